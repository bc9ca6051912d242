//! Conformance of `engy_core::toploc` with the golden vectors of PyPI toploc 0.1.6.
//!
//! Reads every `*.json` in `$ENGY_VECTORS_DIR/toploc` (else `<workspace>/tests/vectors/toploc`),
//! dispatches on the top-level `kind` (build / verify / poly / topk; files without a `kind`,
//! like `manifest.json`, are skipped) and checks every case. No file names or case counts
//! are assumed; the test prints how many cases of each kind ran and fails if any kind ran
//! zero cases. Every mismatch is reported with its file and case name.
//!
//! Rules (see `tests/vectors/toploc/README.md`):
//! * build: proofs (base64 and decoded) byte-identical; per batch `flat_len`, top-k
//!   algorithm, `topk_indices` (same order) and `topk_value_bits`. `fallback_to_null` → our
//!   typed error, and `null_proofs_like_reference` reproduces the reference's bytes.
//!   `raises` → typed error. float32 input → `Dtype::from_torch_name` refuses it.
//! * verify: `tensor_path` results → ours equal (exp_mismatches exact, mean/median within
//!   1e-9 relative); `tensor_path = {crash}` (null proofs) → our `NullProof` error.
//!   `tensor_path = null` (prefill or ragged input, where toploc uses its Python list path)
//!   → compared with `list_path` only where the list path equals the tensor semantics: when
//!   every proof modulus is 65497 (raw index ≡ reduced index). Then exp_mismatches and mean
//!   must be equal; the median must be equal when the count of matched exponents
//!   (n = topk − exp_mismatches) is odd; for even n the list path averages the two middle
//!   values while we take the upper one, so we only require ours ≥ list and
//!   2·list − ours ≥ 0 (the implied lower middle is a valid error). Checks with a proof
//!   modulus below 65497 and no tensor path are counted as skipped. A list-path `raises` →
//!   our error. A proof count different from the batch count → our `ProofCountMismatch`.
//! * poly: evaluate / from_points / decode / null exactly.
//! * topk: indices in torch's order, the algorithm name, and |x| bits as torch's `abs()`
//!   gives them (bf16 NaN → 0x7FC0).

mod common;

use std::collections::BTreeMap;

use engy_core::toploc::{
    bf16_bits_to_f32, build_proofs, build_proofs_base64, build_proofs_detailed, f32_to_bf16_bits,
    null_proofs_like_reference, select_topk, topk_algorithm, verify_proofs_base64, Dtype, Params,
    ProofPoly, ToplocError, VerifyResult,
};
use serde_json::Value;

/// A tensor record decoded: dtype (or the refused dtype name) and 16-bit patterns.
struct Tensor {
    dtype: Result<Dtype, ToplocError>,
    bits: Vec<u16>,
    shape: Vec<usize>,
}

fn tensor(v: &Value) -> Result<Tensor, String> {
    let name = v["dtype"].as_str().ok_or("tensor without dtype")?;
    let dtype = Dtype::from_torch_name(name);
    let raw = v["bits"].as_array().ok_or("tensor without bits")?;
    let bits = if dtype.is_ok() {
        raw.iter()
            .map(|b| {
                b.as_u64()
                    .and_then(|b| u16::try_from(b).ok())
                    .ok_or("bad bits")
            })
            .collect::<Result<Vec<_>, _>>()?
    } else {
        Vec::new() // float32: refused before its bits matter
    };
    let shape = v["shape"]
        .as_array()
        .ok_or("tensor without shape")?
        .iter()
        .map(|d| d.as_u64().unwrap() as usize)
        .collect::<Vec<_>>();
    if dtype.is_ok() && shape.iter().product::<usize>() != bits.len() {
        return Err(format!(
            "shape {shape:?} does not match {} bits",
            bits.len()
        ));
    }
    Ok(Tensor { dtype, bits, shape })
}

fn tensors(v: &Value) -> Result<Vec<Tensor>, String> {
    v.as_array()
        .ok_or("inputs is not a list")?
        .iter()
        .map(tensor)
        .collect()
}

