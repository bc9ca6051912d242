//! Gateway → miner frame decoding (`engy_miner::gateway::decode_frame`, PROTOCOL.md §2) on
//! arbitrary text, and on frames built from fuzzer bytes. Never panics; deterministic;
//! formatting (whitespace, key order) never changes the decoded frame; a frame built from
//! known fields decodes to exactly those fields (serve/cancel need a non-empty string
//! `corr_id`; `stream` by Python truthiness; unknown types are `Unknown`).
#![no_main]
use engy_miner::gateway::{decode_frame, Frame, FrameError, ServeFrame};
use libfuzzer_sys::fuzz_target;
use serde_json::{json, Value};

/// The frame without its free-form JSON (`request`, `reason`), whose floats serde_json
/// may read back 1 ulp off after printing them.
fn shape(f: &Result<Frame, FrameError>) -> Result<Frame, FrameError> {
    match f {
        Ok(Frame::Serve(s)) => Ok(Frame::Serve(ServeFrame { request: Value::Null, ..s.clone() })),
        Ok(Frame::Deny { .. }) => Ok(Frame::Deny { reason: Value::Null }),
        other => other.clone(),
    }
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

fuzz_target!(|data: &[u8]| {
    let Some((&mode, rest)) = data.split_first() else {
        return;
    };
    if mode & 1 == 0 {
        let Ok(t) = std::str::from_utf8(rest) else {
            return;
        };
        let f = decode_frame(t);
        assert_eq!(f, decode_frame(t), "not deterministic");
        if let Ok(v) = serde_json::from_str::<Value>(t) {
            let compact = serde_json::to_string(&v).unwrap();
            let pretty = serde_json::to_string_pretty(&v).unwrap();
            assert_eq!(shape(&decode_frame(&compact)), shape(&f), "re-serialising changed the frame");
            assert_eq!(shape(&decode_frame(&pretty)), shape(&f), "pretty-printing changed the frame");
        } else {
            assert!(matches!(f, Err(FrameError::NotAnObject(_))), "non-JSON decoded: {f:?}");
        }
        return;
    }
    // A frame from parts: [kind][corr_id kind][stream kind] then 0xFF-separated strings.
    let [k, c, s, tail @ ..] = rest else {
        return;
    };
    let mut parts = tail.split(|&b| b == 0xFF);
    let corr = text(parts.next().unwrap_or_default());
    let content = text(parts.next().unwrap_or_default());
    let other = text(parts.next().unwrap_or_default());
    let kind = match k % 8 {
        0 => "serve".to_string(),
        1 => "cancel".into(),
        2 => "ping".into(),
        3 => "reconnect".into(),
        4 => "admit".into(),
        5 => "deny".into(),
        _ => other.clone(),
    };
    let mut obj = serde_json::Map::new();
    if c % 4 != 3 {
        obj.insert("type".into(), Value::String(kind.clone()));
    }
    let corr_v = match c % 5 {
        0 => None,
        1 => Some(json!(42)),
        _ => Some(Value::String(corr.clone())),
    };
    if let Some(v) = &corr_v {
        obj.insert("corr_id".into(), v.clone());
    }
    let stream_v = match s % 4 {
        0 => None,
        1 => Some(json!(true)),
        2 => Some(json!(false)),
        _ => Some(json!("true")),
    };
    if let Some(v) = &stream_v {
        obj.insert("stream".into(), v.clone());
    }
    let request = json!({"messages": [{"role": "user", "content": content}], "max_tokens": 16});
    if s & 4 == 0 {
        obj.insert("request".into(), request.clone());
    }
    let reason = Value::String(other.clone());
    if s & 8 == 0 {
        obj.insert("reason".into(), reason.clone());
    }
    let t = Value::Object(obj).to_string();
    let got = decode_frame(&t);
    let kind = if c % 4 == 3 { String::new() } else { kind };
    let corr_ok = matches!(&corr_v, Some(Value::String(x)) if !x.is_empty());
    let want = match kind.as_str() {
        "serve" if !corr_ok => Err(FrameError::NoCorrId { kind: "serve" }),
        "cancel" if !corr_ok => Err(FrameError::NoCorrId { kind: "cancel" }),
        "serve" => Ok(Frame::Serve(ServeFrame {
            corr_id: corr.clone(),
            request: if s & 4 == 0 { request } else { Value::Null },
            stream: matches!(&stream_v, Some(v) if engy_core::wire::truthy(v)),
        })),
        "cancel" => Ok(Frame::Cancel { corr_id: corr.clone() }),
        "ping" => Ok(Frame::Ping),
        "reconnect" => Ok(Frame::Reconnect),
        "admit" => Ok(Frame::Admit),
        "deny" => Ok(Frame::Deny {
            reason: if s & 8 == 0 { reason } else { Value::Null },
        }),
        _ => Ok(Frame::Unknown { kind: kind.clone() }),
    };
    assert_eq!(got, want, "{t}");
});
