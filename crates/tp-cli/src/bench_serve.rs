//! `tp bench serve`: starts a server in this process per tp (through `tp_serve::serve`, as
//! `tp serve` does, with the bench's model flags), drives it with streaming completion
//! requests at each concurrency (a bounded number of requests per level), and reports output
//! throughput, time to first token and time per output token (p50/p99), and how throughput
//! grows with concurrency (continuous batching). With a shared system prompt, the same
//! workload runs with and without the prefix cache (`--prefix-cache both`), and a KV budget
//! of a few full contexts (`--kv-contexts`) makes the server preempt and recompute. With a
//! drafter (`--spec ngram`, `--draft-model`), every server also runs without speculation, the
//! baseline of the same run, and each level reports the drafts' acceptance.

use crate::generate::Drafting;
use crate::model_run::{run_model_serving, ModelArgs};
use crate::serve::serve_error;
use crate::serve::ServeSpecArgs;
use anyhow::{bail, Context};
use std::net::{IpAddr, SocketAddr};
use std::process::ExitCode;
use std::sync::mpsc;
use std::time::Duration;
use tp_engine::launch::RanksFailed;
use tp_serve::bench_ranks::{level_ranks, ranks_line, RankLevel, Snapshot};
use tp_serve::bench_report::{level_json, level_line, table, BenchShape, Measured, Run, Variant};
use tp_serve::client::Client;
use tp_serve::load::{drive, one_request, Prompts, Workload};
use tp_serve::{ConnLimits, KvBudget, ServeConfig, StopHandle};

#[derive(clap::Args, Clone, Debug)]
pub struct BenchServeArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// tp sizes to measure, e.g. 1,2.
    #[arg(long, value_delimiter = ',', default_value = "1,2")]
    pub tps: Vec<usize>,
    /// Concurrent clients per level, e.g. 1,4,16.
    #[arg(long, value_delimiter = ',', default_value = "1,4,16")]
    pub concurrency: Vec<usize>,
    /// Requests per level: this many times the concurrency (at least 8).
    #[arg(long, default_value_t = 4)]
    pub rounds: usize,
    /// Approximate prompt length in tokens.
    #[arg(long, default_value_t = 64)]
    pub prompt_tokens: usize,
    /// Tokens generated per request (end-of-sequence ignored).
    #[arg(long, default_value_t = 64)]
    pub gen_tokens: usize,
    /// What the requests ask: runs of words (about --prompt-tokens each), or to print a
    /// piece of code again with a variable renamed (an answer that copies its prompt, as
    /// speculative decoding likes).
    #[arg(long, value_enum, default_value_t = PromptsArg::Words)]
    pub prompts: PromptsArg,
    /// Tokens of a system prompt every request begins with (0: none).
    #[arg(long, default_value_t = 0)]
    pub system_prompt_tokens: usize,
    /// Run with the prefix cache on, off, or both (one server each).
    #[arg(long, value_enum, default_value_t = PrefixCacheArg::On)]
    pub prefix_cache: PrefixCacheArg,
    /// KV budget of this many full contexts (system prompt, prompt and generated tokens) per
    /// rank, instead of the default budget; fewer than the concurrency makes requests wait
    /// or be preempted.
    #[arg(long)]
    pub kv_contexts: Option<usize>,
    /// Print one JSON object per (tp, concurrency) on stdout instead of the table.
    #[arg(long)]
    pub json: bool,
    /// Measure the server listening at this address (HOST:PORT), started elsewhere (e.g.
    /// `tp serve --backend mpi` under mpirun across hosts), instead of starting one at each
    /// of --tps: its model, layout, prefix cache and speculation are its own.
    #[arg(long, value_name = "HOST:PORT")]
    pub url: Option<SocketAddr>,
    /// Speculative decoding in the servers; with a drafter each server also runs without
    /// it (the baseline).
    #[command(flatten)]
    pub spec: ServeSpecArgs,
}

/// What the requests of `tp bench serve` ask.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum PromptsArg {
    Words,
    Edit,
}

/// Which servers `tp bench serve` starts per tp.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum PrefixCacheArg {
    On,
    Off,
    Both,
}

