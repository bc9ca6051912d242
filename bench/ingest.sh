#!/usr/bin/env bash
# CPU time and peak RSS of the miner's ingest + proof path on one recorded-shape reply,
# through the stable entry point (crates/engy-miner/examples/ingest_bench.rs).
#
#   bench/ingest.sh [RUNS]           # default 5 runs of each shape; prints JSON lines
set -euo pipefail
cd "$(dirname "$0")/.."
RUNS="${1:-5}"
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-target}"
cargo build -q --release -p engy-miner --example ingest_bench
B="$CARGO_TARGET_DIR/release/examples/ingest_bench"
for shape in "1024 2048" "4096 2048" "1024 6144" "4096 6144"; do
  set -- $shape
  for _ in $(seq "$RUNS"); do
    "$B" --tokens "$1" --hidden "$2"
    "$B" --tokens "$1" --hidden "$2" --stream
  done
done
