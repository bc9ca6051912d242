//! Qwen3.5 / Qwen3.6-MoE text model (`qwen3_5_moe`, `qwen3_5_moe_text`; Qwen3.6-35B-A3B), as
//! transformers' `models/qwen3_5_moe/modeling_qwen3_5_moe.py` (5.x) computes it.
//!
//! Per decoder layer `l` (pre-norm, residual stream `x` `[T, H]`):
//! * `h = rms1p(x, input_layernorm)`, where every decoder norm is zero-centred:
//!   `rms1p(x, w) = x * rsqrt(mean(x²) + eps) * (1 + w)` (`Qwen3_5MoeRMSNorm`).
//! * `layer_types[l] == "linear_attention"`: a **Gated DeltaNet**
//!   (`Qwen3_5MoeGatedDeltaNet`): `qkv = silu(causal_depthwise_conv(in_proj_qkv h))` (kernel
//!   `linear_conv_kernel_dim`, left zero padding, no bias), split `[q | k | v]` (`key_dim`,
//!   `key_dim`, `value_dim`); `q`, `k` L2-normalised per head (`x * rsqrt(Σx² + 1e-6)`), `q`
//!   scaled by `linear_key_head_dim^-0.5`; value head `i` reads key head `i / (nv / nk)`
//!   (repeat_interleave); `β = sigmoid(in_proj_b h)`, `g = -exp(A_log) * softplus(in_proj_a h +
//!   dt_bias)`; per value head the state `S` `[d_k, d_v]` (zero at position 0) runs the gated
//!   delta rule `S ← S·e^{g_t}; S ← S + k_t ((v_t − Sᵀk_t) β_t)ᵀ; o_t = Sᵀ q_t`. transformers
//!   prefills with the chunked form (chunk 64) and decodes with this recurrent one; they are
//!   the same arithmetic up to summation order, and the recurrent form is what runs here (it is
//!   O(T·d_k·d_v) per head, negligible beside the projections, and it is the decode cache).
//!   Output: `out_proj(rms(o) * norm.weight * silu(in_proj_z h))` per value head (the gated
//!   norm's weight multiplies directly, eps `rms_norm_eps`).
//! * `"full_attention"`: **gated GQA attention** (`Qwen3_5MoeAttention`): `q_proj` gives per
//!   head `[q (head_dim) | gate (head_dim)]`; `q_norm`/`k_norm` (zero-centred, per head);
//!   rotate-half RoPE on the first `head_dim * partial_rotary_factor` features (mrope sections
//!   coincide for text positions); eager softmax, scale `head_dim^-0.5`; output
//!   `o_proj(attn * sigmoid(gate))`.
//! * `x += mixer`, then `x += moe(rms1p(x, post_attention_layernorm))`: softmax router (f32),
//!   top `num_experts_per_tok`, weights renormalised to sum 1 (always, in this model), SwiGLU
//!   experts, plus `sigmoid(shared_expert_gate h) * shared_expert(h)` (SwiGLU of width
//!   `shared_expert_intermediate_size`).
//!
//! Final `rms1p(x, model.norm)`. Tensors: the text-only layout (`model.…`); the conditional
//! generation layout (`model.language_model.…`) is mapped by [`Weights`], and `model.visual.*`
//! and `mtp.*` are never read. Routed experts are stored per expert
//! (`mlp.experts.{e}.{gate,up,down}_proj.weight`).
//!
//! With [`Compute::Bf16`] every module's output is rounded to bf16 where transformers' bf16
//! model rounds it (an honest bf16 serve, recomputed): `Qwen3_5MoeRMSNorm` computes in f32 and
//! rounds once; each projection's output is rounded (weights not stored as bf16 are the bf16
//! rounding of their dequantised value, [`Weights::linear_in`]); the causal conv accumulates in
//! f32 and rounds, then SiLU rounds; `β = sigmoid(b)` is rounded while `g` stays f32; the delta
//! rule runs in f32 and its output is rounded; the gated norm rounds the normalised row, its
//! product with the weight, and the product with the f32 `silu(z)`; RoPE uses bf16 `cos`/`sin`
//! and rounds each product and the sum; attention is a fused kernel's
//! ([`ops::attention_in`]); the router's logits are bf16 (a bf16 `nn.Linear`), softmax and
//! renormalisation f32, the weights rounded to bf16; routed experts as `grouped_mm`
//! ([`ops::moe_dispatch_in`]); the shared expert gate's logit and sigmoid are rounded; every
//! residual add is rounded.
//!
//! Cache per layer: DeltaNet `[conv_state [K-1, conv_dim], state [nv, d_k, d_v]]`; attention
//! `[k, v]` (`[kv_heads, positions, head_dim]`).
use std::sync::Arc;

use candle_core::{DType, Device, Tensor};

use super::delta_rule;
use super::experts;
use super::ops::{self, linear_t};
use super::{
    Architecture, AttentionKernel, Cache, Fp8Activations, LayerCache, LoadOptions, Probe,
    RouteScores, RoutingShape, SeqPass, TextConfig, Weights,
};
use crate::device::phase;
use crate::{Compute, ModelError};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mixer {
    DeltaNet,
    Attention,
}

/// The loaded Qwen3.5-MoE text model.
pub struct Qwen3_5Moe {
    cfg: TextConfig,
    w: Arc<Weights>,
    compute: Compute,
    /// How products with block-FP8 weights treat their input rows (W8A16 or W8A8).
    acts: Fp8Activations,
    attention: AttentionKernel,
    mixers: Vec<Mixer>,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    rot_dim: usize,
    nk: usize,
    nv: usize,
    dk: usize,
    dv: usize,
    conv_k: usize,
    experts: usize,
    top_k: usize,
    moe_inter: usize,
    shared_inter: usize,
}

