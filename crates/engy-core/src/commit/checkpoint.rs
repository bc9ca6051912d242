//! Reading a checkpoint directory: mmap every `*.safetensors` shard, validate the
//! headers with the safetensors crate, check duplicates and quantisation scales, and
//! hash every tensor leaf in parallel with rayon.
use std::collections::{BTreeMap, HashMap, HashSet};
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use memmap2::Mmap;
use rayon::prelude::*;
use safetensors::{Dtype, SafeTensors};

use super::layout::{self, LayerPart, ModelConfig, UnitId};
use super::{CommitError, Commitment, TensorDigest};

/// Live counters a caller may poll while [`commit_checkpoint`] runs (e.g. to print
/// tensors, GB and GB/s).
#[derive(Debug, Default)]
pub struct Progress {
    /// Tensors in the checkpoint (set once the headers are read).
    pub tensors_total: AtomicU64,
    /// Raw tensor bytes in the checkpoint (set once the headers are read).
    pub bytes_total: AtomicU64,
    /// Tensors hashed so far.
    pub tensors_done: AtomicU64,
    /// Bytes hashed so far (advances in 16 MiB chunks).
    pub bytes_done: AtomicU64,
}

/// Options of [`commit_checkpoint`].
#[derive(Debug, Clone, Default)]
pub struct CommitOptions {
    /// Replaces the weight format detected from `config.json` (`fp8`, `nvfp4`, `bf16`, …).
    pub quant: Option<String>,
    /// Replaces `model_type` as `arch`.
    pub arch: Option<String>,
    /// Binds the whole `config.json` (its SHA-256 as the config's `config_sha256`,
    /// specs/SCHEME.md "Config leaf"), so that every field the forward pass reads is
    /// committed, not only the ten canonical keys. Changes `model_root`.
    pub bind_config: bool,
}

/// The `*.safetensors` files directly in `dir`, sorted by file name (bytewise).
///
/// Errors: [`CommitError::Io`], [`CommitError::NoShards`].
pub fn list_shards(dir: &Path) -> Result<Vec<PathBuf>, CommitError> {
    let io = |source| CommitError::Io {
        path: dir.to_path_buf(),
        source,
    };
    let mut shards = Vec::new();
    for entry in std::fs::read_dir(dir).map_err(io)? {
        let entry = entry.map_err(io)?;
        let path = entry.path();
        let is_shard = path.extension().is_some_and(|e| e == "safetensors")
            && entry.file_type().map_err(io)?.is_file();
        if is_shard {
            shards.push(path);
        }
    }
    shards.sort_by(|a, b| {
        a.as_os_str()
            .as_encoded_bytes()
            .cmp(b.as_os_str().as_encoded_bytes())
    });
    if shards.is_empty() {
        return Err(CommitError::NoShards(dir.to_path_buf()));
    }
    Ok(shards)
}

/// Maps a shard read-only.
#[allow(unsafe_code)]
fn map_readonly(file: &File) -> std::io::Result<Mmap> {
    // SAFETY: the map is read-only and never outlives `Shards`, which owns it. The one
    // hazard of file-backed maps is another process truncating or rewriting the file while
    // we read it; a checkpoint being committed must not change under the tool (a rewrite
    // would only change the digests; a truncation raises SIGBUS). This is documented in
    // specs/SCHEME.md and is the standard contract of safetensors loaders.
    unsafe { Mmap::map(file) }
}

/// The mmapped shards of a checkpoint.
pub struct Shards {
    paths: Vec<PathBuf>,
    maps: Vec<Mmap>,
}

/// One tensor found in a shard (borrowing the map).
struct TensorRef<'a> {
    name: String,
    dtype: Dtype,
    shape: Vec<u64>,
    data: &'a [u8],
    shard: usize,
}

