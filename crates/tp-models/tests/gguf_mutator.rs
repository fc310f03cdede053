//! GGUF mutator (issue 18, classes 4-6): every metadata value and every tensor-info field
//! (name, n_dims, dims, type, offset) of a valid file is edited one at a time, the result is
//! loaded as `tp` loads a model (`check_gguf`: header, config, tensor set, types, shapes; then
//! the context check `--ctx-size` defaults to), and every outcome is classified:
//!
//! - refused: a typed error (the expected outcome for any edit that changes what is computed);
//! - accepted, no effect: the loaded config and tensor table are those of the original;
//! - accepted, hyper-parameter value: only `rms_eps`, `rope_theta` or `context` differ, values
//!   a file may legitimately hold and no loader can tell from the original;
//! - accepted, not read: the key is one the model loader does not read (tokenizer, names);
//! - accepted, relabel: a tensor's type changed to one of the same bytes per element
//!   (F16/BF16, Q4_0/Q4_K, Q5_0/Q5_K), which no layout check can tell apart (listed);
//! - violation: accepted with a different structure (layers, shapes, heads, tensor table...);
//! - panic, or slow (over a second).
//!
//! The test fails on any violation, panic or slow load, and prints the counts.

mod common;

use std::collections::BTreeMap;
use std::time::{Duration, Instant};
use tp_models::checkpoint::GgmlDType;
use tp_models::gguf::check_gguf;
use tp_models::synthetic::{GgufTypes, SyntheticModel};
use tp_models::{limits, Arch, GgufHeader, ModelConfig, ModelError};

/// One metadata pair: key, value type and the value's raw bytes.
#[derive(Clone)]
struct Kv {
    key: String,
    ty: u32,
    raw: Vec<u8>,
}

/// One tensor info, as stored (dims innermost first).
#[derive(Clone)]
struct Ti {
    name: String,
    dims: Vec<u64>,
    ty: u32,
    offset: u64,
}

/// A GGUF file split into its editable parts; `data` is everything after the padding.
struct Parts {
    version: u32,
    kvs: Vec<Kv>,
    tis: Vec<Ti>,
    alignment: u64,
    header_len: usize,
    data_offset: usize,
}

fn u32_at(b: &[u8], p: usize) -> u32 {
    u32::from_le_bytes(b[p..p + 4].try_into().unwrap())
}
fn u64_at(b: &[u8], p: usize) -> u64 {
    u64::from_le_bytes(b[p..p + 8].try_into().unwrap())
}

/// Bytes of a value of type `t` at `p` (a valid file).
fn value_len(b: &[u8], p: usize, t: u32) -> usize {
    match t {
        0 | 1 | 7 => 1,
        2 | 3 => 2,
        4..=6 => 4,
        10..=12 => 8,
        8 => 8 + u64_at(b, p) as usize,
        9 => {
            let (et, n) = (u32_at(b, p), u64_at(b, p + 4));
            let mut q = p + 12;
            for _ in 0..n {
                q += value_len(b, q, et);
            }
            q - p
        }
        _ => unreachable!("valid file"),
    }
}

fn string_at(b: &[u8], p: &mut usize) -> String {
    let n = u64_at(b, *p) as usize;
    let s = String::from_utf8(b[*p + 8..*p + 8 + n].to_vec()).unwrap();
    *p += 8 + n;
    s
}

fn split(b: &[u8]) -> Parts {
    let header = GgufHeader::parse(b, "base").unwrap();
    let (nt, nk) = (u64_at(b, 8), u64_at(b, 16));
    let mut p = 24;
    let mut kvs = Vec::new();
    for _ in 0..nk {
        let key = string_at(b, &mut p);
        let ty = u32_at(b, p);
        p += 4;
        let n = value_len(b, p, ty);
        kvs.push(Kv {
            key,
            ty,
            raw: b[p..p + n].to_vec(),
        });
        p += n;
    }
    let mut tis = Vec::new();
    for _ in 0..nt {
        let name = string_at(b, &mut p);
        let nd = u32_at(b, p) as usize;
        p += 4;
        let dims = (0..nd).map(|i| u64_at(b, p + 8 * i)).collect();
        p += 8 * nd;
        tis.push(Ti {
            name,
            dims,
            ty: u32_at(b, p),
            offset: u64_at(b, p + 4),
        });
        p += 12;
    }
    assert_eq!(p as u64, header.header_bytes);
    Parts {
        version: u32_at(b, 4),
        kvs,
        tis,
        alignment: header.alignment,
        header_len: p,
        data_offset: header.data_offset as usize,
    }
}

