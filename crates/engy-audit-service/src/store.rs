//! The service's database: one schema (`migrations/`, run by sqlx's migrator at start-up) on
//! two engines, chosen by the URL of `--db` / `ENGY_AUDIT_DB`:
//!
//! * `sqlite://PATH` (embedded, the default; created when missing, WAL journal so that
//!   several processes of one machine share it; one writer at a time, each statement below
//!   is atomic on its own);
//! * `postgres://USER@HOST:PORT/DB` (scale-out: workers on several machines share it).
//!
//! Every query goes through sqlx's `Any` driver with `$n` parameters (both engines read
//! them), so the two engines run the same statements, except the job claim's row lock:
//! PostgreSQL takes the oldest ready job `FOR UPDATE SKIP LOCKED` (concurrent claimers skip
//! each other's row instead of waiting), SQLite's single `UPDATE … RETURNING` holds the
//! database's one write lock for the statement.
//!
//! The rules the schema keeps:
//! * a request is stored once per commitment (`requests.digest`, the SHA-256 of the
//!   commitment's bytes, is the key; a repeat is [`Stored::Duplicate`]);
//! * a job is held under a lease (`lease_token`, `lease_until_ms`): its worker renews it
//!   while it audits; a lease that runs out is taken back ([`Store::expire_leases`]) and the
//!   job claimed again;
//! * a verdict is written exactly once per commitment: `verdicts.digest` is the key, and the
//!   verdict is inserted in the one transaction that closes the job, only while the writer
//!   still holds the job's lease ([`Store::finish`]).
use std::borrow::Cow;
use std::str::FromStr as _;

use sqlx::any::{AnyPoolOptions, AnyRow};
use sqlx::migrate::{Migration, MigrationType, Migrator};
use sqlx::{AnyPool, Row as _};

/// The database engine behind a [`Store`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Engine {
    /// SQLite, embedded (`sqlite://`).
    Sqlite,
    /// PostgreSQL (`postgres://` or `postgresql://`).
    Postgres,
}

impl Engine {
    /// The engine a `--db` URL names.
    ///
    /// # Errors
    /// [`StoreError::Url`] for any other scheme.
    pub fn of_url(url: &str) -> Result<Engine, StoreError> {
        if url.starts_with("sqlite:") {
            Ok(Engine::Sqlite)
        } else if url.starts_with("postgres://") || url.starts_with("postgresql://") {
            Ok(Engine::Postgres)
        } else {
            Err(StoreError::Url(format!(
                "{:?} is neither sqlite://PATH nor postgres://USER@HOST/DB",
                redact(url)
            )))
        }
    }
}

/// Why the database could not be used.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// The `--db` URL names no engine this service speaks.
    #[error("--db / ENGY_AUDIT_DB: {0}")]
    Url(String),
    /// The database could not be reached or opened.
    #[error("cannot open the database {url}: {source}")]
    Connect {
        /// The URL, its password replaced by `***`.
        url: String,
        /// sqlx's reason.
        source: sqlx::Error,
    },
    /// The schema could not be brought to this version.
    #[error("cannot migrate the database schema: {0}")]
    Migrate(#[from] sqlx::migrate::MigrateError),
    /// A statement failed (the connection dropped, the server restarted, a constraint).
    #[error("database: {0}")]
    Db(#[from] sqlx::Error),
}

/// `url` with the password of its user-info part replaced by `***`, for messages.
pub fn redact(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return url.to_owned();
    };
    let Some((userinfo, host)) = rest.split_once('@') else {
        return url.to_owned();
    };
    match userinfo.split_once(':') {
        Some((user, _)) => format!("{scheme}://{user}:***@{host}"),
        None => url.to_owned(),
    }
}

/// The migrations, embedded in the binary (sqlx's migrator, without its macros).
fn migrator() -> Migrator {
    Migrator {
        migrations: Cow::Owned(vec![
            Migration::new(
                1,
                Cow::Borrowed("audit service"),
                MigrationType::Simple,
                Cow::Borrowed(include_str!("../migrations/0001_audit_service.sql")),
                false,
            ),
            Migration::new(
                2,
                Cow::Borrowed("near-tie ledger"),
                MigrationType::Simple,
                Cow::Borrowed(include_str!("../migrations/0002_near_tie_ledger.sql")),
                false,
            ),
        ]),
        ignore_missing: false,
        locking: true,
        no_tx: false,
    }
}

