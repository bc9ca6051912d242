//! With the `cuda` feature, compiles engy's own CUDA kernels (`kernels/*.cu`) to PTX in
//! `OUT_DIR` with the toolkit's `nvcc` (scripts/cuda-toolkit.sh puts it on `PATH`; `NVCC`
//! names another). The PTX targets `compute_$CUDA_COMPUTE_CAP` (default 80: the driver
//! compiles it for any GPU from Ampere on), the variable candle's own kernels are built with.
//! The default (CPU) build does nothing here.
use std::path::PathBuf;
use std::process::Command;

const KERNELS: &[&str] = &[
    "attention",
    "delta_rule",
    "dsa",
    "experts",
    "fp8",
    "gated_deltanet",
    "norm",
    "topk",
];

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-env-changed=CUDA_COMPUTE_CAP");
    println!("cargo:rerun-if-env-changed=NVCC");
    if std::env::var_os("CARGO_FEATURE_CUDA").is_none() {
        return;
    }
    let out = PathBuf::from(std::env::var_os("OUT_DIR").unwrap_or_default());
    let nvcc = std::env::var("NVCC").unwrap_or_else(|_| "nvcc".into());
    let cap = std::env::var("CUDA_COMPUTE_CAP").unwrap_or_else(|_| "80".into());
    let cap: String = cap.chars().filter(char::is_ascii_digit).collect();
    for k in KERNELS {
        let src = format!("kernels/{k}.cu");
        println!("cargo:rerun-if-changed={src}");
        let ptx = out.join(format!("{k}.ptx"));
        let status = Command::new(&nvcc)
            .args(["--ptx", "-O3", "-std=c++17"])
            .arg(format!("-arch=compute_{cap}"))
            .arg(&src)
            .arg("-o")
            .arg(&ptx)
            .status();
        match status {
            Ok(s) if s.success() => {}
            Ok(s) => panic!("{nvcc} failed on {src} ({s}); see its messages above"),
            Err(e) => panic!(
                "cannot run {nvcc} for {src}: {e} (the `cuda` feature needs the CUDA toolkit: \
                 eval \"$(scripts/cuda-toolkit.sh)\", docs/AUDITOR.md \"On a GPU\")"
            ),
        }
    }
}
