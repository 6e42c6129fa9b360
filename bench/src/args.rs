//! Command-line arguments, parsed by hand.

use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use candle_core::{DType, Device};

pub const USAGE: &str = "\
usage: berrylm-bench [--device cpu|cuda] [--dtype bf16|f32] [--layers N] [--tiny]
                     [--prefill LIST] [--decode LIST] [--json OUT] [options]

Builds a BerryLM-OS-shaped model with random weights on the device (nothing is
read from disk, nothing written but --json and --save-checkpoint) and measures
prefill and decode throughput of the berrylm plugin, the time of one KDA layer's
kernels, the device's copy bandwidth and the weight-read floor of a decode step.

  --device D           cpu or cuda (GPU 0); default cuda in a CUDA build, else cpu
  --dtype D            weights and activations: bf16 or f32; default bf16 on cuda, f32
                       on cpu (candle's CPU matmul has no bf16)
  --layers N           decoder layers, [KDA, KDA, KDA, attention] repeated (default 8)
  --tiny               a scaled-down shape (hidden 256, 8 experts top-2, vocabulary
                       2048) for quick runs on the CPU
  --prefill LIST       prompt lengths of the batch-1 prefills (default 512,4096,16384;
                       `none` skips them)
  --decode LIST        batch sizes of the decode runs (default 1,8,64; `none` skips them)
  --context N          tokens prefilled per sequence before decoding (default 128)
  --steps N            timed decode steps (default 32)
  --warmup N           decode steps before the timed ones (default 3)
  --repeats N          timed prefills per prompt length, after one warm-up (default 3)
  --kernel-tokens N    tokens of the kernels' prefill case (default 4096)
  --kernel-ms MS       time spent per kernel figure (default 200)
  --no-kernels         skip the per-kernel timings
  --copy-mib N         size of the bandwidth copy (default 1024 on a GPU, 256 on the CPU)
  --seed N             seed of the token ids (default 0)
  --json OUT           also write every figure as JSON
  --save-checkpoint DIR  instead of benchmarking, write the model as a servable
                       checkpoint: DIR/config.json, DIR/model.safetensors (bf16,
                       generated on the device tensor by tensor) and a word-level
                       tokenizer over `t0 ... t{vocab-1}` (eos: the last word)
  --help               this text
";

/// Compute type of the run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Precision {
    Bf16,
    F32,
}

impl Precision {
    fn parse(value: &str) -> Result<Precision> {
        Ok(match value {
            "bf16" => Precision::Bf16,
            "f32" => Precision::F32,
            other => bail!("--dtype must be bf16 or f32, not `{other}`"),
        })
    }

    pub fn name(self) -> &'static str {
        match self {
            Precision::Bf16 => "bf16",
            Precision::F32 => "f32",
        }
    }

    pub fn candle(self) -> DType {
        match self {
            Precision::Bf16 => DType::BF16,
            Precision::F32 => DType::F32,
        }
    }
}

/// Where the model runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DeviceKind {
    Cpu,
    Cuda,
}

impl DeviceKind {
    fn parse(value: &str) -> Result<DeviceKind> {
        Ok(match value {
            "cpu" => DeviceKind::Cpu,
            "cuda" => DeviceKind::Cuda,
            other => bail!("--device must be cpu or cuda, not `{other}`"),
        })
    }

    pub fn name(self) -> &'static str {
        match self {
            DeviceKind::Cpu => "cpu",
            DeviceKind::Cuda => "cuda",
        }
    }

    pub fn open(self) -> Result<Device> {
        match self {
            DeviceKind::Cpu => Ok(Device::Cpu),
            DeviceKind::Cuda => berrylm::device::open_cuda(0).context(
                "opening CUDA device 0 (is this a CUDA build? `cargo xtask bench --device cuda`)",
            ),
        }
    }
}

#[derive(Clone, Debug)]
pub struct Args {
    pub device: DeviceKind,
    pub dtype: Precision,
    pub layers: usize,
    pub tiny: bool,
    pub prefill: Vec<usize>,
    pub decode: Vec<usize>,
    pub context: usize,
    pub steps: usize,
    pub warmup: usize,
    pub repeats: usize,
    pub kernel_tokens: usize,
    pub kernel_ms: f64,
    pub kernels: bool,
    pub copy_mib: usize,
    pub seed: u64,
    pub json: Option<PathBuf>,
    pub save_checkpoint: Option<PathBuf>,
}

