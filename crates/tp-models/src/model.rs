//! The Llama-family model sharded over a tensor-parallel group for inference (Megatron §3):
//! vocab-parallel embedding, attention split by heads (GQA-aware, KV cache of local heads),
//! SwiGLU MLP split by FFN columns, LM head split by vocab rows. Two all-reduces per layer.
//! Under pipelining a rank holds only its stage's layers (`tp_spec::Stage`): the first stage
//! embeds, every later one receives the `[tokens, hidden]` activations from the stage before
//! over the pipeline group, and the last one applies the final norm and the head.

use crate::attention::{attend, AttendInput};
use crate::checkpoint::{Checkpoint, Expected, WeightName};
use crate::config::ModelConfig;
use crate::error::{ModelError, Result};
use crate::kv_cache::{BlockTable, KvDtype, KvPool};
use crate::matrix::{LoadOptions, Matrix, Projection};
use crate::moe::MoeLayer;
use crate::ops::{gelu_tanh_mul, rms_norm, rms_norm_in_place, silu_mul, Rope};
use crate::profile::Profile;
use crate::qk_norm::WholeNorm;
use crate::shard::{CheckpointPlan, ShardPlan};
use crate::sync::{sum_partials, SyncMode};
use tp_comm::{CommExt, Group, ReduceOp};
use tp_spec::{embed_params, head_params, Activation, Param, RankWeights, Units};

/// One transformer block's local weights.
#[derive(Debug)]
struct Layer {
    attn_norm: Vec<f32>, // [hidden]
    qkv: Projection,     // [q_local*hd + 2*kv_local*hd, hidden]
    /// RMSNorm weights of the queries and keys, before RoPE: Qwen3's of each head, `([hd],
    /// [hd])`; OLMoE's over the whole projections, this rank's slices `([q_local*hd],
    /// [kv_local*hd])`.
    qk_norm: Option<(Vec<f32>, Vec<f32>)>,
    o: Matrix, // [hidden, q_local*hd]
    /// Gemma: RMSNorm weights of the attention output and of the MLP output, `([hidden],
    /// [hidden])`, applied before each residual add.
    post_norms: Option<(Vec<f32>, Vec<f32>)>,
    ffn_norm: Vec<f32>, // [hidden]
    mlp: Mlp,
}

/// A block's MLP on this rank.
#[derive(Debug)]
enum Mlp {
    Dense {
        gate_up: Projection, // [2*ffn_local, hidden]
        down: Matrix,        // [hidden, ffn_local]
    },
    Moe(MoeLayer),
}

impl Mlp {
    fn bytes(&self) -> usize {
        match self {
            Mlp::Dense { gate_up, down } => gate_up.bytes() + down.bytes(),
            Mlp::Moe(m) => m.bytes(),
        }
    }

    fn streamed_bytes_per_token(&self) -> usize {
        match self {
            Mlp::Dense { gate_up, down } => gate_up.bytes() + down.bytes(),
            Mlp::Moe(m) => m.streamed_bytes_per_token(),
        }
    }
}

/// A sequence's share of one forward call.
#[derive(Debug)]
pub struct Chunk<'a> {
    /// New tokens, at positions `table.len()..table.len() + tokens.len()`.
    pub tokens: &'a [u32],
    /// The sequence's blocks in the pool passed to [`ShardedModel::forward`].
    pub table: &'a mut BlockTable,
    /// Logits for every new token (perplexity) instead of only the last one (generation).
    pub all_logits: bool,
}

/// One rank's shard of the model.
#[derive(Debug)]
pub struct ShardedModel {
    cfg: ModelConfig,
    plan: ShardPlan,
    /// The first stage's embedding, or a tied head's matrix on the last stage.
    embed: Option<Matrix>, // [vocab_local, hidden]
    head: Option<Matrix>, // [vocab_local, hidden]; None when tied to `embed` or not last
    norm: Vec<f32>,       // [hidden] on the last stage, empty elsewhere
    /// The stage's layers, `plan.stage.layers` in order.
    layers: Vec<Layer>,
    /// RoPE of the global layers (every layer without sliding windows).
    rope: Rope,
    /// RoPE of the sliding-window layers, with their own base.
    local_rope: Option<Rope>,
    /// Longest context a sequence may reach.
    max_pos: usize,
    /// For each local query head, its KV head's index among the local KV heads.
    kv_of_q: Vec<usize>,
    /// How row-parallel partial sums are summed over the group.
    sync: SyncMode,
    /// How new caches store keys and values.
    kv_dtype: KvDtype,
}

