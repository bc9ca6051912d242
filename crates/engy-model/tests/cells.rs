//! The sampled cell audit on the generated devnet checkpoint: a bf16 serve's cells are
//! committed in an `engy-cells/v2` tree, challenged with a seed, opened, and checked against
//! the weights; honest cells never fail, each cheat's cells fail at a measured rate. Bundles
//! bound to the auditor's recompute of the request ([`audit_bundle_with_recompute`]): cells of
//! zeros, cells of another request or another model fail; a uniformly scaled `y` and
//! expert-only FP8 rounding fail the statistics; honest bf16 and f32 serves pass.
mod common;

use std::path::Path;

use engy_core::cells::{
    select, verify_opening, Cell, CellAuditBundle, CellTree, LogitsDtype, RouterLogits,
};
use engy_model::arch::{CommittedRouting, RoutingRecord};
use engy_model::cells::{
    audit_bundle, audit_bundle_with_recompute, serve_cells, verify_cell, write_expert_cheat,
    BundleReport, BundleVerdict, CellPolicy, CellServe, CommittedWeights,
};
use engy_model::{corpus, gen_model, Checkpoint, Compute, GenConfig, Model, Precision, Probe};

use common::cells::{committed, shape_of};

/// One generated checkpoint shared by the tests of this binary.
fn checkpoint_dir() -> &'static Path {
    common::generated_checkpoint(5)
}

/// Token sequences as a serve would run them: chat prompts plus greedy continuations.
fn sequences(model: &Model, ck: &Checkpoint, n: usize, new_tokens: usize) -> Vec<Vec<u32>> {
    corpus::sample_prompts(17, n)
        .iter()
        .map(|user| {
            let text = format!("<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n");
            let mut ids = ck
                .tokenizer
                .encode(text.as_str(), false)
                .unwrap()
                .get_ids()
                .to_vec();
            let steps = model.generate(&ids, new_tokens, &[]).unwrap();
            ids.extend(steps.iter().map(|s| s.token_id));
            ids
        })
        .collect()
}

#[test]
fn honest_cells_pass_and_open_against_the_root() {
    let dir = checkpoint_dir();
    let ck = Checkpoint::open(dir, Precision::Bf16).unwrap();
    let serve = ck.model.with_compute(Compute::Bf16).unwrap();
    let policy = CellPolicy::default();
    let mut checked = 0;
    let (mut worst_logits, mut worst_y) = (0f32, 0f32);
    for (r, ids) in sequences(&serve, &ck, 30, 160).iter().enumerate() {
        let cells = serve_cells(&serve, ids, CellServe::Honest).unwrap();
        let shape = shape_of(&serve, ids, &cells);
        assert_eq!(shape.logits_dtype().unwrap(), LogitsDtype::Bf16);
        assert_eq!(cells.len() as u64, shape.n_cells());
        let tree = CellTree::from_cells(shape.clone(), &cells).unwrap();
        let root = tree.root();
        // The auditor's challenge: 16 cells from a seed drawn after the commitment.
        let seed = [r as u8 + 1; 32];
        for index in select(&seed, &root, shape.n_cells(), 16).unwrap() {
            let path = tree.open(index).unwrap();
            let bytes = cells[index as usize].encode();
            let cell = verify_opening(&shape, &root, &bytes, &path).unwrap();
            let c = verify_cell(&ck.model, &cell, &policy).unwrap();
            assert!(c.pass(), "honest cell failed: {c:?}");
        }
        // And every other cell, for the false-positive count.
        for cell in &cells {
            let c = verify_cell(&ck.model, cell, &policy).unwrap();
            assert!(c.pass(), "honest cell failed: {c:?}");
            worst_logits = worst_logits.max(c.logits_err);
            worst_y = worst_y.max(c.y_err);
            checked += 1;
        }
    }
    assert!(checked >= 10_000, "only {checked} honest cells");
    println!(
        "honest: {checked} cells, 0 failed; worst logits error {worst_logits:.3} of the \
         tolerance, worst y error {worst_y:.5}"
    );
}

