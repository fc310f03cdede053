//! `tp serve`: the OpenAI-compatible server's flags, mapped to [`tp_serve::ServeConfig`] and
//! run by [`tp_serve::serve`] on rank 0 (HTTP front end, continuous-batching scheduler,
//! drain); the other ranks follow its steps. The KV budget comes from --max-kv-memory, or
//! from --max-rank-memory minus the weights, or defaults to 1 GiB per rank.

use crate::model_run::{run_model_serving, seconds, ModelArgs};
use anyhow::{bail, Context};
use std::io::Write;
use std::net::IpAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tp_engine::launch::Backend;
use tp_engine::report::{parse_bytes, show_bytes};
use tp_serve::canary::{Canary, CanaryConfig};
use tp_serve::fdlimit::{default_max_connections, fd_reserve};
use tp_serve::{ConnLimits, KvBudget, Ready, ServeConfig, ServeError, SwapConfig, SwapPolicy};
/// Drain after SIGTERM under mpirun: short enough to finish before mpirun's SIGKILL.
const MPI_TERM_DRAIN: Duration = Duration::from_millis(200);

/// Speculative decoding flags of a server: the drafter, and up to how many decoding requests
/// a step drafts for.
#[derive(clap::Args, Clone, Debug)]
pub struct ServeSpecArgs {
    #[command(flatten)]
    pub drafting: crate::generate::SpecArgs,
    /// With speculative decoding: which batched steps carry drafts. N: only steps where at
    /// most N requests decode (every draft costs a verification row, accepted or not, so a
    /// batch that keeps the cores busy gets slower with drafts); auto: each request's drafts
    /// are kept when the step cost measured on this server (a fixed part and a part per token
    /// fed) and the request's acceptance say they raise the step's tokens per second (for
    /// machines where a row is cheap beside a step) [default: 1].
    #[arg(long, value_name = "N|auto", value_parser = parse_spec_batch)]
    pub spec_max_batch: Option<tp_serve::SpecBatch>,
}

/// `--spec-max-batch`'s values: a count of at least 1, or auto.
fn parse_spec_batch(s: &str) -> Result<tp_serve::SpecBatch, String> {
    match s {
        "auto" => Ok(tp_serve::SpecBatch::Adaptive),
        n => match n.parse::<usize>() {
            Ok(n) if n >= 1 => Ok(tp_serve::SpecBatch::UpTo(n)),
            _ => Err(format!("{n:?}: give a count of at least 1, or auto")),
        },
    }
}

impl ServeSpecArgs {
    /// The server's speculation for `s` (a draft model is loaded here), `None` when off.
    pub fn serve_spec(
        &self,
        s: &tp_engine::Session,
        model: &ModelArgs,
    ) -> anyhow::Result<Option<tp_serve::ServeSpec>> {
        let batch = self.spec_max_batch.unwrap_or(tp_serve::SpecBatch::UpTo(1));
        Ok(self
            .drafting
            .source(s, model)?
            .map(|(source, tokens)| tp_serve::ServeSpec {
                source,
                tokens,
                batch,
            }))
    }

    /// The flags checked (before any rank starts).
    pub fn check(&self) -> anyhow::Result<crate::generate::Drafting> {
        let drafting = self.drafting.drafting()?;
        if self.drafting.draft_ahead != tp_engine::DraftAhead::Auto {
            anyhow::bail!(
                "tp serve does not draft ahead (its requests draft inside each batched step); leave --draft-ahead out"
            );
        }
        if self.spec_max_batch.is_some() && matches!(drafting, crate::generate::Drafting::Off) {
            anyhow::bail!(
                "--spec-max-batch needs --spec ngram or --draft-model FILE (speculative decoding is off)"
            );
        }
        Ok(drafting)
    }
}

