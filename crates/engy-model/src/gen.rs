//! `gen_model`: writes the devnet checkpoint (bf16 safetensors shards, `config.json`,
//! `tokenizer.json`, `tokenizer_config.json`, `generation_config.json`) deterministically from a
//! seed.
//!
//! # How the weights are made (and why text is not degenerate)
//! A randomly initialised transformer decoded greedily falls into a one-token loop or emits
//! end-of-turn at once. The generator therefore gives the model a cheap *bigram prior*, counted
//! over the assistant turns of the generated corpus ([`crate::corpus`]):
//!
//! * the tokens seen there get mutually orthogonal embeddings (Gram–Schmidt), so the LM head can
//!   read the current token from the residual stream without crosstalk;
//! * the LM head is an associative memory: `lm_head[v] = Σ_t s(t, v) · ê_t` with
//!   `s(t, v) = bigram_gain · (1 + successor_prob_weight · P(v | t))` for every observed
//!   successor `v` of `t` (0 otherwise; the `<|im_end|>` column times `eos_gain`), plus small
//!   noise.
//!
//! The logits thus favour every grammatical successor about equally, and the random attention
//! and MLP layers, which see the whole context, choose among them: greedy text is corpus-like
//! and varies with the context instead of settling into one cycle (short loops still happen, as
//! with real greedy decoding; turns end with `<|im_end|>` where the corpus allows it, rarely).
//!
//! All projection matrices (attention, MLP, experts, router) are Gaussian with std
//! `1/sqrt(fan_in)` (times `residual_gain` for the residual-writing `o_proj` and `down_proj`),
//! with a small fraction of heavy-tailed entries (`outlier_frac`, scaled by `outlier_scale`), as
//! trained LLM weights have; the residual-writing rows of the first `massive_dims` channels are
//! scaled by `massive_gain` ("massive activations"; token embeddings and the LM head do not use
//! those channels). The outliers make naive round-to-nearest int4 lossy, as on real
//! checkpoints, and the massive channels carry the top-k values TOPLOC commits to, so the int4
//! cheat ([`crate::Precision::Int4`]) moves the proven values well past `toploc_v` while an
//! honest bf16-activation serve stays far below it.
use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use half::bf16;
use safetensors::tensor::TensorView;
use safetensors::Dtype;
use tokenizers::models::bpe::{BpeTrainerBuilder, BPE};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::{
    AddedToken, DecoderWrapper, NormalizerWrapper, PostProcessorWrapper, PreTokenizerWrapper,
    Tokenizer, TokenizerBuilder,
};

use crate::config::Qwen3Config;
use crate::corpus;
use crate::rng::SplitMix64;
use crate::ModelError;

/// `<|endoftext|>`: document separator and padding.
pub const ENDOFTEXT: &str = "<|endoftext|>";
/// `<|im_start|>`: ChatML start of a turn.
pub const IM_START: &str = "<|im_start|>";
/// `<|im_end|>`: ChatML end of a turn (the model's EOS).
pub const IM_END: &str = "<|im_end|>";

/// The ChatML chat template written to `tokenizer_config.json` (Qwen2.5-style without the default
/// system prompt and without tools). Renders every message as
/// `<|im_start|>{role}\n{content}<|im_end|>\n` and, with `add_generation_prompt`, appends
/// `<|im_start|>assistant\n`. Works in Jinja2 (`transformers`) and minijinja.
pub const CHAT_TEMPLATE: &str = "{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}";

/// Shape of the sparse MoE blocks (Qwen3-MoE).
#[derive(Debug, Clone, PartialEq)]
pub struct MoeGen {
    /// Routed experts per MoE layer.
    pub num_experts: usize,
    /// Experts per token.
    pub num_experts_per_tok: usize,
    /// Width of one expert.
    pub moe_intermediate_size: usize,
    /// Every `decoder_sparse_step`-th layer is sparse (HF rule `(i + 1) % step == 0`).
    pub decoder_sparse_step: usize,
}

/// Which architecture [`gen_model`] writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum GenArch {
    /// Qwen3(-MoE) (`qwen3_moe`, or `qwen3` without [`GenConfig::moe`]): the devnet model.
    #[default]
    Qwen3Moe,
    /// Qwen3.5/3.6-MoE text model (`qwen3_5_moe_text`, the Qwen3.6-35B-A3B architecture):
    /// every `full_attention_interval` = 4th layer is gated attention, the others Gated
    /// DeltaNet with `linear_num_key_heads` = `num_key_value_heads`, `linear_num_value_heads` =
    /// `num_attention_heads`, key/value head width `head_dim` and conv kernel 4; every layer
    /// is MoE ([`GenConfig::moe`] required, `decoder_sparse_step` ignored) with a shared expert
    /// of width `moe_intermediate_size` behind a sigmoid gate; partial RoPE factor 0.25;
    /// zero-centred norms.
    Qwen3_5Moe,
}

