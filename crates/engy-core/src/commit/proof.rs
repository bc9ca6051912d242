//! Opening proofs: one unit's tensor digests (e.g. one routed expert) and the sibling
//! paths from its unit root to `model_root`, checkable without the checkpoint
//! (specs/SCHEME.md "Opening proof").
use serde::{Deserialize, Serialize};

use super::layout::{self, LayerPart, ModelConfig, UnitId};
use super::spec::{Hex, SpecFile};
use super::{
    body_index_of_layer, config_leaf, tree, CommitError, Commitment, Digest, TensorDigest, SCHEME,
};

/// `kind` field of an opening proof.
pub const OPENING_KIND: &str = "engy-commit-opening";

/// Why an opening proof was rejected. Each variant says at which level it failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ProofError {
    /// The proof is not well formed (wrong scheme/kind, positions that do not match the
    /// config, a path of the wrong length, unsorted tensors, a tensor of another unit).
    #[error("malformed opening proof: {0}")]
    Malformed(String),
    /// A tensor entry's leaf is not the hash of its name, dtype, shape, length and data digest.
    #[error("tensor {name:?}: metadata and sha256 hash to leaf {computed}, proof has {claimed}")]
    TensorLeafMismatch {
        /// Tensor name.
        name: String,
        /// Leaf in the proof.
        claimed: Hex,
        /// Leaf of the entry's metadata and data digest.
        computed: Hex,
    },
    /// The tensor digests do not hash to the claimed unit root.
    #[error("unit root mismatch: tensors hash to {computed}, proof claims {claimed}")]
    UnitRootMismatch {
        /// Claimed in the proof.
        claimed: Hex,
        /// Recomputed.
        computed: Hex,
    },
    /// The unit root and layer path do not give the claimed layer root.
    #[error("layer root mismatch: path gives {computed}, proof claims {claimed}")]
    LayerRootMismatch {
        /// Claimed in the proof.
        claimed: Hex,
        /// Recomputed.
        computed: Hex,
    },
    /// The layer (or globals/lm) root and body path do not give the claimed body root.
    #[error("body root mismatch: path gives {computed}, proof claims {claimed}")]
    BodyRootMismatch {
        /// Claimed in the proof.
        claimed: Hex,
        /// Recomputed.
        computed: Hex,
    },
    /// `node(config_leaf(config), body_root)` is not the claimed model root.
    #[error("model root mismatch: config + body give {computed}, proof claims {claimed}")]
    ModelRootMismatch {
        /// Claimed in the proof.
        claimed: Hex,
        /// Recomputed.
        computed: Hex,
    },
    /// The proof is internally consistent but proves membership in another model.
    #[error("proof is for model_root {computed}, not the trusted {trusted}")]
    UntrustedRoot {
        /// The root the verifier trusts (spec file / gateway).
        trusted: Hex,
        /// The root the proof leads to.
        computed: Hex,
    },
    /// Tensor bytes presented for checking do not match the proof's entry.
    #[error("tensor {name:?}: {what}")]
    TensorMismatch {
        /// Tensor name.
        name: String,
        /// What differs.
        what: String,
    },
}

/// Which unit a proof opens, as flat JSON (`{"layer":3,"part":"expert","expert":5}`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct UnitRef {
    /// Decoder layer (absent for `globals` / `lm`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub layer: Option<u32>,
    /// `globals`, `lm`, `attn`, `mlp`, `router`, `shared` or `expert`.
    pub part: PartName,
    /// Routed expert index (only for `expert`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expert: Option<u32>,
}

/// Part names of [`UnitRef`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
#[allow(missing_docs)]
pub enum PartName {
    Globals,
    Lm,
    Attn,
    Mlp,
    Router,
    Shared,
    Expert,
}

