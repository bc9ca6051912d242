//! The miner's chat-template renderer (`engy_miner::chat::Prompter`, PROTOCOL.md §3.1)
//! with arbitrary `messages`, over two real checkpoints' template + tokenizer (the
//! synthetic serve's ChatML checkpoint, engy-devnet `write_checkpoint`, and the devnet
//! model's, engy-model `gen_model`; committed under `fuzz/seeds/chat_checkpoints/`, see
//! fuzz/README.md). Never panics; rendering and tokenizing are deterministic; errors are
//! `ChatError::Messages` or `ChatError::Render`; a rendered prompt always tokenizes, and its
//! ids decode; messages with string roles and contents render exactly the template's
//! ChatML text.
#![no_main]
use std::path::Path;
use std::sync::OnceLock;

use engy_miner::chat::{ChatError, Prompter};
use libfuzzer_sys::fuzz_target;
use serde_json::{json, Value};

fn prompters() -> &'static [(Prompter, bool); 2] {
    static P: OnceLock<[(Prompter, bool); 2]> = OnceLock::new();
    P.get_or_init(|| {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("seeds/chat_checkpoints");
        let load = |name: &str| {
            Prompter::load(&dir.join(name)).unwrap_or_else(|e| {
                panic!("{e}: generate the checkpoints first (fuzz/README.md)")
            })
        };
        // (prompter, whether its template adds a default system turn)
        [(load("synthetic"), true), (load("devnet"), false)]
    })
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// Messages from fuzzer bytes: 0xFF-separated, each `[role kind][content kind] text…`.
fn messages(b: &[u8]) -> Value {
    let list: Vec<Value> = b
        .split(|&x| x == 0xFF)
        .map(|m| {
            let (r, c, t) = match m {
                [r, c, t @ ..] => (*r, *c, t),
                [r] => (*r, 0, &[][..]),
                [] => (1, 0, &[][..]),
            };
            let body = text(t);
            let mut o = serde_json::Map::new();
            match r % 8 {
                0 => {
                    o.insert("role".into(), json!("system"));
                }
                1 | 5 => {
                    o.insert("role".into(), json!("user"));
                }
                2 => {
                    o.insert("role".into(), json!("assistant"));
                }
                3 => {
                    o.insert("role".into(), json!("tool"));
                }
                4 => {
                    o.insert("role".into(), Value::String(body.chars().take(8).collect()));
                }
                6 => {
                    o.insert("role".into(), json!(7));
                }
                _ => {}
            }
            match c % 6 {
                0 | 1 => {
                    o.insert("content".into(), Value::String(body));
                }
                2 => {
                    o.insert("content".into(), Value::Null);
                }
                3 => {
                    o.insert("content".into(), json!([{"type": "text", "text": body}]));
                }
                4 => {
                    o.insert("content".into(), json!(c));
                }
                _ => {}
            }
            if r & 0x80 != 0 {
                o.insert("name".into(), json!("x"));
            }
            Value::Object(o)
        })
        .collect();
    Value::Array(list)
}

/// What the ChatML templates render for messages with string roles and contents.
fn chatml(msgs: &[Value], default_system: bool) -> Option<String> {
    let mut out = String::new();
    for (i, m) in msgs.iter().enumerate() {
        let role = m.get("role")?.as_str()?;
        let content = m.get("content")?.as_str()?;
        if i == 0 && default_system && role != "system" {
            out.push_str("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n");
        }
        out.push_str(&format!("<|im_start|>{role}\n{content}<|im_end|>\n"));
    }
    out.push_str("<|im_start|>assistant\n");
    Some(out)
}

fn check(p: &Prompter, default_system: bool, msgs: &Value) {
    let r = p.render(msgs);
    let again = p.render(msgs);
    assert_eq!(format!("{r:?}"), format!("{again:?}"), "rendering is not deterministic");
    match &r {
        Ok(t) => {
            let ids = p.prompt_ids(msgs).expect("a rendered prompt tokenizes");
            assert_eq!(ids, p.encode(t).unwrap(), "prompt_ids is not encode(render)");
            p.decode(&ids).expect("ids of a prompt decode");
            if let Some(want) = msgs.as_array().and_then(|m| chatml(m, default_system)) {
                assert_eq!(t, &want, "rendered text differs from ChatML");
            }
        }
        Err(ChatError::Messages(_) | ChatError::Render(_)) => {
            assert!(p.prompt_ids(msgs).is_err());
        }
        Err(e) => panic!("render failed with an unexpected kind of error: {e:?}"),
    }
}

fuzz_target!(|data: &[u8]| {
    let Some((&mode, rest)) = data.split_first() else {
        return;
    };
    let msgs = if mode & 1 == 0 {
        match serde_json::from_slice::<Value>(rest) {
            Ok(v) => v,
            Err(_) => return,
        }
    } else {
        messages(rest)
    };
    for (p, default_system) in prompters() {
        check(p, *default_system, &msgs);
    }
});
