//! What each serve offers besides hidden states, read from its server info: `GET
//! /server_info` (alias of the deprecated `/get_server_info`, which older serves answer), a
//! flat merge of every sglang `ServerArgs` field (sglang-native-api.md §6). The miner reads
//! `enable_return_routed_experts` (`--enable-return-routed-experts`) and
//! `enable_return_indexer_topk` (`--enable-return-indexer-topk`); an absent field is off.
//! The engy_cells hooks (docs/PROTOCOL.md §10) are offered when `forward_hooks`
//! (`--forward-hooks`, sglang's `ServerArgs.forward_hooks`) holds a spec whose
//! `hook_factory` is in the `engy_cells` package.
//!
//! [`OfferCache`] keeps the answer per serve: probed at start-up in the background
//! ([`OfferCache::probe_all`]), or before the first request to a serve whose answer is not
//! known; a failed probe is retried after [`RETRY`]; an answer that lacks a flag is read
//! again after [`RECHECK`] (the serve may have been restarted with it); a reply that lacks
//! an offered field makes the serve unknown again ([`OfferCache::forget`]: it may have
//! restarted without the flag).
use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use serde_json::Value;

/// What a serve offers (its start-up flags).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Offers {
    /// `enable_return_routed_experts`.
    pub routing: bool,
    /// `enable_return_indexer_topk`.
    pub indexer: bool,
    /// `forward_hooks` names an `engy_cells` hook factory (the serve spools cells).
    pub cells: bool,
}

/// How long one server-info probe may take.
pub const PROBE_TIMEOUT: Duration = Duration::from_secs(5);

/// After a failed probe, the serve is asked again no sooner than this.
pub const RETRY: Duration = Duration::from_secs(30);

/// An answer without every flag is read again after this long.
pub const RECHECK: Duration = Duration::from_secs(300);

/// Read `serve`'s server info: `/server_info`, then `/get_server_info` when that path is
/// not served (404/405).
///
/// # Errors
/// A sentence with the cause: unreachable, an HTTP status, a body that is not a JSON object.
pub async fn fetch(client: &reqwest::Client, serve: &str) -> Result<Offers, String> {
    let mut last = String::new();
    for path in ["/server_info", "/get_server_info"] {
        let resp = client
            .get(format!("{serve}{path}"))
            .timeout(PROBE_TIMEOUT)
            .send()
            .await
            .map_err(|e| format!("{serve}{path}: {}", crate::error_chain(&e)))?;
        let status = resp.status();
        if status == reqwest::StatusCode::NOT_FOUND
            || status == reqwest::StatusCode::METHOD_NOT_ALLOWED
        {
            last = format!("{serve}{path}: HTTP {status}");
            continue;
        }
        if !status.is_success() {
            return Err(format!("{serve}{path}: HTTP {status}"));
        }
        let v: Value = resp
            .json()
            .await
            .map_err(|e| format!("{serve}{path}: not JSON ({e})"))?;
        if !v.is_object() {
            return Err(format!("{serve}{path}: not a JSON object"));
        }
        return Ok(from_server_info(&v));
    }
    Err(last)
}

/// The offers in a server-info object (absent or non-boolean fields are off).
pub fn from_server_info(v: &Value) -> Offers {
    let flag = |k: &str| v.get(k).and_then(Value::as_bool).unwrap_or(false);
    let cells = v
        .get("forward_hooks")
        .and_then(Value::as_array)
        .is_some_and(|specs| {
            specs.iter().any(|s| {
                s.get("hook_factory")
                    .and_then(Value::as_str)
                    .is_some_and(|f| f.starts_with("engy_cells.") || f.starts_with("engy_cells:"))
            })
        });
    Offers {
        routing: flag("enable_return_routed_experts"),
        indexer: flag("enable_return_indexer_topk"),
        cells,
    }
}

enum Entry {
    Known(Offers, Instant),
    Failed(Instant),
}

/// The offers of every serve, as last read.
#[derive(Default)]
pub struct OfferCache {
    entries: Mutex<HashMap<String, Entry>>,
}

