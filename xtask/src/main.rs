use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};

use anyhow::{bail, Context, Result};
use xtask::host::{self, Repo};
use xtask::{cargo, target_dir};

const USAGE: &str = "\
usage: cargo xtask <command>

commands:
  prepare                         apply the host seam to the pinned mistral.rs sources (.host/)
  build [--cuda]                  build the host CLI with the berrylm plugin (release); with
                                  --cuda also stripped standalone executables for the GPU
                                  machine in <target>-cuda/standalone
  test                            prepare, build and run every test of the workspace
  serve [--model DIR] [--port P] [--cuda] [-- HOST_ARGS...]
                                  build and run `mistralrs serve` on 127.0.0.1 (default model:
                                  the bundled trained-tiny BerryLM)
  install [--cuda]                build and install the `mistralrs` binary with berrylm
  parse [--tools FILE] [--no-thinking] [--stream] < OUTPUT
                                  print the OpenAI assistant message the server returns for a
                                  raw BerryLM output (--tools: the request's `tools` JSON array)
  align --model DIR --golden FILE [--dtype f32|bf16|f16] [--device cpu|cuda] [--json OUT]
        [--dump OUT]              build, then report how closely berrylm reproduces a golden
                                  file's reference outputs (docs/alignment.md); `--device cuda`
                                  builds with CUDA
  bench [--device cpu|cuda] [--dtype bf16|f32] [--layers N] [--tiny] [--prefill LIST]
        [--decode LIST] [--json OUT] [...]
                                  build, then measure prefill/decode throughput, per-kernel
                                  times and the decode weight-read floor on a random
                                  BerryLM-OS-shaped model (`bench --help` for every option);
                                  `--device cuda` builds with CUDA
";

/// The bundled default model (the trained tiny BerryLM, vendored with the test fixtures).
const BUNDLED_MODEL: &str = "tests/fixtures/trained-tiny/model";

fn main() -> ExitCode {
    match run(std::env::args().skip(1).collect()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("xtask: error: {error:#}");
            ExitCode::FAILURE
        }
    }
}

fn run(args: Vec<String>) -> Result<()> {
    let (command, rest) = args
        .split_first()
        .map_or(("help", &[][..]), |(c, r)| (c.as_str(), r));
    let repo = Repo::locate()?;
    match command {
        "prepare" => host::prepare(&repo),
        "build" => {
            let options = BuildOptions::parse(rest)?;
            host::prepare(&repo)?;
            build_workspace(&repo, &options)?;
            if options.cuda {
                write_standalone(&options)?;
            }
            Ok(())
        }
        "test" => test(&repo),
        "serve" => serve(&repo, rest),
        "install" => install(&repo, &BuildOptions::parse(rest)?),
        "parse" => xtask::parse::run(&xtask::parse::ParseOptions::parse(rest)?),
        "align" => run_built_tool(&repo, "berrylm-align", rest),
        "bench" => run_built_tool(&repo, "berrylm-bench", rest),
        "help" | "--help" | "-h" => {
            print!("{USAGE}");
            Ok(())
        }
        other => bail!("unknown command `{other}`\n{USAGE}"),
    }
}

#[derive(Default)]
struct BuildOptions {
    cuda: bool,
}

impl BuildOptions {
    fn parse(args: &[String]) -> Result<BuildOptions> {
        let mut options = BuildOptions::default();
        for arg in args {
            match arg.as_str() {
                "--cuda" => options.cuda = true,
                other => bail!("unexpected argument `{other}`\n{USAGE}"),
            }
        }
        Ok(options)
    }

    /// The one feature set every build and test uses, so the host compiles once.
    /// (Builds also name `--bins --tests`: the same units `cargo test` resolves
    /// features for, so testing after building recompiles nothing.)
    fn features(&self) -> String {
        let mut features = vec!["mistralrs-cli/berrylm"];
        if self.cuda {
            features.push("mistralrs-cli/cuda");
            features.push("berrylm/cuda");
        }
        features.join(",")
    }
}