impl ShardedModel {
    /// Reads rank `tp_rank`'s slices of `ckpt` (and nothing else) into memory. `max_pos` is the
    /// longest context any sequence may reach.
    pub fn load(
        ckpt: &dyn Checkpoint,
        tp_rank: usize,
        tp: usize,
        opts: LoadOptions,
        max_pos: usize,
    ) -> Result<Self> {
        let plan = ShardPlan::for_checkpoint(ckpt, tp_rank, tp)?
            .with_expert_groups(ckpt.config(), opts.expert_groups)?;
        Self::load_plan(ckpt, plan, opts, max_pos)
    }

    /// [`ShardedModel::load`] with shares in proportion to `weights` (one per rank of a
    /// stage's tp group, [`ShardPlan::weighted`]) and `opts.pipeline_stages` stages: `rank`
    /// is the world rank (stage `rank / tp`, tp rank `rank % tp`; the tp rank itself without
    /// pipelining). Every rank must pass the same weights and options.
    pub fn load_weighted(
        ckpt: &dyn Checkpoint,
        rank: usize,
        weights: &RankWeights,
        opts: LoadOptions,
        max_pos: usize,
    ) -> Result<Self> {
        let plan = crate::shard::world_rank_plan(ckpt, rank, weights, opts)?;
        Self::load_plan(ckpt, plan, opts, max_pos)
    }

