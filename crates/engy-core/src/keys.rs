//! SS58 addresses, sr25519 signatures under the Substrate context, and bittensor wallet
//! hotkey files.
//!
//! Rules (from `tests/vectors/keys/README.md`, checked against py-sr25519-bindings 0.2.4,
//! bittensor-wallet 4.1.1 and the crates.io `schnorrkel` 0.11.5 crate):
//!
//! * **SS58**: `base58(prefix_bytes || public_key(32) || blake2b_512("SS58PRE" || prefix_bytes || public_key)[0..2])`.
//!   `prefix_bytes` is one byte for prefixes `< 64`, else two bytes
//!   `[((p & 0xFC) >> 2) | 0x40, (p >> 8) | ((p & 0x03) << 6)]`. Prefixes 46 and 47 are
//!   reserved. Bittensor writes prefix 42 ([`BITTENSOR_SS58_PREFIX`]).
//! * **sr25519**: schnorrkel with signing context `b"substrate"`; the message is the raw bytes
//!   (no `<Bytes>` wrapping, no pre-hash). Signatures are 64 bytes and randomized.
//! * **Keys**: a 32-byte mini secret expands with `ExpansionMode::Ed25519`; the 64-byte
//!   secret key (`privateKey` in wallet files) is `SecretKey::to_bytes()` (scalar || nonce).
//!
//! Secrets never appear in any `Debug`, `Display` or error string of this module.
//!
//! Policy versus bittensor-wallet (see `tests/keys_vectors.rs`):
//! * [`ss58_decode`] accepts any non-reserved prefix, as bittensor-wallet does; the pinned
//!   master hotkey is decoded this way (the same public key written with e.g. Polkadot's
//!   prefix 0 is the same master). [`ss58_decode_prefix_42`] is STRICTER: it only accepts the
//!   bittensor prefix 42, for places where an address must be in bittensor form.
//! * [`load_hotkey`] loads the key bittensor-wallet 4.1.1 loads from the same file (phrase,
//!   then seed, then `privateKey` of 64 or 32 bytes; `tests/reverse/hotkey_choice.py`
//!   checks every case against PyPI bittensor-wallet) and lists the fields that name another
//!   key, which bittensor-wallet ignores silently. It is STRICTER in one way: a file that
//!   group or others can write is refused. It loads one file bittensor-wallet cannot: the
//!   `utf8seed` form (raw-byte `secretSeed`) via its `privateKey`.
//! * Encrypted hotkeys: NaCl (`$NACL`, what `btcli` writes when a password is set) decrypts
//!   with [`load_hotkey_with_password`] ([`nacl`] gives the format and its source). The
//!   older ansible-vault and legacy Fernet formats are refused with
//!   [`WalletError::UnsupportedEncryption`]: bittensor-wallet 4.x only reads them back for
//!   migration (and its Fernet path cannot decrypt at all: it opens the box with a freshly
//!   generated key), so the fix is to re-save the hotkey with a current `btcli`.

pub mod nacl;

use std::fmt;
use std::path::{Path, PathBuf};

use blake2::{Blake2b512, Digest};
use schnorrkel::{ExpansionMode, MiniSecretKey, PublicKey, SecretKey, Signature};
use zeroize::{Zeroize, Zeroizing};

pub use nacl::{NaclError, WalletPassword};

/// The SS58 prefix bittensor uses (generic Substrate, one byte; addresses start with `5`).
pub const BITTENSOR_SS58_PREFIX: u16 = 42;

/// The sr25519 signing context of Substrate (`sp_core`, py-sr25519-bindings).
pub const SIGNING_CONTEXT: &[u8] = b"substrate";

/// Length of an sr25519 signature in bytes.
pub const SIGNATURE_LENGTH: usize = 64;

const SS58_CHECKSUM_SALT: &[u8] = b"SS58PRE";
const SS58_CHECKSUM_LEN: usize = 2;
/// Largest prefix the two-byte SS58 encoding can carry (14 bits).
pub const SS58_MAX_PREFIX: u16 = 16383;

/// Why an SS58 address did not decode (or a prefix could not be encoded).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Ss58Error {
    /// A character outside the base58 (Bitcoin) alphabet, including whitespace.
    #[error("invalid SS58 address: not base58")]
    BadBase58,
    /// The decoded byte string has the wrong length for a 32-byte account.
    #[error("invalid SS58 address: {len} decoded bytes, expected 35 (one-byte prefix) or 36 (two-byte prefix)")]
    WrongLength {
        /// Number of bytes after base58 decoding.
        len: usize,
    },
    /// Prefix 46/47 (reserved in the SS58 registry) or a first byte `>= 128`.
    #[error("invalid SS58 address: reserved address format (prefix {prefix})")]
    ReservedPrefix {
        /// The reserved prefix (or the raw first byte when it is `>= 128`).
        prefix: u16,
    },
    /// The two checksum bytes do not match `blake2b_512("SS58PRE" || ...)`.
    #[error("invalid SS58 address: bad checksum")]
    BadChecksum,
    /// The address decoded, but with another prefix than the one required.
    #[error("SS58 address has prefix {found}, expected {expected}")]
    UnexpectedPrefix {
        /// The required prefix.
        expected: u16,
        /// The prefix found in the address.
        found: u16,
    },
    /// A prefix that cannot be encoded (`> 16383`) or is reserved.
    #[error("SS58 prefix {prefix} cannot be encoded")]
    PrefixOutOfRange {
        /// The requested prefix.
        prefix: u16,
    },
}

