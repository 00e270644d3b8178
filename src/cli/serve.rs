//! `devtrace serve`: starts the agent and its gRPC services.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context};
use clap::Args;
use tracing::info;

use super::memory::MemorySize;
use crate::agent::{Agent, AgentConfig, BackendChoice};
use crate::backend::ebpf::{cgroup_id, AttachMode, CudaReturns, EbpfConfig};
use crate::backend::mock::MockConfig;
use crate::capture::local_hostname;
use crate::capture::spill::SpillSpace;
use crate::protocol::client::{self, Target};
use crate::protocol::unix_socket::{self, Occupant, PlacedSocket};
use crate::recorder::StoreConfig;
use crate::repository::roots::AllowedRoots;
use crate::repository::Location;
use crate::ring::DropPolicy;
use crate::service::access::{Access, RemoteCallers};
use crate::service::profile_analysis::{AnalysisConfig, ProfileAnalysisService};
use crate::service::profiler::{ProfilerService, ServiceConfig};
use crate::service::session_bytes::SessionBytes;
use crate::service::session_hosts::{HostPattern, SessionHosts};
use crate::service::trigger::TriggerService;
use crate::service::Listeners;
use crate::telemetry::http::MetricsListen;
use crate::telemetry::Telemetry;
use crate::trigger::rule::Rule;
use crate::trigger::Triggers;

/// The sections of `serve --help` (and `doctor --help`), in this order.
const BACKENDS: &str = "Backends (what is recorded)";
const TRACES: &str = "Traces (where they are written, what they may hold)";
const MEMORY: &str = "Memory (the flight recorder and captures)";
const LISTENING: &str = "Listening (who may call, and how much)";
const CALLING: &str = "TLS (its certificate), and calling other servers (session hosts, upstreams)";

#[derive(Debug, Args)]
pub struct ServeArgs {
    /// Backends to run (repeatable, or comma-separated). `auto` runs every
    /// backend that works on this machine and falls back to the mock when no
    /// device backend does.
    #[arg(help_heading = BACKENDS, long = "backend", value_enum, value_delimiter = ',', default_values_t = [BackendChoice::Auto])]
    pub backends: Vec<BackendChoice>,

