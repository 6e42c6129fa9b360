//! The project's commands (`cargo xtask ...`): preparing the patched host,
//! building it with the plugin, testing, serving and installing.

pub mod host;
pub mod parse;
pub mod seam;
pub mod series;
pub mod standalone;

use std::ffi::OsString;
use std::path::PathBuf;

/// The cargo that runs us (or the one on PATH).
pub fn cargo() -> OsString {
    std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into())
}

/// The shared target folder: outside the clone so it survives fresh checkouts.
/// CUDA builds get their own (`-cuda`), so the CPU binaries the tests use and
/// the CUDA binaries for the GPU machine never overwrite each other.
pub fn target_dir(cuda: bool) -> PathBuf {
    let base = match std::env::var_os("CARGO_TARGET_DIR") {
        Some(dir) => PathBuf::from(dir),
        None => {
            let home = std::env::var_os("HOME").map_or_else(|| PathBuf::from("."), PathBuf::from);
            home.join(".cache/berrylm/target")
        }
    };
    if cuda {
        let mut name = base.file_name().unwrap_or_default().to_os_string();
        name.push("-cuda");
        base.with_file_name(name)
    } else {
        base
    }
}
