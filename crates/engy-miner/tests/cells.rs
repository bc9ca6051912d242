//! The miner side of the sampled cell audit (docs/PROTOCOL.md §10, issue 23 B2) through the
//! real `engy-miner` binary, the sglang double over the real devnet model with the
//! engy_cells hooks (`SglangConfig::cells_spool`) and the gateway double, on 127.0.0.1:
//! the commitment carries the root of the cells the commit pass spooled; the gateway's
//! challenge is answered with openings that verify against that root and against the
//! weights; a serve without the hooks gives no cells and the request still succeeds; a
//! request evicted from the retention store is answered `unknown_request`.
mod common;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use base64::Engine as _;
use common::*;
use engy_core::cells::{select, verify_opening, CellPath, CellShape};
use engy_core::commit::spec::Hex;
use engy_devnet::devnet_backend::CandleBackend;
use engy_devnet::gateway::{GatewayConfig, GatewayDouble};
use engy_devnet::sglang::{SglangConfig, SglangDouble};
use engy_model::cells::{verify_cell, CellPolicy};
use engy_model::{gen_model, GenConfig, Model, Precision};
use serde_json::{json, Value};

/// A fixture over a generated two-layer MoE devnet checkpoint (layer 1 is MoE) served by
/// the candle backend; `hooks`: the serve was started with the engy_cells hooks writing to
/// `<dir>/spool` (and `--disable-radix-cache`, as the hook package requires).
async fn moe_fixture(hooks: bool) -> (Fixture, PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let cfg = GenConfig {
        num_hidden_layers: 2,
        corpus_docs: 60,
        ..GenConfig::default()
    };
    gen_model(&dir.path().join("ckpt"), 7, &cfg).unwrap();
    let spool = dir.path().join("spool");
    let backend = CandleBackend::open(&dir.path().join("ckpt"), Precision::Bf16).unwrap();
    let mut scfg = SglangConfig {
        radix_cache: false,
        ..SglangConfig::default()
    };
    if hooks {
        scfg = scfg.with_cells_spool(Some(spool.clone()));
    } else {
        std::fs::create_dir_all(&spool).unwrap();
    }
    let sglang = SglangDouble::start(Arc::new(backend), scfg).await.unwrap();
    let gw = GatewayDouble::start(GatewayConfig::default())
        .await
        .unwrap();
    (Fixture { dir, sglang, gw }, spool)
}

fn request(id: &str, max_tokens: u64) -> Value {
    let mut r = chat("Tell me about the sea.", max_tokens);
    r["engy_request_id"] = json!(id);
    r
}

