//! The real `engy-miner` binary at the edges where the production miner was seen to differ
//! (issue 14, docs/PROTOCOL.md): request fields in the forms production reads, null proofs,
//! cancel before serve, list content, streaming cadence and UTF-8, a terminal frame for
//! every served request (oversize frames; the SIGTERM drain is in hardening_faults.rs),
//! and MINER_KEY in no log.
mod common;

use std::time::Duration;

use common::*;
use engy_devnet::gateway::Dir;
use engy_devnet::sglang::{Fault, SglangConfig};
use serde_json::{json, Value};

const HIDDEN: usize = 128;

/// Renders `content` strings, and lists of `{type: "text", text}` parts as their texts.
const PARTS_TEMPLATE: &str = "{%- for m in messages -%}{{ '<|im_start|>' + m.role + '\\n' }}\
{%- if m.content is string -%}{{ m.content }}{%- else -%}{%- for p in m.content -%}{%- if p.type == 'text' -%}{{ p.text }}{%- endif -%}{%- endfor -%}{%- endif -%}\
{{ '<|im_end|>\\n' }}{%- endfor -%}{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}";

/// Every frame the miner sent parses strictly as a wire frame.
fn assert_wire_frames(fx: &Fixture) {
    for f in fx.gw.frames() {
        if f.dir == Dir::FromMiner && !f.kind().starts_with('<') {
            if let Err(e) = f.miner_frame() {
                panic!("not a wire frame ({e}): {}", f.value);
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn request_fields_are_read_as_the_production_miner_reads_them() {
    let fx = Fixture::new(HIDDEN, 1, SglangConfig::default()).await;
    let _m = fx.miner(&[]);
    let leg = fx.gw.wait_legs(1, T).await.unwrap()[0].id;
    let cases = [
        ("s5", json!("5"), 5),
        ("f5", json!(5.0), 5),
        ("f59", json!(5.9), 5),
        ("mct", Value::Null, 6),
    ];
    for (corr, max_tokens, want) in cases {
        let mut req = chat("Count.", 1);
        req["max_tokens"] = max_tokens;
        if corr == "mct" {
            req["max_completion_tokens"] = json!(6);
        }
        req["engy_request_id"] = json!(4242);
        assert!(fx.gw.serve(leg, corr, req, false));
        let resp = fx.gw.wait_response(corr, T).await.expect("response");
        let (commitment, _) = assert_ok(&resp);
        assert_eq!(
            resp["request_id"], 4242,
            "a numeric request id is echoed as sent"
        );
        assert_eq!(
            commitment["output_token_ids"].as_array().unwrap().len(),
            want,
            "{corr}"
        );
        let rec = fx.sglang.generate_log().pop().unwrap();
        assert_eq!(
            rec.wire_request().unwrap().sampling_params.max_new_tokens,
            want as u64
        );
    }
    // "stream": "true" streams (Python truthiness).
    let req =
        json!({"type": "serve", "corr_id": "st", "stream": "true", "request": chat("Stream.", 12)});
    assert!(fx.gw.send(leg, req));
    let resp = fx.gw.wait_response("st", T).await.expect("response");
    assert_ok(&resp);
    assert!(
        !fx.gw.chunks("st").is_empty(),
        "\"stream\":\"true\" must stream"
    );
    assert_eq!(
        fx.sglang.generate_log().pop().unwrap().request["stream"],
        true
    );
    // A max_tokens production cannot read either is an error response, not a default.
    let mut req = chat("Bad.", 1);
    req["max_tokens"] = json!("5.0");
    assert!(fx.gw.serve(leg, "bad", req, false));
    let resp = fx.gw.wait_response("bad", T).await.expect("response");
    assert!(
        resp["error"].as_str().unwrap().contains("max_tokens"),
        "{resp}"
    );
    assert_eq!(resp["commitment"], Value::Null);
    assert_wire_frames(&fx);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_proof_that_cannot_be_built_is_delivered_as_null_proofs() {
    let fx = Fixture::new(HIDDEN, 1, SglangConfig::default()).await;
    // top-k 200 over a last batch of one 128-value row: TOPLOC cannot build it.
    let _m = fx.miner(&[("TOPLOC_TOPK", "200")]);
    let leg = fx.gw.wait_legs(1, T).await.unwrap()[0].id;
    assert!(fx.gw.serve(leg, "np", chat("Hi.", 33), false));
    let resp = fx.gw.wait_response("np", T).await.expect("response");
    let (commitment, output) = assert_ok(&resp);
    assert_eq!(output["usage"]["completion_tokens"], 33);
    let proofs = commitment["toploc"]["proofs"].as_array().unwrap();
    // toploc 0.1.6: 1 + (n - 1 + dbs) // dbs null proofs = 1 + 64 // 32 = 3.
    assert_eq!(proofs.len(), 3);
    for p in proofs {
        let poly = engy_core::toploc::ProofPoly::from_base64(p.as_str().unwrap()).unwrap();
        assert!(poly.is_null(), "a null proof: modulus 0");
        assert_eq!(
            poly.to_bytes(),
            vec![0u8; 2 + 2 * 200],
            "and 200 zero coefficients"
        );
    }
    assert_eq!(commitment["toploc"]["n_tokens"], 33);
    assert_wire_frames(&fx);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancel_just_before_its_serve_answers_it_and_the_corr_id_is_not_swallowed() {
    let fx = Fixture::new(HIDDEN, 1, SglangConfig::default()).await;
    let _m = fx.miner(&[NO_PERIODIC_HEARTBEAT]);
    let leg = fx.gw.wait_legs(1, T).await.unwrap()[0].id;
    assert!(fx.gw.send_together(
        leg,
        vec![
            json!({"type": "cancel", "corr_id": "early"}),
            json!({"type": "serve", "corr_id": "early", "request": chat("Hi.", 4)}),
        ]
    ));
    let resp = fx
        .gw
        .wait_response("early", T)
        .await
        .expect("a terminal frame");
    assert!(
        resp["error"].as_str().unwrap().contains("cancelled"),
        "{resp}"
    );
    assert!(fx.sglang.generate_log().is_empty(), "nothing ran for it");
    // The same corr_id served again later is served (the cancel was consumed).
    let n = frame_count(&fx.gw).await;
    assert!(fx.gw.serve(leg, "early", chat("Hi again.", 4), false));
    let resp = wait_frame_of(&fx.gw, "early", n, &["response"], T)
        .await
        .expect("second response");
    assert_ok(&resp);
    assert_wire_frames(&fx);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn content_as_a_list_of_text_parts_renders_as_transformers_does() {
    let fx = Fixture::new(HIDDEN, 1, SglangConfig::default()).await;
    // A template that renders typed parts, as multimodal chat templates do (transformers
    // hands `content` to the template as sent).
    std::fs::write(fx.ckpt().join("chat_template.jinja"), PARTS_TEMPLATE).unwrap();
    let _m = fx.miner(&[]);
    let leg = fx.gw.wait_legs(1, T).await.unwrap()[0].id;
    let parts = json!({"messages": [
        {"role": "user", "content": [{"type": "text", "text": "Hello "}, {"type": "text", "text": "there."}]}
    ], "max_tokens": 3});
    assert!(fx.gw.serve(leg, "parts", parts, false));
    let resp = fx.gw.wait_response("parts", T).await.expect("response");
    let (commitment, _) = assert_ok(&resp);
    let plain = json!({"messages": [{"role": "user", "content": "Hello there."}], "max_tokens": 3});
    assert!(fx.gw.serve(leg, "plain", plain, false));
    let resp = fx.gw.wait_response("plain", T).await.expect("response");
    let (plain_c, _) = assert_ok(&resp);
    assert_eq!(
        commitment["toploc"]["prompt_ids"],
        plain_c["toploc"]["prompt_ids"]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streamed_chunks_wait_out_the_flush_window_from_the_first_delta_on() {
    let fx = Fixture::new(HIDDEN, 1, SglangConfig::default()).await;
    let _m = fx.miner(&[("STREAM_FLUSH_S", "0.05")]);
    let leg = fx.gw.wait_legs(1, T).await.unwrap()[0].id;
    fx.sglang
        .set_fault(Some(Fault::Slow(Duration::from_millis(4))));
    assert!(fx
        .gw
        .serve(leg, "cadence", chat("A long answer.", 60), true));
    let resp = fx.gw.wait_response("cadence", T).await.expect("response");
    let (_, output) = assert_ok(&resp);
    fx.sglang.set_fault(None);
    let frames = fx.gw.frames();
    let served_at = frames
        .iter()
        .find(|f| f.dir == Dir::ToMiner && f.kind() == "serve")
        .unwrap()
        .at;
    let chunks: Vec<_> = frames
        .iter()
        .filter(|f| f.kind() == "chunk" && f.corr_id() == "cadence")
        .collect();
    assert!(chunks.len() >= 2, "{} chunks", chunks.len());
    let window = Duration::from_millis(50);
    assert!(
        chunks[0].at.duration_since(served_at) >= window,
        "the first delta waits for the window too: {:?}",
        chunks[0].at.duration_since(served_at)
    );
    // Between the chunks of one generation call (the last may be the call-end flush).
    // Recorded on arrival, so a chunk held up on a loaded machine shortens the gap after
    // it and lengthens the one before by as much: the mean gap, from the first to the
    // last of these chunks, is what scheduling cannot shrink. Tokens come every ~4 ms, so
    // uncoalesced chunks would be ~4 ms apart, far below half a window.
    let inner = &chunks[..chunks.len() - 1];
    if let (Some(first), Some(last)) = (inner.first(), inner.last()) {
        let gaps = u32::try_from(inner.len() - 1).unwrap();
        if gaps > 0 {
            let mean = last.at.duration_since(first.at) / gaps;
            assert!(mean >= window / 2, "mean gap {mean:?} over {gaps} gaps");
        }
    }
    let streamed: String = chunks
        .iter()
        .map(|c| c.value["delta"]["content"].as_str().unwrap())
        .collect();
    assert_eq!(
        streamed,
        output["choices"][0]["message"]["content"].as_str().unwrap()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streamed_text_never_carries_a_transient_replacement_character() {
    let fx = Fixture::new(HIDDEN, 1, SglangConfig::default()).await;
    // One generation call per request: within a call the stream equals the final text
    // exactly. (Across a continuation boundary some splits still differ: docs/PROTOCOL.md
    // §3.6 and the closing note of issue 14.)
    let _m = fx.miner(&[("TOPLOC_GEN_CHUNK", "4096")]);
    let leg = fx.gw.wait_legs(1, T).await.unwrap()[0].id;
    // Byte-level tokens: many completions split a multi-byte character across tokens.
    let mut split = 0;
    for i in 0..12 {
        let corr = format!("u{i}");
        assert!(fx.gw.serve(
            leg,
            &corr,
            chat(&format!("Say something in Greek, take {i}."), 80),
            true
        ));
        let resp = fx.gw.wait_response(&corr, T).await.expect("response");
        let (_, output) = assert_ok(&resp);
        let content = output["choices"][0]["message"]["content"].as_str().unwrap();
        let streamed: String = fx
            .gw
            .chunks(&corr)
            .iter()
            .map(|c| c["delta"]["content"].as_str().unwrap().to_string())
            .collect();
        assert_eq!(streamed, content, "{corr}");
        split += usize::from(content.chars().any(|c| c.len_utf8() > 1 && c != '\u{fffd}'));
    }
    assert!(
        split > 0,
        "no completion had a multi-byte character: the test proves nothing"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn text_of_an_sse_event_that_does_not_parse_is_never_forwarded() {
    let fx = Fixture::new(HIDDEN, 1, SglangConfig::default()).await;
    let _m = fx.miner(&[]);
    let leg = fx.gw.wait_legs(1, T).await.unwrap()[0].id;
    let body = b"data: {\"text\":\"LEAKED\",\"output_ids\":[5],\"meta_info\":{\"finish_reason\":null}} trailing\n\ndata: [DONE]\n\n".to_vec();
    fx.sglang.push_fault(Fault::Raw(body));
    assert!(fx.gw.serve(leg, "trail", chat("Hi.", 4), true));
    let resp = fx.gw.wait_response("trail", T).await.expect("response");
    assert!(resp["error"].is_string(), "{resp}");
    assert!(
        fx.gw
            .chunks("trail")
            .iter()
            .all(|c| !c.to_string().contains("LEAKED")),
        "{:?}",
        fx.gw.chunks("trail")
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_oversize_gateway_frame_is_dropped_and_the_leg_goes_on() {
    let fx = Fixture::new(HIDDEN, 1, SglangConfig::default()).await;
    let m = fx.miner(&[NO_PERIODIC_HEARTBEAT]);
    let leg = fx.gw.wait_legs(1, T).await.unwrap()[0].id;
    fx.sglang
        .set_fault(Some(Fault::Slow(Duration::from_millis(5))));
    // In flight while the oversize frame arrives.
    assert!(fx.gw.serve(leg, "before", chat("First.", 30), true));
    fx.sglang
        .wait_until(T, |recs, _, _| (!recs.is_empty()).then_some(()))
        .await
        .expect("the first call started");
    let huge = "x".repeat(17 << 20);
    assert!(fx.gw.send(
        leg,
        json!({"type": "serve", "corr_id": "huge", "request": {"messages": [{"role": "user", "content": huge}]}})
    ));
    drop(huge);
    let resp = fx
        .gw
        .wait_response("huge", T)
        .await
        .expect("the oversize serve is answered");
    assert!(
        resp["error"].as_str().unwrap().contains("frame cap"),
        "{resp}"
    );
    let resp = fx
        .gw
        .wait_response("before", T)
        .await
        .expect("the in-flight request finished");
    assert_ok(&resp);
    fx.sglang.set_fault(None);
    assert!(fx.gw.serve(leg, "after", chat("Then.", 4), false));
    assert_ok(
        &fx.gw
            .wait_response("after", T)
            .await
            .expect("served on the same leg"),
    );
    assert_eq!(fx.gw.conns().len(), 1, "the leg was never re-dialed");
    assert_wire_frames(&fx);
    terminate_idle(m).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_miner_key_is_in_no_log_at_trace_level() {
    let fx = Fixture::new(HIDDEN, 1, SglangConfig::default()).await;
    let m = fx.miner(&[(
        "RUST_LOG",
        "trace,tungstenite=trace,tokio_tungstenite=trace",
    )]);
    let leg = fx.gw.wait_legs(1, T).await.unwrap()[0].id;
    assert!(fx.gw.serve(leg, "t", chat("Hi.", 3), false));
    assert_ok(&fx.gw.wait_response("t", T).await.expect("response"));
    let log = wait_log(&m, "HELLO sent").await;
    assert!(log.contains("TRACE"), "trace logging is on");
    assert!(!log.contains(KEY), "MINER_KEY in the log");
    terminate_idle(m).await;
}

/// `messages: []` (and a request without `messages`, which production reads as `[]`) is an
/// error `response` as in production (issue 21 item 11): nothing is generated for it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn empty_messages_get_an_error_response_as_in_production() {
    let fx = Fixture::new(HIDDEN, 1, SglangConfig::default()).await;
    let _m = fx.miner(&[]);
    let leg = fx.gw.wait_legs(1, T).await.unwrap()[0].id;
    for (corr, req) in [
        ("empty", json!({"messages": [], "max_tokens": 4})),
        ("absent", json!({"max_tokens": 4})),
    ] {
        assert!(fx.gw.serve(leg, corr, req, false));
        let resp = fx.gw.wait_response(corr, T).await.expect("response");
        let error = resp["error"]
            .as_str()
            .unwrap_or_else(|| panic!("{corr}: {resp}"));
        assert!(error.contains("messages"), "{corr}: {error}");
        assert!(resp["commitment"].is_null(), "{resp}");
    }
    assert!(fx.sglang.generate_log().is_empty(), "nothing was generated");
    assert_wire_frames(&fx);
}
