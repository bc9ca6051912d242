//! The sglang double follows sglang-native-api.md: ragged hidden states, cumulative SSE
//! text, hidden states on every streamed event, radix-cache accounting, abort semantics.
use std::sync::Arc;
use std::time::Duration;

use engy_devnet::sglang::synthetic::{
    write_checkpoint, CheckpointSpec, SyntheticBackend, SyntheticConfig,
};
use engy_devnet::sglang::{Fault, SglangConfig, SglangDouble};
use serde_json::{json, Value};

async fn double(dir: &std::path::Path, cfg: SglangConfig) -> SglangDouble {
    write_checkpoint(
        dir,
        &CheckpointSpec {
            hidden_size: 16,
            vocab_size: 400,
            ..Default::default()
        },
    )
    .unwrap();
    let b = SyntheticBackend::from_checkpoint(dir, SyntheticConfig::default()).unwrap();
    SglangDouble::start(Arc::new(b), cfg).await.unwrap()
}

fn body(ids: &[u32], n: usize, rid: &str, stream: bool) -> Value {
    json!({"input_ids": ids, "sampling_params": {"temperature": 0.0, "max_new_tokens": n},
           "rid": rid, "return_hidden_states": true, "return_logprob": true, "stream": stream})
}

fn rows_of(meta: &Value) -> Vec<Vec<f64>> {
    let mut out = Vec::new();
    for e in meta["hidden_states"].as_array().unwrap() {
        let a = e.as_array().unwrap();
        if a.first().map(Value::is_array).unwrap_or(false) {
            out.push(
                a.last()
                    .unwrap()
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|x| x.as_f64().unwrap())
                    .collect(),
            );
        } else if !a.is_empty() {
            out.push(a.iter().map(|x| x.as_f64().unwrap()).collect());
        }
    }
    out
}

async fn post(c: &reqwest::Client, url: &str, b: &Value) -> Value {
    c.post(format!("{url}/generate"))
        .json(b)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap()
}