/// `engy_miner_cells_total{outcome}`.
fn cells_total(text: &str, outcome: &str) -> f64 {
    sample(
        text,
        &format!(r#"engy_miner_cells_total{{outcome="{outcome}"}}"#),
    )
}

/// `engy_miner_cells_openings_total{outcome}`.
fn openings_total(text: &str, outcome: &str) -> f64 {
    sample(
        text,
        &format!(r#"engy_miner_cells_openings_total{{outcome="{outcome}"}}"#),
    )
}

fn ids(v: &Value) -> Vec<u32> {
    serde_json::from_value(v.clone()).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn committed_cells_open_and_verify_against_the_root_and_the_weights() {
    let (fx, spool) = moe_fixture(true).await;
    let (_m, addr) = miner_with_metrics(
        &fx,
        &[
            ("ENGY_CELLS", "on"),
            ("ENGY_CELLS_SPOOL", spool.to_str().unwrap()),
            ("TOPLOC_GEN_CHUNK", "5"),
        ],
    )
    .await;
    let leg = fx.gw.wait_legs(1, T).await.unwrap()[0].id;
    assert!(fx.gw.serve(leg, "c1", request("r-1", 12), false));
    let resp = fx.gw.wait_response("c1", T).await.expect("response");
    let (commitment, _) = assert_ok(&resp);
    assert_eq!(resp["request_id"], "r-1");
    let cells = commitment.get("cells").expect("commitment.cells");
    assert_eq!(cells["scheme"], "engy-cells/v2");
    let shape: CellShape = serde_json::from_value(cells["shape"].clone()).unwrap();
    let root: Hex = serde_json::from_value(cells["root"].clone()).unwrap();
    let mut seq = ids(&commitment["toploc"]["prompt_ids"]);
    seq.extend(ids(&commitment["output_token_ids"]));
    assert_eq!(
        shape.n_positions() as usize,
        seq.len(),
        "every position of prompt + output"
    );
    assert_eq!(
        shape.tokens_sha256(),
        &engy_core::cells::tokens_sha256(&seq),
        "the root binds the request's token ids"
    );
    assert_eq!(shape.layers(), &[1], "the MoE layer");
    // The commit pass was one prefill of exactly that sequence, max_new_tokens 1.
    let log = fx.sglang.generate_log();
    let pass = log.last().unwrap();
    assert_eq!(pass.input_ids, seq);
    assert_eq!(pass.request["sampling_params"]["max_new_tokens"], 1);

    let seed: [u8; 32] = std::array::from_fn(|i| (i * 7 + 3) as u8);
    let n = 8.min(shape.n_cells());
    assert!(fx.gw.open_cells(leg, json!("r-1"), seed, n));
    let answer = fx.gw.wait_cells(&json!("r-1"), 0, T).await.expect("cells");
    assert_eq!(answer["type"], "cells", "{answer}");
    assert_eq!(answer["root"], cells["root"]);
    let openings = answer["openings"].as_array().unwrap();
    let want = select(&seed, &root.0, shape.n_cells(), n).unwrap();
    let got: Vec<u64> = openings
        .iter()
        .map(|o| o["index"].as_u64().unwrap())
        .collect();
    assert_eq!(got, want, "the cells the challenge selects, in its order");
    let model = Model::load(&fx.ckpt(), Precision::Bf16).unwrap();
    for o in openings {
        let bytes = base64::engine::general_purpose::STANDARD
            .decode(o["cell"].as_str().unwrap())
            .unwrap();
        let path = CellPath {
            index: o["index"].as_u64().unwrap(),
            siblings: serde_json::from_value(o["path"].clone()).unwrap(),
        };
        let cell = verify_opening(&shape, &root.0, &bytes, &path).expect("opening");
        let check = verify_cell(&model, &cell, &CellPolicy::default()).unwrap();
        assert!(check.pass(), "{check:?}");
    }
    // A challenge for more cells than the request has is refused as such.
    assert!(fx
        .gw
        .open_cells(leg, json!("r-1"), seed, shape.n_cells() + 1));
    let bad = fx.gw.wait_cells(&json!("r-1"), 1, T).await.expect("answer");
    assert_eq!(
        (bad["type"].as_str(), bad["reason"].as_str()),
        (Some("cells_error"), Some("bad_challenge"))
    );
    let text = scrape(&addr).await;
    assert_eq!(cells_total(&text, "attached"), 1.0);
    assert_eq!(openings_total(&text, "ok"), 1.0);
    assert_eq!(openings_total(&text, "bad_challenge"), 1.0);
    assert_eq!(sample(&text, "engy_miner_cells_retained_requests"), 1.0);
    assert!(sample(&text, "engy_miner_cells_retained_bytes") > 0.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_serve_without_the_hooks_gives_no_cells_and_the_request_succeeds() {
    let (fx, spool) = moe_fixture(false).await;
    let (_m, addr) = miner_with_metrics(
        &fx,
        &[
            ("ENGY_CELLS", "on"),
            ("ENGY_CELLS_SPOOL", spool.to_str().unwrap()),
        ],
    )
    .await;
    let leg = fx.gw.wait_legs(1, T).await.unwrap()[0].id;
    assert!(fx.gw.serve(leg, "c1", request("r-1", 6), false));
    let resp = fx.gw.wait_response("c1", T).await.expect("response");
    let (commitment, _) = assert_ok(&resp);
    assert!(commitment.get("cells").is_none(), "{commitment}");
    assert!(
        fx.sglang
            .generate_log()
            .iter()
            .all(|r| r.request["sampling_params"]["max_new_tokens"] != 1
                || r.request["return_hidden_states"] == true),
        "no commit pass on a serve without the hooks"
    );
    assert!(fx.gw.open_cells(leg, json!("r-1"), [1; 32], 1));
    let answer = fx.gw.wait_cells(&json!("r-1"), 0, T).await.expect("answer");
    assert_eq!(answer["reason"], "unknown_request", "{answer}");
    let text = scrape(&addr).await;
    assert_eq!(cells_total(&text, "not_offered"), 1.0);
    assert_eq!(cells_total(&text, "attached"), 0.0);
    assert_eq!(openings_total(&text, "unknown_request"), 1.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cells_evicted_by_age_are_answered_unknown_request() {
    let (fx, spool) = moe_fixture(true).await;
    let (_m, addr) = miner_with_metrics(
        &fx,
        &[
            ("ENGY_CELLS", "on"),
            ("ENGY_CELLS_SPOOL", spool.to_str().unwrap()),
            ("ENGY_CELLS_RETAIN_S", "1"),
        ],
    )
    .await;
    let leg = fx.gw.wait_legs(1, T).await.unwrap()[0].id;
    assert!(fx.gw.serve(leg, "c1", request("r-1", 6), false));
    let resp = fx.gw.wait_response("c1", T).await.expect("response");
    assert!(assert_ok(&resp).0.get("cells").is_some());
    // The store's sweep evicts it once it is older than 1 s: wait for the metric to say so.
    let deadline = std::time::Instant::now() + T;
    loop {
        let text = scrape(&addr).await;
        if sample(&text, r#"engy_miner_cells_evictions_total{reason="age"}"#) >= 1.0 {
            assert_eq!(sample(&text, "engy_miner_cells_retained_requests"), 0.0);
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "no eviction by age:\n{text}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(fx.gw.open_cells(leg, json!("r-1"), [1; 32], 1));
    let answer = fx.gw.wait_cells(&json!("r-1"), 0, T).await.expect("answer");
    assert_eq!(answer["type"], "cells_error");
    assert_eq!(answer["reason"], "unknown_request", "{answer}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn check_reports_cells_the_spool_and_the_serves_hooks() {
    let (fx, spool) = moe_fixture(true).await;
    let (ckpt, gw, serve) = (fx.ckpt(), fx.gw.url(), fx.sglang.url());
    let check = |extra: Vec<(&'static str, String)>| {
        let mut vars: Vec<(&str, String)> = vec![
            ("GW", gw.clone()),
            ("MINER_KEY", KEY.to_string()),
            ("CHECKPOINT", ckpt.to_str().unwrap().to_string()),
            ("SERVE_URL", serve.clone()),
        ];
        vars.extend(extra);
        let vars: Vec<(&str, &str)> = vars.iter().map(|(k, v)| (*k, v.as_str())).collect();
        let cmd = miner_cmd(&vars, &["check"]);
        async move {
            let out = tokio::process::Command::from(cmd).output().await.unwrap();
            String::from_utf8_lossy(&out.stdout).into_owned()
        }
    };
    let off = check(vec![]).await;
    assert!(
        off.lines().any(|l| l.starts_with("ok   cells: off")),
        "{off}"
    );
    let on = check(vec![
        ("ENGY_CELLS", "on".into()),
        ("ENGY_CELLS_SPOOL", spool.to_str().unwrap().into()),
    ])
    .await;
    assert!(
        on.lines()
            .any(|l| l.starts_with("ok   cells: on: spool") && l.contains("writable")),
        "{on}"
    );
    assert!(
        on.lines()
            .any(|l| l.starts_with(&format!("ok   serve {serve} cells hooks"))),
        "{on}"
    );
    let missing = fx.dir.path().join("no-such-spool");
    let bad = check(vec![
        ("ENGY_CELLS", "on".into()),
        ("ENGY_CELLS_SPOOL", missing.to_str().unwrap().into()),
    ])
    .await;
    assert!(
        bad.lines()
            .any(|l| l.starts_with("FAIL cells: on, but the spool")),
        "{bad}"
    );
}
