//! Saving, a collective over the world: each stage's tp ranks all-gather their shards (of
//! weights and both AdamW moments) into global tensors, stage leaders send them to world
//! rank 0, which writes the directory atomically; then every rank learns whether it worked.
//! A pipeline rank's shards are those of its model chunks ([`rank_params`]): tensors are
//! stored by name, so a checkpoint of any number of virtual stages loads at any other.

use super::atomic::{replace_file, sync_dir, write_synced, SaveHook, SavePoint};
use super::manifest::{Manifest, MANIFEST};
use super::shards::place_local;
use super::{
    step_dir_name, SavedLayout, TensorShards, TrainerState, CONFIG_FILE, LATEST, MODEL_FILE,
    OPTIMIZER_FILE, TOKENIZER_CONFIG_FILE, TOKENIZER_FILE, TRAINER_FILE,
};
use crate::config::{ModelConfig, TrainModel};
use crate::error::{Result, TrainError};
use crate::grads::FlatLayout;
use crate::layout::{rank_params, rank_params_ep, ParamSpec};
use safetensors::tensor::{Dtype, TensorView};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use tp_comm::{CommExt, ProcessGroups, ReduceOp};
use tp_nn::Placement;
use tp_spec::{hf_name, WeightName};

const TAG_CHECKPOINT: u32 = 3;

/// What one rank contributes to a save.
pub struct SaveInputs<'a> {
    /// The checkpoint root (`DIR` holding `latest` and the step directories).
    pub dir: &'a Path,
    pub state: &'a TrainerState,
    pub config: &'a ModelConfig,
    pub tokenizer_json: &'a str,
    /// `tokenizer_config.json` (the chat template), when the tokenizer has one.
    pub tokenizer_config: Option<&'a str>,
    pub groups: &'a ProcessGroups,
    /// Model chunks per pipeline rank (1 without interleaving).
    pub virtual_stages: usize,
    /// The experts' placement of `specs` (across replicas: the block view, the experts
    /// already gathered over the ep group).
    pub ep: &'a crate::layout::EpRank,
    /// This rank's flat shard buffers and their layout (this stage's specs, in order).
    pub specs: &'a [ParamSpec],
    pub layout: &'a FlatLayout,
    pub params: &'a [f32],
    pub exp_avg: &'a [f32],
    pub exp_avg_sq: &'a [f32],
    /// Step directories to keep (older ones are deleted after `latest` moves); 0 keeps all.
    pub keep: usize,
    /// Fault injection on the writing rank.
    pub hook: Option<&'a SaveHook>,
}

/// The shard metadata of a layout, for `trainer.json`.
pub fn saved_layout(
    cfg: &ModelConfig,
    dims: tp_comm::ParallelDims,
    virtual_stages: usize,
) -> Result<SavedLayout> {
    let (tp, pp, dp) = (dims.tp, dims.pp, dims.dp);
    let mut tensors = Vec::new();
    for stage in 0..pp {
        let per_rank: Vec<Vec<ParamSpec>> = (0..tp)
            .map(|t| rank_params(cfg, stage, pp, virtual_stages, t, tp))
            .collect::<Result<_>>()?;
        for (i, spec) in per_rank[0].iter().enumerate() {
            if spec.tied_copy {
                continue;
            }
            let (split_dim, tp_ranges) = match &spec.placement {
                Placement::Replicated => (None, vec![]),
                Placement::Sharded { dim, .. } => (
                    Some(*dim),
                    per_rank
                        .iter()
                        .map(|s| match &s[i].placement {
                            Placement::Sharded { range, .. } => (range.start, range.end),
                            Placement::Replicated => (0, spec.shape[*dim]),
                        })
                        .collect(),
                ),
            };
            tensors.push(TensorShards {
                name: spec.name.clone(),
                shape: spec.shape.clone(),
                pp_stage: stage,
                split_dim,
                tp_ranges,
            });
        }
    }
    Ok(SavedLayout {
        tp,
        pp,
        dp,
        virtual_stages,
        tensors,
    })
}

