//! A server's KV budget per rank: where it comes from ([`KvBudget`]), its bytes on each rank,
//! and the blocks every rank has room for. A server allocates blocks as tokens arrive up to
//! this budget, across all its sequences, so the memory preflight prices a server at its
//! budget, not at one sequence's context ([`crate::start::SessionConfig::kv_budget`]).

use tp_models::{KvDtype, KvPool, ModelConfig, RankWeights, ShardPlan, BLOCK_POSITIONS};

/// KV budget per rank when neither a KV budget nor a rank memory limit is given: 1 GiB.
pub const DEFAULT_KV_BYTES: u64 = 1 << 30;

/// Where the KV budget per rank comes from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KvBudget {
    /// This many bytes per rank.
    Bytes(u64),
    /// What a rank may use in all, less that rank's weights.
    RankMemory(u64),
    /// Room for this many positions (whole blocks) on every rank, whatever they cost.
    Positions(usize),
    /// [`DEFAULT_KV_BYTES`].
    Default,
}

impl KvBudget {
    /// Each rank's budget in bytes, for ranks holding `weight_bytes[r]` of weights and
    /// `block_bytes[r]` bytes per KV block.
    pub fn rank_bytes(self, weight_bytes: &[u64], block_bytes: &[usize]) -> Vec<u64> {
        match self {
            KvBudget::Bytes(b) => vec![b; block_bytes.len()],
            KvBudget::RankMemory(limit) => weight_bytes
                .iter()
                .map(|&w| limit.saturating_sub(w))
                .collect(),
            KvBudget::Default => vec![DEFAULT_KV_BYTES; block_bytes.len()],
            KvBudget::Positions(n) => {
                let blocks = n.div_ceil(BLOCK_POSITIONS) as u64;
                block_bytes
                    .iter()
                    .map(|&b| blocks.saturating_mul(b as u64))
                    .collect()
            }
        }
    }
}

/// Bytes of one KV block on each rank of `cfg` split by `weights`.
pub fn block_bytes(
    cfg: &ModelConfig,
    weights: &RankWeights,
    kv_dtype: KvDtype,
) -> tp_models::Result<Vec<usize>> {
    (0..weights.tp())
        .map(|r| {
            let plan = ShardPlan::weighted(cfg, 1, r, weights)?;
            Ok(KvPool::bytes_per_block(
                cfg.layers,
                plan.kv_heads().len(),
                cfg.head_dim,
                kv_dtype,
            ))
        })
        .collect()
}

/// Each rank's bytes per KV block (world-rank order) under `opts.pipeline_stages` stages: a
/// rank's block holds its stage's layers only ([`block_bytes`] without pipelining).
pub fn stage_block_bytes(
    ckpt: &dyn tp_models::Checkpoint,
    weights: &RankWeights,
    opts: tp_models::LoadOptions,
) -> tp_models::Result<Vec<usize>> {
    let cfg = ckpt.config();
    Ok(tp_models::world_plans(ckpt, weights, opts)?
        .iter()
        .map(|plan| {
            KvPool::bytes_per_block(
                plan.stage.layers.len(),
                plan.kv_heads().len(),
                cfg.head_dim,
                opts.kv_dtype,
            )
        })
        .collect())
}

/// The rank that holds the fewest blocks with `budgets[r]` bytes of `block_bytes[r]` each,
/// and that count (at most [`tp_models::kv_cache::MAX_BLOCKS`]): every rank holds every
/// block, so it bounds them all. `None` without ranks.
pub fn limiting_rank(budgets: &[u64], block_bytes: &[usize]) -> Option<(usize, usize)> {
    budgets
        .iter()
        .zip(block_bytes)
        .map(|(&budget, &per_block)| {
            usize::try_from(budget / per_block.max(1) as u64)
                .unwrap_or(usize::MAX)
                .min(tp_models::kv_cache::MAX_BLOCKS)
        })
        .enumerate()
        .min_by_key(|&(_, blocks)| blocks)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_budget_in_bytes_and_the_limiting_rank() {
        let (w, b) = ([100, 300], [10, 20]);
        assert_eq!(KvBudget::Bytes(50).rank_bytes(&w, &b), [50, 50]);
        assert_eq!(KvBudget::RankMemory(400).rank_bytes(&w, &b), [300, 100]);
        assert_eq!(KvBudget::RankMemory(200).rank_bytes(&w, &b), [100, 0]);
        assert_eq!(
            KvBudget::Positions(BLOCK_POSITIONS + 1).rank_bytes(&w, &b),
            [20, 40]
        );
        assert_eq!(KvBudget::Default.rank_bytes(&w, &b)[1], DEFAULT_KV_BYTES);
        // 300/10 = 30 blocks on rank 0, 100/20 = 5 on rank 1.
        assert_eq!(limiting_rank(&[300, 100], &b), Some((1, 5)));
        assert_eq!(limiting_rank(&[], &[]), None);
        assert_eq!(
            limiting_rank(&[u64::MAX], &[1]),
            Some((0, tp_models::kv_cache::MAX_BLOCKS))
        );
    }
}
