//! A draft model for speculative decoding: a smaller model with the target's vocabulary,
//! held whole by rank 0 (a group of one: no shards, no communication; the other ranks only
//! see the drafted tokens in the verification step's command) and shared by every sequence
//! that drafts with it (a server's requests). Each sequence's drafter keeps its own KV cache
//! of the draft in step with the sequence: each call drops what the sequence no longer holds (rejected
//! drafts), feeds what it gained, then drafts greedily one token at a time (a point-mass
//! distribution, as the decoder's acceptance rule expects).
//!
//! The draft's memory is priced before anything loads ([`draft_memory`]: its weights whole and
//! its bytes per KV block, both on rank 0; the session's preflight adds them to rank 0's plan)
//! and its KV pool is bounded ([`DraftPlan::blocks`], from the same budget as the target's).
//! A drafter whose next draft does not fit the pool drafts nothing
//! ([`EngineError::DraftKvFull`]: the sequence goes on unspeculated that step).

use crate::error::{EngineError, Result};
use crate::generate::PREFILL_CHUNK;
use crate::sampling::argmax;
use crate::session::{load_tokenizer, SessionError};
use crate::spec::Drafter;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use thiserror::Error;
use tp_comm::Group;
use tp_models::{
    open_checkpoint, BlockTable, Chunk, KvPool, LoadOptions, Profile, RankWeights, ShardedModel,
    BLOCK_POSITIONS,
};
use tp_tokenizer::Tokenizer;

/// Why a draft model cannot serve a target.
#[derive(Debug, Error)]
pub enum DraftModelError {
    #[error("cannot load the draft model {}", path.display())]
    Load {
        path: PathBuf,
        #[source]
        source: Box<tp_models::ModelError>,
    },
    #[error("cannot read the draft model's tokenizer")]
    Tokenizer(#[source] Box<SessionError>),
    /// The draft's tokens are not the target's: its drafts would mean other text.
    #[error("the draft model {} has another vocabulary than the target: {what}; use a draft of the target's family (e.g. Qwen2.5-Coder-0.5B for -1.5B)", path.display())]
    Vocabulary { path: PathBuf, what: String },
}

/// What a draft model takes on rank 0, the one rank that holds it: its weights (whole) and
/// each block of [`BLOCK_POSITIONS`] positions of its KV pool.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DraftMemory {
    pub weights: u64,
    pub block_bytes: usize,
}

/// A session's draft model as its preflight priced it: where it is, what it takes, and the
/// most KV blocks its pool holds (all its sequences together).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DraftPlan {
    pub path: PathBuf,
    pub memory: DraftMemory,
    pub blocks: usize,
}

impl DraftPlan {
    /// Bytes of its KV pool when full.
    pub fn kv_bytes(&self) -> u64 {
        (self.blocks as u64).saturating_mul(self.memory.block_bytes as u64)
    }

    /// Weights and a full KV pool.
    pub fn total(&self) -> u64 {
        self.memory.weights.saturating_add(self.kv_bytes())
    }

    /// One line on what it takes on rank 0 (`rank0` bytes there in all, the target's
    /// included), as the start-up report and `tp inspect` print it.
    pub fn describe(&self, rank0: u64) -> String {
        use crate::report::show_bytes;
        format!(
            "draft model {} on rank 0: {} weights + {} KV pool ({} blocks of {BLOCK_POSITIONS} positions at most, {} per block) = {}; rank 0 with it: {}",
            self.path.display(),
            show_bytes(self.memory.weights),
            show_bytes(self.kv_bytes()),
            self.blocks,
            show_bytes(self.memory.block_bytes as u64),
            show_bytes(self.total()),
            show_bytes(rank0)
        )
    }
}

/// The load options of a draft model: the target's, but whole on one rank (no pipeline
/// stages or layer split, no expert groups) and without the target's expert capacity (a
/// dense draft could not take one; a draft only proposes tokens).
fn draft_options(opts: LoadOptions) -> LoadOptions {
    LoadOptions {
        pipeline_stages: 1,
        stage_split: tp_models::StageSplit::default(),
        expert_groups: 1,
        expert_capacity: None,
        ..opts
    }
}

/// What the draft model at `path`, loaded with `opts`, takes on rank 0; reads its metadata
/// only.
pub fn draft_memory(
    path: &Path,
    opts: LoadOptions,
) -> std::result::Result<DraftMemory, DraftModelError> {
    let load = |source: tp_models::ModelError| DraftModelError::Load {
        path: path.to_path_buf(),
        source: Box::new(source),
    };
    let ckpt = open_checkpoint(path).map_err(load)?;
    let opts = draft_options(opts);
    let plan =
        crate::session::memory_plan_held(&*ckpt, &RankWeights::even(1), BLOCK_POSITIONS, 0, opts)
            .map_err(load)?;
    let m = plan.first().ok_or_else(|| {
        load(tp_models::ModelError::Config(
            "the draft model has no rank plan".into(),
        ))
    })?;
    Ok(DraftMemory {
        weights: (m.sharded + m.replicated) as u64,
        block_bytes: m.kv_block_bytes,
    })
}

