//! The `spec` command of `engy-validator` and `engy-audit` (one crate, so both binaries share
//! one source): build, verify, open and inspect `engy-commit/v1` Merkle weight commitments over
//! safetensors checkpoints (specs/SCHEME.md; docs/PROTOCOL.md §4).
//!
//! Exit codes (every subcommand): 0 = done / matches / proof valid; 1 = bad input or I/O
//! error (message on stderr); 2 = recomputed roots differ from the spec, or the opening
//! proof is rejected (reason on stderr).
use std::io::{ErrorKind, Write};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use engy_core::commit::{
    self, checkpoint, spec, CommitOptions, Commitment, LayerPart, OpeningProof, Progress, SpecFile,
    UnitId,
};

/// Exit code when roots differ or a proof is rejected.
const MISMATCH: u8 = 2;

/// Arguments of `engy-validator spec`.
#[derive(clap::Args, Debug)]
pub struct SpecArgs {
    #[command(subcommand)]
    command: SpecCommand,
}

#[derive(clap::Subcommand, Debug)]
enum SpecCommand {
    /// Commit a checkpoint: write <out>/model_spec.json.gz and <out>/README.md.
    Build(BuildArgs),
    /// Recompute a checkpoint's roots and compare them with a spec file (exit 2 on mismatch).
    Verify(VerifyArgs),
    /// Emit an opening proof (JSON) of one unit, e.g. `--layer 3 --expert 17`.
    Open(OpenArgs),
    /// Check an opening proof against a trusted model_root, without the checkpoint (exit 2 if rejected).
    CheckOpening(CheckOpeningArgs),
    /// Show the structure of a spec file (ours or published); never recomputes unknown-scheme roots.
    Inspect(InspectArgs),
}

/// Checkpoint and hashing options shared by build/verify/open.
#[derive(clap::Args, Debug)]
struct CheckpointArgs {
    /// Checkpoint directory: config.json + *.safetensors shards (read via mmap).
    #[arg(long, env = "ENGY_CHECKPOINT", value_name = "DIR")]
    checkpoint: PathBuf,
    /// Hashing threads (default: all cores).
    #[arg(long, env = "ENGY_SPEC_JOBS")]
    jobs: Option<usize>,
    /// Override the weight format detected from config.json (bf16, fp8, nvfp4, ...).
    #[arg(long)]
    quant: Option<String>,
    /// Override `arch` (default: config.json model_type).
    #[arg(long)]
    arch: Option<String>,
    /// Commit the whole config.json (its SHA-256 as `config_sha256`, specs/SCHEME.md "Config
    /// leaf"); changes model_root. `verify` turns it on for a spec built with it.
    #[arg(long)]
    bind_config: bool,
    /// No progress lines on stderr.
    #[arg(long, short)]
    quiet: bool,
}

impl CheckpointArgs {
    fn options(&self) -> CommitOptions {
        CommitOptions {
            quant: self.quant.clone(),
            arch: self.arch.clone(),
            bind_config: self.bind_config,
        }
    }
}

#[derive(clap::Args, Debug)]
struct BuildArgs {
    #[command(flatten)]
    ckpt: CheckpointArgs,
    /// Output directory (created): model_spec.json.gz + README.md.
    #[arg(long, value_name = "DIR")]
    out: PathBuf,
    /// Model name for the README (default: the output directory's name).
    #[arg(long)]
    name: Option<String>,
}

#[derive(clap::Args, Debug)]
struct VerifyArgs {
    #[command(flatten)]
    ckpt: CheckpointArgs,
    /// Spec file (model_spec.json.gz) or a directory holding one.
    #[arg(long, value_name = "FILE")]
    spec: PathBuf,
}