fn put_string(out: &mut Vec<u8>, s: &str) {
    out.extend((s.len() as u64).to_le_bytes());
    out.extend(s.as_bytes());
}

/// The header with `kvs` and `tis` (padding not included).
fn header_bytes(p: &Parts, kvs: &[Kv], tis: &[Ti]) -> Vec<u8> {
    let mut out = b"GGUF".to_vec();
    out.extend(p.version.to_le_bytes());
    out.extend((tis.len() as u64).to_le_bytes());
    out.extend((kvs.len() as u64).to_le_bytes());
    for kv in kvs {
        put_string(&mut out, &kv.key);
        out.extend(kv.ty.to_le_bytes());
        out.extend(&kv.raw);
    }
    for t in tis {
        put_string(&mut out, &t.name);
        out.extend((t.dims.len() as u32).to_le_bytes());
        for d in &t.dims {
            out.extend(d.to_le_bytes());
        }
        out.extend(t.ty.to_le_bytes());
        out.extend(t.offset.to_le_bytes());
    }
    out
}

/// A numeric value's raw bytes as i128 (for arithmetic edits), `None` for other types.
fn as_int(ty: u32, raw: &[u8]) -> Option<i128> {
    Some(match ty {
        0 => raw[0] as i128,
        1 => raw[0] as i8 as i128,
        2 => u16::from_le_bytes([raw[0], raw[1]]) as i128,
        3 => i16::from_le_bytes([raw[0], raw[1]]) as i128,
        4 => u32::from_le_bytes(raw[..4].try_into().unwrap()) as i128,
        5 => i32::from_le_bytes(raw[..4].try_into().unwrap()) as i128,
        10 => u64::from_le_bytes(raw[..8].try_into().unwrap()) as i128,
        11 => i64::from_le_bytes(raw[..8].try_into().unwrap()) as i128,
        _ => return None,
    })
}

/// `v` as a value of integer type `ty` (wrapping, as a corrupted field would).
fn int_raw(ty: u32, v: i128) -> Vec<u8> {
    match ty {
        0 | 1 => vec![v as u8],
        2 | 3 => (v as u16).to_le_bytes().to_vec(),
        4 | 5 => (v as u32).to_le_bytes().to_vec(),
        _ => (v as u64).to_le_bytes().to_vec(),
    }
}

fn int_bounds(ty: u32) -> (i128, i128) {
    match ty {
        0 => (0, u8::MAX as i128),
        1 => (i8::MIN as i128, i8::MAX as i128),
        2 => (0, u16::MAX as i128),
        3 => (i16::MIN as i128, i16::MAX as i128),
        4 => (0, u32::MAX as i128),
        5 => (i32::MIN as i128, i32::MAX as i128),
        10 => (0, u64::MAX as i128),
        _ => (i64::MIN as i128, i64::MAX as i128),
    }
}

fn string_raw(s: &str) -> Vec<u8> {
    let mut out = Vec::new();
    put_string(&mut out, s);
    out
}

/// Every edit of one metadata value: `(description, new type, new raw bytes)`.
fn value_edits(kv: &Kv) -> Vec<(String, u32, Vec<u8>)> {
    let mut out: Vec<(String, u32, Vec<u8>)> = Vec::new();
    if let Some(v) = as_int(kv.ty, &kv.raw) {
        let (lo, hi) = int_bounds(kv.ty);
        for (what, x) in [
            ("0", 0),
            ("1", 1),
            ("-1", -1),
            ("max", hi),
            ("min", lo),
            ("value+1", v + 1),
            ("value-1", v - 1),
            ("value*2", v * 2),
            ("2^31-1", (1i128 << 31) - 1),
        ] {
            out.push((format!("= {what}"), kv.ty, int_raw(kv.ty, x)));
        }
        out.push(("as u64".into(), 10, int_raw(10, v)));
        out.push(("as i8".into(), 1, int_raw(1, v)));
        out.push(("as f32".into(), 6, (v as f32).to_le_bytes().to_vec()));
    }
    match kv.ty {
        6 => {
            let v = f32::from_le_bytes(kv.raw[..4].try_into().unwrap());
            for (what, x) in [
                ("0", 0.0f32),
                ("-1", -1.0),
                ("NaN", f32::NAN),
                ("inf", f32::INFINITY),
                ("value*2", v * 2.0),
                ("max", f32::MAX),
            ] {
                out.push((format!("= {what}"), 6, x.to_le_bytes().to_vec()));
            }
            out.push(("as f64".into(), 12, f64::from(v).to_le_bytes().to_vec()));
            out.push(("as u32".into(), 4, (v as u32).to_le_bytes().to_vec()));
        }
        7 => {
            out.push(("flipped".into(), 7, vec![kv.raw[0] ^ 1]));
            out.push(("= 2".into(), 7, vec![2]));
        }
        8 => {
            let s = String::from_utf8_lossy(&kv.raw[8..]).into_owned();
            out.push(("= \"\"".into(), 8, string_raw("")));
            out.push(("= \"x\"".into(), 8, string_raw("x")));
            out.push(("+ \"x\"".into(), 8, string_raw(&format!("{s}x"))));
            out.push(("= \"qwen2\"".into(), 8, string_raw("qwen2")));
        }
        9 => {
            let et = u32_at(&kv.raw, 0);
            let n = u64_at(&kv.raw, 4);
            let mut empty = et.to_le_bytes().to_vec();
            empty.extend(0u64.to_le_bytes());
            out.push(("= []".into(), 9, empty));
            if n > 1 {
                // The first element only.
                let first = value_len(&kv.raw, 12, et);
                let mut one = et.to_le_bytes().to_vec();
                one.extend(1u64.to_le_bytes());
                one.extend(&kv.raw[12..12 + first]);
                out.push(("= [first]".into(), 9, one));
            }
            let mut zeros = 4u32.to_le_bytes().to_vec();
            zeros.extend(n.to_le_bytes());
            zeros.extend(std::iter::repeat_n(0u8, 4 * n as usize));
            out.push(("= [0u32; len]".into(), 9, zeros));
        }
        _ => {}
    }
    out.push(("as string \"7\"".into(), 8, string_raw("7")));
    out.retain(|(_, t, r)| !(*t == kv.ty && *r == kv.raw));
    out
}

