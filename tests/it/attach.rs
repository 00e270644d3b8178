//! `devtrace attach` against the stand-in driver and CUPTI: a workload
//! started without the injection library is attached while it waits in a
//! system call and its kernels are in the next capture; a thread spinning
//! in user code keeps every register through an attach; a thread that
//! never waits is borrowed outside malloc and restartable sequences, and
//! one waiting in epoll_wait without an EINTR; an attach killed
//! at each of its steps leaves the workload running to its end; a workload
//! in pid and mount namespaces of its own is attached by its host pid;
//! unprivileged callers, processes without the driver and processes
//! already injected are refused or left alone with a clear word. Attaching
//! needs root; without it these tests say so and pass without checking.

use crate::common;

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use common::workload::*;
use common::{is_root, AgentProcess, BIN};

fn skip_without_root(test: &str) -> bool {
    if is_root() {
        return false;
    }
    eprintln!("{test}: skipped, attaching needs root");
    true
}

/// An agent on the CUDA backend and what workloads need to reach it.
struct Setup {
    runtime: tempfile::TempDir,
    agent: AgentProcess,
}

impl Setup {
    fn new() -> Setup {
        Setup::with(&[])
    }

    /// An agent with `extra` flags, and the test's injection library for
    /// the attaches it makes itself.
    fn with(extra: &[&str]) -> Setup {
        let runtime = common::shared_directory();
        let library = inject_library();
        let mut args = vec![
            "--backend",
            "cuda",
            "--runtime-dir",
            runtime.path().to_str().unwrap(),
            "--inject-library",
            library.to_str().unwrap(),
        ];
        args.extend_from_slice(extra);
        let agent = AgentProcess::start(&args);
        Setup { runtime, agent }
    }

    fn runtime(&self) -> &str {
        self.runtime.path().to_str().unwrap()
    }

    /// The environment of a workload started plainly: the stand-in driver
    /// and CUPTI on its library path, no injection library, no runtime
    /// directory.
    fn plain_env() -> Vec<(&'static str, String)> {
        vec![
            ("LD_LIBRARY_PATH", cupti_standin().display().to_string()),
            ("DEVTRACE_STANDIN_GPU_KERNEL_NS", "5000".into()),
        ]
    }

    /// The CUDA workload, started plainly, waiting for `release`. With
    /// `recorded` it then waits for recording too (`--wait-recording`): it
    /// is to be attached and its kernels counted, however late a loaded
    /// machine lets the library start recording.
    fn plain_workload(
        &self,
        name: &str,
        iterations: &str,
        recorded: bool,
    ) -> (CudaWorkload, PathBuf) {
        let program = cuda_programs(name);
        let release = self.runtime.path().join(format!("{name}.go"));
        let env = Setup::plain_env();
        let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
        let mut args = vec![iterations, "--wait-file", release.to_str().unwrap()];
        if recorded {
            args.push("--wait-recording");
        }
        let workload = CudaWorkload::start(&program, &args, &env);
        workload.read_until("waiting");
        (workload, release)
    }
}

/// `devtrace attach PID` with the test's library and runtime directory.
fn attach(pid: u32, runtime: &str, extra_env: &[(&str, &str)]) -> std::process::Output {
    Command::new(BIN)
        .args(["attach", &pid.to_string(), "--runtime-dir", runtime])
        .arg("--library")
        .arg(inject_library())
        .envs(extra_env.iter().copied())
        .output()
        .expect("running devtrace attach")
}

fn said(output: &std::process::Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    )
}

/// The stand-in program's kernels in a trace.
fn kernels_of(space: &devtrace::proto::tensorflow::profiler::XSpace, pid: u32) -> usize {
    let line = format!("(pid {pid}: ");
    space
        .planes
        .iter()
        .filter(|p| p.name.starts_with("/device:GPU:"))
        .flat_map(|p| {
            let names = &p.event_metadata;
            p.lines
                .iter()
                .filter(|l| l.name.contains(&line))
                .flat_map(move |l| {
                    l.events
                        .iter()
                        .filter_map(move |e| names.get(&e.metadata_id))
                })
        })
        .filter(|m| m.name == "vector_add" || m.name == "matmul_tiled")
        .count()
}

