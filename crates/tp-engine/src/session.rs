//! Opening a model for a tensor-parallel layout, before and around the ranks: every rank's
//! memory plan and its checks (the step protocol's context limit, this machine's memory, a
//! per-rank memory limit with the smallest tp that fits), the tokenizer that belongs to the
//! model, and what rank 0 holds to lead the group ([`Session`]). Errors are typed and worded
//! without any front end's flags; the CLI adds those.
//!
//! A draft model for speculative decoding lives on rank 0 only: its weights and its KV pool
//! are charged to rank 0's plan ([`charge_draft`]), so every check and a server's KV budget
//! (which then pays a target block and a draft block per block) count it.

use crate::draft_model::{DraftMemory, DraftPlan};
use crate::kv_budget::{limiting_rank, stage_block_bytes, KvBudget};
use crate::worker::Worker;
use std::path::{Path, PathBuf};
use thiserror::Error;
use tp_models::limits::show;
use tp_models::{
    rank_memory, Checkpoint, KvPool, LoadOptions, RankMemory, RankWeights, BLOCK_POSITIONS,
};
use tp_tokenizer::{Tokenizer, TokenizerError};

/// What rank 0 holds to lead the group.
pub struct Session {
    pub worker: Worker,
    pub tokenizer: Tokenizer,
    /// Positions of one sequence's KV cache.
    pub ctx_size: usize,
    /// Every rank's memory at this layout, by rank (weights, a KV cache of
    /// `ctx_size` positions, or of fewer when the run said it holds fewer): what the front end
    /// budgets with, without reopening the model.
    pub memory: Vec<RankMemory>,
    /// How the shards are split (even, or in proportion to rank weights).
    pub weights: RankWeights,
    /// What each rank read at load and how long it took, by rank (empty where not measured).
    pub load: Vec<crate::load_stats::LoadStats>,
    /// The draft model rank 0 may load, as the preflight priced it (already charged to
    /// `memory[0]`, see [`charge_draft`]); `None` when the run was started without one.
    pub draft: Option<DraftPlan>,
}

/// Where the ranks of a layout live, for the machine-memory check.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Placement {
    /// Every rank is a thread of this process: together they must fit this machine.
    OneProcess,
    /// One rank per process (possibly on other hosts): the busiest one must fit.
    ProcessPerRank,
}

