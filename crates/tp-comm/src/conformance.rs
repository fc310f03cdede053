//! The conformance suite every backend must pass: each op, every dtype, sizes 0, 1, odd and
//! past the small-message limit, uneven counts (all_to_all: uneven, empty peers, all empty),
//! point-to-point rings and isolated sub-groups.
//!
//! Inputs are small rank-valued integers, exact in every dtype (f16 and bf16 included), so
//! results are checked for equality, not within a tolerance. Every rank of the world calls
//! [`run`]; each returns its own [`Report`].

use crate::communicator::{CommExt, Group};
use crate::dtype::{Elem, ReduceOp};
use crate::mesh::{ParallelDims, ProcessGroups};
use half::{bf16, f16};

/// What one rank saw: how many checks passed and a line per failure.
#[derive(Debug, Default)]
pub struct Report {
    pub passed: usize,
    pub failed: Vec<String>,
}

impl Report {
    fn check(&mut self, name: &str, r: Result<(), String>) {
        match r {
            Ok(()) => self.passed += 1,
            Err(e) => self.failed.push(format!("{name}: {e}")),
        }
    }
}

/// Element counts tried for every op: empty, one, odd, around the 64 KiB scratch limit of
/// the local backend (f32), and large.
pub const COUNTS: [usize; 7] = [0, 1, 7, 1023, 16_384, 16_385, 100_003];

trait Small: Elem + PartialEq + std::fmt::Debug {
    fn small(v: u32) -> Self;
}
macro_rules! small {
    ($($t:ty),*) => {$( impl Small for $t { fn small(v: u32) -> Self { v as $t } } )*};
}
small!(f32, f64, i32, i64, u8, u32, u64);
impl Small for f16 {
    fn small(v: u32) -> Self {
        f16::from_f32(v as f32)
    }
}
impl Small for bf16 {
    fn small(v: u32) -> Self {
        bf16::from_f32(v as f32)
    }
}

/// Rank r's value at index i for reductions: (r + 1) * (i % 3 + 1), at most 108 at 8 ranks.
fn value(r: usize, i: usize) -> u32 {
    ((r + 1) * (i % 3 + 1)) as u32
}

/// A value that names its origin, for gathers and point-to-point (fits u8 for small cases).
fn tagged(r: usize, i: usize) -> u32 {
    ((r * 31 + i) % 251) as u32
}

fn compare<T: Small>(got: &[T], want: impl Fn(usize) -> u32) -> Result<(), String> {
    for (i, g) in got.iter().enumerate() {
        let w = T::small(want(i));
        if *g != w {
            return Err(format!("element {i} is {g:?}, expected {w:?}"));
        }
    }
    Ok(())
}

fn all_reduce_case<T: Small>(g: &Group, count: usize, op: ReduceOp) -> Result<(), String> {
    let (r, n) = (g.rank(), g.size());
    let mut buf: Vec<T> = (0..count).map(|i| T::small(value(r, i))).collect();
    g.all_reduce(&mut buf, op).map_err(|e| e.to_string())?;
    compare(&buf, |i| {
        let k = (i % 3 + 1) as u32;
        match op {
            ReduceOp::Sum => k * (n * (n + 1) / 2) as u32,
            ReduceOp::Max => k * n as u32,
            ReduceOp::Min => k,
        }
    })
}

/// Inexact inputs (sums round differently in another order) for the rank-order check.
fn inexact(r: usize, i: usize) -> f32 {
    ((r * 7919 + i * 104_729) % 1000) as f32 * 1.37e-3 + 1.0 / (r as f32 + 3.0)
}

