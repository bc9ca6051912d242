//! What a pass keeps in its cache, on every architecture's tiny checkpoint of
//! `tests/vectors/arch` (on `$ENGY_TEST_DEVICE`): a one-pass cache (`KvCache::one_pass`, an
//! audit's teacher-forced recompute) gives the same hidden states as a kept cache, keeps no
//! layer state, and refuses to be continued. (That a kept Gated DeltaNet conv state is its
//! own tensor, not a view keeping the layer's whole conv input alive, is checked beside the
//! tensor path: `qwen3_5_moe`'s `the_tensor_delta_net_is_the_host_delta_net`.)
mod common;

use engy_model::arch::Probe;
use engy_model::{KvCache, LoadOptions, Model, ModelError, Residency};

/// The architectures with a tiny checkpoint in `tests/vectors/arch`.
const ARCHES: [&str; 3] = ["qwen3_moe", "qwen3_5_moe", "glm_moe_dsa"];

fn open(arch: &str) -> Model {
    let dir = common::vectors_dir().join(arch);
    let opts = LoadOptions {
        residency: Residency::Streaming,
        device: common::test_device(),
        ..LoadOptions::default()
    };
    Model::open(&dir, &opts).unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
}

/// 24 ids spread over the vocabulary (enough rows for a chunk of the delta rule and for the
/// DSA indexer to select).
fn ids(model: &Model) -> Vec<u32> {
    let vocab = model.config().vocab_size as u32;
    (0..24u32).map(|i| (i * 7919 + 11) % vocab).collect()
}

#[test]
fn a_one_pass_cache_gives_the_same_states_keeps_nothing_and_is_not_continued() {
    for arch in ARCHES {
        let model = open(arch);
        let ids = ids(&model);
        let mut kept = model.new_cache();
        let want = model.forward(&ids, &mut kept).unwrap();
        assert!(kept.keeps_layers());
        assert_eq!(
            kept.layers.len(),
            model.config().num_hidden_layers,
            "{arch}"
        );

        let mut once = KvCache::one_pass();
        assert!(!once.keeps_layers());
        let got = model
            .forward_probed(&ids, &mut once, &mut Probe::default())
            .unwrap();
        assert_eq!(
            got.to_vec2::<f32>().unwrap(),
            want.to_vec2::<f32>().unwrap(),
            "{arch}: a one-pass cache changed the hidden states"
        );
        assert!(
            once.layers.is_empty(),
            "{arch}: a one-pass cache kept layer state"
        );
        assert_eq!(once.len, ids.len());

        // Continuing it would run the next ids without their past: refused, and the cache
        // is left as it was.
        let err = model.forward(&ids[..4], &mut once).unwrap_err();
        assert!(
            matches!(&err, ModelError::Config(m) if m.contains("one pass")),
            "{arch}: {err}"
        );
        assert_eq!(once.len, ids.len());

        // A kept cache continues (the decoder's path).
        model.forward(&ids[..4], &mut kept).unwrap();
        assert_eq!(kept.len, ids.len() + 4);
    }
}
