//! Renders a model's Jinja chat template with minijinja, set up the way HF transformers runs them.
//!
//! Like transformers: `trim_blocks` and `lstrip_blocks` on; variables `messages`,
//! `add_generation_prompt`, `bos_token`, `eos_token`; functions `raise_exception(msg)` (fails the
//! render with `msg`) and `strftime_now(fmt)` (current time, UTC here); Python string/dict methods
//! (`.strip()`, `.startswith()`, `.items()` ...) through minijinja-contrib's pycompat; `tojson`
//! writes JSON as transformers' does (Python's `json.dumps`: `", "` and `": "` separators,
//! non-ASCII kept, optional `indent`). `trim`, `namespace` and `loop` are minijinja built-ins.

use minijinja::value::{Kwargs, Value};
use minijinja::{context, Environment, Error, ErrorKind};

use crate::pyjson;
use crate::strftime::DateTime;
use crate::{ChatMessage, TokenizerError};

/// ChatML, used for models that ship no template.
pub(crate) const CHATML: &str = "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}";

/// Gemma's turn format, for Gemma files that carry no template (such as the Gemma-3-270M
/// GGUF): `<start_of_turn>user\n...<end_of_turn>\n`, the assistant's turns as `model`, a system
/// message put before the first user message (Gemma has no system turn).
pub(crate) const GEMMA: &str = "{{ bos_token }}{% set ns = namespace(sys='') %}{% for message in messages %}{% if message['role'] == 'system' %}{% set ns.sys = message['content'] + '\\n\\n' %}{% else %}{{ '<start_of_turn>' + ('model' if message['role'] == 'assistant' else message['role']) + '\\n' }}{% if message['role'] == 'user' %}{{ ns.sys }}{% set ns.sys = '' %}{% endif %}{{ message['content'] + '<end_of_turn>\\n' }}{% endif %}{% endfor %}{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}";

/// The variables a chat template sees.
pub(crate) struct Context<'a> {
    pub messages: &'a [ChatMessage],
    pub add_generation_prompt: bool,
    pub bos_token: &'a str,
    pub eos_token: &'a str,
}

fn raise_exception(message: String) -> Result<String, Error> {
    Err(Error::new(
        ErrorKind::InvalidOperation,
        format!("template raised: {message}"),
    ))
}

/// transformers' `tojson`: `json.dumps(x, ensure_ascii=False, indent=indent)`; the other
/// keyword arguments it knows (`ensure_ascii`, `separators`, `sort_keys`) are accepted and ignored.
fn tojson(value: Value, kwargs: Kwargs) -> Result<String, Error> {
    let indent: Option<usize> = kwargs.get("indent")?;
    for ignored in ["ensure_ascii", "separators", "sort_keys"] {
        let _: Option<Value> = kwargs.get(ignored)?;
    }
    kwargs.assert_all_used()?;
    pyjson::dumps(&value, indent)
}

fn strftime_now(format: String) -> String {
    DateTime::now().format(&format)
}

fn template_error(err: &Error) -> TokenizerError {
    let mut message = match err.detail() {
        Some(detail) => format!("{}: {detail}", err.kind()),
        None => err.kind().to_string(),
    };
    if let Some(line) = err.line() {
        message.push_str(&format!(" (line {line})"));
    }
    TokenizerError::Template { message }
}

/// The environment HF templates expect.
fn environment() -> Environment<'static> {
    let mut env = Environment::new();
    env.set_trim_blocks(true);
    env.set_lstrip_blocks(true);
    env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
    env.add_function("raise_exception", raise_exception);
    env.add_function("strftime_now", strftime_now);
    env.add_filter("tojson", tojson);
    env
}