#[derive(clap::Args, Debug)]
struct OpenArgs {
    #[command(flatten)]
    ckpt: CheckpointArgs,
    /// Decoder layer of the unit.
    #[arg(long)]
    layer: Option<u32>,
    /// Routed expert index (with --layer).
    #[arg(long, conflicts_with = "unit")]
    expert: Option<u32>,
    /// Unit other than an expert: attn, mlp, router, shared (with --layer), globals, lm.
    #[arg(long)]
    unit: Option<String>,
    /// Take sibling roots from this spec file and hash only the opened unit (fast); the
    /// unit's recomputed root must match the spec's.
    #[arg(long, value_name = "FILE")]
    spec: Option<PathBuf>,
    /// Write the proof here instead of stdout.
    #[arg(long, value_name = "FILE")]
    out: Option<PathBuf>,
}

#[derive(clap::Args, Debug)]
struct CheckOpeningArgs {
    /// The opening proof (JSON from `spec open`).
    #[arg(long, value_name = "FILE")]
    proof: PathBuf,
    /// Trust the model_root of this spec file (or directory holding model_spec.json.gz).
    #[arg(
        long,
        value_name = "FILE",
        required_unless_present = "root",
        conflicts_with = "root"
    )]
    spec: Option<PathBuf>,
    /// Trust this model_root (64 hex).
    #[arg(long)]
    root: Option<String>,
}

#[derive(clap::Args, Debug)]
struct InspectArgs {
    /// Spec file (model_spec.json.gz or plain JSON) or a directory holding one.
    file: PathBuf,
    /// Print the summary as JSON.
    #[arg(long)]
    json: bool,
}

/// Set once the reader of standard output has gone (`spec inspect … | head -1`).
static STDOUT_CLOSED: AtomicBool = AtomicBool::new(false);

/// Writes one line of a command's result to standard output. A closed pipe is not an error:
/// the rest of the output is dropped and the command ends with its own exit code (as
/// `engy-audit audit` does). Any other write error is returned.
fn out_line(args: std::fmt::Arguments<'_>) -> anyhow::Result<()> {
    if STDOUT_CLOSED.load(Ordering::Relaxed) {
        return Ok(());
    }
    let mut out = std::io::stdout().lock();
    match out.write_fmt(args).and_then(|()| out.write_all(b"\n")) {
        Err(e) if e.kind() == ErrorKind::BrokenPipe => {
            STDOUT_CLOSED.store(true, Ordering::Relaxed);
            Ok(())
        }
        r => r.context("writing to standard output"),
    }
}

/// `println!` through [`out_line`], `?` on its error.
macro_rules! outln {
    ($($t:tt)*) => {
        out_line(format_args!($($t)*))?
    };
}

/// Runs `engy-validator spec`.
pub fn main(args: SpecArgs) -> anyhow::Result<ExitCode> {
    match args.command {
        SpecCommand::Build(a) => build(a),
        SpecCommand::Verify(a) => verify(a),
        SpecCommand::Open(a) => open(a),
        SpecCommand::CheckOpening(a) => check_opening(a),
        SpecCommand::Inspect(a) => inspect(a),
    }
}

/// `FILE` or `DIR/model_spec.json.gz`.
fn spec_path(p: &Path) -> PathBuf {
    if p.is_dir() {
        p.join("model_spec.json.gz")
    } else {
        p.to_path_buf()
    }
}

/// Commits the checkpoint on a pool of `jobs` threads, printing progress to stderr.
fn commit_with_progress(a: &CheckpointArgs) -> anyhow::Result<(Commitment, f64)> {
    let mut pool = rayon::ThreadPoolBuilder::new();
    if let Some(j) = a.jobs {
        if j == 0 {
            bail!("--jobs must be at least 1");
        }
        pool = pool.num_threads(j);
    }
    let pool = pool.build().context("starting the hashing threads")?;
    let progress = Progress::default();
    let start = Instant::now();
    if !a.quiet {
        eprintln!(
            "spec: committing {} on {} threads",
            a.checkpoint.display(),
            pool.current_num_threads()
        );
    }
    let (done_tx, done_rx) = std::sync::mpsc::channel::<()>();
    let result = std::thread::scope(|s| {
        if !a.quiet {
            let progress = &progress;
            s.spawn(move || {
                while let Err(std::sync::mpsc::RecvTimeoutError::Timeout) =
                    done_rx.recv_timeout(Duration::from_secs(1))
                {
                    eprintln!("spec: {}", progress_line(progress, start.elapsed()));
                }
            });
        }
        let r = pool.install(|| commit::commit_checkpoint(&a.checkpoint, &a.options(), &progress));
        drop(done_tx);
        r
    });
    let c = result.with_context(|| format!("committing {}", a.checkpoint.display()))?;
    let secs = start.elapsed().as_secs_f64();
    if !a.quiet {
        eprintln!("spec: done: {}", progress_line(&progress, start.elapsed()));
    }
    Ok((c, secs))
}

