//! Single-device reference block, the test oracle: plain candle, no parallelism, written
//! independently of the parallel path (candle's `rms_norm_slow` and `rope_slow`/`rope_i_slow`,
//! KV heads repeated by broadcasting). Same math as Llama's block, Qwen3's with the
//! per-head q/k norms (`rms_norm_slow` over each head's `head_dim`, before RoPE), and
//! Gemma-3's layer styles (GeGLU written out from its formula, post norms, `1 + w` norms,
//! query scale, a windowed mask, scaled positions), Qwen2's Q/K/V biases (added to the whole
//! projections, before RoPE).

use crate::block::{BlockConfig, BlockWeights};
use crate::error::Result;
use crate::error::TpError;
use crate::rope::RopeLayout;
use candle_core::{Tensor, Var, D};
use tp_spec::Activation;

#[derive(Debug)]
pub struct DenseBlock {
    cfg: BlockConfig,
    vars: Vec<(&'static str, Var)>,
    cos: Tensor, // [max_seq, head_dim / 2]
    sin: Tensor, // [max_seq, head_dim / 2]
}

impl DenseBlock {
    pub fn new(cfg: &BlockConfig, w: &BlockWeights) -> Result<Self> {
        cfg.validate()?;
        let v = |t: &Tensor| Var::from_tensor(&t.copy()?);
        let (w_gate, w_up, w_down) = w.mlp.dense().ok_or_else(|| {
            TpError::Config("the dense reference block has no experts (see dense_moe)".into())
        })?;
        let mut vars = vec![
            ("attn_norm", v(&w.attn_norm)?),
            ("wq", v(&w.wq)?),
            ("wk", v(&w.wk)?),
            ("wv", v(&w.wv)?),
            ("wo", v(&w.wo)?),
            ("mlp_norm", v(&w.mlp_norm)?),
            ("w_gate", v(w_gate)?),
            ("w_up", v(w_up)?),
            ("w_down", v(w_down)?),
        ];
        if let Some((q, k)) = cfg.qk_norm_weights(w)? {
            vars.push(("q_norm", v(q)?));
            vars.push(("k_norm", v(k)?));
        }
        if let Some((a, m)) = cfg.post_norm_weights(w)? {
            vars.push(("post_attn_norm", v(a)?));
            vars.push(("post_mlp_norm", v(m)?));
        }
        if let Some([q, k, b]) = cfg.qkv_bias_weights(w)? {
            vars.push(("bq", v(q)?));
            vars.push(("bk", v(k)?));
            vars.push(("bv", v(b)?));
        }
        // Frequencies theta^(-2i/d), computed here as a tensor expression (not shared with
        // the parallel path's table builder).
        let half = cfg.head_dim / 2;
        let dev = w.wq.device();
        let f64_ = candle_core::DType::F64;
        let i = Tensor::arange(0u32, half as u32, dev)?.to_dtype(f64_)?; // [half]
        let inv_freq = (i * (-2.0 * cfg.rope_theta.ln() / cfg.head_dim as f64))?.exp()?; // [half]
        let pos = (Tensor::arange(0u32, cfg.max_seq as u32, dev)?.to_dtype(f64_)?
            / cfg.style.rope_scale)?; // [max_seq]
        let ang = pos.unsqueeze(1)?.broadcast_mul(&inv_freq.unsqueeze(0)?)?; // [max_seq, half]
        let cos = ang.cos()?.to_dtype(candle_core::DType::F32)?.contiguous()?; // [max_seq, half]
        let sin = ang.sin()?.to_dtype(candle_core::DType::F32)?.contiguous()?; // [max_seq, half]
        Ok(DenseBlock {
            cfg: cfg.clone(),
            vars,
            cos,
            sin,
        })
    }

