//! `tp`: the tensor-parallel command line. Parses arguments, then calls down into the crates.

mod bench_collectives;
mod bench_decode;
mod bench_link;
mod bench_serve;
mod bench_train;
mod chat;
mod generate;
mod inspect;
mod model_run;
mod perplexity;
mod selftest;
mod serve;
mod train;

use clap::{CommandFactory, FromArgMatches, Parser, Subcommand};
use std::process::ExitCode;

#[derive(Parser)]
#[command(
    name = "tp",
    version,
    about = "Tensor-parallel transformers: split every layer over N ranks"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Continues a prompt with a model sharded over --tp ranks, streaming the text.
    Generate(generate::GenerateArgs),
    /// Interactive multi-turn chat (the model's chat template applied).
    Chat(chat::ChatArgs),
    /// OpenAI-compatible HTTP server (chat and text completions, streaming, continuous batching).
    Serve(serve::ServeArgs),
    /// Shapes of a model and the shard each rank gets at --tp.
    Inspect(inspect::InspectArgs),
    /// Mean negative log-likelihood and perplexity of a text file.
    Perplexity(perplexity::PerplexityArgs),
    /// Benchmarks.
    Bench {
        #[command(subcommand)]
        what: Bench,
    },
    /// Runs the collectives conformance suite on this backend (use it to check a cluster).
    Selftest(selftest::SelftestArgs),
    /// Chooses tp, pp, dp (and micro-batch, recompute, ...) for a model on a cluster.
    Plan(tp_plan::cli::PlanArgs),
    /// Trains a Llama, Qwen2, Qwen3 or Gemma-3 model with tensor, pipeline and data parallelism.
    Train(Box<train::TrainArgs>),
}

#[derive(Subcommand)]
enum Bench {
    /// nccl-tests-style sweep of all_reduce, all_gather, reduce_scatter, broadcast and all_to_all.
    Collectives(bench_collectives::BenchArgs),
    /// Batch-1 prefill and decode speed per tp, time split and bandwidth limit.
    Decode(bench_decode::BenchDecodeArgs),
    /// Latency and bandwidth from rank 0 to every other rank (run under mpirun across the
    /// hosts), with the `tp plan` flags of the slowest link.
    Link(bench_link::BenchLinkArgs),
    /// Training step time, tokens/s and MFU at several tp x pp x dp layouts.
    Train(bench_train::BenchTrainArgs),
    /// `tp serve` under load: throughput, time to first token and per output token at each
    /// concurrency and tp.
    Serve(bench_serve::BenchServeArgs),
}

/// Lets every option that takes a value accept one that starts with `-` and looks like a
/// number (`--temperature -1`), so the command's own range check explains what is allowed,
/// instead of clap reading `-1` as an unknown option.
fn negative_numbers_are_values(cmd: clap::Command) -> clap::Command {
    let cmd = cmd.mut_args(|a| {
        if a.get_action().takes_values() {
            a.allow_negative_numbers(true)
        } else {
            a
        }
    });
    cmd.mut_subcommands(negative_numbers_are_values)
}

/// A reader that closes our stdout early (`tp plan ... | head`) ends the run quietly, as it
/// ends other Unix tools (status 141 = 128 + SIGPIPE), not with a panic and a backtrace: Rust
/// ignores SIGPIPE, so a print to a closed pipe panics instead.
fn end_quietly_when_stdout_closes() {
    let next = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        let payload = info.payload();
        let message = payload
            .downcast_ref::<String>()
            .map(String::as_str)
            .or_else(|| payload.downcast_ref::<&str>().copied())
            .unwrap_or("");
        if message.contains("failed printing to stdout") && message.contains("Broken pipe") {
            std::process::exit(141);
        }
        next(info);
    }));
}

fn main() -> ExitCode {
    end_quietly_when_stdout_closes();
    let matches = negative_numbers_are_values(Cli::command()).get_matches();
    let cli = Cli::from_arg_matches(&matches).unwrap_or_else(|e| e.exit());
    let result = match cli.command {
        Command::Generate(args) => generate::run(&args),
        Command::Chat(args) => chat::run(&args),
        Command::Serve(args) => serve::run(&args),
        Command::Inspect(args) => inspect::run(&args),
        Command::Perplexity(args) => perplexity::run(&args),
        Command::Bench {
            what: Bench::Collectives(args),
        } => bench_collectives::run(&args),
        Command::Bench {
            what: Bench::Decode(args),
        } => bench_decode::run(&args),
        Command::Bench {
            what: Bench::Link(args),
        } => bench_link::run(&args),
        Command::Bench {
            what: Bench::Train(args),
        } => bench_train::run(&args),
        Command::Bench {
            what: Bench::Serve(args),
        } => bench_serve::run(&args),
        Command::Selftest(args) => selftest::run(&args),
        Command::Train(args) => train::run(&args),
        Command::Plan(args) => tp_plan::cli::run(&args)
            .map(|text| {
                println!("{text}");
                ExitCode::SUCCESS
            })
            .map_err(anyhow::Error::from),
    };
    match result {
        Ok(code) => code,
        Err(e) => {
            eprintln!("error: {}", tp_engine::report::chain(&*e));
            ExitCode::from(2)
        }
    }
}