    /// Events per second the mock backend produces (0: none, an idle agent;
    /// at most 100000000).
    #[arg(help_heading = BACKENDS, long, default_value_t = 50_000,
          value_parser = clap::value_parser!(u64).range(0..=crate::backend::mock::MAX_EVENTS_PER_SECOND))]
    pub mock_rate: u64,

    /// Seed of the mock backend; the same seed gives the same workload.
    #[arg(help_heading = BACKENDS, long, default_value_t = 1)]
    pub mock_seed: u64,

    /// Number of GPUs the mock backend simulates.
    #[arg(help_heading = BACKENDS, long, default_value_t = 2, value_parser = clap::value_parser!(u16).range(1..=64))]
    pub mock_gpus: u16,

    /// The user the mock's simulated job runs as (a uid), for trying
    /// captures of a user who is not an admin, which hold only that user's
    /// processes. Default: the agent's own user.
    #[arg(help_heading = BACKENDS, long, value_name = "UID")]
    pub mock_uid: Option<u32>,

    /// Scenario: the first mock step starting this long after the agent
    /// starts lasts four times as long as the others (for trying a
    /// slow-step trigger).
    #[arg(help_heading = BACKENDS, long, allow_hyphen_values = true, value_name = "AFTER", value_parser = super::parse_duration)]
    pub mock_slow_step: Option<Duration>,

    /// Scenario: the mock samples each GPU's SM utilisation at every step,
    /// 92% except from AFTER the agent starts for LENGTH, when it reads 3%
    /// (for trying a utilisation trigger), e.g. `10s+5s`.
    #[arg(help_heading = BACKENDS, long, value_name = "AFTER+LENGTH")]
    pub mock_utilization_dip: Option<crate::backend::mock::Dip>,

    /// The NVML library for the nvml backend (a path, or a name the dynamic
    /// loader resolves).
    #[arg(help_heading = BACKENDS, long, default_value = crate::backend::nvml::DEFAULT_LIBRARY)]
    pub nvml_library: std::ffi::OsString,

    /// How often the nvml backend samples each GPU while a capture runs.
    #[arg(help_heading = BACKENDS, long, allow_hyphen_values = true, default_value = "10ms", value_parser = super::parse_duration)]
    pub nvml_interval: Duration,

    /// How often it samples when no capture runs.
    #[arg(help_heading = BACKENDS, long, allow_hyphen_values = true, default_value = "1s", value_parser = super::parse_duration)]
    pub nvml_idle_interval: Duration,

    /// libtpu for the tpu backend (default: $TPU_LIBRARY_PATH, else
    /// libtpu.so through the dynamic loader).
    #[arg(help_heading = BACKENDS, long)]
    pub tpu_library: Option<std::ffi::OsString>,

    /// A process the perf backend also counts on its own (repeatable).
    #[arg(help_heading = BACKENDS, long = "perf-pid", value_name = "PID")]
    pub perf_pids: Vec<i32>,

    /// How often the perf backend reads its counters while a capture runs.
    #[arg(help_heading = BACKENDS, long, allow_hyphen_values = true, default_value = "10ms", value_parser = super::parse_duration)]
    pub perf_interval: Duration,

    /// When the eBPF backend's kernel hooks are attached: during captures
    /// only (no cost otherwise), or always (so snapshots of the past hold
    /// scheduling and CUDA calls too).
    #[arg(help_heading = BACKENDS, long, value_enum, default_value_t = AttachMode::Capture)]
    pub ebpf_attach: AttachMode,

    /// Which kernel hooks the eBPF backend uses (comma-separated).
    #[arg(help_heading = BACKENDS, long, value_enum, value_delimiter = ',', default_values_t = [EbpfHook::Sched, EbpfHook::Cuda])]
    pub ebpf_hooks: Vec<EbpfHook>,

    /// Which probed CUDA driver calls also get a return probe (a second trap
    /// into the kernel per call). `needed`: only those whose duration or
    /// returned value is recorded (synchronizations, synchronous copies,
    /// allocations, frees, module lookups); launches and asynchronous copies
    /// are then instants with their arguments but no API duration or
    /// CUresult. `all`: every probed call, at about twice the cost of a
    /// launch.
    #[arg(help_heading = BACKENDS, long, value_enum, default_value_t = CudaReturns::Needed)]
    pub ebpf_cuda_returns: CudaReturns,

    /// Limit the eBPF backend to this process (repeatable).
    #[arg(help_heading = BACKENDS, long = "ebpf-pid", value_name = "PID")]
    pub ebpf_pids: Vec<u32>,

    /// Limit the eBPF backend to one cgroup v2, e.g. a pod's
    /// /sys/fs/cgroup/kubepods.slice/.../ directory.
    #[arg(help_heading = BACKENDS, long, value_name = "DIR")]
    pub ebpf_cgroup: Option<PathBuf>,

    /// Limit the eBPF backend to threads whose command name starts with this
    /// (at most 15 bytes, the kernel's limit).
    #[arg(help_heading = BACKENDS, long, value_name = "PREFIX", value_parser = parse_comm)]
    pub ebpf_comm: Option<String>,

    /// Size of each BPF ring buffer between the kernel and the agent (a
    /// power of two, 4KiB to 1GiB). Records that find it full are counted
    /// in the trace's warnings and loss counters.
    #[arg(help_heading = BACKENDS, long, default_value = "4MiB", value_parser = parse_ring_size)]
    pub ebpf_ring_size: u32,

    /// A CUDA driver library to probe besides those found mapped in running
    /// processes (repeatable), e.g. /usr/lib/x86_64-linux-gnu/libcuda.so.1
    /// so that programs started later are seen from their first call. While
    /// the injection library records some process that maps a driver
    /// library, that library is probed in each other process alone, found
    /// at the next rescan (each second).
    #[arg(help_heading = BACKENDS, long = "cuda-library", value_name = "PATH")]
    pub cuda_libraries: Vec<PathBuf>,

    /// While the injection library records some processes that map a CUDA
    /// driver library, the other processes that map it (and pass the
    /// --ebpf-pid and --ebpf-comm filters) are probed one by one, so that
    /// the recorded ones run unprobed; past this many, the library is
    /// probed in every process, the recorded ones too (Monitor says so).
    /// Default: 64 where the kernel links a process's probes together
    /// (Linux 6.12 and later), 4 before (each of a process's 54 probes is
    /// then a perf event of its own).
    #[arg(help_heading = BACKENDS, long, value_name = "N")]
    pub ebpf_probe_alone_max: Option<usize>,

    /// Where CUDA workloads' injection libraries put their rings (the same
    /// DEVTRACE_RUNTIME_DIR must reach the workloads; share it as a volume
    /// with containers). Created world-writable and sticky when missing.
    /// One agent per directory: a second agent's CUDA backend does not
    /// start on it.
    #[arg(help_heading = BACKENDS, long, default_value = crate::workload::DEFAULT_RUNTIME_DIR)]
    pub runtime_dir: PathBuf,

    /// Attach the injection library by itself to running processes that
    /// map the CUDA driver and match RULE (repeatable; any rule may match):
    /// `all`, or KEY=PATTERN[,KEY=PATTERN...] with keys comm, cmdline,
    /// user and cgroup and `*`/`?` wildcards, e.g. `cmdline=*train.py*` or
    /// `user=alice,comm=python*`. Processes are looked at every second;
    /// needs root or CAP_SYS_PTRACE (see `devtrace attach`).
    #[arg(help_heading = BACKENDS, long = "cuda-attach", value_name = "RULE")]
    pub cuda_attach: Vec<crate::attach::rules::Rule>,

    /// The injection library --cuda-attach and captures naming processes
    /// to attach (devtrace capture --attach) load; by default the one
    /// beside this program, else /opt/devtrace/lib/libdevtrace_inject.so.
    #[arg(help_heading = BACKENDS, long, value_name = "FILE")]
    pub inject_library: Option<PathBuf>,

    /// Which CUDA driver and runtime API calls injected workloads record
    /// during captures. `timeline` (the default) records the calls that put
    /// work on the GPU timeline: kernel, cooperative, graph and host-function
    /// launches, copies, memsets, allocations and frees, whose records draw
    /// the flows to their kernels. Every other call (cuCtxSynchronize,
    /// cuStreamSynchronize, queries, module loads, ...) gets no API record
    /// and costs nothing extra (what a synchronization waited for is still
    /// recorded, on the process's synchronization line). The injection
    /// library times these calls itself, from the Callback API subscriber
    /// it holds during a capture, rather than having CUPTI record them
    /// (CUPTI's record of each launch and the capture's other kinds made up
    /// to 1.9 us of the 3.4 us a capture cost per kernel on an H200); it
    /// falls back to
    /// CUPTI's records when another CUPTI user holds the subscriber.
    /// `timeline-cupti` has CUPTI record the same calls. `all` records every
    /// call, at CUPTI's cost on each (scripts/bench-inject measures them).
    /// A capture asks for `all` with ProfileOptions.device_tracer_level 2 or
    /// more (devtrace capture --device-tracer-level 2).
    #[arg(help_heading = BACKENDS, long, value_enum, default_value_t = crate::backend::cuda::ApiRecords::Timeline)]
    pub cuda_api_records: crate::backend::cuda::ApiRecords,

    /// When injected workloads record their GPU's work: capture (during
    /// captures alone; CUPTI is detached between them, so jobs run at full
    /// speed) or always (kernels, copies and memsets between captures too,
    /// so that look-back captures, continuous snapshots and triggers hold
    /// the GPU's past; every job pays CUPTI's cost on its kernels all the
    /// time).
    #[arg(help_heading = BACKENDS, long, value_name = "WHEN", value_enum, default_value_t = crate::backend::cuda::Recording::Capture)]
    pub cuda_record: crate::backend::cuda::Recording,

    /// An in-process profiler server (TensorFlow's or JAX's, or another
    /// devtrace) whose trace every capture folds in, over the same window
    /// (repeatable), e.g. `--upstream grpc://127.0.0.1:9999`. Reached with
    /// TLS when --tls-ca is given, unless named grpc://.
    #[arg(help_heading = BACKENDS, long = "upstream", value_name = "ADDR", value_parser = parse_upstream)]
    pub upstreams: Vec<Target>,

    /// Run a tap (repeatable): forward gRPC from LISTEN to a TensorFlow
    /// server at UPSTREAM and record its steps and ops in this agent's
    /// captures, e.g. `--tap 127.0.0.1:2223=127.0.0.1:2222`.
    #[arg(help_heading = BACKENDS, long = "tap", value_name = "LISTEN=UPSTREAM", value_parser = super::tap::parse_tap_spec)]
    pub taps: Vec<(String, String)>,

    /// Directory or bucket prefix (s3://BUCKET/PREFIX, gs://BUCKET/PREFIX)
    /// the agent may write traces into, and read sessions from, when a
    /// request's repository_root lies inside it (repeatable). Buckets are
    /// reached with the credentials of the environment (AWS_*, GOOGLE_*,
    /// instance roles). Without it, traces are always returned to the
    /// client, which writes them on its own machine. A missing directory is
    /// made at start; one on procfs, sysfs, a cgroup filesystem, debugfs or
    /// tracefs is refused.
    #[arg(help_heading = TRACES, long = "allow-root", value_name = "DIR|URL")]
    pub allow_roots: Vec<PathBuf>,

    /// Where a session host's trace is kept when its upload to object
    /// storage fails (a new private directory per trace, named in the
    /// session's error); default: the temporary directory ($TMPDIR or /tmp).
    #[arg(help_heading = TRACES, long, value_name = "DIR")]
    pub unsent_dir: Option<PathBuf>,

    /// Longest capture window a request may ask for (at least 1ms).
    /// Default, and most: --store-retention less a margin (a quarter, at most
    /// 5s) for the trace's build to begin, since a window is built from the
    /// flight recorder once it ends and the recorder holds no more.
    #[arg(help_heading = TRACES, long, allow_hyphen_values = true, value_parser = parse_max_duration)]
    pub max_duration: Option<Duration>,

    /// Store a trace larger than this (encoded) as Riegeli chunks of XSpace,
    /// `<host>.xplane.riegeli`, instead of one `.xplane.pb` message, which
    /// protobuf caps at 2 GiB; XProf 2.23 and later and `devtrace inspect`
    /// read them. Under --allow-root the agent writes that file; otherwise
    /// the reply carries it as `xplane.riegeli` tool data (TensorFlow's
    /// client and `devtrace capture` write it) when the file is within this
    /// size too, as it does for a session's fan-out. A client that needs
    /// the XSpace itself (emit_xspace, GetSnapshot) gets RESOURCE_EXHAUSTED
    /// saying where the trace was written or how to get it. 1KiB to 2GiB -
    /// 1.
    #[arg(help_heading = TRACES, long, value_name = "SIZE", default_value = "1GiB", value_parser = parse_chunk_size)]
    pub chunk_traces_over: usize,

    /// Host name recorded in traces (default: this machine's), and naming
    /// the files the agent names itself, `<host>.xplane.pb`: trigger saves,
    /// and captures whose request names no host. A client names its
    /// captures' files after the address it called (`10.0.0.2_6009`, as
    /// TensorFlow's does), or its override_hostname.
    #[arg(help_heading = TRACES, long, value_parser = parse_hostname)]
    pub hostname: Option<String>,

    /// A trigger rule (repeatable): when its condition is met, the flight
    /// recorder's window around that moment is saved as a new session in
    /// --trigger-repository. `;`-separated fields: name=NAME;
    /// when=CONDITION; before=10s; after=2s; cooldown=5m; max-per-hour=6
    /// (only name and when are required). Conditions: `utilization < 20%
    /// for 30s`, `ecc changes`, `throttle changes`, `xid` (a GPU's XID
    /// errors), `counter NAME changes`, `step > 3x median(20)`, `span step_* > 3x median(20)` (spans by
    /// name or prefix: NVTX ranges, ops), `dropped`, `explicit` (only `devtrace
    /// trigger NAME` fires it; any rule can be fired so). In a --config
    /// file, a `[[trigger]]` table per rule with the same keys.
    #[arg(help_heading = TRACES,
        long = "trigger",
        value_name = "RULE",
        value_parser = parse_trigger,
        requires = "trigger_repository"
    )]
    pub triggers: Vec<Rule>,

    /// Where triggers save their sessions: a directory or bucket prefix
    /// inside an --allow-root (a logdir's plugins/profile, so that XProf and
    /// `devtrace sessions` list them). Needed with --trigger.
    #[arg(help_heading = TRACES, long, value_name = "DIR|URL")]
    pub trigger_repository: Option<PathBuf>,

    /// How much history the flight recorder keeps (e.g. 120s, 10m; at least
    /// 1s).
    #[arg(help_heading = MEMORY, long, allow_hyphen_values = true, default_value = "120s", value_parser = parse_retention)]
    pub store_retention: Duration,

    /// Memory bound of the flight recorder (e.g. 512MiB, 2GiB; at least
    /// 1MiB), or auto: half of what the agent may use (its cgroup's memory
    /// limit, else the machine's memory) after its ring and its own needs,
    /// at most 512MiB. Sizes that do not fit beside --capture-memory are
    /// refused at start.
    #[arg(help_heading = MEMORY, long, value_name = "SIZE", default_value = "auto", value_parser = super::memory::parse_store_size)]
    pub store_size: MemorySize,

    /// Slots per ring lane (rounded up to a power of two; 136 bytes each: an event and its sequence word;
    /// 2 to 16777216).
    #[arg(help_heading = MEMORY, long, default_value_t = 65_536,
          value_parser = clap::value_parser!(u64).range(crate::ring::LANE_CAPACITIES))]
    pub ring_capacity: u64,

    /// What a full ring gives up. Every drop is counted in the trace.
    #[arg(help_heading = MEMORY, long, value_enum, default_value_t = DropPolicyArg::DropNewest)]
    pub drop_policy: DropPolicyArg,

    /// Memory for traces being built and replied at once. A build reserves
    /// what its window's events are expected to take once they are in,
    /// draws every further byte as it grows, and holds its trace's size
    /// until its reply has been sent; captures of one window share one
    /// trace, whose bytes their replies send without copying. Past it,
    /// captures wait for earlier ones to reply, within their deadline, and
    /// say so in their trace's warnings; one whose deadline passes first
    /// fails with RESOURCE_EXHAUSTED. A trace that outgrows its share spills
    /// to --spill-dir. auto: what the agent may use after its ring, its own
    /// needs and the flight recorder, at most 2GiB.
    #[arg(help_heading = MEMORY, long, value_name = "SIZE", default_value = "auto", value_parser = super::memory::parse_capture_memory)]
    pub capture_memory: MemorySize,

    /// Directory a trace's finished parts are spilled to when it outgrows
    /// its share of --capture-memory (a window larger than the budget, many
    /// large captures at once): it is then sent from a file with no name,
    /// mapped into memory, whose pages the kernel can drop and read again,
    /// instead of being refused. Not a directory in memory (tmpfs). Default:
    /// the temporary directory ($TMPDIR or /tmp), unless it is in memory.
    #[arg(help_heading = MEMORY, long, value_name = "DIR")]
    pub spill_dir: Option<PathBuf>,

    /// Disk space spilled traces may take at once (SIZE, e.g. 8GiB), or
    /// `off`: a trace that outgrows its share of --capture-memory is then
    /// refused with RESOURCE_EXHAUSTED.
    #[arg(help_heading = MEMORY, long, value_name = "SIZE", default_value = "4GiB", value_parser = super::memory::parse_spill_size)]
    pub spill_size: super::memory::SpillSize,

    /// Address to listen on. Use 0.0.0.0:6009 to accept captures from other
    /// hosts; an address other hosts can reach needs --tls-cert (or
    /// --insecure). `off`: no TCP listener, only --listen-unix, whose
    /// clients the kernel names and the socket's mode lets in.
    #[arg(help_heading = LISTENING, long, default_value = "127.0.0.1:6009", value_parser = parse_listen)]
    pub listen: String,

    /// Serve plaintext gRPC on an address other hosts can reach. Anyone who
    /// reaches the port can then capture, and read and write sessions under
    /// --allow-root; keep such a port on a private network. TensorFlow's and
    /// XProf's clients speak only plaintext.
    #[arg(help_heading = LISTENING, long)]
    pub insecure: bool,

    /// Require every client of --listen to present a certificate signed by
    /// this CA (PEM): mutual TLS. Needs --tls-cert.
    #[arg(help_heading = LISTENING, long, value_name = "FILE", requires = "tls_cert")]
    pub tls_client_ca: Option<PathBuf>,

    /// Also serve on a UNIX socket at this path (plaintext; only users the
    /// socket's mode lets in can connect), e.g. for local clients while
    /// --listen uses TLS. Capture with `devtrace capture unix:PATH`.
    #[arg(help_heading = LISTENING, long, value_name = "PATH", required_if_eq("listen", "off"))]
    pub listen_unix: Option<PathBuf>,

    /// How long a continuous profiling session lives without a snapshot: a
    /// client that went away leaves no backend attached (nor CUPTI on in
    /// every workload) for longer.
    #[arg(help_heading = LISTENING, long, allow_hyphen_values = true, value_name = "DURATION", default_value = "10m", value_parser = parse_retention)]
    pub continuous_timeout: Duration,

    /// Captures one caller may have in progress at once (admins: any
    /// number); one more is refused with RESOURCE_EXHAUSTED until one ends.
    #[arg(help_heading = LISTENING, long, value_name = "N", default_value_t = 8, value_parser = clap::value_parser!(u16).range(1..))]
    pub captures_per_caller: u16,

    /// Bytes one NewSession of a caller that is not an admin may have the
    /// agent write (its hosts' traces together); a host whose trace would
    /// pass it is not written, and the session's errors say so.
    #[arg(help_heading = LISTENING, long, value_name = "SIZE", default_value = "16GiB", value_parser = parse_session_bytes)]
    pub session_bytes: usize,

    /// Bytes the NewSessions of one caller that is not an admin may have
    /// the agent write within an hour, together.
    #[arg(help_heading = LISTENING, long, value_name = "SIZE", default_value = "64GiB", value_parser = parse_session_bytes)]
    pub session_bytes_per_hour: usize,

    /// Members of this group (a name or a gid; besides root) are admins:
    /// their captures hold the whole host, and they may stop any capture and
    /// take or stop any continuous session. Any other local user captures
    /// only its own processes and acts only on what it started.
    #[arg(help_heading = LISTENING, long, value_name = "GROUP")]
    pub admin_group: Option<String>,

    /// What callers on other hosts that are not admins (--admin-client) may
    /// capture: refuse (nothing; their captures and sessions are refused
    /// with PERMISSION_DENIED) or host (the whole host: anyone who can reach
    /// --listen, so only on a network that trusted clients alone reach).
    #[arg(help_heading = LISTENING, long, value_name = "POLICY", value_enum, default_value_t = RemoteCallers::Refuse)]
    pub remote_callers: RemoteCallers,

    /// A client certificate name (its first URI name, such as a SPIFFE ID,
    /// else its first DNS name) whose bearer is an admin (repeatable);
    /// other certificate names act only on what they started. Needs
    /// --tls-client-ca, which verifies them.
    #[arg(help_heading = LISTENING, long = "admin-client", value_name = "NAME", requires = "tls_client_ca")]
    pub admin_clients: Vec<String>,

    /// Mode of the --listen-unix socket: 0600 (the agent's user; the
    /// default) or 0660 (also its group: --listen-unix-group, else the
    /// agent's own).
    #[arg(help_heading = LISTENING, long, value_name = "MODE", requires = "listen_unix", value_parser = parse_socket_mode)]
    pub listen_unix_mode: Option<u32>,

    /// Group of the --listen-unix socket (a name or a gid), set each time
    /// the agent makes it, before it is reachable: with
    /// --listen-unix-mode 0660, that group's members capture through it.
    #[arg(help_heading = LISTENING, long, value_name = "GROUP", requires = "listen_unix")]
    pub listen_unix_group: Option<String>,

    /// How long a gRPC connection is served before its client is asked to
    /// open a new one (HTTP/2 GOAWAY; gRPC clients move without failing a
    /// call): idle connections do not keep their places for good. Calls in
    /// progress on it still finish (at least 1s).
    #[arg(help_heading = LISTENING, long, allow_hyphen_values = true, value_name = "DURATION", default_value = "15m", value_parser = parse_connection_age)]
    pub max_connection_age: Duration,

    /// HTTP endpoint for probes and monitoring: /metrics (Prometheus),
    /// /healthz (liveness), /readyz (readiness); `off` for none. Default
    /// 127.0.0.1:6010, skipped with a warning when that port is taken; an
    /// address given here must be free. Metrics are not secret, so an
    /// address other hosts reach (0.0.0.0:6010, for a Prometheus elsewhere)
    /// needs no TLS, but tells whoever reaches it what this host's GPUs and
    /// the agent are doing.
    #[arg(help_heading = LISTENING, long, value_name = "ADDR|off")]
    pub metrics_listen: Option<MetricsListen>,

    /// Hosts a NewSession may make this agent call (repeatable): host[:port]
    /// glob patterns, e.g. `10.0.*:6009` or `*.cluster.local:*` (no port
    /// means 6009). Default: any host.
    #[arg(help_heading = CALLING, long = "session-hosts", value_name = "PATTERN", value_parser = parse_session_hosts)]
    pub session_hosts: Vec<HostPattern>,

    // --tls-ca, --tls-cert, --tls-key, --tls-domain, --max-reply-size: this
    // agent's certificate, and how it calls session hosts and upstreams.
    #[command(flatten, next_help_heading = CALLING)]
    pub client: super::client_args::ClientArgs,

    // --dns-server, --concurrent-hosts: how NewSession finds and calls hosts.
    #[command(flatten, next_help_heading = CALLING)]
    pub fleet: super::fleet_args::FleetArgs,
}