/// The one dtype of a list of tensors (Bf16 for an empty list), or the refusal.
fn common_dtype(ts: &[Tensor]) -> Result<Dtype, ToplocError> {
    let mut dtype = Dtype::Bf16;
    for (i, t) in ts.iter().enumerate() {
        let d = t.dtype.clone()?;
        if i > 0 && d != dtype {
            panic!("mixed dtypes in one input list");
        }
        dtype = d;
    }
    Ok(dtype)
}

fn params(v: &Value) -> Params {
    Params {
        topk: v["topk"].as_u64().unwrap() as usize,
        decode_batching_size: v["decode_batching_size"].as_u64().unwrap() as usize,
        skip_prefill: v["skip_prefill"].as_bool().unwrap(),
    }
}

fn proof_obj(v: &Value) -> ProofPoly {
    ProofPoly {
        modulus: v["modulus"].as_u64().unwrap() as u16,
        coeffs: v["coeffs"]
            .as_array()
            .unwrap()
            .iter()
            .map(|c| c.as_u64().unwrap() as u16)
            .collect(),
    }
}

fn strings(v: &Value) -> Vec<String> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|s| s.as_str().unwrap().to_string())
        .collect()
}

fn u64s(v: &Value) -> Vec<u64> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap())
        .collect()
}

/// Whether our typed error names the cause behind the reference's message. Messages this
/// table does not know (a future vector set) only require that we returned an error.
fn error_matches_reference(ours: &ToplocError, reference: &str) -> bool {
    use ToplocError as E;
    type IsCause = fn(&ToplocError) -> bool;
    let known: [(&str, IsCause); 6] = [
        ("selected index k out of range", |e| {
            matches!(e, E::TopkExceedsBatch { .. })
        }),
        ("float32 not supported", |e| {
            matches!(e, E::UnsupportedDtype { .. })
        }),
        ("Input vectors must not be empty", |e| {
            matches!(e, E::TopkZero | E::NoPoints)
        }),
        ("list index out of range", |e| {
            matches!(e, E::NoPrefillElement)
        }),
        ("ZeroDivisionError", |e| {
            matches!(e, E::ZeroDecodeBatchingSize)
        }),
        ("No injective modulus", |e| {
            matches!(e, E::NoInjectiveModulus)
        }),
    ];
    known
        .iter()
        .find(|(needle, _)| reference.contains(needle))
        .is_none_or(|(_, check)| check(ours))
}

fn close(a: f64, b: f64) -> bool {
    a == b || (a - b).abs() <= 1e-9 * a.abs().max(b.abs()).max(1.0)
}

fn result_obj(v: &Value) -> VerifyResult {
    VerifyResult {
        exp_mismatches: v["exp_mismatches"].as_u64().unwrap(),
        mant_err_mean: v["mant_err_mean"].as_f64().unwrap(),
        mant_err_median: v["mant_err_median"].as_f64().unwrap(),
    }
}

#[derive(Default)]
struct Report {
    ran: BTreeMap<String, usize>,
    skipped: BTreeMap<String, usize>,
    failures: Vec<String>,
}

impl Report {
    fn fail(&mut self, at: &str, msg: impl AsRef<str>) {
        self.failures.push(format!("{at}: {}", msg.as_ref()));
    }
}

