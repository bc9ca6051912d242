//! Weight commitments (`engy_core::commit`, specs/SCHEME.md) on checkpoints these tests
//! generate with the safetensors crate: bf16 and FP8 block formats with scales, NVFP4,
//! sharded across files, dense + MoE layers in Qwen3-MoE and GLM (DeepSeek-V3) naming.
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use engy_core::commit::{
    self, checkpoint, spec, CommitError, CommitOptions, Commitment, LayerPart, OpeningProof,
    Progress, ProofError, SpecFile, UnitId,
};
use safetensors::{Dtype, SafeTensors};
use serde_json::json;

#[derive(Clone, Copy, PartialEq)]
enum Naming {
    Glm,
    QwenMoe,
    /// Dense Qwen3 (the devnet model's names).
    QwenDense,
}

#[derive(Clone, Copy, PartialEq)]
enum Quant {
    Bf16,
    Fp8,
    Nvfp4,
}

#[derive(Clone)]
struct Model {
    naming: Naming,
    quant: Quant,
    n_layers: usize,
    first_dense: usize,
    n_experts: usize,
    hidden: usize,
    d_ff: usize,
    vocab: usize,
    shards: usize,
    /// Routed experts stacked in `mlp.experts.gate_up_proj` / `mlp.experts.down_proj` (bf16).
    fused: bool,
}

impl Model {
    fn new(naming: Naming, quant: Quant) -> Self {
        Self {
            naming,
            quant,
            n_layers: 3,
            first_dense: 1,
            n_experts: 4,
            hidden: 8,
            d_ff: 4,
            vocab: 16,
            shards: 3,
            fused: false,
        }
    }