#[tokio::test(flavor = "multi_thread")]
async fn a_workload_started_plainly_is_attached_and_its_kernels_are_in_the_next_capture() {
    if skip_without_root("attach_plain") {
        return;
    }
    let setup = Setup::new();
    let (workload, release) = setup.plain_workload("cuda_plain", "3", true);
    // It waits on its file: blocked in nanosleep, which the attach interrupts
    // and makes again.
    let out = attach(workload.workload.pid, setup.runtime(), &[]);
    assert!(out.status.success(), "{}", said(&out));
    assert!(
        said(&out).contains(&format!("attached {}", workload.workload.pid)),
        "{}",
        said(&out)
    );
    wait_for_attached(&setup.agent, 1).await;
    let space = capture_while(&setup.agent, 2000, &release).await;
    assert_eq!(kernels_of(&space, workload.workload.pid), 6);
    let end = workload.read_until("done");
    assert!(end.last().unwrap().starts_with("done"), "{end:?}");
    // The staged copy is gone; the library stays loaded.
    let staged: Vec<_> = std::fs::read_dir("/tmp")
        .unwrap()
        .filter_map(Result::ok)
        .filter(|e| {
            e.file_name()
                .to_string_lossy()
                .starts_with(&format!("devtrace-attach-{}-", workload.workload.pid))
        })
        .collect();
    assert!(staged.is_empty(), "{staged:?}");
    // A second attach finds it there and does nothing.
    let (again, release_again) = setup.plain_workload("cuda_plain_again", "1", false);
    let first = attach(again.workload.pid, setup.runtime(), &[]);
    assert!(first.status.success(), "{}", said(&first));
    let second = attach(again.workload.pid, setup.runtime(), &[]);
    assert!(second.status.success(), "{}", said(&second));
    assert!(
        said(&second).contains("loaded in it already"),
        "{}",
        said(&second)
    );
    std::fs::write(release_again, b"go").unwrap();
    again.read_until("done");
}

/// Attached while its thread is inside a driver call (a synchronize the
/// stand-in driver spends 150 ms in, in user code): the library loads from
/// there, the call returns as it would have, and the iterations after the
/// attach are captured.
#[tokio::test(flavor = "multi_thread")]
async fn a_workload_inside_a_driver_call_is_attached_and_runs_on() {
    if skip_without_root("attach_in_call") {
        return;
    }
    let setup = Setup::new();
    let program = cuda_programs("cuda_in_call");
    let release = setup.runtime.path().join("in_call.go");
    let mut env = Setup::plain_env();
    env.push(("DEVTRACE_STANDIN_SYNC_US", "150000".into()));
    let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
    let workload = CudaWorkload::start(
        &program,
        &["30", "--wait-file", release.to_str().unwrap()],
        &env,
    );
    workload.read_until("waiting");
    std::fs::write(&release, b"go").unwrap();
    // Well into its iterations, most of each spent synchronizing.
    tokio::time::sleep(std::time::Duration::from_millis(700)).await;
    let out = attach(workload.workload.pid, setup.runtime(), &[]);
    assert!(out.status.success(), "{}", said(&out));
    assert!(said(&out).contains("the main thread"), "{}", said(&out));
    wait_for_attached(&setup.agent, 1).await;
    let space = common::workload::capture(&setup.agent, 1500).await;
    assert!(
        kernels_of(&space, workload.workload.pid) >= 4,
        "{} kernels captured",
        kernels_of(&space, workload.workload.pid)
    );
    let calls = calls_until_done(&workload);
    assert_eq!(
        calls
            .iter()
            .filter(|c| c.name == "cuStreamSynchronize")
            .count(),
        30
    );
    assert!(calls
        .iter()
        .all(|c| c.fields.get("rc").map(String::as_str) == Some("0")));
}