/// A report to store ([`Store::insert_request`]).
#[derive(Debug, Clone)]
pub struct NewRequest {
    /// SHA-256 of the commitment's bytes, 64 lowercase hex.
    pub digest: String,
    /// The gateway's `request_id`.
    pub request_id: String,
    /// The miner's hotkey (SS58).
    pub hotkey: String,
    /// The model name, one the service is configured with.
    pub model: String,
    /// The commitment's bytes as the report carried them (UTF-8 JSON).
    pub commitment: String,
    /// The report's `timing` object, as JSON.
    pub timing: String,
    /// Whether the commitment carries `cells`.
    pub has_cells: bool,
    /// When the report arrived (ms since the epoch).
    pub received_ms: i64,
    /// The start of its sampling window (ms since the epoch).
    pub window_start_ms: i64,
    /// The chain head when it arrived (the beacon is the next block's hash).
    pub head_block: i64,
}

/// What [`Store::insert_request`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stored {
    /// A new request.
    New,
    /// The commitment was reported before; nothing changed.
    Duplicate,
}

/// A request whose sampling is not decided yet (its beacon block may not exist yet).
#[derive(Debug, Clone)]
pub struct Undecided {
    /// Commitment digest (hex).
    pub digest: String,
    /// Model name.
    pub model: String,
    /// The chain head when it arrived.
    pub head_block: i64,
}

/// A claimed job ([`Store::claim`]).
#[derive(Debug, Clone)]
pub struct Job {
    /// Commitment digest (hex).
    pub digest: String,
    /// Model name.
    pub model: String,
    /// The lease's token: only its holder may renew, release or finish the job.
    pub lease_token: String,
    /// Claims so far, this one included.
    pub attempts: i64,
    /// The gateway's `request_id`.
    pub request_id: String,
    /// The miner's hotkey.
    pub hotkey: String,
    /// The commitment's bytes.
    pub commitment: String,
    /// The challenge seed (hex), from the beacon.
    pub seed: Option<String>,
    /// Whether the commitment carries cells.
    pub has_cells: bool,
    /// When the report arrived (ms since the epoch): the cell challenge's age is counted
    /// from it (docs/PROTOCOL.md §10 "Retention").
    pub received_ms: i64,
}

/// A verdict as stored and served (`GET /v1/verdicts`).
#[derive(Debug, Clone, serde::Serialize)]
pub struct VerdictRow {
    /// Commitment digest (hex).
    pub digest: String,
    /// The gateway's `request_id`.
    pub request_id: String,
    /// The miner's hotkey.
    pub hotkey: String,
    /// Model name.
    pub model: String,
    /// `pass`, `cheat`, `unproven` or `unanswered`.
    pub verdict: String,
    /// Why (empty for a plain pass).
    pub reasons: Vec<String>,
    /// The TOPLOC score (mean exponent mismatches / top-k), when the recompute ran.
    pub score: Option<f64>,
    /// The worker that wrote it.
    pub worker: String,
    /// Seconds the audit took.
    pub audit_seconds: f64,
    /// When it was written (ms since the epoch).
    pub decided_ms: i64,
    /// Near-tie cells of the answered cell challenge's bundle (`CellStats::near_ties`);
    /// `None` when no bundle was judged.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub near_ties: Option<u64>,
    /// Cells of that bundle judged (`CellStats::n`); `None` when no bundle was judged.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cells_judged: Option<u64>,
    /// The full audit report (JSON), only where asked for.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub report: Option<serde_json::Value>,
}

/// A miner's near-tie ledger: its bundles' near-tie cells and judged cells summed over all
/// its verdicts ([`Store::near_tie_ledger`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct NearTieLedger {
    /// Verdicts whose bundle was judged.
    pub bundles: u64,
    /// Near-tie cells over those bundles.
    pub near_ties: u64,
    /// Cells judged over those bundles.
    pub cells: u64,
}

/// A cheat's evidence: what `engy-audit audit` / `engy-audit cells` re-check by themselves.
#[derive(Debug, Clone)]
pub struct Evidence {
    /// The commitment's bytes as the miner sent them.
    pub commitment: String,
    /// The audit report (JSON).
    pub report: String,
    /// The miner's cell audit bundle (JSON), when a cell challenge was answered.
    pub bundle: Option<String>,
}