impl PrefixCacheArg {
    fn settings(self) -> &'static [bool] {
        match self {
            PrefixCacheArg::On => &[true],
            PrefixCacheArg::Off => &[false],
            PrefixCacheArg::Both => &[true, false],
        }
    }
}

pub fn run(args: &BenchServeArgs) -> anyhow::Result<ExitCode> {
    if args.tps.is_empty() || args.tps.contains(&0) {
        bail!("--tps needs tp sizes of at least 1, e.g. --tps 1,2");
    }
    if args.concurrency.is_empty() || args.concurrency.contains(&0) {
        bail!("--concurrency needs levels of at least 1, e.g. --concurrency 1,4,16");
    }
    if args.gen_tokens < 2 || args.prompt_tokens == 0 || args.rounds == 0 {
        bail!("--gen-tokens >= 2, --prompt-tokens >= 1 and --rounds >= 1 are needed");
    }
    if args.kv_contexts == Some(0) {
        bail!("--kv-contexts must be at least 1");
    }
    if args.model.backend != tp_engine::launch::Backend::Local {
        bail!("tp bench serve starts its servers with the local backend; drop --backend (or measure a server started under mpirun with --url)");
    }
    let max_c = args.concurrency.iter().copied().max().unwrap_or(1);
    // Words of the prompts are about a token each; the margin covers the tokenizer's
    // rounding.
    // An edit prompt has fewer tokens than characters.
    let prompt_bound = match args.prompts {
        PromptsArg::Words => args.prompt_tokens * 2,
        PromptsArg::Edit => tp_engine::bench_spec::EDIT_SOURCE.len() + 128,
    };
    let ctx = args.system_prompt_tokens + prompt_bound + args.gen_tokens + 64;
    let budget = args.kv_contexts.map(|k| KvBudget::Positions(k * ctx));
    let w = Workload {
        prompt_tokens: args.prompt_tokens,
        gen_tokens: args.gen_tokens,
        system_prompt_tokens: args.system_prompt_tokens,
        prompts: match args.prompts {
            PromptsArg::Words => Prompts::Words,
            PromptsArg::Edit => Prompts::Edit,
        },
    };
    let shape = BenchShape {
        workload: w,
        rounds: args.rounds,
        kv_contexts: args.kv_contexts,
        pp: if args.url.is_some() { 1 } else { args.model.pp },
        ep: if args.url.is_some() { 1 } else { args.model.ep },
        server: args.url.map(|a| a.to_string()),
    };
    if let Some(addr) = args.url {
        return measure_elsewhere(args, addr, &shape);
    }
    let model = args.model.model_path()?;
    let spec_label = match args.spec.check()? {
        Drafting::Off => None,
        Drafting::Method(..) => Some("ngram".to_string()),
        Drafting::Model(path, _) => Some(
            path.file_stem()
                .map_or_else(|| "draft".into(), |s| s.to_string_lossy().into_owned()),
        ),
    };
    let mut variants = Vec::new();
    for &prefix_cache in args.prefix_cache.settings() {
        variants.push(Variant {
            prefix_cache,
            spec: None,
        });
        if spec_label.is_some() {
            variants.push(Variant {
                prefix_cache,
                spec: spec_label.clone(),
            });
        }
    }
    let mut all: Vec<Measured> = Vec::new();
    for &tp in &args.tps {
        let mut runs = Vec::new();
        for variant in &variants {
            let server = InProcessServer::start(
                &model,
                ServerShape {
                    tp,
                    ctx,
                    max_seqs: max_c,
                    prefix_cache: variant.prefix_cache,
                    budget,
                    spec: variant.spec.is_some().then(|| args.spec.clone()),
                },
                &args.model,
            )?;
            let client = Client::new(server.addr);
            // Warm-up (first touches of weights and caches).
            one_request(&client, 0, &w, 4).context("warm-up request")?;
            for &c in &args.concurrency {
                let before = drafts(&client)?;
                let (level, ranks) = drive_with_ranks(&client, c, args.rounds, &w)
                    .with_context(|| format!("tp {tp}, concurrency {c}"))?;
                let after = drafts(&client)?;
                let drafted = after.0 - before.0;
                let run = Run {
                    variant: variant.clone(),
                    level,
                    acceptance: (variant.spec.is_some() && drafted > 0.0)
                        .then(|| (after.1 - before.1) / drafted),
                    ranks,
                };
                if args.json {
                    println!("{}", level_json(Some(tp), &run, &shape));
                } else {
                    eprintln!("{}", level_line(Some(tp), &shape, &run));
                    if !run.ranks.is_empty() {
                        eprintln!("{}", ranks_line(c, &run.ranks));
                    }
                }
                runs.push(run);
            }
            server.stop()?;
        }
        all.push((Some(tp), runs));
    }
    if !args.json {
        print!("{}", table(&all, &shape, &tp_kernels::kernel_report()));
    }
    Ok(ExitCode::SUCCESS)
}

