//! What is being planned: a training step (global batch, sequence, precision,
//! optimizer) or a serving deployment (context, concurrency, latency target).

use serde::Serialize;

/// Numeric format of weights (and, for training, of activations and gradients).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
pub enum Precision {
    Bf16,
    Fp16,
    Fp32,
    Int8,
    Int4,
}

impl Precision {
    pub fn bytes(self) -> f64 {
        match self {
            Precision::Bf16 | Precision::Fp16 => 2.0,
            Precision::Fp32 => 4.0,
            Precision::Int8 => 1.0,
            Precision::Int4 => 0.5,
        }
    }
    /// Mixed precision keeps an fp32 master copy in the optimizer.
    pub fn is_mixed(self) -> bool {
        self != Precision::Fp32
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
pub enum Optimizer {
    /// Adam/AdamW: two fp32 moments.
    Adam,
    /// SGD with momentum: one fp32 moment.
    Sgd,
}

impl Optimizer {
    /// Optimizer-state bytes per parameter (ZeRO paper §3.1: mixed-precision Adam
    /// keeps fp32 master weights, momentum and variance = 12 bytes).
    pub fn state_bytes_per_param(self, precision: Precision) -> f64 {
        let moments = match self {
            Optimizer::Adam => 8.0,
            Optimizer::Sgd => 4.0,
        };
        let master = if precision.is_mixed() { 4.0 } else { 0.0 };
        moments + master
    }
}

/// Activation recomputation policy (Korthikanti et al. 2022 §4, §5).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
pub enum Recompute {
    None,
    /// Recompute only the attention scores/softmax/dropout (the 5as²b term).
    Selective,
    /// Keep only each layer's input; recompute the whole forward pass.
    Full,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct TrainingWorkload {
    pub global_batch: u64,
    pub seq_len: u64,
    pub precision: Precision,
    pub optimizer: Optimizer,
    /// ZeRO-1 style sharding of optimizer state over data-parallel ranks.
    pub distributed_optimizer: bool,
    /// Fused attention that never materialises the s×s scores.
    pub flash_attention: bool,
    pub max_micro_batch: u64,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ServingWorkload {
    /// Tokens held in the KV cache per sequence (prompt + generated).
    pub context_len: u64,
    /// Sequences decoded concurrently over the whole deployment.
    pub concurrency: u64,
    /// Target time per output token, seconds; `None` ranks by cost alone.
    pub target_time_per_token_s: Option<f64>,
    pub weight_precision: Precision,
    pub kv_precision: Precision,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mixed_precision_adam_is_sixteen_bytes_per_param_with_weights_and_grads() {
        // ZeRO §3.1: 2 (bf16 weights) + 2 (bf16 grads) + 12 (fp32 master, m, v) = 16.
        let p = Precision::Bf16;
        assert_eq!(
            p.bytes() * 2.0 + Optimizer::Adam.state_bytes_per_param(p),
            16.0
        );
        // fp32 Adam: 4 + 4 + 8 = 16 too, without a master copy.
        assert_eq!(Optimizer::Adam.state_bytes_per_param(Precision::Fp32), 8.0);
    }
}
