//! The spec file `model_spec.json.gz`: the JSON shape of the published specs
//! (`model_root`, `lm_root`, `layer_roots`, `expert_roots_by_layer`, …) plus a `scheme`
//! field and the extra roots this scheme needs (specs/SCHEME.md "Spec file").
//!
//! Also [`inspect`]: the structure of any spec file, ours or published, without
//! pretending to recompute roots of an unknown scheme.
use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::path::Path;

use serde::{Deserialize, Serialize};

use super::{tree, CommitError, Commitment, Digest, LayerBody, ModelConfig, SCHEME};

/// A digest that (de)serialises (and prints, also in `Debug`) as 64 lowercase hex characters.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Hex(pub Digest);

impl std::fmt::Debug for Hex {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Hex({})", hex::encode(self.0))
    }
}

impl std::fmt::Display for Hex {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&hex::encode(self.0))
    }
}

impl Serialize for Hex {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        super::hex32::serialize(&self.0, s)
    }
}

impl<'de> Deserialize<'de> for Hex {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        super::hex32::deserialize(d).map(Hex)
    }
}

/// Unit roots of one MoE layer (the published `expert_roots_by_layer` entry + `attn`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MoeLayerRoots {
    /// Attention + norms unit.
    pub attn: Hex,
    /// Router unit (gate weight + GLM bias).
    pub router: Hex,
    /// Tensor leaf of `mlp.gate.e_score_correction_bias` (GLM), inside the router unit.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bias_leaf: Option<Hex>,
    /// Shared-expert unit (`SHA-256("")` when none).
    pub shared: Hex,
    /// Routed experts' unit roots, by expert index.
    pub experts: Vec<Hex>,
    /// `MTH([attn, router, shared, experts…])`.
    pub layer_root: Hex,
}

/// Unit roots of one dense layer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DenseLayerRoots {
    /// Attention + norms unit.
    pub attn: Hex,
    /// Dense FFN unit.
    pub mlp: Hex,
    /// `MTH([attn, mlp])`.
    pub layer_root: Hex,
}

/// A spec file of scheme [`SCHEME`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SpecFile {
    /// Always [`SCHEME`].
    pub scheme: String,
    /// The canonical config (hashed into `config_leaf`).
    pub config: ModelConfig,
    /// Same as `config.quant` (the published files carry it top-level).
    pub quant: String,
    /// `node(config_leaf, body_root)`: the commitment.
    pub model_root: Hex,
    /// The config leaf.
    pub config_leaf: Hex,
    /// `MTH([globals_root, lm_root, layer_roots…])`.
    pub body_root: Hex,
    /// Embeddings, final norm, MTP layers, other non-layer tensors.
    pub globals_root: Hex,
    /// `lm_head.*`.
    pub lm_root: Hex,
    /// One root per decoder layer `0..n_layers` (dense and MoE).
    pub layer_roots: Vec<Hex>,
    /// MoE layers, keyed by decoder layer index.
    pub expert_roots_by_layer: BTreeMap<u32, MoeLayerRoots>,
    /// Dense layers, keyed by decoder layer index.
    pub dense_roots_by_layer: BTreeMap<u32, DenseLayerRoots>,
    /// Hex of the raw little-endian bytes of each MoE layer's `e_score_correction_bias`.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub router_bias_by_layer: BTreeMap<u32, String>,
    /// `config.first_k_dense` (published field name).
    pub first_k_dense_replace: u64,
    /// Number of MoE layers committed.
    pub n_moe_committed: u64,
    /// Always `false`: this tool commits every tensor.
    pub partial: bool,
    /// Tensors committed.
    pub n_tensors: u64,
    /// Raw tensor bytes committed.
    pub n_bytes: u64,
    /// Wall-clock seconds the build took (informational, not committed).
    #[serde(default)]
    pub built_in_s: f64,
}