/// What [`gen_model`] builds. [`GenConfig::default`] is the devnet model: hidden 128, 4 layers,
/// 4 query / 2 KV heads of 32, dense MLP 256, MoE (4 experts, top-2, width 128) on layers 1 and 3,
/// a BPE vocabulary of about 1k tokens, 2 shards: about 1.3 M parameters, 2.6 MB.
#[derive(Debug, Clone, PartialEq)]
pub struct GenConfig {
    /// Model width (≥ 128 keeps one hidden row ≥ TOPLOC's top-k of 128).
    pub hidden_size: usize,
    /// Decoder layers.
    pub num_hidden_layers: usize,
    /// Query heads.
    pub num_attention_heads: usize,
    /// Key/value heads.
    pub num_key_value_heads: usize,
    /// Head width.
    pub head_dim: usize,
    /// Dense MLP width.
    pub intermediate_size: usize,
    /// Sparse MoE blocks, or `None` for a dense model.
    pub moe: Option<MoeGen>,
    /// Target vocabulary size of the BPE trainer (the result can be smaller).
    pub target_vocab_size: usize,
    /// ChatML documents in the corpus.
    pub corpus_docs: usize,
    /// `max_position_embeddings`.
    pub max_position_embeddings: usize,
    /// Scale of `o_proj` / `down_proj` (how much the layers write into the residual stream).
    pub residual_gain: f32,
    /// Fraction of projection entries that are outliers.
    pub outlier_frac: f32,
    /// Multiplier of an outlier entry.
    pub outlier_scale: f32,
    /// Strength of the bigram prior in the LM head.
    pub bigram_gain: f32,
    /// Weight of `P(v | t)` on top of the flat bonus every observed successor gets (small: the
    /// context chooses among grammatical successors, so text varies instead of cycling).
    pub successor_prob_weight: f32,
    /// Multiplier of the `<|im_end|>` column of the bigram prior.
    pub eos_gain: f32,
    /// Hidden channels `0..massive_dims` that the layers write strongly into ("massive
    /// activations", as in trained LLMs) and that token embeddings and the LM head do not use.
    pub massive_dims: usize,
    /// Gain of `o_proj` / `down_proj` rows for those channels.
    pub massive_gain: f32,
    /// Number of safetensors shards (≥ 1).
    pub shards: usize,
    /// The architecture written.
    pub arch: GenArch,
}

impl Default for GenConfig {
    fn default() -> Self {
        Self {
            hidden_size: 256,
            num_hidden_layers: 4,
            num_attention_heads: 4,
            num_key_value_heads: 2,
            head_dim: 64,
            intermediate_size: 512,
            moe: Some(MoeGen {
                num_experts: 4,
                num_experts_per_tok: 2,
                moe_intermediate_size: 256,
                decoder_sparse_step: 2,
            }),
            target_vocab_size: 1024,
            corpus_docs: 600,
            max_position_embeddings: 8192,
            residual_gain: 0.5,
            outlier_frac: 0.01,
            outlier_scale: 8.0,
            bigram_gain: 2.0,
            successor_prob_weight: 0.3,
            eos_gain: 1.08,
            massive_dims: 8,
            massive_gain: 4.0,
            shards: 2,
            arch: GenArch::Qwen3Moe,
        }
    }
}

/// What [`gen_model`] wrote.
#[derive(Debug, Clone)]
pub struct GenReport {
    /// Files written, relative to the output directory, sorted.
    pub files: Vec<String>,
    /// Vocabulary size (tokenizer and model).
    pub vocab_size: usize,
    /// Total parameters.
    pub parameters: usize,
    /// The written `config.json`.
    pub config: serde_json::Value,
}