/// A program of the stand-ins that never waits, started plainly, once it
/// has said `first`; the rest of what it says.
fn start_spinning(
    program: &Path,
    args: &[&str],
    first: &str,
) -> (
    std::process::Child,
    std::io::Lines<BufReader<std::process::ChildStdout>>,
) {
    let mut child = Command::new(program)
        .args(args)
        .envs(Setup::plain_env())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let said_first = lines.next().unwrap().unwrap();
    assert!(said_first.starts_with(first), "{said_first}");
    (child, lines)
}

#[tokio::test(flavor = "multi_thread")]
async fn a_thread_spinning_in_user_code_keeps_every_register_through_an_attach() {
    if skip_without_root("attach_registers") {
        return;
    }
    if !std::is_x86_feature_detected!("avx") {
        eprintln!("attach_registers: skipped, the check needs AVX");
        return;
    }
    let setup = Setup::new();
    let program = cuda_linked("regs_workload.c", "regs_workload", &["-mavx"]);
    for round in 0..3 {
        let (mut child, lines) = start_spinning(&program, &["3"], "spinning");
        // Into the spin, at a different moment each round.
        std::thread::sleep(std::time::Duration::from_millis(300 + 400 * round));
        let out = attach(child.id(), setup.runtime(), &[]);
        if !out.status.success() {
            // Whether it was still there, and what it mapped, for the reader.
            let maps =
                std::fs::read_to_string(format!("/proc/{}/maps", child.id())).unwrap_or_default();
            let driver: Vec<&str> = maps.lines().filter(|l| l.contains("cuda")).collect();
            panic!(
                "round {round}: {}; the workload: {:?}, its driver mappings: {driver:?}",
                said(&out),
                child.try_wait()
            );
        }
        assert!(said(&out).contains("the main thread"), "{}", said(&out));
        let rest: Vec<String> = lines.map_while(Result::ok).collect();
        assert_eq!(rest, ["registers intact", "done"], "round {round}");
        assert!(child.wait().unwrap().success());
    }
}

/// A process whose only running thread never waits is borrowed where it
/// runs, but never inside malloc (whose lock `dlopen` would wait on for
/// ever: the attach would time out and the process hang) nor inside a
/// restartable sequence (which would go on unguarded after the detour).
/// Each round attaches at another moment of a program that spends most
/// of its time in one or the other.
#[tokio::test(flavor = "multi_thread")]
async fn a_thread_that_never_waits_is_borrowed_outside_malloc_and_restartable_sequences() {
    if skip_without_root("attach_busy") {
        return;
    }
    let setup = Setup::new();
    let program = cuda_linked("borrow_workload.c", "borrow_workload", &["-pthread"]);
    for mode in ["malloc", "rseq"] {
        for round in 0..4 {
            let (mut child, lines) = start_spinning(&program, &[mode, "60"], "busy");
            std::thread::sleep(std::time::Duration::from_millis(200 + 150 * round));
            let out = Command::new(BIN)
                .args(["attach", &child.id().to_string(), "--runtime-dir"])
                .arg(setup.runtime())
                .arg("--library")
                .arg(inject_library())
                // A dlopen stuck on malloc's lock never returns: fail soon.
                .args(["--load-timeout", "5s"])
                // Half the rounds find the sequence as on kernels before
                // 5.13, through the C library's own variables.
                .envs((round >= 2).then_some(("DEVTRACE_ATTACH_RSEQ_FROM_LIBC", "1")))
                .output()
                .expect("running devtrace attach");
            if !out.status.success() {
                let _ = child.kill();
            }
            assert!(out.status.success(), "{mode} round {round}: {}", said(&out));
            assert!(said(&out).contains("the main thread"), "{}", said(&out));
            // SAFETY: a signal to the child this test started and has not
            // reaped.
            unsafe { libc::kill(child.id() as i32, libc::SIGUSR1) };
            let rest: Vec<String> = lines.map_while(Result::ok).collect();
            let expected: &[&str] = match (mode, rest.first().map(String::as_str)) {
                ("malloc", _) => &["done"],
                (_, Some("rseq unavailable")) => {
                    eprintln!("attach_busy: this kernel or C library has no rseq");
                    &["rseq unavailable", "done"]
                }
                _ => &["sequences guarded", "done"],
            };
            assert_eq!(rest, expected, "{mode} round {round}");
            assert!(child.wait().unwrap().success());
        }
    }
}

