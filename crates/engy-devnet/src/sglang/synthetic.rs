//! A deterministic synthetic [`Backend`] and the small checkpoint folder it serves.
//!
//! Token ids and hidden rows are hash-seeded from the context (a rolling SplitMix64 over
//! the token ids), so they satisfy the backend contract exactly: the row at position `p`
//! and the token sampled after it depend only on `ids[..=p]`. Values are bf16-exact with
//! varied exponents (±m·2^e, m an 8-bit mantissa), so TOPLOC top-k selection and exponent
//! checks see realistic spreads. Text comes from a real `tokenizers` tokenizer.
//!
//! [`write_checkpoint`] generates a checkpoint folder the miner can load: a byte-level BPE
//! `tokenizer.json` trained with the `tokenizers` crate on a built-in corpus, a
//! `tokenizer_config.json` with a ChatML `chat_template`, a `config.json` and one small
//! `.safetensors` shard (so `model_root` covers a shard).
use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use tokenizers::models::bpe::{BpeTrainerBuilder, BPE};
use tokenizers::models::TrainerWrapper;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::{AddedToken, Tokenizer};

use super::backend::{
    Backend, BackendError, IndexerShape, ModelFacts, RoutingShape, Session, Step,
};

/// The ChatML template written by [`write_checkpoint`] (Qwen2-style, with a default system
/// prompt only when the first message is not a system message).
pub const CHATML_TEMPLATE: &str = "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

/// Special tokens of the generated tokenizer, in id order (ids 0, 1, 2).
pub const SPECIAL_TOKENS: [&str; 3] = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"];

/// Shape of a generated checkpoint.
#[derive(Debug, Clone)]
pub struct CheckpointSpec {
    /// `hidden_size` written to `config.json` (width of every hidden row).
    pub hidden_size: usize,
    /// Target BPE vocabulary size (special tokens and the 256-symbol byte alphabet
    /// included).
    pub vocab_size: usize,
    /// An MoE model: `config.json` gets `num_hidden_layers`, `num_experts`,
    /// `num_experts_per_tok` and `first_k_dense_replace`, and the backend records routing.
    pub routing: Option<RoutingShape>,
    /// A DSA indexer: `config.json` gets `index_topk` (and `num_hidden_layers` when
    /// `routing` is `None`), and the backend records the indexer's top-k.
    pub indexer: Option<IndexerShape>,
}

impl Default for CheckpointSpec {
    fn default() -> Self {
        Self {
            hidden_size: 64,
            vocab_size: 600,
            routing: None,
            indexer: None,
        }
    }
}

/// Errors writing or loading a checkpoint.
#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    /// File system failure, with the path.
    #[error("{path}: {source}")]
    Io {
        /// The file or folder.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
    /// The tokenizer could not be trained, saved or loaded.
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    /// `config.json` is unreadable or lacks `hidden_size`.
    #[error("config.json: {0}")]
    Config(String),
}

fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> CheckpointError + '_ {
    move |source| CheckpointError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// A small training corpus with ASCII, punctuation, digits and multi-byte text.
fn corpus() -> Vec<String> {
    let base = [
        "The quick brown fox jumps over the lazy dog.",
        "Verified inference: every completion carries a proof of its hidden states.",
        "You are a helpful assistant. Answer briefly and precisely.",
        "What is the capital of France? Paris is the capital of France.",
        "Tell me a story about a miner, a gateway and a validator on a subnet.",
        "Numbers 0 1 2 3 4 5 6 7 8 9 10 42 128 4096 and symbols {} [] () <> = + - * / ! ?",
        "Café, naïve, résumé; Grüße aus München; ¿Qué tal? Ça va.",
        "日本語のテキスト、中文文本，한국어 텍스트.",
        "Emoji test: 🙂 🚀 ✨ — done.",
        "def main():\n    print(\"hello, world\")\n    return 0\n",
        "The sky is blue and the grass is green; the sea is deep and wide.",
    ];
    let mut out = Vec::new();
    for round in 0..8 {
        for (i, s) in base.iter().enumerate() {
            out.push(format!("{s} {round}{i}"));
        }
    }
    out
}