/// Trains the byte-level BPE tokenizer on the corpus (special tokens get ids 0, 1, 2:
/// `<|endoftext|>`, `<|im_start|>`, `<|im_end|>`).
fn train_tokenizer(docs: &[String], target_vocab: usize) -> Result<Tokenizer, ModelError> {
    let specials = [ENDOFTEXT, IM_START, IM_END];
    let mut trainer = BpeTrainerBuilder::new()
        .vocab_size(target_vocab)
        .min_frequency(2)
        .show_progress(false)
        .special_tokens(
            specials
                .iter()
                .map(|s| AddedToken::from(s.to_string(), true))
                .collect(),
        )
        .initial_alphabet(ByteLevel::alphabet().into_iter().collect())
        .build();
    let mut tk = TokenizerBuilder::<
        BPE,
        NormalizerWrapper,
        PreTokenizerWrapper,
        PostProcessorWrapper,
        DecoderWrapper,
    >::new()
    .with_model(BPE::default())
    .with_normalizer(None)
    .with_pre_tokenizer(Some(ByteLevel::new(false, true, true).into()))
    .with_post_processor(Some(ByteLevel::new(false, false, true).into()))
    .with_decoder(Some(ByteLevel::new(false, true, true).into()))
    .build()
    .map_err(|e| ModelError::Tokenizer(e.to_string()))?;
    // Train on the plain text: the special tokens are not learnt as merges.
    let plain: Vec<String> = docs
        .iter()
        .map(|d| {
            specials
                .iter()
                .fold(d.clone(), |acc, s| acc.replace(s, "\n"))
        })
        .collect();
    tk.train(&mut trainer, plain.iter())
        .map_err(|e| ModelError::Tokenizer(e.to_string()))?;
    Ok(tk.into())
}

/// Samples `rows × cols` entries N(0, std²) with heavy-tailed outliers, for tensor `name`.
fn gaussian(
    seed: u64,
    name: &str,
    n: usize,
    std: f32,
    outlier_frac: f32,
    outlier_scale: f32,
) -> Vec<f32> {
    let mut rng = SplitMix64::for_label(seed, name);
    (0..n)
        .map(|_| {
            let z = rng.normal() as f32 * std;
            if (rng.uniform() as f32) < outlier_frac {
                z * outlier_scale
            } else {
                z
            }
        })
        .collect()
}

/// `1 + spread · N(0, 1)` entries, for norm weights.
fn around_one(seed: u64, name: &str, n: usize, spread: f32) -> Vec<f32> {
    let mut rng = SplitMix64::for_label(seed, name);
    (0..n).map(|_| 1.0 + spread * rng.normal() as f32).collect()
}

struct Tensors {
    /// name → (shape, f32 values), in insertion order per shard.
    list: Vec<(String, Vec<usize>, Vec<f32>)>,
}

impl Tensors {
    fn push(&mut self, name: String, shape: Vec<usize>, data: Vec<f32>) {
        self.list.push((name, shape, data));
    }
}

/// Token bigram probabilities `P(next | current)` over the assistant turns of the corpus
/// (`<|im_start|>assistant\n{answer}<|im_end|>`, encoded with `tok`), as a dense row-major
/// `vocab × vocab` matrix (rows with no successor are zero), and the tokens seen there ordered
/// by frequency (descending, ties by id).
fn bigram_matrix(
    tok: &Tokenizer,
    docs: &[String],
    vocab: usize,
) -> Result<(Vec<f32>, Vec<u32>), ModelError> {
    let mut counts = vec![0f32; vocab * vocab];
    let mut freq = vec![0u64; vocab];
    let marker = format!("{IM_START}assistant\n");
    for d in docs {
        let Some(start) = d.find(&marker) else {
            continue;
        };
        let turn = d.get(start..).unwrap_or("");
        let turn = match turn.find(IM_END) {
            Some(e) => turn.get(..e + IM_END.len()).unwrap_or(turn),
            None => turn,
        };
        let enc = tok
            .encode(turn, false)
            .map_err(|e| ModelError::Tokenizer(e.to_string()))?;
        let ids = enc.get_ids();
        for &a in ids {
            if let Some(f) = freq.get_mut(a as usize) {
                *f += 1;
            }
        }
        for w in ids.windows(2) {
            if let [a, b] = w {
                let (a, b) = (*a as usize, *b as usize);
                if a < vocab && b < vocab {
                    if let Some(c) = counts.get_mut(a * vocab + b) {
                        *c += 1.0;
                    }
                }
            }
        }
    }
    for row in counts.chunks_mut(vocab) {
        let s: f32 = row.iter().sum();
        if s > 0.0 {
            row.iter_mut().for_each(|c| *c /= s);
        }
    }
    let mut used: Vec<u32> = (0..vocab as u32)
        .filter(|&t| freq.get(t as usize).copied().unwrap_or(0) > 0)
        .collect();
    used.sort_by_key(|&t| {
        (
            std::cmp::Reverse(freq.get(t as usize).copied().unwrap_or(0)),
            t,
        )
    });
    Ok((counts, used))
}