/// A thread waiting in `epoll_wait` is borrowed without the program ever
/// seeing the `EINTR` the kernel fails that wait with after a stop: the
/// wait is made again.
#[tokio::test(flavor = "multi_thread")]
async fn a_thread_waiting_in_epoll_is_borrowed_and_its_wait_goes_on() {
    if skip_without_root("attach_epoll") {
        return;
    }
    let setup = Setup::new();
    let program = cuda_linked("borrow_workload.c", "borrow_workload", &["-pthread"]);
    let (mut child, lines) = start_spinning(&program, &["epoll", "60"], "busy");
    // Once its thread waits in epoll_wait (232), however loaded the machine.
    let waiting = || {
        std::fs::read_dir(format!("/proc/{}/task", child.id()))
            .into_iter()
            .flatten()
            .flatten()
            .any(|task| {
                std::fs::read_to_string(task.path().join("syscall"))
                    .is_ok_and(|call| call.starts_with("232 "))
            })
    };
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while !waiting() && std::time::Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    let out = attach(child.id(), setup.runtime(), &[]);
    // SAFETY: a signal to the child this test started and has not reaped.
    unsafe { libc::kill(child.id() as i32, libc::SIGUSR1) };
    assert!(out.status.success(), "{}", said(&out));
    assert!(
        said(&out).contains("blocked in system call 232"),
        "{}",
        said(&out)
    );
    let rest: Vec<String> = lines.map_while(Result::ok).collect();
    assert_eq!(rest, ["epoll_wait interrupted: 0", "done"]);
    assert!(child.wait().unwrap().success());
}

/// The steps an attach may be killed at (`DEVTRACE_ATTACH_PAUSE_AT`).
const STEPS: [&str; 6] = [
    "staged", "stopped", "mapped", "written", "switched", "detached",
];

