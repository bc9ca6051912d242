//! Chat template + tokenizer: OpenAI `messages` → `prompt_ids` exactly as Hugging Face
//! `transformers` `apply_chat_template(messages, tokenize=True, add_generation_prompt=True)`
//! computes them (docs/PROTOCOL.md §3.1).
//!
//! What transformers does, and this module mirrors:
//! * the template is `chat_template.jinja` in the checkpoint when present, else
//!   `tokenizer_config.json` `chat_template` (a string, or a list of `{name, template}`
//!   where `default` is used);
//! * jinja2 sandbox with `trim_blocks=True`, `lstrip_blocks=True`, loop controls, and the
//!   globals `raise_exception(msg)` and `strftime_now(fmt)`, the filter `tojson`
//!   (`json.dumps(ensure_ascii=False)` with Python's `", "`/`": "` separators, optional
//!   `indent`); Python string methods (`.strip()`, `.startswith()`, …) come from
//!   minijinja-contrib's pycompat layer;
//! * render variables: `messages`, `add_generation_prompt=True`, `tools=None`, and every
//!   special token of the tokenizer config (`bos_token`, `eos_token`, `unk_token`,
//!   `pad_token`, `additional_special_tokens`) as strings;
//! * the rendered text is tokenized WITHOUT adding special tokens (`add_special_tokens=False`).
//!
//! Only `role` and `content` of each message are passed (docs/PROTOCOL.md §3.1).
use std::path::{Path, PathBuf};

use minijinja::value::{Value as JValue, ValueKind};
use minijinja::{Environment, Error as JError, ErrorKind};
use serde_json::Value;
use tokenizers::Tokenizer;

/// Loading or applying the checkpoint's template/tokenizer failed.
#[derive(Debug, thiserror::Error)]
pub enum ChatError {
    /// A file is missing or unreadable.
    #[error("{path}: {msg}")]
    File {
        /// The file.
        path: PathBuf,
        /// What went wrong.
        msg: String,
    },
    /// The checkpoint has no chat template.
    #[error("no chat template in {0} (neither chat_template.jinja nor tokenizer_config.json chat_template)")]
    NoTemplate(PathBuf),
    /// The template does not compile.
    #[error("chat template does not compile: {0}")]
    Compile(String),
    /// The request's messages are unusable.
    #[error("bad messages: {0}")]
    Messages(String),
    /// The template raised or failed while rendering.
    #[error("chat template failed: {0}")]
    Render(String),
    /// The tokenizer failed.
    #[error("tokenizer: {0}")]
    Tokenize(String),
}

/// The checkpoint's chat template and tokenizer.
pub struct Prompter {
    env: Environment<'static>,
    tokenizer: Tokenizer,
    specials: Vec<(String, JValue)>,
}

impl std::fmt::Debug for Prompter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Prompter").finish_non_exhaustive()
    }
}

fn read(path: &Path) -> Result<String, ChatError> {
    std::fs::read_to_string(path).map_err(|e| ChatError::File {
        path: path.to_path_buf(),
        msg: e.to_string(),
    })
}

/// A special token entry of tokenizer_config.json: a string or `{"content": …}`.
fn token_str(v: &Value) -> Option<String> {
    match v {
        Value::String(s) => Some(s.clone()),
        Value::Object(o) => o.get("content").and_then(Value::as_str).map(str::to_string),
        _ => None,
    }
}