fn ss58_prefix_bytes(prefix: u16) -> Result<Vec<u8>, Ss58Error> {
    if prefix == 46 || prefix == 47 || prefix > SS58_MAX_PREFIX {
        return Err(Ss58Error::PrefixOutOfRange { prefix });
    }
    if prefix < 64 {
        // prefix < 64 fits a byte.
        return Ok(vec![prefix as u8]);
    }
    let first = (((prefix & 0b1111_1100) >> 2) as u8) | 0b0100_0000;
    let second = ((prefix >> 8) as u8) | (((prefix & 0b11) as u8) << 6);
    Ok(vec![first, second])
}

fn ss58_checksum(prefix_and_key: &[u8]) -> [u8; SS58_CHECKSUM_LEN] {
    let mut h = Blake2b512::new();
    h.update(SS58_CHECKSUM_SALT);
    h.update(prefix_and_key);
    let out = h.finalize();
    [out[0], out[1]]
}

/// Encode a 32-byte public key as an SS58 address with `prefix`.
///
/// Errors: [`Ss58Error::PrefixOutOfRange`] for a prefix `> 16383` or a reserved one (46, 47).
pub fn ss58_encode_with_prefix(public_key: &[u8; 32], prefix: u16) -> Result<String, Ss58Error> {
    let mut data = ss58_prefix_bytes(prefix)?;
    data.extend_from_slice(public_key);
    let cs = ss58_checksum(&data);
    data.extend_from_slice(&cs);
    Ok(bs58::encode(data).into_string())
}

/// Encode a 32-byte public key as a bittensor SS58 address (prefix 42, 48 characters).
pub fn ss58_encode(public_key: &[u8; 32]) -> String {
    let mut data = Vec::with_capacity(35);
    data.push(BITTENSOR_SS58_PREFIX as u8);
    data.extend_from_slice(public_key);
    let cs = ss58_checksum(&data);
    data.extend_from_slice(&cs);
    bs58::encode(data).into_string()
}

/// Decode an SS58 address with ANY non-reserved prefix, returning `(prefix, public_key)`.
///
/// This is what bittensor-wallet's `Keypair(ss58_address=...)` accepts: the pinned master
/// hotkey written with another prefix (e.g. Polkadot's 0) names the same public key. Only
/// 32-byte accounts are accepted (one- or two-byte prefix, 2 checksum bytes).
///
/// Errors, checked in this order: [`Ss58Error::BadBase58`], [`Ss58Error::WrongLength`],
/// [`Ss58Error::ReservedPrefix`], [`Ss58Error::BadChecksum`].
pub fn ss58_decode(address: &str) -> Result<(u16, [u8; 32]), Ss58Error> {
    let data = bs58::decode(address)
        .into_vec()
        .map_err(|_| Ss58Error::BadBase58)?;
    let first = *data.first().ok_or(Ss58Error::WrongLength { len: 0 })?;
    let (prefix, prefix_len) = match first {
        0..=63 => (u16::from(first), 1usize),
        64..=127 => {
            let second = *data
                .get(1)
                .ok_or(Ss58Error::WrongLength { len: data.len() })?;
            let lower = (first << 2) | (second >> 6);
            let upper = second & 0b0011_1111;
            (u16::from(lower) | (u16::from(upper) << 8), 2usize)
        }
        _ => {
            return Err(Ss58Error::ReservedPrefix {
                prefix: u16::from(first),
            })
        }
    };
    if data.len() != prefix_len + 32 + SS58_CHECKSUM_LEN {
        return Err(Ss58Error::WrongLength { len: data.len() });
    }
    if prefix == 46 || prefix == 47 {
        return Err(Ss58Error::ReservedPrefix { prefix });
    }
    let body_len = prefix_len + 32;
    let (body, checksum) = data.split_at(body_len);
    if ss58_checksum(body) != checksum {
        return Err(Ss58Error::BadChecksum);
    }
    let mut key = [0u8; 32];
    key.copy_from_slice(&body[prefix_len..]);
    Ok((prefix, key))
}

/// Same as [`ss58_decode`] (any non-reserved prefix), returning only the public key.
pub fn ss58_decode_any_prefix(address: &str) -> Result<[u8; 32], Ss58Error> {
    ss58_decode(address).map(|(_, key)| key)
}

/// Decode an SS58 address that MUST carry the bittensor prefix 42.
///
/// Errors: everything [`ss58_decode`] returns, plus [`Ss58Error::UnexpectedPrefix`].
pub fn ss58_decode_prefix_42(address: &str) -> Result<[u8; 32], Ss58Error> {
    let (prefix, key) = ss58_decode(address)?;
    if prefix != BITTENSOR_SS58_PREFIX {
        return Err(Ss58Error::UnexpectedPrefix {
            expected: BITTENSOR_SS58_PREFIX,
            found: prefix,
        });
    }
    Ok(key)
}

