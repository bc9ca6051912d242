#!/usr/bin/env bash
# The GPU checks and benchmark of the auditor in one command, on a machine with an NVIDIA GPU
# (docs/AUDITOR.md "On a GPU"). Run from the repository root:
#
#   scripts/gpu-check.sh BIN_DIR [OUT_DIR]
#
# BIN_DIR: what scripts/build-cuda.sh staged, optionally with `devnet*/` folders (a devnet
# model and the commitments `engy-devnet run --model-dir BIN_DIR/devnet/model
# --save-commitments BIN_DIR/devnet` kept, with the CPU verdicts in verdicts.tsv).
# Steps (each prints a `== ` header and `-> ok|FAIL`; the exit code is 1 when any check
# failed):
#   1. the architecture oracle on the GPU (same tolerances as on the CPU), and engy's own
#      kernels (fused attention, the delta rule's chunk loop) against the unfused rules;
#   2. the audit oracle and tests/vectors/honest-serves on the GPU (honest serves pass, cheats are caught),
#      the W8A8 serves of tests/vectors/audit-oracle-w8a8 (honest ones never flagged, 4-bit
#      swaps never pass), an audit's one-pass cache (the same states, nothing kept), and
#      commitments audited in one pass over streamed weights (`--batch`) get their own reports;
#   3. every devnet commitment audited on the GPU gets its CPU verdict;
#   4. with ENGY_GPU_BENCH=1 (off by default: it writes a 36 GB checkpoint; ENGY_GPU_BENCH_QWEN=0
#      skips this one): the side-by-side benchmark, a
#      teacher-forced audit of ENGY_GPU_BENCH_TOKENS (4096) tokens on a real-shape
#      Qwen3.6-35B-A3B FP8 checkpoint of ENGY_GPU_BENCH_LAYERS (40) layers written here, by
#      engy-audit (streamed, then --resident) and by transformers
#      (bench/gpu/transformers_anchor.py), with time, tokens/s and peak GPU memory, and
#      whether two processes auditing the same commitment wrote identical reports (the
#      benchmark fails when they did not: a GPU audit is bit-reproducible, docs/AUDITOR.md);
#      transformers both as the anchor runs it and with flash-linear-attention (`fla-core`
#      and `einops` wheels from BIN_DIR/wheels, ENGY_GPU_WHEELS); N commitments in one pass
#      over streamed weights (`engy-audit audit --batch N`, N in ENGY_GPU_BENCH_BATCHES,
#      default "1 4 16"; with ENGY_GPU_BENCH_CAP_GIB=G, another process holds all of the GPU's
#      memory but G GiB while they run, bench/gpu/hold_memory.py); each row with its TFLOP/s
#      and share of the GPU's dense bf16 peak (bench/gpu/pass_cost.py);
#   5. with ENGY_GPU_BENCH=1 (ENGY_GPU_BENCH_GLM=0 skips this one): the same on a real-shape GLM-5 FP8
#      checkpoint of ENGY_GPU_BENCH_GLM_LAYERS (5: the release's 3 dense layers, then 2 MoE
#      layers) at ENGY_GPU_BENCH_TOKENS tokens.
# Each benchmark writes its checkpoint under ENGY_GPU_WORK and first deletes the other one
# (Qwen3.6 at 40 layers is 35.7 GB, GLM-5 at 5 layers 24.8 GB; the GPU machine has 64 GB of
# disk); a checkpoint already there with its commitment.json is reused.
# ENGY_GPU_CHECKS=0 (with ENGY_GPU_BENCH=1) runs the benchmarks alone.
# Needs: nvidia-smi and the NVIDIA driver 580 or newer (CUDA 13.0), the CUDA 13 libraries,
# python3 (and transformers + torch for the benchmark's side); checked before anything runs.
# Env: ENGY_CUDA_LIB_DIR (where libcublas.so.13 and friends are; default: found under the
# Python install, e.g. PyTorch's nvidia/cu13/lib), ENGY_GPU_WORK (scratch, default /tmp/engy-gpu).
set -uo pipefail
if ! command -v nvidia-smi >/dev/null || ! nvidia-smi >/dev/null 2>&1; then
  echo "gpu-check.sh: nvidia-smi does not answer: this needs a machine with an NVIDIA GPU and its driver (580 or newer)" >&2
  exit 1
