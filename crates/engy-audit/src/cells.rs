//! `engy-audit cells`: the sampled cell audit of one request (specs/CELLS.md §5, §7;
//! docs/PROTOCOL.md §10). The auditor owns the challenge: from the commitment as the miner sent
//! it (`--commitment`), it takes the request's token ids and `commitment.cells`, derives the
//! request's shape (token ids + the committed model config), the seed (`--beacon` →
//! [`engy_core::cells::production_seed`], or its own `--seed`) and `n` (`--cells-n`, its
//! policy); the miner's answer (`--bundle`, or `--declined` when it refused or did not answer)
//! must be an answer to exactly that challenge. Then each challenged cell is checked against a
//! checkpoint whose touched weights are verified against a trusted `engy-commit/v1`
//! `model_root` ([`engy_model::cells`]).
//!
//! Exit codes (docs/AUDITOR.md "Cells"): 0 every challenged cell opened and passed; 1 a cheat:
//! a challenged cell failed or was not opened, the bundle does not answer the auditor's
//! challenge (another root, shape, seed or `n`, an unchosen or repeated opening, more than
//! 64 MiB), the commitment's shape is not the request's, the miner declined or did not answer
//! inside the retention window, or a serve that offers cells committed none; 2 not judged
//! (a commitment without cells from a serve not known to offer them, or a refusal after the
//! retention window); 3 the audit could not run (unreadable or malformed input, bad flags);
//! 4 the checkpoint is not the committed one (a touched unit's bytes do not match the trusted
//! `model_root`, the proofs or spec lead to another root, or `config.json` is not the
//! committed config; nothing is said about the miner).
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context;
use engy_core::cells::{
    challenge_n, commitment_digest, parse_bundle, production_seed, BundleError, CellShape,
    Challenge, LogitsDtype, DEFAULT_CHALLENGE_CELLS, MIN_CHALLENGE_CELLS, RETENTION_WINDOW_S,
};
use engy_core::commit::{parse_digest, SpecFile};
use engy_core::wire::{CellsCommitment, Commitment};
use engy_model::cells::{
    audit_bundle_with_recompute, BundleAuditError, BundleReport, BundleVerdict, CellPolicy,
    CommittedWeights, Openings,
};
use engy_model::{LoadOptions, Model, Residency};
use serde::Serialize;

/// Arguments of `engy-audit cells`.
#[derive(clap::Args, Debug)]
pub struct CellsArgs {
    /// Checkpoint directory (config.json, *.safetensors) the request was served from.
    #[arg(long, env = "ENGY_CHECKPOINT", value_name = "DIR")]
    pub checkpoint: PathBuf,
    /// The commitment (docs/PROTOCOL.md §3.10) exactly as the miner's `response` carried it:
    /// the file holds the `commitment` JSON value (surrounding whitespace ignored); its SHA-256
    /// is the commitment digest the seed mixes in, its ids are the request's tokens.
    #[arg(long, value_name = "FILE")]
    pub commitment: PathBuf,
    /// The beacon (64 hex: a block hash or drand randomness produced after the response): the
    /// seed is production_seed(beacon, SHA-256 of the commitment) (specs/CELLS.md §5).
    #[arg(
        long,
        value_name = "HEX",
        required_unless_present = "seed",
        conflicts_with = "seed"
    )]
    pub beacon: Option<String>,
    /// The auditor's own random seed (64 hex), drawn after the commitment, instead of a beacon.
    #[arg(long, value_name = "HEX")]
    pub seed: Option<String>,
    /// Cells to challenge (the auditor's policy): at least the minimum, 32; the challenge
    /// opens min(N, the request's cells, 256).
    #[arg(long, value_name = "N", default_value_t = DEFAULT_CHALLENGE_CELLS)]
    pub cells_n: u64,
    /// The miner's answer: a cell audit bundle (JSON, specs/CELLS.md §7); `-` reads standard
    /// input.
    #[arg(
        long,
        value_name = "FILE",
        required_unless_present = "declined",
        conflicts_with = "declined"
    )]
    pub bundle: Option<PathBuf>,
    /// The miner answered `open_cells` with `cells_error` (`unknown-request`,
    /// `bad-challenge`) or not at all by the deadline (`no-answer`): a cheat inside the
    /// retention window (docs/PROTOCOL.md §10 "Retention").
    #[arg(long, value_enum, value_name = "HOW")]
    pub declined: Option<Declined>,
    /// Seconds between the miner's response and the challenge (`open_cells`); a refusal after
    /// the 600 s retention window is not judged.
    #[arg(long, value_name = "SECONDS", default_value_t = 0)]
    pub challenge_age_s: u64,
    /// The serve this commitment came from offers cells (its miner runs with cells on): a
    /// commitment without `cells` is then a cheat, not "nothing to audit".
    #[arg(long)]
    pub serve_offers_cells: bool,
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
    /// The cells_root the auditor recorded for this request (64 hex), when it has one apart
    /// from the commitment file: the commitment's must equal it.
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

