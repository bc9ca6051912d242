//! Qwen3 / Qwen3-MoE (`qwen3`, `qwen3_moe`): the devnet model.
//!
//! As transformers' `modeling_qwen3_moe.py`: token embedding; per layer
//! `x += o_proj(attn(q_norm(q_proj(rms(x))), k_norm(k_proj(rms(x))), v_proj(rms(x))))` with
//! rotate-half RoPE over the whole head and grouped KV heads (softmax scale `head_dim^-0.5`),
//! then `x += mlp(rms(x))` where `mlp` is SwiGLU or the sparse MoE block (softmax router in f32,
//! top-k, renormalised when `norm_topk_prob`); final RMSNorm. A layer `i` is sparse when
//! `num_experts > 0`, `i` is not in `mlp_only_layers` and `(i + 1) % decoder_sparse_step == 0`.
//!
//! Config: `num_experts` (v4) or `num_local_experts` (v5); `head_dim` defaults to
//! `hidden_size / num_attention_heads`.
//!
//! With [`Compute::Bf16`] every module's output is rounded to bf16 where transformers' bf16
//! model rounds it: `Qwen3MoeRMSNorm` rounds the normalised row, then its product with the
//! weight ([`ops::rms_norm_in`]); each projection's output is rounded; RoPE uses bf16
//! `cos`/`sin` and rounds each product and the sum ([`ops::rope_half_in`]); attention is a
//! fused kernel's ([`ops::attention_in`]); the router's logits are bf16 (a bf16 `nn.Linear`),
//! softmax and renormalisation f32 with torch's `topk` tie order, the weights rounded to
//! bf16; routed experts as `grouped_mm` ([`ops::moe_dispatch_in`]); every residual add is
//! rounded. Prefill and decode round at the same points, so they stay consistent.
//!
//! Cache per layer: `[k, v]`, each `[kv_heads, positions, head_dim]`.
use std::sync::Arc;

use candle_core::{DType, Tensor};

use super::experts;
use super::ops::{self, linear_t};
use super::{
    Architecture, AttentionKernel, Cache, Fp8Activations, LayerCache, LoadOptions, Probe,
    RouteScores, RoutingShape, TextConfig, Weights,
};
use crate::{Compute, ModelError};

/// The loaded Qwen3(-MoE) model.
pub struct Qwen3Moe {
    cfg: TextConfig,
    w: Arc<Weights>,
    compute: Compute,
    /// How products with block-FP8 weights treat their input rows (W8A16 or W8A8).
    acts: Fp8Activations,
    attention: AttentionKernel,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    intermediate: usize,
    experts: usize,
    top_k: usize,
    moe_inter: usize,
    norm_topk_prob: bool,
    sparse_step: usize,
    mlp_only: Vec<usize>,
}

impl Qwen3Moe {
    /// Reads the Qwen3(-MoE) fields of `cfg` and checks every tensor the forward pass uses
    /// (decoding them all now when [`Weights::preloads`](super::Weights::preloads)).
    ///
    /// # Errors
    /// [`ModelError::Config`] for inconsistent settings, [`ModelError::MissingTensor`] /
    /// [`ModelError::Shape`] when the checkpoint does not match.
    pub fn load(cfg: TextConfig, w: Arc<Weights>, opts: &LoadOptions) -> Result<Self, ModelError> {
        let d = cfg.hidden_size;
        let heads = cfg.usize_req("num_attention_heads")?;
        let kv_heads = cfg.usize_or("num_key_value_heads", heads)?;
        let head_dim = cfg.usize_or("head_dim", d / heads)?;
        let experts = match cfg.usize_or("num_experts", 0)? {
            0 => cfg.usize_or("num_local_experts", 0)?,
            n => n,
        };
        let m = Self {
            heads,
            kv_heads,
            head_dim,
            intermediate: cfg.usize_or("intermediate_size", 0)?,
            experts,
            top_k: cfg.usize_or("num_experts_per_tok", 0)?,
            moe_inter: cfg.usize_or("moe_intermediate_size", 0)?,
            norm_topk_prob: cfg.bool_or("norm_topk_prob", false),
            sparse_step: cfg.usize_or("decoder_sparse_step", 1)?,
            mlp_only: cfg.usize_list("mlp_only_layers"),
            compute: opts.compute,
            acts: opts.fp8_activations,
            attention: opts.attention,
            cfg,
            w,
        };
        let checks = [
            (
                kv_heads > 0 && heads.is_multiple_of(kv_heads),
                "num_attention_heads must be a multiple of num_key_value_heads",
            ),
            (
                head_dim > 0 && head_dim.is_multiple_of(2),
                "head_dim must be even and > 0",
            ),
            (
                m.experts == 0 || (m.top_k > 0 && m.top_k <= m.experts && m.moe_inter > 0),
                "MoE needs 0 < num_experts_per_tok <= num_experts and moe_intermediate_size > 0",
            ),
            (
                m.cfg.str_field("hidden_act").unwrap_or("silu") == "silu",
                "hidden_act must be \"silu\" (SwiGLU)",
            ),
        ];
        for (ok, msg) in checks {
            if !ok {
                return Err(ModelError::Config(msg.to_string()));
            }
        }
        m.check_tensors()?;
        Ok(m)
    }

