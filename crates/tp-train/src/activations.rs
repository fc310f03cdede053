//! Activation bytes on one tp rank, with and without sequence parallelism: by the formula of
//! this trainer's own layer ([`RankShapes`], [`trainer_bytes`]: every f32 tensor candle's
//! backprop graph keeps from the forward to the backward, checked against a counting
//! allocator in tests/activation_memory.rs), and for one layer measured (the tensors a block
//! holds outside its tensor-parallel regions, which sequence parallelism divides by tp)
//! beside Korthikanti et al. 2022's formulas for a fused GPT layer (Table 2).

use crate::config::{ModelConfig, TrainModel};
use crate::error::{Result, TrainError};
use crate::layout;
use crate::schedule::{rank_schedule, Action};
use candle_core::Device;
use tp_comm::local::{run, LocalOptions};
use tp_comm::ParallelDims;
use tp_nn::{ParallelBlock, RandomTensor, Rng, SeqLayout, SeqSplit};
use tp_plan::activation_memory::korthikanti_bytes_per_layer;
use tp_plan::workload::Recompute;

/// One layer's activation bytes on tp rank 0 for a micro-batch of `batch` x `seq` tokens.
#[derive(Clone, Debug, PartialEq)]
pub struct LayerActivations {
    pub tp: usize,
    pub batch: usize,
    pub seq: usize,
    pub hidden: usize,
    pub heads: usize,
    /// Measured, f32: the bytes of the tensors layer 0's block holds outside its
    /// tensor-parallel regions (its input, the norms' outputs, the reduced attention and MLP
    /// outputs, the residual sum), without and with sequence parallelism.
    pub measured: (usize, usize),
}

impl LayerActivations {
    /// `s * b * h`.
    fn sbh(&self) -> f64 {
        (self.seq * self.batch * self.hidden) as f64
    }

    /// The paper's bytes of a GPT layer at t-way tensor parallelism with 2-byte activations:
    /// `sbh(10 + 24/t + 5as/(ht))` without sequence parallelism, `sbh(34/t + 5as/(ht))` with
    /// it, and `34sbh/t` with it and selective recomputation.
    pub fn paper(&self) -> (f64, f64, f64) {
        let (t, a, s, h) = (
            self.tp as f64,
            self.heads as f64,
            self.seq as f64,
            self.hidden as f64,
        );
        let scores = 5.0 * a * s / (h * t);
        (
            self.sbh() * (10.0 + 24.0 / t + scores),
            self.sbh() * (34.0 / t + scores),
            34.0 * self.sbh() / t,
        )
    }

    /// `#` lines for `tp bench train`.
    pub fn report(&self) -> String {
        let mb = |b: f64| b / 1e6;
        let (m0, m1) = self.measured;
        let (tp_only, sp, sp_sel) = self.paper();
        let t = self.tp as f64;
        format!(
            "# activations of one layer per rank at tp={}, micro-batch b x s = {} x {}, h {}, a {}:\n\
             #   measured (f32 tensors outside the tp regions: input, norm outputs, reduced \
             attention/MLP outputs, residual sum): {:.2} MB without SP, {:.2} MB with SP \
             (x{:.2})\n\
             #   paper (2-byte, Korthikanti et al. 2022 Table 2): norms/residual/dropout part \
             10sbh = {:.2} MB without SP, 10sbh/t = {:.2} MB with SP; whole layer \
             sbh(10 + 24/t + 5as/(ht)) = {:.2} MB [tp, no SP], sbh(34/t + 5as/(ht)) = {:.2} MB \
             [tp + SP], 34sbh/t = {:.2} MB [tp + SP + selective recompute]\n",
            self.tp,
            self.batch,
            self.seq,
            self.hidden,
            self.heads,
            mb(m0 as f64),
            mb(m1 as f64),
            m1 as f64 / (m0 as f64).max(1.0),
            mb(10.0 * self.sbh()),
            mb(10.0 * self.sbh() / t),
            mb(tp_only),
            mb(sp),
            mb(sp_sel),
        )
    }
}

