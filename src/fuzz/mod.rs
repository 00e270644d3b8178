//! Mutational fuzzing of every decoder of untrusted bytes, on stable Rust,
//! as ordinary tests of the library (so none of it reaches the binary).
//!
//! Each target ([`targets`]) starts from seeds made by the project's own
//! encoders and runs mutated copies of them ([`mutate`]) through one
//! decoder. A case is a finding when the decoder panics, when it holds more
//! memory at once than the target's bound (a multiple of the input's
//! length plus a constant: [`alloc`] counts), or when it does not return
//! within the hang limit (a watchdog saves the input and aborts). There is
//! no coverage instrumentation on stable Rust, so each target sums up what
//! its decoder made of an input in a number (how many records of which
//! kinds, planes, events, ...); an input whose number is new joins the
//! corpus, and later cases start from it.
//!
//! `cargo test --lib fuzz` runs a fixed number of cases per target from a
//! fixed seed; `scripts/fuzz SECONDS` runs each for a time with a fresh
//! seed. Settings (environment):
//!
//! - `DEVTRACE_FUZZ_SECONDS`: run each target this long instead of
//!   [`DEFAULT_CASES`] cases.
//! - `DEVTRACE_FUZZ_CASES`: cases per target when no time is given.
//! - `DEVTRACE_FUZZ_SEED`: the first seed (default: fixed for a count, the
//!   clock for a time).
//! - `DEVTRACE_FUZZ_DIR`: where findings are saved, as
//!   `<target>/<kind>-<hash>` (default: `devtrace-fuzz` in the temporary
//!   directory).
//! - `DEVTRACE_FUZZ_HANG_SECONDS`: how long one case may run (default 30).
//!
//! Inputs saved under `src/fuzz/regressions/<target>/` are run first, every
//! time: findings that were fixed stay fixed.

mod alloc;
mod mutate;
mod targets;

use std::cell::RefCell;
use std::collections::BTreeMap;
use std::panic::{self, AssertUnwindSafe};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, Once};
use std::time::{Duration, Instant};

use mutate::Mutator;

/// Cases per target under `cargo test`: a few seconds each in a debug build.
pub const DEFAULT_CASES: u64 = 30_000;
/// Largest input a case is given.
const MAX_INPUT: usize = 64 << 10;
/// Most inputs kept in a target's corpus.
const MAX_CORPUS: usize = 512;
/// Tries at making a finding's input smaller.
const SHRINK_ATTEMPTS: usize = 2_000;

/// One decoder under test.
pub struct Target {
    pub name: &'static str,
    /// Valid inputs, made with the project's own encoders.
    pub seeds: fn() -> Vec<Vec<u8>>,
    /// Runs one input: what the decoder made of it, summed up in a number
    /// (inputs with a new one are kept), or `None` when it refused it.
    pub run: fn(&[u8]) -> Option<u64>,
    /// Tokens of the format the mutator may insert.
    pub dictionary: &'static [&'static [u8]],
    /// Most bytes held at once per input byte (plus [`ALLOCATION_SLACK`]).
    pub bytes_per_input_byte: usize,
}

/// Memory any case may hold whatever its length: tables, buffers, a ring.
const ALLOCATION_SLACK: usize = 1 << 20;

/// What went wrong in one case.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Finding {
    /// A panic: its message and where it was raised.
    Panic(String),
    /// More memory held at once than the target allows.
    Allocation { held: usize, allowed: usize },
}

impl Finding {
    /// Findings with the same signature are the same bug.
    fn signature(&self) -> String {
        match self {
            Finding::Panic(message) => format!("panic: {message}"),
            Finding::Allocation { .. } => "allocation beyond the bound".to_string(),
        }
    }

    fn kind(&self) -> &'static str {
        match self {
            Finding::Panic(_) => "crash",
            Finding::Allocation { .. } => "allocation",
        }
    }
}

thread_local! {
    /// Set while a case runs: its panics are recorded, not printed.
    static IN_CASE: RefCell<Option<String>> = const { RefCell::new(None) };
    static CASE_RUNNING: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Panics inside cases are expected and many: record them quietly; every
/// other panic (other tests in the binary) is shown as usual.
fn install_panic_hook() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        let previous = panic::take_hook();
        panic::set_hook(Box::new(move |info| {
            if CASE_RUNNING.with(std::cell::Cell::get) {
                let message = info
                    .payload()
                    .downcast_ref::<&str>()
                    .map(|s| s.to_string())
                    .or_else(|| info.payload().downcast_ref::<String>().cloned())
                    .unwrap_or_else(|| "(no message)".into());
                let at = info
                    .location()
                    .map(|l| format!("{}:{}", l.file(), l.line()))
                    .unwrap_or_default();
                IN_CASE.with(|c| *c.borrow_mut() = Some(format!("{message} at {at}")));
            } else {
                previous(info);
            }
        }));
    });
}

