//! The mixture-of-experts training layer against the single-device MoE
//! (`reference::dense_moe`): outputs, the load-balancing loss and every gradient (input,
//! router, each expert's shard) at tp 1, 2, 4 with expert-parallel sizes 1, 2, 4 and ep 2 x
//! expert-TP 2, with 8 experts (even) and 6 (uneven over 4 groups: 2|2|1|1), normalised and
//! not; and expert parallelism over data-parallel replicas (tokens dispatched by
//! all-to-all) against the single-device MoE on each replica's tokens. Tolerance: as every
//! layer test here (see main.rs).

use crate::support::{assert_close, dev, world};
use candle_core::Tensor;
use tp_nn::reference::{dense_moe, dense_moe_capped};
use tp_nn::{copy_to_tp, Activation, ParallelMoe, RandomTensor, Rng, RouteOptions};
use tp_spec::{CapacityFactor, ExpertShard, Experts};

const HIDDEN: usize = 16;
const FFN: usize = 8;
const TOKENS: usize = 7;

struct Case {
    x: Tensor,
    router: Tensor,
    weights: Vec<(Tensor, Tensor, Tensor)>,
    probe: Tensor, // [tokens, hidden]: the loss is sum(y * probe) + aux
    experts: Experts,
}

fn case(count: usize, normalize: bool, seed: u64) -> Case {
    let mut rng = Rng::xorshift64_star(seed);
    let mut t = |dims: &[usize], s: f32| rng.tensor(dims, 0.0, s, &dev()).unwrap();
    let weights = (0..count)
        .map(|_| {
            (
                t(&[FFN, HIDDEN], 0.5),
                t(&[FFN, HIDDEN], 0.5),
                t(&[HIDDEN, FFN], 0.5),
            )
        })
        .collect();
    let mut experts = Experts::new(count, 2);
    experts.normalize = normalize;
    Case {
        x: t(&[TOKENS, HIDDEN], 1.0),
        router: t(&[count, HIDDEN], 1.0),
        weights,
        probe: t(&[TOKENS, HIDDEN], 1.0),
        experts,
    }
}

/// What a rank reports: y, aux, dx, its router gradient, and each local expert's
/// `(index, cols, d gate, d up, d down)`.
type RankOut = (
    Tensor,
    f32,
    Tensor,
    Tensor,
    Vec<(usize, std::ops::Range<usize>, [Tensor; 3])>,
);

