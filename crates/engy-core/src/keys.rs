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
//! * [`load_hotkey`] is STRICTER than bittensor-wallet: the key derived from `privateKey`
//!   must match `publicKey`, `accountId` and `ss58Address`, and it reads `privateKey` rather
//!   than re-deriving from `secretPhrase` (so the `utf8seed` file bittensor-wallet 4.1.1
//!   cannot read back loads here).
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
    #[error("hotkey file {path} is not a bittensor keyfile (expected a JSON object with privateKey/publicKey/ss58Address): {why}; if it is encrypted, regenerate an unencrypted hotkey with `btcli wallet regen-hotkey`")]
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
    /// The key derived from the secret does not match the stored public part.
    #[error("hotkey file {path}: the key derived from {from} does not match {field}; the file is corrupt or was edited")]
    KeyMismatch {
        /// The file.
        path: PathBuf,
        /// Secret field used (`privateKey` or `secretSeed`).
        from: &'static str,
        /// The public field that disagrees.
        field: &'static str,
    },
}

/// A hotkey loaded from a wallet file, with facts the daemon should log.
#[derive(Debug)]
pub struct LoadedHotkey {
    /// The keypair.
    pub hotkey: Hotkey,
    /// The file it came from.
    pub path: PathBuf,
    /// `true` when the file is readable by group or others (mode & 0o077 != 0). Loading
    /// still succeeds; the daemon should warn and suggest `chmod 600`.
    pub insecure_permissions: bool,
    /// The file mode bits (Unix), for the warning.
    pub mode: Option<u32>,
    /// Which field the key came from: `privateKey` or `secretSeed`.
    pub source_field: &'static str,
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
/// The key comes from `privateKey` (64-byte schnorrkel secret, see the keys README), else
/// from `secretSeed` (32-byte mini secret). The derived public key must equal `publicKey`
/// and `accountId` (when present) and `ss58Address` must encode it, else
/// [`WalletError::KeyMismatch`]. A NaCl-encrypted keyfile fails with
/// [`WalletError::PasswordRequired`] (use [`load_hotkey_with_password`]); ansible-vault and
/// legacy Fernet fail with [`WalletError::UnsupportedEncryption`], which tells the operator
/// how to fix it. A file readable by group/others loads, with
/// [`LoadedHotkey::insecure_permissions`] set.
///
/// `secretPhrase` is not used (bittensor-wallet tries it first, but `privateKey` is the exact
/// key and needs no BIP39); the `utf8seed` case (non-hex `secretSeed`) loads via `privateKey`.
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
    let (insecure_permissions, mode) = file_mode(path);

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
        return parse_keyfile(path, &plain, insecure_permissions, mode, true).map_err(
            |e| match e {
                WalletError::NotKeyfile { path, why } => WalletError::CorruptEncrypted {
                    path,
                    why: format!("it decrypts, but the content is {why}"),
                },
                other => other,
            },
        );
    }
    if let Some(format) = unsupported_encryption(&data) {
        return Err(WalletError::UnsupportedEncryption {
            path: path.to_path_buf(),
            format,
        });
    }
    parse_keyfile(path, &data, insecure_permissions, mode, false)
}

/// Check and load the keyfile JSON `data` read from `path` (plain or decrypted).
fn parse_keyfile(
    path: &Path,
    data: &[u8],
    insecure_permissions: bool,
    mode: Option<u32>,
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

        let (hk, source_field) = if let Some(sk) = hex_field::<64>(path, obj, "privateKey")? {
            let hk = Hotkey::from_secret_key_bytes(sk.as_slice()).map_err(|_| {
                WalletError::BadField {
                    path: path.to_path_buf(),
                    field: "privateKey",
                    why: "is not a valid sr25519 secret key".to_string(),
                }
            })?;
            (hk, "privateKey")
        } else if let Some(seed) = hex_field::<32>(path, obj, "secretSeed")? {
            let hk =
                Hotkey::from_mini_secret(seed.as_slice()).map_err(|_| WalletError::BadField {
                    path: path.to_path_buf(),
                    field: "secretSeed",
                    why: "is not a valid mini secret".to_string(),
                })?;
            (hk, "secretSeed")
        } else {
            return Err(WalletError::BadField {
                    path: path.to_path_buf(),
                    field: "privateKey",
                    why: "is missing (and there is no secretSeed); is this a public-only file such as defaultpub.txt?".to_string(),
                });
        };

        let public = hk.public_key();
        let mut saw_public = false;
        for field in ["publicKey", "accountId"] {
            if let Some(pk) = hex_field::<32>(path, obj, field)? {
                saw_public = true;
                if *pk != public {
                    return Err(WalletError::KeyMismatch {
                        path: path.to_path_buf(),
                        from: source_field,
                        field,
                    });
                }
            }
        }
        if !saw_public {
            return Err(WalletError::BadField {
                path: path.to_path_buf(),
                field: "publicKey",
                why: "is missing".to_string(),
            });
        }
        let ss58 = obj
            .get("ss58Address")
            .ok_or_else(|| WalletError::BadField {
                path: path.to_path_buf(),
                field: "ss58Address",
                why: "is missing".to_string(),
            })?
            .as_str()
            .ok_or_else(|| WalletError::BadField {
                path: path.to_path_buf(),
                field: "ss58Address",
                why: "is not a string".to_string(),
            })?;
        match ss58_decode(ss58) {
            Ok((_, key)) if key == public => {}
            Ok(_) => {
                return Err(WalletError::KeyMismatch {
                    path: path.to_path_buf(),
                    from: source_field,
                    field: "ss58Address",
                })
            }
            Err(e) => {
                return Err(WalletError::BadField {
                    path: path.to_path_buf(),
                    field: "ss58Address",
                    why: format!("does not decode: {e}"),
                })
            }
        }
        Ok(LoadedHotkey {
            hotkey: hk,
            path: path.to_path_buf(),
            insecure_permissions,
            mode,
            source_field,
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

#[cfg(unix)]
fn file_mode(path: &Path) -> (bool, Option<u32>) {
    use std::os::unix::fs::PermissionsExt;
    match std::fs::metadata(path) {
        Ok(m) => {
            let mode = m.permissions().mode() & 0o7777;
            (mode & 0o077 != 0, Some(mode))
        }
        Err(_) => (false, None),
    }
}

#[cfg(not(unix))]
fn file_mode(_path: &Path) -> (bool, Option<u32>) {
    (false, None)
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
