//! Attention's paths against each other (bit for bit), its exp against f64, the paged cache
//! against a contiguous layout, and the whole against an f64 reference.

use super::*;
use crate::kv_cache::{BlockTable, KvDtype, KvPool};
use crate::testutil::{rng, same_bits};

/// The paths this CPU can run.
fn paths() -> Vec<Path> {
    #[allow(unused_mut)]
    let mut p = vec![Path::Portable];
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx2") {
            p.push(Path::Avx2);
        }
        if std::arch::is_x86_feature_detected!("avx512f") {
            p.push(Path::Avx512);
        }
    }
    p
}

#[test]
fn softmax_paths_agree_for_every_range() {
    let mut next = rng(11);
    let s0: Vec<f32> = (0..64).map(|_| next() * 9.0).collect();
    for lo in [0, 1, 5, 15, 16, 17, 40] {
        for hi in [lo, lo + 1, lo + 7, 48, 63, 64] {
            if hi < lo || hi > 64 || hi == lo {
                continue;
            }
            let mut want = s0.clone();
            softmax(Path::Portable, &mut want, lo, hi);
            let total: f32 = want[lo..hi].iter().sum();
            assert!((total - 1.0).abs() < 1e-5, "{lo}..{hi}: sums to {total}");
            for path in paths() {
                let mut got = s0.clone();
                softmax(path, &mut got, lo, hi);
                assert!(
                    same_bits(&got[lo..hi], &want[lo..hi]),
                    "{path:?} {lo}..{hi}"
                );
            }
        }
    }
}

/// A one-layer f32 pool holding `keys`/`values` (`[positions, kv_heads * hd]`) in scattered
/// blocks.
fn pool_with(kv_heads: usize, hd: usize, keys: &[f32], values: &[f32]) -> (KvPool, BlockTable) {
    let n = keys.len() / (kv_heads * hd);
    let mut pool = KvPool::new(1, kv_heads, hd, KvDtype::F32);
    let mut table = BlockTable::new(n + 64);
    let need = pool.blocks_needed(&table, n);
    let ids: Vec<u32> = (0..need as u32)
        .map(|i| (i * 7 + 3) % need as u32)
        .collect();
    pool.grow(&mut table, n, &ids).unwrap();
    pool.append(&table, 0, keys, values);
    (pool, table)
}

/// Random queries (`len` tokens) over `pos0 + len` random cached positions.
struct Case {
    hd: usize,
    kv_of_q: Vec<usize>,
    pos0: usize,
    len: usize,
    window: Option<usize>,
}

/// A case's random data: `keys`, `values` (`[positions, kv_w]`) and `qkv` (`[len, qkv_w]`).
struct Data {
    kv_w: usize,
    qkv_w: usize,
    keys: Vec<f32>,
    values: Vec<f32>,
    qkv: Vec<f32>,
}

impl Case {
    fn data(&self) -> Data {
        let kv_heads = self.kv_of_q.iter().max().unwrap() + 1;
        let kv_w = kv_heads * self.hd;
        let qkv_w = self.kv_of_q.len() * self.hd + 2 * kv_w;
        let n = self.pos0 + self.len;
        let mut next = rng((self.hd * 1000 + n) as u64);
        let keys = (0..n * kv_w).map(|_| next()).collect();
        let values = (0..n * kv_w).map(|_| next()).collect();
        let qkv = (0..self.len * qkv_w).map(|_| next() * 3.0).collect();
        Data {
            kv_w,
            qkv_w,
            keys,
            values,
            qkv,
        }
    }

    fn run(&self, path: Path, tile_min: usize) -> Vec<f32> {
        let d = self.data();
        let (pool, table) = pool_with(d.kv_w / self.hd, self.hd, &d.keys, &d.values);
        let input = AttendInput {
            qkv: &d.qkv,
            qkv_w: d.qkv_w,
            kv: pool.layer(&table, 0),
            hd: self.hd,
            kv_of_q: &self.kv_of_q,
            pos0: self.pos0,
            scale: 1.0 / (self.hd as f32).sqrt(),
            window: self.window,
        };
        let mut ctx = vec![0f32; self.len * self.kv_of_q.len() * self.hd];
        attend_on(path, tile_min, input, &mut ctx);
        ctx
    }
}