/// Embedding matrix `vocab × d`: Gaussian rows of norm `sqrt(d)` that are zero in the
/// `massive` channels; the first `min(d - massive, used.len())` tokens of `used` get mutually
/// orthogonal rows (Gram–Schmidt), so the bigram LM head reads them without crosstalk.
fn embeddings(seed: u64, vocab: usize, d: usize, used: &[u32], massive: usize) -> Vec<f32> {
    let mut embed = gaussian(seed, "model.embed_tokens.weight", vocab * d, 1.0, 0.0, 1.0);
    for row in embed.chunks_mut(d) {
        row.iter_mut().take(massive).for_each(|x| *x = 0.0);
        let n = row.iter().map(|x| x * x).sum::<f32>().sqrt().max(1e-6);
        let scale = (d as f32).sqrt() / n;
        row.iter_mut().for_each(|x| *x *= scale);
    }
    let mut basis: Vec<Vec<f64>> = Vec::new();
    for &t in used.iter().take(d.saturating_sub(massive)) {
        let Some(row) = embed.get_mut(t as usize * d..(t as usize + 1) * d) else {
            continue;
        };
        let mut v: Vec<f64> = row.iter().map(|x| *x as f64).collect();
        for b in &basis {
            let dot: f64 = v.iter().zip(b).map(|(x, y)| x * y).sum();
            v.iter_mut().zip(b).for_each(|(x, y)| *x -= dot * y);
        }
        let n = v.iter().map(|x| x * x).sum::<f64>().sqrt();
        if n < 1e-9 {
            continue;
        }
        v.iter_mut().for_each(|x| *x /= n);
        let scale = (d as f64).sqrt();
        row.iter_mut()
            .zip(&v)
            .for_each(|(r, x)| *r = (x * scale) as f32);
        basis.push(v);
    }
    embed
}

fn write_file(path: &Path, bytes: &[u8]) -> Result<(), ModelError> {
    std::fs::write(path, bytes).map_err(|source| ModelError::Io {
        path: path.to_path_buf(),
        source,
    })
}

fn json_bytes(v: &impl serde::Serialize) -> Result<Vec<u8>, ModelError> {
    let mut b = serde_json::to_vec_pretty(v).map_err(|e| ModelError::Config(e.to_string()))?;
    b.push(b'\n');
    Ok(b)
}

