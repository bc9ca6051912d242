//! The devnet: the whole pipeline on one machine (issue 5), behind `engy-devnet run`.
//!
//! For each of the first two phases, **honest** (the checkpoint's bf16 weights) and **int4 cheat** (the
//! same checkpoint rounded to 4-bit groups, still claiming the honest `model_root`):
//!
//! 1. the reference serve: the sglang double ([`crate::sglang::SglangDouble`]) over the real
//!    devnet model ([`crate::devnet_backend::CandleBackend`]) on 127.0.0.1;
//! 2. the gateway double ([`crate::gateway::GatewayDouble`]);
//! 3. the real `engy-miner` binary, dialled into the gateway and pointed at the serve, with a
//!    small `TOPLOC_GEN_CHUNK` so long requests take several `/generate` calls;
//! 4. a fixed set of chat requests through the gateway (streaming and not, one multi-turn, two
//!    longer than `TOPLOC_GEN_CHUNK`), each commitment audited by [`engy_model::audit`] against
//!    the bf16 checkpoint.
//!
//! A third phase, **fp8 experts**, serves a copy of the checkpoint whose routed experts only
//! are rounded to block FP8 ([`engy_model::cells::write_expert_cheat`]; router, attention and
//! shared expert exact), still claiming the honest checkpoint: its TOPLOC proofs pass (the
//! final hidden state moves too little), a fraction of its cells do not (the phase must fail
//! cells, not every request). A fourth, **fabricated cells**, serves
//! the honest weights (its TOPLOC proofs pass) but commits activation cells it never computed
//! (a `y` taken from the previous position): both are cheats only the sampled cell audit sees.
//!
//! Every commitment carries the serve's routing trace (the double runs with
//! `--enable-return-routed-experts`, the miner asks for it), which the audit checks and
//! replays, and the root of the request's activation cells (issue 23 part B, docs/PROTOCOL.md
//! §10): the double runs the engy_cells `--forward-hooks` (its cells built as the phase's
//! [`CellServe`] builds them), the miner runs with `--cells on`, its commit pass spools them
//! and it keeps them in its retention store. After each audit the auditor plays the sampled
//! cell audit through the miner as `engy-audit cells` does ([`judge`]): it checks the
//! commitment's cell shape against the request, draws a seed only now, sends `open_cells` for
//! [`CELLS_PER_REQUEST`] cells on the request's leg, requires the answer to answer exactly that
//! challenge, and checks each cell against the recompute of the request and the checkpoint's
//! weights, those checked against the checkpoint's own `engy-commit/v1` root
//! ([`engy_model::cells::audit_bundle_with_recompute`]). On the first honest request the red
//! team ([`red_team`]) judges the answers a cheating miner could give instead.
//!
//! With [`DevnetOptions::audit_bin`] the run also reports through the audit service
//! ([`crate::audit_service`]): one real `engy-audit serve` (SQLite) for the run, to which the
//! honest and int4 phases' requests are reported as the gateway reports them (their miners
//! named by [`SERVICE_HOTKEYS`] in the gateway's registry); the service samples every one,
//! challenges its cells through the phase's gateway double (reached at one address, the
//! [`crate::audit_service::GatewayFront`]) and writes a verdict, which the phase waits for
//! before its miner stops. [`DevnetRun::service`] is the service's per-miner table.
//!
//! It prints one table row per request, its `verdict` the audit's verdict on the request
//! (TOPLOC, routing and cells together, naming what caught a cheat: `cheat (cells)`;
//! [`combined_verdict`]) beside the recompute's own (`toploc`), then the summary lines
//! `honest: K/N pass`, `int4 cheat: K/N cheat`, `fp8 experts: K/N cheat`, `fabricated cells:
//! K/N cheat` (K counts the rows whose verdict column says so), `routing: honest A/B tokens
//! agree (near-ties N)` and one `cells: <phase> F/N challenged cells failed` per phase, and
//! exits non-zero if an honest request does not pass, a cheat is not caught (an `unproven`
//! counts as a failure in every phase), or an honest cell fails.
use std::io::{IsTerminal, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use base64::Engine as _;
use engy_core::cells::{challenge_n, BundleOpening, CellAuditBundle, CellShape, Challenge};
use engy_core::wire::{CellOpening, CellsCommitment};
use engy_model::audit::{audit_with, AuditParams, Recompute, RoutingAudit, Verdict};
use engy_model::cells::{write_expert_cheat, BundleVerdict, CellPolicy, CellServe};
use engy_model::{gen_model, Checkpoint, Compute, GenArch, GenConfig, Precision};
use serde_json::{json, Value};

use crate::audit_service::{AuditService, GatewayFront, MinerSummary, ServiceOptions};
use crate::devnet_backend::CandleBackend;
use crate::gateway::{GatewayConfig, GatewayDouble};
use crate::sglang::{SglangConfig, SglangDouble};

/// Settings of one devnet run.
#[derive(Debug, Clone)]
pub struct DevnetOptions {
    /// Seed of the generated model ([`engy_model::gen_model`]).
    pub seed: u64,
    /// Architecture of the generated model ([`GenArch`]).
    pub arch: GenArch,
    /// Where the checkpoint is generated (a temporary directory when `None`).
    pub model_dir: Option<PathBuf>,
    /// The `engy-miner` binary.
    pub miner_bin: PathBuf,
    /// The miner's `TOPLOC_GEN_CHUNK` (output tokens per `/generate` call).
    pub gen_chunk: usize,
    /// Group size of the int4 cheat.
    pub int4_group: usize,
    /// Activation dtype of both serves ([`Compute::Bf16`] plays a bf16 GPU serve; the auditor
    /// recomputes in bf16, then f32: [`Recompute::Auto`]).
    pub serve_compute: Compute,
    /// Audit thresholds (model spec defaults).
    pub audit: AuditParams,
    /// Longest wait for one request's response.
    pub request_timeout: Duration,
    /// Where to keep every commitment and the devnet auditor's verdict on it (`NN-phase-
    /// request.json` and one `file<TAB>verdict` line of `verdicts.tsv` each), so the same
    /// commitments can be audited again elsewhere (`engy-audit audit --device cuda`,
    /// scripts/gpu-check.sh). `None` keeps nothing.
    pub save_commitments: Option<PathBuf>,
    /// The `engy-audit` binary: the honest and int4 miners' requests are also reported to a
    /// real `engy-audit serve` (SQLite; [`crate::audit_service`]) and [`DevnetRun::service`]
    /// is its per-miner table. `None` runs without the service.
    pub audit_bin: Option<PathBuf>,
}

/// The running audit service and the gateway front its cell challenges go through.
struct ServiceLink {
    svc: AuditService,
    front: GatewayFront,
}

/// What [`run`] found.
#[derive(Debug, Clone)]
pub struct DevnetRun {
    /// One row per request, every phase.
    pub rows: Vec<DevnetRow>,
    /// The audit service's per-miner table, in phase order (empty without
    /// [`DevnetOptions::audit_bin`]): the honest miner and the int4 miner.
    pub service: Vec<MinerSummary>,
}

/// The SS58 hotkeys of the miners the devnet reports to the audit service: the honest phase's
/// (Substrate's well-known dev account Alice) and the int4 phase's (Bob).
pub const SERVICE_HOTKEYS: [(&str, &str); 2] = [
    ("honest", "5GrwvaEF5zXb26Fz9rcQpDWS57CtERHpNehXCPcNoHGKutQY"),
    (
        "int4 cheat",
        "5FHneW46xGXgs5mUiveU4sbTyGBzmstUspZC92UhjJM694ty",
    ),
];

/// Cells the auditor opens per request (at most the request's cell count). The fp8-experts
/// phase fails about 0.1 (qwen3_5_moe) to 0.3 (qwen3_moe) of its cells (docs/AUDITOR.md
/// "Cells"): 32 cells a request, 160 a phase, leave a run no real chance of missing the
/// phase (0.9¹⁶⁰ ≈ 5·10⁻⁸).
pub const CELLS_PER_REQUEST: u64 = 32;

/// One request of the devnet's fixed set.
#[derive(Debug, Clone)]
struct DevnetRequest {
    label: &'static str,
    stream: bool,
    body: Value,
}

fn requests(gen_chunk: usize) -> Vec<DevnetRequest> {
    let user = |text: &str| json!({"role": "user", "content": text});
    vec![
        DevnetRequest {
            label: "short",
            stream: false,
            body: json!({"messages": [user("What does the miner do?")], "max_tokens": 24}),
        },
        DevnetRequest {
            label: "short",
            stream: true,
            body: json!({"messages": [user("How is a proof checked?")], "max_tokens": 24}),
        },
        DevnetRequest {
            label: "multi-turn",
            stream: false,
            body: json!({"messages": [
                {"role": "system", "content": "You explain the engy network."},
                user("Who signs the weight vector?"),
                {"role": "assistant", "content": "The provider signs the weight vector."},
                user("Tell me about the gateway.")
            ], "max_tokens": 48}),
        },
        DevnetRequest {
            label: "long > GEN_CHUNK",
            stream: true,
            body: json!({"messages": [user("Write a short story about a proof.")],
                         "max_tokens": 3 * gen_chunk - 10}),
        },
        DevnetRequest {
            label: "long > GEN_CHUNK",
            stream: false,
            body: json!({"messages": [user("Explain the audit.")],
                         "max_tokens": 2 * gen_chunk + 5}),
        },
    ]
}

/// One row of the result table.
#[derive(Debug, Clone)]
pub struct DevnetRow {
    /// `honest`, `int4 cheat`, [`FP8_EXPERTS`] or [`FABRICATED`].
    pub phase: &'static str,
    /// Request label.
    pub request: String,
    /// Streamed through the gateway.
    pub stream: bool,
    /// `usage.prompt_tokens`.
    pub prompt_tokens: u64,
    /// `usage.completion_tokens`.
    pub completion_tokens: u64,
    /// Streamed `chunk` frames (0 for non-stream).
    pub chunks: usize,
    /// Decoded proof bytes.
    pub proof_bytes: usize,
    /// Gateway-side latency from `serve` to `response`.
    pub latency: Duration,
    /// Audit score (mean exponent mismatches / topk).
    pub score: Option<f64>,
    /// The recompute's verdict (TOPLOC and the routing check): `pass`, `cheat`,
    /// `unproven: …` or `error: …`.
    pub toploc: String,
    /// The audit's verdict on the request, TOPLOC, routing and cells together: `pass`,
    /// `cheat (toploc, routing, cells)` naming every check that caught it, `unproven: …` or
    /// `error: …` ([`combined_verdict`]).
    pub verdict: String,
    /// Token positions whose routing agrees in every MoE layer, near-tie positions, and
    /// positions compared (`None` when the commitment carried no trace).
    pub routing: Option<(usize, usize, usize)>,
    /// Opened cells that failed, and cells challenged (`None` when the cell audit did not
    /// run).
    pub cells: Option<(usize, usize)>,
    /// Why the cell audit failed before any cell was checked (a refused challenge, a shape
    /// that is not the request's, an answer to another challenge).
    pub cells_reason: Option<String>,
    /// The red team's attacks on this request's cell audit ([`red_team`]; the first honest
    /// request only).
    pub red_team: Vec<RedTeamRow>,
    /// Whether this row is what the phase expects.
    pub ok: bool,
}

/// Finds the `engy-miner` binary: `explicit`, else next to the running executable (the same
/// cargo target directory).
///
/// # Errors
/// When no binary is found, with the build command to run.
pub fn locate_miner(explicit: Option<PathBuf>) -> anyhow::Result<PathBuf> {
    if let Some(p) = explicit {
        if p.is_file() {
            return Ok(p);
        }
        bail!("--miner-bin {} is not a file", p.display());
    }
    let exe = std::env::current_exe().context("locating the running executable")?;
    let dir = exe
        .parent()
        .context("the executable has no parent directory")?;
    let name = format!("engy-miner{}", std::env::consts::EXE_SUFFIX);
    for candidate in [dir.join(&name), dir.join("..").join(&name)] {
        if candidate.is_file() {
            return Ok(candidate);
        }
    }
    bail!(
        "no engy-miner binary next to {} — build it first: `cargo build -p engy-miner -p \
         engy-devnet` (same profile), or pass --miner-bin / ENGY_MINER_BIN",
        exe.display()
    )
}

/// A progress line on stderr: rewritten in place on a terminal, printed once otherwise.
struct Progress {
    tty: bool,
}

impl Progress {
    fn update(&self, msg: &str) {
        if self.tty {
            let mut e = std::io::stderr();
            let _ = write!(e, "\r\x1b[2K{msg}");
            let _ = e.flush();
        }
    }
    fn done(&self, msg: &str) {
        if self.tty {
            eprint!("\r\x1b[2K");
        }
        eprintln!("{msg}");
    }
}

/// The spool directory a phase's serve hooks write and its miner reads.
fn cells_spool(work: &Path, phase: &str) -> PathBuf {
    work.join(format!("cells-spool-{}", phase.replace(' ', "-")))
}

/// The miner child process; killed on drop if still running.
struct Miner {
    child: tokio::process::Child,
    log: PathBuf,
}

impl Miner {
    async fn spawn(
        bin: &Path,
        gw: &str,
        serve: &str,
        checkpoint: &Path,
        gen_chunk: usize,
        work: &Path,
        phase: &str,
    ) -> anyhow::Result<Self> {
        let log = work.join(format!("miner-{}.log", phase.replace(' ', "-")));
        let out =
            std::fs::File::create(&log).with_context(|| format!("creating {}", log.display()))?;
        let err = out.try_clone()?;
        let child = tokio::process::Command::new(bin)
            .arg("run")
            .args(["--gw", gw])
            .args(["--miner-key", "devnet-miner"])
            .args(["--model", "engy-devnet"])
            .arg("--checkpoint")
            .arg(checkpoint)
            .args(["--serve-url", serve])
            .args(["--gen-chunk", &gen_chunk.to_string()])
            .args(["--max-inflight", "8"])
            .args(["--worker-name", "devnet"])
            .args(["--cells", "on"])
            .arg("--cells-spool")
            .arg(cells_spool(work, phase))
            .arg("--lock-file")
            .arg(work.join("engy-miner.lock"))
            .env_remove("GW")
            .env_remove("ENGY_GW_WORKERS")
            .env("RUST_LOG", "info")
            .stdin(std::process::Stdio::null())
            .stdout(out)
            .stderr(err)
            .kill_on_drop(true)
            .spawn()
            .with_context(|| format!("starting {}", bin.display()))?;
        Ok(Self { child, log })
    }

    /// SIGTERM (the miner drains and exits), then SIGKILL after 10 s.
    async fn stop(mut self) -> anyhow::Result<()> {
        if let Some(pid) = self.child.id() {
            let _ = std::process::Command::new("kill")
                .args(["-TERM", &pid.to_string()])
                .status();
        }
        match tokio::time::timeout(Duration::from_secs(10), self.child.wait()).await {
            Ok(status) => {
                status?;
            }
            Err(_) => {
                self.child.kill().await?;
            }
        }
        Ok(())
    }
}

fn tail(path: &Path, lines: usize) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

/// Runs one phase: serve + gateway + miner, every request, every audit.
/// What one phase serves and expects.
struct PhaseSpec {
    name: &'static str,
    precision: Precision,
    /// The recompute's verdict (TOPLOC and routing) the phase's commitments must get.
    expect: Verdict,
    /// Whether the phase cheats: the audit's verdict ([`combined_verdict`]) must be `cheat`
    /// (for every request with `caught_per_request`, else somewhere in the phase), else `pass`.
    cheat: bool,
    /// How the phase's serve builds its cells.
    cells: CellServe,
    /// Whether the phase's opened cells must all pass (else at least one must fail).
    cells_pass: bool,
    /// With `cells_pass` false: whether a failed cell is required in every request (a cheat
    /// most cells show), or only somewhere in the phase (a cheat few cells show: the fp8
    /// experts fail about 0.1–0.3 of their cells, so one request may be missed by chance while
    /// the serve is caught across its requests).
    caught_per_request: bool,
}

async fn phase(
    spec: &PhaseSpec,
    dir: &Path,
    work: &Path,
    auditor: &Arc<Auditor>,
    opts: &DevnetOptions,
    progress: &Progress,
    mut service: Option<&mut ServiceLink>,
) -> anyhow::Result<(Vec<DevnetRow>, Option<MinerSummary>)> {
    let hotkey = SERVICE_HOTKEYS
        .iter()
        .find(|(p, _)| *p == spec.name)
        .map(|(_, h)| *h);
    let mut reported = 0u64;
    let (name, precision, expect) = (spec.name, spec.precision, &spec.expect);
    // The expert-only cheats serve a rounded copy; the miner still claims `dir`.
    let serve_dir = match spec.cells.expert_quant() {
        Some(q) => {
            let copy = work.join(format!("model-{}", spec.cells.label()));
            let d = dir.to_path_buf();
            let c = copy.clone();
            let r = tokio::task::spawn_blocking(move || write_expert_cheat(&d, &c, q))
                .await
                .context("expert cheat task")?
                .with_context(|| format!("writing the {} checkpoint", spec.cells.label()))?;
            progress.done(&format!(
                "[{name}] {} expert tensors rounded ({q:?}) in {}",
                r.tensors,
                copy.display()
            ));
            copy
        }
        None => dir.to_path_buf(),
    };
    progress.done(&format!(
        "[{name}] loading the serve: {precision} weights, {:?} activations",
        opts.serve_compute
    ));
    let backend = CandleBackend::open_with(&serve_dir, precision, opts.serve_compute)
        .with_context(|| format!("loading {} for the serve", serve_dir.display()))?
        .with_cell_serve(spec.cells);
    // As a serve started with --enable-return-routed-experts (the miner attaches the routing
    // to every commitment, docs/PROTOCOL.md §3.10) and with the engy_cells --forward-hooks
    // and --disable-radix-cache (the miner's commit pass spools the cells, §10).
    let spool = cells_spool(work, name);
    let serve = SglangDouble::start(
        Arc::new(backend),
        SglangConfig {
            radix_cache: false,
            ..SglangConfig::default()
        }
        .with_routed_experts(true)
        .with_cells_spool(Some(spool.clone())),
    )
    .await
    .context("starting the reference serve")?;
    let gateway = GatewayDouble::start(GatewayConfig::default())
        .await
        .context("starting the gateway double")?;
    if let (Some(link), Some(hotkey)) = (service.as_deref(), hotkey) {
        // The gateway's registry: this phase's miner (its --miner-key) is `hotkey`; the
        // service's open_cells calls reach this phase's gateway through the front.
        gateway.register_miner("devnet-miner", hotkey);
        // The double's URL is its websocket's (ws://); its HTTP API is on the same address.
        let http = gateway.url().replacen("ws://", "http://", 1);
        link.front.route_to(Some(http));
    }
    let mut miner = Miner::spawn(
        &opts.miner_bin,
        &gateway.url(),
        &serve.url(),
        dir,
        opts.gen_chunk,
        work,
        name,
    )
    .await?;
    progress.done(&format!(
        "[{name}] serve {}  gateway {}  engy-miner pid {} (log {})",
        serve.url(),
        gateway.url(),
        miner.child.id().unwrap_or(0),
        miner.log.display()
    ));
    tokio::select! {
        legs = gateway.wait_legs(1, Duration::from_secs(60)) => {
            if legs.is_none() {
                bail!("engy-miner did not connect within 60 s; its log:\n{}", tail(&miner.log, 20));
            }
        }
        status = miner.child.wait() => {
            bail!("engy-miner exited ({:?}) before connecting; its log:\n{}",
                status.ok(), tail(&miner.log, 20));
        }
    }
    let reqs = requests(opts.gen_chunk);
    let mut rows = Vec::with_capacity(reqs.len());
    for (i, r) in reqs.iter().enumerate() {
        let mode = if r.stream { "stream" } else { "non-stream" };
        let what = format!("[{name}] {}/{} {} ({mode})", i + 1, reqs.len(), r.label);
        let started = Instant::now();
        let Some((conn, corr)) = gateway.submit(r.body.clone(), r.stream) else {
            bail!("the gateway double found no miner leg with free capacity");
        };
        let response = loop {
            let tick = gateway
                .wait_response(&corr, Duration::from_millis(250))
                .await;
            if let Some(v) = tick {
                break Some(v);
            }
            let elapsed = started.elapsed();
            if elapsed > opts.request_timeout {
                break None;
            }
            let streamed: usize = gateway
                .chunks(&corr)
                .iter()
                .filter_map(|c| c.pointer("/delta/content").and_then(Value::as_str))
                .map(str::len)
                .sum();
            progress.update(&format!(
                "{what}: generating… {:.1} s{}",
                elapsed.as_secs_f64(),
                if r.stream {
                    format!(", {streamed} chars streamed")
                } else {
                    String::new()
                }
            ));
        };
        let latency = started.elapsed();
        let Some(resp) = response else {
            bail!(
                "{what}: no response within {:?}; miner log:\n{}",
                opts.request_timeout,
                tail(&miner.log, 20)
            );
        };
        progress.update(&format!("{what}: auditing…"));
        let chunks = gateway.chunks(&corr).len();
        let usage = resp
            .pointer("/output/usage")
            .cloned()
            .unwrap_or(Value::Null);
        let num = |k: &str| usage.get(k).and_then(Value::as_u64).unwrap_or(0);
        let row = if let Some(err) = resp.get("error").and_then(Value::as_str) {
            DevnetRow {
                phase: name,
                request: r.label.into(),
                stream: r.stream,
                prompt_tokens: 0,
                completion_tokens: 0,
                chunks,
                proof_bytes: 0,
                latency,
                score: None,
                toploc: format!("error: {err}"),
                verdict: format!("error: {err}"),
                routing: None,
                cells: None,
                cells_reason: None,
                red_team: Vec::new(),
                ok: false,
            }
        } else {
            let commitment = resp.get("commitment").cloned().unwrap_or(Value::Null);
            if let (Some(link), Some(hotkey)) = (service.as_deref(), hotkey) {
                // As the gateway reports a completed request (docs/PROTOCOL.md §11.1).
                let request_id = match resp.get("request_id") {
                    Some(Value::String(s)) => s.clone(),
                    Some(v) if !v.is_null() => v.to_string(),
                    _ => corr.clone(),
                };
                link.svc
                    .report(&request_id, hotkey, &commitment, latency)
                    .await
                    .with_context(|| format!("{what}: reporting to the audit service"))?;
                reported += 1;
            }
            let ck = Arc::clone(auditor);
            let params = opts.audit;
            let c = commitment.clone();
            let report = tokio::task::spawn_blocking(move || {
                audit_with(
                    &ck.ck.model,
                    &ck.ck.model_root,
                    &c,
                    &params,
                    Recompute::Auto,
                )
            })
            .await
            .context("audit task")?
            .context("audit")?;
            let toploc = match &report.verdict {
                Verdict::Unproven { reason } => format!("unproven: {reason}"),
                v => v.label().to_string(),
            };
            let toploc_failed = report.batches.len() > report.passing_batches
                && (report.passing_batches as f64) < params.toploc_p * report.batches.len() as f64;
            let routing_failed =
                matches!(&report.routing, Some(RoutingAudit::Checked(r)) if r.is_cheat());
            if let Some(dir) = &opts.save_commitments {
                save_commitment(dir, name, r.label, &commitment, &toploc)?;
            }
            let routing = match &report.routing {
                Some(RoutingAudit::Checked(s)) => {
                    Some((s.tokens.agree, s.tokens.near_tie, s.tokens.compared))
                }
                _ => None,
            };
            drop(commitment);
            progress.update(&format!("{what}: challenging the miner's cells…"));
            let outcome = cell_audit(&gateway, conn, &resp, Arc::clone(auditor))
                .await
                .context("cell audit")?;
            let cells = outcome.as_ref().map(|o| (o.failed, o.challenged));
            let cells_reason = outcome.as_ref().and_then(|o| o.reason.clone());
            let cells_failed = outcome.as_ref().is_none_or(|o| o.failed > 0);
            let verdict =
                combined_verdict(&report.verdict, toploc_failed, routing_failed, cells_failed);
            let caught = verdict.starts_with("cheat");
            let verdict_ok = if spec.cheat {
                caught || !spec.caught_per_request
            } else {
                verdict == "pass"
            };
            let cells_ok = match cells {
                Some((failed, _)) if spec.cells_pass => failed == 0,
                Some((failed, _)) => failed > 0 || !spec.caught_per_request,
                None => false,
            };
            DevnetRow {
                phase: name,
                request: r.label.into(),
                stream: r.stream,
                prompt_tokens: num("prompt_tokens"),
                completion_tokens: num("completion_tokens"),
                chunks,
                proof_bytes: report.proof_bytes,
                latency,
                score: report.score,
                ok: &report.verdict == expect && verdict_ok && cells_ok && routing.is_some(),
                toploc,
                verdict,
                routing,
                cells,
                cells_reason,
                red_team: Vec::new(),
            }
        };
        let mut row = row;
        if name == "honest" && i == 0 && row.cells.is_some() {
            progress.update(&format!("{what}: the red team's answers…"));
            let a = Arc::clone(auditor);
            let r2 = resp.clone();
            row.red_team = tokio::task::spawn_blocking(move || red_team(&a, &r2))
                .await
                .context("red team task")?
                .context("red team")?;
            if row.red_team.iter().any(|t| t.caught != t.cheat) {
                row.ok = false;
            }
        }
        progress.done(&format!(
            "{what}: {} tokens in {:.2} s, score {}, {}",
            row.completion_tokens,
            row.latency.as_secs_f64(),
            row.score.map(|s| format!("{s:.3}")).unwrap_or("-".into()),
            row.verdict
        ));
        rows.push(row);
    }
    // The service may still challenge this miner: its verdicts first, then the miner stops.
    let summary = match (service.as_deref_mut(), hotkey) {
        (Some(link), Some(hotkey)) => {
            progress.update(&format!(
                "[{name}] waiting for the audit service's {reported} verdicts…"
            ));
            let s = link
                .svc
                .wait_audited(name, hotkey, reported, Duration::from_secs(600))
                .await
                .with_context(|| format!("[{name}] the audit service's verdicts"))?;
            progress.done(&format!(
                "[{name}] audit service: {} audited, {} pass, {} cheat, {} unproven, {} unanswered",
                s.audited, s.pass, s.cheat, s.unproven, s.unanswered
            ));
            Some(s)
        }
        _ => None,
    };
    miner.stop().await.context("stopping engy-miner")?;
    if let Some(link) = service.as_deref() {
        link.front.route_to(None);
    }
    let caught = rows.iter().any(|r| r.cells.is_some_and(|(f, _)| f > 0));
    if !spec.cells_pass && !caught {
        rows.iter_mut().for_each(|r| r.ok = false);
    }
    Ok((rows, summary))
}

/// Appends one commitment and its verdict to [`DevnetOptions::save_commitments`].
fn save_commitment(
    dir: &Path,
    phase: &str,
    request: &str,
    commitment: &Value,
    verdict: &str,
) -> anyhow::Result<()> {
    use std::io::Write as _;
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let tsv = dir.join("verdicts.tsv");
    let n = std::fs::read_to_string(&tsv)
        .map(|t| t.lines().count())
        .unwrap_or(0);
    let slug = |s: &str| -> String {
        s.chars()
            .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
            .collect()
    };
    let file = format!("{n:02}-{}-{}.json", slug(phase), slug(request));
    std::fs::write(dir.join(&file), serde_json::to_vec_pretty(commitment)?)
        .with_context(|| format!("writing {}", dir.join(&file).display()))?;
    let mut f = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&tsv)
        .with_context(|| format!("opening {}", tsv.display()))?;
    writeln!(f, "{file}\t{verdict}").with_context(|| format!("writing {}", tsv.display()))?;
    Ok(())
}

