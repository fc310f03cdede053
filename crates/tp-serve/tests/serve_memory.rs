//! Resident memory of a server comes back after 100 finished requests: KV blocks are
//! unmapped as sequences end. Its own test binary, so no other test's allocations share the
//! process while it measures.

mod common;

use common::{complete, config, rss_bytes, settled_metric, with_server};
use tp_serve::client::Client;
use tp_serve::ServeConfig;

/// Resident memory after 100 finished requests is back within 5% of what the idle server
/// held (KV blocks are returned to the system as requests end; the prefix cache is off).
#[test]
fn memory_returns_to_the_idle_baseline_after_100_requests() {
    let cfg = ServeConfig {
        prefix_cache: false,
        max_queue: 64,
        ..config()
    };
    let (_, (idle, after)) = with_server(2, 512, cfg, |ready| {
        let c = Client::new(ready.addr);
        // Warm-up with the measured pattern (4 client threads), so that thread stacks, the
        // HTTP stack and the allocator's per-thread arenas reach their steady state first.
        load(&c, 4, 6);
        assert_eq!(settled_metric(&c, "tp_kv_blocks_used", 0.0), 0.0);
        let idle = rss_bytes();
        load(&c, 4, 25);
        assert_eq!(settled_metric(&c, "tp_kv_blocks_used", 0.0), 0.0);
        (idle, rss_bytes())
    });
    if let (Some(idle), Some(after)) = (idle, after) {
        eprintln!("resident memory: {idle} bytes idle, {after} after 100 requests");
        assert!(
            after as f64 <= idle as f64 * 1.05,
            "resident memory {after} bytes after 100 requests, {idle} idle"
        );
    }
}

/// `threads` clients, each sending `each` requests of mixed lengths one after another.
fn load(c: &Client, threads: usize, each: usize) {
    std::thread::scope(|s| {
        for t in 0..threads {
            let c = c.clone();
            s.spawn(move || {
                for i in 0..each {
                    let prompt = format!("request {t} {i} ").repeat(3 + i % 9);
                    complete(&c, &prompt, 60 + i * 5);
                }
            });
        }
    });
}
