//! The cell audit bundle (specs/CELLS.md §7): the spec's example checks, a bundle a tree opens
//! round-trips through JSON and checks, and every way of not answering the challenge is
//! refused or fails its cell.
use std::path::Path;

use engy_core::cells::{
    parse_bundle, BundleError, Cell, CellAuditBundle, CellError, CellShape, CellTree, Challenge,
    LogitsDtype, RouterLogits, MAX_BUNDLE_BYTES,
};
use half::bf16;

/// The JSON block of specs/CELLS.md §7.
fn spec_example() -> String {
    let md =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("../../specs/CELLS.md"))
            .unwrap();
    let (_, s7) = md.split_once("## 7. The cell audit bundle").unwrap();
    let (_, rest) = s7.split_once("```json\n").unwrap();
    rest.split_once("```").unwrap().0.to_string()
}

/// The request's token ids (prompt + output).
const TOKENS: [u32; 5] = [11, 7, 5, 3, 2];

fn request() -> (CellTree, Vec<Cell>) {
    let shape = CellShape::for_request(&TOKENS, vec![1, 3], 8, 6, 2, LogitsDtype::Bf16).unwrap();
    let mut cells = Vec::new();
    for p in 0..5u32 {
        for (j, &l) in [1u32, 3].iter().enumerate() {
            let v = |k: u32| bf16::from_f32((p * 31 + l * 7 + k) as f32 / 17.0 - 3.0);
            cells.push(
                Cell::new(
                    p,
                    l,
                    (0..8).map(v).collect(),
                    RouterLogits::Bf16((0..6).map(|k| v(k + 100)).collect()),
                    vec![(p + j as u32) % 6, (p + j as u32 + 2) % 6],
                    (0..8).map(|k| v(k + 50)).collect(),
                )
                .unwrap(),
            );
        }
    }
    (CellTree::from_cells(shape, &cells).unwrap(), cells)
}

#[test]
fn the_specs_example_bundle_checks() {
    let b: CellAuditBundle = serde_json::from_str(&spec_example()).unwrap();
    let checked = b.check().unwrap();
    assert_eq!(checked.len(), 1);
    let cell = checked[0].opened.as_ref().unwrap();
    assert_eq!(cell.expert_ids(), &[3]);
    assert_eq!((checked[0].position, checked[0].layer), (0, 0));
}

#[test]
fn a_bundle_answers_its_challenge_and_nothing_else() {
    let (tree, cells) = request();
    let seed = [9u8; 32];
    let b = CellAuditBundle::open(&tree, &seed, 4, |i| Ok(cells[i as usize].encode())).unwrap();
    // JSON round trip, then every chosen cell opens.
    let b: CellAuditBundle = serde_json::from_str(&serde_json::to_string(&b).unwrap()).unwrap();
    let checked = b.check().unwrap();
    assert_eq!(
        checked.iter().map(|c| c.index).collect::<Vec<_>>(),
        b.challenge().unwrap()
    );
    for c in &checked {
        let cell = c.opened.as_ref().unwrap();
        assert_eq!((cell.position(), cell.layer()), (c.position, c.layer));
        assert_eq!(cell, &cells[c.index as usize]);
    }

    // An opening of a cell the challenge did not choose: refused.
    let chosen = b.challenge().unwrap();
    let other = (0..10).find(|i| !chosen.contains(i)).unwrap();
    let mut extra = b.clone();
    extra.openings[1].index = other;
    assert_eq!(
        extra.check(),
        Err(BundleError::NotChallenged { index: other })
    );
    // One cell twice: refused.
    let mut twice = b.clone();
    twice.openings[1] = twice.openings[0].clone();
    assert_eq!(
        twice.check(),
        Err(BundleError::Duplicate {
            index: b.openings[0].index
        })
    );
    // More cells than the tree: refused.
    let mut many = b.clone();
    many.n = 11;
    assert!(matches!(
        many.check(),
        Err(BundleError::Challenge(CellError::TooMany { .. }))
    ));
    // A missing opening fails that cell only.
    let mut missing = b.clone();
    let gone = missing.openings.remove(2).index;
    let checked = missing.check().unwrap();
    for c in &checked {
        if c.index == gone {
            assert_eq!(c.opened, Err(CellError::NotOpened { index: gone }));
        } else {
            assert!(c.opened.is_ok());
        }
    }
    // Other bytes than committed: that cell's path does not lead to the root.
    let mut forged = b.clone();
    let mut bytes = forged.openings[0].cell.clone();
    let last = bytes.len() - 1;
    bytes[last] ^= 1;
    forged.openings[0].cell = bytes;
    let checked = forged.check().unwrap();
    let f = checked
        .iter()
        .find(|c| c.index == b.openings[0].index)
        .unwrap();
    assert!(
        matches!(f.opened, Err(CellError::RootMismatch { .. })),
        "{f:?}"
    );
    // Another seed chooses other cells: the same openings no longer answer it.
    let mut reseeded = b.clone();
    reseeded.seed.0[0] ^= 1;
    assert!(matches!(
        reseeded.check(),
        Err(BundleError::NotChallenged { .. })
    ));
}

