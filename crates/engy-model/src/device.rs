//! Where the forward pass runs: [`DeviceSpec`] (`cpu`, `cuda`, `cuda:N`), the one candle
//! [`Device`] per GPU, and the count of [`HostStep`]s, the parts of a pass that still copy
//! device data to the host and back (docs/AUDITOR.md "On a GPU").
//!
//! A CUDA device exists only in a build with the `cuda` feature (scripts/build-cuda.sh); in
//! the default build `cuda` parses and then fails with [`ModelError::Device`] saying so.
//! Every tensor of one pass must live on one candle device, and candle tells two handles of
//! the same GPU apart, so [`DeviceSpec::device`] hands out one shared handle per ordinal.
use std::fmt;
use std::str::FromStr;
use std::sync::atomic::{AtomicU64, Ordering};

use candle_core::Device;

use crate::ModelError;

/// A device named on the command line: `cpu`, `cuda` (= `cuda:0`) or `cuda:N`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Hash)]
pub enum DeviceSpec {
    /// The host, candle's CPU backend (the default; what CI runs).
    #[default]
    Cpu,
    /// GPU `N` through candle's CUDA backend (needs the `cuda` feature).
    Cuda(usize),
}

impl fmt::Display for DeviceSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DeviceSpec::Cpu => f.write_str("cpu"),
            DeviceSpec::Cuda(n) => write!(f, "cuda:{n}"),
        }
    }
}

impl FromStr for DeviceSpec {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "cpu" => Ok(DeviceSpec::Cpu),
            "cuda" => Ok(DeviceSpec::Cuda(0)),
            _ => s
                .strip_prefix("cuda:")
                .and_then(|n| n.parse().ok())
                .map(DeviceSpec::Cuda)
                .ok_or_else(|| format!("`{s}` is not a device: cpu, cuda or cuda:N")),
        }
    }
}

impl DeviceSpec {
    /// Whether this build can open a CUDA device (the `cuda` feature).
    pub const CUDA_BUILT: bool = cfg!(feature = "cuda");

    /// The candle device: the CPU, or the one shared handle of GPU `N`.
    ///
    /// # Errors
    /// [`ModelError::Device`] when this build has no CUDA backend, or when the driver cannot
    /// open GPU `N` (no driver, no such GPU, a toolkit the driver is too old for).
    pub fn device(self) -> Result<Device, ModelError> {
        match self {
            DeviceSpec::Cpu => Ok(Device::Cpu),
            DeviceSpec::Cuda(n) => cuda_device(n),
        }
    }
}

#[cfg(feature = "cuda")]
fn cuda_device(n: usize) -> Result<Device, ModelError> {
    use std::collections::HashMap;
    use std::sync::{Mutex, OnceLock};
    static OPEN: OnceLock<Mutex<HashMap<usize, Device>>> = OnceLock::new();
    let mut open = OPEN
        .get_or_init(|| Mutex::new(HashMap::new()))
        .lock()
        .map_err(|_| ModelError::Device("the device table was poisoned".into()))?;
    if let Some(d) = open.get(&n) {
        return Ok(d.clone());
    }
    let d = Device::new_cuda(n).map_err(|e| ModelError::Device(format!("cuda:{n}: {e}")))?;
    if let Device::Cuda(cd) = &d {
        if keeps_pool() {
            keep_pool(cd).map_err(|e| {
                ModelError::Device(format!(
                    "cuda:{n}: setting the memory pool's release threshold: {e} \
                     (ENGY_KEEP_POOL=0 leaves the driver's default)"
                ))
            })?;
        }
    }
    open.insert(n, d.clone());
    Ok(d)
}

/// Whether [`keep_pool`] runs: not turned off by `ENGY_KEEP_POOL=0`.
#[cfg(feature = "cuda")]
fn keeps_pool() -> bool {
    std::env::var("ENGY_KEEP_POOL").map_or(true, |v| v != "0")
}

