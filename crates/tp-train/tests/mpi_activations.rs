//! Activation bytes per rank under mpirun (issue 34): `tp-train-mpi-activations` at 2
//! processes, one rank each, so each rank's counting allocator sees that rank alone; every
//! rank's measured bytes equal its own formula within 5% for 2 sizes x sequence parallelism
//! off/on x 3 recomputations.
#![cfg(feature = "mpi")]

use std::time::Duration;
use tp_testkit::{mpirun, run};

#[test]
fn each_ranks_activation_bytes_equal_its_formula_under_mpirun() {
    let check = env!("CARGO_BIN_EXE_tp-train-mpi-activations");
    let f = run(
        mpirun(2).arg(check).env("RAYON_NUM_THREADS", "1"),
        Duration::from_secs(300),
    );
    assert_eq!(f.code, Some(0), "{}", f.output);
    // 2 sizes x SP off/on x 3 modes, on each of the 2 ranks.
    assert!(f.output.contains("24 passed, 0 failed"), "{}", f.output);
    for rank in 0..2 {
        assert!(
            f.output.contains(&format!(
                "rank {rank}: small 2 x 256 tp 2 sp true Selective"
            )),
            "{}",
            f.output
        );
    }
}
