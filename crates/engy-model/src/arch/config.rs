//! `config.json` of any architecture the auditor runs, read with the field names of transformers
//! 4 and 5 alike.
//!
//! transformers 5 renamed or moved several fields; both spellings are accepted:
//! * `rope_theta` (v4, top level) or `rope_parameters.rope_theta` (v5); `partial_rotary_factor`
//!   at the top level (v4) or in `rope_parameters` (v5);
//! * `torch_dtype` (v4) or `dtype` (v5);
//! * a multimodal checkpoint (`Qwen3_5MoeForConditionalGeneration`, model_type `qwen3_5_moe`)
//!   keeps the text model's settings under `text_config`; they are read from there, with
//!   fields missing there taken from the top level (`tie_word_embeddings`, token ids).
//! * `eos_token_id` may be an integer, a list or null.
//!
//! Architecture-specific fields are read by each architecture from [`TextConfig::raw`].
use serde_json::Value;

use crate::ModelError;

/// The architecture families the auditor implements, chosen from `model_type` (then
/// `architectures`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ArchKind {
    /// `qwen3` / `qwen3_moe` (`Qwen3ForCausalLM`, `Qwen3MoeForCausalLM`): the devnet model.
    Qwen3Moe,
    /// `qwen3_5_moe` / `qwen3_5_moe_text` (Qwen3.5/3.6-MoE: Gated DeltaNet + gated attention).
    Qwen3_5Moe,
    /// `glm_moe_dsa` (GLM-5.x: MLA + DSA indexer).
    GlmMoeDsa,
}

impl ArchKind {
    /// The `model_type` spelling of the family (`qwen3_moe`, `qwen3_5_moe`, `glm_moe_dsa`).
    pub fn name(self) -> &'static str {
        match self {
            ArchKind::Qwen3Moe => "qwen3_moe",
            ArchKind::Qwen3_5Moe => "qwen3_5_moe",
            ArchKind::GlmMoeDsa => "glm_moe_dsa",
        }
    }

    /// Parses a family name as [`ArchKind::name`] prints it (also `qwen3`, `qwen3_5_moe_text`).
    pub fn from_model_type(s: &str) -> Option<Self> {
        match s {
            "qwen3" | "qwen3_moe" => Some(ArchKind::Qwen3Moe),
            "qwen3_5_moe" | "qwen3_5_moe_text" => Some(ArchKind::Qwen3_5Moe),
            "glm_moe_dsa" => Some(ArchKind::GlmMoeDsa),
            _ => None,
        }
    }

    fn from_architecture(s: &str) -> Option<Self> {
        match s {
            "Qwen3ForCausalLM" | "Qwen3MoeForCausalLM" => Some(ArchKind::Qwen3Moe),
            "Qwen3_5MoeForCausalLM" | "Qwen3_5MoeForConditionalGeneration" => {
                Some(ArchKind::Qwen3_5Moe)
            }
            "GlmMoeDsaForCausalLM" => Some(ArchKind::GlmMoeDsa),
            _ => None,
        }
    }
}

impl std::fmt::Display for ArchKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// `quantization_config` (top level of `config.json`), as far as dequantisation needs it.
#[derive(Debug, Clone, PartialEq)]
pub struct QuantConfig {
    /// `quant_method`: `fp8` (block FP8) or `modelopt` (NVFP4), or another method.
    pub method: String,
    /// `weight_block_size` of block FP8 (`[128, 128]` when absent).
    pub weight_block_size: [usize; 2],
    /// Values per NVFP4 scale (`config_groups.*.weights.group_size`, 16 when absent).
    pub group_size: usize,
}

