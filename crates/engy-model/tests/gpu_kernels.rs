//! engy's own GPU kernels (`kernels/*.cu`) against the unfused candle operations on the CPU,
//! which state each rule:
//! * the fused attention of a bf16 recompute (`arch::fused_attention`, three kernels) against
//!   `ops::attention_in` (docs/design/recomputes.md), on the shapes the served
//!   architectures use: grouped KV heads, a causal mask over cached and new positions, and no
//!   mask. The two must agree to the order of the f32 sums: after the output's bf16 rounding,
//!   at most one bf16 step apart and equal on at least 99% of values;
//! * the steps around the routed experts' grouped GEMMs (`arch::expert_kernels`: the rows'
//!   gather, the SwiGLU and the weighted combine) against the candle operations they replace,
//!   on the same device: bit for bit (the combine: to f32 rounding, as it adds in top-k order
//!   where candle's GPU sum adds as a tree);
//! * the Gated DeltaNet's causal conv and SiLU, and its gated RMSNorm (`arch::deltanet_kernels`)
//!   against the candle operations they replace, on the same device, in f32 and bf16: the conv
//!   bit for bit, the norm to the order of its sum of squares (bf16: one step apart at most,
//!   equal on at least 99% of values; f32: within 1e-6 relative of each value);
//! * the chunked delta rule (`arch::delta_rule::chunked`), whose chunk-to-chunk loop is one
//!   kernel on a GPU, against the same function on the CPU (the loop as matmuls), at Qwen3.6's
//!   head shape, with a starting state, across and inside chunk boundaries: within the f32
//!   tolerance the chunked form keeps against the token loop;
//! * the delta rule's inputs from the conv's output (`arch::deltanet_kernels::rule_inputs`)
//!   against the candle operations: `v`, `beta`, `g` bit for bit, `q` and `k` to the l2 norm's
//!   order of summation;
//! * the router's top-k on the device (`arch::router_kernels`) against the host's port of
//!   torch's CPU `topk`: index for index, on rows full of exact ties;
//! * the DSA indexer's top-k of key positions and its attention mask on the device
//!   (`arch::dsa_kernels`) against the host's selection (`ops::topk_indices_ordered` on each
//!   row's causal scores) and mask: index for index and bit for bit, in both tie orders;
//!   and the count of rows whose selection cuts through a tie, made where the scores are
//!   (`dsa_kernels::rows_cutting_ties`), never below the host's exact count;
//! * the RMSNorm and bf16 rounding kernels (`arch::norm_kernels`) against candle's chain of
//!   operations on the same device, bit for bit: every rule the architectures use, with and
//!   without the residual add in front, on rows narrower and wider than one block;
//! * a layer's block-FP8 expert stack, which goes up through one reused page-locked staging
//!   buffer in several copies while earlier work is still queued, against each expert decoded
//!   alone: bit for bit. (The host once rewrote that buffer without waiting for the copy out
//!   of it; this test did not catch that on the H200, where the race showed only in whole
//!   audits: `ENGY_TRACE` digests of two processes parted at the first MoE block.)
//! * the W8A8 recompute's activation quantiser run on the device
//!   (`arch::quant::act_quant_tensor`) against the host's rule (`act_quant_rows`): bit for bit.
//!
//! On `ENGY_TEST_DEVICE=cuda` (scripts/gpu-check.sh) the kernels run; on the CPU the fused
//! attention must not apply (`None`), so the CPU audit is the unfused rule itself.
use candle_core::{DType, Device, Tensor, D};
use engy_model::arch::norm_kernels::{self, NormRule};
use engy_model::arch::{
    delta_rule, deltanet_kernels, dsa_kernels, expert_kernels, fused_attention, ops, TieOrder,
};
use engy_model::{Compute, DeviceSpec};

mod common;

/// `n` values in [-amp, amp) from a fixed LCG, rounded to bf16 (a bf16 recompute's q, k, v).
fn bf16_values(n: usize, seed: u64, amp: f32) -> Vec<f32> {
    let mut x = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    (0..n)
        .map(|_| {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            let u = (x >> 40) as f32 / (1u64 << 24) as f32;
            half::bf16::from_f32((2.0 * u - 1.0) * amp).to_f32()
        })
        .collect()
}

struct Case {
    name: &'static str,
    h: usize,
    kv: usize,
    t: usize,
    off: usize,
    d: usize,
    dv: usize,
    masked: bool,
}

const CASES: &[Case] = &[
    // Qwen3.6's full-attention shape (16 query heads over 2 KV heads, head dim 256), prefill.
    Case {
        name: "gqa prefill",
        h: 16,
        kv: 2,
        t: 333,
        off: 0,
        d: 256,
        dv: 256,
        masked: true,
    },
    // New positions after cached ones, odd sizes, one query head per KV head.
    Case {
        name: "cached keys",
        h: 4,
        kv: 4,
        t: 37,
        off: 91,
        d: 64,
        dv: 48,
        masked: true,
    },
    // No mask (one new position attends to every key).
    Case {
        name: "no mask",
        h: 8,
        kv: 2,
        t: 1,
        off: 200,
        d: 128,
        dv: 128,
        masked: false,
    },
];

#[test]
fn fused_attention_is_the_unfused_rule() {
    let dev = common::test_device()
        .device()
        .unwrap_or_else(|e| panic!("ENGY_TEST_DEVICE: {e}"));
    for (ci, c) in CASES.iter().enumerate() {
        let s = c.off + c.t;
        let seed = 1 + ci as u64 * 3;
        // Scores of a few units, as after q/k norms: exponentials span many bf16 binades.
        let q = Tensor::from_vec(
            bf16_values(c.h * c.t * c.d, seed, 1.5),
            (c.h, c.t, c.d),
            &Device::Cpu,
        )
        .unwrap();
        let k = Tensor::from_vec(
            bf16_values(c.kv * s * c.d, seed + 1, 1.5),
            (c.kv, s, c.d),
            &Device::Cpu,
        )
        .unwrap();
        let v = Tensor::from_vec(
            bf16_values(c.kv * s * c.dv, seed + 2, 4.0),
            (c.kv, s, c.dv),
            &Device::Cpu,
        )
        .unwrap();
        let scale = 1.0 / (c.d as f64).sqrt();
        let mask = if c.masked {
            ops::causal_mask(c.t, c.off, &Device::Cpu).unwrap()
        } else {
            None
        };
        let want = ops::attention_in(&q, &k, &v, scale, mask.as_ref(), Compute::Bf16).unwrap();
        let on = |x: &Tensor| x.to_device(&dev).unwrap();
        let mask_d = mask.as_ref().map(on);
        let fused =
            fused_attention::attention(&on(&q), &on(&k), &on(&v), scale, mask_d.as_ref()).unwrap();
        if matches!(common::test_device(), DeviceSpec::Cpu) {
            assert!(fused.is_none(), "{}: the fused path ran on the CPU", c.name);
            continue;
        }
        let fused =
            fused.unwrap_or_else(|| panic!("{}: the fused path did not apply on the GPU", c.name));
        assert_eq!(fused.dims(), &[c.h, c.t, c.dv], "{}", c.name);
        // The same tail as ops::attention_in: heads concatenated, rounded to bf16.
        let got = fused
            .transpose(0, 1)
            .unwrap()
            .contiguous()
            .unwrap()
            .reshape((c.t, c.h * c.dv))
            .unwrap()
            .to_dtype(DType::BF16)
            .unwrap()
            .to_dtype(DType::F32)
            .unwrap()
            .to_device(&Device::Cpu)
            .unwrap();
        // And the whole of ops::attention_in on the device, which must take the fused path.
        let whole = ops::attention_in(
            &on(&q),
            &on(&k),
            &on(&v),
            scale,
            mask_d.as_ref(),
            Compute::Bf16,
        )
        .unwrap()
        .to_device(&Device::Cpu)
        .unwrap();
        let flat = |x: &Tensor| x.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        let (want, got, whole) = (flat(&want), flat(&got), flat(&whole));
        assert_eq!(
            got, whole,
            "{}: ops::attention_in on the GPU is not the fused path",
            c.name
        );
        // Two implementations of the rule differ where an exponential sits at a bf16 rounding
        // boundary and the score's last f32 bit (the sums' order) decides its side: that moves
        // the output by at most one bf16 step of the exponential times |v| over the row sum,
        // at most 2^-8·max|v| in all; then the output's own rounding, a step either way.
        let vmax = v
            .abs()
            .unwrap()
            .max_all()
            .unwrap()
            .to_scalar::<f32>()
            .unwrap();
        let step = |x: f32| 2f32.powi(x.abs().max(f32::MIN_POSITIVE).log2().floor() as i32 - 7);
        let mut equal = 0usize;
        for (i, (&w, &g)) in want.iter().zip(&got).enumerate() {
            let bound = 2f32.powi(-8) * vmax + 2.0 * step(w.abs().max(g.abs()));
            assert!(
                (w - g).abs() <= bound,
                "{}: value {i} is {g} fused, {w} unfused (bound {bound})",
                c.name
            );
            equal += usize::from(w == g);
        }
        // Such boundaries are rare: most values must be equal. A different rounding point
        // (exponentials not rounded, say) leaves about half of them unequal.
        let share = equal as f64 / want.len() as f64;
        assert!(
            share >= 0.95,
            "{}: only {:.4} of values equal",
            c.name,
            share
        );
        eprintln!("{}: {:.5} of {} values equal", c.name, share, want.len());
    }
}

