//! `engy-audit cells`: check a miner's cell audit bundle (specs/CELLS.md §7) against a
//! checkpoint whose touched weights are verified against a trusted `engy-commit/v1`
//! `model_root` (the logic is [`engy_model::cells::audit_bundle`]).
//!
//! Exit codes (docs/AUDITOR.md "Cells"): 0 every challenged cell opened and passed; 1 at least
//! one challenged cell failed or was not opened (cheat); 2 the bundle is refused (it opens a
//! cell its challenge did not choose, or one twice, or its `cells_root` is not `--cells-root`);
//! 3 the audit could not run (unreadable or malformed input, bad flags); 4 the checkpoint is
//! not the committed one (a touched unit's bytes do not match the trusted `model_root`, the
//! proofs or spec lead to another root, or `config.json` is not the committed config; nothing
//! is said about the miner).
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context;
use engy_core::cells::CellAuditBundle;
use engy_core::commit::{parse_digest, SpecFile};
use engy_model::cells::{
    audit_bundle, BundleAuditError, BundleReport, BundleVerdict, CellPolicy, CommittedWeights,
    Openings,
};
use engy_model::{LoadOptions, Model, Residency};

/// Arguments of `engy-audit cells`.
#[derive(clap::Args, Debug)]
pub struct CellsArgs {
    /// Checkpoint directory (config.json, *.safetensors) the request was served from.
    #[arg(long, env = "ENGY_CHECKPOINT", value_name = "DIR")]
    pub checkpoint: PathBuf,
    /// The cell audit bundle (JSON, specs/CELLS.md §7); `-` reads standard input.
    #[arg(long, value_name = "FILE")]
    pub bundle: PathBuf,
    /// Trusted engy-commit/v1 model_root (64 hex); needs --proofs, or --spec holding it.
    #[arg(long, value_name = "HEX", required_unless_present = "spec")]
    pub model_root: Option<String>,
    /// Spec file (model_spec.json.gz, or a directory holding one): its model_root is trusted
    /// (or must equal --model-root) and its unit roots check the touched units.
    #[arg(long, value_name = "FILE", conflicts_with = "proofs")]
    pub spec: Option<PathBuf>,
    /// Directory of opening proofs (`spec open` output, one unit per *.json) for the units
    /// the challenged cells touch (router, shared expert, experts of their layers).
    #[arg(long, value_name = "DIR", required_unless_present = "spec")]
    pub proofs: Option<PathBuf>,
    /// The cells_root of the commitment the challenge is for (64 hex); the bundle's must
    /// equal it.
    #[arg(long, value_name = "HEX")]
    pub cells_root: Option<String>,
    /// Largest relative L2 distance of a passing block output.
    #[arg(long, default_value_t = CellPolicy::default().y_rel)]
    pub y_rel: f32,
    /// Absolute routing near-tie margin (default: the architecture's).
    #[arg(long, env = "ENGY_AUDIT_ROUTING_MARGIN", value_name = "SCORE")]
    pub routing_margin: Option<f32>,
    /// Print the report as one JSON object.
    #[arg(long)]
    pub json: bool,
}

const EXIT_PASS: u8 = 0;
const EXIT_CHEAT: u8 = 1;
const EXIT_REFUSED: u8 = 2;
pub(crate) const EXIT_ERROR: u8 = 3;
const EXIT_WEIGHTS: u8 = 4;

/// What ended the run without a verdict.
enum Stop {
    Refused(String),
    Weights(String),
    Error(anyhow::Error),
}

impl From<anyhow::Error> for Stop {
    fn from(e: anyhow::Error) -> Self {
        Stop::Error(e)
    }
}

/// Runs `engy-audit cells` (exit codes in the module docs).
pub fn main(args: &CellsArgs) -> ExitCode {
    let report = match run(args) {
        Ok(r) => r,
        Err(Stop::Refused(why)) => {
            println!("verdict: refused ({why})");
            return ExitCode::from(EXIT_REFUSED);
        }
        Err(Stop::Weights(why)) => {
            eprintln!("engy-audit cells: error: {why}");
            eprintln!(
                "no verdict: this checkpoint is not the committed one; fetch the committed \
                 weights (spec verify names every differing unit) and run again"
            );
            return ExitCode::from(EXIT_WEIGHTS);
        }
        Err(Stop::Error(e)) => {
            eprintln!(
                "engy-audit cells: error: {}",
                engy_telemetry::cli::error_line(e.as_ref())
            );
            eprintln!("no verdict: fix the input above and run the audit again");
            return ExitCode::from(EXIT_ERROR);
        }
    };
    let code = match report.verdict {
        BundleVerdict::Pass => EXIT_PASS,
        BundleVerdict::Cheat => EXIT_CHEAT,
    };
    crate::emit("cells", &report, args.json, report_text, code, EXIT_ERROR)
}

