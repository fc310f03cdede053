//! The table rank 0 prints of what each rank read at load (bytes and time per rank and host,
//! gathered from every rank by tp-engine's `load_stats`).

use crate::launch::host_of;
use crate::units::show_bytes;
pub use tp_engine::load_stats::{gather, Counting, LoadStats};

/// The table rank 0 prints: one line per rank, then the total against the file size.
pub fn table(stats: &[LoadStats], file_bytes: Option<u64>) -> Vec<String> {
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
    use std::time::Duration;

    #[test]
    fn the_table_has_a_line_per_rank_and_a_total() {
        let s = |b, ms| LoadStats {
            bytes: b,
            time: Duration::from_millis(ms),
        };
        let lines = table(&[s(50_000_000, 400), s(49_000_000, 900)], Some(100_000_000));
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
}
