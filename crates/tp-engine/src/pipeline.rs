//! Pipeline-parallel inference on the engine's side: the groups a rank of a pp x tp mesh
//! works in, and the last stage's logits brought to rank 0 (which samples). The stage split
//! itself is tp-spec's (`Stage`, balanced by bytes) and the forward tp-models'
//! (`ShardedModel::forward_stage`).

use crate::error::Result;
use tp_comm::{CommExt, Group, ParallelDims, ProcessGroups};
use tp_models::{Profile, ShardedModel};

/// The tag of the logits the last stage sends rank 0.
pub const LOGITS_TAG: u32 = 2;

/// The groups of world rank `world.rank()` in a mesh of `pp` stages of `tp` ranks (tp
/// innermost: a stage is consecutive ranks): its stage's tp group and, when `pp > 1`, its
/// pipeline group (rank = stage). Collective over `world`.
pub fn stage_groups(world: &Group, tp: usize, pp: usize) -> Result<(Group, Option<Group>)> {
    if pp == 1 {
        return Ok((world.clone(), None));
    }
    let g = ProcessGroups::new(world.clone(), ParallelDims { tp, pp, dp: 1 })?;
    Ok((g.tp, Some(g.pp)))
}

/// After a forward: the last stage gathers its `[rows, vocab_local]` logits over its tp
/// group and its tp rank 0 sends the `[rows, vocab]` rows to stage 0's tp rank 0 (world rank
/// 0), which returns them; every other rank returns none.
pub fn logits_to_leader(
    model: &ShardedModel,
    local: Vec<f32>,
    rows: usize,
    tp: &Group,
    pipe: &Group,
    prof: &mut Profile,
) -> Result<Vec<f32>> {
    let stage = model.stage();
    let last = pipe.size() - 1;
    if stage.is_last() {
        let full = model.gather_logits(local, rows, tp, prof)?;
        if tp.rank() == 0 {
            prof.time_comm(|| pipe.send(&full, 0, LOGITS_TAG))?;
        }
        return Ok(Vec::new());
    }
    if stage.is_first() && tp.rank() == 0 {
        let mut full = vec![0f32; rows * model.config().vocab]; // [rows, vocab]
        prof.time_comm(|| pipe.recv(&mut full, last, LOGITS_TAG))?;
        return Ok(full);
    }
    Ok(Vec::new())
}
