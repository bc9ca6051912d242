//! `glm_moe_dsa` against transformers' reference (the `arch-oracle/1` vector set): every
//! layer's residual output, the routed experts and the DSA key selection of each query, the
//! final hidden states, and greedy decoding with a KV cache against the teacher-forced pass.
//!
//! Reads every case folder of `$ENGY_ARCH_VECTORS_DIR` (default `tests/vectors/arch`) whose
//! `case.json` has `arch` `glm_moe_dsa`, so it runs unchanged on another set of that schema.
use std::path::{Path, PathBuf};
use std::sync::Arc;

use candle_core::{DType, Device, Tensor};
use engy_model::arch::glm_moe_dsa::{GlmMoeDsa, GlmTrace};
use engy_model::arch::{Probe, Weights};
use engy_model::{Architecture, LoadOptions, Precision, Residency, TextConfig};
use safetensors::{Dtype, SafeTensors};

fn vectors_dir() -> PathBuf {
    match std::env::var_os("ENGY_ARCH_VECTORS_DIR") {
        Some(d) => PathBuf::from(d),
        None => Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/vectors/arch"),
    }
}

/// The glm case folders of the vector set, sorted.
fn glm_cases() -> Vec<PathBuf> {
    let dir = vectors_dir();
    let mut out = Vec::new();
    let entries = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e} (set ENGY_ARCH_VECTORS_DIR)", dir.display()));
    for e in entries {
        let p = e.unwrap().path();
        let Ok(case) = std::fs::read(p.join("case.json")) else {
            continue;
        };
        let case: serde_json::Value = serde_json::from_slice(&case).unwrap();
        if case["arch"] == "glm_moe_dsa" {
            out.push(p);
        }
    }
    out.sort();
    assert!(!out.is_empty(), "no glm_moe_dsa case in {}", dir.display());
    out
}

/// The reference tensors of a case, by name.
struct Reference {
    bytes: Vec<u8>,
}

impl Reference {
    fn open(case: &Path) -> Self {
        Self {
            bytes: std::fs::read(case.join("reference.safetensors")).unwrap(),
        }
    }

    fn st(&self) -> SafeTensors<'_> {
        SafeTensors::deserialize(&self.bytes).unwrap()
    }

    fn has(&self, name: &str) -> bool {
        self.st().tensor(name).is_ok()
    }

    fn f32s(&self, name: &str) -> (Vec<f32>, Vec<usize>) {
        let st = self.st();
        let t = st.tensor(name).unwrap();
        assert_eq!(t.dtype(), Dtype::F32, "{name}");
        let v = t
            .data()
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect();
        (v, t.shape().to_vec())
    }

    fn ints(&self, name: &str) -> (Vec<i64>, Vec<usize>) {
        let st = self.st();
        let t = st.tensor(name).unwrap();
        let d = t.data();
        let v = match t.dtype() {
            Dtype::I64 => d
                .chunks_exact(8)
                .map(|b| i64::from_le_bytes(b.try_into().unwrap()))
                .collect(),
            Dtype::I32 => d
                .chunks_exact(4)
                .map(|b| i32::from_le_bytes(b.try_into().unwrap()) as i64)
                .collect(),
            Dtype::U8 => d.iter().map(|&b| b as i64).collect(),
            other => panic!("{name}: unexpected dtype {other:?}"),
        };
        (v, t.shape().to_vec())
    }

    fn ids(&self, k: usize) -> Vec<u32> {
        self.ints(&format!("input_ids_{k}"))
            .0
            .into_iter()
            .map(|x| x as u32)
            .collect()
    }

    fn sequences(&self) -> usize {
        (0..)
            .take_while(|k| self.has(&format!("input_ids_{k}")))
            .count()
    }
}

/// Loads a case folder as the auditor does (mmapped shards, streaming dequantisation).
fn load(case: &Path) -> GlmMoeDsa {
    load_with(case, &LoadOptions::default())
}

/// [`load`] with `opts`' numerics (activation dtype, DSA tie order).
fn load_with(case: &Path, opts: &LoadOptions) -> GlmMoeDsa {
    let cfg = TextConfig::read(case).unwrap();
    let w = Weights::open(
        case,
        cfg.quantization.as_ref(),
        Precision::Bf16,
        Residency::Streaming,
    )
    .unwrap();
    GlmMoeDsa::load(cfg, Arc::new(w), opts).unwrap()
}

/// The case's tolerance for a row block whose largest |value| is `max_ref`: 20 × the reference's
/// own eager-vs-sdpa floor (`case.json` `tolerance.<field>`), at least 2e-5 × `max_ref`.
fn tolerance(case: &Path, field: &str, max_ref: f32) -> f32 {
    let c: serde_json::Value =
        serde_json::from_slice(&std::fs::read(case.join("case.json")).unwrap()).unwrap();
    let floor = c["tolerance"][field].as_f64().unwrap_or(1e-5) as f32;
    (20.0 * floor).max(2e-5 * max_ref)
}

