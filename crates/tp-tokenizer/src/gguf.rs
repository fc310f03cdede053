//! Builds a tokenizer from GGUF metadata (`tokenizer.ggml.*`, `tokenizer.chat_template`).
//!
//! Supported `tokenizer.ggml.model`s: `gpt2` (byte-level BPE: vocabulary + merges, with the
//! pre-tokenizer named by `tokenizer.ggml.pre`) and `llama` (SentencePiece BPE: vocabulary +
//! scores, byte fallback). Token types decide which tokens are parsed out of raw text: control
//! and unknown tokens as special tokens (skipped by `decode`), user-defined ones as ordinary
//! added tokens.

use std::collections::HashMap;

use candle_core::quantized::gguf_file::Value;
use serde_json::{Map, Value as Json};

use crate::json::{self, BpeOptions};
use crate::{pretok, specials, spm, Settings, Tokenizer, TokenizerError};

/// GGUF token types (llama.cpp's `llama_token_type`).
pub(crate) mod token_type {
    pub const NORMAL: i64 = 1;
    pub const UNKNOWN: i64 = 2;
    pub const CONTROL: i64 = 3;
    pub const USER_DEFINED: i64 = 4;
    pub const UNUSED: i64 = 5;
    pub const BYTE: i64 = 6;
}

const MODELS: &str = "gpt2 (byte-level BPE), llama (SentencePiece BPE)";

/// tp-spec's GGUF metadata (from its header reader) as candle holds it, which this module reads.
pub(crate) fn candle_metadata(
    metadata: HashMap<String, tp_spec::GgufValue>,
) -> HashMap<String, Value> {
    fn value(v: tp_spec::GgufValue) -> Value {
        use tp_spec::GgufValue as G;
        match v {
            G::U8(x) => Value::U8(x),
            G::I8(x) => Value::I8(x),
            G::U16(x) => Value::U16(x),
            G::I16(x) => Value::I16(x),
            G::U32(x) => Value::U32(x),
            G::I32(x) => Value::I32(x),
            G::U64(x) => Value::U64(x),
            G::I64(x) => Value::I64(x),
            G::F32(x) => Value::F32(x),
            G::F64(x) => Value::F64(x),
            G::Bool(x) => Value::Bool(x),
            G::String(s) => Value::String(s),
            G::Array(a) => Value::Array(a.into_iter().map(value).collect()),
        }
    }
    metadata.into_iter().map(|(k, v)| (k, value(v))).collect()
}

/// Typed access to the metadata map, with errors that name the key.
pub(crate) struct Meta<'a>(pub &'a HashMap<String, Value>);

impl<'a> Meta<'a> {
    fn get(&self, key: &str) -> Option<&'a Value> {
        self.0.get(key)
    }

    pub fn string(&self, key: &str) -> Result<Option<&'a str>, TokenizerError> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::String(s)) => Ok(Some(s.as_str())),
            Some(other) => Err(TokenizerError::invalid(
                key,
                format!("expected a string, found {:?}", other.value_type()),
            )),
        }
    }

    pub fn int(&self, key: &str) -> Result<Option<i64>, TokenizerError> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => as_int(v).map(Some).ok_or_else(|| {
                TokenizerError::invalid(
                    key,
                    format!("expected an integer, found {:?}", v.value_type()),
                )
            }),
        }
    }

    pub fn bool(&self, key: &str) -> Result<Option<bool>, TokenizerError> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::Bool(b)) => Ok(Some(*b)),
            Some(v) => match as_int(v) {
                Some(i) => Ok(Some(i != 0)),
                None => Err(TokenizerError::invalid(
                    key,
                    format!("expected a bool, found {:?}", v.value_type()),
                )),
            },
        }
    }

    pub fn array(&self, key: &str) -> Result<Option<&'a [Value]>, TokenizerError> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::Array(items)) => Ok(Some(items.as_slice())),
            Some(v) => Err(TokenizerError::invalid(
                key,
                format!("expected an array, found {:?}", v.value_type()),
            )),
        }
    }

    pub fn strings(&self, key: &str) -> Result<Option<Vec<&'a str>>, TokenizerError> {
        let Some(items) = self.array(key)? else {
            return Ok(None);
        };
        items
            .iter()
            .enumerate()
            .map(|(i, v)| match v {
                Value::String(s) => Ok(s.as_str()),
                other => Err(TokenizerError::invalid(
                    key,
                    format!("element {i} is {:?}, expected a string", other.value_type()),
                )),
            })
            .collect::<Result<Vec<_>, _>>()
            .map(Some)
    }

    /// A token id that must be below `n_tokens`; negative values (llama.cpp's "none") read as absent.
    pub fn token_id(&self, key: &str, n_tokens: usize) -> Result<Option<u32>, TokenizerError> {
        match self.int(key)? {
            None => Ok(None),
            Some(i) if i < 0 => Ok(None),
            Some(i) if (i as u64) < n_tokens as u64 => Ok(Some(i as u32)),
            Some(i) => Err(TokenizerError::invalid(
                key,
                format!("id {i} is outside the vocabulary of {n_tokens} tokens"),
            )),
        }
    }
}

