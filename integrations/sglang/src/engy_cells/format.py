"""The `engy-cells/v2` format (specs/CELLS.md) in plain Python: cell bytes, leaves, the
Merkle tree, inclusion paths, the shape leaf that binds the request's token ids, and the
challenge. Standard library only (hashlib, struct, math), so it is also the independent
implementation the Rust side (engy_core::cells) is checked against. `engy-cells/v1` is
retired.
"""
import hashlib
import math
import struct

SCHEME = "engy-cells/v2"
CELL_TAG = b"engy-cells/v2/cell"
SHAPE_TAG = b"engy-cells/v2/shape"
CHALLENGE_TAG = b"engy-cells/v2/challenge"
SEED_TAG = b"engy-cells/v2/seed"

BF16 = 1
F32 = 2
WIDTH = {BF16: 2, F32: 4}
HEADER = struct.Struct("<6I")
MAX_HIDDEN = 1 << 16
MAX_EXPERTS = 1 << 13
MAX_LAYERS = 1 << 10


class CellFormatError(ValueError):
    """Bytes or parts that are not a valid engy-cells/v2 cell."""


def _sha(*parts):
    h = hashlib.sha256()
    for p in parts:
        h.update(p)
    return h.digest()


def lp(b):
    """u64le(len(b)) || b"""
    return struct.pack("<Q", len(b)) + b


def _check_sizes(hidden, n_experts, top_k):
    if not 1 <= hidden <= MAX_HIDDEN:
        raise CellFormatError(f"hidden {hidden} not in 1..={MAX_HIDDEN}")
    if not 1 <= n_experts <= MAX_EXPERTS:
        raise CellFormatError(f"n_experts {n_experts} not in 1..={MAX_EXPERTS}")
    if not 1 <= top_k <= n_experts:
        raise CellFormatError(f"top_k {top_k} not in 1..={n_experts}")


def _bf16_finite(b):
    """Index of the first NaN/inf among little-endian bf16 values, or None."""
    for i, (v,) in enumerate(struct.iter_unpack("<H", bytes(b))):
        if v & 0x7F80 == 0x7F80:
            return i
    return None


def _check_finite(x, logits, logits_dtype, y):
    bad = _bf16_finite(x)
    if bad is not None:
        raise CellFormatError(f"non-finite x value at {bad}")
    if logits_dtype == BF16:
        bad = _bf16_finite(logits)
    else:
        bad = next((i for i, (v,) in enumerate(struct.iter_unpack("<f", bytes(logits)))
                    if not math.isfinite(v)), None)
    if bad is not None:
        raise CellFormatError(f"non-finite router_logits value at {bad}")
    bad = _bf16_finite(y)
    if bad is not None:
        raise CellFormatError(f"non-finite y value at {bad}")


def tokens_sha256(ids):
    """SHA-256 of the token ids as u32le back to back (the shape's tokens_sha256), hex."""
    return hashlib.sha256(struct.pack(f"<{len(ids)}I", *ids)).hexdigest()


def encode_cell(position, layer, x, logits, logits_dtype, expert_ids, y):
    """Canonical bytes of one cell.

    x, y: little-endian bf16 bytes (2·hidden each); logits: little-endian bytes of
    n_experts values of `logits_dtype` (BF16 or F32); expert_ids: ints in any order
    (stored ascending, must be distinct and < n_experts).
    """
    if logits_dtype not in WIDTH:
        raise CellFormatError(f"logits dtype code {logits_dtype}")
    if len(x) != len(y) or len(x) % 2:
        raise CellFormatError(f"x has {len(x)} bytes, y {len(y)}")
    if len(logits) % WIDTH[logits_dtype]:
        raise CellFormatError(f"{len(logits)} logits bytes")
    hidden = len(x) // 2
    n_experts = len(logits) // WIDTH[logits_dtype]
    ids = sorted(int(e) for e in expert_ids)
    _check_sizes(hidden, n_experts, len(ids))
    if any(a >= b for a, b in zip(ids, ids[1:])) or ids[-1] >= n_experts or ids[0] < 0:
        raise CellFormatError(f"expert ids {ids} not distinct ids below {n_experts}")
    _check_finite(x, logits, logits_dtype, y)
    head = HEADER.pack(position, layer, hidden, n_experts, len(ids), logits_dtype)
    return b"".join([head, bytes(x), bytes(logits), struct.pack(f"<{len(ids)}I", *ids), bytes(y)])


