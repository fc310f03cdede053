//! Bad model inputs of every kind (docs/reliability.md R4, R7): each is a typed error whose
//! message names the file (and tensor or key) and says what to do; none panics.

mod common;

use candle_core::quantized::gguf_file::Value;
use std::path::Path;
use tp_models::synthetic::{self, GgufTypes, HfDType, SyntheticModel};
use tp_models::{
    open_checkpoint, Arch, Checkpoint, CheckpointPlan, GgufCheckpoint, HfCheckpoint, LoadOptions,
    ModelConfig, ModelError, ShardPlan, ShardedModel,
};

fn open_err(path: &Path) -> ModelError {
    match open_checkpoint(path) {
        Ok(_) => panic!("{} opened", path.display()),
        Err(e) => e,
    }
}

/// The message names `path` and contains every part.
fn says(e: &ModelError, path: &Path, parts: &[&str]) {
    let m = e.to_string();
    let shown = path.display().to_string();
    assert!(m.contains(&shown), "{m:?} does not name {shown}");
    for p in parts {
        assert!(m.contains(p), "{m:?} lacks {p:?}");
    }
}

#[test]
fn missing_path_empty_file_text_file_and_dir_without_config() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("nope.gguf");
    let e = open_err(&missing);
    assert!(matches!(e, ModelError::Input(_)), "{e:?}");
    says(&e, &missing, &["does not exist", "give a GGUF file"]);

    let empty = dir.path().join("empty.gguf");
    std::fs::write(&empty, b"").unwrap();
    let e = open_err(&empty);
    assert!(matches!(e, ModelError::Corrupt { .. }), "{e:?}");
    says(&e, &empty, &["empty", "download"]);

    let text = dir.path().join("notes.txt");
    std::fs::write(&text, "these are notes, not a model\n").unwrap();
    let e = open_err(&text);
    assert!(matches!(e, ModelError::Corrupt { .. }), "{e:?}");
    says(
        &e,
        &text,
        &[
            "not a GGUF file",
            "these are notes",
            "use another model file",
        ],
    );

    let bare = dir.path().join("bare");
    std::fs::create_dir(&bare).unwrap();
    let e = open_err(&bare);
    assert!(matches!(e, ModelError::Input(_)), "{e:?}");
    says(&e, &bare, &["no config.json", "give a GGUF file"]);

    let lone = dir.path().join("lone.safetensors");
    std::fs::write(&lone, b"x").unwrap();
    says(&open_err(&lone), &lone, &["without a config.json"]);
}

#[test]
fn truncated_copies_of_smollm2_name_the_file_and_the_cut() {
    let Some(path) = common::smollm2() else {
        return;
    };
    use std::io::Read;
    let dir = tempfile::tempdir().unwrap();
    let mut head = vec![0u8; 3 << 20];
    std::fs::File::open(&path)
        .unwrap()
        .read_exact(&mut head)
        .unwrap();
    for (cut, expect) in [
        (100_000, "metadata key tokenizer.ggml"), // inside the vocabulary
        (3 << 20, "past the end of the file"),    // inside the tensor data
    ] {
        let p = dir.path().join(format!("smollm2-{cut}.gguf"));
        std::fs::write(&p, &head[..cut]).unwrap();
        let e = open_err(&p);
        assert!(matches!(e, ModelError::Corrupt { .. }), "{e:?}");
        says(&e, &p, &[expect, "truncated", "compare its sha256"]);
    }
    // A truncated file of the full size with its last tensor cut by one byte.
    let len = std::fs::metadata(&path).unwrap().len();
    let p = dir.path().join("smollm2-short.gguf");
    let f = std::fs::File::create(&p).unwrap();
    std::io::Write::write_all(&mut &f, &head).unwrap();
    f.set_len(len - 1).unwrap(); // sparse: the rest reads as zeros
    let e = open_err(&p);
    says(&e, &p, &["past the end of the file"]);
}