impl Qwen3_5Moe {
    /// Reads the Qwen3.5-MoE fields of `cfg` and checks every tensor the forward pass uses.
    /// The activations are computed in `opts.compute` (see the module documentation).
    ///
    /// # Errors
    /// [`ModelError::Config`] for missing or inconsistent settings (`layer_types`, head
    /// counts, a RoPE type other than `default`), [`ModelError::MissingTensor`] /
    /// [`ModelError::Shape`] when the checkpoint does not match.
    pub fn load(cfg: TextConfig, w: Arc<Weights>, opts: &LoadOptions) -> Result<Self, ModelError> {
        let n = cfg.num_hidden_layers;
        let heads = cfg.usize_req("num_attention_heads")?;
        let kv_heads = cfg.usize_or("num_key_value_heads", heads)?;
        let head_dim = cfg.usize_or("head_dim", cfg.hidden_size / heads)?;
        let rot_dim = (head_dim as f64 * cfg.partial_rotary_factor) as usize;
        let types = match cfg.str_list("layer_types") {
            Some(t) => t,
            None => {
                // transformers' default: every `full_attention_interval`-th layer is full attention.
                let every = cfg.usize_or("full_attention_interval", 4)?.max(1);
                (0..n)
                    .map(|i| {
                        if (i + 1) % every == 0 {
                            "full_attention"
                        } else {
                            "linear_attention"
                        }
                        .to_string()
                    })
                    .collect()
            }
        };
        if types.len() != n {
            return Err(ModelError::Config(format!(
                "layer_types has {} entries for {n} layers",
                types.len()
            )));
        }
        let mixers = types
            .iter()
            .map(|t| match t.as_str() {
                "linear_attention" => Ok(Mixer::DeltaNet),
                "full_attention" => Ok(Mixer::Attention),
                other => Err(ModelError::Config(format!("unknown layer type {other:?}"))),
            })
            .collect::<Result<Vec<_>, _>>()?;
        let m = Self {
            mixers,
            heads,
            kv_heads,
            head_dim,
            rot_dim,
            nk: cfg.usize_req("linear_num_key_heads")?,
            nv: cfg.usize_req("linear_num_value_heads")?,
            dk: cfg.usize_req("linear_key_head_dim")?,
            dv: cfg.usize_req("linear_value_head_dim")?,
            conv_k: cfg.usize_req("linear_conv_kernel_dim")?,
            experts: cfg.usize_req("num_experts")?,
            top_k: cfg.usize_req("num_experts_per_tok")?,
            moe_inter: cfg.usize_req("moe_intermediate_size")?,
            shared_inter: cfg.usize_or("shared_expert_intermediate_size", 0)?,
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
                rot_dim > 0 && rot_dim.is_multiple_of(2) && rot_dim <= head_dim,
                "head_dim * partial_rotary_factor must be even and within head_dim",
            ),
            (
                m.nv.is_multiple_of(m.nk),
                "linear_num_value_heads must be a multiple of linear_num_key_heads",
            ),
            (
                m.top_k <= m.experts,
                "num_experts_per_tok must be <= num_experts",
            ),
            (
                m.cfg.rope_type == "default",
                "only rope_type \"default\" is supported",
            ),
            (
                m.cfg.str_field("hidden_act").unwrap_or("silu") == "silu",
                "hidden_act must be \"silu\"",
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

    fn conv_dim(&self) -> usize {
        2 * self.nk * self.dk + self.nv * self.dv
    }

    fn check_tensors(&self) -> Result<(), ModelError> {
        let (d, v) = (self.cfg.hidden_size, self.cfg.vocab_size);
        let w = &*self.w;
        let streaming = !w.preloads();
        let need = |name: String, shape: &[usize], proj: bool| -> Result<(), ModelError> {
            if streaming {
                // Plain tensors from the header now; projections (maybe quantised) on use.
                return match (proj, w.has(&name)) {
                    (false, _) => w.check_stored(&name, shape),
                    (true, true) => Ok(()),
                    (true, false) => Err(ModelError::MissingTensor(w.resolve(&name))),
                };
            }
            match (proj, shape) {
                (true, &[o, i]) => w
                    .projection_t(name.trim_end_matches(".weight"), o, i)
                    .map(drop),
                _ => w.tensor_shaped(&name, shape).map(drop),
            }
        };
        need("model.embed_tokens.weight".into(), &[v, d], false)?;
        need("model.norm.weight".into(), &[d], false)?;
        if !self.cfg.tie_word_embeddings {
            need("lm_head.weight".into(), &[v, d], false)?;
        }
        let (h, kv, hd) = (self.heads, self.kv_heads, self.head_dim);
        for (i, mixer) in self.mixers.iter().enumerate() {
            let p = format!("model.layers.{i}");
            need(format!("{p}.input_layernorm.weight"), &[d], false)?;
            need(format!("{p}.post_attention_layernorm.weight"), &[d], false)?;
            match mixer {
                Mixer::DeltaNet => {
                    let a = format!("{p}.linear_attn");
                    need(
                        format!("{a}.in_proj_qkv.weight"),
                        &[self.conv_dim(), d],
                        true,
                    )?;
                    need(
                        format!("{a}.in_proj_z.weight"),
                        &[self.nv * self.dv, d],
                        true,
                    )?;
                    need(format!("{a}.in_proj_a.weight"), &[self.nv, d], false)?;
                    need(format!("{a}.in_proj_b.weight"), &[self.nv, d], false)?;
                    need(
                        format!("{a}.conv1d.weight"),
                        &[self.conv_dim(), 1, self.conv_k],
                        false,
                    )?;
                    need(format!("{a}.A_log"), &[self.nv], false)?;
                    need(format!("{a}.dt_bias"), &[self.nv], false)?;
                    need(format!("{a}.norm.weight"), &[self.dv], false)?;
                    need(
                        format!("{a}.out_proj.weight"),
                        &[d, self.nv * self.dv],
                        true,
                    )?;
                }
                Mixer::Attention => {
                    let a = format!("{p}.self_attn");
                    need(format!("{a}.q_proj.weight"), &[h * hd * 2, d], true)?;
                    need(format!("{a}.k_proj.weight"), &[kv * hd, d], true)?;
                    need(format!("{a}.v_proj.weight"), &[kv * hd, d], true)?;
                    need(format!("{a}.o_proj.weight"), &[d, h * hd], true)?;
                    need(format!("{a}.q_norm.weight"), &[hd], false)?;
                    need(format!("{a}.k_norm.weight"), &[hd], false)?;
                }
            }
            let m = format!("{p}.mlp");
            need(format!("{m}.gate.weight"), &[self.experts, d], false)?;
            for e in 0..self.experts {
                let x = format!("{m}.experts.{e}");
                need(format!("{x}.gate_proj.weight"), &[self.moe_inter, d], true)?;
                need(format!("{x}.up_proj.weight"), &[self.moe_inter, d], true)?;
                need(format!("{x}.down_proj.weight"), &[d, self.moe_inter], true)?;
            }
            if self.shared_inter > 0 {
                let x = format!("{m}.shared_expert");
                need(
                    format!("{x}.gate_proj.weight"),
                    &[self.shared_inter, d],
                    true,
                )?;
                need(format!("{x}.up_proj.weight"), &[self.shared_inter, d], true)?;
                need(
                    format!("{x}.down_proj.weight"),
                    &[d, self.shared_inter],
                    true,
                )?;
                need(format!("{m}.shared_expert_gate.weight"), &[1, d], false)?;
            }
        }
        Ok(())
    }

    /// One Gated DeltaNet layer on `h` `[T, H]`; `prev` is the layer's cache (empty at 0):
    /// token by token on the host, in the chunked form ([`delta_rule::chunked`]) on a GPU.
    fn delta_net(
        &self,
        p: &str,
        h: &Tensor,
        prev: &[Tensor],
    ) -> Result<(Tensor, LayerCache), ModelError> {
        if h.device().is_cpu() {
            self.delta_net_host(p, h, prev)
        } else {
            self.delta_net_tensors(p, h, prev)
        }
    }

    /// A Gated DeltaNet layer's input projections of `h` `[T, H]` (module prefix `a`), each
    /// rounded to the activation dtype: `in_proj_qkv` `[T, conv_dim]`, `in_proj_z`
    /// `[T, nv·dv]`, `in_proj_b` and `in_proj_a` `[T, nv]`. Shared by both paths.
    fn delta_net_inputs(&self, a: &str, h: &Tensor) -> Result<[Tensor; 4], ModelError> {
        let d = h.dim(1)?;
        let (nv, dv, cd) = (self.nv, self.dv, self.conv_dim());
        let (w, cm) = (&*self.w, self.compute);
        let small = |name: &str| -> Result<Tensor, ModelError> {
            let wt = w.matrix_t(&format!("{a}.{name}"), nv, d)?;
            Ok(cm.round(linear_t(h, &wt)?)?)
        };
        Ok([
            cm.round(w.linear_as(&format!("{a}.in_proj_qkv"), h, cd, d, cm, self.acts)?)?,
            cm.round(w.linear_as(&format!("{a}.in_proj_z"), h, nv * dv, d, cm, self.acts)?)?,
            small("in_proj_b")?,
            small("in_proj_a")?,
        ])
    }

    /// [`Self::delta_net`] as tensor operations on `h`'s device: the same rounding points as
    /// the host path, the rule in its chunked form.
    fn delta_net_tensors(
        &self,
        p: &str,
        h: &Tensor,
        prev: &[Tensor],
    ) -> Result<(Tensor, LayerCache), ModelError> {
        let (t, d) = h.dims2()?;
        let dev = h.device();
        let a = format!("{p}.linear_attn");
        let (nk, nv, dk, dv, kk) = (self.nk, self.nv, self.dk, self.dv, self.conv_k);
        let cd = self.conv_dim();
        let w = &*self.w;
        let cm = self.compute;
        let [qkv, z, bb, aa] = phase(dev, "gated deltanet: projections", || {
            self.delta_net_inputs(&a, h)
        })?;
        let conv_w = w
            .tensor(&format!("{a}.conv1d.weight"))?
            .reshape((cd, kk))?
            .t()?
            .contiguous()?; // [K, cd]
        let a_log = w.tensor(&format!("{a}.A_log"))?;
        let dt_bias = w.tensor(&format!("{a}.dt_bias"))?;
        let norm_w = w.tensor(&format!("{a}.norm.weight"))?;

        // Causal depthwise conv, summed over taps in the host path's order, then SiLU.
        let hist = kk.saturating_sub(1);
        let past = match prev.first() {
            Some(s) => s.clone(),
            None => Tensor::zeros((hist, cd), DType::F32, dev)?,
        };
        let input = Tensor::cat(&[&past, &qkv], 0)?; // [hist + t, cd]
        let conv = phase(dev, "gated deltanet: conv", || {
            // On a GPU, one kernel with these rounding points ([`super::deltanet_kernels`]).
            if let Some(conv) = super::deltanet_kernels::causal_conv_silu(&input, &conv_w, cm)? {
                return Ok(conv);
            }
            let mut s = Tensor::zeros((t, cd), DType::F32, dev)?;
            for j in 0..kk {
                s = (s + input
                    .narrow(0, j, t)?
                    .broadcast_mul(&conv_w.narrow(0, j, 1)?)?)?;
            }
            let s = cm.round(s)?;
            Ok(cm.round(ops::silu(&s)?)?)
        })?;
        // Its own copy: a narrow of `input`'s rows (its last `hist`) is contiguous already, and
        // `contiguous` would keep all of `input` (`[hist + t, cd]`, 134 MB at Qwen3.6's
        // width and 4,096 tokens) alive in the cache.
        let conv_state = input.narrow(0, t, hist)?.force_contiguous()?;

        let state = match prev.get(1) {
            Some(s) => s.clone(),
            None => Tensor::zeros((nv, dk, dv), DType::F32, dev)?,
        };
        let [q, k, v, beta, g] = phase(dev, "gated deltanet: rule inputs", || {
            // On a GPU, two kernels with this arithmetic ([`super::deltanet_kernels`]).
            let gates = [&bb, &aa, &dt_bias, &a_log];
            let heads = (nk, nv, dk, dv);
            if let Some(x) = super::deltanet_kernels::rule_inputs(&conv, gates, heads, cm)? {
                return Ok(x);
            }
            let l2 = |x: Tensor| -> candle_core::Result<Tensor> {
                x.broadcast_div(&(x.sqr()?.sum_keepdim(2)? + 1e-6)?.sqrt()?)
            };
            let heads = |x: Tensor| -> candle_core::Result<Tensor> {
                // [t, nk, dk] → [t, nv, dk], value head hv reading key head hv / (nv / nk).
                x.unsqueeze(2)?
                    .broadcast_as((t, nk, nv / nk, dk))?
                    .reshape((t, nv, dk))
            };
            let q = l2(conv.narrow(1, 0, nk * dk)?.reshape((t, nk, dk))?)?;
            let q = heads((q * (1.0 / (dk as f64).sqrt()))?)?;
            let k = heads(l2(conv
                .narrow(1, nk * dk, nk * dk)?
                .reshape((t, nk, dk))?)?)?;
            let v = conv.narrow(1, 2 * nk * dk, nv * dv)?.reshape((t, nv, dv))?;
            let beta = cm.round(ops::sigmoid(&bb)?)?; // [t, nv]
            let sp = aa.broadcast_add(&dt_bias)?;
            let softplus = sp.gt(20.0)?.where_cond(&sp, &(sp.exp()? + 1.0)?.log()?)?;
            let g = softplus.broadcast_mul(&a_log.exp()?.neg()?)?; // [t, nv]
            let tr = |x: Tensor| x.transpose(0, 1)?.contiguous();
            Ok([tr(q)?, tr(k)?, tr(v)?, tr(beta)?, tr(g)?])
        })?;
        let (o, state) = phase(dev, "gated deltanet: chunked rule", || {
            delta_rule::chunked(&q, &k, &v, &beta, &g, &state)
        })?;
        // Gated RMSNorm per head on the rounded output (see the host path); on a GPU, one
        // kernel with these rounding points ([`super::deltanet_kernels`]).
        let eps = self.cfg.rms_norm_eps;
        let core = phase(dev, "gated deltanet: gated norm", || {
            if let Some(core) = super::deltanet_kernels::gated_rms_norm(&o, &z, &norm_w, eps, cm)? {
                return Ok(core);
            }
            let o = cm.round(o.transpose(0, 1)?.contiguous()?)?; // [t, nv, dv]
            let r = (o.sqr()?.mean_keepdim(2)? + eps)?.sqrt()?.recip()?;
            let normed = cm.round(o.broadcast_mul(&r)?)?;
            let weighted = cm.round(normed.broadcast_mul(&norm_w)?)?;
            let z = z.reshape((t, nv, dv))?;
            Ok(cm
                .round((weighted * ops::silu(&z)?)?)?
                .reshape((t, nv * dv))?)
        })?;
        let y = phase(dev, "gated deltanet: projections", || {
            Ok(cm.round(w.linear_as(
                &format!("{a}.out_proj"),
                &core,
                d,
                nv * dv,
                cm,
                self.acts,
            )?)?)
        })?;
        Ok((y, LayerCache(vec![conv_state, state])))
    }

    /// [`Self::delta_net`] token by token on the host.
    fn delta_net_host(
        &self,
        p: &str,
        h: &Tensor,
        prev: &[Tensor],
    ) -> Result<(Tensor, LayerCache), ModelError> {
        let (t, d) = h.dims2()?;
        let a = format!("{p}.linear_attn");
        let (nk, nv, dk, dv, kk) = (self.nk, self.nv, self.dk, self.dv, self.conv_k);
        let cd = self.conv_dim();
        let w = &*self.w;
        let cm = self.compute;
        let rb = |v: f32| cm.round_f32(v);
        let [qkv, z, bb, aa] = self.delta_net_inputs(&a, h)?.map(|x| x.to_vec2::<f32>());
        let (qkv, z, bb, aa) = (qkv?, z?, bb?, aa?);
        let conv_w = w
            .tensor(&format!("{a}.conv1d.weight"))?
            .flatten_all()?
            .to_vec1::<f32>()?; // [cd, K]
        let a_log = w.tensor(&format!("{a}.A_log"))?.to_vec1::<f32>()?;
        let dt_bias = w.tensor(&format!("{a}.dt_bias"))?.to_vec1::<f32>()?;
        let norm_w = w.tensor(&format!("{a}.norm.weight"))?.to_vec1::<f32>()?;

        // Causal depthwise conv over [previous K-1 inputs | this call's inputs] (f32
        // accumulation, output in the activation dtype), then SiLU.
        let hist = kk.saturating_sub(1);
        let mut input: Vec<f32> = match prev.first() {
            Some(s) => s.flatten_all()?.to_vec1::<f32>()?,
            None => vec![0.0; hist * cd],
        };
        for row in &qkv {
            input.extend_from_slice(row);
        }
        let mut conv = vec![0f32; t * cd];
        for ti in 0..t {
            for c in 0..cd {
                let mut s = 0f32;
                for j in 0..kk {
                    s += conv_w[c * kk + j] * input[(ti + j) * cd + c];
                }
                let s = rb(s);
                conv[ti * cd + c] = rb(s / (1.0 + (-s).exp()));
            }
        }
        let conv_state = input[t * cd..].to_vec();

        let mut state: Vec<f32> = match prev.get(1) {
            Some(s) => s.flatten_all()?.to_vec1::<f32>()?,
            None => vec![0.0; nv * dk * dv],
        };
        let rep = nv / nk;
        let qscale = 1.0 / (dk as f32).sqrt();
        let l2 = |v: &[f32]| -> Vec<f32> {
            let ss: f32 = v.iter().map(|x| x * x).sum();
            let inv = 1.0 / (ss + 1e-6).sqrt();
            v.iter().map(|x| x * inv).collect()
        };
        let eps = self.cfg.rms_norm_eps as f32;
        let mut out = vec![0f32; t * nv * dv];
        let mut kv_mem = vec![0f32; dv];
        for ti in 0..t {
            let row = &conv[ti * cd..(ti + 1) * cd];
            let (qa, rest) = row.split_at(nk * dk);
            let (ka, va) = rest.split_at(nk * dk);
            let qn: Vec<Vec<f32>> = (0..nk)
                .map(|hk| {
                    l2(&qa[hk * dk..(hk + 1) * dk])
                        .into_iter()
                        .map(|x| x * qscale)
                        .collect()
                })
                .collect();
            let kn: Vec<Vec<f32>> = (0..nk).map(|hk| l2(&ka[hk * dk..(hk + 1) * dk])).collect();
            for hv in 0..nv {
                let (q, k) = (&qn[hv / rep], &kn[hv / rep]);
                let v = &va[hv * dv..(hv + 1) * dv];
                let beta = rb(1.0 / (1.0 + (-bb[ti][hv]).exp()));
                let g = -a_log[hv].exp() * softplus(aa[ti][hv] + dt_bias[hv]);
                let decay = g.exp();
                let s = &mut state[hv * dk * dv..(hv + 1) * dk * dv];
                for x in s.iter_mut() {
                    *x *= decay;
                }
                kv_mem.iter_mut().for_each(|m| *m = 0.0);
                for (i, &ki) in k.iter().enumerate() {
                    for (m, &sv) in kv_mem.iter_mut().zip(&s[i * dv..(i + 1) * dv]) {
                        *m += sv * ki;
                    }
                }
                for (m, &vj) in kv_mem.iter_mut().zip(v) {
                    *m = (vj - *m) * beta; // delta
                }
                for (i, &ki) in k.iter().enumerate() {
                    for (sv, &dj) in s[i * dv..(i + 1) * dv].iter_mut().zip(&kv_mem) {
                        *sv += ki * dj;
                    }
                }
                let o = &mut out[(ti * nv + hv) * dv..(ti * nv + hv + 1) * dv];
                for (i, &qi) in q.iter().enumerate() {
                    for (oj, &sv) in o.iter_mut().zip(&s[i * dv..(i + 1) * dv]) {
                        *oj += sv * qi;
                    }
                }
                // Gated RMSNorm of this head on the rule's rounded output: rms(o) * w * silu(z)
                // (`Qwen3_5MoeRMSNormGated`: the normalised row and its product with the weight
                // in the activation dtype, the product with the f32 `silu(z)` rounded once).
                o.iter_mut().for_each(|x| *x = rb(*x));
                let var = o.iter().map(|x| x * x).sum::<f32>() / dv as f32;
                let r = 1.0 / (var + eps).sqrt();
                let zr = &z[ti][hv * dv..(hv + 1) * dv];
                for ((oj, &wj), &zj) in o.iter_mut().zip(&norm_w).zip(zr) {
                    *oj = rb(rb(wj * rb(*oj * r)) * (zj / (1.0 + (-zj).exp())));
                }
            }
        }
        let core = Tensor::from_vec(out, (t, nv * dv), &Device::Cpu)?;
        let y =
            cm.round(w.linear_as(&format!("{a}.out_proj"), &core, d, nv * dv, cm, self.acts)?)?;
        let cache = LayerCache(vec![
            Tensor::from_vec(conv_state, (hist, cd), &Device::Cpu)?,
            Tensor::from_vec(state, (nv, dk, dv), &Device::Cpu)?,
        ]);
        Ok((y, cache))
    }

    /// One gated full-attention layer on `h` `[T, H]` at positions `off ..`.
    fn attention(
        &self,
        p: &str,
        h: &Tensor,
        off: usize,
        prev: &[Tensor],
    ) -> Result<(Tensor, LayerCache), ModelError> {
        let (t, d) = h.dims2()?;
        let a = format!("{p}.self_attn");
        let (nh, kv, hd) = (self.heads, self.kv_heads, self.head_dim);
        let w = &*self.w;
        let cm = self.compute;
        let eps = self.cfg.rms_norm_eps;
        let proj = |name: &str, out: usize| -> Result<Tensor, ModelError> {
            Ok(cm.round(w.linear_as(&format!("{a}.{name}"), h, out, d, cm, self.acts)?)?)
        };
        let qg = proj("q_proj", nh * hd * 2)?.reshape((t, nh, 2 * hd))?;
        let q = qg.narrow(2, 0, hd)?;
        let gate = qg.narrow(2, hd, hd)?.contiguous()?.reshape((t, nh * hd))?;
        let q = ops::rms_norm_1p_in(&q, &w.tensor(&format!("{a}.q_norm.weight"))?, eps, cm)?;
        let k = proj("k_proj", kv * hd)?.reshape((t, kv, hd))?;
        let k = ops::rms_norm_1p_in(&k, &w.tensor(&format!("{a}.k_norm.weight"))?, eps, cm)?;
        let v = proj("v_proj", kv * hd)?.reshape((t, kv, hd))?;
        let (cos, sin) = ops::rope_tables(self.cfg.rope_theta, self.rot_dim, off, t, h.device())?;
        let q = ops::rope_half_in(&q.transpose(0, 1)?.contiguous()?, &cos, &sin, cm)?;
        let k = ops::rope_half_in(&k.transpose(0, 1)?.contiguous()?, &cos, &sin, cm)?;
        let v = v.transpose(0, 1)?.contiguous()?;
        let (k, v) = match prev {
            [pk, pv] => (Tensor::cat(&[pk, &k], 1)?, Tensor::cat(&[pv, &v], 1)?),
            _ => (k, v),
        };
        let mask = ops::causal_mask(t, off, h.device())?;
        let y = phase(h.device(), "attention: scores to output", || {
            let scale = 1.0 / (hd as f64).sqrt();
            Ok(match self.attention {
                AttentionKernel::Sdpa => ops::attention_in(&q, &k, &v, scale, mask.as_ref(), cm)?,
                AttentionKernel::Eager => {
                    let blk = ops::eager_row_block(nh, k.dim(1)?);
                    ops::attention_eager_in(&q, &k, &v, scale, mask.as_ref(), blk, cm)?
                }
            })
        })?;
        let y = cm.round((y * cm.round(ops::sigmoid(&gate)?)?)?)?;
        let y = cm.round(w.linear_as(&format!("{a}.o_proj"), &y, d, nh * hd, cm, self.acts)?)?;
        Ok((y, LayerCache(vec![k, v])))
    }

    /// The MoE block of layer `li` (tensor prefix `p`) on `h` `[t, hidden]` at positions
    /// `off..`; the routing goes through `probe` ([`Probe::route`]).
    fn moe(
        &self,
        li: usize,
        p: &str,
        h: &Tensor,
        off: usize,
        probe: &mut Probe<'_>,
    ) -> Result<Tensor, ModelError> {
        let d = self.cfg.hidden_size;
        let m = format!("{p}.mlp");
        let w = &*self.w;
        let cm = self.compute;
        let router = w.matrix_t(&format!("{m}.gate"), self.experts, d)?;
        // Qwen3.5-MoE always renormalises the chosen weights (no `norm_topk_prob` switch). The
        // logits are in the activation dtype, softmax and renormalisation in f32, the weights
        // then cast to the logits' dtype (`Qwen3_5MoeTopKRouter`); ties between bf16 logits
        // are broken as torch's `topk` breaks them.
        let logits = phase(h.device(), "moe: router logits", || {
            Ok(cm.round(linear_t(h, &router)?)?)
        })?;
        let full = probe.wants_scores();
        let started = phase(h.device(), "moe: routing", || {
            Ok(ops::softmax_route_start(&logits, self.top_k, cm, full)?)
        })?;
        // The shared expert does not depend on the routing: queued before the host waits for
        // the router's top-k, the device computes it while the host routes.
        let shared = if self.shared_inter > 0 {
            Some(phase(h.device(), "moe: shared expert", || {
                let shared = ops::swiglu_as(
                    w,
                    &format!("{m}.shared_expert"),
                    h,
                    (d, self.shared_inter),
                    cm,
                    self.acts,
                )?;
                let g = cm.round(ops::sigmoid(&cm.round(linear_t(
                    h,
                    &w.matrix_t(&format!("{m}.shared_expert_gate"), 1, d)?,
                )?)?)?)?;
                Ok(cm.round(shared.broadcast_mul(&g)?)?)
            })?)
        } else {
            None
        };
        let mut routed = phase(h.device(), "moe: routing: wait", || Ok(started.finish()?))?;
        let choice = phase(h.device(), "moe: routing on the host", || {
            let own = routed.take_own();
            let rank = &routed.rank;
            let used = probe.route(li, off, rank, RouteScores::new(rank), own);
            let mut choice = routed.weights(&used, true)?;
            for (_, wgt) in choice.iter_mut().flatten() {
                *wgt = cm.round_f32(*wgt);
            }
            Ok(choice)
        })?;
        if crate::device::tracing() {
            let ids: Vec<u32> = choice.iter().flatten().map(|&(e, _)| e as u32).collect();
            if let Ok(ids) = Tensor::new(ids, &candle_core::Device::Cpu) {
                crate::device::trace("qwen routing", &ids);
            }
        }
        let mut out = phase(h.device(), "moe: routed experts", || {
            if experts::grouped(w) {
                let module = |e: usize| format!("{m}.experts.{e}");
                let shape = (d, self.moe_inter);
                Ok(cm.round(experts::dispatch(
                    w,
                    module,
                    Some(self.experts),
                    h,
                    &choice,
                    shape,
                    cm,
                    self.acts,
                    true,
                )?)?)
            } else {
                ops::moe_dispatch_in(h, &choice, cm, |e, rows| {
                    let module = format!("{m}.experts.{e}");
                    ops::swiglu_as(w, &module, rows, (d, self.moe_inter), cm, self.acts)
                })
            }
        })?;
        if let Some(shared) = shared {
            probe.push_shared(&shared);
            out = cm.round((out + shared)?)?;
        }
        probe.push_block(li, off, h, &out);
        Ok(out)
    }
}

/// One sequence's state between decoder layers of a pass ([`Qwen3_5Moe::layer`]).
struct PassState {
    /// The residual stream `[T, hidden]`.
    x: Tensor,
    /// The norm of `x` the next step reads (after the last layer: the final norm's output).
    h: Tensor,
    /// The sequence's first position.
    off: usize,
    /// The layers' caches made so far, in layer order.
    new_cache: Vec<LayerCache>,
}

impl Qwen3_5Moe {
    /// The embedding of `ids` at positions `cache.len..` and the first layer's input norm;
    /// a cache that cannot be continued is refused ([`Cache::check_continuable`]).
    fn begin(&self, ids: &[u32], cache: &Cache) -> Result<PassState, ModelError> {
        cache.check_continuable()?;
        let off = cache.len;
        let cm = self.compute;
        let x = cm.round(self.w.rows("model.embed_tokens.weight", ids)?)?;
        let first = match self.mixers.len() {
            0 => "model.norm.weight",
            _ => "model.layers.0.input_layernorm.weight",
        };
        let dev = x.device().clone();
        let h = phase(&dev, "norms and residual adds", || {
            Ok(ops::rms_norm_1p_in(
                &x,
                &self.w.tensor(first)?,
                self.cfg.rms_norm_eps,
                cm,
            )?)
        })?;
        Ok(PassState {
            x,
            h,
            off,
            new_cache: Vec::with_capacity(self.mixers.len()),
        })
    }

    /// Starts reading the routed experts a pass about to run layer `li` needs next (all of
    /// layers 0 and 1 before the first, then layer `li + 1`).
    fn prefetch_experts(&self, li: usize) {
        let layers = self.mixers.len();
        let first = if li == 0 { 0 } else { li + 1 };
        for l in first..=(li + 1).min(layers.saturating_sub(1)) {
            experts::prefetch(
                &self.w,
                |e| format!("model.layers.{l}.mlp.experts.{e}"),
                self.experts,
                self.compute,
                self.acts,
            );
        }
    }

    /// Decoder layer `li` on `st`: the mixer (with `cache`'s layer `li` as its past), the
    /// residual add with the post-attention norm, the MoE block, the residual add with the
    /// next norm. Each residual add and the norm after it run as one step
    /// ([`ops::add_rms_norm_1p_in`]).
    fn layer(
        &self,
        li: usize,
        st: &mut PassState,
        cache: &Cache,
        probe: &mut Probe<'_>,
    ) -> Result<(), ModelError> {
        let eps = self.cfg.rms_norm_eps;
        let cm = self.compute;
        let dev = st.x.device().clone();
        let add_norm = |x: &Tensor, y: &Tensor, name: &str| {
            phase(&dev, "norms and residual adds", || {
                Ok(ops::add_rms_norm_1p_in(
                    x,
                    y,
                    &self.w.tensor(name)?,
                    eps,
                    cm,
                )?)
            })
        };
        let p = format!("model.layers.{li}");
        let prev = cache.layers.get(li).map(|l| l.0.as_slice()).unwrap_or(&[]);
        let (y, lc) = match self.mixers.get(li) {
            Some(Mixer::DeltaNet) => {
                phase(&dev, "gated deltanet", || self.delta_net(&p, &st.h, prev))?
            }
            Some(Mixer::Attention) => phase(&dev, "attention", || {
                self.attention(&p, &st.h, st.off, prev)
            })?,
            None => return Err(ModelError::Config(format!("no decoder layer {li}"))),
        };
        if cache.keeps_layers() {
            st.new_cache.push(lc);
        }
        crate::device::trace("qwen mixer output", &y);
        let post = format!("{p}.post_attention_layernorm.weight");
        (st.x, st.h) = add_norm(&st.x, &y, &post)?;
        let y = phase(&dev, "moe", || self.moe(li, &p, &st.h, st.off, probe))?;
        crate::device::trace("qwen moe output", &y);
        let next = if li + 1 < self.mixers.len() {
            format!("model.layers.{}.input_layernorm.weight", li + 1)
        } else {
            "model.norm.weight".to_string()
        };
        (st.x, st.h) = add_norm(&st.x, &y, &next)?;
        probe.push_layer(&st.x);
        Ok(())
    }

    /// The final hidden states of a pass over `n` ids; `cache` takes the layers' caches.
    fn finish(st: PassState, n: usize, cache: &mut Cache) -> Tensor {
        // After the last layer `h` is the final norm's output.
        cache.layers = st.new_cache;
        cache.len = st.off + n;
        st.h
    }
}

/// torch's `softplus` (beta 1, threshold 20).
fn softplus(x: f32) -> f32 {
    if x > 20.0 {
        x
    } else {
        x.exp().ln_1p()
    }
}

impl Architecture for Qwen3_5Moe {
    fn config(&self) -> &TextConfig {
        &self.cfg
    }

    fn forward(
        &self,
        ids: &[u32],
        cache: &mut Cache,
        probe: &mut Probe<'_>,
    ) -> Result<Tensor, ModelError> {
        let mut st = self.begin(ids, cache)?;
        for li in 0..self.mixers.len() {
            // The next layer's routed experts are read while this one computes (on a GPU,
            // when every expert is stacked: `experts::dispatch`).
            if ids.len() * self.top_k >= self.experts || self.w.keeps_stacks(self.compute) {
                self.prefetch_experts(li);
            }
            self.layer(li, &mut st, cache, probe)?;
        }
        Ok(Self::finish(st, ids.len(), cache))
    }

    fn forward_many(&self, seqs: &mut [SeqPass<'_, '_>]) -> Result<Vec<Tensor>, ModelError> {
        // Layer by layer for every sequence, each layer's weights read and decoded once
        // (`Weights::hold`), released before the next layer's are read.
        let _held = self.w.held();
        let mut states = seqs
            .iter()
            .map(|s| self.begin(s.ids, s.cache))
            .collect::<Result<Vec<_>, _>>()?;
        let most = seqs.iter().map(|s| s.ids.len()).max().unwrap_or(0);
        for li in 0..self.mixers.len() {
            if most * self.top_k >= self.experts || self.w.keeps_stacks(self.compute) {
                self.prefetch_experts(li);
            }
            for (st, s) in states.iter_mut().zip(seqs.iter_mut()) {
                self.layer(li, st, s.cache, s.probe)?;
            }
            self.w.release_held();
        }
        Ok(states
            .into_iter()
            .zip(seqs.iter_mut())
            .map(|(st, s)| Self::finish(st, s.ids.len(), s.cache))
            .collect())
    }

    fn moe_block(
        &self,
        layer: usize,
        x: &Tensor,
        first: usize,
        probe: &mut Probe<'_>,
    ) -> Result<Option<Tensor>, ModelError> {
        if layer >= self.mixers.len() {
            return Ok(None);
        }
        let x = self.compute.round(x.to_dtype(DType::F32)?)?;
        let p = format!("model.layers.{layer}");
        Ok(Some(self.moe(layer, &p, &x, first, probe)?))
    }

    fn routing_shape(&self) -> Option<RoutingShape> {
        Some(RoutingShape {
            layers: self.mixers.len(),
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::arch::{open, LoadOptions};

    /// The Gated DeltaNet layer a GPU runs (tensor operations, chunked rule) is the host
    /// path's layer, here both on the CPU backend on the oracle checkpoint, in f32 and in
    /// bf16, with a cache carried from a first call into a second one.
    #[test]
    fn the_tensor_delta_net_is_the_host_delta_net() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../tests/vectors/arch/qwen3_5_moe");
        for compute in [Compute::F32, Compute::Bf16] {
            let opts = LoadOptions {
                compute,
                ..LoadOptions::default()
            };
            let (cfg, w) = open(&dir, &opts).unwrap();
            let d = cfg.hidden_size;
            let m = Qwen3_5Moe::load(cfg, w, &opts).unwrap();
            let li = m
                .mixers
                .iter()
                .position(|x| matches!(x, Mixer::DeltaNet))
                .unwrap();
            let p = format!("model.layers.{li}");
            let h: Vec<f32> = (0..70 * d)
                .map(|i| ((i * 37 % 101) as f32 - 50.0) / 40.0)
                .collect();
            let h = compute
                .round(Tensor::from_vec(h, (70, d), &Device::Cpu).unwrap())
                .unwrap();
            let (a, b) = (h.narrow(0, 0, 66).unwrap(), h.narrow(0, 66, 4).unwrap());
            let (y_host, c_host) = m.delta_net_host(&p, &a, &[]).unwrap();
            let (y_dev, c_dev) = m.delta_net_tensors(&p, &a, &[]).unwrap();
            // The kept conv state is its own `[conv_k - 1, conv_dim]`, not a view that
            // keeps the layer's whole conv input alive.
            let conv_state = &c_dev.0[0];
            let (storage, _) = conv_state.storage_and_layout();
            let held = match &*storage {
                candle_core::Storage::Cpu(candle_core::CpuStorage::F32(v)) => v.len(),
                _ => panic!("an f32 host tensor"),
            };
            assert_eq!(
                held,
                conv_state.elem_count(),
                "{compute:?}: conv state is a view"
            );
            drop(storage);
            let (y2_host, _) = m.delta_net_host(&p, &b, &c_host.0).unwrap();
            let (y2_dev, _) = m.delta_net_tensors(&p, &b, &c_dev.0).unwrap();
            for (got, want) in [(&y_dev, &y_host), (&y2_dev, &y2_host)] {
                let scale = want
                    .abs()
                    .unwrap()
                    .max_all()
                    .unwrap()
                    .to_scalar::<f32>()
                    .unwrap();
                let err = (got - want)
                    .unwrap()
                    .abs()
                    .unwrap()
                    .max_all()
                    .unwrap()
                    .to_scalar::<f32>()
                    .unwrap();
                // bf16: a value one rounding apart is 2^-8 relative.
                let tol = match compute {
                    Compute::F32 => 1e-4 * scale,
                    Compute::Bf16 => 2e-2 * scale,
                };
                assert!(err <= tol, "{compute:?}: off by {err} (scale {scale})");
            }
        }
    }
}