#[derive(clap::Args, Clone, Debug)]
pub struct ServeArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Speculative decoding per request (--spec ngram: each request drafts from its own
    /// prompt and output; --draft-model: each keeps its own cache of the draft model, held
    /// once on rank 0). Clients see the same text (greedy) or distribution (sampling).
    #[command(flatten)]
    pub spec: ServeSpecArgs,
    /// Address to listen on. Loopback by default; anything else is reachable from the network
    /// (set an API key then: $TP_API_KEY or --api-key).
    #[arg(long, default_value = "127.0.0.1")]
    pub host: IpAddr,
    /// Port to listen on (0: any free port; the address is printed).
    #[arg(long, default_value_t = 8000)]
    pub port: u16,
    /// Require `Authorization: Bearer KEY` on every request. Prefer setting $TP_API_KEY
    /// instead: a flag's value is visible to every user of the machine in `ps`. An empty key
    /// (flag or variable) is refused rather than serving without authentication.
    #[arg(long, value_name = "KEY")]
    pub api_key: Option<String>,
    /// Turn on the admin endpoints (POST /admin/reload to load a model or a `tp train`
    /// checkpoint beside the live one, canary it and switch; POST /admin/rollback; GET
    /// /admin/models), which need `Authorization: Bearer KEY` with this key (not the API
    /// key). Prefer setting $TP_ADMIN_KEY: a flag's value shows in `ps`.
    #[arg(long, value_name = "KEY")]
    pub admin_key: Option<String>,
    /// How POST /admin/reload makes room for the new model: auto holds it beside the live
    /// one when the memory plan says both fit and otherwise drains first (new requests wait,
    /// running ones finish, the live model is dropped on every rank, the new one loads in its
    /// place: no model serves meanwhile); drain always drains first (a host that must never
    /// hold two models).
    #[arg(long, value_enum, default_value_t = SwapArg::Auto)]
    pub swap: SwapArg,
    /// Memory a reloaded model may take on this host, e.g. 2GiB, in place of what the system
    /// reports available (MemAvailable) when the reload is asked for: decides between holding
    /// both models and draining first.
    #[arg(long, value_parser = parse_bytes, value_name = "BYTES")]
    pub reload_memory: Option<u64>,
    /// With an API key: answer GET /health without it (for load-balancer probes); every
    /// other route still needs the key.
    #[arg(long)]
    pub public_health: bool,
    /// The model name clients pass (default: the model file's name without extension).
    #[arg(long)]
    pub served_model_name: Option<String>,
    /// KV cache memory per rank shared by all requests, e.g. 512MB; requests beyond it queue.
    #[arg(long, value_parser = parse_bytes)]
    pub max_kv_memory: Option<u64>,
    /// Most requests generated at once (continuous batching); more queue.
    #[arg(long, default_value_t = 16)]
    pub max_seqs: usize,
    /// Most tokens in one forward step: one per running request plus prompt chunks of new
    /// ones (bounds how long a long prompt stalls the others).
    #[arg(long, default_value_t = 256)]
    pub max_batch_tokens: usize,
    /// Do not share KV blocks between requests that begin alike, and keep no finished
    /// requests' blocks for later ones (the prefix cache): every request computes its whole
    /// prompt.
    #[arg(long)]
    pub no_prefix_cache: bool,
    /// Requests allowed to wait for admission; beyond it new ones get 429 (a request for
    /// `n` choices takes `n` places).
    #[arg(long, default_value_t = 256)]
    pub max_queue: usize,
    /// Most choices (`n`) one request may ask for; each is generated as its own sequence
    /// (the prompt is computed once and shared). More get 400.
    #[arg(long, default_value_t = tp_serve::DEFAULT_MAX_N, value_name = "N")]
    pub max_n: usize,
    /// Largest request body, e.g. 1MiB; larger bodies get 413.
    #[arg(long, value_parser = parse_bytes, default_value = "1MiB")]
    pub max_body: u64,
    /// Seconds in-flight requests get to finish after SIGINT/SIGTERM; streams still running
    /// then end with an error event and `[DONE]`, other requests get 503.
    #[arg(long, default_value_t = 30.0)]
    pub drain_timeout: f64,
    /// Seconds the server keeps answering after the inference engine failed (a lost or
    /// stalled rank or stage): `/health` gives 503 with the error, requests 503; then it
    /// exits with the error. 0 exits at once; SIGTERM ends it sooner.
    #[arg(long, default_value_t = 30.0, value_name = "SECS")]
    pub unhealthy_linger: f64,
    /// Seconds a client has to send a request's headers (from connecting, or from the
    /// request's first byte), and then again its body; slower connections are closed.
    #[arg(long, default_value_t = 10.0, value_name = "SECS")]
    pub header_timeout: f64,
    /// Seconds a kept-alive connection may wait for its next request, and a response write
    /// may stall (a client that stopped reading), before the connection is closed. Requests
    /// being answered (long generations, streams) are never cut by it.
    #[arg(long, default_value_t = 60.0, value_name = "SECS")]
    pub idle_timeout: f64,
    /// Connections served at once; more get `503` with `Retry-After: 1` and
    /// `Connection: close`. Default: the open-file limit (raised to its hard limit at start)
    /// less a reserve of an eighth (at least 32), at most 8192.
    #[arg(long, value_name = "N")]
    pub max_connections: Option<usize>,
    /// Canary file (JSON Lines of {"prompt", "expected", "mean_logprob", "max_tokens"}, as
    /// --write-canary writes it): run once the server is up and then every
    /// --canary-interval seconds; a continuation that differs, or a mean logprob that moved
    /// by more than --canary-threshold, raises the drift alarm (tp_canary_drift on /metrics,
    /// the dashboard, a log line).
    #[arg(long, value_name = "FILE")]
    pub canary: Option<PathBuf>,
    /// Seconds between two canary runs.
    #[arg(long, default_value_t = 300.0, value_name = "SECS")]
    pub canary_interval: f64,
    /// Largest shift of a canary case's mean logprob (nats per token) that is not drift.
    #[arg(long, default_value_t = tp_serve::canary::DEFAULT_THRESHOLD, value_name = "NATS")]
    pub canary_threshold: f64,
    /// Write a canary file from this model and exit: the greedy continuation of each prompt
    /// of --canary-prompts (a built-in set by default), --canary-max-tokens long.
    #[arg(long, value_name = "FILE")]
    pub write_canary: Option<PathBuf>,
    /// Prompts for --write-canary, one a line.
    #[arg(long, value_name = "FILE")]
    pub canary_prompts: Option<PathBuf>,
    /// Tokens of each continuation --write-canary records.
    #[arg(long, default_value_t = 16, value_name = "N")]
    pub canary_max_tokens: usize,
}