fn write_model(
    dir: &Path,
    arch: Arch,
    edit: impl FnOnce(&mut Vec<(String, Value)>),
) -> std::path::PathBuf {
    let m = SyntheticModel::small(arch, 3);
    let mut md = m.gguf_metadata();
    edit(&mut md);
    let path = dir.join(format!("{arch:?}.gguf"));
    synthetic::write_gguf(&path, &md, &m.gguf_tensors(GgufTypes::F32).unwrap()).unwrap();
    path
}

#[test]
fn unsupported_architectures_are_named_with_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let p = write_model(dir.path(), Arch::Llama, |md| {
        md[0].1 = Value::String("gpt2".into());
    });
    let e = open_err(&p);
    assert!(
        matches!(e, ModelError::UnsupportedArch { ref arch, .. } if arch == "gpt2"),
        "{e:?}"
    );
    says(
        &e,
        &p,
        &["\"gpt2\"", "supported: llama (LlamaForCausalLM), qwen2"],
    );

    let hf = dir.path().join("bert");
    SyntheticModel::small(Arch::Llama, 3)
        .write_hf(&hf, 1, HfDType::F32)
        .unwrap();
    std::fs::write(
        hf.join("config.json"),
        r#"{"model_type": "bert", "architectures": ["BertModel"], "hidden_size": 384}"#,
    )
    .unwrap();
    let e = open_err(&hf);
    assert!(matches!(e, ModelError::UnsupportedArch { .. }), "{e:?}");
    says(
        &e,
        &hf.join("config.json"),
        &["\"bert\"", "LlamaForCausalLM"],
    );
}

/// Expert metadata without expert tensors, an MoE family this engine cannot run, and a dense
/// model carrying expert tensors: each refused before loading, naming what is wrong.
#[test]
fn mixtures_of_experts_are_refused_before_loading() {
    let dir = tempfile::tempdir().unwrap();
    let p = write_model(dir.path(), Arch::Llama, |md| {
        md.push(("llama.expert_count".into(), Value::U32(8)));
        md.push(("llama.expert_used_count".into(), Value::U32(2)));
    });
    // The dense MLP tensors are not weights of a mixture of experts.
    says(&open_err(&p), &p, &["blk.0.ffn_gate.weight", "llama"]);
    let p = write_model(dir.path(), Arch::Qwen2, |md| {
        md[0].1 = Value::String("deepseek2".into());
    });
    says(
        &open_err(&p),
        &p,
        &["deepseek2", "mixture-of-experts", "cannot run"],
    );

    let m = SyntheticModel::small(Arch::Llama, 4);
    let mut tensors = m.gguf_tensors(GgufTypes::F32).unwrap();
    let router =
        candle_core::Tensor::zeros((8, 256), candle_core::DType::F32, &candle_core::Device::Cpu)
            .unwrap();
    tensors.push((
        "blk.0.ffn_gate_inp.weight".into(),
        candle_core::quantized::QTensor::quantize(&router, candle_core::quantized::GgmlDType::F32)
            .unwrap(),
    ));
    let p = dir.path().join("router.gguf");
    synthetic::write_gguf(&p, &m.gguf_metadata(), &tensors).unwrap();
    says(
        &open_err(&p),
        &p,
        &["blk.0.ffn_gate_inp.weight", "mixture-of-experts weight"],
    );
}

#[test]
fn minilm_bert_directory_is_an_unsupported_architecture() {
    let Some(dir) = common::minilm() else {
        return;
    };
    let e = open_err(&dir);
    assert!(
        matches!(e, ModelError::UnsupportedArch { ref arch, .. } if arch == "bert"),
        "{e:?}"
    );
    says(&e, &dir, &["not supported", "LlamaForCausalLM"]);
}

