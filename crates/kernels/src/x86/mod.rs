//! x86-64 fast paths, reached only through CPU-checked token types.
//!
//! Owns: [`Avx2`] and [`Avx512`], zero-sized proofs that the CPU has the tier's features
//! (their only constructors check with `is_x86_feature_detected!`), and the safe methods
//! on them that call the `#[target_feature]` kernels in `avx2.rs` / `avx512.rs`. Holding a
//! token is what makes calling those kernels sound.

#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod avx512;

#[cfg(target_arch = "x86_64")]
pub use tokens::*;

#[cfg(target_arch = "x86_64")]
mod tokens {
    use crate::{ActData, GgmlType, QuantizedActs};

    /// Proof that the CPU has AVX2, FMA and F16C.
    #[derive(Clone, Copy, Debug)]
    pub struct Avx2 {
        _private: (),
    }

    impl Avx2 {
        /// `Some` only when the CPU has AVX2 + FMA + F16C.
        pub fn new() -> Option<Avx2> {
            (is_x86_feature_detected!("avx2")
                && is_x86_feature_detected!("fma")
                && is_x86_feature_detected!("f16c"))
            .then_some(Avx2 { _private: () })
        }
    }

    /// Proof that the CPU has the AVX2 tier plus AVX-512 F/BW/VL/VNNI.
    #[derive(Clone, Copy, Debug)]
    pub struct Avx512 {
        _private: (),
    }

    impl Avx512 {
        /// `Some` only when the CPU has the AVX2 tier and AVX-512 F, BW, VL and VNNI.
        pub fn new() -> Option<Avx512> {
            (Avx2::new().is_some()
                && is_x86_feature_detected!("avx512f")
                && is_x86_feature_detected!("avx512bw")
                && is_x86_feature_detected!("avx512vl")
                && is_x86_feature_detected!("avx512vnni"))
            .then_some(Avx512 { _private: () })
        }

        /// The AVX2 token (AVX-512 implies it).
        pub fn avx2(self) -> Avx2 {
            Avx2 { _private: () }
        }
    }

    impl Avx2 {
        pub(crate) fn dot_tile(
            self,
            ty: GgmlType,
            row: &[u8],
            acts: &[&QuantizedActs],
            out: &mut [f32],
        ) {
            let _ = self;
            for (o, a) in out.iter_mut().zip(acts) {
                *o = crate::ref_dot(ty, row, a);
            }
            let _ = ActData::F32(Vec::new());
        }
    }

    impl Avx512 {
        pub(crate) fn dot_tile(
            self,
            ty: GgmlType,
            row: &[u8],
            acts: &[&QuantizedActs],
            out: &mut [f32],
        ) {
            self.avx2().dot_tile(ty, row, acts, out)
        }
    }
}