/// Lets the device's default memory pool keep the memory freed into it (release threshold:
/// all of it). candle allocates every tensor from that pool (`cuMemAllocAsync`); with the
/// driver's default threshold of 0 every stream or event synchronisation hands the pool's free
/// memory back to the driver, and the next allocations map it again. An audit synchronises
/// at every MoE layer (the router's top-k to the host) and at every staged weight upload, so
/// that remapping recurred through the pass. The pool then holds at most the pass's peak,
/// which [`memory_in_use`] counts. `ENGY_KEEP_POOL=0` leaves the driver's default.
///
/// # Errors
/// The driver's error when the pool cannot be read or set.
#[cfg(feature = "cuda")]
#[allow(unsafe_code)]
fn keep_pool(cd: &candle_core::CudaDevice) -> Result<(), String> {
    use candle_core::cuda_backend::cudarc::driver::{result, sys};
    let ctx = cd.cuda_stream().context().clone();
    ctx.bind_to_thread().map_err(|e| e.to_string())?;
    let mut all = u64::MAX;
    // SAFETY: the device is the context's own; the release threshold's value is a u64.
    unsafe {
        let pool =
            result::device::get_default_mem_pool(ctx.cu_device()).map_err(|e| e.to_string())?;
        result::mem_pool::set_attribute(
            pool,
            sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
            (&mut all as *mut u64).cast(),
        )
        .map_err(|e| e.to_string())
    }
}

/// Recomputes run again after dropping a resident model's kept weights for want of device
/// memory ([`crate::audit`]), since the process started.
static MEMORY_RETRIES: AtomicU64 = AtomicU64::new(0);

/// How many recomputes ran out of device memory beside a resident model's kept weights and
/// were run again without them, since the process started (`engy-audit` reports it per
/// audit).
pub fn memory_retries() -> u64 {
    MEMORY_RETRIES.load(Ordering::Relaxed)
}

pub(crate) fn note_memory_retry() {
    MEMORY_RETRIES.fetch_add(1, Ordering::Relaxed);
}

/// Batched passes split in two for want of device memory ([`crate::audit::audit_many`]),
/// since the process started.
static BATCH_SPLITS: AtomicU64 = AtomicU64::new(0);

/// How many batched passes ran out of device memory and ran again as two halves, since the
/// process started (`engy-audit audit --batch` reports it per pass).
pub fn batch_splits() -> u64 {
    BATCH_SPLITS.load(Ordering::Relaxed)
}

pub(crate) fn note_batch_split() {
    BATCH_SPLITS.fetch_add(1, Ordering::Relaxed);
}

/// Hands the device memory that `device`'s pool keeps free ([`keep_pool`]) back to the
/// driver, once the device has finished its queued work. An audit calls it between its
/// recomputes on a GPU ([`crate::audit`]): a resident bf16 pass leaves the pool holding free
/// blocks of its own sizes, while the f32 and W8A8 recomputes that follow a failed bf16 one
/// allocate other sizes beside the kept weights, where an 80 GB card has little to spare.
/// Alone it did not keep a real-shape Qwen3.6 on an H100 within memory (with the driver's
/// default pool, `ENGY_KEEP_POOL=0`, it ran out too); holding the f32 and W8A8 experts as FP8
/// codes did (bench/RESULTS.md "A commitment that fails bf16 on a GPU"). Nothing on the CPU.
///
/// # Errors
/// [`ModelError::Device`] when the device cannot be synchronised or its pool not trimmed.
pub fn release_pool(device: &Device) -> Result<(), ModelError> {
    #[cfg(feature = "cuda")]
    if let Device::Cuda(cd) = device {
        return trim_pool(cd)
            .map_err(|e| ModelError::Device(format!("handing back the memory pool: {e}")));
    }
    let _ = device;
    Ok(())
}

/// [`release_pool`] on a GPU.
#[cfg(feature = "cuda")]
#[allow(unsafe_code)]
fn trim_pool(cd: &candle_core::CudaDevice) -> Result<(), String> {
    use candle_core::cuda_backend::cudarc::driver::result;
    let stream = cd.cuda_stream();
    stream.synchronize().map_err(|e| e.to_string())?;
    let ctx = stream.context().clone();
    ctx.bind_to_thread().map_err(|e| e.to_string())?;
    // SAFETY: the pool is the device's own default pool; trimming releases only memory no
    // allocation holds (the stream is idle, so every free queued on it has happened).
    unsafe {
        let pool =
            result::device::get_default_mem_pool(ctx.cu_device()).map_err(|e| e.to_string())?;
        result::mem_pool::trim_to(pool, 0).map_err(|e| e.to_string())
    }
}

