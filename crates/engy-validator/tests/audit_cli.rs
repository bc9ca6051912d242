//! `engy-validator audit` as a process: verdicts map to exit codes 0 / 1 / 2 / 3 and `--json`
//! prints the report.
use std::process::Command;

use engy_core::toploc::Params;
use engy_model::audit::commit_greedy;
use engy_model::{gen_model, Checkpoint, GenConfig, Precision};

fn run(args: &[&str]) -> (i32, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_engy-validator"))
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

    let missing = t.path().join("nope").to_string_lossy().into_owned();
    let good_path = write("g2.json", &good);
    let (code, _) = run(&["--checkpoint", &missing, "--commitment", &good_path]);
    assert_eq!(code, 3);
}