/// Renders `source` for `ctx`.
pub(crate) fn render(source: &str, ctx: &Context<'_>) -> Result<String, TokenizerError> {
    let env = environment();
    let template = env
        .template_from_str(source)
        .map_err(|e| template_error(&e))?;
    template
        .render(context! {
            messages => ctx.messages,
            add_generation_prompt => ctx.add_generation_prompt,
            bos_token => ctx.bos_token,
            eos_token => ctx.eos_token,
        })
        .map_err(|e| template_error(&e))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ctx(messages: &[ChatMessage], add_generation_prompt: bool) -> Context<'_> {
        Context {
            messages,
            add_generation_prompt,
            bos_token: "<s>",
            eos_token: "</s>",
        }
    }

    fn chat() -> Vec<ChatMessage> {
        vec![
            ChatMessage::new("system", "Be brief."),
            ChatMessage::new("user", "  Hi  "),
        ]
    }

    #[test]
    fn chatml_fallback() {
        let out = render(CHATML, &ctx(&chat(), true)).ok();
        assert_eq!(
            out.as_deref(),
            Some("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n  Hi  <|im_end|>\n<|im_start|>assistant\n")
        );
        let out = render(CHATML, &ctx(&chat(), false)).ok();
        assert_eq!(
            out.as_deref(),
            Some("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n  Hi  <|im_end|>\n")
        );
    }

    #[test]
    fn gemma_turns() {
        let out = render(GEMMA, &ctx(&chat(), true)).ok();
        assert_eq!(
            out.as_deref(),
            Some(
                "<s><start_of_turn>user\nBe brief.\n\n  Hi  <end_of_turn>\n<start_of_turn>model\n"
            )
        );
    }

    #[test]
    fn hf_helpers() {
        let source = "{{ bos_token }}{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}\
            {% if loop.first %}[{{ m.role | upper }}]{% endif %}{{ m['content'] | trim }}|{{ m.content.strip() }}|{{ m | tojson }}\
            {% if not loop.last %};{% endif %}{% endfor %}{{ ns.n }}{{ eos_token }}";
        let out = render(source, &ctx(&chat(), false)).ok();
        assert_eq!(
            out.as_deref(),
            Some("<s>[SYSTEM]Be brief.|Be brief.|{\"role\": \"system\", \"content\": \"Be brief.\"};Hi|Hi|{\"role\": \"user\", \"content\": \"  Hi  \"}2</s>")
        );
    }

    #[test]
    fn tojson_with_indent_and_loop_controls() {
        let source = "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}{{ m | tojson(indent=2) }}{% endfor %}";
        assert_eq!(
            render(source, &ctx(&chat(), false)).ok().as_deref(),
            Some("{\n  \"role\": \"system\",\n  \"content\": \"Be brief.\"\n}")
        );
        let err = render("{{ messages | tojson(colour=1) }}", &ctx(&chat(), false));
        assert!(matches!(err, Err(TokenizerError::Template { .. })));
    }

    #[test]
    fn blocks_are_trimmed_like_transformers() {
        let source = "{% for m in messages %}\n    {% if m.role == 'user' %}\n{{ m.role }}\n    {% endif %}\n{% endfor %}";
        assert_eq!(
            render(source, &ctx(&chat(), false)).ok().as_deref(),
            Some("user\n")
        );
    }

    #[test]
    fn raise_exception_is_a_template_error() {
        let source = "{% if messages[0].role != 'user' %}{{ raise_exception('Conversations must start with a user message') }}{% endif %}";
        match render(source, &ctx(&chat(), false)) {
            Err(TokenizerError::Template { message }) => assert!(
                message.contains("must start with a user message"),
                "{message}"
            ),
            other => panic!("expected a template error, got {other:?}"),
        }
    }

    #[test]
    fn syntax_error_is_a_template_error() {
        assert!(matches!(
            render("{% for %}", &ctx(&chat(), false)),
            Err(TokenizerError::Template { .. })
        ));
    }

    #[test]
    fn strftime_now_renders_a_date() {
        let out = render("{{ strftime_now('%Y') }}", &ctx(&chat(), false)).unwrap_or_default();
        assert!(
            out.len() == 4 && out.chars().all(|c| c.is_ascii_digit()),
            "{out}"
        );
    }
}
