//! Preparing the host: fetch the pinned crates.io sources and apply the seam.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, Context, Result};

use crate::seam::{self, Seam};

/// Paths of the repository that the host preparation works with.
pub struct Repo {
    pub root: PathBuf,
}

impl Repo {
    pub fn locate() -> Result<Repo> {
        let manifest_dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
        let root = manifest_dir
            .parent()
            .context("xtask must live one folder below the repository root")?
            .to_path_buf();
        Ok(Repo { root })
    }

    pub fn seam_file(&self) -> PathBuf {
        self.root.join("host/seam.toml")
    }

    pub fn generated_host(&self) -> PathBuf {
        self.root.join(".host")
    }
}

/// The cargo registry folder holding unpacked crate sources.
fn registry_sources() -> Result<Vec<PathBuf>> {
    let cargo_home = match std::env::var_os("CARGO_HOME") {
        Some(home) => PathBuf::from(home),
        None => PathBuf::from(std::env::var_os("HOME").context("HOME is not set")?).join(".cargo"),
    };
    let src = cargo_home.join("registry/src");
    let mut dirs = Vec::new();
    if let Ok(entries) = std::fs::read_dir(&src) {
        for entry in entries.flatten() {
            dirs.push(entry.path());
        }
    }
    Ok(dirs)
}

fn find_pristine(name: &str, version: &str) -> Result<Option<PathBuf>> {
    let folder = format!("{name}-{version}");
    Ok(registry_sources()?
        .into_iter()
        .map(|dir| dir.join(&folder))
        .find(|dir| dir.join("Cargo.toml").is_file()))
}

/// Locates (fetching if needed) the pristine sources of every crate the seam edits.
pub fn pristine_sources(repo: &Repo, seam: &Seam) -> Result<BTreeMap<String, PathBuf>> {
    let mut missing = false;
    for host_crate in &seam.crates {
        missing |= find_pristine(&host_crate.name, &seam.host_version)?.is_none();
    }
    if missing {
        println!(
            "xtask: fetching host crates {} from crates.io",
            seam.host_version
        );
        let status = Command::new(crate::cargo())
            .args(["fetch", "--manifest-path"])
            .arg(repo.root.join("host/pristine/Cargo.toml"))
            .status()
            .context("running cargo fetch")?;
        if !status.success() {
            bail!("cargo fetch of the host crates failed (is crates.io reachable?)");
        }
    }
    let mut sources = BTreeMap::new();
    for host_crate in &seam.crates {
        let path = find_pristine(&host_crate.name, &seam.host_version)?.with_context(|| {
            format!(
                "{} {} is not in the cargo registry after fetching",
                host_crate.name, seam.host_version
            )
        })?;
        sources.insert(host_crate.name.clone(), path);
    }
    Ok(sources)
}

/// Applies the seam into `.host/`, writing only what changed.
pub fn prepare(repo: &Repo) -> Result<()> {
    let seam_file = repo.seam_file();
    let seam = Seam::load(&seam_file)?;
    check_registry_version(&repo.root, &seam.host_version)?;
    let pristine = pristine_sources(repo, &seam)?;
    let seam_dir = seam_file.parent().unwrap_or(Path::new("."));
    let report = seam::apply(&seam, seam_dir, &pristine, &repo.generated_host())?;
    println!(
        "xtask: host seam for mistral.rs {}: {} edits, {} files updated",
        seam.host_version, report.edits_applied, report.files_written
    );
    Ok(())
}

/// `registry.toml` names the host version the plugin targets; it must be the seam's.
fn check_registry_version(root: &Path, seam_version: &str) -> Result<()> {
    #[derive(serde::Deserialize)]
    struct Registry {
        host: RegistryHost,
    }
    #[derive(serde::Deserialize)]
    struct RegistryHost {
        version: String,
    }
    let path = root.join("registry.toml");
    let text = std::fs::read_to_string(&path).with_context(|| path.display().to_string())?;
    let registry: Registry = toml::from_str(&text).context("registry.toml")?;
    if registry.host.version != seam_version {
        bail!(
            "registry.toml targets host {} but host/seam.toml is for {}",
            registry.host.version,
            seam_version
        );
    }
    Ok(())
}
