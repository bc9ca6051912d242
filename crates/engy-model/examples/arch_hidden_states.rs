//! Runs engy's teacher-forced pass on a checkpoint and writes the hidden states, for
//! cross-language checks against transformers (`tests/reverse/arch_real_shape.py`).
//!
//! ```text
//! cargo run --release -p engy-model --example arch_hidden_states -- CHECKPOINT IDS OUT [--decode N] [--bf16]
//! ```
//!
//! * `CHECKPOINT`: a folder with `config.json` and safetensors shards, loaded exactly as the
//!   auditor loads it ([`engy_model::arch::load`], streaming residency, f32 compute; with
//!   `--bf16`, bf16 compute: the architecture's bf16 rounding points).
//! * `IDS`: a safetensors file with I64 tensors `input_ids_0`, `input_ids_1`, … (shape `[T]`),
//!   the schema of `tests/vectors/arch/*/reference.safetensors`; other tensors are ignored.
//! * `OUT`: written as safetensors, F32: `hidden_<k>` `[T, hidden]` (the final norm's output)
//!   and `layer_<l>_<k>` `[T, hidden]` (the residual stream after decoder layer `l`), the
//!   reference's names. Each sequence runs alone from position 0 with an empty cache.
//! * `--decode N`: the last `N` positions of each sequence are computed by `N` single-id steps
//!   on the cache of a prefill of the rest (the incremental path a serve decodes with); the
//!   rows are written in the same tensors, so they must match the same reference rows.
//!
//! Exit status: 0 written, 1 a load / forward / write error, 2 a usage error. Per-sequence
//! wall time goes to stderr.
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Instant;

use candle_core::Tensor;
use engy_model::{arch, Compute, LoadOptions, Residency};
use safetensors::tensor::TensorView;
use safetensors::{Dtype, SafeTensors};

fn main() -> ExitCode {
    let usage =
        "usage: arch_hidden_states CHECKPOINT IDS.safetensors OUT.safetensors [--decode N] [--bf16]";
    let mut args: Vec<PathBuf> = std::env::args_os().skip(1).map(PathBuf::from).collect();
    let compute = match args.iter().position(|a| a.as_os_str() == "--bf16") {
        Some(i) => {
            args.remove(i);
            Compute::Bf16
        }
        None => Compute::F32,
    };
    let mut decode = 0;
    if let Some(i) = args.iter().position(|a| a.as_os_str() == "--decode") {
        match args
            .get(i + 1)
            .and_then(|n| n.to_str())
            .map(str::parse::<usize>)
        {
            Some(Ok(n)) => decode = n,
            _ => {
                eprintln!("--decode needs a whole number\n{usage}");
                return ExitCode::from(2);
            }
        }
        args.drain(i..i + 2);
    }
    let [checkpoint, ids, out] = args.as_slice() else {
        eprintln!("{usage}");
        return ExitCode::from(2);
    };
    match run(checkpoint, ids, out, decode, compute) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("arch_hidden_states: {e}");
            ExitCode::FAILURE
        }
    }
}

/// The `input_ids_<k>` sequences of `path`, in `k` order from 0 until the first gap.
fn read_ids(path: &Path) -> Result<Vec<Vec<u32>>, String> {
    let bytes = std::fs::read(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let st = SafeTensors::deserialize(&bytes).map_err(|e| format!("{}: {e}", path.display()))?;
    let mut seqs = Vec::new();
    while let Ok(t) = st.tensor(&format!("input_ids_{}", seqs.len())) {
        let name = format!("input_ids_{}", seqs.len());
        if t.dtype() != Dtype::I64 || t.shape().len() != 1 {
            return Err(format!(
                "{name}: expected I64 [T], found {:?} {:?}",
                t.dtype(),
                t.shape()
            ));
        }
        let ids = t
            .data()
            .chunks_exact(8)
            .map(|c| {
                let mut b = [0u8; 8];
                b.copy_from_slice(c);
                u32::try_from(i64::from_le_bytes(b)).map_err(|_| format!("{name}: id out of range"))
            })
            .collect::<Result<Vec<u32>, String>>()?;
        seqs.push(ids);
    }
    if seqs.is_empty() {
        return Err(format!("{}: no input_ids_0", path.display()));
    }
    Ok(seqs)
}

fn le_bytes(t: &Tensor) -> Result<(Vec<usize>, Vec<u8>), String> {
    let shape = t.dims().to_vec();
    let v = t
        .flatten_all()
        .and_then(|f| f.to_vec1::<f32>())
        .map_err(|e| e.to_string())?;
    Ok((shape, v.iter().flat_map(|x| x.to_le_bytes()).collect()))
}

fn run(
    checkpoint: &Path,
    ids: &Path,
    out: &Path,
    decode: usize,
    compute: Compute,
) -> Result<(), String> {
    let seqs = read_ids(ids)?;
    let opts = LoadOptions {
        residency: Residency::Streaming,
        compute,
        ..LoadOptions::default()
    };
    let t0 = Instant::now();
    let model =
        arch::load(checkpoint, &opts).map_err(|e| format!("{}: {e}", checkpoint.display()))?;
    eprintln!(
        "arch_hidden_states: loaded {} ({:?}, {} layers) in {:.1}s",
        checkpoint.display(),
        model.config().kind,
        model.config().num_hidden_layers,
        t0.elapsed().as_secs_f64()
    );
    let mut tensors: BTreeMap<String, (Vec<usize>, Vec<u8>)> = BTreeMap::new();
    for (k, ids) in seqs.iter().enumerate() {
        let t = Instant::now();
        let split = ids.len().saturating_sub(decode).max(1);
        let mut cache = model.new_cache();
        // Row blocks: the prefill's, then one per decode step.
        let mut hidden = Vec::new();
        let mut layers: Vec<Vec<Tensor>> = Vec::new();
        for (i, chunk) in std::iter::once(&ids[..split])
            .chain(ids[split..].chunks(1))
            .enumerate()
        {
            let mut step_layers = Vec::new();
            let h = model
                .forward(
                    chunk,
                    &mut cache,
                    &mut engy_model::arch::Probe::with_layers(Some(&mut step_layers)),
                )
                .map_err(|e| format!("sequence {k} (T={}), call {i}: {e}", ids.len()))?;
            hidden.push(h);
            for (l, r) in step_layers.into_iter().enumerate() {
                if layers.len() <= l {
                    layers.push(Vec::new());
                }
                layers[l].push(r);
            }
        }
        eprintln!(
            "arch_hidden_states: sequence {k} (T={}, prefill {split} + {} decode steps) in {:.1}s",
            ids.len(),
            ids.len() - split,
            t.elapsed().as_secs_f64()
        );
        let cat = |rows: &[Tensor]| Tensor::cat(rows, 0).map_err(|e| e.to_string());
        tensors.insert(format!("hidden_{k}"), le_bytes(&cat(&hidden)?)?);
        for (l, r) in layers.iter().enumerate() {
            tensors.insert(format!("layer_{l}_{k}"), le_bytes(&cat(r)?)?);
        }
    }
    let views = tensors
        .iter()
        .map(|(name, (shape, bytes))| {
            TensorView::new(Dtype::F32, shape.clone(), bytes)
                .map(|v| (name.clone(), v))
                .map_err(|e| format!("{name}: {e}"))
        })
        .collect::<Result<Vec<_>, String>>()?;
    safetensors::serialize_to_file(views, None, out)
        .map_err(|e| format!("{}: {e}", out.display()))?;
    Ok(())
}
