//! The sampled cell audit's red team (issue 39): each attack a cheating miner can make on
//! `engy-audit cells`, through the real binary, against a generated checkpoint, with the
//! honest serve beside it. Every attack must be a cheat (exit 1); the honest requests must
//! pass (exit 0). The test prints the table (attack, exit, verdict line).
//!
//! Before issue 39 (main fef574c, the issue's own runs) zero cells, `n` = 0, a chosen seed, a
//! shrunk shape, a declined challenge and a commitment without cells all passed or were
//! neutral; each row below names the rule that now catches it. The last row is not a cell
//! cheat at all: a serve that generates with cheap weights and commits cells from an honest
//! commit pass passes the cell audit — that gap is TOPLOC's (docs/AUDITOR.md "Cells").
mod cells_common;

use cells_common::{a, bundle, commitment, fixture, seed_of, serve, shape_of, write};
use engy_core::cells::{cell_leaf, Cell, CellAuditBundle, CellTree, RouterLogits};
use engy_core::commit::spec::Hex;
use engy_core::commit::tree::{inclusion_path, mth, node};
use engy_model::cells::{write_expert_cheat, CellServe, ExpertQuant};
use engy_model::{gen_model, Compute, GenConfig, Model, Precision};
use half::bf16;

/// One row of the table.
struct Row {
    attack: &'static str,
    code: i32,
    line: String,
    want: i32,
}

/// A bundle over raw cell bytes (cells `Cell::new` would refuse, e.g. a NaN logit): the
/// tree, root and paths computed from the bytes as a miner would.
fn raw_bundle(
    shape: &engy_core::cells::CellShape,
    cells: &[Vec<u8>],
    seed: [u8; 32],
    n: u64,
) -> ([u8; 32], CellAuditBundle) {
    let leaves: Vec<[u8; 32]> = cells.iter().map(|b| cell_leaf(b)).collect();
    let root = node(&shape.leaf(), &mth(&leaves));
    let chosen = engy_core::cells::select(&seed, &root, shape.n_cells(), n).unwrap();
    let openings = chosen
        .iter()
        .map(|&i| engy_core::cells::BundleOpening {
            index: i,
            cell: cells[i as usize].clone(),
            path: inclusion_path(&leaves, i as usize)
                .unwrap()
                .into_iter()
                .map(Hex)
                .collect(),
        })
        .collect();
    (
        root,
        CellAuditBundle {
            cells_root: Hex(root),
            shape: shape.clone(),
            seed: Hex(seed),
            n,
            openings,
        },
    )
}

/// The commitment JSON of `prompt` + `output` committing `root` under `shape`.
fn commitment_with(
    prompt: &[u32],
    output: &[u32],
    root: [u8; 32],
    shape: &engy_core::cells::CellShape,
) -> Vec<u8> {
    let mut v: serde_json::Value =
        serde_json::from_slice(&commitment(prompt, output, None)).unwrap();
    v["cells"] = serde_json::json!({"scheme": engy_core::cells::SCHEME, "root": hex::encode(root),
                                    "shape": shape});
    serde_json::to_vec(&v).unwrap()
}