/// The levels of a server started elsewhere, at `addr`.
fn measure_elsewhere(
    args: &BenchServeArgs,
    addr: SocketAddr,
    shape: &BenchShape,
) -> anyhow::Result<ExitCode> {
    let client = Client::new(addr);
    let w = &shape.workload;
    one_request(&client, 0, w, 4)
        .with_context(|| format!("warm-up request to the server at {addr}"))?;
    let variant = Variant {
        prefix_cache: true,
        spec: None,
    };
    let mut runs = Vec::new();
    for &c in &args.concurrency {
        let (level, ranks) = drive_with_ranks(&client, c, args.rounds, w)
            .with_context(|| format!("the server at {addr}, concurrency {c}"))?;
        let run = Run {
            variant: variant.clone(),
            level,
            acceptance: None,
            ranks,
        };
        if args.json {
            println!("{}", level_json(None, &run, shape));
        } else {
            eprintln!("{}", level_line(None, shape, &run));
            if !run.ranks.is_empty() {
                eprintln!("{}", ranks_line(c, &run.ranks));
            }
        }
        runs.push(run);
    }
    if !args.json {
        let all = [(None, runs)];
        print!("{}", table(&all, shape, &tp_kernels::kernel_report()));
    }
    Ok(ExitCode::SUCCESS)
}

/// One level at concurrency `c` (`rounds x c` requests, at least 8), with each rank's share
/// read from the server's dashboard before and after it (after one collection interval, so
/// the reading covers the level's last steps; none when the dashboard cannot be read).
fn drive_with_ranks(
    client: &Client,
    c: usize,
    rounds: usize,
    w: &Workload,
) -> anyhow::Result<(tp_serve::load::Level, Vec<RankLevel>)> {
    let before = Snapshot::read(client);
    let level = drive(client, c, (rounds * c).max(8), w)?;
    let ranks = match before {
        Some(b) => {
            std::thread::sleep(Duration::from_secs_f64(b.poll_seconds.min(5.0) + 0.2));
            Snapshot::read(client).map_or_else(Vec::new, |a| level_ranks(&b, &a, level.wall))
        }
        None => Vec::new(),
    };
    Ok((level, ranks))
}

/// The server's drafted and accepted tokens so far (0 without speculation), from `/metrics`.
fn drafts(client: &Client) -> anyhow::Result<(f64, f64)> {
    let text = client
        .get("/metrics")
        .context("cannot read the server's /metrics")?
        .text();
    let value = |name: &str| {
        text.lines()
            .filter(|l| !l.starts_with('#'))
            .find_map(|l| {
                let (k, v) = l.rsplit_once(' ')?;
                (k == name).then(|| v.parse::<f64>().ok()).flatten()
            })
            .unwrap_or(0.0)
    };
    Ok((
        value("tp_spec_drafted_tokens_total"),
        value("tp_spec_accepted_tokens_total"),
    ))
}

/// A server in this process on a free loopback port, started through [`tp_serve::serve`] as
/// `tp serve` starts it (its ranks are threads: the local backend), with every model flag of
/// the bench; stopped as SIGTERM would stop `tp serve`, and when dropped.
struct InProcessServer {
    addr: SocketAddr,
    stop: StopHandle,
    thread: Option<std::thread::JoinHandle<RunOutcome>>,
}

/// What the server's thread ends with (`run_model`'s result).
type RunOutcome = anyhow::Result<Result<Option<()>, RanksFailed>>;