/// Why an sr25519 signature did not verify.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SignatureError {
    /// The signature is not exactly 64 bytes.
    #[error("signature is {len} bytes, expected 64")]
    BadLength {
        /// Length found.
        len: usize,
    },
    /// 64 bytes that schnorrkel cannot parse: byte 63 lacks the schnorrkel marker bit or `s`
    /// is not canonical (py-sr25519-bindings raises `ValueError` here).
    #[error("signature bytes are not a schnorrkel signature")]
    Malformed,
    /// The 32 bytes are not a valid Ristretto public key.
    #[error("public key is not a valid sr25519 public key")]
    BadPublicKey,
    /// A well-formed signature that does not verify for this key and message.
    #[error("signature does not verify")]
    Invalid,
}

/// Verify an sr25519 `signature` by `public_key` over the raw `message` bytes with the
/// Substrate signing context (`b"substrate"`). Equivalent to py-sr25519-bindings'
/// `sr25519.verify(sig, msg, pub)` (no `<Bytes>` retry).
pub fn verify_signature(
    public_key: &[u8; 32],
    message: &[u8],
    signature: &[u8],
) -> Result<(), SignatureError> {
    if signature.len() != SIGNATURE_LENGTH {
        return Err(SignatureError::BadLength {
            len: signature.len(),
        });
    }
    let sig = Signature::from_bytes(signature).map_err(|_| SignatureError::Malformed)?;
    let pk = PublicKey::from_bytes(public_key).map_err(|_| SignatureError::BadPublicKey)?;
    pk.verify_simple(SIGNING_CONTEXT, message, &sig)
        .map_err(|_| SignatureError::Invalid)
}

/// Errors building a [`Hotkey`] from secret bytes. Carries no secret material.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KeyError {
    /// The bytes are not a valid schnorrkel secret key (wrong length or bad scalar).
    #[error("secret key bytes are not a valid sr25519 secret key ({len} bytes; expected 64: scalar || nonce)")]
    BadSecretKey {
        /// Length of the rejected input.
        len: usize,
    },
    /// The mini secret is not 32 bytes.
    #[error("mini secret (seed) is {len} bytes, expected 32")]
    BadMiniSecret {
        /// Length of the rejected input.
        len: usize,
    },
}

/// An sr25519 keypair (a bittensor hotkey, or the master key in tests and doubles).
///
/// The secret is zeroized on drop (schnorrkel's `Keypair` drop) and never shown by
/// `Debug`, which prints only the SS58 address.
#[derive(Clone)]
pub struct Hotkey {
    pair: schnorrkel::Keypair,
}

impl fmt::Debug for Hotkey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Hotkey")
            .field("ss58", &self.ss58())
            .field("secret", &"<redacted>")
            .finish()
    }
}

impl Hotkey {
    /// Build from a 32-byte mini secret (a "seed"), expanded with
    /// `ExpansionMode::Ed25519` as Substrate and bittensor-wallet do.
    pub fn from_mini_secret(seed: &[u8]) -> Result<Self, KeyError> {
        let mini = MiniSecretKey::from_bytes(seed)
            .map_err(|_| KeyError::BadMiniSecret { len: seed.len() })?;
        Ok(Self {
            pair: mini.expand_to_keypair(ExpansionMode::Ed25519),
        })
    }

    /// Build from the 64-byte secret key (`SecretKey::to_bytes()`: canonical scalar || nonce),
    /// the form a bittensor wallet file stores as `privateKey`.
    pub fn from_secret_key_bytes(secret: &[u8]) -> Result<Self, KeyError> {
        let sk = SecretKey::from_bytes(secret)
            .map_err(|_| KeyError::BadSecretKey { len: secret.len() })?;
        Ok(Self {
            pair: sk.to_keypair(),
        })
    }

    /// A fresh random keypair from the OS RNG (tests and protocol doubles).
    pub fn generate() -> Self {
        Self {
            pair: schnorrkel::Keypair::generate(),
        }
    }

    /// The 32-byte public key.
    pub fn public_key(&self) -> [u8; 32] {
        self.pair.public.to_bytes()
    }

    /// The SS58 address with the bittensor prefix 42.
    pub fn ss58(&self) -> String {
        ss58_encode(&self.public_key())
    }

    /// The 64-byte secret key (scalar || nonce), zeroized when dropped. Handle with care:
    /// this is the wallet `privateKey`.
    pub fn secret_key_bytes(&self) -> Zeroizing<[u8; 64]> {
        Zeroizing::new(self.pair.secret.to_bytes())
    }

    /// Sign the raw `message` bytes with the Substrate context; 64 bytes, randomized.
    pub fn sign(&self, message: &[u8]) -> [u8; 64] {
        self.pair
            .sign(schnorrkel::signing_context(SIGNING_CONTEXT).bytes(message))
            .to_bytes()
    }

    /// Verify a signature against this key's public key (see [`verify_signature`]).
    pub fn verify(&self, message: &[u8], signature: &[u8]) -> Result<(), SignatureError> {
        verify_signature(&self.public_key(), message, signature)
    }
}

