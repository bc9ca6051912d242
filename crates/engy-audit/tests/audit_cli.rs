//! `engy-audit` as a process: `audit` verdicts map to exit codes 0 / 1 / 2 / 3 and `--json`
//! prints the report; a closed standard output ends it quietly; toploc's "no exponent
//! matched" sentinel is reported as n/a, never as a mean; `spec` builds and verifies.
use std::path::Path;
use std::process::{Command, Stdio};

use engy_core::toploc::{self, Dtype, Params};
use engy_model::audit::commit_greedy;
use engy_model::{gen_model, Checkpoint, GenConfig, Precision};

fn run(args: &[&str]) -> (i32, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_engy-audit"))
        .arg("audit")
        .args(args)
        .output()
        .unwrap();
    (
        out.status.code().unwrap(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
    )
}

#[test]
fn audit_exit_codes_follow_the_verdict() {
    let t = tempfile::tempdir().unwrap();
    let dir = t.path().join("m");
    gen_model(&dir, 3, &GenConfig::default()).unwrap();
    let honest = Checkpoint::open(&dir, Precision::Bf16).unwrap();
    let cheat = Checkpoint::open(&dir, Precision::Int4 { group_size: 32 }).unwrap();
    let prompt = honest
        .tokenizer
        .encode(
            "<|im_start|>user\nExplain the audit?<|im_end|>\n<|im_start|>assistant\n",
            false,
        )
        .unwrap()
        .get_ids()
        .to_vec();
    let write = |name: &str, v: &serde_json::Value| {
        let p = t.path().join(name);
        std::fs::write(&p, serde_json::to_vec(v).unwrap()).unwrap();
        p.to_string_lossy().into_owned()
    };
    let ck = dir.to_string_lossy().into_owned();
    let good = commit_greedy(
        &honest.model,
        &honest.model_root,
        &prompt,
        70,
        &[],
        &Params::ENGY,
    )
    .unwrap();
    let bad = commit_greedy(
        &cheat.model,
        &cheat.model_root,
        &prompt,
        70,
        &[],
        &Params::ENGY,
    )
    .unwrap();
    let mut broken = good.clone();
    broken["toploc"]["n_tokens"] = 3.into();

    let (code, out) = run(&[
        "--checkpoint",
        &ck,
        "--commitment",
        &write("good.json", &good),
    ]);
    assert_eq!(code, 0, "{out}");
    assert!(out.starts_with("verdict: pass"), "{out}");

    let bad_path = write("bad.json", &bad);
    let (code, out) = run(&["--checkpoint", &ck, "--commitment", &bad_path, "--json"]);
    assert_eq!(code, 1, "{out}");
    let report: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
    assert_eq!(report["verdict"], "cheat");
    assert!(report["score"].as_f64().unwrap() > 0.2);

    let broken_path = write("broken.json", &broken);
    let (code, out) = run(&["--checkpoint", &ck, "--commitment", &broken_path]);
    assert_eq!(code, 2, "{out}");
    assert!(out.contains("unproven"), "{out}");

    let not_json = t.path().join("x.json");
    std::fs::write(&not_json, b"{not json").unwrap();
    let (code, _) = run(&[
        "--checkpoint",
        &ck,
        "--commitment",
        &not_json.to_string_lossy(),
    ]);
    assert_eq!(code, 2);
    // Bytes that are not UTF-8 are the miner's garbage too (unproven), not an unreadable
    // file (3); a UTF-8 byte order mark in front of JSON is ignored (RFC 8259 §8.1).
    for (name, bytes) in [
        ("latin1.json", b"{\"model_root\": \"\xff\xfe\"}".to_vec()),
        ("binary.json", vec![0x9f, 0x00, 0xc3, 0x28, 0xff]),
    ] {
        let p = t.path().join(name);
        std::fs::write(&p, bytes).unwrap();
        let (code, out) = run(&["--checkpoint", &ck, "--commitment", &p.to_string_lossy()]);
        assert_eq!(code, 2, "{name}: {out}");
        assert!(
            out.starts_with("verdict: unproven (the commitment file is not UTF-8 JSON"),
            "{out}"
        );
    }
    let bom = t.path().join("bom.json");
    let mut bytes = b"\xEF\xBB\xBF".to_vec();
    bytes.extend(serde_json::to_vec(&good).unwrap());
    std::fs::write(&bom, bytes).unwrap();
    let (code, out) = run(&["--checkpoint", &ck, "--commitment", &bom.to_string_lossy()]);
    assert_eq!(code, 0, "{out}");

    let missing = t.path().join("nope").to_string_lossy().into_owned();
    let good_path = write("g2.json", &good);
    let (code, _) = run(&["--checkpoint", &missing, "--commitment", &good_path]);
    assert_eq!(code, 3);
}

/// Several `--commitment`s are audited in one run against the checkpoint opened once (here
/// kept decoded, `--resident`): a report per commitment, in order, each naming its file, and
/// one exit code: a cheat first, then an audit that could not run, then unproven.
#[test]
fn several_commitments_are_audited_in_one_run() {
    let t = tempfile::tempdir().unwrap();
    let Files {
        ck,
        good,
        bad,
        junk,
        missing,
    } = files(t.path());
    let audit = |files: &[&str], json: bool| {
        let mut args = vec!["--checkpoint", ck.as_str(), "--resident"];
        for f in files {
            args.extend(["--commitment", f]);
        }
        if json {
            args.push("--json");
        }
        run(&args)
    };

    let (code, out) = audit(&[&good, &bad, &junk], false);
    assert_eq!(code, 1, "{out}");
    let heads: Vec<&str> = out
        .lines()
        .filter(|l| l.starts_with("commitment: "))
        .collect();
    assert_eq!(
        heads,
        [good.as_str(), bad.as_str(), junk.as_str()].map(|f| format!("commitment: {f}")),
        "{out}"
    );
    let verdicts: Vec<&str> = out.lines().filter(|l| l.starts_with("verdict: ")).collect();
    assert_eq!(verdicts.len(), 3, "{out}");
    assert_eq!(verdicts[0], "verdict: pass", "{out}");
    assert_eq!(verdicts[1], "verdict: cheat", "{out}");
    assert!(verdicts[2].starts_with("verdict: unproven"), "{out}");

    let (code, out) = audit(&[&good, &junk, &bad], true);
    assert_eq!(code, 1, "{out}");
    let reports: Vec<serde_json::Value> = out
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let seen: Vec<(&str, &str)> = reports
        .iter()
        .map(|r| {
            (
                r["commitment"].as_str().unwrap(),
                r["verdict"].as_str().unwrap(),
            )
        })
        .collect();
    assert_eq!(
        seen,
        [
            (good.as_str(), "pass"),
            (junk.as_str(), "unproven"),
            (bad.as_str(), "cheat")
        ],
        "{out}"
    );

    // The same commitment twice: both pass (the second on the kept weights).
    let (code, out) = audit(&[&good, &good], false);
    assert_eq!(code, 0, "{out}");
    assert_eq!(out.matches("verdict: pass").count(), 2, "{out}");
    // An unreadable file does not stop the others; it outranks an unproven one.
    let (code, out) = audit(&[&missing, &good, &junk], false);
    assert_eq!(code, 3, "{out}");
    assert_eq!(out.matches("verdict: pass").count(), 1, "{out}");
    assert_eq!(out.matches("verdict: unproven").count(), 1, "{out}");
    // With --json it still has its line, in its turn: a reader gets one per --commitment.
    let (code, out) = audit(&[&good, &missing, &bad], true);
    assert_eq!(code, 1, "{out}");
    let lines: Vec<serde_json::Value> = out
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 3, "{out}");
    assert_eq!(lines[1]["commitment"], missing.as_str(), "{out}");
    assert!(lines[1]["verdict"].is_null(), "{out}");
    assert!(
        lines[1]["error"].as_str().unwrap().contains("reading"),
        "{out}"
    );
    // Standard input can be read once only.
    let (code, _) = audit(&["-", "-"], false);
    assert_eq!(code, 3);
}

