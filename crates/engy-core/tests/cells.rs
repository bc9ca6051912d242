//! `engy-cells/v2` (specs/CELLS.md): properties of `engy_core::cells` and the fixed vectors
//! of the independent Python implementation.
//!
//! * `vectors_from_python_match`: every case of `$ENGY_VECTORS_DIR/cells/vectors.json`
//!   (default `tests/vectors/cells/`, made by `integrations/sglang/tests/make_vectors.py`
//!   with hashlib) is rebuilt from its parts in Rust: the tokens' SHA-256, cell bytes, leaves,
//!   shape leaf, roots, every inclusion path, the challenge indices and the production seed
//!   must be equal.
//! * `python_regenerates_the_vectors`: with `ENGY_PY_REVERSE=1` (CI), runs that script and
//!   requires its output to equal the committed file (visible SKIP otherwise).
//! * property tests: encode/decode round trips, a flipped bit anywhere in a cell or a path
//!   fails verification, selection is distinct, in range and deterministic.
use std::path::{Path, PathBuf};
use std::process::Command;

use engy_core::cells::{
    cell_leaf, decode_all, production_seed, select, tokens_sha256, verify_opening, Cell, CellError,
    CellPath, CellShape, CellTree, LogitsDtype, RouterLogits,
};
use engy_core::commit::spec::Hex;
use half::bf16;
use proptest::prelude::*;
use serde_json::Value;

/// A tokens digest for shapes built by hand.
const T: [u8; 32] = [7; 32];

fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn vectors_file() -> PathBuf {
    match std::env::var_os("ENGY_VECTORS_DIR") {
        Some(d) => PathBuf::from(d).join("cells/vectors.json"),
        None => workspace().join("tests/vectors/cells/vectors.json"),
    }
}

fn hx(v: &Value) -> Vec<u8> {
    hex::decode(v.as_str().expect("hex string")).expect("hex")
}

fn digest(v: &Value) -> [u8; 32] {
    hx(v).try_into().expect("32 bytes")
}

fn bf16s(b: &[u8]) -> Vec<bf16> {
    b.chunks_exact(2)
        .map(|c| bf16::from_bits(u16::from_le_bytes([c[0], c[1]])))
        .collect()
}

