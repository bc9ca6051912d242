"""The anchor of the GPU audit benchmark (docs/AUDITOR.md "On a GPU"): transformers' own
teacher-forced forward pass over the same real-shape checkpoint config and the same number of
tokens as `engy-audit audit --device cuda`, on the same GPU.

    python3 bench/gpu/transformers_anchor.py CHECKPOINT_DIR TOKENS

The model is built from the checkpoint's `config.json` (its `text_config`, without the FP8
quantisation) in bf16 on the GPU, with transformers' own random initialisation: the time of a
forward pass does not depend on the weights' values, and loading 35B parameters from FP8
would measure the loader, not the pass. Prints one JSON line: tokens, seconds (the median of
the timed passes after one warm-up), tokens/s, peak GPU memory in GiB, versions.
"""
import json
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
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(text, dtype=torch.bfloat16)
    model.eval()
    params = sum(p.numel() for p in model.parameters())
    ids = torch.randint(0, text.vocab_size, (1, tokens), device="cuda")
    times = []
    with torch.inference_mode():
        for i in range(repeats + 1):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            # The decoder only: the auditor compares the last hidden states, not logits.
            model.model(input_ids=ids, use_cache=False)
            torch.cuda.synchronize()
            if i > 0:
                times.append(time.perf_counter() - t0)
            else:
                torch.cuda.reset_peak_memory_stats()
    s = statistics.median(times)
    print(json.dumps({
        "engine": "transformers",
        "model_type": text.model_type,
        "layers": text.num_hidden_layers,
        "parameters": params,
        "tokens": tokens,
        "seconds": round(s, 3),
        "tokens_per_s": round(tokens / s, 1),
        "peak_gpu_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2),
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name(0),
    }))


if __name__ == "__main__":
    main()
