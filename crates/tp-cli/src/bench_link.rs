//! `tp bench link`: the latency and bandwidth of the link from rank 0 to every other rank
//! (tp-comm's `link` probe, point to point as a pipeline boundary sends), printed with the
//! `tp plan` flags that describe the slowest link. Run it under mpirun across the hosts a plan
//! is for: `mpirun -n 2 --host a,b tp bench link --backend mpi`.

use std::process::ExitCode;
use tp_comm::launch::{host_of, run_ranks, Backend};
use tp_comm::link::{probe_links, slowest, LinkFigures, ProbeConfig};

#[derive(clap::Args, Clone)]
pub struct BenchLinkArgs {
    /// Ranks for the local backend (under MPI, mpirun's -n decides).
    #[arg(long, default_value_t = 2)]
    ranks: usize,
    #[arg(long, default_value_t = Backend::Local, value_parser = crate::model_run::backend_values())]
    backend: Backend,
    /// Round trips of a 4-byte message per peer (the latency is half their median).
    #[arg(long, default_value_t = 50)]
    rounds: usize,
    /// Size of the large messages the bandwidth is measured with, in MiB.
    #[arg(long, default_value_t = 8)]
    mib: usize,
    /// Print one JSON object per peer instead of the table.
    #[arg(long)]
    json: bool,
    /// Deadline of each message, in seconds.
    #[arg(long, default_value_t = 60.0)]
    timeout: f64,
}

/// The table, and the `tp plan` flags of the slowest link.
fn report(links: &[LinkFigures], cfg: &ProbeConfig) -> String {
    use std::fmt::Write as _;
    let mut out = format!(
        "# link probe from rank 0 ({}): latency = half the median round trip of a 4-byte message ({} round trips); bandwidth = {} MiB one way (median of {}), the small round trip taken out\n",
        host_of(0),
        cfg.rounds,
        cfg.bytes >> 20,
        cfg.big_rounds
    );
    let _ = writeln!(
        out,
        "{:>5}  {:<16}  {:>11}  {:>14}",
        "rank", "host", "latency us", "bandwidth"
    );
    for l in links {
        let _ = writeln!(
            out,
            "{:>5}  {:<16}  {:>11.1}  {:>9.3} Gbit/s",
            l.peer,
            host_of(l.peer),
            l.latency.as_secs_f64() * 1e6,
            l.bandwidth * 8.0 / 1e9
        );
    }
    if let Some((latency, bandwidth)) = slowest(links) {
        let _ = writeln!(
            out,
            "# for tp plan (the slowest link): --link-latency {}us --link-bandwidth {}mbit",
            latency.as_micros().max(1),
            ((bandwidth * 8.0 / 1e6).round() as u64).max(1)
        );
    }
    out
}

pub fn run(args: &BenchLinkArgs) -> anyhow::Result<ExitCode> {
    let timeout = crate::model_run::seconds("--timeout", args.timeout)?;
    anyhow::ensure!(
        args.rounds > 0 && args.mib > 0,
        "--rounds and --mib must be at least 1"
    );
    let cfg = ProbeConfig {
        rounds: args.rounds,
        bytes: args.mib << 20,
        ..ProbeConfig::default()
    };
    let out = run_ranks(args.backend, args.ranks, timeout, |world| {
        anyhow::ensure!(world.size() > 1, "a link probe needs at least 2 ranks");
        let links = probe_links(&world, &cfg)?;
        if world.rank() == 0 {
            if args.json {
                for l in &links {
                    let line = serde_json::json!({
                        "peer": l.peer,
                        "host": host_of(l.peer),
                        "latency_us": l.latency.as_secs_f64() * 1e6,
                        "bandwidth_gbit_s": l.bandwidth * 8.0 / 1e9,
                    });
                    println!("{line}");
                }
            } else {
                println!("# CPU: {}", tp_kernels::kernel_report());
                print!("{}", report(&links, &cfg));
            }
        }
        Ok(())
    })?;
    match out {
        Ok(_) => Ok(ExitCode::SUCCESS),
        Err(failed) => Ok(failed.into()),
    }
}
