//! Quantized block formats and the CPU kernels over them.
//!
//! Owns: block layouts, a scalar reference for every op (the spec), AVX2 / AVX-512 fast
//! paths chosen once at run time (`SLUICE_ISA=scalar|avx2|avx512` forces a lower tier).
