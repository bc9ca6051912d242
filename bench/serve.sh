#!/usr/bin/env bash
# Whole-process CPU time and peak RSS of the real engy-miner serving recorded-shape
# sglang replies (the sglang double, engy's trimmed serve shape), measured with
# /usr/bin/time -v. See bench/README.md.
#
#   bench/serve.sh [RUNS]            # default 3 runs of each case
#
# Cases: idle (no request), 1 request × 4096 tokens at hidden 2048 (non-stream and
# stream), 1 × 4096 at hidden 6144. Prints one JSON line per run; the medians go to
# bench/RESULTS.md.
set -euo pipefail
cd "$(dirname "$0")/.."
RUNS="${1:-3}"
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-target}"
cargo bench -p engy-miner --bench serve --no-run >/dev/null 2>&1 || cargo bench -p engy-miner --bench serve --no-run
run() { cargo bench -q -p engy-miner --bench serve -- "$@" 2>/dev/null | grep '^{'; }
for _ in $(seq "$RUNS"); do
  run --tokens 4096 --hidden 2048 --requests 0
  run --tokens 4096 --hidden 2048 --requests 1
  run --tokens 4096 --hidden 2048 --requests 1 --stream
  run --tokens 4096 --hidden 6144 --requests 1
done
