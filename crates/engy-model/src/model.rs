//! The Qwen3 / Qwen3-MoE forward pass on CPU with candle: checkpoint loading (optionally with
//! the int4 cheat), step-by-step greedy decoding with a KV cache, and a teacher-forced pass.
//!
//! Architecture (as `transformers`' `modeling_qwen3.py` / `modeling_qwen3_moe.py`): token
//! embedding; per layer `x += o_proj(attn(q_norm(q_proj(rms(x))), k_norm(k_proj(rms(x))),
//! v_proj(rms(x))))` with rotate-half RoPE and grouped KV heads, then `x += mlp(rms(x))` where
//! `mlp` is SwiGLU (`down(silu(gate(x)) * up(x))`) or the sparse MoE block (softmax router,
//! top-k experts, weights renormalised when `norm_topk_prob`); final RMSNorm; `lm_head`.
//!
//! Weights are stored in bf16 and computed in f32. The *hidden state* this module returns for a
//! position is the output of the final RMSNorm, i.e. the input of the LM head: the tensor sglang
//! hands to its logits processor for Llama/Qwen models and returns as `hidden_states`
//! (sglang-native-api.md §2.6.1).
use std::path::Path;

use candle_core::{DType, Device, Tensor};
use half::{bf16, f16};
use safetensors::{Dtype, SafeTensors};

use crate::config::Qwen3Config;
use crate::ModelError;

/// How the checkpoint's weights are turned into the weights the forward pass uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Precision {
    /// The stored bf16 weights, exactly (the honest serve and the auditor).
    #[default]
    Bf16,
    /// The cheat: every projection matrix (`*_proj.weight` of attention, dense MLPs and
    /// experts) rounded to symmetric 4-bit integers per group of `group_size` consecutive input
    /// columns (scale = max |w| / 7, levels −8..=7, round to nearest), then dequantised to bf16.
    /// Embeddings, norms, the router and `lm_head` stay bf16, as in common int4 (GPTQ/AWQ-style)
    /// exports.
    Int4 {
        /// Columns per quantisation group (32 or 128 are usual); 0 is treated as 1.
        group_size: usize,
    },
}

impl std::fmt::Display for Precision {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Precision::Bf16 => write!(f, "bf16"),
            Precision::Int4 { group_size } => write!(f, "int4 (group {group_size})"),
        }
    }
}

/// Rounds `w` (row-major, `cols` per row) to symmetric int4 groups in place (see
/// [`Precision::Int4`]).
pub fn quantize_int4(w: &mut [f32], cols: usize, group_size: usize) {
    let g = group_size.max(1);
    let cols = cols.max(1);
    for row in w.chunks_mut(cols) {
        for group in row.chunks_mut(g) {
            let max = group.iter().fold(0f32, |m, x| m.max(x.abs()));
            if max == 0.0 || !max.is_finite() {
                continue;
            }
            let scale = max / 7.0;
            for x in group.iter_mut() {
                let q = (*x / scale).round().clamp(-8.0, 7.0);
                *x = bf16::from_f32(q * scale).to_f32();
            }
        }
    }
}

struct Mlp {
    gate_t: Tensor,
    up_t: Tensor,
    down_t: Tensor,
}

impl Mlp {
    fn forward(&self, x: &Tensor, c: Compute) -> candle_core::Result<Tensor> {
        let g = c.round(candle_nn::ops::silu(&c.round(x.matmul(&self.gate_t)?)?)?)?;
        let u = c.round(x.matmul(&self.up_t)?)?;
        c.round(c.round((g * u)?)?.matmul(&self.down_t)?)
    }
}

enum Ffn {
    Dense(Mlp),
    Moe {
        router_t: Tensor,
        experts: Vec<Mlp>,
        top_k: usize,
        norm_topk_prob: bool,
    },
}