fn progress_line(p: &Progress, elapsed: Duration) -> String {
    let gb = |b: u64| b as f64 / 1e9;
    let done = p.bytes_done.load(Ordering::Relaxed);
    let secs = elapsed.as_secs_f64().max(1e-9);
    format!(
        "{}/{} tensors, {:.2}/{:.2} GB, {:.2} GB/s",
        p.tensors_done.load(Ordering::Relaxed),
        p.tensors_total.load(Ordering::Relaxed),
        gb(done),
        gb(p.bytes_total.load(Ordering::Relaxed)),
        gb(done) / secs
    )
}

fn build(a: BuildArgs) -> anyhow::Result<ExitCode> {
    let (c, secs) = commit_with_progress(&a.ckpt)?;
    let spec = SpecFile::from_commitment(&c, (secs * 10.0).round() / 10.0);
    std::fs::create_dir_all(&a.out).with_context(|| format!("creating {}", a.out.display()))?;
    let path = a.out.join("model_spec.json.gz");
    spec.write_gz(&path)?;
    let name = a.name.clone().unwrap_or_else(|| {
        a.out
            .canonicalize()
            .ok()
            .and_then(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()))
            .unwrap_or_else(|| "model".into())
    });
    let readme = a.out.join("README.md");
    std::fs::write(&readme, readme_text(&name, &spec)?)
        .with_context(|| format!("writing {}", readme.display()))?;
    eprintln!(
        "spec: wrote {} and {}; model_root follows on stdout",
        path.display(),
        readme.display()
    );
    outln!("{}", spec.model_root);
    Ok(ExitCode::SUCCESS)
}

/// The README written beside a spec: every top-level root and layer root.
fn readme_text(name: &str, s: &SpecFile) -> anyhow::Result<String> {
    use std::fmt::Write;
    let mut t = String::new();
    writeln!(t, "# {name}: `{}` weight commitment\n", s.scheme)?;
    writeln!(
        t,
        "Built by `engy-validator spec build` (engy {}) over {} tensors ({:.3} GB) in {:.1} s.",
        env!("CARGO_PKG_VERSION"),
        s.n_tensors,
        s.n_bytes as f64 / 1e9,
        s.built_in_s
    )?;
    writeln!(
        t,
        "The scheme is specified in `specs/SCHEME.md`; recompute with\n`engy-validator spec verify --checkpoint <DIR> --spec model_spec.json.gz`.\n"
    )?;
    writeln!(t, "| root | value |\n|---|---|")?;
    for (k, v) in [
        ("model_root", s.model_root),
        ("config_leaf", s.config_leaf),
        ("body_root", s.body_root),
        ("globals_root", s.globals_root),
        ("lm_root", s.lm_root),
    ] {
        writeln!(t, "| `{k}` | `{v}` |")?;
    }
    writeln!(
        t,
        "\nConfig (canonical JSON, hashed into `config_leaf`):\n\n```json\n{}\n```\n",
        s.config.canonical_json()?
    )?;
    writeln!(t, "| layer | kind | layer_root |\n|---|---|---|")?;
    for (i, r) in s.layer_roots.iter().enumerate() {
        let kind = if s.expert_roots_by_layer.contains_key(&(i as u32)) {
            "moe"
        } else {
            "dense"
        };
        writeln!(t, "| {i} | {kind} | `{r}` |")?;
    }
    Ok(t)
}