/// Write a checkpoint folder at `dir` (created if missing): `tokenizer.json`,
/// `tokenizer_config.json` (ChatML template, `eos_token` `<|im_end|>`), `config.json`
/// (`hidden_size`, `vocab_size`, `eos_token_id`, `model_type` `engy-synthetic`) and
/// `model.safetensors` (one tiny tensor). Deterministic for a given spec.
///
/// # Errors
/// [`CheckpointError`] on an I/O or tokenizer-training failure.
pub fn write_checkpoint(dir: &Path, spec: &CheckpointSpec) -> Result<(), CheckpointError> {
    std::fs::create_dir_all(dir).map_err(io_err(dir))?;
    let specials: Vec<AddedToken> = SPECIAL_TOKENS
        .iter()
        .map(|t| AddedToken::from(t.to_string(), true))
        .collect();
    let mut trainer = TrainerWrapper::BpeTrainer(
        BpeTrainerBuilder::new()
            .vocab_size(spec.vocab_size)
            .min_frequency(1)
            .show_progress(false)
            .special_tokens(specials.clone())
            .initial_alphabet(ByteLevel::alphabet().into_iter().collect())
            .build(),
    );
    let mut tok = Tokenizer::new(BPE::default());
    tok.with_pre_tokenizer(Some(ByteLevel::new(false, true, true)));
    tok.with_decoder(Some(ByteLevel::new(false, true, true)));
    tok.with_post_processor(Some(ByteLevel::new(false, true, true)));
    tok.train(&mut trainer, corpus().into_iter())
        .map_err(|e| CheckpointError::Tokenizer(e.to_string()))?;
    tok.add_special_tokens(&specials);
    let tok_path = dir.join("tokenizer.json");
    tok.save(&tok_path, true)
        .map_err(|e| CheckpointError::Tokenizer(e.to_string()))?;

    let vocab = tok.get_vocab_size(true);
    let eos = tok.token_to_id("<|im_end|>").unwrap_or(2);
    let tc = serde_json::json!({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": null,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": null,
        "model_max_length": 32768,
        "clean_up_tokenization_spaces": false,
        "add_bos_token": false,
        "chat_template": CHATML_TEMPLATE,
    });
    write_json(&dir.join("tokenizer_config.json"), &tc)?;
    let mut cfg = serde_json::json!({
        "architectures": ["EngySyntheticForCausalLM"],
        "model_type": "engy-synthetic",
        "hidden_size": spec.hidden_size,
        "vocab_size": vocab,
        "eos_token_id": eos,
        "max_position_embeddings": 1 << 20,
        "torch_dtype": "bfloat16",
    });
    if let Some(ix) = spec.indexer {
        cfg["num_hidden_layers"] = ix.layers.into();
        cfg["index_topk"] = ix.index_topk.into();
    }
    if let Some(r) = spec.routing {
        cfg["num_hidden_layers"] = r.num_hidden_layers.into();
        cfg["num_experts"] = r.num_experts.into();
        cfg["num_experts_per_tok"] = r.num_experts_per_tok.into();
        cfg["first_k_dense_replace"] = r.first_k_dense.into();
    }
    write_json(&dir.join("config.json"), &cfg)?;
    // One tiny shard so `model_root` (docs/PROTOCOL.md §4) covers a file name and size.
    let seed = [0u8, 1, 2, 3, 4, 5, 6, 7];
    let view = safetensors::tensor::TensorView::new(safetensors::Dtype::U8, vec![8], &seed)
        .map_err(|e| CheckpointError::Config(e.to_string()))?;
    let bytes = safetensors::serialize([("synthetic.seed", view)], None)
        .map_err(|e| CheckpointError::Config(e.to_string()))?;
    let shard = dir.join("model.safetensors");
    std::fs::write(&shard, bytes).map_err(io_err(&shard))?;
    Ok(())
}

fn write_json(path: &Path, v: &serde_json::Value) -> Result<(), CheckpointError> {
    let s = serde_json::to_string_pretty(v).map_err(|e| CheckpointError::Config(e.to_string()))?;
    std::fs::write(path, s).map_err(io_err(path))
}