    fn is_moe_layer(&self, i: usize) -> bool {
        self.experts > 0
            && self.sparse_step > 0
            && !self.mlp_only.contains(&i)
            && (i + 1).is_multiple_of(self.sparse_step)
    }

    /// Fetches every weight once: errors surface at load, and resident weights are decoded.
    fn check_tensors(&self) -> Result<(), ModelError> {
        let (d, v) = (self.cfg.hidden_size, self.cfg.vocab_size);
        let (h, kv, hd) = (self.heads, self.kv_heads, self.head_dim);
        let w = &*self.w;
        let streaming = !w.preloads();
        let need = |name: String, shape: Vec<usize>, proj: bool| -> Result<(), ModelError> {
            if streaming {
                // Plain tensors from the header now; projections (maybe quantised) on use.
                return match (proj, w.has(&name)) {
                    (false, _) => w.check_stored(&name, &shape),
                    (true, true) => Ok(()),
                    (true, false) => Err(ModelError::MissingTensor(w.resolve(&name))),
                };
            }
            match (proj, shape.as_slice()) {
                (true, &[o, i]) => w
                    .projection_t(name.trim_end_matches(".weight"), o, i)
                    .map(drop),
                _ => w.tensor_shaped(&name, &shape).map(drop),
            }
        };
        need("model.embed_tokens.weight".into(), vec![v, d], false)?;
        need("model.norm.weight".into(), vec![d], false)?;
        if !self.cfg.tie_word_embeddings {
            need("lm_head.weight".into(), vec![v, d], false)?;
        }
        for i in 0..self.cfg.num_hidden_layers {
            let p = format!("model.layers.{i}");
            need(format!("{p}.input_layernorm.weight"), vec![d], false)?;
            need(
                format!("{p}.post_attention_layernorm.weight"),
                vec![d],
                false,
            )?;
            need(
                format!("{p}.self_attn.q_proj.weight"),
                vec![h * hd, d],
                true,
            )?;
            need(
                format!("{p}.self_attn.k_proj.weight"),
                vec![kv * hd, d],
                true,
            )?;
            need(
                format!("{p}.self_attn.v_proj.weight"),
                vec![kv * hd, d],
                true,
            )?;
            need(
                format!("{p}.self_attn.o_proj.weight"),
                vec![d, h * hd],
                true,
            )?;
            need(format!("{p}.self_attn.q_norm.weight"), vec![hd], false)?;
            need(format!("{p}.self_attn.k_norm.weight"), vec![hd], false)?;
            let mlp = |q: String, inter: usize| -> Result<(), ModelError> {
                need(format!("{q}.gate_proj.weight"), vec![inter, d], true)?;
                need(format!("{q}.up_proj.weight"), vec![inter, d], true)?;
                need(format!("{q}.down_proj.weight"), vec![d, inter], true)
            };
            if self.is_moe_layer(i) {
                for e in 0..self.experts {
                    mlp(format!("{p}.mlp.experts.{e}"), self.moe_inter)?;
                }
                need(format!("{p}.mlp.gate.weight"), vec![self.experts, d], false)?;
            } else {
                mlp(format!("{p}.mlp"), self.intermediate)?;
            }
        }
        Ok(())
    }