fn check_build(r: &mut Report, at: &str, case: &Value) -> Result<(), String> {
    let p = params(&case["params"]);
    let inputs = tensors(&case["inputs"])?;
    let slices: Vec<&[u16]> = inputs.iter().map(|t| t.bits.as_slice()).collect();
    let expected = &case["expected"];
    let dtype = common_dtype(&inputs);

    if expected.get("raises").is_some() {
        let ours = dtype.and_then(|d| build_proofs(&slices, d, &p));
        if ours.is_ok() {
            r.fail(
                at,
                format!("reference raises {}, we returned Ok", expected["raises"]),
            );
        }
        // The reference raises from inside its null-proof fallback (dbs = 0).
        if null_proofs_like_reference(inputs.len(), &p).is_ok() {
            r.fail(
                at,
                "null_proofs_like_reference accepted what the reference raises on",
            );
        }
        return Ok(());
    }

    let expected_b64 = strings(&expected["proofs_base64"]);
    let expected_proofs: Vec<ProofPoly> = expected["proofs"]
        .as_array()
        .unwrap()
        .iter()
        .map(proof_obj)
        .collect();
    for (b64, proof) in expected_b64.iter().zip(&expected_proofs) {
        if &proof.to_base64() != b64 {
            r.fail(
                at,
                "expected proof object does not encode to expected base64",
            );
        }
    }

    if expected["fallback_to_null"].as_bool().unwrap() {
        match dtype.and_then(|d| build_proofs(&slices, d, &p)) {
            Ok(_) => r.fail(
                at,
                format!(
                    "reference fell back to null proofs ({}), we built proofs",
                    expected["error"]
                ),
            ),
            Err(e) => {
                let reference = expected["error"].as_str().unwrap_or("");
                if !error_matches_reference(&e, reference) {
                    r.fail(
                        at,
                        format!(
                            "our error {e:?} does not name the reference's cause {reference:?}"
                        ),
                    );
                }
            }
        }
        match null_proofs_like_reference(inputs.len(), &p) {
            Ok(nulls) => {
                let ours: Vec<String> = nulls.iter().map(ProofPoly::to_base64).collect();
                if ours != expected_b64 {
                    r.fail(at, format!("null proofs {ours:?} != {expected_b64:?}"));
                }
            }
            Err(e) => r.fail(at, format!("null_proofs_like_reference failed: {e}")),
        }
        return Ok(());
    }

    let dtype = match dtype {
        Ok(d) => d,
        Err(e) => {
            r.fail(
                at,
                format!("dtype refused but the reference built proofs: {e}"),
            );
            return Ok(());
        }
    };
    let detailed = match build_proofs_detailed(&slices, dtype, &p) {
        Ok(d) => d,
        Err(e) => {
            r.fail(at, format!("build failed: {e}"));
            return Ok(());
        }
    };
    match build_proofs_base64(&slices, dtype, &p) {
        Ok(b64) if b64 == expected_b64 => {}
        Ok(b64) => {
            let first_diff = b64.iter().zip(&expected_b64).position(|(a, b)| a != b);
            r.fail(
                at,
                format!(
                    "base64 differs: {} proofs vs {} expected, first differing proof {first_diff:?}",
                    b64.len(),
                    expected_b64.len()
                ),
            );
        }
        Err(e) => r.fail(at, format!("build_proofs_base64 failed: {e}")),
    }
    let ours: Vec<ProofPoly> = detailed.iter().map(|b| b.proof.clone()).collect();
    if ours != expected_proofs {
        r.fail(at, "decoded proofs differ");
    }
    let batches = expected["batches"].as_array().unwrap();
    if batches.len() != detailed.len() {
        r.fail(
            at,
            format!("{} batches, expected {}", detailed.len(), batches.len()),
        );
    }
    for (i, (ob, eb)) in detailed.iter().zip(batches).enumerate() {
        if ob.flat_len as u64 != eb["flat_len"].as_u64().unwrap() {
            r.fail(
                at,
                format!("batch {i}: flat_len {} != {}", ob.flat_len, eb["flat_len"]),
            );
        }
        if ob.algorithm.vector_name() != eb["topk_algorithm"].as_str().unwrap() {
            r.fail(
                at,
                format!(
                    "batch {i}: algorithm {:?} != {}",
                    ob.algorithm, eb["topk_algorithm"]
                ),
            );
        }
        let ei: Vec<u64> = u64s(&eb["topk_indices"]);
        let oi: Vec<u64> = ob.topk_indices.iter().map(|&x| u64::from(x)).collect();
        if oi != ei {
            let pos = oi.iter().zip(&ei).position(|(a, b)| a != b);
            r.fail(
                at,
                format!("batch {i}: topk indices differ (first at position {pos:?})"),
            );
        }
        let ev: Vec<u64> = u64s(&eb["topk_value_bits"]);
        let ov: Vec<u64> = ob.topk_value_bits.iter().map(|&x| u64::from(x)).collect();
        if ov != ev {
            r.fail(at, format!("batch {i}: topk value bits differ"));
        }
    }
    Ok(())
}

