//! The weights a cell touches, checked against the checkpoint's committed `engy-commit/v1`
//! `model_root` (specs/SCHEME.md §6; issue 23 B3) before the cell's numbers are trusted.
//!
//! A cell at MoE layer `l` with routed experts `E` touches three kinds of commitment unit:
//! `layer l router`, `layer l shared` and `layer l expert e` for each `e ∈ E`.
//! [`CommittedWeights::check_cell`] reads exactly those units' bytes from the mmapped shards
//! (an [`engy_core::commit::UnitIndex`]: headers only at open), and for each unit
//!
//! * with opening proofs ([`Openings::Proofs`], as `spec open` writes them): verifies the
//!   unit's proof against the trusted root ([`OpeningProof::verify`]), requires the checkpoint's
//!   tensors of the unit to be exactly the proof's, and each one's dtype, shape and bytes to
//!   match its entry ([`OpeningProof::check_tensor`]), so a mismatch names the tensor;
//! * with a spec file ([`Openings::Spec`]): hashes the unit's tensors, builds the proof from the
//!   spec's sibling roots ([`SpecFile::open`]) and verifies it against the trusted root, so a
//!   mismatch names the unit (a spec holds unit roots, not tensor digests).
//!
//! A unit is checked once and remembered; every other unit is never read, so checking a cell
//! of a 35B model reads megabytes (the router, `top_k` experts and the shared expert of one
//! layer). [`CommittedWeights::units_read`] and [`CommittedWeights::bytes_read`] count what was
//! read.
//!
//! The recompute ([`super::verify_cell`]) reads the same shard files through the model's own
//! mapping; like every safetensors loader it requires the checkpoint not to change while it
//! runs.
use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

use engy_core::cells::Cell;
use engy_core::commit::checkpoint::read_config;
use engy_core::commit::spec::Hex;
use engy_core::commit::{
    CommitError, CommitOptions, Digest, LayerPart, ModelConfig, OpeningProof, ProofError, SpecFile,
    TensorDigest, UnitId, UnitIndex,
};

/// Why a touched unit's weights could not be trusted.
#[derive(Debug, thiserror::Error)]
pub enum WeightCheckError {
    /// The checkpoint's shards or `config.json` could not be read or indexed.
    #[error("checkpoint: {0}")]
    Checkpoint(#[from] CommitError),
    /// An opening proof file could not be read or parsed.
    #[error("opening proof {path}: {reason}")]
    ProofFile {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// No opening proof at all, or one that names no valid unit.
    #[error("opening proofs: {0}")]
    BadProofs(String),
    /// Two opening proofs of one unit.
    #[error("{unit}: two opening proofs")]
    DuplicateProof {
        /// The unit.
        unit: UnitId,
    },
    /// No opening proof of a unit the cell touches.
    #[error("{unit}: no opening proof for this unit")]
    NoProof {
        /// The unit.
        unit: UnitId,
    },
    /// The unit's opening proof (or the spec file's) does not lead to the trusted root.
    #[error("{unit}: opening proof rejected: {source}")]
    Proof {
        /// The unit.
        unit: UnitId,
        /// The failing level.
        #[source]
        source: ProofError,
    },
    /// A tensor of the unit in the checkpoint differs from the committed one (bytes, dtype,
    /// shape), or is in only one of the two.
    #[error("{unit}: tensor {name:?}: {what}")]
    Tensor {
        /// The unit.
        unit: UnitId,
        /// The tensor (a fused expert slice by its virtual name `{name}[{e}]`).
        name: String,
        /// What differs.
        what: String,
    },
    /// The unit's tensors hash to another unit root than the spec file's.
    #[error("{unit}: the checkpoint's tensors of this unit differ from the committed unit root ({reason})")]
    UnitRoot {
        /// The unit.
        unit: UnitId,
        /// The spec's diagnosis.
        reason: String,
    },
    /// The checkpoint's `config.json` is not the committed config.
    #[error("config.json gives {checkpoint}, the committed config is {committed}")]
    Config {
        /// Canonical config from `config.json`.
        checkpoint: String,
        /// Canonical config the root commits.
        committed: String,
    },
}

/// Where the committed unit digests come from.
#[derive(Debug, Clone)]
pub enum Openings {
    /// Opening proofs by unit (`spec open` output).
    Proofs(HashMap<UnitId, OpeningProof>),
    /// A spec file (`model_spec.json.gz`) of the scheme: every unit's root.
    Spec(Box<SpecFile>),
}

impl Openings {
    /// Opening proofs keyed by their unit.
    ///
    /// # Errors
    /// [`WeightCheckError::BadProofs`] for a proof naming no valid unit,
    /// [`WeightCheckError::DuplicateProof`].
    pub fn from_proofs(
        proofs: impl IntoIterator<Item = OpeningProof>,
    ) -> Result<Self, WeightCheckError> {
        let mut map = HashMap::new();
        for p in proofs {
            let unit =
                UnitId::try_from(p.unit).map_err(|e| WeightCheckError::BadProofs(e.to_string()))?;
            if map.insert(unit, p).is_some() {
                return Err(WeightCheckError::DuplicateProof { unit });
            }
        }
        Ok(Self::Proofs(map))
    }

    /// Every `*.json` file directly in `dir`, each one opening proof.
    ///
    /// # Errors
    /// [`WeightCheckError::ProofFile`] for an unreadable directory or file, or one that is not
    /// an opening proof; those of [`Openings::from_proofs`].
    pub fn read_dir(dir: &Path) -> Result<Self, WeightCheckError> {
        let bad = |path: &Path, reason: String| WeightCheckError::ProofFile {
            path: path.to_path_buf(),
            reason,
        };
        let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
            .map_err(|e| bad(dir, e.to_string()))?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|x| x == "json"))
            .collect();
        files.sort();
        let mut proofs = Vec::with_capacity(files.len());
        for f in files {
            let text = std::fs::read(&f).map_err(|e| bad(&f, e.to_string()))?;
            proofs.push(serde_json::from_slice(&text).map_err(|e| bad(&f, e.to_string()))?);
        }
        Self::from_proofs(proofs)
    }
}

