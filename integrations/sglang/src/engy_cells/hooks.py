"""Forward hooks that capture engy-cells/v2 cells into a spool directory.

One capture state per spool directory is shared by five hook roles:

* ``block``  on each MoE block (sglang/transformers ``model.layers.{i}.mlp``): ``x`` (its
  first positional input) and ``y`` (its output, shared experts and routed scaling
  included: what the block returns). Modules without ``experts`` and ``gate`` (a dense MLP
  matched by the same pattern, e.g. GLM-5's first ``first_k_dense_replace`` layers) are
  ignored.
* ``router`` on the block's router (``…mlp.gate``): the router logits (the output, or its
  first element: sglang's Qwen ``ReplicatedLinear`` returns ``(logits, bias)``, sglang's
  DeepSeek-style ``MoEGate`` (DeepSeek-V3, GLM-5: ``glm_moe_dsa``) returns the logits alone,
  f32 or bf16 as its GEMM gives them; transformers' ``Qwen3MoeTopKRouter`` /
  ``Qwen3_5MoeTopKRouter`` / ``GlmMoeDsaTopkRouter`` return ``(logits, weights, ids)``; the
  ids are taken from the third element when present). The logits are the pre-activation
  ``W_r·x``: the sigmoid, ``e_score_correction_bias``, the group limit (``n_group``,
  ``topk_group``) and ``routed_scaling_factor`` of a DeepSeek-style router are the
  verifier's to apply (specs/CELLS.md), never the capture's.
* ``topk``   on sglang's ``TopK`` module (``…mlp.topk``): ``topk_ids`` of its output. With
  sglang's shared-experts fusion the ids carry the fused shared expert(s) as extra columns
  with ids ``≥ n_experts`` (the router's width); those are dropped, so a cell's ids are the
  ``top_k`` routed experts either way.
* ``tokens`` on the token embedding (``…embed_tokens``): the pass's input ids.
* ``pass``   on the decoder stack (``model``): the end of one forward pass; the pass's
  cells are written then.

sglang's ``--forward-hooks`` calls a factory once per spec with the spec's ``config`` and
registers the returned hook on every module the spec's ``target_modules`` (fnmatch
patterns over ``named_modules()``) match; :func:`hook_factory` is that factory and
:func:`sglang_forward_hooks` writes the specs. :func:`attach` applies the same specs to a
transformers model.

Spool layout (one commit pass = one request): ``SPOOL/req-NNNNNN/cells.bin`` (cells back
to back in leaf order: position-major, then layer) and ``manifest.json`` (scheme, shape,
``cells_root`` (over the shape and ``tokens_sha256``; absent when the ``tokens`` hook saw
no ids), ``tree_root``, ``tokens_sha256``, ``error``), rewritten atomically after
every pass; ``SPOOL/latest`` names the newest request directory.
"""
import fnmatch
import hashlib
import json
import logging
import os
import re
import sys

import torch

from . import format as fmt

log = logging.getLogger("engy_cells")
SPOOL_ENV = "ENGY_CELLS_SPOOL"
ROLES = ("block", "router", "topk", "tokens", "pass")
_STATES = {}

if sys.byteorder != "little":  # the canonical bytes are the tensors' own little-endian bytes
    raise ImportError("engy_cells needs a little-endian host")


def _le_bytes(t):
    """Raw little-endian bytes of a contiguous CPU tensor."""
    t = t.contiguous()
    return t.view(torch.uint8).numpy().tobytes() if t.numel() else b""


def _rank0():
    d = torch.distributed
    return not (d.is_available() and d.is_initialized()) or d.get_rank() == 0


def _first_tensor(out):
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
        return out[0]
    return None