/// Kernel hooks of the eBPF backend.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum EbpfHook {
    /// Scheduler switches, wakeups, exec and exit: the /host:CPUs plane.
    Sched,
    /// Uprobes on the CUDA driver library's entry points.
    Cuda,
}

/// The agent's configuration from the flags (the flight recorder's size is
/// set once the budgets are sized; the eBPF cgroup once
/// [`ebpf_cgroup_id`] found it).
pub(super) fn agent_config(args: &ServeArgs) -> AgentConfig {
    AgentConfig {
        backends: args.backends.clone(),
        mock: MockConfig {
            seed: args.mock_seed,
            events_per_second: args.mock_rate,
            gpus: args.mock_gpus,
            slow_step_after: args.mock_slow_step,
            utilization_dip: args.mock_utilization_dip,
            uid: args.mock_uid,
        },
        nvml: crate::backend::nvml::NvmlConfig {
            library: args.nvml_library.clone(),
            interval: args.nvml_interval,
            idle_interval: args.nvml_idle_interval,
        },
        tpu: match &args.tpu_library {
            Some(library) => crate::backend::tpu::TpuConfig {
                library: library.clone(),
            },
            None => crate::backend::tpu::TpuConfig::default(),
        },
        perf: crate::backend::perf::PerfConfig {
            interval: args.perf_interval,
            pids: args.perf_pids.clone(),
            ..Default::default()
        },
        ebpf: EbpfConfig {
            sched: args.ebpf_hooks.contains(&EbpfHook::Sched),
            cuda: args.ebpf_hooks.contains(&EbpfHook::Cuda),
            cuda_returns: args.ebpf_cuda_returns,
            attach: args.ebpf_attach,
            pids: args.ebpf_pids.clone(),
            comm: args.ebpf_comm.clone(),
            cuda_libraries: args.cuda_libraries.clone(),
            probe_alone_max: args.ebpf_probe_alone_max,
            ring_bytes: args.ebpf_ring_size,
            ..EbpfConfig::default()
        },
        cuda: crate::backend::cuda::CudaConfig {
            runtime_dir: args.runtime_dir.clone(),
            api_records: args.cuda_api_records,
            record: args.cuda_record,
            ..Default::default()
        },
        store: StoreConfig {
            retention: args.store_retention,
            max_bytes: 0,
        },
        ring_capacity: args.ring_capacity,
        drop_policy: args.drop_policy.into(),
        ..AgentConfig::default()
    }
}