#[test]
fn vectors_from_python_match() {
    let doc: Value =
        serde_json::from_slice(&std::fs::read(vectors_file()).expect("read vectors")).unwrap();
    assert_eq!(doc["schema"], "engy-cells/vectors/v2");
    let ps = &doc["production_seed"];
    assert_eq!(
        hex::encode(production_seed(
            &digest(&ps["beacon"]),
            &digest(&ps["commitment_digest"])
        )),
        ps["seed"]
    );
    let cases = doc["cases"].as_array().unwrap();
    assert!(!cases.is_empty());
    for case in cases {
        let id = case["id"].as_str().unwrap();
        let shape: CellShape = serde_json::from_value(case["shape"].clone()).unwrap();
        let tokens: Vec<u32> = case["tokens"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap() as u32)
            .collect();
        assert_eq!(
            shape.tokens_sha256(),
            &tokens_sha256(&tokens),
            "{id}: tokens"
        );
        assert_eq!(
            CellShape::for_request(
                &tokens,
                shape.layers().to_vec(),
                shape.hidden(),
                shape.n_experts(),
                shape.top_k(),
                shape.logits_dtype().unwrap()
            )
            .unwrap(),
            shape,
            "{id}: shape from the tokens"
        );
        assert_eq!(
            hex::encode(shape.leaf()),
            case["shape_leaf"],
            "{id}: shape leaf"
        );
        let mut cells = Vec::new();
        for c in case["cells"].as_array().unwrap() {
            let dtype = LogitsDtype::from_code(c["logits_dtype"].as_u64().unwrap() as u32).unwrap();
            let lb = hx(&c["logits_hex"]);
            let logits = match dtype {
                LogitsDtype::Bf16 => RouterLogits::Bf16(bf16s(&lb)),
                LogitsDtype::F32 => RouterLogits::F32(
                    lb.chunks_exact(4)
                        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                        .collect(),
                ),
            };
            let ids: Vec<u32> = c["expert_ids"]
                .as_array()
                .unwrap()
                .iter()
                .map(|v| v.as_u64().unwrap() as u32)
                .collect();
            let cell = Cell::new(
                c["position"].as_u64().unwrap() as u32,
                c["layer"].as_u64().unwrap() as u32,
                bf16s(&hx(&c["x_hex"])),
                logits,
                ids,
                bf16s(&hx(&c["y_hex"])),
            )
            .unwrap();
            let enc = cell.encode();
            assert_eq!(hex::encode(&enc), c["encoded_hex"], "{id}: encoding");
            assert_eq!(hex::encode(cell.leaf()), c["leaf"], "{id}: leaf");
            assert_eq!(Cell::decode(&enc).unwrap(), cell, "{id}: decode");
            cells.push(cell);
        }
        let tree = CellTree::from_cells(shape.clone(), &cells).unwrap();
        assert_eq!(hex::encode(tree.tree_root()), case["tree_root"], "{id}");
        assert_eq!(hex::encode(tree.root()), case["cells_root"], "{id}");
        for p in case["paths"].as_array().unwrap() {
            let index = p["index"].as_u64().unwrap();
            let want: Vec<Hex> = p["siblings"]
                .as_array()
                .unwrap()
                .iter()
                .map(|s| Hex(digest(s)))
                .collect();
            let got = tree.open(index).unwrap();
            assert_eq!(got.siblings, want, "{id}: path {index}");
            let bytes = cells[index as usize].encode();
            verify_opening(&shape, &tree.root(), &bytes, &got).unwrap();
        }
        let ch = &case["challenge"];
        let got = select(
            &digest(&ch["seed"]),
            &tree.root(),
            shape.n_cells(),
            ch["n"].as_u64().unwrap(),
        )
        .unwrap();
        let want: Vec<u64> = ch["indices"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap())
            .collect();
        assert_eq!(got, want, "{id}: challenge");
    }
}

#[test]
fn python_regenerates_the_vectors() {
    if std::env::var("ENGY_PY_REVERSE").as_deref() != Ok("1") {
        println!("SKIP python_regenerates_the_vectors: set ENGY_PY_REVERSE=1 to recompute tests/vectors/cells with integrations/sglang/tests/make_vectors.py");
        return;
    }
    let out = Command::new("python3")
        .arg(workspace().join("integrations/sglang/tests/make_vectors.py"))
        .output()
        .expect("run python3");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let fresh: Value = serde_json::from_slice(&out.stdout).unwrap();
    let committed: Value = serde_json::from_slice(&std::fs::read(vectors_file()).unwrap()).unwrap();
    assert_eq!(
        fresh, committed,
        "make_vectors.py output differs from the committed vectors"
    );
}

// ---- properties ---------------------------------------------------------------------------

fn arb_cell() -> impl Strategy<Value = Cell> {
    (1usize..12, 1u32..10, any::<bool>()).prop_flat_map(|(hidden, n_experts, f32_logits)| {
        (
            any::<u32>(),
            any::<u32>(),
            prop::collection::vec(any::<u16>(), hidden),
            prop::collection::vec(any::<u32>(), n_experts as usize),
            prop::sample::subsequence((0..n_experts).collect::<Vec<_>>(), 1..=n_experts as usize)
                .prop_shuffle(),
            prop::collection::vec(any::<u16>(), hidden),
        )
            .prop_map(move |(p, l, x, lg, ids, y)| {
                // Any finite bit pattern (v2 refuses NaN and infinities: clear the top
                // exponent bit of the all-ones exponents).
                let f32f = |v: u32| {
                    if (v >> 23) & 0xff == 0xff {
                        v & !(1 << 30)
                    } else {
                        v
                    }
                };
                let b16f = |v: u16| {
                    if (v >> 7) & 0xff == 0xff {
                        v & !(1 << 14)
                    } else {
                        v
                    }
                };
                let logits = if f32_logits {
                    RouterLogits::F32(lg.into_iter().map(|v| f32::from_bits(f32f(v))).collect())
                } else {
                    RouterLogits::Bf16(
                        lg.into_iter()
                            .map(|v| bf16::from_bits(b16f(v as u16)))
                            .collect(),
                    )
                };
                let b = |v: Vec<u16>| v.into_iter().map(|v| bf16::from_bits(b16f(v))).collect();
                Cell::new(p, l, b(x), logits, ids, b(y)).unwrap()
            })
    })
}

