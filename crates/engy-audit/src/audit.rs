//! `engy-audit audit`: re-derive a miner commitment's hidden states from a checkpoint in one
//! teacher-forced pass and check its TOPLOC proofs (PROTOCOL.md §3.10, §4, §5; the rules are in
//! [`engy_model::audit`]). The checkpoint may be any architecture `engy_model::arch`
//! implements (`qwen3_moe`, `qwen3_5_moe`, `glm_moe_dsa`), in bf16, block FP8 or NVFP4; weights
//! are dequantised layer by layer from the mmapped shards (`--resident` keeps them decoded).
//! `--commitment` may be given several times: the checkpoint is opened once and the
//! commitments are audited one after the other, so with `--resident` the later audits reuse
//! the decoded weights (docs/AUDITOR.md "Several commitments in one run").
//!
//! Exit codes: 0 `pass`, 1 `cheat`, 2 `unproven` (the commitment is malformed or mis-shaped,
//! not UTF-8 JSON, or of another `model_root`: the reason is printed), 3 the audit itself
//! could not run (a usage error, `crate::usage`; an unreadable checkpoint or commitment file;
//! an unsupported architecture; a recompute that is not finite,
//! [`engy_model::ModelError::NonFinite`]). With several commitments: 1 when any is a
//! cheat, else 3 when any could not be audited, else 2 when any is unproven, else 0. A reader
//! that closes standard output early (`engy-audit audit … | head -1`) ends the printing
//! quietly; the exit code is still the verdict's.
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context;
use engy_model::audit::{
    audit_with, AuditParams, AuditReport, Recompute, RoutingAudit, RoutingPolicy, Verdict,
};
use engy_model::device::host_steps;
use engy_model::index_sets::IndexSetAudit;
use engy_model::{DeviceSpec, LoadOptions, Model, Residency};