/// Global (weights, exp_avg, exp_avg_sq) of one stage, concatenated per tensor in spec order.
fn gather_stage(inp: &SaveInputs<'_>) -> Result<Vec<f32>> {
    let g = inp.groups;
    let (tp, pp_rank, pp) = (g.dims.tp, g.coords.pp_rank, g.dims.pp);
    let per_rank: Vec<Vec<ParamSpec>> = (0..tp)
        .map(|t| rank_params_ep(inp.config, pp_rank, pp, inp.virtual_stages, t, tp, inp.ep))
        .collect::<Result<_>>()?;
    let mut out = Vec::new();
    for (i, spec) in inp.specs.iter().enumerate() {
        let r = inp.layout.range(i);
        let mut mine = Vec::with_capacity(3 * r.len());
        for buf in [inp.params, inp.exp_avg, inp.exp_avg_sq] {
            mine.extend_from_slice(&buf[r.clone()]);
        }
        let counts: Vec<usize> = per_rank.iter().map(|s| 3 * s[i].local_len()).collect();
        let mut all = vec![0f32; counts.iter().sum()];
        if tp > 1 {
            g.tp.all_gather_v(&mine, &mut all, &counts)?;
        } else {
            all.copy_from_slice(&mine);
        }
        let n = spec.global_len();
        let mut global = vec![0f32; 3 * n];
        let mut at = 0;
        for (t, specs) in per_rank.iter().enumerate() {
            let len = specs[i].local_len();
            for k in 0..3 {
                let src = &all[at + k * len..at + (k + 1) * len];
                place_local(
                    &mut global[k * n..(k + 1) * n],
                    &spec.shape,
                    &per_rank[t][i].placement,
                    src,
                );
            }
            at += 3 * len;
        }
        out.extend_from_slice(&global);
    }
    Ok(out)
}

/// Collective: every rank of the world calls it with the same state. Returns the new step
/// directory on world rank 0 (`None` elsewhere).
pub fn save(inp: &SaveInputs<'_>) -> Result<Option<PathBuf>> {
    let g = inp.groups;
    let leader = g.coords.dp_rank == 0 && g.coords.tp_rank == 0;
    let writer = g.world.rank() == 0;
    let mut stages: Vec<Vec<f32>> = Vec::new();
    if g.coords.dp_rank == 0 {
        let mine = gather_stage(inp)?;
        if leader && g.coords.pp_rank > 0 {
            g.pp.send(&mine, 0, TAG_CHECKPOINT)?;
        }
        if writer {
            stages.push(mine);
            for q in 1..g.dims.pp {
                let n: usize =
                    rank_params(inp.config, q, g.dims.pp, inp.virtual_stages, 0, g.dims.tp)?
                        .iter()
                        .map(|s| 3 * s.global_len())
                        .sum();
                let mut buf = vec![0f32; n];
                g.pp.recv(&mut buf, q, TAG_CHECKPOINT)?;
                stages.push(buf);
            }
        }
    }
    let written = if writer {
        Some(write_checkpoint(inp, &stages))
    } else {
        None
    };
    // Everyone learns whether the write worked, so no rank trains on believing it saved.
    let mut failed = [u32::from(matches!(written, Some(Err(_))))];
    g.world.all_reduce(&mut failed, ReduceOp::Max)?;
    match written {
        Some(Ok(dir)) => Ok(Some(dir)),
        Some(Err(e)) => Err(e),
        None if failed[0] != 0 => Err(TrainError::checkpoint(
            inp.dir,
            "rank 0 could not write the checkpoint (its error says why)",
        )),
        None => Ok(None),
    }
}

fn le_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// Serializes named global f32 tensors as safetensors with `{"format": "pt"}` metadata.
fn safetensors_bytes(tensors: &[(String, Vec<usize>, &[f32])], path: &Path) -> Result<Vec<u8>> {
    let bytes: Vec<Vec<u8>> = tensors.iter().map(|(_, _, d)| le_bytes(d)).collect();
    let views = tensors
        .iter()
        .zip(&bytes)
        .map(|((name, shape, _), b)| {
            TensorView::new(Dtype::F32, shape.clone(), b)
                .map(|v| (name.clone(), v))
                .map_err(|e| TrainError::checkpoint(path, format!("tensor {name}: {e}")))
        })
        .collect::<Result<Vec<_>>>()?;
    let meta = HashMap::from([("format".to_string(), "pt".to_string())]);
    safetensors::serialize(views, Some(meta))
        .map_err(|e| TrainError::checkpoint(path, format!("cannot serialize: {e}")))
}