/// Bit-level equality (NaN payloads included).
fn same_bits(a: &Cell, b: &Cell) -> bool {
    a.encode() == b.encode()
}

/// A small request: every (position, layer) cell with fixed sizes.
fn arb_request() -> impl Strategy<Value = (CellShape, Vec<Cell>)> {
    (
        1u32..6,
        prop::collection::btree_set(0u32..40, 1..5),
        1u32..5,
        2u32..6,
        any::<u64>(),
    )
        .prop_map(|(n_positions, layers, hidden, n_experts, salt)| {
            let layers: Vec<u32> = layers.into_iter().collect();
            let shape = CellShape::new(
                n_positions,
                layers.clone(),
                hidden,
                n_experts,
                2,
                LogitsDtype::Bf16,
                [salt as u8; 32],
            )
            .unwrap();
            let mut cells = Vec::new();
            for p in 0..n_positions {
                for &l in &layers {
                    let v = |k: u64| {
                        // finite: the exponent's top bit cleared
                        bf16::from_bits(
                            (salt ^ (u64::from(p) << 32) ^ (u64::from(l) << 16) ^ k) as u16
                                & !(1 << 14),
                        )
                    };
                    cells.push(
                        Cell::new(
                            p,
                            l,
                            (0..hidden).map(|i| v(u64::from(i))).collect(),
                            RouterLogits::Bf16(
                                (0..n_experts).map(|i| v(100 + u64::from(i))).collect(),
                            ),
                            vec![(p + l) % n_experts, (p + l + 1) % n_experts],
                            (0..hidden).map(|i| v(200 + u64::from(i))).collect(),
                        )
                        .unwrap(),
                    );
                }
            }
            (shape, cells)
        })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn encode_decode_round_trip(cell in arb_cell()) {
        let bytes = cell.encode();
        prop_assert_eq!(
            bytes.len(),
            Cell::encoded_len(cell.hidden(), cell.n_experts(), cell.top_k(), cell.router_logits().dtype())
        );
        let back = Cell::decode(&bytes).unwrap();
        prop_assert!(same_bits(&back, &cell));
        prop_assert_eq!(back.encode(), bytes.clone());
        // Back to back, as in a spool file.
        let mut two = bytes.clone();
        two.extend_from_slice(&bytes);
        let all = decode_all(&two).unwrap();
        prop_assert_eq!(all.len(), 2);
        // Any strict prefix is truncated, one more byte is trailing.
        for cut in [0, 1, bytes.len() / 2, bytes.len() - 1] {
            let truncated = matches!(Cell::decode(&bytes[..cut]), Err(CellError::Truncated { .. }));
            prop_assert!(truncated);
        }
        let mut longer = bytes.clone();
        longer.push(0);
        prop_assert_eq!(Cell::decode(&longer), Err(CellError::Trailing { extra: 1 }));
    }

    #[test]
    fn every_opening_verifies_and_any_flipped_bit_fails(
        (shape, cells) in arb_request(), pick in any::<prop::sample::Index>(), bit in any::<prop::sample::Index>()
    ) {
        let tree = CellTree::from_cells(shape.clone(), &cells).unwrap();
        let root = tree.root();
        for (i, c) in cells.iter().enumerate() {
            let path = tree.open(i as u64).unwrap();
            let got = verify_opening(&shape, &root, &c.encode(), &path).unwrap();
            prop_assert!(same_bits(&got, c));
        }
        let i = pick.index(cells.len());
        let bytes = cells[i].encode();
        let path = tree.open(i as u64).unwrap();
        // A flipped bit in the cell bytes.
        let b = bit.index(bytes.len() * 8);
        let mut bad = bytes.clone();
        bad[b / 8] ^= 1 << (b % 8);
        prop_assert!(verify_opening(&shape, &root, &bad, &path).is_err());
        // A flipped bit in a sibling, the index, or the root.
        if !path.siblings.is_empty() {
            let s = bit.index(path.siblings.len() * 256);
            let mut p2 = path.clone();
            p2.siblings[s / 256].0[(s % 256) / 8] ^= 1 << (s % 8);
            prop_assert!(verify_opening(&shape, &root, &bytes, &p2).is_err());
        }
        let moved = CellPath { index: path.index ^ 1, siblings: path.siblings.clone() };
        prop_assert!(verify_opening(&shape, &root, &bytes, &moved).is_err());
        let mut r2 = root;
        r2[bit.index(32)] ^= 0x80;
        let wrong_root = matches!(verify_opening(&shape, &r2, &bytes, &path), Err(CellError::RootMismatch { .. }));
        prop_assert!(wrong_root);
        // Another shape (one more position) is another commitment.
        let other = CellShape::new(shape.n_positions() + 1, shape.layers().to_vec(), shape.hidden(),
            shape.n_experts(), shape.top_k(), LogitsDtype::Bf16, *shape.tokens_sha256()).unwrap();
        prop_assert!(verify_opening(&other, &root, &bytes, &path).is_err());
        // So is one over other tokens (the same sizes).
        let mut tokens = *shape.tokens_sha256();
        tokens[bit.index(32)] ^= 1;
        let retok = CellShape::new(shape.n_positions(), shape.layers().to_vec(), shape.hidden(),
            shape.n_experts(), shape.top_k(), LogitsDtype::Bf16, tokens).unwrap();
        let moved_tokens = matches!(verify_opening(&retok, &root, &bytes, &path), Err(CellError::RootMismatch { .. }));
        prop_assert!(moved_tokens);
        prop_assert_eq!(cell_leaf(&bytes), tree.leaves()[i]);
    }

    #[test]
    fn selection_is_distinct_in_range_and_deterministic(
        seed in any::<[u8; 32]>(), root in any::<[u8; 32]>(), n_cells in 1u64..5000, frac in 0.0f64..=1.0
    ) {
        let n = ((n_cells as f64) * frac).min(200.0) as u64;
        let a = select(&seed, &root, n_cells, n).unwrap();
        prop_assert_eq!(a.len() as u64, n);
        prop_assert!(a.iter().all(|&i| i < n_cells));
        let set: std::collections::BTreeSet<_> = a.iter().collect();
        prop_assert_eq!(set.len(), a.len());
        prop_assert_eq!(&select(&seed, &root, n_cells, n).unwrap(), &a);
        // A prefix of a longer challenge: the draw order does not depend on n.
        if n < n_cells {
            let longer = select(&seed, &root, n_cells, n + 1).unwrap();
            prop_assert_eq!(&longer[..a.len()], &a[..]);
        }
        prop_assert_eq!(select(&seed, &root, n_cells, n_cells + 1), Err(CellError::TooMany { n: n_cells + 1, n_cells }));
    }
}

