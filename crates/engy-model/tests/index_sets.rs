//! The DSA index-set comparison through the audit (issue 23 part A, docs/AUDITOR.md "DSA index
//! sets"): a GLM commitment of the audit oracle (transformers serving the arch oracle's
//! checkpoint in bf16) gets an `indexer_topk` trace in sglang's form, built from the key
//! positions a bf16 recompute keeps; the audit compares it, reports every set identical, and a
//! trace with one set moved is reported as such without changing the verdict.
use engy_core::trace::Trace;
use engy_model::audit::{audit_with, AuditParams, Recompute, Verdict};
use engy_model::index_sets::{IndexSetAudit, OwnIndexSets};
use engy_model::{Compute, LoadOptions, Model, Probe, Residency};
use serde_json::Value;

mod common;

fn dir(rel: &str) -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/vectors")
        .join(rel)
}

#[test]
fn a_committed_index_trace_is_compared_and_reported() {
    let ckpt = dir("arch/glm_moe_dsa");
    let opts = LoadOptions {
        residency: Residency::Resident,
        compute: Compute::Bf16,
        device: common::test_device(),
        ..LoadOptions::default()
    };
    let model = Model::open(&ckpt, &opts).unwrap();
    let root = engy_core::identity::model_root(&ckpt).unwrap();
    let mut value: Value = serde_json::from_slice(
        &std::fs::read(dir("audit-oracle/glm_moe_dsa/honest_bf16_00.json")).unwrap(),
    )
    .unwrap();
    let prompt: Vec<u32> = serde_json::from_value(value["toploc"]["prompt_ids"].clone()).unwrap();
    let output: Vec<u32> = serde_json::from_value(value["output_token_ids"].clone()).unwrap();
    let mut ids = prompt.clone();
    ids.extend(&output[..output.len() - 1]);
    let mut own = OwnIndexSets::new();
    model
        .hidden_states_probed(
            &ids,
            &mut Probe {
                attended: Some(&mut own),
                ..Probe::default()
            },
        )
        .unwrap();
    let cfg: Value =
        serde_json::from_slice(&std::fs::read(ckpt.join("config.json")).unwrap()).unwrap();
    let (layers, width) = (
        cfg["num_hidden_layers"].as_u64().unwrap() as usize,
        cfg["index_topk"].as_u64().unwrap() as usize,
    );
    let sglang = |own: &OwnIndexSets| -> Trace {
        let mut flat = Vec::new();
        for pos in 0..ids.len() {
            for l in 0..layers {
                let mut keys: Vec<i32> = own[&(pos, l)].iter().rev().map(|&k| k as i32).collect();
                keys.resize(width, -1);
                flat.extend(keys);
            }
        }
        Trace::encode(0, layers as u64, width as u64, &flat, true).unwrap()
    };
    let params = AuditParams::default();

    value["indexer_topk"] = serde_json::to_value(sglang(&own)).unwrap();
    let report = audit_with(&model, &root, &value, &params, Recompute::Auto).unwrap();
    assert_eq!(report.verdict, Verdict::Pass);
    let Some(IndexSetAudit::Compared(s)) = &report.index_sets else {
        panic!("not compared: {:?}", report.index_sets);
    };
    assert_eq!(s.compared, (ids.len() * layers) as u64);
    assert_eq!((s.identical, s.mean_overlap), (s.compared, 1.0));

    // The serve attended other keys at one late position of layer 2.
    let pos = ids.len() - 1;
    let mut moved = own.clone();
    let keys = moved.get_mut(&(pos, 2)).unwrap();
    let gone = keys.remove(0);
    keys.push((0..pos).find(|k| !keys.contains(k) && *k != gone).unwrap());
    value["indexer_topk"] = serde_json::to_value(sglang(&moved)).unwrap();
    let report = audit_with(&model, &root, &value, &params, Recompute::Auto).unwrap();
    assert_eq!(
        report.verdict,
        Verdict::Pass,
        "the comparison is reported, not judged"
    );
    let Some(IndexSetAudit::Compared(s)) = &report.index_sets else {
        panic!("not compared: {:?}", report.index_sets);
    };
    assert_eq!(s.identical, s.compared - 1);
    let w = s.worst.as_ref().unwrap();
    assert_eq!((w.position, w.layer), (pos, 2));
    assert!(
        (w.overlap - (width - 1) as f64 / width as f64).abs() < 1e-12,
        "{w:?}"
    );

    // Without a trace the report says so.
    value.as_object_mut().unwrap().remove("indexer_topk");
    let report = audit_with(&model, &root, &value, &params, Recompute::Auto).unwrap();
    assert!(matches!(
        report.index_sets,
        Some(IndexSetAudit::NotCompared { .. })
    ));
}
