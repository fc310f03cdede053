//! How the engine words things for people: an error with its causes (once each), byte sizes
//! ("300MB" in, "98.4 MB" out) and the table of what each rank read at load.
//!
//! The project's convention (ARCHITECTURE.md, "Errors"): a library error's message may quote
//! its cause so that it reads completely on its own (in an HTTP body, a log line); such a
//! variant does not also return that cause from `source()`. Context layers added by callers are
//! the only layers [`chain`] walks, and a cause whose text the line already holds (a context
//! that formats its error in) is skipped rather than printed twice.

use crate::load_stats::LoadStats;
use tp_comm::launch::host_of;

pub use tp_comm::error::chain;

/// Parses a byte count with an optional unit: B, kB/MB/GB/TB (powers of 1000) or
/// KiB/MiB/GiB/TiB (powers of 1024); case-insensitive, fractions allowed ("1.5GB").
pub fn parse_bytes(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let value: f64 = num
        .parse()
        .map_err(|_| format!("{s:?} is not a size; write e.g. 512MB, 2GiB or 1048576"))?;
    let scale: f64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1.0,
        "k" | "kb" => 1e3,
        "m" | "mb" => 1e6,
        "g" | "gb" => 1e9,
        "t" | "tb" => 1e12,
        "kib" => 1024.0,
        "mib" => 1024.0 * 1024.0,
        "gib" => 1024.0 * 1024.0 * 1024.0,
        "tib" => 1024.0 * 1024.0 * 1024.0 * 1024.0,
        other => {
            return Err(format!(
                "unknown size unit {other:?} in {s:?}; use B, MB, GB, MiB or GiB"
            ))
        }
    };
    let bytes = value * scale;
    if !bytes.is_finite() || bytes < 1.0 || bytes > u64::MAX as f64 {
        return Err(format!("{s:?} is not a usable size"));
    }
    Ok(bytes as u64)
}

/// `123.4 MB` style (powers of 1000, as disk and RAM vendors count).
pub fn show_bytes(b: u64) -> String {
    let b = b as f64;
    if b >= 1e9 {
        format!("{:.2} GB", b / 1e9)
    } else if b >= 1e6 {
        format!("{:.1} MB", b / 1e6)
    } else if b >= 1e3 {
        format!("{:.1} kB", b / 1e3)
    } else {
        format!("{b} B")
    }
}

/// The table rank 0 prints: one line per rank, then the total against the file size.
pub fn load_table(stats: &[LoadStats], file_bytes: Option<u64>) -> Vec<String> {
    let hosts: Vec<String> = (0..stats.len()).map(host_of).collect();
    let w = hosts.iter().map(String::len).max().unwrap_or(4).max(4);
    let mut lines = vec![format!(
        "load  rank  {:<w$}  {:>10}  {:>8}",
        "host", "read", "time"
    )];
    for (r, (s, h)) in stats.iter().zip(&hosts).enumerate() {
        lines.push(format!(
            "      {r:>4}  {h:<w$}  {:>10}  {:>6.2} s",
            show_bytes(s.bytes),
            s.time.as_secs_f64()
        ));
    }
    let total: u64 = stats.iter().map(|s| s.bytes).sum();
    let slowest = stats.iter().map(|s| s.time).max().unwrap_or_default();
    let file = file_bytes.map_or(String::new(), |f| format!(" (the file: {})", show_bytes(f)));
    lines.push(format!(
        "load: {} read by {} ranks{file}; slowest rank {:.2} s",
        show_bytes(total),
        stats.len(),
        slowest.as_secs_f64()
    ));
    lines
}

#[cfg(test)]
mod tests {
    use super::*;
    use anyhow::Context;
    use std::time::Duration;

    #[test]
    fn sizes_parse_with_units() {
        assert_eq!(parse_bytes("1048576"), Ok(1_048_576));
        assert_eq!(parse_bytes("300MB"), Ok(300_000_000));
        assert_eq!(parse_bytes("2GiB"), Ok(2 << 30));
        assert_eq!(parse_bytes("1.5 gb"), Ok(1_500_000_000));
        assert!(parse_bytes("lots").is_err());
        assert!(parse_bytes("5 parsecs").is_err());
        assert!(parse_bytes("0").is_err());
        assert_eq!(show_bytes(98_362_432), "98.4 MB");
    }

    #[test]
    fn the_table_has_a_line_per_rank_and_a_total() {
        let s = |b, ms| LoadStats {
            bytes: b,
            time: Duration::from_millis(ms),
        };
        let lines = load_table(&[s(50_000_000, 400), s(49_000_000, 900)], Some(100_000_000));
        assert_eq!(lines.len(), 4, "{lines:?}");
        assert!(
            lines[1].contains("50.0 MB") && lines[1].contains("0.40 s"),
            "{lines:?}"
        );
        assert!(
            lines[3].contains("99.0 MB read by 2 ranks (the file: 100.0 MB)"),
            "{lines:?}"
        );
        assert!(lines[3].contains("slowest rank 0.90 s"), "{lines:?}");
    }

    /// A message that quotes its cause and also returns it from `source()` (what the
    /// convention rules out, and what some foreign errors do).
    #[derive(Debug)]
    struct Embeds {
        source: std::io::Error,
    }

    impl std::fmt::Display for Embeds {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            write!(f, "cannot read model.gguf: {}; check the path", self.source)
        }
    }

    impl std::error::Error for Embeds {
        fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
            Some(&self.source)
        }
    }

    fn missing() -> std::io::Error {
        std::io::Error::new(std::io::ErrorKind::NotFound, "No such file or directory")
    }

    #[test]
    fn every_cause_once() {
        let e = Err::<(), _>(missing())
            .context("cannot open the tokenizer file tok.json")
            .context("cannot load the tokenizer of m.gguf")
            .unwrap_err();
        assert_eq!(
            chain(e.as_ref()),
            "cannot load the tokenizer of m.gguf: cannot open the tokenizer file tok.json: No such file or directory"
        );
    }

    #[test]
    fn an_embedded_cause_is_not_repeated() {
        let e = Err::<(), _>(Embeds { source: missing() })
            .context("cannot load the model m.gguf")
            .unwrap_err();
        let line = chain(e.as_ref());
        assert_eq!(
            line.matches("No such file or directory").count(),
            1,
            "{line}"
        );
        assert!(
            line.starts_with("cannot load the model m.gguf: cannot read model.gguf"),
            "{line}"
        );
    }
}
