//! `tp perplexity`: mean negative log-likelihood and perplexity of a text file, in windows of
//! --window tokens (each window starts with an empty cache; its first token is not scored;
//! the scoring is tp-engine's `perplexity`).

use crate::model_run::{run_model, ModelArgs};
use anyhow::{bail, Context};
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Instant;
use tp_engine::perplexity;

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
        let start = Instant::now();
        let score = perplexity::score(s, &ids, window)?;
        let scored = score.scored;
        if scored == 0 {
            bail!("the text has fewer than 2 tokens; nothing to score");
        }
        let mean = score.mean();
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
