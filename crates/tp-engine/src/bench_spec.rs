//! Speculative decoding's benchmark (what `tp bench decode --spec` reports per tp): the same
//! greedy generation through the one generation loop without and with speculation, runs
//! alternated, medians of decode speed, the acceptance rate and tokens per target step; and
//! what a verification step costs against a one-token step (the many-token path's price of
//! each extra row), which bounds what any drafter can gain.
//!
//! The workload is input-grounded: the prompt hands the model a piece of code and asks for it
//! back with one identifier renamed (chat template when the model has one), so most of the
//! answer quotes the prompt, as editing and summarising work does.

use crate::bench::BenchError;
use crate::candidates::{force_gather, RowNeed, StepLogits};
use crate::decoder::{DecodeParams, SequenceDecoder};
use crate::draft_model::DraftModelSource;
use crate::error::{EngineError, Result};
use crate::generate::{generate, Flow};
use crate::protocol::{ChunkSpec, Command};
use crate::session::Session;
use crate::spec::{DraftAhead, DraftTokens, SpecMethod, SpecStats, Speculator};
use std::path::PathBuf;
use std::time::Instant;
use tp_models::LoadOptions;
use tp_tokenizer::ChatMessage;

/// The code the edit workload quotes.
pub const EDIT_SOURCE: &str = r#"def summarize(records, key):
    totals = {}
    counts = {}
    for record in records:
        value = record.get(key)
        if value is None:
            continue
        name = record["name"]
        totals[name] = totals.get(name, 0) + value
        counts[name] = counts.get(name, 0) + 1
    result = []
    for name in sorted(totals):
        average = totals[name] / counts[name]
        result.append({"name": name, "total": totals[name], "average": average})
    return result


def top_entries(records, key, limit):
    rows = summarize(records, key)
    rows.sort(key=lambda row: row["total"], reverse=True)
    return rows[:limit]
"#;

/// The edit workload's prompt: the code and the instruction, in the model's chat format.
pub fn edit_prompt(tok: &tp_tokenizer::Tokenizer) -> std::result::Result<Vec<u32>, BenchError> {
    let message = format!(
        "Rename the variable `records` to `entries` everywhere in this Python code and print the whole code, changing nothing else:\n\n```python\n{EDIT_SOURCE}```"
    );
    tok.encode_chat(&[ChatMessage::new("user", message)], true)
        .map_err(BenchError::Prompt)
}

/// Who drafts in a speculative measurement.
#[derive(Clone, Debug)]
pub enum BenchDrafter {
    Method(SpecMethod),
    /// A draft model, whole on rank 0 ([`crate::draft_model::ModelDrafter`]).
    Model {
        path: PathBuf,
        opts: LoadOptions,
    },
}

impl BenchDrafter {
    fn name(&self) -> String {
        match self {
            BenchDrafter::Method(SpecMethod::Ngram) => "ngram".into(),
            BenchDrafter::Model { path, .. } => format!(
                "draft model {}",
                path.file_name().map_or(path.display().to_string(), |n| n
                    .to_string_lossy()
                    .into_owned())
            ),
        }
    }
}

/// What one speculative measurement runs.
#[derive(Clone, Debug)]
pub struct SpecBench {
    pub drafter: BenchDrafter,
    pub tokens: DraftTokens,
    /// Tokens generated per run (greedy, end-of-sequence ignored).
    pub gen_tokens: usize,
    /// Measured runs of each kind after one warm-up of each; medians are reported.
    pub repeats: usize,
    /// Drafting ahead during verification ([`Speculator::draft_ahead`]), resolved against
    /// `ranks_here`, the rank threads of this process.
    pub ahead: DraftAhead,
    pub ranks_here: usize,
}

/// One tp's figures (medians).
#[derive(Clone, Debug)]
pub struct SpecFigures {
    pub tp: usize,
    pub prompt_tokens: usize,
    /// Decode tokens/s without speculation.
    pub plain_tok_s: f64,
    /// Decode tokens/s with it.
    pub spec_tok_s: f64,
    pub stats: SpecStats,
    /// Generated tokens (after the first) per target decode step.
    pub tokens_per_step: f64,
    /// `(k, ms)`: a step of `1 + k` tokens (every row's top candidate) over the prompt's cache.
    pub verify_ms: Vec<(usize, f64)>,
    /// Whether the speculative runs drafted ahead during verification.
    pub ahead: bool,
    /// Per target decode step of the speculative run: drafting (not ahead), and the
    /// target's step (with drafting ahead beside it).
    pub draft_ms: f64,
    pub target_ms: f64,
}

