"""What the reverse serve scripts share: one checkpoint fill, one model_root, one way to draw
requests and to capture a serve's decode rows.

Used by honest_serves.py (transformers serves of the arch oracle's checkpoints),
variant_checkpoint.py (a tiny checkpoint of another shape) and w8a8_serves.py (W8A8 serves of
block-FP8 checkpoints), so that a row in tests/vectors means the same thing whichever script
wrote it. Imported with the scripts' folder on sys.path; torch only (transformers is the
caller's).
"""
import hashlib
import math
import os

import torch


def model_root(folder):
    """docs/PROTOCOL.md §4: sha256 of config.json's bytes, then of every *.safetensors file's
    name and decimal size, in name order (hex)."""
    h = hashlib.sha256(open(os.path.join(folder, "config.json"), "rb").read())
    for name in sorted(f for f in os.listdir(folder) if f.endswith(".safetensors")):
        h.update(name.encode())
        h.update(str(os.path.getsize(os.path.join(folder, name))).encode())
    return h.hexdigest()


def init_weights(model, seed):
    """The arch oracle's `realistic_init`, approximately (tests/vectors/arch/README.md): matrices
    N(0, 0.8/sqrt(fan_in)), routers 1.6/sqrt(hidden), embeddings 0.15, lm_head 0.05, norm gains
    1 + N(0, 0.1), GLM's e_score_correction_bias U(-0.08, 0.08), other biases 0.05, and two
    massive channels (layer 0's MLP output rows of them x20, later layers' pre-block norm gains
    on them 0.08). Draws from a generator seeded `seed + 7`; returns the massive channels."""
    g = torch.Generator().manual_seed(seed + 7)
    hidden = model.config.hidden_size
    massive = [int(x) for x in torch.randperm(hidden, generator=g)[:2]]
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("embed_tokens.weight"):
                p.normal_(0, 0.15, generator=g)
            elif name == "lm_head.weight":
                p.normal_(0, 0.05, generator=g)
            elif name.endswith("mlp.gate.weight"):
                p.normal_(0, 1.6 / math.sqrt(hidden), generator=g)
            elif name.endswith("e_score_correction_bias"):
                p.uniform_(-0.08, 0.08, generator=g)
            elif "norm" in name and p.dim() == 1:
                p.copy_(1 + torch.randn(p.shape, generator=g) * 0.1)
            elif p.dim() >= 2:
                p.normal_(0, 0.8 / math.sqrt(p.shape[-1]), generator=g)
            elif "bias" in name:
                p.normal_(0, 0.05, generator=g)
        layers = model.model.layers
        mlp = layers[0].mlp
        if hasattr(mlp, "down_proj"):
            mlp.down_proj.weight[massive, :] *= 20.0
        for layer in layers[1:]:
            layer.input_layernorm.weight[massive] = 0.08
            layer.post_attention_layernorm.weight[massive] = 0.08
    return massive


def draw_requests(vocab, n, seed):
    """n requests from `seed`: (prompts, news), each prompt 16 to 40 ids in [1, vocab), each
    output 64 to 160 new tokens."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(1, vocab, (int(torch.randint(16, 41, (1,), generator=g)),), generator=g).tolist()
               for _ in range(n)]
    news = [int(torch.randint(64, 161, (1,), generator=g)) for _ in range(n)]
    return prompts, news


class Serve:
    """Greedy serves of `model` with its final norm's outputs captured (f32, on the host):
    row j of a request is the hidden state that sampled its output id j (docs/PROTOCOL.md
    §3.10). `out` collects prompt_k, output_k (I64) and rows_k (F32 [N, hidden])."""

    def __init__(self, model, prompts, news, dev="cpu"):
        self.model, self.prompts, self.news, self.dev = model, prompts, news, dev
        self.steps = []
        self.out = {}
        model.model.norm.register_forward_hook(
            lambda m, i, o: self.steps.append(o.detach().to(torch.float32).cpu()))

    def generate(self, batch):
        """Requests `batch` (indices) in one left-padded batch, EOS off, each to its length."""
        prompts, news = self.prompts, self.news
        width = max(len(prompts[i]) for i in batch)
        ids = torch.zeros((len(batch), width), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for r, i in enumerate(batch):
            ids[r, width - len(prompts[i]):] = torch.tensor(prompts[i])
            mask[r, width - len(prompts[i]):] = 1
        self.steps.clear()
        m = max(news[i] for i in batch)
        with torch.no_grad():
            gen = self.model.generate(input_ids=ids.to(self.dev), attention_mask=mask.to(self.dev),
                                      max_new_tokens=m, min_new_tokens=m, do_sample=False,
                                      pad_token_id=0, eos_token_id=None).cpu()
        for r, i in enumerate(batch):
            self.out[f"prompt_{i}"] = torch.tensor(prompts[i], dtype=torch.int64)
            self.out[f"output_{i}"] = gen[r, width:width + news[i]].to(torch.int64).contiguous()
            self.out[f"rows_{i}"] = torch.stack([s[r, -1] for s in self.steps[:news[i]]]).contiguous()

    def teacher_forced(self):
        """Every generated request's rows again from one forward pass over prompt +
        output[:-1] (no KV cache), one sequence at a time: the `*_tf` variants."""
        for i in range(len(self.prompts)):
            p = self.prompts[i]
            ids = torch.cat([self.out[f"prompt_{i}"], self.out[f"output_{i}"][:-1]]).unsqueeze(0)
            self.steps.clear()
            with torch.no_grad():
                self.model(input_ids=ids.to(self.dev), use_cache=False)
            self.out[f"rows_{i}"] = self.steps[0][0, len(p) - 1:].contiguous()