impl Ffn {
    fn forward(&self, x: &Tensor, c: Compute) -> candle_core::Result<Tensor> {
        match self {
            Ffn::Dense(m) => m.forward(x, c),
            Ffn::Moe {
                router_t,
                experts,
                top_k,
                norm_topk_prob,
            } => {
                let probs = candle_nn::ops::softmax_last_dim(&x.matmul(router_t)?)?;
                let probs = probs.to_dtype(DType::F32)?.to_vec2::<f32>()?;
                let n_exp = experts.len();
                let mut gates = vec![0f32; probs.len() * n_exp];
                for (t, p) in probs.iter().enumerate() {
                    let mut order: Vec<usize> = (0..p.len()).collect();
                    // Descending probability; ties by lower expert index (torch.topk order).
                    order.sort_by(|&a, &b| {
                        let (pa, pb) = (p.get(a).copied(), p.get(b).copied());
                        pb.partial_cmp(&pa)
                            .unwrap_or(std::cmp::Ordering::Equal)
                            .then(a.cmp(&b))
                    });
                    let chosen: Vec<usize> = order.into_iter().take(*top_k).collect();
                    let sum: f32 = chosen.iter().filter_map(|&e| p.get(e)).sum();
                    for e in chosen {
                        let w = p.get(e).copied().unwrap_or(0.0);
                        let w = if *norm_topk_prob && sum > 0.0 {
                            w / sum
                        } else {
                            w
                        };
                        if let Some(g) = gates.get_mut(t * n_exp + e) {
                            *g = w;
                        }
                    }
                }
                let gates = Tensor::from_vec(gates, (probs.len(), n_exp), x.device())?
                    .to_dtype(x.dtype())?;
                let mut out = x.zeros_like()?;
                for (e, expert) in experts.iter().enumerate() {
                    let w = gates.narrow(1, e, 1)?;
                    out = (out + expert.forward(x, c)?.broadcast_mul(&w)?)?;
                }
                c.round(out)
            }
        }
    }
}

struct Layer {
    ln1: Tensor,
    ln2: Tensor,
    q_t: Tensor,
    k_t: Tensor,
    v_t: Tensor,
    o_t: Tensor,
    q_norm: Tensor,
    k_norm: Tensor,
    ffn: Ffn,
}

/// The dtype the forward pass computes activations in. Weights are stored in bf16 either way.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Compute {
    /// f32 activations (the auditor, and the default serve): prefill and decode give
    /// bit-identical rows on CPU.
    #[default]
    F32,
    /// bf16 activations (every operation's output rounded to bf16), as a bf16 GPU serve
    /// computes: an honest serve whose numbers differ slightly from the f32 auditor's (the
    /// "different hardware" case of the SN53 experiment).
    Bf16,
}

impl Compute {
    /// Rounds `t` (f32) to the activation dtype: bf16 storage with f32 accumulation inside each
    /// operation, as GPU bf16 kernels do (candle's CPU matmul has no bf16 kernel).
    fn round(self, t: Tensor) -> candle_core::Result<Tensor> {
        match self {
            Compute::F32 => Ok(t),
            Compute::Bf16 => t.to_dtype(DType::BF16)?.to_dtype(DType::F32),
        }
    }
}

/// Per-layer key/value cache of one sequence (`[1, kv_heads, positions, head_dim]` each).
#[derive(Debug, Clone)]
pub struct KvCache {
    layers: Vec<Option<(Tensor, Tensor)>>,
    len: usize,
}

impl KvCache {
    /// Positions already in the cache.
    pub fn len(&self) -> usize {
        self.len
    }
    /// Whether nothing is cached yet.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

/// The loaded model (weights in f32 on the CPU, pre-transposed for `x · Wᵀ`).
pub struct Model {
    cfg: Qwen3Config,
    precision: Precision,
    compute: Compute,
    device: Device,
    embed: Tensor,
    layers: Vec<Layer>,
    norm: Tensor,
    lm_head_t: Tensor,
    cos: Tensor,
    sin: Tensor,
}

impl std::fmt::Debug for Model {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Model")
            .field("model_type", &self.cfg.model_type)
            .field("hidden_size", &self.cfg.hidden_size)
            .field("layers", &self.cfg.num_hidden_layers)
            .field("vocab_size", &self.cfg.vocab_size)
            .field("precision", &self.precision)
            .field("compute", &self.compute)
            .finish()
    }
}

