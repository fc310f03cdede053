//! `tp plan` is wired into the binary: a plan prints, a bad preset is a clear error.

mod common;
use common::TP;
use std::time::Duration;

#[test]
fn plans_a_known_model_and_keeps_tp_inside_the_node() {
    let f = common::run_with_deadline(
        TP,
        &[
            "plan",
            "--model",
            "llama-2-7b",
            "--gpus",
            "16",
            "--gpu",
            "a100-80",
            "--json",
        ],
        Duration::from_secs(60),
    );
    assert_eq!(f.code, Some(0), "{}", f.output);
    let v: serde_json::Value = serde_json::from_str(&f.output).expect("JSON output");
    let text = v.to_string();
    assert!(text.contains("\"tp\""), "{text}");
}

#[test]
fn an_unknown_preset_lists_the_valid_ones() {
    let f = common::run_with_deadline(
        TP,
        &["plan", "--model", "gpt-17", "--gpus", "8"],
        Duration::from_secs(30),
    );
    assert_eq!(f.code, Some(2), "{}", f.output);
    assert!(f.output.contains("llama-2-70b"), "{}", f.output);
}
