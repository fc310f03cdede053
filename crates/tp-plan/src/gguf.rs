//! Reads the model shape from a GGUF file's header with tp-spec's one GGUF header reader
//! ([`tp_spec::gguf`]: every count and length bounded by the file, typed errors naming the key
//! or tensor; the rules: docs/gguf.md). Only the header is read, from the start of the file
//! (a few MB for a large vocabulary), never the tensor data.

use crate::model::{ModelSpec, StoredWeights};
use crate::PlanError;
use std::collections::HashMap;
use std::path::Path;
use tp_spec::gguf::{GgufError, GgufHeader};
use tp_spec::{parse_gguf_name, Dims, Layout, ModelConfig, WeightName};

/// Layers beyond this index are no real model's; their tensors are not kept.
const MAX_LAYERS: usize = 1 << 16;

/// The planner's model from a parsed header; `name` is the model name.
fn model_of(header: &GgufHeader, name: &str) -> Result<ModelSpec, String> {
    // The ggml type of each weight the model family names (layers beyond MAX_LAYERS are no
    // real model's), the embedding's rows and whether an LM head is stored.
    let mut types: HashMap<WeightName, u32> = HashMap::new();
    for t in &header.tensors {
        if let Some(w) =
            parse_gguf_name(&t.name).filter(|w| w.layer().is_none_or(|l| l < MAX_LAYERS))
        {
            types.insert(w, t.ggml_type);
        }
    }
    // The embedding is `[vocab, hidden]`.
    let embed_rows = header
        .tensor("token_embd.weight")
        .and_then(|t| (t.shape.len() >= 2).then(|| t.shape[t.shape.len() - 2]));
    let has_output = header.tensors.is_empty() || header.tensor("output.weight").is_some();
    let meta = &header.metadata;
    let dims = Dims::from_gguf(meta, embed_rows, has_output).map_err(|e| e.to_string())?;
    let down = types
        .get(&WeightName::Down(0))
        .and_then(|&t| Layout::of_ggml_type(t));
    let ffn_unit = down.map_or(tp_spec::DENSE_CHUNK, Layout::ffn_unit);
    let mut model = ModelSpec::from_dims(name, &dims, ffn_unit as u64);
    // A supported architecture whose every weight has a known layout: exact per-rank bytes.
    if let Ok(config) = ModelConfig::from_gguf(meta, embed_rows, has_output) {
        let layouts: Option<HashMap<WeightName, Layout>> = types
            .iter()
            .map(|(&w, &t)| Some((w, Layout::of_ggml_type(t)?)))
            .collect();
        if let Some(layouts) = layouts {
            model.stored = Some(StoredWeights { config, layouts });
        }
    }
    Ok(model)
}

/// Parses GGUF header bytes (the whole file, or at least its header); `path` is used in
/// errors and as the model name.
pub fn parse_gguf_header(bytes: &[u8], path: &Path) -> Result<ModelSpec, PlanError> {
    let header = GgufHeader::read(bytes, bytes.len() as u64).map_err(|e| malformed(path, e))?;
    finish(model_of(&header, &path.display().to_string()), path)
}

fn malformed(path: &Path, e: GgufError) -> PlanError {
    PlanError::MalformedGguf {
        path: path.to_path_buf(),
        message: e.to_string(),
    }
}

fn finish(parsed: Result<ModelSpec, String>, path: &Path) -> Result<ModelSpec, PlanError> {
    let model = parsed.map_err(|message| PlanError::MalformedGguf {
        path: path.to_path_buf(),
        message,
    })?;
    model.validate()?;
    Ok(model)
}