/// The devnet's auditor: the checkpoint it recomputes with, and the same checkpoint's touched
/// weights checked against its `engy-commit/v1` root (as `engy-audit cells` checks them).
pub struct Auditor {
    /// The checkpoint (bf16).
    pub ck: Checkpoint,
    /// Its units against the root of its own commitment.
    pub weights: engy_model::cells::CommittedWeights,
    /// The same checkpoint as the honest serve runs it (the red team's cells are made as a
    /// serve makes them: [`DevnetOptions::serve_compute`]).
    pub serve: engy_model::Model,
}

/// What the sampled cell audit of one request found.
#[derive(Debug, Clone, PartialEq)]
pub struct CellOutcome {
    /// Challenged cells that failed (all of them when the answer failed as a whole).
    pub failed: usize,
    /// Cells challenged.
    pub challenged: usize,
    /// Why the answer failed as a whole, before any cell was checked.
    pub reason: Option<String>,
}

/// The audit's verdict on one request from its three checks: `pass` when none caught it,
/// else `cheat (…)` naming each that did (`toploc`, `routing`, `cells`); an `unproven`
/// recompute stays `unproven: …` unless the cells caught it.
pub fn combined_verdict(
    recompute: &Verdict,
    toploc_failed: bool,
    routing_failed: bool,
    cells_failed: bool,
) -> String {
    let mut by = Vec::new();
    if matches!(recompute, Verdict::Cheat) && toploc_failed {
        by.push("toploc");
    }
    if matches!(recompute, Verdict::Cheat) && routing_failed {
        by.push("routing");
    }
    if matches!(recompute, Verdict::Cheat) && by.is_empty() {
        by.push("toploc");
    }
    if cells_failed {
        by.push("cells");
    }
    match recompute {
        Verdict::Unproven { reason } if by.is_empty() => format!("unproven: {reason}"),
        _ if by.is_empty() => "pass".to_string(),
        _ => format!("cheat ({})", by.join(", ")),
    }
}