/// Every edit of one tensor info.
fn tensor_edits(t: &Ti, layers: usize) -> Vec<(String, Ti)> {
    let mut out = Vec::new();
    let mut edit = |what: String, f: &dyn Fn(&mut Ti)| {
        let mut e = t.clone();
        f(&mut e);
        out.push((what, e));
    };
    edit("name + \"x\"".into(), &|e| e.name.push('x'));
    if let Some(rest) = t.name.strip_prefix("blk.") {
        let tail = rest.split_once('.').map_or("", |(_, r)| r).to_string();
        edit(format!("name blk.{layers}.*"), &|e| {
            e.name = format!("blk.{layers}.{tail}")
        });
    }
    for n in [0usize, 3, 5] {
        edit(format!("n_dims {n}"), &|e| e.dims.resize(n, 1));
    }
    if t.dims.len() == 1 {
        edit("n_dims 2 (x1)".into(), &|e| e.dims.push(1));
    }
    if t.dims.len() == 2 {
        edit("n_dims 1 (flattened)".into(), &|e| {
            e.dims = vec![e.dims[0] * e.dims[1]]
        });
        edit("dims swapped".into(), &|e| e.dims.swap(0, 1));
    }
    for i in 0..t.dims.len() {
        let d = t.dims[i];
        for (what, x) in [
            ("0", 0),
            ("1", 1),
            ("value+1", d + 1),
            ("value-1", d - 1),
            ("value*2", d * 2),
            ("2^32", 1 << 32),
            ("max", u64::MAX),
        ] {
            edit(format!("dim {i} = {what}"), &|e| e.dims[i] = x);
        }
    }
    for ty in [0u32, 1, 2, 3, 8, 12, 14, 30, 9, 99] {
        if ty != t.ty {
            edit(format!("type {ty}"), &|e| e.ty = ty);
        }
    }
    for (what, x) in [
        ("0", 0),
        ("+1", t.offset + 1),
        ("+32", t.offset + 32),
        ("-32", t.offset.saturating_sub(32)),
        ("2^40", 1 << 40),
        ("max", u64::MAX),
    ] {
        if x != t.offset {
            edit(format!("offset {what}"), &|e| e.offset = x);
        }
    }
    // Drop edits that change nothing (dims swapped on a square matrix).
    out.retain(|(_, e)| {
        e.name != t.name || e.dims != t.dims || e.ty != t.ty || e.offset != t.offset
    });
    out
}

#[derive(Default)]
struct Tally {
    tried: usize,
    refused: usize,
    no_effect: usize,
    value_only: usize,
    not_read: usize,
    /// Accepted: one tensor's type relabelled to another of the same bytes per element
    /// (F16/BF16, Q4_0/Q4_K, Q5_0/Q5_K): the layout cannot tell them apart.
    relabels: Vec<String>,
    violations: Vec<String>,
    panics: Vec<String>,
    slow: Vec<String>,
    by_error: BTreeMap<&'static str, usize>,
}

