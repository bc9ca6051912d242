//! Cells checked against committed weights (issue 23 B3): a real generated checkpoint is
//! committed (`engy-commit/v1`), its units opened; verifying a cell reads only the units it
//! touches and checks them against the root; a tampered expert the cell uses is named, one it
//! does not use is never read.
use std::path::{Path, PathBuf};

use engy_core::commit::{
    self, CommitOptions, Commitment, LayerPart, Progress, SpecFile, UnitId, UnitIndex,
};
use engy_model::cells::{
    serve_cells, verify_cell_committed, CellPolicy, CellServe, CommittedCellError,
    CommittedWeights, Openings, WeightCheckError,
};
use engy_model::{gen_model, GenConfig, LoadOptions, Model, Residency};

fn copy_dir(src: &Path, dst: &Path) {
    std::fs::create_dir_all(dst).unwrap();
    for e in std::fs::read_dir(src).unwrap() {
        let p = e.unwrap().path();
        std::fs::copy(&p, dst.join(p.file_name().unwrap())).unwrap();
    }
}

/// Flips the lowest bit of the first byte of tensor `name`'s data, in whichever shard holds
/// it (the file stays a valid checkpoint).
fn tamper(dir: &Path, name: &str) {
    for e in std::fs::read_dir(dir).unwrap() {
        let p: PathBuf = e.unwrap().path();
        if p.extension().is_none_or(|x| x != "safetensors") {
            continue;
        }
        let mut buf = std::fs::read(&p).unwrap();
        let (n, meta) = safetensors::SafeTensors::read_metadata(&buf).unwrap();
        if let Some(info) = meta.tensors().get(name) {
            buf[8 + n + info.data_offsets.0] ^= 1;
            std::fs::write(&p, buf).unwrap();
            return;
        }
    }
    panic!("no tensor {name}");
}

fn moe_proofs(c: &Commitment, layers: &[u32], n_experts: u32) -> Openings {
    let mut proofs = Vec::new();
    for &layer in layers {
        let mut parts = vec![LayerPart::Router, LayerPart::Shared];
        parts.extend((0..n_experts).map(LayerPart::Expert));
        for part in parts {
            proofs.push(c.open(UnitId::Layer { layer, part }).unwrap());
        }
    }
    Openings::from_proofs(proofs).unwrap()
}

fn streaming(dir: &Path) -> Model {
    Model::open(
        dir,
        &LoadOptions {
            residency: Residency::Streaming,
            ..LoadOptions::default()
        },
    )
    .unwrap()
}

