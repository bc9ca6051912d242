//! Epoch payload verification cost (PROTOCOL.md §6): a typical SN53 vector (256 weights) and
//! a body near the 1 MiB response cap, plus sr25519 sign/verify and the heartbeat signature.

use criterion::{black_box, criterion_group, criterion_main, Criterion, Throughput};
use engy_core::heartbeat::{build_body, signed_headers, HEARTBEAT_PATH};
use engy_core::keys::{verify_signature, Hotkey};
use engy_core::payload::{build_result_json, sign_payload, verify};

fn weights(n: usize) -> Vec<(String, u16)> {
    (0..n)
        .map(|i| {
            let hk = Hotkey::from_mini_secret(&[(i % 251) as u8; 32]).unwrap();
            (hk.ss58(), (i * 257 % 65536) as u16)
        })
        .collect()
}

fn bench_payload(c: &mut Criterion) {
    let master = Hotkey::from_mini_secret(&[1u8; 32]).unwrap();
    let ss58 = master.ss58();
    let mut g = c.benchmark_group("payload_verify");
    // 256 weights ≈ a full subnet; ~8000 weights ≈ 1 MiB with the display copy.
    for n in [256usize, 8000] {
        let rj = build_result_json(53, 12, &weights(n));
        let body = sign_payload(&master, 53, 12, &rj);
        g.throughput(Throughput::Bytes(body.len() as u64));
        g.bench_function(format!("{n}_weights_{}_bytes", body.len()), |b| {
            b.iter(|| verify(black_box(body.as_bytes()), &ss58, 53).unwrap())
        });
    }
    g.finish();

    let msg = b"engy-sn53:epoch:v1:53:12:6e992d9b620d046d2340f7fa58e10214958925fed4c9331bc9a3fb80d41ad6ab";
    let sig = master.sign(msg);
    let pk = master.public_key();
    c.bench_function("sr25519_sign", |b| b.iter(|| master.sign(black_box(msg))));
    c.bench_function("sr25519_verify", |b| {
        b.iter(|| verify_signature(&pk, black_box(msg), &sig).unwrap())
    });
    let body = build_body("engy-lv 0.1.0", Some(12), Some("ab"));
    c.bench_function("heartbeat_signed_headers", |b| {
        b.iter(|| signed_headers(&master, 53, HEARTBEAT_PATH, 1_784_506_210, body.as_bytes()))
    });
}

criterion_group!(benches, bench_payload);
criterion_main!(benches);
