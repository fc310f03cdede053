//! Batch-1 prefill and decode speed of a session (what `tp bench decode` reports per tp): the
//! time per token split into compute, all-reduce and waiting for the slowest rank, and decode
//! speed set against the memory-bandwidth limit (weight bytes streamed per token / measured
//! read bandwidth with as many threads as ranks). It counts the bytes rank 0 sends per decoded
//! token: on the MPI backend those it hands to MPI (all-reduce payloads, fingerprints,
//! commands), else those of its collectives (the profile's count). Tokens are chosen from each
//! rank's top candidate ([`crate::candidates`]); `TP_GATHER_LOGITS=1` gathers the whole rows
//! as before, for comparison. For a
//! mixture of experts it reports the expert load of the decode steps: tokens per expert and
//! each rank's share of the expert rows (max over mean: 1 is balanced), and under a capacity
//! factor the (token, expert) pairs it dropped in the prefill and in the decode steps (a
//! decode step of one token never drops: the capacity is at least 1).

use crate::candidates::{force_gather, Row, RowNeed};
use crate::error::EngineError;
use crate::protocol::{ChunkSpec, Command};
use crate::report::show_bytes;
use crate::sampling::argmax;
use crate::session::Session;
use std::time::Instant;
use tp_tokenizer::TokenizerError;

/// What one measurement runs.
#[derive(Clone, Copy, Debug)]
pub struct DecodeBench {
    /// Prompt length in tokens (at least 1).
    pub prompt_tokens: usize,
    /// Tokens generated per run, greedily, end-of-sequence ignored (at least 2).
    pub gen_tokens: usize,
    /// Measured runs after one warm-up (at least 1); medians are reported.
    pub repeats: usize,
}