/// `--batch N` audits up to N commitments in one pass over streamed weights and prints, in
/// the order given, exactly the reports they get one by one (an unreadable and a non-JSON
/// file among them keep their lines); the exit code is the same.
#[test]
fn a_batch_prints_the_reports_each_commitment_gets_alone() {
    let t = tempfile::tempdir().unwrap();
    let Files {
        ck,
        good,
        bad,
        junk,
        missing,
    } = files(t.path());
    let files = [&good, &bad, &junk, &good, &missing, &bad, &good];
    let audit = |batch: &str| {
        let mut args = vec!["--checkpoint", ck.as_str(), "--json", "--batch", batch];
        for f in files {
            args.extend(["--commitment", f.as_str()]);
        }
        run(&args)
    };
    let (code_one, one) = audit("1");
    assert_eq!(code_one, 1, "{one}");
    assert_eq!(one.lines().count(), files.len(), "{one}");
    for batch in ["3", "7"] {
        let (code, out) = audit(batch);
        assert_eq!(code, code_one, "--batch {batch}: {out}");
        assert_eq!(out, one, "--batch {batch} printed other reports");
    }
    let (code, _) = audit("0");
    assert_eq!(code, 3, "--batch 0 is a usage error");
}

/// A checkpoint in `root/m` and commitment files beside it: an honest one, an int4 cheat's,
/// one that is not JSON and the path of one that does not exist.
struct Files {
    ck: String,
    good: String,
    bad: String,
    junk: String,
    missing: String,
}