    fn config(&self) -> serde_json::Value {
        let mut c = match self.naming {
            Naming::Glm => json!({
                "model_type": "glm4_moe", "num_hidden_layers": self.n_layers, "hidden_size": self.hidden,
                "intermediate_size": 32, "moe_intermediate_size": self.d_ff, "n_routed_experts": self.n_experts,
                "num_experts_per_tok": 2, "first_k_dense_replace": self.first_dense, "vocab_size": self.vocab,
                "torch_dtype": "bfloat16"
            }),
            Naming::QwenMoe => json!({
                "model_type": "qwen3_moe", "num_hidden_layers": self.n_layers, "hidden_size": self.hidden,
                "intermediate_size": 32, "moe_intermediate_size": self.d_ff, "num_experts": self.n_experts,
                "num_experts_per_tok": 2, "mlp_only_layers": (0..self.first_dense).collect::<Vec<_>>(),
                "vocab_size": self.vocab, "torch_dtype": "bfloat16"
            }),
            Naming::QwenDense => json!({
                "model_type": "qwen3", "num_hidden_layers": self.n_layers, "hidden_size": self.hidden,
                "intermediate_size": self.d_ff, "vocab_size": self.vocab, "torch_dtype": "bfloat16"
            }),
        };
        match self.quant {
            Quant::Bf16 => {}
            Quant::Fp8 => {
                c["quantization_config"] =
                    json!({"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]})
            }
            Quant::Nvfp4 => {
                c["quantization_config"] =
                    json!({"quant_method": "modelopt", "quant_algo": "NVFP4"})
            }
        }
        c
    }

    /// (name, dtype, shape) of every tensor.
    fn tensors(&self) -> Vec<(String, Dtype, Vec<usize>)> {
        let (h, f, v) = (self.hidden, self.d_ff, self.vocab);
        let mut out = vec![
            (
                "model.embed_tokens.weight".to_string(),
                Dtype::BF16,
                vec![v, h],
            ),
            ("model.norm.weight".to_string(), Dtype::BF16, vec![h]),
            ("lm_head.weight".to_string(), Dtype::BF16, vec![v, h]),
        ];
        let q = self.quant;
        let linear = |out: &mut Vec<(String, Dtype, Vec<usize>)>,
                      base: String,
                      o: usize,
                      i: usize| match q {
            Quant::Bf16 => out.push((format!("{base}.weight"), Dtype::BF16, vec![o, i])),
            Quant::Fp8 => {
                out.push((format!("{base}.weight"), Dtype::F8_E4M3, vec![o, i]));
                out.push((
                    format!("{base}.weight_scale_inv"),
                    Dtype::F32,
                    vec![o.div_ceil(128), i.div_ceil(128)],
                ));
            }
            Quant::Nvfp4 => {
                out.push((format!("{base}.weight"), Dtype::U8, vec![o, i / 2]));
                out.push((
                    format!("{base}.weight_scale"),
                    Dtype::F8_E4M3,
                    vec![o, i / 16],
                ));
                out.push((format!("{base}.weight_scale_2"), Dtype::F32, vec![]));
                out.push((format!("{base}.input_scale"), Dtype::F32, vec![]));
            }
        };
        for l in 0..self.n_layers {
            let p = format!("model.layers.{l}");
            out.push((format!("{p}.input_layernorm.weight"), Dtype::BF16, vec![h]));
            out.push((
                format!("{p}.post_attention_layernorm.weight"),
                Dtype::BF16,
                vec![h],
            ));
            for proj in ["q_proj", "k_proj", "v_proj", "o_proj"] {
                linear(&mut out, format!("{p}.self_attn.{proj}"), h, h);
            }
            let moe = self.naming != Naming::QwenDense && l >= self.first_dense;
            if !moe {
                let ff = if self.naming == Naming::QwenDense {
                    f
                } else {
                    32
                };
                linear(&mut out, format!("{p}.mlp.gate_proj"), ff, h);
                linear(&mut out, format!("{p}.mlp.up_proj"), ff, h);
                linear(&mut out, format!("{p}.mlp.down_proj"), h, ff);
                continue;
            }
            out.push((
                format!("{p}.mlp.gate.weight"),
                Dtype::BF16,
                vec![self.n_experts, h],
            ));
            let shared = match self.naming {
                Naming::Glm => {
                    out.push((
                        format!("{p}.mlp.gate.e_score_correction_bias"),
                        Dtype::F32,
                        vec![self.n_experts],
                    ));
                    format!("{p}.mlp.shared_experts")
                }
                _ => {
                    out.push((
                        format!("{p}.mlp.shared_expert_gate.weight"),
                        Dtype::BF16,
                        vec![1, h],
                    ));
                    format!("{p}.mlp.shared_expert")
                }
            };
            linear(&mut out, format!("{shared}.gate_proj"), f, h);
            linear(&mut out, format!("{shared}.up_proj"), f, h);
            linear(&mut out, format!("{shared}.down_proj"), h, f);
            if self.fused {
                let n = self.n_experts;
                out.push((
                    format!("{p}.mlp.experts.gate_up_proj"),
                    Dtype::BF16,
                    vec![n, 2 * f, h],
                ));
                out.push((
                    format!("{p}.mlp.experts.down_proj"),
                    Dtype::BF16,
                    vec![n, h, f],
                ));
                continue;
            }
            for e in 0..self.n_experts {
                linear(&mut out, format!("{p}.mlp.experts.{e}.gate_proj"), f, h);
                linear(&mut out, format!("{p}.mlp.experts.{e}.up_proj"), f, h);
                linear(&mut out, format!("{p}.mlp.experts.{e}.down_proj"), h, f);
            }
        }
        out
    }

    /// Writes config.json + `shards` safetensors files (round-robin) + index.json.
    fn write(&self, dir: &Path) {
        std::fs::create_dir_all(dir).unwrap();
        std::fs::write(dir.join("config.json"), self.config().to_string()).unwrap();
        let tensors = self.tensors();
        let data: Vec<Vec<u8>> = tensors
            .iter()
            .map(|(name, dtype, shape)| {
                let n = shape.iter().product::<usize>() * dtype.bitsize() / 8;
                // Deterministic bytes that differ per tensor.
                let seed = name
                    .bytes()
                    .fold(0u32, |a, b| a.wrapping_mul(31).wrapping_add(b as u32));
                (0..n)
                    .map(|i| (seed.wrapping_add(i as u32 * 7919) >> 3) as u8)
                    .collect()
            })
            .collect();
        let mut weight_map = serde_json::Map::new();
        for s in 0..self.shards {
            let file = format!("model-{:05}-of-{:05}.safetensors", s + 1, self.shards);
            let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = tensors
                .iter()
                .zip(&data)
                .enumerate()
                .filter(|(i, _)| i % self.shards == s)
                .map(|(_, ((name, dtype, shape), bytes))| {
                    weight_map.insert(name.clone(), json!(file));
                    (
                        name.clone(),
                        safetensors::tensor::TensorView::new(*dtype, shape.clone(), bytes).unwrap(),
                    )
                })
                .collect();
            safetensors::serialize_to_file(views, None, &dir.join(&file)).unwrap();
        }
        std::fs::write(
            dir.join("model.safetensors.index.json"),
            json!({"metadata": {}, "weight_map": weight_map}).to_string(),
        )
        .unwrap();
    }
}

fn build(dir: &Path) -> Result<Commitment, CommitError> {
    commit::commit_checkpoint(dir, &CommitOptions::default(), &Progress::default())
}

fn gen(m: &Model) -> (tempfile::TempDir, PathBuf) {
    let t = tempfile::tempdir().unwrap();
    let dir = t.path().join("ckpt");
    m.write(&dir);
    (t, dir)
}

/// Flips one byte of tensor `name`'s data in whichever shard holds it.
fn flip_byte(dir: &Path, name: &str, at: usize) {
    for shard in checkpoint::list_shards(dir).unwrap() {
        let mut bytes = std::fs::read(&shard).unwrap();
        let (start, len) = {
            let st = SafeTensors::deserialize(&bytes).unwrap();
            let Ok(view) = st.tensor(name) else { continue };
            let header_len = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
            let data_start = 8 + header_len;
            let off = view.data().as_ptr() as usize - bytes.as_ptr() as usize;
            assert!(off >= data_start);
            (off, view.data().len())
        };
        assert!(at < len);
        bytes[start + at] ^= 0x01;
        std::fs::write(&shard, bytes).unwrap();
        return;
    }
    panic!("no tensor {name}");
}

#[test]
fn round_trip_is_deterministic_and_independent_of_sharding() {
    for (naming, quant) in [
        (Naming::Glm, Quant::Bf16),
        (Naming::Glm, Quant::Fp8),
        (Naming::QwenMoe, Quant::Fp8),
        (Naming::QwenMoe, Quant::Nvfp4),
        (Naming::QwenDense, Quant::Bf16),
    ] {
        let m = Model::new(naming, quant);
        let (_t, dir) = gen(&m);
        let c = build(&dir).unwrap();
        assert_eq!(c.n_tensors as usize, m.tensors().len());
        assert_eq!(
            c.config.quant,
            match quant {
                Quant::Bf16 => "bf16",
                Quant::Fp8 => "fp8",
                Quant::Nvfp4 => "nvfp4",
            }
        );
        let s = SpecFile::from_commitment(&c, 0.0);
        assert!(s.check_internal().is_empty(), "{:?}", s.check_internal());
        // gz round trip.
        let path = dir.parent().unwrap().join("model_spec.json.gz");
        s.write_gz(&path).unwrap();
        let back = SpecFile::read(&path).unwrap();
        assert_eq!(back, s);
        assert!(back.diff(&s).is_empty());
        // Same tensors, other sharding and a fresh build: same roots.
        let (_t2, dir2) = gen(&Model {
            shards: 1,
            ..m.clone()
        });
        assert_eq!(build(&dir2).unwrap(), c);
        if naming == Naming::QwenDense {
            assert!(s.expert_roots_by_layer.is_empty());
            assert_eq!(s.dense_roots_by_layer.len(), m.n_layers);
        } else {
            assert_eq!(s.n_moe_committed as usize, m.n_layers - m.first_dense);
            assert_eq!(s.layer_roots.len(), m.n_layers);
            assert!(s
                .expert_roots_by_layer
                .values()
                .all(|l| l.experts.len() == m.n_experts));
        }
        if naming == Naming::Glm {
            // Bias bytes are published raw (4 bytes per expert, F32) and its leaf is in the router unit.
            let b = &s.router_bias_by_layer[&1];
            assert_eq!(b.len(), m.n_experts * 8);
            assert!(s.expert_roots_by_layer[&1].bias_leaf.is_some());
        }
    }
}

#[test]
fn flipping_one_expert_byte_changes_exactly_its_root_its_layer_and_model_root() {
    let m = Model::new(Naming::Glm, Quant::Fp8);
    let (_t, dir) = gen(&m);
    let before = SpecFile::from_commitment(&build(&dir).unwrap(), 0.0);
    flip_byte(&dir, "model.layers.2.mlp.experts.3.down_proj.weight", 5);
    let after = SpecFile::from_commitment(&build(&dir).unwrap(), 0.0);
    let d = after.diff(&before);
    let mut names: Vec<&str> = d.iter().map(|l| l.split(':').next().unwrap()).collect();
    names.sort();
    assert_eq!(
        names,
        ["layer 2", "layer 2 expert 3", "model_root"],
        "{d:#?}"
    );
    assert_ne!(after.body_root, before.body_root);
    // Scale tensors are committed too.
    flip_byte(
        &dir,
        "model.layers.1.mlp.experts.0.up_proj.weight_scale_inv",
        0,
    );
    let again = SpecFile::from_commitment(&build(&dir).unwrap(), 0.0);
    let mut d: Vec<String> = again
        .diff(&after)
        .iter()
        .map(|l| l.split(':').next().unwrap().to_string())
        .collect();
    d.sort();
    assert_eq!(d, ["layer 1", "layer 1 expert 0", "model_root"]);
}

#[test]
fn config_and_metadata_are_bound() {
    let m = Model::new(Naming::QwenMoe, Quant::Bf16);
    let (_t, dir) = gen(&m);
    let a = build(&dir).unwrap();
    let b = commit::commit_checkpoint(
        &dir,
        &CommitOptions {
            arch: Some("qwen3_moe_other".into()),
            quant: None,
            bind_config: false,
        },
        &Progress::default(),
    )
    .unwrap();
    assert_ne!(a.model_root, b.model_root);
    assert_eq!(a.body_root, b.body_root);
    assert_ne!(a.config_leaf, b.config_leaf);
}

#[test]
fn opening_proof_verifies_and_tampering_fails_for_the_right_reason() {
    let m = Model::new(Naming::Glm, Quant::Fp8);
    let (_t, dir) = gen(&m);
    let c = build(&dir).unwrap();
    let root = c.model_root;
    let unit = UnitId::Layer {
        layer: 2,
        part: LayerPart::Expert(3),
    };
    let p = c.open(unit).unwrap();
    p.verify(&root).unwrap();
    // JSON round trip.
    let text = serde_json::to_string_pretty(&p).unwrap();
    let p: OpeningProof = serde_json::from_str(&text).unwrap();
    p.verify(&root).unwrap();
    assert_eq!(p.tensors.len(), 6, "3 FP8 weights + 3 scales");
    // Every unit kind opens and verifies, from the commitment and from the spec file.
    let s = SpecFile::from_commitment(&c, 0.0);
    for u in [
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
            part: LayerPart::Shared,
        },
        UnitId::Layer {
            layer: 1,
            part: LayerPart::Expert(0),
        },
        UnitId::Layer {
            layer: 2,
            part: LayerPart::Expert(3),
        },
    ] {
        let full = c.open(u).unwrap();
        full.verify(&root).unwrap();
        let tensors = checkpoint::hash_unit(&dir, &c.config, u).unwrap();
        assert_eq!(s.open(u, tensors).unwrap(), full, "{u}");
    }
    assert!(matches!(
        c.open(UnitId::Layer {
            layer: 2,
            part: LayerPart::Expert(4)
        }),
        Err(CommitError::NoSuchUnit(_))
    ));
    assert!(matches!(
        c.open(UnitId::Layer {
            layer: 0,
            part: LayerPart::Router
        }),
        Err(CommitError::NoSuchUnit(_))
    ));

    // The auditor's copy of the tensor bytes.
    let shards = checkpoint::list_shards(&dir).unwrap();
    let name = "model.layers.2.mlp.experts.3.gate_proj.weight";
    let (dtype, shape, mut data) = shards
        .iter()
        .find_map(|s| {
            let bytes = std::fs::read(s).unwrap();
            let st = SafeTensors::deserialize(&bytes).unwrap();
            st.tensor(name).ok().map(|v| {
                (
                    v.dtype().to_string(),
                    v.shape().iter().map(|d| *d as u64).collect::<Vec<_>>(),
                    v.data().to_vec(),
                )
            })
        })
        .unwrap();
    p.check_tensor(name, &dtype, &shape, &data).unwrap();
    data[0] ^= 0x80;
    assert!(matches!(
        p.check_tensor(name, &dtype, &shape, &data),
        Err(ProofError::TensorMismatch { .. })
    ));

    // Tampered tensor leaf or data digest → that tensor's leaf fails.
    let mut t = p.clone();
    t.tensors[0].leaf[0] ^= 1;
    let e = t.verify(&root);
    assert!(
        matches!(e, Err(ProofError::TensorLeafMismatch { .. })),
        "{e:?}"
    );
    let mut t = p.clone();
    t.tensors[2].sha256[0] ^= 1;
    let e = t.verify(&root);
    assert!(
        matches!(e, Err(ProofError::TensorLeafMismatch { ref name, .. }) if *name == p.tensors[2].name),
        "{e:?}"
    );
    // Leaf and digest both replaced consistently → unit root mismatch.
    let mut t = p.clone();
    t.tensors[2].sha256[0] ^= 1;
    t.tensors[2].leaf = t.tensors[2].expected_leaf();
    assert!(matches!(
        t.verify(&root),
        Err(ProofError::UnitRootMismatch { .. })
    ));
    // Tampered layer sibling → layer root mismatch.
    let mut t = p.clone();
    t.layer.as_mut().unwrap().level.path[0].0[0] ^= 1;
    assert!(matches!(
        t.verify(&root),
        Err(ProofError::LayerRootMismatch { .. })
    ));
    // Tampered body sibling → body root mismatch.
    let mut t = p.clone();
    t.body.path[0].0[0] ^= 1;
    assert!(matches!(
        t.verify(&root),
        Err(ProofError::BodyRootMismatch { .. })
    ));
    // Tampered config → model root mismatch.
    let mut t = p.clone();
    t.config.top_k = 3;
    assert!(matches!(
        t.verify(&root),
        Err(ProofError::ModelRootMismatch { .. })
    ));
    // Consistent proof, but another model.
    let mut other = root;
    other[31] ^= 1;
    assert!(matches!(
        p.verify(&other),
        Err(ProofError::UntrustedRoot { .. })
    ));
    // Claim the tensors are another expert's → malformed (tensor belongs to expert 3).
    let mut t = p.clone();
    t.unit.expert = Some(2);
    t.layer.as_mut().unwrap().level.index = 5;
    assert!(
        matches!(t.verify(&root), Err(ProofError::Malformed(ref m)) if m.contains("belongs to layer 2 expert 3"))
    );
    // Position inconsistent with the unit → malformed.
    let mut t = p.clone();
    t.layer.as_mut().unwrap().level.index = 4;
    assert!(
        matches!(t.verify(&root), Err(ProofError::Malformed(ref m)) if m.contains("layer position"))
    );
    // Truncated path → malformed.
    let mut t = p.clone();
    t.body.path.pop();
    assert!(
        matches!(t.verify(&root), Err(ProofError::Malformed(ref m)) if m.contains("body path"))
    );
    // Dropped tensor → unit root mismatch.
    let mut t = p.clone();
    t.tensors.remove(1);
    assert!(matches!(
        t.verify(&root),
        Err(ProofError::UnitRootMismatch { .. })
    ));
    // Wrong scheme → malformed.
    let mut t = p.clone();
    t.scheme = "engy-commit/v0".into();
    assert!(matches!(t.verify(&root), Err(ProofError::Malformed(_))));
}

#[test]
fn spec_open_refuses_a_checkpoint_that_differs_from_the_spec() {
    let m = Model::new(Naming::QwenMoe, Quant::Bf16);
    let (_t, dir) = gen(&m);
    let c = build(&dir).unwrap();
    let s = SpecFile::from_commitment(&c, 0.0);
    flip_byte(&dir, "model.layers.1.mlp.experts.2.up_proj.weight", 0);
    let u = UnitId::Layer {
        layer: 1,
        part: LayerPart::Expert(2),
    };
    let tensors = checkpoint::hash_unit(&dir, &c.config, u).unwrap();
    assert!(
        matches!(s.open(u, tensors), Err(CommitError::Spec(ref m)) if m.contains("differs from the spec"))
    );
}

// ---------- malformed inputs ----------

fn err(dir: &Path) -> CommitError {
    build(dir).expect_err("must fail")
}

#[test]
fn truncated_shard_is_a_clear_error() {
    let (_t, dir) = gen(&Model::new(Naming::Glm, Quant::Bf16));
    let shard = checkpoint::list_shards(&dir).unwrap()[1].clone();
    let bytes = std::fs::read(&shard).unwrap();
    std::fs::write(&shard, &bytes[..bytes.len() - 3]).unwrap();
    let e = err(&dir);
    assert!(
        matches!(e, CommitError::BadShard { ref path, .. } if *path == shard),
        "{e}"
    );
    assert!(e.to_string().contains("truncated"), "{e}");
    // Cut inside the header too.
    std::fs::write(&shard, &bytes[..20]).unwrap();
    assert!(matches!(err(&dir), CommitError::BadShard { .. }));
    std::fs::write(&shard, &bytes[..5]).unwrap();
    assert!(matches!(err(&dir), CommitError::BadShard { .. }));
}

/// A shard written by hand: 8-byte header length, header JSON, data.
fn raw_shard(path: &Path, header: serde_json::Value, data_len: usize) {
    let h = header.to_string().into_bytes();
    let mut out = (h.len() as u64).to_le_bytes().to_vec();
    out.extend(&h);
    out.extend(std::iter::repeat_n(7u8, data_len));
    std::fs::write(path, out).unwrap();
}

#[test]
fn header_lying_about_offsets_is_a_clear_error() {
    let (_t, dir) = gen(&Model::new(Naming::QwenDense, Quant::Bf16));
    let path = dir.join("zz-extra.safetensors");
    // Overlapping ranges.
    raw_shard(
        &path,
        json!({"model.layers.0.extra_a.weight": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
               "model.layers.0.extra_b.weight": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}),
        12,
    );
    let e = err(&dir);
    assert!(matches!(e, CommitError::BadShard { .. }), "{e}");
    assert!(e.to_string().contains("offsets"), "{e}");
    // Range beyond the data.
    raw_shard(
        &path,
        json!({"model.layers.0.extra_a.weight": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}),
        4,
    );
    assert!(matches!(err(&dir), CommitError::BadShard { .. }));
    // Byte range that does not match dtype × shape.
    raw_shard(
        &path,
        json!({"model.layers.0.extra_a.weight": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}),
        8,
    );
    let e = err(&dir);
    assert!(e.to_string().contains("dtype"), "{e}");
    // A valid extra shard is accepted (attention-side tensor of layer 0).
    raw_shard(
        &path,
        json!({"model.layers.0.extra_a.weight": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}),
        8,
    );
    std::fs::remove_file(dir.join("model.safetensors.index.json")).unwrap();
    build(&dir).unwrap();
}

#[test]
fn duplicate_tensor_across_shards_is_a_clear_error() {
    let (_t, dir) = gen(&Model::new(Naming::Glm, Quant::Bf16));
    let name = "model.layers.1.mlp.experts.0.up_proj.weight";
    let path = dir.join("zz-dup.safetensors");
    raw_shard(
        &path,
        json!({name: {"dtype": "BF16", "shape": [4, 8], "data_offsets": [0, 64]}}),
        64,
    );
    match err(&dir) {
        CommitError::DuplicateTensor {
            name: n, second, ..
        } => {
            assert_eq!(n, name);
            assert_eq!(second, path);
        }
        e => panic!("{e}"),
    }
}

#[test]
fn missing_or_orphan_scales_are_clear_errors() {
    // FP8 weight without weight_scale_inv.
    let m = Model::new(Naming::Glm, Quant::Fp8);
    let t = tempfile::tempdir().unwrap();
    let dir = t.path().join("c");
    m.write(&dir);
    drop_tensor(
        &dir,
        "model.layers.2.mlp.experts.1.gate_proj.weight_scale_inv",
    );
    let e = err(&dir);
    assert!(
        matches!(e, CommitError::MissingScale { ref weight, .. } if weight == "model.layers.2.mlp.experts.1.gate_proj.weight"),
        "{e}"
    );
    // Scale without its weight.
    let dir = t.path().join("d");
    m.write(&dir);
    drop_tensor(&dir, "model.layers.2.mlp.experts.1.gate_proj.weight");
    assert!(matches!(err(&dir), CommitError::OrphanScale { .. }));
    // NVFP4 packed weight without its second-level scale.
    let dir = t.path().join("e");
    Model::new(Naming::QwenMoe, Quant::Nvfp4).write(&dir);
    drop_tensor(
        &dir,
        "model.layers.1.mlp.experts.0.down_proj.weight_scale_2",
    );
    assert!(
        matches!(err(&dir), CommitError::MissingScale { ref expected, .. } if expected.contains("weight_scale_2"))
    );
}

/// Rewrites the shard holding `name` without it (and drops the index).
fn drop_tensor(dir: &Path, name: &str) {
    let _ = std::fs::remove_file(dir.join("model.safetensors.index.json"));
    for shard in checkpoint::list_shards(dir).unwrap() {
        let bytes = std::fs::read(&shard).unwrap();
        let st = SafeTensors::deserialize(&bytes).unwrap();
        if st.tensor(name).is_err() {
            continue;
        }
        let keep: BTreeMap<String, _> = st
            .tensors()
            .into_iter()
            .filter(|(n, _)| n != name)
            .collect();
        let out = safetensors::serialize(keep, None).unwrap();
        std::fs::write(&shard, out).unwrap();
        return;
    }
    panic!("no tensor {name}");
}

#[test]
fn layers_that_do_not_fit_the_config_are_clear_errors() {
    let m = Model::new(Naming::QwenMoe, Quant::Bf16);
    let t = tempfile::tempdir().unwrap();
    let dir = t.path().join("a");
    m.write(&dir);
    for proj in ["gate_proj", "up_proj", "down_proj"] {
        drop_tensor(&dir, &format!("model.layers.2.mlp.experts.3.{proj}.weight"));
    }
    assert!(
        matches!(err(&dir), CommitError::BadLayer { layer: 2, ref reason } if reason.contains("expert 3"))
    );
    let dir = t.path().join("b");
    m.write(&dir);
    drop_tensor(&dir, "model.layers.1.mlp.gate.weight");
    assert!(
        matches!(err(&dir), CommitError::BadLayer { layer: 1, ref reason } if reason.contains("router"))
    );
    // Fused expert tensors are refused, not silently misplaced.
    let dir = t.path().join("c");
    m.write(&dir);
    raw_shard(
        &dir.join("zz.safetensors"),
        json!({"model.layers.1.mlp.experts.gate_up_proj": {"dtype": "BF16", "shape": [2], "data_offsets": [0, 4]}}),
        4,
    );
    std::fs::remove_file(dir.join("model.safetensors.index.json")).unwrap();
    assert!(matches!(err(&dir), CommitError::UnknownTensor { .. }));
    // Index that disagrees with the shards.
    let dir = t.path().join("d");
    m.write(&dir);
    let idx = dir.join("model.safetensors.index.json");
    let text = std::fs::read_to_string(&idx).unwrap().replacen(
        "model-00001-of-00003",
        "model-00002-of-00003",
        1,
    );
    std::fs::write(&idx, text).unwrap();
    assert!(matches!(err(&dir), CommitError::Config(ref m) if m.contains("index")));
    // No config / no shards.
    let dir = t.path().join("e");
    std::fs::create_dir_all(&dir).unwrap();
    assert!(matches!(err(&dir), CommitError::Io { .. }));
    std::fs::write(dir.join("config.json"), m.config().to_string()).unwrap();
    assert!(matches!(err(&dir), CommitError::NoShards(_)));
}

// ---------- published specs (third-party data, read from ENGY_SHARED_DIR) ----------

fn shared_specs_dir() -> PathBuf {
    match std::env::var_os("ENGY_SHARED_DIR") {
        Some(d) => PathBuf::from(d).join("specs"),
        None => Path::new(env!("CARGO_MANIFEST_DIR")).join("../../../shared/specs"),
    }
}

#[test]
fn inspects_published_specs_without_claiming_to_recompute_them() {
    let dir = shared_specs_dir();
    let Ok(entries) = std::fs::read_dir(&dir) else {
        eprintln!("skip: no published specs at {}", dir.display());
        return;
    };
    let mut n = 0;
    for e in entries {
        let path = e.unwrap().path().join("model_spec.json.gz");
        if !path.exists() {
            continue;
        }
        n += 1;
        let v = spec::read_json(&path).unwrap();
        let s = spec::inspect(&v);
        assert!(!s.recomputable, "{}", path.display());
        assert!(s.internal_problems.is_none());
        assert!(s.roots.contains_key("model_root") && s.roots.contains_key("lm_root"));
        assert_eq!(s.n_layer_roots, s.moe_layer_keys.len());
        assert!(s.layer_roots_match_entries);
        let n_experts = s.n_experts.unwrap() as usize;
        assert_eq!(s.experts_per_layer, Some((n_experts, n_experts)));
        if let Some((n_bias, bytes)) = s.router_bias {
            assert_eq!(n_bias, s.n_layer_roots);
            assert_eq!(bytes, n_experts * 4, "one f32 per expert");
        }
        // And the strict reader refuses it with the reason.
        let e = SpecFile::from_value(v).unwrap_err();
        assert!(e.to_string().contains("cannot be recomputed"), "{e}");
    }
    eprintln!("inspected {n} published specs in {}", dir.display());
}

#[test]
fn inspect_checks_our_own_files_internally() {
    let (_t, dir) = gen(&Model::new(Naming::Glm, Quant::Bf16));
    let s = SpecFile::from_commitment(&build(&dir).unwrap(), 0.0);
    let mut v = serde_json::to_value(&s).unwrap();
    let sum = spec::inspect(&v);
    assert!(sum.recomputable);
    assert_eq!(sum.internal_problems, Some(vec![]));
    assert!(sum.layer_roots_match_entries);
    // Change one expert root inside the file: the layer root no longer matches.
    v["expert_roots_by_layer"]["2"]["experts"][1] = json!("00".repeat(32));
    let sum = spec::inspect(&v);
    let problems = sum.internal_problems.unwrap();
    assert_eq!(problems.len(), 1, "{problems:?}");
    assert!(problems[0].contains("layer 2"));
}

// ---------- specs/SCHEME.md: worked example and the Python reference ----------

fn scheme_md() -> String {
    std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("../../specs/SCHEME.md"))
        .unwrap()
}

