//! `tp plan` entry point: good inputs produce text/JSON, bad inputs (unknown
//! presets, zero GPUs, partial nodes, malformed config.json / TOML, GGUF) give
//! clear typed errors.

use std::path::PathBuf;
use tp_plan::cli::{run, PlanArgs};
use tp_plan::PlanError;

fn args(model: &str, gpus: u64) -> PlanArgs {
    PlanArgs {
        model: Some(model.to_string()),
        gpus: Some(gpus),
        ..PlanArgs::default()
    }
}

fn temp_file(name: &str, contents: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("tp-plan-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join(name);
    std::fs::write(&path, contents).unwrap();
    path
}

#[test]
fn training_text_and_json() {
    let text = run(&args("llama-3-8b", 8)).unwrap();
    assert!(text.contains("valid layouts") && text.contains("rejected"));
    let mut a = args("llama-3-8b", 8);
    a.json = true;
    let json: serde_json::Value = serde_json::from_str(&run(&a).unwrap()).unwrap();
    let top = json["top"].as_array().unwrap();
    assert!(!top.is_empty());
    for field in [
        "weights",
        "gradients",
        "optimizer_state",
        "activations",
        "kv_cache",
    ] {
        assert!(top[0]["memory"][field].is_number(), "{field}");
    }
    for field in [
        "compute_s",
        "tensor_parallel_comm_s",
        "pipeline_bubble_s",
        "data_parallel_comm_s",
    ] {
        assert!(top[0]["time"][field].is_number(), "{field}");
    }
    assert!(top[0]["mfu"].as_f64().unwrap() > 0.0);
}

#[test]
fn cpu_serving_recommends_tp_and_memory_budget() {
    let a = PlanArgs {
        model: Some("smollm2-135m".to_string()),
        gpu: "cpu-2core".to_string(),
        serve: true,
        context: Some(2048),
        ..PlanArgs::default()
    };
    let text = run(&a).unwrap();
    assert!(
        text.contains("recommendation for this machine: tp="),
        "{text}"
    );
    assert!(text.contains("memory budget"));
}

#[test]
fn unknown_presets_list_valid_names() {
    let e = run(&args("gpt-5", 8)).unwrap_err();
    assert!(matches!(e, PlanError::UnknownModelPreset { .. }));
    assert!(e.to_string().contains("llama-3-405b"));
    let mut a = args("llama-3-8b", 8);
    a.gpu = "b300".to_string();
    let e = run(&a).unwrap_err().to_string();
    assert!(
        e.contains("b300") && e.contains("a100-80") && e.contains("mi300x"),
        "{e}"
    );
}

#[test]
fn bad_cluster_shapes() {
    assert!(matches!(
        run(&args("llama-3-8b", 0)),
        Err(PlanError::ZeroGpus)
    ));
    assert!(matches!(
        run(&args("llama-3-8b", 20)),
        Err(PlanError::GpusNotDivisibleByNode {
            gpus: 20,
            per_node: 8
        })
    ));
    let mut a = args("llama-3-8b", 8);
    a.gpus = None;
    assert!(run(&a)
        .unwrap_err()
        .to_string()
        .contains("--gpus is required"));
    let mut a = args("llama-3-8b", 8);
    a.gpus_per_node = Some(0);
    assert!(matches!(run(&a), Err(PlanError::ZeroGpusPerNode)));
}

#[test]
fn bad_workloads() {
    let mut a = args("llama-3-8b", 8);
    a.global_batch = 0;
    assert!(matches!(run(&a), Err(PlanError::InvalidWorkload(_))));
    let mut a = args("llama-3-8b", 8);
    a.serve = true;
    a.target_tpot_ms = Some(-1.0);
    assert!(matches!(run(&a), Err(PlanError::InvalidWorkload(_))));
}

#[test]
fn config_json_files() {
    let good = temp_file(
        "smol.json",
        r#"{"hidden_act":"silu","hidden_size":576,"intermediate_size":1536,"num_attention_heads":9,
            "num_hidden_layers":30,"num_key_value_heads":3,"tie_word_embeddings":true,"vocab_size":49152}"#,
    );
    let text = run(&args(good.to_str().unwrap(), 2)).unwrap();
    assert!(text.contains("0.13B params"), "{text}");

    let bad = temp_file("bad.json", "{\"hidden_size\": 576,");
    let e = run(&args(bad.to_str().unwrap(), 2)).unwrap_err();
    assert!(matches!(e, PlanError::MalformedModelConfig { .. }), "{e}");
    assert!(e.to_string().contains("bad.json"));

    let e = run(&args("/nonexistent/dir/config.json", 2)).unwrap_err();
    assert!(matches!(e, PlanError::FileRead { .. }), "{e}");

    let e = run(&args("/nonexistent/model.gguf", 2)).unwrap_err();
    assert!(matches!(e, PlanError::FileRead { .. }), "{e}");
    let junk = temp_file("junk.gguf", "GGUF\x03");
    let e = run(&args(junk.to_str().unwrap(), 2)).unwrap_err();
    assert!(matches!(e, PlanError::MalformedGguf { .. }), "{e}");
}

