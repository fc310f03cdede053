//! The hardened GGUF header parser: same result as candle's reader on real and synthetic
//! files, and a typed error naming the key or tensor for every kind of corruption.

mod common;

use candle_core::quantized::gguf_file::{self, Value};
use std::collections::HashMap;
use tp_models::synthetic::{GgufTypes, SyntheticModel};
use tp_models::{Arch, GgufHeader, ModelError};

/// Values compared exactly (floats by bits; candle's `Value` has no `PartialEq`).
fn value_eq(a: &Value, b: &Value) -> bool {
    match (a, b) {
        (Value::U8(x), Value::U8(y)) => x == y,
        (Value::I8(x), Value::I8(y)) => x == y,
        (Value::U16(x), Value::U16(y)) => x == y,
        (Value::I16(x), Value::I16(y)) => x == y,
        (Value::U32(x), Value::U32(y)) => x == y,
        (Value::I32(x), Value::I32(y)) => x == y,
        (Value::U64(x), Value::U64(y)) => x == y,
        (Value::I64(x), Value::I64(y)) => x == y,
        (Value::F32(x), Value::F32(y)) => x.to_bits() == y.to_bits(),
        (Value::F64(x), Value::F64(y)) => x.to_bits() == y.to_bits(),
        (Value::Bool(x), Value::Bool(y)) => x == y,
        (Value::String(x), Value::String(y)) => x == y,
        (Value::Array(x), Value::Array(y)) => {
            x.len() == y.len() && x.iter().zip(y).all(|(a, b)| value_eq(a, b))
        }
        _ => false,
    }
}

/// Our header equals candle's `Content::read` of the same bytes.
fn assert_same_as_candle(bytes: &[u8], what: &str) -> GgufHeader {
    let ours = GgufHeader::parse(bytes, what).unwrap();
    let theirs = gguf_file::Content::read(&mut std::io::Cursor::new(bytes)).unwrap();
    assert_eq!(
        ours.metadata.len(),
        theirs.metadata.len(),
        "{what}: key count"
    );
    for (k, v) in &theirs.metadata {
        let mine = ours
            .metadata
            .get(k)
            .unwrap_or_else(|| panic!("{what}: lacks {k}"));
        assert!(value_eq(mine, v), "{what}: {k}: {mine:?} != {v:?}");
    }
    assert_eq!(
        ours.tensors.len(),
        theirs.tensor_infos.len(),
        "{what}: tensor count"
    );
    for t in &ours.tensors {
        let c = &theirs.tensor_infos[&t.name];
        assert_eq!(t.shape, c.shape.dims(), "{what}: {} shape", t.name);
        assert_eq!(t.dtype, c.ggml_dtype.into(), "{what}: {} type", t.name);
        assert_eq!(t.offset, c.offset, "{what}: {} offset", t.name);
    }
    assert_eq!(
        ours.data_offset, theirs.tensor_data_offset,
        "{what}: data offset"
    );
    ours
}

#[test]
fn smollm2_header_is_the_same_as_candles() {
    let Some(path) = common::smollm2() else {
        return;
    };
    let bytes = std::fs::read(&path).unwrap();
    let h = assert_same_as_candle(&bytes, "SmolLM2");
    assert_eq!(h.tensors.len(), 272); // 30 layers x 9 + token_embd + output_norm
    assert_eq!(
        h.tensor("token_embd.weight").unwrap().shape,
        vec![49152, 576]
    );
    match h.metadata.get("tokenizer.ggml.tokens") {
        Some(Value::Array(t)) => assert_eq!(t.len(), 49152),
        other => panic!("tokens: {other:?}"),
    }
}

