//! Shared test helpers: the sharded model's logits and their comparison with an oracle; the
//! real models (CI installs SmolLM2; tests skip without it) come from tp-testkit.

#![allow(dead_code)]

#[allow(unused_imports)] // each test binary uses a subset
pub use tp_testkit::{gemma3, minilm, qwen25, smollm2};

/// One rank's model with its KV pool, group and profile, stepping sequences one at a time.
pub struct Stepper<'a> {
    pub model: &'a tp_models::ShardedModel,
    pub pool: tp_models::KvPool,
    pub g: &'a tp_comm::Group,
    pub prof: tp_models::Profile,
}

impl<'a> Stepper<'a> {
    pub fn new(model: &'a tp_models::ShardedModel, g: &'a tp_comm::Group) -> Self {
        Stepper {
            pool: model.new_pool(),
            model,
            g,
            prof: tp_models::Profile::default(),
        }
    }

    /// This rank's logits for `tokens` appended to `table`: the last position's, or every
    /// new position's with `all_logits`.
    pub fn local(
        &mut self,
        table: &mut tp_models::BlockTable,
        tokens: &[u32],
        all_logits: bool,
    ) -> Vec<f32> {
        self.model
            .forward(
                &mut [tp_models::Chunk {
                    tokens,
                    table,
                    all_logits,
                }],
                &mut self.pool,
                self.g,
                &mut self.prof,
            )
            .unwrap()
    }

    /// As [`Stepper::local`], gathered over the group: whole-vocabulary rows.
    pub fn logits(
        &mut self,
        table: &mut tp_models::BlockTable,
        tokens: &[u32],
        all_logits: bool,
    ) -> Vec<f32> {
        let local = self.local(table, tokens, all_logits);
        let rows = if all_logits { tokens.len() } else { 1 };
        self.model
            .gather_logits(local, rows, self.g, &mut self.prof)
            .unwrap()
    }
}

/// Logits of the sharded model at `tp` (local backend): the last row of the whole prompt in
/// one pass, then the last row after each token fed one by one through a fresh cache
/// (`1 + tokens.len()` rows of `vocab`).
pub fn sharded_logits(
    ckpt: &dyn tp_models::Checkpoint,
    tokens: &[u32],
    tp: usize,
    opts: tp_models::LoadOptions,
) -> Vec<Vec<f32>> {
    use tp_comm::local::{self, LocalOptions};
    let results = local::run(tp, LocalOptions::default(), |g| {
        let model = tp_models::ShardedModel::load(ckpt, g.rank(), tp, opts, 64).unwrap();
        let mut whole = Stepper::new(&model, &g);
        let mut out = vec![whole.logits(&mut model.new_table(64), tokens, false)];
        let mut one_by_one = Stepper::new(&model, &g);
        let mut cache = model.new_table(64);
        for t in tokens {
            out.push(one_by_one.logits(&mut cache, std::slice::from_ref(t), false));
        }
        out
    })
    .unwrap();
    results.into_iter().next().unwrap().unwrap()
}

pub fn spread(v: &[f32]) -> f32 {
    let max = v.iter().copied().fold(f32::MIN, f32::max);
    let min = v.iter().copied().fold(f32::MAX, f32::min);
    max - min
}

pub fn argmax(v: &[f32]) -> usize {
    v.iter()
        .enumerate()
        .max_by(|a, b| a.1.total_cmp(b.1))
        .map(|(i, _)| i)
        .unwrap()
}

