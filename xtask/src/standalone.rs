//! Stripped standalone executables of a build, for a machine without cargo
//! (the GPU machine): the tools and the test executables that need a GPU.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, Context, Result};

/// Binaries of the workspace, by name.
pub const TOOLS: [&str; 3] = ["mistralrs", "berrylm-align", "berrylm-bench"];

/// Test targets whose executables run on the GPU machine: the kernels
/// against their CPU reference, and the serving tests (paged attention is
/// only on in CUDA builds; device errors are injected there; quantized
/// experts run in the host's indexed kernels there; device maps are refused
/// only where there is a GPU to map to; LoRA merges, unloading and reloading
/// go through the CUDA model's own buffers and decode graphs; sampled
/// batches copy their logits from the device), decode graphs against the
/// eager forward, and prompts after a prefix-cache hit against the
/// contiguous cache.
pub const TESTS: [&str; 13] = [
    "cuda",
    "server_invariance",
    "server_paged",
    "server_chat_template",
    "server_e2e",
    "server_model_errors",
    "server_isq",
    "server_options",
    "server_lora",
    "server_lifecycle",
    "server_sampling",
    "decode_graphs",
    "paged_prefix",
];

/// The newest executable `deps/{name}-{16 hex digits}` of a target folder.
fn newest_test_executable(release: &Path, name: &str) -> Result<PathBuf> {
    let deps = release.join("deps");
    let mut newest: Option<(std::time::SystemTime, PathBuf)> = None;
    for entry in std::fs::read_dir(&deps).with_context(|| format!("reading {}", deps.display()))? {
        let entry = entry?;
        let file_name = entry.file_name().to_string_lossy().into_owned();
        let Some(hash) = file_name
            .strip_prefix(name)
            .and_then(|rest| rest.strip_prefix('-'))
        else {
            continue;
        };
        if hash.len() != 16 || !hash.chars().all(|c| c.is_ascii_hexdigit()) {
            continue;
        }
        let metadata = entry.metadata()?;
        let executable =
            std::os::unix::fs::PermissionsExt::mode(&metadata.permissions()) & 0o111 != 0;
        if !metadata.is_file() || !executable {
            continue;
        }
        let modified = metadata.modified()?;
        if newest.as_ref().is_none_or(|(time, _)| modified > *time) {
            newest = Some((modified, entry.path()));
        }
    }
    newest
        .map(|(_, path)| path)
        .with_context(|| format!("no test executable `{name}` in {}", deps.display()))
}

/// Writes stripped copies of [`TOOLS`] and [`TESTS`] from `release` into
/// `out` (replacing what was there) and returns each file with its size.
pub fn write(release: &Path, out: &Path) -> Result<Vec<(PathBuf, u64)>> {
    if out.exists() {
        std::fs::remove_dir_all(out).with_context(|| format!("clearing {}", out.display()))?;
    }
    std::fs::create_dir_all(out)?;
    let mut sources: Vec<(String, PathBuf)> = TOOLS
        .iter()
        .map(|name| (name.to_string(), release.join(name)))
        .collect();
    for name in TESTS {
        sources.push((
            format!("test-{name}"),
            newest_test_executable(release, name)?,
        ));
    }
    let mut written = Vec::new();
    for (name, source) in sources {
        let destination = out.join(&name);
        let status = Command::new("strip")
            .arg("--strip-all")
            .arg("-o")
            .arg(&destination)
            .arg(&source)
            .status()
            .context("running `strip` (binutils)")?;
        if !status.success() {
            bail!("strip {} failed ({status})", source.display());
        }
        let size = std::fs::metadata(&destination)?.len();
        written.push((destination, size));
    }
    Ok(written)
}