#[test]
fn cluster_toml_files() {
    let good = temp_file(
        "c.toml",
        "accelerator = \"a100-40\"\ngpus = 16\ngpus_per_node = 8\n",
    );
    let a = PlanArgs {
        model: Some("llama-2-7b".to_string()),
        cluster: Some(good),
        ..PlanArgs::default()
    };
    assert!(run(&a).unwrap().contains("16 x a100-40"));

    let bad = temp_file("bad.toml", "accelerator = \"a100-40\"\ngpus = sixteen\n");
    let a = PlanArgs {
        model: Some("llama-2-7b".to_string()),
        cluster: Some(bad),
        ..PlanArgs::default()
    };
    let e = run(&a).unwrap_err();
    assert!(matches!(e, PlanError::MalformedClusterFile { .. }), "{e}");
}

#[test]
fn megatron_table_and_presets_flags() {
    let a = PlanArgs {
        megatron_table: true,
        ..PlanArgs::default()
    };
    assert!(run(&a).unwrap().contains("megatron-1t"));
    // Both published-run tables, and as JSON.
    let a = PlanArgs {
        published_runs: true,
        ..PlanArgs::default()
    };
    let text = run(&a).unwrap();
    assert!(
        text.contains("| gpt-1t |") && text.contains("| 16384 | 8 | 16 |"),
        "{text}"
    );
    let json: serde_json::Value = serde_json::from_str(
        &run(&PlanArgs {
            json: true,
            ..a.clone()
        })
        .unwrap(),
    )
    .unwrap();
    assert_eq!(json["korthikanti_2022"].as_array().map(Vec::len), Some(4));
    assert_eq!(json["llama3_405b"].as_array().map(Vec::len), Some(2));
    let a = PlanArgs {
        list_presets: true,
        ..PlanArgs::default()
    };
    assert!(run(&a).unwrap().contains("smollm2-135m"));
}

/// The link and the cores of CPU machines as given: a serving plan across two one-core hosts
/// offers tp 2 over both; bad values are named.
#[test]
fn link_latency_bandwidth_and_cores() {
    let mut a = args("smollm2-135m", 2);
    a.gpu = "cpu-2core".to_string();
    a.serve = true;
    a.cores = Some(1);
    a.link_latency = Some("200us".to_string());
    a.link_bandwidth = Some("1gbit".to_string());
    let text = run(&a).unwrap();
    assert!(
        text.contains("1 cores") && text.contains("0.125 GB/s + 200 us inter"),
        "{text}"
    );
    assert!(text.contains("fastest per token: tp=1 pp=1 dp=2"), "{text}");
    a.link_latency = Some("1us".to_string());
    a.link_bandwidth = Some("100gbit".to_string());
    let text = run(&a).unwrap();
    assert!(
        text.contains("fastest per token: tp=2 pp=1 dp=1 (2 machine(s)"),
        "{text}"
    );
    for (latency, bandwidth, cores, want) in [
        (
            "2 fortnights",
            "1gbit",
            1,
            "link latency \"2 fortnights\" is not a time",
        ),
        ("200us", "fast", 1, "link bandwidth \"fast\" is not a rate"),
        ("-1ms", "1gbit", 1, "is not a time"),
        ("200us", "0gbit", 1, "is not a rate"),
        ("200us", "1gbit", 0, "0 cores per machine: give 1 to 65536"),
    ] {
        a.link_latency = Some(latency.to_string());
        a.link_bandwidth = Some(bandwidth.to_string());
        a.cores = Some(cores);
        let e = run(&a).unwrap_err().to_string();
        assert!(e.contains(want), "{latency} {bandwidth} {cores}: {e}");
    }
    let mut gpu = args("smollm2-135m", 8);
    gpu.cores = Some(4);
    let e = run(&gpu).unwrap_err().to_string();
    assert!(e.contains("cores per machine are for CPU machines"), "{e}");
}