/// What a loaded file computes with: the config, the tensor table and where the data starts.
type Loaded = (ModelConfig, Vec<(String, Vec<usize>, GgmlDType, u64)>, u64);

/// Loads as `tp` does: every open-time check, then the default context's memory check.
fn load(file: &[u8]) -> Result<Loaded, ModelError> {
    let (header, cfg) = check_gguf(file, "mutant.gguf")?;
    limits::check_context(&cfg, cfg.context)?;
    let table = header
        .tensors
        .iter()
        .map(|t| (t.name.clone(), t.shape.clone(), t.dtype, t.offset))
        .collect();
    Ok((cfg, table, header.data_offset))
}

/// Whether `table` differs from `base` only in one tensor's type, relabelled to a type of
/// the same storage size (the same bytes per element).
fn relabel(
    table: &[(String, Vec<usize>, GgmlDType, u64)],
    base: &[(String, Vec<usize>, GgmlDType, u64)],
) -> bool {
    let per_element = |t: GgmlDType| (t.type_size() * 256) / t.block_size();
    let diffs: Vec<_> = table.iter().zip(base).filter(|(a, b)| a != b).collect();
    table.len() == base.len()
        && diffs.len() == 1
        && diffs.iter().all(|(a, b)| {
            a.0 == b.0 && a.1 == b.1 && a.3 == b.3 && per_element(a.2) == per_element(b.2)
        })
}

fn kind(e: &ModelError) -> &'static str {
    match e {
        ModelError::Corrupt { .. } => "Corrupt",
        ModelError::Inconsistent { .. } => "Inconsistent",
        ModelError::TooLarge { .. } => "TooLarge",
        ModelError::TensorShape { .. } => "TensorShape",
        ModelError::MissingTensor { .. } => "MissingTensor",
        ModelError::MissingMetadata { .. } => "MissingMetadata",
        ModelError::UnsupportedDType { .. } => "UnsupportedDType",
        ModelError::UnsupportedArch { .. } => "UnsupportedArch",
        ModelError::Config(_) => "Config",
        _ => "other",
    }
}

impl Tally {
    /// Loads `file` and classifies the outcome against `base`.
    /// `data_at`: where the edited file's data really starts (what the parser must find).
    fn try_one(&mut self, what: &str, file: &[u8], base: &Loaded, data_at: u64, key_read: bool) {
        self.tried += 1;
        let start = Instant::now();
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| load(file)));
        if start.elapsed() > Duration::from_secs(1) {
            self.slow.push(format!("{what}: {:?}", start.elapsed()));
        }
        match r {
            Err(_) => self.panics.push(what.to_string()),
            Ok(Err(e)) => {
                assert!(!e.to_string().is_empty(), "{what}: empty error");
                self.refused += 1;
                *self.by_error.entry(kind(&e)).or_default() += 1;
            }
            Ok(Ok((cfg, table, data_offset))) => {
                let mut shape = cfg.clone();
                (shape.rms_eps, shape.rope_theta, shape.context) =
                    (base.0.rms_eps, base.0.rope_theta, base.0.context);
                if shape == base.0 && data_offset == data_at && relabel(&table, &base.1) {
                    self.relabels.push(what.to_string());
                } else if shape != base.0 || table != base.1 || data_offset != data_at {
                    self.violations.push(format!(
                        "{what}: accepted as {cfg:?} (was {:?}), tensor table {}, data read at {data_offset} (written at {data_at})",
                        base.0,
                        if table == base.1 { "same" } else { "changed" },
                    ));
                } else if !key_read {
                    self.not_read += 1;
                } else if cfg == base.0 {
                    self.no_effect += 1;
                } else {
                    self.value_only += 1;
                }
            }
        }
    }

    fn report(&self, name: &str) {
        eprintln!(
            "GGUF mutator, {name}: {} inputs tried, {} refused with typed errors {:?}, accepted: {} with no effect, {} changing only rms_eps/rope_theta/context, {} in keys the model loader does not read, {} type relabels of equal storage size {:?}; {} violations, {} panics, {} over 1 s",
            self.tried,
            self.refused,
            self.by_error,
            self.no_effect,
            self.value_only,
            self.not_read,
            self.relabels.len(),
            self.relabels,
            self.violations.len(),
            self.panics.len(),
            self.slow.len()
        );
        assert!(
            self.violations.is_empty(),
            "edits accepted with a changed model:\n{}",
            self.violations.join("\n")
        );
        assert!(self.panics.is_empty(), "panics: {:?}", self.panics);
        assert!(self.slow.is_empty(), "loads over 1 s: {:?}", self.slow);
    }
}