/// Reads only the header of a GGUF file ([`GgufHeader::read_file`]: its first MB, then more
/// while the header goes on).
pub fn load_gguf(path: &Path) -> Result<ModelSpec, PlanError> {
    let header = GgufHeader::read_file(path).map_err(|e| match e {
        GgufError::Io(source) => PlanError::FileRead {
            path: path.to_path_buf(),
            source,
        },
        e => malformed(path, e),
    })?;
    finish(model_of(&header, &path.display().to_string()), path)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn string(out: &mut Vec<u8>, s: &str) {
        out.extend_from_slice(&(s.len() as u64).to_le_bytes());
        out.extend_from_slice(s.as_bytes());
    }
    fn kv_u32(out: &mut Vec<u8>, key: &str, v: u32) {
        string(out, key);
        out.extend_from_slice(&4u32.to_le_bytes());
        out.extend_from_slice(&v.to_le_bytes());
    }

    /// A SmolLM2-shaped header: 8 keys, a 3-token string array, one tensor.
    fn smollm2_header() -> Vec<u8> {
        let mut out = b"GGUF".to_vec();
        out.extend_from_slice(&3u32.to_le_bytes());
        out.extend_from_slice(&1u64.to_le_bytes()); // tensors
        out.extend_from_slice(&8u64.to_le_bytes()); // kv pairs
        string(&mut out, "general.architecture");
        out.extend_from_slice(&8u32.to_le_bytes());
        string(&mut out, "llama");
        kv_u32(&mut out, "llama.block_count", 30);
        kv_u32(&mut out, "llama.embedding_length", 576);
        kv_u32(&mut out, "llama.feed_forward_length", 1536);
        kv_u32(&mut out, "llama.attention.head_count", 9);
        kv_u32(&mut out, "llama.attention.head_count_kv", 3);
        kv_u32(&mut out, "llama.vocab_size", 49152);
        string(&mut out, "tokenizer.ggml.tokens");
        out.extend_from_slice(&9u32.to_le_bytes());
        out.extend_from_slice(&8u32.to_le_bytes());
        out.extend_from_slice(&3u64.to_le_bytes());
        for t in ["a", "bc", "def"] {
            string(&mut out, t);
        }
        string(&mut out, "token_embd.weight");
        out.extend_from_slice(&2u32.to_le_bytes());
        out.extend_from_slice(&576u64.to_le_bytes());
        out.extend_from_slice(&49152u64.to_le_bytes());
        out.extend_from_slice(&0u32.to_le_bytes()); // ggml type
        out.extend_from_slice(&0u64.to_le_bytes()); // offset
        out
    }

    #[test]
    fn parses_a_llama_header() {
        let m = parse_gguf_header(&smollm2_header(), Path::new("smol.gguf")).unwrap();
        let preset = crate::model_presets::model_preset("smollm2-135m").unwrap();
        assert_eq!(m.total_params(), preset.total_params());
        assert!(m.tied_embeddings, "no output.weight tensor → tied");
    }

    /// A Mixtral-style header (`llama` with an expert count): the planner sizes its experts
    /// (the loader refuses it), and its weights are not priced as a dense file's.
    #[test]
    fn an_expert_count_makes_a_mixture_of_experts_spec() {
        let mut h = smollm2_header();
        // Two more metadata pairs.
        h[16..24].copy_from_slice(&10u64.to_le_bytes());
        let at = 24 + 8 + "general.architecture".len() + 4 + 8 + "llama".len();
        let mut extra = Vec::new();
        kv_u32(&mut extra, "llama.expert_count", 8);
        kv_u32(&mut extra, "llama.expert_used_count", 2);
        h.splice(at..at, extra);
        let m = parse_gguf_header(&h, Path::new("moe.gguf")).unwrap();
        assert_eq!((m.num_experts, m.experts_per_token), (8, 2));
        assert!(m.is_moe());
    }

    /// A header longer than the first read (a 3 MiB description before the tensors) is read
    /// in several steps from the file; the same file cut inside the header is an error.
    #[test]
    fn load_gguf_reads_a_header_longer_than_the_first_read() {
        let mut h = smollm2_header();
        h[16..24].copy_from_slice(&9u64.to_le_bytes());
        let at = 24 + 8 + "general.architecture".len() + 4 + 8 + "llama".len();
        let mut extra = Vec::new();
        string(&mut extra, "general.description");
        extra.extend_from_slice(&8u32.to_le_bytes());
        string(&mut extra, &"x".repeat(3 << 20));
        h.splice(at..at, extra);
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("long.gguf");
        std::fs::write(&path, &h).unwrap();
        let m = load_gguf(&path).unwrap();
        assert_eq!(m.num_layers, 30);
        std::fs::write(&path, &h[..h.len() - 10]).unwrap();
        let e = load_gguf(&path).unwrap_err();
        assert!(matches!(e, PlanError::MalformedGguf { .. }), "{e}");
        assert!(e.to_string().contains("truncated"), "{e}");
    }

    #[test]
    fn every_truncation_is_a_typed_error() {
        let full = smollm2_header();
        for cut in 0..full.len() {
            let e = parse_gguf_header(&full[..cut], Path::new("t.gguf")).unwrap_err();
            assert!(
                matches!(e, PlanError::MalformedGguf { .. }),
                "cut {cut}: {e}"
            );
        }
    }

    #[test]
    fn bad_magic_version_and_lengths() {
        let p = Path::new("b.gguf");
        let mut bad = smollm2_header();
        bad[0] = b'X';
        assert!(parse_gguf_header(&bad, p)
            .unwrap_err()
            .to_string()
            .contains("not a GGUF file"));
        let mut bad = smollm2_header();
        bad[4] = 9;
        assert!(parse_gguf_header(&bad, p)
            .unwrap_err()
            .to_string()
            .contains("version 9"));
        let mut bad = smollm2_header();
        // First key length (bytes 24..32) set to 2^40.
        bad[24..32].copy_from_slice(&(1u64 << 40).to_le_bytes());
        assert!(parse_gguf_header(&bad, p)
            .unwrap_err()
            .to_string()
            .contains("implausibly large"));
    }
}
