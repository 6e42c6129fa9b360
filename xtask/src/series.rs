//! `cargo xtask seam --patches DIR`: the seam as a series of unified diffs
//! against the pristine host crates, one per group of `host/seam.toml`.
//!
//! The groups are applied cumulatively in memory (each group's edits on top of
//! the previous groups', then the new files of the groups so far) and each
//! patch is the difference between two successive states. Applied in order
//! with `patch -p1` inside a folder that holds the pristine crates laid out as
//! `.host/` is (`mistralrs-core/`, `mistralrs-cli/`, ...), the series gives
//! exactly what `cargo xtask prepare` writes.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;
use std::ops::Range;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use similar::TextDiff;

use crate::host::{self, Repo};
use crate::seam::{self, Files, Seam};

/// Lines of context around each change, as `diff -u`.
const CONTEXT_LINES: usize = 3;

/// Columns the description is wrapped at.
const WRAP: usize = 72;

/// A group of edits: one concern, opened in `seam.toml` by a header line
/// `# ---...--- <title>`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Group {
    pub title: String,
    /// Indices into `Seam::edits`.
    pub edits: Range<usize>,
}

/// A new file of the seam, in the group that adds it.
struct AddedFile {
    crate_name: String,
    path: PathBuf,
    bytes: Vec<u8>,
    /// Its source, relative to the seam file's folder.
    source: String,
}

/// One patch of the series.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Patch {
    /// `0001-<slug>.patch`.
    pub file_name: String,
    pub text: String,
}

/// The title of a group header line (`# ` then at least eight dashes, a space
/// and the title), if `line` is one.
fn header_title(line: &str) -> Option<&str> {
    let rest = line.strip_prefix("# ---------")?;
    let title = rest.trim_start_matches('-').strip_prefix(' ')?.trim();
    (!title.is_empty()).then_some(title)
}

/// The multi-line string delimiter still open at the end of `line`, given the
/// one open at its start (`"""` or `'''`, TOML's multi-line strings).
fn open_string_after(line: &str, mut open: Option<&'static str>) -> Option<&'static str> {
    let mut rest = line;
    loop {
        match open {
            Some(delimiter) => match rest.find(delimiter) {
                Some(at) => {
                    rest = &rest[at + delimiter.len()..];
                    open = None;
                }
                None => return open,
            },
            None => {
                let first = ["\"\"\"", "'''"]
                    .into_iter()
                    .filter_map(|d| rest.find(d).map(|at| (at, d)))
                    .min();
                match first {
                    Some((at, delimiter)) => {
                        rest = &rest[at + delimiter.len()..];
                        open = Some(delimiter);
                    }
                    None => return None,
                }
            }
        }
    }
}

/// The groups of `seam_text` (the text of `seam.toml`, which holds
/// `edit_count` edits), in file order.
pub fn groups(seam_text: &str, edit_count: usize) -> Result<Vec<Group>> {
    let mut groups: Vec<Group> = Vec::new();
    let mut edits = 0;
    let mut open = None;
    for (index, line) in seam_text.lines().enumerate() {
        if open.is_none() {
            if let Some(title) = header_title(line) {
                if groups.iter().any(|g| g.title.eq_ignore_ascii_case(title)) {
                    bail!(
                        "host/seam.toml line {}: a second header for the group \"{title}\"; a \
                         group's edits must stand together under one header",
                        index + 1
                    );
                }
                groups.push(Group {
                    title: title.to_string(),
                    edits: edits..edits,
                });
            } else if line.trim_end() == "[[edit]]" {
                let group = groups.last_mut().with_context(|| {
                    format!(
                        "host/seam.toml line {}: an edit before the first group header \
                         (`# ---------------- <concern>`)",
                        index + 1
                    )
                })?;
                edits += 1;
                group.edits.end = edits;
            }
        }
        open = open_string_after(line, open);
    }
    if edits != edit_count {
        bail!(
            "host/seam.toml: found {edits} `[[edit]]` lines outside strings but the file holds \
             {edit_count} edits"
        );
    }
    Ok(groups)
}

/// `plugin API and architecture registry` -> `plugin-api-and-architecture-registry`.
pub fn slug(title: &str) -> String {
    let mut slug = String::new();
    for c in title.chars() {
        if c.is_ascii_alphanumeric() {
            slug.push(c.to_ascii_lowercase());
        } else if !slug.is_empty() && !slug.ends_with('-') {
            slug.push('-');
        }
    }
    slug.trim_end_matches('-').to_string()
}

/// The section of docs/host-seam.md that describes the groups.
pub const DOCS_SECTION: &str = "## Every edit and why";

/// Each group's description in docs/host-seam.md: under the section
/// [`DOCS_SECTION`], a heading `### <title>` followed by one paragraph.
/// Returns (title, paragraph joined into one line), in the document's order.
pub fn descriptions(docs_text: &str) -> Vec<(String, String)> {
    let mut found = Vec::new();
    let mut in_section = false;
    let mut lines = docs_text.lines().peekable();
    while let Some(line) = lines.next() {
        if line.starts_with("## ") {
            in_section = line.trim_end() == DOCS_SECTION;
            continue;
        }
        if !in_section {
            continue;
        }
        let Some(title) = line.strip_prefix("### ") else {
            continue;
        };
        while lines.peek().is_some_and(|l| l.trim().is_empty()) {
            lines.next();
        }
        let mut paragraph = Vec::new();
        while let Some(next) = lines.peek() {
            let next = next.trim();
            if next.is_empty() || next.starts_with('|') || next.starts_with('#') {
                break;
            }
            paragraph.push(next);
            lines.next();
        }
        found.push((title.trim().to_string(), paragraph.join(" ")));
    }
    found
}

/// `text` wrapped at [`WRAP`] columns. A line that `patch` could take for the
/// start of a diff gets a leading space.
fn wrap(text: &str) -> String {
    let mut out = String::new();
    let mut line = String::new();
    for word in text.split_whitespace() {
        if !line.is_empty() && line.len() + 1 + word.len() > WRAP {
            out.push_str(&line);
            out.push('\n');
            line.clear();
        }
        if !line.is_empty() {
            line.push(' ');
        }
        line.push_str(word);
    }
    if !line.is_empty() {
        out.push_str(&line);
        out.push('\n');
    }
    out.lines()
        .map(|l| {
            let diff_like = ["--- ", "+++ ", "*** ", "@@ ", "diff ", "Index:"]
                .iter()
                .any(|p| l.starts_with(p));
            if diff_like {
                format!(" {l}\n")
            } else {
                format!("{l}\n")
            }
        })
        .collect()
}

/// A unified diff (context [`CONTEXT_LINES`]) of one file, from `old` (`None`:
/// the file does not exist yet) to `new`, with the paths `patch -p1` expects.
pub fn file_diff(display_path: &str, old: Option<&str>, new: &str) -> String {
    let old_header = match old {
        Some(_) => format!("a/{display_path}"),
        None => "/dev/null".to_string(),
    };
    let new_header = format!("b/{display_path}");
    TextDiff::from_lines(old.unwrap_or(""), new)
        .unified_diff()
        .context_radius(CONTEXT_LINES)
        .header(&old_header, &new_header)
        .to_string()
}

fn utf8<'a>(bytes: &'a [u8], display_path: &str) -> Result<&'a str> {
    std::str::from_utf8(bytes)
        .with_context(|| format!("{display_path} is not UTF-8 text; a patch cannot carry it"))
}

