//! Decryption of bittensor-wallet's NaCl-encrypted keyfiles (`$NACL`), the format `btcli`
//! writes for a hotkey or coldkey created with a password.
//!
//! The format, as opentensor/btwallet `src/keyfile.rs` (`encrypt_keyfile_data`,
//! `decrypt_keyfile_data`, `derive_key`; the Rust source of PyPI `bittensor-wallet` 4.x)
//! writes it with libsodium (sodiumoxide), checked against files PyPI bittensor-wallet 4.1.1
//! encrypts (`tests/nacl_keyfile.rs`, `tests/vectors/keys/nacl/`):
//!
//! ```text
//! file   = "$NACL" || nonce (24 bytes) || box
//! box    = crypto_secretbox_easy(keyfile JSON, nonce, key)
//!        = Poly1305 tag (16 bytes) || XSalsa20 ciphertext (as long as the JSON)
//! key    = crypto_pwhash argon2i13(password bytes, NACL_SALT, OPSLIMIT_SENSITIVE,
//!                                  MEMLIMIT_SENSITIVE), 32 bytes
//!        = Argon2i v1.3, t = 8 passes, m = 536870912 bytes = 524288 KiB, p = 1 lane
//! ```
//!
//! The salt is one fixed 16-byte constant for every file (`NACL_SALT` in btwallet), so the
//! key depends on the password alone; the nonce is random per file. The password is the
//! UTF-8 bytes of the string bittensor-wallet was given, unmodified (`btcli`'s prompt trims
//! surrounding whitespace before it gets there). A wrong password and a box altered after
//! encryption are the same event to the secretbox: the tag does not authenticate.
//!
//! Cost: one derivation needs 512 MiB of memory and takes seconds (libsodium's "sensitive"
//! limits); it runs once, when the hotkey is loaded. Cryptography is RustCrypto's (`argon2`,
//! `crypto_secretbox`); this module only lays out the bytes.

use std::fmt;

use argon2::{Algorithm, Argon2, Block, Params, Version};
use crypto_secretbox::aead::{Aead, KeyInit};
use crypto_secretbox::{Nonce, XSalsa20Poly1305};
use zeroize::Zeroizing;

/// The five bytes that start a NaCl keyfile.
pub const NACL_PREFIX: &[u8] = b"$NACL";
/// The fixed Argon2i salt of every `$NACL` keyfile (btwallet `NACL_SALT`).
pub const NACL_SALT: [u8; 16] = *b"\x13q\x83\xdf\xf1Z\t\xbc\x9c\x90\xb5Q\x879\xe9\xb1";
/// Argon2i passes: libsodium `crypto_pwhash_argon2i_OPSLIMIT_SENSITIVE`.
pub const ARGON2I_T_COST: u32 = 8;
/// Argon2i memory in KiB: libsodium `crypto_pwhash_argon2i_MEMLIMIT_SENSITIVE`
/// (536870912 bytes) / 1024, as libsodium passes it to Argon2.
pub const ARGON2I_M_COST_KIB: u32 = 536_870_912 / 1024;
/// Argon2i lanes: libsodium's `crypto_pwhash` always uses one.
pub const ARGON2I_P_COST: u32 = 1;
/// XSalsa20 nonce length (`crypto_secretbox_NONCEBYTES`).
pub const NONCE_LEN: usize = 24;
/// Poly1305 tag length (`crypto_secretbox_MACBYTES`).
pub const TAG_LEN: usize = 16;
/// The shortest well-formed `$NACL` file: prefix, nonce and tag around an empty message.
pub const MIN_NACL_LEN: usize = NACL_PREFIX.len() + NONCE_LEN + TAG_LEN;

/// A wallet password: its bytes, zeroized on drop, never shown by `Debug`.
///
/// bittensor-wallet derives the key from the password's UTF-8 bytes exactly as given, so
/// nothing here trims or normalises; a caller that reads it from a file strips the line end.
pub struct WalletPassword(Zeroizing<Vec<u8>>);

impl WalletPassword {
    /// Take ownership of the password bytes (the caller's buffer is moved, not copied).
    pub fn new(bytes: Vec<u8>) -> Self {
        Self(Zeroizing::new(bytes))
    }

    /// The password bytes.
    pub fn as_bytes(&self) -> &[u8] {
        &self.0
    }
}

impl From<String> for WalletPassword {
    fn from(s: String) -> Self {
        Self::new(s.into_bytes())
    }
}

impl fmt::Debug for WalletPassword {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("WalletPassword(<redacted>)")
    }
}