/// Errors loading a bittensor wallet hotkey file. No variant carries secret material.
#[derive(Debug, thiserror::Error)]
pub enum WalletError {
    /// The wallet or hotkey name is empty or contains a path separator / `..`.
    #[error("invalid {what} name {name:?}: must be a plain file name (no '/', no '..')")]
    BadName {
        /// `wallet` or `hotkey`.
        what: &'static str,
        /// The rejected name.
        name: String,
    },
    /// No home directory to resolve `~/.bittensor/wallets` against.
    #[error("cannot resolve the default wallet path ~/.bittensor/wallets: HOME is not set; pass the wallet path explicitly")]
    NoHome,
    /// The hotkey file does not exist.
    #[error("hotkey file {path} not found: check the wallet name, hotkey name and wallet path (a bittensor wallet keeps hotkeys at <wallet path>/<wallet>/hotkeys/<hotkey>)")]
    NotFound {
        /// The path tried.
        path: PathBuf,
    },
    /// The file could not be read.
    #[error("cannot read hotkey file {path}: {source}")]
    Io {
        /// The path tried.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// The hotkey file is encrypted in a format engy does not decrypt (ansible-vault,
    /// legacy Fernet, or an unknown `$...` header); NaCl (`$NACL`) is decrypted instead.
    #[error("hotkey file {path} is encrypted with {format}, which engy does not decrypt: re-save the hotkey with a current btcli, which writes NaCl ($NACL) when a password is set, e.g. `btcli wallet regen-hotkey --wallet.name <wallet> --wallet.hotkey <hotkey>` (or without a password: add --no-use-password)")]
    UnsupportedEncryption {
        /// The file.
        path: PathBuf,
        /// The format detected (`ansible-vault`, `legacy Fernet`, ...).
        format: &'static str,
    },
    /// The hotkey file is NaCl-encrypted (`$NACL`) and no password was supplied.
    #[error(
        "hotkey file {path} is encrypted (NaCl, $NACL) and no password was supplied to decrypt it"
    )]
    PasswordRequired {
        /// The file.
        path: PathBuf,
    },
    /// The password does not decrypt the NaCl hotkey file ([`NaclError::WrongPassword`]).
    #[error("wrong password for hotkey file {path}: it does not decrypt the NaCl secretbox (a file altered or cut short after it was encrypted fails the same way; compare it with the wallet's copy)")]
    WrongPassword {
        /// The file.
        path: PathBuf,
    },
    /// A damaged NaCl hotkey file: shorter than its header, or it decrypts to something
    /// that is not a keyfile.
    #[error("hotkey file {path} is a damaged NaCl ($NACL) keyfile: {why}; restore it from the wallet's backup or regenerate the hotkey (`btcli wallet regen-hotkey`)")]
    CorruptEncrypted {
        /// The file.
        path: PathBuf,
        /// What is wrong (never the content).
        why: String,
    },
    /// The Argon2i key derivation could not run (memory; see [`NaclError`]).
    #[error("cannot decrypt hotkey file {path}: {source}")]
    KeyDerivation {
        /// The file.
        path: PathBuf,
        /// The cause.
        #[source]
        source: NaclError,
    },
    /// The file is not a JSON object in bittensor's hotkey format.
    #[error("hotkey file {path} is not a bittensor keyfile (expected a JSON object with privateKey/publicKey/ss58Address): {why}; check that the path names the hotkey file itself, else restore it from the wallet's backup or with `btcli wallet regen-hotkey` (a password-encrypted hotkey is fine: engy decrypts NaCl $NACL files)")]
    NotKeyfile {
        /// The file.
        path: PathBuf,
        /// What was wrong (never the file content).
        why: String,
    },
    /// A field is missing or has the wrong shape (its value is never echoed).
    #[error("hotkey file {path}: field {field} {why}")]
    BadField {
        /// The file.
        path: PathBuf,
        /// Field name.
        field: &'static str,
        /// What is wrong with it.
        why: String,
    },
    /// The hotkey file (or, for a symlink, the file it points to) can be written by its
    /// group or by others (mode & 0o022): anyone in that set could swap the key the daemon
    /// signs with. Refused (docs/SECURITY.md "Hotkey files").
    #[error("hotkey file {path} can be written by group or others (mode {mode:o}); fix: chmod 600 {path} (and chown it to the daemon's user)")]
    WritableByOthers {
        /// The file (the symlink's target when it is a symlink).
        path: PathBuf,
        /// The file mode bits.
        mode: u32,
    },
}

/// A field of a hotkey file that names another key than the one loaded (bittensor-wallet
/// 4.1.1 ignores every such field; the daemons warn).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Disagreement {
    /// The field: `secretSeed`, `privateKey`, `publicKey`, `accountId` or `ss58Address`.
    pub field: &'static str,
    /// The SS58 address the field names, or `None` when it does not decode.
    pub ss58: Option<String>,
}

