//! Extension points for model crates that live outside mistral.rs.
//!
//! Two things are offered here:
//! * re-exports of everything a text model needs to implement the loader and
//!   model traits (caches, attention, layers, loading metadata), so an external
//!   crate can build a model the same way the built-in ones are built;
//! * a registry of architectures: a crate registers a loader factory under
//!   `model_type` and `architectures` names, and the automatic loaders
//!   (`AutoLoader::detect`, `AutoNormalLoader`) consult it before their own
//!   closed list, so `mistralrs serve -m DIR` picks the external model.
//!
//! The API mirrors the internal traits and is as stable as they are.

use std::sync::{Arc, RwLock};

use serde::Deserialize;

pub use crate::amoe::AnyMoeBaseModelMixin;
pub use crate::attention::{SdpaParams, ATTENTION_CHUNK_SIZE};
pub use crate::device_map::{DeviceMappedMask, DeviceMapper};
pub use crate::kv_cache::{
    HybridCache, HybridCacheConfig, HybridLayerCache, HybridLayerType, RecurrentLayerConfig,
    RecurrentStatePool, RecurrentStateSnapshot,
};
pub use crate::layers_masker::PastKvLenCache;
pub use crate::lora::LoraConfig;
pub use crate::moe::{MoEExperts, MoEExpertsConfig};
pub use crate::paged_attention::{
    AttentionImplementation, KvCacheLayout, ModelConfigLike, ModelConfigMetadata, PagedAttention,
};
pub use crate::pipeline::text_models_inputs_processor::{FlashParams, PagedAttentionInputMetadata};
pub use crate::pipeline::{
    extract_logits, AutoDeviceMapParams, DeviceMappedModelLoader, EitherCache, IsqModel,
    IsqModelLoader, KvCache, NormalCache, NormalLoadingMetadata, NormalModel, NormalModelLoader,
};
pub use crate::utils::progress::NiceProgressBar;
pub use crate::utils::unvarbuilder::{ToTensors, UnVarBuilder};
pub use crate::utils::varbuilder_utils::DeviceForLoadTensor;
pub use crate::xlora_models::{NonGranularState, XLoraConfig};

/// Builds a fresh loader for a registered architecture.
pub type NormalLoaderFactory = Arc<dyn Fn() -> Box<dyn NormalModelLoader> + Send + Sync>;

struct RegisteredArchitecture {
    architectures: Vec<String>,
    model_types: Vec<String>,
    factory: NormalLoaderFactory,
}

static ARCHITECTURES: RwLock<Vec<RegisteredArchitecture>> = RwLock::new(Vec::new());

/// The fields of `config.json` that identify a model.
#[derive(Deserialize)]
struct ConfigIdentity {
    #[serde(default)]
    architectures: Option<Vec<String>>,
    #[serde(default)]
    model_type: Option<String>,
}

/// Register a text model. A `config.json` whose `model_type` is one of
/// `model_types`, or whose `architectures` contains one of `architectures`,
/// is loaded with a loader from `factory`. Registered models take precedence
/// over the built-in ones; registering a name again replaces the earlier entry.
pub fn register_normal_architecture(
    architectures: &[&str],
    model_types: &[&str],
    factory: NormalLoaderFactory,
) {
    let mut registry = ARCHITECTURES
        .write()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    registry.retain(|entry| {
        !entry
            .architectures
            .iter()
            .any(|name| architectures.contains(&name.as_str()))
            && !entry
                .model_types
                .iter()
                .any(|name| model_types.contains(&name.as_str()))
    });
    registry.push(RegisteredArchitecture {
        architectures: architectures.iter().map(|s| s.to_string()).collect(),
        model_types: model_types.iter().map(|s| s.to_string()).collect(),
        factory,
    });
}

/// The loader registered for this `config.json`, if any.
pub fn lookup_normal_loader(config_json: &str) -> Option<Box<dyn NormalModelLoader>> {
    let identity: ConfigIdentity = serde_json::from_str(config_json).ok()?;
    let registry = ARCHITECTURES
        .read()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    registry
        .iter()
        .find(|entry| {
            let by_type = identity
                .model_type
                .as_ref()
                .is_some_and(|model_type| entry.model_types.contains(model_type));
            let by_architecture = identity
                .architectures
                .iter()
                .flatten()
                .any(|name| entry.architectures.contains(name));
            by_type || by_architecture
        })
        .map(|entry| (entry.factory)())
}

