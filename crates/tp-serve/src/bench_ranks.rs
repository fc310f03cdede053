//! The ranks' side of a `tp bench serve` level, read from the server's `/dashboard.json`
//! before and after it: each rank's compute per engine step, the share of the level it spent
//! computing, and the expert rows it ran (its experts' load under a mixture of experts), so a
//! table of layouts says why one wins (e.g. whole experts per rank leave one rank busier).

use crate::client::Client;
use serde_json::{json, Value};

/// The server's running totals at one moment.
#[derive(Clone, Debug, PartialEq)]
pub struct Snapshot {
    /// Engine steps so far.
    pub steps: f64,
    /// Each rank's `(compute seconds, expert rows)` so far, by rank.
    pub ranks: Vec<(f64, f64)>,
    /// How often the server collects the ranks' figures: a reading lags by up to this.
    pub poll_seconds: f64,
}

impl Snapshot {
    /// From the dashboard's JSON; `None` when it lacks the fields (another server).
    pub fn from_json(v: &Value) -> Option<Snapshot> {
        let ranks = v["ranks"]
            .as_array()?
            .iter()
            .map(|r| {
                Some((
                    r["compute_seconds_total"].as_f64()?,
                    r["expert_rows_total"].as_f64().unwrap_or(0.0),
                ))
            })
            .collect::<Option<Vec<_>>>()?;
        Some(Snapshot {
            steps: v["server"]["steps"].as_f64()?,
            ranks,
            poll_seconds: v["poll_interval_seconds"].as_f64().unwrap_or(1.0),
        })
    }

    /// The server's `/dashboard.json` now; `None` when it cannot be read or lacks the fields
    /// (the bench then prints no rank line).
    pub fn read(client: &Client) -> Option<Snapshot> {
        let r = client.get("/dashboard.json").ok()?;
        (r.status == 200).then(|| Snapshot::from_json(&r.json()))?
    }
}

/// One rank over one level.
#[derive(Clone, Debug, PartialEq)]
pub struct RankLevel {
    pub rank: usize,
    pub compute_ms_per_step: f64,
    /// Compute seconds over the level's wall time.
    pub busy: f64,
    /// Expert rows it ran (0 for a dense model).
    pub expert_rows: f64,
}

/// Each rank's figures between `before` and `after` a level of `wall` seconds; empty when
/// the rank counts differ or no step ran.
pub fn level_ranks(before: &Snapshot, after: &Snapshot, wall: f64) -> Vec<RankLevel> {
    let steps = after.steps - before.steps;
    if steps <= 0.0 || before.ranks.len() != after.ranks.len() {
        return Vec::new();
    }
    before
        .ranks
        .iter()
        .zip(&after.ranks)
        .enumerate()
        .map(|(rank, (b, a))| RankLevel {
            rank,
            compute_ms_per_step: (a.0 - b.0) * 1e3 / steps,
            busy: (a.0 - b.0) / wall.max(1e-9),
            expert_rows: a.1 - b.1,
        })
        .collect()
}

/// The busiest rank's expert rows over the mean (1 when balanced; `None` without experts).
pub fn expert_imbalance(ranks: &[RankLevel]) -> Option<f64> {
    let total: f64 = ranks.iter().map(|r| r.expert_rows).sum();
    if total <= 0.0 {
        return None;
    }
    let most = ranks.iter().map(|r| r.expert_rows).fold(0.0, f64::max);
    Some(most * ranks.len() as f64 / total)
}

/// `# ranks at concurrency C: rank 0 42.4 ms compute/step (busy 71%), 63104 expert rows;
/// ...; busiest rank's expert rows 1.05x the mean`.
pub fn ranks_line(concurrency: usize, ranks: &[RankLevel]) -> String {
    let each: Vec<String> = ranks
        .iter()
        .map(|r| {
            let rows = if r.expert_rows > 0.0 {
                format!(", {:.0} expert rows", r.expert_rows)
            } else {
                String::new()
            };
            format!(
                "rank {} {:.1} ms compute/step (busy {:.0}%){rows}",
                r.rank,
                r.compute_ms_per_step,
                100.0 * r.busy
            )
        })
        .collect();
    let imbalance = expert_imbalance(ranks).map_or(String::new(), |x| {
        format!("; busiest rank's expert rows {x:.2}x the mean")
    });
    format!(
        "# ranks at concurrency {concurrency}: {}{imbalance}",
        each.join("; ")
    )
}

/// The ranks of a level as JSON (`[{rank, compute_ms_per_step, busy, expert_rows}]`).
pub fn ranks_json(ranks: &[RankLevel]) -> Value {
    Value::Array(
        ranks
            .iter()
            .map(|r| {
                json!({
                    "rank": r.rank,
                    "compute_ms_per_step": (r.compute_ms_per_step * 100.0).round() / 100.0,
                    "busy": (r.busy * 1000.0).round() / 1000.0,
                    "expert_rows": r.expert_rows,
                })
            })
            .collect(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dash(steps: f64, ranks: &[(f64, f64)]) -> Value {
        json!({
            "poll_interval_seconds": 1.0,
            "server": {"steps": steps},
            "ranks": ranks.iter().map(|(c, e)| json!({
                "compute_seconds_total": c, "expert_rows_total": e
            })).collect::<Vec<_>>(),
        })
    }

    #[test]
    fn a_level_is_the_difference_of_two_readings() {
        let before = Snapshot::from_json(&dash(10.0, &[(1.0, 100.0), (2.0, 300.0)])).unwrap();
        let after = Snapshot::from_json(&dash(30.0, &[(3.0, 700.0), (3.0, 500.0)])).unwrap();
        let r = level_ranks(&before, &after, 4.0);
        assert_eq!(r.len(), 2);
        assert!((r[0].compute_ms_per_step - 100.0).abs() < 1e-9);
        assert!((r[1].compute_ms_per_step - 50.0).abs() < 1e-9);
        assert!((r[0].busy - 0.5).abs() < 1e-12 && (r[1].busy - 0.25).abs() < 1e-12);
        assert_eq!((r[0].expert_rows, r[1].expert_rows), (600.0, 200.0));
        // 600 of 800 rows on one of two ranks: 1.5x the mean.
        assert!((expert_imbalance(&r).unwrap() - 1.5).abs() < 1e-12);
        let line = ranks_line(16, &r);
        assert!(line.contains("rank 0 100.0 ms compute/step (busy 50%), 600 expert rows"));
        assert!(
            line.ends_with("busiest rank's expert rows 1.50x the mean"),
            "{line}"
        );
        assert_eq!(ranks_json(&r)[1]["expert_rows"], 200.0);
        // A dense model: no rows, no imbalance; no step: nothing.
        let dense = Snapshot::from_json(&dash(30.0, &[(3.0, 0.0), (3.0, 0.0)])).unwrap();
        let base = Snapshot::from_json(&dash(10.0, &[(1.0, 0.0), (2.0, 0.0)])).unwrap();
        assert_eq!(expert_imbalance(&level_ranks(&base, &dense, 1.0)), None);
        assert!(level_ranks(&dense, &dense, 1.0).is_empty());
        assert!(Snapshot::from_json(&json!({"ranks": []})).is_none());
    }
}
