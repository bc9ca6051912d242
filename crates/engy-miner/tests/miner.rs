//! The real `engy-miner` binary against the gateway and sglang doubles (docs/PROTOCOL.md §2–§5).
mod common;

use std::time::Duration;

use common::*;
use engy_devnet::sglang::{Fault, SglangConfig};
use serde_json::{json, Value};

const HIDDEN: usize = 128;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hello_fields_and_leg_plan() {
    let fx = Fixture::new(HIDDEN, 10, SglangConfig::default()).await;
    // MAX_INFLIGHT < N: 8 legs at 1 each, on distinct workers.
    let mut m = fx.miner(&[("MAX_INFLIGHT", "8"), ("ENGY_WORKER_NAME", "rig-a")]);
    let legs = fx.gw.wait_legs(8, T).await.expect("8 legs");
    assert_eq!(legs.len(), 8);
    let mut distinct: Vec<usize> = legs.iter().map(|l| l.worker).collect();
    distinct.sort_unstable();
    distinct.dedup();
    assert_eq!(distinct.len(), 8);
    let root = engy_core::identity::model_root(&fx.ckpt()).unwrap();
    for l in &legs {
        let h = l.hello.as_ref().unwrap();
        assert_eq!(h["type"], "hello");
        assert_eq!(h["miner_key"], KEY);
        assert_eq!(h["model"], "qwen3.6-35b-a3b");
        assert_eq!(h["model_root"], root.as_str());
        assert_eq!(h["worker_name"], "rig-a");
        assert_eq!(h["instance_id"], "rig-a");
        assert_eq!(h["worker_id"].as_str().unwrap().len(), 32);
        assert_eq!(h["capacity"]["max_inflight"], 1);
        assert_eq!(h["capacity"]["max_inflight_total"], 8);
        assert_eq!(h["capacity"]["max_input_tokens"], 229_376);
        assert_eq!(h["capacity"]["max_output_tokens"], 32_768);
        assert_eq!(h["capacity"]["max_request_s"], 1800.0);
        assert_eq!(h["hw"]["parallelism"], "tp");
        assert!(h["hw"]["gpus"].is_string());
        assert!(h["versions"].is_object());
    }
    // No third leg appears: wait for a heartbeat round trip on each leg first.
    for l in &legs {
        let hb = ping_heartbeat(&fx.gw, l.id).await;
        assert_eq!(hb["capacity"]["max_inflight"], 1);
        assert_eq!(hb["inflight"], 0);
    }
    assert_eq!(fx.gw.live_legs().len(), 8);
    assert!(
        !m.log_text().contains(KEY),
        "the miner key must never be logged"
    );
    assert_eq!(m.terminate().and_then(|s| s.code()), Some(0));

    // MAX_INFLIGHT ≥ N: one leg per worker, floor(MAX_INFLIGHT / N) each.
    let _m2 = fx.miner(&[("MAX_INFLIGHT", "25")]);
    let legs = fx
        .gw
        .wait_for(T, |_, conns| {
            let live: Vec<_> = conns
                .iter()
                .filter(|c| c.alive && c.hello.is_some())
                .cloned()
                .collect();
            (live.len() == 10).then_some(live)
        })
        .await
        .expect("10 legs");
    let mut workers: Vec<usize> = legs.iter().map(|l| l.worker).collect();
    workers.sort_unstable();
    assert_eq!(workers, (0..10).collect::<Vec<_>>());
    for l in &legs {
        let h = l.hello.as_ref().unwrap();
        assert_eq!(h["capacity"]["max_inflight"], 2);
        assert_eq!(h["capacity"]["max_inflight_total"], 25);
        assert!(h["worker_name"].as_str().unwrap().starts_with("ins-"));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn non_streaming_and_streaming_replies_prove_the_served_rows() {
    let fx = Fixture::new(HIDDEN, 1, SglangConfig::default()).await;
    let _m = fx.miner(&[]);
    let leg = fx.gw.wait_legs(1, T).await.unwrap()[0].id;

    let mut req = chat("Tell me about the sky.", 40);
    req["engy_request_id"] = json!("req-123");
    assert!(fx.gw.serve(leg, "c1", req, false));
    let resp = fx.gw.wait_response("c1", T).await.expect("response");
    let (commitment, output) = assert_ok(&resp);
    assert_eq!(resp["request_id"], "req-123");
    let recs = fx.sglang.generate_log();
    assert_eq!(recs.len(), 1);
    let rec = &recs[0];
    assert!(
        rec.rid.starts_with("engy-") && rec.rid.len() == 37,
        "rid {}",
        rec.rid
    );
    assert_eq!(rec.request["return_hidden_states"], true);
    assert_eq!(rec.request["return_logprob"], true);
    assert_eq!(rec.request["sampling_params"]["temperature"], 0.0);
    assert_eq!(rec.request["sampling_params"]["max_new_tokens"], 40);
    let rows = served_rows(rec);
    assert_eq!(rows.len(), 40);
    assert_eq!(
        verify_against(commitment, &rows),
        2,
        "40 rows / 32 per batch"
    );
    let ids: Vec<u32> = commitment["output_token_ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect();
    assert_eq!(ids, rec.output_ids);
    let prompt: Vec<u32> = commitment["toploc"]["prompt_ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect();
    assert_eq!(prompt, rec.input_ids);
    assert_eq!(
        commitment["model_root"],
        engy_core::identity::model_root(&fx.ckpt())
            .unwrap()
            .as_str()
    );
    assert_eq!(output["choices"][0]["finish_reason"], "stop");
    assert_eq!(output["choices"][0]["message"]["role"], "assistant");
    assert_eq!(output["usage"]["prompt_tokens"], prompt.len());
    assert_eq!(output["usage"]["completion_tokens"], 40);
    assert_eq!(output["usage"]["total_tokens"], prompt.len() + 40);
    assert!(
        output["usage"].get("prompt_tokens_details").is_none(),
        "no cache hit"
    );
    assert!(
        fx.gw.chunks("c1").is_empty(),
        "non-streaming sends no chunk"
    );

    // Streaming: chunks carry only new suffixes; their concatenation is the content.
    assert!(fx
        .gw
        .serve(leg, "c2", chat("Tell me about the sea.", 24), true));
    let resp = fx.gw.wait_response("c2", T).await.expect("response");
    let (commitment, output) = assert_ok(&resp);
    let rec = fx.sglang.generate_log().pop().unwrap();
    assert_eq!(rec.request["stream"], true);
    verify_against(commitment, &served_rows(&rec));
    let chunks = fx.gw.chunks("c2");
    assert!(!chunks.is_empty());
    let streamed: String = chunks
        .iter()
        .map(|c| c["delta"]["content"].as_str().unwrap())
        .collect();
    assert_eq!(
        streamed,
        output["choices"][0]["message"]["content"].as_str().unwrap()
    );
    // The response is the last frame for c2.
    let frames = fx.gw.frames_for("c2");
    assert_eq!(frames.last().unwrap().kind(), "response");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chunked_generation_gives_the_rows_and_proof_of_one_call() {
    let fx = Fixture::new(HIDDEN, 1, SglangConfig::default()).await;
    let _m = fx.miner(&[("TOPLOC_GEN_CHUNK", "7")]);
    let leg = fx.gw.wait_legs(1, T).await.unwrap()[0].id;
    assert!(fx
        .gw
        .serve(leg, "long", chat("Write a long story.", 45), true));
    let resp = fx.gw.wait_response("long", T).await.expect("response");
    let (commitment, output) = assert_ok(&resp);
    let recs = fx.sglang.generate_log();
    // 45 tokens in chunks of 7: 7, then 6 continuations of 7+1 (+1 overlap) up to 45.
    assert_eq!(recs.len(), 7);
    assert_eq!(recs[1].request["sampling_params"]["max_new_tokens"], 8);
    let prompt: Vec<u32> = commitment["toploc"]["prompt_ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect();
    // Continuation input = prompt + output so far minus its last token.
    let ids: Vec<u32> = commitment["output_token_ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect();
    assert_eq!(ids.len(), 45);
    let mut want_input = prompt.clone();
    want_input.extend_from_slice(&ids[..6]);
    assert_eq!(recs[1].input_ids, want_input);

    // One long call on the same serve gives the same rows and the same proof.
    fx.sglang.flush_cache();
    let c = reqwest::Client::new();
    let one: Value = c
        .post(format!("{}/generate", fx.sglang.url()))
        .json(&json!({"input_ids": prompt, "sampling_params": {"temperature": 0.0, "max_new_tokens": 45},
                      "rid": "one-call", "return_hidden_states": true, "return_logprob": true}))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let rec = fx.sglang.generate_log().pop().unwrap();
    assert_eq!(rec.output_ids, ids);
    let rows = served_rows(&rec);
    verify_against(commitment, &rows);
    let bits = to_bits(&rows);
    let elements: Vec<&[u16]> = bits.iter().map(Vec::as_slice).collect();
    let params = engy_core::toploc::Params {
        topk: 128,
        decode_batching_size: 32,
        skip_prefill: true,
    };
    let direct =
        engy_core::toploc::build_proofs_base64(&elements, engy_core::toploc::Dtype::Bf16, &params)
            .unwrap();
    assert_eq!(commitment["toploc"]["proofs"], json!(direct));
    // The streamed text is the whole completion, overlap tokens not repeated.
    let streamed: String = fx
        .gw
        .chunks("long")
        .iter()
        .map(|c| c["delta"]["content"].as_str().unwrap())
        .collect();
    assert_eq!(
        streamed,
        output["choices"][0]["message"]["content"].as_str().unwrap()
    );
    assert_eq!(one["text"].as_str().unwrap(), streamed);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn radix_cache_hit_folds_tokens_into_the_prompt() {
    let fx = Fixture::new(HIDDEN, 1, SglangConfig::default()).await;
    let _m = fx.miner(&[]);
    let leg = fx.gw.wait_legs(1, T).await.unwrap()[0].id;
    // Warm the cache with the same prompt, then a full hit returns an empty element 0.
    assert!(fx
        .gw
        .serve(leg, "warm", chat("Same prompt twice.", 5), false));
    assert_ok(&fx.gw.wait_response("warm", T).await.unwrap());
    fx.sglang.push_fault(Fault::EmptyPrefillBlock);
    assert!(fx
        .gw
        .serve(leg, "hit", chat("Same prompt twice.", 12), false));
    let resp = fx.gw.wait_response("hit", T).await.unwrap();
    let (commitment, output) = assert_ok(&resp);
    let rec = fx.sglang.generate_log().pop().unwrap();
    assert!(rec.cached_tokens > 0);
    let mut want_prompt = rec.input_ids.clone();
    want_prompt.push(rec.output_ids[0]);
    assert_eq!(commitment["toploc"]["prompt_ids"], json!(want_prompt));
    assert_eq!(commitment["output_token_ids"], json!(rec.output_ids[1..]));
    verify_against(commitment, &served_rows(&rec));
    assert_eq!(output["usage"]["prompt_tokens"], want_prompt.len());
    assert_eq!(output["usage"]["completion_tokens"], 11);
    assert_eq!(
        output["usage"]["prompt_tokens_details"]["cached_tokens"],
        rec.cached_tokens.min(want_prompt.len())
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancel_before_start_mid_stream_and_inside_a_giant_final_line() {
    let fx = Fixture::new(256, 1, SglangConfig::default()).await;
    let _m = fx.miner(&[NO_PERIODIC_HEARTBEAT]);
    let leg = fx.gw.wait_legs(1, T).await.unwrap()[0].id;

    // 1. Cancel right behind the serve frame: the job may not have started. The Hang is
    // sticky, not queued: a job cancelled before its serve call would leave a queued
    // fault for the next step's call.
    fx.sglang.set_fault(Some(Fault::Hang));
    let n0 = fx.sglang.generate_log().len();
    assert!(fx.gw.serve(leg, "early", chat("Never mind.", 50), false));
    assert!(cancel_fenced(&fx.gw, leg, "early"));
    wait_idle(&fx.gw, leg).await;
    for rec in fx.sglang.generate_log().iter().skip(n0) {
        // Any serve call it made was aborted.
        wait_abort_of(&fx, &rec.rid).await;
    }
    assert!(
        fx.gw.frames_for("early").is_empty(),
        "nothing at all for a cancelled request"
    );
    fx.sglang.set_fault(None);
    // A Hang call still waiting would hold a serve slot: let it end.
    let _ = fx
        .sglang
        .wait_until(T, |_, _, live| (live == 0).then_some(()))
        .await;

    // 2. Mid-stream.
    fx.sglang
        .set_fault(Some(Fault::Slow(Duration::from_millis(20))));
    assert!(fx.gw.serve(leg, "mid", chat("Talk forever.", 5000), true));
    fx.gw
        .wait_for(T, |frames, _| {
            frames
                .iter()
                .any(|f| f.kind() == "chunk" && f.corr_id() == "mid")
                .then_some(())
        })
        .await
        .unwrap();
    let rid = fx.sglang.generate_log().last().unwrap().rid.clone();
    assert!(cancel_fenced(&fx.gw, leg, "mid"));
    wait_abort_of(&fx, &rid).await;
    wait_idle(&fx.gw, leg).await;
    assert!(frames_after_cancel(&fx, "mid").await.is_empty());
    fx.sglang.set_fault(None);
    fx.sglang
        .wait_until(T, |_, _, live| (live == 0).then_some(()))
        .await
        .expect("serve request ended");

    // 3. Inside a giant final SSE line that stalls half-written.
    fx.sglang.push_fault(Fault::StallFinalLine);
    assert!(fx.gw.serve(leg, "giant", chat("One more.", 200), true));
    let rid = fx
        .sglang
        .wait_until(T, |recs, _, _| {
            recs.last()
                .filter(|r| !r.finish_reason.is_null() && r.request["stream"] == true)
                .map(|r| r.rid.clone())
        })
        .await
        .expect("final event being written");
    assert!(cancel_fenced(&fx.gw, leg, "giant"));
    wait_abort_of(&fx, &rid).await;
    wait_idle(&fx.gw, leg).await;
    assert!(frames_after_cancel(&fx, "giant").await.is_empty());
    assert!(fx
        .gw
        .frames_for("giant")
        .iter()
        .all(|f| f.kind() == "chunk"));

    // The slot was released every time: the leg still serves.
    assert!(fx.gw.serve(leg, "after", chat("Still there?", 8), false));
    assert_ok(&fx.gw.wait_response("after", T).await.unwrap());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn misaligned_or_missing_rows_are_error_responses() {
    let fx = Fixture::new(HIDDEN, 1, SglangConfig::default()).await;
    let _m = fx.miner(&[]);
    let leg = fx.gw.wait_legs(1, T).await.unwrap()[0].id;
    let cases = [
        (Fault::ForeignPrefillRows(3), "misaligned"),
        (Fault::MissingDecodeRow, "misaligned"),
        (Fault::RaggedRowWidth, "misaligned"),
        (Fault::Retraction, "misaligned"),
        (Fault::HiddenStatesDisabled, "--enable-return-hidden-states"),
        (Fault::NoHiddenStates, "--enable-return-hidden-states"),
    ];
    for (i, (fault, needle)) in cases.iter().enumerate() {
        for stream in [false, true] {
            fx.sglang.push_fault(fault.clone());
            let corr = format!("bad-{i}-{stream}");
            assert!(fx.gw.serve(leg, &corr, chat("Hello there.", 9), stream));
            let resp = fx.gw.wait_response(&corr, T).await.unwrap();
            let err = resp["error"]
                .as_str()
                .unwrap_or_else(|| panic!("{fault:?}: no error in {resp}"));
            assert!(err.contains(needle), "{fault:?}: {err}");
            assert!(err.chars().count() <= 300);
            assert!(resp["commitment"].is_null());
            assert_eq!(resp["output"], json!({}));
        }
    }
    // The no-rows error shows the curl probe.
    let last = fx.gw.wait_response("bad-5-false", T).await.unwrap();
    assert!(last["error"].as_str().unwrap().contains("curl"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_failures_fail_one_request_and_the_leg_carries_on() {
    let fx = Fixture::new(HIDDEN, 1, SglangConfig::default()).await;
    let _m = fx.miner(&[]);
    let leg = fx.gw.wait_legs(1, T).await.unwrap()[0].id;
    let cases = [
        (Fault::Status(503), false, "503"),
        (Fault::Status(500), true, "500"),
        (Fault::MalformedJson, false, "malformed"),
        (Fault::MalformedJson, true, "malformed"),
        (Fault::DieAfterEvents(2), true, "broke off|closed"),
        (Fault::DieAfterEvents(0), false, "broke off|closed"),
    ];
    for (i, (fault, stream, needle)) in cases.iter().enumerate() {
        fx.sglang.push_fault(fault.clone());
        let corr = format!("f{i}");
        assert!(fx.gw.serve(leg, &corr, chat("Hi.", 6), *stream));
        let resp = fx.gw.wait_response(&corr, T).await.unwrap();
        let err = resp["error"]
            .as_str()
            .unwrap_or_else(|| panic!("{fault:?}: {resp}"));
        let lower = err.to_lowercase();
        assert!(
            needle.split('|').any(|n| lower.contains(n)),
            "{fault:?}: {err}"
        );
    }
    assert!(fx.gw.serve(leg, "fine", chat("Hi.", 6), true));
    assert_ok(&fx.gw.wait_response("fine", T).await.unwrap());
    assert_eq!(fx.gw.live_legs().len(), 1);
    assert_eq!(fx.gw.live_legs()[0].id, leg, "same leg throughout");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sixty_four_concurrent_requests_over_eight_legs() {
    let fx = Fixture::new(HIDDEN, 8, SglangConfig::default()).await;
    let _m = fx.miner(&[("MAX_INFLIGHT", "64")]);
    let legs = fx.gw.wait_legs(8, T).await.unwrap();
    // No request may finish (and free its slot) before the 65th submit: ≥ 20 tokens at
    // 50 ms each keeps all 64 open for a second, however slowly the loop below runs.
    fx.sglang
        .set_fault(Some(Fault::Slow(Duration::from_millis(50))));
    let mut corrs = Vec::new();
    for i in 0..64 {
        let (_, corr) = fx
            .gw
            .submit(
                chat(&format!("Question number {i}?"), 20 + (i % 5)),
                i % 2 == 0,
            )
            .expect("capacity");
        corrs.push(corr);
    }
    assert!(
        fx.gw.submit(chat("one too many", 4), false).is_none(),
        "8 legs × 8 are full"
    );
    fx.sglang.set_fault(None);
    for corr in &corrs {
        let resp = fx
            .gw
            .wait_response(corr, T)
            .await
            .unwrap_or_else(|| panic!("no response for {corr}"));
        let (commitment, _) = assert_ok(&resp);
        let rec = fx
            .sglang
            .generate_log()
            .into_iter()
            .find(|r| {
                json!(r.output_ids) == commitment["output_token_ids"]
                    && json!(r.input_ids) == commitment["toploc"]["prompt_ids"]
            })
            .expect("served record");
        verify_against(commitment, &served_rows(&rec));
    }
    // The response frame is sent just before the slot is released: wait for each leg to
    // go idle (bounded) rather than ask once.
    for l in &legs {
        wait_idle(&fx.gw, l.id).await;
    }
    assert!(fx.sglang.live_rids().is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropped_or_drained_legs_reconnect_and_keep_serving() {
    let fx = Fixture::new(HIDDEN, 1, SglangConfig::default()).await;
    let _m = fx.miner(&[]);
    let first = fx.gw.wait_legs(1, T).await.unwrap()[0].id;
    assert!(fx.gw.drop_conn(first));
    let second = next_leg(&fx.gw, first).await;
    assert!(fx.gw.serve(second, "r1", chat("Back?", 5), false));
    assert_ok(&fx.gw.wait_response("r1", T).await.unwrap());
    // `reconnect`: the miner closes the leg itself and dials again.
    assert!(fx.gw.reconnect(second));
    let third = next_leg(&fx.gw, second).await;
    assert!(!fx.gw.conns().iter().find(|c| c.id == second).unwrap().alive);
    fx.gw.admit(third);
    fx.gw.deny(third, "test deny is only logged");
    assert!(fx.gw.serve(third, "r2", chat("Again?", 5), true));
    assert_ok(&fx.gw.wait_response("r2", T).await.unwrap());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn configuration_errors_and_a_second_instance() {
    let fx = Fixture::new(HIDDEN, 1, SglangConfig::default()).await;
    let run = |envs: &[(&str, &str)]| {
        let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_engy-miner"));
        cmd.env_clear()
            .env("ENGY_MINER_LOCK", fx.lock())
            .env("CHECKPOINT", fx.ckpt());
        for (k, v) in envs {
            cmd.env(k, v);
        }
        cmd.output().unwrap()
    };
    let out = run(&[("MINER_KEY", KEY)]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("GW is not set"));
    let gw = fx.gw.url();
    let out = run(&[("GW", &gw)]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("MINER_KEY is not set"));
    // --help never shows the key's value.
    let help = std::process::Command::new(env!("CARGO_BIN_EXE_engy-miner"))
        .arg("--help")
        .env("MINER_KEY", KEY)
        .output()
        .unwrap();
    assert!(help.status.success());
    assert!(!String::from_utf8_lossy(&help.stdout).contains(KEY));

    let mut first = fx.miner(&[]);
    fx.gw.wait_legs(1, T).await.unwrap();
    let second = std::process::Command::new(env!("CARGO_BIN_EXE_engy-miner"))
        .env_clear()
        .env("GW", &gw)
        .env("MINER_KEY", KEY)
        .env("CHECKPOINT", fx.ckpt())
        .env("SERVE_URL", fx.sglang.url())
        .env("ENGY_MINER_LOCK", fx.lock())
        .output()
        .unwrap();
    assert_eq!(second.status.code(), Some(0));
    assert!(String::from_utf8_lossy(&second.stderr).contains("another engy-miner instance"));
    assert_eq!(fx.gw.live_legs().len(), 1);
    // Graceful SIGTERM: exit 0, the leg closes.
    assert_eq!(first.terminate().and_then(|s| s.code()), Some(0));
    fx.gw
        .wait_for(T, |_, conns| conns.iter().all(|c| !c.alive).then_some(()))
        .await
        .expect("leg closed");
    assert!(first.log_text().contains("stopped"));
    assert!(!first.log_text().contains(KEY));
}

/// `engy-miner check` against the fixture's serve and gateway, run off the runtime.
async fn run_check(fx: &Fixture) -> std::process::Output {
    let (ckpt, serve, gw) = (fx.ckpt(), fx.sglang.url(), fx.gw.url());
    tokio::task::spawn_blocking(move || {
        std::process::Command::new(env!("CARGO_BIN_EXE_engy-miner"))
            .arg("check")
            .env_clear()
            .env("CHECKPOINT", ckpt)
            .env("SERVE_URL", serve)
            .env("GW", gw)
            .env("MINER_KEY", KEY)
            .output()
            .unwrap()
    })
    .await
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn check_preflight_passes_and_fails_with_the_fix() {
    let fx = Fixture::new(HIDDEN, 2, SglangConfig::default()).await;
    let out = run_check(&fx).await;
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    assert_eq!(out.status.code(), Some(0), "{text}");
    assert!(text.contains("all checks passed"), "{text}");
    assert!(text.contains("workers 2"), "{text}");

    let bad = Fixture::new(
        HIDDEN,
        1,
        SglangConfig {
            enable_hidden_states: false,
            ..Default::default()
        },
    )
    .await;
    let out = run_check(&bad).await;
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    assert_eq!(out.status.code(), Some(1), "{text}");
    assert!(
        text.contains("FAIL") && text.contains("--enable-return-hidden-states"),
        "{text}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oversized_replies_fail_that_request_not_the_process() {
    let fx = Fixture::new(256, 1, SglangConfig::default()).await;
    let _m = fx.miner(&[("ENGY_MAX_RESPONSE_MB", "1")]);
    let leg = fx.gw.wait_legs(1, T).await.unwrap()[0].id;
    // ~400 rows × 256 floats × ≥ 10 bytes: over 1 MiB in one body / one SSE line.
    for (corr, stream) in [("big-body", false), ("big-line", true)] {
        assert!(fx
            .gw
            .serve(leg, corr, chat("Long answer please.", 400), stream));
        let resp = fx.gw.wait_response(corr, T).await.unwrap();
        let err = resp["error"].as_str().unwrap_or_else(|| panic!("{resp}"));
        assert!(err.contains("cap"), "{err}");
    }
    assert!(fx.gw.serve(leg, "small", chat("Short.", 8), true));
    assert_ok(&fx.gw.wait_response("small", T).await.unwrap());
    wait_idle(&fx.gw, leg).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_lets_in_flight_requests_finish_then_exits_zero() {
    let fx = Fixture::new(HIDDEN, 1, SglangConfig::default()).await;
    let m = fx.miner(&[("ENGY_DRAIN_S", "30")]);
    let leg = fx.gw.wait_legs(1, T).await.unwrap()[0].id;
    fx.sglang
        .set_fault(Some(Fault::Slow(Duration::from_millis(10))));
    assert!(fx.gw.serve(leg, "inflight", chat("Finish me.", 60), true));
    fx.sglang
        .wait_until(T, |recs, _, live| {
            (!recs.is_empty() && live == 1).then_some(())
        })
        .await
        .unwrap();
    let code = stop(m).await;
    assert_eq!(code.0, Some(0), "{}", code.1);
    let resp = fx
        .gw
        .wait_response("inflight", T)
        .await
        .expect("drained request answered");
    let (commitment, _) = assert_ok(&resp);
    assert_eq!(commitment["toploc"]["n_tokens"], 60);
    assert!(code.1.contains("draining"), "{}", code.1);
}
