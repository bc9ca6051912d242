//! `engy-audit cells` as a process: the auditor's challenge over a request's commitment (the
//! seed from a beacon, `n` from its policy), a miner's cell audit bundle for a real generated
//! checkpoint, its weights checked against the `engy-commit/v1` root from `spec build` (or from
//! opening proofs): pass, cheat, not judged, unrunnable and a checkpoint that is not the
//! committed one map to exit codes 0 / 1 / 2 / 3 / 4 (docs/AUDITOR.md "Cells").
mod cells_common;

use cells_common::{a, bundle, commitment, engy_audit, fixture, seed_of, serve, text, write};
use engy_model::cells::CellServe;

fn copy_dir(src: &std::path::Path, dst: &std::path::Path) {
    std::fs::create_dir_all(dst).unwrap();
    for e in std::fs::read_dir(src).unwrap() {
        let p = e.unwrap().path();
        std::fs::copy(&p, dst.join(p.file_name().unwrap())).unwrap();
    }
}

/// `engy-audit cells` on `checkpoint` with the fixture's root and opening proofs (instead of
/// its spec), the commitment file and the beacon, answered by `bundle`.
fn with_proofs(
    fx: &cells_common::Fixture,
    checkpoint: &std::path::Path,
    commitment: &std::path::Path,
    bundle: &std::path::Path,
) -> (i32, String, String) {
    text(&engy_audit(&[
        a("cells"),
        a("--checkpoint"),
        a(checkpoint),
        a("--model-root"),
        a(&fx.root),
        a("--proofs"),
        a(&fx.proofs),
        a("--commitment"),
        a(commitment),
        a("--beacon"),
        a(hex::encode(cells_common::BEACON)),
        a("--bundle"),
        a(bundle),
    ]))
}

#[test]
fn cells_exit_codes_follow_the_verdict() {
    let fx = fixture(9);
    let ids: Vec<u32> = (3..67).collect();
    let (prompt, output) = ids.split_at(37);
    let (tree, cells) = serve(&fx.serve, &ids, CellServe::Honest);
    let c = commitment(prompt, output, Some(&tree));
    let n = 32.min(tree.shape().n_cells());
    let honest = bundle(&tree, &cells, seed_of(&c), n);
    let t = fx.t.path();
    let c_path = write(t, "commitment.json", &c);
    let honest_path = write(t, "honest.json", &serde_json::to_vec(&honest).unwrap());
    let with_bundle = [a("--bundle"), a(&honest_path)];

    // Honest: exit 0, the challenge, one line per challenged cell, the units read.
    let (code, out, err) = fx.cells(&c_path, &with_bundle);
    eprintln!("{out}");
    assert_eq!(code, 0, "{out}{err}");
    assert!(
        out.starts_with(&format!("verdict: pass (0/{n} challenged cells failed)")),
        "{out}"
    );
    assert!(
        out.contains(&format!(
            "challenge: {n} of {} cells",
            tree.shape().n_cells()
        )),
        "{out}"
    );
    assert_eq!(out.matches("\n  cell ").count(), n as usize, "{out}");
    assert!(out.contains("units ("), "{out}");
    // The same with opening proofs instead of the spec.
    let (code, out, err) = with_proofs(&fx, &fx.dir, &c_path, &honest_path);
    assert_eq!(code, 0, "{out}{err}");
    // The recorded cells_root: still a pass; another one: a cheat.
    let own = hex::encode(tree.root());
    let (code, out, _) = fx.cells(
        &c_path,
        &[&with_bundle[..], &[a("--cells-root"), a(&own)]].concat(),
    );
    assert_eq!(code, 0, "{out}");
    let other = hex::encode([1u8; 32]);
    let (code, out, _) = fx.cells(
        &c_path,
        &[&with_bundle[..], &[a("--cells-root"), a(&other)]].concat(),
    );
    assert_eq!(code, 1, "{out}");
    assert!(
        out.starts_with("verdict: cheat (the commitment's cells_root"),
        "{out}"
    );

    // Fabricated y: exit 1; the JSON report lists the failed cells.
    let (ftree, fcells) = serve(&fx.serve, &ids, CellServe::FabricatedY);
    let fc = commitment(prompt, output, Some(&ftree));
    let fab = bundle(&ftree, &fcells, seed_of(&fc), n);
    let (code, out, err) = fx.audit("fab", &fc, &fab, &[a("--json")]);
    assert_eq!(code, 1, "{out}{err}");
    let report: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
    assert_eq!(report["verdict"], "cheat");
    assert!(report["bundle"]["failed"].as_u64().unwrap() > 0, "{report}");
    assert_eq!(report["challenge"]["n"], n);

    // A challenged cell left unopened: a failed cell (exit 1).
    let mut missing = honest.clone();
    missing.openings.pop();
    let (code, out, _) = fx.audit("missing", &c, &missing, &[]);
    assert_eq!(code, 1, "{out}");
    assert!(out.contains("not opened"), "{out}");

    // An opening of a cell the challenge did not choose: not an answer (exit 1).
    let chosen = honest.challenge().unwrap();
    let unchosen = (0..honest.shape.n_cells())
        .find(|i| !chosen.contains(i))
        .unwrap();
    let mut extra = honest.clone();
    extra.openings[0].index = unchosen;
    let (code, out, _) = fx.audit("extra", &c, &extra, &[]);
    assert_eq!(code, 1, "{out}");
    assert!(out.contains("did not choose"), "{out}");

    // Not a bundle: exit 3.
    let junk = write(t, "junk.json", b"{\"cells_root\": 1}");
    let (code, _, err) = fx.cells(&c_path, &[a("--bundle"), a(&junk)]);
    assert_eq!(code, 3, "{err}");
    assert!(err.contains("not a cell audit bundle"), "{err}");
    // A policy below the minimum: exit 3, naming it.
    let (code, _, err) = fx.cells(
        &c_path,
        &[&with_bundle[..], &[a("--cells-n"), a("8")]].concat(),
    );
    assert_eq!(code, 3, "{err}");
    assert!(err.contains("below the minimum 32"), "{err}");

    // Not judged (exit 2): a commitment without cells from a serve not known to offer them,
    // and a refusal after the retention window.
    let bare = write(t, "bare.json", &commitment(prompt, output, None));
    let (code, out, _) = fx.cells(&bare, &with_bundle);
    assert_eq!(code, 2, "{out}");
    assert!(out.starts_with("verdict: not judged"), "{out}");
    let (code, out, _) = fx.cells(
        &c_path,
        &[
            a("--declined"),
            a("unknown-request"),
            a("--challenge-age-s"),
            a("601"),
        ],
    );
    assert_eq!(code, 2, "{out}");
    assert!(out.contains("past the 600 s retention window"), "{out}");

    // The auditor's checkpoint differs from the committed one in an expert a challenged cell
    // uses: exit 4, naming the unit and the tensor.
    let cell = engy_core::cells::Cell::decode(&honest.openings[0].cell).unwrap();
    let (layer, e) = (cell.layer(), cell.expert_ids()[0]);
    let bad = t.join("bad");
    copy_dir(&fx.dir, &bad);
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
    let (code, out, err) = with_proofs(&fx, &bad, &c_path, &honest_path);
    assert_eq!(code, 4, "{out}{err}");
    assert!(err.contains(&name), "{err}");
    assert!(err.contains(&format!("layer {layer} expert {e}")), "{err}");
}