impl SpecFile {
    /// The spec of a commitment.
    pub fn from_commitment(c: &Commitment, built_in_s: f64) -> Self {
        let mut moe = BTreeMap::new();
        let mut dense = BTreeMap::new();
        let mut biases = BTreeMap::new();
        for (i, l) in c.layers.iter().enumerate() {
            let i = i as u32;
            match &l.body {
                LayerBody::Dense { attn, mlp } => {
                    dense.insert(
                        i,
                        DenseLayerRoots {
                            attn: Hex(attn.root),
                            mlp: Hex(mlp.root),
                            layer_root: Hex(l.root),
                        },
                    );
                }
                LayerBody::Moe {
                    attn,
                    router,
                    shared,
                    experts,
                    router_bias,
                } => {
                    if let Some(b) = router_bias {
                        biases.insert(i, hex::encode(b));
                    }
                    moe.insert(
                        i,
                        MoeLayerRoots {
                            attn: Hex(attn.root),
                            router: Hex(router.root),
                            bias_leaf: router
                                .tensors
                                .iter()
                                .find(|t| t.name.ends_with(".e_score_correction_bias"))
                                .map(|t| Hex(t.leaf)),
                            shared: Hex(shared.root),
                            experts: experts.iter().map(|u| Hex(u.root)).collect(),
                            layer_root: Hex(l.root),
                        },
                    );
                }
            }
        }
        Self {
            scheme: SCHEME.to_string(),
            quant: c.config.quant.clone(),
            first_k_dense_replace: c.config.first_k_dense,
            n_moe_committed: moe.len() as u64,
            config: c.config.clone(),
            model_root: Hex(c.model_root),
            config_leaf: Hex(c.config_leaf),
            body_root: Hex(c.body_root),
            globals_root: Hex(c.globals.root),
            lm_root: Hex(c.lm.root),
            layer_roots: c.layers.iter().map(|l| Hex(l.root)).collect(),
            expert_roots_by_layer: moe,
            dense_roots_by_layer: dense,
            router_bias_by_layer: biases,
            partial: false,
            n_tensors: c.n_tensors,
            n_bytes: c.n_bytes,
            built_in_s,
        }
    }

    /// Parses a spec file of this scheme from JSON.
    ///
    /// Errors: [`CommitError::Spec`] when it is not JSON of this shape or its `scheme` is
    /// not [`SCHEME`].
    pub fn from_value(v: serde_json::Value) -> Result<Self, CommitError> {
        match v.get("scheme").and_then(|s| s.as_str()) {
            Some(SCHEME) => {}
            Some(other) => {
                return Err(CommitError::Spec(format!(
                    "scheme {other:?} is not {SCHEME:?}; this tool cannot recompute its roots"
                )))
            }
            None => {
                return Err(CommitError::Spec(
                    "no `scheme` field: made by another tool whose leaf/node hashing is not public; its roots cannot be recomputed (see `spec inspect`)".into(),
                ))
            }
        }
        serde_json::from_value(v).map_err(|e| CommitError::Spec(e.to_string()))
    }

    /// Reads a spec file of this scheme (gzip or plain JSON).
    ///
    /// Errors: [`CommitError::Io`], [`CommitError::Spec`].
    pub fn read(path: &Path) -> Result<Self, CommitError> {
        Self::from_value(read_json(path)?)
    }

    /// Writes the spec as gzip-compressed pretty JSON.
    ///
    /// Errors: [`CommitError::Io`].
    pub fn write_gz(&self, path: &Path) -> Result<(), CommitError> {
        let io = |source| CommitError::Io {
            path: path.to_path_buf(),
            source,
        };
        let json = serde_json::to_vec(self).map_err(|e| CommitError::Spec(e.to_string()))?;
        let f = std::fs::File::create(path).map_err(io)?;
        let mut gz = flate2::write::GzEncoder::new(f, flate2::Compression::default());
        gz.write_all(&json).map_err(io)?;
        gz.finish().map_err(io)?;
        Ok(())
    }

    /// Recomputes every layer root from its unit roots and `model_root` from the layer,
    /// globals and lm roots and the config: the file's internal consistency (no checkpoint
    /// needed). Returns the list of inconsistencies (empty = consistent).
    pub fn check_internal(&self) -> Vec<String> {
        let mut bad = Vec::new();
        if self.layer_roots.len() as u64 != self.config.n_layers {
            bad.push(format!(
                "{} layer_roots for n_layers {}",
                self.layer_roots.len(),
                self.config.n_layers
            ));
        }
        for (i, lr) in self.layer_roots.iter().enumerate() {
            let i32_ = i as u32;
            let units: Vec<Digest> = match (
                self.expert_roots_by_layer.get(&i32_),
                self.dense_roots_by_layer.get(&i32_),
            ) {
                (Some(m), None) => {
                    if m.layer_root != *lr {
                        bad.push(format!(
                            "layer {i}: layer_root differs from layer_roots[{i}]"
                        ));
                    }
                    if m.experts.len() as u64 != self.config.n_experts {
                        bad.push(format!(
                            "layer {i}: {} experts for n_experts {}",
                            m.experts.len(),
                            self.config.n_experts
                        ));
                    }
                    let mut v = vec![m.attn.0, m.router.0, m.shared.0];
                    v.extend(m.experts.iter().map(|e| e.0));
                    v
                }
                (None, Some(d)) => {
                    if d.layer_root != *lr {
                        bad.push(format!(
                            "layer {i}: layer_root differs from layer_roots[{i}]"
                        ));
                    }
                    vec![d.attn.0, d.mlp.0]
                }
                _ => {
                    bad.push(format!("layer {i}: not exactly one of MoE/dense entries"));
                    continue;
                }
            };
            if tree::mth(&units) != lr.0 {
                bad.push(format!(
                    "layer {i}: MTH of its unit roots is not its layer root"
                ));
            }
        }
        match super::config_leaf(&self.config) {
            Ok(cl) if cl != self.config_leaf.0 => {
                bad.push("config_leaf does not hash config".into())
            }
            Ok(_) => {}
            Err(e) => bad.push(e.to_string()),
        }
        let mut body = vec![self.globals_root.0, self.lm_root.0];
        body.extend(self.layer_roots.iter().map(|h| h.0));
        let body_root = tree::mth(&body);
        if body_root != self.body_root.0 {
            bad.push("body_root is not MTH([globals_root, lm_root, layer_roots…])".into());
        }
        if tree::node(&self.config_leaf.0, &body_root) != self.model_root.0 {
            bad.push("model_root is not node(config_leaf, body_root)".into());
        }
        bad
    }