#[test]
fn each_cheat_fails_its_cells() {
    let dir = checkpoint_dir();
    let ck = Checkpoint::open(dir, Precision::Bf16).unwrap();
    let honest = ck.model.with_compute(Compute::Bf16).unwrap();
    let int4 = Model::load_with(dir, Precision::Int4 { group_size: 32 }, Compute::Bf16).unwrap();
    // The expert-only cheats run a copy whose routed experts are rounded.
    let t = tempfile::tempdir().unwrap();
    let expert_cheat = |how: CellServe| {
        let copy = t.path().join(how.label());
        write_expert_cheat(dir, &copy, how.expert_quant().unwrap()).unwrap();
        Model::load_with(&copy, Precision::Bf16, Compute::Bf16).unwrap()
    };
    let (int4_experts, fp8_experts) = (
        expert_cheat(CellServe::Int4Experts),
        expert_cheat(CellServe::Fp8Experts),
    );
    let policy = CellPolicy::default();
    let seqs = sequences(&honest, &ck, 2, 32);
    // Per-cell detection floors (the measured rates are in docs/AUDITOR.md "Cells"): fp8
    // experts move `y` least.
    for (name, serve, how, floor) in [
        ("int4 weights", &int4, CellServe::Honest, 0.5),
        ("int4 experts", &int4_experts, CellServe::Int4Experts, 0.5),
        ("fp8 experts", &fp8_experts, CellServe::Fp8Experts, 0.15),
        ("top-k reduced", &honest, CellServe::TopKReduced, 0.5),
        ("expert swapped", &honest, CellServe::ExpertSwap, 0.5),
        ("fabricated y", &honest, CellServe::FabricatedY, 0.5),
    ] {
        let (mut n, mut failed) = (0usize, 0usize);
        for ids in &seqs {
            for cell in serve_cells(serve, ids, how).unwrap() {
                n += 1;
                failed += usize::from(!verify_cell(&ck.model, &cell, &policy).unwrap().pass());
            }
        }
        let p = failed as f64 / n as f64;
        let need = if p >= 1.0 {
            1.0
        } else {
            (0.01f64.ln() / (1.0 - p).ln()).ceil()
        };
        println!("{name}: {failed}/{n} cells failed ({p:.3}); cells for 99% detection: {need}");
        assert!(p > floor, "{name}: only {failed}/{n} cells failed");
    }
}

/// The checkpoint's commitment, as the auditor trusts it (its spec file's unit roots).
/// The bundle a miner answers a 32-cell challenge with: `cells` committed for the request
/// `ids` (the shape's token hash and positions are the request's), opened at `seed`.
fn bundle(model: &Model, ids: &[u32], cells: &[Cell], seed: u8) -> CellAuditBundle {
    common::cells::bundle(model, ids, cells, [seed; 32])
}

/// Cells of the same (position, layer) and sizes as `like`, every value rebuilt by `f`.
fn rebuild(like: &[Cell], f: impl Fn(&Cell) -> Cell) -> Vec<Cell> {
    like.iter().map(f).collect()
}

/// `cells` with every output value `y` multiplied by `k` (rounded to bf16), the rest unchanged.
fn y_scaled(cells: &[Cell], k: f32) -> Vec<Cell> {
    rebuild(cells, |c| {
        let y = c.y().iter().map(|v| half::bf16::from_f32(v.to_f32() * k));
        Cell::new(
            c.position(),
            c.layer(),
            c.x().to_vec(),
            c.router_logits().clone(),
            c.expert_ids().to_vec(),
            y.collect(),
        )
        .unwrap()
    })
}

fn audit(model: &Model, w: &CommittedWeights, b: &CellAuditBundle, ids: &[u32]) -> BundleReport {
    audit_bundle_with_recompute(model, w, b, ids, None, &CellPolicy::default()).unwrap()
}

fn summary(r: &BundleReport) -> String {
    format!(
        "{:?}: {}/{} cells failed; x_err max {:.4} ({} recomputes); y median {:.4}, bias {:+.4}, \
         near-ties {}/{} (limit {}); {:?}",
        r.verdict,
        r.failed,
        r.n,
        r.recompute.as_ref().map_or(f32::NAN, |b| b.x_err_max),
        r.recompute.as_ref().map_or(0, |b| b.recomputes),
        r.stats.y_err_median,
        r.stats.y_bias_mean,
        r.stats.near_ties,
        r.stats.n,
        r.stats.near_tie_limit,
        r.stats.failures
    )
}