/// The id of the cgroup `--ebpf-cgroup` names (the inode of its
/// directory), if it names one.
pub(super) fn ebpf_cgroup_id(args: &ServeArgs) -> anyhow::Result<Option<u64>> {
    args.ebpf_cgroup
        .as_ref()
        .map(|dir| cgroup_id(dir).with_context(|| format!("--ebpf-cgroup {}", dir.display())))
        .transpose()
}

/// The memory budgets `serve` runs with, sized inside the limit this
/// process runs under, beside the rings `config` makes.
pub(super) fn memory_budgets(
    args: &ServeArgs,
    config: &AgentConfig,
) -> Result<super::memory::Budgets, String> {
    let ring_bytes = crate::ring::RingLayout {
        lanes: config.ring_lanes,
        capacity: config.ring_capacity.next_power_of_two(),
    }
    .total_size()
    .map_or(u64::MAX, |bytes| bytes as u64)
    .saturating_add(bpf_ring_bytes(config));
    super::memory::size(
        crate::model::memory_limit::of_this_process(),
        ring_bytes,
        crate::service::request_bodies::BODY_MEMORY as u64,
        args.store_size,
        args.capture_memory,
    )
}

/// What the eBPF backend's ring buffers take when it may start: one of
/// --ebpf-ring-size per hook, memory the kernel charges to the agent's
/// cgroup.
fn bpf_ring_bytes(config: &AgentConfig) -> u64 {
    let may_start = config
        .backends
        .iter()
        .any(|choice| matches!(choice, BackendChoice::Auto | BackendChoice::Ebpf));
    if !may_start {
        return 0;
    }
    let hooks = u64::from(config.ebpf.sched) + u64::from(config.ebpf.cuda);
    hooks * u64::from(config.ebpf.ring_bytes)
}

/// Where traces that outgrow their share of capture memory are spilled, as
/// the flags say: a --spill-dir that cannot take them stops the agent; the
/// default directory only turns spilling off, saying why.
fn spill_space(args: &ServeArgs) -> anyhow::Result<Option<Arc<SpillSpace>>> {
    let super::memory::SpillSize::Bytes(limit) = args.spill_size else {
        info!("spilling is off (--spill-size off): a trace larger than its share of --capture-memory is refused");
        return Ok(None);
    };
    let space = match &args.spill_dir {
        Some(dir) => SpillSpace::new(dir, limit).map_err(anyhow::Error::msg)?,
        None => match SpillSpace::new(&std::env::temp_dir(), limit) {
            Ok(space) => space,
            Err(why) => {
                info!("spilling is off: {why}");
                return Ok(None);
            }
        },
    };
    info!(
        "traces larger than their share of --capture-memory spill to {} (at most {} at once, --spill-size)",
        space.dir().display(),
        super::memory::mib(space.limit() as u64)
    );
    Ok(Some(Arc::new(space)))
}

