//! Merkle weight commitments over safetensors checkpoints, scheme `engy-commit/v1`
//! (specs/SCHEME.md; PROTOCOL.md §4 "published weight commitments").
//!
//! A checkpoint is committed as a tree of SHA-256 hashes:
//!
//! ```text
//! model_root = node(config_leaf, MTH([globals_root, lm_root, layer_root_0, …, layer_root_{L-1}]))
//! layer_root = MTH([attn, mlp])                                   (dense layer)
//!            = MTH([attn, router, shared, expert_0, …, expert_{E-1}])  (MoE layer)
//! unit root  = MTH(tensor leaves of the unit, sorted by tensor name)
//! ```
//!
//! * [`tree`]: leaf/node hashing, MTH and inclusion paths (RFC 6962 / RFC 9162).
//! * [`layout`]: which unit a tensor name belongs to; the canonical config.
//! * [`checkpoint`]: mmap the shards, validate them, hash every tensor in parallel.
//! * [`spec`]: the `model_spec.json(.gz)` file, ours and the published ones.
//! * [`proof`]: opening proofs for one unit (e.g. one routed expert) and their check.
use std::path::PathBuf;

use serde::{Deserialize, Serialize};
use sha2::{Digest as _, Sha256};

pub mod checkpoint;
pub mod layout;
pub mod proof;
pub mod spec;
pub mod tree;

pub use checkpoint::{commit_checkpoint, CommitOptions, Progress, UnitIndex, UnitTensor};
pub use layout::{LayerPart, ModelConfig, UnitId};
pub use proof::{OpeningProof, ProofError};
pub use spec::SpecFile;
pub use tree::Digest;

/// The scheme's version tag, bound into every leaf and into the config leaf.
pub const SCHEME: &str = "engy-commit/v1";
/// Domain tag of a tensor leaf.
pub const TENSOR_TAG: &str = "engy-commit/v1/tensor";
/// Domain tag of the config leaf.
pub const CONFIG_TAG: &str = "engy-commit/v1/config";

/// Largest `n_layers` accepted (guards allocations sized by `config.json`).
pub const MAX_LAYERS: u32 = 1 << 16;
/// Largest `n_experts` accepted (guards allocations sized by `config.json`).
pub const MAX_EXPERTS: u64 = 1 << 20;

/// Errors building or checking a commitment. Every variant names the offending file,
/// tensor or layer.
#[derive(Debug, thiserror::Error)]
pub enum CommitError {
    /// Reading a file failed.
    #[error("{path}: {source}")]
    Io {
        /// The file or directory.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// The checkpoint directory holds no `*.safetensors` file.
    #[error("{0}: no *.safetensors shard in this directory")]
    NoShards(PathBuf),
    /// A shard is not a valid safetensors file (truncated, header offsets that do not tile
    /// the data, bad JSON, …): the safetensors crate's diagnosis.
    #[error("{path}: invalid safetensors shard: {reason}")]
    BadShard {
        /// The shard.
        path: PathBuf,
        /// What is wrong (from the safetensors crate).
        reason: String,
    },
    /// Two shards (or one twice) hold a tensor of the same name.
    #[error("tensor {name:?} appears in both {first} and {second}")]
    DuplicateTensor {
        /// Tensor name.
        name: String,
        /// Shard of the first occurrence.
        first: PathBuf,
        /// Shard of the second occurrence.
        second: PathBuf,
    },
    /// A block-quantised weight has no scale tensor beside it.
    #[error("quantised weight {weight:?} ({dtype}) has no scale tensor {expected}")]
    MissingScale {
        /// The weight tensor.
        weight: String,
        /// Its dtype.
        dtype: String,
        /// The scale name(s) looked for.
        expected: String,
    },
    /// A scale tensor has no weight beside it.
    #[error("scale tensor {name:?} has no weight {weight:?} beside it")]
    OrphanScale {
        /// The scale tensor.
        name: String,
        /// The weight looked for.
        weight: String,
    },
    /// A tensor name this scheme cannot place in a unit.
    #[error("tensor {name:?}: {reason}")]
    UnknownTensor {
        /// Tensor name.
        name: String,
        /// Why.
        reason: String,
    },
    /// A layer's tensors do not form a dense or an MoE layer of the config's shape.
    #[error("layer {layer}: {reason}")]
    BadLayer {
        /// Decoder layer index.
        layer: u32,
        /// What is missing or inconsistent.
        reason: String,
    },
    /// `config.json` is missing, not JSON, or lacks a field.
    #[error("config: {0}")]
    Config(String),
    /// A spec file is malformed.
    #[error("spec: {0}")]
    Spec(String),
    /// A requested unit does not exist in this model.
    #[error("no such unit: {0}")]
    NoSuchUnit(String),
}

/// The committed description of one tensor: its metadata, the SHA-256 of its bytes and
/// its leaf. Everything but the bytes, so an opening proof authenticates the metadata too.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TensorDigest {
    /// Full tensor name as in the checkpoint (or `{name}[{e}]` for a fused-expert slice).
    pub name: String,
    /// safetensors dtype string (`BF16`, `F8_E4M3`, `U8`, …).
    pub dtype: String,
    /// Shape (row-major, as in the header).
    pub shape: Vec<u64>,
    /// Byte length of the raw data.
    pub nbytes: u64,
    /// `SHA-256(data)` (hex in JSON): what `sha256sum` of the raw bytes prints.
    #[serde(with = "hex32")]
    pub sha256: Digest,
    /// The tensor leaf (hex in JSON), see [`tensor_leaf_from_digest`].
    #[serde(with = "hex32")]
    pub leaf: Digest,
}

