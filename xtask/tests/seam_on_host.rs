//! The seam tool on the real pinned host sources: it applies cleanly, and a
//! copy of the sources with one anchor line altered fails with a message that
//! names the edit and the host version.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use xtask::host::{pristine_sources, Repo};
use xtask::seam::{self, Seam};

fn copy_tree(from: &Path, to: &Path) {
    for entry in std::fs::read_dir(from).expect("read pristine") {
        let entry = entry.expect("entry");
        let target = to.join(entry.file_name());
        if entry.file_type().expect("type").is_dir() {
            std::fs::create_dir_all(&target).expect("mkdir");
            copy_tree(&entry.path(), &target);
        } else {
            std::fs::copy(entry.path(), &target).expect("copy");
        }
    }
}

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("berrylm-seam-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("scratch dir");
    dir
}

#[test]
fn the_seam_applies_to_the_pinned_host_and_reapplying_writes_nothing() {
    let repo = Repo::locate().expect("repo");
    let seam = Seam::load(&repo.seam_file()).expect("seam.toml");
    let pristine = pristine_sources(&repo, &seam).expect("pristine sources");
    let out = scratch("apply");
    let seam_dir = repo.seam_file().parent().expect("host/").to_path_buf();
    let first = seam::apply(&seam, &seam_dir, &pristine, &out).expect("seam applies");
    assert_eq!(first.edits_applied, seam.edits.len());
    assert!(first.files_written > 0);
    let second = seam::apply(&seam, &seam_dir, &pristine, &out).expect("seam re-applies");
    assert_eq!(second.files_written, 0, "re-applying rewrote files");
    let lib = std::fs::read_to_string(out.join("mistralrs-core/src/lib.rs")).expect("lib.rs");
    assert!(lib.contains("pub mod plugin_api;"));
    std::fs::remove_dir_all(&out).expect("cleanup");
}

#[test]
fn an_altered_anchor_line_names_the_edit_and_the_host_version() {
    let repo = Repo::locate().expect("repo");
    let seam = Seam::load(&repo.seam_file()).expect("seam.toml");
    let pristine = pristine_sources(&repo, &seam).expect("pristine sources");

    // A copy of the host sources in which one anchor line was changed, as a
    // new host release would change it.
    let altered_root = scratch("altered");
    let mut altered = BTreeMap::new();
    for (name, path) in &pristine {
        let copy = altered_root.join(name);
        std::fs::create_dir_all(&copy).expect("mkdir");
        copy_tree(path, &copy);
        altered.insert(name.clone(), copy);
    }
    let lib = altered["mistralrs-core"].join("src/lib.rs");
    let text = std::fs::read_to_string(&lib).expect("lib.rs");
    assert_eq!(text.matches("pub mod reasoning_parsers;").count(), 1);
    std::fs::write(
        &lib,
        text.replace("pub mod reasoning_parsers;", "pub mod reasoning;"),
    )
    .expect("alter lib.rs");

    let out = scratch("altered-out");
    let seam_dir = repo.seam_file().parent().expect("host/").to_path_buf();
    let error = seam::apply(&seam, &seam_dir, &altered, &out)
        .expect_err("the seam must not apply to altered sources")
        .to_string();
    assert!(error.contains("mistralrs-core 0.8.1"), "{error}");
    assert!(error.contains("declare the plugin_api module"), "{error}");
    assert!(error.contains("src/lib.rs"), "{error}");
    assert!(error.contains("found it 0 times"), "{error}");
    std::fs::remove_dir_all(&altered_root).expect("cleanup");
    let _ = std::fs::remove_dir_all(&out);
}
