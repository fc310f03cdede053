//! cargo-fuzz target: arbitrary bytes written to a file and opened as a checkpoint; when it
//! opens, every weight's `meta`/`rows`/`cols`/`vector` call errs or returns the size asked for.
#![no_main]

use libfuzzer_sys::fuzz_target;
use tp_models::checkpoint::expected_weights;
use tp_models::{open_checkpoint, WeightName};

fuzz_target!(|data: &[u8]| {
    let path = std::env::temp_dir().join(format!("tp-fuzz-{}.gguf", std::process::id()));
    std::fs::write(&path, data).unwrap();
    if let Ok(ckpt) = open_checkpoint(&path) {
        let mut names: Vec<WeightName> = expected_weights(ckpt.config()).map(|(n, _)| n).collect();
        names.push(WeightName::Output);
        for name in names {
            let Ok(m) = ckpt.meta(name) else { continue };
            if let Ok(s) = ckpt.rows(name, 0..m.rows.min(2)) {
                assert_eq!((s.rows(), s.cols()), (m.rows.min(2), m.cols));
            }
            if m.cols > 1 && m.rows * m.cols <= 1 << 20 {
                if let Ok(s) = ckpt.cols(name, 1..m.cols) {
                    assert_eq!((s.rows(), s.cols()), (m.rows, m.cols - 1));
                }
            }
            if m.cols == 1 {
                if let Ok(v) = ckpt.vector(name, None) {
                    assert_eq!(v.len(), m.rows);
                }
            }
            assert!(ckpt.rows(name, m.rows..m.rows + 1).is_err());
        }
    }
    let _ = std::fs::remove_file(&path);
});