impl TensorDigest {
    /// Hashes `data` and computes the leaf.
    pub fn of(name: &str, dtype: &str, shape: &[u64], data: &[u8]) -> Self {
        Self::of_progress(name, dtype, shape, data, &mut |_| {})
    }

    /// Like [`Self::of`], reporting each hashed chunk's byte count (16 MiB chunks).
    pub(crate) fn of_progress(
        name: &str,
        dtype: &str,
        shape: &[u64],
        data: &[u8],
        on_chunk: &mut dyn FnMut(u64),
    ) -> Self {
        let mut h = Sha256::new();
        for chunk in data.chunks(16 << 20) {
            h.update(chunk);
            on_chunk(chunk.len() as u64);
        }
        let sha256: Digest = h.finalize().into();
        let nbytes = data.len() as u64;
        Self {
            leaf: tensor_leaf_from_digest(name, dtype, shape, nbytes, &sha256),
            name: name.to_string(),
            dtype: dtype.to_string(),
            shape: shape.to_vec(),
            nbytes,
            sha256,
        }
    }

    /// The leaf this entry's metadata and data digest hash to (equals `leaf` when honest).
    pub fn expected_leaf(&self) -> Digest {
        tensor_leaf_from_digest(
            &self.name,
            &self.dtype,
            &self.shape,
            self.nbytes,
            &self.sha256,
        )
    }
}

/// The tensor leaf (specs/SCHEME.md "Tensor leaf"):
/// `SHA-256(0x00 || lp(TENSOR_TAG) || lp(name) || lp(dtype) || u64le(rank) || u64le(dim)… ||
/// u64le(nbytes) || SHA-256(data))` with `lp(x) = u64le(len(x)) || x`.
pub fn tensor_leaf_from_digest(
    name: &str,
    dtype: &str,
    shape: &[u64],
    nbytes: u64,
    data_sha256: &Digest,
) -> Digest {
    let mut h = Sha256::new();
    h.update([tree::LEAF_PREFIX]);
    tree::update_lp(&mut h, TENSOR_TAG.as_bytes());
    tree::update_lp(&mut h, name.as_bytes());
    tree::update_lp(&mut h, dtype.as_bytes());
    h.update((shape.len() as u64).to_le_bytes());
    for d in shape {
        h.update(d.to_le_bytes());
    }
    h.update(nbytes.to_le_bytes());
    h.update(data_sha256);
    h.finalize().into()
}

/// The tensor leaf of raw bytes: [`tensor_leaf_from_digest`] with `SHA-256(data)`.
pub fn tensor_leaf(name: &str, dtype: &str, shape: &[u64], data: &[u8]) -> Digest {
    TensorDigest::of(name, dtype, shape, data).leaf
}

/// The config leaf: `SHA-256(0x00 || lp(CONFIG_TAG) || lp(canonical_json))`.
pub fn config_leaf(config: &ModelConfig) -> Result<Digest, CommitError> {
    let json = config.canonical_json()?;
    let mut h = Sha256::new();
    h.update([tree::LEAF_PREFIX]);
    tree::update_lp(&mut h, CONFIG_TAG.as_bytes());
    tree::update_lp(&mut h, json.as_bytes());
    Ok(h.finalize().into())
}

/// A unit: its tensors sorted by name (bytewise) and their MTH.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Unit {
    /// Tensors, sorted by name.
    pub tensors: Vec<TensorDigest>,
    /// `MTH(leaves)`; `SHA-256("")` when empty.
    pub root: Digest,
}

impl Unit {
    /// Sorts the tensors by name and computes the root.
    pub fn new(mut tensors: Vec<TensorDigest>) -> Self {
        tensors.sort_by(|a, b| a.name.as_bytes().cmp(b.name.as_bytes()));
        let leaves: Vec<Digest> = tensors.iter().map(|t| t.leaf).collect();
        Self {
            root: tree::mth(&leaves),
            tensors,
        }
    }
}

