//! `tp serve --backend mpi` under mpirun (2 processes): answers what the local backend's
//! `tp generate --tp 2` gives, and SIGTERM to rank 0 drains, releases the follower process
//! and ends the job with exit code 0.
#![cfg(feature = "mpi")]

mod serve_util;

use serde_json::json;
use serve_util::{chat_body, read_stream, ServerProc, TP};
use std::path::Path;
use std::time::Duration;

/// SIGTERM to rank 0 (its pid is printed with the address), not to mpirun: the job ends with
/// exit code 0.
fn terminate_rank0(server: &mut ServerProc) {
    let pid = server
        .rank0_pid
        .expect("the pid of rank 0 in the listening line");
    let ok = std::process::Command::new("kill")
        .args(["-TERM", &pid.to_string()])
        .status()
        .is_ok_and(|s| s.success());
    assert!(ok);
    let status = server.wait(Duration::from_secs(60));
    assert_eq!(status.code(), Some(0), "{}", server.stderr());
}

/// The admin key of the reload tests' servers.
const ADMIN_KEY: &str = "mpi-admin-key";

/// `tp serve --backend mpi` of `model` under mpirun (2 processes) with an admin key and
/// `extra` flags.
fn admin_server_under_mpirun(model: &Path, extra: &[&str]) -> ServerProc {
    let mpirun = tp_testkit::require_mpirun();
    let mpirun = mpirun.to_str().expect("a UTF-8 path to mpirun");
    let [root, oversubscribe] = tp_testkit::process::MPIRUN_FLAGS;
    let mut flags = vec![
        "--backend",
        "mpi",
        "--ctx-size",
        "256",
        "--admin-key",
        ADMIN_KEY,
    ];
    flags.extend_from_slice(extra);
    ServerProc::start_with(mpirun, &[root, oversubscribe, "-n", "2", TP], model, &flags)
}

/// The server's greedy completion of one prompt (12 tokens).
fn complete(server: &ServerProc) -> String {
    let body = json!({"prompt": "The capital of France is", "max_tokens": 12, "temperature": 0});
    let r = server.client.post_json("/v1/completions", &body).unwrap();
    assert_eq!(r.status, 200, "{}", r.text());
    r.json()["choices"][0]["text"].as_str().unwrap().to_string()
}

#[test]
fn serve_under_mpirun_answers_and_stops_cleanly() {
    let Some(model) = tp_testkit::smollm2() else {
        return;
    };
    let mpirun = tp_testkit::require_mpirun();
    let mpirun = mpirun.to_str().expect("a UTF-8 path to mpirun");
    let [root, oversubscribe] = tp_testkit::process::MPIRUN_FLAGS;
    let mut server = ServerProc::start_with(
        mpirun,
        &[root, oversubscribe, "-n", "2", TP],
        &model,
        &["--backend", "mpi", "--ctx-size", "256"],
    );
    let prompt = "Name a primary color.";
    let r = server
        .client
        .post_json("/v1/chat/completions", &chat_body(prompt, 12, json!({})))
        .unwrap();
    assert_eq!(r.status, 200, "{}", r.text());
    let text = r.json()["choices"][0]["message"]["content"]
        .as_str()
        .unwrap()
        .to_string();
    let s = read_stream(
        &server.client,
        "/v1/chat/completions",
        &chat_body(prompt, 12, json!({"stream": true})),
    );
    assert_eq!(s.text, text);
    let generated = std::process::Command::new(TP)
        .arg("generate")
        .arg("--model")
        .arg(&model)
        .args([
            "--tp",
            "2",
            "--ctx-size",
            "256",
            "--greedy",
            "--chat",
            "--quiet",
        ])
        .args(["--max-tokens", "12", prompt])
        .output()
        .expect("tp generate");
    assert!(generated.status.success());
    let reference = String::from_utf8_lossy(&generated.stdout);
    assert_eq!(reference.strip_suffix('\n').unwrap_or(&reference), text);

    terminate_rank0(&mut server);
}

