//! engy-core: the pieces both engy daemons stand on.
//!
//! * [`payload`]: the master-signed epoch payload (PROTOCOL.md §6) and its verification.
//! * [`keys`]: SS58 addresses, sr25519 signing under the Substrate context, bittensor wallet hotkey files.
//! * [`heartbeat`]: the validator → provider heartbeat canonical message, body and signed headers (§6).
//! * [`toploc`]: TOPLOC activation proofs, byte-compatible with PyPI `toploc` 0.1.6 (§5).
//! * [`identity`]: the cheap checkpoint identity `model_root` (§4).
//! * [`commit`]: Merkle weight commitments over safetensors checkpoints (specs/SCHEME.md).
//! * [`cells`]: activation cells of the sampled MoE audit and their Merkle commitment
//!   (specs/CELLS.md).
//! * [`wire`]: the miner's typed wire messages: gateway frames both ways, `/generate` bodies,
//!   the commitment (docs/PROTOCOL.md §2–§3).
//! * [`trace`]: the compact MoE routing / DSA index traces a commitment may carry (§3.10).
#![deny(unsafe_code)]

pub mod cells;
pub mod commit;
pub mod heartbeat;
pub mod identity;
pub mod keys;
pub mod payload;
pub mod toploc;
pub mod trace;
pub mod wire;