/// A checkpoint whose touched units are checked against a trusted `model_root` (module docs).
pub struct CommittedWeights {
    root: Digest,
    config: ModelConfig,
    index: UnitIndex,
    openings: Openings,
    checked: Mutex<HashSet<UnitId>>,
    units_read: AtomicU64,
    bytes_read: AtomicU64,
}

impl std::fmt::Debug for CommittedWeights {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CommittedWeights")
            .field("root", &Hex(self.root))
            .field("index", &self.index)
            .field("units_read", &self.units_read())
            .finish()
    }
}

impl CommittedWeights {
    /// Indexes the checkpoint in `dir` (headers only) for checks against `trusted_root`.
    /// The committed config is taken from the openings and authenticated against the root
    /// first (one proof verified, or the spec's root compared); `config.json` must give the
    /// same config (its `arch` and `quant` as committed). When the commitment binds the whole
    /// file ([`ModelConfig::config_sha256`]), `config.json` must be those bytes exactly, so
    /// every field the recompute reads (`norm_topk_prob`, `routed_scaling_factor`, `n_group`,
    /// `topk_group`, …) is the committed one ([`Self::config_bound`]); without it only the ten
    /// canonical keys are.
    ///
    /// # Errors
    /// [`WeightCheckError::BadProofs`] for no proofs, [`WeightCheckError::Proof`] when the
    /// openings lead to another root, [`WeightCheckError::Config`],
    /// [`WeightCheckError::Checkpoint`].
    pub fn open(
        dir: &Path,
        trusted_root: Digest,
        openings: Openings,
    ) -> Result<Self, WeightCheckError> {
        let config = match &openings {
            Openings::Proofs(map) => {
                let (unit, proof) = map
                    .iter()
                    .next()
                    .ok_or_else(|| WeightCheckError::BadProofs("no opening proof given".into()))?;
                proof
                    .verify(&trusted_root)
                    .map_err(|source| WeightCheckError::Proof {
                        unit: *unit,
                        source,
                    })?;
                proof.config.clone()
            }
            Openings::Spec(spec) => {
                if spec.model_root.0 != trusted_root {
                    return Err(WeightCheckError::Proof {
                        unit: UnitId::Globals,
                        source: ProofError::UntrustedRoot {
                            trusted: Hex(trusted_root),
                            computed: spec.model_root,
                        },
                    });
                }
                spec.config.clone()
            }
        };
        let local = read_config(
            dir,
            &CommitOptions {
                quant: Some(config.quant.clone()),
                arch: Some(config.arch.clone()),
                bind_config: config.config_sha256.is_some(),
            },
        )?;
        if local != config {
            return Err(WeightCheckError::Config {
                checkpoint: local.canonical_json().unwrap_or_default(),
                committed: config.canonical_json().unwrap_or_default(),
            });
        }
        let index = UnitIndex::open(dir, &config)?;
        Ok(Self {
            root: trusted_root,
            config,
            index,
            openings,
            checked: Mutex::new(HashSet::new()),
            units_read: AtomicU64::new(0),
            bytes_read: AtomicU64::new(0),
        })
    }