fn as_int(v: &Value) -> Option<i64> {
    Some(match v {
        Value::U8(x) => i64::from(*x),
        Value::I8(x) => i64::from(*x),
        Value::U16(x) => i64::from(*x),
        Value::I16(x) => i64::from(*x),
        Value::U32(x) => i64::from(*x),
        Value::I32(x) => i64::from(*x),
        Value::U64(x) => i64::try_from(*x).ok()?,
        Value::I64(x) => *x,
        _ => return None,
    })
}

fn as_float(v: &Value) -> Option<f64> {
    match v {
        Value::F32(x) => Some(f64::from(*x)),
        Value::F64(x) => Some(*x),
        other => as_int(other).map(|i| i as f64),
    }
}

/// What every GGUF tokenizer reads, whatever its model.
pub(crate) struct Common<'a> {
    pub tokens: Vec<&'a str>,
    pub types: Vec<i64>,
    pub bos: Option<u32>,
    pub eos: Option<u32>,
    pub eot: Option<u32>,
    pub eom: Option<u32>,
    pub unk: Option<u32>,
    pub pad: Option<u32>,
    pub add_bos: Option<bool>,
    pub add_eos: Option<bool>,
    pub chat_template: Option<String>,
}

impl<'a> Common<'a> {
    fn read(meta: &Meta<'a>) -> Result<Self, TokenizerError> {
        let tokens = meta.strings("tokenizer.ggml.tokens")?.ok_or_else(|| TokenizerError::MissingKey {
            key: "tokenizer.ggml.tokens".into(),
            hint: "the file carries no vocabulary; load the tokenizer from the model's HF directory (tokenizer.json) instead".into(),
        })?;
        if tokens.is_empty() {
            return Err(TokenizerError::invalid(
                "tokenizer.ggml.tokens",
                "the vocabulary is empty",
            ));
        }
        let n = tokens.len();
        let types = match meta.array("tokenizer.ggml.token_type")? {
            None => vec![token_type::NORMAL; n],
            Some(items) if items.len() != n => {
                return Err(TokenizerError::invalid(
                    "tokenizer.ggml.token_type",
                    format!("{} entries for {n} tokens", items.len()),
                ))
            }
            Some(items) => items
                .iter()
                .enumerate()
                .map(|(i, v)| {
                    as_int(v).ok_or_else(|| {
                        TokenizerError::invalid(
                            "tokenizer.ggml.token_type",
                            format!("element {i} is not an integer"),
                        )
                    })
                })
                .collect::<Result<_, _>>()?,
        };
        let chat_template = meta.string("tokenizer.chat_template")?.map(str::to_string);
        Ok(Self {
            bos: meta.token_id("tokenizer.ggml.bos_token_id", n)?,
            eos: meta.token_id("tokenizer.ggml.eos_token_id", n)?,
            eot: meta.token_id("tokenizer.ggml.eot_token_id", n)?,
            eom: meta.token_id("tokenizer.ggml.eom_token_id", n)?,
            unk: meta.token_id("tokenizer.ggml.unknown_token_id", n)?,
            pad: meta.token_id("tokenizer.ggml.padding_token_id", n)?,
            add_bos: meta.bool("tokenizer.ggml.add_bos_token")?,
            add_eos: meta.bool("tokenizer.ggml.add_eos_token")?,
            tokens,
            types,
            chat_template,
        })
    }

    /// Whether token `id` is parsed out of raw text and skipped by decode (llama.cpp: control or
    /// unknown type; tokens named like end-of-generation markers count as control).
    fn is_special(&self, id: usize) -> bool {
        let t = self.types[id];
        t == token_type::CONTROL
            || t == token_type::UNKNOWN
            || specials::is_end_of_generation_name(self.tokens[id])
    }

    /// The `added_tokens` of the document: special tokens, then user-defined ones. Without a
    /// token_type key, the ids named by bos/eos/eot/eom/pad are taken as special.
    pub fn added_tokens(&self, has_types: bool) -> Vec<Json> {
        let named: Vec<u32> = [self.bos, self.eos, self.eot, self.eom, self.pad]
            .into_iter()
            .flatten()
            .collect();
        let mut out = Vec::new();
        for (id, token) in self.tokens.iter().enumerate() {
            let id32 = id as u32;
            if self.is_special(id) || (!has_types && named.contains(&id32)) {
                out.push(json::added_token(id32, token, true));
            } else if self.types[id] == token_type::USER_DEFINED {
                out.push(json::added_token(id32, token, false));
            }
        }
        out
    }

    /// End-of-generation ids: eos, eot, eom, then every token named like an end marker.
    pub fn eos_ids(&self) -> Vec<u32> {
        let named = self
            .tokens
            .iter()
            .enumerate()
            .filter(|(_, t)| specials::is_end_of_generation_name(t))
            .map(|(i, _)| i as u32);
        specials::dedup(
            [self.eos, self.eot, self.eom]
                .into_iter()
                .flatten()
                .chain(named),
        )
    }

