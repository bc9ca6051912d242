#!/usr/bin/env python3
"""engy-model against transformers at the REAL layer shapes of the models the network serves.

The tiny oracle vectors (tests/vectors/arch, crates/engy-model/tests/arch_vectors.rs) hold engy's
qwen3_5_moe and glm_moe_dsa to transformers at hidden size 128. Shape-dependent bugs hide there:
DeltaNet key heads != value heads (16 vs 32), head_dim 256 with a 64-wide partial rotary, GQA
8:1, MLA ranks 2048/512, qk 192+64 / v 256 heads, DSA `index_topk` against the sequence length.
This check builds, with transformers' own model classes and a fixed seed, checkpoints with the
real per-layer shapes of Qwen3.6-35B-A3B and GLM-5.2 but few layers, 16 routed experts (top-k
and per-expert widths real) and a small vocabulary, saves them with `save_pretrained` (bf16,
a block-FP8 variant and, for glm, an NVFP4 one, in the layouts of the vectors README), runs
transformers' fp32 eager forward, runs engy's side (`cargo run --release -p engy-model --example arch_hidden_states`,
which loads the folder with `engy_model::arch::load` as the auditor does) and compares every
decoder layer's residual and the final hidden states.

Pass rule (tests/arch_vectors.rs): max abs error <= max(20 x floor, 2e-5 x max|ref|), where the
floor is transformers' own fp32 eager-vs-sdpa difference on the same input, and bf16-rounded
final rows agree on >= 99.5% of values. The discrete choices (MoE top-k, DSA top-k) are
reported with their smallest margins, so a failure can be told from a near-tie.

Opt-in: it needs a venv with torch, transformers==5.24.*, safetensors and numpy. Set
ENGY_TF5_PYTHON to that venv's python; the script re-executes itself with it. Without it, it
prints a skip line and exits 0. Cost on 2 cores: qwen about 4 minutes for both formats; glm
about 12 minutes, 11 GB of RAM and 8 GB of disk (the work dir) per format.

    ENGY_TF5_PYTHON=/path/to/venv/bin/python python3 tests/reverse/arch_real_shape.py
    ... --arch glm_moe_dsa --formats bf16 --glm-tokens 2304 --keep

Options: --arch {qwen3_5_moe,glm_moe_dsa,all} (all), --formats bf16,fp8,nvfp4 (all three;
nvfp4, in NVIDIA ModelOpt's layout, for glm_moe_dsa only, as the public GLM-5.x NVFP4 builds),
--work DIR (${ENGY_CACHE_DIR:-~/.cache/engy}/arch-real-shape), --engy-bin PATH (a built
arch_hidden_states; default: cargo run), --qwen-tokens N,... (64,300), --glm-tokens N,...
(2304: longer than the real index_topk 2048, so the last 256 queries really drop keys),
--glm-index-topk N (2048, the release's), --decode N (4: engy computes each sequence's last N
positions by single-id decode steps on the cache of a prefill of the rest, so the incremental
path, with a DSA key cache longer than index_topk, meets the same reference rows),
--keep (keep the checkpoints), --seed S (15).

Exit status: 0 every case passed (or skipped), 1 a case failed, 2 a usage or setup error.
"""
import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


def gate():
    """Re-exec with $ENGY_TF5_PYTHON, or skip when it is unset."""
    want = os.environ.get("ENGY_TF5_PYTHON", "")
    if not want:
        print("arch_real_shape: SKIPPED (set ENGY_TF5_PYTHON to a python with torch and "
              "transformers 5.24: python3 -m venv V && V/bin/pip install torch transformers==5.24.0 safetensors numpy)")
        sys.exit(0)
    if not os.path.exists(want):
        print(f"arch_real_shape: ENGY_TF5_PYTHON={want} does not exist", file=sys.stderr)
        sys.exit(2)
    if os.path.abspath(sys.executable) != os.path.abspath(want) and \
            os.environ.get("_ENGY_TF5_REEXEC") != "1":
        os.environ["_ENGY_TF5_REEXEC"] = "1"
        os.execv(want, [want, os.path.abspath(__file__)] + sys.argv[1:])


if __name__ == "__main__":
    gate()

import numpy as np  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

