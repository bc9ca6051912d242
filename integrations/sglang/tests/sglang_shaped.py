"""A tiny MoE model with sglang's module names and call signatures (our own code, following
sglang's qwen3_moe.py interfaces as integrations/sglang/README.md lists them), and sglang's
``--forward-hooks`` registration rule, so the hooks meet what they meet in a serve:

* ``model`` (the decoder stack): ``forward(input_ids, positions, forward_batch)`` with
  positional arguments, tokens flattened to ``[T]`` over the batch;
* ``model.layers.{i}.mlp``: dense MLP for layer 0, else a MoE block with ``layer_id``,
  ``forward(hidden_states [T, H], forward_batch)``;
* ``…mlp.gate``: a replicated linear returning ``(logits, bias)``;
* ``…mlp.topk``: returns a named tuple ``(topk_weights, topk_ids, router_logits)``, ids int32;
* ``…mlp.experts``: applies the chosen experts.

``style="deepseek"`` builds the DeepSeek-style block instead (sglang's ``DeepseekV2MoE``,
which serves DeepSeek-V3 and GLM-5 ``glm_moe_dsa``): ``…mlp.gate`` an f32 ``MoEGate``
returning the logits alone with an ``e_score_correction_bias``; ``…mlp.topk`` grouped
sigmoid top-k (``n_group``, ``topk_group``, the bias in the choice only, weights
renormalised, times ``routed_scaling_factor``) with the shared expert fused as an extra
column of id ``n_experts`` (sglang's shared-experts fusion), which ``…mlp.experts`` applies
as its expert ``n_experts``; ``…mlp.shared_experts`` the same shared expert as a module (it
is not called when fused: the fusion replaces it).

:func:`register_like_sglang` resolves ``hook_factory`` by import path, calls it once per spec
with the spec's ``config`` and registers the hook on every module whose name matches a
pattern with ``fnmatch`` (sglang ``hook_manager.register_forward_hooks``' documented rule).
"""
import fnmatch
import importlib
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

BF16 = torch.bfloat16


def _param(g, *shape):
    return nn.Parameter((torch.randn(*shape, generator=g) / shape[-1] ** 0.5).to(BF16))


class ReplicatedLinearLike(nn.Module):
    def __init__(self, g, n_in, n_out):
        super().__init__()
        self.weight = _param(g, n_out, n_in)

    def forward(self, x):
        return F.linear(x, self.weight), None


class TopKOutput(NamedTuple):
    topk_weights: torch.Tensor
    topk_ids: torch.Tensor
    router_logits: torch.Tensor


class TopKLike(nn.Module):
    def __init__(self, top_k):
        super().__init__()
        self.top_k = top_k

    def forward(self, hidden_states, router_logits):
        probs = torch.softmax(router_logits.float(), dim=-1)
        w, ids = torch.topk(probs, self.top_k, dim=-1)
        return TopKOutput(w / w.sum(-1, keepdim=True), ids.to(torch.int32), router_logits)


class ExpertsLike(nn.Module):
    def __init__(self, g, n_experts, hidden, inter):
        super().__init__()
        self.w13 = _param(g, n_experts, 2 * inter, hidden)
        self.w2 = _param(g, n_experts, hidden, inter)

    def forward(self, hidden_states, topk_output):
        out = torch.zeros_like(hidden_states, dtype=torch.float32)
        for t in range(hidden_states.shape[0]):
            for w, e in zip(topk_output.topk_weights[t], topk_output.topk_ids[t].tolist()):
                gate, up = F.linear(hidden_states[t], self.w13[e]).chunk(2)
                out[t] += w * F.linear(F.silu(gate) * up, self.w2[e]).float()
        return out.to(hidden_states.dtype)


class MoeBlockLike(nn.Module):
    def __init__(self, g, layer_id, hidden, n_experts, top_k, inter):
        super().__init__()
        self.layer_id = layer_id
        self.gate = ReplicatedLinearLike(g, hidden, n_experts)
        self.topk = TopKLike(top_k)
        self.experts = ExpertsLike(g, n_experts, hidden, inter)

    def forward(self, hidden_states, forward_batch=None):
        router_logits, _ = self.gate(hidden_states)
        return self.experts(hidden_states, self.topk(hidden_states, router_logits))


class MoEGateLike(nn.Module):
    """sglang's DeepSeek-style ``MoEGate``: f32 weight and correction bias, returns logits."""

    def __init__(self, g, hidden, n_experts):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(n_experts, hidden, generator=g) / hidden ** 0.5)
        self.e_score_correction_bias = nn.Parameter(0.05 * torch.randn(n_experts, generator=g))

    def forward(self, hidden_states, forward_batch=None):
        return F.linear(hidden_states.float(), self.weight)


