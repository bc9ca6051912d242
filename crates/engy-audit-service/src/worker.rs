//! The workers: one per `--device`, each with every configured model open on its device and
//! its weights resident (decoded once, reused by every audit), claiming jobs of the models it
//! holds from the shared queue.
//!
//! A job's life in a worker: claim under a lease ([`Store::claim`]) → renew the lease every
//! third of its length while the audit runs → the TOPLOC recompute with the routing check
//! (`engy_model::audit::audit_with`, `Recompute::Auto`, as `engy-audit audit` runs it) →
//! the verdict, its reasons and score, and for a cheat the evidence, written in the
//! transaction that closes the job ([`Store::finish`]). With `--batch B` a worker claims up
//! to B ready jobs of one model, each under its own lease, and runs their recomputes in one
//! pass over the weights (`engy_model::audit::audit_many`: each report exactly the one it gets
//! alone); each job still gets its own verdict in its own transaction, and a batched pass that
//! fails is redone one job at a time ([`run_audits`]). A worker that dies holds nothing: its
//! lease runs out and any worker takes the job again ([`Store::expire_leases`]). An audit
//! that cannot run (the recompute itself fails) gives the job back with the error, to be
//! tried again after [`RETRY_AFTER_MS`]. On SIGTERM a worker claims nothing more, lets the
//! audit in hand finish within the drain time, else gives its job back.
//!
//! A model whose checkpoint cannot be opened is logged (ERROR, naming the model and the
//! directory) and reported by `/health` and `GET /v1/requests/{digest}`; the worker runs on
//! with the others and never claims that model's jobs, which stay queued until a worker
//! that holds the model takes them.
use std::collections::BTreeMap;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use engy_model::audit::{
    audit_many, audit_with, AuditParams, AuditReport, Recompute, RoutingAudit, Verdict,
};
use engy_model::{DeviceSpec, LoadOptions, Model, Residency};

use engy_core::cells::RETENTION_WINDOW_S;
use engy_core::wire::Commitment;
use engy_model::cells::{CellPolicy, CommittedWeights};

use crate::challenge::{Answer, CellOutcome, CellVerdict, Gateway, Prepared};
use crate::metrics::Metrics;
use crate::store::{now_ms, Evidence, Job, Store, VerdictRow};

/// How long a job whose audit could not run waits before it is claimed again.
pub const RETRY_AFTER_MS: i64 = 30_000;

/// How often an idle worker looks for a job.
const POLL: Duration = Duration::from_millis(200);

/// A model open on a worker's device.
pub struct LoadedModel {
    /// The runtime.
    pub model: Model,
    /// Its checkpoint's `model_root` (docs/PROTOCOL.md §4).
    pub model_root: String,
    /// Its weights checked against the trusted spec's `engy-commit/v1` root, for the cell
    /// check (`--spec NAME=SPEC`); `None` without a spec (cells not judged).
    pub cells: Option<CommittedWeights>,
}

/// Each configured model's state, per worker: `loaded on DEVICE` or why it is not.
pub type ModelStates = Arc<Mutex<BTreeMap<String, String>>>;

/// Opens `dir` on `device` with resident weights and, with `spec`, its committed weights for
/// the cell check ([`crate::challenge::open_weights`]).
///
/// # Errors
/// The checkpoint, the device or the spec cannot be used (the message names them).
pub fn open_model(
    name: &str,
    dir: &Path,
    spec: Option<&Path>,
    device: DeviceSpec,
) -> anyhow::Result<LoadedModel> {
    use anyhow::Context as _;
    let opts = LoadOptions {
        residency: Residency::Resident,
        device,
        ..LoadOptions::default()
    };
    let model = Model::open(dir, &opts).with_context(|| {
        format!(
            "model {name}: opening checkpoint {} on {device} (--model / ENGY_AUDIT_MODELS, \
             --device / ENGY_AUDIT_DEVICES)",
            dir.display()
        )
    })?;
    let model_root = engy_core::identity::model_root(dir)
        .with_context(|| format!("model {name}: model_root of {}", dir.display()))?;
    let cells = match spec {
        Some(spec) => Some(
            crate::challenge::open_weights(dir, spec)
                .with_context(|| format!("model {name}: --spec / ENGY_AUDIT_SPECS"))?,
        ),
        None => None,
    };
    Ok(LoadedModel {
        model,
        model_root,
        cells,
    })
}