/// Where a request stands (`GET /v1/requests/{digest}`).
#[derive(Debug, Clone, serde::Serialize)]
pub struct RequestStatus {
    /// Commitment digest (hex).
    pub digest: String,
    /// The gateway's `request_id`.
    pub request_id: String,
    /// The miner's hotkey.
    pub hotkey: String,
    /// Model name.
    pub model: String,
    /// `null` until decided, then whether it is audited.
    pub sampled: Option<bool>,
    /// `rate` or `floor` when sampled.
    pub sample_reason: Option<String>,
    /// `queued`, `leased` or `done` when sampled.
    pub job_state: Option<String>,
    /// Claims so far.
    pub attempts: Option<i64>,
    /// Why the last attempt did not give a verdict.
    pub last_error: Option<String>,
    /// The verdict, once written.
    pub verdict: Option<String>,
}

/// Verdict counts of one miner (and model).
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
pub struct Counts {
    /// `pass` verdicts.
    pub pass: u64,
    /// `cheat` verdicts.
    pub cheat: u64,
    /// `unproven` verdicts.
    pub unproven: u64,
    /// `unanswered` verdicts.
    pub unanswered: u64,
}

/// The database, shared by the intake, the sampler and the workers (clone freely).
#[derive(Debug, Clone)]
pub struct Store {
    pool: AnyPool,
    engine: Engine,
}

/// Milliseconds since the Unix epoch, now.
pub fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
}

impl Store {
    /// Opens the database at `url` (creating an SQLite file when missing) and brings its
    /// schema to this version.
    ///
    /// # Errors
    /// [`StoreError::Url`], [`StoreError::Connect`], [`StoreError::Migrate`].
    pub async fn open(url: &str) -> Result<Store, StoreError> {
        let engine = Engine::of_url(url)?;
        sqlx::any::install_default_drivers();
        let connect_url = match engine {
            Engine::Sqlite if !url.contains("mode=") => {
                let sep = if url.contains('?') { '&' } else { '?' };
                format!("{url}{sep}mode=rwc")
            }
            _ => url.to_owned(),
        };
        let options = sqlx::any::AnyConnectOptions::from_str(&connect_url).map_err(|e| {
            StoreError::Connect {
                url: redact(url),
                source: e,
            }
        })?;
        let pool = AnyPoolOptions::new()
            .max_connections(match engine {
                Engine::Sqlite => 4,
                Engine::Postgres => 8,
            })
            .acquire_timeout(std::time::Duration::from_secs(10))
            .after_connect(move |conn, _| {
                Box::pin(async move {
                    if engine == Engine::Sqlite {
                        // Several processes of one machine share the file: readers never
                        // wait for the writer, and a writer waits (up to 10 s) for another.
                        sqlx::query("PRAGMA journal_mode = WAL")
                            .execute(&mut *conn)
                            .await?;
                        sqlx::query("PRAGMA busy_timeout = 10000")
                            .execute(&mut *conn)
                            .await?;
                        sqlx::query("PRAGMA foreign_keys = ON")
                            .execute(&mut *conn)
                            .await?;
                    }
                    Ok(())
                })
            })
            .connect_with(options)
            .await
            .map_err(|e| StoreError::Connect {
                url: redact(url),
                source: e,
            })?;
        migrator().run(&pool).await?;
        Ok(Store { pool, engine })
    }

    /// The engine.
    pub fn engine(&self) -> Engine {
        self.engine
    }

    /// Whether the database answers (`SELECT 1`).
    pub async fn ping(&self) -> bool {
        sqlx::query("SELECT 1").execute(&self.pool).await.is_ok()
    }

    /// Stores a report once per commitment digest.
    ///
    /// # Errors
    /// [`StoreError::Db`].
    pub async fn insert_request(&self, r: &NewRequest) -> Result<Stored, StoreError> {
        let done = sqlx::query(
            "INSERT INTO requests (digest, request_id, hotkey, model, commitment, timing, \
             has_cells, received_ms, window_start_ms, head_block) \
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10) ON CONFLICT (digest) DO NOTHING",
        )
        .bind(&r.digest)
        .bind(&r.request_id)
        .bind(&r.hotkey)
        .bind(&r.model)
        .bind(&r.commitment)
        .bind(&r.timing)
        .bind(i64::from(r.has_cells))
        .bind(r.received_ms)
        .bind(r.window_start_ms)
        .bind(r.head_block)
        .execute(&self.pool)
        .await?;
        Ok(if done.rows_affected() == 1 {
            Stored::New
        } else {
            Stored::Duplicate
        })
    }

