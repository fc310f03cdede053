//! Loads a tokenizer from an HF model directory.
//!
//! `tokenizer.json` is required. When present: `tokenizer_config.json` gives the chat template,
//! the BOS/EOS tokens and `add_bos_token`; `chat_template.jinja` (newer exports) the template;
//! `generation_config.json` more end-of-generation ids. Tokens named like end markers
//! (`<|im_end|>`, `<|endoftext|>`, ...) that are special added tokens also end generation.
//! The tokenizer.json post-processor decides whether BOS is added; `add_bos_token: true` adds
//! it only where the post-processor does not. The file's truncation and padding are ignored.

use std::path::{Path, PathBuf};

use serde_json::Value;

use crate::{specials, Settings, Tokenizer, TokenizerError};

fn read(path: &Path, hint: &str) -> Result<Option<String>, TokenizerError> {
    match std::fs::read_to_string(path) {
        Ok(text) => Ok(Some(text)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(source) => Err(TokenizerError::Io {
            path: path.to_path_buf(),
            hint: hint.to_string(),
            source,
        }),
    }
}

fn read_json(path: &Path) -> Result<Option<Value>, TokenizerError> {
    let Some(text) = read(path, "check the file's permissions")? else {
        return Ok(None);
    };
    serde_json::from_str(&text)
        .map(Some)
        .map_err(|e| TokenizerError::InvalidFile {
            path: path.to_path_buf(),
            reason: e.to_string(),
        })
}

/// A token given as `"<s>"` or as `{"content": "<s>", ...}`.
fn token_text(v: Option<&Value>) -> Option<String> {
    match v? {
        Value::String(s) => Some(s.clone()),
        Value::Object(map) => map
            .get("content")
            .and_then(Value::as_str)
            .map(str::to_string),
        _ => None,
    }
}

/// `chat_template` given as a string or as a list of `{"name", "template"}` (the "default" one wins).
fn template_of(config: &Value) -> Option<String> {
    match config.get("chat_template")? {
        Value::String(s) => Some(s.clone()),
        Value::Array(items) => {
            let named = |name: &str| {
                items
                    .iter()
                    .find(|t| t.get("name").and_then(Value::as_str) == Some(name))
                    .and_then(|t| t.get("template"))
                    .and_then(Value::as_str)
            };
            named("default")
                .or_else(|| {
                    items
                        .first()
                        .and_then(|t| t.get("template"))
                        .and_then(Value::as_str)
                })
                .map(str::to_string)
        }
        _ => None,
    }
}

/// Ids given as a number or a list of numbers.
fn ids_of(v: Option<&Value>) -> Vec<u32> {
    match v {
        Some(Value::Number(n)) => n
            .as_u64()
            .and_then(|n| u32::try_from(n).ok())
            .into_iter()
            .collect(),
        Some(Value::Array(items)) => items
            .iter()
            .filter_map(Value::as_u64)
            .filter_map(|n| u32::try_from(n).ok())
            .collect(),
        _ => Vec::new(),
    }
}

/// Loads `dir`.
pub(crate) fn from_dir(dir: &Path) -> Result<Tokenizer, TokenizerError> {
    let path: PathBuf = dir.join("tokenizer.json");
    let text = match read(&path, "an HF model directory must hold tokenizer.json")? {
        Some(text) => text,
        None => {
            return Err(TokenizerError::Io {
                path,
                hint: "an HF model directory must hold tokenizer.json; for a GGUF model use Tokenizer::from_gguf".into(),
                source: std::io::Error::from(std::io::ErrorKind::NotFound),
            })
        }
    };
    let config = read_json(&dir.join("tokenizer_config.json"))?.unwrap_or(Value::Null);
    let generation = read_json(&dir.join("generation_config.json"))?.unwrap_or(Value::Null);
    let jinja = read(
        &dir.join("chat_template.jinja"),
        "check the file's permissions",
    )?;
    from_parts(&path, &text, &config, &generation, jinja)
}

/// Loads the tokenizer.json document at `path` alone: BOS and EOS come from its
/// post-processor and its special tokens' names; no chat template.
pub(crate) fn from_file(path: &Path) -> Result<Tokenizer, TokenizerError> {
    let text = std::fs::read_to_string(path).map_err(|source| TokenizerError::Io {
        path: path.to_path_buf(),
        hint: "pass a tokenizer.json file, an HF model directory or a GGUF file".into(),
        source,
    })?;
    from_parts(path, &text, &Value::Null, &Value::Null, None)
}

/// A tokenizer from the tokenizer.json `text` read from `path` and what the directory's
/// configs say (`Null` when absent).
fn from_parts(
    path: &Path,
    text: &str,
    config: &Value,
    generation: &Value,
    jinja: Option<String>,
) -> Result<Tokenizer, TokenizerError> {
    let mut inner: tokenizers::Tokenizer =
        text.parse()
            .map_err(|e: tokenizers::Error| TokenizerError::InvalidFile {
                path: path.to_path_buf(),
                reason: e.to_string(),
            })?;
    // Encoding returns every id of the text: the file's truncation and padding are dropped.
    inner
        .with_truncation(None)
        .map_err(|e| TokenizerError::backend("rejected disabling truncation", e))?;
    inner.with_padding(None);

    let bos_token = token_text(config.get("bos_token"));
    let eos_token = token_text(config.get("eos_token"));
    let id = |t: &Option<String>| t.as_deref().and_then(|t| inner.token_to_id(t));
    let mut added: Vec<(u32, String)> = inner
        .get_added_tokens_decoder()
        .into_iter()
        .filter(|(_, t)| t.special)
        .map(|(id, t)| (id, t.content))
        .collect();
    added.sort_unstable();
    // What the post-processor puts around text: its first token is taken as BOS when the configs
    // name none; failing that, a special token named like one (`<s>`, `<|begin_of_text|>` ...).
    let framing: Vec<u32> = inner
        .encode("", true)
        .map(|e| e.get_ids().to_vec())
        .unwrap_or_default();
    let bos_id = id(&bos_token)
        .or_else(|| ids_of(generation.get("bos_token_id")).first().copied())
        .or_else(|| framing.first().copied())
        .or_else(|| {
            added
                .iter()
                .find(|(_, t)| specials::is_begin_of_sequence_name(t))
                .map(|(id, _)| *id)
        });
    let eos_ids = specials::dedup(
        id(&eos_token)
            .into_iter()
            .chain(ids_of(generation.get("eos_token_id")))
            .chain(
                added
                    .iter()
                    .filter(|(_, t)| specials::is_end_of_generation_name(t))
                    .map(|(id, _)| *id),
            ),
    );

    // add_bos_token asks for BOS; the tokenizer.json post-processor may already add it.
    let wants_bos = config.get("add_bos_token").and_then(Value::as_bool) == Some(true);
    let adds_bos = bos_id.is_some_and(|bos| framing.first() == Some(&bos));
    let text_of = |id: Option<u32>| id.and_then(|id| inner.id_to_token(id));
    let eos_token = eos_token.or_else(|| text_of(eos_ids.first().copied()));
    let bos_token = bos_token.or_else(|| text_of(bos_id));
    let settings = Settings {
        vocab_size: None,
        bos_id,
        pad_id: id(&token_text(config.get("pad_token"))),
        eos_ids,
        eos_token,
        bos_token,
        chat_template: jinja.or_else(|| template_of(config)),
        prepend_bos: wants_bos && !adds_bos && bos_id.is_some(),
        adds_bos: adds_bos || (wants_bos && bos_id.is_some()),
    };
    Tokenizer::assemble(inner, settings)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn token_forms() {
        assert_eq!(token_text(Some(&json!("<s>"))).as_deref(), Some("<s>"));
        assert_eq!(
            token_text(Some(&json!({"content": "</s>", "lstrip": false}))).as_deref(),
            Some("</s>")
        );
        assert_eq!(token_text(Some(&json!(null))), None);
    }

    #[test]
    fn template_forms() {
        assert_eq!(
            template_of(&json!({"chat_template": "x"})).as_deref(),
            Some("x")
        );
        let list = json!({"chat_template": [{"name": "tool_use", "template": "t"}, {"name": "default", "template": "d"}]});
        assert_eq!(template_of(&list).as_deref(), Some("d"));
        assert_eq!(template_of(&json!({})), None);
    }

    #[test]
    fn id_forms() {
        assert_eq!(ids_of(Some(&json!(2))), vec![2]);
        assert_eq!(ids_of(Some(&json!([2, 0]))), vec![2, 0]);
        assert_eq!(ids_of(None), Vec::<u32>::new());
    }
}
