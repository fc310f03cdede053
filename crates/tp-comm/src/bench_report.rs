//! The sweep as `tp bench collectives` runs it: optionally under an injected fault (a drill
//! whose fault never fires is a failure: it tested nothing), with rank 0 handing each line of
//! the report (the copy bandwidth, then per op a header and a row per size, as a table or as
//! JSON objects) to the caller as it is measured.

use crate::bench::{shared_memcpy_bandwidth, sweep, Row, SweepConfig};
use crate::fault::{FaultPlan, Faulty};
use crate::{CommError, Group};

/// Why a sweep failed.
#[derive(Debug, thiserror::Error)]
pub enum SweepError {
    #[error(transparent)]
    Comm(#[from] CommError),
    /// The injected fault's call was never reached.
    #[error(
        "the injected fault never fired: the sweep made {calls} collective calls on rank {rank} \
         and ended before call {at_call}"
    )]
    FaultNeverFired {
        calls: u64,
        rank: usize,
        at_call: u64,
    },
}

/// Runs the sweep on every rank of `world` (under `fault`'s plan when given); rank 0 passes
/// each piece of the report to `out` (a table, or JSON lines when `json`).
pub fn run_sweep(
    world: Group,
    cfg: &SweepConfig,
    fault: Option<&FaultPlan>,
    json: bool,
    mut out: impl FnMut(&str),
) -> Result<Vec<Row>, SweepError> {
    // Wrapped first, so a fault's CALL index is the group's sequence number in errors.
    let (g, watch) = match fault {
        Some(plan) => {
            let (g, watch) = Faulty::wrap_watched(world, plan.clone());
            (g, Some((plan, watch)))
        }
        None => (world, None),
    };
    let memcpy = shared_memcpy_bandwidth(&g)?;
    let lead = g.rank() == 0;
    if lead {
        out(&preamble(memcpy, json));
    }
    let rows = sweep(&g, cfg, memcpy, |row, first| {
        if lead {
            out(&row_text(row, json, first));
        }
    })?;
    if let Some((plan, watch)) = watch {
        if g.rank() == plan.rank && !watch.reached() {
            return Err(SweepError::FaultNeverFired {
                calls: watch.calls(),
                rank: plan.rank,
                at_call: plan.at_call,
            });
        }
    }
    Ok(rows)
}

/// The copy bandwidth the rows are set against (lines ending in a newline).
pub fn preamble(memcpy: f64, json: bool) -> String {
    if json {
        return format!("{}\n", serde_json::json!({"memcpy_gbs": memcpy / 1e9}));
    }
    format!(
        "# tp bench collectives: memcpy bandwidth of this machine (1 thread, 64 MiB): {:.2} GB/s copied\n\
         # busbw/cp = busbw as a fraction of that copy bandwidth\n",
        memcpy / 1e9
    )
}

/// One row (after its op's header when `first_of_op`), ending in a newline.
pub fn row_text(row: &Row, json: bool, first_of_op: bool) -> String {
    let refs = match (row.ref_time_us, row.ref_busbw_gbs, row.vs_ref) {
        (Some(t), Some(b), Some(v)) => Some((t, b, v)),
        _ => None,
    };
    if json {
        let mut j = serde_json::json!({
            "op": row.op.name(), "ranks": row.ranks, "backend": row.backend, "bytes": row.bytes,
            "count": row.count, "time_us": row.time_us, "algbw_gbs": row.algbw_gbs,
            "busbw_gbs": row.busbw_gbs, "busbw_vs_memcpy": row.busbw_vs_memcpy, "wrong": row.wrong,
        });
        if let Some((t, b, v)) = refs {
            j["ref_time_us"] = t.into();
            j["ref_busbw_gbs"] = b.into();
            j["vs_ref"] = v.into();
        }
        return format!("{j}\n");
    }
    let mut s = String::new();
    if first_of_op {
        s.push_str(&format!(
            "\n# {}  ranks={} backend={} dtype=f32\n# {:>12} {:>10} {:>11} {:>11} {:>11} {:>9} {:>6}",
            row.op.name(),
            row.ranks,
            row.backend,
            "size(B)",
            "count",
            "time(us)",
            "algbw(GB/s)",
            "busbw(GB/s)",
            "busbw/cp",
            "wrong"
        ));
        if row.ref_time_us.is_some() {
            s.push_str(&format!(
                " | {:>12} {:>11} {:>7}",
                "MPI time(us)", "MPI busbw", "vs MPI"
            ));
        }
        s.push('\n');
    }
    s.push_str(&format!(
        "  {:>12} {:>10} {:>11.2} {:>11.3} {:>11.3} {:>9.3} {:>6}",
        row.bytes,
        row.count,
        row.time_us,
        row.algbw_gbs,
        row.busbw_gbs,
        row.busbw_vs_memcpy,
        row.wrong
    ));
    if let Some((t, b, v)) = refs {
        s.push_str(&format!(" | {t:>12.2} {b:>11.3} {v:>7.2}"));
    }
    s.push('\n');
    s
}