# --------------------------------------------------------------------------------------------
# Real per-layer shapes. Sources (also in docs/AUDITOR.md):
# * Qwen3.6-35B-A3B: the published config.json's text_config (Qwen/Qwen3.6-35B-A3B; quoted in
#   full by public loaders' tests), which agrees with transformers 5.24's Qwen3_5MoeTextConfig
#   defaults and crates/engy-model/src/synth.rs Qwen36Shapes::RELEASE; rope_theta 1e7 and the
#   interleaved mrope section [11, 11, 10] come from the config.json (not the class defaults).
# * GLM-5.2: the published config.json (zai-org/GLM-5.2-FP8, quoted by public loaders' tests):
#   hidden 6144, 64 heads, q/kv ranks 2048/512, qk 192+64, v 256, indexer 32 x 128 top-2048,
#   rope_theta 8e6, head_dim 192 (transformers points head_dim at qk_rope_head_dim on load),
#   rope_interleave / indexer_rope_interleave true, index_topk_freq 4, dense intermediate 12288,
#   expert width 2048, 8 of 256 routed + 1 shared, routed_scaling_factor 2.5, rms eps 1e-5;
#   n_layers, hidden, experts and top_k also in ../shared/specs/glm-5.2-fp8 (`config`).
# Reduced here: layer count, routed experts (256 -> 16), vocabulary (-> 4096).
# --------------------------------------------------------------------------------------------
EXPERTS = 16
VOCAB = 4096


# --smoke: the same pipeline at toy widths (a self-test of this script, not the check).
QWEN_SMOKE = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                  linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2,
                  linear_num_value_heads=4, moe_intermediate_size=24,
                  shared_expert_intermediate_size=24)
GLM_SMOKE = dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                 num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=32,
                 qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, index_head_dim=16,
                 index_n_heads=16)


def smoke(args, kw, small):
    return {**kw, **small} if args.smoke else kw


def qwen_config(args):
    from transformers import Qwen3_5MoeTextConfig
    return Qwen3_5MoeTextConfig(**smoke(args, dict(
        vocab_size=VOCAB, hidden_size=2048, num_hidden_layers=2,
        layer_types=["linear_attention", "full_attention"],
        num_attention_heads=16, num_key_value_heads=2, head_dim=256,
        linear_conv_kernel_dim=4, linear_key_head_dim=128, linear_value_head_dim=128,
        linear_num_key_heads=16, linear_num_value_heads=32,
        moe_intermediate_size=512, shared_expert_intermediate_size=512,
        num_experts=EXPERTS, num_experts_per_tok=8,
        rms_norm_eps=1e-6, max_position_embeddings=262144, tie_word_embeddings=False,
        hidden_act="silu",
        rope_parameters={"rope_type": "default", "rope_theta": 10000000.0,
                         "partial_rotary_factor": 0.25, "mrope_interleaved": True,
                         "mrope_section": [2, 1, 1] if args.smoke else [11, 11, 10]},
        architectures=["Qwen3_5MoeForCausalLM"],
    ), QWEN_SMOKE))


def glm_config(args):
    from transformers import GlmMoeDsaConfig
    return GlmMoeDsaConfig(**smoke(args, dict(
        vocab_size=VOCAB, hidden_size=6144, intermediate_size=12288, moe_intermediate_size=2048,
        num_hidden_layers=2, mlp_layer_types=["dense", "sparse"],
        first_k_dense_replace=1, indexer_types=["full", "shared"],
        num_attention_heads=64, num_key_value_heads=64,
        q_lora_rank=2048, kv_lora_rank=512, qk_nope_head_dim=192, qk_rope_head_dim=64,
        v_head_dim=256, index_topk=args.glm_index_topk, index_head_dim=128, index_n_heads=32,
        n_routed_experts=EXPERTS, n_shared_experts=1, num_experts_per_tok=8, n_group=1,
        topk_group=1, norm_topk_prob=True, routed_scaling_factor=2.5, rms_norm_eps=1e-5,
        rope_parameters={"rope_theta": 8000000.0, "rope_type": "default"},
        max_position_embeddings=1048576, tie_word_embeddings=False, hidden_act="silu",
        architectures=["GlmMoeDsaForCausalLM"],
    ), GLM_SMOKE))


