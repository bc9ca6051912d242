//! The /metrics endpoint on 127.0.0.1: what a Prometheus scrape sees, in both formats,
//! checked with real parsers (tests/metrics/check_exposition.py: promtool and
//! prometheus_client).
use std::path::PathBuf;
use std::sync::Arc;

use engy_telemetry::metrics::{
    labels, serve, Labels, MetricsError, CONTENT_TYPE, OPENMETRICS_CONTENT_TYPE, TEXT_CONTENT_TYPE,
};
use engy_telemetry::prometheus_client::metrics::counter::Counter;
use engy_telemetry::prometheus_client::metrics::family::Family;
use engy_telemetry::prometheus_client::metrics::gauge::Gauge;
use engy_telemetry::prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use engy_telemetry::prometheus_client::registry::Registry;

/// Runs tests/metrics/check_exposition.py on `text`: `Ok(true)` valid, `Ok(false)` skipped
/// (a tool missing and not required), `Err(why)` invalid.
fn check_exposition(format: &str, text: &str) -> Result<bool, String> {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..");
    let dir = tempfile_dir();
    let file = dir.join(format!("scrape.{format}"));
    std::fs::write(&file, text).map_err(|e| e.to_string())?;
    let out = std::process::Command::new("python3")
        .arg(root.join("tests/metrics/check_exposition.py"))
        .arg(format)
        .arg(&file)
        .output()
        .map_err(|e| format!("python3: {e}"))?;
    let _ = std::fs::remove_dir_all(&dir);
    let said = String::from_utf8_lossy(&out.stderr).into_owned();
    match out.status.code() {
        Some(0) => Ok(true),
        Some(77) => {
            println!("{}", said.trim());
            Ok(false)
        }
        _ => Err(said),
    }
}

fn tempfile_dir() -> PathBuf {
    let d = std::env::temp_dir().join(format!(
        "engy-telemetry-{}-{}",
        std::process::id(),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0)
    ));
    std::fs::create_dir_all(&d).unwrap();
    d
}

#[tokio::test]
async fn each_content_type_parses_with_a_real_parser_even_with_hostile_label_values() {
    let mut registry = Registry::with_prefix("engy_test");
    let errors = Family::<Labels, Counter>::default();
    let _ = errors.get_or_create(&labels(&[("kind", "transport")]));
    // what issue 21 saw as a label value: quotes and braces of a chain error
    errors
        .get_or_create(&labels(&[(
            "kind",
            "User error: {\"invalid\":{\"ancientBirthBlock\":null}} (1010)\n\\",
        )]))
        .inc();
    registry.register("chain_errors", "Chain failures by kind", errors);
    let g: Gauge = Gauge::default();
    g.set(293);
    registry.register("spec_version", "Runtime spec version", g);
    let h = Histogram::new(exponential_buckets(0.01, 2.0, 4));
    h.observe(0.05);
    registry.register("serve_seconds", "Serve time in \"seconds\"", h);
    let server = serve(
        "127.0.0.1:0".parse().unwrap(),
        Arc::new(registry),
        std::future::pending(),
    )
    .await
    .unwrap();
    let url = format!("http://{}/metrics", server.local_addr());
    let client = reqwest::Client::new();
    for (accept, want_type, format) in [
        (Some("text/plain;version=0.0.4"), TEXT_CONTENT_TYPE, "text"),
        (
            Some("application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1"),
            OPENMETRICS_CONTENT_TYPE,
            "openmetrics",
        ),
        (None, OPENMETRICS_CONTENT_TYPE, "openmetrics"),
    ] {
        let mut req = client.get(&url);
        if let Some(a) = accept {
            req = req.header("accept", a);
        }
        let reply = req.send().await.unwrap();
        assert_eq!(reply.headers()["content-type"], want_type, "{accept:?}");
        let text = reply.text().await.unwrap();
        match check_exposition(format, &text) {
            Ok(_) => {}
            Err(why) => panic!("{accept:?}: {why}\n{text}"),
        }
    }
}

#[tokio::test]
async fn a_scrape_reads_the_registry_as_it_is_now() {
    let mut registry = Registry::default();
    let landings: Counter = Counter::default();
    registry.register(
        "engy_test_landings",
        "Weight vectors landed",
        landings.clone(),
    );
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let server = serve(
        "127.0.0.1:0".parse().unwrap(),
        Arc::new(registry),
        async move {
            let _ = stopped.await;
        },
    )
    .await
    .unwrap();
    let url = format!("http://{}/metrics", server.local_addr());

    landings.inc_by(3);
    let reply = reqwest::get(&url).await.unwrap();
    assert_eq!(reply.status(), 200);
    assert_eq!(reply.headers()["content-type"], CONTENT_TYPE);
    let text = reply.text().await.unwrap();
    assert!(text.contains("# TYPE engy_test_landings counter"), "{text}");
    assert!(text.contains("engy_test_landings_total 3\n"), "{text}");
    assert!(text.ends_with("# EOF\n"), "{text}");

    landings.inc();
    let text = reqwest::get(&url).await.unwrap().text().await.unwrap();
    assert!(text.contains("engy_test_landings_total 4\n"), "{text}");

    let other = format!("http://{}/", server.local_addr());
    assert_eq!(reqwest::get(&other).await.unwrap().status(), 404);
    let post = reqwest::Client::new().post(&url).send().await.unwrap();
    assert_eq!(post.status(), 405);

    stop.send(()).unwrap();
    server.join().await;
    assert!(
        reqwest::get(&url).await.is_err(),
        "the endpoint still answers after shutdown"
    );
}

#[tokio::test]
async fn an_address_in_use_is_a_bind_error_naming_it() {
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = taken.local_addr().unwrap();
    let e = serve(addr, Arc::new(Registry::default()), std::future::pending())
        .await
        .unwrap_err();
    assert!(matches!(e, MetricsError::Bind { .. }));
    assert!(
        e.to_string()
            .starts_with(&format!("cannot listen on {addr} for metrics: ")),
        "{e}"
    );
}