/// A hotkey loaded from a wallet file, with facts the daemon should log.
#[derive(Debug)]
pub struct LoadedHotkey {
    /// The keypair.
    pub hotkey: Hotkey,
    /// The file it came from.
    pub path: PathBuf,
    /// `true` when the file is readable by group or others (mode & 0o044 != 0). Loading
    /// still succeeds; `check` fails it and the daemon warns (docs/SECURITY.md "Hotkey
    /// files"). A file writable by them is refused ([`WalletError::WritableByOthers`]).
    pub insecure_permissions: bool,
    /// The file mode bits (Unix), for the warning.
    pub mode: Option<u32>,
    /// The file `path` points to when `path` is a symlink (followed, as bittensor-wallet
    /// does; a Kubernetes secret volume is one); the daemons name it.
    pub symlink_target: Option<PathBuf>,
    /// Which field the key came from, in bittensor-wallet 4.1.1's order: `secretPhrase`,
    /// `secretSeed` or `privateKey`.
    pub source_field: &'static str,
    /// Other fields of the file that name a different key (or do not decode); empty for a
    /// file bittensor-wallet wrote.
    pub disagreeing: Vec<Disagreement>,
    /// `true` when the file was NaCl-encrypted and decrypted with the password.
    pub decrypted: bool,
}

/// Largest hotkey file read (a real one is under 1 KiB).
pub const MAX_KEYFILE_BYTES: u64 = 64 * 1024;

/// The default wallet path root, `~/.bittensor/wallets` (bittensor's default).
pub fn default_wallet_root() -> Result<PathBuf, WalletError> {
    let home = std::env::var_os("HOME")
        .filter(|h| !h.is_empty())
        .ok_or(WalletError::NoHome)?;
    Ok(PathBuf::from(home).join(".bittensor").join("wallets"))
}

/// Expand a leading `~` or `~/` in a wallet path (as bittensor does for `--wallet.path`).
pub fn expand_wallet_path(path: &Path) -> Result<PathBuf, WalletError> {
    let s = path.to_string_lossy();
    if s == "~" || s.starts_with("~/") {
        let home = std::env::var_os("HOME")
            .filter(|h| !h.is_empty())
            .ok_or(WalletError::NoHome)?;
        let rest = s.strip_prefix('~').unwrap_or("").trim_start_matches('/');
        return Ok(PathBuf::from(home).join(rest));
    }
    Ok(path.to_path_buf())
}

fn check_name(what: &'static str, name: &str) -> Result<(), WalletError> {
    if name.is_empty()
        || name == "."
        || name == ".."
        || name.contains('/')
        || name.contains('\\')
        || name.contains('\0')
    {
        return Err(WalletError::BadName {
            what,
            name: name.to_string(),
        });
    }
    Ok(())
}

/// An encrypted format engy does not decrypt, by its header (bittensor-wallet's
/// `keyfile_data_encryption_method`, plus `$BTWL` and any other `$` header).
fn unsupported_encryption(data: &[u8]) -> Option<&'static str> {
    let trimmed = data.trim_ascii_start();
    if trimmed.starts_with(b"$ANSIBLE_VAULT") {
        Some("ansible-vault")
    } else if trimmed.starts_with(b"$BTWL") {
        Some("bittensor wallet ($BTWL)")
    } else if trimmed.starts_with(b"gAAAAA") {
        Some("legacy Fernet")
    } else if trimmed.starts_with(b"$") {
        Some("unknown encrypted format")
    } else {
        None
    }
}

/// Decode a `"0x" + hex` field into exactly `N` bytes.
fn hex_field<const N: usize>(
    path: &Path,
    obj: &serde_json::Map<String, serde_json::Value>,
    field: &'static str,
) -> Result<Option<Zeroizing<[u8; N]>>, WalletError> {
    let Some(v) = obj.get(field) else {
        return Ok(None);
    };
    let bad = |why: String| WalletError::BadField {
        path: path.to_path_buf(),
        field,
        why,
    };
    let s = v
        .as_str()
        .ok_or_else(|| bad("is not a string".to_string()))?;
    let h = s.strip_prefix("0x").unwrap_or(s);
    let mut out = Zeroizing::new([0u8; N]);
    hex::decode_to_slice(h, out.as_mut_slice()).map_err(|_| {
        bad(format!(
            "is not \"0x\" followed by {} hex characters",
            2 * N
        ))
    })?;
    Ok(Some(out))
}

/// Load the hotkey `<wallet_path_root>/<wallet>/hotkeys/<hotkey>` written by bittensor-wallet.
///
/// The key is the one bittensor-wallet 4.1.1 (`Keyfile.keypair`) loads from the same file,
/// checked against it in `tests/reverse/hotkey_choice.py`: the first present (non-null) of
/// `secretPhrase` (BIP39 English words → substrate mini secret), `secretSeed` (32 bytes),
/// `privateKey` (64 bytes = scalar || nonce, or 32 bytes = a mini secret). A phrase or
/// field that does not decode is an error, as there. The other fields (`publicKey`,
/// `accountId`, `ss58Address`, a second secret) are not used to pick the key; those naming
/// another key are listed in [`LoadedHotkey::disagreeing`] for the daemon to warn about.
/// One case loads here that bittensor-wallet refuses: a non-hex `secretSeed` (the raw seed
/// bytes that its own `set_hotkey` writes for a key made from a seed) is skipped for
/// `privateKey`.
///
/// A NaCl-encrypted keyfile fails with [`WalletError::PasswordRequired`] (use
/// [`load_hotkey_with_password`]); ansible-vault and legacy Fernet fail with
/// [`WalletError::UnsupportedEncryption`], which tells the operator how to fix it. A
/// symlink is followed ([`LoadedHotkey::symlink_target`]); a file writable by group/others
/// is refused ([`WalletError::WritableByOthers`]); one readable by them loads, with
/// [`LoadedHotkey::insecure_permissions`] set.
pub fn load_hotkey(
    wallet_path_root: &Path,
    wallet: &str,
    hotkey: &str,
) -> Result<LoadedHotkey, WalletError> {
    load_hotkey_with_password(wallet_path_root, wallet, hotkey, None)
}