#[tokio::test(flavor = "multi_thread")]
async fn an_attach_killed_at_any_step_leaves_the_workload_running_to_its_end() {
    if skip_without_root("attach_killed") {
        return;
    }
    let setup = Setup::new();
    for step in STEPS {
        let (workload, release) = setup.plain_workload(&format!("cuda_killed_{step}"), "2", false);
        let mut attaching = Command::new(BIN)
            .args(["attach", &workload.workload.pid.to_string()])
            .args(["--runtime-dir", setup.runtime()])
            .arg("--library")
            .arg(inject_library())
            .env("DEVTRACE_ATTACH_PAUSE_AT", step)
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let mut stderr = BufReader::new(attaching.stderr.take().unwrap());
        let mut line = String::new();
        stderr.read_line(&mut line).unwrap();
        assert!(
            line.contains(&format!("paused at {step}")),
            "{step}: {line}"
        );
        attaching.kill().unwrap();
        attaching.wait().unwrap();
        // Not left stopped: it runs its iterations once let go, and ends well.
        std::fs::write(&release, b"go").unwrap();
        let calls = calls_until_done(&workload);
        assert_eq!(
            calls
                .iter()
                .filter(|c| c.name.starts_with("cuLaunchKernel"))
                .count(),
            4,
            "{step}"
        );
        let mut workload = workload;
        let status = workload.workload.child.wait().unwrap();
        assert!(status.success(), "{step}: {status:?}");
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_workload_in_namespaces_of_its_own_is_attached_by_its_host_pid() {
    if skip_without_root("attach_namespaces") {
        return;
    }
    let setup = Setup::new();
    let program = cuda_programs("cuda_contained_plain");
    let release = setup.runtime.path().join("contained.go");
    let env = Setup::plain_env();
    let mut command = Command::new("unshare");
    command
        .args(["--pid", "--mount", "--fork", "--kill-child"])
        .arg(&program)
        .args([
            "3",
            "--wait-file",
            release.to_str().unwrap(),
            "--wait-recording",
        ]);
    let mut child = command
        .envs(env.iter().map(|(k, v)| (*k, v.as_str())))
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let unshare = child.id();
    // Killed with the test should it fail.
    let _contained = Workload {
        child,
        pid: unshare,
    };
    lines
        .by_ref()
        .map_while(Result::ok)
        .find(|l| l.starts_with("waiting"))
        .expect("the workload waits for its file");
    let children =
        std::fs::read_to_string(format!("/proc/{unshare}/task/{unshare}/children")).unwrap();
    let host_pid: u32 = children.split_whitespace().next().unwrap().parse().unwrap();
    let out = attach(host_pid, setup.runtime(), &[]);
    assert!(out.status.success(), "{}", said(&out));
    wait_for_attached(&setup.agent, 1).await;
    let space = capture_while(&setup.agent, 2000, &release).await;
    assert_eq!(kernels_of(&space, host_pid), 6);
    let rest: Vec<String> = lines.map_while(Result::ok).collect();
    assert!(rest.iter().any(|l| l.starts_with("done")), "{rest:?}");
}

/// `serve --cuda-attach`: the agent attaches by itself to a process that
/// matches a rule once it maps the driver, and leaves one that does not
/// alone.
#[tokio::test(flavor = "multi_thread")]
async fn the_agent_attaches_by_itself_to_processes_its_rules_match() {
    if skip_without_root("cuda_attach") {
        return;
    }
    let setup = Setup::with(&["--cuda-attach", "comm=cuda_auto*"]);
    let (other, release_other) = setup.plain_workload("cuda_other", "1", false);
    let (matched, release) = setup.plain_workload("cuda_auto_one", "3", true);
    wait_for_attached(&setup.agent, 1).await;
    let space = capture_while(&setup.agent, 2000, &release).await;
    assert_eq!(kernels_of(&space, matched.workload.pid), 6);
    assert_eq!(kernels_of(&space, other.workload.pid), 0);
    let maps = std::fs::read_to_string(format!("/proc/{}/maps", other.workload.pid)).unwrap();
    assert!(!maps.contains("libdevtrace_inject"));
    std::fs::write(release_other, b"go").unwrap();
    other.read_until("done");
    matched.read_until("done");
}

/// A process that execs into a program a rule matches (a launcher script's
/// `exec python train.py`) is judged again as the new program: the pid and
/// start time stay, the executable changes.
#[tokio::test(flavor = "multi_thread")]
async fn a_process_that_execs_into_a_match_is_attached() {
    if skip_without_root("cuda_attach_exec") {
        return;
    }
    let setup = Setup::with(&["--cuda-attach", "comm=cuda_auto*"]);
    let program = cuda_programs("cuda_auto_exec");
    let release = setup.runtime.path().join("exec.go");
    let env = Setup::plain_env();
    let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
    // "sh" matches no rule for the watcher's first looks.
    let script = format!(
        "sleep 2.5; exec {} 3 --wait-file {} --wait-recording",
        program.display(),
        release.display()
    );
    let launcher = CudaWorkload::start(Path::new("sh"), &["-c", &script], &env);
    launcher.read_until("waiting");
    wait_for_attached(&setup.agent, 1).await;
    let space = capture_while(&setup.agent, 2000, &release).await;
    assert_eq!(kernels_of(&space, launcher.workload.pid), 6);
    launcher.read_until("done");
}

/// A capture may name processes for the agent to attach first
/// (`devtrace capture --attach`): its own user's, or any for an admin. A
/// user naming another user's process is told why not, and that process
/// is left alone.
#[tokio::test(flavor = "multi_thread")]
async fn a_capture_has_the_agent_attach_the_processes_it_names_first() {
    if skip_without_root("capture_attach") {
        return;
    }
    let setup = Setup::new();
    let (workload, release) = setup.plain_workload("cuda_named", "3", true);
    let logdir = tempfile::tempdir().unwrap();
    let pid = workload.workload.pid.to_string();
    let capture = Command::new(BIN)
        .args([
            "capture",
            &setup.agent.address,
            "--duration",
            "3s",
            "--quiet",
        ])
        .args(["--attach", &pid, "--logdir"])
        .arg(logdir.path())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Once attached and recording, the workload runs its kernels.
    wait_for_attached(&setup.agent, 1).await;
    tokio::time::sleep(std::time::Duration::from_millis(800)).await;
    std::fs::write(&release, b"go").unwrap();
    let out = capture.wait_with_output().unwrap();
    assert!(out.status.success(), "{}", said(&out));
    let path = String::from_utf8_lossy(&out.stdout).trim().to_string();
    let space = {
        use prost::Message;
        let file = std::fs::read_dir(&path)
            .map(|mut d| d.next().unwrap().unwrap().path())
            .unwrap_or_else(|_| PathBuf::from(&path));
        devtrace::proto::tensorflow::profiler::XSpace::decode(&std::fs::read(file).unwrap()[..])
            .unwrap()
    };
    assert_eq!(kernels_of(&space, workload.workload.pid), 6);
    assert!(
        space
            .warnings
            .iter()
            .any(|w| w.starts_with(&format!("process {pid} was attached for this capture"))),
        "{:?}",
        space.warnings
    );
    workload.read_until("done");

    // uid 65534 naming root's process: told why not; nothing is loaded.
    let (roots, release) = setup.plain_workload("cuda_not_named", "1", false);
    let space = capture_as(65534, &setup, roots.workload.pid).await;
    let why = format!(
        "process {} was not attached: it is uid 0's, not yours",
        roots.workload.pid
    );
    assert!(space.warnings.contains(&why), "{:?}", space.warnings);
    let maps = std::fs::read_to_string(format!("/proc/{}/maps", roots.workload.pid)).unwrap();
    assert!(!maps.contains("libdevtrace_inject"));
    std::fs::write(release, b"go").unwrap();
    roots.read_until("done");
}

/// A 300 ms capture asked by `uid` that names process `pid` to attach
/// first (`devtrace_attach`).
async fn capture_as(
    uid: u32,
    setup: &Setup,
    pid: u32,
) -> devtrace::proto::tensorflow::profiler::XSpace {
    use devtrace::proto::tensorflow::profile_options::{
        advanced_config_value::Value, AdvancedConfigValue,
    };
    let mut asked = common::request(300, "attach-as-user");
    asked.emit_xspace = true;
    asked.opts.as_mut().unwrap().advanced_configuration.insert(
        "devtrace_attach".into(),
        AdvancedConfigValue {
            value: Some(Value::StringValue(pid.to_string())),
        },
    );
    let io = common::raw_call::connect_as(uid, &setup.agent.address).await;
    let (reply, status) = common::raw_call::unary_on(
        io,
        &setup.agent.address,
        "/tensorflow.ProfilerService/Profile",
        &asked,
    )
    .await;
    assert_eq!(status.code(), tonic::Code::Ok, "{status:?}");
    let reply = {
        use prost::Message;
        devtrace::proto::tensorflow::ProfileResponse::decode(&reply[..]).unwrap()
    };
    common::space_of(&reply)
}

/// A user has attached only processes it could trace itself: its own, in
/// one group, without capabilities, dumpable. The agent traces with root's
/// rights, so a set-group-ID program or one that asked not to be inspected
/// is left to admins.
#[tokio::test(flavor = "multi_thread")]
async fn a_user_has_attached_only_what_it_could_trace_itself() {
    if skip_without_root("user_attach") {
        return;
    }
    let setup = Setup::new();
    let start = |ids: &[&str], program: &[&str]| {
        Command::new("setpriv")
            .args(ids)
            .args(["--clear-groups", "--"])
            .args(program)
            .stdout(Stdio::null())
            .spawn()
            .unwrap()
    };
    let user = ["--reuid=65534", "--regid=65534"];
    let mut own = start(&user, &["sleep", "30"]);
    let mut between_groups = start(
        &["--reuid=65534", "--rgid=65534", "--egid=100"],
        &["sleep", "30"],
    );
    // PR_SET_DUMPABLE (4) to 0, through prctl (157 on x86-64).
    let mut undumpable = start(
        &user,
        &["perl", "-e", "syscall(157, 4, 0, 0, 0, 0); sleep 30"],
    );
    tokio::time::sleep(std::time::Duration::from_millis(500)).await;
    let said_of = |space: &devtrace::proto::tensorflow::profiler::XSpace, pid: u32| {
        let prefix = format!("process {pid} was not attached: ");
        space
            .warnings
            .iter()
            .find_map(|w| w.strip_prefix(&prefix).map(str::to_string))
            .unwrap_or_else(|| panic!("nothing said of {pid}: {:?}", space.warnings))
    };
    // Its own plain process passes the user's check (and is then refused
    // as the non-CUDA process it is).
    let why = said_of(&capture_as(65534, &setup, own.id()).await, own.id());
    assert!(why.contains("libcuda"), "{why}");
    let why = said_of(
        &capture_as(65534, &setup, between_groups.id()).await,
        between_groups.id(),
    );
    assert!(
        why.starts_with("it runs between groups (set-group-ID)"),
        "{why}"
    );
    let why = said_of(
        &capture_as(65534, &setup, undumpable.id()).await,
        undumpable.id(),
    );
    assert!(why.starts_with("it is not dumpable"), "{why}");
    for child in [&mut own, &mut between_groups, &mut undumpable] {
        let _ = child.kill();
        let _ = child.wait();
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn attaches_that_cannot_or_need_not_be_made_say_why() {
    if skip_without_root("attach_refusals") {
        return;
    }
    let setup = Setup::new();
    // Not a CUDA process.
    let mut sleeper = Command::new("sleep").arg("30").spawn().unwrap();
    let out = attach(sleeper.id(), setup.runtime(), &[]);
    assert!(!out.status.success());
    assert!(
        said(&out).contains("does not map libcuda.so"),
        "{}",
        said(&out)
    );
    sleeper.kill().unwrap();
    sleeper.wait().unwrap();
    // No such process.
    let out = attach(u32::MAX / 2, setup.runtime(), &[]);
    assert!(!out.status.success());
    assert!(said(&out).contains("no such process"), "{}", said(&out));
    // A user may not trace root's process.
    let (workload, release) = setup.plain_workload("cuda_roots", "1", false);
    let out = Command::new("setpriv")
        .args(["--reuid=65534", "--regid=65534", "--clear-groups", "--"])
        .arg(BIN)
        .args([
            "attach",
            &workload.workload.pid.to_string(),
            "--runtime-dir",
            setup.runtime(),
        ])
        .arg("--library")
        .arg(inject_library())
        .output()
        .unwrap();
    assert!(!out.status.success());
    let text = said(&out);
    assert!(text.contains("not permitted to trace it"), "{text}");
    std::fs::write(&release, b"go").unwrap();
    workload.read_until("done");
    // Started with the library named, before its cuInit loads it: nothing
    // to do.
    let program = cuda_programs("cuda_named_early");
    let early = setup.runtime.path().join("early.go");
    let library = inject_library();
    let mut env = Setup::plain_env();
    env.push(("CUDA_INJECTION64_PATH", library.display().to_string()));
    env.push(("DEVTRACE_RUNTIME_DIR", setup.runtime().to_string()));
    let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
    let named = CudaWorkload::start(
        &program,
        &["1", "--init-wait-file", early.to_str().unwrap()],
        &env,
    );
    named.read_until("waiting");
    let out = attach(named.workload.pid, setup.runtime(), &[]);
    assert!(out.status.success(), "{}", said(&out));
    assert!(
        said(&out).contains("loaded in it already"),
        "{}",
        said(&out)
    );
    std::fs::write(&early, b"go").unwrap();
    named.read_until("done");
    // No library where it was said to be.
    let out = Command::new(BIN)
        .args(["attach", "1", "--library", "/nonexistent/lib.so"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(said(&out).contains("no injection library at /nonexistent/lib.so"));
}