#[cfg(not(feature = "cuda"))]
fn cuda_device(n: usize) -> Result<Device, ModelError> {
    Err(ModelError::Device(format!(
        "cuda:{n}: this binary was built without the `cuda` feature \
         (build it with scripts/build-cuda.sh, docs/AUDITOR.md \"On a GPU\")"
    )))
}

/// A part of the forward pass that reads device data on the host and writes its result back:
/// on the CPU a no-op, on a GPU a synchronising copy each way. Counted so a run says what it
/// did not do on the device ([`host_steps`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HostStep {
    /// A MoE router's top-k: `[T, n_experts]` scores to the host, the chosen experts back as
    /// index tensors (torch's tie order is kept by [`crate::arch::ops`]).
    Routing,
    /// The DSA indexer's per-query top-k of key positions and the mask built from it.
    DsaTopK,
    /// GLM's interleaved rotary embedding of MLA and indexer queries/keys on the host. A GPU
    /// pass now rotates on the device (`glm_moe_dsa::rope_tensor`), so it stays 0 there; kept
    /// so that reports and the counters' order do not change.
    Rope,
}

impl HostStep {
    /// Every step, in report order.
    pub const ALL: [HostStep; 3] = [HostStep::Routing, HostStep::DsaTopK, HostStep::Rope];

    /// The step's name in reports.
    pub fn label(self) -> &'static str {
        match self {
            HostStep::Routing => "routing top-k",
            HostStep::DsaTopK => "dsa top-k",
            HostStep::Rope => "mla rope",
        }
    }
}

static HOST_STEPS: [AtomicU64; 3] = [AtomicU64::new(0), AtomicU64::new(0), AtomicU64::new(0)];

/// Counts one [`HostStep`] done for a tensor on `device` (a step on the CPU is not counted).
pub fn count_host_step(device: &Device, step: HostStep) {
    if !device.is_cpu() {
        HOST_STEPS[step as usize].fetch_add(1, Ordering::Relaxed);
    }
}

/// The host steps counted in this process so far, by step (zero on the CPU).
pub fn host_steps() -> [(HostStep, u64); 3] {
    HostStep::ALL.map(|s| (s, HOST_STEPS[s as usize].load(Ordering::Relaxed)))
}

/// With `ENGY_TRACE` set (any value but `0`), [`trace`] prints a digest of each tensor it is
/// given to stderr: `engy trace: NAME #i: <hex>` (FNV-1a over the values' f32 bits, in order).
/// Two runs that should agree bit for bit (two processes auditing one commitment) can then be
/// compared line by line to find the first step where they part. Each trace copies the tensor
/// to the host, so a traced pass is slow. Off by default.
pub(crate) fn tracing() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("ENGY_TRACE").is_ok_and(|v| !v.is_empty() && v != "0"))
}

/// Prints the digest of `t` as step `name` when `ENGY_TRACE` is set (see [`tracing`]); does
/// nothing otherwise. A tensor that cannot be read is traced as `unreadable (error)`.
pub fn trace(name: &str, t: &candle_core::Tensor) {
    if !tracing() {
        return;
    }
    static SEQ: AtomicU64 = AtomicU64::new(0);
    let i = SEQ.fetch_add(1, Ordering::Relaxed);
    let values = t
        .to_dtype(candle_core::DType::F32)
        .and_then(|t| t.flatten_all())
        .and_then(|t| t.to_vec1::<f32>());
    match values {
        Ok(v) => {
            let mut h: u64 = 0xcbf2_9ce4_8422_2325;
            for x in &v {
                for b in x.to_bits().to_le_bytes() {
                    h = (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
                }
            }
            eprintln!("engy trace: {name} #{i}: {h:016x} ({} values)", v.len());
        }
        Err(e) => eprintln!("engy trace: {name} #{i}: unreadable ({e})"),
    }
}

/// The phases of a forward pass [`phase`] times when `ENGY_PROFILE` is set (any value but
/// `0`): each phase waits for the device before and after, so its wall time is its own, and
/// the profile is the sum per phase ([`profile`]). Off by default: the waits cost overlap.
static PROFILE: std::sync::Mutex<Vec<(&'static str, f64, u64)>> = std::sync::Mutex::new(Vec::new());

fn profiling() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("ENGY_PROFILE").is_ok_and(|v| !v.is_empty() && v != "0"))
}