#[tokio::test]
async fn non_stream_shape_radix_cache_and_chunk_equivalence() {
    let dir = tempfile::tempdir().unwrap();
    let d = double(dir.path(), SglangConfig::default()).await;
    let c = reqwest::Client::new();
    let prompt = [5u32, 6, 7, 8, 9];
    let r = post(&c, &d.url(), &body(&prompt, 6, "a", false)).await;
    let meta = &r["meta_info"];
    assert_eq!(meta["id"], "a");
    assert_eq!(meta["finish_reason"], json!({"type":"length","length":6}));
    assert_eq!(meta["prompt_tokens"], 5);
    assert_eq!(meta["cached_tokens"], 0);
    let hs = meta["hidden_states"].as_array().unwrap();
    assert_eq!(hs.len(), 6);
    assert_eq!(
        hs[0].as_array().unwrap().len(),
        5,
        "prefill block = every prompt row"
    );
    assert_eq!(hs[1].as_array().unwrap().len(), 16, "decode element is 1-D");
    let out: Vec<u32> = r["output_ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect();
    let lp: Vec<u32> = meta["output_token_logprobs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e[1].as_u64().unwrap() as u32)
        .collect();
    assert_eq!(out, lp);
    // Continuation with the one-token overlap: input = prompt + out[..5], want 1 + 1.
    let mut cont = prompt.to_vec();
    cont.extend_from_slice(&out[..5]);
    let r2 = post(&c, &d.url(), &body(&cont, 2, "b", false)).await;
    let m2 = &r2["meta_info"];
    assert_eq!(m2["cached_tokens"], 9, "radix hit on prompt + out[..4]");
    assert_eq!(
        m2["hidden_states"][0].as_array().unwrap().len(),
        1,
        "uncached suffix only"
    );
    assert_eq!(
        r2["output_ids"][0], out[5],
        "greedy overlap token regenerated"
    );
    // The overlap row equals the long call's last row.
    assert_eq!(rows_of(m2)[0], rows_of(meta)[5]);
}

#[tokio::test]
async fn stream_is_cumulative_with_hidden_states_on_every_event() {
    let dir = tempfile::tempdir().unwrap();
    let d = double(dir.path(), SglangConfig::default()).await;
    let c = reqwest::Client::new();
    let text = c
        .post(format!("{}/generate", d.url()))
        .json(&body(&[3, 4, 5], 4, "s", true))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let events: Vec<&str> = text.split("\n\n").filter(|l| !l.is_empty()).collect();
    assert_eq!(events.last().unwrap(), &"data: [DONE]");
    let evs: Vec<Value> = events[..events.len() - 1]
        .iter()
        .map(|l| serde_json::from_str(l.strip_prefix("data: ").unwrap()).unwrap())
        .collect();
    assert_eq!(evs.len(), 4);
    let mut prev = String::new();
    for (k, ev) in evs.iter().enumerate() {
        let t = ev["text"].as_str().unwrap().to_string();
        assert!(t.starts_with(&prev), "cumulative text");
        prev = t;
        assert_eq!(
            ev["meta_info"]["hidden_states"].as_array().unwrap().len(),
            k + 1
        );
        assert_eq!(ev["meta_info"]["finish_reason"].is_null(), k < 3);
        assert_eq!(ev["meta_info"].get("e2e_latency").is_some(), k == 3);
        assert_eq!(
            ev["meta_info"].get("response_sent_to_client_ts").is_some(),
            k == 0
        );
    }
}

#[tokio::test]
async fn abort_finishes_running_and_queued_requests() {
    let dir = tempfile::tempdir().unwrap();
    let d = double(dir.path(), SglangConfig::default()).await;
    let c = reqwest::Client::new();
    d.push_fault(Fault::Slow(Duration::from_millis(20)));
    let url = d.url();
    let h = tokio::spawn({
        let c = c.clone();
        async move { post(&c, &url, &body(&[1, 2], 100_000, "run", false)).await }
    });
    d.wait_until(Duration::from_secs(10), |_, _, live| {
        (live == 1).then_some(())
    })
    .await
    .unwrap();
    let r = c
        .post(format!("{}/abort_request", d.url()))
        .json(&json!({"rid":"run"}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert!(r.bytes().await.unwrap().is_empty());
    let v = h.await.unwrap();
    assert_eq!(v["meta_info"]["finish_reason"]["type"], "abort");
    assert_eq!(v["meta_info"]["finish_reason"]["message"], "Aborted");
    // Queued request: the reduced reply without hidden_states.
    d.push_fault(Fault::Hang);
    let url = d.url();
    let h = tokio::spawn({
        let c = c.clone();
        async move { post(&c, &url, &body(&[1, 2], 4, "q", false)).await }
    });
    d.wait_until(Duration::from_secs(10), |_, _, live| {
        (live == 1).then_some(())
    })
    .await
    .unwrap();
    c.post(format!("{}/abort_request", d.url()))
        .json(&json!({"rid":"q"}))
        .send()
        .await
        .unwrap();
    let v = h.await.unwrap();
    assert_eq!(
        v["meta_info"]["finish_reason"],
        json!({"type":"abort","message":"Abort in waiting queue"})
    );
    assert!(v["meta_info"].get("hidden_states").is_none());
}

#[tokio::test]
async fn refusals_follow_sglang() {
    let dir = tempfile::tempdir().unwrap();
    let d = double(
        dir.path(),
        SglangConfig {
            enable_hidden_states: false,
            ..Default::default()
        },
    )
    .await;
    let c = reqwest::Client::new();
    let r = c
        .post(format!("{}/generate", d.url()))
        .json(&body(&[1], 2, "x", false))
        .send()
        .await;
    let r = r.unwrap();
    assert_eq!(r.status(), 400);
    let v: Value = r.json().await.unwrap();
    assert!(v["error"]["message"]
        .as_str()
        .unwrap()
        .contains("--enable-return-hidden-states"));
    let r = c
        .post(format!("{}/generate", d.url()))
        .json(&body(&[], 2, "y", false))
        .send()
        .await;
    assert_eq!(r.unwrap().status(), 400);
    let info: Value = c
        .get(format!("{}/get_model_info", d.url()))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(info["is_generation"], true);
}

#[tokio::test]
async fn eos_finishes_with_stop_and_duplicate_rids_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    write_checkpoint(
        dir.path(),
        &CheckpointSpec {
            hidden_size: 16,
            vocab_size: 400,
            ..Default::default()
        },
    )
    .unwrap();
    let cfg = SyntheticConfig {
        eos_per_mille: 1000,
        ..Default::default()
    };
    let b = SyntheticBackend::from_checkpoint(dir.path(), cfg).unwrap();
    let eos = engy_devnet::sglang::Backend::facts(&b).eos_token_ids[0];
    let d = SglangDouble::start(Arc::new(b), SglangConfig::default())
        .await
        .unwrap();
    let c = reqwest::Client::new();
    let r = post(&c, &d.url(), &body(&[1, 2, 3], 8, "e", false)).await;
    assert_eq!(
        r["meta_info"]["finish_reason"],
        json!({"type":"stop","matched":eos})
    );
    assert_eq!(
        r["output_ids"],
        json!([eos]),
        "the stop token is in output_ids"
    );
    assert_eq!(r["text"], "", "special tokens are skipped in text");
    assert_eq!(r["meta_info"]["hidden_states"].as_array().unwrap().len(), 1);

    // A rid already in flight is refused (400 non-stream, an error event in a stream).
    d.push_fault(Fault::Hang);
    let url = d.url();
    let h = tokio::spawn({
        let c = c.clone();
        async move { post(&c, &url, &body(&[1], 4, "dup", false)).await }
    });
    d.wait_until(Duration::from_secs(10), |_, _, live| {
        (live == 1).then_some(())
    })
    .await
    .unwrap();
    let r = c
        .post(format!("{}/generate", d.url()))
        .json(&body(&[1], 4, "dup", false))
        .send()
        .await;
    let r = r.unwrap();
    assert_eq!(r.status(), 400);
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["error"]["message"], "Duplicate request ID detected: dup");
    let r = c
        .post(format!("{}/generate", d.url()))
        .json(&body(&[1], 4, "dup", true))
        .send()
        .await;
    let text = r.unwrap().text().await.unwrap();
    assert!(text
        .starts_with("data: {\"error\":{\"message\":\"Duplicate request ID detected: dup\"}}\n\n"));
    assert!(text.ends_with("data: [DONE]\n\n"));
    c.post(format!("{}/abort_request", d.url()))
        .json(&json!({"rid":"dup"}))
        .send()
        .await
        .unwrap();
    h.await.unwrap();
}

#[tokio::test]
async fn recording_off_keeps_nothing_and_serves_the_same() {
    let (on_dir, off_dir) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let on = double(on_dir.path(), SglangConfig::default()).await;
    let off = double(
        off_dir.path(),
        SglangConfig {
            record: false,
            ..Default::default()
        },
    )
    .await;
    let c = reqwest::Client::new();
    // The same requests twice (the second hits the radix cache): identical answers.
    for i in 0..2 {
        let b = body(&[5, 6, 7], 4, &format!("r{i}"), false);
        let (a, z) = (
            post(&c, &on.url(), &b).await,
            post(&c, &off.url(), &b).await,
        );
        for key in ["hidden_states", "finish_reason", "cached_tokens"] {
            assert_eq!(
                a["meta_info"][key], z["meta_info"][key],
                "request {i}: {key}"
            );
        }
        assert_eq!(a["output_ids"], z["output_ids"], "request {i}");
    }
    for d in [&on, &off] {
        let r = c
            .post(format!("{}/generate", d.url()))
            .json(&body(&[5, 6, 7], 4, "s", true))
            .send()
            .await
            .unwrap();
        assert!(r.status().is_success());
        assert!(r.text().await.unwrap().contains("[DONE]"));
    }
    for d in [&on, &off] {
        let r = c
            .post(format!("{}/abort_request", d.url()))
            .json(&json!({"rid": "gone"}))
            .send()
            .await
            .unwrap();
        assert!(r.status().is_success());
    }
    assert_eq!(on.generate_log().len(), 3);
    assert_eq!(on.aborts().len(), 1);
    assert!(off.generate_log().is_empty());
    assert!(off.aborts().is_empty());
}

/// A double over a synthetic MoE checkpoint (4 layers, the first dense, 16 experts, top-2).
async fn moe_double(dir: &std::path::Path, cfg: SglangConfig) -> SglangDouble {
    write_checkpoint(
        dir,
        &CheckpointSpec {
            hidden_size: 16,
            vocab_size: 400,
            routing: Some(engy_devnet::sglang::RoutingShape {
                num_hidden_layers: 4,
                num_experts_per_tok: 2,
                num_experts: 16,
                first_k_dense: 1,
            }),
            indexer: None,
        },
    )
    .unwrap();
    let b = SyntheticBackend::from_checkpoint(dir, SyntheticConfig::default()).unwrap();
    SglangDouble::start(Arc::new(b), cfg).await.unwrap()
}

fn routed(meta: &Value) -> Option<Vec<i32>> {
    let b64 = meta.get("routed_experts")?.as_str().unwrap();
    Some(engy_core::trace::sglang_int32(b64, 4, 2).unwrap())
}

/// sglang's `routed_experts` (state_capturer/base.py `get_topk`, batch_result_processor.py
/// `_maybe_collect_routed_experts`): rows `[start_len, prompt + output − 1)`, on the final
/// reply only, after `hidden_states`; the same rows whatever the radix cache held; dense
/// layers 0; the flag in server info; without the server flag no key and no error.
#[tokio::test]
async fn routed_experts_as_sglang_returns_them() {
    let dir = tempfile::tempdir().unwrap();
    let d = moe_double(
        dir.path(),
        SglangConfig::default().with_routed_experts(true),
    )
    .await;
    let c = reqwest::Client::new();
    let info: Value = c
        .get(format!("{}/server_info", d.url()))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(info["enable_return_routed_experts"], true);
    assert_eq!(info["enable_return_indexer_topk"], false);
    let prompt = [5u32, 6, 7, 8, 9];
    let mut b = body(&prompt, 6, "a", false);
    b["return_routed_experts"] = json!(true);
    let raw = c
        .post(format!("{}/generate", d.url()))
        .json(&b)
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let r: Value = serde_json::from_str(&raw).unwrap();
    let full = routed(&r["meta_info"]).expect("routed_experts");
    // 5 prompt + 6 output − 1 rows of 4 × 2.
    assert_eq!(full.len(), 10 * 8);
    for row in full.chunks(8) {
        assert_eq!(&row[..2], &[0, 0], "dense layer 0");
        assert!(row[2..].iter().all(|e| (0..16).contains(e)));
        assert_ne!(row[2], row[3]);
    }
    // sglang's key order: after hidden_states, before dp_rank.
    let at = |k: &str| raw.find(&format!("\"{k}\":")).unwrap();
    assert!(at("hidden_states") < at("routed_experts") && at("routed_experts") < at("dp_rank"));
    // The same sequence again from a start: a radix-cache hit, the rows from there on.
    let out: Vec<u32> = r["output_ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect();
    let mut seq = prompt.to_vec();
    seq.extend(&out[..5]);
    let mut b = body(&seq, 1, "b", false);
    b["return_routed_experts"] = json!(true);
    b["routed_experts_start_len"] = json!(7);
    let r = post(&c, &d.url(), &b).await;
    assert!(r["meta_info"]["cached_tokens"].as_u64().unwrap() > 0);
    assert_eq!(routed(&r["meta_info"]).unwrap(), full[7 * 8..]);
    // A start past the sequence is clamped to seqlen − 1 (no rows); a negative one refused.
    b["routed_experts_start_len"] = json!(99);
    b["rid"] = json!("c");
    assert_eq!(
        routed(&post(&c, &d.url(), &b).await["meta_info"]).unwrap(),
        Vec::<i32>::new()
    );
    b["routed_experts_start_len"] = json!(-1);
    b["rid"] = json!("d");
    let r = c
        .post(format!("{}/generate", d.url()))
        .json(&b)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 400);
    // Streaming: intermediate events have no routed_experts, the final one has them all.
    let mut b = body(&prompt, 4, "s", true);
    b["return_routed_experts"] = json!(true);
    let text = c
        .post(format!("{}/generate", d.url()))
        .json(&b)
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let events: Vec<Value> = text
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter(|l| *l != "[DONE]")
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let (last, rest) = events.split_last().unwrap();
    assert!(rest
        .iter()
        .all(|e| e["meta_info"].get("routed_experts").is_none()));
    assert_eq!(routed(&last["meta_info"]).unwrap(), full[..8 * 8]);

    // Without --enable-return-routed-experts: the request succeeds, without the key.
    let dir2 = tempfile::tempdir().unwrap();
    let d2 = moe_double(dir2.path(), SglangConfig::default()).await;
    let mut b = body(&prompt, 3, "e", false);
    b["return_routed_experts"] = json!(true);
    let r = c
        .post(format!("{}/generate", d2.url()))
        .json(&b)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let r: Value = r.json().await.unwrap();
    assert!(r["meta_info"].get("routed_experts").is_none(), "{r}");
    assert_eq!(r["output_ids"].as_array().unwrap().len(), 3);
}

/// A killed double keeps its port for the restart (issue 43: a port let go can be handed
/// to another process, and the restart then fails): while killed, connections are refused
/// and another socket cannot bind the address; the restart serves there again, also after
/// a kill that tore live connections.
#[tokio::test]
async fn a_killed_double_keeps_its_port_for_the_restart() {
    let dir = tempfile::tempdir().unwrap();
    let mut d = double(dir.path(), SglangConfig::default()).await;
    let addr = d.addr();
    d.kill().await;
    let refused = tokio::net::TcpStream::connect(addr).await.unwrap_err();
    assert_eq!(
        refused.kind(),
        std::io::ErrorKind::ConnectionRefused,
        "{refused}"
    );
    let other = tokio::net::TcpSocket::new_v4().unwrap();
    other.set_reuseaddr(false).unwrap();
    let taken = other.bind(addr).map(|()| other.local_addr().unwrap());
    assert_eq!(
        taken.as_ref().map_err(std::io::Error::kind).err(),
        Some(std::io::ErrorKind::AddrInUse),
        "another socket bound the killed double's address: {taken:?}"
    );
    d.restart().await.unwrap();
    assert_eq!(d.addr(), addr);
    let first = post(
        &reqwest::Client::new(),
        &d.url(),
        &body(&[1, 2, 3], 2, "a", false),
    )
    .await;
    assert!(first["text"].is_string(), "{first}");
    d.kill().await;
    d.restart().await.unwrap();
    let again = post(
        &reqwest::Client::new(),
        &d.url(),
        &body(&[1, 2, 3], 2, "b", false),
    )
    .await;
    assert_eq!(again["text"], first["text"]);
}