/// `tp serve --backend mpi --admin-key` under mpirun (2 processes): a reload loads the model
/// on both processes (the follower learns the load, adopt and select commands from the step
/// protocol) and traffic switches with the same answers (the same file: what this checks is
/// that every rank loads, adopts and selects in step, not a change of answers, which the
/// tp-serve tests check with two models at tp 2); a path that is no model is refused with
/// 400 and the live model keeps serving; a rollback switches back; SIGTERM still ends the
/// job with exit code 0.
#[test]
fn reload_under_mpirun_switches_every_rank() {
    let Some(model) = tp_testkit::smollm2() else {
        return;
    };
    let mut server = admin_server_under_mpirun(&model, &[]);
    let admin = server.client.clone().with_api_key(ADMIN_KEY);
    let before = complete(&server);
    let r = admin
        .post_json(
            "/admin/reload",
            &json!({"path": model.to_str().expect("a UTF-8 model path")}),
        )
        .unwrap();
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.json()["live"]["id"], 1, "{}", r.text());
    assert_eq!(complete(&server), before);
    let r = admin
        .post_json("/admin/reload", &json!({"path": "/no/such/model.gguf"}))
        .unwrap();
    assert_eq!(r.status, 400, "{}", r.text());
    assert!(r.text().contains("/no/such/model.gguf"), "{}", r.text());
    assert_eq!(complete(&server), before);
    let r = admin.post("/admin/rollback", b"").unwrap();
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.json()["live"]["id"], 0, "{}", r.text());
    assert_eq!(complete(&server), before);
    terminate_rank0(&mut server);
}

/// `tp serve --backend mpi --swap drain` under mpirun (2 processes): a reload drains and
/// replaces the model in place on both processes (the follower frees its shard and loads
/// the new one on the step protocol's `Replace`), with the same answers (the same file: what
/// this checks is that both processes replace in step); a rollback drains back to the first
/// model, loaded again from its path; SIGTERM still ends the job with exit code 0.
#[test]
fn a_drain_swap_under_mpirun_replaces_the_model_on_every_rank() {
    let Some(model) = tp_testkit::smollm2() else {
        return;
    };
    let mut server = admin_server_under_mpirun(&model, &["--swap", "drain"]);
    let admin = server.client.clone().with_api_key(ADMIN_KEY);
    let before = complete(&server);
    let r = admin
        .post_json(
            "/admin/reload",
            &json!({"path": model.to_str().expect("a UTF-8 model path")}),
        )
        .unwrap();
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.json()["swap"], "drain", "{}", r.text());
    assert_eq!(r.json()["live"]["id"], 1, "{}", r.text());
    assert_eq!(complete(&server), before);
    let r = admin.post("/admin/rollback", b"").unwrap();
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.json()["live"]["id"], 2, "{}", r.text());
    assert!(r.json()["drained"].is_object(), "{}", r.text());
    assert_eq!(complete(&server), before);
    terminate_rank0(&mut server);
}

