//! The report of a serving benchmark (`tp bench serve`): a JSON line per measured level and
//! the table of every level with its throughput against one client's, from the [`Level`]s
//! [`crate::load::drive`] measured.

use crate::load::{percentile, Level, Workload};
use serde_json::json;

/// What was measured: the workload, the requests per level and the KV budget.
#[derive(Clone, Copy, Debug)]
pub struct BenchShape {
    pub workload: Workload,
    /// Requests per level are `rounds x concurrency` (at least 8).
    pub rounds: usize,
    /// The KV budget in full contexts per rank (`None`: the default budget).
    pub kv_contexts: Option<usize>,
}

/// The levels of one server: `(tp, [(prefix cache on, level)])`.
pub type Measured = (usize, Vec<(bool, Level)>);

fn on_off(on: bool) -> &'static str {
    if on {
        "on"
    } else {
        "off"
    }
}

/// One level as a JSON line (times in ms).
pub fn level_json(tp: usize, prefix_cache: bool, l: &Level, shape: &BenchShape) -> String {
    let w = &shape.workload;
    json!({
        "tp": tp,
        "prefix_cache": prefix_cache,
        "system_prompt_tokens": w.system_prompt_tokens,
        "kv_contexts": shape.kv_contexts,
        "concurrency": l.concurrency,
        "requests": l.requests,
        "prompt_tokens": w.prompt_tokens,
        "gen_tokens": w.gen_tokens,
        "output_tok_s": (l.throughput() * 10.0).round() / 10.0,
        "ttft_p50_ms": percentile(&l.ttft, 50.0) * 1e3,
        "ttft_p99_ms": percentile(&l.ttft, 99.0) * 1e3,
        "tpot_p50_ms": percentile(&l.tpot, 50.0) * 1e3,
        "tpot_p99_ms": percentile(&l.tpot, 99.0) * 1e3,
    })
    .to_string()
}

/// The progress line of one level.
pub fn level_line(tp: usize, prefix_cache: bool, l: &Level) -> String {
    format!(
        "# tp {tp} prefix cache {} concurrency {}: {:.1} tok/s",
        on_off(prefix_cache),
        l.concurrency,
        l.throughput()
    )
}

/// The table of every level, under a header naming the CPU (`cpu`, with its kernel path) and
/// the workload; each row's throughput against the one-client level of its server.
pub fn table(all: &[Measured], shape: &BenchShape, cpu: &str) -> String {
    use std::fmt::Write as _;
    let w = &shape.workload;
    let mut out = format!("# CPU: {cpu}\n");
    let _ = writeln!(
        out,
        "# tp bench serve: streaming completions, ~{} prompt + {} generated tokens each (EOS ignored), greedy; requests per level = {} x concurrency (at least 8)",
        w.prompt_tokens, w.gen_tokens, shape.rounds
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
    let _ = writeln!(
        out,
        "{:>3}  {:>6}  {:>5}  {:>8}  {:>12}  {:>13}  {:>13}  {:>13}  {:>13}  {:>8}",
        "tp",
        "prefix",
        "conc",
        "requests",
        "output t/s",
        "TTFT p50 ms",
        "TTFT p99 ms",
        "TPOT p50 ms",
        "TPOT p99 ms",
        "vs c=1"
    );
    for (tp, levels) in all {
        for (prefix_cache, l) in levels {
            let base = levels
                .iter()
                .find(|(p, b)| b.concurrency == 1 && p == prefix_cache)
                .map(|(_, b)| b.throughput());
            let ratio = base.map_or(String::from("-"), |b| format!("{:.2}x", l.throughput() / b));
            let _ = writeln!(
                out,
                "{:>3}  {:>6}  {:>5}  {:>8}  {:>12.1}  {:>13.1}  {:>13.1}  {:>13.2}  {:>13.2}  {:>8}",
                tp,
                on_off(*prefix_cache),
                l.concurrency,
                l.requests,
                l.throughput(),
                percentile(&l.ttft, 50.0) * 1e3,
                percentile(&l.ttft, 99.0) * 1e3,
                percentile(&l.tpot, 50.0) * 1e3,
                percentile(&l.tpot, 99.0) * 1e3,
                ratio
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
            },
            rounds: 4,
            kv_contexts: Some(2),
        };
        let all = vec![(2, vec![(true, level(1, 100)), (true, level(4, 250))])];
        let t = table(&all, &shape, "test cpu");
        assert!(t.starts_with("# CPU: test cpu\n"), "{t}");
        assert!(t.contains("# KV budget: 2 full contexts per rank"), "{t}");
        assert!(t.contains("2.50x") && t.contains("1.00x"), "{t}");
        let j: serde_json::Value =
            serde_json::from_str(&level_json(2, true, &all[0].1[1].1, &shape)).unwrap();
        assert_eq!(j["concurrency"], 4);
        assert_eq!(j["kv_contexts"], 2);
    }
}