    /// Loads the shard `plan` names (its tp slices of its stage's layers).
    pub fn load_plan(
        ckpt: &dyn Checkpoint,
        plan: ShardPlan,
        opts: LoadOptions,
        max_pos: usize,
    ) -> Result<Self> {
        let cfg = ckpt.config().clone();
        let hd = cfg.head_dim;
        // A context no sequence could ever hold is refused before any weight is read.
        crate::limits::check_context(&cfg, max_pos)?;
        tp_spec::check_capacity(&cfg, opts.expert_capacity)?;
        let rope = Rope::new(hd, cfg.rope_theta, cfg.block.rope_scale, cfg.rope_style);
        let local_rope = cfg
            .block
            .sliding
            .map(|s| Rope::new(hd, s.rope_theta, 1.0, cfg.rope_style));
        // Each rank's ranges, by the table's placement ([`ShardPlan::place`]).
        let q_rows = plan.units_range(Units::QHeads);
        let kv_rows = plan.units_range(Units::KvHeads);
        let ffn = plan.units_range(Units::Ffn);
        let vocab = plan.units_range(Units::Vocab);
        // Every weight outside the layers, as the table lists it, is checked before any is
        // read. The vocabulary matrices are read first, while nothing else is held: the
        // largest tensors, their file pages and slice copies then peak beside no layer
        // (Qwen2.5-Coder-0.5B at tp 1: 899 -> 734 MB peak RSS).
        for p in embed_params(&cfg).iter().chain(&head_params(&cfg)) {
            check_param(ckpt, p)?;
        }
        let stage = plan.stage.clone();
        if stage.layers.end > cfg.layers || stage.layers.is_empty() {
            return Err(ModelError::Input(format!(
                "pipeline stage {} holds layers {:?}, but the model has {} layers",
                stage.index, stage.layers, cfg.layers
            )));
        }
        // Repacked straight from the mapped file, its pages let go part by part (no slice
        // copy). The first stage embeds; the last reads the embedding as its tied head.
        let embed = if stage.is_first() || (stage.is_last() && cfg.tied_embeddings) {
            Some(Matrix::from_rows(
                ckpt,
                WeightName::Embed,
                vocab.clone(),
                opts,
            )?)
        } else {
            None
        };
        let head = if stage.is_last() && !cfg.tied_embeddings {
            Some(Matrix::from_rows(ckpt, WeightName::Output, vocab, opts)?)
        } else {
            None
        };
        ckpt.release_pages();
        let mut layers = Vec::with_capacity(stage.layers.len());
        for l in stage.layers.clone() {
            // The layer's weights as the table lists them, checked before any is read; below,
            // each goes to its slot.
            for p in cfg.layer_spec(l).params() {
                check_param(ckpt, &p)?;
            }
            let post_norms = if cfg.block.post_norms {
                Some((
                    ckpt.vector(WeightName::PostAttnNorm(l), None)?,
                    ckpt.vector(WeightName::PostFfnNorm(l), None)?,
                ))
            } else {
                None
            };
            let qk_norm = match (cfg.qk_norm, cfg.block.qk_norm_whole) {
                (false, _) => None,
                (true, false) => Some((
                    ckpt.vector(WeightName::QNorm(l), None)?,
                    ckpt.vector(WeightName::KNorm(l), None)?,
                )),
                (true, true) => Some((
                    ckpt.vector(WeightName::QNorm(l), Some(q_rows.clone()))?,
                    ckpt.vector(WeightName::KNorm(l), Some(kv_rows.clone()))?,
                )),
            };
            let bias =
                |name: WeightName, range: std::ops::Range<usize>| -> Result<Option<Vec<f32>>> {
                    if cfg.qkv_bias {
                        Ok(Some(ckpt.vector(name, Some(range))?))
                    } else {
                        Ok(None)
                    }
                };
            let qkv = Projection::new(
                vec![
                    (
                        ckpt.rows(WeightName::Q(l), q_rows.clone())?,
                        bias(WeightName::QBias(l), q_rows.clone())?,
                    ),
                    (
                        ckpt.rows(WeightName::K(l), kv_rows.clone())?,
                        bias(WeightName::KBias(l), kv_rows.clone())?,
                    ),
                    (
                        ckpt.rows(WeightName::V(l), kv_rows.clone())?,
                        bias(WeightName::VBias(l), kv_rows.clone())?,
                    ),
                ],
                opts,
            )?;
            let mlp = if cfg.experts.is_some() {
                Mlp::Moe(MoeLayer::load(ckpt, &plan, l, opts)?)
            } else {
                Mlp::Dense {
                    gate_up: Projection::new(
                        vec![
                            (ckpt.rows(WeightName::Gate(l), ffn.clone())?, None),
                            (ckpt.rows(WeightName::Up(l), ffn.clone())?, None),
                        ],
                        opts,
                    )?,
                    down: Matrix::from_row_parallel_slice(
                        ckpt.cols(WeightName::Down(l), ffn.clone())?,
                        plan.ffn_unit,
                        opts,
                    )?,
                }
            };
            layers.push(Layer {
                attn_norm: ckpt.vector(WeightName::AttnNorm(l), None)?,
                qkv,
                qk_norm,
                o: Matrix::from_row_parallel_slice(
                    ckpt.cols(WeightName::O(l), q_rows.clone())?,
                    hd,
                    opts,
                )?,
                post_norms,
                ffn_norm: ckpt.vector(WeightName::FfnNorm(l), None)?,
                mlp,
            });
            // The layer is repacked into this rank's own memory: its file pages may go, so the
            // load's peak is the weights plus one layer, not the weights plus the file.
            ckpt.release_pages();
        }
        let norm = if stage.is_last() {
            ckpt.vector(WeightName::OutputNorm, None)?
        } else {
            Vec::new()
        };
        // Everything is read: the last rank to finish leaves none of the file resident.
        ckpt.release_pages();
        let kv_of_q = plan
            .heads
            .local_kv_of_q()
            .into_iter()
            .map(|k| k as usize)
            .collect();
        Ok(ShardedModel {
            rope,
            local_rope,
            max_pos,
            norm,
            cfg,
            plan,
            embed,
            head,
            layers,
            kv_of_q,
            sync: SyncMode::Exact,
            kv_dtype: opts.kv_dtype,
        })
    }

    /// Sets how row-parallel partial sums are summed; every rank of the group must use the
    /// same mode (a mismatch is a desync the collectives report).
    pub fn set_sync(&mut self, mode: SyncMode) {
        self.sync = mode;
    }

    /// How row-parallel partial sums are summed.
    pub fn sync(&self) -> SyncMode {
        self.sync
    }

    pub fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    pub fn plan(&self) -> &ShardPlan {
        &self.plan
    }