/// [`load_hotkey`], decrypting a NaCl (`$NACL`) hotkey file with `password` as
/// bittensor-wallet does (see [`nacl`]). The password is ignored for an unencrypted file.
///
/// Decryption errors: [`WalletError::PasswordRequired`] (encrypted, `password` is `None`),
/// [`WalletError::WrongPassword`], [`WalletError::CorruptEncrypted`] (cut short before the
/// ciphertext, or it decrypts to something that is not a keyfile),
/// [`WalletError::KeyDerivation`]. The decrypted keyfile then passes the same checks as an
/// unencrypted one. Decryption costs one Argon2i derivation: 512 MiB and seconds.
pub fn load_hotkey_with_password(
    wallet_path_root: &Path,
    wallet: &str,
    hotkey: &str,
    password: Option<&WalletPassword>,
) -> Result<LoadedHotkey, WalletError> {
    check_name("wallet", wallet)?;
    check_name("hotkey", hotkey)?;
    let root = expand_wallet_path(wallet_path_root)?;
    let path = root.join(wallet).join("hotkeys").join(hotkey);
    load_hotkey_file_with_password(&path, password)
}

/// Load a hotkey file by its path (see [`load_hotkey`] for the rules).
pub fn load_hotkey_file(path: &Path) -> Result<LoadedHotkey, WalletError> {
    load_hotkey_file_with_password(path, None)
}

/// Load a hotkey file by its path, decrypting it with `password` when it is NaCl-encrypted
/// (see [`load_hotkey_with_password`] for the rules).
pub fn load_hotkey_file_with_password(
    path: &Path,
    password: Option<&WalletPassword>,
) -> Result<LoadedHotkey, WalletError> {
    if let Ok(meta) = std::fs::metadata(path) {
        if meta.len() > MAX_KEYFILE_BYTES {
            return Err(WalletError::NotKeyfile {
                path: path.to_path_buf(),
                why: format!(
                    "{} bytes, larger than any keyfile ({MAX_KEYFILE_BYTES} bytes max)",
                    meta.len()
                ),
            });
        }
    }
    let data = Zeroizing::new(std::fs::read(path).map_err(|e| {
        if e.kind() == std::io::ErrorKind::NotFound {
            WalletError::NotFound {
                path: path.to_path_buf(),
            }
        } else {
            WalletError::Io {
                path: path.to_path_buf(),
                source: e,
            }
        }
    })?);
    let access = file_access(path)?;

    // bittensor-wallet tests the header at byte 0; leading whitespace is tolerated here
    // (the secretbox authenticates everything after the prefix anyway).
    let encrypted = data.trim_ascii_start();
    if encrypted.starts_with(nacl::NACL_PREFIX) {
        let password = password.ok_or_else(|| WalletError::PasswordRequired {
            path: path.to_path_buf(),
        })?;
        let plain = nacl::decrypt(encrypted, password).map_err(|e| match e {
            NaclError::WrongPassword => WalletError::WrongPassword {
                path: path.to_path_buf(),
            },
            NaclError::Truncated { .. } | NaclError::NotNacl => WalletError::CorruptEncrypted {
                path: path.to_path_buf(),
                why: e.to_string(),
            },
            NaclError::OutOfMemory | NaclError::KeyDerivation(_) => WalletError::KeyDerivation {
                path: path.to_path_buf(),
                source: e,
            },
        })?;
        return parse_keyfile(path, &plain, &access, true).map_err(|e| match e {
            WalletError::NotKeyfile { path, why } => WalletError::CorruptEncrypted {
                path,
                why: format!("it decrypts, but the content is {why}"),
            },
            other => other,
        });
    }
    if let Some(format) = unsupported_encryption(&data) {
        return Err(WalletError::UnsupportedEncryption {
            path: path.to_path_buf(),
            format,
        });
    }
    parse_keyfile(path, &data, &access, false)
}

