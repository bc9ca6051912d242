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

for t in sorted(CORPUS.iterdir()):
    print(f"{t.name}: {len(list(t.iterdir()))} seeds")