    /// Requests whose sampling is not decided, oldest first, at most `limit`.
    ///
    /// # Errors
    /// [`StoreError::Db`].
    pub async fn undecided(&self, limit: i64) -> Result<Vec<Undecided>, StoreError> {
        let rows = sqlx::query(
            "SELECT digest, model, head_block FROM requests WHERE sampled IS NULL \
             ORDER BY received_ms LIMIT $1",
        )
        .bind(limit)
        .fetch_all(&self.pool)
        .await?;
        rows.iter()
            .map(|r| {
                Ok(Undecided {
                    digest: r.try_get(0)?,
                    model: r.try_get(1)?,
                    head_block: r.try_get(2)?,
                })
            })
            .collect::<Result<_, sqlx::Error>>()
            .map_err(StoreError::from)
    }

    /// Records the sampling decision of an undecided request (its beacon and seed, hex) and,
    /// when sampled, queues its job, in one transaction. A request decided meanwhile by
    /// another process is left as it is.
    ///
    /// # Errors
    /// [`StoreError::Db`].
    pub async fn decide(
        &self,
        digest: &str,
        model: &str,
        beacon: &str,
        seed: &str,
        sampled: Option<&str>,
    ) -> Result<(), StoreError> {
        let mut tx = self.pool.begin().await?;
        let done = sqlx::query(
            "UPDATE requests SET beacon = $1, seed = $2, sampled = $3, sample_reason = $4 \
             WHERE digest = $5 AND sampled IS NULL",
        )
        .bind(beacon)
        .bind(seed)
        .bind(i64::from(sampled.is_some()))
        .bind(sampled)
        .bind(digest)
        .execute(&mut *tx)
        .await?;
        if done.rows_affected() == 1 && sampled.is_some() {
            queue_job(&mut tx, digest, model).await?;
        }
        tx.commit().await?;
        Ok(())
    }

    /// The floor's top-up of the windows that started before `ended_before_ms` (and at or
    /// after `since_ms`): for each (model, miner, window) whose requests are all decided and
    /// of which fewer than `k` are sampled, samples the not-yet-sampled ones of lowest seed
    /// until `k` are (reason `floor`). The seeds come from beacons that did not exist when
    /// the miner committed, so which requests the floor takes cannot be predicted either.
    /// Returns how many requests it sampled.
    ///
    /// # Errors
    /// [`StoreError::Db`].
    pub async fn top_up_floor(
        &self,
        since_ms: i64,
        ended_before_ms: i64,
        k: i64,
    ) -> Result<u64, StoreError> {
        let short = sqlx::query(
            "SELECT model, hotkey, window_start_ms, CAST(SUM(COALESCE(sampled, 0)) AS BIGINT), \
             CAST(SUM(CASE WHEN sampled IS NULL THEN 1 ELSE 0 END) AS BIGINT), COUNT(*) \
             FROM requests WHERE window_start_ms >= $1 AND window_start_ms < $2 \
             GROUP BY model, hotkey, window_start_ms",
        )
        .bind(since_ms)
        .bind(ended_before_ms)
        .fetch_all(&self.pool)
        .await?;
        let mut added = 0;
        for row in short {
            let model: String = row.try_get(0)?;
            let hotkey: String = row.try_get(1)?;
            let window: i64 = row.try_get(2)?;
            let sampled: i64 = row.try_get(3)?;
            let undecided: i64 = row.try_get(4)?;
            let n: i64 = row.try_get(5)?;
            if undecided > 0 || sampled >= k || sampled >= n {
                continue;
            }
            let mut tx = self.pool.begin().await?;
            let picked = sqlx::query(
                "SELECT digest FROM requests WHERE model = $1 AND hotkey = $2 \
                 AND window_start_ms = $3 AND sampled = 0 ORDER BY seed LIMIT $4",
            )
            .bind(&model)
            .bind(&hotkey)
            .bind(window)
            .bind(k - sampled)
            .fetch_all(&mut *tx)
            .await?;
            for p in picked {
                let digest: String = p.try_get(0)?;
                let done = sqlx::query(
                    "UPDATE requests SET sampled = 1, sample_reason = 'floor' \
                     WHERE digest = $1 AND sampled = 0",
                )
                .bind(&digest)
                .execute(&mut *tx)
                .await?;
                if done.rows_affected() == 1 {
                    queue_job(&mut tx, &digest, &model).await?;
                    added += 1;
                }
            }
            tx.commit().await?;
        }
        Ok(added)
    }