/// The raw tensors of a checkpoint: name → (shape, f32 values).
type RawTensors = std::collections::HashMap<String, (Vec<usize>, Vec<f32>)>;

fn read_shards(dir: &Path) -> Result<RawTensors, ModelError> {
    let io = |path: &Path| {
        let path = path.to_path_buf();
        move |source| ModelError::Io { path, source }
    };
    let mut files: Vec<_> = std::fs::read_dir(dir)
        .map_err(io(dir))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
        .collect();
    files.sort();
    if files.is_empty() {
        return Err(ModelError::Config(format!(
            "no *.safetensors file in {}",
            dir.display()
        )));
    }
    let mut out = RawTensors::new();
    for f in files {
        let bytes = std::fs::read(&f).map_err(io(&f))?;
        let st = SafeTensors::deserialize(&bytes).map_err(|e| ModelError::Safetensors {
            file: f.clone(),
            msg: e.to_string(),
        })?;
        for (name, view) in st.tensors() {
            let data = view.data();
            let vals: Vec<f32> = match view.dtype() {
                Dtype::BF16 => data
                    .chunks_exact(2)
                    .map(|c| bf16::from_le_bytes([c[0], c[1]]).to_f32())
                    .collect(),
                Dtype::F16 => data
                    .chunks_exact(2)
                    .map(|c| f16::from_le_bytes([c[0], c[1]]).to_f32())
                    .collect(),
                Dtype::F32 => data
                    .chunks_exact(4)
                    .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                    .collect(),
                other => {
                    return Err(ModelError::Safetensors {
                        file: f.clone(),
                        msg: format!("tensor {name} has unsupported dtype {other:?}"),
                    })
                }
            };
            out.insert(name, (view.shape().to_vec(), vals));
        }
    }
    Ok(out)
}

impl Model {
    /// Loads `config.json` and every `*.safetensors` shard directly in `dir`, applying
    /// `precision`.
    ///
    /// # Errors
    /// [`ModelError::Io`] / [`ModelError::Safetensors`] for unreadable files,
    /// [`ModelError::Config`] for an invalid config, [`ModelError::MissingTensor`] /
    /// [`ModelError::Shape`] when the shards do not match the config.
    pub fn load(dir: &Path, precision: Precision) -> Result<Self, ModelError> {
        Self::load_with(dir, precision, Compute::F32)
    }

