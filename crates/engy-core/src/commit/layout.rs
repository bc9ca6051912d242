//! Which commitment unit a tensor belongs to (specs/SCHEME.md "Grouping"), and the
//! canonical model config read from `config.json`.
//!
//! Handles HF Qwen3 / Qwen3-MoE / Qwen3-Next / Qwen3.5-3.6 (`model.layers.*`,
//! `model.language_model.layers.*`) and DeepSeek-V3-style GLM names
//! (`mlp.shared_experts.*`, `mlp.gate.e_score_correction_bias`).
use serde::{Deserialize, Serialize};

use super::{CommitError, SCHEME};

/// Prefixes under which decoder layers live; the layer index and a `.` follow.
const LAYER_PREFIXES: [&str; 3] = [
    "model.layers.",
    "model.language_model.layers.",
    "language_model.model.layers.",
];
/// Prefixes of the LM head (`lm_root`).
const LM_PREFIXES: [&str; 2] = ["lm_head.", "language_model.lm_head."];

/// The part of a decoder layer a tensor belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LayerPart {
    /// Everything in the layer outside `mlp.`: attention (`self_attn.*`, `linear_attn.*`,
    /// DSA indexer) and the layer norms.
    Attn,
    /// A dense FFN: `mlp.{gate_proj,up_proj,down_proj}.*`.
    Mlp,
    /// The MoE router: `mlp.gate.*` (weight, and GLM's `e_score_correction_bias`).
    Router,
    /// The shared expert: `mlp.shared_experts.*`, `mlp.shared_expert.*`, `mlp.shared_expert_gate.*`.
    Shared,
    /// Routed expert `e`: `mlp.experts.{e}.*`.
    Expert(u32),
}

/// The unit a tensor is committed in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum UnitId {
    /// Everything outside the LM head and decoder layers `0..n_layers` (embeddings, final
    /// norm, MTP layers, vision tower).
    Globals,
    /// `lm_head.*`.
    Lm,
    /// A part of decoder layer `layer`.
    Layer {
        /// Decoder layer index.
        layer: u32,
        /// Part of that layer.
        part: LayerPart,
    },
}

impl std::fmt::Display for UnitId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            UnitId::Globals => f.write_str("globals"),
            UnitId::Lm => f.write_str("lm"),
            UnitId::Layer { layer, part } => match part {
                LayerPart::Expert(e) => write!(f, "layer {layer} expert {e}"),
                p => write!(f, "layer {layer} {}", format!("{p:?}").to_lowercase()),
            },
        }
    }
}

/// Parses a decimal index made only of ASCII digits (no sign, no leading `+`).
fn parse_index(s: &str) -> Option<u32> {
    if s.is_empty() || !s.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    s.parse().ok()
}

/// Classifies a tensor name (specs/SCHEME.md "Grouping").
///
/// Errors: [`CommitError::UnknownTensor`] for an `mlp.` tensor of no known shape (e.g.
/// fused `mlp.experts.gate_up_proj`), so nothing is ever committed in the wrong unit.
pub fn classify(name: &str, n_layers: u32) -> Result<UnitId, CommitError> {
    if LM_PREFIXES.iter().any(|p| name.starts_with(p)) {
        return Ok(UnitId::Lm);
    }
    let Some(rest) = LAYER_PREFIXES.iter().find_map(|p| name.strip_prefix(p)) else {
        return Ok(UnitId::Globals);
    };
    let Some((idx, rest)) = rest.split_once('.') else {
        return Ok(UnitId::Globals);
    };
    let Some(layer) = parse_index(idx) else {
        return Ok(UnitId::Globals);
    };
    if layer >= n_layers {
        // MTP / extra layers beyond the decoder stack.
        return Ok(UnitId::Globals);
    }
    let unknown = |reason: &str| CommitError::UnknownTensor {
        name: name.to_string(),
        reason: reason.to_string(),
    };
    let part = match rest.strip_prefix("mlp.") {
        None => LayerPart::Attn,
        Some(m) => {
            let (head, tail) = m.split_once('.').unwrap_or((m, ""));
            match head {
                "gate" => LayerPart::Router,
                "shared_experts" | "shared_expert" | "shared_expert_gate" => LayerPart::Shared,
                "gate_proj" | "up_proj" | "down_proj" => LayerPart::Mlp,
                "experts" => {
                    let (e, after) = tail.split_once('.').unwrap_or((tail, ""));
                    match (parse_index(e), slice_of_fused(tail)) {
                        (Some(e), _) if !after.is_empty() => LayerPart::Expert(e),
                        (None, Some(e)) => LayerPart::Expert(e),
                        _ => {
                            return Err(unknown(
                                "unindexed expert tensor (want mlp.experts.{e}.* or a fused mlp.experts.* of first dim n_experts)",
                            ))
                        }
                    }
                }
                _ => return Err(unknown("MLP tensor of no known kind")),
            }
        }
    };
    Ok(UnitId::Layer { layer, part })
}