#[test]
fn zero_copied_and_foreign_cells_fail_the_binding_to_the_recompute() {
    let dir = checkpoint_dir();
    let ck = Checkpoint::open(dir, Precision::Bf16).unwrap();
    let serve = ck.model.with_compute(Compute::Bf16).unwrap();
    let w = committed(dir);
    let seqs = sequences(&serve, &ck, 2, 48);
    let (a, b) = (&seqs[0], &seqs[1]);
    let honest = serve_cells(&serve, a, CellServe::Honest).unwrap();
    let s = serve.routing_shape().unwrap();

    // Zeros: x = 0, logits 0 (every expert a tie), experts 0..k, y = 0.
    let zeros = rebuild(&honest, |c| {
        let h = c.x().len();
        Cell::new(
            c.position(),
            c.layer(),
            vec![half::bf16::ZERO; h],
            RouterLogits::Bf16(vec![half::bf16::ZERO; s.experts]),
            (0..s.top_k as u32).collect(),
            vec![half::bf16::ZERO; h],
        )
        .unwrap()
    });
    // Another request's cells at the same (position, layer), committed for this request.
    let other: Vec<Cell> = serve_cells(&serve, b, CellServe::Honest).unwrap();
    let by_at = |cells: &[Cell], p: u32, l: u32| {
        cells
            .iter()
            .find(|c| (c.position(), c.layer()) == (p, l))
            .cloned()
    };
    let len = a.len().min(b.len());
    let a_short = &a[..len];
    let honest_short: Vec<Cell> = honest
        .iter()
        .filter(|c| (c.position() as usize) < len)
        .cloned()
        .collect();
    let copied = rebuild(&honest_short, |c| {
        by_at(&other, c.position(), c.layer()).unwrap()
    });
    // Another model's pass over this request (same architecture and sizes, other weights).
    let t = tempfile::tempdir().unwrap();
    gen_model(&t.path().join("m"), 6, &GenConfig::default()).unwrap();
    let foreign_model =
        Model::load_with(&t.path().join("m"), Precision::Bf16, Compute::Bf16).unwrap();
    let foreign = serve_cells(&foreign_model, a, CellServe::Honest).unwrap();

    let policy = CellPolicy::default();
    for (name, ids, cells) in [
        ("zeros", &a[..], &zeros),
        ("another request's cells", a_short, &copied),
        ("another model's cells", &a[..], &foreign),
    ] {
        let bnd = bundle(&serve, ids, cells, 7);
        // Today's unbound audit: every rule is self-consistent.
        let unbound = audit_bundle(&ck.model, &w, &bnd, &policy).unwrap();
        let bound = audit(&ck.model, &w, &bnd, ids);
        println!("{name}: unbound {}", summary(&unbound));
        println!("{name}: bound {}", summary(&bound));
        assert_eq!(
            bound.verdict,
            BundleVerdict::Cheat,
            "{name}: {}",
            summary(&bound)
        );
        // Both requests open with the same chat-template tokens: a copied cell there is the
        // honest cell. Every cell past the common prefix fails the binding.
        let common = a.iter().zip(b).take_while(|(x, y)| x == y).count() as u32;
        let past: Vec<_> = bound
            .cells
            .iter()
            .filter(|c| name != "another request's cells" || c.position >= common)
            .collect();
        assert!(
            past.len() >= 16,
            "{name}: {} cells past the prefix",
            past.len()
        );
        for c in past {
            assert!(
                c.failures
                    .iter()
                    .any(|f| f.contains("from the recompute's MoE input")),
                "{name}: cell ({}, {}) not caught: {:?}",
                c.position,
                c.layer,
                c.check
            );
        }
    }
    // The honest cells of the same request pass, and with the serve's routing trace replayed.
    let hb = bundle(&serve, a, &honest, 7);
    let r = audit(&ck.model, &w, &hb, a);
    assert_eq!(r.verdict, BundleVerdict::Pass, "{}", summary(&r));
    let mut record = RoutingRecord::new(s);
    serve
        .hidden_states_probed(
            a,
            &mut Probe {
                routing: Some(&mut record),
                ..Probe::default()
            },
        )
        .unwrap();
    let trace = CommittedRouting {
        start: 0,
        shape: s,
        ids: record.ids(0, a.len()),
    };
    let r = audit_bundle_with_recompute(&ck.model, &w, &hb, a, Some(&trace), &policy).unwrap();
    assert_eq!(r.verdict, BundleVerdict::Pass, "{}", summary(&r));
    assert!(r.recompute.as_ref().is_some_and(|b| b.replayed_trace));
    // Zeros stay caught with a trace.
    let zb = bundle(&serve, a, &zeros, 7);
    let r = audit_bundle_with_recompute(&ck.model, &w, &zb, a, Some(&trace), &policy).unwrap();
    assert_eq!(r.failed, r.n, "{}", summary(&r));
}

