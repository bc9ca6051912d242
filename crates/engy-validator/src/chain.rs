//! The chain client: subxt, DYNAMIC against the node's own metadata (no static codegen that
//! goes stale at the next runtime upgrade). PROTOCOL.md §7 steps 4 and 8.
//!
//! One [`Chain`] is opened per tick and dropped at its end, so a runtime upgrade, a node
//! restart or a dropped websocket never outlives a tick. Reads are pinned to one block.
//!
//! Storage read (pallet `SubtensorModule`, names as in opentensor/subtensor):
//! `SubnetworkN(netuid)`, `Keys(netuid, uid)` (uid → hotkey), `Uids(netuid, hotkey)`,
//! `ValidatorPermit(netuid)`, `LastUpdate(netuid)`, `WeightsSetRateLimit`,
//! `MinAllowedWeights`, `MaxWeightsLimit`, `CommitRevealWeightsEnabled`, `ActivityCutoff`,
//! `WeightsVersionKey`, `NetworksAdded`, `TotalHotkeyAlpha(hotkey, netuid)` and the global
//! `WeightsMinStake`.
//!
//! Submission: `SubtensorModule.set_weights(netuid, dests, weights, version_key)` signed
//! with the wallet hotkey (sr25519, MultiSignature), mortal for [`MORTAL_PERIOD`] blocks
//! from the latest finalized block, waiting for inclusion. Success = included without
//! `System.ExtrinsicFailed`. A transaction-pool rejection ("Invalid Transaction",
//! `Custom(N)` from subtensor's transaction extension) and a dispatch error are both
//! [`SubmitError`]s that carry the runtime's own name.
//!
//! Transaction extensions are chosen from the metadata (subxt `AnyOf`): the standard
//! Substrate ones, subtensor's `ChargeTransactionPaymentWrapper` (a compact tip, here 0),
//! and every data-less extension (`SubtensorSignedExtension`, `SubtensorTransactionExtension`,
//! `CommitmentsSignedExtension`, `DrandPriority`, `SudoTransactionExtension`,
//! `CheckShieldedTxValidity`, …) which encode to nothing. [`unsupported_extensions`] names
//! any extension carrying data this client cannot encode.

use std::time::Duration;

use futures_util::{stream, StreamExt, TryStreamExt};
use subxt::config::transaction_extensions::{self as ext, TransactionExtension};
use subxt::config::{ExtrinsicParams, ExtrinsicParamsEncoder, ExtrinsicParamsError};
use subxt::dynamic::Value;
use subxt::ext::codec::{Compact, Encode};
use subxt::ext::scale_decode::DecodeAsType;
use subxt::utils::{AccountId32, MultiAddress, MultiSignature};
use subxt::OnlineClient;

use crate::commit_reveal::{CommitCall, CommitRevealState, EpochSchedule, DEFAULT_BLOCK_TIME_MS};

/// Mortality period of a `set_weights` extrinsic in blocks (~12.8 min on finney).
pub const MORTAL_PERIOD: u64 = 64;

/// How long to wait for a connection plus metadata download.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(30);

/// How long to wait for one batch of reads.
pub const READ_TIMEOUT: Duration = Duration::from_secs(60);

/// How long to wait for a submitted extrinsic to be included.
pub const INCLUSION_TIMEOUT: Duration = Duration::from_secs(180);

/// subxt configuration for subtensor (node-subtensor): AccountId32, `MultiAddress<_, ()>`,
/// MultiSignature, BLAKE2-256, u32 block numbers.
#[derive(Debug, Clone, Copy)]
pub enum SubtensorConfig {}

impl subxt::Config for SubtensorConfig {
    type AccountId = AccountId32;
    type Address = MultiAddress<AccountId32, ()>;
    type Signature = MultiSignature;
    type Hasher = subxt::config::substrate::BlakeTwo256;
    type Header =
        subxt::config::substrate::SubstrateHeader<u32, subxt::config::substrate::BlakeTwo256>;
    type ExtrinsicParams = SubtensorExtrinsicParams;
    type AssetId = u32;
}

/// The transaction extensions this client knows, picked per chain from the metadata.
pub type SubtensorExtrinsicParams = ext::AnyOf<
    SubtensorConfig,
    (
        ext::VerifySignature<SubtensorConfig>,
        ext::CheckSpecVersion,
        ext::CheckTxVersion,
        ext::CheckNonce,
        ext::CheckGenesis<SubtensorConfig>,
        ext::CheckMortality<SubtensorConfig>,
        ext::ChargeAssetTxPayment<SubtensorConfig>,
        ext::ChargeTransactionPayment,
        ext::CheckMetadataHash,
        ChargeTransactionPaymentWrapper,
    ),
>;

/// Identifiers of the non-empty extensions [`SubtensorExtrinsicParams`] encodes.
const KNOWN_EXTENSIONS: &[&str] = &[
    "VerifySignature",
    "CheckSpecVersion",
    "CheckTxVersion",
    "CheckNonce",
    "CheckGenesis",
    "CheckMortality",
    "ChargeAssetTxPayment",
    "ChargeTransactionPayment",
    "CheckMetadataHash",
];

/// subtensor's `ChargeTransactionPaymentWrapper`: wraps `ChargeTransactionPayment`, so its
/// explicit data is a compact tip (here always 0) and it has no implicit data.
pub struct ChargeTransactionPaymentWrapper {
    tip: Compact<u128>,
}

impl ExtrinsicParams<SubtensorConfig> for ChargeTransactionPaymentWrapper {
    type Params = ();
    fn new(
        _client: &subxt::client::ClientState<SubtensorConfig>,
        _params: (),
    ) -> Result<Self, ExtrinsicParamsError> {
        Ok(Self { tip: Compact(0) })
    }
}

impl ExtrinsicParamsEncoder for ChargeTransactionPaymentWrapper {
    fn encode_value_to(&self, v: &mut Vec<u8>) {
        self.tip.encode_to(v);
    }
}

impl TransactionExtension<SubtensorConfig> for ChargeTransactionPaymentWrapper {
    type Decoded = ();
    fn matches(identifier: &str, type_id: u32, types: &scale_info::PortableRegistry) -> bool {
        identifier == "ChargeTransactionPaymentWrapper" && is_compact_int(type_id, types, 0)
    }
}

/// True when `type_id` is a compact integer, possibly wrapped in single-field composites.
fn is_compact_int(type_id: u32, types: &scale_info::PortableRegistry, depth: u8) -> bool {
    use scale_info::TypeDef;
    if depth > 8 {
        return false;
    }
    match types.resolve(type_id).map(|t| &t.type_def) {
        Some(TypeDef::Compact(_)) => true,
        Some(TypeDef::Composite(c)) => match c.fields.as_slice() {
            [only] => is_compact_int(only.ty.id, types, depth + 1),
            _ => false,
        },
        Some(TypeDef::Tuple(t)) => match t.fields.as_slice() {
            [only] => is_compact_int(only.id, types, depth + 1),
            _ => false,
        },
        _ => false,
    }
}

/// True when values of `type_id` encode to zero bytes.
fn is_empty_type(type_id: u32, types: &scale_info::PortableRegistry) -> bool {
    use scale_info::TypeDef;
    match types.resolve(type_id).map(|t| &t.type_def) {
        Some(TypeDef::Composite(c)) => c.fields.iter().all(|f| is_empty_type(f.ty.id, types)),
        Some(TypeDef::Tuple(t)) => t.fields.iter().all(|f| is_empty_type(f.id, types)),
        Some(TypeDef::Array(a)) => a.len == 0 || is_empty_type(a.type_param.id, types),
        _ => false,
    }
}

