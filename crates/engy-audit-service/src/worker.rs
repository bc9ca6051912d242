//! The workers: one per `--device`, each with every configured model open on its device and
//! its weights resident (decoded once, reused by every audit), claiming jobs of the models it
//! holds from the shared queue.
//!
//! A job's life in a worker: claim under a lease ([`Store::claim`]) → renew the lease every
//! third of its length while the audit runs → the TOPLOC recompute with the routing check
//! (`engy_model::audit::audit_with`, `Recompute::Auto`, as `engy-audit audit` runs it) →
//! the verdict, its reasons and score, and for a cheat the evidence, written in the
//! transaction that closes the job ([`Store::finish`]). A worker that dies holds nothing: its
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

use engy_model::audit::{audit_with, AuditParams, AuditReport, Recompute, RoutingAudit, Verdict};
use engy_model::{DeviceSpec, LoadOptions, Model, Residency};

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
}

/// Each configured model's state, per worker: `loaded on DEVICE` or why it is not.
pub type ModelStates = Arc<Mutex<BTreeMap<String, String>>>;

/// Opens `dir` on `device` with resident weights.
///
/// # Errors
/// The checkpoint or the device cannot be used (the message names both).
pub fn open_model(name: &str, dir: &Path, device: DeviceSpec) -> anyhow::Result<LoadedModel> {
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
    Ok(LoadedModel { model, model_root })
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
    /// Metrics.
    pub metrics: Arc<Metrics>,
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
            if !self.audit_job(job, &mut stop).await {
                break;
            }
        }
        tracing::info!(worker = %self.id, "worker stopped");
    }

    /// Audits one claimed job; `false` when the worker must stop (SIGTERM and the drain
    /// time ran out: the job was given back).
    async fn audit_job(&self, job: Job, stop: &mut tokio::sync::watch::Receiver<bool>) -> bool {
        let started = Instant::now();
        tracing::info!(
            worker = %self.id, digest = %job.digest, model = %job.model,
            hotkey = %job.hotkey, attempt = job.attempts, "audit claimed"
        );
        let Some(loaded) = self.models.get(&job.model).cloned() else {
            // Claims name only held models; a job of another model is given back as it was.
            let _ = self.store.release(&job, None, 0).await;
            return true;
        };
        let renew = {
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
        };
        let params = self.params;
        let commitment = job.commitment.clone();
        let mut audit =
            tokio::task::spawn_blocking(move || run_audit(&loaded, &commitment, &params));
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
        renew.abort();
        let Some(outcome) = outcome else {
            match self.store.release(&job, None, 0).await {
                Ok(_) => tracing::warn!(
                    digest = %job.digest,
                    "shutting down: the audit in hand did not finish within the drain time; \
                     its job is back in the queue"
                ),
                Err(e) => tracing::warn!(
                    digest = %job.digest, error = %e,
                    "shutting down: cannot give the job back; its lease will run out"
                ),
            }
            return false;
        };
        let seconds = started.elapsed().as_secs_f64();
        let result = match outcome {
            Ok(r) => r,
            Err(e) => Err(anyhow::anyhow!("the audit task ended: {e}")),
        };
        let report = match result {
            Ok(report) => report,
            Err(e) => {
                self.metrics.audit_errors.inc();
                let error = engy_telemetry::cli::error_line(e.as_ref());
                tracing::error!(
                    digest = %job.digest, model = %job.model, %error,
                    "the audit could not run; the job is kept and tried again"
                );
                let _ = self
                    .store
                    .release(&job, Some(&error), now_ms().saturating_add(RETRY_AFTER_MS))
                    .await;
                return true;
            }
        };
        let (verdict, reasons) = verdict_of(&report);
        let report_json = serde_json::to_string(&report).unwrap_or_else(|_| "{}".into());
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
            report: None,
        };
        let evidence = (verdict == "cheat").then(|| Evidence {
            commitment: job.commitment.clone(),
            report: report_json.clone(),
            bundle: None,
        });
        match self
            .store
            .finish(&job, &row, &report_json, evidence.as_ref())
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
                let _ = self.store.release(&job, None, 0).await;
            }
        }
        true
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
