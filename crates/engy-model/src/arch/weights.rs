//! [`Weights`]: the tensors of a checkpoint by name, as f32 tensors on the weights' device
//! (the CPU unless [`Weights::with_device`]) dequantised on demand from mmapped safetensors
//! shards.
//!
//! Names are given in the layout of transformers' text-only classes (`model.layers.0.…`,
//! `model.embed_tokens.weight`, `lm_head.weight`). A multimodal checkpoint keeps its text model
//! under `model.language_model.` (Qwen3.5/3.6 `ForConditionalGeneration`): the prefix is
//! detected once and `model.` is rewritten to it, so an architecture never sees the layout.
//! Tensors outside the text model (`model.visual.*`, `mtp.*`) are never read.
//!
//! Memory: nothing is decoded at open. Each getter decodes (and dequantises) one tensor from the
//! map and returns it; with [`Residency::Resident`] the result is kept for the next call (small
//! models, the devnet serve), with [`Residency::Streaming`] it is dropped after use, so a
//! forward pass holds one layer's f32 weights at a time, and each decoded tensor's file pages
//! are handed back to the kernel, so a large FP8 checkpoint audits in about one layer of f32
//! plus one layer of mapped pages, whatever its size (docs/AUDITOR.md "Memory").
use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::RwLock;

use candle_core::{Device, Tensor};
use memmap2::Mmap;
use safetensors::{Dtype, SafeTensors};

use super::config::QuantConfig;
use super::qlinear::QuantMatrix;
use super::quant;
use crate::Compute;
use crate::{quantize_int4, ModelError, Precision};

/// The most rows of `x` [`Weights::linear`] multiplies with the fused kernel
/// ([`QuantMatrix::linear`]); above it, dequantising `W` once and using candle's matmul is
/// faster (measured: bench/RESULTS.md "Auditor on the CPU").
pub const FUSED_MAX_ROWS: usize = 4;

/// Whether decoded weights are kept between calls.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Residency {
    /// Keep every decoded tensor for reuse: fastest. On the CPU, f32 (4 bytes per parameter).
    /// On a GPU, a bf16 recompute keeps the bf16 values it multiplies (2 bytes per parameter
    /// for the projections and the routed experts' stacks, [`Weights::keeps_stacks`]: about
    /// 65 GiB for Qwen3.6-35B-A3B), so a second audit on the same weights reads and decodes
    /// nothing; an f32 recompute there keeps its smaller tensors and streams the experts.
    #[default]
    Resident,
    /// Decode on every call and keep nothing: the forward pass holds one layer at a time.
    Streaming,
}

struct Shard {
    path: PathBuf,
    /// The open file, for positioned reads ([`Weights::read_into`]).
    file: File,
    map: Mmap,
    data_start: usize,
}

#[derive(Debug, Clone)]
struct Entry {
    shard: usize,
    dtype: Dtype,
    shape: Vec<usize>,
    start: usize,
    end: usize,
}

/// The tensors of a checkpoint directory (every `*.safetensors` file directly in it).
pub struct Weights {
    dir: PathBuf,
    shards: Vec<Shard>,
    index: HashMap<String, Entry>,
    text_prefix: String,
    fp8_block: [usize; 2],
    nvfp4_group: usize,
    precision: Precision,
    residency: Residency,
    resident: RwLock<HashMap<String, Tensor>>,
    /// Under [`Residency::Streaming`], whether decoded tensors are kept until
    /// [`Weights::release_held`] ([`Weights::hold`]): one layer's weights serving several
    /// sequences of a batched pass.
    held: std::sync::atomic::AtomicBool,
    device: Device,
    /// The E4M3 decode table on `device`, made once ([`Weights::decode_on_device`]).
    e4m3: std::sync::OnceLock<Tensor>,
    /// Reads started ahead by [`Weights::prefetch`], by the exact list of names they read.
    prefetched: std::sync::Mutex<Vec<Prefetched>>,
    /// Page-locked staging buffers by length, for [`Weights::upload`] on a GPU.
    #[cfg(feature = "cuda")]
    staging: std::sync::Mutex<HashMap<usize, Staging>>,
}

/// A [`Weights::hold`] that ends when this is dropped ([`Weights::held`]).
pub struct Held<'w>(&'w Weights);

impl Drop for Held<'_> {
    fn drop(&mut self) {
        self.0.hold(false);
    }
}

/// A page-locked staging buffer of [`Weights::upload`] and the event recorded after the last
/// copy out of it: the host waits on the event before writing the buffer again. cudarc's own
/// event on a pinned buffer is recorded only when it manages synchronisation between several
/// streams (`CudaContext::is_managing_stream_synchronization`), which candle's one stream never
/// turns on; without this event the host overwrote a buffer while the previous copy out of it
/// was still reading it, and a GPU audit's weights varied from process to process.
#[cfg(feature = "cuda")]
struct Staging {
    buf: candle_core::cuda_backend::cudarc::driver::PinnedHostSlice<u8>,
    copied: Option<candle_core::cuda_backend::cudarc::driver::CudaEvent>,
}

#[cfg(feature = "cuda")]
impl Drop for Staging {
    fn drop(&mut self) {
        // The buffer is freed after this: no copy may still read it.
        if let Some(e) = &self.copied {
            let _ = e.synchronize();
        }
    }
}

/// The bytes of a list of tensors being read in the background ([`Weights::prefetch`]).
struct Prefetched {
    names: Vec<String>,
    read: std::thread::JoinHandle<Result<Vec<u8>, ModelError>>,
}

impl std::fmt::Debug for Weights {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Weights")
            .field("dir", &self.dir)
            .field("shards", &self.shards.len())
            .field("tensors", &self.index.len())
            .field("text_prefix", &self.text_prefix)
            .field("precision", &self.precision)
            .field("residency", &self.residency)
            .field("device", &self.device)
            .finish()
    }
}

#[allow(unsafe_code)]
fn map_readonly(file: &File) -> std::io::Result<Mmap> {
    // SAFETY: read-only map owned by `Weights` and never handed out beyond a borrow of it. The
    // one hazard of file-backed maps is the file changing underneath (a truncation raises
    // SIGBUS); a checkpoint under audit must not change, the contract of every safetensors
    // loader.
    unsafe { Mmap::map(file) }
}