#[test]
fn every_attack_is_a_cheat_and_honest_serves_pass() {
    let fx = fixture(9);
    let t = fx.t.path().to_path_buf();
    let ids: Vec<u32> = (3..67).collect();
    let (prompt, output) = ids.split_at(37);
    let other_ids: Vec<u32> = (103..167).collect();
    let mut rows: Vec<Row> = Vec::new();
    let mut run = |attack: &'static str, want: i32, r: (i32, String, String)| {
        let line = r.1.lines().next().unwrap_or("").to_string();
        eprintln!(
            "{attack}: exit {} {line}{}",
            r.0,
            if r.0 == 3 { &r.2 } else { "" }
        );
        rows.push(Row {
            attack,
            code: r.0,
            line,
            want,
        });
    };

    // Honest serves: three requests, each its own commitment and challenge.
    let (tree, cells) = serve(&fx.serve, &ids, CellServe::Honest);
    let n = 32.min(tree.shape().n_cells());
    let c = commitment(prompt, output, Some(&tree));
    for (k, req) in [ids.clone(), other_ids.clone(), (40..104).collect()]
        .iter()
        .enumerate()
    {
        let (p, o) = req.split_at(20 + 5 * k);
        let (tr, ce) = serve(&fx.serve, req, CellServe::Honest);
        let cc = commitment(p, o, Some(&tr));
        let b = bundle(&tr, &ce, seed_of(&cc), n);
        run(
            "honest bf16",
            0,
            fx.audit(&format!("honest-{k}"), &cc, &b, &[]),
        );
    }

    // Zero cells: x = 0, logits 0, experts 0..k, y = 0 at every place of the request's shape.
    let shape = tree.shape().clone();
    let zeros: Vec<Cell> = cells
        .iter()
        .map(|c| {
            let h = c.hidden() as usize;
            Cell::new(
                c.position(),
                c.layer(),
                vec![bf16::ZERO; h],
                RouterLogits::Bf16(vec![bf16::ZERO; c.n_experts() as usize]),
                (0..c.top_k()).collect(),
                vec![bf16::ZERO; h],
            )
            .unwrap()
        })
        .collect();
    let zt = CellTree::from_cells(shape.clone(), &zeros).unwrap();
    let zc = commitment(prompt, output, Some(&zt));
    run(
        "zero cells",
        1,
        fx.audit("zeros", &zc, &bundle(&zt, &zeros, seed_of(&zc), n), &[]),
    );

    // Copied cells: another request's honest cells, committed under this request's shape.
    let (_, copied) = serve(&fx.serve, &other_ids, CellServe::Honest);
    let copied: Vec<Cell> = copied; // same positions and layers: the tree accepts them
    let ct = CellTree::from_cells(shape.clone(), &copied).unwrap();
    let cc = commitment(prompt, output, Some(&ct));
    run(
        "copied cells (this request's shape)",
        1,
        fx.audit("copied", &cc, &bundle(&ct, &copied, seed_of(&cc), n), &[]),
    );
    // ...or under the other request's shape (its own tokens).
    let ot = CellTree::from_cells(shape_of(&other_ids, &copied), &copied).unwrap();
    let oc = commitment(prompt, output, Some(&ot));
    run(
        "copied commitment (other tokens)",
        1,
        fx.audit("copied2", &oc, &bundle(&ot, &copied, seed_of(&oc), n), &[]),
    );

    // Cells from another model of the same shape (another seed).
    let other_dir = t.join("other-model");
    gen_model(&other_dir, 10, &GenConfig::default()).unwrap();
    let other_model = Model::load_with(&other_dir, Precision::Bf16, Compute::Bf16).unwrap();
    let (mt, mcells) = serve(&other_model, &ids, CellServe::Honest);
    let mc = commitment(prompt, output, Some(&mt));
    run(
        "cells from another model",
        1,
        fx.audit(
            "other-model",
            &mc,
            &bundle(&mt, &mcells, seed_of(&mc), n),
            &[],
        ),
    );

    // n = 0 and no openings.
    let mut none = bundle(&tree, &cells, seed_of(&c), n);
    none.n = 0;
    none.openings.clear();
    run("n = 0", 1, fx.audit("n0", &c, &none, &[]));
    // A seed the miner chose (its bundle consistent with it).
    run(
        "chosen seed",
        1,
        fx.audit("seed", &c, &bundle(&tree, &cells, [1; 32], n), &[]),
    );
    // A shrunk shape: a tree over the first position only.
    let small = CellTree::from_cells(
        shape_of(&ids[..1], &cells[..shape.layers().len()]),
        &cells[..shape.layers().len()],
    )
    .unwrap();
    let sc = commitment(prompt, output, Some(&small));
    let sb = bundle(&small, &cells, seed_of(&sc), small.shape().n_cells().min(n));
    run(
        "shrunk shape (one position)",
        1,
        fx.audit("shrunk", &sc, &sb, &[]),
    );
    // NaN router logits (bytes a serve would never produce).
    let nan_cells: Vec<Vec<u8>> = cells
        .iter()
        .map(|cell| {
            let mut b = cell.encode();
            let at = 24 + 2 * cell.hidden() as usize;
            b[at..at + 2].copy_from_slice(&0x7fc0u16.to_le_bytes());
            b
        })
        .collect();
    let (nroot, _) = raw_bundle(&shape, &nan_cells, [0; 32], n);
    let nc = commitment_with(prompt, output, nroot, &shape);
    let (_, nb) = raw_bundle(&shape, &nan_cells, seed_of(&nc), n);
    run("NaN router logits", 1, fx.audit("nan", &nc, &nb, &[]));

    // Declined challenges and omitted cells.
    let c_path = write(&t, "c.json", &c);
    for (attack, how) in [
        ("declined: unknown_request", "unknown-request"),
        ("declined: bad_challenge", "bad-challenge"),
        ("declined: no answer", "no-answer"),
    ] {
        run(
            attack,
            1,
            fx.cells(
                &c_path,
                &[a("--declined"), a(how), a("--challenge-age-s"), a("30")],
            ),
        );
    }
    let bare = write(&t, "bare.json", &commitment(prompt, output, None));
    run(
        "commitment without cells",
        1,
        fx.cells(
            &bare,
            &[a("--serve-offers-cells"), a("--declined"), a("no-answer")],
        ),
    );

    // Cells computed wrongly (the numeric checks).
    for (attack, how) in [
        ("fabricated y", CellServe::FabricatedY),
        ("top-k reduced", CellServe::TopKReduced),
        ("expert swap", CellServe::ExpertSwap),
    ] {
        let (ft, fcells) = serve(&fx.serve, &ids, how);
        let fc = commitment(prompt, output, Some(&ft));
        run(
            attack,
            1,
            fx.audit(attack, &fc, &bundle(&ft, &fcells, seed_of(&fc), n), &[]),
        );
    }
    // Systematic near-tie swaps: wherever a set within the cell margin exists, the serve runs
    // and reports it. On this softmax router a challenged swapped cell fails alone (its
    // experts are not the top-k of its own committed logits); an audit whose challenge holds
    // none passes (one audit's odds; tests/cells_near_tie.rs in engy-model has the rates and
    // the ledger). On main 847f793 every such audit passed.
    {
        let (st, scells) = serve(&fx.serve, &ids, CellServe::NearTieSwap);
        let sc = commitment(prompt, output, Some(&st));
        let b = bundle(&st, &scells, seed_of(&sc), n);
        let swapped = b
            .openings
            .iter()
            .filter(|o| {
                let i = o.index as usize;
                scells[i].expert_ids() != cells[i].expert_ids()
            })
            .count();
        let attack = "systematic near-tie swaps";
        run(
            attack,
            if swapped > 0 { 1 } else { 0 },
            fx.audit(attack, &sc, &b, &[]),
        );
        eprintln!("near-tie swaps: {swapped} of the {n} challenged cells swapped");
    }
    // A uniformly scaled y (every MoE output × 1.02).
    let scaled: Vec<Cell> = cells
        .iter()
        .map(|c| {
            Cell::new(
                c.position(),
                c.layer(),
                c.x().to_vec(),
                c.router_logits().clone(),
                c.expert_ids().to_vec(),
                c.y()
                    .iter()
                    .map(|v| bf16::from_f32(v.to_f32() * 1.02))
                    .collect(),
            )
            .unwrap()
        })
        .collect();
    let yt = CellTree::from_cells(shape.clone(), &scaled).unwrap();
    let yc = commitment(prompt, output, Some(&yt));
    run(
        "y scaled by 1.02",
        1,
        fx.audit("scaled", &yc, &bundle(&yt, &scaled, seed_of(&yc), n), &[]),
    );
    // Expert-only quantisation: the serve runs a copy whose routed experts are rounded.
    for (attack, q, how) in [
        (
            "int4 experts",
            ExpertQuant::Int4 { group_size: 32 },
            CellServe::Int4Experts,
        ),
        ("fp8 experts", ExpertQuant::Fp8, CellServe::Fp8Experts),
    ] {
        let copy = t.join(format!("cheat-{}", how.label()));
        write_expert_cheat(&fx.dir, &copy, q).unwrap();
        let cheat = Model::load_with(&copy, Precision::Bf16, Compute::Bf16).unwrap();
        let (qt, qcells) = serve(&cheat, &ids, how);
        let qc = commitment(prompt, output, Some(&qt));
        run(
            attack,
            1,
            fx.audit(attack, &qc, &bundle(&qt, &qcells, seed_of(&qc), n), &[]),
        );
    }
    // TOPLOC's gap: a serve that generated with int4 weights, then committed cells from an
    // honest commit pass over its own output: the cells are honest, the cell audit passes;
    // only TOPLOC (engy-audit audit) sees the generation.
    run(
        "honest cells over a cheap generation (TOPLOC's gap)",
        0,
        fx.audit("gap", &c, &bundle(&tree, &cells, seed_of(&c), n), &[]),
    );

    let mut table =
        String::from("\nattack                                               exit  verdict\n");
    for r in &rows {
        table.push_str(&format!("{:<52} {:>4}  {}\n", r.attack, r.code, r.line));
    }
    eprintln!("{table}");
    let wrong: Vec<&Row> = rows.iter().filter(|r| r.code != r.want).collect();
    assert!(
        wrong.is_empty(),
        "{} rows not as expected: {:?}{table}",
        wrong.len(),
        wrong.iter().map(|r| r.attack).collect::<Vec<_>>()
    );
}

