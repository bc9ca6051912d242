//! Metrics, JSON logs and the health check, through the real binary (issue 14 item 8):
//! `/metrics` scraped on 127.0.0.1, JSON log lines parsed, `engy-miner health` run.

mod common;

use std::process::{Command, Stdio};

use common::*;
use engy_devnet::sglang::{Fault, SglangConfig};
use serde_json::Value;

fn health(addr: &str) -> (Option<i32>, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_engy-miner"))
        .arg("health")
        .env_clear()
        .env("ENGY_METRICS_ADDR", addr)
        .stdin(Stdio::null())
        .output()
        .unwrap();
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_count_requests_by_outcome_legs_and_reconnects() {
    let fx = Fixture::new(64, 1, SglangConfig::default()).await;
    let (_m, addr) = miner_with_metrics(&fx, &[]).await;
    let leg = fx.gw.wait_legs(1, T).await.unwrap()[0].id;

    let text = scrape(&addr).await;
    assert_eq!(sample(&text, "engy_miner_legs_connected"), 1.0);
    assert_eq!(
        sample(&text, r#"engy_miner_requests_total{outcome="completed"}"#),
        0.0
    );
    assert_eq!(sample(&text, "engy_miner_reconnects_total"), 0.0);
    let (code, out) = health(&addr);
    assert_eq!(code, Some(0), "{out}");
    assert!(out.starts_with("healthy: 1 gateway leg"), "{out}");

    // One completion, one failure.
    assert!(fx.gw.serve(leg, "ok", chat("Hello there.", 9), false));
    assert_ok(&fx.gw.wait_response("ok", T).await.unwrap());
    fx.sglang.push_fault(Fault::Status(503));
    assert!(fx.gw.serve(leg, "bad", chat("Hello there.", 9), true));
    let bad = fx.gw.wait_response("bad", T).await.unwrap();
    assert!(bad["error"].is_string(), "{bad}");
    let text = scrape(&addr).await;
    for (outcome, n) in [
        ("completed", 1.0),
        ("failed", 1.0),
        ("cancelled", 0.0),
        ("aborted", 0.0),
        ("refused", 0.0),
    ] {
        let series = format!(r#"engy_miner_requests_total{{outcome="{outcome}"}}"#);
        assert_eq!(sample(&text, &series), n, "{series}");
    }
    assert_eq!(sample(&text, "engy_miner_serve_seconds_count"), 1.0);
    assert!(sample(&text, "engy_miner_serve_seconds_sum") > 0.0);
    assert_eq!(sample(&text, "engy_miner_proof_build_seconds_count"), 1.0);
    assert!(text.contains("engy_miner_inflight "), "{text}");
    assert!(text.ends_with("# EOF\n"), "OpenMetrics text");

    // The gateway drops the leg: the miner re-dials.
    assert!(fx.gw.drop_conn(leg));
    wait_redialed(&fx.gw, leg).await;
    let text = scrape(&addr).await;
    assert_eq!(sample(&text, "engy_miner_reconnects_total"), 1.0);
    assert_eq!(sample(&text, "engy_miner_legs_connected"), 1.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn json_logs_are_one_object_per_line() {
    let fx = Fixture::new(64, 1, SglangConfig::default()).await;
    let m = fx.miner(&[("ENGY_LOG_FORMAT", "json")]);
    let leg = fx.gw.wait_legs(1, T).await.unwrap()[0].id;
    assert!(fx.gw.serve(leg, "j", chat("Hello there.", 5), false));
    assert_ok(&fx.gw.wait_response("j", T).await.unwrap());
    let log = m.log_text();
    let lines: Vec<Value> = log
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON ({e}): {l}")))
        .collect();
    assert!(lines.len() >= 3, "{log}");
    for l in &lines {
        for k in ["timestamp", "level", "target", "message"] {
            assert!(l.get(k).is_some(), "{k} missing in {l}");
        }
    }
    let hello = lines
        .iter()
        .find(|l| l["message"] == "HELLO sent; awaiting work")
        .unwrap_or_else(|| panic!("{log}"));
    assert_eq!(hello["leg"], "gw0");
    assert_eq!(hello["level"], "INFO");
    assert!(
        lines
            .iter()
            .any(|l| l["message"] == "serve" && l["corr_id"] == "j"),
        "{log}"
    );
    assert!(!log.contains(KEY));
}

#[tokio::test]
async fn bad_metrics_and_log_settings_are_refused_naming_the_variable() {
    let fx = Fixture::new(64, 1, SglangConfig::default()).await;
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let taken = taken.local_addr().unwrap().to_string();
    for (var, value, expect) in [
        ("ENGY_METRICS_ADDR", "localhost-9464", "ENGY_METRICS_ADDR"),
        ("ENGY_METRICS_ADDR", taken.as_str(), "ENGY_METRICS_ADDR"),
        ("RUST_LOG", "garbage===", "RUST_LOG"),
        // the variable the operator set, not the flag clap knows (issue 21 item 5)
        (
            "ENGY_LOG_FORMAT",
            "xml",
            "invalid value 'xml' for ENGY_LOG_FORMAT",
        ),
    ] {
        let mut m = fx.miner(&[(var, value)]);
        let status = m.child.wait().unwrap();
        let log = m.log_text();
        assert_eq!(status.code(), Some(2), "{var}={value}: {log}");
        assert!(log.contains(expect), "{var}={value}: {log}");
    }
    assert!(fx.gw.conns().is_empty(), "no leg was dialed");
    // health without an address cannot work (exit 1: Docker reserves 2 for a HEALTHCHECK);
    // with a dead one it is unhealthy.
    let out = Command::new(env!("CARGO_BIN_EXE_engy-miner"))
        .arg("health")
        .env_clear()
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("ENGY_METRICS_ADDR"));
    let closed = refused_addr();
    let (code, out) = health(&closed.addr().to_string());
    assert_eq!(code, Some(1), "{out}");
    assert!(out.starts_with("unhealthy:"), "{out}");
}