# Fields of the released GLM-5.2 config.json that transformers 5.24 does not keep on save;
# written back so engy reads the release's file as it is (head_dim 192 must not become the
# rotary width).
GLM_RELEASE_EXTRA = {
    "head_dim": 192, "rope_interleave": True, "indexer_rope_interleave": True,
    "index_topk_freq": 4, "index_skip_topk_offset": 3, "scoring_func": "sigmoid",
    "topk_method": "noaux_tc", "num_nextn_predict_layers": 1,
}

# --------------------------------------------------------------------------------------------
# Weights: transformers' init, rescaled per matrix as tools/gen_arch_vectors.py does for the
# tiny set (vectors README "Weight initialisation") so activations have realistic magnitudes.
# --------------------------------------------------------------------------------------------


def rescale(model, seed):
    g = torch.Generator().manual_seed(seed + 1)
    hidden = model.config.hidden_size
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or ".norm." in name or name.endswith("layernorm.weight"):
                p.add_((torch.rand(p.shape, generator=g) * 0.2 - 0.1).to(p.dtype))
            elif name.endswith("mlp.gate.weight") or name.endswith("shared_expert_gate.weight"):
                p.copy_(torch.randn(p.shape, generator=g) * (1.6 / math.sqrt(hidden)))
            elif name.endswith("embed_tokens.weight"):
                p.copy_(torch.randn(p.shape, generator=g))
            elif p.dim() == 2 and "conv1d" not in name:
                p.copy_(torch.randn(p.shape, generator=g) * (0.8 / math.sqrt(p.shape[1])))
            elif p.dim() == 3 and "conv1d" not in name:  # fused experts [E, out, in]
                p.copy_(torch.randn(p.shape, generator=g) * (0.8 / math.sqrt(p.shape[2])))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.rand(b.shape, generator=g) * 0.16 - 0.08)


def build(arch, args, out):
    """Writes the bf16 checkpoint of `arch` into `out` with save_pretrained."""
    from transformers import GlmMoeDsaForCausalLM, Qwen3_5MoeForCausalLM
    torch.manual_seed(args.seed)
    if arch == "qwen3_5_moe":
        cfg, cls = qwen_config(args), Qwen3_5MoeForCausalLM
    else:
        cfg, cls = glm_config(args), GlmMoeDsaForCausalLM
    model = cls(cfg)
    rescale(model, args.seed)
    model = model.to(torch.bfloat16)
    # transformers keeps the glm router and its bias in fp32 (vectors README).
    for name, mod in model.named_modules():
        if type(mod).__name__.endswith("TopkRouter"):
            mod.float()
    model.save_pretrained(out)
    del model
    if arch == "glm_moe_dsa":
        path = os.path.join(out, "config.json")
        with open(path) as f:
            c = json.load(f)
        c.update(GLM_RELEASE_EXTRA)
        with open(path, "w") as f:
            json.dump(c, f, indent=2, sort_keys=True)


# --------------------------------------------------------------------------------------------
# Block FP8 (vectors README "Layouts of the quantized cases"): W [N, K] -> F8_E4M3 q and F32
# weight_scale_inv [ceil(N/128), ceil(K/128)], scale = amax(tile)/448, q = e4m3(w/scale).
# --------------------------------------------------------------------------------------------
FP8_KEEP = {
    "qwen3_5_moe": ("mlp.gate.weight", "shared_expert_gate.weight", "in_proj_a.weight",
                    "in_proj_b.weight", "conv1d.weight"),
    "glm_moe_dsa": ("mlp.gate.weight", "weights_proj.weight"),
}
BLOCK = 128


def quantizable(arch, name, t):
    if t.dim() != 2 or not name.endswith(".weight"):
        return False
    if "embed_tokens" in name or name.startswith("lm_head") or "norm" in name:
        return False
    return not name.endswith(FP8_KEEP[arch])