#[test]
fn gguf_missing_metadata_tensors_or_wrong_shapes_name_key_tensor_and_file() {
    let dir = tempfile::tempdir().unwrap();
    let p = write_model(dir.path(), Arch::Llama, |md| {
        md.retain(|(k, _)| k != "llama.block_count")
    });
    let e = open_err(&p);
    assert!(matches!(e, ModelError::MissingMetadata { .. }), "{e:?}");
    says(&e, &p, &["llama.block_count", "convert the model again"]);

    let m = SyntheticModel::small(Arch::Qwen2, 4);
    let md = m.gguf_metadata();
    let mut tensors = m.gguf_tensors(GgufTypes::F32).unwrap();
    tensors.retain(|(n, _)| n != "blk.1.attn_k.bias");
    let p = dir.path().join("nobias.gguf");
    synthetic::write_gguf(&p, &md, &tensors).unwrap();
    let e = open_err(&p);
    assert!(matches!(e, ModelError::MissingTensor { .. }), "{e:?}");
    says(
        &e,
        &p,
        &["blk.1.attn_k.bias", "download or convert it again"],
    );

    // ffn_up with the rows of another model.
    let mut tensors = m.gguf_tensors(GgufTypes::F32).unwrap();
    let wrong = candle_core::Tensor::zeros(
        (512, 256),
        candle_core::DType::F32,
        &candle_core::Device::Cpu,
    )
    .unwrap();
    let i = tensors
        .iter()
        .position(|(n, _)| n == "blk.0.ffn_up.weight")
        .unwrap();
    tensors[i].1 =
        candle_core::quantized::QTensor::quantize(&wrong, candle_core::quantized::GgmlDType::F32)
            .unwrap();
    let p = dir.path().join("shape.gguf");
    synthetic::write_gguf(&p, &md, &tensors).unwrap();
    let e = open_err(&p);
    assert!(matches!(e, ModelError::TensorShape { .. }), "{e:?}");
    says(
        &e,
        &p,
        &[
            "blk.0.ffn_up.weight",
            "[512, 256]",
            "[544, 256]",
            "re-export",
        ],
    );

    // A layer count past the tensors: refused at once from the tensor count, before any loop
    // over the claimed 2^40 layers.
    let p = write_model(dir.path(), Arch::Llama, |md| {
        for (k, v) in md.iter_mut() {
            if k == "llama.block_count" {
                *v = Value::U64(1 << 40);
            }
        }
    });
    let e = open_err(&p);
    assert!(matches!(e, ModelError::Inconsistent { .. }), "{e:?}");
    says(&e, &p, &["1099511627776 layers", "at most 2"]);

    // Sizes whose products overflow.
    let p = write_model(dir.path(), Arch::Llama, |md| {
        for (k, v) in md.iter_mut() {
            if k == "llama.embedding_length" {
                *v = Value::U64(u64::MAX / 2);
            }
        }
    });
    let e = open_err(&p);
    assert!(matches!(e, ModelError::Config(_)), "{e:?}");
    says(&e, &p, &["overflow"]);
}

fn hf_dir(root: &Path, name: &str, shards: usize) -> std::path::PathBuf {
    let d = root.join(name);
    SyntheticModel::small(Arch::Qwen2, 5)
        .write_hf(&d, shards, HfDType::F32)
        .unwrap();
    d
}

#[test]
fn hf_config_problems_name_config_json() {
    let root = tempfile::tempdir().unwrap();
    let d = hf_dir(root.path(), "badjson", 1);
    std::fs::write(d.join("config.json"), "{ \"model_type\": \"qwen2\", ").unwrap();
    let e = open_err(&d);
    assert!(matches!(e, ModelError::Config(_)), "{e:?}");
    says(&e, &d.join("config.json"), &["not valid JSON"]);

    let d = hf_dir(root.path(), "nofield", 1);
    let mut cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(d.join("config.json")).unwrap()).unwrap();
    cfg.as_object_mut().unwrap().remove("num_hidden_layers");
    std::fs::write(d.join("config.json"), cfg.to_string()).unwrap();
    let e = open_err(&d);
    assert!(matches!(e, ModelError::MissingMetadata { .. }), "{e:?}");
    says(
        &e,
        &d.join("config.json"),
        &["num_hidden_layers", "came with the model"],
    );

    let d = hf_dir(root.path(), "notype", 1);
    std::fs::write(d.join("config.json"), "{}").unwrap();
    let e = open_err(&d);
    says(&e, &d.join("config.json"), &["model_type"]);

    let d = hf_dir(root.path(), "noweights", 1);
    std::fs::remove_file(d.join("model.safetensors")).unwrap();
    let e = open_err(&d);
    says(
        &e,
        &d,
        &["neither model.safetensors", "download the weights"],
    );
}