/// The series for `seam` (whose file text is `seam_text`; new-file sources
/// relative to `seam_dir`) against the `pristine` crates, each patch opening
/// with its group's description from `docs_text` (docs/host-seam.md).
pub fn series(
    seam: &Seam,
    seam_text: &str,
    seam_dir: &Path,
    docs_text: &str,
    pristine: &BTreeMap<String, PathBuf>,
) -> Result<Vec<Patch>> {
    let groups = groups(seam_text, seam.edits.len())?;
    let described = descriptions(docs_text);
    let group_of = |title: &str| {
        groups
            .iter()
            .position(|g| g.title.eq_ignore_ascii_case(title))
    };

    // The new files, by the group that adds them.
    let mut new_files: Vec<Vec<AddedFile>> = groups.iter().map(|_| Vec::new()).collect();
    for host_crate in &seam.crates {
        for new_file in &host_crate.new_files {
            let title = new_file.group.as_deref().with_context(|| {
                format!(
                    "host/seam.toml: the new file {} of {} names no `group`",
                    new_file.path, host_crate.name
                )
            })?;
            let index = group_of(title).with_context(|| {
                format!(
                    "host/seam.toml: the new file {} names the group \"{title}\", which has no \
                     header",
                    new_file.path
                )
            })?;
            let bytes = seam::new_file_content(seam_dir, new_file)?;
            new_files[index].push(AddedFile {
                crate_name: host_crate.name.clone(),
                path: PathBuf::from(&new_file.path),
                bytes,
                source: new_file.source.clone(),
            });
        }
    }

    // The crates with the edits of the groups so far applied.
    let mut edited: BTreeMap<String, Files> = BTreeMap::new();
    for host_crate in &seam.crates {
        let root = pristine
            .get(&host_crate.name)
            .with_context(|| format!("no pristine source for {}", host_crate.name))?;
        edited.insert(host_crate.name.clone(), seam::read_tree(root)?);
    }
    // New files added so far: (crate, path) -> content. They replace whatever
    // the edits produced at that path, as in `seam::render_crate`.
    let mut added: BTreeMap<(String, PathBuf), Vec<u8>> = BTreeMap::new();
    let view = |edited: &BTreeMap<String, Files>,
                added: &BTreeMap<(String, PathBuf), Vec<u8>>,
                key: &(String, PathBuf)|
     -> Option<Vec<u8>> {
        added
            .get(key)
            .or_else(|| edited.get(&key.0).and_then(|files| files.get(&key.1)))
            .cloned()
    };

    let total = groups.len();
    let mut patches = Vec::with_capacity(total);
    for (index, group) in groups.iter().enumerate() {
        let edits = &seam.edits[group.edits.clone()];
        let mut changed: BTreeSet<(String, PathBuf)> = BTreeSet::new();
        for edit in edits {
            changed.insert((edit.crate_name.clone(), PathBuf::from(&edit.file)));
        }
        for file in &new_files[index] {
            changed.insert((file.crate_name.clone(), file.path.clone()));
        }
        let before: Vec<Option<Vec<u8>>> = changed
            .iter()
            .map(|key| view(&edited, &added, key))
            .collect();
        for edit in edits {
            let files = edited.get_mut(&edit.crate_name).with_context(|| {
                format!(
                    "host/seam.toml: edit \"{}\" is for {}, which is not a [[crate]] of the seam",
                    edit.name, edit.crate_name
                )
            })?;
            seam::apply_edits(files, [edit], &seam.host_version)?;
        }
        for file in &new_files[index] {
            added.insert(
                (file.crate_name.clone(), file.path.clone()),
                file.bytes.clone(),
            );
        }

        let mut diffs = String::new();
        for (key, old) in changed.iter().zip(&before) {
            let new = view(&edited, &added, key).context("a file of the seam vanished")?;
            if old.as_deref() == Some(new.as_slice()) {
                continue;
            }
            let display_path = format!("{}/{}", key.0, key.1.display());
            let old = old.as_deref().map(|b| utf8(b, &display_path)).transpose()?;
            let new = utf8(&new, &display_path)?;
            diffs.push_str(&file_diff(&display_path, old, new));
        }
        if diffs.is_empty() {
            bail!(
                "host/seam.toml: the group \"{}\" changes nothing in the host sources",
                group.title
            );
        }

        let description = described
            .iter()
            .find(|(title, _)| title.eq_ignore_ascii_case(&group.title))
            .map(|(_, paragraph)| paragraph.as_str())
            .filter(|paragraph| !paragraph.is_empty())
            .with_context(|| {
                format!(
                    "docs/host-seam.md has no description of the seam group \"{}\" (a heading \
                     `### {}` and a paragraph under \"{}\")",
                    group.title,
                    group.title,
                    DOCS_SECTION.trim_start_matches("## ")
                )
            })?;
        let mut text = String::new();
        writeln!(text, "{}", group.title)?;
        writeln!(text)?;
        text.push_str(&wrap(description));
        writeln!(text)?;
        writeln!(
            text,
            "Patch {} of {total} of the berrylm host seam for mistral.rs {} \
             (host/seam.toml, docs/host-seam.md).",
            index + 1,
            seam.host_version
        )?;
        if !edits.is_empty() {
            writeln!(text)?;
            writeln!(text, "Edits:")?;
            for edit in edits {
                writeln!(
                    text,
                    "  * {} ({} {})",
                    edit.name, edit.crate_name, edit.file
                )?;
            }
        }
        if !new_files[index].is_empty() {
            writeln!(text)?;
            writeln!(text, "New files:")?;
            for file in &new_files[index] {
                writeln!(
                    text,
                    "  * {}/{} (host/{})",
                    file.crate_name,
                    file.path.display(),
                    file.source
                )?;
            }
        }
        writeln!(text)?;
        text.push_str(&diffs);
        patches.push(Patch {
            file_name: format!("{:04}-{}.patch", index + 1, slug(&group.title)),
            text,
        });
    }
    Ok(patches)
}

