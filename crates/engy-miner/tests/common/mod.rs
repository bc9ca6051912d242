//! Shared harness: a generated checkpoint, the sglang and gateway doubles, and the REAL
//! `engy-miner` binary as a child process.
#![allow(dead_code)]
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use engy_core::toploc::{f32_to_bf16_bits, verify_proofs_base64, Dtype, Params};
use engy_devnet::gateway::{Dir, GatewayConfig, GatewayDouble};
use engy_devnet::sglang::synthetic::{
    write_checkpoint, CheckpointSpec, SyntheticBackend, SyntheticConfig,
};
use engy_devnet::sglang::{Element, GenerateRecord, SglangConfig, SglangDouble};
use serde_json::{json, Value};

pub const T: Duration = Duration::from_secs(60);
pub const KEY: &str = "mk-test-secret-4f9a";

pub struct Fixture {
    pub dir: tempfile::TempDir,
    pub sglang: SglangDouble,
    pub gw: GatewayDouble,
}

impl Fixture {
    pub async fn new(hidden: usize, workers: usize, cfg: SglangConfig) -> Self {
        let dir = tempfile::tempdir().unwrap();
        write_checkpoint(
            &dir.path().join("ckpt"),
            &CheckpointSpec {
                hidden_size: hidden,
                vocab_size: 500,
            },
        )
        .unwrap();
        let b =
            SyntheticBackend::from_checkpoint(&dir.path().join("ckpt"), SyntheticConfig::default())
                .unwrap();
        let sglang = SglangDouble::start(Arc::new(b), cfg).await.unwrap();
        let gw = GatewayDouble::start(GatewayConfig {
            workers,
            meta: true,
        })
        .await
        .unwrap();
        Self { dir, sglang, gw }
    }

    pub fn ckpt(&self) -> PathBuf {
        self.dir.path().join("ckpt")
    }

    pub fn lock(&self) -> PathBuf {
        self.dir.path().join("miner.lock")
    }

    /// Start the real miner with the fixture's env plus `extra`.
    pub fn miner(&self, extra: &[(&str, &str)]) -> Miner {
        let log = self
            .dir
            .path()
            .join(format!("miner-{}.log", uuid::Uuid::new_v4().simple()));
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_engy-miner"));
        cmd.env_clear()
            .env("PATH", std::env::var("PATH").unwrap_or_default())
            .env("RUST_LOG", "info")
            .env("GW", self.gw.url())
            .env("MINER_KEY", KEY)
            .env("CHECKPOINT", self.ckpt())
            .env("SERVE_URL", self.sglang.url())
            .env("ENGY_MINER_LOCK", self.lock())
            .env("MAX_INFLIGHT", "8")
            .env("STREAM_FLUSH_S", "0")
            .env("ENGY_DRAIN_S", "5");
        for (k, v) in extra {
            cmd.env(k, v);
        }
        let f = std::fs::File::create(&log).unwrap();
        let child = cmd
            .stdout(Stdio::null())
            .stderr(Stdio::from(f))
            .spawn()
            .unwrap();
        Miner { child, log }
    }
}

pub struct Miner {
    pub child: Child,
    pub log: PathBuf,
}

impl Miner {
    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// SIGTERM and wait (bounded) for the exit status.
    pub fn terminate(&mut self) -> Option<std::process::ExitStatus> {
        let _ = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status();
        let deadline = std::time::Instant::now() + Duration::from_secs(20);
        while std::time::Instant::now() < deadline {
            if let Ok(Some(s)) = self.child.try_wait() {
                return Some(s);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        None
    }
}

impl Drop for Miner {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

pub fn chat(text: &str, max_tokens: u64) -> Value {
    json!({"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": text}],
           "max_tokens": max_tokens})
}

/// The kept rows of a served reply (§2.6.4: last row of 2-D elements, leading empties skipped).
pub fn served_rows(rec: &GenerateRecord) -> Vec<Vec<f32>> {
    let mut out = Vec::new();
    for e in &rec.hidden_states {
        match e {
            Element::Block(b) => {
                if let Some(r) = b.last() {
                    out.push(r.clone());
                }
            }
            Element::Row(r) => out.push(r.clone()),
        }
    }
    out
}

pub fn to_bits(rows: &[Vec<f32>]) -> Vec<Vec<u16>> {
    rows.iter()
        .map(|r| r.iter().map(|v| f32_to_bf16_bits(*v)).collect())
        .collect()
}

/// Verify a commitment's proofs against rows; returns the number of proofs.
pub fn verify_against(commitment: &Value, rows: &[Vec<f32>]) -> usize {
    let t = &commitment["toploc"];
    let params = Params {
        topk: t["topk"].as_u64().unwrap() as usize,
        decode_batching_size: t["decode_batching_size"].as_u64().unwrap() as usize,
        skip_prefill: t["skip_prefill"].as_bool().unwrap(),
    };
    assert!(params.skip_prefill);
    assert_eq!(
        t["n_tokens"].as_u64().unwrap() as usize,
        rows.len(),
        "n_tokens = rows"
    );
    let proofs: Vec<String> = t["proofs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p.as_str().unwrap().to_string())
        .collect();
    let bits = to_bits(rows);
    let elements: Vec<&[u16]> = bits.iter().map(Vec::as_slice).collect();
    let res = verify_proofs_base64(&elements, Dtype::Bf16, &proofs, &params).unwrap();
    for r in &res {
        assert_eq!(
            r.exp_mismatches, 0,
            "proof must match the served rows exactly"
        );
        assert_eq!(r.mant_err_mean, 0.0);
    }
    res.len()
}

/// Wait for a heartbeat from `conn` sent after a fresh ping, and return it.
pub async fn ping_heartbeat(gw: &GatewayDouble, conn: u64) -> Value {
    let before = gw.frames().len();
    assert!(gw.ping(conn));
    gw.wait_for(T, |frames, _| {
        frames
            .iter()
            .skip(before)
            .find(|f| f.conn == conn && f.dir == Dir::FromMiner && f.kind() == "heartbeat")
            .map(|f| f.value.clone())
    })
    .await
    .expect("heartbeat in answer to ping")
}

/// Ping until the leg reports `inflight == 0` (the job released its slot).
pub async fn wait_idle(gw: &GatewayDouble, conn: u64) {
    let deadline = tokio::time::Instant::now() + T;
    loop {
        let hb = ping_heartbeat(gw, conn).await;
        if hb["inflight"] == 0 {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "leg {conn} never went idle: {hb}"
        );
        // Wait for the next recorded change before asking again.
        let n = gw.frames().len();
        let _ = gw
            .wait_for(Duration::from_millis(200), |f, _| {
                (f.len() > n + 1).then_some(())
            })
            .await;
    }
}

pub fn python_has_transformers() -> bool {
    Command::new("python3")
        .args(["-c", "import transformers"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .map(|s| s.success())
        .unwrap_or(false)
}

pub fn script(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests")
        .join(name)
}
