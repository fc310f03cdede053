//! `tp`: the tensor-parallel command line. Parses arguments, then calls down into the crates.

mod bench_collectives;
mod bench_train;
mod launch;
mod selftest;
mod train;

use clap::{Parser, Subcommand};
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
    /// Benchmarks.
    Bench {
        #[command(subcommand)]
        what: Bench,
    },
    /// Runs the collectives conformance suite on this backend (use it to check a cluster).
    Selftest(selftest::SelftestArgs),
    /// Chooses tp, pp, dp (and micro-batch, recompute, ...) for a model on a cluster.
    Plan(tp_plan::cli::PlanArgs),
    /// Trains a Llama-style model with tensor, pipeline and data parallelism.
    Train(Box<train::TrainArgs>),
}

#[derive(Subcommand)]
enum Bench {
    /// nccl-tests-style sweep of all_reduce, all_gather, reduce_scatter and broadcast.
    Collectives(bench_collectives::BenchArgs),
    /// Training step time, tokens/s and MFU at several tp x pp x dp layouts.
    Train(bench_train::BenchTrainArgs),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Bench {
            what: Bench::Collectives(args),
        } => bench_collectives::run(&args),
        Command::Bench {
            what: Bench::Train(args),
        } => bench_train::run(&args),
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
            eprintln!("error: {e:#}");
            ExitCode::from(2)
        }
    }
}
