//! The engy_cells `--forward-hooks` of a serve (integrations/sglang/README.md,
//! `integrations/sglang/src/engy_cells/hooks.py`), as the sglang double plays them with
//! [`super::SglangConfig::cells_spool`]: the spool directory and what a forward pass writes
//! into it, byte for byte as the Python hooks write it.
//!
//! * A pass that starts at position 0 opens a new request: `SPOOL/req-NNNNNN/` (numbered on
//!   from the highest already in the spool), an empty `cells.bin`, then `SPOOL/latest` =
//!   `"req-NNNNNN\n"` (written to `latest.tmp`, fsynced, renamed);
//! * the pass's cells are appended to `cells.bin` in leaf order (position-major, then
//!   layer), then `manifest.json` is rewritten atomically: `scheme`, `request`, `shape`,
//!   `n_cells`, `passes`, `error`, `tokens_sha256` (SHA-256 of the pass's ids as int32 LE),
//!   `tree_root`, `cells_root` (`engy-cells/v2`: over the shape and `tokens_sha256`;
//!   `json.dumps(doc, indent=1)` + newline, keys in that order);
//! * a pass that starts elsewhere (a radix-cache hit) continues the current request at
//!   another position than its next, which the hooks refuse: the current request's
//!   manifest gets an `error` and nothing else is written.
//!
//! The double runs the hooks on each call's prefill (the pass over `input_ids`); its
//! decode steps do not fire them (a serve whose decode batches replay CUDA graphs).
use std::path::{Path, PathBuf};

use engy_core::cells::{Cell, CellShape, CellTree, SCHEME};
use serde::Serialize;
use serde_json::{json, Value};

/// `sglang_forward_hooks(spool)` of the hook package: the `forward_hooks` server argument a
/// serve started with `--forward-hooks "$(engy-cells-hooks SPOOL)"` reports in its server
/// info.
pub fn forward_hooks(spool: &Path) -> Value {
    let specs = [
        ("router", vec!["*layers.*.mlp.gate"]),
        ("topk", vec!["*layers.*.mlp.topk"]),
        ("block", vec!["*layers.*.mlp"]),
        ("tokens", vec!["*embed_tokens"]),
        ("pass", vec!["model"]),
    ];
    Value::Array(
        specs
            .into_iter()
            .map(|(role, t)| {
                json!({"name": format!("engy_cells_{role}"), "target_modules": t,
                       "hook_factory": "engy_cells.hooks:hook_factory",
                       "config": {"spool": spool.display().to_string(), "role": role}})
            })
            .collect(),
    )
}

/// The capture state of one spool directory (the Python `Capture`).
#[derive(Debug)]
pub struct Spool {
    dir: PathBuf,
    seq: u64,
    /// The current request's directory and manifest.
    current: Option<(PathBuf, Manifest)>,
}

/// `manifest.json`, fields in the order the hooks' `_write_manifest` writes them.
#[derive(Debug, Clone, Serialize)]
struct Manifest {
    scheme: &'static str,
    request: String,
    shape: ManifestShape,
    n_cells: usize,
    passes: u64,
    error: Option<String>,
    tokens_sha256: Option<String>,
    tree_root: String,
    cells_root: String,
}

/// The manifest's `shape` as the hooks write it: the six sizes (its `tokens_sha256` is the
/// manifest's own key).
#[derive(Debug, Clone, Serialize)]
struct ManifestShape {
    n_positions: u32,
    layers: Vec<u32>,
    hidden: u32,
    n_experts: u32,
    top_k: u32,
    logits_dtype: u32,
}

impl From<&CellShape> for ManifestShape {
    fn from(s: &CellShape) -> Self {
        Self {
            n_positions: s.n_positions(),
            layers: s.layers().to_vec(),
            hidden: s.hidden(),
            n_experts: s.n_experts(),
            top_k: s.top_k(),
            logits_dtype: s.logits_dtype().map_or(0, |d| d.code()),
        }
    }
}

fn atomic(path: &Path, text: &str) -> std::io::Result<()> {
    use std::io::Write as _;
    let tmp = PathBuf::from(format!("{}.tmp", path.display()));
    let mut f = std::fs::File::create(&tmp)?;
    f.write_all(text.as_bytes())?;
    f.sync_all()?;
    std::fs::rename(&tmp, path)
}

impl Spool {
    /// The spool at `dir` (created when missing), numbering on from its highest `req-N`.
    ///
    /// # Errors
    /// Creating or listing the directory.
    pub fn open(dir: &Path) -> std::io::Result<Self> {
        std::fs::create_dir_all(dir)?;
        let seq = std::fs::read_dir(dir)?
            .flatten()
            .filter_map(|e| {
                e.file_name()
                    .to_str()?
                    .strip_prefix("req-")?
                    .parse::<u64>()
                    .ok()
            })
            .max()
            .unwrap_or(0);
        Ok(Self {
            dir: dir.to_path_buf(),
            seq,
            current: None,
        })
    }

