//! Run-time choice of the instruction-set tier.
//!
//! Owns: [`Isa`], the detection of the best tier this CPU supports, and the once-only
//! decision ([`isa()`]) honoring `SLUICE_ISA=scalar|avx2|avx512`, which can only lower
//! the tier (asking for more than the CPU has gives the best available one).

use std::sync::OnceLock;

/// Instruction-set tiers, lowest first.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Isa {
    /// Portable scalar Rust (the reference kernels).
    Scalar,
    /// AVX2 + FMA + F16C.
    Avx2,
    /// AVX-512 F/BW/VL/VNNI on top of the AVX2 tier.
    Avx512,
}

impl Isa {
    /// Every tier, lowest first.
    pub const ALL: [Isa; 3] = [Isa::Scalar, Isa::Avx2, Isa::Avx512];

    /// Lower-case name as accepted by `SLUICE_ISA`.
    pub fn name(self) -> &'static str {
        match self {
            Isa::Scalar => "scalar",
            Isa::Avx2 => "avx2",
            Isa::Avx512 => "avx512",
        }
    }

    /// Parse a `SLUICE_ISA` value (case-insensitive).
    pub fn from_name(s: &str) -> Option<Isa> {
        Isa::ALL
            .into_iter()
            .find(|i| i.name().eq_ignore_ascii_case(s.trim()))
    }

    /// Whether this CPU can run the tier (checked through the tier's token constructor).
    pub fn is_available(self) -> bool {
        match self {
            Isa::Scalar => true,
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => crate::x86::Avx2::new().is_some(),
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 => crate::x86::Avx512::new().is_some(),
            #[cfg(not(target_arch = "x86_64"))]
            _ => false,
        }
    }

    /// The tiers this CPU supports, lowest first.
    pub fn available() -> Vec<Isa> {
        Isa::ALL.into_iter().filter(|i| i.is_available()).collect()
    }

    /// The best tier this CPU supports.
    pub fn best() -> Isa {
        Isa::available().pop().unwrap_or(Isa::Scalar)
    }
}

/// The tier used by [`crate::matvec`] & co, decided once per process: the best available,
/// lowered to `SLUICE_ISA` when that names a lower tier (unknown values are ignored).
pub fn isa() -> Isa {
    static CHOSEN: OnceLock<Isa> = OnceLock::new();
    *CHOSEN.get_or_init(|| {
        let best = Isa::best();
        match std::env::var("SLUICE_ISA")
            .ok()
            .and_then(|v| Isa::from_name(&v))
        {
            Some(req) => req.min(best),
            None => best,
        }
    })
}
