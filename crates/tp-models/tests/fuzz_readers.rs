//! Fuzzing the readers (docs/reliability.md R4): random bit flips, truncations and overwrites of
//! length, type, dimension and offset fields of GGUF files (a small synthetic model, and the
//! real SmolLM2 header over a sparse file of the real size), and of safetensors files,
//! config.json and shard indexes of synthetic HF directories.
//!
//! Property: opening never panics; it fails with a typed error, or yields a checkpoint whose
//! every `meta`/`rows`/`cols`/`vector` call fails or returns exactly the data asked for, and
//! whose sharded load fails or succeeds without panicking. Case counts are bounded so the
//! whole file runs in seconds; raise `FUZZ_CASES` (an environment variable) for a longer run.

mod common;

use proptest::prelude::*;
use proptest::test_runner::{Config, TestCaseError, TestRunner};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use tp_models::checkpoint::{expected_weights, Expected};
use tp_models::synthetic::{GgufTypes, HfDType, SyntheticModel};
use tp_models::{
    open_checkpoint, Arch, Checkpoint, LoadOptions, ModelConfig, ShardedModel, WeightName,
    WeightSlice,
};

use tp_testkit::fuzz_cases as cases;

/// A small model: fast to write, open and load once per case.
fn tiny(arch: Arch, seed: u64) -> SyntheticModel {
    let mut cfg: ModelConfig = SyntheticModel::small(arch, seed).cfg;
    (
        cfg.layers,
        cfg.hidden,
        cfg.heads,
        cfg.kv_heads,
        cfg.head_dim,
    ) = (2, 64, 4, 2, 16);
    (cfg.ffn, cfg.vocab, cfg.context) = (96, 100, 32);
    SyntheticModel::new(cfg, seed)
}

/// Where the length, count, type, dimension and offset fields of a valid GGUF file are
/// (byte position, field width), found by walking its header.
fn gguf_fields(b: &[u8]) -> Vec<(usize, usize)> {
    let u32_at = |p: usize| u32::from_le_bytes(b[p..p + 4].try_into().unwrap());
    let u64_at = |p: usize| u64::from_le_bytes(b[p..p + 8].try_into().unwrap()) as usize;
    let mut f = vec![(4, 4), (8, 8), (16, 8)];
    let (tensors, kvs) = (u64_at(8), u64_at(16));
    let mut p = 24;
    fn value(b: &[u8], p: &mut usize, t: u32, f: &mut Vec<(usize, usize)>) {
        let u32_at = |p: usize| u32::from_le_bytes(b[p..p + 4].try_into().unwrap());
        let u64_at = |p: usize| u64::from_le_bytes(b[p..p + 8].try_into().unwrap()) as usize;
        match t {
            0 | 1 | 7 => *p += 1,
            2 | 3 => *p += 2,
            4..=6 => *p += 4,
            10..=12 => *p += 8,
            8 => {
                f.push((*p, 8));
                *p += 8 + u64_at(*p);
            }
            9 => {
                f.push((*p, 4));
                f.push((*p + 4, 8));
                let (et, n) = (u32_at(*p), u64_at(*p + 4));
                *p += 12;
                for _ in 0..n {
                    value(b, p, et, f);
                }
            }
            _ => unreachable!("valid file"),
        }
    }
    for _ in 0..kvs {
        value(b, &mut p, 8, &mut f); // key
        f.push((p, 4));
        let t = u32_at(p);
        p += 4;
        value(b, &mut p, t, &mut f);
    }
    for _ in 0..tensors {
        value(b, &mut p, 8, &mut f); // name
        f.push((p, 4));
        let n = u32_at(p) as usize;
        p += 4;
        for _ in 0..n {
            f.push((p, 8));
            p += 8;
        }
        f.push((p, 4)); // type
        f.push((p + 4, 8)); // offset
        p += 12;
    }
    f
}