/// `Some(e)` for the name of expert `e`'s slice of a fused expert tensor: `{rest}[{e}]`
/// with `rest` not starting with a decimal segment (see [`fused_expert_tensor`]).
fn slice_of_fused(tail: &str) -> Option<u32> {
    let inner = tail.strip_suffix(']')?;
    let (rest, idx) = inner.rsplit_once('[')?;
    let first = rest.split('.').next().unwrap_or("");
    if rest.is_empty() || parse_index(first).is_some() {
        return None;
    }
    parse_index(idx)
}

/// Whether `name` is a fused expert tensor (all routed experts of a layer stacked along
/// dim 0, e.g. Qwen3.5's `model.language_model.layers.{i}.mlp.experts.gate_up_proj`):
/// a layer tensor `mlp.experts.{rest}` whose `rest` does not start with a decimal segment
/// and is not already a slice name. Such tensors are committed as one virtual tensor per
/// expert (specs/SCHEME.md "Fused experts").
pub fn fused_expert_tensor(name: &str, n_layers: u32) -> bool {
    let Some(rest) = LAYER_PREFIXES.iter().find_map(|p| name.strip_prefix(p)) else {
        return false;
    };
    let Some((idx, rest)) = rest.split_once('.') else {
        return false;
    };
    if parse_index(idx).is_none_or(|l| l >= n_layers) {
        return false;
    }
    let Some(tail) = rest.strip_prefix("mlp.experts.") else {
        return false;
    };
    let first = tail.split('.').next().unwrap_or("");
    !first.is_empty() && parse_index(first).is_none() && !tail.ends_with(']')
}

/// The canonical model config bound into `model_root` (specs/SCHEME.md "Config leaf").
///
/// Fields are declared in alphabetical order: serialising with `serde_json::to_string`
/// yields the canonical JSON (sorted keys, no whitespace, integers in decimal).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelConfig {
    /// `model_type` of `config.json` (e.g. `qwen3_moe`, `glm4_moe`).
    pub arch: String,
    /// SHA-256 of the checkpoint's `config.json` bytes, 64 lowercase hex digits, when the
    /// commitment binds the whole file ([`super::CommitOptions::bind_config`]; specs/SCHEME.md
    /// "Config leaf"): every field the forward pass reads (`norm_topk_prob`,
    /// `routed_scaling_factor`, `n_group`, `topk_group`, `rms_norm_eps`, `rope_theta`, …) is
    /// then committed. Absent (and not serialised) otherwise, so commitments made without it
    /// keep their roots.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub config_sha256: Option<String>,
    /// Routed-expert FFN width (`moe_intermediate_size`), or `intermediate_size` for dense models.
    pub d_ff: u64,
    /// `first_k_dense_replace` (0 when absent).
    pub first_k_dense: u64,
    /// `hidden_size`.
    pub hidden: u64,
    /// Routed experts per MoE layer (`num_experts`/`n_routed_experts`/`num_local_experts`; 0 = dense).
    pub n_experts: u64,
    /// `num_hidden_layers`.
    pub n_layers: u64,
    /// Weight format: `bf16`, `f16`, `f32`, `fp8`, `nvfp4`, or another lowercase tag.
    pub quant: String,
    /// Always [`SCHEME`].
    pub scheme: String,
    /// `num_experts_per_tok` (0 = dense).
    pub top_k: u64,
    /// `vocab_size`.
    pub vocab: u64,
}

fn tag_ok(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 64
        && s.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b"_.-".contains(&b))
}

