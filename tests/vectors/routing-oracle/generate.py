"""Regenerates tests/vectors/routing-oracle: the routing traces of transformers serves.

    python generate.py SHARED_VECTORS_DIR OUT_DIR [CASE ...]

Needs torch 2.15 and transformers 5.24 (PyPI, CPU). For each case of the audit oracle
(SHARED_VECTORS_DIR/audit-oracle/CASE, checkpoints in SHARED_VECTORS_DIR/arch/CASE), it loads the
checkpoint into transformers in bf16 (built in that dtype, never cast afterwards: a cast would
also round the RoPE inverse frequencies), greedy-generates the oracle's 12 honest_bf16 prompts
one at a time with a KV cache exactly as the oracle's honest_bf16 serve did, and records the
experts every `mlp.gate` router returned (its third output) for every forward position. The
variants `int4_g32` and `fp8_tensor` first replace the projection weights as the oracle's cheats
do (int4 in groups of 32 with absmax/7; FP8 E4M3 with one absmax/448 scale per tensor or per
expert) and generate their own continuations of the same prompts.
"""
import json
import os
import re
import sys

import torch
import transformers
from safetensors.torch import load_file
from transformers import DynamicCache

SCALE_SUFFIXES = ("_scale_inv", "weight_scale", "_scale_2", "input_scale")


def load_bf16(arch_dir):
    cfg = transformers.AutoConfig.from_pretrained(arch_dir)
    if hasattr(cfg, "quantization_config"):
        delattr(cfg, "quantization_config")
    cfg._attn_implementation = "sdpa"
    cfg._experts_implementation = "grouped_mm"
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    raw = load_file(os.path.join(arch_dir, "model.safetensors"))
    state = {}
    for name, t in raw.items():
        if name.endswith(SCALE_SUFFIXES):
            continue
        if t.dtype == torch.float8_e4m3fn:
            # Block FP8: one scale per 128x128 tile, partial edge tiles included.
            s = raw[name + "_scale_inv"].float()
            o, i = t.shape
            tiles = s.repeat_interleave(128, 0)[:o].repeat_interleave(128, 1)[:, :i]
            state[name] = t.float() * tiles
        else:
            state[name] = t.float()
    experts = {}
    for name in list(state):
        m = re.match(r"(.*\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$", name)
        if m:
            experts.setdefault(m.group(1), {})[(int(m.group(2)), m.group(3))] = state.pop(name)
    for prefix, d in experts.items():
        n = max(e for e, _ in d) + 1
        state[prefix + ".gate_up_proj"] = torch.stack(
            [torch.cat([d[(e, "gate")], d[(e, "up")]], 0) for e in range(n)]
        )
        state[prefix + ".down_proj"] = torch.stack([d[(e, "down")] for e in range(n)])
    model.load_state_dict(state, strict=False)
    model.eval()
    return model, cfg


def cheated(name):
    return name.endswith(("proj.weight", "gate_up_proj", "experts.down_proj")) and "gate." not in name


def int4(model):
    with torch.no_grad():
        for name, p in model.named_parameters():
            if cheated(name):
                g = p.float().reshape(-1, 32)
                s = g.abs().amax(-1, keepdim=True) / 7
                q = torch.where(s > 0, (g / s).round().clamp(-8, 7) * s, g)
                p.copy_(q.reshape(p.shape).to(p.dtype))


def fp8(model):
    with torch.no_grad():
        for name, p in model.named_parameters():
            if cheated(name):
                w = p.float()
                ws = w if w.dim() == 3 else w.unsqueeze(0)
                s = ws.abs().amax(dim=(1, 2), keepdim=True) / 448.0
                q = (ws / s).to(torch.float8_e4m3fn).float() * s
                p.copy_(q.reshape(w.shape).to(p.dtype))


def generate(vectors, out, case):
    oracle = os.path.join(vectors, "audit-oracle", case)
    os.makedirs(os.path.join(out, case), exist_ok=True)
    for variant in ("honest_bf16", "int4_g32", "fp8_tensor"):
        model, cfg = load_bf16(os.path.join(vectors, "arch", case))
        {"int4_g32": int4, "fp8_tensor": fp8}.get(variant, lambda m: None)(model)
        text = cfg.get_text_config()
        layers, top_k = text.num_hidden_layers, text.num_experts_per_tok
        calls = {}
        hooks = []
        for name, module in model.named_modules():
            if name.endswith("mlp.gate"):
                layer = int(name.split("layers.")[1].split(".")[0])
                hooks.append(module.register_forward_hook(
                    lambda mod, inp, o, layer=layer: calls.setdefault(layer, []).extend(
                        o[2].reshape(-1, top_k).tolist())))
        for i in range(12):
            c = json.load(open(os.path.join(oracle, "honest_bf16_%02d.json" % i)))
            prompt, n = c["toploc"]["prompt_ids"], len(c["output_token_ids"])
            calls.clear()
            cache, output = DynamicCache(config=cfg), []
            with torch.no_grad():
                o = model.model(torch.tensor([prompt]), cache=cache, use_cache=True)
                for j in range(n):
                    h = o.last_hidden_state[0, -1]
                    token = int(model.lm_head(h.unsqueeze(0)).argmax(-1))
                    output.append(token)
                    if j < n - 1:
                        o = model.model(torch.tensor([[token]]), cache=cache, use_cache=True)
            rows = len(prompt) + n - 1
            routing = [[[0] * top_k for _ in range(layers)] for _ in range(rows)]
            for layer, ids in calls.items():
                assert len(ids) == rows, (layer, len(ids), rows)
                for pos, cell in enumerate(ids):
                    routing[pos][layer] = cell
            if variant == "honest_bf16" and output != c["output_token_ids"]:
                print("warning: %s %s %d does not reproduce the oracle" % (case, variant, i))
            with open(os.path.join(out, case, "%s_%02d.routing.json" % (variant, i)), "w") as f:
                json.dump({"prompt_ids": prompt, "output_token_ids": output, "layers": layers,
                           "top_k": top_k, "routing": routing}, f, separators=(",", ":"))
        for h in hooks:
            h.remove()
        print(case, variant, "done", flush=True)


if __name__ == "__main__":
    torch.set_num_threads(1)
    vectors, out = sys.argv[1], sys.argv[2]
    for case in sys.argv[3:] or ("qwen3_moe", "qwen3_5_moe", "glm_moe_dsa"):
        generate(vectors, out, case)
