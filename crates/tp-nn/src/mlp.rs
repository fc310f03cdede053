//! Parallel gated MLP (Megatron §3, Fig. 3a; SwiGLU and GeGLU after Shazeer 2020): gate and
//! up are column-parallel over FFN columns, down is row-parallel, so the output is a
//! [`PartialSum`]. The nonlinearity is applied locally, on the rank's own columns.

use crate::error::Result;
use crate::linear::{ColumnParallelLinear, PartialSum, RowParallelLinear};
use candle_core::{Tensor, Var};
use tp_comm::Group;
use tp_spec::{Activation, Partition};

#[derive(Debug)]
pub struct ParallelMlp {
    gate: ColumnParallelLinear,
    up: ColumnParallelLinear,
    down: RowParallelLinear,
    ffn: Partition,
    activation: Activation,
}

impl ParallelMlp {
    /// Global `w_gate`, `w_up [ffn, hidden]` and `w_down [hidden, ffn]`.
    pub fn from_global(
        w_gate: &Tensor,
        w_up: &Tensor,
        w_down: &Tensor,
        tp_rank: usize,
        tp: usize,
    ) -> Result<Self> {
        let (ffn_global, _) = w_gate.dims2()?;
        let (ffn, unit) = tp_spec::ffn_split(ffn_global, 1, tp)?;
        Self::from_global_split(w_gate, w_up, w_down, &ffn, unit, tp_rank)
    }

    /// The rank's FFN columns are `ffn.range(tp_rank)` in units of `unit` columns (the shard
    /// plan's split, [`tp_spec::ffn_split`]).
    pub fn from_global_split(
        w_gate: &Tensor,
        w_up: &Tensor,
        w_down: &Tensor,
        ffn: &Partition,
        unit: usize,
        tp_rank: usize,
    ) -> Result<Self> {
        Ok(ParallelMlp {
            gate: ColumnParallelLinear::from_global_units(w_gate, ffn, unit, tp_rank)?,
            up: ColumnParallelLinear::from_global_units(w_up, ffn, unit, tp_rank)?,
            down: RowParallelLinear::from_global_units(w_down, ffn, unit, tp_rank)?,
            ffn: ffn.clone(),
            activation: Activation::Silu,
        })
    }

    /// The same MLP with `activation` on the gate (SwiGLU's silu by default).
    pub fn with_activation(mut self, activation: Activation) -> Self {
        self.activation = activation;
        self
    }

    /// The FFN split (in the units [`ParallelMlp::from_global_split`] was given).
    pub fn partition(&self) -> &Partition {
        &self.ffn
    }

    /// `(name, var)` of every weight shard: w_gate, w_up, w_down.
    pub fn vars(&self) -> [(&'static str, &Var); 3] {
        [
            ("w_gate", self.gate.weight()),
            ("w_up", self.up.weight()),
            ("w_down", self.down.weight()),
        ]
    }

    /// `x_par [.., hidden]` inside the parallel region -> this rank's partial `[.., hidden]`.
    pub fn forward_local(&self, x_par: &Tensor, group: &Group) -> Result<PartialSum> {
        let g = self.gate.forward_local(x_par)?; // [.., ffn_local]
        let u = self.up.forward_local(x_par)?; // [.., ffn_local]
        let a = match self.activation {
            Activation::Silu => g.silu()?,     // [.., ffn_local]
            Activation::GeluTanh => g.gelu()?, // [.., ffn_local] (tanh approximation)
        };
        let h = (a * u)?; // [.., ffn_local]
        self.down.forward(&h, group)
    }
}
