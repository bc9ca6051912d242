#!/usr/bin/env bash
# Honest W8A8 serves at the release's layer widths, on a GPU (bench/RESULTS.md "W8A8 serves on
# a GPU, and the serving-noise rule"; docs/PROTOCOL.md §5.1). Run from the repository root on
# the GPU machine:
#
#   bench/gpu/w8a8_depth.sh BIN_DIR COMMIT_ROWS [LAYERS (8)] [PROMPTS (6)]
#
# BIN_DIR: what scripts/build-cuda.sh staged (its engy-audit); COMMIT_ROWS: a host build of
# `cargo build -p engy-model --example commit_rows` (no GPU code). It makes a block-FP8
# Qwen3.6-shaped checkpoint with `tests/reverse/w8a8_serves.py make` (hidden 2048, Gated
# DeltaNet 16/32 heads of 128, gated attention 16/2 heads of 256 every 4th layer, 32 experts of
# 512 top-8 and a shared expert of 512, vocabulary 256: the release's per-layer widths with
# fewer experts), serves it bf16, W8A8 (FP8 tensor-core products) and with cheats, turns the
# rows into commitments and audits each with `engy-audit audit --device cuda --json`; one line
# per commitment: variant, verdict, and per recompute (dtype, attention, activations, largest
# batch, mean a batch). ENGY_DEPTH_VARIANTS narrows the serves (a comma list of
# w8a8_serves.py variants); the reports stay in $ENGY_GPU_WORK/w8a8-depth/reports.jsonl.
set -uo pipefail
export PYTHONUNBUFFERED=1
bin="$(cd "${1:?usage: bench/gpu/w8a8_depth.sh BIN_DIR COMMIT_ROWS [LAYERS] [PROMPTS]}" && pwd)"
commit_rows="${2:?usage: bench/gpu/w8a8_depth.sh BIN_DIR COMMIT_ROWS [LAYERS] [PROMPTS]}"
layers="${3:-8}"
prompts="${4:-6}"
hit="$(find / -xdev -name 'libcublasLt.so.13*' -not -path '*/proc/*' 2>/dev/null | head -n1)"
export LD_LIBRARY_PATH="$(dirname "${hit:-/nonexistent/x}")${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
w="${ENGY_GPU_WORK:-/tmp/engy-gpu}/w8a8-depth"
rm -rf "$w"; mkdir -p "$w/commit"
types=$(python3 -c "import sys; n=int(sys.argv[1]); print(','.join('\"full_attention\"' if (i+1)%4==0 else '\"linear_attention\"' for i in range(n)))" "$layers")
overrides='{"hidden_size":2048,"num_hidden_layers":'"$layers"',"layer_types":['"$types"'],"head_dim":256,"num_attention_heads":16,"num_key_value_heads":2,"linear_key_head_dim":128,"linear_value_head_dim":128,"linear_num_key_heads":16,"linear_num_value_heads":32,"moe_intermediate_size":512,"shared_expert_intermediate_size":512,"num_experts":32,"num_experts_per_tok":8,"rope_parameters":{"mrope_interleaved":true,"mrope_section":[11,11,10],"partial_rotary_factor":0.25,"rope_theta":10000000.0,"rope_type":"default"}}'
t0=$SECONDS
python3 tests/reverse/w8a8_serves.py make tests/vectors/arch/qwen3_5_moe_fp8 "$w/ck" 4101 "$overrides" || exit 1
echo "w8a8_depth: checkpoint made in $((SECONDS - t0)) s"; t0=$SECONDS
variants="${ENGY_DEPTH_VARIANTS:-honest_bf16_batched,honest_w8a8_batched,honest_w8a8,experts_int4_g32_w8a8,experts_fp8_tensor_w8a8,int4_g32}"
python3 tests/reverse/w8a8_serves.py serve "$w/ck" "$w/rows" --variant "$variants" --n "$prompts" || exit 1
echo "w8a8_depth: served in $((SECONDS - t0)) s"; t0=$SECONDS
root=$(cd tests/reverse && python3 -c "import sys; from serves_common import model_root; print(model_root(sys.argv[1]))" "$w/ck")
for f in "$w"/rows/*.safetensors; do
  "$commit_rows" "$f" "$root" "$w/commit" "$(basename "$f" .safetensors)" || exit 1
done
# One process, weights resident: every commitment's recomputes reuse the decoded layers.
args=(); for j in "$w"/commit/*.json; do args+=(--commitment "$j"); done
"$bin/engy-audit" audit --checkpoint "$w/ck" "${args[@]}" --device cuda --resident --json 2>/dev/null |
  tee "$w/reports.jsonl" |
  python3 -c 'import json, os, sys
for line in sys.stdin:
    d = json.loads(line)
    name = os.path.basename(d["commitment"])[: -len(".json")]
    if "verdict" not in d:
        print(name, "error", d.get("error")); continue
    print(name, d["verdict"], [(r["compute"], r["attention"], r["fp8_activations"], r["max_exp_mismatches"], round(r["score"] * 128)) for r in d["recomputes"]], flush=True)'
echo "w8a8_depth: audited in $((SECONDS - t0)) s"
