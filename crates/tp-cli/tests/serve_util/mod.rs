//! Shared by the `serve*` tests: starting a real `tp serve` process on a free loopback port,
//! reading the address it prints, and stopping it (SIGTERM, or a kill when the test ends).

#![allow(dead_code)] // each test binary uses a different subset

use std::io::{BufRead, BufReader, Read};
use std::net::SocketAddr;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};
use tp_serve::client::Client;

pub const TP: &str = env!("CARGO_BIN_EXE_tp");

/// A running `tp serve`; killed when dropped.
pub struct ServerProc {
    pub child: Child,
    pub addr: SocketAddr,
    /// The pid printed with the address (rank 0's process; under mpirun not the child's).
    pub rank0_pid: Option<u32>,
    pub client: Client,
    /// Everything it wrote to stderr so far.
    pub stderr: Arc<Mutex<String>>,
}

/// How long a server may take to load and print its address.
const STARTUP: Duration = Duration::from_secs(120);

impl ServerProc {
    /// `tp serve --model SMOLLM2 --port 0 EXTRA...` (skips with `None` without the model).
    pub fn start(extra: &[&str]) -> Option<ServerProc> {
        let model = tp_testkit::smollm2()?;
        Some(Self::start_with(TP, &[], &model, extra))
    }

    /// As [`ServerProc::start`], with `configure` applied to the command before it starts
    /// (environment, resource limits).
    pub fn start_configured(
        extra: &[&str],
        configure: impl FnOnce(&mut Command),
    ) -> Option<ServerProc> {
        let model = tp_testkit::smollm2()?;
        Some(Self::start_command(TP, &[], &model, extra, configure))
    }

    /// Starts `program pre_args... serve --model M --port 0 extra...` (mpirun uses pre_args).
    pub fn start_with(
        program: &str,
        pre: &[&str],
        model: &std::path::Path,
        extra: &[&str],
    ) -> ServerProc {
        Self::start_command(program, pre, model, extra, |_| {})
    }

    fn start_command(
        program: &str,
        pre: &[&str],
        model: &std::path::Path,
        extra: &[&str],
        configure: impl FnOnce(&mut Command),
    ) -> ServerProc {
        let mut cmd = Command::new(program);
        cmd.args(pre)
            .arg("serve")
            .arg("--model")
            .arg(model)
            .args(["--port", "0"])
            .args(extra)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        configure(&mut cmd);
        let mut child = cmd
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {program}: {e}"));
        let stdout = child.stdout.take().expect("piped stdout");
        let mut stderr_pipe = child.stderr.take().expect("piped stderr");
        let stderr = Arc::new(Mutex::new(String::new()));
        let sink = Arc::clone(&stderr);
        std::thread::spawn(move || {
            let mut buf = [0u8; 4096];
            while let Ok(n) = stderr_pipe.read(&mut buf) {
                if n == 0 {
                    break;
                }
                sink.lock()
                    .unwrap()
                    .push_str(&String::from_utf8_lossy(&buf[..n]));
            }
        });
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        let t0 = Instant::now();
        let (addr, rank0_pid) = loop {
            let left = STARTUP.saturating_sub(t0.elapsed());
            match rx.recv_timeout(left) {
                Ok(line) => {
                    if let Some(banner) = tp_serve::banner::parse_listening_line(&line) {
                        let banner = banner.unwrap_or_else(|e| panic!("{e}"));
                        break (banner.addr, banner.pid);
                    }
                }
                Err(_) => {
                    let _ = child.kill();
                    let _ = child.wait();
                    std::thread::sleep(Duration::from_millis(100));
                    panic!(
                        "tp serve printed no address within {STARTUP:?}; stderr:\n{}",
                        stderr.lock().unwrap()
                    );
                }
            }
        };
        let mut client = Client::new(addr);
        client.timeout = Duration::from_secs(120);
        ServerProc {
            child,
            addr,
            rank0_pid,
            client,
            stderr,
        }
    }

    /// Sends `signal` ("TERM", "INT") to the server process.
    pub fn signal(&self, signal: &str) {
        let ok = Command::new("kill")
            .args([&format!("-{signal}"), &self.child.id().to_string()])
            .status()
            .is_ok_and(|s| s.success());
        assert!(ok, "kill -{signal} failed");
    }