impl Prompter {
    /// Load `tokenizer.json`, `tokenizer_config.json` and the template from `checkpoint`.
    ///
    /// # Errors
    /// [`ChatError`] naming the missing or broken file.
    pub fn load(checkpoint: &Path) -> Result<Self, ChatError> {
        let tok_path = checkpoint.join("tokenizer.json");
        let tokenizer = Tokenizer::from_file(&tok_path).map_err(|e| ChatError::File {
            path: tok_path.clone(),
            msg: e.to_string(),
        })?;
        let cfg_path = checkpoint.join("tokenizer_config.json");
        let cfg: Value = if cfg_path.exists() {
            serde_json::from_str(&read(&cfg_path)?).map_err(|e| ChatError::File {
                path: cfg_path.clone(),
                msg: e.to_string(),
            })?
        } else {
            Value::Null
        };
        let jinja_path = checkpoint.join("chat_template.jinja");
        let source = if jinja_path.exists() {
            read(&jinja_path)?
        } else {
            match cfg.get("chat_template") {
                Some(Value::String(s)) => s.clone(),
                Some(Value::Array(list)) => list
                    .iter()
                    .find(|t| t.get("name").and_then(Value::as_str) == Some("default"))
                    .and_then(|t| t.get("template"))
                    .and_then(Value::as_str)
                    .map(str::to_string)
                    .ok_or_else(|| ChatError::NoTemplate(checkpoint.to_path_buf()))?,
                _ => return Err(ChatError::NoTemplate(checkpoint.to_path_buf())),
            }
        };
        let mut specials = Vec::new();
        for k in [
            "bos_token",
            "eos_token",
            "unk_token",
            "pad_token",
            "sep_token",
            "cls_token",
            "mask_token",
        ] {
            if let Some(s) = cfg.get(k).and_then(token_str) {
                specials.push((k.to_string(), JValue::from(s)));
            }
        }
        if let Some(Value::Array(a)) = cfg.get("additional_special_tokens") {
            let list: Vec<JValue> = a.iter().filter_map(token_str).map(JValue::from).collect();
            specials.push(("additional_special_tokens".into(), JValue::from(list)));
        }
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_keep_trailing_newline(false);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", |msg: String| -> Result<JValue, JError> {
            Err(JError::new(ErrorKind::InvalidOperation, msg))
        });
        env.add_function("strftime_now", |fmt: String| -> Result<JValue, JError> {
            Ok(JValue::from(strftime_now(&fmt)))
        });
        env.add_filter("tojson", tojson);
        env.add_template_owned("chat", source)
            .map_err(|e| ChatError::Compile(format!("{e:#}")))?;
        Ok(Self {
            env,
            tokenizer,
            specials,
        })
    }

    /// Render the prompt text for OpenAI `messages` (`[{role, content}, …]`).
    ///
    /// # Errors
    /// [`ChatError::Messages`] when `messages` is not a non-empty list of objects with a
    /// string `role`; [`ChatError::Render`] when the template raises.
    pub fn render(&self, messages: &Value) -> Result<String, ChatError> {
        let list = messages
            .as_array()
            .ok_or_else(|| ChatError::Messages("messages must be a list".into()))?;
        // Production's apply_chat_template fails on an empty conversation (docs/PROTOCOL.md
        // §3.1): nothing is generated for it here either.
        if list.is_empty() {
            return Err(ChatError::Messages(
                "messages is empty: a chat request needs at least one message".into(),
            ));
        }
        let mut msgs = Vec::with_capacity(list.len());
        for (i, m) in list.iter().enumerate() {
            let role = m
                .get("role")
                .and_then(Value::as_str)
                .ok_or_else(|| ChatError::Messages(format!("messages[{i}] has no string role")))?;
            let content = m.get("content").cloned().unwrap_or(Value::Null);
            let content = if content.is_null() {
                JValue::from(())
            } else {
                JValue::from_serialize(&content)
            };
            msgs.push(JValue::from_iter([
                ("role", JValue::from(role)),
                ("content", content),
            ]));
        }
        let tmpl = self
            .env
            .get_template("chat")
            .map_err(|e| ChatError::Render(e.to_string()))?;
        let mut ctx: Vec<(String, JValue)> = self.specials.clone();
        ctx.push(("messages".into(), JValue::from(msgs)));
        ctx.push(("add_generation_prompt".into(), JValue::from(true)));
        ctx.push(("tools".into(), JValue::from(())));
        ctx.push(("documents".into(), JValue::from(())));
        let ctx = JValue::from_iter(ctx);
        tmpl.render(ctx)
            .map_err(|e| ChatError::Render(format!("{e:#}")))
    }

    /// `prompt_ids` for `messages`: render, then tokenize without special tokens.
    ///
    /// # Errors
    /// As [`Prompter::render`], plus [`ChatError::Tokenize`].
    pub fn prompt_ids(&self, messages: &Value) -> Result<Vec<u32>, ChatError> {
        let text = self.render(messages)?;
        self.encode(&text)
    }

    /// Render and tokenize the probe conversation the miner checks at start-up (a system
    /// and a user message); returns its token count.
    ///
    /// # Errors
    /// As [`Prompter::prompt_ids`]; [`ChatError::Render`] when it renders to nothing.
    pub fn probe(&self) -> Result<usize, ChatError> {
        let msgs = serde_json::json!([
            {"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "Hello!"}
        ]);
        let ids = self.prompt_ids(&msgs)?;
        if ids.is_empty() {
            return Err(ChatError::Render("it renders to an empty prompt".into()));
        }
        Ok(ids.len())
    }

    /// Tokenize text without adding special tokens.
    ///
    /// # Errors
    /// [`ChatError::Tokenize`].
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, ChatError> {
        let enc = self
            .tokenizer
            .encode(text, false)
            .map_err(|e| ChatError::Tokenize(e.to_string()))?;
        Ok(enc.get_ids().to_vec())
    }

    /// Decode ids with special tokens skipped (docs/PROTOCOL.md §3.9).
    ///
    /// # Errors
    /// [`ChatError::Tokenize`] for an id outside the vocabulary.
    pub fn decode(&self, ids: &[u32]) -> Result<String, ChatError> {
        self.tokenizer
            .decode(ids, true)
            .map_err(|e| ChatError::Tokenize(e.to_string()))
    }
}

