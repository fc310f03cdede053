//! Pipeline-parallel inference on the engine's side: the groups a rank of a pp x tp mesh
//! works in. The stage split is tp-spec's (`Stage`, `StageSplit`: balanced by compute, or
//! given; `stage_of_rank`: stages of consecutive ranks, rank 0 on the last so the logits stay
//! on the leader's host) and the forward tp-models' (`ShardedModel::forward_stage`).

use crate::error::Result;
use tp_comm::{CommError, Group};

/// The groups of world rank `world.rank()` in a mesh of `pp` stages of `tp` ranks: its
/// stage's tp group (ranks by tp rank) and, when `pp > 1`, its pipeline group (the same tp
/// rank of every stage, ranks by stage index). Collective over `world`.
pub fn stage_groups(world: &Group, tp: usize, pp: usize) -> Result<(Group, Option<Group>)> {
    if pp == 1 {
        return Ok((world.clone(), None));
    }
    let (stage, tp_rank) = tp_spec::stage_of_rank(world.rank(), tp, pp);
    let split = |color: usize, key: usize| -> Result<Group> {
        world.split(Some(color as u32), key)?.ok_or_else(|| {
            CommError::InvalidArgument {
                rank: world.rank(),
                message: "split with a color returned no group".into(),
            }
            .into()
        })
    };
    let tp_group = split(stage, tp_rank)?;
    let pipe = split(tp_rank, stage)?;
    Ok((tp_group, Some(pipe)))
}
