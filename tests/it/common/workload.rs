//! Workloads the tests start and read: the CUDA stand-ins and a program
//! calling them with known arguments, the lines it prints, and the events of
//! a trace with their stats resolved.

use std::collections::HashMap;
use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};

use devtrace::proto::tensorflow::profiler::{x_event, XPlane, XSpace};
use devtrace::xspace::read::{find_stat, StatValue};

use super::{build_program, request, space_of, AgentProcess};

/// A started workload; killed when dropped.
pub struct Workload {
    pub child: Child,
    pub pid: u32,
}

impl Drop for Workload {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// One event of a plane, with its name and stats resolved.
#[derive(Debug)]
pub struct Seen {
    pub line: String,
    pub name: String,
    pub offset_ps: i64,
    pub duration_ps: i64,
    pub stats: HashMap<String, StatValue>,
}

pub fn events(plane: &XPlane) -> Vec<Seen> {
    let mut out = Vec::new();
    for line in &plane.lines {
        for event in &line.events {
            let stats = event
                .stats
                .iter()
                .filter_map(|stat| {
                    let name = plane.stat_metadata.get(&stat.metadata_id)?.name.clone();
                    let value = find_stat(plane, &event.stats, &name)?;
                    Some((name, value))
                })
                .collect();
            out.push(Seen {
                line: line.name.clone(),
                name: plane.event_metadata[&event.metadata_id].name.clone(),
                offset_ps: match event.data {
                    Some(x_event::Data::OffsetPs(ps)) => ps,
                    _ => 0,
                },
                duration_ps: event.duration_ps,
                stats,
            });
        }
    }
    out
}

pub fn uint(seen: &Seen, stat: &str) -> u64 {
    match seen.stats.get(stat) {
        Some(StatValue::Uint(v)) => *v,
        Some(StatValue::Int(v)) => *v as u64,
        other => panic!("{stat} of {seen:?}: {other:?}"),
    }
}

pub fn text<'s>(seen: &'s Seen, stat: &str) -> &'s str {
    match seen.stats.get(stat) {
        Some(StatValue::Str(v)) => v,
        other => panic!("{stat} of {seen:?}: {other:?}"),
    }
}

pub async fn capture(agent: &AgentProcess, duration_ms: u64) -> XSpace {
    let reply = agent
        .client()
        .await
        .profile(request(duration_ms, "ebpf"))
        .await
        .expect("Profile")
        .into_inner();
    space_of(&reply)
}

/// The stand-in driver (`libcuda.so.1`, with `libcuda.so` beside it) and a
/// program linked against it, copied to `name` (its command name).
pub fn cuda_programs(name: &str) -> std::path::PathBuf {
    cuda_linked("cuda_workload.c", name, &["-pthread"])
}

/// The stand-in program `source` linked against the stand-in driver, as
/// `name`, with `flags`.
pub fn cuda_linked(source: &str, name: &str, flags: &[&str]) -> std::path::PathBuf {
    let dir = standin_driver_dir();
    let search = format!("-L{}", dir.display());
    let rpath = format!("-Wl,-rpath,{}", dir.display());
    let mut args = flags.to_vec();
    args.extend([search.as_str(), "-lcuda", rpath.as_str()]);
    build_program(source, name, &args)
}

/// The directory of the stand-in driver (`libcuda.so.1`, `libcuda.so`).
pub fn standin_driver_dir() -> std::path::PathBuf {
    standin_library("libcuda.c", "libcuda.so.1", "libcuda.so")
}

/// Builds a stand-in library under its soname, with the unversioned name
/// (`link`) beside it as real installs have; returns their directory.
fn standin_library(source: &str, soname: &str, link: &str) -> std::path::PathBuf {
    let flag = format!("-Wl,-soname,{soname}");
    let library = build_program(
        source,
        soname,
        &["-shared", "-fPIC", &flag, "-ldl", "-pthread"],
    );
    let dir = library.parent().expect("standin directory").to_path_buf();
    let link = dir.join(link);
    if std::fs::symlink_metadata(&link).is_err() {
        // Another test process may have made it first.
        let _ = std::os::unix::fs::symlink(soname, &link);
    }
    dir
}

/// One call line of the workload's output.
#[derive(Debug, Clone)]
pub struct Call {
    pub name: String,
    pub pid: u32,
    pub tid: u64,
    pub realtime: (u64, u64),
    pub fields: HashMap<String, String>,
}

pub fn parse_call(line: &str) -> Option<Call> {
    let mut words = line.split_whitespace();
    if words.next()? != "call" {
        return None;
    }
    let name = words.next()?.to_string();
    let fields: HashMap<String, String> = words
        .filter_map(|w| w.split_once('='))
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    let number = |key: &str| fields.get(key)?.parse::<u64>().ok();
    Some(Call {
        pid: number("pid")? as u32,
        tid: number("tid")?,
        realtime: (number("rt0")?, number("rt1")?),
        name,
        fields,
    })
}

