//! The process logger: format, filter variable, destination.
//!
//! Rules (docs/VALIDATOR.md "Logs", docs/MINER.md "Logs"):
//! * the filter comes from one environment variable the daemon names (`ENGY_LOG`, `RUST_LOG`);
//!   unset or empty means the daemon's default (`info`);
//! * a value that is not a `tracing` filter (for example `ENGY_LOG=garbage===`) or is not
//!   UTF-8 is a [`LogError`] naming the variable: the daemon refuses to start (exit 2) rather
//!   than run with a filter the operator did not ask for;
//! * `text` is tracing-subscriber's compact human format, coloured only on a terminal;
//!   `json` is one object per line with `timestamp`, `level`, `target`, `message` and the
//!   event's fields at the top level (tracing-subscriber's JSON layer, flattened).
use std::ffi::OsString;

use tracing_subscriber::fmt::writer::BoxMakeWriter;
use tracing_subscriber::EnvFilter;

/// How log lines are written (`--log-format`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormat {
    /// Human-readable lines (the default).
    #[default]
    Text,
    /// One JSON object per line, for log shippers (Loki, Vector, Datadog, journald's JSON).
    Json,
}

/// Where log lines go.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LogTarget {
    /// Standard output (the validator: its stdout is the container log).
    Stdout,
    /// Standard error (the miner: its stdout is reserved for command output such as `check`).
    Stderr,
}

/// What [`init`] needs from a daemon.
#[derive(Clone, Copy, Debug)]
pub struct LogConfig<'a> {
    /// The environment variable holding the filter, e.g. `"ENGY_LOG"`.
    pub filter_var: &'a str,
    /// The filter when that variable is unset or empty, e.g. `"info"`.
    pub default_filter: &'a str,
    /// Text or JSON.
    pub format: LogFormat,
    /// Standard output or standard error.
    pub target: LogTarget,
}

/// Why the logger could not be installed. Each message names the variable the operator set.
#[derive(Debug, thiserror::Error)]
pub enum LogError {
    /// The variable's value is not a `tracing` filter.
    #[error(
        "{var}={value:?} is not a log filter ({reason}); write a level or directives, \
         for example {var}=info or {var}=warn,engy=debug"
    )]
    BadFilter {
        /// The variable, e.g. `ENGY_LOG`.
        var: String,
        /// The value as set.
        value: String,
        /// tracing-subscriber's parse error.
        reason: String,
    },
    /// The variable's value is not UTF-8.
    #[error("{var} is not valid UTF-8; write a level or directives, for example {var}=info")]
    NotUnicode {
        /// The variable, e.g. `ENGY_LOG`.
        var: String,
    },
    /// The daemon's default filter does not parse (a bug in the daemon, not the operator's).
    #[error("the built-in log filter {0:?} does not parse")]
    BadDefault(String),
    /// A global logger was already installed in this process.
    #[error("a logger is already installed in this process")]
    AlreadyInstalled,
}

/// The filter from `value` (the variable's raw value, `None` when unset), strictly parsed.
///
/// # Errors
/// [`LogError::BadFilter`] or [`LogError::NotUnicode`], naming `var`.
pub fn parse_filter(
    var: &str,
    value: Option<OsString>,
    default_filter: &str,
) -> Result<EnvFilter, LogError> {
    let value = match value {
        None => None,
        Some(v) => Some(v.into_string().map_err(|_| LogError::NotUnicode {
            var: var.to_owned(),
        })?),
    };
    match value.as_deref().map(str::trim) {
        None | Some("") => EnvFilter::builder()
            .parse(default_filter)
            .map_err(|_| LogError::BadDefault(default_filter.to_owned())),
        Some(v) => EnvFilter::builder()
            .parse(v)
            .map_err(|e| LogError::BadFilter {
                var: var.to_owned(),
                value: v.to_owned(),
                reason: e.to_string(),
            }),
    }
}

/// Reads the filter from the process environment ([`parse_filter`] of `cfg.filter_var`).
///
/// # Errors
/// As [`parse_filter`].
pub fn filter_from_env(cfg: &LogConfig<'_>) -> Result<EnvFilter, LogError> {
    parse_filter(
        cfg.filter_var,
        std::env::var_os(cfg.filter_var),
        cfg.default_filter,
    )
}

/// Installs the process-wide logger described by `cfg`.
///
/// # Errors
/// The filter errors of [`filter_from_env`], or [`LogError::AlreadyInstalled`].
pub fn init(cfg: &LogConfig<'_>) -> Result<(), LogError> {
    let filter = filter_from_env(cfg)?;
    let (writer, is_terminal) = match cfg.target {
        LogTarget::Stdout => (
            BoxMakeWriter::new(std::io::stdout),
            std::io::IsTerminal::is_terminal(&std::io::stdout()),
        ),
        LogTarget::Stderr => (
            BoxMakeWriter::new(std::io::stderr),
            std::io::IsTerminal::is_terminal(&std::io::stderr()),
        ),
    };
    tracing::subscriber::set_global_default(subscriber(cfg.format, filter, writer, is_terminal))
        .map_err(|_| LogError::AlreadyInstalled)
}

