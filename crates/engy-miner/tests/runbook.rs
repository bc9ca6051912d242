//! docs/MINER.md's commands and messages, run as written against the real binary and the
//! gateway and sglang doubles: the preflight order (`check` needs the serve up), `check |
//! head -1` (no panic, the verdict's exit code), the JSON fatal line's fields, `health`'s exit
//! codes, and the healthy log's messages.
mod common;

use std::process::Stdio;

use common::*;
use engy_devnet::sglang::synthetic::CheckpointSpec;
use engy_devnet::sglang::{RoutingShape, SglangConfig};
use serde_json::Value;

fn doc() -> String {
    std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../../docs/MINER.md")).unwrap()
}

/// `check` before the serve is up fails on `/get_model_info` with the fix (start the serve
/// first), exit 1; with the serve up it passes, exit 0: the order MINER.md "Docker" runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn check_fails_before_the_serve_is_up_and_passes_after() {
    let fx = Fixture::new(64, 1, SglangConfig::default()).await;
    let down = refused_addr();
    let (code, out) = fx.check(&format!("http://{}", down.addr()), &[]).await;
    assert_eq!(code, Some(1), "{out}");
    assert!(
        out.lines()
            .any(|l| l.starts_with("FAIL serve") && l.contains("/get_model_info")),
        "{out}"
    );
    assert!(out.contains("fix: start the sglang serve"), "{out}");
    let (code, out) = fx.check(&fx.sglang.url(), &[]).await;
    assert_eq!(code, Some(0), "{out}");
    assert!(out.contains("all checks passed"), "{out}");
    // and the runbook says so, in that order
    let d = doc();
    let docker = &d[d.find("### Docker").unwrap()..];
    let wait = docker
        .find("up -d --wait sglang")
        .expect("MINER.md starts the serve first");
    let check = docker.find("run --rm --no-deps miner check").unwrap();
    let up = docker[check..].find("miner.yml up -d\n").map(|i| i + check);
    assert!(
        wait < check && up.is_some(),
        "MINER.md Docker: serve, check, up"
    );
}

/// A reader that is gone before `check` writes (as `| head -1` is after its line): no panic
/// ("failed printing to stdout", exit 101), and the exit code is still the checks' verdict.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn check_and_health_survive_a_closed_stdout() {
    let fx = Fixture::new(64, 1, SglangConfig::default()).await;
    let down = refused_addr();
    for (serve, want) in [(fx.sglang.url(), 0), (format!("http://{}", down.addr()), 1)] {
        for format in ["text", "json"] {
            let (reader, writer) = std::io::pipe().unwrap();
            drop(reader);
            let (gw, ckpt) = (fx.gw.url(), fx.ckpt());
            let mut cmd = miner_cmd(
                &[
                    ("GW", gw.as_str()),
                    ("MINER_KEY", KEY),
                    ("CHECKPOINT", ckpt.to_str().unwrap()),
                    ("SERVE_URL", serve.as_str()),
                    ("ENGY_LOG_FORMAT", format),
                ],
                &["check"],
            );
            cmd.stdout(writer).stderr(Stdio::piped());
            let out = tokio::process::Command::from(cmd).output().await.unwrap();
            let err = String::from_utf8_lossy(&out.stderr);
            assert_eq!(out.status.code(), Some(want), "{serve} {format}: {err}");
            assert!(!err.contains("panicked"), "{err}");
        }
    }
    let (reader, writer) = std::io::pipe().unwrap();
    drop(reader);
    let mut cmd = miner_cmd(
        &[("ENGY_METRICS_ADDR", &down.addr().to_string())],
        &["health"],
    );
    cmd.stdout(writer).stderr(Stdio::piped());
    let out = cmd.output().unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(!String::from_utf8_lossy(&out.stderr).contains("panicked"));
}

/// `health` exits 0 or 1 only (Docker reserves 2 for a HEALTHCHECK): 1 with the address
/// unset, as one fatal line on stderr naming ENGY_METRICS_ADDR.
#[test]
fn health_without_an_address_exits_1() {
    for format in ["text", "json"] {
        let out = miner_cmd(&[("ENGY_LOG_FORMAT", format)], &["health"])
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{format}: {err}");
        assert!(err.contains("ENGY_METRICS_ADDR"), "{err}");
        if format == "json" {
            let v: Value = serde_json::from_str(err.trim()).unwrap();
            assert_eq!(v["exit_code"], 1, "{v}");
        }
    }
}