#[test]
fn moe_layer_matches_the_single_device_moe_at_every_layout() {
    for (count, normalize) in [(8, true), (6, false)] {
        let c = case(count, normalize, 40 + count as u64);
        // The reference and its gradients.
        let x = candle_core::Var::from_tensor(&c.x).unwrap();
        let router = candle_core::Var::from_tensor(&c.router).unwrap();
        let vars: Vec<_> = c
            .weights
            .iter()
            .map(|(g, u, d)| [g, u, d].map(|w| candle_core::Var::from_tensor(w).unwrap()))
            .collect();
        let tensors: Vec<_> = vars
            .iter()
            .map(|[g, u, d]| {
                (
                    g.as_tensor().clone(),
                    u.as_tensor().clone(),
                    d.as_tensor().clone(),
                )
            })
            .collect();
        let (y, aux) = dense_moe(
            x.as_tensor(),
            router.as_tensor(),
            &tensors,
            &c.experts,
            Activation::Silu,
        )
        .unwrap();
        let loss = ((&y * &c.probe).unwrap().sum_all().unwrap() + &aux).unwrap();
        let grads = loss.backward().unwrap();
        let aux_want = aux.to_scalar::<f32>().unwrap();
        for (tp, ep) in [(1, 1), (2, 1), (2, 2), (4, 1), (4, 2), (4, 4)] {
            let what = format!("{count} experts, tp {tp} ep {ep}");
            let outs: Vec<RankOut> = world(tp, |g| {
                let shard = ExpertShard::for_experts(c.experts, FFN, 1, g.rank(), tp, ep)?;
                let moe = ParallelMoe::from_global(
                    &c.router,
                    c.experts,
                    &c.weights,
                    &shard,
                    tp,
                    Activation::Silu,
                )?;
                let xv = candle_core::Var::from_tensor(&c.x)?;
                let x_par = copy_to_tp(xv.as_tensor(), &g)?;
                let out = moe.forward_local(&x_par, &g)?;
                let y = out.partial.reduce()?;
                let loss = ((&y * &c.probe)?.sum_all()? + &out.aux_share)?;
                let gr = loss.backward()?;
                let experts = moe
                    .expert_vars()
                    .into_iter()
                    .map(|(e, gv, uv, dv)| {
                        let d = [gv, uv, dv].map(|v| gr.get(v.as_tensor()).unwrap().clone());
                        (e, shard.expert_cols(e), d)
                    })
                    .collect();
                Ok((
                    y,
                    out.aux,
                    gr.get(xv.as_tensor()).unwrap().clone(),
                    gr.get(moe.router().as_tensor()).unwrap().clone(),
                    experts,
                ))
            });
            let mut router_grad = outs[0].3.zeros_like().unwrap();
            let mut seen = vec![0usize; count];
            for (r, (y_r, aux_r, dx, dr, experts)) in outs.iter().enumerate() {
                assert_close(&format!("{what}: y on rank {r}"), y_r, &y);
                assert!(
                    (aux_r - aux_want).abs() <= 1e-5 * aux_want.abs().max(1.0),
                    "{what}: aux {aux_r} vs {aux_want}"
                );
                assert_close(
                    &format!("{what}: dx on rank {r}"),
                    dx,
                    grads.get(x.as_tensor()).unwrap(),
                );
                router_grad = (router_grad + dr).unwrap();
                for (e, cols, [dg, du, dd]) in experts {
                    seen[*e] += cols.len();
                    // An expert no token chose is not in the reference's graph: its
                    // gradient is zero.
                    let want = |v: &candle_core::Var, dim: usize| {
                        let full = match grads.get(v.as_tensor()) {
                            Some(g) => g.clone(),
                            None => v.as_tensor().zeros_like().unwrap(),
                        };
                        full.narrow(dim, cols.start, cols.len()).unwrap()
                    };
                    assert_close(
                        &format!("{what}: d gate {e} rank {r}"),
                        dg,
                        &want(&vars[*e][0], 0),
                    );
                    assert_close(
                        &format!("{what}: d up {e} rank {r}"),
                        du,
                        &want(&vars[*e][1], 0),
                    );
                    assert_close(
                        &format!("{what}: d down {e} rank {r}"),
                        dd,
                        &want(&vars[*e][2], 1),
                    );
                }
            }
            // Every column of every expert is held exactly once; the router's gradient is
            // the sum of the ranks' shares.
            assert!(seen.iter().all(|&s| s == FFN), "{what}: {seen:?}");
            assert_close(
                &format!("{what}: d router"),
                &router_grad,
                grads.get(router.as_tensor()).unwrap(),
            );
        }
    }
}

/// What an expert-parallel rank reports: its (replica, tp rank), y, aux, dx, its router
/// gradient, each local (whole) expert's `(index, [d gate, d up, d down])`, and the
/// all-to-alls of its ep group (forward, backward).
type EpOut = (
    (usize, usize),
    Tensor,
    f32,
    Tensor,
    Tensor,
    Vec<(usize, [Tensor; 3])>,
    (usize, usize),
);

/// Tokens of replica `b` (replica 1 has a single token: most peers get no rows from it).
fn replica_tokens(b: usize) -> usize {
    [TOKENS, 1, 5, 3][b % 4]
}