/// --swap's values.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum SwapArg {
    Auto,
    Drain,
}

/// The canary settings from --canary and its companions, the file read and checked now (an
/// invalid line is an error naming it).
fn canary_config(args: &ServeArgs) -> anyhow::Result<Option<CanaryConfig>> {
    let Some(path) = &args.canary else {
        return Ok(None);
    };
    let canary = Canary::load(path).context("--canary")?;
    let interval = seconds("--canary-interval", args.canary_interval)?;
    if !(args.canary_threshold.is_finite() && args.canary_threshold >= 0.0) {
        bail!("--canary-threshold must be a non-negative number of nats per token");
    }
    Ok(Some(CanaryConfig {
        canary,
        interval,
        threshold: args.canary_threshold,
    }))
}

/// The prompts --write-canary records: --canary-prompts' lines, or the built-in set.
fn canary_prompts(args: &ServeArgs) -> anyhow::Result<Vec<String>> {
    if args.canary_max_tokens == 0 {
        bail!("--canary-max-tokens must be at least 1");
    }
    let Some(path) = &args.canary_prompts else {
        return Ok(tp_serve::canary::DEFAULT_PROMPTS
            .iter()
            .map(|s| s.to_string())
            .collect());
    };
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("cannot read --canary-prompts {}", path.display()))?;
    let prompts: Vec<String> = text
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(str::to_string)
        .collect();
    if prompts.is_empty() {
        bail!(
            "--canary-prompts {} has no prompt; write one a line",
            path.display()
        );
    }
    Ok(prompts)
}