/// Writes the devnet checkpoint for `seed` into `out_dir` (created if missing; existing files of
/// the same names are overwritten). The same `(seed, cfg)` gives byte-identical files.
///
/// # Errors
/// [`ModelError::Io`] when the directory or a file cannot be written, [`ModelError::Tokenizer`]
/// when tokenizer training fails, [`ModelError::Config`] for an inconsistent `cfg`.
pub fn gen_model(out_dir: &Path, seed: u64, cfg: &GenConfig) -> Result<GenReport, ModelError> {
    if cfg.shards == 0 || cfg.num_hidden_layers == 0 {
        return Err(ModelError::Config(
            "shards and num_hidden_layers must be > 0".into(),
        ));
    }
    std::fs::create_dir_all(out_dir).map_err(|source| ModelError::Io {
        path: out_dir.to_path_buf(),
        source,
    })?;
    let docs = corpus::chat_documents(seed, cfg.corpus_docs);
    let tok = train_tokenizer(&docs, cfg.target_vocab_size)?;
    let vocab = tok.get_vocab_size(true);
    let id_of = |s: &str| {
        tok.token_to_id(s)
            .ok_or_else(|| ModelError::Tokenizer(format!("special token {s} missing")))
    };
    let (eot, im_end) = (id_of(ENDOFTEXT)?, id_of(IM_END)?);
    let _ = id_of(IM_START)?;

    let (moe_experts, moe_k, moe_inter, moe_step) = match &cfg.moe {
        Some(m) => (
            m.num_experts,
            m.num_experts_per_tok,
            m.moe_intermediate_size,
            m.decoder_sparse_step,
        ),
        None => (0, 0, 0, 1),
    };
    let config = Qwen3Config {
        architectures: vec![if cfg.moe.is_some() {
            "Qwen3MoeForCausalLM".into()
        } else {
            "Qwen3ForCausalLM".into()
        }],
        attention_bias: false,
        attention_dropout: 0.0,
        bos_token_id: eot,
        eos_token_id: im_end,
        head_dim: cfg.head_dim,
        hidden_act: "silu".into(),
        hidden_size: cfg.hidden_size,
        initializer_range: 0.02,
        intermediate_size: cfg.intermediate_size,
        max_position_embeddings: cfg.max_position_embeddings,
        model_type: if cfg.moe.is_some() {
            "qwen3_moe".into()
        } else {
            "qwen3".into()
        },
        num_attention_heads: cfg.num_attention_heads,
        num_hidden_layers: cfg.num_hidden_layers,
        num_key_value_heads: cfg.num_key_value_heads,
        rms_norm_eps: 1e-6,
        rope_theta: 1_000_000.0,
        tie_word_embeddings: false,
        torch_dtype: "bfloat16".into(),
        transformers_version: "4.51.0".into(),
        use_cache: true,
        use_sliding_window: false,
        vocab_size: vocab,
        num_experts: moe_experts,
        num_experts_per_tok: moe_k,
        moe_intermediate_size: moe_inter,
        decoder_sparse_step: moe_step,
        norm_topk_prob: cfg.moe.is_some(),
        mlp_only_layers: vec![],
    };
    config.validate().map_err(ModelError::Config)?;
    let qwen3_5 = cfg.arch == GenArch::Qwen3_5Moe;
    if qwen3_5 && cfg.moe.is_none() {
        return Err(ModelError::Config(
            "qwen3_5_moe: every layer is MoE, GenConfig::moe is required".into(),
        ));
    }
    let config_json = if qwen3_5 {
        qwen3_5_config(&config)
    } else {
        serde_json::to_value(&config)
            .map_err(|e| ModelError::Config(format!("config.json: {e}")))?
    };

    let d = cfg.hidden_size;
    let (h, kv, hd) = (
        cfg.num_attention_heads,
        cfg.num_key_value_heads,
        cfg.head_dim,
    );
    let (of, os) = (cfg.outlier_frac, cfg.outlier_scale);
    let lin = |name: &str, out: usize, inp: usize, gain: f32| {
        let std = gain / (inp as f32).sqrt();
        (
            name.to_string(),
            vec![out, inp],
            gaussian(seed, name, out * inp, std, of, os),
        )
    };
    // A residual-writing projection (`o_proj`, `down_proj`): rows of the massive channels
    // scaled by `massive_gain`.
    let massive = cfg.massive_dims.min(d / 2);
    let res = |name: &str, inp: usize| {
        let (n, s, mut v) = lin(name, d, inp, cfg.residual_gain);
        for row in v.chunks_mut(inp).take(massive) {
            row.iter_mut().for_each(|x| *x *= cfg.massive_gain);
        }
        (n, s, v)
    };

    // Embeddings (rms 1, like the normalised residual stream) and the bigram LM head.
    let (probs, used) = bigram_matrix(&tok, &docs, vocab)?;
    let embed = embeddings(seed, vocab, d, &used, cfg.massive_dims.min(d / 2));
    let mut lm = gaussian(seed, "lm_head.weight", vocab * d, 0.02, 0.0, 1.0);
    for (t, e_row) in embed.chunks(d).enumerate() {
        let norm = e_row.iter().map(|x| x * x).sum::<f32>().sqrt().max(1e-6);
        let p_row = probs.get(t * vocab..(t + 1) * vocab).unwrap_or(&[]);
        for (v, p) in p_row.iter().enumerate() {
            if *p == 0.0 {
                continue;
            }
            // Every observed successor gets the same bonus, plus its probability: the noise
            // from the layers then chooses among grammatical successors only.
            let g = if v as u32 == im_end {
                cfg.bigram_gain * cfg.eos_gain
            } else {
                cfg.bigram_gain
            };
            let s = g * (1.0 + cfg.successor_prob_weight * p);
            if let Some(w_row) = lm.get_mut(v * d..(v + 1) * d) {
                for (w, e) in w_row.iter_mut().zip(e_row) {
                    *w += s * e / norm;
                }
            }
        }
    }

    let mut all = Tensors { list: Vec::new() };
    all.push("model.embed_tokens.weight".into(), vec![vocab, d], embed);
    for i in 0..cfg.num_hidden_layers {
        let p = format!("model.layers.{i}");
        if qwen3_5 {
            for (n, s, v) in qwen3_5_layer(&config, &p, i, &lin, &res, seed) {
                all.push(n, s, v);
            }
            continue;
        }
        let norm = |n: &str, len: usize, spread: f32| {
            let name = format!("{p}.{n}");
            let data = around_one(seed, &name, len, spread);
            (name, vec![len], data)
        };
        for (n, s, v) in [
            norm("input_layernorm.weight", d, 0.1),
            norm("post_attention_layernorm.weight", d, 0.1),
            norm("self_attn.q_norm.weight", hd, 0.1),
            norm("self_attn.k_norm.weight", hd, 0.1),
            lin(&format!("{p}.self_attn.q_proj.weight"), h * hd, d, 1.0),
            lin(&format!("{p}.self_attn.k_proj.weight"), kv * hd, d, 1.0),
            lin(&format!("{p}.self_attn.v_proj.weight"), kv * hd, d, 1.0),
            res(&format!("{p}.self_attn.o_proj.weight"), h * hd),
        ] {
            all.push(n, s, v);
        }
        let mlp = |q: &str, inter: usize| {
            [
                lin(&format!("{q}.gate_proj.weight"), inter, d, 1.0),
                lin(&format!("{q}.up_proj.weight"), inter, d, 1.0),
                res(&format!("{q}.down_proj.weight"), inter),
            ]
        };
        if config.is_moe_layer(i) {
            let (n, s, v) = lin(&format!("{p}.mlp.gate.weight"), moe_experts, d, 1.0);
            all.push(n, s, v);
            for e in 0..moe_experts {
                for (n, s, v) in mlp(&format!("{p}.mlp.experts.{e}"), moe_inter) {
                    all.push(n, s, v);
                }
            }
        } else {
            for (n, s, v) in mlp(&format!("{p}.mlp"), cfg.intermediate_size) {
                all.push(n, s, v);
            }
        }
    }
    // Qwen3.5's norms are zero-centred (`x̂ · (1 + w)`): the same effective gains.
    let centre = if qwen3_5 { 1.0 } else { 0.0 };
    let final_norm = around_one(seed, "model.norm.weight", d, 0.05)
        .into_iter()
        .map(|x| x - centre)
        .collect();
    all.push("model.norm.weight".into(), vec![d], final_norm);
    all.push("lm_head.weight".into(), vec![vocab, d], lm);

    // Shard by layer: shard s holds the layers with i * shards / L == s; embeddings go with the
    // first shard, the final norm and LM head with the last.
    let n_shards = cfg.shards;
    let shard_of = |name: &str| -> usize {
        if let Some(rest) = name.strip_prefix("model.layers.") {
            let i: usize = rest
                .split('.')
                .next()
                .and_then(|s| s.parse().ok())
                .unwrap_or(0);
            (i * n_shards / cfg.num_hidden_layers).min(n_shards - 1)
        } else if name.starts_with("model.embed_tokens") {
            0
        } else {
            n_shards - 1
        }
    };
    let parameters: usize = all.list.iter().map(|(_, _, v)| v.len()).sum();
    let mut files = Vec::new();
    let mut weight_map = BTreeMap::new();
    let mut total_size = 0usize;
    for s in 0..n_shards {
        let file = format!("model-{:05}-of-{:05}.safetensors", s + 1, n_shards);
        let bytes: Vec<(String, Vec<usize>, Vec<u8>)> = all
            .list
            .iter()
            .filter(|(n, _, _)| shard_of(n) == s)
            .map(|(n, shape, data)| {
                let b: Vec<u8> = data
                    .iter()
                    .flat_map(|x| bf16::from_f32(*x).to_le_bytes())
                    .collect();
                (n.clone(), shape.clone(), b)
            })
            .collect();
        let mut views = Vec::new();
        for (n, shape, b) in &bytes {
            total_size += b.len();
            weight_map.insert(n.clone(), file.clone());
            let v = TensorView::new(Dtype::BF16, shape.clone(), b).map_err(|e| {
                ModelError::Safetensors {
                    file: PathBuf::from(&file),
                    msg: e.to_string(),
                }
            })?;
            views.push((n.clone(), v));
        }
        let meta: HashMap<String, String> = [("format".to_string(), "pt".to_string())].into();
        let buf = safetensors::tensor::serialize(views, Some(meta)).map_err(|e| {
            ModelError::Safetensors {
                file: PathBuf::from(&file),
                msg: e.to_string(),
            }
        })?;
        write_file(&out_dir.join(&file), &buf)?;
        files.push(file);
    }
    let index = serde_json::json!({
        "metadata": {"total_size": total_size},
        "weight_map": weight_map,
    });
    write_file(
        &out_dir.join("model.safetensors.index.json"),
        &json_bytes(&index)?,
    )?;
    files.push("model.safetensors.index.json".into());

    write_file(&out_dir.join("config.json"), &json_bytes(&config_json)?)?;
    files.push("config.json".into());

    let tok_json = tok
        .to_string(true)
        .map_err(|e| ModelError::Tokenizer(e.to_string()))?;
    write_file(&out_dir.join("tokenizer.json"), tok_json.as_bytes())?;
    files.push("tokenizer.json".into());

    let added: BTreeMap<String, serde_json::Value> = [ENDOFTEXT, IM_START, IM_END]
        .iter()
        .filter_map(|s| {
            tok.token_to_id(s).map(|id| {
                (
                    id.to_string(),
                    serde_json::json!({"content": s, "lstrip": false, "normalized": false,
                        "rstrip": false, "single_word": false, "special": true}),
                )
            })
        })
        .collect();
    let tok_cfg = serde_json::json!({
        "add_bos_token": false,
        "add_prefix_space": false,
        "added_tokens_decoder": added,
        "additional_special_tokens": [IM_START, IM_END],
        "bos_token": null,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": false,
        "eos_token": IM_END,
        "errors": "replace",
        "model_max_length": cfg.max_position_embeddings,
        "pad_token": ENDOFTEXT,
        "split_special_tokens": false,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": null,
    });
    write_file(
        &out_dir.join("tokenizer_config.json"),
        &json_bytes(&tok_cfg)?,
    )?;
    files.push("tokenizer_config.json".into());

    let gen_cfg = serde_json::json!({
        "bos_token_id": eot,
        "do_sample": false,
        "eos_token_id": [im_end, eot],
        "pad_token_id": eot,
        "transformers_version": "4.51.0",
    });
    write_file(
        &out_dir.join("generation_config.json"),
        &json_bytes(&gen_cfg)?,
    )?;
    files.push("generation_config.json".into());
    files.sort();
    Ok(GenReport {
        files,
        vocab_size: vocab,
        parameters,
        config: config_json,
    })
}

