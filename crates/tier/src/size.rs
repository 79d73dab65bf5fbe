//! Byte sizes given on the command line: `4G`, `512MiB`, `1.5GB`, `123456`, `25%`.
//!
//! Owns: [`parse_size`] and [`SizeSpec`]. Units: `K M G T` and `KiB MiB GiB TiB` are
//! binary (powers of 1024), `KB MB GB TB` are decimal (powers of 1000), `B` or no unit is
//! bytes. Case-insensitive. A percentage is relative to a total the caller supplies (for
//! cache budgets: the model's total routed-expert bytes).

use thiserror::Error;

/// A parsed size: absolute bytes, or a percentage of a total known later.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum SizeSpec {
    Bytes(u64),
    /// 0.0 ..= 100.0
    Percent(f64),
}

#[derive(Debug, Error, PartialEq)]
pub enum SizeError {
    #[error("bad size {input:?}: {why} (expected e.g. 4G, 512MiB, 1.5GB, 123456 or 25%)")]
    Invalid { input: String, why: &'static str },
    #[error("size {input:?} is a percentage, but no total is known to take it of")]
    NoTotal { input: String },
}

impl SizeSpec {
    /// Resolves to bytes; a percentage is taken of `total` (rounded down).
    pub fn resolve(self, total: u64) -> u64 {
        match self {
            SizeSpec::Bytes(b) => b,
            SizeSpec::Percent(p) => ((total as f64) * p / 100.0).floor() as u64,
        }
    }
}

/// Parses a size such as `4G`, `512MiB`, `1.5GB`, `123456` or `25%`.
pub fn parse_size(input: &str) -> Result<SizeSpec, SizeError> {
    let bad = |why| SizeError::Invalid {
        input: input.to_string(),
        why,
    };
    let s = input.trim();
    if let Some(num) = s.strip_suffix('%') {
        let p: f64 = num
            .trim()
            .parse()
            .map_err(|_| bad("not a number before %"))?;
        if !p.is_finite() || !(0.0..=100.0).contains(&p) {
            return Err(bad("percentage must be between 0 and 100"));
        }
        return Ok(SizeSpec::Percent(p));
    }
    let split = s
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(s.len());
    let (num, unit) = s.split_at(split);
    if num.is_empty() {
        return Err(bad("no number"));
    }
    let mult: u64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kib" => 1 << 10,
        "m" | "mib" => 1 << 20,
        "g" | "gib" => 1 << 30,
        "t" | "tib" => 1 << 40,
        "kb" => 1_000,
        "mb" => 1_000_000,
        "gb" => 1_000_000_000,
        "tb" => 1_000_000_000_000,
        _ => return Err(bad("unknown unit")),
    };
    if let Ok(n) = num.parse::<u64>() {
        return n
            .checked_mul(mult)
            .map(SizeSpec::Bytes)
            .ok_or(bad("too large"));
    }
    let x: f64 = num.parse().map_err(|_| bad("not a number"))?;
    let bytes = x * mult as f64;
    if !bytes.is_finite() || bytes >= u64::MAX as f64 {
        return Err(bad("too large"));
    }
    Ok(SizeSpec::Bytes(bytes.floor() as u64))
}

/// Parses and resolves in one step; a percentage needs `total`.
pub fn parse_size_bytes(input: &str, total: Option<u64>) -> Result<u64, SizeError> {
    match (parse_size(input)?, total) {
        (spec @ SizeSpec::Percent(_), Some(t)) => Ok(spec.resolve(t)),
        (SizeSpec::Percent(_), None) => Err(SizeError::NoTotal {
            input: input.to_string(),
        }),
        (SizeSpec::Bytes(b), _) => Ok(b),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn units() {
        // Expected values are the unit definitions in the module doc, computed by hand.
        assert_eq!(
            parse_size("4G"),
            Ok(SizeSpec::Bytes(4 * 1024 * 1024 * 1024))
        );
        assert_eq!(parse_size("512MiB"), Ok(SizeSpec::Bytes(536_870_912)));
        assert_eq!(parse_size("2gb"), Ok(SizeSpec::Bytes(2_000_000_000)));
        assert_eq!(parse_size("1.5K"), Ok(SizeSpec::Bytes(1536)));
        assert_eq!(parse_size(" 123 "), Ok(SizeSpec::Bytes(123)));
        assert_eq!(parse_size("7B"), Ok(SizeSpec::Bytes(7)));
        assert_eq!(parse_size("25%"), Ok(SizeSpec::Percent(25.0)));
        assert_eq!(parse_size("25%").unwrap().resolve(1000), 250);
        assert_eq!(parse_size_bytes("10%", Some(999)), Ok(99));
    }

    #[test]
    fn rejects_garbage() {
        for s in [
            "",
            "G",
            "4X",
            "-1",
            "101%",
            "abc%",
            "1.2.3M",
            "99999999999999999999T",
            "nan",
            "%",
        ] {
            assert!(parse_size(s).is_err(), "{s:?} should be rejected");
        }
        assert!(matches!(
            parse_size_bytes("5%", None),
            Err(SizeError::NoTotal { .. })
        ));
    }
}