/// What `--cuda-attach` attaches with; fails without an injection
/// library to load.
fn attach_config(args: &ServeArgs) -> anyhow::Result<crate::attach::AttachConfig> {
    let config = crate::attach::AttachConfig::for_runtime(
        args.runtime_dir.clone(),
        args.inject_library.clone(),
    );
    if !config.library.is_file() {
        anyhow::bail!(
            "--cuda-attach: no injection library at {} (--inject-library names it)",
            config.library.display()
        );
    }
    Ok(config)
}

/// Where traces that cannot be written or uploaded are kept
/// (`--unsent-dir`, else the temporary directory).
fn unsent_dir(args: &ServeArgs) -> PathBuf {
    args.unsent_dir.clone().unwrap_or_else(std::env::temp_dir)
}

/// The gid of the group `flag` names, if it names one.
fn named_group(flag: &str, name: Option<&str>) -> Result<Option<u32>, String> {
    name.map(|group| crate::service::access::group_id(flag, group))
        .transpose()
}

/// Why `serve` with these flags would stop as it starts, found without
/// starting anything (for `devtrace doctor`, which must not claim ready
/// what serve refuses): the checks serve itself makes of its client TLS,
/// its --spill-dir, --cuda-attach's library, where triggers save,
/// --ebpf-cgroup, --admin-group and --listen-unix-group.
pub(super) fn refusals(args: &ServeArgs) -> Vec<String> {
    let mut refusals = Vec::new();
    if let Err(error) = ebpf_cgroup_id(args) {
        refusals.push(super::failure_text(&error));
    }
    if let Err(error) = args.client.config() {
        refusals.push(super::failure_text(&error));
    }
    for (flag, group) in [
        ("--admin-group", &args.admin_group),
        ("--listen-unix-group", &args.listen_unix_group),
    ] {
        if let Err(why) = named_group(flag, group.as_deref()) {
            refusals.push(why);
        }
    }
    if let (Some(dir), super::memory::SpillSize::Bytes(limit)) = (&args.spill_dir, args.spill_size)
    {
        if let Err(why) = SpillSpace::new(dir, limit) {
            refusals.push(why);
        }
    }
    if !args.cuda_attach.is_empty() {
        if let Err(error) = attach_config(args) {
            refusals.push(super::failure_text(&error));
        }
    }
    // Addresses as given (a host name is resolved only when bound).
    if let Ok(address) = args.listen.parse::<std::net::SocketAddr>() {
        refusals.extend(plaintext_beyond_this_host(args, address.ip()));
    }
    if let Some(MetricsListen::At(metrics)) = &args.metrics_listen {
        if *metrics == args.listen && !metrics.ends_with(":0") {
            refusals.push(format!(
                "--listen and --metrics-listen are both {metrics}: one address serves one of them"
            ));
        }
    }
    if let Some(repository) = args
        .trigger_repository
        .as_ref()
        .filter(|_| !args.triggers.is_empty())
    {
        let inside = repository
            .to_str()
            .is_some_and(|path| crate::repository::roots::lies_in(&args.allow_roots, path));
        if !inside {
            refusals.push(format!(
                "--trigger-repository {} must lie inside an --allow-root",
                repository.display()
            ));
        }
    }
    refusals
}

/// Why serving plaintext on `ip` is refused: other hosts can reach it and
/// neither TLS nor `--insecure` was given.
fn plaintext_beyond_this_host(args: &ServeArgs, ip: std::net::IpAddr) -> Option<String> {
    let tls = args.client.tls_cert.is_some() && args.client.tls_key.is_some();
    (!tls && !args.insecure && !ip.is_loopback()).then(|| {
        format!(
            "--listen {} can be reached from other hosts and would serve plaintext: anyone \
             reaching it could capture and use --allow-root. Give --tls-cert and --tls-key (and \
             --tls-client-ca to require client certificates), or --insecure to serve plaintext \
             anyway on a network you trust",
            args.listen
        )
    })
}

/// The thread that attaches to processes matching `--cuda-attach`, if any
/// rule is given.
fn start_attaching(args: &ServeArgs) -> anyhow::Result<Option<crate::attach::Watcher>> {
    if args.cuda_attach.is_empty() {
        return Ok(None);
    }
    let config = attach_config(args)?;
    let rules: Vec<String> = args.cuda_attach.iter().map(|r| r.to_string()).collect();
    info!(rules = %rules.join("; "), library = %config.library.display(), "attaching to CUDA processes that match --cuda-attach");
    let watcher = crate::attach::Watcher::start(args.cuda_attach.clone(), config)
        .context("starting the --cuda-attach thread")?;
    Ok(Some(watcher))
}

fn parse_trigger(text: &str) -> Result<Rule, String> {
    text.parse()
        .map_err(|e: crate::trigger::rule::RuleError| e.to_string())
}

fn parse_ring_size(text: &str) -> Result<u32, String> {
    let bytes = super::parse_size(text).map_err(|e| e.to_string())?;
    if !bytes.is_power_of_two() || !(4096..=1 << 30).contains(&bytes) {
        return Err(format!(
            "{bytes} bytes; a BPF ring buffer is a power of two from 4KiB to 1GiB"
        ));
    }
    Ok(bytes as u32)
}

fn parse_chunk_size(text: &str) -> Result<usize, String> {
    let bytes = super::parse_size(text).map_err(|e| e.to_string())?;
    if !(1 << 10..=i32::MAX as usize).contains(&bytes) {
        return Err(format!(
            "{bytes} bytes; chunking starts between 1KiB and 2GiB - 1 (one protobuf message)"
        ));
    }
    Ok(bytes)
}

fn parse_retention(text: &str) -> Result<Duration, String> {
    let duration = super::parse_duration(text).map_err(|e| e.to_string())?;
    at_least(duration, Duration::from_secs(1), "1s")
}

fn parse_connection_age(text: &str) -> Result<Duration, String> {
    let age = super::parse_duration(text).map_err(|e| e.to_string())?;
    if age < Duration::from_secs(1) {
        return Err(format!(
            "{age:?} is less than 1s: clients would reconnect for every call"
        ));
    }
    Ok(age)
}

fn parse_session_bytes(text: &str) -> Result<usize, String> {
    let bytes = crate::model::units::parse_size(text).map_err(|e| e.to_string())?;
    if bytes < 1 << 20 {
        return Err(format!("{bytes} bytes is less than 1MiB"));
    }
    Ok(bytes)
}

/// The longest window a request may ask for, and why it is less than
/// `--max-duration` asked, if it is: a window is built from the flight
/// recorder once it ends, so it may reach back no further than the recorder
/// keeps, less a margin for the build to begin ([`kept_window`]); the
/// default.
pub(super) fn window_limit(args: &ServeArgs) -> (Duration, Option<String>) {
    let kept = kept_window(args.store_retention);
    match args.max_duration {
        Some(asked) if asked > kept => (
            kept,
            Some(format!(
                "--max-duration {}s is longer than the flight recorder keeps whole to the \
                 trace's build (--store-retention {}s, less {}s): captures are held to {}s; \
                 raise --store-retention for longer ones",
                asked.as_secs_f64(),
                args.store_retention.as_secs_f64(),
                (args.store_retention - kept).as_secs_f64(),
                kept.as_secs_f64()
            )),
        ),
        Some(asked) => (asked, None),
        None => (kept, None),
    }
}