/// `config.json` of the Qwen3.5-MoE text model with `base`'s sizes (see [`GenArch::Qwen3_5Moe`]).
fn qwen3_5_config(base: &Qwen3Config) -> serde_json::Value {
    let n = base.num_hidden_layers;
    let types: Vec<&str> = (0..n)
        .map(|i| {
            if (i + 1).is_multiple_of(QWEN3_5_FULL_ATTENTION_INTERVAL) {
                "full_attention"
            } else {
                "linear_attention"
            }
        })
        .collect();
    serde_json::json!({
        "architectures": ["Qwen3_5MoeForCausalLM"],
        "model_type": "qwen3_5_moe_text",
        "bos_token_id": base.bos_token_id,
        "eos_token_id": base.eos_token_id,
        "hidden_act": "silu",
        "hidden_size": base.hidden_size,
        "vocab_size": base.vocab_size,
        "num_hidden_layers": n,
        "layer_types": types,
        "full_attention_interval": QWEN3_5_FULL_ATTENTION_INTERVAL,
        "num_attention_heads": base.num_attention_heads,
        "num_key_value_heads": base.num_key_value_heads,
        "head_dim": base.head_dim,
        "partial_rotary_factor": QWEN3_5_PARTIAL_ROTARY,
        "linear_num_key_heads": base.num_key_value_heads,
        "linear_num_value_heads": base.num_attention_heads,
        "linear_key_head_dim": base.head_dim,
        "linear_value_head_dim": base.head_dim,
        "linear_conv_kernel_dim": QWEN3_5_CONV_KERNEL,
        "num_experts": base.num_experts,
        "num_experts_per_tok": base.num_experts_per_tok,
        "moe_intermediate_size": base.moe_intermediate_size,
        "shared_expert_intermediate_size": base.moe_intermediate_size,
        "max_position_embeddings": base.max_position_embeddings,
        "rms_norm_eps": base.rms_norm_eps,
        "rope_theta": base.rope_theta,
        "tie_word_embeddings": false,
        "dtype": "bfloat16",
        "transformers_version": "5.0.0",
        "use_cache": true,
    })
}

