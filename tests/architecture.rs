//! The house rules of src/, checked on the source text: no import circles between files, the
//! layers import only downwards, every file belongs to a layer or is one of the shared leaves, no
//! file over 600 lines, and every file opens with a `//!` line.
//!
//! Edges are drawn file by file from `use` statements and from paths that start with `crate::`,
//! `super::`, `self::` or the name of a child module; `mod x;` declarations are not edges.
//! `IUD_PRINT_IMPORTS=1 cargo test --release --test architecture -- --nocapture` prints the graph.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

const MAX_LINES: usize = 600;

/// Layers, lowest first (docs/ARCHITECTURE.md says why). A file may import only from its own
/// layer's files (without circles) and from layers below it.
const LAYERS: &[(&str, &[&str])] = &[
    ("gpu", &["gpu/"]),
    ("uring", &["uring/"]),
    ("mem", &["mem/"]),
    ("params", &["params/"]),
    ("path", &["path/"]),
    ("xfer", &["xfer/"]),
    ("engine", &["engine/"]),
    ("ffi", &["ffi/"]),
];

/// Files shared by every layer: they import no layer themselves. The root holds only lib.rs and
/// these leaves; the NIXL-facing layer's declarations that every layer reads (the bridge's
/// descriptor and status types, the manifest's parameter table) stay in its folder.
const SHARED: &[&str] = &[
    "error.rs",
    "log.rs",
    "test_support.rs",
    "ffi/bridge.rs",
    "ffi/manifest.rs",
];

struct SrcFile {
    rel: String,
    module: Vec<String>,
    children: BTreeSet<String>,
    code: String,
    lines: usize,
    first_line: String,
}

fn collect(dir: &Path, root: &Path, out: &mut Vec<PathBuf>) {
    let mut entries: Vec<_> = std::fs::read_dir(dir)
        .expect("read src")
        .map(|e| e.expect("dir entry").path())
        .collect();
    entries.sort();
    for p in entries {
        if p.is_dir() {
            if p.strip_prefix(root).unwrap() != Path::new("bin") {
                collect(&p, root, out);
            }
        } else if p.extension().is_some_and(|e| e == "rs") {
            out.push(p);
        }
    }
}

fn module_of(rel: &str) -> Vec<String> {
    let stem = rel.trim_end_matches(".rs");
    let mut parts: Vec<String> = stem.split('/').map(str::to_owned).collect();
    if matches!(parts.last().map(String::as_str), Some("mod") | Some("lib")) {
        parts.pop();
    }
    parts
}

/// The code with comments removed and string/char literals emptied.
fn strip(src: &str) -> String {
    let b = src.as_bytes();
    let mut out = String::with_capacity(src.len());
    let mut i = 0;
    while i < b.len() {
        let c = b[i];
        if c == b'/' && b.get(i + 1) == Some(&b'/') {
            while i < b.len() && b[i] != b'\n' {
                i += 1;
            }
        } else if c == b'/' && b.get(i + 1) == Some(&b'*') {
            i += 2;
            while i + 1 < b.len() && !(b[i] == b'*' && b[i + 1] == b'/') {
                i += 1;
            }
            i += 2;
        } else if c == b'r'
            && (b.get(i + 1) == Some(&b'"') || b.get(i + 1) == Some(&b'#'))
            && !is_ident(b.get(i.wrapping_sub(1)).copied())
        {
            let mut j = i + 1;
            let mut hashes = 0;
            while b.get(j) == Some(&b'#') {
                hashes += 1;
                j += 1;
            }
            if b.get(j) != Some(&b'"') {
                out.push('r');
                i += 1;
                continue;
            }
            j += 1;
            loop {
                if j >= b.len() {
                    break;
                }
                if b[j] == b'"'
                    && b[j + 1..]
                        .iter()
                        .take(hashes)
                        .filter(|&&h| h == b'#')
                        .count()
                        == hashes
                {
                    j += 1 + hashes;
                    break;
                }
                j += 1;
            }
            out.push_str("\"\"");
            i = j;
        } else if c == b'"' {
            i += 1;
            while i < b.len() && b[i] != b'"' {
                if b[i] == b'\\' {
                    i += 1;
                }
                i += 1;
            }
            i += 1;
            out.push_str("\"\"");
        } else if c == b'\''
            && (b.get(i + 2) == Some(&b'\'')
                || (b.get(i + 1) == Some(&b'\\')
                    && b[i + 2..]
                        .iter()
                        .position(|&x| x == b'\'')
                        .is_some_and(|p| p < 10)))
        {
            let end = i + 2 + b[i + 2..].iter().position(|&x| x == b'\'').unwrap();
            out.push_str("' '");
            i = end + 1;
        } else {
            out.push(c as char);
            i += 1;
        }
    }
    out
}

