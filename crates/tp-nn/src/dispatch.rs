//! Expert parallelism across data-parallel replicas (docs/moe.md "Expert parallelism in
//! training"; Megatron-Core's token dispatcher): every rank holds whole experts, routes its
//! own replica's tokens with the replicated router, sends the (token, expert) rows bound for
//! another replica's experts with `all_to_all_v` over the ranks of its ep block with its tp
//! index, runs its experts on the rows it receives, sends the results back with the reverse
//! `all_to_all_v` and combines them with the routing weights into its partial output (still
//! summed by the block's tp all-reduce).
//!
//! The two data movements are one differentiable mapping, [`all_to_all_rows`] (forward:
//! all-to-all of rows with the counts; backward: the same with the counts swapped), so the
//! gradients flow exactly: an expert's gradient is summed over its block's tokens, the input's
//! returns to the rank that owns the token. Per MoE layer: 3 all-to-alls forward (the counts,
//! the rows out, the results back) and 2 backward.

use crate::error::{Result, TpError};
use crate::linear::PartialSum;
use crate::moe::{balance_loss, MoeOutput, ParallelMoe, Routed};
use candle_core::{CpuStorage, CustomOp1, DType, Layout, Shape, Tensor};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use tp_comm::{CommError, CommExt, Group};

/// Where the experts of this rank's tokens are: the ep group (the block's ranks with this tp
/// index) and, per expert, the rank of that group holding it.
#[derive(Debug)]
pub struct Dispatch {
    group: Group,
    /// `peers[e]`: the rank of `group` holding expert `e`; `None` for an expert a rank of
    /// another tp index holds (its rows are that rank's to send).
    peers: Vec<Option<usize>>,
    /// Rows this rank's experts computed, counted when the dispatch's backward runs (once a
    /// trained micro-batch, also when the forward is recomputed).
    rows: Arc<AtomicU64>,
}

impl Dispatch {
    /// Checks `peers` against the layer: one entry per expert, in the group, and this rank
    /// the holder of exactly its local experts.
    pub(crate) fn new(group: Group, peers: Vec<Option<usize>>, moe: &ParallelMoe) -> Result<Self> {
        let count = moe.experts().count;
        let me = group.rank();
        let bad = |m: String| Err(TpError::Config(m));
        if peers.len() != count {
            return bad(format!(
                "expert dispatch: {} peers listed for {count} experts",
                peers.len()
            ));
        }
        if let Some(p) = peers.iter().flatten().find(|&&p| p >= group.size()) {
            return bad(format!(
                "expert dispatch: peer {p} is outside the {}-rank expert-parallel group",
                group.size()
            ));
        }
        let local: Vec<usize> = moe.local().iter().map(|e| e.index).collect();
        let mine: Vec<usize> = (0..count).filter(|&e| peers[e] == Some(me)).collect();
        if local != mine {
            return bad(format!(
                "expert dispatch: this rank holds experts {local:?}, but the dispatch sends it \
                 experts {mine:?}"
            ));
        }
        Ok(Dispatch {
            group,
            peers,
            rows: Arc::new(AtomicU64::new(0)),
        })
    }

    /// Rows this rank's experts have computed in trained micro-batches so far.
    pub fn rows(&self) -> u64 {
        self.rows.load(Ordering::Relaxed)
    }