#[test]
fn honest_bundles_pass_and_scaled_or_fp8_outputs_fail_the_statistics() {
    let dir = checkpoint_dir();
    let ck = Checkpoint::open(dir, Precision::Bf16).unwrap();
    let bf16 = ck.model.with_compute(Compute::Bf16).unwrap();
    let w = committed(dir);
    let t = tempfile::tempdir().unwrap();
    let fp8_dir = t.path().join("fp8");
    write_expert_cheat(dir, &fp8_dir, CellServe::Fp8Experts.expert_quant().unwrap()).unwrap();
    let fp8 = Model::load_with(&fp8_dir, Precision::Bf16, Compute::Bf16).unwrap();
    let seqs = sequences(&bf16, &ck, 12, 96);
    let (mut x_max, mut y_med_max, mut bias_max, mut near) = (0f32, 0f32, 0f32, 0usize);
    let (mut cell_y_max, mut cell_bias_max) = (0f32, 0f32);
    let (mut honest_n, mut cells_n) = (0usize, 0usize);
    let (mut scaled_caught, mut fp8_caught, mut scaled_cells_pass) = (0usize, 0usize, 0usize);
    for (r, ids) in seqs.iter().enumerate() {
        let seed = r as u8 + 1;
        for serve in [&bf16, &ck.model] {
            let cells = serve_cells(serve, ids, CellServe::Honest).unwrap();
            let rep = audit(&ck.model, &w, &bundle(serve, ids, &cells, seed), ids);
            assert_eq!(
                rep.verdict,
                BundleVerdict::Pass,
                "honest: {}",
                summary(&rep)
            );
            x_max = x_max.max(rep.recompute.as_ref().unwrap().x_err_max);
            y_med_max = y_med_max.max(rep.stats.y_err_median);
            bias_max = bias_max.max(rep.stats.y_bias_mean.abs());
            near += rep.stats.near_ties;
            for k in rep.cells.iter().filter_map(|c| c.check.as_ref()) {
                cell_y_max = cell_y_max.max(k.y_err);
                cell_bias_max = cell_bias_max.max(k.y_bias.abs());
            }
            cells_n += rep.stats.n;
            honest_n += 1;
        }
        // Every output scaled by 1.02: each cell alone passes (y_rel 0.05).
        let honest = serve_cells(&bf16, ids, CellServe::Honest).unwrap();
        let scaled = y_scaled(&honest, 1.02);
        let rep = audit(&ck.model, &w, &bundle(&bf16, ids, &scaled, seed), ids);
        scaled_cells_pass += rep.cells.iter().filter(|c| c.pass()).count();
        scaled_caught += usize::from(rep.verdict == BundleVerdict::Cheat);
        if r == 0 {
            println!("1.02-scaled y: {}", summary(&rep));
        }
        let cells = serve_cells(&fp8, ids, CellServe::Fp8Experts).unwrap();
        let rep = audit(&ck.model, &w, &bundle(&fp8, ids, &cells, seed), ids);
        fp8_caught += usize::from(rep.verdict == BundleVerdict::Cheat);
        if r == 0 {
            println!("fp8 experts: {}", summary(&rep));
        }
    }
    println!(
        "honest: {honest_n} bundles ({cells_n} cells, bf16 and f32 serves) pass; largest x_err \
         {x_max:.4}, largest y median {y_med_max:.4}, largest |mean bias| {bias_max:.4}, \
         near-ties {near}/{cells_n}; one cell: largest y_err {cell_y_max:.4}, largest \
         |y_bias| {cell_bias_max:.4}"
    );
    println!(
        "1.02-scaled y: {scaled_caught}/{} bundles caught ({scaled_cells_pass} of their cells \
         pass alone); fp8 experts: {fp8_caught}/{} caught",
        seqs.len(),
        seqs.len()
    );
    assert!(scaled_cells_pass > 0, "the scaling must pass cells alone");
    assert_eq!(scaled_caught, seqs.len());
    assert_eq!(fp8_caught, seqs.len());
}

