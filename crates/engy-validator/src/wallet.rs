//! The validator's hotkey: the wallet file named by the settings, decrypted with the
//! password from the environment when it is NaCl-encrypted (`$NACL`, what `btcli` writes
//! for a hotkey created with a password; decryption in `engy_core::keys::nacl`).
//!
//! The password comes from exactly one of [`PASSWORD_ENV`] (the password itself) or
//! [`PASSWORD_FILE_ENV`] (a file holding it, e.g. a docker secret under `/run/secrets/`;
//! its trailing line end is stripped). An empty variable counts as unset. There is no flag:
//! a password on a command line is visible to every user through `ps`. The password is
//! never logged, lives in a zeroizing buffer and is dropped once the hotkey is loaded.

use std::ffi::OsString;
use std::path::PathBuf;

use engy_core::keys::{LoadedHotkey, WalletError, WalletPassword};

use crate::config::Settings;

/// Environment variable holding the hotkey password.
pub const PASSWORD_ENV: &str = "ENGY_SN53_WALLET_PASSWORD";
/// Environment variable naming a file that holds the hotkey password (a docker secret).
pub const PASSWORD_FILE_ENV: &str = "ENGY_SN53_WALLET_PASSWORD_FILE";

/// Why the hotkey could not be loaded. Each message names the variable to fix; none
/// carries the password.
#[derive(Debug, thiserror::Error)]
pub enum HotkeyError {
    /// Both password variables are set.
    #[error("both {PASSWORD_ENV} and {PASSWORD_FILE_ENV} are set; set only one (the _FILE form for a docker secret)")]
    BothPasswordSources,
    /// The password file cannot be read.
    #[error("{PASSWORD_FILE_ENV}={path}: cannot read the password file ({source}); fix the path, or the file's owner/mode for the validator's user")]
    PasswordFileUnreadable {
        /// The path given.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// The password file is empty (after its line end is stripped).
    #[error("{PASSWORD_FILE_ENV}={path}: the password file is empty")]
    PasswordFileEmpty {
        /// The path given.
        path: PathBuf,
    },
    /// The hotkey is encrypted and neither variable is set.
    #[error("{source}: set {PASSWORD_ENV} or {PASSWORD_FILE_ENV} (a file, e.g. a docker secret) to the hotkey's password")]
    PasswordRequired {
        /// The wallet error ([`WalletError::PasswordRequired`]).
        #[source]
        source: WalletError,
    },
    /// The password does not decrypt the hotkey.
    #[error("{source} (password from {from}); fix the password in {from}")]
    WrongPassword {
        /// The wallet error ([`WalletError::WrongPassword`]).
        #[source]
        source: WalletError,
        /// Which variable supplied it (`ENGY_SN53_WALLET_PASSWORD` or `…_FILE=<path>`).
        from: String,
    },
    /// Any other wallet error (missing file, bad JSON, unsupported encryption, ...).
    #[error(transparent)]
    Wallet(#[from] WalletError),
}

/// A password and the variable it came from (for messages; never the password itself).
#[derive(Debug)]
pub struct PasswordSource {
    /// The password.
    pub password: WalletPassword,
    /// `ENGY_SN53_WALLET_PASSWORD` or `ENGY_SN53_WALLET_PASSWORD_FILE=<path>`.
    pub from: String,
}

fn nonempty(v: Option<OsString>) -> Option<OsString> {
    v.filter(|v| !v.is_empty())
}

/// Read the password source from the process environment (see the module docs).
pub fn password_from_env() -> Result<Option<PasswordSource>, HotkeyError> {
    password_from(std::env::var_os)
}

/// [`password_from_env`] with the environment given as a lookup (for tests).
///
/// Errors: [`HotkeyError::BothPasswordSources`], [`HotkeyError::PasswordFileUnreadable`],
/// [`HotkeyError::PasswordFileEmpty`].
pub fn password_from(
    get: impl Fn(&'static str) -> Option<OsString>,
) -> Result<Option<PasswordSource>, HotkeyError> {
    match (
        nonempty(get(PASSWORD_ENV)),
        nonempty(get(PASSWORD_FILE_ENV)),
    ) {
        (Some(_), Some(_)) => Err(HotkeyError::BothPasswordSources),
        (None, None) => Ok(None),
        (Some(v), None) => Ok(Some(PasswordSource {
            password: WalletPassword::new(v.into_encoded_bytes()),
            from: PASSWORD_ENV.to_owned(),
        })),
        (None, Some(p)) => {
            let path = PathBuf::from(p);
            let mut bytes =
                std::fs::read(&path).map_err(|source| HotkeyError::PasswordFileUnreadable {
                    path: path.clone(),
                    source,
                })?;
            // `echo pw > file` and editors end the line; btcli trims the passwords it is
            // given, so a real one never ends in a line break.
            let keep = bytes
                .iter()
                .rposition(|b| *b != b'\n' && *b != b'\r')
                .map_or(0, |i| i + 1);
            bytes.truncate(keep);
            if bytes.is_empty() {
                return Err(HotkeyError::PasswordFileEmpty { path });
            }
            Ok(Some(PasswordSource {
                password: WalletPassword::new(bytes),
                from: format!("{PASSWORD_FILE_ENV}={}", path.display()),
            }))
        }
    }
}

/// Load the hotkey `<wallet_path>/<wallet>/hotkeys/<wallet_hotkey>` of `s`, decrypting it
/// with the password from the environment when it is NaCl-encrypted (a password given for
/// an unencrypted hotkey is not used). Decryption takes seconds and 512 MiB (Argon2i).
pub fn load_hotkey(s: &Settings) -> Result<LoadedHotkey, HotkeyError> {
    let source = password_from_env()?;
    let loaded = engy_core::keys::load_hotkey_with_password(
        &s.wallet_path,
        &s.wallet,
        &s.wallet_hotkey,
        source.as_ref().map(|p| &p.password),
    );
    match loaded {
        Ok(l) => {
            if let (true, Some(src)) = (l.decrypted, &source) {
                tracing::info!(
                    "hotkey file {} decrypted with the password from {}",
                    l.path.display(),
                    src.from
                );
            }
            Ok(l)
        }
        Err(e @ WalletError::PasswordRequired { .. }) => {
            Err(HotkeyError::PasswordRequired { source: e })
        }
        Err(e @ WalletError::WrongPassword { .. }) => Err(HotkeyError::WrongPassword {
            source: e,
            from: source.map(|p| p.from).unwrap_or_default(),
        }),
        Err(e) => Err(e.into()),
    }
}

/// The fix for a file of the wallet this process may not read (`Permission denied`, above
/// all a mode-600 hotkey read by the image's uid 65532): who owns the file, who this process
/// runs as, and the settings that make them the same (`ENGY_SN53_UID` / `ENGY_SN53_GID` with
/// compose, docs/VALIDATOR.md "Start (Docker)"). `None` for any other error, whose own
/// message says what to fix.
pub fn access_fix(e: &HotkeyError) -> Option<String> {
    use std::os::unix::fs::MetadataExt;
    let path = match e {
        HotkeyError::Wallet(WalletError::Io { path, source })
        | HotkeyError::PasswordFileUnreadable { path, source }
            if source.kind() == std::io::ErrorKind::PermissionDenied =>
        {
            path
        }
        _ => return None,
    };
    // /proc/self belongs to the process's effective uid and gid
    let me = std::fs::metadata("/proc/self")
        .map(|m| format!("uid {} gid {}", m.uid(), m.gid()))
        .unwrap_or_else(|_| "another uid".into());
    Some(match std::fs::metadata(path) {
        Ok(m) => format!(
            "{} is owned by uid {} gid {} (mode {:o}) and this process runs as {me}: run it as the owner (compose: ENGY_SN53_UID={} ENGY_SN53_GID={} in .env.validator, passed with --env-file); do not open the file's mode",
            path.display(),
            m.uid(),
            m.gid(),
            m.mode() & 0o7777,
            m.uid(),
            m.gid()
        ),
        Err(_) => format!(
            "a folder above {} is not searchable by this process ({me}): run it as the wallet's owner (compose: ENGY_SN53_UID / ENGY_SN53_GID in .env.validator, passed with --env-file, `id -u` / `id -g` of the owner)",
            path.display()
        ),
    })
}

/// What an operator must be told about a loaded hotkey besides its address
/// (docs/SECURITY.md "Hotkey files"): `problems` fail `check` and are WARN lines of `run`
/// (which still starts: a restart would fix nothing); `notes` are said by both.
#[derive(Debug, Default)]
pub struct HotkeyNotes {
    /// The file is readable by group or others.
    pub problems: Vec<String>,
    /// A symlink followed; fields of the file that name another key than the one loaded.
    pub notes: Vec<String>,
}

/// The [`HotkeyNotes`] of `l`.
pub fn notes(l: &LoadedHotkey) -> HotkeyNotes {
    let mut out = HotkeyNotes::default();
    let file = l.symlink_target.as_ref().unwrap_or(&l.path);
    if l.insecure_permissions {
        out.problems.push(format!(
            "hotkey file {} is readable by others (group or all users, mode {:o}): they can copy the key; fix: chmod 600 {} and run the validator as its owner (ENGY_SN53_UID/GID with compose)",
            file.display(),
            l.mode.unwrap_or(0),
            file.display()
        ));
    }
    if let Some(target) = &l.symlink_target {
        out.notes.push(format!(
            "hotkey file {} is a symlink to {} (followed, as bittensor-wallet does)",
            l.path.display(),
            target.display()
        ));
    }
    if !l.disagreeing.is_empty() {
        let others = l
            .disagreeing
            .iter()
            .map(|d| match &d.ss58 {
                Some(a) => format!("{} names {a}", d.field),
                None => format!("{} does not decode", d.field),
            })
            .collect::<Vec<_>>()
            .join(", ");
        out.notes.push(format!(
            "hotkey file {}: the key is {} from {}, which bittensor-wallet and btcli use too, but {others}; the file was edited or mixed up: re-create it with btcli (`btcli wallet regen-hotkey`) so every field names the same key",
            l.path.display(),
            l.hotkey.ss58(),
            l.source_field
        ));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env<'a>(vars: &'a [(&'a str, &'a str)]) -> impl Fn(&'static str) -> Option<OsString> + 'a {
        move |k| {
            vars.iter()
                .find(|(n, _)| *n == k)
                .map(|(_, v)| OsString::from(v))
        }
    }

    #[test]
    fn one_source_or_none() {
        assert!(password_from(env(&[])).unwrap().is_none());
        assert!(
            password_from(env(&[(PASSWORD_ENV, ""), (PASSWORD_FILE_ENV, "")]))
                .unwrap()
                .is_none()
        );
        let p = password_from(env(&[(PASSWORD_ENV, "pw\n")]))
            .unwrap()
            .unwrap();
        // The variable is taken as it is; only the file form strips a line end.
        assert_eq!(p.password.as_bytes(), b"pw\n");
        assert_eq!(p.from, PASSWORD_ENV);
        let err = password_from(env(&[(PASSWORD_ENV, "a"), (PASSWORD_FILE_ENV, "/x")]))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains(PASSWORD_ENV) && err.contains(PASSWORD_FILE_ENV),
            "{err}"
        );
    }

    #[test]
    fn the_file_form_strips_the_line_end_and_names_the_path() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("pw");
        let fs = f.to_str().unwrap();
        for (content, want) in [
            (&b"s3cret\n"[..], &b"s3cret"[..]),
            (b"s3cret\r\n", b"s3cret"),
            (b"s3 cret ", b"s3 cret "),
            (b"s3cret", b"s3cret"),
        ] {
            std::fs::write(&f, content).unwrap();
            let p = password_from(env(&[(PASSWORD_FILE_ENV, fs)]))
                .unwrap()
                .unwrap();
            assert_eq!(p.password.as_bytes(), want);
            assert_eq!(p.from, format!("{PASSWORD_FILE_ENV}={fs}"));
        }
        std::fs::write(&f, b"\n").unwrap();
        let err = password_from(env(&[(PASSWORD_FILE_ENV, fs)])).unwrap_err();
        assert!(
            matches!(err, HotkeyError::PasswordFileEmpty { .. }),
            "{err}"
        );
        let missing = dir.path().join("absent");
        let ms = missing.to_str().unwrap();
        let err = password_from(env(&[(PASSWORD_FILE_ENV, ms)]))
            .unwrap_err()
            .to_string();
        assert!(err.contains(PASSWORD_FILE_ENV) && err.contains(ms), "{err}");
    }
}
