//! Command-line arguments (clap).

use std::path::PathBuf;

use anyhow::{Context, Result};
use candle_core::{DType, Device};
use clap::{Parser, ValueEnum};
use mistralrs::{IsqType, ModelDType};

/// Compares the berrylm plugin with the transformers reference's golden outputs.
#[derive(Debug, Parser)]
#[command(name = "berrylm-align", version)]
pub struct Args {
    /// The checkpoint folder (config.json, *.safetensors, tokenizer).
    #[arg(long, value_name = "DIR")]
    pub model: PathBuf,
    /// The reference's golden.safetensors (seq{i}.input_ids, seq{i}.logits_f32,
    /// optionally seq{i}.logits_bf16, gen.prompt_ids, gen.output_ids).
    #[arg(long, value_name = "FILE")]
    pub golden: PathBuf,
    /// Weights and activations.
    #[arg(long, value_enum, default_value_t = Precision::F32)]
    pub dtype: Precision,
    /// Where the model runs (cuda: GPU 0; needs a CUDA build).
    #[arg(long, value_enum, default_value_t = Target::Cpu)]
    pub device: Target,
    /// Also write the report as JSON.
    #[arg(long, value_name = "OUT")]
    pub json: Option<PathBuf>,
    /// Also write our logits of every mode and our greedy tokens as safetensors.
    #[arg(long, value_name = "OUT")]
    pub dump: Option<PathBuf>,
    /// Quantize the model while loading, as `mistralrs serve --isq TYPE`
    /// does (`q4k`, `q8_0`, ...; the host's types and aliases), and compare
    /// the quantized model.
    #[arg(long, value_name = "TYPE", value_parser = parse_isq)]
    pub isq: Option<IsqType>,
    /// Also write a golden file in the reference's layout from this run:
    /// the golden's ids, our prefill logits as `logits_f32` and the Driver's
    /// greedy tokens (e.g. the unquantized model's, for `--isq` runs to be
    /// compared with).
    #[arg(long, value_name = "OUT")]
    pub write_golden: Option<PathBuf>,
    /// Only the teacher-forced modes: not the free-running greedy run through
    /// the host engine (which loads the model a second time).
    #[arg(long)]
    pub teacher_forced_only: bool,
    /// With a corpus-protocol file (`prompt{i}.ids`, from
    /// `tools/reference_dump.py --corpus`): compare only its first K windows.
    #[arg(long, value_name = "K", value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..))]
    pub prompts: Option<usize>,
}

fn parse_isq(value: &str) -> Result<IsqType, String> {
    mistralrs_core::parse_isq_value(value, None)
}

/// The compute type of the run.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Precision {
    F32,
    Bf16,
    F16,
}

impl Precision {
    pub fn name(self) -> &'static str {
        match self {
            Precision::F32 => "f32",
            Precision::Bf16 => "bf16",
            Precision::F16 => "f16",
        }
    }

    pub fn candle(self) -> DType {
        match self {
            Precision::F32 => DType::F32,
            Precision::Bf16 => DType::BF16,
            Precision::F16 => DType::F16,
        }
    }

    pub fn engine(self) -> ModelDType {
        match self {
            Precision::F32 => ModelDType::F32,
            Precision::Bf16 => ModelDType::BF16,
            Precision::F16 => ModelDType::F16,
        }
    }
}

/// Where the model runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Target {
    Cpu,
    Cuda,
}

impl Target {
    pub fn name(self) -> &'static str {
        match self {
            Target::Cpu => "cpu",
            Target::Cuda => "cuda",
        }
    }

    pub fn open(self) -> Result<Device> {
        match self {
            Target::Cpu => Ok(Device::Cpu),
            Target::Cuda => berrylm::device::open_cuda(0).context(
                "--device cuda: cannot open CUDA device 0 (is this a CUDA build? \
                 `cargo xtask align --device cuda ...` builds one)",
            ),
        }
    }
}

impl Args {
    /// A short name for the model: its folder, or the folder above when that
    /// is called `model` (the golden fixtures' layout `NAME/model`).
    pub fn model_name(&self) -> String {
        let dir = std::fs::canonicalize(&self.model).unwrap_or_else(|_| self.model.clone());
        let name =
            |path: &std::path::Path| path.file_name().map(|n| n.to_string_lossy().into_owned());
        match name(&dir) {
            Some(last) if last == "model" => dir.parent().and_then(name).unwrap_or(last),
            Some(last) => last,
            None => dir.display().to_string(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(args: &[&str]) -> Result<Args, clap::Error> {
        Args::try_parse_from(std::iter::once("berrylm-align").chain(args.iter().copied()))
    }

    #[test]
    fn parses_every_flag_in_both_forms() {
        let args = parse(&[
            "--model",
            "m",
            "--golden=g.safetensors",
            "--dtype",
            "bf16",
            "--device=cpu",
            "--json",
            "r.json",
            "--dump",
            "d.safetensors",
        ])
        .unwrap();
        assert_eq!(args.model, PathBuf::from("m"));
        assert_eq!(args.golden, PathBuf::from("g.safetensors"));
        assert_eq!(args.dtype, Precision::Bf16);
        assert_eq!(args.device, Target::Cpu);
        assert_eq!(args.json, Some(PathBuf::from("r.json")));
        assert_eq!(args.dump, Some(PathBuf::from("d.safetensors")));
    }

    #[test]
    fn defaults_and_errors() {
        let args = parse(&["--model", "m", "--golden", "g"]).unwrap();
        assert_eq!((args.dtype, args.device), (Precision::F32, Target::Cpu));
        let kind = |args: &[&str]| parse(args).unwrap_err().kind();
        use clap::error::ErrorKind;
        assert_eq!(kind(&["--golden", "g"]), ErrorKind::MissingRequiredArgument);
        assert_eq!(
            kind(&["--model", "m", "--golden", "g", "--dtype", "f64"]),
            ErrorKind::InvalidValue
        );
        assert_eq!(
            kind(&["--model", "m", "--golden", "g", "--bogus"]),
            ErrorKind::UnknownArgument
        );
        assert_eq!(kind(&["--model"]), ErrorKind::InvalidValue);
        assert_eq!(kind(&["--help"]), ErrorKind::DisplayHelp);
    }
}
