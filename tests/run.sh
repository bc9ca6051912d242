#!/usr/bin/env bash
# engy's test command (README "Run the tests").
#
# Starts the real subtensor runtime (chopsticks + the shared chain spec) on 127.0.0.1 when
# the shared harness is available, exports ENGY_SUBTENSOR_URL for the chain tests, runs every
# test of the workspace, and stops the chain again whatever happens.
#
# Env (all optional):
#   ENGY_SHARED_DIR      the shared folder beside the project (default: ../shared)
#   ENGY_CHAIN_PORT      port for the local chain (default 19944)
#   ENGY_SUBTENSOR_URL   use an already running chain instead of starting one
#   ENGY_SUBTENSOR293_URL  a running spec 293 chain (../shared/chain293) for the runtime-change
#                        step of the validator's chain tests; started on PORT+1 when unset
#   ENGY_NO_CHAIN=1      do not start a chain (chain tests then print a visible skip)
#   ENGY_TEST_POSTGRES_URL  a running PostgreSQL for the audit service's tests
#                        (crates/engy-audit/tests/serve.rs); when unset, one is started with
#                        tests/postgres.sh (Debian's postgresql package) on port PORT+6
#   ENGY_NO_POSTGRES=1   do not start PostgreSQL (its tests then print a visible skip)
#   ENGY_TF5_PYTHON      a python with torch + transformers 5.24: also run the real-shape
#                        check of engy-model against transformers (tests/reverse/arch_real_shape.py,
#                        docs/design/accuracy.md); skipped with a visible line otherwise
#   ENGY_CELLS_PYTHON    a python with torch + transformers 5.24: the sglang hook package's
#                        cross-language test (crates/engy-core/tests/cells_hooks.rs) runs with
#                        it; .ci/run makes one from PyPI; a visible SKIP line otherwise
# Extra arguments are passed to `cargo test` (before its `--`).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
export ENGY_SHARED_DIR="${ENGY_SHARED_DIR:-$(cd "$ROOT/.." && pwd)/shared}"
PORT="${ENGY_CHAIN_PORT:-19944}"
HARNESS="$ENGY_SHARED_DIR/chain"
HARNESS293="$ENGY_SHARED_DIR/chain293"
PORT293=$((PORT + 1))
STARTED=0
STARTED293=0

say() { echo "[tests/run.sh] $*" >&2; }

stop_chain() {
  if [ "$STARTED" = 1 ]; then
    say "stopping the local chain on port $PORT"
    bash "$HARNESS/stop-subtensor.sh" "$PORT" >&2 || true
  fi
  if [ "$STARTED293" = 1 ]; then
    say "stopping the spec 293 chain on port $PORT293"
    bash "$HARNESS293/stop-subtensor.sh" "$PORT293" >&2 || true
  fi
}
PG_DIR=""
stop_postgres() {
  if [ -n "$PG_DIR" ]; then
    say "stopping PostgreSQL ($PG_DIR)"
    bash "$ROOT/tests/postgres.sh" stop "$PG_DIR/pg" || true
    rm -rf "$PG_DIR"
  fi
}
trap 'stop_chain; stop_postgres' EXIT

if [ -n "${ENGY_SUBTENSOR_URL:-}" ]; then
  say "using the running chain at $ENGY_SUBTENSOR_URL"
elif [ "${ENGY_NO_CHAIN:-0}" = 1 ]; then
  say "ENGY_NO_CHAIN=1: chain tests will be skipped"
elif [ -f "$HARNESS/start-subtensor.sh" ] && command -v node >/dev/null && command -v npm >/dev/null; then
  say "starting the subtensor runtime (chopsticks) on 127.0.0.1:$PORT"
  bash "$HARNESS/start-subtensor.sh" "$PORT" --restart >&2
  STARTED=1
  export ENGY_SUBTENSOR_URL="ws://127.0.0.1:$PORT"
  if [ -z "${ENGY_SUBTENSOR293_URL:-}" ] && [ -f "$HARNESS293/start-subtensor.sh" ]; then
    say "starting the spec 293 runtime (chopsticks) on 127.0.0.1:$PORT293 (runtime-change test)"
    bash "$HARNESS293/start-subtensor.sh" "$PORT293" --restart >&2
    STARTED293=1
    export ENGY_SUBTENSOR293_URL="ws://127.0.0.1:$PORT293"
  fi
else
  say "no chain harness at $HARNESS (or no node/npm): chain tests will be skipped"
fi

if [ -n "${ENGY_TEST_POSTGRES_URL:-}" ]; then
  say "using the PostgreSQL at ENGY_TEST_POSTGRES_URL"
elif [ "${ENGY_NO_POSTGRES:-0}" = 1 ]; then
  say "ENGY_NO_POSTGRES=1: PostgreSQL tests will be skipped"
elif ls /usr/lib/postgresql/*/bin/pg_ctl >/dev/null 2>&1; then
  PG_DIR="$(mktemp -d)"
  say "starting PostgreSQL on 127.0.0.1:$((PORT + 6)) (tests/postgres.sh, data in $PG_DIR)"
  ENGY_TEST_POSTGRES_URL="$(bash tests/postgres.sh start "$((PORT + 6))" "$PG_DIR/pg")"
  export ENGY_TEST_POSTGRES_URL
else
  say "no PostgreSQL under /usr/lib/postgresql (apt-get install postgresql): its tests will be skipped"
fi

# `--include-ignored` also runs the whole devnet end to end (honest proofs pass, the int4 cheat
# is caught): it drives the real engy-miner binary, which this workspace build produces before
# any test runs (`cargo test -p engy-devnet` alone would not, hence the #[ignore]).
cargo test --workspace --locked "$@" -- --include-ignored

# Opt-in (needs torch): prints "SKIPPED" and succeeds when ENGY_TF5_PYTHON is unset.
python3 tests/reverse/arch_real_shape.py
