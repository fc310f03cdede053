//! Where every parameter lives under a (tp, pp, dp) layout: pipeline stages own contiguous
//! layers (Narayanan et al. 2021, §2.2), tensor-parallel ranks own contiguous slices of each
//! weight (Megatron §3, split by heads / FFN columns / vocab rows), data-parallel replicas
//! hold everything of their stage. The parameters and their placements come from tp-spec's
//! one table and shard plan (the FFN in the units inference uses for an f32 checkpoint), so a
//! training rank's shard is the inference rank's. Pure functions of the config, so any rank
//! (or a checkpoint loader) can compute any other rank's shards.

use crate::config::{ModelConfig, TrainModel};
use crate::error::{Result, TrainError};
use std::ops::Range;
use tp_comm::ParallelDims;
use tp_nn::{Partition, Placement};
use tp_spec::{hf_name, EpLayout, ShardPlan, WeightName, DENSE_CHUNK};

/// A rank's place in the run's expert parallelism (`--ep`, [`EpLayout`]; docs/moe.md "Expert
/// parallelism in training").
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EpRank {
    pub layout: EpLayout,
    /// Across replicas: the rank's position in its ep block; `None` is the view of the whole
    /// block's experts of each tp index (what a checkpoint gathers before the tp gather).
    pub pos: Option<usize>,
}

impl EpRank {
    /// Expert-TP (`--ep 1`): every expert sliced over the tp ranks.
    pub fn none() -> EpRank {
        EpRank {
            layout: EpLayout::InsideTp(1),
            pos: None,
        }
    }

    /// Data-parallel rank `dp_rank`'s place at expert-parallel size `ep` under `dims`; the
    /// error names the valid sizes.
    pub fn new(cfg: &ModelConfig, ep: usize, dims: ParallelDims, dp_rank: usize) -> Result<Self> {
        let layout = match cfg.experts {
            Some(e) => EpLayout::new(ep, dims.tp, dims.dp, e.count)?,
            None if ep == 1 => EpLayout::InsideTp(1),
            None => return Err(tp_spec::ShardError::NoExperts { ep }.into()),
        };
        let pos = layout.across().map(|r| r.position(dp_rank));
        Ok(EpRank { layout, pos })
    }

    /// The view of the whole block's experts of each tp index ([`EpRank::pos`] `None`).
    pub fn block_view(&self) -> EpRank {
        EpRank {
            layout: self.layout.clone(),
            pos: None,
        }
    }
}

/// One parameter shard as a rank holds it.
#[derive(Clone, Debug, PartialEq)]
pub struct ParamSpec {
    /// The weight in the parameter table.
    pub weight: WeightName,
    /// Hugging Face tensor name (`model.layers.3.self_attn.q_proj.weight`).
    pub name: String,
    /// Global shape, `[out, in]` for linears.
    pub shape: Vec<usize>,
    pub placement: Placement,
    /// Whether AdamW's weight decay applies (matrices yes, norm weights no).
    pub decay: bool,
    /// Replicated, but each tp rank's backward gives only its heads' share of the gradient
    /// (Qwen3's per-head q/k norms, [`tp_nn::tp_partial_grad`]): summed over tp each step.
    pub tp_partial_grad: bool,
    /// The last stage's copy of a tied embedding (pp > 1; Megatron's embedding group): its
    /// gradient is summed with the first stage's each step, and only the first stage's is
    /// counted in the gradient norm and saved.
    pub tied_copy: bool,
}

impl ParamSpec {
    /// Shape of this rank's shard.
    pub fn local_shape(&self) -> Vec<usize> {
        let mut s = self.shape.clone();
        if let Placement::Sharded { dim, range } = &self.placement {
            s[*dim] = range.len();
        }
        s
    }

    pub fn local_len(&self) -> usize {
        self.local_shape().iter().product()
    }

    pub fn global_len(&self) -> usize {
        self.shape.iter().product()
    }
}

/// The layers of pipeline stage `pp_rank`: a balanced contiguous range.
pub fn stage_layers(layers: usize, pp: usize, pp_rank: usize) -> Result<Range<usize>> {
    Ok(Partition::new(layers, pp, "layers", "layer")
        .map_err(|_| pp_error(layers, pp))?
        .range(pp_rank))
}

fn pp_error(layers: usize, pp: usize) -> TrainError {
    TrainError::Config(format!(
        "{layers} layers cannot give each of {pp} pipeline stages a layer; use 1 <= pp <= {layers}"
    ))
}