impl From<UnitId> for UnitRef {
    fn from(u: UnitId) -> Self {
        let (layer, part, expert) = match u {
            UnitId::Globals => (None, PartName::Globals, None),
            UnitId::Lm => (None, PartName::Lm, None),
            UnitId::Layer { layer, part } => match part {
                LayerPart::Attn => (Some(layer), PartName::Attn, None),
                LayerPart::Mlp => (Some(layer), PartName::Mlp, None),
                LayerPart::Router => (Some(layer), PartName::Router, None),
                LayerPart::Shared => (Some(layer), PartName::Shared, None),
                LayerPart::Expert(e) => (Some(layer), PartName::Expert, Some(e)),
            },
        };
        Self {
            layer,
            part,
            expert,
        }
    }
}

impl TryFrom<UnitRef> for UnitId {
    type Error = ProofError;
    fn try_from(r: UnitRef) -> Result<Self, ProofError> {
        let bad = || ProofError::Malformed(format!("unit {r:?} is not a valid unit"));
        let part = match (r.part, r.layer, r.expert) {
            (PartName::Globals, None, None) => return Ok(UnitId::Globals),
            (PartName::Lm, None, None) => return Ok(UnitId::Lm),
            (PartName::Attn, Some(_), None) => LayerPart::Attn,
            (PartName::Mlp, Some(_), None) => LayerPart::Mlp,
            (PartName::Router, Some(_), None) => LayerPart::Router,
            (PartName::Shared, Some(_), None) => LayerPart::Shared,
            (PartName::Expert, Some(_), Some(e)) => LayerPart::Expert(e),
            _ => return Err(bad()),
        };
        Ok(UnitId::Layer {
            layer: r.layer.ok_or_else(bad)?,
            part,
        })
    }
}

/// Dense or MoE (decides the layer tree's size and unit positions).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LayerKind {
    /// `[attn, mlp]`.
    Dense,
    /// `[attn, router, shared, expert_0 …]`.
    Moe,
}

/// One level of the proof: the position of a node among `size` leaves, its audit path
/// (siblings bottom-up, RFC 9162 §2.1.3) and the root it leads to.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PathLevel {
    /// Leaf index.
    pub index: u64,
    /// Number of leaves.
    pub size: u64,
    /// Audit path, bottom-up.
    pub path: Vec<Hex>,
    /// The root this level leads to.
    pub root: Hex,
}

/// The layer level of a proof.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LayerLevel {
    /// Dense or MoE.
    pub kind: LayerKind,
    /// Position among the layer's units.
    #[serde(flatten)]
    pub level: PathLevel,
}

/// An opening proof (JSON, specs/SCHEME.md "Opening proof").
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct OpeningProof {
    /// Always [`OPENING_KIND`].
    pub kind: String,
    /// Always [`SCHEME`].
    pub scheme: String,
    /// The canonical config (its leaf is the left child of `model_root`).
    pub config: ModelConfig,
    /// The opened unit.
    pub unit: UnitRef,
    /// The unit's tensors, sorted by name, with their leaves.
    pub tensors: Vec<TensorDigest>,
    /// `MTH(leaves)`.
    pub unit_root: Hex,
    /// Unit → layer root (absent for `globals` / `lm`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub layer: Option<LayerLevel>,
    /// Layer (or globals/lm) root → body root.
    pub body: PathLevel,
    /// `node(config_leaf, body.root)`.
    pub model_root: Hex,
}

fn level(items: &[Digest], index: usize) -> Result<PathLevel, CommitError> {
    let path = tree::inclusion_path(items, index)
        .ok_or_else(|| CommitError::NoSuchUnit(format!("index {index} of {}", items.len())))?;
    Ok(PathLevel {
        index: index as u64,
        size: items.len() as u64,
        path: path.into_iter().map(Hex).collect(),
        root: Hex(tree::mth(items)),
    })
}