#[test]
fn hf_shard_index_problems_name_the_index_or_shard() {
    let root = tempfile::tempdir().unwrap();
    let index = |d: &Path| -> serde_json::Value {
        serde_json::from_str(
            &std::fs::read_to_string(d.join("model.safetensors.index.json")).unwrap(),
        )
        .unwrap()
    };
    let write_index = |d: &Path, v: &serde_json::Value| {
        std::fs::write(d.join("model.safetensors.index.json"), v.to_string()).unwrap()
    };

    let d = hf_dir(root.path(), "missing_shard", 2);
    std::fs::remove_file(d.join("model-00002-of-00002.safetensors")).unwrap();
    let e = open_err(&d);
    assert!(matches!(e, ModelError::Input(_)), "{e:?}");
    says(
        &e,
        &d.join("model-00002-of-00002.safetensors"),
        &["is missing", "fetch that file again"],
    );

    for outside in [
        "../model-00001-of-00002.safetensors",
        "/etc/passwd",
        "sub/x.safetensors",
        ".hidden",
    ] {
        let d = hf_dir(root.path(), "outside", 2);
        let mut v = index(&d);
        v["weight_map"]["model.norm.weight"] = outside.into();
        write_index(&d, &v);
        let e = open_err(&d);
        assert!(matches!(e, ModelError::Corrupt { .. }), "{e:?}");
        says(
            &e,
            &d.join("model.safetensors.index.json"),
            &["leaves the model directory", outside],
        );
        std::fs::remove_dir_all(&d).unwrap();
    }

    let d = hf_dir(root.path(), "wrong_file", 2);
    let mut v = index(&d);
    v["weight_map"]["model.embed_tokens.weight"] = "model-00002-of-00002.safetensors".into();
    write_index(&d, &v);
    let e = open_err(&d);
    says(
        &e,
        &d.join("model.safetensors.index.json"),
        &["model.embed_tokens.weight", "does not hold it"],
    );

    let d = hf_dir(root.path(), "not_json", 2);
    std::fs::write(d.join("model.safetensors.index.json"), "weight_map").unwrap();
    says(
        &open_err(&d),
        &d.join("model.safetensors.index.json"),
        &["not valid JSON"],
    );

    // The same tensor in both shards.
    let d = hf_dir(root.path(), "dup", 2);
    let m = SyntheticModel::small(Arch::Qwen2, 5);
    let mut second: Vec<_> = m
        .hf_tensors()
        .into_iter()
        .skip(m.hf_tensors().len().div_ceil(2))
        .collect();
    second.push(m.hf_tensors()[0].clone());
    synthetic::write_safetensors(
        &d.join("model-00002-of-00002.safetensors"),
        &second,
        HfDType::F32,
    )
    .unwrap();
    let e = open_err(&d);
    says(
        &e,
        &d.join("model-00002-of-00002.safetensors"),
        &["model.embed_tokens.weight", "also in"],
    );
}

