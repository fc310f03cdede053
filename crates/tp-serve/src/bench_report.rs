//! The report of a serving benchmark (`tp bench serve`): a JSON line per measured level and
//! the table of every level with its throughput against one client's (and, with speculative
//! decoding, against the same level without it), from the [`Level`]s [`crate::load::drive`]
//! measured.

use crate::bench_ranks::{ranks_json, RankLevel};
use crate::load::{percentile, Level, Prompts, Workload};
use serde_json::json;

/// What was measured: the workload, the requests per level and the KV budget.
#[derive(Clone, Debug)]
pub struct BenchShape {
    pub workload: Workload,
    /// Requests per level are `rounds x concurrency` (at least 8).
    pub rounds: usize,
    /// The KV budget in full contexts per rank (`None`: the default budget).
    pub kv_contexts: Option<usize>,
    /// Pipeline stages of each server (each of a row's tp ranks); 1 without pipelining.
    pub pp: usize,
    /// Expert groups of each server's tp ranks (`--ep`); 1 for expert-TP or a dense model.
    pub ep: usize,
    /// A server started elsewhere (its address) that every row measured, instead of servers
    /// started at each tp.
    pub server: Option<String>,
}

/// How a server of the bench was set up beside its tp.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Variant {
    pub prefix_cache: bool,
    /// The drafter of speculative decoding (`ngram`, a draft model's name), `None` when off.
    pub spec: Option<String>,
}

/// One measured level of one server.
pub struct Run {
    pub variant: Variant,
    pub level: Level,
    /// With speculative decoding: accepted over drafted tokens during the level (`None`
    /// without speculation or when nothing was drafted).
    pub acceptance: Option<f64>,
    /// Each rank's compute and expert rows during the level (empty when the server's
    /// dashboard could not be read).
    pub ranks: Vec<RankLevel>,
}

/// The levels of one tp's servers: `(tp, runs)`; the tp is `None` for a server started
/// elsewhere ([`BenchShape::server`]).
pub type Measured = (Option<usize>, Vec<Run>);

fn on_off(on: bool) -> &'static str {
    if on {
        "on"
    } else {
        "off"
    }
}

/// One level as a JSON line (times in ms).
pub fn level_json(tp: Option<usize>, r: &Run, shape: &BenchShape) -> String {
    let (w, l) = (&shape.workload, &r.level);
    json!({
        "tp": tp,
        "pp": tp.map(|_| shape.pp),
        "ep": tp.map(|_| shape.ep),
        "server": shape.server,
        "prefix_cache": r.variant.prefix_cache,
        "spec": r.variant.spec,
        "spec_acceptance": r.acceptance,
        "system_prompt_tokens": w.system_prompt_tokens,
        "kv_contexts": shape.kv_contexts,
        "concurrency": l.concurrency,
        "requests": l.requests,
        "prompts": w.prompts.name(),
        "prompt_tokens": w.prompt_tokens,
        "gen_tokens": w.gen_tokens,
        "output_tok_s": (l.throughput() * 10.0).round() / 10.0,
        "ttft_p50_ms": percentile(&l.ttft, 50.0) * 1e3,
        "ttft_p99_ms": percentile(&l.ttft, 99.0) * 1e3,
        "tpot_p50_ms": percentile(&l.tpot, 50.0) * 1e3,
        "tpot_p99_ms": percentile(&l.tpot, 99.0) * 1e3,
        "ranks": ranks_json(&r.ranks),
    })
    .to_string()
}

/// The progress line of one level.
pub fn level_line(tp: Option<usize>, shape: &BenchShape, r: &Run) -> String {
    let (pp, ep) = (shape.pp, shape.ep);
    let layout = match tp {
        None => "the server".to_string(),
        Some(tp) if pp > 1 => format!("pp {pp} x tp {tp}"),
        Some(tp) => format!("tp {tp}"),
    };
    let layout = match (tp, ep) {
        (Some(_), ep) if ep > 1 => format!("{layout} ep {ep}"),
        _ => layout,
    };
    format!(
        "# {layout} prefix cache {} speculation {} concurrency {}: {:.1} tok/s",
        on_off(r.variant.prefix_cache),
        r.variant.spec.as_deref().unwrap_or("off"),
        r.level.concurrency,
        r.level.throughput()
    )
}