impl Shards {
    /// Maps every shard of `dir` (see [`list_shards`]).
    ///
    /// Errors: [`CommitError::Io`], [`CommitError::NoShards`].
    pub fn open(dir: &Path) -> Result<Self, CommitError> {
        let paths = list_shards(dir)?;
        let maps = paths
            .iter()
            .map(|p| {
                let io = |source| CommitError::Io {
                    path: p.clone(),
                    source,
                };
                let f = File::open(p).map_err(io)?;
                map_readonly(&f).map_err(io)
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Self { paths, maps })
    }

    /// The shard paths, sorted.
    pub fn paths(&self) -> &[PathBuf] {
        &self.paths
    }

    /// Every tensor of every shard, validated: headers parse, offsets tile the data,
    /// names unique across shards.
    fn tensors(&self) -> Result<Vec<TensorRef<'_>>, CommitError> {
        let mut seen: HashMap<String, usize> = HashMap::new();
        let mut out = Vec::new();
        for (i, (path, map)) in self.paths.iter().zip(&self.maps).enumerate() {
            let st = SafeTensors::deserialize(map).map_err(|e| CommitError::BadShard {
                path: path.clone(),
                reason: describe(&e),
            })?;
            for (name, view) in st.iter() {
                if let Some(first) = seen.insert(name.to_string(), i) {
                    return Err(CommitError::DuplicateTensor {
                        name: name.to_string(),
                        first: self.paths.get(first).cloned().unwrap_or_default(),
                        second: path.clone(),
                    });
                }
                out.push(TensorRef {
                    name: name.to_string(),
                    dtype: view.dtype(),
                    shape: view.shape().iter().map(|d| *d as u64).collect(),
                    data: view.data(),
                    shard: i,
                });
            }
        }
        Ok(out)
    }
}

/// A readable diagnosis of a safetensors error.
fn describe(e: &safetensors::SafeTensorError) -> String {
    use safetensors::SafeTensorError as E;
    match e {
        E::MetadataIncompleteBuffer => {
            "data section length differs from what the header declares (truncated or padded file)".into()
        }
        E::InvalidOffset(name) => format!(
            "header offsets of tensor {name:?} do not tile the data section (gap, overlap or out of order)"
        ),
        E::TensorInvalidInfo => "a tensor's byte range does not match its dtype × shape".into(),
        E::HeaderTooSmall => "file shorter than the 8-byte header length (truncated)".into(),
        E::InvalidHeaderLength => "header length points past the end of the file (truncated)".into(),
        other => format!("{other:?}"),
    }
}

fn is_fp8(d: Dtype) -> bool {
    matches!(d, Dtype::F8_E4M3 | Dtype::F8_E5M2)
}

