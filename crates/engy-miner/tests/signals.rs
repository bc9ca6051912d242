//! Signals an operator can trust (issue 21), through the real binary: the build in
//! `--version`, HELLO, `/metrics` and `health`; settings that cannot work refused at start-up
//! naming the variable; every line written under `--log-format json` parsed by `jq`,
//! fatal start-up errors and `check`'s report included.

mod common;

use std::io::Write;
use std::path::Path;
use std::process::{Command, Output, Stdio};

use common::*;
use engy_devnet::sglang::SglangConfig;
use serde_json::Value;

/// `git rev-parse HEAD` of this source tree, as the build saw it (`None` without git, or
/// when the build was given ENGY_GIT_COMMIT).
fn source_commit() -> Option<String> {
    if let Some(c) = option_env!("ENGY_GIT_COMMIT") {
        return Some(c.trim().to_ascii_lowercase());
    }
    let out = Command::new("git")
        .args(["rev-parse", "HEAD"])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .ok()?;
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).trim().to_owned())
}

/// Every line of `text` is one JSON value, as `jq -R fromjson` reads it (the real jq; a
/// line that does not parse fails it). Returns the parsed lines.
fn jq_lines(text: &str) -> Vec<Value> {
    let mut child = Command::new("jq")
        .args(["-c", "-R", "fromjson"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("jq is needed (apt-get install jq; .ci/run installs it)");
    child
        .stdin
        .take()
        .unwrap()
        .write_all(text.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "jq refused a line: {}\n--- text ---\n{text}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// `cmd`'s output, or a panic naming `what` when it is still running after [`T`] (a miner
/// that started instead of refusing: killed, so the test fails rather than hangs).
fn bounded(mut cmd: Command, what: &str) -> Output {
    let mut child = cmd
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = std::time::Instant::now() + T;
    while child.try_wait().unwrap().is_none() {
        if std::time::Instant::now() > deadline {
            let _ = child.kill();
            let out = child.wait_with_output().unwrap();
            panic!(
                "{what}: still running after {T:?} (it started):\n{}",
                text(&out.stderr)
            );
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    child.wait_with_output().unwrap()
}

fn refused(out: &Output, what: &str) -> String {
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{what}: {err}");
    err
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_build_is_named_in_version_hello_metrics_and_health() {
    let out = miner_cmd(&[], &["--version"]).output().unwrap();
    assert!(out.status.success());
    let version = text(&out.stdout);
    let commit = source_commit().unwrap_or_else(|| "unknown".into());
    let want = format!(
        "engy-miner {} (commit {commit}, dirty=",
        env!("CARGO_PKG_VERSION")
    );
    assert!(version.starts_with(&want), "{version:?} vs {want:?}");
    let dirty = version
        .trim()
        .strip_prefix(&want)
        .and_then(|r| r.strip_suffix(')'))
        .unwrap_or_else(|| panic!("{version}"))
        .to_owned();
    assert!(
        matches!(dirty.as_str(), "true" | "false" | "unknown"),
        "{version}"
    );

    let fx = Fixture::new(64, 1, SglangConfig::default()).await;
    let (_m, addr) = miner_with_metrics(&fx, &[]).await;
    let conn = fx.gw.wait_legs(1, T).await.unwrap().remove(0);
    let hello = conn.hello.unwrap();
    let v = &hello["versions"];
    assert_eq!(v["engy-miner"], env!("CARGO_PKG_VERSION"), "{hello}");
    assert_eq!(v["commit"], commit.as_str(), "{hello}");
    let dirty_json = match dirty.as_str() {
        "true" => Value::Bool(true),
        "false" => Value::Bool(false),
        _ => Value::Null,
    };
    assert_eq!(v["dirty"], dirty_json, "{hello}");

    let scrape = reqwest::get(format!("http://{addr}/metrics"))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let series = format!(
        r#"engy_miner_build_info{{version="{}",commit="{commit}",dirty="{dirty}"}} 1"#,
        env!("CARGO_PKG_VERSION")
    );
    assert!(scrape.lines().any(|l| l == series), "{series} in\n{scrape}");

    let addr2 = addr.clone();
    let health = tokio::task::spawn_blocking(move || {
        miner_cmd(&[("ENGY_METRICS_ADDR", addr2.as_str())], &["health"])
            .output()
            .unwrap()
    })
    .await
    .unwrap();
    assert!(health.status.success());
    let line = text(&health.stdout);
    assert!(
        line.contains(&format!(
            "engy-miner {} (commit {commit}",
            env!("CARGO_PKG_VERSION")
        )),
        "{line}"
    );
    let addr3 = addr.clone();
    let health = tokio::task::spawn_blocking(move || {
        miner_cmd(
            &[
                ("ENGY_METRICS_ADDR", addr3.as_str()),
                ("ENGY_LOG_FORMAT", "json"),
            ],
            &["health"],
        )
        .output()
        .unwrap()
    })
    .await
    .unwrap();
    let lines = jq_lines(&text(&health.stdout));
    assert_eq!(lines.len(), 1, "{lines:?}");
    assert_eq!(lines[0]["status"], "healthy");
    assert_eq!(lines[0]["running"]["commit"], commit.as_str());
}

/// The variables every refusal test starts from: a miner that would start but for `var`.
fn base(dir: &Path, fx: &Fixture) -> Vec<(String, String)> {
    vec![
        ("GW".into(), fx.gw.url()),
        ("MINER_KEY".into(), KEY.into()),
        ("CHECKPOINT".into(), fx.ckpt().display().to_string()),
        ("SERVE_URL".into(), fx.sglang.url()),
        (
            "ENGY_MINER_LOCK".into(),
            dir.join("lock").display().to_string(),
        ),
        ("MAX_INFLIGHT".into(), "8".into()),
    ]
}

fn with<'a>(base: &'a [(String, String)], extra: &[(&'a str, &'a str)]) -> Vec<(&'a str, &'a str)> {
    let mut v: Vec<(&str, &str)> = base
        .iter()
        .filter(|(k, _)| !extra.iter().any(|(e, _)| e == k))
        .map(|(k, v)| (k.as_str(), v.as_str()))
        .collect();
    v.extend_from_slice(extra);
    v
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn settings_that_cannot_work_are_refused_at_start_up_naming_the_variable() {
    let fx = Fixture::new(64, 1, SglangConfig::default()).await;
    let dir = tempfile::tempdir().unwrap();
    let base = base(dir.path(), &fx);
    for (var, value, names) in [
        ("MAX_INPUT_TOKENS", "0", "MAX_INPUT_TOKENS"),
        ("ENGY_GW_WORKERS", "0", "ENGY_GW_WORKERS"),
        // hidden_size 64 × TOPLOC_DBS 32 = 2048 values in a full proof batch
        ("TOPLOC_TOPK", "100000", "TOPLOC_TOPK"),
        ("TOPLOC_TOPK", "2049", "TOPLOC_TOPK"),
        // values that do not parse: the variable, not the flag clap knows
        ("MAX_INFLIGHT", "-1", "MAX_INFLIGHT"),
        ("TOPLOC_TOPK", "lots", "TOPLOC_TOPK"),
        ("ENGY_HEARTBEAT_S", "thirty", "ENGY_HEARTBEAT_S"),
    ] {
        let vars = with(&base, &[(var, value)]);
        let out = tokio::task::spawn_blocking({
            let vars: Vec<(String, String)> = vars
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect();
            move || {
                let vars: Vec<(&str, &str)> =
                    vars.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
                bounded(miner_cmd(&vars, &[]), &format!("{vars:?}"))
            }
        })
        .await
        .unwrap();
        let err = refused(&out, &format!("{var}={value}"));
        assert!(err.contains(names), "{var}={value}: {err}");
        assert!(!err.contains("--max-inflight <"), "{var}={value}: {err}");
        assert!(!err.contains("--toploc-topk <"), "{var}={value}: {err}");
        assert!(!err.contains("--heartbeat-s <"), "{var}={value}: {err}");
    }
    assert!(fx.gw.conns().is_empty(), "no leg was dialed");
    // The flag typed on the command line is named as typed.
    let vars = with(&base, &[]);
    let out = miner_cmd(&vars, &["--max-inflight=lots"]).output().unwrap();
    assert!(refused(&out, "--max-inflight=lots").contains("--max-inflight"));
    // A subcommand reads the same variables.
    let vars = with(&base, &[("MAX_INFLIGHT", "lots")]);
    let out = miner_cmd(&vars, &["check"]).output().unwrap();
    let err = refused(&out, "check with MAX_INFLIGHT=lots");
    assert!(
        err.contains("MAX_INFLIGHT") && !err.contains("--max-inflight <"),
        "{err}"
    );
    // The bound is a full batch: TOPLOC_TOPK=2048 starts and dials.
    let _m = fx.miner(&[("TOPLOC_TOPK", "2048")]);
    fx.gw
        .wait_legs(1, T)
        .await
        .expect("TOPLOC_TOPK=2048 starts");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_line_in_json_mode_parses_with_jq_fatal_errors_included() {
    let fx = Fixture::new(64, 1, SglangConfig::default()).await;
    let dir = tempfile::tempdir().unwrap();
    let base = base(dir.path(), &fx);
    let json = ("ENGY_LOG_FORMAT", "json");
    for (case, vars, args) in [
        ("GW unset", with(&base, &[json, ("GW", "")]), vec![]),
        (
            "MAX_INFLIGHT below 8",
            with(&base, &[json, ("MAX_INFLIGHT", "4")]),
            vec![],
        ),
        (
            "MAX_INFLIGHT not a number",
            with(&base, &[json, ("MAX_INFLIGHT", "-1")]),
            vec![],
        ),
        (
            "bad RUST_LOG",
            with(&base, &[json, ("RUST_LOG", "garbage===")]),
            vec![],
        ),
        (
            "TOPLOC_TOPK over hidden_size",
            with(&base, &[json, ("TOPLOC_TOPK", "100000")]),
            vec![],
        ),
        (
            "bad checkpoint",
            with(&base, &[json, ("CHECKPOINT", "/nonexistent")]),
            vec![],
        ),
        (
            "unknown flag, json by flag",
            with(&base, &[]),
            vec!["--log-format", "json", "--frobnicate"],
        ),
    ] {
        let out = bounded(miner_cmd(&vars, &args), case);
        let err = refused(&out, case);
        let lines = jq_lines(&err);
        assert_eq!(lines.len(), 1, "{case}: {err}");
        assert_eq!(lines[0]["level"], "ERROR", "{case}: {err}");
        assert!(
            lines[0]["message"].as_str().is_some_and(|m| !m.is_empty()),
            "{case}"
        );
        assert!(text(&out.stdout).is_empty(), "{case}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn check_has_a_json_report() {
    let fx = Fixture::new(64, 1, SglangConfig::default()).await;
    let dir = tempfile::tempdir().unwrap();
    let base = base(dir.path(), &fx);
    let run = |vars: Vec<(String, String)>| {
        tokio::task::spawn_blocking(move || {
            let vars: Vec<(&str, &str)> =
                vars.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
            miner_cmd(&vars, &["check"]).output().unwrap()
        })
    };
    let owned = |v: Vec<(&str, &str)>| -> Vec<(String, String)> {
        v.into_iter().map(|(k, v)| (k.into(), v.into())).collect()
    };
    let good = run(owned(with(&base, &[("ENGY_LOG_FORMAT", "json")])))
        .await
        .unwrap();
    jq_lines(&text(&good.stderr));
    let report = jq_lines(&text(&good.stdout));
    assert_eq!(report.len(), 1, "one object: {report:?}");
    let r = &report[0];
    assert_eq!(good.status.code(), Some(0), "{r}");
    assert_eq!(r["passed"], true, "{r}");
    assert_eq!(r["failed"], 0, "{r}");
    let checks = r["checks"].as_array().unwrap();
    assert!(checks.len() >= 5, "{r}");
    assert!(
        checks
            .iter()
            .all(|c| c["ok"] == true && c["check"].is_string()),
        "{r}"
    );
    assert_eq!(r["build"]["version"], env!("CARGO_PKG_VERSION"));

    let bad = run(owned(with(
        &base,
        &[
            ("ENGY_LOG_FORMAT", "json"),
            ("MINER_KEY", ""),
            ("TOPLOC_TOPK", "100000"),
        ],
    )))
    .await
    .unwrap();
    assert_eq!(bad.status.code(), Some(1));
    jq_lines(&text(&bad.stderr));
    let report = jq_lines(&text(&bad.stdout));
    assert_eq!(report.len(), 1, "{report:?}");
    let r = &report[0];
    assert_eq!(r["passed"], false, "{r}");
    let failed: Vec<&Value> = r["checks"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|c| c["ok"] == false)
        .collect();
    assert_eq!(r["failed"], failed.len(), "{r}");
    for name in ["MINER_KEY", "TOPLOC_TOPK"] {
        assert!(
            failed
                .iter()
                .any(|c| c.to_string().contains(name) && c["fix"].is_string()),
            "{name}: {r}"
        );
    }
}

/// Every family docs/MINER.md "Metrics" lists, as scraped (OpenMetrics names).
const DOCUMENTED: &[&str] = &[
    r#"engy_miner_requests_total{outcome="completed"}"#,
    r#"engy_miner_requests_total{outcome="failed"}"#,
    r#"engy_miner_requests_total{outcome="aborted"}"#,
    r#"engy_miner_requests_total{outcome="cancelled"}"#,
    r#"engy_miner_requests_total{outcome="refused"}"#,
    "engy_miner_serve_seconds_count",
    "engy_miner_proof_build_seconds_count",
    "engy_miner_inflight",
    "engy_miner_legs_connected",
    "engy_miner_reconnects_total",
    "engy_miner_build_info{",
];

/// `GET /metrics` with `accept`; (content type, body).
async fn scrape_as(addr: &str, accept: &str) -> (String, String) {
    let r = reqwest::Client::new()
        .get(format!("http://{addr}/metrics"))
        .header("accept", accept)
        .send()
        .await
        .unwrap();
    assert!(r.status().is_success(), "{}", r.status());
    let ct = r
        .headers()
        .get("content-type")
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_owned();
    (ct, r.text().await.unwrap())
}

/// `tests/metrics/check_exposition.py FORMAT` on `text`: `promtool check metrics` (Debian's
/// `prometheus` package, Prometheus 2.42: parse + lint, HELP on every family) and
/// prometheus_client's 0.0.4 parser for `text`; prometheus_client's strict OpenMetrics
/// parser for `openmetrics`. `Ok(false)` when a tool is missing and not required (exit 77;
/// .ci/run sets ENGY_REQUIRE_PROMTOOL=1).
fn check_exposition(format: &str, text: &str) -> Result<bool, String> {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("scrape.txt");
    std::fs::write(&file, text).unwrap();
    let script =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/metrics/check_exposition.py");
    let out = Command::new("python3")
        .arg(script)
        .arg(format)
        .arg(&file)
        .output()
        .unwrap();
    match out.status.code() {
        Some(0) => Ok(true),
        Some(77) => Ok(false),
        _ => Err(format!("{}{}", text_of(&out.stdout), text_of(&out.stderr))),
    }
}

fn text_of(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// Accept headers: text 0.0.4, OpenMetrics, and what Prometheus 2.42 sends.
const TEXT_004: &str = "text/plain;version=0.0.4";
const OPENMETRICS: &str = "application/openmetrics-text;version=1.0.0";
const PROMETHEUS_2_42: &str = "application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1";

/// Both content types, each through a real parser; the documented families in the
/// OpenMetrics one.
async fn assert_scrape_parses(addr: &str, when: &str) -> String {
    let (ct, text) = scrape_as(addr, TEXT_004).await;
    assert!(
        ct.starts_with("text/plain") && ct.contains("version=0.0.4"),
        "{when}: {ct}"
    );
    let (ct, om) = scrape_as(addr, OPENMETRICS).await;
    assert!(
        ct.starts_with("application/openmetrics-text"),
        "{when}: {ct}"
    );
    for (format, body) in [("text", &text), ("openmetrics", &om)] {
        match check_exposition(format, body) {
            Ok(true) => {}
            Ok(false) => println!("SKIP {when} {format}: promtool or prometheus_client missing (tests/metrics/check_exposition.py)"),
            Err(e) => panic!("{when} {format}: {e}\n{body}"),
        }
    }
    let (ct, _) = scrape_as(addr, PROMETHEUS_2_42).await;
    assert!(
        ct.starts_with("application/openmetrics-text"),
        "{when}: {ct}"
    );
    for series in DOCUMENTED {
        assert!(
            om.lines().any(|l| l.starts_with(series)),
            "{when}: {series} missing from\n{om}"
        );
    }
    om
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_scrape_parses_in_both_content_types_after_faults() {
    use engy_devnet::sglang::Fault;
    let fx = Fixture::new(64, 1, SglangConfig::default()).await;
    let (_m, addr) = miner_with_metrics(&fx, &[]).await;
    let leg = fx.gw.wait_legs(1, T).await.unwrap()[0].id;
    // At start-up every documented family is there, at 0.
    let om = assert_scrape_parses(&addr, "start-up").await;
    assert!(
        om.contains(r#"engy_miner_requests_total{outcome="failed"} 0"#),
        "{om}"
    );

    // A serve error (HTTP 500 with a body full of quotes and braces), a completion, and a
    // dropped leg that is re-dialed.
    fx.sglang.push_fault(Fault::Status(500));
    assert!(fx
        .gw
        .serve(leg, "bad", chat("Hello \"there\" {x}.", 5), true));
    let bad = fx.gw.wait_response("bad", T).await.unwrap();
    assert!(bad["error"].is_string(), "{bad}");
    assert!(fx.gw.serve(leg, "ok", chat("Hello.", 5), false));
    assert_ok(&fx.gw.wait_response("ok", T).await.unwrap());
    assert!(fx.gw.drop_conn(leg));
    wait_redialed(&fx.gw, leg).await;
    let om = assert_scrape_parses(&addr, "after faults").await;
    for series in [
        r#"engy_miner_requests_total{outcome="failed"} 1"#,
        r#"engy_miner_requests_total{outcome="completed"} 1"#,
        "engy_miner_reconnects_total 1",
    ] {
        assert!(om.lines().any(|l| l == series), "{series} in\n{om}");
    }
}