fn check_verify(r: &mut Report, at: &str, case: &Value) -> Result<(), String> {
    let p = params(&case["params"]);
    let proofs_b64 = strings(&case["proofs_base64"]);
    let proofs: Vec<ProofPoly> = case["proofs"]
        .as_array()
        .unwrap()
        .iter()
        .map(proof_obj)
        .collect();
    for (b64, proof) in proofs_b64.iter().zip(&proofs) {
        match ProofPoly::from_base64(b64) {
            Ok(decoded) if &decoded == proof => {}
            other => r.fail(at, format!("proof decode mismatch: {other:?}")),
        }
    }
    let reference = tensors(&case["reference_inputs"])?;
    let all_prime = proofs.iter().all(|q| q.modulus == 65497);
    let any_null = proofs.iter().any(|q| q.modulus == 0);
    for check in case["checks"].as_array().unwrap() {
        let at = format!("{at}/{}", check["perturbation"].as_str().unwrap_or("?"));
        *r.ran.entry("verify(check)".into()).or_default() += 1;
        let owned;
        let inputs: &[Tensor] = match &check["inputs"] {
            Value::String(_) => &reference,
            v => {
                owned = tensors(v)?;
                &owned
            }
        };
        let slices: Vec<&[u16]> = inputs.iter().map(|t| t.bits.as_slice()).collect();
        let ours =
            common_dtype(inputs).and_then(|d| verify_proofs_base64(&slices, d, &proofs_b64, &p));
        let tensor_path = &check["tensor_path"];
        let list_path = &check["list_path"];
        if let Some(arr) = tensor_path.as_array() {
            let expected: Vec<VerifyResult> = arr.iter().map(result_obj).collect();
            compare_exact(r, &at, &ours, &expected);
        } else if tensor_path.get("crash").is_some() {
            match &ours {
                Err(ToplocError::NullProof { .. }) if any_null => {}
                other => r.fail(&at, format!("tensor path crashes; we gave {other:?}")),
            }
        } else if list_path.get("raises").is_some() {
            if ours.is_ok() {
                r.fail(&at, "list path raises; we returned Ok");
            }
        } else if any_null {
            if !matches!(ours, Err(ToplocError::NullProof { .. })) {
                r.fail(
                    &at,
                    format!("null proofs: expected NullProof, got {ours:?}"),
                );
            }
        } else if all_prime {
            let expected: Vec<VerifyResult> = list_path
                .as_array()
                .unwrap()
                .iter()
                .map(result_obj)
                .collect();
            compare_with_list(r, &at, &ours, &expected, &proofs, p.topk);
        } else {
            *r.skipped.entry("verify(check)".into()).or_default() += 1;
        }
    }
    Ok(())
}

fn compare_exact(
    r: &mut Report,
    at: &str,
    ours: &Result<Vec<VerifyResult>, ToplocError>,
    expected: &[VerifyResult],
) {
    match ours {
        Err(e) => r.fail(at, format!("verify failed: {e}")),
        Ok(ours) => {
            if ours.len() != expected.len() {
                r.fail(
                    at,
                    format!("{} results, expected {}", ours.len(), expected.len()),
                );
            }
            for (i, (o, e)) in ours.iter().zip(expected).enumerate() {
                if o.exp_mismatches != e.exp_mismatches
                    || !close(o.mant_err_mean, e.mant_err_mean)
                    || !close(o.mant_err_median, e.mant_err_median)
                {
                    r.fail(at, format!("batch {i}: ours {o:?} != tensor path {e:?}"));
                }
            }
        }
    }
}