/// Arguments of `engy-audit audit`.
#[derive(clap::Args, Debug)]
pub struct AuditArgs {
    /// Checkpoint directory (config.json, *.safetensors) the commitment claims to be served
    /// from. Its model_root covers config.json and the shards' names and sizes, not the weight
    /// bytes: verify them once per copy before acting on a cheat verdict (docs/AUDITOR.md
    /// "Checkpoint integrity").
    #[arg(long, env = "ENGY_CHECKPOINT", value_name = "DIR")]
    pub checkpoint: PathBuf,
    /// JSON file holding the commitment (PROTOCOL.md §3.10), or a gateway `response` frame
    /// containing it under "commitment"; `-` reads standard input (once). Give it several
    /// times to audit several commitments against the checkpoint opened once.
    #[arg(long, required = true, value_name = "FILE")]
    pub commitment: Vec<PathBuf>,
    /// Proof top-k the commitment must use (model spec `toploc_k`).
    #[arg(long, default_value_t = 128)]
    pub toploc_k: usize,
    /// A decode batch passes with at most this many exponent mismatches (model spec
    /// `toploc_v`).
    #[arg(long, default_value_t = 40)]
    pub toploc_v: u64,
    /// The commitment passes when at least this fraction of its batches pass (model spec
    /// `toploc_p`, above 0 and at most 1: at 0 every commitment would pass).
    #[arg(long, default_value_t = 0.99)]
    pub toploc_p: f64,
    /// Print the full report as one JSON object instead of text.
    #[arg(long)]
    pub json: bool,
    /// Keep every dequantised weight in memory instead of decoding each layer as it is used:
    /// f32 on the CPU (4 bytes per parameter), bf16 on a GPU (`--device cuda`, 2 bytes per
    /// parameter); faster for repeated passes.
    #[arg(long)]
    pub resident: bool,
    /// The activation dtype(s) of the recompute: `auto` recomputes in bf16 (as GPU serves
    /// compute) and, when that does not pass, on a block-FP8 checkpoint in W8A8 (bf16 with
    /// every FP8 product's input rows quantised per token and per 128-group to e4m3, as sglang
    /// serves FP8 checkpoints), then in f32, then in bf16 with transformers' eager attention,
    /// and passes when one does (docs/AUDITOR.md "Recomputes", "W8A8");
    /// `bf16`, `bf16-eager`, `f32` or `w8a8` run only that one. On a
    /// DSA architecture (GLM) a recompute that does not pass runs again with exactly tied index
    /// scores taken higher index first, when one of its top-k selections cut through a tie.
    #[arg(long, env = "ENGY_AUDIT_RECOMPUTE", value_enum, default_value_t = RecomputeArg::Auto)]
    pub recompute: RecomputeArg,
    /// Absolute near-tie margin of the routing check, in the architecture's router score
    /// units (default: the architecture's calibrated margin; docs/AUDITOR.md "Routing").
    #[arg(
        long,
        env = "ENGY_AUDIT_ROUTING_MARGIN",
        value_name = "SCORE",
        allow_negative_numbers = true
    )]
    pub routing_margin: Option<f32>,
    /// Largest fraction of (position, MoE layer) cells whose committed experts are outside the
    /// margin that still passes (0..=1).
    #[arg(
        long,
        env = "ENGY_AUDIT_MAX_ROUTING_MISMATCH",
        value_name = "FRACTION",
        default_value_t = engy_model::audit::DEFAULT_MAX_ROUTING_MISMATCH_RATE
    )]
    pub max_routing_mismatch: f64,
    /// Check a committed routing trace without replaying its near-ties (the recompute then
    /// always dispatches its own top-k).
    #[arg(long)]
    pub no_routing_replay: bool,
    /// The serve offers routing traces (it runs with --enable-return-routed-experts): a trace
    /// that is missing, malformed, of another shape or short of any position is a cheat, not
    /// "not replayed" (issue 39; docs/AUDITOR.md "Routing").
    #[arg(long)]
    pub serve_offers_routing: bool,
    /// Where the recompute runs: `cpu`, or `cuda` / `cuda:N` in a build with the `cuda`
    /// feature (docs/AUDITOR.md "On a GPU"). The verdict rules are the same on every device.
    #[arg(
        long,
        env = "ENGY_AUDIT_DEVICE",
        value_name = "DEVICE",
        default_value = "cpu"
    )]
    pub device: DeviceSpec,
    /// Audit up to N commitments in one pass over the weights: each decoder layer runs for
    /// all of them before the next, so streamed weights (no --resident) are read and decoded
    /// once per N commitments instead of once per commitment (docs/AUDITOR.md "Several
    /// commitments in one run"). Every report is the one the commitment gets alone; device
    /// memory grows with N by each commitment's activations (about 0.2 GB at 4,096 tokens of
    /// Qwen3.6 or GLM-5; no caches are kept), beside one layer's weights. A pass that runs out
    /// of device memory runs again in halves, down to one commitment.
    #[arg(
        long,
        env = "ENGY_AUDIT_BATCH",
        value_name = "N",
        default_value_t = 1,
        value_parser = clap::value_parser!(u16).range(1..=256)
    )]
    pub batch: u16,
}

/// `--recompute` values.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum RecomputeArg {
    /// bf16, then (block-FP8 checkpoints) W8A8, then f32, then bf16 with eager attention,
    /// until one passes.
    Auto,
    /// bf16 only (a fused kernel's attention).
    Bf16,
    /// bf16 with transformers' eager attention only.
    Bf16Eager,
    /// f32 only.
    F32,
    /// W8A8 only: bf16 with block-FP8 products' input rows quantised as sglang does.
    W8a8,
}

impl From<RecomputeArg> for Recompute {
    fn from(a: RecomputeArg) -> Self {
        match a {
            RecomputeArg::Auto => Recompute::Auto,
            RecomputeArg::Bf16 => Recompute::Bf16,
            RecomputeArg::Bf16Eager => Recompute::Bf16Eager,
            RecomputeArg::F32 => Recompute::F32,
            RecomputeArg::W8a8 => Recompute::W8a8,
        }
    }
}