/// Check and load the keyfile JSON `data` read from `path` (plain or decrypted).
fn parse_keyfile(
    path: &Path,
    data: &[u8],
    access: &Access,
    decrypted: bool,
) -> Result<LoadedHotkey, WalletError> {
    let not_keyfile = |why: &str| WalletError::NotKeyfile {
        path: path.to_path_buf(),
        why: why.to_string(),
    };
    // serde_json errors quote no input, but keep the message generic anyway.
    let mut value: serde_json::Value =
        serde_json::from_slice(data).map_err(|_| not_keyfile("not valid JSON"))?;
    let result = (|| {
        let obj = value
            .as_object()
            .ok_or_else(|| not_keyfile("not a JSON object"))?;

        let (hk, source_field) = choose_key(path, obj)?;
        let disagreeing = disagreeing_fields(obj, source_field, &hk.public_key());
        Ok(LoadedHotkey {
            hotkey: hk,
            path: path.to_path_buf(),
            insecure_permissions: access.readable_by_others,
            mode: access.mode,
            symlink_target: access.symlink_target.clone(),
            source_field,
            disagreeing,
            decrypted,
        })
    })();
    zeroize_json(&mut value);
    result
}

/// Overwrite every string in a parsed keyfile before it is dropped.
fn zeroize_json(v: &mut serde_json::Value) {
    match v {
        serde_json::Value::String(s) => s.zeroize(),
        serde_json::Value::Array(a) => a.iter_mut().for_each(zeroize_json),
        serde_json::Value::Object(o) => o.values_mut().for_each(zeroize_json),
        _ => {}
    }
}

/// What the daemons are told about the file's access (see [`LoadedHotkey`]).
#[derive(Debug, Default)]
struct Access {
    readable_by_others: bool,
    mode: Option<u32>,
    symlink_target: Option<PathBuf>,
}

/// The file's mode (of the symlink's target when `path` is one); refuses a file writable by
/// group or others.
fn file_access(path: &Path) -> Result<Access, WalletError> {
    let symlink_target = std::fs::symlink_metadata(path)
        .ok()
        .filter(|m| m.file_type().is_symlink())
        .map(|_| std::fs::canonicalize(path).unwrap_or_else(|_| path.to_path_buf()));
    let mode = file_mode(path);
    if let Some(mode) = mode.filter(|m| m & 0o022 != 0) {
        return Err(WalletError::WritableByOthers {
            path: symlink_target.clone().unwrap_or_else(|| path.to_path_buf()),
            mode,
        });
    }
    Ok(Access {
        readable_by_others: mode.is_some_and(|m| m & 0o044 != 0),
        mode,
        symlink_target,
    })
}

#[cfg(unix)]
fn file_mode(path: &Path) -> Option<u32> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::metadata(path)
        .ok()
        .map(|m| m.permissions().mode() & 0o7777)
}

#[cfg(not(unix))]
fn file_mode(_path: &Path) -> Option<u32> {
    None
}

/// The substrate mini secret of a BIP39 English phrase without a password, as sp-core's
/// `Pair::from_phrase` (substrate-bip39 `mini_secret_from_entropy`): the first 32 bytes of
/// PBKDF2-HMAC-SHA512(entropy, salt "mnemonic", 2048 rounds). `None` for a phrase that is
/// not valid BIP39 (unknown word, bad checksum, wrong length).
fn mini_secret_from_phrase(phrase: &str) -> Option<Zeroizing<[u8; 32]>> {
    let mnemonic = bip39::Mnemonic::parse_in_normalized(bip39::Language::English, phrase).ok()?;
    let (mut entropy, len) = mnemonic.to_entropy_array();
    let mut seed = Zeroizing::new([0u8; 64]);
    let ok = pbkdf2::pbkdf2::<hmac::Hmac<sha2::Sha512>>(
        entropy.get(..len)?,
        b"mnemonic",
        2048,
        seed.as_mut_slice(),
    );
    entropy.zeroize();
    ok.ok()?;
    let mut mini = Zeroizing::new([0u8; 32]);
    mini.copy_from_slice(seed.get(..32)?);
    Some(mini)
}

/// The key bittensor-wallet 4.1.1 loads from a keyfile object, and the field it came from
/// (see [`load_hotkey`] for the order).
fn choose_key(
    path: &Path,
    obj: &serde_json::Map<String, serde_json::Value>,
) -> Result<(Hotkey, &'static str), WalletError> {
    let bad = |field: &'static str, why: &str| WalletError::BadField {
        path: path.to_path_buf(),
        field,
        why: why.to_string(),
    };
    match obj.get("secretPhrase") {
        None | Some(serde_json::Value::Null) => {}
        Some(serde_json::Value::String(phrase)) => {
            let mini = mini_secret_from_phrase(phrase).ok_or_else(|| {
                bad(
                    "secretPhrase",
                    "is not a BIP39 English mnemonic (bittensor-wallet refuses it too: \"Invalid phrase\")",
                )
            })?;
            let hk = Hotkey::from_mini_secret(mini.as_slice())
                .map_err(|_| bad("secretPhrase", "does not give a mini secret"))?;
            return Ok((hk, "secretPhrase"));
        }
        Some(_) => return Err(bad("secretPhrase", "is not a string")),
    }
    // A non-hex secretSeed (raw seed bytes, as bittensor-wallet 4.1.1's own set_hotkey
    // writes them) is skipped for privateKey; a hex one of the wrong length is an error.
    match obj.get("secretSeed") {
        Some(serde_json::Value::String(s))
            if s.strip_prefix("0x")
                .unwrap_or(s)
                .bytes()
                .all(|b| b.is_ascii_hexdigit()) =>
        {
            if let Some(seed) = hex_field::<32>(path, obj, "secretSeed")? {
                let hk = Hotkey::from_mini_secret(seed.as_slice())
                    .map_err(|_| bad("secretSeed", "is not a valid mini secret"))?;
                return Ok((hk, "secretSeed"));
            }
        }
        _ => {}
    }
    match obj.get("privateKey") {
        None | Some(serde_json::Value::Null) => Err(bad(
            "privateKey",
            "is missing (and there is no secretPhrase or secretSeed); is this a public-only file such as defaultpub.txt?",
        )),
        Some(serde_json::Value::String(s)) => {
            let len = s.strip_prefix("0x").unwrap_or(s).len();
            let hk = if len == 64 {
                let seed = hex_field::<32>(path, obj, "privateKey")?
                    .ok_or_else(|| bad("privateKey", "is missing"))?;
                Hotkey::from_mini_secret(seed.as_slice())
            } else {
                let sk = hex_field::<64>(path, obj, "privateKey")?
                    .ok_or_else(|| bad("privateKey", "is missing"))?;
                Hotkey::from_secret_key_bytes(sk.as_slice())
            };
            let hk = hk.map_err(|_| {
                bad(
                    "privateKey",
                    "is not a valid sr25519 secret key (64 bytes) or mini secret (32 bytes)",
                )
            })?;
            Ok((hk, "privateKey"))
        }
        Some(_) => Err(bad("privateKey", "is not a string")),
    }
}