/// How a miner declined a challenge (`--declined`).
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Declined {
    /// `cells_error unknown_request`.
    UnknownRequest,
    /// `cells_error bad_challenge` (the auditor's challenge is valid by construction).
    BadChallenge,
    /// No answer by the deadline.
    NoAnswer,
}

impl Declined {
    fn words(self) -> &'static str {
        match self {
            Declined::UnknownRequest => "answered cells_error unknown_request",
            Declined::BadChallenge => "answered cells_error bad_challenge to a valid challenge",
            Declined::NoAnswer => "did not answer by the deadline",
        }
    }
}

const EXIT_PASS: u8 = 0;
const EXIT_CHEAT: u8 = 1;
const EXIT_NOT_JUDGED: u8 = 2;
pub(crate) const EXIT_ERROR: u8 = 3;
const EXIT_WEIGHTS: u8 = 4;

/// What ended the run without a verdict.
enum Stop {
    Weights(String),
    Error(anyhow::Error),
}

/// The verdict of `engy-audit cells`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Verdict {
    /// Every challenged cell opened and passed.
    Pass,
    /// A failed audit (the reason, or the failed cells).
    Cheat,
    /// Nothing to judge (module docs, exit 2).
    NotJudged,
}

/// The auditor's challenge, as reported.
#[derive(Debug, Clone, Serialize)]
pub struct ChallengeReport {
    /// The commitment's `cells_root` (hex).
    pub cells_root: String,
    /// The seed (hex).
    pub seed: String,
    /// Cells challenged.
    pub n: u64,
    /// The request's cells.
    pub n_cells: u64,
}

/// The report of `engy-audit cells` (`--json`: this object).
#[derive(Debug, Clone, Serialize)]
pub struct CellsReport {
    /// The verdict.
    pub verdict: Verdict,
    /// Why, when the verdict came before any cell was checked (a declined or mismatched
    /// answer, a commitment without cells or of another shape); `None` when the cells decided.
    pub reason: Option<String>,
    /// The auditor's challenge, once it could be drawn.
    pub challenge: Option<ChallengeReport>,
    /// The challenged cells' check, when a bundle answered the challenge.
    pub bundle: Option<BundleReport>,
}

impl CellsReport {
    fn early(verdict: Verdict, reason: String, challenge: Option<ChallengeReport>) -> Self {
        Self {
            verdict,
            reason: Some(reason),
            challenge,
            bundle: None,
        }
    }
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
        Verdict::Pass => EXIT_PASS,
        Verdict::Cheat => EXIT_CHEAT,
        Verdict::NotJudged => EXIT_NOT_JUDGED,
    };
    crate::emit("cells", &report, args.json, report_text, code, EXIT_ERROR)
}

/// Reads a file (or standard input for `-`) of at most `cap` bytes.
fn read_capped(path: &std::path::Path, cap: usize, what: &str) -> anyhow::Result<Vec<u8>> {
    use std::io::Read as _;
    let mut buf = Vec::new();
    let limit = cap as u64 + 1;
    if path.as_os_str() == "-" {
        std::io::stdin()
            .take(limit)
            .read_to_end(&mut buf)
            .with_context(|| format!("reading the {what} from stdin"))?;
    } else {
        std::fs::File::open(path)
            .and_then(|f| f.take(limit).read_to_end(&mut buf))
            .with_context(|| format!("reading {}", path.display()))?;
    }
    Ok(buf)
}

/// Largest commitment file read (a commitment is a few MB at most: TOPLOC proofs, traces).
const MAX_COMMITMENT_BYTES: usize = 256 << 20;

