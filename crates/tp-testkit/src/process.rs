//! Child processes with a deadline: a test that hangs is a failing test. [`run`] starts a
//! command in its own process group with its output piped, and when the deadline passes kills
//! the whole group (so the ranks `mpirun` started go too) and fails the test with everything
//! the command wrote. [`mpirun`] is the `mpirun` command line the MPI tests share.

use std::io::Read;
use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// What a finished command returned and wrote.
#[derive(Clone, Debug)]
pub struct Finished {
    /// The exit code (`None` when a signal ended it).
    pub code: Option<i32>,
    /// stdout followed by stderr.
    pub output: String,
    pub stdout: String,
    pub stderr: String,
    pub took: Duration,
}

/// How long to wait for the pipes to close after the command exited: a grandchild that
/// outlives it (a rank mpirun left behind) may hold them open.
const DRAIN: Duration = Duration::from_secs(10);

/// Runs `cmd` (stdin closed, stdout and stderr captured), killing its process group and
/// failing the test, with what it wrote, if it outlives `deadline`.
pub fn run(cmd: &mut Command, deadline: Duration) -> Finished {
    let t0 = Instant::now();
    let what = format!("{cmd:?}");
    cmd.stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    #[cfg(unix)]
    std::os::unix::process::CommandExt::process_group(cmd, 0);
    let mut child = cmd
        .spawn()
        .unwrap_or_else(|e| panic!("cannot start {what}: {e}"));
    let stdout = Capture::start(child.stdout.take().expect("piped stdout"));
    let stderr = Capture::start(child.stderr.take().expect("piped stderr"));
    let status = loop {
        if let Some(status) = child.try_wait().expect("wait on the child") {
            break status;
        }
        if t0.elapsed() > deadline {
            kill_group(&mut child);
            // The pipes close once the group is gone; take what came until then.
            let (out, err) = (stdout.finish(DRAIN), stderr.finish(DRAIN));
            panic!(
                "{what} still ran after {deadline:?} and was killed (a hang); \
                 stdout:\n{out}\nstderr:\n{err}"
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    finished(status, stdout.finish(DRAIN), stderr.finish(DRAIN), t0)
}

/// `program args...` through [`run`].
pub fn run_with_deadline(program: &str, args: &[&str], deadline: Duration) -> Finished {
    run(Command::new(program).args(args), deadline)
}

fn finished(status: ExitStatus, stdout: String, stderr: String, t0: Instant) -> Finished {
    Finished {
        code: status.code(),
        output: format!("{stdout}{stderr}"),
        stdout,
        stderr,
        took: t0.elapsed(),
    }
}

/// SIGKILL to the child's process group (the child and everything it started), then reaped.
fn kill_group(child: &mut Child) {
    #[cfg(unix)]
    {
        let _ = Command::new("kill")
            .args(["-KILL", "--", &format!("-{}", child.id())])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status();
    }
    let _ = child.kill();
    let _ = child.wait();
}

/// A pipe read to its end on a thread of its own, into a buffer readable at any time.
struct Capture {
    buf: Arc<Mutex<Vec<u8>>>,
    reader: JoinHandle<()>,
}

impl Capture {
    fn start(mut pipe: impl Read + Send + 'static) -> Capture {
        let buf = Arc::new(Mutex::new(Vec::new()));
        let sink = Arc::clone(&buf);
        let reader = std::thread::spawn(move || {
            let mut chunk = [0u8; 8192];
            while let Ok(n) = pipe.read(&mut chunk) {
                if n == 0 {
                    break;
                }
                sink.lock().unwrap().extend_from_slice(&chunk[..n]);
            }
        });
        Capture { buf, reader }
    }

    /// The text read once the pipe closed, or after `wait` with it still open.
    fn finish(self, wait: Duration) -> String {
        let t0 = Instant::now();
        while !self.reader.is_finished() && t0.elapsed() < wait {
            std::thread::sleep(Duration::from_millis(10));
        }
        let bytes = self.buf.lock().unwrap();
        String::from_utf8_lossy(&bytes).into_owned()
    }
}

/// The `mpirun` on PATH; fails the test saying how to install Open MPI when there is none.
pub fn require_mpirun() -> PathBuf {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .map(|d| d.join("mpirun"))
        .find(|p| p.is_file())
        .unwrap_or_else(|| {
            panic!(
                "mpirun is not on PATH: install Open MPI (apt-get install openmpi-bin \
                 libopenmpi-dev) to run the MPI tests"
            )
        })
}

/// The options every test passes to mpirun: root allowed (containers, CI), more ranks than
/// cores allowed.
pub const MPIRUN_FLAGS: [&str; 2] = ["--allow-run-as-root", "--oversubscribe"];

/// `mpirun --allow-run-as-root --oversubscribe -n N`: add mpirun options (`-x VAR=...`), then
/// the program and its arguments, and hand it to [`run`].
pub fn mpirun(n: usize) -> Command {
    let mut cmd = Command::new(require_mpirun());
    cmd.args(MPIRUN_FLAGS).args(["-n", &n.to_string()]);
    cmd
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn output_and_exit_code_come_back() {
        let f = run(
            Command::new("sh").args(["-c", "echo out; echo err >&2; exit 3"]),
            Duration::from_secs(30),
        );
        assert_eq!(f.code, Some(3));
        assert_eq!(f.stdout, "out\n");
        assert_eq!(f.stderr, "err\n");
        assert_eq!(f.output, "out\nerr\n");
    }

    #[test]
    fn a_hang_is_killed_with_its_group_and_reported() {
        let t0 = Instant::now();
        let panic = std::panic::catch_unwind(|| {
            // The background sleep holds the pipes open: only a group kill ends it.
            run_with_deadline(
                "sh",
                &["-c", "echo started; sleep 30 & sleep 30"],
                Duration::from_millis(300),
            )
        })
        .expect_err("the deadline must fail the test");
        let msg = panic.downcast_ref::<String>().cloned().unwrap_or_default();
        assert!(msg.contains("still ran after 300ms"), "{msg}");
        assert!(msg.contains("stdout:\nstarted\n"), "{msg}");
        assert!(t0.elapsed() < Duration::from_secs(8), "{:?}", t0.elapsed());
    }
}