/// One worker.
pub struct Worker {
    /// Its name in the queue and in verdicts (`<pid>-<device>-<8 hex>`).
    pub id: String,
    /// The database.
    pub store: Store,
    /// The models it holds, by name.
    pub models: BTreeMap<String, Arc<LoadedModel>>,
    /// Audit thresholds.
    pub params: AuditParams,
    /// Lease length, ms.
    pub lease_ms: i64,
    /// How long an audit in hand may run on after SIGTERM.
    pub drain: Duration,
    /// Jobs of one model claimed at once and audited in one pass over the weights
    /// (`--batch`, at least 1).
    pub batch: usize,
    /// Metrics.
    pub metrics: Arc<Metrics>,
    /// The gateway of the cell challenge (docs/PROTOCOL.md §11.3), if any.
    pub gateway: Option<Gateway>,
    /// How long the miner has to answer `open_cells`.
    pub challenge_deadline: Duration,
    /// Cells challenged per request (the policy's `n`).
    pub cells_n: u64,
}

impl Worker {
    /// Claims and audits jobs until `stop` turns true.
    pub async fn run(self, mut stop: tokio::sync::watch::Receiver<bool>) {
        let names: Vec<String> = self.models.keys().cloned().collect();
        tracing::info!(worker = %self.id, models = ?names, "worker started");
        loop {
            if *stop.borrow() {
                break;
            }
            match self.store.expire_leases(now_ms()).await {
                Ok(expired) => {
                    for (digest, worker) in expired {
                        self.metrics.lease_expiries.inc();
                        tracing::warn!(
                            %digest, %worker,
                            "a lease ran out; the job is queued again"
                        );
                    }
                }
                Err(e) => tracing::warn!(error = %e, "cannot take back run-out leases"),
            }
            let job = match self
                .store
                .claim(&self.id, &names, now_ms(), self.lease_ms)
                .await
            {
                Ok(Some(job)) => job,
                Ok(None) => {
                    tokio::select! {
                        _ = tokio::time::sleep(POLL) => {}
                        _ = stop.changed() => {}
                    }
                    continue;
                }
                Err(e) => {
                    tracing::warn!(worker = %self.id, error = %e, "cannot claim a job; retrying");
                    tokio::select! {
                        _ = tokio::time::sleep(POLL * 5) => {}
                        _ = stop.changed() => {}
                    }
                    continue;
                }
            };
            let mut jobs = vec![job];
            let same_model = [jobs[0].model.clone()];
            while jobs.len() < self.batch.max(1) {
                match self
                    .store
                    .claim(&self.id, &same_model, now_ms(), self.lease_ms)
                    .await
                {
                    Ok(Some(more)) => jobs.push(more),
                    Ok(None) => break,
                    Err(e) => {
                        tracing::warn!(worker = %self.id, error = %e, "cannot claim more jobs of the batch");
                        break;
                    }
                }
            }
            if !self.audit_jobs(jobs, &mut stop).await {
                break;
            }
        }
        tracing::info!(worker = %self.id, "worker stopped");
    }

