//! The canary against a synthetic model at tp 2: a canary written from the server passes when
//! run against it (at start and then periodically, shown on `/dashboard.json` and `/metrics`);
//! one whose expected continuation or mean log-probability differs raises the drift alarm.

mod common;

use common::{config, metric, with_server};
use std::time::{Duration, Instant};
use tp_serve::canary::{self, Canary, CanaryConfig};
use tp_serve::client::Client;
use tp_serve::ServeConfig;

const CTX: usize = 256;

fn prompts() -> Vec<String> {
    ["hello there", "the quick brown fox", "1 2 3"]
        .iter()
        .map(|s| s.to_string())
        .collect()
}

/// Serves with `canary` run every 200 ms; returns the dashboard's canary status after at
/// least 2 runs and the `tp_canary_drift` metric.
fn served_with(canary: Canary) -> (serde_json::Value, f64) {
    let cfg = ServeConfig {
        canary: Some(CanaryConfig {
            canary,
            interval: Duration::from_millis(200),
            threshold: canary::DEFAULT_THRESHOLD,
        }),
        ..config()
    };
    with_server(2, CTX, cfg, |ready| {
        let c = Client::new(ready.addr);
        let t0 = Instant::now();
        loop {
            let d = c.get("/dashboard.json").unwrap().json();
            if d["canary"]["runs"].as_u64().unwrap_or(0) >= 2 {
                return (d["canary"].clone(), metric(&c, "tp_canary_drift"));
            }
            assert!(
                t0.elapsed() < Duration::from_secs(20),
                "the canary did not run: {d}"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    })
    .1
}

#[test]
fn a_canary_passes_on_its_model_and_raises_drift_when_it_differs() {
    let written = with_server(2, CTX, config(), |ready| {
        canary::record(&Client::new(ready.addr), &prompts(), 8).unwrap()
    })
    .1;
    assert_eq!(written.cases.len(), 3);
    for case in &written.cases {
        // The synthetic model is sure of its tokens: log-probabilities of about 0.
        assert!(
            case.mean_logprob <= 0.0 && !case.expected.is_empty(),
            "{case:?}"
        );
    }
    // Through its file form.
    let path = std::env::temp_dir().join(format!("tp-canary-{}.jsonl", std::process::id()));
    std::fs::write(&path, written.to_jsonl()).unwrap();
    let loaded = Canary::load(&path).unwrap();
    let _ = std::fs::remove_file(&path);
    assert_eq!(loaded.cases.len(), written.cases.len());
    for (a, b) in loaded.cases.iter().zip(&written.cases) {
        assert_eq!(
            (&a.prompt, &a.expected, a.max_tokens),
            (&b.prompt, &b.expected, b.max_tokens)
        );
        // JSON's decimal form of an f64 may come back one ulp away.
        assert!(
            (a.mean_logprob - b.mean_logprob).abs() <= 1e-12,
            "{a:?} {b:?}"
        );
    }

    let (status, drift) = served_with(loaded.clone());
    assert_eq!(status["drift"], false, "{status}");
    assert_eq!(status["failures"], 0, "{status}");
    assert_eq!(drift, 0.0);

    // Another continuation expected for the second case.
    let mut text = loaded.clone();
    text.cases[1].expected.push('!');
    let (status, drift) = served_with(text);
    assert_eq!(status["drift"], true, "{status}");
    assert_eq!(status["mismatches"], 1, "{status}");
    assert!(
        status["detail"].as_str().unwrap().contains("case 2"),
        "{status}"
    );
    assert_eq!(drift, 1.0);

    // The same text, with a mean log-probability 0.5 nats per token away.
    let mut shifted = loaded;
    shifted.cases[0].mean_logprob -= 0.5;
    let (status, drift) = served_with(shifted);
    assert_eq!(status["drift"], true, "{status}");
    assert_eq!(status["mismatches"], 0, "{status}");
    let shift = status["max_logprob_shift"].as_f64().unwrap();
    assert!((shift - 0.5).abs() < 1e-3, "{status}");
    assert_eq!(drift, 1.0);
}
