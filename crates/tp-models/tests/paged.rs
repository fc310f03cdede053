//! The paged KV cache gives exactly the bits of a sequence run alone in a fresh cache (an f32
//! cache), at tp 1..4, when blocks come in a scrambled order and sequences share a prefix
//! (a fork in the middle of a block) and then diverge: copy-on-write keeps every sequence's
//! own positions, and the shared ones are read, not recomputed.

use tp_comm::local::{self, LocalOptions};
use tp_models::synthetic::{GgufTypes, SyntheticModel};
use tp_models::{
    open_checkpoint, Arch, BlockTable, Chunk, KvPool, LoadOptions, Profile, ShardedModel,
};
use tp_testkit::Rng;

/// Block ids from a fixed scrambled order, skipping those in use.
struct Scrambled(Rng);

impl Scrambled {
    fn grow(&mut self, pool: &mut KvPool, table: &mut BlockTable, n: usize) {
        let mut ids = Vec::new();
        while ids.len() < pool.blocks_needed(table, n) {
            let id = self.0.below(200) as u32;
            if pool.refs(id) == 0 && !ids.contains(&id) {
                ids.push(id);
            }
        }
        pool.grow(table, n, &ids).unwrap();
    }
}

/// Every position's logits of `tokens` run alone from an empty cache in one pass.
fn alone(m: &ShardedModel, g: &tp_comm::Group, tokens: &[u32]) -> Vec<Vec<f32>> {
    let mut pool = m.new_pool();
    let mut table = m.new_table(256);
    let mut prof = Profile::default();
    let local = m
        .forward(
            &mut [Chunk {
                tokens,
                table: &mut table,
                all_logits: true,
            }],
            &mut pool,
            g,
            &mut prof,
        )
        .unwrap();
    let all = m.gather_logits(local, tokens.len(), g, &mut prof).unwrap();
    let vocab = all.len() / tokens.len();
    all.chunks_exact(vocab).map(<[f32]>::to_vec).collect()
}

/// Feeds `tokens` to each `(table, tokens)` in one step, returning every position's logits.
fn step(
    m: &ShardedModel,
    g: &tp_comm::Group,
    pool: &mut KvPool,
    seqs: &mut [(&mut BlockTable, &[u32])],
) -> Vec<Vec<Vec<f32>>> {
    let mut prof = Profile::default();
    let rows: usize = seqs.iter().map(|(_, t)| t.len()).sum();
    let mut chunks: Vec<Chunk<'_>> = seqs
        .iter_mut()
        .map(|(table, tokens)| Chunk {
            tokens,
            table,
            all_logits: true,
        })
        .collect();
    let local = m.forward(&mut chunks, pool, g, &mut prof).unwrap();
    let all = m.gather_logits(local, rows, g, &mut prof).unwrap();
    let vocab = all.len() / rows;
    let mut rows = all.chunks_exact(vocab).map(<[f32]>::to_vec);
    seqs.iter()
        .map(|(_, t)| rows.by_ref().take(t.len()).collect())
        .collect()
}

fn same_bits(a: &[f32], b: &[f32]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
}

#[test]
fn forked_sequences_in_scrambled_blocks_equal_each_sequence_alone() {
    let cfg = SyntheticModel::small(Arch::Llama, 3).cfg;
    let dir = std::env::temp_dir().join(format!("tp-paged-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("m.gguf");
    SyntheticModel::new(cfg.clone(), 3)
        .write_gguf(&path, GgufTypes::F32)
        .unwrap();
    let ckpt = open_checkpoint(&path).unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    let tok = |i: usize| ((i * 37 + 11) % cfg.vocab) as u32;
    // A: 45 prompt tokens then 2 more; B forks A at 37 (mid-block) and takes 30; C forks B
    // at 50 (B's own block) and takes 3.
    let a: Vec<u32> = (0..47).map(tok).collect();
    let b: Vec<u32> = a[..37].iter().copied().chain((100..130).map(tok)).collect();
    let c: Vec<u32> = b[..50].iter().copied().chain((200..203).map(tok)).collect();
    let mut reference: Option<Vec<Vec<Vec<f32>>>> = None;
    for tp in 1..=4 {
        let out = local::run(tp, LocalOptions::default(), |g| {
            let m = ShardedModel::load(&*ckpt, g.rank(), tp, LoadOptions::default(), 256).unwrap();
            let want: Vec<Vec<Vec<f32>>> = [&a, &b, &c].iter().map(|s| alone(&m, &g, s)).collect();
            let mut pool = m.new_pool();
            let mut ids = Scrambled(Rng::new(tp as u64));
            let mut ta = m.new_table(256);
            ids.grow(&mut pool, &mut ta, 45);
            let mut got_a = step(&m, &g, &mut pool, &mut [(&mut ta, &a[..45])]).remove(0);
            let mut tb = pool.fork(&ta, 37, 256).unwrap();
            // B's first write copies the shared block; A's next write then has it alone.
            ids.grow(&mut pool, &mut tb, 13);
            ids.grow(&mut pool, &mut ta, 2);
            let mut both = step(
                &m,
                &g,
                &mut pool,
                &mut [(&mut tb, &b[37..50]), (&mut ta, &a[45..])],
            );
            got_a.extend(both.remove(1));
            let mut got_b = both.remove(0);
            let mut tc = pool.fork(&tb, 50, 256).unwrap();
            ids.grow(&mut pool, &mut tc, 3);
            ids.grow(&mut pool, &mut tb, 17);
            let mut both = step(
                &m,
                &g,
                &mut pool,
                &mut [(&mut tc, &c[50..]), (&mut tb, &b[50..])],
            );
            got_b.extend(both.remove(1));
            let got_c = both.remove(0);
            // Shared blocks: A's first block is held by all three.
            assert_eq!(pool.refs(ta.blocks()[0]), 3);
            for t in [&mut ta, &mut tb, &mut tc] {
                pool.release(t);
            }
            assert_eq!(pool.in_use(), 0);
            (want, got_a, got_b, got_c)
        })
        .unwrap();
        let (want, got_a, got_b, got_c) = out.into_iter().next().unwrap().unwrap();
        // Paged and forked = alone (positions the forks shared are not recomputed: compare
        // each sequence's own new positions).
        let checks = [
            ("A", &got_a, &want[0], 0),
            ("B", &got_b, &want[1], 37),
            ("C", &got_c, &want[2], 50),
        ];
        for (name, got, want, from) in checks {
            assert_eq!(got.len(), want.len() - from, "{name} at tp {tp}");
            for (p, (g, w)) in got.iter().zip(&want[from..]).enumerate() {
                assert!(same_bits(g, w), "{name} position {} at tp {tp}", from + p);
            }
        }
        // And every tp gives tp 1's bits.
        match &reference {
            None => reference = Some(want),
            Some(r) => {
                for (s, (x, y)) in r.iter().zip(&want).enumerate() {
                    for (p, (u, v)) in x.iter().zip(y).enumerate() {
                        assert!(
                            same_bits(u, v),
                            "sequence {s} position {p}: tp {tp} != tp 1"
                        );
                    }
                }
            }
        }
    }
}
