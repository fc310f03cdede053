//! Reads the model shape from a GGUF file's metadata header (GGUF v2/v3, the ggml repository's
//! spec, github.com/ggml-org/ggml; the rules of our readers: docs/gguf.md): magic, version,
//! counts, key/value pairs and tensor infos.
//! Only the header is read; every length is bounds-checked, and truncated or
//! malformed files are typed errors.

use crate::model::{ModelSpec, StoredWeights};
use crate::PlanError;
use std::collections::HashMap;
use std::io::{BufReader, Read};
use std::path::Path;
use tp_spec::{parse_gguf_name, Dims, Layout, MetaValue, ModelConfig, WeightName};

/// Longest string the parser accepts (keys, values, tensor names).
const MAX_STRING_BYTES: u64 = 1 << 20;
/// Arrays inside arrays nest at most this deep (real files nest at most once).
const MAX_ARRAY_DEPTH: usize = 8;
/// Layers beyond this index are no real model's; their tensors are not kept.
const MAX_LAYERS: usize = 1 << 16;
/// Most array elements / key-value pairs / tensors the parser accepts.
const MAX_COUNT: u64 = 1 << 24;

struct HeaderReader<R: Read> {
    inner: R,
    offset: u64,
}

impl<R: Read> HeaderReader<R> {
    fn bytes<const N: usize>(&mut self, what: &str) -> Result<[u8; N], String> {
        let mut buf = [0u8; N];
        self.inner
            .read_exact(&mut buf)
            .map_err(|_| format!("truncated at byte {} while reading {what}", self.offset))?;
        self.offset += N as u64;
        Ok(buf)
    }
    fn u32(&mut self, what: &str) -> Result<u32, String> {
        self.bytes::<4>(what).map(u32::from_le_bytes)
    }
    fn u64(&mut self, what: &str) -> Result<u64, String> {
        self.bytes::<8>(what).map(u64::from_le_bytes)
    }
    fn count(&mut self, what: &str) -> Result<u64, String> {
        let n = self.u64(what)?;
        if n > MAX_COUNT {
            return Err(format!(
                "{what} {n} at byte {} is implausibly large",
                self.offset - 8
            ));
        }
        Ok(n)
    }
    fn string(&mut self, what: &str) -> Result<String, String> {
        let len = self.u64(what)?;
        if len > MAX_STRING_BYTES {
            return Err(format!(
                "{what} length {len} at byte {} is implausibly large",
                self.offset - 8
            ));
        }
        let mut buf = vec![0u8; len as usize];
        self.inner
            .read_exact(&mut buf)
            .map_err(|_| format!("truncated at byte {} while reading {what}", self.offset))?;
        self.offset += len;
        String::from_utf8(buf)
            .map_err(|_| format!("{what} ending at byte {} is not UTF-8", self.offset))
    }
    fn skip(&mut self, bytes: u64, what: &str) -> Result<(), String> {
        let copied = std::io::copy(&mut (&mut self.inner).take(bytes), &mut std::io::sink())
            .map_err(|e| format!("read error while skipping {what}: {e}"))?;
        if copied < bytes {
            return Err(format!(
                "truncated at byte {} while skipping {what}",
                self.offset + copied
            ));
        }
        self.offset += bytes;
        Ok(())
    }

    fn scalar_size(value_type: u32) -> Option<u64> {
        match value_type {
            0 | 1 | 7 => Some(1),
            2 | 3 => Some(2),
            4..=6 => Some(4),
            10..=12 => Some(8),
            _ => None,
        }
    }

    /// One value of `value_type`; `depth` counts the arrays around it.
    fn value(&mut self, value_type: u32, key: &str, depth: usize) -> Result<MetaValue, String> {
        Ok(match value_type {
            0 => MetaValue::Uint(u64::from(self.bytes::<1>(key)?[0])),
            1 => MetaValue::Int(i64::from(self.bytes::<1>(key)?[0] as i8)),
            2 => MetaValue::Uint(u64::from(u16::from_le_bytes(self.bytes::<2>(key)?))),
            3 => MetaValue::Int(i64::from(i16::from_le_bytes(self.bytes::<2>(key)?))),
            4 => MetaValue::Uint(u64::from(self.u32(key)?)),
            5 => MetaValue::Int(i64::from(i32::from_le_bytes(self.bytes::<4>(key)?))),
            6 => MetaValue::Float(f64::from(f32::from_le_bytes(self.bytes::<4>(key)?))),
            7 => MetaValue::Bool(self.bytes::<1>(key)?[0] != 0),
            8 => MetaValue::Text(self.string(key)?),
            9 => {
                let element_type = self.u32(key)?;
                let len = self.count(key)?;
                match (element_type, Self::scalar_size(element_type)) {
                    (_, Some(size)) => self.skip(size * len, key)?,
                    (8, None) => {
                        for _ in 0..len {
                            let n = self.u64(key)?;
                            if n > MAX_STRING_BYTES {
                                return Err(format!("string in array `{key}` is implausibly long"));
                            }
                            self.skip(n, key)?;
                        }
                    }
                    (9, None) if depth < MAX_ARRAY_DEPTH => {
                        for _ in 0..len {
                            self.value(9, key, depth + 1)?;
                        }
                    }
                    _ => {
                        return Err(format!(
                            "array `{key}` has unsupported element type {element_type} (or nests deeper than {MAX_ARRAY_DEPTH})"
                        ))
                    }
                }
                MetaValue::Array { len: len as usize }
            }
            10 => MetaValue::Uint(self.u64(key)?),
            11 => MetaValue::Int(i64::from_le_bytes(self.bytes::<8>(key)?)),
            12 => MetaValue::Float(f64::from_le_bytes(self.bytes::<8>(key)?)),
            other => return Err(format!("key `{key}` has unknown value type {other}")),
        })
    }
}