#[test]
fn scheme_md_worked_example_and_python_reference_agree() {
    let t = tempfile::tempdir().unwrap();
    let dir = t.path().join("example");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(
        dir.join("config.json"),
        r#"{"model_type":"qwen3_moe","num_hidden_layers":2,"hidden_size":1,"intermediate_size":1,"moe_intermediate_size":1,"num_experts":2,"num_experts_per_tok":1,"vocab_size":2,"quantization_config":{"quant_method":"fp8","weight_block_size":[128,128]}}"#,
    )
    .unwrap();
    let tensors: [(&str, Dtype, Vec<usize>, &str); 10] = [
        (
            "model.embed_tokens.weight",
            Dtype::BF16,
            vec![2, 1],
            "803f0040",
        ),
        ("lm_head.weight", Dtype::BF16, vec![2, 1], "803f00c0"),
        (
            "model.layers.0.input_layernorm.weight",
            Dtype::BF16,
            vec![1],
            "803f",
        ),
        (
            "model.layers.0.mlp.down_proj.weight",
            Dtype::BF16,
            vec![1, 1],
            "003f",
        ),
        (
            "model.layers.1.input_layernorm.weight",
            Dtype::BF16,
            vec![1],
            "803f",
        ),
        (
            "model.layers.1.mlp.gate.weight",
            Dtype::BF16,
            vec![2, 1],
            "803f80bf",
        ),
        (
            "model.layers.1.mlp.experts.0.down_proj.weight",
            Dtype::F8_E4M3,
            vec![1, 1],
            "38",
        ),
        (
            "model.layers.1.mlp.experts.0.down_proj.weight_scale_inv",
            Dtype::F32,
            vec![1, 1],
            "0000803f",
        ),
        (
            "model.layers.1.mlp.experts.1.down_proj.weight",
            Dtype::F8_E4M3,
            vec![1, 1],
            "40",
        ),
        (
            "model.layers.1.mlp.experts.1.down_proj.weight_scale_inv",
            Dtype::F32,
            vec![1, 1],
            "0000003f",
        ),
    ];
    let data: Vec<Vec<u8>> = tensors.iter().map(|t| hex::decode(t.3).unwrap()).collect();
    // Two shards, to show sharding does not matter.
    for (k, range) in [(1, 0..5), (2, 5..10)] {
        let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = range
            .map(|i| {
                let (n, d, s, _) = &tensors[i];
                (
                    n.to_string(),
                    safetensors::tensor::TensorView::new(*d, s.clone(), &data[i]).unwrap(),
                )
            })
            .collect();
        safetensors::serialize_to_file(views, None, &dir.join(format!("m-{k}.safetensors")))
            .unwrap();
    }
    let c = build(&dir).unwrap();
    let md = scheme_md();
    let expect_in_md = |what: &str, d: &[u8; 32]| {
        let h = hex::encode(d);
        assert!(md.contains(&h), "{what} {h} is not in specs/SCHEME.md");
    };
    expect_in_md("model_root", &c.model_root);
    expect_in_md("config_leaf", &c.config_leaf);
    expect_in_md("body_root", &c.body_root);
    expect_in_md("globals_root", &c.globals.root);
    expect_in_md("lm_root", &c.lm.root);
    for (i, l) in c.layers.iter().enumerate() {
        expect_in_md(&format!("layer {i}"), &l.root);
        for u in l.body.units() {
            expect_in_md(&format!("layer {i} unit"), &u.root);
            for t in &u.tensors {
                expect_in_md(&t.name, &t.leaf);
                expect_in_md(&t.name, &t.sha256);
            }
        }
    }
    assert!(md.contains(&c.config.canonical_json().unwrap()));
    // The opening of layer 1 expert 1 as described.
    let p = c
        .open(UnitId::Layer {
            layer: 1,
            part: LayerPart::Expert(1),
        })
        .unwrap();
    let l = p.layer.as_ref().unwrap();
    assert_eq!((l.level.index, l.level.size, l.level.path.len()), (4, 5, 1));
    assert_eq!((p.body.index, p.body.size, p.body.path.len()), (3, 4, 2));
    assert!(md.contains(&l.level.path[0].to_string()[..8]));
    p.verify(&c.model_root).unwrap();

    // The appendix script, run by python3 when present, agrees on generated checkpoints.
    let script = md
        .split("```python\n")
        .nth(1)
        .and_then(|s| s.split("\n```").next())
        .expect("python block in SCHEME.md");
    let py = t.path().join("engy_commit_v1.py");
    std::fs::write(&py, script).unwrap();
    let run = |dir: &Path| {
        std::process::Command::new("python3")
            .arg(&py)
            .arg(dir)
            .output()
    };
    let Ok(out) = run(&dir) else {
        eprintln!("skip: python3 not available for the reference cross-check");
        return;
    };
    let mut dirs = vec![(dir.clone(), c)];
    for (naming, quant, fused) in [
        (Naming::Glm, Quant::Fp8, false),
        (Naming::QwenMoe, Quant::Nvfp4, false),
        (Naming::QwenMoe, Quant::Bf16, true),
        (Naming::QwenDense, Quant::Bf16, false),
    ] {
        let d = t.path().join(format!("g{}", dirs.len()));
        Model {
            fused,
            ..Model::new(naming, quant)
        }
        .write(&d);
        let c = build(&d).unwrap();
        dirs.push((d, c));
    }
    drop(out);
    for (d, c) in dirs {
        let out = run(&d).unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(
            v["model_root"],
            hex::encode(c.model_root),
            "{}",
            d.display()
        );
        assert_eq!(v["config"], c.config.canonical_json().unwrap());
        let layers: Vec<String> = c.layers.iter().map(|l| hex::encode(l.root)).collect();
        assert_eq!(v["layer_roots"], json!(layers));
    }
}

