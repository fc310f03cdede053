//! A headless Chromium driven over the DevTools protocol through `--remote-debugging-pipe`
//! (JSON messages ended by a NUL byte on file descriptors 3 and 4): open a page, run an
//! expression in it, wait for a condition, press keys, save a screenshot. Every wait has a
//! deadline. `launch` answers `None` where no browser is installed (the caller says it
//! skipped), unless `TP_REQUIRE_BROWSER=1`, where that is a failure.
#![allow(dead_code)]

use serde_json::{json, Value};
use std::io::{BufRead, BufReader, Write};
use std::os::fd::{FromRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

const BROWSERS: &[&str] = &["chromium", "chromium-browser", "google-chrome"];

pub struct Browser {
    child: Child,
    to: std::fs::File,
    from: mpsc::Receiver<Value>,
    next: u64,
    session: String,
    profile: PathBuf,
}

fn find_browser() -> Option<PathBuf> {
    if let Ok(p) = std::env::var("TP_BROWSER") {
        return Some(PathBuf::from(p));
    }
    let path = std::env::var_os("PATH")?;
    BROWSERS.iter().find_map(|name| {
        std::env::split_paths(&path)
            .map(|d| d.join(name))
            .find(|p| p.is_file())
    })
}

fn pipe() -> (OwnedFd, OwnedFd) {
    let mut fds = [0; 2];
    // SAFETY: pipe2 writes two descriptors into the array.
    let r = unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) };
    assert_eq!(r, 0, "pipe2: {}", std::io::Error::last_os_error());
    // SAFETY: both descriptors are new and owned here.
    unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) }
}