/// HF's `tojson`: `json.dumps(value, ensure_ascii=False, indent=indent)`.
fn tojson(value: JValue, kwargs: minijinja::value::Kwargs) -> Result<JValue, JError> {
    let indent: Option<usize> = kwargs.get("indent")?;
    let _: Option<bool> = kwargs.get("sort_keys").ok().flatten();
    kwargs.assert_all_used()?;
    let mut out = String::new();
    dump_py(&value, indent, 0, &mut out)?;
    Ok(JValue::from_safe_string(out))
}

fn newline(out: &mut String, indent: Option<usize>, level: usize) {
    if let Some(n) = indent {
        out.push('\n');
        out.push_str(&" ".repeat(n * level));
    }
}

fn dump_py(
    v: &JValue,
    indent: Option<usize>,
    level: usize,
    out: &mut String,
) -> Result<(), JError> {
    let item_sep = if indent.is_some() { "," } else { ", " };
    match v.kind() {
        ValueKind::Undefined | ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if v.is_true() { "true" } else { "false" }),
        ValueKind::Number => {
            if let Some(i) = v.as_i64() {
                out.push_str(&i.to_string());
            } else {
                let f = f64::try_from(v.clone()).unwrap_or(f64::NAN);
                if f.is_finite() && f.fract() == 0.0 && f.abs() < 1e16 {
                    out.push_str(&format!("{f:.1}"));
                } else if f.is_finite() {
                    out.push_str(&f.to_string());
                } else {
                    out.push_str(if f.is_nan() {
                        "NaN"
                    } else if f > 0.0 {
                        "Infinity"
                    } else {
                        "-Infinity"
                    });
                }
            }
        }
        ValueKind::String => {
            let s = v.as_str().unwrap_or_default();
            out.push_str(
                &serde_json::to_string(s)
                    .map_err(|e| JError::new(ErrorKind::InvalidOperation, e.to_string()))?,
            );
        }
        ValueKind::Seq | ValueKind::Iterable => {
            let items: Vec<JValue> = v.try_iter()?.collect();
            if items.is_empty() {
                out.push_str("[]");
                return Ok(());
            }
            out.push('[');
            for (i, it) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(item_sep);
                }
                newline(out, indent, level + 1);
                dump_py(it, indent, level + 1, out)?;
            }
            newline(out, indent, level);
            out.push(']');
        }
        ValueKind::Map => {
            let keys: Vec<JValue> = v.try_iter()?.collect();
            if keys.is_empty() {
                out.push_str("{}");
                return Ok(());
            }
            out.push('{');
            for (i, k) in keys.iter().enumerate() {
                if i > 0 {
                    out.push_str(item_sep);
                }
                newline(out, indent, level + 1);
                let ks = k
                    .as_str()
                    .map(str::to_string)
                    .unwrap_or_else(|| k.to_string());
                out.push_str(
                    &serde_json::to_string(&ks)
                        .map_err(|e| JError::new(ErrorKind::InvalidOperation, e.to_string()))?,
                );
                out.push_str(": ");
                dump_py(&v.get_item(k)?, indent, level + 1, out)?;
            }
            newline(out, indent, level);
            out.push('}');
        }
        _ => {
            let s = v.to_string();
            out.push_str(
                &serde_json::to_string(&s)
                    .map_err(|e| JError::new(ErrorKind::InvalidOperation, e.to_string()))?,
            );
        }
    }
    Ok(())
}

