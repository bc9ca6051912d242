//! `engy-audit cells` as a process: a miner's cell audit bundle for a real generated checkpoint,
//! its weights checked against the `engy-commit/v1` root from `spec build` (or from opening
//! proofs): pass, cheat, refused, unrunnable and a checkpoint that is not the committed one map
//! to exit codes 0 / 1 / 2 / 3 / 4 (docs/AUDITOR.md "Cells").
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use engy_core::cells::{CellAuditBundle, CellShape, CellTree};
use engy_core::commit::{self, CommitOptions, LayerPart, Progress, UnitId};
use engy_model::cells::{serve_cells, CellServe};
use engy_model::{gen_model, Compute, GenConfig, Model, Precision};

fn engy_audit(args: &[&std::ffi::OsStr]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_engy-audit"))
        .args(args)
        .output()
        .unwrap()
}

fn text(o: &Output) -> (i32, String, String) {
    (
        o.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&o.stdout).into_owned(),
        String::from_utf8_lossy(&o.stderr).into_owned(),
    )
}

/// The bundle a serve of `how` answers the challenge `seed` with (`n` cells).
fn bundle(model: &Model, ids: &[u32], how: CellServe, seed: [u8; 32], n: u64) -> CellAuditBundle {
    let cells = serve_cells(model, ids, how).unwrap();
    let s = model.routing_shape().unwrap();
    let mut layers: Vec<u32> = cells.iter().map(|c| c.layer()).collect();
    layers.dedup();
    layers.sort_unstable();
    layers.dedup();
    let shape = CellShape::new(
        ids.len() as u32,
        layers,
        model.config().hidden_size as u32,
        s.experts as u32,
        s.top_k as u32,
        cells[0].router_logits().dtype(),
    )
    .unwrap();
    let tree = CellTree::from_cells(shape, &cells).unwrap();
    CellAuditBundle::open(&tree, &seed, n, |i| Ok(cells[i as usize].encode())).unwrap()
}

fn write(dir: &Path, name: &str, b: &CellAuditBundle) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, serde_json::to_vec(b).unwrap()).unwrap();
    p
}

fn copy_dir(src: &Path, dst: &Path) {
    std::fs::create_dir_all(dst).unwrap();
    for e in std::fs::read_dir(src).unwrap() {
        let p = e.unwrap().path();
        std::fs::copy(&p, dst.join(p.file_name().unwrap())).unwrap();
    }
}

