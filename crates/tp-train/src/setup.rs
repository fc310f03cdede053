//! A training run checked before any rank starts: the checkpoint to resume (and its step),
//! the tokenizer, the model (a preset of either trainable architecture, an HF config.json or
//! the checkpoint's), the data
//! encoded into a corpus, the layout and optimizer settings, all validated into a
//! [`TrainSpec`]. `tp train` calls [`prepare`] on the main thread.

use crate::config::{trainable_arch, TrainArch};
use crate::{
    AdamWConfig, Checkpoint, Corpus, ModelConfig, Pretrained, Result, Start, TextTokenizer,
    TrainError, TrainModel, TrainSpec,
};
use std::path::PathBuf;
use tp_comm::ParallelDims;

/// What a run asks for; `None` takes the checkpoint's value when resuming, else a default.
#[derive(Clone, Debug)]
pub struct RunRequest {
    pub dims: ParallelDims,
    /// A preset (tiny, small, bench) or an HF Llama, Qwen2, Qwen3 or Gemma-3 config.json; default tiny, or
    /// the checkpoint's model.
    pub config: Option<String>,
    /// A pretrained model to fine-tune (a GGUF file or an HF directory): its weights, config
    /// and (unless `tokenizer` is given) its tokenizer.
    pub init: Option<PathBuf>,
    /// The architecture (`llama`, `qwen3`) a preset is built as (default llama); with a
    /// config.json or a checkpoint it must be theirs.
    pub arch: Option<String>,
    /// Training text; default the built-in corpus.
    pub data: Option<PathBuf>,
    /// A tokenizer.json, a directory holding one, or a GGUF file; default bytes, vocab 256.
    pub tokenizer: Option<PathBuf>,
    /// Train until this many optimizer steps are done (a resumed run counts its earlier ones).
    pub steps: u64,
    /// Sequences per step over all replicas (default 8).
    pub batch: Option<usize>,
    /// Micro-batches per step on each replica (default [`default_micro_batches`]).
    pub micro_batches: Option<usize>,
    /// Model chunks per pipeline rank: the interleaved 1F1B schedule's V (1: plain 1F1B).
    pub virtual_stages: usize,
    /// Tokens per sequence (default 128).
    pub seq: Option<usize>,
    pub lr: f64,
    /// Final learning rate of the cosine decay (default lr / 10).
    pub min_lr: Option<f64>,
    pub warmup: u64,
    pub weight_decay: f64,
    pub clip: f64,
    /// Default 0.
    pub seed: Option<u64>,
    pub save: Option<PathBuf>,
    pub save_every: u64,
    pub keep: usize,
    /// A checkpoint to continue from (a save directory or one of its step directories).
    pub resume: Option<PathBuf>,
    /// Data-parallel all-reduce bucket size, MiB.
    pub bucket_mib: f64,
    /// Weight of the MoE load-balancing loss (unused without experts).
    pub moe_aux_coef: f64,
    /// Expert-parallel size ([`crate::TrainSpec::ep`]).
    pub ep: usize,
    /// The MoE layers' capacity factor ([`TrainSpec::moe_capacity`]); refused for a dense
    /// model.
    pub moe_capacity: Option<tp_spec::CapacityFactor>,
    /// The aux-loss-free router bias's update rate ([`TrainSpec::moe_bias_rate`]).
    pub moe_bias_rate: Option<f64>,
    /// Shard the optimizer state over the data-parallel replicas (ZeRO-1).
    pub distributed_optimizer: bool,
    /// Sequence parallelism: the norms and residual adds hold `seq/tp` positions per tp rank.
    pub sequence_parallel: bool,
    /// Activation recomputation ([`TrainSpec::recompute`]).
    pub recompute: crate::Recompute,
    /// Pack several documents (chat conversations) into each sequence ([`Corpus::packed`]);
    /// a packed run resumes packed either way.
    pub pack: bool,
    /// Hold out one sequence in this many (seeded) as a validation split (0: none).
    pub held_out: u64,
    /// Validation loss every this many steps (and after the last) when data is held out.
    pub val_every: u64,
}