    pub fn vars(&self) -> &[(&'static str, Var)] {
        &self.vars
    }

    /// The weight named `name`.
    fn w(&self, name: &str) -> Result<&Tensor> {
        self.vars
            .iter()
            .find(|(n, _)| *n == name)
            .map(|(_, v)| v.as_tensor())
            .ok_or_else(|| TpError::Config(format!("the reference block has no {name}")))
    }

    /// RMSNorm of `x` by the weight `name`, `x * (1 + w)` for Gemma's norms.
    fn norm(&self, x: &Tensor, name: &str) -> Result<Tensor> {
        let w = self.w(name)?;
        let w = if self.cfg.style.unit_offset_norms {
            (w + 1.0)?
        } else {
            w.clone()
        };
        Ok(candle_nn::ops::rms_norm_slow(
            x,
            &w,
            self.cfg.rms_eps as f32,
        )?)
    }

    /// `h [batch, seq, hidden] -> [batch, seq, hidden]`.
    pub fn forward(&self, h: &Tensor) -> Result<Tensor> {
        let c = &self.cfg;
        let (b, s, hidden) = h.dims3()?;
        let lin = |x: &Tensor, w: &Tensor| x.broadcast_matmul(&w.t()?);
        // A projection with its bias (Qwen2) when the block has one.
        let proj = |x: &Tensor, w: &str, bias: &str| -> Result<Tensor> {
            let y = lin(x, self.w(w)?)?; // [b, s, out]
            Ok(if c.qkv_bias {
                y.broadcast_add(self.w(bias)?)? // [b, s, out]
            } else {
                y
            })
        };
        let n = self.norm(h, "attn_norm")?; // [b, s, hidden]
        let q = proj(&n, "wq", "bq")?.reshape((b, s, c.heads, c.head_dim))?; // [b, s, heads, hd]
        let k = proj(&n, "wk", "bk")?.reshape((b, s, c.kv_heads, c.head_dim))?; // [b, s, kv, hd]
        let (q, k) = if c.qk_norm {
            (self.norm(&q, "q_norm")?, self.norm(&k, "k_norm")?) // [b, s, heads|kv, hd]
        } else {
            (q, k)
        };
        let q = q.transpose(1, 2)?.contiguous()?; // [b, heads, s, hd]
        let k = k.transpose(1, 2)?.contiguous()?; // [b, kv, s, hd]
        let v = proj(&n, "wv", "bv")?
            .reshape((b, s, c.kv_heads, c.head_dim))?
            .transpose(1, 2)?
            .contiguous()?; // [b, kv, s, hd]
        let (cos, sin) = (&self.cos, &self.sin);
        let rope = |x: &Tensor| match c.rope_layout {
            RopeLayout::RotateHalf => candle_nn::rotary_emb::rope_slow(x, cos, sin),
            RopeLayout::Interleaved => candle_nn::rotary_emb::rope_i_slow(x, cos, sin),
        };
        let q = rope(&q)?; // [b, heads, s, hd]
        let k = rope(&k)?; // [b, kv, s, hd]
        let g = c.heads / c.kv_heads;
        // Repeat each KV head g times: [b, kv, 1, s, hd] -> [b, kv, g, s, hd] -> [b, heads, s, hd].
        let rep = |x: &Tensor| {
            x.unsqueeze(2)?
                .broadcast_as((b, c.kv_heads, g, s, c.head_dim))?
                .contiguous()?
                .reshape((b, c.heads, s, c.head_dim))
        };
        let k = rep(&k)?; // [b, heads, s, hd]
        let v = rep(&v)?; // [b, heads, s, hd]
        let scale = c
            .style
            .query_scale
            .unwrap_or(1.0 / (c.head_dim as f64).sqrt());
        let att = (q.matmul(&k.transpose(2, 3)?.contiguous()?)? * scale)?; // [b, heads, s, s]
        let window = c.style.window.unwrap_or(s + 1);
        let mask: Vec<u8> = (0..s)
            .flat_map(|i| (0..s).map(move |j| u8::from(j <= i && j + window > i)))
            .collect();
        let mask = Tensor::from_vec(mask, (s, s), h.device())?.broadcast_as(att.shape())?; // [b, heads, s, s]
        let neg = Tensor::full(f32::NEG_INFINITY, att.shape(), h.device())?; // [b, heads, s, s]
        let att = mask.where_cond(&att, &neg)?; // [b, heads, s, s]
        let p = candle_nn::ops::softmax(&att, D::Minus1)?; // [b, heads, s, s]
        let ctx =
            p.matmul(&v)?
                .transpose(1, 2)?
                .contiguous()?
                .reshape((b, s, c.heads * c.head_dim))?; // [b, s, heads*hd]
        let a = lin(&ctx, self.w("wo")?)?; // [b, s, hidden]
        let a = if c.style.post_norms {
            self.norm(&a, "post_attn_norm")? // [b, s, hidden]
        } else {
            a
        };
        let h = (h + a)?; // [b, s, hidden]
        let n = self.norm(&h, "mlp_norm")?; // [b, s, hidden]
        let gate = lin(&n, self.w("w_gate")?)?; // [b, s, ffn]
        let up = lin(&n, self.w("w_up")?)?; // [b, s, ffn]
        let act = match c.style.activation {
            Activation::Silu => (candle_nn::ops::sigmoid(&gate)? * &gate)?, // [b, s, ffn]
            Activation::GeluTanh => {
                // 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))
                let cube = (gate.sqr()? * &gate)?; // [b, s, ffn]
                let inner = ((&gate + (cube * 0.044715)?)? * (2.0 / std::f64::consts::PI).sqrt())?; // [b, s, ffn]
                (((inner.tanh()? + 1.0)? * &gate)? * 0.5)? // [b, s, ffn]
            }
        };
        let m = lin(&(act * up)?, self.w("w_down")?)?; // [b, s, hidden]
        let m = if c.style.post_norms {
            self.norm(&m, "post_mlp_norm")? // [b, s, hidden]
        } else {
            m
        };
        debug_assert_eq!(m.dim(2)?, hidden);
        Ok((h + m)?)
    }
}

/// The single-device mixture of experts, the oracle of [`crate::moe::ParallelMoe`]: token by
/// token, the softmax of its router scores, its top-k experts by sorting (ties to the lower
/// expert), each chosen expert's whole MLP weighted (normalised over the k when the family
/// does), plus the load-balancing loss `E * sum_e f_e * P_e`. Returns `(y [n, hidden], aux)`.
pub fn dense_moe(
    x: &Tensor,
    router: &Tensor,
    weights: &[(Tensor, Tensor, Tensor)],
    experts: &tp_spec::Experts,
    activation: Activation,
) -> Result<(Tensor, Tensor)> {
    let (y, aux, _) = dense_moe_capped(x, router, weights, experts, activation, None)?;
    Ok((y, aux))
}

/// [`dense_moe`] under a capacity factor `f`: each expert keeps the first
/// `ceil(f x n x k / E)` (at least 1) of the tokens routed to it in token order, a later
/// token skipping it (its other experts' weights unchanged); the loss's `f_e` counts the
/// routed tokens. Also returns the pairs dropped per expert.
pub fn dense_moe_capped(
    x: &Tensor,
    router: &Tensor,
    weights: &[(Tensor, Tensor, Tensor)],
    experts: &tp_spec::Experts,
    activation: Activation,
    capacity: Option<f64>,
) -> Result<(Tensor, Tensor, Vec<u64>)> {
    let (n, _) = x.dims2()?;
    let count = experts.count;
    let cap = capacity.map_or(n, |f| {
        ((f * (n * experts.per_token) as f64 / count as f64).ceil() as usize).max(1)
    });
    let mut taken = vec![0usize; count];
    let mut dropped = vec![0u64; count];
    let mut rows = Vec::with_capacity(n);
    let mut probs_rows = Vec::with_capacity(n);
    let mut routed = vec![0f32; count];
    for t in 0..n {
        let xt = x.narrow(0, t, 1)?; // [1, hidden]
        let p = candle_nn::ops::softmax(&xt.matmul(&router.t()?)?, D::Minus1)?; // [1, count]
        let pv: Vec<f32> = p.flatten_all()?.to_vec1()?;
        let mut order: Vec<usize> = (0..count).collect();
        order.sort_by(|a, b| pv[*b].total_cmp(&pv[*a]));
        let chosen = &order[..experts.per_token];
        let total = chosen
            .iter()
            .map(|&e| p.narrow(1, e, 1))
            .collect::<candle_core::Result<Vec<_>>>()?;
        let sum = Tensor::cat(&total, 1)?.sum_keepdim(1)?; // [1, 1]
        let mut y = xt.zeros_like()?; // [1, hidden]
        for &e in chosen {
            routed[e] += 1.0;
            taken[e] += 1;
            if taken[e] > cap {
                dropped[e] += 1;
                continue;
            }
            let (g, u, d) = &weights[e];
            let gate = xt.matmul(&g.t()?)?;
            let act = match activation {
                Activation::Silu => gate.silu()?,
                Activation::GeluTanh => gate.gelu()?,
            };
            let out = (act * xt.matmul(&u.t()?)?)?.matmul(&d.t()?)?; // [1, hidden]
            let mut w = p.narrow(1, e, 1)?; // [1, 1]
            if experts.normalize {
                w = (w / &sum)?;
            }
            y = (y + out.broadcast_mul(&w)?)?;
        }
        rows.push(y);
        probs_rows.push(p);
    }
    let probs = Tensor::cat(&probs_rows, 0)?; // [n, count]
    let f: Vec<f32> = routed
        .iter()
        .map(|c| c / (n * experts.per_token) as f32)
        .collect();
    let f = Tensor::from_vec(f, (count,), x.device())?;
    let aux = ((probs.mean(0)? * f)?.sum_all()? * count as f64)?;
    Ok((Tensor::cat(&rows, 0)?, aux, dropped))
}
