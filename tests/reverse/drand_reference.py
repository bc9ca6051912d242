#!/usr/bin/env python3
"""Commit-reveal v4 cross-check with the PyPI reference bittensor-drand 2.0.0.

Reads one JSON object on stdin (written by the Rust test
crates/engy-validator/tests/reverse_drand.rs) and prints one JSON object on stdout:

input:
  rust_ciphertext_hex   a Rust tlock ciphertext of the payload, locked to `round`
  round, signature_hex  a real drand quicknet round and its signature
  payload               {hotkey_hex, uids, values, version_key}
  states                [{last_epoch_block, pending_epoch_at, subnet_epoch_index, tempo,
                          blocks_since_last_step, current_block, reveal_period, block_time}]
output:
  rust_plaintext_hex    the Rust ciphertext decrypted by bittensor_drand.decrypt_with_signature
  python_commit_hex     bittensor_drand.get_encrypted_commit_v2 of the payload, steered to
                        `round` (a negative block time moves its wall-clock target back to the
                        round whose signature is known), for the Rust side to decrypt
  python_commit_round   the round it reported
  rounds                per state: {round, t0_ms, t1_ms} from get_encrypted_commit_v2 with the
                        wall clock read just before and after the call

Exit 0 with the JSON, 2 on a usage/input error (the message on stderr).
"""
import json
import sys
import time

import bittensor_drand

GENESIS = 1692803367
PERIOD = 3


def scale_compact(n):
    if n < 1 << 6:
        return bytes([n << 2])
    if n < 1 << 14:
        return ((n << 2) | 1).to_bytes(2, "little")
    if n < 1 << 30:
        return ((n << 2) | 2).to_bytes(4, "little")
    raise ValueError("length too large")


def main():
    try:
        req = json.load(sys.stdin)
    except ValueError as e:
        print(f"drand_reference.py: bad JSON on stdin: {e}", file=sys.stderr)
        return 2
    p = req["payload"]
    hotkey = bytes.fromhex(p["hotkey_hex"])
    # decrypt_with_signature takes the SCALE `UserData { encrypted_data: Vec<u8>, reveal_round: u64 }`
    ct = bytes.fromhex(req["rust_ciphertext_hex"])
    user_data = scale_compact(len(ct)) + ct + int(req["round"]).to_bytes(8, "little")
    plain = bittensor_drand.decrypt_with_signature(user_data, req["signature_hex"])

    # steer get_encrypted_commit_v2 to `round`: target time = now + blocks * block_time
    state0 = dict(last_epoch_block=1000, pending_epoch_at=0, subnet_epoch_index=50, tempo=360,
                  blocks_since_last_step=10, current_block=1010, subnet_reveal_period_epochs=1)
    blocks = 353  # blocks until the target for state0 (reveal block 1360 + 3 - 1010)
    target = GENESIS + PERIOD * int(req["round"]) + 1.5
    block_time = -((time.time() - target) / blocks)
    commit, commit_round = bittensor_drand.get_encrypted_commit_v2(
        p["uids"], p["values"], p["version_key"], block_time=block_time, hotkey=hotkey, **state0)

    rounds = []
    for s in req["states"]:
        t0 = time.time()
        _, r = bittensor_drand.get_encrypted_commit_v2(
            [0], [65535], 0,
            last_epoch_block=s["last_epoch_block"], pending_epoch_at=s["pending_epoch_at"],
            subnet_epoch_index=s["subnet_epoch_index"], tempo=s["tempo"],
            blocks_since_last_step=s["blocks_since_last_step"], current_block=s["current_block"],
            subnet_reveal_period_epochs=s["reveal_period"], block_time=s["block_time"],
            hotkey=hotkey)
        t1 = time.time()
        rounds.append({"round": r, "t0_ms": int(t0 * 1000), "t1_ms": int(t1 * 1000) + 1})

    json.dump({
        "rust_plaintext_hex": bytes(plain).hex(),
        "python_commit_hex": bytes(commit).hex(),
        "python_commit_round": commit_round,
        "rounds": rounds,
    }, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
