//! Helpers shared by the integration tests: reading GGUF metadata and oracle fixtures, checking
//! encode against them; the installed models and scratch folders come from tp-testkit.
#![allow(dead_code)]

use std::collections::HashMap;
use std::path::Path;

use candle_core::quantized::gguf_file::{Content, Value};
use tp_tokenizer::{TextStream, Tokenizer};

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