impl SpecFigures {
    pub fn speedup(&self) -> f64 {
        self.spec_tok_s / self.plain_tok_s
    }
}

/// Measures `s` on the edit workload.
pub fn measure_spec(
    s: &mut Session,
    b: &SpecBench,
) -> std::result::Result<SpecFigures, BenchError> {
    let tp = s.weights.tp();
    let ids = edit_prompt(&s.tokenizer)?;
    let mut spec = match &b.drafter {
        BenchDrafter::Method(m) => Speculator::for_method(*m, b.tokens),
        BenchDrafter::Model { path, opts } => {
            // Bounded as the session's preflight planned (when it was told of the draft).
            let d = DraftModelSource::for_session(path, s, *opts)?.sequence();
            Speculator::new(Box::new(d), b.tokens)
        }
    };
    let cores = std::thread::available_parallelism().map_or(1, usize::from);
    spec.set_draft_ahead(
        b.ahead
            .resolve(spec.drafter_is_costly(), b.ranks_here, cores),
    );
    let ahead = spec.drafts_ahead();
    let run_err = |run: usize| move |source: EngineError| BenchError::Run { run, tp, source };
    let mut plain = Vec::new();
    let mut fast = Vec::new();
    let mut last_stats = SpecStats::default();
    let mut tokens_per_step = Vec::new();
    for run in 0..=b.repeats {
        let (p, _, _) = one_run(s, &ids, b.gen_tokens, None).map_err(run_err(run))?;
        let (f, stats, steps) =
            one_run(s, &ids, b.gen_tokens, Some(&mut spec)).map_err(run_err(run))?;
        if run > 0 {
            plain.push(p);
            fast.push(f);
            last_stats = stats;
            tokens_per_step.push((b.gen_tokens - 1) as f64 / steps.max(1) as f64);
        }
    }
    let verify_ms = verify_cost(s, &ids, &[0, 1, 2, 4, 8, 16]).map_err(run_err(0))?;
    Ok(SpecFigures {
        tp,
        prompt_tokens: ids.len(),
        plain_tok_s: median(plain),
        spec_tok_s: median(fast),
        stats: last_stats,
        tokens_per_step: median(tokens_per_step),
        verify_ms,
        ahead,
        draft_ms: last_stats.draft_s * 1e3 / last_stats.steps.max(1) as f64,
        target_ms: last_stats.target_s * 1e3 / last_stats.steps.max(1) as f64,
    })
}

/// One greedy generation of `gen` tokens after `ids` on slot 0: decode tokens/s, the
/// speculation counts and the decode steps.
fn one_run(
    s: &mut Session,
    ids: &[u32],
    gen: usize,
    mut spec: Option<&mut Speculator>,
) -> Result<(f64, SpecStats, usize)> {
    s.worker.submit(Command::Open {
        slot: 0,
        capacity: (ids.len() + gen) as u32,
    })?;
    let params = DecodeParams {
        ignore_eos: true,
        ..DecodeParams::greedy(gen)
    };
    let mut decoder = SequenceDecoder::new(&s.tokenizer, params)?;
    if let Some(sp) = spec.as_deref_mut() {
        sp.start(&[], ids);
    }
    let g = generate(
        &mut s.worker,
        0,
        ids,
        &mut decoder,
        spec.as_deref_mut(),
        |_| Flow::Continue,
    );
    s.worker.submit(Command::Close { slot: 0 })?;
    let g = g?;
    let stats = spec.map(|sp| sp.stats).unwrap_or_default();
    Ok((g.decode_tokens_per_s(), stats, g.decode_steps))
}

/// Median time of a step of `1 + k` tokens (every row's top candidate) after `ids`, for each `k`.
fn verify_cost(s: &mut Session, ids: &[u32], ks: &[usize]) -> Result<Vec<(usize, f64)>> {
    let max_k = ks.iter().copied().max().unwrap_or(0);
    s.worker.submit(Command::Open {
        slot: 0,
        capacity: (ids.len() + 1 + max_k) as u32,
    })?;
    let out = (|| {
        forward(s, ids.to_vec(), false)?;
        let mut out = Vec::new();
        for &k in ks {
            let tokens: Vec<u32> = ids.iter().cycle().take(1 + k).copied().collect();
            let mut times = Vec::new();
            for _ in 0..7 {
                let t = Instant::now();
                forward(s, tokens.clone(), k > 0)?;
                times.push(t.elapsed().as_secs_f64() * 1e3);
                s.worker.submit(Command::Truncate {
                    slot: 0,
                    len: ids.len() as u32,
                })?;
            }
            out.push((k, median(times)));
        }
        Ok(out)
    })();
    s.worker.submit(Command::Close { slot: 0 })?;
    out
}