fn verify(mut a: VerifyArgs) -> anyhow::Result<ExitCode> {
    let path = spec_path(&a.spec);
    let want = SpecFile::read(&path).with_context(|| format!("reading {}", path.display()))?;
    // A spec that binds config.json (specs/SCHEME.md "Config leaf") is verified bound.
    a.ckpt.bind_config |= want.config.config_sha256.is_some();
    let (c, _) = commit_with_progress(&a.ckpt)?;
    let got = SpecFile::from_commitment(&c, 0.0);
    let diff = want.diff(&got);
    if diff.is_empty() {
        outln!(
            "ok: {} matches model_root {}",
            a.ckpt.checkpoint.display(),
            got.model_root
        );
        return Ok(ExitCode::SUCCESS);
    }
    eprintln!(
        "spec verify: {} differs from {} in {} place(s):",
        a.ckpt.checkpoint.display(),
        path.display(),
        diff.len()
    );
    for d in &diff {
        eprintln!("  {d}");
    }
    Ok(ExitCode::from(MISMATCH))
}

fn unit_id(a: &OpenArgs) -> anyhow::Result<UnitId> {
    let need_layer = || a.layer.context("--layer is required for this unit");
    Ok(match (a.expert, a.unit.as_deref()) {
        (Some(e), None) => UnitId::Layer {
            layer: need_layer()?,
            part: LayerPart::Expert(e),
        },
        (None, Some("globals")) | (None, Some("lm")) if a.layer.is_some() => {
            bail!("--unit globals/lm takes no --layer")
        }
        (None, Some("globals")) => UnitId::Globals,
        (None, Some("lm")) => UnitId::Lm,
        (None, Some(u)) => {
            let part = match u {
                "attn" => LayerPart::Attn,
                "mlp" => LayerPart::Mlp,
                "router" => LayerPart::Router,
                "shared" => LayerPart::Shared,
                other => bail!("unknown --unit {other:?} (attn, mlp, router, shared, globals, lm)"),
            };
            UnitId::Layer {
                layer: need_layer()?,
                part,
            }
        }
        (None, None) => bail!("give --expert E or --unit NAME"),
        (Some(_), Some(_)) => bail!("give --expert or --unit, not both"),
    })
}

fn open(a: OpenArgs) -> anyhow::Result<ExitCode> {
    let unit = unit_id(&a)?;
    let proof = match &a.spec {
        Some(spec) => {
            let path = spec_path(spec);
            let s = SpecFile::read(&path).with_context(|| format!("reading {}", path.display()))?;
            let tensors = checkpoint::hash_unit(&a.ckpt.checkpoint, &s.config, unit)
                .with_context(|| format!("hashing {unit} of {}", a.ckpt.checkpoint.display()))?;
            s.open(unit, tensors)?
        }
        None => commit_with_progress(&a.ckpt)?.0.open(unit)?,
    };
    let json = serde_json::to_string_pretty(&proof)?;
    match &a.out {
        Some(p) => {
            std::fs::write(p, json + "\n").with_context(|| format!("writing {}", p.display()))?;
            eprintln!(
                "spec: wrote the opening proof of {unit} ({} tensors) under model_root {} to {}",
                proof.tensors.len(),
                proof.model_root,
                p.display()
            );
        }
        None => outln!("{json}"),
    }
    Ok(ExitCode::SUCCESS)
}

fn check_opening(a: CheckOpeningArgs) -> anyhow::Result<ExitCode> {
    let text = std::fs::read_to_string(&a.proof)
        .with_context(|| format!("reading {}", a.proof.display()))?;
    let proof: OpeningProof = serde_json::from_str(&text)
        .with_context(|| format!("{} is not an opening proof", a.proof.display()))?;
    let trusted = match (&a.spec, &a.root) {
        (Some(s), None) => {
            let path = spec_path(s);
            SpecFile::read(&path)
                .with_context(|| format!("reading {}", path.display()))?
                .model_root
                .0
        }
        (None, Some(r)) => commit::parse_digest(r).context("--root")?,
        _ => bail!("give exactly one of --spec or --root"),
    };
    let unit = UnitId::try_from(proof.unit).map_err(anyhow::Error::from)?;
    match proof.verify(&trusted) {
        Ok(()) => {
            outln!(
                "ok: {unit} ({} tensors, unit_root {}) is committed under model_root {}",
                proof.tensors.len(),
                proof.unit_root,
                hex::encode(trusted)
            );
            Ok(ExitCode::SUCCESS)
        }
        Err(e) => {
            eprintln!("spec check-opening: REJECTED {}: {e}", a.proof.display());
            Ok(ExitCode::from(MISMATCH))
        }
    }
}