fn cases() -> Vec<Case> {
    let mut out = Vec::new();
    for (hd, kv_of_q) in [
        (1, vec![0]),
        (5, vec![0, 1]),
        (8, vec![0, 0, 1, 1]),
        (12, vec![0, 0, 0]),
        (16, vec![0]),
        (64, vec![0, 0, 0, 1, 1, 1]),
        (64, vec![0; 7]),
        (128, vec![1, 1, 1, 0]),
        (72, vec![1, 0]),
        (128, vec![0, 0]),
        (200, vec![0]),
        (256, vec![0, 1]),
    ] {
        for (pos0, len, window) in [
            (0, 1, None),
            (0, 3, None),
            (5, 1, None),
            (31, 17, None),
            (100, 1, Some(7)),
            (13, 40, Some(20)),
            (64, 16, None),
        ] {
            out.push(Case {
                hd,
                kv_of_q: kv_of_q.clone(),
                pos0,
                len,
                window,
            });
        }
    }
    out
}

/// Every path, with keys by key or in tiles, gives the portable key-by-key bits.
#[test]
fn every_path_and_layout_gives_the_same_bits() {
    for c in cases() {
        let want = c.run(Path::Portable, usize::MAX);
        for path in paths() {
            for tile_min in [1, usize::MAX] {
                let got = c.run(path, tile_min);
                assert!(
                    same_bits(&got, &want),
                    "{path:?}, tiles from {tile_min}: hd {}, {} heads, {} at {}, window {:?}",
                    c.hd,
                    c.kv_of_q.len(),
                    c.len,
                    c.pos0,
                    c.window
                );
            }
        }
    }
}

/// The arithmetic is attention: within 1e-5 of an f64 softmax over f64 dot products.
#[test]
fn attention_is_within_1e_5_of_f64() {
    for c in cases() {
        let got = c.run(Path::current(), TILE_MIN_QUERIES);
        let Data {
            kv_w,
            qkv_w,
            keys,
            values,
            qkv,
        } = c.data();
        let q_w = c.kv_of_q.len() * c.hd;
        let scale = 1.0 / (c.hd as f64).sqrt();
        for i in 0..c.len {
            let seen = c.pos0 + i + 1;
            let first = c.window.map_or(0, |w| seen.saturating_sub(w));
            for (h, &kvh) in c.kv_of_q.iter().enumerate() {
                let q = &qkv[i * qkv_w + h * c.hd..][..c.hd];
                let at = |p: usize| p * kv_w + kvh * c.hd;
                let s: Vec<f64> = (first..seen)
                    .map(|p| {
                        let k = &keys[at(p)..at(p) + c.hd];
                        q.iter()
                            .zip(k)
                            .map(|(&a, &b)| a as f64 * b as f64)
                            .sum::<f64>()
                            * scale
                    })
                    .collect();
                let m = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let e: Vec<f64> = s.iter().map(|v| (v - m).exp()).collect();
                let total: f64 = e.iter().sum();
                for d in 0..c.hd {
                    let want: f64 = (first..seen)
                        .zip(&e)
                        .map(|(p, w)| w / total * values[at(p) + d] as f64)
                        .sum();
                    let g = got[i * q_w + h * c.hd + d] as f64;
                    assert!((g - want).abs() < 1e-5, "hd {} d {d}: {g} vs {want}", c.hd);
                }
            }
        }
    }
}

