//! Model commitment opening proofs and spec files (`engy_core::commit`, specs/SCHEME.md)
//! parsed from arbitrary JSON, then checked: `OpeningProof::verify` against its own and a
//! foreign root, `check_tensor`, `SpecFile::from_value` + `check_internal` + `diff`.
//! Never panics; a proof that verifies against a root stays verified after a JSON round
//! trip and never verifies against a different root.
#![no_main]
use engy_core::commit::{OpeningProof, SpecFile};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(value) = serde_json::from_slice::<serde_json::Value>(data) else {
        return;
    };
    if let Ok(p) = serde_json::from_value::<OpeningProof>(value.clone()) {
        let root = p.model_root.0;
        let own = p.verify(&root);
        let mut other = root;
        other[0] ^= 1;
        assert!(
            p.verify(&other).is_err(),
            "verified against a different root"
        );
        if own.is_ok() {
            let text = serde_json::to_string(&p).unwrap();
            let back: OpeningProof = serde_json::from_str(&text).unwrap();
            assert!(back.verify(&root).is_ok());
        }
        if let Err(e) = &own {
            let _ = format!("{e} {e:?}");
        }
        for t in p.tensors.iter().take(4) {
            let _ = p.check_tensor(&t.name, &t.dtype, &t.shape, data);
        }
    }
    match SpecFile::from_value(value) {
        Ok(s) => {
            let _ = s.check_internal();
            assert!(s.diff(&s).is_empty());
        }
        Err(e) => {
            let _ = format!("{e} {e:?}");
        }
    }
});