fn compare_with_list(
    r: &mut Report,
    at: &str,
    ours: &Result<Vec<VerifyResult>, ToplocError>,
    expected: &[VerifyResult],
    proofs: &[ProofPoly],
    topk: usize,
) {
    let ours = match ours {
        Err(ToplocError::ProofCountMismatch { .. }) if expected.len() < proofs.len() => return,
        Err(e) => return r.fail(at, format!("verify failed: {e}")),
        Ok(o) => o,
    };
    if ours.len() != expected.len() {
        return r.fail(
            at,
            format!("{} results, list path has {}", ours.len(), expected.len()),
        );
    }
    for (i, (o, e)) in ours.iter().zip(expected).enumerate() {
        let n = topk as u64 - e.exp_mismatches;
        let median_ok = if n % 2 == 1 || n == 0 {
            close(o.mant_err_median, e.mant_err_median)
        } else {
            o.mant_err_median >= e.mant_err_median
                && 2.0 * e.mant_err_median - o.mant_err_median >= 0.0
        };
        if o.exp_mismatches != e.exp_mismatches
            || !close(o.mant_err_mean, e.mant_err_mean)
            || !median_ok
        {
            r.fail(
                at,
                format!("batch {i}: ours {o:?} vs list path {e:?} (n = {n})"),
            );
        }
    }
}

fn check_poly(r: &mut Report, at: &str, case: &Value) -> Result<(), String> {
    let kind = case["kind"].as_str().ok_or("poly case without kind")?;
    *r.ran.entry(format!("poly({kind})")).or_default() += 1;
    let expected = &case["expected"];
    match kind {
        "evaluate" => {
            let proof = ProofPoly::from_base64(case["proof_base64"].as_str().unwrap())
                .map_err(|e| format!("decode: {e}"))?;
            if proof != proof_obj(case) {
                r.fail(at, "decoded proof differs from modulus/coeffs");
            }
            for pt in case["points"].as_array().unwrap() {
                let x = pt["x"].as_i64().unwrap();
                let y = pt["y"].as_u64().unwrap();
                let got = proof.evaluate(x);
                if u64::from(got) != y {
                    r.fail(at, format!("evaluate({x}) = {got}, expected {y}"));
                }
            }
        }
        "from_points" => {
            let x: Vec<i64> = case["x"]
                .as_array()
                .unwrap()
                .iter()
                .map(|v| v.as_i64().unwrap())
                .collect();
            let y: Vec<i64> = case["y"]
                .as_array()
                .unwrap()
                .iter()
                .map(|v| v.as_i64().unwrap())
                .collect();
            let ours = ProofPoly::from_points(&x, &y);
            if expected.get("raises").is_some() {
                if ours.is_ok() {
                    r.fail(
                        at,
                        format!("reference raises {}, we returned Ok", expected["message"]),
                    );
                }
                return Ok(());
            }
            let ours = match ours {
                Ok(p) => p,
                Err(e) => {
                    r.fail(at, format!("from_points failed: {e}"));
                    return Ok(());
                }
            };
            if ours != proof_obj(expected) {
                r.fail(at, format!("{ours:?} != expected"));
            }
            if ours.to_base64() != expected["base64"].as_str().unwrap() {
                r.fail(at, "base64 differs");
            }
            let evals = u64s(&expected["eval_at_x_mod_modulus"]);
            let ymods = u64s(&expected["y_mod_65497"]);
            for ((&xi, &yi), (&ev, &ym)) in x.iter().zip(&y).zip(evals.iter().zip(&ymods)) {
                let got = ours.evaluate(xi.rem_euclid(i64::from(ours.modulus)));
                if u64::from(got) != ev || yi.rem_euclid(65497) as u64 != ym || ev != ym {
                    r.fail(
                        at,
                        format!("point x={xi}: evaluate {got}, expected {ev} (y mod p {ym})"),
                    );
                }
            }
        }
        "decode" => {
            let ours = if let Some(b64) = case.get("input_base64").and_then(Value::as_str) {
                ProofPoly::from_base64(b64)
            } else {
                let hex = case["input_hex"]
                    .as_str()
                    .ok_or("decode case without input")?;
                ProofPoly::from_bytes(&hex::decode(hex).map_err(|e| e.to_string())?)
            };
            if expected.get("raises").is_some() {
                if !matches!(ours, Err(ToplocError::ProofTooShort { .. })) {
                    r.fail(at, format!("expected ProofTooShort, got {ours:?}"));
                }
                return Ok(());
            }
            match ours {
                Ok(p) => {
                    if p != proof_obj(expected) {
                        r.fail(at, format!("{p:?} != expected"));
                    }
                    if p.to_base64() != expected["reencoded_base64"].as_str().unwrap() {
                        r.fail(at, "re-encoded base64 differs");
                    }
                }
                Err(e) => r.fail(at, format!("decode failed: {e}")),
            }
        }
        "null" => {
            let k = case["k"].as_u64().unwrap() as usize;
            let ours = ProofPoly::null(k);
            if ours != proof_obj(expected)
                || ours.to_base64() != expected["base64"].as_str().unwrap()
            {
                r.fail(at, "null proof differs");
            }
        }
        other => r.fail(at, format!("unknown poly case kind {other}")),
    }
    Ok(())
}