/// Bytes per GiB, for memory in reports.
const GIB: f64 = (1u64 << 30) as f64;

const EXIT_PASS: u8 = 0;
const EXIT_CHEAT: u8 = 1;
const EXIT_UNPROVEN: u8 = 2;
pub(crate) const EXIT_ERROR: u8 = 3;

/// Runs `engy-audit audit` (exit codes in the module docs).
pub fn main(args: &AuditArgs) -> ExitCode {
    let several = args.commitment.len() > 1;
    let failed = |path: &std::path::Path, e: &anyhow::Error| {
        let what = if several {
            format!("{}: ", path.display())
        } else {
            String::new()
        };
        eprintln!(
            "engy-audit audit: error: {what}{}",
            engy_telemetry::cli::error_line(e.as_ref())
        );
        if several {
            eprintln!(
                "no verdict for {}; the other commitments are audited",
                path.display()
            );
        } else {
            eprintln!("no verdict: fix the input above and run the audit again");
        }
    };
    let params = match check_args(args) {
        Ok(p) => p,
        Err(e) => {
            eprintln!(
                "engy-audit audit: error: {}",
                engy_telemetry::cli::error_line(e.as_ref())
            );
            eprintln!("no verdict: fix the input above and run the audit again");
            return ExitCode::from(EXIT_ERROR);
        }
    };
    // Every commitment is read before the checkpoint is opened (which may decode all of it),
    // and a file that cannot be read is reported then: a wrong path fails at once.
    let texts: Vec<anyhow::Result<Vec<u8>>> =
        args.commitment.iter().map(|p| read_commitment(p)).collect();
    for (path, text) in args.commitment.iter().zip(&texts) {
        if let Err(e) = text {
            failed(path, e);
        }
    }
    if texts.iter().all(|t| t.is_err()) {
        return ExitCode::from(EXIT_ERROR);
    }
    let (model, model_root) = match open_model(args) {
        Ok(r) => r,
        Err(e) => {
            eprintln!(
                "engy-audit audit: error: {}",
                engy_telemetry::cli::error_line(e.as_ref())
            );
            eprintln!("no verdict: fix the input above and run the audit again");
            return ExitCode::from(EXIT_ERROR);
        }
    };
    let mut codes = Vec::with_capacity(args.commitment.len());
    let all: Vec<usize> = (0..args.commitment.len()).collect();
    for group in all.chunks(usize::from(args.batch.max(1))) {
        let mut outcomes = if group.len() > 1 {
            audit_group(args, &model, &model_root, &params, group, &texts)
        } else {
            Vec::new()
        };
        outcomes.resize_with(group.len(), || None);
        for (&i, batched) in group.iter().zip(outcomes) {
            let (path, text) = (&args.commitment[i], &texts[i]);
            let outcome = match (text, batched) {
                // Reported above; with --json it still gets its line, in its turn.
                (Err(e), _) => Err(engy_telemetry::cli::error_line(e.as_ref())),
                (Ok(_), Some(Ok(report))) => Ok(report),
                (Ok(_), Some(Err(e))) => {
                    failed(path, &e);
                    Err(engy_telemetry::cli::error_line(e.as_ref()))
                }
                (Ok(text), None) => audit_one(args, &model, &model_root, &params, path, text)
                    .map_err(|e| {
                        failed(path, &e);
                        engy_telemetry::cli::error_line(e.as_ref())
                    }),
            };
            let report = match outcome {
                Ok(report) => report,
                Err(error) => {
                    if several && args.json {
                        let line = Failed {
                            commitment: path.display().to_string(),
                            error,
                        };
                        crate::emit_code("audit", &line, true, |_| String::new(), 0, 0);
                    }
                    codes.push(EXIT_ERROR);
                    continue;
                }
            };
            let code = match report.verdict {
                Verdict::Pass => EXIT_PASS,
                Verdict::Cheat => EXIT_CHEAT,
                Verdict::Unproven { .. } => EXIT_UNPROVEN,
            };
            let code = if several {
                // Each report names its commitment: a header line in text, a field in JSON.
                let named = Named {
                    commitment: path.display().to_string(),
                    report: &report,
                };
                let text = |n: &Named<'_>| {
                    format!("commitment: {}\n{}", n.commitment, report_text(n.report))
                };
                crate::emit_code("audit", &named, args.json, text, code, EXIT_ERROR)
            } else {
                crate::emit_code("audit", &report, args.json, report_text, code, EXIT_ERROR)
            };
            codes.push(code);
        }
    }
    ExitCode::from(combined_code(&codes))
}

