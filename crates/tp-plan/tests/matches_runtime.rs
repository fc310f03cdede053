//! `tp plan` and the runtime share tp-spec's shard arithmetic: for a model file, the planner's
//! per-rank weight bytes equal what the runtime's memory report (`tp inspect`, `rank_memory`)
//! gives for every rank at tp 1..4, exactly (the same integers), on synthetic GGUFs whose
//! K-quant shards cut super-blocks and on the real SmolLM2 (and Qwen2.5-Coder-0.5B where
//! installed); with pipeline stages (pp 2, 3), the same stages and every stage rank's bytes.

use std::path::Path;
use tp_models::synthetic::{GgufTypes, SyntheticModel};
use tp_models::{
    checkpoint_stages, open_checkpoint, rank_memory, Arch, CheckpointPlan, KvDtype, LoadOptions,
    ShardPlan,
};
use tp_plan::hardware::{accelerator_preset, ClusterSpec};
use tp_plan::serving_model::{estimate_serving, ServingConfig};
use tp_plan::workload::{Precision, ServingWorkload};
use tp_spec::Stage;

/// Every rank's weights at tp 1..4 as the runtime plans them and as the planner does.
fn assert_plan_matches_runtime(path: &Path, what: &str) {
    let model = tp_plan::cli::resolve_model(&path.display().to_string()).unwrap();
    let stored = model
        .stored
        .as_ref()
        .unwrap_or_else(|| panic!("{what}: a supported GGUF gives the planner its layouts"));
    let ckpt = open_checkpoint(path).unwrap();
    let cfg = ckpt.config().clone();
    assert_eq!(&stored.config, &cfg, "{what}: one reader, one config");
    let ctx = 16;
    for tp in 1..=4.min(cfg.heads) {
        let mut most = 0;
        for r in 0..tp {
            let plan = ShardPlan::for_checkpoint(&*ckpt, r, tp).unwrap();
            let m = rank_memory(&*ckpt, &plan, ctx, 4, true, KvDtype::F32).unwrap();
            let runtime = (m.sharded + m.replicated) as u64;
            let planned = stored.rank_bytes(tp, r, 4);
            assert_eq!(planned, Some(runtime), "{what}: tp {tp} rank {r}");
            most = most.max(runtime);
        }
        // The serving estimate's busiest rank holds exactly that.
        let cluster = ClusterSpec::new(accelerator_preset("cpu-2core").unwrap(), 1, 1).unwrap();
        let workload = ServingWorkload {
            context_len: 64,
            concurrency: 1,
            target_time_per_token_s: None,
            weight_precision: Precision::Fp32,
            kv_precision: Precision::Fp32,
        };
        let config = ServingConfig::dense(tp as u64, 1, 1);
        let e = estimate_serving(&model, &cluster, &workload, &config);
        assert_eq!(e.memory.weights, most as f64, "{what}: tp {tp}");
    }
    // Pipeline stages: the same layers per stage as the runtime's split, and every rank of
    // every stage the runtime's bytes.
    for pp in [2, 3].into_iter().filter(|&pp| pp <= cfg.layers) {
        let opts = LoadOptions {
            pipeline_stages: pp,
            ..LoadOptions::default()
        };
        let runtime_stages = checkpoint_stages(&*ckpt, opts).unwrap();
        let planned_stages = stored.stages(pp).unwrap();
        assert_eq!(planned_stages, runtime_stages, "{what}: pp {pp} stages");
        for stage in &runtime_stages {
            for tp in 1..=2.min(cfg.heads) {
                for r in 0..tp {
                    let plan = ShardPlan::for_checkpoint(&*ckpt, r, tp)
                        .unwrap()
                        .with_stage(stage.clone());
                    let m = rank_memory(&*ckpt, &plan, ctx, 4, true, KvDtype::F32).unwrap();
                    let runtime = (m.sharded + m.replicated) as u64;
                    let planned = stored.stage_rank_bytes(stage, tp, r, 4).map(|b| b.held);
                    assert_eq!(
                        planned,
                        Some(runtime),
                        "{what}: pp {pp} stage {} tp {tp} rank {r}",
                        stage.index
                    );
                }
            }
        }
    }
}

