//! Command-line arguments (clap).

use std::path::PathBuf;
use std::str::FromStr;

use anyhow::{Context, Result};
use berrylm::graph_batches::GraphBatches;
use candle_core::{DType, Device};
use clap::builder::RangedU64ValueParser;
use clap::error::ErrorKind;
use clap::{CommandFactory, Parser, ValueEnum};
use mistralrs_quant::IsqType;

/// Builds a BerryLM-OS-shaped model with random weights on the device (nothing
/// is read from disk, nothing written but --json and --save-checkpoint) and
/// measures prefill and decode throughput of the berrylm plugin, the time of
/// one KDA layer's kernels, the device's copy bandwidth and the weight-read
/// floor of a decode step.
#[derive(Debug, Parser)]
#[command(name = "berrylm-bench", version)]
struct Cli {
    /// GPU 0 (cuda) or the CPU; default cuda in a CUDA build, else cpu.
    #[arg(long, value_enum)]
    device: Option<DeviceKind>,
    /// Weights and activations; default bf16 on cuda, f32 on cpu (candle's CPU
    /// matmul has no bf16).
    #[arg(long, value_enum)]
    dtype: Option<Precision>,
    /// Decoder layers, [KDA, KDA, KDA, attention] repeated.
    #[arg(long, default_value_t = 8, value_parser = positive())]
    layers: usize,
    /// A scaled-down shape (hidden 256, 8 experts top-2, vocabulary 2048) for
    /// quick runs on the CPU.
    #[arg(long)]
    tiny: bool,
    /// Prompt lengths of the batch-1 prefills (`none` skips them).
    #[arg(long, default_value = "512,4096,16384", value_name = "LIST")]
    prefill: Sizes,
    /// Batch sizes of the decode runs (`none` skips them).
    #[arg(long, default_value = "1,8,64", value_name = "LIST")]
    decode: Sizes,
    /// How the decode runs keep the attention KV, each measured in turn:
    /// `contiguous` (the host's non-paged cache), `paged` (blocks as under
    /// `--paged-attn`), `graphs` (paged, steps replayed from CUDA graphs as
    /// the server's are); paged and graphs need --device cuda.
    #[arg(long, value_enum, value_delimiter = ',', default_value = "contiguous")]
    decode_kv: Vec<DecodeKv>,
    /// The batch sizes `--decode-kv graphs` replays from graphs (sizes and
    /// ranges, `1-8,16`); others run eagerly. Default: the server's.
    #[arg(long, default_value = "standard", value_name = "LIST")]
    graph_batches: GraphBatches,
    /// Tokens prefilled per sequence before decoding.
    #[arg(long, default_value_t = 128, value_parser = positive())]
    context: usize,
    /// Timed decode steps.
    #[arg(long, default_value_t = 32, value_parser = positive())]
    steps: usize,
    /// Decode steps before the timed ones.
    #[arg(long, default_value_t = 3)]
    warmup: usize,
    /// Timed prefills per prompt length, after one warm-up.
    #[arg(long, default_value_t = 3, value_parser = positive())]
    repeats: usize,
    /// Tokens of the kernels' prefill case.
    #[arg(long, default_value_t = 4096, value_parser = positive())]
    kernel_tokens: usize,
    /// Milliseconds spent per kernel figure.
    #[arg(long, default_value_t = 200, value_parser = positive())]
    kernel_ms: usize,
    /// Skip the per-kernel timings.
    #[arg(long)]
    no_kernels: bool,
    /// Skip the host cost per operation table (under a profiler it is most of
    /// the run's kernels).
    #[arg(long)]
    no_op_costs: bool,
    /// Size of the bandwidth copy in MiB; default 1024 on a GPU, 256 on the CPU.
    #[arg(long, value_parser = positive())]
    copy_mib: Option<usize>,
    /// Seed of the token ids.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Also write every figure as JSON.
    #[arg(long, value_name = "OUT")]
    json: Option<PathBuf>,
    /// Quantize the projections as `mistralrs serve --isq TYPE` does (the
    /// host's in-situ quantization of the projections BerryLM lets it
    /// quantize) while the model is built.
    #[arg(long, value_name = "TYPE", value_parser = parse_isq)]
    isq: Option<IsqType>,
    /// Instead of benchmarking, write the model as a servable checkpoint:
    /// DIR/config.json, DIR/model.safetensors (bf16, generated on the device
    /// tensor by tensor) and a word-level tokenizer over `t0 ... t{vocab-1}`
    /// (eos: the last word).
    #[arg(long, value_name = "DIR")]
    save_checkpoint: Option<PathBuf>,
}

