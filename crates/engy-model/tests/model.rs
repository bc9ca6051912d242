//! The generated devnet checkpoint and its forward pass: determinism, file layout, KV-cache
//! decoding against the teacher-forced pass, the int4 cheat, and error paths.
mod common;

use std::path::Path;

use engy_model::{
    corpus, gen_model, Checkpoint, Compute, GenConfig, LoadOptions, Model, ModelError, Precision,
    Residency,
};

const SEED: u64 = 53;

/// One generated checkpoint shared by the tests of this binary.
fn checkpoint_dir() -> &'static Path {
    common::generated_checkpoint(SEED)
}

fn chat_prompt(ck: &Checkpoint, user: &str) -> Vec<u32> {
    let text = format!("<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n");
    ck.tokenizer
        .encode(text.as_str(), false)
        .unwrap()
        .get_ids()
        .to_vec()
}

fn read_all(dir: &Path) -> Vec<(String, Vec<u8>)> {
    let mut v: Vec<_> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| {
            let p = e.unwrap().path();
            (
                p.file_name().unwrap().to_string_lossy().into_owned(),
                std::fs::read(&p).unwrap(),
            )
        })
        .collect();
    v.sort();
    v
}

#[test]
fn same_seed_gives_identical_bytes_and_other_seed_differs() {
    let t = tempfile::tempdir().unwrap();
    let a = t.path().join("a");
    gen_model(&a, SEED, &GenConfig::default()).unwrap();
    let again = read_all(&a);
    let first = read_all(checkpoint_dir());
    assert_eq!(first.len(), again.len());
    for ((n1, b1), (n2, b2)) in first.iter().zip(&again) {
        assert_eq!(n1, n2);
        assert!(b1 == b2, "{n1} differs between two runs with the same seed");
    }
    let b = t.path().join("b");
    gen_model(&b, SEED + 1, &GenConfig::default()).unwrap();
    let other = read_all(&b);
    let shard = |v: &[(String, Vec<u8>)]| {
        v.iter()
            .find(|(n, _)| n == "model-00001-of-00002.safetensors")
            .unwrap()
            .1
            .clone()
    };
    assert_ne!(shard(&first), shard(&other));
}

#[test]
fn checkpoint_has_the_hugging_face_layout() {
    let dir = checkpoint_dir();
    let names: Vec<String> = read_all(dir).into_iter().map(|(n, _)| n).collect();
    for f in [
        "config.json",
        "generation_config.json",
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
        "model.safetensors.index.json",
        "tokenizer.json",
        "tokenizer_config.json",
    ] {
        assert!(names.iter().any(|n| n == f), "{f} missing from {names:?}");
    }
    let cfg: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.join("config.json")).unwrap()).unwrap();
    assert_eq!(cfg["model_type"], "qwen3_moe");
    assert_eq!(cfg["torch_dtype"], "bfloat16");
    assert!(cfg["num_experts"].as_u64().unwrap() > 0);
    let tc: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.join("tokenizer_config.json")).unwrap()).unwrap();
    assert_eq!(tc["eos_token"], "<|im_end|>");
    assert!(tc["chat_template"]
        .as_str()
        .unwrap()
        .contains("<|im_start|>"));
    // The index maps every tensor to a shard that exists.
    let idx: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.join("model.safetensors.index.json")).unwrap())
            .unwrap();
    for (_, f) in idx["weight_map"].as_object().unwrap() {
        assert!(dir.join(f.as_str().unwrap()).is_file());
    }
    // Special tokens are single tokens.
    let ck = Checkpoint::open(dir, Precision::Bf16).unwrap();
    let ids = ck
        .tokenizer
        .encode("<|im_start|>user\nhi<|im_end|>", false)
        .unwrap()
        .get_ids()
        .to_vec();
    assert_eq!(
        ids.first(),
        ck.tokenizer.token_to_id("<|im_start|>").as_ref()
    );
    assert_eq!(ids.last(), ck.tokenizer.token_to_id("<|im_end|>").as_ref());
    assert_eq!(ck.model_root.len(), 64);
}

#[test]
fn kv_cache_decoding_matches_the_teacher_forced_pass() {
    for compute in [Compute::F32, Compute::Bf16] {
        kv_cache_matches(compute);
    }
}

fn kv_cache_matches(compute: Compute) {
    let ck = Checkpoint::open_with(checkpoint_dir(), Precision::Bf16, compute).unwrap();
    let stop = ck.stop_ids();
    let mut worst = 0f32;
    let mut rows_total = 0usize;
    let mut bf16_differ = 0usize;
    for p in corpus::sample_prompts(1, 6) {
        let prompt = chat_prompt(&ck, &p);
        let steps = ck.model.generate(&prompt, 96, &stop).unwrap();
        assert!(!steps.is_empty());
        // Step 0 returns every prompt row; later steps one row each.
        assert_eq!(steps[0].hidden.len(), prompt.len());
        assert!(steps[1..].iter().all(|s| s.hidden.len() == 1));
        let out: Vec<u32> = steps.iter().map(|s| s.token_id).collect();
        let mut full = prompt.clone();
        full.extend(&out[..out.len() - 1]);
        let tf = ck.model.hidden_states(&full).unwrap();
        assert_eq!(tf.len(), full.len());
        for (j, s) in steps.iter().enumerate() {
            let row = s.hidden.last().unwrap();
            let want = &tf[prompt.len() - 1 + j];
            for (a, b) in row.iter().zip(want) {
                worst = worst.max((a - b).abs() / b.abs().max(1e-3));
                if half::bf16::from_f32(*a) != half::bf16::from_f32(*b) {
                    bf16_differ += 1;
                }
            }
            rows_total += 1;
        }
        // Greedy from the teacher-forced logits picks the same tokens.
        let logits = ck
            .model
            .logits(&candle_core::Tensor::new(tf.clone(), &candle_core::Device::Cpu).unwrap())
            .unwrap()
            .to_vec2::<f32>()
            .unwrap();
        for (j, t) in out.iter().enumerate() {
            let l = &logits[prompt.len() - 1 + j];
            let arg = (0..l.len()).fold(0, |b, i| if l[i] > l[b] { i } else { b });
            assert_eq!(arg as u32, *t);
        }
    }
    eprintln!(
        "{compute:?} activations, decode vs teacher-forced: {rows_total} rows, worst relative \
         diff {worst:e}, {bf16_differ} bf16 values differ"
    );
    assert!(worst < 1e-3, "worst relative difference {worst}");
}

