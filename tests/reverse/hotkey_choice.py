#!/usr/bin/env python3
"""Write bittensor hotkey files with PyPI bittensor-wallet and record which key it loads.

Issue 21 item 8: engy must load the key bittensor-wallet loads from the same file. This
script writes one wallet, ``<ROOT>/choice/hotkeys/<case>``, through the library's own calls
(``Wallet.set_hotkey``), edits some files the way an operator or a tool might, then loads
every case back with ``Wallet(name, hotkey, path).get_hotkey()`` and prints one JSON object:

    {"bittensor_wallet_version": "4.1.1",
     "cases": [{"hotkey", "about", "mode", "symlink_to"?, "written_ss58"?,
                "bittensor_wallet": {"ss58": ...} | {"error": ...}}]}

Cases: ``mnemonic`` (set_hotkey of a key made from a phrase), ``pk32`` (privateKey is a
32-byte mini secret), ``phrase_other_pk`` (a phrase and a different key's privateKey /
publicKey / ss58Address), ``seed_other_pk`` (same with secretSeed), ``pk_other_public``
(privateKey of one key, publicKey and ss58Address of another), ``bad_phrase`` (a phrase that
is not BIP39 beside a valid privateKey), ``utf8seed`` (set_hotkey of a key made from a seed:
bittensor-wallet 4.1.1 writes the raw seed bytes and cannot read its own file back),
``group_readable`` (mode 0640), ``symlink`` (a link to ``mnemonic``).

Usage: hotkey_choice.py ROOT     (ROOT must not exist yet or be empty)
Exit 0 on success, 2 on a usage error or when bittensor-wallet is missing.
Used by crates/engy-validator/tests/hotkey_files.rs (fresh, with ENGY_PY_REVERSE=1) and
to make the committed fixture tests/vectors/keys/choice/ (its README).
"""
import contextlib
import importlib.metadata
import json
import os
import sys


def main(argv):
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    root = argv[1]
    try:
        from bittensor_wallet import Keypair, Wallet
    except ImportError as e:
        print(f"hotkey_choice.py: bittensor-wallet is not installed ({e}); "
              "python3 -m pip install 'bittensor-wallet==4.1.1'", file=sys.stderr)
        return 2
    hotkeys = os.path.join(root, "choice", "hotkeys")

    def write(name, kp):
        # bittensor-wallet prints progress on stdout; keep stdout for the JSON.
        with contextlib.redirect_stdout(sys.stderr):
            Wallet(name="choice", hotkey=name, path=root).set_hotkey(
                kp, encrypt=False, overwrite=True)
        with open(os.path.join(hotkeys, name)) as f:
            return json.load(f)

    def put(name, doc, mode=0o600):
        p = os.path.join(hotkeys, name)
        with open(p, "w") as f:
            json.dump(doc, f)
        os.chmod(p, mode)

    phrase_a = ("legal winner thank year wave sausage worth useful legal winner thank "
                "yellow")
    a = Keypair.create_from_mnemonic(phrase_a)
    b_doc = write("b_tmp", Keypair.create_from_mnemonic(
        "letter advice cage absurd amount doctor acoustic avoid letter advice cage above"))
    seed_c = "0x" + bytes(range(32)).hex()
    c = Keypair.create_from_seed(seed_c)
    cases = []

    def case(name, about, **extra):
        cases.append(dict(hotkey=name, about=about, **extra))

    a_doc = write("mnemonic", a)
    case("mnemonic", "set_hotkey of a key made from a BIP39 phrase", written_ss58=a.ss58_address)

    put("pk32", {"cryptoType": 1, "privateKey": seed_c, "publicKey": "0x" + c.public_key.hex(),
                 "accountId": "0x" + c.public_key.hex(), "ss58Address": c.ss58_address})
    case("pk32", "privateKey is a 32-byte mini secret")

    doc = dict(b_doc)
    doc["secretPhrase"] = phrase_a
    doc.pop("secretSeed", None)
    put("phrase_other_pk", doc)
    case("phrase_other_pk", "secretPhrase of key A; privateKey, publicKey, ss58Address of key B")

    doc = dict(b_doc)
    doc.pop("secretPhrase", None)
    doc["secretSeed"] = seed_c
    put("seed_other_pk", doc)
    case("seed_other_pk", "secretSeed of key C; privateKey, publicKey, ss58Address of key B")

    doc = {k: v for k, v in a_doc.items() if k not in ("secretPhrase", "secretSeed")}
    for k in ("publicKey", "accountId", "ss58Address"):
        doc[k] = b_doc[k]
    put("pk_other_public", doc)
    case("pk_other_public", "privateKey of key A; publicKey, accountId, ss58Address of key B")

    doc = dict(a_doc)
    doc["secretPhrase"] = "not a bip39 phrase at all"
    put("bad_phrase", doc)
    case("bad_phrase", "a secretPhrase that is not BIP39 beside a valid privateKey")

    write("utf8seed", c)
    case("utf8seed", "set_hotkey of a key made from a seed (secretSeed holds the raw bytes)",
         written_ss58=c.ss58_address)

    put("group_readable", a_doc, 0o640)
    case("group_readable", "a consistent file with mode 0640")

    os.symlink("mnemonic", os.path.join(hotkeys, "symlink"))
    case("symlink", "a symlink to the mnemonic file", symlink_to="mnemonic")

    os.remove(os.path.join(hotkeys, "b_tmp"))
    for c_ in cases:
        p = os.path.join(hotkeys, c_["hotkey"])
        c_["mode"] = oct(os.stat(p).st_mode & 0o7777)
        try:
            kp = Wallet(name="choice", hotkey=c_["hotkey"], path=root).get_hotkey()
            c_["bittensor_wallet"] = {"ss58": kp.ss58_address}
        except Exception as e:  # the library raises its own KeyFileError
            c_["bittensor_wallet"] = {"error": f"{type(e).__name__}: {e}"}
    print(json.dumps({
        "bittensor_wallet_version": importlib.metadata.version("bittensor-wallet"),
        "cases": cases,
    }, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
