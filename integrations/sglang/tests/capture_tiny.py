#!/usr/bin/env python3
"""Cross-language hook test, Python half (crates/engy-core/tests/cells_hooks.rs runs it).

For each architecture (transformers 5.24's Qwen3-MoE and Qwen3.5-MoE, tiny random weights,
built in bf16 with ``from_config(..., dtype=torch.bfloat16)`` on CPU; GLM-5's
``glm_moe_dsa`` loaded in bf16 from ``--checkpoint``, by default the arch oracle's
``tests/vectors/arch/glm_moe_dsa``) it writes to ``OUT/<arch>/``:

* ``checkpoint/``: the model (``save_pretrained``, or the loaded checkpoint copied), for the numeric check of the cells
  (router logits = W_r·x, y = Σ gate·expert(x) + shared) that the verifier adds;
* ``spool/req-000001/{cells.bin,manifest.json}``: what engy_cells' hooks (applied with
  ``engy_cells.hooks.attach``, the same specs sglang's ``--forward-hooks`` gets) captured in
  one forward pass over a short sequence;
* ``reference.safetensors``: what plain, independent forward hooks saw at every MoE
  block: ``layers.{l}.x``, ``.y`` (the block's input and returned output), ``.router_logits``
  and ``.expert_ids`` (the router's outputs), ``input_ids``;
* ``case.json``: arch, the MoE layers, sequence length, the router logits' dtype.

Two cases, ``sglang_shaped`` and ``sglang_deepseek_shaped`` (tests/sglang_shaped.py), have
sglang's module names and call signatures (Qwen's block; the DeepSeek-style block GLM-5 is
served with, its shared expert fused into the top-k) and get the hooks from the
``--forward-hooks`` specs by sglang's registration rule; their checked request is a chunked
prefill of two passes, and (Qwen) a pass that skips positions must leave an ``error`` in
another spool's manifest.

It checks in Python too: the hooks leave the model's logits unchanged, each cell's y and x are
the bytes the block saw and returned, the manifest's root is the root of the cells.

    PYTHONPATH=integrations/sglang/src $ENGY_CELLS_PYTHON capture_tiny.py --out DIR [--arch A]
Exit status: 0 ok, 1 a check failed.
"""
import argparse
import hashlib
import json
import math
import os
import shutil
import sys

import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from engy_cells import format as fmt  # noqa: E402
from engy_cells import hooks  # noqa: E402

SEQ = 7


def qwen3_moe():
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    cfg = Qwen3MoeConfig(vocab_size=96, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                         num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[0],
                         decoder_sparse_step=1, max_position_embeddings=64, tie_word_embeddings=False)
    return Qwen3MoeForCausalLM, cfg


def qwen3_5_moe():
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig
    cfg = Qwen3_5MoeTextConfig(
        vocab_size=96, hidden_size=64, num_hidden_layers=2, layer_types=["linear_attention", "full_attention"],
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, linear_conv_kernel_dim=4,
        linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
        moe_intermediate_size=24, shared_expert_intermediate_size=24, num_experts=8, num_experts_per_tok=3,
        max_position_embeddings=64, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                         "mrope_interleaved": True, "mrope_section": [2, 1, 1]})
    return Qwen3_5MoeForCausalLM, cfg


ARCHS = {"qwen3_moe": qwen3_moe, "qwen3_5_moe": qwen3_5_moe}
# Loaded from a checkpoint (``--checkpoint``, default the arch oracle's tiny GLM-5 case): the
# DeepSeek-style MoE (sigmoid router with e_score_correction_bias and group limits,
# routed_scaling_factor, a shared expert; f32 router weight and logits, as transformers keeps them).
FROM_CHECKPOINT = {"glm_moe_dsa": os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..",
                                               "tests", "vectors", "arch", "glm_moe_dsa")}


