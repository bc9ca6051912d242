//! The /metrics endpoint on 127.0.0.1: what a Prometheus scrape sees.
use std::sync::Arc;

use engy_telemetry::metrics::{serve, MetricsError, CONTENT_TYPE};
use engy_telemetry::prometheus_client::metrics::counter::Counter;
use engy_telemetry::prometheus_client::registry::Registry;

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
