//! The miner's wire messages, typed: every gateway frame in both directions, the serve's
//! `/generate` and `/abort_request` request bodies, and the commitment a `response` carries
//! (docs/PROTOCOL.md §2, §3.4, §3.10).
//!
//! One module for every side: the miner encodes [`MinerFrame`]s and decodes
//! [`GatewayFrame`]s with [`decode_gateway_frame`]; the gateway double encodes the gateway's
//! frames and checks the miner's with [`MinerFrame::parse_strict`]; the sglang double
//! parses [`GenerateRequest`]; the auditor reads [`Commitment`].
//!
//! Unknown input is handled here and nowhere else (docs/PROTOCOL.md §2.4):
//! * a gateway frame of an unknown `type` decodes to [`GatewayFrame::Unknown`] (logged and
//!   ignored by the miner: a newer gateway may send more kinds);
//! * unknown fields of a known gateway frame are ignored;
//! * the miner's own frames are checked strictly ([`MinerFrame::parse_strict`] refuses an
//!   unknown field), so a test notices when the miner sends something the protocol does
//!   not name.
//!
//! The request-body rules the production miner applies to `serve.request` (numbers sent as
//! strings, Python truthiness) are [`max_tokens`], [`request_id`] and [`truthy`].
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

/// Largest `error` text of a `response` frame, in characters (docs/PROTOCOL.md §2).
pub const ERROR_MAX_CHARS: usize = 300;

// ---------------------------------------------------------------- miner → gateway

/// `capacity` of HELLO and of every heartbeat (docs/PROTOCOL.md §2.2).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Capacity {
    /// This leg's share of the miner's concurrency.
    pub max_inflight: u64,
    /// The miner's whole concurrency (`MAX_INFLIGHT`), undivided.
    pub max_inflight_total: u64,
    /// Longest prompt accepted, tokens.
    pub max_input_tokens: u64,
    /// Longest output, tokens.
    pub max_output_tokens: u64,
    /// Seconds the gateway waits for one request.
    pub max_request_s: f64,
}

/// `hello`: the first frame on every leg (docs/PROTOCOL.md §2). Its `Debug` never shows
/// `miner_key`.
#[derive(Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Hello {
    /// The miner key (secret: sent here and nowhere else).
    pub miner_key: String,
    /// Gateway model id, e.g. `qwen3.6-35b-a3b`.
    pub model: String,
    /// Checkpoint identity (docs/PROTOCOL.md §4).
    pub model_root: String,
    /// Hardware facts (free-form object, docs/PROTOCOL.md §2.1).
    pub hw: Value,
    /// Software versions (free-form object).
    pub versions: Value,
    /// Concurrency and limits.
    pub capacity: Capacity,
    /// This machine's name under the key.
    pub worker_name: String,
    /// The same value as `worker_name` (older gateways read this name).
    pub instance_id: String,
    /// uuid hex, fresh per process start.
    pub worker_id: String,
}

impl std::fmt::Debug for Hello {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Hello")
            .field("miner_key", &"<redacted>")
            .field("model", &self.model)
            .field("model_root", &self.model_root)
            .field("worker_name", &self.worker_name)
            .field("worker_id", &self.worker_id)
            .finish_non_exhaustive()
    }
}

/// `heartbeat`: periodic, and the answer to every `ping`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Heartbeat {
    /// Requests in flight on this leg.
    pub inflight: u64,
    /// Seconds since this leg last finished a request (0 while busy).
    pub idle_seconds: f64,
    /// As in HELLO.
    pub capacity: Capacity,
}

/// `delta` of a `chunk` frame.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Delta {
    /// New text since the previous chunk of the request.
    pub content: String,
}

/// `chunk`: streamed text of a request served with `stream` (docs/PROTOCOL.md §3.6).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Chunk {
    /// The request's correlation id.
    pub corr_id: String,
    /// The new text.
    pub delta: Delta,
}