/// Why a model cannot be opened for a layout.
#[derive(Debug, Error)]
pub enum SessionError {
    /// The memory plan cannot be computed for this context (a size too large to hold, or a
    /// layout the model cannot be split into).
    #[error("a context of {ctx} positions does not fit")]
    Context {
        ctx: usize,
        #[source]
        source: Box<tp_models::ModelError>,
    },
    /// The step protocol carries a sequence's capacity as a u32.
    #[error(
        "a context of {ctx} positions is more than the {} a sequence can hold",
        u32::MAX
    )]
    ContextTooLong { ctx: usize },
    #[error(
        "{} would need {} (weights and a KV cache of {held} positions), more than this machine's {}",
        match placement {
            Placement::OneProcess => format!("the {tp} ranks of this process"),
            Placement::ProcessPerRank => "the busiest rank".to_string(),
        },
        show(Some(*need)),
        show(Some(u128::from(*machine)))
    )]
    OverMachine {
        placement: Placement,
        tp: usize,
        ctx: usize,
        /// KV positions priced: the context, or fewer when the run knows it holds fewer.
        held: usize,
        need: u128,
        machine: u64,
    },
    /// The busiest rank needs more than the per-rank limit; `fits` is the smallest tp (up to
    /// the head count `heads`) at which every rank would fit.
    #[error(
        "{} needs {} at tp {tp} (weights and a KV cache of {held} positions) but the per-rank memory limit is {}; {}{}",
        match uneven {
            Some((rank, weights)) => format!("rank {rank} (rank weights {weights})"),
            None => "a rank".to_string(),
        },
        show(Some(u128::from(*need))),
        show(Some(u128::from(*limit))),
        match fits {
            Some(t) => format!("the smallest tp that fits with even shards is {t}"),
            None => format!("no tp up to {heads} (the head count) fits"),
        },
        match fits_positions {
            Some(p) => format!("; at tp {tp} a KV cache of {p} positions at most fits"),
            None => format!("; at tp {tp} not even the weights fit"),
        }
    )]
    OverRankLimit {
        tp: usize,
        ctx: usize,
        /// KV positions priced: the context, or fewer when the run knows it holds fewer.
        held: usize,
        need: u64,
        limit: u64,
        /// With uneven rank weights: the busiest rank and the weights.
        uneven: Option<(usize, RankWeights)>,
        /// The smallest even tp whose every rank fits.
        fits: Option<usize>,
        heads: usize,
        /// At this tp and these weights: the most KV positions (fewer than `held`) with which
        /// every rank fits; `None` when the weights alone exceed the limit.
        fits_positions: Option<usize>,
    },
    /// The target fits the per-rank limit but not beside the draft model rank 0 holds.
    #[error(
        "rank 0 needs {} at tp {tp} with the draft model ({} of weights and {} of KV cache) but the per-rank memory limit is {}; use a smaller draft model, {}, or no draft model",
        show(Some(u128::from(*need))),
        show(Some(u128::from(*draft_weights))),
        show(Some(u128::from(*draft_kv))),
        show(Some(u128::from(*limit))),
        match fits {
            Some(t) => format!("more ranks for the target (it fits beside the draft at tp {t})"),
            None => format!("(more ranks do not help: no tp up to {heads} fits beside the draft)"),
        }
    )]
    DraftOverRankLimit {
        tp: usize,
        need: u64,
        limit: u64,
        draft_weights: u64,
        draft_kv: u64,
        /// The smallest even tp at which rank 0 fits with the draft.
        fits: Option<usize>,
        heads: usize,
    },
    #[error("rank weights {weights} cannot split this model")]
    WeightsSplit {
        weights: RankWeights,
        #[source]
        source: Box<tp_models::ModelError>,
    },
    /// Reading the GGUF file's metadata for its tokenizer failed.
    #[error(transparent)]
    Model(Box<tp_models::ModelError>),
    #[error("cannot load the tokenizer of {}", path.display())]
    Tokenizer {
        path: PathBuf,
        #[source]
        source: TokenizerError,
    },
    #[error("the tokenizer of {} has {tokens} tokens but the model only {vocab}; they do not belong together", path.display())]
    TokenizerVocab {
        path: PathBuf,
        tokens: usize,
        vocab: usize,
    },
}

/// Every rank's memory at `tp` (and `opts.pipeline_stages` stages: world-rank order) with a
/// KV cache of `ctx` positions.
pub fn memory_plan(
    ckpt: &dyn Checkpoint,
    weights: &RankWeights,
    ctx: usize,
    opts: LoadOptions,
) -> tp_models::Result<Vec<RankMemory>> {
    memory_plan_held(ckpt, weights, ctx, ctx, opts)
}

/// Every rank's memory at `tp` for sequences of at most `ctx` positions whose KV cache holds
/// at most `held` positions in all (whole blocks): the cache takes blocks as tokens arrive, so
/// a run that knows its longest sequence (a prompt and the tokens to generate) is priced for
/// that, not for the context, and a server for its budget ([`budget_positions`], which may be
/// more than one context).
pub fn memory_plan_held(
    ckpt: &dyn Checkpoint,
    weights: &RankWeights,
    ctx: usize,
    held: usize,
    opts: LoadOptions,
) -> tp_models::Result<Vec<RankMemory>> {
    let cfg = ckpt.config();
    tp_models::world_plans(ckpt, weights, opts)?
        .into_iter()
        .map(|plan| {
            let mut m = rank_memory(
                ckpt,
                &plan,
                ctx,
                opts.dense.bytes(),
                opts.keep_quantized,
                opts.kv_dtype,
            )?;
            if held != ctx {
                // The context was checked with the plan; `held` prices what the cache takes
                // (saturating, like every size here).
                m.kv_cache = KvPool::bytes_for(
                    plan.stage.layers.len(),
                    plan.kv_heads().len(),
                    cfg.head_dim,
                    held,
                    opts.kv_dtype,
                );
            }
            Ok(m)
        })
        .collect()
}