/// Names of the runtime's transaction extensions that this client cannot encode (they
/// carry explicit or implicit data and are not in its list). Empty = every `set_weights`
/// this client builds is well-formed for this runtime.
pub fn unsupported_extensions(metadata: &subxt::Metadata) -> Vec<String> {
    let types = metadata.types();
    metadata
        .extrinsic()
        .transaction_extensions_to_use_for_encoding()
        .filter(|e| {
            let id = e.identifier();
            let known = KNOWN_EXTENSIONS.contains(&id)
                || ChargeTransactionPaymentWrapper::matches(id, e.extra_ty(), types)
                    && is_empty_type(e.additional_ty(), types);
            let data_less =
                is_empty_type(e.extra_ty(), types) && is_empty_type(e.additional_ty(), types);
            !(known || data_less)
        })
        .map(|e| e.identifier().to_owned())
        .collect()
}

/// The runtime's transaction extension identifiers, in signing order.
pub fn extension_names(metadata: &subxt::Metadata) -> Vec<String> {
    metadata
        .extrinsic()
        .transaction_extensions_to_use_for_encoding()
        .map(|e| e.identifier().to_owned())
        .collect()
}

/// Signs with an sr25519 key under the Substrate signing context (`substrate`).
pub trait Sr25519Signer: Send + Sync {
    /// The 32-byte public key.
    fn public_key(&self) -> [u8; 32];
    /// A 64-byte sr25519 signature over `message` (context `substrate`).
    fn sign(&self, message: &[u8]) -> [u8; 64];
}

/// Adapts an [`Sr25519Signer`] to subxt's `Signer`.
struct SubxtSigner<'a>(&'a dyn Sr25519Signer);

impl subxt::tx::Signer<SubtensorConfig> for SubxtSigner<'_> {
    fn account_id(&self) -> AccountId32 {
        AccountId32(self.0.public_key())
    }
    fn sign(&self, signer_payload: &[u8]) -> MultiSignature {
        MultiSignature::Sr25519(self.0.sign(signer_payload))
    }
}

/// Errors opening or reading the chain.
#[derive(Debug, thiserror::Error)]
pub enum ChainError {
    /// Connecting or downloading metadata failed; `reason` is the innermost cause, once
    /// (see [`innermost_cause`]).
    #[error("cannot reach the chain at {url}: {reason}")]
    Connect {
        /// The node URL.
        url: String,
        /// What went wrong.
        reason: String,
    },
    /// An operation did not finish in time.
    #[error("{what} timed out after {secs} s")]
    Timeout {
        /// What was being done.
        what: &'static str,
        /// The timeout.
        secs: u64,
    },
    /// A read failed (RPC, decoding, missing storage item).
    #[error("{what}: {reason}")]
    Read {
        /// What was being read.
        what: String,
        /// What went wrong.
        reason: String,
    },
}

/// Why a `set_weights` did not land.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SubmitError {
    /// Included, but the dispatch failed: `System.ExtrinsicFailed` with this module error.
    #[error("{pallet}.{name} (included in block #{block}, ExtrinsicFailed)")]
    Dispatch {
        /// Pallet of the error, e.g. `SubtensorModule`.
        pallet: String,
        /// The error variant, e.g. `SettingWeightsTooFast`.
        name: String,
        /// Inclusion block.
        block: u64,
    },
    /// Included, but the dispatch failed with a non-module error.
    #[error("{0} (ExtrinsicFailed)")]
    DispatchOther(String),
    /// The transaction pool refused it (never in a block): RPC 1010 "Invalid Transaction".
    #[error("pool rejected: Invalid Transaction {}{}", custom.map(|c| format!("Custom({c})")).unwrap_or_else(|| pool_reason(message).map(|(n, m)| format!("{n} ({m})")).unwrap_or_else(|| message.clone())), custom.and_then(custom_hint).map(|h| format!(" ({h})")).unwrap_or_default())]
    Pool {
        /// The `Custom(N)` code, when it is one.
        custom: Option<u8>,
        /// The node's message.
        message: String,
    },
    /// The node dropped or refused it for another reason (usurped, dropped, error status).
    #[error("not included: {0}")]
    NotIncluded(String),
    /// The client cannot build a valid extrinsic for this runtime (e.g. an extension it
    /// cannot encode; reported by name at start-up).
    #[error("cannot build the extrinsic: {0}")]
    Build(String),
    /// The runtime's metadata has no such call (e.g. a pre-CRv4 runtime asked for
    /// `commit_timelocked_weights`).
    #[error("the runtime has no call {pallet}.{call}")]
    MissingCall {
        /// The pallet.
        pallet: String,
        /// The call.
        call: String,
    },
    /// Transport or RPC failure while submitting or watching.
    #[error("chain transport: {0}")]
    Transport(String),
    /// No inclusion within [`INCLUSION_TIMEOUT`].
    #[error("not included within {0} s")]
    Timeout(u64),
}

impl SubmitError {
    /// True when the extrinsic may have landed although no inclusion was seen: the node
    /// closed the status subscription, the wait timed out, or the transport failed after
    /// sending. A caller must read the chain before resubmitting (issue 13 item 4).
    pub fn uncertain(&self) -> bool {
        matches!(
            self,
            SubmitError::NotIncluded(_) | SubmitError::Timeout(_) | SubmitError::Transport(_)
        )
    }

    /// The failure's kind, a word of a small closed set for the `chain_errors_total{kind}`
    /// metric (never the node's free text): `dispatch:<Pallet>.<Error>` (metadata
    /// identifiers), `dispatch-other`, `ancient-birth-block`, `outdated`, `pool-rejected`,
    /// `not-included`, `build`, `missing-call`, `transport`, `timeout`.
    pub fn kind(&self) -> String {
        match self {
            SubmitError::Dispatch { pallet, name, .. } => format!("dispatch:{pallet}.{name}"),
            SubmitError::DispatchOther(_) => "dispatch-other".into(),
            SubmitError::Pool { .. } if self.stale_era_or_nonce() => {
                if pool_text_says(self, &["ancientbirthblock", "ancient birth block"]) {
                    "ancient-birth-block".into()
                } else {
                    "outdated".into()
                }
            }
            SubmitError::Pool { .. } => "pool-rejected".into(),
            SubmitError::NotIncluded(_) => "not-included".into(),
            SubmitError::Build(_) => "build".into(),
            SubmitError::MissingCall { .. } => "missing-call".into(),
            SubmitError::Transport(_) => "transport".into(),
            SubmitError::Timeout(_) => "timeout".into(),
        }
    }

    /// True for a pool rejection of the extrinsic's era or nonce, not of its content: an
    /// ancient birth block (`InvalidTransaction::AncientBirthBlock`, the mortal era's birth
    /// block is unknown to the node) or an outdated transaction (`InvalidTransaction::Stale`,
    /// its nonce was used). Built again with a fresh era and nonce, the same call can land
    /// (issue 21 item 6). Node text: `Transaction has an ancient birth block`,
    /// `Transaction is outdated`; chopsticks: `{"invalid":{"ancientBirthBlock":null}}`,
    /// `{"invalid":{"stale":null}}`.
    pub fn stale_era_or_nonce(&self) -> bool {
        matches!(self, SubmitError::Pool { custom: None, .. })
            && pool_text_says(
                self,
                &[
                    "ancientbirthblock",
                    "ancient birth block",
                    "\"stale\"",
                    "is outdated",
                ],
            )
    }

    /// The runtime's short name for the failure, for tests and `check`
    /// (`SettingWeightsTooFast`, `Custom(6)`, …).
    pub fn name(&self) -> String {
        match self {
            SubmitError::Dispatch { name, .. } => name.clone(),
            SubmitError::Pool {
                custom: Some(c), ..
            } => format!("Custom({c})"),
            SubmitError::Pool { message, .. } => message.clone(),
            other => other.to_string(),
        }
    }
}