/// The JSON fatal line has exactly the fields MINER.md "What healthy logs look like" names.
#[test]
fn the_json_fatal_line_has_the_documented_fields() {
    let out = miner_cmd(
        &[
            ("ENGY_LOG_FORMAT", "json"),
            ("GW", "wss://gw.example/gw"),
            ("MINER_KEY", KEY),
            ("CHECKPOINT", "/nonexistent"),
            ("MAX_INFLIGHT", "1"),
        ],
        &[],
    )
    .output()
    .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    let lines: Vec<Value> = err
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}")))
        .collect();
    assert_eq!(lines.len(), 1, "{err}");
    let line = lines[0].as_object().unwrap();
    let mut keys: Vec<&str> = line.keys().map(String::as_str).collect();
    keys.sort_unstable();
    assert_eq!(
        keys,
        ["exit_code", "level", "message", "target", "timestamp"]
    );
    assert_eq!(line["level"], "ERROR");
    assert_eq!(line["target"], "engy-miner");
    assert_eq!(line["exit_code"], 2);
    assert!(line["message"].as_str().unwrap().contains("MAX_INFLIGHT"));
    // the runbook names the same fields, and no other
    let d = doc();
    let documented =
        r#"`{"timestamp", "level": "ERROR", "target": "engy-miner", "message", "exit_code"}`"#;
    assert!(
        d.contains(documented),
        "MINER.md does not name the fatal line's fields"
    );
    assert!(
        !d.contains(r#""fatal""#),
        "MINER.md names a field the binary does not write"
    );
}

/// Each message of MINER.md's healthy-log example is one the miner logs, serving a request.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_healthy_log_example_is_what_the_miner_logs() {
    let d = doc();
    let section = &d[d.find("## 5. What healthy logs look like").unwrap()..];
    let block = &section[section.find("```text\n").unwrap() + 8..];
    let block = &block[..block.find("```").unwrap()];
    let messages: Vec<String> = block
        .lines()
        .filter_map(|l| l.strip_prefix("INFO "))
        .map(|l| {
            l.split(' ')
                // a field is `key=value` with a lowercase key; `(ENGY_CELLS=off):` is message
                .take_while(|w| {
                    !w.split_once('=').is_some_and(|(k, _)| {
                        !k.is_empty() && k.chars().all(|c| c.is_ascii_lowercase() || c == '_')
                    })
                })
                .collect::<Vec<_>>()
                .join(" ")
        })
        .collect();
    assert!(messages.len() >= 8, "{messages:?}");
    // an MoE checkpoint and a serve with the routing trace, as the example's Qwen3.6
    let spec = CheckpointSpec {
        hidden_size: 64,
        vocab_size: 500,
        routing: Some(RoutingShape {
            num_hidden_layers: 4,
            num_experts_per_tok: 2,
            num_experts: 16,
            first_k_dense: 1,
        }),
        indexer: None,
    };
    let cfg = SglangConfig {
        routed_experts: true,
        ..SglangConfig::default()
    };
    let fx = Fixture::with_spec(&spec, 1, cfg).await;
    let m = fx.miner(&[("ENGY_LOG_FORMAT", "json"), ("HW_GPUS", "1x test GPU")]);
    let leg = fx.gw.wait_legs(1, T).await.unwrap()[0].id;
    assert!(fx.gw.admit(leg));
    assert!(fx.gw.serve(leg, "h", chat("Hello there.", 5), false));
    assert_ok(&fx.gw.wait_response("h", T).await.unwrap());
    for msg in &messages {
        let needle = serde_json::to_string(msg).unwrap();
        let log = wait_log(&m, &format!("\"message\":{needle}")).await;
        assert!(log.contains(&needle), "{msg}");
    }
    let log = m.log_text();
    assert!(
        log.contains("1x test GPU"),
        "HW_GPUS reaches HELLO's hw: {log}"
    );
    assert!(!log.contains("?x GPU"), "{log}");
}

/// One miner per node across users: a lock file another user made (a miner run as root,
/// then one in the container as 65532, both on the host's /tmp/engy_miner.singleton) is
/// still taken, read-only: the second miner sees the first and exits 0 instead of failing
/// to open it. Needs root (to run the miner as another uid); says so and skips otherwise.
#[test]
fn a_lock_file_of_another_user_still_keeps_one_miner_per_node() {
    use std::os::unix::fs::PermissionsExt;
    use std::os::unix::process::CommandExt;
    let root = std::fs::metadata("/proc/self")
        .map(|m| std::os::unix::fs::MetadataExt::uid(&m) == 0)
        .unwrap_or(false);
    if !root {
        println!("skipped: not root, cannot run the miner as another uid");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let lock = dir.path().join("engy_miner.singleton");
    let held = std::fs::File::create(&lock).unwrap();
    std::fs::set_permissions(&lock, std::fs::Permissions::from_mode(0o644)).unwrap();
    let mut held = fd_lock::RwLock::new(held);
    let _guard = held.try_write().unwrap();
    let copy = dir.path().join("engy-miner");
    std::fs::copy(miner_bin(), &copy).unwrap();
    let out = std::process::Command::new(&copy)
        .env_clear()
        .env("GW", "ws://127.0.0.1:9/gw")
        .env("MINER_KEY", KEY)
        .env("CHECKPOINT", "/nonexistent")
        .env("ENGY_MINER_LOCK", &lock)
        .uid(65532)
        .gid(65532)
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{err}");
    assert!(
        err.contains("another engy-miner instance is running"),
        "{err}"
    );
}