/// `strftime_now(fmt)` in UTC for the specifiers chat templates use
/// (`%Y %y %m %d %e %B %b %A %a %H %M %S %j %%`).
fn strftime_now(fmt: &str) -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs() as i64)
        .unwrap_or(0);
    let days = secs.div_euclid(86_400);
    let sod = secs.rem_euclid(86_400);
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    const MONTHS: [&str; 12] = [
        "January",
        "February",
        "March",
        "April",
        "May",
        "June",
        "July",
        "August",
        "September",
        "October",
        "November",
        "December",
    ];
    const DAYS: [&str; 7] = [
        "Thursday",
        "Friday",
        "Saturday",
        "Sunday",
        "Monday",
        "Tuesday",
        "Wednesday",
    ];
    let month = MONTHS.get((m - 1) as usize).copied().unwrap_or("January");
    let wday = DAYS
        .get(days.rem_euclid(7) as usize)
        .copied()
        .unwrap_or("Thursday");
    let is_leap = (y % 4 == 0 && y % 100 != 0) || y % 400 == 0;
    let cum = [0, 31, 59, 90, 120, 151, 181, 212, 243, 273, 304, 334];
    let jday = cum.get((m - 1) as usize).copied().unwrap_or(0) + d + i64::from(is_leap && m > 2);
    let mut out = String::new();
    let mut it = fmt.chars();
    while let Some(ch) = it.next() {
        if ch != '%' {
            out.push(ch);
            continue;
        }
        match it.next() {
            Some('Y') => out.push_str(&y.to_string()),
            Some('y') => out.push_str(&format!("{:02}", y.rem_euclid(100))),
            Some('m') => out.push_str(&format!("{m:02}")),
            Some('d') => out.push_str(&format!("{d:02}")),
            Some('e') => out.push_str(&format!("{d:>2}")),
            Some('B') => out.push_str(month),
            Some('b') => out.push_str(month.get(..3).unwrap_or(month)),
            Some('A') => out.push_str(wday),
            Some('a') => out.push_str(wday.get(..3).unwrap_or(wday)),
            Some('H') => out.push_str(&format!("{:02}", sod / 3600)),
            Some('M') => out.push_str(&format!("{:02}", (sod / 60) % 60)),
            Some('S') => out.push_str(&format!("{:02}", sod % 60)),
            Some('j') => out.push_str(&format!("{jday:03}")),
            Some('%') => out.push('%'),
            Some(other) => {
                out.push('%');
                out.push(other);
            }
            None => out.push('%'),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tojson_matches_python_json_dumps() {
        let mut env = Environment::new();
        env.add_filter("tojson", tojson);
        let t = env
            .template_from_str("{{ x | tojson }}|{{ x | tojson(indent=2) }}")
            .unwrap();
        let x = serde_json::json!({"b": [1, 2.5, "é<\"", null, true], "a": {}});
        let out = t
            .render(minijinja::context! { x => JValue::from_serialize(&x) })
            .unwrap();
        // serde_json's map is sorted (b before a is lost); the separators are Python's.
        assert!(
            out.starts_with(r#"{"a": {}, "b": [1, 2.5, "é<\"", null, true]}|{"#),
            "{out}"
        );
        assert!(out.contains("\n  \"b\": [\n    1,\n    2.5,"), "{out}");
    }

    #[test]
    fn strftime_has_the_usual_fields() {
        let s = strftime_now("%d %b %Y %%");
        assert_eq!(s.len(), "01 Jan 2026 %".len(), "{s}");
    }
}