fi
here="$(cd "$(dirname "$0")" && pwd)"
bin="$(cd "${1:?usage: scripts/gpu-check.sh BIN_DIR [OUT_DIR]}" && pwd)"
out="${2:-.}"
mkdir -p "$out"
work="${ENGY_GPU_WORK:-/tmp/engy-gpu}"
mkdir -p "$work"
status=0

libdir="${ENGY_CUDA_LIB_DIR:-}"
if [ -z "$libdir" ]; then
  hit="$(find / -xdev -name 'libcublasLt.so.13*' -not -path '*/proc/*' 2>/dev/null | head -n1)"
  libdir="$(dirname "${hit:-/nonexistent/x}")"
fi
export LD_LIBRARY_PATH="$libdir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
echo "== GPU: $(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader)"
echo "   CUDA libraries: $libdir"

step() { # name command...
  local name="$1"; shift
  echo "== $name"
  local t0=$SECONDS
  if "$@"; then echo "-> ok ($((SECONDS - t0)) s)"; else echo "-> FAIL ($((SECONDS - t0)) s)"; status=1; fi
}

export ENGY_TEST_DEVICE=cuda
if [ "${ENGY_GPU_CHECKS:-1}" != 0 ]; then
step "architecture oracle on cuda" \
  env ENGY_ARCH_VECTORS_DIR="$PWD/tests/vectors/arch" "$bin/arch_vectors" --nocapture --test-threads 1
step "engy's kernels on cuda" \
  env ENGY_ARCH_VECTORS_DIR="$PWD/tests/vectors/arch" "$bin/gpu_kernels" --nocapture --test-threads 1
step "audit oracle and honest serves on cuda" \
  env ENGY_ARCH_VECTORS_DIR="$PWD/tests/vectors/arch" ENGY_AUDIT_ORACLE_DIR="$PWD/tests/vectors/audit-oracle" \
  ENGY_HONEST_SERVES_DIR="$PWD/tests/vectors/honest-serves" \
  "$bin/audit_oracle" --nocapture --test-threads 1

if [ -x "$bin/w8a8" ]; then
  step "W8A8 serves on cuda (honest never flagged, 4-bit swaps never pass)" \
    env ENGY_W8A8_ORACLE_DIR="$PWD/tests/vectors/audit-oracle-w8a8" \
    "$bin/w8a8" --nocapture --test-threads 1
fi

if [ -x "$bin/cache" ]; then
  step "an audit's one-pass cache on cuda (same states, nothing kept)" \
    env ENGY_ARCH_VECTORS_DIR="$PWD/tests/vectors/arch" "$bin/cache" --nocapture --test-threads 1
fi

if [ -x "$bin/batched_pass" ]; then
  step "commitments in one pass over streamed weights on cuda" \
    env ENGY_ARCH_VECTORS_DIR="$PWD/tests/vectors/arch" ENGY_AUDIT_ORACLE_DIR="$PWD/tests/vectors/audit-oracle" \
    "$bin/batched_pass" --nocapture --test-threads 1
fi