#[test]
fn committed_devnet_spec_is_a_consistent_engy_commit_v1_file() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../specs/devnet/model_spec.json.gz");
    let s = SpecFile::read(&path).unwrap();
    assert_eq!(s.scheme, commit::SCHEME);
    assert_eq!(s.check_internal(), Vec::<String>::new());
    assert_eq!(s.layer_roots.len() as u64, s.config.n_layers);
    // specs/README.md and specs/devnet/README.md quote this root.
    for readme in ["../../specs/README.md", "../../specs/devnet/README.md"] {
        let text =
            std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join(readme)).unwrap();
        assert!(
            text.contains(&s.model_root.to_string()),
            "{readme} does not quote {}",
            s.model_root
        );
    }
}

#[test]
fn fused_expert_tensors_are_committed_per_expert() {
    let m = Model {
        fused: true,
        ..Model::new(Naming::QwenMoe, Quant::Bf16)
    };
    let (_t, dir) = gen(&m);
    let c = build(&dir).unwrap();
    let u = c
        .unit(UnitId::Layer {
            layer: 2,
            part: LayerPart::Expert(2),
        })
        .unwrap();
    let names: Vec<(&str, &[u64])> = u
        .tensors
        .iter()
        .map(|t| (t.name.as_str(), t.shape.as_slice()))
        .collect();
    assert_eq!(
        names,
        [
            ("model.layers.2.mlp.experts.down_proj[2]", &[8u64, 4][..]),
            ("model.layers.2.mlp.experts.gate_up_proj[2]", &[8, 8][..]),
        ]
    );
    // Opening proof + the auditor's slice of the fused tensor.
    let p = c
        .open(UnitId::Layer {
            layer: 2,
            part: LayerPart::Expert(2),
        })
        .unwrap();
    p.verify(&c.model_root).unwrap();
    let name = "model.layers.2.mlp.experts.gate_up_proj";
    let bytes = checkpoint::list_shards(&dir)
        .unwrap()
        .iter()
        .find_map(|s| {
            let b = std::fs::read(s).unwrap();
            let st = SafeTensors::deserialize(&b).unwrap();
            st.tensor(name).ok().map(|v| v.data().to_vec())
        })
        .unwrap();
    let per = bytes.len() / m.n_experts;
    p.check_tensor(
        &format!("{name}[2]"),
        "BF16",
        &[8, 8],
        &bytes[2 * per..3 * per],
    )
    .unwrap();
    assert!(p
        .check_tensor(&format!("{name}[2]"), "BF16", &[8, 8], &bytes[per..2 * per])
        .is_err());
    // A byte of expert 2's slice changes exactly expert 2.
    let before = SpecFile::from_commitment(&c, 0.0);
    flip_byte(&dir, name, 2 * per + 3);
    let after = SpecFile::from_commitment(&build(&dir).unwrap(), 0.0);
    let mut d: Vec<String> = after
        .diff(&before)
        .iter()
        .map(|l| l.split(':').next().unwrap().to_string())
        .collect();
    d.sort();
    assert_eq!(d, ["layer 2", "layer 2 expert 2", "model_root"]);
    // First dimension other than n_experts is refused.
    let bad = Model {
        n_experts: 4,
        ..m.clone()
    };
    let t2 = tempfile::tempdir().unwrap();
    bad.write(t2.path());
    let cfg = t2.path().join("config.json");
    let text = std::fs::read_to_string(&cfg)
        .unwrap()
        .replace("\"num_experts\":4", "\"num_experts\":3");
    std::fs::write(&cfg, text).unwrap();
    let e = err(t2.path());
    assert!(
        matches!(e, CommitError::UnknownTensor { ref reason, .. } if reason.contains("n_experts = 3")),
        "{e}"
    );
}