/// Runs `f` as phase `name` of the pass on `device`: with `ENGY_PROFILE` set, the device is
/// synchronised before and after and the wall time added to the phase's total; otherwise `f`
/// alone. Phases may nest (an inner phase's time is also in the outer one's).
///
/// # Errors
/// Whatever `f` returns; a failed synchronisation is [`ModelError::Device`].
pub fn phase<T>(
    device: &Device,
    name: &'static str,
    f: impl FnOnce() -> Result<T, ModelError>,
) -> Result<T, ModelError> {
    if !profiling() {
        return f();
    }
    let sync = || {
        device
            .synchronize()
            .map_err(|e| ModelError::Device(format!("synchronising for the profile: {e}")))
    };
    sync()?;
    let t0 = std::time::Instant::now();
    let out = f()?;
    sync()?;
    let dt = t0.elapsed().as_secs_f64();
    if let Some(m) = memory_in_use(device) {
        PEAK_IN_USE.fetch_max(m, Ordering::Relaxed);
    }
    if let Ok(mut p) = PROFILE.lock() {
        match p.iter_mut().find(|(n, _, _)| *n == name) {
            Some(e) => {
                e.1 += dt;
                e.2 += 1;
            }
            None => p.push((name, dt, 1)),
        }
    }
    Ok(out)
}

/// The profile so far: `(phase, seconds, calls)` in the order phases first ran; empty unless
/// `ENGY_PROFILE` is set.
pub fn profile() -> Vec<(&'static str, f64, u64)> {
    PROFILE.lock().map(|p| p.clone()).unwrap_or_default()
}

/// The most device memory in use (bytes) seen at the end of a profiled [`phase`] so far; 0
/// unless `ENGY_PROFILE` is set on a GPU.
static PEAK_IN_USE: AtomicU64 = AtomicU64::new(0);

/// [`PEAK_IN_USE`]: the most device memory in use at the end of a profiled phase, in bytes.
pub fn profile_peak_memory() -> u64 {
    PEAK_IN_USE.load(Ordering::Relaxed)
}

/// Memory in use on `device` (bytes, every process's, as the driver counts it: total less
/// free), or `None` on the CPU and when the driver cannot say.
pub fn memory_in_use(device: &Device) -> Option<u64> {
    #[cfg(feature = "cuda")]
    if let Device::Cuda(cd) = device {
        let (free, total) = cd.cuda_stream().context().mem_get_info().ok()?;
        return Some(total.saturating_sub(free) as u64);
    }
    let _ = device;
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn device_names_parse_and_print_back() {
        for (s, d) in [
            ("cpu", DeviceSpec::Cpu),
            ("cuda", DeviceSpec::Cuda(0)),
            ("cuda:3", DeviceSpec::Cuda(3)),
        ] {
            assert_eq!(s.parse::<DeviceSpec>(), Ok(d));
        }
        assert_eq!(DeviceSpec::Cuda(3).to_string(), "cuda:3");
        for bad in ["gpu", "cuda:", "cuda:x", "CPU", "cuda:-1"] {
            let e = bad.parse::<DeviceSpec>().unwrap_err();
            assert!(e.contains(bad), "{e}");
        }
    }

    #[cfg(not(feature = "cuda"))]
    #[test]
    fn a_cpu_build_names_the_missing_feature() {
        let e = DeviceSpec::Cuda(0).device().unwrap_err().to_string();
        assert!(e.contains("`cuda` feature"), "{e}");
        assert!(DeviceSpec::Cpu.device().unwrap().is_cpu());
    }
}