fn is_ident(c: Option<u8>) -> bool {
    c.is_some_and(|c| c.is_ascii_alphanumeric() || c == b'_')
}

/// Expands a use tree (`a::{b, c::{d, self}}`) into full paths.
fn expand_use(tree: &str, prefix: &[String], out: &mut Vec<Vec<String>>) {
    let tree = tree.trim();
    if let Some(open) = tree.find('{') {
        let head = tree[..open].trim().trim_end_matches("::");
        let mut base = prefix.to_vec();
        base.extend(
            head.split("::")
                .map(|s| s.trim().to_owned())
                .filter(|s| !s.is_empty()),
        );
        let inner = &tree[open + 1..tree.rfind('}').expect("balanced use tree")];
        let mut depth = 0;
        let mut start = 0;
        for (k, ch) in inner.char_indices() {
            match ch {
                '{' => depth += 1,
                '}' => depth -= 1,
                ',' if depth == 0 => {
                    expand_use(&inner[start..k], &base, out);
                    start = k + 1;
                }
                _ => {}
            }
        }
        expand_use(&inner[start..], &base, out);
    } else if !tree.is_empty() {
        let tree = tree.split(" as ").next().unwrap().trim();
        let mut p = prefix.to_vec();
        for seg in tree.split("::").map(str::trim) {
            if seg == "self" && !p.is_empty() {
                continue;
            }
            p.push(seg.to_owned());
        }
        out.push(p);
    }
}

/// Every crate-internal path a file names, each with the module it is named from (inline
/// `mod x { .. }` blocks, such as unit tests, are modules of their own inside the file).
fn paths_of(f: &SrcFile) -> Vec<(Vec<String>, Vec<String>)> {
    let mut out = Vec::new();
    let mut blocks = vec![(f.module.clone(), f.code.clone())];
    while let Some((module, code)) = blocks.pop() {
        let (outer, inner) = split_inline_mods(&code);
        for (name, body) in inner {
            let mut m = module.clone();
            m.push(name);
            blocks.push((m, body));
        }
        for p in paths_in(&outer, &f.children, module.len() == f.module.len()) {
            out.push((module.clone(), p));
        }
    }
    out
}

/// The code outside inline `mod x { .. }` blocks, and each block's name and body.
fn split_inline_mods(code: &str) -> (String, Vec<(String, String)>) {
    let b = code.as_bytes();
    let (mut outer, mut inner) = (String::new(), Vec::new());
    let mut i = 0;
    let mut copied = 0;
    while let Some(k) = code[i..].find("mod ") {
        let at = i + k;
        i = at + 4;
        if is_ident(b.get(at.wrapping_sub(1)).copied()) {
            continue;
        }
        let mut e = i;
        while is_ident(b.get(e).copied()) {
            e += 1;
        }
        let name = code[i..e].to_owned();
        let rest = code[e..].trim_start();
        if !rest.starts_with('{') {
            continue;
        }
        let open = code.len() - rest.len();
        let mut depth = 0;
        let mut close = open;
        for (j, ch) in code[open..].char_indices() {
            match ch {
                '{' => depth += 1,
                '}' => {
                    depth -= 1;
                    if depth == 0 {
                        close = open + j;
                        break;
                    }
                }
                _ => {}
            }
        }
        outer.push_str(&code[copied..at]);
        inner.push((name, code[open + 1..close].to_owned()));
        copied = close + 1;
        i = close + 1;
    }
    outer.push_str(&code[copied..]);
    (outer, inner)
}