/// The request's cell shape as the auditor derives it (specs/CELLS.md §3 "A request's
/// shape"): positions and tokens from the commitment's ids, the MoE layers from the committed
/// checkpoint, the sizes from the auditor's model; the logits dtype is the commitment's.
fn request_shape(auditor: &Auditor, ids: &[u32], c: &CellsCommitment) -> Option<CellShape> {
    let rs = auditor.ck.model.routing_shape()?;
    let dtype = c.shape.logits_dtype().ok()?;
    let layers: Vec<u32> = (0..rs.layers as u32)
        .filter(|&l| auditor.weights.is_moe_layer(l))
        .collect();
    CellShape::for_request(
        ids,
        layers,
        auditor.ck.model.config().hidden_size as u32,
        rs.experts as u32,
        rs.top_k as u32,
        dtype,
    )
    .ok()
}

/// The request's token ids (prompt + output) of a `response` frame's commitment.
fn request_ids(resp: &Value) -> anyhow::Result<Vec<u32>> {
    let commitment: engy_core::wire::Commitment =
        serde_json::from_value(resp.get("commitment").cloned().unwrap_or(Value::Null))
            .context("reading the commitment")?;
    Ok(commitment
        .toploc
        .prompt_ids
        .iter()
        .chain(&commitment.output_token_ids)
        .copied()
        .collect())
}