fn build(
    config: &ModelConfig,
    unit: UnitId,
    tensors: Vec<TensorDigest>,
    layer_units: Option<(LayerKind, Vec<Digest>, usize)>,
    body_leaves: &[Digest],
    body_index: usize,
) -> Result<OpeningProof, CommitError> {
    let leaves: Vec<Digest> = tensors.iter().map(|t| t.leaf).collect();
    let unit_root = tree::mth(&leaves);
    let layer = match layer_units {
        Some((kind, units, idx)) => {
            if units.get(idx) != Some(&unit_root) {
                return Err(CommitError::Spec(format!(
                    "{unit}: the checkpoint's unit root {} differs from the spec's",
                    hex::encode(unit_root)
                )));
            }
            Some(LayerLevel {
                kind,
                level: level(&units, idx)?,
            })
        }
        None => None,
    };
    let body = level(body_leaves, body_index)?;
    let cl = config_leaf(config)?;
    Ok(OpeningProof {
        kind: OPENING_KIND.to_string(),
        scheme: SCHEME.to_string(),
        config: config.clone(),
        unit: unit.into(),
        tensors,
        unit_root: Hex(unit_root),
        layer,
        model_root: Hex(tree::node(&cl, &body.root.0)),
        body,
    })
}

impl Commitment {
    /// The opening proof of `unit`.
    ///
    /// Errors: [`CommitError::NoSuchUnit`] when the model has no such unit (e.g. an expert
    /// index ≥ `n_experts`, or `router` of a dense layer).
    pub fn open(&self, unit: UnitId) -> Result<OpeningProof, CommitError> {
        let u = self
            .unit(unit)
            .ok_or_else(|| CommitError::NoSuchUnit(unit.to_string()))?;
        let mut body = vec![self.globals.root, self.lm.root];
        body.extend(self.layers.iter().map(|l| l.root));
        let (layer_units, body_index) = match unit {
            UnitId::Globals => (None, 0),
            UnitId::Lm => (None, 1),
            UnitId::Layer { layer, part } => {
                let l = self
                    .layers
                    .get(layer as usize)
                    .ok_or_else(|| CommitError::NoSuchUnit(unit.to_string()))?;
                let idx = l
                    .body
                    .index_of(part)
                    .ok_or_else(|| CommitError::NoSuchUnit(unit.to_string()))?;
                let kind = match l.body {
                    super::LayerBody::Dense { .. } => LayerKind::Dense,
                    super::LayerBody::Moe { .. } => LayerKind::Moe,
                };
                let roots = l.body.units().iter().map(|u| u.root).collect();
                (
                    Some((kind, roots, idx)),
                    body_index_of_layer(layer) as usize,
                )
            }
        };
        build(
            &self.config,
            unit,
            u.tensors.clone(),
            layer_units,
            &body,
            body_index,
        )
    }
}

impl SpecFile {
    /// The opening proof of `unit` from this spec's sibling roots and the unit's own
    /// tensor digests (hashed from the checkpoint by the caller), without rehashing the
    /// rest of the checkpoint.
    ///
    /// Errors: [`CommitError::NoSuchUnit`]; [`CommitError::Spec`] when the tensors'
    /// root is not the spec's root of that unit (the checkpoint differs from the spec).
    pub fn open(
        &self,
        unit: UnitId,
        tensors: Vec<TensorDigest>,
    ) -> Result<OpeningProof, CommitError> {
        let mut body = vec![self.globals_root.0, self.lm_root.0];
        body.extend(self.layer_roots.iter().map(|h| h.0));
        let none = || CommitError::NoSuchUnit(unit.to_string());
        let leaves: Vec<Digest> = tensors.iter().map(|t| t.leaf).collect();
        let unit_root = tree::mth(&leaves);
        let (layer_units, body_index) = match unit {
            UnitId::Globals | UnitId::Lm => {
                let (want, i) = if unit == UnitId::Globals {
                    (self.globals_root.0, 0)
                } else {
                    (self.lm_root.0, 1)
                };
                if want != unit_root {
                    return Err(CommitError::Spec(format!(
                        "{unit}: the checkpoint's unit root {} differs from the spec's",
                        hex::encode(unit_root)
                    )));
                }
                (None, i)
            }
            UnitId::Layer { layer, part } => {
                let (kind, units) = if let Some(m) = self.expert_roots_by_layer.get(&layer) {
                    let mut v = vec![m.attn.0, m.router.0, m.shared.0];
                    v.extend(m.experts.iter().map(|e| e.0));
                    (LayerKind::Moe, v)
                } else if let Some(d) = self.dense_roots_by_layer.get(&layer) {
                    (LayerKind::Dense, vec![d.attn.0, d.mlp.0])
                } else {
                    return Err(none());
                };
                let idx = match (kind, part) {
                    (_, LayerPart::Attn) => 0,
                    (LayerKind::Dense, LayerPart::Mlp) | (LayerKind::Moe, LayerPart::Router) => 1,
                    (LayerKind::Moe, LayerPart::Shared) => 2,
                    (LayerKind::Moe, LayerPart::Expert(e)) if (e as usize) + 3 < units.len() => {
                        3 + e as usize
                    }
                    _ => return Err(none()),
                };
                (
                    Some((kind, units, idx)),
                    body_index_of_layer(layer) as usize,
                )
            }
        };
        build(&self.config, unit, tensors, layer_units, &body, body_index)
    }
}