/// The units of one decoder layer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LayerBody {
    /// A dense layer: `[attn, mlp]`.
    Dense {
        /// Attention + norms.
        attn: Unit,
        /// Dense FFN.
        mlp: Unit,
    },
    /// An MoE layer: `[attn, router, shared, expert_0 … expert_{E-1}]`.
    Moe {
        /// Attention + norms.
        attn: Unit,
        /// Router (+ GLM `e_score_correction_bias`).
        router: Unit,
        /// Shared expert (empty unit when the model has none).
        shared: Unit,
        /// Routed experts, by index.
        experts: Vec<Unit>,
        /// Raw little-endian bytes of `mlp.gate.e_score_correction_bias` when present.
        router_bias: Option<Vec<u8>>,
    },
}

impl LayerBody {
    /// The layer's units in tree order.
    pub fn units(&self) -> Vec<&Unit> {
        match self {
            LayerBody::Dense { attn, mlp } => vec![attn, mlp],
            LayerBody::Moe {
                attn,
                router,
                shared,
                experts,
                ..
            } => {
                let mut v = vec![attn, router, shared];
                v.extend(experts.iter());
                v
            }
        }
    }

    /// Position of `part` in [`Self::units`], if this layer has it.
    pub fn index_of(&self, part: LayerPart) -> Option<usize> {
        match (self, part) {
            (_, LayerPart::Attn) => Some(0),
            (LayerBody::Dense { .. }, LayerPart::Mlp) => Some(1),
            (LayerBody::Moe { .. }, LayerPart::Router) => Some(1),
            (LayerBody::Moe { .. }, LayerPart::Shared) => Some(2),
            (LayerBody::Moe { experts, .. }, LayerPart::Expert(e))
                if (e as usize) < experts.len() =>
            {
                Some(3 + e as usize)
            }
            _ => None,
        }
    }
}

/// One decoder layer and its root.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Layer {
    /// The units.
    pub body: LayerBody,
    /// `MTH(unit roots)`.
    pub root: Digest,
}

/// A whole checkpoint's commitment.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Commitment {
    /// The canonical config.
    pub config: ModelConfig,
    /// [`config_leaf`] of it.
    pub config_leaf: Digest,
    /// Embeddings, final norm, MTP and other tensors outside the decoder stack.
    pub globals: Unit,
    /// `lm_head.*`.
    pub lm: Unit,
    /// Decoder layers `0..n_layers`.
    pub layers: Vec<Layer>,
    /// `MTH([globals, lm, layer roots…])`.
    pub body_root: Digest,
    /// `node(config_leaf, body_root)`.
    pub model_root: Digest,
    /// Tensors committed.
    pub n_tensors: u64,
    /// Raw tensor bytes committed.
    pub n_bytes: u64,
}

/// Index of a layer's root among the body leaves.
pub(crate) const fn body_index_of_layer(layer: u32) -> u64 {
    2 + layer as u64
}