fn files(root: &Path) -> Files {
    let dir = root.join("m");
    let (honest, prompt, good) = honest_commitment(&dir);
    let cheat = Checkpoint::open(&dir, Precision::Int4 { group_size: 32 }).unwrap();
    let bad = commit_greedy(
        &cheat.model,
        &cheat.model_root,
        &prompt,
        40,
        &[],
        &Params::ENGY,
    )
    .unwrap();
    drop(honest);
    let write = |name: &str, bytes: &[u8]| {
        let p = root.join(name);
        std::fs::write(&p, bytes).unwrap();
        p.to_string_lossy().into_owned()
    };
    Files {
        ck: dir.to_string_lossy().into_owned(),
        good: write("good.json", &serde_json::to_vec(&good).unwrap()),
        bad: write("bad.json", &serde_json::to_vec(&bad).unwrap()),
        junk: write("junk.json", b"{not json"),
        missing: root.join("gone.json").to_string_lossy().into_owned(),
    }
}

/// The commitment files are read before the checkpoint is opened (which may decode all of
/// it): a wrong commitment path is the error reported, even beside a wrong checkpoint.
#[test]
fn an_unreadable_commitment_fails_before_the_checkpoint_is_opened() {
    let t = tempfile::tempdir().unwrap();
    let gone = t.path().join("gone.json");
    let out = Command::new(env!("CARGO_BIN_EXE_engy-audit"))
        .args(["audit", "--checkpoint"])
        .arg(t.path().join("no-checkpoint"))
        .arg("--commitment")
        .arg(&gone)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(3), "{err}");
    assert!(
        err.contains(&format!("reading {}", gone.display())),
        "{err}"
    );
    assert!(!err.contains("opening checkpoint"), "{err}");
}

