//! What each rank read at load: a checkpoint wrapper that adds up the bytes of the file every
//! slice request covers, and the table rank 0 prints (gathered from every rank) of bytes read
//! and load time per rank and host.

use crate::launch::host_of;
use crate::units::show_bytes;
use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;
use tp_comm::{CommExt, Group};
use tp_models::checkpoint::{Storage, TensorMeta};
use tp_models::{Checkpoint, ModelConfig, WeightName, WeightSlice};

/// A checkpoint that counts the file bytes behind every successful slice request.
pub struct Counting<'a> {
    inner: &'a dyn Checkpoint,
    bytes: AtomicU64,
}

impl<'a> Counting<'a> {
    pub fn new(inner: &'a dyn Checkpoint) -> Self {
        Counting {
            inner,
            bytes: AtomicU64::new(0),
        }
    }

    /// File bytes read so far.
    pub fn bytes(&self) -> u64 {
        self.bytes.load(Ordering::Relaxed)
    }

    fn add(&self, b: usize) {
        self.bytes.fetch_add(b as u64, Ordering::Relaxed);
    }
}

/// Bytes of columns `cols` of one row as stored: whole quant blocks around the range.
fn stored_bytes(storage: Storage, cols: &Range<usize>) -> usize {
    let block = storage.block().max(1);
    let start = cols.start / block * block;
    let end = cols.end.div_ceil(block) * block;
    storage.row_bytes(end.saturating_sub(start))
}

impl Checkpoint for Counting<'_> {
    fn config(&self) -> &ModelConfig {
        self.inner.config()
    }
    fn source(&self) -> &str {
        self.inner.source()
    }
    fn meta(&self, name: WeightName) -> tp_models::Result<TensorMeta> {
        self.inner.meta(name)
    }
    fn has(&self, name: WeightName) -> bool {
        self.inner.has(name)
    }
    fn rows(&self, name: WeightName, rows: Range<usize>) -> tp_models::Result<WeightSlice> {
        let out = self.inner.rows(name, rows.clone())?;
        if let Ok(m) = self.inner.meta(name) {
            self.add(rows.len() * stored_bytes(m.storage, &(0..m.cols)));
        }
        Ok(out)
    }
    fn cols(&self, name: WeightName, cols: Range<usize>) -> tp_models::Result<WeightSlice> {
        let out = self.inner.cols(name, cols.clone())?;
        if let Ok(m) = self.inner.meta(name) {
            self.add(m.rows * stored_bytes(m.storage, &cols));
        }
        Ok(out)
    }
    fn vector(&self, name: WeightName, range: Option<Range<usize>>) -> tp_models::Result<Vec<f32>> {
        let out = self.inner.vector(name, range.clone())?;
        if let Ok(m) = self.inner.meta(name) {
            let r = range.unwrap_or(0..m.rows * m.cols);
            self.add(stored_bytes(m.storage, &r));
        }
        Ok(out)
    }
    fn describe(&self, name: WeightName) -> String {
        self.inner.describe(name)
    }
}

/// One rank's load: file bytes read and time taken.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LoadStats {
    pub bytes: u64,
    pub time: Duration,
}

/// Gathers every rank's stats (one all_gather; every rank of `g` calls it) and returns them
/// by rank.
pub fn gather(g: &Group, mine: LoadStats) -> tp_comm::Result<Vec<LoadStats>> {
    let send = [
        mine.bytes,
        u64::try_from(mine.time.as_micros()).unwrap_or(u64::MAX),
    ];
    let mut all = vec![0u64; 2 * g.size()];
    g.all_gather(&send, &mut all)?;
    Ok(all
        .chunks_exact(2)
        .map(|c| LoadStats {
            bytes: c[0],
            time: Duration::from_micros(c[1]),
        })
        .collect())
}

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

    #[test]
    fn stored_bytes_of_plain_floats() {
        assert_eq!(stored_bytes(Storage::Float { bytes: 2 }, &(3..7)), 8);
        assert_eq!(stored_bytes(Storage::Float { bytes: 4 }, &(0..0)), 0);
    }

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