/// `response`: the one terminal frame of a served request (docs/PROTOCOL.md §2, §2.6).
/// On failure `commitment` is null, `output` is `{}` and `error` says why.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Response {
    /// The request's correlation id.
    pub corr_id: String,
    /// The request's `engy_request_id` as sent (any JSON value), else a fresh uuid hex.
    pub request_id: Value,
    /// The proof of the completion; null on failure.
    pub commitment: Option<Commitment>,
    /// The completion; `{}` on failure.
    pub output: Output,
    /// Why the request failed (≤ [`ERROR_MAX_CHARS`] characters); absent on success.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

impl Response {
    /// A successful response.
    pub fn completed(
        corr_id: &str,
        request_id: Value,
        commitment: Commitment,
        output: Completion,
    ) -> Self {
        Self {
            corr_id: corr_id.to_string(),
            request_id,
            commitment: Some(commitment),
            output: Output::Completion(output),
            error: None,
        }
    }

    /// A failed response: null commitment, `{}` output, `error` cut to
    /// [`ERROR_MAX_CHARS`] characters by [`short_error`].
    pub fn failed(corr_id: &str, request_id: Value, error: &str) -> Self {
        Self {
            corr_id: corr_id.to_string(),
            request_id,
            commitment: None,
            output: Output::Empty(Empty {}),
            error: Some(short_error(error)),
        }
    }
}

/// `output` of a `response`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum Output {
    /// The OpenAI-style completion.
    Completion(Completion),
    /// `{}` (a failed request).
    Empty(Empty),
}

/// The empty object `{}`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Empty {}

/// The OpenAI-style chat completion body (docs/PROTOCOL.md §3.9).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Completion {
    /// One choice.
    pub choices: Vec<Choice>,
    /// Token counts.
    pub usage: Usage,
}

impl Completion {
    /// The single-choice completion of `content`, `finish_reason` "stop", as the
    /// production miner reports every completion.
    pub fn of_text(content: String, usage: Usage) -> Self {
        Self {
            choices: vec![Choice {
                index: 0,
                finish_reason: "stop".into(),
                message: Message {
                    role: "assistant".into(),
                    content,
                },
            }],
            usage,
        }
    }
}

/// One completion choice.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Choice {
    /// Always 0.
    pub index: u64,
    /// Always `"stop"` (as the production miner).
    pub finish_reason: String,
    /// The assistant message.
    pub message: Message,
}

/// A chat message of a completion.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Message {
    /// `"assistant"`.
    pub role: String,
    /// Decoded text, special tokens skipped.
    pub content: String,
}

/// Token counts of a completion.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Usage {
    /// `len(prompt_ids)` including `prompt_extra`.
    pub prompt_tokens: u64,
    /// Rows proven (= output tokens).
    pub completion_tokens: u64,
    /// The sum.
    pub total_tokens: u64,
    /// Present only when the serve reported a prefix-cache hit.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prompt_tokens_details: Option<PromptTokensDetails>,
}

/// Prefix-cache detail of [`Usage`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PromptTokensDetails {
    /// `min(cached_tokens, prompt_tokens)`.
    pub cached_tokens: u64,
}

/// The proof of one completion (docs/PROTOCOL.md §3.10). Unknown fields are ignored when
/// reading one (an auditor reads commitments of other miners).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Commitment {
    /// Checkpoint identity (docs/PROTOCOL.md §4).
    pub model_root: String,
    /// Every output token, in order.
    pub output_token_ids: Vec<u32>,
    /// The TOPLOC proof and what it was built over.
    pub toploc: ToplocCommitment,
    /// The serve's MoE routing of every position `[0, len(prompt_ids) + n_tokens − 1)`
    /// (docs/PROTOCOL.md §3.10): `layers = num_hidden_layers`, `width =
    /// num_experts_per_tok`. Absent when it was not collected (the key is then not
    /// written, so commitments without it are byte-identical to before).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub routing: Option<crate::trace::Trace>,
    /// The DSA indexer's top-k key positions over the same positions (`padded`: unused
    /// slots are sglang's -1). Absent when not collected.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub indexer_topk: Option<crate::trace::Trace>,
    /// The request's activation-cell commitment (docs/PROTOCOL.md §10, specs/CELLS.md):
    /// absent when the miner committed no cells (the key is then not written).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cells: Option<CellsCommitment>,
}

