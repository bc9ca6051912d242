//! Routing traces on the generated devnet checkpoint (a Qwen3-MoE): what a serve records while it
//! decodes, and the auditor's check and replay of a committed trace.
mod common;

use std::path::Path;

use engy_core::toploc::Params;
use engy_model::arch::{CommittedRouting, Margin, RoutingCheck, RoutingRecord};
use engy_model::audit::{
    audit_with, audit_with_routing, commit_greedy, AuditParams, Recompute, RoutingAudit,
    RoutingPolicy, RoutingSummary, Verdict,
};
use engy_model::{corpus, Checkpoint, Model, Precision, Probe};

/// One generated checkpoint shared by the tests of this binary.
fn checkpoint_dir() -> &'static Path {
    common::generated_checkpoint(11)
}

fn prompt(ck: &Checkpoint, i: usize) -> Vec<u32> {
    let user = &corpus::sample_prompts(3, 4)[i];
    let text = format!("<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n");
    ck.tokenizer
        .encode(text.as_str(), false)
        .unwrap()
        .get_ids()
        .to_vec()
}

/// Greedy decoding of `n` tokens; returns the output ids and the routing every step returned,
/// concatenated (positions `0 .. prompt + n - 1`).
fn decode(model: &Model, prompt: &[u32], n: usize) -> (Vec<u32>, Vec<u32>) {
    let (mut out, mut routing) = (Vec::new(), Vec::new());
    let mut dec = model.decoder(prompt).unwrap();
    for _ in 0..n {
        let s = dec.step().unwrap();
        out.push(s.token_id);
        routing.extend(s.routed_experts);
    }
    (out, routing)
}

/// The routing a teacher-forced pass of `model` records over `ids`.
fn teacher_forced_routing(model: &Model, ids: &[u32]) -> Vec<u32> {
    let mut record = RoutingRecord::new(model.routing_shape().unwrap());
    model
        .hidden_states_probed(
            ids,
            &mut Probe {
                routing: Some(&mut record),
                ..Probe::default()
            },
        )
        .unwrap();
    record.ids(0, ids.len())
}

fn summary(audit: &Option<RoutingAudit>) -> &RoutingSummary {
    match audit {
        Some(RoutingAudit::Checked(s)) => s,
        other => panic!("the routing was not checked: {other:?}"),
    }
}

#[test]
fn decode_steps_return_the_routing_of_every_computed_position() {
    let ck = Checkpoint::open(checkpoint_dir(), Precision::Bf16).unwrap();
    let shape = ck
        .model
        .routing_shape()
        .expect("the devnet model has MoE layers");
    let p = prompt(&ck, 0);
    let n = 24;
    let (out, routing) = decode(&ck.model, &p, n);
    let rows = p.len() + n - 1;
    assert_eq!(routing.len(), rows * shape.layers * shape.top_k);
    assert!(routing.iter().all(|&e| (e as usize) < shape.experts));
    // Each position's experts are distinct within a MoE layer.
    for cell in routing.chunks(shape.top_k) {
        let mut c = cell.to_vec();
        c.sort_unstable();
        c.dedup();
        assert!(c.len() == shape.top_k || cell.iter().all(|&e| e == 0));
    }
    // Prefill + one-token decode steps route exactly as one teacher-forced pass does.
    let mut ids = p.clone();
    ids.extend(&out[..n - 1]);
    assert_eq!(teacher_forced_routing(&ck.model, &ids), routing);
}

#[test]
fn an_honest_trace_agrees_everywhere_and_passes() {
    let ck = Checkpoint::open(checkpoint_dir(), Precision::Bf16).unwrap();
    let shape = ck.model.routing_shape().unwrap();
    let p = prompt(&ck, 1);
    let params = AuditParams {
        toploc_k: 128.min(ck.model.config().hidden_size),
        ..AuditParams::default()
    };
    let proof = params.proof_params(Params::ENGY.decode_batching_size);
    let c = commit_greedy(&ck.model, &ck.model_root, &p, 40, &[], &proof).unwrap();
    let out: Vec<u32> = serde_json::from_value(c["output_token_ids"].clone()).unwrap();
    let (_, ids) = decode(&ck.model, &p, out.len());
    let committed = CommittedRouting {
        start: 0,
        shape,
        ids,
    };
    // The same trace placed after the sequence covers no cell: reported as not replayed,
    // not as a check of "0/0 cells".
    let audit = |trace: CommittedRouting| {
        audit_with_routing(
            &ck.model,
            &ck.model_root,
            &c,
            &params,
            Recompute::F32,
            Some(trace),
        )
        .unwrap()
    };
    let r = audit(CommittedRouting {
        start: 1 << 40,
        ..committed.clone()
    });
    assert!(
        matches!(&r.routing, Some(RoutingAudit::NotReplayed { reason }) if reason.contains("covers no")),
        "{:?}",
        r.routing
    );
    let r = audit(committed);
    assert_eq!(r.verdict, Verdict::Pass, "{r:?}");
    let s = summary(&r.routing);
    let moe_layers = s.layers.len();
    assert!(moe_layers > 0);
    assert_eq!(s.totals.compared, (p.len() + out.len() - 1) * moe_layers);
    assert_eq!(s.totals.agree, s.totals.compared);
    assert_eq!(s.mismatch_rate, 0.0);
    assert!(s.first_divergence.is_none());
}