#[test]
fn synthetic_header_with_every_value_type_is_the_same_as_candles() {
    use tp_models::checkpoint::GgmlDType::*;
    let dir = tempfile::tempdir().unwrap();
    for (arch, types) in [
        (
            Arch::Llama,
            GgufTypes {
                linear: Q4_1,
                embed: Q8_0,
            },
        ),
        (
            Arch::Qwen2,
            GgufTypes {
                linear: Q4_0,
                embed: F32,
            },
        ),
    ] {
        let path = dir.path().join("m.gguf");
        SyntheticModel::small(arch, 1)
            .write_gguf(&path, types)
            .unwrap();
        let bytes = std::fs::read(&path).unwrap();
        let h = assert_same_as_candle(&bytes, &format!("{arch:?}"));
        assert!(matches!(h.metadata["synthetic.nested"], Value::Array(ref a) if a.len() == 2));
        // The candle Content built from our header reads the same tensor bytes.
        let content = h.to_candle();
        let mut cur = std::io::Cursor::new(&bytes);
        let q = content.tensor(&mut cur, "blk.1.ffn_down.weight", &candle_core::Device::Cpu);
        assert_eq!(q.unwrap().shape().dims(), &[256, 544]);
    }
}

/// A GGUF writer that writes whatever it is told, valid or not.
struct Raw(Vec<u8>);

impl Raw {
    fn new(version: u32, tensors: u64, kvs: u64) -> Self {
        let mut r = Raw(b"GGUF".to_vec());
        r.u32(version).u64(tensors).u64(kvs);
        r
    }
    fn u32(&mut self, x: u32) -> &mut Self {
        self.0.extend_from_slice(&x.to_le_bytes());
        self
    }
    fn u64(&mut self, x: u64) -> &mut Self {
        self.0.extend_from_slice(&x.to_le_bytes());
        self
    }
    fn str(&mut self, s: &str) -> &mut Self {
        self.u64(s.len() as u64);
        self.0.extend_from_slice(s.as_bytes());
        self
    }
    fn kv_u32(&mut self, key: &str, v: u32) -> &mut Self {
        self.str(key).u32(4).u32(v)
    }
    /// `dims` innermost first, as in the file.
    fn tensor(&mut self, name: &str, dims: &[u64], ty: u32, offset: u64) -> &mut Self {
        self.str(name).u32(dims.len() as u32);
        for &d in dims {
            self.u64(d);
        }
        self.u32(ty).u64(offset)
    }
    fn pad(&mut self, align: usize) -> &mut Self {
        while !self.0.len().is_multiple_of(align) {
            self.0.push(0);
        }
        self
    }
    fn zeros(&mut self, n: usize) -> &mut Self {
        self.0.resize(self.0.len() + n, 0);
        self
    }
}

fn err(bytes: &[u8]) -> String {
    match GgufHeader::parse(bytes, "bad.gguf") {
        Ok(_) => panic!("a corrupt header was accepted"),
        Err(e) => {
            assert!(
                matches!(
                    e,
                    ModelError::Corrupt { .. } | ModelError::UnsupportedDType { .. }
                ),
                "{e:?}"
            );
            let m = e.to_string();
            assert!(m.contains("bad.gguf"), "{m}");
            m
        }
    }
}

fn has(m: &str, parts: &[&str]) {
    for p in parts {
        assert!(m.contains(p), "{m:?} lacks {p:?}");
    }
}

/// Two F32 tensors `a` [4] and `b` [8], with optional changes to b's fields.
fn two_tensors(b_dims: &[u64], b_ty: u32, b_off: u64) -> Vec<u8> {
    let mut r = Raw::new(3, 2, 1);
    r.kv_u32("general.alignment", 32)
        .tensor("a", &[4], 0, 0)
        .tensor("b", b_dims, b_ty, b_off)
        .pad(32)
        .zeros(64);
    r.0
}

#[test]
fn a_valid_handmade_file_parses() {
    let h = GgufHeader::parse(&two_tensors(&[8], 0, 32), "ok.gguf").unwrap();
    assert_eq!(h.data_offset % 32, 0);
    assert_eq!(h.tensor("b").unwrap().bytes, 32);
    assert_eq!(h.data_range(h.tensor("b").unwrap()).len(), 32);
}

