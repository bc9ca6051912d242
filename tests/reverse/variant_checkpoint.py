"""A tiny checkpoint of another shape and seed, for honest-serve runs on models engy's tests do not ship.

Takes a case folder of tests/vectors/arch (its config.json), applies config overrides given
as JSON, builds the model with transformers 5.24 from that config and fills it the way the arch
oracle's README describes its own `realistic_init` (case.json "init"): matrices normal with
std gain/sqrt(fan_in) (0.8), routers 1.6/sqrt(hidden), embeddings 0.15, lm_head 0.05, norm
gains 1 + N(0, 0.1), GLM's e_score_correction_bias U(-0.08, 0.08), and two massive channels
(layer 0's MLP output rows of them x20, later layers' pre-block norm gains on them 0.08). It is
an approximation of that generator, not a copy: the point is a model engy was never tuned on.
Saved in bf16 with save_pretrained; prints the folder's model_root (docs/PROTOCOL.md §4), which
commit_rows writes into commitments.

  $ENGY_TF5_PYTHON tests/reverse/variant_checkpoint.py tests/vectors/arch/glm_moe_dsa OUT SEED \
      '{"num_hidden_layers": 5, "index_topk": 16, ...}'

Then serve it with tests/reverse/honest_serves.py OUT … and audit with engy-audit audit
--checkpoint OUT. Exit 0, or 2 on a usage error.
"""
import json, os, sys, tempfile

import torch
from transformers import AutoConfig, AutoModelForCausalLM

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from serves_common import init_weights, model_root  # noqa: E402


def main():
    if len(sys.argv) not in (4, 5):
        print(__doc__, file=sys.stderr)
        sys.exit(2)
    case, out, seed = sys.argv[1], sys.argv[2], int(sys.argv[3])
    cfg = json.load(open(os.path.join(case, "config.json")))
    cfg.update(json.loads(sys.argv[4]) if len(sys.argv) == 5 else {})
    with tempfile.TemporaryDirectory() as tmp:
        json.dump(cfg, open(os.path.join(tmp, "config.json"), "w"))
        config = AutoConfig.from_pretrained(tmp)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    massive = init_weights(model, seed)
    model.to(torch.bfloat16).save_pretrained(out)
    print(f"{out}: model_root {model_root(out)} (massive channels {massive})")


if __name__ == "__main__":
    main()
