//! Applies the host seam (`host/seam.toml`) to pristine host crate sources.
//!
//! Each edit is located by an anchor that must occur exactly once in the
//! pristine file (or exactly `occurrences` times, for a `replace` that changes
//! every use of one construct). Output files are written only when their content changes, so
//! re-applying an unchanged seam touches nothing and cargo rebuilds nothing.

use std::collections::BTreeMap;
use std::fmt;
use std::fs;
use std::path::{Path, PathBuf};

use serde::Deserialize;

#[derive(Debug, Deserialize)]
pub struct Seam {
    pub host_version: String,
    #[serde(rename = "crate")]
    pub crates: Vec<SeamCrate>,
    #[serde(rename = "edit")]
    pub edits: Vec<Edit>,
}

#[derive(Debug, Deserialize)]
pub struct SeamCrate {
    pub name: String,
    pub new_files: Vec<NewFile>,
}

#[derive(Debug, Deserialize)]
pub struct NewFile {
    /// Destination inside the host crate.
    pub path: String,
    /// Source, relative to the seam file's folder.
    pub source: String,
    /// The group (the concern, as its header in `seam.toml` names it) whose
    /// patch adds the file (`cargo xtask seam --patches`).
    #[serde(default)]
    pub group: Option<String>,
}

#[derive(Debug, Deserialize)]
pub struct Edit {
    pub name: String,
    #[serde(rename = "crate")]
    pub crate_name: String,
    pub file: String,
    pub anchor: String,
    pub kind: EditKind,
    pub text: String,
    /// How many times the anchor must occur; every occurrence is replaced.
    /// More than one is allowed only for `replace`.
    #[serde(default = "one")]
    pub occurrences: usize,
}

fn one() -> usize {
    1
}

#[derive(Debug, Clone, Copy, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum EditKind {
    InsertBefore,
    InsertAfter,
    Replace,
}

/// An edit whose anchor does not occur the expected number of times.
#[derive(Debug)]
pub struct AnchorMismatch {
    pub edit: String,
    pub crate_name: String,
    pub host_version: String,
    pub file: String,
    pub expected: usize,
    pub found: usize,
    pub anchor: String,
}

/// Why the seam could not be applied.
#[derive(Debug)]
pub enum SeamError {
    Anchor(Box<AnchorMismatch>),
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    Invalid(String),
}

impl fmt::Display for SeamError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SeamError::Anchor(mismatch) => {
                let AnchorMismatch {
                    edit,
                    crate_name,
                    host_version,
                    file,
                    expected,
                    found,
                    anchor,
                } = mismatch.as_ref();
                let expected = match expected {
                    1 => "exactly once".to_string(),
                    n => format!("exactly {n} times"),
                };
                write!(
                f,
                "host seam does not fit {crate_name} {host_version}: edit \"{edit}\" expects its anchor \
                 {expected} in {file}, found it {found} times. The host sources changed; port the \
                 edit (docs/host-seam.md, \"Porting\"). Anchor:\n{anchor}"
                )
            }
            SeamError::Io { path, source } => write!(f, "{}: {source}", path.display()),
            SeamError::Invalid(message) => write!(f, "host/seam.toml: {message}"),
        }
    }
}

impl std::error::Error for SeamError {}

fn io_error(path: &Path) -> impl FnOnce(std::io::Error) -> SeamError + '_ {
    move |source| SeamError::Io {
        path: path.to_path_buf(),
        source,
    }
}

impl Seam {
    pub fn load(path: &Path) -> Result<Seam, SeamError> {
        let text = fs::read_to_string(path).map_err(io_error(path))?;
        toml::from_str(&text).map_err(|e| SeamError::Invalid(e.to_string()))
    }
}

fn anchor_mismatch(edit: &Edit, host_version: &str, found: usize) -> SeamError {
    SeamError::Anchor(Box::new(AnchorMismatch {
        edit: edit.name.clone(),
        crate_name: edit.crate_name.clone(),
        host_version: host_version.to_string(),
        file: edit.file.clone(),
        expected: edit.occurrences,
        found,
        anchor: edit.anchor.clone(),
    }))
}