#[test]
fn not_gguf_empty_or_unknown_versions_are_rejected() {
    has(&err(b""), &["empty"]);
    has(
        &err(b"hello world, this is text\n"),
        &["not a GGUF file", "hello world"],
    );
    has(&err(b"GGU"), &["not a GGUF file"]);
    has(&err(&Raw::new(1, 0, 0).0), &["version 1", "convert"]);
    has(&err(&Raw::new(9, 0, 0).0), &["version 9"]);
    has(&err(&Raw::new(3u32.swap_bytes(), 0, 0).0), &["big-endian"]);
}

#[test]
fn counts_and_lengths_beyond_the_file_are_rejected_before_allocating() {
    has(&err(&Raw::new(3, u64::MAX, 0).0), &["tensor count"]);
    has(&err(&Raw::new(3, 0, 1 << 40).0), &["metadata count"]);
    let mut r = Raw::new(3, 0, 1);
    r.u64(u64::MAX - 3).zeros(16);
    has(&err(&r.0), &["metadata key #0", "string length"]);
    let mut r = Raw::new(3, 0, 1);
    r.str("general.name").u32(8).u64(1 << 50);
    has(&err(&r.0), &["general.name", "string length"]);
    let mut r = Raw::new(3, 0, 1);
    r.str("tokenizer.ggml.tokens").u32(9).u32(8).u64(1 << 40);
    has(&err(&r.0), &["tokenizer.ggml.tokens", "array length"]);
    // An array of u8 whose length fits the file but not the metadata value cap is fine when
    // small: 3 values here.
    let mut r = Raw::new(3, 0, 1);
    r.str("k").u32(9).u32(0).u64(3).zeros(3);
    GgufHeader::parse(&r.0, "ok.gguf").unwrap();
}

#[test]
fn bad_value_types_bools_nesting_and_duplicate_keys_are_rejected() {
    let mut r = Raw::new(3, 0, 1);
    r.str("odd.key").u32(13).u32(0);
    has(&err(&r.0), &["odd.key", "value type 13"]);
    let mut r = Raw::new(3, 0, 1);
    r.str("odd.array").u32(9).u32(77).u64(1).u32(0);
    has(&err(&r.0), &["odd.array", "element type 77"]);
    let mut r = Raw::new(3, 0, 1);
    r.str("flag").u32(7).0.push(2);
    has(&err(&r.0), &["flag", "boolean byte 2"]);
    let mut r = Raw::new(3, 0, 1);
    r.str("deep").u32(9);
    for _ in 0..20 {
        r.u32(9).u64(1);
    }
    r.u32(0).u64(0);
    has(&err(&r.0), &["deep", "nest deeper"]);
    let mut r = Raw::new(3, 0, 2);
    r.kv_u32("twice", 1).kv_u32("twice", 2);
    has(&err(&r.0), &["twice", "appears twice"]);
    let mut r = Raw::new(3, 0, 1);
    r.u64(2).0.extend_from_slice(&[0xff, 0xfe]);
    r.u32(4).u32(0);
    has(&err(&r.0), &["not UTF-8"]);
}

#[test]
fn bad_tensor_infos_are_rejected_naming_the_tensor() {
    has(
        &err(&two_tensors(&[8, 1, 1, 1, 1], 0, 32)),
        &["tensor b", "5 dimensions"],
    );
    has(
        &err(&two_tensors(&[], 0, 32)),
        &["tensor b", "0 dimensions"],
    );
    has(
        &err(&two_tensors(&[8, 0], 0, 32)),
        &["tensor b", "dimension 0"],
    );
    has(
        &err(&two_tensors(&[1 << 32, 1 << 32, 1 << 32], 0, 32)),
        &["tensor b", "overflow"],
    );
    has(
        &err(&two_tensors(&[8], 99, 32)),
        &["tensor b", "type 99", "not a ggml type"],
    );
    has(
        &err(&two_tensors(&[33], 8, 32)),
        &["tensor b", "Q8_0 blocks"],
    );
    let m = err(&two_tensors(&[256], 16, 32));
    has(&m, &["b in bad.gguf", "IQ2_XXS"]);
    let mut r = Raw::new(3, 2, 0);
    r.tensor("w", &[4], 0, 0)
        .tensor("w", &[4], 0, 32)
        .pad(32)
        .zeros(64);
    has(&err(&r.0), &["tensor w appears twice"]);
}