/// A usage error (unknown flag, a value that does not parse, from the flag or its variable)
/// is the subcommand's "could not run" code, never a verdict's: 3 for `audit` and `cells`
/// (2 is unproven / bundle refused), 1 for `spec` (2 is "roots differ"); a value from a
/// variable is reported under the variable's name.
#[test]
fn usage_errors_never_exit_with_a_verdicts_code() {
    let engy_audit = |args: &[&str], env: &[(&str, &str)]| {
        let out = Command::new(env!("CARGO_BIN_EXE_engy-audit"))
            .args(args)
            .envs(env.iter().copied())
            .output()
            .unwrap();
        (
            out.status.code().unwrap(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let audit = ["audit", "--checkpoint", "ck", "--commitment", "c.json"];
    let (code, err) = engy_audit(&[&audit[..], &["--bogus"]].concat(), &[]);
    assert_eq!(code, 3, "{err}");
    assert!(err.contains("--bogus"), "{err}");
    let (code, err) = engy_audit(&audit, &[("ENGY_AUDIT_RECOMPUTE", "fp16")]);
    assert_eq!(code, 3, "{err}");
    assert!(
        err.contains("invalid value 'fp16' for ENGY_AUDIT_RECOMPUTE"),
        "{err}"
    );
    let (code, err) = engy_audit(
        &["audit", "--commitment", "c.json"],
        &[("ENGY_CHECKPOINT", "")],
    );
    assert_eq!(code, 3, "{err}");
    assert!(err.contains("ENGY_CHECKPOINT"), "{err}");
    // A negative margin reaches the audit's own check (not "unexpected argument '-1'").
    let (code, err) = engy_audit(&[&audit[..], &["--routing-margin", "-1"]].concat(), &[]);
    assert_eq!(code, 3, "{err}");
    assert!(
        err.contains("--routing-margin (ENGY_AUDIT_ROUTING_MARGIN) must be"),
        "{err}"
    );
    // A pass ratio of 0 would pass every commitment.
    let (code, err) = engy_audit(&[&audit[..], &["--toploc-p", "0"]].concat(), &[]);
    assert_eq!(code, 3, "{err}");
    assert!(err.contains("--toploc-p must be above 0"), "{err}");
    let (code, err) = engy_audit(&["cells", "--bogus"], &[]);
    assert_eq!(code, 3, "{err}");
    let (code, err) = engy_audit(&["spec", "verify", "--bogus"], &[]);
    assert_eq!(code, 1, "{err}");
    let (code, _) = engy_audit(&["audit", "--help"], &[]);
    assert_eq!(code, 0);
}

/// Weights that make the recompute NaN (here the final norm's gain, written over in place so
/// that the file keeps its size and the checkpoint its model_root) give no verdict (exit 3,
/// "non-finite"): the auditor's checkpoint is damaged, the miner's commitment is not judged
/// on it.
#[test]
fn a_recompute_that_is_not_finite_gives_no_verdict() {
    let t = tempfile::tempdir().unwrap();
    let dir = t.path().join("m");
    let (honest, _, good) = honest_commitment(&dir);
    let root = honest.model_root.clone();
    drop(honest);
    // The shard holding the final norm, and that tensor's byte range in it.
    let (shard, mut bytes, range) = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "safetensors"))
        .find_map(|p| {
            let bytes = std::fs::read(&p).unwrap();
            let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
            let data = st.tensor("model.norm.weight").ok()?.data();
            let at = data.as_ptr() as usize - bytes.as_ptr() as usize;
            let range = at..at + data.len();
            Some((p, bytes, range))
        })
        .unwrap();
    // bf16 NaN, 0x7fc0, little-endian
    for pair in bytes[range].chunks_mut(2) {
        pair.copy_from_slice(&[0xc0, 0x7f]);
    }
    std::fs::write(&shard, bytes).unwrap();
    assert_eq!(engy_core::identity::model_root(&dir).unwrap(), root);
    let c = t.path().join("good.json");
    std::fs::write(&c, serde_json::to_vec(&good).unwrap()).unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_engy-audit"))
        .arg("audit")
        .arg("--checkpoint")
        .arg(&dir)
        .arg("--commitment")
        .arg(&c)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(3), "{err}");
    assert!(err.contains("non-finite hidden state"), "{err}");
    assert!(out.stdout.is_empty());
}

/// A seed-3 devnet checkpoint, its honest greedy commitment for a short chat prompt, and the
/// model it came from.
fn honest_commitment(dir: &Path) -> (Checkpoint, Vec<u32>, serde_json::Value) {
    gen_model(dir, 3, &GenConfig::default()).unwrap();
    let honest = Checkpoint::open(dir, Precision::Bf16).unwrap();
    let prompt = honest
        .tokenizer
        .encode(
            "<|im_start|>user\nWhy audit?<|im_end|>\n<|im_start|>assistant\n",
            false,
        )
        .unwrap()
        .get_ids()
        .to_vec();
    let good = commit_greedy(
        &honest.model,
        &honest.model_root,
        &prompt,
        40,
        &[],
        &Params::ENGY,
    )
    .unwrap();
    (honest, prompt, good)
}

#[test]
fn a_closed_stdout_ends_the_audit_quietly_with_the_verdict() {
    let t = tempfile::tempdir().unwrap();
    let dir = t.path().join("m");
    let (_, _, good) = honest_commitment(&dir);
    let path = t.path().join("good.json");
    std::fs::write(&path, serde_json::to_vec(&good).unwrap()).unwrap();
    for json in [false, true] {
        // The reader is gone before the auditor writes a byte (what `| head -1` leaves once it
        // has its line): every write to standard output fails with EPIPE.
        let (reader, writer) = std::io::pipe().unwrap();
        drop(reader);
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_engy-audit"));
        cmd.arg("audit")
            .arg("--checkpoint")
            .arg(&dir)
            .arg("--commitment")
            .arg(&path)
            .stdout(writer)
            .stderr(Stdio::piped());
        if json {
            cmd.arg("--json");
        }
        let out = cmd.output().unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!stderr.contains("panicked"), "json={json}: {stderr}");
        assert!(stderr.is_empty(), "json={json}: {stderr}");
        assert_eq!(out.status.code(), Some(0), "json={json}: {stderr}");
    }
}