/// Applies one edit to `content`, checking that its anchor occurs exactly
/// `edit.occurrences` times (once, unless stated).
pub fn apply_edit(content: &str, edit: &Edit, host_version: &str) -> Result<String, SeamError> {
    if edit.occurrences != 1 && edit.kind != EditKind::Replace {
        return Err(SeamError::Invalid(format!(
            "edit \"{}\": only a `replace` may expect its anchor more than once",
            edit.name
        )));
    }
    let found = content.matches(edit.anchor.as_str()).count();
    if found != edit.occurrences {
        return Err(anchor_mismatch(edit, host_version, found));
    }
    let text = edit.text.trim_start_matches('\n');
    let start = content
        .find(edit.anchor.as_str())
        .ok_or_else(|| anchor_mismatch(edit, host_version, found))?;
    let end = start + edit.anchor.len();
    let mut out = String::with_capacity(content.len() + text.len() + 1);
    match edit.kind {
        EditKind::Replace => out = content.replace(edit.anchor.as_str(), text),
        EditKind::InsertBefore => {
            let line_start = content[..start].rfind('\n').map_or(0, |i| i + 1);
            out.push_str(&content[..line_start]);
            out.push_str(text);
            if !text.ends_with('\n') {
                out.push('\n');
            }
            out.push_str(&content[line_start..]);
        }
        EditKind::InsertAfter => {
            let line_end = content[end..]
                .find('\n')
                .map_or(content.len(), |i| end + i + 1);
            out.push_str(&content[..line_end]);
            if !content[..line_end].ends_with('\n') {
                out.push('\n');
            }
            out.push_str(text);
            if !text.ends_with('\n') {
                out.push('\n');
            }
            out.push_str(&content[line_end..]);
        }
    }
    Ok(out)
}

/// What `apply` did.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct ApplyReport {
    pub files_written: usize,
    pub edits_applied: usize,
}

/// One host crate's files: path inside the crate, content.
pub type Files = BTreeMap<PathBuf, Vec<u8>>;

/// Every file under `root`, keyed by its path relative to `root`.
pub fn read_tree(root: &Path) -> Result<Files, SeamError> {
    let mut files = Files::new();
    collect_files(root, root, &mut files)?;
    Ok(files)
}

/// Applies `edits` (edits of one crate, in the seam's order) to that crate's `files`.
pub fn apply_edits<'a>(
    files: &mut Files,
    edits: impl IntoIterator<Item = &'a Edit>,
    host_version: &str,
) -> Result<usize, SeamError> {
    let mut applied = 0;
    for edit in edits {
        let key = PathBuf::from(&edit.file);
        let bytes = files
            .get(&key)
            .ok_or_else(|| anchor_mismatch(edit, host_version, 0))?;
        let content = String::from_utf8_lossy(bytes).into_owned();
        let patched = apply_edit(&content, edit, host_version)?;
        files.insert(key, patched.into_bytes());
        applied += 1;
    }
    Ok(applied)
}

/// The content of a new file, read from its source beside the seam file.
pub fn new_file_content(seam_dir: &Path, new_file: &NewFile) -> Result<Vec<u8>, SeamError> {
    let source = seam_dir.join(&new_file.source);
    fs::read(&source).map_err(io_error(&source))
}

/// One host crate's files with the seam applied (its edits, then its new
/// files), and how many edits that took.
pub fn render_crate(
    seam: &Seam,
    host_crate: &SeamCrate,
    seam_dir: &Path,
    pristine: &BTreeMap<String, PathBuf>,
) -> Result<(Files, usize), SeamError> {
    let source_root = pristine
        .get(&host_crate.name)
        .ok_or_else(|| SeamError::Invalid(format!("no pristine source for {}", host_crate.name)))?;
    let mut files = read_tree(source_root)?;
    let edits = seam
        .edits
        .iter()
        .filter(|e| e.crate_name == host_crate.name);
    let applied = apply_edits(&mut files, edits, &seam.host_version)?;
    for new_file in &host_crate.new_files {
        let bytes = new_file_content(seam_dir, new_file)?;
        files.insert(PathBuf::from(&new_file.path), bytes);
    }
    Ok((files, applied))
}

