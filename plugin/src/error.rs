//! Errors of the plugin's library code.

/// What can go wrong when reading a BerryLM checkpoint.
#[derive(Debug, thiserror::Error)]
pub enum BerryLmError {
    #[error("config.json is not valid BerryLM JSON: {message}")]
    ConfigJson { message: String },
    #[error("config.json field `{field}` {message}")]
    InvalidConfig { field: String, message: String },
    #[error("checkpoint tensor `{name}`: {message}")]
    Weight { name: String, message: String },
    #[error("LoRA adapter for `{module}`: {message}")]
    Lora { module: String, message: String },
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
}

pub type Result<T> = std::result::Result<T, BerryLmError>;

impl From<BerryLmError> for candle_core::Error {
    fn from(error: BerryLmError) -> Self {
        match error {
            BerryLmError::Candle(inner) => inner,
            other => candle_core::Error::Msg(other.to_string()),
        }
    }
}
