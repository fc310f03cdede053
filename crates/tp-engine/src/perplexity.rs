//! Scoring a text (what `tp perplexity` reports): the mean negative log-likelihood of its
//! tokens in windows (each window starts with an empty cache; its first token is not scored),
//! every row of logits gathered, a bounded number of rows per forward pass.

use crate::error::{EngineError, Result};
use crate::protocol::{ChunkSpec, Command};
use crate::session::Session;

/// Rows of logits gathered per forward pass (bounds memory: rows x vocab floats).
const ROWS_PER_PASS: usize = 128;

/// What a text scored.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Score {
    /// Sum of `-log p(token)` over the scored tokens, nats.
    pub nll: f64,
    pub scored: usize,
}

impl Score {
    pub fn mean(&self) -> f64 {
        self.nll / self.scored as f64
    }
}

/// Scores `ids` in windows of `window` tokens (at least 2) on slot 0 of `s` (not open).
pub fn score(s: &mut Session, ids: &[u32], window: usize) -> Result<Score> {
    if window < 2 {
        return Err(EngineError::Param {
            name: "window",
            message: "it must be at least 2 tokens".into(),
        });
    }
    let vocab = s.worker.model().config().vocab;
    let (mut nll, mut scored) = (0f64, 0usize);
    for win in ids.chunks(window).filter(|w| w.len() >= 2) {
        s.worker.submit(Command::Open {
            slot: 0,
            capacity: win.len() as u32,
        })?;
        for (c, part) in win.chunks(ROWS_PER_PASS).enumerate() {
            let logits = s
                .worker
                .submit(Command::Forward(vec![ChunkSpec {
                    all_logits: true,
                    ..ChunkSpec::new(0, part.to_vec())
                }]))?
                .ok_or_else(|| EngineError::Internal("forward returned no logits".into()))?; // [part.len(), vocab]
            for (i, row) in logits.chunks_exact(vocab).enumerate() {
                let pos = c * ROWS_PER_PASS + i;
                if let Some(&next) = win.get(pos + 1) {
                    nll += negative_log_likelihood(row, next as usize);
                    scored += 1;
                }
            }
        }
        s.worker.submit(Command::Close { slot: 0 })?;
    }
    Ok(Score { nll, scored })
}

/// `-log softmax(row)[target]`, computed in f64.
fn negative_log_likelihood(row: &[f32], target: usize) -> f64 {
    let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let sum: f64 = row.iter().map(|&v| (v as f64 - max).exp()).sum();
    max + sum.ln() - row[target] as f64
}

#[cfg(test)]
mod tests {
    #[test]
    fn nll_of_a_uniform_row_is_log_vocab() {
        let row = [0.5f32; 8];
        assert!((super::negative_log_likelihood(&row, 3) - 8f64.ln()).abs() < 1e-12);
    }
}