    /// Waits for the process to exit, failing the test after `deadline`.
    pub fn wait(&mut self, deadline: Duration) -> ExitStatus {
        let t0 = Instant::now();
        loop {
            if let Some(s) = self.child.try_wait().expect("wait on tp serve") {
                return s;
            }
            if t0.elapsed() > deadline {
                let _ = self.child.kill();
                let _ = self.child.wait();
                panic!(
                    "tp serve still ran {deadline:?} after being asked to stop; stderr:\n{}",
                    self.stderr()
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    pub fn stderr(&self) -> String {
        self.stderr.lock().unwrap().clone()
    }

    /// The value of an unlabelled metric in `/metrics` (`None` when absent).
    pub fn metric(&self, name: &str) -> Option<f64> {
        let text = self.client.get("/metrics").expect("GET /metrics").text();
        metric_value(&text, name)
    }

    /// Polls `cond` on the metrics text until it holds or `deadline` passes.
    pub fn wait_metrics(&self, deadline: Duration, cond: impl Fn(&str) -> bool) -> String {
        let t0 = Instant::now();
        loop {
            let text = self.client.get("/metrics").expect("GET /metrics").text();
            if cond(&text) || t0.elapsed() > deadline {
                return text;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Resident memory of the server process in bytes (Linux).
    pub fn rss_bytes(&self) -> Option<u64> {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.child.id())).ok()?;
        let line = status.lines().find(|l| l.starts_with("VmRSS:"))?;
        let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
        Some(kb * 1024)
    }
}

impl Drop for ServerProc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `name VALUE` of an unlabelled sample in Prometheus text.
pub fn metric_value(text: &str, name: &str) -> Option<f64> {
    text.lines().filter(|l| !l.starts_with('#')).find_map(|l| {
        let (k, v) = l.rsplit_once(' ')?;
        (k == name).then(|| v.parse().ok()).flatten()
    })
}

/// A chat request body.
pub fn chat_body(user: &str, max_tokens: u32, extra: serde_json::Value) -> serde_json::Value {
    let mut body = serde_json::json!({
        "messages": [{"role": "user", "content": user}],
        "max_tokens": max_tokens,
        "temperature": 0,
    });
    if let (Some(b), Some(e)) = (body.as_object_mut(), extra.as_object()) {
        for (k, v) in e {
            b.insert(k.clone(), v.clone());
        }
    }
    body
}

/// The text and finish reason of a streamed answer, read to `[DONE]`, plus the usage chunk
/// if one came. Panics (failing the test) on a malformed stream.
pub struct Streamed {
    pub text: String,
    pub finish_reason: String,
    pub usage: Option<serde_json::Value>,
    pub chunks: usize,
    /// The `logprobs` object of every chunk that had one (not null), in order.
    pub logprobs: Vec<serde_json::Value>,
}

pub fn read_stream(client: &Client, path: &str, body: &serde_json::Value) -> Streamed {
    let mut s = client.stream(path, body).expect("streaming request");
    assert_eq!(s.status, 200, "streaming request refused");
    let mut out = Streamed {
        text: String::new(),
        finish_reason: String::new(),
        usage: None,
        chunks: 0,
        logprobs: Vec::new(),
    };
    loop {
        let data = s
            .next_data()
            .expect("reading the stream")
            .expect("the stream ended before [DONE]");
        if data == "[DONE]" {
            assert!(
                s.next_data().expect("after [DONE]").is_none(),
                "data after [DONE]"
            );
            return out;
        }
        let v: serde_json::Value = serde_json::from_str(&data).expect("a JSON chunk");
        assert!(v.get("error").is_none(), "error in stream: {v}");
        out.chunks += 1;
        if let Some(u) = v.get("usage").filter(|u| !u.is_null()) {
            out.usage = Some(u.clone());
        }
        let Some(choice) = v["choices"].get(0) else {
            continue;
        };
        let piece = choice["delta"]["content"]
            .as_str()
            .or_else(|| choice["text"].as_str())
            .unwrap_or("");
        out.text.push_str(piece);
        if !choice["logprobs"].is_null() {
            out.logprobs.push(choice["logprobs"].clone());
        }
        if let Some(f) = choice["finish_reason"].as_str() {
            out.finish_reason = f.to_string();
        }
    }
}