#[test]
fn cells_exit_codes_follow_the_verdict() {
    let t = tempfile::tempdir().unwrap();
    let dir = t.path().join("m");
    gen_model(&dir, 9, &GenConfig::default()).unwrap();
    // The trusted root: `spec build`, as a validator publishes it.
    let spec_dir = t.path().join("spec");
    let o = engy_audit(&[
        "spec".as_ref(),
        "build".as_ref(),
        "--quiet".as_ref(),
        "--checkpoint".as_ref(),
        dir.as_os_str(),
        "--out".as_ref(),
        spec_dir.as_os_str(),
    ]);
    assert_eq!(o.status.code(), Some(0), "{o:?}");
    // Opening proofs of every MoE unit, as `spec open` writes them.
    let c =
        commit::commit_checkpoint(&dir, &CommitOptions::default(), &Progress::default()).unwrap();
    let root = hex::encode(c.model_root);
    let proofs = t.path().join("proofs");
    std::fs::create_dir_all(&proofs).unwrap();
    let serve = Model::load_with(&dir, Precision::Bf16, Compute::Bf16).unwrap();
    let shape = serve.routing_shape().unwrap();
    for layer in 0..c.config.n_layers as u32 {
        let mut parts = vec![LayerPart::Router, LayerPart::Shared];
        parts.extend((0..shape.experts as u32).map(LayerPart::Expert));
        for part in parts {
            if let Ok(p) = c.open(UnitId::Layer { layer, part }) {
                let f = proofs.join(format!("{layer}-{part:?}.json"));
                std::fs::write(f, serde_json::to_vec(&p).unwrap()).unwrap();
            }
        }
    }
    let ids: Vec<u32> = (3..67).collect();
    let seed = [7u8; 32];
    let honest = bundle(&serve, &ids, CellServe::Honest, seed, 8);
    let honest_path = write(t.path(), "honest.json", &honest);
    let ck = dir.as_os_str();
    let cells = |b: &Path, extra: &[&std::ffi::OsStr]| {
        let mut a: Vec<&std::ffi::OsStr> = vec![
            "cells".as_ref(),
            "--checkpoint".as_ref(),
            ck,
            "--bundle".as_ref(),
            b.as_os_str(),
        ];
        a.extend_from_slice(extra);
        text(&engy_audit(&a))
    };
    let with_proofs: [&std::ffi::OsStr; 4] = [
        "--model-root".as_ref(),
        root.as_ref(),
        "--proofs".as_ref(),
        proofs.as_os_str(),
    ];
    let with_spec: [&std::ffi::OsStr; 2] = ["--spec".as_ref(), spec_dir.as_os_str()];

    // Honest: exit 0, one line per challenged cell, the units read.
    let (code, out, err) = cells(&honest_path, &with_proofs);
    eprintln!("{out}");
    assert_eq!(code, 0, "{out}{err}");
    assert!(
        out.starts_with("verdict: pass (0/8 challenged cells failed)"),
        "{out}"
    );
    assert_eq!(out.matches("\n  cell ").count(), 8, "{out}");
    assert!(out.contains("units ("), "{out}");
    let (code, out, err) = cells(&honest_path, &with_spec);
    assert_eq!(code, 0, "{out}{err}");
    // The commitment's own cells_root: still a pass; another one: refused.
    let own = hex::encode(honest.cells_root.0);
    let (code, out, _) = cells(
        &honest_path,
        &[&with_spec[..], &["--cells-root".as_ref(), own.as_ref()]].concat(),
    );
    assert_eq!(code, 0, "{out}");
    let other = hex::encode([1u8; 32]);
    let (code, out, _) = cells(
        &honest_path,
        &[&with_spec[..], &["--cells-root".as_ref(), other.as_ref()]].concat(),
    );
    assert_eq!(code, 2, "{out}");
    assert!(out.starts_with("verdict: refused"), "{out}");

    // Fabricated y: exit 1; the JSON report lists the failed cells.
    let fab = write(
        t.path(),
        "fab.json",
        &bundle(&serve, &ids, CellServe::FabricatedY, seed, 8),
    );
    let (code, out, err) = cells(&fab, &[&with_spec[..], &["--json".as_ref()]].concat());
    assert_eq!(code, 1, "{out}{err}");
    let report: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
    assert_eq!(report["verdict"], "cheat");
    assert!(report["failed"].as_u64().unwrap() > 0);

    // A challenged cell left unopened: a failed cell (exit 1).
    let mut missing = honest.clone();
    missing.openings.pop();
    let (code, out, _) = cells(&write(t.path(), "missing.json", &missing), &with_spec);
    assert_eq!(code, 1, "{out}");
    assert!(out.contains("not opened"), "{out}");
    eprintln!("{out}");

    // An opening of a cell the challenge did not choose: refused (exit 2).
    let chosen = honest.challenge().unwrap();
    let unchosen = (0..honest.shape.n_cells())
        .find(|i| !chosen.contains(i))
        .unwrap();
    let mut extra = honest.clone();
    extra.openings[0].index = unchosen;
    let (code, out, _) = cells(&write(t.path(), "extra.json", &extra), &with_spec);
    assert_eq!(code, 2, "{out}");
    assert!(out.contains("did not choose"), "{out}");

    // Not a bundle: exit 3.
    let junk = t.path().join("junk.json");
    std::fs::write(&junk, b"{\"cells_root\": 1}").unwrap();
    let (code, _, err) = cells(&junk, &with_spec);
    assert_eq!(code, 3, "{err}");
    assert!(err.contains("not a cell audit bundle"), "{err}");

    // The auditor's checkpoint differs from the committed one in an expert a challenged cell
    // uses: exit 4, naming the unit and the tensor.
    let cell = engy_core::cells::Cell::decode(&honest.openings[0].cell).unwrap();
    let (layer, e) = (cell.layer(), cell.expert_ids()[0]);
    let bad = t.path().join("bad");
    copy_dir(&dir, &bad);
    let name = format!("model.layers.{layer}.mlp.experts.{e}.up_proj.weight");
    for f in std::fs::read_dir(&bad).unwrap() {
        let p = f.unwrap().path();
        if p.extension().is_some_and(|x| x == "safetensors") {
            let mut buf = std::fs::read(&p).unwrap();
            let (n, meta) = safetensors::SafeTensors::read_metadata(&buf).unwrap();
            if let Some(info) = meta.tensors().get(&name) {
                buf[8 + n + info.data_offsets.0 + 1] ^= 0x40;
                std::fs::write(&p, buf).unwrap();
            }
        }
    }
    let o = engy_audit(&[
        "cells".as_ref(),
        "--checkpoint".as_ref(),
        bad.as_os_str(),
        "--bundle".as_ref(),
        honest_path.as_os_str(),
        "--model-root".as_ref(),
        root.as_ref(),
        "--proofs".as_ref(),
        proofs.as_os_str(),
    ]);
    let (code, out, err) = text(&o);
    assert_eq!(code, 4, "{out}{err}");
    assert!(err.contains(&name), "{err}");
    assert!(err.contains(&format!("layer {layer} expert {e}")), "{err}");
}
