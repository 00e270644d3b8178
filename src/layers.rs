//! The agent's layers, and the test that keeps its dependencies pointing
//! down them: every top-level module of `src/` belongs to one layer and may
//! use modules of its own layer or below, and the modules' uses form no
//! cycle. The uses are read from the sources (`crate::module` paths and
//! `use crate::{...}` groups, comments left out), as Perfetto's import
//! checker reads includes.
//!
//! The few edges that still point the wrong way are listed in
//! [`KNOWN_WRONG_WAY`], each with what removes it; the test fails when a new
//! one appears and when a listed one is gone (so that the list only
//! shrinks).

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

/// Layers from the bottom, and the top-level modules in each.
const LAYERS: &[(&str, &[&str])] = &[
    (
        "model",
        &["clock", "event", "model", "proto", "ring", "workload"],
    ),
    ("protocol", &["protocol"]),
    ("recording", &["recorder", "repository"]),
    ("sources", &["attach", "backend", "elf", "tap"]),
    ("products", &["agent", "analysis", "tools", "xspace"]),
    ("clients", &["doctor", "fleet", "telemetry"]),
    ("captures", &["capture"]),
    ("services", &["service", "trigger"]),
    ("edges", &["cli", "fuzz", "layers"]),
];

/// Uses that break the rules today, and what removes each.
const KNOWN_WRONG_WAY: &[(&str, &str, &str)] = &[];

fn layer_of(module: &str) -> Option<usize> {
    LAYERS
        .iter()
        .position(|(_, modules)| modules.contains(&module))
}

/// The top-level module a file under `src/` belongs to.
fn module_of(relative: &Path) -> Option<String> {
    let first = relative.components().next()?.as_os_str().to_str()?;
    Some(first.trim_end_matches(".rs").to_string())
}

/// The top-level modules a source text uses through `crate::`.
fn uses(text: &str) -> BTreeSet<String> {
    let code: String = text
        .lines()
        .filter(|line| !line.trim_start().starts_with("//"))
        .collect::<Vec<_>>()
        .join("\n");
    let mut found = BTreeSet::new();
    let mut rest = code.as_str();
    while let Some(at) = rest.find("crate::") {
        rest = &rest[at + "crate::".len()..];
        if let Some(group) = rest.strip_prefix('{') {
            // `use crate::{a, b::c, d::{e, f}}`: the names at depth one.
            let mut depth = 1;
            let mut name = String::new();
            let mut expecting = true;
            for c in group.chars() {
                match c {
                    '{' => depth += 1,
                    '}' => {
                        depth -= 1;
                        if depth == 0 {
                            break;
                        }
                    }
                    ',' if depth == 1 => {
                        if !name.is_empty() {
                            found.insert(std::mem::take(&mut name));
                        }
                        expecting = true;
                    }
                    c if depth == 1 && expecting && (c.is_ascii_alphanumeric() || c == '_') => {
                        name.push(c)
                    }
                    _ if !name.is_empty() => {
                        found.insert(std::mem::take(&mut name));
                        expecting = false;
                    }
                    _ => {}
                }
            }
            if !name.is_empty() {
                found.insert(name);
            }
        } else {
            let name: String = rest
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                .collect();
            if !name.is_empty() {
                found.insert(name);
            }
        }
    }
    found
}

/// Every top-level module's uses of other top-level modules.
fn graph() -> BTreeMap<String, BTreeSet<String>> {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut graph: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    let mut pending = vec![src.clone()];
    while let Some(dir) = pending.pop() {
        for entry in std::fs::read_dir(&dir).expect("reading src/") {
            let path = entry.expect("a directory entry").path();
            if path.is_dir() {
                pending.push(path);
                continue;
            }
            if path.extension().is_none_or(|e| e != "rs") {
                continue;
            }
            let relative = path.strip_prefix(&src).expect("under src/");
            let Some(module) = module_of(relative) else {
                continue;
            };
            if module == "lib" || module == "main" {
                continue;
            }
            let text = std::fs::read_to_string(&path).expect("reading a source file");
            let entry = graph.entry(module.clone()).or_default();
            entry.extend(uses(&text).into_iter().filter(|used| *used != module));
        }
    }
    graph
}

#[test]
fn uses_are_read_from_paths_and_groups_but_not_comments() {
    let text = "use crate::a::B;\n// crate::commented\nuse crate::{c, d::{E, F}, g::h};\nlet x = crate::i::j();";
    let found: Vec<String> = uses(text).into_iter().collect();
    assert_eq!(found, ["a", "c", "d", "g", "i"]);
}

#[test]
fn every_module_uses_only_its_layer_and_below_without_cycles() {
    let graph = graph();
    let unplaced: Vec<&String> = graph.keys().filter(|m| layer_of(m).is_none()).collect();
    assert!(
        unplaced.is_empty(),
        "modules in no layer of src/layers.rs: {unplaced:?}"
    );
    let known = |from: &str, to: &str| {
        KNOWN_WRONG_WAY
            .iter()
            .any(|(f, t, _)| *f == from && *t == to)
    };
    let mut wrong = Vec::new();
    for (module, used) in &graph {
        for dependency in used {
            let (Some(from), Some(to)) = (layer_of(module), layer_of(dependency)) else {
                continue;
            };
            if to > from && !known(module, dependency) {
                wrong.push(format!(
                    "{module} ({}) uses {dependency} ({})",
                    LAYERS[from].0, LAYERS[to].0
                ));
            }
        }
    }
    assert!(wrong.is_empty(), "uses up the layers: {wrong:?}");

    // No cycle among the uses, the known ones aside.
    fn visit(
        module: &str,
        graph: &BTreeMap<String, BTreeSet<String>>,
        skip: &dyn Fn(&str, &str) -> bool,
        path: &mut Vec<String>,
        done: &mut BTreeSet<String>,
    ) -> Option<Vec<String>> {
        if let Some(at) = path.iter().position(|m| m == module) {
            let mut cycle = path[at..].to_vec();
            cycle.push(module.to_string());
            return Some(cycle);
        }
        if !done.insert(module.to_string()) {
            return None;
        }
        path.push(module.to_string());
        for next in graph.get(module).into_iter().flatten() {
            if skip(module, next) {
                continue;
            }
            if let Some(cycle) = visit(next, graph, skip, path, done) {
                return Some(cycle);
            }
        }
        path.pop();
        None
    }
    let mut done = BTreeSet::new();
    for module in graph.keys() {
        let cycle = visit(module, &graph, &known, &mut Vec::new(), &mut done);
        assert!(cycle.is_none(), "a cycle of uses: {cycle:?}");
    }

    let gone: Vec<String> = KNOWN_WRONG_WAY
        .iter()
        .filter(|(from, to, _)| !graph.get(*from).is_some_and(|used| used.contains(*to)))
        .map(|(from, to, _)| format!("{from} -> {to}"))
        .collect();
    assert!(
        gone.is_empty(),
        "listed as wrong-way in src/layers.rs but no longer used: {gone:?} (remove them from the list)"
    );
}
