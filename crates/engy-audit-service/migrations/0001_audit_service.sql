-- engy audit service, schema 1. One text for SQLite and PostgreSQL: only types and clauses
-- both engines read the same way (TEXT, BIGINT, DOUBLE PRECISION, partial indexes,
-- ON CONFLICT, RETURNING). Times are milliseconds since the Unix epoch; flags are 0/1.

-- Every report the gateway sent that was accepted, once per commitment (digest = SHA-256
-- of the commitment's bytes as the report carried them, 64 hex).
CREATE TABLE requests (
    digest          TEXT PRIMARY KEY,
    request_id      TEXT NOT NULL,
    hotkey          TEXT NOT NULL,
    model           TEXT NOT NULL,
    commitment      TEXT NOT NULL,
    timing          TEXT NOT NULL,
    has_cells       BIGINT NOT NULL,
    received_ms     BIGINT NOT NULL,
    window_start_ms BIGINT NOT NULL,
    -- the chain head when the report arrived; the beacon is the hash of the block after it
    head_block      BIGINT NOT NULL,
    beacon          TEXT,
    seed            TEXT,
    -- NULL until the beacon exists; then 0 or 1
    sampled         BIGINT,
    sample_reason   TEXT
);
CREATE INDEX requests_undecided ON requests (received_ms) WHERE sampled IS NULL;
CREATE INDEX requests_miner_window ON requests (model, hotkey, window_start_ms);

-- The audit queue: one job per sampled request.
CREATE TABLE jobs (
    digest        TEXT PRIMARY KEY REFERENCES requests (digest),
    model         TEXT NOT NULL,
    -- queued | leased | done
    state         TEXT NOT NULL,
    worker        TEXT,
    lease_token   TEXT,
    lease_until_ms BIGINT,
    attempts      BIGINT NOT NULL,
    not_before_ms BIGINT NOT NULL,
    last_error    TEXT,
    queued_ms     BIGINT NOT NULL
);
CREATE INDEX jobs_ready ON jobs (state, model, queued_ms);

-- One verdict per commitment, written in the transaction that closes its job.
CREATE TABLE verdicts (
    digest        TEXT PRIMARY KEY REFERENCES requests (digest),
    request_id    TEXT NOT NULL,
    hotkey        TEXT NOT NULL,
    model         TEXT NOT NULL,
    -- pass | cheat | unproven | unanswered
    verdict       TEXT NOT NULL,
    reasons       TEXT NOT NULL,
    score         DOUBLE PRECISION,
    report        TEXT NOT NULL,
    worker        TEXT NOT NULL,
    audit_seconds DOUBLE PRECISION NOT NULL,
    decided_ms    BIGINT NOT NULL
);
CREATE INDEX verdicts_decided ON verdicts (decided_ms);
CREATE INDEX verdicts_hotkey ON verdicts (hotkey);

-- What anyone needs to re-check a cheat verdict with `engy-audit audit` / `engy-audit cells`.
CREATE TABLE evidence (
    digest     TEXT PRIMARY KEY REFERENCES verdicts (digest),
    commitment TEXT NOT NULL,
    report     TEXT NOT NULL,
    bundle     TEXT
);