/// Substrate's `InvalidTransaction` reasons a pool rejection can carry: (words of the node's
/// text or chopsticks' JSON key, lower case; the variant's name; what it means here).
/// sp-runtime `transaction_validity.rs`.
const INVALID_TRANSACTION: &[(&[&str], &str, &str)] = &[
    (&["ancientbirthblock", "ancient birth block"], "AncientBirthBlock", "the extrinsic's mortal era starts at a block this node does not know (a lagging node, or a long gap between signing and submitting); rebuilt with a fresh era"),
    (&["\"stale\"", "is outdated"], "Stale", "the transaction is outdated: its nonce was already used (another extrinsic of this hotkey landed first); rebuilt with a fresh nonce"),
    (&["\"future\"", "will be valid in the future"], "Future", "its nonce is ahead of the account's"),
    (&["badproof", "bad signature", "invalid signing address"], "BadProof", "the signature does not verify against this runtime (genesis, spec or extension data differ)"),
    (&["\"payment\"", "inability to pay"], "Payment", "the account cannot pay the fee"),
    (&["exhaustsresources", "exhausts the resources"], "ExhaustsResources", "the block is full"),
    (&["\"call\"", "call is not expected"], "Call", "the runtime does not accept this call"),
    (&["badsigner", "bad signer"], "BadSigner", "the signer is not allowed"),
];

/// The `(name, meaning)` of the `InvalidTransaction` reason in a pool rejection's text, so
/// a log line names it instead of printing the node's raw JSON.
pub fn pool_reason(message: &str) -> Option<(&'static str, &'static str)> {
    let lower = message.to_ascii_lowercase();
    INVALID_TRANSACTION
        .iter()
        .find(|(words, _, _)| words.iter().any(|w| lower.contains(w)))
        .map(|(_, name, meaning)| (*name, *meaning))
}

/// True when `e` is a pool rejection whose text contains one of `needles` (lower case).
fn pool_text_says(e: &SubmitError, needles: &[&str]) -> bool {
    match e {
        SubmitError::Pool { message, .. } => {
            let lower = message.to_ascii_lowercase();
            needles.iter().any(|n| lower.contains(n))
        }
        _ => false,
    }
}

impl ChainError {
    /// The failure's kind for the `chain_errors_total{kind}` metric: `unreachable`
    /// (connecting), `timeout`, `read`.
    pub fn kind(&self) -> &'static str {
        match self {
            ChainError::Connect { .. } => "unreachable",
            ChainError::Timeout { .. } => "timeout",
            ChainError::Read { .. } => "read",
        }
    }
}

/// subtensor's `CustomTransactionError` (`common/src/transaction_error.rs`, spec 425): the
/// `Custom(N)` code of a pool rejection, its variant name and what it means for a weights
/// submission. Codes 0–13 and 255 kept their numbers since early 2025; 14–27 were added
/// later (14 `ZeroMaxAmount`, 15 `InvalidRevealRound`, 19 `UidNotFound`, …).
pub const CUSTOM_TRANSACTION_ERRORS: &[(u8, &str, &str)] = &[
    (0, "ColdkeyInSwapSchedule", "the coldkey is scheduled for a swap (deprecated code)"),
    (1, "StakeAmountTooLow", "stake amount below the minimum; on mid-2025 runtimes (spec 293): stake below StakeThreshold / WeightsMinStake"),
    (2, "BalanceTooLow", "the account balance is below what the call needs"),
    (3, "SubnetNotExists", "the netuid does not exist; on early-2025 runtimes (spec 218): stake below WeightsMinStake"),
    (4, "HotkeyAccountDoesntExist", "the hotkey account does not exist on chain"),
    (5, "NotEnoughStakeToWithdraw", "not enough stake to withdraw"),
    (6, "RateLimitExceeded", "rate limited; resubmitted once the chain's rate limit has passed (LastUpdate + WeightsSetRateLimit)"),
    (7, "InsufficientLiquidity", "the subnet pool lacks liquidity"),
    (8, "SlippageTooHigh", "price slippage above the limit"),
    (9, "TransferDisallowed", "transfers are disallowed on this subnet"),
    (10, "HotKeyNotRegisteredInNetwork", "the hotkey is not registered on this netuid; register it (btcli subnets register)"),
    (11, "InvalidIpAddress", "invalid axon IP address"),
    (12, "ServingRateLimitExceeded", "axon serving rate limit"),
    (13, "InvalidPort", "invalid axon port"),
    (14, "ZeroMaxAmount", "a zero max amount"),
    (15, "InvalidRevealRound", "the commit's drand reveal round is older than Drand.LastStoredRound; the next commit picks a later round"),
    (16, "CommitNotFound", "no matching commit to reveal"),
    (17, "CommitBlockNotInRevealRange", "the reveal is outside the commit's reveal window"),
    (18, "InputLengthsUnequal", "uids and values differ in length"),
    (19, "UidNotFound", "the hotkey has no uid on this netuid"),
    (20, "EvmKeyAssociateRateLimitExceeded", "EVM key association rate limit"),
    (21, "ColdkeySwapDisputed", "the coldkey swap is disputed"),
    (22, "InvalidRealAccount", "invalid proxied (real) account"),
    (23, "FailedShieldedTxParsing", "a shielded transaction could not be parsed"),
    (24, "InvalidShieldedTxPubKeyHash", "a shielded transaction names an unknown key"),
    (25, "NonAssociatedColdKey", "the coldkey is not associated with the hotkey"),
    (26, "DelegateTakeTooLow", "delegate take below the minimum"),
    (27, "DelegateTakeTooHigh", "delegate take above the maximum"),
    (255, "BadRequest", "malformed request"),
];

/// The `CustomTransactionError` variant name of pool code `code` (see
/// [`CUSTOM_TRANSACTION_ERRORS`]), `None` for a code subtensor does not define.
pub fn custom_error_name(code: u8) -> Option<&'static str> {
    CUSTOM_TRANSACTION_ERRORS
        .iter()
        .find(|(c, _, _)| *c == code)
        .map(|(_, name, _)| *name)
}

/// What pool code `code` means for a weights submission: `"Name: meaning"` from
/// [`CUSTOM_TRANSACTION_ERRORS`], `None` for an unknown code.
pub fn custom_hint(code: u8) -> Option<String> {
    CUSTOM_TRANSACTION_ERRORS
        .iter()
        .find(|(c, _, _)| *c == code)
        .map(|(_, name, meaning)| format!("{name}: {meaning}"))
}

/// Parses an RPC error text for a pool rejection: real nodes say
/// `1010: Invalid Transaction: Custom error: 6`, chopsticks says
/// `1010: {"invalid":{"custom":6}}`.
pub fn parse_pool_rejection(text: &str) -> Option<SubmitError> {
    let lower = text.to_ascii_lowercase();
    let pool = lower.contains("1010")
        || lower.contains("invalid transaction")
        || lower.contains("\"invalid\"");
    if !pool {
        return None;
    }
    let number_after = |pat: &str| -> Option<u8> {
        let at = lower.find(pat)? + pat.len();
        let digits: String = lower
            .get(at..)?
            .chars()
            .skip_while(|c| c.is_whitespace())
            .take_while(char::is_ascii_digit)
            .collect();
        digits.parse().ok()
    };
    let custom = number_after("custom error:").or_else(|| number_after("\"custom\":"));
    Some(SubmitError::Pool {
        custom,
        message: text.trim().to_owned(),
    })
}

/// The subnet hyperparameters that decide whether a vector can land.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Hyperparams {
    /// `WeightsSetRateLimit`: blocks between accepted `set_weights`.
    pub weights_rate_limit: u64,
    /// `MinAllowedWeights`: minimum number of dests.
    pub min_allowed_weights: u16,
    /// `MaxWeightsLimit`: maximum single weight after max-upscaling (u16 scale).
    pub max_weight_limit: u16,
    /// `CommitRevealWeightsEnabled`: plain `set_weights` is refused when true.
    pub commit_reveal_weights_enabled: bool,
    /// `ActivityCutoff`: blocks after which a silent validator leaves consensus.
    pub activity_cutoff: u16,
    /// `WeightsVersionKey`: the minimum `version_key` accepted.
    pub weights_version_key: u64,
    /// Global `WeightsMinStake` (rao), 0 when the runtime has none.
    pub weights_min_stake: u64,
}