/// The API key from --api-key or $TP_API_KEY (the flag wins); an empty one is an error.
fn api_key(flag: Option<&str>) -> anyhow::Result<Option<String>> {
    key_from(flag, "--api-key", "TP_API_KEY")
}

/// The admin key from --admin-key or $TP_ADMIN_KEY (the flag wins); an empty one is an error.
fn admin_key(flag: Option<&str>) -> anyhow::Result<Option<String>> {
    key_from(flag, "--admin-key", "TP_ADMIN_KEY")
}

/// A key from `flag_name` (given as `flag`) or the environment variable `var`.
fn key_from(flag: Option<&str>, flag_name: &str, var: &str) -> anyhow::Result<Option<String>> {
    let (key, source) = match flag {
        Some(k) => (k.to_string(), flag_name.to_string()),
        None => match std::env::var_os(var) {
            None => return Ok(None),
            Some(v) => match v.into_string() {
                Ok(k) => (k, format!("${var}")),
                Err(_) => bail!(
                    "${var} is not valid UTF-8; set it to the key (printable ASCII) or unset it"
                ),
            },
        },
    };
    if key.trim().is_empty() {
        bail!(
            "{source} is {}: refusing to serve without authentication by accident. Set {source} to the key, or leave it {} to serve without one",
            if key.is_empty() { "empty" } else { "only whitespace" },
            if source == flag_name { "out" } else { "unset" }
        );
    }
    tp_serve::check_api_key(&key).map_err(|e| {
        let e = if var == "TP_API_KEY" {
            e
        } else {
            e.replace("the API key", "the key")
        };
        anyhow::anyhow!("{source}: {e}")
    })?;
    Ok(Some(key))
}

/// Raises the soft open-file limit to the hard one (a warning if it cannot) and returns the
/// connection cap: --max-connections, or derived from the limit.
pub fn connection_cap(flag: Option<usize>, quiet: bool) -> anyhow::Result<(usize, Option<u64>)> {
    let limit = match tp_serve::fdlimit::raise_open_file_limit() {
        Ok((before, after)) => {
            if !quiet && after.soft > before.soft {
                eprintln!(
                    "# open-file limit raised from {} to {}",
                    before.soft, after.soft
                );
            }
            Some(after.soft)
        }
        Err(e) => {
            eprintln!(
                "warning: cannot raise the open-file limit to its hard limit: {e}; connections beyond the current limit will wait"
            );
            tp_serve::fdlimit::open_file_limit().ok().map(|l| l.soft)
        }
    };
    let cap = match flag {
        Some(0) => bail!("--max-connections must be at least 1"),
        Some(n) => {
            if let Some(l) = limit.filter(|&l| n as u64 > l.saturating_sub(fd_reserve(l))) {
                eprintln!(
                    "warning: --max-connections {n} leaves fewer than {} of the {l} open files this process may have for itself; connections beyond what the limit allows wait in the kernel's queue",
                    fd_reserve(l)
                );
            }
            n
        }
        None => default_max_connections(limit.unwrap_or(1024)),
    };
    Ok((cap, limit))
}