/// A validated run: everything the ranks need.
pub struct Prepared {
    pub spec: TrainSpec,
    pub corpus: Corpus,
    /// The held-out validation split.
    pub val: Option<Corpus>,
    pub tokenizer_json: String,
    /// The checkpoints' `tokenizer_config.json` (chat template), if the tokenizer has one.
    pub tokenizer_config: Option<String>,
    pub resume: Option<Checkpoint>,
    /// The pretrained model a fine-tuning run starts from.
    pub init: Option<Pretrained>,
    pub data_desc: String,
}

impl Prepared {
    /// Where the ranks' weights come from.
    pub fn start(&self) -> Start<'_> {
        match (&self.resume, &self.init) {
            (Some(ck), _) => Start::Resume(ck),
            (None, Some(p)) => Start::Init(p),
            (None, None) => Start::Fresh,
        }
    }
}

/// Default micro-batches: 1 without a pipeline; else the largest divisor of the per-replica
/// batch up to 2 x pp (keeps the 1F1B bubble (pp-1)/(M+pp-1) small), with virtual stages
/// the largest such multiple of pp (the interleaved schedule's groups), if one divides it.
pub fn default_micro_batches(batch_per_replica: usize, pp: usize, virtual_stages: usize) -> usize {
    if pp == 1 {
        return 1;
    }
    let divisors = (1..=(2 * pp).min(batch_per_replica.max(1)))
        .rev()
        .filter(|m| batch_per_replica.is_multiple_of(*m));
    let grouped = if virtual_stages > 1 {
        divisors.clone().find(|m| m.is_multiple_of(pp))
    } else {
        None
    };
    grouped.or_else(|| divisors.clone().next()).unwrap_or(1)
}

/// The model `c` names (a preset or a config.json) as the architecture `arch` asks for: a
/// preset takes the architecture (and its experts); a config.json must already be one.
pub fn requested_model(c: &str, arch: Option<TrainArch>) -> Result<ModelConfig> {
    let m = ModelConfig::from_arg(c)?;
    match arch {
        Some(arch) if ModelConfig::preset(c).is_some() => {
            Ok(m.with_arch(arch.arch)?.with_experts(arch.experts))
        }
        Some(arch) if arch.name() != TrainArch::of(&m).name() => Err(TrainError::Config(format!(
            "--arch {} but {c} is a {} model; leave --arch out or use a {} config.json",
            arch.name(),
            TrainArch::of(&m).name(),
            arch.name()
        ))),
        _ => Ok(m),
    }
}

