//! The drand-timelocked weights commit of commit-reveal v4.
//!
//! The plaintext is the SCALE encoding of subtensor's `WeightsTlockPayload { hotkey: Vec<u8>,
//! uids: Vec<u16>, values: Vec<u16>, version_key: u64 }` (`coinbase/reveal_commits.rs`; the
//! hotkey is the committer's 32-byte public key, the chain drops a commit whose hotkey is
//! not the committer's). It is encrypted with tlock (Boneh–Franklin IBE on BLS12-381 with
//! the drand quicknet public key, signatures in G1 — `TinyBLS381` — and AES-GCM for the
//! body) to the identity `sha256(round as 8-byte big-endian)`, and sent as the
//! ark-serialize compressed `TLECiphertext`. All cryptography is the `timelock` crate (the
//! code subtensor decrypts with) over `w3f-bls`; nothing here is our own.

use ark_serialize::{CanonicalDeserialize, CanonicalSerialize};
use sha2::Digest;
use subxt::ext::codec::Encode;
use timelock::curves::drand::TinyBLS381;
use timelock::ibe::fullident::Identity;
use timelock::stream_ciphers::AESGCMStreamCipherProvider;
use timelock::tlock::{tld, tle, TLECiphertext};
use w3f_bls::EngineBLS;

/// The drand quicknet public key (G2, compressed, hex), as in subtensor's
/// `pallet_drand` `BeaconConfig` and bittensor-drand.
pub const DRAND_QUICKNET_PUBLIC_KEY: &str = "83cf0f2896adee7eb8b5f01fcad3912212c437e0073e911fb90022d3e760183c8c4b450b6a0a6c3ac6a5776a2d1064510d1fec758c921cc22b0e17e63aaf4bcb5ed66304de9cf809bd274ca73bab4af5a6e9c76a4bc09e76eae8991ef5ece45a";

/// Upper bound on a commit's size (`MAX_CRV3_COMMIT_SIZE_BYTES` in subtensor).
pub const MAX_COMMIT_BYTES: usize = 5000;

/// subtensor's `WeightsTlockPayload`, the plaintext of a v4 commit.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WeightsTlockPayload {
    /// The committer's hotkey, 32-byte public key.
    pub hotkey: [u8; 32],
    /// Dest uids.
    pub uids: Vec<u16>,
    /// Weights (u16 scale), one per uid.
    pub values: Vec<u16>,
    /// `version_key`.
    pub version_key: u64,
}

impl WeightsTlockPayload {
    /// The SCALE bytes: `Vec<u8>` hotkey (compact length 32), `Vec<u16>` uids,
    /// `Vec<u16>` values, `u64` version key, all little-endian.
    pub fn encode(&self) -> Vec<u8> {
        (
            self.hotkey.to_vec(),
            &self.uids,
            &self.values,
            self.version_key,
        )
            .encode()
    }

    /// sha256 of [`Self::encode`], hex (recorded with a commit).
    pub fn sha256_hex(&self) -> String {
        hex::encode(sha2::Sha256::digest(self.encode()))
    }
}

/// Timelock failures.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TlockError {
    /// The drand public key or a signature is not a valid group element.
    #[error("invalid drand {what}: {reason}")]
    Key {
        /// `public key` or `signature`.
        what: &'static str,
        /// The deserialiser's message.
        reason: String,
    },
    /// The ciphertext bytes do not parse.
    #[error("malformed timelock ciphertext: {0}")]
    Ciphertext(String),
    /// Encryption failed.
    #[error("timelock encryption failed: {0}")]
    Encrypt(String),
    /// Decryption failed (the signature is not the target round's).
    #[error("timelock decryption failed (wrong round's signature?): {0}")]
    Decrypt(String),
    /// The ciphertext exceeds [`MAX_COMMIT_BYTES`].
    #[error("commit of {0} bytes exceeds the chain's {MAX_COMMIT_BYTES}-byte limit")]
    TooLarge(usize),
}

/// The identity of drand round `round`: `sha256(round.to_be_bytes())`.
fn identity(round: u64) -> Identity {
    Identity::new(
        b"",
        vec![sha2::Sha256::digest(round.to_be_bytes()).to_vec()],
    )
}

fn public_key(hex_key: &str) -> Result<<TinyBLS381 as EngineBLS>::PublicKeyGroup, TlockError> {
    let bytes = hex::decode(hex_key).map_err(|e| TlockError::Key {
        what: "public key",
        reason: e.to_string(),
    })?;
    <TinyBLS381 as EngineBLS>::PublicKeyGroup::deserialize_compressed(&*bytes).map_err(|e| {
        TlockError::Key {
            what: "public key",
            reason: e.to_string(),
        }
    })
}

