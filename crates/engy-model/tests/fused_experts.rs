//! Fused routed experts (specs/SCHEME.md "Fused experts"; transformers 5's in-memory layout
//! `mlp.experts.gate_up_proj` `[E, 2I, H]` with gate = rows `0..I`, and `mlp.experts.down_proj`
//! `[E, H, I]`) load as the per-expert layout does.
//!
//! Every case of the arch oracle (`$ENGY_ARCH_VECTORS_DIR`, default `tests/vectors/arch`) is
//! rewritten with its routed experts fused, scales included (`gate_up_proj_scale_inv`,
//! `gate_up_proj_scale`, a per-expert `[E]` `gate_up_proj_scale_2` and `input_scale`). The fused
//! checkpoint must give bit-identical hidden states to the original. The one layout engy refuses,
//! block FP8 whose tile rows straddle the gate/up boundary (`I` not a multiple of the tile rows),
//! must be refused with an error that says so.
use std::collections::BTreeMap;
use std::path::Path;

use engy_model::{LoadOptions, Model, Residency};
use safetensors::tensor::TensorView;
use safetensors::{Dtype, SafeTensors};
use serde_json::Value;

mod common;

struct Tensor {
    dtype: Dtype,
    shape: Vec<usize>,
    data: Vec<u8>,
}

/// `(layer head, expert, proj, leaf)` of a per-expert tensor name
/// `{head}.mlp.experts.{e}.{proj}.{leaf}`.
fn per_expert(name: &str) -> Option<(String, usize, String, String)> {
    let (head, rest) = name.split_once(".mlp.experts.")?;
    let (e, rest) = rest.split_once('.')?;
    let (proj, leaf) = rest.split_once('.')?;
    Some((head.into(), e.parse().ok()?, proj.into(), leaf.into()))
}

/// The fused name of `leaf` of `proj` (`gate_up_proj` or `down_proj`), transformers 5 style.
fn fused_name(head: &str, proj: &str, leaf: &str) -> String {
    let suffix = match leaf {
        "weight" => String::new(),
        "input_scale" => "_input_scale".into(),
        l => format!("_{}", l.strip_prefix("weight_").unwrap_or(l)),
    };
    format!("{head}.mlp.experts.{proj}{suffix}")
}