impl Browser {
    /// Starts the browser with an empty profile and attaches to its first page.
    pub fn launch(test: &str) -> Option<Browser> {
        let Some(exe) = find_browser() else {
            let msg = format!(
                "no Chromium found (tried {BROWSERS:?} on PATH and $TP_BROWSER); install Debian's `chromium` package to run this test"
            );
            if std::env::var("TP_REQUIRE_BROWSER").is_ok_and(|v| v == "1") {
                panic!("{msg} (TP_REQUIRE_BROWSER=1)");
            }
            // Straight to stderr (not through the test harness's capture): a skip must show.
            let _ = writeln!(std::io::stderr(), "SKIPPED {test}: {msg}");
            return None;
        };
        let profile =
            std::env::temp_dir().join(format!("tp-browser-{}-{}", std::process::id(), test));
        let _ = std::fs::remove_dir_all(&profile);
        std::fs::create_dir_all(&profile).unwrap();
        // Commands go browser-ward on fd 3, answers come back on fd 4.
        let (cmd_read, cmd_write) = pipe();
        let (ans_read, ans_write) = pipe();
        let mut cmd = Command::new(&exe);
        cmd.args([
            "--headless=new",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-dev-shm-usage",
            "--no-first-run",
            "--no-default-browser-check",
            "--disable-extensions",
            "--disable-background-networking",
            "--remote-debugging-pipe",
            "--window-size=1280,900",
        ])
        .arg(format!("--user-data-dir={}", profile.display()))
        .arg("about:blank")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null());
        {
            use std::os::fd::AsRawFd;
            use std::os::unix::process::CommandExt;
            let (r, w) = (cmd_read.as_raw_fd(), ans_write.as_raw_fd());
            // SAFETY: only dup/dup2/close (async-signal-safe) run between fork and exec.
            unsafe {
                cmd.pre_exec(move || {
                    // Out of the way first, so that neither lands on the other's target.
                    let r2 = libc::fcntl(r, libc::F_DUPFD, 10);
                    let w2 = libc::fcntl(w, libc::F_DUPFD, 10);
                    if r2 < 0 || w2 < 0 || libc::dup2(r2, 3) < 0 || libc::dup2(w2, 4) < 0 {
                        return Err(std::io::Error::last_os_error());
                    }
                    libc::close(r2);
                    libc::close(w2);
                    Ok(())
                });
            }
        }
        let child = cmd
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {}: {e}", exe.display()));
        drop(cmd_read);
        drop(ans_write);
        let (tx, from) = mpsc::channel();
        std::thread::spawn(move || {
            let mut r = BufReader::new(std::fs::File::from(ans_read));
            let mut buf = Vec::new();
            while r.read_until(0, &mut buf).is_ok_and(|n| n > 0) {
                buf.pop_if(|b| *b == 0);
                if let Ok(v) = serde_json::from_slice::<Value>(&buf) {
                    if tx.send(v).is_err() {
                        return;
                    }
                }
                buf.clear();
            }
        });
        let mut b = Browser {
            child,
            to: std::fs::File::from(cmd_write),
            from,
            next: 0,
            session: String::new(),
            profile,
        };
        let targets = b.call_root("Target.getTargets", json!({}));
        let page = targets["targetInfos"]
            .as_array()
            .and_then(|t| t.iter().find(|t| t["type"] == "page"))
            .map(|t| t["targetId"].clone())
            .unwrap_or_else(|| {
                b.call_root("Target.createTarget", json!({"url": "about:blank"}))["targetId"]
                    .clone()
            });
        let attached = b.call_root(
            "Target.attachToTarget",
            json!({"targetId": page, "flatten": true}),
        );
        b.session = attached["sessionId"].as_str().unwrap().to_string();
        b.call("Page.enable", json!({}));
        b.call("Runtime.enable", json!({}));
        Some(b)
    }

    fn send(&mut self, method: &str, params: Value, session: Option<&str>) -> Value {
        self.next += 1;
        let id = self.next;
        let mut msg = json!({"id": id, "method": method, "params": params});
        if let Some(s) = session {
            msg["sessionId"] = json!(s);
        }
        let mut bytes = msg.to_string().into_bytes();
        bytes.push(0);
        self.to
            .write_all(&bytes)
            .expect("the browser's command pipe");
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let v = self
                .from
                .recv_timeout(left)
                .unwrap_or_else(|e| panic!("no answer to {method} within 30 s: {e}"));
            if v["id"] == id {
                if let Some(err) = v.get("error") {
                    panic!("{method} failed: {err}");
                }
                return v["result"].clone();
            }
        }
    }

    fn call_root(&mut self, method: &str, params: Value) -> Value {
        self.send(method, params, None)
    }

    /// A command to the attached page.
    pub fn call(&mut self, method: &str, params: Value) -> Value {
        let s = self.session.clone();
        self.send(method, params, Some(&s))
    }

    /// Opens `url` and waits for its document (and deferred scripts) to be ready.
    pub fn open(&mut self, url: &str) {
        self.call("Page.navigate", json!({"url": url}));
        self.wait_for(
            "document.readyState === 'complete' && location.href !== 'about:blank'",
            Duration::from_secs(15),
        );
    }

    /// The value of a JavaScript expression in the page (promises awaited); panics on an
    /// exception, naming it.
    pub fn eval(&mut self, expr: &str) -> Value {
        let r = self.call(
            "Runtime.evaluate",
            json!({"expression": expr, "returnByValue": true, "awaitPromise": true}),
        );
        if let Some(e) = r.get("exceptionDetails") {
            panic!("{expr}: {e}");
        }
        r["result"]["value"].clone()
    }

    /// Waits until `expr` is true in the page, for at most `limit`.
    pub fn wait_for(&mut self, expr: &str, limit: Duration) {
        let t0 = Instant::now();
        loop {
            let r = self.call(
                "Runtime.evaluate",
                json!({"expression": format!("Boolean({expr})"), "returnByValue": true}),
            );
            if r["result"]["value"] == true {
                return;
            }
            assert!(
                t0.elapsed() < limit,
                "not true within {limit:?}: {expr}; page text: {}",
                self.eval("document.body ? document.body.innerText : ''")
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Types `text` into the focused element, as keystrokes would.
    pub fn type_text(&mut self, text: &str) {
        self.call("Input.insertText", json!({"text": text}));
    }

    /// Presses a key (`Enter`, `Tab`, `Escape`) on the focused element.
    pub fn press(&mut self, key: &str, code: u32) {
        for kind in ["keyDown", "keyUp"] {
            let mut p = json!({"type": kind, "key": key, "code": key,
                "windowsVirtualKeyCode": code, "nativeVirtualKeyCode": code});
            if kind == "keyDown" && key == "Enter" {
                p["text"] = json!("\r");
            }
            self.call("Input.dispatchKeyEvent", p);
        }
    }

    /// Saves a PNG of the page at `path`.
    pub fn screenshot(&mut self, path: &Path) {
        let r = self.call("Page.captureScreenshot", json!({"format": "png"}));
        let data = decode_base64(r["data"].as_str().unwrap());
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(path, data).unwrap();
    }
}

impl Drop for Browser {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.profile);
    }
}

/// Where screenshots are kept: `target/tmp/artifacts/` (kept after the run).
pub fn artifact(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join("artifacts")
        .join(name)
}

fn decode_base64(s: &str) -> Vec<u8> {
    let val = |c: u8| -> u32 {
        match c {
            b'A'..=b'Z' => u32::from(c - b'A'),
            b'a'..=b'z' => u32::from(c - b'a') + 26,
            b'0'..=b'9' => u32::from(c - b'0') + 52,
            b'+' => 62,
            b'/' => 63,
            _ => panic!("not base64: {c}"),
        }
    };
    let bytes: Vec<u8> = s.bytes().filter(|&c| c != b'=' && c != b'\n').collect();
    let mut out = Vec::with_capacity(bytes.len() * 3 / 4);
    for chunk in bytes.chunks(4) {
        let mut n = 0u32;
        for (i, &c) in chunk.iter().enumerate() {
            n |= val(c) << (18 - 6 * i);
        }
        let k = chunk.len() - 1;
        for i in 0..k {
            out.push((n >> (16 - 8 * i)) as u8);
        }
    }
    out
}