/// A miner's answer to `open_cells`, as the auditor receives it.
#[derive(Debug, Clone)]
pub enum Answer {
    /// `cells_error` (its reason word) or no answer.
    Declined(String),
    /// `cells`: the root it names and its openings.
    Opened {
        /// The `cells` frame's `root`.
        root: [u8; 32],
        /// The openings, cells decoded from base64.
        openings: Vec<BundleOpening>,
    },
}

/// The auditor's judgement of one request's cells (blocking; [`cell_audit`] and the red team
/// share it): `c` the commitment's `cells` (`None`: the commitment has none, from a serve
/// that offers them), the shape checked against the request's, the answer made a bundle of
/// the auditor's `seed` and `n` and checked to answer exactly that challenge, then every
/// challenged cell bound to the recompute of `ids` and checked against the committed weights
/// ([`engy_model::cells::audit_bundle_with_recompute`], as `engy-audit cells` does).
pub fn judge(
    auditor: &Auditor,
    ids: &[u32],
    c: Option<&CellsCommitment>,
    seed: [u8; 32],
    answer: Answer,
) -> anyhow::Result<CellOutcome> {
    let all_failed = |n: u64, reason: String| CellOutcome {
        failed: n as usize,
        challenged: n as usize,
        reason: Some(reason),
    };
    let Some(c) = c else {
        return Ok(all_failed(
            CELLS_PER_REQUEST,
            "the commitment carries no cells, from a serve that offers them".into(),
        ));
    };
    let Some(want) = request_shape(auditor, ids, c) else {
        bail!("the auditor's model gives no cell shape for this request");
    };
    let n = challenge_n(CELLS_PER_REQUEST, want.n_cells());
    if c.scheme != engy_core::cells::SCHEME {
        return Ok(all_failed(
            n,
            format!("commitment.cells is scheme {}", c.scheme),
        ));
    }
    if let Some(why) = c.shape.request_mismatch(&want) {
        return Ok(all_failed(
            n,
            format!("commitment.cells.shape is not the request's: {why}"),
        ));
    }
    let (root, openings) = match answer {
        Answer::Declined(why) => {
            return Ok(all_failed(
                n,
                format!("the miner declined the challenge inside the retention window: {why}"),
            ))
        }
        Answer::Opened { root, openings } => (root, openings),
    };
    let challenge = Challenge {
        cells_root: c.root.0,
        shape: c.shape.clone(),
        seed,
        n,
    };
    let bundle = CellAuditBundle {
        cells_root: engy_core::commit::spec::Hex(root),
        shape: c.shape.clone(),
        seed: engy_core::commit::spec::Hex(seed),
        n,
        openings,
    };
    if let Err(e) = bundle.check_challenge(&challenge) {
        return Ok(all_failed(
            n,
            format!("the answer does not answer the auditor's challenge: {e}"),
        ));
    }
    let report = engy_model::cells::audit_bundle_with_recompute(
        &auditor.ck.model,
        &auditor.weights,
        &bundle,
        ids,
        None,
        &CellPolicy::default(),
    )?;
    let reason = (!report.stats.failures.is_empty())
        .then(|| format!("together: {}", report.stats.failures.join("; ")));
    Ok(CellOutcome {
        failed: report.failed as usize
            + usize::from(report.failed == 0 && report.verdict == BundleVerdict::Cheat),
        challenged: report.n as usize,
        reason,
    })
}

