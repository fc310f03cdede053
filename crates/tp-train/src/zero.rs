//! Megatron-LM's distributed optimizer (ZeRO stage 1, Rajbhandari et al. 2020): the flat
//! buffer of a stage's shards is cut into `dp` contiguous slices, one per data-parallel rank.
//! Gradients are reduce-scattered over dp (each rank gets the sum of its slice only, bucket
//! by bucket like the all-reduce), each rank keeps AdamW's moments and the f32 master weights
//! of its slice and updates only that, and the updated slices are all-gathered into every
//! replica's model, bucket by bucket. The sums are the all-reduce's, so training is the same.
//! With experts over data-parallel replicas the buffer has two parts with different
//! replicas ([`Replicas`]): the dense parameters, sharded over dp, and the rank's experts,
//! sharded over their expert-data-parallel group (Megatron-Core's separate expert
//! distributed optimizer); each part is packed, reduce-scattered and gathered over its group.

use crate::error::{Result, TrainError};
use crate::grads::{self, FlatLayout};
use crate::layout::ParamSpec;
use crate::optim::{AdamW, AdamWConfig};
use std::borrow::Cow;
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

/// The replicas a part of the flat buffer is sharded over: all of dp for the dense
/// parameters (every replica holds them), the expert-data-parallel group for the experts of
/// a rank when experts are spread over the replicas of an ep block (only the ranks at the
/// same place in the other blocks hold them; Megatron-Core's expert distributed optimizer).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Replicas {
    Dp,
    Edp,
}

/// The groups a rank's parts are sharded over ([`Replicas`]).
#[derive(Clone, Copy)]
pub struct ReplicaGroups<'g> {
    pub dp: &'g Group,
    /// The expert-data-parallel group (experts across replicas only).
    pub edp: Option<&'g Group>,
}

impl<'g> ReplicaGroups<'g> {
    fn of(&self, r: Replicas) -> Result<&'g Group> {
        match r {
            Replicas::Dp => Ok(self.dp),
            Replicas::Edp => self.edp.ok_or_else(|| {
                TrainError::Config("internal: an expert part without an edp group".into())
            }),
        }
    }
}

/// One part of a rank's flat buffer (some of its parameters, packed in order) sharded over
/// one replica group: the part's slice, its master weights and AdamW's moments of it.
#[derive(Clone, Debug)]
pub struct ShardedPart {
    /// Indices of the part's parameters in the rank's flat layout, ascending.
    pub which: Vec<usize>,
    /// The part's own specs and layout (its parameters packed in `which`'s order).
    pub specs: Vec<ParamSpec>,
    pub layout: FlatLayout,
    pub replicas: Replicas,
    /// The part's buffer cut over the group's ranks.
    pub slices: DpSlices,
    /// f32 master weights of this rank's slice: the only copy that AdamW updates.
    pub master: Vec<f32>,
    /// AdamW's moments of the slice.
    pub adam: AdamW,
    /// The part is the whole flat buffer (no packing needed).
    whole: bool,
}

impl ShardedPart {
    /// This rank's slice of the part out of a whole flat buffer of the rank's layout
    /// (`flat[which]` packed, then `[slices.mine()]`), copying only the slice's elements.
    fn pack_mine<'b>(&self, flat: &'b [f32], layout: &FlatLayout) -> Cow<'b, [f32]> {
        let mine = self.slices.mine();
        if self.whole {
            return Cow::Borrowed(&flat[mine]);
        }
        let mut out = Vec::with_capacity(mine.len());
        let mut at = 0; // offset of parameter i in the packed part
        for &i in &self.which {
            let r = layout.range(i);
            let (lo, hi) = (mine.start.max(at), mine.end.min(at + r.len()));
            if lo < hi {
                out.extend_from_slice(&flat[r.start + lo - at..r.start + hi - at]);
            }
            at += r.len();
        }
        Cow::Owned(out)
    }
}

/// This rank's part of the distributed optimizer: one [`ShardedPart`] over dp, or with
/// experts across replicas two (dense over dp, the rank's experts over edp). The replicas'
/// weights are the model's tensors, set from the gathered slices each step; no rank keeps a
/// whole flat copy.
#[derive(Clone, Debug)]
pub struct DistributedOptimizer {
    pub parts: Vec<ShardedPart>,
}

