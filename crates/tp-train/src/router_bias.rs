//! The aux-loss-free load-balancing bias of the MoE routers (DeepSeek-V3; Wang et al. 2024,
//! "Auxiliary-Loss-Free Load Balancing"): a per-expert bias added to the router probabilities
//! for the top-k selection only, moved after each optimizer step towards balance by
//! `b_e += u * sign(mean_load - load_e)` over the step's tokens.

/// Moves each layer's bias (`bias [layers][count]`) by `rate` towards balance from the
/// step's loads (`load [layers * count]`, tokens routed to each expert, summed over
/// micro-batches, stages and replicas), and returns the loads' imbalance before the update:
/// the mean over layers of the busiest expert's load over the mean load (1 is balanced).
pub fn update(bias: &mut [Vec<f32>], load: &[f64], rate: f64) -> f64 {
    if bias.is_empty() || load.is_empty() {
        return 1.0;
    }
    let mut imbalance = 0.0;
    let layers = bias.len();
    for (b, row) in bias.iter_mut().zip(load.chunks_exact(load.len() / layers)) {
        let mean = row.iter().sum::<f64>() / row.len().max(1) as f64;
        let max = row.iter().copied().fold(0.0, f64::max);
        imbalance += if mean > 0.0 { max / mean } else { 1.0 };
        for (b, &n) in b.iter_mut().zip(row) {
            // sign(mean - load), 0 when equal.
            let step = if n < mean {
                rate
            } else if n > mean {
                -rate
            } else {
                0.0
            };
            *b += step as f32;
        }
    }
    imbalance / layers as f64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_busy_experts_bias_falls_and_the_idle_ones_rises() {
        let mut bias = vec![vec![0.0f32; 4]; 2];
        // Layer 0: expert 0 takes everything; layer 1: balanced.
        let load = [8.0, 0.0, 0.0, 0.0, 2.0, 2.0, 2.0, 2.0];
        let imbalance = update(&mut bias, &load, 0.5);
        assert_eq!(bias, vec![vec![-0.5, 0.5, 0.5, 0.5], vec![0.0; 4]]);
        assert_eq!(imbalance, (4.0 + 1.0) / 2.0);
    }
}