fn parse_isq(value: &str) -> Result<IsqType, String> {
    mistralrs_core::parse_isq_value(value, None)
}

fn positive() -> RangedU64ValueParser<usize> {
    RangedU64ValueParser::new().range(1..)
}

/// A comma-separated list of positive integers, or `none`.
#[derive(Clone, Debug)]
struct Sizes(Vec<usize>);

impl FromStr for Sizes {
    type Err = String;

    fn from_str(value: &str) -> Result<Sizes, String> {
        if value.trim() == "none" {
            return Ok(Sizes(Vec::new()));
        }
        value
            .split(',')
            .filter(|item| !item.trim().is_empty())
            .map(|item| match item.trim().parse::<usize>() {
                Ok(size) if size > 0 => Ok(size),
                _ => Err(format!("`{item}` is not a positive integer")),
            })
            .collect::<Result<_, _>>()
            .map(Sizes)
    }
}

/// How a decode run keeps the attention KV (`--decode-kv`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum DecodeKv {
    Contiguous,
    Paged,
    Graphs,
}

impl DecodeKv {
    pub fn name(self) -> &'static str {
        match self {
            DecodeKv::Contiguous => "contiguous",
            DecodeKv::Paged => "paged",
            DecodeKv::Graphs => "graphs",
        }
    }
}

/// Compute type of the run.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Precision {
    Bf16,
    F32,
}

impl Precision {
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
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum DeviceKind {
    Cpu,
    Cuda,
}

impl DeviceKind {
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

/// The run's settings, defaults resolved for the device.
#[derive(Clone, Debug)]
pub struct Args {
    pub device: DeviceKind,
    pub dtype: Precision,
    pub layers: usize,
    pub tiny: bool,
    pub prefill: Vec<usize>,
    pub decode: Vec<usize>,
    pub decode_kv: Vec<DecodeKv>,
    pub graph_batches: GraphBatches,
    pub context: usize,
    pub steps: usize,
    pub warmup: usize,
    pub repeats: usize,
    pub kernel_tokens: usize,
    pub kernel_ms: f64,
    pub kernels: bool,
    /// Whether to print the host cost per operation table.
    pub op_costs: bool,
    pub copy_mib: usize,
    pub seed: u64,
    pub json: Option<PathBuf>,
    pub isq: Option<IsqType>,
    pub save_checkpoint: Option<PathBuf>,
}

impl Args {
    /// The process's arguments; on a wrong one clap prints its error and the
    /// process exits.
    pub fn from_command_line() -> Args {
        Cli::parse().resolve().unwrap_or_else(|error| error.exit())
    }