/// Largest `max |got - want| / spread(want)` over the rows; asserts it stays within `rel_tol`
/// and, when `same_argmax`, that every row's greedy token agrees.
pub fn assert_close(
    what: &str,
    got: &[Vec<f32>],
    want: &[Vec<f32>],
    rel_tol: f32,
    same_argmax: bool,
) -> f32 {
    assert_eq!(got.len(), want.len(), "{what}: row count");
    let mut worst = 0f32;
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert_eq!(g.len(), w.len(), "{what}: row {i} length");
        assert!(
            g.iter().all(|x| x.is_finite()),
            "{what}: row {i} not finite"
        );
        let err = g
            .iter()
            .zip(w)
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        let rel = err / spread(w);
        worst = worst.max(rel);
        assert!(
            rel <= rel_tol,
            "{what}: row {i}: max |logit diff| {err} = {rel:.2e} of the spread > {rel_tol:.0e}"
        );
        if same_argmax {
            assert_eq!(
                argmax(g),
                argmax(w),
                "{what}: row {i}: greedy token differs"
            );
        }
    }
    eprintln!("{what}: worst max|diff|/spread = {worst:.2e}");
    worst
}

/// Token ids `0..vocab` picked by a fixed rule (no tokenizer involved).
pub fn prompt(vocab: usize, len: usize) -> Vec<u32> {
    (0..len).map(|i| ((i * 7919 + 13) % vocab) as u32).collect()
}

/// candle-transformers' GGUF models: the oracle of the synthetic-model tests (with
/// `CANDLE_DEQUANTIZE_ALL=1` in the environment, candle dequantizes every weight).
pub enum GgufOracle {
    Llama(candle_transformers::models::quantized_llama::ModelWeights),
    Qwen2(candle_transformers::models::quantized_qwen2::ModelWeights),
    Qwen3(candle_transformers::models::quantized_qwen3::ModelWeights),
}

impl GgufOracle {
    pub fn load(path: &std::path::Path, arch: tp_models::Arch) -> Self {
        use candle_transformers::models::{quantized_llama, quantized_qwen2, quantized_qwen3};
        let mut file = std::fs::File::open(path).unwrap();
        let c = candle_core::quantized::gguf_file::Content::read(&mut file).unwrap();
        let dev = &candle_core::Device::Cpu;
        match arch {
            tp_models::Arch::Llama => GgufOracle::Llama(
                quantized_llama::ModelWeights::from_gguf(c, &mut file, dev).unwrap(),
            ),
            tp_models::Arch::Qwen2 => GgufOracle::Qwen2(
                quantized_qwen2::ModelWeights::from_gguf(c, &mut file, dev).unwrap(),
            ),
            tp_models::Arch::Qwen3 => GgufOracle::Qwen3(
                quantized_qwen3::ModelWeights::from_gguf(c, &mut file, dev).unwrap(),
            ),
            // candle's quantized_gemma3 computes SiLU where Gemma computes GELU.
            tp_models::Arch::Gemma3 => {
                panic!("no GGUF oracle for gemma3; gemma3_oracle.rs uses candle's plain model")
            }
            tp_models::Arch::Olmoe => {
                panic!("no GGUF oracle for olmoe; moe.rs has a reference of its own")
            }
        }
    }

    /// Logits of the last of `tokens`, fed at position `pos`.
    pub fn forward(&mut self, tokens: &[u32], pos: usize) -> Vec<f32> {
        let x = candle_core::Tensor::new(tokens, &candle_core::Device::Cpu)
            .unwrap()
            .unsqueeze(0)
            .unwrap();
        let y = match self {
            GgufOracle::Llama(m) => m.forward(&x, pos),
            GgufOracle::Qwen2(m) => m.forward(&x, pos),
            GgufOracle::Qwen3(m) => m.forward(&x, pos),
        };
        y.unwrap().flatten_all().unwrap().to_vec1().unwrap()
    }

    /// The oracle's rows in the order of [`sharded_logits`]: whole prompt, then each prefix
    /// fed token by token through a fresh model.
    pub fn logits(path: &std::path::Path, arch: tp_models::Arch, tokens: &[u32]) -> Vec<Vec<f32>> {
        let mut out = vec![GgufOracle::load(path, arch).forward(tokens, 0)];
        let mut m = GgufOracle::load(path, arch);
        for (i, t) in tokens.iter().enumerate() {
            out.push(m.forward(std::slice::from_ref(t), i));
        }
        out
    }
}