impl ModelConfig {
    /// The canonical JSON bytes of this config.
    ///
    /// Errors: [`CommitError::Config`] when `arch`/`quant` are not `[a-z0-9_.-]{1,64}` or
    /// `scheme` is not [`SCHEME`].
    pub fn canonical_json(&self) -> Result<String, CommitError> {
        if !tag_ok(&self.arch) || !tag_ok(&self.quant) {
            return Err(CommitError::Config(format!(
                "arch {:?} / quant {:?} must match [a-z0-9_.-]{{1,64}}",
                self.arch, self.quant
            )));
        }
        if self.scheme != SCHEME {
            return Err(CommitError::Config(format!(
                "scheme {:?} is not {SCHEME:?}",
                self.scheme
            )));
        }
        if let Some(h) = &self.config_sha256 {
            let hex = h.len() == 64
                && h.bytes()
                    .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b));
            if !hex {
                return Err(CommitError::Config(format!(
                    "config_sha256 {h:?} is not 64 lowercase hex digits"
                )));
            }
        }
        serde_json::to_string(self).map_err(|e| CommitError::Config(e.to_string()))
    }

    /// Reads the config from a parsed HF `config.json` (using `text_config` when present).
    /// `quant_override` replaces the detected weight format.
    ///
    /// Errors: [`CommitError::Config`] when a required field (`num_hidden_layers`,
    /// `hidden_size`, `vocab_size`, `moe_intermediate_size`/`intermediate_size`) is missing.
    pub fn from_hf(
        config: &serde_json::Value,
        quant_override: Option<&str>,
    ) -> Result<Self, CommitError> {
        let text = config.get("text_config").unwrap_or(config);
        let int = |keys: &[&str]| -> Option<u64> {
            keys.iter()
                .find_map(|k| text.get(*k).or_else(|| config.get(*k)))
                .and_then(|v| v.as_u64())
        };
        let need = |keys: &[&str]| {
            int(keys).ok_or_else(|| {
                CommitError::Config(format!("config.json lacks an integer {}", keys.join("/")))
            })
        };
        let arch = config
            .get("model_type")
            .and_then(|v| v.as_str())
            .ok_or_else(|| CommitError::Config("config.json lacks model_type".into()))?
            .to_ascii_lowercase();
        let n_experts = int(&["num_experts", "n_routed_experts", "num_local_experts"]).unwrap_or(0);
        let d_ff = if n_experts > 0 {
            need(&["moe_intermediate_size"])?
        } else {
            need(&["intermediate_size"])?
        };
        let quant = match quant_override {
            Some(q) => q.to_ascii_lowercase(),
            None => detect_quant(config),
        };
        Ok(Self {
            arch,
            config_sha256: None,
            d_ff,
            first_k_dense: int(&["first_k_dense_replace"]).unwrap_or(0),
            hidden: need(&["hidden_size"])?,
            n_experts,
            n_layers: need(&["num_hidden_layers"])?,
            quant,
            scheme: SCHEME.to_string(),
            top_k: if n_experts > 0 {
                int(&["num_experts_per_tok"]).unwrap_or(0)
            } else {
                0
            },
            vocab: need(&["vocab_size"])?,
        })
    }
}

