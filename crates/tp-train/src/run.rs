//! A prepared training run on its ranks (what `tp train` runs): the rank body (groups,
//! trainer, the loop, the checkpoint it ends with), the error routing (a collective's error
//! goes to the launcher with its flight record, any other is printed by its rank), and the
//! report lines with tokens/s and MFU against a matmul peak measured in the same process.

use crate::checkpoint::step_dir_name;
use crate::setup::Prepared;
use crate::{flops, plot, Result, StepReport, TrainError, TrainModel, TrainOptions, Trainer};
use std::path::PathBuf;
use std::time::Duration;
use tp_comm::launch::{run_ranks, Backend, LaunchError, RanksFailed};
use tp_comm::{Group, ProcessGroups};

/// How rank 0's run ended.
pub struct Summary {
    pub reports: Vec<StepReport>,
    /// The step directory of the last checkpoint (when the run saves).
    pub checkpoint: Option<PathBuf>,
}

/// A step's figures.
pub struct StepFigures {
    pub tokens_per_s: f64,
    pub mfu: f64,
    /// "loss .. | .. tok/s | MFU ..% | lr .."
    pub line: String,
}

/// A prepared run on a backend, with the matmul peak its MFU figures are against.
pub struct Job<'a> {
    pub prepared: &'a Prepared,
    pub backend: Backend,
    /// Ranks of the whole job.
    pub world: usize,
    /// Compute threads per rank.
    pub threads: usize,
    /// Best matmul FLOP/s of one rank, measured at start.
    pub peak: f64,
}

impl<'a> Job<'a> {
    /// Ranks of `prepared`'s layout that run in this process under `backend` (what the cores
    /// are shared among: [`crate::setup::compute_threads`]).
    pub fn local_ranks(prepared: &Prepared, backend: Backend) -> usize {
        match backend {
            Backend::Local => prepared.spec.dims.world_size(),
            Backend::Mpi => 1,
        }
    }

    /// A job whose ranks each compute with `threads` threads (the caller has given candle that
    /// count before: [`crate::setup::compute_threads`]); measures the matmul peak.
    pub fn new(prepared: &'a Prepared, backend: Backend, threads: usize) -> Result<Self> {
        let world = prepared.spec.dims.world_size();
        let peak = flops::measure_matmul_peak(512, 5)?;
        Ok(Job {
            prepared,
            backend,
            world,
            threads,
            peak,
        })
    }

    /// The model and the layout, two lines.
    pub fn header(&self) -> String {
        let p = self.prepared;
        let (cfg, d, world) = (&p.spec.model, p.spec.dims, self.world);
        format!(
            "tp train: {:.2}M parameters (hidden {}, {} layers, {} heads / {} KV, vocab {}) on {}\n  \
             tp={} pp={} dp={} ({world} ranks, {} compute thread(s) each); batch {} x {} \
             tokens in {} micro-batch(es) per replica{}; matmul peak {:.1} GFLOP/s per rank{}{}",
            cfg.num_params() as f64 / 1e6,
            cfg.hidden,
            cfg.layers,
            cfg.heads,
            cfg.kv_heads,
            cfg.vocab,
            p.data_desc,
            d.tp,
            d.pp,
            d.dp,
            self.threads,
            p.spec.global_batch,
            p.spec.seq,
            p.spec.micro_batches,
            match p.spec.virtual_stages {
                1 => String::new(),
                v => format!(
                    "; interleaved 1F1B, {v} virtual stages ({} chunks of the {} layers)",
                    v * d.pp,
                    cfg.layers
                ),
            },
            self.peak / 1e9,
            ep_text(&p.spec),
            match &p.resume {
                Some(ck) => format!("; resuming {} at step {}", ck.dir.display(), ck.state.step),
                None => String::new(),
            }
        ) + &match p.corpus.pack_stats() {
            Some(st) => format!(
                "\n  packed: {} documents in {} sequences ({:.2} per sequence); padding {:.1}% \
                 of the tokens one document per sequence, {:.1}% packed",
                st.documents,
                st.windows,
                st.per_window(),
                100.0 * st.padding_unpacked,
                100.0 * st.padding_packed
            ),
            None => String::new(),
        }
    }

    /// One step's rate, MFU and line.
    pub fn step(&self, r: &StepReport) -> StepFigures {
        let tokens_per_s = r.tokens as f64 / r.seconds.max(1e-9);
        let mfu = flops::mfu(
            &self.prepared.spec.model,
            tokens_per_s,
            self.world,
            self.peak,
        );
        let aux = r
            .aux_loss
            .map(|a| format!(" | balance {a:.3}"))
            .unwrap_or_default();
        let aux = match r.moe_dropped {
            Some(d) => format!("{aux} | dropped {d}"),
            None => aux,
        };
        let aux = match r.moe_imbalance {
            Some(i) => format!("{aux} | expert max/mean {i:.2}"),
            None => aux,
        };
        let line = format!(
            "loss {:.4}{aux} | {} tok/s | MFU {:.1}% | lr {:.2e}",
            r.loss,
            fmt_rate(tokens_per_s),
            100.0 * mfu,
            r.lr
        );
        StepFigures {
            tokens_per_s,
            mfu,
            line,
        }
    }

    /// Trains on every rank; rank 0 calls `progress` after each step. Rank 0's summary comes
    /// back (`None` on the other processes of an MPI job), or [`RanksFailed`] once every
    /// failing rank has printed its error.
    pub fn run(
        &self,
        timeout: Duration,
        opts: &TrainOptions,
        progress: &(dyn Fn(&StepReport) + Sync),
    ) -> std::result::Result<std::result::Result<Option<Summary>, RanksFailed>, LaunchError> {
        launch(self.backend, self.world, timeout, |world| {
            rank_main(world, self.prepared, opts, progress)
        })
    }

