//! Single-device reference block, the test oracle: plain candle, no parallelism, written
//! independently of the parallel path (candle's `rms_norm_slow` and `rope_slow`/`rope_i_slow`,
//! KV heads repeated by broadcasting). Same math as Llama's block, and Qwen3's with the
//! per-head q/k norms (`rms_norm_slow` over each head's `head_dim`, before RoPE).

use crate::block::{BlockConfig, BlockWeights};
use crate::error::Result;
use crate::rope::RopeLayout;
use candle_core::{Tensor, Var, D};

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
        let mut vars = vec![
            ("attn_norm", v(&w.attn_norm)?),
            ("wq", v(&w.wq)?),
            ("wk", v(&w.wk)?),
            ("wv", v(&w.wv)?),
            ("wo", v(&w.wo)?),
            ("mlp_norm", v(&w.mlp_norm)?),
            ("w_gate", v(&w.w_gate)?),
            ("w_up", v(&w.w_up)?),
            ("w_down", v(&w.w_down)?),
        ];
        if let Some((q, k)) = cfg.qk_norm_weights(w)? {
            vars.push(("q_norm", v(q)?));
            vars.push(("k_norm", v(k)?));
        }
        // Frequencies theta^(-2i/d), computed here as a tensor expression (not shared with
        // the parallel path's table builder).
        let half = cfg.head_dim / 2;
        let dev = w.wq.device();
        let f64_ = candle_core::DType::F64;
        let i = Tensor::arange(0u32, half as u32, dev)?.to_dtype(f64_)?; // [half]
        let inv_freq = (i * (-2.0 * cfg.rope_theta.ln() / cfg.head_dim as f64))?.exp()?; // [half]
        let pos = Tensor::arange(0u32, cfg.max_seq as u32, dev)?.to_dtype(f64_)?; // [max_seq]
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

    fn w(&self, i: usize) -> &Tensor {
        self.vars[i].1.as_tensor()
    }

    /// `h [batch, seq, hidden] -> [batch, seq, hidden]`.
    pub fn forward(&self, h: &Tensor) -> Result<Tensor> {
        let c = &self.cfg;
        let (b, s, hidden) = h.dims3()?;
        let eps = c.rms_eps as f32;
        let lin = |x: &Tensor, w: &Tensor| x.broadcast_matmul(&w.t()?);
        let n = candle_nn::ops::rms_norm_slow(h, self.w(0), eps)?; // [b, s, hidden]
        let q = lin(&n, self.w(1))?.reshape((b, s, c.heads, c.head_dim))?; // [b, s, heads, hd]
        let k = lin(&n, self.w(2))?.reshape((b, s, c.kv_heads, c.head_dim))?; // [b, s, kv, hd]
        let (q, k) = if c.qk_norm {
            (
                candle_nn::ops::rms_norm_slow(&q, self.w(9), eps)?, // [b, s, heads, hd]
                candle_nn::ops::rms_norm_slow(&k, self.w(10), eps)?, // [b, s, kv, hd]
            )
        } else {
            (q, k)
        };
        let q = q.transpose(1, 2)?.contiguous()?; // [b, heads, s, hd]
        let k = k.transpose(1, 2)?.contiguous()?; // [b, kv, s, hd]
        let v = lin(&n, self.w(3))?
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
        let att = (q.matmul(&k.transpose(2, 3)?.contiguous()?)? / (c.head_dim as f64).sqrt())?; // [b, heads, s, s]
        let mask: Vec<u8> = (0..s)
            .flat_map(|i| (0..s).map(move |j| u8::from(j <= i)))
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
        let h = (h + lin(&ctx, self.w(4))?)?; // [b, s, hidden]
        let n = candle_nn::ops::rms_norm_slow(&h, self.w(5), eps)?; // [b, s, hidden]
        let gate = lin(&n, self.w(6))?; // [b, s, ffn]
        let up = lin(&n, self.w(7))?; // [b, s, ffn]
        let act = (candle_nn::ops::sigmoid(&gate)? * &gate)?; // [b, s, ffn]
        let m = lin(&(act * up)?, self.w(8))?; // [b, s, hidden]
        debug_assert_eq!(m.dim(2)?, hidden);
        Ok((h + m)?)
    }
}
