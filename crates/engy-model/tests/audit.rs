//! The auditor end to end on a generated checkpoint: honest proofs pass, int4 proofs are caught
//! with a clearly separated score, malformed commitments are `unproven`.
mod common;

use std::path::Path;

use engy_core::toploc::Params;
use engy_model::audit::{audit, commit_greedy, AuditParams, Verdict};
use engy_model::{corpus, Checkpoint, Compute, Precision};

/// One generated checkpoint shared by the tests of this binary.
fn checkpoint_dir() -> &'static Path {
    common::generated_checkpoint(7)
}

fn prompt(ck: &Checkpoint, user: &str) -> Vec<u32> {
    let text = format!("<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n");
    ck.tokenizer
        .encode(text.as_str(), false)
        .unwrap()
        .get_ids()
        .to_vec()
}

fn quantiles(mut v: Vec<f64>) -> String {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    let q = |f: f64| v[((v.len() - 1) as f64 * f).round() as usize];
    format!(
        "min {:.3} p50 {:.3} p99 {:.3} max {:.3}",
        q(0.0),
        q(0.5),
        q(0.99),
        q(1.0)
    )
}

#[test]
fn honest_passes_and_int4_is_caught_with_separated_scores() {
    let dir = checkpoint_dir();
    let auditor = Checkpoint::open(dir, Precision::Bf16).unwrap();
    // A bf16-activation serve: honest, but its numbers differ from the f32 auditor's.
    let gpu_like = Checkpoint::open_with(dir, Precision::Bf16, Compute::Bf16).unwrap();
    let cheat =
        Checkpoint::open_with(dir, Precision::Int4 { group_size: 32 }, Compute::Bf16).unwrap();
    let stop = auditor.stop_ids();
    let params = AuditParams::default();
    let (mut honest_scores, mut gpu_scores, mut cheat_scores) = (vec![], vec![], vec![]);
    for (i, user) in corpus::sample_prompts(11, 10).iter().enumerate() {
        let ids = prompt(&auditor, user);
        let max_new = 40 + 17 * i; // 1 to 6 decode batches, last one ragged
        for (serve, scores, want) in [
            (&auditor, &mut honest_scores, Verdict::Pass),
            (&gpu_like, &mut gpu_scores, Verdict::Pass),
            (&cheat, &mut cheat_scores, Verdict::Cheat),
        ] {
            let c = commit_greedy(
                &serve.model,
                &serve.model_root,
                &ids,
                max_new,
                &stop,
                &Params::ENGY,
            )
            .unwrap();
            let r = audit(&auditor.model, &auditor.model_root, &c, &params).unwrap();
            assert_eq!(r.verdict, want, "prompt {i} ({user:?}): {r:?}");
            // Verdicts are stable: auditing again gives the same report.
            assert_eq!(
                r,
                audit(&auditor.model, &auditor.model_root, &c, &params).unwrap()
            );
            scores.push(r.score.unwrap());
        }
    }
    eprintln!(
        "honest f32 serve scores:  {}",
        quantiles(honest_scores.clone())
    );
    eprintln!(
        "honest bf16 serve scores: {}",
        quantiles(gpu_scores.clone())
    );
    eprintln!(
        "int4 bf16 serve scores:   {}",
        quantiles(cheat_scores.clone())
    );
    // The f32 serve computes exactly what the auditor computes.
    assert!(honest_scores.iter().all(|s| *s == 0.0));
    let honest_max = gpu_scores.iter().cloned().fold(0.0, f64::max);
    let cheat_min = cheat_scores.iter().cloned().fold(1.0, f64::min);
    assert!(
        cheat_min > honest_max + 0.2,
        "scores not separated: honest max {honest_max}, int4 min {cheat_min}"
    );
}