/// Keys the model loader reads: the architecture, the alignment and `<arch>.*`.
fn read_by_loader(key: &str) -> bool {
    key == "general.architecture"
        || key == "general.alignment"
        || key.starts_with("llama.")
        || key.starts_with("qwen2.")
}

/// Edits every metadata value and the tensor infos `tensor_filter` picks, one at a time.
/// Edits that keep the header's length are made in place in `file` (and undone), so a
/// large model is not copied per edit.
fn mutate_all(mut file: Vec<u8>, tensor_filter: &dyn Fn(&str) -> bool, name: &str) -> Tally {
    let parts = split(&file);
    let base = load(&file).expect("the unedited file loads");
    let layers = base.0.layers;
    let original_header = file[..parts.header_len].to_vec();
    let mut tally = Tally::default();
    let mut run = |what: String, header: Vec<u8>, file: &mut Vec<u8>, read: bool| {
        if header.len() == parts.header_len {
            file[..header.len()].copy_from_slice(&header);
            tally.try_one(&what, file, &base, parts.data_offset as u64, read);
            file[..header.len()].copy_from_slice(&original_header);
        } else {
            let start = header.len().next_multiple_of(parts.alignment as usize);
            let mut out = Vec::with_capacity(start + file.len() - parts.data_offset);
            out.extend(&header);
            out.resize(start, 0);
            out.extend(&file[parts.data_offset..]);
            tally.try_one(&what, &out, &base, start as u64, read);
        }
    };
    for (i, kv) in parts.kvs.iter().enumerate() {
        for (what, ty, raw) in value_edits(kv) {
            let mut kvs = parts.kvs.clone();
            kvs[i].ty = ty;
            kvs[i].raw = raw;
            let header = header_bytes(&parts, &kvs, &parts.tis);
            run(
                format!("{} {what}", kv.key),
                header,
                &mut file,
                read_by_loader(&kv.key),
            );
        }
        // The key removed, and renamed.
        let mut kvs = parts.kvs.clone();
        kvs.remove(i);
        run(
            format!("{} removed", kv.key),
            header_bytes(&parts, &kvs, &parts.tis),
            &mut file,
            read_by_loader(&kv.key),
        );
    }
    for (i, t) in parts.tis.iter().enumerate() {
        if !tensor_filter(&t.name) {
            continue;
        }
        for (what, edited) in tensor_edits(t, layers) {
            let mut tis = parts.tis.clone();
            tis[i] = edited;
            run(
                format!("tensor {} {what}", t.name),
                header_bytes(&parts, &parts.kvs, &tis),
                &mut file,
                true,
            );
        }
        let mut tis = parts.tis.clone();
        tis.remove(i);
        run(
            format!("tensor {} removed", t.name),
            header_bytes(&parts, &parts.kvs, &tis),
            &mut file,
            true,
        );
    }
    tally.report(name);
    tally
}

#[test]
fn every_single_edit_of_a_synthetic_gguf_is_refused_or_harmless() {
    use tp_models::checkpoint::GgmlDType::*;
    let dir = tempfile::tempdir().unwrap();
    let mut total = 0;
    for (arch, types) in [
        (
            Arch::Llama,
            GgufTypes {
                linear: Q4_0,
                embed: Q8_0,
            },
        ),
        (
            Arch::Qwen2,
            GgufTypes {
                linear: Q8_0,
                embed: F16,
            },
        ),
    ] {
        let p = dir.path().join("base.gguf");
        SyntheticModel::small(arch, 3)
            .write_gguf(&p, types)
            .unwrap();
        let t = mutate_all(std::fs::read(&p).unwrap(), &|_| true, arch.name());
        assert!(t.refused > 0 && t.tried > 300, "too few edits: {}", t.tried);
        total += t.tried;
    }
    eprintln!("GGUF mutator, synthetic total: {total} inputs");
}

#[test]
fn every_single_edit_of_smollm2_is_refused_or_harmless() {
    let Some(path) = common::smollm2() else {
        return;
    };
    let file = std::fs::read(&path).unwrap();
    // Every metadata key; the tensor infos of a norm, a quantized matrix, the embedding and
    // the last tensor (the synthetic test covers every tensor; each SmolLM2 load parses a
    // 1.7 MB header, so all 272 would take minutes).
    let pick = |n: &str| {
        matches!(
            n,
            "blk.0.attn_norm.weight"
                | "blk.0.ffn_down.weight"
                | "token_embd.weight"
                | "output_norm.weight"
        )
    };
    let t = mutate_all(file, &pick, "SmolLM2-135M Q4_1");
    assert!(t.refused > 0 && t.tried > 300, "too few edits: {}", t.tried);
}