    /// Takes back every lease that ran out before `now_ms`: the job is queued again. Returns
    /// (digest, worker) of each.
    ///
    /// # Errors
    /// [`StoreError::Db`].
    pub async fn expire_leases(&self, now_ms: i64) -> Result<Vec<(String, String)>, StoreError> {
        let rows = sqlx::query(
            "UPDATE jobs SET state = 'queued', lease_token = NULL, lease_until_ms = NULL, \
             last_error = 'the lease of worker ' || COALESCE(worker, '?') || ' ran out' \
             WHERE state = 'leased' AND lease_until_ms < $1 RETURNING digest, worker",
        )
        .bind(now_ms)
        .fetch_all(&self.pool)
        .await?;
        rows.iter()
            .map(|r| {
                Ok((
                    r.try_get(0)?,
                    r.try_get::<Option<String>, _>(1)?.unwrap_or_default(),
                ))
            })
            .collect::<Result<_, sqlx::Error>>()
            .map_err(StoreError::from)
    }

    /// Claims the oldest ready job of one of `models` for `worker`, leased until
    /// `now_ms + lease_ms`. `None` when there is none.
    ///
    /// # Errors
    /// [`StoreError::Db`].
    pub async fn claim(
        &self,
        worker: &str,
        models: &[String],
        now_ms: i64,
        lease_ms: i64,
    ) -> Result<Option<Job>, StoreError> {
        if models.is_empty() {
            return Ok(None);
        }
        let token = uuid::Uuid::new_v4().to_string();
        let list: Vec<String> = (0..models.len()).map(|i| format!("${}", i + 5)).collect();
        let lock = match self.engine {
            Engine::Postgres => " FOR UPDATE SKIP LOCKED",
            Engine::Sqlite => "",
        };
        let sql = format!(
            "UPDATE jobs SET state = 'leased', worker = $1, lease_token = $2, \
             lease_until_ms = $3, attempts = attempts + 1 \
             WHERE digest = (SELECT digest FROM jobs WHERE state = 'queued' \
             AND not_before_ms <= $4 AND model IN ({}) ORDER BY queued_ms, digest LIMIT 1{lock}) \
             AND state = 'queued' RETURNING digest, model, attempts",
            list.join(", ")
        );
        let mut q = sqlx::query(&sql)
            .bind(worker)
            .bind(&token)
            .bind(now_ms.saturating_add(lease_ms))
            .bind(now_ms);
        for m in models {
            q = q.bind(m);
        }
        let Some(row) = q.fetch_optional(&self.pool).await? else {
            return Ok(None);
        };
        let digest: String = row.try_get(0)?;
        let model: String = row.try_get(1)?;
        let attempts: i64 = row.try_get(2)?;
        let r = sqlx::query(
            "SELECT request_id, hotkey, commitment, seed, has_cells, received_ms FROM requests \
             WHERE digest = $1",
        )
        .bind(&digest)
        .fetch_one(&self.pool)
        .await?;
        Ok(Some(Job {
            digest,
            model,
            lease_token: token,
            attempts,
            request_id: r.try_get(0)?,
            hotkey: r.try_get(1)?,
            commitment: r.try_get(2)?,
            seed: r.try_get(3)?,
            has_cells: r.try_get::<i64, _>(4)? != 0,
            received_ms: r.try_get(5)?,
        }))
    }

    /// Extends a held lease to `until_ms`; `false` when the lease is no longer this one's.
    ///
    /// # Errors
    /// [`StoreError::Db`].
    pub async fn renew(&self, job: &Job, until_ms: i64) -> Result<bool, StoreError> {
        let done = sqlx::query(
            "UPDATE jobs SET lease_until_ms = $1 WHERE digest = $2 AND lease_token = $3 \
             AND state = 'leased'",
        )
        .bind(until_ms)
        .bind(&job.digest)
        .bind(&job.lease_token)
        .execute(&self.pool)
        .await?;
        Ok(done.rows_affected() == 1)
    }

