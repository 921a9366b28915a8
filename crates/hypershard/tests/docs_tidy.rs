//! Keeps the users' documentation (`docs/*.md` and `README.md`) about the software: no dated
//! benchmark "sittings", no load averages, no issue numbers, and no relative link (file or
//! `#anchor`) that points nowhere. Measurement history belongs in `benches/results/`, not in
//! the prose. Only files inside the repository are read.

use std::collections::HashSet;
use std::fs;
use std::path::{Path, PathBuf};

/// One finding: the file, the 1-based line and what is wrong there.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Finding {
    file: String,
    line: usize,
    what: String,
}

fn repo_root() -> PathBuf {
    // This file lives in crates/hypershard/tests, so the workspace root is two levels up.
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// The pages the check covers: every `docs/*.md` and the top-level `README.md`.
fn checked_pages(root: &Path) -> Vec<PathBuf> {
    let docs = root.join("docs");
    let mut pages: Vec<PathBuf> = fs::read_dir(&docs)
        .unwrap_or_else(|e| panic!("reading {}: {e}", docs.display()))
        .map(|entry| entry.expect("a readable directory entry").path())
        .filter(|path| path.extension().is_some_and(|ext| ext == "md"))
        .collect();
    pages.sort();
    pages.push(root.join("README.md"));
    pages
}

/// Lines outside fenced code blocks, with their 1-based numbers, and inline code removed:
/// commands and examples may quote anything.
fn prose_lines(text: &str) -> Vec<(usize, String)> {
    let mut in_fence = false;
    let mut out = Vec::new();
    for (index, line) in text.lines().enumerate() {
        if line.trim_start().starts_with("```") {
            in_fence = !in_fence;
            continue;
        }
        if in_fence {
            continue;
        }
        out.push((index + 1, strip_inline_code(line)));
    }
    out
}

fn strip_inline_code(line: &str) -> String {
    let mut out = String::with_capacity(line.len());
    let mut in_code = false;
    for c in line.chars() {
        if c == '`' {
            in_code = !in_code;
            continue;
        }
        if !in_code {
            out.push(c);
        }
    }
    out
}

/// `YYYY-MM-DD` anywhere in the line.
fn has_date(line: &str) -> bool {
    let bytes = line.as_bytes();
    bytes.windows(10).any(|w| {
        w[..4].iter().all(u8::is_ascii_digit)
            && w[4] == b'-'
            && w[5..7].iter().all(u8::is_ascii_digit)
            && w[7] == b'-'
            && w[8..10].iter().all(u8::is_ascii_digit)
    })
}

/// A clock time such as `07:49` or `7:49` (one or two digits, a colon, two digits, and no
/// digit right after: `1:2:3` ratios and `u32:4` types do not look like this).
fn has_clock_time(line: &str) -> bool {
    let bytes = line.as_bytes();
    (0..bytes.len()).any(|i| {
        bytes[i] == b':'
            && i >= 1
            && bytes[i - 1].is_ascii_digit()
            && (i < 2 || !bytes[i - 2].is_ascii_alphabetic())
            && bytes.get(i + 1).is_some_and(u8::is_ascii_digit)
            && bytes.get(i + 2).is_some_and(u8::is_ascii_digit)
            && !bytes.get(i + 3).is_some_and(u8::is_ascii_digit)
    })
}

/// "issue 8", "issue #8", "issues 3, 4", "Issue-8": an issue number in the prose.
fn has_issue_number(line: &str) -> bool {
    let lower = line.to_lowercase();
    let bytes = lower.as_bytes();
    let mut from = 0;
    while let Some(offset) = lower[from..].find("issue") {
        let start = from + offset;
        let word_start = start == 0 || !bytes[start - 1].is_ascii_alphanumeric();
        let mut i = start + "issue".len();
        if bytes.get(i) == Some(&b's') {
            i += 1;
        }
        while matches!(bytes.get(i), Some(b' ' | b'#' | b'-')) {
            i += 1;
        }
        if word_start && bytes.get(i).is_some_and(u8::is_ascii_digit) {
            return true;
        }
        from = start + "issue".len();
    }
    false
}

/// The lab-notebook rules for one page's text.
fn notebook_findings(file: &str, text: &str) -> Vec<Finding> {
    let mut findings = Vec::new();
    let mut push = |line: usize, what: &str| {
        findings.push(Finding {
            file: file.to_string(),
            line,
            what: what.to_string(),
        })
    };
    for (number, line) in prose_lines(text) {
        let lower = line.to_lowercase();
        if lower.contains("sitting") && (has_date(&line) || has_clock_time(&line)) {
            push(
                number,
                "a dated sitting (measurement history belongs in benches/results/)",
            );
        }
        if lower.contains("load average") {
            push(
                number,
                "a load average (say what the software does, not how loaded a machine was)",
            );
        }
        if has_issue_number(&line) {
            push(number, "an issue number");
        }
    }
    findings
}

/// GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens.
fn slug(heading: &str) -> String {
    heading
        .trim()
        .to_lowercase()
        .chars()
        .filter_map(|c| match c {
            ' ' => Some('-'),
            c if c.is_alphanumeric() || c == '-' || c == '_' => Some(c),
            _ => None,
        })
        .collect()
}

/// Every anchor a markdown page offers (headings outside code blocks; repeated headings get
/// `-1`, `-2`, ... as on GitHub).
fn anchors(text: &str) -> HashSet<String> {
    let mut seen = HashSet::new();
    let mut in_fence = false;
    for line in text.lines() {
        if line.trim_start().starts_with("```") {
            in_fence = !in_fence;
            continue;
        }
        if in_fence || !line.starts_with('#') {
            continue;
        }
        let heading = line.trim_start_matches('#');
        if !heading.starts_with(' ') {
            continue;
        }
        let base = slug(&heading.replace('`', ""));
        let mut anchor = base.clone();
        let mut n = 0;
        while seen.contains(&anchor) {
            n += 1;
            anchor = format!("{base}-{n}");
        }
        seen.insert(anchor);
    }
    seen
}

/// The targets of the markdown links `[text](target)` and images `![alt](target)` in a line.
fn link_targets(line: &str) -> Vec<String> {
    let mut targets = Vec::new();
    let mut rest = line;
    while let Some(open) = rest.find("](") {
        let after = &rest[open + 2..];
        match after.find(')') {
            Some(close) => {
                let target = after[..close].split_whitespace().next().unwrap_or("");
                targets.push(target.to_string());
                rest = &after[close + 1..];
            }
            None => break,
        }
    }
    targets
}

/// Relative links of one page that do not resolve: a missing file or folder, or an anchor
/// that no heading of the target page produces.
fn link_findings(root: &Path, page: &Path, text: &str) -> Vec<Finding> {
    let file = page
        .strip_prefix(root)
        .unwrap_or(page)
        .display()
        .to_string();
    let dir = page.parent().unwrap_or(root);
    let mut findings = Vec::new();
    for (number, line) in prose_lines(text) {
        for target in link_targets(&line) {
            if target.is_empty() || target.contains("://") || target.starts_with("mailto:") {
                continue;
            }
            let (path_part, anchor) = match target.split_once('#') {
                Some((path, anchor)) => (path, Some(anchor)),
                None => (target.as_str(), None),
            };
            let resolved = if path_part.is_empty() {
                page.to_path_buf()
            } else {
                dir.join(path_part)
            };
            if !resolved.exists() {
                findings.push(Finding {
                    file: file.clone(),
                    line: number,
                    what: format!(
                        "broken link: {target} ({} does not exist)",
                        resolved.display()
                    ),
                });
                continue;
            }
            // Anchors are checked in markdown pages only; a folder or an image has none.
            if let Some(anchor) = anchor
                && resolved.extension().is_some_and(|ext| ext == "md")
            {
                let target_text = fs::read_to_string(&resolved)
                    .unwrap_or_else(|e| panic!("reading {}: {e}", resolved.display()));
                if !anchors(&target_text).contains(anchor) {
                    findings.push(Finding {
                        file: file.clone(),
                        line: number,
                        what: format!("broken anchor: {target}"),
                    });
                }
            }
        }
    }
    findings
}

fn report(findings: &[Finding]) -> String {
    findings
        .iter()
        .map(|f| format!("{}:{}: {}", f.file, f.line, f.what))
        .collect::<Vec<_>>()
        .join("\n")
}

#[test]
fn the_docs_are_free_of_lab_notebook_entries() {
    let root = repo_root();
    let mut findings = Vec::new();
    for page in checked_pages(&root) {
        let text =
            fs::read_to_string(&page).unwrap_or_else(|e| panic!("reading {}: {e}", page.display()));
        let name = page
            .strip_prefix(&root)
            .unwrap_or(&page)
            .display()
            .to_string();
        findings.extend(notebook_findings(&name, &text));
    }
    assert!(
        findings.is_empty(),
        "lab-notebook entries in the docs:\n{}",
        report(&findings)
    );
}

#[test]
fn every_relative_link_in_the_docs_resolves() {
    let root = repo_root();
    let pages = checked_pages(&root);
    assert!(
        pages.iter().any(|p| p.ends_with("docs/README.md")),
        "docs/README.md, the index, is missing"
    );
    let mut findings = Vec::new();
    let mut links = 0;
    for page in &pages {
        let text =
            fs::read_to_string(page).unwrap_or_else(|e| panic!("reading {}: {e}", page.display()));
        links += prose_lines(&text)
            .iter()
            .map(|(_, line)| link_targets(line).len())
            .sum::<usize>();
        findings.extend(link_findings(&root, page, &text));
    }
    // The index alone links every page, so a scan that finds few links is a broken scan.
    assert!(links >= 50, "only {links} links found in the docs");
    assert!(
        findings.is_empty(),
        "links that do not resolve:\n{}",
        report(&findings)
    );
}

#[test]
fn the_index_links_every_page_of_docs() {
    let root = repo_root();
    let index = fs::read_to_string(root.join("docs/README.md")).expect("docs/README.md exists");
    let linked: HashSet<String> = prose_lines(&index)
        .iter()
        .flat_map(|(_, line)| link_targets(line))
        .map(|t| t.split('#').next().unwrap_or("").to_string())
        .collect();
    let missing: Vec<String> = checked_pages(&root)
        .iter()
        .filter(|p| p.parent() == Some(root.join("docs").as_path()))
        .filter_map(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()))
        .filter(|name| name != "README.md" && !linked.contains(name))
        .collect();
    assert!(
        missing.is_empty(),
        "pages of docs/ the index does not link: {missing:?}"
    );
}