/// The sampled cell audit of one response through the miner (module docs, docs/PROTOCOL.md
/// §10), the auditor owning the challenge: a seed it draws only now, `open_cells` for
/// [`CELLS_PER_REQUEST`] cells on the request's leg (`conn`), the answer judged by [`judge`].
/// A missing `commitment.cells` is a failed audit here (the serve offers cells).
async fn cell_audit(
    gateway: &GatewayDouble,
    conn: u64,
    resp: &Value,
    auditor: Arc<Auditor>,
) -> anyhow::Result<Option<CellOutcome>> {
    let ids = request_ids(resp)?;
    let c: Option<CellsCommitment> = match resp.pointer("/commitment/cells") {
        None => None,
        Some(v) => Some(serde_json::from_value(v.clone()).context("reading commitment.cells")?),
    };
    // The miner has committed `cells.root`; only now does the auditor draw its seed.
    let seed: [u8; 32] = rand::random();
    let answer = match &c {
        None => Answer::Declined("no cells committed".into()),
        Some(c) => {
            let request_id = resp.get("request_id").cloned().unwrap_or(Value::Null);
            let n = challenge_n(CELLS_PER_REQUEST, c.shape.n_cells());
            let asked_before = gateway
                .frames()
                .iter()
                .filter(|f| {
                    f.kind() == "open_cells" && f.value.get("request_id") == Some(&request_id)
                })
                .count();
            if !gateway.open_cells(conn, request_id.clone(), seed, n) {
                bail!("the request's leg {conn} is gone: cannot send open_cells");
            }
            let frame = gateway
                .wait_cells(&request_id, asked_before, Duration::from_secs(60))
                .await;
            opened_answer(frame.as_ref())?
        }
    };
    let out = tokio::task::spawn_blocking(move || judge(&auditor, &ids, c.as_ref(), seed, answer))
        .await
        .context("cell audit task")??;
    Ok(Some(out))
}