/// Charges rank 0's plan (`plan[0]`) with the draft model it holds: its weights (whole, counted
/// as replicated), a KV pool of `blocks` blocks, and its bytes per block beside the target's
/// (a server's budget pays one block of each per block).
pub fn charge_draft(plan: &mut [RankMemory], draft: &DraftMemory, blocks: usize) {
    if let Some(m) = plan.first_mut() {
        let w = usize::try_from(draft.weights).unwrap_or(usize::MAX);
        m.replicated = m.replicated.saturating_add(w);
        m.kv_cache = m
            .kv_cache
            .saturating_add(blocks.saturating_mul(draft.block_bytes));
        m.kv_block_bytes = m.kv_block_bytes.saturating_add(draft.block_bytes);
    }
}

/// [`memory_plan_held`] with the draft model (if any) charged to rank 0, its pool the blocks
/// of `held` positions (a sequence's draft cache follows the sequence).
pub fn memory_plan_drafted(
    ckpt: &dyn Checkpoint,
    weights: &RankWeights,
    ctx: usize,
    held: usize,
    opts: LoadOptions,
    draft: Option<&DraftMemory>,
) -> tp_models::Result<Vec<RankMemory>> {
    let mut plan = memory_plan_held(ckpt, weights, ctx, held, opts)?;
    if let Some(d) = draft {
        charge_draft(&mut plan, d, held.div_ceil(BLOCK_POSITIONS));
    }
    Ok(plan)
}

/// The positions (whole blocks, all sequences together) a server's KV `budget` gives every
/// rank of this layout room for: each rank's budget in bytes over its bytes per block, the
/// rank with the fewest bounding them (as the server allocates them). With a draft model,
/// rank 0's weights include the draft's and each of its blocks pays a draft block too: the
/// same count of blocks for both pools.
pub fn budget_positions(
    ckpt: &dyn Checkpoint,
    weights: &RankWeights,
    ctx: usize,
    opts: LoadOptions,
    budget: KvBudget,
    draft: Option<&DraftMemory>,
) -> tp_models::Result<usize> {
    let bare = memory_plan_drafted(ckpt, weights, ctx, 0, opts, draft)?;
    let weight_bytes: Vec<u64> = bare
        .iter()
        .map(|m| (m.sharded + m.replicated) as u64)
        .collect();
    let mut per_block = stage_block_bytes(ckpt, weights, opts)?;
    if let (Some(d), Some(b)) = (draft, per_block.first_mut()) {
        *b = b.saturating_add(d.block_bytes);
    }
    let budgets = budget.rank_bytes(&weight_bytes, &per_block);
    Ok(limiting_rank(&budgets, &per_block)
        .map_or(0, |(_, blocks)| blocks.saturating_mul(BLOCK_POSITIONS)))
}

/// The memory plan of a layout whose sequences hold at most `held` of `ctx` positions
/// ([`memory_plan_held`], with `draft` charged to rank 0: [`memory_plan_drafted`]), refused
/// when the context is more than a sequence can hold or the ranks would exceed this
/// machine's memory, before any rank allocates.
pub fn checked_memory_plan(
    ckpt: &dyn Checkpoint,
    weights: &RankWeights,
    ctx: usize,
    held: usize,
    opts: LoadOptions,
    placement: Placement,
    draft: Option<&DraftMemory>,
) -> Result<Vec<RankMemory>, SessionError> {
    let tp = weights.tp();
    let plan = memory_plan_drafted(ckpt, weights, ctx, held, opts, draft).map_err(|e| {
        if !weights.is_even() && e.is_split_error() {
            SessionError::WeightsSplit {
                weights: weights.clone(),
                source: Box::new(e),
            }
        } else {
            SessionError::Context {
                ctx,
                source: Box::new(e),
            }
        }
    })?;
    // The memory plan names the cost of huge contexts first.
    if u32::try_from(ctx).is_err() {
        return Err(SessionError::ContextTooLong { ctx });
    }
    if let Some(machine) = tp_models::limits::physical_memory() {
        let need: u128 = match placement {
            Placement::OneProcess => plan.iter().map(|m| m.total() as u128).sum(),
            Placement::ProcessPerRank => plan.iter().map(|m| m.total() as u128).max().unwrap_or(0),
        };
        if need > u128::from(machine) {
            return Err(SessionError::OverMachine {
                placement,
                tp,
                ctx,
                held,
                need,
                machine,
            });
        }
    }
    Ok(plan)
}