/// The fields other than `chosen` that name a key other than `public` (or do not decode).
fn disagreeing_fields(
    obj: &serde_json::Map<String, serde_json::Value>,
    chosen: &'static str,
    public: &[u8; 32],
) -> Vec<Disagreement> {
    let mut out = Vec::new();
    let mut note = |field: &'static str, key: Option<[u8; 32]>| {
        if key.as_ref() != Some(public) {
            out.push(Disagreement {
                field,
                ss58: key.map(|k| ss58_encode(&k)),
            });
        }
    };
    let text = |field: &str| obj.get(field).and_then(serde_json::Value::as_str);
    let unhex = |s: &str| hex::decode(s.strip_prefix("0x").unwrap_or(s)).ok();
    for field in ["secretSeed", "privateKey"] {
        if field == chosen {
            continue;
        }
        let Some(s) = text(field) else { continue };
        let bytes = unhex(s).map(Zeroizing::new);
        // a raw-byte secretSeed (see choose_key) is what bittensor-wallet writes: not noted
        if bytes.is_none() && field == "secretSeed" {
            continue;
        }
        let key = match bytes.as_ref().map(|b| b.len()) {
            Some(32) => bytes
                .as_ref()
                .and_then(|b| Hotkey::from_mini_secret(b).ok()),
            Some(64) => bytes
                .as_ref()
                .and_then(|b| Hotkey::from_secret_key_bytes(b).ok()),
            _ => None,
        };
        note(field, key.map(|k| k.public_key()));
    }
    for field in ["publicKey", "accountId"] {
        if let Some(s) = text(field) {
            note(field, unhex(s).and_then(|b| <[u8; 32]>::try_from(b).ok()));
        }
    }
    if let Some(s) = text("ss58Address") {
        note("ss58Address", ss58_decode(s).ok().map(|(_, k)| k));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn debug_hides_secret() {
        let hk = Hotkey::from_mini_secret(&[7u8; 32]).unwrap();
        let dbg = format!("{hk:?}");
        let sk = hex::encode(hk.secret_key_bytes().as_slice());
        assert!(!dbg.contains(&sk[..16]));
        assert!(dbg.contains(&hk.ss58()));
    }

    #[test]
    fn a_phrase_gives_substrates_mini_secret() {
        // tests/vectors/keys/keypairs.json: dev_root and wallet_hotkey (bittensor-wallet).
        for (phrase, seed) in [
            (
                "bottom drive obey lake curtain smoke basket hold race lonely fit walk",
                "fac7959dbfe72f052e5a0c3c8d6530f202b02fd8f9f5ca3580ec8deb7797479e",
            ),
            (
                "abandon abandon abandon abandon abandon abandon abandon abandon abandon abandon abandon about",
                "4ed8d4b17698ddeaa1f1559f152f87b5d472f725ca86d341bd0276f1b61197e2",
            ),
        ] {
            let mini = mini_secret_from_phrase(phrase).unwrap();
            assert_eq!(hex::encode(mini.as_slice()), seed);
        }
        assert!(mini_secret_from_phrase("abandon abandon abandon").is_none());
        assert!(mini_secret_from_phrase("").is_none());
    }

    #[test]
    fn two_byte_prefix_round_trip() {
        let pk = [3u8; 32];
        for p in [64u16, 255, 1337, 16383] {
            let a = ss58_encode_with_prefix(&pk, p).unwrap();
            assert_eq!(ss58_decode(&a).unwrap(), (p, pk));
        }
        assert!(ss58_encode_with_prefix(&pk, 46).is_err());
        assert!(ss58_encode_with_prefix(&pk, 16384).is_err());
    }
}