/// The [`Answer`] of a `cells` / `cells_error` frame (`None`: no answer by the deadline).
fn opened_answer(frame: Option<&Value>) -> anyhow::Result<Answer> {
    let Some(f) = frame else {
        return Ok(Answer::Declined("no answer within 60 s".into()));
    };
    if f["type"] != "cells" {
        return Ok(Answer::Declined(
            f.get("reason")
                .and_then(Value::as_str)
                .unwrap_or("cells_error")
                .to_string(),
        ));
    }
    let root: engy_core::commit::spec::Hex =
        serde_json::from_value(f["root"].clone()).context("reading the cells frame's root")?;
    let openings: Vec<CellOpening> =
        serde_json::from_value(f["openings"].clone()).context("reading the cells frame")?;
    let mut out = Vec::with_capacity(openings.len());
    for o in openings {
        let Ok(cell) = base64::engine::general_purpose::STANDARD.decode(&o.cell) else {
            return Ok(Answer::Declined(format!(
                "opening {} is not base64",
                o.index
            )));
        };
        out.push(BundleOpening {
            index: o.index,
            cell,
            path: o.path,
        });
    }
    Ok(Answer::Opened {
        root: root.0,
        openings: out,
    })
}

/// One attack of the red team and what the auditor made of it.
#[derive(Debug, Clone, PartialEq)]
pub struct RedTeamRow {
    /// The attack.
    pub attack: &'static str,
    /// Whether it is a cheat (the honest control is not).
    pub cheat: bool,
    /// Whether the audit failed it.
    pub caught: bool,
    /// The failed cells or the reason.
    pub why: String,
}

/// A cell's parts a red-team attack remakes: `x`, router logits, expert ids, `y`.
type CellParts = (
    Vec<half::bf16>,
    engy_core::cells::RouterLogits,
    Vec<u32>,
    Vec<half::bf16>,
);

/// The red team (issue 39): the answers a cheating miner could give for the request of
/// `resp` (its commitment's cells and its `open_cells` answer), each judged by the devnet's
/// auditor exactly as the miner's real answers are ([`judge`]), beside the honest answer.
///
/// # Errors
/// The recompute's own failures.
pub fn red_team(auditor: &Auditor, resp: &Value) -> anyhow::Result<Vec<RedTeamRow>> {
    use engy_core::cells::{Cell, CellTree, RouterLogits};
    use engy_core::commit::spec::Hex;
    use half::bf16;
    let ids = request_ids(resp)?;
    let c: CellsCommitment = serde_json::from_value(
        resp.pointer("/commitment/cells")
            .cloned()
            .context("the request has no cells")?,
    )?;
    let model = &auditor.serve;
    let shape = request_shape(auditor, &ids, &c).context("no shape")?;
    let commit = |t: &CellTree| CellsCommitment {
        scheme: engy_core::cells::SCHEME.into(),
        root: Hex(t.root()),
        shape: t.shape().clone(),
    };
    let n = challenge_n(CELLS_PER_REQUEST, shape.n_cells());
    let open = |t: &CellTree, cells: &[Cell], seed: [u8; 32]| -> anyhow::Result<Answer> {
        let b = CellAuditBundle::open(t, &seed, n.min(t.shape().n_cells()), |i| {
            Ok(cells[i as usize].encode())
        })?;
        Ok(Answer::Opened {
            root: b.cells_root.0,
            openings: b.openings,
        })
    };
    // A serve that commits `cells` under `shape` and opens them for `seed`: its commitment
    // and its answer.
    let served = |shape: &CellShape,
                  cells: &[Cell],
                  seed: [u8; 32]|
     -> anyhow::Result<(Option<CellsCommitment>, Answer)> {
        let t = CellTree::from_cells(shape.clone(), cells)?;
        Ok((Some(commit(&t)), open(&t, cells, seed)?))
    };
    // The request's shape over other token ids (same layers, widths and logits dtype).
    let shape_for = |ids: &[u32]| -> anyhow::Result<CellShape> {
        Ok(CellShape::for_request(
            ids,
            shape.layers().to_vec(),
            shape.hidden(),
            shape.n_experts(),
            shape.top_k(),
            shape.logits_dtype()?,
        )?)
    };
    let honest = engy_model::cells::serve_cells(model, &ids, CellServe::Honest)?;
    let ht = CellTree::from_cells(shape.clone(), &honest)?;
    // Every honest cell with some of its parts replaced.
    let remade = |f: &dyn Fn(&Cell) -> CellParts| {
        honest
            .iter()
            .map(|x| {
                let (xs, logits, experts, y) = f(x);
                Ok(Cell::new(x.position(), x.layer(), xs, logits, experts, y)?)
            })
            .collect::<anyhow::Result<Vec<Cell>>>()
    };
    let seed: [u8; 32] = rand::random();
    let zeros = remade(&|x| {
        let h = x.hidden() as usize;
        (
            vec![bf16::ZERO; h],
            RouterLogits::Bf16(vec![bf16::ZERO; x.n_experts() as usize]),
            (0..x.top_k()).collect(),
            vec![bf16::ZERO; h],
        )
    })?;
    let scaled = remade(&|x| {
        (
            x.x().to_vec(),
            x.router_logits().clone(),
            x.expert_ids().to_vec(),
            x.y()
                .iter()
                .map(|v| bf16::from_f32(v.to_f32() * 1.02))
                .collect(),
        )
    })?;
    let other: Vec<u32> = ids.iter().rev().copied().collect();
    let copied = engy_model::cells::serve_cells(model, &other, CellServe::Honest)?;
    let per = shape.layers().len();
    // Each attack: its name, whether it is a cheat, the commitment and the answer judged.
    let attacks: Vec<(&'static str, bool, Option<CellsCommitment>, Answer)> = vec![
        (
            "honest answer (control)",
            false,
            Some(c.clone()),
            open(&ht, &honest, seed)?,
        ),
        {
            let (c, a) = served(&shape, &zeros, seed)?;
            ("zero cells", true, c, a)
        },
        {
            let (c, a) = served(&shape, &copied, seed)?;
            ("copied cells (another request)", true, c, a)
        },
        {
            let (c, a) = served(&shape_for(&other)?, &copied, seed)?;
            ("copied commitment (other tokens)", true, c, a)
        },
        (
            "n = 0 (nothing opened)",
            true,
            Some(c.clone()),
            Answer::Opened {
                root: c.root.0,
                openings: Vec::new(),
            },
        ),
        (
            "chosen seed",
            true,
            Some(c.clone()),
            open(&ht, &honest, [1; 32])?,
        ),
        {
            let st = CellTree::from_cells(shape_for(&ids[..1])?, &honest[..per])?;
            let a = open(&st, &honest, seed)?;
            ("shrunk shape (one position)", true, Some(commit(&st)), a)
        },
        (
            "declined (unknown_request)",
            true,
            Some(c.clone()),
            Answer::Declined("unknown_request".into()),
        ),
        (
            "commitment without cells",
            true,
            None,
            Answer::Declined("no cells".into()),
        ),
        {
            let (c, a) = served(&shape, &scaled, seed)?;
            ("y scaled by 1.02", true, c, a)
        },
    ];
    let mut rows = Vec::with_capacity(attacks.len());
    for (attack, cheat, c, answer) in attacks {
        let o = judge(auditor, &ids, c.as_ref(), seed, answer)?;
        rows.push(RedTeamRow {
            attack,
            cheat,
            caught: o.failed > 0,
            why: o
                .reason
                .unwrap_or_else(|| format!("{}/{} cells failed", o.failed, o.challenged)),
        });
    }
    Ok(rows)
}