    /// [`ParallelMoe::forward_local`] with the tokens dispatched: `x_par [n, hidden]` (this
    /// replica's tokens, inside the tp region, routed as `routed` says) -> this rank's partial
    /// `[n, hidden]`.
    pub(crate) fn forward(
        &self,
        moe: &ParallelMoe,
        x_par: &Tensor,
        tp_group: &Group,
        routed: Routed,
    ) -> Result<MoeOutput> {
        let experts = moe.experts();
        let count = experts.count;
        let size = self.group.size();
        let dev = x_par.device();
        let Routed {
            probs,
            weights,
            counts,
            dropped,
        } = routed;
        let picked: Vec<Vec<f32>> = weights.to_vec2()?; // [n][count]

        // The (token, expert) rows this tp index serves, by peer, then expert, then token.
        let mut tokens: Vec<u32> = Vec::new();
        let mut flat: Vec<u32> = Vec::new(); // token * count + expert, into weights
        let mut send_counts = vec![0u64; size * count]; // [peer][expert]
        for p in 0..size {
            for e in (0..count).filter(|&e| self.peers[e] == Some(p)) {
                for (t, row) in picked.iter().enumerate() {
                    if row[e] != 0.0 {
                        tokens.push(t as u32);
                        flat.push((t * count + e) as u32);
                        send_counts[p * count + e] += 1;
                    }
                }
            }
        }
        // Each peer's rows for each of this rank's experts.
        let mut recv_counts = vec![0u64; size * count]; // [peer][expert]
        self.group.all_to_all(&send_counts, &mut recv_counts)?;
        let per_peer = |c: &[u64]| -> Vec<usize> {
            c.chunks(count)
                .map(|r| r.iter().sum::<u64>() as usize)
                .collect()
        };
        let (send_rows, recv_rows) = (per_peer(&send_counts), per_peer(&recv_counts));

        let m_send = tokens.len();
        let ids = Tensor::from_vec(tokens, m_send, dev)?; // [m_send]
        let x_send = x_par.index_select(&ids, 0)?; // [m_send, hidden]
        let x_recv = rows_op(
            &x_send,
            &self.group,
            &send_rows,
            &recv_rows,
            Some(&self.rows),
        )?; // [m_recv, hidden]

        // The received rows of each local expert: peer blocks in order, experts ascending.
        let mut rows_of: Vec<Vec<u32>> = vec![Vec::new(); count];
        let mut at = 0u32;
        for q in 0..size {
            for e in 0..count {
                let c = recv_counts[q * count + e] as u32;
                rows_of[e].extend(at..at + c);
                at += c;
            }
        }
        // Depends on x_recv (times a zero tensor, which candle keeps in the graph), so the
        // return's backward runs on every rank, also one whose experts got no rows.
        let zero = Tensor::zeros((1, 1), x_recv.dtype(), dev)?;
        let mut y_recv = x_recv.broadcast_mul(&zero)?; // [m_recv, hidden]

        // Zero terms of the experts no row reached, added to the output: candle drops the
        // other operand of a binary op on an empty tensor, and `y_recv` may be empty.
        let mut idle = Tensor::zeros((), x_recv.dtype(), dev)?;
        for e in moe.local() {
            let rows = &rows_of[e.index];
            if rows.is_empty() {
                idle = (idle + ParallelMoe::idle(e)?)?;
                continue;
            }
            let rid = Tensor::from_vec(rows.clone(), rows.len(), dev)?; // [m_e]
            let y = moe.run_expert(e, &x_recv.index_select(&rid, 0)?)?; // [m_e, hidden]
            y_recv = y_recv.index_add(&rid, &y, 0)?;
        }
        let y_send = all_to_all_rows(&y_recv, &self.group, &recv_rows, &send_rows)?; // [m_send, hidden]

        let mut out = x_par.zeros_like()?.broadcast_add(&idle)?; // [n, hidden]
        if m_send > 0 {
            let fid = Tensor::from_vec(flat, m_send, dev)?; // [m_send]
            let w = weights.flatten_all()?.index_select(&fid, 0)?.unsqueeze(1)?; // [m_send, 1]
            out = out.index_add(&ids, &y_send.broadcast_mul(&w)?, 0)?;
        } else {
            // Keeps the return's backward (a collective) in the graph with no row sent.
            out = out.broadcast_add(&y_send.sum_all()?.broadcast_mul(&zero)?)?;
        }
        let aux = balance_loss(&probs, &counts, experts)?;
        let value = aux.to_scalar::<f32>()?;
        Ok(MoeOutput {
            partial: PartialSum::new(out, tp_group),
            aux_share: (aux / tp_group.size() as f64)?,
            aux: value,
            dropped,
        })
    }
}

/// Rows to and from the ranks of a group, differentiable: `x [sum(send), width]`, whose
/// first `send[0]` rows go to rank 0 and so on -> `[sum(recv), width]`, rank q's rows in
/// block q; the backward sends the gradient's rows back (the counts swapped).
pub fn all_to_all_rows(
    x: &Tensor,
    group: &Group,
    send: &[usize],
    recv: &[usize],
) -> Result<Tensor> {
    rows_op(x, group, send, recv, None)
}