/// The validator's own neuron on the netuid.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Neuron {
    /// Its uid.
    pub uid: u16,
    /// `ValidatorPermit[uid]`.
    pub validator_permit: bool,
    /// `LastUpdate[uid]`: block of its last accepted weights (or registration).
    pub last_update: u64,
    /// Stake on the netuid in rao (`TotalHotkeyAlpha`), when the runtime has it.
    pub stake: Option<u64>,
}

/// Where a successful extrinsic landed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Inclusion {
    /// Inclusion block number.
    pub block: u64,
    /// Inclusion block hash, 0x-hex.
    pub block_hash: String,
}

/// A connection to a subtensor node, with the metadata it served.
pub struct Chain {
    api: OnlineClient<SubtensorConfig>,
    url: String,
}

async fn within<F, T, E>(what: &'static str, limit: Duration, f: F) -> Result<T, ChainError>
where
    F: std::future::Future<Output = Result<T, E>>,
    E: std::fmt::Display,
{
    match tokio::time::timeout(limit, f).await {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(e)) => Err(ChainError::Read {
            what: what.to_owned(),
            reason: strip_layer_prefixes(&e.to_string()).to_owned(),
        }),
        Err(_) => Err(ChainError::Timeout {
            what,
            secs: limit.as_secs(),
        }),
    }
}

fn read_err(what: impl Into<String>) -> impl FnOnce(subxt::Error) -> ChainError {
    let what = what.into();
    move |e| ChainError::Read {
        what,
        reason: strip_layer_prefixes(&e.to_string()).to_owned(),
    }
}