/// What differs between two tokenizers' token tables (`None`: the same tokens, id for id).
pub fn vocabulary_difference(target: &Tokenizer, draft: &Tokenizer) -> Option<String> {
    let (t, d) = (target.vocab_size(), draft.vocab_size());
    if t != d {
        return Some(format!("the target has {t} tokens, the draft {d}"));
    }
    for id in 0..t as u32 {
        let (a, b) = (target.token_bytes(id).ok(), draft.token_bytes(id).ok());
        if a != b {
            let show = |x: Option<Vec<u8>>| {
                x.map_or("no token".to_string(), |b| {
                    format!("{:?}", String::from_utf8_lossy(&b))
                })
            };
            return Some(format!(
                "token {id} is {} in the target and {} in the draft",
                show(a),
                show(b)
            ));
        }
    }
    None
}

/// A draft model on rank 0: its weights and one pool of KV blocks for every sequence that
/// drafts with it (a server's requests each keep their own table in it).
struct DraftModel {
    model: ShardedModel,
    group: Group,
    pool: KvPool,
    prof: Profile,
    /// Context of one sequence.
    ctx: usize,
    /// Ids at or past this are not the target's: a draft stops before one.
    target_vocab: usize,
}

impl DraftModel {
    /// The last position's logits `[vocab]` after feeding `tokens` to `table`.
    fn forward(&mut self, table: &mut BlockTable, tokens: &[u32]) -> Result<Vec<f32>> {
        let logits = self.model.forward(
            &mut [Chunk {
                tokens,
                table,
                all_logits: false,
            }],
            &mut self.pool,
            &self.group,
            &mut self.prof,
        )?;
        Ok(logits)
    }
}

/// The draft model shared by many sequences: [`DrafterSource::drafter`] gives each its own
/// [`ModelDrafter`] (its own KV cache of the draft; the weights are held once).
#[derive(Clone)]
pub struct DraftModelSource {
    shared: Arc<Mutex<DraftModel>>,
    path: PathBuf,
}

impl std::fmt::Debug for DraftModelSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DraftModelSource")
            .field("path", &self.path)
            .finish_non_exhaustive()
    }
}

impl DraftModelSource {
    /// Loads the draft at `path` whole (a context of `ctx` positions per sequence) for a
    /// target with `target` as tokenizer and `target_vocab` logits per row; its vocabulary
    /// must be the target's, token for token.
    pub fn open(
        path: &Path,
        target: &Tokenizer,
        target_vocab: usize,
        ctx: usize,
        opts: LoadOptions,
    ) -> std::result::Result<Self, DraftModelError> {
        let load = |source: tp_models::ModelError| DraftModelError::Load {
            path: path.to_path_buf(),
            source: Box::new(source),
        };
        let ckpt = open_checkpoint(path).map_err(load)?;
        let tok =
            load_tokenizer(path, &*ckpt).map_err(|e| DraftModelError::Tokenizer(Box::new(e)))?;
        if let Some(what) = vocabulary_difference(target, &tok) {
            return Err(DraftModelError::Vocabulary {
                path: path.to_path_buf(),
                what,
            });
        }
        drop(tok);
        let model = ShardedModel::load(&*ckpt, 0, 1, draft_options(opts), ctx).map_err(load)?;
        ckpt.release_pages();
        let pool = model.new_pool();
        Ok(DraftModelSource {
            shared: Arc::new(Mutex::new(DraftModel {
                model,
                group: tp_comm::local::solo(),
                pool,
                prof: Profile::default(),
                ctx,
                target_vocab,
            })),
            path: path.to_path_buf(),
        })
    }

    /// [`DraftModelSource::open`] for `session`'s target (its tokenizer, vocabulary and
    /// context), its KV pool bounded as the session's preflight planned (unbounded when the
    /// session was started without the draft: [`crate::start::SessionConfig::draft`]).
    pub fn for_session(
        path: &Path,
        session: &crate::Session,
        opts: LoadOptions,
    ) -> std::result::Result<Self, DraftModelError> {
        let d = Self::open(
            path,
            &session.tokenizer,
            session.worker.model().config().vocab,
            session.ctx_size,
            opts,
        )?;
        if let Some(plan) = &session.draft {
            d.set_block_limit(plan.blocks);
        }
        Ok(d)
    }