    /// [`Model::load`] with the activations computed in `compute` (see [`Compute`]).
    ///
    /// # Errors
    /// As [`Model::load`].
    pub fn load_with(
        dir: &Path,
        precision: Precision,
        compute: Compute,
    ) -> Result<Self, ModelError> {
        let cfg_path = dir.join("config.json");
        let cfg_bytes = std::fs::read(&cfg_path).map_err(|source| ModelError::Io {
            path: cfg_path.clone(),
            source,
        })?;
        let cfg: Qwen3Config = serde_json::from_slice(&cfg_bytes)
            .map_err(|e| ModelError::Config(format!("{}: {e}", cfg_path.display())))?;
        cfg.validate().map_err(ModelError::Config)?;
        let mut raw = read_shards(dir)?;
        let device = Device::Cpu;
        let mut take =
            |name: &str, shape: &[usize], quantize: bool| -> Result<Tensor, ModelError> {
                let (s, mut v) = raw
                    .remove(name)
                    .ok_or_else(|| ModelError::MissingTensor(name.to_string()))?;
                if s != shape {
                    return Err(ModelError::Shape {
                        name: name.to_string(),
                        got: s,
                        want: shape.to_vec(),
                    });
                }
                if let (true, Precision::Int4 { group_size }) = (quantize, precision) {
                    quantize_int4(&mut v, shape.last().copied().unwrap_or(1), group_size);
                }
                Ok(Tensor::from_vec(v, shape, &device)?)
            };
        let (d, h, kv, hd, v) = (
            cfg.hidden_size,
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_dim,
            cfg.vocab_size,
        );
        let tr = |t: Tensor| -> Result<Tensor, ModelError> { Ok(t.t()?.contiguous()?) };
        let embed = take("model.embed_tokens.weight", &[v, d], false)?;
        let mut layers = Vec::with_capacity(cfg.num_hidden_layers);
        for i in 0..cfg.num_hidden_layers {
            let p = format!("model.layers.{i}");
            let mut mlp = |q: &str, inter: usize| -> Result<Mlp, ModelError> {
                Ok(Mlp {
                    gate_t: tr(take(&format!("{q}.gate_proj.weight"), &[inter, d], true)?)?,
                    up_t: tr(take(&format!("{q}.up_proj.weight"), &[inter, d], true)?)?,
                    down_t: tr(take(&format!("{q}.down_proj.weight"), &[d, inter], true)?)?,
                })
            };
            let ffn = if cfg.is_moe_layer(i) {
                let mut experts = Vec::with_capacity(cfg.num_experts);
                for e in 0..cfg.num_experts {
                    experts.push(mlp(
                        &format!("{p}.mlp.experts.{e}"),
                        cfg.moe_intermediate_size,
                    )?);
                }
                Ffn::Moe {
                    router_t: tr(take(
                        &format!("{p}.mlp.gate.weight"),
                        &[cfg.num_experts, d],
                        false,
                    )?)?,
                    experts,
                    top_k: cfg.num_experts_per_tok,
                    norm_topk_prob: cfg.norm_topk_prob,
                }
            } else {
                Ffn::Dense(mlp(&format!("{p}.mlp"), cfg.intermediate_size)?)
            };
            layers.push(Layer {
                ln1: take(&format!("{p}.input_layernorm.weight"), &[d], false)?,
                ln2: take(&format!("{p}.post_attention_layernorm.weight"), &[d], false)?,
                q_t: tr(take(
                    &format!("{p}.self_attn.q_proj.weight"),
                    &[h * hd, d],
                    true,
                )?)?,
                k_t: tr(take(
                    &format!("{p}.self_attn.k_proj.weight"),
                    &[kv * hd, d],
                    true,
                )?)?,
                v_t: tr(take(
                    &format!("{p}.self_attn.v_proj.weight"),
                    &[kv * hd, d],
                    true,
                )?)?,
                o_t: tr(take(
                    &format!("{p}.self_attn.o_proj.weight"),
                    &[d, h * hd],
                    true,
                )?)?,
                q_norm: take(&format!("{p}.self_attn.q_norm.weight"), &[hd], false)?,
                k_norm: take(&format!("{p}.self_attn.k_norm.weight"), &[hd], false)?,
                ffn,
            });
        }
        let norm = take("model.norm.weight", &[d], false)?;
        let lm_head = if cfg.tie_word_embeddings {
            embed.clone()
        } else {
            take("lm_head.weight", &[v, d], false)?
        };
        let lm_head_t = tr(lm_head)?;
        // RoPE tables: inv_freq[i] = theta^(-2i/hd), angle = pos * inv_freq (HF default rope).
        let half = hd / 2;
        let max = cfg.max_position_embeddings;
        let mut cos = Vec::with_capacity(max * half);
        let mut sin = Vec::with_capacity(max * half);
        for pos in 0..max {
            for i in 0..half {
                let inv = 1.0 / cfg.rope_theta.powf(2.0 * i as f64 / hd as f64);
                let a = pos as f64 * inv;
                cos.push(a.cos() as f32);
                sin.push(a.sin() as f32);
            }
        }
        let cos = Tensor::from_vec(cos, (max, half), &device)?;
        let sin = Tensor::from_vec(sin, (max, half), &device)?;
        Ok(Self {
            cfg,
            precision,
            compute,
            device,
            embed,
            layers,
            norm,
            lm_head_t,
            cos,
            sin,
        })
    }