impl OpeningProof {
    /// Verifies the proof against a trusted `model_root` (from a spec file or the
    /// gateway), without the checkpoint. Checks, in order: scheme and kind; that the
    /// positions and tree sizes are those the config implies for the unit; that the
    /// tensors are sorted, unique and all belong to the unit; then unit root, layer root,
    /// body root, model root, and finally the trusted root.
    ///
    /// Errors: the first [`ProofError`] met, naming the level that failed.
    pub fn verify(&self, trusted_root: &Digest) -> Result<(), ProofError> {
        let bad = |m: String| Err(ProofError::Malformed(m));
        if self.kind != OPENING_KIND || self.scheme != SCHEME {
            return bad(format!(
                "kind {:?} / scheme {:?}, want {OPENING_KIND:?} / {SCHEME:?}",
                self.kind, self.scheme
            ));
        }
        let cl = config_leaf(&self.config).map_err(|e| ProofError::Malformed(e.to_string()))?;
        let unit = UnitId::try_from(self.unit)?;
        let n_layers = self.config.n_layers;
        let n_experts = self.config.n_experts;
        let want_body_index = match unit {
            UnitId::Globals => 0,
            UnitId::Lm => 1,
            UnitId::Layer { layer, .. } => {
                if u64::from(layer) >= n_layers {
                    return bad(format!("layer {layer} ≥ n_layers {n_layers}"));
                }
                body_index_of_layer(layer)
            }
        };
        if self.body.index != want_body_index || self.body.size != n_layers.saturating_add(2) {
            return bad(format!(
                "body position {}/{} does not match {unit} in a {n_layers}-layer model",
                self.body.index, self.body.size
            ));
        }
        // Tensors: strictly sorted by name, each of this unit.
        let n_layers_u32 = u32::try_from(n_layers).unwrap_or(u32::MAX);
        for w in self.tensors.windows(2) {
            if let [a, b] = w {
                if a.name.as_bytes() >= b.name.as_bytes() {
                    return bad(format!("tensors not strictly sorted at {:?}", b.name));
                }
            }
        }
        for t in &self.tensors {
            match layout::classify(&t.name, n_layers_u32) {
                Ok(u) if u == unit => {}
                Ok(u) => return bad(format!("tensor {:?} belongs to {u}, not {unit}", t.name)),
                Err(e) => return bad(e.to_string()),
            }
        }
        // Each leaf must hash its entry's metadata and data digest.
        for t in &self.tensors {
            let want = t.expected_leaf();
            if want != t.leaf {
                return Err(ProofError::TensorLeafMismatch {
                    name: t.name.clone(),
                    claimed: Hex(t.leaf),
                    computed: Hex(want),
                });
            }
        }
        let leaves: Vec<Digest> = self.tensors.iter().map(|t| t.leaf).collect();
        let unit_root = tree::mth(&leaves);
        if unit_root != self.unit_root.0 {
            return Err(ProofError::UnitRootMismatch {
                claimed: self.unit_root,
                computed: Hex(unit_root),
            });
        }
        let body_leaf = match (unit, &self.layer) {
            (UnitId::Globals | UnitId::Lm, None) => unit_root,
            (UnitId::Layer { part, .. }, Some(l)) => {
                let (want_index, want_size) = match (l.kind, part) {
                    (LayerKind::Dense, LayerPart::Attn) => (0, 2),
                    (LayerKind::Dense, LayerPart::Mlp) => (1, 2),
                    (LayerKind::Moe, _) if n_experts == 0 => {
                        return bad("MoE layer in a config with n_experts 0".into())
                    }
                    (LayerKind::Moe, LayerPart::Attn) => (0, n_experts.saturating_add(3)),
                    (LayerKind::Moe, LayerPart::Router) => (1, n_experts.saturating_add(3)),
                    (LayerKind::Moe, LayerPart::Shared) => (2, n_experts.saturating_add(3)),
                    (LayerKind::Moe, LayerPart::Expert(e)) if u64::from(e) < n_experts => {
                        (u64::from(e) + 3, n_experts.saturating_add(3))
                    }
                    (k, p) => {
                        return bad(format!(
                            "{p:?} is not a unit of a {k:?} layer of this config"
                        ))
                    }
                };
                if l.level.index != want_index || l.level.size != want_size {
                    return bad(format!(
                        "layer position {}/{} does not match {unit} (want {want_index}/{want_size})",
                        l.level.index, l.level.size
                    ));
                }
                let path: Vec<Digest> = l.level.path.iter().map(|h| h.0).collect();
                let r = tree::root_from_path(&unit_root, l.level.index, l.level.size, &path)
                    .ok_or_else(|| {
                        ProofError::Malformed(format!(
                            "layer path has {} siblings, wrong for index {} of {}",
                            path.len(),
                            l.level.index,
                            l.level.size
                        ))
                    })?;
                if r != l.level.root.0 {
                    return Err(ProofError::LayerRootMismatch {
                        claimed: l.level.root,
                        computed: Hex(r),
                    });
                }
                r
            }
            _ => return bad(format!("{unit}: layer level present/absent wrongly")),
        };
        let path: Vec<Digest> = self.body.path.iter().map(|h| h.0).collect();
        let body = tree::root_from_path(&body_leaf, self.body.index, self.body.size, &path)
            .ok_or_else(|| {
                ProofError::Malformed(format!(
                    "body path has {} siblings, wrong for index {} of {}",
                    path.len(),
                    self.body.index,
                    self.body.size
                ))
            })?;
        if body != self.body.root.0 {
            return Err(ProofError::BodyRootMismatch {
                claimed: self.body.root,
                computed: Hex(body),
            });
        }
        let model = tree::node(&cl, &body);
        if model != self.model_root.0 {
            return Err(ProofError::ModelRootMismatch {
                claimed: self.model_root,
                computed: Hex(model),
            });
        }
        if &model != trusted_root {
            return Err(ProofError::UntrustedRoot {
                trusted: Hex(*trusted_root),
                computed: Hex(model),
            });
        }
        Ok(())
    }