/// An f32 cache in blocks with scattered ids gives exactly the bits of the contiguous
/// layout, for chunks that start and end anywhere in a block (GQA: 4 query heads over 2 KV
/// heads), on every path, with and without a sliding window.
#[test]
fn paged_f32_attention_equals_contiguous_bit_for_bit() {
    let (hd, kv_of_q) = (8, vec![0usize, 0, 1, 1]);
    let (q_w, kv_w) = (kv_of_q.len() * hd, 2 * hd);
    let qkv_w = q_w + 2 * kv_w;
    let scale = 1.0 / (hd as f32).sqrt();
    let mut pool = KvPool::new(1, 2, hd, KvDtype::F32);
    let mut table = BlockTable::new(200);
    // Block ids in a scrambled order (17 is coprime to 40).
    let mut ids = (0..40u32).map(|i| (i * 17 + 5) % 40);
    let (mut keys, mut values) = (Vec::new(), Vec::new()); // [positions, kv_w]
    let mut next = rng(7);
    let mut pos0 = 0;
    for len in [1usize, 30, 3, 33, 1, 64] {
        let qkv: Vec<f32> = (0..len * qkv_w).map(|_| next()).collect(); // [len, qkv_w]
        let (mut k_new, mut v_new) = (Vec::new(), Vec::new());
        for row in qkv.chunks_exact(qkv_w) {
            k_new.extend_from_slice(&row[q_w..q_w + kv_w]);
            v_new.extend_from_slice(&row[q_w + kv_w..]);
        }
        keys.extend_from_slice(&k_new);
        values.extend_from_slice(&v_new);
        let take: Vec<u32> = ids.by_ref().take(pool.blocks_needed(&table, len)).collect();
        pool.grow(&mut table, len, &take).unwrap();
        pool.append(&table, 0, &k_new, &v_new);
        // Odd chunks attend through a window of 5 (Gemma's local layers).
        let window = (len % 2 == 1).then_some(5);
        // The contiguous layout, position by position, with the portable arithmetic.
        let mut want = vec![0f32; len * q_w];
        for (i, row) in qkv.chunks_exact(qkv_w).enumerate() {
            let seen = pos0 + i + 1;
            let first = window.map_or(0, |w| seen.saturating_sub(w));
            let base = first / LANES * LANES;
            for (h, &kvh) in kv_of_q.iter().enumerate() {
                let q = &row[h * hd..(h + 1) * hd];
                let head = |m: &[f32], p: usize| m[p * kv_w + kvh * hd..][..hd].to_vec();
                let mut s = vec![0f32; seen.div_ceil(LANES) * LANES - base];
                for p in first..seen {
                    s[p - base] = dot(q, &head(&keys, p)) * scale;
                }
                softmax_portable(&mut s, first - base, seen - base);
                let v: Vec<f32> = (first..seen).flat_map(|p| head(&values, p)).collect();
                let out = &mut want[i * q_w + h * hd..][..hd];
                weighted_sum_portable(&s[first - base..seen - base], &v, out);
            }
        }
        for path in paths() {
            for tile_min in [1, usize::MAX] {
                let input = AttendInput {
                    qkv: &qkv,
                    qkv_w,
                    kv: pool.layer(&table, 0),
                    hd,
                    kv_of_q: &kv_of_q,
                    pos0,
                    scale,
                    window,
                };
                let mut got = vec![0f32; len * q_w];
                attend_on(path, tile_min, input, &mut got);
                assert!(
                    same_bits(&got, &want),
                    "{path:?}, tiles from {tile_min}: chunk of {len} at position {pos0}"
                );
            }
        }
        table.advance(len);
        pos0 += len;
    }
    assert_eq!(table.len(), 132);
    assert_eq!(table.blocks(), &[5, 22, 39, 16, 33]);
}

/// Queries up to 200x larger (scores far apart: most weights below exp's cut-off, a softmax
/// held by one key) with Gemma-3's shape (head size 256, four query heads on one KV head,
/// a window, query scale 1/16): every path and layout still gives the same bits.
#[test]
fn large_scores_give_the_same_bits_on_every_path() {
    for mag in [1.0f32, 10.0, 50.0, 200.0] {
        for (len, pos0) in [(9usize, 0usize), (1, 9), (40, 500)] {
            let (hd, kv_of_q) = (256, [0usize; 4]);
            let qkv_w = kv_of_q.len() * hd + 2 * hd;
            let n = pos0 + len;
            let mut next = rng(5);
            let keys: Vec<f32> = (0..n * hd).map(|_| next()).collect();
            let values: Vec<f32> = (0..n * hd).map(|_| next()).collect();
            let qkv: Vec<f32> = (0..len * qkv_w).map(|_| next() * mag).collect();
            let (pool, table) = pool_with(1, hd, &keys, &values);
            let run = |path, tile_min| {
                let input = AttendInput {
                    qkv: &qkv,
                    qkv_w,
                    kv: pool.layer(&table, 0),
                    hd,
                    kv_of_q: &kv_of_q,
                    pos0,
                    scale: 0.0625,
                    window: Some(512),
                };
                let mut ctx = vec![0f32; len * kv_of_q.len() * hd];
                attend_on(path, tile_min, input, &mut ctx);
                ctx
            };
            let want = run(Path::Portable, usize::MAX);
            assert!(want.iter().all(|v| v.is_finite()));
            for path in paths() {
                for tile_min in [1, usize::MAX] {
                    let got = run(path, tile_min);
                    assert!(same_bits(&got, &want), "x{mag}, {len} at {pos0}: {path:?}");
                }
            }
        }
    }
}