impl Args {
    /// Parses the arguments; `None` when help was asked for.
    pub fn parse(args: impl IntoIterator<Item = String>) -> Result<Option<Args>> {
        let device = if candle_core::utils::cuda_is_available() {
            DeviceKind::Cuda
        } else {
            DeviceKind::Cpu
        };
        let mut parsed = Args {
            device,
            dtype: Precision::F32,
            layers: 8,
            tiny: false,
            prefill: vec![512, 4096, 16384],
            decode: vec![1, 8, 64],
            context: 128,
            steps: 32,
            warmup: 3,
            repeats: 3,
            kernel_tokens: 4096,
            kernel_ms: 200.0,
            kernels: true,
            copy_mib: 0,
            seed: 0,
            json: None,
            save_checkpoint: None,
        };
        let mut dtype = None;
        let mut iter = args.into_iter();
        while let Some(arg) = iter.next() {
            // `--name value` or `--name=value`.
            let (name, inline) = match arg.split_once('=') {
                Some((name, value)) if name.starts_with("--") => {
                    (name.to_string(), Some(value.to_string()))
                }
                _ => (arg.clone(), None),
            };
            let mut value = |what: &str| -> Result<String> {
                match &inline {
                    Some(value) => Ok(value.clone()),
                    None => iter.next().with_context(|| format!("{name} needs {what}")),
                }
            };
            match name.as_str() {
                "--help" | "-h" => return Ok(None),
                "--device" => parsed.device = DeviceKind::parse(&value("cpu or cuda")?)?,
                "--dtype" => dtype = Some(Precision::parse(&value("bf16 or f32")?)?),
                "--layers" => parsed.layers = positive(&name, &value("a number")?)?,
                "--tiny" => parsed.tiny = true,
                "--prefill" => parsed.prefill = list(&name, &value("a list like 512,4096")?)?,
                "--decode" => parsed.decode = list(&name, &value("a list like 1,8,64")?)?,
                "--context" => parsed.context = positive(&name, &value("a number")?)?,
                "--steps" => parsed.steps = positive(&name, &value("a number")?)?,
                "--warmup" => parsed.warmup = number(&name, &value("a number")?)?,
                "--repeats" => parsed.repeats = positive(&name, &value("a number")?)?,
                "--kernel-tokens" => parsed.kernel_tokens = positive(&name, &value("a number")?)?,
                "--kernel-ms" => {
                    parsed.kernel_ms = positive(&name, &value("milliseconds")?)? as f64;
                }
                "--no-kernels" => parsed.kernels = false,
                "--copy-mib" => parsed.copy_mib = positive(&name, &value("a number")?)?,
                "--seed" => parsed.seed = number(&name, &value("a number")?)? as u64,
                "--json" => parsed.json = Some(PathBuf::from(value("a file")?)),
                "--save-checkpoint" => {
                    parsed.save_checkpoint = Some(PathBuf::from(value("a folder")?));
                }
                other => bail!("unexpected argument `{other}`\n{USAGE}"),
            }
            if inline.is_some() && matches!(name.as_str(), "--tiny" | "--no-kernels" | "--help") {
                bail!("{name} takes no value");
            }
        }
        parsed.dtype = match (dtype, parsed.device) {
            (Some(Precision::Bf16), DeviceKind::Cpu) => {
                bail!("--dtype bf16 needs --device cuda: candle's CPU matmul has no bf16")
            }
            (Some(dtype), _) => dtype,
            (None, DeviceKind::Cuda) => Precision::Bf16,
            (None, DeviceKind::Cpu) => Precision::F32,
        };
        if parsed.copy_mib == 0 {
            parsed.copy_mib = match parsed.device {
                DeviceKind::Cuda => 1024,
                DeviceKind::Cpu => 256,
            };
        }
        Ok(Some(parsed))
    }
}

fn number(name: &str, value: &str) -> Result<usize> {
    value
        .trim()
        .parse::<usize>()
        .with_context(|| format!("{name}: `{value}` is not a non-negative integer"))
}

fn positive(name: &str, value: &str) -> Result<usize> {
    let parsed = number(name, value)?;
    if parsed == 0 {
        bail!("{name} must be positive");
    }
    Ok(parsed)
}

/// A comma-separated list of positive integers, or `none` for an empty list.
fn list(name: &str, value: &str) -> Result<Vec<usize>> {
    if value.trim() == "none" {
        return Ok(Vec::new());
    }
    value
        .split(',')
        .filter(|item| !item.trim().is_empty())
        .map(|item| positive(name, item))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(args: &[&str]) -> Result<Option<Args>> {
        Args::parse(args.iter().map(|a| a.to_string()))
    }

    #[test]
    fn defaults_and_overrides() {
        let args = parse(&["--device", "cuda"]).unwrap().unwrap();
        assert_eq!(args.dtype, Precision::Bf16);
        assert_eq!(args.copy_mib, 1024);
        let args = parse(&[]).unwrap().unwrap();
        assert_eq!(args.layers, 8);
        assert_eq!(args.prefill, vec![512, 4096, 16384]);
        assert_eq!(args.decode, vec![1, 8, 64]);
        assert_eq!((args.context, args.steps, args.warmup), (128, 32, 3));
        let cpu = parse(&["--device", "cpu"]).unwrap().unwrap();
        assert_eq!(cpu.dtype, Precision::F32);

        let args = parse(&[
            "--device",
            "cpu",
            "--dtype=f32",
            "--layers",
            "2",
            "--tiny",
            "--prefill",
            "64",
            "--decode=1,2",
            "--json",
            "out.json",
            "--save-checkpoint",
            "/tmp/ck",
        ])
        .unwrap()
        .unwrap();
        assert_eq!(args.device, DeviceKind::Cpu);
        assert_eq!(args.dtype, Precision::F32);
        assert_eq!(args.layers, 2);
        assert!(args.tiny);
        assert_eq!(args.prefill, vec![64]);
        assert_eq!(args.decode, vec![1, 2]);
        assert_eq!(args.copy_mib, 256);
        assert_eq!(args.json, Some(PathBuf::from("out.json")));
        assert_eq!(args.save_checkpoint, Some(PathBuf::from("/tmp/ck")));
        assert!(parse(&["--prefill", "none"])
            .unwrap()
            .unwrap()
            .prefill
            .is_empty());
        assert!(parse(&["--help"]).unwrap().is_none());
    }

    #[test]
    fn bad_arguments_are_refused() {
        for bad in [
            &["--layers", "0"][..],
            &["--layers"],
            &["--save-checkpoint"],
            &["--dtype", "f16"],
            &["--device", "cpu", "--dtype", "bf16"],
            &["--device", "metal"],
            &["--decode", "1,x"],
            &["--tiny=1"],
            &["--frobnicate"],
        ] {
            assert!(parse(bad).is_err(), "{bad:?} was accepted");
        }
    }
}