    /// `x · Wᵀ` for the projection `module` `[out, inp]` as this model multiplies it: the
    /// weight as the recompute holds it ([`Weights::projection_t_in`]), or, for a block-FP8
    /// weight under W8A8, [`Weights::linear_as`]. Unrounded.
    fn lin(&self, module: &str, x: &Tensor, out: usize, inp: usize) -> Result<Tensor, ModelError> {
        let c = self.compute;
        if self.acts == Fp8Activations::PerTokenGroup && self.w.is_block_fp8(module) {
            return self.w.linear_as(module, x, out, inp, c, self.acts);
        }
        Ok(linear_t(x, &self.w.projection_t_in(module, out, inp, c)?)?)
    }

    fn mlp(&self, module: &str, x: &Tensor, inter: usize) -> Result<Tensor, ModelError> {
        let c = self.compute;
        let d = self.cfg.hidden_size;
        let g = self.lin(&format!("{module}.gate_proj"), x, inter, d)?;
        let g = c.round(ops::silu(&c.round(g)?)?)?;
        let u = c.round(self.lin(&format!("{module}.up_proj"), x, inter, d)?)?;
        let h = c.round((g * u)?)?;
        Ok(c.round(self.lin(&format!("{module}.down_proj"), &h, d, inter)?)?)
    }

    /// The MLP of layer `i` on `x` `[t, hidden]` (rows at positions `off..`); an MoE layer's
    /// routing goes through `probe` ([`Probe::route`]).
    fn ffn(
        &self,
        i: usize,
        x: &Tensor,
        off: usize,
        probe: &mut Probe<'_>,
    ) -> Result<Tensor, ModelError> {
        let p = format!("model.layers.{i}.mlp");
        if !self.is_moe_layer(i) {
            return self.mlp(&p, x, self.intermediate);
        }
        let d = self.cfg.hidden_size;
        let c = self.compute;
        let router = self.w.matrix_t(&format!("{p}.gate"), self.experts, d)?;
        // `Qwen3MoeTopKRouter`: logits in the activation dtype, softmax (and renormalisation)
        // in f32, the weights cast back to the logits' dtype.
        let logits = c.round(linear_t(x, &router)?)?;
        let mut routed = ops::softmax_route_in(&logits, self.top_k, c, probe.wants_scores())?;
        let own = routed.take_own();
        let rank = &routed.rank;
        let used = probe.route(i, off, rank, RouteScores::new(rank), own);
        let mut choice = routed.weights(&used, self.norm_topk_prob)?;
        for (_, wgt) in choice.iter_mut().flatten() {
            *wgt = c.round_f32(*wgt);
        }
        let y = if experts::grouped(&self.w) {
            let module = |e: usize| format!("{p}.experts.{e}");
            let shape = (d, self.moe_inter);
            c.round(experts::dispatch(
                &self.w,
                module,
                Some(self.experts),
                x,
                &choice,
                shape,
                c,
                self.acts,
                true,
            )?)?
        } else {
            ops::moe_dispatch_in(x, &choice, c, |e, rows| {
                self.mlp(&format!("{p}.experts.{e}"), rows, self.moe_inter)
            })?
        };
        probe.push_block(i, off, x, &y);
        Ok(y)
    }
}

impl Architecture for Qwen3Moe {
    fn config(&self) -> &TextConfig {
        &self.cfg
    }

