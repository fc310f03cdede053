//! The parallel block equals the dense reference under mpirun, one rank per process:
//! tp 2 and 3 (SmolLM2's 9 heads / 3 KV heads: uneven at 2).
#![cfg(feature = "mpi")]

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

#[test]
fn block_matches_reference_under_mpirun_at_tp_2_and_3() {
    for n in ["2", "3"] {
        let t0 = Instant::now();
        let mut child = Command::new("mpirun")
            .args(["--allow-run-as-root", "--oversubscribe", "-n", n])
            .arg(env!("CARGO_BIN_EXE_tp-nn-mpi-check"))
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("mpirun must be installed (apt-get install openmpi-bin libopenmpi-dev)");
        let status = loop {
            if let Some(s) = child.try_wait().expect("wait") {
                break s;
            }
            if t0.elapsed() > Duration::from_secs(120) {
                let _ = child.kill();
                panic!("mpirun -n {n} tp-nn-mpi-check hung");
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        let out = child.wait_with_output().expect("output");
        let text = String::from_utf8_lossy(&out.stdout).to_string()
            + &String::from_utf8_lossy(&out.stderr);
        assert!(status.success(), "tp={n}: {text}");
        // Two checks per rank.
        let want = format!("{} passed, 0 failed", 2 * n.parse::<usize>().unwrap_or(0));
        assert!(text.contains(&want), "tp={n}: {text}");
    }
}
