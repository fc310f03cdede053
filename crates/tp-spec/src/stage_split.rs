//! How a model's layers are divided among pipeline stages ([`StageSplit`]): balanced by a
//! compute cost model (the default), or layer counts given per stage (vLLM's
//! `VLLM_PP_LAYER_PARTITION`). Both are pure functions of the model's config and the options,
//! so every rank computes the same stages.
//!
//! The cost model ([`layer_cost`], [`head_cost`]): a layer costs the multiply-adds one token
//! takes through its matrices (a mixture of experts counts the experts a token is routed to,
//! `per_token` of `count`), whatever the matrices' storage; the last stage adds the final norm,
//! the LM head's multiply-adds and rank 0's sampling (a few passes over the vocabulary), and
//! its whole cost is multiplied by the [`LastStageWeight`] (rank 0 also schedules, samples and
//! answers HTTP on that stage's core). Attention over the KV cache is left out (it grows with
//! the position and is the same per layer, so it does not move a split of equal layers).

use crate::config::ModelConfig;
use crate::error::ShardError;
use crate::params::{head_params, Param};
use crate::stage::{balanced_stages_weighted, Stage};
use crate::weights::Expected;
use std::fmt;
use std::ops::Range;
use std::str::FromStr;

/// The most stages a [`LayerCounts`] names (it is kept inline, so load options stay `Copy`).
pub const MAX_SPLIT_STAGES: usize = 64;

/// Layer counts per pipeline stage, first stage first (`14,10`: layers 0..14 on stage 0,
/// 14..24 on stage 1). Nothing is checked against a model here: [`StageSplit::ranges`] does.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct LayerCounts {
    len: u8,
    counts: [u16; MAX_SPLIT_STAGES],
}

impl LayerCounts {
    /// The counts of `counts` (each stage's layers): more than [`MAX_SPLIT_STAGES`] stages,
    /// or a count above 65535, is a [`ShardError::StageSplitSyntax`]-like typed error.
    pub fn new(counts: &[usize]) -> Result<Self, ShardError> {
        if counts.is_empty() || counts.len() > MAX_SPLIT_STAGES {
            return Err(ShardError::StageSplitLength {
                given: counts.len(),
                max: MAX_SPLIT_STAGES,
            });
        }
        let mut out = LayerCounts {
            len: counts.len() as u8,
            counts: [0; MAX_SPLIT_STAGES],
        };
        for (slot, &c) in out.counts.iter_mut().zip(counts) {
            *slot = u16::try_from(c).map_err(|_| ShardError::StageSplitSyntax {
                text: join(counts.iter().copied()),
            })?;
        }
        Ok(out)
    }

    /// The stages named.
    pub fn len(&self) -> usize {
        usize::from(self.len)
    }

    /// No stage named (never: [`LayerCounts::new`] refuses it).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Each stage's layer count, first stage first.
    pub fn counts(&self) -> impl Iterator<Item = usize> + '_ {
        self.counts[..self.len()].iter().map(|&c| usize::from(c))
    }
}

impl fmt::Debug for LayerCounts {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_list().entries(self.counts()).finish()
    }
}

impl fmt::Display for LayerCounts {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&join(self.counts()))
    }
}

impl FromStr for LayerCounts {
    type Err = ShardError;

    /// Whole numbers separated by commas (`14,10`; spaces around a number are allowed).
    fn from_str(text: &str) -> Result<Self, ShardError> {
        let syntax = || ShardError::StageSplitSyntax {
            text: text.chars().take(64).collect(),
        };
        let counts = text
            .split(',')
            .map(|part| {
                let part = part.trim();
                if part.is_empty() || !part.bytes().all(|b| b.is_ascii_digit()) {
                    return Err(syntax());
                }
                part.parse::<usize>().map_err(|_| syntax())
            })
            .collect::<Result<Vec<_>, _>>()?;
        LayerCounts::new(&counts)
    }
}

/// How much slower the last stage's core runs its share than the others run theirs, in
/// thousandths (1000: as fast): rank 0 samples, schedules and serves HTTP on it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LastStageWeight(u32);

impl LastStageWeight {
    /// The default: a tenth more for rank 0's own work (a model, not a measurement; see
    /// docs/multi-host.md).
    pub const DEFAULT: LastStageWeight = LastStageWeight(1100);
    /// The smallest weight taken (a tenth).
    pub const MIN: u32 = 100;
    /// The largest weight taken (ten times).
    pub const MAX: u32 = 10_000;