/// Builds a chat output parser for one request.
pub type ChatOutputParserFactory =
    Arc<dyn Fn(&ChatOutputRequest<'_>) -> Box<dyn ChatOutputParser> + Send + Sync>;

static CHAT_OUTPUT_PARSERS: RwLock<Vec<(String, ChatOutputParserFactory)>> =
    RwLock::new(Vec::new());

/// Register a chat output parser under `name` (registering a name again
/// replaces the earlier parser). Models ask for it by name through
/// [`chat_output_parser_named`].
pub fn register_chat_output_parser(name: &str, factory: ChatOutputParserFactory) {
    let mut parsers = CHAT_OUTPUT_PARSERS
        .write()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    parsers.retain(|(registered, _)| registered != name);
    parsers.push((name.to_string(), factory));
}

/// A parser for `request` from the chat output parser registered as `name`.
pub fn chat_output_parser_named(
    name: &str,
    request: &ChatOutputRequest<'_>,
) -> Option<Box<dyn ChatOutputParser>> {
    let parsers = CHAT_OUTPUT_PARSERS
        .read()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    parsers
        .iter()
        .find(|(registered, _)| registered == name)
        .map(|(_, factory)| factory(request))
}

/// The names of the registered chat output parsers, in registration order.
pub fn registered_chat_output_parsers() -> Vec<String> {
    CHAT_OUTPUT_PARSERS
        .read()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
        .iter()
        .map(|(name, _)| name.clone())
        .collect()
}

/// The chat output parser chosen for every model the process serves.
static SELECTED_CHAT_OUTPUT_PARSER: RwLock<Option<String>> = RwLock::new(None);

/// A chat output parser name that no registered parser answers to.
#[derive(Debug, thiserror::Error)]
#[error(
    "no chat output parser is registered as `{name}`; the registered ones: {}",
    name_list(.registered)
)]
pub struct UnknownChatOutputParser {
    pub name: String,
    pub registered: Vec<String>,
}

fn name_list(names: &[String]) -> String {
    if names.is_empty() {
        "none".to_string()
    } else {
        names.join(", ")
    }
}

/// Use the parser registered as `name` for the chat requests of every model,
/// in place of the model's own parser and of the host's format detection.
pub fn select_chat_output_parser(name: &str) -> Result<(), UnknownChatOutputParser> {
    let registered = registered_chat_output_parsers();
    if !registered.iter().any(|registered| registered == name) {
        return Err(UnknownChatOutputParser {
            name: name.to_string(),
            registered,
        });
    }
    *SELECTED_CHAT_OUTPUT_PARSER
        .write()
        .unwrap_or_else(|poisoned| poisoned.into_inner()) = Some(name.to_string());
    Ok(())
}

/// A parser for `request` from the parser chosen with
/// [`select_chat_output_parser`], if one was chosen.
pub fn selected_chat_output_parser(
    request: &ChatOutputRequest<'_>,
) -> Option<Box<dyn ChatOutputParser>> {
    let selected = SELECTED_CHAT_OUTPUT_PARSER
        .read()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
        .clone()?;
    chat_output_parser_named(&selected, request)
}

/// What a model's chat output parser learns about the request it serves.
pub struct ChatOutputRequest<'a> {
    /// The rendered prompt (e.g. whether it opened a reasoning block).
    pub prompt: &'a str,
    /// The request's tool definitions, with their JSON schemas.
    pub tools: &'a [crate::Tool],
    /// The request's `tool_choice` (`auto` when it gave none).
    pub tool_choice: &'a crate::ToolChoice,
}

/// Parts of an assistant message that a chat output parser recognised.
#[derive(Debug, Clone, Default)]
pub struct ParsedOutput {
    pub content: Option<String>,
    pub reasoning_content: Option<String>,
    /// Streaming: argument deltas (a call's `id` and `function.name` are set on
    /// its first delta and empty after). Complete: one entry per call.
    pub tool_calls: Vec<crate::ToolCallResponse>,
}

/// A model's own parser of its generated text into content, reasoning and
/// tool calls. When a model provides one for a request, it replaces the
/// host's format-sniffing reasoning and tool parsers for that sequence.
pub trait ChatOutputParser: Send + Sync {
    /// Streaming: consumes newly generated text, returns what became final.
    fn push(&mut self, text: &str) -> ParsedOutput;
    /// Streaming: generation ended; returns whatever was held back.
    fn finish(&mut self) -> ParsedOutput;
    /// Non-streaming: the whole generated text as one message.
    fn parse_complete(&mut self, text: &str) -> ParsedOutput;
    /// Whether any tool call was recognised so far.
    fn has_tool_calls(&self) -> bool;
    /// The grammar the request's `tool_choice` needs in this model's format
    /// (`required` or a named function: a tool call forced; `none`: none
    /// started). It constrains the output as a request's own grammar does.
    fn tool_choice_constraint(&self) -> Option<crate::Constraint> {
        None
    }
    /// When the output starts inside a reasoning block: the special token
    /// that ends it. Grammars then constrain only what follows that token.
    fn reasoning_end_token(&self) -> Option<&str> {
        None
    }
}
