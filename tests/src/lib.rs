//! Shared support for the berrylm tests: the vendored golden fixtures (outputs
//! of the transformers reference) and a driver that runs the model through
//! the host's hybrid cache.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result};
use berrylm::model::BerryLm;
use candle_core::{DType, Device, Tensor};

pub use berrylm::driver::{load_checkpoint, Driver};

pub mod chat;
pub mod metrics;
pub mod server;

/// Every fixture vendored from the golden set.
pub const FIXTURES: [&str; 8] = [
    "tiny-hf",
    "small-hybrid",
    "small-hybrid-alt-layout",
    "small-hybrid-bf16",
    "variant-a",
    "variant-b",
    "no-attnres",
    "trained-tiny",
];

/// The transformers reference's own bf16 noise: the mean |Δ log-probability|
/// of its chosen tokens between its bf16 and f32 runs over the golden
/// fixtures (docs/alignment.md). Two bf16 paths of ours that sum in
/// different orders may differ by about this much.
pub const REFERENCE_BF16_MEAN_ABS_LOGPROB: f64 = 7.39e-2;

pub fn fixtures_dir() -> PathBuf {
    match std::env::var_os("BERRYLM_FIXTURES") {
        Some(dir) => PathBuf::from(dir),
        None => Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures"),
    }
}

/// One golden fixture: a checkpoint and the reference's outputs on it.
pub struct Fixture {
    pub name: String,
    pub model_dir: PathBuf,
    pub golden: HashMap<String, Tensor>,
    pub facts: serde_json::Value,
}

impl Fixture {
    pub fn load(name: &str) -> Result<Fixture> {
        let dir = fixtures_dir().join(name);
        let golden = candle_core::safetensors::load(dir.join("golden.safetensors"), &Device::Cpu)
            .with_context(|| format!("{name}: golden.safetensors"))?;
        let facts = serde_json::from_str(&std::fs::read_to_string(dir.join("golden.json"))?)?;
        Ok(Fixture {
            name: name.to_string(),
            model_dir: dir.join("model"),
            golden,
            facts,
        })
    }

    pub fn tensor(&self, key: &str) -> Result<&Tensor> {
        self.golden
            .get(key)
            .with_context(|| format!("{}: golden tensor {key} is missing", self.name))
    }

    pub fn ids(&self, key: &str) -> Result<Vec<u32>> {
        Ok(self
            .tensor(key)?
            .to_dtype(DType::I64)?
            .to_vec1::<i64>()?
            .into_iter()
            .map(|id| id as u32)
            .collect())
    }

    /// Number of `seq{i}` entries.
    pub fn num_sequences(&self) -> usize {
        (0..)
            .take_while(|i| self.golden.contains_key(&format!("seq{i}.input_ids")))
            .count()
    }

    /// The checkpoint's context length (`max_position_embeddings` of its
    /// `config.json`).
    pub fn context_length(&self) -> Result<usize> {
        let config: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(
            self.model_dir.join("config.json"),
        )?)?;
        let length = config["max_position_embeddings"]
            .as_u64()
            .with_context(|| format!("{}: no max_position_embeddings", self.name))?;
        Ok(usize::try_from(length)?)
    }

    pub fn model(&self, dtype: DType) -> Result<BerryLm> {
        load_checkpoint(&self.model_dir, dtype, &Device::Cpu)
    }

    /// The reference's greedy completion of golden sequence `index` (a chat
    /// fixture's `greedy_completion_text`) without the end-of-turn token it
    /// ends with.
    pub fn reference_completion(&self, index: usize) -> Result<&str> {
        let text = self.facts["sequences"][index]["greedy_completion_text"]
            .as_str()
            .with_context(|| {
                format!("{}: sequence {index}: no greedy_completion_text", self.name)
            })?;
        text.strip_suffix("<|im_end|>").with_context(|| {
            format!(
                "{}: sequence {index}: the reference's greedy completion does not end the turn",
                self.name
            )
        })
    }

    /// The reference's greedy answer to golden sequence `index`
    /// ([`Fixture::reference_completion`]): its reasoning and what follows
    /// `</think>`, both trimmed.
    pub fn reference_answer(&self, index: usize) -> Result<(String, String)> {
        let (reasoning, rest) = self
            .reference_completion(index)?
            .split_once("</think>")
            .with_context(|| format!("{}: sequence {index}: no </think>", self.name))?;
        Ok((reasoning.trim().to_string(), rest.trim().to_string()))
    }
}

/// The bundled trained model (`trained-tiny`) in bf16 on the first CUDA
/// device, as the GPU tests of the plugin's forward load it.
pub fn bundled_model_on_cuda() -> Result<BerryLm> {
    let device = berrylm::device::open_cuda(0)?;
    load_checkpoint(
        &fixtures_dir().join("trained-tiny").join("model"),
        DType::BF16,
        &device,
    )
}

