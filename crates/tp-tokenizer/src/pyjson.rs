//! JSON written the way Python's `json.dumps` writes it, for the `tojson` filter of chat templates.
//!
//! transformers renders templates with its own `tojson`: `json.dumps(x, ensure_ascii=False,
//! indent=indent)`. That differs from minijinja's built-in (which is compact and escapes `<`,
//! `>`, `&`, `'` for HTML): items are separated by `", "` and keys by `": "`, non-ASCII text is
//! kept, and with an indent every item goes on its own line. Tool definitions and tool-call
//! arguments reach the model through this filter, so the spacing matters.

use minijinja::value::{Value, ValueKind};
use minijinja::Error;

/// `json.dumps(value, ensure_ascii=False, indent=indent)`; maps keep their order.
pub(crate) fn dumps(value: &Value, indent: Option<usize>) -> Result<String, Error> {
    let mut out = String::new();
    write_value(&mut out, value, indent, 0)?;
    Ok(out)
}

fn write_value(
    out: &mut String,
    value: &Value,
    indent: Option<usize>,
    depth: usize,
) -> Result<(), Error> {
    match value.kind() {
        ValueKind::Undefined | ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if value.is_true() { "true" } else { "false" }),
        ValueKind::Number if value.is_integer() => out.push_str(&value.to_string()),
        ValueKind::Number => write_float(out, f64::try_from(value.clone())?),
        ValueKind::String => write_string(out, value.as_str().unwrap_or_default()),
        ValueKind::Map => {
            let keys: Vec<Value> = value.try_iter()?.collect();
            let mut items = Vec::with_capacity(keys.len());
            for key in keys {
                let item = value.get_item(&key)?;
                items.push((key, item));
            }
            write_container(
                out,
                ('{', '}'),
                &items,
                indent,
                depth,
                |out, (key, item), depth| {
                    match key.as_str() {
                        Some(k) => write_string(out, k),
                        None => write_string(out, &key.to_string()),
                    }
                    out.push_str(": ");
                    write_value(out, item, indent, depth)
                },
            )?;
        }
        ValueKind::Seq | ValueKind::Iterable => {
            let items: Vec<Value> = value.try_iter()?.collect();
            write_container(
                out,
                ('[', ']'),
                &items,
                indent,
                depth,
                |out, item, depth| write_value(out, item, indent, depth),
            )?;
        }
        ValueKind::Bytes => write_string(
            out,
            &String::from_utf8_lossy(value.as_bytes().unwrap_or_default()),
        ),
        _ => write_string(out, &value.to_string()),
    }
    Ok(())
}

/// Writes `open item, item close` (Python's layout for the given indent).
fn write_container<T>(
    out: &mut String,
    (open, close): (char, char),
    items: &[T],
    indent: Option<usize>,
    depth: usize,
    mut write_item: impl FnMut(&mut String, &T, usize) -> Result<(), Error>,
) -> Result<(), Error> {
    out.push(open);
    if items.is_empty() {
        out.push(close);
        return Ok(());
    }
    let newline = |out: &mut String, level: usize| {
        if let Some(width) = indent {
            out.push('\n');
            out.push_str(&" ".repeat(width * level));
        }
    };
    for (i, item) in items.iter().enumerate() {
        if i > 0 {
            out.push_str(if indent.is_some() { "," } else { ", " });
        }
        newline(out, depth + 1);
        write_item(out, item, depth + 1)?;
    }
    newline(out, depth);
    out.push(close);
    Ok(())
}

/// Python's float repr for the common cases ("1.0", "2.5", "NaN", "Infinity").
fn write_float(out: &mut String, f: f64) {
    if f.is_nan() {
        out.push_str("NaN");
    } else if f.is_infinite() {
        out.push_str(if f > 0.0 { "Infinity" } else { "-Infinity" });
    } else if f.fract() == 0.0 && f.abs() < 1e16 {
        out.push_str(&format!("{f:.1}"));
    } else {
        out.push_str(&f.to_string());
    }
}

fn write_string(out: &mut String, s: &str) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
            c => out.push(c),
        }
    }
    out.push('"');
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dump(source: &str, indent: Option<usize>) -> String {
        let env = minijinja::Environment::new();
        let value = env
            .compile_expression(source)
            .and_then(|e| e.eval(()))
            .unwrap_or_default();
        dumps(&value, indent).unwrap_or_default()
    }

    #[test]
    fn compact_form_has_python_separators_and_keeps_key_order() {
        assert_eq!(
            dump(
                r#"{"name": "get_weather", "arguments": {"city": "Zürich <3>", "days": [1, 2.5, 3.0]}, "ok": true, "none": none}"#,
                None
            ),
            r#"{"name": "get_weather", "arguments": {"city": "Zürich <3>", "days": [1, 2.5, 3.0]}, "ok": true, "none": null}"#
        );
    }

    #[test]
    fn indented_form() {
        assert_eq!(
            dump(r#"{"a": [1, {"b": "x\n\"y\""}], "c": {}, "d": []}"#, Some(2)),
            "{\n  \"a\": [\n    1,\n    {\n      \"b\": \"x\\n\\\"y\\\"\"\n    }\n  ],\n  \"c\": {},\n  \"d\": []\n}"
        );
    }

    #[test]
    fn control_characters_are_escaped() {
        let value = Value::from("\u{1}\t\\ é");
        assert_eq!(dumps(&value, None).unwrap_or_default(), r#""\u0001\t\\ é""#);
    }
}