    /// One forward pass over `ids` whose first position is `start`, with `cells` (every
    /// position of the pass × every MoE layer, leaf order; positions counted from the
    /// request's 0).
    ///
    /// # Errors
    /// File system errors, or a refused pass (written to the manifest's `error` as the
    /// hooks do).
    pub fn pass(&mut self, start: usize, ids: &[u32], cells: &[Cell]) -> std::io::Result<()> {
        if cells.is_empty() {
            return Ok(());
        }
        if start != 0 {
            let msg = format!(
                "RuntimeError: pass starts at position {start}, the request has {} (prefix cache on? start the commit serve with --disable-radix-cache)",
                self.current
                    .as_ref()
                    .map_or(0, |(_, m)| m.shape.n_positions)
            );
            if let Some((dir, m)) = self.current.as_mut() {
                m.error.get_or_insert_with(|| msg.clone());
                atomic(&dir.join("manifest.json"), &manifest_text(m))?;
            }
            return Err(std::io::Error::other(msg));
        }
        self.seq += 1;
        let name = format!("req-{:06}", self.seq);
        let dir = self.dir.join(&name);
        std::fs::create_dir_all(&dir)?;
        std::fs::write(dir.join("cells.bin"), b"")?;
        atomic(&self.dir.join("latest"), &format!("{name}\n"))?;
        let mut layers: Vec<u32> = cells.iter().map(Cell::layer).collect();
        layers.sort_unstable();
        layers.dedup();
        let first = &cells[0];
        let shape = CellShape::for_request(
            ids,
            layers,
            first.hidden(),
            first.n_experts(),
            first.top_k(),
            first.router_logits().dtype(),
        )
        .map_err(std::io::Error::other)?;
        let tree = CellTree::from_cells(shape.clone(), cells).map_err(std::io::Error::other)?;
        let bytes: Vec<u8> = cells.iter().flat_map(Cell::encode).collect();
        std::fs::write(dir.join("cells.bin"), &bytes)?;
        let m = Manifest {
            scheme: SCHEME,
            request: name,
            shape: ManifestShape::from(&shape),
            n_cells: cells.len(),
            passes: 1,
            error: None,
            tokens_sha256: Some(hex::encode(shape.tokens_sha256())),
            tree_root: hex::encode(tree.tree_root()),
            cells_root: hex::encode(tree.root()),
        };
        atomic(&dir.join("manifest.json"), &manifest_text(&m))?;
        self.current = Some((dir, m));
        Ok(())
    }
}

/// `json.dumps(doc, indent=1) + "\n"` of a manifest: the struct's field order, one space
/// of indent per level, `": "` and `",\n"` between items (serde_json's pretty printer
/// writes Python's layout; every value is ASCII).
fn manifest_text(m: &Manifest) -> String {
    let mut buf = Vec::new();
    let fmt = serde_json::ser::PrettyFormatter::with_indent(b" ");
    let mut ser = serde_json::Serializer::with_formatter(&mut buf, fmt);
    let _ = serde::Serialize::serialize(m, &mut ser);
    let mut s = String::from_utf8(buf).unwrap_or_default();
    s.push('\n');
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use engy_core::cells::{spool, LogitsDtype, RouterLogits};
    use half::bf16;

    fn cells(n: u32) -> Vec<Cell> {
        let mut out = Vec::new();
        for p in 0..n {
            for layer in [1, 3] {
                let v = |k: f32| vec![bf16::from_f32(p as f32 * 0.5 + k); 8];
                let logits = RouterLogits::Bf16(vec![bf16::from_f32(p as f32); 6]);
                out.push(Cell::new(p, layer, v(1.0), logits, vec![4, 0], v(2.0)).unwrap());
            }
        }
        out
    }

    #[test]
    fn a_spooled_pass_reads_back_with_the_miners_reader() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(dir.path().join("req-000041")).unwrap();
        let mut s = Spool::open(dir.path()).unwrap();
        let ids = [5u32, 6, 7];
        s.pass(0, &ids, &cells(3)).unwrap();
        let latest = spool::latest(dir.path()).unwrap();
        assert_eq!(latest, dir.path().join("req-000042"));
        let req = spool::read_request(&latest).unwrap();
        assert!(req.ran_tokens(&ids));
        assert!(!req.ran_tokens(&[5, 6]));
        assert_eq!(req.tree.shape().layers(), &[1, 3]);
        assert_eq!(req.tree.shape().logits_dtype(), Ok(LogitsDtype::Bf16));
        assert_eq!(
            req.cells.len(),
            6 * Cell::encoded_len(8, 6, 2, LogitsDtype::Bf16)
        );
        // A pass that starts past 0 (a radix-cache hit) spoils the current request.
        assert!(s.pass(2, &ids[2..], &cells(1)).is_err());
        assert_eq!(spool::latest(dir.path()).unwrap(), latest);
        assert!(matches!(
            spool::read_request(&latest),
            Err(spool::SpoolError::CaptureFailed { .. })
        ));
    }
}