    /// A weight of `permille` thousandths, within [`Self::MIN`]..=[`Self::MAX`].
    pub fn from_permille(permille: u32) -> Result<Self, ShardError> {
        if (Self::MIN..=Self::MAX).contains(&permille) {
            Ok(LastStageWeight(permille))
        } else {
            Err(ShardError::LastStageWeight {
                text: format!("{}", LastStageWeight(permille)),
            })
        }
    }

    /// The weight in thousandths.
    pub fn permille(self) -> u32 {
        self.0
    }
}

impl Default for LastStageWeight {
    fn default() -> Self {
        Self::DEFAULT
    }
}

impl fmt::Display for LastStageWeight {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let text = format!("{}.{:03}", self.0 / 1000, self.0 % 1000);
        f.write_str(text.trim_end_matches('0').trim_end_matches('.'))
    }
}

impl FromStr for LastStageWeight {
    type Err = ShardError;

    /// A decimal number from 0.1 to 10 with at most three decimals (`1.25`).
    fn from_str(text: &str) -> Result<Self, ShardError> {
        let bad = || ShardError::LastStageWeight {
            text: text.chars().take(64).collect(),
        };
        let t = text.trim();
        let (whole, frac) = t.split_once('.').unwrap_or((t, ""));
        let digits = |s: &str| s.bytes().all(|b| b.is_ascii_digit());
        if (whole.is_empty() && frac.is_empty())
            || !digits(whole)
            || !digits(frac)
            || frac.len() > 3
            || whole.len() > 5
        {
            return Err(bad());
        }
        let whole: u32 = if whole.is_empty() {
            0
        } else {
            whole.parse().map_err(|_| bad())?
        };
        let frac: u32 = format!("{frac:0<3}").parse().map_err(|_| bad())?;
        LastStageWeight::from_permille(whole * 1000 + frac).map_err(|_| bad())
    }
}

/// How a model's layers are divided among its pipeline stages.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StageSplit {
    /// Contiguous ranges that minimise the largest stage's cost under the cost model (this
    /// module's doc), the last stage's multiplied by the weight.
    Balanced(LastStageWeight),
    /// These layer counts, first stage first: as many as stages, each at least 1, summing to
    /// the model's layers.
    Layers(LayerCounts),
}

impl Default for StageSplit {
    fn default() -> Self {
        StageSplit::Balanced(LastStageWeight::DEFAULT)
    }
}

impl StageSplit {
    /// Each stage's layers over `pp` stages of `cfg`: a `pp` the layers cannot take is a
    /// [`ShardError::InvalidPp`], explicit counts that do not fit the model a typed error
    /// naming what would.
    pub fn ranges(&self, cfg: &ModelConfig, pp: usize) -> Result<Vec<Range<usize>>, ShardError> {
        let layers = cfg.layers;
        if pp == 0 || pp > layers {
            return Err(ShardError::InvalidPp { pp, layers });
        }
        match self {
            StageSplit::Balanced(w) => {
                let costs: Vec<u64> = (0..layers).map(|l| layer_cost(cfg, l)).collect();
                balanced_stages_weighted(&costs, head_cost(cfg), w.permille(), pp)
            }
            StageSplit::Layers(counts) => {
                let split = counts.to_string();
                let example = even_split(layers, pp);
                if counts.len() != pp {
                    return Err(ShardError::StageSplitCount {
                        split,
                        given: counts.len(),
                        pp,
                        layers,
                        example,
                    });
                }
                if let Some(stage) = counts.counts().position(|c| c == 0) {
                    return Err(ShardError::StageSplitEmpty {
                        split,
                        stage,
                        layers,
                        example,
                    });
                }
                let sum: usize = counts.counts().sum();
                if sum != layers {
                    return Err(ShardError::StageSplitSum {
                        split,
                        sum,
                        pp,
                        layers,
                        example,
                    });
                }
                let mut at = 0;
                Ok(counts
                    .counts()
                    .map(|c| {
                        at += c;
                        at - c..at
                    })
                    .collect())
            }
        }
    }
}

/// The pipeline stages of `cfg` over `pp` stages, divided as `split` says (the same on every
/// rank: a function of the config and the options only).
pub fn pipeline_stages(
    cfg: &ModelConfig,
    pp: usize,
    split: StageSplit,
) -> Result<Vec<Stage>, ShardError> {
    Ok(split
        .ranges(cfg, pp)?
        .into_iter()
        .enumerate()
        .map(|(index, layers)| Stage {
            index,
            count: pp,
            layers,
        })
        .collect())
}

