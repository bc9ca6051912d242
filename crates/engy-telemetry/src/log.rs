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

/// The log format the operator asked for, read straight from the process arguments and the
/// environment, for errors printed before (or instead of) a successful command-line parse,
/// such as a usage error: `flag` (e.g. `--log-format`, as `--log-format json` or
/// `--log-format=json`) wins over `var` (e.g. `ENGY_SN53_LOG_FORMAT`). Anything that is not
/// `json` reads as [`LogFormat::Text`]. `args` are the process arguments (the first is the
/// program); `var_value` is the variable's value (`std::env::var_os(var)`).
pub fn requested_format(args: &[OsString], flag: &str, var_value: Option<OsString>) -> LogFormat {
    let mut from_flag: Option<String> = None;
    let mut it = args.iter().skip(1).filter_map(|a| a.to_str());
    while let Some(a) = it.next() {
        if a == "--" {
            break;
        }
        if a == flag {
            from_flag = it.next().map(str::to_owned);
        } else if let Some(v) = a.strip_prefix(flag).and_then(|r| r.strip_prefix('=')) {
            from_flag = Some(v.to_owned());
        }
    }
    let chosen = from_flag.or_else(|| var_value.and_then(|v| v.into_string().ok()));
    match chosen.as_deref().map(str::trim) {
        Some(v) if v.eq_ignore_ascii_case("json") => LogFormat::Json,
        _ => LogFormat::Text,
    }
}

/// The line [`fatal`] prints (without its newline): in text `"<program>: <message>"`, in
/// JSON one object like the logger's lines, `{"timestamp", "level": "ERROR", "target":
/// <program>, "message", "exit_code"}`, so a log shipper parses it like any other line
/// (a multi-line message, such as a usage error, stays one JSON line).
pub fn fatal_line(format: LogFormat, program: &str, message: &str, exit_code: u8) -> String {
    let message = message.trim_end();
    match format {
        LogFormat::Text => format!("{program}: {message}"),
        LogFormat::Json => {
            use tracing_subscriber::fmt::time::FormatTime;
            let mut timestamp = String::new();
            // SystemTime writes RFC 3339 like the JSON layer; it cannot fail on a String
            let _ = tracing_subscriber::fmt::time::SystemTime.format_time(
                &mut tracing_subscriber::fmt::format::Writer::new(&mut timestamp),
            );
            serde_json::json!({
                "timestamp": timestamp,
                "level": "ERROR",
                "target": program,
                "message": message,
                "exit_code": exit_code,
            })
            .to_string()
        }
    }
}

/// Prints a fatal error to standard error in the operator's format ([`fatal_line`]): for
/// errors that end the process before or outside the logger (bad settings, a wallet that
/// cannot be read, a usage error). The caller then exits with `exit_code`.
pub fn fatal(format: LogFormat, program: &str, message: &str, exit_code: u8) {
    eprintln!("{}", fatal_line(format, program, message, exit_code));
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
    fn requested_format_reads_the_flag_then_the_variable() {
        let args = |v: &[&str]| v.iter().map(OsString::from).collect::<Vec<_>>();
        let f = "--log-format";
        let json = Some(OsString::from("json"));
        assert_eq!(
            requested_format(&args(&["p", "run"]), f, None),
            LogFormat::Text
        );
        assert_eq!(
            requested_format(&args(&["p", "run"]), f, json.clone()),
            LogFormat::Json
        );
        assert_eq!(
            requested_format(&args(&["p", "run", "--log-format", "json"]), f, None),
            LogFormat::Json
        );
        assert_eq!(
            requested_format(&args(&["p", "run", "--log-format=json"]), f, None),
            LogFormat::Json
        );
        assert_eq!(
            requested_format(&args(&["p", "run", "--log-format=text"]), f, json),
            LogFormat::Text
        );
    }

    #[test]
    fn fatal_lines_are_one_json_object_in_json_mode() {
        let msg = "error: invalid value \"x\" for\n  --poll-s\n";
        let line = fatal_line(LogFormat::Json, "engy-validator", msg, 2);
        assert!(!line.contains('\n'));
        let v: serde_json::Value = serde_json::from_str(&line).unwrap();
        assert_eq!(v["level"], "ERROR");
        assert_eq!(v["target"], "engy-validator");
        assert_eq!(v["message"], msg.trim_end());
        assert_eq!(v["exit_code"], 2);
        assert!(
            v["timestamp"].as_str().is_some_and(|t| t.ends_with('Z')),
            "{v}"
        );
        assert_eq!(
            fatal_line(LogFormat::Text, "engy-validator", "bad\n", 1),
            "engy-validator: bad"
        );
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
