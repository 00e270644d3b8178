//! The GPU quick start of the book (`docs/src/quickstart-pytorch.md`), run
//! as written: every block marked `sh,quickstart` runs in bash, in order,
//! against the stand-in CUDA driver, CUPTI and NVML, with `python3
//! train.py` standing for the stand-in CUDA job and `sudo` for nothing (the
//! tests run as root). The page's own address (127.0.0.1:6009) is swapped
//! for a free port, and the agent's runtime directory for a temporary one,
//! through the environment the agent reads. The messages the page quotes
//! for common failures are checked against what the program prints.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crate::common::workload::{cuda_programs, cupti_standin, inject_library};
use crate::common::{build_standin, BIN};

const PAGE: &str = include_str!("../../docs/src/quickstart-pytorch.md");
const PAGE_ADDRESS: &str = "127.0.0.1:6009";

/// The fenced blocks whose info string is `lang`, in page order.
fn blocks(lang: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut current: Option<String> = None;
    for line in PAGE.lines() {
        match (&mut current, line.strip_prefix("```")) {
            (None, Some(info)) if info.trim() == lang => current = Some(String::new()),
            (Some(block), Some("")) => {
                out.push(std::mem::take(block));
                current = None;
            }
            (Some(block), _) => {
                block.push_str(line);
                block.push('\n');
            }
            (None, _) => {}
        }
    }
    out
}

/// The page's text with every run of whitespace made one space, so that a
/// quoted message may wrap.
fn page_words() -> String {
    PAGE.split_whitespace().collect::<Vec<_>>().join(" ")
}

fn free_port() -> u16 {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    listener.local_addr().unwrap().port()
}

/// A user's machine: a home, a directory holding `target/release`, the
/// stand-ins on the loader's path and the page's commands' environment.
struct Host {
    home: tempfile::TempDir,
    work: tempfile::TempDir,
    runtime: tempfile::TempDir,
    shims: tempfile::TempDir,
    logs: tempfile::TempDir,
    standins: PathBuf,
    port: u16,
    /// The process group of every block run, ended with the test (the
    /// agent and the jobs are put in the background in them).
    groups: Vec<i32>,
}

impl Drop for Host {
    fn drop(&mut self) {
        for group in &self.groups {
            // SAFETY: kill has no memory preconditions.
            unsafe { libc::kill(-group, libc::SIGKILL) };
        }
    }
}

impl Host {
    fn new() -> Host {
        let standins = cupti_standin();
        // The NVML stand-in beside the driver and CUPTI stand-ins.
        let nvml = build_standin("nvml.c", "libnvidia-ml.so.1");
        assert_eq!(nvml.parent(), Some(standins.as_path()));
        let work = tempfile::tempdir().unwrap();
        let release = work.path().join("target/release");
        std::fs::create_dir_all(&release).unwrap();
        std::os::unix::fs::symlink(BIN, release.join("devtrace")).unwrap();
        std::os::unix::fs::symlink(inject_library(), release.join("libdevtrace_inject.so"))
            .unwrap();
        let shims = tempfile::tempdir().unwrap();
        let job = cuda_programs("quickstart_job");
        let python = find_on_path("python3").unwrap_or_else(|| PathBuf::from("/bin/false"));
        write_executable(
            &shims.path().join("python3"),
            &format!(
                "#!/bin/sh\n# train.py is the stand-in CUDA job; anything else goes to python3.\n\
                 if [ \"$1\" = train.py ]; then exec {} 100000 --sleep-ms 5; fi\nexec {} \"$@\"\n",
                job.display(),
                python.display()
            ),
        );
        // The tests run as root: sudo runs its command, and -v has nothing
        // to ask.
        write_executable(
            &shims.path().join("sudo"),
            "#!/bin/sh\n[ \"$1\" = -v ] && exit 0\nexec \"$@\"\n",
        );
        Host {
            home: tempfile::tempdir().unwrap(),
            work,
            runtime: tempfile::tempdir().unwrap(),
            shims,
            logs: tempfile::tempdir().unwrap(),
            standins,
            port: free_port(),
            groups: Vec::new(),
        }
    }