    /// Gives a held job back to the queue: with `error` (the audit could not run; the claim
    /// counts, the job waits until `not_before_ms`), or without (a worker shutting down;
    /// the claim does not count). `false` when the lease was no longer this one's.
    ///
    /// # Errors
    /// [`StoreError::Db`].
    pub async fn release(
        &self,
        job: &Job,
        error: Option<&str>,
        not_before_ms: i64,
    ) -> Result<bool, StoreError> {
        let done = sqlx::query(
            "UPDATE jobs SET state = 'queued', worker = NULL, lease_token = NULL, \
             lease_until_ms = NULL, attempts = attempts - $1, \
             last_error = COALESCE($2, last_error), not_before_ms = $3 \
             WHERE digest = $4 AND lease_token = $5 AND state = 'leased'",
        )
        .bind(i64::from(error.is_none()))
        .bind(error)
        .bind(not_before_ms)
        .bind(&job.digest)
        .bind(&job.lease_token)
        .execute(&self.pool)
        .await?;
        Ok(done.rows_affected() == 1)
    }

    /// Closes a held job with its verdict (and, for a cheat, its evidence) in one
    /// transaction. `false`, and nothing written, when the lease is no longer this one's
    /// (it ran out and another worker took the job): that worker writes the verdict.
    ///
    /// # Errors
    /// [`StoreError::Db`].
    pub async fn finish(
        &self,
        job: &Job,
        v: &VerdictRow,
        report: &str,
        evidence: Option<&Evidence>,
    ) -> Result<bool, StoreError> {
        let mut tx = self.pool.begin().await?;
        let closed = sqlx::query(
            "UPDATE jobs SET state = 'done', lease_token = NULL, lease_until_ms = NULL, \
             last_error = NULL WHERE digest = $1 AND lease_token = $2 AND state = 'leased'",
        )
        .bind(&job.digest)
        .bind(&job.lease_token)
        .execute(&mut *tx)
        .await?;
        if closed.rows_affected() != 1 {
            tx.rollback().await?;
            return Ok(false);
        }
        let reasons = serde_json::to_string(&v.reasons).unwrap_or_else(|_| "[]".into());
        sqlx::query(
            "INSERT INTO verdicts (digest, request_id, hotkey, model, verdict, reasons, score, \
             report, worker, audit_seconds, decided_ms, near_ties, cells_judged) \
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13)",
        )
        .bind(&v.digest)
        .bind(&v.request_id)
        .bind(&v.hotkey)
        .bind(&v.model)
        .bind(&v.verdict)
        .bind(reasons)
        .bind(v.score)
        .bind(report)
        .bind(&v.worker)
        .bind(v.audit_seconds)
        .bind(v.decided_ms)
        .bind(v.near_ties.and_then(|n| i64::try_from(n).ok()))
        .bind(v.cells_judged.and_then(|n| i64::try_from(n).ok()))
        .execute(&mut *tx)
        .await?;
        if let Some(e) = evidence {
            sqlx::query(
                "INSERT INTO evidence (digest, commitment, report, bundle) \
                 VALUES ($1, $2, $3, $4)",
            )
            .bind(&v.digest)
            .bind(&e.commitment)
            .bind(&e.report)
            .bind(e.bundle.as_deref())
            .execute(&mut *tx)
            .await?;
        }
        tx.commit().await?;
        Ok(true)
    }

    /// Where the request of commitment `digest` stands; `None` when it was never reported.
    ///
    /// # Errors
    /// [`StoreError::Db`].
    pub async fn request_status(&self, digest: &str) -> Result<Option<RequestStatus>, StoreError> {
        let row = sqlx::query(
            "SELECT r.digest, r.request_id, r.hotkey, r.model, r.sampled, r.sample_reason, \
             j.state, j.attempts, j.last_error, v.verdict FROM requests r \
             LEFT JOIN jobs j ON j.digest = r.digest LEFT JOIN verdicts v ON v.digest = r.digest \
             WHERE r.digest = $1",
        )
        .bind(digest)
        .fetch_optional(&self.pool)
        .await?;
        let Some(r) = row else { return Ok(None) };
        Ok(Some(RequestStatus {
            digest: r.try_get(0)?,
            request_id: r.try_get(1)?,
            hotkey: r.try_get(2)?,
            model: r.try_get(3)?,
            sampled: r.try_get::<Option<i64>, _>(4)?.map(|s| s != 0),
            sample_reason: r.try_get(5)?,
            job_state: r.try_get(6)?,
            attempts: r.try_get(7)?,
            last_error: r.try_get(8)?,
            verdict: r.try_get(9)?,
        }))
    }