/// Runs layer 0 of `model` (random weights) forward at `tp` on rank threads, replicated and
/// sequence parallel, on a micro-batch of `batch` x `seq` tokens; rank 0's bytes.
pub fn measure(
    model: &ModelConfig,
    batch: usize,
    seq: usize,
    tp: usize,
) -> Result<LayerActivations> {
    let split = SeqSplit::even(seq, tp)?;
    let cfg = model.block(0)?;
    let dev = Device::Cpu;
    let w = cfg.random_weights(1, &dev)?;
    let h = Rng::xorshift64_star(2).tensor(&[batch, seq, model.hidden], 0.0, 1.0, &dev)?; // [b, s, hidden]
    let outs = run(tp, LocalOptions::default(), |g| {
        let plan = layout::shard_plan(model, g.rank(), tp)?;
        let block = ParallelBlock::from_plan(&cfg, &w, 0, &plan)?;
        let whole = block.forward_layout(&h, &g, SeqLayout::Replicated)?;
        let local = h.narrow(1, g.rank() * split.local(), split.local())?; // [b, s/tp, hidden]
        let part = block.forward_layout(&local, &g, SeqLayout::Split(&split))?;
        Ok::<_, TrainError>((whole.outside_bytes, part.outside_bytes))
    })?;
    let measured = match outs.into_iter().next() {
        Some(Ok(Ok(m))) => m,
        Some(Ok(Err(e))) => return Err(e),
        _ => {
            return Err(TrainError::Config(
                "internal: the activation measurement's rank 0 failed".into(),
            ))
        }
    };
    Ok(LayerActivations {
        tp,
        batch,
        seq,
        hidden: model.hidden,
        heads: model.heads,
        measured,
    })
}

/// One tp rank's share of a micro-batch of `b` sequences of `s` tokens, as the formula of
/// this trainer's layer ([`RankShapes::layer_elems`]) sees it: every width is this rank's
/// (its query and KV heads, FFN columns and vocabulary rows, by the model's shard plan).
#[derive(Clone, Debug, PartialEq)]
pub struct RankShapes {
    pub b: usize,
    pub s: usize,
    pub hidden: usize,
    /// This rank's query heads (`a/t` with an even split).
    pub heads: usize,
    /// This rank's KV heads (`kv/t`, at least the one its query heads share).
    pub kv_heads: usize,
    pub head_dim: usize,
    /// This rank's FFN columns (`ffn/t`).
    pub ffn: usize,
    /// This rank's vocabulary rows (`V/t`).
    pub vocab: usize,
    pub tp: usize,
    /// Sequence parallelism: the tensors outside the tp regions hold `s/t` positions.
    pub sequence_parallel: bool,
    /// Qwen3's q/k norms, Qwen2's Q/K/V biases, Gemma-3's post-norms and scaled embeddings.
    pub qk_norm: bool,
    pub qkv_bias: bool,
    pub post_norms: bool,
    pub embed_scale: bool,
}

impl RankShapes {
    /// Rank `tp_rank` of `tp`'s shapes for `model`; an error for a mixture of experts, whose
    /// kept bytes depend on the routing (the formula covers dense layers).
    pub fn new(
        model: &ModelConfig,
        tp_rank: usize,
        tp: usize,
        b: usize,
        s: usize,
        sequence_parallel: bool,
    ) -> Result<RankShapes> {
        let plan = layout::shard_plan(model, tp_rank, tp)?;
        let block = model.block(0)?;
        if model.experts.is_some() {
            return Err(TrainError::Config(
                "the activation formula covers dense MLPs; this model's MLPs are mixtures of \
                 experts, whose kept bytes depend on the routing"
                    .into(),
            ));
        }
        if sequence_parallel {
            SeqSplit::even(s, tp)?;
        }
        Ok(RankShapes {
            b,
            s,
            hidden: model.hidden,
            heads: plan.heads.q_range().len(),
            kv_heads: plan.heads.kv_range().len(),
            head_dim: block.head_dim,
            ffn: plan.ffn.range(tp_rank).len() * plan.ffn_unit,
            vocab: plan.vocab.range(tp_rank).len(),
            tp: tp.max(1),
            sequence_parallel,
            qk_norm: block.qk_norm,
            qkv_bias: block.qkv_bias,
            post_norms: block.style.post_norms,
            embed_scale: model.block.embed_scale,
        })
    }

    /// Tokens `b s` inside the tp regions (the whole sequence on every rank).
    fn tokens(&self) -> f64 {
        (self.b * self.s) as f64
    }

    /// Tokens outside them: `b s`, or `b s / t` with sequence parallelism.
    fn local_tokens(&self) -> f64 {
        if self.sequence_parallel {
            self.tokens() / self.tp as f64
        } else {
            self.tokens()
        }
    }