/// The longest window whose start the flight recorder, keeping
/// `retention`, still holds when the window's trace is built: a quarter of
/// the retention, at most 5 s, is left for the build to begin.
fn kept_window(retention: Duration) -> Duration {
    retention - (retention / 4).min(Duration::from_secs(5))
}

fn parse_max_duration(text: &str) -> Result<Duration, String> {
    let duration = super::parse_duration(text).map_err(|e| e.to_string())?;
    at_least(duration, Duration::from_millis(1), "1ms")
}

/// `value` when it is `minimum` or more; a flag below it would make every
/// capture empty or refused.
fn at_least<T: PartialOrd + std::fmt::Debug>(
    value: T,
    minimum: T,
    shown: &str,
) -> Result<T, String> {
    if value < minimum {
        return Err(format!(
            "{value:?} is less than {shown}, the least that lets captures hold anything"
        ));
    }
    Ok(value)
}

/// A host name names trace files: one path component.
fn parse_hostname(text: &str) -> Result<String, String> {
    if text.is_empty() || text == "." || text == ".." {
        return Err(format!("{text:?} cannot name a file"));
    }
    if text.contains('/') || text.chars().any(char::is_control) {
        return Err(format!(
            "{text:?} names trace files, so it has no '/' or control characters"
        ));
    }
    let longest = crate::xspace::chunks::LONGEST_HOST_PART;
    if text.len() > longest {
        return Err(format!(
            "{} bytes; a host name names files (<host>.xplane.riegeli), at most {longest} bytes",
            text.len()
        ));
    }
    Ok(text.to_string())
}

fn parse_comm(text: &str) -> Result<String, String> {
    if text.is_empty() {
        return Err("the prefix is empty".into());
    }
    if text.len() > 15 {
        return Err(format!(
            "{} bytes; the kernel keeps at most 15 bytes of a command name",
            text.len()
        ));
    }
    Ok(text.to_string())
}

fn parse_upstream(text: &str) -> Result<Target, String> {
    Target::tcp(text, client::DEFAULT_PORT).map_err(|e| e.to_string())
}

fn parse_session_hosts(text: &str) -> Result<HostPattern, String> {
    HostPattern::parse(text, client::DEFAULT_PORT).map_err(|e| e.to_string())
}

fn parse_socket_mode(text: &str) -> Result<u32, String> {
    match text.trim_start_matches('0') {
        "600" => Ok(0o600),
        "660" => Ok(0o660),
        _ => Err(format!("{text:?}: the socket's mode is 0600 or 0660")),
    }
}

pub fn run(args: ServeArgs) -> anyhow::Result<()> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .thread_name("devtrace-rpc")
        .build()
        .context("starting the async runtime")?;
    let served = runtime.block_on(serve(args));
    // What is left on the blocking pool was given up on by `serve` (and
    // named there): a stalled write must not hold the exit.
    runtime.shutdown_timeout(LEFT_WORK_AT_EXIT);
    served
}

/// How long the exit waits for blocking work no call waits for any more.
const LEFT_WORK_AT_EXIT: Duration = Duration::from_millis(500);

async fn serve(args: ServeArgs) -> anyhow::Result<()> {
    let (max_duration, held) = window_limit(&args);
    if let Some(held) = held {
        tracing::warn!("{held}");
    }
    let (listeners, placed_socket) = listen(&args).await?;
    // Up while the backends start, so that probes see the process alive.
    let telemetry = Telemetry::new();
    let metrics = crate::telemetry::http::start(args.metrics_listen.as_ref(), &telemetry).await?;
    let client_config = args.client.config()?;
    let allowed_roots = AllowedRoots::new(&args.allow_roots)
        .with_context(|| format!("preparing --allow-root {:?}", args.allow_roots))?;
    warn_of_unwritable_roots(&args.allow_roots);
    let mut config = agent_config(&args);
    config.ebpf.cgroup_id = ebpf_cgroup_id(&args)?;
    let budgets = memory_budgets(&args, &config).map_err(anyhow::Error::msg)?;
    info!("memory: {}", budgets.describe());
    if let Some(scant) = budgets.scant() {
        tracing::warn!("memory: {scant}");
    }
    telemetry.memory_budgets(budgets.limit.bytes, budgets.capture);
    let config = AgentConfig {
        store: StoreConfig {
            max_bytes: budgets.store,
            ..config.store
        },
        ..config
    };
    // Before the backends start (loading eBPF programs): a group that does
    // not exist stops the agent at once.
    let admin_group =
        named_group("--admin-group", args.admin_group.as_deref()).map_err(anyhow::Error::msg)?;
    let agent = Agent::start(&config).context("starting the agent")?;
    telemetry.agent_started(&agent);
    let _attacher = start_attaching(&args)?;
    let access = Access::new(admin_group, args.admin_clients.clone())
        .with_remote_callers(args.remote_callers);
    let trigger_access = access.clone();
    let service = Arc::new(ProfilerService::new(
        Arc::clone(&agent),
        ServiceConfig {
            max_duration,
            allowed_roots: allowed_roots.clone(),
            hostname: args.hostname.clone().unwrap_or_else(local_hostname),
            upstreams: args.upstreams.clone(),
            client: client_config.clone(),
            telemetry: Arc::clone(&telemetry),
            chunk_traces_over: args.chunk_traces_over,
            capture_memory: budgets.capture,
            spill: spill_space(&args)?,
            continuous_timeout: args.continuous_timeout,
            captures_per_caller: usize::from(args.captures_per_caller),
            access: access.clone(),
            attach: Some(crate::attach::AttachConfig::for_runtime(
                args.runtime_dir.clone(),
                args.inject_library.clone(),
            )),
            ..ServiceConfig::default()
        },
    ));
    let analysis = Arc::new(ProfileAnalysisService::new(AnalysisConfig {
        allowed_roots: allowed_roots.clone(),
        max_duration,
        default_port: client::DEFAULT_PORT,
        client: client_config,
        session_hosts: SessionHosts::new(args.session_hosts.clone()),
        unsent_dir: unsent_dir(&args),
        resolver: Arc::new(args.fleet.resolver()),
        concurrent_hosts: args.fleet.concurrent_hosts,
        memory: Some(service.captures().memory()),
        access,
        session_bytes: Arc::new(SessionBytes::new(
            args.session_bytes as u64,
            args.session_bytes_per_hour as u64,
        )),
    }));
    let triggers = start_triggers(&args, &agent, &service, &allowed_roots)?;
    if let Some(triggers) = &triggers {
        telemetry.triggers_started(triggers);
    }
    let trigger_service = Arc::new(TriggerService::new(triggers.clone(), trigger_access));
    // Where clients reach it: the TCP address, or the socket with --listen off.
    let address = match &listeners.tcp {
        Some(tcp) => tcp
            .local_addr()
            .context("reading the bound address")?
            .to_string(),
        None => format!(
            "unix:{}",
            args.listen_unix
                .as_ref()
                .map(|path| path.display().to_string())
                .unwrap_or_default()
        ),
    };
    for (name, health) in agent.backend_health() {
        info!(backend = name, %health, "backend");
    }
    if allowed_roots.is_empty() {
        info!("no --allow-root: traces are returned to the client, never written here");
    } else {
        info!(roots = ?allowed_roots.roots(), "traces may be written under these roots");
    }
    // Before the address is announced: a busy tap address fails first.
    let taps = super::tap::bind_taps(&agent, &args.taps).await?;
    let placed_socket = Arc::new(placed_socket);
    let shutdown = stop_on_signal(
        Arc::clone(&agent),
        triggers.clone(),
        Arc::clone(&placed_socket),
    );
    // Scripts and tests read the bound address (useful with port 0) from stdout.
    super::announce(&format!("devtrace listening on {address}"));
    let tap_stop = tokio_util::sync::CancellationToken::new();
    let tap_recorder = match taps {
        Some(taps) => Some(super::tap::start_taps(taps, Some(&telemetry), &tap_stop)?),
        None => None,
    };
    if let Some(address) = metrics {
        // After the lines above, which scripts read first.
        super::announce(&format!("devtrace metrics on http://{address}"));
        info!("metrics on http://{address}/metrics, probes on /healthz and /readyz");
    }
    let scheme = match (&listeners.tcp, &listeners.tls) {
        (None, _) => "",
        (Some(_), Some(_)) => "grpcs://",
        (Some(_), None) => "grpc://",
    };
    info!("capture with: devtrace capture {scheme}{address} --logdir DIR");
    if let Some(path) = &args.listen_unix {
        info!(socket = %path.display(), "also serving on a UNIX socket");
    }
    let served =
        crate::service::serve(listeners, service, analysis, trigger_service, shutdown).await;
    if let Some(socket) = placed_socket.as_ref() {
        socket.remove_if_ours();
    }
    served?;
    info!("shutting down");
    let deadline = tokio::time::Instant::now() + STOP_GRACE;
    tap_stop.cancel();
    if let Some(triggers) = &triggers {
        triggers.finish(deadline).await;
    }
    if let Some(recorder) = &tap_recorder {
        super::tap::drain_taps(recorder, deadline, std::future::pending()).await;
    }
    wait_for_work(deadline).await;
    agent.shutdown();
    Ok(())
}