/// The request's shape as the auditor derives it (specs/CELLS.md §3 "A request's shape"):
/// positions and tokens from `ids`, the MoE layers from the committed checkpoint, the sizes
/// from the model's config; `dtype` is the serve's (either code is the request's).
fn request_shape(
    model: &Model,
    weights: &CommittedWeights,
    ids: &[u32],
    dtype: LogitsDtype,
) -> anyhow::Result<CellShape> {
    let rs = model
        .routing_shape()
        .context("the checkpoint has no MoE layers: it has no cells")?;
    let layers: Vec<u32> = (0..rs.layers as u32)
        .filter(|&l| weights.is_moe_layer(l))
        .collect();
    CellShape::for_request(
        ids,
        layers,
        model.config().hidden_size as u32,
        rs.experts as u32,
        rs.top_k as u32,
        dtype,
    )
    .context("the model's cell shape")
}

fn run(args: &CellsArgs) -> Result<CellsReport, Stop> {
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
    if args.cells_n < MIN_CHALLENGE_CELLS {
        return Err(anyhow::anyhow!(
            "--cells-n {} is below the minimum {MIN_CHALLENGE_CELLS} cells a challenge (specs/CELLS.md §5)",
            args.cells_n
        )
        .into());
    }
    // The commitment, as the miner sent it: its digest and the request's tokens.
    let raw = read_capped(&args.commitment, MAX_COMMITMENT_BYTES, "commitment")?;
    if raw.len() > MAX_COMMITMENT_BYTES {
        return Err(anyhow::anyhow!(
            "{} is larger than {MAX_COMMITMENT_BYTES} bytes",
            args.commitment.display()
        )
        .into());
    }
    let trimmed = raw.trim_ascii();
    let digest = commitment_digest(trimmed);
    let commitment: Commitment = serde_json::from_slice(trimmed).with_context(|| {
        format!(
            "{} is not a commitment (docs/PROTOCOL.md §3.10)",
            args.commitment.display()
        )
    })?;
    let seed = match (&args.beacon, &args.seed) {
        (Some(b), _) => production_seed(&parse_digest(b).context("--beacon")?, &digest),
        (None, Some(s)) => parse_digest(s).context("--seed")?,
        (None, None) => return Err(anyhow::anyhow!("give --beacon or --seed").into()),
    };
    let ids: Vec<u32> = commitment
        .toploc
        .prompt_ids
        .iter()
        .chain(&commitment.output_token_ids)
        .copied()
        .collect();
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

    // commitment.cells: absent is a cheat from a serve that offers cells.
    let Some(cells) = commitment.cells.as_ref() else {
        let (verdict, why) = if args.serve_offers_cells {
            (
                Verdict::Cheat,
                "the commitment carries no cells, from a serve that offers them",
            )
        } else {
            (
                Verdict::NotJudged,
                "the commitment carries no cells (give --serve-offers-cells when its serve offers them)",
            )
        };
        return Ok(CellsReport::early(verdict, why.to_string(), None));
    };
    let (shape_ok, want) = match commitment_shape(&model, &weights, &ids, cells) {
        Ok(s) => (Ok(()), s),
        Err(e) => (Err(e), None),
    };
    if let Err(why) = shape_ok {
        return Ok(CellsReport::early(Verdict::Cheat, why, None));
    }
    let Some(shape) = want else {
        return Err(anyhow::anyhow!("no request shape").into());
    };
    if let Some(h) = &args.cells_root {
        let recorded = parse_digest(h).context("--cells-root")?;
        if recorded != cells.root.0 {
            return Ok(CellsReport::early(
                Verdict::Cheat,
                format!(
                    "the commitment's cells_root {} is not the one recorded for this request, {}",
                    cells.root,
                    hex::encode(recorded)
                ),
                None,
            ));
        }
    }
    let n_cells = shape.n_cells();
    let challenge = Challenge {
        cells_root: cells.root.0,
        shape,
        seed,
        n: challenge_n(args.cells_n, n_cells),
    };
    let challenge_report = ChallengeReport {
        cells_root: cells.root.to_string(),
        seed: hex::encode(seed),
        n: challenge.n,
        n_cells,
    };

    // The miner's answer.
    let bundle_path = match (args.declined, &args.bundle) {
        (Some(how), _) => {
            return Ok(if args.challenge_age_s <= RETENTION_WINDOW_S {
                CellsReport::early(
                    Verdict::Cheat,
                    format!(
                        "the miner {} {} s after its response, inside the {RETENTION_WINDOW_S} s retention window",
                        how.words(),
                        args.challenge_age_s
                    ),
                    Some(challenge_report),
                )
            } else {
                CellsReport::early(
                    Verdict::NotJudged,
                    format!(
                        "the miner {} {} s after its response, past the {RETENTION_WINDOW_S} s retention window",
                        how.words(),
                        args.challenge_age_s
                    ),
                    Some(challenge_report),
                )
            });
        }
        (None, Some(p)) => p,
        (None, None) => return Err(anyhow::anyhow!("give --bundle or --declined").into()),
    };
    let bytes = read_capped(bundle_path, engy_core::cells::MAX_BUNDLE_BYTES, "bundle")?;
    let bundle = match parse_bundle(&bytes) {
        Ok(b) => b,
        Err(e @ BundleError::TooLarge { .. }) => {
            return Ok(CellsReport::early(
                Verdict::Cheat,
                format!("the answer is not a bundle an auditor reads: {e}"),
                Some(challenge_report),
            ))
        }
        Err(e) => {
            return Err(anyhow::Error::new(e)
                .context(format!(
                    "{} is not a cell audit bundle",
                    bundle_path.display()
                ))
                .into())
        }
    };
    if let Err(e) = bundle.check_challenge(&challenge) {
        return Ok(CellsReport::early(
            Verdict::Cheat,
            format!("the bundle does not answer the auditor's challenge: {e}"),
            Some(challenge_report),
        ));
    }
    // Each challenged cell's x bound to the auditor's own recompute of the request's tokens
    // (engy_model::cells::audit_bundle_with_recompute); the recompute routes by its own
    // scores (the commitment's routing trace is checked by `engy-audit audit`).
    let report = audit_bundle_with_recompute(&model, &weights, &bundle, &ids, None, &policy)
        .map_err(|e| match e {
            BundleAuditError::Refused(e) => Stop::Error(anyhow::anyhow!(
                "the bundle answered the challenge, then was refused: {e}"
            )),
            BundleAuditError::Weights(e) => Stop::Weights(e.to_string()),
            BundleAuditError::Model(e) => {
                Stop::Error(anyhow::Error::new(e).context("recomputing the cells"))
            }
        })?;
    Ok(CellsReport {
        verdict: match report.verdict {
            BundleVerdict::Pass => Verdict::Pass,
            BundleVerdict::Cheat => Verdict::Cheat,
        },
        reason: None,
        challenge: Some(challenge_report),
        bundle: Some(report),
    })
}

