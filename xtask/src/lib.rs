//! The project's commands (`cargo xtask ...`): preparing the patched host,
//! building it with the plugin, testing, serving and installing.

pub mod host;
pub mod parse;
pub mod seam;

use std::ffi::OsString;
use std::path::PathBuf;

/// The cargo that runs us (or the one on PATH).
pub fn cargo() -> OsString {
    std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into())
}

/// The shared target folder: outside the clone so it survives fresh checkouts.
pub fn target_dir() -> PathBuf {
    if let Some(dir) = std::env::var_os("CARGO_TARGET_DIR") {
        return PathBuf::from(dir);
    }
    let home = std::env::var_os("HOME").map_or_else(|| PathBuf::from("."), PathBuf::from);
    home.join(".cache/berrylm/target")
}
