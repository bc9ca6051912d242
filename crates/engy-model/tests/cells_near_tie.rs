//! Systematic near-tie swaps (issue 39, item 4; the red team's "systematic near-tie swaps"):
//! a serve that, wherever another expert set is within the cell margin of the router's top-k,
//! runs and reports that set instead ([`CellServe::NearTieSwap`]: the designated cheap experts,
//! the lowest ids). Each such cell alone is a legal near-tie; the challenged cells judged
//! together ([`engy_model::cells::stats`]) must catch the serve while honest bf16 and f32
//! serves are never flagged. Measured over many requests and challenge seeds on the devnet
//! checkpoint and the tiny Qwen3.5-MoE and GLM-MoE-DSA checkpoints (`tests/vectors/arch`);
//! the printed rows are bench/RESULTS.md "Cells: near-tie swaps".
mod common;

use std::path::Path;

use engy_model::cells::stats::near_ties_flagged;
use engy_model::cells::{
    serve_cells, BundleReport, BundleVerdict, CellPolicy, CellServe, CommittedWeights,
};
use engy_model::{corpus, gen_model, Checkpoint, Compute, GenConfig, Model, Precision};

use common::cells::{audit, committed};

/// Challenge seeds drawn per request (each a separate audit of the same committed cells).
const SEEDS: u8 = 4;

/// Audits of one kind of serve.
#[derive(Default)]
struct Tally {
    audits: usize,
    flagged: usize,
    near_ties: usize,
    cells: usize,
    /// Every challenged near-tie's gap (score units).
    gaps: Vec<f32>,
}

impl Tally {
    fn add(&mut self, r: &BundleReport) {
        self.audits += 1;
        self.flagged += usize::from(r.verdict == BundleVerdict::Cheat);
        self.near_ties += r.stats.near_ties;
        self.cells += r.stats.n;
        self.gaps.extend(
            r.cells
                .iter()
                .filter_map(|c| c.check.as_ref().and_then(|k| k.near_tie_gap)),
        );
    }

    /// Whether the near-tie count over all these audits together (a serve's ledger) is
    /// flagged ([`near_ties_flagged`]).
    fn ledger_flagged(&self) -> bool {
        near_ties_flagged(self.near_ties, self.cells, &CellPolicy::default().stats)
    }

    /// The gaps sorted, as `[min, median, max]` (empty when none).
    fn gap_spread(&self) -> String {
        let mut g = self.gaps.clone();
        g.sort_by(f32::total_cmp);
        match g.len() {
            0 => "none".into(),
            m => format!("{:.5} / {:.5} / {:.5}", g[0], g[m / 2], g[m - 1]),
        }
    }
}

/// The measured rows of one checkpoint: honest serves, the near-tie swap serve, and the share
/// of all its cells the swap serve changed.
struct Rows {
    honest: Tally,
    cheat: Tally,
    swapped: usize,
    all_cells: usize,
}

fn measure(verifier: &Model, w: &CommittedWeights, requests: &[Vec<u32>]) -> Rows {
    let bf16 = verifier.with_compute(Compute::Bf16).unwrap();
    let mut rows = Rows {
        honest: Tally::default(),
        cheat: Tally::default(),
        swapped: 0,
        all_cells: 0,
    };
    for (r, ids) in requests.iter().enumerate() {
        let honest_bf16 = serve_cells(&bf16, ids, CellServe::Honest).unwrap();
        let honest_f32 = serve_cells(verifier, ids, CellServe::Honest).unwrap();
        let cheat = serve_cells(&bf16, ids, CellServe::NearTieSwap).unwrap();
        rows.all_cells += cheat.len();
        rows.swapped += cheat
            .iter()
            .zip(&honest_bf16)
            .filter(|(c, h)| c.expert_ids() != h.expert_ids())
            .count();
        for s in 0..SEEDS {
            let seed = [(r as u8).wrapping_mul(16).wrapping_add(s + 1); 32];
            for (serve, cells) in [(&bf16, &honest_bf16), (verifier, &honest_f32)] {
                let rep = audit(verifier, w, serve, ids, cells, seed);
                rows.honest.add(&rep);
            }
            rows.cheat
                .add(&audit(verifier, w, &bf16, ids, &cheat, seed));
        }
    }
    rows
}

fn print(name: &str, rows: &Rows) {
    println!(
        "{name}: near-tie swap serve changed {}/{} cells ({:.1}%); caught {}/{} audits \
         (near-ties {}/{} challenged cells; ledger flagged: {}); honest bf16 + f32 flagged {}/{} audits (near-ties \
         {}/{} challenged cells; ledger flagged: {}); near-tie gap min / median / max: honest {}, swaps {}",
        rows.swapped,
        rows.all_cells,
        100.0 * rows.swapped as f64 / rows.all_cells.max(1) as f64,
        rows.cheat.flagged,
        rows.cheat.audits,
        rows.cheat.near_ties,
        rows.cheat.cells,
        rows.cheat.ledger_flagged(),
        rows.honest.flagged,
        rows.honest.audits,
        rows.honest.near_ties,
        rows.honest.cells,
        rows.honest.ledger_flagged(),
        rows.honest.gap_spread(),
        rows.cheat.gap_spread(),
    );
}

/// Random token ids (the tiny checkpoints have no tokenizer worth a chat).
fn random_ids(vocab: u64, r: u64, len: usize) -> Vec<u32> {
    let mut state = 0x9e37_79b9_7f4a_7c15u64 ^ ((r + 1) * 7919);
    (0..len)
        .map(|_| {
            state = state
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            ((state >> 33) % vocab) as u32
        })
        .collect()
}

#[test]
fn systematic_near_tie_swaps_are_caught_and_honest_serves_are_not_flagged() {
    let t = tempfile::tempdir().unwrap();
    let dir = t.path().join("m");
    gen_model(&dir, 5, &GenConfig::default()).unwrap();
    let ck = Checkpoint::open(&dir, Precision::Bf16).unwrap();
    let requests: Vec<Vec<u32>> = corpus::sample_prompts(23, 8)
        .iter()
        .map(|user| {
            let text = format!("<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n");
            let mut ids = ck
                .tokenizer
                .encode(text.as_str(), false)
                .unwrap()
                .get_ids()
                .to_vec();
            let steps = ck.model.generate(&ids, 64, &[]).unwrap();
            ids.extend(steps.iter().map(|s| s.token_id));
            ids
        })
        .collect();
    let mut all = vec![("devnet", measure(&ck.model, &committed(&dir), &requests))];
    let vectors = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/vectors/arch");
    for arch in ["qwen3_5_moe", "glm_moe_dsa"] {
        let dir = vectors.join(arch);
        let verifier = Model::load(&dir, Precision::Bf16).unwrap();
        let vocab = verifier.config().vocab_size as u64;
        let requests: Vec<Vec<u32>> = (0..6).map(|r| random_ids(vocab, r, 80)).collect();
        all.push((arch, measure(&verifier, &committed(&dir), &requests)));
    }
    for (name, rows) in &all {
        print(name, rows);
    }
    for (name, rows) in &all {
        assert_eq!(
            rows.honest.flagged, 0,
            "{name}: an honest serve was flagged"
        );
        assert!(
            !rows.honest.ledger_flagged(),
            "{name}: the honest ledger was flagged"
        );
        assert!(rows.swapped > 0, "{name}: the swap serve must swap");
        assert!(
            rows.cheat.flagged > 0,
            "{name}: no audit caught the swap serve"
        );
        assert!(
            rows.cheat.ledger_flagged(),
            "{name}: the swap serve's ledger passed"
        );
    }
}