#[test]
fn selection_depends_on_seed_and_root() {
    let a = select(&[1; 32], &[2; 32], 1 << 20, 16).unwrap();
    assert_ne!(a, select(&[3; 32], &[2; 32], 1 << 20, 16).unwrap());
    assert_ne!(a, select(&[1; 32], &[4; 32], 1 << 20, 16).unwrap());
}

#[test]
fn selection_is_uniform_enough() {
    // 3 cells: 2^64 mod 3 = 1, so rejection matters only for one value; check the counts
    // of many one-cell draws are balanced (chi-square, 2 dof, p = 0.001 bound 13.8).
    let mut counts = [0u64; 3];
    for s in 0..30_000u32 {
        let mut seed = [0u8; 32];
        seed[..4].copy_from_slice(&s.to_le_bytes());
        counts[select(&seed, &[9; 32], 3, 1).unwrap()[0] as usize] += 1;
    }
    let e = 10_000.0;
    let chi: f64 = counts.iter().map(|&c| (c as f64 - e).powi(2) / e).sum();
    assert!(chi < 13.8, "counts {counts:?} chi² {chi}");
}

#[test]
fn cells_out_of_order_or_misfit_are_refused() {
    let shape = CellShape::new(2, vec![1, 3], 2, 4, 1, LogitsDtype::Bf16, T).unwrap();
    let mk = |p, l| {
        Cell::new(
            p,
            l,
            vec![bf16::ONE; 2],
            RouterLogits::Bf16(vec![bf16::ZERO; 4]),
            vec![0],
            vec![bf16::ONE; 2],
        )
        .unwrap()
    };
    let good = vec![mk(0, 1), mk(0, 3), mk(1, 1), mk(1, 3)];
    assert!(CellTree::from_cells(shape.clone(), &good).is_ok());
    let swapped = vec![mk(0, 3), mk(0, 1), mk(1, 1), mk(1, 3)];
    assert!(matches!(
        CellTree::from_cells(shape.clone(), &swapped),
        Err(CellError::ShapeMismatch(_))
    ));
    assert!(CellTree::from_cells(shape.clone(), &good[..3]).is_err());
    assert_eq!(shape.index_of(1, 3), Some(3));
    assert_eq!(shape.cell_at(2), Some((1, 1)));
    assert_eq!(shape.index_of(2, 1), None);
    assert_eq!(shape.index_of(0, 2), None);
    assert!(CellShape::new(0, vec![1], 2, 4, 1, LogitsDtype::Bf16, T).is_err());
    assert!(CellShape::new(1, vec![3, 1], 2, 4, 1, LogitsDtype::Bf16, T).is_err());
    assert!(CellShape::new(1, vec![1], 2, 4, 5, LogitsDtype::Bf16, T).is_err());
    // Deserialising validates the same way.
    let json = serde_json::to_value(&shape).unwrap();
    assert_eq!(
        serde_json::from_value::<CellShape>(json.clone()).unwrap(),
        shape
    );
    for (k, v) in [
        ("n_positions", serde_json::json!(0)),
        ("layers", serde_json::json!([3, 1])),
        ("logits_dtype", serde_json::json!(7)),
        ("top_k", serde_json::json!(9)),
        ("tokens_sha256", serde_json::json!("ab")),
        ("extra", serde_json::json!(1)),
    ] {
        let mut bad = json.clone();
        bad[k] = v;
        assert!(serde_json::from_value::<CellShape>(bad).is_err(), "{k}");
    }
}