/// How long a stopping agent waits, once the calls in progress have ended,
/// for trigger saves, calls its taps forward and trace writes still under
/// way (writes whose client gave up go on): a firing just before the stop
/// is saved once its `after`
/// has passed (2 s by default), within what service managers allow a stop.
const STOP_GRACE: Duration = Duration::from_secs(10);

/// Waits for the work still under way (trace writes, attaches) until
/// `deadline`, saying what it waits for, and names what it stops without:
/// those traces are lost (a file half written is cleared by the next agent
/// to write there; an upload not finished leaves nothing).
async fn wait_for_work(deadline: tokio::time::Instant) {
    use crate::model::under_way;
    let under_way = under_way::under_way();
    if under_way.is_empty() {
        return;
    }
    info!(
        work = ?under_way,
        "waiting at most {:.1} s for the work still under way",
        deadline
            .saturating_duration_since(tokio::time::Instant::now())
            .as_secs_f64()
    );
    let left = under_way::settled_by(deadline).await;
    if !left.is_empty() {
        tracing::warn!(
            work = ?left,
            "stopping without the work still under way (a stalled disk or bucket, or a process \
             that does not let an attach finish): what it was writing is lost, and a process \
             being attached is let go as the agent exits"
        );
    }
}

/// Says at start which local --allow-root this user cannot write (a
/// read-only mount, another user's directory), rather than at the first
/// capture asked to write there; a bucket is not contacted here.
fn warn_of_unwritable_roots(roots: &[PathBuf]) {
    for root in roots
        .iter()
        .filter(|root| matches!(Location::parse(root), Ok(Location::Local(_))))
    {
        let (existing, writable) = crate::model::filesystem::writable_part(root);
        if !writable {
            tracing::warn!(
                "--allow-root {}: {} is not writable by this user: captures asked to write \
                 there will fail (`devtrace doctor` checks it)",
                root.display(),
                existing.display()
            );
        }
    }
}

/// Arms the `--trigger` rules, saving into `--trigger-repository`; none
/// without rules.
fn start_triggers(
    args: &ServeArgs,
    agent: &Arc<Agent>,
    service: &Arc<ProfilerService>,
    allowed_roots: &AllowedRoots,
) -> anyhow::Result<Option<Arc<Triggers>>> {
    if args.triggers.is_empty() {
        return Ok(None);
    }
    // Made a usage error by the parser; kept for callers that build the
    // arguments themselves.
    let Some(repository) = &args.trigger_repository else {
        bail!("--trigger needs --trigger-repository, the directory or bucket prefix its sessions go to");
    };
    let shown = repository.display();
    let folder = repository
        .to_str()
        .context("--trigger-repository is not UTF-8")
        .and_then(|path| Ok(allowed_roots.confine(path)?))
        .with_context(|| format!("--trigger-repository {shown} must lie inside an --allow-root"))?;
    // A logdir's sessions are in its plugins/profile: saves made into the
    // logdir itself are listed by neither XProf nor `devtrace sessions` once
    // the logdir has a plugins/profile.
    if !Location::parse(repository)
        .is_ok_and(|location| super::logdir::is_plugins_profile(&location))
    {
        tracing::warn!(
            "--trigger-repository {shown} is not a logdir's plugins/profile: XProf and `devtrace \
             sessions` pointed at a logdir list only the sessions in its plugins/profile \
             (give LOGDIR/plugins/profile)"
        );
    }
    for (index, rule) in args.triggers.iter().enumerate() {
        if args.triggers[..index].iter().any(|r| r.name == rule.name) {
            bail!("--trigger {rule}: another rule is named {:?}", rule.name);
        }
        // The session is built once `after` has passed: its window's start
        // is then `before + after` old, and must still be held as the
        // build begins, as a capture's must.
        let reach = rule.before.saturating_add(rule.after);
        let kept = kept_window(args.store_retention);
        if reach > kept {
            bail!(
                "--trigger {rule}: before={}s and after={}s reach {}s back when the session is \
                 saved, past what the flight recorder holds then (--store-retention {}s, less \
                 {}s for the trace's build): shorten them or raise --store-retention",
                rule.before.as_secs_f64(),
                rule.after.as_secs_f64(),
                reach.as_secs_f64(),
                args.store_retention.as_secs_f64(),
                (args.store_retention - kept).as_secs_f64(),
            );
        }
    }
    let triggers = Triggers::start(
        args.triggers.clone(),
        agent,
        Arc::clone(service.captures()),
        folder,
        unsent_dir(args),
    )
    .context("starting the trigger watcher")?;
    // Said now, not at the first firing (a read-only mount, a directory of
    // another user's), as each firing's reply says it too.
    if let Some(why) = triggers.unwritable_repository() {
        tracing::warn!("--trigger-repository {shown}: {why}");
    }
    for rule in &args.triggers {
        info!(rule = %rule, repository = %shown, "trigger armed");
    }
    Ok(Some(triggers))
}

/// Binds `--listen` (refusing plaintext other hosts could reach, unless
/// `--insecure`) and `--listen-unix`, with the server's TLS when asked for;
/// with the socket put in place for `--listen-unix`, to remove at exit.
async fn listen(args: &ServeArgs) -> anyhow::Result<(Listeners, Option<PlacedSocket>)> {
    // The UNIX socket is plaintext: with no TCP listener the certificate is
    // this agent's as a client alone.
    let tls = match (&args.client.tls_cert, &args.client.tls_key) {
        (Some(cert), Some(key)) if args.listen != "off" => Some(
            crate::protocol::tls::server_config(cert, key, args.tls_client_ca.as_deref())
                .context("loading the TLS files of --tls-cert/--tls-key/--tls-client-ca")?,
        ),
        _ => None,
    };
    // `off` comes with --listen-unix: the parser requires it.
    let tcp = if args.listen == "off" {
        None
    } else {
        let tcp = tokio::net::TcpListener::bind(&args.listen)
            .await
            .with_context(|| format!("cannot listen on {}", args.listen))?;
        let address = tcp.local_addr().context("reading the bound address")?;
        if let Some(why) = plaintext_beyond_this_host(args, address.ip()) {
            bail!(why);
        }
        Some(tcp)
    };
    let (unix, placed) = match &args.listen_unix {
        Some(path) => {
            let group = named_group("--listen-unix-group", args.listen_unix_group.as_deref())
                .map_err(anyhow::Error::msg)?;
            let mode = args.listen_unix_mode.unwrap_or(0o600);
            let (listener, placed) = bind_unix(path, mode, group)?;
            (Some(listener), Some(placed))
        }
        None => (None, None),
    };
    let listeners = Listeners {
        tcp,
        tls,
        unix,
        max_connection_age: args.max_connection_age,
    };
    Ok((listeners, placed))
}