/// Why a measurement failed.
#[derive(Debug, thiserror::Error)]
pub enum BenchError {
    #[error("cannot encode the benchmark's prompt")]
    Prompt(#[source] TokenizerError),
    #[error(transparent)]
    Draft(#[from] crate::draft_model::DraftModelError),
    #[error("run {run} at tp {tp}")]
    Run {
        run: usize,
        tp: usize,
        #[source]
        source: EngineError,
    },
}

/// One session's figures: medians over the measured runs.
#[derive(Clone, Debug)]
pub struct DecodeFigures {
    pub tp: usize,
    /// Pipeline stages (1 without pipelining).
    pub pp: usize,
    pub prefill_tok_s: f64,
    pub decode_tok_s: f64,
    /// Per decode step, milliseconds, of the slowest-computing rank.
    pub compute_ms: f64,
    pub all_reduce_ms: f64,
    /// The longest any rank waited for the slowest one.
    pub wait_ms: f64,
    /// Weight bytes all ranks together stream per decoded token.
    pub bytes_per_token: f64,
    /// Read bandwidth of `tp` threads, bytes/s.
    pub read_bandwidth: f64,
    /// Bytes rank 0 sent per decoded token: handed to MPI on the MPI backend, else in its
    /// collectives.
    pub sent_per_token: Option<f64>,
    /// The weights' and the output head's formats.
    pub formats: (String, String),
    /// Mixture of experts: the most (token, expert) rows a rank computed over the mean per
    /// rank, in the decode steps (1: balanced); `None` for a dense model.
    pub expert_rank_load: Option<f64>,
    /// Mixture of experts: tokens routed to each expert in the decode steps, over layers
    /// (the last measured run); empty for a dense model.
    pub expert_tokens: Vec<u64>,
    /// Mixture of experts: (token, expert) pairs the capacity factor dropped per expert in
    /// the decode steps, over layers (the last measured run); empty without a capacity.
    pub expert_dropped: Vec<u64>,
    /// Mixture of experts: pairs the capacity factor dropped in the prefill (the last
    /// measured run); `None` without a capacity.
    pub prefill_expert_dropped: Option<u64>,
}

impl DecodeFigures {
    /// Tokens/s the read bandwidth allows.
    pub fn limit_tok_s(&self) -> f64 {
        self.read_bandwidth / self.bytes_per_token
    }
}

/// One run's figures.
#[derive(Clone, Debug)]
struct Run {
    prefill_tok_s: f64,
    decode_tok_s: f64,
    compute: f64,
    all_reduce: f64,
    wait: f64,
    sent_per_token: Option<f64>,
    expert_rank_load: Option<f64>,
    expert_tokens: Vec<u64>,
    expert_dropped: Vec<u64>,
    prefill_expert_dropped: Option<u64>,
}

const TEXT: &str = "The history of the world is a story of people, places and ideas. \
Rivers carried boats and trade, cities grew around markets, and writing let merchants keep \
accounts and poets keep songs. ";

/// Measures `session` (rank 0 leading): one warm-up run, then `b.repeats` measured ones.
pub fn measure(s: &mut Session, b: DecodeBench) -> Result<DecodeFigures, BenchError> {
    let tp = s.weights.tp();
    let bw = read_bandwidth(tp);
    let mut ids = Vec::new();
    while ids.len() < b.prompt_tokens {
        ids.extend(s.tokenizer.encode(TEXT).map_err(BenchError::Prompt)?);
    }
    ids.truncate(b.prompt_tokens);
    let rank0_bytes = s.worker.model().streamed_bytes_per_token();
    let mut runs = Vec::new();
    for run in 0..=b.repeats {
        runs.push(
            one_run(s, &ids, b.gen_tokens).map_err(|source| BenchError::Run { run, tp, source })?,
        );
    }
    runs.remove(0);
    let med = |f: fn(&Run) -> f64| median(runs.iter().map(f).collect());
    Ok(DecodeFigures {
        tp,
        pp: (s.memory.len() / tp.max(1)).max(1),
        prefill_tok_s: med(|r| r.prefill_tok_s),
        decode_tok_s: med(|r| r.decode_tok_s),
        compute_ms: med(|r| r.compute) * 1e3,
        all_reduce_ms: med(|r| r.all_reduce) * 1e3,
        wait_ms: med(|r| r.wait) * 1e3,
        // Every rank of a stage streams about the same bytes (balanced shards); the total per
        // token is what the whole machine must read. Stages are balanced by compute, not
        // bytes, so at pp > 1 this is rank 0's stage's bytes times the ranks, an estimate. A
        // pipeline's stages take turns at batch 1, so tp threads read at a time.
        bytes_per_token: rank0_bytes as f64 * s.memory.len().max(tp) as f64,
        read_bandwidth: bw,
        sent_per_token: runs
            .iter()
            .all(|r| r.sent_per_token.is_some())
            .then(|| med(|r| r.sent_per_token.unwrap_or(0.0))),
        formats: s.worker.model().formats(),
        expert_rank_load: runs
            .iter()
            .all(|r| r.expert_rank_load.is_some())
            .then(|| med(|r| r.expert_rank_load.unwrap_or(0.0))),
        expert_tokens: runs
            .last()
            .map(|r| r.expert_tokens.clone())
            .unwrap_or_default(),
        expert_dropped: runs
            .last()
            .map(|r| r.expert_dropped.clone())
            .unwrap_or_default(),
        prefill_expert_dropped: runs.last().and_then(|r| r.prefill_expert_dropped),
    })
}

/// The lines above the table: what was measured, the CPU, the limit, the column names.
pub fn header(b: DecodeBench, f: &DecodeFigures) -> String {
    format!(
        "# tp bench decode: batch 1, {} prompt + {} generated tokens, median of {} runs, one thread per rank ({} weights, {} head)\n\
         # CPU: {}\n\
         # limit = read bandwidth with tp threads / weight bytes streamed per token; per-token times are per decode step\n\
         {:>7}  {:>12}  {:>11}  {:>10}  {:>13}  {:>10}  {:>13}  {:>10}  {:>11}  {:>8}  {:>15}  {:>15}  {:>15}",
        b.prompt_tokens,
        b.gen_tokens,
        b.repeats,
        f.formats.0,
        f.formats.1,
        tp_kernels::kernel_report(),
        "tp x pp",
        "prefill t/s",
        "decode t/s",
        "compute ms",
        "all-reduce ms",
        "waiting ms",
        "bytes/token",
        "read GB/s",
        "limit t/s",
        "of limit",
        "sent/token/rank",
        "expert max/mean",
        "dropped pf/dec"
    )
}

/// One table line.
pub fn row(f: &DecodeFigures) -> String {
    let limit = f.limit_tok_s();
    format!(
        "{:>7}  {:>12.1}  {:>11.1}  {:>10.3}  {:>13.3}  {:>10.3}  {:>13}  {:>10.2}  {:>11.1}  {:>7.0}%  {:>15}  {:>15}  {:>15}",
        format!("{} x {}", f.tp, f.pp),
        f.prefill_tok_s,
        f.decode_tok_s,
        f.compute_ms,
        f.all_reduce_ms,
        f.wait_ms,
        show_bytes(f.bytes_per_token as u64),
        f.read_bandwidth / 1e9,
        limit,
        f.decode_tok_s / limit * 100.0,
        f.sent_per_token
            .map_or_else(|| "-".to_string(), |b| show_bytes(b as u64)),
        f.expert_rank_load
            .map_or_else(|| "-".to_string(), |l| format!("{l:.2}")),
        f.prefill_expert_dropped.map_or_else(
            || "-".to_string(),
            |p| format!("{p}/{}", f.expert_dropped.iter().sum::<u64>())
        )
    )
}

/// One JSON object.
pub fn json(f: &DecodeFigures) -> String {
    format!(
        "{{\"tp\":{},\"pp\":{},\"prefill_tok_s\":{:.1},\"decode_tok_s\":{:.1},\"compute_ms\":{:.3},\"all_reduce_ms\":{:.3},\"wait_ms\":{:.3},\"bytes_per_token\":{:.0},\"read_gb_s\":{:.2},\"bandwidth_limit_tok_s\":{:.1},\"sent_bytes_per_token_per_rank\":{},\"expert_rank_load\":{},\"expert_tokens\":{:?},\"expert_dropped\":{:?},\"prefill_expert_dropped\":{}}}",
        f.tp,
        f.pp,
        f.prefill_tok_s,
        f.decode_tok_s,
        f.compute_ms,
        f.all_reduce_ms,
        f.wait_ms,
        f.bytes_per_token,
        f.read_bandwidth / 1e9,
        f.limit_tok_s(),
        f.sent_per_token
            .map_or_else(|| "null".to_string(), |b| format!("{b:.0}")),
        f.expert_rank_load
            .map_or_else(|| "null".to_string(), |l| format!("{l:.3}")),
        f.expert_tokens,
        f.expert_dropped,
        f.prefill_expert_dropped
            .map_or_else(|| "null".to_string(), |p| p.to_string())
    )
}

/// Bytes this process has sent through MPI so far (None without MPI).
fn mpi_bytes_sent(s: &Session) -> Option<u64> {
    #[cfg(feature = "mpi")]
    if s.worker.group().backend() == "mpi" {
        return Some(tp_comm::mpi::bytes_sent());
    }
    let _ = s;
    None
}

/// Prefill `ids` and decode `gen` tokens greedily on slot 0 (EOS ignored), twice: once plain
/// for the speeds, once with a barrier before each all-reduce for the time split of the
/// decode steps (the barriers cost a little, so speeds come from the plain pass).
fn one_run(s: &mut Session, ids: &[u32], gen: usize) -> Result<Run, EngineError> {
    let mut speeds = (0.0, 0.0);
    let mut split = (0.0, 0.0, 0.0);
    let mut sent = None;
    let mut experts = (None, Vec::new(), Vec::new());
    let mut prefill_dropped = None;
    for barriers in [false, true] {
        s.worker.submit(Command::Open {
            slot: 0,
            capacity: (ids.len() + gen) as u32,
        })?;
        let dropped0 = s.worker.profile.expert_dropped_total();
        let t = Instant::now();
        let mut token = next_token(s, ids.to_vec())?;
        let prefill = t.elapsed().as_secs_f64();
        // Rank 0's layers' drops in the prefill (its profile counts since the last start).
        if barriers && !s.worker.profile.expert_dropped.is_empty() {
            prefill_dropped = Some(s.worker.profile.expert_dropped_total() - dropped0);
        }
        s.worker.submit(Command::ProfileStart { barriers })?;
        let sent0 = mpi_bytes_sent(s);
        let t = Instant::now();
        for _ in 1..gen {
            token = next_token(s, vec![token])?;
        }
        let decode = t.elapsed().as_secs_f64();
        s.worker.submit(Command::ProfileReport)?;
        if !barriers {
            // MPI's own count where there is one, else the collectives' bytes rank 0 sent.
            let profiled = s.worker.rank_profiles().first().map(|p| p.sent_bytes);
            sent = match (sent0, mpi_bytes_sent(s), profiled) {
                (Some(a), Some(b), _) => Some(b.saturating_sub(a) as f64 / (gen - 1) as f64),
                (_, _, Some(p)) => Some(p as f64 / (gen - 1) as f64),
                _ => None,
            };
        }
        s.worker.submit(Command::Close { slot: 0 })?;
        let steps = (gen - 1) as f64;
        if barriers {
            // The rank that computed longest: its waiting is near zero, the others wait for it.
            let profiles = s.worker.rank_profiles();
            let slowest = profiles
                .iter()
                .max_by(|a, b| a.compute_s().total_cmp(&b.compute_s()))
                .cloned()
                .unwrap_or_default();
            let most_wait = profiles.iter().map(|p| p.wait_s).fold(0.0, f64::max);
            let rows: Vec<f64> = profiles.iter().map(|p| p.expert_rows as f64).collect();
            let mean = rows.iter().sum::<f64>() / rows.len().max(1) as f64;
            experts = (
                (mean > 0.0).then(|| rows.iter().copied().fold(0.0, f64::max) / mean),
                s.worker.profile.expert_tokens.clone(),
                s.worker.profile.expert_dropped.clone(),
            );
            split = (
                slowest.compute_s() / steps,
                slowest.comm_s / steps,
                most_wait / steps,
            );
        } else {
            speeds = (ids.len() as f64 / prefill, steps / decode);
        }
    }
    Ok(Run {
        prefill_tok_s: speeds.0,
        decode_tok_s: speeds.1,
        compute: split.0,
        all_reduce: split.1,
        wait: split.2,
        sent_per_token: sent,
        expert_rank_load: experts.0,
        expert_tokens: experts.1,
        expert_dropped: experts.2,
        prefill_expert_dropped: prefill_dropped,
    })
}

/// The greedy next token after `tokens`: from every rank's top candidate, or from the whole
/// row gathered when `TP_GATHER_LOGITS=1` (the path before distributed sampling).
fn next_token(s: &mut Session, tokens: Vec<u32>) -> Result<u32, EngineError> {
    let need = if force_gather() {
        RowNeed::Full
    } else {
        RowNeed::Candidates { k: 1, lse: false }
    };
    let out = s
        .worker
        .forward_rows(vec![ChunkSpec::new(0, tokens).with_need(need)])?;
    match out.row(0) {
        Some(Row::Full(row)) => Ok(argmax(row)),
        Some(Row::Candidates(c)) => c
            .top
            .first()
            .map(|t| t.1)
            .ok_or_else(|| EngineError::Internal("no candidates".into())),
        None => Err(EngineError::Internal("forward returned no logits".into())),
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
}

/// Aggregate read bandwidth (bytes/s) of `threads` threads each summing its own 128 MiB.
fn read_bandwidth(threads: usize) -> f64 {
    const BYTES: usize = 128 << 20;
    let bufs: Vec<Vec<f32>> = (0..threads)
        .map(|t| vec![t as f32 + 1.0; BYTES / 4])
        .collect();
    let mut best = f64::MAX;
    for _ in 0..3 {
        let barrier = std::sync::Barrier::new(threads);
        let t = Instant::now();
        std::thread::scope(|sc| {
            for b in &bufs {
                let barrier = &barrier;
                sc.spawn(move || {
                    barrier.wait();
                    std::hint::black_box(sum(b));
                });
            }
        });
        best = best.min(t.elapsed().as_secs_f64());
    }
    (threads * BYTES) as f64 / best
}

fn sum(v: &[f32]) -> f32 {
    let mut acc = [0f32; 16];
    for c in v.chunks_exact(16) {
        for i in 0..16 {
            acc[i] += c[i];
        }
    }
    acc.iter().sum()
}
