//! Best-effort hardware facts for HELLO (docs/PROTOCOL.md §2.1). Never fatal, never opens a GPU
//! context: GPUs are read with `nvidia-smi` (a query, no context).
use std::time::Duration;

use serde_json::{json, Map, Value};

/// This host's name (`/proc/sys/kernel/hostname`, `/etc/hostname`, `$HOSTNAME`), or "".
pub fn hostname() -> String {
    for p in ["/proc/sys/kernel/hostname", "/etc/hostname"] {
        if let Ok(s) = std::fs::read_to_string(p) {
            let s = s.trim();
            if !s.is_empty() {
                return s.to_string();
            }
        }
    }
    std::env::var("HOSTNAME").unwrap_or_default()
}

fn ram_gb() -> Option<f64> {
    let s = std::fs::read_to_string("/proc/meminfo").ok()?;
    let kb: f64 = s
        .lines()
        .find(|l| l.starts_with("MemTotal:"))?
        .split_whitespace()
        .nth(1)?
        .parse()
        .ok()?;
    Some((kb * 1024.0 / 1e9 * 10.0).round() / 10.0)
}

async fn nvidia_smi() -> Option<(String, usize, f64)> {
    let out = tokio::time::timeout(
        Duration::from_secs(5),
        tokio::process::Command::new("nvidia-smi")
            .args([
                "--query-gpu=name,memory.total",
                "--format=csv,noheader,nounits",
            ])
            .kill_on_drop(true)
            .output(),
    )
    .await
    .ok()?
    .ok()?;
    let text = String::from_utf8_lossy(&out.stdout);
    let lines: Vec<&str> = text.lines().filter(|l| !l.trim().is_empty()).collect();
    let first = lines.first()?;
    let mut parts = first.split(',').map(str::trim);
    let name = parts.next()?.to_string();
    let mem_mib: f64 = parts.next()?.parse().ok()?;
    Some((name, lines.len(), (mem_mib / 1024.0 * 10.0).round() / 10.0))
}

/// The `hw` object: host, cpus, ram_gb, gpu, gpu_count, gpu_mem_gb, parallelism (`par`,
/// HW_PAR, default `tp`), gpus summary (`gpus`, HW_GPUS, else `<count>x <name>` from
/// nvidia-smi, else `?x GPU`). The second value is true when the summary is that last
/// fallback (no HW_GPUS and no nvidia-smi answer), which the daemon warns about once.
pub async fn detect(par: &str, gpus: Option<&str>) -> (Value, bool) {
    let mut hw = Map::new();
    hw.insert("parallelism".into(), json!(par));
    let host = hostname();
    if !host.is_empty() {
        hw.insert("host".into(), json!(host));
    }
    if let Ok(n) = std::thread::available_parallelism() {
        hw.insert("cpus".into(), json!(n.get()));
    }
    if let Some(r) = ram_gb() {
        hw.insert("ram_gb".into(), json!(r));
    }
    let gpu = nvidia_smi().await;
    if let Some((name, count, mem)) = &gpu {
        hw.insert("gpu".into(), json!(name));
        hw.insert("gpu_count".into(), json!(count));
        hw.insert("gpu_mem_gb".into(), json!(mem));
    }
    let (summary, unknown) = match (gpus.map(str::trim).filter(|s| !s.is_empty()), &gpu) {
        (Some(s), _) => (s.to_owned(), false),
        (None, Some((name, count, _))) => (format!("{count}x {name}"), false),
        (None, None) => ("?x GPU".to_owned(), true),
    };
    hw.insert("gpus".into(), json!(summary));
    (Value::Object(hw), unknown)
}