class Capture:
    """Capture state of one spool directory (see the module doc)."""

    def __init__(self, spool, strict=False):
        self.spool = os.path.abspath(spool)
        self.strict = strict
        os.makedirs(self.spool, exist_ok=True)
        self.seq = max([int(m.group(1)) for m in
                        (re.fullmatch(r"req-(\d+)", n) for n in os.listdir(self.spool)) if m],
                       default=0)
        self.pending_router = {}
        self.pending_topk = {}
        self.pass_cells = {}
        self.pass_tokens = None
        self.req = None

    # -- hooks ---------------------------------------------------------------------------
    def _guard(self, fn, *a):
        if not _rank0():
            return None
        try:
            fn(*a)
        except Exception as e:  # never break the serve's forward pass
            msg = f"{type(e).__name__}: {e}"
            log.error("engy_cells: %s (this request's cells are marked failed)", msg)
            if self.req is not None:
                self.req["error"] = self.req["error"] or msg
                self._mark_failed()
            if self.strict:
                raise
        return None

    def _mark_failed(self):
        """Rewrites the failed request's manifest; never raises (the error path must not
        break the pass it guards). The request directory may be gone, deleted under the
        serve (a miner's spool cleanup): then only the log says the request failed, and the
        miner, finding no manifest, has no cells of it to serve."""
        try:
            self._write_manifest()
        except Exception as e:
            log.error("engy_cells: %s: manifest not rewritten (%s: %s)", self.req["dir"], type(e).__name__, e)

    def router_hook(self, module, inputs, output):
        return self._guard(self._router, module, output)

    def topk_hook(self, module, inputs, output):
        return self._guard(self._topk, module, output)

    def block_hook(self, module, inputs, output):
        return self._guard(self._block, module, inputs, output)

    def tokens_hook(self, module, inputs, output):
        return self._guard(self._tokens, inputs)

    def pass_hook(self, module, inputs, output):
        return self._guard(self._pass, inputs)

    def _router(self, module, output):
        logits = _first_tensor(output)
        ids = None
        if isinstance(output, (tuple, list)) and len(output) >= 3 and isinstance(output[2], torch.Tensor) \
                and not output[2].is_floating_point():
            ids = output[2]
        self.pending_router[id(module)] = (logits.detach(), None if ids is None else ids.detach())

    def _topk(self, module, output):
        ids = getattr(output, "topk_ids", None)
        if ids is not None:
            self.pending_topk[id(module)] = ids.detach()

    def _tokens(self, inputs):
        if inputs and isinstance(inputs[0], torch.Tensor) and not inputs[0].is_floating_point():
            self.pass_tokens = inputs[0].detach().reshape(-1).to("cpu", torch.int64)

    def _block(self, module, inputs, output):
        gate = getattr(module, "gate", None)
        if gate is None or not hasattr(module, "experts"):
            return  # a dense MLP under the same name pattern
        layer = getattr(module, "_engy_cells_layer", None)
        if layer is None:
            layer = getattr(module, "layer_id", None)
        if layer is None:
            raise RuntimeError(f"{type(module).__name__} has no layer index (layer_id); use engy_cells.attach")
        x = inputs[0]
        y = _first_tensor(output)
        logits, ids = self.pending_router.pop(id(gate), (None, None))
        topk = getattr(module, "topk", None)
        if topk is not None and id(topk) in self.pending_topk:
            ids = self.pending_topk.pop(id(topk))
        if logits is None or ids is None:
            raise RuntimeError(f"layer {layer}: no router logits / expert ids captured (router and topk hooks)")
        ids = _routed_ids(ids, logits.shape[-1], layer)
        hidden = x.shape[-1]
        cpu = lambda t, dt: t.detach().reshape(-1, t.shape[-1]).to("cpu", dt)  # noqa: E731
        ldt = torch.bfloat16 if logits.dtype == torch.bfloat16 else torch.float32
        cell = (cpu(x, torch.bfloat16), cpu(logits, ldt), cpu(ids, torch.int64), cpu(y, torch.bfloat16))
        if cell[0].shape[0] != cell[3].shape[0] or cell[3].shape[1] != hidden:
            raise RuntimeError(f"layer {layer}: x {tuple(x.shape)} and y {tuple(y.shape)} differ")
        self.pass_cells[int(layer)] = cell

    # -- pass end: cells of this pass to the spool -------------------------------------------
    def _pass(self, inputs):
        cells, self.pass_cells = self.pass_cells, {}
        tokens, self.pass_tokens = self.pass_tokens, None
        self.pending_router.clear()
        self.pending_topk.clear()
        if not cells:
            return
        layers = sorted(cells)
        n = cells[layers[0]][0].shape[0]
        positions = None
        if len(inputs) >= 2 and isinstance(inputs[1], torch.Tensor) and not inputs[1].is_floating_point():
            p = inputs[1].detach().to("cpu", torch.int64)
            positions = p[0] if p.dim() == 2 else p.reshape(-1)  # mrope: 3 equal rows for text
        start = 0 if positions is None else int(positions[0])
        if positions is not None and not torch.equal(positions, torch.arange(start, start + n)):
            raise RuntimeError("pass positions are not one contiguous run: run one commit pass at a time")
        if start == 0 or self.req is None:
            self._new_request()
        req = self.req
        x0, lg0, id0, _ = cells[layers[0]]
        dtype = fmt.BF16 if lg0.dtype == torch.bfloat16 else fmt.F32
        shape = dict(hidden=x0.shape[1], n_experts=lg0.shape[1], top_k=id0.shape[1], logits_dtype=dtype)
        if req["shape"] is None:
            req["shape"] = dict(n_positions=0, layers=layers, **shape)
        s = req["shape"]
        if s["layers"] != layers or any(s[k] != v for k, v in shape.items()):
            raise RuntimeError(f"pass shape {layers} {shape} differs from the request's {s}")
        if start != s["n_positions"]:
            raise RuntimeError(f"pass starts at position {start}, the request has {s['n_positions']} "
                               "(prefix cache on? start the commit serve with --disable-radix-cache)")
        cols = [(l, [_rows(t) for t in cells[l]]) for l in layers]
        chunk = []
        for i in range(n):
            for layer, (x, lg, ids, y) in cols:
                b = fmt.encode_cell(start + i, layer, x[i], lg[i], dtype, ids[i], y[i])
                chunk.append(b)
                req["leaves"].append(fmt.cell_leaf(b))
        with open(os.path.join(req["dir"], "cells.bin"), "ab") as f:
            f.write(b"".join(chunk))
        s["n_positions"] += n
        if tokens is not None and tokens.numel() == n:
            req["tokens"].update(_le_bytes(tokens.to(torch.int32)))
        else:
            req["tokens"] = None
        req["passes"] += 1
        self._write_manifest()

    def _new_request(self):
        self.seq += 1
        d = os.path.join(self.spool, f"req-{self.seq:06d}")
        os.makedirs(d, exist_ok=True)
        open(os.path.join(d, "cells.bin"), "wb").close()
        self.req = dict(dir=d, shape=None, leaves=[], tokens=hashlib.sha256(), passes=0, error=None)
        _atomic(os.path.join(self.spool, "latest"), os.path.basename(d) + "\n")

    def _write_manifest(self):
        r = self.req
        s = r["shape"]
        doc = dict(scheme=fmt.SCHEME, request=os.path.basename(r["dir"]), shape=s, n_cells=len(r["leaves"]),
                   passes=r["passes"], error=r["error"],
                   tokens_sha256=None if r["tokens"] is None else r["tokens"].hexdigest())
        if s is not None and r["leaves"]:
            tree = fmt.mth(r["leaves"])
            doc.update(tree_root=tree.hex())
            if r["tokens"] is not None:  # engy-cells/v2: the root binds the pass's token ids
                bound = dict(s, tokens_sha256=r["tokens"].hexdigest())
                doc.update(cells_root=fmt.node(fmt.shape_leaf(**bound), tree).hex())
        _atomic(os.path.join(r["dir"], "manifest.json"), json.dumps(doc, indent=1) + "\n")