impl DistributedOptimizer {
    /// The slices of `params` (the whole flat buffer of `layout`) this rank owns: `parts`
    /// lists each part's parameter indices, replicas, group size and rank in that group.
    pub fn new(
        params: &[f32],
        layout: &FlatLayout,
        specs: &[ParamSpec],
        parts: Vec<(Vec<usize>, Replicas, usize, usize)>,
    ) -> Result<DistributedOptimizer> {
        let parts = parts
            .into_iter()
            .map(|(which, replicas, size, rank)| {
                let whole =
                    which.len() == layout.len() && which.iter().enumerate().all(|(k, &i)| k == i);
                let specs: Vec<ParamSpec> = which.iter().map(|&i| specs[i].clone()).collect();
                let part_layout = FlatLayout::new(&specs);
                let slices = DpSlices::new(part_layout.total(), size, rank)?;
                let adam = AdamW::new(slices.mine().len());
                let mut part = ShardedPart {
                    which,
                    specs,
                    layout: part_layout,
                    replicas,
                    slices,
                    master: Vec::new(),
                    adam,
                    whole,
                };
                part.master = part.pack_mine(params, layout).into_owned();
                Ok(part)
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(DistributedOptimizer { parts })
    }

    /// Elements of the optimizer arrays this rank holds (each part's slice).
    pub fn held(&self) -> usize {
        self.parts.iter().map(|p| p.master.len()).sum()
    }

    /// Collective over each part's group: sums `flat` (whole gradients of `layout`) over the
    /// replicas, part by part, in buckets of `bucket_elems` ([`DpSlices::reduce_scatter`]).
    /// Afterwards each part's slice holds the sum and every other element is 0, so a sum of
    /// squares over `flat` counts this rank's slices only. Returns the number of calls.
    pub fn reduce_scatter(
        &self,
        flat: &mut [f32],
        layout: &FlatLayout,
        groups: ReplicaGroups<'_>,
        bucket_elems: usize,
    ) -> Result<usize> {
        let mut calls = 0;
        for p in &self.parts {
            let g = groups.of(p.replicas)?;
            if p.whole {
                calls += p.slices.reduce_scatter(flat, g, bucket_elems)?;
            } else {
                let mut buf = grads::pack(flat, layout, &p.which);
                calls += p.slices.reduce_scatter(&mut buf, g, bucket_elems)?;
                grads::unpack(&buf, flat, layout, &p.which);
            }
        }
        Ok(calls)
    }

    /// One AdamW update of each part's slice of the master weights from `grads` (the whole
    /// buffer of `layout`, reduce-scattered: only the slices are read).
    pub fn update(
        &mut self,
        grads: &[f32],
        layout: &FlatLayout,
        cfg: &AdamWConfig,
        lr: f64,
        grad_scale: f64,
    ) {
        for p in &mut self.parts {
            let mine = p.slices.mine();
            let g = p.pack_mine(grads, layout);
            p.adam.update_window(
                &mut p.master,
                &g,
                mine,
                &p.layout,
                &p.specs,
                cfg,
                lr,
                grad_scale,
            );
        }
    }

    /// Collective over each part's group: the updated weights of every parameter,
    /// all-gathered from the replicas' slices in buckets of whole parameters of about
    /// `bucket_elems` elements (no whole flat weight buffer is ever held); `set(i, w)`
    /// receives parameter i's shard (i in the rank's flat layout).
    pub fn all_gather_params(
        &self,
        groups: ReplicaGroups<'_>,
        bucket_elems: usize,
        set: &mut dyn FnMut(usize, &[f32]) -> Result<()>,
    ) -> Result<()> {
        for p in &self.parts {
            let (layout, g) = (&p.layout, groups.of(p.replicas)?);
            let mut first = 0;
            while first < layout.len() {
                // Parameters first..end, at least one, up to about a bucket.
                let start = layout.range(first).start;
                let mut end = first + 1;
                while end < layout.len() && layout.range(end).end - start <= bucket_elems.max(1) {
                    end += 1;
                }
                let stop = layout.range(end - 1).end;
                let (counts, local) = p.slices.within(start..stop);
                let mut bucket = vec![0f32; stop - start];
                g.all_gather_v(&p.master[local], &mut bucket, &counts)?;
                for i in first..end {
                    let r = layout.range(i);
                    set(p.which[i], &bucket[r.start - start..r.end - start])?;
                }
                first = end;
            }
        }
        Ok(())
    }

    /// Collective over each part's group: the whole buffers of `layout` (`total` elements)
    /// of the master weights and both moments, for a save.
    pub fn gather(&self, layout: &FlatLayout, groups: ReplicaGroups<'_>) -> Result<[Vec<f32>; 3]> {
        let mut out: [Vec<f32>; 3] = std::array::from_fn(|_| vec![0f32; layout.total()]);
        for p in &self.parts {
            let g = groups.of(p.replicas)?;
            let arrays = [&p.master, &p.adam.exp_avg, &p.adam.exp_avg_sq];
            for (o, slice) in out.iter_mut().zip(arrays) {
                let mut all = vec![0f32; p.layout.total()];
                p.slices.all_gather(slice, &mut all, g)?;
                grads::unpack(&all, o, layout, &p.which);
            }
        }
        Ok(out)
    }

    /// Each part's slice of whole moments `m` and `v` of `layout` (a checkpoint's, each of
    /// `layout.total()` elements: the caller checks), and `step` updates done: the state to
    /// resume from.
    pub fn set_moments(&mut self, m: &[f32], v: &[f32], layout: &FlatLayout, step: u64) {
        for p in &mut self.parts {
            p.adam.exp_avg = p.pack_mine(m, layout).into_owned();
            p.adam.exp_avg_sq = p.pack_mine(v, layout).into_owned();
            p.adam.step = step;
        }
    }
}

/// Optimizer memory of one rank: the f32 arrays that AdamW reads and writes (first and
/// second moments and the master weights), by the lengths this rank holds.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct OptimizerMemory {
    /// Elements of this rank's flat shard buffer (its share of the model under tp x pp).
    pub local_params: usize,
    /// Of them, the elements of the experts only an expert-data-parallel group holds (experts
    /// across replicas; 0 otherwise).
    pub expert_params: usize,
    /// Elements of each of the three arrays this rank holds (all of `local_params`, or its
    /// slices under the distributed optimizer).
    pub held: usize,
    pub dp: usize,
    /// The expert-data-parallel group's size (`dp` without experts across replicas).
    pub edp: usize,
    pub distributed: bool,
}

impl OptimizerMemory {
    /// Bytes of m, v and master: 3 arrays x 4 bytes x `held`.
    pub fn bytes(&self) -> usize {
        12 * self.held
    }

