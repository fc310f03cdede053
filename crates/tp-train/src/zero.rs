//! Megatron-LM's distributed optimizer (ZeRO stage 1, Rajbhandari et al. 2020): the flat
//! buffer of a stage's shards is cut into `dp` contiguous slices, one per data-parallel rank.
//! Gradients are reduce-scattered over dp (each rank gets the sum of its slice only, bucket
//! by bucket like the all-reduce), each rank keeps AdamW's moments and the f32 master weights
//! of its slice and updates only that, and the updated slices are all-gathered into every
//! replica's model, bucket by bucket. The sums are the all-reduce's, so training is the same.

use crate::error::{Result, TrainError};
use crate::grads::FlatLayout;
use crate::layout::ParamSpec;
use crate::optim::{AdamW, AdamWConfig};
use std::ops::Range;
use tp_comm::{CommExt, Group, ReduceOp};

/// Which slice of the flat buffer each data-parallel rank owns: near-equal contiguous slices
/// in rank order (the first `total % dp` one element longer), so any length splits.
#[derive(Clone, Debug, PartialEq)]
pub struct DpSlices {
    /// Element counts per dp rank; they add up to the buffer's length.
    counts: Vec<usize>,
    rank: usize,
}

impl DpSlices {
    pub fn new(total: usize, dp: usize, rank: usize) -> Result<DpSlices> {
        if dp == 0 || rank >= dp {
            return Err(TrainError::Config(format!(
                "internal: data-parallel rank {rank} of {dp}"
            )));
        }
        let counts = (0..dp)
            .map(|r| total / dp + usize::from(r < total % dp))
            .collect();
        Ok(DpSlices { counts, rank })
    }

    pub fn counts(&self) -> &[usize] {
        &self.counts
    }

    /// The slice of dp rank `r`.
    pub fn range_of(&self, r: usize) -> Range<usize> {
        let start: usize = self.counts[..r].iter().sum();
        start..start + self.counts[r]
    }

    /// This rank's slice.
    pub fn mine(&self) -> Range<usize> {
        self.range_of(self.rank)
    }

    /// Each rank's element count inside `window` of the flat buffer (its slice cut to it),
    /// and this rank's part of the window as offsets into its slice: the counts and the
    /// local part of one bucket's collective.
    pub fn within(&self, window: Range<usize>) -> (Vec<usize>, Range<usize>) {
        // Empty (start >= end) where a slice misses the window.
        let cut = |s: Range<usize>| s.start.max(window.start)..s.end.min(window.end);
        let counts = (0..self.counts.len())
            .map(|r| cut(self.range_of(r)).len())
            .collect();
        let mine = self.mine();
        let part = cut(mine.clone());
        let local = if part.is_empty() {
            0..0
        } else {
            part.start - mine.start..part.end - mine.start
        };
        (counts, local)
    }

    /// Collective over `dp`: sums `flat` over the replicas in buckets of `bucket_elems`
    /// (one reduce-scatter per bucket, each rank receiving the part of the bucket inside its
    /// slice). Afterwards `flat[self.mine()]` holds the sum and every other element is 0, so
    /// a sum of squares over `flat` counts this rank's slice only. Returns the number of calls.
    pub fn reduce_scatter(
        &self,
        flat: &mut [f32],
        dp: &Group,
        bucket_elems: usize,
    ) -> Result<usize> {
        let total: usize = self.counts.iter().sum();
        if flat.len() != total {
            return Err(TrainError::Config(format!(
                "internal: a gradient buffer of {} elements for slices of {total}",
                flat.len()
            )));
        }
        let mine = self.mine();
        let mut summed = vec![0f32; mine.len()];
        let mut calls = 0;
        let mut at = 0;
        while at < total {
            let end = (at + bucket_elems.max(1)).min(total);
            let (counts, local) = self.within(at..end);
            let recv = &mut summed[local];
            dp.reduce_scatter_v(&flat[at..end], recv, &counts, ReduceOp::Sum)?;
            calls += 1;
            at = end;
        }
        flat.fill(0.0);
        flat[mine].copy_from_slice(&summed);
        Ok(calls)
    }

