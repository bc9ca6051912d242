//! The Prometheus scrape endpoint behind a daemon's `--metrics-addr`.
//!
//! A daemon registers its metrics in a [`Registry`] at start-up, then calls [`serve`] with the
//! operator's address. `GET /metrics` answers the registry in the format the scraper asks for
//! in its `Accept` header ([`Format::negotiate`]):
//!
//! * `Accept: text/plain;version=0.0.4` (what `curl -H`, older scrapers and `promtool check
//!   metrics` read): the Prometheus text format 0.0.4 ([`TEXT_CONTENT_TYPE`]);
//! * anything else, including Prometheus's own header, `*/*` and no header: OpenMetrics text
//!   1.0.0 ([`OPENMETRICS_CONTENT_TYPE`], ending in `# EOF`).
//!
//! Every other path is 404 and every other method 405. The endpoint has no authentication:
//! bind it to 127.0.0.1 or a private interface (docs/SECURITY.md).
//!
//! # Rules a daemon follows (issue 21 items 1–2)
//! * Label values come from small closed sets (an outcome word, an error *kind*), never from
//!   free text such as an error message: a label set per distinct message grows without
//!   bound. Use [`Labels`] / [`labels`] for a family's label set: its values are escaped on
//!   output (`\` `"` and newline, the same in both formats), so even a value that slipped
//!   through can never break the exposition.
//! * Every family is registered with a one-line help text (prometheus-client writes it as
//!   `# HELP`; [`encode_as`] escapes it for the format).
//! * Every label value a family can take is created at start-up (`let _ = family.get_or_create(..);`),
//!   so each series is scraped at 0 before its first event and `increase(...)` sees that
//!   first event.
use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;

use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use prometheus_client::encoding::{EncodeLabelValue, LabelValueEncoder};
use prometheus_client::registry::Registry;

/// The `Content-Type` of an OpenMetrics scrape (text 1.0.0).
pub const OPENMETRICS_CONTENT_TYPE: &str =
    "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// The `Content-Type` of a Prometheus text-format scrape (0.0.4).
pub const TEXT_CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

/// The `Content-Type` of the default scrape (OpenMetrics; kept for callers of earlier
/// versions).
pub const CONTENT_TYPE: &str = OPENMETRICS_CONTENT_TYPE;

/// A label value as scraped. Escaped on output (`\` → `\\`, `"` → `\"`, newline → `\n`,
/// as both the OpenMetrics and the 0.0.4 text format require), whatever it holds.
#[derive(Clone, Debug, Hash, PartialEq, Eq, PartialOrd, Ord)]
pub struct LabelValue(String);

impl LabelValue {
    /// The value as given (unescaped).
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl From<&str> for LabelValue {
    fn from(s: &str) -> Self {
        LabelValue(s.to_owned())
    }
}

impl From<String> for LabelValue {
    fn from(s: String) -> Self {
        LabelValue(s)
    }
}

impl EncodeLabelValue for LabelValue {
    fn encode(&self, encoder: &mut LabelValueEncoder) -> Result<(), std::fmt::Error> {
        use std::fmt::Write;
        encoder.write_str(&escape_label_value(&self.0))
    }
}

/// A family's label set: `(label name, value)` pairs, the names fixed by the daemon, the
/// values escaped on output ([`LabelValue`]). Use it as `Family<Labels, Counter>`.
pub type Labels = Vec<(&'static str, LabelValue)>;

/// `[("kind", "timeout")]` as a [`Labels`].
pub fn labels(pairs: &[(&'static str, &str)]) -> Labels {
    pairs
        .iter()
        .map(|(k, v)| (*k, LabelValue::from(*v)))
        .collect()
}

/// `value` escaped for a label value (`\`, `"`, newline), as both text formats define it.
pub fn escape_label_value(value: &str) -> String {
    let mut out = String::with_capacity(value.len());
    for c in value.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '"' => out.push_str("\\\""),
            '\n' => out.push_str("\\n"),
            c => out.push(c),
        }
    }
    out
}

/// The exposition format of one scrape.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    /// OpenMetrics text 1.0.0 (the default).
    OpenMetrics,
    /// Prometheus text format 0.0.4.
    Text,
}

impl Format {
    /// The format for a request's `Accept` header (`None`: no header).
    ///
    /// Each media range's `q` (default 1) is weighed: `application/openmetrics-text` (any
    /// version) counts for OpenMetrics, `text/plain` (version 0.0.4 or none) and `text/*`
    /// for the text format, `*/*` and `application/*` for OpenMetrics. The text format is
    /// chosen only when it weighs more than OpenMetrics; a header naming neither (or none at
    /// all) gets OpenMetrics rather than a 406, so a plain `curl` always sees the metrics.
    pub fn negotiate(accept: Option<&str>) -> Format {
        let Some(accept) = accept else {
            return Format::OpenMetrics;
        };
        let (mut om, mut text) = (0.0f32, 0.0f32);
        for range in accept.split(',') {
            let mut parts = range.split(';').map(str::trim);
            let media = parts.next().unwrap_or("").to_ascii_lowercase();
            let mut q = 1.0f32;
            let mut version: Option<String> = None;
            for p in parts {
                let Some((k, v)) = p.split_once('=') else {
                    continue;
                };
                match k.trim().to_ascii_lowercase().as_str() {
                    "q" => q = v.trim().parse().unwrap_or(0.0),
                    "version" => version = Some(v.trim().trim_matches('"').to_owned()),
                    _ => {}
                }
            }
            match media.as_str() {
                "application/openmetrics-text" | "*/*" | "application/*" => om = om.max(q),
                "text/plain" if version.as_deref().is_none_or(|v| v == "0.0.4") => {
                    text = text.max(q)
                }
                "text/*" => text = text.max(q),
                _ => {}
            }
        }
        if text > om {
            Format::Text
        } else {
            Format::OpenMetrics
        }
    }

