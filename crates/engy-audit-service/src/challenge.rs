//! The cell challenge (docs/PROTOCOL.md §11.3): for a sampled request whose commitment
//! carries `cells`, the service asks the gateway to send `open_cells` to the miner with the
//! auditor's seed (`production_seed(beacon, commitment_digest)`, §11.2) and its own `n`, and
//! judges what came back with the cell check `engy-audit cells` runs
//! ([`engy_model::cells::audit_bundle_with_recompute`] against weights checked against the
//! trusted `model_root` of the model's spec file).
//!
//! Three steps, so that the network wait holds no CPU and the recompute holds no socket:
//! [`prepare`] derives the request's shape and the challenge (blocking, cheap) or finds the
//! commitment's cells a cheat already; [`Gateway::open_cells`] is the call (async, bounded
//! by the deadline); [`judge`] checks the answer (blocking: the recompute).
//!
//! The rules are docs/PROTOCOL.md §10 "The auditor's side": the miner's answer must be a
//! bundle of exactly the auditor's root, shape, seed and `n`; inside the
//! [`RETENTION_WINDOW_S`] window a `cells_error` (`unknown_request`, or `bad_challenge` to a
//! challenge valid by construction) is a failed audit (`cheat`), no answer by the deadline is
//! `unanswered` (§8's gate counts it as a cheat); after the window neither is judged.
use std::time::Duration;

use engy_core::cells::{challenge_n, CellAuditBundle, CellShape, Challenge, RETENTION_WINDOW_S};
use engy_core::wire::{CellsCommitment, CellsError, CellsOpened, Commitment};
use engy_model::cells::{
    audit_bundle_with_recompute, BundleAuditError, BundleReport, BundleVerdict, CellPolicy,
    CommittedWeights,
};
use engy_model::Model;
use serde::Serialize;
use serde_json::{json, Value};

/// What the cell audit of one request concluded.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum CellOutcome {
    /// Every challenged cell opened and passed.
    Pass,
    /// A failed audit: a failed or missing cell, an answer to another challenge, a refusal
    /// inside the retention window, a commitment shape that is not the request's.
    Cheat,
    /// No answer by the deadline, inside the retention window.
    Unanswered,
    /// Not judged: the challenge came after the retention window, or the service cannot
    /// challenge this request (no gateway, no spec for its model); the reason says which.
    NotJudged,
}

impl CellOutcome {
    /// The word used in verdicts and metrics (`pass`, `cheat`, `unanswered`, `not_judged`).
    pub fn label(self) -> &'static str {
        match self {
            CellOutcome::Pass => "pass",
            CellOutcome::Cheat => "cheat",
            CellOutcome::Unanswered => "unanswered",
            CellOutcome::NotJudged => "not_judged",
        }
    }
}

/// The cell audit's report, kept in the verdict's `report.cells`.
#[derive(Debug, Clone, Serialize)]
pub struct CellVerdict {
    /// The outcome.
    pub outcome: CellOutcome,
    /// Why, when the outcome came before any cell was checked; `None` when the cells decided.
    pub reason: Option<String>,
    /// The challenge's seed (64 hex), once drawn.
    pub seed: Option<String>,
    /// Cells challenged.
    pub n: Option<u64>,
    /// The request's cells.
    pub n_cells: Option<u64>,
    /// Seconds between the report and the challenge.
    pub challenge_age_s: Option<u64>,
    /// The challenged cells' check, when a bundle answered the challenge.
    pub bundle: Option<BundleReport>,
    /// The miner's answer made a bundle (specs/CELLS.md §7, JSON), kept as a cheat's evidence
    /// (`engy-audit cells --bundle`); not serialised into the report.
    #[serde(skip)]
    pub bundle_json: Option<String>,
}

impl CellVerdict {
    /// An outcome decided without a bundle, with its reason.
    pub fn early(outcome: CellOutcome, reason: impl Into<String>) -> Self {
        Self {
            outcome,
            reason: Some(reason.into()),
            seed: None,
            n: None,
            n_cells: None,
            challenge_age_s: None,
            bundle: None,
            bundle_json: None,
        }
    }
}

/// A request ready to be challenged: the auditor's challenge and the request's tokens.
#[derive(Debug, Clone)]
pub struct Prepared {
    /// The auditor's challenge (root from the commitment, shape checked against the
    /// request's, the seed, `n` from the policy).
    pub challenge: Challenge,
    /// `prompt_ids ++ output_token_ids`.
    pub ids: Vec<u32>,
}