/// Variables `cargo run` sets for xtask itself. Some build scripts of the
/// host's dependencies (ring) declare them with `rerun-if-env-changed`, so
/// passing them on would make this build differ from a plain `cargo build`
/// and recompile the host whenever the two alternate.
fn is_cargo_run_variable(name: &str) -> bool {
    const EXACT: [&str; 8] = [
        "CARGO_MANIFEST_DIR",
        "CARGO_MANIFEST_PATH",
        "CARGO_MANIFEST_LINKS",
        "CARGO_CRATE_NAME",
        "CARGO_BIN_NAME",
        "CARGO_PRIMARY_PACKAGE",
        "CARGO_RUSTC_CURRENT_DIR",
        "OUT_DIR",
    ];
    EXACT.contains(&name) || name.starts_with("CARGO_PKG_")
}

fn cargo_in(repo: &Repo, options: &BuildOptions) -> Command {
    let mut command = Command::new(cargo());
    for (name, _) in std::env::vars_os() {
        if name.to_str().is_some_and(is_cargo_run_variable) {
            command.env_remove(&name);
        }
    }
    command
        .current_dir(&repo.root)
        .env("CARGO_TARGET_DIR", target_dir(options.cuda));
    command
}

fn run_step(description: &str, command: &mut Command) -> Result<()> {
    println!("xtask: {description}");
    let program = command.get_program().to_string_lossy().into_owned();
    let status = command
        .status()
        .with_context(|| format!("could not start `{program}` for: {description}"))?;
    if !status.success() {
        bail!("{description} failed ({status})");
    }
    Ok(())
}

fn build_workspace(repo: &Repo, options: &BuildOptions) -> Result<()> {
    run_step(
        "building the workspace and the host CLI with berrylm (release; the first build of \
         mistral.rs takes about 25 minutes on 2 cores)",
        cargo_in(repo, options).args([
            "build",
            "--release",
            "--workspace",
            "--bins",
            "--tests",
            "--features",
            &options.features(),
        ]),
    )
}

/// Stripped copies of the CUDA build's tools and GPU test executables, for
/// the GPU machine (no cargo there), in `<target>/standalone`.
fn write_standalone(options: &BuildOptions) -> Result<()> {
    let target = target_dir(options.cuda);
    let out = target.join("standalone");
    let written = xtask::standalone::write(&target.join("release"), &out)?;
    println!(
        "xtask: standalone executables (stripped) in {}:",
        out.display()
    );
    for (path, size) in written {
        println!(
            "  {:<28} {:>6.1} MiB",
            path.file_name().unwrap_or_default().to_string_lossy(),
            size as f64 / (1024.0 * 1024.0)
        );
    }
    println!(
        "xtask: on the GPU machine: LD_LIBRARY_PATH=<CUDA 13 runtime libraries>, \
         BERRYLM_HOST_BIN=<standalone>/mistralrs and BERRYLM_FIXTURES=<repo>/tests/fixtures \
         for the test executables (kernels/CUDA.md)"
    );
    Ok(())
}

fn host_binary(options: &BuildOptions) -> PathBuf {
    target_dir(options.cuda).join("release").join("mistralrs")
}

/// The OpenAI Python client the end-to-end tests drive the server with.
const OPENAI_CLIENT: &str = "openai==3.51.0";

/// A venv (beside the target folder cache) with the OpenAI client; returns its python.
fn python_with_openai_client() -> Result<PathBuf> {
    let home = std::env::var_os("HOME").map_or_else(|| PathBuf::from("."), PathBuf::from);
    let venv = home.join(".cache/berrylm/venv");
    let python = venv.join("bin/python");
    let ready = Command::new(&python)
        .args(["-c", "import openai"])
        .output()
        .is_ok_and(|output| output.status.success());
    if !ready {
        run_step(
            "creating the Python venv for the OpenAI client tests",
            Command::new("python3").arg("-m").arg("venv").arg(&venv),
        )
        .context("python3 with the venv module is needed for the end-to-end tests")?;
        run_step(
            &format!("installing {OPENAI_CLIENT} from PyPI"),
            Command::new(venv.join("bin/pip")).args(["install", "--quiet", OPENAI_CLIENT]),
        )?;
    }
    Ok(python)
}