/// The crate-internal paths in one module's code; `children` are the file's child modules,
/// nameable without a prefix only from the file's own top level.
fn paths_in(code: &str, children: &BTreeSet<String>, top: bool) -> Vec<Vec<String>> {
    let children_here = if top {
        children.clone()
    } else {
        BTreeSet::new()
    };
    let b = code.as_bytes();
    let mut out = Vec::new();
    let mut i = 0;
    while i < b.len() {
        if !is_ident(Some(b[i])) || is_ident(b.get(i.wrapping_sub(1)).copied()) {
            i += 1;
            continue;
        }
        let start = i;
        while is_ident(b.get(i).copied()) {
            i += 1;
        }
        let word = &code[start..i];
        if word == "use" {
            let end = start + code[start..].find(';').expect("use ends with ;");
            expand_use(&code[i..end], &[], &mut out);
            i = end;
            continue;
        }
        if code[i..].starts_with("::")
            && (matches!(word, "crate" | "super" | "self") || children_here.contains(word))
        {
            // Skip a path that continues another (`a::crate` cannot happen; `x::self` neither).
            if b.get(start.wrapping_sub(1)) == Some(&b':') {
                continue;
            }
            let mut segs = vec![word.to_owned()];
            while code[i..].starts_with("::") {
                let s = i + 2;
                let mut e = s;
                while is_ident(b.get(e).copied()) {
                    e += 1;
                }
                if e == s {
                    break;
                }
                segs.push(code[s..e].to_owned());
                i = e;
            }
            out.push(segs);
        }
    }
    out
}

fn resolve(
    f: &SrcFile,
    from: &[String],
    path: &[String],
    modules: &BTreeMap<Vec<String>, String>,
) -> Option<String> {
    let mut abs: Vec<String> = match path.first().map(String::as_str) {
        Some("crate") => Vec::new(),
        Some("self") => from.to_vec(),
        Some("super") => {
            let mut m = from.to_vec();
            m.pop();
            m
        }
        Some(first) if from == f.module.as_slice() && f.children.contains(first) => {
            let mut m = f.module.clone();
            m.push(first.to_owned());
            m
        }
        _ => return None,
    };
    let mut rest = &path[1..];
    while rest.first().map(String::as_str) == Some("super") {
        abs.pop();
        rest = &rest[1..];
    }
    abs.extend(rest.iter().cloned());
    (0..=abs.len())
        .rev()
        .find_map(|n| modules.get(&abs[..n]).cloned())
}

fn layer_of(rel: &str) -> Option<usize> {
    if SHARED.contains(&rel) {
        return None;
    }
    LAYERS
        .iter()
        .position(|(_, prefixes)| prefixes.iter().any(|p| rel.starts_with(p)))
}

fn load() -> (Vec<SrcFile>, BTreeMap<String, BTreeSet<String>>) {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut paths = Vec::new();
    collect(&root, &root, &mut paths);
    let mut files: Vec<SrcFile> = paths
        .iter()
        .map(|p| {
            let text = std::fs::read_to_string(p).expect("read source");
            let rel = p
                .strip_prefix(&root)
                .unwrap()
                .to_string_lossy()
                .into_owned();
            SrcFile {
                module: module_of(&rel),
                rel,
                children: BTreeSet::new(),
                lines: text.lines().count(),
                first_line: text.lines().next().unwrap_or("").to_owned(),
                code: strip(&text),
            }
        })
        .collect();
    let modules: BTreeMap<Vec<String>, String> = files
        .iter()
        .map(|f| (f.module.clone(), f.rel.clone()))
        .collect();
    for f in &mut files {
        f.children = modules
            .keys()
            .filter(|m| m.len() == f.module.len() + 1 && m.starts_with(&f.module))
            .map(|m| m.last().unwrap().clone())
            .collect();
    }
    let mut graph = BTreeMap::new();
    for f in &files {
        let edges: BTreeSet<String> = paths_of(f)
            .iter()
            .filter_map(|(from, p)| resolve(f, from, p, &modules))
            .filter(|t| *t != f.rel && t != "lib.rs")
            .collect();
        graph.insert(f.rel.clone(), edges);
    }
    (files, graph)
}