fn max_abs(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

#[test]
fn glm_layers_experts_and_dsa_selection_match_transformers() {
    for case in glm_cases() {
        let m = load(&case);
        let r = Reference::open(&case);
        let hd = m.glm_config().hidden_size;
        for k in 0..r.sequences() {
            let ids = r.ids(k);
            let t = ids.len();
            let mut trace = GlmTrace::default();
            let mut cache = m.new_cache();
            let out = m
                .forward_traced(&ids, &mut cache, Some(&mut trace))
                .unwrap();
            for l in 0..m.glm_config().num_hidden_layers {
                let (want, shape) = r.f32s(&format!("layer_{l}_{k}"));
                assert_eq!(shape, vec![t, hd]);
                let got: Vec<f32> = trace.residuals[l].flatten_all().unwrap().to_vec1().unwrap();
                let err = max_abs(&got, &want);
                eprintln!("{} seq {k} layer {l}: max abs {err:.3e}", case.display());
                let dsa = format!("dsa_mask_{l}_{k}");
                if r.has(&dsa) {
                    let (mask, _) = r.ints(&dsa);
                    for (i, keys) in trace.attended[l].iter().enumerate() {
                        let want: Vec<usize> = (0..t).filter(|&j| mask[i * t + j] == 1).collect();
                        assert_eq!(keys, &want, "{dsa} row {i}");
                    }
                }
                let ex = format!("experts_{l}_{k}");
                if r.has(&ex) {
                    let (want, shape) = r.ints(&ex);
                    let got = trace.experts[l].as_ref().expect("MoE layer");
                    let kk = shape[1];
                    for (i, e) in got.iter().enumerate() {
                        let w: Vec<usize> = want[i * kk..(i + 1) * kk]
                            .iter()
                            .map(|&x| x as usize)
                            .collect();
                        assert_eq!(e, &w, "{ex} row {i}");
                    }
                }
                let max_ref = want.iter().fold(0f32, |m, x| m.max(x.abs()));
                let tol = tolerance(&case, "eager_vs_sdpa_fp32_max_abs_layers", max_ref);
                assert!(
                    err <= tol,
                    "{} layer {l} seq {k}: {err} > {tol}",
                    case.display()
                );
            }
            let (want, _) = r.f32s(&format!("hidden_{k}"));
            let got: Vec<f32> = out
                .to_dtype(DType::F32)
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1()
                .unwrap();
            let err = max_abs(&got, &want);
            eprintln!("{} seq {k} hidden: max abs {err:.3e}", case.display());
            let max_ref = want.iter().fold(0f32, |m, x| m.max(x.abs()));
            let tol = tolerance(&case, "eager_vs_sdpa_fp32_max_abs_hidden", max_ref);
            assert!(err <= tol, "{} seq {k}: {err} > {tol}", case.display());
        }
    }
}

/// Greedy decoding with the cache: each step's hidden row and DSA selection equal the
/// teacher-forced pass over prompt + generated tokens, and the sampled tokens are its argmax.
#[test]
fn glm_cached_decode_matches_the_teacher_forced_pass() {
    let case = glm_cases().into_iter().next().expect("a glm case");
    let m = load(&case);
    let r = Reference::open(&case);
    let ids = r.ids(0);
    // A prompt shorter than index_topk's budget would not exercise the selection: take one
    // that already drops keys, and decode past it.
    let prompt: Vec<u32> = ids[..ids.len().min(m.glm_config().index_topk + 4)].to_vec();
    let steps = 6;
    let mut cache = m.new_cache();
    let mut seq = prompt.clone();
    let mut rows: Vec<Vec<f32>> = Vec::new();
    let mut attended: Vec<Vec<Vec<usize>>> = vec![Vec::new(); m.glm_config().num_hidden_layers];
    let mut pending = prompt.clone();
    for _ in 0..steps {
        let mut tr = GlmTrace::default();
        let h = m
            .forward_traced(&pending, &mut cache, Some(&mut tr))
            .unwrap();
        for (l, a) in tr.attended.into_iter().enumerate() {
            attended[l].extend(a);
        }
        let hv = h.to_vec2::<f32>().unwrap();
        let last = h.narrow(0, hv.len() - 1, 1).unwrap();
        let logits = m
            .logits(&last)
            .unwrap()
            .squeeze(0)
            .unwrap()
            .to_vec1::<f32>()
            .unwrap();
        let mut best = 0;
        for (i, &x) in logits.iter().enumerate() {
            if x > logits[best] {
                best = i;
            }
        }
        rows.extend(hv);
        seq.push(best as u32);
        pending = vec![best as u32];
    }
    assert_eq!(cache.len(), seq.len() - 1);
    // Teacher-forced over everything fed so far (the last sampled token was never fed).
    let fed = &seq[..seq.len() - 1];
    let mut tr = GlmTrace::default();
    let full = m
        .forward_traced(fed, &mut m.new_cache(), Some(&mut tr))
        .unwrap()
        .to_vec2::<f32>()
        .unwrap();
    assert_eq!(full.len(), rows.len());
    let err = full
        .iter()
        .zip(&rows)
        .map(|(a, b)| max_abs(a, b))
        .fold(0.0, f32::max);
    eprintln!("cached decode vs teacher-forced: max abs {err:.3e}");
    // Same arithmetic on the same rows: prefill and step-by-step decode agree to the bit today;
    // allow f32 noise should a backend ever block the matmul by row count.
    assert!(err <= 1e-5, "{err}");
    assert_eq!(
        tr.attended, attended,
        "DSA selection differs between the two passes"
    );
    let tf_tokens: Vec<u32> = (prompt.len() - 1..fed.len())
        .map(|i| {
            let row = Tensor::from_slice(&full[i], (1, full[i].len()), &Device::Cpu).unwrap();
            let lg = m
                .logits(&row)
                .unwrap()
                .squeeze(0)
                .unwrap()
                .to_vec1::<f32>()
                .unwrap();
            let mut best = 0;
            for (j, &x) in lg.iter().enumerate() {
                if x > lg[best] {
                    best = j;
                }
            }
            best as u32
        })
        .collect();
    assert_eq!(tf_tokens, seq[prompt.len()..].to_vec());
}

/// Processing the query rows in blocks (to bound the score tensors' memory at long context)
/// changes no value: one-row blocks give the same bits as the whole sequence at once.
#[test]
fn glm_row_blocking_changes_nothing() {
    let case = glm_cases().into_iter().next().expect("a glm case");
    let r = Reference::open(&case);
    let ids = r.ids(r.sequences() - 1);
    let whole = load(&case);
    let blocked = load(&case).with_score_budget(1);
    let a = whole
        .forward(&ids, &mut whole.new_cache(), &mut Probe::default())
        .unwrap();
    let b = blocked
        .forward(&ids, &mut blocked.new_cache(), &mut Probe::default())
        .unwrap();
    let (a, b) = (a.to_vec2::<f32>().unwrap(), b.to_vec2::<f32>().unwrap());
    assert_eq!(a, b);
}

/// A pass whose DSA selections cut through no tie (`Probe::dsa_boundary_ties` stays 0) is the
/// pass with ties taken higher-first, bit for bit, which is why the auditor skips that
/// recompute then (engy_model::audit, step 6). Every case, both activation dtypes, the
/// reference's sequences and longer ones, so that selections past `index_topk` are made both
/// with and without ties.
#[test]
fn a_pass_that_cut_no_tie_is_the_higher_first_pass() {
    use engy_model::arch::TieOrder;
    use engy_model::Compute;
    let (mut same, mut cut) = (0usize, 0usize);
    for case in glm_cases() {
        let config: serde_json::Value =
            serde_json::from_slice(&std::fs::read(case.join("config.json")).unwrap()).unwrap();
        let topk = config["index_topk"].as_u64().expect("index_topk") as usize;
        let vocab = config["vocab_size"].as_u64().expect("vocab_size");
        let r = Reference::open(&case);
        let mut seqs: Vec<Vec<u32>> = (0..r.sequences()).map(|k| r.ids(k)).collect();
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        for len in [topk + 3, 3 * topk, 8 * topk] {
            seqs.push(
                (0..len)
                    .map(|_| {
                        x = x.wrapping_mul(6364136223846793005).wrapping_add(1);
                        ((x >> 33) % vocab) as u32
                    })
                    .collect(),
            );
        }
        for compute in [Compute::Bf16, Compute::F32] {
            let open = |dsa_ties| {
                let opts = LoadOptions {
                    compute,
                    dsa_ties,
                    ..LoadOptions::default()
                };
                load_with(&case, &opts)
            };
            let (lower, higher) = (open(TieOrder::LowerFirst), open(TieOrder::HigherFirst));
            for ids in &seqs {
                let mut ties = 0usize;
                let probe = &mut Probe {
                    dsa_boundary_ties: Some(&mut ties),
                    ..Probe::default()
                };
                let a = lower.forward(ids, &mut lower.new_cache(), probe).unwrap();
                let b = higher
                    .forward(ids, &mut higher.new_cache(), &mut Probe::default())
                    .unwrap();
                let bits = |t: &Tensor| -> Vec<u32> {
                    let v = t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
                    v.iter().map(|f| f.to_bits()).collect()
                };
                let equal = bits(&a) == bits(&b);
                println!(
                    "{} {compute:?} {} tokens: {ties} rows cut through a tie, the orders {}",
                    case.display(),
                    ids.len(),
                    if equal { "agree" } else { "differ" }
                );
                if ties == 0 {
                    assert!(
                        equal,
                        "{}: no tie cut, yet the orders differ",
                        case.display()
                    );
                    if ids.len() > topk {
                        same += 1;
                    }
                } else {
                    cut += 1;
                }
            }
        }
    }
    // Both outcomes occur past index_topk, so the assertion above tests something.
    assert!(
        same > 0 && cut > 0,
        "{same} passes without a cut tie, {cut} with"
    );
}