#[test]
fn a_cheat_serve_routing_is_a_cheat_even_when_toploc_passes() {
    let dir = checkpoint_dir();
    let ck = Checkpoint::open(dir, Precision::Bf16).unwrap();
    let int4 = Model::load(dir, Precision::Int4 { group_size: 32 }).unwrap();
    let shape = ck.model.routing_shape().unwrap();
    let p = prompt(&ck, 2);
    let params = AuditParams {
        toploc_k: 128.min(ck.model.config().hidden_size),
        ..AuditParams::default()
    };
    let proof = params.proof_params(Params::ENGY.decode_batching_size);
    // Honest hidden states (TOPLOC passes), but the routing of int4 weights on the same tokens:
    // a serve whose experts ran on other weights than the ones its proofs claim.
    let c = commit_greedy(&ck.model, &ck.model_root, &p, 40, &[], &proof).unwrap();
    let out: Vec<u32> = serde_json::from_value(c["output_token_ids"].clone()).unwrap();
    let mut ids = p.clone();
    ids.extend(&out[..out.len() - 1]);
    let committed = CommittedRouting {
        start: 0,
        shape,
        ids: teacher_forced_routing(&int4, &ids),
    };
    let without = audit_with(&ck.model, &ck.model_root, &c, &params, Recompute::F32).unwrap();
    assert_eq!(without.verdict, Verdict::Pass, "TOPLOC alone passes it");
    let r = audit_with_routing(
        &ck.model,
        &ck.model_root,
        &c,
        &params,
        Recompute::F32,
        Some(committed),
    )
    .unwrap();
    assert_eq!(r.verdict, Verdict::Cheat, "{r:?}");
    let s = summary(&r.routing);
    assert!(s.is_cheat());
    assert!(s.mismatch_rate > params.routing.max_mismatch_rate);
    let first = s.first_divergence.as_ref().expect("a first divergence");
    assert!(first.gap > s.margin.at(0.0) || first.gap.is_infinite());
}

#[test]
fn near_ties_are_replayed_and_counted() {
    let ck = Checkpoint::open(checkpoint_dir(), Precision::Bf16).unwrap();
    let shape = ck.model.routing_shape().unwrap();
    let p = prompt(&ck, 0);
    let own = teacher_forced_routing(&ck.model, &p);
    // Replace one expert of the last position's first MoE layer with an expert it did not
    // choose: with an unbounded margin that is a near-tie.
    let mut committed = own.clone();
    let last = (p.len() - 1) * shape.layers * shape.top_k;
    let layer = (0..shape.layers)
        .find(|l| {
            committed[last + l * shape.top_k..last + (l + 1) * shape.top_k]
                .iter()
                .any(|&e| e != 0)
        })
        .unwrap();
    let at = last + layer * shape.top_k;
    let cell = committed[at..at + shape.top_k].to_vec();
    let other = (0..shape.experts as u32)
        .find(|e| !cell.contains(e))
        .unwrap();
    committed[at] = other;
    let trace = CommittedRouting {
        start: 0,
        shape,
        ids: committed.clone(),
    };
    let wide = Margin {
        abs: f32::MAX,
        rel: 0.0,
    };
    for replay in [false, true] {
        let mut check = RoutingCheck::new(trace.clone(), wide, replay);
        let mut record = RoutingRecord::new(shape);
        let hidden = ck
            .model
            .hidden_states_probed(
                &p,
                &mut Probe {
                    check: Some(&mut check),
                    routing: Some(&mut record),
                    ..Probe::default()
                },
            )
            .unwrap();
        let t = check.totals();
        assert_eq!((t.near_tie, t.mismatch), (1, 0));
        assert_eq!(t.replayed, usize::from(replay));
        let dispatched = record.ids(0, p.len());
        // Replayed: the layer dispatched the committed experts, so the last row changes.
        assert_eq!(dispatched == committed, replay);
        assert_eq!(dispatched == own, !replay);
        let plain = ck.model.hidden_states(&p).unwrap();
        assert_eq!(hidden.last() != plain.last(), replay);
    }
    // With a zero margin the same swap is a mismatch, never replayed.
    let mut check = RoutingCheck::new(trace, Margin { abs: 0.0, rel: 0.0 }, true);
    ck.model
        .hidden_states_probed(
            &p,
            &mut Probe {
                check: Some(&mut check),
                ..Probe::default()
            },
        )
        .unwrap();
    let t = check.totals();
    assert_eq!((t.near_tie, t.mismatch, t.replayed), (0, 1, 0));
    let d = check.first_divergence().unwrap();
    assert_eq!((d.position, d.layer), (p.len() - 1, layer));
}

