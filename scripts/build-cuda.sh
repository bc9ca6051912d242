#!/usr/bin/env bash
# Builds the GPU auditor and its GPU checks with the `cuda` feature on a machine with no CUDA
# install (the toolkit comes from PyPI: scripts/cuda-toolkit.sh), and stages them in DIR
# (default target/gpu) for scripts/gpu-check.sh on the GPU machine:
#   DIR/engy-audit        the auditor (`--device cuda`)
#   DIR/arch_vectors      the architecture oracle test (ENGY_TEST_DEVICE=cuda)
#   DIR/audit_oracle      the audit oracle test (ENGY_TEST_DEVICE=cuda)
#   DIR/gpu_kernels       engy's own kernels against the unfused rules (ENGY_TEST_DEVICE=cuda)
#   DIR/batched_pass      commitments in one pass over streamed weights get their own reports
#   DIR/w8a8              the W8A8 serves' oracle test (ENGY_TEST_DEVICE=cuda)
#   DIR/cache             a one-pass cache keeps nothing and gives the same states (ENGY_TEST_DEVICE=cuda)
#   DIR/synth_checkpoint  writes the real-shape Qwen3.6 FP8 checkpoint for the benchmark
#   DIR/wheels/           fla-core and einops, for transformers' second benchmark row
# docs/AUDITOR.md "On a GPU" says how to run them. DIR is relative to the directory the script
# is called from.
#
# Prerequisites, checked first:
#   here (the build machine): cc and nm (binutils), python3 with pip and access to PyPI (the
#   CUDA 13.0 compiler wheels, scripts/cuda-toolkit.sh); no GPU or driver needed. For a GPU
#   other than Hopper (H100/H200) set CUDA_COMPUTE_CAP (e.g. 89 for an L40S/RTX 4090, 80 for
#   an A100) before running this.
#   there (the GPU machine): the NVIDIA driver 580 or newer (CUDA 13.0) and the CUDA 13
#   libraries libcublas.so.13, libcublasLt.so.13 and libcurand.so.10 (e.g. PyTorch's).
# The staged binaries need the driver (libcuda.so.1): without it they do not start, not even
# for --help. So the CUDA build goes to its own cargo target folder,
# ${CARGO_TARGET_DIR:-target}/cuda (ENGY_CUDA_TARGET_DIR overrides it), and never replaces the
# CPU target/release/engy-audit. Binaries are stripped (they carry the kernels' PTX).
set -euo pipefail
missing=()
for tool in cc nm strip python3; do command -v "$tool" >/dev/null || missing+=("$tool"); done
if [ "${#missing[@]}" -gt 0 ]; then
  echo "build-cuda.sh: missing ${missing[*]}: install a C compiler and binutils (Debian: apt-get install build-essential) and python3 with pip" >&2
  exit 1
fi
python3 -m pip --version >/dev/null 2>&1 || { echo "build-cuda.sh: python3 has no pip (Debian: apt-get install python3-pip python3-venv)" >&2; exit 1; }
out="$(realpath -m -- "${1:-$(dirname "$0")/../target/gpu}")"
cd "$(dirname "$0")/.."
eval "$(scripts/cuda-toolkit.sh)"
echo "build-cuda.sh: CUDA_COMPUTE_CAP=$CUDA_COMPUTE_CAP (90 = Hopper; set it for another GPU)" >&2
mkdir -p "$out"
target="$(realpath -m -- "${ENGY_CUDA_TARGET_DIR:-${CARGO_TARGET_DIR:-target}/cuda}")"
export CARGO_TARGET_DIR="$target"
cargo build --release --locked -p engy-audit --features cuda
cargo build --release --locked -p engy-model --example synth_checkpoint
# The test build's output goes to stderr as it comes (`tee` into a file, never /dev/stderr:
# that reopens a redirected log at offset 0 and writes over it) and is read for the paths.
built="$(mktemp)"
trap 'rm -f "$built"' EXIT
cargo test --release --locked -p engy-model --features cuda \
  --test arch_vectors --test audit_oracle --test gpu_kernels --test batched_pass --test w8a8 --test cache --no-run 2>&1 | tee "$built" >&2
tests="$(sed -n 's/.*Executable tests\/\([a-z0-9_]*\)\.rs (\(.*\))/\1 \2/p' "$built")"
install -m 755 "$target/release/engy-audit" "$out/engy-audit"
install -m 755 "$target/release/examples/synth_checkpoint" "$out/synth_checkpoint"
while read -r name path; do
  [ -n "$name" ] && install -m 755 "$path" "$out/$name"
done <<<"$tests"
strip "$out"/* 2>/dev/null || true
# The benchmark's second transformers row (scripts/gpu-check.sh) runs it with
# flash-linear-attention, as its users do: pure-Python wheels, staged for a GPU machine that
# cannot reach PyPI.
mkdir -p "$out/wheels"
python3 -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
  -d "$out/wheels" fla-core==0.6.0 einops==0.8.2 \
  || echo "build-cuda.sh: could not fetch fla-core/einops: the benchmark's fla row is skipped" >&2
ls -la "$out" >&2