    /// The closing lines: the loss over the run with the median rate and MFU, and where the
    /// checkpoint and the loss curve are.
    pub fn summary(&self, s: &Summary) -> Vec<String> {
        let mut lines = Vec::new();
        let p = self.prepared;
        if let (Some(first), Some(last)) = (s.reports.first(), s.reports.last()) {
            // The first step pays for warming up; the median is the steady state.
            let tps = median(
                s.reports
                    .iter()
                    .map(|x| x.tokens as f64 / x.seconds.max(1e-9))
                    .collect(),
            );
            lines.push(format!(
                "done: steps {}..{}, loss {:.4} -> {:.4}, median {} tokens/s, MFU {:.1}% of {:.1} \
                 GFLOP/s x {} rank(s)",
                first.step,
                last.step,
                first.loss,
                last.loss,
                fmt_rate(tps),
                100.0 * flops::mfu(&p.spec.model, tps, self.world, self.peak),
                self.peak / 1e9,
                self.world
            ));
        }
        if let (Some(ck), Some(dir)) = (&s.checkpoint, &p.spec.save_dir) {
            lines.push(format!(
                "checkpoint {} (an HF {} directory: config.json, model.safetensors, \
                 tokenizer.json); loss curve {}",
                ck.display(),
                p.spec.model.hf_class(),
                dir.join(plot::PLOT_FILE).display()
            ));
        }
        lines
    }
}

/// One rank: build the groups and the trainer, train, report on rank 0.
fn rank_main(
    world: Group,
    p: &Prepared,
    opts: &TrainOptions,
    progress: &(dyn Fn(&StepReport) + Sync),
) -> Result<Summary> {
    let rank = world.rank();
    let groups = ProcessGroups::new(world, p.spec.dims)?;
    let mut t = Trainer::new(
        &p.spec,
        groups,
        &p.corpus,
        &p.tokenizer_json,
        p.start(),
        opts.clone(),
    )?
    .with_validation(p.val.as_ref())
    .with_tokenizer_config(p.tokenizer_config.as_deref());
    if rank == 0 {
        // The start-up line's memory figure: the arrays this rank holds, by their lengths.
        eprintln!("  {}", t.optimizer_memory().line());
    }
    let mut reports = Vec::new();
    t.run(&mut |r| {
        if rank == 0 {
            progress(r);
        }
        reports.push(r.clone());
    })?;
    let checkpoint = p
        .spec
        .save_dir
        .as_ref()
        .map(|d| d.join(step_dir_name(t.step_count())));
    Ok(Summary {
        reports,
        checkpoint,
    })
}

/// Runs training work on every rank of `backend`, routing its errors: a collective error goes
/// back to the launcher (which prints it with its flight record); any other error is printed
/// by its rank (under mpirun the process then ends, as other processes may wait on it).
pub fn launch<T: Send>(
    backend: Backend,
    ranks: usize,
    timeout: Duration,
    work: impl Fn(Group) -> std::result::Result<T, TrainError> + Sync,
) -> std::result::Result<std::result::Result<Option<T>, RanksFailed>, LaunchError> {
    let out = run_ranks(backend, ranks, timeout, |world| {
        let rank = world.rank();
        match work(world) {
            Ok(v) => Ok(Ok(v)),
            Err(e) => match e.into_comm() {
                Ok(comm) => Err(comm),
                Err(other) => {
                    eprintln!("rank {rank}: error: {}", tp_comm::error::chain(&other));
                    if backend == Backend::Mpi {
                        // Other processes may wait on this one: end the job.
                        std::thread::sleep(Duration::from_millis(300));
                        std::process::exit(1);
                    }
                    Ok(Err(()))
                }
            },
        }
    })?;
    Ok(match out {
        Ok(Some(Ok(v))) => Ok(Some(v)),
        Ok(Some(Err(()))) => Err(RanksFailed),
        Ok(None) => Ok(None),
        Err(failed) => Err(failed),
    })
}

/// "1.23M", "45.6k" or "789".
pub fn fmt_rate(x: f64) -> String {
    if x >= 1e6 {
        format!("{:.2}M", x / 1e6)
    } else if x >= 1e3 {
        format!("{:.1}k", x / 1e3)
    } else {
        format!("{x:.0}")
    }
}

/// The middle value (the upper one of an even count); 0 when empty.
pub(crate) fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(0.0)
}

/// The header's words for the run's expert parallelism (nothing at ep 1).
fn ep_text(spec: &crate::TrainSpec) -> String {
    let d = spec.dims;
    let count = spec.model.experts.map_or(1, |e| e.count);
    match tp_spec::EpLayout::new(spec.ep, d.tp, d.dp, count) {
        Ok(tp_spec::EpLayout::AcrossReplicas(r)) => format!(
            "; ep {}: whole experts over blocks of {} replicas, tokens sent by all-to-all",
            r.ep, r.block
        ),
        Ok(tp_spec::EpLayout::InsideTp(n)) if n > 1 => {
            format!("; ep {n}: {n} expert groups of {} tp ranks", d.tp / n)
        }
        _ => String::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rates_read_at_a_glance() {
        assert_eq!(fmt_rate(1_234_567.0), "1.23M");
        assert_eq!(fmt_rate(45_600.0), "45.6k");
        assert_eq!(fmt_rate(789.4), "789");
        assert_eq!(median(vec![3.0, 1.0, 2.0, 9.0]), 3.0);
        assert_eq!(median(Vec::new()), 0.0);
    }
}
