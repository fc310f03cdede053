//! The 3D mesh: one world cut into tensor-, pipeline- and data-parallel groups.
//!
//! Rank order follows Megatron-LM's default (tp innermost, then dp, then pp outermost):
//! `world_rank = pp_rank * (dp * tp) + dp_rank * tp + tp_rank`, so a tp group is a run of
//! consecutive ranks (one node's GPUs, where bandwidth is highest).

use crate::communicator::Group;
use crate::error::{CommError, Result};

/// Sizes of the three parallel dimensions.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ParallelDims {
    pub tp: usize,
    pub pp: usize,
    pub dp: usize,
}

impl ParallelDims {
    pub fn world_size(&self) -> usize {
        self.tp * self.pp * self.dp
    }

    /// This world rank's coordinates.
    pub fn coords(&self, world_rank: usize) -> MeshCoords {
        MeshCoords {
            tp_rank: world_rank % self.tp,
            dp_rank: world_rank / self.tp % self.dp,
            pp_rank: world_rank / (self.tp * self.dp),
        }
    }

    /// The world rank at these coordinates.
    pub fn world_rank(&self, c: MeshCoords) -> usize {
        c.pp_rank * self.dp * self.tp + c.dp_rank * self.tp + c.tp_rank
    }
}

/// Where a rank sits in the mesh.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MeshCoords {
    pub tp_rank: usize,
    pub pp_rank: usize,
    pub dp_rank: usize,
}

/// One rank's groups.
#[derive(Clone, Debug)]
pub struct ProcessGroups {
    pub dims: ParallelDims,
    pub coords: MeshCoords,
    pub world: Group,
    pub tp: Group,
    pub pp: Group,
    pub dp: Group,
}

impl ProcessGroups {
    /// Collective over `world`: every rank calls it with the same `dims`.
    pub fn new(world: Group, dims: ParallelDims) -> Result<Self> {
        let size = world.size();
        if dims.tp == 0 || dims.pp == 0 || dims.dp == 0 || dims.world_size() != size {
            return Err(CommError::InvalidArgument {
                rank: world.rank(),
                message: format!(
                    "tp={} x pp={} x dp={} = {} ranks, but the world has {size}; choose sizes \
                     whose product is {size}",
                    dims.tp,
                    dims.pp,
                    dims.dp,
                    dims.tp * dims.pp * dims.dp
                ),
            });
        }
        let c = dims.coords(world.rank());
        let split = |color: usize, key: usize| -> Result<Group> {
            world
                .split(Some(color as u32), key)?
                .ok_or_else(|| CommError::InvalidArgument {
                    rank: world.rank(),
                    message: "split with a color returned no group".into(),
                })
        };
        // tp group: same (pp, dp); pp group: same (tp, dp); dp group: same (tp, pp).
        let tp = split(c.pp_rank * dims.dp + c.dp_rank, c.tp_rank)?;
        let pp = split(c.dp_rank * dims.tp + c.tp_rank, c.pp_rank)?;
        let dp = split(c.pp_rank * dims.tp + c.tp_rank, c.dp_rank)?;
        Ok(ProcessGroups {
            dims,
            coords: c,
            world,
            tp,
            pp,
            dp,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn coordinates_round_trip_with_tp_innermost() {
        let d = ParallelDims {
            tp: 2,
            pp: 3,
            dp: 2,
        };
        for r in 0..d.world_size() {
            assert_eq!(d.world_rank(d.coords(r)), r);
        }
        assert_eq!(
            d.coords(1),
            MeshCoords {
                tp_rank: 1,
                pp_rank: 0,
                dp_rank: 0
            }
        );
        assert_eq!(
            d.coords(2),
            MeshCoords {
                tp_rank: 0,
                pp_rank: 0,
                dp_rank: 1
            }
        );
        assert_eq!(
            d.coords(4),
            MeshCoords {
                tp_rank: 0,
                pp_rank: 1,
                dp_rank: 0
            }
        );
    }
}