#[test]
fn hf_truncated_wrong_dtype_and_wrong_shape_name_file_and_tensor() {
    let root = tempfile::tempdir().unwrap();
    let d = hf_dir(root.path(), "truncated", 1);
    let st = d.join("model.safetensors");
    let len = std::fs::metadata(&st).unwrap().len();
    for cut in [0, 5, 100, len / 2, len - 1] {
        let f = std::fs::OpenOptions::new().write(true).open(&st).unwrap();
        f.set_len(cut).unwrap();
        let e = open_err(&d);
        assert!(matches!(e, ModelError::Corrupt { .. }), "{e:?}");
        says(&e, &st, &["truncated", "compare its sha256"]);
    }

    // An integer weight.
    let d = hf_dir(root.path(), "dtype", 1);
    let m = SyntheticModel::small(Arch::Qwen2, 5);
    let tensors = m.hf_tensors();
    let encoded: Vec<(String, Vec<usize>, Vec<u8>)> = tensors
        .iter()
        .map(|(n, s, v)| {
            if n == "model.layers.1.mlp.up_proj.weight" {
                let b = v.iter().flat_map(|x| (*x as i32).to_le_bytes()).collect();
                (n.clone(), s.clone(), b)
            } else {
                (
                    n.clone(),
                    s.clone(),
                    v.iter().flat_map(|x| x.to_le_bytes()).collect(),
                )
            }
        })
        .collect();
    let views: Vec<_> = encoded
        .iter()
        .map(|(n, s, b)| {
            let dt = if n.contains("up_proj") && n.contains("layers.1") {
                safetensors::Dtype::I32
            } else {
                safetensors::Dtype::F32
            };
            (
                n.clone(),
                safetensors::tensor::TensorView::new(dt, s.clone(), b).unwrap(),
            )
        })
        .collect();
    std::fs::write(
        d.join("model.safetensors"),
        safetensors::serialize(views, None).unwrap(),
    )
    .unwrap();
    let e = open_err(&d);
    assert!(matches!(e, ModelError::UnsupportedDType { .. }), "{e:?}");
    says(
        &e,
        &d.join("model.safetensors"),
        &["model.layers.1.mlp.up_proj.weight", "I32", "re-export"],
    );

    // A config that does not match the tensors.
    let d = hf_dir(root.path(), "shape", 1);
    let mut cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(d.join("config.json")).unwrap()).unwrap();
    cfg["intermediate_size"] = 512.into();
    std::fs::write(d.join("config.json"), cfg.to_string()).unwrap();
    let e = open_err(&d);
    assert!(matches!(e, ModelError::TensorShape { .. }), "{e:?}");
    says(
        &e,
        &d.join("model.safetensors"),
        &[
            "model.layers.0.mlp.gate_proj.weight",
            "[544, 256]",
            "[512, 256]",
        ],
    );

    // A 3-D weight.
    let d = hf_dir(root.path(), "rank3", 1);
    let mut t = m.hf_tensors();
    let i = t
        .iter()
        .position(|(n, ..)| n == "model.norm.weight")
        .unwrap();
    t[i].1 = vec![2, 2, 64];
    synthetic::write_safetensors(&d.join("model.safetensors"), &t, HfDType::F32).unwrap();
    let e = open_err(&d);
    says(
        &e,
        &d.join("model.safetensors"),
        &["model.norm.weight", "[2, 2, 64]"],
    );
}

fn small_cfg() -> ModelConfig {
    SyntheticModel::small(Arch::Llama, 0).cfg
}

#[test]
fn tp_sizes_that_cannot_work_name_the_valid_range() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("m.gguf");
    SyntheticModel::small(Arch::Llama, 6)
        .write_gguf(&p, GgufTypes::F32)
        .unwrap();
    let ckpt = GgufCheckpoint::open(&p).unwrap();
    for tp in [9, 16] {
        let e = ShardedModel::load(&ckpt, 0, tp, LoadOptions::default(), 16).unwrap_err();
        let m = e.to_string();
        assert!(
            m.contains(&format!(
                "8 heads cannot give every rank a head at tp={tp}; use 1 <= tp <= 8"
            )),
            "{m}"
        );
    }
    let e = ShardedModel::load(&ckpt, 0, 0, LoadOptions::default(), 16).unwrap_err();
    assert!(e.to_string().contains("use 1 <= tp <= 8"), "{e}");
    let e = ShardedModel::load(&ckpt, 5, 4, LoadOptions::default(), 16).unwrap_err();
    assert!(e.to_string().contains("use 0 <= tp_rank < 4"), "{e}");
    // Every tp up to the head count plans, KV heads replicated past 2.
    for tp in 1..=8 {
        for r in 0..tp {
            let plan = ShardPlan::for_checkpoint(&ckpt, r, tp).unwrap();
            assert!(!plan.kv_heads().is_empty() && !plan.q_heads().is_empty());
        }
    }

    // FFN and vocabulary too small for tp.
    let mut cfg = small_cfg();
    cfg.ffn = 3;
    let e = ShardPlan::new(&cfg, 1, 0, 4).unwrap_err().to_string();
    assert!(
        e.contains("3 FFN columns cannot give every rank a FFN column at tp=4; use 1 <= tp <= 3"),
        "{e}"
    );
    let mut cfg = small_cfg();
    cfg.vocab = 2;
    let e = ShardPlan::new(&cfg, 1, 0, 3).unwrap_err().to_string();
    assert!(e.contains("use 1 <= tp <= 2"), "{e}");
}