    /// Bounds the draft's KV pool, all sequences together, to `blocks` blocks of
    /// [`BLOCK_POSITIONS`] positions.
    pub fn set_block_limit(&self, blocks: usize) {
        lock(&self.shared).pool.set_limit(blocks);
    }

    /// A drafter with its own (empty) cache of the draft.
    pub fn sequence(&self) -> ModelDrafter {
        let table = {
            let m = lock(&self.shared);
            m.model.new_table(m.ctx)
        };
        ModelDrafter {
            shared: Arc::clone(&self.shared),
            table,
            fed: Vec::new(),
        }
    }
}

impl crate::spec::DrafterSource for DraftModelSource {
    fn drafter(&self) -> Result<Box<dyn Drafter>> {
        Ok(Box::new(self.sequence()))
    }
    fn describe(&self) -> String {
        format!("draft model {}", self.path.display())
    }
}

/// The draft model, also after a panic elsewhere (its state is only caches, which each
/// drafter checks against its sequence).
fn lock(m: &Mutex<DraftModel>) -> std::sync::MutexGuard<'_, DraftModel> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// One sequence's drafter over a (shared) draft model: its cache of the draft, kept in
/// step with the sequence by common prefix.
pub struct ModelDrafter {
    shared: Arc<Mutex<DraftModel>>,
    table: BlockTable,
    /// The tokens the draft's cache holds, in order.
    fed: Vec<u32>,
}

impl std::fmt::Debug for ModelDrafter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ModelDrafter")
            .field("fed", &self.fed.len())
            .finish_non_exhaustive()
    }
}

impl Drop for ModelDrafter {
    fn drop(&mut self) {
        lock(&self.shared).pool.release(&mut self.table);
    }
}

impl ModelDrafter {
    /// Loads the draft at `path` for one sequence (see [`DraftModelSource::open`]).
    pub fn open(
        path: &Path,
        target: &Tokenizer,
        target_vocab: usize,
        ctx: usize,
        opts: LoadOptions,
    ) -> std::result::Result<Self, DraftModelError> {
        Ok(DraftModelSource::open(path, target, target_vocab, ctx, opts)?.sequence())
    }
}

impl Drafter for ModelDrafter {
    fn draft(&mut self, history: &[u32], k: usize) -> Result<Vec<u32>> {
        if history.is_empty() || k == 0 {
            return Ok(Vec::new());
        }
        let mut m = lock(&self.shared);
        // Keep what the sequence still holds (at least one token is fed again, for logits).
        let common = self
            .fed
            .iter()
            .zip(history)
            .take_while(|(a, b)| a == b)
            .count()
            .min(history.len() - 1);
        m.pool.truncate(&mut self.table, common);
        self.fed.truncate(common);
        if history.len() > self.table.capacity() {
            return Ok(Vec::new());
        }
        // The pool must take what the sequence gained, then the drafts fed back (all but the
        // last): draft fewer when only some fit, none when not even the catch-up does.
        let (catch_up, free) = (history.len() - common, m.pool.free_blocks());
        let needed = m.pool.blocks_needed(&self.table, catch_up);
        if needed > free {
            return Err(EngineError::DraftKvFull {
                needed,
                free,
                limit: m.pool.limit(),
            });
        }
        let mut k = k;
        while k > 1 && m.pool.blocks_needed(&self.table, catch_up + k - 1) > free {
            k -= 1;
        }
        let mut logits = Vec::new();
        for chunk in history[common..].chunks(PREFILL_CHUNK) {
            logits = m.forward(&mut self.table, chunk)?;
            self.fed.extend_from_slice(chunk);
        }
        let mut out = Vec::with_capacity(k);
        loop {
            if logits.is_empty() {
                return Err(EngineError::Internal(
                    "the draft model gave no logits".into(),
                ));
            }
            let t = argmax(&logits);
            if t as usize >= m.target_vocab {
                break;
            }
            out.push(t);
            if out.len() == k || self.table.len() >= self.table.capacity() {
                break;
            }
            logits = m.forward(&mut self.table, &[t])?;
            self.fed.push(t);
        }
        Ok(out)
    }

    fn costly(&self) -> bool {
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_different_vocabulary_is_described() {
        let a = Tokenizer::bytes(&["<|endoftext|>"]);
        let b = Tokenizer::bytes(&["<|im_end|>"]);
        let c = Tokenizer::bytes(&["<|endoftext|>", "<|im_end|>"]);
        assert_eq!(vocabulary_difference(&a, &a), None);
        let d = vocabulary_difference(&a, &b).unwrap();
        assert!(d.contains("token 256") && d.contains("<|im_end|>"), "{d}");
        let d = vocabulary_difference(&a, &c).unwrap();
        assert_eq!(d, "the target has 257 tokens, the draft 258");
    }
}
