//! The alignment tool (`berrylm-align`, the binary behind `cargo xtask align`)
//! on the CPU: `small-hybrid` in float32, and every fixture with the
//! reference's own bfloat16 logits in bfloat16, against the acceptance of the
//! alignment report (docs/alignment.md); on `bf16-pool`, bfloat16 against the
//! reference's own bfloat16 run row by row.

use std::path::Path;
use std::process::Command;

use anyhow::{Context, Result};
use berrylm_align::stats::argmax;
use berrylm_tests::{
    align_binary, count, fixtures_dir, number, run_successfully, Fixture, FIXTURES,
};
use candle_core::Device;
use serde_json::Value;

/// Largest |Δ logprob| of the reference's top-1 token accepted in float32.
const MAX_LOGPROB_DIFF: f64 = 2e-3;

/// In bfloat16, pooled top-1 agreement with `logits_f32` may be this much
/// below the reference's own bfloat16 run's (one percentage point).
const BF16_TOP1_MARGIN: f64 = 0.01;

/// In bfloat16, pooled mean |Δ logprob| may be this many times the reference's
/// own bfloat16 run's.
const BF16_MEAN_DIFF_FACTOR: f64 = 1.5;

/// Runs `berrylm-align` on the CPU with `--model MODEL --golden GOLDEN
/// --dtype DTYPE --json JSON` and the further arguments; asserts that it
/// succeeded and returns its standard output.
fn run_align(
    model: &Path,
    golden: &Path,
    dtype: &str,
    json: &Path,
    extra: &[&std::ffi::OsStr],
) -> Result<String> {
    run_successfully(
        Command::new(align_binary()?)
            .arg("--model")
            .arg(model)
            .arg("--golden")
            .arg(golden)
            .args(["--dtype", dtype, "--device", "cpu", "--json"])
            .arg(json)
            .args(extra),
    )
}

#[test]
fn small_hybrid_f32_is_aligned_in_every_mode() -> Result<()> {
    let fixture = fixtures_dir().join("small-hybrid");
    let out = std::env::temp_dir().join(format!("berrylm-align-test-{}", std::process::id()));
    std::fs::create_dir_all(&out)?;
    let (json_path, dump_path) = (out.join("report.json"), out.join("dump.safetensors"));
    let stdout = run_align(
        &fixture.join("model"),
        &fixture.join("golden.safetensors"),
        "f32",
        &json_path,
        &["--dump".as_ref(), dump_path.as_os_str()],
    )?;
    assert!(
        stdout.contains("| Model") && stdout.contains("| Position"),
        "no tables:\n{stdout}"
    );

    let report: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&json_path)?)?;
    let modes = &report["modes"];
    for mode in ["prefill", "incremental", "chunked"] {
        let stats = &modes[mode];
        let top1 = number(stats, "top1_match")?;
        let max_diff = number(stats, "max_abs_logprob_diff")?;
        assert_eq!(top1, 1.0, "{mode}: top-1 match {top1}\n{stdout}");
        assert!(
            max_diff <= MAX_LOGPROB_DIFF,
            "{mode}: max |Δ logprob| {max_diff}\n{stdout}"
        );
        assert!(count(stats, "positions")? > 0);
    }
    let incremental = &modes["incremental"];
    let split = count(&incremental["prefill_positions"], "positions")?
        + count(&incremental["decode_positions"], "positions")?;
    assert_eq!(Some(split), incremental["positions"].as_u64());
    let matched = count(&modes["greedy"], "matched")?;
    let total = count(&modes["greedy"], "total")?;
    assert!(total > 0);
    assert_eq!(matched, total, "free-running greedy diverges\n{stdout}");
    assert!(
        report["noise_floor"]["top1_match"].is_number(),
        "small-hybrid has logits_bf16"
    );

    let dump = candle_core::safetensors::load(&dump_path, &Device::Cpu)?;
    let golden = candle_core::safetensors::load(fixture.join("golden.safetensors"), &Device::Cpu)?;
    for mode in ["prefill", "incremental", "chunked"] {
        let ours = dump
            .get(&format!("seq3.{mode}.logits"))
            .context("dumped logits")?;
        assert_eq!(ours.dims(), golden["seq3.logits_f32"].dims(), "{mode}");
    }
    let dumped_ids = dump["gen.output_ids"].to_vec1::<i64>()?;
    assert_eq!(dumped_ids, golden["gen.output_ids"].to_vec1::<i64>()?);
    std::fs::remove_dir_all(&out)?;
    Ok(())
}