/// Encrypts `plaintext` to drand quicknet round `round`; returns the compressed
/// `TLECiphertext` bytes. `rng` supplies the ephemeral key (use `rand::rngs::OsRng`).
pub fn encrypt<R>(plaintext: &[u8], round: u64, mut rng: R) -> Result<Vec<u8>, TlockError>
where
    R: rand::RngCore + rand::CryptoRng,
{
    let pk = public_key(DRAND_QUICKNET_PUBLIC_KEY)?;
    let mut esk = [0u8; 32];
    rng.fill_bytes(&mut esk);
    let ct = tle::<TinyBLS381, AESGCMStreamCipherProvider, _>(
        pk,
        esk,
        plaintext,
        identity(round),
        &mut rng,
    )
    .map_err(|e| TlockError::Encrypt(format!("{e:?}")))?;
    let mut out = Vec::new();
    ct.serialize_compressed(&mut out)
        .map_err(|e| TlockError::Encrypt(e.to_string()))?;
    if out.len() > MAX_COMMIT_BYTES {
        return Err(TlockError::TooLarge(out.len()));
    }
    Ok(out)
}

/// Decrypts a compressed `TLECiphertext` with a drand round signature (48-byte compressed
/// G1 point), as the chain does at reveal.
pub fn decrypt(ciphertext: &[u8], signature: &[u8]) -> Result<Vec<u8>, TlockError> {
    let ct = TLECiphertext::<TinyBLS381>::deserialize_compressed(ciphertext)
        .map_err(|e| TlockError::Ciphertext(e.to_string()))?;
    let sig = <TinyBLS381 as EngineBLS>::SignatureGroup::deserialize_compressed(signature)
        .map_err(|e| TlockError::Key {
            what: "signature",
            reason: e.to_string(),
        })?;
    tld::<TinyBLS381, AESGCMStreamCipherProvider>(ct, sig)
        .map_err(|e| TlockError::Decrypt(format!("{e:?}")))
}

/// Encrypts `payload` to `round`: the commit bytes for the timelocked commit call.
pub fn commit_bytes(payload: &WeightsTlockPayload, round: u64) -> Result<Vec<u8>, TlockError> {
    encrypt(&payload.encode(), round, rand::rngs::OsRng)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// drand quicknet round 1000 (subtensor `pallets/drand/src/tests.rs` `DRAND_PULSE`).
    const SIG_1000: &str = "b44679b9a59af2ec876b1a6b1ad52ea9b1615fc3982b19576350f93447cb1125e342b73a8dd2bacbe47e4b6b63ed5e39";
    /// drand quicknet round 2000 (subtensor `pallets/commitments/src/tests.rs` `two_timelocks_partial_then_full_reveal`).
    const SIG_2000: &str = "b6cb8f482a0b15d45936a4c4ea08e98a087e71787caee3f4d07a8a9843b1bc5423c6b3c22f446488b3137eaca799c77e";

    fn payload() -> WeightsTlockPayload {
        WeightsTlockPayload {
            hotkey: [7u8; 32],
            uids: vec![0, 2, 3],
            values: vec![65535, 1, 300],
            version_key: 843_000,
        }
    }

    #[test]
    fn commit_reveal_payload_is_the_scale_struct() {
        let bytes = payload().encode();
        let mut want = vec![32u8 << 2];
        want.extend([7u8; 32]);
        want.push(3 << 2);
        want.extend([0, 0, 2, 0, 3, 0]);
        want.push(3 << 2);
        want.extend([0xff, 0xff, 1, 0, 0x2c, 0x01]);
        want.extend(843_000u64.to_le_bytes());
        assert_eq!(bytes, want);
        assert_eq!(
            payload().sha256_hex(),
            hex::encode(sha2::Sha256::digest(&want))
        );
    }

    #[test]
    fn commit_reveal_tlock_round_trip_with_a_real_quicknet_pulse() {
        let plain = payload().encode();
        let sig1000 = hex::decode(SIG_1000).unwrap();
        let sig2000 = hex::decode(SIG_2000).unwrap();
        let ct = encrypt(&plain, 1000, rand::rngs::OsRng).unwrap();
        assert_eq!(decrypt(&ct, &sig1000).unwrap(), plain);
        // another round's (valid) signature does not open it
        assert!(matches!(
            decrypt(&ct, &sig2000),
            Err(TlockError::Decrypt(_))
        ));
        let ct = encrypt(&plain, 2000, rand::rngs::OsRng).unwrap();
        assert_eq!(decrypt(&ct, &sig2000).unwrap(), plain);
        assert!(decrypt(&ct, &sig1000).is_err());
        // two encryptions of the same payload differ (fresh ephemeral key)
        let again = encrypt(&plain, 2000, rand::rngs::OsRng).unwrap();
        assert_ne!(ct, again);
    }

    #[test]
    fn commit_reveal_tlock_rejects_malformed_input_by_name() {
        let sig = hex::decode(SIG_1000).unwrap();
        assert!(matches!(
            decrypt(&[1, 2, 3], &sig),
            Err(TlockError::Ciphertext(_))
        ));
        let ct = encrypt(b"x", 1000, rand::rngs::OsRng).unwrap();
        assert!(matches!(
            decrypt(&ct, &sig[..47]),
            Err(TlockError::Key {
                what: "signature",
                ..
            })
        ));
        assert!(matches!(
            encrypt(&vec![0u8; MAX_COMMIT_BYTES], 1000, rand::rngs::OsRng),
            Err(TlockError::TooLarge(_))
        ));
    }
}
