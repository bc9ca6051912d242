//! What an operator meets first, through the real binary: configuration refusals printed
//! once and without colour codes, a GW the miner cannot use, error causes in `check`, and
//! SIGTERM during start-up.

mod common;

use std::process::{Command, Stdio};

use common::*;
use engy_devnet::sglang::SglangConfig;

#[test]
fn configuration_errors_are_printed_once_without_colour_codes() {
    let out = miner_cmd(&[], &[]).output().unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(err.matches("GW is not set").count(), 1, "{err}");
    assert!(
        !err.contains('\u{1b}'),
        "ANSI escapes in a non-terminal log: {err:?}"
    );
}

#[test]
fn a_gw_the_miner_cannot_extend_is_refused_without_echoing_it() {
    let dir = tempfile::tempdir().unwrap();
    let lock = dir.path().join("lock");
    for (gw, expect) in [
        ("wss://gw.example/gw?token=s3cr3t-token", "query"),
        ("wss://gw.example/gw#s3cr3t-token", "fragment"),
        ("wss://user:s3cr3t-token@gw.example/gw", "credentials"),
        ("https://gw.example/gw", "ws:// or wss://"),
        ("gw.example:443", "URL"),
    ] {
        let out = miner_cmd(
            &[
                ("GW", gw),
                ("MINER_KEY", KEY),
                ("CHECKPOINT", "/nonexistent"),
                ("ENGY_MINER_LOCK", lock.to_str().unwrap()),
            ],
            &[],
        )
        .output()
        .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{gw}: {err}");
        assert!(err.contains(expect), "{gw}: {err}");
        assert!(!err.contains("s3cr3t-token"), "{gw}: {err}");
    }
    // A path (the documented form) and a trailing slash pass this check (and then the
    // missing checkpoint is refused, exit 2).
    for gw in ["wss://gw.example/gw", "ws://127.0.0.1:9/"] {
        let out = miner_cmd(
            &[
                ("GW", gw),
                ("MINER_KEY", KEY),
                ("CHECKPOINT", "/nonexistent"),
                ("ENGY_MINER_LOCK", lock.to_str().unwrap()),
            ],
            &[],
        )
        .output()
        .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{gw}: {err}");
        assert!(err.contains("CHECKPOINT"), "{gw}: {err}");
        assert!(err.contains("/nonexistent/tokenizer.json"), "{gw}: {err}");
    }
}

#[tokio::test]
async fn check_names_the_cause_of_an_unreachable_serve() {
    let fx = Fixture::new(64, 1, SglangConfig::default()).await;
    let closed = refused_addr();
    let (code, stdout) = fx.check(&format!("http://{}", closed.addr()), &[]).await;
    assert_eq!(code, Some(1), "{stdout}");
    let line = stdout
        .lines()
        .find(|l| l.starts_with("FAIL") && l.contains("/get_model_info"))
        .unwrap_or_else(|| panic!("{stdout}"));
    assert!(line.contains("Connection refused"), "{line}");
    assert!(!stdout.contains(KEY));
}

#[tokio::test]
async fn sigterm_during_start_up_exits_zero() {
    // A gateway that accepts TCP and never answers: the /meta probe hangs (5 s timeout).
    let fx = Fixture::new(64, 1, SglangConfig::default()).await;
    let gw_listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let gw = format!("ws://{}", gw_listener.local_addr().unwrap());
    let ckpt = fx.ckpt();
    let serve = fx.sglang.url();
    let lock = fx.lock();
    let log = fx.dir.path().join("startup.log");
    let mut child = miner_cmd(
        &[
            ("GW", gw.as_str()),
            ("MINER_KEY", KEY),
            ("CHECKPOINT", ckpt.to_str().unwrap()),
            ("SERVE_URL", serve.as_str()),
            ("ENGY_MINER_LOCK", lock.to_str().unwrap()),
            ("ENGY_DRAIN_S", "1"),
        ],
        &[],
    )
    .stdout(Stdio::null())
    .stderr(std::fs::File::create(&log).unwrap())
    .spawn()
    .unwrap();
    // /meta is being asked: start-up is in progress.
    let (_held, _) = gw_listener.accept().await.unwrap();
    let kill = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(kill.success());
    let status = tokio::task::spawn_blocking(move || child.wait().unwrap())
        .await
        .unwrap();
    let text = std::fs::read_to_string(&log).unwrap();
    assert_eq!(status.code(), Some(0), "{text}");
    assert!(text.contains("stopped"), "{text}");
}