/// Statistics of several reports pooled over their positions.
#[derive(Default)]
struct Pooled {
    positions: u64,
    top1_matches: u64,
    /// Sum over positions of |Δ logprob|.
    logprob_diff_sum: f64,
}

impl Pooled {
    /// Adds a report's statistics over a set of positions (a mode, or the noise floor).
    fn add(&mut self, stats: &Value) -> Result<()> {
        let positions = count(stats, "positions")?;
        let mismatches = count(stats, "top1_mismatches")?;
        let mean_diff = number(stats, "mean_abs_logprob_diff")?;
        self.positions += positions;
        self.top1_matches += positions - mismatches;
        self.logprob_diff_sum += mean_diff * positions as f64;
        Ok(())
    }

    fn top1(&self) -> f64 {
        self.top1_matches as f64 / self.positions as f64
    }

    fn mean_logprob_diff(&self) -> f64 {
        self.logprob_diff_sum / self.positions as f64
    }
}

#[test]
fn bf16_is_within_the_reference_noise_floor() -> Result<()> {
    let out = std::env::temp_dir().join(format!("berrylm-align-bf16-{}", std::process::id()));
    std::fs::create_dir_all(&out)?;
    let mut modes = [
        ("prefill", Pooled::default()),
        ("incremental", Pooled::default()),
        ("chunked", Pooled::default()),
    ];
    let mut noise_floor = Pooled::default();
    let mut tables = String::new();
    for name in FIXTURES {
        let fixture = Fixture::load(name)?;
        if !fixture.golden.contains_key("seq0.logits_bf16") {
            continue;
        }
        let json_path = out.join(format!("{name}.json"));
        let output = Command::new(align_binary()?)
            .arg("--model")
            .arg(&fixture.model_dir)
            .arg("--golden")
            .arg(fixtures_dir().join(name).join("golden.safetensors"))
            .args(["--dtype", "bf16", "--device", "cpu", "--json"])
            .arg(&json_path)
            .output()
            .context("running berrylm-align")?;
        let stdout = String::from_utf8_lossy(&output.stdout);
        // Status 2 reports a mode that could not run (checked below for the
        // teacher-forced modes; free-running greedy is not compared in bf16).
        assert!(
            matches!(output.status.code(), Some(0 | 2)),
            "berrylm-align failed on {name} ({}):\n{stdout}\n{}",
            output.status,
            String::from_utf8_lossy(&output.stderr)
        );
        let report: Value = serde_json::from_str(&std::fs::read_to_string(&json_path)?)?;
        for (mode, pooled) in &mut modes {
            let stats = &report["modes"][*mode];
            assert!(
                stats.get("error").is_none(),
                "{name}: {mode} did not run in bf16: {}\n{stdout}",
                stats["error"]
            );
            pooled.add(stats)?;
        }
        noise_floor.add(&report["noise_floor"])?;
        tables.push_str(&stdout);
    }
    assert!(noise_floor.positions > 0, "no fixture has logits_bf16");

    for (mode, pooled) in &modes {
        assert_eq!(
            pooled.positions, noise_floor.positions,
            "{mode}: pooled positions"
        );
        let (top1, floor_top1) = (pooled.top1(), noise_floor.top1());
        assert!(
            top1 >= floor_top1 - BF16_TOP1_MARGIN,
            "{mode}: pooled top-1 {top1:.4} below the noise floor's {floor_top1:.4} - {BF16_TOP1_MARGIN}\n{tables}"
        );
        let (diff, floor_diff) = (pooled.mean_logprob_diff(), noise_floor.mean_logprob_diff());
        assert!(
            diff <= BF16_MEAN_DIFF_FACTOR * floor_diff,
            "{mode}: pooled mean |Δ logprob| {diff:.4e} above {BF16_MEAN_DIFF_FACTOR} x the noise floor's {floor_diff:.4e}\n{tables}"
        );
    }
    std::fs::remove_dir_all(&out)?;
    Ok(())
}