/// `commitment.cells` (docs/PROTOCOL.md §3.10, §10): the root over every cell of the
/// teacher-forced pass over `prompt_ids + output_token_ids` and the shape that gives each
/// leaf index its (position, layer). About 200 bytes of JSON plus 3 per MoE layer, whatever
/// the request's length.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CellsCommitment {
    /// `engy-cells/v2` ([`crate::cells::SCHEME`]).
    pub scheme: String,
    /// `cells_root`, 64 lowercase hex characters.
    pub root: crate::commit::spec::Hex,
    /// `n_positions` (= `len(prompt_ids) + n_tokens`), `tokens_sha256` (of those ids as
    /// `u32le`), `layers` (the MoE layers), `hidden`,
    /// `n_experts`, `top_k`, `logits_dtype` (1 = BF16, 2 = F32); validated when read.
    pub shape: crate::cells::CellShape,
}

/// `commitment.toploc`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ToplocCommitment {
    /// One base64 proof per batch of `decode_batching_size` rows (null proofs when none
    /// could be built, docs/PROTOCOL.md §5).
    pub proofs: Vec<String>,
    /// Top-k per batch.
    pub topk: u64,
    /// Rows per batch.
    pub decode_batching_size: u64,
    /// Always true for engy.
    pub skip_prefill: bool,
    /// Rows proven (= output tokens).
    pub n_tokens: u64,
    /// The prompt the rows were computed on, `prompt_extra` included.
    pub prompt_ids: Vec<u32>,
}

/// One opened cell of a `cells` frame (docs/PROTOCOL.md §10, specs/CELLS.md §4).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CellOpening {
    /// Leaf index (`position · len(layers) + rank(layer)`), as the challenge drew it.
    pub index: u64,
    /// Standard base64 (with padding) of the cell's canonical bytes (specs/CELLS.md §2).
    pub cell: String,
    /// The RFC 9162 inclusion path, siblings bottom-up, each 64 hex characters.
    pub path: Vec<crate::commit::spec::Hex>,
}

/// `cells`: the miner's answer to `open_cells` (docs/PROTOCOL.md §2, §10).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CellsOpened {
    /// The `request_id` of `open_cells`, as sent.
    pub request_id: Value,
    /// The request's committed `cells_root` (64 hex characters).
    pub root: crate::commit::spec::Hex,
    /// The challenged cells, in the order the challenge drew them.
    pub openings: Vec<CellOpening>,
}

/// Why an `open_cells` was not answered with cells (`cells_error.reason`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CellsRefusal {
    /// The miner holds no cells for this `request_id`: never committed, or evicted from
    /// its retention store (time or size limit), or cells are off.
    UnknownRequest,
    /// The seed is not 64 hex characters, or `n` is 0, above the request's cells, or
    /// above [`MAX_OPEN_CELLS`].
    BadChallenge,
}

/// `cells_error`: `open_cells` refused, with the reason word and a sentence.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CellsError {
    /// The `request_id` of `open_cells`, as sent.
    pub request_id: Value,
    /// `unknown_request` or `bad_challenge`.
    pub reason: CellsRefusal,
    /// What was wrong (at most [`ERROR_MAX_CHARS`] characters).
    pub error: String,
}

/// Most cells one `open_cells` may ask for (a Qwen3.6 opening is about 13 KB of JSON, so
/// the `cells` frame stays under about 3.5 MB).
pub const MAX_OPEN_CELLS: u64 = 256;

/// A frame the miner sends. (Variants differ in size, `response` being the largest: a frame
/// is built once, serialised and dropped, so none is boxed.)
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum MinerFrame {
    /// `hello`.
    Hello(Hello),
    /// `heartbeat`.
    Heartbeat(Heartbeat),
    /// `chunk`.
    Chunk(Chunk),
    /// `response`.
    Response(Response),
    /// `cells`: the openings of an `open_cells` (engy extension, §10).
    Cells(CellsOpened),
    /// `cells_error`: an `open_cells` refused (engy extension, §10).
    CellsError(CellsError),
}

