//! `tp perplexity`: mean negative log-likelihood and perplexity of a text file, in windows of
//! --window tokens (each window starts with an empty cache; its first token is not scored).

use crate::model_run::{run_model, ModelArgs};
use anyhow::{bail, Context};
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Instant;
use tp_engine::{ChunkSpec, Command};

#[derive(clap::Args, Clone, Debug)]
pub struct PerplexityArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Tokens per window.
    #[arg(long, default_value_t = 512)]
    pub window: usize,
    /// Score at most this many tokens of the file (0 = all).
    #[arg(long, default_value_t = 0)]
    pub max_tokens: usize,
    /// UTF-8 text file.
    pub file: PathBuf,
}

/// Rows of logits gathered per forward pass (bounds memory: rows x vocab floats).
const ROWS_PER_PASS: usize = 128;

pub fn run(args: &PerplexityArgs) -> anyhow::Result<ExitCode> {
    let text = std::fs::read(&args.file)
        .with_context(|| format!("cannot read {}", args.file.display()))?;
    let text = String::from_utf8(text).map_err(|e| {
        anyhow::anyhow!(
            "{} is not UTF-8 text (invalid byte at offset {})",
            args.file.display(),
            e.utf8_error().valid_up_to()
        )
    })?;
    if text.trim().is_empty() {
        bail!("{} is empty; give a text to score", args.file.display());
    }
    if args.window < 2 {
        bail!("--window must be at least 2 tokens");
    }
    let out = run_model(&args.model, |s| {
        let mut ids = s.tokenizer.encode(&text)?;
        if args.max_tokens > 0 {
            ids.truncate(args.max_tokens);
        }
        let window = args.window.min(s.ctx_size);
        if window < 2 {
            bail!("--ctx-size must be at least 2 tokens to score anything");
        }
        let vocab = s.worker.model().config().vocab;
        let start = Instant::now();
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
                    .context("forward returned no logits")?; // [part.len(), vocab]
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
        if scored == 0 {
            bail!("the text has fewer than 2 tokens; nothing to score");
        }
        let mean = nll / scored as f64;
        let secs = start.elapsed().as_secs_f64();
        println!(
            "{scored} tokens scored in windows of {window}: mean NLL {mean:.4} nats, perplexity {:.3}",
            mean.exp()
        );
        if !args.model.quiet {
            eprintln!(
                "# {:.1} s ({:.1} tokens/s)",
                secs,
                ids.len() as f64 / secs.max(1e-9)
            );
        }
        Ok(())
    })?;
    Ok(match out {
        Ok(_) => ExitCode::SUCCESS,
        Err(failed) => failed.into(),
    })
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