    /// The checkpoint's `config.json`.
    pub fn config(&self) -> &Qwen3Config {
        &self.cfg
    }

    /// The precision the weights were loaded with.
    pub fn precision(&self) -> Precision {
        self.precision
    }

    /// The activation dtype.
    pub fn compute(&self) -> Compute {
        self.compute
    }

    /// An empty KV cache for one sequence.
    pub fn new_cache(&self) -> KvCache {
        KvCache {
            layers: vec![None; self.layers.len()],
            len: 0,
        }
    }

    /// Checks that `ids` may be appended to a sequence of `cached` positions.
    fn check_ids(&self, ids: &[u32], cached: usize) -> Result<(), ModelError> {
        if ids.is_empty() {
            return Err(ModelError::EmptyInput);
        }
        if let Some(&id) = ids.iter().find(|&&id| id as usize >= self.cfg.vocab_size) {
            return Err(ModelError::TokenOutOfVocab {
                id,
                vocab: self.cfg.vocab_size,
            });
        }
        let len = cached.saturating_add(ids.len());
        if len > self.cfg.max_position_embeddings {
            return Err(ModelError::TooLong {
                len,
                max: self.cfg.max_position_embeddings,
            });
        }
        Ok(())
    }

    /// Runs `ids` (appended after the `cache.len()` cached positions) through the model and
    /// returns the final hidden states `[ids.len(), hidden_size]` (post final RMSNorm, f32).
    ///
    /// # Errors
    /// [`ModelError::EmptyInput`], [`ModelError::TokenOutOfVocab`], [`ModelError::TooLong`];
    /// the cache is left unchanged on error.
    pub fn forward(&self, ids: &[u32], cache: &mut KvCache) -> Result<Tensor, ModelError> {
        self.check_ids(ids, cache.len)?;
        let out = self.forward_unchecked(ids, cache)?;
        Ok(out)
    }

