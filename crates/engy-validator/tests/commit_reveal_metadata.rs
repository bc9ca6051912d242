//! Offline, against real runtime metadata (finney spec 365/393, devnet 240/381 in
//! `$ENGY_CHAIN_METADATA_DIR`, third-party data read from ../shared, never committed): a
//! signed `set_weights` and a signed timelocked commit built with the runtime's real
//! transaction-extension list decode back with the same metadata, no bytes left over; a
//! runtime without the commit call gives the named error.
//!
//! Unset `ENGY_CHAIN_METADATA_DIR` → a visible SKIP; set but unreadable or without
//! `*.scale` files → FAIL.

use engy_core::keys::Hotkey;
use engy_validator::chain::{
    build_signed_offline, commit_call, commit_call_in, set_weights_call, SubmitError,
    SubtensorConfig,
};
use engy_validator::commit_reveal::CommitCall;
use engy_validator::daemon::HotkeySigner;
use engy_validator::timelock::{commit_bytes, WeightsTlockPayload};
use subxt::ext::codec::Decode;
use subxt::ext::scale_value::{Composite, Value, ValueDef};

fn metadata_files() -> Option<Vec<(String, Vec<u8>)>> {
    let Ok(dir) = std::env::var("ENGY_CHAIN_METADATA_DIR") else {
        println!("SKIP commit_reveal metadata tests: set ENGY_CHAIN_METADATA_DIR (e.g. ../shared/chain/metadata; .ci/run sets it)");
        return None;
    };
    let entries = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("ENGY_CHAIN_METADATA_DIR={dir} is unreadable: {e}"));
    let mut files: Vec<(String, Vec<u8>)> = entries
        .filter_map(Result::ok)
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "scale"))
        .map(|p| {
            let bytes = std::fs::read(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
            (p.file_name().unwrap().to_string_lossy().into_owned(), bytes)
        })
        .collect();
    files.sort();
    assert!(
        !files.is_empty(),
        "ENGY_CHAIN_METADATA_DIR={dir} has no *.scale metadata files"
    );
    Some(files)
}

fn key() -> Hotkey {
    use sha2::Digest;
    Hotkey::from_mini_secret(&sha2::Sha256::digest(b"engy-sn53 commit-reveal metadata")).unwrap()
}

/// Decodes `bytes` as one extrinsic (errors on leftover bytes) and returns its pallet,
/// call and fields.
fn decode_back(bytes: Vec<u8>, metadata: subxt::Metadata) -> (String, String, Composite<u32>) {
    let xts = subxt::ext::subxt_core::blocks::Extrinsics::<SubtensorConfig>::decode_from(
        vec![bytes],
        metadata,
    )
    .expect("decodes with the same metadata, no bytes left over");
    let xt = xts.iter().next().expect("one extrinsic");
    assert!(xt.is_signed(), "signed");
    let fields = xt.field_values().expect("call fields decode");
    (
        xt.pallet_name().unwrap().to_owned(),
        xt.variant_name().unwrap().to_owned(),
        fields,
    )
}

fn field<'a>(fields: &'a Composite<u32>, name: &str) -> &'a Value<u32> {
    match fields {
        Composite::Named(f) => {
            &f.iter()
                .find(|(n, _)| n == name)
                .unwrap_or_else(|| panic!("no field {name} in {fields:?}"))
                .1
        }
        Composite::Unnamed(_) => panic!("unnamed fields {fields:?}"),
    }
}

/// The bytes of a `Vec<u8>` value, looking through single-field wrappers (`BoundedVec`).
fn bytes_of(v: &Value<u32>) -> Vec<u8> {
    match &v.value {
        ValueDef::Composite(c) => {
            let items: Vec<&Value<u32>> = c.values().collect();
            match items.as_slice() {
                [only] if matches!(only.value, ValueDef::Composite(_)) => bytes_of(only),
                _ => items
                    .iter()
                    .map(|b| b.as_u128().expect("a byte") as u8)
                    .collect(),
            }
        }
        other => panic!("not a byte sequence: {other:?}"),
    }
}

#[test]
fn commit_reveal_signed_extrinsics_decode_back_with_real_metadata() {
    let Some(files) = metadata_files() else {
        return;
    };
    let hotkey = key();
    let signer = HotkeySigner(&hotkey);
    let mut commits_built = 0;
    for (name, raw) in files {
        let metadata = subxt::Metadata::decode(&mut &raw[..])
            .unwrap_or_else(|e| panic!("{name}: metadata does not decode: {e}"));
        let build = |call: &subxt::tx::DynamicPayload| {
            build_signed_offline(
                metadata.clone(),
                [0x11; 32],
                (393, 1),
                call,
                &signer,
                7,
                (1000, [0x22; 32]),
            )
        };

        // plain set_weights
        let xt = build(&set_weights_call(53, &[2, 3], &[65535, 7], 0))
            .unwrap_or_else(|e| panic!("{name}: set_weights: {e}"));
        let (pallet, call, fields) = decode_back(xt, metadata.clone());
        assert_eq!(
            (pallet.as_str(), call.as_str()),
            ("SubtensorModule", "set_weights"),
            "{name}"
        );
        assert_eq!(field(&fields, "netuid").as_u128(), Some(53), "{name}");

        // the timelocked commit, whichever form the metadata has
        let payload = WeightsTlockPayload {
            hotkey: hotkey.public_key(),
            uids: vec![2, 3],
            values: vec![65535, 7],
            version_key: 0,
        };
        let commit = commit_bytes(&payload, 1000).unwrap();
        match commit_call_in(&metadata) {
            Some(which) => {
                let xt = build(&commit_call(which, 53, &commit, 1000, 4))
                    .unwrap_or_else(|e| panic!("{name}: {}: {e}", which.name()));
                let (pallet, call, fields) = decode_back(xt, metadata.clone());
                assert_eq!(
                    (pallet.as_str(), call.as_str()),
                    ("SubtensorModule", which.name())
                );
                assert_eq!(bytes_of(field(&fields, "commit")), commit, "{name}");
                assert_eq!(
                    field(&fields, "reveal_round").as_u128(),
                    Some(1000),
                    "{name}"
                );
                assert_eq!(field(&fields, "commit_reveal_version").as_u128(), Some(4));
                if which == CommitCall::TimelockedMechanismWeights {
                    assert_eq!(field(&fields, "mecid").as_u128(), Some(0), "{name}");
                }
                commits_built += 1;
                println!(
                    "{name}: set_weights and {} build, sign and decode back",
                    which.name()
                );
            }
            None => {
                // a runtime without CRv4: asking for the call is a named error
                for which in [
                    CommitCall::TimelockedMechanismWeights,
                    CommitCall::TimelockedWeights,
                ] {
                    let e = build(&commit_call(which, 53, &commit, 1000, 4)).unwrap_err();
                    assert_eq!(
                        e,
                        SubmitError::MissingCall {
                            pallet: "SubtensorModule".into(),
                            call: which.name().into()
                        },
                        "{name}"
                    );
                    assert!(e.to_string().contains(which.name()));
                }
                println!("{name}: set_weights builds; no timelocked commit call (named error)");
            }
        }
    }
    assert!(
        commits_built > 0,
        "no metadata file had a timelocked commit call"
    );
}
