//! Sizes derived from user input or file contents, computed with checked arithmetic and
//! compared with the machine's memory before anything is allocated (docs/reliability.md R4).
//!
//! A size that cannot be held is a [`ModelError::TooLarge`] naming the value and the bytes it
//! would take, never an allocation that aborts the process or a multiplication that wraps.

use crate::error::{ModelError, Result};

/// The product of `factors` in bytes, in u128 so that no product of a few u64s overflows
/// silently (`None`: more than 2^128).
pub fn product(factors: &[u64]) -> Option<u128> {
    factors
        .iter()
        .try_fold(1u128, |acc, &f| acc.checked_mul(u128::from(f)))
}

/// Total memory of this machine in bytes (`MemTotal` of `/proc/meminfo`), or `None` where it
/// cannot be read.
pub fn physical_memory() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemTotal:"))?;
    let kib: u64 = line
        .trim_start_matches("MemTotal:")
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .ok()?;
    kib.checked_mul(1024)
}

/// The most bytes one allocation plan may claim: the machine's memory, and never more than
/// the address space (`isize::MAX`, Rust's limit on one allocation).
pub fn memory_limit() -> u64 {
    let space = isize::MAX as u64;
    physical_memory().map_or(space, |m| m.min(space))
}

/// Refuses `bytes` (`None`: too large to compute) for `what` = `value` when it exceeds
/// `limit`; `hint` says what to change.
pub fn check_bytes(
    what: &str,
    value: impl std::fmt::Display,
    bytes: Option<u128>,
    limit: u64,
    hint: &'static str,
) -> Result<u64> {
    match bytes {
        Some(b) if b <= u128::from(limit) => Ok(b as u64),
        _ => Err(ModelError::TooLarge {
            what: what.to_string(),
            value: value.to_string(),
            cost: format!(
                "{}, more than the {} this machine has",
                show(bytes),
                show(Some(u128::from(limit)))
            ),
            hint,
        }),
    }
}

/// Refuses a context of `ctx` positions for `cfg` when one sequence's KV cache (all KV
/// heads, as at tp 1) would exceed the machine's memory: what a context length
/// from a file or the user costs (an f32 cache, the largest), checked before anything is
/// allocated.
pub fn check_context(cfg: &crate::ModelConfig, ctx: usize) -> Result<u64> {
    let hint = "ask for a shorter context";
    let limit = memory_limit();
    let kv = crate::KvPool::checked_bytes_for(
        cfg.layers,
        cfg.kv_heads,
        cfg.head_dim,
        ctx,
        crate::KvDtype::F32,
    );
    check_bytes("a KV cache for a context length of", ctx, kv, limit, hint)
}

/// `1234 bytes (1.2 KiB)`, or "more than 2^128 bytes".
pub fn show(bytes: Option<u128>) -> String {
    let Some(b) = bytes else {
        return "more than 2^128 bytes".into();
    };
    const UNITS: [&str; 7] = ["KiB", "MiB", "GiB", "TiB", "PiB", "EiB", "ZiB"];
    let mut v = b as f64;
    let mut unit = "";
    for u in UNITS {
        if v < 1024.0 {
            break;
        }
        v /= 1024.0;
        unit = u;
    }
    if unit.is_empty() {
        format!("{b} bytes")
    } else {
        format!("{b} bytes ({v:.1} {unit})")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn products_and_refusals() {
        assert_eq!(product(&[2, 3, 4]), Some(24));
        assert_eq!(product(&[u64::MAX, u64::MAX, 2]), None);
        assert_eq!(check_bytes("x", 1, Some(10), 10, "").unwrap(), 10);
        let e = check_bytes("context", 7, Some(11), 10, "lower it").unwrap_err();
        let m = e.to_string();
        assert!(
            m.contains("context 7") && m.contains("11 bytes") && m.contains("lower it"),
            "{m}"
        );
        let e = check_bytes("context", u64::MAX, None, 10, "").unwrap_err();
        assert!(e.to_string().contains("more than 2^128 bytes"), "{e}");
        assert!(show(Some(3 << 30)).contains("3.0 GiB"));
    }
}