/// Expert parallelism across `block` data-parallel replicas at `tp` (ep = tp x block): every
/// rank holds whole experts, each replica routes its own tokens, rows travel by all-to-all.
/// Oracle: the single-device MoE on each replica's tokens; an expert's gradient is the sum
/// over the replicas' references, each replica's router gradient the sum over its tp ranks.
#[test]
fn expert_parallel_over_replicas_matches_the_single_device_moe_per_replica() {
    use candle_core::Var;
    use tp_comm::{OpKind, ParallelDims, ProcessGroups};
    use tp_nn::RecordingComm;
    use tp_spec::EpLayout;
    for (count, normalize, tp, block, skewed) in [
        (8, true, 1, 2, false),
        (8, true, 1, 4, false),
        (8, false, 1, 3, false), // 3 | 3 | 2 experts
        (6, false, 1, 4, false), // 2 | 2 | 1 | 1
        (8, true, 2, 2, false),  // ep 4: EP x tp
        (6, true, 2, 2, false),
        (8, true, 1, 4, true), // every token to experts 0 and 1: 3 ranks receive no row
        (8, true, 2, 2, true), // tp index 1's ranks send and receive no row
    ] {
        let ep = tp * block;
        let what =
            format!("{count} experts, tp {tp} x {block} replicas (ep {ep}), skewed {skewed}");
        let mut c = case(count, normalize, 70 + count as u64);
        let mut rng = Rng::xorshift64_star(90 + ep as u64);
        let mut xs: Vec<Tensor> = (0..block)
            .map(|b| {
                rng.tensor(&[replica_tokens(b), HIDDEN], 0.0, 1.0, &dev())
                    .unwrap()
            })
            .collect();
        if skewed {
            // Positive inputs and a router whose rows 0 and 1 are large positive multiples
            // of one direction, the others 0: experts 0 and 1 win every token.
            let ones = Tensor::ones(HIDDEN, candle_core::DType::F32, &dev()).unwrap();
            let rows: Vec<Tensor> = (0..count)
                .map(|e| (&ones * [3.0, 2.5].get(e).copied().unwrap_or(0.0)).unwrap())
                .collect();
            c.router = Tensor::stack(&rows, 0).unwrap();
            xs = xs
                .iter()
                .map(|x| (x.abs().unwrap() + 0.5).unwrap())
                .collect();
        }
        let probes: Vec<Tensor> = (0..block)
            .map(|b| {
                rng.tensor(&[replica_tokens(b), HIDDEN], 0.0, 1.0, &dev())
                    .unwrap()
            })
            .collect();
        // The references: one graph, the experts shared by the replicas (their gradients
        // summed), a router and an input per replica.
        let vars: Vec<[Var; 3]> = c
            .weights
            .iter()
            .map(|(g, u, d)| [g, u, d].map(|w| Var::from_tensor(w).unwrap()))
            .collect();
        let tensors: Vec<_> = vars
            .iter()
            .map(|[g, u, d]| {
                (
                    g.as_tensor().clone(),
                    u.as_tensor().clone(),
                    d.as_tensor().clone(),
                )
            })
            .collect();
        let mut loss = Tensor::new(0f32, &dev()).unwrap();
        let mut refs = Vec::new();
        for b in 0..block {
            let x = Var::from_tensor(&xs[b]).unwrap();
            let router = Var::from_tensor(&c.router).unwrap();
            let (y, aux) = dense_moe(
                x.as_tensor(),
                router.as_tensor(),
                &tensors,
                &c.experts,
                Activation::Silu,
            )
            .unwrap();
            let l = ((&y * &probes[b]).unwrap().sum_all().unwrap() + &aux).unwrap();
            loss = (loss + l).unwrap();
            refs.push((x, router, y, aux.to_scalar::<f32>().unwrap()));
        }
        let grads = loss.backward().unwrap();
        let layout = EpLayout::new(ep, tp, block, count).unwrap();
        let rep = layout.across().unwrap().clone();
        let outs: Vec<EpOut> = world(ep, |world| {
            let dims = ParallelDims {
                tp,
                pp: 1,
                dp: block,
            };
            let pg = ProcessGroups::new(world, dims)?;
            let (b, t) = (pg.coords.dp_rank, pg.coords.tp_rank);
            let (rec, ep_group) = RecordingComm::wrap(pg.dp.clone());
            let shard = rep.shard(c.experts, FFN, 1, Some(rep.position(b)), t)?;
            let moe = ParallelMoe::from_global(
                &c.router,
                c.experts,
                &c.weights,
                &shard,
                tp,
                Activation::Silu,
            )?
            .with_dispatch(ep_group, rep.peers(t))?;
            let xv = Var::from_tensor(&xs[b])?;
            let x_par = copy_to_tp(xv.as_tensor(), &pg.tp)?;
            let out = moe.forward_local(&x_par, &pg.tp)?;
            let y = out.partial.reduce()?;
            let fwd = rec.count(OpKind::AllToAll);
            rec.reset();
            let loss = ((&y * &probes[b])?.sum_all()? + &out.aux_share)?;
            let gr = loss.backward()?;
            let bwd = rec.count(OpKind::AllToAll);
            let experts = moe
                .expert_vars()
                .into_iter()
                .map(|(e, gv, uv, dv)| {
                    (
                        e,
                        [gv, uv, dv].map(|v| gr.get(v.as_tensor()).unwrap().clone()),
                    )
                })
                .collect();
            Ok((
                (b, t),
                y,
                out.aux,
                gr.get(xv.as_tensor()).unwrap().clone(),
                gr.get(moe.router().as_tensor()).unwrap().clone(),
                experts,
                (fwd, bwd),
            ))
        });
        let mut router_grads: Vec<Tensor> =
            (0..block).map(|_| c.router.zeros_like().unwrap()).collect();
        let mut held = vec![0usize; count];
        for ((b, t), y, aux, dx, dr, experts, calls) in &outs {
            let r = format!("{what}: replica {b} tp rank {t}");
            let (x_ref, _, y_ref, aux_ref) = &refs[*b];
            assert_eq!(*calls, (3, 2), "{r}: all-to-alls (forward, backward)");
            assert_close(&format!("{r}: y"), y, y_ref);
            assert!(
                (aux - aux_ref).abs() <= 1e-5 * aux_ref.abs().max(1.0),
                "{r}: aux {aux} vs {aux_ref}"
            );
            assert_close(
                &format!("{r}: dx"),
                dx,
                grads.get(x_ref.as_tensor()).unwrap(),
            );
            router_grads[*b] = (&router_grads[*b] + dr).unwrap();
            for (e, d) in experts {
                held[*e] += 1;
                for (k, d) in d.iter().enumerate() {
                    let v = &vars[*e][k];
                    let want = match grads.get(v.as_tensor()) {
                        Some(g) => g.clone(),
                        None => v.as_tensor().zeros_like().unwrap(),
                    };
                    assert_close(&format!("{r}: expert {e} weight {k}"), d, &want);
                }
            }
        }
        // Every expert held once in each ep block (here: once).
        assert!(held.iter().all(|&h| h == 1), "{what}: {held:?}");
        for (b, dr) in router_grads.iter().enumerate() {
            assert_close(
                &format!("{what}: replica {b}'s router"),
                dr,
                grads.get(refs[b].1.as_tensor()).unwrap(),
            );
        }
    }
}