    /// Collective over `dp`: every rank's slice `mine` (this rank's, `self.mine().len()`
    /// elements) into the whole buffer `flat` on every rank.
    pub fn all_gather(&self, mine: &[f32], flat: &mut [f32], dp: &Group) -> Result<()> {
        dp.all_gather_v(mine, flat, &self.counts)?;
        Ok(())
    }
}

/// This rank's part of the distributed optimizer: its slice, and the master weights of it.
/// (AdamW's moments of the slice are the trainer's [`AdamW`], sized to the slice.) The
/// replicas' weights are the model's tensors, set from the gathered slices each step; no
/// rank keeps a whole flat copy.
#[derive(Clone, Debug)]
pub struct DistributedOptimizer {
    pub slices: DpSlices,
    /// f32 master weights of this rank's slice: the only copy that AdamW updates.
    pub master: Vec<f32>,
}

impl DistributedOptimizer {
    /// The slice of `params` (the whole flat buffer) that dp rank `rank` of `dp` owns.
    pub fn new(params: &[f32], dp: usize, rank: usize) -> Result<DistributedOptimizer> {
        let slices = DpSlices::new(params.len(), dp, rank)?;
        let master = params[slices.mine()].to_vec();
        Ok(DistributedOptimizer { slices, master })
    }

    /// One AdamW update of this rank's slice of the master weights from `grads` (the whole
    /// buffer, reduce-scattered: only the slice is read).
    #[allow(clippy::too_many_arguments)] // the buffers, their layout, the step's scalars
    pub fn update(
        &mut self,
        adam: &mut AdamW,
        grads: &[f32],
        layout: &FlatLayout,
        specs: &[ParamSpec],
        cfg: &AdamWConfig,
        lr: f64,
        grad_scale: f64,
    ) {
        let mine = self.slices.mine();
        let g = &grads[mine.clone()];
        adam.update_window(
            &mut self.master,
            g,
            mine,
            layout,
            specs,
            cfg,
            lr,
            grad_scale,
        );
    }

    /// Collective over `dp`: the updated weights of every parameter, all-gathered from the
    /// replicas' slices in buckets of whole parameters of about `bucket_elems` elements (no
    /// whole flat weight buffer is ever held); `set(i, w)` receives parameter i's shard.
    pub fn all_gather_params(
        &self,
        layout: &FlatLayout,
        dp: &Group,
        bucket_elems: usize,
        set: &mut dyn FnMut(usize, &[f32]) -> Result<()>,
    ) -> Result<()> {
        let mut first = 0;
        while first < layout.len() {
            // Parameters first..end, at least one, up to about a bucket.
            let start = layout.range(first).start;
            let mut end = first + 1;
            while end < layout.len() && layout.range(end).end - start <= bucket_elems.max(1) {
                end += 1;
            }
            let stop = layout.range(end - 1).end;
            let (counts, local) = self.slices.within(start..stop);
            let mut bucket = vec![0f32; stop - start];
            dp.all_gather_v(&self.master[local], &mut bucket, &counts)?;
            for i in first..end {
                let r = layout.range(i);
                set(i, &bucket[r.start - start..r.end - start])?;
            }
            first = end;
        }
        Ok(())
    }

    /// Collective over `dp`: the whole buffer of a per-slice array (master weights or a
    /// moment) for a save.
    pub fn gather(&self, slice: &[f32], dp: &Group) -> Result<Vec<f32>> {
        let mut all = vec![0f32; self.slices.counts().iter().sum()];
        self.slices.all_gather(slice, &mut all, dp)?;
        Ok(all)
    }
}