/// Knobs of the synthetic model.
#[derive(Debug, Clone)]
pub struct SyntheticConfig {
    /// Mixed into every hash: two seeds give two different "models".
    pub seed: u64,
    /// Chance, per generated token and in thousandths, that the sampled token is the EOS
    /// token (0 = never stop early).
    pub eos_per_mille: u32,
}

impl Default for SyntheticConfig {
    fn default() -> Self {
        Self {
            seed: 0x656e_6779,
            eos_per_mille: 0,
        }
    }
}

/// Deterministic, instant backend for tests (see the module docs).
pub struct SyntheticBackend {
    inner: Arc<Inner>,
    tokenizer: Tokenizer,
}

struct Inner {
    facts: ModelFacts,
    /// Non-special token ids the sampler draws from.
    regular: Vec<u32>,
    cfg: SyntheticConfig,
}

impl SyntheticBackend {
    /// Load the tokenizer and `config.json` (`hidden_size`, `eos_token_id`) of `dir`.
    ///
    /// # Errors
    /// [`CheckpointError`] when a file is missing or malformed.
    pub fn from_checkpoint(dir: &Path, cfg: SyntheticConfig) -> Result<Self, CheckpointError> {
        let tok_path = dir.join("tokenizer.json");
        let tokenizer = Tokenizer::from_file(&tok_path)
            .map_err(|e| CheckpointError::Tokenizer(format!("{}: {e}", tok_path.display())))?;
        let cfg_path = dir.join("config.json");
        let raw = std::fs::read(&cfg_path).map_err(io_err(&cfg_path))?;
        let v: serde_json::Value =
            serde_json::from_slice(&raw).map_err(|e| CheckpointError::Config(e.to_string()))?;
        let hidden_size = v
            .get("hidden_size")
            .and_then(|h| h.as_u64())
            .filter(|h| *h > 0)
            .ok_or_else(|| CheckpointError::Config("missing positive hidden_size".into()))?
            as usize;
        let specials: HashSet<u32> = tokenizer
            .get_added_tokens_decoder()
            .keys()
            .copied()
            .collect();
        let mut regular: Vec<u32> = tokenizer
            .get_vocab(false)
            .into_values()
            .filter(|id| !specials.contains(id))
            .collect();
        regular.sort_unstable();
        if regular.is_empty() {
            return Err(CheckpointError::Tokenizer(
                "vocabulary has no regular tokens".into(),
            ));
        }
        let mut eos: Vec<u32> = match v.get("eos_token_id") {
            Some(serde_json::Value::Number(n)) => {
                n.as_u64().map(|x| vec![x as u32]).unwrap_or_default()
            }
            Some(serde_json::Value::Array(a)) => a
                .iter()
                .filter_map(|x| x.as_u64())
                .map(|x| x as u32)
                .collect(),
            _ => Vec::new(),
        };
        if eos.is_empty() {
            eos.extend(tokenizer.token_to_id("<|im_end|>"));
        }
        let str_of = |k: &str, d: &str| v.get(k).and_then(|x| x.as_str()).unwrap_or(d).to_string();
        let facts = ModelFacts {
            model_path: dir.display().to_string(),
            model_type: str_of("model_type", "engy-synthetic"),
            architectures: v
                .get("architectures")
                .and_then(|a| a.as_array())
                .map(|a| {
                    a.iter()
                        .filter_map(|x| x.as_str().map(str::to_string))
                        .collect()
                })
                .unwrap_or_default(),
            hidden_size,
            vocab_size: tokenizer.get_vocab_size(true),
            eos_token_ids: eos,
            context_length: 1 << 20,
            routing: routing_shape(&v),
            indexer: indexer_shape(&v),
        };
        Ok(Self {
            inner: Arc::new(Inner {
                facts,
                regular,
                cfg,
            }),
            tokenizer,
        })
    }
}

/// `config.json` field `k` as a positive usize.
fn cfg_usize(v: &serde_json::Value, k: &str) -> Option<usize> {
    v.get(k)
        .and_then(serde_json::Value::as_u64)
        .and_then(|x| usize::try_from(x).ok())
}

