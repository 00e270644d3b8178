//! The eBPF backend against the real kernel: scheduler tracing of a workload
//! with a known pattern, uprobes on a stand-in CUDA driver library called
//! with known arguments, filters, and losses. Loading BPF programs needs
//! root; without it these tests say so and pass without checking anything.

use crate::common;

use std::collections::HashMap;
use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};

use common::workload::*;
use common::{build_program, is_root, AgentProcess};
use devtrace::proto::tensorflow::profiler::XSpace;
use devtrace::xspace::read::{find_stat, StatValue};

fn skip_without_root(test: &str) -> bool {
    if is_root() {
        return false;
    }
    eprintln!("{test}: skipped, loading BPF programs needs root");
    true
}

fn start_sched_workload(seconds: &str) -> Workload {
    start_sched_workload_as(seconds, None)
}

/// The workload of [`start_sched_workload`], run as `uid` (needs root).
fn start_sched_workload_as(seconds: &str, uid: Option<u32>) -> Workload {
    let program = build_program("sched_workload.c", "sched_workload", &["-pthread"]);
    let mut command = match uid {
        None => Command::new(program),
        Some(uid) => {
            let mut command = Command::new("setpriv");
            command
                .arg(format!("--reuid={uid}"))
                .arg(format!("--regid={uid}"))
                .args(["--clear-groups", "--"])
                .arg(program);
            command
        }
    };
    let mut child = command
        .arg(seconds)
        .stdout(Stdio::piped())
        .spawn()
        .expect("starting the workload");
    let mut line = String::new();
    BufReader::new(child.stdout.take().expect("stdout"))
        .read_line(&mut line)
        .expect("reading the ready line");
    let pid = line
        .trim()
        .strip_prefix("ready ")
        .and_then(|p| p.parse().ok())
        .unwrap_or_else(|| panic!("unexpected first line {line:?}"));
    Workload { child, pid }
}

fn on_cpu_ms(cpu_events: &[Seen], thread: &str) -> f64 {
    cpu_events
        .iter()
        .filter(|e| e.name == thread)
        .map(|e| e.duration_ps as f64 / 1e9)
        .sum()
}