fn write_checkpoint(inp: &SaveInputs<'_>, stages: &[Vec<f32>]) -> Result<PathBuf> {
    let dir = inp.dir;
    std::fs::create_dir_all(dir).map_err(|e| TrainError::io("create directory", dir, e))?;
    remove_stale_temporaries(dir);
    let name = step_dir_name(inp.state.step);
    let tmp = dir.join(format!(".tmp-{name}-{}", std::process::id()));
    std::fs::create_dir(&tmp).map_err(|e| TrainError::io("create directory", &tmp, e))?;

    // Global tensors of every pipeline rank (safetensors stores them sorted by name).
    let mut model = Vec::new();
    let mut optim = Vec::new();
    for (q, flat) in stages.iter().enumerate() {
        let mut at = 0;
        let d = inp.groups.dims;
        for spec in rank_params(inp.config, q, d.pp, inp.virtual_stages, 0, d.tp)? {
            let n = spec.global_len();
            let part = &flat[at..at + 3 * n];
            at += 3 * n;
            if spec.tied_copy {
                // The same tensor as the first stage's embedding (and its moments).
                continue;
            }
            model.push((spec.name.clone(), spec.shape.clone(), &part[..n]));
            optim.push((
                format!("{}.exp_avg", spec.name),
                spec.shape.clone(),
                &part[n..2 * n],
            ));
            optim.push((
                format!("{}.exp_avg_sq", spec.name),
                spec.shape.clone(),
                &part[2 * n..],
            ));
        }
    }
    // The aux-loss-free router bias of each MoE layer beside its router, so inference routes
    // as training did (it is also trainer state, in trainer.json, for resuming).
    let bias_names: Vec<String> = (0..inp.state.moe_bias.len())
        .map(|l| hf_name(inp.config.arch, WeightName::RouterBias(l)))
        .collect();
    for (name, bias) in bias_names.iter().zip(&inp.state.moe_bias) {
        if !bias.is_empty() {
            model.push((name.clone(), vec![bias.len()], &bias[..]));
        }
    }
    let trainer = serde_json::to_string_pretty(inp.state)
        .map_err(|e| TrainError::checkpoint(&tmp, format!("cannot encode trainer.json: {e}")))?;
    let mut files: Vec<(&str, Vec<u8>)> = vec![
        (CONFIG_FILE, inp.config.hf_json_text().into_bytes()),
        (TOKENIZER_FILE, inp.tokenizer_json.as_bytes().to_vec()),
        (
            MODEL_FILE,
            safetensors_bytes(&model, &tmp.join(MODEL_FILE))?,
        ),
        (
            OPTIMIZER_FILE,
            safetensors_bytes(&optim, &tmp.join(OPTIMIZER_FILE))?,
        ),
        (TRAINER_FILE, (trainer + "\n").into_bytes()),
    ];
    if let Some(c) = inp.tokenizer_config {
        files.push((TOKENIZER_CONFIG_FILE, c.as_bytes().to_vec()));
    }
    let step = inp.state.step;
    let at = |p: SavePoint<'_>| inp.hook.map_or(Ok(()), |h| h(step, p));
    let mut manifest = Manifest::default();
    for (file, bytes) in &files {
        write_synced(&tmp.join(file), file, bytes, &at)?;
        manifest.add(file, bytes);
    }
    write_synced(
        &tmp.join(MANIFEST),
        MANIFEST,
        manifest.to_json().as_bytes(),
        &at,
    )?;
    sync_dir(&tmp)?;

    let final_dir = dir.join(&name);
    if final_dir.exists() {
        // A re-save of the same step: move the old one aside (it stays whole until the new
        // one is in place).
        let old = dir.join(format!(".old-{name}-{}", std::process::id()));
        std::fs::rename(&final_dir, &old).map_err(|e| TrainError::io("rename", &final_dir, e))?;
    }
    std::fs::rename(&tmp, &final_dir).map_err(|e| TrainError::io("rename", &tmp, e))?;
    sync_dir(dir)?;
    at(SavePoint::Renamed)?;
    replace_file(dir, LATEST, &format!("{name}\n"))?;
    at(SavePoint::LatestWritten)?;
    remove_stale_temporaries(dir);
    prune(dir, inp.keep, &name);
    Ok(final_dir)
}

/// Removes temporary directories left by interrupted saves (never a complete checkpoint).
fn remove_stale_temporaries(dir: &Path) {
    if let Ok(entries) = std::fs::read_dir(dir) {
        for e in entries.flatten() {
            let n = e.file_name().to_string_lossy().to_string();
            if n.starts_with(".tmp-step-") || n.starts_with(".old-step-") {
                let _ = std::fs::remove_dir_all(e.path());
            }
        }
    }
}

/// Deletes all but the newest `keep` step directories (never `current`).
fn prune(dir: &Path, keep: usize, current: &str) {
    if keep == 0 {
        return;
    }
    let mut steps: Vec<String> = std::fs::read_dir(dir)
        .map(|it| {
            it.flatten()
                .map(|e| e.file_name().to_string_lossy().to_string())
                .filter(|n| n.starts_with("step-"))
                .collect()
        })
        .unwrap_or_default();
    steps.sort();
    let excess = steps.len().saturating_sub(keep);
    for n in steps.into_iter().take(excess) {
        if n != current {
            let _ = std::fs::remove_dir_all(dir.join(n));
        }
    }
}
