"""W8A8 serves of small block-FP8 checkpoints on a GPU: the audit oracle for sglang's numerics.

sglang serves a block-FP8 checkpoint (`quant_method: fp8`, `weight_block_size [128, 128]`)
W8A8: every input row of an FP8 linear (and of the fused MoE's experts) is quantised per token
and per group of 128 input columns to float8_e4m3fn (`per_token_group_quant_fp8`: scale =
max(max|x|, 1e-10) / 448, f32; q = e4m3(clamp(x / scale, ±448)), round to nearest even), and
the product runs on FP8 tensor cores with f32 accumulation per 128-column block, scaled by
activation scale × weight tile scale, output cast to bf16 (`w8a8_block_fp8_matmul`). This
script serves that way on a GPU, independently of engy: the activation quantiser in torch
(the cast `.to(torch.float8_e4m3fn)`), the product in a Triton kernel with `tl.dot` on
FP8 operands (Hopper's FP8 tensor cores), everything else transformers' own bf16 model
(sdpa attention, eager experts: `nn.functional.linear` per expert replaced by the W8A8
product). transformers' own FineGrainedFP8 path (5.17 and 5.24) takes its kernels from the
Hugging Face hub (`kernels-community/finegrained-fp8`), which a machine without network cannot
load; the kernel here computes the same rule.

Two commands:

  make CASE OUT SEED '{config overrides}'   (CPU; torch + transformers >= 5.17)
      A random checkpoint of CASE's architecture (tests/vectors/arch/<case>_fp8, its
      config.json and modules_to_not_convert), every dimension an FP8 product sees a multiple
      of 128 (no partial tile), filled as serves_common.init_weights fills it, the
      projections, shared and routed experts stored block FP8 (per-expert names, F32
      weight_scale_inv, tile scale = tile amax / 448) as the Qwen and GLM `-FP8` releases.
  serve CKPT OUT.safetensors --variant V[,V…] [--n 12] [--seed 2001]   (CUDA; on a machine without
      one, a CPU emulation: the same quantised operands, f32 products)
      Greedy generation of n random prompts (16–40 ids, 64–160 new tokens, EOS off), rows
      captured at the final norm as tests/reverse/honest_serves.py does; V is one of
      VARIANTS below. Then crates/engy-model/examples/commit_rows.rs turns OUT into
      commitments.

Exit 0, or 2 on a usage error.
"""
import argparse, json, os, sys, tempfile

import torch
from safetensors.torch import load_file, save_file

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from serves_common import Serve, draw_requests, init_weights, model_root  # noqa: E402

E4M3_MAX = 448.0
EPS = 1e-10
BLOCK = 128

# variant -> (what the serve does, whether a correct auditor passes it)
VARIANTS = {
    "honest_bf16_batched": "bf16 products of the dequantised weights (W8A16: the bf16 recompute's serve), batched",
    "honest_w8a8_batched": "W8A8 (sglang's numerics), all prompts in one left-padded batch",
    "honest_w8a8": "W8A8, one prompt at a time",
    "honest_w8a8_tf": "W8A8, the batched serve's output ids, rows from one teacher-forced pass each",
    "honest_w8a8_exact_batched": "the W8A8 quantised operands, their products in f32 on the same device "
                                 "(the CPU emulation's rule; on a GPU: no FP8 tensor cores), batched",
    "int4_g32": "every projection and expert int4 (groups of 32), bf16 activations (W4A16), batched",
    "experts_int4_g32_w8a8": "routed experts int4 g32 (W4A16), the rest W8A8, batched",
    "experts_nvfp4_w8a8": "routed experts NVFP4 (E2M1, e4m3 scale per 16, global f32 scale; W4A16), the rest W8A8, batched",
    "experts_fp8_tensor_w8a8": "routed experts requantised to one FP8 scale per expert tensor (W8A16), the rest W8A8, batched",
}


# ---------------------------------------------------------------------------------------------
# make: a random block-FP8 checkpoint