#[derive(Clone, Debug)]
enum Mutation {
    /// Flip bit `bit` of the byte at `pos` (a fraction of the region mutated).
    Flip { pos: f64, bit: u8 },
    /// Keep only the first `keep` (fraction) of the file.
    Truncate { keep: f64 },
    /// Overwrite the `field`-th known field (fraction of the list) with `value`.
    Field { field: f64, value: u64 },
    /// Overwrite 8 bytes at `pos` with `value`.
    Word { pos: f64, value: u64 },
}

fn interesting() -> impl Strategy<Value = u64> {
    prop_oneof![
        Just(0u64),
        Just(1),
        Just(2),
        Just(4),
        Just(9),
        Just(16),
        Just(31),
        Just(255),
        Just(u32::MAX as u64),
        Just(1 << 32),
        Just(1 << 40),
        Just(u64::MAX / 2),
        Just(u64::MAX),
        any::<u64>(),
        (0u64..4096),
    ]
}

fn mutation() -> impl Strategy<Value = Mutation> {
    prop_oneof![
        5 => (0.0..1.0f64, 0u8..8).prop_map(|(pos, bit)| Mutation::Flip { pos, bit }),
        1 => (0.0..1.0f64).prop_map(|keep| Mutation::Truncate { keep }),
        3 => (0.0..1.0f64, interesting()).prop_map(|(field, value)| Mutation::Field { field, value }),
        1 => (0.0..1.0f64, interesting()).prop_map(|(pos, value)| Mutation::Word { pos, value }),
    ]
}

/// Applies mutations to `bytes`; flips and words land in the first `focus` bytes (the
/// header) three times out of four.
fn mutate(bytes: &mut Vec<u8>, muts: &[Mutation], fields: &[(usize, usize)], focus: usize) {
    for (i, m) in muts.iter().enumerate() {
        if bytes.is_empty() {
            return;
        }
        let region = if i % 4 == 3 {
            bytes.len()
        } else {
            focus.min(bytes.len())
        };
        let at = |frac: f64, len: usize| ((frac * len as f64) as usize).min(len.saturating_sub(1));
        match *m {
            Mutation::Flip { pos, bit } => {
                let p = at(pos, region);
                bytes[p] ^= 1 << bit;
            }
            Mutation::Truncate { keep } => bytes.truncate((keep * bytes.len() as f64) as usize),
            Mutation::Field { field, value } => {
                if fields.is_empty() {
                    continue;
                }
                let (p, w) = fields[at(field, fields.len())];
                if p + w <= bytes.len() {
                    bytes[p..p + w].copy_from_slice(&value.to_le_bytes()[..w]);
                }
            }
            Mutation::Word { pos, value } => {
                let p = at(pos, region);
                let end = (p + 8).min(bytes.len());
                bytes[p..end].copy_from_slice(&value.to_le_bytes()[..end - p]);
            }
        }
    }
}

fn check(ok: bool, what: impl FnOnce() -> String) -> Result<(), TestCaseError> {
    if ok {
        Ok(())
    } else {
        Err(TestCaseError::fail(what()))
    }
}

/// A slice holds exactly `rows x cols` elements.
fn slice_ok(s: &WeightSlice, rows: usize, cols: usize) -> bool {
    s.rows() == rows
        && s.cols() == cols
        && match s {
            WeightSlice::Dense { values, .. } => values.len() == rows * cols,
            WeightSlice::Quant { dtype, bytes, .. } => {
                bytes.len() == rows * cols / dtype.block_size() * dtype.type_size()
            }
            WeightSlice::QuantSub {
                dtype, lead, bytes, ..
            } => {
                let nb = (lead + cols).div_ceil(dtype.block_size());
                *lead < dtype.block_size() && bytes.len() == rows * nb * dtype.type_size()
            }
        }
}