/// Why a `$NACL` keyfile did not decrypt. Carries no secret material.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NaclError {
    /// The data does not start with `$NACL`.
    #[error("not a NaCl keyfile: it does not start with \"$NACL\"")]
    NotNacl,
    /// Shorter than prefix + nonce + tag: cut short (a partial copy, a truncated write).
    #[error("truncated: {len} bytes, a NaCl keyfile has at least {MIN_NACL_LEN} (\"$NACL\", a {NONCE_LEN}-byte nonce and a {TAG_LEN}-byte tag before the ciphertext)")]
    Truncated {
        /// Length found.
        len: usize,
    },
    /// The Poly1305 tag does not authenticate under the key from this password: the
    /// password is wrong (or the ciphertext was altered after encryption, which the
    /// secretbox cannot tell apart).
    #[error("wrong password: the secretbox does not authenticate with the key derived from it (a file altered or cut short after encryption fails the same way)")]
    WrongPassword,
    /// The 512 MiB of Argon2i memory could not be allocated.
    #[error("cannot allocate the {} MiB the Argon2i key derivation needs", ARGON2I_M_COST_KIB / 1024)]
    OutOfMemory,
    /// Argon2 refused its inputs (cannot happen with the fixed parameters; kept typed).
    #[error("Argon2i key derivation failed: {0}")]
    KeyDerivation(String),
}

/// Derive the 32-byte secretbox key from `password` as bittensor-wallet does (Argon2i v1.3,
/// [`NACL_SALT`], t = [`ARGON2I_T_COST`], m = [`ARGON2I_M_COST_KIB`] KiB, p = 1).
///
/// Allocates 512 MiB for the duration of the call (zeroized before it is freed).
/// Errors: [`NaclError::OutOfMemory`], [`NaclError::KeyDerivation`].
pub fn derive_key(password: &WalletPassword) -> Result<Zeroizing<[u8; 32]>, NaclError> {
    let params = Params::new(ARGON2I_M_COST_KIB, ARGON2I_T_COST, ARGON2I_P_COST, Some(32))
        .map_err(|e| NaclError::KeyDerivation(e.to_string()))?;
    let argon = Argon2::new(Algorithm::Argon2i, Version::V0x13, params);
    let blocks = ARGON2I_M_COST_KIB as usize;
    let mut memory: Zeroizing<Vec<Block>> = Zeroizing::new(Vec::new());
    memory
        .try_reserve_exact(blocks)
        .map_err(|_| NaclError::OutOfMemory)?;
    memory.resize(blocks, Block::default());
    let mut key = Zeroizing::new([0u8; 32]);
    argon
        .hash_password_into_with_memory(
            password.as_bytes(),
            &NACL_SALT,
            key.as_mut_slice(),
            memory.as_mut_slice(),
        )
        .map_err(|e| NaclError::KeyDerivation(e.to_string()))?;
    Ok(key)
}

/// Decrypt a `$NACL` keyfile with `password`, returning the keyfile JSON bytes (zeroized
/// on drop).
///
/// The layout is checked before the (costly) key derivation, so a truncated file fails at
/// once. Errors: [`NaclError::NotNacl`], [`NaclError::Truncated`],
/// [`NaclError::WrongPassword`], and those of [`derive_key`].
pub fn decrypt(data: &[u8], password: &WalletPassword) -> Result<Zeroizing<Vec<u8>>, NaclError> {
    let body = data.strip_prefix(NACL_PREFIX).ok_or(NaclError::NotNacl)?;
    if data.len() < MIN_NACL_LEN {
        return Err(NaclError::Truncated { len: data.len() });
    }
    let (nonce, sealed) = body.split_at(NONCE_LEN);
    let key = derive_key(password)?;
    let cipher = XSalsa20Poly1305::new(key.as_slice().into());
    cipher
        .decrypt(Nonce::from_slice(nonce), sealed)
        .map(Zeroizing::new)
        .map_err(|_| NaclError::WrongPassword)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layout_errors_come_before_the_key_derivation() {
        let pw = WalletPassword::from("pw".to_string());
        assert_eq!(decrypt(b"{\"a\":1}", &pw).unwrap_err(), NaclError::NotNacl);
        for len in [0, 5, 28, MIN_NACL_LEN - 1] {
            let mut data = b"$NACL".to_vec();
            data.resize(len.max(5), 0);
            let got = decrypt(&data, &pw).unwrap_err();
            assert_eq!(got, NaclError::Truncated { len: data.len() });
        }
    }

    #[test]
    fn password_debug_is_redacted() {
        let pw = WalletPassword::from("hunter2-secret".to_string());
        assert_eq!(format!("{pw:?}"), "WalletPassword(<redacted>)");
    }
}
