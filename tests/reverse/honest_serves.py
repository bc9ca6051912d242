"""Honest transformers serves of the arch oracle's checkpoints, captured as decode rows.

transformers 5.24 (CPU, torch 2.15) greedy-generates from random prompts on one checkpoint of
tests/vectors/arch with the attention and experts implementation asked for, one prompt at a
time or all in one left-padded batch, and a forward hook on the final norm
(`model.model.norm`) keeps the last row of every generation step: row j is the hidden state
that sampled output id j (docs/PROTOCOL.md §3.10). Block-FP8 and NVFP4 checkpoints are served
from their exact dequantisation (arch_bf16_floor.py's `dequantised_copy`), not through
transformers' quantised loaders. The rows become commitments with engy's TOPLOC code
(crates/engy-model/examples/commit_rows.rs); tests/vectors/honest-serves holds such commitments
and its README says how they were made and what the auditor says of them.

  ENGY_TF5_PYTHON=/path/venv/bin/python   # torch + transformers>=5.24 + safetensors
  $ENGY_TF5_PYTHON tests/reverse/honest_serves.py CASE_DIR OUT.safetensors \
      [--n 24] [--seed 2001] [--attn sdpa|eager] [--experts grouped_mm|eager] [--batched] \
      [--dtype bf16|f32] [--cheat int4_g32|fp8_tensor] [--teacher-forced]
  target/release/examples/commit_rows OUT.safetensors MODEL_ROOT DIR PREFIX

OUT holds prompt_k, output_k (I64) and rows_k (F32 [N, hidden]) for k = 0..n-1. Prompts have
16 to 40 random ids, outputs 64 to 160 new tokens (EOS off), both drawn from --seed. Exit 0,
or 2 on a usage error.
"""
import argparse, os, sys, tempfile

import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from arch_bf16_floor import dequantised_copy  # noqa: E402  (block FP8 and NVFP4, exactly, in f32)
from serves_common import Serve, draw_requests  # noqa: E402


def cheat(model, how):
    """Swaps weights as the audit oracle's cheats do: every `*_proj` weight and fused expert
    tensor through int4 (groups of 32 along the input, scale absmax/7) or FP8 E4M3 with one
    scale per tensor (per expert for a fused stack, scale absmax/448)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not (name.endswith("_proj.weight") or name.endswith(("experts.gate_up_proj", "experts.down_proj"))):
                continue
            w = p.data.to(torch.float32)
            if how == "int4_g32":
                n = w.shape[-1]
                padded = torch.nn.functional.pad(w, (0, -n % 32))  # a last group of zeros
                g = padded.reshape(*w.shape[:-1], -1, 32)
                s = g.abs().amax(-1, keepdim=True).clamp_min(1e-12) / 7
                w = ((g / s).round().clamp(-7, 7) * s).reshape(padded.shape)[..., :n]
            else:
                dims = tuple(range(1, w.dim())) if w.dim() == 3 else None
                a = w.abs().amax(dim=dims, keepdim=True) if dims else w.abs().max()
                s = a.clamp_min(1e-12) / 448
                w = (w / s).to(torch.float8_e4m3fn).to(torch.float32) * s
            p.data.copy_(w.to(p.dtype))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("case")
    ap.add_argument("out")
    ap.add_argument("--n", type=int, default=24)
    ap.add_argument("--seed", type=int, default=2001)
    ap.add_argument("--attn", default="sdpa", choices=["sdpa", "eager"])
    ap.add_argument("--experts", default="grouped_mm", choices=["grouped_mm", "eager"])
    ap.add_argument("--batched", action="store_true")
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "f32"])
    ap.add_argument("--teacher-forced", action="store_true",
                    help="rows from one forward pass over the generated sequence (the *_tf variants)")
    ap.add_argument("--cheat", choices=["int4_g32", "fp8_tensor"],
                    help="serve swapped weights instead (a correct auditor catches these)")
    a = ap.parse_args()
    if not os.path.exists(os.path.join(a.case, "config.json")):
        print(f"{a.case}: no config.json", file=sys.stderr)
        sys.exit(2)
    torch.manual_seed(0)
    torch.set_num_threads(1)
    dtype = torch.bfloat16 if a.dtype == "bf16" else torch.float32
    with tempfile.TemporaryDirectory() as tmp:
        # A quantised checkpoint is served from its exact f32 dequantisation, which loading
        # in bf16 rounds to nearest even.
        model = AutoModelForCausalLM.from_pretrained(
            dequantised_copy(a.case, os.path.join(tmp, "served")), dtype=dtype,
            attn_implementation=a.attn, experts_implementation=a.experts)
    model.eval()
    if a.cheat:
        cheat(model, a.cheat)
    prompts, news = draw_requests(model.config.vocab_size, a.n, a.seed)
    sv = Serve(model, prompts, news)
    if a.batched:
        sv.generate(list(range(a.n)))
    else:
        for i in range(a.n):
            sv.generate([i])
    if a.teacher_forced:
        sv.teacher_forced()
    save_file(sv.out, a.out)
    print(f"wrote {a.out}: {a.n} {a.dtype} {a.cheat or 'honest'} serves ({a.attn} attention, {a.experts} experts, "
          f"{'batched' if a.batched else 'one at a time'}{', teacher-forced rows' if a.teacher_forced else ''})")


if __name__ == "__main__":
    main()