/// Every accessor of an opened checkpoint errs or returns in-bounds data of the asked size;
/// then the sharded load at tp 2 errs or succeeds. `big` skips whole-tensor dequantization
/// of large tensors (the real-size file) to keep the case fast.
fn exercise(ckpt: &dyn Checkpoint, big: bool) -> Result<(), TestCaseError> {
    let cfg = ckpt.config().clone();
    let mut names: Vec<WeightName> = expected_weights(&cfg).map(|(n, _)| n).collect();
    names.push(WeightName::Output);
    for name in names {
        let Ok(meta) = ckpt.meta(name) else { continue };
        let (rows, cols) = (meta.rows, meta.cols);
        let block = meta.storage.block();
        let small = rows * cols <= 1 << 16 || !big;
        if let Ok(s) = ckpt.rows(name, 0..rows.min(2)) {
            check(slice_ok(&s, rows.min(2), cols), || format!("{name:?} rows"))?;
        }
        if let Ok(s) = ckpt.rows(name, rows - 1..rows) {
            check(slice_ok(&s, 1, cols), || format!("{name:?} last row"))?;
        }
        check(ckpt.rows(name, rows..rows + 1).is_err(), || {
            format!("{name:?} rows past the end")
        })?;
        #[allow(clippy::reversed_empty_ranges)]
        let backwards = 2..1;
        check(ckpt.rows(name, backwards).is_err(), || {
            format!("{name:?} backwards rows")
        })?;
        if cols >= block && small {
            if let Ok(s) = ckpt.cols(name, 0..block) {
                check(slice_ok(&s, rows, block), || {
                    format!("{name:?} aligned cols")
                })?;
            }
        }
        if cols > 1 && small {
            if let Ok(s) = ckpt.cols(name, 1..cols) {
                check(slice_ok(&s, rows, cols - 1), || {
                    format!("{name:?} unaligned cols")
                })?;
            }
        }
        check(ckpt.cols(name, 0..cols + 1).is_err(), || {
            format!("{name:?} cols past the end")
        })?;
        if cols == 1 || rows == 1 {
            let len = rows * cols;
            if let Ok(v) = ckpt.vector(name, None) {
                check(v.len() == len, || format!("{name:?} vector"))?;
            }
            if let Ok(v) = ckpt.vector(name, Some(len / 2..len)) {
                check(v.len() == len - len / 2, || {
                    format!("{name:?} vector range")
                })?;
            }
            check(ckpt.vector(name, Some(0..len + 1)).is_err(), || {
                format!("{name:?} vector past the end")
            })?;
        }
    }
    if !big {
        let opts = LoadOptions::default();
        for (rank, tp) in [(0, 1), (1, 2)] {
            let _ = ShardedModel::load(ckpt, rank, tp, opts, 8);
        }
    }
    Ok(())
}

static FILE_ID: AtomicUsize = AtomicUsize::new(0);

/// Writes `bytes` to a fresh file in `dir` (a fresh name: no map of an older case survives).
fn fresh(dir: &Path, ext: &str, bytes: &[u8], sparse_len: Option<u64>) -> PathBuf {
    let id = FILE_ID.fetch_add(1, Ordering::Relaxed);
    let p = dir.join(format!("case{id}.{ext}"));
    let f = std::fs::File::create(&p).unwrap();
    std::io::Write::write_all(&mut &f, bytes).unwrap();
    if let Some(len) = sparse_len {
        f.set_len(len.max(bytes.len() as u64)).unwrap();
    }
    p
}

