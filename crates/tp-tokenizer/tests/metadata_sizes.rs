//! Random sizes and counts in tokenizer GGUF metadata (issue 18, classes 4-5): vocabularies,
//! token types, scores and merges of random lengths that disagree with each other, token ids
//! anywhere in u64, for both GGUF tokenizer models. Every load errs with a typed error or
//! succeeds, never panics, within a second; the counts are printed.

use std::collections::HashMap;
use std::time::{Duration, Instant};
use tp_testkit::Rng;

use candle_core::quantized::gguf_file::Value;
use tp_tokenizer::Tokenizer;

/// Counts and token ids, drawn from tp-testkit's seeded stream (a failure reproduces).
trait Draws {
    fn count(&mut self, near: usize) -> usize;
    fn id(&mut self, n: usize) -> Value;
}

impl Draws for Rng {
    /// A count: small, around a real vocabulary's, or one off another count.
    fn count(&mut self, near: usize) -> usize {
        match self.below(5) {
            0 => 0,
            1 => self.below(8) as usize,
            2 => near,
            3 => near.saturating_sub(1),
            _ => near + 1,
        }
    }
    /// A token id: in range, just past it, or anywhere in u64 / i64.
    fn id(&mut self, n: usize) -> Value {
        match self.below(5) {
            0 => Value::U32(self.below(n as u64 + 1) as u32),
            1 => Value::U64(u64::MAX),
            2 => Value::I32(-1),
            3 => Value::I64(i64::MIN),
            _ => Value::U64(self.next_u64()),
        }
    }
}

fn metadata(rng: &mut Rng) -> HashMap<String, Value> {
    let s = |x: &str| Value::String(x.to_string());
    let n = [1usize, 3, 260, 700][rng.below(4) as usize];
    let mut m = HashMap::new();
    let model = ["gpt2", "llama"][rng.below(2) as usize];
    m.insert("tokenizer.ggml.model".into(), s(model));
    m.insert("tokenizer.ggml.pre".into(), s("gpt-2"));
    let tokens: Vec<Value> = (0..rng.count(n))
        .map(|i| match i {
            0..=255 => s(&format!("<0x{i:02X}>")),
            _ => s(&format!("t{i}")),
        })
        .collect();
    let len = tokens.len();
    m.insert("tokenizer.ggml.tokens".into(), Value::Array(tokens));
    let types = (0..rng.count(len))
        .map(|_| Value::I32(rng.below(8) as i32 - 1))
        .collect();
    m.insert("tokenizer.ggml.token_type".into(), Value::Array(types));
    let scores = (0..rng.count(len))
        .map(|i| Value::F32(-(i as f32)))
        .collect();
    m.insert("tokenizer.ggml.scores".into(), Value::Array(scores));
    let merges = (0..rng.count(len))
        .map(|i| s(&format!("t{} t{}", i, rng.below(2 * len as u64 + 2))))
        .collect();
    m.insert("tokenizer.ggml.merges".into(), Value::Array(merges));
    for key in ["bos", "eos", "eot", "unknown", "padding"] {
        if rng.below(2) == 0 {
            m.insert(format!("tokenizer.ggml.{key}_token_id"), rng.id(len));
        }
    }
    m
}

#[test]
fn random_tokenizer_counts_error_or_load_within_a_second() {
    let cases: usize = tp_testkit::fuzz_cases(300);
    let mut rng = Rng::new(0x9e37_79b9_7f4a_7c15);
    let (mut loaded, mut refused) = (0, 0);
    for case in 0..cases {
        let m = metadata(&mut rng);
        let start = Instant::now();
        let r = std::panic::catch_unwind(|| Tokenizer::from_gguf(&m).map(|t| t.vocab_size()));
        let took = start.elapsed();
        assert!(took < Duration::from_secs(1), "case {case} took {took:?}");
        match r {
            Err(_) => panic!("case {case} panicked"),
            Ok(Ok(vocab)) => {
                assert!(vocab > 0, "case {case}: an empty vocabulary loaded");
                loaded += 1;
            }
            Ok(Err(e)) => {
                assert!(!e.to_string().is_empty());
                refused += 1;
            }
        }
    }
    eprintln!(
        "tokenizer metadata sizes: {cases} inputs, {loaded} loaded, {refused} typed errors, 0 panics, 0 over 1 s"
    );
    assert!(refused > 0 && loaded + refused == cases);
}