/// The innermost cause of `e`, once: the deepest `source()` in its chain, with the layer
/// prefixes subxt and jsonrpsee repeat at each level ("RPC error: ", "client error: ", …)
/// stripped. A connection refused reads "Connection refused (os error 111)" instead of
/// "RPC error: RPC error: client error: RPC error: client error: …".
pub fn innermost_cause(e: &(dyn std::error::Error + 'static)) -> String {
    let mut last = e;
    while let Some(next) = last.source() {
        last = next;
    }
    strip_layer_prefixes(&last.to_string()).to_owned()
}

/// `text` without any leading run of the layer prefixes named in [`innermost_cause`].
fn strip_layer_prefixes(text: &str) -> &str {
    const PREFIXES: &[&str] = &[
        "RPC error: ",
        "Rpc error: ",
        "client error: ",
        "Client error: ",
        "Networking or low-level protocol error: ",
        "Transport error: ",
        "Error when opening the TCP socket: ",
    ];
    let mut rest = text.trim();
    while let Some(next) = PREFIXES.iter().find_map(|p| rest.strip_prefix(p)) {
        rest = next.trim_start();
    }
    if rest.is_empty() {
        text.trim()
    } else {
        rest
    }
}

impl Chain {
    /// Connects to `url` (ws:// or wss://) and downloads the node's metadata.
    pub async fn connect(url: &str) -> Result<Chain, ChainError> {
        let fut = OnlineClient::<SubtensorConfig>::from_insecure_url(url);
        match tokio::time::timeout(CONNECT_TIMEOUT, fut).await {
            Ok(Ok(api)) => Ok(Chain {
                api,
                url: url.to_owned(),
            }),
            Ok(Err(e)) => Err(ChainError::Connect {
                url: url.to_owned(),
                reason: innermost_cause(&e),
            }),
            Err(_) => Err(ChainError::Timeout {
                what: "connect",
                secs: CONNECT_TIMEOUT.as_secs(),
            }),
        }
    }

    /// The node URL.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// The runtime metadata the node served.
    pub fn metadata(&self) -> subxt::Metadata {
        self.api.metadata()
    }

    /// `(spec_version, transaction_version)` of the runtime.
    pub fn runtime_version(&self) -> (u32, u32) {
        let v = self.api.runtime_version();
        (v.spec_version, v.transaction_version)
    }

    /// The underlying subxt client (tests use it for sudo calls and raw reads).
    pub fn client(&self) -> &OnlineClient<SubtensorConfig> {
        &self.api
    }

    /// The latest finalized block number (positive), via the node's head.
    pub async fn block_number(&self) -> Result<u64, ChainError> {
        let block = within("latest block", READ_TIMEOUT, self.api.blocks().at_latest()).await?;
        Ok(u64::from(block.number()))
    }

    async fn fetch_value<T: DecodeAsType>(
        storage: &subxt::storage::Storage<SubtensorConfig, OnlineClient<SubtensorConfig>>,
        entry: &'static str,
        keys: Vec<Value>,
    ) -> Result<T, ChainError> {
        let addr = subxt::dynamic::storage("SubtensorModule", entry, keys);
        let thunk = storage
            .fetch_or_default(&addr)
            .await
            .map_err(read_err(format!("SubtensorModule.{entry}")))?;
        thunk.as_type::<T>().map_err(|e| ChainError::Read {
            what: format!("SubtensorModule.{entry}"),
            reason: e.to_string(),
        })
    }

    async fn storage_at_latest(
        &self,
    ) -> Result<subxt::storage::Storage<SubtensorConfig, OnlineClient<SubtensorConfig>>, ChainError>
    {
        within("latest block", READ_TIMEOUT, self.api.storage().at_latest()).await
    }

    fn has_entry(&self, entry: &str) -> bool {
        self.api
            .metadata()
            .pallet_by_name("SubtensorModule")
            .and_then(|p| p.storage())
            .and_then(|s| s.entry_by_name(entry))
            .is_some()
    }

    /// True when the netuid exists (`NetworksAdded`).
    pub async fn subnet_exists(&self, netuid: u16) -> Result<bool, ChainError> {
        let s = self.storage_at_latest().await?;
        Self::fetch_value::<bool>(&s, "NetworksAdded", vec![Value::u128(netuid.into())]).await
    }

    /// The metagraph hotkeys of `netuid` in uid order (`metagraph[uid]` = SS58, prefix 42).
    pub async fn metagraph(&self, netuid: u16) -> Result<Vec<String>, ChainError> {
        let s = self.storage_at_latest().await?;
        let n = tokio::time::timeout(
            READ_TIMEOUT,
            Self::fetch_value::<u16>(&s, "SubnetworkN", vec![Value::u128(netuid.into())]),
        )
        .await
        .map_err(|_| ChainError::Timeout {
            what: "SubnetworkN",
            secs: READ_TIMEOUT.as_secs(),
        })??;
        let reads = stream::iter(0..n)
            .map(|uid| {
                let s = s.clone();
                async move {
                    let keys = vec![Value::u128(netuid.into()), Value::u128(uid.into())];
                    Self::fetch_value::<AccountId32>(&s, "Keys", keys)
                        .await
                        .map(|a| a.to_string())
                }
            })
            .buffered(32)
            .try_collect::<Vec<String>>();
        tokio::time::timeout(READ_TIMEOUT, reads)
            .await
            .map_err(|_| ChainError::Timeout {
                what: "metagraph Keys",
                secs: READ_TIMEOUT.as_secs(),
            })?
    }

    /// The subnet hyperparameters of `netuid`.
    pub async fn hyperparams(&self, netuid: u16) -> Result<Hyperparams, ChainError> {
        let s = self.storage_at_latest().await?;
        let k = || vec![Value::u128(netuid.into())];
        let min_stake = if self.has_entry("WeightsMinStake") {
            Self::fetch_value::<u64>(&s, "WeightsMinStake", vec![]).await?
        } else {
            0
        };
        Ok(Hyperparams {
            weights_rate_limit: Self::fetch_value(&s, "WeightsSetRateLimit", k()).await?,
            min_allowed_weights: Self::fetch_value(&s, "MinAllowedWeights", k()).await?,
            max_weight_limit: Self::fetch_value(&s, "MaxWeightsLimit", k()).await?,
            commit_reveal_weights_enabled: Self::fetch_value(&s, "CommitRevealWeightsEnabled", k())
                .await?,
            activity_cutoff: Self::fetch_value(&s, "ActivityCutoff", k()).await?,
            weights_version_key: Self::fetch_value(&s, "WeightsVersionKey", k()).await?,
            weights_min_stake: min_stake,
        })
    }

    /// The neuron of `hotkey` (32-byte public key) on `netuid`, or `None` when it is not
    /// registered there.
    pub async fn neuron(
        &self,
        netuid: u16,
        hotkey: [u8; 32],
    ) -> Result<Option<Neuron>, ChainError> {
        let s = self.storage_at_latest().await?;
        let addr = subxt::dynamic::storage(
            "SubtensorModule",
            "Uids",
            vec![Value::u128(netuid.into()), Value::from_bytes(hotkey)],
        );
        let Some(thunk) = s
            .fetch(&addr)
            .await
            .map_err(read_err("SubtensorModule.Uids"))?
        else {
            return Ok(None);
        };
        let uid: u16 = thunk.as_type().map_err(|e| ChainError::Read {
            what: "SubtensorModule.Uids".into(),
            reason: e.to_string(),
        })?;
        let k = || vec![Value::u128(netuid.into())];
        let permits: Vec<bool> = Self::fetch_value(&s, "ValidatorPermit", k()).await?;
        let last: Vec<u64> = Self::fetch_value(&s, "LastUpdate", k()).await?;
        let stake = if self.has_entry("TotalHotkeyAlpha") {
            Some(
                Self::fetch_value::<u64>(
                    &s,
                    "TotalHotkeyAlpha",
                    vec![Value::from_bytes(hotkey), Value::u128(netuid.into())],
                )
                .await?,
            )
        } else {
            None
        };
        Ok(Some(Neuron {
            uid,
            validator_permit: permits.get(usize::from(uid)).copied().unwrap_or(false),
            last_update: last.get(usize::from(uid)).copied().unwrap_or(0),
            stake,
        }))
    }

    /// `Weights(netuid, uid)` as stored (max-upscaled by the runtime): `(dest uid, weight)`.
    pub async fn weights(&self, netuid: u16, uid: u16) -> Result<Vec<(u16, u16)>, ChainError> {
        let s = self.storage_at_latest().await?;
        Self::fetch_value(
            &s,
            "Weights",
            vec![Value::u128(netuid.into()), Value::u128(uid.into())],
        )
        .await
    }

    /// Signs, submits and waits for inclusion of any dynamic call (also used by tests for
    /// sudo calls). Success = included without `System.ExtrinsicFailed`.
    pub async fn submit(
        &self,
        call: &subxt::tx::DynamicPayload,
        signer: &dyn Sr25519Signer,
    ) -> Result<Inclusion, SubmitError> {
        let signer = SubxtSigner(signer);
        let params = tx_params(
            ext::CheckNonceParams::from_chain(),
            ext::CheckMortalityParams::mortal(MORTAL_PERIOD),
        );
        let run = async {
            let mut tx_client = self.api.tx();
            let tx = tx_client
                .create_signed(call, &signer, params)
                .await
                .map_err(classify)?;
            let mut progress = tx.submit_and_watch().await.map_err(classify)?;
            while let Some(status) = progress.next().await {
                use subxt::tx::TxStatus;
                match status.map_err(classify)? {
                    TxStatus::InBestBlock(in_block) | TxStatus::InFinalizedBlock(in_block) => {
                        let hash = in_block.block_hash();
                        let block = self
                            .api
                            .blocks()
                            .at(hash)
                            .await
                            .map(|b| u64::from(b.number()))
                            .unwrap_or(0);
                        return match in_block.wait_for_success().await {
                            Ok(_) => Ok(Inclusion {
                                block,
                                block_hash: format!("0x{}", hex::encode(hash.0)),
                            }),
                            Err(subxt::Error::Runtime(subxt::error::DispatchError::Module(m))) => {
                                Err(match m.details() {
                                    Ok(d) => SubmitError::Dispatch {
                                        pallet: d.pallet.name().to_owned(),
                                        name: d.variant.name.clone(),
                                        block,
                                    },
                                    Err(_) => SubmitError::DispatchOther(m.to_string()),
                                })
                            }
                            Err(subxt::Error::Runtime(e)) => {
                                Err(SubmitError::DispatchOther(e.to_string()))
                            }
                            Err(e) => Err(SubmitError::Transport(
                                strip_layer_prefixes(&e.to_string()).to_owned(),
                            )),
                        };
                    }
                    TxStatus::Invalid { message } => {
                        return Err(parse_pool_rejection(&message)
                            .unwrap_or(SubmitError::NotIncluded(format!("invalid: {message}"))))
                    }
                    TxStatus::Dropped { message } => {
                        return Err(SubmitError::NotIncluded(format!("dropped: {message}")))
                    }
                    TxStatus::Error { message } => {
                        return Err(parse_pool_rejection(&message)
                            .unwrap_or(SubmitError::NotIncluded(format!("error: {message}"))))
                    }
                    TxStatus::Validated | TxStatus::Broadcasted | TxStatus::NoLongerInBestBlock => {
                    }
                }
            }
            Err(SubmitError::NotIncluded(
                "the node closed the status subscription before inclusion (node stopped or restarted?); the extrinsic may still land".into(),
            ))
        };
        match tokio::time::timeout(INCLUSION_TIMEOUT, run).await {
            Ok(r) => r,
            Err(_) => Err(SubmitError::Timeout(INCLUSION_TIMEOUT.as_secs())),
        }
    }

    /// `SubtensorModule.set_weights(netuid, dests, weights, version_key)` (PROTOCOL.md §7
    /// step 8), signed by `signer`, waiting for inclusion.
    pub async fn set_weights(
        &self,
        netuid: u16,
        dests: &[u16],
        weights: &[u16],
        version_key: u64,
        signer: &dyn Sr25519Signer,
    ) -> Result<Inclusion, SubmitError> {
        let call = set_weights_call(netuid, dests, weights, version_key);
        self.submit(&call, signer).await
    }

    /// The timelocked commit (`commit_timelocked_mechanism_weights` with mechanism 0, or
    /// `commit_timelocked_weights`, see [`CommitCall`]) of the tlock ciphertext `commit`
    /// locked to drand round `reveal_round`, signed by `signer`, waiting for inclusion.
    /// A call the runtime lacks is [`SubmitError::MissingCall`].
    pub async fn commit_timelocked(
        &self,
        call: CommitCall,
        netuid: u16,
        commit: &[u8],
        reveal_round: u64,
        version: u16,
        signer: &dyn Sr25519Signer,
    ) -> Result<Inclusion, SubmitError> {
        let metadata = self.api.metadata();
        ensure_call(&metadata, "SubtensorModule", call.name())?;
        let payload = commit_call(call, netuid, commit, reveal_round, version);
        self.submit(&payload, signer).await
    }

    /// The commit-reveal state of `netuid` at the latest block (see
    /// [`crate::commit_reveal`]): `CommitRevealWeightsEnabled`, `CommitRevealWeightsVersion`,
    /// `Tempo`, `RevealPeriodEpochs`, `Drand.LastStoredRound`, and, when the runtime has
    /// them, `LastEpochBlock`, `PendingEpochAt`, `SubnetEpochIndex`, `BlocksSinceLastStep`.
    pub async fn commit_reveal_state(&self, netuid: u16) -> Result<CommitRevealState, ChainError> {
        let block = self.block_number().await?;
        let s = self.storage_at_latest().await?;
        let k = || vec![Value::u128(netuid.into())];
        let metadata = self.api.metadata();
        let version = if self.has_entry("CommitRevealWeightsVersion") {
            Some(Self::fetch_value::<u16>(&s, "CommitRevealWeightsVersion", vec![]).await?)
        } else {
            None
        };
        let reveal_period_epochs = if self.has_entry("RevealPeriodEpochs") {
            Self::fetch_value::<u64>(&s, "RevealPeriodEpochs", k()).await?
        } else {
            1
        };
        let last_stored_round = if has_storage(&metadata, "Drand", "LastStoredRound") {
            Some(fetch_in::<u64>(&s, "Drand", "LastStoredRound", vec![]).await?)
        } else {
            None
        };
        let schedule = if self.has_entry("LastEpochBlock") && self.has_entry("SubnetEpochIndex") {
            let pending = if self.has_entry("PendingEpochAt") {
                Self::fetch_value::<u64>(&s, "PendingEpochAt", k()).await?
            } else {
                0
            };
            let since = if self.has_entry("BlocksSinceLastStep") {
                Self::fetch_value::<u64>(&s, "BlocksSinceLastStep", k()).await?
            } else {
                0
            };
            Some(EpochSchedule {
                last_epoch_block: Self::fetch_value(&s, "LastEpochBlock", k()).await?,
                pending_epoch_at: pending,
                subnet_epoch_index: Self::fetch_value(&s, "SubnetEpochIndex", k()).await?,
                blocks_since_last_step: since,
            })
        } else {
            None
        };
        Ok(CommitRevealState {
            netuid,
            block,
            enabled: Self::fetch_value(&s, "CommitRevealWeightsEnabled", k()).await?,
            version,
            tempo: Self::fetch_value(&s, "Tempo", k()).await?,
            reveal_period_epochs,
            last_stored_round,
            schedule,
            commit_call: commit_call_in(&metadata),
            block_time_ms: block_time_ms(&metadata),
        })
    }

    /// This validator's queued timelocked commits on `netuid` (mechanism 0):
    /// `(epoch key, commit block, reveal round)` of each entry of
    /// `TimelockedWeightCommits(netuid, epoch)` whose account is `hotkey`, for `epochs`.
    /// Empty on runtimes without the item.
    pub async fn queued_commits(
        &self,
        netuid: u16,
        hotkey: [u8; 32],
        epochs: &[u64],
    ) -> Result<Vec<(u64, u64, u64)>, ChainError> {
        if !self.has_entry("TimelockedWeightCommits") {
            return Ok(Vec::new());
        }
        let s = self.storage_at_latest().await?;
        let mut out = Vec::new();
        for &epoch in epochs {
            let queue: Vec<(AccountId32, u64, Vec<u8>, u64)> = Self::fetch_value(
                &s,
                "TimelockedWeightCommits",
                vec![Value::u128(netuid.into()), Value::u128(epoch.into())],
            )
            .await?;
            out.extend(
                queue
                    .into_iter()
                    .filter(|(who, ..)| who.0 == hotkey)
                    .map(|(_, block, _, round)| (epoch, block, round)),
            );
        }
        Ok(out)
    }
}

/// The transaction-extension params: nonce and mortality as given, no tip, data-less rest.
fn tx_params(
    nonce: ext::CheckNonceParams,
    mortality: ext::CheckMortalityParams<SubtensorConfig>,
) -> <SubtensorExtrinsicParams as ExtrinsicParams<SubtensorConfig>>::Params {
    (
        (),
        (),
        (),
        nonce,
        (),
        mortality,
        ext::ChargeAssetTxPaymentParams::no_tip(),
        ext::ChargeTransactionPaymentParams::no_tip(),
        (),
        (),
    )
}

/// `Err(MissingCall)` unless `pallet.call` is in `metadata`.
pub fn ensure_call(
    metadata: &subxt::Metadata,
    pallet: &str,
    call: &str,
) -> Result<(), SubmitError> {
    let found = metadata
        .pallet_by_name(pallet)
        .and_then(|p| p.call_variant_by_name(call))
        .is_some();
    if found {
        Ok(())
    } else {
        Err(SubmitError::MissingCall {
            pallet: pallet.to_owned(),
            call: call.to_owned(),
        })
    }
}

/// The timelocked commit call `metadata` has (mechanism form preferred), if any.
pub fn commit_call_in(metadata: &subxt::Metadata) -> Option<CommitCall> {
    CommitCall::pick(|name| ensure_call(metadata, "SubtensorModule", name).is_ok())
}

fn has_storage(metadata: &subxt::Metadata, pallet: &str, entry: &str) -> bool {
    metadata
        .pallet_by_name(pallet)
        .and_then(|p| p.storage())
        .and_then(|s| s.entry_by_name(entry))
        .is_some()
}

/// Block time from the metadata: `2 × Timestamp.MinimumPeriod` (ms), else
/// [`DEFAULT_BLOCK_TIME_MS`].
pub fn block_time_ms(metadata: &subxt::Metadata) -> u64 {
    use subxt::ext::codec::Decode;
    metadata
        .pallet_by_name("Timestamp")
        .and_then(|p| p.constant_by_name("MinimumPeriod"))
        .and_then(|c| u64::decode(&mut c.value()).ok())
        .map(|p| p.saturating_mul(2))
        .filter(|ms| *ms > 0)
        .unwrap_or(DEFAULT_BLOCK_TIME_MS)
}

async fn fetch_in<T: DecodeAsType>(
    storage: &subxt::storage::Storage<SubtensorConfig, OnlineClient<SubtensorConfig>>,
    pallet: &'static str,
    entry: &'static str,
    keys: Vec<Value>,
) -> Result<T, ChainError> {
    let addr = subxt::dynamic::storage(pallet, entry, keys);
    let thunk = storage
        .fetch_or_default(&addr)
        .await
        .map_err(read_err(format!("{pallet}.{entry}")))?;
    thunk.as_type::<T>().map_err(|e| ChainError::Read {
        what: format!("{pallet}.{entry}"),
        reason: e.to_string(),
    })
}

/// The dynamic timelocked commit call (mechanism 0 for the mechanism form).
pub fn commit_call(
    call: CommitCall,
    netuid: u16,
    commit: &[u8],
    reveal_round: u64,
    version: u16,
) -> subxt::tx::DynamicPayload {
    let mut fields = vec![Value::u128(netuid.into())];
    if call == CommitCall::TimelockedMechanismWeights {
        fields.push(Value::u128(0));
    }
    fields.extend([
        Value::from_bytes(commit),
        Value::u128(reveal_round.into()),
        Value::u128(version.into()),
    ]);
    subxt::dynamic::tx("SubtensorModule", call.name(), fields)
}

/// A signed extrinsic built offline against `metadata` (no node): `call` signed by
/// `signer` with `nonce`, mortal for [`MORTAL_PERIOD`] blocks from block `from` (number,
/// hash), for a chain with `genesis` hash and `(spec, tx)` versions. Returns the encoded
/// extrinsic (with its length prefix). A call the metadata lacks is
/// [`SubmitError::MissingCall`]; an extension this client cannot encode is
/// [`SubmitError::Build`].
#[allow(clippy::too_many_arguments)]
pub fn build_signed_offline(
    metadata: subxt::Metadata,
    genesis: [u8; 32],
    versions: (u32, u32),
    call: &subxt::tx::DynamicPayload,
    signer: &dyn Sr25519Signer,
    nonce: u64,
    from: (u64, [u8; 32]),
) -> Result<Vec<u8>, SubmitError> {
    ensure_call(&metadata, call.pallet_name(), call.call_name())?;
    let unsupported = unsupported_extensions(&metadata);
    if !unsupported.is_empty() {
        return Err(SubmitError::Build(format!(
            "transaction extension(s) {} cannot be encoded",
            unsupported.join(", ")
        )));
    }
    let client = subxt::OfflineClient::<SubtensorConfig>::new(
        subxt::utils::H256(genesis),
        subxt::client::RuntimeVersion {
            spec_version: versions.0,
            transaction_version: versions.1,
        },
        metadata,
    );
    let params = tx_params(
        ext::CheckNonceParams::with_nonce(nonce),
        ext::CheckMortalityParams::mortal_from_unchecked(
            MORTAL_PERIOD,
            from.0,
            subxt::utils::H256(from.1),
        ),
    );
    let mut partial = client
        .tx()
        .create_partial_offline(call, params)
        .map_err(classify)?;
    Ok(partial.sign(&SubxtSigner(signer)).into_encoded())
}

/// The dynamic `SubtensorModule.set_weights` call.
pub fn set_weights_call(
    netuid: u16,
    dests: &[u16],
    weights: &[u16],
    version_key: u64,
) -> subxt::tx::DynamicPayload {
    subxt::dynamic::tx(
        "SubtensorModule",
        "set_weights",
        vec![
            Value::u128(netuid.into()),
            Value::unnamed_composite(dests.iter().map(|d| Value::u128((*d).into()))),
            Value::unnamed_composite(weights.iter().map(|w| Value::u128((*w).into()))),
            Value::u128(version_key.into()),
        ],
    )
}

/// Maps a subxt error during build/submit to a [`SubmitError`].
fn classify(e: subxt::Error) -> SubmitError {
    match &e {
        subxt::Error::Extrinsic(p) => SubmitError::Build(p.to_string()),
        subxt::Error::Encode(p) => SubmitError::Build(p.to_string()),
        subxt::Error::Metadata(m) => SubmitError::Build(m.to_string()),
        subxt::Error::Transaction(subxt::error::TransactionError::Invalid(m)) => {
            parse_pool_rejection(m).unwrap_or_else(|| SubmitError::NotIncluded(m.clone()))
        }
        // a node's JSON-RPC error: subxt prints only `message (code)`, but the reason of a
        // pool rejection (`Transaction has an ancient birth block`, `Custom error: 6`) is
        // in its `data`
        subxt::Error::Rpc(subxt::error::RpcError::ClientError(
            subxt::ext::subxt_rpcs::Error::User(u),
        )) => {
            let data = u
                .data
                .as_ref()
                .map(|d| format!(": {}", d.get().trim_matches('"')))
                .unwrap_or_default();
            let text = format!("{}: {}{data}", u.code, u.message);
            parse_pool_rejection(&text).unwrap_or(SubmitError::Transport(text))
        }
        _ => {
            // subxt repeats its layer prefix ("RPC error: RPC error: client error: …")
            let text = strip_layer_prefixes(&e.to_string()).to_owned();
            parse_pool_rejection(&text).unwrap_or(SubmitError::Transport(text))
        }
    }
}

/// Maps a module error name of `set_weights` to the operator's fix (for logs and `check`).
pub fn dispatch_hint(name: &str) -> Option<&'static str> {
    Some(match name {
        "CommitRevealEnabled" => "commit-reveal is enabled on this subnet; plain set_weights is refused (the next tick commits timelocked instead)",
        "CommitRevealDisabled" => "commit-reveal was switched off on this subnet; the next tick uses plain set_weights",
        "IncorrectCommitRevealVersion" => "the chain expects another commit-reveal version than this validator builds (4); upgrade engy-validator",
        "CommittingWeightsTooFast" => "inside weights_rate_limit since the last commit; resubmitted once it has passed (LastUpdate + WeightsSetRateLimit)",
        "TooManyUnrevealedCommits" => "10 commits of this hotkey are already waiting for reveal in this epoch",
        "InvalidRevealRound" => "the reveal round is older than Drand.LastStoredRound; check the host clock (NTP)",
        "SettingWeightsTooFast" => "inside weights_rate_limit since the last accepted set_weights; resubmitted once it has passed (LastUpdate + WeightsSetRateLimit)",
        "NeuronNoValidatorPermit" | "NoValidatorPermit" => "the hotkey holds no validator permit on this subnet; add stake until it ranks among max_allowed_validators",
        "HotKeyNotRegisteredInSubNet" => "the wallet hotkey is not registered on this netuid; register it (btcli subnets register)",
        "IncorrectWeightVersionKey" => "the subnet's weights_version_key is above the version_key this validator sends (0)",
        "NotEnoughStakeToSetWeights" => "stake is below the chain's WeightsMinStake",
        "WeightVecLengthIsLow" => "fewer dests than min_allowed_weights",
        "MaxWeightExceeded" => "one weight exceeds max_weight_limit after normalisation",
        "UidVecContainInvalidOne" => "a dest uid is not on the subnet (metagraph changed between read and inclusion)",
        "DuplicateUids" => "duplicate dest uids",
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn connect_error_names_the_url_and_the_cause_once() {
        // A port nothing listens on, held so that nothing can (engy_devnet::ports).
        let closed = engy_devnet::ports::ReservedPort::new().unwrap();
        let url = format!("ws://{}", closed.addr());
        let Err(e) = Chain::connect(&url).await else {
            panic!("connected to a closed port");
        };
        let text = e.to_string();
        assert!(
            text.starts_with(&format!("cannot reach the chain at {url}: ")),
            "{text}"
        );
        assert!(!text.contains("RPC error"), "{text}");
        assert!(!text.contains("client error"), "{text}");
        assert!(text.to_lowercase().contains("refused"), "{text}");
    }

    #[test]
    fn layer_prefixes_are_stripped() {
        assert_eq!(
            strip_layer_prefixes(
                "RPC error: RPC error: client error: RPC error: client error: Connection refused"
            ),
            "Connection refused"
        );
        assert_eq!(strip_layer_prefixes("RPC error: "), "RPC error:");
        assert_eq!(strip_layer_prefixes("plain"), "plain");
    }

    /// A read or submit that fails in the RPC layer (node gone mid-tick) names the cause
    /// once: subxt's own text is "RPC error: RPC error: client error: …".
    #[test]
    fn read_and_submit_errors_do_not_repeat_the_rpc_prefix() {
        let rpc = || {
            subxt::Error::Rpc(subxt::error::RpcError::ClientError(
                subxt::ext::subxt_rpcs::Error::Client(Box::new(std::io::Error::new(
                    std::io::ErrorKind::ConnectionReset,
                    "Connection reset by peer",
                ))),
            ))
        };
        assert!(rpc().to_string().starts_with("RPC error: RPC error: "));
        let read = read_err("SubtensorModule.Keys")(rpc()).to_string();
        assert_eq!(read, "SubtensorModule.Keys: Connection reset by peer");
        let submit = classify(rpc()).to_string();
        assert_eq!(submit, "chain transport: Connection reset by peer");
    }

    /// subtensor's `ChargeTransactionPaymentWrapper` shape: a composite around a compact tip.
    struct WrapperLike;
    impl scale_info::TypeInfo for WrapperLike {
        type Identity = Self;
        fn type_info() -> scale_info::Type {
            scale_info::Type::builder()
                .path(scale_info::Path::new(
                    "ChargeTransactionPaymentWrapper",
                    "t",
                ))
                .composite(scale_info::build::Fields::unnamed().field(|f| f.compact::<u128>()))
        }
    }

    fn registry_with<T: scale_info::TypeInfo + 'static>() -> (scale_info::PortableRegistry, u32) {
        let mut reg = scale_info::Registry::new();
        let id = reg.register_type(&scale_info::meta_type::<T>()).id;
        (reg.into(), id)
    }

    #[test]
    fn extension_type_shapes() {
        let (types, id) = registry_with::<WrapperLike>();
        assert!(is_compact_int(id, &types, 0));
        assert!(!is_empty_type(id, &types));
        assert!(ChargeTransactionPaymentWrapper::matches(
            "ChargeTransactionPaymentWrapper",
            id,
            &types
        ));
        assert!(!ChargeTransactionPaymentWrapper::matches(
            "ChargeTransactionPayment",
            id,
            &types
        ));
        let (types, id) = registry_with::<()>();
        assert!(is_empty_type(id, &types));
        assert!(!ChargeTransactionPaymentWrapper::matches(
            "ChargeTransactionPaymentWrapper",
            id,
            &types
        ));
        let (types, id) = registry_with::<std::marker::PhantomData<u64>>();
        assert!(
            is_empty_type(id, &types),
            "data-less extensions (DrandPriority, …) encode to nothing"
        );
        let (types, id) = registry_with::<(u32, ())>();
        assert!(!is_empty_type(id, &types) && !is_compact_int(id, &types, 0));
        let (types, id) = registry_with::<[u8; 0]>();
        assert!(is_empty_type(id, &types));
        // the wrapper's explicit data is the compact tip (0 → one zero byte), no implicit data
        let w = ChargeTransactionPaymentWrapper { tip: Compact(0) };
        let (mut explicit, mut implicit) = (Vec::new(), Vec::new());
        w.encode_value_to(&mut explicit);
        w.encode_implicit_to(&mut implicit);
        assert_eq!((explicit, implicit), (vec![0u8], vec![]));
    }

    #[test]
    fn pool_rejections_parse_on_both_node_flavours() {
        let real =
            parse_pool_rejection("RPC error: 1010: Invalid Transaction: Custom error: 6").unwrap();
        assert_eq!(real.name(), "Custom(6)");
        assert!(real.to_string().contains("RateLimitExceeded"), "{real}");
        let chopsticks = parse_pool_rejection(r#"1010: {"invalid":{"custom":3}}"#).unwrap();
        assert_eq!(chopsticks.name(), "Custom(3)");
        let stale =
            parse_pool_rejection("1010: Invalid Transaction: Transaction is outdated").unwrap();
        assert!(matches!(stale, SubmitError::Pool { custom: None, .. }));
        assert!(parse_pool_rejection("connection reset by peer").is_none());
    }

    #[test]
    fn error_kinds_are_closed_words() {
        let kind = |t: &str| parse_pool_rejection(t).unwrap().kind();
        assert_eq!(
            kind(r#"1010: {"invalid":{"ancientBirthBlock":null}}"#),
            "ancient-birth-block"
        );
        assert_eq!(
            kind("1010: Invalid Transaction: Transaction has an ancient birth block"),
            "ancient-birth-block"
        );
        assert_eq!(kind(r#"1010: {"invalid":{"stale":null}}"#), "outdated");
        assert_eq!(
            kind("1010: Invalid Transaction: Transaction is outdated"),
            "outdated"
        );
        assert_eq!(kind(r#"1010: {"invalid":{"custom":6}}"#), "pool-rejected");
        assert_eq!(
            kind(r#"1010: {"invalid":{"badProof":null}}"#),
            "pool-rejected"
        );
        let d = SubmitError::Dispatch {
            pallet: "SubtensorModule".into(),
            name: "IncorrectWeightVersionKey".into(),
            block: 9,
        };
        assert_eq!(
            d.kind(),
            "dispatch:SubtensorModule.IncorrectWeightVersionKey"
        );
        assert!(!d.stale_era_or_nonce());
        assert_eq!(SubmitError::Timeout(180).kind(), "timeout");
        // the log names the reason, never the node's raw JSON
        let line =
            parse_pool_rejection(r#"User error: {"invalid":{"ancientBirthBlock":null}} (1010)"#)
                .unwrap()
                .to_string();
        assert!(
            line.contains("AncientBirthBlock (") && !line.contains('{'),
            "{line}"
        );
    }

    /// Every code of subtensor's `CustomTransactionError` (spec 425,
    /// `common/src/transaction_error.rs`, `impl From<CustomTransactionError> for u8`), in the
    /// source's order; codes it does not define have no name.
    #[test]
    fn pool_custom_codes_follow_subtensor_custom_transaction_error() {
        let source: &[(u8, &str)] = &[
            (0, "ColdkeyInSwapSchedule"),
            (1, "StakeAmountTooLow"),
            (2, "BalanceTooLow"),
            (3, "SubnetNotExists"),
            (4, "HotkeyAccountDoesntExist"),
            (5, "NotEnoughStakeToWithdraw"),
            (6, "RateLimitExceeded"),
            (7, "InsufficientLiquidity"),
            (8, "SlippageTooHigh"),
            (9, "TransferDisallowed"),
            (10, "HotKeyNotRegisteredInNetwork"),
            (11, "InvalidIpAddress"),
            (12, "ServingRateLimitExceeded"),
            (13, "InvalidPort"),
            (255, "BadRequest"),
            (14, "ZeroMaxAmount"),
            (15, "InvalidRevealRound"),
            (16, "CommitNotFound"),
            (17, "CommitBlockNotInRevealRange"),
            (18, "InputLengthsUnequal"),
            (19, "UidNotFound"),
            (20, "EvmKeyAssociateRateLimitExceeded"),
            (21, "ColdkeySwapDisputed"),
            (22, "InvalidRealAccount"),
            (23, "FailedShieldedTxParsing"),
            (24, "InvalidShieldedTxPubKeyHash"),
            (25, "NonAssociatedColdKey"),
            (26, "DelegateTakeTooLow"),
            (27, "DelegateTakeTooHigh"),
        ];
        assert_eq!(CUSTOM_TRANSACTION_ERRORS.len(), source.len());
        for code in 0..=u8::MAX {
            let expected = source.iter().find(|(c, _)| *c == code).map(|(_, n)| *n);
            assert_eq!(custom_error_name(code), expected, "Custom({code})");
            for text in [
                format!("RPC error: 1010: Invalid Transaction: Custom error: {code}"),
                format!(r#"1010: {{"invalid":{{"custom":{code}}}}}"#),
            ] {
                let e = parse_pool_rejection(&text).unwrap();
                assert_eq!(e.name(), format!("Custom({code})"), "{text}");
                let shown = e.to_string();
                match expected {
                    Some(name) => assert!(
                        shown.contains(&format!("Custom({code}) ({name}: ")),
                        "{shown}"
                    ),
                    None => assert!(shown.ends_with(&format!("Custom({code})")), "{shown}"),
                }
            }
        }
        assert!(custom_hint(15).unwrap().contains("LastStoredRound"));
    }

    #[test]
    fn dispatch_errors_keep_the_runtime_name() {
        // In this runtime every registered uid holds a validator permit, so the permit
        // error is covered here rather than on chain.
        let e = SubmitError::Dispatch {
            pallet: "SubtensorModule".into(),
            name: "NeuronNoValidatorPermit".into(),
            block: 9,
        };
        assert_eq!(e.name(), "NeuronNoValidatorPermit");
        assert!(e
            .to_string()
            .contains("SubtensorModule.NeuronNoValidatorPermit"));
        assert!(dispatch_hint(&e.name())
            .unwrap()
            .contains("validator permit"));
        assert!(dispatch_hint("SettingWeightsTooFast").is_some());
        assert!(dispatch_hint("CommitRevealEnabled")
            .unwrap()
            .contains("commit-reveal"));
    }

    #[test]
    fn set_weights_call_shape() {
        let call = set_weights_call(53, &[2, 3], &[65535, 1], 0);
        assert_eq!(call.pallet_name(), "SubtensorModule");
        assert_eq!(call.call_name(), "set_weights");
    }
}