/// The tp sizes at which this model can be split (every one from 1 to the head count, the
/// FFN width and the vocabulary, whichever is smallest).
pub fn max_tp(cfg: &ModelConfig) -> usize {
    cfg.heads.min(cfg.ffn).min(cfg.vocab)
}

/// Checks a layout against the model before any rank starts; errors name the valid sizes.
pub fn validate(cfg: &ModelConfig, dims: ParallelDims) -> Result<()> {
    cfg.check_trainable()?;
    if dims.tp == 0 || dims.pp == 0 || dims.dp == 0 {
        return Err(TrainError::Config(
            "--tp, --pp and --dp must each be at least 1".into(),
        ));
    }
    let max = max_tp(cfg);
    if dims.tp > max {
        return Err(TrainError::Config(format!(
            "tp={} is more than this model can split: {} heads, {} FFN columns, {} vocab rows; \
             use 1 <= tp <= {max} (uneven splits are fine)",
            dims.tp, cfg.heads, cfg.ffn, cfg.vocab
        )));
    }
    if dims.pp > cfg.layers {
        return Err(pp_error(cfg.layers, dims.pp));
    }
    Ok(())
}

/// The HF name of a weight outside the blocks (embedding, final norm, LM head; the same in
/// every family trained here).
pub fn global_name(w: WeightName) -> String {
    hf_name(tp_spec::Arch::Llama, w)
}

/// With sequence parallelism every replicated weight (the norms, which see only the rank's
/// positions; the q/k norms and the router, which see only its heads or experts) gets a
/// partial gradient on each of `tp > 1` ranks, summed over tp once a step (Megatron marks the
/// norms `sequence_parallel` and all-reduces their gradients).
pub fn sequence_parallel_grads(specs: &mut [ParamSpec], tp: usize) {
    if tp < 2 {
        return;
    }
    for s in specs {
        if s.placement == Placement::Replicated {
            s.tp_partial_grad = true;
        }
    }
}

/// The vocabulary split of the embedding and the LM head.
pub fn vocab_partition(cfg: &ModelConfig, tp: usize) -> Result<Partition> {
    Ok(shard_plan(cfg, 0, tp)?.vocab)
}

/// Rank `tp_rank`'s shard plan: inference's plan of an f32 checkpoint of `cfg` (the FFN in
/// units of [`DENSE_CHUNK`] columns where they divide it, else single columns).
pub fn shard_plan(cfg: &ModelConfig, tp_rank: usize, tp: usize) -> Result<ShardPlan> {
    Ok(ShardPlan::new(cfg, DENSE_CHUNK, tp_rank, tp)?)
}

/// [`shard_plan`] with the experts placed by `ep`: expert groups inside the tp group, or the
/// rank's whole experts across replicas.
pub fn shard_plan_ep(
    cfg: &ModelConfig,
    tp_rank: usize,
    tp: usize,
    ep: &EpRank,
) -> Result<ShardPlan> {
    let plan = shard_plan(cfg, tp_rank, tp)?;
    match (&ep.layout, cfg.experts) {
        (EpLayout::AcrossReplicas(r), Some(e)) => {
            let shard = r.shard(e, cfg.ffn, DENSE_CHUNK, ep.pos, tp_rank)?;
            Ok(ShardPlan {
                experts: Some(shard),
                ..plan
            })
        }
        (layout, _) => Ok(plan.with_expert_groups(cfg, layout.inside_tp())?),
    }
}

/// Every parameter shard of stage `pp_rank` on `tp_rank`, in the table's order (embedding,
/// then each layer's tensors, then final norm and LM head), placed by the shard plan.
pub fn stage_params(
    cfg: &ModelConfig,
    pp_rank: usize,
    pp: usize,
    tp_rank: usize,
    tp: usize,
) -> Result<Vec<ParamSpec>> {
    stage_params_ep(cfg, pp_rank, pp, tp_rank, tp, &EpRank::none())
}