/// Multiply-adds one token takes through `params`: every matrix element once (an expert's
/// scaled by the share of tokens routed to it), every vector element once.
fn params_cost(cfg: &ModelConfig, params: &[Param]) -> u64 {
    params
        .iter()
        .map(|p| {
            let elems = match p.shape {
                Expected::Matrix { rows, cols } => (rows * cols) as u64,
                Expected::Vector { len } => len as u64,
            };
            match (p.name.expert(), &cfg.experts) {
                (Some(_), Some(x)) => elems * x.per_token as u64 / x.count.max(1) as u64,
                _ => elems,
            }
        })
        .sum()
}

/// Layer `l`'s cost in the model: the multiply-adds of one token through it.
pub fn layer_cost(cfg: &ModelConfig, l: usize) -> u64 {
    params_cost(cfg, &cfg.layer_spec(l).params())
}

/// What sampling a token costs rank 0, in multiply-adds per vocabulary entry (a softmax and a
/// selection pass over the logits).
pub const SAMPLING_COST_PER_LOGIT: u64 = 8;

/// The last stage's extra cost in the model: the final norm, the LM head (the embedding
/// matrix when tied) and rank 0's sampling.
pub fn head_cost(cfg: &ModelConfig) -> u64 {
    let head = params_cost(cfg, &head_params(cfg));
    let tied = if cfg.tied_embeddings {
        (cfg.vocab * cfg.hidden) as u64
    } else {
        0
    };
    head + tied + cfg.vocab as u64 * SAMPLING_COST_PER_LOGIT
}

/// `15,15` for 30 layers over 2 stages (earlier stages take the remainder): a split that fits.
fn even_split(layers: usize, pp: usize) -> String {
    let pp = pp.max(1);
    join((0..pp).map(|s| layers / pp + usize::from(s < layers % pp)))
}