    /// The formula: 12 x P bytes, or with the distributed optimizer
    /// [`OptimizerMemory::sharded_bytes`].
    pub fn formula_bytes(&self) -> f64 {
        if self.distributed {
            self.sharded_bytes()
        } else {
            12.0 * self.local_params as f64
        }
    }

    /// The distributed optimizer's share: 12 x (P - Pe) / dp + 12 x Pe / edp bytes (P: this
    /// rank's parameter elements, Pe: those of its experts held over edp only; without
    /// experts across replicas Pe = 0, 12 x P / dp).
    pub fn sharded_bytes(&self) -> f64 {
        let (p, pe) = (self.local_params as f64, self.expert_params as f64);
        12.0 * ((p - pe) / self.dp as f64 + pe / self.edp.max(1) as f64)
    }

    /// One line for a run's start.
    pub fn line(&self) -> String {
        let mib = |b: f64| b / (1u64 << 20) as f64;
        let sharded = if self.expert_params > 0 {
            "12 x ((P - Pe) / dp + Pe / edp)"
        } else {
            "12 x P / dp"
        };
        format!(
            "optimizer state on rank 0: AdamW m, v and f32 master weights, 3 x {} elements x 4 \
             bytes = {:.2} MiB ({}; {} = {:.2} MiB for its P = {} parameter elements{}; \
             {:.2} MiB {})",
            self.held,
            mib(self.bytes() as f64),
            match (self.distributed, self.expert_params > 0) {
                (true, true) => format!(
                    "sharded over dp={}, its experts over edp={}",
                    self.dp, self.edp
                ),
                (true, false) => format!("sharded over dp={}", self.dp),
                (false, _) => "not sharded".into(),
            },
            if self.distributed { sharded } else { "12 x P" },
            mib(self.formula_bytes()),
            self.local_params,
            if self.expert_params > 0 {
                format!(", Pe = {} of its experts", self.expert_params)
            } else {
                String::new()
            },
            if self.distributed {
                mib(12.0 * self.local_params as f64)
            } else {
                mib(self.sharded_bytes())
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

    /// A part of some parameters (0, 2 and 3 of lengths 3, 2, 4, 1) packed and cut over 3
    /// ranks: rank 1's slice is elements 3..6 of the packed [0 1 2 | 5 6 7 8 | 9], i.e. flat
    /// elements 5, 6, 7; the weights and a checkpoint's moments are cut alike.
    #[test]
    fn a_part_holds_its_slice_of_its_packed_parameters() {
        let spec = |n: usize| ParamSpec {
            weight: tp_spec::WeightName::OutputNorm,
            name: format!("p{n}"),
            shape: vec![n],
            placement: tp_nn::Placement::Replicated,
            decay: false,
            tp_partial_grad: false,
            tied_copy: false,
        };
        let specs: Vec<ParamSpec> = [3, 2, 4, 1].into_iter().map(spec).collect();
        let layout = FlatLayout::new(&specs);
        let flat: Vec<f32> = (0..10).map(|i| i as f32).collect();
        let part = (vec![0, 2, 3], Replicas::Edp, 3, 1);
        let mut z = DistributedOptimizer::new(&flat, &layout, &specs, vec![part]).unwrap();
        assert_eq!(z.parts[0].master, [5.0, 6.0, 7.0]);
        assert_eq!(z.held(), 3);
        let m: Vec<f32> = flat.iter().map(|x| x + 100.0).collect();
        z.set_moments(&m, &flat, &layout, 4);
        assert_eq!(z.parts[0].adam.exp_avg, [105.0, 106.0, 107.0]);
        assert_eq!(z.parts[0].adam.step, 4);
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