/// A report with the commitment file it is about, for runs of several commitments.
#[derive(serde::Serialize)]
struct Named<'a> {
    commitment: String,
    #[serde(flatten)]
    report: &'a AuditReport,
}

/// The `--json` line of a commitment that could not be audited, in a run of several (so
/// that a reader gets one line per `--commitment`): the file and the error, no verdict.
#[derive(serde::Serialize)]
struct Failed {
    commitment: String,
    error: String,
}

/// The exit code of a run of several audits from theirs: a cheat first (it is what the run
/// is for), then an audit that could not run, then an unproven commitment, else pass.
fn combined_code(codes: &[u8]) -> u8 {
    [EXIT_CHEAT, EXIT_ERROR, EXIT_UNPROVEN]
        .into_iter()
        .find(|c| codes.contains(c))
        .unwrap_or(EXIT_PASS)
}

/// The audit parameters from the flags, checked.
fn check_args(args: &AuditArgs) -> anyhow::Result<AuditParams> {
    anyhow::ensure!(
        args.toploc_p > 0.0 && args.toploc_p <= 1.0,
        "--toploc-p must be above 0 and at most 1 (at 0 every commitment passes), got {}",
        args.toploc_p
    );
    anyhow::ensure!(args.toploc_k > 0, "--toploc-k must be at least 1");
    anyhow::ensure!(
        (0.0..=1.0).contains(&args.max_routing_mismatch),
        "--max-routing-mismatch (ENGY_AUDIT_MAX_ROUTING_MISMATCH) must be within 0..=1, got {}",
        args.max_routing_mismatch
    );
    if let Some(m) = args.routing_margin {
        anyhow::ensure!(
            m.is_finite() && m >= 0.0,
            "--routing-margin (ENGY_AUDIT_ROUTING_MARGIN) must be a finite score ≥ 0, got {m}"
        );
    }
    let stdin = args
        .commitment
        .iter()
        .filter(|p| p.as_os_str() == "-")
        .count();
    anyhow::ensure!(
        stdin <= 1,
        "--commitment - (standard input) can be given once, got it {stdin} times"
    );
    Ok(AuditParams {
        toploc_k: args.toploc_k,
        toploc_v: args.toploc_v,
        toploc_p: args.toploc_p,
        routing: RoutingPolicy {
            margin: args.routing_margin,
            max_mismatch_rate: args.max_routing_mismatch,
            replay: !args.no_routing_replay,
            require_trace: args.serve_offers_routing,
        },
    })
}

/// The checkpoint opened on the device, and its `model_root`.
fn open_model(args: &AuditArgs) -> anyhow::Result<(Model, String)> {
    let opts = LoadOptions {
        residency: if args.resident {
            Residency::Resident
        } else {
            Residency::Streaming
        },
        device: args.device,
        ..LoadOptions::default()
    };
    let model = Model::open(&args.checkpoint, &opts).map_err(|e| {
        // Name the setting at fault: the device when it is the device, else the checkpoint.
        let flag = match e {
            engy_model::ModelError::Device(_) => "--device / ENGY_AUDIT_DEVICE",
            _ => "--checkpoint / ENGY_CHECKPOINT",
        };
        anyhow::Error::new(e).context(format!(
            "opening checkpoint {} on {} ({flag})",
            args.checkpoint.display(),
            args.device
        ))
    })?;
    let model_root = engy_core::identity::model_root(&args.checkpoint)
        .with_context(|| format!("model_root of {}", args.checkpoint.display()))?;
    Ok((model, model_root))
}

