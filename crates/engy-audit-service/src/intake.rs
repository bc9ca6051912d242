//! The HTTP API (axum), docs/PROTOCOL.md §11.1:
//!
//! * `POST /v1/requests`: the gateway reports a completed request, a JSON object
//!   `{request_id, hotkey, model, commitment, timing}`. Stored once per commitment (the key
//!   is the SHA-256 of the `commitment` value's bytes as the body carries them): `202` with
//!   `{"digest", "stored": "new"}`, or `200` with `"stored": "duplicate"`. A report that is
//!   refused stores nothing and is answered `{"error", "field"}`: `413` larger than
//!   `--max-report-bytes` (field `body`), `400` not a JSON object, a member given twice, a
//!   missing or mis-typed field, a hotkey that is not SS58, a commitment that is not
//!   docs/PROTOCOL.md §3.10's (field `commitment.<path>`), `422` a model the service does not
//!   audit (field `model`); `503` when the database or the beacon cannot be reached (the
//!   gateway retries).
//! * `GET /v1/requests/{digest}`: where a request stands (sampled, job, verdict).
//! * `GET /v1/miners/{hotkey}`: the miner's verdicts and §8's gate ([`crate::verdicts`]),
//!   over all models and per model.
//! * `GET /v1/verdicts?since=MS&limit=N`: verdicts written at or after `since` (ms since the
//!   epoch), oldest first, at most `limit` (default and most 1000), and `next_since`.
//! * `GET /v1/verdicts/{digest}`: one verdict with its full audit report.
//! * `GET /v1/evidence/{digest}/{commitment.json|report.json|bundle.json}`: a cheat's
//!   evidence as files (`engy-audit audit --commitment commitment.json` re-checks it).
//! * `GET /health`, `GET /metrics`.
use std::sync::Arc;