    fn forward(
        &self,
        ids: &[u32],
        cache: &mut Cache,
        probe: &mut Probe<'_>,
    ) -> Result<Tensor, ModelError> {
        cache.check_continuable()?;
        let c = self.compute;
        let t = ids.len();
        let off = cache.len;
        let (h, kv, hd, d) = (
            self.heads,
            self.kv_heads,
            self.head_dim,
            self.cfg.hidden_size,
        );
        let eps = self.cfg.rms_norm_eps;
        let mut x = c.round(self.w.rows("model.embed_tokens.weight", ids)?)?;
        let (cos, sin) = ops::rope_tables(self.cfg.rope_theta, hd, off, t, x.device())?;
        let mask = ops::causal_mask(t, off, x.device())?;
        let scale = 1.0 / (hd as f64).sqrt();
        let mut new_cache = Vec::with_capacity(self.cfg.num_hidden_layers);
        for li in 0..self.cfg.num_hidden_layers {
            let p = format!("model.layers.{li}");
            let ln1 = self.w.tensor(&format!("{p}.input_layernorm.weight"))?;
            let xn = ops::rms_norm_in(&x, &ln1, eps, c)?;
            let heads = |name: &str, n: usize, norm: Option<&str>| -> Result<Tensor, ModelError> {
                let y = self.lin(&format!("{p}.self_attn.{name}"), &xn, n * hd, d)?;
                let y = c.round(y)?.reshape((t, n, hd))?;
                let y = match norm {
                    Some(nn) => {
                        let nw = self.w.tensor(&format!("{p}.self_attn.{nn}.weight"))?;
                        ops::rms_norm_in(&y, &nw, eps, c)?
                    }
                    None => y,
                };
                Ok(y.transpose(0, 1)?.contiguous()?) // [n, t, hd]
            };
            let q = ops::rope_half_in(&heads("q_proj", h, Some("q_norm"))?, &cos, &sin, c)?;
            let k = ops::rope_half_in(&heads("k_proj", kv, Some("k_norm"))?, &cos, &sin, c)?;
            let v = heads("v_proj", kv, None)?;
            let (k, v) = match cache.layers.get(li).map(|l| l.0.as_slice()) {
                Some([pk, pv]) => (Tensor::cat(&[pk, &k], 1)?, Tensor::cat(&[pv, &v], 1)?),
                _ => (k, v),
            };
            let y = match self.attention {
                AttentionKernel::Sdpa => ops::attention_in(&q, &k, &v, scale, mask.as_ref(), c)?,
                AttentionKernel::Eager => {
                    let blk = ops::eager_row_block(h, k.dim(1)?);
                    ops::attention_eager_in(&q, &k, &v, scale, mask.as_ref(), blk, c)?
                }
            };
            if cache.keeps_layers() {
                new_cache.push(LayerCache(vec![k, v]));
            }
            let o = self.lin(&format!("{p}.self_attn.o_proj"), &y, d, h * hd)?;
            x = c.round((x + c.round(o)?)?)?;
            let ln2 = self
                .w
                .tensor(&format!("{p}.post_attention_layernorm.weight"))?;
            let xn = ops::rms_norm_in(&x, &ln2, eps, c)?;
            x = c.round((&x + self.ffn(li, &xn, off, probe)?)?)?;
            probe.push_layer(&x);
        }
        let norm = self.w.tensor("model.norm.weight")?;
        let out = ops::rms_norm_in(&x, &norm, eps, c)?;
        cache.layers = new_cache;
        cache.len = off + t;
        Ok(out)
    }

    fn moe_block(
        &self,
        layer: usize,
        x: &Tensor,
        first: usize,
        probe: &mut Probe<'_>,
    ) -> Result<Option<Tensor>, ModelError> {
        if layer >= self.cfg.num_hidden_layers || !self.is_moe_layer(layer) {
            return Ok(None);
        }
        let x = self.compute.round(x.to_dtype(DType::F32)?)?;
        Ok(Some(self.ffn(layer, &x, first, probe)?))
    }

    fn routing_shape(&self) -> Option<RoutingShape> {
        (self.experts > 0).then_some(RoutingShape {
            layers: self.cfg.num_hidden_layers,
            top_k: self.top_k,
            experts: self.experts,
        })
    }

    fn logits(&self, hidden: &Tensor) -> Result<Tensor, ModelError> {
        let name = if self.cfg.tie_word_embeddings {
            "model.embed_tokens"
        } else {
            "lm_head"
        };
        let (v, d) = (self.cfg.vocab_size, self.cfg.hidden_size);
        let wt = self.w.matrix_t(name, v, d)?;
        Ok(linear_t(&hidden.to_dtype(DType::F32)?, &wt)?)
    }
}