def decode_cell(b, offset=0):
    """(dict, next_offset) of the cell at `offset` of `b`."""
    if len(b) - offset < HEADER.size:
        raise CellFormatError("truncated header")
    position, layer, hidden, n_experts, top_k, dt = HEADER.unpack_from(b, offset)
    if dt not in WIDTH:
        raise CellFormatError(f"logits dtype code {dt}")
    _check_sizes(hidden, n_experts, top_k)
    o = offset + HEADER.size
    end = o + 4 * hidden + WIDTH[dt] * n_experts + 4 * top_k
    if len(b) < end:
        raise CellFormatError("truncated cell")
    x = b[o:o + 2 * hidden]
    o += 2 * hidden
    logits = b[o:o + WIDTH[dt] * n_experts]
    o += WIDTH[dt] * n_experts
    ids = list(struct.unpack_from(f"<{top_k}I", b, o))
    o += 4 * top_k
    y = b[o:o + 2 * hidden]
    if any(a >= c for a, c in zip(ids, ids[1:])) or ids[-1] >= n_experts:
        raise CellFormatError(f"expert ids {ids}")
    _check_finite(x, logits, dt, y)
    return dict(position=position, layer=layer, hidden=hidden, n_experts=n_experts,
                top_k=top_k, logits_dtype=dt, x=x, logits=logits, expert_ids=ids, y=y), end


def decode_all(b):
    """Every cell of a spool file (cells back to back)."""
    out, o = [], 0
    while o < len(b):
        c, o = decode_cell(b, o)
        out.append(c)
    return out


def cell_leaf(cell_bytes):
    """SHA-256(0x00 || lp(CELL_TAG) || lp(cell_bytes))"""
    return _sha(b"\x00", lp(CELL_TAG), lp(cell_bytes))


def node(left, right):
    """SHA-256(0x01 || left || right)"""
    return _sha(b"\x01", left, right)


def _split(n):
    k = 1
    while k * 2 < n:
        k *= 2
    return k


def mth(items):
    """RFC 6962 Merkle tree hash over already-hashed leaves (lone last node carried up)."""
    if not items:
        return hashlib.sha256(b"").digest()
    if len(items) == 1:
        return items[0]
    k = _split(len(items))
    return node(mth(items[:k]), mth(items[k:]))


def inclusion_path(items, m):
    """RFC 9162 §2.1.3.1 audit path (siblings bottom-up) of items[m]."""
    if len(items) <= 1:
        return []
    k = _split(len(items))
    if m < k:
        return inclusion_path(items[:k], m) + [mth(items[k:])]
    return inclusion_path(items[k:], m - k) + [mth(items[:k])]


def shape_leaf(n_positions, layers, hidden, n_experts, top_k, logits_dtype, tokens_sha256):
    """SHA-256(0x00 || lp(SHAPE_TAG) || tokens_sha256 (32 bytes) || u32le n_positions, hidden,
    n_experts, top_k, logits_dtype, len(layers), layers...); `tokens_sha256` hex."""
    if not 1 <= len(layers) <= MAX_LAYERS or any(a >= b for a, b in zip(layers, layers[1:])):
        raise CellFormatError(f"layers {layers}")
    digest = bytes.fromhex(tokens_sha256)
    if len(digest) != 32:
        raise CellFormatError("tokens_sha256 is not 32 bytes")
    body = struct.pack("<6I", n_positions, hidden, n_experts, top_k, logits_dtype, len(layers))
    body += struct.pack(f"<{len(layers)}I", *layers)
    return _sha(b"\x00", lp(SHAPE_TAG), digest, body)


def cells_root(shape, leaves):
    """node(shape_leaf, MTH(leaves)); `shape` a dict with the CellShape fields (the seven of
    specs/CELLS.md §3, tokens_sha256 in hex)."""
    return node(shape_leaf(**shape), mth(leaves))


def production_seed(beacon, commitment_digest):
    """SHA-256(lp(SEED_TAG) || beacon || commitment_digest), both 32 bytes."""
    return _sha(lp(SEED_TAG), beacon, commitment_digest)


def select(seed, root, n_cells, n):
    """The n distinct leaf indices the 32-byte `seed` selects in the tree of `root`
    (SHA-256 counter mode, rejection sampling against modulo bias), in draw order."""
    if n > n_cells:
        raise ValueError(f"cannot select {n} of {n_cells}")
    if n == 0:
        return []
    limit = 2 ** 64 - (2 ** 64 % n_cells)
    chosen, seen, counter = [], set(), 0
    while len(chosen) < n:
        block = _sha(lp(CHALLENGE_TAG), seed, root, struct.pack("<Q", counter))
        counter += 1
        for j in range(4):
            (v,) = struct.unpack_from("<Q", block, 8 * j)
            if v >= limit:
                continue
            i = v % n_cells
            if i not in seen:
                seen.add(i)
                chosen.append(i)
                if len(chosen) == n:
                    break
    return chosen
