//! Writes a synthetic block-FP8 checkpoint with a released model's real shapes at a reduced
//! layer count, and a commitment to audit against it, for measuring the auditor's peak memory
//! (docs/AUDITOR.md "Memory") and its speed on a GPU (docs/AUDITOR.md "On a GPU").
//!
//! ```text
//! cargo run --release -p engy-model --example synth_checkpoint -- \
//!     [--arch qwen3_5_moe|glm_moe_dsa] OUT_DIR [LAYERS] [TOKENS]
//! /usr/bin/time -v target/release/engy-audit audit --checkpoint OUT_DIR \
//!     --commitment OUT_DIR/commitment.json
//! ```
//!
//! The architecture (`--arch` first, else env `ENGY_SYNTH_ARCH`, else `qwen3_5_moe`):
//!
//! * `qwen3_5_moe`: Qwen3.6-35B-A3B ([`engy_model::synth::Qwen36Shapes::RELEASE`]); `LAYERS`
//!   default 4, three Gated DeltaNet layers and one gated-attention layer, as in the release's
//!   repeating block;
//! * `glm_moe_dsa`: GLM-5 / GLM-5.1 ([`engy_model::synth::GlmShapes::RELEASE`]); `LAYERS`
//!   default 5, the release's 3 dense layers then 2 MoE layers (every layer with its DSA
//!   indexer, as in the release).
//!
//! `TOKENS` (default 256: prompt and output ids, half each). The values are random, so the
//! commitment's proofs are built from random rows of the model's hidden size and the verdict
//! is `cheat`: the measurement is of the teacher-forced pass, which runs in full either way.
//! Exit codes: 0 written, 2 bad arguments, 1 a write failed.
use std::path::PathBuf;
use std::process::ExitCode;

use engy_core::toploc::{self, Dtype, Params};
use engy_model::synth::{self, GlmShapes, Qwen36Shapes, SynthReport};

const USAGE: &str =
    "usage: synth_checkpoint [--arch qwen3_5_moe|glm_moe_dsa] OUT_DIR [LAYERS] [TOKENS]";

fn main() -> ExitCode {
    let all: Vec<std::ffi::OsString> = std::env::args_os().skip(1).collect();
    // `--help` anywhere prints the usage (it is never an output folder: that would write
    // gigabytes into `./--help`); any other dash word but `--arch` is refused, as is a
    // fourth positional word.
    if all.iter().any(|a| a == "--help" || a == "-h") {
        println!("{USAGE}\n\nWrites a synthetic block-FP8 checkpoint with the release's shapes at LAYERS layers\n(qwen3_5_moe: default 4, about 5 GB; glm_moe_dsa: default 5, about 25 GB) and a\ncommitment of TOKENS (default 256) tokens to OUT_DIR/commitment.json.");
        return ExitCode::SUCCESS;
    }
    let arch_flag = usize::from(all.first().is_some_and(|a| a == "--arch")) * 2;
    if let Some(bad) = all
        .iter()
        .skip(arch_flag)
        .find(|a| a.to_str().is_some_and(|s| s.starts_with('-')))
    {
        eprintln!("unknown option {bad:?} (--arch goes first)\n{USAGE}");
        return ExitCode::from(2);
    }
    if all.len().saturating_sub(arch_flag) > 3 {
        eprintln!("too many arguments\n{USAGE}");
        return ExitCode::from(2);
    }
    let mut args = all.into_iter().peekable();
    let arch = if args.peek().is_some_and(|a| a == "--arch") {
        args.next();
        match args.next().and_then(|a| a.into_string().ok()) {
            Some(a) => a,
            None => {
                eprintln!("--arch needs a value\n{USAGE}");
                return ExitCode::from(2);
            }
        }
    } else {
        std::env::var("ENGY_SYNTH_ARCH").unwrap_or_else(|_| "qwen3_5_moe".to_string())
    };
    let default_layers = match arch.as_str() {
        "qwen3_5_moe" => 4,
        "glm_moe_dsa" => GlmShapes::RELEASE.first_k_dense + 2,
        other => {
            eprintln!("unknown architecture `{other}` (--arch or ENGY_SYNTH_ARCH): qwen3_5_moe or glm_moe_dsa\n{USAGE}");
            return ExitCode::from(2);
        }
    };
    let Some(out) = args.next().map(PathBuf::from) else {
        eprintln!("{USAGE}");
        return ExitCode::from(2);
    };
    let num = |a: Option<std::ffi::OsString>, default: usize| -> Option<usize> {
        match a {
            None => Some(default),
            Some(s) => s.to_str().and_then(|s| s.parse().ok()),
        }
    };
    let (Some(layers), Some(tokens)) = (num(args.next(), default_layers), num(args.next(), 256))
    else {
        eprintln!("LAYERS and TOKENS must be whole numbers\n{USAGE}");
        return ExitCode::from(2);
    };
    // (hidden size, vocabulary, what was written)
    let written: Result<(usize, usize, SynthReport), _> = if arch == "glm_moe_dsa" {
        let shapes = GlmShapes {
            layers,
            ..GlmShapes::RELEASE
        };
        synth::write_glm_moe_dsa(&out, &shapes, true, 36).map(|r| (shapes.hidden, shapes.vocab, r))
    } else {
        let shapes = Qwen36Shapes {
            layers,
            ..Qwen36Shapes::RELEASE
        };
        synth::write_qwen3_5_moe(&out, &shapes, true, 36).map(|r| (shapes.hidden, shapes.vocab, r))
    };
    let (hidden, vocab, report) = match written {
        Ok(w) => w,
        Err(e) => {
            eprintln!("writing {}: {e}", out.display());
            return ExitCode::FAILURE;
        }
    };
    eprintln!(
        "{}: {arch}, {} layers, {} parameters, {} bytes of tensor data ({:.3} bytes/parameter)",
        out.display(),
        layers,
        report.parameters,
        report.bytes,
        report.bytes as f64 / report.parameters as f64
    );
    let n = tokens / 2;
    let prompt: Vec<u32> = (0..tokens - n)
        .map(|i| (i as u32 * 7919 + 13) % vocab as u32)
        .collect();
    let output: Vec<u32> = (0..n)
        .map(|i| (i as u32 * 104_729 + 7) % vocab as u32)
        .collect();
    let rows: Vec<Vec<u16>> = (0..n)
        .map(|i| {
            (0..hidden)
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