/// Runs the devnet and returns every row (print them with [`render_table`]).
///
/// # Errors
/// When a component cannot start or a request gets no response (an audit verdict is never an
/// error: it is a row).
pub async fn run(opts: &DevnetOptions) -> anyhow::Result<DevnetRun> {
    let progress = Progress {
        tty: std::io::stderr().is_terminal(),
    };
    // Miner logs and lock file (and the model unless --model-dir) live in a fresh temporary
    // directory, removed at the end.
    let work = tempfile::Builder::new()
        .prefix("engy-devnet-")
        .tempdir()
        .context("creating a temporary directory")?;
    let dir = match &opts.model_dir {
        Some(d) => d.clone(),
        None => work.path().join("devnet-model"),
    };
    let t0 = Instant::now();
    let report = {
        let gen_dir = dir.clone();
        let seed = opts.seed;
        let cfg = GenConfig {
            arch: opts.arch,
            ..GenConfig::default()
        };
        tokio::task::spawn_blocking(move || gen_model(&gen_dir, seed, &cfg))
            .await
            .context("gen-model task")?
            .with_context(|| format!("generating the devnet model in {}", dir.display()))?
    };
    progress.done(&format!(
        "generated the devnet model ({:?}, seed {}, {} parameters, vocab {}) in {} ({:.1} s)",
        opts.arch,
        opts.seed,
        report.parameters,
        report.vocab_size,
        dir.display(),
        t0.elapsed().as_secs_f64()
    ));
    let ck = Checkpoint::open(&dir, Precision::Bf16).context("loading the auditor's checkpoint")?;
    let spec_path = work.path().join("devnet-model_spec.json.gz");
    let weights = {
        let d = dir.clone();
        let spec_path = spec_path.clone();
        tokio::task::spawn_blocking(move || -> anyhow::Result<_> {
            let c = engy_core::commit::commit_checkpoint(
                &d,
                &engy_core::commit::CommitOptions::default(),
                &engy_core::commit::Progress::default(),
            )?;
            let spec = engy_core::commit::SpecFile::from_commitment(&c, 0.0);
            // The audit service's trusted spec of the devnet model (ENGY_AUDIT_SPECS).
            spec.write_gz(&spec_path)?;
            Ok(engy_model::cells::CommittedWeights::open(
                &d,
                c.model_root,
                engy_model::cells::Openings::Spec(Box::new(spec)),
            )?)
        })
        .await
        .context("commit task")?
        .context("committing the devnet checkpoint for the cell audit")?
    };
    let serve = engy_model::Model::load_with(&dir, Precision::Bf16, opts.serve_compute)
        .context("loading the red team's serve")?;
    let auditor = Arc::new(Auditor { ck, weights, serve });
    progress.done(&format!("model_root {}", auditor.ck.model_root));
    let phases = [
        PhaseSpec {
            name: "honest",
            precision: Precision::Bf16,
            expect: Verdict::Pass,
            cheat: false,
            cells: CellServe::Honest,
            cells_pass: true,
            caught_per_request: true,
        },
        PhaseSpec {
            name: "int4 cheat",
            precision: Precision::Int4 {
                group_size: opts.int4_group,
            },
            expect: Verdict::Cheat,
            cheat: true,
            cells: CellServe::Honest,
            cells_pass: false,
            caught_per_request: true,
        },
        PhaseSpec {
            name: FP8_EXPERTS,
            precision: Precision::Bf16,
            expect: Verdict::Pass,
            cheat: true,
            cells: CellServe::Fp8Experts,
            cells_pass: false,
            caught_per_request: false,
        },
        PhaseSpec {
            name: FABRICATED,
            precision: Precision::Bf16,
            expect: Verdict::Pass,
            cheat: true,
            cells: CellServe::FabricatedY,
            cells_pass: false,
            caught_per_request: true,
        },
    ];
    let mut service = match &opts.audit_bin {
        Some(bin) => {
            let front = GatewayFront::start().await?;
            let svc = AuditService::start(&ServiceOptions {
                bin: bin.clone(),
                checkpoint: dir.clone(),
                spec: Some(spec_path.clone()),
                gateway: Some(front.url().to_owned()),
                floor: requests(opts.gen_chunk).len() as u64,
                work: work.path().to_path_buf(),
            })
            .await
            .context("starting the audit service")?;
            progress.done(&format!(
                "audit service: engy-audit serve at {} (sqlite://{}, log {}), its cell \
                 challenges through the gateway front {}",
                svc.url(),
                svc.db().display(),
                svc.log().display(),
                front.url()
            ));
            Some(ServiceLink { svc, front })
        }
        None => None,
    };
    let mut out = DevnetRun {
        rows: Vec::new(),
        service: Vec::new(),
    };
    for spec in &phases {
        let (rows, summary) = phase(
            spec,
            &dir,
            work.path(),
            &auditor,
            opts,
            &progress,
            service.as_mut(),
        )
        .await?;
        out.rows.extend(rows);
        out.service.extend(summary);
    }
    if let Some(link) = service {
        link.svc
            .stop()
            .await
            .context("stopping the audit service")?;
    }
    Ok(out)
}