/// Largest absolute element-wise difference.
pub fn max_abs_diff(a: &Tensor, b: &Tensor) -> Result<f32> {
    let a = a.to_dtype(DType::F32)?;
    let b = b.to_dtype(DType::F32)?;
    anyhow::ensure!(
        a.dims() == b.dims(),
        "shapes differ: {:?} vs {:?}",
        a.dims(),
        b.dims()
    );
    Ok((a - b)?.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()?)
}

/// A tensor's values as the bits of their f32 values, for an exact
/// comparison.
pub fn f32_bits(tensor: &Tensor) -> Result<Vec<u32>> {
    Ok(tensor
        .to_dtype(DType::F32)?
        .flatten_all()?
        .to_vec1::<f32>()?
        .into_iter()
        .map(f32::to_bits)
        .collect())
}

/// Largest absolute element.
pub fn max_abs(a: &Tensor) -> Result<f32> {
    Ok(a.to_dtype(DType::F32)?
        .abs()?
        .flatten_all()?
        .max(0)?
        .to_scalar::<f32>()?)
}

/// The number at `key` of the JSON object `object`.
pub fn number(object: &serde_json::Value, key: &str) -> Result<f64> {
    object[key]
        .as_f64()
        .with_context(|| format!("`{key}` is not a number in {object}"))
}

/// The unsigned integer at `key` of the JSON object `object`.
pub fn count(object: &serde_json::Value, key: &str) -> Result<u64> {
    object[key]
        .as_u64()
        .with_context(|| format!("`{key}` is not an unsigned integer in {object}"))
}

/// Runs `command` to its end, asserts that it exits successfully and
/// returns its standard output.
pub fn run_successfully(command: &mut Command) -> Result<String> {
    let program = command.get_program().to_string_lossy().into_owned();
    let output = command
        .output()
        .with_context(|| format!("running {program}"))?;
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    assert!(
        output.status.success(),
        "{program} failed ({}):\n{stdout}\n{}",
        output.status,
        String::from_utf8_lossy(&output.stderr)
    );
    Ok(stdout)
}

/// A binary of the workspace, built beside the tests by `cargo xtask test`
/// (the tests run from the same profile folder).
pub fn workspace_binary(name: &str) -> Result<PathBuf> {
    let exe = std::env::current_exe()?;
    let profile_dir = exe
        .parent()
        .and_then(Path::parent)
        .context("test binary has no profile folder")?;
    let candidate = profile_dir.join(name);
    anyhow::ensure!(
        candidate.is_file(),
        "{name} is not built at {}: run `cargo xtask test`",
        candidate.display()
    );
    Ok(candidate)
}

/// The host CLI (`BERRYLM_HOST_BIN`, set by `cargo xtask test`, or the one
/// built beside the tests).
pub fn host_binary() -> Result<PathBuf> {
    match std::env::var_os("BERRYLM_HOST_BIN") {
        Some(path) => Ok(PathBuf::from(path)),
        None => workspace_binary("mistralrs"),
    }
}

/// The alignment tool built beside the tests.
pub fn align_binary() -> Result<PathBuf> {
    workspace_binary("berrylm-align")
}

/// The checkpoint's tensors the model reads: name and element count.
pub fn checkpoint_tensors(model_dir: &Path) -> Result<Vec<(String, usize)>> {
    let files: Vec<PathBuf> = std::fs::read_dir(model_dir)?
        .filter_map(|entry| entry.ok().map(|entry| entry.path()))
        .filter(|path| path.extension().is_some_and(|ext| ext == "safetensors"))
        .collect();
    // SAFETY: the fixture files are not modified while they are mapped.
    let tensors = unsafe { candle_core::safetensors::MmapedSafetensors::multi(&files)? };
    Ok(tensors
        .tensors()
        .into_iter()
        .filter(|(name, _)| !name.starts_with("mtp."))
        .map(|(name, view)| (name, view.shape().iter().product()))
        .collect())
}

/// A folder in the system's temporary folder, named `{name}-{pid}` (emptied
/// first), removed when dropped.
pub struct TempDir(pub PathBuf);

impl TempDir {
    pub fn new(name: &str) -> Result<TempDir> {
        let path = std::env::temp_dir().join(format!("{name}-{}", std::process::id()));
        if path.exists() {
            std::fs::remove_dir_all(&path)?;
        }
        std::fs::create_dir_all(&path)?;
        Ok(TempDir(path))
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// `text` without ANSI escape sequences (`ESC [ ... letter`).
pub fn without_ansi_escapes(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut chars = text.chars();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            for next in chars.by_ref() {
                if next.is_ascii_alphabetic() {
                    break;
                }
            }
        } else {
            out.push(c);
        }
    }
    out
}
