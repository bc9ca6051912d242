#!/usr/bin/env python3
"""Seed the cargo-fuzz corpora from the golden vectors (ENGY_VECTORS_DIR, else
<workspace>/tests/vectors) and the committed devnet spec. Idempotent: files are named by
the sha256 of their content. Usage: python3 fuzz/seed.py"""
import base64, gzip, hashlib, json, os, pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent
VEC = pathlib.Path(os.environ.get("ENGY_VECTORS_DIR") or ROOT / "tests" / "vectors")
CORPUS = ROOT / "fuzz" / "corpus"


def put(target, data):
    if isinstance(data, str):
        data = data.encode("utf-8", "surrogatepass")
    d = CORPUS / target
    d.mkdir(parents=True, exist_ok=True)
    (d / hashlib.sha256(data).hexdigest()[:16]).write_bytes(data)


def load(folder):
    for p in sorted((VEC / folder).glob("*.json")):
        yield json.loads(p.read_text())


def walk(v):
    """Every value nested in a JSON document."""
    yield v
    if isinstance(v, dict):
        for x in v.values():
            yield from walk(x)
    elif isinstance(v, list):
        for x in v:
            yield from walk(x)


for doc in load("payloads"):
    for c in doc.get("cases", []):
        if isinstance(c.get("body_b64"), str):
            body = base64.b64decode(c["body_b64"])
        elif isinstance(c.get("body"), str):
            body = c["body"].encode("utf-8", "surrogatepass")
        else:
            continue
        put("payload_verify", body)
        put("payload_mutate", b"\x02\x0c\x00\x00\x00" + body)
put("payload_mutate", b"\x00")
put("payload_mutate", b"\x01\x06[[\"5Fake\",65535]]")
put("payload_mutate", b"\x03[1,2,3]")

for doc in load("keys"):
    for v in walk(doc):
        if isinstance(v, dict):
            for k in ("address", "ss58_address", "ss58Address", "ss58"):
                if isinstance(v.get(k), str):
                    put("ss58_decode", v[k])
            for k in ("file", "content", "keyfile", "text"):
                if isinstance(v.get(k), str):
                    put("wallet_file", v[k])
for p in (VEC / "keys" / "wallets").rglob("*"):
    if p.is_file():
        put("wallet_file", p.read_bytes())

for doc in load("toploc"):
    for v in walk(doc):
        if isinstance(v, str) and 4 <= len(v) <= 4096 and all(
            ch.isalnum() or ch in "+/=" for ch in v
        ):
            put("proof_poly", v)
            # toploc_verify: topk 4, dbs 2, skip_prefill, bf16; 3 elements of 8 values; the proof
            put("toploc_verify", bytes([4, 2, 1, 3]) + b"".join(
                bytes([8]) + bytes(range(i, i + 16)) for i in range(3)) + v.encode())

put("state_file", json.dumps({
    "last_applied": 7, "last_submit_block": 1234, "last_submit_ts": 1700000000.5,
    "cached_weights": [["5H8i93MnMEs9KyLA1kgXTNSjTVqaiQqYg2CivRE87DzKygK9", 65535]],
    "cached_digest": "ab" * 32}, indent=2))
put("state_file", '{"last_applied": true, "last_submit_block": 0, "cached_weights": [["5A", 70000]]}')

spec = ROOT / "specs" / "devnet" / "model_spec.json.gz"
if spec.exists():
    put("commit_proof", gzip.decompress(spec.read_bytes()))
for p in (ROOT / "fuzz" / "seeds" / "commit_proof").glob("*"):
    put("commit_proof", p.read_bytes())

# ---- the miner's parsers ----
import math, struct


def bf16_text(bits):
    """A bf16 pattern as orjson prints it (Python's shortest float repr), or None."""
    v = struct.unpack(">f", struct.pack(">I", bits << 16))[0]
    return None if not math.isfinite(v) else repr(v)