    /// Checks one tensor's bytes (e.g. an auditor's copy of this expert) against the
    /// proof's entry: same dtype and shape, and `SHA-256(data)` equal to its `sha256`.
    /// Call after [`Self::verify`], which authenticates the entries.
    ///
    /// Errors: [`ProofError::Malformed`] when the proof has no tensor of that name,
    /// [`ProofError::TensorMismatch`] when the dtype, shape or bytes differ.
    pub fn check_tensor(
        &self,
        name: &str,
        dtype: &str,
        shape: &[u64],
        data: &[u8],
    ) -> Result<(), ProofError> {
        let t = self
            .tensors
            .iter()
            .find(|t| t.name == name)
            .ok_or_else(|| ProofError::Malformed(format!("no tensor {name:?} in the proof")))?;
        let got = TensorDigest::of(name, dtype, shape, data);
        if got.leaf != t.leaf {
            let what = if dtype != t.dtype || shape != t.shape.as_slice() {
                format!(
                    "dtype/shape {dtype} {shape:?}, proof has {} {:?}",
                    t.dtype, t.shape
                )
            } else {
                format!(
                    "bytes hash to sha256 {}, proof has {}",
                    Hex(got.sha256),
                    Hex(t.sha256)
                )
            };
            return Err(ProofError::TensorMismatch {
                name: name.to_string(),
                what,
            });
        }
        Ok(())
    }
}