/// One step's rows as greedy decoding asks for them: each rank's top candidate, or the whole
/// rows with `TP_GATHER_LOGITS=1`.
fn forward(s: &mut Session, tokens: Vec<u32>, all_logits: bool) -> Result<StepLogits> {
    let need = if force_gather() {
        RowNeed::Full
    } else {
        RowNeed::Candidates { k: 1, lse: false }
    };
    let mut c = ChunkSpec::new(0, tokens).with_need(need);
    c.all_logits = all_logits;
    s.worker.forward_rows(vec![c])
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
}

/// The lines above the table.
pub fn spec_header(b: &SpecBench, f: &SpecFigures) -> String {
    let k = match b.tokens {
        DraftTokens::Fixed(k) => format!("{k} draft tokens"),
        DraftTokens::Adaptive => "adaptive draft length".into(),
    };
    format!(
        "# tp bench decode, speculation by {}: edit workload (rename an identifier in {} tokens of prompt, chat template), {} generated tokens (greedy, EOS ignored), {k}, median of {} alternated runs\n\
         # CPU: {}\n\
         # verify ms: one step of 1+k tokens (every row's top candidate, as greedy decoding asks) after the prompt; k=0 is a plain decode step\n\
         # draft ms, target ms: per decode step of the speculative run (drafting on rank 0; the target's step, verification included)\n\
         # ahead used: steps whose drafts were made ahead, during the verification before, of those verifications that drafted ahead (- when off)\n\
         {:>3}  {:>12}  {:>11}  {:>8}  {:>9}  {:>11}  {:>12}  {:>9}  {:>10}  {:>11}  verify ms (k=0,1,2,4,8,16)",
        b.drafter.name(),
        f.prompt_tokens,
        b.gen_tokens,
        b.repeats,
        tp_kernels::kernel_report(),
        "tp",
        "plain t/s",
        "spec t/s",
        "speedup",
        "accepted",
        "tok/step",
        "verify steps",
        "draft ms",
        "target ms",
        "ahead used",
    )
}

/// One table line.
pub fn spec_row(f: &SpecFigures) -> String {
    let verify: Vec<String> = f
        .verify_ms
        .iter()
        .map(|(_, ms)| format!("{ms:.1}"))
        .collect();
    format!(
        "{:>3}  {:>12.1}  {:>11.1}  {:>7.2}x  {:>8.0}%  {:>11.2}  {:>12}  {:>9.2}  {:>10.2}  {:>11}  {}",
        f.tp,
        f.plain_tok_s,
        f.spec_tok_s,
        f.speedup(),
        f.stats.acceptance() * 100.0,
        f.tokens_per_step,
        f.stats.verify_steps,
        f.draft_ms,
        f.target_ms,
        if f.ahead {
            format!("{}/{}", f.stats.ahead_used, f.stats.ahead)
        } else {
            "-".into()
        },
        verify.join(" "),
    )
}

/// One JSON object.
pub fn spec_json(f: &SpecFigures) -> String {
    let verify: Vec<String> = f
        .verify_ms
        .iter()
        .map(|(k, ms)| format!("\"{k}\":{ms:.3}"))
        .collect();
    format!(
        "{{\"tp\":{},\"prompt_tokens\":{},\"plain_decode_tok_s\":{:.1},\"spec_decode_tok_s\":{:.1},\"speedup\":{:.3},\"acceptance\":{:.3},\"tokens_per_step\":{:.3},\"drafted\":{},\"accepted\":{},\"verify_steps\":{},\"draft_ms_per_step\":{:.3},\"target_ms_per_step\":{:.3},\"draft_ahead\":{},\"ahead_steps\":{},\"ahead_used\":{},\"verify_ms\":{{{}}}}}",
        f.tp,
        f.prompt_tokens,
        f.plain_tok_s,
        f.spec_tok_s,
        f.speedup(),
        f.stats.acceptance(),
        f.tokens_per_step,
        f.stats.drafted,
        f.stats.accepted,
        f.stats.verify_steps,
        f.draft_ms,
        f.target_ms,
        f.ahead,
        f.stats.ahead,
        f.stats.ahead_used,
        verify.join(",")
    )
}