/// Scale companions (specs/SCHEME.md "Quantised weights"): FP8 weights need
/// `weight_scale_inv` (block FP8) or `weight_scale` (per-tensor FP8); NVFP4 packed weights
/// need `weight_scale` and `weight_scale_2` (ModelOpt) or `weight_global_scale`
/// (compressed-tensors); every scale needs its weight.
fn check_scales(tensors: &[TensorRef<'_>], quant: &str) -> Result<(), CommitError> {
    let names: HashSet<&str> = tensors.iter().map(|t| t.name.as_str()).collect();
    let has = |base: &str, suffix: &str| names.contains(format!("{base}.{suffix}").as_str());
    for t in tensors {
        if let Some(base) = t.name.strip_suffix(".weight") {
            if is_fp8(t.dtype) && !has(base, "weight_scale_inv") && !has(base, "weight_scale") {
                return Err(CommitError::MissingScale {
                    weight: t.name.clone(),
                    dtype: t.dtype.to_string(),
                    expected: format!("{base}.weight_scale_inv (or .weight_scale)"),
                });
            }
        }
        let packed = if quant == "nvfp4" {
            t.name.strip_suffix(".weight_packed").or_else(|| {
                t.name
                    .strip_suffix(".weight")
                    .filter(|_| t.dtype == Dtype::U8)
            })
        } else {
            None
        };
        if let Some(base) = packed {
            if !has(base, "weight_scale") {
                return Err(CommitError::MissingScale {
                    weight: t.name.clone(),
                    dtype: t.dtype.to_string(),
                    expected: format!("{base}.weight_scale"),
                });
            }
            if !has(base, "weight_scale_2") && !has(base, "weight_global_scale") {
                return Err(CommitError::MissingScale {
                    weight: t.name.clone(),
                    dtype: t.dtype.to_string(),
                    expected: format!("{base}.weight_scale_2 (or .weight_global_scale)"),
                });
            }
        }
        for suffix in [
            ".weight_scale_inv",
            ".weight_scale",
            ".weight_scale_2",
            ".weight_global_scale",
        ] {
            if let Some(base) = t.name.strip_suffix(suffix) {
                if !has(base, "weight") && !has(base, "weight_packed") {
                    return Err(CommitError::OrphanScale {
                        name: t.name.clone(),
                        weight: format!("{base}.weight"),
                    });
                }
            }
        }
    }
    Ok(())
}

/// Splits fused expert tensors (dim 0 = `n_experts`) into one virtual tensor per expert:
/// name `{name}[{e}]`, shape `shape[1..]`, data the `e`-th of `n_experts` equal byte slices
/// (specs/SCHEME.md "Fused experts"). Other tensors pass through.
///
/// Errors: [`CommitError::UnknownTensor`] when a fused tensor's first dimension is not
/// `n_experts` or its bytes do not split evenly; [`CommitError::DuplicateTensor`] when a
/// slice name is also a real tensor name.
fn expand_fused<'a>(
    tensors: Vec<TensorRef<'a>>,
    config: &ModelConfig,
    paths: &[PathBuf],
) -> Result<Vec<TensorRef<'a>>, CommitError> {
    let n_layers = u32::try_from(config.n_layers).unwrap_or(u32::MAX);
    let n_experts = config.n_experts;
    let mut out = Vec::with_capacity(tensors.len());
    for t in tensors {
        if !layout::fused_expert_tensor(&t.name, n_layers) {
            out.push(t);
            continue;
        }
        let bad = |reason: String| CommitError::UnknownTensor {
            name: t.name.clone(),
            reason,
        };
        if t.shape.first() != Some(&n_experts) || n_experts == 0 || n_experts > super::MAX_EXPERTS {
            return Err(bad(format!(
                "fused expert tensor of shape {:?}: dim 0 must be n_experts = {n_experts}",
                t.shape
            )));
        }
        let len = t.data.len() as u64;
        if !len.is_multiple_of(n_experts) {
            return Err(bad(format!(
                "{len} bytes do not split into {n_experts} experts"
            )));
        }
        let per = (len / n_experts) as usize;
        let shape = t.shape.get(1..).unwrap_or_default().to_vec();
        for e in 0..n_experts as usize {
            out.push(TensorRef {
                name: format!("{}[{e}]", t.name),
                dtype: t.dtype,
                shape: shape.clone(),
                data: t.data.get(e * per..(e + 1) * per).unwrap_or_default(),
                shard: t.shard,
            });
        }
    }
    let mut seen: HashMap<&str, usize> = HashMap::new();
    for t in &out {
        if let Some(first) = seen.insert(t.name.as_str(), t.shard) {
            return Err(CommitError::DuplicateTensor {
                name: t.name.clone(),
                first: paths.get(first).cloned().unwrap_or_default(),
                second: paths.get(t.shard).cloned().unwrap_or_default(),
            });
        }
    }
    Ok(out)
}

/// Checks `model.safetensors.index.json` (when present) against the shards: every mapped
/// tensor must be in the named file.
fn check_index(dir: &Path, tensors: &[(String, PathBuf)]) -> Result<(), CommitError> {
    let path = dir.join("model.safetensors.index.json");
    let Ok(text) = std::fs::read_to_string(&path) else {
        return Ok(());
    };
    let v: serde_json::Value = serde_json::from_str(&text)
        .map_err(|e| CommitError::Config(format!("{}: {e}", path.display())))?;
    let Some(map) = v.get("weight_map").and_then(|m| m.as_object()) else {
        return Ok(());
    };
    let found: HashMap<&str, &Path> = tensors
        .iter()
        .map(|(n, p)| (n.as_str(), p.as_path()))
        .collect();
    for (name, file) in map {
        let file = file.as_str().unwrap_or("");
        match found.get(name.as_str()) {
            None => {
                return Err(CommitError::Config(format!(
                    "{}: maps tensor {name:?} to {file}, but no shard holds it",
                    path.display()
                )))
            }
            Some(p) if p.file_name().is_none_or(|f| f != file) => {
                return Err(CommitError::Config(format!(
                    "{}: maps tensor {name:?} to {file}, but it is in {}",
                    path.display(),
                    p.display()
                )))
            }
            Some(_) => {}
        }
    }
    Ok(())
}

