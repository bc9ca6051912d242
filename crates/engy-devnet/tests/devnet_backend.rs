//! The real devnet model behind the sglang double: served rows are the model's final hidden
//! states, a continuation call (PROTOCOL.md §3.4 overlap) returns the same rows as one long
//! call, and proofs built from served rows pass the auditor (honest) or fail it (int4).
use std::sync::Arc;

use engy_core::toploc::{self, Dtype, Params};
use engy_devnet::devnet_backend::CandleBackend;
use engy_devnet::sglang::{Backend, SglangConfig, SglangDouble};
use engy_model::audit::{audit, AuditParams, Verdict};
use engy_model::{gen_model, Checkpoint, GenConfig, Precision};
use serde_json::{json, Value};

fn body(ids: &[u32], n: usize, rid: &str) -> Value {
    json!({"input_ids": ids, "sampling_params": {"temperature": 0.0, "max_new_tokens": n},
           "rid": rid, "return_hidden_states": true, "return_logprob": true, "stream": false})
}

/// (output ids, one row per output token: last row of element 0, then each decode row).
fn rows_and_ids(r: &Value) -> (Vec<u32>, Vec<Vec<f32>>) {
    let meta = &r["meta_info"];
    let ids = meta["output_token_logprobs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e[1].as_u64().unwrap() as u32)
        .collect();
    let mut rows = Vec::new();
    for e in meta["hidden_states"].as_array().unwrap() {
        let a = e.as_array().unwrap();
        let row = if a.first().map(Value::is_array).unwrap_or(false) {
            a.last().unwrap().as_array().unwrap().clone()
        } else {
            a.clone()
        };
        rows.push(row.iter().map(|x| x.as_f64().unwrap() as f32).collect());
    }
    (ids, rows)
}

async fn generate(c: &reqwest::Client, url: &str, b: &Value) -> Value {
    let resp = c
        .post(format!("{url}/generate"))
        .json(b)
        .send()
        .await
        .unwrap();
    assert!(resp.status().is_success());
    resp.json().await.unwrap()
}

fn commitment(root: &str, prompt: &[u32], out: &[u32], rows: &[Vec<f32>]) -> Value {
    let bits: Vec<Vec<u16>> = rows
        .iter()
        .map(|r| toploc::f32_to_bf16_bits_slice(r))
        .collect();
    let el: Vec<&[u16]> = bits.iter().map(Vec::as_slice).collect();
    let proofs = toploc::build_proofs_base64(&el, Dtype::Bf16, &Params::ENGY).unwrap();
    json!({"model_root": root, "output_token_ids": out, "toploc": {"proofs": proofs,
        "topk": 128, "decode_batching_size": 32, "skip_prefill": true,
        "n_tokens": rows.len(), "prompt_ids": prompt}})
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn served_rows_are_the_model_rows_and_audit_as_expected() {
    let t = tempfile::tempdir().unwrap();
    let dir = t.path().join("m");
    gen_model(&dir, 5, &GenConfig::default()).unwrap();
    let auditor = Checkpoint::open(&dir, Precision::Bf16).unwrap();
    let prompt: Vec<u32> = auditor
        .tokenizer
        .encode(
            "<|im_start|>user\nHow is a proof checked?<|im_end|>\n<|im_start|>assistant\n",
            false,
        )
        .unwrap()
        .get_ids()
        .to_vec();
    let c = reqwest::Client::new();

    for (precision, want) in [
        (Precision::Bf16, Verdict::Pass),
        (Precision::Int4 { group_size: 32 }, Verdict::Cheat),
    ] {
        let backend = CandleBackend::open(&dir, precision).unwrap();
        assert_eq!(backend.model_root(), auditor.model_root);
        let d = SglangDouble::start(Arc::new(backend), SglangConfig::default())
            .await
            .unwrap();
        let info: Value = c
            .get(format!("{}/get_model_info", d.url()))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        assert_eq!(info["model_path"], dir.display().to_string());

        // One long call.
        let n = 70;
        let long = generate(
            &c,
            &d.url(),
            &body(&prompt, n, &format!("long-{precision}")),
        )
        .await;
        let (out, rows) = rows_and_ids(&long);
        assert_eq!(rows.len(), out.len());
        assert!(rows.iter().all(|r| r.len() == 256));
        // Every served value is bf16-exact.
        assert!(rows
            .iter()
            .flatten()
            .all(|x| half::bf16::from_f32(*x).to_f32() == *x));
        let text = long["text"].as_str().unwrap();
        assert!(!text.is_empty());

        if precision == Precision::Bf16 {
            // Served rows equal the auditor's teacher-forced rows, bit for bit in bf16.
            let mut full = prompt.clone();
            full.extend(&out[..out.len() - 1]);
            let tf = auditor.model.hidden_states(&full).unwrap();
            for (j, r) in rows.iter().enumerate() {
                assert_eq!(r, &engy_model::round_to_bf16(&tf[prompt.len() - 1 + j]));
            }
            // A continuation call (prompt + first 40 outputs minus the last, asking 1 + rest)
            // returns the same rows as the long call for the overlap onwards.
            if out.len() == n {
                let k = 40;
                let mut input = prompt.clone();
                input.extend(&out[..k - 1]);
                let cont = generate(&c, &d.url(), &body(&input, n - k + 1, "cont")).await;
                let (cout, crow) = rows_and_ids(&cont);
                assert_eq!(cout, out[k - 1..].to_vec());
                assert_eq!(crow, rows[k - 1..].to_vec());
            }
        }
        let com = commitment(&auditor.model_root, &prompt, &out, &rows);
        let r = audit(
            &auditor.model,
            &auditor.model_root,
            &com,
            &AuditParams::default(),
        )
        .unwrap();
        eprintln!("{precision}: score {:?} verdict {:?}", r.score, r.verdict);
        assert_eq!(r.verdict, want);
    }
}

/// The candle model's routing through the double (docs/PROTOCOL.md §3.10): `routed_experts`
/// of one long call covers `[0, prompt + output − 1)` and equals what the model routes over
/// that sequence in one pass; a continuation asked from its input length returns the tail.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn served_routing_is_the_models_routing() {
    let t = tempfile::tempdir().unwrap();
    let dir = t.path().join("m");
    gen_model(&dir, 5, &GenConfig::default()).unwrap();
    let auditor = Checkpoint::open(&dir, Precision::Bf16).unwrap();
    let shape = auditor
        .model
        .routing_shape()
        .expect("the devnet model is MoE");
    let per = shape.per_position();
    let backend = CandleBackend::open(&dir, Precision::Bf16).unwrap();
    assert!(backend.facts().routing.is_some());
    let d = SglangDouble::start(
        Arc::new(backend),
        SglangConfig::default().with_routed_experts(true),
    )
    .await
    .unwrap();
    let c = reqwest::Client::new();
    let prompt: Vec<u32> = (10..30).collect();
    let mut b = body(&prompt, 12, "long");
    b["return_routed_experts"] = json!(true);
    let long = generate(&c, &d.url(), &b).await;
    let (out, _) = rows_and_ids(&long);
    let routed = |r: &Value| {
        engy_core::trace::sglang_int32(
            r["meta_info"]["routed_experts"]
                .as_str()
                .expect("routed_experts"),
            shape.layers as u64,
            shape.top_k as u64,
        )
        .unwrap()
    };
    let all = routed(&long);
    assert_eq!(all.len(), (prompt.len() + out.len() - 1) * per);
    assert!(all.iter().all(|e| (0..shape.experts as i32).contains(e)));
    let mut seq = prompt.clone();
    seq.extend(&out[..out.len() - 1]);
    let one_pass = auditor.model.decoder(&seq).unwrap().step().unwrap();
    let want: Vec<i32> = one_pass.routed_experts.iter().map(|&e| e as i32).collect();
    assert_eq!(all, want);
    // A continuation over prompt + 5 outputs, asked from its input length.
    let mut input = prompt.clone();
    input.extend(&out[..5]);
    let mut b = body(&input, 7, "cont");
    b["return_routed_experts"] = json!(true);
    b["routed_experts_start_len"] = json!(input.len());
    let cont = generate(&c, &d.url(), &b).await;
    assert_eq!(routed(&cont), all[input.len() * per..].to_vec());
}