/// A UNIX socket at `path` with `mode`, never reachable with a wider mode:
/// it is bound in a private directory, given its mode, then moved into
/// place, replacing a stale socket, never another kind of file nor a
/// socket another server accepts connections on.
fn bind_unix(
    path: &std::path::Path,
    mode: u32,
    group: Option<u32>,
) -> anyhow::Result<(tokio::net::UnixListener, PlacedSocket)> {
    use std::os::unix::fs::PermissionsExt;
    let shown = path.display();
    let occupant = unix_socket::occupant(path);
    match occupant {
        Occupant::NotASocket => {
            bail!("--listen-unix {shown}: a file that is not a socket is already there")
        }
        Occupant::Listening => bail!(
            "--listen-unix {shown}: another server accepts connections on it (another devtrace \
             agent?): stop it, or choose another path"
        ),
        Occupant::Unknown => bail!(
            "--listen-unix {shown}: a socket is there that this agent cannot connect to (another \
             user's?): remove it if no server uses it, or choose another path"
        ),
        Occupant::Nothing | Occupant::Stale => {}
    }
    let over_stale = occupant == Occupant::Stale;
    let parent = path
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(std::path::Path::new("."));
    let private = tempfile::Builder::new()
        .prefix(".devtrace-socket.")
        .tempdir_in(parent)
        .with_context(|| format!("--listen-unix {shown}: preparing the socket"))?;
    let staged = private.path().join("socket");
    let listener = std::os::unix::net::UnixListener::bind(&staged)
        .with_context(|| format!("--listen-unix {shown}: binding"))?;
    if let Some(gid) = group {
        std::os::unix::fs::chown(&staged, None, Some(gid)).with_context(|| {
            format!(
                "--listen-unix-group {gid}: the agent's user may not give the socket that group \
                 (root may, or a member of the group)"
            )
        })?;
    }
    let placed = std::fs::set_permissions(&staged, std::fs::Permissions::from_mode(mode))
        .and_then(|()| unix_socket::put_in_place(&staged, path, over_stale))
        .and_then(|()| listener.set_nonblocking(true))
        .and_then(|()| PlacedSocket::at(path))
        .with_context(|| format!("--listen-unix {shown}: putting the socket in place"))?;
    let listener = tokio::net::UnixListener::from_std(listener)
        .with_context(|| format!("--listen-unix {shown}: listening"))?;
    Ok((listener, placed))
}

/// `--listen`: an address, or `off`.
fn parse_listen(text: &str) -> Result<String, String> {
    if text != "off" {
        crate::protocol::listen::check_listen_address(text)?;
    }
    Ok(text.to_string())
}

/// Resolves at the first SIGINT, SIGTERM or SIGHUP, which lets the calls
/// and trigger saves in progress end (saying so at once, so that a stop
/// that waits for a capture is not taken for a hang); another one, a second
/// or more later, stops the agent at once, losing them. (One sooner is the
/// same request delivered twice: a terminal's Ctrl-C reaches a wrapper
/// script too, which may pass it on as SIGTERM.)
fn stop_on_signal(
    agent: Arc<Agent>,
    triggers: Option<Arc<Triggers>>,
    socket: Arc<Option<PlacedSocket>>,
) -> impl std::future::Future<Output = ()> {
    let first = shutdown_signal();
    async move {
        first.await;
        let asked_at = std::time::Instant::now();
        let trigger_saves = triggers.as_ref().map_or(0, |t| t.saves_in_progress());
        info!(
            captures = agent.captures_in_progress(),
            trigger_saves,
            "stopping once the calls and trigger saves in progress end; another stop signal \
             (Ctrl-C, SIGTERM, SIGHUP), a second or more from now, stops at once and loses them"
        );
        tokio::spawn(async move {
            loop {
                shutdown_signal().await;
                if asked_at.elapsed() >= SECOND_STOP_AFTER {
                    break;
                }
            }
            tracing::warn!(
                "stopping now: the calls, trigger saves and writes still in progress are lost"
            );
            if let Some(socket) = socket.as_ref() {
                socket.remove_if_ours();
            }
            std::process::exit(130);
        });
    }
}

/// How long after the first stop signal another one means "now".
const SECOND_STOP_AFTER: Duration = Duration::from_secs(1);

/// Resolves at SIGINT, SIGTERM or SIGHUP. SIGHUP stops cleanly too: there
/// is no configuration to reload, and its default action would end the
/// agent on the spot, losing the captures in flight without a word; but
/// an agent started ignoring it (`nohup`) goes on ignoring it.
pub(super) fn shutdown_signal() -> impl std::future::Future<Output = ()> {
    // Registered now, not when first polled: a SIGTERM right after the
    // agent says it listens must stop it cleanly, not kill it.
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        let mut interrupt = signal(SignalKind::interrupt()).ok();
        let mut terminate = signal(SignalKind::terminate()).ok();
        let mut hangup = (!hangup_ignored())
            .then(|| signal(SignalKind::hangup()).ok())
            .flatten();
        async move {
            tokio::select! {
                _ = next_signal(&mut interrupt) => {}
                _ = next_signal(&mut terminate) => {}
                _ = next_signal(&mut hangup) => {}
            }
        }
    }
    #[cfg(not(unix))]
    async {
        let _ = tokio::signal::ctrl_c().await;
    }
}

/// Whether this process was started with SIGHUP ignored (`nohup`), as
/// found before this process handles it itself.
#[cfg(unix)]
fn hangup_ignored() -> bool {
    static IGNORED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *IGNORED.get_or_init(|| {
        // SAFETY: reads the disposition only (no new action is given), into
        // a zeroed struct of the right type.
        unsafe {
            let mut current: libc::sigaction = std::mem::zeroed();
            libc::sigaction(libc::SIGHUP, std::ptr::null(), &mut current) == 0
                && current.sa_sigaction == libc::SIG_IGN
        }
    })
}

/// The next delivery of `signal`; never, where it could not be registered.
#[cfg(unix)]
pub(super) async fn next_signal(signal: &mut Option<tokio::signal::unix::Signal>) {
    match signal {
        Some(signal) => {
            signal.recv().await;
        }
        None => std::future::pending().await,
    }
}

/// `--drop-policy`: the ring's [`DropPolicy`], named on the command line.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum DropPolicyArg {
    /// Keep what is already queued; refuse the new event.
    DropNewest,
    /// Keep the new event; overwrite the oldest unread one.
    DropOldest,
}

impl From<DropPolicyArg> for DropPolicy {
    fn from(arg: DropPolicyArg) -> DropPolicy {
        match arg {
            DropPolicyArg::DropNewest => DropPolicy::DropNewest,
            DropPolicyArg::DropOldest => DropPolicy::DropOldest,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bpf_ring_buffers_count_only_when_the_ebpf_backend_may_start() {
        let with = |backends: Vec<BackendChoice>, sched: bool, cuda: bool| {
            bpf_ring_bytes(&AgentConfig {
                backends,
                ebpf: EbpfConfig {
                    sched,
                    cuda,
                    ring_bytes: 4 << 20,
                    ..EbpfConfig::default()
                },
                ..AgentConfig::default()
            })
        };
        assert_eq!(with(vec![BackendChoice::Auto], true, true), 8 << 20);
        assert_eq!(with(vec![BackendChoice::Ebpf], true, false), 4 << 20);
        assert_eq!(with(vec![BackendChoice::Mock], true, true), 0);
        assert_eq!(
            with(vec![BackendChoice::Nvml, BackendChoice::Cuda], true, true),
            0
        );
    }
}