fn join(counts: impl Iterator<Item = usize>) -> String {
    counts.map(|c| c.to_string()).collect::<Vec<_>>().join(",")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::arch::{Arch, RopeStyle};

    /// Qwen2.5-0.5B's shapes: 24 layers of ~14.9M multiply-adds, a tied head of 136M (about
    /// 9 layers).
    fn qwen05(layers: usize) -> ModelConfig {
        ModelConfig {
            arch: Arch::Qwen2,
            layers,
            hidden: 896,
            ffn: 4864,
            heads: 14,
            kv_heads: 2,
            head_dim: 64,
            vocab: 151_936,
            rms_eps: 1e-6,
            rope_theta: 1e6,
            rope_style: RopeStyle::RotateHalf,
            context: 64,
            qkv_bias: true,
            qk_norm: false,
            tied_embeddings: true,
            block: crate::BlockStyle::LLAMA,
            experts: None,
        }
    }

    fn counts(s: &str) -> StageSplit {
        StageSplit::Layers(s.parse().unwrap())
    }

    #[test]
    fn an_explicit_split_gives_the_stages_it_names() {
        let c = qwen05(24);
        let stages = pipeline_stages(&c, 2, counts("14,10")).unwrap();
        assert_eq!(
            stages.iter().map(|s| s.layers.clone()).collect::<Vec<_>>(),
            vec![0..14, 14..24]
        );
        assert!(stages[0].is_first() && stages[1].is_last());
        let three = pipeline_stages(&c, 3, counts(" 1, 20 ,3")).unwrap();
        assert_eq!(
            three.iter().map(|s| s.layers.clone()).collect::<Vec<_>>(),
            vec![0..1, 1..21, 21..24]
        );
        assert_eq!(
            pipeline_stages(&c, 1, counts("24")).unwrap(),
            vec![Stage::whole(24)]
        );
    }

    #[test]
    fn explicit_splits_that_do_not_fit_name_one_that_does() {
        let c = qwen05(24);
        let e = StageSplit::Layers("14,9".parse().unwrap())
            .ranges(&c, 2)
            .unwrap_err();
        assert!(
            matches!(e, ShardError::StageSplitSum { sum: 23, .. }),
            "{e:?}"
        );
        assert!(
            e.to_string().contains("has 24") && e.to_string().contains("12,12"),
            "{e}"
        );
        let e = counts("8,8,8").ranges(&c, 2).unwrap_err();
        assert!(
            matches!(
                e,
                ShardError::StageSplitCount {
                    given: 3,
                    pp: 2,
                    ..
                }
            ),
            "{e:?}"
        );
        assert!(e.to_string().contains("2 layer counts"), "{e}");
        let e = counts("24,0").ranges(&c, 2).unwrap_err();
        assert!(
            matches!(e, ShardError::StageSplitEmpty { stage: 1, .. }),
            "{e:?}"
        );
        assert!(e.to_string().contains("at least 1"), "{e}");
        // The pp itself first.
        let e = counts("1,1").ranges(&qwen05(1), 2).unwrap_err();
        assert_eq!(e, ShardError::InvalidPp { pp: 2, layers: 1 });
        for bad in ["", "14,", "a,3", "1.5,2", "-1,3"] {
            let e = bad.parse::<LayerCounts>().unwrap_err();
            assert!(e.to_string().contains("like 14,10"), "{bad:?}: {e}");
        }
        let long = vec!["1"; MAX_SPLIT_STAGES + 1].join(",");
        assert!(matches!(
            long.parse::<LayerCounts>(),
            Err(ShardError::StageSplitLength { .. })
        ));
        assert_eq!(
            "14, 10".parse::<LayerCounts>().unwrap().to_string(),
            "14,10"
        );
    }

    #[test]
    fn last_stage_weights_parse_in_thousandths_within_range() {
        for (text, permille) in [("1", 1000), ("1.25", 1250), (".5", 500), ("10", 10_000)] {
            let w: LastStageWeight = text.parse().unwrap();
            assert_eq!(w.permille(), permille, "{text}");
        }
        assert_eq!(LastStageWeight::DEFAULT.to_string(), "1.1");
        assert_eq!(
            "2.50".parse::<LastStageWeight>().unwrap().to_string(),
            "2.5"
        );
        for bad in ["0", "0.05", "10.5", "1.2345", "x", "", ".", "-1", "1e3"] {
            let e = bad.parse::<LastStageWeight>().unwrap_err();
            assert!(e.to_string().contains("0.1 to 10"), "{bad:?}: {e}");
        }
    }

    /// Qwen2.5-0.5B's shapes with 4-to-5-bit layers (~0.6 bytes per weight) and a tied Q8_0
    /// head (1.06): by bytes the head weighs ~16 layers and the last stage gets 4 of 24; by
    /// multiply-adds it weighs ~9.2 and the last stage gets 7 (17 layers against
    /// (7 + 9.2) x 1.1).
    #[test]
    fn the_default_balances_compute_where_bytes_would_not() {
        let c = qwen05(24);
        let layer = layer_cost(&c, 0);
        let head = head_cost(&c);
        assert_eq!(
            layer,
            896 * (896 + 128 + 128 + 896) + 3 * 4864 * 896 + 128 + 128 + 896 + 2 * 896
        );
        assert!(head > 9 * layer && head < 10 * layer, "{head} vs {layer}");
        // By bytes (the split before this model): the head at Q8_0, layers at ~0.6 B/weight.
        let bytes_layer = layer * 6 / 10;
        let bytes_head = (c.vocab * c.hidden) as u64 * 34 / 32;
        let by_bytes = crate::balanced_stages(&[bytes_layer; 24], bytes_head, 2).unwrap();
        assert_eq!(by_bytes, vec![0..20, 20..24]);
        let by_compute = StageSplit::default().ranges(&c, 2).unwrap();
        assert_eq!(by_compute, vec![0..17, 17..24]);
        // The model's own figures (in layers): 17 | (7 + 9.2) x 1.1 = 17.8, against 18 | 16.7
        // and 16 | 18.9.
        let worst = |x: u64| (x * layer).max(((24 - x) * layer + head) * 1100 / 1000);
        assert!(worst(17) < worst(18) && worst(17) < worst(16));
        // A heavier last-stage weight moves layers off it; weight 1 keeps the pure model's.
        let heavy = StageSplit::Balanced("1.5".parse().unwrap())
            .ranges(&c, 2)
            .unwrap();
        assert_eq!(heavy, vec![0..20, 20..24]);
        let plain = StageSplit::Balanced("1".parse().unwrap())
            .ranges(&c, 2)
            .unwrap();
        assert_eq!(plain, vec![0..17, 17..24]);
    }

    #[test]
    fn experts_cost_the_share_of_tokens_routed_to_them() {
        let mut c = qwen05(4);
        let dense = layer_cost(&c, 0);
        c.experts = Some(crate::Experts::new(8, 2));
        let moe = layer_cost(&c, 0);
        // 8 experts of the same width, 2 per token: twice the dense MLP, plus the router.
        let mlp = 3 * 4864 * 896;
        assert_eq!(moe, dense + mlp + 8 * 896);
    }
}
