"""How close can an independent f32 implementation get to the arch oracle's reference?

The arch oracle (tests/vectors/arch, README there) holds transformers' fp32 eager hidden
states. Its own f32 rounding noise bounds how often ANY other f32 implementation can round to
the same bf16 value: this script measures it. For each case folder it runs the same checkpoint
through transformers in float64 (the quantised weights dequantised exactly as the README says)
and reports, per sequence, the bf16 agreement and max abs error of
  * the reference (transformers fp32) against float64,
  * engy's f32 hidden states (crates/engy-model/examples/arch_hidden_states.rs) against float64,
  * engy against the reference (what crates/engy-model/tests/arch_vectors.rs asserts).

  ENGY_TF5_PYTHON=/path/venv/bin/python   # torch + transformers>=5.24 + safetensors
  $ENGY_TF5_PYTHON tests/reverse/arch_bf16_floor.py [--hidden-states BIN] CASE_DIR...

BIN defaults to target/release/examples/arch_hidden_states (build it with
`cargo build --release -p engy-model --example arch_hidden_states`). Prints a table; exit 0, or 2
on a usage or setup error. A measurement, not a pass/fail check: docs/AUDITOR.md quotes it.
"""
import argparse, json, os, shutil, subprocess, sys, tempfile

import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def dequantised_copy(case, out):
    """A copy of `case` with every quantised weight decoded to f32 and no quantization_config."""
    cfg = json.load(open(os.path.join(case, "config.json")))
    q = cfg.pop("quantization_config", None)
    if q is None:
        return case
    st = load_file(os.path.join(case, "model.safetensors"))
    res = {}
    for name, t in st.items():
        if name.endswith((".weight_scale_inv", ".weight_scale", ".weight_scale_2", ".input_scale")):
            continue
        if name + "_scale_inv" in st:  # block FP8: W = f32(q) * scale_inv[i // bn, j // bk]
            bn, bk = q.get("weight_block_size", [128, 128])
            s = st[name + "_scale_inv"].float()
            s = s.repeat_interleave(bn, 0)[: t.shape[0]].repeat_interleave(bk, 1)[:, : t.shape[1]]
            res[name] = t.float() * s
        elif name + "_scale" in st and t.dtype == torch.uint8:  # NVFP4, ModelOpt layout
            lo, hi = (t & 0xF).long(), (t >> 4).long()
            codes = torch.stack([lo, hi], -1).reshape(t.shape[0], -1)
            mag = torch.tensor(E2M1)[codes & 7]
            vals = torch.where(codes >= 8, -mag, mag)
            scale = st[name + "_scale"].float().repeat_interleave(16, 1)
            res[name] = (vals * scale) * st[name + "_scale_2"].float()
        else:
            res[name] = t
    os.makedirs(out, exist_ok=True)
    for f in os.listdir(case):
        if f.endswith(".json") and f not in ("config.json", "hf_quant_config.json", "case.json"):
            shutil.copy(os.path.join(case, f), out)
    json.dump(cfg, open(os.path.join(out, "config.json"), "w"))
    save_file(res, os.path.join(out, "model.safetensors"))
    return out


def bf16(x):
    return x.to(torch.float32).to(torch.bfloat16)


def agree(a, b):
    return 100.0 * (bf16(a) == bf16(b)).float().mean().item()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hidden-states", default="target/release/examples/arch_hidden_states")
    ap.add_argument("cases", nargs="+")
    a = ap.parse_args()
    if not os.access(a.hidden_states, os.X_OK):
        print(f"arch_bf16_floor: {a.hidden_states} is not an executable (build the example)", file=sys.stderr)
        return 2
    torch.set_num_threads(1)
    print("| case | seq | ref vs f64: bf16 equal, max abs | engy vs f64 | engy vs ref |")
    print("|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for case in a.cases:
            name = os.path.basename(os.path.normpath(case))
            ref_path = os.path.join(case, "reference.safetensors")
            ours_path = os.path.join(tmp, name + ".engy.safetensors")
            subprocess.run([a.hidden_states, case, ref_path, ours_path], check=True, stderr=subprocess.DEVNULL)
            ref, ours = load_file(ref_path), load_file(ours_path)
            model = AutoModelForCausalLM.from_pretrained(
                dequantised_copy(case, os.path.join(tmp, name)), dtype=torch.float64,
                attn_implementation="eager", experts_implementation="eager").eval()
            k = 0
            while f"input_ids_{k}" in ref:
                with torch.no_grad():
                    h64 = model.model(ref[f"input_ids_{k}"][None], use_cache=False).last_hidden_state[0]
                r, o = ref[f"hidden_{k}"], ours[f"hidden_{k}"]
                err = lambda x, y: (x.double() - y.double()).abs().max().item()
                print(f"| {name} | {k} | {agree(r, h64):.2f}%, {err(r, h64):.1e} | "
                      f"{agree(o, h64):.2f}%, {err(o, h64):.1e} | {agree(o, r):.2f}%, {err(o, r):.1e} |", flush=True)
                k += 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
