//! The chain beacon: subtensor block hashes read with subxt's JSON-RPC methods
//! (`chain_getHeader`, `chain_getFinalizedHead`, `chain_getBlockHash`).
//!
//! [`Beacon::head`] is the newest best-block number this process has read when a report
//! arrives (never less than an earlier read: a node whose head goes back, a lagging node
//! behind a load-balanced endpoint, a reconnect to another node or a reorganisation, would
//! otherwise make the beacon a block that existed, and that the miner could know, before the
//! report); the request's beacon is the hash of the next block, taken only once that block is
//! finalized (a hash that a reorganisation could still replace is not a beacon). A dropped
//! connection is opened again at the next read. At `debug` (`ENGY_LOG=engy_audit_service::beacon=debug`) each read logs
//! `beacon block not finalized yet` (fields `block`, `finalized`) or `beacon block` (`block`,
//! `hash`, hex), the value the sampling seed is made from.
use std::sync::atomic::{AtomicU64, Ordering};

use subxt::backend::legacy::LegacyRpcMethods;
use subxt::backend::rpc::RpcClient;
use subxt::PolkadotConfig;
use tokio::sync::Mutex;

use crate::sampling::{Beacon, BeaconError, BoxFuture};

/// How long one read may take.
const READ_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(20);

/// Block hashes of a subtensor node.
pub struct ChainBeacon {
    url: String,
    rpc: Mutex<Option<LegacyRpcMethods<PolkadotConfig>>>,
    /// The highest best-block number read so far.
    highest: AtomicU64,
}

impl ChainBeacon {
    /// Connects to the node at `url` (ws:// or wss://).
    ///
    /// # Errors
    /// [`BeaconError`] when the node cannot be reached.
    pub async fn connect(url: &str) -> Result<ChainBeacon, BeaconError> {
        let b = ChainBeacon {
            url: url.to_owned(),
            rpc: Mutex::new(None),
            highest: AtomicU64::new(0),
        };
        b.head_number().await?;
        Ok(b)
    }

    async fn methods(&self) -> Result<LegacyRpcMethods<PolkadotConfig>, BeaconError> {
        let mut guard = self.rpc.lock().await;
        if let Some(m) = guard.as_ref() {
            return Ok(m.clone());
        }
        let client = tokio::time::timeout(READ_TIMEOUT, RpcClient::from_insecure_url(&self.url))
            .await
            .map_err(|_| BeaconError(format!("connecting to {} timed out", self.url)))?
            .map_err(|e| BeaconError(format!("cannot connect to {}: {e}", self.url)))?;
        let m = LegacyRpcMethods::<PolkadotConfig>::new(client);
        *guard = Some(m.clone());
        Ok(m)
    }

    /// Forgets the connection after an error, so the next read opens a new one.
    async fn reset(&self) {
        *self.rpc.lock().await = None;
    }

    async fn head_number(&self) -> Result<u64, BeaconError> {
        let m = self.methods().await?;
        let r = tokio::time::timeout(READ_TIMEOUT, m.chain_get_header(None)).await;
        match r {
            Ok(Ok(Some(h))) => {
                let n = u64::from(h.number);
                let before = self.highest.fetch_max(n, Ordering::SeqCst);
                if before > n {
                    tracing::debug!(
                        head = n,
                        highest = before,
                        "the node's head is behind one read before; counting from the highest"
                    );
                }
                Ok(before.max(n))
            }
            Ok(Ok(None)) => Err(BeaconError("the node has no best block".into())),
            Ok(Err(e)) => {
                self.reset().await;
                Err(BeaconError(format!("chain_getHeader on {}: {e}", self.url)))
            }
            Err(_) => {
                self.reset().await;
                Err(BeaconError(format!(
                    "chain_getHeader on {} timed out",
                    self.url
                )))
            }
        }
    }

    async fn finalized_hash_of(&self, number: u64) -> Result<Option<[u8; 32]>, BeaconError> {
        let m = self.methods().await?;
        let read = async {
            let fin = m.chain_get_finalized_head().await?;
            let Some(h) = m.chain_get_header(Some(fin)).await? else {
                return Ok(None);
            };
            if u64::from(h.number) < number {
                tracing::debug!(
                    block = number,
                    finalized = h.number,
                    "beacon block not finalized yet"
                );
                return Ok(None);
            }
            let hash = m.chain_get_block_hash(Some(number.into())).await?;
            if let Some(hash) = &hash {
                tracing::debug!(block = number, hash = %hex::encode(hash.0), "beacon block");
            }
            Ok::<_, subxt::ext::subxt_rpcs::Error>(hash.map(|h| h.0))
        };
        match tokio::time::timeout(READ_TIMEOUT, read).await {
            Ok(Ok(h)) => Ok(h),
            Ok(Err(e)) => {
                self.reset().await;
                Err(BeaconError(format!(
                    "reading block {number} on {}: {e}",
                    self.url
                )))
            }
            Err(_) => {
                self.reset().await;
                Err(BeaconError(format!(
                    "reading block {number} on {} timed out",
                    self.url
                )))
            }
        }
    }
}

impl Beacon for ChainBeacon {
    fn head(&self) -> BoxFuture<'_, Result<u64, BeaconError>> {
        Box::pin(self.head_number())
    }
    fn hash_of(&self, number: u64) -> BoxFuture<'_, Result<Option<[u8; 32]>, BeaconError>> {
        Box::pin(self.finalized_hash_of(number))
    }
}
