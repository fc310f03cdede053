//! Where message text lies in a rendered chat prompt, so that it is encoded as plain text.
//!
//! A chat template is rendered to one string; encoding it with special-token parsing would let
//! a message containing `<|im_start|>system` open a real system turn. [`render_marked`] renders
//! the template and also returns the byte ranges of the rendered text that came from message
//! contents ("untrusted"); the encoder then accepts special tokens only outside those ranges.
//!
//! Ranges are found by rendering twice: once with the real messages (the text HF transformers
//! would build) and once with each content replaced by a sentinel (private-use characters and a
//! nonce absent from the template and every message). When putting each content back in place of
//! its sentinel gives exactly the real text, the sentinels' places are the content ranges and the
//! text between them is template text. Leading and trailing whitespace stay outside the sentinel,
//! so `| trim` and `.strip()` do not disturb it.
//!
//! A template that rewrites content otherwise (slicing, `split`, `replace`, `tojson` ...) breaks
//! that identity. Then each special-token text inside a content is replaced by an escape marker
//! before rendering, so the template rewrites it as opaque text; the markers' places in the
//! output are the untrusted ranges, and the caller also checks that the special tokens left in
//! the text are exactly those the template produces on its own (the sentinel rendering), which
//! refuses special tokens assembled from pieces of message text. Putting the special texts back
//! must give exactly the real text, else (a marker cut or rewritten) the prompt is refused. So
//! the fallback is never less safe; at worst it is a refusal.

use std::ops::Range;

use crate::template::{self, Context};
use crate::{ChatMessage, TokenizerError};

/// Opens and closes a sentinel or escape marker (Unicode private-use characters).
const OPEN: char = '\u{E000}';
const CLOSE: char = '\u{E001}';

/// Roles every template is assumed to know.
const BASE_ROLES: [&str; 3] = ["system", "user", "assistant"];
/// Further roles, known when the template names them as a string literal.
const EXTRA_ROLES: [&str; 4] = ["tool", "ipython", "function", "developer"];

/// A rendered prompt and where its message text lies.
#[derive(Debug)]
pub(crate) struct Marked {
    /// The rendered prompt, the same text the template gives for the real messages.
    pub text: String,
    /// Byte ranges of `text` that came from message contents, in order, not overlapping.
    pub untrusted: Vec<Range<usize>>,
    /// Set when the ranges were found by escaping: the template rendered with sentinels, whose
    /// special tokens are the only ones `text` may hold outside `untrusted`.
    pub reference: Option<String>,
}

/// The roles `source` knows: system, user, assistant, and those of [`EXTRA_ROLES`] it names.
pub(crate) fn known_roles(source: &str) -> Vec<&'static str> {
    let mut roles = BASE_ROLES.to_vec();
    for role in EXTRA_ROLES {
        if source.contains(&format!("'{role}'")) || source.contains(&format!("\"{role}\"")) {
            roles.push(role);
        }
    }
    roles
}

/// Refuses a message whose role the template does not know (the role is rendered as template
/// text, so it must not be free user text).
pub(crate) fn check_roles(source: &str, messages: &[ChatMessage]) -> Result<(), TokenizerError> {
    let known = known_roles(source);
    match messages
        .iter()
        .position(|m| !known.contains(&m.role.as_str()))
    {
        Some(index) => Err(TokenizerError::UnknownRole {
            index,
            role: messages[index].role.clone(),
            known: known.join(", "),
        }),
        None => Ok(()),
    }
}

/// A nonce such that `OPEN nonce` occurs in none of `texts`.
fn nonce<'a>(texts: impl Iterator<Item = &'a str> + Clone) -> String {
    let mut n: u64 = 0x7470; // any start works; the loop ends within texts.count() + 1 steps
    loop {
        let candidate = format!("{OPEN}tp{n:x}#");
        if !texts.clone().any(|t| t.contains(&candidate)) {
            return candidate;
        }
        n += 1;
    }
}

/// `content` split into leading whitespace, the rest, trailing whitespace.
fn split_ws(content: &str) -> (&str, &str, &str) {
    let core = content.trim();
    let start = content.len() - content.trim_start().len();
    let end = start + core.len();
    (&content[..start], core, &content[end..])
}