impl Weights {
    /// Maps every `*.safetensors` file directly in `dir` and indexes its tensors.
    /// `quant` gives the FP8 tile and NVFP4 group sizes (defaults 128×128 and 16 when `None`);
    /// `precision` applies the int4 cheat in [`Weights::projection`].
    ///
    /// # Errors
    /// [`ModelError::Io`] for unreadable files, [`ModelError::Safetensors`] for a malformed
    /// shard or a tensor name found in two shards, [`ModelError::Config`] when there is no
    /// shard.
    pub fn open(
        dir: &Path,
        quant: Option<&QuantConfig>,
        precision: Precision,
        residency: Residency,
    ) -> Result<Self, ModelError> {
        let io = |path: &Path| {
            let path = path.to_path_buf();
            move |source| ModelError::Io { path, source }
        };
        let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
            .map_err(io(dir))?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| {
                p.extension().is_some_and(|x| x == "safetensors")
                    && !p
                        .file_name()
                        .is_some_and(|n| n.to_string_lossy().starts_with('.'))
            })
            .collect();
        files.sort();
        if files.is_empty() {
            return Err(ModelError::Config(format!(
                "no *.safetensors file in {}",
                dir.display()
            )));
        }
        let mut shards = Vec::with_capacity(files.len());
        let mut index = HashMap::new();
        for (si, path) in files.into_iter().enumerate() {
            let file = File::open(&path).map_err(io(&path))?;
            let map = map_readonly(&file).map_err(io(&path))?;
            let bad = |msg: String| ModelError::Safetensors {
                file: path.clone(),
                msg,
            };
            let (n, meta) = SafeTensors::read_metadata(&map).map_err(|e| bad(e.to_string()))?;
            for (name, info) in meta.tensors() {
                let (start, end) = info.data_offsets;
                let e = Entry {
                    shard: si,
                    dtype: info.dtype,
                    shape: info.shape.clone(),
                    start,
                    end,
                };
                if index.insert(name.clone(), e).is_some() {
                    return Err(bad(format!("tensor {name} is in more than one shard")));
                }
            }
            shards.push(Shard {
                path,
                file,
                map,
                data_start: 8 + n,
            });
        }
        let text_prefix = if index.keys().any(|k| k.starts_with("model.language_model.")) {
            "model.language_model.".to_string()
        } else {
            "model.".to_string()
        };
        let fp8_block = quant.map_or([128, 128], |q| q.weight_block_size);
        split_fused_experts(&mut index, fp8_block[0]).map_err(|(shard, msg)| {
            ModelError::Safetensors {
                file: shards
                    .get(shard)
                    .map(|s| s.path.clone())
                    .unwrap_or_default(),
                msg,
            }
        })?;
        Ok(Self {
            dir: dir.to_path_buf(),
            shards,
            index,
            text_prefix,
            fp8_block,
            nvfp4_group: quant.map_or(16, |q| q.group_size),
            precision,
            residency,
            resident: RwLock::new(HashMap::new()),
            held: std::sync::atomic::AtomicBool::new(false),
            device: Device::Cpu,
            e4m3: std::sync::OnceLock::new(),
            prefetched: std::sync::Mutex::new(Vec::new()),
            #[cfg(feature = "cuda")]
            staging: std::sync::Mutex::new(HashMap::new()),
        })
    }

    /// These weights placed on `device`: every tensor a getter returns is created there. On a
    /// GPU, bf16 and block-FP8 tensors are copied as stored and decoded there; the rest are
    /// decoded on the host, then copied. The
    /// default is the CPU.
    pub fn with_device(mut self, device: Device) -> Self {
        self.device = device;
        self.e4m3 = std::sync::OnceLock::new();
        self
    }

    /// The device the getters' tensors are on.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// The checkpoint directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// `model.` or `model.language_model.`: where the text model's tensors are.
    pub fn text_prefix(&self) -> &str {
        &self.text_prefix
    }

    /// The precision [`Weights::projection`] applies.
    pub fn precision(&self) -> Precision {
        self.precision
    }

    /// Whether decoded tensors are kept.
    pub fn residency(&self) -> Residency {
        self.residency
    }

    /// Whether an architecture decodes (and so keeps) every tensor when it opens, checking
    /// them all up front: under [`Residency::Resident`] on the CPU. On a GPU resident weights
    /// are kept as the recompute first uses them, in the form it multiplies (bf16 for a bf16
    /// recompute, [`Weights::keeps_stacks`]); decoding all of them to f32 at open would need
    /// 4 bytes per parameter of device memory (140 GB for a 35B model).
    pub fn preloads(&self) -> bool {
        self.residency == Residency::Resident && self.device.is_cpu()
    }

    /// The stored name of `name` (text-only layout → the checkpoint's layout).
    pub fn resolve(&self, name: &str) -> String {
        match name.strip_prefix("model.") {
            Some(rest) if self.text_prefix != "model." => format!("{}{rest}", self.text_prefix),
            _ => name.to_string(),
        }
    }

    fn entry(&self, name: &str) -> Option<&Entry> {
        self.index.get(&self.resolve(name))
    }

    /// Whether tensor `name` (text-only layout) is in the checkpoint.
    pub fn has(&self, name: &str) -> bool {
        self.entry(name).is_some()
    }

    /// The stored shape of `name`, if present.
    pub fn shape(&self, name: &str) -> Option<&[usize]> {
        self.entry(name).map(|e| e.shape.as_slice())
    }

    /// The stored dtype of `name`, if present.
    pub fn dtype(&self, name: &str) -> Option<Dtype> {
        self.entry(name).map(|e| e.dtype)
    }

    /// Every stored tensor name (the checkpoint's own layout), unordered.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.index.keys().map(String::as_str)
    }

    fn bytes(&self, name: &str) -> Result<(&Entry, &[u8], &Path), ModelError> {
        let e = self
            .entry(name)
            .ok_or_else(|| ModelError::MissingTensor(self.resolve(name)))?;
        let sh = &self.shards[e.shard];
        let data = sh
            .map
            .get(sh.data_start + e.start..sh.data_start + e.end)
            .ok_or_else(|| ModelError::Safetensors {
                file: sh.path.clone(),
                msg: format!("tensor {name}: data offsets outside the file"),
            })?;
        Ok((e, data, &sh.path))
    }

    /// [`Residency::Streaming`]: once `name` is decoded, hands its file pages back to the
    /// kernel (`madvise(MADV_DONTNEED)`), so the process's resident set holds about one layer
    /// instead of every page of the checkpoint it has read (measured in docs/AUDITOR.md
    /// "Memory"). The pages stay in the page cache; a later read faults them in again.
    /// Advice is best effort: a failure only leaves the pages mapped.
    #[cfg(unix)]
    #[allow(unsafe_code)]
    fn release_pages(&self, name: &str) {
        let Some(e) = self.entry(name) else { return };
        let Some(sh) = self.shards.get(e.shard) else {
            return;
        };
        let len = e.end.saturating_sub(e.start);
        if len == 0 || sh.data_start + e.end > sh.map.len() {
            return;
        }
        // SAFETY: `map` is a shared, read-only file mapping (`Mmap::map`), never written.
        // MADV_DONTNEED on such a mapping only unmaps the pages; the next access reads the same
        // bytes back from the page cache or the file, so no borrow of the map ever sees other
        // contents. (The hazard memmap2 marks this unsafe for, lost writes of a private
        // copy-on-write mapping, cannot arise here.)
        let _ = unsafe {
            sh.map.unchecked_advise_range(
                memmap2::UncheckedAdvice::DontNeed,
                sh.data_start + e.start,
                len,
            )
        };
    }

    #[cfg(not(unix))]
    fn release_pages(&self, _name: &str) {}

    fn floats_of(&self, name: &str) -> Result<(Vec<usize>, Vec<f32>), ModelError> {
        let (e, data, path) = self.bytes(name)?;
        let v = quant::floats(e.dtype, data).ok_or_else(|| ModelError::Safetensors {
            file: path.to_path_buf(),
            msg: format!("tensor {name} has unsupported dtype {:?} here", e.dtype),
        })?;
        Ok((e.shape.clone(), v))
    }

    /// The quantised 2-D weight `name` as stored, checked against its siblings: `<m>.weight`
    /// F8_E4M3 with `<m>.weight_scale_inv` (block FP8), or `<m>.weight` U8 with
    /// `<m>.weight_scale` and `<m>.weight_scale_2` (NVFP4; logical shape `[N, K]`). `None` for
    /// a tensor stored plainly. See [`super::quant`] for the formulas.
    fn quantised(&self, name: &str) -> Result<Option<QuantMatrix<'_>>, ModelError> {
        let (e, data, path) = self.bytes(name)?;
        let bad = |msg: String| ModelError::Safetensors {
            file: path.to_path_buf(),
            msg: format!("tensor {name}: {msg}"),
        };
        let fp8_scale = format!("{name}_scale_inv");
        if e.dtype == Dtype::F8_E4M3 && self.has(&fp8_scale) {
            let [n, k] = e.shape[..] else {
                return Err(bad(format!(
                    "block FP8 weight of shape {:?} is not 2-D",
                    e.shape
                )));
            };
            let (sshape, scale) = self.floats_of(&fp8_scale)?;
            let [bn, bk] = self.fp8_block;
            let want = vec![n.div_ceil(bn), k.div_ceil(bk)];
            if sshape != want {
                return Err(bad(format!(
                    "weight_scale_inv has shape {sshape:?}, expected {want:?} for tiles {bn}x{bk}"
                )));
            }
            return QuantMatrix::fp8_block(data, n, k, scale, self.fp8_block)
                .map(Some)
                .ok_or_else(|| bad("block FP8 sizes do not match".into()));
        }
        let nv_scale = format!("{name}_scale");
        let nv_scale_2 = format!("{name}_scale_2");
        if e.dtype == Dtype::U8 && self.has(&nv_scale) && self.has(&nv_scale_2) {
            let [n, kh] = e.shape[..] else {
                return Err(bad(format!(
                    "NVFP4 weight of shape {:?} is not 2-D",
                    e.shape
                )));
            };
            let k = kh * 2;
            let g = self.nvfp4_group;
            let (se, sdata, _) = self.bytes(&nv_scale)?;
            if se.dtype != Dtype::F8_E4M3 || se.shape != [n, k / g.max(1)] {
                return Err(bad(format!(
                    "weight_scale is {:?} {:?}, expected F8_E4M3 [{n}, {}]",
                    se.dtype,
                    se.shape,
                    k / g.max(1)
                )));
            }
            let (_, s2) = self.floats_of(&nv_scale_2)?;
            let [s2] = s2[..] else {
                return Err(bad("weight_scale_2 is not a scalar".into()));
            };
            return QuantMatrix::nvfp4(data, n, k, sdata, s2, g)
                .map(Some)
                .ok_or_else(|| bad("NVFP4 sizes do not match".into()));
        }
        Ok(None)
    }

    /// On a GPU: `name` copied there as stored (1 byte per FP8 parameter, 2 per bf16) and
    /// decoded to f32 there, so the host neither dequantises nor copies f32. Covers plain
    /// bf16 / f16 / f32 tensors and block FP8 whose tiles divide the shape (every projection
    /// of the served checkpoints); `None` for the rest (NVFP4, partial tiles), which decode
    /// on the host. The values are the host decode's exactly: the E4M3 codes are decoded by
    /// the host decoder's table ([`quant::e4m3_table`]) and the tile scale is one f32
    /// product either way.
    fn decode_on_device(&self, name: &str) -> Result<Option<Tensor>, ModelError> {
        use candle_core::DType as C;
        let (e, data, _) = self.bytes(name)?;
        let dev = &self.device;
        let plain = |dtype: C| -> Result<Option<Tensor>, ModelError> {
            Ok(Some(
                Tensor::from_raw_buffer(data, dtype, &e.shape, dev)?.to_dtype(C::F32)?,
            ))
        };
        match e.dtype {
            Dtype::BF16 => return plain(C::BF16),
            Dtype::F16 => return plain(C::F16),
            Dtype::F32 => return plain(C::F32),
            Dtype::F8_E4M3 => {}
            _ => return Ok(None),
        }
        let scale_name = format!("{name}_scale_inv");
        let [bn, bk] = self.fp8_block;
        let (Some(se), [n, k]) = (self.entry(&scale_name), &e.shape[..]) else {
            return Ok(None);
        };
        let (n, k) = (*n, *k);
        if bn == 0 || bk == 0 || n % bn != 0 || k % bk != 0 || se.shape != [n / bn, k / bk] {
            return Ok(None);
        }
        let scale = match se.dtype {
            Dtype::BF16 | Dtype::F16 | Dtype::F32 => {
                let (se, sdata, _) = self.bytes(&scale_name)?;
                let dt = match se.dtype {
                    Dtype::BF16 => C::BF16,
                    Dtype::F16 => C::F16,
                    _ => C::F32,
                };
                Tensor::from_raw_buffer(sdata, dt, &se.shape, dev)?.to_dtype(C::F32)?
            }
            _ => return Ok(None),
        };
        // The codes go up as bytes and are decoded by a 256-entry table of the host's own
        // E4M3 decoder (candle 0.9.2 looks the F8E4M3 → F32 cast kernel up under a name its
        // kernels do not define, so the F8E4M3 dtype is not used).
        let table = self.e4m3_on_device()?;
        let codes = Tensor::from_raw_buffer(data, C::U8, &[n * k], dev)?;
        let scale = scale.reshape((1, n / bn, k / bk))?;
        let fused = super::fp8_kernels::block_decode(
            &codes,
            &scale,
            table,
            &[0],
            (1, n, k),
            [bn, bk],
            C::F32,
        )?;
        if let Some(w) = fused {
            return Ok(Some(w.reshape((n, k))?));
        }
        let w = table
            .index_select(&codes, 0)?
            .reshape((n / bn, bn, k / bk, bk))?
            .broadcast_mul(&scale.reshape((n / bn, 1, k / bk, 1))?)?
            .reshape((n, k))?;
        Ok(Some(w))
    }

    /// Copies the stored bytes of `name` into `dst` (exactly their length) with a positioned
    /// read of the shard file rather than through the map: a read from the page cache costs no
    /// page faults, so many run in parallel at memory speed, and the process's resident set
    /// does not grow. Elsewhere than unix, a copy from the map.
    fn read_into(&self, name: &str, dst: &mut [u8]) -> Result<(), ModelError> {
        let (e, data, path) = self.bytes(name)?;
        if data.len() != dst.len() {
            return Err(ModelError::Safetensors {
                file: path.to_path_buf(),
                msg: format!(
                    "tensor {name}: {} bytes, expected {}",
                    data.len(),
                    dst.len()
                ),
            });
        }
        #[cfg(unix)]
        {
            use std::os::unix::fs::FileExt;
            let sh = &self.shards[e.shard];
            let at = (sh.data_start + e.start) as u64;
            sh.file
                .read_exact_at(dst, at)
                .map_err(|err| ModelError::Io {
                    path: path.to_path_buf(),
                    source: err,
                })
        }
        #[cfg(not(unix))]
        {
            let _ = e;
            dst.copy_from_slice(data);
            Ok(())
        }
    }

    /// Starts reading the stored bytes of `names` (all of one size) in the background, for the
    /// next [`Weights::stacked`] of exactly these names: the auditor on a GPU reads layer
    /// `l + 1`'s experts while the GPU computes layer `l`. The bytes wait in host memory
    /// until taken; at most 8 lists wait (a ninth drops the oldest). Nothing is started when
    /// a name is not in the checkpoint.
    pub fn prefetch(self: &std::sync::Arc<Self>, names: Vec<String>) {
        if names.iter().any(|n| !self.has(n)) {
            return;
        }
        let Ok(mut p) = self.prefetched.lock() else {
            return;
        };
        if p.iter().any(|q| q.names == names) {
            return;
        }
        if p.len() >= 8 {
            // The oldest was never asked for; its thread finishes and its bytes are dropped.
            p.remove(0);
        }
        let w = std::sync::Arc::clone(self);
        let list = names.clone();
        let read = std::thread::spawn(move || w.read_all(&list));
        p.push(Prefetched { names, read });
    }

    /// The stored bytes of every tensor of `names` (all of one size), one after the other:
    /// a [`Weights::prefetch`] of exactly this list when there is one, else read now.
    fn gather(&self, names: &[String]) -> Result<Vec<u8>, ModelError> {
        let ahead = self.prefetched.lock().ok().and_then(|mut p| {
            let i = p.iter().position(|q| q.names == names)?;
            Some(p.swap_remove(i))
        });
        crate::device::phase(&self.device, "weights: host read", || match ahead {
            Some(q) => q
                .read
                .join()
                .map_err(|_| ModelError::Device("a background weight read panicked".into()))?,
            None => self.read_all(names),
        })
    }

    /// [`Weights::gather`]'s read: every tensor of `names` in parallel
    /// ([`Weights::read_into`]).
    fn read_all(&self, names: &[String]) -> Result<Vec<u8>, ModelError> {
        use rayon::prelude::*;
        let Some(first) = names.first() else {
            return Ok(Vec::new());
        };
        let each = self.bytes(first)?.1.len();
        let mut buf = vec![0u8; each * names.len()];
        buf.par_chunks_mut(each.max(1))
            .zip(names.par_iter())
            .try_for_each(|(dst, n)| self.read_into(n, dst))?;
        Ok(buf)
    }

    /// `bytes` as a `U8` tensor on the weights' device. On a GPU, large copies go through a
    /// page-locked staging buffer (one per length, kept): the host copies into it in
    /// parallel and the GPU reads it by DMA, several times the speed of a copy from pageable
    /// memory (measured in docs/AUDITOR.md "On a GPU"). Elsewhere, and when the staging
    /// buffer cannot be had, an ordinary copy.
    fn upload(&self, bytes: &[u8]) -> Result<Tensor, ModelError> {
        #[cfg(feature = "cuda")]
        if let Device::Cuda(cd) = &self.device {
            if bytes.len() >= 1 << 24 {
                if let Some(t) = self.upload_pinned(cd, bytes)? {
                    return Ok(t);
                }
            }
        }
        Ok(Tensor::from_raw_buffer(
            bytes,
            candle_core::DType::U8,
            &[bytes.len()],
            &self.device,
        )?)
    }

    /// [`Weights::upload`] through a staging buffer; `None` when none can be allocated.
    #[cfg(feature = "cuda")]
    #[allow(unsafe_code)]
    fn upload_pinned(
        &self,
        cd: &candle_core::cuda_backend::CudaDevice,
        bytes: &[u8],
    ) -> Result<Option<Tensor>, ModelError> {
        use rayon::prelude::*;
        let dev_err = |e: candle_core::cuda_backend::cudarc::driver::DriverError| {
            ModelError::Device(format!("uploading weights: {e}"))
        };
        let stream = cd.cuda_stream();
        let Ok(mut staging) = self.staging.lock() else {
            return Ok(None);
        };
        let pinned = match staging.entry(bytes.len()) {
            std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
            std::collections::hash_map::Entry::Vacant(v) => {
                // SAFETY: the buffer's contents are unset; every byte is written below before
                // the copy reads it.
                match unsafe { stream.context().alloc_pinned::<u8>(bytes.len()) } {
                    Ok(buf) => v.insert(Staging { buf, copied: None }),
                    Err(_) => return Ok(None),
                }
            }
        };
        // The previous copy out of this buffer must be done before the host writes it (the
        // event is dropped only once that is known).
        if let Some(e) = &pinned.copied {
            e.synchronize().map_err(dev_err)?;
        }
        pinned.copied = None;
        let host = pinned.buf.as_mut_slice().map_err(dev_err)?;
        host.par_chunks_mut(1 << 22)
            .zip(bytes.par_chunks(1 << 22))
            .for_each(|(d, s)| d.copy_from_slice(s));
        // SAFETY: the device buffer is fully written by the copy, which is ordered on the
        // stream before any kernel that reads the tensor.
        let mut dst = unsafe { stream.alloc::<u8>(bytes.len()) }.map_err(dev_err)?;
        if let Err(e) = stream.memcpy_htod(&pinned.buf, &mut dst) {
            // A copy may have been queued: none may still read the buffer after this.
            let _ = stream.synchronize();
            return Err(dev_err(e));
        }
        match stream.record_event(None) {
            Ok(done) => pinned.copied = Some(done),
            Err(e) => {
                // No event to wait on later: wait for the copy now.
                stream.synchronize().map_err(dev_err)?;
                return Err(dev_err(e));
            }
        }
        let storage = candle_core::cuda_backend::CudaStorage::wrap_cuda_slice(dst, cd.clone());
        Ok(Some(Tensor::from_storage(
            candle_core::Storage::Cuda(storage),
            bytes.len(),
            candle_core::op::BackpropOp::none(),
            false,
        )))
    }

    /// The E4M3 decode table on the weights' device, made once.
    fn e4m3_on_device(&self) -> Result<&Tensor, ModelError> {
        if let Some(t) = self.e4m3.get() {
            return Ok(t);
        }
        let t = Tensor::from_vec(quant::e4m3_table().to_vec(), 256, &self.device)?;
        Ok(self.e4m3.get_or_init(|| t))
    }

    /// The 2-D weights `names` (each `[out, inp]`) stacked as `[names.len(), out, inp]`, as a
    /// model computing in `compute` holds them ([`Weights::projection_t_in`]'s values,
    /// untransposed): the routed experts of one layer, for one batched product per expert
    /// group ([`super::experts`]).
    ///
    /// On a GPU the stored bytes of all `names` are gathered on the host (in parallel) and go
    /// up in one copy per kind (codes, tile scales), then decode there as
    /// [`Weights::decode_on_device`] decodes one tensor; with [`Compute::Bf16`] the stack is
    /// held as bf16 (exact: the values are bf16 roundings), so the products run on bf16
    /// tensor cores. Other cases (the CPU, NVFP4, partial FP8 tiles, mixed dtypes, the int4
    /// cheat) decode tensor by tensor and stack f32.
    ///
    /// # Errors
    /// [`ModelError::MissingTensor`], [`ModelError::Shape`] when a tensor is not
    /// `[out, inp]`, and the decode errors of [`Weights::tensor`].
    pub fn stacked(
        &self,
        names: &[String],
        out: usize,
        inp: usize,
        compute: Compute,
    ) -> Result<Tensor, ModelError> {
        let key = self
            .keeps_stacks(compute)
            .then(|| format!("stack#{compute:?}#{}", names.join(",")));
        if let Some(t) = key.as_deref().and_then(|k| self.kept(k)) {
            return Ok(t);
        }
        // Parts decoded one by one (NVFP4 and the like) are kept only on the CPU: on a GPU
        // an f32 copy of every expert would not fit beside the kept bf16 stacks.
        let keep_parts = key.is_none() && self.device.is_cpu();
        let t = self.stack_fresh(names, out, inp, compute, keep_parts)?;
        if let Some(k) = key {
            self.keep(k, &t);
        }
        Ok(t)
    }

    /// Whether [`Weights::stacked`] keeps the stacks it makes for a recompute in `compute`:
    /// under [`Residency::Resident`], on a GPU, for a bf16 recompute of an unaltered
    /// checkpoint. The routed experts then stack every expert of a layer
    /// ([`super::experts::dispatch`]), so the next pass reuses the stacks whatever it routes.
    pub fn keeps_stacks(&self, compute: Compute) -> bool {
        self.keeps()
            && !self.device.is_cpu()
            && compute == Compute::Bf16
            && !matches!(self.precision, Precision::Int4 { .. })
    }

    /// Whether the stack of exactly `names` for `compute` is kept ([`Weights::keeps_stacks`]):
    /// nothing of it needs reading again.
    pub fn holds_stack(&self, names: &[String], compute: Compute) -> bool {
        self.keeps_stacks(compute)
            && self
                .kept(&format!("stack#{compute:?}#{}", names.join(",")))
                .is_some()
    }

    /// Whether a projection decoded for a recompute in `compute` ([`Weights::projection_t_in`])
    /// may be kept: always on the CPU and while a streamed pass holds a layer
    /// ([`Weights::hold`]); on a resident GPU model only for [`Compute::Bf16`]. A resident GPU
    /// model holds the bf16 recompute's weights (2 bytes a parameter: 70 GB for a 35B model,
    /// what fits an 80 GB GPU), and the f32 and W8A8 recomputes that `auto` runs after a
    /// failed bf16 one decode theirs per pass and drop them, as a streamed pass does: keeping
    /// their f32 copies too (4 bytes a parameter) would not fit, and the audit would fail for
    /// want of device memory on exactly the commitments (an honest W8A8 serve among them) that
    /// need those recomputes.
    fn keeps_for(&self, compute: Compute) -> bool {
        self.device.is_cpu() || compute == Compute::Bf16 || self.residency == Residency::Streaming
    }

    /// Whether decoded tensors are kept now: under [`Residency::Resident`], or streamed while
    /// a [`Weights::hold`] is on.
    fn keeps(&self) -> bool {
        self.residency == Residency::Resident
            || self.held.load(std::sync::atomic::Ordering::Acquire)
    }

    /// Streamed weights kept from now until [`Weights::release_held`]: a pass that runs one
    /// layer for several sequences before the next layer ([`super::Architecture::forward_many`])
    /// reads and decodes each of the layer's tensors once for all of them, and holds at most
    /// one layer (plus the few tensors outside the layers) at a time. The arithmetic is the
    /// streamed pass's: only what is read again changes, and on a GPU a bf16 recompute stacks
    /// every routed expert of a layer ([`Weights::keeps_stacks`]) so that each sequence finds
    /// the stack whatever it routes. `on = false` stops keeping and releases what is held.
    /// Under [`Residency::Resident`] everything is kept anyway and this does nothing.
    pub fn hold(&self, on: bool) {
        if self.residency == Residency::Resident {
            return;
        }
        self.held.store(on, std::sync::atomic::Ordering::Release);
        if !on {
            self.release_held();
        }
    }

    /// [`Weights::hold`] on until the returned guard is dropped, on every path out of the
    /// caller (an error included): a batched pass holds its layers through it.
    pub fn held(&self) -> Held<'_> {
        self.hold(true);
        Held(self)
    }

    /// Drops every decoded tensor kept so far, [`Residency::Resident`] included: the auditor's
    /// way out when a GPU recompute runs out of device memory beside a resident model's kept
    /// bf16 weights ([`crate::audit`]). The next pass decodes what it needs again (and keeps it,
    /// where it keeps anything); the values are the same.
    pub fn drop_kept(&self) {
        if let Ok(mut m) = self.resident.write() {
            m.clear();
        }
    }

    /// Drops what a [`Weights::hold`] kept (between two layers of a batched pass); the hold
    /// stays on. Nothing under [`Residency::Resident`].
    pub fn release_held(&self) {
        if self.residency == Residency::Resident {
            return;
        }
        if let Ok(mut m) = self.resident.write() {
            m.clear();
        }
    }

    /// The kept tensor `key` ([`Weights::keeps`]).
    fn kept(&self, key: &str) -> Option<Tensor> {
        if !self.keeps() {
            return None;
        }
        self.resident.read().ok()?.get(key).cloned()
    }

    /// Keeps `t` as `key` ([`Weights::keeps`]).
    fn keep(&self, key: String, t: &Tensor) {
        if self.keeps() {
            if let Ok(mut m) = self.resident.write() {
                m.insert(key, t.clone());
            }
        }
    }

    /// [`Weights::stacked`] made now; `keep_parts`: whether the tensors decoded one by one (off
    /// the device path) are kept under [`Residency::Resident`].
    fn stack_fresh(
        &self,
        names: &[String],
        out: usize,
        inp: usize,
        compute: Compute,
        keep_parts: bool,
    ) -> Result<Tensor, ModelError> {
        let cheat = matches!(self.precision, Precision::Int4 { .. });
        if !self.device.is_cpu() && !cheat && !names.is_empty() {
            if let Some(t) = self.stack_on_device(names, out, inp, compute)? {
                return Ok(t);
            }
        }
        let parts = names
            .iter()
            .map(|n| self.get_kept(n, Some(&[out, inp]), true, false, compute, keep_parts))
            .collect::<Result<Vec<_>, _>>()?;
        if parts.is_empty() {
            return Ok(Tensor::zeros(
                (0, out, inp),
                candle_core::DType::F32,
                &self.device,
            )?);
        }
        let t = Tensor::stack(&parts, 0)?;
        Ok(if !self.device.is_cpu() && compute == Compute::Bf16 {
            t.to_dtype(candle_core::DType::BF16)?
        } else {
            t
        })
    }

    /// [`Weights::stacked`] on a GPU: `None` when the tensors are not all plain bf16/f16/f32
    /// of one dtype or all block FP8 with float tile scales of one dtype.
    fn stack_on_device(
        &self,
        names: &[String],
        out: usize,
        inp: usize,
        compute: Compute,
    ) -> Result<Option<Tensor>, ModelError> {
        use candle_core::DType as C;
        let float_dtype = |d: Dtype| match d {
            Dtype::BF16 => Some(C::BF16),
            Dtype::F16 => Some(C::F16),
            Dtype::F32 => Some(C::F32),
            _ => None,
        };
        let mut dtypes = Vec::with_capacity(names.len());
        for n in names {
            dtypes.push(self.bytes(n)?.0.dtype);
        }
        let dtype = dtypes[0];
        let stored_as_is = float_dtype(dtype).is_some() || dtype == Dtype::F8_E4M3;
        if !stored_as_is || dtypes.iter().any(|d| *d != dtype) {
            // NVFP4 (packed, its stored shape is not the logical one) and the like.
            return Ok(None);
        }
        for n in names {
            check_shape(n, self.shape(n).unwrap_or_default(), Some(&[out, inp]))?;
        }
        // One host buffer per kind, read in parallel, one copy up.
        let dev = &self.device;
        let e = names.len();
        let held = |t: Tensor| -> Result<Tensor, ModelError> {
            Ok(match compute {
                Compute::Bf16 => t.to_dtype(C::BF16)?,
                Compute::F32 => t.to_dtype(C::F32)?,
            })
        };
        if let Some(c) = float_dtype(dtype) {
            let t = Tensor::from_raw_buffer(&self.gather(names)?, c, &[e, out, inp], dev)?;
            return Ok(Some(held(t)?));
        }
        if dtype != Dtype::F8_E4M3 {
            return Ok(None);
        }
        let Some((scale_names, sc)) = self.fp8_scales(names, out, inp)? else {
            return Ok(None);
        };
        // One kernel decodes the whole stack in place (no f32 intermediate, no concatenation)
        // where it applies ([`Weights::fp8_upload`] says).
        if let Some(st) = self.fp8_upload(names, &scale_names, sc, out, inp)? {
            let dtype = match compute {
                Compute::Bf16 => C::BF16,
                Compute::F32 => C::F32,
            };
            return Ok(Some(st.decode(&super::fp8_kernels::all(e), dtype)?));
        }
        let [bn, bk] = self.fp8_block;
        let (tn, tk) = (out.div_ceil(bn), inp.div_ceil(bk));
        let scale = Tensor::from_raw_buffer(&self.gather(&scale_names)?, sc, &[e, tn, tk], dev)?
            .to_dtype(C::F32)?;
        // Each element's tile, by row and by column (the last tiles may be partial).
        let tile = |len: usize, b: usize| -> Result<Tensor, ModelError> {
            let v: Vec<u32> = (0..len).map(|i| (i / b) as u32).collect();
            Ok(Tensor::from_vec(v, len, dev)?)
        };
        let (row_tile, col_tile) = (tile(out, bn)?, tile(inp, bk)?);
        let whole = out.is_multiple_of(bn) && inp.is_multiple_of(bk);
        let table = self.e4m3_on_device()?;
        // Read at once, decoded a few experts at a time, so the f32 intermediate stays small
        // on a 24 GB card.
        let all = self.gather(names)?;
        let per = experts_per_decode(out, inp);
        let mut done = Vec::with_capacity(e.div_ceil(per));
        for start in (0..e).step_by(per) {
            let n = per.min(e - start);
            let bytes = &all[start * out * inp..(start + n) * out * inp];
            let codes = crate::device::phase(dev, "weights: upload", || self.upload(bytes))?;
            let s = scale.narrow(0, start, n)?;
            let w = if whole {
                // Whole tiles: one broadcast product per tile.
                table
                    .index_select(&codes, 0)?
                    .reshape((n, tn, bn, tk, bk))?
                    .broadcast_mul(&s.reshape((n, tn, 1, tk, 1))?)?
                    .reshape((n, out, inp))?
            } else {
                let s = s.index_select(&row_tile, 1)?.index_select(&col_tile, 2)?;
                (table.index_select(&codes, 0)?.reshape((n, out, inp))? * s)?
            };
            done.push(held(w)?);
        }
        Ok(Some(if done.len() == 1 {
            done.remove(0)
        } else {
            Tensor::cat(&done, 0)?
        }))
    }

    /// The tile scales' names of the block-FP8 weights `names` (each `[out, inp]`) and their
    /// one float dtype, or `None` when a weight has no scale grid of `weight_block_size`'s
    /// shape or the scales are not all one float dtype.
    fn fp8_scales(
        &self,
        names: &[String],
        out: usize,
        inp: usize,
    ) -> Result<Option<(Vec<String>, candle_core::DType)>, ModelError> {
        use candle_core::DType as C;
        let [bn, bk] = self.fp8_block;
        if bn == 0 || bk == 0 {
            return Ok(None);
        }
        let (tn, tk) = (out.div_ceil(bn), inp.div_ceil(bk));
        let scale_names: Vec<String> = names.iter().map(|n| format!("{n}_scale_inv")).collect();
        let mut sdtypes = Vec::with_capacity(names.len());
        for n in &scale_names {
            match self.entry(n) {
                Some(se) if se.shape == [tn, tk] => sdtypes.push(se.dtype),
                _ => return Ok(None),
            }
        }
        let sc = match sdtypes.first() {
            Some(Dtype::BF16) => C::BF16,
            Some(Dtype::F16) => C::F16,
            Some(Dtype::F32) => C::F32,
            _ => return Ok(None),
        };
        if sdtypes.iter().any(|d| *d != sdtypes[0]) {
            return Ok(None);
        }
        Ok(Some((scale_names, sc)))
    }

    /// The block-FP8 weights `names` (each `[out, inp]`, scales `scale_names` stored as `sc`)
    /// on the GPU as stored ([`super::fp8_kernels::Fp8Stack`]): the codes read on the host at
    /// once (or taken from [`Weights::prefetch`]) and sent up in staged copies of at most
    /// 64 MiB into one buffer. `None` where the decode kernel does not apply.
    fn fp8_upload(
        &self,
        names: &[String],
        scale_names: &[String],
        sc: candle_core::DType,
        out: usize,
        inp: usize,
    ) -> Result<Option<super::fp8_kernels::Fp8Stack>, ModelError> {
        use candle_core::DType as C;
        let dev = &self.device;
        if !super::fp8_kernels::enabled() || dev.is_cpu() {
            return Ok(None);
        }
        let e = names.len();
        let [bn, bk] = self.fp8_block;
        let (tn, tk) = (out.div_ceil(bn), inp.div_ceil(bk));
        let scale = Tensor::from_raw_buffer(&self.gather(scale_names)?, sc, &[e, tn, tk], dev)?
            .to_dtype(C::F32)?;
        let all = self.gather(names)?;
        let per = experts_per_decode(out, inp);
        let mut parts = Vec::with_capacity(e.div_ceil(per));
        for start in (0..e).step_by(per) {
            let bytes = &all[start * out * inp..(start + per.min(e - start)) * out * inp];
            parts.push(crate::device::phase(dev, "weights: upload", || {
                self.upload(bytes)
            })?);
        }
        let codes = match parts.len() {
            1 => parts.remove(0),
            _ => Tensor::cat(&parts, 0)?,
        };
        Ok(Some(super::fp8_kernels::Fp8Stack {
            codes,
            scale,
            table: self.e4m3_on_device()?.clone(),
            dims: (e, out, inp),
            block: [bn, bk],
        }))
    }

    /// The routed experts `names` (each `[out, inp]`) as stored, on a GPU, for a recompute
    /// that multiplies their exact f32 dequantisation and decodes only the few experts each
    /// product needs ([`super::experts`]): `Some` for block-FP8 weights with float tile scales
    /// when the decode kernel applies ([`super::fp8_kernels`]); `None` elsewhere (the CPU, the
    /// int4 cheat, other formats), where [`Weights::stacked`] stacks them decoded.
    ///
    /// # Errors
    /// [`ModelError::Shape`] when a weight is not `[out, inp]`, read and device errors.
    pub fn stacked_fp8(
        &self,
        names: &[String],
        out: usize,
        inp: usize,
    ) -> Result<Option<super::fp8_kernels::Fp8Stack>, ModelError> {
        let cheat = matches!(self.precision, Precision::Int4 { .. });
        if cheat || self.device.is_cpu() || names.is_empty() {
            return Ok(None);
        }
        for n in names {
            if self.entry(n).map(|e| e.dtype) != Some(Dtype::F8_E4M3) {
                return Ok(None);
            }
            check_shape(n, self.shape(n).unwrap_or_default(), Some(&[out, inp]))?;
        }
        let Some((scale_names, sc)) = self.fp8_scales(names, out, inp)? else {
            return Ok(None);
        };
        self.fp8_upload(names, &scale_names, sc, out, inp)
    }

    /// Decodes `name` to f32, dequantising a quantised weight ([`Weights::quantised`]).
    fn decode(&self, name: &str) -> Result<(Vec<usize>, Vec<f32>), ModelError> {
        if let Some(m) = self.quantised(name)? {
            return Ok((m.shape().to_vec(), m.dequantise()));
        }
        let (e, data, path) = self.bytes(name)?;
        let v = quant::floats(e.dtype, data).ok_or_else(|| ModelError::Safetensors {
            file: path.to_path_buf(),
            msg: format!("tensor {name}: unsupported dtype {:?}", e.dtype),
        })?;
        Ok((e.shape.clone(), v))
    }

    /// The 2-D weight `name` as stored (quantised, or plain BF16 / F16 / F32 / unscaled E4M3), for
    /// [`QuantMatrix::linear`].
    fn stored(&self, name: &str) -> Result<QuantMatrix<'_>, ModelError> {
        if let Some(m) = self.quantised(name)? {
            return Ok(m);
        }
        let (e, data, path) = self.bytes(name)?;
        let bad = |msg: String| ModelError::Safetensors {
            file: path.to_path_buf(),
            msg: format!("tensor {name}: {msg}"),
        };
        let [n, k] = e.shape[..] else {
            return Err(bad(format!("weight of shape {:?} is not 2-D", e.shape)));
        };
        QuantMatrix::float(e.dtype, data, n, k).ok_or_else(|| {
            bad(format!(
                "unsupported dtype {:?} or size for a [{n}, {k}] weight",
                e.dtype
            ))
        })
    }

    fn get(&self, name: &str, want: Option<&[usize]>, cheat: bool) -> Result<Tensor, ModelError> {
        self.get_as(name, want, cheat, false, Compute::F32)
    }

    /// Whether `name`, decoded, needs rounding to be held in `compute`: only a bf16 recompute
    /// of a tensor not stored as bf16 (block FP8, NVFP4, f32), which a bf16 model holds as the
    /// bf16 rounding of its dequantised value.
    fn rounds(&self, name: &str, compute: Compute) -> bool {
        compute == Compute::Bf16
            && self
                .entry(name)
                .is_none_or(|e| !matches!(e.dtype, Dtype::BF16))
    }

    fn get_as(
        &self,
        name: &str,
        want: Option<&[usize]>,
        cheat: bool,
        transpose: bool,
        compute: Compute,
    ) -> Result<Tensor, ModelError> {
        self.get_kept(name, want, cheat, transpose, compute, true)
    }

    /// [`Weights::get_as`]; `keep`: whether a tensor decoded now is kept under
    /// [`Residency::Resident`] (a kept one is returned either way).
    fn get_kept(
        &self,
        name: &str,
        want: Option<&[usize]>,
        cheat: bool,
        transpose: bool,
        compute: Compute,
        keep: bool,
    ) -> Result<Tensor, ModelError> {
        let cheat = cheat && matches!(self.precision, Precision::Int4 { .. });
        let round = self.rounds(name, compute);
        let key = format!(
            "{name}{}{}{}",
            if cheat { "#int4" } else { "" },
            if transpose { "#t" } else { "" },
            if round { "#bf16" } else { "" }
        );
        if let Some(t) = self.kept(&key) {
            return Ok(t);
        }
        if !self.device.is_cpu() && !cheat {
            if let Some(mut t) = self.decode_on_device(name)? {
                if self.residency == Residency::Streaming {
                    self.release_pages(name);
                }
                check_shape(name, t.dims(), want)?;
                if round {
                    t = compute.round(t)?;
                }
                if transpose {
                    t = t.t()?.contiguous()?;
                }
                if keep {
                    self.keep(key, &t);
                }
                return Ok(t);
            }
        }
        let (shape, mut v) = self.decode(name)?;
        if self.residency == Residency::Streaming {
            self.release_pages(name);
        }
        check_shape(name, &shape, want)?;
        if let (true, Precision::Int4 { group_size }) = (cheat, self.precision) {
            quantize_int4(&mut v, shape.last().copied().unwrap_or(1), group_size);
        }
        if round {
            v.iter_mut().for_each(|x| *x = compute.round_f32(*x));
        }
        let mut t = Tensor::from_vec(v, shape, &self.device)?;
        if transpose {
            t = t.t()?.contiguous()?;
        }
        if keep {
            self.keep(key, &t);
        }
        Ok(t)
    }

    /// Tensor `name` as f32 (dequantised when stored quantised), any shape.
    ///
    /// # Errors
    /// [`ModelError::MissingTensor`], [`ModelError::Safetensors`] for an unsupported dtype or
    /// inconsistent quantisation tensors.
    pub fn tensor(&self, name: &str) -> Result<Tensor, ModelError> {
        self.get(name, None, false)
    }

    /// Checks `name` against `shape` from the shard header alone, reading no data: what a
    /// streaming load checks up front, so that a `config.json` that contradicts the weights
    /// (say a `vocab_size` other than the embedding's rows) fails at open as a resident load
    /// does, not at first use (or never). A quantised tensor (one with a `_scale_inv` or
    /// `_scale` beside it) is stored in another shape and is checked when it is decoded.
    ///
    /// # Errors
    /// [`ModelError::MissingTensor`], [`ModelError::Shape`].
    pub fn check_stored(&self, name: &str, shape: &[usize]) -> Result<(), ModelError> {
        let Some(stored) = self.shape(name) else {
            return Err(ModelError::MissingTensor(self.resolve(name)));
        };
        let quantised =
            self.has(&format!("{name}_scale_inv")) || self.has(&format!("{name}_scale"));
        if quantised || stored == shape {
            return Ok(());
        }
        Err(ModelError::Shape {
            name: self.resolve(name),
            got: stored.to_vec(),
            want: shape.to_vec(),
        })
    }

    /// [`Weights::tensor`] checked against `shape`.
    ///
    /// # Errors
    /// As [`Weights::tensor`], and [`ModelError::Shape`].
    pub fn tensor_shaped(&self, name: &str, shape: &[usize]) -> Result<Tensor, ModelError> {
        self.get(name, Some(shape), false)
    }

    /// `<module>.weight` `[out, in]` as f32: routers, gates and other matrices the int4 cheat
    /// leaves alone.
    ///
    /// # Errors
    /// As [`Weights::tensor_shaped`].
    pub fn matrix(&self, module: &str, out: usize, inp: usize) -> Result<Tensor, ModelError> {
        self.get(&format!("{module}.weight"), Some(&[out, inp]), false)
    }

    /// `<module>.weight` `[out, in]` of a projection (attention, MLP, expert): as
    /// [`Weights::matrix`], with the int4 cheat applied when the precision is
    /// [`Precision::Int4`].
    ///
    /// # Errors
    /// As [`Weights::tensor_shaped`].
    pub fn projection(&self, module: &str, out: usize, inp: usize) -> Result<Tensor, ModelError> {
        self.get(&format!("{module}.weight"), Some(&[out, inp]), true)
    }

    /// [`Weights::projection`] transposed: `[in, out]`, contiguous, ready for `x · Wᵀ` as
    /// `x.matmul(wt)` ([`super::ops::linear_t`]); kept transposed under
    /// [`Residency::Resident`].
    ///
    /// # Errors
    /// As [`Weights::tensor_shaped`].
    pub fn projection_t(&self, module: &str, out: usize, inp: usize) -> Result<Tensor, ModelError> {
        self.projection_t_in(module, out, inp, Compute::F32)
    }

    /// [`Weights::projection_t`] as a model computing in `compute` holds it: with
    /// [`Compute::Bf16`], a weight not stored as bf16 (block FP8, NVFP4, f32) is the bf16
    /// rounding of its exact dequantised value, as when transformers loads dequantised weights
    /// into a bf16 model. Kept under [`Residency::Resident`] except, on a GPU, for a recompute
    /// other than bf16 ([`Weights::keeps_for`]).
    ///
    /// # Errors
    /// As [`Weights::projection_t`].
    pub fn projection_t_in(
        &self,
        module: &str,
        out: usize,
        inp: usize,
        compute: Compute,
    ) -> Result<Tensor, ModelError> {
        self.get_kept(
            &format!("{module}.weight"),
            Some(&[out, inp]),
            true,
            true,
            compute,
            self.keeps_for(compute),
        )
    }

    /// `x · Wᵀ` for the projection `<module>.weight` `[out, in]`: `x` `[.., in]` →
    /// `[.., out]`, f32. The same product as `ops::linear_t(x, &self.projection_t(..)?)`, int4
    /// cheat included, computed without keeping an f32 copy of `W` under
    /// [`Residency::Streaming`]:
    /// * up to [`FUSED_MAX_ROWS`] rows of `x` (a routed expert's few tokens, a decode step):
    ///   [`QuantMatrix::linear`] straight from the stored bytes;
    /// * more rows: `W` dequantised once and multiplied in place (no transposed copy).
    ///
    /// Under [`Residency::Resident`] the kept transposed weight is reused. On a GPU with
    /// [`Compute::Bf16`] the product is a bf16 one (bf16 operands, f32 accumulation, the output
    /// rounded to bf16, as a bf16 `nn.Linear`); callers round the output anyway. Results agree
    /// with the plain path up to the order of f32 summation.
    ///
    /// # Errors
    /// As [`Weights::projection`]; [`ModelError::Shape`] when the last dimension of `x` is not
    /// `inp`.
    pub fn linear(
        &self,
        module: &str,
        x: &Tensor,
        out: usize,
        inp: usize,
    ) -> Result<Tensor, ModelError> {
        self.linear_in(module, x, out, inp, Compute::F32)
    }

    /// [`Weights::linear`] with the weight as a model computing in `compute` holds it
    /// ([`Weights::projection_t_in`]).
    ///
    /// # Errors
    /// As [`Weights::linear`].
    pub fn linear_in(
        &self,
        module: &str,
        x: &Tensor,
        out: usize,
        inp: usize,
        compute: Compute,
    ) -> Result<Tensor, ModelError> {
        let cheat = matches!(self.precision, Precision::Int4 { .. });
        let name = format!("{module}.weight");
        if !self.device.is_cpu() && compute == Compute::Bf16 && !cheat {
            // A bf16 model's product: bf16 operands (`x` is a bf16 activation, the weight its
            // bf16 value), f32 accumulation, the output rounded once (cuBLAS with
            // CUBLAS_COMPUTE_32F, candle's default), on the tensor cores.
            // Under [`Residency::Resident`] the bf16 weight itself is kept (2 bytes per
            // parameter), not its f32 decode.
            use candle_core::DType as C;
            let key = format!("{name}#bf16-held");
            let w = match self.kept(&key) {
                Some(w) => w,
                None => {
                    let w = self
                        .get_kept(&name, Some(&[out, inp]), true, false, compute, false)?
                        .to_dtype(C::BF16)?;
                    self.keep(key, &w);
                    w
                }
            };
            let y = x.to_dtype(C::BF16)?.matmul(&w.t()?)?;
            return Ok(y.to_dtype(C::F32)?);
        }
        if self.residency == Residency::Resident
            || cheat
            || self.rounds(&name, compute)
            || !self.device.is_cpu()
        {
            let wt = self.projection_t_in(module, out, inp, compute)?;
            return Ok(x.matmul(&wt)?);
        }
        let mut dims = x.dims().to_vec();
        if dims.last() != Some(&inp) {
            return Err(ModelError::Shape {
                name: format!("input of {name}"),
                got: dims,
                want: vec![0, inp],
            });
        }
        let m = self.stored(&name)?;
        check_shape(&name, &m.shape(), Some(&[out, inp]))?;
        let n = dims[..dims.len() - 1].iter().product::<usize>();
        if let Some(d) = dims.last_mut() {
            *d = out;
        }
        let y = if n <= FUSED_MAX_ROWS && self.device.is_cpu() {
            let xs = x
                .to_dtype(candle_core::DType::F32)?
                .flatten_all()?
                .to_vec1::<f32>()?;
            let y = m.linear(&xs, n).ok_or_else(|| ModelError::Shape {
                name: format!("input of {name}"),
                got: x.dims().to_vec(),
                want: vec![n, inp],
            })?;
            Tensor::from_vec(y, dims, &self.device)?
        } else {
            let w = Tensor::from_vec(m.dequantise(), (out, inp), &self.device)?;
            let x2 = x.reshape((n, inp))?;
            x2.matmul(&w.t()?)?.reshape(dims)?
        };
        self.release_pages(&name);
        Ok(y)
    }

    /// Whether `<module>.weight` is stored block-FP8 (`F8_E4M3` with a `weight_scale_inv`
    /// beside it): a weight a W8A8 serve multiplies with quantised activations.
    pub fn is_block_fp8(&self, module: &str) -> bool {
        let name = format!("{module}.weight");
        self.dtype(&name) == Some(Dtype::F8_E4M3) && self.has(&format!("{name}_scale_inv"))
    }

    /// The activation group (columns, `weight_block_size[1]`) a W8A8 serve quantises the input
    /// of `<module>.weight` by, when that weight is block FP8 ([`Weights::is_block_fp8`]) and
    /// no int4 cheat replaces it; `None` otherwise (the product takes its input as it is).
    pub fn act_quant_group(&self, module: &str) -> Option<usize> {
        let cheat = matches!(self.precision, Precision::Int4 { .. });
        (!cheat && self.is_block_fp8(module)).then_some(self.fp8_block[1])
    }

    /// [`Weights::linear_in`] as a serve whose products with block-FP8 weights treat their
    /// input rows as `acts` says ([`super::Fp8Activations`]). With
    /// [`super::Fp8Activations::PerTokenGroup`] and a block-FP8 weight (and no int4 cheat):
    /// `x` `[.., inp]` is quantised per row and per `weight_block_size[1]` columns
    /// ([`quant::act_quant_rows`], sglang's `per_token_group_quant_fp8`), then multiplied in
    /// f32 by the exactly dequantised weight (`W8A8`: f32 accumulation; the caller rounds the
    /// output to its activation dtype, as the kernel casts its f32 accumulator to bf16). On a
    /// GPU the quantisation runs there ([`quant::act_quant_tensor`], the same values), on the
    /// host for a ragged last group or with `ENGY_FUSED_ACT_QUANT=0` (`[rows, inp]` f32 each
    /// way). Otherwise exactly [`Weights::linear_in`].
    ///
    /// # Errors
    /// As [`Weights::linear`].
    pub fn linear_as(
        &self,
        module: &str,
        x: &Tensor,
        out: usize,
        inp: usize,
        compute: Compute,
        acts: super::Fp8Activations,
    ) -> Result<Tensor, ModelError> {
        let group = match acts {
            super::Fp8Activations::PerTokenGroup => self.act_quant_group(module),
            super::Fp8Activations::Unquantised => None,
        };
        let Some(group) = group else {
            return self.linear_in(module, x, out, inp, compute);
        };
        let mut dims = x.dims().to_vec();
        if dims.last() != Some(&inp) {
            return Err(ModelError::Shape {
                name: format!("input of {module}.weight"),
                got: dims,
                want: vec![0, inp],
            });
        }
        let n = dims[..dims.len() - 1].iter().product::<usize>();
        let xq = quant::act_quant(x, group)?.reshape((n, inp))?;
        let wt = self.projection_t_in(module, out, inp, Compute::F32)?;
        if let Some(d) = dims.last_mut() {
            *d = out;
        }
        Ok(xq.matmul(&wt)?.reshape(dims)?)
    }

    /// [`Weights::matrix`] transposed (`[in, out]`, contiguous).
    ///
    /// # Errors
    /// As [`Weights::tensor_shaped`].
    pub fn matrix_t(&self, module: &str, out: usize, inp: usize) -> Result<Tensor, ModelError> {
        self.get_as(
            &format!("{module}.weight"),
            Some(&[out, inp]),
            false,
            true,
            Compute::F32,
        )
    }

    /// Rows `ids` of the 2-D tensor `name` (an embedding) as `[ids.len(), cols]` f32. With
    /// [`Residency::Streaming`] only those rows are decoded.
    ///
    /// # Errors
    /// As [`Weights::tensor`]; [`ModelError::TokenOutOfVocab`] for an id past the last row.
    pub fn rows(&self, name: &str, ids: &[u32]) -> Result<Tensor, ModelError> {
        let (rows, cols) = match self.shape(name) {
            Some(&[r, c]) => (r, c),
            Some(s) => {
                return Err(ModelError::Shape {
                    name: name.to_string(),
                    got: s.to_vec(),
                    want: vec![0, 0],
                })
            }
            None => return Err(ModelError::MissingTensor(self.resolve(name))),
        };
        if let Some(&id) = ids.iter().find(|&&i| i as usize >= rows) {
            return Err(ModelError::TokenOutOfVocab { id, vocab: rows });
        }
        let quantised =
            self.has(&format!("{name}_scale_inv")) || self.has(&format!("{name}_scale"));
        if self.residency == Residency::Resident || quantised {
            let t = self.tensor(name)?;
            let idx = Tensor::new(ids, &self.device)?;
            return Ok(t.index_select(&idx, 0)?);
        }
        let (e, data, path) = self.bytes(name)?;
        let width = match e.dtype {
            Dtype::BF16 | Dtype::F16 => 2,
            Dtype::F32 => 4,
            other => {
                return Err(ModelError::Safetensors {
                    file: path.to_path_buf(),
                    msg: format!("embedding {name} has unsupported dtype {other:?}"),
                })
            }
        };
        let mut out = Vec::with_capacity(ids.len() * cols);
        for &id in ids {
            let row = &data[id as usize * cols * width..(id as usize + 1) * cols * width];
            out.extend(quant::floats(e.dtype, row).unwrap_or_default());
        }
        Ok(Tensor::from_vec(out, (ids.len(), cols), &self.device)?)
    }
}

