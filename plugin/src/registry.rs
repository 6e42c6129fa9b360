//! What the plugin registers in the host, read from the repository's
//! `registry.toml` (the single source of truth for those names).

use std::sync::Arc;

use serde::Deserialize;

use crate::loader::BerryLmLoader;

const REGISTRY_TOML: &str = include_str!("../../registry.toml");

#[derive(Debug, Clone, Deserialize)]
pub struct Registry {
    pub host: HostTarget,
    pub model: ModelNames,
    pub parsers: ParserNames,
}

#[derive(Debug, Clone, Deserialize)]
pub struct HostTarget {
    pub crates: Vec<String>,
    pub version: String,
}

#[derive(Debug, Clone, Deserialize)]
pub struct ModelNames {
    pub model_types: Vec<String>,
    pub architectures: Vec<String>,
}

#[derive(Debug, Clone, Deserialize)]
pub struct ParserNames {
    pub reasoning: String,
    pub tool_call: String,
}

impl Registry {
    /// The registry compiled into this build.
    pub fn bundled() -> Result<Registry, toml::de::Error> {
        toml::from_str(REGISTRY_TOML)
    }
}

/// Registers BerryLM with the host: its loader under every model type and
/// architecture name of `registry.toml`.
pub fn register() -> anyhow::Result<()> {
    let registry = Registry::bundled()
        .map_err(|e| anyhow::anyhow!("berrylm registry.toml is invalid: {e}"))?;
    let architectures: Vec<&str> = registry
        .model
        .architectures
        .iter()
        .map(String::as_str)
        .collect();
    let model_types: Vec<&str> = registry
        .model
        .model_types
        .iter()
        .map(String::as_str)
        .collect();
    mistralrs_core::plugin_api::register_normal_architecture(
        &architectures,
        &model_types,
        Arc::new(|| Box::new(BerryLmLoader)),
    );
    tracing::debug!(
        "berrylm registered for model types {:?} and architectures {:?}",
        model_types,
        architectures
    );
    Ok(())
}
