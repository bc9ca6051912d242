//! `engy-devnet`: the whole engy pipeline on one machine, no GPU, no network.
//!
//! * `engy-devnet run`: generate the devnet model, then for an honest serve and three cheat
//!   serves (int4 weights, fp8 experts only, fabricated cells) start the reference serve, the gateway double and the real `engy-miner`, send chat
//!   requests through the gateway and audit every commitment. Prints a table; exit 0 when every
//!   honest proof passes and every cheat is caught, 1 otherwise, 2 when the devnet could not
//!   run (a component failed to start, a request got no response).
//!   The honest and int4 miners' requests are also reported to a real `engy-audit serve`
//!   (SQLite, in the run's temporary directory), whose per-miner table (audited, cheat,
//!   unproven, unanswered, cheat rate bound, §8's gate) is printed last; `--no-service` skips it.
//!   `--arch qwen3_5_moe` runs it on a generated Qwen3.5/3.6-MoE checkpoint (Gated DeltaNet +
//!   gated attention) instead of the default Qwen3-MoE one.
//! * `engy-devnet gen-model --out DIR [--arch A]`: write the devnet checkpoint.
//! * `engy-devnet serve --checkpoint DIR [--quantize int4] --port P`: the reference serve
//!   (sglang's native API, sglang-native-api.md) until SIGTERM / Ctrl-C.
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use clap::{Parser, Subcommand, ValueEnum};
use engy_devnet::audit_service::{locate_audit, render_service_table};
use engy_devnet::devnet::{locate_miner, render_table, run, service_ok, DevnetOptions};
use engy_devnet::devnet_backend::CandleBackend;
use engy_devnet::sglang::{SglangConfig, SglangDouble};
use engy_model::audit::AuditParams;
use engy_model::{gen_model, Compute, GenArch, GenConfig, Precision};

/// engy devnet: the whole pipeline on 127.0.0.1 with a tiny generated model.
#[derive(Parser, Debug)]
#[command(name = "engy-devnet", version, about, long_about = None)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// Run the devnet: honest serve, then the int4, fp8-experts and fabricated-cells cheats,
    /// every commitment audited.
    Run(RunArgs),
    /// Write the devnet checkpoint (bf16 safetensors shards, config, tokenizer, chat template).
    GenModel {
        /// Output directory (created).
        #[arg(long)]
        out: PathBuf,
        /// Model seed.
        #[arg(long, default_value_t = 53)]
        seed: u64,
        /// Architecture of the generated checkpoint.
        #[arg(long, value_enum, default_value_t = ArchArg::Qwen3Moe)]
        arch: ArchArg,
    },
    /// Serve a checkpoint with sglang's native HTTP API (the miner's serve double).
    Serve {
        /// Checkpoint directory (from `gen-model`).
        #[arg(long, env = "CHECKPOINT")]
        checkpoint: PathBuf,
        /// Serve cheaper weights while reporting the same checkpoint: `int4`.
        #[arg(long)]
        quantize: Option<Quantize>,
        /// Columns per int4 group.
        #[arg(long, default_value_t = 32)]
        group_size: usize,
        /// Activation dtype.
        #[arg(long, value_enum, default_value_t = ComputeArg::Bf16)]
        compute: ComputeArg,
        /// Listen address.
        #[arg(long, default_value = "127.0.0.1")]
        host: String,
        /// Listen port.
        #[arg(long, default_value_t = 8000)]
        port: u16,
        /// As sglang's flag: answer `return_routed_experts` with `meta_info.routed_experts`
        /// (docs/PROTOCOL.md §3.10), when the model records its routing.
        #[arg(long)]
        enable_return_routed_experts: bool,
        /// As sglang started with the engy_cells `--forward-hooks` writing to this spool
        /// directory (integrations/sglang/README.md), and `--disable-radix-cache` as the hooks
        /// require: every prefill's cells are spooled for a miner with `ENGY_CELLS=on`.
        #[arg(long, env = "ENGY_CELLS_SPOOL")]
        cells_spool: Option<PathBuf>,
    },
}

/// Activation dtype of a serve.
#[derive(Debug, Clone, Copy, ValueEnum)]
enum ComputeArg {
    /// bf16 activations (f32 accumulation), like a bf16 GPU serve: the auditor's first
    /// recompute, in bf16, differs from it only in the order of rounding.
    Bf16,
    /// f32 activations: honest rows equal the auditor's f32 recompute bit for bit.
    F32,
}