devnet_verdicts() { # DIR: a devnet model and its saved commitments
  local d="$1" n=0 same=0 file want got
  while IFS=$'\t' read -r file want; do
    got="$("$bin/engy-audit" audit --checkpoint "$d/model" --commitment "$d/$file" --device cuda 2>/dev/null | head -n1)"
    got="${got#verdict: }"
    n=$((n + 1))
    if [ "$got" = "$want" ]; then same=$((same + 1)); else echo "   $file: cpu $want, cuda $got"; fi
  done <"$d/verdicts.tsv"
  echo "   $(basename "$d"): $same/$n commitments get the CPU verdict on cuda"
  [ "$n" -gt 0 ] && [ "$same" -eq "$n" ]
}
devnet_resident() { # DIR: the same commitments in one run, weights kept on the GPU (--resident)
  local d="$1" args=() file want got n=0 same=0
  while IFS=$'\t' read -r file want; do args+=(--commitment "$d/$file"); done <"$d/verdicts.tsv"
  "$bin/engy-audit" audit --checkpoint "$d/model" --device cuda --resident --json "${args[@]}" \
    2>/dev/null | python3 -c 'import json, sys; [print(json.loads(l)["verdict"]) for l in sys.stdin]' \
    >"$work/resident.verdicts"
  while IFS=$'\t' read -r file want && read -r got <&3; do
    n=$((n + 1))
    if [ "$got" = "$want" ]; then same=$((same + 1)); else echo "   $file: cpu $want, cuda resident $got"; fi
  done <"$d/verdicts.tsv" 3<"$work/resident.verdicts"
  echo "   $(basename "$d"): $same/$n commitments get the CPU verdict in one resident run on cuda"
  [ "$n" -gt 0 ] && [ "$same" -eq "$n" ] && [ "$n" -eq "$(wc -l <"$d/verdicts.tsv")" ]
}
for tsv in "$bin"/devnet*/verdicts.tsv; do
  [ -f "$tsv" ] || continue
  step "devnet commitments on cuda ($(basename "$(dirname "$tsv")"))" devnet_verdicts "$(dirname "$tsv")"
  step "devnet commitments in one resident run on cuda ($(basename "$(dirname "$tsv")"))" \
    devnet_resident "$(dirname "$tsv")"
done
fi

peak_mem() { # command... : runs it while sampling GPU memory; prints the peak (MiB) to $work/peak
  local base
  base="$(nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits | head -n1)"
  nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 100 >"$work/mem.log" &
  local smi=$!
  "$@"
  local rc=$?
  kill "$smi" 2>/dev/null; wait "$smi" 2>/dev/null
  echo "$(( $(sort -n "$work/mem.log" | tail -n1) - base ))" >"$work/peak"
  return $rc
}

