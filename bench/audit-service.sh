#!/usr/bin/env bash
# Audits per second and report-to-verdict latency of `engy-audit serve` (the real binary,
# the devnet model, CPU workers): one worker and two worker processes on one queue, on
# SQLite and, when PostgreSQL's binaries are installed (or ENGY_TEST_POSTGRES_URL is set), on
# PostgreSQL. See bench/README.md §4; medians go to bench/RESULTS.md.
#
#   bench/audit-service.sh [RUNS] [REPORTS] [TOKENS]     # default 3 runs, 40 reports, 64 tokens
#
# Prints one JSON line per run (crates/engy-audit/examples/service_bench.rs). Wall time:
# note the load average (each line carries it) beside any number you publish.
set -euo pipefail
cd "$(dirname "$0")/.."
RUNS="${1:-3}"
REPORTS="${2:-40}"
TOKENS="${3:-64}"
cargo build -q -p engy-audit --bin engy-audit --example service_bench
T="$(cargo metadata --format-version 1 --no-deps | python3 -c 'import json,sys; print(json.load(sys.stdin)["target_directory"])')/debug"
PG_URL="${ENGY_TEST_POSTGRES_URL:-}"
PG_DIR=""
if [ -z "$PG_URL" ] && ls /usr/lib/postgresql/*/bin/pg_ctl >/dev/null 2>&1; then
  PG_DIR="$(mktemp -d)"
  PG_URL="$(bash tests/postgres.sh start 55436 "$PG_DIR/pg")"
  trap 'bash tests/postgres.sh stop "$PG_DIR/pg" >/dev/null 2>&1 || true; rm -rf "$PG_DIR"' EXIT
fi
run() { "$T/examples/service_bench" --bin "$T/engy-audit" --reports "$REPORTS" --tokens "$TOKENS" "$@"; }
for _ in $(seq "$RUNS"); do
  run --db sqlite --workers 1
  run --db sqlite --workers 2
  if [ -n "$PG_URL" ]; then
    run --db "$PG_URL" --workers 1
    run --db "$PG_URL" --workers 2
  fi
done