#[test]
fn no_exponent_match_is_reported_as_na_not_as_the_2_pow_64_sentinel() {
    let t = tempfile::tempdir().unwrap();
    let dir = t.path().join("m");
    let (honest, prompt, mut commitment) = honest_commitment(&dir);
    // Proofs of the honest rows scaled by 2^10: the same top-k positions, every bf16 exponent
    // off by 10, so no exponent matches in any batch (toploc's 2^64 sentinel).
    let steps = honest.model.generate(&prompt, 40, &[]).unwrap();
    let rows: Vec<Vec<u16>> = steps
        .iter()
        .filter_map(|s| s.hidden.last())
        .map(|r| {
            let scaled: Vec<f32> = r.iter().map(|v| v * 1024.0).collect();
            toploc::f32_to_bf16_bits_slice(&scaled)
        })
        .collect();
    let elements: Vec<&[u16]> = rows.iter().map(Vec::as_slice).collect();
    let proofs = toploc::build_proofs_base64(&elements, Dtype::Bf16, &Params::ENGY).unwrap();
    commitment["toploc"]["proofs"] = serde_json::json!(proofs);
    let path = t.path().join("shifted.json");
    std::fs::write(&path, serde_json::to_vec(&commitment).unwrap()).unwrap();
    let ck = dir.to_string_lossy().into_owned();
    let path = path.to_string_lossy().into_owned();

    let (code, out) = run(&["--checkpoint", &ck, "--commitment", &path]);
    assert_eq!(code, 1, "{out}");
    assert!(out.starts_with("verdict: cheat"), "{out}");
    assert!(
        !out.contains("18446744073709551616") && !out.contains("e19"),
        "the sentinel printed as a mean: {out}"
    );
    let batch_lines: Vec<&str> = out.lines().filter(|l| l.contains("batch ")).collect();
    assert!(!batch_lines.is_empty(), "{out}");
    for l in batch_lines {
        assert!(
            l.contains("mantissa error n/a (no exponent matched)"),
            "{l}"
        );
    }

    let (code, out) = run(&["--checkpoint", &ck, "--commitment", &path, "--json"]);
    assert_eq!(code, 1, "{out}");
    let report: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
    let batches = report["batches"].as_array().unwrap();
    assert!(!batches.is_empty());
    for b in batches {
        assert_eq!(b["exp_mismatches"], 128, "{b}");
        assert!(b["mant_err_mean"].is_null(), "{b}");
        assert!(b["mant_err_median"].is_null(), "{b}");
    }
}

#[test]
fn spec_builds_and_verifies_a_checkpoint() {
    let t = tempfile::tempdir().unwrap();
    let dir = t.path().join("m");
    gen_model(&dir, 5, &GenConfig::default()).unwrap();
    let out_dir = t.path().join("spec");
    let spec = |args: &[&std::ffi::OsStr]| {
        Command::new(env!("CARGO_BIN_EXE_engy-audit"))
            .arg("spec")
            .args(args)
            .output()
            .unwrap()
    };
    let o = spec(&[
        "build".as_ref(),
        "--quiet".as_ref(),
        "--checkpoint".as_ref(),
        dir.as_os_str(),
        "--out".as_ref(),
        out_dir.as_os_str(),
    ]);
    assert_eq!(o.status.code(), Some(0), "{o:?}");
    let o = spec(&[
        "verify".as_ref(),
        "--quiet".as_ref(),
        "--checkpoint".as_ref(),
        dir.as_os_str(),
        "--spec".as_ref(),
        out_dir.as_os_str(),
    ]);
    assert_eq!(o.status.code(), Some(0), "{o:?}");
    // Another checkpoint does not match the spec: exit 2.
    let other = t.path().join("other");
    gen_model(&other, 6, &GenConfig::default()).unwrap();
    let o = spec(&[
        "verify".as_ref(),
        "--quiet".as_ref(),
        "--checkpoint".as_ref(),
        other.as_os_str(),
        "--spec".as_ref(),
        out_dir.as_os_str(),
    ]);
    assert_eq!(o.status.code(), Some(2), "{o:?}");
}
