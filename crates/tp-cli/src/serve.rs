//! `tp serve`: the OpenAI-compatible server. Rank 0 runs the HTTP front end (its own thread)
//! and the continuous-batching scheduler (on the rank thread, which owns the worker); the
//! other ranks follow its steps. The KV budget comes from --max-kv-memory, or from
//! --max-rank-memory minus the weights, or defaults to 1 GiB per rank.

use crate::model_run::{memory_plan, run_model, ModelArgs};
use crate::units::{parse_bytes, show_bytes};
use anyhow::{bail, Context};
use std::io::Write;
use std::net::IpAddr;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;
use tp_models::{open_checkpoint, SeqCache, ShardPlan};
use tp_serve::{Load, Metrics, SchedulerConfig, SchedulerHandle, Server, ServerConfig};

/// KV budget per rank when neither --max-kv-memory nor --max-rank-memory is given.
const DEFAULT_KV_BYTES: u64 = 1 << 30;

#[derive(clap::Args, Clone, Debug)]
pub struct ServeArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Address to listen on. Loopback by default; anything else is reachable from the network
    /// (use --api-key then).
    #[arg(long, default_value = "127.0.0.1")]
    pub host: IpAddr,
    /// Port to listen on (0: any free port; the address is printed).
    #[arg(long, default_value_t = 8000)]
    pub port: u16,
    /// Require `Authorization: Bearer KEY` on every request (or set $TP_API_KEY).
    #[arg(long)]
    pub api_key: Option<String>,
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
    /// Requests allowed to wait for admission; beyond it new ones get 429.
    #[arg(long, default_value_t = 256)]
    pub max_queue: usize,
    /// Largest request body, e.g. 1MiB; larger bodies get 413.
    #[arg(long, value_parser = parse_bytes, default_value = "1MiB")]
    pub max_body: u64,
    /// Seconds in-flight requests get to finish after SIGINT/SIGTERM.
    #[arg(long, default_value_t = 30.0)]
    pub drain_timeout: f64,
}

pub fn run(args: &ServeArgs) -> anyhow::Result<ExitCode> {
    if args.max_seqs == 0 || args.max_batch_tokens == 0 {
        bail!("--max-seqs and --max-batch-tokens must be at least 1");
    }
    let drain = Duration::try_from_secs_f64(args.drain_timeout)
        .ok()
        .context("--drain-timeout must be a non-negative number of seconds")?;
    let api_key = args
        .api_key
        .clone()
        .or_else(|| std::env::var("TP_API_KEY").ok())
        .filter(|k| !k.is_empty());
    let path = args.model.model_path()?;
    let model_name = match &args.served_model_name {
        Some(n) => n.clone(),
        None => path
            .file_stem()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_else(|| "model".into()),
    };
    let quiet = args.model.quiet;
    let out = run_model(&args.model, |s| {
        let tp = s.worker.group().size();
        let cfg = s.worker.model().config().clone();
        // The busiest rank's KV bytes per position bound how many positions fit.
        let mut per_position = 0;
        for r in 0..tp {
            let plan = ShardPlan::new(&cfg, 1, r, tp)?;
            let width = plan.kv_heads().len() * cfg.head_dim;
            per_position = per_position.max(SeqCache::bytes_for(cfg.layers, width, 1));
        }
        let budget = match (args.max_kv_memory, args.model.max_rank_memory) {
            (Some(b), _) => b,
            (None, Some(rank)) => {
                let ckpt = open_checkpoint(&path)?;
                let plan = memory_plan(&*ckpt, tp, s.ctx_size, args.model.load_options())?;
                let weights = plan
                    .iter()
                    .map(|m| (m.sharded + m.replicated) as u64)
                    .max()
                    .unwrap_or(0);
                rank.saturating_sub(weights)
            }
            (None, None) => DEFAULT_KV_BYTES,
        };
        // A budget is reserved as requests arrive; one larger than the machine would let
        // admissions outrun memory instead of queueing.
        if let Some(machine) = tp_models::limits::physical_memory().filter(|&m| budget > m) {
            bail!(
                "a KV budget of {} per rank is more than this machine's {}; lower --max-kv-memory or --max-rank-memory",
                show_bytes(budget),
                show_bytes(machine)
            );
        }
        let positions = (budget / per_position.max(1) as u64) as usize;
        if positions < 2 {
            bail!(
                "a KV budget of {} per rank holds {positions} positions ({} each); raise --max-kv-memory or --max-rank-memory",
                show_bytes(budget),
                show_bytes(per_position as u64)
            );
        }
        let sched_cfg = SchedulerConfig {
            max_seqs: args.max_seqs,
            kv_budget_positions: positions,
            max_batch_tokens: args.max_batch_tokens,
            heartbeat: Duration::from_secs(1)
                .min(args.model.timeout()? / 4)
                .max(Duration::from_millis(10)),
        };
        let server_cfg = ServerConfig {
            host: args.host,
            port: args.port,
            api_key: api_key.clone(),
            model_name: model_name.clone(),
            ctx_size: s.ctx_size,
            kv_budget_positions: positions,
            vocab: cfg.vocab,
            max_body_bytes: usize::try_from(args.max_body).unwrap_or(usize::MAX),
            max_queue: args.max_queue,
            drain_timeout: drain,
            event_timeout: Duration::from_secs(120).max(args.model.timeout()? * 2),
            log: !quiet,
        };
        let metrics = Arc::new(Metrics::new());
        let load = Arc::new(Load::default());
        let (tx, rx) = std::sync::mpsc::channel();
        let handle = SchedulerHandle {
            control: tx,
            load: Arc::clone(&load),
        };
        let server = Server::start(
            server_cfg,
            Arc::new(s.tokenizer.clone()),
            handle,
            Arc::clone(&metrics),
        )?;
        if !quiet {
            eprintln!(
                "# KV budget: {} per rank = {positions} positions ({} per position on the busiest rank; context {}); up to {} requests at once, {} tokens per step",
                show_bytes(budget),
                show_bytes(per_position as u64),
                s.ctx_size,
                args.max_seqs,
                args.max_batch_tokens
            );
        }
        if !args.host.is_loopback() && api_key.is_none() {
            eprintln!(
                "warning: listening on {} without --api-key: anyone who can reach this port can use the model",
                args.host
            );
        }
        println!(
            "{}",
            tp_serve::banner::listening_line(server.addr, &model_name, tp, std::process::id())
        );
        std::io::stdout().flush()?;
        let result = tp_serve::scheduler::run(
            &mut s.worker,
            &s.tokenizer,
            &sched_cfg,
            &rx,
            &load,
            &metrics,
        );
        // New requests now fail at once; the HTTP side drains what it holds.
        drop(rx);
        if result.is_err() {
            server.stop();
        }
        let joined = server.join();
        result?;
        joined?;
        if !quiet {
            eprintln!("# tp serve: stopped");
        }
        Ok(())
    })?;
    Ok(match out {
        Ok(_) => ExitCode::SUCCESS,
        Err(code) => code,
    })
}