/// The per-expert pieces of a fused routed-expert tensor: `(stored suffix, [(per-expert
/// suffix, first row, rows)])` for the rows of each expert's `[rows, …]` slice.
fn fused_pieces(suffix: &str, rows: usize) -> Option<Vec<(String, usize, usize)>> {
    let (base, tail) = match suffix.find("_proj") {
        Some(i) => suffix.split_at(i + "_proj".len()),
        None => return None,
    };
    // `gate_up_proj` [E, 2I, H]: gate = rows 0..I, up = rows I..2I of each expert (transformers 5
    // `gate, up = linear(x, gate_up_proj[e]).chunk(2, dim=-1)`); `down_proj` [E, H, I] whole.
    // What follows `_proj`: nothing or `.weight` (the weight), `[.weight]_scale_inv`,
    // `[.weight]_scale`, `[.weight]_scale_2`, or `[.|_]input_scale`.
    let t = tail.strip_prefix('.').unwrap_or(tail);
    let t = t.strip_prefix("weight").unwrap_or(t);
    let leaf = if t.contains("input_scale") {
        ".input_scale".to_string()
    } else {
        format!(".weight{t}")
    };
    match base {
        "gate_up_proj" if rows.is_multiple_of(2) => Some(vec![
            (format!("gate_proj{}", leaf), 0, rows / 2),
            (format!("up_proj{}", leaf), rows / 2, rows / 2),
        ]),
        "down_proj" => Some(vec![(format!("down_proj{}", leaf), 0, rows)]),
        _ => None,
    }
}