/// Runs one input through `target`: a finding, or the target's summary.
fn run_case(target: &Target, input: &[u8]) -> Result<Option<u64>, Finding> {
    CASE_RUNNING.with(|c| c.set(true));
    IN_CASE.with(|c| c.borrow_mut().take());
    let (outcome, held) =
        alloc::peak_during(|| panic::catch_unwind(AssertUnwindSafe(|| (target.run)(input))));
    CASE_RUNNING.with(|c| c.set(false));
    let allowed = input.len() * target.bytes_per_input_byte + ALLOCATION_SLACK;
    match outcome {
        Err(_) => Err(Finding::Panic(
            IN_CASE
                .with(|c| c.borrow_mut().take())
                .unwrap_or_else(|| "(no message)".into()),
        )),
        Ok(_) if held > allowed => Err(Finding::Allocation { held, allowed }),
        Ok(summary) => Ok(summary),
    }
}

/// A smaller input with the same finding, by cutting pieces out.
fn shrink(target: &Target, input: &[u8], finding: &Finding) -> Vec<u8> {
    let same = |candidate: &[u8]| {
        run_case(target, candidate)
            .err()
            .is_some_and(|f| f.signature() == finding.signature())
    };
    let mut best = input.to_vec();
    let mut attempts = 0;
    let mut chunk = best.len().div_ceil(2).max(1);
    while chunk > 0 && attempts < SHRINK_ATTEMPTS {
        let mut at = 0;
        let mut cut_any = false;
        while at < best.len() && attempts < SHRINK_ATTEMPTS {
            let mut candidate = best[..at].to_vec();
            candidate.extend_from_slice(&best[(at + chunk).min(best.len())..]);
            attempts += 1;
            if same(&candidate) {
                best = candidate;
                cut_any = true;
            } else {
                at += chunk;
            }
        }
        if !cut_any {
            chunk /= 2;
        }
    }
    best
}

/// How one target's run went.
#[derive(Default)]
pub struct Report {
    pub executions: u64,
    pub elapsed: Duration,
    /// Each distinct finding: how often, and its smallest saved input.
    findings: BTreeMap<String, (u64, PathBuf, Finding)>,
    pub corpus: usize,
}

impl Report {
    pub fn crashes(&self) -> u64 {
        self.findings.values().map(|(count, _, _)| count).sum()
    }

    fn summary(&self, target: &str, dir: &Path) -> String {
        let rate = self.executions as f64 / self.elapsed.as_secs_f64().max(1e-9);
        let mut text = format!(
            "fuzz {target}: {} executions in {:.1} s ({rate:.0}/s), {} crashes ({} distinct), corpus {}; findings in {}",
            self.executions,
            self.elapsed.as_secs_f64(),
            self.crashes(),
            self.findings.len(),
            self.corpus,
            dir.join(target).display()
        );
        for (signature, (count, path, finding)) in &self.findings {
            let detail = match finding {
                Finding::Allocation { held, allowed } => {
                    format!(" (held {held} bytes, allowed {allowed})")
                }
                Finding::Panic(_) => String::new(),
            };
            text.push_str(&format!(
                "\n  {count} x {signature}{detail}\n    smallest input: {}",
                path.display()
            ));
        }
        text
    }
}

/// Settings from the environment.
struct Settings {
    budget: Budget,
    seed: u64,
    dir: PathBuf,
    hang: Duration,
}

enum Budget {
    Cases(u64),
    Time(Duration),
}

impl Settings {
    fn from_env() -> Settings {
        let number = |name: &str| std::env::var(name).ok().and_then(|v| v.parse::<u64>().ok());
        let seconds = number("DEVTRACE_FUZZ_SECONDS");
        let budget = match seconds {
            Some(seconds) => Budget::Time(Duration::from_secs(seconds)),
            None => Budget::Cases(number("DEVTRACE_FUZZ_CASES").unwrap_or(DEFAULT_CASES)),
        };
        let seed = number("DEVTRACE_FUZZ_SEED").unwrap_or_else(|| match budget {
            Budget::Cases(_) => 0x5eed,
            Budget::Time(_) => crate::clock::now_ns(),
        });
        let dir = std::env::var_os("DEVTRACE_FUZZ_DIR")
            .map_or_else(|| std::env::temp_dir().join("devtrace-fuzz"), PathBuf::from);
        let hang = Duration::from_secs(number("DEVTRACE_FUZZ_HANG_SECONDS").unwrap_or(30));
        Settings {
            budget,
            seed,
            dir,
            hang,
        }
    }
}

/// The bucket of a count: 0, 1, 2-3, 4-7, ... (what matters is its size).
pub fn bucket(count: usize) -> u64 {
    u64::from(usize::BITS - count.leading_zeros())
}

/// FNV-1a, to name saved inputs by their content.
fn content_hash(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |hash, byte| {
        (hash ^ u64::from(*byte)).wrapping_mul(0x0100_0000_01b3)
    })
}