/// The server's settings from the flags (the model name and API key already resolved).
fn serve_config(
    args: &ServeArgs,
    model_name: String,
    api_key: Option<String>,
    connections: ConnLimits,
    drain: Duration,
) -> anyhow::Result<ServeConfig> {
    let admin_key = match admin_key(args.admin_key.as_deref())? {
        Some(k) if api_key.as_deref() == Some(k.as_str()) => bail!(
            "the admin key is the API key; give --admin-key ($TP_ADMIN_KEY) a key of its own (every client holds the API key)"
        ),
        k => k,
    };
    Ok(ServeConfig {
        host: args.host,
        port: args.port,
        api_key,
        public_health: args.public_health,
        model_name,
        kv_budget: match (args.max_kv_memory, args.model.max_rank_memory) {
            (Some(b), _) => KvBudget::Bytes(b),
            (None, Some(rank)) => KvBudget::RankMemory(rank),
            (None, None) => KvBudget::Default,
        },
        max_seqs: args.max_seqs,
        max_batch_tokens: args.max_batch_tokens,
        max_queue: args.max_queue,
        max_n: args.max_n,
        max_body_bytes: usize::try_from(args.max_body).unwrap_or(usize::MAX),
        drain_timeout: drain,
        // mpirun answers a failed rank with SIGTERM to the others and SIGKILL about a
        // second later (Open MPI's odls_base_sigkill_timeout): end in-flight requests
        // with an error while the connections can still carry it.
        term_drain_timeout: match args.model.backend {
            Backend::Mpi => drain.min(MPI_TERM_DRAIN),
            Backend::Local => drain,
        },
        collective_timeout: args.model.timeout()?,
        connections,
        log: !args.model.quiet,
        auth_hint: Some("--api-key".into()),
        prefix_cache: !args.no_prefix_cache,
        canary: canary_config(args)?,
        admin_key,
        spec: None,
        swap: SwapConfig {
            policy: match args.swap {
                SwapArg::Auto => SwapPolicy::Auto,
                SwapArg::Drain => SwapPolicy::Drain,
            },
            reload_memory: args.reload_memory,
            model_path: args.model.model_path().ok(),
        },
        unhealthy_linger: Duration::try_from_secs_f64(args.unhealthy_linger)
            .ok()
            .context("--unhealthy-linger must be a non-negative number of seconds")?,
    })
}

/// A server error in the CLI's words: the flags that change it.
pub fn serve_error(e: ServeError) -> anyhow::Error {
    match e {
        ServeError::Bind { addr, source } => anyhow::Error::new(source)
            .context(format!("cannot listen on {addr} (pick another --port or --host)")),
        ServeError::KvOverMachine { budget, machine } => anyhow::anyhow!(
            "a KV budget of {} per rank is more than this machine's {}; lower --max-kv-memory or --max-rank-memory",
            show_bytes(budget),
            show_bytes(machine)
        ),
        ServeError::KvTooSmall {
            budget,
            blocks,
            per_block,
        } => anyhow::anyhow!(
            "a KV budget of {} per rank holds {blocks} blocks of 32 positions ({} each); raise --max-kv-memory or --max-rank-memory",
            show_bytes(budget),
            show_bytes(per_block as u64)
        ),
        e => anyhow::Error::new(e),
    }
}