/// R10: an all-reduce sum of inexact values equals, bit for bit, the rank-order reduction
/// 0..n of every rank's input (each rank rebuilds all inputs), so all ranks hold the same
/// bits and the backend's reduction order is the documented one.
fn rank_order_case<T: Elem + PartialEq + std::fmt::Debug>(
    g: &Group,
    count: usize,
    make: fn(f32) -> T,
) -> Result<(), String> {
    let (r, n) = (g.rank(), g.size());
    let input = |rank: usize| -> Vec<T> { (0..count).map(|i| make(inexact(rank, i))).collect() };
    let mut buf = input(r);
    g.all_reduce(&mut buf, ReduceOp::Sum)
        .map_err(|e| e.to_string())?;
    let all: Vec<Vec<T>> = (0..n).map(input).collect();
    let srcs: Vec<&[u8]> = all.iter().map(|v| bytemuck::cast_slice(v)).collect();
    let mut want = vec![make(0.0); count];
    crate::reduce::reduce_into(
        bytemuck::cast_slice_mut(&mut want),
        &srcs,
        T::DTYPE,
        ReduceOp::Sum,
    );
    match buf.iter().zip(&want).position(|(a, b)| a != b) {
        None => Ok(()),
        Some(i) => Err(format!(
            "element {i} is {:?}, the rank-order sum is {:?}",
            buf[i], want[i]
        )),
    }
}

fn counts_for(n: usize, base: usize, uneven: bool) -> Vec<usize> {
    (0..n)
        .map(|j| {
            if uneven {
                (base + j * 5) % (base + 3)
            } else {
                base
            }
        })
        .collect()
}

fn all_gather_case<T: Small>(g: &Group, counts: &[usize]) -> Result<(), String> {
    let r = g.rank();
    let send: Vec<T> = (0..counts[r]).map(|i| T::small(tagged(r, i))).collect();
    let mut recv = vec![T::small(0); counts.iter().sum()];
    g.all_gather_v(&send, &mut recv, counts)
        .map_err(|e| e.to_string())?;
    let mut want = Vec::with_capacity(recv.len());
    for (j, &c) in counts.iter().enumerate() {
        want.extend((0..c).map(|i| tagged(j, i)));
    }
    compare(&recv, |i| want[i])
}

/// What rank i sends to rank j at position k of its block: names all three (fits u8).
fn routed(i: usize, j: usize, k: usize) -> u32 {
    ((i * 31 + j * 17 + k) % 251) as u32
}

/// A value `routed` never yields: marks receive elements the call must overwrite.
const UNWRITTEN: u32 = 252;

/// all_to_all_v where rank i sends `counts(i, j)` elements to rank j; every rank checks that
/// block i of its receive buffer is rank i's block for it, element by element.
fn all_to_all_case<T: Small>(
    g: &Group,
    counts: impl Fn(usize, usize) -> usize,
) -> Result<(), String> {
    let (r, n) = (g.rank(), g.size());
    let send_counts: Vec<usize> = (0..n).map(|j| counts(r, j)).collect();
    let recv_counts: Vec<usize> = (0..n).map(|i| counts(i, r)).collect();
    let mut send = Vec::with_capacity(send_counts.iter().sum());
    let mut want = Vec::with_capacity(recv_counts.iter().sum());
    for j in 0..n {
        send.extend((0..send_counts[j]).map(|k| T::small(routed(r, j, k))));
        want.extend((0..recv_counts[j]).map(|k| routed(j, r, k)));
    }
    let mut recv = vec![T::small(UNWRITTEN); want.len()];
    g.all_to_all_v(&send, &send_counts, &mut recv, &recv_counts)
        .map_err(|e| e.to_string())?;
    compare(&recv, |i| want[i])
}

/// The even `all_to_all` (blocks of `block` elements), checked like [`all_to_all_case`].
fn all_to_all_even_case<T: Small>(g: &Group, block: usize) -> Result<(), String> {
    let (r, n) = (g.rank(), g.size());
    let send: Vec<T> = (0..n * block)
        .map(|x| T::small(routed(r, x / block, x % block)))
        .collect();
    let mut recv = vec![T::small(UNWRITTEN); n * block];
    g.all_to_all(&send, &mut recv).map_err(|e| e.to_string())?;
    compare(&recv, |x| routed(x / block, r, x % block))
}

/// The all-to-all count tables of the suite (see [`a2a_count`]).
const A2A_SHAPES: [&str; 4] = ["uneven", "empty peers", "lopsided", "all empty"];

