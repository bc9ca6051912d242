//! The commit pass of the sampled cell audit (docs/PROTOCOL.md §10,
//! integrations/sglang/README.md "So: a teacher-forced commit pass"): after a generation,
//! on a serve started with the engy_cells `--forward-hooks`, the miner sends prompt + output
//! once more as one prefill (`max_new_tokens` 1, greedy; the sampled token is discarded),
//! reads the request the hooks spooled (`SPOOL/latest`) back with
//! [`engy_core::cells::spool`], checks it ran exactly this sequence, keeps its cells in the
//! [`CellStore`] and returns `commitment.cells`.
//!
//! The hooks are server-wide and see no request id, so the miner runs one commit pass at a
//! time over its spool ([`CommitPass::lock`]); a generation pass of the same serve that
//! runs meanwhile (hooks fire on every eager pass) spoils the capture, which the checks
//! catch: the cells are then dropped. Nothing here fails a request: every problem is a
//! [`Dropped`] reason (WARN + `engy_miner_cells_total{outcome}`), and the commitment goes
//! out without `cells`.
use std::path::{Path, PathBuf};
use std::sync::Arc;

use engy_core::cells::{self, spool};
use engy_core::commit::spec::Hex;
use engy_core::wire;
use serde_json::Value;

use crate::cell_store::{CellStore, RetainError};

/// Why a request's commitment carries no cells (the `outcome` label of
/// `engy_miner_cells_total`).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Dropped {
    /// The serve's server info names no engy_cells hook factory.
    #[error("the serve was not started with the engy_cells hooks")]
    NotOffered,
    /// The commit pass call failed.
    #[error("the commit pass failed: {0}")]
    Pass(String),
    /// The spool has no new request, or it is unreadable or inconsistent.
    #[error("{0}")]
    Spool(String),
    /// The spooled pass ran another sequence than the request's.
    #[error("{0}")]
    Tokens(String),
    /// The retention store cannot keep them.
    #[error("{0}")]
    Retain(String),
}

impl Dropped {
    /// The metric label.
    pub fn label(&self) -> &'static str {
        match self {
            Dropped::NotOffered => "not_offered",
            Dropped::Pass(_) => "pass",
            Dropped::Spool(_) => "spool",
            Dropped::Tokens(_) => "tokens",
            Dropped::Retain(_) => "retain",
        }
    }
}

/// The miner's commit-pass state: the spool, its lock, the store.
pub struct CommitPass {
    spool: PathBuf,
    /// One commit pass at a time over the spool (the hooks see no request id).
    lock: tokio::sync::Mutex<()>,
    store: Arc<CellStore>,
}

impl CommitPass {
    /// Commit passes reading `spool`, keeping cells in `store`.
    pub fn new(spool: PathBuf, store: Arc<CellStore>) -> Self {
        Self {
            spool,
            lock: tokio::sync::Mutex::new(()),
            store,
        }
    }

    /// The retention store.
    pub fn store(&self) -> &Arc<CellStore> {
        &self.store
    }

    /// The spool directory.
    pub fn spool(&self) -> &Path {
        &self.spool
    }

    /// Run the commit pass of `ids` (prompt + output) on `serve` and keep its cells under
    /// `request_id`. `call` sends the `/generate` body and returns when the serve answered.
    ///
    /// # Errors
    /// [`Dropped`] (the caller counts and logs it; the request goes on).
    pub async fn commit<F, Fut>(
        &self,
        request_id: &Value,
        ids: &[u32],
        call: F,
    ) -> Result<wire::CellsCommitment, Dropped>
    where
        F: FnOnce(wire::GenerateRequest) -> Fut,
        Fut: std::future::Future<Output = Result<(), String>>,
    {
        let _turn = self.lock.lock().await;
        let before = spool::latest(&self.spool).ok();
        let body = wire::GenerateRequest {
            input_ids: ids.to_vec(),
            sampling_params: wire::SamplingParams {
                temperature: 0.0,
                max_new_tokens: 1,
            },
            rid: format!("engy-cells-{}", uuid::Uuid::new_v4().simple()),
            return_hidden_states: false,
            return_logprob: false,
            stream: false,
            return_routed_experts: false,
            routed_experts_start_len: None,
            return_indexer_topk: false,
        };
        call(body).await.map_err(Dropped::Pass)?;
        let spool_dir = self.spool.clone();
        let ids = ids.to_vec();
        let read = tokio::task::spawn_blocking(move || read_spooled(&spool_dir, before, &ids))
            .await
            .map_err(|e| Dropped::Spool(format!("spool read task failed: {e}")))??;
        let root = read.tree.root();
        let shape = read.tree.shape().clone();
        self.store
            .insert(request_id, read.tree, read.cells)
            .map_err(|e| match e {
                RetainError::TooLarge { .. } => Dropped::Retain(e.to_string()),
                RetainError::Inconsistent(m) => Dropped::Spool(m),
            })?;
        Ok(wire::CellsCommitment {
            scheme: cells::SCHEME.to_string(),
            root: Hex(root),
            shape,
        })
    }
}

/// The request the commit pass spooled, checked against `ids`; older request directories
/// of the spool are removed (the one just read is left for the hooks, which may still
/// write an error into it, and removed after the next pass).
fn read_spooled(
    spool_dir: &Path,
    before: Option<PathBuf>,
    ids: &[u32],
) -> Result<spool::SpoolRequest, Dropped> {
    let dir = spool::latest(spool_dir).map_err(|e| {
        Dropped::Spool(format!(
            "no spooled request after the commit pass (are the serve's hooks writing to ENGY_CELLS_SPOOL {}?): {e}",
            spool_dir.display()
        ))
    })?;
    if before.as_deref() == Some(dir.as_path()) {
        return Err(Dropped::Spool(format!(
            "the commit pass spooled nothing new ({} is still the latest request; are the serve's hooks writing to ENGY_CELLS_SPOOL {}?)",
            dir.display(),
            spool_dir.display()
        )));
    }
    let req = spool::read_request(&dir);
    remove_older(spool_dir, &dir);
    let req = req.map_err(|e| Dropped::Spool(e.to_string()))?;
    let n = req.tree.shape().n_positions() as usize;
    if n != ids.len() || !req.ran_tokens(ids) {
        return Err(Dropped::Tokens(format!(
            "{} holds a pass over {n} positions that is not this request's {} tokens (another pass of the serve ran meanwhile?)",
            dir.display(),
            ids.len()
        )));
    }
    Ok(req)
}

/// Remove every `req-NNNNNN` directory of the spool numbered below `newest`'s.
fn remove_older(spool_dir: &Path, newest: &Path) {
    let num =
        |p: &Path| -> Option<u64> { p.file_name()?.to_str()?.strip_prefix("req-")?.parse().ok() };
    let Some(keep) = num(newest) else { return };
    let Ok(entries) = std::fs::read_dir(spool_dir) else {
        return;
    };
    for e in entries.flatten() {
        let p = e.path();
        if num(&p).is_some_and(|n| n < keep) {
            if let Err(err) = std::fs::remove_dir_all(&p) {
                tracing::debug!(dir = %p.display(), error = %err, "cannot remove an old spool request");
            }
        }
    }
}