    #[cfg(test)]
    fn try_parse<'a>(args: impl IntoIterator<Item = &'a str>) -> Result<Args, clap::Error> {
        Cli::try_parse_from(std::iter::once("berrylm-bench").chain(args))?.resolve()
    }
}

impl Cli {
    fn resolve(self) -> Result<Args, clap::Error> {
        let device = self
            .device
            .unwrap_or(if candle_core::utils::cuda_is_available() {
                DeviceKind::Cuda
            } else {
                DeviceKind::Cpu
            });
        let dtype = match (self.dtype, device) {
            (Some(Precision::Bf16), DeviceKind::Cpu) => {
                return Err(Cli::command().error(
                    ErrorKind::ArgumentConflict,
                    "--dtype bf16 needs --device cuda: candle's CPU matmul has no bf16",
                ))
            }
            (Some(dtype), _) => dtype,
            (None, DeviceKind::Cuda) => Precision::Bf16,
            (None, DeviceKind::Cpu) => Precision::F32,
        };
        if device == DeviceKind::Cpu && self.decode_kv.iter().any(|kv| *kv != DecodeKv::Contiguous)
        {
            return Err(Cli::command().error(
                ErrorKind::ArgumentConflict,
                "--decode-kv paged and graphs need --device cuda: paged attention runs on CUDA",
            ));
        }
        Ok(Args {
            device,
            dtype,
            layers: self.layers,
            tiny: self.tiny,
            prefill: self.prefill.0,
            decode: self.decode.0,
            decode_kv: self.decode_kv,
            graph_batches: self.graph_batches,
            context: self.context,
            steps: self.steps,
            warmup: self.warmup,
            repeats: self.repeats,
            kernel_tokens: self.kernel_tokens,
            kernel_ms: self.kernel_ms as f64,
            kernels: !self.no_kernels,
            op_costs: !self.no_op_costs,
            copy_mib: self.copy_mib.unwrap_or(match device {
                DeviceKind::Cuda => 1024,
                DeviceKind::Cpu => 256,
            }),
            seed: self.seed,
            json: self.json,
            isq: self.isq,
            save_checkpoint: self.save_checkpoint,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_and_overrides() {
        let args = Args::try_parse(["--device", "cuda"]).unwrap();
        assert_eq!(args.dtype, Precision::Bf16);
        assert_eq!(args.copy_mib, 1024);
        let args = Args::try_parse([]).unwrap();
        assert_eq!(args.layers, 8);
        assert_eq!(args.isq, None);
        assert_eq!(args.prefill, vec![512, 4096, 16384]);
        assert_eq!(args.decode, vec![1, 8, 64]);
        assert_eq!(args.decode_kv, vec![DecodeKv::Contiguous]);
        assert_eq!((args.context, args.steps, args.warmup), (128, 32, 3));
        let cpu = Args::try_parse(["--device", "cpu"]).unwrap();
        assert_eq!(cpu.dtype, Precision::F32);

        let args = Args::try_parse([
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
            "--isq",
            "Q4K",
            "--save-checkpoint",
            "/tmp/ck",
        ])
        .unwrap();
        assert_eq!(args.device, DeviceKind::Cpu);
        assert_eq!(args.dtype, Precision::F32);
        assert_eq!(args.layers, 2);
        assert!(args.tiny);
        assert_eq!(args.prefill, vec![64]);
        assert_eq!(args.decode, vec![1, 2]);
        assert_eq!(args.copy_mib, 256);
        assert_eq!(args.json, Some(PathBuf::from("out.json")));
        assert_eq!(args.isq, Some(IsqType::Q4K));
        assert_eq!(args.save_checkpoint, Some(PathBuf::from("/tmp/ck")));
        let args = Args::try_parse(["--device", "cuda", "--decode-kv", "paged,graphs"]).unwrap();
        assert_eq!(args.decode_kv, vec![DecodeKv::Paged, DecodeKv::Graphs]);
        assert_eq!(args.graph_batches, GraphBatches::standard());
        let args = Args::try_parse(["--graph-batches", "1-2,16"]).unwrap();
        assert_eq!(args.graph_batches.sizes().collect::<Vec<_>>(), [1, 2, 16]);
        assert!(Args::try_parse(["--prefill", "none"])
            .unwrap()
            .prefill
            .is_empty());
        assert_eq!(
            Args::try_parse(["--help"]).unwrap_err().kind(),
            ErrorKind::DisplayHelp
        );
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
            &["--device", "cpu", "--decode-kv", "paged"],
            &["--device", "cuda", "--decode-kv", "pages"],
            &["--graph-batches", "0"],
            &["--graph-batches", "300"],
            &["--isq", "q9"],
            &["--tiny=1"],
            &["--frobnicate"],
        ] {
            assert!(
                Args::try_parse(bad.iter().copied()).is_err(),
                "{bad:?} was accepted"
            );
        }
    }
}