/// A ratio of throughputs, `-` without a base.
fn ratio(l: &Level, base: Option<&Level>) -> String {
    base.map_or(String::from("-"), |b| {
        format!("{:.2}x", l.throughput() / b.throughput())
    })
}

/// The table of every level, under a header naming the CPU (`cpu`, with its kernel path) and
/// the workload; each row's throughput against the one-client level of its server.
pub fn table(all: &[Measured], shape: &BenchShape, cpu: &str) -> String {
    use std::fmt::Write as _;
    let w = &shape.workload;
    let mut out = format!("# CPU: {cpu}\n");
    let prompt = match w.prompts {
        Prompts::Words => format!("~{} prompt", w.prompt_tokens),
        Prompts::Edit => "a code-edit prompt".to_string(),
    };
    let _ = writeln!(
        out,
        "# tp bench serve: streaming completions, {prompt} + {} generated tokens each (EOS ignored), greedy; requests per level = {} x concurrency (at least 8)",
        w.gen_tokens, shape.rounds
    );
    if w.system_prompt_tokens > 0 {
        let _ = writeln!(
            out,
            "# every request begins with the same ~{}-token system prompt",
            w.system_prompt_tokens
        );
    }
    if let Some(k) = shape.kv_contexts {
        let _ = writeln!(out, "# KV budget: {k} full contexts per rank");
    }
    if shape.pp > 1 {
        let _ = writeln!(
            out,
            "# pipeline: {} stages of each row's tp ranks (pp x tp ranks in all)",
            shape.pp
        );
    }
    if shape.ep > 1 {
        let _ = writeln!(
            out,
            "# experts: {} expert groups of each row's tp ranks (whole experts per group)",
            shape.ep
        );
    }
    if let Some(addr) = &shape.server {
        let _ = writeln!(
            out,
            "# the server at {addr}, started elsewhere (its layout and settings are its own; prefix and spec say what was asked of it)"
        );
    }
    let spec = all
        .iter()
        .flat_map(|(_, r)| r)
        .any(|r| r.variant.spec.is_some());
    let _ = write!(
        out,
        "{:>3}  {:>6}  {:>8}  {:>5}  {:>8}  {:>12}  {:>13}  {:>13}  {:>13}  {:>13}  {:>8}",
        "tp",
        "prefix",
        "spec",
        "conc",
        "requests",
        "output t/s",
        "TTFT p50 ms",
        "TTFT p99 ms",
        "TPOT p50 ms",
        "TPOT p99 ms",
        "vs c=1"
    );
    let _ = if spec {
        writeln!(out, "  {:>8}  {:>10}", "accepted", "vs no spec")
    } else {
        writeln!(out)
    };
    for (tp, runs) in all {
        for r in runs {
            let (v, l) = (&r.variant, &r.level);
            let alone = runs
                .iter()
                .find(|b| b.level.concurrency == 1 && b.variant == *v)
                .map(|b| &b.level);
            let _ = write!(
                out,
                "{:>3}  {:>6}  {:>8}  {:>5}  {:>8}  {:>12.1}  {:>13.1}  {:>13.1}  {:>13.2}  {:>13.2}  {:>8}",
                tp.map_or("-".to_string(), |t| t.to_string()),
                on_off(v.prefix_cache),
                v.spec.as_deref().unwrap_or("off"),
                l.concurrency,
                l.requests,
                l.throughput(),
                percentile(&l.ttft, 50.0) * 1e3,
                percentile(&l.ttft, 99.0) * 1e3,
                percentile(&l.tpot, 50.0) * 1e3,
                percentile(&l.tpot, 99.0) * 1e3,
                ratio(l, alone)
            );
            if !spec {
                let _ = writeln!(out);
                continue;
            }
            // The same server without speculation at the same concurrency.
            let plain = runs
                .iter()
                .find(|b| {
                    b.level.concurrency == l.concurrency
                        && b.variant.spec.is_none()
                        && b.variant.prefix_cache == v.prefix_cache
                })
                .map(|b| &b.level);
            let _ = writeln!(
                out,
                "  {:>8}  {:>10}",
                r.acceptance
                    .map_or(String::from("-"), |a| format!("{:.0}%", a * 100.0)),
                if v.spec.is_some() {
                    ratio(l, plain)
                } else {
                    String::from("-")
                }
            );
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn level(c: usize, tokens: usize) -> Level {
        Level {
            concurrency: c,
            requests: 8,
            tokens,
            wall: 1.0,
            ttft: vec![0.01, 0.02],
            tpot: vec![0.005, 0.006],
        }
    }

    #[test]
    fn the_table_compares_each_level_with_one_client_of_its_server() {
        let shape = BenchShape {
            workload: Workload {
                prompt_tokens: 64,
                gen_tokens: 64,
                system_prompt_tokens: 0,
                prompts: Prompts::Words,
            },
            rounds: 4,
            kv_contexts: Some(2),
            pp: 1,
            ep: 1,
            server: None,
        };
        let run = |spec: Option<&str>, l: Level, acceptance: Option<f64>| Run {
            variant: Variant {
                prefix_cache: true,
                spec: spec.map(String::from),
            },
            level: l,
            acceptance,
            ranks: Vec::new(),
        };
        let all = vec![(
            Some(2),
            vec![
                run(None, level(1, 100), None),
                run(None, level(4, 250), None),
            ],
        )];
        let t = table(&all, &shape, "test cpu");
        assert!(t.starts_with("# CPU: test cpu\n"), "{t}");
        assert!(t.contains("# KV budget: 2 full contexts per rank"), "{t}");
        assert!(t.contains("2.50x") && t.contains("1.00x"), "{t}");
        assert!(!t.contains("vs no spec"), "{t}");
        let j: serde_json::Value =
            serde_json::from_str(&level_json(Some(2), &all[0].1[1], &shape)).unwrap();
        assert_eq!(j["concurrency"], 4);
        assert_eq!(j["kv_contexts"], 2);
        assert_eq!(j["spec"], serde_json::Value::Null);
        // With a drafter: each speculating level against the same level without it.
        let all = vec![(
            Some(1),
            vec![
                run(None, level(1, 100), None),
                run(None, level(4, 200), None),
                run(Some("ngram"), level(1, 150), Some(0.5)),
                run(Some("ngram"), level(4, 260), Some(0.25)),
            ],
        )];
        let t = table(&all, &shape, "test cpu");
        let rows: Vec<&str> = t.lines().filter(|l| l.contains("ngram")).collect();
        assert_eq!(rows.len(), 2, "{t}");
        assert!(rows[0].ends_with("50%       1.50x"), "{t}");
        assert!(
            rows[1].contains("1.73x") && rows[1].ends_with("25%       1.30x"),
            "{t}"
        );
        let j: serde_json::Value =
            serde_json::from_str(&level_json(Some(1), &all[0].1[3], &shape)).unwrap();
        assert_eq!(
            (j["spec"].as_str(), j["spec_acceptance"].as_f64()),
            (Some("ngram"), Some(0.25))
        );
        // Pipelined servers, and a server started elsewhere.
        let piped = BenchShape {
            pp: 2,
            ..shape.clone()
        };
        let t = table(&all, &piped, "test cpu");
        assert!(
            t.contains("# pipeline: 2 stages of each row's tp ranks"),
            "{t}"
        );
        assert!(level_line(Some(1), &piped, &all[0].1[0]).starts_with("# pp 2 x tp 1 prefix"));
        let grouped = BenchShape {
            ep: 2,
            ..shape.clone()
        };
        assert!(level_line(Some(2), &grouped, &all[0].1[0]).starts_with("# tp 2 ep 2 prefix"));
        assert!(table(&all, &grouped, "cpu").contains("# experts: 2 expert groups"));
        let elsewhere = BenchShape {
            server: Some("10.0.0.1:8080".into()),
            ..shape.clone()
        };
        let all = vec![(None, vec![run(None, level(1, 100), None)])];
        let t = table(&all, &elsewhere, "test cpu");
        assert!(
            t.contains("# the server at 10.0.0.1:8080, started elsewhere"),
            "{t}"
        );
        assert!(
            t.lines().last().unwrap().trim_start().starts_with("-  "),
            "{t}"
        );
        let j: serde_json::Value =
            serde_json::from_str(&level_json(None, &all[0].1[0], &elsewhere)).unwrap();
        assert_eq!(
            (j["tp"].clone(), j["server"].as_str()),
            (serde_json::Value::Null, Some("10.0.0.1:8080"))
        );
    }
}
