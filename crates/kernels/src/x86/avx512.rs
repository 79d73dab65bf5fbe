//! AVX-512 kernels.