/// [`stage_params`] with the experts placed by `ep` ([`shard_plan_ep`]).
pub fn stage_params_ep(
    cfg: &ModelConfig,
    pp_rank: usize,
    pp: usize,
    tp_rank: usize,
    tp: usize,
    ep: &EpRank,
) -> Result<Vec<ParamSpec>> {
    let layers = stage_layers(cfg.layers, pp, pp_rank)?;
    let plan = shard_plan_ep(cfg, tp_rank, tp, ep)?;
    let last = pp_rank + 1 == pp;
    let spec = |p: tp_spec::Param, tied_copy: bool| ParamSpec {
        weight: p.name,
        name: hf_name(cfg.arch, p.name),
        shape: p.dims(),
        placement: plan.place(&p),
        decay: p.decay(),
        tp_partial_grad: p.partial_grad,
        tied_copy,
    };
    let mut out: Vec<ParamSpec> = tp_spec::stage_params(cfg, layers, pp_rank == 0, last)
        .into_iter()
        .map(|p| spec(p, false))
        .collect();
    if cfg.tied_embeddings && last && pp > 1 {
        out.extend(
            tp_spec::embed_params(cfg)
                .into_iter()
                .map(|p| spec(p, true)),
        );
    }
    Ok(out)
}

/// The model chunks pipeline rank `pp_rank` of `pp` holds with `virtual_stages` chunks a
/// rank (interleaved 1F1B, Narayanan et al. 2021 §2.2.2): its chunk c is the model's chunk
/// `c * pp + pp_rank` of `pp * virtual_stages`, each a stage of [`stage_layers`]. One chunk:
/// the rank's stage.
pub fn rank_chunks(pp_rank: usize, pp: usize, virtual_stages: usize) -> Vec<usize> {
    (0..virtual_stages.max(1))
        .map(|c| c * pp + pp_rank)
        .collect()
}

/// The pipeline rank of `pp` that holds the model's chunk `chunk` ([`rank_chunks`]).
pub fn chunk_rank(chunk: usize, pp: usize) -> usize {
    chunk % pp.max(1)
}

/// Every parameter shard of pipeline rank `pp_rank` on `tp_rank`: [`stage_params`] of each of
/// its [`rank_chunks`] as a stage of `pp * virtual_stages`, chunk after chunk (with one chunk,
/// the stage's).
pub fn rank_params(
    cfg: &ModelConfig,
    pp_rank: usize,
    pp: usize,
    virtual_stages: usize,
    tp_rank: usize,
    tp: usize,
) -> Result<Vec<ParamSpec>> {
    rank_params_ep(
        cfg,
        pp_rank,
        pp,
        virtual_stages,
        tp_rank,
        tp,
        &EpRank::none(),
    )
}

/// [`rank_params`] with the experts placed by `ep` ([`shard_plan_ep`]).
pub fn rank_params_ep(
    cfg: &ModelConfig,
    pp_rank: usize,
    pp: usize,
    virtual_stages: usize,
    tp_rank: usize,
    tp: usize,
    ep: &EpRank,
) -> Result<Vec<ParamSpec>> {
    let chunks = pp * virtual_stages.max(1);
    let mut out = Vec::new();
    for g in rank_chunks(pp_rank, pp, virtual_stages) {
        out.extend(stage_params_ep(cfg, g, chunks, tp_rank, tp, ep)?);
    }
    Ok(out)
}

/// Checks `virtual_stages` chunks per pipeline rank against the model and the pipeline:
/// interleaving needs a pipeline, a layer for each of the `pp * virtual_stages` chunks, and
/// micro-batches in whole groups of `pp` (Megatron-LM's condition); errors name the valid
/// values.
pub fn validate_virtual_stages(
    cfg: &ModelConfig,
    pp: usize,
    virtual_stages: usize,
    micro_batches: usize,
) -> Result<()> {
    let bad = |m: String| Err(TrainError::Config(m));
    if virtual_stages == 0 {
        return bad("the virtual stages per pipeline rank must be at least 1".into());
    }
    if virtual_stages == 1 {
        return Ok(());
    }
    if pp < 2 {
        return bad(format!(
            "{virtual_stages} virtual stages interleave a pipeline, and this run has one stage; \
             use 1 virtual stage, or 2 or more pipeline stages"
        ));
    }
    let most = cfg.layers / pp;
    if pp * virtual_stages > cfg.layers {
        return bad(format!(
            "{} layers cannot give each of {pp} pipeline stages x {virtual_stages} virtual \
             stages a layer; use 1 to {most} virtual stages at pp={pp}",
            cfg.layers
        ));
    }
    if !micro_batches.is_multiple_of(pp) {
        return bad(format!(
            "the interleaved schedule takes micro-batches in groups of the {pp} pipeline \
             stages, and {micro_batches} micro-batches per replica is not a multiple of {pp}; \
             use {} (or 1 virtual stage)",
            micro_batches.next_multiple_of(pp)
        ));
    }
    Ok(())
}