/// The fixtures of `bf16-pool` (its README): 1440 more positions with the
/// reference's own bfloat16 logits on the random checkpoints.
const BF16_POOL: [&str; 6] = [
    "tiny-hf",
    "small-hybrid",
    "small-hybrid-bf16",
    "variant-a",
    "variant-b",
    "no-attnres",
];

/// Our bfloat16 logits against the reference's own bfloat16 run, as
/// `from_pretrained` loads the model, over the pool in every teacher-forced
/// mode: how many rows are bit for bit the reference's and how many have its
/// argmax. The CPU computes bf16 at the reference's rounding points, so a
/// changed rounding point shows as rows that stop being identical; what is
/// left apart is the float32 summation order of a few near-ties (1432 of the
/// 1440 argmaxes and 994 rows equal on 0b46e56's plugin).
#[test]
fn bf16_reproduces_the_reference_bf16_run_on_the_pool() -> Result<()> {
    let out = std::env::temp_dir().join(format!("berrylm-align-pool-{}", std::process::id()));
    std::fs::create_dir_all(&out)?;
    let modes = ["prefill", "incremental", "chunked"];
    let (mut rows, mut identical, mut same_argmax) = (0usize, [0usize; 3], [0usize; 3]);
    for name in BF16_POOL {
        let golden_path = fixtures_dir()
            .join("bf16-pool/from-pretrained")
            .join(name)
            .join("golden.safetensors");
        let dump_path = out.join(format!("{name}.safetensors"));
        run_align(
            &fixtures_dir().join(name).join("model"),
            &golden_path,
            "bf16",
            &out.join(format!("{name}.json")),
            &[
                "--teacher-forced-only".as_ref(),
                "--dump".as_ref(),
                dump_path.as_os_str(),
            ],
        )?;
        let golden = candle_core::safetensors::load(&golden_path, &Device::Cpu)?;
        let dump = candle_core::safetensors::load(&dump_path, &Device::Cpu)?;
        for seq in 0.. {
            let Some(reference) = golden.get(&format!("seq{seq}.logits_bf16")) else {
                break;
            };
            let reference = reference.to_vec2::<f32>()?;
            rows += reference.len();
            for (m, mode) in modes.iter().enumerate() {
                let ours = dump
                    .get(&format!("seq{seq}.{mode}.logits"))
                    .with_context(|| format!("{name}: seq{seq}.{mode}.logits dumped"))?
                    .to_vec2::<f32>()?;
                assert_eq!(ours.len(), reference.len(), "{name} seq{seq} {mode}");
                for (ours, reference) in ours.iter().zip(&reference) {
                    identical[m] += usize::from(ours == reference);
                    same_argmax[m] += usize::from(argmax(ours) == argmax(reference));
                }
            }
        }
    }
    assert_eq!(rows, 1440, "positions of the pool");
    for (m, mode) in modes.iter().enumerate() {
        assert!(
            same_argmax[m] * 100 >= rows * 99,
            "{mode}: the reference bf16 run's argmax at {} of {rows} positions",
            same_argmax[m]
        );
        assert!(
            identical[m] * 10 >= rows * 6,
            "{mode}: {} of {rows} rows bit for bit the reference bf16 run's",
            identical[m]
        );
    }
    std::fs::remove_dir_all(&out)?;
    Ok(())
}