/// Fused routed experts (transformers 5 and some releases: `…mlp.experts.gate_up_proj`
/// `[E, 2I, H]`, `…mlp.experts.down_proj` `[E, H, I]`, block-FP8 scales `…_scale_inv` and NVFP4
/// scales `…_scale` split the same way; specs/SCHEME.md "Fused experts") become per-expert
/// entries `…mlp.experts.{e}.{gate,up,down}_proj.weight[_scale_inv|_scale]` over the same bytes,
/// so the architectures read one layout. A per-tensor NVFP4 `_scale_2` (shape `[]`) is shared by
/// every expert; one of shape `[E]` is split.
///
/// # Errors
/// `(shard, message)` when a fused tensor's bytes do not split into `E` equal experts, when a
/// block-FP8 tile would straddle the gate/up boundary (`I` not a multiple of the tile rows
/// `bn`: transformers dequantises the fused matrix, engy reads gate and up apart), or when a
/// per-expert name already exists.
fn split_fused_experts(
    index: &mut HashMap<String, Entry>,
    bn: usize,
) -> Result<(), (usize, String)> {
    let fused: Vec<(String, String, String)> = index
        .keys()
        .filter_map(|k| {
            let (head, suffix) = k.split_once(".mlp.experts.")?;
            let first = suffix.split('.').next()?;
            (first.parse::<usize>().is_err() && suffix.contains("_proj"))
                .then(|| (k.clone(), head.to_string(), suffix.to_string()))
        })
        .collect();
    // Per layer: the expert count and the fused gate_up rows (2I), from the weights themselves.
    let mut layer: HashMap<String, (usize, usize)> = HashMap::new();
    for (name, head, suffix) in &fused {
        let Some(e) = index.get(name) else { continue };
        let is_weight = !suffix.contains("_scale") && !suffix.contains("input_");
        if let (true, [n, rows, ..]) = (is_weight, &e.shape[..]) {
            let slot = layer.entry(head.clone()).or_insert((*n, 0));
            if suffix.starts_with("gate_up_proj") {
                slot.1 = *rows;
            }
        }
    }
    for (name, head, suffix) in fused {
        let Some(e) = index.remove(&name) else {
            continue;
        };
        let bad = |msg: String| (e.shard, format!("fused expert tensor {name}: {msg}"));
        let Some(&(experts, gate_up_rows)) = layer.get(&head) else {
            return Err(bad(
                "no fused gate_up_proj or down_proj weight beside it".into()
            ));
        };
        if e.shape.is_empty() || e.shape == [1] {
            // A per-tensor scalar (NVFP4 `_scale_2`, `input_scale`): shared by every expert.
            let Some(pieces) = fused_pieces(&suffix, 2) else {
                return Err(bad("not a gate_up_proj or down_proj tensor".into()));
            };
            for x in 0..experts {
                for (leaf, _, _) in &pieces {
                    insert_new(index, format!("{head}.mlp.experts.{x}.{leaf}"), e.clone())
                        .map_err(&bad)?;
                }
            }
            continue;
        }
        let (n, inner) = match e.shape.split_first() {
            Some((&n, rest)) => (n, rest.to_vec()),
            None => return Err(bad("no expert dimension".into())),
        };
        if n != experts {
            return Err(bad(format!(
                "dim 0 is {n}, the layer's fused weights have {experts} experts"
            )));
        }
        let len = e.end - e.start;
        if !len.is_multiple_of(experts) {
            return Err(bad(format!(
                "{len} bytes do not split into {experts} experts"
            )));
        }
        let per = len / experts;
        // An expert's `_scale_2` of shape [E] is one scalar per expert.
        let rows = inner.first().copied().unwrap_or(2);
        if suffix.starts_with("gate_up_proj") && suffix.ends_with("_scale_inv") {
            let i = gate_up_rows / 2;
            if !i.is_multiple_of(bn.max(1)) || rows * bn.max(1) != gate_up_rows {
                return Err(bad(format!(
                    "the gate/up split at row {i} falls inside a {bn}-row FP8 tile; such a \
                     checkpoint is not supported (store the experts per expert)"
                )));
            }
        }
        let Some(pieces) = fused_pieces(&suffix, rows) else {
            return Err(bad(
                "not a gate_up_proj or down_proj tensor, or an odd row count".into(),
            ));
        };
        let scalar_each = inner.is_empty();
        let row_bytes = if scalar_each { per } else { per / rows.max(1) };
        if !scalar_each && !per.is_multiple_of(rows.max(1)) {
            return Err(bad(format!(
                "{per} bytes per expert do not split into {rows} rows"
            )));
        }
        for x in 0..experts {
            for (leaf, row0, nrows) in &pieces {
                let (start, end, shape) = if scalar_each {
                    let s = e.start + x * per;
                    (s, s + per, vec![])
                } else {
                    let s = e.start + x * per + row0 * row_bytes;
                    let mut shape = inner.clone();
                    shape[0] = *nrows;
                    (s, s + nrows * row_bytes, shape)
                };
                let piece = Entry {
                    shard: e.shard,
                    dtype: e.dtype,
                    shape,
                    start,
                    end,
                };
                insert_new(index, format!("{head}.mlp.experts.{x}.{leaf}"), piece).map_err(&bad)?;
            }
        }
    }
    Ok(())
}