def _routed_ids(ids, n_experts, layer):
    """`ids` [T, k] without the columns of fused shared experts (ids ≥ `n_experts`, the
    router's width: sglang's shared-experts fusion appends them to every row)."""
    ids = ids.reshape(-1, ids.shape[-1])
    routed = ids < n_experts
    if bool(routed.all()):
        return ids
    per_row = routed.sum(dim=-1)
    if ids.shape[0] == 0 or not bool((per_row == per_row[0]).all()) or int(per_row[0]) == 0:
        raise RuntimeError(f"layer {layer}: expert ids at or above the router's {n_experts} experts "
                           "are not one fixed set of fused shared-expert columns")
    return ids[routed].reshape(ids.shape[0], int(per_row[0]))


def _rows(t):
    """Per-row little-endian bytes of a 2-D CPU tensor (ids: python ints)."""
    if t.dtype == torch.int64:
        return t.tolist()
    raw = _le_bytes(t)
    w = len(raw) // t.shape[0]
    return [raw[i * w:(i + 1) * w] for i in range(t.shape[0])]


def _atomic(path, text):
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def capture_for(spool=None, strict=False):
    """The shared :class:`Capture` of a spool directory (argument, else $ENGY_CELLS_SPOOL)."""
    spool = spool or os.environ.get(SPOOL_ENV)
    if not spool:
        raise ValueError(f"no spool directory: pass config.spool or set {SPOOL_ENV}")
    key = os.path.abspath(spool)
    if key not in _STATES:
        _STATES[key] = Capture(key, strict=strict)
    return _STATES[key]


