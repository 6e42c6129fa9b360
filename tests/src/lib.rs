//! Shared support for the berrylm tests: the vendored golden fixtures (outputs
//! of the transformers reference) and a driver that runs the model through
//! the host's hybrid cache.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use berrylm::model::BerryLm;
use candle_core::{DType, Device, Tensor};

pub use berrylm::driver::{load_checkpoint, Driver};

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

pub fn fixtures_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures")
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

    pub fn model(&self, dtype: DType) -> Result<BerryLm> {
        load_checkpoint(&self.model_dir, dtype, &Device::Cpu)
    }
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

/// Largest absolute element.
pub fn max_abs(a: &Tensor) -> Result<f32> {
    Ok(a.to_dtype(DType::F32)?
        .abs()?
        .flatten_all()?
        .max(0)?
        .to_scalar::<f32>()?)
}

/// The path of the host CLI binary built beside the tests (`cargo xtask test`
/// builds it and sets `BERRYLM_HOST_BIN`).
pub fn host_binary() -> Result<PathBuf> {
    if let Some(path) = std::env::var_os("BERRYLM_HOST_BIN") {
        return Ok(PathBuf::from(path));
    }
    let exe = std::env::current_exe()?;
    let profile_dir = exe
        .parent()
        .and_then(Path::parent)
        .context("test binary has no profile folder")?;
    let candidate = profile_dir.join("mistralrs");
    anyhow::ensure!(
        candidate.is_file(),
        "the host CLI is not built at {}: run `cargo xtask test`",
        candidate.display()
    );
    Ok(candidate)
}

/// The path of the `berrylm-align` binary built beside the tests (next to the
/// host CLI; `BERRYLM_ALIGN_BIN` overrides it).
pub fn align_binary() -> Result<PathBuf> {
    if let Some(path) = std::env::var_os("BERRYLM_ALIGN_BIN") {
        return Ok(PathBuf::from(path));
    }
    let exe = std::env::current_exe()?;
    let profile_dir = exe
        .parent()
        .and_then(Path::parent)
        .context("test binary has no profile folder")?;
    let candidate = profile_dir.join("berrylm-align");
    anyhow::ensure!(
        candidate.is_file(),
        "berrylm-align is not built at {}: run `cargo xtask build`",
        candidate.display()
    );
    Ok(candidate)
}