impl MinerFrame {
    /// The frame as one websocket text message.
    pub fn to_text(&self) -> String {
        // Serialising these types cannot fail: every map key is a string.
        serde_json::to_string(self).unwrap_or_default()
    }

    /// Parse a miner frame, refusing unknown types and unknown fields (for the doubles and
    /// tests: what the miner sends must be exactly a frame the protocol names).
    ///
    /// # Errors
    /// The serde error.
    pub fn parse_strict(text: &str) -> Result<Self, serde_json::Error> {
        serde_json::from_str(text)
    }
}

/// Cut an error text to [`ERROR_MAX_CHARS`] characters (the last three become `...`).
pub fn short_error(msg: &str) -> String {
    if msg.chars().count() <= ERROR_MAX_CHARS {
        msg.to_string()
    } else {
        let mut s: String = msg.chars().take(ERROR_MAX_CHARS - 3).collect();
        s.push_str("...");
        s
    }
}

// ---------------------------------------------------------------- gateway → miner

/// A frame the gateway sends (docs/PROTOCOL.md §2), as [`decode_gateway_frame`] reads it.
#[derive(Debug, Clone, PartialEq)]
pub enum GatewayFrame {
    /// `serve`: run one request.
    Serve(Serve),
    /// `cancel {corr_id}`: the buyer left.
    Cancel {
        /// The request's correlation id (non-empty).
        corr_id: String,
    },
    /// `ping`: answer with a heartbeat.
    Ping,
    /// `reconnect`: the gateway is draining; close this leg and re-dial.
    Reconnect,
    /// `admit`.
    Admit,
    /// `deny {reason}`; `reason` as sent (`null` when absent).
    Deny {
        /// The gateway's reason, any JSON value.
        reason: Value,
    },
    /// `open_cells {request_id, seed, n}`: open the challenged cells of a committed
    /// request (engy extension, docs/PROTOCOL.md §10).
    OpenCells(OpenCells),
    /// A frame of another `type` (a newer gateway may send more kinds).
    Unknown {
        /// Its `type` (`""` when it has none or it is not a string).
        kind: String,
    },
}

/// The fields of a `serve` frame: `{corr_id, request, stream?}`.
#[derive(Debug, Clone, PartialEq)]
pub struct Serve {
    /// Correlation id (non-empty).
    pub corr_id: String,
    /// The OpenAI-style chat body (`Value::Null` when absent).
    pub request: Value,
    /// Stream `chunk` frames: `stream` by Python truthiness, as the production miner reads
    /// it ([`truthy`]: `true`, `"true"`, `1` stream; absent, `false`, `0`, `""` do not).
    pub stream: bool,
}

/// The fields of an `open_cells` frame. A seed or `n` the miner cannot use is kept as the
/// reason (`challenge: Err`), so the miner answers it with `cells_error bad_challenge`
/// instead of ignoring the frame.
#[derive(Debug, Clone, PartialEq)]
pub struct OpenCells {
    /// The `request_id` of the request's `response`, any JSON value (`null` when absent).
    pub request_id: Value,
    /// The challenge, or why the frame's `seed` / `n` are unusable.
    pub challenge: Result<CellChallenge, String>,
}

/// A challenge: the 32-byte seed (`seed`, 64 hex characters on the wire, e.g.
/// [`crate::cells::production_seed`]) and how many distinct cells to open (`n`, 1 ..=
/// [`MAX_OPEN_CELLS`]). The miner opens [`crate::cells::select`]`(seed, cells_root, n_cells,
/// n)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CellChallenge {
    /// The seed.
    pub seed: [u8; 32],
    /// Cells to open.
    pub n: u64,
}

fn challenge(obj: &Map<String, Value>) -> Result<CellChallenge, String> {
    let seed = obj
        .get("seed")
        .and_then(Value::as_str)
        .ok_or("seed must be a string of 64 hex characters")?;
    let seed = crate::commit::parse_digest(seed)
        .map_err(|e| format!("seed must be 64 hex characters: {e}"))?;
    let n = obj
        .get("n")
        .and_then(Value::as_u64)
        .ok_or("n must be a positive integer")?;
    if n == 0 || n > MAX_OPEN_CELLS {
        return Err(format!("n must be 1 to {MAX_OPEN_CELLS}, got {n}"));
    }
    Ok(CellChallenge { seed, n })
}