#[test]
fn planned_rank_bytes_equal_the_runtimes_on_synthetic_k_quant_models() {
    use tp_models::checkpoint::GgmlDType::*;
    let dir = tempfile::tempdir().unwrap();
    for (i, (arch, linear, embed)) in [
        (Arch::Qwen2, Q4K, Q6K),
        (Arch::Llama, Q6K, Q8_0),
        (Arch::Llama, Q4_1, Q4_1),
        (Arch::Qwen2, F32, F32),
        (Arch::Gemma3, Q4K, Q8_0),
    ]
    .into_iter()
    .enumerate()
    {
        // FFN of 4 super-blocks; the o projection's 256 columns are cut inside a super-block
        // at tp 2..4.
        let mut cfg = SyntheticModel::small(arch, 700 + i as u64).cfg;
        cfg.ffn = 1024;
        let path = dir.path().join(format!("m{i}.gguf"));
        SyntheticModel::new(cfg, 700 + i as u64)
            .write_gguf(&path, GgufTypes { linear, embed })
            .unwrap();
        assert_plan_matches_runtime(&path, &format!("{arch:?} {linear:?}/{embed:?}"));
    }
}

#[test]
fn planned_rank_bytes_equal_the_runtimes_on_real_models() {
    if let Some(p) = tp_testkit::models::smollm2() {
        assert_plan_matches_runtime(&p, "SmolLM2-135M Q4_1");
        // `tp plan` says which weights it priced.
        let args = tp_plan::cli::PlanArgs {
            model: Some(p.display().to_string()),
            gpu: "cpu-2core".into(),
            serve: true,
            context: Some(256),
            ..Default::default()
        };
        let text = tp_plan::cli::run(&args).unwrap();
        assert!(text.contains("weights as stored in the file"), "{text}");
        assert_embedding_is_not_read(&p);
    }
    if let Some(p) = tp_testkit::models::qwen25() {
        assert_plan_matches_runtime(&p, "Qwen2.5-Coder-0.5B Q4_K_M");
    }
    if let Some(p) = tp_testkit::models::gemma3() {
        assert_plan_matches_runtime(&p, "Gemma-3-270M Q4_K_M");
    }
}

/// A decode step reads every weight a rank holds except an embedding it only looks up: at
/// tp 1 the first of 2 stages reads its bytes less the embedding's, as stored in the file
/// (the span of `token_embd.weight` to the next tensor, SmolLM2's sizes being multiples of
/// the alignment); the last stage (the tied head) and the single stage read all they hold.
fn assert_embedding_is_not_read(path: &Path) {
    let model = tp_plan::cli::resolve_model(&path.display().to_string()).unwrap();
    let stored = model.stored.as_ref().unwrap();
    assert!(stored.config.tied_embeddings, "SmolLM2 ties its head");
    let header = tp_spec::GgufHeader::read_file(path).unwrap();
    let embed = header.tensor("token_embd.weight").unwrap();
    let next = header
        .tensors
        .iter()
        .map(|t| t.offset)
        .filter(|&o| o > embed.offset)
        .min()
        .unwrap();
    let whole = stored
        .stage_rank_bytes(&Stage::whole(stored.config.layers), 1, 0, 4)
        .unwrap();
    assert_eq!(whole.read, whole.held);
    let stages = stored.stages(2).unwrap();
    let first = stored.stage_rank_bytes(&stages[0], 1, 0, 4).unwrap();
    assert_eq!(first.held - first.read, next - embed.offset);
    let last = stored.stage_rank_bytes(&stages[1], 1, 0, 4).unwrap();
    assert_eq!(last.read, last.held);
}