/// The PyPI packages the reference dumper's tests run with (tools/test_reference_dump.py),
/// pinned to the versions they last passed with.
const REFERENCE_PACKAGES: [&str; 4] = [
    "torch==2.15.0",
    "transformers==5.24.0",
    "safetensors==0.8.0",
    "tokenizers==0.23.3",
];

/// Exits 0 when every `name==version` argument is installed at that version
/// (package metadata only: no import of torch, so a ready venv costs milliseconds).
const PINS_INSTALLED: &str = "\
import sys
from importlib import metadata
def installed(pin):
    name, version = pin.split('==')
    try:
        return metadata.version(name) == version
    except metadata.PackageNotFoundError:
        return False
sys.exit(0 if all(installed(pin) for pin in sys.argv[1:]) else 1)
";

/// The Python that runs the reference dumper's tests. `BERRYLM_REFERENCE_PYTHON`
/// when set, used as it is (`BERRYLM_REFERENCE_PYTHON=python3` without torch makes
/// the tests skip, saying why). Else a venv of this command's own, cached outside
/// the clone (`~/.cache/berrylm/venv-reference-tests`, apart from the
/// `venv-reference` that docs/alignment.md has users make, which may hold a
/// transformers main checkout): created when missing, and `pip install`ed with
/// `REFERENCE_PACKAGES` when one of them is missing or at another version (the
/// first time downloads PyPI's torch, a CUDA build of some gigabytes that also
/// runs on the CPU). When the venv is ready this is one metadata check.
fn reference_python() -> Result<PathBuf> {
    if let Some(python) = std::env::var_os("BERRYLM_REFERENCE_PYTHON") {
        return Ok(PathBuf::from(python));
    }
    let home = std::env::var_os("HOME").map_or_else(|| PathBuf::from("."), PathBuf::from);
    let venv = home.join(".cache/berrylm/venv-reference-tests");
    let python = venv.join("bin/python");
    let ready = Command::new(&python)
        .args(["-c", PINS_INSTALLED])
        .args(REFERENCE_PACKAGES)
        .output()
        .is_ok_and(|output| output.status.success());
    if !ready {
        if !python.exists() {
            run_step(
                "creating the Python venv for the reference dumper's tests",
                Command::new("python3").arg("-m").arg("venv").arg(&venv),
            )
            .context(
                "python3 with the venv module is needed for the reference dumper's tests \
                 (BERRYLM_REFERENCE_PYTHON=python3 runs them without it: they skip)",
            )?;
        }
        run_step(
            &format!(
                "installing {} from PyPI into {} (the first time downloads gigabytes)",
                REFERENCE_PACKAGES.join(" "),
                venv.display()
            ),
            Command::new(venv.join("bin/pip"))
                .args(["install", "--quiet"])
                .args(REFERENCE_PACKAGES),
        )?;
    }
    Ok(python)
}

fn test(repo: &Repo) -> Result<()> {
    let options = BuildOptions::default();
    host::prepare(repo)?;
    let python = python_with_openai_client()?;
    run_step(
        "testing xtask (the seam tool)",
        Command::new(cargo()).current_dir(&repo.root).args([
            "test",
            "--manifest-path",
            "xtask/Cargo.toml",
        ]),
    )?;
    run_step(
        "testing the reference dumper (tools/test_reference_dump.py, with torch and \
         transformers from the venv-reference-tests venv or BERRYLM_REFERENCE_PYTHON)",
        Command::new(reference_python()?)
            .current_dir(&repo.root)
            .args(["tools/test_reference_dump.py", "-v"]),
    )?;
    run_step(
        "testing the load tool (tools/test_load_test.py, standard library only)",
        Command::new("python3")
            .current_dir(&repo.root)
            .args(["tools/test_load_test.py", "-v"]),
    )?;
    build_workspace(repo, &options)?;
    run_step(
        "testing the workspace",
        cargo_in(repo, &options)
            .env("BERRYLM_HOST_BIN", host_binary(&options))
            .env("BERRYLM_PYTHON", python)
            .args([
                "test",
                "--release",
                "--no-fail-fast",
                "--workspace",
                "--features",
                &options.features(),
            ]),
    )
}