#[test]
fn a_cell_committed_at_another_place_is_refused() {
    // A miner that commits a tree with cells out of place (here: every position holds
    // position 0's cell) gets valid paths, but the opened header is not the challenged cell.
    use engy_core::commit::tree::{inclusion_path, mth, node};
    let shape = CellShape::new(2, vec![4], 2, 4, 1, LogitsDtype::Bf16, T).unwrap();
    let cell = Cell::new(
        0,
        4,
        vec![bf16::ONE; 2],
        RouterLogits::Bf16(vec![bf16::ZERO; 4]),
        vec![2],
        vec![bf16::ONE; 2],
    )
    .unwrap();
    let leaves = vec![cell.leaf(), cell.leaf()];
    let root = node(&shape.leaf(), &mth(&leaves));
    let path = |i: usize| CellPath {
        index: i as u64,
        siblings: inclusion_path(&leaves, i)
            .unwrap()
            .into_iter()
            .map(Hex)
            .collect(),
    };
    assert!(verify_opening(&shape, &root, &cell.encode(), &path(0)).is_ok());
    assert!(matches!(
        verify_opening(&shape, &root, &cell.encode(), &path(1)),
        Err(CellError::ShapeMismatch(_))
    ));
}

#[test]
fn bad_cell_parts_and_bytes_are_typed_errors() {
    let x = vec![bf16::ONE; 3];
    let lg = || RouterLogits::Bf16(vec![bf16::ZERO; 4]);
    assert!(matches!(
        Cell::new(0, 0, x.clone(), lg(), vec![1, 1], x.clone()),
        Err(CellError::BadExpertIds { .. })
    ));
    assert!(matches!(
        Cell::new(0, 0, x.clone(), lg(), vec![4], x.clone()),
        Err(CellError::BadExpertIds { .. })
    ));
    assert!(matches!(
        Cell::new(0, 0, x.clone(), lg(), vec![], x.clone()),
        Err(CellError::BadSize(_))
    ));
    assert!(matches!(
        Cell::new(0, 0, x.clone(), lg(), vec![0], vec![bf16::ONE; 2]),
        Err(CellError::Inconsistent(_))
    ));
    let good = Cell::new(0, 0, x.clone(), lg(), vec![3, 0], x.clone()).unwrap();
    assert_eq!(good.expert_ids(), &[0, 3]);
    let bytes = good.encode();
    let mut bad = bytes.clone();
    bad[20] = 3; // logits dtype code
    assert_eq!(Cell::decode(&bad), Err(CellError::BadDtype(3)));
    let mut bad = bytes.clone();
    bad[8..12].copy_from_slice(&u32::MAX.to_le_bytes()); // hidden
    assert!(matches!(Cell::decode(&bad), Err(CellError::BadSize(_))));
    let mut bad = bytes.clone();
    let ids_at = 24 + 6 + 8;
    bad[ids_at..ids_at + 4].copy_from_slice(&3u32.to_le_bytes()); // ids [3, 3]
    assert!(matches!(
        Cell::decode(&bad),
        Err(CellError::BadExpertIds { .. })
    ));
    // Sizes above the v2 caps.
    let mut bad = bytes.clone();
    bad[8..12].copy_from_slice(&((1u32 << 16) + 1).to_le_bytes());
    assert!(matches!(Cell::decode(&bad), Err(CellError::BadSize(_))));
    let mut bad = bytes.clone();
    bad[12..16].copy_from_slice(&((1u32 << 13) + 1).to_le_bytes());
    assert!(matches!(Cell::decode(&bad), Err(CellError::BadSize(_))));
}