/// Optimizer memory of one rank: the f32 arrays that AdamW reads and writes (first and
/// second moments and the master weights), by the lengths this rank holds.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct OptimizerMemory {
    /// Elements of this rank's flat shard buffer (its share of the model under tp x pp).
    pub local_params: usize,
    /// Elements of each of the three arrays this rank holds (all of `local_params`, or its
    /// slice under the distributed optimizer).
    pub held: usize,
    pub dp: usize,
    pub distributed: bool,
}

impl OptimizerMemory {
    /// Bytes of m, v and master: 3 arrays x 4 bytes x `held`.
    pub fn bytes(&self) -> usize {
        12 * self.held
    }

    /// The formula: 12 x P bytes, or 12 x P / dp with the distributed optimizer (P: this
    /// rank's parameter elements).
    pub fn formula_bytes(&self) -> f64 {
        let p = 12.0 * self.local_params as f64;
        if self.distributed {
            p / self.dp as f64
        } else {
            p
        }
    }

    /// One line for a run's start.
    pub fn line(&self) -> String {
        let mib = |b: f64| b / (1u64 << 20) as f64;
        format!(
            "optimizer state on rank 0: AdamW m, v and f32 master weights, 3 x {} elements x 4 \
             bytes = {:.2} MiB ({}; 12 x P{} = {:.2} MiB for its P = {} parameter elements; \
             {:.2} MiB {})",
            self.held,
            mib(self.bytes() as f64),
            if self.distributed {
                format!("sharded over dp={}", self.dp)
            } else {
                "not sharded".into()
            },
            if self.distributed { " / dp" } else { "" },
            mib(self.formula_bytes()),
            self.local_params,
            if self.distributed {
                mib(12.0 * self.local_params as f64)
            } else {
                mib(12.0 * self.local_params as f64 / self.dp as f64)
            },
            if self.distributed {
                "without the distributed optimizer"
            } else {
                "with the distributed optimizer"
            }
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tp_comm::local::{run, LocalOptions};

    #[test]
    fn slices_cover_any_length_in_rank_order() {
        let s = DpSlices::new(10, 3, 1).unwrap();
        assert_eq!(s.counts(), &[4, 3, 3]);
        assert_eq!(
            (s.range_of(0), s.mine(), s.range_of(2)),
            (0..4, 4..7, 7..10)
        );
        let s = DpSlices::new(2, 4, 3).unwrap();
        assert_eq!((s.counts(), s.mine()), (&[1, 1, 0, 0][..], 2..2));
        assert!(DpSlices::new(4, 2, 2).is_err());
        // A window [3, 8) over slices [0, 4) [4, 7) [7, 10) seen from rank 1 and rank 0.
        let s = DpSlices::new(10, 3, 1).unwrap();
        assert_eq!(s.within(3..8), (vec![1, 3, 1], 0..3));
        assert_eq!(s.within(8..10), (vec![0, 0, 2], 0..0));
        let s = DpSlices::new(10, 3, 0).unwrap();
        assert_eq!(s.within(3..8), (vec![1, 3, 1], 3..4));
    }

    /// The bucketed reduce-scatter gives each rank the all-reduce's sums on its slice (buckets
    /// that cut a slice, and a rank with no part in a bucket), zeros elsewhere.
    #[test]
    fn reduce_scatter_gives_each_slice_the_sum_over_replicas() {
        let outs = run(3, LocalOptions::default(), |g| {
            let s = DpSlices::new(11, 3, g.rank()).unwrap();
            let mut flat: Vec<f32> = (0..11).map(|i| (i + 100 * g.rank()) as f32).collect();
            let calls = s.reduce_scatter(&mut flat, &g, 3)?;
            Ok::<_, TrainError>((calls, s.mine(), flat))
        })
        .unwrap();
        for o in outs {
            let (calls, mine, flat) = o.unwrap().unwrap();
            assert_eq!(calls, 4); // 11 elements in buckets of 3
            for (i, x) in flat.iter().enumerate() {
                let want = if mine.contains(&i) {
                    (3 * i + 300) as f32
                } else {
                    0.0
                };
                assert_eq!(*x, want, "element {i}");
            }
        }
    }
}