/// Refuses a layout whose busiest rank (in `plan`, of sequences holding at most `held` of
/// `ctx` positions, `draft` charged to rank 0) exceeds `limit` bytes, naming the smallest tp
/// that fits. A target that fits without the draft but not beside it is
/// [`SessionError::DraftOverRankLimit`].
#[allow(clippy::too_many_arguments)]
pub fn check_rank_limit(
    ckpt: &dyn Checkpoint,
    weights: &RankWeights,
    ctx: usize,
    held: usize,
    opts: LoadOptions,
    limit: u64,
    plan: &[RankMemory],
    draft: Option<&DraftMemory>,
) -> Result<(), SessionError> {
    let need = plan.iter().map(RankMemory::total).max().unwrap_or(0) as u64;
    if need <= limit {
        return Ok(());
    }
    let heads = ckpt.config().heads;
    // Whether every rank fits the limit with these weights and a cache of `positions`.
    let fits_with = |weights: &RankWeights, positions: usize, draft: Option<&DraftMemory>| {
        memory_plan_drafted(ckpt, weights, ctx, positions, opts, draft)
            .map(|p| p.iter().all(|m| m.total() as u64 <= limit))
            .unwrap_or(false)
    };
    if let Some(d) = draft.filter(|_| fits_with(weights, held, None)) {
        let blocks = held.div_ceil(BLOCK_POSITIONS) as u64;
        return Err(SessionError::DraftOverRankLimit {
            tp: weights.tp(),
            need: plan.first().map_or(0, RankMemory::total) as u64,
            limit,
            draft_weights: d.weights,
            draft_kv: blocks.saturating_mul(d.block_bytes as u64),
            fits: (1..=heads).find(|&t| fits_with(&RankWeights::even(t), held, draft)),
            heads,
        });
    }
    let fits_with = |weights: &RankWeights, positions: usize| fits_with(weights, positions, draft);
    let busiest = plan
        .iter()
        .position(|m| m.total() as u64 == need)
        .unwrap_or(0);
    let fits = (1..=heads).find(|&t| fits_with(&RankWeights::even(t), held));
    let fits_at = |positions: usize| fits_with(weights, positions);
    // The cache's bytes grow with the positions: the largest that fits, by bisection.
    let fits_positions = fits_at(0).then(|| {
        let (mut lo, mut hi) = (0, held); // fits_at(lo), !fits_at(hi)
        while hi - lo > 1 {
            let mid = lo + (hi - lo) / 2;
            if fits_at(mid) {
                lo = mid;
            } else {
                hi = mid;
            }
        }
        lo
    });
    Err(SessionError::OverRankLimit {
        tp: weights.tp(),
        ctx,
        held,
        need,
        limit,
        uneven: (!weights.is_even()).then(|| (busiest, weights.clone())),
        fits,
        heads,
        fits_positions,
    })
}