    /// Longest context a sequence may reach.
    pub fn max_positions(&self) -> usize {
        self.max_pos
    }

    /// How this model's caches store keys and values.
    pub fn kv_dtype(&self) -> KvDtype {
        self.kv_dtype
    }

    /// Values cached per position per layer on this rank (`kv_local * head_dim`).
    pub fn kv_width(&self) -> usize {
        self.plan.kv_heads().len() * self.cfg.head_dim
    }

    /// This rank's pipeline stage (the whole model without pipelining).
    pub fn stage(&self) -> &tp_spec::Stage {
        &self.plan.stage
    }

    /// Frees the weights (layers, embedding, head, final norm) and keeps the shape: the model
    /// cannot run a forward pass afterwards. For a server that must drop its model before the
    /// next one fits (a drain swap, see `tp_engine::swap`).
    pub fn release_weights(&mut self) {
        self.layers = Vec::new();
        self.embed = None;
        self.head = None;
        self.norm = Vec::new();
    }

    /// An empty pool of KV blocks for this rank's heads of its stage's layers (no limit until
    /// one is set).
    pub fn new_pool(&self) -> KvPool {
        KvPool::new(
            self.layers.len(),
            self.plan.kv_heads().len(),
            self.cfg.head_dim,
            self.kv_dtype,
        )
    }

    /// An empty block table for a sequence of at most `capacity` positions (and at most this
    /// model's context).
    pub fn new_table(&self, capacity: usize) -> BlockTable {
        BlockTable::new(capacity.min(self.max_positions()))
    }

    /// Bytes of weights this rank holds.
    pub fn weight_bytes(&self) -> usize {
        let layers: usize = self
            .layers
            .iter()
            .map(|l| {
                l.qkv.bytes()
                    + l.o.bytes()
                    + l.mlp.bytes()
                    + (l.attn_norm.len() + l.ffn_norm.len()) * 4
                    + l.qk_norm
                        .as_ref()
                        .map_or(0, |(q, k)| (q.len() + k.len()) * 4)
                    + l.post_norms
                        .as_ref()
                        .map_or(0, |(a, f)| (a.len() + f.len()) * 4)
            })
            .sum();
        layers
            + self.embed.as_ref().map_or(0, Matrix::bytes)
            + self.head.as_ref().map_or(0, Matrix::bytes)
            + self.norm.len() * 4
    }

    /// Bytes of weights streamed for one decode step (every matrix once; embedding rows are
    /// negligible, the tied head is read once).
    pub fn streamed_bytes_per_token(&self) -> usize {
        let layers: usize = self
            .layers
            .iter()
            .map(|l| l.qkv.bytes() + l.o.bytes() + l.mlp.streamed_bytes_per_token())
            .sum();
        layers + self.head_matrix().map_or(0, Matrix::bytes)
    }

    /// The LM head on the last stage (the embedding when tied); `None` on other stages.
    fn head_matrix(&self) -> Option<&Matrix> {
        if self.plan.stage.is_last() {
            self.head.as_ref().or(self.embed.as_ref())
        } else {
            None
        }
    }

    /// Storage format of the block weights and of the LM head ("Q4_1", "Q8_0", "f32", ...).
    pub fn formats(&self) -> (String, String) {
        let block = self
            .layers
            .first()
            .and_then(|l| l.qkv.matrices().first())
            .map_or_else(String::new, |m| m.format().to_string());
        (
            block,
            self.head_matrix()
                .map_or_else(String::new, |m| m.format().to_string()),
        )
    }

