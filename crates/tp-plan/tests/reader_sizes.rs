//! Random sizes and counts fed to the planner's model readers (issue 18, classes 4-5): GGUF
//! headers whose counts, lengths, dimensions and hyper-parameters are random, and config.json
//! files with random sizes. Every read errs with a typed error or succeeds, never panics,
//! within a second; the counts are printed.

use std::path::Path;
use std::time::{Duration, Instant};
use tp_plan::gguf::parse_gguf_header;
use tp_plan::hf_config::parse_hf_config;
use tp_testkit::Rng;

/// Sizes as files hold them, drawn from tp-testkit's seeded stream (a failure reproduces).
trait Sizes {
    fn size(&mut self) -> u64;
}

impl Sizes for Rng {
    /// A size as files hold them: small, a real model's, powers of two at the edges, any.
    fn size(&mut self) -> u64 {
        const EDGES: [u64; 12] = [
            0,
            1,
            2,
            9,
            576,
            49152,
            (1 << 24) + 1,
            (1 << 31) - 1,
            1 << 32,
            1_000_000_000_000,
            u64::MAX / 2,
            u64::MAX,
        ];
        match self.below(3) {
            0 => EDGES[self.below(EDGES.len() as u64) as usize],
            1 => self.below(64),
            _ => self.next_u64(),
        }
    }
}

fn string(out: &mut Vec<u8>, s: &str) {
    out.extend((s.len() as u64).to_le_bytes());
    out.extend(s.as_bytes());
}

/// A llama GGUF header with random hyper-parameters, counts and lengths.
fn header(rng: &mut Rng) -> Vec<u8> {
    let keys = [
        "block_count",
        "embedding_length",
        "feed_forward_length",
        "attention.head_count",
        "attention.head_count_kv",
        "attention.key_length",
        "vocab_size",
        "expert_count",
        "expert_used_count",
    ];
    let n_tensors = rng.below(3);
    let mut out = b"GGUF".to_vec();
    out.extend(3u32.to_le_bytes());
    let declared_tensors = if rng.below(4) == 0 {
        rng.size()
    } else {
        n_tensors
    };
    out.extend(declared_tensors.to_le_bytes());
    let declared_kvs = if rng.below(4) == 0 {
        rng.size()
    } else {
        keys.len() as u64 + 2
    };
    out.extend(declared_kvs.to_le_bytes());
    string(&mut out, "general.architecture");
    out.extend(8u32.to_le_bytes());
    string(&mut out, "llama");
    let real = [30u64, 576, 1536, 9, 3, 64, 49152, 1, 1];
    for (k, r) in keys.iter().zip(real) {
        string(&mut out, &format!("llama.{k}"));
        out.extend(10u32.to_le_bytes());
        let v = if rng.below(4) == 0 { rng.size() } else { r };
        out.extend(v.to_le_bytes());
    }
    // An array whose declared length may exceed what follows.
    string(&mut out, "tokenizer.ggml.tokens");
    out.extend(9u32.to_le_bytes());
    out.extend(8u32.to_le_bytes());
    let n = rng.below(4);
    out.extend(if rng.below(3) == 0 { rng.size() } else { n }.to_le_bytes());
    for _ in 0..n {
        if rng.below(5) == 0 {
            out.extend(rng.size().to_le_bytes()); // a string length past the end
        } else {
            string(&mut out, "tok");
        }
    }
    for t in 0..n_tensors {
        string(&mut out, &format!("blk.{t}.w"));
        let dims = if rng.below(4) == 0 {
            rng.size() as u32
        } else {
            2
        };
        out.extend(dims.to_le_bytes());
        for _ in 0..dims.min(8) {
            out.extend(rng.size().to_le_bytes());
        }
        out.extend(0u32.to_le_bytes());
        out.extend(rng.size().to_le_bytes());
    }
    if rng.below(4) == 0 {
        let keep = rng.below(out.len() as u64) as usize;
        out.truncate(keep);
    }
    out
}

fn config_json(rng: &mut Rng) -> String {
    let mut v = serde_json::json!({
        "architectures": ["LlamaForCausalLM"], "hidden_act": "silu",
        "hidden_size": 576, "intermediate_size": 1536, "num_attention_heads": 9,
        "num_hidden_layers": 30, "num_key_value_heads": 3, "vocab_size": 49152,
    });
    let keys = [
        "hidden_size",
        "intermediate_size",
        "num_attention_heads",
        "num_hidden_layers",
        "num_key_value_heads",
        "vocab_size",
        "head_dim",
        "num_local_experts",
        "num_experts_per_tok",
    ];
    for _ in 0..1 + rng.below(3) {
        let k = keys[rng.below(keys.len() as u64) as usize];
        v[k] = match rng.below(6) {
            0 => serde_json::json!(-1),
            1 => serde_json::json!(1e300),
            2 => serde_json::Value::Null,
            _ => serde_json::json!(rng.size()),
        };
    }
    if rng.below(4) == 0 {
        v.as_object_mut().unwrap().remove("intermediate_size");
    }
    v.to_string()
}

fn timed<T>(what: &str, f: impl FnOnce() -> T) -> T {
    let start = Instant::now();
    let r = f();
    let took = start.elapsed();
    assert!(took < Duration::from_secs(1), "{what} took {took:?}");
    r
}

#[test]
fn random_sizes_in_gguf_headers_and_config_json_error_or_parse_within_a_second() {
    let cases: usize = tp_testkit::fuzz_cases(2000);
    let mut rng = Rng::new(0x2545_f491_4f6c_dd1d);
    let (mut ok, mut err) = ([0usize; 2], [0usize; 2]);
    for case in 0..cases {
        let h = header(&mut rng);
        let r = timed(&format!("GGUF case {case}"), || {
            std::panic::catch_unwind(|| parse_gguf_header(&h, Path::new("random.gguf")))
        });
        match r.unwrap_or_else(|_| panic!("GGUF case {case} panicked")) {
            Ok(m) => {
                assert!(m.num_layers > 0 && m.hidden_size > 0, "case {case}: {m:?}");
                ok[0] += 1;
            }
            Err(e) => {
                assert!(!e.to_string().is_empty());
                err[0] += 1;
            }
        }
        let j = config_json(&mut rng);
        let r = timed(&format!("config.json case {case}"), || {
            std::panic::catch_unwind(|| parse_hf_config(&j, Path::new("config.json")))
        });
        match r.unwrap_or_else(|_| panic!("config.json case {case} panicked: {j}")) {
            Ok(_) => ok[1] += 1,
            Err(e) => {
                assert!(!e.to_string().is_empty());
                err[1] += 1;
            }
        }
    }
    eprintln!(
        "tp-plan readers: {cases} GGUF headers ({} parsed, {} typed errors), {cases} config.json ({} parsed, {} typed errors); 0 panics, 0 over 1 s",
        ok[0], err[0], ok[1], err[1]
    );
    assert!(
        ok[0] > 0 && err[0] > 0 && ok[1] > 0 && err[1] > 0,
        "{ok:?} {err:?}"
    );
}