/// `focus`: where the header ends (flips and overwrites land before it three times in four).
fn fuzz_gguf(base: Vec<u8>, focus: usize, sparse_len: Option<u64>, n_cases: u32) {
    let fields = gguf_fields(&base);
    let dir = tempfile::tempdir().unwrap();
    let big = sparse_len.is_some();
    let mut runner = TestRunner::new(Config {
        cases: n_cases,
        failure_persistence: None,
        ..Config::default()
    });
    let (opened, failed) = (AtomicUsize::new(0), AtomicUsize::new(0));
    runner
        .run(&proptest::collection::vec(mutation(), 1..3), |muts| {
            let mut bytes = base.clone();
            mutate(&mut bytes, &muts, &fields, focus);
            let path = fresh(dir.path(), "gguf", &bytes, sparse_len);
            match open_checkpoint(&path) {
                Ok(ckpt) => {
                    opened.fetch_add(1, Ordering::Relaxed);
                    exercise(ckpt.as_ref(), big)?;
                }
                Err(e) => {
                    failed.fetch_add(1, Ordering::Relaxed);
                    check(!e.to_string().is_empty(), || "empty error".into())?;
                }
            }
            std::fs::remove_file(&path).unwrap();
            Ok(())
        })
        .unwrap();
    eprintln!(
        "{n_cases} cases: {} opened, {} typed errors",
        opened.into_inner(),
        failed.into_inner()
    );
}

#[test]
fn fuzz_synthetic_gguf() {
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
                linear: Q8_0,
                embed: F16,
            },
        ),
    ] {
        let p = dir.path().join("base.gguf");
        tiny(arch, 7).write_gguf(&p, types).unwrap();
        let bytes = std::fs::read(&p).unwrap();
        let focus = tp_models::GgufHeader::parse(&bytes, "base")
            .unwrap()
            .data_offset;
        fuzz_gguf(bytes, focus as usize, None, cases(512));
    }
}

#[test]
fn fuzz_smollm2_header() {
    let Some(path) = common::smollm2() else {
        return;
    };
    let bytes = std::fs::read(&path).unwrap();
    let header = tp_models::GgufHeader::parse(&bytes, "smollm2").unwrap();
    // The header plus the first tensor's data; the rest of the file is sparse (zeros), so a
    // case costs a header parse, not a 98 MB write.
    let focus = header.data_offset as usize;
    fuzz_gguf(
        bytes[..focus + 4096].to_vec(),
        focus,
        Some(bytes.len() as u64),
        cases(48),
    );
}

#[test]
fn fuzz_synthetic_hf_dirs() {
    let dir = tempfile::tempdir().unwrap();
    for (shards, seed) in [(1, 8), (2, 9)] {
        let base = dir.path().join(format!("base{shards}"));
        tiny(Arch::Qwen2, seed)
            .write_hf(&base, shards, HfDType::BF16)
            .unwrap();
        let mut files: Vec<PathBuf> = std::fs::read_dir(&base)
            .unwrap()
            .map(|e| e.unwrap().path())
            .collect();
        files.sort();
        let originals: Vec<Vec<u8>> = files.iter().map(|f| std::fs::read(f).unwrap()).collect();
        let mut runner = TestRunner::new(Config {
            cases: cases(384),
            failure_persistence: None,
            ..Config::default()
        });
        let (opened, failed) = (AtomicUsize::new(0), AtomicUsize::new(0));
        let strategy = (
            0usize..files.len(),
            proptest::collection::vec(mutation(), 1..3),
        );
        runner
            .run(&strategy, |(which, muts)| {
                let case = dir
                    .path()
                    .join(format!("case{}", FILE_ID.fetch_add(1, Ordering::Relaxed)));
                std::fs::create_dir(&case).unwrap();
                for (i, (f, original)) in files.iter().zip(&originals).enumerate() {
                    let mut bytes = original.clone();
                    if i == which {
                        // safetensors: the 8-byte header length and the JSON header are the
                        // fields; JSON files are all header.
                        let json_len = if f.extension().is_some_and(|e| e == "safetensors") {
                            8 + u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize
                        } else {
                            bytes.len()
                        };
                        mutate(&mut bytes, &muts, &[(0, 8)], json_len);
                    }
                    std::fs::write(case.join(f.file_name().unwrap()), bytes).unwrap();
                }
                match open_checkpoint(&case) {
                    Ok(ckpt) => {
                        opened.fetch_add(1, Ordering::Relaxed);
                        exercise(ckpt.as_ref(), false)?;
                    }
                    Err(e) => {
                        failed.fetch_add(1, Ordering::Relaxed);
                        check(!e.to_string().is_empty(), || "empty error".into())?;
                    }
                }
                std::fs::remove_dir_all(&case).unwrap();
                Ok(())
            })
            .unwrap();
        eprintln!(
            "HF {shards} shard(s): {} opened, {} typed errors",
            opened.into_inner(),
            failed.into_inner()
        );
    }
}