#[tokio::test]
async fn an_unreachable_serve_is_one_start_up_warning_and_the_miner_runs() {
    use tokio::io::{AsyncBufReadExt, BufReader};
    let fx = Fixture::new(64, 1, SglangConfig::default()).await;
    let closed = refused_addr();
    let dead = format!("http://{}", closed.addr());
    let good = fx.sglang.url();
    let serves = format!("{good},{dead}");
    let (ckpt, gw, lock) = (fx.ckpt(), fx.gw.url(), fx.lock());
    let mut cmd = miner_cmd(
        &[
            ("GW", gw.as_str()),
            ("MINER_KEY", KEY),
            ("CHECKPOINT", ckpt.to_str().unwrap()),
            ("SERVE_URL", serves.as_str()),
            ("ENGY_MINER_LOCK", lock.to_str().unwrap()),
            ("ENGY_DRAIN_S", "1"),
        ],
        &[],
    );
    cmd.stdout(Stdio::null()).stderr(Stdio::piped());
    let mut child = tokio::process::Command::from(cmd)
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stderr.take().unwrap()).lines();
    let mut seen = Vec::new();
    let (mut warned, mut dialing) = (false, false);
    tokio::time::timeout(std::time::Duration::from_secs(60), async {
        while !(warned && dialing) {
            let Some(l) = lines.next_line().await.unwrap() else {
                break;
            };
            warned |= l.contains("does not answer /get_model_info");
            dialing |= l.contains("dialing the gateway");
            seen.push(l);
        }
    })
    .await
    .unwrap_or_else(|_| panic!("no warning or no dial: {seen:#?}"));
    let warns: Vec<&String> = seen
        .iter()
        .filter(|l| l.contains("does not answer /get_model_info"))
        .collect();
    assert_eq!(warns.len(), 1, "{seen:#?}");
    assert!(warns[0].contains("WARN"), "{seen:#?}");
    assert!(warns[0].contains(&dead), "{seen:#?}");
    assert!(warns[0].contains("Connection refused"), "{seen:#?}");
    assert!(warns[0].contains("fix:"), "{seen:#?}");
    assert!(dialing, "the miner still starts: {seen:#?}");
    // still running; a SIGTERM stops it cleanly
    assert!(child.try_wait().unwrap().is_none(), "{seen:#?}");
    let kill = Command::new("kill")
        .args(["-TERM", &child.id().unwrap().to_string()])
        .status()
        .unwrap();
    assert!(kill.success());
    let status = child.wait().await.unwrap();
    assert_eq!(status.code(), Some(0), "{seen:#?}");
}

#[test]
fn settings_the_miner_cannot_run_with_are_refused_naming_the_variable() {
    let dir = tempfile::tempdir().unwrap();
    let lock = dir.path().join("lock");
    for (var, value) in [
        ("MAX_TOKENS", "0"),
        ("MAX_OUTPUT_TOKENS", "0"),
        ("SERVE_HTTP_S", "0"),
        ("MAX_REQUEST_S", "nan"),
        ("MAX_REQUEST_S", "-5"),
        ("ENGY_MAX_RESPONSE_MB", "0"),
        ("ENGY_HEARTBEAT_S", "0"),
        ("ENGY_HEARTBEAT_S", "-1"),
        ("ENGY_HEARTBEAT_S", "90"),
        ("MAX_INFLIGHT", "7"),
        ("TOPLOC_TOPK", "0"),
        ("STREAM_FLUSH_S", "-0.1"),
        ("ENGY_CELLS_RETAIN_MB", "0"),
        ("ENGY_CELLS_RETAIN_S", "0"),
    ] {
        let out = miner_cmd(
            &[
                ("GW", "ws://127.0.0.1:9"),
                ("MINER_KEY", KEY),
                ("CHECKPOINT", "/nonexistent"),
                ("ENGY_MINER_LOCK", lock.to_str().unwrap()),
                (var, value),
            ],
            &[],
        )
        .output()
        .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{var}={value}: {err}");
        assert!(err.contains(var), "{var}={value}: {err}");
        assert_eq!(err.lines().count(), 1, "{var}={value}: one line: {err}");
        assert!(!err.contains(KEY));
    }
}