use axum::body::Body;
use axum::extract::{Path, Query, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde_json::{json, Value};
use sha2::{Digest as _, Sha256};

use crate::metrics::Metrics;
use crate::sampling::{window_start, Beacon};
use crate::store::{now_ms, Counts, NewRequest, Store, Stored};
use crate::verdicts::Summary;
use crate::worker::ModelStates;

/// Longest `request_id` accepted, in bytes.
pub const MAX_REQUEST_ID_BYTES: usize = 256;

/// What the handlers share.
pub struct AppState {
    /// The database.
    pub store: Store,
    /// The models the service audits.
    pub models: std::collections::BTreeSet<String>,
    /// Largest report body.
    pub max_report_bytes: usize,
    /// Window length, ms.
    pub window_ms: i64,
    /// §8's minimum sample (the floor K).
    pub min_sample: u64,
    /// The beacon (its head is stored with each report).
    pub beacon: Arc<dyn Beacon>,
    /// Metrics and their registry.
    pub metrics: Arc<Metrics>,
    /// The registry `/metrics` encodes.
    pub registry: Arc<prometheus_client::registry::Registry>,
    /// Each model's state in this process's workers.
    pub model_states: ModelStates,
    /// Workers in this process.
    pub workers: usize,
}

use engy_telemetry::prometheus_client;

/// The API's routes.
pub fn router(state: Arc<AppState>) -> Router {
    Router::new()
        .route("/v1/requests", post(post_request))
        .route("/v1/requests/{digest}", get(get_request))
        .route("/v1/miners/{hotkey}", get(get_miner))
        .route("/v1/verdicts", get(get_verdicts))
        .route("/v1/verdicts/{digest}", get(get_verdict))
        .route("/v1/evidence/{digest}/{file}", get(get_evidence))
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .with_state(state)
}

/// A refused report: `status`, `{"error": message, "field": field}`.
fn refuse(status: StatusCode, field: &str, message: impl Into<String>) -> Response {
    (
        status,
        Json(json!({"error": message.into(), "field": field})),
    )
        .into_response()
}

fn unavailable(what: &str, e: &dyn std::fmt::Display) -> Response {
    tracing::warn!(error = %e, "{what}");
    (
        StatusCode::SERVICE_UNAVAILABLE,
        Json(json!({"error": format!("{what}: {e}; try again")})),
    )
        .into_response()
}

/// A report checked: what is stored.
struct Checked {
    request: NewRequest,
}

/// Why a report is refused: the status, the field and the message ([`refuse`]).
struct Refusal {
    status: StatusCode,
    field: String,
    message: String,
}

impl Refusal {
    fn new(status: StatusCode, field: &str, message: impl Into<String>) -> Refusal {
        Refusal {
            status,
            field: field.to_owned(),
            message: message.into(),
        }
    }

    fn response(self) -> Response {
        refuse(self.status, &self.field, self.message)
    }
}

/// Checks a report body (module docs); `Err` is the response refusing it.
fn check(state: &AppState, body: &[u8]) -> Result<Checked, Refusal> {
    let bad = |field: &str, m: String| Err(Refusal::new(StatusCode::BAD_REQUEST, field, m));
    let value: Value = match serde_json::from_slice(body) {
        Ok(v) => v,
        Err(e) => return bad("body", format!("the report is not JSON: {e}")),
    };
    let Value::Object(obj) = &value else {
        return bad("body", "the report is not a JSON object".into());
    };
    let members = match crate::raw::members(body) {
        Ok(m) => m,
        Err(e) => return bad("body", e.to_string()),
    };
    let string = |field: &str| -> Result<String, Refusal> {
        match obj.get(field) {
            Some(Value::String(s)) if !s.is_empty() => Ok(s.clone()),
            Some(_) => Err(Refusal::new(
                StatusCode::BAD_REQUEST,
                field,
                format!("{field} must be a non-empty string"),
            )),
            None => Err(Refusal::new(
                StatusCode::BAD_REQUEST,
                field,
                format!("{field} is missing"),
            )),
        }
    };
    let request_id = string("request_id")?;
    if request_id.len() > MAX_REQUEST_ID_BYTES {
        return bad(
            "request_id",
            format!("request_id is longer than {MAX_REQUEST_ID_BYTES} bytes"),
        );
    }
    let hotkey = string("hotkey")?;
    if let Err(e) = engy_core::keys::ss58_decode_any_prefix(&hotkey) {
        return bad("hotkey", format!("hotkey is not an SS58 address: {e}"));
    }
    let model = string("model")?;
    if !state.models.contains(&model) {
        return Err(Refusal::new(
            StatusCode::UNPROCESSABLE_ENTITY,
            "model",
            format!(
                "model {model:?} is not audited here (audited: {})",
                state.models.iter().cloned().collect::<Vec<_>>().join(", ")
            ),
        ));
    }
    let timing = match obj.get("timing") {
        None | Some(Value::Null) => "{}".to_owned(),
        Some(t @ Value::Object(_)) => t.to_string(),
        Some(_) => return bad("timing", "timing must be an object".into()),
    };
    let Some((_, range)) = members.iter().find(|(n, _)| n == "commitment") else {
        return bad("commitment", "commitment is missing".into());
    };
    let raw = &body[range.clone()];
    let Some(c @ Value::Object(_)) = obj.get("commitment") else {
        return bad("commitment", "commitment must be an object".into());
    };
    let de = c.clone();
    let commitment: engy_core::wire::Commitment = match serde_path_to_error::deserialize(de) {
        Ok(c) => c,
        Err(e) => {
            let path = e.path().to_string();
            let field = if path == "." || path.is_empty() {
                "commitment".to_owned()
            } else {
                format!("commitment.{path}")
            };
            return bad(&field, format!("{field}: {}", e.into_inner()));
        }
    };
    // The commitment's bytes, as the miner sent them (the body is UTF-8: it parsed).
    let Ok(raw_text) = std::str::from_utf8(raw) else {
        return bad("commitment", "commitment is not UTF-8".into());
    };
    let digest = hex::encode(Sha256::digest(raw));
    let received_ms = now_ms();
    Ok(Checked {
        request: NewRequest {
            digest,
            request_id,
            hotkey,
            model,
            commitment: raw_text.to_owned(),
            timing,
            has_cells: commitment.cells.is_some(),
            received_ms,
            window_start_ms: window_start(received_ms, state.window_ms),
            head_block: 0,
        },
    })
}

async fn post_request(State(state): State<Arc<AppState>>, body: Body) -> Response {
    let refused = |r: Response| {
        state
            .metrics
            .requests
            .get_or_create(&engy_telemetry::metrics::labels(&[("outcome", "refused")]))
            .inc();
        r
    };
    let bytes = match axum::body::to_bytes(body, state.max_report_bytes).await {
        Ok(b) => b,
        Err(_) => {
            return refused(refuse(
                StatusCode::PAYLOAD_TOO_LARGE,
                "body",
                format!(
                    "the report is larger than {} bytes (--max-report-bytes / \
                     ENGY_AUDIT_MAX_REPORT_BYTES)",
                    state.max_report_bytes
                ),
            ))
        }
    };
    let mut checked = match check(&state, &bytes) {
        Ok(c) => c,
        Err(r) => return refused(r.response()),
    };
    checked.request.head_block = match state.beacon.head().await {
        Ok(h) => i64::try_from(h).unwrap_or(i64::MAX),
        Err(e) => return unavailable("the beacon's chain head cannot be read", &e),
    };
    let r = &checked.request;
    match state.store.insert_request(r).await {
        Ok(stored) => {
            let (code, word) = match stored {
                Stored::New => (StatusCode::ACCEPTED, "new"),
                Stored::Duplicate => (StatusCode::OK, "duplicate"),
            };
            state
                .metrics
                .requests
                .get_or_create(&engy_telemetry::metrics::labels(&[("outcome", word)]))
                .inc();
            tracing::debug!(digest = %r.digest, hotkey = %r.hotkey, model = %r.model, stored = word, "report");
            (code, Json(json!({"digest": r.digest, "stored": word}))).into_response()
        }
        Err(e) => unavailable("the report cannot be stored", &e),
    }
}

async fn get_request(State(state): State<Arc<AppState>>, Path(digest): Path<String>) -> Response {
    match state.store.request_status(&digest).await {
        Ok(Some(s)) => {
            let mut v = serde_json::to_value(&s).unwrap_or(Value::Null);
            let waiting = s.job_state.as_deref() == Some("queued");
            let model_state = state
                .model_states
                .lock()
                .ok()
                .and_then(|m| m.get(&s.model).cloned());
            if waiting {
                if let (Some(m), Value::Object(o)) = (model_state, &mut v) {
                    if !m.starts_with("loaded") {
                        o.insert(
                            "note".into(),
                            json!(format!(
                                "no worker of this process holds model {}: {m}; the job stays \
                                 queued until a worker that holds it claims it",
                                s.model
                            )),
                        );
                    }
                }
            }
            Json(v).into_response()
        }
        Ok(None) => refuse(StatusCode::NOT_FOUND, "digest", "no such request"),
        Err(e) => unavailable("the database cannot be read", &e),
    }
}

async fn get_miner(State(state): State<Arc<AppState>>, Path(hotkey): Path<String>) -> Response {
    match state.store.miner_counts(&hotkey).await {
        Ok(per_model) => {
            let mut total = Counts::default();
            let mut models = serde_json::Map::new();
            for (model, c) in &per_model {
                total.pass += c.pass;
                total.cheat += c.cheat;
                total.unproven += c.unproven;
                total.unanswered += c.unanswered;
                models.insert(
                    model.clone(),
                    serde_json::to_value(Summary::of(c, state.min_sample)).unwrap_or(Value::Null),
                );
            }
            let summary =
                serde_json::to_value(Summary::of(&total, state.min_sample)).unwrap_or(Value::Null);
            let ledger = match state.store.near_tie_ledger(&hotkey).await {
                Ok(l) => l,
                Err(e) => return unavailable("the database cannot be read", &e),
            };
            let mut out = json!({"hotkey": hotkey, "models": models});
            if let (Value::Object(o), Value::Object(s)) = (&mut out, summary) {
                o.extend(s);
                o.extend(near_tie_fields(&ledger));
            }
            Json(out).into_response()
        }
        Err(e) => unavailable("the database cannot be read", &e),
    }
}

/// The near-tie ledger's fields of `GET /v1/miners/{hotkey}`: `near_ties` (the running
/// totals and the limit they are held to) and `near_tie_flagged` with its `near_tie_reason`.
/// The test is `engy_model::cells::stats::near_ties_flagged` on the sums over all the miner's
/// judged bundles, with the default `StatsPolicy` (rate `near_tie_rate`, false-flag bound
/// `false_flag` per judgement): bundles that each pass alone can be flagged together.
fn near_tie_fields(l: &crate::store::NearTieLedger) -> serde_json::Map<String, Value> {
    use engy_model::cells::stats::{near_tie_limit, near_ties_flagged, StatsPolicy};
    let policy = StatsPolicy::default();
    let near_ties = usize::try_from(l.near_ties).unwrap_or(usize::MAX);
    let cells = usize::try_from(l.cells).unwrap_or(usize::MAX);
    let limit = near_tie_limit(cells, policy.near_tie_rate, policy.false_flag);
    let flagged = l.cells > 0 && near_ties_flagged(near_ties, cells, &policy);
    let reason = flagged.then(|| {
        format!(
            "{near_ties} of {cells} cells over {} judged bundles take a near-tied expert set; \
             an honest serve (rate ≤ {}) reaches {limit} with probability ≤ {:e}",
            l.bundles, policy.near_tie_rate, policy.false_flag
        )
    });
    let mut m = serde_json::Map::new();
    m.insert(
        "near_ties".into(),
        json!({"bundles": l.bundles, "near_ties": l.near_ties, "cells": l.cells, "limit": limit}),
    );
    m.insert("near_tie_flagged".into(), Value::Bool(flagged));
    m.insert("near_tie_reason".into(), json!(reason));
    m
}

/// `GET /v1/verdicts` query.
#[derive(serde::Deserialize)]
struct Since {
    since: Option<i64>,
    limit: Option<i64>,
}

async fn get_verdicts(
    State(state): State<Arc<AppState>>,
    q: Result<Query<Since>, axum::extract::rejection::QueryRejection>,
) -> Response {
    let Ok(Query(q)) = q else {
        return refuse(
            StatusCode::BAD_REQUEST,
            "since",
            "since and limit must be integers",
        );
    };
    let limit = q.limit.unwrap_or(1000).clamp(1, 1000);
    match state
        .store
        .verdicts_since(q.since.unwrap_or(0), limit)
        .await
    {
        Ok(rows) => {
            let next = rows.last().map(|r| r.decided_ms);
            Json(json!({"verdicts": rows, "next_since": next})).into_response()
        }
        Err(e) => unavailable("the database cannot be read", &e),
    }
}

async fn get_verdict(State(state): State<Arc<AppState>>, Path(digest): Path<String>) -> Response {
    match state.store.verdict(&digest).await {
        Ok(Some(v)) => Json(v).into_response(),
        Ok(None) => refuse(
            StatusCode::NOT_FOUND,
            "digest",
            "no verdict for this digest",
        ),
        Err(e) => unavailable("the database cannot be read", &e),
    }
}

async fn get_evidence(
    State(state): State<Arc<AppState>>,
    Path((digest, file)): Path<(String, String)>,
) -> Response {
    let e = match state.store.evidence(&digest).await {
        Ok(Some(e)) => e,
        Ok(None) => {
            return refuse(
                StatusCode::NOT_FOUND,
                "digest",
                "no evidence for this digest (only cheat verdicts keep evidence)",
            )
        }
        Err(e) => return unavailable("the database cannot be read", &e),
    };
    let text = match file.as_str() {
        "commitment.json" => e.commitment,
        "report.json" => e.report,
        "bundle.json" => match e.bundle {
            Some(b) => b,
            None => return refuse(StatusCode::NOT_FOUND, "file", "no cell bundle was kept"),
        },
        _ => {
            return refuse(
                StatusCode::NOT_FOUND,
                "file",
                "commitment.json, report.json or bundle.json",
            )
        }
    };
    ([(header::CONTENT_TYPE, "application/json")], text).into_response()
}

async fn health(State(state): State<Arc<AppState>>) -> Response {
    let db = state.store.ping().await;
    let models = state
        .model_states
        .lock()
        .map(|m| m.clone())
        .unwrap_or_default();
    let all_loaded = models.values().all(|s| s.starts_with("loaded"));
    let status = match (db, all_loaded || state.workers == 0) {
        (false, _) => "db-unreachable",
        (true, false) => "degraded",
        (true, true) => "ok",
    };
    let requests = state.store.request_count().await.ok();
    let jobs = state
        .store
        .job_counts()
        .await
        .ok()
        .map(|(q, l, d)| json!({"queued": q, "leased": l, "done": d}));
    let body = json!({
        "status": status,
        "requests": requests,
        "jobs": jobs,
        "build": engy_telemetry::build_info::BUILD.describe("engy-audit"),
        "db": db,
        "engine": format!("{:?}", state.store.engine()).to_lowercase(),
        "workers": state.workers,
        "models": models,
    });
    let code = if db {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    (code, Json(body)).into_response()
}

async fn metrics(State(state): State<Arc<AppState>>, headers: HeaderMap) -> Response {
    // Database-wide gauges are read at scrape time.
    if let Ok((q, l, _)) = state.store.job_counts().await {
        let m = &state.metrics;
        m.queue
            .get_or_create(&engy_telemetry::metrics::labels(&[("state", "queued")]))
            .set(q);
        m.queue
            .get_or_create(&engy_telemetry::metrics::labels(&[("state", "leased")]))
            .set(l);
    }
    if let Ok(miners) = state.store.all_miner_counts().await {
        let mut totals = Counts::default();
        for (hotkey, c) in &miners {
            totals.pass += c.pass;
            totals.cheat += c.cheat;
            totals.unproven += c.unproven;
            totals.unanswered += c.unanswered;
            let s = Summary::of(c, state.min_sample);
            state
                .metrics
                .miner_cheat_rate
                .get_or_create(&engy_telemetry::metrics::labels(&[("hotkey", hotkey)]))
                .set(s.cheat_rate);
        }
        for (v, n) in [
            ("pass", totals.pass),
            ("cheat", totals.cheat),
            ("unproven", totals.unproven),
            ("unanswered", totals.unanswered),
        ] {
            state
                .metrics
                .verdicts
                .get_or_create(&engy_telemetry::metrics::labels(&[("verdict", v)]))
                .set(i64::try_from(n).unwrap_or(i64::MAX));
        }
    }
    let format = engy_telemetry::metrics::Format::negotiate(
        headers.get(header::ACCEPT).and_then(|v| v.to_str().ok()),
    );
    match engy_telemetry::metrics::encode_as(&state.registry, format) {
        Ok(text) => ([(header::CONTENT_TYPE, format.content_type())], text).into_response(),
        Err(_) => StatusCode::INTERNAL_SERVER_ERROR.into_response(),
    }
}