/// Runs `berrylm-align` on the vendored corpus-protocol file
/// (`trained-tiny-corpus`, the reference's windows of the bundled model) and
/// returns its JSON report.
fn corpus_report(dtype: &str) -> Result<Value> {
    let fixtures = fixtures_dir();
    let out = std::env::temp_dir().join(format!(
        "berrylm-align-corpus-{dtype}-{}.json",
        std::process::id()
    ));
    let stdout = run_align(
        &fixtures.join("trained-tiny/model"),
        &fixtures.join("trained-tiny-corpus/golden.safetensors"),
        dtype,
        &out,
        &[],
    )?;
    assert!(
        stdout.contains("## Free-running") && stdout.contains("## Teacher-forced"),
        "no tables:\n{stdout}"
    );
    Ok(serde_json::from_str(&std::fs::read_to_string(&out)?)?)
}

/// Float32 on the corpus protocol: every window's free-running continuation
/// and every teacher-forced position agree with the reference, at every
/// position.
#[test]
fn corpus_protocol_f32_matches_at_every_position() -> Result<()> {
    let report = corpus_report("f32")?;
    assert_eq!(report["windows"], 8, "{report}");
    for table in ["free_running", "teacher_forced"] {
        let rows = report[table]["per_position"]
            .as_array()
            .context("per_position")?;
        assert_eq!(rows.len(), 8, "{table}: one row per continuation token");
        assert_eq!(rows[0]["position"], "prefill");
        for row in rows {
            let position = &row["position"];
            assert_eq!(row["top1_match"], 1.0, "{table} {position}: {row}");
            let max = number(row, "max_abs_logprob_diff")?;
            assert!(
                max <= MAX_LOGPROB_DIFF,
                "{table} {position}: max |Δ logprob| {max}"
            );
        }
    }
    Ok(())
}

/// Bfloat16 on the corpus protocol: top-1 agreement within one point of the
/// reference's own bfloat16 run, in both tables.
#[test]
fn corpus_protocol_bf16_sits_beside_the_reference_bf16() -> Result<()> {
    let report = corpus_report("bf16")?;
    for table in ["free_running", "teacher_forced"] {
        let ours = number(&report[table], "top1_match")?;
        let floor = number(&report[table]["reference_bf16"], "top1_match")?;
        assert!(
            ours >= floor - BF16_TOP1_MARGIN,
            "{table}: top-1 {ours} against the reference's bf16 {floor}"
        );
    }
    Ok(())
}

/// Pooled top-1 agreement of the bundled model quantized to `q8_0` with the
/// reference's float32 logits, at least (measured: 99.88 % of 824 positions).
const Q8_0_TOP1: f64 = 0.99;
/// Its mean |Δ logprob|, at most (measured: 2.3e-4; the reference's own
/// bfloat16 run sits at 7.4e-2 on the other fixtures).
const Q8_0_MEAN_DIFF: f64 = 1e-3;

