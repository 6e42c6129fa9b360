//! What the tests on the real pinned host sources share.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use xtask::host::{pristine_sources, Repo};
use xtask::seam::Seam;

/// The repository's seam (`host/seam.toml` and its folder) and the pristine
/// host crates it applies to.
pub struct PinnedHost {
    pub seam: Seam,
    pub seam_dir: PathBuf,
    pub pristine: BTreeMap<String, PathBuf>,
}

pub fn pinned_host() -> PinnedHost {
    let repo = Repo::locate().expect("repo");
    let seam = Seam::load(&repo.seam_file()).expect("seam.toml");
    let pristine = pristine_sources(&repo, &seam).expect("pristine sources");
    let seam_dir = repo.seam_file().parent().expect("host/").to_path_buf();
    PinnedHost {
        seam,
        seam_dir,
        pristine,
    }
}

/// Copies the tree `from` to `to`, creating `to`.
pub fn copy_tree(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).expect("mkdir");
    for entry in std::fs::read_dir(from).expect("read pristine") {
        let entry = entry.expect("entry");
        let target = to.join(entry.file_name());
        if entry.file_type().expect("type").is_dir() {
            copy_tree(&entry.path(), &target);
        } else {
            std::fs::copy(entry.path(), &target).expect("copy");
        }
    }
}

/// An empty folder `berrylm-{test}-{name}-{pid}` in the temporary folder.
pub fn scratch(test: &str, name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("berrylm-{test}-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("scratch dir");
    dir
}
