#!/usr/bin/env python3
"""Fixed engy-cells/v2 vectors from the Python implementation (engy_cells.format, stdlib
only): prints the JSON that tests/vectors/cells/vectors.json holds and that
crates/engy-core/tests/cells.rs recomputes in Rust.

    PYTHONPATH=integrations/sglang/src python3 integrations/sglang/tests/make_vectors.py > tests/vectors/cells/vectors.json
"""
import hashlib
import json
import os
import struct
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))
from engy_cells import format as fmt  # noqa: E402


def stream(tag, n):
    """n deterministic bytes: SHA-256(tag || u32le(i)) blocks."""
    out = b""
    i = 0
    while len(out) < n:
        out += hashlib.sha256(tag.encode() + struct.pack("<I", i)).digest()
        i += 1
    return out[:n]


def bf16s(tag, n):
    # finite bf16 values: random mantissa/sign, exponent kept in a normal range
    raw = stream(tag, 2 * n)
    vals = []
    for i in range(n):
        (v,) = struct.unpack_from("<H", raw, 2 * i)
        v = (v & 0x807F) | (((v >> 7) % 16 + 116) << 7)
        vals.append(v)
    return struct.pack(f"<{n}H", *vals)


def token_ids(cid, n):
    """n deterministic token ids below 151 936 (Qwen's vocabulary)."""
    raw = stream(cid + "/tokens", 4 * n)
    return [struct.unpack_from("<I", raw, 4 * i)[0] % 151936 for i in range(n)]


def case(cid, n_positions, layers, hidden, n_experts, top_k, dtype, seed_tag, n_select):
    tokens = token_ids(cid, n_positions)
    # tokens_sha256 by hashlib directly (u32le ids back to back), not through fmt
    digest = hashlib.sha256(b"".join(struct.pack("<I", t) for t in tokens)).hexdigest()
    assert digest == fmt.tokens_sha256(tokens)
    shape = dict(n_positions=n_positions, layers=layers, hidden=hidden, n_experts=n_experts,
                 top_k=top_k, logits_dtype=dtype, tokens_sha256=digest)
    cells, leaves = [], []
    for p in range(n_positions):
        for l in layers:
            tag = f"{cid}/{p}/{l}"
            x = bf16s(tag + "/x", hidden)
            y = bf16s(tag + "/y", hidden)
            if dtype == fmt.BF16:
                logits = bf16s(tag + "/logits", n_experts)
            else:
                raw = stream(tag + "/logits", 4 * n_experts)
                logits = struct.pack(f"<{n_experts}f", *[
                    (struct.unpack_from("<i", raw, 4 * i)[0] % 20000 - 10000) / 997.0
                    for i in range(n_experts)])
            order = sorted(range(n_experts), key=lambda e: stream(f"{tag}/ids/{e}", 4))
            ids = order[:top_k]  # in "score" order, not sorted: encoding sorts them
            b = fmt.encode_cell(p, l, x, logits, dtype, ids, y)
            leaves.append(fmt.cell_leaf(b))
            cells.append(dict(position=p, layer=l, x_hex=x.hex(), logits_hex=logits.hex(),
                              logits_dtype=dtype, expert_ids=ids, y_hex=y.hex(),
                              encoded_hex=b.hex(), leaf=leaves[-1].hex()))
    tree = fmt.mth(leaves)
    root = fmt.node(fmt.shape_leaf(**shape), tree)
    paths = [dict(index=i, siblings=[s.hex() for s in fmt.inclusion_path(leaves, i)])
             for i in range(len(leaves))]
    seed = hashlib.sha256(seed_tag.encode()).digest()
    return dict(id=cid, tokens=tokens, shape=shape, shape_leaf=fmt.shape_leaf(**shape).hex(), cells=cells,
                tree_root=tree.hex(), cells_root=root.hex(), paths=paths,
                challenge=dict(seed=seed.hex(), n=n_select,
                               indices=fmt.select(seed, root, len(leaves), n_select)))


def main():
    cases = [
        case("one-cell-bf16", 1, [0], 4, 4, 1, fmt.BF16, "seed-a", 1),
        case("three-positions-two-layers-bf16", 3, [1, 3], 8, 6, 2, fmt.BF16, "seed-b", 4),
        case("odd-tree-f32", 5, [0, 1, 2], 6, 5, 3, fmt.F32, "seed-c", 15),
    ]
    beacon = bytes(range(32))
    seed = dict(beacon=beacon.hex(), commitment_digest=(b"\xab" * 32).hex(),
                seed=fmt.production_seed(beacon, b"\xab" * 32).hex())
    print(json.dumps(dict(schema="engy-cells/vectors/v2", production_seed=seed,
                          produced_by="integrations/sglang/tests/make_vectors.py (engy_cells.format, hashlib)",
                          cases=cases), indent=1))


if __name__ == "__main__":
    main()