#[test]
fn malformed_commitments_are_unproven() {
    let dir = checkpoint_dir();
    let ck = Checkpoint::open(dir, Precision::Bf16).unwrap();
    let params = AuditParams::default();
    let ids = prompt(&ck, "What is a decode batch?");
    let good = commit_greedy(&ck.model, &ck.model_root, &ids, 40, &[], &Params::ENGY).unwrap();
    assert_eq!(
        audit(&ck.model, &ck.model_root, &good, &params)
            .unwrap()
            .verdict,
        Verdict::Pass
    );
    // A gateway response frame holding the commitment is accepted too.
    let frame = serde_json::json!({"type": "response", "commitment": good.clone()});
    assert_eq!(
        audit(&ck.model, &ck.model_root, &frame, &params)
            .unwrap()
            .verdict,
        Verdict::Pass
    );
    let vocab = ck.model.config().vocab_size;
    type Mutation = Box<dyn Fn(&mut serde_json::Value)>;
    let mutations: Vec<(&str, Mutation)> = vec![
        (
            "model_root",
            Box::new(|c| c["model_root"] = "00".repeat(32).into()),
        ),
        (
            "n_tokens",
            Box::new(|c| c["toploc"]["n_tokens"] = 39.into()),
        ),
        (
            "output length",
            Box::new(|c| {
                c["output_token_ids"].as_array_mut().unwrap().pop();
            }),
        ),
        (
            "bad base64",
            Box::new(|c| c["toploc"]["proofs"][0] = "!!not base64!!".into()),
        ),
        (
            "odd proof bytes",
            Box::new(|c| c["toploc"]["proofs"][0] = "AAA=".into()),
        ),
        (
            "null proof",
            Box::new(|c| c["toploc"]["proofs"][0] = base64_zeros(2 + 2 * 128).into()),
        ),
        (
            "proof count",
            Box::new(|c| {
                c["toploc"]["proofs"].as_array_mut().unwrap().pop();
            }),
        ),
        (
            "prompt out of vocab",
            Box::new(move |c| c["toploc"]["prompt_ids"][0] = vocab.into()),
        ),
        (
            "output out of vocab",
            Box::new(|c| c["output_token_ids"][0] = u64::MAX.into()),
        ),
        (
            "empty prompt",
            Box::new(|c| c["toploc"]["prompt_ids"] = serde_json::json!([])),
        ),
        (
            "skip_prefill",
            Box::new(|c| c["toploc"]["skip_prefill"] = false.into()),
        ),
        ("topk", Box::new(|c| c["toploc"]["topk"] = 64.into())),
        (
            "dbs zero",
            Box::new(|c| c["toploc"]["decode_batching_size"] = 0.into()),
        ),
        (
            "missing toploc",
            Box::new(|c| {
                c.as_object_mut().unwrap().remove("toploc");
            }),
        ),
        (
            "wrong type",
            Box::new(|c| c["toploc"]["n_tokens"] = "forty".into()),
        ),
        ("null", Box::new(|c| *c = serde_json::Value::Null)),
        (
            "too long",
            Box::new(|c| c["toploc"]["prompt_ids"] = serde_json::json!(vec![1; 9000])),
        ),
    ];
    for (what, mutate) in mutations {
        let mut c = good.clone();
        mutate(&mut c);
        let r = audit(&ck.model, &ck.model_root, &c, &params).unwrap();
        match &r.verdict {
            Verdict::Unproven { reason } => eprintln!("{what}: {reason}"),
            v => panic!("{what}: expected unproven, got {v:?}"),
        }
    }
}

fn base64_zeros(n: usize) -> String {
    // n zero bytes in standard base64 (n divisible by 3 gives no padding; handle the rest).
    let full = "AAAA".repeat(n / 3);
    match n % 3 {
        1 => full + "AA==",
        2 => full + "AAA=",
        _ => full,
    }
}

