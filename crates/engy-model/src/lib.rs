//! engy-model: the model runtime on candle: the tiny Qwen3-style devnet model, the
//! architectures the network serves, and the auditor's rules.
//!
//! * [`gen_model`] writes a real, small Qwen3(-MoE) checkpoint deterministically from a seed:
//!   bf16 safetensors shards, `config.json`, a byte-level BPE `tokenizer.json` trained on a
//!   generated corpus, a ChatML `tokenizer_config.json`, `generation_config.json`.
//! * [`Model`] runs it on CPU: greedy decoding with a KV cache ([`Decoder`]) returning each
//!   step's final hidden state (the LM head's input, what sglang returns), a teacher-forced
//!   single pass ([`Model::hidden_states`]), and the int4 cheat ([`Precision::Int4`]).
//! * [`audit`] re-derives a commitment's hidden states in one teacher-forced pass and verifies
//!   its TOPLOC proofs (PROTOCOL.md §3.10, §4, §5), giving `pass` / `cheat` / `unproven`.
//! * [`arch`]: the served architectures (`qwen3_moe`, `qwen3_5_moe`, `glm_moe_dsa`) behind one
//!   trait, their weights (bf16, block FP8, NVFP4), the routing record and replay, and engy's
//!   own CUDA kernels (`kernels/*.cu`, each module names the candle operations it replaces).
//! * [`cells`]: the sampled cell audit's numeric check and a bundle end to end, the touched
//!   weights checked against the committed root; [`index_sets`]: the DSA index-set comparison.
//! * [`device`]: where a pass runs (`cpu`, `cuda[:N]`), its profile and trace switches.
//! * [`synth`]: random-valued checkpoints with a release's real shapes, for the benchmarks.
//! * [`config`], [`corpus`]: the devnet checkpoint's `config.json` and training corpus.
use std::path::{Path, PathBuf};

pub mod arch;
pub mod audit;
pub mod cells;
pub mod config;
pub mod corpus;
pub mod device;
mod gen;
pub mod index_sets;
mod model;
mod rng;
pub mod synth;

pub use arch::{Architecture, LoadOptions, Probe, Residency, RoutingShape, TextConfig};
pub use config::Qwen3Config;
pub use device::DeviceSpec;
pub use gen::{
    gen_model, GenArch, GenConfig, GenReport, MoeGen, CHAT_TEMPLATE, ENDOFTEXT, IM_END, IM_START,
};
pub use model::{
    quantize_int4, round_to_bf16, Compute, Decoder, KvCache, Model, Numerics, Precision, Step,
};

/// Errors of checkpoint generation, loading and the forward pass.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    /// A file or directory could not be read or written.
    #[error("{path}: {source}")]
    Io {
        /// The path.
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
    /// `config.json` is missing fields or inconsistent, or a generation setting is invalid.
    #[error("config: {0}")]
    Config(String),
    /// The device named ([`DeviceSpec`]) cannot be opened or used.
    #[error("device {0}")]
    Device(String),
    /// A safetensors shard is malformed.
    #[error("{file}: {msg}")]
    Safetensors {
        /// The shard.
        file: PathBuf,
        /// What is wrong.
        msg: String,
    },
    /// A tensor the config requires is in no shard.
    #[error("tensor {0} is missing from the checkpoint")]
    MissingTensor(String),
    /// A tensor has a shape other than the config implies.
    #[error("tensor {name} has shape {got:?}, expected {want:?}")]
    Shape {
        /// Tensor name.
        name: String,
        /// Shape in the shard.
        got: Vec<usize>,
        /// Shape the config implies.
        want: Vec<usize>,
    },
    /// Tokenizer training, loading or encoding failed.
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    /// A token id is not below `vocab_size`.
    #[error("token id {id} is outside the vocabulary (size {vocab})")]
    TokenOutOfVocab {
        /// The id.
        id: u32,
        /// `vocab_size`.
        vocab: usize,
    },
    /// The sequence would exceed `max_position_embeddings`.
    #[error("sequence of {len} positions exceeds max_position_embeddings {max}")]
    TooLong {
        /// Positions requested.
        len: usize,
        /// The limit.
        max: usize,
    },
    /// No input tokens.
    #[error("empty input: at least one token is required")]
    EmptyInput,
    /// The checkpoint's architecture is recognised but has no implementation in this build.
    #[error("architecture {arch} is not implemented")]
    Unimplemented {
        /// The architecture family (`model_type` spelling).
        arch: String,
    },
    /// A tensor operation failed (a bug or resource exhaustion, not bad input).
    #[error("candle: {0}")]
    Candle(#[from] candle_core::Error),
    /// A recompute produced a hidden state that is NaN or infinite: no served model does, so
    /// the checkpoint's weights are damaged or not the model's (docs/AUDITOR.md "Checkpoint
    /// integrity"); an audit gives no verdict on it.
    #[error(
        "the recompute produced a non-finite hidden state (NaN or infinity) at position \
         {position}: the checkpoint's weights are damaged or not this model's; verify them \
         (docs/AUDITOR.md \"Checkpoint integrity\")"
    )]
    NonFinite {
        /// The first position (0-based, prompt included) whose row holds one.
        position: usize,
    },
}