/// Writes `src`'s checkpoint into `dst` with every layer's routed experts fused.
fn fuse(src: &Path, dst: &Path) {
    std::fs::create_dir_all(dst).unwrap();
    for f in std::fs::read_dir(src).unwrap() {
        let p = f.unwrap().path();
        if p.extension().is_some_and(|x| x == "json") {
            std::fs::copy(&p, dst.join(p.file_name().unwrap())).unwrap();
        }
    }
    let bytes = std::fs::read(src.join("model.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let mut out: BTreeMap<String, Tensor> = BTreeMap::new();
    // (head, leaf) -> expert -> proj -> tensor
    type Experts = BTreeMap<usize, BTreeMap<String, Tensor>>;
    let mut grouped: BTreeMap<(String, String), Experts> = BTreeMap::new();
    for (name, t) in st.tensors() {
        let t2 = Tensor {
            dtype: t.dtype(),
            shape: t.shape().to_vec(),
            data: t.data().to_vec(),
        };
        match per_expert(&name) {
            Some((head, e, proj, leaf)) => {
                grouped
                    .entry((head, leaf))
                    .or_default()
                    .entry(e)
                    .or_default()
                    .insert(proj, t2);
            }
            None => {
                out.insert(name, t2);
            }
        }
    }
    for ((head, leaf), experts) in grouped {
        let n = experts.len();
        let first = &experts[&0];
        let scalar = first["gate_proj"].shape.is_empty();
        let (mut gu, mut down) = (Vec::new(), Vec::new());
        for e in 0..n {
            let p = &experts[&e];
            if scalar {
                // A per-expert scalar: gate and up share it in a fused checkpoint.
                assert_eq!(p["gate_proj"].data, p["up_proj"].data, "{head} {e} {leaf}");
                gu.extend_from_slice(&p["gate_proj"].data);
            } else {
                gu.extend_from_slice(&p["gate_proj"].data);
                gu.extend_from_slice(&p["up_proj"].data);
            }
            down.extend_from_slice(&p["down_proj"].data);
        }
        let g = &first["gate_proj"];
        let mut gu_shape = vec![n];
        let mut down_shape = vec![n];
        if !scalar {
            gu_shape.push(g.shape[0] * 2);
            gu_shape.extend_from_slice(&g.shape[1..]);
            down_shape.extend_from_slice(&first["down_proj"].shape);
        }
        out.insert(
            fused_name(&head, "gate_up_proj", &leaf),
            Tensor {
                dtype: g.dtype,
                shape: gu_shape,
                data: gu,
            },
        );
        out.insert(
            fused_name(&head, "down_proj", &leaf),
            Tensor {
                dtype: first["down_proj"].dtype,
                shape: down_shape,
                data: down,
            },
        );
    }
    let views: Vec<(String, TensorView<'_>)> = out
        .iter()
        .map(|(k, t)| {
            (
                k.clone(),
                TensorView::new(t.dtype, t.shape.clone(), &t.data).unwrap(),
            )
        })
        .collect();
    safetensors::serialize_to_file(views, None, &dst.join("model.safetensors")).unwrap();
}

fn ids(reference: &SafeTensors<'_>, k: usize) -> Option<Vec<u32>> {
    let t = reference.tensor(&format!("input_ids_{k}")).ok()?;
    Some(
        t.data()
            .chunks_exact(8)
            .map(|c| u32::try_from(i64::from_le_bytes(c.try_into().unwrap())).unwrap())
            .collect(),
    )
}

/// Whether engy must refuse the fused form of this case: block FP8 whose routed-expert width
/// is not a multiple of the tile rows.
fn straddles_fp8_tile(dir: &Path) -> bool {
    let cfg: Value =
        serde_json::from_slice(&std::fs::read(dir.join("config.json")).unwrap()).unwrap();
    let cfg_text = cfg.get("text_config").unwrap_or(&cfg);
    let q = cfg.get("quantization_config");
    if q.and_then(|q| q["quant_method"].as_str()) != Some("fp8") {
        return false;
    }
    let bn = q
        .and_then(|q| q["weight_block_size"][0].as_u64())
        .unwrap_or(128);
    let inter = cfg_text["moe_intermediate_size"].as_u64().unwrap();
    !inter.is_multiple_of(bn)
}

#[test]
fn fused_experts_load_bit_identical_to_per_expert() {
    let cases = common::cases();
    assert!(!cases.is_empty());
    let opts = LoadOptions {
        residency: Residency::Streaming,
        ..LoadOptions::default()
    };
    let tmp = tempfile::tempdir().unwrap();
    let (mut same, mut refused) = (0, 0);
    for case in &cases {
        let name = case.file_name().unwrap().to_string_lossy().into_owned();
        let fused = tmp.path().join(&name);
        fuse(case, &fused);
        if straddles_fp8_tile(case) {
            let err = Model::open(&fused, &opts).unwrap_err().to_string();
            assert!(
                err.contains("inside a") && err.contains("FP8 tile"),
                "{name}: {err}"
            );
            refused += 1;
            continue;
        }
        let a = Model::open(case, &opts).unwrap();
        let b = Model::open(&fused, &opts).unwrap_or_else(|e| panic!("{name}: {e}"));
        let bytes = std::fs::read(case.join("reference.safetensors")).unwrap();
        let reference = SafeTensors::deserialize(&bytes).unwrap();
        let ids = ids(&reference, 0).unwrap();
        let ha = a.hidden_states(&ids).unwrap();
        let hb = b.hidden_states(&ids).unwrap();
        assert!(ha == hb, "{name}: fused experts change the hidden states");
        same += 1;
    }
    eprintln!(
        "fused experts: {same} cases bit-identical, {refused} refused (FP8 tile straddles gate/up)"
    );
    assert!(same > 0);
}
