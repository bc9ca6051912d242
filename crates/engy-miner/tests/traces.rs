//! Routing and indexer traces (docs/PROTOCOL.md §3.10, issue 23 A1–A2) through the real
//! `engy-miner` binary and the sglang double on 127.0.0.1: the trace a commitment carries
//! equals the routing the serve's model computed for every position with a forward pass,
//! across generation chunks, streams and radix-cache hits; anything wrong with the serve's
//! field leaves the commitment without a trace and the request successful, counted in
//! `engy_miner_traces_total`.
mod common;

use common::*;
use engy_core::trace::Trace;
use engy_devnet::sglang::synthetic::{CheckpointSpec, SyntheticBackend, SyntheticConfig};
use engy_devnet::sglang::{Backend, Fault, IndexerShape, RoutingShape, SglangConfig, TraceFault};
use serde_json::Value;

const MOE: RoutingShape = RoutingShape {
    num_hidden_layers: 4,
    num_experts_per_tok: 2,
    num_experts: 16,
    first_k_dense: 1,
};

fn moe_spec() -> CheckpointSpec {
    CheckpointSpec {
        hidden_size: 64,
        vocab_size: 500,
        routing: Some(MOE),
        indexer: None,
    }
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

/// The routing (or indexer top-k) the model computes for every position of the
/// commitment's sequence that had a forward pass (`[0, prompt + output − 1)`): one prefill
/// over those tokens, independent of how the miner split the generation.
fn oracle(fx: &Fixture, commitment: &Value, indexer: bool) -> Vec<i32> {
    let b = SyntheticBackend::from_checkpoint(&fx.ckpt(), SyntheticConfig::default()).unwrap();
    let mut seq = ids(&commitment["toploc"]["prompt_ids"]);
    seq.extend(ids(&commitment["output_token_ids"]));
    seq.pop();
    let step = b.start(&seq, 0).unwrap().step().unwrap();
    if indexer {
        step.indexer_topk.unwrap()
    } else {
        step.routing.unwrap()
    }
}

fn trace_of(commitment: &Value, key: &str) -> Option<Trace> {
    commitment
        .get(key)
        .map(|t| serde_json::from_value(t.clone()).unwrap())
}

fn positions(commitment: &Value) -> u64 {
    (commitment["toploc"]["prompt_ids"].as_array().unwrap().len()
        + commitment["output_token_ids"].as_array().unwrap().len()
        - 1) as u64
}

fn trace_sample(text: &str, trace: &str, outcome: &str) -> f64 {
    sample(
        text,
        &format!(r#"engy_miner_traces_total{{trace="{trace}",outcome="{outcome}"}}"#),
    )
}

/// Serve `corr` and return its successful commitment.
async fn commitment(fx: &Fixture, leg: u64, corr: &str, max_tokens: u64, stream: bool) -> Value {
    assert!(fx.gw.serve(
        leg,
        corr,
        chat("Tell me about the sea.", max_tokens),
        stream
    ));
    let resp = fx.gw.wait_response(corr, T).await.expect("response");
    assert_ok(&resp).0.clone()
}

/// The `routed_experts_start_len` each `/generate` call of the log asked for (`None` =
/// routing not asked), with its input length.
fn asks(fx: &Fixture) -> Vec<(Option<u64>, usize)> {
    fx.sglang
        .generate_log()
        .iter()
        .map(|r| {
            let asked = r.request.get("return_routed_experts") == Some(&Value::Bool(true));
            (
                asked.then(|| r.request["routed_experts_start_len"].as_u64().unwrap()),
                r.input_ids.len(),
            )
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chunked_and_streamed_generations_carry_the_models_routing() {
    let cfg = SglangConfig::default().with_routed_experts(true);
    let fx = Fixture::with_spec(&moe_spec(), 1, cfg).await;
    let (_m, addr) = miner_with_metrics(&fx, &[("TOPLOC_GEN_CHUNK", "7")]).await;
    let leg = fx.gw.wait_legs(1, T).await.unwrap()[0].id;
    for (n, stream) in [(0, false), (1, true)] {
        let c = commitment(&fx, leg, &format!("c{n}"), 20, stream).await;
        let t = trace_of(&c, "routing").expect("commitment.routing");
        assert_eq!((t.start, t.rows), (0, positions(&c)));
        assert_eq!((t.layers, t.width, t.id_bytes, t.padded), (4, 2, 1, false));
        let d = t.decode().unwrap();
        assert_eq!(d.ids, oracle(&fx, &c, false), "stream {stream}");
        // Dense layer 0 is all zeros; MoE layers hold distinct experts below 16.
        for p in 0..t.rows {
            assert_eq!(d.at(p, 0), Some(&[0, 0][..]));
            let e = d.at(p, 3).unwrap();
            assert!(
                e[0] != e[1] && e.iter().all(|x| (0..16).contains(x)),
                "{e:?}"
            );
        }
        assert!(
            c.get("indexer_topk").is_none(),
            "indexer trace is off by default"
        );
    }
    // 20 tokens in chunks of 7: 3 calls per request; each continuation asks from the
    // first position the earlier calls did not cover, which is its input length.
    let a = asks(&fx);
    assert_eq!(a.len(), 6, "{a:?}");
    for call in a.chunks(3) {
        assert_eq!(call[0].0, Some(0));
        for (start, n_input) in &call[1..] {
            assert_eq!(*start, Some(*n_input as u64));
        }
    }
    let text = scrape(&addr).await;
    assert_eq!(trace_sample(&text, "routing", "attached"), 2.0);
    assert_eq!(trace_sample(&text, "routing", "not_offered"), 0.0);
    assert_eq!(trace_sample(&text, "indexer", "attached"), 0.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn radix_cache_hits_and_prompt_extra_keep_the_trace_whole() {
    let cfg = SglangConfig::default().with_routed_experts(true);
    let fx = Fixture::with_spec(&moe_spec(), 1, cfg).await;
    let _m = fx.miner(&[("TOPLOC_GEN_CHUNK", "5")]);
    let leg = fx.gw.wait_legs(1, T).await.unwrap()[0].id;
    let first = commitment(&fx, leg, "a", 12, false).await;
    // The same prompt again: its first call hits the radix cache (the double returns the
    // cached prefix's routing too, as sglang does from its host buffer).
    let second = commitment(&fx, leg, "b", 12, false).await;
    let recs = fx.sglang.generate_log();
    let first_call_b = recs
        .iter()
        .filter(|r| r.request["routed_experts_start_len"] == 0)
        .nth(1)
        .unwrap();
    assert!(
        first_call_b.cached_tokens > 0,
        "the second request hit the cache"
    );
    for c in [&first, &second] {
        let t = trace_of(c, "routing").expect("routing");
        assert_eq!(t.rows, positions(c));
        assert_eq!(t.decode().unwrap().ids, oracle(&fx, c, false));
    }
    // An empty prefill block (engy's "full radix-cache hit", §3.5): the first output
    // token moves into the prompt as prompt_extra; the trace still covers every position.
    fx.sglang.push_fault(Fault::EmptyPrefillBlock);
    let c = commitment(&fx, leg, "extra", 12, true).await;
    assert_eq!(
        c["toploc"]["prompt_ids"].as_array().unwrap().len(),
        ids(&first["toploc"]["prompt_ids"]).len() + 1,
        "prompt_extra"
    );
    let t = trace_of(&c, "routing").expect("routing with prompt_extra");
    assert_eq!(t.rows, positions(&c));
    assert_eq!(t.decode().unwrap().ids, oracle(&fx, &c, false));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_serve_without_the_flag_is_not_asked_and_requests_succeed() {
    let fx = Fixture::with_spec(&moe_spec(), 1, SglangConfig::default()).await;
    let (m, addr) = miner_with_metrics(&fx, &[]).await;
    let leg = fx.gw.wait_legs(1, T).await.unwrap()[0].id;
    let log = wait_log(&m, "serve does not offer routed experts").await;
    assert!(log.contains("--enable-return-routed-experts"), "{log}");
    let c = commitment(&fx, leg, "c", 9, false).await;
    assert!(c.get("routing").is_none(), "{c}");
    assert!(asks(&fx).iter().all(|(a, _)| a.is_none()));
    let text = scrape(&addr).await;
    assert_eq!(trace_sample(&text, "routing", "not_offered"), 1.0);
    assert_eq!(trace_sample(&text, "routing", "attached"), 0.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broken_field_never_fails_a_request() {
    let cfg = SglangConfig::default().with_routed_experts(true);
    let fx = Fixture::with_spec(&moe_spec(), 1, cfg).await;
    let (m, addr) = miner_with_metrics(&fx, &[("TOPLOC_GEN_CHUNK", "6")]).await;
    let leg = fx.gw.wait_legs(1, T).await.unwrap()[0].id;
    let cases = [
        (TraceFault::Missing, "missing"),
        (TraceFault::NotBase64, "malformed"),
        (TraceFault::NotAString, "malformed"),
        (TraceFault::CutMidValue, "malformed"),
        (TraceFault::OneRowShort, "rows"),
    ];
    for (i, (fault, _)) in cases.iter().enumerate() {
        // The fault hits the first of two calls; streamed and not, alternately.
        let corr = format!("f{i}");
        fx.sglang.push_fault(Fault::RoutedExperts(*fault));
        let c = commitment(&fx, leg, &corr, 10, i % 2 == 0).await;
        assert!(c.get("routing").is_none(), "{fault:?}: {c}");
        assert_eq!(c["output_token_ids"].as_array().unwrap().len(), 10);
    }
    let text = scrape(&addr).await;
    assert_eq!(trace_sample(&text, "routing", "missing"), 1.0);
    assert_eq!(trace_sample(&text, "routing", "malformed"), 3.0);
    assert_eq!(trace_sample(&text, "routing", "rows"), 1.0);
    assert_eq!(trace_sample(&text, "routing", "attached"), 0.0);
    let log = m.log_text();
    assert!(
        log.contains("no routed_experts trace for this request"),
        "{log}"
    );
    assert!(!log.contains("panicked"), "{log}");
    // Operator text, not Rust debug output.
    for p in ["Some(", "None", "TraceText"] {
        assert!(!log.contains(p), "{p} in {log}");
    }
    // After a missing field the serve's flags are read again; a healthy reply then
    // carries the trace.
    let c = commitment(&fx, leg, "healthy", 10, false).await;
    assert_eq!(
        trace_of(&c, "routing").unwrap().decode().unwrap().ids,
        oracle(&fx, &c, false)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn routing_trace_off_never_asks() {
    let cfg = SglangConfig::default().with_routed_experts(true);
    let fx = Fixture::with_spec(&moe_spec(), 1, cfg).await;
    let (_m, addr) = miner_with_metrics(&fx, &[("ENGY_ROUTING_TRACE", "off")]).await;
    let leg = fx.gw.wait_legs(1, T).await.unwrap()[0].id;
    let c = commitment(&fx, leg, "c", 9, true).await;
    assert!(c.get("routing").is_none(), "{c}");
    for r in fx.sglang.generate_log() {
        assert!(
            r.request.get("return_routed_experts").is_none(),
            "{}",
            r.request
        );
        assert!(r.request.get("routed_experts_start_len").is_none());
    }
    let text = scrape(&addr).await;
    for outcome in ["attached", "not_offered", "missing", "malformed", "rows"] {
        assert_eq!(trace_sample(&text, "routing", outcome), 0.0, "{outcome}");
    }
    // A bad value is refused at start-up, naming the variable.
    let out = miner_cmd(&[("ENGY_ROUTING_TRACE", "maybe")], &["check"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("ENGY_ROUTING_TRACE"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_indexer_trace_when_asked_keeps_its_padding() {
    let spec = CheckpointSpec {
        indexer: Some(IndexerShape {
            layers: 4,
            index_topk: 24,
        }),
        ..moe_spec()
    };
    let cfg = SglangConfig::default()
        .with_routed_experts(true)
        .with_indexer_topk(true);
    let fx = Fixture::with_spec(&spec, 1, cfg).await;
    let _m = fx.miner(&[("TOPLOC_GEN_CHUNK", "4"), ("ENGY_INDEXER_TRACE", "on")]);
    let leg = fx.gw.wait_legs(1, T).await.unwrap()[0].id;
    let c = commitment(&fx, leg, "c", 10, false).await;
    let t = trace_of(&c, "indexer_topk").expect("indexer_topk");
    assert!(t.padded);
    assert_eq!((t.rows, t.layers, t.width), (positions(&c), 4, 24));
    let d = t.decode().unwrap();
    assert_eq!(d.ids, oracle(&fx, &c, true));
    // Position 0 has one key: [0, -1, -1, …]; the last position has more than 24.
    assert_eq!(d.at(0, 0).unwrap()[..3], [0, -1, -1]);
    assert!(d.at(t.rows - 1, 0).unwrap().iter().all(|k| *k >= 0));
    assert!(trace_of(&c, "routing").is_some());
    for r in fx.sglang.generate_log() {
        assert_eq!(r.request["return_indexer_topk"], true);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn check_says_which_traces_each_serve_offers() {
    for (on, want) in [
        (true, "offers routed experts"),
        (false, "does not offer routed experts"),
    ] {
        let cfg = SglangConfig::default().with_routed_experts(on);
        let fx = Fixture::with_spec(&moe_spec(), 1, cfg).await;
        let url = fx.sglang.url();
        let ckpt = fx.ckpt();
        let out = tokio::task::spawn_blocking(move || {
            miner_cmd(
                &[
                    ("SERVE_URL", url.as_str()),
                    ("CHECKPOINT", ckpt.to_str().unwrap()),
                    ("MINER_KEY", KEY),
                ],
                &["check"],
            )
            .output()
            .unwrap()
        })
        .await
        .unwrap();
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        let line = text
            .lines()
            .find(|l| l.contains("routing trace"))
            .unwrap_or_else(|| panic!("no routing trace line:\n{text}"));
        assert!(line.contains(want), "{line}");
        // Optional: never a FAIL of its own.
        assert!(!line.starts_with("FAIL"), "{line}");
    }
}
