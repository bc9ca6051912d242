//! engy-devnet: the one set of protocol doubles, written to the shared spec documents and
//! reused by every test and by the devnet:
//!
//! * [`gateway`]: the engy gateway (PROTOCOL.md §2), a websocket server that records every frame.
//! * [`provider`]: the provider API (PROTOCOL.md §6), serving signed epoch payloads and faults.
//! * [`sglang`]: sglang's native HTTP API (sglang-native-api.md) over a pluggable model backend.
pub mod devnet;
pub mod devnet_backend;
pub mod gateway;
pub mod provider;
pub mod sglang;