    /// Audits claimed jobs, all of one model (one job at `--batch 1`): each leased and
    /// renewed, their TOPLOC recomputes in one pass over the weights, each given its own
    /// verdict exactly once. `false` when the worker must stop (SIGTERM and the drain time
    /// ran out: every job was given back).
    async fn audit_jobs(
        &self,
        jobs: Vec<Job>,
        stop: &mut tokio::sync::watch::Receiver<bool>,
    ) -> bool {
        let started = Instant::now();
        for job in &jobs {
            tracing::info!(
                worker = %self.id, digest = %job.digest, model = %job.model,
                hotkey = %job.hotkey, attempt = job.attempts, batch = jobs.len(), "audit claimed"
            );
        }
        let Some(loaded) = jobs
            .first()
            .and_then(|j| self.models.get(&j.model))
            .cloned()
        else {
            // Claims name only held models; a job of another model is given back as it was.
            for job in &jobs {
                let _ = self.store.release(job, None, 0).await;
            }
            return true;
        };
        let renewals: Vec<_> = jobs.iter().map(|job| self.renew_lease(job)).collect();
        let audit = self.audit_work(loaded, &jobs);
        tokio::pin!(audit);
        let drained = async {
            if !*stop.borrow() {
                let _ = stop.changed().await;
            }
            tokio::time::sleep(self.drain).await;
        };
        let outcome = tokio::select! {
            r = &mut audit => Some(r),
            () = drained => None,
        };
        for r in &renewals {
            r.abort();
        }
        let Some(outcomes) = outcome else {
            for job in &jobs {
                match self.store.release(job, None, 0).await {
                    Ok(_) => tracing::warn!(
                        digest = %job.digest,
                        "shutting down: the audit in hand did not finish within the drain \
                         time; its job is back in the queue"
                    ),
                    Err(e) => tracing::warn!(
                        digest = %job.digest, error = %e,
                        "shutting down: cannot give the job back; its lease will run out"
                    ),
                }
            }
            return false;
        };
        let seconds = started.elapsed().as_secs_f64();
        for (job, outcome) in jobs.iter().zip(outcomes) {
            self.conclude(job, outcome, seconds).await;
        }
        true
    }

    /// Renews `job`'s lease every third of its length until aborted.
    fn renew_lease(&self, job: &Job) -> tokio::task::JoinHandle<()> {
        let store = self.store.clone();
        let job = job.clone();
        let lease_ms = self.lease_ms;
        tokio::spawn(async move {
            let every = Duration::from_millis(u64::try_from(lease_ms / 3).unwrap_or(1).max(1));
            loop {
                tokio::time::sleep(every).await;
                match store.renew(&job, now_ms().saturating_add(lease_ms)).await {
                    Ok(true) => {}
                    Ok(false) => {
                        tracing::warn!(digest = %job.digest, "the job's lease was lost");
                        return;
                    }
                    Err(e) => tracing::warn!(error = %e, "cannot renew a lease; retrying"),
                }
            }
        })
    }

    /// Writes one job's verdict (or gives the job back when its audit could not run).
    async fn conclude(
        &self,
        job: &Job,
        outcome: anyhow::Result<(AuditReport, Option<CellVerdict>)>,
        seconds: f64,
    ) {
        let (report, cells) = match outcome {
            Ok(r) => r,
            Err(e) => {
                self.metrics.audit_errors.inc();
                let error = engy_telemetry::cli::error_line(e.as_ref());
                tracing::error!(
                    digest = %job.digest, model = %job.model, %error,
                    "the audit could not run; the job is kept and tried again"
                );
                let _ = self
                    .store
                    .release(job, Some(&error), now_ms().saturating_add(RETRY_AFTER_MS))
                    .await;
                return;
            }
        };
        let (verdict, reasons) = combined_verdict(&report, cells.as_ref());
        if let Some(c) = &cells {
            self.metrics
                .challenges
                .get_or_create(&engy_telemetry::metrics::labels(&[(
                    "outcome",
                    c.outcome.label(),
                )]))
                .inc();
        }
        let report_json = {
            let mut v = serde_json::to_value(&report).unwrap_or_else(|_| serde_json::json!({}));
            if let (Some(o), Some(c)) = (v.as_object_mut(), &cells) {
                o.insert(
                    "cells".into(),
                    serde_json::to_value(c).unwrap_or(serde_json::Value::Null),
                );
            }
            v.to_string()
        };
        // The near-tie ledger's entry: the answered bundle's counts (docs/AUDIT-SERVICE.md).
        let judged_bundle = cells.as_ref().and_then(|c| c.bundle.as_ref());
        let row = VerdictRow {
            digest: job.digest.clone(),
            request_id: job.request_id.clone(),
            hotkey: job.hotkey.clone(),
            model: job.model.clone(),
            verdict: verdict.to_owned(),
            reasons,
            score: report.score,
            worker: self.id.clone(),
            audit_seconds: seconds,
            decided_ms: now_ms(),
            near_ties: judged_bundle.map(|b| b.stats.near_ties as u64),
            cells_judged: judged_bundle.map(|b| b.stats.n as u64),
            report: None,
        };
        let evidence = (verdict == "cheat").then(|| Evidence {
            commitment: job.commitment.clone(),
            report: report_json.clone(),
            bundle: cells.as_ref().and_then(|c| c.bundle_json.clone()),
        });
        match self
            .store
            .finish(job, &row, &report_json, evidence.as_ref())
            .await
        {
            Ok(true) => {
                self.metrics
                    .audits
                    .get_or_create(&engy_telemetry::metrics::labels(&[("verdict", verdict)]))
                    .inc();
                self.metrics.audit_seconds.observe(seconds);
                tracing::info!(
                    worker = %self.id, digest = %job.digest, hotkey = %job.hotkey,
                    verdict, score = ?report.score, seconds, "verdict written"
                );
            }
            Ok(false) => tracing::warn!(
                digest = %job.digest,
                "the lease ran out before the verdict was written; the worker that took the \
                 job over writes it"
            ),
            Err(e) => {
                tracing::warn!(digest = %job.digest, error = %e, "cannot write the verdict; the job is given back");
                let _ = self.store.release(job, None, 0).await;
            }
        }
    }
}