#[test]
fn greedy_text_is_varied_and_not_immediately_finished() {
    let ck = Checkpoint::open(checkpoint_dir(), Precision::Bf16).unwrap();
    let stop = ck.stop_ids();
    for p in corpus::sample_prompts(2, 5) {
        let prompt = chat_prompt(&ck, &p);
        let steps = ck.model.generate(&prompt, 120, &stop).unwrap();
        let out: Vec<u32> = steps.iter().map(|s| s.token_id).collect();
        let distinct: std::collections::HashSet<_> = out.iter().collect();
        let text = ck.tokenizer.decode(&out, true).unwrap();
        eprintln!("{p:?} -> {} tokens: {text:?}", out.len());
        assert!(out.len() >= 4, "finished after {} tokens", out.len());
        let longest_run = out
            .chunk_by(|a, b| a == b)
            .map(|c| c.len())
            .max()
            .unwrap_or(0);
        assert!(
            distinct.len() >= 8.min(out.len()) && longest_run <= 3,
            "degenerate: {} distinct in {}, longest single-token run {longest_run}",
            distinct.len(),
            out.len()
        );
    }
}

#[test]
fn int4_cheat_changes_hidden_states_but_not_the_root() {
    let dir = checkpoint_dir();
    let honest = Checkpoint::open(dir, Precision::Bf16).unwrap();
    let cheat = Checkpoint::open(dir, Precision::Int4 { group_size: 32 }).unwrap();
    assert_eq!(honest.model_root, cheat.model_root);
    let ids = chat_prompt(&honest, "What does the miner do?");
    let a = honest.model.hidden_states(&ids).unwrap();
    let b = cheat.model.hidden_states(&ids).unwrap();
    let (mut num, mut den) = (0f64, 0f64);
    for (ra, rb) in a.iter().zip(&b) {
        for (x, y) in ra.iter().zip(rb) {
            num += ((x - y) as f64).powi(2);
            den += (*x as f64).powi(2);
        }
    }
    let rel = (num / den).sqrt();
    eprintln!("int4 relative hidden-state error: {rel:.3}");
    assert!(rel > 0.05, "int4 barely changed the hidden states ({rel})");
}

#[test]
fn bad_inputs_are_typed_errors() {
    let dir = checkpoint_dir();
    let m = Model::load(dir, Precision::Bf16).unwrap();
    let vocab = m.config().vocab_size as u32;
    assert!(matches!(
        m.hidden_states(&[1, vocab]),
        Err(ModelError::TokenOutOfVocab { id, .. }) if id == vocab
    ));
    assert!(matches!(m.hidden_states(&[]), Err(ModelError::EmptyInput)));
    let long = vec![1u32; m.config().max_position_embeddings + 1];
    assert!(matches!(m.decoder(&long), Err(ModelError::TooLong { .. })));

    // A checkpoint with a shard missing names the missing tensor.
    let t = tempfile::tempdir().unwrap();
    for f in ["config.json", "model-00001-of-00002.safetensors"] {
        std::fs::copy(dir.join(f), t.path().join(f)).unwrap();
    }
    assert!(matches!(
        Model::load(t.path(), Precision::Bf16),
        Err(ModelError::MissingTensor(_))
    ));
    // A corrupt shard is a safetensors error, not a panic.
    std::fs::write(
        t.path().join("model-00002-of-00002.safetensors"),
        b"garbage",
    )
    .unwrap();
    assert!(matches!(
        Model::load(t.path(), Precision::Bf16),
        Err(ModelError::Safetensors { .. })
    ));
    // A config.json whose vocab_size is not the embedding's rows fails at open whether the
    // weights stream or stay resident (streaming checks plain tensors from the shard header),
    // not at first use as a token "outside the vocabulary" (the miner's fault) or never.
    let t = tempfile::tempdir().unwrap();
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        std::fs::copy(&p, t.path().join(p.file_name().unwrap())).unwrap();
    }
    let mut cfg: serde_json::Value =
        serde_json::from_slice(&std::fs::read(t.path().join("config.json")).unwrap()).unwrap();
    cfg["vocab_size"] = (vocab as u64 + 100).into();
    std::fs::write(t.path().join("config.json"), cfg.to_string()).unwrap();
    for residency in [Residency::Streaming, Residency::Resident] {
        let opts = LoadOptions {
            residency,
            ..LoadOptions::default()
        };
        let r = Model::open(t.path(), &opts);
        assert!(
            matches!(&r, Err(ModelError::Shape { name, .. }) if name.contains("embed_tokens")),
            "{residency:?}: {:?}",
            r.err()
        );
    }
    // No config.json.
    let empty = tempfile::tempdir().unwrap();
    assert!(matches!(
        Model::load(empty.path(), Precision::Bf16),
        Err(ModelError::Io { .. })
    ));
}
