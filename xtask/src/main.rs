use std::ffi::OsStr;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode, Stdio};

use anyhow::{bail, Context, Result};
use clap::{Parser, Subcommand};
use xtask::host::{self, Repo};
use xtask::{cargo, target_dir};

/// The project's commands: preparing the patched mistral.rs host, building it
/// with the berrylm plugin, testing, serving and installing.
#[derive(Debug, Parser)]
#[command(name = "cargo xtask", bin_name = "cargo xtask")]
struct Cli {
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Debug, Subcommand)]
enum Cmd {
    /// Apply the host seam to the pinned mistral.rs sources (.host/)
    Prepare,
    /// Build the host CLI with the berrylm plugin (release)
    Build(BuildOptions),
    /// Prepare, build and run every test of the workspace
    Test,
    /// Build and run `mistralrs serve` on 127.0.0.1
    Serve(ServeOptions),
    /// Build and install the `mistralrs` binary with berrylm into $CARGO_HOME/bin
    Install(BuildOptions),
    /// Print the OpenAI assistant message the server returns for a raw BerryLM
    /// output read from stdin
    Parse(xtask::parse::ParseOptions),
    /// Build, then report how closely berrylm reproduces a golden file's
    /// reference outputs (docs/alignment.md)
    ///
    /// Every argument goes to `berrylm-align` unchanged (`cargo xtask align
    /// --help` shows its options): `--model DIR --golden FILE [--dtype
    /// f32|bf16|f16] [--device cpu|cuda] [--json OUT] [--dump OUT]`. `--device
    /// cuda` builds with CUDA.
    #[command(disable_help_flag = true)]
    Align(ToolArgs),
    /// Build, then measure prefill/decode throughput, per-kernel times and the
    /// decode weight-read floor on a random BerryLM-OS-shaped model
    ///
    /// Every argument goes to `berrylm-bench` unchanged (`cargo xtask bench
    /// --help` shows its options): `[--device cpu|cuda] [--dtype bf16|f32]
    /// [--layers N] [--tiny] [--prefill LIST] [--decode LIST] [--json OUT]
    /// ...`. `--device cuda` builds with CUDA.
    #[command(disable_help_flag = true)]
    Bench(ToolArgs),
    /// Write the host seam as a series of patches against the pristine host crates
    Seam(SeamOptions),
}

#[derive(Debug, Default, clap::Args)]
struct BuildOptions {
    /// Build with CUDA; `build --cuda` also writes stripped standalone
    /// executables for the GPU machine in <target>-cuda/standalone
    #[arg(long)]
    cuda: bool,
}

#[derive(Debug, clap::Args)]
struct ServeOptions {
    /// The model folder (default: the bundled trained-tiny BerryLM)
    #[arg(long, value_name = "DIR")]
    model: Option<PathBuf>,
    /// The port to listen on
    #[arg(long, value_name = "P", default_value_t = 1234)]
    port: u16,
    /// Build and serve with CUDA
    #[arg(long)]
    cuda: bool,
    /// Arguments for `mistralrs serve`, after `--`
    #[arg(last = true, value_name = "HOST_ARGS")]
    host_args: Vec<String>,
}

#[derive(Debug, clap::Args)]
struct ToolArgs {
    /// The tool's arguments, passed on unchanged
    #[arg(
        trailing_var_arg = true,
        allow_hyphen_values = true,
        value_name = "ARGS"
    )]
    args: Vec<String>,
}

#[derive(Debug, clap::Args)]
struct SeamOptions {
    /// Write one unified diff per group of host/seam.toml into DIR
    /// (0001-<group>.patch, ...), to apply in order with `patch -p1` in a folder
    /// holding the pristine crates as .host/ does; writes nothing else
    #[arg(long, value_name = "DIR")]
    patches: PathBuf,
}

/// The bundled default model (the trained tiny BerryLM, vendored with the test fixtures).
const BUNDLED_MODEL: &str = "tests/fixtures/trained-tiny/model";

fn main() -> ExitCode {
    let cli = Cli::parse();
    match run(cli.command) {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("xtask: error: {error:#}");
            ExitCode::FAILURE
        }
    }
}