def quant_block(w):
    """[N, K] f32 -> (F8_E4M3 [N, K], F32 [N/128, K/128]): scale = tile amax / 448."""
    n, k = w.shape
    assert n % BLOCK == 0 and k % BLOCK == 0, f"{w.shape}: not whole 128x128 tiles"
    t = w.reshape(n // BLOCK, BLOCK, k // BLOCK, BLOCK)
    s = t.abs().amax(dim=(1, 3)).clamp_min(1e-12) / E4M3_MAX
    q = (t / s[:, None, :, None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q.reshape(n, k), s.to(torch.float32)


def portable(cfg):
    """`cfg` (a config.json dict) as both transformers 5.17 and 5.24 load it.

    GLM's `layer_types` entry for a DSA layer was renamed between them (5.17
    `deepseek_sparse_attention`, 5.24 `indexed_attention`) and each rejects the other's name;
    left out, each fills in its own. engy does not read it (`mlp_layer_types` and
    `indexer_types` say what each layer is)."""
    if cfg.get("model_type") == "glm_moe_dsa":
        cfg = {k: v for k, v in cfg.items() if k != "layer_types"}
    return cfg


def check_indexers(cfg, config):
    """Refuse a checkpoint with shared DSA indexers on a transformers that ignores
    `indexer_types`: it would compute every layer's indexer, and the rows would not be the
    serve of this checkpoint."""
    want = cfg.get("indexer_types")
    if want and "shared" in want and list(getattr(config, "indexer_types", None) or []) != want:
        sys.exit(f"this transformers does not keep indexer_types {want}: make the checkpoint "
                 "with every indexer 'full' (override indexer_types)")


def make(case, out, seed, overrides):
    from transformers import AutoConfig, AutoModelForCausalLM
    cfg = json.load(open(os.path.join(case, "config.json")))
    cfg.update(overrides)
    cfg = portable(cfg)
    keep = set(cfg["quantization_config"].get("modules_to_not_convert", []))
    with tempfile.TemporaryDirectory() as tmp:
        plain = {k: v for k, v in cfg.items() if k != "quantization_config"}
        json.dump(plain, open(os.path.join(tmp, "config.json"), "w"))
        config = AutoConfig.from_pretrained(tmp)
    check_indexers(cfg, config)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    massive = init_weights(model, seed)
    sd = {k: v.detach().to(torch.float32) for k, v in model.state_dict().items()}
    # Fused experts -> the release's per-expert names (gate = the first half of gate_up).
    flat = {}
    for name, t in sd.items():
        if name.endswith("experts.gate_up_proj"):
            base = name[: -len("gate_up_proj")]
            half = t.shape[1] // 2
            for e in range(t.shape[0]):
                flat[f"{base}{e}.gate_proj.weight"] = t[e, :half]
                flat[f"{base}{e}.up_proj.weight"] = t[e, half:]
        elif name.endswith("experts.down_proj"):
            base = name[: -len("down_proj")]
            for e in range(t.shape[0]):
                flat[f"{base}{e}.down_proj.weight"] = t[e]
        else:
            flat[name] = t
    res = {}
    fp8 = 0
    for name, t in flat.items():
        module = name[: -len(".weight")] if name.endswith(".weight") else None
        quantise = (module is not None and t.dim() == 2 and module not in keep
                    and "norm" not in module and not module.endswith(("embed_tokens", "lm_head"))
                    and not module.endswith(("mlp.gate", "shared_expert_gate", "weights_proj",
                                             "in_proj_a", "in_proj_b")))
        if quantise:
            q, s = quant_block(t)
            res[name] = q.contiguous()
            res[name + "_scale_inv"] = s.contiguous()
            fp8 += 1
        elif name.endswith("e_score_correction_bias") or name.endswith("mlp.gate.weight") and "glm" in cfg["model_type"]:
            res[name] = t.contiguous()  # GLM keeps its router in f32
        else:
            res[name] = t.to(torch.bfloat16).contiguous()
    os.makedirs(out, exist_ok=True)
    json.dump(cfg, open(os.path.join(out, "config.json"), "w"), indent=2)
    for f in ("generation_config.json",):
        if os.path.exists(os.path.join(case, f)):
            with open(os.path.join(case, f)) as src, open(os.path.join(out, f), "w") as dst:
                dst.write(src.read())
    save_file(res, os.path.join(out, "model.safetensors"))
    print(f"{out}: {fp8} block-FP8 weights, model_root {model_root(out)} (massive channels {massive})")


# ---------------------------------------------------------------------------------------------
# serve: W8A8 on a GPU


def act_quant(x):
    """sglang's per_token_group_quant_fp8 on x [M, K] (K % 128 == 0): (q F8 [M, K], s F32 [M, K/128])."""
    m, k = x.shape
    g = x.to(torch.float32).reshape(m, k // BLOCK, BLOCK)
    s = g.abs().amax(-1, keepdim=True).clamp_min(EPS) / E4M3_MAX
    q = (g / s).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q.reshape(m, k), s.reshape(m, k // BLOCK).contiguous()


_KERNEL = None


def _kernel():
    global _KERNEL
    if _KERNEL is not None:
        return _KERNEL
    import triton
    import triton.language as tl

    @triton.jit
    def w8a8(a_ptr, b_ptr, c_ptr, as_ptr, bs_ptr, M, N, K, s_am, s_bn, s_cm, s_asm, s_bsn,
             BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
        pm = tl.program_id(0)
        pn = tl.program_id(1)
        rm = pm * BM + tl.arange(0, BM)
        rn = pn * BN + tl.arange(0, BN)
        rk = tl.arange(0, BK)
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for kb in range(0, K // BK):
            a = tl.load(a_ptr + rm[:, None] * s_am + (kb * BK + rk)[None, :], mask=rm[:, None] < M, other=0.0)
            b = tl.load(b_ptr + rn[None, :] * s_bn + (kb * BK + rk)[:, None], mask=rn[None, :] < N, other=0.0)
            a_s = tl.load(as_ptr + rm * s_asm + kb, mask=rm < M, other=0.0)
            b_s = tl.load(bs_ptr + (rn // BK) * s_bsn + kb, mask=rn < N, other=0.0)
            acc += tl.dot(a, b) * a_s[:, None] * b_s[None, :]
        tl.store(c_ptr + rm[:, None] * s_cm + rn[None, :], acc.to(tl.bfloat16),
                 mask=(rm[:, None] < M) & (rn[None, :] < N))

    _KERNEL = (w8a8, triton)
    return _KERNEL


EXACT = False  # set for honest_w8a8_exact_batched: f32 products of the quantised operands


def w8a8_linear(x, q, s):
    """x [..., K] bf16 · (q [N, K] F8, s [N/128, K/128] F32)ᵀ -> [..., N] bf16, sglang's W8A8."""
    shape = x.shape
    if not x.is_cuda or EXACT:
        # The CPU emulation (no FP8 tensor cores): the same quantised operands, f32 products.
        x2 = x.reshape(-1, shape[-1])
        aq, a_s = act_quant(x2)
        a = aq.to(torch.float32) * a_s.repeat_interleave(BLOCK, 1)
        w = q.to(torch.float32) * s.repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)
        return (a @ w.T).to(torch.bfloat16).reshape(*shape[:-1], q.shape[0])
    kern, triton = _kernel()
    x2 = x.reshape(-1, shape[-1]).contiguous()
    m, k = x2.shape
    n = q.shape[0]
    out = torch.empty((m, n), dtype=torch.bfloat16, device=x.device)
    if m == 0:
        return out.reshape(*shape[:-1], n)
    aq, a_s = act_quant(x2)
    grid = (triton.cdiv(m, 64), triton.cdiv(n, BLOCK))
    kern[grid](aq, q, out, a_s, s, m, n, k, aq.stride(0), q.stride(0), out.stride(0),
               a_s.stride(0), s.stride(0), BM=64, BN=BLOCK, BK=BLOCK)
    return out.reshape(*shape[:-1], n)


def fake_int4(w, group=32):
    n = w.shape[-1]
    g = w.reshape(*w.shape[:-1], n // group, group)
    s = g.abs().amax(-1, keepdim=True).clamp_min(1e-12) / 7
    return ((g / s).round().clamp(-7, 7) * s).reshape(w.shape)


def fake_nvfp4(w):
    """ModelOpt NVFP4: global scale amax/(448·6), per-16 e4m3 scales, E2M1 values (RNE)."""
    lv = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], device=w.device)
    g2 = w.abs().max().clamp_min(1e-12) / (448.0 * 6.0)
    g = w.reshape(*w.shape[:-1], -1, 16)
    s = (g.abs().amax(-1, keepdim=True) / 6.0 / g2).clamp(max=448).to(torch.float8_e4m3fn).to(torch.float32)
    s = torch.where(s == 0, torch.ones_like(s), s)
    v = (g / (s * g2)).clamp(-6, 6)
    idx = (v.abs()[..., None] - lv).abs().argmin(-1)
    return (torch.sign(v) * lv[idx] * s * g2).reshape(w.shape)


def fake_fp8_tensor(w):
    s = w.abs().max().clamp_min(1e-12) / E4M3_MAX
    return (w / s).to(torch.float8_e4m3fn).to(torch.float32) * s


def patch(model, st, variant):
    """Routes every block-FP8 linear of the loaded (dequantised, bf16) model through
    w8a8_linear, and the experts through a per-expert loop whose products are W8A8 or, for an
    expert cheat, bf16 products with the cheated weights."""
    dev = next(model.parameters()).device
    fp8 = {n[: -len(".weight_scale_inv")] for n in st if n.endswith(".weight_scale_inv")}
    cheat_experts = {"experts_int4_g32_w8a8": fake_int4, "experts_nvfp4_w8a8": fake_nvfp4,
                     "experts_fp8_tensor_w8a8": fake_fp8_tensor}.get(variant)
    patched = 0
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.Linear) and name in fp8:
            q = st[name + ".weight"].to(dev)
            s = st[name + ".weight_scale_inv"].to(dev).contiguous()
            mod.forward = (lambda x, q=q, s=s: w8a8_linear(x, q, s))
            patched += 1
        elif hasattr(mod, "gate_up_proj") and hasattr(mod, "down_proj") and f"{name}.0.gate_proj" in fp8:
            ne = mod.gate_up_proj.shape[0]
            if cheat_experts is None:
                gu = [(torch.cat([st[f"{name}.{e}.gate_proj.weight"], st[f"{name}.{e}.up_proj.weight"]]).to(dev),
                       torch.cat([st[f"{name}.{e}.gate_proj.weight_scale_inv"],
                                  st[f"{name}.{e}.up_proj.weight_scale_inv"]]).to(dev).contiguous())
                      for e in range(ne)]
                dn = [(st[f"{name}.{e}.down_proj.weight"].to(dev),
                       st[f"{name}.{e}.down_proj.weight_scale_inv"].to(dev).contiguous()) for e in range(ne)]
                lin_gu = lambda x, e, gu=gu: w8a8_linear(x, *gu[e])
                lin_dn = lambda x, e, dn=dn: w8a8_linear(x, *dn[e])
            else:
                with torch.no_grad():
                    wgu = torch.stack([cheat_experts(mod.gate_up_proj[e].float()) for e in range(ne)]).to(torch.bfloat16)
                    wdn = torch.stack([cheat_experts(mod.down_proj[e].float()) for e in range(ne)]).to(torch.bfloat16)
                lin_gu = lambda x, e, w=wgu: torch.nn.functional.linear(x, w[e])
                lin_dn = lambda x, e, w=wdn: torch.nn.functional.linear(x, w[e])

            def forward(hidden_states, top_k_index, top_k_weights, mod=mod, lin_gu=lin_gu, lin_dn=lin_dn, ne=ne):
                # transformers' eager experts loop, products replaced.
                final = torch.zeros_like(hidden_states)
                mask = torch.nn.functional.one_hot(top_k_index, num_classes=ne + 1).permute(2, 1, 0)
                for e in torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero():
                    e = int(e[0])
                    if e == ne:
                        continue
                    pos, tok = torch.where(mask[e])
                    gate, up = lin_gu(hidden_states[tok], e).chunk(2, dim=-1)
                    h = lin_dn(mod.act_fn(gate) * up, e)
                    h = h * top_k_weights[tok, pos, None]
                    final.index_add_(0, tok, h.to(final.dtype))
                return final

            mod.forward = forward
            patched += 1
    return patched


def serve(ckpt, out, variant, n, seed):
    from transformers import AutoModelForCausalLM
    from arch_bf16_floor import dequantised_copy
    from honest_serves import cheat
    torch.manual_seed(0)
    st = load_file(os.path.join(ckpt, "model.safetensors"))
    with tempfile.TemporaryDirectory() as tmp:
        served = dequantised_copy(ckpt, os.path.join(tmp, "served"))
        if served != ckpt:
            cfg_path = os.path.join(served, "config.json")
            cfg = portable(json.load(open(cfg_path)))
            json.dump(cfg, open(cfg_path, "w"))
        model = AutoModelForCausalLM.from_pretrained(
            served, dtype=torch.bfloat16,
            attn_implementation="sdpa", experts_implementation="eager")
    check_indexers(json.load(open(os.path.join(ckpt, "config.json"))), model.config)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    model.eval().to(dev)
    if variant == "int4_g32":
        cheat(model, "int4_g32")
        patched = 0
    elif variant == "honest_bf16_batched":
        patched = 0
    else:
        global EXACT
        EXACT = variant == "honest_w8a8_exact_batched"
        patched = patch(model, st, variant)
    prompts, news = draw_requests(model.config.vocab_size, n, seed)
    sv = Serve(model, prompts, news, dev)
    if variant == "honest_w8a8":
        for i in range(n):
            sv.generate([i])
    else:
        sv.generate(list(range(n)))
    if variant == "honest_w8a8_tf":
        sv.teacher_forced()
    save_file(sv.out, out)
    print(f"wrote {out}: {n} serves, {variant} ({patched} modules W8A8-patched)", flush=True)


def main():
    if len(sys.argv) >= 2 and sys.argv[1] == "make" and len(sys.argv) in (5, 6):
        make(sys.argv[2], sys.argv[3], int(sys.argv[4]), json.loads(sys.argv[5]) if len(sys.argv) == 6 else {})
        return
    if len(sys.argv) >= 2 and sys.argv[1] == "serve":
        ap = argparse.ArgumentParser()
        ap.add_argument("ckpt")
        ap.add_argument("out")
        ap.add_argument("--variant", required=True,
                        help="one of VARIANTS, or several comma-separated (OUT is then a folder: OUT/VARIANT.safetensors)")
        ap.add_argument("--n", type=int, default=12)
        ap.add_argument("--seed", type=int, default=2001)
        a = ap.parse_args(sys.argv[2:])
        variants = a.variant.split(",")
        bad = [v for v in variants if v not in VARIANTS]
        if bad:
            print(f"unknown variant(s) {bad}; known: {sorted(VARIANTS)}", file=sys.stderr)
            sys.exit(2)
        if len(variants) == 1:
            serve(a.ckpt, a.out, variants[0], a.n, a.seed)
        else:
            os.makedirs(a.out, exist_ok=True)
            for v in variants:
                serve(a.ckpt, os.path.join(a.out, f"{v}.safetensors"), v, a.n, a.seed)
        return
    print(__doc__, file=sys.stderr)
    sys.exit(2)


if __name__ == "__main__":
    main()
