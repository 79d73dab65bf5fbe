//! AVX-512 (F/BW/VL/VNNI) kernels.
//!
//! Owns: the kernels where AVX-512 pays over the AVX2 tier. Today: the Q8_0-activation dots
//! (Q8_0, Q5_0 weights) with VNNI `vpdpbusd` doing the u8 x i8 -> i32 step in one
//! instruction; its i32 lanes equal AVX2's maddubs + madd exactly, so results are
//! bit-identical to the AVX2 tier. Other formats use the AVX2 kernels.
//! Every function here is a `#[target_feature]` fn: callers must hold the `Avx512` token.

use core::arch::x86_64::*;

use super::avx2::{decode_q5_0, decode_q8_0, hsum8, ld256_i8};
use crate::formats::{Q5_0_BYTES, Q8_0_BYTES};

crate::q8_like_kernel!(
    dot_q8_0,
    Q8_0_BYTES,
    decode_q8_0,
    "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni",
    |a, s| _mm256_dpbusd_epi32(_mm256_setzero_si256(), a, s)
);
crate::q8_like_kernel!(
    dot_q5_0,
    Q5_0_BYTES,
    decode_q5_0,
    "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni",
    |a, s| _mm256_dpbusd_epi32(_mm256_setzero_si256(), a, s)
);