/// Under a capacity factor (7 tokens, top-2 of 8 experts; f = 1: each expert keeps its first
/// 2 tokens, f = 0.5: its first 1) the layer drops the reference's pairs
/// (`reference::dense_moe_capped`, token by token in token order) at tp 1, 2 x ep 1 and 2,
/// 4 x ep 4: the same pairs per expert, and y, the balance loss, dx and the router's
/// gradient equal the reference's.
#[test]
fn a_capacity_factor_drops_the_reference_pairs() {
    let c = case(8, true, 48);
    for f in [1.0, 0.5] {
        let x = candle_core::Var::from_tensor(&c.x).unwrap();
        let router = candle_core::Var::from_tensor(&c.router).unwrap();
        let (y, aux, dropped) = dense_moe_capped(
            x.as_tensor(),
            router.as_tensor(),
            &c.weights,
            &c.experts,
            Activation::Silu,
            Some(f),
        )
        .unwrap();
        assert!(dropped.iter().sum::<u64>() > 0, "f {f}: the case must drop");
        let loss = ((&y * &c.probe).unwrap().sum_all().unwrap() + &aux).unwrap();
        let grads = loss.backward().unwrap();
        let routing = RouteOptions {
            capacity: Some(CapacityFactor::new(f).unwrap()),
            ..RouteOptions::default()
        };
        for (tp, ep) in [(1, 1), (2, 1), (2, 2), (4, 4)] {
            let what = format!("f {f}, tp {tp} ep {ep}");
            let outs = world(tp, |g| {
                let shard = ExpertShard::for_experts(c.experts, FFN, 1, g.rank(), tp, ep)?;
                let moe = ParallelMoe::from_global(
                    &c.router,
                    c.experts,
                    &c.weights,
                    &shard,
                    tp,
                    Activation::Silu,
                )?
                .with_routing(routing.clone());
                let xv = candle_core::Var::from_tensor(&c.x)?;
                let out = moe.forward_local(&copy_to_tp(xv.as_tensor(), &g)?, &g)?;
                let y = out.partial.reduce()?;
                let loss = ((&y * &c.probe)?.sum_all()? + &out.aux_share)?;
                let gr = loss.backward()?;
                Ok((
                    y,
                    out.aux,
                    out.dropped,
                    gr.get(xv.as_tensor()).unwrap().clone(),
                    gr.get(moe.router().as_tensor()).unwrap().clone(),
                ))
            });
            let mut router_grad = outs[0].4.zeros_like().unwrap();
            for (r, (y_r, aux_r, dropped_r, dx, dr)) in outs.iter().enumerate() {
                assert_eq!(dropped_r, &dropped, "{what}: pairs dropped on rank {r}");
                assert_close(&format!("{what}: y on rank {r}"), y_r, &y);
                let aux_want = aux.to_scalar::<f32>().unwrap();
                assert!(
                    (aux_r - aux_want).abs() <= 1e-5,
                    "{what}: aux {aux_r} vs {aux_want}"
                );
                assert_close(
                    &format!("{what}: dx on rank {r}"),
                    dx,
                    grads.get(x.as_tensor()).unwrap(),
                );
                router_grad = (router_grad + dr).unwrap();
            }
            assert_close(
                &format!("{what}: d router"),
                &router_grad,
                grads.get(router.as_tensor()).unwrap(),
            );
        }
    }
}

