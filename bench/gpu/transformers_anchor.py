"""The anchor of the GPU audit benchmark (docs/AUDITOR.md "On a GPU"): transformers' own
teacher-forced forward pass over the same real-shape checkpoint config and the same number of
tokens as `engy-audit audit --device cuda`, on the same GPU.

    python3 bench/gpu/transformers_anchor.py CHECKPOINT_DIR TOKENS [REPEATS]

Any architecture transformers knows from the checkpoint's `config.json` (the benchmark runs it
on the synthetic Qwen3.6 and GLM-5 checkpoints of `synth_checkpoint`). The model is built from
that config (its `text_config` when it has one, without the FP8 quantisation) in bf16 on the
GPU, with transformers' own random initialisation: the time of a
forward pass does not depend on the weights' values, and loading 35B parameters from FP8
would measure the loader, not the pass. Prints one JSON line: tokens, seconds (the median of
the timed passes after one warm-up), tokens/s, whether the last hidden states are all finite,
peak GPU memory in GiB, versions, and `fla`: the version of flash-linear-attention
(`fla-core`) when transformers found it and uses its kernels (Qwen3.5/3.6's Gated DeltaNet and
gated RMSNorm; without it transformers runs its reference torch code), else null.
scripts/gpu-check.sh runs it both ways, installing `fla-core` and `einops` from wheels that
scripts/build-cuda.sh stages.

ENGY_ANCHOR_DEVICE (default `cuda`) runs it elsewhere, e.g. `cpu` to check on a small
checkpoint that transformers builds and runs a config (peak memory is then not measured).
ENGY_ANCHOR_PROFILE=N: after the timed passes, one more pass under torch's profiler, and its N
kernels of most device time to stderr (where transformers' time goes, to compare with
`ENGY_PROFILE=1 engy-audit`); the JSON line is unchanged.
"""
import json
import os
import statistics
import sys
import time

import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM


def main() -> None:
    ckpt, tokens = sys.argv[1], int(sys.argv[2])
    repeats = int(sys.argv[3]) if len(sys.argv) > 3 else 2
    cfg = AutoConfig.from_pretrained(ckpt)
    text = getattr(cfg, "text_config", cfg)
    for attr in ("quantization_config",):
        if hasattr(text, attr):
            delattr(text, attr)
    device = torch.device(os.environ.get("ENGY_ANCHOR_DEVICE", "cuda"))
    cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    torch.manual_seed(0)
    with device:
        model = AutoModelForCausalLM.from_config(text, dtype=torch.bfloat16)
    model.eval()
    params = sum(p.numel() for p in model.parameters())
    ids = torch.randint(0, text.vocab_size, (1, tokens), device=device)
    times = []
    with torch.inference_mode():
        for i in range(repeats + 1):
            sync()
            t0 = time.perf_counter()
            # The decoder only: the auditor compares the last hidden states, not logits.
            out = model.model(input_ids=ids, use_cache=False)
            sync()
            if i > 0:
                times.append(time.perf_counter() - t0)
            elif cuda:
                torch.cuda.reset_peak_memory_stats()
        top = int(os.environ.get("ENGY_ANCHOR_PROFILE", "0") or 0)
        if top > 0:
            profile(lambda: model.model(input_ids=ids, use_cache=False), cuda, top)
    finite = bool(torch.isfinite(out.last_hidden_state).all())
    fla = None
    try:
        from transformers.utils.import_utils import is_flash_linear_attention_available

        if is_flash_linear_attention_available():
            import fla as fla_module

            fla = getattr(fla_module, "__version__", "unknown")
    except ImportError:
        pass
    s = statistics.median(times)
    print(json.dumps({
        "engine": "transformers" + (" + fla-core" if fla else ""),
        "fla": fla,
        "model_type": text.model_type,
        "layers": text.num_hidden_layers,
        "parameters": params,
        "tokens": tokens,
        "seconds": round(s, 3),
        "tokens_per_s": round(tokens / s, 1),
        "finite": finite,
        "peak_gpu_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if cuda else None,
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name(device) if cuda else str(device),
    }))


def profile(run, cuda: bool, top: int) -> None:
    """One pass of `run` under torch's profiler; its `top` kernels by device time to stderr."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with torch_profile(activities=acts) as prof:
        run()
        if cuda:
            torch.cuda.synchronize()
    key = "self_device_time_total" if cuda else "self_cpu_time_total"
    events = prof.key_averages()
    # On a GPU, the kernels' own rows (an operator's row counts its kernels' time again).
    kernels = [e for e in events if not cuda or e.device_type == torch.autograd.DeviceType.CUDA]
    total = sum(getattr(e, key) for e in kernels) / 1e6
    print(f"anchor profile: {total:.3f} s of {'device' if cuda else 'cpu'} time in all", file=sys.stderr)
    print(events.table(sort_by=key, row_limit=top, max_name_column_width=90), file=sys.stderr)


if __name__ == "__main__":
    main()
