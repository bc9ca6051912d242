//! Writes a synthetic block-FP8 checkpoint with Qwen3.6-35B-A3B's real text-model shapes
//! ([`engy_model::synth::Qwen36Shapes::RELEASE`]) at a reduced layer count, and a commitment
//! to audit against it, for measuring the auditor's peak memory (docs/AUDITOR.md "Memory").
//!
//! ```text
//! cargo run --release -p engy-model --example synth_checkpoint -- OUT_DIR [LAYERS] [TOKENS]
//! /usr/bin/time -v target/release/engy-audit audit --checkpoint OUT_DIR \
//!     --commitment OUT_DIR/commitment.json
//! ```
//!
//! `LAYERS` (default 4: three Gated DeltaNet layers and one gated-attention layer, as in the
//! release's repeating block) and `TOKENS` (default 256: prompt and output ids, half each). The
//! values are random, so the commitment's proofs are built from random rows and the verdict is
//! `cheat`: the measurement is of the teacher-forced pass, which runs in full either way.
use std::path::PathBuf;
use std::process::ExitCode;

use engy_core::toploc::{self, Dtype, Params};
use engy_model::synth::{self, Qwen36Shapes};

fn main() -> ExitCode {
    let mut args = std::env::args_os().skip(1);
    let Some(out) = args.next().map(PathBuf::from) else {
        eprintln!("usage: synth_checkpoint OUT_DIR [LAYERS] [TOKENS]");
        return ExitCode::from(2);
    };
    let num = |a: Option<std::ffi::OsString>, default: usize| -> Option<usize> {
        match a {
            None => Some(default),
            Some(s) => s.to_str().and_then(|s| s.parse().ok()),
        }
    };
    let (Some(layers), Some(tokens)) = (num(args.next(), 4), num(args.next(), 256)) else {
        eprintln!("LAYERS and TOKENS must be whole numbers");
        return ExitCode::from(2);
    };
    let shapes = Qwen36Shapes {
        layers,
        ..Qwen36Shapes::RELEASE
    };
    let report = match synth::write_qwen3_5_moe(&out, &shapes, true, 36) {
        Ok(r) => r,
        Err(e) => {
            eprintln!("writing {}: {e}", out.display());
            return ExitCode::FAILURE;
        }
    };
    eprintln!(
        "{}: {} layers, {} parameters, {} bytes of tensor data ({:.3} bytes/parameter)",
        out.display(),
        layers,
        report.parameters,
        report.bytes,
        report.bytes as f64 / report.parameters as f64
    );
    let n = tokens / 2;
    let prompt: Vec<u32> = (0..tokens - n)
        .map(|i| (i as u32 * 7919 + 13) % shapes.vocab as u32)
        .collect();
    let output: Vec<u32> = (0..n)
        .map(|i| (i as u32 * 104_729 + 7) % shapes.vocab as u32)
        .collect();
    let rows: Vec<Vec<u16>> = (0..n)
        .map(|i| {
            (0..shapes.hidden)
                .map(|j| toploc::f32_to_bf16_bits(((i * 31 + j * 17) % 101) as f32 / 50.0 - 1.0))
                .collect()
        })
        .collect();
    let elements: Vec<&[u16]> = rows.iter().map(Vec::as_slice).collect();
    let proofs = match toploc::build_proofs_base64(&elements, Dtype::Bf16, &Params::ENGY) {
        Ok(p) => p,
        Err(e) => {
            eprintln!("building proofs: {e}");
            return ExitCode::FAILURE;
        }
    };
    let model_root = match engy_core::identity::model_root(&out) {
        Ok(r) => r,
        Err(e) => {
            eprintln!("model_root: {e}");
            return ExitCode::FAILURE;
        }
    };
    let commitment = serde_json::json!({
        "model_root": model_root,
        "output_token_ids": output,
        "toploc": {
            "proofs": proofs,
            "topk": Params::ENGY.topk,
            "decode_batching_size": Params::ENGY.decode_batching_size,
            "skip_prefill": Params::ENGY.skip_prefill,
            "n_tokens": n,
            "prompt_ids": prompt,
        }
    });
    let path = out.join("commitment.json");
    if let Err(e) = std::fs::write(&path, commitment.to_string()) {
        eprintln!("{}: {e}", path.display());
        return ExitCode::FAILURE;
    }
    eprintln!(
        "{}: {} prompt + {} output tokens",
        path.display(),
        tokens - n,
        n
    );
    ExitCode::SUCCESS
}