#[test]
fn heads_not_a_multiple_of_kv_heads_are_rejected_at_open_and_by_the_plan() {
    let mut cfg = small_cfg();
    cfg.kv_heads = 3;
    let e = ShardPlan::new(&cfg, 1, 0, 2).unwrap_err().to_string();
    assert!(
        e.contains("8 query heads are not a multiple of 3 KV heads"),
        "{e}"
    );

    let dir = tempfile::tempdir().unwrap();
    let p = write_model(dir.path(), Arch::Llama, |md| {
        for (k, v) in md.iter_mut() {
            if k == "llama.attention.head_count_kv" {
                *v = Value::U32(3);
            }
        }
    });
    let e = open_err(&p);
    assert!(matches!(e, ModelError::Config(_)), "{e:?}");
    says(
        &e,
        &p,
        &["8 query heads must be a positive multiple of 3 KV heads"],
    );
}

#[test]
fn synthetic_checkpoints_open_through_every_entry_point() {
    let dir = tempfile::tempdir().unwrap();
    let d = hf_dir(dir.path(), "hf", 2);
    let via_dir = open_checkpoint(&d).unwrap();
    let via_file = open_checkpoint(&d.join("model-00001-of-00002.safetensors")).unwrap();
    let via_config = open_checkpoint(&d.join("config.json")).unwrap();
    for c in [&via_dir, &via_file, &via_config] {
        assert_eq!(c.config(), via_dir.config());
        assert!(!c.config().tied_embeddings);
    }
    let h = HfCheckpoint::open(&d).unwrap();
    assert_eq!(h.config().arch, Arch::Qwen2);
}

/// Patches the ggml type of tensor `name` in a GGUF file's header.
fn retype(bytes: &mut [u8], name: &str, ty: u32) {
    let needle = [&(name.len() as u64).to_le_bytes()[..], name.as_bytes()].concat();
    let at = bytes
        .windows(needle.len())
        .position(|w| w == needle.as_slice())
        .expect("tensor name in the header");
    let p = at + needle.len();
    let n_dims = u32::from_le_bytes(bytes[p..p + 4].try_into().unwrap()) as usize;
    let t = p + 4 + 8 * n_dims;
    bytes[t..t + 4].copy_from_slice(&ty.to_le_bytes());
}

/// Sets metadata key `key` of a synthetic model's GGUF.
fn with_key(dir: &Path, arch: Arch, key: &str, v: Value) -> std::path::PathBuf {
    let key = key.to_string();
    write_model(dir, arch, move |md| {
        md.retain(|(k, _)| *k != key);
        md.push((key, v));
    })
}

#[test]
fn issue18_lowered_block_count_is_refused_naming_the_ignored_layer() {
    let dir = tempfile::tempdir().unwrap();
    let p = with_key(dir.path(), Arch::Llama, "llama.block_count", Value::U32(1));
    let e = open_err(&p);
    assert!(matches!(e, ModelError::Inconsistent { .. }), "{e:?}");
    says(&e, &p, &["blk.1.", "layer 1", "declares 1 layers"]);
}

