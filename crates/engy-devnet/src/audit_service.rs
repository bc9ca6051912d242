//! The devnet's audit service: the real `engy-audit serve` binary (docs/AUDIT-SERVICE.md,
//! docs/PROTOCOL.md §11) with its embedded SQLite database, to which the devnet reports its
//! miners' requests as the gateway does, and whose per-miner table it prints.
//!
//! The devnet starts one service per run ([`AuditService::start`]): `--db
//! sqlite://WORK/audit.db`, `--listen 127.0.0.1:0` (the bound address read back from the
//! `listening` log line), `--model engy-devnet=CHECKPOINT`, one CPU worker, every request
//! sampled (`--sample-rate 1`) under a fixed beacon (a devnet has no chain: the service logs
//! that every decision is then predictable), the floor (§8's minimum sample) set to the
//! requests one miner sends. The cell challenge goes through a gateway
//! (`ENGY_AUDIT_GATEWAY`, `ENGY_AUDIT_SPECS`: the devnet's gateway front and the checkpoint's
//! spec file) when the binary reads those variables; a binary without them audits TOPLOC and
//! the routing only, and its reports say the cells were not judged.
//!
//! Each completed request is reported with `POST /v1/requests` ([`AuditService::report`]):
//! `{request_id, hotkey, model, commitment, timing}`, the commitment exactly as the miner sent
//! it. Before a miner is stopped the devnet waits until the service has a verdict on each of
//! its reports ([`AuditService::wait_audited`]: a challenge needs the miner alive), then reads
//! `GET /v1/miners/{hotkey}` ([`MinerSummary`]).
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use serde_json::{json, Value};

/// The model name the devnet's miner serves and the service audits.
pub const DEVNET_MODEL: &str = "engy-devnet";

/// The fixed sampling beacon of the devnet's service (64 hex digits). Tests and the devnet
/// only: a miner who knows it predicts every sampling decision.
pub const DEVNET_BEACON: &str = "5eed5eed5eed5eed5eed5eed5eed5eed5eed5eed5eed5eed5eed5eed5eed5eed";

/// Finds the `engy-audit` binary: `explicit`, else next to the running executable (the same
/// cargo target directory).
///
/// # Errors
/// When no binary is found, with the build command to run.
pub fn locate_audit(explicit: Option<PathBuf>) -> anyhow::Result<PathBuf> {
    if let Some(p) = explicit {
        if p.is_file() {
            return Ok(p);
        }
        bail!("--audit-bin {} is not a file", p.display());
    }
    let exe = std::env::current_exe().context("locating the running executable")?;
    let dir = exe
        .parent()
        .context("the executable has no parent directory")?;
    let name = format!("engy-audit{}", std::env::consts::EXE_SUFFIX);
    for candidate in [dir.join(&name), dir.join("..").join(&name)] {
        if candidate.is_file() {
            return Ok(candidate);
        }
    }
    bail!(
        "no engy-audit binary next to {} — build it first: `cargo build -p engy-audit -p \
         engy-devnet` (same profile), or pass --audit-bin / ENGY_AUDIT_BIN",
        exe.display()
    )
}

/// How to start the service.
#[derive(Debug, Clone)]
pub struct ServiceOptions {
    /// The `engy-audit` binary.
    pub bin: PathBuf,
    /// The devnet checkpoint (the service's `--model engy-devnet=DIR`).
    pub checkpoint: PathBuf,
    /// Its spec file (`ENGY_AUDIT_SPECS`), for the cell check's trusted `model_root`.
    pub spec: Option<PathBuf>,
    /// The gateway the service's cell challenge goes through (`ENGY_AUDIT_GATEWAY`).
    pub gateway: Option<String>,
    /// §8's minimum sample and the sampling floor (`--floor`).
    pub floor: u64,
    /// The database, log and nothing else go here.
    pub work: PathBuf,
}

/// A running `engy-audit serve`; killed on drop if still running.
pub struct AuditService {
    child: tokio::process::Child,
    url: String,
    log: PathBuf,
    db: PathBuf,
    http: reqwest::Client,
}