fn run(command: Cmd) -> Result<()> {
    let repo = Repo::locate()?;
    match command {
        Cmd::Prepare => host::prepare(&repo),
        Cmd::Build(options) => {
            host::prepare(&repo)?;
            build_workspace(&repo, &options)?;
            if options.cuda {
                write_standalone(&options)?;
            }
            Ok(())
        }
        Cmd::Test => test(&repo),
        Cmd::Serve(options) => serve(&repo, options),
        Cmd::Install(options) => install(&repo, &options),
        Cmd::Parse(options) => xtask::parse::run(&options),
        Cmd::Align(tool) => run_built_tool(&repo, "berrylm-align", &tool.args),
        Cmd::Bench(tool) => run_built_tool(&repo, "berrylm-bench", &tool.args),
        Cmd::Seam(options) => {
            let written = xtask::series::write(&repo, &options.patches)?;
            println!(
                "xtask: {} patches of the host seam in {}",
                written.len(),
                options.patches.display()
            );
            for path in written {
                println!(
                    "  {}",
                    path.file_name().unwrap_or_default().to_string_lossy()
                );
            }
            Ok(())
        }
    }
}

impl BuildOptions {
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
    if options.cuda {
        check_cuda_toolkit(std::env::var_os("PATH").as_deref())?;
    }
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

/// Fails, saying how to set one up, unless `nvcc` runs from the directories
/// of `path` (a `PATH` value): the CUDA build compiles kernels with it, and
/// without it cudarc's build script panics minutes into the build.
fn check_cuda_toolkit(path: Option<&OsStr>) -> Result<()> {
    let mut nvcc = Command::new("nvcc");
    nvcc.arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    match path {
        Some(path) => nvcc.env("PATH", path),
        None => nvcc.env_remove("PATH"),
    };
    if nvcc.status().is_ok_and(|status| status.success()) {
        return Ok(());
    }
    bail!(
        "the CUDA build needs a CUDA toolkit's `nvcc` on PATH; on a machine without one, \
         `cargo xtask prepare && cargo fetch`, then `. kernels/cuda-env.sh` in this shell \
         (kernels/CUDA.md)"
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
    run_step(
        "testing the step timeline and token golden tools \
         (tools/test_timeline_and_token_golden.py, standard library only)",
        Command::new("python3")
            .current_dir(&repo.root)
            .args(["tools/test_timeline_and_token_golden.py", "-v"]),
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

fn serve(repo: &Repo, serve: ServeOptions) -> Result<()> {
    let model = serve.model.unwrap_or_else(|| repo.root.join(BUNDLED_MODEL));
    let port = serve.port.to_string();
    let options = BuildOptions { cuda: serve.cuda };
    let host_args = serve.host_args;
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

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    /// A CUDA build is refused, naming the setup script, when no `nvcc`
    /// runs from PATH, and goes ahead when one does.
    #[test]
    fn the_cuda_build_needs_nvcc_on_path() {
        use std::os::unix::fs::PermissionsExt;
        let dir = std::env::temp_dir().join(format!("xtask-nvcc-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("a temporary folder");
        let error = check_cuda_toolkit(Some(dir.as_os_str())).expect_err("no nvcc there");
        assert!(error.to_string().contains("kernels/cuda-env.sh"), "{error}");
        let nvcc = dir.join("nvcc");
        std::fs::write(&nvcc, "#!/bin/sh\nexit 0\n").expect("a stand-in nvcc");
        std::fs::set_permissions(&nvcc, std::fs::Permissions::from_mode(0o755)).expect("mode");
        let result = check_cuda_toolkit(Some(dir.as_os_str()));
        std::fs::remove_dir_all(&dir).expect("cleaned up");
        result.expect("an nvcc that runs");
    }

    fn parse(args: &[&str]) -> Result<Cmd, clap::Error> {
        Cli::try_parse_from(std::iter::once("cargo xtask").chain(args.iter().copied()))
            .map(|cli| cli.command)
    }

    fn tool_args(command: Cmd) -> Vec<String> {
        match command {
            Cmd::Align(tool) | Cmd::Bench(tool) => tool.args,
            other => panic!("not a tool command: {other:?}"),
        }
    }

    fn strings(args: &[&str]) -> Vec<String> {
        args.iter().map(|a| a.to_string()).collect()
    }

    #[test]
    fn the_command_line_is_consistent() {
        Cli::command().debug_assert();
    }

    /// Every invocation the README, docs/, tools/ and .ci/ show.
    #[test]
    fn the_documented_invocations_parse() {
        assert!(matches!(parse(&["prepare"]), Ok(Cmd::Prepare)));
        assert!(matches!(parse(&["test"]), Ok(Cmd::Test)));
        for (args, cuda) in [(&["build"][..], false), (&["build", "--cuda"][..], true)] {
            let parsed = parse(args);
            assert!(matches!(parsed, Ok(Cmd::Build(BuildOptions { cuda: c })) if c == cuda));
        }
        for (args, cuda) in [
            (&["install"][..], false),
            (&["install", "--cuda"][..], true),
        ] {
            let parsed = parse(args);
            assert!(matches!(parsed, Ok(Cmd::Install(BuildOptions { cuda: c })) if c == cuda));
        }

        let Ok(Cmd::Serve(serve)) = parse(&["serve"]) else {
            panic!("serve")
        };
        assert_eq!((serve.model, serve.port, serve.cuda), (None, 1234, false));
        assert!(serve.host_args.is_empty());
        let Ok(Cmd::Serve(serve)) = parse(&["serve", "--cuda"]) else {
            panic!("serve --cuda")
        };
        assert!(serve.cuda);
        let Ok(Cmd::Serve(serve)) = parse(&[
            "serve", "--model", "DIR", "--port", "8080", "--", "--dtype", "f32",
        ]) else {
            panic!("serve with host args")
        };
        assert_eq!(serve.model, Some(PathBuf::from("DIR")));
        assert_eq!(serve.port, 8080);
        assert_eq!(serve.host_args, strings(&["--dtype", "f32"]));

        let Ok(Cmd::Parse(options)) = parse(&[
            "parse",
            "--tools",
            "tools.json",
            "--no-thinking",
            "--stream",
        ]) else {
            panic!("parse")
        };
        assert_eq!(options.tools, Some(PathBuf::from("tools.json")));
        assert!(!options.thinking_enabled() && options.stream);
        let Ok(Cmd::Parse(options)) = parse(&["parse"]) else {
            panic!("parse")
        };
        assert!(options.tools.is_none() && options.thinking_enabled() && !options.stream);

        let Ok(Cmd::Seam(seam)) = parse(&["seam", "--patches", "/tmp/series"]) else {
            panic!("seam")
        };
        assert_eq!(seam.patches, PathBuf::from("/tmp/series"));
    }

    #[test]
    fn align_and_bench_pass_every_argument_on_unchanged() {
        for args in [
            &[
                "--model", "DIR", "--golden", "FILE", "--device", "cuda", "--dtype", "bf16",
            ][..],
            &[
                "--model", "DIR", "--golden", "FILE", "--json", "r.json", "--dump", "o.st",
            ],
            &["--device=cuda", "--help"],
            &["-h"],
            &["--help"],
            &[],
            &["--tiny", "--", "x"],
        ] {
            for command in ["align", "bench"] {
                let mut line = vec![command];
                line.extend(args);
                assert_eq!(tool_args(parse(&line).unwrap()), strings(args), "{line:?}");
            }
        }
        let bench = [
            "bench",
            "--device",
            "cpu",
            "--tiny",
            "--layers",
            "2",
            "--prefill",
            "64",
            "--decode",
            "1,2",
            "--dtype",
            "f32",
        ];
        assert_eq!(tool_args(parse(&bench).unwrap()), strings(&bench[1..]));
        // A leading `--` is clap's end of options (the tools take no `--`).
        assert_eq!(
            tool_args(parse(&["bench", "--", "--tiny"]).unwrap()),
            strings(&["--tiny"])
        );
    }

    #[test]
    fn wrong_arguments_are_clap_errors() {
        use clap::error::ErrorKind;
        let kind = |args: &[&str]| parse(args).expect_err("must not parse").kind();
        assert_eq!(kind(&["frob"]), ErrorKind::InvalidSubcommand);
        assert_eq!(kind(&["build", "--frob"]), ErrorKind::UnknownArgument);
        assert_eq!(kind(&["test", "--cuda"]), ErrorKind::UnknownArgument);
        assert_eq!(
            kind(&["serve", "--port", "http"]),
            ErrorKind::ValueValidation
        );
        assert_eq!(kind(&["serve", "--model"]), ErrorKind::InvalidValue);
        assert_eq!(
            kind(&["serve", "--dtype", "f32"]),
            ErrorKind::UnknownArgument
        );
        assert_eq!(kind(&["parse", "--tools"]), ErrorKind::InvalidValue);
        assert_eq!(kind(&["seam"]), ErrorKind::MissingRequiredArgument);
        assert_eq!(
            kind(&[]),
            ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand
        );
        assert_eq!(kind(&["--help"]), ErrorKind::DisplayHelp);
        assert_eq!(kind(&["serve", "--help"]), ErrorKind::DisplayHelp);
    }
}