bench() { # LABEL ARCH LAYERS: one side-by-side benchmark (synth_checkpoint --arch ARCH)
  local label="$1" arch="$2" layers="$3" tokens="${ENGY_GPU_BENCH_TOKENS:-4096}"
  local ck="$work/$arch-fp8-$layers" old
  # One synthetic checkpoint on disk at a time.
  for old in "$work"/*-fp8-*; do
    if [ -d "$old" ] && [ "$old" != "$ck" ]; then echo "   deleting $old (disk)"; rm -rf "$old"; fi
  done
  if [ ! -f "$ck/commitment.json" ]; then
    echo "   disk before writing: $(df -h --output=avail "$work" | tail -n1 | tr -d ' ') free"
    /usr/bin/time -f "   wrote the checkpoint in %e s" \
      "$bin/synth_checkpoint" --arch "$arch" "$ck" "$layers" "$tokens" || return 1
  fi
  cat "$ck"/*.safetensors >/dev/null # into the page cache: time the audit, not the disk
  local audit=("$bin/engy-audit" audit --checkpoint "$ck" --device cuda --recompute bf16)
  local once=(--commitment "$ck/commitment.json")
  # A first run fills the driver's kernel cache (~/.nv/ComputeCache: candle's kernels ship as
  # PTX and are compiled on first use); the second is the one measured.
  "${audit[@]}" "${once[@]}" >"$work/$arch-engy-first.out" 2>"$work/$arch-engy-first.err"
  sed 's/^/   first run: /' "$work/$arch-engy-first.err"
  # Where the time goes: a run with ENGY_PROFILE=1 (each phase waits for the GPU, so this run
  # is slower than the measured one).
  ENGY_PROFILE=1 "${audit[@]}" "${once[@]}" >/dev/null 2>"$work/$arch-engy-profile.err"
  sed 's/^/   profiled run: /' "$work/$arch-engy-profile.err"
  local t0 t1
  t0=$(date +%s.%N)
  peak_mem "${audit[@]}" "${once[@]}" >"$work/$arch-engy.out" 2>"$work/$arch-engy.err"
  t1=$(date +%s.%N)
  cat "$work/$arch-engy.err"
  local engy_s engy_mem
  engy_s="$(sed -n 's/.*recomputed on cuda:0 in \([0-9.]*\) s.*/\1/p' "$work/$arch-engy.err")"
  engy_mem="$(cat "$work/peak")"
  echo "   engy-audit: $(head -n1 "$work/$arch-engy.out"), process wall $(awk -v a="$t0" -v b="$t1" 'BEGIN{printf "%.2f", b-a}') s"
  # Reproducibility across processes: the first and the measured run audit the same
  # commitment in two processes; their reports (score, every batch's mismatches) should be
  # identical (a weight upload that raced its staging buffer once made them differ).
  local reproducible=1
  if cmp -s "$work/$arch-engy-first.out" "$work/$arch-engy.out"; then
    echo "   reproducible: two processes wrote identical reports"
  else
    reproducible=0
    echo "   NOT reproducible: two processes' reports differ ($(diff "$work/$arch-engy-first.out" "$work/$arch-engy.out" | grep -c '^<') lines; scores: $(grep -h '^score' "$work/$arch-engy-first.out" "$work/$arch-engy.out" | cut -d' ' -f2 | tr '\n' ' '))"
  fi
  # Weights resident: the same commitment audited four times in one process with --resident;
  # the median of audits 2 to 4, on the weights the first kept on the GPU as bf16, is the one
  # measured (the anchor's weights are resident too, and it takes the median of three
  # passes). Then twice with ENGY_PROFILE=1 for the split.
  local twice=("${once[@]}" "${once[@]}")
  peak_mem "${audit[@]}" "${twice[@]}" "${twice[@]}" --resident >/dev/null \
    2>"$work/$arch-engy-resident.err"
  sed 's/^/   resident run: /' "$work/$arch-engy-resident.err"
  local res_s res_mem
  res_s="$(sed -n 's/.*recomputed on cuda:0 in \([0-9.]*\) s.*/\1/p' "$work/$arch-engy-resident.err" \
    | tail -n +2 | sort -n | sed -n 2p)"
  res_mem="$(cat "$work/peak")"
  ENGY_PROFILE=1 "${audit[@]}" "${twice[@]}" --resident >/dev/null 2>"$work/$arch-engy-resident-profile.err"
  sed 's/^/   resident profiled run: /' "$work/$arch-engy-resident-profile.err"
  # The experts' padded batched products instead of the grouped GEMM, for comparison
  # (ENGY_GPU_BENCH_PADDED=0 skips it).
  if [ "${ENGY_GPU_BENCH_PADDED:-1}" != 0 ]; then
    ENGY_PROFILE=1 ENGY_GROUPED_GEMM=0 "${audit[@]}" "${twice[@]}" --resident \
      >/dev/null 2>"$work/$arch-engy-resident-padded.err"
    sed 's/^/   resident profiled run, ENGY_GROUPED_GEMM=0: /' "$work/$arch-engy-resident-padded.err"
  fi
  # Weights streamed, N commitments of the model in one pass over the layers (each layer read
  # and decoded once for all of them): audits per weight pass and seconds per audit.
  # With ENGY_GPU_BENCH_CAP_GIB, a second process holds all of the GPU's memory but that
  # many GiB while these rows run (bench/gpu/hold_memory.py): a card smaller than the model.
  local batch_rows="$work/$arch-batch.tsv" n cap="${ENGY_GPU_BENCH_CAP_GIB:-}" held=""
  local hold_out hold_in hold_pid
  : >"$batch_rows"
  if [ -n "$cap" ]; then
    coproc HOLD { python3 "$here/../bench/gpu/hold_memory.py" "$cap"; }
    hold_out="${HOLD[0]:-}" hold_in="${HOLD[1]:-}" hold_pid="${HOLD_PID:-}"
    if [ -n "$hold_out" ] && read -r held <&"$hold_out" && [ -n "$held" ]; then
      echo "   batch rows with the GPU's memory capped: $held (bench/gpu/hold_memory.py)"
    else
      echo "   ENGY_GPU_BENCH_CAP_GIB=$cap: the memory could not be held (above); this benchmark stops here"
      return 1
    fi
  fi
  for n in ${ENGY_GPU_BENCH_BATCHES-1 4 16}; do
    local many=()
    for _ in $(seq "$n"); do many+=(--commitment "$ck/commitment.json"); done
    t0=$(date +%s.%N)
    peak_mem "${audit[@]}" "${many[@]}" --batch "$n" >/dev/null 2>"$work/$arch-engy-batch$n.err"
    t1=$(date +%s.%N)
    tail -n 2 "$work/$arch-engy-batch$n.err" | sed "s/^/   streamed, $n in one pass: /"
    printf '%s\t%s\t%s\n' "$n" "$(awk -v a="$t0" -v b="$t1" 'BEGIN{printf "%.3f", b-a}')" \
      "$(cat "$work/peak")" >>"$batch_rows"
  done
  if [ -n "$cap" ]; then
    exec {hold_in}>&- # the holder reads its stdin to the end, then frees the memory
    wait "$hold_pid"
  fi
  # transformers as the anchor runs it, then as its users run it with flash-linear-attention
  # (`fla-core`, installed from the staged wheels into its own folder: nothing else changes).
  peak_mem python3 "$here/../bench/gpu/transformers_anchor.py" "$ck" "$tokens" 3 \
    >"$work/$arch-tf.json" 2>"$work/$arch-tf.err"
  local tf_mem; tf_mem="$(cat "$work/peak")"
  tail -n 3 "$work/$arch-tf.err"
  cat "$work/$arch-tf.json"
  local tf_fla_mem="" tf_fla="$work/$arch-tf-fla.json"
  rm -f "$tf_fla"
  if [ -n "$fla_site" ]; then
    peak_mem env PYTHONPATH="$fla_site${PYTHONPATH:+:$PYTHONPATH}" \
      python3 "$here/../bench/gpu/transformers_anchor.py" "$ck" "$tokens" 3 \
      >"$tf_fla" 2>"$work/$arch-tf-fla.err"
    tf_fla_mem="$(cat "$work/peak")"
    tail -n 3 "$work/$arch-tf-fla.err"
    cat "$tf_fla"
  fi
  python3 "$here/../bench/gpu/pass_cost.py" "$ck" "$tokens" >"$work/$arch-cost.json" \
    || echo '{}' >"$work/$arch-cost.json"
  python3 - "$label" "$tokens" "$layers" "$engy_s" "$engy_mem" "$work/$arch-tf.json" "$tf_mem" \
    "$res_s" "$res_mem" "$tf_fla" "$tf_fla_mem" "$work/$arch-cost.json" "$batch_rows" "$cap" <<'PY'
import json, os, sys
(label, tokens, layers, engy_s, engy_mem, tf_path, tf_mem, res_s, res_mem, fla_path, fla_mem,
 cost_path, batch_path, cap) = sys.argv[1:]
tf = json.load(open(tf_path))
cost = json.load(open(cost_path))
num = lambda v: float(v) if v not in ("", None) else float("nan")
rows = [("engy-audit --device cuda (bf16 recompute, weights streamed)", num(engy_s), num(engy_mem)),
        ("engy-audit --device cuda --resident (bf16 recompute, median of audits 2 to 4, weights resident)", num(res_s), num(res_mem)),
        (f"transformers {tf['transformers']} (bf16, torch {tf['torch']}, median of 3 passes, weights resident, fla {tf.get('fla')})", tf["seconds"], num(tf_mem))]
if os.path.exists(fla_path):
    fla = json.load(open(fla_path))
    rows.append((f"transformers {fla['transformers']} + fla-core {fla.get('fla')} (same)", fla["seconds"], num(fla_mem)))
flops, peak = cost.get("flops"), cost.get("peak_tflops")
print(f"   {label}, {layers} layers, {tokens} tokens, {tf['gpu']}")
if flops:
    print(f"   a pass: {flops / 1e12:.1f} TFLOP, {cost['weight_bytes'] / 1e9:.1f} GB of bf16 weights; "
          f"floor {cost.get('floor_s', float('nan')):.3f} s at {peak} TFLOP/s and {cost.get('bandwidth_tbs')} TB/s "
          "(bench/gpu/pass_cost.py)")
print("   | engine | wall (s) | tokens/s | TFLOP/s | share of dense bf16 peak | peak GPU memory (GiB) |")
print("   |---|---|---|---|---|---|")
for name, s, mem in rows:
    tfs = flops / s / 1e12 if flops and s == s and s > 0 else float("nan")
    share = f"{tfs / peak:.1%}" if peak and tfs == tfs else "?"
    print(f"   | {name} | {s:.3f} | {int(tokens)/s:.0f} | {tfs:.1f} | {share} | {mem/1024:.1f} |")
batch = [l.split("\t") for l in open(batch_path).read().splitlines() if l.strip()]
if batch:
    one = None
    if cap:
        print(f"   the GPU's memory capped at {cap} GiB for these rows (bench/gpu/hold_memory.py)")
    print("   | streamed, commitments in one pass | process wall (s) | seconds per audit | audits per hour | vs 1 | peak GPU memory (GiB) |")
    print("   |---|---|---|---|---|---|")
    for n, wall, mem in batch:
        n, wall = int(n), float(wall)
        per = wall / n
        one = one or per
        print(f"   | {n} | {wall:.2f} | {per:.2f} | {3600 / per:.0f} | {one / per:.1f}x | {num(mem)/1024:.1f} |")
if not tf.get("finite", True):
    print("   note: transformers' last hidden states were not all finite")
if engy_s in ("", None):
    sys.exit(1)
PY
  local table=$?
  [ "$table" -eq 0 ] && [ "$reproducible" -eq 1 ]
}
# flash-linear-attention for transformers' second row: `fla-core` and `einops` wheels staged by
# scripts/build-cuda.sh in BIN_DIR/wheels (ENGY_GPU_WHEELS overrides), installed into a folder
# of their own that only that row's PYTHONPATH names.
fla_site=""
wheels="${ENGY_GPU_WHEELS:-$bin/wheels}"
if [ "${ENGY_GPU_BENCH:-0}" != 0 ] && compgen -G "$wheels/fla_core-*.whl" >/dev/null; then
  fla_site="$work/fla-site"
  if python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$fla_site" \
    "$wheels"/*.whl; then
    echo "== fla-core for transformers' second row: $(ls "$wheels" | tr '\n' ' ')"
  else
    echo "== fla-core wheels in $wheels did not install: transformers runs one way only"
    fla_site=""
  fi
fi
if [ "${ENGY_GPU_BENCH:-0}" = 0 ]; then
  echo "== benchmarks skipped (ENGY_GPU_BENCH=1 runs them: 25-36 GB of checkpoints under $work)"
else
  if [ "${ENGY_GPU_BENCH_QWEN:-1}" != 0 ]; then
    step "benchmark: engy-audit vs transformers" \
      bench "real-shape Qwen3.6-35B-A3B FP8" qwen3_5_moe "${ENGY_GPU_BENCH_LAYERS:-40}"
  fi
  if [ "${ENGY_GPU_BENCH_GLM:-1}" != 0 ]; then
    step "benchmark: GLM-5.x few layers" \
      bench "real-shape GLM-5 FP8" glm_moe_dsa "${ENGY_GPU_BENCH_GLM_LAYERS:-5}"
  fi
fi
exit $status