/// Reads and checks everything before any rank starts.
pub fn prepare(a: &RunRequest) -> Result<Prepared> {
    let resume = match &a.resume {
        Some(p) => Some(Checkpoint::open(p)?),
        None => None,
    };
    if let Some(ck) = &resume {
        if a.steps <= ck.state.step {
            return Err(TrainError::Config(format!(
                "the checkpoint is at step {} and the run ends at step {}: nothing to train; \
                 train to a step above {}",
                ck.state.step, a.steps, ck.state.step
            )));
        }
    }
    if a.init.is_some() && (resume.is_some() || a.config.is_some()) {
        return Err(TrainError::Config(
            "fine-tuning takes its model from the pretrained one: give no checkpoint to resume \
             and no model config with it"
                .into(),
        ));
    }
    let init = a.init.as_deref().map(Pretrained::open).transpose()?;
    let tokenizer = match (&a.tokenizer, &resume, &init) {
        (Some(p), _, _) => TextTokenizer::from_file(p)?,
        (None, Some(ck), _) => TextTokenizer::of_checkpoint(&ck.dir.join("tokenizer.json"))?,
        (None, None, Some(init)) => TextTokenizer::from_file(&init.path)?,
        (None, None, None) => TextTokenizer::Bytes,
    };
    let arch = a.arch.as_deref().map(trainable_arch).transpose()?;
    if let (Some(arch), Some(init)) = (arch, &init) {
        if arch.name() != TrainArch::of(&init.config).name() {
            return Err(TrainError::Config(format!(
                "the architecture {} was asked for, but {} is a {} model; leave the \
                 architecture out to fine-tune it",
                arch.name(),
                init.path.display(),
                TrainArch::of(&init.config).name()
            )));
        }
    }
    let requested = |c: &str| requested_model(c, arch);
    let model = match (&a.config, &resume, &init) {
        (_, _, Some(p)) => p.config.clone(),
        (Some(c), Some(ck), None) => {
            let m = requested(c)?;
            if m != ck.config {
                return Err(TrainError::Config(format!(
                    "the model {c} differs from the checkpoint's model; give no model to \
                     resume the checkpoint's"
                )));
            }
            m
        }
        (None, Some(ck), None) => match arch {
            Some(arch) if arch.name() != TrainArch::of(&ck.config).name() => {
                return Err(TrainError::Config(format!(
                    "--arch {} but the checkpoint's model is a {}; leave --arch out to resume it",
                    arch.name(),
                    TrainArch::of(&ck.config).name()
                )))
            }
            _ => ck.config.clone(),
        },
        (c, None, None) => {
            let name = c.as_deref().unwrap_or("tiny");
            let m = requested(name)?;
            if ModelConfig::preset(name).is_some() {
                m.with_vocab(tokenizer.vocab_size())
            } else {
                m
            }
        }
    };
    let text = crate::data::read_text(a.data.as_deref())?;
    let data_desc = match &a.data {
        Some(p) => format!("{} ({} bytes)", p.display(), text.len()),
        None => crate::data::DEFAULT_CORPUS_NAME.to_string(),
    };
    let seed = a
        .seed
        .or(resume.as_ref().map(|c| c.state.seed))
        .unwrap_or(0);
    let seq = a
        .seq
        .or(resume.as_ref().map(|c| c.state.seq))
        .unwrap_or(128);
    let batch = a
        .batch
        .or(resume.as_ref().map(|c| c.state.global_batch))
        .unwrap_or(8);
    // A packed run resumes packed: its data position counts packed windows.
    let pack = a.pack || resume.as_ref().is_some_and(|c| c.state.pack);
    let corpus = match a.data.as_deref() {
        Some(path) if crate::chat::is_chat(path) => {
            chat_corpus(&tokenizer, &text, path, seq, seed, pack)?
        }
        _ if pack => {
            return Err(TrainError::Data(format!(
                "{data_desc} is plain text, without documents to pack into sequences; packing \
                 takes chat data (JSONL of conversations)"
            )))
        }
        _ => Corpus::new(tokenizer.encode(&text)?, seq, seed)?,
    };
    let (corpus, val) = corpus.split(a.held_out)?;
    let dims = a.dims;
    let micro_batches = a.micro_batches.unwrap_or_else(|| {
        default_micro_batches(batch / dims.dp.max(1), dims.pp, a.virtual_stages)
    });
    if !(a.lr > 0.0 && a.lr.is_finite()) {
        return Err(TrainError::Config(
            "the learning rate must be a positive number".into(),
        ));
    }
    if !(a.moe_aux_coef >= 0.0 && a.moe_aux_coef.is_finite()) {
        return Err(TrainError::Config(
            "the load-balancing loss weight must be a number >= 0".into(),
        ));
    }
    tp_spec::check_capacity(&model, a.moe_capacity)
        .map_err(|e| TrainError::Config(e.to_string()))?;
    if let Some(u) = a.moe_bias_rate {
        if !(u >= 0.0 && u.is_finite()) {
            return Err(TrainError::Config(format!(
                "the router bias update rate must be a number >= 0 (DeepSeek-V3 used 0.001), not {u}"
            )));
        }
        if model.experts.is_none() {
            return Err(TrainError::Config(
                "a router bias update rate was given, but the model has no experts (it is dense); leave it unset".into(),
            ));
        }
    }
    if !(a.bucket_mib > 0.0 && a.bucket_mib.is_finite()) {
        return Err(TrainError::Config(
            "the all-reduce bucket size must be a positive number of MiB".into(),
        ));
    }
    let spec = TrainSpec {
        model,
        dims,
        steps: a.steps,
        global_batch: batch,
        micro_batches,
        virtual_stages: a.virtual_stages,
        seq,
        seed,
        optim: AdamWConfig {
            lr: a.lr,
            min_lr: a.min_lr.unwrap_or(a.lr / 10.0),
            warmup_steps: a.warmup,
            weight_decay: a.weight_decay,
            clip_norm: a.clip,
            ..AdamWConfig::default()
        },
        val_every: if val.is_some() { a.val_every } else { 0 },
        bucket_elems: ((a.bucket_mib * (1 << 20) as f64) / 4.0).max(1.0) as usize,
        moe_aux_coef: a.moe_aux_coef,
        ep: a.ep,
        moe_capacity: a.moe_capacity,
        moe_bias_rate: a.moe_bias_rate,
        distributed_optimizer: a.distributed_optimizer,
        sequence_parallel: a.sequence_parallel,
        recompute: a.recompute,
        pack,
        save_dir: a.save.clone(),
        save_every: a.save_every,
        keep: a.keep,
        data_name: format!(
            "{data_desc}, {}",
            match &tokenizer {
                TextTokenizer::Bytes => "bytes".to_string(),
                TextTokenizer::Model { path, .. } => path.display().to_string(),
            }
        ),
    };
    spec.validate()?;
    let max = corpus.max_token() as usize;
    if max >= spec.model.vocab {
        return Err(TrainError::Data(format!(
            "the data has token id {max} but the model's vocabulary is {}; use the tokenizer the \
             model was made for",
            spec.model.vocab
        )));
    }
    Ok(Prepared {
        tokenizer_json: tokenizer.json()?,
        tokenizer_config: tokenizer.config_json(),
        spec,
        corpus,
        val,
        resume,
        init,
        data_desc,
    })
}