/// The routing shape a [`write_checkpoint`] `config.json` declares (all four fields, top-k
/// at most the expert count).
fn routing_shape(v: &serde_json::Value) -> Option<RoutingShape> {
    let r = RoutingShape {
        num_hidden_layers: cfg_usize(v, "num_hidden_layers")?,
        num_experts_per_tok: cfg_usize(v, "num_experts_per_tok")?,
        num_experts: cfg_usize(v, "num_experts")?,
        first_k_dense: cfg_usize(v, "first_k_dense_replace").unwrap_or(0),
    };
    (r.num_hidden_layers > 0 && r.num_experts_per_tok > 0 && r.num_experts_per_tok <= r.num_experts)
        .then_some(r)
}

/// The indexer shape a `config.json` declares (`index_topk` and `num_hidden_layers`).
fn indexer_shape(v: &serde_json::Value) -> Option<IndexerShape> {
    let ix = IndexerShape {
        layers: cfg_usize(v, "num_hidden_layers")?,
        index_topk: cfg_usize(v, "index_topk")?,
    };
    (ix.layers > 0 && ix.index_topk > 0).then_some(ix)
}

impl Inner {
    /// Routed experts of the position whose context hash is `h`: per layer, `top-k`
    /// distinct ids below `num_experts` drawn from the hash (0s for the dense layers).
    fn route(&self, r: &RoutingShape, h: u64, out: &mut Vec<i32>) {
        for layer in 0..r.num_hidden_layers {
            if layer < r.first_k_dense {
                out.extend(std::iter::repeat_n(0, r.num_experts_per_tok));
                continue;
            }
            let mut s = h ^ (0x726f_7574_6500_0000 | layer as u64);
            let from = out.len();
            while out.len() - from < r.num_experts_per_tok {
                let e = (splitmix(&mut s) % r.num_experts as u64) as i32;
                if !out[from..].contains(&e) {
                    out.push(e);
                }
            }
        }
    }

    /// Indexer top-k of position `pos` (context hashes `hashes[..=pos]`): every earlier
    /// key position when there are at most `index_topk` of them, then `-1`; else the
    /// `index_topk` positions with the highest hash score, highest first.
    fn index(&self, ix: &IndexerShape, hashes: &[u64], pos: usize, out: &mut Vec<i32>) {
        let h = hashes.get(pos).copied().unwrap_or_default();
        for layer in 0..ix.layers {
            let n_keys = pos + 1;
            if n_keys <= ix.index_topk {
                out.extend((0..n_keys).map(|j| j as i32));
                out.extend(std::iter::repeat_n(-1, ix.index_topk - n_keys));
                continue;
            }
            let mut scored: Vec<(u64, usize)> = (0..n_keys)
                .map(|j| {
                    let mut s = h
                        ^ hashes.get(j).copied().unwrap_or_default()
                        ^ (layer as u64).wrapping_mul(0x9e37);
                    (splitmix(&mut s), j)
                })
                .collect();
            scored.sort_unstable_by(|a, b| b.cmp(a));
            out.extend(scored.iter().take(ix.index_topk).map(|&(_, j)| j as i32));
        }
    }

    /// The hidden row at the position whose rolling context hash is `h`.
    fn row(&self, h: u64, out: &mut Vec<f32>) {
        let mut s = h ^ 0x5151_5151;
        for _ in 0..self.facts.hidden_size {
            let r = splitmix(&mut s);
            // Sparse zeros, otherwise ±m·2^e with an 8-bit mantissa: bf16-exact.
            if r & 0x3f == 0 {
                out.push(0.0);
                continue;
            }
            let mant = 128 + ((r >> 8) & 0x7f) as i32; // 128..=255
            let exp = ((r >> 16) % 14) as i32 - 17; // 2^-17 .. 2^-4 → |v| in [2^-10, 2^4)
                                                    // 2^exp built from its bits (exact, and without a powi call per value).
            let v = mant as f32 * f32::from_bits(((exp + 127) as u32) << 23);
            out.push(if (r >> 40) & 1 == 1 { -v } else { v });
        }
    }