fn inspect(a: InspectArgs) -> anyhow::Result<ExitCode> {
    let path = spec_path(&a.file);
    let v = spec::read_json(&path).with_context(|| format!("reading {}", path.display()))?;
    let s = spec::inspect(&v);
    if a.json {
        outln!("{}", serde_json::to_string_pretty(&s)?);
        return Ok(ExitCode::SUCCESS);
    }
    let opt = |x: &Option<String>| x.clone().unwrap_or_else(|| "-".into());
    let num = |x: Option<u64>| x.map_or_else(|| "-".into(), |n| n.to_string());
    outln!("file:        {}", path.display());
    outln!(
        "scheme:      {}",
        s.scheme
            .clone()
            .unwrap_or_else(|| "(none: made by another tool)".into())
    );
    outln!(
        "model:       arch {}, n_layers {}, n_experts {}, quant {}",
        opt(&s.arch),
        num(s.n_layers),
        num(s.n_experts),
        opt(&s.quant)
    );
    for (k, v) in &s.roots {
        outln!("{:<13}{v}", format!("{k}:"));
    }
    let keys = match (s.moe_layer_keys.first(), s.moe_layer_keys.last()) {
        (Some(a), Some(b)) => format!("{} MoE entries, keys {a}..{b}", s.moe_layer_keys.len()),
        _ => "no MoE entries".into(),
    };
    outln!("layer_roots: {} ({keys})", s.n_layer_roots);
    if let Some((lo, hi)) = s.experts_per_layer {
        outln!("experts:     {lo}..{hi} per MoE layer");
    }
    outln!("entry keys:  {}", s.moe_entry_fields.join(", "));
    outln!(
        "consistency: layer_roots {} the entries' layer_root",
        if s.layer_roots_match_entries {
            "match"
        } else {
            "DO NOT match"
        }
    );
    if let Some((n, bytes)) = s.router_bias {
        outln!("router bias: {n} layers, {bytes} bytes each");
    }
    if let Some(p) = s.partial {
        outln!("partial:     {p}");
    }
    match &s.internal_problems {
        None => outln!(
            "recompute:   not possible: the leaf/node hashing of this file's scheme is not public; compare structure only"
        ),
        Some(p) if p.is_empty() => outln!(
            "recompute:   {} file, internally consistent; `spec verify --checkpoint DIR` recomputes it",
            commit::SCHEME
        ),
        Some(p) => {
            outln!("recompute:   {} file with {} internal problem(s):", commit::SCHEME, p.len());
            for x in p {
                outln!("  {x}");
            }
            return Ok(ExitCode::from(MISMATCH));
        }
    }
    Ok(ExitCode::SUCCESS)
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct T {
        #[command(flatten)]
        a: SpecArgs,
    }

    fn run(args: &[&str]) -> anyhow::Result<ExitCode> {
        let mut v = vec!["spec"];
        v.extend_from_slice(args);
        main(T::try_parse_from(v)?.a)
    }

    /// A two-layer dense Qwen3 checkpoint in one shard (devnet naming).
    fn checkpoint(dir: &Path) {
        use safetensors::{tensor::TensorView, Dtype};
        std::fs::create_dir_all(dir).unwrap();
        std::fs::write(
            dir.join("config.json"),
            r#"{"model_type":"qwen3","num_hidden_layers":2,"hidden_size":4,"intermediate_size":8,"vocab_size":8,"torch_dtype":"bfloat16"}"#,
        )
        .unwrap();
        let mut names = vec![
            ("model.embed_tokens.weight".to_string(), vec![8usize, 4]),
            ("model.norm.weight".into(), vec![4]),
            ("lm_head.weight".into(), vec![8, 4]),
        ];
        for l in 0..2 {
            for p in ["self_attn.q_proj", "self_attn.o_proj", "input_layernorm"] {
                names.push((format!("model.layers.{l}.{p}.weight"), vec![4, 4]));
            }
            for p in ["gate_proj", "up_proj", "down_proj"] {
                names.push((format!("model.layers.{l}.mlp.{p}.weight"), vec![8, 4]));
            }
        }
        let data: Vec<Vec<u8>> = names
            .iter()
            .enumerate()
            .map(|(i, (_, s))| vec![i as u8; s.iter().product::<usize>() * 2])
            .collect();
        let views: Vec<(String, TensorView<'_>)> = names
            .iter()
            .zip(&data)
            .map(|((n, s), d)| {
                (
                    n.clone(),
                    TensorView::new(Dtype::BF16, s.clone(), d).unwrap(),
                )
            })
            .collect();
        safetensors::serialize_to_file(views, None, &dir.join("model.safetensors")).unwrap();
    }

    #[test]
    fn build_verify_open_check_inspect() {
        let t = tempfile::tempdir().unwrap();
        let ck = t.path().join("ckpt");
        let out = t.path().join("spec");
        checkpoint(&ck);
        let ck_s = ck.to_str().unwrap();
        let out_s = out.to_str().unwrap();
        assert_eq!(
            run(&["build", "--checkpoint", ck_s, "--out", out_s, "-q"]).unwrap(),
            ExitCode::SUCCESS
        );
        let readme = std::fs::read_to_string(out.join("README.md")).unwrap();
        let spec = SpecFile::read(&out.join("model_spec.json.gz")).unwrap();
        assert!(readme.contains(&spec.model_root.to_string()));
        assert_eq!(
            run(&["verify", "--checkpoint", ck_s, "--spec", out_s, "-q"]).unwrap(),
            ExitCode::SUCCESS
        );
        assert_eq!(run(&["inspect", out_s]).unwrap(), ExitCode::SUCCESS);

        let proof = t.path().join("p.json");
        let proof_s = proof.to_str().unwrap();
        for extra in [&[][..], &["--spec", out_s][..]] {
            let mut args = vec![
                "open",
                "--checkpoint",
                ck_s,
                "--layer",
                "1",
                "--unit",
                "mlp",
                "-q",
                "--out",
                proof_s,
            ];
            args.extend_from_slice(extra);
            assert_eq!(run(&args).unwrap(), ExitCode::SUCCESS);
            assert_eq!(
                run(&["check-opening", "--proof", proof_s, "--spec", out_s]).unwrap(),
                ExitCode::SUCCESS
            );
        }
        let root = spec.model_root.to_string();
        assert_eq!(
            run(&["check-opening", "--proof", proof_s, "--root", &root]).unwrap(),
            ExitCode::SUCCESS
        );
        let other = format!("{}0", &root[..63]);
        let other = if other == root {
            format!("{}1", &root[..63])
        } else {
            other
        };
        assert_eq!(
            run(&["check-opening", "--proof", proof_s, "--root", &other]).unwrap(),
            ExitCode::from(MISMATCH)
        );
        assert!(run(&[
            "open",
            "--checkpoint",
            ck_s,
            "--layer",
            "1",
            "--expert",
            "0",
            "-q"
        ])
        .is_err());

        // One byte changes: verify reports the mismatch with exit code 2.
        let shard = ck.join("model.safetensors");
        let mut bytes = std::fs::read(&shard).unwrap();
        let last = bytes.len() - 1;
        bytes[last] ^= 1;
        std::fs::write(&shard, bytes).unwrap();
        assert_eq!(
            run(&["verify", "--checkpoint", ck_s, "--spec", out_s, "-q"]).unwrap(),
            ExitCode::from(MISMATCH)
        );
    }
}
