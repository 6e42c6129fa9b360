//! `berrylm-align`: how closely the berrylm plugin reproduces the transformers
//! reference on a golden file, in every way the engine runs the model
//! (one-shot prefill, prefill then teacher-forced decode, chunked prefill,
//! free-running greedy through the host engine), next to the reference's own
//! bfloat16 noise. See docs/alignment.md.

use std::process::ExitCode;

use anyhow::{Context, Result};

use berrylm_align::args::Args;
use berrylm_align::modes::Golden;
use berrylm_align::report::{Report, Run};
use berrylm_align::{corpus, dump, modes};
use clap::Parser;

#[tokio::main]
async fn main() -> ExitCode {
    match run().await {
        Ok(code) => code,
        Err(error) => {
            eprintln!("berrylm-align: error: {error:#}");
            ExitCode::FAILURE
        }
    }
}

/// Exit status when the report was written but some mode could not run.
const SOME_MODE_FAILED: u8 = 2;

async fn run() -> Result<ExitCode> {
    let args = Args::parse();
    let device = args.device.open()?;
    if corpus::is_corpus_file(&args.golden)? {
        return run_corpus(&args, &device);
    }
    let golden = Golden::load(&args.golden)?;

    // Teacher-forced modes and the Driver's greedy run, on fresh host caches.
    // A mode that cannot run is reported as failed; the others still run.
    let model = load_model(&args, &device);
    let runs = modes::teacher_forced(&model, &golden);
    let driver_tokens = match &model {
        Ok(model) => match modes::driver_greedy(model, &golden.prompt_ids, golden.output_ids.len())
        {
            Ok(tokens) => Some(tokens),
            Err(error) => {
                eprintln!(
                    "berrylm-align: greedy decoding with the driver failed: {}",
                    modes::error_line(&error)
                );
                None
            }
        },
        Err(_) => None,
    };
    drop(model);

    if let Some(path) = &args.write_golden {
        let prefill = runs.prefill.as_ref().map_err(|error| {
            anyhow::anyhow!(
                "--write-golden needs the prefill mode: {}",
                modes::error_line(error)
            )
        })?;
        let tokens = driver_tokens
            .as_deref()
            .context("--write-golden needs the Driver's greedy tokens")?;
        dump::save_golden(path, &golden, prefill, tokens)?;
    }

    // Free-running greedy through the host engine.
    let greedy = if args.teacher_forced_only {
        None
    } else {
        berrylm::register().context("registering berrylm in the host")?;
        let greedy = modes::engine_greedy(
            &args.model,
            args.dtype,
            args.device,
            args.isq,
            &golden,
            driver_tokens.as_deref(),
        )
        .await
        .context("greedy generation through the host engine");
        Some(greedy)
    };

    let report = Report::build(run_header(&args), &golden, &runs, greedy);
    print!("{}", report.table());
    if let Some(path) = &args.json {
        let json = serde_json::to_string_pretty(&report)?;
        std::fs::write(path, json + "\n").with_context(|| format!("writing {}", path.display()))?;
    }
    if let Some(path) = &args.dump {
        dump::save(path, &golden, &runs, driver_tokens.as_deref())?;
    }
    Ok(if report.failures().is_empty() {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(SOME_MODE_FAILED)
    })
}

/// The checkpoint in the run's dtype on `device`, quantized while loading
/// with `--isq` (what the host quantized goes to stderr).
fn load_model(args: &Args, device: &candle_core::Device) -> Result<berrylm::model::BerryLm> {
    let context = || format!("loading {}", args.model.display());
    let dtype = args.dtype.candle();
    match args.isq {
        None => berrylm::driver::load_checkpoint(&args.model, dtype, device).with_context(context),
        Some(isq) => {
            let (model, report) =
                berrylm::driver::load_checkpoint_quantized(&args.model, dtype, device, isq)
                    .with_context(context)?;
            eprintln!("berrylm-align: in-situ quantization to {isq:?} {report}");
            Ok(model)
        }
    }
}

fn run_header(args: &Args) -> Run {
    Run {
        model: args.model_name(),
        model_dir: args.model.display().to_string(),
        golden: args.golden.display().to_string(),
        dtype: args.dtype.name().into(),
        isq: args.isq.map(|isq| format!("{isq:?}")),
        device: args.device.name().into(),
    }
}

/// The corpus protocol (a file of `tools/reference_dump.py --corpus`): the
/// free-running and teacher-forced tables (corpus.rs).
fn run_corpus(args: &Args, device: &candle_core::Device) -> Result<ExitCode> {
    let golden = corpus::CorpusGolden::load(&args.golden, args.prompts)?;
    let model = load_model(args, device)?;
    let report = corpus::CorpusReport::build(run_header(args), &model, &golden)?;
    print!("{}", report.tables());
    if let Some(path) = &args.json {
        let json = serde_json::to_string_pretty(&report)?;
        std::fs::write(path, json + "\n").with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(ExitCode::SUCCESS)
}