def randomise(model, seed):
    """Random weights of realistic scale (transformers' init leaves the routers at zero)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
            elif name.endswith("embed_tokens.weight"):
                p.copy_(torch.randn(p.shape, generator=g))
            elif p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=g) * (1.0 / math.sqrt(p.shape[-1])))


def is_moe_block(m):
    return hasattr(m, "experts") and hasattr(m, "gate")


def run(arch, out, seed, checkpoint=None):
    d = os.path.join(out, arch)
    os.makedirs(d, exist_ok=True)
    torch.manual_seed(seed)
    if arch in FROM_CHECKPOINT:
        src = checkpoint or FROM_CHECKPOINT[arch]
        # bf16 as the serve runs; transformers keeps the router (gate.weight,
        # e_score_correction_bias) in f32 (_keep_in_fp32_modules_strict).
        model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16)
        shutil.copytree(src, os.path.join(d, "checkpoint"), dirs_exist_ok=True)
        cfg = model.config
    else:
        cls, cfg = ARCHS[arch]()
        # Built in bf16 (never .to(bfloat16), which would also cast RoPE's fp32 inv_freq buffer).
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
        if type(model) is not cls:
            raise SystemExit(f"{arch}: AutoModelForCausalLM built {type(model).__name__}, not {cls.__name__}")
        randomise(model, seed)
        model.save_pretrained(os.path.join(d, "checkpoint"))
    model.eval()
    ids = torch.randint(0, cfg.vocab_size, (1, SEQ), generator=torch.Generator().manual_seed(seed + 7))

    with torch.no_grad():
        plain = model(ids).logits

    # Independent reference hooks.
    ref, handles, moe_layers = {}, [], []
    for name, m in model.named_modules():
        if name.endswith(".mlp") and is_moe_block(m):
            layer = int(name.split(".")[-2])
            moe_layers.append(layer)

            def block(mod, inp, outp, layer=layer):
                ref[f"layers.{layer}.x"] = inp[0].detach().reshape(-1, inp[0].shape[-1]).clone()
                ref[f"layers.{layer}.y"] = outp.detach().reshape(-1, outp.shape[-1]).clone()

            def router(mod, inp, outp, layer=layer):
                ref[f"layers.{layer}.router_logits"] = outp[0].detach().clone()
                ref[f"layers.{layer}.expert_ids"] = outp[2].detach().to(torch.int64).clone()

            handles += [m.register_forward_hook(block), m.gate.register_forward_hook(router)]
    spool = os.path.join(d, "spool")
    handles += hooks.attach(model, spool)
    with torch.no_grad():
        hooked = model(ids).logits
    for h in handles:
        h.remove()
    ref["input_ids"] = ids.reshape(-1).clone()
    if not torch.equal(plain, hooked):
        return report(arch, ["the hooks changed the model's output"])
    n_experts = getattr(cfg, "n_routed_experts", None) or cfg.num_experts
    return finish(arch, d, ref, moe_layers, cfg.hidden_size, n_experts, cfg.num_experts_per_tok,
                  ids.reshape(-1), passes=1)


def finish(arch, d, ref, moe_layers, hidden, n_experts, top_k, ids, passes):
    """Saves the reference tensors and case.json, then checks the spool's latest request."""
    save_file({k: v.contiguous() for k, v in ref.items()}, os.path.join(d, "reference.safetensors"))
    router = ref[f"layers.{min(moe_layers)}.router_logits"].dtype
    json.dump(dict(arch=arch, moe_layers=sorted(moe_layers), n_positions=len(ids), hidden=hidden,
                   n_experts=n_experts, top_k=top_k, router_dtype="f32" if router == torch.float32 else "bf16",
                   checkpoint=os.path.isfile(os.path.join(d, "checkpoint", "config.json"))),
              open(os.path.join(d, "case.json"), "w"), indent=1)
    spool = os.path.join(d, "spool")
    fails = []
    req = os.path.join(spool, open(os.path.join(spool, "latest")).read().strip())
    man = json.load(open(os.path.join(req, "manifest.json")))
    if man["error"]:
        fails.append(f"manifest error {man['error']}")
    if man["passes"] != passes:
        fails.append(f"{man['passes']} passes, want {passes}")
    want_tokens = hashlib.sha256(ids.to(torch.int32).contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()
    if man["tokens_sha256"] != want_tokens:
        fails.append(f"tokens_sha256 {man['tokens_sha256']}, want {want_tokens}")
    cells = fmt.decode_all(open(os.path.join(req, "cells.bin"), "rb").read())
    if len(cells) != len(ids) * len(moe_layers):
        fails.append(f"{len(cells)} cells, want {len(ids) * len(moe_layers)}")
    raw = lambda t: t.contiguous().view(torch.uint8).numpy().tobytes()  # noqa: E731
    for c in cells:
        p, l = c["position"], c["layer"]
        if c["y"] != raw(ref[f"layers.{l}.y"][p]):
            fails.append(f"cell ({p}, {l}): y differs from the block's output")
        if c["x"] != raw(ref[f"layers.{l}.x"][p]):
            fails.append(f"cell ({p}, {l}): x differs from the block's input")
        if c["logits"] != raw(ref[f"layers.{l}.router_logits"][p]):
            fails.append(f"cell ({p}, {l}): router logits differ")
        if c["expert_ids"] != sorted(ref[f"layers.{l}.expert_ids"][p].tolist()):
            fails.append(f"cell ({p}, {l}): expert ids differ")
    leaves = [fmt.cell_leaf(fmt.encode_cell(c["position"], c["layer"], c["x"], c["logits"], c["logits_dtype"],
                                            c["expert_ids"], c["y"])) for c in cells]
    if fmt.cells_root(dict(man["shape"], tokens_sha256=man["tokens_sha256"]), leaves).hex() != man["cells_root"]:
        fails.append("manifest cells_root is not the root of cells.bin")
    print(f"{arch}: {len(cells)} cells, layers {sorted(moe_layers)}, root {man['cells_root'][:16]}…")
    return report(arch, fails)


def report(arch, fails):
    print(f"{arch}: {'ok' if not fails else 'FAILED'}")
    for f in fails:
        print(f"  {f}")
    return not fails


def run_sglang_shaped(out, seed, style="qwen"):
    """sglang's module names and signatures (tests/sglang_shaped.py; `style` "qwen" or
    "deepseek", the DeepSeek-style block GLM-5 is served with, its shared expert fused into
    the top-k), hooks registered from the --forward-hooks specs: one 3-token request, then
    the checked 7-token request as a chunked prefill (positions 0-3, then 4-6); then (qwen),
    on another spool, a pass that skips positions must leave an error in the manifest."""
    from sglang_shaped import CausalLMLike, register_like_sglang
    arch = SHAPED[style]
    model = CausalLMLike(seed, style=style).eval()
    cfg = model.config
    d = os.path.join(out, arch)
    os.makedirs(d, exist_ok=True)
    g = torch.Generator().manual_seed(seed + 11)
    warm = torch.randint(0, cfg["vocab"], (3,), generator=g)
    ids = torch.randint(0, cfg["vocab"], (SEQ,), generator=g)
    chunks = [(ids[:4], torch.arange(0, 4)), (ids[4:], torch.arange(4, SEQ))]
    with torch.no_grad():
        plain = [model(i, p) for i, p in chunks]

    acc = {}
    handles = []
    for name, m in model.named_modules():
        if name.endswith(".mlp") and hasattr(m, "experts"):
            l = m.layer_id

            def put(**kv):  # returns None: a forward hook's non-None result would replace the output
                for k, t in kv.items():
                    acc.setdefault(k, []).append(t.detach().clone())

            handles += [
                m.register_forward_hook(lambda mod, i, o, l=l: put(**{f"layers.{l}.x": i[0], f"layers.{l}.y": o})),
                m.gate.register_forward_hook(lambda mod, i, o, l=l: put(
                    **{f"layers.{l}.router_logits": o if isinstance(o, torch.Tensor) else o[0]})),
                # Routed experts only: the fused shared expert's column (id n_experts) is not one.
                m.topk.register_forward_hook(lambda mod, i, o, l=l: put(**{f"layers.{l}.expert_ids": o.topk_ids[
                    :, :cfg["top_k"]].to(torch.int64)})),
            ]
    specs = hooks.sglang_forward_hooks(os.path.join(d, "spool"))
    for s in specs:
        s["config"]["strict"] = True
    hook_handles = register_like_sglang(model, json.loads(json.dumps(specs)))
    with torch.no_grad():
        model(warm, torch.arange(3))
        acc.clear()
        hooked = [model(i, p) for i, p in chunks]
    for h in handles + hook_handles:
        h.remove()
    if not all(torch.equal(a, b) for a, b in zip(plain, hooked)):
        return report(arch, ["the hooks changed the model's output"])
    ref = {k: torch.cat(v) for k, v in acc.items()}
    ref["input_ids"] = ids
    ok = finish(arch, d, ref, cfg["moe_layers"], cfg["hidden"], cfg["n_experts"], cfg["top_k"], ids, passes=2)
    if style != "qwen":
        return ok

    # A pass that does not continue the request (a prefix-cache hit would do this).
    gap = os.path.join(d, "spool-gap")
    hook_handles = register_like_sglang(model, json.loads(json.dumps(hooks.sglang_forward_hooks(gap))))
    with torch.no_grad():
        model(ids[:4], torch.arange(0, 4))
        model(ids[5:], torch.arange(5, SEQ))
    for h in hook_handles:
        h.remove()
    man = json.load(open(os.path.join(gap, "req-000001", "manifest.json")))
    err = man["error"] or ""
    print(f"{arch}: a pass starting at position 5 after 4 positions: error {err!r}")
    return report(arch + " (gap)", [] if "position 5" in err else ["no error for a gap in the positions"]) and ok


SHAPED = {"qwen": "sglang_shaped", "deepseek": "sglang_deepseek_shaped"}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--seed", type=int, default=5)
    ap.add_argument("--arch", choices=[*ARCHS, *FROM_CHECKPOINT, *SHAPED.values(), "all"], default="all")
    ap.add_argument("--checkpoint", help="the checkpoint of a --arch loaded from one (default: the arch oracle's)")
    a = ap.parse_args()
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    archs = [*ARCHS, *FROM_CHECKPOINT, *SHAPED.values()] if a.arch == "all" else [a.arch]
    style = {v: k for k, v in SHAPED.items()}
    ok = all([run_sglang_shaped(a.out, a.seed, style[arch]) if arch in style
              else run(arch, a.out, a.seed, a.checkpoint) for arch in archs])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