    /// The committed config.
    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    /// Whether `config.json` was checked byte for byte against the commitment (its
    /// `config_sha256`), so every field the forward pass reads from it is committed. `false`
    /// for a commitment made without [`CommitOptions::bind_config`]: then the fields outside
    /// the ten canonical keys (routing among them) are the auditor's own file's.
    pub fn config_bound(&self) -> bool {
        self.config.config_sha256.is_some()
    }

    /// Whether the checkpoint has a router at `layer` (an MoE layer whose cells touch units).
    pub fn is_moe_layer(&self, layer: u32) -> bool {
        !self
            .index
            .unit(UnitId::Layer {
                layer,
                part: LayerPart::Router,
            })
            .is_empty()
    }

    /// The units a cell touches: its layer's router and shared expert, then its experts.
    pub fn units_of(cell: &Cell) -> Vec<UnitId> {
        let layer = cell.layer();
        let mut v = vec![
            UnitId::Layer {
                layer,
                part: LayerPart::Router,
            },
            UnitId::Layer {
                layer,
                part: LayerPart::Shared,
            },
        ];
        v.extend(cell.expert_ids().iter().map(|&e| UnitId::Layer {
            layer,
            part: LayerPart::Expert(e),
        }));
        v
    }

    /// Checks every unit `cell` touches ([`Self::units_of`]; module docs).
    ///
    /// # Errors
    /// The first unit's [`WeightCheckError`].
    pub fn check_cell(&self, cell: &Cell) -> Result<(), WeightCheckError> {
        Self::units_of(cell)
            .into_iter()
            .try_for_each(|u| self.check_unit(u))
    }

    /// Checks one unit's bytes against the trusted root, once (a unit that passed is not
    /// read again).
    ///
    /// # Errors
    /// [`WeightCheckError::NoProof`], [`WeightCheckError::Proof`],
    /// [`WeightCheckError::Tensor`], [`WeightCheckError::UnitRoot`].
    pub fn check_unit(&self, unit: UnitId) -> Result<(), WeightCheckError> {
        if self.checked.lock().is_ok_and(|c| c.contains(&unit)) {
            return Ok(());
        }
        let tensors = self.index.unit(unit);
        self.units_read.fetch_add(1, Ordering::Relaxed);
        let bytes: usize = tensors.iter().map(|t| t.data.len()).sum();
        self.bytes_read.fetch_add(bytes as u64, Ordering::Relaxed);
        let rejected = |source| WeightCheckError::Proof { unit, source };
        match &self.openings {
            Openings::Proofs(map) => {
                let proof = map.get(&unit).ok_or(WeightCheckError::NoProof { unit })?;
                proof.verify(&self.root).map_err(rejected)?;
                let mine: HashSet<&str> = tensors.iter().map(|t| t.name).collect();
                if let Some(t) = proof
                    .tensors
                    .iter()
                    .find(|t| !mine.contains(t.name.as_str()))
                {
                    return Err(WeightCheckError::Tensor {
                        unit,
                        name: t.name.clone(),
                        what: "committed, but not in the checkpoint".into(),
                    });
                }
                for t in &tensors {
                    if !proof.tensors.iter().any(|p| p.name == t.name) {
                        return Err(WeightCheckError::Tensor {
                            unit,
                            name: t.name.to_string(),
                            what: "in the checkpoint, but not committed".into(),
                        });
                    }
                    proof
                        .check_tensor(t.name, t.dtype, t.shape, t.data)
                        .map_err(|e| match e {
                            ProofError::TensorMismatch { name, what } => {
                                WeightCheckError::Tensor { unit, name, what }
                            }
                            other => rejected(other),
                        })?;
                }
            }
            Openings::Spec(spec) => {
                let digests: Vec<TensorDigest> = tensors
                    .iter()
                    .map(|t| TensorDigest::of(t.name, t.dtype, t.shape, t.data))
                    .collect();
                let proof = spec.open(unit, digests).map_err(|e| match e {
                    CommitError::NoSuchUnit(_) => WeightCheckError::NoProof { unit },
                    other => WeightCheckError::UnitRoot {
                        unit,
                        reason: other.to_string(),
                    },
                })?;
                proof.verify(&self.root).map_err(rejected)?;
            }
        }
        if let Ok(mut c) = self.checked.lock() {
            c.insert(unit);
        }
        Ok(())
    }

    /// Units read (hashed) so far; a unit is read once.
    pub fn units_read(&self) -> u64 {
        self.units_read.load(Ordering::Relaxed)
    }

    /// Tensor bytes read (hashed) so far.
    pub fn bytes_read(&self) -> u64 {
        self.bytes_read.load(Ordering::Relaxed)
    }
}
