//! Stand-alone `tp plan` until the main binary wires it: `cargo run -p tp-plan --example plan -- --model llama-3-8b --gpus 8`.

use clap::Parser;

#[derive(Parser)]
struct Cli {
    #[command(flatten)]
    plan: tp_plan::cli::PlanArgs,
}

fn main() {
    let cli = Cli::parse();
    match tp_plan::cli::run(&cli.plan) {
        Ok(text) => print!("{text}"),
        Err(e) => {
            eprintln!("error: {e}");
            std::process::exit(2);
        }
    }
}