/// Weight format from `quantization_config` (FP8 block, ModelOpt / compressed-tensors
/// NVFP4) or the checkpoint dtype.
fn detect_quant(config: &serde_json::Value) -> String {
    let text = config.get("text_config").unwrap_or(config);
    let qc = [config, text]
        .iter()
        .find_map(|c| c.get("quantization_config").filter(|v| !v.is_null()));
    if let Some(qc) = qc {
        let blob = qc.to_string().to_ascii_lowercase();
        if blob.contains("nvfp4") {
            return "nvfp4".into();
        }
        let method = qc
            .get("quant_method")
            .and_then(|v| v.as_str())
            .unwrap_or("")
            .to_ascii_lowercase();
        if method == "fp8" || blob.contains("\"fp8\"") || blob.contains("float-quantized") {
            return "fp8".into();
        }
        if tag_ok(&method) {
            return method;
        }
        return "quantized".into();
    }
    // First key present (in `text_config`, else top level), as the Python reference.
    let dtype = ["torch_dtype", "dtype"]
        .iter()
        .find_map(|k| text.get(*k).or_else(|| config.get(*k)))
        .and_then(|v| v.as_str())
        .unwrap_or("");
    match dtype {
        "bfloat16" => "bf16",
        "float16" => "f16",
        "float32" => "f32",
        _ => "unquantized",
    }
    .into()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn l(layer: u32, part: LayerPart) -> UnitId {
        UnitId::Layer { layer, part }
    }

    #[test]
    fn config_sha256_is_sorted_in_and_absent_when_unbound() {
        let v = serde_json::json!({"model_type": "qwen3_moe", "num_hidden_layers": 2,
            "hidden_size": 4, "moe_intermediate_size": 2, "num_experts": 2,
            "num_experts_per_tok": 1, "vocab_size": 8, "torch_dtype": "bfloat16"});
        let mut c = ModelConfig::from_hf(&v, None).unwrap();
        let unbound = c.canonical_json().unwrap();
        assert!(!unbound.contains("config_sha256"), "{unbound}");
        c.config_sha256 = Some("ab".repeat(32));
        let bound = c.canonical_json().unwrap();
        assert!(
            bound.starts_with(&format!(
                "{{\"arch\":\"qwen3_moe\",\"config_sha256\":\"{}\",\"d_ff\"",
                "ab".repeat(32)
            )),
            "{bound}"
        );
        c.config_sha256 = Some("AB".repeat(32));
        assert!(c.canonical_json().is_err());
        c.config_sha256 = Some("ab".into());
        assert!(c.canonical_json().is_err());
    }

    #[test]
    fn classifies_qwen_glm_and_devnet_names() {
        let cases = [
            ("model.embed_tokens.weight", UnitId::Globals),
            ("model.norm.weight", UnitId::Globals),
            ("lm_head.weight", UnitId::Lm),
            (
                "model.layers.0.self_attn.q_proj.weight",
                l(0, LayerPart::Attn),
            ),
            (
                "model.layers.0.input_layernorm.weight",
                l(0, LayerPart::Attn),
            ),
            ("model.layers.1.mlp.gate_proj.weight", l(1, LayerPart::Mlp)),
            ("model.layers.2.mlp.gate.weight", l(2, LayerPart::Router)),
            (
                "model.layers.2.mlp.gate.e_score_correction_bias",
                l(2, LayerPart::Router),
            ),
            (
                "model.layers.2.mlp.shared_experts.up_proj.weight_scale_inv",
                l(2, LayerPart::Shared),
            ),
            (
                "model.layers.2.mlp.shared_expert_gate.weight",
                l(2, LayerPart::Shared),
            ),
            (
                "model.layers.2.mlp.experts.17.down_proj.weight",
                l(2, LayerPart::Expert(17)),
            ),
            (
                "model.language_model.layers.3.linear_attn.in_proj_qkvz.weight",
                l(3, LayerPart::Attn),
            ),
            (
                "model.layers.9.mlp.experts.0.up_proj.weight",
                UnitId::Globals,
            ),
        ];
        for (name, want) in cases {
            assert_eq!(classify(name, 4).unwrap(), want, "{name}");
        }
        assert!(classify("model.layers.1.mlp.experts.gate_up_proj", 4).is_err());
        assert_eq!(
            classify("model.layers.1.mlp.experts.gate_up_proj[7]", 4).unwrap(),
            l(1, LayerPart::Expert(7))
        );
        assert!(classify("model.layers.1.mlp.experts.3[7]", 4).is_err());
        assert!(fused_expert_tensor(
            "model.language_model.layers.1.mlp.experts.down_proj",
            4
        ));
        assert!(fused_expert_tensor(
            "model.layers.1.mlp.experts.gate_up_proj_scale_inv",
            4
        ));
        assert!(!fused_expert_tensor(
            "model.layers.1.mlp.experts.3.down_proj.weight",
            4
        ));
        assert!(!fused_expert_tensor(
            "model.layers.9.mlp.experts.down_proj",
            4
        ));
        assert!(!fused_expert_tensor(
            "model.layers.1.mlp.experts.down_proj[2]",
            4
        ));
        assert!(classify("model.layers.1.mlp.weird.weight", 4).is_err());
    }
}