/// Whether `name` looks like a file of a series (`0001-something.patch`).
fn is_series_file(name: &str) -> bool {
    let bytes = name.as_bytes();
    bytes.len() > 11
        && bytes[..4].iter().all(u8::is_ascii_digit)
        && bytes[4] == b'-'
        && name.ends_with(".patch")
}

/// Writes the series of the repository's seam into `dir` (created if needed;
/// files of an earlier series there that this one does not overwrite are
/// removed). Returns the paths written, in order. Writes nothing else.
pub fn write(repo: &Repo, dir: &Path) -> Result<Vec<PathBuf>> {
    let seam_file = repo.seam_file();
    let seam = Seam::load(&seam_file)?;
    let seam_text = std::fs::read_to_string(&seam_file)
        .with_context(|| format!("reading {}", seam_file.display()))?;
    let docs_file = repo.root.join("docs/host-seam.md");
    let docs_text = std::fs::read_to_string(&docs_file)
        .with_context(|| format!("reading {}", docs_file.display()))?;
    let pristine = host::pristine_sources(repo, &seam)?;
    let seam_dir = seam_file.parent().unwrap_or(Path::new("."));
    let patches = series(&seam, &seam_text, seam_dir, &docs_text, &pristine)?;

    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let names: BTreeSet<&str> = patches.iter().map(|p| p.file_name.as_str()).collect();
    for entry in std::fs::read_dir(dir).with_context(|| format!("reading {}", dir.display()))? {
        let entry = entry?;
        let name = entry.file_name();
        let Some(name) = name.to_str() else { continue };
        if is_series_file(name) && !names.contains(name) && entry.file_type()?.is_file() {
            std::fs::remove_file(entry.path())
                .with_context(|| format!("removing the stale {}", entry.path().display()))?;
            println!("xtask: removed {name}, a patch of an earlier series");
        }
    }
    let mut written = Vec::with_capacity(patches.len());
    for patch in &patches {
        let path = dir.join(&patch.file_name);
        std::fs::write(&path, &patch.text)
            .with_context(|| format!("writing {}", path.display()))?;
        written.push(path);
    }
    Ok(written)
}