/// One miner's line of the service's table: `GET /v1/miners/{hotkey}` as the service computed
/// it (engy_audit_service::verdicts::Summary).
#[derive(Debug, Clone, PartialEq)]
pub struct MinerSummary {
    /// The devnet's name for the miner (its phase).
    pub miner: String,
    /// Its hotkey (SS58).
    pub hotkey: String,
    /// Requests the devnet reported.
    pub reported: u64,
    /// Verdicts written, every kind.
    pub audited: u64,
    /// `pass` verdicts.
    pub pass: u64,
    /// `cheat` verdicts.
    pub cheat: u64,
    /// `unproven` verdicts.
    pub unproven: u64,
    /// `unanswered` verdicts.
    pub unanswered: u64,
    /// `(cheat + unanswered) / judged`.
    pub cheat_rate: f64,
    /// The 95 % Wilson interval of the cheat rate.
    pub wilson95: [f64; 2],
    /// The gate's minimum sample.
    pub min_sample: u64,
    /// Whether §8's gate fires.
    pub gate_fires: bool,
}

impl MinerSummary {
    /// Reads the service's answer for `hotkey`.
    ///
    /// # Errors
    /// A member missing or of another type.
    fn from_value(miner: &str, hotkey: &str, reported: u64, v: &Value) -> anyhow::Result<Self> {
        let u = |k: &str| {
            v.get(k)
                .and_then(Value::as_u64)
                .with_context(|| format!("GET /v1/miners: {k} missing in {v}"))
        };
        let f = |p: &str| {
            v.pointer(p)
                .and_then(Value::as_f64)
                .with_context(|| format!("GET /v1/miners: {p} missing in {v}"))
        };
        Ok(MinerSummary {
            miner: miner.to_owned(),
            hotkey: hotkey.to_owned(),
            reported,
            audited: u("audited")?,
            pass: u("pass")?,
            cheat: u("cheat")?,
            unproven: u("unproven")?,
            unanswered: u("unanswered")?,
            cheat_rate: f("/cheat_rate")?,
            wilson95: [f("/cheat_rate_wilson95/0")?, f("/cheat_rate_wilson95/1")?],
            min_sample: u("min_sample")?,
            gate_fires: v
                .get("gate_fires")
                .and_then(Value::as_bool)
                .context("GET /v1/miners: gate_fires missing")?,
        })
    }
}