/// Why a gateway frame was not decoded (the miner logs it and ignores the frame).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FrameError {
    /// Not JSON, or JSON that is not an object.
    #[error("frame is not a JSON object: {0}")]
    NotAnObject(String),
    /// A `serve` or `cancel` frame without a non-empty string `corr_id`.
    #[error("{kind} frame without a corr_id")]
    NoCorrId {
        /// `"serve"` or `"cancel"`.
        kind: &'static str,
    },
}

/// Decode one websocket text frame from the gateway. Pure. Unknown `type`s are
/// [`GatewayFrame::Unknown`], unknown fields are ignored.
///
/// # Errors
/// [`FrameError::NotAnObject`] for text that is not a JSON object;
/// [`FrameError::NoCorrId`] for a `serve` or `cancel` without a non-empty string `corr_id`.
pub fn decode_gateway_frame(text: &str) -> Result<GatewayFrame, FrameError> {
    let frame: Value =
        serde_json::from_str(text).map_err(|e| FrameError::NotAnObject(e.to_string()))?;
    let Value::Object(mut obj) = frame else {
        return Err(FrameError::NotAnObject("not an object".into()));
    };
    let kind = obj
        .get("type")
        .and_then(Value::as_str)
        .unwrap_or("")
        .to_string();
    let corr_id = |obj: &Map<String, Value>, kind: &'static str| {
        obj.get("corr_id")
            .and_then(Value::as_str)
            .filter(|c| !c.is_empty())
            .map(str::to_string)
            .ok_or(FrameError::NoCorrId { kind })
    };
    Ok(match kind.as_str() {
        "serve" => GatewayFrame::Serve(Serve {
            corr_id: corr_id(&obj, "serve")?,
            stream: obj.get("stream").is_some_and(truthy),
            request: obj.remove("request").unwrap_or(Value::Null),
        }),
        "cancel" => GatewayFrame::Cancel {
            corr_id: corr_id(&obj, "cancel")?,
        },
        "ping" => GatewayFrame::Ping,
        "reconnect" => GatewayFrame::Reconnect,
        "admit" => GatewayFrame::Admit,
        "deny" => GatewayFrame::Deny {
            reason: obj.remove("reason").unwrap_or(Value::Null),
        },
        "open_cells" => GatewayFrame::OpenCells(OpenCells {
            challenge: challenge(&obj),
            request_id: obj.remove("request_id").unwrap_or(Value::Null),
        }),
        _ => GatewayFrame::Unknown { kind },
    })
}

impl GatewayFrame {
    /// The frame as the gateway writes it (for the gateway double).
    pub fn to_value(&self) -> Value {
        match self {
            GatewayFrame::Serve(s) => serde_json::json!({
                "type": "serve", "corr_id": s.corr_id, "request": s.request, "stream": s.stream
            }),
            GatewayFrame::Cancel { corr_id } => {
                serde_json::json!({"type": "cancel", "corr_id": corr_id})
            }
            GatewayFrame::Ping => serde_json::json!({"type": "ping"}),
            GatewayFrame::Reconnect => serde_json::json!({"type": "reconnect"}),
            GatewayFrame::Admit => serde_json::json!({"type": "admit"}),
            GatewayFrame::Deny { reason } => serde_json::json!({"type": "deny", "reason": reason}),
            GatewayFrame::OpenCells(o) => match &o.challenge {
                Ok(c) => serde_json::json!({"type": "open_cells", "request_id": o.request_id,
                    "seed": hex::encode(c.seed), "n": c.n}),
                Err(_) => serde_json::json!({"type": "open_cells", "request_id": o.request_id}),
            },
            GatewayFrame::Unknown { kind } => serde_json::json!({ "type": kind }),
        }
    }
}

