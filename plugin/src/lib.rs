//! BerryLM-OS for mistral.rs: the model, its host cache layout, and its
//! registration into the host's architecture registry.
//!
//! Enable it with the host CLI's `berrylm` feature; the CLI calls [`register`]
//! before parsing arguments, and `mistralrs serve -m DIR` then serves any
//! checkpoint whose `config.json` names BerryLM.

pub mod config;
#[cfg(feature = "cuda")]
pub mod decode_graph;
pub mod device;
#[cfg(feature = "cuda")]
pub mod device_memory;
pub mod driver;
pub mod error;
pub mod graph_batches;
pub mod host;
pub mod layers;
pub mod loader;
pub mod model;
pub mod output_parser;
pub mod quantization;
pub mod registry;
pub mod weights;

pub use config::BerryLmConfig;
pub use error::BerryLmError;
pub use registry::{register, Registry};