/// Checks `commitment.cells` against the request (scheme, shape) and returns the shape the
/// challenge uses; `Err` is the reason of a cheat.
fn commitment_shape(
    model: &Model,
    weights: &CommittedWeights,
    ids: &[u32],
    cells: &CellsCommitment,
) -> Result<Option<CellShape>, String> {
    if cells.scheme != engy_core::cells::SCHEME {
        return Err(format!(
            "commitment.cells is scheme {:?}, not {:?}",
            cells.scheme,
            engy_core::cells::SCHEME
        ));
    }
    let dtype = cells
        .shape
        .logits_dtype()
        .map_err(|e| format!("commitment.cells.shape: {e}"))?;
    let want = request_shape(model, weights, ids, dtype)
        .map_err(|e| format!("the request has no cell shape: {e:#}"))?;
    if let Some(why) = cells.shape.request_mismatch(&want) {
        return Err(format!(
            "commitment.cells.shape is not the request's: {why}"
        ));
    }
    Ok(Some(cells.shape.clone()))
}

/// The text report: the verdict line first (with its reason, or the failed cells' count),
/// the challenge, then the weights read and one line per cell.
fn report_text(report: &CellsReport) -> String {
    use std::fmt::Write as _;
    let mut s = String::new();
    let verdict = match report.verdict {
        Verdict::Pass => "pass",
        Verdict::Cheat => "cheat",
        Verdict::NotJudged => "not judged",
    };
    let challenge = |s: &mut String| {
        if let Some(c) = &report.challenge {
            let _ = writeln!(
                s,
                "challenge: {} of {} cells, seed {}, cells_root {}",
                c.n, c.n_cells, c.seed, c.cells_root
            );
        }
    };
    let Some(r) = &report.bundle else {
        let _ = writeln!(
            s,
            "verdict: {verdict} ({})",
            report.reason.as_deref().unwrap_or("no bundle")
        );
        challenge(&mut s);
        return s;
    };
    let stats = if r.stats.failures.is_empty() {
        String::new()
    } else {
        format!("; together: {}", r.stats.failures.join("; "))
    };
    let _ = writeln!(
        s,
        "verdict: {verdict} ({}/{} challenged cells failed{stats})",
        r.failed, r.n
    );
    challenge(&mut s);
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
