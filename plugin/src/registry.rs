//! What the plugin registers in the host, read from the repository's
//! `registry.toml` (the single source of truth for those names).

use std::sync::Arc;

use mistralrs_core::plugin_api;
use serde::Deserialize;

use crate::loader::BerryLmLoader;
use crate::output_parser::BerryLmOutputParser;

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

fn as_strs(names: &[String]) -> Vec<&str> {
    names.iter().map(String::as_str).collect()
}

/// Registers BerryLM with the host: its loader under every model type and
/// architecture name of `registry.toml`, and its chat output parser (reasoning
/// and tool calls) under the parser names there.
pub fn register() -> anyhow::Result<()> {
    let registry = Registry::bundled()
        .map_err(|e| anyhow::anyhow!("berrylm registry.toml is invalid: {e}"))?;
    let architectures = as_strs(&registry.model.architectures);
    let model_types = as_strs(&registry.model.model_types);
    for name in [&registry.parsers.reasoning, &registry.parsers.tool_call] {
        plugin_api::register_chat_output_parser(
            name,
            Arc::new(|request| Box::new(BerryLmOutputParser::for_request(request))),
        );
    }
    let output_parser = registry.parsers.tool_call.clone();
    plugin_api::register_normal_architecture(
        &architectures,
        &model_types,
        Arc::new(move || {
            Box::new(BerryLmLoader {
                output_parser: output_parser.clone(),
            })
        }),
    );
    tracing::debug!(
        "berrylm registered for model types {:?} and architectures {:?}, parsers {:?}",
        model_types,
        architectures,
        registry.parsers
    );
    Ok(())
}