    /// An RMSNorm over `width` of `rows` rows (norm.rs) keeps `x^2`, `x * inv` and its output
    /// (`3 rows width`) and five `[rows, 1]` tensors: the sum, the mean, `+ eps`, the square
    /// root and its reciprocal.
    fn norm(rows: f64, width: f64) -> f64 {
        3.0 * rows * width + 5.0 * rows
    }

    /// Elements (f32) one layer keeps from its forward to its backward, its output included
    /// and its input not (the previous layer's output or the stage input): every tensor its
    /// graph reaches, as candle's backprop graph holds each op's inputs (views, `contiguous`
    /// of a contiguous tensor and `detach` share storage and count nothing). With
    /// `n = b s` tokens in the tp regions, `n_l` outside them, this rank's `hq` query heads,
    /// `hkv` KV heads, head dim `d` and `f` FFN columns:
    /// - outside the tp regions, `10 n_l h + 10 n_l`: two norms (`3 n_l h + 5 n_l` each), the
    ///   two regions' reduced (or reduce-scattered) outputs, the residual sum, the output;
    /// - entering the regions, `2 n h`: copy_to_tp's copy (or the sequence all-gather) twice;
    /// - the row-parallel partial sums of wo and down, `2 n h`;
    /// - Q: projection, transposed copy, RoPE's four half-width products and its concatenation
    ///   (`6 n hq d`); K likewise (`6 n hkv d`); V: projection and transposed copy (`2 n hkv d`);
    ///   a transposed copy is none where the rank holds one head (already contiguous);
    /// - GQA's index-selected K and V, `k^T`'s copy, the context and its transposed copy
    ///   (`5 n hq d`);
    /// - the core's `[b, hq, s, s]` tensors: `q k^T`, scaled, masked, minus the row max, its
    ///   exp, the softmax (`6 b hq s^2`), the row max and sum (`2 b hq s`), and the `[s, s]`
    ///   causal mask (`s^2`, whatever b);
    /// - the MLP: gate, up, the activation and the product (`4 n f`).
    ///
    /// Selective recomputation keeps the core's inputs and output only: no `[b, hq, s, s]`
    /// tensor, no row max or sum, no `k^T` copy; the mask stays, held by the recomputing op.
    /// Full recomputation keeps the layer's input only (`n_l h`). Qwen3's q/k norms add their
    /// norms (`3 n (hq + hkv) d + 5 n (hq + hkv)`), Qwen2's biases their sums
    /// (`n (hq + 2 hkv) d`), Gemma-3's post-norms two norms over `n_l` tokens.
    pub fn layer_elems(&self, recompute: Recompute) -> f64 {
        let (n, nl, h) = (self.tokens(), self.local_tokens(), self.hidden as f64);
        if recompute == Recompute::Full {
            return nl * h;
        }
        let (hq, hkv, d, f) = (
            self.heads as f64,
            self.kv_heads as f64,
            self.head_dim as f64,
            self.ffn as f64,
        );
        let (b, s) = (self.b as f64, self.s as f64);
        let outside = 2.0 * Self::norm(nl, h) + 4.0 * nl * h;
        let regions = 2.0 * n * h + 2.0 * n * h;
        // A `[b, s, heads, d]` -> `[b, heads, s, d]` transpose of one head is already
        // contiguous: no copy.
        let moved = |heads: f64| if heads > 1.0 { heads } else { 0.0 };
        let qkv = 5.0 * n * hq * d + 5.0 * n * hkv * d + n * hkv * d;
        let transposed = n * d * (2.0 * moved(hq) + 2.0 * moved(hkv));
        let gqa_ctx = 4.0 * n * hq * d;
        let mlp = 4.0 * n * f;
        let mask = s * s;
        let mut e = outside + regions + qkv + transposed + gqa_ctx + mlp + mask;
        if recompute == Recompute::None {
            e += 6.0 * b * hq * s * s + 2.0 * b * hq * s;
        } else {
            e -= n * hq * d; // the k^T copy lives inside the recomputed core
        }
        if self.qk_norm {
            e += Self::norm(n * hq, d) + Self::norm(n * hkv, d);
        }
        if self.qkv_bias {
            e += n * (hq + 2.0 * hkv) * d;
        }
        if self.post_norms {
            e += 2.0 * Self::norm(nl, h);
        }
        e
    }