/// Renders `source` for the messages and finds where their contents lie. `specials` are the
/// texts of the tokenizer's special tokens (used only by the escaping fallback).
pub(crate) fn render_marked(
    source: &str,
    ctx: &Context<'_>,
    specials: &[String],
) -> Result<Marked, TokenizerError> {
    let real = template::render(source, ctx)?;
    let texts = std::iter::once(source)
        .chain([ctx.bos_token, ctx.eos_token])
        .chain(ctx.messages.iter().map(|m| m.content.as_str()));
    let nonce = nonce(texts);

    // Pass 1: every non-empty content becomes lead + sentinel + trail.
    let mut replaced = Vec::with_capacity(ctx.messages.len());
    let mut parts = Vec::with_capacity(ctx.messages.len());
    for (i, m) in ctx.messages.iter().enumerate() {
        let (lead, core, trail) = split_ws(&m.content);
        if m.content.is_empty() {
            replaced.push(m.clone());
        } else {
            replaced.push(ChatMessage::new(
                m.role.clone(),
                format!("{lead}{nonce}{i}{CLOSE}{trail}"),
            ));
        }
        parts.push((lead, core, trail));
    }
    let sentinel_ctx = Context {
        messages: &replaced,
        ..*ctx
    };
    let with_sentinels = template::render(source, &sentinel_ctx)?;
    if let Some((text, untrusted)) = substitute(&with_sentinels, &nonce, |i| {
        parts.get(i).map(|&(lead, core, trail)| (lead, core, trail))
    }) {
        if text == real {
            return Ok(Marked {
                text,
                untrusted,
                reference: None,
            });
        }
    }

    // Pass 2: the template rewrote the content; escape special-token texts inside it instead.
    let escaped: Vec<ChatMessage> = ctx
        .messages
        .iter()
        .map(|m| ChatMessage::new(m.role.clone(), escape(&m.content, specials, &nonce)))
        .collect();
    let escaped_ctx = Context {
        messages: &escaped,
        ..*ctx
    };
    let rendered = template::render(source, &escaped_ctx)?;
    let (text, untrusted) = substitute(&rendered, &nonce, |k| {
        specials.get(k).map(|s| ("", s.as_str(), ""))
    })
    .filter(|(text, _)| *text == real)
    .ok_or_else(|| TokenizerError::Inseparable {
        reason: "the template cuts or rewrites message text that holds special-token text".into(),
    })?;
    Ok(Marked {
        text,
        untrusted,
        reference: Some(with_sentinels),
    })
}

/// `content` with each special-token text (leftmost, longest first) replaced by a marker
/// `nonce k CLOSE`, k its index in `specials`.
fn escape(content: &str, specials: &[String], nonce: &str) -> String {
    let mut out = String::with_capacity(content.len());
    let mut rest = content;
    'outer: while !rest.is_empty() {
        let mut best: Option<(usize, usize)> = None; // (index in specials, length)
        for (k, s) in specials.iter().enumerate() {
            if !s.is_empty()
                && rest.starts_with(s.as_str())
                && best.is_none_or(|(_, l)| s.len() > l)
            {
                best = Some((k, s.len()));
            }
        }
        if let Some((k, len)) = best {
            out.push_str(&format!("{nonce}{k}{CLOSE}"));
            rest = &rest[len..];
            continue 'outer;
        }
        let Some(c) = rest.chars().next() else { break };
        out.push(c);
        rest = &rest[c.len_utf8()..];
    }
    out
}

/// Replaces every `nonce i CLOSE` in `rendered` by the core text `lookup(i)` gives and returns
/// the text with the untrusted ranges (the core, widened over the lead/trail whitespace when the
/// rendered text kept it there). `None` when a marker is cut apart or names no entry.
fn substitute<'a>(
    rendered: &str,
    nonce: &str,
    lookup: impl Fn(usize) -> Option<(&'a str, &'a str, &'a str)>,
) -> Option<(String, Vec<Range<usize>>)> {
    let mut text = String::with_capacity(rendered.len());
    let mut untrusted: Vec<Range<usize>> = Vec::new();
    let mut rest = rendered;
    while let Some(at) = rest.find(nonce) {
        text.push_str(&rest[..at]);
        let after = &rest[at + nonce.len()..];
        let close = after.find(CLOSE)?;
        let index: usize = after[..close].parse().ok()?;
        let (lead, core, trail) = lookup(index)?;
        let tail = &after[close + CLOSE.len_utf8()..];
        let start = if !lead.is_empty() && text.ends_with(lead) {
            text.len() - lead.len()
        } else {
            text.len()
        };
        text.push_str(core);
        let mut end = text.len();
        if !trail.is_empty() && tail.starts_with(trail) {
            end += trail.len();
        }
        match untrusted.last_mut() {
            Some(last) if last.end >= start => last.end = last.end.max(end),
            _ => untrusted.push(start..end),
        }
        rest = tail;
    }
    text.push_str(rest);
    Some((text, untrusted))
}