#[test]
fn issue18_retyped_norm_leaves_a_gap_and_a_quantized_norm_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    // The issue's edit: F32 -> Q4_0 in the header only, so the data no longer tiles.
    let p = write_model(dir.path(), Arch::Llama, |_| {});
    let mut bytes = std::fs::read(&p).unwrap();
    retype(&mut bytes, "blk.0.attn_norm.weight", 2);
    std::fs::write(&p, &bytes).unwrap();
    let e = open_err(&p);
    assert!(matches!(e, ModelError::Corrupt { .. }), "{e:?}");
    says(&e, &p, &["unused bytes", "blk.0.attn_norm.weight"]);

    // A norm written consistently as Q8_0 (no gap): a type a norm cannot have.
    let m = SyntheticModel::small(Arch::Llama, 3);
    let mut tensors = m.gguf_tensors(GgufTypes::F32).unwrap();
    let i = tensors
        .iter()
        .position(|(n, _)| n == "output_norm.weight")
        .unwrap();
    let deq = tensors[i].1.dequantize(&candle_core::Device::Cpu).unwrap();
    tensors[i].1 =
        candle_core::quantized::QTensor::quantize(&deq, candle_core::quantized::GgmlDType::Q8_0)
            .unwrap();
    let p = dir.path().join("q8norm.gguf");
    synthetic::write_gguf(&p, &m.gguf_metadata(), &tensors).unwrap();
    let e = open_err(&p);
    assert!(matches!(e, ModelError::Inconsistent { .. }), "{e:?}");
    says(&e, &p, &["output_norm.weight", "Q8_0", "F32, F16 or BF16"]);
}

#[test]
fn issue18_tensors_the_architecture_does_not_use_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let m = SyntheticModel::small(Arch::Llama, 3);
    let extra = |name: &str| {
        let mut tensors = m.gguf_tensors(GgufTypes::F32).unwrap();
        let norm = tensors
            .iter()
            .find(|(n, _)| n == "blk.0.attn_norm.weight")
            .unwrap()
            .1
            .dequantize(&candle_core::Device::Cpu)
            .unwrap();
        let t = candle_core::quantized::QTensor::quantize(
            &norm,
            candle_core::quantized::GgmlDType::F32,
        )
        .unwrap();
        tensors.push((name.to_string(), t));
        let p = dir.path().join(format!("{name}.gguf"));
        synthetic::write_gguf(&p, &m.gguf_metadata(), &tensors).unwrap();
        p
    };
    for (name, says_what) in [
        ("rope_freqs.weight", "not a weight of a llama model"),
        ("blk.0.attn_q.bias", "qkv bias false"),
        ("blk.7.attn_norm.weight", "layer 7"),
    ] {
        let p = extra(name);
        let e = open_err(&p);
        assert!(
            matches!(e, ModelError::Inconsistent { .. }),
            "{name}: {e:?}"
        );
        says(&e, &p, &[name, says_what]);
    }

    // HF: an extra layer, and a stray tensor; RoPE's inv_freq buffers stay allowed.
    let root = tempfile::tempdir().unwrap();
    let d = hf_dir(root.path(), "extra_layer", 1);
    let mut cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(d.join("config.json")).unwrap()).unwrap();
    cfg["num_hidden_layers"] = 1.into();
    std::fs::write(d.join("config.json"), cfg.to_string()).unwrap();
    let e = open_err(&d);
    assert!(matches!(e, ModelError::Inconsistent { .. }), "{e:?}");
    says(&e, &d, &["model.layers.1.", "layer 1"]);

    let d = root.path().join("stray");
    let sm = SyntheticModel::small(Arch::Qwen2, 5);
    sm.write_hf(&d, 1, HfDType::F32).unwrap();
    let mut tensors = sm.hf_tensors();
    tensors.push(("model.rotary_emb.inv_freq".into(), vec![4], vec![1.0; 4]));
    synthetic::write_safetensors(&d.join("model.safetensors"), &tensors, HfDType::F32).unwrap();
    assert!(open_checkpoint(&d).is_ok(), "inv_freq buffers are allowed");
    tensors.push(("model.vision_tower.weight".into(), vec![4], vec![1.0; 4]));
    synthetic::write_safetensors(&d.join("model.safetensors"), &tensors, HfDType::F32).unwrap();
    let e = open_err(&d);
    says(&e, &d, &["model.vision_tower.weight", "would be ignored"]);
}