    /// Requests stored (all, including those not sampled).
    ///
    /// # Errors
    /// [`StoreError::Db`].
    pub async fn request_count(&self) -> Result<i64, StoreError> {
        Ok(sqlx::query("SELECT COUNT(*) FROM requests")
            .fetch_one(&self.pool)
            .await?
            .try_get(0)?)
    }

    /// Jobs by state: (queued, leased, done).
    ///
    /// # Errors
    /// [`StoreError::Db`].
    pub async fn job_counts(&self) -> Result<(i64, i64, i64), StoreError> {
        let rows = sqlx::query("SELECT state, COUNT(*) FROM jobs GROUP BY state")
            .fetch_all(&self.pool)
            .await?;
        let (mut q, mut l, mut d) = (0, 0, 0);
        for r in rows {
            let state: String = r.try_get(0)?;
            let n: i64 = r.try_get(1)?;
            match state.as_str() {
                "queued" => q = n,
                "leased" => l = n,
                _ => d = n,
            }
        }
        Ok((q, l, d))
    }

    /// Verdict counts of `hotkey` per model (empty when it has none).
    ///
    /// # Errors
    /// [`StoreError::Db`].
    pub async fn miner_counts(&self, hotkey: &str) -> Result<Vec<(String, Counts)>, StoreError> {
        let rows = sqlx::query(
            "SELECT model, verdict, COUNT(*) FROM verdicts WHERE hotkey = $1 \
             GROUP BY model, verdict ORDER BY model",
        )
        .bind(hotkey)
        .fetch_all(&self.pool)
        .await?;
        let mut out: Vec<(String, Counts)> = Vec::new();
        for r in rows {
            let model: String = r.try_get(0)?;
            let verdict: String = r.try_get(1)?;
            let n = u64::try_from(r.try_get::<i64, _>(2)?).unwrap_or(0);
            if out.last().is_none_or(|(m, _)| *m != model) {
                out.push((model.clone(), Counts::default()));
            }
            if let Some((_, c)) = out.last_mut() {
                add(c, &verdict, n);
            }
        }
        Ok(out)
    }

    /// The near-tie ledger of `hotkey`: its judged bundles' near-tie and judged cells summed
    /// over all its verdicts (all models; zeros when it has none).
    ///
    /// # Errors
    /// [`StoreError::Db`].
    pub async fn near_tie_ledger(&self, hotkey: &str) -> Result<NearTieLedger, StoreError> {
        let r = sqlx::query(
            "SELECT COUNT(cells_judged), CAST(COALESCE(SUM(near_ties), 0) AS BIGINT), \
             CAST(COALESCE(SUM(cells_judged), 0) AS BIGINT) FROM verdicts WHERE hotkey = $1",
        )
        .bind(hotkey)
        .fetch_one(&self.pool)
        .await?;
        let get = |i: usize| -> Result<u64, StoreError> {
            Ok(u64::try_from(r.try_get::<i64, _>(i)?).unwrap_or(0))
        };
        Ok(NearTieLedger {
            bundles: get(0)?,
            near_ties: get(1)?,
            cells: get(2)?,
        })
    }

    /// Verdict counts of every miner (all models together), for the metrics.
    ///
    /// # Errors
    /// [`StoreError::Db`].
    pub async fn all_miner_counts(&self) -> Result<Vec<(String, Counts)>, StoreError> {
        let rows = sqlx::query(
            "SELECT hotkey, verdict, COUNT(*) FROM verdicts GROUP BY hotkey, verdict \
             ORDER BY hotkey",
        )
        .fetch_all(&self.pool)
        .await?;
        let mut out: Vec<(String, Counts)> = Vec::new();
        for r in rows {
            let hotkey: String = r.try_get(0)?;
            let verdict: String = r.try_get(1)?;
            let n = u64::try_from(r.try_get::<i64, _>(2)?).unwrap_or(0);
            if out.last().is_none_or(|(h, _)| *h != hotkey) {
                out.push((hotkey.clone(), Counts::default()));
            }
            if let Some((_, c)) = out.last_mut() {
                add(c, &verdict, n);
            }
        }
        Ok(out)
    }