    fn address(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    /// Runs `script` in bash, in the work directory with the page's
    /// environment and `library_path` for the loader, in a process group
    /// of its own, until bash ends (what it puts in the background goes
    /// on); what it printed, and whether it succeeded.
    fn run_with(&mut self, script: &str, library_path: &Path) -> (bool, String) {
        let path = format!(
            "{}:{}",
            self.shims.path().display(),
            std::env::var("PATH").unwrap_or_default()
        );
        // Into a file, not a pipe: a command left in the background keeps
        // its output open, and reading a pipe to its end would wait for it.
        let log = self
            .logs
            .path()
            .join(format!("block-{}", self.groups.len()));
        let file = std::fs::File::create(&log).unwrap();
        let mut command = Command::new("bash");
        command
            .args(["-euo", "pipefail", "-c"])
            .arg(script.replace(PAGE_ADDRESS, &self.address()))
            .current_dir(self.work.path())
            .env("HOME", self.home.path())
            .env("PATH", path)
            .env("LD_LIBRARY_PATH", library_path)
            .env("DEVTRACE_RUNTIME_DIR", self.runtime.path())
            .env("DEVTRACE_LISTEN", self.address())
            .env("DEVTRACE_METRICS_LISTEN", "off")
            .stdin(Stdio::null())
            .stdout(file.try_clone().unwrap())
            .stderr(file);
        std::os::unix::process::CommandExt::process_group(&mut command, 0);
        let mut child = command.spawn().expect("running bash");
        self.groups.push(child.id() as i32);
        let deadline = Instant::now() + Duration::from_secs(60);
        let status = loop {
            if let Some(status) = child.try_wait().unwrap() {
                break status;
            }
            assert!(
                Instant::now() < deadline,
                "{script}\ndid not end within 60 s"
            );
            std::thread::sleep(Duration::from_millis(20));
        };
        let text = std::fs::read_to_string(&log).unwrap_or_default();
        (status.success(), text)
    }

    /// As [`Host::run_with`], with the stand-ins on the loader's path, and
    /// the block must succeed.
    fn run(&mut self, script: &str) -> String {
        let standins = self.standins.clone();
        let (ok, text) = self.run_with(script, &standins);
        assert!(ok, "{script}\nfailed:\n{text}");
        text
    }

    /// Waits until `done` holds (the agent listening, a job's ring made).
    fn wait_for(&self, what: &str, done: impl Fn() -> bool) {
        let deadline = Instant::now() + Duration::from_secs(30);
        while !done() {
            assert!(Instant::now() < deadline, "{what} within 30 s");
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    fn rings(&self) -> usize {
        std::fs::read_dir(self.runtime.path())
            .map(|entries| {
                entries
                    .filter_map(Result::ok)
                    .filter(|entry| entry.file_name().to_string_lossy().ends_with(".ring"))
                    .count()
            })
            .unwrap_or(0)
    }
}

fn find_on_path(name: &str) -> Option<PathBuf> {
    std::env::split_paths(&std::env::var_os("PATH")?)
        .map(|dir| dir.join(name))
        .find(|candidate| candidate.is_file())
}

fn write_executable(path: &Path, text: &str) {
    use std::os::unix::fs::PermissionsExt;
    std::fs::write(path, text).unwrap();
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o755)).unwrap();
}

/// The page's steps, in order: install, doctor, agent, job, capture and
/// inspect; and between agent and job, a job without the library, which
/// the page says leaves no Stream lines.
#[test]
fn the_quick_start_reaches_a_trace_with_the_jobs_kernels() {
    let steps = blocks("sh,quickstart");
    assert_eq!(
        steps.len(),
        5,
        "install, doctor, serve, job, capture: {steps:#?}"
    );
    let mut host = Host::new();

    host.run(&steps[0]);
    assert!(host
        .home
        .path()
        .join("devtrace/libdevtrace_inject.so")
        .is_file());

    let doctor = host.run(&steps[1]);
    assert!(
        doctor.contains("NVML: driver 580.00-standin, CUDA 13.0, 2 GPUs"),
        "{doctor}"
    );
    assert!(
        doctor.contains("CUDA driver: libcuda.so.1 supports CUDA"),
        "{doctor}"
    );
    assert!(
        doctor.contains("start jobs with CUDA_INJECTION64_PATH="),
        "{doctor}"
    );
    assert!(doctor.contains("\nready:"), "{doctor}");

    host.run(&steps[2]);
    let address = host.address();
    host.wait_for("the agent listening", || {
        std::net::TcpStream::connect(&address).is_ok()
    });

    // A job started without the variable: the capture has no Stream line.
    let plain = host.run("python3 train.py > /dev/null 2>&1 &\nsleep 0.5\necho started");
    assert!(plain.contains("started"));
    let capture = steps[4].replace("~/traces", "~/plain-traces");
    let without = host.run(&capture);
    assert!(without.contains("_counters_"), "{without}");
    assert!(!without.contains("Stream #"), "{without}");
    assert_eq!(host.rings(), 0, "a job without the library made a ring");

    host.run(&steps[3]);
    host.wait_for("the job's ring", || host.rings() == 1);
    let traced = host.run(&steps[4]);
    assert!(traced.contains("xplane.pb"), "{traced}");
    assert!(traced.contains("plane /device:GPU:0"), "{traced}");
    assert!(traced.contains("Stream #"), "{traced}");
    assert!(traced.contains("(pid "), "{traced}");
    assert!(traced.contains("matmul_tiled"), "{traced}");
}

/// The page's train.py is Python that compiles (PyTorch itself is not
/// here to run it).
#[test]
fn the_quick_starts_training_loop_is_python() {
    let [train] = &blocks("python")[..] else {
        panic!("one python block on the page");
    };
    let Some(python) = find_on_path("python3") else {
        eprintln!("no python3: the training loop is not compiled");
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("train.py");
    std::fs::write(&file, train).unwrap();
    let output = Command::new(python)
        .args(["-m", "py_compile"])
        .arg(&file)
        .output()
        .unwrap();
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
}

/// The failures the page describes print what the page quotes.
#[test]
fn the_quick_starts_failures_print_what_the_page_quotes() {
    let page = page_words();
    let host = Host::new();
    let as_on_the_page = |text: &str| {
        text.replace(&host.address(), PAGE_ADDRESS)
            .split_whitespace()
            .collect::<Vec<_>>()
            .join(" ")
    };

    // No agent: capture fails at once.
    let capture = Command::new(BIN)
        .args(["capture", &format!("grpc://{}", host.address())])
        .args(["--duration", "1s", "--quiet", "--logdir"])
        .arg(host.home.path().join("traces"))
        .output()
        .unwrap();
    assert!(!capture.status.success());
    let stderr = String::from_utf8_lossy(&capture.stderr);
    let said = as_on_the_page(stderr.lines().last().unwrap_or_default());
    assert!(page.contains(&said), "the page does not quote: {said}");

    // The address taken: serve cannot start.
    let holder = std::net::TcpListener::bind(host.address()).unwrap();
    let serve = Command::new(BIN)
        .args([
            "serve",
            "--listen",
            &host.address(),
            "--metrics-listen",
            "off",
        ])
        .args(["--backend", "mock"])
        .output()
        .unwrap();
    drop(holder);
    assert!(!serve.status.success());
    let stderr = String::from_utf8_lossy(&serve.stderr);
    let last = stderr.lines().last().unwrap_or_default();
    let said = as_on_the_page(last);
    assert!(page.contains(&said), "the page does not quote: {said}");

    // A job that finds no libcupti: the driver stand-in alone.
    let driver_only = tempfile::tempdir().unwrap();
    for name in ["libcuda.so.1", "libcuda.so"] {
        std::fs::copy(host.standins.join(name), driver_only.path().join(name)).unwrap();
    }
    let job = cuda_programs("quickstart_job");
    // Long enough (a second) for the library's thread to look for libcupti
    // before the job ends, however loaded the machine: a job of a few
    // milliseconds could end first, and say nothing.
    let output = Command::new(&job)
        .args(["100", "--sleep-ms", "10"])
        .env("LD_LIBRARY_PATH", driver_only.path())
        .env("CUDA_INJECTION64_PATH", inject_library())
        .env("DEVTRACE_RUNTIME_DIR", host.runtime.path())
        .env_remove("DEVTRACE_CUPTI_PATH")
        .env_remove("CUDA_HOME")
        .output()
        .unwrap();
    assert!(output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    let line = stderr
        .lines()
        .find(|line| line.contains("libcupti was not found"))
        .unwrap_or_else(|| panic!("no word of libcupti: {stderr}"));
    // The page elides the list of places tried.
    let (before, after) = line.split_once("tried ").unwrap();
    let (_, end) = after.rsplit_once(')').unwrap();
    for part in [before, end] {
        let said = as_on_the_page(part);
        assert!(page.contains(&said), "the page does not quote: {said}");
    }
}
