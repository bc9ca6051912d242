//! Turns a serve's captured decode rows into miner commitments, with engy's TOPLOC code, for
//! serves engy did not run (`tests/reverse/honest_serves.py` captures transformers').
//!
//! ```text
//! cargo run --release -p engy-model --example commit_rows -- ROWS MODEL_ROOT OUT_DIR PREFIX
//! ```
//!
//! * `ROWS`: safetensors with, for `k = 0, 1, …` until one is missing: `prompt_k` I64 `[P]`
//!   (the prompt ids), `output_k` I64 `[N]` (the sampled ids) and `rows_k` F32 `[N, hidden]`
//!   (row `j`: the final norm's output that sampled output id `j`, the last row of generation
//!   step `j`; docs/PROTOCOL.md §3.10).
//! * `MODEL_ROOT`: the checkpoint's `model_root` (hex), written into each commitment.
//! * Writes `OUT_DIR/PREFIX_NN.json` (`NN` = `k`, two digits), the schema `engy-audit audit
//!   --commitment` reads: the rows rounded to bf16, proofs with engy's parameters (top-k 128,
//!   decode batch 32, skip_prefill; PROTOCOL.md §3.8).
//!
//! Exit status: 0 written, 1 a read, shape or proof error, 2 a usage error.
use std::process::ExitCode;

use engy_core::toploc::{self, Params};
use safetensors::{Dtype as StDtype, SafeTensors};

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [rows, root, out_dir, prefix] = args.as_slice() else {
        eprintln!("usage: commit_rows ROWS.safetensors MODEL_ROOT OUT_DIR PREFIX");
        return ExitCode::from(2);
    };
    match run(rows, root, out_dir, prefix) {
        Ok(n) => {
            eprintln!("commit_rows: wrote {n} commitments to {out_dir}");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("commit_rows: {e}");
            ExitCode::from(1)
        }
    }
}

fn run(rows: &str, root: &str, out_dir: &str, prefix: &str) -> Result<usize, String> {
    let bytes = std::fs::read(rows).map_err(|e| format!("reading {rows}: {e}"))?;
    let st = SafeTensors::deserialize(&bytes).map_err(|e| format!("{rows}: {e}"))?;
    let mut k = 0;
    while let Ok(r) = st.tensor(&format!("rows_{k}")) {
        let ids = |name: &str| -> Result<Vec<u32>, String> {
            let t = st
                .tensor(name)
                .map_err(|e| format!("{rows}: {name}: {e}"))?;
            if t.dtype() != StDtype::I64 {
                return Err(format!("{rows}: {name} is {:?}, not I64", t.dtype()));
            }
            t.data()
                .chunks_exact(8)
                .map(|c| {
                    let v = i64::from_le_bytes(c.try_into().unwrap_or_default());
                    u32::try_from(v).map_err(|_| format!("{rows}: {name} holds the id {v}"))
                })
                .collect()
        };
        let prompt = ids(&format!("prompt_{k}"))?;
        let output = ids(&format!("output_{k}"))?;
        let (n, hidden) = match (r.dtype(), r.shape()) {
            (StDtype::F32, &[n, h]) => (n, h),
            (d, s) => {
                return Err(format!(
                    "{rows}: rows_{k} is {d:?} {s:?}, not F32 [N, hidden]"
                ))
            }
        };
        if n != output.len() || hidden == 0 {
            return Err(format!(
                "{rows}: rows_{k} has {n} rows of {hidden} for {} output ids",
                output.len()
            ));
        }
        let values: Vec<f32> = r
            .data()
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap_or_default()))
            .collect();
        let bf16: Vec<Vec<u16>> = values
            .chunks_exact(hidden)
            .map(toploc::f32_to_bf16_bits_slice)
            .collect();
        let commitment =
            engy_model::audit::commit_rows(root, &prompt, &output, &bf16, &Params::ENGY)
                .map_err(|e| format!("{rows}: sequence {k}: {e}"))?;
        let path = format!("{out_dir}/{prefix}_{k:02}.json");
        std::fs::write(&path, commitment.to_string())
            .map_err(|e| format!("writing {path}: {e}"))?;
        k += 1;
    }
    if k == 0 {
        return Err(format!("{rows}: no rows_0 tensor"));
    }
    Ok(k)
}