/// `engy-audit audit` on a serve that offers routing traces (`--serve-offers-routing`): a
/// commitment without a trace, or with one that covers one position, is a cheat; before issue
/// 39 both were "not replayed" and TOPLOC alone decided (the honest proofs pass). Without the
/// flag the honest commitment still passes.
#[test]
fn a_withheld_or_short_routing_trace_is_a_cheat_when_the_serve_offers_traces() {
    use engy_core::toploc::Params;
    use engy_core::trace::Trace;
    use engy_model::audit::commit_greedy;
    use engy_model::Checkpoint;

    let t = tempfile::tempdir().unwrap();
    let dir = t.path().join("m");
    gen_model(&dir, 3, &GenConfig::default()).unwrap();
    let ck = Checkpoint::open(&dir, Precision::Bf16).unwrap();
    let prompt: Vec<u32> = (5..25).collect();
    let honest = commit_greedy(&ck.model, &ck.model_root, &prompt, 40, &[], &Params::ENGY).unwrap();
    let audit = |name: &str, c: &serde_json::Value, extra: &[&str]| {
        let p = write(t.path(), name, &serde_json::to_vec(c).unwrap());
        let mut args = vec![
            a("audit"),
            a("--checkpoint"),
            a(&dir),
            a("--commitment"),
            a(&p),
        ];
        args.extend(extra.iter().map(a));
        let (code, out, err) = cells_common::text(&cells_common::engy_audit(&args));
        eprintln!(
            "{name} {extra:?}: exit {code} {}",
            out.lines().next().unwrap_or(&err)
        );
        code
    };
    assert_eq!(
        audit("no-trace.json", &honest, &[]),
        0,
        "honest, no trace, not required"
    );
    assert_eq!(
        audit("no-trace.json", &honest, &["--serve-offers-routing"]),
        1,
        "a withheld trace"
    );
    // A trace of the model's shape over position 0 only.
    let rs = ck.model.routing_shape().unwrap();
    let ids: Vec<i32> = (0..rs.layers * rs.top_k)
        .map(|i| (i % rs.top_k) as i32)
        .collect();
    let short = Trace::encode(0, rs.layers as u64, rs.top_k as u64, &ids, false).unwrap();
    let mut c = honest.clone();
    c["routing"] = serde_json::to_value(&short).unwrap();
    assert_eq!(
        audit("short-trace.json", &c, &["--serve-offers-routing"]),
        1,
        "a trace of one position"
    );
}
