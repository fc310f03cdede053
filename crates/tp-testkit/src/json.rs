//! JSON rows of a command's output: `tp ... --json` prints one object a line among other
//! lines (logs, tables), and tests read the objects back.

use serde_json::Value;

/// Every line of `text` that is a JSON object, parsed; other lines are skipped.
pub fn json_rows(text: &str) -> Vec<Value> {
    text.lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter(Value::is_object)
        .collect()
}

/// The rows of [`json_rows`] that have the field `key`.
pub fn rows_with(text: &str, key: &str) -> Vec<Value> {
    json_rows(text)
        .into_iter()
        .filter(|v| v.get(key).is_some())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn objects_are_kept_and_everything_else_skipped() {
        let text = "# a log line\n{\"step\":1,\"loss\":2.5}\n42\n[1]\n{\"op\":\"x\"}\nnot json {\n";
        let rows = json_rows(text);
        assert_eq!(rows.len(), 2);
        assert_eq!(rows[0]["loss"], 2.5);
        let ops = rows_with(text, "op");
        assert_eq!(ops.len(), 1);
        assert_eq!(ops[0]["op"], "x");
    }
}
