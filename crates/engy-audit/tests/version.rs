//! `engy-audit --version` names the build as the daemons do (version, git commit, dirty flag:
//! engy-telemetry's build_info), and `--help` says what `--resident` keeps on each device.
use std::process::Command;

fn run(args: &[&str]) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_engy-audit"))
        .args(args)
        .env_clear()
        .output()
        .unwrap();
    assert!(out.status.success(), "{args:?}");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[test]
fn version_names_the_commit() {
    let v = run(&["--version"]);
    assert!(v.starts_with("engy-audit "), "{v}");
    assert!(v.contains("(commit ") && v.contains("dirty="), "{v}");
}

#[test]
fn help_says_what_resident_keeps_on_each_device() {
    let h = run(&["audit", "--help"]);
    let at = h.find("--resident").expect("--resident in audit --help");
    let text: String = h[at..at + 400.min(h.len() - at)]
        .split_whitespace()
        .collect::<Vec<_>>()
        .join(" ");
    assert!(
        text.contains("f32 on the CPU") && text.contains("bf16 on a GPU"),
        "{text}"
    );
}
