//! Command-line arguments, parsed by hand.

use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use candle_core::{DType, Device};
use mistralrs::ModelDType;

pub const USAGE: &str = "\
usage: berrylm-align --model DIR --golden FILE [--dtype f32|bf16|f16] [--device cpu|cuda]
                     [--json OUT] [--dump OUT]

Compares the berrylm plugin with the transformers reference's golden outputs.

  --model DIR     the checkpoint folder (config.json, *.safetensors, tokenizer)
  --golden FILE   the reference's golden.safetensors (seq{i}.input_ids, seq{i}.logits_f32,
                  optionally seq{i}.logits_bf16, gen.prompt_ids, gen.output_ids)
  --dtype D       weights and activations: f32 (default), bf16 or f16
  --device D      cpu (default) or cuda (GPU 0; needs a CUDA build)
  --json OUT      also write the report as JSON
  --dump OUT      also write our logits of every mode and our greedy tokens as safetensors
";

/// The compute type of the run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Precision {
    F32,
    Bf16,
    F16,
}

impl Precision {
    fn parse(value: &str) -> Result<Precision> {
        Ok(match value {
            "f32" => Precision::F32,
            "bf16" => Precision::Bf16,
            "f16" => Precision::F16,
            other => bail!("--dtype must be f32, bf16 or f16, not `{other}`"),
        })
    }

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
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Target {
    Cpu,
    Cuda,
}

impl Target {
    fn parse(value: &str) -> Result<Target> {
        Ok(match value {
            "cpu" => Target::Cpu,
            "cuda" => Target::Cuda,
            other => bail!("--device must be cpu or cuda, not `{other}`"),
        })
    }

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

#[derive(Debug)]
pub struct Args {
    pub model: PathBuf,
    pub golden: PathBuf,
    pub dtype: Precision,
    pub device: Target,
    pub json: Option<PathBuf>,
    pub dump: Option<PathBuf>,
}

impl Args {
    /// Parses the arguments (without the program name); `None` when help was asked for.
    pub fn parse(args: impl IntoIterator<Item = String>) -> Result<Option<Args>> {
        let mut model = None;
        let mut golden = None;
        let mut dtype = Precision::F32;
        let mut device = Target::Cpu;
        let mut json = None;
        let mut dump = None;
        let mut args = args.into_iter();
        while let Some(arg) = args.next() {
            if arg == "-h" || arg == "--help" {
                return Ok(None);
            }
            // Both `--flag value` and `--flag=value`.
            let (flag, inline) = match arg.split_once('=') {
                Some((flag, value)) if flag.starts_with("--") => {
                    (flag.to_string(), Some(value.to_string()))
                }
                _ => (arg.clone(), None),
            };
            let mut value = || -> Result<String> {
                match &inline {
                    Some(value) => Ok(value.clone()),
                    None => args
                        .next()
                        .with_context(|| format!("{flag} needs a value\n{USAGE}")),
                }
            };
            match flag.as_str() {
                "--model" => model = Some(PathBuf::from(value()?)),
                "--golden" => golden = Some(PathBuf::from(value()?)),
                "--dtype" => dtype = Precision::parse(&value()?)?,
                "--device" => device = Target::parse(&value()?)?,
                "--json" => json = Some(PathBuf::from(value()?)),
                "--dump" => dump = Some(PathBuf::from(value()?)),
                other => bail!("unexpected argument `{other}`\n{USAGE}"),
            }
        }
        Ok(Some(Args {
            model: model.with_context(|| format!("--model is required\n{USAGE}"))?,
            golden: golden.with_context(|| format!("--golden is required\n{USAGE}"))?,
            dtype,
            device,
            json,
            dump,
        }))
    }

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

    fn parse(args: &[&str]) -> Result<Option<Args>> {
        Args::parse(args.iter().map(|a| a.to_string()))
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
        .unwrap()
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
        let args = parse(&["--model", "m", "--golden", "g"]).unwrap().unwrap();
        assert_eq!((args.dtype, args.device), (Precision::F32, Target::Cpu));
        assert!(parse(&["--golden", "g"]).is_err());
        assert!(parse(&["--model", "m", "--golden", "g", "--dtype", "f64"]).is_err());
        assert!(parse(&["--model", "m", "--golden", "g", "--bogus"]).is_err());
        assert!(parse(&["--model"]).is_err());
        assert!(parse(&["--help"]).unwrap().is_none());
    }
}
