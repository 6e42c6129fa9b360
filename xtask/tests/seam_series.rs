//! `cargo xtask seam --patches DIR` on the real pinned host sources: the
//! series, applied in order with `patch -p1` to a copy of the pristine crates,
//! gives exactly what `cargo xtask prepare` writes, file for file, byte for byte.

mod common;

use std::process::Command;

use common::{copy_tree, pinned_host, scratch};
use xtask::host::Repo;
use xtask::{seam, series};

/// GNU patch (or another `patch`) on PATH.
fn patch_available() -> bool {
    Command::new("patch")
        .arg("--version")
        .output()
        .is_ok_and(|output| output.status.success())
}

#[test]
fn the_patch_series_applied_in_order_gives_what_prepare_writes() {
    if !patch_available() {
        eprintln!(
            "SKIPPED the_patch_series_applied_in_order_gives_what_prepare_writes: `patch` is not \
             installed (it applies the series as a reviewer would)"
        );
        return;
    }
    let repo = Repo::locate().expect("repo");
    let host = pinned_host();
    let (seam, pristine) = (&host.seam, &host.pristine);
    let seam_text = std::fs::read_to_string(repo.seam_file()).expect("seam.toml");
    let groups = series::groups(&seam_text, seam.edits.len()).expect("groups");

    // The series, written by the command's own function into a folder that
    // already holds a stale patch of an earlier series and a file of the user's.
    let series_dir = scratch("series", "patches");
    std::fs::write(series_dir.join("0099-stale.patch"), "stale").expect("stale patch");
    std::fs::write(series_dir.join("notes.txt"), "mine").expect("user file");
    let written = series::write(&repo, &series_dir).expect("the series is written");
    assert_eq!(written.len(), groups.len(), "one patch per group");
    assert!(
        !series_dir.join("0099-stale.patch").exists(),
        "stale patch kept"
    );
    assert!(
        series_dir.join("notes.txt").exists(),
        "a file not of a series was removed"
    );
    for (index, (path, group)) in written.iter().zip(&groups).enumerate() {
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        assert_eq!(
            name,
            format!("{:04}-{}.patch", index + 1, series::slug(&group.title))
        );
        let text = std::fs::read_to_string(path).expect("patch");
        let mut lines = text.lines();
        assert_eq!(lines.next(), Some(group.title.as_str()), "{name}: title");
        assert_eq!(lines.next(), Some(""), "{name}");
        assert!(
            lines
                .next()
                .is_some_and(|l| !l.is_empty() && !l.starts_with("--- ")),
            "{name}: the patch must open with its group's description"
        );
    }

    // The pristine crates, laid out as .host/ is, patched in order.
    let patched = scratch("series", "patched");
    for (name, path) in pristine {
        copy_tree(path, &patched.join(name));
    }
    for path in &written {
        let output = Command::new("patch")
            .args(["-p1", "--batch", "--forward", "--fuzz=0", "-i"])
            .arg(path)
            .current_dir(&patched)
            .output()
            .expect("running patch");
        let report = format!(
            "{}{}",
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        );
        assert!(
            output.status.success(),
            "{} does not apply:\n{report}",
            path.display()
        );
        for line in report.lines() {
            assert!(
                line.starts_with("patching file "),
                "{} applied with a remark (offset, fuzz, ...): {line}",
                path.display()
            );
        }
    }

    // What `cargo xtask prepare` writes (the same function, another folder).
    let prepared = scratch("series", "prepared");
    seam::apply(seam, &host.seam_dir, pristine, &prepared).expect("the seam applies");

    let patched_files = seam::read_tree(&patched).expect("read patched");
    let prepared_files = seam::read_tree(&prepared).expect("read prepared");
    let only_patched: Vec<_> = patched_files
        .keys()
        .filter(|k| !prepared_files.contains_key(*k))
        .collect();
    let only_prepared: Vec<_> = prepared_files
        .keys()
        .filter(|k| !patched_files.contains_key(*k))
        .collect();
    assert!(
        only_patched.is_empty() && only_prepared.is_empty(),
        "files only after patching: {only_patched:?}; only after prepare: {only_prepared:?}"
    );
    let differing: Vec<_> = prepared_files
        .iter()
        .filter(|(path, bytes)| patched_files[*path] != **bytes)
        .map(|(path, _)| path)
        .collect();
    assert!(
        differing.is_empty(),
        "files that differ from what prepare writes: {differing:?}"
    );
    assert!(prepared_files.len() > 100, "the comparison saw the crates");

    for dir in [series_dir, patched, prepared] {
        std::fs::remove_dir_all(dir).expect("cleanup");
    }
}