fn check_topk(r: &mut Report, at: &str, case: &Value) -> Result<(), String> {
    let t = tensor(&case["input"])?;
    let dtype = t.dtype.clone().map_err(|e| e.to_string())?;
    if t.shape.len() != 1 {
        return Err(format!("topk input of shape {:?}", t.shape));
    }
    let k = case["k"].as_u64().unwrap() as usize;
    let algo = topk_algorithm(k, t.bits.len());
    if algo.vector_name() != case["algorithm"].as_str().unwrap() {
        r.fail(at, format!("algorithm {algo:?} != {}", case["algorithm"]));
    }
    let ours = match select_topk(&t.bits, dtype, k) {
        Ok(o) => o,
        Err(e) => {
            r.fail(at, format!("select_topk failed: {e}"));
            return Ok(());
        }
    };
    let expected = u64s(&case["expected_indices"]);
    let got: Vec<u64> = ours.iter().map(|&i| u64::from(i)).collect();
    if got != expected {
        let pos = got.iter().zip(&expected).position(|(a, b)| a != b);
        r.fail(at, format!("indices differ (first at position {pos:?})"));
    }
    let abs_bits = u64s(&case["expected_abs_bits"]);
    for (&i, &e) in ours.iter().zip(&abs_bits) {
        let b = t.bits[i as usize];
        let torch_abs = match dtype {
            Dtype::Bf16 => f32_to_bf16_bits(bf16_bits_to_f32(b).abs()),
            Dtype::F16 => half::f16::from_f32(half::f16::from_bits(b).to_f32().abs()).to_bits(),
        };
        if u64::from(torch_abs) != e {
            r.fail(at, format!("|x| bits at {i}: {torch_abs:#06x} != {e:#06x}"));
        }
    }
    Ok(())
}

#[test]
fn toploc_golden_vectors() {
    let dir = common::vectors_dir().join("toploc");
    let files = common::json_files("toploc");
    let mut r = Report::default();
    for file in &files {
        let name = file.file_name().unwrap().to_string_lossy().to_string();
        let doc: Value = serde_json::from_slice(&std::fs::read(file).unwrap())
            .unwrap_or_else(|e| panic!("{name}: bad JSON: {e}"));
        let Some(kind) = doc.get("kind").and_then(Value::as_str) else {
            continue; // manifest and other non-case files
        };
        let cases = doc["cases"]
            .as_array()
            .unwrap_or_else(|| panic!("{name}: no cases"));
        for case in cases {
            let at = format!("{name}/{}", case["name"].as_str().unwrap_or("?"));
            let outcome = match kind {
                "build" => check_build(&mut r, &at, case),
                "verify" => check_verify(&mut r, &at, case),
                "poly" => check_poly(&mut r, &at, case),
                "topk" => check_topk(&mut r, &at, case),
                other => Err(format!("unknown kind {other}")),
            };
            if let Err(e) = outcome {
                r.fail(&at, format!("malformed case: {e}"));
            }
            *r.ran.entry(kind.to_string()).or_default() += 1;
        }
    }
    println!("toploc vectors from {}", dir.display());
    for (kind, n) in &r.ran {
        println!("  {kind}: {n} ran");
    }
    for (kind, n) in &r.skipped {
        println!("  {kind}: {n} skipped (list path with a proof modulus below 65497)");
    }
    for kind in ["build", "verify", "poly", "topk"] {
        if r.ran.get(kind).copied().unwrap_or(0) == 0 {
            r.fail(kind, "zero cases of this kind ran");
        }
    }
    assert!(
        r.failures.is_empty(),
        "{} mismatches:\n{}",
        r.failures.len(),
        r.failures.join("\n")
    );
}