#[test]
fn cells_on_without_a_spool_is_refused_naming_engy_cells_spool() {
    let dir = tempfile::tempdir().unwrap();
    let lock = dir.path().join("lock");
    let out = miner_cmd(
        &[
            ("GW", "ws://127.0.0.1:9"),
            ("MINER_KEY", KEY),
            ("CHECKPOINT", "/nonexistent"),
            ("ENGY_MINER_LOCK", lock.to_str().unwrap()),
            ("ENGY_CELLS", "on"),
        ],
        &[],
    )
    .output()
    .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains("ENGY_CELLS_SPOOL"), "{err}");
    assert_eq!(err.lines().count(), 1, "{err}");
}

#[tokio::test]
async fn a_checkpoint_that_cannot_serve_is_refused_at_start_up() {
    let fx = Fixture::new(64, 1, SglangConfig::default()).await;
    let ckpt = fx.ckpt();
    let (gw, serve, lock) = (fx.gw.url(), fx.sglang.url(), fx.lock());
    let run = |what: &str| {
        let out = miner_cmd(
            &[
                ("GW", gw.as_str()),
                ("MINER_KEY", KEY),
                ("CHECKPOINT", ckpt.to_str().unwrap()),
                ("SERVE_URL", serve.as_str()),
                ("ENGY_MINER_LOCK", lock.to_str().unwrap()),
            ],
            &[],
        )
        .output()
        .unwrap();
        let err = String::from_utf8_lossy(&out.stderr).into_owned();
        assert_eq!(out.status.code(), Some(2), "{what}: {err}");
        assert!(err.contains("CHECKPOINT"), "{what}: {err}");
        err
    };
    // A template that raises on a plain system + user conversation.
    let tpl = ckpt.join("chat_template.jinja");
    std::fs::write(&tpl, "{{ raise_exception('only tool calls here') }}").unwrap();
    let err = run("template");
    assert!(err.contains("only tool calls here"), "{err}");
    std::fs::remove_file(&tpl).unwrap();
    // config.json without hidden_size, then unreadable.
    let cfg = ckpt.join("config.json");
    let good = std::fs::read(&cfg).unwrap();
    std::fs::write(&cfg, br#"{"model_type": "qwen3_moe"}"#).unwrap();
    assert!(run("no hidden_size").contains("hidden_size"));
    std::fs::write(&cfg, b"{not json").unwrap();
    assert!(run("not json").contains("not JSON"));
    std::fs::remove_file(&cfg).unwrap();
    assert!(run("missing").contains("config.json"));
    std::fs::write(&cfg, good).unwrap();
    assert!(fx.gw.conns().is_empty(), "no leg was dialed");
}

#[tokio::test]
async fn check_fails_when_miner_key_is_unset() {
    let fx = Fixture::new(64, 1, SglangConfig::default()).await;
    let (ckpt, gw, serve) = (fx.ckpt(), fx.gw.url(), fx.sglang.url());
    let run = |vars: &[(&str, &str)]| {
        let mut cmd = miner_cmd(vars, &["check"]);
        cmd.stdin(Stdio::null());
        tokio::process::Command::from(cmd).output()
    };
    let base = [
        ("GW", gw.as_str()),
        ("CHECKPOINT", ckpt.to_str().unwrap()),
        ("SERVE_URL", serve.as_str()),
    ];
    let out = run(&base).await.unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(1), "{stdout}");
    assert!(
        stdout.lines().any(|l| l.starts_with("FAIL MINER_KEY")),
        "{stdout}"
    );
    let mut with_key = base.to_vec();
    with_key.push(("MINER_KEY", KEY));
    let out = run(&with_key).await.unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        stdout.lines().any(|l| l.starts_with("ok   MINER_KEY")),
        "{stdout}"
    );
    assert!(!stdout.contains(KEY), "{stdout}");
}

