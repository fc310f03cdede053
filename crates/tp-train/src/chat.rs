//! Chat fine-tuning data: JSONL, one conversation a line (`{"messages": [{"role": ..,
//! "content": ..}, ..]}`), rendered with the model's chat template (tp-tokenizer's
//! `encode_chat`: message text never becomes special tokens) with the loss on the assistant's
//! replies only. The mask comes from the template's own turn boundaries: for each assistant
//! message, the conversation before it rendered with the generation prompt (what the model
//! sees when it starts replying) and the conversation through it; the tokens between the two
//! are the reply (its text and the template's end of turn). Both must be prefixes of the whole
//! rendering, or the template does not render turn by turn and the file is refused.

use crate::error::{Result, TrainError};
use serde_json::Value;
use std::path::Path;
use tp_tokenizer::{ChatMessage, Tokenizer};

/// One conversation and the line it came from (1-based).
#[derive(Clone, Debug, PartialEq)]
pub struct Conversation {
    pub line: usize,
    pub messages: Vec<ChatMessage>,
}

/// Whether `path` names chat data (a `.jsonl` file).
pub fn is_chat(path: &Path) -> bool {
    path.extension().is_some_and(|e| e == "jsonl")
}

/// The conversations of a JSONL file's text; blank lines are skipped. The error names the
/// line (and the message) and what is wrong.
pub fn parse_jsonl(text: &str, path: &Path) -> Result<Vec<Conversation>> {
    let bad = |line: usize, what: String| {
        TrainError::Data(format!("{} line {line}: {what}", path.display()))
    };
    let mut out = Vec::new();
    for (i, raw) in text.lines().enumerate() {
        let line = i + 1;
        if raw.trim().is_empty() {
            continue;
        }
        let v: Value = serde_json::from_str(raw).map_err(|e| {
            bad(
                line,
                format!("not JSON ({e}); each line is one JSON object"),
            )
        })?;
        let Some(list) = v.get("messages").and_then(Value::as_array) else {
            return Err(bad(
                line,
                "no \"messages\" array; each line is {\"messages\": [{\"role\": .., \"content\": ..}, ..]}"
                    .into(),
            ));
        };
        let mut messages = Vec::with_capacity(list.len());
        for (k, m) in list.iter().enumerate() {
            let field = |name: &str| m.get(name).and_then(Value::as_str);
            let (Some(role), Some(content)) = (field("role"), field("content")) else {
                let missing = if field("role").is_none() {
                    "role"
                } else {
                    "content"
                };
                return Err(bad(
                    line,
                    format!("message {} has no \"{missing}\" string", k + 1),
                ));
            };
            messages.push(ChatMessage::new(role, content));
        }
        if !messages.iter().any(|m| m.role == "assistant") {
            return Err(bad(
                line,
                "no assistant message; the loss is on the assistant's replies, so each \
                 conversation needs one"
                    .into(),
            ));
        }
        out.push(Conversation { line, messages });
    }
    if out.is_empty() {
        return Err(TrainError::Data(format!(
            "{} holds no conversations; write one JSON object a line",
            path.display()
        )));
    }
    Ok(out)
}

