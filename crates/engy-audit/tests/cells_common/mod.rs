//! Shared by `cells_cli.rs` and `red_team.rs`: a generated checkpoint with its trusted root
//! (`spec build`, opening proofs), a request's commitment as a miner sends it, the cells a
//! serve commits for it, and `engy-audit cells` run as a process.
#![allow(dead_code)]
use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use engy_core::cells::{
    commitment_digest, production_seed, Cell, CellAuditBundle, CellShape, CellTree,
};
use engy_core::commit::spec::Hex;
use engy_core::commit::{self, CommitOptions, LayerPart, Progress, UnitId};
use engy_core::wire::CellsCommitment;
use engy_model::cells::{serve_cells, CellServe};
use engy_model::{gen_model, Compute, GenConfig, Model, Precision};
use serde_json::json;

/// The beacon every test challenges with (a block hash produced after the response).
pub const BEACON: [u8; 32] = [0x5a; 32];

/// A generated checkpoint, its `spec build` directory, its root and opening proofs of every
/// MoE unit, and the model loaded as a bf16 serve.
pub struct Fixture {
    pub t: tempfile::TempDir,
    pub dir: PathBuf,
    pub spec: PathBuf,
    pub root: String,
    pub proofs: PathBuf,
    pub serve: Model,
}

pub fn engy_audit(args: &[OsString]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_engy-audit"))
        .args(args)
        .output()
        .unwrap()
}

pub fn text(o: &Output) -> (i32, String, String) {
    (
        o.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&o.stdout).into_owned(),
        String::from_utf8_lossy(&o.stderr).into_owned(),
    )
}

/// `s` as an argument.
pub fn a(s: impl AsRef<std::ffi::OsStr>) -> OsString {
    s.as_ref().to_os_string()
}

pub fn fixture(seed: u64) -> Fixture {
    let t = tempfile::tempdir().unwrap();
    let dir = t.path().join("m");
    gen_model(&dir, seed, &GenConfig::default()).unwrap();
    let spec = t.path().join("spec");
    let o = engy_audit(&[
        a("spec"),
        a("build"),
        a("--quiet"),
        a("--checkpoint"),
        a(&dir),
        a("--out"),
        a(&spec),
    ]);
    assert_eq!(o.status.code(), Some(0), "{o:?}");
    let c =
        commit::commit_checkpoint(&dir, &CommitOptions::default(), &Progress::default()).unwrap();
    let root = hex::encode(c.model_root);
    let proofs = t.path().join("proofs");
    std::fs::create_dir_all(&proofs).unwrap();
    let serve = Model::load_with(&dir, Precision::Bf16, Compute::Bf16).unwrap();
    let shape = serve.routing_shape().unwrap();
    for layer in 0..c.config.n_layers as u32 {
        let mut parts = vec![LayerPart::Router, LayerPart::Shared];
        parts.extend((0..shape.experts as u32).map(LayerPart::Expert));
        for part in parts {
            if let Ok(p) = c.open(UnitId::Layer { layer, part }) {
                let f = proofs.join(format!("{layer}-{part:?}.json"));
                std::fs::write(f, serde_json::to_vec(&p).unwrap()).unwrap();
            }
        }
    }
    Fixture {
        t,
        dir,
        spec,
        root,
        proofs,
        serve,
    }
}

/// The request's shape for `cells` (their layers and sizes) over the token ids `ids`.
pub fn shape_of(ids: &[u32], cells: &[Cell]) -> CellShape {
    let mut layers: Vec<u32> = cells.iter().map(|c| c.layer()).collect();
    layers.sort_unstable();
    layers.dedup();
    CellShape::for_request(
        ids,
        layers,
        cells[0].hidden(),
        cells[0].n_experts(),
        cells[0].top_k(),
        cells[0].router_logits().dtype(),
    )
    .unwrap()
}

/// The cells a serve of `how` commits for `ids`, and their tree under the request's shape.
pub fn serve(model: &Model, ids: &[u32], how: CellServe) -> (CellTree, Vec<Cell>) {
    let cells = serve_cells(model, ids, how).unwrap();
    let shape = shape_of(ids, &cells);
    (CellTree::from_cells(shape, &cells).unwrap(), cells)
}

/// A commitment (docs/PROTOCOL.md §3.10) of `prompt` + `output`, with `cells` when given,
/// as the bytes a miner's `response` carries.
pub fn commitment(prompt: &[u32], output: &[u32], cells: Option<&CellTree>) -> Vec<u8> {
    let mut c = json!({
        "model_root": "00".repeat(32),
        "output_token_ids": output,
        "toploc": {"proofs": [], "topk": 128, "decode_batching_size": 32,
                   "skip_prefill": true, "n_tokens": output.len(), "prompt_ids": prompt},
    });
    if let Some(t) = cells {
        c["cells"] = serde_json::to_value(CellsCommitment {
            scheme: engy_core::cells::SCHEME.into(),
            root: Hex(t.root()),
            shape: t.shape().clone(),
        })
        .unwrap();
    }
    serde_json::to_vec(&c).unwrap()
}

/// The seed the auditor derives for `commitment` from [`BEACON`].
pub fn seed_of(commitment: &[u8]) -> [u8; 32] {
    production_seed(&BEACON, &commitment_digest(commitment))
}

/// The bundle `tree` (cells `cells`) answers a challenge `(seed, n)` with.
pub fn bundle(tree: &CellTree, cells: &[Cell], seed: [u8; 32], n: u64) -> CellAuditBundle {
    CellAuditBundle::open(tree, &seed, n, |i| Ok(cells[i as usize].encode())).unwrap()
}

pub fn write(dir: &Path, name: &str, bytes: &[u8]) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, bytes).unwrap();
    p
}

impl Fixture {
    /// `engy-audit cells` against this checkpoint (`--spec`), the commitment file and the
    /// beacon, plus `extra`.
    pub fn cells(&self, commitment: &Path, extra: &[OsString]) -> (i32, String, String) {
        let mut args = vec![
            a("cells"),
            a("--checkpoint"),
            a(&self.dir),
            a("--spec"),
            a(&self.spec),
            a("--commitment"),
            a(commitment),
            a("--beacon"),
            a(hex::encode(BEACON)),
        ];
        args.extend_from_slice(extra);
        text(&engy_audit(&args))
    }

    /// Writes the commitment and the bundle, runs the audit with `--bundle`.
    pub fn audit(
        &self,
        name: &str,
        commitment: &[u8],
        bundle: &CellAuditBundle,
        extra: &[OsString],
    ) -> (i32, String, String) {
        let c = write(
            self.t.path(),
            &format!("{name}-commitment.json"),
            commitment,
        );
        let b = write(
            self.t.path(),
            &format!("{name}-bundle.json"),
            &serde_json::to_vec(bundle).unwrap(),
        );
        let mut args = vec![a("--bundle"), a(&b)];
        args.extend_from_slice(extra);
        self.cells(&c, &args)
    }
}
