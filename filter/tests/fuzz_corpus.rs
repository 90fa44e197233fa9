//! Runs every file of every fuzz target's corpus (`fuzz/corpus/<target>/`,
//! seeds and saved crash reproducers alike) through the same check as the
//! `cargo fuzz` target, on the stable toolchain: CI never runs the fuzzer,
//! but what it found stays fixed.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::{Path, PathBuf};

use sluice_filter::fuzzing::TARGETS;

fn corpus_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../fuzz/corpus")
}

fn files_of(dir: &Path) -> Vec<PathBuf> {
    let entries = std::fs::read_dir(dir).unwrap_or_else(|e| panic!("corpus {} is missing: {e}", dir.display()));
    let mut files: Vec<PathBuf> =
        entries.map(|e| e.expect("a readable corpus entry").path()).filter(|p| p.is_file()).collect();
    files.sort();
    assert!(!files.is_empty(), "corpus {} is empty", dir.display());
    files
}

#[test]
fn every_fuzz_target_has_a_corpus_and_every_target_directory_a_check() {
    let root = corpus_root();
    for (name, _) in TARGETS {
        files_of(&root.join(name));
    }
    for entry in std::fs::read_dir(&root).expect("fuzz/corpus exists") {
        let name = entry.expect("a readable entry").file_name().into_string().expect("a UTF-8 name");
        assert!(TARGETS.iter().any(|(t, _)| *t == name), "fuzz/corpus/{name} belongs to no fuzz target");
    }
    let targets = std::fs::read_dir(Path::new(env!("CARGO_MANIFEST_DIR")).join("../fuzz/fuzz_targets"))
        .expect("fuzz/fuzz_targets exists")
        .count();
    assert_eq!(targets, TARGETS.len(), "fuzz/fuzz_targets and sluice_filter::fuzzing::TARGETS disagree");
}

fn run_corpus(target: &str) {
    let (_, check) = TARGETS.iter().find(|(t, _)| *t == target).expect("a known target");
    let mut failed = Vec::new();
    let files = files_of(&corpus_root().join(target));
    for file in &files {
        let data = std::fs::read(file).expect("a readable corpus file");
        if let Err(e) = catch_unwind(AssertUnwindSafe(|| check(&data))) {
            let why = e.downcast_ref::<String>().cloned().or_else(|| e.downcast_ref::<&str>().map(|s| s.to_string()));
            failed.push(format!("{}: {}", file.display(), why.unwrap_or_default()));
        }
    }
    assert!(failed.is_empty(), "{} of {} {target} inputs fail:\n{}", failed.len(), files.len(), failed.join("\n"));
}

#[test]
fn openai_request_corpus() {
    run_corpus("openai_request");
}

#[test]
fn request_path_corpus() {
    run_corpus("request_path");
}

#[test]
fn token_counter_corpus() {
    run_corpus("token_counter");
}

#[test]
fn prometheus_corpus() {
    run_corpus("prometheus");
}

#[test]
fn wire_corpus() {
    run_corpus("wire");
}

#[test]
fn config_corpus() {
    run_corpus("config");
}
