//! What one challenged cell costs to check (issue 39, item 1), on a checkpoint such as
//! `synth_checkpoint` writes at a released model's real shapes:
//!
//! ```text
//! cargo run --release -p engy-model --example synth_checkpoint -- --arch qwen3_5_moe D 1 64
//! cargo run --release -p engy-model --example cell_cost -- D [TOKENS] [CELLS]
//! ```
//!
//! Prints, each timed separately (CPU, weights streamed and decoded per use, as `engy-audit
//! cells` loads a checkpoint):
//!
//! * the commitment of the checkpoint (once per checkpoint, not per audit);
//! * the binding recompute: one teacher-forced pass over `TOKENS` ids (default 64) keeping
//!   `CELLS` (default 32) challenged rows ([`engy_model::cells::recompute::recompute_rows`]);
//! * per cell: the weight check of the units it touches (router, shared expert, its experts:
//!   bytes hashed) and the cell's numbers ([`engy_model::cells::verify_cell`]: router, routing,
//!   one MoE block on one row).
//!
//! Exit codes: 0 measured, 2 bad arguments, 1 a step failed.
use std::collections::BTreeSet;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Instant;

use engy_core::commit::{self, CommitOptions, Progress, SpecFile};
use engy_model::cells::recompute::recompute_rows;
use engy_model::cells::{
    serve_cells, verify_cell, CellPolicy, CellServe, CommittedWeights, Openings,
};
use engy_model::{LoadOptions, Model, Residency};

const USAGE: &str = "usage: cell_cost CHECKPOINT_DIR [TOKENS] [CELLS]";

fn main() -> ExitCode {
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("{e}");
            if e.starts_with("usage") {
                ExitCode::from(2)
            } else {
                ExitCode::FAILURE
            }
        }
    }
}

fn run() -> Result<(), String> {
    let mut args = std::env::args().skip(1);
    let dir = PathBuf::from(args.next().ok_or(USAGE)?);
    let num = |a: Option<String>, d: usize| -> Result<usize, String> {
        a.map_or(Ok(d), |s| {
            s.parse()
                .map_err(|_| format!("{USAGE}: {s} is not a number"))
        })
    };
    let tokens = num(args.next(), 64)?;
    let n_cells = num(args.next(), 32)?;
    let e = |what: &str| {
        let what = what.to_string();
        move |err: &dyn std::fmt::Display| format!("{what}: {err}")
    };

    let t = Instant::now();
    let c = commit::commit_checkpoint(&dir, &CommitOptions::default(), &Progress::default())
        .map_err(|x| e("commit")(&x))?;
    let commit_s = t.elapsed().as_secs_f64();
    let spec = SpecFile::from_commitment(&c, commit_s);
    let weights = CommittedWeights::open(&dir, c.model_root, Openings::Spec(Box::new(spec)))
        .map_err(|x| e("committed weights")(&x))?;
    let model = Model::open(
        &dir,
        &LoadOptions {
            residency: Residency::Streaming,
            ..LoadOptions::default()
        },
    )
    .map_err(|x| e("load")(&x))?;
    let cfg = model.config();
    let vocab = cfg.vocab_size as u32;
    let ids: Vec<u32> = (0..tokens as u32)
        .map(|i| (i * 7919 + 13) % vocab)
        .collect();
    println!(
        "{}: {:?}, hidden {}, {} layers; commitment {:.2} s",
        dir.display(),
        cfg.kind,
        cfg.hidden_size,
        cfg.num_hidden_layers,
        commit_s
    );

    // The serve's cells (not timed: the miner's work), then a challenge of n of them spread
    // over positions and MoE layers.
    let cells = serve_cells(&model, &ids, CellServe::Honest).map_err(|x| e("serve")(&x))?;
    let step = (cells.len() / n_cells.max(1)).max(1);
    let chosen: Vec<_> = cells.iter().step_by(step).take(n_cells).collect();
    let wanted: BTreeSet<(usize, usize)> = chosen
        .iter()
        .map(|c| (c.position() as usize, c.layer() as usize))
        .collect();
    let last = wanted.iter().map(|&(p, _)| p + 1).max().unwrap_or(0);

    let t = Instant::now();
    let rows = recompute_rows(&model, &ids, &wanted, None).map_err(|x| e("recompute")(&x))?;
    let recompute_s = t.elapsed().as_secs_f64();
    println!(
        "binding recompute: {last} positions, {} cells kept: {recompute_s:.3} s",
        rows.len()
    );

    let policy = CellPolicy::default();
    let (mut hash_s, mut check_s) = (0f64, 0f64);
    let mut bytes0 = weights.bytes_read();
    for c in &chosen {
        let t = Instant::now();
        weights.check_cell(c).map_err(|x| e("weights")(&x))?;
        let h = t.elapsed().as_secs_f64();
        let t = Instant::now();
        let k = verify_cell(&model, c, &policy).map_err(|x| e("verify")(&x))?;
        let v = t.elapsed().as_secs_f64();
        let b = weights.bytes_read() - bytes0;
        bytes0 = weights.bytes_read();
        println!(
            "cell ({}, {}): weights {:.1} MB hashed in {:.3} s; numbers {:.3} s; pass {}",
            c.position(),
            c.layer(),
            b as f64 / 1e6,
            h,
            v,
            k.pass()
        );
        hash_s += h;
        check_s += v;
    }
    let n = chosen.len().max(1) as f64;
    println!(
        "per cell (mean of {}): weights {:.3} s, numbers {:.3} s; recompute shared by all: \
         {recompute_s:.3} s ({:.3} s per position)",
        chosen.len(),
        hash_s / n,
        check_s / n,
        recompute_s / last.max(1) as f64
    );
    Ok(())
}