/// Reads `<dir>/config.json` into the canonical [`ModelConfig`] (with the file's SHA-256 when
/// [`CommitOptions::bind_config`]).
///
/// Errors: [`CommitError::Io`] (missing file), [`CommitError::Config`].
pub fn read_config(dir: &Path, opts: &CommitOptions) -> Result<ModelConfig, CommitError> {
    let path = dir.join("config.json");
    let text = std::fs::read_to_string(&path).map_err(|source| CommitError::Io {
        path: path.clone(),
        source,
    })?;
    let v: serde_json::Value = serde_json::from_str(&text)
        .map_err(|e| CommitError::Config(format!("{}: {e}", path.display())))?;
    let mut cfg = ModelConfig::from_hf(&v, opts.quant.as_deref())?;
    if let Some(a) = &opts.arch {
        cfg.arch = a.clone();
    }
    if opts.bind_config {
        use sha2::Digest as _;
        cfg.config_sha256 = Some(hex::encode(sha2::Sha256::digest(text.as_bytes())));
    }
    cfg.canonical_json()?;
    Ok(cfg)
}

/// Commits the checkpoint in `dir` (`config.json` + `*.safetensors`): maps the shards,
/// validates them, hashes every tensor leaf on the current rayon pool and builds every
/// root. `progress` is updated as it goes.
///
/// Errors: every [`CommitError`] variant that concerns inputs: unreadable files, invalid
/// shards (truncated, lying offsets), duplicate tensors, missing or orphan scales, unknown
/// tensor names, layers that do not match the config.
pub fn commit_checkpoint(
    dir: &Path,
    opts: &CommitOptions,
    progress: &Progress,
) -> Result<Commitment, CommitError> {
    let config = read_config(dir, opts)?;
    let shards = Shards::open(dir)?;
    let tensors = shards.tensors()?;
    check_scales(&tensors, &config.quant)?;
    let owners: Vec<(String, PathBuf)> = tensors
        .iter()
        .map(|t| {
            (
                t.name.clone(),
                shards.paths.get(t.shard).cloned().unwrap_or_default(),
            )
        })
        .collect();
    check_index(dir, &owners)?;
    let tensors = expand_fused(tensors, &config, &shards.paths)?;
    let n_layers = u32::try_from(config.n_layers).unwrap_or(u32::MAX);
    progress
        .tensors_total
        .store(tensors.len() as u64, Ordering::Relaxed);
    progress.bytes_total.store(
        tensors.iter().map(|t| t.data.len() as u64).sum(),
        Ordering::Relaxed,
    );
    // Largest first, so one huge embedding does not finish last on a single core.
    let mut order: Vec<&TensorRef<'_>> = tensors.iter().collect();
    order.sort_by_key(|t| std::cmp::Reverse(t.data.len()));
    let digests: Vec<TensorDigest> = order
        .par_iter()
        .map(|t| {
            let d = TensorDigest::of_progress(
                &t.name,
                &t.dtype.to_string(),
                &t.shape,
                t.data,
                &mut |n| {
                    progress.bytes_done.fetch_add(n, Ordering::Relaxed);
                },
            );
            progress.tensors_done.fetch_add(1, Ordering::Relaxed);
            d
        })
        .collect();
    let mut biases = BTreeMap::new();
    for t in &tensors {
        if t.name.ends_with("mlp.gate.e_score_correction_bias") {
            if let Ok(UnitId::Layer {
                layer,
                part: LayerPart::Router,
            }) = layout::classify(&t.name, n_layers)
            {
                biases.insert(layer, t.data.to_vec());
            }
        }
    }
    Commitment::from_tensors(config, digests, biases)
}

/// Hashes the tensors of one unit only (for `spec open` against a published spec of this
/// scheme, without rehashing the whole checkpoint). Returns the unit's tensors sorted by name.
///
/// Errors: as [`commit_checkpoint`] for the shards read.
pub fn hash_unit(
    dir: &Path,
    config: &ModelConfig,
    unit: UnitId,
) -> Result<Vec<TensorDigest>, CommitError> {
    let index = UnitIndex::open(dir, config)?;
    let picked = index.unit(unit);
    let mut out: Vec<TensorDigest> = picked
        .par_iter()
        .map(|t| TensorDigest::of(t.name, t.dtype, t.shape, t.data))
        .collect();
    out.sort_by(|a, b| a.name.as_bytes().cmp(b.name.as_bytes()));
    Ok(out)
}