    /// Runs `chunks` through the model (one batched pass over all their tokens) and returns
    /// this rank's logits `[rows, vocab_local]`: one row per chunk, or one per token for chunks
    /// that ask for all logits. A table without blocks for its new positions takes the lowest
    /// free ones from `pool`. Tables advance only when the whole pass succeeds; on an error
    /// they keep their first positions and release blocks taken for the rest. A model of
    /// one pipeline stage only ([`ShardedModel::forward_stage`] for more).
    pub fn forward(
        &self,
        chunks: &mut [Chunk<'_>],
        pool: &mut KvPool,
        group: &Group,
        prof: &mut Profile,
    ) -> Result<Vec<f32>> {
        self.forward_stage(chunks, pool, group, None, prof)
    }

    /// [`ShardedModel::forward`] on a pipeline stage: `group` is the stage's tp group,
    /// `pipeline` the group of this tp rank's counterparts in every stage (rank = stage
    /// index), over which a later stage receives the activations `[tokens, hidden]` from the
    /// stage before and an earlier one sends them on. Only the last stage returns logits
    /// (every other returns none); every stage must run the same chunks.
    pub fn forward_stage(
        &self,
        chunks: &mut [Chunk<'_>],
        pool: &mut KvPool,
        group: &Group,
        pipeline: Option<&Group>,
        prof: &mut Profile,
    ) -> Result<Vec<f32>> {
        let stage = &self.plan.stage;
        let pipe = match pipeline {
            Some(p) if p.size() == stage.count && p.rank() == stage.index => Some(p),
            None if stage.count == 1 => None,
            _ => {
                return Err(ModelError::Input(format!(
                    "stage {} of {} needs a pipeline group of {} ranks in which it is rank {}",
                    stage.index, stage.count, stage.count, stage.index
                )))
            }
        };
        let start_lens: Vec<usize> = chunks.iter().map(|c| c.table.len()).collect();
        let out = self.check_chunks(chunks).and_then(|()| {
            for c in chunks.iter_mut() {
                pool.reserve(c.table, c.tokens.len())?;
            }
            self.forward_inner(chunks, pool, group, pipe, prof)
        });
        for (c, len) in chunks.iter_mut().zip(start_lens) {
            match &out {
                Ok(_) => c.table.advance(c.tokens.len()),
                Err(_) => pool.truncate(c.table, len),
            }
        }
        out
    }

    fn check_chunks(&self, chunks: &[Chunk<'_>]) -> Result<()> {
        let vocab = self.cfg.vocab;
        for c in chunks {
            if c.tokens.is_empty() {
                return Err(ModelError::Input("a sequence chunk has no tokens".into()));
            }
            c.table.check_room(c.tokens.len())?;
            if c.table.len() + c.tokens.len() > self.max_positions() {
                return Err(ModelError::ContextFull {
                    pos: c.table.len(),
                    len: c.tokens.len(),
                    cap: self.max_positions(),
                });
            }
            if let Some(&id) = c.tokens.iter().find(|&&t| t as usize >= vocab) {
                return Err(ModelError::TokenOutOfRange { id, vocab });
            }
        }
        Ok(())
    }

    fn forward_inner(
        &self,
        chunks: &mut [Chunk<'_>],
        pool: &mut KvPool,
        group: &Group,
        pipe: Option<&Group>,
        prof: &mut Profile,
    ) -> Result<Vec<f32>> {
        let cfg = &self.cfg;
        let (hidden, hd) = (cfg.hidden, cfg.head_dim);
        let n: usize = chunks.iter().map(|c| c.tokens.len()).sum();
        prof.start_compute();

        let stage = &self.plan.stage;
        let mut h = vec![0f32; n * hidden]; // [n, hidden]
        match (pipe, &self.embed) {
            // A later stage: the stage before's output, as it left it.
            (Some(p), _) if !stage.is_first() => {
                prof.stage_recv(|| p.recv(&mut h, stage.index - 1, ACTIVATIONS_TAG))?;
            }
            // Embedding: own vocab rows, zeros elsewhere, summed over ranks.
            (_, Some(embed)) => {
                let vocab = self.plan.vocab_rows();
                for (t, id) in chunks.iter().flat_map(|c| c.tokens.iter()).enumerate() {
                    let id = *id as usize;
                    if vocab.contains(&id) {
                        embed.row_into(id - vocab.start, &mut h[t * hidden..(t + 1) * hidden])?;
                    }
                }
                all_reduce(&mut h, group, prof)?;
                if cfg.block.embed_scale {
                    let s = (hidden as f32).sqrt();
                    h.iter_mut().for_each(|x| *x *= s);
                }
            }
            (_, None) => {
                return Err(ModelError::Input(
                    "the first pipeline stage holds no embedding".into(),
                ))
            }
        }
        // Every token's RoPE angles, in token order, for each base the layers use.
        let positions = || {
            chunks
                .iter()
                .flat_map(|c| c.table.len()..c.table.len() + c.tokens.len())
        };
        let global_angles = self.rope.angles(positions());
        let local_angles = self.local_rope.as_ref().map(|r| r.angles(positions()));
        let scale = match cfg.block.query_scale {
            // The default in f32 arithmetic, as before the scale was configurable.
            None => 1.0 / (hd as f32).sqrt(),
            Some(s) => s as f32,
        };

        let q_w = self.plan.q_heads().len() * hd;
        let kv_w = self.kv_width();
        let qkv_w = q_w + 2 * kv_w;
        let ffn_w = self.plan.ffn_cols().len();
        let eps = cfg.rms_eps as f32;
        let mut xn = vec![0f32; n * hidden]; // [n, hidden]
        let mut qkv = vec![0f32; n * qkv_w]; // [n, q_w + 2 kv_w]
        let mut ctx = vec![0f32; n * q_w]; // [n, q_w]
        let mut partial = vec![0f64; n * hidden]; // [n, hidden], f64 partial sums

        // [rows, 2 ffn_w] for up to MLP_ROWS tokens at a time; after the activation its
        // first rows * ffn_w values are [rows, ffn_w].
        let dense = cfg.experts.is_none();
        let mut gu = vec![
            0f32;
            if dense {
                n.min(MLP_ROWS) * 2 * ffn_w
            } else {
                0
            }
        ];
        let mut out = vec![0f32; if cfg.block.post_norms { n * hidden } else { 0 }]; // [n, hidden]
                                                                                     // `li` indexes this stage's layers (and its cache); the model's index is offset.
        for (li, layer) in self.layers.iter().enumerate() {
            let window = cfg.window(stage.layers.start + li);
            let angles = match (window, &local_angles) {
                (Some(_), Some(local)) => local,
                _ => &global_angles,
            };
            // Attention half: f, local heads, row-parallel output, g.
            rms_norm(&h, &layer.attn_norm, eps, &mut xn);
            layer.qkv.forward(&xn, n, &mut qkv)?;
            let per_head_norm = match &layer.qk_norm {
                Some((qn, kn)) if cfg.block.qk_norm_whole => {
                    let whole = WholeNorm {
                        q_weight: qn,
                        k_weight: kn,
                        heads: cfg.heads,
                        kv_heads: cfg.kv_heads,
                        q_local: self.plan.q_heads(),
                        kv_local: self.plan.kv_heads(),
                        head_dim: hd,
                        eps,
                    };
                    whole.apply(&mut qkv, n, group, prof)?;
                    None
                }
                other => other.as_ref(),
            };
            let mut t0 = 0;
            for (ci, c) in chunks.iter().enumerate() {
                // The next sequence's cache is fetched while this one's attention runs.
                if let Some(next) = chunks.get(ci + 1) {
                    pool.layer(next.table, li).prefetch();
                }
                let len = c.tokens.len();
                let pos0 = c.table.len();
                let rows = &mut qkv[t0 * qkv_w..(t0 + len) * qkv_w];
                let mut k_new = Vec::with_capacity(len * kv_w); // [len, kv_w]
                let mut v_new = Vec::with_capacity(len * kv_w); // [len, kv_w]
                for (i, row) in rows.chunks_exact_mut(qkv_w).enumerate() {
                    let (q, kv) = row.split_at_mut(q_w);
                    let (k, v) = kv.split_at_mut(kv_w);
                    if let Some((qn, kn)) = per_head_norm {
                        rms_norm_in_place(q, qn, eps);
                        rms_norm_in_place(k, kn, eps);
                    }
                    angles.apply(q, t0 + i);
                    angles.apply(k, t0 + i);
                    k_new.extend_from_slice(k);
                    v_new.extend_from_slice(v);
                }
                pool.append(c.table, li, &k_new, &v_new);
                let input = AttendInput {
                    qkv: &qkv[t0 * qkv_w..(t0 + len) * qkv_w],
                    qkv_w,
                    kv: pool.layer(c.table, li), // [pos0 + len, kv_w] keys and values
                    hd,
                    kv_of_q: &self.kv_of_q,
                    pos0,
                    scale,
                    window,
                };
                attend(input, &mut ctx[t0 * q_w..(t0 + len) * q_w]);
                t0 += len;
            }
            row_parallel(&layer.o, &ctx, n, self.sync, &mut partial, group, prof)?;
            let post = layer.post_norms.as_ref();
            add_residual(
                &mut h,
                &partial,
                post.map(|p| &p.0[..]),
                eps,
                &mut out,
                &mut xn,
            );
            // MLP half: f, gate/up column-parallel, the activation locally, down
            // row-parallel, g.
            rms_norm(&h, &layer.ffn_norm, eps, &mut xn);
            partial.fill(0.0);
            match &layer.mlp {
                Mlp::Dense { gate_up, down } => {
                    for t0 in (0..n).step_by(MLP_ROWS) {
                        let rows = MLP_ROWS.min(n - t0);
                        let gu = &mut gu[..rows * 2 * ffn_w]; // [rows, 2 ffn_w]
                        let xs = &xn[t0 * hidden..(t0 + rows) * hidden]; // [rows, hidden]
                        gate_up.forward(xs, rows, gu)?;
                        // The activation in place, each token's result packed to the front
                        // (row t moves from 2t ffn_w down to t ffn_w, never over a row not
                        // yet read).
                        for t in 0..rows {
                            let row = &mut gu[2 * t * ffn_w..2 * (t + 1) * ffn_w];
                            let (g, u) = row.split_at_mut(ffn_w);
                            match cfg.block.activation {
                                Activation::Silu => silu_mul(g, u),
                                Activation::GeluTanh => gelu_tanh_mul(g, u),
                            }
                            gu.copy_within(2 * t * ffn_w..(2 * t + 1) * ffn_w, t * ffn_w);
                        }
                        let act = &gu[..rows * ffn_w]; // [rows, ffn_w]
                        let out = &mut partial[t0 * hidden..(t0 + rows) * hidden]; // [rows, hidden]
                        down.matmul_wide_acc(act, rows, out)?;
                    }
                }
                // Each local expert on its routed tokens, into the same partial sums.
                Mlp::Moe(moe) => moe.forward(&xn, n, &mut partial, prof)?,
            }
            // g: one sum over ranks for the whole chunk.
            sum_partials(self.sync, &mut partial, group, prof)?;
            add_residual(
                &mut h,
                &partial,
                post.map(|p| &p.1[..]),
                eps,
                &mut out,
                &mut xn,
            );
        }

        if !stage.is_last() {
            // The next stage continues from here; it returns the logits.
            let p =
                pipe.ok_or_else(|| ModelError::Input("a pipeline stage without its group".into()))?;
            prof.stage_send(std::mem::size_of_val(h.as_slice()), || {
                p.send(&h, stage.index + 1, ACTIVATIONS_TAG)
            })?;
            prof.stop_compute();
            return Ok(Vec::new());
        }
        // Final norm and the vocab-parallel head over the rows asked for.
        let mut picked: Vec<f32> = Vec::new(); // [rows, hidden]
        let mut t0 = 0;
        for c in chunks.iter() {
            let len = c.tokens.len();
            let first = if c.all_logits { t0 } else { t0 + len - 1 };
            picked.extend_from_slice(&h[first * hidden..(t0 + len) * hidden]);
            t0 += len;
        }
        let rows = picked.len() / hidden;
        let mut normed = vec![0f32; picked.len()]; // [rows, hidden]
        rms_norm(&picked, &self.norm, eps, &mut normed);
        let head = self
            .head_matrix()
            .ok_or_else(|| ModelError::Input("the last pipeline stage holds no head".into()))?;
        let mut logits = vec![0f32; rows * head.rows()]; // [rows, vocab_local]
        head.matmul(&normed, rows, &mut logits)?;
        prof.stop_compute();
        Ok(logits)
    }

    /// Every rank's `[rows, vocab_local]` logits -> the full `[rows, vocab]` on every rank.
    pub fn gather_logits(
        &self,
        local: Vec<f32>,
        rows: usize,
        group: &Group,
        prof: &mut Profile,
    ) -> Result<Vec<f32>> {
        let sizes = self.plan.vocab.sizes();
        if group.size() == 1 {
            return Ok(local);
        }
        let counts: Vec<usize> = sizes.iter().map(|s| s * rows).collect();
        let mut blocks = vec![0f32; counts.iter().sum()]; // [rank][rows, vocab_r]
        prof.time_comm(|| group.all_gather_v(&local, &mut blocks, &counts))?;
        prof.sent_all_gather(std::mem::size_of_val(local.as_slice()), group.size());
        // Row by row, each rank's columns in rank order (no zeroed copy first: a batched
        // decode step gathers [rows, vocab] every step).
        let mut out = Vec::with_capacity(rows * self.cfg.vocab); // [rows, vocab]
        for r in 0..rows {
            let mut block = 0;
            for &s in &sizes {
                out.extend_from_slice(&blocks[block + r * s..block + (r + 1) * s]);
                block += rows * s;
            }
        }
        Ok(out)
    }
}

/// `h [n, hidden] += y`, the summed output `y` of a row-parallel product (f64), rounded to
/// f32 and first RMS-normalised with `post_norm` where the block has one (Gemma); `out` and
/// `normed` (`[n, hidden]`) are scratch for that norm.
fn add_residual(
    h: &mut [f32],
    y: &[f64],
    post_norm: Option<&[f32]>,
    eps: f32,
    out: &mut [f32],
    normed: &mut [f32],
) {
    match post_norm {
        None => {
            for (a, b) in h.iter_mut().zip(y) {
                *a += *b as f32;
            }
        }
        Some(w) => {
            for (o, b) in out.iter_mut().zip(y) {
                *o = *b as f32;
            }
            rms_norm(out, w, eps, normed);
            for (a, b) in h.iter_mut().zip(normed.iter()) {
                *a += *b;
            }
        }
    }
}

/// The tag of the activations one pipeline stage sends the next.
pub const ACTIVATIONS_TAG: u32 = 1;

/// g: sums a partial result over the tp group (nothing to do at tp 1).
fn all_reduce<T: tp_comm::Elem>(x: &mut [T], group: &Group, prof: &mut Profile) -> Result<()> {
    if group.size() > 1 {
        prof.all_reduce(group, |g| g.all_reduce(x, ReduceOp::Sum))?;
        prof.sent_all_reduce(std::mem::size_of_val(x), group.size());
    }
    Ok(())
}

/// Tokens per pass of a prefill chunk's MLP. Its gate/up output (`[rows, 2 ffn_w]`, the
/// largest buffer of a chunk: 20 MB for 512 tokens of Qwen2.5-0.5B at tp 1) is held for this
/// many tokens at a time, and the down projection's partial sums still go over the group once
/// per chunk. The products are per token (the kernels give the same bits at every batch
/// size), so the logits do not depend on it; 128 tokens keep the many-token kernels' weight
/// unpacking amortized over 8 chunks of 16 tokens.
const MLP_ROWS: usize = 128;

/// A row-parallel product and its g, tp-invariant: this rank's blocks summed in f64, the
/// ranks' partial sums added in f64 (in rank order), rounded to f32 only by the caller. Sums
/// of block contributions are exact in f64 for realistic magnitudes, so the result has the
/// same bits however the input columns are split over ranks: greedy text does not change
/// with tp (R10), even though the next layer re-quantizes its activations to 8 bits.
/// `SyncMode::Q8` trades that invariance for ~7x fewer bytes on the wire (`sync.rs`).
fn row_parallel(
    w: &Matrix,
    x: &[f32],
    n: usize,
    sync: SyncMode,
    out: &mut [f64],
    group: &Group,
    prof: &mut Profile,
) -> Result<()> {
    out.fill(0.0);
    w.matmul_wide_acc(x, n, out)?;
    sum_partials(sync, out, group, prof)
}

/// Refuses a weight whose shape in the file is not the table's (a vector may be stored as a
/// `[1, len]` or `[len, 1]` matrix).
fn check_param(ckpt: &dyn Checkpoint, p: &Param) -> Result<()> {
    let m = ckpt.meta(p.name)?;
    let ok = match p.shape {
        Expected::Matrix { rows, cols } => m.rows == rows && m.cols == cols,
        Expected::Vector { len } => {
            m.rows.checked_mul(m.cols) == Some(len) && m.rows.min(m.cols) == 1
        }
    };
    if !ok {
        return Err(ModelError::TensorShape {
            name: format!("{:?} in {}", p.name, ckpt.source()),
            found: vec![m.rows, m.cols],
            expected: p.dims(),
        });
    }
    Ok(())
}
