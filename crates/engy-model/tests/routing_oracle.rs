//! The routing check against transformers' own serves (`$ENGY_ROUTING_ORACLE_DIR`, default the
//! shipped `tests/vectors/routing-oracle`; schema in its README).
//!
//! * Every `honest_bf16` trace, with its audit-oracle commitment (same prompt, same output ids),
//!   passes the full audit ([`Recompute::Auto`], default routing policy) with at most the
//!   policy's mismatch rate, and its routing is checked, not skipped.
//! * A cheat's trace (`int4_g32`, `fp8_tensor`: the serve's own continuation, so there is no
//!   TOPLOC commitment for it) is caught by routing alone when its mismatch rate is above the
//!   policy's threshold under every recompute the auditor would try (bf16 and f32). `int4_g32`
//!   is caught everywhere; `fp8_tensor` in at least [`FP8_MIN_DETECTION`] of the traces.
//!
//! The table it prints is the one in docs/AUDITOR.md "Routing".
mod common;

use std::path::{Path, PathBuf};

use engy_model::arch::{CommittedRouting, Margin, RoutingCheck};
use engy_model::audit::{
    audit_with_routing, default_routing_margin, AuditParams, Recompute, RoutingAudit, Verdict,
    ROUTING_MARGIN_REL,
};
use engy_model::{Compute, LoadOptions, Model, Probe};

fn oracle_dir() -> PathBuf {
    common::vectors_or("ENGY_ROUTING_ORACLE_DIR", "routing-oracle")
}

fn audit_oracle_dir() -> PathBuf {
    common::vectors_or("ENGY_AUDIT_ORACLE_DIR", "audit-oracle")
}

/// The smallest fraction of `fp8_tensor` traces routing alone must catch.
const FP8_MIN_DETECTION: f64 = 0.5;

struct Trace {
    prompt: Vec<u32>,
    output: Vec<u32>,
    routing: CommittedRouting,
}

fn read_trace(path: &Path, model: &Model) -> Trace {
    let v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap())
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let ids = |k: &str| -> Vec<u32> { serde_json::from_value(v[k].clone()).unwrap() };
    let rows: Vec<Vec<Vec<u32>>> = serde_json::from_value(v["routing"].clone()).unwrap();
    let shape = model.routing_shape().expect("an MoE checkpoint");
    Trace {
        prompt: ids("prompt_ids"),
        output: ids("output_token_ids"),
        routing: CommittedRouting {
            start: 0,
            shape,
            ids: rows.into_iter().flatten().flatten().collect(),
        },
    }
}

/// The mismatch rate of `t` under a recompute in `compute` with the default policy.
fn mismatch_rate(model: &Model, t: &Trace, compute: Compute) -> f64 {
    let m = model.with_compute(compute).unwrap();
    let margin = Margin {
        abs: default_routing_margin(m.config().kind),
        rel: ROUTING_MARGIN_REL,
    };
    let mut check = RoutingCheck::new(t.routing.clone(), margin, true);
    let mut ids = t.prompt.clone();
    ids.extend(&t.output[..t.output.len() - 1]);
    m.hidden_states_probed(
        &ids,
        &mut Probe {
            check: Some(&mut check),
            ..Probe::default()
        },
    )
    .unwrap();
    let totals = check.totals();
    assert!(totals.compared > 0);
    totals.mismatch as f64 / totals.compared as f64
}

#[test]
fn honest_traces_pass_and_cheat_traces_are_caught_by_routing() {
    let oracle = oracle_dir();
    let cases = common::sorted_paths(&oracle, Path::is_dir);
    assert!(!cases.is_empty(), "no case in {}", oracle.display());
    let params = AuditParams::default();
    let limit = params.routing.max_mismatch_rate;
    let (mut fp8_n, mut fp8_caught) = (0usize, 0usize);
    let mut failures = Vec::new();
    println!("case | variant | caught | mismatch rate (bf16 recompute) min–max");
    for case in &cases {
        let name = case.file_name().unwrap().to_string_lossy().to_string();
        let dir = common::vectors_dir().join(&name);
        let model = Model::open(&dir, &LoadOptions::default()).unwrap();
        let root = engy_core::identity::model_root(&dir).unwrap();
        let files = common::sorted_paths(case, |p| p.to_string_lossy().ends_with(".routing.json"));
        for variant in ["honest_bf16", "int4_g32", "fp8_tensor"] {
            let (mut n, mut caught, mut lo, mut hi) = (0, 0, f64::MAX, 0f64);
            for f in files.iter().filter(|f| {
                f.file_name()
                    .is_some_and(|n| n.to_string_lossy().starts_with(variant))
            }) {
                let t = read_trace(f, &model);
                n += 1;
                if variant == "honest_bf16" {
                    let stem = f
                        .file_name()
                        .unwrap()
                        .to_string_lossy()
                        .replace(".routing", "");
                    let cpath = audit_oracle_dir().join(&name).join(&stem);
                    let c: serde_json::Value =
                        serde_json::from_str(&std::fs::read_to_string(&cpath).unwrap()).unwrap();
                    let r = audit_with_routing(
                        &model,
                        &root,
                        &c,
                        &params,
                        Recompute::Auto,
                        Some(t.routing.clone()),
                    )
                    .unwrap();
                    let rate = match &r.routing {
                        Some(RoutingAudit::Checked(s)) => s.mismatch_rate,
                        other => panic!("{}: routing not checked: {other:?}", f.display()),
                    };
                    lo = lo.min(rate);
                    hi = hi.max(rate);
                    if r.verdict != Verdict::Pass {
                        failures.push(format!("{}: honest judged {:?}", f.display(), r.verdict));
                        caught += 1;
                    }
                    continue;
                }
                let bf16 = mismatch_rate(&model, &t, Compute::Bf16);
                lo = lo.min(bf16);
                hi = hi.max(bf16);
                if bf16 > limit && mismatch_rate(&model, &t, Compute::F32) > limit {
                    caught += 1;
                } else if variant == "int4_g32" {
                    failures.push(format!("{}: int4 routing passed ({bf16:.4})", f.display()));
                }
            }
            println!("{name} | {variant} | {caught}/{n} | {lo:.4}–{hi:.4}");
            if variant == "fp8_tensor" {
                fp8_n += n;
                fp8_caught += caught;
            }
        }
    }
    assert!(failures.is_empty(), "{failures:#?}");
    assert!(
        fp8_caught as f64 >= FP8_MIN_DETECTION * fp8_n as f64,
        "fp8_tensor caught by routing in {fp8_caught}/{fp8_n}"
    );
}
