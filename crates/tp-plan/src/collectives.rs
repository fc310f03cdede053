//! α-β cost of the collectives the layouts need: ring all-reduce
//! 2(n-1)/n·bytes/bw + 2(n-1)·α (Patarasuk & Yuan 2009; Thakur et al. 2005),
//! ring all-gather / reduce-scatter, all-to-all and point-to-point sends.

/// A link: per-device bandwidth (bytes/s) and per-step latency (s).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Link {
    pub bandwidth: f64,
    pub latency_s: f64,
}

/// Ring all-reduce of `bytes` over `ranks` ranks: reduce-scatter then all-gather.
pub fn ring_all_reduce_s(bytes: f64, ranks: u64, link: Link) -> f64 {
    if ranks <= 1 {
        return 0.0;
    }
    let n = ranks as f64;
    2.0 * (n - 1.0) / n * bytes / link.bandwidth + 2.0 * (n - 1.0) * link.latency_s
}

/// All-reduce of `bytes` over `ranks` as an engine picks for the buffer: the ring, or for
/// small buffers every rank sending its whole buffer to every peer at once and reducing
/// locally (one message step: α + (n-1)·bytes/bw; tp-comm's MPI backend does this up to
/// 256 KiB at 2 ranks), whichever is faster. Decode's per-layer all-reduces are small.
pub fn all_reduce_s(bytes: f64, ranks: u64, link: Link) -> f64 {
    if ranks <= 1 {
        return 0.0;
    }
    let direct = link.latency_s + (ranks - 1) as f64 * bytes / link.bandwidth;
    ring_all_reduce_s(bytes, ranks, link).min(direct)
}

/// Ring all-gather (or reduce-scatter) whose full result is `bytes`.
pub fn ring_all_gather_s(bytes: f64, ranks: u64, link: Link) -> f64 {
    if ranks <= 1 {
        return 0.0;
    }
    let n = ranks as f64;
    (n - 1.0) / n * bytes / link.bandwidth + (n - 1.0) * link.latency_s
}

/// All-to-all where each rank starts with `bytes` and keeps 1/n of it.
pub fn all_to_all_s(bytes: f64, ranks: u64, link: Link) -> f64 {
    ring_all_gather_s(bytes, ranks, link)
}

/// One point-to-point send.
pub fn send_s(bytes: f64, link: Link) -> f64 {
    bytes / link.bandwidth + link.latency_s
}

#[cfg(test)]
mod tests {
    use super::*;

    const LINK: Link = Link {
        bandwidth: 100e9,
        latency_s: 1e-6,
    };

    #[test]
    fn all_reduce_hand_computed() {
        // 8 ranks, 1 GB: 2·7/8·1e9/100e9 = 0.0175 s, plus 14·1 µs = 0.000014 s.
        let t = ring_all_reduce_s(1e9, 8, LINK);
        assert!((t - 0.017514).abs() < 1e-12);
        assert_eq!(ring_all_reduce_s(1e9, 1, LINK), 0.0);
    }

    #[test]
    fn all_reduce_is_reduce_scatter_plus_all_gather() {
        // The identity sequence parallelism relies on (Korthikanti et al. §4.2.2).
        let ar = ring_all_reduce_s(3e8, 4, LINK);
        let rs_ag = 2.0 * ring_all_gather_s(3e8, 4, LINK);
        assert!((ar - rs_ag).abs() < 1e-15);
    }

    #[test]
    fn send_hand_computed() {
        // 1 MB over 100 GB/s = 10 µs, plus 1 µs.
        assert!((send_s(1e6, LINK) - 11e-6).abs() < 1e-15);
    }
}
