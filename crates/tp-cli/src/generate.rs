//! `tp generate`: one prompt, answered by the model sharded over --tp ranks, streamed to stdout.

use crate::model_run::{run_model, ModelArgs, Session};
use anyhow::{bail, Context};
use std::io::Write;
use std::process::ExitCode;
use tp_engine::{
    generate, Command, FinishReason, Flow, GenerateOptions, GenerationStats, SamplingParams,
    StopMatcher,
};
use tp_tokenizer::ChatMessage;

#[derive(clap::Args, Clone, Debug)]
pub struct SamplingArgs {
    /// Most tokens to generate.
    #[arg(long, default_value_t = 256)]
    pub max_tokens: usize,
    /// Sampling temperature; 0 is greedy.
    #[arg(long, default_value_t = 0.8)]
    pub temperature: f32,
    /// Sample among the k most likely tokens (0 = all).
    #[arg(long, default_value_t = 40)]
    pub top_k: usize,
    /// Sample among the most likely tokens whose probability adds up to p.
    #[arg(long, default_value_t = 0.95)]
    pub top_p: f32,
    /// Random seed: the same seed gives the same text, at every tp.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Greedy decoding (same as --temperature 0).
    #[arg(long)]
    pub greedy: bool,
    /// Stop when this text appears (repeatable); it is not printed.
    #[arg(long)]
    pub stop: Vec<String>,
}

impl SamplingArgs {
    pub fn params(&self) -> SamplingParams {
        SamplingParams {
            temperature: if self.greedy { 0.0 } else { self.temperature },
            top_k: self.top_k,
            top_p: self.top_p,
            seed: self.seed,
        }
    }
}

#[derive(clap::Args, Clone, Debug)]
pub struct GenerateArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    #[command(flatten)]
    pub sampling: SamplingArgs,
    /// Wrap the prompt in the model's chat template as a user message.
    #[arg(long)]
    pub chat: bool,
    /// The prompt (text to continue).
    pub prompt: String,
}

pub fn run(args: &GenerateArgs) -> anyhow::Result<ExitCode> {
    if args.prompt.trim().is_empty() {
        bail!("the prompt is empty; give some text to continue, e.g. tp generate \"Once upon a time\"");
    }
    args.sampling.params().validate()?;
    let out = run_model(&args.model, |s| {
        // A --chat prompt is message text: special-token text in it stays plain text. Without
        // --chat the prompt is raw model input, special tokens included (as /v1/completions).
        let ids = if args.chat {
            s.tokenizer
                .encode_chat(&[ChatMessage::new("user", args.prompt.clone())], true)?
        } else {
            s.tokenizer.encode(&args.prompt)?
        };
        let reply = stream_reply(s, 0, &ids, &args.sampling, &mut std::io::stdout())?;
        let _ = s.worker.submit(Command::Close { slot: 0 });
        println!();
        if !args.model.quiet {
            report(&reply);
        }
        Ok(())
    })?;
    Ok(match out {
        Ok(_) => ExitCode::SUCCESS,
        Err(code) => code,
    })
}

/// Opens `slot` if needed, generates after `ids` (of which the slot may already hold a
/// prefix), and writes the text to `out` as it comes. The generated tokens stay in the
/// slot's cache (all but the last, which was never fed).
pub fn stream_reply(
    s: &mut Session,
    slot: u32,
    ids: &[u32],
    sampling: &SamplingArgs,
    out: &mut dyn Write,
) -> anyhow::Result<Reply> {
    if ids.is_empty() {
        bail!("the prompt has no tokens");
    }
    if ids.len() >= s.ctx_size {
        bail!(
            "the prompt has {} tokens but the context holds {}; shorten it or raise --ctx-size",
            ids.len(),
            s.ctx_size
        );
    }
    if s.worker.capacity(slot) == 0 {
        s.worker.submit(Command::Open {
            slot,
            capacity: s.ctx_size as u32,
        })?;
    }
    let cached = s.worker.cached_len(slot);
    let opts = GenerateOptions {
        max_tokens: sampling.max_tokens,
        eos_ids: s.tokenizer.eos_ids().to_vec(),
        sampling: sampling.params(),
    };
    let mut stream = s.tokenizer.stream();
    let mut stop = StopMatcher::new(&sampling.stop);
    let mut text = String::new();
    let mut failure: Option<anyhow::Error> = None;
    let mut emit = |piece: &str, text: &mut String| -> std::io::Result<()> {
        text.push_str(piece);
        out.write_all(piece.as_bytes())?;
        out.flush()
    };
    let (tokens, stats) = generate(&mut s.worker, slot, &ids[cached..], &opts, |token| {
        let step = (|| -> anyhow::Result<()> {
            if let Some(piece) = stream.push(token)? {
                let shown = stop.push(&piece);
                emit(&shown, &mut text).context("cannot write the output")?;
            }
            Ok(())
        })();
        match step {
            Err(e) => {
                failure = Some(e);
                Flow::Stop
            }
            Ok(()) if stop.is_stopped() => Flow::Stop,
            Ok(()) => Flow::Continue,
        }
    })?;
    if let Some(e) = failure {
        return Err(e);
    }
    if let Some(piece) = stream.finish()? {
        let shown = stop.push(&piece);
        emit(&shown, &mut text)?;
    }
    let rest = stop.finish();
    emit(&rest, &mut text)?;
    Ok(Reply {
        stats,
        text,
        tokens,
    })
}

/// One generated answer.
pub struct Reply {
    pub stats: GenerationStats,
    pub text: String,
    /// Generated token ids (end-of-sequence excluded).
    pub tokens: Vec<u32>,
}

pub fn report(reply: &Reply) {
    let s = &reply.stats;
    let why = match s.finish {
        FinishReason::Eos => "end of sequence",
        FinishReason::Length => "length",
        FinishReason::Stop => "stop sequence",
    };
    eprintln!(
        "# prompt: {} tokens in {:.3} s ({:.1} tok/s); generated: {} tokens in {:.3} s ({:.1} tok/s); stopped by {why}",
        s.prompt_tokens,
        s.prefill.as_secs_f64(),
        s.prefill_tokens_per_s(),
        s.generated_tokens,
        s.decode.as_secs_f64(),
        s.decode_tokens_per_s(),
    );
}