impl From<ComputeArg> for Compute {
    fn from(c: ComputeArg) -> Self {
        match c {
            ComputeArg::Bf16 => Compute::Bf16,
            ComputeArg::F32 => Compute::F32,
        }
    }
}

/// Architecture of the generated devnet checkpoint ([`GenArch`]).
#[derive(Debug, Clone, Copy, ValueEnum)]
enum ArchArg {
    /// Qwen3-MoE (`qwen3_moe`), the default devnet model.
    #[value(name = "qwen3_moe")]
    Qwen3Moe,
    /// Qwen3.5/3.6-MoE text model (`qwen3_5_moe`): Gated DeltaNet and gated attention layers,
    /// routed experts plus a gated shared expert (activations in f32 in every serve).
    #[value(name = "qwen3_5_moe")]
    Qwen3_5Moe,
}

impl From<ArchArg> for GenArch {
    fn from(a: ArchArg) -> Self {
        match a {
            ArchArg::Qwen3Moe => GenArch::Qwen3Moe,
            ArchArg::Qwen3_5Moe => GenArch::Qwen3_5Moe,
        }
    }
}

#[derive(Debug, Clone, Copy, ValueEnum)]
enum Quantize {
    /// Symmetric 4-bit groups, dequantised to bf16.
    Int4,
}

#[derive(clap::Args, Debug)]
struct RunArgs {
    /// Model seed.
    #[arg(long, default_value_t = 53)]
    seed: u64,
    /// Architecture of the generated checkpoint.
    #[arg(long, value_enum, default_value_t = ArchArg::Qwen3Moe)]
    arch: ArchArg,
    /// Generate the model here and keep it (default: a temporary directory).
    #[arg(long)]
    model_dir: Option<PathBuf>,
    /// The engy-miner binary (default: next to this executable).
    #[arg(long, env = "ENGY_MINER_BIN")]
    miner_bin: Option<PathBuf>,
    /// The miner's TOPLOC_GEN_CHUNK (small, so long requests take several /generate calls).
    #[arg(long, default_value_t = 64)]
    gen_chunk: usize,
    /// Columns per int4 group of the cheat.
    #[arg(long, default_value_t = 32)]
    group_size: usize,
    /// Activation dtype of the serves (the auditor recomputes in bf16 first, then in f32 and
    /// in bf16 with eager attention when bf16 does not pass).
    #[arg(long, value_enum, default_value_t = ComputeArg::Bf16)]
    serve_compute: ComputeArg,
    /// Audit: proof top-k (model spec toploc_k).
    #[arg(long, default_value_t = 128)]
    toploc_k: usize,
    /// Audit: exponent mismatches a batch may have (model spec toploc_v).
    #[arg(long, default_value_t = 40)]
    toploc_v: u64,
    /// Audit: fraction of batches that must pass (model spec toploc_p).
    #[arg(long, default_value_t = 0.99)]
    toploc_p: f64,
    /// Longest wait for one request, in seconds.
    #[arg(long, default_value_t = 120.0)]
    request_timeout_s: f64,
    /// Keep every commitment and its verdict in this directory (`verdicts.tsv`), to audit
    /// them again elsewhere (`engy-audit audit --device cuda`).
    #[arg(long, value_name = "DIR")]
    save_commitments: Option<PathBuf>,
    /// The engy-audit binary whose `serve` the honest and int4 miners' requests are reported
    /// to (default: next to this executable).
    #[arg(long, env = "ENGY_AUDIT_BIN")]
    audit_bin: Option<PathBuf>,
    /// Run without the audit service (no engy-audit binary needed, no service table).
    #[arg(long)]
    no_service: bool,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("engy-devnet: cannot start the async runtime: {e}");
            return ExitCode::from(2);
        }
    };
    let result = rt.block_on(async move {
        match cli.cmd {
            Cmd::Run(a) => run_cmd(a).await,
            Cmd::GenModel { out, seed, arch } => {
                let cfg = GenConfig {
                    arch: arch.into(),
                    ..GenConfig::default()
                };
                let r = gen_model(&out, seed, &cfg)
                    .with_context(|| format!("generating into {}", out.display()))?;
                println!(
                    "wrote {} ({} parameters, vocab {}): {}",
                    out.display(),
                    r.parameters,
                    r.vocab_size,
                    r.files.join(", ")
                );
                Ok(ExitCode::SUCCESS)
            }
            Cmd::Serve {
                checkpoint,
                quantize,
                group_size,
                compute,
                host,
                port,
                enable_return_routed_experts,
                cells_spool,
            } => {
                let addr = (host, port);
                serve_cmd(
                    checkpoint,
                    quantize,
                    group_size,
                    compute.into(),
                    addr,
                    enable_return_routed_experts,
                    cells_spool,
                )
                .await
            }
        }
    });
    match result {
        Ok(code) => code,
        Err(e) => {
            eprintln!("engy-devnet: error: {e:#}");
            ExitCode::from(2)
        }
    }
}