/// Why the cell audit could not run (no verdict: the job is kept and tried again).
#[derive(Debug, thiserror::Error)]
pub enum ChallengeError {
    /// The gateway could not be asked, or answered something that is not §11.3's.
    #[error("the gateway ({url}) {what}")]
    Gateway {
        /// The gateway's base URL.
        url: String,
        /// What went wrong.
        what: String,
    },
    /// The auditor's model gives no cell shape, or its checkpoint is not the committed one.
    #[error("{0}")]
    Auditor(String),
    /// The recompute failed.
    #[error("recomputing the cells: {0}")]
    Model(#[from] engy_model::ModelError),
}

/// The request's shape as the auditor derives it (specs/CELLS.md §3 "A request's shape"):
/// positions and tokens from `ids`, the MoE layers from the committed checkpoint, the sizes
/// from the model's config, the router logits' dtype the commitment's (either is the serve's).
fn request_shape(
    model: &Model,
    weights: &CommittedWeights,
    ids: &[u32],
    cells: &CellsCommitment,
) -> Result<CellShape, String> {
    let dtype = cells
        .shape
        .logits_dtype()
        .map_err(|e| format!("commitment.cells.shape: {e}"))?;
    let rs = model
        .routing_shape()
        .ok_or_else(|| "the auditor's checkpoint has no MoE layers".to_owned())?;
    let layers: Vec<u32> = (0..u32::try_from(rs.layers).unwrap_or(u32::MAX))
        .filter(|&l| weights.is_moe_layer(l))
        .collect();
    CellShape::for_request(
        ids,
        layers,
        u32::try_from(model.config().hidden_size).unwrap_or(u32::MAX),
        u32::try_from(rs.experts).unwrap_or(u32::MAX),
        u32::try_from(rs.top_k).unwrap_or(u32::MAX),
        dtype,
    )
    .map_err(|e| format!("the request has no cell shape: {e}"))
}

/// Derives the challenge of a commitment with `cells`: `Ok(Err(verdict))` when the commitment
/// is a cheat already (another scheme, a shape that is not the request's), so no challenge is
/// sent. `cells_n` is the policy's `n` (the challenge opens `challenge_n(cells_n, n_cells)`).
///
/// # Errors
/// [`ChallengeError::Auditor`]: the commitment has no `cells` (the caller's bug).
pub fn prepare(
    model: &Model,
    weights: &CommittedWeights,
    commitment: &Commitment,
    seed: [u8; 32],
    cells_n: u64,
) -> Result<Result<Prepared, CellVerdict>, ChallengeError> {
    let Some(cells) = commitment.cells.as_ref() else {
        return Err(ChallengeError::Auditor(
            "the commitment carries no cells".into(),
        ));
    };
    let ids: Vec<u32> = commitment
        .toploc
        .prompt_ids
        .iter()
        .chain(&commitment.output_token_ids)
        .copied()
        .collect();
    if cells.scheme != engy_core::cells::SCHEME {
        return Ok(Err(CellVerdict::early(
            CellOutcome::Cheat,
            format!(
                "commitment.cells is scheme {:?}, not {:?}",
                cells.scheme,
                engy_core::cells::SCHEME
            ),
        )));
    }
    let want = match request_shape(model, weights, &ids, cells) {
        Ok(s) => s,
        Err(why) => return Ok(Err(CellVerdict::early(CellOutcome::Cheat, why))),
    };
    if let Some(why) = cells.shape.request_mismatch(&want) {
        return Ok(Err(CellVerdict::early(
            CellOutcome::Cheat,
            format!("commitment.cells.shape is not the request's: {why}"),
        )));
    }
    let n = challenge_n(cells_n, want.n_cells());
    Ok(Ok(Prepared {
        challenge: Challenge {
            cells_root: cells.root.0,
            shape: cells.shape.clone(),
            seed,
            n,
        },
        ids,
    }))
}

/// The miner's answer to `open_cells`, as the gateway returned it.
#[derive(Debug, Clone)]
pub enum Answer {
    /// `200 {"cells": …}`.
    Opened(CellsOpened),
    /// `200 {"cells_error": …}`.
    Refused(CellsError),
    /// `504`: nothing by the deadline.
    Unanswered,
    /// `200 {"cells": …}` whose frame is not §10's (the miner's answer opens nothing).
    Malformed(String),
}

/// The gateway's side of §11.3: `POST {url}/v1/open_cells`.
#[derive(Debug, Clone)]
pub struct Gateway {
    url: String,
    http: reqwest::Client,
}

impl Gateway {
    /// A client of the gateway at `url` (`http://HOST:PORT`, no trailing slash needed).
    pub fn new(url: &str) -> Self {
        Self {
            url: url.trim_end_matches('/').to_owned(),
            http: reqwest::Client::new(),
        }
    }