/// A workload started with its stdout read line by line on a thread.
pub struct CudaWorkload {
    pub workload: Workload,
    pub lines: std::sync::mpsc::Receiver<String>,
}

impl CudaWorkload {
    pub fn start(program: &std::path::Path, args: &[&str], env: &[(&str, &str)]) -> CudaWorkload {
        let mut command = Command::new(program);
        command.args(args);
        CudaWorkload::spawn(command, env)
    }

    /// As [`CudaWorkload::start`], in a pid namespace of its own (as in a
    /// container), where it is pid 1; `pid` is then `unshare`'s, and
    /// [`CudaWorkload::host_pid`] the program's. Needs root.
    pub fn start_in_namespace(
        program: &std::path::Path,
        args: &[&str],
        env: &[(&str, &str)],
    ) -> CudaWorkload {
        let mut command = Command::new("unshare");
        command
            .args(["--pid", "--fork", "--kill-child"])
            .arg(program)
            .args(args);
        CudaWorkload::spawn(command, env)
    }

    /// The host's pid of a workload started in a namespace, once it runs.
    pub fn host_pid(&self) -> u32 {
        let pid = self.workload.pid;
        let children = std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/children"))
            .expect("reading unshare's children");
        children
            .split_whitespace()
            .next()
            .and_then(|child| child.parse().ok())
            .expect("unshare has started the workload")
    }

    fn spawn(mut command: Command, env: &[(&str, &str)]) -> CudaWorkload {
        let mut child = command
            .envs(env.iter().copied())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("starting the CUDA workload");
        let stdout = child.stdout.take().expect("stdout");
        let (tx, lines) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        let pid = child.id();
        CudaWorkload {
            workload: Workload { child, pid },
            lines,
        }
    }

    /// Lines up to and including the first that starts with `prefix`.
    pub fn read_until(&self, prefix: &str) -> Vec<String> {
        let mut seen = Vec::new();
        loop {
            let line = self
                .lines
                .recv_timeout(std::time::Duration::from_secs(30))
                .unwrap_or_else(|_| panic!("the workload never printed {prefix:?}: {seen:?}"));
            let done = line.starts_with(prefix);
            seen.push(line);
            if done {
                return seen;
            }
        }
    }
}

/// The calls a workload printed up to its end.
pub fn calls_until_done(workload: &CudaWorkload) -> Vec<Call> {
    workload
        .read_until("done")
        .iter()
        .filter_map(|l| parse_call(l))
        .collect()
}

/// Captures `duration_ms` while, after a moment, `release` lets the workload
/// go; returns the trace.
pub async fn capture_while(
    agent: &AgentProcess,
    duration_ms: u64,
    release: &std::path::Path,
) -> XSpace {
    capture_releasing_after(agent, duration_ms, release, 300).await
}

/// Captures `duration_ms` while, `after_ms` into it, `release` lets the
/// workload go; returns the trace.
pub async fn capture_releasing_after(
    agent: &AgentProcess,
    duration_ms: u64,
    release: &std::path::Path,
    after_ms: u64,
) -> XSpace {
    let capture = capture(agent, duration_ms);
    let go = async {
        tokio::time::sleep(std::time::Duration::from_millis(after_ms)).await;
        std::fs::write(release, b"go").expect("releasing the workload");
    };
    let (space, ()) = tokio::join!(capture, go);
    space
}

pub fn hex(call: &Call, key: &str) -> u64 {
    let text = &call.fields[key];
    u64::from_str_radix(text.trim_start_matches("0x"), 16).expect("hex field")
}

/// The stand-in CUPTI (`libcupti.so.12`, with `libcupti.so` beside it) in
/// the directory of the stand-in driver; returns that directory.
pub fn cupti_standin() -> std::path::PathBuf {
    standin_library("cupti.c", "libcupti.so.12", "libcupti.so")
}

/// The injection library built next to the devtrace binary, building it
/// first when `cargo test` alone did not.
pub fn inject_library() -> std::path::PathBuf {
    let dir = std::path::Path::new(super::BIN)
        .parent()
        .expect("binary directory")
        .to_path_buf();
    let library = dir.join("libdevtrace_inject.so");
    static BUILD: std::sync::Once = std::sync::Once::new();
    BUILD.call_once(|| {
        let mut build = Command::new(env!("CARGO"));
        build.args(["build", "--quiet", "-p", "devtrace-inject"]);
        if dir.ends_with("release") {
            build.arg("--release");
        }
        let status = build
            .current_dir(env!("CARGO_MANIFEST_DIR"))
            .status()
            .expect("running cargo build -p devtrace-inject");
        assert!(status.success(), "building the injection library failed");
    });
    assert!(library.exists(), "{} missing", library.display());
    library
}