/// One line on rank `rank`'s shard and memory (`show_bytes` formats sizes).
pub fn describe_rank(
    ckpt: &dyn Checkpoint,
    rank: usize,
    weights: &RankWeights,
    opts: LoadOptions,
    m: &RankMemory,
    ctx: usize,
    show_bytes: impl Fn(u64) -> String,
) -> String {
    let Ok(plan) = tp_models::world_rank_plan(ckpt, rank, weights, opts) else {
        return format!("rank {rank}: no shard");
    };
    let stage = if plan.stage.count > 1 {
        format!(
            "stage {} layers {:?}{}{}, ",
            plan.stage.index,
            plan.stage.layers,
            if plan.stage.is_first() {
                " + embedding"
            } else {
                ""
            },
            if plan.stage.is_last() { " + head" } else { "" }
        )
    } else {
        String::new()
    };
    let cfg = ckpt.config();
    let kv = plan.kv_heads();
    let shared = if kv.len() * cfg.heads / cfg.kv_heads > plan.q_heads().len() {
        " (shared)"
    } else {
        ""
    };
    // The cache is priced in whole blocks of `ctx` positions (the context, or what the run
    // holds at most); per token held is what it grows by.
    let per_token = m.kv_cache / ctx.div_ceil(BLOCK_POSITIONS).max(1) / BLOCK_POSITIONS;
    let mlp = match &plan.experts {
        Some(x) => format!(
            "experts {:?} (FFN {:?} of each)",
            x.local,
            x.expert_cols(x.local.start)
        ),
        None => format!("FFN {:?}", plan.ffn_cols()),
    };
    format!(
        "rank {rank}: {stage}heads {:?}, KV heads {kv:?}{shared}, {mlp}, vocab {:?}: {} sharded + {} replicated + {} KV cache ({ctx} positions at most, {} per token held) = {}",
        plan.q_heads(),
        plan.vocab_rows(),
        show_bytes(m.sharded as u64),
        show_bytes(m.replicated as u64),
        show_bytes(m.kv_cache as u64),
        show_bytes(per_token as u64),
        show_bytes(m.total() as u64),
    )
}

/// Gives the heap memory the allocator holds free back to the system. glibc keeps what loading
/// a model and building a tokenizer allocated and freed (the tokenizer's intermediate
/// vocabulary and merges, slice copies): for Qwen2.5's 151k-token vocabulary about 200 MB of
/// resident memory that nothing uses. Call after such work (building the tokenizer, loading the
/// shards). A no-op elsewhere.
pub fn release_free_heap() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim has no preconditions; it only returns free pages to the system.
    unsafe {
        libc::malloc_trim(0);
    }
}

/// The tokenizer of a GGUF (from its metadata) or an HF directory (tokenizer.json, also for a
/// `.safetensors` file inside one), refused when it has more tokens than the model.
pub fn load_tokenizer(path: &Path, ckpt: &dyn Checkpoint) -> Result<Tokenizer, SessionError> {
    let tok = if path.is_dir() {
        Tokenizer::from_hf_dir(path)
    } else if let Some(dir) = path
        .parent()
        .filter(|_| path.extension().is_some_and(|e| e == "safetensors"))
    {
        Tokenizer::from_hf_dir(dir)
    } else {
        let gguf =
            tp_models::GgufCheckpoint::open(path).map_err(|e| SessionError::Model(Box::new(e)))?;
        Tokenizer::from_gguf(gguf.metadata())
    };
    let tok = tok.map_err(|source| SessionError::Tokenizer {
        path: path.to_path_buf(),
        source,
    })?;
    let vocab = ckpt.config().vocab;
    if tok.vocab_size() > vocab {
        return Err(SessionError::TokenizerVocab {
            path: path.to_path_buf(),
            tokens: tok.vocab_size(),
            vocab,
        });
    }
    Ok(tok)
}

#[cfg(test)]
mod tests {
    use super::*;
    use tp_models::synthetic::{GgufTypes, SyntheticModel};
    use tp_models::{open_checkpoint, Arch};