    fn forward_unchecked(&self, ids: &[u32], cache: &mut KvCache) -> candle_core::Result<Tensor> {
        let t = ids.len();
        let off = cache.len;
        let (h, kv, hd) = (
            self.cfg.num_attention_heads,
            self.cfg.num_key_value_heads,
            self.cfg.head_dim,
        );
        let eps = self.cfg.rms_norm_eps as f32;
        let idx = Tensor::new(ids, &self.device)?;
        let mut x = self.embed.index_select(&idx, 0)?; // [t, d]
        let cos = self.cos.narrow(0, off, t)?;
        let sin = self.sin.narrow(0, off, t)?;
        let total = off + t;
        let mask = if t > 1 {
            let m: Vec<f32> = (0..t)
                .flat_map(|i| {
                    (0..total).map(move |j| if j > off + i { f32::NEG_INFINITY } else { 0.0 })
                })
                .collect();
            Some(Tensor::from_vec(m, (t, total), &self.device)?)
        } else {
            None
        };
        let scale = 1.0 / (hd as f64).sqrt();
        let mut new_cache = Vec::with_capacity(self.layers.len());
        for (li, layer) in self.layers.iter().enumerate() {
            let c = self.compute;
            let xn = c.round(candle_nn::ops::rms_norm(&x, &layer.ln1, eps)?)?;
            let heads = |w: &Tensor,
                         n: usize,
                         norm: Option<&Tensor>|
             -> candle_core::Result<Tensor> {
                let y = c.round(xn.matmul(w)?)?.reshape((t, n, hd))?;
                let y = match norm {
                    Some(nw) => c.round(candle_nn::ops::rms_norm(&y.contiguous()?, nw, eps)?)?,
                    None => y,
                };
                y.transpose(0, 1)?.contiguous()?.unsqueeze(0) // [1, n, t, hd]
            };
            let q = heads(&layer.q_t, h, Some(&layer.q_norm))?;
            let k = heads(&layer.k_t, kv, Some(&layer.k_norm))?;
            let v = heads(&layer.v_t, kv, None)?;
            let q = c.round(candle_nn::rotary_emb::rope(&q, &cos, &sin)?)?;
            let k = c.round(candle_nn::rotary_emb::rope(&k, &cos, &sin)?)?;
            let (k, v) = match cache.layers.get(li).and_then(|c| c.as_ref()) {
                Some((pk, pv)) => (Tensor::cat(&[pk, &k], 2)?, Tensor::cat(&[pv, &v], 2)?),
                None => (k, v),
            };
            new_cache.push((k.clone(), v.clone()));
            let rep = h / kv;
            let expand = |z: &Tensor| -> candle_core::Result<Tensor> {
                if rep == 1 {
                    return Ok(z.clone());
                }
                z.unsqueeze(2)?
                    .expand((1, kv, rep, total, hd))?
                    .reshape((1, h, total, hd))
            };
            let (k, v) = (expand(&k)?, expand(&v)?);
            let mut att = (q.matmul(&k.t()?.contiguous()?)? * scale)?; // [1, h, t, total]
            if let Some(m) = &mask {
                att = att.broadcast_add(m)?;
            }
            let att = candle_nn::ops::softmax_last_dim(&att)?;
            let y = c.round(att.matmul(&v)?)?; // [1, h, t, hd]
            let y = y
                .squeeze(0)?
                .transpose(0, 1)?
                .contiguous()?
                .reshape((t, h * hd))?;
            x = c.round((x + c.round(y.matmul(&layer.o_t)?)?)?)?;
            let xn = c.round(candle_nn::ops::rms_norm(&x, &layer.ln2, eps)?)?;
            x = c.round((&x + layer.ffn.forward(&xn, c)?)?)?;
        }
        for (slot, kvs) in cache.layers.iter_mut().zip(new_cache) {
            *slot = Some(kvs);
        }
        cache.len = total;
        self.compute
            .round(candle_nn::ops::rms_norm(&x, &self.norm, eps)?)
    }

    /// Logits `[rows, vocab]` of final hidden states `[rows, hidden]`.
    ///
    /// # Errors
    /// A candle error when `hidden` has the wrong width.
    pub fn logits(&self, hidden: &Tensor) -> Result<Tensor, ModelError> {
        Ok(hidden.matmul(&self.lm_head_t)?)
    }

    /// Teacher-forced: the final hidden state of every position of `ids`, computed in ONE pass
    /// without a cache (`ids.len()` rows of `hidden_size` f32).
    ///
    /// # Errors
    /// As [`Model::forward`].
    pub fn hidden_states(&self, ids: &[u32]) -> Result<Vec<Vec<f32>>, ModelError> {
        let mut cache = self.new_cache();
        let h = self.forward(ids, &mut cache)?;
        Ok(h.to_vec2::<f32>()?)
    }

    /// Starts greedy decoding of `prompt_ids` (see [`Decoder`]).
    ///
    /// # Errors
    /// [`ModelError::EmptyInput`], [`ModelError::TokenOutOfVocab`], [`ModelError::TooLong`].
    pub fn decoder(&self, prompt_ids: &[u32]) -> Result<Decoder<&Model>, ModelError> {
        Decoder::new(self, prompt_ids)
    }