/// The real libcupti of a pip wheel (`requirement`, e.g.
/// `nvidia-cuda-cupti==13.0.85`), downloaded once into the test target
/// directory; returns the unpacked `nvidia` package directory.
pub fn real_cupti_wheel(requirement: &str) -> std::path::PathBuf {
    let dir = std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join("cupti-wheels")
        .join(requirement.replace(['=', '<', '>'], "_"));
    let unpacked = dir.join("nvidia");
    if unpacked.is_dir() {
        return unpacked;
    }
    let partial = dir.with_extension(format!("{}.partial", std::process::id()));
    let _ = std::fs::remove_dir_all(&partial);
    std::fs::create_dir_all(&partial).expect("wheel directory");
    let script = "import sys, zipfile, glob, subprocess\n\
        subprocess.run([sys.executable, '-m', 'pip', 'download', '--quiet', '--no-deps',\n\
                        '--only-binary=:all:', '-d', sys.argv[1], sys.argv[2]], check=True)\n\
        for w in glob.glob(sys.argv[1] + '/*.whl'):\n    zipfile.ZipFile(w).extractall(sys.argv[1])";
    let status = Command::new("python3")
        .args(["-c", script])
        .arg(&partial)
        .arg(requirement)
        .status()
        .expect("python3 runs");
    assert!(status.success(), "pip download {requirement} failed");
    let _ = std::fs::rename(&partial, &dir);
    let _ = std::fs::remove_dir_all(&partial);
    unpacked
}

/// A ring planted in a runtime directory for a process of `uid`, as a user
/// of the host could make one for a process of their own: the process (a
/// `sleep`) takes the ring file's lock before it runs, the header names it as
/// the creator, and the file appears under its name complete, as the
/// library's do. The process is killed when this is dropped.
pub struct PlantedRing {
    pub ring: std::sync::Arc<devtrace::ring::Ring>,
    /// The holding process.
    pub pid: u32,
    /// Where the ring file is now: in a staging directory until placed.
    pub path: std::path::PathBuf,
    /// Its names in the runtime directory.
    pub files: devtrace::workload::WorkloadFiles,
    holder: Child,
    _staging: tempfile::TempDir,
}

impl PlantedRing {
    /// Planted and in place, naming its holder.
    pub fn new(dir: &std::path::Path, uid: u32) -> PlantedRing {
        PlantedRing::staged(dir, uid, None).placed()
    }

    /// Prepared beside `dir` and not yet in it; its name and header name
    /// `claimed` as the process, if given, instead of the holder.
    pub fn staged(dir: &std::path::Path, uid: u32, claimed: Option<u32>) -> PlantedRing {
        use devtrace::ring::{DropPolicy, Ring};
        use std::os::fd::AsRawFd;
        use std::os::unix::fs::FileExt;
        use std::os::unix::process::CommandExt;
        let staging = tempfile::tempdir_in(dir).unwrap();
        let path = staging.path().join("ring");
        let ring = Ring::create_shared(&path, 1, 64, DropPolicy::DropNewest).unwrap();
        std::os::unix::fs::chown(&path, Some(uid), Some(uid)).unwrap();
        let file = std::fs::File::open(&path).unwrap();
        let fd = file.as_raw_fd();
        let mut command = Command::new("sleep");
        command.arg("600").uid(uid).gid(uid);
        // SAFETY: flock and fcntl are async-signal-safe; the descriptor is
        // the child's copy of one the parent holds open until spawn returns.
        unsafe {
            command.pre_exec(move || {
                if libc::flock(fd, libc::LOCK_SH) != 0 || libc::fcntl(fd, libc::F_SETFD, 0) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let holder = command.spawn().expect("starting the ring's holder");
        drop(file);
        let pid = holder.id();
        let named = claimed.unwrap_or(pid);
        let file = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
        file.write_all_at(&named.to_ne_bytes(), CREATOR_PID_OFFSET)
            .unwrap();
        PlantedRing {
            ring,
            pid,
            path,
            files: devtrace::workload::WorkloadFiles::new(dir, named),
            holder,
            _staging: staging,
        }
    }

    /// Puts the ring under its name in the runtime directory.
    pub fn placed(mut self) -> PlantedRing {
        std::fs::rename(&self.path, &self.files.ring).unwrap();
        self.path = self.files.ring.clone();
        self
    }
}

impl Drop for PlantedRing {
    fn drop(&mut self) {
        let _ = self.holder.kill();
        let _ = self.holder.wait();
    }
}

/// Where `RingHeader::creator_pid` lies (`crates/devtrace-shm/src/ring/layout.rs`).
pub const CREATOR_PID_OFFSET: u64 = 44;

/// Waits until the agent's CUDA backend reports `count` attached processes.
pub async fn wait_for_attached(agent: &AgentProcess, count: usize) {
    let wanted = format!("backend cuda: running ({count} processes attached");
    for _ in 0..100 {
        if agent.monitor(100).await.data.contains(&wanted) {
            return;
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    panic!("the agent never attached {count} processes");
}