#[test]
fn unknown_keys_and_bad_base64_are_refused() {
    let example = spec_example();
    let mut v: serde_json::Value = serde_json::from_str(&example).unwrap();
    v["extra"] = 1.into();
    assert!(serde_json::from_value::<CellAuditBundle>(v).is_err());
    let mut v: serde_json::Value = serde_json::from_str(&example).unwrap();
    v["openings"][0]["cell"] = "not base64!".into();
    let e = serde_json::from_value::<CellAuditBundle>(v).unwrap_err();
    assert!(e.to_string().contains("base64"), "{e}");
}

#[test]
fn the_auditors_challenge_is_the_only_answerable_one() {
    let (tree, cells) = request();
    let seed = [9u8; 32];
    let want = Challenge {
        cells_root: tree.root(),
        shape: tree.shape().clone(),
        seed,
        n: 4,
    };
    let honest =
        CellAuditBundle::open(&tree, &seed, 4, |i| Ok(cells[i as usize].encode())).unwrap();
    let checked = honest.check_challenge(&want).unwrap();
    assert!(checked.iter().all(|c| c.opened.is_ok()));

    // n = 0 and no openings: its own challenge is empty, the auditor's is not.
    let mut none = honest.clone();
    none.n = 0;
    none.openings.clear();
    assert!(none.check().unwrap().is_empty());
    assert_eq!(
        none.check_challenge(&want),
        Err(BundleError::N { got: 0, want: 4 })
    );
    // A seed the miner chose (its bundle consistent with it): not the auditor's.
    let ground =
        CellAuditBundle::open(&tree, &[1; 32], 4, |i| Ok(cells[i as usize].encode())).unwrap();
    assert!(ground.check().is_ok());
    assert!(matches!(
        ground.check_challenge(&want),
        Err(BundleError::Seed { .. })
    ));
    // A fresh tree over one position (a shrunk shape), consistent with itself.
    let small_shape =
        CellShape::for_request(&TOKENS[..1], vec![1, 3], 8, 6, 2, LogitsDtype::Bf16).unwrap();
    let small = CellTree::from_cells(small_shape, &cells[..2]).unwrap();
    let shrunk =
        CellAuditBundle::open(&small, &seed, 2, |i| Ok(cells[i as usize].encode())).unwrap();
    assert!(shrunk.check().is_ok());
    assert!(matches!(
        shrunk.check_challenge(&want),
        Err(BundleError::Root { .. })
    ));
    // The same root claimed with another shape: the shape differs (and would not open).
    let mut reshaped = honest.clone();
    reshaped.shape = CellShape::for_request(&TOKENS, vec![1], 8, 6, 2, LogitsDtype::Bf16).unwrap();
    match reshaped.check_challenge(&want) {
        Err(BundleError::Shape(why)) => assert!(why.contains("layers [1]"), "{why}"),
        other => panic!("{other:?}"),
    }
    // Cells over other tokens: the request's shape says which tokens.
    let mut other_tokens = TOKENS;
    other_tokens[2] = 6;
    let retok =
        CellShape::for_request(&other_tokens, vec![1, 3], 8, 6, 2, LogitsDtype::Bf16).unwrap();
    assert!(retok
        .request_mismatch(tree.shape())
        .unwrap()
        .contains("tokens_sha256"));
    assert_eq!(tree.shape().request_mismatch(tree.shape()), None);
    // More openings than n: refused before any is checked.
    let mut padded = honest.clone();
    padded.openings.push(padded.openings[0].clone());
    assert!(matches!(
        padded.check_challenge(&want),
        Err(BundleError::TooManyOpenings { .. })
    ));
}

#[test]
fn a_bundle_above_the_cap_is_not_parsed() {
    let example = spec_example();
    assert!(parse_bundle(example.as_bytes()).is_ok());
    let mut big = example.into_bytes();
    big.resize(MAX_BUNDLE_BYTES + 1, b' ');
    assert_eq!(
        parse_bundle(&big),
        Err(BundleError::TooLarge {
            len: MAX_BUNDLE_BYTES + 1
        })
    );
    assert!(matches!(
        parse_bundle(b"{}"),
        Err(BundleError::Malformed(_))
    ));
}

#[test]
fn a_path_longer_than_64_fails_its_cell() {
    let (tree, cells) = request();
    let seed = [9u8; 32];
    let mut b = CellAuditBundle::open(&tree, &seed, 1, |i| Ok(cells[i as usize].encode())).unwrap();
    b.openings[0].path = vec![b.openings[0].path[0]; 65];
    let checked = b.check().unwrap();
    assert!(matches!(
        checked[0].opened,
        Err(CellError::BadPath { len: 65, .. })
    ));
}
