//! Activation bytes of one layer on one tp rank, with and without sequence parallelism:
//! measured (the tensors a block holds outside its tensor-parallel regions, which sequence
//! parallelism divides by tp) and by Korthikanti et al. 2022's formulas (Table 2).

use crate::config::{ModelConfig, TrainModel};
use crate::error::{Result, TrainError};
use crate::layout;
use candle_core::Device;
use tp_comm::local::{run, LocalOptions};
use tp_nn::{ParallelBlock, RandomTensor, Rng, SeqLayout, SeqSplit};

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