    /// The `Content-Type` of a scrape in this format.
    pub fn content_type(self) -> &'static str {
        match self {
            Format::OpenMetrics => OPENMETRICS_CONTENT_TYPE,
            Format::Text => TEXT_CONTENT_TYPE,
        }
    }
}

/// Why the endpoint could not start.
#[derive(Debug, thiserror::Error)]
pub enum MetricsError {
    /// The address could not be bound (in use, not local, no permission).
    #[error("cannot listen on {addr} for metrics: {source}")]
    Bind {
        /// The address asked for.
        addr: SocketAddr,
        /// The operating system's reason.
        source: std::io::Error,
    },
}

/// A running endpoint. Dropping it leaves the server running until its shutdown future
/// completes; [`MetricsServer::join`] waits for that.
#[derive(Debug)]
pub struct MetricsServer {
    local_addr: SocketAddr,
    task: tokio::task::JoinHandle<()>,
}

impl MetricsServer {
    /// The bound address (the real port when the operator asked for port 0).
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// Waits until the server has stopped (after the shutdown future passed to [`serve`]).
    pub async fn join(self) {
        // A panic in the server task is already reported by tokio; nothing to add here.
        let _ = self.task.await;
    }
}

/// The registry as OpenMetrics text (ending in `# EOF`); [`encode_as`] with
/// [`Format::OpenMetrics`].
///
/// # Errors
/// Only if a metric's encoder fails, which prometheus-client's own types never do.
pub fn encode(registry: &Registry) -> Result<String, std::fmt::Error> {
    encode_as(registry, Format::OpenMetrics)
}

/// The registry as scrape text in `format`.
///
/// prometheus-client writes OpenMetrics; for [`Format::Text`] each family is rewritten to
/// the 0.0.4 conventions: a counter's family is named with its `_total` suffix, an `info`
/// family becomes a gauge named `<name>_info`, `unknown` becomes `untyped`, `# UNIT` and
/// `# EOF` are dropped. Help texts are escaped for the format (`\` and newline, and `"` in
/// OpenMetrics). Samples (and their already escaped label values, [`LabelValue`]) are the
/// same in both formats.
///
/// # Errors
/// As [`encode`].
pub fn encode_as(registry: &Registry, format: Format) -> Result<String, std::fmt::Error> {
    let mut om = String::new();
    prometheus_client::encoding::text::encode(&mut om, registry)?;
    Ok(rewrite(&om, format))
}

/// Rewrites prometheus-client's OpenMetrics output for `format` (see [`encode_as`]).
fn rewrite(om: &str, format: Format) -> String {
    let mut out = String::with_capacity(om.len() + 256);
    // (name, help) of a `# HELP` line waiting for its `# TYPE` line
    let mut help: Option<(&str, &str)> = None;
    let flush_help = |out: &mut String, name: &str, text: &str| {
        out.push_str("# HELP ");
        out.push_str(name);
        out.push(' ');
        out.push_str(&escape_help(text, format));
        out.push('\n');
    };
    for line in om.lines() {
        if let Some(rest) = line.strip_prefix("# HELP ") {
            if let Some((name, text)) = help.take() {
                flush_help(&mut out, name, text);
            }
            let (name, text) = rest.split_once(' ').unwrap_or((rest, ""));
            help = Some((name, text));
            continue;
        }
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            let (name, kind) = rest.split_once(' ').unwrap_or((rest, "unknown"));
            let (name, kind) = match (format, kind) {
                (Format::OpenMetrics, _) => (name.to_owned(), kind),
                (Format::Text, "counter") => (format!("{name}_total"), "counter"),
                (Format::Text, "info") => (format!("{name}_info"), "gauge"),
                (Format::Text, "unknown") => (name.to_owned(), "untyped"),
                (Format::Text, k) => (name.to_owned(), k),
            };
            if let Some((_, text)) = help.take() {
                flush_help(&mut out, &name, text);
            }
            out.push_str("# TYPE ");
            out.push_str(&name);
            out.push(' ');
            out.push_str(kind);
            out.push('\n');
            continue;
        }
        if let Some((name, text)) = help.take() {
            flush_help(&mut out, name, text);
        }
        if format == Format::Text && (line.starts_with("# UNIT ") || line == "# EOF") {
            continue;
        }
        out.push_str(line);
        out.push('\n');
    }
    if let Some((name, text)) = help.take() {
        flush_help(&mut out, name, text);
    }
    out
}

