//! The CUDA backend end to end: a program calling the stand-in driver runs
//! with the injection library (`CUDA_INJECTION64_PATH`) and the stand-in
//! CUPTI, which has the real record layouts; the agent finds its ring,
//! switches it on for a capture, and the trace holds exactly its kernels,
//! copies, calls and allocations. Also the faults: a workload that exits
//! mid-capture, an agent restart, a full ring, two workloads, CUPTI failing.

use crate::common;

use std::collections::BTreeMap;
use std::path::PathBuf;

use common::workload::*;
use common::AgentProcess;
use devtrace::proto::tensorflow::profiler::XSpace;
use devtrace::xspace::read::{find_stat, StatValue};
use prost::Message;

/// Kernel and copy durations the stand-in CUPTI reports.
const KERNEL_NS: u64 = 5_000;
const MEMCPY_NS: u64 = 2_000;
/// The stand-in GPU clock runs this far from the host's, so a conversion
/// that forgot it would put events 10 000 s away.
const GPU_CLOCK_OFFSET_NS: i64 = -10_000_000_000_000;

struct Setup {
    runtime: tempfile::TempDir,
    program: PathBuf,
    libraries: PathBuf,
    inject: PathBuf,
}

fn setup(program: &str) -> Setup {
    let program = cuda_programs(program);
    Setup {
        runtime: tempfile::tempdir().unwrap(),
        libraries: cupti_standin(),
        program,
        inject: inject_library(),
    }
}

impl Setup {
    fn agent(&self) -> AgentProcess {
        self.agent_with(&[])
    }

    /// As [`Setup::agent`], with `extra` arguments.
    fn agent_with(&self, extra: &[&str]) -> AgentProcess {
        let mut args = vec![
            "--backend",
            "cuda",
            "--runtime-dir",
            self.runtime.path().to_str().unwrap(),
        ];
        args.extend_from_slice(extra);
        AgentProcess::start(&args)
    }

    /// Starts the program with the injection library; `extra_env` on top.
    fn workload(&self, args: &[&str], extra_env: &[(&str, &str)]) -> CudaWorkload {
        self.workload_loading("CUDA_INJECTION64_PATH", args, extra_env)
    }

    /// As [`Setup::workload`], run as `uid` (needs root).
    fn workload_as(&self, uid: u32, args: &[&str]) -> CudaWorkload {
        let env = self.environment("CUDA_INJECTION64_PATH");
        let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
        let mut wrapped = vec![
            format!("--reuid={uid}"),
            format!("--regid={uid}"),
            "--clear-groups".to_string(),
            "--".to_string(),
            self.program.display().to_string(),
        ];
        wrapped.extend(args.iter().map(|a| a.to_string()));
        let wrapped: Vec<&str> = wrapped.iter().map(String::as_str).collect();
        CudaWorkload::start(std::path::Path::new("setpriv"), &wrapped, &env)
    }

    /// As [`Setup::workload`], in a pid namespace of its own.
    fn contained_workload(&self, args: &[&str]) -> CudaWorkload {
        let env = self.environment("CUDA_INJECTION64_PATH");
        let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
        CudaWorkload::start_in_namespace(&self.program, args, &env)
    }