/// Writes `pristine` (one folder per host crate, named like the crate) with the
/// seam applied into `out` (same layout). `seam_dir` is where new-file sources live.
pub fn apply(
    seam: &Seam,
    seam_dir: &Path,
    pristine: &BTreeMap<String, PathBuf>,
    out: &Path,
) -> Result<ApplyReport, SeamError> {
    let mut report = ApplyReport::default();
    for host_crate in &seam.crates {
        let (generated, applied) = render_crate(seam, host_crate, seam_dir, pristine)?;
        report.edits_applied += applied;
        let out_root = out.join(&host_crate.name);
        for (relative, bytes) in &generated {
            let target = out_root.join(relative);
            if fs::read(&target).ok().as_deref() == Some(bytes.as_slice()) {
                continue;
            }
            if let Some(parent) = target.parent() {
                fs::create_dir_all(parent).map_err(io_error(parent))?;
            }
            fs::write(&target, bytes).map_err(io_error(&target))?;
            report.files_written += 1;
        }
    }
    Ok(report)
}

fn collect_files(root: &Path, dir: &Path, files: &mut Files) -> Result<(), SeamError> {
    for entry in fs::read_dir(dir).map_err(io_error(dir))? {
        let entry = entry.map_err(io_error(dir))?;
        let path = entry.path();
        let file_type = entry.file_type().map_err(io_error(&path))?;
        if file_type.is_dir() {
            collect_files(root, &path, files)?;
        } else if file_type.is_file() {
            let bytes = fs::read(&path).map_err(io_error(&path))?;
            let relative = path
                .strip_prefix(root)
                .map_err(|e| SeamError::Invalid(e.to_string()))?
                .to_path_buf();
            files.insert(relative, bytes);
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn edit(anchor: &str, kind: EditKind, text: &str) -> Edit {
        Edit {
            name: "test edit".into(),
            crate_name: "host-crate".into(),
            file: "src/lib.rs".into(),
            anchor: anchor.into(),
            kind,
            text: text.into(),
            occurrences: 1,
        }
    }

    #[test]
    fn inserts_and_replaces_around_the_anchor_line() {
        let source = "a\n    b();\nc\n";
        let before = apply_edit(source, &edit("b();", EditKind::InsertBefore, "x"), "1").unwrap();
        assert_eq!(before, "a\nx\n    b();\nc\n");
        let after = apply_edit(source, &edit("b();", EditKind::InsertAfter, "y"), "1").unwrap();
        assert_eq!(after, "a\n    b();\ny\nc\n");
        let replaced = apply_edit(source, &edit("b()", EditKind::Replace, "d()"), "1").unwrap();
        assert_eq!(replaced, "a\n    d();\nc\n");
    }

    #[test]
    fn a_missing_or_repeated_anchor_names_the_edit_and_host_version() {
        let missing = apply_edit("a\n", &edit("zzz", EditKind::Replace, ""), "0.8.1").unwrap_err();
        let message = missing.to_string();
        assert!(message.contains("\"test edit\""), "{message}");
        assert!(message.contains("host-crate 0.8.1"), "{message}");
        assert!(message.contains("found it 0 times"), "{message}");
        let repeated =
            apply_edit("b\nb\n", &edit("b", EditKind::Replace, "c"), "0.8.1").unwrap_err();
        assert!(repeated.to_string().contains("found it 2 times"));
    }

    #[test]
    fn a_counted_replace_changes_every_occurrence_and_checks_the_count() {
        let counted = Edit {
            occurrences: 2,
            ..edit("b()", EditKind::Replace, "d()")
        };
        assert_eq!(
            apply_edit("b();\nb();\n", &counted, "1").unwrap(),
            "d();\nd();\n"
        );
        let message = apply_edit("b();\n", &counted, "0.8.1")
            .unwrap_err()
            .to_string();
        assert!(message.contains("exactly 2 times"), "{message}");
        assert!(message.contains("found it 1 times"), "{message}");
        let counted_insert = Edit {
            occurrences: 2,
            ..edit("b()", EditKind::InsertAfter, "x")
        };
        assert!(apply_edit("b();\nb();\n", &counted_insert, "1").is_err());
    }
}
