"""What one teacher-forced pass over a checkpoint costs at least: FLOPs and bytes, and the floor
they set on a GPU (issue 42 item 5; docs/AUDITOR.md "On a GPU").

    python3 bench/gpu/pass_cost.py CHECKPOINT_DIR TOKENS [SECONDS ...]

Reads only `config.json` and the safetensors headers (no weights). Prints one JSON line:
`flops` (per pass), `weight_bytes` (every weight the pass multiplies, read once from device
memory as bf16: 2 bytes a parameter, what a resident bf16 recompute and transformers' bf16
model hold), `floor_s` (the larger of FLOPs at the GPU's dense bf16 peak and the weight bytes
at its memory bandwidth), and for each SECONDS given the achieved TFLOP/s and its share of
the peak. `gpu`: the name torch reports (or `ENGY_GPU_NAME`), which picks the peak from
PEAKS; an unknown GPU gets no floor.

What is counted (T tokens, causal attention counted as half the square):
- every 2-D weight of a decoder layer as a product `2 · T · out · in`; a routed expert's
  weights only for the tokens routed to it, `2 · T · k/E · out · in` summed over experts
  (each token runs k of the E experts); the embedding is a gather (no FLOPs), the LM head is
  not run (the audit compares the final hidden states);
- softmax attention: `q·kᵀ` and `p·v`, `2 · T²/2 · heads · (d_qk + d_v)`;
  GLM's MLA with its DSA indexer: attention over the kept `min(T, index_topk)` keys a query,
  `2 · T · keys · heads · (d_qk + d_v)` with keys the mean causal count `min(topk, t)`, and
  the indexer's scores `2 · T²/2 · index_heads · index_head_dim`;
- Gated DeltaNet (chunked, chunk C = 64, per value head with key width dk and value width dv):
  the state's read and update `4 · T · dk · dv`, the chunk's intra products
  `2 · T · C · (dk + dv)` and the output's `2 · T · dk · dv`;
- element-wise work (norms, activations, rotary, routing) is left out: it is bandwidth, and
  small beside the above.
Bytes count the weights alone: activations at 4,096 tokens are a few hundred MB a pass and
stay mostly in L2 or move once per kernel; the floor is a floor.
"""
import json
import os
import struct
import sys

# Dense bf16 tensor-core peak (TFLOP/s, without sparsity) and memory bandwidth (TB/s), from
# NVIDIA's data sheets (H100 SXM5, H200 SXM; the PCIe / NVL parts are lower).
PEAKS = {
    "H100 80GB HBM3": (989.0, 3.35),
    "H100": (989.0, 3.35),
    "H200": (989.0, 4.8),
}


def headers(ckpt):
    """name -> shape of every tensor of every `*.safetensors` in CKPT."""
    out = {}
    for f in sorted(os.listdir(ckpt)):
        if not f.endswith(".safetensors"):
            continue
        with open(os.path.join(ckpt, f), "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            h = json.loads(fh.read(n))
        for name, meta in h.items():
            if name != "__metadata__":
                out[name] = meta["shape"]
    return out


def gpu_name():
    name = os.environ.get("ENGY_GPU_NAME")
    if name:
        return name
    try:
        import torch

        if torch.cuda.is_available():
            return torch.cuda.get_device_name(0)
    except Exception:  # torch missing or no GPU: no floor
        pass
    return "unknown"


def peak_of(name):
    for key, v in PEAKS.items():
        if key in name:
            return v
    return None


def cost(ckpt, tokens):
    cfg = json.load(open(os.path.join(ckpt, "config.json")))
    text = cfg.get("text_config", cfg)
    T = float(tokens)
    experts = text.get("num_experts") or text.get("n_routed_experts") or 0
    k = text.get("num_experts_per_tok") or 0
    flops = 0.0
    params = 0
    for name, shape in headers(ckpt).items():
        if ".layers." not in name or "conv1d" in name or "norm" in name:
            continue
        if len(shape) == 3 and ".experts." in name:
            # A fused stack [E, out, in] (gate_up_proj / down_proj): k of E a token.
            e, out_f, in_f = shape
            params += e * out_f * in_f
            flops += 2.0 * T * k * out_f * in_f
            continue
        if len(shape) != 2 or not name.endswith(".weight"):
            continue
        out_f, in_f = shape
        params += out_f * in_f
        routed = ".experts." in name and "shared" not in name
        share = (k / experts) if routed and experts else 1.0
        flops += 2.0 * T * share * out_f * in_f
    layers = text["num_hidden_layers"]
    mt = text.get("model_type", "")
    if mt.startswith("qwen3_5_moe") or mt.startswith("qwen3_next"):
        interval = text.get("full_attention_interval", 4)
        types = text.get("layer_types") or [
            "full_attention" if (i + 1) % interval == 0 else "linear_attention"
            for i in range(layers)
        ]
        heads, hd = text["num_attention_heads"], text.get("head_dim", 256)
        vh = text["linear_num_value_heads"]
        dk, dv = text["linear_key_head_dim"], text["linear_value_head_dim"]
        for t in types[:layers]:
            if t == "full_attention":
                flops += 2.0 * T * T / 2 * heads * (hd + hd)
            else:
                flops += vh * (4 * T * dk * dv + 2 * T * 64 * (dk + dv) + 2 * T * dk * dv)
    elif mt == "glm_moe_dsa":
        heads = text["num_attention_heads"]
        dqk = text["qk_nope_head_dim"] + text["qk_rope_head_dim"]
        dv = text["v_head_dim"]
        topk = text.get("index_topk", 2048)
        ih, ihd = text.get("index_n_heads", 32), text.get("index_head_dim", 128)
        keys = sum(min(topk, t + 1) for t in range(int(T))) / T
        flops += layers * (
            2.0 * T * keys * heads * (dqk + dv) + 2.0 * T * T / 2 * ih * ihd
        )
    elif mt == "qwen3_moe":
        heads, hd = text["num_attention_heads"], text.get("head_dim", 128)
        flops += layers * 2.0 * T * T / 2 * heads * (hd + hd)
    return flops, 2 * params


def main():
    if len(sys.argv) < 3:
        print(__doc__, file=sys.stderr)
        sys.exit(2)
    ckpt, tokens = sys.argv[1], int(sys.argv[2])
    seconds = [float(s) for s in sys.argv[3:] if s not in ("", "nan")]
    flops, wbytes = cost(ckpt, tokens)
    gpu = gpu_name()
    peak = peak_of(gpu)
    line = {"tokens": tokens, "flops": flops, "tflop": round(flops / 1e12, 2),
            "weight_bytes": wbytes, "weight_gb": round(wbytes / 1e9, 1), "gpu": gpu}
    if peak:
        tf, bw = peak
        line["peak_tflops"] = tf
        line["bandwidth_tbs"] = bw
        line["floor_s"] = round(max(flops / (tf * 1e12), wbytes / (bw * 1e12)), 4)
    line["achieved"] = [
        {"seconds": s, "tflops": round(flops / s / 1e12, 1),
         "share_of_peak": round(flops / s / (peak[0] * 1e12), 3) if peak else None}
        for s in seconds
    ]
    print(json.dumps(line))


if __name__ == "__main__":
    main()