/// Whether the audit service's table is what the devnet expects: the honest miner audited on
/// every report with no cheat and no unanswered challenge, §8's gate holding; the int4 miner
/// audited on every report, caught on at least one, the gate firing.
pub fn service_ok(service: &[MinerSummary]) -> bool {
    let find = |m: &str| service.iter().find(|s| s.miner == m);
    let honest = find(SERVICE_HOTKEYS[0].0).is_some_and(|s| {
        s.audited == s.reported
            && s.reported > 0
            && s.cheat == 0
            && s.unanswered == 0
            && !s.gate_fires
    });
    let cheater = find(SERVICE_HOTKEYS[1].0)
        .is_some_and(|s| s.audited == s.reported && s.cheat > 0 && s.gate_fires);
    honest && cheater
}

/// The phase whose TOPLOC proofs pass but whose routed experts run in block FP8.
pub const FP8_EXPERTS: &str = "fp8 experts";

/// The phase whose TOPLOC proofs pass but whose cells are fabricated.
pub const FABRICATED: &str = "fabricated cells";

/// The result table, then one summary line per phase.
pub fn render_table(rows: &[DevnetRow]) -> String {
    let mut s = String::new();
    let header = format!(
        "{:<16} {:<17} {:<10} {:>6} {:>6} {:>6} {:>6} {:>8} {:>6} {:>9} {:>6} {:<7}  {}\n",
        "phase",
        "request",
        "mode",
        "prompt",
        "compl",
        "chunks",
        "proofB",
        "latency",
        "score",
        "routing",
        "cellsF",
        "toploc",
        "verdict"
    );
    s.push_str(&header);
    s.push_str(&"-".repeat(header.len().saturating_sub(1)));
    s.push('\n');
    for r in rows {
        s.push_str(&format!(
            "{:<16} {:<17} {:<10} {:>6} {:>6} {:>6} {:>6} {:>7.2}s {:>6} {:>9} {:>6} {:<7}  {}{}{}\n",
            r.phase,
            r.request,
            if r.stream { "stream" } else { "non-stream" },
            r.prompt_tokens,
            r.completion_tokens,
            r.chunks,
            r.proof_bytes,
            r.latency.as_secs_f64(),
            r.score.map(|x| format!("{x:.3}")).unwrap_or("-".into()),
            r.routing
                .map(|(a, _, n)| format!("{a}/{n}"))
                .unwrap_or("-".into()),
            r.cells
                .map(|(f, n)| format!("{f}/{n}"))
                .unwrap_or("-".into()),
            r.toploc.split(':').next().unwrap_or("-"),
            r.verdict,
            r.cells_reason
                .as_deref()
                .map(|w| format!(": {w}"))
                .unwrap_or_default(),
            if r.ok { "" } else { "   <-- UNEXPECTED" }
        ));
    }
    for (phase, want) in [
        ("honest", "pass"),
        ("int4 cheat", "cheat"),
        (FP8_EXPERTS, "cheat"),
        (FABRICATED, "cheat"),
    ] {
        let of: Vec<&DevnetRow> = rows.iter().filter(|r| r.phase == phase).collect();
        // The same words as the verdict column: a row counts when its verdict is `want`.
        let ok = of
            .iter()
            .filter(|r| r.verdict == want || (want == "cheat" && r.verdict.starts_with("cheat (")))
            .count();
        let scores: Vec<f64> = of.iter().filter_map(|r| r.score).collect();
        let (lo, hi) = scores
            .iter()
            .fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), &x| {
                (a.min(x), b.max(x))
            });
        s.push_str(&format!(
            "{phase}: {ok}/{} {want} (score {})\n",
            of.len(),
            if scores.is_empty() {
                "-".to_string()
            } else {
                format!("{lo:.3}..{hi:.3}")
            }
        ));
    }
    let honest_routing = rows
        .iter()
        .filter(|r| r.phase == "honest")
        .filter_map(|r| r.routing)
        .fold((0, 0, 0), |(a, n, b), (ra, rn, rb)| {
            (a + ra, n + rn, b + rb)
        });
    s.push_str(&format!(
        "routing: honest {}/{} tokens agree (near-ties {})\n",
        honest_routing.0, honest_routing.2, honest_routing.1
    ));
    let attacks: Vec<&RedTeamRow> = rows.iter().flat_map(|r| &r.red_team).collect();
    if !attacks.is_empty() {
        let honest_n = rows.iter().filter(|r| r.phase == "honest").count();
        let flagged = rows
            .iter()
            .filter(|r| r.phase == "honest" && r.verdict != "pass")
            .count();
        s.push_str(&format!(
            "red team (the cell audit; honest requests flagged: {flagged}/{honest_n})\n"
        ));
        for (phase, _) in [("int4 cheat", ()), (FP8_EXPERTS, ()), (FABRICATED, ())] {
            let of: Vec<&DevnetRow> = rows.iter().filter(|r| r.phase == phase).collect();
            let caught = of
                .iter()
                .filter(|r| r.cells.is_some_and(|(f, _)| f > 0))
                .count();
            s.push_str(&format!(
                "  {:<36} caught {caught}/{} requests (the serve)\n",
                format!("{phase} serve"),
                of.len()
            ));
        }
        for a in attacks {
            s.push_str(&format!(
                "  {:<36} {} 1/1 ({})\n",
                a.attack,
                match (a.cheat, a.caught) {
                    (true, true) => "caught",
                    (true, false) => "MISSED",
                    (false, false) => "passes",
                    (false, true) => "FLAGGED",
                },
                a.why
            ));
        }
    }
    for phase in ["honest", "int4 cheat", FP8_EXPERTS, FABRICATED] {
        let (failed, opened) = rows
            .iter()
            .filter(|r| r.phase == phase)
            .filter_map(|r| r.cells)
            .fold((0, 0), |(f, n), (rf, rn)| (f + rf, n + rn));
        s.push_str(&format!(
            "cells: {phase} {failed}/{opened} challenged cells failed\n"
        ));
    }
    s
}