const QWEN3_5_FULL_ATTENTION_INTERVAL: usize = 4;
const QWEN3_5_PARTIAL_ROTARY: f64 = 0.25;
const QWEN3_5_CONV_KERNEL: usize = 4;

type Named = (String, Vec<usize>, Vec<f32>);

/// The tensors of Qwen3.5-MoE decoder layer `i` (prefix `p`): `lin` makes a reading projection,
/// `res` a residual-writing one (massive channels, as for Qwen3).
fn qwen3_5_layer(
    c: &Qwen3Config,
    p: &str,
    i: usize,
    lin: &dyn Fn(&str, usize, usize, f32) -> Named,
    res: &dyn Fn(&str, usize) -> Named,
    seed: u64,
) -> Vec<Named> {
    let d = c.hidden_size;
    let (h, kv, hd) = (c.num_attention_heads, c.num_key_value_heads, c.head_dim);
    // Zero-centred norms: stored `w` is the gain minus one.
    let norm = |n: &str, len: usize, spread: f32, centre: f32| {
        let name = format!("{p}.{n}");
        let data = around_one(seed, &name, len, spread)
            .into_iter()
            .map(|x| x - centre)
            .collect();
        (name, vec![len], data)
    };
    let mut t = vec![
        norm("input_layernorm.weight", d, 0.1, 1.0),
        norm("post_attention_layernorm.weight", d, 0.1, 1.0),
    ];
    if (i + 1).is_multiple_of(QWEN3_5_FULL_ATTENTION_INTERVAL) {
        t.extend([
            lin(&format!("{p}.self_attn.q_proj.weight"), 2 * h * hd, d, 1.0),
            lin(&format!("{p}.self_attn.k_proj.weight"), kv * hd, d, 1.0),
            lin(&format!("{p}.self_attn.v_proj.weight"), kv * hd, d, 1.0),
            res(&format!("{p}.self_attn.o_proj.weight"), h * hd),
            norm("self_attn.q_norm.weight", hd, 0.1, 1.0),
            norm("self_attn.k_norm.weight", hd, 0.1, 1.0),
        ]);
    } else {
        let a = format!("{p}.linear_attn");
        // key heads = KV heads, value heads = query heads, all of width head_dim.
        let (nk, nv) = (kv, h);
        let cd = (2 * nk + nv) * hd;
        let k = QWEN3_5_CONV_KERNEL;
        let conv = format!("{a}.conv1d.weight");
        let conv_w = gaussian(seed, &conv, cd * k, 1.0 / (k as f32).sqrt(), 0.0, 1.0);
        // transformers' initialisation: A ~ U(0, 16) (A_log = ln A), dt_bias = 1.
        let a_log = format!("{a}.A_log");
        let mut rng = SplitMix64::for_label(seed, &a_log);
        let a_log_v = (0..nv)
            .map(|_| (1.0 + 15.0 * rng.uniform() as f32).ln())
            .collect();
        t.extend([
            lin(&format!("{a}.in_proj_qkv.weight"), cd, d, 1.0),
            lin(&format!("{a}.in_proj_z.weight"), nv * hd, d, 1.0),
            lin(&format!("{a}.in_proj_a.weight"), nv, d, 1.0),
            lin(&format!("{a}.in_proj_b.weight"), nv, d, 1.0),
            (conv, vec![cd, 1, k], conv_w),
            (a_log, vec![nv], a_log_v),
            (format!("{a}.dt_bias"), vec![nv], vec![1.0; nv]),
            norm("linear_attn.norm.weight", hd, 0.1, 0.0),
            res(&format!("{a}.out_proj.weight"), nv * hd),
        ]);
    }
    let (e, inter) = (c.num_experts, c.moe_intermediate_size);
    let m = format!("{p}.mlp");
    t.push(lin(&format!("{m}.gate.weight"), e, d, 1.0));
    let swiglu = |q: &str| {
        [
            lin(&format!("{q}.gate_proj.weight"), inter, d, 1.0),
            lin(&format!("{q}.up_proj.weight"), inter, d, 1.0),
            res(&format!("{q}.down_proj.weight"), inter),
        ]
    };
    for x in 0..e {
        t.extend(swiglu(&format!("{m}.experts.{x}")));
    }
    t.extend(swiglu(&format!("{m}.shared_expert")));
    t.push(lin(&format!("{m}.shared_expert_gate.weight"), 1, d, 1.0));
    t
}
