//! The sglang double's engy_cells hooks write the spool byte for byte as the Python hook
//! package does (integrations/sglang/src/engy_cells/hooks.py `_pass` / `_write_manifest`):
//! Python's own `engy_cells.format` (standard library only) decodes `cells.bin`, recomputes
//! the shape, the roots and the token hash, and `json.dumps(doc, indent=1)` of the manifest
//! must equal the double's `manifest.json` exactly.
use std::path::PathBuf;
use std::process::Command;

use engy_core::cells::{Cell, RouterLogits};
use engy_devnet::sglang::cells_hooks::Spool;
use half::bf16;

const SCRIPT: &str = r#"
import hashlib, json, struct, sys
from engy_cells import format as fmt
spool, ids = sys.argv[1], [int(i) for i in sys.argv[2].split(",")]
req = open(spool + "/latest").read()
assert req.endswith("\n"), repr(req)
req = req.strip()
d = spool + "/" + req
b = open(d + "/cells.bin", "rb").read()
leaves, cells, o = [], [], 0
while o < len(b):
    c, end = fmt.decode_cell(b, o)
    leaves.append(fmt.cell_leaf(b[o:end]))
    cells.append(c)
    o = end
layers = sorted({c["layer"] for c in cells})
c0 = cells[0]
shape = dict(n_positions=len(cells) // len(layers), layers=layers, hidden=c0["hidden"],
             n_experts=c0["n_experts"], top_k=c0["top_k"], logits_dtype=c0["logits_dtype"])
tokens = hashlib.sha256(struct.pack("<%di" % len(ids), *ids)).hexdigest()
doc = dict(scheme=fmt.SCHEME, request=req, shape=shape, n_cells=len(leaves), passes=1,
           error=None, tokens_sha256=tokens)
tree = fmt.mth(leaves)
doc.update(tree_root=tree.hex())
doc.update(cells_root=fmt.node(fmt.shape_leaf(**dict(shape, tokens_sha256=tokens)), tree).hex())
want = json.dumps(doc, indent=1) + "\n"
got = open(d + "/manifest.json").read()
if got != want:
    sys.exit("manifest differs:\n--- double\n" + got + "--- python\n" + want)
print("ok", req, doc["cells_root"])
"#;

fn python_src() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../integrations/sglang/src")
}

#[test]
fn the_doubles_spool_is_what_the_python_hooks_write() {
    let dir = tempfile::tempdir().unwrap();
    let mut spool = Spool::open(dir.path()).unwrap();
    let ids = [11u32, 7, 300, 2];
    let mut cells = Vec::new();
    for p in 0..ids.len() as u32 {
        for layer in [1u32, 3, 4] {
            let v = |k: f32| {
                (0..16)
                    .map(|i| bf16::from_f32(p as f32 - k * i as f32 / 7.0))
                    .collect()
            };
            let logits = RouterLogits::F32((0..8).map(|e| (e as f32 - p as f32) / 3.0).collect());
            cells.push(Cell::new(p, layer, v(1.0), logits, vec![6, 1, 2], v(-2.5)).unwrap());
        }
    }
    spool.pass(0, &ids, &cells).unwrap();
    let list: Vec<String> = ids.iter().map(u32::to_string).collect();
    let out = Command::new("python3")
        .env("PYTHONPATH", python_src())
        .arg("-c")
        .arg(SCRIPT)
        .arg(dir.path())
        .arg(list.join(","))
        .output()
        .expect("run python3");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "{text}");
    assert!(text.starts_with("ok req-000001 "), "{text}");
}