    /// Elements of the stage's input kept besides the layers: the first layer's input
    /// (`n_l h`; without full recomputation, which counts it as its first layer's).
    pub fn stage_input_elems(&self, recompute: Recompute) -> f64 {
        if recompute == Recompute::Full {
            0.0
        } else {
            self.local_tokens() * self.hidden as f64
        }
    }

    /// Elements of the embedding's graph (first stage), its output not counted (the stage
    /// input): the looked-up rows and their masked copy (`2 n h`), the local ids (u32) and
    /// the mask (`2 n`), and Gemma's unscaled output (`n_l h`).
    pub fn embedding_elems(&self) -> f64 {
        let (n, h) = (self.tokens(), self.hidden as f64);
        let scaled = if self.embed_scale {
            self.local_tokens() * h
        } else {
            0.0
        };
        2.0 * n * h + 2.0 * n + scaled
    }

    /// Elements of the head's graph (last stage): under full recomputation the leaf copy of
    /// the last layer's output (`n_l h`); the final norm (`3 n_l h + 5 n_l`); entering the
    /// tp region (`n h`); the logits, shifted, their exp, the one-hot targets and the
    /// target logits (`5 n V_t`); the per-token `[n, 1]`/`[n, 2]` pieces of the
    /// cross-entropy and its weighting (`10 n`).
    pub fn head_elems(&self, recompute: Recompute) -> f64 {
        let (n, nl, h, v) = (
            self.tokens(),
            self.local_tokens(),
            self.hidden as f64,
            self.vocab as f64,
        );
        let leaf = if recompute == Recompute::Full {
            nl * h
        } else {
            0.0
        };
        leaf + Self::norm(nl, h) + n * h + 5.0 * n * v + 10.0 * n
    }

    /// Bytes (f32) one micro-batch keeps on this rank through a model chunk of `layers`
    /// layers, with the embedding when `first` and the head when `last`.
    pub fn chunk_bytes(&self, layers: usize, first: bool, last: bool, r: Recompute) -> f64 {
        let mut e = self.stage_input_elems(r) + layers as f64 * self.layer_elems(r);
        if first {
            e += self.embedding_elems();
        }
        if last {
            e += self.head_elems(r);
        }
        4.0 * e
    }
}

/// The activation bytes pipeline rank 0 holds at its peak: each micro-batch's forward
/// through one of its model chunks adds `chunk(layers, first, last)` bytes (`first`: the
/// chunk with the embedding, `last`: the one with the head) until that chunk's backward, in
/// the order of its schedule (1F1B, or interleaved with `virtual_stages` chunks of about
/// `L / (p v)` layers; [`crate::schedule::rank_schedule`]) over `micro_batches`.
pub fn peak_in_flight_bytes(
    layers: usize,
    dims: ParallelDims,
    micro_batches: usize,
    virtual_stages: usize,
    chunk: impl Fn(usize, bool, bool) -> f64,
) -> Result<f64> {
    let (pp, v) = (dims.pp.max(1), virtual_stages.max(1));
    let bytes = layout::rank_chunks(0, pp, v)
        .into_iter()
        .map(|g| {
            let n = layout::stage_layers(layers, pp * v, g)?.len();
            Ok(chunk(n, g == 0, g + 1 == pp * v))
        })
        .collect::<Result<Vec<f64>>>()?;
    let (mut live, mut peak) = (0.0f64, 0.0f64);
    for a in rank_schedule(0, pp, v, micro_batches.max(1)) {
        match a.action {
            Action::Forward(_) => live += bytes[a.chunk],
            Action::Backward(_) => live -= bytes[a.chunk],
        }
        peak = peak.max(live);
    }
    Ok(peak)
}

/// A training layout's activations, for [`trainer_bytes`] and [`paper_bytes`].
#[derive(Clone, Copy, Debug)]
pub struct ActivationLayout {
    pub dims: ParallelDims,
    /// Sequences per micro-batch and tokens per sequence.
    pub micro_batch: usize,
    pub seq: usize,
    /// Micro-batches per step and model chunks per pipeline rank.
    pub micro_batches: usize,
    pub virtual_stages: usize,
    pub sequence_parallel: bool,
    pub recompute: Recompute,
}