    /// The greedy token sampled from the position whose context hash is `h`.
    fn sample(&self, h: u64) -> (u32, f32) {
        let mut s = h ^ 0xa5a5_a5a5_0000_0001;
        let r = splitmix(&mut s);
        let logprob = -(((r >> 32) % 1000) as f32) / 1000.0;
        if self.cfg.eos_per_mille > 0 && (r % 1000) < u64::from(self.cfg.eos_per_mille) {
            if let Some(e) = self.facts.eos_token_ids.first() {
                return (*e, logprob);
            }
        }
        let idx = ((r >> 10) % self.regular.len() as u64) as usize;
        (self.regular.get(idx).copied().unwrap_or(0), logprob)
    }
}

fn splitmix(s: &mut u64) -> u64 {
    *s = s.wrapping_add(0x9e37_79b9_7f4a_7c15);
    let mut z = *s;
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

fn roll(h: u64, id: u32) -> u64 {
    let mut s = h ^ (u64::from(id).wrapping_mul(0x1000_0000_01b3));
    splitmix(&mut s)
}

impl Backend for SyntheticBackend {
    fn facts(&self) -> &ModelFacts {
        &self.inner.facts
    }

    fn start(
        &self,
        input_ids: &[u32],
        cached_prefix: usize,
    ) -> Result<Box<dyn Session>, BackendError> {
        if input_ids.is_empty() {
            return Err(BackendError("empty input".into()));
        }
        let facts = &self.inner.facts;
        if let Some(bad) = input_ids.iter().find(|&&t| t as usize >= facts.vocab_size) {
            return Err(BackendError(format!("token id {bad} out of vocabulary")));
        }
        let mut hashes = Vec::with_capacity(input_ids.len());
        let mut h = self.inner.cfg.seed;
        for &t in input_ids {
            h = roll(h, t);
            hashes.push(h);
        }
        let from = cached_prefix.min(input_ids.len() - 1);
        Ok(Box::new(SyntheticSession {
            inner: Arc::clone(&self.inner),
            prefill: Some(from),
            hashes,
            h,
            last: None,
        }))
    }

    fn decode(&self, ids: &[u32]) -> Result<String, BackendError> {
        self.tokenizer
            .decode(ids, true)
            .map_err(|e| BackendError(e.to_string()))
    }
}

struct SyntheticSession {
    inner: Arc<Inner>,
    /// The first computed position, until the prefill step ran.
    prefill: Option<usize>,
    /// Context hash of every position so far (input, then each fed token).
    hashes: Vec<u64>,
    /// Context hash of the last position fed.
    h: u64,
    /// The token sampled by the previous step (fed by the next one).
    last: Option<u32>,
}

impl Session for SyntheticSession {
    fn step(&mut self) -> Result<Step, BackendError> {
        let hidden = self.inner.facts.hidden_size;
        let mut rows = Vec::new();
        // Positions this step ran: all input positions on the prefill step (routing and
        // index of the cached prefix included), then the one fed token.
        let ran = if let Some(from) = self.prefill.take() {
            let computed = self.hashes.get(from..).unwrap_or(&[]);
            rows.reserve(computed.len() * hidden);
            for &h in computed {
                self.inner.row(h, &mut rows);
            }
            0..self.hashes.len()
        } else {
            let t = self
                .last
                .ok_or_else(|| BackendError("session stepped before prefill".into()))?;
            self.h = roll(self.h, t);
            self.hashes.push(self.h);
            rows.reserve(hidden);
            self.inner.row(self.h, &mut rows);
            self.hashes.len() - 1..self.hashes.len()
        };
        let routing = self.inner.facts.routing.map(|r| {
            let mut out =
                Vec::with_capacity(ran.len() * r.num_hidden_layers * r.num_experts_per_tok);
            for p in ran.clone() {
                self.inner.route(
                    &r,
                    self.hashes.get(p).copied().unwrap_or_default(),
                    &mut out,
                );
            }
            out
        });
        let indexer_topk = self.inner.facts.indexer.map(|ix| {
            let mut out = Vec::with_capacity(ran.len() * ix.layers * ix.index_topk);
            for p in ran.clone() {
                self.inner.index(&ix, &self.hashes, p, &mut out);
            }
            out
        });
        let (token_id, logprob) = self.inner.sample(self.h);
        self.last = Some(token_id);
        Ok(Step {
            token_id,
            logprob,
            rows,
            routing,
            indexer_topk,
        })
    }
}