#[test]
fn issue18_huge_layer_count_in_config_json_fails_at_once() {
    let root = tempfile::tempdir().unwrap();
    let d = hf_dir(root.path(), "layers", 1);
    let mut cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(d.join("config.json")).unwrap()).unwrap();
    cfg["num_hidden_layers"] = 1_000_000_000_000u64.into();
    std::fs::write(d.join("config.json"), cfg.to_string()).unwrap();
    let start = std::time::Instant::now();
    let e = open_err(&d);
    assert!(
        start.elapsed() < std::time::Duration::from_secs(1),
        "{:?}",
        start.elapsed()
    );
    assert!(matches!(e, ModelError::Inconsistent { .. }), "{e:?}");
    says(&e, &d, &["1000000000000 layers", "at most 3"]);
}

#[test]
fn issue18_mistyped_optional_keys_are_errors_not_defaults() {
    let dir = tempfile::tempdir().unwrap();
    let p = with_key(
        dir.path(),
        Arch::Llama,
        "llama.context_length",
        Value::F32(8192.0),
    );
    let e = open_err(&p);
    assert!(matches!(e, ModelError::Config(_)), "{e:?}");
    says(
        &e,
        &p,
        &["llama.context_length", "not a non-negative integer"],
    );
    let p = with_key(
        dir.path(),
        Arch::Llama,
        "llama.attention.head_count_kv",
        Value::I32(-1),
    );
    says(&open_err(&p), &p, &["llama.attention.head_count_kv"]);
    let root = tempfile::tempdir().unwrap();
    let d = hf_dir(root.path(), "kv", 1);
    let mut cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(d.join("config.json")).unwrap()).unwrap();
    cfg["num_key_value_heads"] = "two".into();
    std::fs::write(d.join("config.json"), cfg.to_string()).unwrap();
    says(
        &open_err(&d),
        &d.join("config.json"),
        &["num_key_value_heads"],
    );
}

/// The context sizes of the issue: each refused before anything is allocated, naming the
/// value and the bytes it would take.
#[test]
fn issue18_context_lengths_too_large_to_hold_are_refused_with_their_cost() {
    let dir = tempfile::tempdir().unwrap();
    let p = write_model(dir.path(), Arch::Llama, |_| {});
    let ckpt = GgufCheckpoint::open(&p).unwrap();
    for ctx in [4_000_000_000usize, usize::MAX, (1 << 31) - 1] {
        let start = std::time::Instant::now();
        let e = ShardedModel::load(&ckpt, 0, 1, LoadOptions::default(), ctx).unwrap_err();
        assert!(matches!(e, ModelError::TooLarge { .. }), "{ctx}: {e:?}");
        let m = e.to_string();
        eprintln!("ctx {ctx}: {m}");
        assert!(m.contains(&ctx.to_string()) && m.contains("bytes"), "{m}");
        let plan = ShardPlan::for_checkpoint(&ckpt, 0, 1).unwrap();
        let e = tp_models::rank_memory(&ckpt, &plan, ctx, 4, true, tp_models::KvDtype::F32)
            .unwrap_err();
        assert!(matches!(e, ModelError::TooLarge { .. }), "{ctx}: {e:?}");
        let e = tp_models::limits::check_context(ckpt.config(), ctx).unwrap_err();
        assert!(e.to_string().contains(&ctx.to_string()), "{e}");
        assert!(start.elapsed() < std::time::Duration::from_secs(1));
    }
    // A GGUF context_length of 2^31-1 opens (a file may declare a long context) and is
    // refused when that context is asked for.
    let p = with_key(
        dir.path(),
        Arch::Llama,
        "llama.context_length",
        Value::U32((1 << 31) - 1),
    );
    let ckpt = GgufCheckpoint::open(&p).unwrap();
    let ctx = ckpt.config().context;
    assert_eq!(ctx, (1 << 31) - 1);
    let e = ShardedModel::load(&ckpt, 0, 1, LoadOptions::default(), ctx).unwrap_err();
    says(
        &e,
        Path::new(""),
        &["2147483647", "bytes", "shorter context"],
    );
}
