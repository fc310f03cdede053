//! The parallel block equals the dense reference under mpirun, one rank per process:
//! tp 2 and 3 (SmolLM2's 9 heads / 3 KV heads: uneven at 2).
#![cfg(feature = "mpi")]

use std::time::Duration;
use tp_testkit::{mpirun, run};

#[test]
fn block_matches_reference_under_mpirun_at_tp_2_and_3() {
    for n in [2, 3] {
        let f = run(
            mpirun(n).arg(env!("CARGO_BIN_EXE_tp-nn-mpi-check")),
            Duration::from_secs(120),
        );
        let text = f.output;
        assert_eq!(f.code, Some(0), "tp={n}: {text}");
        // One check per rank.
        let want = format!("{n} passed, 0 failed");
        assert!(text.contains(&want), "tp={n}: {text}");
    }
}