    /// What a workload is started with: the stand-ins, the library named by
    /// `variable`, the runtime directory and the stand-in GPU's timing.
    fn environment(&self, variable: &str) -> Vec<(String, String)> {
        [
            ("LD_LIBRARY_PATH", self.libraries.display().to_string()),
            (variable, self.inject.display().to_string()),
            (
                "DEVTRACE_RUNTIME_DIR",
                self.runtime.path().display().to_string(),
            ),
            (
                "DEVTRACE_STANDIN_GPU_CLOCK_OFFSET_NS",
                GPU_CLOCK_OFFSET_NS.to_string(),
            ),
            ("DEVTRACE_STANDIN_GPU_KERNEL_NS", KERNEL_NS.to_string()),
            ("DEVTRACE_STANDIN_GPU_MEMCPY_NS", MEMCPY_NS.to_string()),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect()
    }

    /// As [`Setup::workload`], the library named by `variable`
    /// (`CUDA_INJECTION64_PATH` or `LD_PRELOAD`).
    fn workload_loading(
        &self,
        variable: &str,
        args: &[&str],
        extra_env: &[(&str, &str)],
    ) -> CudaWorkload {
        let base = self.environment(variable);
        let mut env: Vec<(&str, &str)> =
            base.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
        env.extend_from_slice(extra_env);
        CudaWorkload::start(&self.program, args, &env)
    }
}

/// The file whose creation releases a workload started with `--wait-file`.
fn release_file(setup: &Setup, name: &str) -> PathBuf {
    setup.runtime.path().join(format!("{name}.go"))
}

/// A workload's arguments: `iterations`, run once `release` exists and
/// kernels are recorded (however late a loaded machine lets the library
/// start CUPTI after the release).
fn recorded_run<'a>(iterations: &'a str, release: &'a std::path::Path) -> Vec<&'a str> {
    let release = release.to_str().expect("a UTF-8 path");
    vec![iterations, "--wait-file", release, "--wait-recording"]
}

/// Events of one plane with absolute times.
fn timed(space: &XSpace, plane: &str) -> Vec<(Seen, u64)> {
    let (start, _) = common::window_of(space);
    let Some(plane) = space.planes.iter().find(|p| p.name == plane) else {
        return Vec::new();
    };
    events(plane)
        .into_iter()
        .map(|e| {
            let at = start + (e.offset_ps / 1000) as u64;
            (e, at)
        })
        .collect()
}

/// Whether an event is one of the stand-in program's two kernels.
fn is_program_kernel(event: &Seen) -> bool {
    event.name == "vector_add" || event.name == "matmul_tiled"
}

/// The stand-in program's kernels on `/device:GPU:0`, with their times.
fn program_kernels(space: &XSpace) -> Vec<(Seen, u64)> {
    timed(space, "/device:GPU:0")
        .into_iter()
        .filter(|(e, _)| is_program_kernel(e))
        .collect()
}

fn plane_stat(space: &XSpace, plane: &str, name: &str) -> Option<StatValue> {
    let plane = space.planes.iter().find(|p| p.name == plane)?;
    find_stat(plane, &plane.stats, name)
}

#[tokio::test(flavor = "multi_thread")]
async fn kernels_copies_and_calls_arrive_exactly_with_cupti_12_8_records() {
    exact_run("26").await;
}

#[tokio::test(flavor = "multi_thread")]
async fn kernels_copies_and_calls_arrive_exactly_with_cupti_13_0_records() {
    exact_run("130001").await;
}

#[tokio::test(flavor = "multi_thread")]
async fn kernels_copies_and_calls_arrive_exactly_with_cupti_13_1_records() {
    exact_run("130101").await;
}

#[tokio::test(flavor = "multi_thread")]
async fn kernels_copies_and_calls_arrive_exactly_with_cupti_13_4_records() {
    exact_run("130401").await;
}

/// One workload under the stand-in CUPTI of API `version`, whose records
/// have that release's layout: the trace holds exactly what it did. It
/// starts the moment kernels are recorded, and each kind takes CUPTI
/// 60 ms to enable: were kernels recorded before the other kinds, the
/// copies, allocations and synchronizations around the first ones would be
/// missing (they were, with kernels enabled second).
async fn exact_run(version: &str) {
    let setup = setup("cuda_injected");
    let agent = setup.agent();
    let release = release_file(&setup, "exact");
    let workload = setup.workload(
        &recorded_run("3", &release),
        &[
            ("DEVTRACE_STANDIN_CUPTI_DROP", "5"),
            ("DEVTRACE_STANDIN_CUPTI_VERSION", version),
            ("DEVTRACE_STANDIN_CUPTI_ENABLE_MS", "60"),
        ],
    );
    workload.read_until("waiting");
    let pid = workload.workload.pid;
    wait_for_attached(&agent, 1).await;
    let space = capture_while(&agent, 2000, &release).await;
    let calls = calls_until_done(&workload);

    // Kernels: on the stream line of this process, with CUPTI's exact
    // duration, launch details and occupancy, inside the launch call's
    // interval on the host clock.
    let gpu = timed(&space, "/device:GPU:0");
    let kernels: Vec<&(Seen, u64)> = gpu.iter().filter(|(e, _)| is_program_kernel(e)).collect();
    let launches: Vec<&Call> = calls
        .iter()
        .filter(|c| c.name == "cuLaunchKernel" || c.name == "cuLaunchKernelEx")
        .collect();
    assert_eq!(kernels.len(), 6, "{gpu:?}");
    assert_eq!(launches.len(), 6);
    let line = format!("Stream #13(Compute,MemcpyD2H) (pid {pid}: cuda_injected)");
    for ((kernel, at), launch) in kernels.iter().zip(&launches) {
        assert_eq!(kernel.line, line);
        assert_eq!(kernel.duration_ps as u64, KERNEL_NS * 1000);
        assert_eq!(kernel.name, launch.fields["func"]);
        let details = text(kernel, "kernel_details");
        let expected = if kernel.name == "vector_add" {
            "regs:32 static_shared:0 dynamic_shared:0 grid:128,1,1 block:256,1,1 occ_pct:100"
        } else {
            "regs:64 static_shared:8192 dynamic_shared:4096 grid:16,16,1 block:32,8,1 occ_pct:50"
        };
        assert_eq!(details, expected);
        let slack = 100_000;
        assert!(
            *at + slack >= launch.realtime.0 && *at <= launch.realtime.1 + slack,
            "{} at {at}, launched {:?}",
            kernel.name,
            launch.realtime
        );
    }

    // Every kernel's correlation id is on exactly one host API call of the
    // launching thread, named by CUPTI.
    let host = timed(&space, "/host:CPU");
    for (kernel, _) in &kernels {
        let id = uint(kernel, "correlation_id");
        let api: Vec<&(Seen, u64)> = host
            .iter()
            .filter(|(e, _)| {
                e.stats.contains_key("correlation_id") && uint(e, "correlation_id") == id
            })
            .filter(|(e, _)| e.name.starts_with("cuLaunchKernel"))
            .collect();
        assert_eq!(api.len(), 1, "correlation {id}");
        assert!(
            api[0].0.line.ends_with(&format!("(pid {pid})")),
            "{}",
            api[0].0.line
        );
    }

    // Copies: both directions with their sizes.
    let copies: BTreeMap<String, usize> = gpu.iter().fold(BTreeMap::new(), |mut m, (e, _)| {
        if e.name.starts_with("Memcpy") {
            assert_eq!(e.duration_ps as u64, MEMCPY_NS * 1000);
            assert!(text(e, "memcpy_details").contains("size:4096"), "{e:?}");
            *m.entry(e.name.clone()).or_default() += 1;
        }
        m
    });
    assert_eq!(
        copies,
        [("MemcpyD2H".to_string(), 3), ("MemcpyH2D".to_string(), 3)]
            .into_iter()
            .collect()
    );

    // The driver calls that put work on the timeline are API calls on the
    // host; the others (cuStreamSynchronize) have no API record by default,
    // and the trace says so.
    let api_names = api_calls_of(&space, pid);
    for call in calls.iter().filter(|c| c.name != "cuInit") {
        assert_eq!(
            api_names.contains(&call.name),
            on_timeline(&call.name),
            "{}: recorded {api_names:?}",
            call.name
        );
    }
    assert!(calls.iter().any(|c| !on_timeline(&c.name)));
    assert!(
        api_records_of(&space, pid).starts_with(TIMED),
        "{}",
        api_records_of(&space, pid)
    );

    // Allocations feed the memory profile, per device and process.
    let allocator = format!("GPU_0_cuda (pid {pid})");
    let memory: Vec<(String, i64)> = host
        .iter()
        .filter(|(e, _)| e.name.starts_with("Memory"))
        .map(|(e, _)| {
            assert_eq!(text(e, "allocator_name"), allocator);
            let in_use = match e.stats.get("bytes_allocated") {
                Some(StatValue::Int(v)) => *v,
                other => panic!("{other:?}"),
            };
            (e.name.clone(), in_use)
        })
        .collect();
    let one = [
        ("MemoryAllocation".to_string(), 1 << 20),
        ("MemoryDeallocation".to_string(), 0),
    ];
    assert_eq!(memory, [one.clone(), one.clone(), one].concat());

    // The process, its command line and its libcupti are in the Task
    // Environment.
    let env = common::plane(&space, "Task Environment");
    match find_stat(env, &env.stats, &format!("devtrace_cuda_cupti_{pid}")) {
        Some(StatValue::Str(cupti)) => assert!(
            cupti.starts_with(&format!("API version {version} from ")),
            "{cupti}"
        ),
        other => panic!("no libcupti for {pid}: {other:?}"),
    }
    match find_stat(env, &env.stats, &format!("devtrace_cuda_process_{pid}")) {
        Some(StatValue::Str(command)) => assert!(
            command.ends_with(&format!(
                "cuda_injected 3 --wait-file {} --wait-recording",
                release.display()
            )),
            "{command}"
        ),
        other => panic!("no command line for {pid}: {other:?}"),
    }

    // The device's facts and CUPTI's dropped records.
    assert_eq!(
        plane_stat(&space, "/device:GPU:0", "gpu_device_name"),
        Some(StatValue::Str("Standin GPU".into()))
    );
    assert_eq!(
        plane_stat(&space, "/device:GPU:0", "core_count"),
        Some(StatValue::Int(132))
    );
    let dropped = space
        .warnings
        .iter()
        .find(|w| w.contains("GPU activity records CUPTI dropped"))
        .unwrap_or_else(|| panic!("{:?}", space.warnings));
    assert!(dropped.starts_with("backend cuda: 5 "), "{dropped}");
    assert_eq!(
        common::dropped_of(&space),
        5,
        "CUPTI's drops count as dropped traces"
    );
}

/// A kernel of the program in a trace, with the launch calls that carry
/// its correlation id.
struct KernelLaunches {
    id: u64,
    /// When it started, in seconds from the window's start.
    at_s: f64,
    /// Process `pid`'s `cuLaunchKernel*` calls with its correlation id.
    launches: usize,
}

/// Each kernel of the program in a trace, with the launch calls of process
/// `pid` that carry its correlation id.
fn kernel_launches(space: &XSpace, pid: u32) -> Vec<KernelLaunches> {
    let (start, _) = common::window_of(space);
    let launches: Vec<u64> = timed(space, "/host:CPU")
        .iter()
        .filter(|(e, _)| e.line.ends_with(&format!("(pid {pid})")))
        .filter(|(e, _)| e.name.starts_with("cuLaunchKernel"))
        .map(|(e, _)| uint(e, "correlation_id"))
        .collect();
    program_kernels(space)
        .iter()
        .map(|(kernel, at)| {
            let id = uint(kernel, "correlation_id");
            KernelLaunches {
                id,
                at_s: at.saturating_sub(start) as f64 / 1e9,
                launches: launches.iter().filter(|l| **l == id).count(),
            }
        })
        .collect()
}

/// How the trace names the default API records: the timeline's calls, timed
/// by the library's subscriber.
const TIMED: &str = "timeline, timed by devtrace's Callback API subscriber";

/// A capture of a workload that was running all along: every kernel it
/// holds has its launch call, the first ones included (the library times
/// launches from before it has CUPTI record kernels), on CUDA 12's one
/// buffer and CUDA 13's per-thread ones.
#[tokio::test(flavor = "multi_thread")]
async fn every_kernel_of_a_running_workload_has_its_launch_call() {
    for version in ["26", "130001"] {
        let setup = setup("cuda_running");
        let agent = setup.agent();
        let workload = setup.workload(
            &["400", "--sleep-ms", "2"],
            &[("DEVTRACE_STANDIN_CUPTI_VERSION", version)],
        );
        let pid = workload.workload.pid;
        wait_for_attached(&agent, 1).await;
        let space = capture(&agent, 1000).await;
        calls_until_done(&workload);
        let kernels = kernel_launches(&space, pid);
        assert!(kernels.len() >= 10, "{version}: {} kernels", kernels.len());
        for k in &kernels {
            assert_eq!(
                k.launches, 1,
                "{version}: kernel {} at {} s has no single launch call",
                k.id, k.at_s
            );
        }
    }
}

/// Launches made as PyTorch makes them, through the runtime (the stand-in
/// CUPTI wraps each in a `cudaLaunchKernel` whose driver call shares its
/// correlation id): each kernel has exactly one launch call, the runtime
/// one, whether the library times the calls or CUPTI records them.
#[tokio::test(flavor = "multi_thread")]
async fn runtime_launches_have_one_launch_call_each_timed_or_recorded() {
    for agent_args in [&[][..], &["--cuda-api-records", "timeline-cupti"][..]] {
        let setup = setup("cuda_runtime_launches");
        let agent = setup.agent_with(agent_args);
        let release = release_file(&setup, "runtime");
        let workload = setup.workload(
            &recorded_run("3", &release),
            &[("DEVTRACE_STANDIN_CUPTI_RUNTIME_LAUNCHES", "1")],
        );
        workload.read_until("waiting");
        let pid = workload.workload.pid;
        wait_for_attached(&agent, 1).await;
        let space = capture_while(&agent, 2000, &release).await;
        calls_until_done(&workload);
        let host = timed(&space, "/host:CPU");
        let calls: Vec<(String, u64)> = host
            .iter()
            .filter(|(e, _)| e.line.ends_with(&format!("(pid {pid})")))
            .filter(|(e, _)| e.stats.contains_key("correlation_id"))
            .map(|(e, _)| (e.name.clone(), uint(e, "correlation_id")))
            .collect();
        assert!(
            !calls
                .iter()
                .any(|(name, _)| name.starts_with("cuLaunchKernel")),
            "{agent_args:?}: driver launches inside runtime ones are left out: {calls:?}"
        );
        let kernels = program_kernels(&space);
        assert_eq!(kernels.len(), 6, "{agent_args:?}: {:?}", space.warnings);
        for (kernel, _) in &kernels {
            let id = uint(kernel, "correlation_id");
            let launches: Vec<&String> = calls
                .iter()
                .filter(|(_, call)| *call == id)
                .map(|(name, _)| name)
                .collect();
            assert_eq!(
                launches,
                ["cudaLaunchKernel_v7000"],
                "{agent_args:?}: kernel {id}"
            );
        }
    }
}

/// Whether the injection library records the stand-in program's `call` by
/// default: all but its synchronizations and event records put work on the
/// timeline (launches, copies, memsets, allocations and frees).
fn on_timeline(call: &str) -> bool {
    ![
        "cuStreamSynchronize",
        "cuCtxSynchronize",
        "cuEventSynchronize",
        "cuEventRecord",
    ]
    .contains(&call)
}

/// The names of process `pid`'s API calls on the host.
fn api_calls_of(space: &XSpace, pid: u32) -> Vec<String> {
    timed(space, "/host:CPU")
        .into_iter()
        .filter(|(e, _)| e.line.ends_with(&format!("(pid {pid})")))
        .filter(|(e, _)| e.stats.contains_key("correlation_id"))
        .map(|(e, _)| e.name)
        .collect()
}

/// Which API calls process `pid` recorded, as the trace says.
fn api_records_of(space: &XSpace, pid: u32) -> String {
    let env = common::plane(space, "Task Environment");
    match find_stat(env, &env.stats, &format!("devtrace_cuda_api_records_{pid}")) {
        Some(StatValue::Str(text)) => text,
        other => panic!("no API records named for {pid}: {other:?}"),
    }
}

/// What [`api_run`] saw: the calls of two iterations of an [`ApiWorkload`]
/// and what one capture recorded of them.
struct ApiRun {
    calls: Vec<Call>,
    recorded: Vec<String>,
    /// `devtrace_cuda_api_records_<pid>`.
    set: String,
    /// Synchronization records on the process's synchronization line.
    synchronizations: usize,
    warnings: Vec<String>,
    stderr: String,
}

/// A workload of the stand-in program with every kind of call
/// (`--extras`: memsets, event and context synchronizations) and `args`,
/// waiting for `release`, attached to an agent started with `agent_args`.
struct ApiWorkload {
    _setup: Setup,
    agent: AgentProcess,
    workload: CudaWorkload,
    release: PathBuf,
    pid: u32,
}

async fn api_workload(
    agent_args: &[&str],
    args: &[&str],
    extra_env: &[(&str, &str)],
) -> ApiWorkload {
    let setup = setup("cuda_api_records");
    let runtime = setup.runtime.path().to_str().unwrap().to_string();
    let mut all_args = vec!["--backend", "cuda", "--runtime-dir", &runtime];
    all_args.extend_from_slice(agent_args);
    let agent = AgentProcess::start(&all_args);
    let release = release_file(&setup, "api");
    let mut program_args = args.to_vec();
    program_args.extend([
        "--extras",
        "--wait-file",
        release.to_str().unwrap(),
        "--wait-recording",
    ]);
    let workload = setup.workload(&program_args, extra_env);
    workload.read_until("waiting");
    let pid = workload.workload.pid;
    wait_for_attached(&agent, 1).await;
    ApiWorkload {
        _setup: setup,
        agent,
        workload,
        release,
        pid,
    }
}

/// A capture of `duration_ms` asking for `device_tracer_level`.
async fn capture_at_level(
    agent: &AgentProcess,
    duration_ms: u64,
    device_tracer_level: u32,
) -> XSpace {
    let mut request = common::request(duration_ms, "api");
    if let Some(options) = request.opts.as_mut() {
        options.device_tracer_level = device_tracer_level;
    }
    let reply = agent
        .client()
        .await
        .profile(request)
        .await
        .expect("Profile");
    common::space_of(&reply.into_inner())
}

/// Two iterations of an [`ApiWorkload`] (the agent started with
/// `agent_args`, the workload with `extra_env`) in one capture asking for
/// `device_tracer_level`.
async fn api_run(
    agent_args: &[&str],
    device_tracer_level: u32,
    extra_env: &[(&str, &str)],
) -> ApiRun {
    let mut started = api_workload(agent_args, &["2"], extra_env).await;
    let capture = capture_at_level(&started.agent, 2000, device_tracer_level);
    let go = async {
        tokio::time::sleep(std::time::Duration::from_millis(300)).await;
        std::fs::write(&started.release, b"go").expect("releasing the workload");
    };
    let (space, ()) = tokio::join!(capture, go);
    let (pid, workload) = (started.pid, &mut started.workload);
    let calls = calls_until_done(workload);
    let synchronizations = timed(&space, "/host:CPU")
        .iter()
        .filter(|(e, _)| {
            [
                "event synchronize",
                "stream synchronize",
                "context synchronize",
            ]
            .contains(&e.name.as_str())
        })
        .count();
    ApiRun {
        recorded: api_calls_of(&space, pid),
        set: api_records_of(&space, pid),
        synchronizations,
        warnings: space.warnings.clone(),
        stderr: stderr_of(workload),
        calls,
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_default_capture_records_launch_calls_but_no_synchronize_calls() {
    let run = api_run(&[], 1, &[]).await;
    assert!(run.set.starts_with(TIMED), "{}", run.set);
    assert_timeline_recorded(&run);
    assert!(run.recorded.iter().any(|c| c == "cuLaunchKernel"));
    assert!(run.calls.iter().any(|c| c.name == "cuCtxSynchronize"));
    assert!(!run.recorded.iter().any(|c| c == "cuCtxSynchronize"));
    // What the synchronizations did is still there, without their calls.
    assert_eq!(
        run.synchronizations,
        3 * 2,
        "event, context and stream, twice"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_capture_asking_for_device_detail_records_every_call() {
    let run = api_run(&[], 2, &[]).await;
    assert!(run.set.starts_with("all: "), "{}", run.set);
    assert_every_call_recorded(&run);
}

#[tokio::test(flavor = "multi_thread")]
async fn the_agent_can_record_every_call_for_every_capture() {
    let run = api_run(&["--cuda-api-records", "all"], 1, &[]).await;
    assert!(run.set.starts_with("all: "), "{}", run.set);
    assert_every_call_recorded(&run);
}

/// An agent asking for CUPTI's records of the timeline's calls gets the
/// same calls, recorded by CUPTI, and the trace says so.
#[tokio::test(flavor = "multi_thread")]
async fn the_agent_can_have_cupti_record_the_timelines_calls() {
    let run = api_run(&["--cuda-api-records", "timeline-cupti"], 1, &[]).await;
    assert!(run.set.starts_with("timeline: "), "{}", run.set);
    assert_timeline_recorded(&run);
}

/// A CUPTI that takes the timeline's calls selected one by one and records
/// none of them (as 13.0 did on an H200) is found out within a second of
/// kernels arriving without them: from then on every call is recorded, and
/// the trace names the span whose calls are missing. Before, a capture
/// kept kernels without their launch calls and said nothing.
#[tokio::test(flavor = "multi_thread")]
async fn a_cupti_that_ignores_the_selected_calls_records_every_call_and_says_so() {
    let setup = setup("cuda_unselected");
    let agent = setup.agent_with(&["--cuda-api-records", "timeline-cupti"]);
    let workload = setup.workload(
        &["700", "--sleep-ms", "5"],
        &[("DEVTRACE_STANDIN_CUPTI_IGNORE_SELECTION", "1")],
    );
    let pid = workload.workload.pid;
    wait_for_attached(&agent, 1).await;
    let space = capture(&agent, 2500).await;
    let lines = workload.read_until("done");
    let kernels = kernel_launches(&space, pid);
    let first_linked = kernels.iter().position(|k| k.launches > 0);
    let Some(first_linked) = first_linked else {
        panic!("no kernel has its launch call: {:?}", space.warnings);
    };
    assert!(first_linked > 0, "the first kernels had their launch calls");
    assert!(
        kernels[first_linked..].iter().all(|k| k.launches == 1),
        "after the switch every kernel has one launch call"
    );
    let said = "CUPTI wrote no record of the calls selected one by one";
    let warning = space
        .warnings
        .iter()
        .find(|w| w.contains(said))
        .unwrap_or_else(|| panic!("{:?}", space.warnings));
    assert!(
        warning.contains(&format!("process {pid}")),
        "the process is named: {warning}"
    );
    let unlinked_until = kernels[first_linked - 1].at_s;
    assert!(
        unlinked_until < 2.0,
        "found out {unlinked_until} s into the window"
    );
    assert!(
        lines
            .iter()
            .all(|l| !l.starts_with("call ") || l.contains("rc=0")),
        "every call succeeded"
    );
}

/// A libcupti without cuptiActivityEnableDriverApi (before CUDA 12.8's)
/// cannot select calls: the timeline's are timed by the library's
/// subscriber all the same, and when it has none, every call is recorded,
/// and the workload's stderr and the trace say why.
#[tokio::test(flavor = "multi_thread")]
async fn a_libcupti_without_per_call_enables_records_every_call_and_says_so() {
    let dir = cupti_standin();
    let older = common::build_program(
        "cupti.c",
        "libcupti-without-per-call-enables.so",
        &[
            "-shared",
            "-fPIC",
            "-Wl,-soname,libcupti.so.12",
            "-ldl",
            "-pthread",
            "-DSTANDIN_CUPTI_WITHOUT_PER_CALL_ENABLES",
        ],
    );
    assert_eq!(older.parent(), Some(dir.as_path()));
    // It needs no per-call enables to time the timeline's calls.
    let path = older.to_str().unwrap();
    let timed = api_run(&[], 1, &[("DEVTRACE_CUPTI_PATH", path)]).await;
    assert!(timed.set.starts_with(TIMED), "{}", timed.set);
    assert_timeline_recorded(&timed);
    assert!(!timed.stderr.contains("cuptiActivityEnableDriverApi"));
    // Without the subscriber (another user holds it), CUPTI's records of
    // every call stand in.
    let run = api_run(
        &[],
        1,
        &[
            ("DEVTRACE_CUPTI_PATH", path),
            ("DEVTRACE_STANDIN_CUPTI_FAIL", "cuptiSubscribe=39"),
        ],
    )
    .await;
    assert!(run.set.contains("cannot select calls"), "{}", run.set);
    assert_every_call_recorded(&run);
    let said = "no cuptiActivityEnableDriverApi and cuptiActivityEnableRuntimeApi";
    assert!(run.stderr.contains(said), "{}", run.stderr);
    assert!(
        run.warnings.iter().any(|w| w.contains(said)),
        "{:?}",
        run.warnings
    );
}

/// A capture asking for every call, inside a longer default one, switches
/// the workload to every call and back: the longer trace has some
/// cuCtxSynchronize calls, not all, and names both sets.
#[tokio::test(flavor = "multi_thread")]
async fn a_detailed_capture_inside_a_default_one_switches_the_records_and_back() {
    let started = api_workload(&[], &["30", "--sleep-ms", "100"], &[]).await;
    let outer = capture_at_level(&started.agent, 5000, 1);
    let inner = async {
        std::fs::write(&started.release, b"go").expect("releasing the workload");
        tokio::time::sleep(std::time::Duration::from_millis(1500)).await;
        capture_at_level(&started.agent, 1000, 2).await;
    };
    let (space, ()) = tokio::join!(outer, inner);
    let (pid, workload) = (started.pid, &started.workload);
    let calls = calls_until_done(workload);
    let made = calls
        .iter()
        .filter(|c| c.name == "cuCtxSynchronize")
        .count();
    let recorded = api_calls_of(&space, pid)
        .iter()
        .filter(|name| *name == "cuCtxSynchronize")
        .count();
    assert!(recorded > 0 && recorded < made, "{recorded} of {made}");
    let set = api_records_of(&space, pid);
    assert!(
        set.starts_with(TIMED) && set.contains("; then all: "),
        "{set}"
    );
}

/// The calls that put work on the timeline were recorded, no other.
fn assert_timeline_recorded(run: &ApiRun) {
    for call in run.calls.iter().filter(|c| c.name != "cuInit") {
        assert_eq!(
            run.recorded.contains(&call.name),
            on_timeline(&call.name),
            "{}: recorded {:?}",
            call.name,
            run.recorded
        );
    }
}

fn assert_every_call_recorded(run: &ApiRun) {
    for call in run.calls.iter().filter(|c| c.name != "cuInit") {
        assert!(
            run.recorded.contains(&call.name),
            "{} missing from {:?}",
            call.name,
            run.recorded
        );
    }
    assert!(run.recorded.iter().any(|c| c == "cuCtxSynchronize"));
}

#[tokio::test(flavor = "multi_thread")]
async fn a_workload_that_exits_mid_capture_keeps_its_events_and_is_reported() {
    let setup = setup("cuda_exiting");
    let agent = setup.agent();
    let release = release_file(&setup, "exiting");
    let workload = setup.workload(
        &[
            "2",
            "--wait-file",
            release.to_str().unwrap(),
            "--wait-recording",
            "--sleep-ms",
            "50",
        ],
        &[],
    );
    workload.read_until("waiting");
    let pid = workload.workload.pid;
    wait_for_attached(&agent, 1).await;
    let space = capture_while(&agent, 2000, &release).await;
    calls_until_done(&workload);
    let kernels = timed(&space, "/device:GPU:0")
        .iter()
        .filter(|(e, _)| e.name == "vector_add")
        .count();
    assert_eq!(kernels, 2, "what it did before exiting is kept");
    assert!(
        space
            .warnings
            .iter()
            .any(|w| w.contains(&format!("process {pid} "))
                && w.contains(
                    "exited; the GPU events its library handed over up to then are in the trace"
                )),
        "{:?}",
        space.warnings
    );
    // Its files are gone once it is.
    let left: Vec<_> = std::fs::read_dir(setup.runtime.path())
        .unwrap()
        .flatten()
        .map(|e| e.file_name())
        .filter(|n| n.to_string_lossy().starts_with("cuda-"))
        .collect();
    assert!(left.is_empty(), "{left:?}");
}

/// The probe of plain CUPTI that `scripts/gpu-check`'s check l runs
/// (`scripts/gpu/cupti_cost.c`), built against CUDA 13.0's real headers,
/// through its phases on the stand-in CUPTI: each phase records all its
/// kernels, its subscriber is called for its own calls alone, and nothing
/// is recorded once it has finalized CUPTI.
#[test]
fn the_cupti_cost_probe_counts_each_phase_and_detaches_after_it() {
    let includes: Vec<String> = [
        "nvidia-cuda-cupti==13.0.85",
        "nvidia-cuda-runtime==13.0.96",
        "nvidia-cuda-crt==13.0.88",
    ]
    .into_iter()
    .map(|wheel| {
        format!(
            "-I{}",
            real_cupti_wheel(wheel).join("cu13/include").display()
        )
    })
    .collect();
    let dir = tempfile::tempdir().unwrap();
    let probe = dir.path().join("libcupti_cost.so");
    let source = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/gpu/cupti_cost.c");
    let built = std::process::Command::new("cc")
        .args(["-shared", "-fPIC", "-O2", "-Wall", "-Werror"])
        .args(&includes)
        .arg("-o")
        .arg(&probe)
        .arg(&source)
        .arg("-ldl")
        .output()
        .expect("cc runs");
    assert!(
        built.status.success(),
        "{}",
        String::from_utf8_lossy(&built.stderr)
    );
    let check = cuda_linked("cupti_cost_check.c", "cupti_cost_check", &["-ldl"]);
    let out = std::process::Command::new(check)
        .arg(&probe)
        .arg(cupti_standin().join("libcupti.so.12"))
        .output()
        .expect("the check runs");
    let said = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{said}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        said.contains("kernels: 100 of 100 kernels recorded, 0 subscriber calls"),
        "{said}"
    );
    assert!(said.ends_with("ok\n"), "{said}");
}

/// A workload that exits while the agent looks away, its pid taken by
/// another process before the agent's next pass: the agent lets go of it
/// all the same (the pid names another process now).
#[tokio::test(flavor = "multi_thread")]
async fn a_workload_whose_pid_is_reused_before_the_agent_looks_is_let_go_of() {
    let setup = setup("cuda_pid_reused");
    let agent = setup.agent();
    let release = release_file(&setup, "never");
    let mut workload = setup.workload(&["1", "--wait-file", release.to_str().unwrap()], &[]);
    workload.read_until("waiting");
    let pid = workload.workload.pid;
    wait_for_attached(&agent, 1).await;

    // The agent stopped, the workload gone and its pid given to another
    // process, then the agent let go on.
    let agent_pid = agent.pid() as i32;
    // SAFETY: signals to a child process of this test.
    unsafe { libc::kill(agent_pid, libc::SIGSTOP) };
    workload.workload.child.kill().unwrap();
    workload.workload.child.wait().unwrap();
    let successor = with_pid(pid);
    // SAFETY: as above.
    unsafe { libc::kill(agent_pid, libc::SIGCONT) };
    let Some(mut successor) = successor else {
        eprintln!("skipped: pid {pid} could not be given to another process");
        return;
    };
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        let monitor = agent.monitor(100).await.data;
        if monitor.contains("backend cuda: running (0 processes attached") {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the agent still holds process {pid}, now another: {monitor}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    successor.kill().unwrap();
    successor.wait().unwrap();
}

/// A process started with pid `pid` (through `ns_last_pid`, as root), or
/// `None` when this host does not allow it or another process keeps
/// taking the pid first.
fn with_pid(pid: u32) -> Option<std::process::Child> {
    const LAST_PID: &str = "/proc/sys/kernel/ns_last_pid";
    for _ in 0..100 {
        if let Err(error) = std::fs::write(LAST_PID, (pid - 1).to_string()) {
            eprintln!("cannot write {LAST_PID}: {error}");
            return None;
        }
        let mut child = std::process::Command::new("sleep")
            .arg("60")
            .spawn()
            .expect("sleep");
        if child.id() == pid {
            return Some(child);
        }
        child.kill().unwrap();
        child.wait().unwrap();
    }
    None
}

/// A process that exits moments into a capture, on CUDA 13, keeps its
/// kernels' occupancy: CUPTI's DEVICE record of the GPU sits in the
/// library's own thread's buffer, which is not back yet when the exiting
/// thread's kernels are converted, so the device's limits come from the
/// driver.
#[tokio::test(flavor = "multi_thread")]
async fn a_workload_exiting_as_recording_begins_keeps_its_kernels_occupancy() {
    let mut setup = setup("cuda_exiting_early");
    // Linked against libcupti, for --wait-recording to find the stand-in.
    setup.program = rival_linked_program();
    let agent = setup.agent();
    let workload = setup.workload(
        &["1", "--wait-recording"],
        &[("DEVTRACE_STANDIN_CUPTI_VERSION", "130001")],
    );
    wait_for_attached(&agent, 1).await;
    let space = capture(&agent, 1500).await;
    calls_until_done(&workload);
    let kernels = program_kernels(&space);
    assert_eq!(kernels.len(), 2, "{:?}", space.warnings);
    for (kernel, _) in &kernels {
        let details = text(kernel, "kernel_details");
        let occupancy = if kernel.name == "vector_add" {
            "occ_pct:100"
        } else {
            "occ_pct:50"
        };
        assert!(details.ends_with(occupancy), "{}: {details}", kernel.name);
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_restarted_agent_reattaches_to_a_running_workload() {
    let setup = setup("cuda_long");
    let workload = setup.workload(&["400", "--sleep-ms", "10"], &[]);
    workload.read_until("call cuStreamCreate");
    let first = setup.agent();
    wait_for_attached(&first, 1).await;
    let before = capture(&first, 500).await;
    drop(first);
    let second = setup.agent();
    wait_for_attached(&second, 1).await;
    let after = capture(&second, 500).await;
    for (label, space) in [("first agent", &before), ("second agent", &after)] {
        let kernels = timed(space, "/device:GPU:0")
            .iter()
            .filter(|(e, _)| e.name == "vector_add")
            .count();
        assert!(kernels > 5, "{label}: {kernels} kernels");
    }
}

/// A workload that stopped following a killed agent follows the next one:
/// the restarted agent's captures have its kernels, and its trace says
/// why recording stopped in between.
#[tokio::test(flavor = "multi_thread")]
async fn a_workload_left_by_a_killed_agent_follows_the_next_one() {
    let setup = setup("cuda_killed_then_restarted");
    let workload = setup.workload(&["600", "--sleep-ms", "10"], &[AGENT_SILENCE]);
    workload.read_until("call cuStreamCreate");
    let first = setup.agent();
    wait_for_attached(&first, 1).await;
    let mut client = first.client().await;
    let capture_of_first =
        tokio::spawn(async move { client.profile(common::request(10_000, "killed")).await });
    tokio::time::sleep(std::time::Duration::from_millis(500)).await;
    drop(first);
    assert!(capture_of_first.await.unwrap().is_err());
    // Past the silence the workload detached; then an agent comes back.
    tokio::time::sleep(std::time::Duration::from_millis(1500)).await;
    let second = setup.agent();
    wait_for_attached(&second, 1).await;
    let after = capture(&second, 500).await;
    let kernels = timed(&after, "/device:GPU:0")
        .iter()
        .filter(|(e, _)| e.name == "vector_add")
        .count();
    assert!(kernels > 5, "{kernels} kernels after the restart");
    assert!(
        after
            .warnings
            .iter()
            .any(|w| w.contains("the agent stopped beating")),
        "{:?}",
        after.warnings
    );
}

/// A workload of several threads that exits during a capture on CUDA 13:
/// CUPTI hands a thread's partly filled buffer back only when it is
/// detached (the stand-in, like the H200 showed, keeps the other threads'
/// after the exit handler's forced flush), so their last records are
/// missing, and the trace says so rather than passing over them. Its
/// kernels run for a second, so that no flush before the exit hands their
/// buffers back, however slowly a loaded machine runs it.
#[tokio::test(flavor = "multi_thread")]
async fn a_threaded_workload_exiting_mid_capture_says_what_cupti_kept() {
    let setup = setup("cuda_exiting_threads");
    let agent = setup.agent();
    let release = release_file(&setup, "threads");
    let mut args = recorded_run("3", &release);
    args.extend(["--threads", "3"]);
    let workload = setup.workload(
        &args,
        &[
            ("DEVTRACE_STANDIN_CUPTI_VERSION", "130001"),
            ("DEVTRACE_STANDIN_GPU_KERNEL_NS", "1000000000"),
        ],
    );
    workload.read_until("waiting");
    let pid = workload.workload.pid;
    wait_for_attached(&agent, 1).await;
    let space = capture_while(&agent, 2000, &release).await;
    let calls = calls_until_done(&workload);
    assert!(calls.iter().all(|c| c.fields["rc"] == "0"), "{calls:?}");
    let told = space.warnings.iter().any(|w| {
        w.contains(&format!("process {pid} "))
            && w.contains("CUPTI activity buffers not handed back")
    });
    assert!(told, "{:?}", space.warnings);
}

/// A job that exits during a capture while its other threads are still in
/// CUDA calls (a watchdog or a signal handler ending it): the exit handler
/// stops recording and reads what CUPTI handed back for a bounded time
/// only (reading a backlog while the threads kept filling buffers held
/// such an exit for seconds; `scripts/bench-inject` times it), the job's
/// exit status is its own, and what was left unread is said. The read time
/// is set to nothing here, so that something is always left.
#[tokio::test(flavor = "multi_thread")]
async fn a_job_exiting_with_threads_in_cuda_calls_is_not_held_and_says_what_it_left() {
    let setup = setup("cuda_exiting_busy");
    let agent = setup.agent();
    let release = release_file(&setup, "busy");
    let release_text = release.to_str().unwrap();
    // Recording before the threads start, exiting early in a long window:
    // a loaded machine has seconds to finish the exit before the trace is
    // built. The threads pause a millisecond an iteration, so that their
    // records do not fill the ring.
    let mut workload = setup.workload(
        &[
            "1000000000",
            "--quiet",
            "--threads",
            "2",
            "--sleep-ms",
            "1",
            "--wait-file",
            release_text,
            "--wait-recording",
            "--exit-after-ms",
            "300",
        ],
        &[("DEVTRACE_INJECT_EXIT_READ_MS", "0")],
    );
    workload.read_until("waiting");
    let pid = workload.workload.pid;
    wait_for_attached(&agent, 1).await;
    let space = capture_while(&agent, 5000, &release).await;
    let status = workload.workload.child.wait().expect("the job's exit");
    assert_eq!(status.code(), Some(3), "the job's own exit status");
    let left = space
        .warnings
        .iter()
        .find(|w| w.contains(&format!("process {pid} ")) && w.contains("not yet read"));
    let left = left.unwrap_or_else(|| panic!("{:?}", space.warnings));
    assert!(
        left.contains(
            "CUPTI activity buffer(s) not yet read, and reading them would have held \
             its exit past 0 ms"
        ),
        "{left}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn two_workloads_keep_their_own_stream_lines() {
    let setup = setup("cuda_pair");
    let agent = setup.agent();
    let release = release_file(&setup, "pair");
    let a = setup.workload(&recorded_run("2", &release), &[]);
    let b = setup.workload(&recorded_run("3", &release), &[]);
    a.read_until("waiting");
    b.read_until("waiting");
    wait_for_attached(&agent, 2).await;
    let space = capture_while(&agent, 2000, &release).await;
    calls_until_done(&a);
    calls_until_done(&b);
    let mut per_line: BTreeMap<String, usize> = BTreeMap::new();
    for (e, _) in timed(&space, "/device:GPU:0") {
        if e.name == "vector_add" {
            *per_line.entry(e.line.clone()).or_default() += 1;
        }
    }
    let expected: BTreeMap<String, usize> = [(a.workload.pid, 2), (b.workload.pid, 3)]
        .into_iter()
        .map(|(pid, n)| {
            (
                format!("Stream #13(Compute,MemcpyD2H) (pid {pid}: cuda_pair)"),
                n,
            )
        })
        .collect();
    assert_eq!(per_line, expected);
}

/// On a shared node, uid 65534's capture switches CUPTI on in its own
/// workload alone and holds only its kernels: uid 1001's workload, traced
/// by the same agent, is never armed and none of its kernels or its command
/// line are in the trace.
#[tokio::test(flavor = "multi_thread")]
async fn a_users_capture_switches_cupti_on_only_in_that_users_processes() {
    use common::raw_call::{connect_as, unary_on};
    use devtrace::proto::tensorflow::ProfileResponse;
    use prost::Message;
    if !common::is_root() {
        eprintln!("skipped: running workloads as other users needs root");
        return;
    }
    let mut setup = setup("cuda_pair");
    // Workloads of two users make their rings in it.
    setup.runtime = common::shared_directory();
    let agent = setup.agent();
    let release = release_file(&setup, "users");
    let wait = ["--wait-file", release.to_str().unwrap()];
    // Only the asking user's process is recorded: it alone waits for it.
    let own = setup.workload_as(65534, &["2", wait[0], wait[1], "--wait-recording"]);
    let other = setup.workload_as(1001, &["3", wait[0], wait[1]]);
    own.read_until("waiting");
    other.read_until("waiting");
    wait_for_attached(&agent, 2).await;
    let mut asked = common::request(2000, "users");
    asked.emit_xspace = true;
    let capture = async {
        let io = connect_as(65534, &agent.address).await;
        unary_on(
            io,
            &agent.address,
            "/tensorflow.ProfilerService/Profile",
            &asked,
        )
        .await
    };
    let go = async {
        tokio::time::sleep(std::time::Duration::from_millis(300)).await;
        std::fs::write(&release, b"go").expect("releasing the workloads");
    };
    let ((reply, status), ()) = tokio::join!(capture, go);
    assert_eq!(status.code(), tonic::Code::Ok, "{status:?}");
    let space = common::space_of(&ProfileResponse::decode(&reply[..]).unwrap());
    let end_state = |workload: &CudaWorkload| {
        workload
            .read_until("done")
            .into_iter()
            .find(|line| line.starts_with("cupti "))
            .expect("the workload's CUPTI state")
    };
    // Its own workload was armed when it ended (the capture still ran);
    // the other user's never was.
    assert_eq!(end_state(&own), "cupti armed=1 finalized=0");
    assert_eq!(end_state(&other), "cupti armed=0 finalized=0");
    let mut per_line: BTreeMap<String, usize> = BTreeMap::new();
    for (e, _) in timed(&space, "/device:GPU:0") {
        if e.name == "vector_add" {
            *per_line.entry(e.line.clone()).or_default() += 1;
        }
    }
    let line = format!(
        "Stream #13(Compute,MemcpyD2H) (pid {}: cuda_pair)",
        own.workload.pid
    );
    assert_eq!(per_line, [(line, 2)].into_iter().collect());
    let env = common::plane(&space, "Task Environment");
    let process = |pid: u32| format!("devtrace_cuda_process_{pid}");
    assert!(find_stat(env, &env.stats, &process(own.workload.pid)).is_some());
    assert!(find_stat(env, &env.stats, &process(other.workload.pid)).is_none());
}

/// The calls a workload ran, from its release to its end: its launches'
/// times bound the window a look-back capture asks for.
fn run_released(workload: &CudaWorkload, release: &std::path::Path) -> Vec<Call> {
    std::fs::write(release, b"go").expect("releasing the workload");
    calls_until_done(workload)
}

/// A capture of the past: the window from `from_ns` to `to_ns`, asked for
/// once it is over.
async fn look_back(agent: &AgentProcess, from_ns: u64, to_ns: u64) -> XSpace {
    let duration_ms = (to_ns - from_ns).div_ceil(1_000_000);
    let mut asked = common::request(duration_ms, "past");
    asked.opts.as_mut().unwrap().start_timestamp_ns = from_ns;
    let reply = agent
        .client()
        .await
        .profile(asked)
        .await
        .expect("Profile")
        .into_inner();
    common::space_of(&reply)
}

/// Under `--cuda-record always` the flight recorder holds the GPU's past:
/// a capture asked for after a workload ran holds every kernel it launched,
/// at its launch's time. Under the default (`capture`) it holds none.
#[tokio::test(flavor = "multi_thread")]
async fn under_cuda_record_always_a_look_back_capture_holds_the_kernels_before_it() {
    let always = setup("cuda_past");
    let agent = always.agent_with(&["--cuda-record", "always"]);
    let release = release_file(&always, "past");
    let workload = always.workload(&recorded_run("3", &release), &[]);
    workload.read_until("waiting");
    wait_for_attached(&agent, 1).await;
    let calls = run_released(&workload, &release);
    let launches: Vec<&Call> = calls
        .iter()
        .filter(|c| c.name.starts_with("cuLaunchKernel"))
        .collect();
    assert_eq!(launches.len(), 6, "{calls:?}");
    let from = launches[0].realtime.0 - 100_000_000;
    let to = launches[5].realtime.1 + 100_000_000;
    let space = look_back(&agent, from, to).await;
    let kernels = program_kernels(&space);
    assert_eq!(kernels.len(), 6, "kernels in the look-back capture");
    let env = common::plane(&space, "Task Environment");
    match find_stat(env, &env.stats, "devtrace_cuda_record") {
        Some(StatValue::Str(mode)) => assert!(mode.starts_with("always: "), "{mode}"),
        other => panic!("no devtrace_cuda_record: {other:?}"),
    }

    // A capture adds the API calls for its window; afterwards the
    // kernels go on being recorded, and CUPTI stays armed for them. This
    // process comes after the first one ended.
    wait_for_attached(&agent, 0).await;
    let release = release_file(&always, "during");
    let during = always.workload(&recorded_run("2", &release), &[]);
    during.read_until("waiting");
    wait_for_attached(&agent, 1).await;
    let space = capture_while(&agent, 2000, &release).await;
    assert_eq!(program_kernels(&space).len(), 4);
    let calls = api_calls_of(&space, during.workload.pid);
    assert!(
        calls.iter().any(|c| c.starts_with("cuLaunchKernel")),
        "{calls:?}"
    );
    let ended: Vec<String> = during.read_until("done");
    assert!(
        ended.iter().any(|l| l == "cupti armed=1 finalized=0"),
        "{ended:?}"
    );
    // The first process's past still shows under its own lines' names: the
    // later process did not take them over.
    let space = look_back(&agent, from, to).await;
    let first = format!("(pid {}: ", workload.workload.pid);
    let lines: Vec<String> = program_kernels(&space)
        .into_iter()
        .map(|(e, _)| e.line)
        .collect();
    assert!(
        lines.len() == 6 && lines.iter().all(|line| line.contains(&first)),
        "{lines:?}"
    );

    // The default records during captures alone: the same run leaves
    // nothing behind.
    let quiet = setup("cuda_past_default");
    let agent = quiet.agent();
    let release = release_file(&quiet, "past");
    let workload = quiet.workload(&["3", "--wait-file", release.to_str().unwrap()], &[]);
    workload.read_until("waiting");
    wait_for_attached(&agent, 1).await;
    let calls = run_released(&workload, &release);
    let (first, last) = (calls.first().unwrap(), calls.last().unwrap());
    let space = look_back(&agent, first.realtime.0, last.realtime.1 + 1).await;
    assert_eq!(program_kernels(&space).len(), 0);
}

/// A quiet workload of `iterations` of `sleep_ms` each, let go once the
/// agent has attached it; it starts once its kernels are recorded.
async fn paced_workload(
    setup: &Setup,
    agent: &AgentProcess,
    iterations: &str,
    sleep_ms: &str,
) -> CudaWorkload {
    paced_workload_with(setup, agent, iterations, sleep_ms, &[]).await
}

/// As [`paced_workload`], with `extra_env` on top of the workload's.
async fn paced_workload_with(
    setup: &Setup,
    agent: &AgentProcess,
    iterations: &str,
    sleep_ms: &str,
    extra_env: &[(&str, &str)],
) -> CudaWorkload {
    let release = release_file(setup, "paced");
    let args = [iterations, "--sleep-ms", sleep_ms, "--quiet"];
    let mut args = args.to_vec();
    args.extend(["--wait-recording", "--wait-file", release.to_str().unwrap()]);
    let workload = setup.workload(&args, extra_env);
    workload.read_until("waiting");
    wait_for_attached(agent, 1).await;
    std::fs::write(&release, b"go").expect("releasing the workload");
    workload
}

/// An agent that stops asking for the GPU's past (here: it stops) leaves
/// the workload as it found it: CUPTI detached, the job running on.
#[tokio::test(flavor = "multi_thread")]
async fn a_workload_recording_its_past_is_detached_when_the_agent_stops() {
    let setup = setup("cuda_past_stop");
    let mut agent = setup.agent_with(&["--cuda-record", "always"]);
    let workload = paced_workload(&setup, &agent, "150", "20").await;
    // Recording (the workload waited for it), then the agent goes.
    tokio::time::sleep(std::time::Duration::from_millis(500)).await;
    let status = agent.stop_with_sigterm(std::time::Duration::from_secs(20));
    assert!(status.is_some_and(|s| s.success()), "{status:?}");
    assert_left_detached(&workload);
}

/// How long a workload of these tests goes on following an agent that
/// stopped beating (the library's default is 5 s).
const AGENT_SILENCE: (&str, &str) = ("DEVTRACE_INJECT_AGENT_SILENCE_MS", "1000");

/// An agent killed (or OOM-killed) while a workload records its GPU's past
/// cannot clear the control word: the workload sees the agent's heartbeat
/// stop and detaches CUPTI by itself.
#[tokio::test(flavor = "multi_thread")]
async fn a_workload_recording_its_past_is_detached_when_its_agent_is_killed() {
    let setup = setup("cuda_past_killed");
    let agent = setup.agent_with(&["--cuda-record", "always"]);
    let workload = paced_workload_with(&setup, &agent, "200", "20", &[AGENT_SILENCE]).await;
    tokio::time::sleep(std::time::Duration::from_millis(500)).await;
    drop(agent);
    assert_left_detached(&workload);
}

/// The workload ran to its end with CUPTI detached.
fn assert_left_detached(workload: &CudaWorkload) {
    let ended = workload.read_until("done");
    assert!(
        ended.iter().any(|l| l == "cupti armed=0 finalized=1"),
        "{ended:?}"
    );
}

/// The same for an agent killed in the middle of a capture: the job does
/// not stay instrumented for the rest of its life.
#[tokio::test(flavor = "multi_thread")]
async fn a_workload_captured_when_its_agent_is_killed_is_detached() {
    let setup = setup("cuda_capture_killed");
    let agent = setup.agent();
    let workload = paced_workload_with(&setup, &agent, "200", "20", &[AGENT_SILENCE]).await;
    let mut client = agent.client().await;
    let capture =
        tokio::spawn(async move { client.profile(common::request(10_000, "killed")).await });
    tokio::time::sleep(std::time::Duration::from_millis(700)).await;
    drop(agent);
    assert!(
        capture.await.unwrap().is_err(),
        "the capture outlived its agent"
    );
    assert_left_detached(&workload);
}

/// A library that fails in the middle of a capture (here every flush of
/// CUPTI's buffers fails) says so once and still leaves the job as it found
/// it: what it had on is switched off and CUPTI detached, as at a capture's
/// end. (It used to stop where it failed, CUPTI armed for the rest of the
/// job's life.)
#[tokio::test(flavor = "multi_thread")]
async fn a_library_failing_mid_capture_leaves_the_job_detached() {
    let setup = setup("cuda_failing_mid_capture");
    let agent = setup.agent();
    let failing = ("DEVTRACE_STANDIN_CUPTI_FAIL", "cuptiActivityFlushAll");
    let mut workload = paced_workload_with(&setup, &agent, "200", "10", &[failing]).await;
    let mut client = agent.client().await;
    let _ = client.profile(common::request(1000, "failing")).await;
    assert_left_detached(&workload);
    let stderr = stderr_of(&mut workload);
    assert_one_library_message(&stderr, "cuptiActivityFlushAll");
}

/// An agent recording the GPU's past beside the mock, whose step `slow_at`
/// in is slow: a step-time trigger then saves the `before` seconds before
/// it (and 300 ms after) under `logdir`'s `plugins/profile`.
fn slow_step_agent(
    setup: &Setup,
    logdir: &std::path::Path,
    slow_at: &str,
    before: &str,
) -> AgentProcess {
    let repository = logdir.join("plugins/profile");
    let rule = format!("name=slow-step; when=step > 3x median(10); before={before}; after=300ms");
    setup.agent_with(&[
        "--backend",
        "mock",
        "--mock-rate",
        "20000",
        "--mock-slow-step",
        slow_at,
        "--cuda-record",
        "always",
        "--allow-root",
        logdir.to_str().unwrap(),
        "--trigger-repository",
        repository.to_str().unwrap(),
        "--trigger",
        &rule,
    ])
}

/// Under `--cuda-record always` a trigger's saved session holds the GPU
/// kernels from before the moment it fired: the mock's slow step fires a
/// step-time rule while a CUDA workload runs, and the saved trace has the
/// workload's kernels of the seconds before that step.
#[tokio::test(flavor = "multi_thread")]
async fn a_triggers_saved_session_holds_gpu_kernels_from_before_the_slow_step() {
    let setup = setup("cuda_before_step");
    let logdir = tempfile::tempdir().unwrap();
    let repository = logdir.path().join("plugins/profile");
    let agent = slow_step_agent(&setup, logdir.path(), "4s", "2s");
    let workload = paced_workload(&setup, &agent, "400", "10").await;
    let found = crate::triggers::wait_for_sessions(&repository, 1);
    let space = XSpace::decode(&std::fs::read(&found[0].1).unwrap()[..]).unwrap();
    let steps = timed(&space, "/host:CPU");
    let slow_start = steps
        .iter()
        .filter(|(e, _)| e.name == "train")
        .max_by_key(|(e, _)| e.duration_ps)
        .map(|(_, at)| *at)
        .expect("the mock's steps");
    let before = program_kernels(&space)
        .iter()
        .filter(|(_, at)| *at < slow_start)
        .count();
    assert!(
        before > 10,
        "{before} of the workload's kernels before the slow step"
    );
    drop(workload);
}

/// Two containers' workloads are both pid 1 in their own pid namespaces:
/// their files must not collide, and the agent, in the host's namespace,
/// must find them by their host pids and put their calls on the lines of
/// their host thread ids.
#[tokio::test(flavor = "multi_thread")]
async fn workloads_in_pid_namespaces_of_their_own_are_traced_under_host_pids() {
    if !common::is_root() {
        eprintln!("skipped: making pid namespaces needs root");
        return;
    }
    let setup = setup("cuda_contained");
    let agent = setup.agent();
    let release = release_file(&setup, "contained");
    let wait = ["--wait-file", release.to_str().unwrap()];
    let a = setup.contained_workload(&["2", wait[0], wait[1], "--wait-recording"]);
    let b = setup.contained_workload(&["3", wait[0], wait[1], "--wait-recording"]);
    for workload in [&a, &b] {
        let lines = workload.read_until("waiting");
        assert!(
            lines.last().unwrap().starts_with("waiting pid=1 "),
            "{lines:?}"
        );
    }
    let (host_a, host_b) = (a.host_pid(), b.host_pid());
    wait_for_attached(&agent, 2).await;
    let rings = std::fs::read_dir(setup.runtime.path())
        .unwrap()
        .flatten()
        .filter(|e| {
            let name = e.file_name().into_string().unwrap();
            name.starts_with("cuda-1-") && name.ends_with(".ring")
        })
        .count();
    assert_eq!(rings, 2);
    let space = capture_while(&agent, 2000, &release).await;
    let calls = calls_until_done(&a);
    calls_until_done(&b);
    assert!(calls.iter().all(|c| c.pid == 1 && c.tid == 1), "{calls:?}");

    let mut per_line: BTreeMap<String, usize> = BTreeMap::new();
    for (e, _) in timed(&space, "/device:GPU:0") {
        if e.name == "vector_add" {
            *per_line.entry(e.line.clone()).or_default() += 1;
        }
    }
    let expected: BTreeMap<String, usize> = [(host_a, 2), (host_b, 3)]
        .into_iter()
        .map(|(pid, n)| {
            (
                format!("Stream #13(Compute,MemcpyD2H) (pid {pid}: cuda_contained)"),
                n,
            )
        })
        .collect();
    assert_eq!(per_line, expected, "{:?}", space.warnings);

    // The calls of A's one thread (1 in its namespace) are on the line of
    // its host thread id, which for a main thread is the host pid.
    let host = common::plane(&space, "/host:CPU");
    let line_of = |id: u32| host.lines.iter().find(|l| l.id == i64::from(id));
    let names: Vec<(i64, &str)> = host.lines.iter().map(|l| (l.id, l.name.as_str())).collect();
    let own = line_of(host_a).unwrap_or_else(|| panic!("no line for A's thread: {names:?}"));
    assert_eq!(own.name, format!("cuda_contained {host_a} (pid {host_a})"));
    let launches = own
        .events
        .iter()
        .filter(|e| host.event_metadata[&e.metadata_id].name == "cuLaunchKernel")
        .count();
    let launched = calls.iter().filter(|c| c.name == "cuLaunchKernel").count();
    assert_eq!(launches, launched);
    assert!(line_of(1).is_none_or(|l| !l.name.contains("cuda_contained")));
    assert!(
        space
            .warnings
            .iter()
            .any(|w| w.contains(&format!("process {host_a} (pid 1 in its namespace; "))),
        "{:?}",
        space.warnings
    );
}

/// An agent in a pid namespace of its own (a container without hostPID)
/// cannot see the host's processes: it says so, and how to run it.
#[tokio::test(flavor = "multi_thread")]
async fn an_agent_that_cannot_see_a_workloads_namespace_says_how_to_run_it() {
    if !common::is_root() {
        eprintln!("skipped: making pid namespaces needs root");
        return;
    }
    let setup = setup("cuda_unseen");
    let runtime = setup.runtime.path().to_str().unwrap();
    let agent = AgentProcess::adopt(
        std::process::Command::new("unshare")
            .args(["--pid", "--fork", "--kill-child", "--mount-proc"])
            .arg(common::BIN)
            .args(["serve", "--listen", "127.0.0.1:0", "--log-level", "error"])
            .args([
                "--metrics-listen",
                "off",
                "--backend",
                "cuda",
                "--backend",
                "mock",
            ])
            .args(["--runtime-dir", runtime])
            .stdout(std::process::Stdio::piped())
            .spawn()
            .expect("starting the agent in a pid namespace"),
    );
    let release = release_file(&setup, "unseen");
    // Its ring appears during the capture, which then names the refusal.
    let started = async {
        tokio::time::sleep(std::time::Duration::from_millis(300)).await;
        let workload = setup.workload(&["1", "--wait-file", release.to_str().unwrap()], &[]);
        workload.read_until("waiting");
        workload
    };
    let (space, workload) = tokio::join!(capture(&agent, 3000), started);
    let seen = space.warnings;
    assert!(
        seen.iter()
            .any(|w| w.contains("a pid namespace this agent cannot see") && w.contains("hostPID")),
        "{seen:?}"
    );
    std::fs::write(&release, b"go").unwrap();
    calls_until_done(&workload);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_full_workload_ring_counts_what_it_drops() {
    let setup = setup("cuda_flood");
    let agent = setup.agent();
    let release = release_file(&setup, "flood");
    // 16 slots against a few thousand records per flush.
    let workload = setup.workload(
        &["300", "--wait-file", release.to_str().unwrap()],
        &[("DEVTRACE_INJECT_RING_CAPACITY", "16")],
    );
    workload.read_until("waiting");
    wait_for_attached(&agent, 1).await;
    let space = capture_while(&agent, 2000, &release).await;
    calls_until_done(&workload);
    let warning = space
        .warnings
        .iter()
        .find(|w| w.contains("could not queue because their ring was full"))
        .unwrap_or_else(|| panic!("{:?}", space.warnings));
    let dropped: u64 = warning
        .split_whitespace()
        .find_map(|w| w.parse().ok())
        .expect("a count");
    let received = common::event_count(&space) as u64;
    // Each iteration makes 16 records (7 calls, 2 kernels, 2 copies, 2
    // allocator events, 1 synchronization, and their correlations); the
    // ring dropped some and the rest arrived.
    assert!(
        dropped > 0 && received > 0,
        "dropped {dropped}, received {received}"
    );
    assert!(
        dropped + received >= 300 * 7,
        "dropped {dropped} + received {received}"
    );
}

fn stderr_of(workload: &mut CudaWorkload) -> String {
    let mut text = String::new();
    if let Some(mut stderr) = workload.workload.child.stderr.take() {
        use std::io::Read;
        let _ = stderr.read_to_string(&mut text);
    }
    text
}

#[tokio::test(flavor = "multi_thread")]
async fn a_cupti_failure_is_logged_once_and_the_workload_runs_on() {
    let setup = setup("cuda_failing");
    let agent = setup.agent();
    let release = release_file(&setup, "failing");
    let mut workload = setup.workload(
        &["3", "--wait-file", release.to_str().unwrap()],
        &[("DEVTRACE_STANDIN_CUPTI_FAIL", "cuptiActivityEnable")],
    );
    workload.read_until("waiting");
    let pid = workload.workload.pid;
    wait_for_attached(&agent, 1).await;
    let space = capture_while(&agent, 1500, &release).await;
    let calls = calls_until_done(&workload);
    assert!(
        calls.iter().all(|c| c.fields["rc"] == "0"),
        "the workload's calls all succeed"
    );
    let status = workload
        .workload
        .child
        .wait()
        .expect("waiting for the workload");
    assert!(status.success(), "{status:?}");
    let stderr = stderr_of(&mut workload);
    let lines: Vec<&str> = stderr
        .lines()
        .filter(|l| l.starts_with("devtrace-inject:"))
        .collect();
    assert_eq!(lines.len(), 1, "{stderr}");
    assert!(
        lines[0].contains("cuptiActivityEnable")
            && lines[0].contains("CUPTI_ERROR_NOT_INITIALIZED"),
        "{}",
        lines[0]
    );
    assert!(
        space
            .warnings
            .iter()
            .any(|w| w.contains(&format!("process {pid} "))
                && w.contains("stopped tracing: cuptiActivityEnable")),
        "{:?}",
        space.warnings
    );
}

#[test]
fn without_libcupti_the_workload_runs_untraced_with_one_message() {
    let setup = setup("cuda_no_cupti");
    // Only the driver's directory: a copy without the stand-in CUPTI.
    let lonely = tempfile::tempdir().unwrap();
    for name in ["libcuda.so.1", "libcuda.so"] {
        std::os::unix::fs::symlink(
            setup.libraries.join("libcuda.so.1"),
            lonely.path().join(name),
        )
        .unwrap();
    }
    let output = std::process::Command::new(&setup.program)
        .args(["3", "--sleep-ms", "200"])
        .env("LD_LIBRARY_PATH", lonely.path())
        .env("CUDA_INJECTION64_PATH", &setup.inject)
        .env("DEVTRACE_RUNTIME_DIR", setup.runtime.path())
        .output()
        .expect("running the workload");
    assert!(output.status.success(), "{output:?}");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_one_library_message(&stderr, "libcupti was not found");
}

/// A runtime directory whose filesystem cannot hold a ring (a container's
/// small `/dev/shm`, an `emptyDir` with a size limit): the library says so
/// once and the job runs on, never killed by a store into a page the
/// filesystem could not find.
#[tokio::test(flavor = "multi_thread")]
async fn a_runtime_directory_too_full_for_a_ring_leaves_the_job_untraced_and_alive() {
    let setup = setup("cuda_full_runtime_dir");
    let mounted = std::process::Command::new("mount")
        .args(["-t", "tmpfs", "-o", "size=256k", "devtrace-test"])
        .arg(setup.runtime.path())
        .status()
        .unwrap();
    assert!(mounted.success(), "mounting a tmpfs needs root");
    struct Unmount<'a>(&'a std::path::Path);
    impl Drop for Unmount<'_> {
        fn drop(&mut self) {
            let _ = std::process::Command::new("umount").arg(self.0).status();
        }
    }
    let _unmount = Unmount(setup.runtime.path());
    // Recording all along, the ring's pages are written well past the
    // filesystem's 256 KiB.
    let _agent = setup.agent_with(&["--cuda-record", "always"]);
    let env = setup.environment("CUDA_INJECTION64_PATH");
    let output = std::process::Command::new(&setup.program)
        .args(["3000", "--sleep-ms", "1"])
        .envs(env.iter().map(|(k, v)| (k, v)))
        .output()
        .expect("running the workload");
    let stderr = String::from_utf8_lossy(&output.stderr);
    // Before rings were allocated as they were made: SIGBUS (status 7)
    // some 700 iterations in.
    assert!(output.status.success(), "{:?}: {stderr}", output.status);
    assert_one_library_message(&stderr, "No space left");
}

/// The library said one thing on the job's standard error, and it holds
/// `needle`.
fn assert_one_library_message(stderr: &str, needle: &str) {
    let lines: Vec<&str> = stderr
        .lines()
        .filter(|l| l.starts_with("devtrace-inject:"))
        .collect();
    assert_eq!(lines.len(), 1, "{stderr}");
    assert!(lines[0].contains(needle), "{}", lines[0]);
}

/// The real CUDA driver, as the dynamic loader knows it.
fn real_driver() -> Option<PathBuf> {
    let listing = std::process::Command::new("ldconfig")
        .arg("-p")
        .output()
        .ok()?;
    String::from_utf8_lossy(&listing.stdout)
        .lines()
        .find(|l| l.trim_start().starts_with("libcuda.so.1 ") && l.contains("x86-64"))
        .and_then(|l| l.split("=> ").nth(1))
        .map(|p| PathBuf::from(p.trim()))
}

/// A directory holding the real libcupti: `DEVTRACE_CUPTI_DIR`, the CUDA
/// toolkit's, or the `nvidia-cuda-cupti-cu12` wheel's.
fn real_cupti_dir() -> Option<PathBuf> {
    let mut candidates: Vec<PathBuf> = std::env::var_os("DEVTRACE_CUPTI_DIR")
        .map(PathBuf::from)
        .into_iter()
        .collect();
    candidates.push("/usr/local/cuda/extras/CUPTI/lib64".into());
    candidates.push("/usr/local/cuda/lib64".into());
    for package in ["nvidia.cu13", "nvidia.cuda_cupti"] {
        let script = format!(
            "import {package}, os; print(os.path.join(list({package}.__path__)[0], 'lib'))"
        );
        if let Ok(out) = std::process::Command::new("python3")
            .args(["-c", &script])
            .output()
        {
            candidates.push(PathBuf::from(String::from_utf8_lossy(&out.stdout).trim()));
        }
    }
    candidates.into_iter().find(|dir| {
        ["libcupti.so.13", "libcupti.so.12", "libcupti.so"]
            .iter()
            .any(|name| dir.join(name).exists())
    })
}

/// On a machine with an NVIDIA GPU: the same program with real PTX, the
/// real driver and the real libcupti; real kernels arrive.
#[tokio::test(flavor = "multi_thread")]
#[ignore = "needs an NVIDIA GPU, its driver and libcupti (DEVTRACE_CUPTI_DIR)"]
async fn real_kernels_arrive_from_a_real_gpu() {
    let driver = real_driver().expect("no libcuda.so.1 known to ldconfig");
    let cupti = real_cupti_dir().expect("no libcupti found; set DEVTRACE_CUPTI_DIR");
    let program = common::build_program(
        "cuda_workload.c",
        "cuda_real",
        &["-pthread", driver.to_str().unwrap()],
    );
    let runtime = tempfile::tempdir().unwrap();
    let agent = AgentProcess::start(&[
        "--backend",
        "cuda",
        "--runtime-dir",
        runtime.path().to_str().unwrap(),
    ]);
    let release = runtime.path().join("go");
    let inject = inject_library();
    let workload = CudaWorkload::start(
        &program,
        &["20", "--wait-file", release.to_str().unwrap(), "--real-ptx"],
        &[
            ("LD_LIBRARY_PATH", cupti.to_str().unwrap()),
            ("CUDA_INJECTION64_PATH", inject.to_str().unwrap()),
            ("DEVTRACE_RUNTIME_DIR", runtime.path().to_str().unwrap()),
        ],
    );
    workload.read_until("waiting");
    wait_for_attached(&agent, 1).await;
    let space = capture_while(&agent, 3000, &release).await;
    let calls = calls_until_done(&workload);
    assert!(
        calls.iter().all(|c| c.fields["rc"] == "0"),
        "a driver call failed: {calls:?}"
    );
    let gpu = timed(&space, "/device:GPU:0");
    for name in ["vector_add", "matmul_tiled"] {
        let kernels: Vec<_> = gpu.iter().filter(|(e, _)| e.name == name).collect();
        assert_eq!(kernels.len(), 20, "{name}: {:?}", space.warnings);
        assert!(kernels.iter().all(|(e, _)| e.duration_ps > 0));
    }
    let name = plane_stat(&space, "/device:GPU:0", "gpu_device_name");
    eprintln!("real GPU: {name:?}; warnings: {:?}", space.warnings);
    assert!(matches!(name, Some(StatValue::Str(n)) if !n.is_empty()));
}

#[tokio::test(flavor = "multi_thread")]
async fn ld_preload_loads_the_library_as_well() {
    let setup = setup("cuda_preloaded");
    let agent = setup.agent();
    let release = release_file(&setup, "preloaded");
    let workload = setup.workload_loading("LD_PRELOAD", &recorded_run("2", &release), &[]);
    workload.read_until("waiting");
    wait_for_attached(&agent, 1).await;
    let space = capture_while(&agent, 1500, &release).await;
    calls_until_done(&workload);
    let kernels = program_kernels(&space).len();
    assert_eq!(kernels, 4);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_cupti_of_an_unknown_major_is_refused_with_one_message() {
    let setup = setup("cuda_newer_cupti");
    let agent = setup.agent();
    let release = release_file(&setup, "newer");
    // A CUDA 14 CUPTI: its records may be laid out in ways not known here.
    let mut workload = setup.workload(
        &["2", "--wait-file", release.to_str().unwrap()],
        &[("DEVTRACE_STANDIN_CUPTI_VERSION", "140000")],
    );
    workload.read_until("waiting");
    wait_for_attached(&agent, 1).await;
    let space = capture_while(&agent, 1500, &release).await;
    calls_until_done(&workload);
    assert!(workload.workload.child.wait().unwrap().success());
    let gpu = timed(&space, "/device:GPU:0");
    assert!(gpu.is_empty(), "nothing misread: {gpu:?}");
    let stderr = stderr_of(&mut workload);
    let lines: Vec<&str> = stderr.lines().collect();
    assert_eq!(lines.len(), 1, "{stderr}");
    assert!(
        lines[0].contains("libcupti has API version 140000 (CUDA 14)"),
        "{stderr}"
    );
    assert!(
        space
            .warnings
            .iter()
            .any(|w| w.contains("stopped tracing") && w.contains("API version 140000")),
        "{:?}",
        space.warnings
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn cupti_13_0_ga_is_read_with_a_warning_about_its_bugs() {
    let setup = setup("cuda_13_0_ga");
    let agent = setup.agent();
    let release = release_file(&setup, "ga");
    let mut workload = setup.workload(
        &recorded_run("2", &release),
        &[("DEVTRACE_STANDIN_CUPTI_VERSION", "130000")],
    );
    workload.read_until("waiting");
    wait_for_attached(&agent, 1).await;
    let space = capture_while(&agent, 1500, &release).await;
    calls_until_done(&workload);
    assert!(workload.workload.child.wait().unwrap().success());
    let kernels = program_kernels(&space).len();
    assert_eq!(kernels, 4);
    assert!(stderr_of(&mut workload).contains("13.0 Update 1"));
    assert!(
        space
            .warnings
            .iter()
            .any(|w| w.contains("13.0 GA (API version 130000) has bugs")),
        "{:?}",
        space.warnings
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn kernels_of_cuda_graph_replays_carry_their_graph_and_node() {
    let setup = setup("cuda_graphs");
    let agent = setup.agent();
    let release = release_file(&setup, "graphs");
    let workload = setup.workload(
        &[
            "2",
            "--graph",
            "--wait-file",
            release.to_str().unwrap(),
            "--wait-recording",
        ],
        &[("DEVTRACE_STANDIN_CUPTI_VERSION", "130401")],
    );
    workload.read_until("waiting");
    wait_for_attached(&agent, 1).await;
    let space = capture_while(&agent, 1500, &release).await;
    let calls = calls_until_done(&workload);
    let gpu = timed(&space, "/device:GPU:0");
    let graph_kernels: Vec<&Seen> = gpu
        .iter()
        .map(|(e, _)| e)
        .filter(|e| e.stats.contains_key("cuda_graph_id"))
        .collect();
    // Two replays of a graph of two kernel nodes.
    assert_eq!(graph_kernels.len(), 4, "{gpu:?}");
    let mut nodes: Vec<u64> = graph_kernels
        .iter()
        .map(|e| uint(e, "cuda_graph_node_id"))
        .collect();
    nodes.sort();
    assert_eq!(nodes, [1, 1, 2, 2]);
    // Both kernels of a replay share the correlation id of its cuGraphLaunch.
    let host = timed(&space, "/host:CPU");
    let replays = calls.iter().filter(|c| c.name == "cuGraphLaunch").count();
    assert_eq!(replays, 2);
    for kernel in &graph_kernels {
        let id = uint(kernel, "correlation_id");
        let launch = host
            .iter()
            .filter(|(e, _)| e.name == "cuGraphLaunch")
            .filter(|(e, _)| uint(e, "correlation_id") == id)
            .count();
        assert_eq!(launch, 1, "kernel with correlation {id}");
        assert!(!kernel.stats.contains_key("device_launched"));
    }
    // Kernels launched directly carry no graph.
    let direct = gpu
        .iter()
        .filter(|(e, _)| !e.stats.contains_key("cuda_graph_id"))
        .filter(|(e, _)| is_program_kernel(e))
        .count();
    assert_eq!(direct, 4);
}

/// One GPU plane per physical GPU: two processes that each see their GPU as
/// CUDA ordinal 0 (`CUDA_VISIBLE_DEVICES`, as under Kubernetes, Slurm or
/// torchrun) land on the planes NVML numbers them by, beside its counters.
#[tokio::test(flavor = "multi_thread")]
async fn processes_on_two_physical_gpus_get_the_planes_nvml_gives_them() {
    let setup = setup("cuda_two_gpus");
    let dir = tempfile::tempdir().unwrap();
    let control = dir.path().join("nvml.ctl");
    std::fs::write(&control, "gpus=2\n").unwrap();
    let nvml = common::build_standin("nvml.c", "libnvidia-ml.so.1");
    let agent = AgentProcess::start_with_env(
        &[
            "--backend",
            "cuda",
            "--backend",
            "nvml",
            "--nvml-library",
            nvml.to_str().unwrap(),
            "--nvml-interval",
            "5ms",
            "--runtime-dir",
            setup.runtime.path().to_str().unwrap(),
        ],
        &[("DEVTRACE_NVML_STANDIN", control.as_path())],
    );
    let release = release_file(&setup, "two");
    // Each runs its kernels once they are recorded, however late a loaded
    // machine lets its library start CUPTI after the release.
    let args = [
        "2",
        "--wait-file",
        release.to_str().unwrap(),
        "--wait-recording",
    ];
    // The process on physical GPU 1 starts first: were planes handed out by
    // arrival, it would take plane 0.
    let on_gpu1 = setup.workload(
        &args,
        &[
            ("DEVTRACE_STANDIN_GPUS", "2"),
            ("CUDA_VISIBLE_DEVICES", "1"),
        ],
    );
    on_gpu1.read_until("waiting");
    wait_for_attached(&agent, 1).await;
    let on_gpu0 = setup.workload(
        &args,
        &[
            ("DEVTRACE_STANDIN_GPUS", "2"),
            ("CUDA_VISIBLE_DEVICES", "0"),
        ],
    );
    let also_on_gpu1 = setup.workload(
        &args,
        &[
            ("DEVTRACE_STANDIN_GPUS", "2"),
            ("CUDA_VISIBLE_DEVICES", "1"),
        ],
    );
    on_gpu0.read_until("waiting");
    also_on_gpu1.read_until("waiting");
    wait_for_attached(&agent, 3).await;
    let space = capture_while(&agent, 2000, &release).await;
    for workload in [&on_gpu1, &on_gpu0, &also_on_gpu1] {
        calls_until_done(workload);
    }
    let kernels_by_pid = |plane: &str| -> BTreeMap<u32, usize> {
        let mut by_pid = BTreeMap::new();
        for (e, _) in timed(&space, plane) {
            if is_program_kernel(&e) {
                let pid =
                    e.line.split("(pid ").nth(1).and_then(|rest| {
                        rest.split(':').next().and_then(|p| p.parse::<u32>().ok())
                    });
                *by_pid
                    .entry(pid.expect("pid in the line name"))
                    .or_default() += 1;
            }
        }
        by_pid
    };
    let pids = |workloads: &[&CudaWorkload]| -> BTreeMap<u32, usize> {
        workloads.iter().map(|w| (w.workload.pid, 4)).collect()
    };
    assert_eq!(kernels_by_pid("/device:GPU:0"), pids(&[&on_gpu0]));
    assert_eq!(
        kernels_by_pid("/device:GPU:1"),
        pids(&[&on_gpu1, &also_on_gpu1])
    );
    assert!(space
        .planes
        .iter()
        .all(|p| !p.name.starts_with("/device:GPU:") || p.name.len() == "/device:GPU:0".len()));
    // NVML's counters share each plane with its kernels.
    for plane in ["/device:GPU:0", "/device:GPU:1"] {
        let counters = common::plane(&space, plane)
            .lines
            .iter()
            .any(|l| l.name == "_counters_" && !l.events.is_empty());
        assert!(counters, "no NVML counters on {plane}");
    }
}

/// Captures 2.5 s of a workload running 6 iterations 150 ms apart, whose
/// second CUPTI user (a stand-in for torch.profiler) records iterations 2
/// and 3, the library loaded through `variable`. Returns the trace, the
/// workload's output and our kernels with their times; the rival must have
/// got all of its kernels.
async fn capture_beside_a_rival(
    name: &str,
    variable: &str,
    version: &str,
    binding: Binding,
) -> (XSpace, Vec<String>, Vec<(Seen, u64)>) {
    let mut setup = setup(name);
    if binding == Binding::Linked {
        setup.program = rival_linked_program();
    }
    let agent = setup.agent();
    let release = release_file(&setup, "rival");
    let workload = rival_workload(&setup, variable, version, binding, "150", &release);
    workload.read_until("waiting");
    wait_for_attached(&agent, 1).await;
    let space = capture_while(&agent, 2500, &release).await;
    let lines = workload.read_until("done");
    let (rival_kernels, _, _) = rival_report(&lines);
    assert_eq!(rival_kernels, 4, "the other profiler keeps working");
    let ours = program_kernels(&space);
    (space, lines, ours)
}

/// How the rival finds CUPTI's functions.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Binding {
    /// `dlsym(RTLD_DEFAULT, ...)`: the global scope.
    Lookup,
    /// Imported by the program (linked with -lcupti), through its PLT and
    /// GOT, as PyTorch's Kineto calls them.
    Linked,
    /// `dlsym` on libcupti's own handle, as XLA's CUPTI wrapper looks them
    /// up: no name another library exports is in the way.
    Direct,
}

/// The workload linked against the stand-in libcupti as well.
fn rival_linked_program() -> PathBuf {
    let dir = cupti_standin();
    let search = format!("-L{}", dir.display());
    let rpath = format!("-Wl,-rpath,{}", dir.display());
    common::build_program(
        "cuda_workload.c",
        "cuda_rival_linked",
        // The program's references to CUPTI are weak: keep libcupti needed.
        &[
            "-pthread",
            &search,
            "-lcuda",
            "-Wl,--no-as-needed",
            "-lcupti",
            &rpath,
        ],
    )
}

fn rival_workload(
    setup: &Setup,
    variable: &str,
    version: &str,
    binding: Binding,
    sleep_ms: &str,
    release: &std::path::Path,
) -> CudaWorkload {
    let mut args: Vec<&str> = vec![
        "6",
        "--wait-file",
        release.to_str().unwrap(),
        "--sleep-ms",
        sleep_ms,
        "--rival-at",
        "2",
        "--rival-iterations",
        "2",
        // The kernels asserted on run once recording has begun and once the
        // stream is ours again, however slowly a loaded machine schedules
        // the library's thread.
        "--wait-recording",
    ];
    match binding {
        Binding::Lookup => {}
        Binding::Linked => args.push("--rival-linked"),
        Binding::Direct => args.push("--rival-direct"),
    }
    setup.workload_loading(
        variable,
        &args,
        &[("DEVTRACE_STANDIN_CUPTI_VERSION", version)],
    )
}

/// The `key=value` fields of the first line starting with `prefix`, by key.
fn line_fields(lines: &[String], prefix: &str) -> impl Fn(&str) -> u64 {
    let line = lines
        .iter()
        .find(|l| l.starts_with(prefix))
        .unwrap_or_else(|| panic!("no {prefix:?} line: {lines:?}"))
        .clone();
    move |key: &str| -> u64 {
        line.split_whitespace()
            .find_map(|f| f.strip_prefix(key))
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("{key} in {line}"))
    }
}

/// The rival's report: kernels it received and its span on the host clock.
fn rival_report(lines: &[String]) -> (usize, u64, u64) {
    let field = line_fields(lines, "rival:");
    (
        field("kernels=") as usize,
        field("start_ns="),
        field("end_ns="),
    )
}

/// The trace blames no other CUPTI user for a gap.
fn assert_no_other_cupti_user(space: &XSpace) {
    let blamed = common::warnings_with(space, "another CUPTI user");
    assert!(blamed.is_empty(), "{:?}", space.warnings);
}

/// No launch of the capture is said to have lost its kernels.
fn assert_no_launch_unanswered(space: &XSpace) {
    let told = common::warnings_with(space, "no kernel record of its last");
    assert!(told.is_empty(), "{:?}", space.warnings);
}

/// The lost span a warning reports, in seconds from the window's start.
fn lost_span(space: &XSpace) -> (f64, f64) {
    span_in_warning(space, "another CUPTI user")
        .unwrap_or_else(|| panic!("no lost span in {:?}", space.warnings))
}

/// The library sees the other user's calls through the names it exports
/// (preloaded, or put in the global scope when the driver loads it; here on
/// CUDA 12's one global buffer, where no probe could tell): it steps aside
/// when its callbacks are replaced and takes the stream back as soon as the
/// other user has switched its kinds off and flushed. Both get every kernel
/// of their part.
#[tokio::test(flavor = "multi_thread")]
async fn a_second_cupti_user_is_stepped_aside_for_and_the_stream_taken_back() {
    for variable in ["LD_PRELOAD", "CUDA_INJECTION64_PATH"] {
        seen_rival(variable, Binding::Lookup).await;
    }
}

/// A framework linked against libcupti (PyTorch's Kineto) calls it through
/// its own GOT, which the dynamic linker's lookup order never reaches: the
/// library loaded by the driver redirects those slots to itself, and the
/// other profiler is seen as well.
#[tokio::test(flavor = "multi_thread")]
async fn a_cupti_user_linked_against_libcupti_is_seen_through_its_got() {
    seen_rival("CUDA_INJECTION64_PATH", Binding::Linked).await;
}

/// A profiler that looks CUPTI's functions up on libcupti's own handle
/// (`dlsym`, as XLA's wrapper does) finds the library's, since libcupti's
/// symbol table entries for them point there: it is seen as well.
#[tokio::test(flavor = "multi_thread")]
async fn a_cupti_user_looking_up_libcuptis_handle_is_seen_through_its_symbol_table() {
    seen_rival("CUDA_INJECTION64_PATH", Binding::Direct).await;
}

async fn seen_rival(variable: &str, binding: Binding) {
    let (space, lines, ours) =
        capture_beside_a_rival("cuda_rival_seen", variable, "26", binding).await;
    let (_, rival_start, rival_end) = rival_report(&lines);
    // Iterations 0, 1, 4 and 5 are ours; none of the rival's is.
    assert_eq!(ours.len(), 8, "{:?}", space.warnings);
    assert!(ours
        .iter()
        .all(|(_, at)| *at < rival_start || *at > rival_end));
    let (start, _) = common::window_of(&space);
    let (from, to) = lost_span(&space);
    let seconds = |ns: u64| (ns - start) as f64 / 1e9;
    // The reported span covers the rival's and ends before the first kernel
    // recorded after it.
    assert!(
        from <= seconds(rival_start) + 0.001,
        "{from} vs {}",
        seconds(rival_start)
    );
    let first_after = ours
        .iter()
        .map(|(_, at)| *at)
        .filter(|at| *at > rival_end)
        .min()
        .expect("kernels of ours after the rival's");
    assert!(
        to + 0.001 >= seconds(rival_end) && to <= seconds(first_after),
        "span ends at {to} s; the rival ended at {} s and our next kernel ran at {} s",
        seconds(rival_end),
        seconds(first_after)
    );
    // The span's end says when the stream came back: no line of its own.
    assert!(!space
        .warnings
        .iter()
        .any(|w| w.contains("has the CUPTI activity stream again")));
}

/// A profiler that registers a clock of its own for CUPTI's records
/// (PyTorch's Kineto registers the CPU's time-stamp counter each time
/// `torch.profiler` starts) has every later record stamped with it, ours
/// too, while `cuptiGetTimestamp` keeps CUPTI's clock: the library sees the
/// registration and maps records by the clock that stamped them, so the
/// kernels after the profiler's part lie where their launches ran (mapped
/// through CUPTI's clock they fell decades before the window and were
/// dropped).
#[tokio::test(flavor = "multi_thread")]
async fn records_stamped_with_a_clock_another_profiler_registered_land_where_they_ran() {
    // Kineto finalizes CUPTI as it tears a profile down; the stand-in keeps
    // the clock across a finalize (real CUPTI's choice is not known).
    for finalizes in [false, true] {
        capture_beside_a_rival_with_its_own_clock(finalizes).await;
    }
}

async fn capture_beside_a_rival_with_its_own_clock(finalizes: bool) {
    let mut rival = vec!["--rival-iterations", "2", "--rival-linked", "--rival-clock"];
    if finalizes {
        rival.push("--rival-finalize");
    }
    let (space, lines) = capture_a_rival_from_iteration_2("cuda_rival_clock", &rival).await;
    let (rival_kernels, rival_start, rival_end) = rival_report(&lines);
    assert_eq!(rival_kernels, 4, "the other profiler keeps working");
    let ours = program_kernels(&space);
    // Iterations 0, 1, 4 and 5 are ours, the last two after the clock
    // changed.
    assert_eq!(
        ours.len(),
        8,
        "finalizes: {finalizes}: {:?}",
        space.warnings
    );
    let after = ours.iter().filter(|(_, at)| *at > rival_end).count();
    assert_eq!(after, 4, "{ours:?}");
    assert!(ours
        .iter()
        .all(|(_, at)| *at < rival_start || *at > rival_end));
    assert_kernels_where_launched(&ours, &lines);
    let unplaced = common::warnings_with(&space, "neither its own nor one registered");
    assert!(unplaced.is_empty(), "{:?}", space.warnings);
    // The kernels the profiler had are in its span, not told again.
    assert_no_launch_unanswered(&space);
}

/// Captures 2.5 s of the workload linked against libcupti running 6
/// iterations 150 ms apart, with a rival profiler from iteration 2 as
/// `rival` says; the trace and the workload's output.
async fn capture_a_rival_from_iteration_2(name: &str, rival: &[&str]) -> (XSpace, Vec<String>) {
    let mut args = vec![
        "6",
        "--sleep-ms",
        "150",
        "--rival-at",
        "2",
        "--wait-recording",
    ];
    args.extend_from_slice(rival);
    capture_a_rival(name, &args).await
}

/// Captures 2.5 s of the workload linked against libcupti, run with `args`
/// (ITERATIONS first) and released 300 ms into the capture; the trace and
/// the workload's output.
async fn capture_a_rival(name: &str, args: &[&str]) -> (XSpace, Vec<String>) {
    let mut setup = setup(name);
    setup.program = rival_linked_program();
    let agent = setup.agent();
    let release = release_file(&setup, "rival");
    let mut all = args.to_vec();
    all.splice(1..1, ["--wait-file", release.to_str().unwrap()]);
    let workload = setup.workload_loading(
        "CUDA_INJECTION64_PATH",
        &all,
        &[("DEVTRACE_STANDIN_CUPTI_VERSION", "130001")],
    );
    workload.read_until("waiting");
    wait_for_attached(&agent, 1).await;
    let space = capture_while(&agent, 2500, &release).await;
    let lines = workload.read_until("done");
    (space, lines)
}

/// Each kernel starts as its launch call enters (the stand-in's device is
/// idle), give or take the clocks' readings: within 2 ms of a
/// `cuLaunchKernel` the workload printed.
fn assert_kernels_where_launched(kernels: &[(Seen, u64)], lines: &[String]) {
    let launches: Vec<u64> = lines
        .iter()
        .filter_map(|l| parse_call(l))
        .filter(|c| c.name == "cuLaunchKernel")
        .map(|c| c.realtime.0)
        .collect();
    for (kernel, at) in kernels {
        let nearest = launches
            .iter()
            .map(|launch| launch.abs_diff(*at))
            .min()
            .expect("launch calls");
        assert!(
            nearest < 2_000_000,
            "{kernel:?} at {at} is {nearest} ns from the nearest launch"
        );
    }
}

/// A profiler that registered the CPU's time-stamp counter for CUPTI's
/// records where the library could not see it (it looked CUPTI up before
/// the library loaded, as `torch.profiler` run before `devtrace attach`
/// would have) leaves records the library recognises by their values: they
/// land where they ran, and the trace says which clock they carried.
#[cfg(target_arch = "x86_64")]
#[tokio::test(flavor = "multi_thread")]
async fn records_of_the_time_stamp_counter_registered_unseen_land_where_they_ran() {
    let rival = ["--rival-clock-only", "--rival-direct", "--rival-early"];
    let (space, lines) = capture_a_rival_from_iteration_2("cuda_rival_unseen_clock", &rival).await;
    let ours = program_kernels(&space);
    // All six iterations are ours: the profiler only registered its clock.
    assert_eq!(ours.len(), 12, "{:?}", space.warnings);
    assert_no_launch_unanswered(&space);
    assert_kernels_where_launched(&ours, &lines);
    let said = common::warnings_with(&space, "the CPU's time-stamp counter");
    assert_eq!(said.len(), 1, "{:?}", space.warnings);
}

/// A profiler that finalizes CUPTI when done (as Kineto tears CUPTI down)
/// leaves the library a CUPTI to attach afresh, whose first enable takes
/// time (100 ms on the stand-in): the span the trace says the other user
/// had ends when recording resumed, so every launch of ours whose kernel
/// is missing lies in a span the trace names.
#[tokio::test(flavor = "multi_thread")]
async fn a_profiler_finalizing_cupti_loses_only_spans_the_trace_names() {
    // 30 ms apart, so that launches fall in the first enable after the
    // finalize; no waiting for recording to resume.
    let args = [
        "10",
        "--sleep-ms",
        "30",
        "--rival-at",
        "3",
        "--rival-iterations",
        "2",
        "--rival-linked",
        "--rival-finalize",
    ];
    let (space, lines) = capture_a_rival("cuda_rival_finalize_span", &args).await;
    assert_every_missing_kernel_in_a_named_span(&space, &lines);
}

/// Every launch of the workload inside the window whose kernel is missing
/// (the other profiler's own aside) lies in a span the trace names.
fn assert_every_missing_kernel_in_a_named_span(space: &XSpace, lines: &[String]) {
    let (start, stop) = common::window_of(space);
    let spans = named_spans(space);
    let kernels: Vec<u64> = program_kernels(space).iter().map(|(_, at)| *at).collect();
    let (_, rival_start, rival_end) = rival_report(lines);
    // A millisecond for the spans' rounding.
    let named = |s: f64| {
        spans
            .iter()
            .any(|(from, to)| (from - 1e-3..=to + 1e-3).contains(&s))
    };
    let unnamed: Vec<f64> = launches_in(lines, start, stop)
        .into_iter()
        .filter(|at| !(rival_start..=rival_end).contains(at))
        .filter(|at| !kernels.iter().any(|k| k.abs_diff(*at) < 2_000_000))
        .map(|at| (at as f64 - start as f64) / 1e9)
        .filter(|s| !named(*s))
        .collect();
    assert!(
        unnamed.is_empty(),
        "launches at {unnamed:?} s lack their kernels outside every span the trace names \
         ({spans:?}): {:?}",
        space.warnings
    );
}

/// The spans of a window the trace's warnings name, in seconds into it.
fn named_spans(space: &XSpace) -> Vec<(f64, f64)> {
    space
        .warnings
        .iter()
        .filter(|w| w.contains(" s of this window"))
        .filter_map(|w| span_of(w))
        .collect()
}

/// When the workload's launch calls from `from_ns` to `to_ns` began, as it
/// printed them.
fn launches_in(lines: &[String], from_ns: u64, to_ns: u64) -> Vec<u64> {
    lines
        .iter()
        .filter_map(|l| parse_call(l))
        .filter(|c| {
            ["cuLaunchKernel", "cuLaunchKernelEx", "cuGraphLaunch"].contains(&c.name.as_str())
        })
        .map(|c| c.realtime.0)
        .filter(|at| (from_ns..=to_ns).contains(at))
        .collect()
}

/// A profiler that reached CUPTI without passing through the library (it
/// looked CUPTI's functions up before the library loaded) and takes the
/// activity stream mid-capture gets the library's buffers, and its disable
/// at its end switches the library's kinds off for the rest of the
/// capture: the library cannot see it, but its launch calls, still timed,
/// are evidence that their kernels never came back, and the trace names
/// the span from the first of them on.
#[tokio::test(flavor = "multi_thread")]
async fn kernels_lost_to_a_profiler_the_library_cannot_see_are_named_from_their_first_launch() {
    let args = [
        "60",
        "--sleep-ms",
        "50",
        "--rival-at",
        "20",
        "--rival-iterations",
        "2",
        "--rival-direct",
        "--rival-early",
    ];
    let (space, lines) = capture_a_rival("cuda_rival_unseen_span", &args).await;
    let told = common::warnings_with(&space, "no kernel record of its last");
    assert_eq!(told.len(), 1, "{:?}", space.warnings);
    let (from, _) = span_of(told[0]).expect("a span");
    let (start, stop) = common::window_of(&space);
    // Named from the first launch whose kernel is missing on.
    let kernels: Vec<u64> = program_kernels(&space).iter().map(|(_, at)| *at).collect();
    let first_missing = launches_in(&lines, start, stop)
        .into_iter()
        .find(|at| !kernels.iter().any(|k| k.abs_diff(*at) < 2_000_000))
        .expect("kernels are missing");
    let first_missing = (first_missing - start) as f64 / 1e9;
    // The workload's stamp and the library's, the warning's rounded to
    // the millisecond.
    assert!(
        (from - first_missing).abs() < 0.005,
        "{from} against {first_missing}: {told:?}"
    );
    // Every launch from there on counted, and at most those of the
    // capture's last moments after the window (the library stops 20 ms
    // after it on an idle machine).
    let launched_from =
        |to_ns: u64| launches_in(&lines, start + (from * 1e9) as u64, to_ns).len() as u64;
    let counted = launches_counted(told[0]);
    assert!(
        (launched_from(stop)..=launched_from(stop + 2_000_000_000)).contains(&counted),
        "{counted} launches counted, {} made in the span: {told:?}",
        launched_from(stop)
    );
    assert_every_missing_kernel_in_a_named_span(&space, &lines);
}

/// Such a profiler already running as a capture starts loses the stream
/// to it (the library registers its callbacks for each capture), and
/// switches the kernels off as it ends, leaving the copies on: the copies'
/// records that go on coming back do not hide the kernels missing.
#[tokio::test(flavor = "multi_thread")]
async fn kernels_switched_off_by_a_profiler_the_library_cannot_see_are_named_beside_copies() {
    let mut setup = setup("cuda_rival_unseen_before");
    setup.program = rival_linked_program();
    let agent = setup.agent();
    let release = release_file(&setup, "before");
    let args = [
        "100",
        "--wait-file",
        release.to_str().unwrap(),
        "--sleep-ms",
        "50",
        "--rival-at",
        "0",
        "--rival-iterations",
        "60",
        "--rival-direct",
        "--rival-early",
    ];
    let workload = setup.workload(&args, &[("DEVTRACE_STANDIN_CUPTI_VERSION", "130001")]);
    workload.read_until("waiting");
    wait_for_attached(&agent, 1).await;
    std::fs::write(&release, b"go").expect("releasing the workload");
    // The profiler's part runs from the release for 3 s: the capture
    // starts inside it, however late a loaded machine starts it, and ends
    // more than a second after it.
    tokio::time::sleep(std::time::Duration::from_millis(800)).await;
    let space = capture(&agent, 4000).await;
    let lines = workload.read_until("done");
    let (start, stop) = common::window_of(&space);
    let copies = timed(&space, "/device:GPU:0")
        .into_iter()
        .filter(|(e, at)| e.name.starts_with("Memcpy") && *at > start + 3_000_000_000)
        .count();
    assert!(
        copies > 0,
        "copies recorded to the end: {:?}",
        space.warnings
    );
    let kernels: Vec<u64> = program_kernels(&space).iter().map(|(_, at)| *at).collect();
    let missing = launches_in(&lines, start, stop)
        .into_iter()
        .filter(|at| !kernels.iter().any(|k| k.abs_diff(*at) < 2_000_000))
        .count();
    assert!(missing > 20, "{missing} launches without their kernel");
    let told = common::warnings_with(&space, "no kernel record of its last");
    assert_eq!(told.len(), 1, "{:?}", space.warnings);
    assert_every_missing_kernel_in_a_named_span(&space, &lines);
}

/// Kernels still running as a capture ends leave their records in the
/// job's thread's buffer, which CUDA 13's CUPTI hands back only as it is
/// detached: the launches are checked once it is back, and none is said to
/// have lost its kernel.
#[tokio::test(flavor = "multi_thread")]
async fn kernels_still_running_as_a_capture_ends_are_not_taken_for_lost() {
    let setup = setup("cuda_unanswered_running");
    let agent = setup.agent();
    let release = release_file(&setup, "running");
    let workload = setup.workload(
        &[
            "10",
            "--wait-file",
            release.to_str().unwrap(),
            "--sleep-ms",
            "250",
        ],
        &[
            ("DEVTRACE_STANDIN_CUPTI_VERSION", "130001"),
            // Each kernel runs 400 ms: the GPU falls behind the launches.
            ("DEVTRACE_STANDIN_GPU_KERNEL_NS", "400000000"),
        ],
    );
    workload.read_until("waiting");
    wait_for_attached(&agent, 1).await;
    let space = capture_while(&agent, 2500, &release).await;
    let lines = workload.read_until("done");
    let (start, stop) = common::window_of(&space);
    assert!(
        launches_in(&lines, start, stop.saturating_sub(1_000_000_000)).len() >= 6,
        "launches a second before the window's end"
    );
    assert_no_launch_unanswered(&space);
}

/// One iteration whose kernel runs `kernel_ms` on the GPU, launched about
/// 60 ms before a 1.5 s capture's end; returns the trace and the kernel's
/// launch call.
async fn capture_a_kernel_across_the_end(
    name: &str,
    kernel_ms: u64,
    cupti_version: &str,
) -> (XSpace, Call) {
    let setup = setup(name);
    let agent = setup.agent();
    let release = release_file(&setup, "across");
    let kernel_ns = (kernel_ms * 1_000_000).to_string();
    let workload = setup.workload(
        &[
            "1",
            "--wait-file",
            release.to_str().unwrap(),
            "--sleep-ms",
            "3000",
        ],
        &[
            ("DEVTRACE_STANDIN_CUPTI_VERSION", cupti_version),
            ("DEVTRACE_STANDIN_GPU_KERNEL_NS", &kernel_ns),
        ],
    );
    workload.read_until("waiting");
    wait_for_attached(&agent, 1).await;
    let space = capture_releasing_after(&agent, 1500, &release, 1440).await;
    let calls = calls_until_done(&workload);
    let launch = calls
        .iter()
        .find(|c| c.name == "cuLaunchKernel")
        .expect("the kernel's launch")
        .clone();
    let (start, stop) = common::window_of(&space);
    assert!(
        launch.realtime.0 > start && launch.realtime.0 < stop,
        "the launch at {} in the window {start}..{stop} (the release came late)",
        launch.realtime.0
    );
    (space, launch)
}

/// A kernel still running as a capture's window ends is in its trace:
/// CUPTI hands back the record of work still running only when its
/// buffers are forced back, and then without its end, never completed; the
/// library lets the work launched in the window end first. (It used to
/// force them at once: the kernel was lost, unsaid.)
#[tokio::test(flavor = "multi_thread")]
async fn a_kernel_still_running_as_a_capture_ends_is_in_its_trace() {
    for version in ["26", "130001"] {
        let name = format!("cuda_running_at_end_{version}");
        // Its second kernel ends 140 ms after the window: the wait ends
        // then, with both kernels back.
        let (space, launch) = capture_a_kernel_across_the_end(&name, 100, version).await;
        let kernels = program_kernels(&space);
        assert_eq!(kernels.len(), 1, "CUPTI {version}: {:?}", space.warnings);
        let (kernel, start_ns) = &kernels[0];
        assert!(
            start_ns.abs_diff(launch.realtime.0) < 5_000_000
                && kernel.duration_ps == 100_000_000_000,
            "CUPTI {version}: the kernel at {start_ns} for {} ps, launched at {}",
            kernel.duration_ps,
            launch.realtime.0
        );
        let unfinished = common::warnings_with(&space, "unfinished");
        assert!(unfinished.is_empty(), "CUPTI {version}: {unfinished:?}");
    }
}

/// Work still running long after a capture's end (longer than the library
/// waits for it) comes back from CUPTI unfinished: the trace says how much,
/// and from when.
#[tokio::test(flavor = "multi_thread")]
async fn work_still_running_long_after_a_capture_ends_is_told_unfinished() {
    let (space, launch) = capture_a_kernel_across_the_end("cuda_running_long", 3000, "26").await;
    assert!(program_kernels(&space).is_empty(), "{:?}", space.warnings);
    let told = common::warnings_with(&space, "unfinished, without their end");
    assert_eq!(told.len(), 1, "{:?}", space.warnings);
    // The iteration's two kernels (the second had not started) and the
    // copy after them on their stream.
    assert!(
        told[0].contains("2 kernels and 1 copy or memset"),
        "{}",
        told[0]
    );
    let (start, _) = common::window_of(&space);
    let said = told[0]
        .split("running from ")
        .nth(1)
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|seconds| seconds.parse::<f64>().ok())
        .unwrap_or_else(|| panic!("no start in {}", told[0]));
    let launched = (launch.realtime.0 - start) as f64 / 1e9;
    assert!(
        (said - launched).abs() < 0.005,
        "{said} s, launched at {launched} s"
    );
}

/// A workload of `iterations` whose GPU never idles, let go once its
/// kernels are recorded: two kernels of 40 ms launched every 45 ms or so,
/// however late a loaded machine runs the loop (the GPU falls behind the
/// launches by 35 ms an iteration).
async fn busy_gpu_workload(setup: &Setup, agent: &AgentProcess, iterations: &str) -> CudaWorkload {
    let release = release_file(setup, "busy");
    let workload = setup.workload(
        &recorded_run(iterations, &release)
            .into_iter()
            .chain(["--sleep-ms", "45", "--quiet"])
            .collect::<Vec<_>>(),
        &[("DEVTRACE_STANDIN_GPU_KERNEL_NS", "40000000")],
    );
    workload.read_until("waiting");
    wait_for_attached(agent, 1).await;
    std::fs::write(&release, b"go").expect("releasing the workload");
    workload
}

/// Under `--cuda-record always` a look-back capture of a busy GPU holds
/// its kernels up to the window's end: the buffer CUPTI is filling always
/// holds a kernel still running, so a flush that is not forced never
/// hands it back, and the library is asked for it as the capture ends.
/// (It was not: the look-back held none of the window's kernels.)
#[tokio::test(flavor = "multi_thread")]
async fn under_cuda_record_always_a_look_back_at_a_busy_gpu_holds_its_last_kernels() {
    let setup = setup("cuda_past_busy");
    let agent = setup.agent_with(&["--cuda-record", "always"]);
    let workload = busy_gpu_workload(&setup, &agent, "60").await;
    tokio::time::sleep(std::time::Duration::from_millis(1500)).await;
    let to = common::now_ns() - 300_000_000;
    let from = to - 800_000_000;
    let space = look_back(&agent, from, to).await;
    let mut starts: Vec<u64> = program_kernels(&space)
        .into_iter()
        .map(|(_, start)| start)
        .filter(|start| (from..to).contains(start))
        .collect();
    starts.sort_unstable();
    // 800 ms of 40 ms kernels back to back (and the copies between).
    assert!(
        starts.len() >= 18,
        "{} kernels: {:?}",
        starts.len(),
        space.warnings
    );
    let last = *starts.last().unwrap();
    assert!(
        to - last <= 45_000_000,
        "the last kernel {} ms before the end",
        (to - last) / 1_000_000
    );
    let gaps = starts.windows(2).map(|w| w[1] - w[0]).max().unwrap_or(0);
    assert!(
        gaps <= 45_000_000,
        "a gap of {} ms between kernels",
        gaps / 1_000_000
    );
    workload.read_until("done");
}

/// The same for a trigger's save, which starts no capture in the
/// workloads: the agent asks them for what their CUPTI holds before it
/// reads the past. The saved window holds the busy GPU's kernels up to its
/// end.
#[tokio::test(flavor = "multi_thread")]
async fn a_triggers_saved_session_of_a_busy_gpu_holds_its_kernels_to_the_windows_end() {
    let setup = setup("cuda_busy_before_step");
    let logdir = tempfile::tempdir().unwrap();
    let repository = logdir.path().join("plugins/profile");
    // Late enough for the workload to be busy on a loaded machine.
    let agent = slow_step_agent(&setup, logdir.path(), "6s", "1s");
    let workload = busy_gpu_workload(&setup, &agent, "400").await;
    let found = crate::triggers::wait_for_sessions(&repository, 1);
    let space = XSpace::decode(&std::fs::read(&found[0].1).unwrap()[..]).unwrap();
    let (start, stop) = common::window_of(&space);
    let mut starts: Vec<u64> = program_kernels(&space)
        .into_iter()
        .map(|(_, at)| at)
        .filter(|at| (start..stop).contains(at))
        .collect();
    starts.sort_unstable();
    let last = starts.last().copied().unwrap_or(start);
    assert!(
        stop - last <= 45_000_000,
        "the last of {} kernels {} ms before the window's end",
        starts.len(),
        (stop - last) / 1_000_000
    );
    drop(workload);
}

/// Launches recorded into a CUDA graph by stream capture run no kernel: a
/// job that captures a graph and then idles is not said to have lost them.
#[tokio::test(flavor = "multi_thread")]
async fn launches_captured_into_a_graph_are_not_taken_for_lost() {
    let (space, ending) = capture_a_job_ending_with("--capture-graph-last").await;
    assert!(
        ending
            .iter()
            .filter(|c| c.name.starts_with("cuLaunchKernel"))
            .all(|c| c.fields.contains_key("captured")),
        "{ending:?}"
    );
    assert_no_launch_unanswered(&space);
}

/// A launch the driver refused ran nothing: a job whose last launch failed
/// and that then idles is not said to have lost its kernel.
#[tokio::test(flavor = "multi_thread")]
async fn a_launch_that_failed_is_not_taken_for_lost() {
    let (space, ending) = capture_a_job_ending_with("--bad-launch-last").await;
    assert!(
        ending.len() == 1 && ending[0].fields.get("rc").is_some_and(|rc| rc != "0"),
        "{ending:?}"
    );
    assert_no_launch_unanswered(&space);
}

/// Captures 4 s of a job that runs one iteration, sleeps 2 s, ends with
/// the launches `ending` (a workload option) makes, then sleeps 2 s more:
/// the trace, and the calls of that ending (those after the iteration's
/// last call), which must come more than a second before the window's end.
async fn capture_a_job_ending_with(ending: &str) -> (XSpace, Vec<Call>) {
    let setup = setup(&format!("cuda_ending{}", ending.replace('-', "_")));
    let agent = setup.agent();
    let release = release_file(&setup, "ending");
    let workload = setup.workload(
        &[
            "1",
            "--wait-file",
            release.to_str().unwrap(),
            "--sleep-ms",
            "2000",
            ending,
        ],
        &[("DEVTRACE_STANDIN_CUPTI_VERSION", "130001")],
    );
    workload.read_until("waiting");
    wait_for_attached(&agent, 1).await;
    let space = capture_while(&agent, 4000, &release).await;
    let lines = workload.read_until("done");
    let (start, stop) = common::window_of(&space);
    let calls: Vec<Call> = lines.iter().filter_map(|l| parse_call(l)).collect();
    let iteration_ends = calls
        .iter()
        .rposition(|c| c.name == "cuStreamSynchronize")
        .expect("the iteration's synchronize");
    let ending: Vec<Call> = calls[iteration_ends + 1..]
        .iter()
        .filter(|c| c.name.starts_with("cuLaunch"))
        .cloned()
        .collect();
    assert!(
        !ending.is_empty()
            && ending
                .iter()
                .all(|c| c.realtime.0 > start && c.realtime.0 + 1_000_000_000 < stop),
        "the ending's launches a second before the window's end: {ending:?}"
    );
    (space, ending)
}

/// The launches a warning of unanswered launch calls counts.
fn launches_counted(warning: &str) -> u64 {
    warning
        .split("no kernel record of its last ")
        .nth(1)
        .and_then(|rest| rest.split(' ').next())
        .and_then(|n| n.parse().ok())
        .expect("a count of launch calls")
}

/// A framework library linked against another toolkit's libcupti
/// (`libcupti.so.13` beside the library's `.so.12`), loaded once CUDA is
/// up: built once, with that copy in a directory of its own that only the
/// framework's RUNPATH names.
fn framework_with_its_own_libcupti() -> PathBuf {
    let other = common::build_program(
        "cupti.c",
        "cupti_other_toolkit.so",
        &[
            "-shared",
            "-fPIC",
            "-Wl,-soname,libcupti.so.13",
            "-ldl",
            "-pthread",
        ],
    );
    let toolkit = other.with_file_name("other-toolkit");
    std::fs::create_dir_all(&toolkit).unwrap();
    let copy = toolkit.join("libcupti.so.13");
    if !copy.exists() {
        let partial = toolkit.join(format!("libcupti.so.13.{}", std::process::id()));
        std::fs::copy(&other, &partial).unwrap();
        std::fs::rename(&partial, &copy).unwrap();
    }
    let rpath = format!("-Wl,-rpath,{}", toolkit.display());
    common::build_program(
        "cupti_framework.c",
        "libother_toolkit_framework.so",
        &["-shared", "-fPIC", copy.to_str().unwrap(), &rpath],
    )
}

/// A framework bound to another copy of libcupti than the library's (two
/// CUDA toolkits in one process), loaded after the library loaded its own,
/// keeps calling its own copy: the library redirects only GOT slots that
/// hold the addresses of the libcupti it uses. So the framework is not
/// taken for a user of that CUPTI, nothing is stepped aside for, and every
/// kernel of the framework's iterations in a later capture is recorded.
/// (Redirected, its calls reached the library's libcupti, and the capture
/// lost its part to it.)
#[tokio::test(flavor = "multi_thread")]
async fn a_framework_bound_to_another_libcupti_copy_keeps_it() {
    let framework = framework_with_its_own_libcupti();
    let (space, lines) =
        capture_a_framework_rival("cuda_rival_other_copy", &framework, false).await;
    assert_no_other_cupti_user(&space);
    let (rival_kernels, rival_start, rival_end) = rival_report(&lines);
    // The driver serves the first copy to attach alone (the stand-in's
    // reading of two toolkits in one process).
    assert_eq!(rival_kernels, 0);
    let during_its_part = program_kernels(&space)
        .iter()
        .filter(|(_, at)| (rival_start..=rival_end).contains(at))
        .count();
    assert_eq!(during_its_part, 4, "{:?}", space.warnings);
}

/// A framework library bound to the libcupti in use is seen as a user of
/// it, whatever its file is called: one named like a libcupti
/// (`libcupti_wrapper.so`) has its GOT redirected too. (Objects were told
/// apart by name, and such a library was passed over: its profiler unseen.)
#[tokio::test(flavor = "multi_thread")]
async fn a_framework_named_like_libcupti_is_still_seen_through_its_got() {
    let libraries = cupti_standin();
    let rpath = format!("-Wl,-rpath,{}", libraries.display());
    let framework = common::build_program(
        "cupti_framework.c",
        "libcupti_wrapper.so",
        &[
            "-shared",
            "-fPIC",
            libraries.join("libcupti.so.12").to_str().unwrap(),
            &rpath,
        ],
    );
    // Loaded before CUDA is: bound to libcupti's own functions, which only
    // the walk of its GOT redirects (one loaded later finds the hooks in
    // libcupti's exports).
    let (space, lines) = capture_a_framework_rival("cuda_rival_named_like", &framework, true).await;
    let (_, rival_start, rival_end) = rival_report(&lines);
    let (start, _) = common::window_of(&space);
    let (from, to) = lost_span(&space);
    let seconds = |ns: u64| (ns - start) as f64 / 1e9;
    assert!(from <= seconds(rival_start) + 0.001 && to + 0.001 >= seconds(rival_end));
}

/// Runs a workload whose rival profiler calls CUPTI through `framework`
/// (loaded before cuInit when `early`, else as the rival first starts,
/// between two captures) for iterations 2-3 and 7-8, and captures the
/// second part: that capture's trace, and the workload's lines.
async fn capture_a_framework_rival(
    name: &str,
    framework: &std::path::Path,
    early: bool,
) -> (XSpace, Vec<String>) {
    let setup = setup(name);
    let agent = setup.agent();
    let release = release_file(&setup, "framework");
    // Its second part (iterations 7 and 8) runs 0.9 s after the first
    // ends.
    let mut args = vec![
        "10",
        "--wait-file",
        release.to_str().unwrap(),
        "--sleep-ms",
        "300",
        "--rival-at",
        "2",
        "--rival-iterations",
        "2",
        "--rival-every",
        "5",
    ];
    if early {
        args.push("--rival-early");
    }
    let workload = setup.workload(
        &args,
        &[(
            "DEVTRACE_STANDIN_RIVAL_FRAMEWORK",
            framework.to_str().unwrap(),
        )],
    );
    workload.read_until("waiting");
    let pid = workload.workload.pid;
    wait_for_attached(&agent, 1).await;
    // The library loads its libcupti (the process has none yet).
    let first = capture(&agent, 300).await;
    assert!(cupti_of(&first, pid).contains("libcupti.so.12"));
    std::fs::write(&release, b"go").unwrap();
    workload.read_until("rival:");
    // The framework is loaded now: this capture looks at its GOT.
    let space = capture(&agent, 3000).await;
    let mut lines = workload.read_until("rival:");
    lines.extend(workload.read_until("done"));
    (space, lines)
}

/// The libcupti a process of this test loaded, as the trace names it.
fn cupti_of(space: &XSpace, pid: u32) -> String {
    let env = common::plane(space, "Task Environment");
    match find_stat(env, &env.stats, &format!("devtrace_cuda_cupti_{pid}")) {
        Some(StatValue::Str(text)) => text,
        other => panic!("no libcupti recorded for {pid}: {other:?}"),
    }
}

/// The real libcupti of CUDA 12.8 and 13.0 (pip wheels, which work without a
/// GPU as far as `cuptiGetVersion`): found where pip installs it, beside a
/// CUDA library the process maps, and its version accepted. Enabling
/// activity then fails (no real driver here): one message, a warning in the
/// trace, and the workload's calls unaffected.
#[tokio::test(flavor = "multi_thread")]
async fn the_real_libcupti_12_and_13_are_found_in_pip_layouts_and_accepted() {
    for (requirement, package, soname, version) in [
        (
            "nvidia-cuda-cupti-cu12==12.8.90",
            "cuda_cupti",
            "libcupti.so.12",
            26,
        ),
        (
            "nvidia-cuda-cupti==13.0.85",
            "cu13",
            "libcupti.so.13",
            130001,
        ),
    ] {
        let wheel = real_cupti_wheel(requirement);
        let setup = setup("cuda_real_cupti");
        // site-packages/nvidia/<package>/lib holds the real libcupti, and
        // site-packages/nvidia/cuda_runtime/lib the driver the process maps
        // (only that one is on the loader's path).
        let nvidia = setup.runtime.path().join("site-packages/nvidia");
        let cupti_dir = nvidia.join(package).join("lib");
        let driver_dir = nvidia.join("cuda_runtime/lib");
        std::fs::create_dir_all(&cupti_dir).unwrap();
        std::fs::create_dir_all(&driver_dir).unwrap();
        let real = wheel.join(package).join("lib").join(soname);
        std::os::unix::fs::symlink(&real, cupti_dir.join(soname)).unwrap();
        for name in ["libcuda.so.1", "libcuda.so"] {
            std::fs::copy(setup.libraries.join("libcuda.so.1"), driver_dir.join(name)).unwrap();
        }
        let agent = setup.agent();
        let release = release_file(&setup, "real");
        let mut workload = CudaWorkload::start(
            &setup.program,
            &["2", "--wait-file", release.to_str().unwrap()],
            &[
                ("LD_LIBRARY_PATH", driver_dir.to_str().unwrap()),
                ("CUDA_INJECTION64_PATH", setup.inject.to_str().unwrap()),
                (
                    "DEVTRACE_RUNTIME_DIR",
                    setup.runtime.path().to_str().unwrap(),
                ),
            ],
        );
        workload.read_until("waiting");
        let pid = workload.workload.pid;
        wait_for_attached(&agent, 1).await;
        let space = capture_while(&agent, 1500, &release).await;
        let calls = calls_until_done(&workload);
        assert!(workload.workload.child.wait().unwrap().success());
        assert!(calls.iter().all(|c| c.fields["rc"] == "0"), "{calls:?}");
        assert_eq!(
            cupti_of(&space, pid),
            format!(
                "API version {version} from {}",
                cupti_dir.join(soname).display()
            )
        );
        // The stand-in driver is no driver CUPTI can work with.
        let stderr = stderr_of(&mut workload);
        let lines: Vec<&str> = stderr.lines().collect();
        assert_eq!(lines.len(), 1, "{stderr}");
        assert!(lines[0].starts_with("devtrace-inject: cupti"), "{stderr}");
        assert!(
            space
                .warnings
                .iter()
                .any(|w| w.contains("stopped tracing: cupti")),
            "{:?}",
            space.warnings
        );
    }
}

/// A libcupti the process already has is used, never a second copy.
#[tokio::test(flavor = "multi_thread")]
async fn a_libcupti_the_process_already_loaded_is_reused() {
    let setup = setup("cuda_cupti_loaded");
    let elsewhere = setup.runtime.path().join("other-cupti");
    std::fs::create_dir_all(&elsewhere).unwrap();
    std::fs::copy(
        setup.libraries.join("libcupti.so.12"),
        elsewhere.join("libcupti.so.12"),
    )
    .unwrap();
    let agent = setup.agent();
    let release = release_file(&setup, "loaded");
    let preloaded = setup.libraries.join("libcupti.so.12");
    let workload = setup.workload(
        &recorded_run("2", &release),
        &[
            ("LD_PRELOAD", preloaded.to_str().unwrap()),
            ("DEVTRACE_CUPTI_PATH", elsewhere.to_str().unwrap()),
        ],
    );
    workload.read_until("waiting");
    let pid = workload.workload.pid;
    wait_for_attached(&agent, 1).await;
    let space = capture_while(&agent, 1500, &release).await;
    calls_until_done(&workload);
    assert_eq!(
        cupti_of(&space, pid),
        "API version 26 from libcupti.so.12 (already loaded)"
    );
    let kernels = program_kernels(&space).len();
    assert_eq!(kernels, 4);
}

/// `DEVTRACE_CUPTI_PATH` names the library when nothing is loaded yet.
#[tokio::test(flavor = "multi_thread")]
async fn devtrace_cupti_path_names_the_library_to_load() {
    let setup = setup("cuda_cupti_path");
    let chosen = setup.runtime.path().join("chosen");
    std::fs::create_dir_all(&chosen).unwrap();
    std::fs::copy(
        setup.libraries.join("libcupti.so.12"),
        chosen.join("libcupti.so.12"),
    )
    .unwrap();
    let agent = setup.agent();
    let release = release_file(&setup, "path");
    // The loader's path holds only the driver: nothing else would find it.
    let driver_only = setup.runtime.path().join("driver");
    std::fs::create_dir_all(&driver_only).unwrap();
    std::fs::copy(
        setup.libraries.join("libcuda.so.1"),
        driver_only.join("libcuda.so.1"),
    )
    .unwrap();
    let workload = CudaWorkload::start(
        &setup.program,
        &recorded_run("2", &release),
        &[
            ("LD_LIBRARY_PATH", driver_only.to_str().unwrap()),
            ("CUDA_INJECTION64_PATH", setup.inject.to_str().unwrap()),
            (
                "DEVTRACE_RUNTIME_DIR",
                setup.runtime.path().to_str().unwrap(),
            ),
            ("DEVTRACE_CUPTI_PATH", chosen.to_str().unwrap()),
        ],
    );
    workload.read_until("waiting");
    let pid = workload.workload.pid;
    wait_for_attached(&agent, 1).await;
    let space = capture_while(&agent, 2000, &release).await;
    calls_until_done(&workload);
    assert_eq!(
        cupti_of(&space, pid),
        format!(
            "API version 26 from {}",
            chosen.join("libcupti.so.12").display()
        )
    );
    assert_eq!(
        timed(&space, "/device:GPU:0")
            .iter()
            .filter(|(e, _)| e.name == "vector_add")
            .count(),
        2,
        "{:?}",
        space.warnings
    );
}

/// Any user can write the runtime directory. A FIFO or a symlink where a
/// ring's metadata belongs neither stalls the agent (a blocking open of a
/// FIFO never returned) nor makes it read another file; it names the file it
/// ignored, and a real workload beside them is traced as usual.
#[tokio::test(flavor = "multi_thread")]
async fn a_fifo_or_symlink_as_metadata_neither_stalls_nor_redirects_the_agent() {
    let setup = setup("cuda_hostile_meta");
    let dir = setup.runtime.path();
    // SAFETY: geteuid has no preconditions.
    let me = unsafe { libc::geteuid() };
    // Rings of live processes, with their metadata planted before them.
    let fifo_ring = PlantedRing::staged(dir, me, None);
    let link_ring = PlantedRing::staged(dir, me, None);
    let (fifo_meta, link_meta) = (fifo_ring.files.meta.clone(), link_ring.files.meta.clone());
    let fifo = std::ffi::CString::new(fifo_meta.to_str().unwrap()).unwrap();
    // SAFETY: a valid path; nobody ever writes the FIFO.
    assert_eq!(unsafe { libc::mkfifo(fifo.as_ptr(), 0o600) }, 0);
    let secret = dir.join("secret");
    std::fs::write(&secret, "name 1 stolen\n").unwrap();
    std::os::unix::fs::symlink(&secret, &link_meta).unwrap();
    let _rings = [fifo_ring.placed(), link_ring.placed()];
    let agent = setup.agent();
    let release = release_file(&setup, "hostile");
    let workload = setup.workload(&recorded_run("2", &release), &[]);
    workload.read_until("waiting");
    wait_for_attached(&agent, 3).await;
    let space = capture_while(&agent, 1500, &release).await;
    calls_until_done(&workload);
    let kernels = program_kernels(&space).len();
    assert_eq!(kernels, 4, "{:?}", space.warnings);
    let ignored = |meta: &std::path::Path, why: &str| {
        space
            .warnings
            .iter()
            .any(|w| w.contains(&format!("ignoring {}", meta.display())) && w.contains(why))
    };
    assert!(
        ignored(&fifo_meta, "not a regular file"),
        "{:?}",
        space.warnings
    );
    // O_NOFOLLOW: the symlink itself is refused (ELOOP).
    assert!(
        ignored(&link_meta, "symbolic links"),
        "{:?}",
        space.warnings
    );
    assert!(!space.warnings.iter().any(|w| w.contains("stolen")));
}

/// The seconds of a window a warning containing `marker` names, as
/// "from A s to B s".
fn span_in_warning(space: &XSpace, marker: &str) -> Option<(f64, f64)> {
    span_of(space.warnings.iter().find(|w| w.contains(marker))?)
}

/// The seconds of a window a warning names as "from A s to B s".
fn span_of(warning: &str) -> Option<(f64, f64)> {
    let numbers: Vec<f64> = warning
        .split(" from ")
        .nth(1)?
        .split_whitespace()
        .filter_map(|w| w.parse().ok())
        .collect();
    Some((*numbers.first()?, *numbers.get(1)?))
}

/// The workload's last words on CUPTI: whether it is armed and how often it
/// was finalized.
/// What a workload wrote on stderr, read once it has exited.
fn stderr_to_end(mut workload: CudaWorkload) -> String {
    let mut stderr = String::new();
    if let Some(mut pipe) = workload.workload.child.stderr.take() {
        std::io::Read::read_to_string(&mut pipe, &mut stderr).expect("reading its stderr");
    }
    stderr
}

fn cupti_state(lines: &[String]) -> (u64, u64) {
    let field = line_fields(lines, "cupti ");
    (field("armed="), field("finalized="))
}

/// After every capture CUPTI is finalized (the stand-in, like the real
/// library, keeps charging every CUDA call until then), on CUDA 13's
/// per-thread buffers, which a forced flush hands back late for other
/// threads: no other CUPTI user is reported where there is none, and each
/// of three back-to-back captures holds the kernel of every launch made
/// after the library said it was recording.
#[tokio::test(flavor = "multi_thread")]
async fn each_capture_detaches_cupti_and_reports_no_phantom_user() {
    let setup = setup("cuda_teardown");
    let agent = setup.agent();
    let release = release_file(&setup, "teardown");
    let workload = setup.workload(
        &[
            "480",
            "--threads",
            "2",
            "--wait-file",
            release.to_str().unwrap(),
            "--sleep-ms",
            "25",
        ],
        &[
            ("DEVTRACE_STANDIN_CUPTI_VERSION", "130001"),
            ("DEVTRACE_INJECT_DEBUG", "1"),
        ],
    );
    workload.read_until("waiting");
    wait_for_attached(&agent, 1).await;
    std::fs::write(&release, b"go").unwrap();
    let mut spaces = Vec::new();
    for _ in 0..3 {
        spaces.push(capture(&agent, 600).await);
        // Long enough for the agent to clear the flag and for the library
        // to detach (up to 500 ms for CUDA 13's late buffers, then the next
        // API call); a capture starting sooner keeps CUPTI attached.
        tokio::time::sleep(std::time::Duration::from_millis(1500)).await;
    }
    let lines = workload.read_until("done");
    let launches: Vec<Call> = lines
        .iter()
        .filter_map(|l| parse_call(l))
        .filter(|c| c.name.starts_with("cuLaunchKernel"))
        .collect();
    for space in &spaces {
        assert_no_other_cupti_user(space);
        let (start, stop) = common::window_of(space);
        let (_, began) = span_in_warning(space, "started recording")
            .unwrap_or_else(|| panic!("no recording start in {:?}", space.warnings));
        // The stand-in's first enable takes 100 ms.
        assert!(began >= 0.1, "recording began at {began} s");
        let from = start + (began * 1e9) as u64;
        // Every launch of the recorded part, to the window's end, with its
        // kernel: the library hands over the window's last records as the
        // capture ends, before the trace is built.
        let settled = 5_000_000;
        let expected = launches
            .iter()
            .filter(|c| c.realtime.0 > from + 5_000_000 && c.realtime.1 + settled < stop)
            .count();
        let kernels = program_kernels(space)
            .into_iter()
            .filter(|(_, at)| *at > from + 5_000_000 && *at + settled < stop)
            .count();
        assert!(
            expected > 5,
            "{expected} launches in the window {start}..{stop}, recording from {began} s; \
             launches {:?}..{:?}; {:?}",
            launches.first().map(|c| c.realtime),
            launches.last().map(|c| c.realtime),
            space.warnings
        );
        let last_kernel = program_kernels(space).into_iter().map(|(_, at)| at).max();
        assert_eq!(
            kernels,
            expected,
            "the last kernel of the window at {:?} ns before its end; {:?}",
            last_kernel.map(|at| stop.saturating_sub(at)),
            space.warnings
        );
    }
    let (armed, finalized) = cupti_state(&lines);
    assert_eq!((armed, finalized), (0, 3), "one detach per capture");
    // DEVTRACE_INJECT_DEBUG: the library said on stderr when it detached.
    let stderr = stderr_to_end(workload);
    let said = stderr.matches("devtrace-inject: CUPTI detached").count();
    assert_eq!(said, 3, "{stderr}");
}

/// The agent wakes a library waiting on its ring's control word as a
/// capture starts and ends, rather than leaving it to its next look: with
/// the library looking every 10 s, a 2 s capture still records the job's
/// kernels (none without the wake).
#[tokio::test(flavor = "multi_thread")]
async fn a_library_is_woken_as_a_capture_starts_and_ends() {
    let setup = setup("cuda_woken");
    let agent = setup.agent();
    let release = release_file(&setup, "woken");
    let workload = setup.workload(
        &recorded_run("2", &release),
        &[("DEVTRACE_INJECT_POLL_MS", "10000")],
    );
    workload.read_until("waiting");
    wait_for_attached(&agent, 1).await;
    let space = capture_while(&agent, 2000, &release).await;
    assert_eq!(program_kernels(&space).len(), 4, "{:?}", space.warnings);
    let starts = common::warnings_with(&space, "CUPTI started recording");
    assert_eq!(starts.len(), 1, "{:?}", space.warnings);
    calls_until_done(&workload);
}

/// A capture that ends before CUPTI starts recording in a process (here
/// CUPTI's first enable takes 3 s, longer than the 1 s window) says so,
/// from when the library was asked to the window's end, instead of
/// leaving the process's missing kernels unexplained.
#[tokio::test(flavor = "multi_thread")]
async fn a_capture_that_ends_before_cupti_starts_recording_says_so() {
    let setup = setup("cuda_never_started");
    let agent = setup.agent();
    let release = release_file(&setup, "never");
    let workload = setup.workload(
        &["2", "--wait-file", release.to_str().unwrap()],
        &[("DEVTRACE_STANDIN_CUPTI_FIRST_ENABLE_MS", "3000")],
    );
    workload.read_until("waiting");
    let pid = workload.workload.pid;
    wait_for_attached(&agent, 1).await;
    let space = capture_while(&agent, 1000, &release).await;
    assert!(program_kernels(&space).is_empty());
    let told: Vec<&String> = space
        .warnings
        .iter()
        .filter(|w| {
            w.contains(&format!("process {pid} "))
                && w.contains("CUPTI had not started recording when the capture ended, from ")
        })
        .collect();
    assert_eq!(told.len(), 1, "{:?}", space.warnings);
    // The job is unharmed: it ends once CUPTI is done starting (and
    // stopping again).
    let calls = calls_until_done(&workload);
    assert!(calls.iter().all(|c| c.fields["rc"] == "0"), "{calls:?}");
}

/// A job that makes no CUDA call after a capture's window still gets the
/// window's last kernels into the trace: on CUDA 13 a job thread's partly
/// filled buffer comes back only as CUPTI is detached, and the library
/// detaches it from a driver call of its own rather than waiting for the
/// job's next one (here 3 s later, long after the trace was built). The
/// kernels run long, so that no flush during the window hands them back.
#[tokio::test(flavor = "multi_thread")]
async fn a_job_idle_after_a_window_still_hands_over_its_last_kernels() {
    let setup = setup("cuda_idle_after");
    let agent = setup.agent();
    let release = release_file(&setup, "idle");
    let workload = setup.workload(
        &[
            "2",
            "--wait-file",
            release.to_str().unwrap(),
            "--sleep-ms",
            "3000",
        ],
        &[
            ("DEVTRACE_STANDIN_CUPTI_VERSION", "130001"),
            ("DEVTRACE_STANDIN_GPU_KERNEL_NS", "150000000"),
            ("DEVTRACE_INJECT_DEBUG", "1"),
        ],
    );
    workload.read_until("waiting");
    wait_for_attached(&agent, 1).await;
    let captured = capture(&agent, 1000);
    let go = async {
        tokio::time::sleep(std::time::Duration::from_millis(750)).await;
        std::fs::write(&release, b"go").expect("releasing the workload");
    };
    let (space, ()) = tokio::join!(captured, go);
    let lines = workload.read_until("done");
    let (_, stop) = common::window_of(&space);
    let launched: Vec<Call> = lines
        .iter()
        .filter_map(|l| parse_call(l))
        .filter(|c| c.name.starts_with("cuLaunchKernel") && c.realtime.1 + 5_000_000 < stop)
        .collect();
    assert_eq!(
        launched.len(),
        2,
        "the first iteration's launches: {lines:?}"
    );
    let kernels = program_kernels(&space);
    assert_eq!(
        kernels.len(),
        2,
        "the window's last kernels, launched {:?} ns before its end: {:?}",
        launched
            .iter()
            .map(|c| stop.saturating_sub(c.realtime.1))
            .collect::<Vec<_>>(),
        space.warnings
    );
    let (armed, finalized) = cupti_state(&lines);
    assert_eq!((armed, finalized), (0, 1), "detached once");
}

/// With a CUPTI that calls no subscriber at all while it is attached with
/// every kind off (a reading of the H200 run that could not be ruled out),
/// each capture still detaches: one kind stays on until the finalize.
#[tokio::test(flavor = "multi_thread")]
async fn each_capture_detaches_cupti_even_if_no_subscriber_is_called_with_every_kind_off() {
    let setup = setup("cuda_teardown_strict");
    let agent = setup.agent();
    let release = release_file(&setup, "strict");
    let workload = setup.workload(
        &[
            "200",
            "--wait-file",
            release.to_str().unwrap(),
            "--sleep-ms",
            "25",
        ],
        &[
            ("DEVTRACE_STANDIN_CUPTI_VERSION", "130001"),
            ("DEVTRACE_STANDIN_CUPTI_STRICT_SUBSCRIBERS", "1"),
            ("DEVTRACE_INJECT_DEBUG", "1"),
        ],
    );
    workload.read_until("waiting");
    wait_for_attached(&agent, 1).await;
    std::fs::write(&release, b"go").unwrap();
    for _ in 0..2 {
        capture(&agent, 500).await;
        tokio::time::sleep(std::time::Duration::from_millis(1200)).await;
    }
    let lines = workload.read_until("done");
    let (armed, finalized) = cupti_state(&lines);
    let stderr = stderr_to_end(workload);
    assert_eq!((armed, finalized), (0, 2), "{stderr}");
}

/// A capture that ends while another CUPTI user (linked against libcupti,
/// as Kineto is) profiles leaves CUPTI attached for it, whose kernels all
/// arrive; once it is done the library detaches.
#[tokio::test(flavor = "multi_thread")]
async fn cupti_is_not_detached_under_another_user_and_is_after_it() {
    let mut setup = setup("cuda_teardown_rival");
    setup.program = rival_linked_program();
    let agent = setup.agent();
    let release = release_file(&setup, "rival");
    let workload = setup.workload(
        &[
            "40",
            "--wait-file",
            release.to_str().unwrap(),
            "--sleep-ms",
            "50",
            "--rival-at",
            "6",
            "--rival-iterations",
            "20",
            "--rival-linked",
        ],
        &[],
    );
    workload.read_until("waiting");
    wait_for_attached(&agent, 1).await;
    // The capture ends during the rival's iterations 6 to 25.
    let space = capture_while(&agent, 800, &release).await;
    assert!(!program_kernels(&space).is_empty());
    let lines = workload.read_until("done");
    let (rival_kernels, _, _) = rival_report(&lines);
    assert_eq!(rival_kernels, 40, "the other profiler lost nothing");
    let (armed, finalized) = cupti_state(&lines);
    assert_eq!(
        (armed, finalized),
        (0, 1),
        "detached once the other user was done"
    );
}

/// An agent and the stand-in program linked against libcupti, released by
/// the returned file, whose rival (`--rival-linked` and `how`) runs from
/// iteration 4 for `rival_iterations` of the program's `iterations` (50 ms
/// apart), with the library's teardown said on stderr; once attached.
async fn rival_from_iteration_4(
    name: &str,
    iterations: &str,
    rival_iterations: &str,
    how: &str,
) -> (Setup, AgentProcess, PathBuf, CudaWorkload) {
    rival_from("4", name, iterations, rival_iterations, &[how]).await
}

/// As [`rival_from_iteration_4`], the rival from iteration `at`, with the
/// options `how`.
async fn rival_from(
    at: &str,
    name: &str,
    iterations: &str,
    rival_iterations: &str,
    how: &[&str],
) -> (Setup, AgentProcess, PathBuf, CudaWorkload) {
    let mut setup = setup(name);
    setup.program = rival_linked_program();
    let agent = setup.agent();
    let release = release_file(&setup, name);
    let mut args = vec![
        iterations,
        "--wait-file",
        release.to_str().unwrap(),
        "--sleep-ms",
        "50",
        "--rival-at",
        at,
        "--rival-iterations",
        rival_iterations,
        "--rival-linked",
    ];
    args.extend_from_slice(how);
    let workload = setup.workload(
        &args,
        &[
            ("DEVTRACE_STANDIN_CUPTI_VERSION", "130001"),
            ("DEVTRACE_INJECT_DEBUG", "1"),
        ],
    );
    workload.read_until("waiting");
    wait_for_attached(&agent, 1).await;
    (setup, agent, release, workload)
}

/// A workload that exits during a capture while another profiler holds the
/// activity stream: the library makes no CUPTI call at exit (a flush then
/// would hand buffers to that profiler's callbacks, whose state its own
/// exit handlers may have freed) and the trace says what that costs.
#[tokio::test(flavor = "multi_thread")]
async fn a_workload_exiting_beside_another_profiler_makes_no_cupti_call_at_exit() {
    let (_setup, agent, release, workload) = rival_from(
        "2",
        "cuda_exit_beside_rival",
        "6",
        "100",
        &["--rival-stays"],
    )
    .await;
    let pid = workload.workload.pid;
    let space = capture_while(&agent, 2000, &release).await;
    let lines = workload.read_until("done");
    assert!(
        !lines.iter().any(|l| l.starts_with("rival:")),
        "the other profiler was still running at exit: {lines:?}"
    );
    let told = space.warnings.iter().any(|w| {
        w.contains(&format!("process {pid} "))
            && w.contains("exited while CUPTI was attached beside another CUPTI user")
    });
    assert!(told, "{:?}", space.warnings);
}

/// A profiler seen subscribing during a capture (as XLA's tracer does)
/// gets the library's Callback API subscriber and holds it past the
/// capture's end. CUPTI then stays attached, also once that profiler is
/// done, saying why (subscribing after a capture would give a subscriber
/// CUPTI never calls), and the next capture, which subscribes again,
/// detaches it when it ends.
#[tokio::test(flavor = "multi_thread")]
async fn a_subscriber_given_to_another_profiler_is_taken_back_by_the_next_capture() {
    subscriber_given_and_taken_back("cuda_teardown_subscriber", "--rival-subscribe").await;
}

/// The same with a profiler that subscribes with `cuptiSubscribe_v2`, as
/// Kineto built for CUDA 13 does: it was not seen, so it was refused the
/// subscriber (and from CUDA 13.3, where both may be held, CUPTI would have
/// been finalized under it).
#[tokio::test(flavor = "multi_thread")]
async fn a_profiler_subscribing_with_the_v2_call_is_seen_too() {
    subscriber_given_and_taken_back("cuda_teardown_subscriber_v2", "--rival-subscribe-v2").await;
}

async fn subscriber_given_and_taken_back(name: &str, subscribe: &str) {
    let (_setup, agent, release, workload) =
        rival_from_iteration_4(name, "160", "30", subscribe).await;
    // The rival's iterations 4 to 33 begin inside this capture and end
    // after it.
    capture_while(&agent, 1200, &release).await;
    tokio::time::sleep(std::time::Duration::from_millis(2500)).await;
    capture(&agent, 600).await;
    let lines = workload.read_until("done");
    let (rival_kernels, _, _) = rival_report(&lines);
    assert!(
        rival_kernels > 0,
        "the other profiler got the subscriber: {lines:?}"
    );
    let (armed, finalized) = cupti_state(&lines);
    let stderr = stderr_to_end(workload);
    assert_eq!(
        (armed, finalized),
        (0, 1),
        "detached after the second capture only: {stderr}"
    );
    assert!(
        stderr.contains("CUPTI stays attached: the library's Callback API subscriber went to another CUPTI user"),
        "{stderr}"
    );
    assert_eq!(
        stderr.matches("devtrace-inject: CUPTI detached").count(),
        1,
        "{stderr}"
    );
}

/// A tool that takes the Callback API subscriber during a capture, and
/// nothing else, takes the one that timed the timeline's calls: CUPTI's API
/// records take over at the library's next look, every kernel keeps its
/// launch call but those launched in the short span the trace reports, and
/// the trace names both ways the calls were recorded.
#[tokio::test(flavor = "multi_thread")]
async fn a_subscriber_taken_mid_capture_hands_the_calls_to_cuptis_records() {
    let (_setup, agent, release, workload) = rival_from(
        "2",
        "cuda_subscriber_taken",
        "8",
        "3",
        &["--rival-callbacks-only", "--wait-recording"],
    )
    .await;
    let pid = workload.workload.pid;
    let space = capture_while(&agent, 2500, &release).await;
    let lines = workload.read_until("done");
    let (rival_kernels, rival_start, _) = rival_report(&lines);
    assert_eq!(rival_kernels, 0, "it records nothing itself");
    let kernels = kernel_launches(&space, pid);
    assert_eq!(
        kernels.len(),
        16,
        "two each iteration: {:?}",
        space.warnings
    );

    let (start, _) = common::window_of(&space);
    let seconds = |ns: u64| ns.saturating_sub(start) as f64 / 1e9;
    let (from, to) = span_in_warning(&space, "Callback API subscriber")
        .unwrap_or_else(|| panic!("no untimed span in {:?}", space.warnings));
    assert!(
        from + 0.001 >= seconds(rival_start) && from <= seconds(rival_start) + 0.1,
        "the span begins at {from} s, the tool subscribed at {} s",
        seconds(rival_start)
    );
    assert!(to >= from && to - from < 1.0, "{from} s to {to} s");

    let mut after_the_span = 0;
    for KernelLaunches { id, at_s, launches } in &kernels {
        if *at_s > to + 0.001 {
            after_the_span += 1;
        }
        assert!(
            *launches == 1 || (*launches == 0 && at_s + 0.001 >= from && *at_s <= to + 0.001),
            "kernel {id} at {at_s} s has {launches} launch calls (span {from} s to {to} s)"
        );
    }
    assert!(
        after_the_span >= 4,
        "{after_the_span} kernels after the span"
    );
    let set = api_records_of(&space, pid);
    assert!(
        set.starts_with(TIMED) && set.contains("; then timeline: "),
        "{set}"
    );
}

/// A profiler that subscribes before it takes the activity stream (as
/// XLA's tracer and Kineto do) inside a capture: the calls between its
/// subscription and its taking the stream are reported missing, the stream
/// it had too, and once it is done the library takes both back; every
/// kernel outside those spans has its launch call.
#[tokio::test(flavor = "multi_thread")]
async fn a_profiler_subscribing_inside_a_capture_leaves_no_kernel_unaccounted_for() {
    let (_setup, agent, release, workload) = rival_from(
        "2",
        "cuda_rival_subscribing",
        "8",
        "2",
        &["--rival-subscribe", "--wait-recording"],
    )
    .await;
    let pid = workload.workload.pid;
    let space = capture_while(&agent, 2500, &release).await;
    let lines = workload.read_until("done");
    let (rival_kernels, _, _) = rival_report(&lines);
    assert_eq!(rival_kernels, 4, "the other profiler keeps working");
    let (untimed_from, untimed_to) = span_in_warning(&space, "Callback API subscriber")
        .unwrap_or_else(|| panic!("no untimed span in {:?}", space.warnings));
    let (other_from, other_to) = lost_span(&space);
    assert!(
        untimed_to <= other_from + 0.001 && other_from - untimed_from < 0.1,
        "calls untimed from {untimed_from} s to {untimed_to} s, the stream another's from \
         {other_from} s"
    );
    let kernels = kernel_launches(&space, pid);
    let after = kernels.iter().filter(|k| k.at_s > other_to + 0.001).count();
    assert!(
        after >= 4,
        "{after} kernels of ours after the other profiler"
    );
    for KernelLaunches { id, at_s, launches } in &kernels {
        assert!(
            *launches == 1 || (at_s + 0.001 >= untimed_from && *at_s <= other_to + 0.001),
            "kernel {id} at {at_s} s has {launches} launch calls; {:?}",
            space.warnings
        );
    }
    // Timed until then; CUPTI's records from the stream's return on (a
    // subscriber made on a CUPTI attached with every kind off would not be
    // called, so it is made after the kinds, and the calls in between have
    // CUPTI's records; this capture keeps them).
    let set = api_records_of(&space, pid);
    assert!(
        set.starts_with(TIMED)
            && set.ends_with(&format!(
                "; then {}",
                devtrace::workload::ApiRecordSet::Timeline.describe()
            )),
        "{set}"
    );
}

/// A CUPTI that never calls the library's subscriber (the worst reading of
/// what CUDA 13.0 did to some subscribers) times nothing: once a second has
/// passed with kernels recorded and not one callback, not even for a driver
/// call of the library's own, CUPTI's records take over, and the trace says
/// from when to when the calls are missing and why.
#[tokio::test(flavor = "multi_thread")]
async fn a_subscriber_cupti_never_calls_hands_the_calls_to_cuptis_records() {
    let setup = setup("cuda_deaf_subscriber");
    let agent = setup.agent();
    let workload = setup.workload(
        &["300", "--sleep-ms", "10"],
        &[("DEVTRACE_STANDIN_CUPTI_DEAF_SUBSCRIBERS", "1")],
    );
    let pid = workload.workload.pid;
    wait_for_attached(&agent, 1).await;
    let space = capture(&agent, 2500).await;
    let (from, to) = span_in_warning(&space, "did not call")
        .unwrap_or_else(|| panic!("no silent span in {:?}", space.warnings));
    assert!(
        (0.9..1.5).contains(&(to - from)),
        "calls missing from {from} s to {to} s"
    );
    let kernels = kernel_launches(&space, pid);
    let after: Vec<_> = kernels.iter().filter(|k| k.at_s > to + 0.005).collect();
    assert!(after.len() > 20, "{} kernels after the span", after.len());
    for k in after {
        assert_eq!(
            k.launches, 1,
            "kernel {} at {} s; calls missing from {from} s to {to} s; {:?}",
            k.id, k.at_s, space.warnings
        );
    }
    let set = api_records_of(&space, pid);
    assert!(
        set.starts_with(TIMED) && set.contains("; then timeline: "),
        "{set}"
    );
    drop(workload);
}

/// A profiler that ends by finalizing CUPTI (as Kineto does when it tears
/// CUPTI down) takes the library's subscriber with it: the library forgets
/// it, subscribes again as it takes the stream back, and detaches CUPTI at
/// the capture's end.
#[tokio::test(flavor = "multi_thread")]
async fn a_profiler_that_finalizes_cupti_leaves_the_library_a_subscriber_to_detach_with() {
    let (_setup, agent, release, workload) = rival_from_iteration_4(
        "cuda_teardown_finalizing_rival",
        "60",
        "4",
        "--rival-finalize",
    )
    .await;
    // The rival's iterations 4 to 7 and its finalize fall inside this
    // capture, which takes the stream back after them.
    capture_while(&agent, 1500, &release).await;
    tokio::time::sleep(std::time::Duration::from_millis(1500)).await;
    let lines = workload.read_until("done");
    let (rival_kernels, _, _) = rival_report(&lines);
    assert!(rival_kernels > 0, "the other profiler traced");
    let (armed, finalized) = cupti_state(&lines);
    let stderr = stderr_to_end(workload);
    assert_eq!(
        (armed, finalized),
        (0, 2),
        "the rival's finalize and the library's: {stderr}"
    );
    assert_eq!(
        stderr.matches("devtrace-inject: CUPTI detached").count(),
        1,
        "{stderr}"
    );
}

/// A profiler that ran and stopped before the first capture, without
/// finalizing, left CUPTI attached with every kind off: the capture's
/// subscriber is made after its kinds are on (one made before them would
/// never be called), and the capture's end detaches CUPTI.
#[tokio::test(flavor = "multi_thread")]
async fn after_a_profiler_that_left_cupti_attached_the_first_capture_still_detaches() {
    let (_setup, agent, release, workload) =
        rival_from_iteration_0("cuda_teardown_after_rival").await;
    std::fs::write(&release, b"go").unwrap();
    // The rival's two iterations are over well before the capture.
    tokio::time::sleep(std::time::Duration::from_millis(600)).await;
    capture(&agent, 600).await;
    tokio::time::sleep(std::time::Duration::from_millis(1500)).await;
    let lines = workload.read_until("done");
    let (armed, finalized) = cupti_state(&lines);
    let stderr = stderr_to_end(workload);
    assert_eq!((armed, finalized), (0, 1), "{stderr}");
    assert_eq!(
        stderr.matches("devtrace-inject: CUPTI detached").count(),
        1,
        "{stderr}"
    );
}

/// As [`rival_from_iteration_4`], with a rival of two iterations from the
/// first, seen through the program's GOT.
async fn rival_from_iteration_0(name: &str) -> (Setup, AgentProcess, PathBuf, CudaWorkload) {
    rival_from("0", name, "80", "2", &[]).await
}

/// Every sequence of captures, a framework profiler and exit, hundreds of
/// times, under valgrind's memcheck: the workload's exit status says that
/// no buffer was freed twice, read after its free or handed to a callback
/// that does not own it. The capture flag is driven straight through the
/// ring's control word (the agent's part, without its pace); the profiler
/// (seen through the program's GOT, as Kineto) runs 4 of every 11
/// iterations; the process exits during a capture.
#[test]
fn capture_and_profiler_sequences_are_memory_safe_under_memcheck() {
    memcheck_sequences("cuda_memcheck", &["--rival-linked"]);
}

/// The same with a profiler the library cannot see (it looked CUPTI up on
/// libcupti's handle before cuInit) that holds a subscriber while it runs,
/// as XLA's tracer does, and frees every buffer its callback is handed,
/// ours included. Its buffers reaching the library's callback keep CUPTI
/// attached for good; nothing is freed twice or read after its free.
#[test]
fn an_unseen_profiler_freeing_every_buffer_it_is_handed_leaves_no_double_free() {
    memcheck_sequences(
        "cuda_memcheck_careless",
        &[
            "--rival-direct",
            "--rival-early",
            "--rival-subscribe",
            "--rival-frees-all",
        ],
    );
}

fn memcheck_sequences(name: &str, rival: &[&str]) {
    if std::env::var("DEVTRACE_SKIP_MEMCHECK").is_ok_and(|v| v == "1") {
        eprintln!("skipped: DEVTRACE_SKIP_MEMCHECK=1");
        return;
    }
    let valgrind = which("valgrind").expect(
        "valgrind is needed (apt-get install valgrind; DEVTRACE_SKIP_MEMCHECK=1 skips this test)",
    );
    let mut setup = setup(name);
    setup.program = rival_linked_program();
    let env = setup.environment("CUDA_INJECTION64_PATH");
    let mut env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    env.extend([
        ("DEVTRACE_STANDIN_CUPTI_VERSION", "130001"),
        ("DEVTRACE_STANDIN_CUPTI_FIRST_ENABLE_MS", "5"),
        ("DEVTRACE_STANDIN_CUPTI_LATE_MS", "30"),
        ("DEVTRACE_INJECT_POLL_MS", "2"),
    ]);
    let program = setup.program.to_str().unwrap().to_string();
    let mut args = vec![
        "--error-exitcode=99",
        "--leak-check=no",
        "-q",
        &program,
        "3000",
        "--quiet",
        "--sleep-ms",
        "2",
        "--rival-at",
        "3",
        "--rival-iterations",
        "4",
        "--rival-every",
        "11",
    ];
    args.extend_from_slice(rival);
    let mut workload = CudaWorkload::start(&valgrind, &args, &env);
    let ring = loop {
        let found = std::fs::read_dir(setup.runtime.path())
            .unwrap()
            .filter_map(Result::ok)
            .map(|e| e.path())
            .find(|p| p.extension().is_some_and(|e| e == "ring"));
        if let Some(path) = found {
            if let Ok(ring) = devtrace::ring::Ring::open_shared(&path) {
                break ring;
            }
        }
        if workload.workload.child.try_wait().unwrap().is_some() {
            panic!(
                "the workload exited before making its ring: {}",
                stderr_to_end(workload)
            );
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    };
    let capture = devtrace::ring::CONTROL_CAPTURE;
    let mut cycles = 0;
    let status = loop {
        // Windows and gaps of 5 to 60 ms, so that captures start and end in
        // every phase of the profiler's windows and of the detaches.
        let on = 5 + (cycles * 7) % 56;
        let off = 5 + (cycles * 13) % 56;
        ring.set_control(capture);
        std::thread::sleep(std::time::Duration::from_millis(on));
        if let Some(status) = workload.workload.child.try_wait().unwrap() {
            break status;
        }
        ring.set_control(0);
        std::thread::sleep(std::time::Duration::from_millis(off));
        cycles += 1;
        if cycles >= 300 {
            // The last capture lasts until the process exits.
            ring.set_control(capture);
            break workload.workload.child.wait().unwrap();
        }
    };
    let stderr = stderr_of(&mut workload);
    assert_eq!(
        status.code(),
        Some(0),
        "{status:?} after {cycles} cycles: {stderr}"
    );
    assert!(
        cycles >= 100,
        "only {cycles} cycles ran before the workload ended"
    );
}

fn which(program: &str) -> Option<PathBuf> {
    std::env::var_os("PATH")?
        .to_str()?
        .split(':')
        .map(|dir| PathBuf::from(dir).join(program))
        .find(|path| path.is_file())
}

/// Two agents on one runtime directory would split its workloads' rings
/// between them, each capture missing the other's processes: the second
/// agent's CUDA backend refuses to start and names the first, whose
/// backend runs on; once the first is gone, the directory is free again.
#[tokio::test(flavor = "multi_thread")]
async fn a_second_agent_on_a_runtime_directory_is_refused_its_cuda_backend() {
    let runtime = tempfile::tempdir().unwrap();
    let dir = runtime.path().to_str().unwrap();
    let first = AgentProcess::start(&["--backend", "cuda", "--runtime-dir", dir]);
    let second = AgentProcess::start(&[
        "--backend",
        "cuda",
        "--backend",
        "mock",
        "--runtime-dir",
        dir,
    ]);
    let refused = second.monitor(100).await.data;
    let holder = format!(
        "another devtrace agent (pid {}) serves the runtime directory {dir}",
        first.pid()
    );
    assert!(refused.contains(&holder), "{refused}");
    let running = first.monitor(100).await.data;
    assert!(running.contains("backend cuda: running"), "{running}");
    drop(first);
    drop(second);
    let third = AgentProcess::start(&["--backend", "cuda", "--runtime-dir", dir]);
    let running = third.monitor(100).await.data;
    assert!(running.contains("backend cuda: running"), "{running}");
}
