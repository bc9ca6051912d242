//! Clap usage errors that name the variable the operator set ([`usage_error`]), shared by
//! both daemons (printed through [`crate::log::fatal`], one JSON line in JSON mode) and
//! engy-audit; and the one-line text of an error that ends a command ([`error_line`]).

/// Rewrites a clap usage error so that it names the environment variable the operator set
/// instead of (or beside) the flag, since most operators configure a daemon through its
/// variables (`ENGY_SN53_*`, `MAX_INFLIGHT`, compose `.env` files) and never typed the flag
/// clap names.
///
/// * a value that does not parse and came from a variable (its flag is not on the command
///   line): `'--poll-s <POLL_S>'` becomes `ENGY_SN53_POLL_S`;
/// * a missing required setting: each `--wallet <WALLET>` line gains `(or ENGY_SN53_WALLET)`;
/// * invalid UTF-8 (clap names nothing): the variables (or arguments) that are not UTF-8.
///
/// `cmd` is the whole command, `args` the process arguments (the first is the program) and
/// `var` looks a variable up (`std::env::var_os`). `None` when clap's own message is right
/// as it is (help, version, unknown flags, ...).
pub fn usage_error(
    e: &clap::Error,
    cmd: &clap::Command,
    args: &[std::ffi::OsString],
    var: &dyn Fn(&str) -> Option<std::ffi::OsString>,
) -> Option<String> {
    use clap::error::{ContextKind, ContextValue, ErrorKind};
    // the subcommand in use: the first argument that names one
    let sub = args
        .iter()
        .skip(1)
        .filter_map(|a| a.to_str())
        .find_map(|a| cmd.find_subcommand(a));
    let arg_list: Vec<&clap::Arg> = sub
        .map(|s| s.get_arguments().collect())
        .unwrap_or_else(|| cmd.get_arguments().collect());
    let on_command_line = |long: &str| {
        let flag = format!("--{long}");
        args.iter().skip(1).any(|a| {
            a.to_str()
                .is_some_and(|a| a == flag || a.starts_with(&format!("{flag}=")))
        })
    };
    // (flag display as clap prints it, e.g. `--poll-s <POLL_S>`, its variable)
    let env_of = |display: &str| -> Option<(String, &clap::Arg)> {
        let long = display.strip_prefix("--")?.split([' ', '=']).next()?;
        let arg = arg_list.iter().find(|a| a.get_long() == Some(long))?;
        let env = arg.get_env()?.to_str()?.to_owned();
        Some((env, *arg))
    };
    let text = e.render().to_string();
    match e.kind() {
        ErrorKind::InvalidValue | ErrorKind::ValueValidation => {
            let Some(ContextValue::String(display)) = e.get(ContextKind::InvalidArg) else {
                return None;
            };
            let (env, arg) = env_of(display)?;
            if on_command_line(arg.get_long()?) || var(&env).is_none() {
                return None;
            }
            Some(text.replace(&format!("'{display}'"), &env))
        }
        ErrorKind::MissingRequiredArgument => {
            let Some(ContextValue::Strings(missing)) = e.get(ContextKind::InvalidArg) else {
                return None;
            };
            let mut out = text;
            for display in missing {
                if let Some((env, _)) = env_of(display) {
                    out = out.replace(
                        &format!("  {display}\n"),
                        &format!("  {display} (or {env})\n"),
                    );
                }
            }
            Some(out)
        }
        ErrorKind::InvalidUtf8 => {
            let mut bad: Vec<String> = arg_list
                .iter()
                .filter(|a| a.get_long().is_some_and(|l| !on_command_line(l)))
                .filter_map(|a| a.get_env()?.to_str())
                .filter_map(|env| {
                    let v = var(env)?;
                    v.to_str()
                        .is_none()
                        .then(|| format!("{env} (read as {:?})", v.to_string_lossy()))
                })
                .collect();
            bad.extend(
                args.iter()
                    .skip(1)
                    .filter(|a| a.to_str().is_none())
                    .map(|a| format!("the command-line argument {:?}", a.to_string_lossy())),
            );
            if bad.is_empty() {
                return None;
            }
            Some(format!(
                "error: not valid UTF-8: {}; set it to a UTF-8 value\n",
                bad.join(", ")
            ))
        }
        _ => None,
    }
}

/// An error and its causes on one line, `: `-separated as anyhow's `{:#}` writes them, less
/// any cause whose text the line already holds (a library error that prints its source in
/// its own message, e.g. engy-model's `{path}: {source}`, is not repeated). Takes what an
/// `anyhow::Error` gives with `.as_ref()`.
pub fn error_line(e: &(dyn std::error::Error + 'static)) -> String {
    let mut out = String::new();
    let mut cause = Some(e);
    while let Some(c) = cause {
        let text = c.to_string();
        if !out.contains(&text) {
            if !out.is_empty() {
                out.push_str(": ");
            }
            out.push_str(&text);
        }
        cause = c.source();
    }
    out
}

#[cfg(test)]
mod tests {
    use super::error_line;

    /// An error that prints its source in its own message, as `{path}: {source}` does.
    #[derive(Debug)]
    struct Inline(std::io::Error);
    impl std::fmt::Display for Inline {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            write!(f, "/x/config.json: {}", self.0)
        }
    }
    impl std::error::Error for Inline {
        fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
            Some(&self.0)
        }
    }

    #[test]
    fn a_cause_already_in_the_line_is_not_repeated() {
        let io = std::io::Error::new(std::io::ErrorKind::NotFound, "no such file");
        let e = Wrapped("opening checkpoint /x", Inline(io));
        assert_eq!(
            error_line(&e),
            "opening checkpoint /x: /x/config.json: no such file"
        );
    }

    /// A context line over an error, as anyhow's `.context()` chains them.
    #[derive(Debug)]
    struct Wrapped(&'static str, Inline);
    impl std::fmt::Display for Wrapped {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str(self.0)
        }
    }
    impl std::error::Error for Wrapped {
        fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
            Some(&self.1)
        }
    }
}