/// The settings common to every decoder-only text model, plus the raw text config.
#[derive(Debug, Clone)]
pub struct TextConfig {
    /// The family this config dispatches to.
    pub kind: ArchKind,
    /// `model_type` of the top level (e.g. `qwen3_5_moe` for the multimodal layout).
    pub model_type: String,
    /// `model_type` of the text config (`qwen3_5_moe_text` under `text_config`; equals
    /// `model_type` for a text-only checkpoint).
    pub text_model_type: String,
    /// `architectures` of the top level.
    pub architectures: Vec<String>,
    /// Model width `H`.
    pub hidden_size: usize,
    /// Rows of `embed_tokens` / `lm_head`.
    pub vocab_size: usize,
    /// Decoder layers.
    pub num_hidden_layers: usize,
    /// Longest sequence accepted (`max_position_embeddings`; 1 << 20 when absent).
    pub max_position_embeddings: usize,
    /// RMSNorm epsilon (`rms_norm_eps`, 1e-6 when absent).
    pub rms_norm_eps: f64,
    /// RoPE base (`rope_theta` or `rope_parameters.rope_theta`; 10000 when absent).
    pub rope_theta: f64,
    /// `rope_parameters.rope_type` / `rope_scaling.rope_type` (`default` when absent).
    pub rope_type: String,
    /// Fraction of the head dimension RoPE rotates (`partial_rotary_factor`, 1.0 when absent).
    pub partial_rotary_factor: f64,
    /// End-of-sequence ids (`eos_token_id` as int or list; empty when null or absent).
    pub eos_token_ids: Vec<u32>,
    /// `bos_token_id` when present.
    pub bos_token_id: Option<u32>,
    /// `dtype` (v5) or `torch_dtype` (v4).
    pub dtype: Option<String>,
    /// Whether `lm_head` is `embed_tokens`.
    pub tie_word_embeddings: bool,
    /// `quantization_config`, when present.
    pub quantization: Option<QuantConfig>,
    /// The text config object (`text_config` when present, else the top level): read
    /// architecture-specific fields from here.
    pub raw: Value,
    /// The whole `config.json`.
    pub top: Value,
}

fn usize_field(v: &Value, key: &str) -> Option<usize> {
    v.get(key)?.as_u64().and_then(|x| usize::try_from(x).ok())
}

fn token_ids(v: Option<&Value>) -> Vec<u32> {
    match v {
        Some(Value::Number(n)) => n
            .as_u64()
            .and_then(|x| u32::try_from(x).ok())
            .into_iter()
            .collect(),
        Some(Value::Array(a)) => a
            .iter()
            .filter_map(|x| x.as_u64().and_then(|x| u32::try_from(x).ok()))
            .collect(),
        _ => Vec::new(),
    }
}