#[test]
fn non_finite_values_are_not_cells() {
    // A NaN logit compares false with every tolerance; v2 refuses it in the format.
    let x = vec![bf16::ONE; 3];
    let lg = |v: f32| RouterLogits::F32(vec![0.0, v, 1.0, 2.0]);
    assert_eq!(
        Cell::new(0, 0, x.clone(), lg(f32::NAN), vec![1], x.clone()),
        Err(CellError::NonFinite {
            field: "router_logits",
            at: 1
        })
    );
    assert!(Cell::new(0, 0, x.clone(), lg(f32::INFINITY), vec![1], x.clone()).is_err());
    let mut nan_y = x.clone();
    nan_y[2] = bf16::NAN;
    assert_eq!(
        Cell::new(0, 0, x.clone(), lg(0.5), vec![1], nan_y),
        Err(CellError::NonFinite { field: "y", at: 2 })
    );
    // The same in bytes: x[0] set to a bf16 NaN.
    let good = Cell::new(0, 0, x.clone(), lg(0.5), vec![1], x.clone()).unwrap();
    let mut bad = good.encode();
    bad[24..26].copy_from_slice(&0x7fc0u16.to_le_bytes());
    assert_eq!(
        Cell::decode(&bad),
        Err(CellError::NonFinite { field: "x", at: 0 })
    );
}