/// The aux-loss-free bias moves the top-k selection only: the same bias on every expert
/// selects the same experts, so y and every gradient are those without a bias, bit for bit
/// (the bias never reaches the weights or the graph); a bias of 10 on expert 0 sends every
/// token to it (its load counts them all) while the weights stay the unbiased probabilities,
/// normalised over the chosen two.
#[test]
fn the_router_bias_moves_the_selection_not_the_weights() {
    let c = case(8, true, 48);
    let run = |bias: Vec<f32>| {
        world(2, |g| {
            let shard = ExpertShard::for_experts(c.experts, FFN, 1, g.rank(), 2, 1)?;
            let mut moe = ParallelMoe::from_global(
                &c.router,
                c.experts,
                &c.weights,
                &shard,
                2,
                Activation::Silu,
            )?;
            moe.set_selection_bias(bias.clone());
            let xv = candle_core::Var::from_tensor(&c.x)?;
            let out = moe.forward_local(&copy_to_tp(xv.as_tensor(), &g)?, &g)?;
            let y = out.partial.reduce()?;
            let gr = ((&y * &c.probe)?.sum_all()? + &out.aux_share)?.backward()?;
            let mut all = vec![y, gr.get(xv.as_tensor()).unwrap().clone()];
            all.push(gr.get(moe.router().as_tensor()).unwrap().clone());
            for (_, gv, uv, dv) in moe.expert_vars() {
                for v in [gv, uv, dv] {
                    if let Some(d) = gr.get(v.as_tensor()) {
                        all.push(d.clone());
                    }
                }
            }
            Ok((all, moe.take_load()))
        })
    };
    let bits = |t: &Tensor| -> Vec<u32> {
        t.flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap()
            .iter()
            .map(|v| v.to_bits())
            .collect()
    };
    let plain = run(Vec::new());
    let uniform = run(vec![0.3; 8]);
    for (r, (p, u)) in plain.iter().zip(&uniform).enumerate() {
        assert_eq!(p.0.len(), u.0.len());
        for (i, (a, b)) in p.0.iter().zip(&u.0).enumerate() {
            assert_eq!(bits(a), bits(b), "rank {r} tensor {i}");
        }
        assert_eq!(p.1, u.1, "rank {r}: loads");
    }
    assert_eq!(plain[0].1.iter().sum::<u64>(), (2 * TOKENS) as u64);
    // Every token to expert 0.
    let mut bias = vec![0.0; 8];
    bias[0] = 10.0;
    let skewed = run(bias.clone());
    assert_eq!(skewed[0].1[0], TOKENS as u64, "{:?}", skewed[0].1);
    let opts = RouteOptions {
        bias,
        ..RouteOptions::default()
    };
    let (probs, weights, counts, _) =
        tp_nn::moe::route(&c.x, &c.router, &c.experts, &opts).unwrap();
    assert_eq!(counts[0], TOKENS);
    let (p, w): (Vec<Vec<f32>>, Vec<Vec<f32>>) =
        (probs.to_vec2().unwrap(), weights.to_vec2().unwrap());
    for t in 0..TOKENS {
        let other = (1..8).find(|&e| w[t][e] != 0.0).unwrap();
        let sum = p[t][0] + p[t][other];
        assert!((w[t][0] - p[t][0] / sum).abs() <= 1e-6, "token {t}");
        assert!((w[t][other] - p[t][other] / sum).abs() <= 1e-6, "token {t}");
    }
}