#[test]
fn flipping_any_digest_or_position_in_a_proof_is_rejected() {
    let m = Model::new(Naming::Glm, Quant::Bf16);
    let (_t, dir) = gen(&m);
    let c = build(&dir).unwrap();
    let p = c
        .open(UnitId::Layer {
            layer: 1,
            part: LayerPart::Expert(1),
        })
        .unwrap();
    p.verify(&c.model_root).unwrap();
    let n_tensors = p.tensors.len();
    let n_layer_path = p.layer.as_ref().unwrap().level.path.len();
    let n_body_path = p.body.path.len();
    type Mutation = Box<dyn Fn(&mut OpeningProof)>;
    let mut mutations: Vec<Mutation> = vec![
        Box::new(|p| p.unit_root.0[7] ^= 0x10),
        Box::new(|p| p.layer.as_mut().unwrap().level.root.0[0] ^= 1),
        Box::new(|p| p.body.root.0[31] ^= 1),
        Box::new(|p| p.model_root.0[5] ^= 1),
        Box::new(|p| p.body.index += 1),
        Box::new(|p| p.body.size += 1),
        Box::new(|p| p.layer.as_mut().unwrap().level.size -= 1),
        Box::new(|p| p.layer.as_mut().unwrap().kind = engy_core::commit::proof::LayerKind::Dense),
        Box::new(|p| p.unit.layer = Some(2)),
        Box::new(|p| p.config.n_experts += 1),
        Box::new(|p| p.config.quant = "fp8".into()),
        Box::new(|p| p.tensors.swap(0, 1)),
        Box::new(|p| p.tensors[0].shape.push(1)),
        Box::new(|p| p.tensors[1].sha256[0] ^= 1),
        Box::new(|p| p.tensors[1].nbytes += 1),
        Box::new(|p| p.tensors[0].dtype = "F16".into()),
    ];
    for i in 0..n_tensors {
        mutations.push(Box::new(move |p| p.tensors[i].leaf[i % 32] ^= 1));
    }
    for i in 0..n_layer_path {
        mutations.push(Box::new(move |p| {
            p.layer.as_mut().unwrap().level.path[i].0[3] ^= 1
        }));
    }
    for i in 0..n_body_path {
        mutations.push(Box::new(move |p| p.body.path[i].0[9] ^= 1));
    }
    for (k, mutate) in mutations.iter().enumerate() {
        let mut t = p.clone();
        mutate(&mut t);
        assert!(
            t.verify(&c.model_root).is_err(),
            "mutation {k} was accepted"
        );
    }
}