impl Worker {
    /// The audits of claimed jobs of one model: for each commitment with cells the challenge
    /// through the gateway first (the retention window runs from the report), then, blocking,
    /// the TOPLOC recomputes in one pass ([`run_audits`]) and the cell check of each answer.
    /// One outcome per job, in order; `Err`: no verdict for that job (it is kept and retried).
    async fn audit_work(
        &self,
        loaded: Arc<LoadedModel>,
        jobs: &[Job],
    ) -> Vec<anyhow::Result<(AuditReport, Option<CellVerdict>)>> {
        let mut stages = Vec::with_capacity(jobs.len());
        for job in jobs {
            stages.push(self.cell_stage(&loaded, job).await);
        }
        let params = self.params;
        let metrics = Arc::clone(&self.metrics);
        let commitments: Vec<String> = jobs
            .iter()
            .zip(&stages)
            .filter(|(_, st)| st.is_ok())
            .map(|(j, _)| j.commitment.clone())
            .collect();
        let n = jobs.len();
        let task = tokio::task::spawn_blocking(move || {
            let mut reports = run_audits(&loaded, &commitments, &params, &metrics).into_iter();
            stages
                .into_iter()
                .map(|stage| {
                    let (prepared, answer, age_s) = stage?;
                    let report = reports
                        .next()
                        .ok_or_else(|| anyhow::anyhow!("no report for a job of the batch"))??;
                    let cells = match (prepared, answer, loaded.cells.as_ref()) {
                        (None, _, _) => None,
                        (Some(Err(v)), _, _) => Some(v),
                        (Some(Ok(p)), Some(a), Some(w)) => Some(crate::challenge::judge(
                            &loaded.model,
                            w,
                            &p,
                            &a,
                            age_s,
                            &CellPolicy::default(),
                        )?),
                        (Some(Ok(_)), _, _) => anyhow::bail!("a challenge without an answer"),
                    };
                    Ok((report, cells))
                })
                .collect::<Vec<_>>()
        });
        match task.await {
            Ok(r) => r,
            Err(e) => (0..n)
                .map(|_| Err(anyhow::anyhow!("the audit task ended: {e}")))
                .collect(),
        }
    }

    /// The cell stage of one job before its recompute: what was prepared (or decided without
    /// a challenge), the miner's answer, and the request's age in seconds.
    async fn cell_stage(&self, loaded: &Arc<LoadedModel>, job: &Job) -> anyhow::Result<CellStage> {
        let plan = self.cell_plan(loaded, job).await?;
        Ok(match plan {
            CellPlan::None => (None, None, 0),
            CellPlan::Decided(v) => (Some(Err(v)), None, 0),
            CellPlan::Challenge(p) => {
                let age_s =
                    u64::try_from(now_ms().saturating_sub(job.received_ms) / 1000).unwrap_or(0);
                if age_s > RETENTION_WINDOW_S {
                    let v = CellVerdict::early(
                        CellOutcome::NotJudged,
                        format!(
                            "audited {age_s} s after the report, past the {RETENTION_WINDOW_S} s \
                             retention window: TOPLOC only (docs/PROTOCOL.md §11.3)"
                        ),
                    );
                    (Some(Err(v)), None, age_s)
                } else {
                    let Some(gateway) = &self.gateway else {
                        anyhow::bail!("no gateway for a planned challenge");
                    };
                    let answer = gateway
                        .open_cells(
                            &job.request_id,
                            &job.hotkey,
                            p.challenge.seed,
                            p.challenge.n,
                            self.challenge_deadline,
                        )
                        .await?;
                    tracing::info!(
                        digest = %job.digest, hotkey = %job.hotkey, n = p.challenge.n,
                        answer = match &answer {
                            Answer::Opened(_) => "cells",
                            Answer::Refused(_) => "cells_error",
                            Answer::Unanswered => "deadline",
                            Answer::Malformed(_) => "malformed",
                        },
                        "cell challenge answered"
                    );
                    (Some(Ok(p)), Some(answer), age_s)
                }
            }
        })
    }