impl TextConfig {
    /// Parses `config.json` bytes.
    ///
    /// # Errors
    /// [`ModelError::Config`] for invalid JSON, a missing required field (`hidden_size`,
    /// `vocab_size`, `num_hidden_layers`) or an unknown architecture.
    pub fn from_json(bytes: &[u8]) -> Result<Self, ModelError> {
        let top: Value = serde_json::from_slice(bytes)
            .map_err(|e| ModelError::Config(format!("config.json: {e}")))?;
        if !top.is_object() {
            return Err(ModelError::Config(
                "config.json is not a JSON object".into(),
            ));
        }
        let raw = match top.get("text_config") {
            Some(t) if t.is_object() => {
                // Fields the text config leaves out come from the top level.
                let mut merged = t.clone();
                if let (Some(m), Some(tm)) = (merged.as_object_mut(), top.as_object()) {
                    for (k, v) in tm {
                        if k != "text_config" && k != "vision_config" && !m.contains_key(k) {
                            m.insert(k.clone(), v.clone());
                        }
                    }
                }
                merged
            }
            _ => top.clone(),
        };
        let s = |v: &Value, k: &str| v.get(k).and_then(Value::as_str).map(str::to_string);
        let model_type = s(&top, "model_type").unwrap_or_default();
        let text_model_type = top
            .get("text_config")
            .and_then(|t| s(t, "model_type"))
            .unwrap_or_else(|| model_type.clone());
        let architectures: Vec<String> = top
            .get("architectures")
            .and_then(Value::as_array)
            .map(|a| {
                a.iter()
                    .filter_map(|x| x.as_str().map(str::to_string))
                    .collect()
            })
            .unwrap_or_default();
        let kind = ArchKind::from_model_type(&text_model_type)
            .or_else(|| ArchKind::from_model_type(&model_type))
            .or_else(|| {
                architectures
                    .iter()
                    .find_map(|a| ArchKind::from_architecture(a))
            })
            .ok_or_else(|| {
                ModelError::Config(format!(
                    "unsupported architecture: model_type {model_type:?}, architectures \
                     {architectures:?} (supported: qwen3_moe, qwen3_5_moe, glm_moe_dsa)"
                ))
            })?;
        let req = |k: &str| {
            usize_field(&raw, k).filter(|&x| x > 0).ok_or_else(|| {
                ModelError::Config(format!(
                    "config.json: {k} missing or not a positive integer"
                ))
            })
        };
        let rope = raw
            .get("rope_parameters")
            .filter(|v| v.is_object())
            .or_else(|| raw.get("rope_scaling").filter(|v| v.is_object()));
        let f = |v: Option<&Value>, k: &str| v.and_then(|v| v.get(k)).and_then(Value::as_f64);
        let rope_theta = f(Some(&raw), "rope_theta")
            .or_else(|| f(rope, "rope_theta"))
            .unwrap_or(10000.0);
        let partial_rotary_factor = f(rope, "partial_rotary_factor")
            .or_else(|| f(Some(&raw), "partial_rotary_factor"))
            .unwrap_or(1.0);
        let rope_type = rope
            .and_then(|r| r.get("rope_type").or_else(|| r.get("type")))
            .and_then(Value::as_str)
            .unwrap_or("default")
            .to_string();
        let quantization = top
            .get("quantization_config")
            .filter(|q| q.is_object())
            .map(|q| {
                let block = q
                    .get("weight_block_size")
                    .and_then(Value::as_array)
                    .and_then(|a| {
                        let v: Vec<usize> = a
                            .iter()
                            .filter_map(|x| x.as_u64().map(|x| x as usize))
                            .collect();
                        (v.len() == 2).then(|| [v[0], v[1]])
                    })
                    .unwrap_or([128, 128]);
                let group = q
                    .get("config_groups")
                    .and_then(Value::as_object)
                    .and_then(|g| {
                        g.values()
                            .find_map(|grp| usize_field(grp.get("weights")?, "group_size"))
                    })
                    .or_else(|| usize_field(q, "group_size"))
                    .unwrap_or(16);
                QuantConfig {
                    method: s(q, "quant_method").unwrap_or_default(),
                    weight_block_size: block,
                    group_size: group,
                }
            });
        Ok(Self {
            kind,
            model_type,
            text_model_type,
            architectures,
            hidden_size: req("hidden_size")?,
            vocab_size: req("vocab_size")?,
            num_hidden_layers: req("num_hidden_layers")?,
            max_position_embeddings: usize_field(&raw, "max_position_embeddings")
                .filter(|&x| x > 0)
                .unwrap_or(1 << 20),
            rms_norm_eps: f(Some(&raw), "rms_norm_eps").unwrap_or(1e-6),
            rope_theta,
            rope_type,
            partial_rotary_factor,
            eos_token_ids: token_ids(raw.get("eos_token_id")),
            bos_token_id: token_ids(raw.get("bos_token_id")).first().copied(),
            dtype: s(&raw, "dtype").or_else(|| s(&raw, "torch_dtype")),
            tie_word_embeddings: raw
                .get("tie_word_embeddings")
                .and_then(Value::as_bool)
                .unwrap_or(false),
            quantization,
            raw,
            top,
        })
    }

    /// Reads `dir/config.json`.
    ///
    /// # Errors
    /// [`ModelError::Io`] when unreadable, else as [`TextConfig::from_json`].
    pub fn read(dir: &std::path::Path) -> Result<Self, ModelError> {
        let path = dir.join("config.json");
        let bytes = std::fs::read(&path).map_err(|source| ModelError::Io {
            path: path.clone(),
            source,
        })?;
        Self::from_json(&bytes).map_err(|e| match e {
            ModelError::Config(m) => ModelError::Config(format!("{}: {m}", path.display())),
            other => other,
        })
    }

    /// A `usize` field of the text config, or `default` when absent.
    ///
    /// # Errors
    /// [`ModelError::Config`] when present but not a non-negative integer.
    pub fn usize_or(&self, key: &str, default: usize) -> Result<usize, ModelError> {
        match self.raw.get(key) {
            None | Some(Value::Null) => Ok(default),
            Some(v) => v
                .as_u64()
                .and_then(|x| usize::try_from(x).ok())
                .ok_or_else(|| {
                    ModelError::Config(format!("{key} must be a non-negative integer, got {v}"))
                }),
        }
    }