/// [`all_to_all_rows`] adding, when its backward runs, the rows it received to `counter`.
fn rows_op(
    x: &Tensor,
    group: &Group,
    send: &[usize],
    recv: &[usize],
    counter: Option<&Arc<AtomicU64>>,
) -> Result<Tensor> {
    let what = "all_to_all_rows";
    if x.dtype() != DType::F32 || !x.device().is_cpu() {
        return Err(TpError::Shape(format!(
            "{what} supports f32 CPU tensors, got {:?}",
            x.dtype()
        )));
    }
    let (rows, width) = x.dims2()?;
    if send.len() != group.size()
        || recv.len() != group.size()
        || send.iter().sum::<usize>() != rows
    {
        return Err(TpError::Shape(format!(
            "{what}: {rows} rows with send counts {send:?} and receive counts {recv:?} for a \
             {}-rank group",
            group.size()
        )));
    }
    let op = Rows {
        group: group.clone(),
        send: send.to_vec(),
        recv: recv.to_vec(),
        width,
        precomputed: Mutex::new(None),
        counter: counter.cloned(),
    };
    let x = x.contiguous()?;
    // The collective runs here, with a typed error; the op hands its result to candle.
    let done = op.apply(&x.flatten_all()?.to_vec1::<f32>()?, true)?;
    if let Ok(mut p) = op.precomputed.lock() {
        *p = Some(done);
    }
    Ok(x.apply_op1(op)?)
}

struct Rows {
    group: Group,
    send: Vec<usize>,
    recv: Vec<usize>,
    width: usize,
    precomputed: Mutex<Option<Vec<f32>>>,
    /// Counts the received rows when the backward runs (the dispatch's expert load).
    counter: Option<Arc<AtomicU64>>,
}

impl Rows {
    /// Forward: `send` rows out, `recv` rows in; backward the reverse.
    fn apply(&self, x: &[f32], fwd: bool) -> std::result::Result<Vec<f32>, CommError> {
        let (out_rows, in_rows) = if fwd {
            (&self.send, &self.recv)
        } else {
            (&self.recv, &self.send)
        };
        let elems = |c: &[usize]| c.iter().map(|r| r * self.width).collect::<Vec<_>>();
        let (sc, rc) = (elems(out_rows), elems(in_rows));
        let mut out = vec![0f32; rc.iter().sum()];
        self.group.all_to_all_v(x, &sc, &mut out, &rc)?;
        Ok(out)
    }

    fn rows(&self, fwd: bool) -> usize {
        if fwd { &self.recv } else { &self.send }.iter().sum()
    }
}

impl CustomOp1 for Rows {
    fn name(&self) -> &'static str {
        "all_to_all_rows"
    }

    fn cpu_fwd(
        &self,
        storage: &CpuStorage,
        layout: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let pre = self.precomputed.lock().ok().and_then(|mut p| p.take());
        let out = match pre {
            Some(done) => done,
            None => {
                let data = storage.as_slice::<f32>()?;
                let (start, end) = layout.contiguous_offsets().ok_or_else(|| {
                    candle_core::Error::msg("all_to_all_rows: input must be contiguous")
                })?;
                self.apply(&data[start..end], true)
                    .map_err(candle_core::Error::wrap)?
            }
        };
        Ok((
            CpuStorage::F32(out),
            Shape::from((self.rows(true), self.width)),
        ))
    }

    fn bwd(
        &self,
        _arg: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<Option<Tensor>> {
        let grad = grad.to_dtype(DType::F32)?.contiguous()?;
        let x = grad.flatten_all()?.to_vec1::<f32>()?;
        let out = self.apply(&x, false).map_err(candle_core::Error::wrap)?;
        if let Some(c) = &self.counter {
            c.fetch_add(self.rows(true) as u64, Ordering::Relaxed);
        }
        Ok(Some(Tensor::from_vec(
            out,
            (self.rows(false), self.width),
            grad.device(),
        )?))
    }
}