fn max_abs_diff(a: &Tensor, b: &Tensor) -> f32 {
    let a = a.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    let b = b.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(&b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

/// Rows of `x` `[h, t, w]` l2-normalised over `w` (the rule's q and k).
fn l2(x: &Tensor) -> Tensor {
    let norm = (x.sqr().unwrap().sum_keepdim(2).unwrap() + 1e-6)
        .unwrap()
        .sqrt()
        .unwrap();
    x.broadcast_div(&norm).unwrap()
}

#[test]
fn the_delta_rule_chunk_loop_is_the_unfused_loop() {
    let dev = common::test_device()
        .device()
        .unwrap_or_else(|e| panic!("ENGY_TEST_DEVICE: {e}"));
    // Qwen3.6's linear-attention heads (dk = dv = 128), fewer of them, then a value width the
    // kernel's 16-column blocks do not divide; lengths inside one chunk, at a boundary, and
    // across several.
    for (i, &(t, h, dk, dv)) in [
        (5usize, 4usize, 128usize, 128usize),
        (64, 4, 128, 128),
        (200, 4, 128, 128),
        (150, 2, 64, 40),
    ]
    .iter()
    .enumerate()
    {
        let seed = 100 + i as u64 * 10;
        let cpu = |v: Vec<f32>, shape: &[usize]| Tensor::from_vec(v, shape, &Device::Cpu).unwrap();
        let q = (l2(&cpu(bf16_values(h * t * dk, seed, 1.0), &[h, t, dk]))
            * (dk as f64).powf(-0.5))
        .unwrap();
        let k = l2(&cpu(bf16_values(h * t * dk, seed + 1, 1.0), &[h, t, dk]));
        let v = cpu(bf16_values(h * t * dv, seed + 2, 2.0), &[h, t, dv]);
        let beta = cpu(bf16_values(h * t, seed + 3, 1.0), &[h, t])
            .affine(0.5, 0.5)
            .unwrap();
        let g = (cpu(bf16_values(h * t, seed + 4, 1.0), &[h, t])
            .abs()
            .unwrap()
            * -0.7)
            .unwrap();
        let s0 = cpu(bf16_values(h * dk * dv, seed + 5, 0.3), &[h, dk, dv]);
        let (want, want_s) = delta_rule::chunked(&q, &k, &v, &beta, &g, &s0).unwrap();
        let on = |x: &Tensor| x.to_device(&dev).unwrap();
        let s0_dev = on(&s0);
        let (got, got_s) =
            delta_rule::chunked(&on(&q), &on(&k), &on(&v), &on(&beta), &on(&g), &s0_dev).unwrap();
        let back = |x: &Tensor| x.to_device(&Device::Cpu).unwrap();
        assert_eq!(got.dims(), want.dims(), "t={t}");
        assert_eq!(got_s.dims(), want_s.dims(), "t={t}");
        let (e, es) = (
            max_abs_diff(&back(&got), &want),
            max_abs_diff(&back(&got_s), &want_s),
        );
        assert!(
            e < 1e-4 && es < 1e-4,
            "t={t}: outputs off by {e}, state by {es}"
        );
        // The caller's state is not written (the kernel updates its own copy).
        assert_eq!(
            max_abs_diff(&back(&s0_dev), &s0),
            0.0,
            "t={t}: the starting state changed"
        );
        eprintln!("delta rule t={t}: outputs within {e:e}, state within {es:e}");
    }
}

#[test]
fn the_expert_kernels_are_the_candle_operations() {
    let dev = common::test_device()
        .device()
        .unwrap_or_else(|e| panic!("ENGY_TEST_DEVICE: {e}"));
    let (t, width, inter, k) = (97usize, 160usize, 48usize, 4usize);
    let x = Tensor::from_vec(bf16_values(t * width, 7, 3.0), (t, width), &dev).unwrap();
    // Every token to k rows, some twice, one token with a missing choice.
    let idx: Vec<u32> = (0..t * k).map(|i| ((i * 37) % t) as u32).collect();
    let gathered = expert_kernels::gather_rows_bf16(&x, &idx).unwrap();
    if matches!(common::test_device(), DeviceSpec::Cpu) {
        assert!(gathered.is_none(), "the expert kernels ran on the CPU");
        return;
    }
    let flat = |x: &Tensor| {
        x.to_dtype(DType::F32)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap()
    };
    let ids = Tensor::from_vec(idx.clone(), idx.len(), &dev).unwrap();
    let want = x
        .index_select(&ids, 0)
        .unwrap()
        .to_dtype(DType::BF16)
        .unwrap();
    let got = gathered.expect("gather on the GPU");
    assert_eq!(got.dtype(), DType::BF16);
    assert_eq!(flat(&got), flat(&want), "gather");
    assert!(
        expert_kernels::gather_rows_bf16(&x, &[t as u32]).is_err(),
        "a row past the end"
    );

    // SwiGLU on gate/up products of several binades, negative and positive.
    let n = t * k * inter;
    let g = Tensor::from_vec(bf16_values(n, 8, 12.0), (t * k, inter), &dev)
        .unwrap()
        .to_dtype(DType::BF16)
        .unwrap();
    let u = Tensor::from_vec(bf16_values(n, 9, 5.0), (t * k, inter), &dev)
        .unwrap()
        .to_dtype(DType::BF16)
        .unwrap();
    let round = |x: Tensor| {
        x.to_dtype(DType::BF16)
            .unwrap()
            .to_dtype(DType::F32)
            .unwrap()
    };
    let (gf, uf) = (
        g.to_dtype(DType::F32).unwrap(),
        u.to_dtype(DType::F32).unwrap(),
    );
    let want = round((round(ops::silu(&gf).unwrap()) * uf).unwrap());
    let got = expert_kernels::swiglu_bf16(&g, &u)
        .unwrap()
        .expect("swiglu on the GPU");
    assert_eq!(flat(&got), flat(&want), "swiglu");

    // Combine: rows of every expert's output, k picks per token, weights rounded to bf16.
    let rows = t * k;
    let y = Tensor::from_vec(bf16_values(rows * width, 10, 6.0), (rows, width), &dev)
        .unwrap()
        .to_dtype(DType::BF16)
        .unwrap();
    let mut pick: Vec<u32> = (0..t * k).map(|i| ((i * 53) % rows) as u32).collect();
    pick[5 * k + k - 1] = rows as u32; // token 5 has one choice fewer
    let w: Vec<f32> = bf16_values(t * k, 11, 1.0)
        .iter()
        .map(|v| half::bf16::from_f32(v.abs()).to_f32())
        .collect();
    for round_products in [true, false] {
        let all = Tensor::cat(
            &[
                y.to_dtype(DType::F32).unwrap(),
                Tensor::zeros((1, width), DType::F32, &dev).unwrap(),
            ],
            0,
        )
        .unwrap();
        let picked = all
            .index_select(&Tensor::from_vec(pick.clone(), t * k, &dev).unwrap(), 0)
            .unwrap()
            .reshape((t, k, width))
            .unwrap();
        let mut weighted = picked
            .broadcast_mul(&Tensor::from_vec(w.clone(), (t, k, 1), &dev).unwrap())
            .unwrap();
        if round_products {
            weighted = round(weighted);
        }
        let want = flat(&weighted.sum(1).unwrap());
        let got = flat(
            &expert_kernels::combine(&y, &pick, &w, k, round_products)
                .unwrap()
                .expect("combine on the GPU"),
        );
        let scale = want.iter().fold(0f32, |m, v| m.max(v.abs()));
        let err = want
            .iter()
            .zip(&got)
            .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
        assert!(
            scale > 0.0 && err <= 1e-6 * scale,
            "combine (round {round_products}): off by {err} (scale {scale})"
        );
        eprintln!("combine (round {round_products}): within {err:e} of scale {scale}");
    }
    assert!(
        expert_kernels::combine(&y, &pick[1..], &w[1..], k, true).is_err(),
        "picks not t·k"
    );
}

#[test]
fn the_causal_conv_kernel_is_the_candle_operations() {
    let dev = common::test_device()
        .device()
        .unwrap_or_else(|e| panic!("ENGY_TEST_DEVICE: {e}"));
    let (t, ch, taps) = (131usize, 96usize, 4usize);
    let input = Tensor::from_vec(
        bf16_values((t + taps - 1) * ch, 21, 4.0),
        (t + taps - 1, ch),
        &dev,
    )
    .unwrap();
    let w = Tensor::from_vec(bf16_values(taps * ch, 22, 1.0), (taps, ch), &dev).unwrap();
    for c in [Compute::F32, Compute::Bf16] {
        let got = deltanet_kernels::causal_conv_silu(&input, &w, c).unwrap();
        if matches!(common::test_device(), DeviceSpec::Cpu) {
            assert!(got.is_none(), "the conv kernel ran on the CPU");
            return;
        }
        let round = |x: Tensor| match c {
            Compute::F32 => x,
            Compute::Bf16 => x
                .to_dtype(DType::BF16)
                .unwrap()
                .to_dtype(DType::F32)
                .unwrap(),
        };
        // The unfused operations of qwen3_5_moe's tensor path.
        let mut s = Tensor::zeros((t, ch), DType::F32, &dev).unwrap();
        for j in 0..taps {
            s = (s + input
                .narrow(0, j, t)
                .unwrap()
                .broadcast_mul(&w.narrow(0, j, 1).unwrap())
                .unwrap())
            .unwrap();
        }
        let want = round(ops::silu(&round(s)).unwrap());
        let flat = |x: &Tensor| x.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        let got = got.expect("the conv kernel on the GPU");
        assert_eq!(flat(&got), flat(&want), "{c:?}");
    }
    assert!(deltanet_kernels::causal_conv_silu(
        &input,
        &w.narrow(1, 0, ch - 1).unwrap(),
        Compute::F32
    )
    .is_err());
}

#[test]
fn the_gated_norm_kernel_is_the_candle_operations() {
    let dev = common::test_device()
        .device()
        .unwrap_or_else(|e| panic!("ENGY_TEST_DEVICE: {e}"));
    let (heads, t, dv, eps) = (6usize, 77usize, 128usize, 1e-6f64);
    let o = Tensor::from_vec(bf16_values(heads * t * dv, 31, 0.05), (heads, t, dv), &dev).unwrap();
    let z = Tensor::from_vec(bf16_values(t * heads * dv, 32, 6.0), (t, heads * dv), &dev).unwrap();
    let w = Tensor::from_vec(bf16_values(dv, 33, 2.0), dv, &dev).unwrap();
    for c in [Compute::F32, Compute::Bf16] {
        let got = deltanet_kernels::gated_rms_norm(&o, &z, &w, eps, c).unwrap();
        if matches!(common::test_device(), DeviceSpec::Cpu) {
            assert!(got.is_none(), "the gated norm kernel ran on the CPU");
            return;
        }
        let round = |x: Tensor| match c {
            Compute::F32 => x,
            Compute::Bf16 => x
                .to_dtype(DType::BF16)
                .unwrap()
                .to_dtype(DType::F32)
                .unwrap(),
        };
        let or = round(o.transpose(0, 1).unwrap().contiguous().unwrap());
        let r = (or.sqr().unwrap().mean_keepdim(2).unwrap() + eps)
            .unwrap()
            .sqrt()
            .unwrap()
            .recip()
            .unwrap();
        let normed = round(or.broadcast_mul(&r).unwrap());
        let weighted = round(normed.broadcast_mul(&w).unwrap());
        let zz = z.reshape((t, heads, dv)).unwrap();
        let want = round((weighted * ops::silu(&zz).unwrap()).unwrap())
            .reshape((t, heads * dv))
            .unwrap();
        let flat = |x: &Tensor| x.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        let (want, got) = (flat(&want), flat(&got.expect("the gated norm on the GPU")));
        let mut equal = 0usize;
        for (i, (&a, &b)) in want.iter().zip(&got).enumerate() {
            let bound = match c {
                Compute::F32 => 1e-6 * a.abs().max(1e-30),
                Compute::Bf16 => {
                    2f32.powi(a.abs().max(b.abs()).max(f32::MIN_POSITIVE).log2().floor() as i32 - 7)
                }
            };
            assert!(
                (a - b).abs() <= bound,
                "{c:?}: value {i} is {b}, candle {a}"
            );
            equal += usize::from(a == b);
        }
        let share = equal as f64 / want.len() as f64;
        // In f32 every value may differ in its last bit; bf16 rounding hides that but where a
        // value sits at a rounding boundary.
        assert!(
            c == Compute::F32 || share >= 0.99,
            "{c:?}: only {share:.4} of values equal"
        );
        eprintln!(
            "gated norm {c:?}: {share:.5} of {} values equal",
            want.len()
        );
    }
}

/// The router's top-k on the device (`arch::router_kernels::torch_topk`) against the host's
/// port of torch's CPU `topk` (`ops::torch_topk_indices`), index for index and value for value,
/// on rows full of exact ties (values from a few levels, as bf16 router logits tie), through
/// both of torch's paths (`nth_element` when `k * 64 > n`, `partial_sort` otherwise), at
/// Qwen3.6's router shape (256 experts, top 8) and others; and the whole router
/// (`ops::softmax_route_in`) with and without full rows choosing the same experts and weights,
/// also when routings are started and waited out of order (`ops::softmax_route_start`).
#[test]
fn the_router_top_k_kernel_is_torchs_order() {
    let dev = common::test_device()
        .device()
        .unwrap_or_else(|e| panic!("ENGY_TEST_DEVICE: {e}"));
    // (rows, experts, top-k, levels): few levels make ties everywhere, many make them rare.
    let cases = [
        (4096usize, 256usize, 8usize, 24usize),
        (513, 256, 8, 1_000_000),
        (300, 128, 2, 7),
        (257, 60, 8, 5),
        (64, 512, 8, 3),
        (9, 8, 8, 2),
        (5, 3, 4, 2),
    ];
    for (seed, &(rows, n, k, levels)) in cases.iter().enumerate() {
        let raw = bf16_values(rows * n, 100 + seed as u64, 1.0);
        let vals: Vec<f32> = raw
            .iter()
            .map(|&v| ((v + 1.0) * 0.5 * levels as f32).floor() / levels as f32)
            .collect();
        let probs = Tensor::from_vec(vals.clone(), (rows, n), &dev).unwrap();
        let got = engy_model::arch::router_kernels::torch_topk(&probs, k).unwrap();
        if matches!(common::test_device(), DeviceSpec::Cpu) {
            assert!(got.is_none(), "the router top-k kernel ran on the CPU");
            return;
        }
        let got = got.expect("the router top-k on the GPU");
        assert_eq!(got.len(), rows);
        let mut tied = 0usize;
        for (r, (idx, p)) in got.iter().enumerate() {
            let row = &vals[r * n..(r + 1) * n];
            let want = ops::torch_topk_indices(row, k);
            assert_eq!(idx, &want, "n {n} k {k} row {r}");
            let want_p: Vec<f32> = want.iter().map(|&e| row[e]).collect();
            assert_eq!(p, &want_p, "n {n} k {k} row {r}");
            tied += usize::from(want != ops::topk_indices(row, k));
        }
        eprintln!("router top-k n {n} k {k}: {rows} rows equal, {tied} of them tied so that the order by index differs");
        // (Rows of three or fewer are insertion-sorted, which keeps ties in index order.)
        if levels < 100 && n >= 60 {
            assert!(tied > 0, "n {n} k {k}: the case must have ties");
        }
    }

    // The whole router: logits of a few bf16 levels, own choice and weights with the top-k on
    // the device (no full rows) and on the host (full rows).
    let (rows, n, k) = (1000usize, 256usize, 8usize);
    let logits: Vec<f32> = bf16_values(rows * n, 7, 4.0)
        .iter()
        .map(|v| (v * 8.0).round() / 8.0)
        .collect();
    let logits = Tensor::from_vec(logits, (rows, n), &dev).unwrap();
    let device = ops::softmax_route_in(&logits, k, Compute::Bf16, false).unwrap();
    let host = ops::softmax_route_in(&logits, k, Compute::Bf16, true).unwrap();
    assert!(device.rank.is_empty() && host.rank.len() == rows);
    assert_eq!(device.own, host.own);
    for renormalise in [true, false] {
        assert_eq!(
            device.weights(&device.own, renormalise).unwrap(),
            host.weights(&host.own, renormalise).unwrap()
        );
    }
    // Routings started before the host waits (a shared expert queued between): two in
    // flight at once through two landing buffers, the second of other logits and a larger
    // size, waited in the other order; one dropped unwaited, its buffers back in the pool.
    let wider = Tensor::from_vec(
        bf16_values(2 * rows * n, 8, 4.0)
            .iter()
            .map(|v| (v * 8.0).round() / 8.0)
            .collect::<Vec<f32>>(),
        (2 * rows, n),
        &dev,
    )
    .unwrap();
    let first = ops::softmax_route_start(&logits, k, Compute::Bf16, false).unwrap();
    let second = ops::softmax_route_start(&wider, k, Compute::Bf16, false).unwrap();
    let dropped = ops::softmax_route_start(&wider, k, Compute::Bf16, false).unwrap();
    let queued = (&wider * 2.0).unwrap().sum_all().unwrap();
    drop(dropped);
    let second = second.finish().unwrap();
    let first = first.finish().unwrap();
    // Both went through the device's top-k (the host's fallback copies every row's logits).
    assert!(
        first.rank.is_empty() && second.rank.is_empty(),
        "a started routing fell back to the host"
    );
    assert_eq!(first.own, device.own, "a routing waited second");
    let wider_host = ops::softmax_route_in(&wider, k, Compute::Bf16, true).unwrap();
    assert_eq!(
        second.own, wider_host.own,
        "a routing in flight beside another"
    );
    assert_eq!(
        second.weights(&second.own, true).unwrap(),
        wider_host.weights(&wider_host.own, true).unwrap()
    );
    let again = ops::softmax_route_in(&wider, k, Compute::Bf16, false).unwrap();
    assert_eq!(
        again.own, wider_host.own,
        "a routing through a reused buffer"
    );
    queued.to_scalar::<f32>().unwrap();

    // A dispatched expert outside the own top-k needs full rows.
    let mut other = device.own.clone();
    other[0][0] = (0..n).find(|e| !device.own[0].contains(e)).unwrap();
    assert!(device.weights(&other, true).is_err());
    assert!(host.weights(&other, true).is_ok());
}

/// The delta rule's inputs from the conv's output (`arch::deltanet_kernels::rule_inputs`)
/// against the candle operations they replace, on the same device, at Qwen3.6's head shape
/// (16 key heads and 32 value heads of 128): `v`, `beta` and `g` bit for bit (`beta` in f32 and
/// bf16), `q` and `k` to the order of the l2 norm's sum (within 16 f32 ulps of each value's
/// scale).
#[test]
fn the_rule_inputs_kernel_is_the_candle_operations() {
    let dev = common::test_device()
        .device()
        .unwrap_or_else(|e| panic!("ENGY_TEST_DEVICE: {e}"));
    let (t, nk, nv, dk, dv) = (133usize, 16usize, 32usize, 128usize, 128usize);
    let width = 2 * nk * dk + nv * dv;
    let conv = Tensor::from_vec(bf16_values(t * width, 41, 2.0), (t, width), &dev).unwrap();
    // Gate projections across softplus's threshold (a + dt_bias above 20 for some).
    let b = Tensor::from_vec(bf16_values(t * nv, 42, 12.0), (t, nv), &dev).unwrap();
    let a = Tensor::from_vec(bf16_values(t * nv, 43, 24.0), (t, nv), &dev).unwrap();
    let dt_bias = Tensor::from_vec(bf16_values(nv, 44, 4.0), nv, &dev).unwrap();
    let a_log = Tensor::from_vec(bf16_values(nv, 45, 2.0), nv, &dev).unwrap();
    for c in [Compute::F32, Compute::Bf16] {
        let got =
            deltanet_kernels::rule_inputs(&conv, [&b, &a, &dt_bias, &a_log], (nk, nv, dk, dv), c)
                .unwrap();
        if matches!(common::test_device(), DeviceSpec::Cpu) {
            assert!(got.is_none(), "the rule inputs kernel ran on the CPU");
            return;
        }
        let [q, k, v, beta, g] = got.expect("the rule inputs on the GPU");
        // The candle operations of `qwen3_5_moe::delta_net_tensors`.
        let l2 = |x: Tensor| {
            x.broadcast_div(
                &(x.sqr().unwrap().sum_keepdim(2).unwrap() + 1e-6)
                    .unwrap()
                    .sqrt()
                    .unwrap(),
            )
            .unwrap()
        };
        let heads = |x: Tensor| {
            x.unsqueeze(2)
                .unwrap()
                .broadcast_as((t, nk, nv / nk, dk))
                .unwrap()
                .reshape((t, nv, dk))
                .unwrap()
        };
        let tr = |x: Tensor| x.transpose(0, 1).unwrap().contiguous().unwrap();
        let part = |i: usize, n: usize| conv.narrow(1, i, n).unwrap();
        let wq = tr(heads(
            (l2(part(0, nk * dk).reshape((t, nk, dk)).unwrap()) * (1.0 / (dk as f64).sqrt()))
                .unwrap(),
        ));
        let wk = tr(heads(l2(part(nk * dk, nk * dk)
            .reshape((t, nk, dk))
            .unwrap())));
        let wv = tr(part(2 * nk * dk, nv * dv).reshape((t, nv, dv)).unwrap());
        let sig = ops::sigmoid(&b).unwrap();
        let wbeta = tr(match c {
            Compute::F32 => sig,
            Compute::Bf16 => sig
                .to_dtype(DType::BF16)
                .unwrap()
                .to_dtype(DType::F32)
                .unwrap(),
        });
        let sp = a.broadcast_add(&dt_bias).unwrap();
        let soft = sp
            .gt(20.0)
            .unwrap()
            .where_cond(&sp, &(sp.exp().unwrap() + 1.0).unwrap().log().unwrap())
            .unwrap();
        let wg = tr(soft
            .broadcast_mul(&a_log.exp().unwrap().neg().unwrap())
            .unwrap());
        let flat = |x: &Tensor| x.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        assert_eq!(flat(&v), flat(&wv), "{c:?}: v");
        assert_eq!(flat(&beta), flat(&wbeta), "{c:?}: beta");
        assert_eq!(flat(&g), flat(&wg), "{c:?}: g");
        for (name, got, want) in [("q", &q, &wq), ("k", &k, &wk)] {
            assert_eq!(got.dims(), want.dims(), "{name}");
            let (got, want) = (flat(got), flat(want));
            let mut equal = 0usize;
            for (i, (&x, &y)) in got.iter().zip(&want).enumerate() {
                let ulp = f32::EPSILON * y.abs().max(f32::MIN_POSITIVE);
                assert!(
                    (x - y).abs() <= 16.0 * ulp,
                    "{c:?}: {name} value {i} is {x}, candle {y}"
                );
                equal += usize::from(x == y);
            }
            eprintln!(
                "rule inputs {c:?}: {name} {:.5} of {} values equal",
                equal as f64 / want.len() as f64,
                want.len()
            );
        }
    }
}

/// `n` index scores in [-0.5, 0.5) on `levels` steps: few levels make exact ties everywhere,
/// many make them rare.
fn leveled_scores(n: usize, seed: u64, levels: usize) -> Vec<f32> {
    bf16_values(n, seed, 1.0)
        .iter()
        .map(|&v| ((v + 1.0) * 0.5 * levels as f32).floor() / levels as f32 - 0.5)
        .collect()
}

/// The DSA indexer's top-k and mask on the device (`arch::dsa_kernels`) against the host's
/// rule, index for index and bit for bit: each query row keeps every causal key when it has at
/// most `k`, else its `k` largest scores by `total_cmp` with ties in the run's tie order
/// (`ops::topk_indices_ordered`); the mask is 0 at the kept keys and `-inf` elsewhere. Rows full
/// of exact ties (few levels), `-0.0` beside `+0.0`, NaNs of both signs and infinities; rows
/// with fewer causal keys than `k`, a cache offset, GLM-5's `index_topk` of 2,048 over 4,096
/// keys, both tie orders; and the mask from a given selection, on the host
/// (`dsa_kernels::mask`) and as the device left it (`dsa_kernels::mask_from`).
#[test]
fn the_dsa_top_k_kernel_is_the_hosts_selection() {
    let dev = common::test_device()
        .device()
        .unwrap_or_else(|e| panic!("ENGY_TEST_DEVICE: {e}"));
    // (rows, cached positions, top-k, levels)
    let cases = [
        (300usize, 0usize, 64usize, 5usize),
        (200, 150, 64, 1_000_000),
        (96, 4000, 2048, 7),
        (130, 0, 128, 3),
        (33, 5, 1, 2),
    ];
    for (seed, &(t, off, k, levels)) in cases.iter().enumerate() {
        let total = off + t;
        let mut vals = leveled_scores(t * total, 300 + seed as u64, levels);
        let specials = [
            -0.0f32,
            0.0,
            f32::NAN,
            -f32::NAN,
            f32::INFINITY,
            f32::NEG_INFINITY,
        ];
        for (i, v) in vals.iter_mut().enumerate() {
            if i % 37 == 0 {
                *v = specials[(i / 37) % specials.len()];
            }
        }
        let index = Tensor::from_vec(vals.clone(), (t, total), &dev).unwrap();
        let mut orders_differ = 0usize;
        for ties in [TieOrder::LowerFirst, TieOrder::HigherFirst] {
            let got = dsa_kernels::topk_mask(&index, off, k, ties).unwrap();
            if matches!(common::test_device(), DeviceSpec::Cpu) {
                assert!(got.is_none(), "the DSA top-k kernel ran on the CPU");
                assert!(dsa_kernels::mask(&[vec![0]], 0, 1, &dev).unwrap().is_none());
                let cpu_sel = Tensor::from_vec(vec![0u32], (1, 1), &dev).unwrap();
                assert!(dsa_kernels::mask_from(&cpu_sel, 0, 1).unwrap().is_none());
                return;
            }
            let (device_sel, mask) = got.expect("the DSA top-k on the GPU");
            assert!(!device_sel.device().is_cpu(), "the selection left the GPU");
            assert_eq!(device_sel.dims(), &[t, k]);
            let sel = dsa_kernels::selection_rows(&device_sel).unwrap();
            assert_eq!(sel.len(), t);
            let mut want_mask = vec![f32::NEG_INFINITY; t * total];
            let mut want_sel = Vec::with_capacity(t);
            for r in 0..t {
                let causal = off + r + 1;
                let row = &vals[r * total..r * total + causal];
                let want: Vec<usize> = if causal <= k {
                    (0..causal).collect()
                } else {
                    ops::topk_indices_ordered(row, k, ties)
                };
                assert_eq!(sel[r], want, "rows {t} off {off} k {k} {ties:?} row {r}");
                if causal > k {
                    let other = match ties {
                        TieOrder::LowerFirst => TieOrder::HigherFirst,
                        TieOrder::HigherFirst => TieOrder::LowerFirst,
                    };
                    orders_differ += usize::from(ops::topk_indices_ordered(row, k, other) != want);
                }
                for &s in &want {
                    want_mask[r * total + s] = 0.0;
                }
                want_sel.push(want);
            }
            let bits = |v: &[f32]| -> Vec<u32> { v.iter().map(|x| x.to_bits()).collect() };
            let got_mask = mask.flatten_all().unwrap().to_vec1::<f32>().unwrap();
            assert_eq!(
                bits(&got_mask),
                bits(&want_mask),
                "mask: rows {t} off {off} k {k} {ties:?}"
            );
            let given = dsa_kernels::mask(&want_sel, off, total, &dev)
                .unwrap()
                .expect("the DSA mask on the GPU");
            let given = given.flatten_all().unwrap().to_vec1::<f32>().unwrap();
            assert_eq!(
                bits(&given),
                bits(&want_mask),
                "mask from a selection: rows {t} off {off} k {k}"
            );
            let kept = dsa_kernels::mask_from(&device_sel, off, total)
                .unwrap()
                .expect("the DSA mask from the device's selection");
            let kept = kept.flatten_all().unwrap().to_vec1::<f32>().unwrap();
            assert_eq!(
                bits(&kept),
                bits(&want_mask),
                "mask from the device's selection: rows {t} off {off} k {k}"
            );
        }
        eprintln!("dsa top-k rows {t} off {off} k {k}: equal; {orders_differ} rows differ between the tie orders");
        if levels < 100 && off + t > k {
            assert!(
                orders_differ > 0,
                "rows {t} off {off} k {k}: the case must have ties that matter"
            );
        }
    }
}

/// The count of rows whose selection cuts through a tie, made where the index scores are
/// (`dsa_kernels::rows_cutting_ties`, candle operations on the test device), against the
/// host's exact rule (`ops::topk_cuts_tie`): never below it, equal on rows without `-0.0`
/// or NaN, and every row of a block with a NaN. It decides whether an audit runs the second
/// DSA tie order, so a count below the exact one would skip a recompute that differs.
#[test]
fn the_device_tie_count_is_never_below_the_hosts() {
    let dev = common::test_device()
        .device()
        .unwrap_or_else(|e| panic!("ENGY_TEST_DEVICE: {e}"));
    // (rows, cached positions, top-k, levels, specials)
    let cases = [
        (300usize, 0usize, 64usize, 5usize, false),
        (200, 150, 64, 1_000_000, false),
        (96, 4000, 2048, 7, false),
        (130, 0, 128, 3, true),
        (64, 10, 40, 1_000_000, true),
        (20, 0, 64, 3, false),
        (100, 50, 32, 0, false),
    ];
    for (seed, &(t, off, k, levels, specials)) in cases.iter().enumerate() {
        let total = off + t;
        // levels 0: every score distinct (no tie anywhere, so nothing may be counted).
        let mut vals: Vec<f32> = if levels == 0 {
            (0..t * total)
                .map(|i| ((i * 7919) % (t * total)) as f32 - 1000.0)
                .collect()
        } else {
            leveled_scores(t * total, 900 + seed as u64, levels)
        };
        if specials {
            for (i, v) in vals.iter_mut().enumerate() {
                if i % 41 == 0 {
                    *v = [-0.0f32, 0.0, f32::INFINITY][(i / 41) % 3];
                }
            }
        }
        let mut exact = 0usize;
        let mut padded = Vec::with_capacity(t * k);
        for r in 0..t {
            let causal = off + r + 1;
            let row = &vals[r * total..r * total + causal];
            let kept: Vec<usize> = if causal <= k {
                (0..causal).collect()
            } else {
                ops::topk_indices_ordered(row, k, TieOrder::LowerFirst)
            };
            exact += usize::from(ops::topk_cuts_tie(row, &kept));
            padded.extend(kept.iter().map(|&s| s as u32));
            padded.extend(std::iter::repeat_n(dsa_kernels::NONE, k - kept.len()));
        }
        let index = Tensor::from_vec(vals.clone(), (t, total), &dev).unwrap();
        let sel = Tensor::from_vec(padded, (t, k), &dev).unwrap();
        let got = dsa_kernels::rows_cutting_ties(&index, &sel, off, k).unwrap();
        eprintln!("dsa ties rows {t} off {off} k {k}: {got} rows counted, {exact} exactly");
        if specials {
            assert!(got >= exact, "rows {t} off {off} k {k}: {got} < {exact}");
        } else {
            assert_eq!(got, exact, "rows {t} off {off} k {k}");
        }
        if (1..100).contains(&levels) && off + t > k {
            assert!(
                exact > 0,
                "rows {t} off {off} k {k}: the case must have ties"
            );
        }
        if levels == 0 {
            assert_eq!(got, 0, "distinct scores: rows {t} off {off} k {k}");
        }
        // A NaN in a row with more than k causal keys: every such row counts.
        let mut with_nan = vals;
        with_nan[(t - 1) * total] = f32::NAN;
        let index = Tensor::from_vec(with_nan, (t, total), &dev).unwrap();
        let got = dsa_kernels::rows_cutting_ties(&index, &sel, off, k).unwrap();
        assert_eq!(
            got,
            t.min((off + t).saturating_sub(k)),
            "NaN: rows {t} off {off} k {k}"
        );
    }
}

/// candle's casts: f32 → bf16 → f32.
fn cast_round(x: &Tensor) -> Tensor {
    x.to_dtype(DType::BF16)
        .unwrap()
        .to_dtype(DType::F32)
        .unwrap()
}

/// The RMSNorm `rule` as the chain of candle operations the kernel replaces.
fn norm_chain(x: &Tensor, w: &Tensor, eps: f64, rule: NormRule) -> Tensor {
    let var = x.sqr().unwrap().mean_keepdim(D::Minus1).unwrap();
    let r = (var + eps).unwrap().sqrt().unwrap().recip().unwrap();
    let mut n = x.broadcast_mul(&r).unwrap();
    if rule.round_normed {
        n = cast_round(&n);
    }
    let w = if rule.one_plus {
        (w + 1.0).unwrap()
    } else {
        w.clone()
    };
    let out = n.broadcast_mul(&w).unwrap();
    if rule.round_out {
        cast_round(&out)
    } else {
        out
    }
}

/// The values' bits, so that NaNs and signed zeros compare too.
fn bits(x: &Tensor) -> Vec<u32> {
    x.flatten_all()
        .unwrap()
        .to_vec1::<f32>()
        .unwrap()
        .iter()
        .map(|v| v.to_bits())
        .collect()
}

#[test]
fn the_norm_kernels_are_the_candle_operations() {
    let dev = common::test_device()
        .device()
        .unwrap_or_else(|e| panic!("ENGY_TEST_DEVICE: {e}"));
    // Values of many binades, exact bf16 ties, signed zeros, infinities and a NaN.
    let mut v: Vec<f32> = (0..4099)
        .map(|i| ((i * 7919 % 4099) as f32 - 2049.0) * 1.37e-3 * (1 + i % 5) as f32)
        .collect();
    v.extend([
        1.0 + f32::EPSILON * 64.0,  // halfway between two bf16 values, even below
        1.0 + f32::EPSILON * 192.0, // halfway, even above
        -0.0,
        0.0,
        f32::INFINITY,
        f32::NEG_INFINITY,
        f32::NAN,
        3.4e38,
    ]);
    let x = Tensor::from_vec(v.clone(), v.len(), &dev).unwrap();
    let got = norm_kernels::round_bf16(&x).unwrap();
    if matches!(common::test_device(), DeviceSpec::Cpu) {
        assert!(got.is_none(), "the norm kernels ran on the CPU");
        return;
    }
    let got = got.expect("bf16 rounding on the GPU");
    assert_eq!(bits(&got), bits(&cast_round(&x)), "bf16 rounding");

    let rules = [
        (false, false, false),
        (false, true, true),
        (true, false, false),
        (true, false, true),
    ]
    .map(|(one_plus, round_normed, round_out)| NormRule {
        one_plus,
        round_normed,
        round_out,
    });
    // Qwen3.6's hidden width, a head's width, a row narrower than its block, a row wider
    // than one block of 1024 threads and not a multiple of it.
    for (rows, n) in [(37usize, 2048usize), (64, 256), (9, 100), (5, 3000)] {
        let x = Tensor::from_vec(bf16_values(rows * n, n as u64, 6.0), (rows, n), &dev).unwrap();
        let y = Tensor::from_vec(bf16_values(rows * n, 3, 2.0), (rows, n), &dev).unwrap();
        let w = Tensor::from_vec(bf16_values(n, 5, 1.5), n, &dev).unwrap();
        for rule in rules {
            let eps = 1e-6;
            let (none, norm) = norm_kernels::rms_norm(&x, None, &w, eps, rule)
                .unwrap()
                .expect("norm on the GPU");
            assert!(none.is_none());
            let want = norm_chain(&x, &w, eps, rule);
            assert_eq!(bits(&norm), bits(&want), "{rows}x{n} {rule:?}");
            for round_sum in [false, true] {
                let (sum, norm) = norm_kernels::rms_norm(&x, Some((&y, round_sum)), &w, eps, rule)
                    .unwrap()
                    .expect("norm on the GPU");
                let mut s = (&x + &y).unwrap();
                if round_sum {
                    s = cast_round(&s);
                }
                let sum = sum.expect("the residual sum");
                assert_eq!(bits(&sum), bits(&s), "{rows}x{n} sum, rounded {round_sum}");
                let want = norm_chain(&s, &w, eps, rule);
                assert_eq!(
                    bits(&norm),
                    bits(&want),
                    "{rows}x{n} {rule:?} after the add"
                );
            }
        }
    }
    eprintln!("norm kernels: bit for bit on 4 widths, 4 rules, with and without the residual add");
}

#[test]
fn fp8_expert_stacks_are_the_stored_weights() {
    let spec = common::test_device();
    if matches!(spec, DeviceSpec::Cpu) {
        // The stack's staged copies are the GPU's; the CPU decodes expert by expert.
        return;
    }
    // Each step says when it ends (a run that did not finish in 60 s on an H100 names where
    // it stopped).
    let started = std::time::Instant::now();
    let step = |what: &str| {
        eprintln!(
            "fp8 expert stack: {what} at {:.1} s",
            started.elapsed().as_secs_f64()
        )
    };
    let dir = tempfile::tempdir().unwrap();
    let fp8 = common::vectors_dir().join("qwen3_5_moe_fp8");
    std::fs::copy(fp8.join("config.json"), dir.path().join("config.json")).unwrap();
    // 2 MiB of codes an expert: a stack goes up 32 experts (64 MiB) a copy, and copies of one
    // size share a staging buffer, so 96 experts take three copies through the same buffer.
    let (out, inp, experts) = (1024usize, 2048usize, 96usize);
    let (tn, tk) = (out / 128, inp / 128);
    let mut data: Vec<(String, safetensors::Dtype, Vec<usize>, Vec<u8>)> = Vec::new();
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    for e in 0..experts {
        let codes: Vec<u8> = (0..out * inp)
            .map(|_| {
                x = x
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                let b = (x >> 56) as u8;
                // 0x7f and 0xff are E4M3's NaNs.
                if b & 0x7f == 0x7f {
                    b ^ 1
                } else {
                    b
                }
            })
            .collect();
        let scales: Vec<u8> = (0..tn * tk)
            .flat_map(|i| (1.0f32 + (e * 7 + i) as f32 / 64.0).to_le_bytes())
            .collect();
        let name = format!("t.experts.{e}.weight");
        data.push((
            format!("{name}_scale_inv"),
            safetensors::Dtype::F32,
            vec![tn, tk],
            scales,
        ));
        data.push((name, safetensors::Dtype::F8_E4M3, vec![out, inp], codes));
    }
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = data
        .iter()
        .map(|(n, d, s, b)| {
            let v = safetensors::tensor::TensorView::new(*d, s.clone(), b).unwrap();
            (n.clone(), v)
        })
        .collect();
    safetensors::serialize_to_file(views, None, &dir.path().join("model.safetensors")).unwrap();
    step("checkpoint written");
    let opts = engy_model::LoadOptions {
        precision: engy_model::Precision::Bf16,
        compute: Compute::F32,
        residency: engy_model::Residency::Streaming,
        device: spec,
        ..engy_model::LoadOptions::default()
    };
    let (_, w) = engy_model::arch::open(dir.path(), &opts).unwrap();
    let names: Vec<String> = (0..experts)
        .map(|e| format!("t.experts.{e}.weight"))
        .collect();
    // Work queued ahead on the stream, as a pass keeps the GPU busy while the host stages the
    // next layer's experts, so that each copy waits in the queue.
    let a = Tensor::zeros((4096, 4096), DType::F32, w.device()).unwrap();
    let mut busy = a.clone();
    for _ in 0..200 {
        busy = busy.matmul(&a).unwrap();
    }
    step("products queued");
    let stack = w.stacked(&names, out, inp, Compute::F32).unwrap();
    step("stacked");
    drop(busy);
    // Each expert against the host's decode of the bytes written above (scales, then codes,
    // an expert at a time). Decoding each on the GPU again took 0.5 s an expert, which ran the
    // test past a minute (2026-12-06): it had looked hung.
    let mut wrong = Vec::new();
    for e in 0..experts {
        let scales: Vec<f32> = data[2 * e]
            .3
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect();
        let want = engy_model::arch::quant::dequant_fp8_block(
            &data[2 * e + 1].3,
            out,
            inp,
            &scales,
            [128, 128],
        )
        .unwrap();
        let want: Vec<u32> = want.iter().map(|v| v.to_bits()).collect();
        if bits(&stack.get(e).unwrap()) != want {
            wrong.push(e);
        }
    }
    step("compared");
    assert!(
        wrong.is_empty(),
        "experts {wrong:?} of the stack are not their stored weights"
    );
    eprintln!(
        "fp8 expert stack: {experts} experts in three copies through one staging buffer, \
         each its stored weights"
    );
}

/// MLA's attention in a bf16 recompute on a GPU (`fused_attention::attention_f32_probs`:
/// bf16 GEMMs, the probabilities kept f32 as three bf16 planes) against the candle
/// operations of the rule (`ops::attention_blocked`, f32 throughout) on the CPU: the same
/// values to f32 rounding (within 2⁻¹⁶ of the values' largest magnitude), with a DSA-like
/// mask (causal, a third of the visible keys dropped, each row keeping itself), grouped and
/// ungrouped heads, and query blocks of 1, 7 and all rows.
#[test]
fn mla_attention_is_the_f32_rule() {
    let dev = common::test_device()
        .device()
        .unwrap_or_else(|e| panic!("ENGY_TEST_DEVICE: {e}"));
    let cpu = &Device::Cpu;
    for (ci, &(h, kv, t, off, d, dv, block)) in [
        (
            4usize, 4usize, 100usize, 30usize, 256usize, 256usize, 100usize,
        ),
        (8, 2, 37, 0, 192, 128, 7),
        (2, 2, 5, 9, 64, 64, 1),
    ]
    .iter()
    .enumerate()
    {
        let s = off + t;
        let seed = 200 + ci as u64 * 3;
        let q = Tensor::from_vec(bf16_values(h * t * d, seed, 1.5), (h, t, d), cpu).unwrap();
        let k = Tensor::from_vec(bf16_values(kv * s * d, seed + 1, 1.5), (kv, s, d), cpu).unwrap();
        let v =
            Tensor::from_vec(bf16_values(kv * s * dv, seed + 2, 4.0), (kv, s, dv), cpu).unwrap();
        let mut mask = vec![f32::NEG_INFINITY; t * s];
        for i in 0..t {
            for j in 0..=off + i {
                if j == off + i || (i * 7 + j * 13) % 3 != 0 {
                    mask[i * s + j] = 0.0;
                }
            }
        }
        let mask = Tensor::from_vec(mask, (t, s), cpu).unwrap();
        let scale = 1.0 / (d as f64).sqrt();
        let want = ops::attention_blocked(&q, &k, &v, scale, Some(&mask), t).unwrap();
        let on = |x: &Tensor| x.to_device(&dev).unwrap();
        let got = fused_attention::attention_f32_probs(
            &on(&q),
            &on(&k),
            &on(&v),
            scale,
            Some(&on(&mask)),
            block,
        )
        .unwrap();
        if matches!(common::test_device(), DeviceSpec::Cpu) {
            assert!(got.is_none(), "the MLA kernel path ran on the CPU");
            return;
        }
        let got = got.unwrap_or_else(|| panic!("case {ci}: the MLA kernel path did not apply"));
        assert_eq!(got.dims(), &[t, h * dv], "case {ci}");
        let flat = |x: &Tensor| x.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        let (want, got) = (flat(&want), flat(&got.to_device(cpu).unwrap()));
        let top = want.iter().fold(0f32, |a, &x| a.max(x.abs()));
        let bound = top * 2f32.powi(-16);
        let worst = want
            .iter()
            .zip(&got)
            .map(|(w, g)| (w - g).abs())
            .fold(0f32, f32::max);
        assert!(worst <= bound, "case {ci}: off by {worst} (bound {bound})");
        eprintln!("mla attention case {ci}: within {worst:e} of scale {top}");
    }
}

/// The W8A8 recompute's activation quantiser on the device (`quant::act_quant_tensor`, run
/// where the activations are) against the host's rule (`quant::act_quant_rows`): bit for bit,
/// on bf16 activations of a layer's width with massive channels, exact ties of the e4m3 grid,
/// subnormal quotients and a zero row.
#[test]
fn the_device_activation_quantiser_is_the_hosts() {
    use engy_model::arch::quant;
    let dev = common::test_device()
        .device()
        .unwrap_or_else(|e| panic!("ENGY_TEST_DEVICE: {e}"));
    let (rows, k) = (33usize, 2048usize);
    let mut x = bf16_values(rows * k, 7, 4.0);
    x[3] = 900.0; // a massive channel: its group's other values quantise to subnormals
    x[k] = 28.0; // scale 2⁻⁴ exactly: 1.0625 / 2⁻⁴ = 17, a tie between 16 and 18
    x[k + 1] = 1.0625;
    x[k + 2] = -1.1875;
    x[2 * k..3 * k].iter_mut().for_each(|v| *v = 0.0);
    let mut want = x.clone();
    quant::act_quant_rows(&mut want, k, quant::ACT_QUANT_GROUP);
    let t = Tensor::from_vec(x, (rows, k), &dev)
        .unwrap()
        .to_dtype(DType::BF16)
        .unwrap();
    let got = quant::act_quant_tensor(&t, quant::ACT_QUANT_GROUP)
        .unwrap()
        .expect("2048 columns are whole groups of 128");
    let got = bits(&got.to_device(&Device::Cpu).unwrap());
    let want: Vec<u32> = want.iter().map(|v| v.to_bits()).collect();
    let differ = got.iter().zip(&want).filter(|(g, w)| g != w).count();
    assert_eq!(
        differ,
        0,
        "{differ} of {} values differ from the host's",
        want.len()
    );
}

/// The block-FP8 decode kernel (`fp8_kernels::block_decode`) against the host decode
/// (`quant::dequant_fp8_block`), bit for bit: every code but E4M3's two NaNs, scales of
/// varied exponents (tiny ones make subnormal and zero products), whole and partial tiles,
/// one matrix and several, in order and picked out of order, f32 and bf16 (rounded to nearest
/// even on the host by `half`). Then the model's paths that use it: every routed expert
/// projection of the FP8 oracle checkpoints stacked on the GPU (`Weights::stacked`, f32 and
/// bf16, and `Weights::stacked_fp8` decoded) holds the CPU's stack.
#[test]
fn the_fp8_decode_kernel_is_the_host_decode() {
    use engy_model::arch::{fp8_kernels, quant};
    let dev = common::test_device()
        .device()
        .unwrap_or_else(|e| panic!("ENGY_TEST_DEVICE: {e}"));
    if dev.is_cpu() {
        return;
    }
    let table = Tensor::from_vec(quant::e4m3_table().to_vec(), 256, &dev).unwrap();
    let mut x = 0x2545_f491_4f6c_dd1du64;
    let mut next = move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    for (n, rows, cols, bn, bk) in [
        (1usize, 256usize, 384usize, 128usize, 128usize),
        (3, 300, 260, 128, 128),
        (2, 24, 128, 24, 128),
        (5, 7, 9, 4, 2),
    ] {
        let (tn, tk) = (rows.div_ceil(bn), cols.div_ceil(bk));
        let codes: Vec<u8> = (0..n * rows * cols)
            .map(|_| {
                let b = (next() >> 56) as u8;
                if b & 0x7f == 0x7f {
                    b ^ 1
                } else {
                    b
                }
            })
            .collect();
        let scales: Vec<f32> = (0..n * tn * tk)
            .map(|_| {
                let r = next();
                let m = 1.0 + (r >> 40) as f32 / (1u64 << 24) as f32;
                m * 2f32.powi(((r >> 8) % 160) as i32 - 140)
            })
            .collect();
        let mut want = Vec::with_capacity(codes.len());
        for e in 0..n {
            let q = &codes[e * rows * cols..(e + 1) * rows * cols];
            let s = &scales[e * tn * tk..(e + 1) * tn * tk];
            want.extend(quant::dequant_fp8_block(q, rows, cols, s, [bn, bk]).unwrap());
        }
        let c = Tensor::from_vec(codes, n * rows * cols, &dev).unwrap();
        let s = Tensor::from_vec(scales, (n, tn, tk), &dev).unwrap();
        // Every matrix in order, then a few out of order and one twice.
        let picks: [Vec<u32>; 2] = [fp8_kernels::all(n), vec![(n - 1) as u32, 0, (n - 1) as u32]];
        for members in &picks {
            for dtype in [DType::F32, DType::BF16] {
                let dims = (n, rows, cols);
                let got = fp8_kernels::block_decode(&c, &s, &table, members, dims, [bn, bk], dtype)
                    .unwrap()
                    .expect("the kernel applies on a GPU");
                assert_eq!(got.dims(), &[members.len(), rows, cols]);
                let got = bits(&got.to_dtype(DType::F32).unwrap());
                let want: Vec<f32> = members
                    .iter()
                    .flat_map(|&m| {
                        let m = m as usize;
                        want[m * rows * cols..(m + 1) * rows * cols].iter().copied()
                    })
                    .collect();
                let off = got
                    .iter()
                    .zip(&want)
                    .filter(|(g, w)| {
                        let w = match dtype {
                            DType::BF16 => half::bf16::from_f32(**w).to_f32(),
                            _ => **w,
                        };
                        **g != w.to_bits()
                    })
                    .count();
                assert_eq!(
                    off, 0,
                    "{n}×[{rows}, {cols}] in {bn}×{bk} tiles, members {members:?}, {dtype:?}: \
                     {off} values differ"
                );
            }
        }
        let past = [n as u32];
        let dims = (n, rows, cols);
        let err = fp8_kernels::block_decode(&c, &s, &table, &past, dims, [bn, bk], DType::F32);
        assert!(err.is_err(), "a member past the stack was decoded");
    }
    let mut stacks = 0;
    for case in ["qwen3_5_moe_fp8", "glm_moe_dsa_fp8"] {
        let dir = common::vectors_dir().join(case);
        let open_on = |device: DeviceSpec, compute: Compute| {
            let opts = engy_model::LoadOptions {
                compute,
                residency: engy_model::Residency::Streaming,
                device,
                ..engy_model::LoadOptions::default()
            };
            engy_model::arch::open(&dir, &opts).unwrap()
        };
        for compute in [Compute::F32, Compute::Bf16] {
            let (cfg, gpu) = open_on(common::test_device(), compute);
            let (_, cpu) = open_on(DeviceSpec::Cpu, compute);
            let experts = cfg
                .usize_req("n_routed_experts")
                .or_else(|_| cfg.usize_req("num_experts"))
                .unwrap();
            for layer in 0..cfg.num_hidden_layers {
                let names = |proj: &str| -> Vec<String> {
                    (0..experts)
                        .map(|e| format!("model.layers.{layer}.mlp.experts.{e}.{proj}.weight"))
                        .collect()
                };
                for proj in ["gate_proj", "up_proj", "down_proj"] {
                    let names = names(proj);
                    let Some([out, inp]) = gpu.shape(&names[0]).map(|s| [s[0], s[1]]) else {
                        continue;
                    };
                    let g = gpu.stacked(&names, out, inp, compute).unwrap();
                    let c = cpu.stacked(&names, out, inp, compute).unwrap();
                    let g = bits(&g.to_dtype(DType::F32).unwrap());
                    let c = bits(&c.to_dtype(DType::F32).unwrap());
                    assert!(
                        g == c,
                        "{case} layer {layer} {proj} {compute:?}: the GPU stack differs"
                    );
                    stacks += 1;
                    if compute == Compute::F32 {
                        let st = gpu.stacked_fp8(&names, out, inp).unwrap();
                        let st = st.expect("FP8 experts are held as stored on a GPU");
                        let all = fp8_kernels::all(names.len());
                        let d = bits(&st.decode(&all, DType::F32).unwrap());
                        assert!(
                            d == c,
                            "{case} layer {layer} {proj}: the FP8 stack decodes otherwise"
                        );
                    }
                }
            }
        }
    }
    assert!(stacks > 0, "no FP8 expert stack was compared");
    eprintln!("fp8 decode kernel: the host decode bit for bit, and {stacks} expert stacks");
}