#[tokio::test(flavor = "multi_thread")]
async fn threads_show_on_cpu_lines_with_their_on_and_off_cpu_time() {
    if skip_without_root("threads_show_on_cpu_lines") {
        return;
    }
    let workload = start_sched_workload("20");
    let pid = workload.pid.to_string();
    let agent = ebpf_agent("sched", &["--ebpf-pid", &pid]);
    let window_ms = 1500.0;
    let space = capture(&agent, window_ms as u64).await;
    let plane = common::plane(&space, "/host:CPUs");
    let all = events(plane);
    let (cpu, threads): (Vec<Seen>, Vec<Seen>) =
        all.into_iter().partition(|e| e.line.starts_with("CPU "));

    // The filter keeps every other process out.
    assert!(!cpu.is_empty(), "no CPU slices");
    for slice in &cpu {
        assert_eq!(uint(slice, "pid"), u64::from(workload.pid), "{slice:?}");
        assert_eq!(uint(slice, "cpu").to_string(), slice.line["CPU ".len()..]);
    }
    // 60 ms of every 100 spinning, 5 of every 100: bands wide enough for a
    // loaded two-core machine, narrow enough to tell the threads apart.
    let spinner = on_cpu_ms(&cpu, "dt-spinner") / window_ms;
    let sleeper = on_cpu_ms(&cpu, "dt-sleeper") / window_ms;
    assert!(
        (0.3..=0.8).contains(&spinner),
        "spinner on CPU {spinner:.2} of the window"
    );
    assert!(
        (0.01..=0.2).contains(&sleeper),
        "sleeper on CPU {sleeper:.2} of the window"
    );
    // Slices on one CPU line never overlap.
    let mut by_cpu: HashMap<&str, Vec<(i64, i64)>> = HashMap::new();
    for slice in &cpu {
        by_cpu
            .entry(&slice.line)
            .or_default()
            .push((slice.offset_ps, slice.offset_ps + slice.duration_ps));
    }
    for spans in by_cpu.values_mut() {
        spans.sort();
        for pair in spans.windows(2) {
            assert!(pair[0].1 <= pair[1].0, "overlap {pair:?}");
        }
    }

    // The sleeper spends most of the window asleep, on its own line.
    let sleeper_line = "dt-sleeper";
    let asleep: f64 = threads
        .iter()
        .filter(|e| e.line.starts_with(sleeper_line) && e.name == "off-CPU: S (sleeping)")
        .map(|e| e.duration_ps as f64 / 1e9)
        .sum();
    assert!(
        asleep / window_ms > 0.6,
        "sleeper asleep {:.2} of the window",
        asleep / window_ms
    );
    let off = threads
        .iter()
        .find(|e| e.line.starts_with(sleeper_line) && e.name == "off-CPU: S (sleeping)")
        .expect("an off-CPU span of the sleeper");
    assert_eq!(text(off, "state"), "S (sleeping)");
    assert!(
        off.line.ends_with(&format!("(pid {})", workload.pid)),
        "{}",
        off.line
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_command_name_filter_keeps_only_matching_threads() {
    if skip_without_root("a_command_name_filter") {
        return;
    }
    let _workload = start_sched_workload("20");
    let agent = ebpf_agent("sched", &["--ebpf-comm", "dt-sp"]);
    let space = capture(&agent, 800).await;
    let cpu: Vec<Seen> = events(common::plane(&space, "/host:CPUs"))
        .into_iter()
        .filter(|e| e.line.starts_with("CPU "))
        .collect();
    assert!(!cpu.is_empty());
    let names: std::collections::BTreeSet<&str> = cpu.iter().map(|e| e.name.as_str()).collect();
    assert_eq!(names, ["dt-spinner"].into_iter().collect());
}

/// On a shared node a user who is not an admin sees only its own threads:
/// uid 65534's capture holds its workload's slices and none of uid 1001's,
/// the agent's or root's; root's capture holds both workloads.
#[tokio::test(flavor = "multi_thread")]
async fn a_users_capture_holds_only_that_users_threads() {
    use common::raw_call::{connect_as, unary_on};
    use devtrace::proto::tensorflow::ProfileResponse;
    use prost::Message;
    if skip_without_root("a_users_capture_holds_only_that_users_threads") {
        return;
    }
    let own = start_sched_workload_as("20", Some(65534));
    let other = start_sched_workload_as("20", Some(1001));
    let agent = ebpf_agent("sched", &[]);
    let mut asked = common::request(1000, "scoped");
    asked.emit_xspace = true;
    let io = connect_as(65534, &agent.address).await;
    let (reply, status) = unary_on(
        io,
        &agent.address,
        "/tensorflow.ProfilerService/Profile",
        &asked,
    )
    .await;
    assert_eq!(status.code(), tonic::Code::Ok, "{status:?}");
    let space = common::space_of(&ProfileResponse::decode(&reply[..]).unwrap());
    let pids = |space: &XSpace| -> std::collections::BTreeSet<u64> {
        events(common::plane(space, "/host:CPUs"))
            .iter()
            .filter(|e| e.stats.contains_key("pid"))
            .map(|e| uint(e, "pid"))
            .collect()
    };
    let seen = pids(&space);
    assert!(seen.contains(&u64::from(own.pid)), "{seen:?}");
    assert!(!seen.contains(&u64::from(other.pid)), "{seen:?}");
    assert!(!seen.contains(&u64::from(agent.pid())), "{seen:?}");
    // Any other pid it holds is a process of uid 65534's (or one gone).
    for pid in &seen {
        if let Ok(status) = std::fs::read_to_string(format!("/proc/{pid}/status")) {
            let uid = status
                .lines()
                .find_map(|l| l.strip_prefix("Uid:"))
                .and_then(|l| l.split_whitespace().next())
                .unwrap_or("?")
                .to_string();
            assert_eq!(uid, "65534", "pid {pid} is uid {uid}'s");
        }
    }
    assert!(space
        .warnings
        .iter()
        .any(|w| w.starts_with("this trace is scoped to the processes of uid 65534")));
    let whole = capture(&agent, 1000).await;
    let seen = pids(&whole);
    assert!(seen.contains(&u64::from(own.pid)), "{seen:?}");
    assert!(seen.contains(&u64::from(other.pid)), "{seen:?}");
}

/// An agent running only the eBPF backend with one hook (`sched` or
/// `cuda`), plus `extra` arguments.
fn ebpf_agent(hook: &str, extra: &[&str]) -> AgentProcess {
    let mut args = vec!["--backend", "ebpf", "--ebpf-hooks", hook];
    args.extend_from_slice(extra);
    AgentProcess::start(&args)
}

/// An agent with only the CUDA probes, attached from the start, plus
/// `extra` arguments; returned once it has probed a driver library.
async fn cuda_agent(extra: &[&str]) -> AgentProcess {
    let mut args = vec!["--ebpf-attach", "always"];
    args.extend_from_slice(extra);
    let agent = ebpf_agent("cuda", &args);
    wait_for_probes(&agent).await;
    agent
}

/// Waits until the agent's eBPF backend reports probes on the stand-in
/// driver beside the test programs (itself, or as a process maps it
/// through its root): another copy of a driver probed first, such as a
/// leftover process's, must not let a test go on before its own is.
async fn wait_for_probes(agent: &AgentProcess) {
    let dir = standin_driver_dir();
    let own = format!("{}/libcuda.so", dir.display());
    for _ in 0..100 {
        let text = agent.monitor(100).await.data;
        if text.contains("CUDA probes on") && text.contains(&own) {
            return;
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    panic!(
        "the eBPF backend never probed the stand-in driver in {}",
        dir.display()
    );
}

/// Driver-call events of `pid` on `/host:CPU`, with absolute times.
fn driver_calls(space: &XSpace, pid: u32) -> Vec<(Seen, u64)> {
    let (start, _) = common::window_of(space);
    events(common::plane(space, "/host:CPU"))
        .into_iter()
        .filter(|e| e.name.starts_with("cu") && e.stats.contains_key("pid"))
        .filter(|e| uint(e, "pid") == u64::from(pid))
        .map(|e| {
            let at = start + (e.offset_ps / 1000) as u64;
            (e, at)
        })
        .collect()
}

/// The thread id of a thread line named `... TID (pid PID)`.
fn line_thread(line: &str) -> u32 {
    line.split(" (pid ")
        .next()
        .and_then(|head| head.rsplit(' ').next())
        .and_then(|tid| tid.parse().ok())
        .unwrap_or_else(|| panic!("no thread id in line {line:?}"))
}

/// Every probed call the workload printed is in the trace once, on its
/// thread's line, inside the interval the workload measured around it, with
/// its arguments; and nothing else of that process is. Launches and
/// asynchronous copies have their duration and result only when
/// `every_call_returns` (`--ebpf-cuda-returns all`).
fn assert_calls_match(
    space: &XSpace,
    calls: &[Call],
    pid: u32,
    kernel_us: u64,
    sync_us: u64,
    lookups_seen: bool,
    every_call_returns: bool,
) {
    const PROBED: [&str; 12] = [
        "cuMemcpyDtoD_v2",
        "cuMemcpyHtoDAsync_v2",
        "cuEventSynchronize",
        "cuModuleGetFunction",
        "cuMemAlloc_v2",
        "cuMemcpyHtoD_v2",
        "cuLaunchKernel",
        "cuLaunchKernelEx",
        "cuMemcpyDtoHAsync_v2",
        "cuStreamSynchronize",
        "cuMemFree_v2",
        "cuCtxSynchronize",
    ];
    // Each thread's calls in order, thread after thread.
    let mut expected: Vec<&Call> = calls
        .iter()
        .filter(|c| PROBED.contains(&c.name.as_str()))
        .collect();
    expected.sort_by_key(|c| (c.tid, c.realtime.0));
    let mut seen = driver_calls(space, pid);
    seen.sort_by_key(|(event, at)| (line_thread(&event.line), *at));
    let names = |v: &[&str]| v.join(" ");
    assert_eq!(
        names(
            &seen
                .iter()
                .map(|(e, _)| e.name.as_str())
                .collect::<Vec<_>>()
        ),
        names(&expected.iter().map(|c| c.name.as_str()).collect::<Vec<_>>()),
        "the calls, in order"
    );
    // The agent's clock is mapped from the kernel's monotonic clock; allow
    // for that mapping's error.
    let slack_ns = 200_000;
    for ((event, at), call) in seen.iter().zip(&expected) {
        let end = at + (event.duration_ps / 1000) as u64;
        assert!(
            *at + slack_ns >= call.realtime.0 && end <= call.realtime.1 + slack_ns,
            "{} at {at}..{end} outside the workload's {:?}",
            call.name,
            call.realtime
        );
        assert!(
            event.line.contains(&format!(" {} (pid {pid})", call.tid)),
            "{} on line {:?}, thread {}",
            call.name,
            event.line,
            call.tid
        );
        assert_eq!(uint(event, "pid"), u64::from(pid));
        assert_eq!(call.pid, pid);
        let entry_only = !every_call_returns
            && matches!(
                call.name.as_str(),
                "cuLaunchKernel"
                    | "cuLaunchKernelEx"
                    | "cuMemcpyHtoDAsync_v2"
                    | "cuMemcpyDtoHAsync_v2"
            );
        match event.stats.get("result") {
            None if entry_only => assert_eq!(event.duration_ps, 0, "{}", call.name),
            Some(StatValue::Int(0)) if !entry_only => {}
            other => panic!("{}: result {other:?}", call.name),
        }
        let duration_us = (event.duration_ps / 1_000_000) as u64;
        match call.name.as_str() {
            "cuLaunchKernel" | "cuLaunchKernelEx" => {
                assert!(
                    entry_only || duration_us >= kernel_us,
                    "{} took {duration_us} us",
                    call.name
                );
                assert_eq!(text(event, "grid"), call.fields["grid"]);
                assert_eq!(text(event, "block"), call.fields["block"]);
                assert_eq!(
                    uint(event, "shared_mem_bytes").to_string(),
                    call.fields["shmem"]
                );
                if lookups_seen {
                    assert_eq!(text(event, "kernel"), call.fields["func"]);
                } else {
                    // Looked up before the probes were attached: the launch
                    // shows the handle without a name.
                    assert!(!event.stats.contains_key("kernel"), "{event:?}");
                }
                assert_ne!(uint(event, "function"), 0);
                assert_ne!(uint(event, "stream"), 0);
            }
            "cuStreamSynchronize" => {
                assert!(duration_us >= sync_us, "sync took {duration_us} us");
                assert_ne!(uint(event, "stream"), 0);
            }
            "cuMemAlloc_v2" => {
                assert_eq!(uint(event, "bytes").to_string(), call.fields["bytes"]);
                assert_eq!(uint(event, "addr"), hex(call, "ptr"));
            }
            "cuMemFree_v2" => {
                assert_eq!(uint(event, "addr"), hex(call, "ptr"));
                assert_eq!(
                    uint(event, "bytes"),
                    1 << 20,
                    "size known from the allocation"
                );
            }
            "cuMemcpyHtoD_v2" => {
                assert_eq!(uint(event, "bytes").to_string(), call.fields["bytes"]);
                assert_eq!(uint(event, "addr"), hex(call, "dst"));
            }
            "cuMemcpyDtoHAsync_v2" => {
                assert_eq!(uint(event, "bytes").to_string(), call.fields["bytes"]);
                assert_eq!(uint(event, "addr"), hex(call, "src"));
                assert_ne!(uint(event, "stream"), 0);
            }
            "cuModuleGetFunction" => {
                assert_eq!(text(event, "kernel"), call.fields["name"]);
            }
            _ => {}
        }
    }
}

/// The memory events of `pid`: (name, address, bytes in use after).
fn memory_events(space: &XSpace, pid: u32) -> Vec<(String, u64, i64)> {
    let allocator = format!("cuMemAlloc pid {pid}");
    events(common::plane(space, "/host:CPU"))
        .into_iter()
        .filter(|e| e.name.starts_with("Memory"))
        .filter(|e| text(e, "allocator_name") == allocator)
        .map(|e| {
            let in_use = match e.stats.get("bytes_allocated") {
                Some(StatValue::Int(v)) => *v,
                other => panic!("{other:?}"),
            };
            (e.name.clone(), uint(&e, "addr"), in_use)
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread")]
async fn driver_calls_of_a_program_started_before_the_agent_carry_their_arguments() {
    if skip_without_root("driver_calls_before") {
        return;
    }
    let program = cuda_programs("cuda_early");
    let dir = tempfile::tempdir().unwrap();
    let release = dir.path().join("go");
    let (kernel_us, sync_us) = (300, 500);
    let workload = CudaWorkload::start(
        &program,
        &[
            "3",
            "--wait-file",
            release.to_str().unwrap(),
            "--sleep-ms",
            "20",
        ],
        &[
            ("DEVTRACE_STANDIN_KERNEL_US", &kernel_us.to_string()),
            ("DEVTRACE_STANDIN_SYNC_US", &sync_us.to_string()),
        ],
    );
    workload.read_until("waiting");
    let pid = workload.workload.pid;
    let agent = cuda_agent(&["--ebpf-pid", &pid.to_string()]).await;
    let space = capture_while(&agent, 2000, &release).await;
    let calls = calls_until_done(&workload);
    assert_eq!(
        calls.iter().filter(|c| c.name == "cuLaunchKernel").count(),
        3
    );
    assert_calls_match(&space, &calls, pid, kernel_us, sync_us, false, false);
    // The trace says why its launches are instants.
    let env = common::plane(&space, "Task Environment");
    match find_stat(env, &env.stats, "devtrace_ebpf_cuda_returns") {
        Some(StatValue::Str(text)) => assert!(text.starts_with("needed: launches"), "{text}"),
        other => panic!("no probe mode in the trace: {other:?}"),
    }

    // Allocations and frees feed the memory profile, per process.
    let memory = memory_events(&space, pid);
    let allocs: Vec<u64> = calls
        .iter()
        .filter(|c| c.name == "cuMemAlloc_v2")
        .map(|c| hex(c, "ptr"))
        .collect();
    let expected: Vec<(String, u64, i64)> = allocs
        .iter()
        .flat_map(|ptr| {
            [
                ("MemoryAllocation".to_string(), *ptr, 1 << 20),
                ("MemoryDeallocation".to_string(), *ptr, 0),
            ]
        })
        .collect();
    assert_eq!(memory, expected);
}

/// A capture of a process the injection library records beside `others`
/// plain processes on the same stand-in driver (`name` is the program's
/// command name, which the agent's filter keeps), each making the same
/// calls once the window is open, the plain ones from two threads each
/// (neither the first), until about a second into it. The agent gets
/// `agent_args` too.
struct Beside {
    space: XSpace,
    /// `Monitor` during the capture.
    health: String,
    recorded: (u32, Vec<Call>),
    probed: Vec<(u32, Vec<Call>)>,
}

async fn recorded_beside(name: &str, others: usize, agent_args: &[&str]) -> Beside {
    let program = cuda_programs(name);
    let runtime = tempfile::tempdir().unwrap();
    let mut args = vec![
        "--backend",
        "cuda",
        "--backend",
        "ebpf",
        "--ebpf-hooks",
        "cuda",
        "--ebpf-comm",
        name,
        "--runtime-dir",
        runtime.path().to_str().unwrap(),
    ];
    args.extend_from_slice(agent_args);
    let agent = AgentProcess::start(&args);
    let dir = tempfile::tempdir().unwrap();
    let release = dir.path().join("go");
    // 40 iterations 20 ms apart: from the release (0.3 s into the window)
    // to past the look at Monitor (0.7 s), done well before the end (2 s).
    let args = [
        "40",
        "--wait-file",
        release.to_str().unwrap(),
        "--sleep-ms",
        "20",
    ];
    let two_threads = [&args[..], &["--threads", "2"]].concat();
    let cupti = cupti_standin().display().to_string();
    let inject = inject_library().display().to_string();
    let recorded = CudaWorkload::start(
        &program,
        &args,
        &[
            ("LD_LIBRARY_PATH", cupti.as_str()),
            ("CUDA_INJECTION64_PATH", inject.as_str()),
            ("DEVTRACE_RUNTIME_DIR", runtime.path().to_str().unwrap()),
        ],
    );
    let probed: Vec<CudaWorkload> = (0..others)
        .map(|_| CudaWorkload::start(&program, &two_threads, &[]))
        .collect();
    recorded.read_until("waiting");
    for workload in &probed {
        workload.read_until("waiting");
    }
    wait_for_attached(&agent, 1).await;
    for _ in 0..100 {
        if agent
            .monitor(100)
            .await
            .data
            .contains("1 recording with CUPTI")
        {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    // The probes go on as the capture starts, and are looked at during it.
    let (space, health) = tokio::join!(capture_while(&agent, 2000, &release), async {
        tokio::time::sleep(std::time::Duration::from_millis(700)).await;
        agent.monitor(100).await.data
    });
    Beside {
        space,
        health,
        recorded: (recorded.workload.pid, calls_until_done(&recorded)),
        probed: probed
            .iter()
            .map(|w| (w.workload.pid, calls_until_done(w)))
            .collect(),
    }
}

/// While a capture runs, a process the injection library records (its ring
/// attached, CUPTI loaded) runs with its driver library unprobed, since a
/// uprobe traps on every call for what the library already has; a process
/// beside it that maps the same driver library is probed, each call once.
/// The injection library's process still has its launches, timed by the
/// library.
#[tokio::test(flavor = "multi_thread")]
async fn a_process_the_injection_library_records_runs_unprobed() {
    if skip_without_root("unprobed") {
        return;
    }
    let Beside {
        space,
        health,
        recorded: (recorded_pid, recorded_calls),
        probed,
    } = recorded_beside("cuda_unprobed", 1, &[]).await;
    assert!(
        health.contains("1 process left unprobed to the injection library"),
        "{health}"
    );
    let (probed_pid, probed_calls) = &probed[0];
    assert_calls_match(&space, probed_calls, *probed_pid, 0, 0, false, false);
    let trapped = driver_calls(&space, recorded_pid);
    assert!(
        trapped.is_empty(),
        "the recorded process was probed: {:?}",
        trapped.iter().map(|(e, _)| &e.name).collect::<Vec<_>>()
    );
    let launches = recorded_calls
        .iter()
        .filter(|c| c.name.starts_with("cuLaunchKernel"))
        .count();
    let timed = events(common::plane(&space, "/host:CPU"))
        .into_iter()
        .filter(|e| e.name.starts_with("cuLaunchKernel") && e.stats.contains_key("correlation_id"))
        .count();
    assert_eq!(timed, launches, "the library's launches");
    let env = common::plane(&space, "Task Environment");
    match find_stat(env, &env.stats, "devtrace_ebpf_cuda_probes") {
        Some(StatValue::Str(text)) => assert!(text.contains("not probed"), "{text}"),
        other => panic!("the trace does not say which processes are probed: {other:?}"),
    }
}

/// Past `--ebpf-probe-alone-max` other processes to probe one by one,
/// the driver library is probed in every process, the recorded one too,
/// and `Monitor` says why.
#[tokio::test(flavor = "multi_thread")]
async fn too_many_processes_to_probe_one_by_one_are_probed_all_at_once() {
    if skip_without_root("crowded") {
        return;
    }
    let Beside {
        space,
        health,
        recorded: (recorded_pid, _),
        probed,
    } = recorded_beside("cuda_crowded", 5, &["--ebpf-probe-alone-max", "4"]).await;
    assert!(
        health.contains("5 processes to probe one by one, too many"),
        "{health}"
    );
    assert!(!health.contains("left unprobed"), "{health}");
    for (pid, calls) in &probed {
        assert_calls_match(&space, calls, *pid, 0, 0, false, false);
    }
    assert!(
        !driver_calls(&space, recorded_pid).is_empty(),
        "the recorded process was probed with all the others"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn driver_calls_of_a_program_started_after_the_agent_are_seen_from_cu_init() {
    if skip_without_root("driver_calls_after") {
        return;
    }
    let program = cuda_programs("cuda_late");
    let agent = ebpf_agent(
        "cuda",
        &[
            "--ebpf-attach",
            "always",
            "--ebpf-comm",
            "cuda_late",
            "--ebpf-cuda-returns",
            "all",
        ],
    );
    let dir = tempfile::tempdir().unwrap();
    let release = dir.path().join("go");
    let workload = CudaWorkload::start(
        &program,
        &[
            "2",
            "--init-wait-file",
            release.to_str().unwrap(),
            "--extras",
        ],
        &[],
    );
    workload.read_until("waiting");
    // The library is found in the new process's maps at the next rescan.
    wait_for_probes(&agent).await;
    let space = capture_while(&agent, 2000, &release).await;
    let calls = calls_until_done(&workload);
    assert_eq!(
        calls
            .iter()
            .filter(|c| c.name == "cuModuleGetFunction")
            .count(),
        2,
        "setup ran inside the window"
    );
    assert_calls_match(&space, &calls, workload.workload.pid, 0, 0, true, true);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_burst_beyond_the_bpf_ring_is_counted_not_lost() {
    if skip_without_root("a_burst_beyond_the_bpf_ring") {
        return;
    }
    let program = cuda_programs("cuda_burst");
    let dir = tempfile::tempdir().unwrap();
    let release = dir.path().join("go");
    let workload = CudaWorkload::start(
        &program,
        &["400", "--wait-file", release.to_str().unwrap()],
        &[],
    );
    workload.read_until("waiting");
    let pid = workload.workload.pid;
    // 4 KiB holds about fifteen records; the burst is thousands.
    let agent = cuda_agent(&["--ebpf-ring-size", "4KiB", "--ebpf-pid", &pid.to_string()]).await;
    let space = capture_while(&agent, 3000, &release).await;
    let made = calls_until_done(&workload)
        .iter()
        .filter(|c| {
            [
                "cuMemAlloc_v2",
                "cuMemcpyHtoD_v2",
                "cuLaunchKernel",
                "cuLaunchKernelEx",
                "cuMemcpyDtoHAsync_v2",
                "cuStreamSynchronize",
                "cuMemFree_v2",
            ]
            .contains(&c.name.as_str())
        })
        .count() as u64;
    assert_eq!(made, 400 * 7);
    let received = driver_calls(&space, pid).len() as u64;
    let warning = space
        .warnings
        .iter()
        .find(|w| w.contains("CUDA call records lost because the BPF ring buffer was full"))
        .unwrap_or_else(|| panic!("no loss warning: {:?}", space.warnings));
    let lost: u64 = warning
        .split_whitespace()
        .find_map(|w| w.parse().ok())
        .expect("a count in the warning");
    assert!(lost > 0 && received > 0, "received {received}, lost {lost}");
    assert_eq!(received + lost, made, "{warning}");
    // The lost records are in the trace's drop count too.
    assert_eq!(common::dropped_of(&space), lost as i64);
    // The loss is also a counter track on the scheduler plane.
    let counters = events(common::plane(&space, "/host:CPUs"));
    let last = counters
        .iter()
        .rfind(|e| e.name == "BPF CUDA call records lost (ring buffer full)")
        .expect("a loss counter sample");
    match last.stats.get("value") {
        Some(StatValue::Double(v)) => assert_eq!(*v as u64, lost),
        other => panic!("{other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn without_privileges_the_agent_says_why_and_serves_the_other_backends() {
    if skip_without_root("without_privileges") {
        return;
    }
    // Drop to an unprivileged user with no capabilities, as a sidecar
    // without CAP_BPF would run.
    let mut child = Command::new("setpriv")
        .args([
            "--reuid=65534",
            "--regid=65534",
            "--clear-groups",
            "--inh-caps=-all",
            "--",
        ])
        .arg(common::BIN)
        .args([
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--backend",
            "mock",
            "--backend",
            "ebpf",
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("starting devtrace as nobody");
    // The log is read to its end, so the agent never writes into a closed pipe.
    let stderr = child.stderr.take().expect("stderr");
    let (tx, log_lines) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            let _ = tx.send(line);
        }
    });
    let agent = common::AgentProcess::adopt(child);
    let reason = "run devtrace as root, or grant it CAP_BPF and CAP_PERFMON";

    let mut log: Vec<String> = Vec::new();
    while !log.iter().any(|l| l.contains("capture with")) {
        let line = log_lines
            .recv_timeout(std::time::Duration::from_secs(30))
            .unwrap_or_else(|_| panic!("the agent's log ended early: {log:?}"));
        log.push(line);
    }
    let log = log.join("\n");
    assert!(
        log.contains("backend not started") && log.contains(reason),
        "{log}"
    );
    let monitor = agent.monitor(100).await.data;
    assert!(
        monitor.contains("backend ebpf: failed:") && monitor.contains(reason),
        "{monitor}"
    );
    let space = capture(&agent, 300).await;
    assert!(
        space
            .warnings
            .iter()
            .any(|w| w.starts_with("backend ebpf is not running") && w.contains(reason)),
        "{:?}",
        space.warnings
    );
    // The mock still ran.
    assert!(common::event_count(&space) > 0);
}

/// Where cgroup v2 is mounted, if it is.
fn cgroup2_mount() -> Option<std::path::PathBuf> {
    let mounts = std::fs::read_to_string("/proc/mounts").ok()?;
    mounts
        .lines()
        .map(|l| l.split_whitespace().collect::<Vec<_>>())
        .find(|f| f.len() > 2 && f[2] == "cgroup2")
        .map(|f| std::path::PathBuf::from(f[1]))
}

/// A cgroup v2 made for one test and removed afterwards.
struct TestCgroup(std::path::PathBuf);

impl Drop for TestCgroup {
    fn drop(&mut self) {
        // Its processes are gone by now (workloads are dropped first).
        let _ = std::fs::remove_dir(&self.0);
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_cgroup_filter_keeps_only_that_cgroups_threads() {
    if skip_without_root("a_cgroup_filter") {
        return;
    }
    let Some(mount) = cgroup2_mount() else {
        eprintln!("a_cgroup_filter: skipped, no cgroup v2 mounted");
        return;
    };
    let cgroup = TestCgroup(mount.join(format!("devtrace-test-{}", std::process::id())));
    std::fs::create_dir_all(&cgroup.0).expect("creating a cgroup");
    let inside = start_sched_workload("20");
    let _outside = start_sched_workload("20");
    std::fs::write(cgroup.0.join("cgroup.procs"), inside.pid.to_string())
        .expect("moving the workload into the cgroup");
    let agent = ebpf_agent("sched", &["--ebpf-cgroup", cgroup.0.to_str().unwrap()]);
    let space = capture(&agent, 800).await;
    let pids: std::collections::BTreeSet<u64> = events(common::plane(&space, "/host:CPUs"))
        .iter()
        .filter(|e| e.line.starts_with("CPU "))
        .map(|e| uint(e, "pid"))
        .collect();
    assert_eq!(pids, [u64::from(inside.pid)].into_iter().collect());
    drop(inside);
}

#[tokio::test(flavor = "multi_thread")]
async fn programs_attach_again_for_every_capture() {
    if skip_without_root("programs_attach_again") {
        return;
    }
    let _workload = start_sched_workload("20");
    let mut agent = ebpf_agent("sched", &["--ebpf-comm", "dt-sp"]);
    // Attached for each capture and detached after it, four times over.
    for round in 0..4 {
        let space = capture(&agent, 300).await;
        let slices = events(common::plane(&space, "/host:CPUs"))
            .iter()
            .filter(|e| e.line.starts_with("CPU ") && e.name == "dt-spinner")
            .count();
        assert!(slices > 0, "capture {round}: no scheduler events");
        // A window of the present is the hooks' own: nothing said.
        let told = common::warnings_with(&space, "eBPF backend's hooks were off");
        assert!(told.is_empty(), "capture {round}: {told:?}");
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    }
    assert!(agent.is_running(), "the agent survived");
}

/// A window reaching back before its capture, with the hooks attached
/// during captures only, says which part has no scheduler slices and how to
/// record them, rather than showing CPUs that look idle.
#[tokio::test(flavor = "multi_thread")]
async fn a_look_back_before_the_hooks_attached_says_which_part_they_missed() {
    if skip_without_root("a_look_back_before_the_hooks_attached") {
        return;
    }
    let _workload = start_sched_workload("20");
    let agent = ebpf_agent("sched", &["--ebpf-comm", "dt-sp"]);
    tokio::time::sleep(std::time::Duration::from_millis(2500)).await;
    // 2 s back, 0.5 s ahead: the hooks go on 2 s into the window.
    let mut req = common::request(2500, "look_back");
    req.opts.as_mut().unwrap().start_timestamp_ns = common::now_ns() - 2_000_000_000;
    let space = common::space_of(&agent.profile(req).await);
    let told = common::warnings_with(&space, "eBPF backend's hooks were off");
    assert_eq!(told.len(), 1, "{:?}", space.warnings);
    assert!(
        told[0].contains("the eBPF backend's hooks were off from 0.000 s to 2.")
            && told[0].contains("--ebpf-attach always")
            && told[0].contains("it holds no scheduler slices (the /host:CPUs plane) for that"),
        "{}",
        told[0]
    );
    // What the hooks saw after attaching is there.
    let slices = events(common::plane(&space, "/host:CPUs"))
        .iter()
        .filter(|e| e.line.starts_with("CPU ") && e.name == "dt-spinner")
        .count();
    assert!(slices > 0, "no scheduler events after the attach");
}
