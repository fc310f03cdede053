//! `tp bench decode`: batch-1 prefill and decode speed at each tp, the time per token split
//! into compute, all-reduce and waiting, against the memory-bandwidth limit (tp-engine's
//! `bench`: the measuring, the table and the JSON). Under mpirun the tp is the number of
//! processes unless --tps or --tp says otherwise.

use crate::generate::{Drafting, SpecArg, SpecArgs};
use crate::model_run::{run_model, run_model_holding, ModelArgs};
use anyhow::bail;
use std::process::ExitCode;
use tp_engine::bench::{header, json, measure, row, DecodeBench};
use tp_engine::bench_spec::{
    measure_spec, spec_header, spec_json, spec_row, BenchDrafter, SpecBench,
};
use tp_engine::launch::Backend;
use tp_engine::{DraftAhead, DraftTokens};

#[derive(clap::Args, Clone, Debug)]
pub struct BenchDecodeArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// tp sizes to measure, e.g. 1,2 [default: --tp if given; else 1,2, and under mpirun the
    /// number of processes].
    #[arg(long, value_delimiter = ',')]
    pub tps: Option<Vec<usize>>,
    /// Prompt length in tokens.
    #[arg(long, default_value_t = 128)]
    pub prompt_tokens: usize,
    /// Tokens generated per run (greedy; end-of-sequence ignored).
    #[arg(long, default_value_t = 128)]
    pub gen_tokens: usize,
    /// Runs per tp; the median is reported.
    #[arg(long, default_value_t = 3)]
    pub repeats: usize,
    /// Print one JSON object per tp on stdout instead of the table.
    #[arg(long)]
    pub json: bool,
    /// Measure speculative decoding on an input-grounded workload (the model rewrites code
    /// it was given): the same greedy generation without and with it, acceptance rate,
    /// tokens per target step, and the cost of a verification step.
    #[arg(long, value_enum, default_value_t = SpecArg::None)]
    pub spec: SpecArg,
    /// Measure speculative decoding with this draft model instead (same vocabulary).
    #[arg(long, value_name = "FILE")]
    pub draft_model: Option<std::path::PathBuf>,
    /// Tokens drafted per step with --spec, 1 to 32 [default: adaptive].
    #[arg(long, value_name = "K")]
    pub draft_tokens: Option<usize>,
    /// With --draft-model: draft ahead on a free core while the model verifies (as tp
    /// generate's --draft-ahead).
    #[arg(long, value_name = "WHEN", default_value = "auto", value_parser = crate::generate::parse_draft_ahead)]
    pub draft_ahead: DraftAhead,
}

pub fn run(args: &BenchDecodeArgs) -> anyhow::Result<ExitCode> {
    // `None`: the launcher's tp (under mpirun, the number of processes).
    let tps: Vec<Option<usize>> = match (&args.tps, args.model.tp, args.model.backend) {
        (Some(tps), _, _) => tps.iter().copied().map(Some).collect(),
        (None, Some(tp), _) => vec![Some(tp)],
        (None, None, Backend::Mpi) => vec![None],
        (None, None, Backend::Local) => vec![Some(1), Some(2)],
    };
    if tps.is_empty() || tps.contains(&Some(0)) {
        bail!("--tps needs tp sizes of at least 1, e.g. --tps 1,2");
    }
    if args.prompt_tokens == 0 || args.gen_tokens < 2 || args.repeats == 0 {
        bail!("--prompt-tokens >= 1, --gen-tokens >= 2 and --repeats >= 1 are needed");
    }
    let bench = DecodeBench {
        prompt_tokens: args.prompt_tokens,
        gen_tokens: args.gen_tokens,
        repeats: args.repeats,
    };
    // Validated as generate's flags are (the same words).
    let spec = SpecArgs {
        spec: args.spec,
        draft_model: args.draft_model.clone(),
        draft_tokens: args.draft_tokens,
        draft_ahead: args.draft_ahead,
    };
    match spec.drafting()? {
        Drafting::Off => {}
        Drafting::Method(m, tokens) => {
            return run_spec(args, &tps, BenchDrafter::Method(m), tokens)
        }
        Drafting::Model(path, tokens) => {
            let opts = args.model.load_options();
            return run_spec(args, &tps, BenchDrafter::Model { path, opts }, tokens);
        }
    }
    let mut header_done = false;
    for tp in tps {
        let mut margs = args.model.clone();
        margs.tp = tp;
        margs.quiet = true;
        margs.ctx_size = Some(
            args.model
                .ctx_size
                .unwrap_or(args.prompt_tokens + args.gen_tokens + 1),
        );
        let figures = match run_model(&margs, |s| Ok(measure(s, bench)?))? {
            Ok(Some(f)) => f,
            Ok(None) => return Ok(ExitCode::SUCCESS), // a follower process under MPI
            Err(failed) => return Ok(failed.into()),
        };
        if args.json {
            println!("{}", json(&figures));
            continue;
        }
        if !std::mem::replace(&mut header_done, true) {
            println!("{}", header(bench, &figures));
        }
        println!("{}", row(&figures));
    }
    Ok(ExitCode::SUCCESS)
}

/// `--spec`: plain against speculative decoding, per tp.
fn run_spec(
    args: &BenchDecodeArgs,
    tps: &[Option<usize>],
    drafter: BenchDrafter,
    tokens: DraftTokens,
) -> anyhow::Result<ExitCode> {
    let mut bench = SpecBench {
        drafter,
        tokens,
        gen_tokens: args.gen_tokens,
        repeats: args.repeats,
        ahead: args.draft_ahead,
        ranks_here: 1,
    };
    let mut header_done = false;
    for &tp in tps {
        let mut margs = args.model.clone();
        margs.tp = tp;
        margs.quiet = true;
        // The edit prompt is about 300 tokens.
        margs.ctx_size = Some(args.model.ctx_size.unwrap_or(1024 + args.gen_tokens));
        bench.ranks_here = crate::generate::ranks_in_process(&margs, tp.unwrap_or(1));
        // A draft model is priced by the preflight beside the target, as `tp generate` does.
        let draft = match &bench.drafter {
            BenchDrafter::Model { path, .. } => Some(path.clone()),
            BenchDrafter::Method(_) => None,
        };
        let figures =
            match run_model_holding(&margs, None, draft, |s| Ok(measure_spec(s, &bench)?))? {
                Ok(Some(f)) => f,
                Ok(None) => return Ok(ExitCode::SUCCESS),
                Err(failed) => return Ok(failed.into()),
            };
        if args.json {
            println!("{}", spec_json(&figures));
            continue;
        }
        if !std::mem::replace(&mut header_done, true) {
            println!("{}", spec_header(&bench, &figures));
        }
        println!("{}", spec_row(&figures));
    }
    Ok(ExitCode::SUCCESS)
}