    /// What the cell audit of `job` will be.
    async fn cell_plan(&self, loaded: &Arc<LoadedModel>, job: &Job) -> anyhow::Result<CellPlan> {
        if !job.has_cells {
            return Ok(CellPlan::None);
        }
        let not_judged = |why: String| {
            Ok(CellPlan::Decided(CellVerdict::early(
                CellOutcome::NotJudged,
                why,
            )))
        };
        if self.gateway.is_none() {
            return not_judged(
                "the service has no gateway to challenge through (--gateway / \
                 ENGY_AUDIT_GATEWAY)"
                    .into(),
            );
        }
        if loaded.cells.is_none() {
            return not_judged(format!(
                "no trusted spec for model {} (--spec / ENGY_AUDIT_SPECS)",
                job.model
            ));
        }
        let Some(seed) = job
            .seed
            .as_deref()
            .and_then(|s| engy_core::commit::parse_digest(s).ok())
        else {
            return not_judged("the request has no seed yet".into());
        };
        let commitment: Commitment = match serde_json::from_str(&job.commitment) {
            Ok(c) => c,
            Err(e) => return not_judged(format!("the commitment is not §3.10's: {e}")),
        };
        let loaded = Arc::clone(loaded);
        let cells_n = self.cells_n;
        let prepared = tokio::task::spawn_blocking(move || {
            let Some(w) = loaded.cells.as_ref() else {
                return Err(crate::challenge::ChallengeError::Auditor(
                    "no weights".into(),
                ));
            };
            crate::challenge::prepare(&loaded.model, w, &commitment, seed, cells_n)
        })
        .await
        .map_err(|e| anyhow::anyhow!("the challenge task ended: {e}"))??;
        Ok(match prepared {
            Ok(p) => CellPlan::Challenge(p),
            Err(v) => CellPlan::Decided(v),
        })
    }
}

/// A job's cell stage: prepared challenge (or the verdict decided without one), the answer,
/// the request's age in seconds.
type CellStage = (Option<Result<Prepared, CellVerdict>>, Option<Answer>, u64);

/// The cell audit a job will get.
enum CellPlan {
    /// The commitment has no cells.
    None,
    /// Decided without a challenge (not judged, or a cheat in the commitment itself).
    Decided(CellVerdict),
    /// Challenge the miner.
    Challenge(Prepared),
}

/// The verdict of a TOPLOC report and a cell audit together: a cheat in either is a cheat;
/// else an unanswered challenge is `unanswered`; else the TOPLOC verdict (a cell pass proves
/// nothing TOPLOC left unproven). Reasons name their check (`toploc:`, `routing:`, `cells:`).
pub fn combined_verdict(
    r: &AuditReport,
    cells: Option<&CellVerdict>,
) -> (&'static str, Vec<String>) {
    let (verdict, mut reasons) = verdict_of(r);
    let Some(c) = cells else {
        return (verdict, reasons);
    };
    let why = format!(
        "cells: {}",
        c.reason.as_deref().unwrap_or("challenged cells failed")
    );
    match c.outcome {
        CellOutcome::Cheat => {
            if verdict != "cheat" {
                reasons.clear();
            }
            reasons.push(why);
            ("cheat", reasons)
        }
        CellOutcome::Unanswered if verdict != "cheat" => {
            reasons.push(why);
            ("unanswered", reasons)
        }
        CellOutcome::Unanswered => {
            reasons.push(why);
            ("cheat", reasons)
        }
        CellOutcome::Pass | CellOutcome::NotJudged => (verdict, reasons),
    }
}