fn run(args: &CellsArgs) -> Result<BundleReport, Stop> {
    let policy = CellPolicy {
        y_rel: args.y_rel,
        margin: args.routing_margin,
        ..CellPolicy::default()
    };
    if !(policy.y_rel.is_finite() && policy.y_rel > 0.0) {
        return Err(
            anyhow::anyhow!("--y-rel must be a finite fraction > 0, got {}", args.y_rel).into(),
        );
    }
    if let Some(m) = policy.margin {
        if !(m.is_finite() && m >= 0.0) {
            return Err(anyhow::anyhow!(
                "--routing-margin (ENGY_AUDIT_ROUTING_MARGIN) must be a finite score ≥ 0, got {m}"
            )
            .into());
        }
    }
    let text = if args.bundle.as_os_str() == "-" {
        std::io::read_to_string(std::io::stdin()).context("reading the bundle from stdin")?
    } else {
        std::fs::read_to_string(&args.bundle)
            .with_context(|| format!("reading {}", args.bundle.display()))?
    };
    let bundle: CellAuditBundle = serde_json::from_str(&text)
        .with_context(|| format!("{} is not a cell audit bundle", args.bundle.display()))?;
    if let Some(want) = &args.cells_root {
        let want = parse_digest(want).context("--cells-root")?;
        if bundle.cells_root.0 != want {
            return Err(Stop::Refused(format!(
                "the bundle's cells_root {} is not the commitment's {}",
                bundle.cells_root,
                hex::encode(want)
            )));
        }
    }
    let root = match &args.model_root {
        Some(h) => Some(parse_digest(h).context("--model-root")?),
        None => None,
    };
    let (root, openings) = match (&args.spec, &args.proofs) {
        (Some(path), _) => {
            let path = if path.is_dir() {
                path.join("model_spec.json.gz")
            } else {
                path.clone()
            };
            let spec = SpecFile::read(&path)
                .with_context(|| format!("reading spec file {}", path.display()))?;
            (
                root.unwrap_or(spec.model_root.0),
                Openings::Spec(Box::new(spec)),
            )
        }
        (None, Some(dir)) => {
            let root = root.context("--model-root is required with --proofs")?;
            let o = Openings::read_dir(dir)
                .with_context(|| format!("reading opening proofs in {}", dir.display()))?;
            (root, o)
        }
        (None, None) => return Err(anyhow::anyhow!("give --spec or --proofs").into()),
    };
    let weights =
        CommittedWeights::open(&args.checkpoint, root, openings).map_err(|e| match e {
            engy_model::cells::WeightCheckError::Checkpoint(_)
            | engy_model::cells::WeightCheckError::ProofFile { .. }
            | engy_model::cells::WeightCheckError::BadProofs(_) => Stop::Error(
                anyhow::Error::new(e).context(format!("opening {}", args.checkpoint.display())),
            ),
            other => Stop::Weights(other.to_string()),
        })?;
    let opts = LoadOptions {
        residency: Residency::Streaming,
        ..LoadOptions::default()
    };
    let model = Model::open(&args.checkpoint, &opts)
        .with_context(|| format!("opening checkpoint {}", args.checkpoint.display()))?;
    audit_bundle(&model, &weights, &bundle, &policy).map_err(|e| match e {
        BundleAuditError::Refused(e) => Stop::Refused(e.to_string()),
        BundleAuditError::Weights(e) => Stop::Weights(e.to_string()),
        BundleAuditError::Model(e) => {
            Stop::Error(anyhow::Error::new(e).context("recomputing the cells"))
        }
    })
}

/// The text report: the verdict line first, then the weights read, then one line per cell.
fn report_text(r: &BundleReport) -> String {
    use std::fmt::Write as _;
    let mut s = String::new();
    let verdict = match r.verdict {
        BundleVerdict::Pass => "pass",
        BundleVerdict::Cheat => "cheat",
    };
    let _ = writeln!(
        s,
        "verdict: {verdict} ({}/{} challenged cells failed)",
        r.failed, r.n
    );
    let _ = writeln!(
        s,
        "weights: {} units ({} bytes) checked against model_root",
        r.units_read, r.bytes_read
    );
    for c in &r.cells {
        let nums = c.check.as_ref().map_or(String::new(), |k| {
            format!(
                " logits {:.3}× tol, routing {}, y error {:.5}",
                k.logits_err,
                serde_json::to_value(k.routing)
                    .ok()
                    .and_then(|v| v.as_str().map(str::to_string))
                    .unwrap_or_default(),
                k.y_err
            )
        });
        let _ = writeln!(
            s,
            "  cell {} (position {}, layer {}): {}{nums}{}",
            c.index,
            c.position,
            c.layer,
            if c.pass() { "pass" } else { "FAIL" },
            if c.pass() {
                String::new()
            } else {
                format!(": {}", c.failures.join("; "))
            }
        );
    }
    s
}