    /// Whether encoded text starts with BOS (`default_add_bos` when the file is silent).
    pub fn adds_bos(&self, default_add_bos: bool) -> bool {
        self.bos.is_some() && self.add_bos.unwrap_or(default_add_bos)
    }

    /// The post-processor adding BOS/EOS as the model asks.
    pub fn processor(&self, default_add_bos: bool) -> Json {
        let with = |flag: bool, id: Option<u32>| {
            id.filter(|_| flag).map(|id| (self.tokens[id as usize], id))
        };
        json::bos_eos_processor(
            with(self.adds_bos(default_add_bos), self.bos),
            with(self.add_eos.unwrap_or(false), self.eos),
        )
    }

    pub fn settings(&self, default_add_bos: bool) -> Settings {
        let token = |id: Option<u32>| id.map(|i| self.tokens[i as usize].to_string());
        Settings {
            vocab_size: Some(self.tokens.len()),
            bos_id: self.bos,
            pad_id: self.pad,
            eos_ids: self.eos_ids(),
            bos_token: token(self.bos),
            eos_token: token(self.eos),
            chat_template: self.chat_template.clone(),
            prepend_bos: false,
            adds_bos: self.adds_bos(default_add_bos),
        }
    }
}

/// Builds the tokenizer described by GGUF metadata.
pub(crate) fn from_metadata(
    metadata: &HashMap<String, Value>,
) -> Result<Tokenizer, TokenizerError> {
    let meta = Meta(metadata);
    let model = meta.string("tokenizer.ggml.model")?.ok_or_else(|| TokenizerError::MissingKey {
        key: "tokenizer.ggml.model".into(),
        hint: "the file carries no tokenizer; load the tokenizer from the model's HF directory (tokenizer.json) instead".into(),
    })?;
    match model {
        "gpt2" => byte_level_bpe(&meta),
        "llama" => spm::from_gguf(
            &meta,
            &Common::read(&meta)?,
            metadata.contains_key("tokenizer.ggml.token_type"),
        ),
        other => Err(TokenizerError::UnsupportedModel {
            model: other.to_string(),
            supported: MODELS.to_string(),
        }),
    }
}

/// `tokenizer.ggml.model = gpt2`.
fn byte_level_bpe(meta: &Meta<'_>) -> Result<Tokenizer, TokenizerError> {
    let common = Common::read(meta)?;
    let spec = pretok::lookup(meta.string("tokenizer.ggml.pre")?)?;
    let merges = meta.strings("tokenizer.ggml.merges")?.ok_or_else(|| TokenizerError::MissingKey {
        key: "tokenizer.ggml.merges".into(),
        hint: "a gpt2 (byte-level BPE) tokenizer needs its merges; re-export the model with a current llama.cpp converter".into(),
    })?;
    let merges = merges
        .iter()
        .enumerate()
        .map(|(i, m)| {
            m.split_once(' ')
                .map(|(a, b)| (a.to_string(), b.to_string()))
                .ok_or_else(|| {
                    TokenizerError::invalid(
                        "tokenizer.ggml.merges",
                        format!("merge {i} `{m}` is not two tokens separated by a space"),
                    )
                })
        })
        .collect::<Result<Vec<_>, _>>()?;
    let mut vocab = Map::new();
    for (id, token) in common.tokens.iter().enumerate() {
        vocab.insert(token.to_string(), Json::from(id as u32));
    }
    let mut pre: Vec<Json> = spec
        .regexes
        .iter()
        .map(|r| json::split_isolated(r))
        .collect();
    pre.push(json::byte_level_pre(false));
    let has_types = meta.0.contains_key("tokenizer.ggml.token_type");
    let doc = json::document(
        common.added_tokens(has_types),
        Json::Null,
        json::pre_sequence(pre),
        common.processor(spec.add_bos_default),
        json::byte_level_decoder(),
        json::bpe_model(
            vocab,
            merges,
            &BpeOptions {
                ignore_merges: spec.ignore_merges,
                ..BpeOptions::default()
            },
        ),
    );
    let inner = json::load(&doc, "GGUF metadata (tokenizer.ggml.*)", "re-export the model with a current llama.cpp converter, or load its HF directory (tokenizer.json)")?;
    Tokenizer::assemble(inner, common.settings(spec.add_bos_default))
}

/// Reads `tokenizer.ggml.scores` as floats (for SentencePiece vocabularies).
pub(crate) fn scores(meta: &Meta<'_>, n: usize) -> Result<Option<Vec<f64>>, TokenizerError> {
    let key = "tokenizer.ggml.scores";
    let Some(items) = meta.array(key)? else {
        return Ok(None);
    };
    if items.len() != n {
        return Err(TokenizerError::invalid(
            key,
            format!("{} entries for {n} tokens", items.len()),
        ));
    }
    items
        .iter()
        .enumerate()
        .map(|(i, v)| {
            as_float(v)
                .ok_or_else(|| TokenizerError::invalid(key, format!("element {i} is not a number")))
        })
        .collect::<Result<Vec<_>, _>>()
        .map(Some)
}