/// The TOPLOC recomputes of commitments of one model (bytes as the miners sent them), in
/// order: one alone as [`run_audit`]; several in one pass over the weights
/// (`engy_model::audit::audit_many`, which gives each exactly the report it gets alone).
/// When the batched pass fails, each commitment is audited alone, so that one commitment's
/// error costs the others nothing. Counts every pass in `metrics.audit_passes`.
fn run_audits(
    loaded: &LoadedModel,
    commitments: &[String],
    params: &AuditParams,
    metrics: &Metrics,
) -> Vec<anyhow::Result<AuditReport>> {
    let alone = |c: &String| {
        metrics.audit_passes.inc();
        run_audit(loaded, c, params)
    };
    if commitments.len() < 2 {
        return commitments.iter().map(alone).collect();
    }
    // Commitments that are not JSON are unproven without a recompute.
    let parsed: Vec<Result<serde_json::Value, Box<AuditReport>>> = commitments
        .iter()
        .map(|c| {
            serde_json::from_str(c).map_err(|e| {
                Box::new(AuditReport::unproven(
                    format!("the commitment is not JSON: {e}"),
                    *params,
                ))
            })
        })
        .collect();
    let values: Vec<serde_json::Value> = parsed
        .iter()
        .filter_map(|p| p.as_ref().ok().cloned())
        .collect();
    if !values.is_empty() {
        metrics.audit_passes.inc();
    }
    match audit_many(
        &loaded.model,
        &loaded.model_root,
        &values,
        params,
        Recompute::Auto,
    ) {
        Ok(reports) if reports.len() == values.len() => {
            let mut reports = reports.into_iter();
            parsed
                .into_iter()
                .map(|p| match p {
                    Err(unproven) => Ok(*unproven),
                    Ok(_) => reports
                        .next()
                        .ok_or_else(|| anyhow::anyhow!("audit_many returned too few reports")),
                })
                .collect()
        }
        Ok(reports) => {
            tracing::warn!(
                expected = values.len(),
                got = reports.len(),
                "the batched pass returned the wrong number of reports; auditing one by one"
            );
            commitments.iter().map(alone).collect()
        }
        Err(e) => {
            tracing::warn!(
                error = %e, jobs = commitments.len(),
                "the batched pass failed; auditing its commitments one by one"
            );
            commitments.iter().map(alone).collect()
        }
    }
}

/// The recompute of one commitment (bytes as the miner sent them).
fn run_audit(
    loaded: &LoadedModel,
    commitment: &str,
    params: &AuditParams,
) -> anyhow::Result<AuditReport> {
    let value: serde_json::Value = match serde_json::from_str(commitment) {
        Ok(v) => v,
        Err(e) => {
            return Ok(AuditReport::unproven(
                format!("the commitment is not JSON: {e}"),
                *params,
            ))
        }
    };
    Ok(audit_with(
        &loaded.model,
        &loaded.model_root,
        &value,
        params,
        Recompute::Auto,
    )?)
}

/// The verdict word and its reasons.
pub fn verdict_of(r: &AuditReport) -> (&'static str, Vec<String>) {
    let mut reasons = Vec::new();
    match &r.verdict {
        Verdict::Unproven { reason } => {
            reasons.push(reason.clone());
            return ("unproven", reasons);
        }
        Verdict::Pass | Verdict::Cheat => {}
    }
    let judged = r.batches.iter().filter(|b| b.judged).count();
    if r.passing_batches < judged || matches!(r.verdict, Verdict::Cheat) {
        reasons.push(format!(
            "toploc: {}/{judged} batches within toploc_v {} (pass ratio required {})",
            r.passing_batches, r.params.toploc_v, r.params.toploc_p
        ));
    }
    if let Some(RoutingAudit::Checked(g)) = &r.routing {
        if g.is_cheat() {
            reasons.push(format!(
                "routing: mismatch rate {:.4} above {}",
                g.mismatch_rate, g.max_mismatch_rate
            ));
        }
    }
    if matches!(r.verdict, Verdict::Pass) {
        reasons.clear();
    }
    (r.verdict.label(), reasons)
}