/// The bytes of the commitment file `path` (`-`: standard input). What they hold is the
/// miner's and judged by [`audit_one`]: bytes that are not UTF-8 JSON make the commitment
/// unproven, not the run an error.
fn read_commitment(path: &std::path::Path) -> anyhow::Result<Vec<u8>> {
    if path.as_os_str() == "-" {
        let mut bytes = Vec::new();
        std::io::Read::read_to_end(&mut std::io::stdin(), &mut bytes)
            .context("reading the commitment from stdin")?;
        Ok(bytes)
    } else {
        std::fs::read(path).with_context(|| format!("reading {}", path.display()))
    }
}

/// The commitment file's bytes as JSON, or the unproven report when they are not UTF-8 JSON
/// (the commitment is the miner's: the audit itself worked).
fn parse_commitment(
    text: &[u8],
    params: &AuditParams,
) -> Result<serde_json::Value, Box<AuditReport>> {
    // A UTF-8 byte order mark is not JSON, but RFC 8259 §8.1 lets a parser ignore it.
    let text = text.strip_prefix(b"\xEF\xBB\xBF").unwrap_or(text);
    serde_json::from_slice(text).map_err(|e| {
        Box::new(AuditReport::unproven(
            format!("the commitment file is not UTF-8 JSON: {e}"),
            *params,
        ))
    })
}

/// The commitments `group` (indices into `--commitment`) audited in one pass over the
/// weights ([`engy_model::audit::audit_many`]): one outcome per index, `None` for a file
/// that could not be read (reported already) and, when the pass fails, for every commitment
/// it held: the caller audits those one by one, each with its own report or error.
fn audit_group(
    args: &AuditArgs,
    model: &Model,
    model_root: &str,
    params: &AuditParams,
    group: &[usize],
    texts: &[anyhow::Result<Vec<u8>>],
) -> Vec<Option<anyhow::Result<AuditReport>>> {
    let mut out: Vec<Option<anyhow::Result<AuditReport>>> = Vec::with_capacity(group.len());
    let mut values = Vec::new();
    let mut slots = Vec::new();
    for &i in group {
        match &texts[i] {
            Err(_) => out.push(None),
            Ok(text) => match parse_commitment(text, params) {
                Err(report) => out.push(Some(Ok(*report))),
                Ok(v) => {
                    slots.push(out.len());
                    values.push(v);
                    out.push(None);
                }
            },
        }
    }
    if values.is_empty() {
        return out;
    }
    let started = std::time::Instant::now();
    let splits_before = engy_model::device::batch_splits();
    match engy_model::audit::audit_many(model, model_root, &values, params, args.recompute.into()) {
        Ok(reports) => {
            for (slot, report) in slots.iter().zip(reports) {
                out[*slot] = Some(Ok(report));
            }
        }
        // Their slots stay `None`: the caller audits each alone, so one commitment's error
        // (one too long for the device even alone, say) is its own, not the group's. No
        // timing line: nothing was recomputed.
        Err(e) => {
            eprintln!(
                "engy-audit audit: recomputing {} commitments in one pass failed: {}; auditing \
                 them one by one",
                values.len(),
                engy_telemetry::cli::error_line(&e)
            );
            return out;
        }
    }
    if args.device != DeviceSpec::Cpu {
        let splits = engy_model::device::batch_splits() - splits_before;
        let note = if splits > 0 {
            format!(
                " (out of device memory, the pass was split in halves {splits} time(s): a \
                 smaller --batch fits this device)"
            )
        } else {
            String::new()
        };
        eprintln!(
            "engy-audit audit: {} commitments recomputed in one pass on {} in {:.3} s{note}",
            values.len(),
            args.device,
            started.elapsed().as_secs_f64()
        );
    }
    out
}