    /// Verdicts written at or after `since_ms`, oldest first, at most `limit`.
    ///
    /// # Errors
    /// [`StoreError::Db`].
    pub async fn verdicts_since(
        &self,
        since_ms: i64,
        limit: i64,
    ) -> Result<Vec<VerdictRow>, StoreError> {
        let rows = sqlx::query(
            "SELECT digest, request_id, hotkey, model, verdict, reasons, score, worker, \
             audit_seconds, decided_ms, near_ties, cells_judged FROM verdicts \
             WHERE decided_ms >= $1 \
             ORDER BY decided_ms, digest LIMIT $2",
        )
        .bind(since_ms)
        .bind(limit)
        .fetch_all(&self.pool)
        .await?;
        rows.iter().map(verdict_row).collect()
    }

    /// The verdict of commitment `digest` with its full report.
    ///
    /// # Errors
    /// [`StoreError::Db`].
    pub async fn verdict(&self, digest: &str) -> Result<Option<VerdictRow>, StoreError> {
        let row = sqlx::query(
            "SELECT digest, request_id, hotkey, model, verdict, reasons, score, worker, \
             audit_seconds, decided_ms, near_ties, cells_judged, report FROM verdicts \
             WHERE digest = $1",
        )
        .bind(digest)
        .fetch_optional(&self.pool)
        .await?;
        let Some(r) = row else { return Ok(None) };
        let mut v = verdict_row(&r)?;
        let report: String = r.try_get(12)?;
        v.report = serde_json::from_str(&report).ok();
        Ok(Some(v))
    }

    /// The evidence kept for commitment `digest` (cheat verdicts only).
    ///
    /// # Errors
    /// [`StoreError::Db`].
    pub async fn evidence(&self, digest: &str) -> Result<Option<Evidence>, StoreError> {
        let row = sqlx::query("SELECT commitment, report, bundle FROM evidence WHERE digest = $1")
            .bind(digest)
            .fetch_optional(&self.pool)
            .await?;
        let Some(r) = row else { return Ok(None) };
        Ok(Some(Evidence {
            commitment: r.try_get(0)?,
            report: r.try_get(1)?,
            bundle: r.try_get(2)?,
        }))
    }

    /// Closes the pool (waits for connections in use to come back).
    pub async fn close(&self) {
        self.pool.close().await;
    }
}

/// Adds `n` verdicts of kind `verdict` to `c`.
fn add(c: &mut Counts, verdict: &str, n: u64) {
    match verdict {
        "pass" => c.pass += n,
        "cheat" => c.cheat += n,
        "unanswered" => c.unanswered += n,
        _ => c.unproven += n,
    }
}

fn verdict_row(r: &AnyRow) -> Result<VerdictRow, StoreError> {
    let reasons: String = r.try_get(5)?;
    Ok(VerdictRow {
        digest: r.try_get(0)?,
        request_id: r.try_get(1)?,
        hotkey: r.try_get(2)?,
        model: r.try_get(3)?,
        verdict: r.try_get(4)?,
        reasons: serde_json::from_str(&reasons).unwrap_or_default(),
        score: r.try_get(6)?,
        worker: r.try_get(7)?,
        audit_seconds: r.try_get(8)?,
        decided_ms: r.try_get(9)?,
        near_ties: r
            .try_get::<Option<i64>, _>(10)?
            .and_then(|n| u64::try_from(n).ok()),
        cells_judged: r
            .try_get::<Option<i64>, _>(11)?
            .and_then(|n| u64::try_from(n).ok()),
        report: None,
    })
}

/// Queues the job of a newly sampled request (inside the caller's transaction).
async fn queue_job(
    tx: &mut sqlx::Transaction<'_, sqlx::Any>,
    digest: &str,
    model: &str,
) -> Result<(), StoreError> {
    sqlx::query(
        "INSERT INTO jobs (digest, model, state, attempts, not_before_ms, queued_ms) \
         VALUES ($1, $2, 'queued', 0, 0, $3) ON CONFLICT (digest) DO NOTHING",
    )
    .bind(digest)
    .bind(model)
    .bind(now_ms())
    .execute(&mut **tx)
    .await?;
    Ok(())
}
