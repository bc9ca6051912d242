#!/usr/bin/env python3
"""Check a reverse_from_rust.json (schema engy-sn53/reverse/v1) with py-sr25519-bindings.

Every item was produced by the Rust engy-core. This script verifies, independently of
the Rust code:

* signatures: ``sr25519.verify(sig, message, public_key)`` equals ``expect_valid``;
* payloads: the epoch-payload checks of PROTOCOL.md section 6, in the order the
  payload vectors README gives, with the signature checked by py-sr25519-bindings;
  the body must also be strict JSON (no duplicate keys, no NaN);
* heartbeats: the canonical message is rebuilt from the headers, method, path and body
  and the X-Validator-Sig is verified against X-Validator-Hotkey; the body must be
  exactly what ``json.dumps(..., separators=(",", ":"))`` prints.

Usage: check_reverse.py FILE.json. Exit 0 when every item matches its expectation,
1 otherwise, 2 on a usage or input error.
"""
import hashlib
import json
import sys

import sr25519

SCHEMA = "engy-sn53/reverse/v1"
B58_ALPHABET = "123456789ABCDEFGHJKLMNPQRSTUVWXYZabcdefghijkmnopqrstuvwxyz"


def b58decode(text):
    value = 0
    for ch in text:
        idx = B58_ALPHABET.find(ch)
        if idx < 0:
            raise ValueError("not base58")
        value = value * 58 + idx
    raw = value.to_bytes((value.bit_length() + 7) // 8, "big")
    leading = len(text) - len(text.lstrip("1"))
    return b"\x00" * leading + raw


def ss58_public_key(address):
    """The 32-byte public key of an SS58 address with any non-reserved prefix."""
    raw = b58decode(address)
    if not raw:
        raise ValueError("empty address")
    if raw[0] < 64:
        prefix_len = 1
        prefix = raw[0]
    elif raw[0] < 128:
        if len(raw) < 2:
            raise ValueError("bad length")
        prefix_len = 2
        lower = ((raw[0] << 2) | (raw[1] >> 6)) & 0xFF
        prefix = lower | ((raw[1] & 0x3F) << 8)
    else:
        raise ValueError("reserved first byte")
    if len(raw) != prefix_len + 32 + 2:
        raise ValueError("bad length")
    if prefix in (46, 47):
        raise ValueError("reserved prefix")
    body, checksum = raw[:-2], raw[-2:]
    if hashlib.blake2b(b"SS58PRE" + body, digest_size=64).digest()[:2] != checksum:
        raise ValueError("bad checksum")
    return body[prefix_len:]


def sr_verify(signature, message, public_key):
    try:
        return len(signature) == 64 and bool(sr25519.verify(signature, message, public_key))
    except (ValueError, TypeError):
        return False


def strict_loads(text):
    """json.loads that refuses duplicate keys and NaN/Infinity."""

    def pairs(items):
        keys = [k for k, _ in items]
        if len(keys) != len(set(keys)):
            raise ValueError("duplicate key")
        return dict(items)

    def constant(name):
        raise ValueError("non-finite constant " + name)

    return json.loads(text, object_pairs_hook=pairs, parse_constant=constant)


def is_int(x):
    return isinstance(x, int) and not isinstance(x, bool)


def verify_payload(payload, master_hotkey, netuid):
    """(ok, reason, epoch_index, weights) by the section 6 rules, first failure wins."""
    if not isinstance(payload, dict):
        return False, "malformed", None, None
    if payload.get("v") != 1 or not is_int(payload.get("v")):
        return False, "version", None, None
    if payload.get("netuid") != netuid or not is_int(payload.get("netuid")):
        return False, "netuid", None, None
    result_json = payload.get("result_json")
    if not isinstance(result_json, str):
        return False, "malformed", None, None
    try:
        digest = hashlib.sha256(result_json.encode("utf-8")).hexdigest()
    except UnicodeEncodeError:  # an unpaired surrogate
        return False, "malformed", None, None
    if payload.get("digest") != digest:
        return False, "digest", None, None
    epoch_index = payload.get("epoch_index")
    try:
        public_key = ss58_public_key(master_hotkey)
        signature_hex = payload.get("signature", "")
        # Strict: exactly 128 hex digits (bytes.fromhex alone would skip whitespace).
        if not (isinstance(signature_hex, str) and len(signature_hex) == 128
                and all(c in "0123456789abcdefABCDEF" for c in signature_hex)):
            return False, "signature", None, None
        signature = bytes.fromhex(signature_hex)
        message = f"engy-sn53:epoch:v1:{netuid}:{epoch_index}:{digest}".encode("ascii")
    except (ValueError, TypeError):
        return False, "signature", None, None
    if not sr_verify(signature, message, public_key):
        return False, "signature", None, None
    try:
        result = strict_loads(result_json)
    except ValueError:
        return False, "malformed", None, None
    if not isinstance(result, dict) or not is_int(epoch_index) or not 0 <= epoch_index < 2**64:
        return False, "malformed", None, None
    if result.get("epoch_index") != epoch_index or not is_int(result.get("epoch_index")):
        return False, "malformed", None, None
    if result.get("netuid") != netuid or not is_int(result.get("netuid")):
        return False, "malformed", None, None
    weights = result.get("weights")
    if not isinstance(weights, list):
        return False, "malformed", None, None
    out = []
    for entry in weights:
        if not (isinstance(entry, list) and len(entry) == 2):
            return False, "malformed", None, None
        hotkey, weight = entry
        if not isinstance(hotkey, str) or not is_int(weight) or not 0 <= weight <= 65535:
            return False, "malformed", None, None
        out.append([hotkey, weight])
    return True, "ok", epoch_index, out


def message_bytes(item):
    if "message_hex" in item:
        return bytes.fromhex(item["message_hex"])
    return item["message_utf8"].encode("utf-8")


def check_signature(item):
    if "public_key_hex" in item:
        public_key = bytes.fromhex(item["public_key_hex"])
    else:
        public_key = ss58_public_key(item["ss58_address"])
    signature = bytes.fromhex(item["signature_hex"])
    got = sr_verify(signature, message_bytes(item), public_key)
    want = bool(item.get("expect_valid", True))
    return got == want, f"verify={got} expected {want}"


def check_payload(item):
    body = item["body"]
    try:
        payload = strict_loads(body)
    except ValueError as exc:
        return False, f"body is not strict JSON: {exc}"
    ok, reason, epoch_index, weights = verify_payload(payload, item["master_hotkey"], item["netuid"])
    want = bool(item.get("expect_ok", True))
    if ok != want:
        return False, f"verify_payload -> {reason}, expected ok={want}"
    if ok and "expect_epoch_index" in item and epoch_index != item["expect_epoch_index"]:
        return False, f"epoch_index {epoch_index} != {item['expect_epoch_index']}"
    if ok and "expect_weights" in item and weights != item["expect_weights"]:
        return False, "weights differ from expect_weights"
    return True, reason


def check_heartbeat(item):
    headers = item["headers"]
    body = item["body"]
    ts = headers["X-Validator-Ts"]
    if not ts.isdigit() or str(int(ts)) != ts:
        return False, f"X-Validator-Ts {ts!r} is not a canonical decimal"
    body_hash = hashlib.sha256(body.encode("utf-8")).hexdigest()
    message = "engy-sn53:api:v1:{}:{}:{}:{}:{}".format(
        item["netuid"], item["method"].upper(), item["path"], int(ts), body_hash
    )
    signature_hex = headers["X-Validator-Sig"]
    if len(signature_hex) != 128 or signature_hex != signature_hex.lower():
        return False, "X-Validator-Sig is not 128 lowercase hex characters"
    public_key = ss58_public_key(headers["X-Validator-Hotkey"])
    got = sr_verify(bytes.fromhex(signature_hex), message.encode("utf-8"), public_key)
    want = bool(item.get("expect_valid", True))
    if got != want:
        return False, f"verify={got} expected {want}"
    if json.dumps(strict_loads(body), separators=(",", ":")) != body:
        return False, "body is not byte-identical to json.dumps(separators=(',', ':'))"
    return True, "ok"


def main(argv):
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    try:
        with open(argv[1], "rb") as fh:
            doc = json.loads(fh.read())
    except (OSError, ValueError) as exc:
        print(f"check_reverse: cannot read {argv[1]}: {exc}", file=sys.stderr)
        return 2
    if doc.get("schema") != SCHEMA:
        print(f"check_reverse: schema {doc.get('schema')!r}, expected {SCHEMA}", file=sys.stderr)
        return 2
    print(f"check_reverse: {argv[1]} produced_by={doc.get('produced_by')!r}")
    print(f"check_reverse: py-sr25519-bindings module {sr25519.__name__} from {getattr(sr25519, '__file__', '?')}")
    failures = 0
    total = 0
    for section, check in (
        ("signatures", check_signature),
        ("payloads", check_payload),
        ("heartbeats", check_heartbeat),
    ):
        items = doc.get(section) or []
        passed = 0
        for item in items:
            total += 1
            try:
                ok, detail = check(item)
            except (KeyError, ValueError, TypeError) as exc:
                ok, detail = False, f"{type(exc).__name__}: {exc}"
            if ok:
                passed += 1
            else:
                failures += 1
                print(f"FAIL {section} {item.get('id')}: {detail}")
        print(f"check_reverse: {section}: {passed}/{len(items)} as expected")
    if total == 0:
        print("check_reverse: the file has no items")
        return 1
    print(f"check_reverse: {total - failures}/{total} items as expected, {failures} failure(s)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
