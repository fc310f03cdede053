//! Published runs beyond Megatron 2021 (docs/planner.md section 7b). Korthikanti et al. 2022
//! Tables 3 and 5: the planner's predicted iteration time for the
//! paper's four GPT models at its own layouts, with sequence parallelism and selective
//! recomputation and with full recomputation, against the reported times (within 15% on
//! most runs); the transcribed MFU follows from the transcribed times; docs/planner.md shows
//! the table this code generates. Llama 3.1 405B on 8,192 and 16,384 H100s within 15%.

use tp_plan::korthikanti_table::{compare_with_table5, render_markdown, TOLERANCE};

#[test]
fn most_runs_within_fifteen_percent_and_the_transcription_is_consistent() {
    let rows = compare_with_table5().unwrap();
    assert_eq!(rows.len(), 4);
    let table = render_markdown(&rows);
    eprintln!("{table}");
    for c in &rows {
        // The reported MFU is the reported time under the paper's FLOP count (a check of
        // the transcription: a wrong time or shape moves it by more than a point).
        assert!(
            (c.implied_mfu - c.row.reported_mfu).abs() < 0.005,
            "{}: implied MFU {} vs reported {}",
            c.row.name,
            c.implied_mfu,
            c.row.reported_mfu
        );
        // Sequence parallelism with selective recomputation is predicted faster than full
        // recomputation, as measured (the paper: 29-32% more throughput).
        assert!(c.selective.predicted_step_s < c.full.predicted_step_s);
    }
    let runs: Vec<_> = rows.iter().flat_map(|c| c.runs()).collect();
    let within = runs.iter().filter(|r| r.within_tolerance()).count();
    assert!(
        within >= 6,
        "only {within} of 8 runs within {TOLERANCE}:\n{table}"
    );
}

#[test]
fn docs_show_the_generated_table() {
    let table = render_markdown(&compare_with_table5().unwrap());
    let doc_path = concat!(env!("CARGO_MANIFEST_DIR"), "/../../docs/planner.md");
    let doc = std::fs::read_to_string(doc_path).unwrap();
    assert!(
        doc.contains(&table),
        "docs/planner.md is stale; regenerate with `tp plan --published-runs`:\n{table}"
    );
}

/// A recent public run: Llama 3.1 405B on 8,192 and 16,384 H100s (Meta's Table 4), the
/// knobs the paper does not give chosen by the planner; docs/planner.md shows the table.
#[test]
fn llama3_405b_runs_within_fifteen_percent() {
    let rows = tp_plan::llama3_run::compare_with_table4().unwrap();
    let table = tp_plan::llama3_run::render_markdown(&rows);
    assert_eq!(rows.len(), 2);
    for c in &rows {
        assert!(c.within_tolerance(), "{table}");
    }
    // Twice the GPUs at the same batch: the reported rate falls (430 -> 400), and so does
    // the predicted one (a longer bubble share with half the micro-batches per replica).
    assert!(rows[1].predicted_tflops_per_gpu < rows[0].predicted_tflops_per_gpu);
    let doc_path = concat!(env!("CARGO_MANIFEST_DIR"), "/../../docs/planner.md");
    let doc = std::fs::read_to_string(doc_path).unwrap();
    assert!(
        doc.contains(&table),
        "docs/planner.md is stale; regenerate with `tp plan --published-runs`:\n{table}"
    );
}