/// One tensor of a unit as stored (a fused expert tensor's slice under its virtual name
/// `{name}[{e}]`), borrowing the mapped shard: reading `data` is what faults its pages in.
#[derive(Debug, Clone, Copy)]
pub struct UnitTensor<'a> {
    /// Tensor name (virtual name for a fused slice).
    pub name: &'a str,
    /// safetensors dtype name (`BF16`, `F8_E4M3`, …).
    pub dtype: &'a str,
    /// Shape (`shape[1..]` of a fused tensor).
    pub shape: &'a [u64],
    /// The raw bytes.
    pub data: &'a [u8],
}

#[derive(Debug)]
struct Located {
    name: String,
    dtype: String,
    shape: Vec<u64>,
    shard: usize,
    start: usize,
    end: usize,
}

/// A checkpoint's tensors grouped by commitment unit (specs/SCHEME.md §3: fused experts
/// split, scales checked), built from the shard headers alone: opening it reads no tensor
/// data, so a caller that checks a few units (a sampled cell audit: the router, the
/// experts dispatched and the shared expert of one layer) reads only their bytes.
pub struct UnitIndex {
    shards: Shards,
    units: HashMap<UnitId, Vec<Located>>,
}

impl std::fmt::Debug for UnitIndex {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UnitIndex")
            .field("shards", &self.shards.paths)
            .field("units", &self.units.len())
            .finish()
    }
}

impl UnitIndex {
    /// Maps the shards of `dir` and places every tensor in its unit under `config`.
    ///
    /// Errors: as [`commit_checkpoint`]'s header checks ([`CommitError::Io`],
    /// [`CommitError::NoShards`], [`CommitError::BadShard`], [`CommitError::DuplicateTensor`],
    /// [`CommitError::MissingScale`], [`CommitError::OrphanScale`],
    /// [`CommitError::UnknownTensor`]).
    pub fn open(dir: &Path, config: &ModelConfig) -> Result<Self, CommitError> {
        let shards = Shards::open(dir)?;
        let tensors = shards.tensors()?;
        check_scales(&tensors, &config.quant)?;
        let tensors = expand_fused(tensors, config, &shards.paths)?;
        let n_layers = u32::try_from(config.n_layers).unwrap_or(u32::MAX);
        let mut units: HashMap<UnitId, Vec<Located>> = HashMap::new();
        for t in &tensors {
            let unit = layout::classify(&t.name, n_layers)?;
            let base = shards.maps.get(t.shard).map_or(0, |m| m.as_ptr() as usize);
            // `data` is a sub-slice of its shard's map: its offset locates it.
            let start = (t.data.as_ptr() as usize).saturating_sub(base);
            units.entry(unit).or_default().push(Located {
                name: t.name.clone(),
                dtype: t.dtype.to_string(),
                shape: t.shape.clone(),
                shard: t.shard,
                start,
                end: start + t.data.len(),
            });
        }
        for v in units.values_mut() {
            v.sort_by(|a, b| a.name.as_bytes().cmp(b.name.as_bytes()));
        }
        Ok(Self { shards, units })
    }

    /// The tensors of `unit`, sorted by name (empty when the checkpoint has none, e.g. the
    /// `shared` unit of a model without a shared expert).
    pub fn unit(&self, unit: UnitId) -> Vec<UnitTensor<'_>> {
        self.units.get(&unit).map_or_else(Vec::new, |v| {
            v.iter()
                .map(|l| UnitTensor {
                    name: &l.name,
                    dtype: &l.dtype,
                    shape: &l.shape,
                    data: self
                        .shards
                        .maps
                        .get(l.shard)
                        .and_then(|m| m.get(l.start..l.end))
                        .unwrap_or_default(),
                })
                .collect()
        })
    }

    /// The shard paths, sorted.
    pub fn paths(&self) -> &[PathBuf] {
        self.shards.paths()
    }
}