/// The subscriber [`init`] installs, writing to `writer` (tests capture it in memory).
pub fn subscriber(
    format: LogFormat,
    filter: EnvFilter,
    writer: BoxMakeWriter,
    ansi: bool,
) -> Box<dyn tracing::Subscriber + Send + Sync> {
    match format {
        LogFormat::Text => Box::new(
            tracing_subscriber::fmt()
                .with_env_filter(filter)
                .with_target(false)
                .with_ansi(ansi)
                .with_writer(writer)
                .finish(),
        ),
        LogFormat::Json => Box::new(
            tracing_subscriber::fmt()
                .json()
                .flatten_event(true)
                .with_current_span(false)
                .with_span_list(false)
                .with_target(true)
                .with_env_filter(filter)
                .with_writer(writer)
                .finish(),
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;
    use std::sync::{Arc, Mutex};

    #[derive(Clone, Default)]
    struct Captured(Arc<Mutex<Vec<u8>>>);

    impl Write for Captured {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0
                .lock()
                .map_err(|_| std::io::Error::other("poisoned"))?
                .extend_from_slice(buf);
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    fn captured_lines(format: LogFormat, filter: &str, emit: impl FnOnce()) -> Vec<String> {
        let sink = Captured::default();
        let writer = {
            let sink = sink.clone();
            BoxMakeWriter::new(move || sink.clone())
        };
        let filter = parse_filter("ENGY_LOG", Some(filter.into()), "info").unwrap();
        tracing::subscriber::with_default(subscriber(format, filter, writer, false), emit);
        let bytes = sink.0.lock().unwrap().clone();
        String::from_utf8(bytes)
            .unwrap()
            .lines()
            .map(str::to_owned)
            .collect()
    }

    #[test]
    fn a_filter_that_does_not_parse_names_its_variable() {
        for bad in ["garbage===", "info,[", "=debug", "engy=loud"] {
            let e = parse_filter("ENGY_LOG", Some(bad.into()), "info").unwrap_err();
            let msg = e.to_string();
            assert!(matches!(e, LogError::BadFilter { .. }), "{bad}: {msg}");
            assert!(msg.starts_with("ENGY_LOG="), "{msg}");
            assert!(msg.contains("ENGY_LOG=info"), "{msg}");
        }
    }

    #[cfg(unix)]
    #[test]
    fn a_non_utf8_filter_names_its_variable() {
        use std::os::unix::ffi::OsStringExt;
        let e = parse_filter(
            "RUST_LOG",
            Some(OsString::from_vec(vec![0x69, 0xff])),
            "info",
        )
        .unwrap_err();
        assert!(matches!(e, LogError::NotUnicode { .. }));
        assert!(e.to_string().starts_with("RUST_LOG is not valid UTF-8"));
    }

    #[test]
    fn unset_or_empty_means_the_default_and_levels_filter() {
        assert!(parse_filter("ENGY_LOG", None, "info").is_ok());
        assert!(parse_filter("ENGY_LOG", Some(" ".into()), "info").is_ok());
        let lines = captured_lines(LogFormat::Text, "warn", || {
            tracing::info!("hidden");
            tracing::warn!("shown");
        });
        assert_eq!(lines.len(), 1, "{lines:?}");
        assert!(lines[0].contains("shown"));
    }

    #[test]
    fn json_lines_carry_level_message_and_fields_at_the_top() {
        let lines = captured_lines(LogFormat::Json, "info", || {
            tracing::info!(epoch = 42u64, hotkey = "5F…", "weights landed");
            tracing::debug!("filtered out");
        });
        assert_eq!(lines.len(), 1, "{lines:?}");
        let v: serde_json::Value = serde_json::from_str(&lines[0]).unwrap();
        assert_eq!(v["level"], "INFO");
        assert_eq!(v["message"], "weights landed");
        assert_eq!(v["epoch"], 42);
        assert_eq!(v["hotkey"], "5F…");
        assert!(v["timestamp"].is_string());
        assert!(v["target"].is_string());
    }

    #[test]
    fn text_lines_are_not_json() {
        let lines = captured_lines(LogFormat::Text, "info", || tracing::info!(n = 1, "hello"));
        assert_eq!(lines.len(), 1);
        assert!(serde_json::from_str::<serde_json::Value>(&lines[0]).is_err());
        assert!(
            lines[0].contains("hello") && lines[0].contains("n=1"),
            "{}",
            lines[0]
        );
    }
}
