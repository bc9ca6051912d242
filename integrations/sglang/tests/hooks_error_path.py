#!/usr/bin/env python3
"""The hook package's error path (crates/engy-core/tests/cells_hooks.rs runs it): a request
directory deleted under the serve in the middle of a forward pass (a miner's spool cleanup,
an operator's ``rm``) must not break the pass.

On the sglang-shaped tiny model (tests/sglang_shaped.py, hooks registered from the
``--forward-hooks`` specs by sglang's rule), a request is a chunked prefill of two passes;
a forward hook on the last MoE block deletes the request's directory during the second:

* serve default (``strict`` off): the pass returns the model's own output, the failure is
  logged, and the next request is captured whole in a new directory;
* ``strict`` on: the pass raises the capture's own error (writing ``cells.bin``), not one
  from the error handling (rewriting the gone manifest);
* the whole spool deleted between requests: the next request recreates it.

    PYTHONPATH=integrations/sglang/src $ENGY_CELLS_PYTHON hooks_error_path.py --out DIR
Exit status: 0 ok, 1 a check failed.
"""
import argparse
import json
import logging
import os
import shutil
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from engy_cells import hooks  # noqa: E402
from sglang_shaped import CausalLMLike, register_like_sglang  # noqa: E402

SEQ = 7


class Records(logging.Handler):
    """Keeps the engy_cells logger's records."""

    def __init__(self):
        super().__init__()
        self.records = []

    def emit(self, record):
        self.records.append(record.getMessage())


def manifest(spool, req):
    path = os.path.join(spool, req, "manifest.json")
    return json.load(open(path)) if os.path.isfile(path) else None


def setup(out, name, seed, strict):
    model = CausalLMLike(seed).eval()
    spool = os.path.join(out, name)
    specs = json.loads(json.dumps(hooks.sglang_forward_hooks(spool)))
    for s in specs:
        s["config"]["strict"] = strict
    register_like_sglang(model, specs)
    ids = torch.randint(0, model.config["vocab"], (SEQ,), generator=torch.Generator().manual_seed(seed + 11))
    return model, spool, ids


def deleter_on_last_block(model, path):
    """A forward hook on the last MoE block that deletes `path` (returns None: the block's
    output is unchanged)."""
    return model.model.layers[-1].mlp.register_forward_hook(lambda m, i, o: shutil.rmtree(path))


def serve_default(out, seed, logs):
    fails = []
    model, spool, ids = setup(out, "vanish", seed, strict=False)
    plain = CausalLMLike(seed).eval()
    with torch.no_grad():
        model(ids[:4], torch.arange(0, 4))
        handle = deleter_on_last_block(model, os.path.join(spool, "req-000001"))
        try:
            got = model(ids[4:], torch.arange(4, SEQ))
        except Exception as e:  # the bug: the error handling raised out of the pass
            return [f"the pass raised {type(e).__name__}: {e}"]
        finally:
            handle.remove()
        if not torch.equal(got, plain(ids[4:], torch.arange(4, SEQ))):
            fails.append("the pass's output differs from the model's own")
        if not any("req-000001" in r for r in logs.records):
            fails.append(f"no log line names the vanished request: {logs.records}")
        model(ids, torch.arange(0, SEQ))
    man = manifest(spool, "req-000002")
    if man is None or man["error"] or man["n_cells"] != SEQ * len(model.config["moe_layers"]):
        fails.append(f"the next request was not captured whole: {man}")
    print(f"vanish: a request directory deleted mid-pass: pass ok, next request {man and man['n_cells']} cells")
    return fails


def strict(out, seed):
    model, spool, ids = setup(out, "vanish-strict", seed, strict=True)
    with torch.no_grad():
        model(ids[:4], torch.arange(0, 4))
        deleter_on_last_block(model, os.path.join(spool, "req-000001"))
        try:
            model(ids[4:], torch.arange(4, SEQ))
        except OSError as e:
            name = os.path.basename(e.filename or "")
            print(f"vanish (strict): raised {type(e).__name__} on {name}")
            return [] if name == "cells.bin" else [f"raised the error handling's {e!r}, not the capture's"]
    return ["strict: the pass did not raise"]


def spool_gone(out, seed):
    model, spool, ids = setup(out, "vanish-spool", seed, strict=True)
    with torch.no_grad():
        model(ids[:3], torch.arange(0, 3))
        shutil.rmtree(spool)
        model(ids, torch.arange(0, SEQ))
    man = manifest(spool, "req-000002")
    print(f"vanish (spool): the next request wrote {man and man['n_cells']} cells")
    if man is None or man["error"] or man["n_cells"] != SEQ * len(model.config["moe_layers"]):
        return [f"the next request after the spool was deleted: {man}"]
    return []


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--seed", type=int, default=5)
    a = ap.parse_args()
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    logs = Records()
    logging.getLogger("engy_cells").addHandler(logs)
    fails = serve_default(a.out, a.seed, logs) + strict(a.out, a.seed) + spool_gone(a.out, a.seed)
    print("hooks error path: " + ("ok" if not fails else "FAILED"))
    for f in fails:
        print(f"  {f}")
    return 0 if not fails else 1


if __name__ == "__main__":
    sys.exit(main())