/// This trainer's activation bytes on pipeline rank 0, tp rank 0 at its peak
/// ([`peak_in_flight_bytes`] of [`RankShapes::chunk_bytes`]). Packed sequences are not
/// modelled (their masks and RoPE tables are per batch).
pub fn trainer_bytes(model: &ModelConfig, l: &ActivationLayout) -> Result<f64> {
    let shapes = RankShapes::new(
        model,
        0,
        l.dims.tp,
        l.micro_batch,
        l.seq,
        l.sequence_parallel,
    )?;
    peak_in_flight_bytes(
        model.layers,
        l.dims,
        l.micro_batches,
        l.virtual_stages,
        |layers, first, last| shapes.chunk_bytes(layers, first, last, l.recompute),
    )
}

/// The same peak by Korthikanti et al. 2022's closed form for a GPT layer (Table 2, tp-plan's
/// [`korthikanti_bytes_per_layer`]: `sbh(10 + 24/t + 5as/(ht))` without recomputation and
/// sequence parallelism, `sbh(34/t + 5as/(ht))` with SP, without the `5as/(ht)` selective,
/// `2sbh` full (`/t` with SP)), doubled for f32; the layers only, as the paper counts. What a
/// fused GPT layer would keep: these layers keep more ([`RankShapes::layer_elems`]).
pub fn paper_bytes(model: &ModelConfig, l: &ActivationLayout) -> Result<f64> {
    let per_layer = 2.0
        * korthikanti_bytes_per_layer(
            l.seq as f64,
            l.micro_batch as f64,
            model.hidden as f64,
            model.heads as f64,
            l.dims.tp.max(1) as f64,
            l.sequence_parallel && l.dims.tp > 1,
            l.recompute,
        );
    peak_in_flight_bytes(
        model.layers,
        l.dims,
        l.micro_batches,
        l.virtual_stages,
        |layers, _, _| per_layer * layers as f64,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layout(pp: usize, m: usize, v: usize) -> ActivationLayout {
        ActivationLayout {
            dims: ParallelDims { tp: 2, pp, dp: 1 },
            micro_batch: 2,
            seq: 64,
            micro_batches: m,
            virtual_stages: v,
            sequence_parallel: true,
            recompute: Recompute::None,
        }
    }

    #[test]
    fn the_peak_is_the_micro_batches_the_first_stage_holds() {
        let cfg = ModelConfig::preset("tiny").unwrap(); // 4 layers
        let sh = RankShapes::new(&cfg, 0, 2, 2, 64, true).unwrap();
        let r = Recompute::None;
        // No pipeline: one micro-batch at a time through the whole model.
        let whole = sh.chunk_bytes(4, true, true, r);
        assert_eq!(trainer_bytes(&cfg, &layout(1, 4, 1)).unwrap(), whole);
        // 1F1B at pp 2: stage 0 (layers 0-1, the embedding) runs 2 forwards first.
        let stage0 = sh.chunk_bytes(2, true, false, r);
        assert_eq!(trainer_bytes(&cfg, &layout(2, 4, 1)).unwrap(), 2.0 * stage0);
        // Interleaved, p 2, v 2, m 4: chunks of one layer; the warm-up runs chunk 0 of
        // micro-batches 0, 1, chunk 1 of 0, 1, then chunk 0 of 2 before the first backward
        // (chunk 1 of 0): 2(p - 1) + (v - 1)p + 1 = 5 chunk micro-batches, then chunk 0 of 3
        // keeps 5, 4 of them with the embedding (chunk 0's).
        let (c0, c1) = (
            sh.chunk_bytes(1, true, false, r),
            sh.chunk_bytes(1, false, false, r),
        );
        assert_eq!(
            trainer_bytes(&cfg, &layout(2, 4, 2)).unwrap(),
            4.0 * c0 + c1
        );
        // The paper's per-layer figure times the same layers in flight.
        let per_layer = paper_bytes(&cfg, &layout(1, 1, 1)).unwrap() / 4.0;
        assert_eq!(
            paper_bytes(&cfg, &layout(2, 4, 2)).unwrap(),
            5.0 * per_layer
        );
    }

    #[test]
    fn a_mixture_of_experts_or_an_uneven_sequence_split_is_refused() {
        let cfg = ModelConfig::preset("tiny").unwrap();
        let e = RankShapes::new(&cfg, 0, 2, 1, 63, true).unwrap_err();
        assert!(
            e.to_string().contains("63 positions do not divide by tp=2"),
            "{e}"
        );
        let experts = crate::config::trainable_arch("mixtral").unwrap().experts;
        let moe = cfg.with_experts(experts);
        let e = RankShapes::new(&moe, 0, 1, 1, 8, false).unwrap_err();
        assert!(e.to_string().contains("mixtures of experts"), "{e}");
    }
}