    /// Field-by-field differences from `other` (e.g. the recomputed spec): empty when
    /// every root agrees. Each line names the unit (`layer 3 expert 7: …`).
    pub fn diff(&self, other: &SpecFile) -> Vec<String> {
        let mut d = Vec::new();
        let mut cmp = |what: String, a: &Hex, b: &Hex| {
            if a != b {
                d.push(format!("{what}: spec {a}, checkpoint {b}"));
            }
        };
        cmp("model_root".into(), &self.model_root, &other.model_root);
        cmp("config_leaf".into(), &self.config_leaf, &other.config_leaf);
        cmp(
            "globals_root".into(),
            &self.globals_root,
            &other.globals_root,
        );
        cmp("lm_root".into(), &self.lm_root, &other.lm_root);
        for (i, (a, b)) in self.layer_roots.iter().zip(&other.layer_roots).enumerate() {
            cmp(format!("layer {i}"), a, b);
        }
        for (i, a) in &self.expert_roots_by_layer {
            if let Some(b) = other.expert_roots_by_layer.get(i) {
                cmp(format!("layer {i} attn"), &a.attn, &b.attn);
                cmp(format!("layer {i} router"), &a.router, &b.router);
                cmp(format!("layer {i} shared"), &a.shared, &b.shared);
                for (e, (x, y)) in a.experts.iter().zip(&b.experts).enumerate() {
                    cmp(format!("layer {i} expert {e}"), x, y);
                }
            }
        }
        for (i, a) in &self.dense_roots_by_layer {
            if let Some(b) = other.dense_roots_by_layer.get(i) {
                cmp(format!("layer {i} attn"), &a.attn, &b.attn);
                cmp(format!("layer {i} mlp"), &a.mlp, &b.mlp);
            }
        }
        if self.config != other.config {
            d.push(format!(
                "config: spec {}, checkpoint {}",
                self.config.canonical_json().unwrap_or_default(),
                other.config.canonical_json().unwrap_or_default()
            ));
        }
        if self.layer_roots.len() != other.layer_roots.len() {
            d.push(format!(
                "layer count: spec {}, checkpoint {}",
                self.layer_roots.len(),
                other.layer_roots.len()
            ));
        }
        d
    }
}

/// Reads a JSON file, gunzipping it when it starts with the gzip magic `1f 8b`.
///
/// Errors: [`CommitError::Io`], [`CommitError::Spec`] (not JSON).
pub fn read_json(path: &Path) -> Result<serde_json::Value, CommitError> {
    let io = |source| CommitError::Io {
        path: path.to_path_buf(),
        source,
    };
    let raw = std::fs::read(path).map_err(io)?;
    let text = if raw.starts_with(&[0x1f, 0x8b]) {
        let mut s = Vec::new();
        flate2::read::GzDecoder::new(raw.as_slice())
            .read_to_end(&mut s)
            .map_err(io)?;
        s
    } else {
        raw
    };
    serde_json::from_slice(&text).map_err(|e| CommitError::Spec(format!("{}: {e}", path.display())))
}

/// The structure of a spec file (ours or published), for `spec inspect`.
#[derive(Debug, Clone, Serialize)]
pub struct SpecSummary {
    /// `scheme` field, if any.
    pub scheme: Option<String>,
    /// `config.arch`.
    pub arch: Option<String>,
    /// `config.n_layers`.
    pub n_layers: Option<u64>,
    /// `config.n_experts`.
    pub n_experts: Option<u64>,
    /// `quant` (top-level or in config).
    pub quant: Option<String>,
    /// Top-level 64-hex roots present (`model_root`, `lm_root`, …) and their values.
    pub roots: BTreeMap<String, String>,
    /// `layer_roots` length.
    pub n_layer_roots: usize,
    /// Keys of `expert_roots_by_layer` (as found).
    pub moe_layer_keys: Vec<String>,
    /// Fields present in the MoE layer entries (`router`, `bias_leaf`, `shared`, …).
    pub moe_entry_fields: Vec<String>,
    /// Minimum and maximum experts per MoE layer entry.
    pub experts_per_layer: Option<(usize, usize)>,
    /// Whether each `layer_roots[i]` equals `expert_roots_by_layer[i].layer_root` (in key order).
    pub layer_roots_match_entries: bool,
    /// Entries of `router_bias_by_layer` and the byte length of the first.
    pub router_bias: Option<(usize, usize)>,
    /// `partial` flag if present.
    pub partial: Option<bool>,
    /// Whether this tool can recompute the roots (scheme == [`SCHEME`]).
    pub recomputable: bool,
    /// For our scheme: internal inconsistencies found by [`SpecFile::check_internal`].
    pub internal_problems: Option<Vec<String>>,
}

