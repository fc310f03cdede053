//! A link probe: ping-pong between rank 0 and each other rank, for the latency of one message
//! and the bandwidth of large ones, as `tp plan` takes them (`--link-latency`,
//! `--link-bandwidth`). Point-to-point, as a pipeline stage boundary sends; the peers wait
//! their turn at a barrier.

use crate::communicator::{CommExt, Group};
use crate::error::CommError;
use std::time::{Duration, Instant};

/// Tag of the probe's messages.
const TAG: u32 = 9;

/// What the probe measured between rank 0 and `peer`.
#[derive(Clone, Debug, PartialEq)]
pub struct LinkFigures {
    pub peer: usize,
    /// One way, for a message of a few bytes: half the median round trip.
    pub latency: Duration,
    /// Bytes per second one way for messages of the probe's large size, the small message's
    /// round trip taken out.
    pub bandwidth: f64,
}

/// How the probe runs.
#[derive(Clone, Copy, Debug)]
pub struct ProbeConfig {
    /// Round trips of a small message per peer (the latency is their median).
    pub rounds: usize,
    /// Size of the large messages, bytes.
    pub bytes: usize,
    /// Round trips of a large message per peer (the bandwidth comes from their median).
    pub big_rounds: usize,
}

impl Default for ProbeConfig {
    fn default() -> Self {
        ProbeConfig {
            rounds: 50,
            bytes: 8 << 20,
            big_rounds: 5,
        }
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
}

/// Median round trip (seconds) of `rounds` messages of `words` u32 between rank 0 and
/// `peer` (rank 0 sends first); 0 on the other ranks.
fn round_trip(g: &Group, peer: usize, words: usize, rounds: usize) -> Result<f64, CommError> {
    let mut buf = vec![0u32; words];
    let mut times = Vec::with_capacity(rounds);
    for _ in 0..rounds + 1 {
        if g.rank() == 0 {
            let t = Instant::now();
            g.send(&buf, peer, TAG)?;
            g.recv(&mut buf, peer, TAG)?;
            times.push(t.elapsed().as_secs_f64());
        } else if g.rank() == peer {
            g.recv(&mut buf, 0, TAG)?;
            g.send(&buf, 0, TAG)?;
        }
    }
    // The first round trip warms the connection up.
    Ok(if times.len() > 1 {
        median(times[1..].to_vec())
    } else {
        0.0
    })
}

/// Probes the link from rank 0 to every other rank of `g`, one peer at a time. Collective;
/// the figures are rank 0's (empty on the others).
pub fn probe_links(g: &Group, cfg: &ProbeConfig) -> Result<Vec<LinkFigures>, CommError> {
    let mut out = Vec::new();
    let words = (cfg.bytes / 4).max(1);
    for peer in 1..g.size() {
        g.barrier()?;
        let small = round_trip(g, peer, 1, cfg.rounds.max(1))?;
        let big = round_trip(g, peer, words, cfg.big_rounds.max(1))?;
        if g.rank() == 0 {
            let one_way = ((big - small) / 2.0).max(1e-9);
            out.push(LinkFigures {
                peer,
                latency: Duration::from_secs_f64(small / 2.0),
                bandwidth: (words * 4) as f64 / one_way,
            });
        }
    }
    g.barrier()?;
    Ok(out)
}

/// The slowest link of `links`: the largest latency and the smallest bandwidth (what a plan
/// across all of them must assume); `None` without links.
pub fn slowest(links: &[LinkFigures]) -> Option<(Duration, f64)> {
    let latency = links.iter().map(|l| l.latency).max()?;
    let bandwidth = links
        .iter()
        .map(|l| l.bandwidth)
        .fold(f64::INFINITY, f64::min);
    Some((latency, bandwidth))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::local::{self, LocalOptions};

    #[test]
    fn rank_0_gets_one_positive_figure_per_peer() {
        let cfg = ProbeConfig {
            rounds: 5,
            bytes: 1 << 16,
            big_rounds: 2,
        };
        let out = local::run(3, LocalOptions::default(), |g| {
            probe_links(&g, &cfg).unwrap()
        })
        .unwrap();
        let rank0 = out[0].as_ref().unwrap();
        assert_eq!(rank0.iter().map(|l| l.peer).collect::<Vec<_>>(), [1, 2]);
        assert!(rank0
            .iter()
            .all(|l| l.bandwidth > 0.0 && l.bandwidth.is_finite() && l.latency > Duration::ZERO));
        assert!(out[1].as_ref().unwrap().is_empty());
        let (lat, bw) = slowest(rank0).unwrap();
        assert_eq!(lat, rank0.iter().map(|l| l.latency).max().unwrap());
        assert!(rank0.iter().all(|l| l.bandwidth >= bw));
    }
}