#[test]
fn unmutated_bases_open_and_pass_the_accessor_checks() {
    // The property is not vacuous: the bases themselves open and every accessor answers.
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("m.gguf");
    tiny(Arch::Llama, 7)
        .write_gguf(
            &p,
            GgufTypes {
                linear: tp_models::checkpoint::GgmlDType::Q4_1,
                embed: tp_models::checkpoint::GgmlDType::Q8_0,
            },
        )
        .unwrap();
    let c = open_checkpoint(&p).unwrap();
    exercise(c.as_ref(), false).unwrap();
    for (name, want) in expected_weights(c.config()) {
        let m = c.meta(name).unwrap();
        match want {
            Expected::Matrix { rows, cols } => assert_eq!((m.rows, m.cols), (rows, cols)),
            Expected::Vector { len } => assert_eq!(m.rows * m.cols, len),
        }
    }
    let h = dir.path().join("hf");
    tiny(Arch::Qwen2, 8).write_hf(&h, 2, HfDType::BF16).unwrap();
    exercise(open_checkpoint(&h).unwrap().as_ref(), false).unwrap();
}

/// The size and count fields of the config, one or two at a time.
const GGUF_SIZE_KEYS: [&str; 9] = [
    "block_count",
    "embedding_length",
    "feed_forward_length",
    "attention.head_count",
    "attention.head_count_kv",
    "rope.dimension_count",
    "context_length",
    "vocab_size",
    "attention.key_length",
];
const HF_SIZE_KEYS: [&str; 8] = [
    "num_hidden_layers",
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "max_position_embeddings",
    "vocab_size",
];

/// Sizes and counts as large files and users give them: tiny, off by one, powers of two
/// around 2^31, 2^32 and 2^64, and arbitrary.
fn size() -> impl Strategy<Value = u64> {
    prop_oneof![
        interesting(),
        Just((1 << 31) - 1),
        Just(1 << 31),
        Just(1_000_000_000_000),
        Just(4_000_000_000),
        (0u64..64),
    ]
}

/// After an open: the memory plan, the context check and the model at `ctx` (built only for
/// short contexts; loading allocates nothing per position, the KV cache grows with tokens).
fn plan_and_load(ckpt: &dyn Checkpoint, ctx: usize) -> Result<(), TestCaseError> {
    let _ = tp_models::limits::check_context(ckpt.config(), ctx);
    for (rank, tp) in [(0, 1), (1, 2)] {
        if let Ok(plan) =
            <tp_models::ShardPlan as tp_models::CheckpointPlan>::for_checkpoint(ckpt, rank, tp)
        {
            let _ = tp_models::rank_memory(ckpt, &plan, ctx, 4, true, tp_models::KvDtype::F32);
        }
    }
    if ctx <= 1 << 12 {
        let _ = ShardedModel::load(ckpt, 0, 1, LoadOptions::default(), ctx);
    }
    Ok(())
}

/// Times one case: error or success, never a panic (proptest reports those), within a second.
fn timed(
    what: &str,
    f: impl FnOnce() -> Result<bool, TestCaseError>,
) -> Result<bool, TestCaseError> {
    let start = std::time::Instant::now();
    let r = f();
    let took = start.elapsed();
    check(took < std::time::Duration::from_secs(1), || {
        format!("{what} took {took:?}")
    })?;
    r
}