/// Elements rank i sends to rank j in the table `shape`, around `block` per pair.
fn a2a_count(shape: &str, block: usize, i: usize, j: usize) -> usize {
    match shape {
        "uneven" => (block + i * 3 + j * 5) % (block + 3),
        // Rank 0 receives nothing, and every rank skips the peers of its parity.
        "empty peers" if j == 0 || (i + j).is_multiple_of(2) => 0,
        "empty peers" => block + i,
        // One rank sends far more than the rest (past the local backend's scratch slot).
        "lopsided" if i == 0 => 20_000,
        "lopsided" => 3 + j,
        _ => 0,
    }
}

fn every_dtype_all_to_all(rep: &mut Report, g: &Group, label: &str, block: usize) {
    let counts = move |i, j| a2a_count("uneven", block, i, j);
    let name = |t: &str| format!("{label}: all_to_all_v {t} uneven block={block}");
    rep.check(&name("f32"), all_to_all_case::<f32>(g, counts));
    rep.check(&name("f64"), all_to_all_case::<f64>(g, counts));
    rep.check(&name("f16"), all_to_all_case::<f16>(g, counts));
    rep.check(&name("bf16"), all_to_all_case::<bf16>(g, counts));
    rep.check(&name("i32"), all_to_all_case::<i32>(g, counts));
    rep.check(&name("i64"), all_to_all_case::<i64>(g, counts));
    rep.check(&name("u8"), all_to_all_case::<u8>(g, counts));
    rep.check(&name("u32"), all_to_all_case::<u32>(g, counts));
    rep.check(&name("u64"), all_to_all_case::<u64>(g, counts));
}

fn reduce_scatter_case<T: Small>(g: &Group, counts: &[usize], op: ReduceOp) -> Result<(), String> {
    let (r, n) = (g.rank(), g.size());
    let total: usize = counts.iter().sum();
    let send: Vec<T> = (0..total).map(|i| T::small(value(r, i))).collect();
    let mut recv = vec![T::small(0); counts[r]];
    g.reduce_scatter_v(&send, &mut recv, counts, op)
        .map_err(|e| e.to_string())?;
    let off: usize = counts[..r].iter().sum();
    compare(&recv, |i| {
        let k = ((off + i) % 3 + 1) as u32;
        match op {
            ReduceOp::Sum => k * (n * (n + 1) / 2) as u32,
            ReduceOp::Max => k * n as u32,
            ReduceOp::Min => k,
        }
    })
}

fn broadcast_case<T: Small>(g: &Group, count: usize, root: usize) -> Result<(), String> {
    let r = g.rank();
    let mut buf: Vec<T> = (0..count).map(|i| T::small(tagged(r, i))).collect();
    g.broadcast(&mut buf, root).map_err(|e| e.to_string())?;
    compare(&buf, |i| tagged(root, i))
}

fn ring_case<T: Small>(g: &Group, count: usize, tag: u32) -> Result<(), String> {
    let (r, n) = (g.rank(), g.size());
    let next = (r + 1) % n;
    let prev = (r + n - 1) % n;
    let send: Vec<T> = (0..count).map(|i| T::small(tagged(r, i))).collect();
    g.send(&send, next, tag).map_err(|e| e.to_string())?;
    let mut recv = vec![T::small(0); count];
    g.recv(&mut recv, prev, tag).map_err(|e| e.to_string())?;
    compare(&recv, |i| tagged(prev, i))
}

fn every_dtype_all_reduce(rep: &mut Report, g: &Group, count: usize) {
    for op in [ReduceOp::Sum, ReduceOp::Max, ReduceOp::Min] {
        let name = |t: &str| format!("all_reduce {t} {} count={count}", op.name());
        rep.check(&name("f32"), all_reduce_case::<f32>(g, count, op));
        rep.check(&name("f64"), all_reduce_case::<f64>(g, count, op));
        rep.check(&name("f16"), all_reduce_case::<f16>(g, count, op));
        rep.check(&name("bf16"), all_reduce_case::<bf16>(g, count, op));
        rep.check(&name("i32"), all_reduce_case::<i32>(g, count, op));
        rep.check(&name("i64"), all_reduce_case::<i64>(g, count, op));
        rep.check(&name("u8"), all_reduce_case::<u8>(g, count, op));
        rep.check(&name("u32"), all_reduce_case::<u32>(g, count, op));
        rep.check(&name("u64"), all_reduce_case::<u64>(g, count, op));
    }
}

