//! The running build in `--version`, `health` and the `build_info` metric (issue 21 item 9):
//! the workspace version, the git commit of this source tree and the dirty flag.

mod common;

use common::*;

/// `git rev-parse HEAD` of this source tree (or the ENGY_GIT_COMMIT the build was given);
/// `unknown` without git.
fn source_commit() -> String {
    if let Some(c) = option_env!("ENGY_GIT_COMMIT") {
        return c.trim().to_ascii_lowercase();
    }
    std::process::Command::new("git")
        .args(["rev-parse", "HEAD"])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned())
        .unwrap_or_else(|| "unknown".into())
}

#[tokio::test]
async fn version_health_and_metric_name_the_commit() {
    let want = format!(
        "{} (commit {}, dirty=",
        env!("CARGO_PKG_VERSION"),
        source_commit()
    );
    let env = Env::new(
        CHARLIE_SEED,
        "http://127.0.0.1:9",
        &key(ALICE_SEED).ss58(),
        "ws://127.0.0.1:9",
    );
    let out = env.run(&["--version"]).await;
    assert!(out.status.success());
    let version = String::from_utf8_lossy(&out.stdout);
    assert!(
        version.starts_with(&format!("engy-validator {want}")),
        "{version}"
    );

    // No heartbeat yet: unhealthy, and the line still names the build.
    let out = env.run(&["health"]).await;
    assert_eq!(out.status.code(), Some(1));
    let line = String::from_utf8_lossy(&out.stdout);
    assert!(line.contains(&format!("engy-validator {want}")), "{line}");

    let mut registry = engy_telemetry::prometheus_client::registry::Registry::default();
    let _m = engy_validator::metrics::Metrics::register(&mut registry);
    let text = engy_telemetry::metrics::encode(&registry).unwrap();
    let series = format!(
        r#"engy_validator_build_info{{version="{}",commit="{}",dirty="#,
        env!("CARGO_PKG_VERSION"),
        source_commit()
    );
    assert!(
        text.lines()
            .any(|l| l.starts_with(&series) && l.ends_with("\"} 1")),
        "{series} in\n{text}"
    );
}