/// Audits the commitment file's bytes `text`, read from `path`.
fn audit_one(
    args: &AuditArgs,
    model: &Model,
    model_root: &str,
    params: &AuditParams,
    path: &std::path::Path,
    text: &[u8],
) -> anyhow::Result<AuditReport> {
    let value = match parse_commitment(text, params) {
        Ok(v) => v,
        Err(report) => return Ok(*report),
    };
    let steps_before = host_steps();
    let retries_before = engy_model::device::memory_retries();
    let profile_before = engy_model::device::profile();
    let started = std::time::Instant::now();
    let report = audit_with(model, model_root, &value, params, args.recompute.into())
        .context("recomputing hidden states")?;
    // On a GPU only (a CPU audit stays quiet on stderr), and on stderr, so the report on
    // stdout reads the same on every device. Counts and times are this audit's own.
    if args.device == DeviceSpec::Cpu {
        return Ok(report);
    }
    let host: Vec<String> = host_steps()
        .iter()
        .zip(steps_before)
        .filter(|((_, n), (_, b))| n > b)
        .map(|((step, n), (_, b))| format!("{} {}", step.label(), n - b))
        .collect();
    for (name, secs, calls) in engy_model::device::profile() {
        let (s0, c0) = profile_before
            .iter()
            .find(|(n, _, _)| *n == name)
            .map_or((0.0, 0), |(_, s, c)| (*s, *c));
        if calls > c0 {
            eprintln!(
                "engy-audit audit: profile: {name:<24} {:>8.3} s  ({} calls)",
                secs - s0,
                calls - c0
            );
        }
    }
    let peak = engy_model::device::profile_peak_memory();
    if peak > 0 {
        eprintln!(
            "engy-audit audit: profile: device memory in use, most {:.1} GiB",
            peak as f64 / GIB
        );
    }
    let what = if args.commitment.len() > 1 {
        format!("{}: ", path.display())
    } else {
        String::new()
    };
    let mut notes = Vec::new();
    if !host.is_empty() {
        notes.push(format!("steps done on the host: {}", host.join(", ")));
    }
    let retries = engy_model::device::memory_retries() - retries_before;
    if retries > 0 {
        notes.push(format!(
            "{retries} recompute(s) ran out of device memory beside the resident weights and ran \
             again without them, which the next audit reads again"
        ));
    }
    let in_use = args.device.device().ok();
    if let Some(m) = in_use.as_ref().and_then(engy_model::device::memory_in_use) {
        notes.push(format!(
            "device memory in use after it: {:.1} GiB",
            m as f64 / GIB
        ));
    }
    eprintln!(
        "engy-audit audit: {what}recomputed on {} in {:.3} s{}",
        args.device,
        started.elapsed().as_secs_f64(),
        if notes.is_empty() {
            String::new()
        } else {
            format!(" ({})", notes.join("; "))
        }
    );
    Ok(report)
}