/// Runs every check on `g` (the world, or any group) and returns this rank's report.
pub fn run(world: &Group) -> Report {
    let mut rep = Report::default();
    run_on(&mut rep, world, "world");
    // Sub-groups: even and odd ranks run different calls at the same time.
    let n = world.size();
    match world.split(Some((world.rank() % 2) as u32), world.rank()) {
        Ok(Some(half)) => {
            let label = format!("parity-{} group", world.rank() % 2);
            if world.rank().is_multiple_of(2) {
                run_on(&mut rep, &half, &label);
            } else {
                // A different sequence of calls than the even group: isolation means it
                // neither blocks on nor mixes with the even ranks' calls.
                for count in [3usize, 40_000] {
                    rep.check(
                        &format!("{label}: all_reduce f64 count={count}"),
                        all_reduce_case::<f64>(&half, count, ReduceOp::Sum),
                    );
                }
            }
            let expect = if world.rank().is_multiple_of(2) {
                n.div_ceil(2)
            } else {
                n / 2
            };
            rep.check(&format!("{label}: size"), {
                if half.size() == expect {
                    Ok(())
                } else {
                    Err(format!("size {} expected {expect}", half.size()))
                }
            });
        }
        Ok(None) => rep.check("split", Err("a colored rank got no group".into())),
        Err(e) => rep.check("split", Err(e.to_string())),
    }
    // A rank that opts out of a split gets no group, and the others still form theirs.
    let color = (world.rank() != 0).then_some(7);
    match world.split(color, n - world.rank()) {
        Ok(g) => rep.check("split without rank 0", {
            match (world.rank(), g) {
                (0, None) => Ok(()),
                (0, Some(_)) => Err("rank 0 opted out but got a group".into()),
                (_, None) => Err("no group".into()),
                // Keys reversed the order: world rank n-1 is rank 0 of the new group.
                (r, Some(g)) if g.rank() == n - 1 - r && g.size() == n - 1 => {
                    let mut x = [r as u64];
                    let want = (n * (n - 1) / 2) as u64;
                    match g.all_reduce(&mut x, ReduceOp::Sum) {
                        Err(e) => Err(e.to_string()),
                        Ok(()) if x[0] == want => Ok(()),
                        Ok(()) => Err(format!("sum {} expected {want}", x[0])),
                    }
                }
                (r, Some(g)) => Err(format!(
                    "rank {r} got group rank {} of {}, expected {} of {}",
                    g.rank(),
                    g.size(),
                    n - 1 - r,
                    n - 1
                )),
            }
        }),
        Err(e) => rep.check("split without rank 0", Err(e.to_string())),
    }
    mesh_checks(&mut rep, world);
    rep
}

fn mesh_checks(rep: &mut Report, world: &Group) {
    let n = world.size();
    for tp in (1..=n).filter(|t| n.is_multiple_of(*t)) {
        for pp in (1..=n / tp).filter(|p| (n / tp).is_multiple_of(*p)) {
            let dims = ParallelDims {
                tp,
                pp,
                dp: n / tp / pp,
            };
            let name = format!("mesh tp={tp} pp={pp} dp={}", dims.dp);
            let r = ProcessGroups::new(world.clone(), dims).map_err(|e| e.to_string());
            rep.check(&name, r.and_then(|pg| mesh_sums(&pg)));
        }
    }
}