impl Commitment {
    /// Groups hashed tensors into units and layers and computes every root.
    ///
    /// `router_biases` maps layer → raw bytes of its `e_score_correction_bias`.
    /// Errors: [`CommitError::UnknownTensor`], [`CommitError::BadLayer`] (missing layer,
    /// dense and MoE tensors mixed, missing router or expert, expert index ≥ `n_experts`).
    pub fn from_tensors(
        config: ModelConfig,
        tensors: Vec<TensorDigest>,
        mut router_biases: std::collections::BTreeMap<u32, Vec<u8>>,
    ) -> Result<Self, CommitError> {
        let n_layers = u32::try_from(config.n_layers)
            .ok()
            .filter(|n| *n <= MAX_LAYERS)
            .ok_or_else(|| {
                CommitError::Config(format!("n_layers {} too large", config.n_layers))
            })?;
        let n_experts = usize::try_from(config.n_experts)
            .ok()
            .filter(|n| *n as u64 <= MAX_EXPERTS)
            .ok_or_else(|| {
                CommitError::Config(format!("n_experts {} too large", config.n_experts))
            })?;
        let n_tensors = tensors.len() as u64;
        let n_bytes = tensors.iter().map(|t| t.nbytes).sum();
        let mut globals = Vec::new();
        let mut lm = Vec::new();
        #[derive(Default)]
        struct Parts {
            attn: Vec<TensorDigest>,
            mlp: Vec<TensorDigest>,
            router: Vec<TensorDigest>,
            shared: Vec<TensorDigest>,
            experts: std::collections::BTreeMap<u32, Vec<TensorDigest>>,
        }
        let mut layers: Vec<Parts> = (0..n_layers).map(|_| Parts::default()).collect();
        for t in tensors {
            match layout::classify(&t.name, n_layers)? {
                UnitId::Globals => globals.push(t),
                UnitId::Lm => lm.push(t),
                UnitId::Layer { layer, part } => {
                    let p =
                        layers
                            .get_mut(layer as usize)
                            .ok_or_else(|| CommitError::BadLayer {
                                layer,
                                reason: "index out of range".into(),
                            })?;
                    match part {
                        LayerPart::Attn => p.attn.push(t),
                        LayerPart::Mlp => p.mlp.push(t),
                        LayerPart::Router => p.router.push(t),
                        LayerPart::Shared => p.shared.push(t),
                        LayerPart::Expert(e) => {
                            if e as usize >= n_experts {
                                return Err(CommitError::BadLayer {
                                    layer,
                                    reason: format!(
                                        "tensor {:?} names expert {e} but the config has {n_experts} experts",
                                        t.name
                                    ),
                                });
                            }
                            p.experts.entry(e).or_default().push(t)
                        }
                    }
                }
            }
        }
        let mut out_layers = Vec::with_capacity(layers.len());
        for (i, p) in layers.into_iter().enumerate() {
            let layer = i as u32;
            let bad = |reason: String| CommitError::BadLayer { layer, reason };
            let moe = !p.router.is_empty() || !p.shared.is_empty() || !p.experts.is_empty();
            if p.attn.is_empty() && p.mlp.is_empty() && !moe {
                return Err(bad("no tensors (missing from every shard)".into()));
            }
            let body = if moe {
                if !p.mlp.is_empty() {
                    return Err(bad("has both dense FFN (mlp.*_proj) and MoE tensors".into()));
                }
                if p.router.is_empty() {
                    return Err(bad("MoE layer without router (mlp.gate.weight)".into()));
                }
                if let Some(missing) = (0..n_experts as u32).find(|e| !p.experts.contains_key(e)) {
                    return Err(bad(format!(
                        "MoE layer lacks expert {missing} (config has {n_experts} experts)"
                    )));
                }
                LayerBody::Moe {
                    attn: Unit::new(p.attn),
                    router: Unit::new(p.router),
                    shared: Unit::new(p.shared),
                    experts: p.experts.into_values().map(Unit::new).collect(),
                    router_bias: router_biases.remove(&layer),
                }
            } else {
                if p.mlp.is_empty() {
                    return Err(bad("no MLP tensors (neither mlp.*_proj nor MoE)".into()));
                }
                LayerBody::Dense {
                    attn: Unit::new(p.attn),
                    mlp: Unit::new(p.mlp),
                }
            };
            let roots: Vec<Digest> = body.units().iter().map(|u| u.root).collect();
            out_layers.push(Layer {
                root: tree::mth(&roots),
                body,
            });
        }
        let globals = Unit::new(globals);
        let lm = Unit::new(lm);
        let config_leaf = config_leaf(&config)?;
        let body_root = tree::mth(&Self::body_leaves(&globals, &lm, &out_layers));
        Ok(Self {
            model_root: tree::node(&config_leaf, &body_root),
            config,
            config_leaf,
            globals,
            lm,
            layers: out_layers,
            body_root,
            n_tensors,
            n_bytes,
        })
    }

    fn body_leaves(globals: &Unit, lm: &Unit, layers: &[Layer]) -> Vec<Digest> {
        let mut v = vec![globals.root, lm.root];
        v.extend(layers.iter().map(|l| l.root));
        v
    }

    /// The unit `id`, if this model has it.
    pub fn unit(&self, id: UnitId) -> Option<&Unit> {
        match id {
            UnitId::Globals => Some(&self.globals),
            UnitId::Lm => Some(&self.lm),
            UnitId::Layer { layer, part } => {
                let l = self.layers.get(layer as usize)?;
                let i = l.body.index_of(part)?;
                l.body.units().get(i).copied()
            }
        }
    }
}

/// Lowercase-hex serde for [`Digest`].
pub(crate) mod hex32 {
    use super::Digest;
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(d: &Digest, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&hex::encode(d))
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Digest, D::Error> {
        let s = String::deserialize(d)?;
        parse(&s).map_err(serde::de::Error::custom)
    }

    /// Parses 64 lowercase or uppercase hex characters.
    pub fn parse(s: &str) -> Result<Digest, String> {
        let mut out = [0u8; 32];
        hex::decode_to_slice(s, &mut out).map_err(|e| format!("{s:?} is not 64 hex chars: {e}"))?;
        Ok(out)
    }
}

/// Parses a 64-hex-character digest.
///
/// Errors: a message naming the bad input.
pub fn parse_digest(s: &str) -> Result<Digest, CommitError> {
    hex32::parse(s).map_err(CommitError::Spec)
}