/// Rust `Debug` renderings an operator must never read (issue 14 item 7).
fn debug_output_in(text: &str) -> Option<&str> {
    ["Some(", "None", "CloseFrame", "Utf8Bytes", "[\"", "\\\""]
        .into_iter()
        .find(|p| text.contains(p))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn operator_text_has_no_rust_debug_output() {
    use engy_devnet::sglang::Fault;
    let fx = Fixture::new(64, 1, SglangConfig::default()).await;

    // `check` against a serve whose last row is one value short.
    fx.sglang.push_fault(Fault::RaggedRowWidth);
    let (code, stdout) = fx.check(&fx.sglang.url(), &[]).await;
    assert_eq!(code, Some(1), "{stdout}");
    let line = stdout
        .lines()
        .find(|l| l.starts_with("FAIL") && l.contains("hidden states"))
        .unwrap_or_else(|| panic!("{stdout}"));
    assert!(
        line.contains("expected 4 rows of 64 (config.json hidden_size); row 3 has 63 values"),
        "{line}"
    );
    assert_eq!(debug_output_in(&stdout), None, "{stdout}");

    // The daemon: start-up lines, a gateway close frame, a deny.
    let m = fx.miner(&[]);
    let first = fx.gw.wait_legs(1, T).await.unwrap()[0].id;
    assert!(fx.gw.deny(first, "maintenance window"));
    assert!(fx.gw.close(first, 1001, "restarting"));
    next_leg(&fx.gw, first).await; // the miner re-dials after the close
    let log = m.log_text();
    assert!(
        log.contains(r#"gateway closed the leg (code 1001, going away: "restarting")"#),
        "{log}"
    );
    assert!(log.contains("reason=maintenance window"), "{log}");
    let start = log
        .lines()
        .find(|l| l.contains("dialing the gateway"))
        .unwrap_or_else(|| panic!("{log}"));
    assert!(
        start.contains(&format!("serves={}", fx.sglang.url())),
        "{start}"
    );
    assert!(start.contains("legs=0 "), "{start}");
    assert_eq!(debug_output_in(&log), None, "{log}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_misalignment_probe_uses_the_checkpoints_own_token_ids() {
    use engy_devnet::sglang::Fault;
    let fx = Fixture::new(64, 1, SglangConfig::default()).await;
    let m = fx.miner(&[]);
    let leg = fx.gw.wait_legs(1, T).await.unwrap()[0].id;
    fx.sglang.push_fault(Fault::MissingDecodeRow);
    assert!(fx.gw.serve(leg, "short", chat("Hello there.", 9), false));
    let resp = fx.gw.wait_response("short", T).await.unwrap();
    assert!(
        resp["error"].as_str().unwrap().contains("misaligned"),
        "{resp}"
    );

    // The full message is in the log (the gateway's copy is cut to 300 characters).
    let log = m.log_text();
    let line = log
        .lines()
        .find(|l| l.contains("misaligned") && l.contains("curl -s "))
        .unwrap_or_else(|| panic!("{log}"));
    let body = line
        .split(" -d '")
        .nth(1)
        .and_then(|rest| rest.split("' | head").next())
        .unwrap_or_else(|| panic!("no -d body in {line}"));
    let body: serde_json::Value = serde_json::from_str(body).unwrap();
    let ids: Vec<u32> = serde_json::from_value(body["input_ids"].clone()).unwrap();
    let tok = tokenizers::Tokenizer::from_file(fx.ckpt().join("tokenizer.json")).unwrap();
    let want = tok
        .encode("Hello, world", false)
        .unwrap()
        .get_ids()
        .to_vec();
    assert!(!want.is_empty());
    assert_eq!(ids, want, "the probe's ids are the checkpoint tokenizer's");

    // Pasted against this serve, the probe answers with hidden states.
    let reply: serde_json::Value = reqwest::Client::new()
        .post(format!("{}/generate", fx.sglang.url()))
        .json(&body)
        .send()
        .await
        .unwrap()
        .error_for_status()
        .unwrap()
        .json()
        .await
        .unwrap();
    let hs = reply["meta_info"]["hidden_states"].as_array().unwrap();
    assert!(!hs.is_empty(), "{reply}");
}