/// Chat data (`path`'s JSONL `text`) rendered with the model's template, one conversation a
/// sequence (or several, `pack`ed), the loss on the assistant's replies; a conversation longer
/// than a sequence is an error naming its line.
fn chat_corpus(
    tokenizer: &TextTokenizer,
    text: &[u8],
    path: &std::path::Path,
    seq: usize,
    seed: u64,
    pack: bool,
) -> Result<Corpus> {
    let Some(tok) = tokenizer.model() else {
        return Err(TrainError::Data(format!(
            "{} is chat data, which is rendered with a model's chat template; train from a \
             model (or give its tokenizer)",
            path.display()
        )));
    };
    let text = std::str::from_utf8(text)
        .map_err(|e| TrainError::Data(format!("{} is not UTF-8 ({e})", path.display())))?;
    let mut docs = Vec::new();
    for c in crate::chat::parse_jsonl(text, path)? {
        let (ids, mask) = crate::chat::render(tok, &c, path)?;
        if ids.len() > seq + 1 {
            return Err(TrainError::Data(format!(
                "{} line {}: the conversation is {} tokens, longer than a sequence of {} \
                 (+1 for the last target); raise the sequence length (at most the model's \
                 context) or shorten it",
                path.display(),
                c.line,
                ids.len(),
                seq
            )));
        }
        docs.push((ids, mask));
    }
    let pad = tok.pad_id().or(tok.eos_ids().first().copied()).unwrap_or(0);
    if pack {
        Corpus::packed(&docs, seq, pad, seed)
    } else {
        Corpus::documents(&docs, seq, pad, seed)
    }
}

/// Compute threads per rank: `requested`, else `inherited` (the thread count the process was
/// started with, if any), else this node's cores shared out among `local_ranks` ranks in each
/// of `node_processes` processes. The library neither reads nor sets environment variables:
/// the binary passes what it read and hands the result to candle, whose matmul reads
/// `RAYON_NUM_THREADS` at every call, before any rank starts.
pub fn compute_threads(
    requested: Option<usize>,
    inherited: Option<usize>,
    local_ranks: usize,
    node_processes: usize,
) -> usize {
    if let Some(n) = requested.or(inherited.filter(|n| *n > 0)) {
        return n;
    }
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    (cores / (local_ranks * node_processes).max(1)).max(1)
}

#[cfg(test)]
mod tests {
    use super::*;
    use tp_spec::Arch;

    #[test]
    fn default_micro_batches_are_a_multiple_of_pp_with_virtual_stages_where_one_divides() {
        // 12 sequences at pp 4: up to 8 micro-batches; 6 for 1F1B, 4 (a group of 4) for
        // the interleaved schedule.
        assert_eq!(default_micro_batches(12, 4, 1), 6);
        assert_eq!(default_micro_batches(12, 4, 2), 4);
        assert_eq!(default_micro_batches(8, 2, 2), 4);
        // No multiple of 3 divides 8: the 1F1B default (the run then says what to use).
        assert_eq!(default_micro_batches(8, 3, 2), 4);
        assert_eq!(default_micro_batches(8, 1, 2), 1);
    }