fn serve(repo: &Repo, args: &[String]) -> Result<()> {
    let mut model = repo.root.join(BUNDLED_MODEL);
    let mut port = String::from("1234");
    let mut options = BuildOptions::default();
    let mut host_args: Vec<String> = Vec::new();
    let mut iter = args.iter();
    while let Some(arg) = iter.next() {
        match arg.as_str() {
            "--model" => model = PathBuf::from(iter.next().context("--model needs a folder")?),
            "--port" => port = iter.next().context("--port needs a number")?.clone(),
            "--cuda" => options.cuda = true,
            "--" => {
                host_args.extend(iter.by_ref().cloned());
            }
            other => bail!("unexpected argument `{other}`\n{USAGE}"),
        }
    }
    port.parse::<u16>()
        .with_context(|| format!("--port {port} is not a port number"))?;
    check_model_dir(&model)?;
    host::prepare(repo)?;
    build_workspace(repo, &options)?;
    println!(
        "xtask: serving {} on http://127.0.0.1:{port}",
        model.display()
    );
    let status = Command::new(host_binary(&options))
        .args(["serve", "--host", "127.0.0.1", "--port", &port, "-m"])
        .arg(&model)
        .args(&host_args)
        .status()
        .context("starting the mistralrs binary")?;
    if !status.success() {
        bail!("mistralrs serve exited with {status}");
    }
    Ok(())
}

/// Builds the workspace (with CUDA when the arguments say `--device cuda`) and
/// runs the built workspace binary `name` with the arguments unchanged (not
/// `cargo run`, which could resolve features differently and rebuild the host).
fn run_built_tool(repo: &Repo, name: &str, args: &[String]) -> Result<()> {
    let mut options = BuildOptions::default();
    let mut iter = args.iter();
    while let Some(arg) = iter.next() {
        let device = match arg.strip_prefix("--device=") {
            Some(device) => Some(device),
            None if arg == "--device" => iter.next().map(String::as_str),
            None => None,
        };
        options.cuda |= device == Some("cuda");
    }
    host::prepare(repo)?;
    build_workspace(repo, &options)?;
    let binary = target_dir(options.cuda).join("release").join(name);
    let status = Command::new(&binary)
        .args(args)
        .status()
        .with_context(|| format!("starting {}", binary.display()))?;
    if !status.success() {
        bail!("{name} exited with {status}");
    }
    Ok(())
}

fn check_model_dir(model: &Path) -> Result<()> {
    if !model.join("config.json").is_file() {
        bail!("{} is not a model folder (no config.json)", model.display());
    }
    Ok(())
}

fn install(repo: &Repo, options: &BuildOptions) -> Result<()> {
    host::prepare(repo)?;
    build_workspace(repo, options)?;
    let cargo_home = match std::env::var_os("CARGO_HOME") {
        Some(home) => PathBuf::from(home),
        None => PathBuf::from(std::env::var_os("HOME").context("HOME is not set")?).join(".cargo"),
    };
    let destination = cargo_home.join("bin").join("mistralrs");
    std::fs::create_dir_all(cargo_home.join("bin"))?;
    std::fs::copy(host_binary(options), &destination)
        .with_context(|| format!("installing into {}", destination.display()))?;
    println!("xtask: installed {}", destination.display());
    Ok(())
}