class GroupedTopKLike(nn.Module):
    """DeepSeek-V3's grouped sigmoid top-k with the fused shared expert as one more column."""

    def __init__(self, top_k, n_group, topk_group, correction_bias, scale, n_experts):
        super().__init__()
        self.top_k, self.n_group, self.topk_group = top_k, n_group, topk_group
        self.correction_bias, self.scale, self.n_experts = correction_bias, scale, n_experts

    def forward(self, hidden_states, router_logits):
        scores = router_logits.float().sigmoid()
        choice = scores + self.correction_bias
        t = choice.shape[0]
        group_scores = choice.view(t, self.n_group, -1).topk(2, dim=-1)[0].sum(-1)
        groups = group_scores.topk(self.topk_group, dim=-1)[1]
        mask = torch.zeros_like(group_scores).scatter_(1, groups, 1.0)
        mask = mask.unsqueeze(-1).expand(t, self.n_group, self.n_experts // self.n_group).reshape(t, -1)
        ids = choice.masked_fill(mask == 0, float("-inf")).topk(self.top_k, dim=-1)[1]
        w = scores.gather(1, ids)
        w = w / w.sum(-1, keepdim=True) * self.scale
        shared = torch.full((t, 1), self.n_experts, dtype=ids.dtype)
        return TopKOutput(torch.cat([w, torch.ones(t, 1)], -1), torch.cat([ids, shared], -1).to(torch.int32),
                          router_logits)


class DeepseekMoeLike(nn.Module):
    def __init__(self, g, layer_id, hidden, n_experts, top_k, inter, n_group=2, topk_group=1, scale=2.5):
        super().__init__()
        self.layer_id = layer_id
        self.gate = MoEGateLike(g, hidden, n_experts)
        self.topk = GroupedTopKLike(top_k, n_group, topk_group, self.gate.e_score_correction_bias.data, scale,
                                    n_experts)
        self.experts = ExpertsLike(g, n_experts + 1, hidden, inter)  # the last: the fused shared expert
        self.shared_experts = DenseMlpLike(g, hidden, inter)

    def forward(self, hidden_states, forward_batch=None, should_allreduce_fusion=False):
        router_logits = self.gate(hidden_states)
        return self.experts(hidden_states, self.topk(hidden_states, router_logits))


class DenseMlpLike(nn.Module):
    def __init__(self, g, hidden, inter):
        super().__init__()
        self.up = _param(g, inter, hidden)
        self.down = _param(g, hidden, inter)

    def forward(self, hidden_states, forward_batch=None):
        return F.linear(F.silu(F.linear(hidden_states, self.up)), self.down)


class LayerLike(nn.Module):
    def __init__(self, mlp):
        super().__init__()
        self.mlp = mlp

    def forward(self, positions, hidden_states, forward_batch):
        return hidden_states + self.mlp(F.rms_norm(hidden_states, hidden_states.shape[-1:]), forward_batch)


class StackLike(nn.Module):
    def __init__(self, g, vocab, hidden, layers):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, hidden, dtype=BF16)
        with torch.no_grad():
            self.embed_tokens.weight.copy_(torch.randn(vocab, hidden, generator=g))
        self.layers = nn.ModuleList(layers)

    def forward(self, input_ids, positions, forward_batch):
        h = self.embed_tokens(input_ids)
        for layer in self.layers:
            h = layer(positions, h, forward_batch)
        return h


class CausalLMLike(nn.Module):
    def __init__(self, seed, vocab=64, hidden=32, n_layers=3, n_experts=6, top_k=2, inter=16, style="qwen"):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        block = {"qwen": MoeBlockLike, "deepseek": DeepseekMoeLike}[style]
        layers = [LayerLike(DenseMlpLike(g, hidden, inter))]
        layers += [LayerLike(block(g, i, hidden, n_experts, top_k, inter)) for i in range(1, n_layers)]
        self.model = StackLike(g, vocab, hidden, layers)
        self.config = dict(vocab=vocab, hidden=hidden, n_experts=n_experts, top_k=top_k,
                           moe_layers=list(range(1, n_layers)))

    def forward(self, input_ids, positions):
        return self.model(input_ids, positions, None)


def register_like_sglang(model, specs):
    """sglang's registration rule for ``--forward-hooks`` specs; returns the handles."""
    handles = []
    for spec in specs:
        mod_name, fn_name = spec["hook_factory"].split(":", 1)
        hook = getattr(importlib.import_module(mod_name), fn_name)(spec.get("config") or {})
        for name, m in model.named_modules():
            if any(fnmatch.fnmatch(name, p) for p in spec["target_modules"]):
                handles.append(m.register_forward_hook(hook))
    return handles