    /// The gateway's base URL.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// Asks the gateway to challenge `hotkey`'s cells of `request_id` with `(seed, n)` and to
    /// answer within `deadline` (sent as `deadline_ms`; the call itself gives up 10 s later).
    ///
    /// # Errors
    /// [`ChallengeError::Gateway`]: the gateway cannot be reached, or answers with another
    /// status or a body that is not §11.3's (not the miner's fault: no verdict).
    pub async fn open_cells(
        &self,
        request_id: &str,
        hotkey: &str,
        seed: [u8; 32],
        n: u64,
        deadline: Duration,
    ) -> Result<Answer, ChallengeError> {
        let err = |what: String| ChallengeError::Gateway {
            url: self.url.clone(),
            what,
        };
        let body = json!({
            "request_id": request_id,
            "hotkey": hotkey,
            "seed": hex::encode(seed),
            "n": n,
            "deadline_ms": u64::try_from(deadline.as_millis()).unwrap_or(u64::MAX),
        });
        let resp = self
            .http
            .post(format!("{}/v1/open_cells", self.url))
            .json(&body)
            .timeout(deadline + Duration::from_secs(10))
            .send()
            .await
            .map_err(|e| err(format!("cannot be reached: {e}")))?;
        let status = resp.status();
        let text = resp
            .text()
            .await
            .map_err(|e| err(format!("answer unreadable: {e}")))?;
        if status == reqwest::StatusCode::GATEWAY_TIMEOUT {
            return Ok(Answer::Unanswered);
        }
        if status != reqwest::StatusCode::OK {
            return Err(err(format!(
                "answered {status}: {}",
                text.chars().take(300).collect::<String>()
            )));
        }
        let v: Value = serde_json::from_str(&text)
            .map_err(|e| err(format!("answered 200 with a body that is not JSON: {e}")))?;
        if let Some(f) = v.get("cells") {
            let mut f = f.clone();
            if let Some(o) = f.as_object_mut() {
                o.remove("type");
            }
            return match serde_json::from_value::<CellsOpened>(f) {
                Ok(c) => Ok(Answer::Opened(c)),
                // The miner's frame is not a `cells` frame: its answer is not an opening.
                Err(e) => Ok(Answer::Malformed(e.to_string())),
            };
        }
        if let Some(f) = v.get("cells_error") {
            let mut f = f.clone();
            if let Some(o) = f.as_object_mut() {
                o.remove("type");
            }
            return serde_json::from_value::<CellsError>(f)
                .map(Answer::Refused)
                .map_err(|e| err(format!("answered a cells_error §2 does not allow: {e}")));
        }
        Err(err(
            "answered 200 without `cells` or `cells_error`".to_owned()
        ))
    }
}

/// Judges the miner's `answer` to `prepared`'s challenge, sent `age_s` seconds after the
/// report (blocking: the recompute).
///
/// # Errors
/// [`ChallengeError::Auditor`] (the checkpoint is not the committed one where a cell touches
/// it) and [`ChallengeError::Model`]: no verdict, the job is tried again.
pub fn judge(
    model: &Model,
    weights: &CommittedWeights,
    prepared: &Prepared,
    answer: &Answer,
    age_s: u64,
    policy: &CellPolicy,
) -> Result<CellVerdict, ChallengeError> {
    let c = &prepared.challenge;
    let with_challenge = |mut v: CellVerdict| {
        v.seed = Some(hex::encode(c.seed));
        v.n = Some(c.n);
        v.n_cells = Some(c.shape.n_cells());
        v.challenge_age_s = Some(age_s);
        v
    };
    let inside = age_s <= RETENTION_WINDOW_S;
    let window = |what: &str| {
        if inside {
            format!(
                "the miner {what} {age_s} s after its response, inside the \
                 {RETENTION_WINDOW_S} s retention window"
            )
        } else {
            format!(
                "the miner {what} {age_s} s after its response, past the \
                 {RETENTION_WINDOW_S} s retention window"
            )
        }
    };
    let opened = match answer {
        Answer::Unanswered => {
            let outcome = if inside {
                CellOutcome::Unanswered
            } else {
                CellOutcome::NotJudged
            };
            return Ok(with_challenge(CellVerdict::early(
                outcome,
                window("did not answer open_cells by the deadline"),
            )));
        }
        Answer::Refused(e) => {
            let outcome = if inside {
                CellOutcome::Cheat
            } else {
                CellOutcome::NotJudged
            };
            let word = serde_json::to_value(e.reason)
                .ok()
                .and_then(|v| v.as_str().map(str::to_owned))
                .unwrap_or_default();
            let what = format!(
                "answered cells_error {word} ({}) to a valid challenge",
                e.error.chars().take(200).collect::<String>()
            );
            return Ok(with_challenge(CellVerdict::early(outcome, window(&what))));
        }
        Answer::Malformed(e) => {
            return Ok(with_challenge(CellVerdict::early(
                CellOutcome::Cheat,
                format!("the miner's cells frame is not an opening (docs/PROTOCOL.md §10): {e}"),
            )))
        }
        Answer::Opened(o) => o,
    };
    let bundle_value = json!({
        "cells_root": opened.root,
        "shape": c.shape,
        "seed": hex::encode(c.seed),
        "n": c.n,
        "openings": opened.openings,
    });
    let bundle_json = bundle_value.to_string();
    let early = |why: String| {
        let mut v = with_challenge(CellVerdict::early(CellOutcome::Cheat, why));
        v.bundle_json = Some(bundle_json.clone());
        v
    };
    let bundle: CellAuditBundle = match serde_json::from_value(bundle_value) {
        Ok(b) => b,
        Err(e) => {
            return Ok(early(format!(
                "the answer is not a bundle an auditor reads: {e}"
            )))
        }
    };
    if let Err(e) = bundle.check_challenge(c) {
        return Ok(early(format!(
            "the bundle does not answer the auditor's challenge: {e}"
        )));
    }
    let report =
        match audit_bundle_with_recompute(model, weights, &bundle, &prepared.ids, None, policy) {
            Ok(r) => r,
            Err(BundleAuditError::Refused(e)) => {
                return Ok(early(format!(
                    "the bundle answered the challenge, then was refused: {e}"
                )))
            }
            Err(BundleAuditError::Weights(e)) => {
                return Err(ChallengeError::Auditor(format!(
                    "the auditor's checkpoint is not the committed one: {e}"
                )))
            }
            Err(BundleAuditError::Model(e)) => return Err(ChallengeError::Model(e)),
        };
    let outcome = match report.verdict {
        BundleVerdict::Pass => CellOutcome::Pass,
        BundleVerdict::Cheat => CellOutcome::Cheat,
    };
    let mut v = with_challenge(CellVerdict {
        outcome,
        reason: None,
        seed: None,
        n: None,
        n_cells: None,
        challenge_age_s: None,
        bundle: Some(report),
        bundle_json: Some(bundle_json),
    });
    if outcome == CellOutcome::Cheat {
        let r = v.bundle.as_ref();
        v.reason = r.map(|r| {
            let mut s = format!("{}/{} challenged cells failed", r.failed, r.n);
            if !r.stats.failures.is_empty() {
                s.push_str(&format!("; together: {}", r.stats.failures.join("; ")));
            }
            s
        });
    }
    Ok(v)
}

/// Opens a model's committed weights for the cell check: the spec file (`model_spec.json.gz`,
/// or a directory holding one, as `engy-audit spec build` writes it) is trusted, its
/// `model_root` the root every touched unit is checked against.
///
/// # Errors
/// The spec cannot be read, or the checkpoint is not the one it commits (the message names
/// both paths).
pub fn open_weights(
    checkpoint: &std::path::Path,
    spec: &std::path::Path,
) -> anyhow::Result<CommittedWeights> {
    use anyhow::Context as _;
    let path = if spec.is_dir() {
        spec.join("model_spec.json.gz")
    } else {
        spec.to_path_buf()
    };
    let file = engy_core::commit::SpecFile::read(&path)
        .with_context(|| format!("reading spec file {}", path.display()))?;
    let root = file.model_root.0;
    CommittedWeights::open(
        checkpoint,
        root,
        engy_model::cells::Openings::Spec(Box::new(file)),
    )
    .with_context(|| {
        format!(
            "checking {} against the spec {}",
            checkpoint.display(),
            path.display()
        )
    })
}