pub fn run(args: &ServeArgs) -> anyhow::Result<ExitCode> {
    // SIGTERM drains the server (tp-serve's handler); no last-word exit under mpirun.
    tp_engine::launch::command_handles_sigterm();
    if args.max_seqs == 0 || args.max_batch_tokens == 0 {
        bail!("--max-seqs and --max-batch-tokens must be at least 1");
    }
    if args.max_n == 0 {
        bail!("--max-n must be at least 1");
    }
    let drain = Duration::try_from_secs_f64(args.drain_timeout)
        .ok()
        .context("--drain-timeout must be a non-negative number of seconds")?;
    let api_key = api_key(args.api_key.as_deref())?;
    let header_timeout = seconds("--header-timeout", args.header_timeout)?;
    let idle_timeout = seconds("--idle-timeout", args.idle_timeout)?;
    let (max_connections, fd_limit) = connection_cap(args.max_connections, args.model.quiet)?;
    let path = args.model.model_path()?;
    let model_name = match &args.served_model_name {
        Some(n) => n.clone(),
        None => path
            .file_stem()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_else(|| "model".into()),
    };
    let connections = ConnLimits {
        header_timeout,
        idle_timeout,
        max_connections,
    };
    let cfg = serve_config(
        args,
        model_name.clone(),
        api_key.clone(),
        connections,
        drain,
    )?;
    let quiet = args.model.quiet;
    let write_canary = match &args.write_canary {
        Some(p) => Some((p.clone(), canary_prompts(args)?)),
        None => None,
    };
    let canary_failed: Arc<Mutex<Option<String>>> = Arc::default();
    // Checked before any rank starts; rank 0 builds the drafter source.
    args.spec.check()?;
    let draft = args.spec.drafting.draft_path();
    let out = run_model_serving(&args.model, cfg.kv_budget, draft, |s| {
        let mut cfg = cfg.clone();
        cfg.spec = args.spec.serve_spec(s, &args.model)?;
        let ready = |r: &Ready| -> tp_serve::Result<()> {
            if !quiet {
                eprintln!(
                    "# KV budget: {} per rank = {} blocks of 32 positions ({} positions, {} per position on the busiest rank; context {}); up to {} requests at once, {} tokens per step",
                    show_bytes(r.kv.budget_bytes),
                    r.kv.blocks,
                    r.kv.positions(),
                    show_bytes(r.kv.bytes_per_position() as u64),
                    r.ctx_size,
                    args.max_seqs,
                    args.max_batch_tokens
                );
                if let Some(d) = &r.draft {
                    eprintln!(
                        "# KV budget with --draft-model: rank 0's pays {} blocks of the draft ({} each, {} in all) beside the target's, and holds its {} of weights",
                        d.blocks,
                        show_bytes(d.memory.block_bytes as u64),
                        show_bytes(d.kv_bytes()),
                        show_bytes(d.memory.weights)
                    );
                }
                eprintln!(
                    "# connections: at most {max_connections} at once ({}); request headers within {} s, idle keep-alive {} s",
                    fd_limit.map_or("open-file limit unknown".to_string(), |l| format!("open-file limit {l}")),
                    header_timeout.as_secs_f64(),
                    idle_timeout.as_secs_f64()
                );
            }
            if !args.host.is_loopback() && api_key.is_none() {
                eprintln!(
                    "warning: listening on {} without an API key ($TP_API_KEY or --api-key): anyone who can reach this port can use the model",
                    args.host
                );
            }
            println!(
                "{}",
                tp_serve::banner::listening_line(r.addr, &model_name, r.tp, std::process::id())
            );
            std::io::stdout().flush()?;
            if let Some((path, prompts)) = write_canary.clone() {
                let mut client = tp_serve::client::Client::new(r.addr);
                if let Some(k) = &api_key {
                    client = client.with_api_key(k);
                }
                let stop = r.stop.clone();
                let failed = Arc::clone(&canary_failed);
                let max_tokens = args.canary_max_tokens;
                std::thread::spawn(move || {
                    let out =
                        tp_serve::canary::record(&client, &prompts, max_tokens).and_then(|c| {
                            std::fs::write(&path, c.to_jsonl())
                                .map_err(|e| format!("cannot write {}: {e}", path.display()))
                                .map(|()| c.cases.len())
                        });
                    match out {
                        Ok(n) => eprintln!(
                            "# tp serve: wrote a canary of {n} cases to {}",
                            path.display()
                        ),
                        Err(e) => *failed.lock().unwrap_or_else(|p| p.into_inner()) = Some(e),
                    }
                    stop.stop();
                });
            }
            Ok(())
        };
        tp_serve::serve(s, &cfg, ready).map_err(serve_error)?;
        if !quiet {
            eprintln!("# tp serve: stopped");
        }
        Ok(())
    })?;
    if let Some(e) = canary_failed
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .take()
    {
        bail!("--write-canary: {e}");
    }
    Ok(match out {
        Ok(_) => ExitCode::SUCCESS,
        Err(failed) => failed.into(),
    })
}