#[test]
fn the_notebook_rules_catch_what_they_name_and_spare_the_rest() {
    let flagged = |text: &str| notebook_findings("t.md", text).len();
    assert_eq!(flagged("## The sitting of 2026-12-02, 20:13 UTC"), 1);
    assert_eq!(flagged("One sitting, 07:06–07:14 (broadcast A/B)"), 1);
    assert_eq!(flagged("the load average was 4–11 on 2 cores"), 1);
    assert_eq!(flagged("against the targets of issue 3"), 1);
    assert_eq!(flagged("Issue #12 asks for it"), 1);
    assert_eq!(flagged("the targets of issues 3, 4 and 6"), 1);
    assert_eq!(flagged("(issue 8 part 3; issue-6's fusion target)"), 1);
    // One line with two rules broken is two findings.
    assert_eq!(flagged("sitting 2026-12-03, load average 7"), 2);
    // Ordinary prose and code are left alone.
    assert_eq!(
        flagged("ops run in issue order; every rank issues the same ops"),
        0
    );
    assert_eq!(flagged("a tissue 3 cells thick; the sitting room"), 0);
    assert_eq!(flagged("ratios read 1:2 and a header of u32:4 bits"), 0);
    assert_eq!(flagged("```\nissue 3 at 2026-12-02 in a sitting\n```"), 0);
    assert_eq!(flagged("`load average` quoted as code"), 0);
}

#[test]
fn the_link_check_catches_missing_files_and_anchors() {
    let dir = std::env::temp_dir().join(format!("docs_tidy_{}", std::process::id()));
    fs::create_dir_all(&dir).expect("a temporary folder");
    fs::write(
        dir.join("b.md"),
        "# Title\n\n## A `code` heading: yes\n\n## Twice\n\n## Twice\n",
    )
    .expect("write b.md");
    let page = dir.join("a.md");
    let text = "[ok](b.md) [ok](b.md#a-code-heading-yes) [ok](b.md#twice-1) [ok](#local)\n\
                [bad](missing.md) [bad](b.md#nowhere) ![bad](img/none.svg)\n\
                [web](https://example.com/x) `[code](not/checked.md)`\n\
                # Local\n";
    fs::write(&page, text).expect("write a.md");
    let findings = link_findings(&dir, &page, text);
    fs::remove_dir_all(&dir).expect("remove the temporary folder");
    let lines: Vec<(usize, bool)> = findings
        .iter()
        .map(|f| (f.line, f.what.starts_with("broken anchor")))
        .collect();
    assert_eq!(
        lines,
        vec![(2, false), (2, true), (2, false)],
        "{findings:?}"
    );
}