def hook_factory(config):
    """sglang ``hook_factory``: ``config = {"role": ROLE, "spool": DIR (optional: else
    $ENGY_CELLS_SPOOL), "strict": bool}``; returns that role's forward hook."""
    role = config.get("role")
    if role not in ROLES:
        raise ValueError(f"engy_cells hook role {role!r}: one of {ROLES}")
    cap = capture_for(config.get("spool"), bool(config.get("strict", False)))
    return getattr(cap, f"{role}_hook")


def sglang_forward_hooks(spool=None, model="model"):
    """The ``--forward-hooks`` JSON list (Python objects) for a MoE on sglang: Qwen
    (``Qwen3MoeSparseMoeBlock``, ``Qwen3_5MoeSparseMoeBlock``) and DeepSeek-style
    (``DeepseekV2MoE``: DeepSeek-V3, GLM-5 ``glm_moe_dsa``) blocks have the same names
    (``model.layers.{i}.mlp`` with ``gate``, ``topk``, ``experts``); `model` is the name of
    the decoder stack module (``model`` for both)."""
    cfg = {} if spool is None else {"spool": spool}
    factory = "engy_cells.hooks:hook_factory"
    specs = [("router", ["*layers.*.mlp.gate"]), ("topk", ["*layers.*.mlp.topk"]),
             ("block", ["*layers.*.mlp"]), ("tokens", ["*embed_tokens"]), ("pass", [model])]
    return [dict(name=f"engy_cells_{role}", target_modules=t, hook_factory=factory,
                 config=dict(cfg, role=role)) for role, t in specs]


def attach(model, spool, strict=True, specs=None):
    """Registers the hooks on a transformers model as sglang's ``register_forward_hooks``
    would (fnmatch over ``named_modules()``, one factory call per spec), after giving each
    MoE block its decoder-layer index parsed from its name. Returns the hook handles."""
    specs = specs or sglang_forward_hooks(spool)
    for name, m in model.named_modules():
        hit = re.search(r"layers\.(\d+)\.mlp$", name)
        if hit:
            m._engy_cells_layer = int(hit.group(1))
    handles = []
    for spec in specs:
        hook = hook_factory(dict(spec["config"], spool=spool, strict=strict))
        for name, m in model.named_modules():
            if any(fnmatch.fnmatch(name, p) for p in spec["target_modules"]):
                handles.append(m.register_forward_hook(hook))
    return handles


def main(argv=None):
    """``python -m engy_cells.hooks SPOOL [MODEL]``: prints the --forward-hooks JSON."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(main.__doc__)
        return 0 if argv else 2
    print(json.dumps(sglang_forward_hooks(argv[0], *(argv[1:2] or []))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