/// Strongly connected components with more than one file (Tarjan).
fn cycles(graph: &BTreeMap<String, BTreeSet<String>>) -> Vec<Vec<String>> {
    struct T<'a> {
        g: &'a BTreeMap<String, BTreeSet<String>>,
        index: BTreeMap<&'a str, usize>,
        low: BTreeMap<&'a str, usize>,
        stack: Vec<&'a str>,
        on: BTreeSet<&'a str>,
        out: Vec<Vec<String>>,
    }
    fn visit<'a>(t: &mut T<'a>, v: &'a str) {
        let n = t.index.len();
        t.index.insert(v, n);
        t.low.insert(v, n);
        t.stack.push(v);
        t.on.insert(v);
        for w in t.g.get(v).into_iter().flatten() {
            let w = w.as_str();
            if !t.index.contains_key(w) {
                visit(t, w);
                let lw = t.low[w];
                let lv = t.low.get_mut(v).unwrap();
                *lv = (*lv).min(lw);
            } else if t.on.contains(w) {
                let iw = t.index[w];
                let lv = t.low.get_mut(v).unwrap();
                *lv = (*lv).min(iw);
            }
        }
        if t.low[v] == t.index[v] {
            let mut comp = Vec::new();
            while let Some(w) = t.stack.pop() {
                t.on.remove(w);
                comp.push(w.to_owned());
                if w == v {
                    break;
                }
            }
            if comp.len() > 1 {
                comp.sort();
                t.out.push(comp);
            }
        }
    }
    let mut t = T {
        g: graph,
        index: BTreeMap::new(),
        low: BTreeMap::new(),
        stack: Vec::new(),
        on: BTreeSet::new(),
        out: Vec::new(),
    };
    for v in graph.keys() {
        if !t.index.contains_key(v.as_str()) {
            visit(&mut t, v);
        }
    }
    t.out
}

#[test]
fn no_import_circles_and_layers_import_downwards() {
    let (_, graph) = load();
    if std::env::var_os("IUD_PRINT_IMPORTS").is_some() {
        for (f, edges) in &graph {
            println!(
                "{f} -> {}",
                edges.iter().cloned().collect::<Vec<_>>().join(", ")
            );
        }
    }
    let circles = cycles(&graph);
    let mut problems: Vec<String> = circles
        .iter()
        .map(|c| format!("import circle: {}", c.join(" <-> ")))
        .collect();
    for (f, edges) in &graph {
        let from = layer_of(f);
        for t in edges {
            let to = layer_of(t);
            let upward = match (from, to) {
                (Some(a), Some(b)) => b > a,
                // A shared file (SHARED) may use no layer.
                (None, Some(_)) => !f.starts_with("lib.rs"),
                _ => false,
            };
            if upward {
                problems.push(format!("{f} imports {t}, a layer above it"));
            }
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

#[test]
fn files_are_small_and_say_their_job() {
    let (files, _) = load();
    let mut problems = Vec::new();
    for f in &files {
        if f.lines > MAX_LINES {
            problems.push(format!(
                "src/{} has {} lines (at most {MAX_LINES})",
                f.rel, f.lines
            ));
        }
        if !f.first_line.starts_with("//!") {
            problems.push(format!(
                "src/{} does not open with a `//!` line saying its job",
                f.rel
            ));
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

#[test]
fn every_file_is_in_a_layer_or_shared() {
    let (files, _) = load();
    let loose: Vec<String> = files
        .iter()
        .filter(|f| f.rel != "lib.rs" && !SHARED.contains(&f.rel.as_str()))
        .filter(|f| layer_of(&f.rel).is_none())
        .map(|f| {
            format!(
                "src/{} is in no layer and not shared (LAYERS, SHARED)",
                f.rel
            )
        })
        .collect();
    assert!(loose.is_empty(), "{}", loose.join("\n"));
}

#[test]
fn the_checker_sees_use_trees_and_relative_paths() {
    let mut out = Vec::new();
    expand_use("crate::{a::{self, B}, c::D as E}", &[], &mut out);
    let joined: Vec<String> = out.iter().map(|p| p.join("::")).collect();
    assert_eq!(joined, ["crate::a", "crate::a::B", "crate::c::D"]);
    assert_eq!(
        strip("let s = \"crate::x\"; // crate::y\nlet c = '\"'; crate::z"),
        "let s = \"\"; \nlet c = ' '; crate::z"
    );
}
