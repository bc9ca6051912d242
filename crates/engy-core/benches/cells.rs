//! Miner-side and auditor-side costs of `engy-cells/v2` (specs/CELLS.md) at a Qwen3.6-35B-A3B
//! cell shape (hidden 2048, 256 experts, top-8, bf16 logits: 8,760 bytes a cell).
//!
//! * `cells/encode_leaf`: one cell to canonical bytes and its leaf (the hook's work per
//!   (token, MoE layer), in Rust).
//! * `cells/tree_from_bytes_2560`: a spooled request of 64 positions × 40 MoE layers (22 MB)
//!   decoded, checked against the shape and hashed to `cells_root` (`CellTree::from_bytes`).
//! * `cells/open_of_81920`: one inclusion path (`CellTree::open`) in a tree of 2,048
//!   positions × 40 layers.
//! * `cells/verify_opening_of_81920`: the auditor's check of one opened cell in that tree.
use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use engy_core::cells::{verify_opening, Cell, CellShape, CellTree, LogitsDtype, RouterLogits};
use half::bf16;

const HIDDEN: u32 = 2048;
const EXPERTS: u32 = 256;
const TOP_K: u32 = 8;
const LAYERS: u32 = 40;

fn cell(position: u32, layer: u32) -> Cell {
    let v = |i: u32| bf16::from_f32(((position * 31 + layer * 7 + i) % 97) as f32 / 97.0 - 0.5);
    Cell::new(
        position,
        layer,
        (0..HIDDEN).map(v).collect(),
        RouterLogits::Bf16((0..EXPERTS).map(v).collect()),
        (0..TOP_K)
            .map(|k| (position + layer + 29 * k) % EXPERTS)
            .collect(),
        (0..HIDDEN).map(|i| v(i + 1)).collect(),
    )
    .unwrap()
}

fn shape(n_positions: u32) -> CellShape {
    CellShape::new(
        n_positions,
        (0..LAYERS).collect(),
        HIDDEN,
        EXPERTS,
        TOP_K,
        LogitsDtype::Bf16,
        [7; 32],
    )
    .unwrap()
}

fn bench(c: &mut Criterion) {
    let mut g = c.benchmark_group("cells");
    let one = cell(3, 5);
    let len = one.encode().len() as u64;
    g.throughput(Throughput::Bytes(len));
    g.bench_function("encode_leaf", |b| b.iter(|| one.leaf()));

    let n_positions = 64;
    let mut spool = Vec::new();
    for p in 0..n_positions {
        for l in 0..LAYERS {
            spool.extend_from_slice(&cell(p, l).encode());
        }
    }
    g.throughput(Throughput::Bytes(spool.len() as u64));
    g.sample_size(10);
    g.bench_function("tree_from_bytes_2560", |b| {
        b.iter(|| {
            CellTree::from_bytes(shape(n_positions), &spool)
                .unwrap()
                .root()
        })
    });

    // A big request: the leaves only (the cells' bytes do not change the path work).
    let big = 2048;
    let small = CellTree::from_bytes(shape(n_positions), &spool).unwrap();
    let leaves: Vec<[u8; 32]> = (0..big * LAYERS as usize)
        .map(|i| small.leaves()[i % small.leaves().len()])
        .collect();
    let big_shape = shape(big as u32);
    let index = 1234 * u64::from(LAYERS) + 17;
    let opened = cell(1234, 17);
    let mut leaves = leaves;
    leaves[index as usize] = opened.leaf();
    let root =
        engy_core::commit::tree::node(&big_shape.leaf(), &engy_core::commit::tree::mth(&leaves));
    g.throughput(Throughput::Elements(1));
    // `CellTree::open` on a tree of the same size (tiny cells: the path work does not
    // depend on the cells' size).
    let tiny_shape = CellShape::new(
        big as u32,
        (0..LAYERS).collect(),
        2,
        4,
        1,
        LogitsDtype::Bf16,
        [7; 32],
    )
    .unwrap();
    let tiny: Vec<Cell> = (0..big as u32)
        .flat_map(|p| {
            (0..LAYERS).map(move |l| {
                Cell::new(
                    p,
                    l,
                    vec![bf16::from_f32(p as f32); 2],
                    RouterLogits::Bf16(vec![bf16::from_f32(l as f32); 4]),
                    vec![(p + l) % 4],
                    vec![bf16::ONE; 2],
                )
                .unwrap()
            })
        })
        .collect();
    let tiny_tree = CellTree::from_cells(tiny_shape, &tiny).unwrap();
    g.bench_function("open_of_81920", |b| {
        b.iter(|| tiny_tree.open(index).unwrap())
    });
    let path = engy_core::cells::CellPath {
        index,
        siblings: engy_core::commit::tree::inclusion_path(&leaves, index as usize)
            .unwrap()
            .into_iter()
            .map(engy_core::commit::spec::Hex)
            .collect(),
    };
    let bytes = opened.encode();
    g.sample_size(100);
    g.bench_function("verify_opening_of_81920", |b| {
        b.iter(|| verify_opening(&big_shape, &root, &bytes, &path).unwrap())
    });
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
