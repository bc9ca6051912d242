//! Writes the auditor's f32 hidden states for token sequences, in the schema of the arch
//! oracle's `reference.safetensors` (`tests/vectors/arch/README.md`), so a reference
//! implementation can be compared with engy's outside the Rust tests (`tests/reverse/`).
//!
//! ```text
//! cargo run --release -p engy-model --example hidden_states -- CHECKPOINT_DIR IDS.safetensors OUT.safetensors
//! ```
//!
//! `IDS.safetensors` holds `input_ids_<k>` I64 `[T]` for k = 0, 1, … (a `reference.safetensors`
//! does). `OUT.safetensors` gets, per sequence, `hidden_<k>` F32 `[T, hidden_size]` (the final
//! norm's output) and `layer_<l>_<k>` F32 `[T, hidden_size]` (the residual stream after decoder
//! layer `l`). The checkpoint is loaded as `engy-audit audit` loads it (streaming weights).
//! Exit codes: 0 written, 1 a load, forward or write error, 2 usage.
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use candle_core::Tensor;
use engy_model::{LoadOptions, Model, Residency};
use safetensors::tensor::TensorView;
use safetensors::{Dtype, SafeTensors};

fn main() -> ExitCode {
    let args: Vec<PathBuf> = std::env::args_os().skip(1).map(PathBuf::from).collect();
    let [dir, ids, out] = args.as_slice() else {
        eprintln!("usage: hidden_states CHECKPOINT_DIR IDS.safetensors OUT.safetensors");
        return ExitCode::from(2);
    };
    match run(dir, ids, out) {
        Ok(n) => {
            eprintln!("wrote {n} sequences to {}", out.display());
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("hidden_states: {e}");
            ExitCode::from(1)
        }
    }
}

type Error = Box<dyn std::error::Error>;

/// Reads `input_ids_<k>` (I64 `[T]`) for k = 0, 1, … until one is missing.
fn sequences(path: &Path) -> Result<Vec<Vec<u32>>, Error> {
    let bytes = std::fs::read(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let st = SafeTensors::deserialize(&bytes)?;
    let mut seqs = Vec::new();
    while let Ok(t) = st.tensor(&format!("input_ids_{}", seqs.len())) {
        if t.dtype() != Dtype::I64 || t.shape().len() != 1 {
            return Err(format!(
                "input_ids_{}: want I64 [T], got {:?} {:?}",
                seqs.len(),
                t.dtype(),
                t.shape()
            )
            .into());
        }
        let ids = t
            .data()
            .chunks_exact(8)
            .map(|c| {
                let mut b = [0u8; 8];
                b.copy_from_slice(c);
                u32::try_from(i64::from_le_bytes(b))
            })
            .collect::<Result<Vec<u32>, _>>()
            .map_err(|_| format!("input_ids_{}: an id outside 0..2^32", seqs.len()))?;
        seqs.push(ids);
    }
    if seqs.is_empty() {
        return Err(format!("{}: no input_ids_0", path.display()).into());
    }
    Ok(seqs)
}

fn f32_bytes(t: &Tensor) -> Result<(Vec<usize>, Vec<u8>), Error> {
    let v = t.flatten_all()?.to_vec1::<f32>()?;
    Ok((
        t.dims().to_vec(),
        v.iter().flat_map(|x| x.to_le_bytes()).collect(),
    ))
}

fn run(dir: &Path, ids: &Path, out: &Path) -> Result<usize, Error> {
    let opts = LoadOptions {
        residency: Residency::Streaming,
        ..LoadOptions::default()
    };
    let model = Model::open(dir, &opts)?;
    let seqs = sequences(ids)?;
    let mut tensors: Vec<(String, Vec<usize>, Vec<u8>)> = Vec::new();
    for (k, ids) in seqs.iter().enumerate() {
        let (hidden, layers) = model.hidden_states_traced(ids)?;
        let (shape, bytes) = f32_bytes(&hidden)?;
        tensors.push((format!("hidden_{k}"), shape, bytes));
        for (l, t) in layers.iter().enumerate() {
            let (shape, bytes) = f32_bytes(t)?;
            tensors.push((format!("layer_{l}_{k}"), shape, bytes));
        }
    }
    let views = tensors
        .iter()
        .map(|(name, shape, bytes)| {
            Ok((
                name.clone(),
                TensorView::new(Dtype::F32, shape.clone(), bytes)?,
            ))
        })
        .collect::<Result<Vec<_>, Error>>()?;
    safetensors::serialize_to_file(views, None, out)
        .map_err(|e| format!("{}: {e}", out.display()))?;
    Ok(seqs.len())
}