/// Python truthiness of a JSON value, as the production miner tests `serve.stream`:
/// false for `null`, `false`, `0`, `0.0`, `""`, `[]`, `{}`; true otherwise.
pub fn truthy(v: &Value) -> bool {
    match v {
        Value::Null => false,
        Value::Bool(b) => *b,
        Value::Number(n) => n.as_f64().is_some_and(|f| f != 0.0),
        Value::String(s) => !s.is_empty(),
        Value::Array(a) => !a.is_empty(),
        Value::Object(o) => !o.is_empty(),
    }
}

/// Why `request.max_tokens` is unusable.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("max_tokens must be a positive integer (a number or a string of digits), got {0}")]
pub struct BadMaxTokens(pub String);

/// The request's output-token budget before `MAX_OUTPUT_TOKENS` (docs/PROTOCOL.md §3.2),
/// read as the production miner reads it (`int(max_tokens or default)`):
/// * absent, `null`, `0`, `0.0`, `""` or `false` → `Ok(None)` (the miner's default);
/// * an integer, a float (truncated toward zero: `5.0`, `5.9` → 5) or a string of decimal
///   digits with optional surrounding whitespace and sign (`"5"`, `" 7 "`) → its value;
/// * `max_completion_tokens` (same rules) when `max_tokens` is absent or null (a
///   deliberate difference: the production miner ignores it).
///
/// # Errors
/// [`BadMaxTokens`] for any other value (`"5.0"`, `"abc"`, `true`, lists, objects) and for
/// a value below 1 (production passes a negative budget on to the serve, which refuses it).
pub fn max_tokens(request: &Value) -> Result<Option<u64>, BadMaxTokens> {
    let v = match request.get("max_tokens") {
        None | Some(Value::Null) => match request.get("max_completion_tokens") {
            None => return Ok(None),
            Some(v) => v,
        },
        Some(v) => v,
    };
    let bad = || BadMaxTokens(v.to_string().chars().take(40).collect());
    if !truthy(v) {
        return Ok(None);
    }
    let n: i128 = match v {
        Value::Number(n) => match (n.as_i64(), n.as_u64(), n.as_f64()) {
            (Some(i), _, _) => i128::from(i),
            (_, Some(u), _) => i128::from(u),
            (_, _, Some(f)) if f.is_finite() => f.trunc() as i128,
            _ => return Err(bad()),
        },
        Value::String(s) => {
            let t = s.trim();
            let digits = t.strip_prefix(['+', '-']).unwrap_or(t);
            if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
                return Err(bad());
            }
            t.parse::<i128>().map_err(|_| bad())?
        }
        _ => return Err(bad()),
    };
    if n < 1 {
        return Err(bad());
    }
    Ok(Some(u64::try_from(n).unwrap_or(u64::MAX)))
}

/// The `request_id` of a request's `response` (docs/PROTOCOL.md §2): `engy_request_id`
/// as sent (string, number, any JSON value) when it is truthy ([`truthy`]), else `None`
/// (the miner then sends a fresh uuid hex), as the production miner does.
pub fn request_id(request: &Value) -> Option<Value> {
    request
        .get("engy_request_id")
        .filter(|v| truthy(v))
        .cloned()
}

// ---------------------------------------------------------------- miner → serve

/// `sampling_params` of a `/generate` call.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SamplingParams {
    /// Always 0.0 (greedy).
    pub temperature: f64,
    /// Tokens to generate in this call.
    pub max_new_tokens: u64,
}

/// The body of one `/generate` call (docs/PROTOCOL.md §3.4). Unknown fields are ignored
/// when reading one (the serve double accepts what sglang accepts).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GenerateRequest {
    /// The prompt (and, on a continuation, the output so far minus its last token).
    pub input_ids: Vec<u32>,
    /// Greedy, with this call's token budget.
    pub sampling_params: SamplingParams,
    /// `engy-<uuid hex>`: makes the call abortable.
    pub rid: String,
    /// Always true.
    pub return_hidden_states: bool,
    /// Always true (output ids come from `output_token_logprobs`).
    pub return_logprob: bool,
    /// SSE when the gateway asked for streaming.
    #[serde(default)]
    pub stream: bool,
    /// Ask for `meta_info.routed_experts` (docs/PROTOCOL.md §3.10); sent only when true.
    #[serde(default, skip_serializing_if = "is_false")]
    pub return_routed_experts: bool,
    /// The first position whose routing the reply covers (sglang: `[start, seqlen − 1)`,
    /// in `[0, len(input_ids)]`); sent only with `return_routed_experts`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub routed_experts_start_len: Option<u64>,
    /// Ask for `meta_info.indexer_topk` (always from position 0); sent only when true.
    #[serde(default, skip_serializing_if = "is_false")]
    pub return_indexer_topk: bool,
}