    /// The synthetic test model as a GGUF file (8 heads, 2 KV heads, f32 weights).
    fn tiny(name: &str) -> Box<dyn Checkpoint> {
        let dir =
            std::env::temp_dir().join(format!("tp-engine-session-{}-{name}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("m.gguf");
        SyntheticModel::small(Arch::Llama, 1)
            .write_gguf(&path, GgufTypes::F32)
            .unwrap();
        let ckpt = open_checkpoint(&path).unwrap();
        let _ = std::fs::remove_dir_all(&dir);
        ckpt
    }

    #[test]
    fn a_rank_limit_names_the_smallest_tp_that_fits() {
        let ckpt = tiny("limit");
        let ckpt = &*ckpt;
        let opts = LoadOptions::default();
        let ctx = 64;
        let one = checked_memory_plan(
            ckpt,
            &RankWeights::even(1),
            ctx,
            ctx,
            opts,
            Placement::OneProcess,
            None,
        )
        .unwrap();
        let two = memory_plan(ckpt, &RankWeights::even(2), ctx, opts).unwrap();
        let need1 = one[0].total() as u64;
        let need2 = two.iter().map(RankMemory::total).max().unwrap() as u64;
        assert!(need2 < need1);
        // Enough for tp 1: no error.
        check_rank_limit(
            ckpt,
            &RankWeights::even(1),
            ctx,
            ctx,
            opts,
            need1,
            &one,
            None,
        )
        .unwrap();
        // Enough for tp 2 only.
        match check_rank_limit(
            ckpt,
            &RankWeights::even(1),
            ctx,
            ctx,
            opts,
            need2,
            &one,
            None,
        ) {
            Err(SessionError::OverRankLimit { fits, need, .. }) => {
                assert_eq!(fits, Some(2));
                assert_eq!(need, need1);
            }
            other => panic!("{other:?}"),
        }
        // Room for half the context at tp 1: the most positions that fit are named (one more
        // does not fit).
        let at = |held| {
            memory_plan_held(ckpt, &RankWeights::even(1), ctx, held, opts).unwrap()[0].total()
                as u64
        };
        let half = at(ctx / 2);
        match check_rank_limit(
            ckpt,
            &RankWeights::even(1),
            ctx,
            ctx,
            opts,
            half,
            &one,
            None,
        ) {
            Err(e @ SessionError::OverRankLimit { .. }) => {
                let SessionError::OverRankLimit { fits_positions, .. } = &e else {
                    unreachable!()
                };
                let p = fits_positions.expect("the weights fit");
                assert!((ctx / 2..ctx).contains(&p), "{p}");
                assert!(at(p) <= half && at(p + 1) > half, "{p}");
                assert!(
                    e.to_string()
                        .contains(&format!("at tp 1 a KV cache of {p} positions at most fits")),
                    "{e}"
                );
            }
            other => panic!("{other:?}"),
        }
        // Nothing fits one byte.
        let e = check_rank_limit(ckpt, &RankWeights::even(1), ctx, ctx, opts, 1, &one, None)
            .unwrap_err();
        assert!(matches!(
            e,
            SessionError::OverRankLimit {
                fits: None,
                fits_positions: None,
                ..
            }
        ));
        assert!(e.to_string().contains("(the head count) fits"), "{e}");
    }

    #[test]
    fn a_run_is_priced_by_the_blocks_it_can_hold() {
        let ckpt = tiny("held");
        let ckpt = &*ckpt;
        let opts = LoadOptions::default();
        let (ctx, w) = (256, RankWeights::even(1));
        let whole = memory_plan(ckpt, &w, ctx, opts).unwrap();
        // 40 positions take two blocks: priced as 64 positions.
        let held = memory_plan_held(ckpt, &w, ctx, 40, opts).unwrap();
        let two = memory_plan_held(ckpt, &w, ctx, 2 * BLOCK_POSITIONS, opts).unwrap();
        assert_eq!(held, two);
        assert_eq!(
            held[0].kv_cache * ctx / (2 * BLOCK_POSITIONS),
            whole[0].kv_cache
        );
        assert_eq!(held[0].replicated, whole[0].replicated);
        // A server's cache may hold more than one context: priced as what it holds.
        let ten = memory_plan_held(ckpt, &w, ctx, 10 * ctx, opts).unwrap();
        assert_eq!(ten[0].kv_cache, 10 * whole[0].kv_cache);
        assert_eq!(ten[0].sharded, whole[0].sharded);
        // A limit between the two: the run that holds 40 positions starts, the context does not.
        let limit = held[0].total() as u64;
        let checked =
            checked_memory_plan(ckpt, &w, ctx, 40, opts, Placement::OneProcess, None).unwrap();
        check_rank_limit(ckpt, &w, ctx, 40, opts, limit, &checked, None).unwrap();
        let e = check_rank_limit(ckpt, &w, ctx, ctx, opts, limit, &whole, None).unwrap_err();
        assert!(e.to_string().contains("a KV cache of 256 positions"), "{e}");
        match check_rank_limit(ckpt, &w, ctx, 1000, opts, 1, &whole, None) {
            Err(SessionError::OverRankLimit { held, ctx: c, .. }) => {
                assert_eq!((held, c), (1000, ctx))
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_server_is_priced_at_its_kv_budget_not_at_a_context() {
        let ckpt = tiny("budget");
        let ckpt = &*ckpt;
        let opts = LoadOptions::default();
        let (ctx, w) = (256, RankWeights::even(2));
        let whole = memory_plan(ckpt, &w, ctx, opts).unwrap();
        let per_block = whole[0].kv_cache / (ctx / BLOCK_POSITIONS);
        // Bytes: whole blocks of the budget, on the rank with the fewest.
        let three = (3 * per_block + per_block / 2) as u64;
        let p = budget_positions(ckpt, &w, ctx, opts, KvBudget::Bytes(three), None).unwrap();
        assert_eq!(p, 3 * BLOCK_POSITIONS);
        let n = 5 * ctx;
        let p = budget_positions(ckpt, &w, ctx, opts, KvBudget::Positions(n), None).unwrap();
        assert_eq!(p, n);
        // A rank limit that holds the weights and 2 blocks but not one context: the server
        // is priced at those blocks and starts, where the context's pricing refused it.
        let weights_max = whole
            .iter()
            .map(|m| m.sharded + m.replicated)
            .max()
            .unwrap();
        let limit = (weights_max + 2 * per_block) as u64;
        assert!(check_rank_limit(ckpt, &w, ctx, ctx, opts, limit, &whole, None).is_err());
        let held =
            budget_positions(ckpt, &w, ctx, opts, KvBudget::RankMemory(limit), None).unwrap();
        assert!((2 * BLOCK_POSITIONS..ctx).contains(&held), "{held}");
        let plan =
            checked_memory_plan(ckpt, &w, ctx, held, opts, Placement::OneProcess, None).unwrap();
        check_rank_limit(ckpt, &w, ctx, held, opts, limit, &plan, None).unwrap();
        assert!(plan.iter().all(|m| m.total() as u64 <= limit));
    }

    /// A draft model (here the tiny model itself, priced from its file as the preflight does)
    /// is charged to rank 0 only; a server's budget gives both pools the same blocks; a limit
    /// the target fits but not beside the draft is refused in the draft's terms.
    #[test]
    fn the_draft_model_is_charged_to_rank_0() {
        let dir =
            std::env::temp_dir().join(format!("tp-engine-session-{}-draft", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("m.gguf");
        SyntheticModel::small(Arch::Llama, 1)
            .write_gguf(&path, GgufTypes::F32)
            .unwrap();
        let ckpt = open_checkpoint(&path).unwrap();
        let ckpt = &*ckpt;
        let opts = LoadOptions::default();
        let d = crate::draft_model::draft_memory(&path, opts).unwrap();
        let _ = std::fs::remove_dir_all(&dir);
        let (ctx, w) = (256, RankWeights::even(2));
        let whole = memory_plan(ckpt, &RankWeights::even(1), ctx, opts).unwrap();
        // Its weights and block bytes are the model's own at tp 1.
        assert_eq!(d.weights, (whole[0].sharded + whole[0].replicated) as u64);
        assert_eq!(d.block_bytes, whole[0].kv_block_bytes);
        // 40 positions: two blocks of the draft on rank 0, nothing on rank 1.
        let plain = memory_plan_held(ckpt, &w, ctx, 40, opts).unwrap();
        let drafted = memory_plan_drafted(ckpt, &w, ctx, 40, opts, Some(&d)).unwrap();
        assert_eq!(drafted[1], plain[1]);
        assert_eq!(
            drafted[0].total(),
            plain[0].total() + d.weights as usize + 2 * d.block_bytes
        );
        // What a server divides its budget by on rank 0 (`Session::memory`): both blocks.
        assert_eq!(
            drafted[0].kv_block_bytes,
            plain[0].kv_block_bytes + d.block_bytes
        );
        // A budget of bytes: rank 0 pays a target block and a draft block per block.
        let t = plain[0].kv_block_bytes;
        let bytes = (5 * (t + d.block_bytes) + 7) as u64;
        let p = budget_positions(ckpt, &w, ctx, opts, KvBudget::Bytes(bytes), Some(&d)).unwrap();
        assert_eq!(p, 5 * BLOCK_POSITIONS);
        let p = budget_positions(ckpt, &w, ctx, opts, KvBudget::Bytes(bytes), None).unwrap();
        assert!(p > 5 * BLOCK_POSITIONS, "{p}");
        // A rank's memory: the draft's weights come off rank 0's budget first.
        let limit = (plain[0].sharded + plain[0].replicated) as u64 + d.weights + bytes;
        let p = budget_positions(ckpt, &w, ctx, opts, KvBudget::RankMemory(limit), Some(&d));
        assert_eq!(p.unwrap(), 5 * BLOCK_POSITIONS);
        let plan = checked_memory_plan(
            ckpt,
            &w,
            ctx,
            p_ok(5),
            opts,
            Placement::OneProcess,
            Some(&d),
        )
        .unwrap();
        check_rank_limit(ckpt, &w, ctx, p_ok(5), opts, limit, &plan, Some(&d)).unwrap();
        // The target fits these limits alone, not beside the draft (the first lacks the
        // draft's KV, the second its weights too): the draft's error, with the tp at which rank
        // 0 fits with it when one does (a smaller shard of the target makes room).
        for (limit, more_ranks) in [
            (plain[0].total() as u64 + d.weights, true),
            (plain[0].total() as u64, false),
        ] {
            let e =
                check_rank_limit(ckpt, &w, ctx, 40, opts, limit, &drafted, Some(&d)).unwrap_err();
            match &e {
                SessionError::DraftOverRankLimit {
                    need,
                    draft_weights,
                    draft_kv,
                    fits,
                    ..
                } => {
                    assert_eq!(*need, drafted[0].total() as u64);
                    assert_eq!(
                        (*draft_weights, *draft_kv),
                        (d.weights, 2 * d.block_bytes as u64)
                    );
                    assert_eq!(fits.is_some(), more_ranks, "{e}");
                    if let Some(t) = *fits {
                        assert!(t > 2, "{t}");
                        let at = |t| {
                            memory_plan_drafted(
                                ckpt,
                                &RankWeights::even(t),
                                ctx,
                                40,
                                opts,
                                Some(&d),
                            )
                            .unwrap()
                            .iter()
                            .all(|m| m.total() as u64 <= limit)
                        };
                        assert!(at(t) && !at(t - 1), "{t}");
                    }
                }
                other => panic!("{other:?}"),
            }
            let msg = e.to_string();
            assert!(
                msg.contains("smaller draft model")
                    && msg.contains("no draft model")
                    && msg.contains(if more_ranks {
                        "more ranks for the target"
                    } else {
                        "more ranks do not help"
                    })
                    && !msg.contains("--"),
                "{msg}"
            );
        }
        // Nothing fits one byte: the target's own error.
        let e = check_rank_limit(ckpt, &w, ctx, 40, opts, 1, &drafted, Some(&d)).unwrap_err();
        assert!(matches!(e, SessionError::OverRankLimit { .. }), "{e:?}");
    }

    /// `n` blocks' positions.
    fn p_ok(n: usize) -> usize {
        n * BLOCK_POSITIONS
    }

    #[test]
    fn a_context_beyond_u32_is_refused_in_the_engines_words() {
        let ckpt = tiny("u32");
        let ckpt = &*ckpt;
        let ctx = u32::MAX as usize + 1;
        let e = checked_memory_plan(
            ckpt,
            &RankWeights::even(1),
            ctx,
            ctx,
            LoadOptions::default(),
            Placement::OneProcess,
            None,
        )
        .unwrap_err();
        // Either the plan names the cost first or the u32 limit refuses it; never a flag.
        assert!(
            matches!(
                e,
                SessionError::Context { .. }
                    | SessionError::ContextTooLong { .. }
                    | SessionError::OverMachine { .. }
            ),
            "{e:?}"
        );
        assert!(!e.to_string().contains("--"), "{e}");
    }
}
