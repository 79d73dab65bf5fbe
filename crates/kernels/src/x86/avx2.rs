//! AVX2 + FMA + F16C kernels.