fn is_false(b: &bool) -> bool {
    !*b
}

/// The body of `/abort_request`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AbortRequest {
    /// The call to stop.
    pub rid: String,
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn max_tokens_reads_numbers_as_the_production_miner() {
        let r = |v: Value| max_tokens(&json!({ "max_tokens": v }));
        assert_eq!(r(json!(5)), Ok(Some(5)));
        assert_eq!(r(json!("5")), Ok(Some(5)));
        assert_eq!(r(json!(5.0)), Ok(Some(5)));
        assert_eq!(r(json!(5.9)), Ok(Some(5)));
        assert_eq!(r(json!(" 7 ")), Ok(Some(7)));
        assert_eq!(r(json!(0)), Ok(None));
        assert_eq!(r(json!("")), Ok(None));
        assert_eq!(r(Value::Null), Ok(None));
        assert!(r(json!("5.0")).is_err());
        assert!(r(json!("abc")).is_err());
        assert!(r(json!(true)).is_err());
        assert!(r(json!(-3)).is_err());
        assert!(r(json!([5])).is_err());
        assert_eq!(
            max_tokens(&json!({"max_completion_tokens": "9"})),
            Ok(Some(9))
        );
        assert_eq!(
            max_tokens(&json!({"max_tokens": 3, "max_completion_tokens": 9})),
            Ok(Some(3))
        );
        assert_eq!(max_tokens(&json!({})), Ok(None));
    }

    #[test]
    fn request_id_is_echoed_as_sent() {
        assert_eq!(request_id(&json!({"engy_request_id": 42})), Some(json!(42)));
        assert_eq!(
            request_id(&json!({"engy_request_id": "r-1"})),
            Some(json!("r-1"))
        );
        assert_eq!(request_id(&json!({"engy_request_id": ""})), None);
        assert_eq!(request_id(&json!({})), None);
    }

    #[test]
    fn serve_stream_is_python_truthiness() {
        for (v, want) in [
            (json!(true), true),
            (json!("true"), true),
            (json!(1), true),
            (json!(false), false),
            (json!(0), false),
            (json!(""), false),
            (Value::Null, false),
        ] {
            let t =
                json!({"type": "serve", "corr_id": "c", "request": {}, "stream": v}).to_string();
            match decode_gateway_frame(&t) {
                Ok(GatewayFrame::Serve(s)) => assert_eq!(s.stream, want, "{t}"),
                other => panic!("{t}: {other:?}"),
            }
        }
    }

    #[test]
    fn unknown_gateway_frames_and_fields_are_tolerated() {
        assert_eq!(
            decode_gateway_frame(r#"{"type":"rebalance","x":1}"#),
            Ok(GatewayFrame::Unknown {
                kind: "rebalance".into()
            })
        );
        assert_eq!(
            decode_gateway_frame(r#"{"type":"cancel","corr_id":"c","why":"left"}"#),
            Ok(GatewayFrame::Cancel {
                corr_id: "c".into()
            })
        );
        assert_eq!(
            decode_gateway_frame(r#"{"type":"cancel"}"#),
            Err(FrameError::NoCorrId { kind: "cancel" })
        );
        assert!(matches!(
            decode_gateway_frame("[1]"),
            Err(FrameError::NotAnObject(_))
        ));
    }

    #[test]
    fn miner_frames_round_trip_and_are_checked_strictly() {
        let f = MinerFrame::Response(Response::failed("c", json!(7), &"x".repeat(400)));
        let text = f.to_text();
        let v: Value = serde_json::from_str(&text).unwrap();
        assert_eq!(v["type"], "response");
        assert_eq!(v["commitment"], Value::Null);
        assert_eq!(v["output"], json!({}));
        assert_eq!(v["request_id"], 7);
        assert_eq!(v["error"].as_str().unwrap().chars().count(), 300);
        assert_eq!(MinerFrame::parse_strict(&text).unwrap(), f);
        let chunk = json!({"type":"chunk","corr_id":"c","delta":{"content":"hi"}});
        assert!(MinerFrame::parse_strict(&chunk.to_string()).is_ok());
        let extra = json!({"type":"chunk","corr_id":"c","delta":{"content":"hi"},"x":1});
        assert!(MinerFrame::parse_strict(&extra.to_string()).is_err());
        assert!(MinerFrame::parse_strict(r#"{"type":"hi"}"#).is_err());
    }

    #[test]
    fn open_cells_decodes_and_keeps_a_bad_challenge_as_its_reason() {
        let seed = "ab".repeat(32);
        let f = decode_gateway_frame(
            &json!({"type": "open_cells", "request_id": "r-1", "seed": seed, "n": 3}).to_string(),
        )
        .unwrap();
        let want = GatewayFrame::OpenCells(OpenCells {
            request_id: json!("r-1"),
            challenge: Ok(CellChallenge {
                seed: [0xab; 32],
                n: 3,
            }),
        });
        assert_eq!(f, want);
        assert_eq!(decode_gateway_frame(&want.to_value().to_string()), Ok(want));
        for bad in [
            json!({"type": "open_cells", "request_id": 7, "seed": "ab", "n": 3}),
            json!({"type": "open_cells", "request_id": 7, "seed": seed, "n": 0}),
            json!({"type": "open_cells", "request_id": 7, "seed": seed, "n": MAX_OPEN_CELLS + 1}),
            json!({"type": "open_cells", "request_id": 7, "seed": seed}),
            json!({"type": "open_cells", "request_id": 7, "seed": 5, "n": 1}),
        ] {
            match decode_gateway_frame(&bad.to_string()) {
                Ok(GatewayFrame::OpenCells(o)) => {
                    assert_eq!(o.request_id, json!(7));
                    assert!(o.challenge.is_err(), "{bad}");
                }
                other => panic!("{bad}: {other:?}"),
            }
        }
    }

    #[test]
    fn cells_frames_are_named_and_strict() {
        let e = MinerFrame::CellsError(CellsError {
            request_id: json!("r"),
            reason: CellsRefusal::UnknownRequest,
            error: "x".into(),
        });
        let v: Value = serde_json::from_str(&e.to_text()).unwrap();
        assert_eq!(v["type"], "cells_error");
        assert_eq!(v["reason"], "unknown_request");
        assert_eq!(MinerFrame::parse_strict(&e.to_text()).unwrap(), e);
        let c = json!({"type": "cells", "request_id": 1, "root": "00".repeat(32),
                       "openings": [{"index": 0, "cell": "AA==", "path": ["11".repeat(32)]}]});
        assert!(matches!(
            MinerFrame::parse_strict(&c.to_string()),
            Ok(MinerFrame::Cells(_))
        ));
        let mut extra = c.clone();
        extra["openings"][0]["x"] = json!(1);
        assert!(MinerFrame::parse_strict(&extra.to_string()).is_err());
    }

    #[test]
    fn hello_debug_hides_the_key() {
        let h = Hello {
            miner_key: "mk-secret".into(),
            model: "m".into(),
            model_root: "r".into(),
            hw: json!({}),
            versions: json!({}),
            capacity: Capacity {
                max_inflight: 8,
                max_inflight_total: 8,
                max_input_tokens: 1,
                max_output_tokens: 1,
                max_request_s: 1.0,
            },
            worker_name: "w".into(),
            instance_id: "w".into(),
            worker_id: "id".into(),
        };
        assert!(!format!("{h:?}").contains("mk-secret"));
        assert!(MinerFrame::Hello(h).to_text().contains("mk-secret"));
    }
}