impl ModelError {
    /// Whether this is the GPU running out of memory (the driver's
    /// `CUDA_ERROR_OUT_OF_MEMORY`, or cuBLAS's `CUBLAS_STATUS_ALLOC_FAILED`, however candle or
    /// cudarc wrapped it): a resource limit the auditor may work around ([`crate::audit`]
    /// drops a resident model's kept weights and recomputes once more), not a fault of the
    /// checkpoint or the commitment.
    pub fn is_out_of_device_memory(&self) -> bool {
        if !matches!(self, ModelError::Candle(_) | ModelError::Device(_)) {
            return false;
        }
        let text = self.to_string();
        text.contains("CUDA_ERROR_OUT_OF_MEMORY") || text.contains("CUBLAS_STATUS_ALLOC_FAILED")
    }
}

/// A checkpoint directory opened for serving or auditing: the model, its tokenizer and its
/// `model_root` (PROTOCOL.md §4).
pub struct Checkpoint {
    /// The directory.
    pub dir: PathBuf,
    /// The model.
    pub model: Model,
    /// `tokenizer.json`.
    pub tokenizer: tokenizers::Tokenizer,
    /// PROTOCOL.md §4 `model_root` of `dir` (independent of the precision it was loaded with:
    /// the int4 cheat claims the honest root).
    pub model_root: String,
}

impl std::fmt::Debug for Checkpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Checkpoint")
            .field("dir", &self.dir)
            .field("model", &self.model)
            .field("model_root", &self.model_root)
            .finish()
    }
}

impl Checkpoint {
    /// Opens `dir` with `precision`.
    ///
    /// # Errors
    /// As [`Model::load`], and [`ModelError::Tokenizer`] when `tokenizer.json` cannot be read.
    pub fn open(dir: &Path, precision: Precision) -> Result<Self, ModelError> {
        Self::open_with(dir, precision, Compute::F32)
    }

    /// [`Checkpoint::open`] with the activations computed in `compute`.
    ///
    /// # Errors
    /// As [`Checkpoint::open`].
    pub fn open_with(
        dir: &Path,
        precision: Precision,
        compute: Compute,
    ) -> Result<Self, ModelError> {
        let model = Model::load_with(dir, precision, compute)?;
        let tokenizer = tokenizers::Tokenizer::from_file(dir.join("tokenizer.json"))
            .map_err(|e| ModelError::Tokenizer(format!("{}: {e}", dir.display())))?;
        let model_root = engy_core::identity::model_root(dir)
            .map_err(|e| ModelError::Config(format!("model_root: {e}")))?;
        Ok(Self {
            dir: dir.to_path_buf(),
            model,
            tokenizer,
            model_root,
        })
    }

    /// Token ids that end a turn: `eos_token_id` (`<|im_end|>`) and `<|endoftext|>`.
    pub fn stop_ids(&self) -> Vec<u32> {
        let mut v = self.model.config().eos_token_ids.clone();
        if let Some(id) = self.tokenizer.token_to_id(ENDOFTEXT) {
            if !v.contains(&id) {
                v.push(id);
            }
        }
        v
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The driver's out-of-memory, as candle and engy's kernels wrap it (the two messages an
    /// H100 printed, 2026-12-06), is out of device memory; other errors, the same words in a
    /// checkpoint's own text included, are not.
    #[test]
    fn out_of_device_memory_is_the_drivers_error_only() {
        let oom = "DriverError(CUDA_ERROR_OUT_OF_MEMORY, \"out of memory\")";
        let candle = |m: String| ModelError::Candle(candle_core::Error::Msg(m));
        assert!(candle(oom.into()).is_out_of_device_memory());
        assert!(candle(format!("device memory: allocating: {oom}")).is_out_of_device_memory());
        assert!(ModelError::Device(format!("cuda:0: {oom}")).is_out_of_device_memory());
        let cublas = "cublas: CUBLAS_STATUS_ALLOC_FAILED";
        assert!(candle(cublas.into()).is_out_of_device_memory());
        assert!(!candle("shape mismatch in matmul".into()).is_out_of_device_memory());
        assert!(!ModelError::Config(oom.into()).is_out_of_device_memory());
        assert!(!ModelError::MissingTensor(oom.into()).is_out_of_device_memory());
    }
}