#[test]
fn a_cell_reads_and_checks_only_its_units_and_names_a_tampered_expert() {
    let t = tempfile::tempdir().unwrap();
    let dir = t.path().join("m");
    gen_model(&dir, 11, &GenConfig::default()).unwrap();
    let c =
        commit::commit_checkpoint(&dir, &CommitOptions::default(), &Progress::default()).unwrap();
    let root = c.model_root;
    let model = streaming(&dir);
    let shape = model.routing_shape().unwrap();
    let ids: Vec<u32> = (1..24).collect();
    let cells = serve_cells(&model, &ids, CellServe::Honest).unwrap();
    let moe_layers: Vec<u32> = {
        let mut v: Vec<u32> = cells.iter().map(|c| c.layer()).collect();
        v.sort_unstable();
        v.dedup();
        v
    };
    let n_experts = shape.experts as u32;
    let policy = CellPolicy::default();
    let cell = &cells[cells.len() / 2];
    let (layer, used) = (cell.layer(), cell.expert_ids().to_vec());
    let unused = (0..n_experts).find(|e| !used.contains(e)).unwrap();
    let unit_bytes = |dir: &Path, part: LayerPart| -> u64 {
        let index = UnitIndex::open(dir, &c.config).unwrap();
        index
            .unit(UnitId::Layer { layer, part })
            .iter()
            .map(|t| t.data.len() as u64)
            .sum()
    };
    let touched: u64 = [LayerPart::Router, LayerPart::Shared]
        .into_iter()
        .chain(used.iter().map(|&e| LayerPart::Expert(e)))
        .map(|p| unit_bytes(&dir, p))
        .sum();

    // The honest checkpoint: the cell passes; exactly router + shared + its experts are read.
    let w = CommittedWeights::open(&dir, root, moe_proofs(&c, &moe_layers, n_experts)).unwrap();
    let check = verify_cell_committed(&model, &w, cell, &policy).unwrap();
    assert!(check.pass(), "{check:?}");
    assert_eq!(w.units_read(), 2 + used.len() as u64);
    assert_eq!(w.bytes_read(), touched);
    let all_experts: u64 = (0..n_experts)
        .map(|e| unit_bytes(&dir, LayerPart::Expert(e)))
        .sum();
    assert!(
        w.bytes_read() < all_experts,
        "{} of {all_experts}",
        w.bytes_read()
    );
    // A second check of the same cell reads nothing more.
    verify_cell_committed(&model, &w, cell, &policy).unwrap();
    assert_eq!(w.units_read(), 2 + used.len() as u64);

    // One bit of an expert the cell uses: refused, naming the unit and the tensor.
    let bad = t.path().join("bad");
    copy_dir(&dir, &bad);
    let name = format!(
        "model.layers.{layer}.mlp.experts.{}.down_proj.weight",
        used[0]
    );
    tamper(&bad, &name);
    let bad_model = streaming(&bad);
    let w = CommittedWeights::open(&bad, root, moe_proofs(&c, &moe_layers, n_experts)).unwrap();
    match verify_cell_committed(&bad_model, &w, cell, &policy) {
        Err(CommittedCellError::Weights(WeightCheckError::Tensor {
            unit,
            name: named,
            what,
        })) => {
            assert_eq!(
                unit,
                UnitId::Layer {
                    layer,
                    part: LayerPart::Expert(used[0])
                }
            );
            assert_eq!(named, name);
            assert!(what.contains("sha256"), "{what}");
        }
        other => panic!("tampered expert not refused: {other:?}"),
    }
    // Against the spec file's unit roots: the unit is named.
    let spec = SpecFile::from_commitment(&c, 0.0);
    let w = CommittedWeights::open(&bad, root, Openings::Spec(Box::new(spec))).unwrap();
    match verify_cell_committed(&bad_model, &w, cell, &policy) {
        Err(CommittedCellError::Weights(WeightCheckError::UnitRoot { unit, .. })) => assert_eq!(
            unit,
            UnitId::Layer {
                layer,
                part: LayerPart::Expert(used[0])
            }
        ),
        other => panic!("tampered expert not refused: {other:?}"),
    }

    // One bit of an expert the cell does not use: never read, the cell passes.
    let other = t.path().join("other");
    copy_dir(&dir, &other);
    tamper(
        &other,
        &format!("model.layers.{layer}.mlp.experts.{unused}.down_proj.weight"),
    );
    let other_model = streaming(&other);
    let w = CommittedWeights::open(&other, root, moe_proofs(&c, &moe_layers, n_experts)).unwrap();
    let check = verify_cell_committed(&other_model, &w, cell, &policy).unwrap();
    assert!(check.pass(), "{check:?}");
    assert_eq!(w.units_read(), 2 + used.len() as u64);

    // A root the proofs do not lead to: refused at open.
    let mut wrong = root;
    wrong[0] ^= 1;
    assert!(matches!(
        CommittedWeights::open(&dir, wrong, moe_proofs(&c, &moe_layers, n_experts)),
        Err(WeightCheckError::Proof { .. })
    ));
}

/// Item 5 of issue 39: a field the forward pass reads but the ten canonical keys do not hold
/// (`norm_topk_prob` changes every MoE layer's weighting) is the auditor's own file's under a
/// commitment without `bind_config`, and refused with it.
#[test]
fn a_bound_config_refuses_a_changed_routing_field() {
    let t = tempfile::tempdir().unwrap();
    let dir = t.path().join("m");
    gen_model(&dir, 11, &GenConfig::default()).unwrap();
    let unbound =
        commit::commit_checkpoint(&dir, &CommitOptions::default(), &Progress::default()).unwrap();
    let bound = commit::commit_checkpoint(
        &dir,
        &CommitOptions {
            bind_config: true,
            ..CommitOptions::default()
        },
        &Progress::default(),
    )
    .unwrap();
    assert_ne!(unbound.model_root, bound.model_root);
    assert_eq!(unbound.body_root, bound.body_root);
    assert!(unbound.config.config_sha256.is_none());
    // The honest checkpoint opens against both.
    let spec = |c: &Commitment| Openings::Spec(Box::new(SpecFile::from_commitment(c, 0.0)));
    assert!(
        !CommittedWeights::open(&dir, unbound.model_root, spec(&unbound))
            .unwrap()
            .config_bound()
    );
    assert!(CommittedWeights::open(&dir, bound.model_root, spec(&bound))
        .unwrap()
        .config_bound());

    // The same weights with norm_topk_prob flipped.
    let bad = t.path().join("bad");
    copy_dir(&dir, &bad);
    let path = bad.join("config.json");
    let mut cfg: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    let flipped = !cfg["norm_topk_prob"].as_bool().unwrap_or(false);
    cfg["norm_topk_prob"] = serde_json::Value::Bool(flipped);
    std::fs::write(&path, serde_json::to_vec_pretty(&cfg).unwrap()).unwrap();
    // Without the binding the changed routing rule is accepted (the gap this closes).
    assert!(CommittedWeights::open(&bad, unbound.model_root, spec(&unbound)).is_ok());
    // With it, refused.
    match CommittedWeights::open(&bad, bound.model_root, spec(&bound)) {
        Err(WeightCheckError::Config { .. }) => {}
        other => panic!("a changed config.json was not refused: {other:?}"),
    }
}
