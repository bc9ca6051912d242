#!/usr/bin/env bash
# Builds the GPU auditor and its GPU checks with the `cuda` feature on a machine with no CUDA
# install (the toolkit comes from PyPI: scripts/cuda-toolkit.sh), and stages them in DIR
# (default target/gpu) for scripts/gpu-check.sh on the GPU machine:
#   DIR/engy-audit        the auditor (`--device cuda`)
#   DIR/arch_vectors      the architecture oracle test (ENGY_TEST_DEVICE=cuda)
#   DIR/audit_oracle      the audit oracle test (ENGY_TEST_DEVICE=cuda)
#   DIR/gpu_kernels       engy's own kernels against the unfused rules (ENGY_TEST_DEVICE=cuda)
#   DIR/synth_checkpoint  writes the real-shape Qwen3.6 FP8 checkpoint for the benchmark
# docs/AUDITOR.md "On a GPU" says how to run them. DIR is relative to the directory the script
# is called from. Binaries are stripped (they carry the kernels' PTX); at run time they need
# the NVIDIA driver (libcuda.so.1: without it they do not start, not even for --help) and the
# CUDA 13 libraries libcublas.so.13, libcublasLt.so.13 and libcurand.so.10.
set -euo pipefail
out="$(realpath -m -- "${1:-$(dirname "$0")/../target/gpu}")"
cd "$(dirname "$0")/.."
eval "$(scripts/cuda-toolkit.sh)"
mkdir -p "$out"
cargo build --release --locked -p engy-audit --features cuda
cargo build --release --locked -p engy-model --example synth_checkpoint
# The test build's output goes to stderr as it comes (`tee` into a file, never /dev/stderr:
# that reopens a redirected log at offset 0 and writes over it) and is read for the paths.
built="$(mktemp)"
trap 'rm -f "$built"' EXIT
cargo test --release --locked -p engy-model --features cuda \
  --test arch_vectors --test audit_oracle --test gpu_kernels --no-run 2>&1 | tee "$built" >&2
tests="$(sed -n 's/.*Executable tests\/\([a-z_]*\)\.rs (\(.*\))/\1 \2/p' "$built")"
target="$(realpath -m -- "${CARGO_TARGET_DIR:-target}")"
install -m 755 "$target/release/engy-audit" "$out/engy-audit"
install -m 755 "$target/release/examples/synth_checkpoint" "$out/synth_checkpoint"
while read -r name path; do
  [ -n "$name" ] && install -m 755 "$path" "$out/$name"
done <<<"$tests"
strip "$out"/* 2>/dev/null || true
ls -la "$out" >&2
