//! The sampled cell audit on the generated devnet checkpoint: a bf16 serve's cells are
//! committed in an `engy-cells/v1` tree, challenged with a seed, opened, and checked against
//! the weights; honest cells never fail, each cheat's cells fail at a measured rate.
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use engy_core::cells::{select, verify_opening, CellShape, CellTree, LogitsDtype};
use engy_model::cells::{serve_cells, verify_cell, write_expert_cheat, CellPolicy, CellServe};
use engy_model::{corpus, gen_model, Checkpoint, Compute, GenConfig, Model, Precision};

fn checkpoint_dir() -> &'static Path {
    static DIR: OnceLock<(tempfile::TempDir, PathBuf)> = OnceLock::new();
    let (_, p) = DIR.get_or_init(|| {
        let t = tempfile::tempdir().unwrap();
        let p = t.path().join("m");
        gen_model(&p, 5, &GenConfig::default()).unwrap();
        (t, p)
    });
    p
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

fn shape_of(model: &Model, ids: &[u32], cells: &[engy_core::cells::Cell]) -> CellShape {
    let s = model.routing_shape().unwrap();
    let mut layers: Vec<u32> = cells.iter().map(|c| c.layer()).collect();
    layers.sort_unstable();
    layers.dedup();
    let dtype = cells[0].router_logits().dtype();
    CellShape::new(
        ids.len() as u32,
        layers,
        model.config().hidden_size as u32,
        s.experts as u32,
        s.top_k as u32,
        dtype,
    )
    .unwrap()
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