/// Whether the model's LM head is the embedding held again by the last stage (tied
/// embeddings split over pipeline stages): then the two copies' gradients are summed.
pub fn has_tied_copy(cfg: &ModelConfig, pp: usize) -> bool {
    cfg.tied_embeddings && pp > 1
}

/// Every parameter of the whole model with its global shape, in model order.
pub fn all_params(cfg: &ModelConfig) -> Result<Vec<ParamSpec>> {
    stage_params(cfg, 0, 1, 0, 1)
}

/// Which local indices along the sharded dim this rank counts when a quantity must count
/// each global element once (the gradient norm): replicated tensors count on tp rank 0 only;
/// rows that several ranks hold (replicated KV heads) count on the lowest of them.
/// `placements[r]` is tp rank r's placement of the same tensor.
pub fn owned_local(placements: &[Placement], tp_rank: usize) -> Option<Range<usize>> {
    match placements.get(tp_rank)? {
        Placement::Replicated => Some(if tp_rank == 0 { 0..usize::MAX } else { 0..0 }),
        Placement::Sharded { range, .. } => {
            let lower_end = placements[..tp_rank]
                .iter()
                .filter_map(|p| match p {
                    Placement::Sharded { range, .. } => Some(range.end),
                    Placement::Replicated => None,
                })
                .max()
                .unwrap_or(0);
            let start = range.start.max(lower_end).min(range.end);
            Some(start - range.start..range.end - range.start)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg() -> ModelConfig {
        crate::config::llama(11, 16, 10, 3, 6, 2, 4, 8)
    }

    #[test]
    fn stages_cover_every_layer_once_and_pp_is_bounded() {
        let c = cfg();
        let names: Vec<String> = (0..2)
            .flat_map(|p| stage_params(&c, p, 2, 0, 1).unwrap())
            .map(|s| s.name)
            .collect();
        let all: Vec<String> = all_params(&c)
            .unwrap()
            .into_iter()
            .map(|s| s.name)
            .collect();
        assert_eq!(names, all);
        assert_eq!(all.len(), 1 + 9 * 3 + 2);
        let e = validate(
            &c,
            ParallelDims {
                tp: 1,
                pp: 4,
                dp: 1,
            },
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("use 1 <= pp <= 3"), "{e}");
        let e = validate(
            &c,
            ParallelDims {
                tp: 7,
                pp: 1,
                dp: 1,
            },
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("use 1 <= tp <= 6"), "{e}");
    }

    #[test]
    fn qwen3_layers_add_the_q_and_k_norms_under_their_hf_names() {
        let c = cfg().with_arch(tp_spec::Arch::Qwen3).unwrap();
        let all = all_params(&c).unwrap();
        assert_eq!(all.len(), 1 + 11 * 3 + 2);
        let norms: Vec<&ParamSpec> = all.iter().filter(|s| s.tp_partial_grad).collect();
        let names: Vec<&str> = norms.iter().map(|s| s.name.as_str()).collect();
        assert_eq!(
            names[..2],
            [
                "model.layers.0.self_attn.q_norm.weight",
                "model.layers.0.self_attn.k_norm.weight"
            ]
        );
        assert_eq!(norms.len(), 6);
        for s in norms {
            assert_eq!(
                (&s.shape, &s.placement, s.decay),
                (&vec![4], &Placement::Replicated, false)
            );
        }
        assert!(all_params(&cfg())
            .unwrap()
            .iter()
            .all(|s| !s.tp_partial_grad));
    }

    #[test]
    fn gemma3_layers_add_post_norms_under_gemmas_hf_names() {
        let c = cfg().with_arch(tp_spec::Arch::Gemma3).unwrap();
        let all = all_params(&c).unwrap();
        assert_eq!(all.len(), 1 + 13 * 3 + 2);
        let layer0: Vec<&str> = all[1..14].iter().map(|s| s.name.as_str()).collect();
        for (w, hf) in [
            (
                WeightName::FfnNorm(0),
                "model.layers.0.pre_feedforward_layernorm.weight",
            ),
            (
                WeightName::PostAttnNorm(0),
                "model.layers.0.post_attention_layernorm.weight",
            ),
            (
                WeightName::PostFfnNorm(0),
                "model.layers.0.post_feedforward_layernorm.weight",
            ),
        ] {
            assert_eq!(hf_name(c.arch, w), hf);
            assert!(layer0.contains(&hf), "{hf} missing from {layer0:?}");
        }
        // The post norms are whole on every rank (no partial gradients), without decay.
        for s in all
            .iter()
            .filter(|s| s.name.contains("feedforward_layernorm"))
        {
            assert_eq!(
                (&s.placement, s.decay, s.tp_partial_grad),
                (&Placement::Replicated, false, false)
            );
        }
    }

    #[test]
    fn shards_tile_each_tensor_and_ownership_counts_each_row_once() {
        let c = cfg().with_arch(tp_spec::Arch::Qwen3).unwrap();
        for tp in 1..=6 {
            let per_rank: Vec<Vec<ParamSpec>> = (0..tp)
                .map(|r| stage_params(&c, 0, 1, r, tp).unwrap())
                .collect();
            for i in 0..per_rank[0].len() {
                let places: Vec<Placement> =
                    per_rank.iter().map(|s| s[i].placement.clone()).collect();
                let spec = &per_rank[0][i];
                let mut counted = 0;
                for r in 0..tp {
                    let own = owned_local(&places, r).unwrap();
                    match &places[r] {
                        Placement::Replicated => {
                            counted += if own.is_empty() { 0 } else { spec.global_len() }
                        }
                        Placement::Sharded { dim, range } => {
                            let per_index = spec.global_len() / spec.shape[*dim];
                            counted += own.len().min(range.len()) * per_index;
                        }
                    }
                }
                assert_eq!(counted, spec.global_len(), "tp={tp} {}", spec.name);
            }
        }
    }

    #[test]
    fn the_ffn_is_cut_in_inferences_32_column_units() {
        // 96 FFN columns at tp 2: three 32-column units, 2 | 1 (single columns would give
        // 48 | 48, a shard no inference rank holds).
        let c = crate::config::llama(64, 32, 96, 1, 4, 2, 8, 16);
        let down = |r: usize| {
            stage_params(&c, 0, 1, r, 2)
                .unwrap()
                .into_iter()
                .find(|s| s.weight == WeightName::Down(0))
                .unwrap()
                .placement
        };
        assert_eq!(
            (down(0), down(1)),
            (
                Placement::Sharded {
                    dim: 1,
                    range: 0..64
                },
                Placement::Sharded {
                    dim: 1,
                    range: 64..96
                }
            )
        );
    }

    #[test]
    fn virtual_stages_give_each_rank_every_pth_chunk_and_name_the_valid_counts() {
        let c = cfg(); // 3 layers
        assert_eq!(rank_chunks(1, 2, 3), vec![1, 3, 5]);
        assert_eq!(rank_chunks(0, 3, 1), vec![0]);
        // 8 layers at pp 2 x 2 virtual stages: every tensor on exactly one rank.
        let big = crate::config::llama(11, 16, 10, 8, 6, 2, 4, 8);
        let mut held: Vec<String> = (0..2)
            .flat_map(|r| rank_params(&big, r, 2, 2, 0, 1).unwrap())
            .filter(|s| !s.tied_copy)
            .map(|s| s.name)
            .collect();
        held.sort();
        let mut want: Vec<String> = all_params(&big)
            .unwrap()
            .into_iter()
            .map(|s| s.name)
            .collect();
        want.sort();
        assert_eq!(held, want);
        let e = validate_virtual_stages(&c, 2, 2, 2)
            .unwrap_err()
            .to_string();
        assert!(e.contains("use 1 to 1 virtual stages at pp=2"), "{e}");
        validate_virtual_stages(&big, 2, 4, 4).unwrap();
        validate_virtual_stages(&c, 1, 1, 3).unwrap();
        let e = validate_virtual_stages(&big, 2, 2, 3)
            .unwrap_err()
            .to_string();
        assert!(e.contains("not a multiple of 2; use 4"), "{e}");
        let e = validate_virtual_stages(&big, 1, 2, 4)
            .unwrap_err()
            .to_string();
        assert!(e.contains("one stage"), "{e}");
        // Chunk 1 of rank 0 (the model's chunk 2 of 4) holds layers 4 and 5 of 8.
        let r0 = rank_params(&big, 0, 2, 2, 0, 1).unwrap();
        assert!(r0
            .iter()
            .any(|s| s.name == "model.layers.4.self_attn.q_proj.weight"));
        assert!(!r0.iter().any(|s| s.name.starts_with("model.layers.2.")));
        assert_eq!(r0[0].name, "model.embed_tokens.weight");
    }
}