/// The bound audit on the other architectures' tiny checkpoints (`tests/vectors/arch`, made by
/// transformers): Qwen3.5-MoE (shared expert, gated) and GLM-MoE-DSA (sigmoid router with
/// groups, the tight cell margin of 1/128, DSA). Honest bf16 and f32 serves pass; a 1.02-scaled
/// `y` and expert-only FP8 rounding are caught.
#[test]
fn other_architectures_honest_pass_and_statistics_catch() {
    let vectors = common::vectors_dir();
    for arch in ["qwen3_5_moe", "glm_moe_dsa"] {
        let dir = vectors.join(arch);
        let verifier = Model::load(&dir, Precision::Bf16).unwrap();
        let bf16 = verifier.with_compute(Compute::Bf16).unwrap();
        let w = committed(&dir);
        let t = tempfile::tempdir().unwrap();
        let fp8_dir = t.path().join("fp8");
        write_expert_cheat(
            &dir,
            &fp8_dir,
            CellServe::Fp8Experts.expert_quant().unwrap(),
        )
        .unwrap();
        let fp8 = Model::load_with(&fp8_dir, Precision::Bf16, Compute::Bf16).unwrap();
        let vocab = verifier.config().vocab_size as u64;
        let (mut honest, mut x_max, mut near, mut cells_n) = (0usize, 0f32, 0usize, 0usize);
        let (mut y_med_max, mut scaled, mut fp8_caught, mut requests) = (0f32, 0, 0, 0);
        for r in 0..6u64 {
            let mut state = 0x9e37_79b9_7f4a_7c15u64 ^ ((r + 1) * 7919);
            let ids: Vec<u32> = (0..80)
                .map(|_| {
                    state = state
                        .wrapping_mul(6_364_136_223_846_793_005)
                        .wrapping_add(1_442_695_040_888_963_407);
                    ((state >> 33) % vocab) as u32
                })
                .collect();
            let seed = r as u8 + 1;
            requests += 1;
            for serve in [&bf16, &verifier] {
                let cells = serve_cells(serve, &ids, CellServe::Honest).unwrap();
                let rep = audit(&verifier, &w, &bundle(serve, &ids, &cells, seed), &ids);
                assert_eq!(
                    rep.verdict,
                    BundleVerdict::Pass,
                    "{arch} honest: {}",
                    summary(&rep)
                );
                x_max = x_max.max(rep.recompute.as_ref().unwrap().x_err_max);
                y_med_max = y_med_max.max(rep.stats.y_err_median);
                near += rep.stats.near_ties;
                cells_n += rep.stats.n;
                honest += 1;
            }
            let cells = serve_cells(&bf16, &ids, CellServe::Honest).unwrap();
            let up = y_scaled(&cells, 1.02);
            let rep = audit(&verifier, &w, &bundle(&bf16, &ids, &up, seed), &ids);
            scaled += usize::from(rep.verdict == BundleVerdict::Cheat);
            let cells = serve_cells(&fp8, &ids, CellServe::Fp8Experts).unwrap();
            let rep = audit(&verifier, &w, &bundle(&fp8, &ids, &cells, seed), &ids);
            if r == 0 {
                println!("{arch} fp8 experts: {}", summary(&rep));
            }
            fp8_caught += usize::from(rep.verdict == BundleVerdict::Cheat);
        }
        println!(
            "{arch}: honest {honest} bundles pass (largest x_err {x_max:.4}, largest y median \
             {y_med_max:.4}, near-ties {near}/{cells_n}); 1.02-scaled y caught {scaled}/{requests}; \
             fp8 experts caught {fp8_caught}/{requests}"
        );
        assert_eq!(scaled, requests, "{arch}: scaled y");
        assert_eq!(fp8_caught, requests, "{arch}: fp8 experts");
    }
}