fn save(dir: &Path, kind: &str, input: &[u8]) -> PathBuf {
    let path = dir.join(format!("{kind}-{:016x}", content_hash(input)));
    if let Err(error) = std::fs::create_dir_all(dir).and_then(|()| std::fs::write(&path, input)) {
        eprintln!("cannot save {}: {error}", path.display());
    }
    path
}

/// The regression inputs of a target, kept in the repository.
fn regressions(target: &str) -> Vec<Vec<u8>> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("src/fuzz/regressions")
        .join(target);
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut files: Vec<PathBuf> = entries.flatten().map(|e| e.path()).collect();
    files.sort();
    files.iter().filter_map(|p| std::fs::read(p).ok()).collect()
}

/// Watches the running case; one that runs past the hang limit is saved
/// and the process aborted (a thread cannot be stopped from outside).
struct Watchdog {
    current: Arc<Mutex<(Instant, Vec<u8>)>>,
    done: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Watchdog {
    fn start(target: &'static str, dir: PathBuf, limit: Duration) -> Watchdog {
        let current = Arc::new(Mutex::new((Instant::now(), Vec::new())));
        let done = Arc::new(AtomicBool::new(false));
        let thread = {
            let (current, done) = (Arc::clone(&current), Arc::clone(&done));
            std::thread::spawn(move || {
                while !done.load(Ordering::Relaxed) {
                    std::thread::sleep(Duration::from_millis(100));
                    let guard = current.lock().unwrap_or_else(|e| e.into_inner());
                    if guard.0.elapsed() > limit {
                        let path = save(&dir.join(target), "hang", &guard.1);
                        eprintln!(
                            "fuzz {target}: a case ran past {} s; input saved as {}",
                            limit.as_secs(),
                            path.display()
                        );
                        std::process::abort();
                    }
                }
            })
        };
        Watchdog {
            current,
            done,
            thread: Some(thread),
        }
    }

    fn case(&self, input: &[u8]) {
        let mut guard = self.current.lock().unwrap_or_else(|e| e.into_inner());
        guard.0 = Instant::now();
        guard.1.clear();
        guard.1.extend_from_slice(input);
    }
}

impl Drop for Watchdog {
    fn drop(&mut self) {
        self.done.store(true, Ordering::Relaxed);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// Fuzzes `target` as the environment says; prints its report and returns it.
pub fn fuzz(target: &'static Target) -> Report {
    install_panic_hook();
    let settings = Settings::from_env();
    let findings_dir = settings.dir.join(target.name);
    let watchdog = Watchdog::start(target.name, settings.dir.clone(), settings.hang);
    let mut report = Report::default();
    let mut corpus: Vec<Vec<u8>> = (target.seeds)();
    corpus.extend(regressions(target.name));
    // Seeds and regressions stay; what the run adds takes turns after them.
    let fixed = corpus.len();
    let mut seen: std::collections::HashSet<u64> = std::collections::HashSet::new();
    let mut mutator = Mutator::new(settings.seed, MAX_INPUT, target.dictionary);
    let started = Instant::now();
    let record = |report: &mut Report, input: &[u8], finding: Finding| {
        let entry = report.findings.entry(finding.signature());
        let known = matches!(entry, std::collections::btree_map::Entry::Occupied(_));
        let slot = entry.or_insert_with(|| (0, PathBuf::new(), finding.clone()));
        slot.0 += 1;
        if !known {
            let smaller = shrink(target, input, &finding);
            slot.1 = save(&findings_dir, finding.kind(), &smaller);
        }
    };
    // Seeds and regressions first, as they are.
    for input in corpus.clone() {
        watchdog.case(&input);
        report.executions += 1;
        match run_case(target, &input) {
            Ok(summary) => drop(seen.insert(summary.unwrap_or(0))),
            Err(finding) => record(&mut report, &input, finding),
        }
    }
    loop {
        let more = match settings.budget {
            Budget::Cases(cases) => report.executions < cases,
            Budget::Time(limit) => started.elapsed() < limit,
        };
        if !more {
            break;
        }
        let input = mutator.next_case(&corpus);
        watchdog.case(&input);
        report.executions += 1;
        match run_case(target, &input) {
            Ok(Some(summary)) if seen.insert(summary) => {
                if corpus.len() < MAX_CORPUS.max(fixed + 1) {
                    corpus.push(input);
                } else {
                    let slot = fixed + mutator.rng.below(corpus.len() - fixed);
                    corpus[slot] = input;
                }
            }
            Ok(_) => {}
            Err(finding) => record(&mut report, &input, finding),
        }
    }
    drop(watchdog);
    report.elapsed = started.elapsed();
    report.corpus = corpus.len();
    println!("{}", report.summary(target.name, &settings.dir));
    report
}

/// Fuzzes `target` and fails with its findings, if any.
pub fn check(target: &'static Target) {
    let report = fuzz(target);
    assert!(
        report.findings.is_empty(),
        "{}",
        report.summary(target.name, &Settings::from_env().dir)
    );
}
