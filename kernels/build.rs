//! With the `cuda` feature, compiles `src/cuda/*.cu` with nvcc into the static
//! library `libberrylmkernels.a` in OUT_DIR and links it, plus `cudart`
//! (dynamic) and `stdc++`. Without the feature it does nothing.
//!
//! Environment:
//! * `CUDA_COMPUTE_CAP`: target compute capability (default 90, built as
//!   `sm_90a` with `compute_90a` PTX);
//! * `NVCC`: the nvcc to run (default `$CUDA_HOME/bin/nvcc`, else `nvcc`);
//! * `CUDA_HOME` / `CUDA_PATH`: toolkit root, for the cudart link search.
//!
//! Every exported symbol of the library is `extern "C"` and starts with
//! `berrylm_`, so it cannot clash with other CUDA static libraries (such as
//! the host's `libmistralrscuda.a`, whose symbols are unprefixed).
//!
//! The library carries the digest of the sources it was built from
//! (`berrylm_sources_digest`), and `OUT_DIR/cuda_sources.rs` gives the crate
//! the same sources as it compiles, so that a library left from another build
//! (a stale build-script output) is refused at the first launch instead of
//! running kernels whose arguments no longer match their bindings.

#[path = "src/cuda/sources_digest.rs"]
mod sources_digest;

use std::env;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::Command;

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-env-changed=CARGO_FEATURE_CUDA");
    if env::var_os("CARGO_FEATURE_CUDA").is_none() {
        return;
    }
    for var in ["CUDA_COMPUTE_CAP", "NVCC", "CUDA_HOME", "CUDA_PATH"] {
        println!("cargo:rerun-if-env-changed={var}");
    }

    let out_dir = PathBuf::from(env::var("OUT_DIR").expect("OUT_DIR"));
    let source_dir = Path::new("src/cuda");
    println!("cargo:rerun-if-changed={}", source_dir.display());
    // The `.cu` and `.cuh` files, sorted; the `.cu` files are compiled.
    let mut all_files = Vec::new();
    for entry in std::fs::read_dir(source_dir).expect("read src/cuda") {
        let path = entry.expect("src/cuda entry").path();
        if matches!(
            path.extension().and_then(|e| e.to_str()),
            Some("cu" | "cuh")
        ) {
            println!("cargo:rerun-if-changed={}", path.display());
            all_files.push(path);
        }
    }
    all_files.sort();
    let sources: Vec<&PathBuf> = all_files
        .iter()
        .filter(|path| path.extension().is_some_and(|e| e == "cu"))
        .collect();
    let digest = write_source_list(&all_files, &out_dir);

    let cuda_home = env::var_os("CUDA_HOME")
        .or_else(|| env::var_os("CUDA_PATH"))
        .map(PathBuf::from);
    let nvcc = env::var_os("NVCC")
        .map(PathBuf::from)
        .or_else(|| {
            cuda_home
                .as_ref()
                .map(|home| home.join("bin").join("nvcc"))
                .filter(|p| p.exists())
        })
        .unwrap_or_else(|| PathBuf::from("nvcc"));

    let cap = env::var("CUDA_COMPUTE_CAP")
        .ok()
        .map(|s| s.trim().replace('.', ""))
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| "90".to_string());
    let cap = cap.trim_start_matches("sm_").trim_start_matches("compute_");
    // Hopper (and later arch-specific targets) get the `a` variant.
    let arch = match cap {
        "90" | "90a" => "90a".to_string(),
        other => other.to_string(),
    };
    let gencode = format!("arch=compute_{arch},code=[sm_{arch},compute_{arch}]");
    // Kernels with Hopper's warpgroup MMAs exist only for sm_90a.
    let wgmma = format!("-DBERRYLM_WGMMA={}", u8::from(arch == "90a"));

    // No --use_fast_math: the kernels reproduce the CPU reference's rounding
    // (IEEE division/sqrt, accurate expf/log1pf/tanh, no flush to zero).
    let mut objects = Vec::new();
    for source in sources {
        let stem = source.file_stem().unwrap().to_string_lossy().to_string();
        let object = out_dir.join(format!("berrylm_{stem}.o"));
        run(Command::new(&nvcc)
            .arg("-c")
            .arg(source)
            .arg("-o")
            .arg(&object)
            .args(["-O3", "-std=c++17", "--expt-relaxed-constexpr"])
            .args(["-Xcompiler", "-fPIC"])
            .arg("-gencode")
            .arg(&gencode)
            .arg(&wgmma)
            .arg(format!("-DBERRYLM_SOURCES_DIGEST={digest:#018x}ull"))
            .arg("-I")
            .arg(source_dir));
        objects.push(object);
    }
    let library = out_dir.join("libberrylmkernels.a");
    let _ = std::fs::remove_file(&library);
    run(Command::new(&nvcc)
        .arg("--lib")
        .arg("-o")
        .arg(&library)
        .args(&objects));

    println!("cargo:rustc-link-search=native={}", out_dir.display());
    println!("cargo:rustc-link-lib=static=berrylmkernels");
    if let Some(home) = &cuda_home {
        for lib in ["lib64", "lib", "targets/x86_64-linux/lib"] {
            let dir = home.join(lib);
            if dir.is_dir() {
                println!("cargo:rustc-link-search=native={}", dir.display());
            }
        }
    }
    println!("cargo:rustc-link-lib=dylib=cudart");
    println!("cargo:rustc-link-lib=dylib=stdc++");
}

/// The digest of `files` (`sources_digest`), and `OUT_DIR/cuda_sources.rs`:
/// the constant `CUDA_SOURCES`, each file's name and its contents as the
/// crate is compiled (`include_bytes!`, which also recompiles the crate when
/// a file changes).
fn write_source_list(files: &[PathBuf], out_dir: &Path) -> u64 {
    let named: Vec<(String, Vec<u8>)> = files
        .iter()
        .map(|path| {
            let name = path.file_name().unwrap().to_string_lossy().into_owned();
            let contents = std::fs::read(path).unwrap_or_else(|e| panic!("read {path:?}: {e}"));
            (name, contents)
        })
        .collect();
    let digest = sources_digest::sources_digest(
        named
            .iter()
            .map(|(name, contents)| (name.as_str(), contents.as_slice())),
    );
    let mut list = format!(
        "/// The CUDA sources, by file name, as this crate was compiled.\n\
         const CUDA_SOURCES: [(&str, &[u8]); {}] = [\n",
        files.len()
    );
    for (path, (name, _)) in files.iter().zip(&named) {
        let absolute = std::fs::canonicalize(path).unwrap_or_else(|e| panic!("{path:?}: {e}"));
        writeln!(
            list,
            "    ({name:?}, include_bytes!({:?})),",
            absolute.display().to_string()
        )
        .expect("format the source list");
    }
    list.push_str("];\n");
    std::fs::write(out_dir.join("cuda_sources.rs"), list).expect("write cuda_sources.rs");
    digest
}

fn run(command: &mut Command) {
    let status = command
        .status()
        .unwrap_or_else(|e| panic!("failed to run {command:?}: {e}"));
    assert!(status.success(), "{command:?} failed with {status}");
}
