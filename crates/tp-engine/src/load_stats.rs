//! What each rank read at load: a checkpoint wrapper that adds up the bytes of the file every
//! slice request covers, and the gathering of every rank's bytes and load time (rank 0
//! prints them; the CLI's `load_report` words the table).

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
    fn release_pages(&self) {
        self.inner.release_pages()
    }
    fn mapped_rows(
        &self,
        name: WeightName,
        rows: Range<usize>,
    ) -> tp_models::Result<Option<(tp_models::checkpoint::GgmlDType, &[u8])>> {
        let out = self.inner.mapped_rows(name, rows)?;
        if let Some((_, bytes)) = out {
            self.add(bytes.len());
        }
        Ok(out)
    }
    fn release_bytes(&self, bytes: &[u8]) {
        self.inner.release_bytes(bytes)
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stored_bytes_of_plain_floats() {
        assert_eq!(stored_bytes(Storage::Float { bytes: 2 }, &(3..7)), 8);
        assert_eq!(stored_bytes(Storage::Float { bytes: 4 }, &(0..0)), 0);
    }
}
