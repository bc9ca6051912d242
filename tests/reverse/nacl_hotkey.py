#!/usr/bin/env python3
"""Write a NaCl-encrypted ($NACL) bittensor hotkey with PyPI bittensor-wallet.

The hotkey comes from a 32-byte seed and is written twice by the reference library,
through the same calls `btcli wallet regen-hotkey` makes:

* ``<root>/<wallet>/hotkeys/plain``:     ``Wallet.set_hotkey(kp, encrypt=False)``
* ``<root>/<wallet>/hotkeys/encrypted``: ``Wallet.set_hotkey(kp, encrypt=True, hotkey_password=...)``

The password is read from the environment variable ENGY_NACL_PASSWORD (never argv, so it
does not show in process listings). Prints one JSON object on stdout:
``{"bittensor_wallet_version", "ss58_address", "public_key_hex"}``.

Usage: ENGY_NACL_PASSWORD=... nacl_hotkey.py ROOT WALLET SEED_HEX
Exit 0 on success, 2 on a usage error or when bittensor-wallet is missing.
Used by crates/engy-core/tests/nacl_keyfile.rs (ENGY_PY_REVERSE=1) and to make the
committed fixture tests/vectors/keys/nacl/ (see its README).
"""
import contextlib
import importlib.metadata
import json
import os
import sys


def main(argv):
    if len(argv) != 4:
        print(__doc__, file=sys.stderr)
        return 2
    root, wallet_name, seed_hex = argv[1], argv[2], argv[3]
    password = os.environ.get("ENGY_NACL_PASSWORD")
    if password is None:
        print("nacl_hotkey.py: set ENGY_NACL_PASSWORD", file=sys.stderr)
        return 2
    try:
        from bittensor_wallet import Keypair, Wallet
    except ImportError as e:
        print(f"nacl_hotkey.py: bittensor-wallet is not installed ({e}); "
              "python3 -m pip install 'bittensor-wallet==4.1.1'", file=sys.stderr)
        return 2
    seed = "0x" + seed_hex.removeprefix("0x")
    kp = Keypair.create_from_seed(seed)
    # bittensor-wallet prints progress ("Encrypting...") on stdout; keep stdout for the JSON.
    with contextlib.redirect_stdout(sys.stderr):
        Wallet(name=wallet_name, hotkey="plain", path=root).set_hotkey(
            kp, encrypt=False, overwrite=True)
        Wallet(name=wallet_name, hotkey="encrypted", path=root).set_hotkey(
            kp, encrypt=True, overwrite=True, hotkey_password=password)
    sys.stderr.flush()
    print(json.dumps({
        "bittensor_wallet_version": importlib.metadata.version("bittensor-wallet"),
        "ss58_address": kp.ss58_address,
        "public_key_hex": kp.public_key.hex(),
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
