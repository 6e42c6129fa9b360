//! The seam tool on the real pinned host sources: it applies cleanly, and a
//! copy of the sources with one anchor line altered fails with a message that
//! names the edit and the host version.

mod common;

use std::collections::BTreeMap;

use common::{copy_tree, pinned_host, scratch};
use xtask::seam;

#[test]
fn the_seam_applies_to_the_pinned_host_and_reapplying_writes_nothing() {
    let host = pinned_host();
    let (seam, seam_dir, pristine) = (&host.seam, &host.seam_dir, &host.pristine);
    let out = scratch("seam", "apply");
    let first = seam::apply(seam, seam_dir, pristine, &out).expect("seam applies");
    assert_eq!(first.edits_applied, seam.edits.len());
    assert!(first.files_written > 0);
    let second = seam::apply(seam, seam_dir, pristine, &out).expect("seam re-applies");
    assert_eq!(second.files_written, 0, "re-applying rewrote files");
    let lib = std::fs::read_to_string(out.join("mistralrs-core/src/lib.rs")).expect("lib.rs");
    assert!(lib.contains("pub mod plugin_api;"));
    std::fs::remove_dir_all(&out).expect("cleanup");
}

#[test]
fn an_altered_anchor_line_names_the_edit_and_the_host_version() {
    let host = pinned_host();

    // A copy of the host sources in which one anchor line was changed, as a
    // new host release would change it.
    let altered_root = scratch("seam", "altered");
    let mut altered = BTreeMap::new();
    for (name, path) in &host.pristine {
        let copy = altered_root.join(name);
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

    let out = scratch("seam", "altered-out");
    let error = seam::apply(&host.seam, &host.seam_dir, &altered, &out)
        .expect_err("the seam must not apply to altered sources")
        .to_string();
    assert!(error.contains("mistralrs-core 0.8.1"), "{error}");
    assert!(error.contains("declare the plugin_api module"), "{error}");
    assert!(error.contains("src/lib.rs"), "{error}");
    assert!(error.contains("found it 0 times"), "{error}");
    std::fs::remove_dir_all(&altered_root).expect("cleanup");
    let _ = std::fs::remove_dir_all(&out);
}