impl OfferCache {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Entry>> {
        self.entries.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// `serve`'s offers: the cached answer, else a probe now (at most [`PROBE_TIMEOUT`]);
    /// `None` when the serve did not say (probe failed now or within [`RETRY`]).
    pub async fn get(&self, client: &reqwest::Client, serve: &str) -> Option<Offers> {
        match self.lock().get(serve) {
            Some(Entry::Known(o, at))
                if (o.routing && o.indexer && o.cells) || at.elapsed() < RECHECK =>
            {
                return Some(*o)
            }
            Some(Entry::Failed(at)) if at.elapsed() < RETRY => return None,
            _ => {}
        }
        self.probe(client, serve).await.ok()
    }

    /// Probe `serve` now and remember the answer (or the failure).
    ///
    /// # Errors
    /// As [`fetch`].
    pub async fn probe(&self, client: &reqwest::Client, serve: &str) -> Result<Offers, String> {
        let r = fetch(client, serve).await;
        let entry = match &r {
            Ok(o) => Entry::Known(*o, Instant::now()),
            Err(_) => Entry::Failed(Instant::now()),
        };
        self.lock().insert(serve.to_string(), entry);
        r
    }

    /// Forget what `serve` offers (it answered without a field it offered): the next
    /// request probes it again.
    pub fn forget(&self, serve: &str) {
        self.lock().remove(serve);
    }

    /// Start-up: probe every serve concurrently and log what each offers (INFO), or why
    /// its traces will be missing (WARN, with the fix). `want` says which traces the
    /// settings and the checkpoint ask for: `(routing, indexer, cells)`.
    pub async fn probe_all(
        &self,
        client: &reqwest::Client,
        serves: &[String],
        want: (bool, bool, bool),
    ) {
        if !(want.0 || want.1 || want.2) {
            return;
        }
        let probes = serves
            .iter()
            .map(|s| async move { (s, self.probe(client, s).await) });
        for (serve, r) in futures_util::future::join_all(probes).await {
            match r {
                Ok(o) => {
                    if want.0 && !o.routing {
                        tracing::warn!(%serve, "serve does not offer routed experts (started without --enable-return-routed-experts): its commitments carry no routing trace; fix: add --enable-return-routed-experts to its sglang command line, or set ENGY_ROUTING_TRACE=off");
                    }
                    if want.1 && !o.indexer {
                        tracing::warn!(%serve, "serve does not offer the indexer top-k (started without --enable-return-indexer-topk): its commitments carry no indexer trace; fix: add --enable-return-indexer-topk, or set ENGY_INDEXER_TRACE=off");
                    }
                    if want.2 && !o.cells {
                        tracing::warn!(%serve, "serve was not started with the engy_cells hooks (its server info's forward_hooks names no engy_cells hook factory): its commitments carry no cells; fix: start it with --forward-hooks \"$(engy-cells-hooks $ENGY_CELLS_SPOOL)\" (integrations/sglang/README.md), or set ENGY_CELLS=off");
                    }
                    tracing::info!(%serve, routed_experts = o.routing, indexer_topk = o.indexer, cells_hooks = o.cells, "serve flags read from its server info");
                }
                Err(e) => {
                    tracing::warn!(%serve, error = %e, "cannot read the serve's server info; no traces are asked of it until it answers (retried before a request, every {} s at most)", RETRY.as_secs())
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn flags_are_read_from_server_args() {
        let v = json!({"enable_return_hidden_states": true, "enable_return_routed_experts": true});
        assert_eq!(
            from_server_info(&v),
            Offers {
                routing: true,
                indexer: false,
                cells: false
            }
        );
        let hooks = json!({"forward_hooks": [
            {"name": "other", "target_modules": ["model"], "hook_factory": "mypkg.hooks:f", "config": {}},
            {"name": "engy_cells_block", "target_modules": ["*layers.*.mlp"],
             "hook_factory": "engy_cells.hooks:hook_factory", "config": {"role": "block"}}]});
        assert!(from_server_info(&hooks).cells);
        let others = json!({"forward_hooks": [{"hook_factory": "engy_cellsx.hooks:f"}]});
        assert!(!from_server_info(&others).cells);
        assert!(!from_server_info(&json!({"forward_hooks": null})).cells);
        let odd = json!({"enable_return_routed_experts": "true", "enable_return_indexer_topk": 1});
        assert_eq!(from_server_info(&odd), Offers::default());
        assert_eq!(from_server_info(&json!({})), Offers::default());
    }
}