/// What a bench server is started with.
struct ServerShape {
    tp: usize,
    ctx: usize,
    max_seqs: usize,
    prefix_cache: bool,
    /// The default budget (or the rank memory limit) when `None`.
    budget: Option<KvBudget>,
    /// Speculative decoding's flags, `None` when off.
    spec: Option<ServeSpecArgs>,
}

impl InProcessServer {
    fn start(
        model: &std::path::Path,
        shape: ServerShape,
        margs: &ModelArgs,
    ) -> anyhow::Result<InProcessServer> {
        let ServerShape {
            tp,
            ctx,
            max_seqs,
            prefix_cache,
            budget,
            spec,
        } = shape;
        let mut m = margs.clone();
        m.model = Some(model.to_path_buf());
        m.tp = Some(tp);
        m.ctx_size = Some(ctx);
        m.quiet = true;
        let (max_connections, _) = crate::serve::connection_cap(None, true)?;
        let cfg = ServeConfig {
            host: IpAddr::from([127, 0, 0, 1]),
            port: 0,
            api_key: None,
            public_health: false,
            model_name: model
                .file_stem()
                .map_or_else(|| "model".into(), |s| s.to_string_lossy().into_owned()),
            kv_budget: match (budget, m.max_rank_memory) {
                (Some(b), _) => b,
                (None, Some(rank)) => KvBudget::RankMemory(rank),
                (None, None) => KvBudget::Default,
            },
            max_seqs,
            max_batch_tokens: 256,
            max_queue: 256,
            max_n: tp_serve::DEFAULT_MAX_N,
            max_body_bytes: tp_serve::DEFAULT_MAX_BODY_BYTES,
            drain_timeout: Duration::from_secs(30),
            term_drain_timeout: Duration::from_secs(30),
            collective_timeout: m.timeout()?,
            connections: ConnLimits {
                header_timeout: Duration::from_secs(10),
                idle_timeout: Duration::from_secs(60),
                max_connections,
            },
            log: false,
            auth_hint: None,
            prefix_cache,
            canary: None,
            admin_key: None,
            spec: None,
            swap: Default::default(),
            unhealthy_linger: Duration::ZERO,
        };
        let (tx, rx) = mpsc::channel();
        let thread = std::thread::Builder::new()
            .name("bench-serve".into())
            .spawn(move || -> RunOutcome {
                let draft = spec.as_ref().and_then(|s| s.drafting.draft_path());
                run_model_serving(&m, cfg.kv_budget, draft, |s| {
                    let mut cfg = cfg.clone();
                    if let Some(spec) = &spec {
                        cfg.spec = spec.serve_spec(s, &m)?;
                    }
                    tp_serve::serve(s, &cfg, |r| {
                        let _ = tx.send((r.addr, r.stop.clone()));
                        Ok(())
                    })
                    .map_err(serve_error)
                })
            })
            .context("cannot start the server thread")?;
        match rx.recv_timeout(Duration::from_secs(300)) {
            Ok((addr, stop)) => Ok(InProcessServer {
                addr,
                stop,
                thread: Some(thread),
            }),
            // The thread ended without a server: its error says why.
            Err(mpsc::RecvTimeoutError::Disconnected) => match thread.join() {
                Ok(Err(e)) => Err(e.context(format!("the server at tp {tp} did not start"))),
                Ok(Ok(_)) => {
                    bail!("the server at tp {tp} did not start (its ranks failed, see above)")
                }
                Err(_) => bail!("the server at tp {tp} panicked while starting"),
            },
            Err(mpsc::RecvTimeoutError::Timeout) => {
                bail!("the server at tp {tp} did not start within 300 s")
            }
        }
    }

    /// Starts the drain and waits for the server and its ranks to end.
    fn stop(mut self) -> anyhow::Result<()> {
        self.stop.stop();
        let Some(thread) = self.thread.take() else {
            return Ok(());
        };
        match thread.join() {
            Ok(Ok(Ok(_))) => Ok(()),
            Ok(Ok(Err(RanksFailed))) => bail!("the server's ranks failed (see above)"),
            Ok(Err(e)) => Err(e.context("the server failed")),
            Err(_) => bail!("the server thread panicked"),
        }
    }
}

impl Drop for InProcessServer {
    fn drop(&mut self) {
        // An error in the bench: stop serving (the process ends soon after).
        if self.thread.is_some() {
            self.stop.stop();
        }
    }
}