fn insert_new(index: &mut HashMap<String, Entry>, name: String, e: Entry) -> Result<(), String> {
    if index.contains_key(&name) {
        return Err(format!("{name} is stored both fused and per expert"));
    }
    index.insert(name, e);
    Ok(())
}

fn check_shape(name: &str, got: &[usize], want: Option<&[usize]>) -> Result<(), ModelError> {
    match want {
        Some(w) if w != got => Err(ModelError::Shape {
            name: name.to_string(),
            got: got.to_vec(),
            want: w.to_vec(),
        }),
        _ => Ok(()),
    }
}

/// How many `[out, inp]` experts a host-side FP8 stack decode handles at a time: about 2^26
/// values (256 MiB of f32) a step, at least one expert, so the f32 intermediate stays small on
/// a 24 GB card.
fn experts_per_decode(out: usize, inp: usize) -> usize {
    (1usize << 26).div_ceil((out * inp).max(1)).max(1)
}

#[cfg(test)]
mod tests {
    use safetensors::tensor::TensorView;

    use super::*;

    /// One block-FP8 projection `p.weight` `[out, in]` (partial 128×128 tiles) and one bf16
    /// projection `b.weight`, written as a real safetensors shard.
    fn checkpoint(dir: &Path, out: usize, inp: usize) {
        let q: Vec<u8> = (0..out * inp)
            .map(|i| {
                let b = ((i * 2_654_435_761) >> 11) as u8;
                if b & 0x7f == 0x7f {
                    0x3f
                } else {
                    b
                }
            })
            .collect();
        let grid = out.div_ceil(128) * inp.div_ceil(128);
        let scale: Vec<u8> = (0..grid)
            .flat_map(|i| (0.25 + i as f32 * 0.125).to_le_bytes())
            .collect();
        let b16: Vec<u8> = (0..out * inp)
            .flat_map(|i| half::bf16::from_f32((i % 23) as f32 / 11.0 - 1.0).to_le_bytes())
            .collect();
        let t = [
            ("p.weight", Dtype::F8_E4M3, vec![out, inp], &q),
            (
                "p.weight_scale_inv",
                Dtype::F32,
                vec![out.div_ceil(128), inp.div_ceil(128)],
                &scale,
            ),
            ("b.weight", Dtype::BF16, vec![out, inp], &b16),
        ];
        let views: Vec<(String, TensorView<'_>)> = t
            .iter()
            .map(|(n, d, s, b)| (n.to_string(), TensorView::new(*d, s.clone(), b).unwrap()))
            .collect();
        safetensors::tensor::serialize_to_file(views, None, &dir.join("w.safetensors")).unwrap();
    }

    /// [`Weights::linear`] under streaming (the fused kernel up to [`FUSED_MAX_ROWS`] rows, the
    /// dequantise-once path above) against the resident transposed weight and candle's matmul.
    #[test]
    fn streaming_linear_matches_the_resident_product() {
        let dir = tempfile::tempdir().unwrap();
        let (out, inp) = (130, 257);
        checkpoint(dir.path(), out, inp);
        let open = |r| Weights::open(dir.path(), None, Precision::Bf16, r).unwrap();
        let (stream, resident) = (open(Residency::Streaming), open(Residency::Resident));
        for module in ["p", "b"] {
            let wt = resident.projection_t(module, out, inp).unwrap();
            let wabs = wt.abs().unwrap();
            for n in [1usize, 3, FUSED_MAX_ROWS, 17] {
                let x: Vec<f32> = (0..n * inp).map(|i| ((i % 7) as f32 - 3.0) / 3.0).collect();
                let x = Tensor::from_vec(x, (n, inp), &Device::Cpu).unwrap();
                let got = stream.linear(module, &x, out, inp).unwrap();
                assert_eq!(got.dims(), &[n, out]);
                let want = x.matmul(&wt).unwrap();
                let mag = x.abs().unwrap().matmul(&wabs).unwrap();
                let (got, want, mag) = (
                    got.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
                    want.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
                    mag.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
                );
                for (j, ((g, e), m)) in got.iter().zip(&want).zip(&mag).enumerate() {
                    assert!(
                        (g - e).abs() <= 1e-5 * m,
                        "{module} n={n} [{j}]: streaming {g}, resident {e}"
                    );
                }
                assert_eq!(
                    resident.linear(module, &x, out, inp).unwrap().dims(),
                    &[n, out]
                );
            }
        }
        let x = Tensor::zeros((2, inp + 1), candle_core::DType::F32, &Device::Cpu).unwrap();
        assert!(matches!(
            stream.linear("p", &x, out, inp + 1),
            Err(ModelError::Shape { .. })
        ));
        assert!(matches!(
            stream.linear("p", &x, out, inp),
            Err(ModelError::Shape { .. })
        ));
    }

    /// The GPU decode ([`Weights::decode_on_device`], run here on the CPU backend) gives the
    /// host decode's values bit for bit, for every block-FP8 and bf16 tensor of the FP8
    /// oracle checkpoints.
    #[test]
    fn the_device_decode_is_the_host_decode() {
        let root =
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/vectors/arch");
        let mut fp8 = 0;
        for case in ["qwen3_5_moe_fp8", "glm_moe_dsa_fp8"] {
            let dir = root.join(case);
            let cfg = crate::arch::TextConfig::read(&dir).unwrap();
            let w = Weights::open(
                &dir,
                cfg.quantization.as_ref(),
                Precision::Bf16,
                Residency::Streaming,
            )
            .unwrap();
            let prefix = w.text_prefix().to_string();
            let mut names: Vec<String> = w
                .names()
                .filter_map(|n| match n.strip_prefix(&prefix) {
                    Some(rest) => Some(format!("model.{rest}")),
                    None => n.starts_with("lm_head").then(|| n.to_string()),
                })
                .collect();
            names.sort();
            for name in names {
                let Some(t) = w.decode_on_device(&name).unwrap() else {
                    continue;
                };
                if w.entry(&name).unwrap().dtype == Dtype::F8_E4M3 {
                    fp8 += 1;
                }
                let (shape, want) = w.decode(&name).unwrap();
                assert_eq!(t.dims(), &shape[..], "{name}");
                let got = t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
                let same = got
                    .iter()
                    .zip(&want)
                    .all(|(a, b)| a.to_bits() == b.to_bits());
                assert!(same, "{case} {name}: the device decode differs");
            }
        }
        assert!(
            fp8 > 0,
            "no block-FP8 tensor was decoded on the device path"
        );
    }

    /// The GPU's stacked decode of one layer's experts (run here on the CPU backend) holds
    /// each expert's host decode bit for bit, bf16-rounded for a bf16 recompute, for the bf16
    /// and the block-FP8 oracle checkpoints.
    #[test]
    fn the_stacked_device_decode_is_the_host_decode() {
        let root =
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/vectors/arch");
        let mut cases = 0;
        let nvfp4 = root.join("glm_moe_dsa_nvfp4");
        let cfg = crate::arch::TextConfig::read(&nvfp4).unwrap();
        let w = Weights::open(
            &nvfp4,
            cfg.quantization.as_ref(),
            Precision::Bf16,
            Residency::Streaming,
        )
        .unwrap();
        let names = ["model.layers.1.mlp.experts.1.gate_proj.weight".to_string()];
        let [out, kh] = w.shape(&names[0]).unwrap() else {
            panic!("NVFP4 weight not 2-D")
        };
        let got = w
            .stack_on_device(&names, *out, kh * 2, Compute::Bf16)
            .unwrap();
        assert!(got.is_none(), "NVFP4 is decoded on the host");
        for case in ["qwen3_5_moe", "qwen3_5_moe_fp8", "glm_moe_dsa_fp8"] {
            let dir = root.join(case);
            let cfg = crate::arch::TextConfig::read(&dir).unwrap();
            let w = Weights::open(
                &dir,
                cfg.quantization.as_ref(),
                Precision::Bf16,
                Residency::Streaming,
            )
            .unwrap();
            let layer = (0..cfg.num_hidden_layers)
                .find(|l| w.has(&format!("model.layers.{l}.mlp.experts.0.down_proj.weight")))
                .unwrap();
            let names: Vec<String> = [2usize, 0, 1]
                .iter()
                .map(|e| format!("model.layers.{layer}.mlp.experts.{e}.down_proj.weight"))
                .collect();
            let [out, inp] = w.shape(&names[0]).unwrap() else {
                panic!("{case}: a 2-D expert weight")
            };
            let (out, inp) = (*out, *inp);
            // The bf16 stack is read ahead, and the read is taken by the stack.
            let w = std::sync::Arc::new(w);
            for compute in [Compute::F32, Compute::Bf16] {
                if compute == Compute::Bf16 {
                    w.prefetch(names.clone());
                    w.prefetch(vec!["model.no.such.weight".into()]);
                    assert_eq!(w.prefetched.lock().unwrap().len(), 1, "{case}");
                }
                let t = w
                    .stack_on_device(&names, out, inp, compute)
                    .unwrap()
                    .unwrap_or_else(|| panic!("{case}: not stacked on the device path"));
                assert_eq!(t.dims(), &[3, out, inp], "{case}");
                let got = t.to_dtype(candle_core::DType::F32).unwrap();
                for (i, name) in names.iter().enumerate() {
                    let (_, want) = w.decode(name).unwrap();
                    let got = got.get(i).unwrap().flatten_all().unwrap();
                    let got = got.to_vec1::<f32>().unwrap();
                    let same = got
                        .iter()
                        .zip(&want)
                        .all(|(a, b)| a.to_bits() == compute.round_f32(*b).to_bits());
                    assert!(
                        same,
                        "{case} {name} {compute:?}: the stacked decode differs"
                    );
                }
                assert!(w.prefetched.lock().unwrap().is_empty(), "{case}");
            }
            cases += 1;
        }
        assert_eq!(cases, 3);

        // Whole tiles (the served checkpoints' case, one broadcast product per tile): the FP8
        // oracle's layer-0 gates `[24, 128]` read with 24×128 tiles are the same values.
        let dir = root.join("qwen3_5_moe_fp8");
        let quant = QuantConfig {
            method: "fp8".into(),
            weight_block_size: [24, 128],
            group_size: 16,
        };
        let w = Weights::open(&dir, Some(&quant), Precision::Bf16, Residency::Streaming).unwrap();
        let names: Vec<String> = (0..3)
            .map(|e| format!("model.layers.0.mlp.experts.{e}.gate_proj.weight"))
            .collect();
        let t = w
            .stack_on_device(&names, 24, 128, Compute::F32)
            .unwrap()
            .unwrap();
        for (i, name) in names.iter().enumerate() {
            let (_, want) = w.decode(name).unwrap();
            let got = t
                .get(i)
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1::<f32>()
                .unwrap();
            assert!(
                got.iter()
                    .zip(&want)
                    .all(|(a, b)| a.to_bits() == b.to_bits()),
                "{name}: the whole-tile stacked decode differs"
            );
        }
    }
}
