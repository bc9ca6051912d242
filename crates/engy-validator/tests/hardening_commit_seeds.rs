//! Opening proofs of a real generated checkpoint (the devnet model, engy-model) verify
//! against its root, survive JSON, and fail against any other root or after any one-byte
//! change of their JSON that still parses. With `ENGY_FUZZ_SEED_DIR` set, the proofs are
//! also written there as seeds for the `commit_proof` fuzz target
//! (`ENGY_FUZZ_SEED_DIR=fuzz/seeds/commit_proof cargo test -p engy-validator --test hardening_commit_seeds`).

use engy_core::commit::{
    commit_checkpoint, CommitOptions, LayerPart, OpeningProof, Progress, UnitId,
};

#[test]
fn opening_proofs_of_a_generated_checkpoint_resist_one_byte_edits() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = engy_model::GenConfig {
        num_hidden_layers: 2,
        corpus_docs: 60,
        ..engy_model::GenConfig::default()
    };
    engy_model::gen_model(dir.path(), 7, &cfg).unwrap();
    let c = commit_checkpoint(dir.path(), &CommitOptions::default(), &Progress::default()).unwrap();
    let units = [
        UnitId::Globals,
        UnitId::Lm,
        UnitId::Layer {
            layer: 0,
            part: LayerPart::Attn,
        },
        UnitId::Layer {
            layer: 0,
            part: LayerPart::Mlp,
        },
        UnitId::Layer {
            layer: 1,
            part: LayerPart::Router,
        },
        UnitId::Layer {
            layer: 1,
            part: LayerPart::Expert(1),
        },
    ];
    let seed_dir = std::env::var_os("ENGY_FUZZ_SEED_DIR").map(std::path::PathBuf::from);
    let mut opened = 0;
    for unit in units {
        let Ok(p) = c.open(unit) else { continue };
        opened += 1;
        p.verify(&c.model_root).unwrap();
        let text = serde_json::to_string(&p).unwrap();
        if let Some(d) = &seed_dir {
            std::fs::create_dir_all(d).unwrap();
            std::fs::write(
                d.join(format!("{unit}.json").replace([' ', '/'], "_")),
                &text,
            )
            .unwrap();
        }
        let mut other = c.model_root;
        other[31] ^= 0x80;
        assert!(p.verify(&other).is_err(), "{unit}");
        // every one-byte change that still parses as a proof fails verification
        let bytes = text.as_bytes();
        let step = (bytes.len() / 400).max(1);
        for i in (0..bytes.len()).step_by(step) {
            let mut b = bytes.to_vec();
            b[i] = if b[i].is_ascii_digit() {
                b'0' + (b[i] - b'0' + 1) % 10
            } else if b[i].is_ascii_hexdigit() {
                b'0'
            } else {
                b'x'
            };
            if b == bytes {
                continue;
            }
            if let Ok(q) = serde_json::from_slice::<OpeningProof>(&b) {
                if q != p {
                    assert!(
                        q.verify(&c.model_root).is_err(),
                        "{unit}: edit at byte {i} still verifies"
                    );
                }
            }
        }
    }
    assert!(opened >= 4, "only {opened} units opened");
}