impl AuditService {
    /// Starts `engy-audit serve` and waits until it listens and its model is loaded.
    ///
    /// # Errors
    /// The binary cannot be started, exits, or is not ready within 120 s (its log's tail in
    /// the message).
    pub async fn start(o: &ServiceOptions) -> anyhow::Result<AuditService> {
        let log = o.work.join("engy-audit-serve.log");
        let db = o.work.join("audit.db");
        let out =
            std::fs::File::create(&log).with_context(|| format!("creating {}", log.display()))?;
        let err = out.try_clone()?;
        let mut cmd = tokio::process::Command::new(&o.bin);
        cmd.arg("serve")
            .args(["--listen", "127.0.0.1:0"])
            .arg("--db")
            .arg(format!("sqlite://{}", db.display()))
            .arg("--model")
            .arg(format!("{DEVNET_MODEL}={}", o.checkpoint.display()))
            .args(["--device", "cpu"])
            .args(["--sample-rate", "1"])
            .args(["--floor", &o.floor.to_string()])
            .args(["--fixed-beacon", DEVNET_BEACON])
            .args(["--log-format", "json"]);
        // Every other ENGY_AUDIT_* of the caller's environment would change the service.
        for (k, _) in std::env::vars_os() {
            if k.to_string_lossy().starts_with("ENGY_AUDIT_") {
                cmd.env_remove(&k);
            }
        }
        if let Some(g) = &o.gateway {
            cmd.env("ENGY_AUDIT_GATEWAY", g);
        }
        if let Some(s) = &o.spec {
            cmd.env(
                "ENGY_AUDIT_SPECS",
                format!("{DEVNET_MODEL}={}", s.display()),
            );
        }
        let mut child = cmd
            .env("ENGY_LOG", "info")
            .stdin(std::process::Stdio::null())
            .stdout(out)
            .stderr(err)
            .kill_on_drop(true)
            .spawn()
            .with_context(|| format!("starting {} serve", o.bin.display()))?;
        let http = reqwest::Client::builder()
            .timeout(Duration::from_secs(30))
            .build()
            .context("building the HTTP client")?;
        let started = Instant::now();
        let mut url = None;
        loop {
            if let Some(status) = child.try_wait()? {
                bail!(
                    "engy-audit serve exited ({status}) before it was ready; its log:\n{}",
                    tail(&log, 20)
                );
            }
            if url.is_none() {
                url = listening_addr(&log).map(|a| format!("http://{a}"));
            }
            if let Some(u) = &url {
                let health: Option<Value> = match http.get(format!("{u}/health")).send().await {
                    Ok(r) => r.json().await.ok(),
                    Err(_) => None,
                };
                if health.as_ref().and_then(|h| h.get("status")) == Some(&json!("ok")) {
                    break;
                }
            }
            if started.elapsed() > Duration::from_secs(120) {
                bail!(
                    "engy-audit serve was not ready within 120 s; its log:\n{}",
                    tail(&log, 20)
                );
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let url = url.context("no listening address")?;
        Ok(AuditService {
            child,
            url,
            log,
            db,
            http,
        })
    }

    /// The service's base URL (`http://127.0.0.1:PORT`).
    pub fn url(&self) -> &str {
        &self.url
    }

    /// The service's log (JSON lines).
    pub fn log(&self) -> &Path {
        &self.log
    }

    /// The SQLite database file.
    pub fn db(&self) -> &Path {
        &self.db
    }

    /// Reports one completed request as the gateway does (`POST /v1/requests`); returns the
    /// commitment's digest.
    ///
    /// # Errors
    /// The service cannot be reached or refuses the report (its status and answer in the
    /// message).
    pub async fn report(
        &self,
        request_id: &str,
        hotkey: &str,
        commitment: &Value,
        latency: Duration,
    ) -> anyhow::Result<String> {
        let body = json!({
            "request_id": request_id,
            "hotkey": hotkey,
            "model": DEVNET_MODEL,
            "commitment": commitment,
            "timing": {"latency_ms": latency.as_millis() as u64},
        });
        let r = self
            .http
            .post(format!("{}/v1/requests", self.url))
            .json(&body)
            .send()
            .await
            .context("POST /v1/requests")?;
        let status = r.status();
        let v: Value = r.json().await.context("POST /v1/requests: the answer")?;
        if !status.is_success() {
            bail!("POST /v1/requests: {status} {v}");
        }
        v.get("digest")
            .and_then(Value::as_str)
            .map(str::to_owned)
            .with_context(|| format!("POST /v1/requests: no digest in {v}"))
    }

    /// `GET /v1/miners/{hotkey}`.
    ///
    /// # Errors
    /// The service cannot be reached or answers something else.
    pub async fn miner(
        &self,
        miner: &str,
        hotkey: &str,
        reported: u64,
    ) -> anyhow::Result<MinerSummary> {
        let r = self
            .http
            .get(format!("{}/v1/miners/{hotkey}", self.url))
            .send()
            .await
            .context("GET /v1/miners")?;
        let status = r.status();
        let v: Value = r.json().await.context("GET /v1/miners: the answer")?;
        if !status.is_success() {
            bail!("GET /v1/miners/{hotkey}: {status} {v}");
        }
        MinerSummary::from_value(miner, hotkey, reported, &v)
    }

    /// Waits until the service has written `n` verdicts for `hotkey` (every report sampled),
    /// polling `GET /v1/miners/{hotkey}`; returns the summary then.
    ///
    /// # Errors
    /// Not within `timeout` (the log's tail in the message), or the service stopped.
    pub async fn wait_audited(
        &mut self,
        miner: &str,
        hotkey: &str,
        n: u64,
        timeout: Duration,
    ) -> anyhow::Result<MinerSummary> {
        let started = Instant::now();
        loop {
            if let Some(status) = self.child.try_wait()? {
                bail!(
                    "engy-audit serve exited ({status}); its log:\n{}",
                    tail(&self.log, 20)
                );
            }
            let s = self.miner(miner, hotkey, n).await?;
            if s.audited >= n {
                return Ok(s);
            }
            if started.elapsed() > timeout {
                bail!(
                    "engy-audit serve wrote {} of {n} verdicts for {miner} within {timeout:?}; \
                     its log:\n{}",
                    s.audited,
                    tail(&self.log, 20)
                );
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// SIGTERM (the service finishes or releases its jobs and exits), then SIGKILL after 30 s.
    ///
    /// # Errors
    /// Waiting for the process failed.
    pub async fn stop(mut self) -> anyhow::Result<()> {
        if let Some(pid) = self.child.id() {
            let _ = std::process::Command::new("kill")
                .args(["-TERM", &pid.to_string()])
                .status();
        }
        match tokio::time::timeout(Duration::from_secs(30), self.child.wait()).await {
            Ok(status) => {
                status?;
            }
            Err(_) => self.child.kill().await?,
        }
        Ok(())
    }
}

/// The devnet's gateway front: the one address the service's cell challenge is sent to
/// (`ENGY_AUDIT_GATEWAY`), while the devnet starts a gateway double per phase. `POST
/// /v1/open_cells` (docs/PROTOCOL.md §11.3) is forwarded unchanged to the current phase's
/// gateway ([`GatewayFront::route_to`]) and its status and body are answered back; with no
/// phase running it answers `503`.
pub struct GatewayFront {
    target: std::sync::Arc<std::sync::Mutex<Option<String>>>,
    url: String,
    _stop: tokio::sync::oneshot::Sender<()>,
}

impl GatewayFront {
    /// Starts the front on 127.0.0.1 (a port the kernel picks).
    ///
    /// # Errors
    /// The bind error.
    pub async fn start() -> anyhow::Result<GatewayFront> {
        use axum::extract::State;
        use axum::response::IntoResponse;
        type Target = std::sync::Arc<std::sync::Mutex<Option<String>>>;
        async fn forward(
            State((target, http)): State<(Target, reqwest::Client)>,
            body: axum::body::Bytes,
        ) -> axum::response::Response {
            let to = target.lock().ok().and_then(|t| t.clone());
            let Some(to) = to else {
                return (
                    axum::http::StatusCode::SERVICE_UNAVAILABLE,
                    axum::Json(json!({"error": "no devnet phase is running"})),
                )
                    .into_response();
            };
            let sent = http
                .post(format!("{to}/v1/open_cells"))
                .header("content-type", "application/json")
                .body(body)
                .send()
                .await;
            match sent {
                Ok(r) => {
                    let status = axum::http::StatusCode::from_u16(r.status().as_u16())
                        .unwrap_or(axum::http::StatusCode::BAD_GATEWAY);
                    let bytes = r.bytes().await.unwrap_or_default();
                    (
                        status,
                        [(axum::http::header::CONTENT_TYPE, "application/json")],
                        bytes,
                    )
                        .into_response()
                }
                Err(e) => (
                    axum::http::StatusCode::BAD_GATEWAY,
                    axum::Json(json!({"error": format!("the phase's gateway: {e}")})),
                )
                    .into_response(),
            }
        }
        let target: Target = std::sync::Arc::new(std::sync::Mutex::new(None));
        let http = reqwest::Client::new();
        let app = axum::Router::new()
            .route("/v1/open_cells", axum::routing::post(forward))
            .with_state((target.clone(), http));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .context("binding the gateway front")?;
        let url = format!("http://{}", listener.local_addr()?);
        let stop = crate::spawn_server(listener, app);
        Ok(GatewayFront {
            target,
            url,
            _stop: stop,
        })
    }

    /// The front's URL (`http://127.0.0.1:PORT`), the service's `ENGY_AUDIT_GATEWAY`.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// Sends later calls to the gateway at `url` (`None`: none running).
    pub fn route_to(&self, url: Option<String>) {
        if let Ok(mut t) = self.target.lock() {
            *t = url;
        }
    }
}

/// The `addr` of the service's `listening` log line (JSON lines), once written.
fn listening_addr(log: &Path) -> Option<String> {
    let text = std::fs::read_to_string(log).ok()?;
    text.lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter(|v| find(v, "message").and_then(Value::as_str) == Some("listening"))
        .find_map(|v| find(&v, "addr").and_then(Value::as_str).map(str::to_owned))
}

/// The first member `key` anywhere in `v` (the log's fields may be nested).
fn find<'a>(v: &'a Value, key: &str) -> Option<&'a Value> {
    match v {
        Value::Object(m) => m.get(key).or_else(|| m.values().find_map(|x| find(x, key))),
        _ => None,
    }
}

fn tail(path: &Path, lines: usize) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

/// The service's per-miner table, as `engy-devnet run` prints it.
pub fn render_service_table(rows: &[MinerSummary]) -> String {
    let mut s = format!(
        "{:<12} {:<10} {:>8} {:>7} {:>4} {:>5} {:>8} {:>10} {:>10} {:>13}  {}\n",
        "miner",
        "hotkey",
        "reported",
        "audited",
        "pass",
        "cheat",
        "unproven",
        "unanswered",
        "cheat rate",
        "95% interval",
        "§8 gate"
    );
    for r in rows {
        s.push_str(&format!(
            "{:<12} {:<10} {:>8} {:>7} {:>4} {:>5} {:>8} {:>10} {:>10.3} {:>13}  {}\n",
            r.miner,
            format!("{}…", r.hotkey.get(..8).unwrap_or(&r.hotkey)),
            r.reported,
            r.audited,
            r.pass,
            r.cheat,
            r.unproven,
            r.unanswered,
            r.cheat_rate,
            format!("{:.3}–{:.3}", r.wilson95[0], r.wilson95[1]),
            if r.gate_fires {
                "fires".to_owned()
            } else {
                format!("holds (min sample {})", r.min_sample)
            }
        ));
    }
    s
}