#[test]
fn tensors_outside_the_file_overlapping_or_misaligned_are_rejected() {
    has(
        &err(&two_tensors(&[8], 0, 64)),
        &["tensor b", "past the end", "truncated"],
    );
    has(
        &err(&two_tensors(&[8], 0, u64::MAX - 31)),
        &["tensor b", "past the end"],
    );
    has(&err(&two_tensors(&[8], 0, 0)), &["tensors a and b overlap"]);
    has(
        &err(&two_tensors(&[8], 0, 8)),
        &["tensor b", "alignment 32"],
    );
    has(
        &err(&two_tensors(&[1 << 40], 0, 32)),
        &["tensor b", "past the end"],
    );
}

#[test]
fn general_alignment_must_be_a_power_of_two_of_at_least_8() {
    for (v, ok) in [
        (0u32, false),
        (3, false),
        (4, false),
        (48, false),
        (8, true),
        (64, true),
    ] {
        // The data (16 bytes) starts at the header rounded up to the alignment; for a bad
        // alignment any layout does, since the key is refused first.
        let mut r = Raw::new(3, 1, 1);
        r.kv_u32("general.alignment", v)
            .tensor("a", &[4], 0, 0)
            .pad(if ok { v as usize } else { 64 })
            .zeros(16);
        match GgufHeader::parse(&r.0, "bad.gguf") {
            Ok(h) => {
                assert!(ok, "alignment {v} accepted");
                assert_eq!(h.alignment, u64::from(v));
                assert_eq!(h.data_offset % u64::from(v), 0);
            }
            Err(e) => {
                assert!(!ok, "alignment {v} rejected: {e}");
                has(&e.to_string(), &["general.alignment"]);
            }
        }
    }
    let mut r = Raw::new(3, 0, 1);
    r.str("general.alignment").u32(8).str("32");
    has(&err(&r.0), &["general.alignment"]);
}

#[test]
fn every_truncation_of_a_synthetic_file_is_an_error_until_the_data_ends() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("m.gguf");
    let mut cfg = SyntheticModel::small(Arch::Llama, 2).cfg;
    (
        cfg.layers,
        cfg.hidden,
        cfg.heads,
        cfg.kv_heads,
        cfg.ffn,
        cfg.vocab,
    ) = (1, 64, 2, 1, 64, 50);
    let model = SyntheticModel::new(cfg, 2);
    model.write_gguf(&path, GgufTypes::F32).unwrap();
    let bytes = std::fs::read(&path).unwrap();
    let full = GgufHeader::parse(&bytes, "m.gguf").unwrap();
    let data_end = full
        .tensors
        .iter()
        .map(|t| full.data_range(t).end)
        .max()
        .unwrap();
    let step = |n: usize| {
        if n < full.data_offset as usize + 64 {
            1
        } else {
            509
        }
    };
    let mut n = 0;
    while n <= bytes.len() {
        let r = GgufHeader::parse(&bytes[..n], "cut.gguf");
        assert_eq!(r.is_ok(), n >= data_end, "prefix of {n} bytes");
        n += step(n);
    }
}

#[test]
fn header_metadata_keeps_candles_string_reading() {
    // Trailing NULs are dropped and invalid UTF-8 in values replaced, as candle does.
    let mut r = Raw::new(3, 0, 2);
    r.str("a").u32(8).u64(3).0.extend_from_slice(b"ab\0");
    r.str("b").u32(8).u64(2).0.extend_from_slice(&[0x61, 0xff]);
    let h = GgufHeader::parse(&r.0, "s.gguf").unwrap();
    let c = gguf_file::Content::read(&mut std::io::Cursor::new(&r.0)).unwrap();
    let strings = |m: &HashMap<String, Value>| {
        (
            m["a"].to_string().unwrap().clone(),
            m["b"].to_string().unwrap().clone(),
        )
    };
    assert_eq!(strings(&h.metadata), strings(&c.metadata));
    assert_eq!(strings(&h.metadata).0, "ab");
}