def fp8_tiles(w, scale_dtype):
    n, k = w.shape
    gn, gk = -(-n // BLOCK), -(-k // BLOCK)
    pad = torch.zeros(gn * BLOCK, gk * BLOCK, dtype=torch.float32)
    pad[:n, :k] = w.float()
    tiles = pad.view(gn, BLOCK, gk, BLOCK)
    amax = tiles.abs().amax(dim=(1, 3))
    scale = torch.where(amax > 0, amax / 448.0, torch.ones_like(amax))
    # A BF16 weight_scale_inv (the public Qwen -FP8 checkpoints) is the rounded scale, and the
    # codes are taken against that rounded scale.
    scale = scale.to(scale_dtype).float()
    q = (tiles / scale[:, None, :, None]).to(torch.float8_e4m3fn)
    deq = (q.float() * scale[:, None, :, None]).view(gn * BLOCK, gk * BLOCK)[:n, :k]
    q = q.view(gn * BLOCK, gk * BLOCK)[:n, :k].contiguous()
    return q, scale.to(scale_dtype).contiguous(), deq.contiguous()


# The released Qwen3.6 checkpoint is Qwen3_5MoeForConditionalGeneration: text settings under
# `text_config`, tensors under `model.language_model.`, plus vision and MTP tensors the audit
# ignores. The FP8 qwen case is written in that layout, with BF16 weight_scale_inv.
def release_name(arch, name):
    if arch == "qwen3_5_moe" and name.startswith("model."):
        return "model.language_model." + name[len("model."):]
    return name


def release_config(arch, cfg):
    if arch != "qwen3_5_moe":
        return cfg
    text = dict(cfg, model_type="qwen3_5_moe_text")
    text.pop("architectures", None)
    return {"architectures": ["Qwen3_5MoeForConditionalGeneration"], "model_type": "qwen3_5_moe",
            "tie_word_embeddings": False, "text_config": text,
            "vision_config": {"model_type": "qwen3_5_moe", "depth": 1, "hidden_size": 16,
                              "out_hidden_size": cfg["hidden_size"]},
            "image_token_id": 248056, "video_token_id": 248057,
            "transformers_version": cfg.get("transformers_version")}


def release_extras(arch):
    """Vision and MTP tensors of the release layout (small, random): engy must ignore them."""
    if arch != "qwen3_5_moe":
        return {}
    g = torch.Generator().manual_seed(3)
    return {"model.visual.patch_embed.proj.weight": torch.randn(16, 3, 2, 4, 4, generator=g)
            .to(torch.bfloat16),
            "mtp.fc.weight": torch.randn(8, 8, generator=g).to(torch.bfloat16)}


# --------------------------------------------------------------------------------------------
# NVFP4 in NVIDIA ModelOpt's layout (vectors README; glm only, as the public GLM-5.x NVFP4
# checkpoints): the routed experts and the dense MLP. <m>.weight U8 [N, K/2] (element 2j in the
# low nibble), <m>.weight_scale F8_E4M3 [N, K/16], <m>.weight_scale_2 F32 [], <m>.input_scale
# F32 [] (unused by the reference). weight_scale_2 = amax(W)/(6*448), weight_scale =
# e4m3(amax(group)/(6*weight_scale_2)), code = nearest E2M1 of W/(weight_scale*weight_scale_2).
# --------------------------------------------------------------------------------------------
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
E2M1_EDGES = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
NVFP4_IGNORE = ["lm_head", "model.embed_tokens", "model.layers.*.self_attn*",
                "model.layers.*.mlp.gate", "model.layers.*.mlp.shared_experts*"]


def nvfp4_quantizable(name, t):
    if t.dim() != 2 or not name.endswith(".weight") or ".mlp." not in name:
        return False
    return name.endswith(("gate_proj.weight", "up_proj.weight", "down_proj.weight")) and \
        "shared_experts" not in name


def nvfp4(w):
    w = w.float()
    n, k = w.shape
    s2 = w.abs().amax() / (6 * 448)
    s2 = s2 if s2 > 0 else torch.tensor(1.0)
    groups = w.view(n, k // 16, 16)
    gs = (groups.abs().amax(-1) / (6 * s2)).to(torch.float8_e4m3fn)
    gs = torch.where(gs.float() > 0, gs.float(), torch.ones_like(gs.float())).to(torch.float8_e4m3fn)
    x = groups / (gs.float()[..., None] * s2)
    mag = torch.bucketize(x.abs().clamp(max=6.0), E2M1_EDGES)
    code = (mag | ((w.view(n, k // 16, 16) < 0).to(torch.int64) << 3)).view(n, k)
    packed = (code[:, 0::2] | (code[:, 1::2] << 4)).to(torch.uint8).contiguous()
    val = E2M1[mag] * torch.where(code.view(n, k // 16, 16) >= 8, -1.0, 1.0)
    deq = ((val * gs.float()[..., None]) * s2).view(n, k).contiguous()
    return {".weight": packed, ".weight_scale": gs.contiguous(),
            ".weight_scale_2": s2.reshape(()).float(), ".input_scale": torch.tensor(1.0)}, deq


def write_fp8(arch, src, out, deq_out, fmt="fp8"):
    """`out`: the FP8 (or NVFP4) checkpoint; `deq_out`: its dequantised weights as F32 (the
    reference's)."""
    os.makedirs(out, exist_ok=True)
    os.makedirs(deq_out, exist_ok=True)
    with open(os.path.join(src, "config.json")) as f:
        cfg = json.load(f)
    shards = sorted(x for x in os.listdir(src) if x.endswith(".safetensors"))
    index = {}
    skipped = []
    scale_dtype = torch.bfloat16 if arch == "qwen3_5_moe" else torch.float32
    for i, shard in enumerate(shards):
        tensors = load_file(os.path.join(src, shard))
        q_out, d_out = ({} if i else release_extras(arch)), {}
        for name, t in tensors.items():
            out_name = release_name(arch, name)
            if fmt == "nvfp4":
                if nvfp4_quantizable(name, t):
                    parts, d = nvfp4(t)
                    stem = out_name[: -len(".weight")]
                    for suffix, v in parts.items():
                        q_out[stem + suffix] = v
                    d_out[name] = d
                else:
                    q_out[out_name] = t
                    d_out[name] = t.float() if t.dtype == torch.bfloat16 else t
            elif quantizable(arch, name, t):
                q, s, d = fp8_tiles(t, scale_dtype)
                q_out[out_name] = q
                q_out[out_name.replace(".weight", ".weight_scale_inv")] = s
                d_out[name] = d
            else:
                q_out[out_name] = t
                d_out[name] = t.float() if t.dtype == torch.bfloat16 else t
                if t.dim() == 2 and "norm" not in name:
                    skipped.append(name.rsplit(".", 1)[0])
        save_file(q_out, os.path.join(out, shard), metadata={"format": "pt"})
        save_file(d_out, os.path.join(deq_out, shard), metadata={"format": "pt"})
        for name in q_out:
            index[name] = shard
        del tensors, q_out, d_out
    if len(shards) > 1 or release_extras(arch):
        with open(os.path.join(out, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {}, "weight_map": index}, f, indent=1, sort_keys=True)
    if len(shards) > 1:
        with open(os.path.join(src, "model.safetensors.index.json")) as f:
            src_index = json.load(f)
        with open(os.path.join(deq_out, "model.safetensors.index.json"), "w") as f:
            json.dump(src_index, f)
    with open(os.path.join(deq_out, "config.json"), "w") as f:
        json.dump(dict(cfg, dtype="float32"), f, indent=2, sort_keys=True)
    if fmt == "nvfp4":
        group = {"dynamic": False, "group_size": 16, "num_bits": 4, "type": "float"}
        cfg["quantization_config"] = {
            "quant_method": "modelopt", "quant_algo": "NVFP4", "ignore": NVFP4_IGNORE,
            "config_groups": {"group_0": {"input_activations": group, "weights": group,
                                          "targets": ["Linear"]}},
            "producer": {"name": "modelopt", "version": "emulated-by-arch_real_shape.py"}}
        with open(os.path.join(out, "hf_quant_config.json"), "w") as f:
            json.dump({"producer": cfg["quantization_config"]["producer"],
                       "quantization": {"quant_algo": "NVFP4", "kv_cache_quant_algo": None,
                                        "group_size": 16, "exclude_modules": NVFP4_IGNORE}},
                      f, indent=2)
        with open(os.path.join(out, "config.json"), "w") as f:
            json.dump(cfg, f, indent=2, sort_keys=True)
        return
    cfg = release_config(arch, cfg)
    cfg["quantization_config"] = {
        "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
        "weight_block_size": [BLOCK, BLOCK],
        "modules_to_not_convert": sorted(set(release_name(arch, m) for m in skipped)),
    }
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2, sort_keys=True)


# --------------------------------------------------------------------------------------------
# The reference forward and the margins of its discrete choices.
# --------------------------------------------------------------------------------------------
class TopkMargins:
    """Records the gap between the k-th and (k+1)-th value of every top-k row transformers
    takes (MoE routers: [T, E]; DSA indexer: [1, T, T]), relative to the row's max |value|."""

    def __init__(self):
        self.stats = {}
        self._orig_fn = torch.topk
        self._orig_m = torch.Tensor.topk

    def _record(self, x, k, dim=-1):
        if not isinstance(k, int) or dim not in (-1, x.dim() - 1) or k >= x.shape[-1]:
            return
        # The DSA indexer's scores are [B, T, T]; a 3-D [T, groups, E] is the glm router's
        # in-group top-2, which only ranks groups (n_group 1 here): not a choice.
        if x.dim() == 3 and x.shape[-1] != x.shape[-2]:
            return
        v = x.detach().float().reshape(-1, x.shape[-1])
        # Masked entries are -inf or the additive mask's finfo.min.
        masked = ~torch.isfinite(v) | (v <= torch.finfo(torch.float32).min / 2)
        v = v.masked_fill(masked, float("-inf"))
        top = self._orig_fn(v, k + 1, dim=-1).values
        kth, nxt = top[:, k - 1], top[:, k]
        ok = torch.isfinite(nxt)
        if not ok.any():
            return
        scale = v.masked_fill(masked, 0).abs().amax(-1).clamp_min(1e-30)
        rel = ((kth - nxt) / scale)[ok]
        kind = "dsa" if x.dim() == 3 else "moe"
        s = self.stats.setdefault(kind, {"rows": 0, "min_rel_margin": float("inf"),
                                          "rows_below_1e-5": 0})
        s["rows"] += int(ok.sum())
        s["min_rel_margin"] = min(s["min_rel_margin"], float(rel.min()))
        s["rows_below_1e-5"] += int((rel < 1e-5).sum())

    def __enter__(self):
        outer = self

        inside = []

        def fn(x, k, dim=-1, *a, **kw):
            if not inside:
                outer._record(x, k, dim)
            return outer._orig_fn(x, k, dim, *a, **kw)

        def meth(self_, k, dim=-1, *a, **kw):
            outer._record(self_, k, dim)
            inside.append(1)
            try:
                return outer._orig_m(self_, k, dim, *a, **kw)
            finally:
                inside.pop()

        torch.topk = fn
        torch.Tensor.topk = meth
        return self

    def __exit__(self, *exc):
        torch.topk = self._orig_fn
        torch.Tensor.topk = self._orig_m


def reference(folder, seqs):
    """fp32 eager forward of every sequence: {hidden_k, layer_l_k}, the eager-vs-sdpa floor
    and the top-k margins."""
    from transformers import AutoModelForCausalLM
    out, margins = {}, TopkMargins()
    floors = {"hidden": 0.0, "layers": 0.0}
    for impl in ("eager", "sdpa"):
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32,
                                                     attn_implementation=impl)
        model.eval()
        base = model.model
        last = {}
        # hidden_states[-1] is the final norm's output, so the last decoder layer's residual
        # (the norm's input) is read with a pre-hook on the norm.
        hook = base.norm.register_forward_pre_hook(
            lambda _m, a: last.__setitem__("x", a[0].detach()))
        for k, ids in enumerate(seqs):
            t = time.time()
            with torch.no_grad():
                if impl == "eager":
                    with margins:
                        o = base(input_ids=ids[None], output_hidden_states=True, use_cache=False)
                else:
                    o = base(input_ids=ids[None], output_hidden_states=True, use_cache=False)
            hs = o.hidden_states
            final = o.last_hidden_state[0]
            layers = [h[0] for h in hs[1:-1]] + [last["x"][0]]
            if not torch.equal(hs[-1][0], final):
                raise RuntimeError("output_hidden_states[-1] is not the final norm's output")
            if impl == "eager":
                out[f"hidden_{k}"] = final.contiguous()
                for l, h in enumerate(layers):
                    out[f"layer_{l}_{k}"] = h.contiguous()
            else:
                floors["hidden"] = max(floors["hidden"],
                                       float((final - out[f"hidden_{k}"]).abs().max()))
                for l, h in enumerate(layers):
                    floors["layers"] = max(floors["layers"],
                                           float((h - out[f"layer_{l}_{k}"]).abs().max()))
            print(f"  transformers {impl} seq {k} (T={len(ids)}): {time.time() - t:.1f}s",
                  flush=True)
        hook.remove()
        del model, base
    return out, floors, margins.stats


# --------------------------------------------------------------------------------------------
# engy's side and the comparison.
# --------------------------------------------------------------------------------------------
def engy(folder, ids_file, out_file, args):
    if args.engy_bin:
        cmd = [args.engy_bin, folder, ids_file, out_file]
    else:
        cmd = ["cargo", "run", "--quiet", "--release", "--locked", "-p", "engy-model",
               "--example", "arch_hidden_states", "--", folder, ids_file, out_file]
    cmd += ["--decode", str(args.decode)]
    t = time.time()
    r = subprocess.run(cmd, cwd=ROOT)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {r.returncode}")
    return time.time() - t


def bf16_bits(x):
    """Round-to-nearest-even f32 -> bf16 bit patterns (as torch does)."""
    return x.to(torch.bfloat16).view(torch.int16)


def compare(name, ref, got, floors, nseq, nlayers, decode):
    failures, rows = [], []
    for k in range(nseq):
        for l in range(nlayers):
            key = f"layer_{l}_{k}"
            if key not in ref:
                continue
            if key not in got:
                failures.append(f"{name} seq {k}: engy wrote no {key}")
                continue
            w, g = ref[key], got[key]
            err = float((w - g).abs().max())
            amax = float(w.abs().max())
            tol = max(20 * floors["layers"], 2e-5 * amax)
            rows.append(f"{name} seq {k} layer {l}: max abs {err:.3e} (tol {tol:.3e}, "
                        f"max |ref| {amax:.2f})")
            if not err <= tol:
                failures.append(f"{name} seq {k} layer {l}: max abs {err:.3e} > {tol:.3e}")
        key = f"hidden_{k}"
        w, g = ref[key], got.get(key)
        if g is None or g.shape != w.shape:
            failures.append(f"{name} seq {k}: engy {key} shape "
                            f"{None if g is None else tuple(g.shape)} vs {tuple(w.shape)}")
            continue
        err = float((w - g).abs().max())
        amax = float(w.abs().max())
        tol = max(20 * floors["hidden"], 2e-5 * amax)
        agree = float((bf16_bits(w) == bf16_bits(g)).float().mean())
        n = min(decode, w.shape[0] - 1)
        derr = float((w[-n:] - g[-n:]).abs().max()) if n > 0 else 0.0
        rows.append(f"{name} seq {k} (T={w.shape[0]}): final max abs {err:.3e}, rel "
                    f"{err / amax:.3e} (tol {tol:.3e}), bf16 equal {100 * agree:.3f}%; "
                    f"the last {n} rows by decode steps: max abs {derr:.3e}")
        if not err <= tol:
            failures.append(f"{name} seq {k}: final max abs {err:.3e} > {tol:.3e}")
        if agree < 0.995:
            failures.append(f"{name} seq {k}: bf16 agreement {agree:.5f} < 0.995")
    return rows, failures


def dir_bytes(d):
    return sum(os.path.getsize(os.path.join(d, f)) for f in os.listdir(d))


def run_case(arch, fmt, args, work, base_dirs):
    name = f"{arch}_real_{fmt}"
    layout = {("qwen3_5_moe", "fp8"): " (release layout: Qwen3_5MoeForConditionalGeneration, "
              "model.language_model.*, visual/mtp tensors, BF16 weight_scale_inv)",
              ("glm_moe_dsa", "bf16"): " (config.json with the release's extra fields: "
              "head_dim 192, rope_interleave, index_topk_freq)"}.get((arch, fmt), "")
    print(f"== {name}{layout}", flush=True)
    t0 = time.time()
    bf16_dir = base_dirs.get(arch)
    if bf16_dir is None:
        bf16_dir = os.path.join(work, f"{arch}_real_bf16")
        shutil.rmtree(bf16_dir, ignore_errors=True)
        build(arch, args, bf16_dir)
        base_dirs[arch] = bf16_dir
    if fmt == "bf16":
        folder, ref_folder = bf16_dir, bf16_dir
    else:
        folder = os.path.join(work, f"{arch}_real_{fmt}")
        ref_folder = os.path.join(work, f"{arch}_real_{fmt}_dequantised")
        shutil.rmtree(folder, ignore_errors=True)
        shutil.rmtree(ref_folder, ignore_errors=True)
        write_fp8(arch, bf16_dir, folder, ref_folder, fmt)
    t_build = time.time() - t0
    with open(os.path.join(ref_folder, "config.json")) as f:
        nlayers = json.load(f)["num_hidden_layers"]
    lengths = args.qwen_tokens if arch == "qwen3_5_moe" else args.glm_tokens
    g = torch.Generator().manual_seed(args.seed + 7)
    seqs = [torch.randint(0, VOCAB, (n,), generator=g, dtype=torch.int64) for n in lengths]
    t = time.time()
    ref, floors, margins = reference(ref_folder, seqs)
    t_ref = time.time() - t
    ids_file = os.path.join(work, f"{name}.ids.safetensors")
    save_file({f"input_ids_{k}": s for k, s in enumerate(seqs)}, ids_file)
    out_file = os.path.join(work, f"{name}.engy.safetensors")
    t_engy = engy(folder, ids_file, out_file, args)
    got = load_file(out_file)
    rows, failures = compare(name, ref, got, floors, len(seqs), nlayers, args.decode)
    for r in rows:
        print("  " + r)
    print(f"  checkpoint {dir_bytes(folder) / 1e9:.2f} GB; eager-vs-sdpa floor: hidden "
          f"{floors['hidden']:.2e}, layers {floors['layers']:.2e}; top-k margins {margins}")
    print(f"  time: build {t_build:.0f}s, transformers {t_ref:.0f}s, engy {t_engy:.0f}s")
    if fmt != "bf16" and not args.keep:
        shutil.rmtree(ref_folder, ignore_errors=True)
        shutil.rmtree(folder, ignore_errors=True)
    return failures


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--arch", default="all", choices=["all", "qwen3_5_moe", "glm_moe_dsa"])
    p.add_argument("--formats", default="bf16,fp8,nvfp4")
    p.add_argument("--work", default=os.path.join(
        os.environ.get("ENGY_CACHE_DIR") or os.path.join(
            os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "engy"),
        "arch-real-shape"))
    p.add_argument("--engy-bin", default="")
    p.add_argument("--qwen-tokens", default="64,300")
    p.add_argument("--glm-tokens", default="2304")
    p.add_argument("--glm-index-topk", type=int, default=2048)
    p.add_argument("--decode", type=int, default=4)
    p.add_argument("--seed", type=int, default=15)
    p.add_argument("--keep", action="store_true")
    p.add_argument("--smoke", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    try:
        args.qwen_tokens = [int(x) for x in args.qwen_tokens.split(",") if x]
        args.glm_tokens = [int(x) for x in args.glm_tokens.split(",") if x]
    except ValueError:
        p.error("--qwen-tokens / --glm-tokens take comma-separated whole numbers")
    formats = [f for f in args.formats.split(",") if f]
    if any(f not in ("bf16", "fp8", "nvfp4") for f in formats):
        p.error("--formats takes bf16, fp8 and/or nvfp4 (nvfp4: glm_moe_dsa only)")
    if not transformers.__version__.startswith("5."):
        print(f"arch_real_shape: transformers {transformers.__version__} found, 5.x needed",
              file=sys.stderr)
        return 2
    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    os.makedirs(args.work, exist_ok=True)
    print(f"arch_real_shape: torch {torch.__version__}, transformers {transformers.__version__},"
          f" work dir {args.work}", flush=True)
    archs = ["qwen3_5_moe", "glm_moe_dsa"] if args.arch == "all" else [args.arch]
    failures, base_dirs = [], {}
    for arch in archs:
        for fmt in formats:
            if fmt == "nvfp4" and arch != "glm_moe_dsa":
                continue
            try:
                failures += run_case(arch, fmt, args, args.work, base_dirs)
            except RuntimeError as e:
                failures.append(f"{arch} {fmt}: {e}")
        if not args.keep and arch in base_dirs:
            shutil.rmtree(base_dirs[arch], ignore_errors=True)
    if failures:
        print("arch_real_shape: FAILED\n  " + "\n  ".join(failures))
        return 1
    print("arch_real_shape: ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