/// Parses a GGUF header from `reader`; `name` is used for the model name.
fn parse_header<R: Read>(reader: R, name: &str) -> Result<ModelSpec, String> {
    let mut r = HeaderReader {
        inner: reader,
        offset: 0,
    };
    let magic = r.bytes::<4>("magic")?;
    if &magic != b"GGUF" {
        return Err("not a GGUF file (bad magic)".to_string());
    }
    let version = r.u32("version")?;
    if !(2..=3).contains(&version) {
        return Err(format!(
            "unsupported GGUF version {version} (expected 2 or 3)"
        ));
    }
    let tensor_count = r.count("tensor count")?;
    let kv_count = r.count("metadata count")?;
    let mut meta: HashMap<String, MetaValue> = HashMap::new();
    for _ in 0..kv_count {
        let key = r.string("metadata key")?;
        let value_type = r.u32(&key)?;
        let value = r.value(value_type, &key, 0)?;
        meta.insert(key, value);
    }
    // Kept while streaming: the ggml type of each weight the model family names (layers
    // beyond MAX_LAYERS are no real model's, so a hostile header cannot grow this without
    // bound), the embedding's rows and whether an LM head is stored.
    let mut types: HashMap<WeightName, u32> = HashMap::new();
    let mut embed_rows = None;
    let mut has_output = tensor_count == 0;
    for _ in 0..tensor_count {
        let tensor = r.string("tensor name")?;
        let dims = r.u32(&tensor)?;
        if dims > 8 {
            return Err(format!("tensor `{tensor}` has {dims} dimensions"));
        }
        let shape = (0..dims)
            .map(|_| r.u64(&tensor))
            .collect::<Result<Vec<u64>, String>>()?;
        let ggml_type = r.u32(&tensor)?;
        r.skip(8, &tensor)?; // data offset
        if tensor == "token_embd.weight" {
            // ggml lists dimensions innermost first: the embedding is [hidden, vocab].
            embed_rows = shape.get(1).and_then(|&v| usize::try_from(v).ok());
        }
        has_output |= tensor == "output.weight";
        if let Some(w) =
            parse_gguf_name(&tensor).filter(|w| w.layer().is_none_or(|l| l < MAX_LAYERS))
        {
            types.insert(w, ggml_type);
        }
    }
    let dims = Dims::from_gguf(&meta, embed_rows, has_output).map_err(|e| e.to_string())?;
    let down = types
        .get(&WeightName::Down(0))
        .and_then(|&t| Layout::of_ggml_type(t));
    let ffn_unit = down.map_or(tp_spec::DENSE_CHUNK, Layout::ffn_unit);
    let mut model = ModelSpec::from_dims(name, &dims, ffn_unit as u64);
    // A supported architecture whose every weight has a known layout: exact per-rank bytes.
    if let Ok(config) = ModelConfig::from_gguf(&meta, embed_rows, has_output) {
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

/// Parses GGUF header bytes; `path` is used in errors and as the model name.
pub fn parse_gguf_header(bytes: &[u8], path: &Path) -> Result<ModelSpec, PlanError> {
    finish(parse_header(bytes, &path.display().to_string()), path)
}

fn finish(parsed: Result<ModelSpec, String>, path: &Path) -> Result<ModelSpec, PlanError> {
    let model = parsed.map_err(|message| PlanError::MalformedGguf {
        path: path.to_path_buf(),
        message,
    })?;
    model.validate()?;
    Ok(model)
}

/// Reads only the header of a GGUF file.
pub fn load_gguf(path: &Path) -> Result<ModelSpec, PlanError> {
    let file = std::fs::File::open(path).map_err(|source| PlanError::FileRead {
        path: path.to_path_buf(),
        source,
    })?;
    finish(
        parse_header(BufReader::new(file), &path.display().to_string()),
        path,
    )
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
            .contains("bad magic"));
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
