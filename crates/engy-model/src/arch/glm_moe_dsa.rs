//! GLM-5.x (`glm_moe_dsa`): MLA attention with the DSA indexer, dense first layers, sigmoid
//! routing with `e_score_correction_bias`, shared experts.
//!
//! Implemented by the `glm` branch on top of [`super::Architecture`]; until it lands, loading
//! such a checkpoint is a typed [`ModelError::Unimplemented`] error.
use std::sync::Arc;

use super::{ArchKind, Architecture, LoadOptions, TextConfig, Weights};
use crate::ModelError;

/// Loads a `glm_moe_dsa` checkpoint.
///
/// # Errors
/// [`ModelError::Unimplemented`] (not yet implemented).
pub fn load(
    _cfg: TextConfig,
    _weights: Arc<Weights>,
    _opts: &LoadOptions,
) -> Result<Box<dyn Architecture>, ModelError> {
    Err(ModelError::Unimplemented {
        arch: ArchKind::GlmMoeDsa.name().to_string(),
    })
}