/// Reports the structure of a spec file. Never recomputes roots of an unknown scheme;
/// for scheme [`SCHEME`] it also checks internal consistency.
pub fn inspect(v: &serde_json::Value) -> SpecSummary {
    let cfg = v.get("config");
    let s = |x: Option<&serde_json::Value>| x.and_then(|x| x.as_str()).map(str::to_string);
    let u = |x: Option<&serde_json::Value>| x.and_then(|x| x.as_u64());
    let is_hex64 = |x: &serde_json::Value| {
        x.as_str()
            .is_some_and(|s| s.len() == 64 && s.bytes().all(|b| b.is_ascii_hexdigit()))
    };
    let mut roots = BTreeMap::new();
    if let Some(obj) = v.as_object() {
        for (k, x) in obj {
            if is_hex64(x) {
                roots.insert(k.clone(), x.as_str().unwrap_or_default().to_string());
            }
        }
    }
    let layer_roots: Vec<&str> = v
        .get("layer_roots")
        .and_then(|x| x.as_array())
        .map(|a| a.iter().filter_map(|x| x.as_str()).collect())
        .unwrap_or_default();
    let moe = v.get("expert_roots_by_layer").and_then(|x| x.as_object());
    let mut keys: Vec<String> = moe.map(|m| m.keys().cloned().collect()).unwrap_or_default();
    keys.sort_by_key(|k| (k.parse::<u64>().unwrap_or(u64::MAX), k.clone()));
    let mut fields = std::collections::BTreeSet::new();
    let mut counts = Vec::new();
    let mut entry_roots = Vec::new();
    if let Some(m) = moe {
        for k in &keys {
            if let Some(e) = m.get(k).and_then(|e| e.as_object()) {
                fields.extend(e.keys().cloned());
                counts.push(
                    e.get("experts")
                        .and_then(|x| x.as_array())
                        .map_or(0, |a| a.len()),
                );
                entry_roots.push(e.get("layer_root").and_then(|x| x.as_str()).unwrap_or(""));
            }
        }
    }
    let scheme = s(v.get("scheme"));
    let recomputable = scheme.as_deref() == Some(SCHEME);
    let internal_problems = if recomputable {
        Some(match SpecFile::from_value(v.clone()) {
            Ok(sf) => sf.check_internal(),
            Err(e) => vec![e.to_string()],
        })
    } else {
        None
    };
    // Our files key MoE entries by decoder layer (dense layers elsewhere); published ones
    // list MoE layers only, in order.
    let layer_roots_match_entries = if recomputable {
        keys.iter().zip(&entry_roots).all(|(k, r)| {
            k.parse::<usize>()
                .ok()
                .and_then(|i| layer_roots.get(i))
                .is_some_and(|lr| lr == r)
        })
    } else {
        layer_roots.len() == entry_roots.len()
            && layer_roots.iter().zip(&entry_roots).all(|(a, b)| a == b)
    };
    SpecSummary {
        arch: s(cfg.and_then(|c| c.get("arch"))),
        n_layers: u(cfg.and_then(|c| c.get("n_layers"))),
        n_experts: u(cfg.and_then(|c| c.get("n_experts"))),
        quant: s(v.get("quant")).or_else(|| s(cfg.and_then(|c| c.get("quant")))),
        roots,
        n_layer_roots: layer_roots.len(),
        moe_layer_keys: keys,
        moe_entry_fields: fields.into_iter().collect(),
        experts_per_layer: counts
            .iter()
            .min()
            .copied()
            .zip(counts.iter().max().copied()),
        layer_roots_match_entries,
        router_bias: v
            .get("router_bias_by_layer")
            .and_then(|x| x.as_object())
            .map(|m| {
                let first = m
                    .values()
                    .next()
                    .and_then(|x| x.as_str())
                    .map_or(0, |h| h.len() / 2);
                (m.len(), first)
            }),
        partial: v.get("partial").and_then(|x| x.as_bool()),
        scheme,
        recomputable,
        internal_problems,
    }
}