#[cfg(test)]
mod tests {
    use super::*;

    const SEAM: &str = r#"# preamble
host_version = "1"

# ---------------------------------------------------------------- first concern
[[edit]]
name = "a"
text = """
# ---------------------------------------------------------------- not a header
[[edit]]
"""

# ---------------------------------------------------------------- second concern
# a sub-heading
[[edit]]
name = "b"
text = '''
[[edit]]'''

[[edit]]
name = "c"
"#;

    #[test]
    fn groups_follow_the_headers_and_skip_strings() {
        let found = groups(SEAM, 3).unwrap();
        assert_eq!(
            found,
            vec![
                Group {
                    title: "first concern".into(),
                    edits: 0..1
                },
                Group {
                    title: "second concern".into(),
                    edits: 1..3
                },
            ]
        );
        assert!(groups(SEAM, 4).is_err());
    }

    #[test]
    fn a_group_header_may_appear_once_and_edits_need_one() {
        let repeated = format!("{SEAM}\n# ---------------------------------- first concern\n");
        let message = groups(&repeated, 3).unwrap_err().to_string();
        assert!(message.contains("second header"), "{message}");
        let headless = "[[edit]]\nname = \"a\"\n";
        let message = groups(headless, 1).unwrap_err().to_string();
        assert!(
            message.contains("before the first group header"),
            "{message}"
        );
    }

    #[test]
    fn slugs_and_series_file_names() {
        assert_eq!(
            slug("hybrid state fixes (H1-H4)"),
            "hybrid-state-fixes-h1-h4"
        );
        assert_eq!(slug("MoE expert weights"), "moe-expert-weights");
        assert!(is_series_file("0001-plugin-api.patch"));
        assert!(!is_series_file("notes.patch"));
        assert!(!is_series_file("0001.patch"));
    }

    #[test]
    fn descriptions_come_from_the_section_headings() {
        let docs = "## Intro\n\n### first concern\n\nnot this\n\n## Every edit and why\n\n\
                    ### First concern\n\nOne paragraph\nover two lines.\n\n| edit | file |\n\n\
                    ### second concern\nno blank line first\n\nnot the second paragraph\n\n\
                    ## Later\n\n### third\n\nno\n";
        assert_eq!(
            descriptions(docs),
            vec![
                (
                    "First concern".to_string(),
                    "One paragraph over two lines.".to_string()
                ),
                (
                    "second concern".to_string(),
                    "no blank line first".to_string()
                ),
            ]
        );
    }

    #[test]
    fn wrapping_keeps_words_and_defuses_diff_headers() {
        let text = "word ".repeat(40);
        let wrapped = wrap(&text);
        assert!(wrapped.lines().all(|l| l.len() <= WRAP));
        assert_eq!(wrapped.split_whitespace().count(), 40);
        assert_eq!(wrap("--- a b"), " --- a b\n");
    }

    #[test]
    fn a_new_file_diffs_from_dev_null() {
        let diff = file_diff("c/src/new.rs", None, "one\ntwo\n");
        assert_eq!(
            diff,
            "--- /dev/null\n+++ b/c/src/new.rs\n@@ -0,0 +1,2 @@\n+one\n+two\n"
        );
        let diff = file_diff("c/x", Some("a\nb"), "a\nc\n");
        assert_eq!(
            diff,
            "--- a/c/x\n+++ b/c/x\n@@ -1,2 +1,2 @@\n a\n-b\n\\ No newline at end of file\n+c\n"
        );
    }
}