    #[test]
    fn compute_threads_prefers_the_request_then_the_inherited_count_then_shares_the_cores() {
        assert_eq!(compute_threads(Some(3), Some(5), 2, 2), 3);
        assert_eq!(compute_threads(None, Some(5), 2, 2), 5);
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        assert_eq!(compute_threads(None, Some(0), 1, 1), cores);
        assert_eq!(compute_threads(None, None, 2, 1), (cores / 2).max(1));
        assert_eq!(compute_threads(None, None, 1, 4 * cores), 1);
    }

    fn request(config: Option<&str>, arch: Option<&str>) -> RunRequest {
        RunRequest {
            dims: ParallelDims {
                tp: 1,
                pp: 1,
                dp: 1,
            },
            config: config.map(str::to_string),
            init: None,
            arch: arch.map(str::to_string),
            data: None,
            tokenizer: None,
            steps: 1,
            batch: Some(2),
            micro_batches: None,
            virtual_stages: 1,
            seq: Some(16),
            lr: 1e-3,
            min_lr: None,
            warmup: 0,
            weight_decay: 0.0,
            clip: 0.0,
            seed: None,
            save: None,
            save_every: 0,
            keep: 0,
            resume: None,
            bucket_mib: 1.0,
            moe_aux_coef: crate::trainer::DEFAULT_MOE_AUX_COEF,
            ep: 1,
            moe_capacity: None,
            moe_bias_rate: None,
            distributed_optimizer: false,
            sequence_parallel: false,
            recompute: crate::Recompute::None,
            pack: false,
            held_out: 0,
            val_every: 0,
        }
    }

    #[test]
    fn packing_takes_documents_and_plain_text_has_none() {
        let e = prepare(&RunRequest {
            pack: true,
            ..request(None, None)
        })
        .err()
        .expect("plain text is refused")
        .to_string();
        assert!(e.contains("plain text, without documents to pack"), "{e}");
    }

    fn prepared_arch(config: Option<&str>, arch: Option<&str>) -> Result<Arch> {
        prepare(&request(config, arch)).map(|p| p.spec.model.arch)
    }

    #[test]
    fn arch_builds_a_preset_as_qwen3_and_must_match_a_config_json() {
        assert_eq!(prepared_arch(None, None).unwrap(), Arch::Llama);
        assert_eq!(
            prepared_arch(Some("small"), Some("llama")).unwrap(),
            Arch::Llama
        );
        let p = prepare(&request(None, Some("qwen3"))).unwrap();
        assert_eq!(p.spec.model.arch, Arch::Qwen3);
        assert!(p.spec.model.qk_norm);
        let p = prepare(&request(None, Some("qwen2"))).unwrap();
        assert!(p.spec.model.arch == Arch::Qwen2 && p.spec.model.qkv_bias);
        let e = prepared_arch(None, Some("qwen2moe"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("use one of llama, qwen2, qwen3, gemma3"), "{e}");

        // A config.json carries its own architecture: --arch must agree with it.
        let dir = std::env::temp_dir().join(format!("tp-train-arch-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("config.json");
        let llama = ModelConfig::preset("tiny").unwrap();
        std::fs::write(&file, llama.hf_json_text()).unwrap();
        let path = file.to_string_lossy().to_string();
        let e = prepared_arch(Some(&path), Some("qwen3"))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("--arch qwen3 but") && e.contains("is a llama model"),
            "{e}"
        );
        let qwen3 = llama.with_arch(Arch::Qwen3).unwrap();
        std::fs::write(&file, qwen3.hf_json_text()).unwrap();
        assert_eq!(prepared_arch(Some(&path), None).unwrap(), Arch::Qwen3);
        assert_eq!(
            prepared_arch(Some(&path), Some("qwen3")).unwrap(),
            Arch::Qwen3
        );
        let _ = std::fs::remove_dir_all(&dir);
    }
}