    /// Greedy decoding of up to `max_new` tokens, stopping after a token in `stop` (which is
    /// kept, like sglang's output ids). Returns every step.
    ///
    /// # Errors
    /// As [`Model::decoder`] and [`Decoder::step`].
    pub fn generate(
        &self,
        prompt_ids: &[u32],
        max_new: usize,
        stop: &[u32],
    ) -> Result<Vec<Step>, ModelError> {
        let mut dec = self.decoder(prompt_ids)?;
        let mut steps = Vec::new();
        while steps.len() < max_new && !dec.is_full() {
            let s = dec.step()?;
            let done = stop.contains(&s.token_id);
            steps.push(s);
            if done {
                break;
            }
        }
        Ok(steps)
    }
}

/// One greedy decoding step.
#[derive(Debug, Clone)]
pub struct Step {
    /// The sampled (argmax) token.
    pub token_id: u32,
    /// Its log-probability under the model (natural log).
    pub logprob: f32,
    /// The final hidden states computed by this step's forward pass: every prompt position for
    /// the first step (its last row sampled `token_id`), one row afterwards (f32, not rounded).
    pub hidden: Vec<Vec<f32>>,
}

/// Step-by-step greedy decoding with a KV cache: each step feeds the tokens not yet seen (the
/// prompt at first, then the last sampled token) and samples the argmax of the last row.
///
/// `M` is how the decoder holds the model: `&Model` ([`Model::decoder`]) or an owning pointer
/// such as `Arc<Model>` for a session that outlives the caller's borrow.
pub struct Decoder<M: std::ops::Deref<Target = Model>> {
    model: M,
    cache: KvCache,
    pending: Vec<u32>,
}

impl<M: std::ops::Deref<Target = Model>> Decoder<M> {
    /// Starts greedy decoding of `prompt_ids` on `model`.
    ///
    /// # Errors
    /// [`ModelError::EmptyInput`], [`ModelError::TokenOutOfVocab`], [`ModelError::TooLong`].
    pub fn new(model: M, prompt_ids: &[u32]) -> Result<Self, ModelError> {
        model.check_ids(prompt_ids, 0)?;
        let cache = model.new_cache();
        Ok(Self {
            model,
            cache,
            pending: prompt_ids.to_vec(),
        })
    }

    /// Whether the sequence reached `max_position_embeddings` (no further step is possible).
    pub fn is_full(&self) -> bool {
        self.cache.len + self.pending.len() > self.model.cfg.max_position_embeddings
    }

    /// Positions processed so far.
    pub fn positions(&self) -> usize {
        self.cache.len
    }

    /// Runs one forward pass and samples the next token greedily (ties: lowest id).
    ///
    /// # Errors
    /// [`ModelError::TooLong`] once the context is full; candle errors.
    pub fn step(&mut self) -> Result<Step, ModelError> {
        let hidden = self.model.forward(&self.pending, &mut self.cache)?;
        let rows = hidden.dim(0)?;
        let last = hidden.narrow(0, rows.saturating_sub(1), 1)?;
        let logits = self.model.logits(&last)?.squeeze(0)?;
        let lv = logits.to_vec1::<f32>()?;
        let (mut best, mut best_v) = (0usize, f32::NEG_INFINITY);
        for (i, &x) in lv.iter().enumerate() {
            if x > best_v {
                best = i;
                best_v = x;
            }
        }
        let lse = {
            let m = best_v;
            m + lv.iter().map(|x| (x - m).exp()).sum::<f32>().ln()
        };
        let token_id = best as u32;
        self.pending = vec![token_id];
        Ok(Step {
            token_id,
            logprob: best_v - lse,
            hidden: hidden.to_dtype(DType::F32)?.to_vec2::<f32>()?,
        })
    }
}

/// Rounds f32 values to the nearest bf16 (ties to even), returned as f32: what a bf16 serve
/// would emit in `hidden_states` (sglang-native-api.md §2.6.2).
pub fn round_to_bf16(row: &[f32]) -> Vec<f32> {
    row.iter().map(|x| bf16::from_f32(*x).to_f32()).collect()
}