/// `--isq q8_0` quantizes the bundled model while loading, as `mistralrs
/// serve --isq q8_0` does, and the quantized model stays beside the
/// reference in every teacher-forced mode; `--write-golden` writes the
/// unquantized model's run in the reference's layout (the file an `--isq`
/// run of a checkpoint without a reference is compared with).
#[test]
fn q8_0_stays_beside_the_reference_and_write_golden_keeps_its_layout() -> Result<()> {
    let fixture = Fixture::load("trained-tiny")?;
    let golden_path = fixtures_dir().join("trained-tiny/golden.safetensors");
    let out = std::env::temp_dir().join(format!("berrylm-align-isq-{}", std::process::id()));
    std::fs::create_dir_all(&out)?;

    let written = out.join("unquantized.safetensors");
    run_align(
        &fixture.model_dir,
        &golden_path,
        "f32",
        &out.join("unquantized.json"),
        &[
            "--teacher-forced-only".as_ref(),
            "--write-golden".as_ref(),
            written.as_os_str(),
        ],
    )?;
    let reference = &fixture.golden;
    let ours = candle_core::safetensors::load(&written, &Device::Cpu)?;
    let sequences = (0..)
        .take_while(|i| reference.contains_key(&format!("seq{i}.input_ids")))
        .count();
    assert!(sequences > 0);
    for i in 0..sequences {
        let ids = format!("seq{i}.input_ids");
        assert_eq!(
            ours[&ids].to_vec1::<i64>()?,
            reference[&ids].to_vec1::<i64>()?
        );
        let logits = format!("seq{i}.logits_f32");
        assert_eq!(ours[&logits].dims(), reference[&logits].dims(), "{logits}");
    }
    // The unquantized model's greedy run is the reference's in float32.
    for key in ["gen.prompt_ids", "gen.output_ids"] {
        assert_eq!(
            ours[key].to_vec1::<i64>()?,
            reference[key].to_vec1::<i64>()?,
            "{key}"
        );
    }

    let json = out.join("q8_0.json");
    let stdout = run_align(
        &fixture.model_dir,
        &golden_path,
        "f32",
        &json,
        &[
            "--isq".as_ref(),
            "q8_0".as_ref(),
            "--teacher-forced-only".as_ref(),
        ],
    )?;
    let report: Value = serde_json::from_str(&std::fs::read_to_string(&json)?)?;
    assert_eq!(report["isq"], "Q8_0", "{stdout}");
    for mode in ["prefill", "incremental", "chunked"] {
        let stats = &report["modes"][mode];
        let top1 = number(stats, "top1_match")?;
        let mean = number(stats, "mean_abs_logprob_diff")?;
        assert!(top1 >= Q8_0_TOP1, "{mode}: top-1 {top1}\n{stdout}");
        assert!(mean <= Q8_0_MEAN_DIFF, "{mode}: mean |Δ| {mean}\n{stdout}");
    }
    assert!(report["modes"]["greedy"]["not_run"].is_string(), "{stdout}");
    std::fs::remove_dir_all(&out)?;
    Ok(())
}

/// The host's quantizations that dequantize into the activations' dtype
/// (AFQ, FP8, F8Q8) serve `--dtype bf16` on the CPU, whose backend has no
/// bf16 matmul: the bundled model quantized to each stays beside the
/// reference in every teacher-forced mode (measured: top-1 99.39-100 % of 824
/// positions, mean |Δ logprob| 4.3e-4 to 1.8e-3).
#[test]
fn bf16_on_the_cpu_serves_the_quantizations_that_dequantize_into_it() -> Result<()> {
    let fixture = Fixture::load("trained-tiny")?;
    let golden_path = fixtures_dir().join("trained-tiny/golden.safetensors");
    let out = std::env::temp_dir().join(format!("berrylm-align-bf16-isq-{}", std::process::id()));
    std::fs::create_dir_all(&out)?;
    for isq in ["afq8", "fp8", "f8q8"] {
        let json = out.join(format!("{isq}.json"));
        let stdout = run_align(
            &fixture.model_dir,
            &golden_path,
            "bf16",
            &json,
            &[
                "--isq".as_ref(),
                isq.as_ref(),
                "--teacher-forced-only".as_ref(),
            ],
        )?;
        let report: Value = serde_json::from_str(&std::fs::read_to_string(&json)?)?;
        for mode in ["prefill", "incremental", "chunked"] {
            let stats = &report["modes"][mode];
            let top1 = number(stats, "top1_match")?;
            let mean = number(stats, "mean_abs_logprob_diff")?;
            assert!(top1 >= 0.99, "{isq} {mode}: top-1 {top1}\n{stdout}");
            assert!(mean <= 5e-3, "{isq} {mode}: mean |Δ| {mean}\n{stdout}");
        }
    }
    std::fs::remove_dir_all(&out)?;
    Ok(())
}