/// The token ids of `c` rendered with the template, and whether each is in the loss (a token
/// of an assistant reply).
pub fn render(tok: &Tokenizer, c: &Conversation, path: &Path) -> Result<(Vec<u32>, Vec<bool>)> {
    let bad =
        |what: String| TrainError::Data(format!("{} line {}: {what}", path.display(), c.line));
    let encode = |msgs: &[ChatMessage], prompt: bool| {
        tok.encode_chat(msgs, prompt)
            .map_err(|e| bad(format!("the chat template cannot render it ({e})")))
    };
    let full = encode(&c.messages, false)?;
    let mut mask = vec![false; full.len()];
    for (i, m) in c.messages.iter().enumerate() {
        if m.role != "assistant" {
            continue;
        }
        let before = encode(&c.messages[..i], true)?;
        let through = encode(&c.messages[..=i], false)?;
        if !through.starts_with(&before) || !full.starts_with(&through) {
            return Err(bad(format!(
                "the chat template does not render this conversation turn by turn (message \
                 {} changes what comes before it), so the assistant's tokens cannot be told \
                 apart; train on plain text instead",
                i + 1
            )));
        }
        mask[before.len()..through.len()].fill(true);
    }
    Ok((full, mask))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The spans of `mask`'s true runs.
    fn spans(mask: &[bool]) -> Vec<std::ops::Range<usize>> {
        let mut out = Vec::new();
        let mut at = None;
        for (i, &m) in mask.iter().chain([false].iter()).enumerate() {
            match (m, at) {
                (true, None) => at = Some(i),
                (false, Some(a)) => {
                    out.push(a..i);
                    at = None;
                }
                _ => {}
            }
        }
        out
    }

    /// The mask covers exactly the assistant replies: one run per reply, each decoding to the
    /// reply and ending with the template's end of turn; nothing of the system prompt, the
    /// user's text or the template's headers. SmolLM2's template (ChatML with a default
    /// system prompt), a multi-turn conversation.
    #[test]
    fn the_mask_covers_exactly_the_assistant_replies() {
        let Some(gguf) = tp_testkit::smollm2() else {
            return;
        };
        let tok = Tokenizer::from_gguf_file(&gguf).unwrap();
        let line = r#"{"messages": [{"role": "user", "content": "Who is Ferris?"}, {"role": "assistant", "content": "An otter."}, {"role": "user", "content": "Where does he live?"}, {"role": "assistant", "content": "By the river Rank."}]}"#;
        let c = &parse_jsonl(line, Path::new("t.jsonl")).unwrap()[0];
        let (ids, mask) = render(&tok, c, Path::new("t.jsonl")).unwrap();
        assert_eq!(ids, tok.encode_chat(&c.messages, false).unwrap());
        let runs = spans(&mask);
        assert_eq!(runs.len(), 2, "{runs:?}");
        let end = tok.token_to_id("<|im_end|>").unwrap();
        for (r, want) in runs.iter().zip(["An otter.", "By the river Rank."]) {
            let text = tok.decode(&ids[r.clone()]).unwrap();
            assert_eq!(text.trim(), want);
            assert!(ids[r.clone()].contains(&end), "no end of turn in {r:?}");
            // The reply starts right after the template's assistant header.
            let before = tok.decode(&ids[..r.start]).unwrap();
            assert!(before.trim_end().ends_with("assistant"), "{before:?}");
        }
        let outside: Vec<u32> = ids
            .iter()
            .zip(&mask)
            .filter(|(_, m)| !**m)
            .map(|(i, _)| *i)
            .collect();
        let outside = tok.decode(&outside).unwrap();
        assert!(outside.contains("Who is Ferris?") && outside.contains("Where does he live?"));
        assert!(
            !outside.contains("otter") && !outside.contains("Rank"),
            "{outside:?}"
        );
    }

    #[test]
    fn bad_lines_are_named() {
        let p = Path::new("chat.jsonl");
        let e = parse_jsonl("{\"messages\": []}\nnot json\n", p).unwrap_err();
        // The first line has no assistant message.
        assert!(
            e.to_string().contains("chat.jsonl line 1: no assistant"),
            "{e}"
        );
        let ok = r#"{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}"#;
        let e = parse_jsonl(&format!("{ok}\n\nnot json\n"), p).unwrap_err();
        assert!(e.to_string().contains("line 3: not JSON"), "{e}");
        let e = parse_jsonl(&format!("{ok}\n{{\"text\": \"x\"}}\n"), p).unwrap_err();
        assert!(
            e.to_string().contains("line 2: no \"messages\" array"),
            "{e}"
        );
        let e = parse_jsonl(
            &format!("{ok}\n{{\"messages\": [{{\"role\": \"user\"}}]}}\n"),
            p,
        )
        .unwrap_err();
        assert!(
            e.to_string()
                .contains("line 2: message 1 has no \"content\""),
            "{e}"
        );
        let e = parse_jsonl("{\"messages\": [{\"content\": \"x\"}]}", p).unwrap_err();
        assert!(e.to_string().contains("message 1 has no \"role\""), "{e}");
        let c = parse_jsonl(&format!("\n{ok}\n"), p).unwrap();
        assert_eq!(c.len(), 1);
        assert_eq!(c[0].line, 2);
        assert_eq!(c[0].messages[1], ChatMessage::new("assistant", "hello"));
    }
}