    /// A required positive `usize` field of the text config.
    ///
    /// # Errors
    /// [`ModelError::Config`] naming the field.
    pub fn usize_req(&self, key: &str) -> Result<usize, ModelError> {
        usize_field(&self.raw, key)
            .filter(|&x| x > 0)
            .ok_or_else(|| {
                ModelError::Config(format!(
                    "config.json: {key} missing or not a positive integer"
                ))
            })
    }

    /// An `f64` field of the text config, or `default`.
    pub fn f64_or(&self, key: &str, default: f64) -> f64 {
        self.raw.get(key).and_then(Value::as_f64).unwrap_or(default)
    }

    /// A `bool` field of the text config, or `default`.
    pub fn bool_or(&self, key: &str, default: bool) -> bool {
        self.raw
            .get(key)
            .and_then(Value::as_bool)
            .unwrap_or(default)
    }

    /// A string field of the text config.
    pub fn str_field(&self, key: &str) -> Option<&str> {
        self.raw.get(key).and_then(Value::as_str)
    }

    /// A list of strings (e.g. `layer_types`), or `None` when absent.
    pub fn str_list(&self, key: &str) -> Option<Vec<String>> {
        self.raw.get(key)?.as_array().map(|a| {
            a.iter()
                .map(|x| x.as_str().unwrap_or_default().to_string())
                .collect()
        })
    }

    /// A list of integers (e.g. `mlp_only_layers`); empty when absent.
    pub fn usize_list(&self, key: &str) -> Vec<usize> {
        self.raw
            .get(key)
            .and_then(Value::as_array)
            .map(|a| {
                a.iter()
                    .filter_map(|x| x.as_u64().map(|x| x as usize))
                    .collect()
            })
            .unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn v4_and_v5_spellings_agree() {
        let v4 = br#"{"model_type":"qwen3_moe","architectures":["Qwen3MoeForCausalLM"],"hidden_size":8,"vocab_size":4,"num_hidden_layers":1,"rope_theta":1000000.0,"torch_dtype":"bfloat16","eos_token_id":3}"#;
        let v5 = br#"{"model_type":"qwen3_moe","hidden_size":8,"vocab_size":4,"num_hidden_layers":1,"rope_parameters":{"rope_type":"default","rope_theta":1000000.0},"dtype":"bfloat16","eos_token_id":[3]}"#;
        let (a, b) = (
            TextConfig::from_json(v4).unwrap(),
            TextConfig::from_json(v5).unwrap(),
        );
        assert_eq!(a.rope_theta, b.rope_theta);
        assert_eq!(a.dtype, b.dtype);
        assert_eq!(a.eos_token_ids, b.eos_token_ids);
        assert_eq!(a.kind, ArchKind::Qwen3Moe);
    }

    #[test]
    fn text_config_is_read_for_the_multimodal_layout() {
        let j = br#"{"model_type":"qwen3_5_moe","architectures":["Qwen3_5MoeForConditionalGeneration"],"tie_word_embeddings":false,"text_config":{"model_type":"qwen3_5_moe_text","hidden_size":16,"vocab_size":9,"num_hidden_layers":2,"rope_parameters":{"rope_theta":1e7,"partial_rotary_factor":0.25}}}"#;
        let c = TextConfig::from_json(j).unwrap();
        assert_eq!(c.kind, ArchKind::Qwen3_5Moe);
        assert_eq!(
            (c.hidden_size, c.vocab_size, c.num_hidden_layers),
            (16, 9, 2)
        );
        assert_eq!(c.partial_rotary_factor, 0.25);
        assert_eq!(c.text_model_type, "qwen3_5_moe_text");
    }

    #[test]
    fn unknown_architecture_is_named() {
        let e = TextConfig::from_json(
            br#"{"model_type":"llama","hidden_size":8,"vocab_size":4,"num_hidden_layers":1}"#,
        )
        .unwrap_err();
        assert!(e.to_string().contains("llama"), "{e}");
    }
}