/// In each group, the sum of world ranks must equal the sum over that group's coordinates.
fn mesh_sums(pg: &ProcessGroups) -> Result<(), String> {
    let d = pg.dims;
    let me = pg.world.rank();
    for (label, g, len) in [
        ("tp", &pg.tp, d.tp),
        ("pp", &pg.pp, d.pp),
        ("dp", &pg.dp, d.dp),
    ] {
        if g.size() != len {
            return Err(format!(
                "{label} group has {} ranks, expected {len}",
                g.size()
            ));
        }
        let mut x = [me as u64];
        g.all_reduce(&mut x, ReduceOp::Sum)
            .map_err(|e| e.to_string())?;
        let mut want = 0u64;
        for k in 0..len {
            let mut c = pg.coords;
            match label {
                "tp" => c.tp_rank = k,
                "pp" => c.pp_rank = k,
                _ => c.dp_rank = k,
            }
            want += d.world_rank(c) as u64;
        }
        if x[0] != want {
            return Err(format!(
                "{label} group sums world ranks to {}, expected {want}",
                x[0]
            ));
        }
        all_to_all_case::<u32>(g, |i, j| (i + 2 * j) % 3)
            .map_err(|e| format!("{label} group all_to_all_v: {e}"))?;
    }
    Ok(())
}

fn run_on(rep: &mut Report, g: &Group, label: &str) {
    let n = g.size();
    for count in COUNTS {
        every_dtype_all_reduce(rep, g, count);
        for uneven in [false, true] {
            let counts = counts_for(n, count / n.max(1), uneven);
            let desc = format!("{label}: counts={counts:?}");
            rep.check(
                &format!("all_gather f32 {desc}"),
                all_gather_case::<f32>(g, &counts),
            );
            rep.check(
                &format!("all_gather u8 {desc}"),
                all_gather_case::<u8>(g, &counts),
            );
            rep.check(
                &format!("all_gather bf16 {desc}"),
                all_gather_case::<bf16>(g, &counts),
            );
            for op in [ReduceOp::Sum, ReduceOp::Max] {
                rep.check(
                    &format!("reduce_scatter f32 {} {desc}", op.name()),
                    reduce_scatter_case::<f32>(g, &counts, op),
                );
                rep.check(
                    &format!("reduce_scatter i64 {} {desc}", op.name()),
                    reduce_scatter_case::<i64>(g, &counts, op),
                );
            }
        }
        for root in 0..n {
            rep.check(
                &format!("{label}: broadcast f32 count={count} root={root}"),
                broadcast_case::<f32>(g, count, root),
            );
        }
        let block = count / n.max(1);
        for (t, r) in [
            ("f32", all_to_all_even_case::<f32>(g, block)),
            ("u8", all_to_all_even_case::<u8>(g, block)),
            ("bf16", all_to_all_even_case::<bf16>(g, block)),
        ] {
            rep.check(&format!("{label}: all_to_all {t} block={block}"), r);
        }
        for shape in A2A_SHAPES {
            let counts = |i, j| a2a_count(shape, block, i, j);
            let desc = format!("{label}: all_to_all_v {shape} block={block}");
            rep.check(&format!("{desc} f32"), all_to_all_case::<f32>(g, &counts));
            rep.check(&format!("{desc} u8"), all_to_all_case::<u8>(g, &counts));
        }
        rep.check(
            &format!("{label}: broadcast u8 count={count}"),
            broadcast_case::<u8>(g, count, n - 1),
        );
        rep.check(
            &format!("{label}: ring send/recv f32 count={count}"),
            ring_case::<f32>(g, count, 5),
        );
        rep.check(
            &format!("{label}: ring send/recv i32 count={count}"),
            ring_case::<i32>(g, count, 6),
        );
    }
    for block in [7usize, 16_385] {
        every_dtype_all_to_all(rep, g, label, block);
    }
    // Past the one-message limit of the MPI backend and over several of its chunks.
    for count in [1023usize, 600_001] {
        rep.check(
            &format!("{label}: all_reduce f32 rank order count={count}"),
            rank_order_case::<f32>(g, count, |x| x),
        );
        rep.check(
            &format!("{label}: all_reduce f16 rank order count={count}"),
            rank_order_case::<f16>(g, count, f16::from_f32),
        );
        rep.check(
            &format!("{label}: all_reduce bf16 rank order count={count}"),
            rank_order_case::<bf16>(g, count, bf16::from_f32),
        );
    }
    rep.check(
        &format!("{label}: barrier"),
        g.barrier().map_err(|e| e.to_string()),
    );
}