/// The generated Qwen3.5-MoE devnet checkpoint (`engy-devnet run --arch qwen3_5_moe`): an honest
/// greedy commitment passes the audit, the int4 serve's is caught.
#[test]
fn qwen3_5_moe_devnet_model_honest_passes_and_int4_is_caught() {
    let t = tempfile::tempdir().unwrap();
    let cfg = engy_model::GenConfig {
        arch: engy_model::GenArch::Qwen3_5Moe,
        ..engy_model::GenConfig::default()
    };
    engy_model::gen_model(t.path(), 53, &cfg).unwrap();
    let honest = engy_model::Checkpoint::open(t.path(), engy_model::Precision::Bf16).unwrap();
    assert_eq!(honest.model.config().model_type, "qwen3_5_moe_text");
    let cheat =
        engy_model::Checkpoint::open(t.path(), engy_model::Precision::Int4 { group_size: 32 })
            .unwrap();
    let prompt = prompt(&honest, "How is a proof checked?");
    let params = engy_core::toploc::Params::ENGY;
    for (ck, want) in [
        (&honest, engy_model::audit::Verdict::Pass),
        (&cheat, engy_model::audit::Verdict::Cheat),
    ] {
        let c =
            engy_model::audit::commit_greedy(&ck.model, &ck.model_root, &prompt, 40, &[], &params)
                .unwrap();
        let r = engy_model::audit::audit(
            &honest.model,
            &honest.model_root,
            &c,
            &engy_model::audit::AuditParams::default(),
        )
        .unwrap();
        assert_eq!(r.verdict, want, "{r:?}");
    }
}

/// A batch too thin for a sparse top-k (rows × hidden below `SPARSE_TOPK_FACTOR` × topk: here
/// one row of 256 values against top-128) is reported but not judged when a full batch is
/// there to judge; when every batch is that thin, they are judged.
#[test]
fn a_thin_tail_batch_is_reported_but_not_judged() {
    use engy_model::audit::{judged_batch, SPARSE_TOPK_FACTOR};
    let dir = checkpoint_dir();
    let auditor = Checkpoint::open(dir, Precision::Bf16).unwrap();
    let hidden = auditor.model.config().hidden_size;
    assert!(!judged_batch(1, hidden, 128) && judged_batch(32, hidden, 128));
    assert!(judged_batch(SPARSE_TOPK_FACTOR, 128, 128) && !judged_batch(3, 128, 128));
    let params = AuditParams::default();
    let commit = |user: &str, n: usize| {
        let ids = prompt(&auditor, user);
        let m = &auditor.model;
        commit_greedy(m, &auditor.model_root, &ids, n, &[], &Params::ENGY).unwrap()
    };
    // 33 rows: a full batch and a one-row tail, whose proof is swapped for another prompt's.
    let (mut c, other) = (commit("first prompt", 33), commit("a second prompt", 33));
    c["toploc"]["proofs"][1] = other["toploc"]["proofs"][1].clone();
    let r = audit(&auditor.model, &auditor.model_root, &c, &params).unwrap();
    assert_eq!(r.verdict, Verdict::Pass, "{r:?}");
    let (full, tail) = (&r.batches[0], &r.batches[1]);
    assert!(
        full.judged && full.pass && tail.rows == 1 && !tail.judged,
        "{r:?}"
    );
    assert!(!tail.pass, "the swapped tail proof should fail: {r:?}");
    assert_eq!(r.passing_batches, 1);
    assert_eq!(r.score, Some(full.exp_mismatches as f64 / 128.0));
    // One row only: nothing else to judge, so the thin batch is judged.
    let (mut c, other) = (commit("first prompt", 1), commit("a second prompt", 1));
    c["toploc"]["proofs"][0] = other["toploc"]["proofs"][0].clone();
    let r = audit(&auditor.model, &auditor.model_root, &c, &params).unwrap();
    assert_eq!(r.verdict, Verdict::Cheat, "{r:?}");
    assert!(r.batches[0].judged && !r.batches[0].pass, "{r:?}");
}