/// `tp serve --backend mpi --pp 2` under mpirun (one stage a process, commands point to
/// point): 4 requests at once get the texts each gets alone, steps were in flight on both
/// stages at once (`tp_pipelined_steps_total`), and SIGTERM ends the job with exit code 0.
#[test]
fn serve_at_pp_2_under_mpirun_keeps_both_stages_busy_and_every_text() {
    let Some(model) = tp_testkit::smollm2() else {
        return;
    };
    let mut server = admin_server_under_mpirun(&model, &["--pp", "2"]);
    let prompts = [
        "The capital of France is",
        "Water boils at",
        "def add(a, b):",
        "Three primary colors are",
    ];
    let ask = |p: &str| -> String {
        let body = json!({"prompt": p, "max_tokens": 12, "temperature": 0});
        let r = server.client.post_json("/v1/completions", &body).unwrap();
        assert_eq!(r.status, 200, "{}", r.text());
        r.json()["choices"][0]["text"].as_str().unwrap().to_string()
    };
    let alone: Vec<String> = prompts.iter().map(|p| ask(p)).collect();
    let together: Vec<String> = std::thread::scope(|s| {
        let handles: Vec<_> = prompts
            .iter()
            .map(|p| {
                let ask = &ask;
                s.spawn(move || ask(p))
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (i, p) in prompts.iter().enumerate() {
        assert!(alone[i].len() > 3, "{p}: {:?}", alone[i]);
        assert_eq!(together[i], alone[i], "{p}: differs under load at pp 2");
    }
    let pipelined = server.metric("tp_pipelined_steps_total").unwrap_or(0.0);
    assert!(pipelined >= 3.0, "{pipelined} pipelined steps");
    terminate_rank0(&mut server);
}

/// The processes whose parent is `pid` (from /proc: no procps needed).
fn children_of(pid: u32) -> Vec<u32> {
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    dir.filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter(|p| {
            // /proc/P/stat: "P (comm) state ppid ...": the comm may hold spaces.
            std::fs::read_to_string(format!("/proc/{p}/stat"))
                .ok()
                .and_then(|s| {
                    let rest = &s[s.rfind(')')? + 1..];
                    rest.split_whitespace().nth(1)?.parse::<u32>().ok()
                })
                == Some(pid)
        })
        .collect()
}

/// A stage that stops answering under `tp serve --pp 2` (its process stopped by SIGSTOP):
/// the request in progress fails within the collective deadline (4 s here) with an error
/// naming stage 0, rank 1 and its host; `/health` then answers 503 with that error and
/// `tp_engine_healthy` is 0 while the server lingers; SIGTERM ends the job, not with 0.
#[test]
fn a_stalled_stage_under_mpirun_is_named_and_the_server_says_unhealthy() {
    let Some(model) = tp_testkit::smollm2() else {
        return;
    };
    let flags = ["--pp", "2", "--timeout", "4", "--unhealthy-linger", "120"];
    let mut server = admin_server_under_mpirun(&model, &flags);
    assert!(!complete(&server).is_empty());
    assert_eq!(server.client.get("/health").unwrap().status, 200);
    let rank0 = server.rank0_pid.expect("rank 0's pid");
    let follower = children_of(server.child.id())
        .into_iter()
        .find(|&p| p != rank0)
        .expect("the process of rank 1 under mpirun");
    let signal = |sig: &str| {
        let ok = std::process::Command::new("kill")
            .args([sig, &follower.to_string()])
            .status()
            .is_ok_and(|s| s.success());
        assert!(ok, "kill {sig} {follower}");
    };
    signal("-STOP");
    let t0 = std::time::Instant::now();
    let body = json!({"prompt": "The capital of France is", "max_tokens": 12, "temperature": 0});
    let r = server.client.post_json("/v1/completions", &body).unwrap();
    let took = t0.elapsed();
    signal("-CONT");
    assert!(r.status >= 500, "{} {}", r.status, r.text());
    // The stage, then the collective's own words.
    let message = r.json()["error"]["message"]
        .as_str()
        .unwrap_or("")
        .to_string();
    assert!(
        message.contains("pipeline stage 0 of 2 (rank 1 on ") && message.contains("timed out"),
        "{message}"
    );
    assert!(took < Duration::from_secs(30), "the failure took {took:?}");
    let h = server.client.get("/health").unwrap();
    assert_eq!(h.status, 503, "{}", h.text());
    let h = h.json();
    assert_eq!(h["status"], "unhealthy", "{h}");
    assert!(
        h["error"]
            .as_str()
            .is_some_and(|e| e.contains("pipeline stage 0 of 2 (rank 1 on ")),
        "{h}"
    );
    assert_eq!(server.metric("tp_engine_healthy"), Some(0.0));
    let later = server.client.post_json("/v1/completions", &body).unwrap();
    assert_eq!(later.status, 503, "{}", later.text());
    assert!(later.text().contains("engine_failed"), "{}", later.text());
    let ok = std::process::Command::new("kill")
        .args(["-TERM", &rank0.to_string()])
        .status()
        .is_ok_and(|s| s.success());
    assert!(ok);
    let status = server.wait(Duration::from_secs(60));
    assert_ne!(status.code(), Some(0), "{}", server.stderr());
}