/// Random sizes and counts in GGUF metadata, config.json and the context length: every
/// loader errs or succeeds, never aborts, within a second (issue 18, classes 4 and 5).
#[test]
fn random_sizes_and_counts_error_or_load_within_a_second() {
    use candle_core::quantized::gguf_file::Value;
    let dir = tempfile::tempdir().unwrap();
    let model = tiny(Arch::Llama, 11);
    let tensors = model
        .gguf_tensors(GgufTypes {
            linear: tp_models::checkpoint::GgmlDType::Q8_0,
            embed: tp_models::checkpoint::GgmlDType::F32,
        })
        .unwrap();
    let mut runner = TestRunner::new(Config {
        cases: cases(256),
        failure_persistence: None,
        ..Config::default()
    });
    let (opened, failed) = (AtomicUsize::new(0), AtomicUsize::new(0));
    let edits = proptest::collection::vec((0..GGUF_SIZE_KEYS.len(), size()), 1..3);
    runner
        .run(&(edits, size()), |(edits, ctx)| {
            let mut md = model.gguf_metadata();
            for (k, v) in &edits {
                let key = format!("llama.{}", GGUF_SIZE_KEYS[*k]);
                md.retain(|(name, _)| *name != key);
                md.push((key, Value::U64(*v)));
            }
            let path = dir.path().join(format!(
                "sizes{}.gguf",
                FILE_ID.fetch_add(1, Ordering::Relaxed)
            ));
            tp_models::synthetic::write_gguf(&path, &md, &tensors).unwrap();
            let ok = timed(
                &format!("GGUF {edits:?}, ctx {ctx}"),
                || match open_checkpoint(&path) {
                    Ok(ckpt) => {
                        let ctx = usize::try_from(ctx).unwrap_or(usize::MAX);
                        plan_and_load(ckpt.as_ref(), ctx)?;
                        plan_and_load(ckpt.as_ref(), ckpt.config().context)?;
                        Ok(true)
                    }
                    Err(e) => {
                        check(!e.to_string().is_empty(), || "empty error".into())?;
                        Ok(false)
                    }
                },
            )?;
            let n = if ok { &opened } else { &failed };
            n.fetch_add(1, Ordering::Relaxed);
            std::fs::remove_file(&path).unwrap();
            Ok(())
        })
        .unwrap();
    eprintln!(
        "GGUF sizes: {} opened, {} typed errors",
        opened.load(Ordering::Relaxed),
        failed.load(Ordering::Relaxed)
    );

    let hf = dir.path().join("hf");
    tiny(Arch::Qwen2, 12)
        .write_hf(&hf, 1, HfDType::F32)
        .unwrap();
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(hf.join("config.json")).unwrap()).unwrap();
    let (opened, failed) = (AtomicUsize::new(0), AtomicUsize::new(0));
    let mut runner = TestRunner::new(Config {
        cases: cases(256),
        failure_persistence: None,
        ..Config::default()
    });
    let edits = proptest::collection::vec((0..HF_SIZE_KEYS.len(), size()), 1..3);
    runner
        .run(&(edits, size()), |(edits, ctx)| {
            let mut cfg = config.clone();
            for (k, v) in &edits {
                cfg[HF_SIZE_KEYS[*k]] = (*v).into();
            }
            std::fs::write(hf.join("config.json"), cfg.to_string()).unwrap();
            let ok = timed(
                &format!("config.json {edits:?}, ctx {ctx}"),
                || match open_checkpoint(&hf) {
                    Ok(ckpt) => {
                        plan_and_load(ckpt.as_ref(), usize::try_from(ctx).unwrap_or(usize::MAX))?;
                        Ok(true)
                    }
                    Err(e) => {
                        check(!e.to_string().is_empty(), || "empty error".into())?;
                        Ok(false)
                    }
                },
            )?;
            let n = if ok { &opened } else { &failed };
            n.fetch_add(1, Ordering::Relaxed);
            Ok(())
        })
        .unwrap();
    eprintln!(
        "config.json sizes: {} opened, {} typed errors",
        opened.load(Ordering::Relaxed),
        failed.load(Ordering::Relaxed)
    );
}