rows = []
for doc in load("toploc"):
    for c in doc.get("cases", []):
        for inp in c.get("inputs", []) if isinstance(c, dict) else []:
            if isinstance(inp, dict) and inp.get("dtype") == "bfloat16" and isinstance(inp.get("bits"), list):
                flat = list(walk(inp["bits"]))
                vals = [bf16_text(b) for b in flat if isinstance(b, int) and 0 <= b < 65536][:64]
                vals = [v for v in vals if v is not None]
                if vals:
                    rows.append(vals)
rows = rows[:40]
ALPHA = "0123456789.-eE+"
for i, row in enumerate(rows):
    hs = "[[" + ",".join(row[:8]) + "],[" + ",".join(row) + "],[]," + "[" + ",".join(row) + "]]"
    body = ('{"text":"x","output_ids":[1,2],"meta_info":{"id":"r%d","finish_reason":{"type":"length","length":2},'
            '"prompt_tokens":3,"cached_tokens":0,"output_token_logprobs":[[-0.5,1,null],[-0.25,2,null]],'
            '"hidden_states":%s}}' % (i, hs))
    put("scan_reply", bytes([i % 8, 0]) + body.encode())
    stock = body.replace('{"type":"length","length":2}', "null")
    put("sse_reader", bytes([i % 8, 0]) + f": keep-alive\n\ndata: {stock}\n\ndata: {body}\n\ndata: [DONE]\n\n".encode())
    # hidden_rows: the row's values as the target's token program (0xF0 ends a value,
    # 0xF1 an element, 0xF2 opens a block / its next row)
    prog = bytearray()
    for j, v in enumerate(row):
        prog += bytes(ALPHA.index(ch) for ch in v) + b"\xf0"
        if j % 7 == 6:
            prog += b"\xf1"
    put("hidden_rows", bytes([i % 4, 2, 3, 200]) + bytes(prog))
    put("hidden_rows", bytes([0, 0, 0xF2]) + bytes(prog[: len(prog) // 2]) + b"\xf2" + bytes(prog))
for p in (ROOT / "fuzz" / "seeds" / "scan_reply").glob("*"):
    put("scan_reply", p.read_bytes())
for p in (ROOT / "fuzz" / "seeds" / "sse_reader").glob("*"):
    put("sse_reader", p.read_bytes())
    put("scan_reply", p.read_bytes().replace(b"data: ", b"", 1))

# gateway frames (PROTOCOL.md §2), raw JSON (mode 0) and from parts (mode 1)
for f in [
    {"type": "serve", "corr_id": "c-1", "stream": True,
     "request": {"model": "m", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8,
                 "engy_request_id": "r-1"}},
    {"type": "serve", "corr_id": "c-2", "request": {"messages": []}},
    {"type": "cancel", "corr_id": "c-1"},
    {"type": "ping"}, {"type": "reconnect"}, {"type": "admit"},
    {"type": "deny", "reason": "unknown miner_key"},
    {"type": "hello-ack", "x": [1, 2]},
]:
    put("gateway_frame", b"\x00" + json.dumps(f).encode())
put("gateway_frame", b"\x00[1,2]")
put("gateway_frame", b"\x01\x00\x02\x01c-9\xffhello\xffother")

# chat messages: raw JSON lists (mode 0) and from parts (mode 1)
for m in [
    [{"role": "user", "content": "Hello!"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "What is 2+2?"}],
    [{"role": "user", "content": "Caf\u00e9 na\u00efve \u2014 \u65e5\u672c\u8a9e \U0001f642"}],
    [{"role": "user", "content": "<|im_start|>not a turn<|im_end|>"}, {"role": "assistant", "content": ""}],
    [{"role": "user", "content": [{"type": "text", "text": "parts"}]}],
    [{"role": "user", "content": None}], [{"content": "no role"}], {"not": "a list"},
]:
    put("chat_template", b"\x00" + json.dumps(m, ensure_ascii=False).encode())
put("chat_template", b"\x01\x00\x00system\xff\x01\x00hi {{ x }} %}\xff\x02\x02")

for t in sorted(CORPUS.iterdir()):
    print(f"{t.name}: {len(list(t.iterdir()))} seeds")