async fn run_cmd(a: RunArgs) -> anyhow::Result<ExitCode> {
    anyhow::ensure!(a.gen_chunk > 0, "--gen-chunk must be at least 1");
    let opts = DevnetOptions {
        seed: a.seed,
        arch: a.arch.into(),
        model_dir: a.model_dir,
        miner_bin: locate_miner(a.miner_bin)?,
        gen_chunk: a.gen_chunk,
        int4_group: a.group_size,
        serve_compute: a.serve_compute.into(),
        audit: AuditParams {
            toploc_k: a.toploc_k,
            toploc_v: a.toploc_v,
            toploc_p: a.toploc_p,
            ..AuditParams::default()
        },
        request_timeout: Duration::from_secs_f64(a.request_timeout_s.clamp(1.0, 86_400.0)),
        save_commitments: a.save_commitments,
        audit_bin: if a.no_service {
            None
        } else {
            Some(locate_audit(a.audit_bin)?)
        },
    };
    let started = std::time::Instant::now();
    let out = run(&opts).await?;
    let rows = &out.rows;
    println!();
    print!("{}", render_table(rows));
    let mut ok = rows.iter().all(|r| r.ok);
    if opts.audit_bin.is_some() {
        let service_ok = service_ok(&out.service);
        println!(
            "\naudit service (engy-audit serve, SQLite; GET /v1/miners/{{hotkey}}){}:",
            if service_ok { "" } else { " UNEXPECTED" }
        );
        print!("{}", render_service_table(&out.service));
        ok &= service_ok;
    }
    println!(
        "{} in {:.1} s",
        if ok {
            "devnet OK: every honest proof and cell passed and every cheat was caught"
        } else {
            "devnet FAILED: see the rows marked UNEXPECTED"
        },
        started.elapsed().as_secs_f64()
    );
    Ok(if ok {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    })
}

async fn serve_cmd(
    checkpoint: PathBuf,
    quantize: Option<Quantize>,
    group_size: usize,
    compute: Compute,
    (host, port): (String, u16),
    routed_experts: bool,
    cells_spool: Option<PathBuf>,
) -> anyhow::Result<ExitCode> {
    let precision = match quantize {
        Some(Quantize::Int4) => Precision::Int4 { group_size },
        None => Precision::Bf16,
    };
    let backend = CandleBackend::open_with(&checkpoint, precision, compute)
        .with_context(|| format!("loading {}", checkpoint.display()))?;
    let root = backend.model_root().to_string();
    let listener = tokio::net::TcpListener::bind((host.as_str(), port))
        .await
        .with_context(|| format!("binding {host}:{port}"))?;
    // Long-running: keep nothing per request (the request log is for tests).
    let cfg = SglangConfig {
        record: false,
        radix_cache: cells_spool.is_none(),
        ..SglangConfig::default()
    }
    .with_routed_experts(routed_experts)
    .with_cells_spool(cells_spool);
    let serve =
        SglangDouble::start_on(listener, Arc::new(backend), cfg).context("starting the serve")?;
    eprintln!(
        "serving {} ({precision} weights, {compute:?} activations, model_root {root}) at {}; \
         stop with SIGTERM or Ctrl-C",
        checkpoint.display(),
        serve.url()
    );
    wait_for_signal().await;
    eprintln!("signal received; stopping the serve");
    drop(serve);
    Ok(ExitCode::SUCCESS)
}

async fn wait_for_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        if let Ok(mut term) = signal(SignalKind::terminate()) {
            tokio::select! {
                _ = term.recv() => {}
                _ = tokio::signal::ctrl_c() => {}
            }
            return;
        }
    }
    let _ = tokio::signal::ctrl_c().await;
}