/// The text report: the verdict line first (so `| head -1` is the verdict), then the score
/// and one line per decode batch.
fn report_text(r: &AuditReport) -> String {
    use std::fmt::Write as _;
    let mut s = String::new();
    // Writing to a String cannot fail.
    let _ = match &r.verdict {
        Verdict::Unproven { reason } => writeln!(s, "verdict: unproven ({reason})"),
        v => writeln!(s, "verdict: {}", v.label()),
    };
    let Some(score) = r.score else {
        return s;
    };
    let _ = writeln!(
        s,
        "score: {score:.4} (mean exponent mismatches / topk {}), {}/{} batches within \
         toploc_v {}, pass ratio required {}",
        r.params.toploc_k,
        r.passing_batches,
        r.batches.iter().filter(|b| b.judged).count(),
        r.params.toploc_v,
        r.params.toploc_p
    );
    if let Some(c) = r.compute {
        let tried: Vec<String> = r
            .recomputes
            .iter()
            .map(|o| {
                let attention = match o.attention {
                    engy_model::arch::AttentionKernel::Eager => " (eager attention)",
                    engy_model::arch::AttentionKernel::Sdpa => "",
                };
                let ties = match o.dsa_ties {
                    engy_model::arch::TieOrder::HigherFirst => " (DSA ties higher-first)",
                    engy_model::arch::TieOrder::LowerFirst => "",
                };
                let cut = match (o.dsa_boundary_ties, o.dsa_ties, o.verdict) {
                    (Some(0), engy_model::arch::TieOrder::LowerFirst, "cheat") => {
                        "; no DSA top-k cut through a tie, so ties higher-first compute the \
                         same (not run)"
                            .to_string()
                    }
                    (Some(0), ..) => "; no DSA top-k cut through a tie".to_string(),
                    (Some(1), ..) => "; 1 DSA top-k row cut through a tie".to_string(),
                    (Some(n), ..) => format!("; {n} DSA top-k rows cut through a tie"),
                    (None, ..) => String::new(),
                };
                format!(
                    "{}{attention}{ties} {} (max {} mismatches in a batch{cut})",
                    o.compute.label(),
                    o.verdict,
                    o.max_exp_mismatches
                )
            })
            .collect();
        let _ = writeln!(
            s,
            "recompute: {}{} reported; tried: {}",
            c.label(),
            match r.attention {
                Some(engy_model::arch::AttentionKernel::Eager) => " (eager attention)",
                _ => "",
            },
            tried.join(", ")
        );
    }
    match &r.routing {
        Some(RoutingAudit::Checked(g)) => {
            let t = g.totals;
            let _ = writeln!(
                s,
                "routing: {}/{} (position, MoE layer) cells agree, {} near-ties ({} replayed, \
                 margin {} + {}·|score|), {} mismatches (rate {:.4}, at most {} passes)",
                t.agree,
                t.compared,
                t.near_tie,
                t.replayed,
                g.margin.abs,
                g.margin.rel,
                t.mismatch,
                g.mismatch_rate,
                g.max_mismatch_rate
            );
            if let Some(d) = &g.first_divergence {
                let _ = writeln!(
                    s,
                    "  first divergence: position {}, layer {}: committed {:?}, recomputed {:?}, gap {}",
                    d.position, d.layer, d.committed, d.own, d.gap
                );
            }
        }
        Some(RoutingAudit::NotReplayed { reason }) => {
            let _ = writeln!(s, "routing: not replayed ({reason})");
        }
        None => {}
    }
    match &r.index_sets {
        Some(IndexSetAudit::Compared(x)) => {
            let worst = x
                .worst
                .as_ref()
                .map(|w| {
                    format!(
                        ", lowest {:.4} at position {} layer {}",
                        w.overlap, w.position, w.layer
                    )
                })
                .unwrap_or_default();
            let _ = writeln!(
                s,
                "dsa index sets: {}/{} (position, layer) sets identical, mean overlap {:.4}{worst} \
                 (reported, not part of the verdict)",
                x.identical, x.compared, x.mean_overlap
            );
        }
        Some(IndexSetAudit::NotCompared { reason }) => {
            let _ = writeln!(s, "dsa index sets: not compared ({reason})");
        }
        None => {}
    }
    let _ = writeln!(
        s,
        "prompt tokens {}, proven output rows {}, proof bytes {}",
        r.prompt_tokens, r.n_tokens, r.proof_bytes
    );
    for (i, b) in r.batches.iter().enumerate() {
        let mantissa = match (b.mant_err_mean, b.mant_err_median) {
            (Some(mean), Some(median)) => {
                format!("mantissa error mean {mean:.2} median {median:.0}")
            }
            _ => "mantissa error n/a (no exponent matched)".to_string(),
        };
        let outcome = match (b.judged, b.pass) {
            (true, true) => "pass",
            (true, false) => "FAIL",
            (false, _) => "not judged (too few values for a sparse top-k)",
        };
        let _ = writeln!(
            s,
            "  batch {i}: {} rows, {} exponent mismatches, {mantissa} -> {outcome}",
            b.rows, b.exp_mismatches,
        );
    }
    s
}