/// A help text escaped for `format`: `\` and newline in both, `"` too in OpenMetrics.
fn escape_help(text: &str, format: Format) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '"' if format == Format::OpenMetrics => out.push_str("\\\""),
            c => out.push(c),
        }
    }
    out
}

/// Binds `addr` and serves `registry` at `GET /metrics` until `shutdown` completes.
///
/// Binding happens before this returns, so a bad `--metrics-addr` is a start-up error.
///
/// # Errors
/// [`MetricsError::Bind`] when the address cannot be bound.
pub async fn serve(
    addr: SocketAddr,
    registry: Arc<Registry>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<MetricsServer, MetricsError> {
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|source| MetricsError::Bind { addr, source })?;
    let local_addr = listener
        .local_addr()
        .map_err(|source| MetricsError::Bind { addr, source })?;
    let app = axum::Router::new().route(
        "/metrics",
        get(move |headers: HeaderMap| {
            let registry = Arc::clone(&registry);
            async move {
                let accept = headers.get(header::ACCEPT).and_then(|v| v.to_str().ok());
                scrape(&registry, Format::negotiate(accept))
            }
        }),
    );
    let task = tokio::spawn(async move {
        if let Err(e) = axum::serve(listener, app)
            .with_graceful_shutdown(shutdown)
            .await
        {
            tracing::error!("metrics endpoint on {local_addr} stopped: {e}; scrapes now fail");
        }
    });
    Ok(MetricsServer { local_addr, task })
}

fn scrape(registry: &Registry, format: Format) -> Response {
    match encode_as(registry, format) {
        Ok(text) => ([(header::CONTENT_TYPE, format.content_type())], text).into_response(),
        Err(_) => (
            StatusCode::INTERNAL_SERVER_ERROR,
            "metrics could not be encoded\n",
        )
            .into_response(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use prometheus_client::metrics::counter::Counter;
    use prometheus_client::metrics::family::Family;
    use prometheus_client::metrics::gauge::Gauge;
    use prometheus_client::metrics::info::Info;

    #[test]
    fn negotiation() {
        use Format::*;
        for (accept, want) in [
            (None, OpenMetrics),
            (Some("*/*"), OpenMetrics),
            (Some("text/plain;version=0.0.4"), Text),
            (Some("text/plain; version=0.0.4; charset=utf-8"), Text),
            (Some("text/plain"), Text),
            (Some("application/openmetrics-text; version=1.0.0"), OpenMetrics),
            // Prometheus 2.42's scrape header
            (Some("application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1"), OpenMetrics),
            // Prometheus with OpenMetrics off
            (Some("text/plain;version=0.0.4;q=1,*/*;q=0.1"), Text),
            (Some("application/openmetrics-text;q=0.2,text/plain;version=0.0.4;q=0.9"), Text),
            (Some("application/json"), OpenMetrics),
            (Some("text/plain;q=0"), OpenMetrics),
        ] {
            assert_eq!(Format::negotiate(accept), want, "{accept:?}");
        }
    }

    fn sample_registry() -> Registry {
        let mut r = Registry::with_prefix("t");
        let fam = Family::<Labels, Counter>::default();
        fam.get_or_create(&labels(&[("kind", "pool-rejected")]))
            .inc();
        fam.get_or_create(&labels(&[("kind", "a \"q\" {b} \\ \nx")]))
            .inc();
        r.register("errors", "Errors by \"kind\" \\ all", fam);
        let g = Gauge::<i64>::default();
        g.set(7);
        r.register("spec_version", "Runtime spec", g);
        r.register(
            "build",
            "Build",
            Info::new(vec![("version".to_owned(), "0.1.0".to_owned())]),
        );
        r
    }

    #[test]
    fn label_values_and_help_are_escaped() {
        let om = encode(&sample_registry()).unwrap();
        assert!(
            om.contains("t_errors_total{kind=\"a \\\"q\\\" {b} \\\\ \\nx\"} 1\n"),
            "{om}"
        );
        assert!(
            om.contains("# HELP t_errors Errors by \\\"kind\\\" \\\\ all.\n"),
            "{om}"
        );
        assert!(om.ends_with("# EOF\n"), "{om}");
    }

    #[test]
    fn text_format_names_counters_with_total_and_drops_eof() {
        let text = encode_as(&sample_registry(), Format::Text).unwrap();
        for want in [
            "# HELP t_errors_total Errors by \"kind\" \\\\ all.\n# TYPE t_errors_total counter\n",
            "t_errors_total{kind=\"pool-rejected\"} 1\n",
            "# HELP t_spec_version Runtime spec.\n# TYPE t_spec_version gauge\nt_spec_version 7\n",
            "# TYPE t_build_info gauge\nt_build_info{version=\"0.1.0\"} 1\n",
        ] {
            assert!(text.contains(want), "{want:?} not in:\n{text}");
        }
        assert!(!text.contains("# EOF"), "{text}");
    }
}