#[test]
fn without_a_trace_the_report_says_routing_could_not_be_replayed() {
    let ck = Checkpoint::open(checkpoint_dir(), Precision::Bf16).unwrap();
    let p = prompt(&ck, 1);
    let params = AuditParams {
        toploc_k: 128.min(ck.model.config().hidden_size),
        ..AuditParams::default()
    };
    let proof = params.proof_params(Params::ENGY.decode_batching_size);
    let c = commit_greedy(&ck.model, &ck.model_root, &p, 8, &[], &proof).unwrap();
    let r = audit_with(&ck.model, &ck.model_root, &c, &params, Recompute::F32).unwrap();
    assert_eq!(r.verdict, Verdict::Pass);
    match r.routing {
        Some(RoutingAudit::NotReplayed { reason }) => {
            assert!(reason.contains("no routing trace"), "{reason}")
        }
        other => panic!("{other:?}"),
    }
    // A trace of another shape is not replayed either, and says why.
    let shape = ck.model.routing_shape().unwrap();
    let wrong = CommittedRouting {
        start: 0,
        shape: engy_model::RoutingShape {
            top_k: shape.top_k + 1,
            ..shape
        },
        ids: vec![0; shape.layers * (shape.top_k + 1) * 4],
    };
    let policy = RoutingPolicy::default();
    let r = audit_with_routing(
        &ck.model,
        &ck.model_root,
        &c,
        &AuditParams {
            routing: policy,
            ..params
        },
        Recompute::F32,
        Some(wrong),
    )
    .unwrap();
    assert_eq!(r.verdict, Verdict::Pass);
    match r.routing {
        Some(RoutingAudit::NotReplayed { reason }) => {
            assert!(reason.contains("the model routes"), "{reason}")
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn the_commitments_own_trace_is_read_and_checked() {
    let ck = Checkpoint::open(checkpoint_dir(), Precision::Bf16).unwrap();
    let shape = ck.model.routing_shape().unwrap();
    let p = prompt(&ck, 3);
    let params = AuditParams {
        toploc_k: 128.min(ck.model.config().hidden_size),
        ..AuditParams::default()
    };
    let proof = params.proof_params(Params::ENGY.decode_batching_size);
    let mut c = commit_greedy(&ck.model, &ck.model_root, &p, 24, &[], &proof).unwrap();
    let out: Vec<u32> = serde_json::from_value(c["output_token_ids"].clone()).unwrap();
    let (_, ids) = decode(&ck.model, &p, out.len());
    let ids: Vec<i32> = ids.iter().map(|&e| e as i32).collect();
    let trace =
        engy_core::trace::Trace::encode(0, shape.layers as u64, shape.top_k as u64, &ids, false)
            .unwrap();
    c["routing"] = serde_json::to_value(&trace).unwrap();
    let r = audit_with(&ck.model, &ck.model_root, &c, &params, Recompute::F32).unwrap();
    assert_eq!(r.verdict, Verdict::Pass, "{r:?}");
    let s = summary(&r.routing);
    assert_eq!(s.totals.agree, s.totals.compared);
    assert!(s.totals.compared > 0);
    // A trace whose digest does not match its ids is not replayed, and says why.
    c["routing"]["sha256"] = serde_json::json!("00".repeat(32));
    let r = audit_with(&ck.model, &ck.model_root, &c, &params, Recompute::F32).unwrap();
    match r.routing {
        Some(RoutingAudit::NotReplayed { reason }) => {
            assert!(reason.contains("sha256"), "{reason}")
        }
        other => panic!("{other:?}"),
    }
}
