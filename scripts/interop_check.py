#!/usr/bin/env python3
"""Interop check: the UNMODIFIED TensorFlow profiler client and XProf converters vs devtrace.

Run through scripts/interop (which provides a venv with tensorflow-cpu==2.21.0,
xprof==2.24.2 and grpcio-health-checking), or directly with such a venv's python:

    python scripts/interop_check.py --bin target/debug/devtrace   # the agent (mock backend)
    python scripts/interop_check.py --tf-server                   # TensorFlow's own profiler server

Each check is a named test function. The last line printed is `N passed, M failed`;
the exit status is 0 only when nothing failed.

Modes:
  agent       `<bin> serve --listen 127.0.0.1:<port> --backend mock --metrics-listen ...`. The
              agent is expected to return the XSpace as ProfileResponse.tool_data "xplane.pb"
              so that the client writes it; GPU planes, kernels and GPU allocators are
              expected; grpcio's health client gets SERVING. A second agent with a low
              --chunk-traces-over checks traces stored as .xplane.riegeli chunks.
  tf-server   a subprocess running a small Keras training loop with
              tf.profiler.experimental.server.start(port) (the server writes the file itself;
              no GPU plane; Monitor answers UNIMPLEMENTED). Used to validate this harness.
"""

import argparse
import collections
import faulthandler
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
SESSION_RE = re.compile(r"^\d{4}_\d{2}_\d{2}_\d{2}_\d{2}_\d{2}$")
TRACE_DURATION_MS = 2000
CONVERT_TIMEOUT_S = 300
# Per TF client call: 3 attempts x max(60 s, 2 x duration) deadline, plus slack.
TRACE_TIMEOUT_S = 3 * 60 + 60
MONITOR_TIMEOUT_S = 60
GLOBAL_TIMEOUT_S = 1500

# ---------------------------------------------------------------------------------------
# TensorFlow's own profiler server, run as a subprocess in --tf-server mode.
TF_SERVER_CODE = r"""
import sys, time
import tensorflow as tf
port = int(sys.argv[1])
model = tf.keras.Sequential([tf.keras.Input(shape=(32,)),
                             tf.keras.layers.Dense(64, activation="relu"),
                             tf.keras.layers.Dense(10)])
opt = tf.keras.optimizers.SGD(0.01)
loss_fn = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)
x = tf.random.normal([128, 32])
y = tf.random.uniform([128], 0, 10, dtype=tf.int32)

@tf.function
def step(x, y):
    with tf.GradientTape() as tape:
        loss = loss_fn(y, model(x))
    grads = tape.gradient(loss, model.trainable_variables)
    opt.apply_gradients(zip(grads, model.trainable_variables))
    return loss

step(x, y)  # trace/compile before the server starts listening
tf.profiler.experimental.server.start(port)
print("tf profiler server listening on", port, flush=True)
i = 0
while True:
    with tf.profiler.experimental.Trace("train", step_num=i, _r=1):
        step(x, y)
    i += 1
    time.sleep(0.002)
"""


# ---------------------------------------------------------------------------------------
# Small helpers


class SkipTest(Exception):
    pass


class CheckFailed(AssertionError):
    pass


def check(cond, msg):
    if not cond:
        raise CheckFailed(msg)


def short(obj, limit=600):
    s = obj if isinstance(obj, str) else repr(obj)
    return s if len(s) <= limit else s[:limit] + "... (%d chars)" % len(s)


def tail(path, n=40):
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        return "<cannot read %s: %s>" % (path, e)
    lines = data.decode("utf-8", "replace").splitlines()
    return "\n".join(lines[-n:]) if lines else "<empty>"


def list_files(root):
    out = []
    for dirpath, _, files in os.walk(root):
        for name in files:
            full = os.path.join(dirpath, name)
            out.append((os.path.relpath(full, root), os.path.getsize(full)))
    return sorted(out)


def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_open(port):
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return False


def _set_pdeathsig():
    # Runs in the child before exec: die with the harness, whatever happens to it.
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
    except Exception:
        pass


def call_with_timeout(fn, timeout_s, what):
    """Runs fn() in a daemon thread; raises CheckFailed if it does not return in time."""
    box = {}

    def run():
        try:
            box["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - reported to the caller
            box["error"] = e

    t = threading.Thread(target=run, name=what, daemon=True)
    t.start()
    t.join(timeout_s)
    if t.is_alive():
        raise CheckFailed("%s did not return within %d s" % (what, timeout_s))
    if "error" in box:
        raise box["error"]
    return box.get("value")


# ---------------------------------------------------------------------------------------
# XProf conversion, isolated in a child process (a converter crash must not kill the run).


def convert_worker(argv):
    """`--convert-worker tool_names|TOOL XPLANE OUT`: writes the tool output to OUT."""
    tool, xplane, out = argv
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    from xprof.convert import raw_to_tool_data as r2t

    if tool == "tool_names":
        names = r2t.xspace_to_tool_names([xplane])
        with open(out, "w") as f:
            json.dump(names, f)
        return 0
    data, content_type = r2t.xspace_to_tool_data([xplane], tool, {})
    meta = {"content_type": content_type, "type": type(data).__name__, "none": data is None}
    with open(out, "wb") as f:
        if isinstance(data, str):
            f.write(data.encode("utf-8"))
        elif data is not None:
            f.write(bytes(data))
    with open(out + ".meta", "w") as f:
        json.dump(meta, f)
    return 0


class Converter:
    def __init__(self, workdir):
        self.workdir = workdir
        self.xplane = None
        self.cache = {}
        self.seconds = {}

    def _run(self, tool):
        if self.xplane is None:
            raise CheckFailed("no xplane.pb to convert (an earlier trace check failed)")
        if tool in self.cache:
            return self.cache[tool]
        safe = re.sub(r"[^A-Za-z0-9_]", "_", tool)
        out = os.path.join(self.workdir, "tool_%s.out" % safe)
        log = os.path.join(self.workdir, "tool_%s.log" % safe)
        cmd = [sys.executable, os.path.abspath(__file__), "--convert-worker", tool, self.xplane, out]
        t0 = time.monotonic()
        with open(log, "wb") as logf:
            try:
                rc = subprocess.run(cmd, stdout=logf, stderr=subprocess.STDOUT,
                                    timeout=CONVERT_TIMEOUT_S).returncode
            except subprocess.TimeoutExpired:
                raise CheckFailed("converter %r timed out after %d s; log tail:\n%s"
                                  % (tool, CONVERT_TIMEOUT_S, tail(log)))
        self.seconds[tool] = time.monotonic() - t0
        if rc != 0:
            how = ("killed by signal %d" % -rc) if rc < 0 else ("exit %d" % rc)
            raise CheckFailed("converter %r failed (%s); log tail:\n%s" % (tool, how, tail(log)))
        if tool == "tool_names":
            with open(out) as f:
                result = json.load(f)
        else:
            with open(out + ".meta") as f:
                meta = json.load(f)
            with open(out, "rb") as f:
                data = f.read()
            if meta["none"]:
                raise CheckFailed("converter %r returned no data (None; success=false); log tail:\n%s"
                                  % (tool, tail(log)))
            result = (data, meta)
        self.cache[tool] = result
        return result

    def tool_names(self):
        return self._run("tool_names")

    def tool_json(self, tool):
        data, meta = self._run(tool)
        check(len(data) > 0, "%s output is empty (content type %s)" % (tool, meta["content_type"]))
        try:
            return json.loads(data)
        except ValueError as e:
            raise CheckFailed("%s output (%d bytes) is not JSON: %s; starts with %s"
                              % (tool, len(data), e, short(data[:300])))


# ---------------------------------------------------------------------------------------
# The run: server process, shared state, test functions


class Run:
    def __init__(self, args):
        self.args = args
        self.mode = args.mode
        self.workdir = tempfile.mkdtemp(prefix="devtrace-interop-")
        self.port = free_port()
        self.addr = "127.0.0.1:%d" % self.port
        self.metrics_addr = "127.0.0.1:%d" % free_port()
        self.server_log = os.path.join(self.workdir, "server.log")
        self.proc = None
        self.tf = None
        self.xplane_path = None  # the file the first trace produced
        self.conv = Converter(self.workdir)
        self.notes = []
        self.timings = collections.OrderedDict()
        self.tf_trace = None  # (logdir, session, host, path) from TF's own server
        self.tap = None  # the tf.distribute.Server and the agent tapping it (test_tap_*)
        self.extra_procs = []

    @property
    def expects_gpu(self):
        return self.mode == "agent"

    @property
    def expects_sched(self):
        # As root the agent also runs its eBPF backend: a /host:CPUs plane.
        return self.mode == "agent" and os.geteuid() == 0

    # -- server process --------------------------------------------------------------
    def server_cmd(self):
        if self.mode == "tf-server":
            return [sys.executable, "-c", TF_SERVER_CODE, str(self.port)]
        cmd = [self.args.bin, "serve", "--listen", self.addr, "--backend", "mock",
               "--metrics-listen", self.metrics_addr]
        if self.expects_sched:
            cmd += ["--backend", "ebpf"]
        return cmd

    def start_server(self):
        env = dict(os.environ)
        if self.mode == "tf-server":
            # TF's CPU allocator only emits MemoryAllocation/MemoryDeallocation when it is a BFC.
            env["TF_CPU_ALLOCATOR_USE_BFC"] = "true"
            env.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")
        cmd = self.server_cmd()
        print("server: %s  (log: %s)" % (" ".join(cmd[:2] if self.mode == "tf-server" else cmd),
                                         self.server_log), flush=True)
        logf = open(self.server_log, "wb")
        try:
            self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=logf,
                                         stderr=subprocess.STDOUT, env=env,
                                         preexec_fn=_set_pdeathsig)
        finally:
            logf.close()

    def stop_server(self):
        for extra in self.extra_procs:
            if extra.poll() is None:
                extra.kill()
                extra.wait(5)
        self.extra_procs = []
        p, self.proc = self.proc, None
        if p is None or p.poll() is not None:
            return
        p.terminate()
        try:
            p.wait(5)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(5)

    def server_died_msg(self):
        return "server exited with status %s; log tail (%s):\n%s" % (
            self.proc.returncode, self.server_log, tail(self.server_log))

    # -- TF client -----------------------------------------------------------------------
    def import_tf(self):
        if self.tf is None:
            os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")
            import tensorflow as tf  # noqa: PLC0415 - slow; imported while the server starts

            self.tf = tf
        return self.tf

    def trace(self, logdir, duration_ms, options=None):
        tf = self.import_tf()
        t0 = time.monotonic()
        try:
            call_with_timeout(
                lambda: tf.profiler.experimental.client.trace(
                    "grpc://" + self.addr, logdir, duration_ms, options=options),
                TRACE_TIMEOUT_S, "client.trace")
        except CheckFailed:
            raise
        except Exception as e:
            raise CheckFailed("client.trace raised %s: %s\nfiles in logdir: %s\n%s"
                              % (type(e).__name__, e, list_files(logdir), self.server_state()))
        return time.monotonic() - t0

    def server_state(self):
        if self.proc is not None and self.proc.poll() is not None:
            return self.server_died_msg()
        return "server still running; log tail (%s):\n%s" % (self.server_log, tail(self.server_log, 15))


# Each test takes the Run and either returns (optional detail string), raises SkipTest, or
# raises an exception (failure).


def test_server_starts(run):
    timeout = 90 if run.mode == "tf-server" else 30
    t0 = time.monotonic()
    deadline = t0 + timeout
    while time.monotonic() < deadline:
        if run.proc.poll() is not None:
            raise CheckFailed(run.server_died_msg())
        if port_open(run.port):
            run.timings["server_ready_s"] = time.monotonic() - t0
            return "accepting TCP on %s after %.1f s" % (run.addr, time.monotonic() - t0)
        time.sleep(0.1)
    raise CheckFailed("nothing accepted TCP on %s within %d s; log tail:\n%s"
                      % (run.addr, timeout, tail(run.server_log)))


def test_trace_writes_one_xplane(run):
    logdir = os.path.join(run.workdir, "logdir")
    os.makedirs(logdir)
    secs = run.trace(logdir, TRACE_DURATION_MS)
    run.timings["trace_2000ms_wall_s"] = secs
    files = list_files(logdir)
    host = run.addr.replace(":", "_")
    hint = ("" if files else " (trace() succeeded, so the server answered OK: it must either return "
            "the XSpace as ProfileResponse.tool_data {name: \"xplane.pb\"} with empty_trace=false, "
            "or write repository_root/session_id/<host>.xplane.pb itself)")
    check(len(files) == 1, "expected exactly one file under %s, found %d: %s%s\n%s"
          % (logdir, len(files), files, hint, run.server_state()))
    rel, size = files[0]
    parts = rel.split(os.sep)
    check(len(parts) == 4 and parts[:2] == ["plugins", "profile"]
          and parts[3] == host + ".xplane.pb",
          "expected plugins/profile/<session>/%s.xplane.pb, found %s" % (host, rel))
    check(SESSION_RE.match(parts[2]), "session dir %r is not YYYY_MM_DD_HH_MM_SS" % parts[2])
    check(size > 0, "%s is empty" % rel)
    run.xplane_path = os.path.join(logdir, rel)
    # Convert a copy in a writable folder: XProf writes cache files next to its input.
    conv_dir = os.path.join(run.workdir, "conv", "plugins", "profile", parts[2])
    os.makedirs(conv_dir)
    run.conv.xplane = os.path.join(conv_dir, parts[3])
    shutil.copyfile(run.xplane_path, run.conv.xplane)
    return "%s (%d bytes) in %.2f s" % (rel, size, secs)


def _load_xspace(path):
    from tensorflow.tsl.profiler.protobuf import xplane_pb2  # noqa: PLC0415

    xs = xplane_pb2.XSpace()
    with open(path, "rb") as f:
        xs.ParseFromString(f.read())
    return xs


def test_xspace_contents(run):
    check(run.xplane_path, "no xplane.pb (trace check failed)")
    run.import_tf()
    xs = _load_xspace(run.xplane_path)
    summary = []
    by_name = {}
    for p in xs.planes:
        n_events = sum(len(line.events) for line in p.lines)
        by_name[p.name] = (p, n_events)
        summary.append("%s(id=%d lines=%d events=%d)" % (p.name, p.id, len(p.lines), n_events))
    detail = "planes: " + ", ".join(summary)
    check("/host:CPU" in by_name, "no /host:CPU plane; %s" % detail)
    total = sum(n for _, n in by_name.values())
    check(total > 0, "XSpace has no events at all; %s" % detail)
    if run.expects_gpu:
        check("/device:GPU:0" in by_name and by_name["/device:GPU:0"][1] > 0,
              "no events on /device:GPU:0; %s" % detail)
        ids = [p.id for p in xs.planes if p.name.startswith("/device:GPU:")]
        check(len(ids) == len(set(ids)), "GPU planes share XPlane.id %s (trace viewer pid = 1 + id)" % ids)
    # XProf converts line timestamps to ps (x1000): absolute Unix ns would overflow int64.
    big = [(p.name, line.name, line.timestamp_ns) for p in xs.planes for line in p.lines
           if line.timestamp_ns > 10**15]
    check(not big, "line timestamp_ns looks absolute (overflows XProf's ps math): %s" % big[:3])
    names = collections.Counter()
    for p in xs.planes:
        for line in p.lines:
            for e in line.events:
                names[p.event_metadata[e.metadata_id].name] += 1
    check(names.get("train", 0) > 0, "no `train` step events; top names: %s" % names.most_common(8))
    check(names.get("MemoryAllocation", 0) > 0, "no MemoryAllocation events; top names: %s"
          % names.most_common(8))
    return "%s; hostnames=%s; train=%d MemoryAllocation=%d" % (
        detail, list(xs.hostnames), names["train"], names["MemoryAllocation"])


def test_trace_session_id_and_override_hostname(run):
    # TF 2.21's ProfilerOptions namedtuple has no such fields, but trace() forwards
    # `options._asdict()` to C++, which reads the string keys session_id/override_hostnames
    # (they arrive as ProfileRequest.session_id and ProfileOptions.override_hostname).
    # Who writes the file decides its name: a server writing it itself (TF's own server) uses
    # the override hostname; when the server returns tool_data, the TF 2.21 client writes
    # <session>/<host_name with ':'->'_'>.<name> and ignores the override. Either is accepted,
    # exactly one file, in the requested session directory.
    tf = run.import_tf()
    logdir = os.path.join(run.workdir, "logdir_opts")
    os.makedirs(logdir)
    Opts = collections.namedtuple("Opts", ["session_id", "override_hostnames"])
    session, hostname = "interop_session", "interop-host"
    secs = run.trace(logdir, 1000, options=Opts(session, hostname))
    run.timings["trace_1000ms_with_options_wall_s"] = secs
    files = list_files(logdir)
    prefix = os.path.join("plugins", "profile", session) + os.sep
    by_server = prefix + hostname + ".xplane.pb"
    by_client = prefix + run.addr.replace(":", "_") + ".xplane.pb"
    if files and not any(rel.startswith(prefix) for rel, _ in files):
        raise SkipTest("TF %s client ignored the session_id option; got %s" % (tf.__version__, files))
    check(len(files) == 1, "expected exactly one file under %s, found %s" % (prefix, files))
    rel, size = files[0]
    check(size > 0, "%s is empty" % rel)
    if rel == by_server:
        return "%s (%d bytes): written under the override hostname" % (rel, size)
    if rel == by_client:
        check(run.mode != "tf-server", "TF's own server should have used the override hostname")
        return ("%s (%d bytes): the client wrote tool_data under host_name; TF 2.21's client "
                "does not apply override_hostname to tool_data files" % (rel, size))
    raise CheckFailed("expected %s or %s, found %s\n%s" % (by_server, by_client, files, run.server_state()))


def test_tool_names(run):
    names = run.conv.tool_names()
    check(isinstance(names, list) and names, "no tools offered: %r" % (names,))
    check("trace_viewer@" in names or "trace_viewer" in names, "no trace viewer in %s" % names)
    for t in ("overview_page", "memory_profile"):
        check(t in names, "%s not offered; offered: %s" % (t, names))
    if run.expects_gpu:
        check("kernel_stats" in names, "kernel_stats not offered (needs a /device:GPU:N plane); "
              "offered: %s" % names)
    return ",".join(names)


def _trace_processes(doc, tool):
    check(isinstance(doc, dict) and isinstance(doc.get("traceEvents"), list),
          "%s: no traceEvents list; keys %s" % (tool, list(doc)[:20] if isinstance(doc, dict) else type(doc)))
    events = doc["traceEvents"]
    pname = {}
    counts = collections.Counter()
    for e in events:
        if not isinstance(e, dict) or "pid" not in e:
            continue
        if e.get("ph") == "M" and e.get("name") == "process_name":
            pname[e["pid"]] = e.get("args", {}).get("name", "")
        elif e.get("ph") != "M":
            counts[e["pid"]] += 1
    procs = {pname.get(pid, "pid %s" % pid): n for pid, n in counts.items()}
    # also list named processes without events
    for pid, name in pname.items():
        procs.setdefault(name, 0)
    return procs, len(events)


def _check_trace_viewer(run, tool):
    doc = run.conv.tool_json(tool)
    procs, n = _trace_processes(doc, tool)

    def events_of(suffix):
        return sum(c for name, c in procs.items() if name == suffix or name.endswith(" " + suffix))

    check(events_of("/host:CPU") > 0, "%s: no events in a /host:CPU process; processes: %s"
          % (tool, procs))
    if run.expects_gpu:
        check(events_of("/device:GPU:0") > 0, "%s: no events in a /device:GPU:0 process; "
              "processes: %s" % (tool, procs))
    if run.expects_sched and tool == "trace_viewer@":
        # The streaming viewer shows every plane whose name starts with /host:CPU.
        check(events_of("/host:CPUs") > 0, "%s: no events in the scheduler's /host:CPUs process; "
              "processes: %s" % (tool, procs))
    return "%d trace events; processes(events): %s" % (n, procs)


def test_trace_viewer_streaming(run):
    names = run.conv.tool_names()
    if "trace_viewer@" not in names:
        raise SkipTest("trace_viewer@ not offered (%s)" % names)
    return _check_trace_viewer(run, "trace_viewer@")


def test_trace_viewer(run):
    return _check_trace_viewer(run, "trace_viewer")


def test_overview_page(run):
    doc = run.conv.tool_json("overview_page")
    check(isinstance(doc, list) and doc, "overview_page: expected a non-empty list of tables, got %s"
          % short(doc))
    steps = None
    for table in doc:
        if isinstance(table, dict) and any(c.get("id") == "stepnum" for c in table.get("cols", [])):
            steps = table.get("rows", [])
    check(steps is not None, "overview_page: no step-time table (column stepnum); %s" % short(doc))
    check(len(steps) > 0, "overview_page: step-time table has no rows (no `train` steps grouped)")
    first = steps[0]["c"][0].get("v") if isinstance(steps[0], dict) else steps[0]
    env = next((t.get("p", {}) for t in doc if isinstance(t, dict)
                and "device_type" in t.get("p", {})), {})
    return "%d tables; %d steps (first %r); device_type=%s device_core_count=%s" % (
        len(doc), len(steps), first, env.get("device_type"), env.get("device_core_count"))


def test_memory_profile(run):
    doc = run.conv.tool_json("memory_profile")
    per = doc.get("memoryProfilePerAllocator") if isinstance(doc, dict) else None
    check(isinstance(per, dict) and per, "memory_profile: no allocators in memoryProfilePerAllocator "
          "(needs MemoryAllocation events with int64 stats on the /host:CPU plane): %s" % short(doc))
    good = []
    report = []
    for name, prof in per.items():
        snaps = len(prof.get("sampledTimelineSnapshots", [])) or len(prof.get("memoryProfileSnapshots", []))
        summ = prof.get("profileSummary", {})
        peak = int(summ.get("peakStats", {}).get("peakBytesInUse", "0") or 0)
        lifetime = int(summ.get("peakBytesUsageLifetime", "0") or 0)
        report.append("%s(snapshots=%d peak=%d lifetime_peak=%d active=%d)" % (
            name, snaps, peak, lifetime, len(prof.get("activeAllocations", []))))
        if snaps > 0 and (peak > 0 or lifetime > 0):
            good.append(name)
    check(good, "memory_profile: no allocator has snapshots and a non-zero peak: %s" % report)
    check(doc.get("memoryIds"), "memory_profile: memoryIds empty")
    return "; ".join(report)


def test_kernel_stats(run):
    if not run.expects_gpu:
        names = run.conv.tool_names()
        check("kernel_stats" not in names, "kernel_stats offered without a GPU plane?")
        raise SkipTest("no GPU plane in this mode (kernel_stats correctly not offered)")
    doc = run.conv.tool_json("kernel_stats")
    check(isinstance(doc, dict) and isinstance(doc.get("cols"), list),
          "kernel_stats: expected a DataTable with cols/rows, got %s" % short(doc))
    cols = [c.get("id") for c in doc["cols"]]
    check("kernel_name" in cols, "kernel_stats: no kernel_name column: %s" % cols)
    ki = cols.index("kernel_name")
    rows = doc.get("rows") or []
    kernels = []
    for r in rows:
        cells = r.get("c", []) if isinstance(r, dict) else r
        if ki < len(cells) and isinstance(cells[ki], dict) and cells[ki].get("v"):
            kernels.append(str(cells[ki]["v"]))
    check(kernels, "kernel_stats: no kernel rows (kernels need duration > 0 and a kernel_details "
          "stat on a /device:GPU:N plane); %d rows: %s" % (len(rows), short(rows)))
    return "%d kernel rows, e.g. %s" % (len(kernels), kernels[:3])


def test_monitor(run):
    tf = run.import_tf()
    call = lambda: tf.profiler.experimental.client.monitor("grpc://" + run.addr, 1000, 1)  # noqa: E731
    if run.mode == "tf-server":
        try:
            out = call_with_timeout(call, MONITOR_TIMEOUT_S, "client.monitor")
        except CheckFailed:
            raise
        except Exception as e:
            check("UNIMPLEMENTED" in str(e), "expected UNIMPLEMENTED from TF's server, got %s: %s"
                  % (type(e).__name__, e))
            return "TF's own server: %s: %s (expected)" % (type(e).__name__, str(e).strip())
        raise CheckFailed("TF's own server unexpectedly answered Monitor: %s" % short(out))
    t0 = time.monotonic()
    try:
        out = call_with_timeout(call, MONITOR_TIMEOUT_S, "client.monitor")
    except CheckFailed:
        raise
    except Exception as e:
        raise CheckFailed("client.monitor raised %s: %s\n%s" % (type(e).__name__, e, run.server_state()))
    run.timings["monitor_1000ms_wall_s"] = time.monotonic() - t0
    check(isinstance(out, str), "monitor returned %s, not str" % type(out).__name__)
    check(out.strip(), "monitor returned empty text %r" % out)
    return "%d chars: %s" % (len(out), short(out.strip(), 200))


def test_grpc_health_and_metrics(run):
    """grpcio's own health client, and the TF client's calls in /metrics."""
    if run.mode != "agent":
        raise SkipTest("agent mode only: TensorFlow's server has no health service")
    import grpc  # noqa: PLC0415 - from tensorflow's dependencies
    from grpc_health.v1 import health_pb2, health_pb2_grpc  # noqa: PLC0415

    statuses = {}
    with grpc.insecure_channel(run.addr) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        for service in ("", "tensorflow.ProfilerService", "tensorflow.ProfileAnalysis"):
            reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
            statuses[service] = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
        try:
            stub.Check(health_pb2.HealthCheckRequest(service="tensorflow.Unknown"), timeout=10)
            raise CheckFailed("an unknown service was answered")
        except grpc.RpcError as e:
            check(e.code() == grpc.StatusCode.NOT_FOUND, "unknown service: %s" % e.code())
    check(set(statuses.values()) == {"SERVING"}, "expected SERVING everywhere: %s" % statuses)

    import urllib.request  # noqa: PLC0415

    base = "http://" + run.metrics_addr
    with urllib.request.urlopen(base + "/readyz", timeout=10) as reply:
        check(reply.status == 200, "/readyz answered %d" % reply.status)
    with urllib.request.urlopen(base + "/metrics", timeout=10) as reply:
        text = reply.read().decode()
    profiles = [line for line in text.splitlines()
                if line.startswith('devtrace_rpcs_total{rpc="Profile",code="OK"} ')]
    check(profiles and float(profiles[0].split()[-1]) >= 1,
          "no successful Profile calls of the TF client counted in /metrics:\n%s" % short(text, 2000))
    return "health %s; %s" % (statuses, profiles[0])


def test_server_survived(run):
    check(run.proc is not None and run.proc.poll() is None,
          "server is no longer running: %s" % (run.server_died_msg() if run.proc else "never started"))
    return "still running"


def test_devtrace_capture_against_tf_server(run):
    """devtrace's own client speaks the protocol to TensorFlow's server too."""
    if run.mode != "agent":
        raise SkipTest("agent mode only")
    port = free_port()
    log_path = os.path.join(run.workdir, "tf-server-for-capture.log")
    # A BFC CPU allocator makes TensorFlow record allocator events.
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="1", TF_CPU_ALLOCATOR_USE_BFC="true")
    with open(log_path, "wb") as logf:
        proc = subprocess.Popen([sys.executable, "-c", TF_SERVER_CODE, str(port)],
                                stdin=subprocess.DEVNULL, stdout=logf, stderr=subprocess.STDOUT,
                                env=env, preexec_fn=_set_pdeathsig)
    try:
        deadline = time.monotonic() + 90
        while not port_open(port):
            check(proc.poll() is None, "TF server exited:\n" + tail(log_path))
            check(time.monotonic() < deadline, "TF server did not listen within 90 s")
            time.sleep(0.2)
        logdir = os.path.join(run.workdir, "capture-from-tf")
        out = subprocess.run([run.args.bin, "capture", "grpc://127.0.0.1:%d" % port,
                              "--duration", "1s", "--logdir", logdir, "--session-id", "from_tf",
                              "--quiet"], capture_output=True, text=True, timeout=180)
        check(out.returncode == 0, "devtrace capture failed: %s" % out.stderr.strip())
        path = out.stdout.strip()
        expected = os.path.join(logdir, "plugins", "profile", "from_tf", "127.0.0.1_%d.xplane.pb" % port)
        check(os.path.abspath(path) == os.path.abspath(expected), "printed %r, expected %r" % (path, expected))
        check(os.path.getsize(path) > 0, "empty file from TF's server")
        space = _load_xspace(path)
        names = [p.name for p in space.planes]
        check("/host:CPU" in names, "planes from TF's server: %s" % names)
        events = sum(len(l.events) for p in space.planes for l in p.lines)
        check(events > 0, "no events in the trace TF's server wrote")
        run.tf_trace = (logdir, "from_tf", os.path.basename(path)[: -len(".xplane.pb")], path)
        return "%s: %d events, planes %s" % (os.path.basename(path), events, names)
    finally:
        proc.kill()
        proc.wait()


def test_worker_list_new_session(run):
    """trace(worker_list=...) sends ProfileAnalysis.NewSession to the first address."""
    if run.mode != "agent":
        raise SkipTest("agent mode only")
    tf = run.import_tf()
    logdir = os.path.join(run.workdir, "fleet-logdir")
    os.makedirs(logdir)
    port = free_port()
    coordinator = "127.0.0.1:%d" % port
    log_path = os.path.join(run.workdir, "coordinator.log")
    with open(log_path, "wb") as logf:
        proc = subprocess.Popen([run.args.bin, "serve", "--listen", coordinator, "--allow-root", logdir],
                                stdin=subprocess.DEVNULL, stdout=logf, stderr=subprocess.STDOUT,
                                preexec_fn=_set_pdeathsig)
    try:
        deadline = time.monotonic() + 30
        while not port_open(port):
            check(proc.poll() is None, "coordinator exited:\n" + tail(log_path))
            check(time.monotonic() < deadline, "coordinator did not listen within 30 s")
            time.sleep(0.1)
        workers = "%s,%s" % (coordinator, run.addr)
        try:
            call_with_timeout(
                lambda: tf.profiler.experimental.client.trace(
                    "grpc://" + coordinator, logdir, 1000, worker_list=workers),
                TRACE_TIMEOUT_S, "client.trace(worker_list=...)")
        except CheckFailed:
            raise
        except Exception as e:
            raise CheckFailed("client.trace(worker_list) raised %s: %s\nfiles: %s\n%s"
                              % (type(e).__name__, e, list_files(logdir), tail(log_path, 15)))
        files = [f for f, _ in list_files(logdir) if f.endswith(".xplane.pb")]
        expected = sorted(h.replace(":", "_") + ".xplane.pb" for h in workers.split(","))
        check(sorted(os.path.basename(f) for f in files) == expected,
              "files %s, expected one per worker %s" % (files, expected))
        check(all(f.startswith(os.path.join("plugins", "profile")) for f in files),
              "files outside plugins/profile: %s" % files)
        sizes = [os.path.getsize(os.path.join(logdir, f)) for f in files]
        check(all(size > 1000 for size in sizes), "tiny traces: %s" % sizes)
        return "NewSession wrote %s (%s bytes)" % (files, sizes)
    finally:
        proc.kill()
        proc.wait()


def test_devtrace_tools_on_tf_trace(run):
    """devtrace's tool converters on a trace TensorFlow's own server wrote."""
    if getattr(run, "tf_trace", None) is None:
        raise SkipTest("needs the trace from test_devtrace_capture_against_tf_server")
    logdir, session, host, path = run.tf_trace
    results = []
    for tool in ("trace_viewer", "overview", "memory_profile"):
        out_path = os.path.join(run.workdir, "tf-%s.json" % tool)
        out = subprocess.run([run.args.bin, "tool", logdir, session, tool, "--host", host, "-o", out_path],
                             capture_output=True, text=True, timeout=300)
        check(out.returncode == 0, "devtrace tool %s failed: %s" % (tool, out.stderr.strip()))
        with open(out_path) as f:
            doc = json.load(f)
        results.append("%s %d bytes" % (tool, os.path.getsize(out_path)))
        if tool == "trace_viewer":
            check(any(e.get("ph") == "X" for e in doc.get("traceEvents", [])), "no complete events")
        if tool == "memory_profile":
            check(doc.get("memoryProfilePerAllocator"), "no allocator in TF's trace: %s" % short(doc))
            compare = subprocess.run([sys.executable, os.path.join(HERE, "compare_memory_profile.py"),
                                      path, out_path], capture_output=True, text=True, timeout=300)
            check(compare.returncode == 0, "memory_profile differs from XProf's on TF's trace:\n%s%s"
                  % (compare.stdout[-2000:], compare.stderr[-1000:]))
            results.append("memory_profile equals XProf's")
    out = subprocess.run([run.args.bin, "tool", logdir, session, "kernel_stats", "--host", host],
                         capture_output=True, text=True, timeout=120)
    check(out.returncode != 0 and "GPU" in out.stderr,
          "kernel_stats on a CPU-only trace should say there is no GPU plane: %r" % out.stderr)
    return "; ".join(results) + "; kernel_stats refused (no GPU plane)"


# ---------------------------------------------------------------------------------------
# Traces past --chunk-traces-over: Riegeli chunks of XSpace, as XProf 2.23+ reads them.

# A 1 s capture of the mock is about 3.4 MB as one XSpace and 0.6 MB as chunks: over
# this, and its chunks within it (so that a reply may carry them).
CHUNK_THRESHOLD = "1MiB"
INSPECT_TOP_RE = re.compile(r"^\s+[\d.]+ ms\s+(\d+)x\s+(.*)$")


def _side_agent(run, label, extra):
    """A second agent on the mock with `extra` flags; its address and log."""
    port = free_port()
    log = os.path.join(run.workdir, "%s-agent.log" % label)
    with open(log, "wb") as logf:
        agent = subprocess.Popen([run.args.bin, "serve", "--listen", "127.0.0.1:%d" % port,
                                  "--backend", "mock", "--metrics-listen", "off"] + extra,
                                 stdin=subprocess.DEVNULL, stdout=logf, stderr=subprocess.STDOUT,
                                 preexec_fn=_set_pdeathsig)
    run.extra_procs.append(agent)
    deadline = time.monotonic() + 30
    while not port_open(port):
        check(agent.poll() is None, "the agent exited:\n" + tail(log))
        check(time.monotonic() < deadline, "the agent did not listen within 30 s:\n" + tail(log))
        time.sleep(0.1)
    return "127.0.0.1:%d" % port, log


def _riegeli_agent(run, root):
    return _side_agent(run, "riegeli", ["--allow-root", root, "--chunk-traces-over", CHUNK_THRESHOLD])


def _check_chunked_in_xprof(run, path, label):
    """XProf opens `path` (an .xplane.riegeli) and shows every chunk of it: the
    counts of its events by name equal what `devtrace inspect` reads."""
    out = subprocess.run([run.args.bin, "inspect", path, "--top", "40"], capture_output=True,
                         text=True, timeout=120)
    check(out.returncode == 0, "devtrace inspect %s failed: %s" % (path, out.stderr.strip()))
    first = out.stdout.splitlines()[0] if out.stdout else ""
    check(first.startswith("chunks: ") and int(first.split()[1]) > 1,
          "devtrace inspect does not see several chunks: %r" % first)
    ours = {}
    for line in out.stdout.splitlines():
        m = INSPECT_TOP_RE.match(line)
        if m:
            ours[m.group(2)] = int(m.group(1))
    session = os.path.basename(os.path.dirname(path))
    conv_dir = os.path.join(run.workdir, "conv-%s" % label, "plugins", "profile", session)
    os.makedirs(conv_dir)
    conv = Converter(os.path.dirname(os.path.dirname(conv_dir)))
    conv.xplane = os.path.join(conv_dir, os.path.basename(path))
    shutil.copyfile(path, conv.xplane)
    names = conv.tool_names()
    for tool in ("overview_page", "kernel_stats"):
        check(tool in names, "%s not offered for the chunked trace; offered: %s" % (tool, names))
    doc = conv.tool_json("trace_viewer")
    counts = collections.Counter(e.get("name") for e in doc.get("traceEvents", []) if e.get("ph") == "X")
    procs, _ = _trace_processes(doc, "trace_viewer")
    for name in ("cudaLaunchKernel", "volta_h884gemm_64x64_ldg8_nn"):
        check(ours.get(name, 0) > 0, "devtrace inspect lists no %s: %s" % (name, short(out.stdout)))
        check(counts[name] == ours[name], "XProf shows %d %s events, devtrace inspect %d: not every "
              "chunk was merged" % (counts[name], name, ours[name]))
    overview = conv.tool_json("overview_page")
    steps = [t.get("rows", []) for t in overview if isinstance(t, dict)
             and any(c.get("id") == "stepnum" for c in t.get("cols", []))]
    check(steps and steps[0], "overview_page of the chunked trace has no steps")
    return "%s (%d chunks): XProf processes %s, %d steps; cudaLaunchKernel %d as devtrace reads" % (
        os.path.basename(path), int(first.split()[1]), procs, len(steps[0]), counts["cudaLaunchKernel"])


def test_chunked_trace_in_xprof(run):
    """A trace past --chunk-traces-over, captured with TensorFlow's client: written as
    .xplane.riegeli by the agent under --allow-root, and by the client itself from the
    reply's `xplane.riegeli` tool data elsewhere; XProf serves tool data from both."""
    if run.mode != "agent":
        raise SkipTest("needs devtrace serve")
    root = os.path.join(run.workdir, "riegeli-root")
    address, log = _riegeli_agent(run, root)
    results = []
    for label, logdir in (("agent-written", os.path.join(root, "logdir")),
                          ("client-written", os.path.join(run.workdir, "riegeli-client"))):
        tf = run.import_tf()
        try:
            call_with_timeout(lambda: tf.profiler.experimental.client.trace(
                "grpc://" + address, logdir, 1000), TRACE_TIMEOUT_S, "client.trace")
        except CheckFailed:
            raise
        except Exception as e:
            raise CheckFailed("client.trace (%s) raised %s: %s\nagent log:\n%s"
                              % (label, type(e).__name__, e, tail(log, 15)))
        files = list_files(logdir)
        host = address.replace(":", "_")
        check(len(files) == 1 and files[0][0].endswith(os.sep + host + ".xplane.riegeli"),
              "%s: expected plugins/profile/<session>/%s.xplane.riegeli, found %s\nagent log:\n%s"
              % (label, host, files, tail(log, 15)))
        results.append("%s: %s" % (label, _check_chunked_in_xprof(run, os.path.join(logdir, files[0][0]),
                                                                  label)))
    return "; ".join(results)


def test_trigger_session_in_xprof(run):
    """A trigger on the mock's slow step saves the seconds before it as a session of its
    own; `devtrace sessions` lists it and XProf's converters read it, steps included."""
    if run.mode != "agent":
        raise SkipTest("needs devtrace serve")
    logdir = os.path.join(run.workdir, "trigger-logdir")
    repository = os.path.join(logdir, "plugins", "profile")
    rule = "name=slow-step; when=step > 3x median(10); before=2s; after=200ms"
    _, log = _side_agent(run, "trigger", [
        "--mock-slow-step", "2s", "--allow-root", logdir, "--trigger-repository", repository,
        "--trigger", rule])
    deadline = time.monotonic() + 60
    while not any(name.endswith(".xplane.pb") for name, _ in list_files(logdir)):
        check(time.monotonic() < deadline, "no trigger session within 60 s:\n" + tail(log))
        time.sleep(0.2)
    files = list_files(logdir)
    check(len(files) == 1 and files[0][0].endswith(".xplane.pb"),
          "expected one <session>/<host>.xplane.pb, found %s" % files)
    session = files[0][0].split(os.sep)[-2]
    check(session.endswith("_slow-step"), "session %r is not named after its rule" % session)
    listed = subprocess.run([run.args.bin, "sessions", logdir], capture_output=True, text=True,
                            timeout=60)
    check(listed.returncode == 0 and session in listed.stdout,
          "devtrace sessions does not list %s: %s%s" % (session, listed.stdout, listed.stderr))
    conv = Converter(os.path.join(run.workdir, "conv-trigger"))
    os.makedirs(conv.workdir)
    conv.xplane = os.path.join(logdir, files[0][0])
    names = conv.tool_names()
    check("overview_page" in names, "overview_page not offered for the trigger's trace: %s" % names)
    doc = conv.tool_json("trace_viewer")
    # XProf names each step root after its step: "train 12".
    steps = [e for e in doc.get("traceEvents", []) if e.get("ph") == "X"
             and "step_num" in e.get("args", {})]
    check(len(steps) >= 10, "XProf shows %d train steps before the slow one" % len(steps))
    longest = max(e.get("dur", 0) for e in steps)
    typical = sorted(e.get("dur", 0) for e in steps)[len(steps) // 2]
    check(longest > 3 * typical, "the slow step (%s us) is not in the trace (median %s us)"
          % (longest, typical))
    overview = conv.tool_json("overview_page")
    rows = [t.get("rows", []) for t in overview if isinstance(t, dict)
            and any(c.get("id") == "stepnum" for c in t.get("cols", []))]
    check(rows and rows[0], "overview_page of the trigger's trace has no steps")
    return "session %s: %d steps in XProf's trace viewer, the slow one %.1fx the median" % (
        session, len(steps), longest / max(typical, 1))


# ---------------------------------------------------------------------------------------
# The tap: TensorFlow's distributed runtime through `devtrace serve --tap`.

TF_DIST_SERVER_CODE = r"""
import sys
import tensorflow as tf
port = int(sys.argv[1])
cluster = tf.train.ClusterSpec({"worker": ["localhost:%d" % port]})
server = tf.distribute.Server(cluster, job_name="worker", task_index=0, protocol="grpc", start=True)
print("tf.distribute.Server listening on", port, flush=True)
server.join()
"""

TF_GRAPH_CLIENT_CODE = r"""
import json, sys
import tensorflow as tf
tf.compat.v1.disable_eager_execution()
graph = tf.Graph()
with graph.as_default():
    x = tf.compat.v1.placeholder(tf.float32, [2, 2], name="x")
    w = tf.Variable([[1.0, 2.0], [3.0, 4.0]], name="w")
    y = tf.matmul(x, w, name="y")
    update = w.assign_add(tf.ones([2, 2]), name="update")
    init = tf.compat.v1.global_variables_initializer()

def run(target):
    with tf.compat.v1.Session(target, graph=graph) as session:
        session.run(init)
        out = []
        for i in range(4):
            out.append(session.run(y, {x: [[float(i), 1.0], [0.0, float(i)]]}).tolist())
            session.run(update)
        return out

print(json.dumps({"direct": run("grpc://" + sys.argv[2]), "tap": run("grpc://" + sys.argv[1])}))
"""

TF_EAGER_CLIENT_CODE = r"""
import json, sys
import tensorflow as tf
tf.config.experimental_connect_to_host(sys.argv[1], job_name="worker")
with tf.device("/job:worker/replica:0/task:0/device:CPU:0"):
    a = tf.constant([[1.0, 2.0], [3.0, 4.0]])
    b = tf.matmul(a, a)
    c = tf.nn.relu(b - 10.0)
print(json.dumps(c.numpy().tolist()))
"""

TAP_CLIENT_TIMEOUT_S = 240


def _tap_setup(run):
    """One tf.distribute.Server and one agent tapping it, shared by the tap tests."""
    if run.tap is not None:
        return run.tap
    tf_port, tap_port, agent_port = free_port(), free_port(), free_port()
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="1")
    tf_log = os.path.join(run.workdir, "tf-distribute-server.log")
    with open(tf_log, "wb") as logf:
        server = subprocess.Popen([sys.executable, "-c", TF_DIST_SERVER_CODE, str(tf_port)],
                                  stdin=subprocess.DEVNULL, stdout=logf, stderr=subprocess.STDOUT,
                                  env=env, preexec_fn=_set_pdeathsig)
    run.extra_procs.append(server)
    agent_log = os.path.join(run.workdir, "tap-agent.log")
    with open(agent_log, "wb") as logf:
        agent = subprocess.Popen([run.args.bin, "serve", "--listen", "127.0.0.1:%d" % agent_port,
                                  "--mock-rate", "0", "--tap",
                                  "127.0.0.1:%d=127.0.0.1:%d" % (tap_port, tf_port)],
                                 stdin=subprocess.DEVNULL, stdout=logf, stderr=subprocess.STDOUT,
                                 preexec_fn=_set_pdeathsig)
    run.extra_procs.append(agent)
    deadline = time.monotonic() + 90
    for port, proc, log in ((tf_port, server, tf_log), (tap_port, agent, agent_log),
                            (agent_port, agent, agent_log)):
        while not port_open(port):
            check(proc.poll() is None, "exited:\n" + tail(log))
            check(time.monotonic() < deadline, "port %d not open within 90 s:\n%s" % (port, tail(log)))
            time.sleep(0.2)
    run.tap = {"tf": "127.0.0.1:%d" % tf_port, "tap": "127.0.0.1:%d" % tap_port,
               "agent": "127.0.0.1:%d" % agent_port, "agent_log": agent_log, "tf_log": tf_log,
               "started": time.monotonic()}
    return run.tap


def _tap_client(run, code, *argv):
    out = subprocess.run([sys.executable, "-c", code] + list(argv), capture_output=True, text=True,
                         timeout=TAP_CLIENT_TIMEOUT_S, env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"),
                         preexec_fn=_set_pdeathsig)
    check(out.returncode == 0, "client failed (%d):\n%s\nagent log:\n%s"
          % (out.returncode, out.stderr[-3000:], tail(run.tap["agent_log"], 15)))
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_tap_graph_session(run):
    """tf.compat.v1.Session through the tap gives the results of a direct session."""
    if run.mode != "agent":
        raise SkipTest("agent mode only")
    tap = _tap_setup(run)
    result = _tap_client(run, TF_GRAPH_CLIENT_CODE, tap["tap"], tap["tf"])
    check(result["tap"] == result["direct"], "through the tap %s, direct %s"
          % (result["tap"], result["direct"]))
    return "4 steps, results equal: %s" % short(result["tap"], 120)


def test_tap_eager_client(run):
    """A remote eager client (StreamingEnqueue) through the tap computes what a direct one does."""
    if run.mode != "agent":
        raise SkipTest("agent mode only")
    tap = _tap_setup(run)
    direct = _tap_client(run, TF_EAGER_CLIENT_CODE, tap["tf"])
    tapped = _tap_client(run, TF_EAGER_CLIENT_CODE, tap["tap"])
    check(tapped == direct, "through the tap %s, direct %s" % (tapped, direct))
    return "results equal: %s" % tapped


def test_tap_capture_shows_steps_and_ops(run):
    """The agent's capture holds a step per RunStep and the enqueued eager op names."""
    if run.tap is None:
        raise SkipTest("needs test_tap_graph_session / test_tap_eager_client")
    tap = run.tap
    back = int(time.monotonic() - tap["started"]) + 5
    logdir = os.path.join(run.workdir, "tap-capture")
    out = subprocess.run([run.args.bin, "capture", "grpc://" + tap["agent"], "--duration",
                          "%ds" % (back + 1), "--delay-back", "%ds" % back, "--logdir", logdir,
                          "--session-id", "tap", "--quiet"],
                         capture_output=True, text=True, timeout=180)
    check(out.returncode == 0, "devtrace capture failed: %s" % out.stderr.strip())
    space = _load_xspace(out.stdout.strip())
    host = [p for p in space.planes if p.name == "/host:CPU"]
    check(host, "no /host:CPU plane: %s" % [p.name for p in space.planes])
    host = host[0]
    stat_names = {k: v.name for k, v in host.stat_metadata.items()}
    steps, methods, ops = [], collections.Counter(), collections.Counter()
    for line in host.lines:
        if not line.name.startswith("tap #"):
            continue
        for event in line.events:
            name = host.event_metadata[event.metadata_id].name
            stats = {stat_names.get(s.metadata_id): s for s in event.stats}
            if "step_num" in stats:
                steps.append(stats["step_num"].int64_value)
            elif "grpc_status" in stats:
                methods[name] += 1
            elif "op_id" in stats:
                ops[name] += 1
    check(methods.get("tensorflow.MasterService/RunStep", 0) >= 8,
          "RunStep calls seen: %s" % dict(methods))
    check(len(steps) == methods["tensorflow.MasterService/RunStep"] and 0 in steps,
          "steps %s for %d RunStep calls" % (sorted(steps), methods["tensorflow.MasterService/RunStep"]))
    check(any(m.startswith("tensorflow.eager.EagerService/") for m in methods),
          "no EagerService call: %s" % dict(methods))
    check(ops.get("MatMul", 0) >= 1, "enqueued ops %s lack MatMul" % dict(ops))
    return "steps %s; methods %s; ops %s" % (sorted(steps), dict(methods), dict(ops))


JAX_SERVER_CODE = r"""
import sys, time
import jax, jax.numpy as jnp
port = int(sys.argv[1])
x = jnp.ones((256, 256))
step = jax.jit(lambda x: jnp.tanh(x @ x) / 256)
step(x).block_until_ready()  # compile before the server starts listening
jax.profiler.start_server(port)
print("jax profiler server listening on", port, flush=True)
i = 0
while True:
    with jax.profiler.StepTraceAnnotation("train", step_num=i):
        x = step(x).block_until_ready()
    i += 1
    time.sleep(0.002)
"""


def _event_times(start_ns, line):
    """Absolute start times (ns) of a line's events: lines are relative to
    the capture's profile_start_time."""
    return [start_ns + line.timestamp_ns + e.offset_ps // 1000 for e in line.events]


def _federate(run, name, server_code, server_env):
    """Starts a real in-process profiler server (`server_code`, its port as
    argv[1]) and an agent with it as --upstream; captures 2 s through the
    agent; checks that the upstream's events lie in the capture's own
    window and that the answer came in time. Returns (space, upstream lines,
    figures)."""
    up_port, agent_port = free_port(), free_port()
    procs = []
    try:
        with open(os.path.join(run.workdir, "%s-upstream.log" % name), "wb") as logf:
            procs.append(subprocess.Popen([sys.executable, "-c", server_code, str(up_port)],
                                          stdin=subprocess.DEVNULL, stdout=logf, stderr=subprocess.STDOUT,
                                          env=dict(os.environ, **server_env),
                                          preexec_fn=_set_pdeathsig))
        with open(os.path.join(run.workdir, "%s-federating-agent.log" % name), "wb") as logf:
            procs.append(subprocess.Popen([run.args.bin, "serve", "--listen", "127.0.0.1:%d" % agent_port,
                                           "--upstream", "127.0.0.1:%d" % up_port],
                                          stdin=subprocess.DEVNULL, stdout=logf, stderr=subprocess.STDOUT,
                                          preexec_fn=_set_pdeathsig))
        deadline = time.monotonic() + 120
        while not (port_open(up_port) and port_open(agent_port)):
            check(all(p.poll() is None for p in procs), "a server exited early")
            check(time.monotonic() < deadline, "servers did not listen within 120 s")
            time.sleep(0.2)
        time.sleep(1.0)  # let the job run steps
        logdir = os.path.join(run.workdir, "%s-federated" % name)
        began = time.monotonic()
        out = subprocess.run([run.args.bin, "capture", "grpc://127.0.0.1:%d" % agent_port, "--duration", "2s",
                              "--logdir", logdir, "--session-id", name, "--quiet"],
                             capture_output=True, text=True, timeout=180)
        answered = time.monotonic() - began
        check(out.returncode == 0, "capture failed: %s" % out.stderr.strip())
        space = _load_xspace(out.stdout.strip())
        check(not space.errors, "merged trace has errors: %s" % list(space.errors))
        env = [p for p in space.planes if p.name == "Task Environment"][0]
        stats = {env.stat_metadata[s.metadata_id].name: s for s in env.stats}
        start = stats["profile_start_time"].uint64_value or stats["profile_start_time"].int64_value
        stop = stats["profile_stop_time"].uint64_value or stats["profile_stop_time"].int64_value
        source = "127.0.0.1:%d" % up_port
        times = []
        lines = 0
        for plane in space.planes:
            merged = any(plane.stat_metadata[s.metadata_id].name == "devtrace_source" and
                         s.str_value.startswith(source) for s in plane.stats)
            for line in plane.lines:
                if merged or line.display_name.startswith(source + " "):
                    lines += 1
                    times.extend(_event_times(start, line))
        check(len(times) > 100, "%s's events missing: %d lines, %d events" % (name, lines, len(times)))
        slack = 50_000_000
        inside = sum(1 for t in times if start - slack <= t <= stop + slack)
        share = inside / len(times)
        check(share >= 0.95, "only %.1f%% of %s's %d events lie in the capture's window (%.3f s to %.3f s "
              "after its start)" % (100 * share, name, len(times), (min(times) - start) / 1e9,
                                    (max(times) - start) / 1e9))
        # The answer time is reported, not asserted: a timing belongs in a
        # benchmark (a debug build merges ~10 MB far slower than a release).
        window_s = (stop - start) / 1e9
        offsets = [(k, s.str_value) for k, s in stats.items() if k.startswith("devtrace_upstream_start_offset_ns")]
        return space, "%d lines, %d events, %.1f%% inside the window; a %.1f s capture answered in %.2f s; " \
            "upstream start offset %s ns" % (lines, len(times), 100 * share, window_s, answered,
                                             offsets[0][1] if offsets else "unreported")
    finally:
        for p in procs:
            p.kill()
            p.wait()


def test_federation_with_tf_server(run):
    """serve --upstream folds TensorFlow's own server trace into the agent's,
    recorded over the capture's own window."""
    if run.mode != "agent":
        raise SkipTest("agent mode only")
    space, figures = _federate(run, "tf", TF_SERVER_CODE, {"TF_CPP_MIN_LOG_LEVEL": "1"})
    names = [p.name for p in space.planes]
    check("/device:GPU:0" in names, "the agent's own planes are missing: %s" % names)
    path = os.path.join(run.workdir, "tf-merged.xplane.pb")
    with open(path, "wb") as f:
        f.write(space.SerializeToString())
    # XProf converts the merged file (on a copy: it writes caches beside it).
    conv = Converter(tempfile.mkdtemp(dir=run.workdir))
    conv.xplane = os.path.join(conv.workdir, os.path.basename(path))
    shutil.copy(path, conv.xplane)
    sizes = []
    for tool in ("trace_viewer", "overview_page", "memory_profile"):
        doc = conv.tool_json(tool)
        check(doc, "XProf's %s of the merged trace is empty" % tool)
        sizes.append("%s ok" % tool)
    return "TensorFlow: %s; XProf: %s" % (figures, ", ".join(sizes))


def test_federation_with_jax_server(run):
    """serve --upstream folds JAX's profiler server (jax.profiler.start_server)
    into the agent's trace, recorded over the capture's own window."""
    if run.mode != "agent":
        raise SkipTest("agent mode only")
    try:
        import jax  # noqa: F401,PLC0415 - only to know it is installed
    except ImportError:
        raise SkipTest("jax is not installed in this venv")
    _, figures = _federate(run, "jax", JAX_SERVER_CODE, {"JAX_PLATFORMS": "cpu"})
    return "JAX: %s" % figures


def test_cuda_injection_in_xprof(run):
    """A CUDA program (stand-in driver and CUPTI) traced through the injection
    library: XProf's converters read its kernels, streams and memory."""
    if run.mode != "agent":
        raise SkipTest("agent mode only")
    bindir = os.path.dirname(run.args.bin)
    inject = os.path.join(bindir, "libdevtrace_inject.so")
    check(os.path.isfile(inject), "%s missing (cargo build builds it)" % inject)
    work = os.path.join(run.workdir, "cuda")
    runtime = os.path.join(work, "run")
    os.makedirs(runtime)
    here = os.path.dirname(os.path.abspath(__file__))
    standins = os.path.join(here, "..", "tests", "standins")

    def cc(*args):
        out = subprocess.run(["cc", "-O2", *args], capture_output=True, text=True)
        check(out.returncode == 0, "cc %s failed: %s" % (" ".join(args), out.stderr))

    cc("-shared", "-fPIC", "-Wl,-soname,libcuda.so.1", "-o", os.path.join(work, "libcuda.so.1"),
       os.path.join(standins, "libcuda.c"), "-ldl", "-pthread")
    os.symlink("libcuda.so.1", os.path.join(work, "libcuda.so"))
    cc("-shared", "-fPIC", "-Wl,-soname,libcupti.so.12", "-o", os.path.join(work, "libcupti.so.12"),
       os.path.join(standins, "cupti.c"), "-ldl", "-pthread")
    cc("-pthread", "-o", os.path.join(work, "cuda_workload"), os.path.join(standins, "cuda_workload.c"),
       "-L" + work, "-lcuda", "-Wl,-rpath," + work)
    port = free_port()
    procs = []
    logf = open(os.path.join(work, "agent.log"), "wb")
    try:
        procs.append(subprocess.Popen([run.args.bin, "serve", "--listen", "127.0.0.1:%d" % port,
                                       "--backend", "cuda", "--runtime-dir", runtime],
                                      stdin=subprocess.DEVNULL, stdout=logf, stderr=subprocess.STDOUT,
                                      preexec_fn=_set_pdeathsig))
        env = dict(os.environ, LD_LIBRARY_PATH=work, CUDA_INJECTION64_PATH=inject,
                   DEVTRACE_RUNTIME_DIR=runtime, DEVTRACE_STANDIN_GPU_KERNEL_NS="20000")
        procs.append(subprocess.Popen([os.path.join(work, "cuda_workload"), "400", "--sleep-ms", "5",
                                       "--extras"],
                                      env=env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
                                      preexec_fn=_set_pdeathsig))
        deadline = time.monotonic() + 20
        while not any(n.endswith(".ring") for n in os.listdir(runtime)):
            check(time.monotonic() < deadline, "the workload made no ring in %s" % runtime)
            time.sleep(0.1)
        time.sleep(0.6)  # the agent scans every 250 ms
        logdir = os.path.join(work, "logs")
        out = subprocess.run([run.args.bin, "capture", "grpc://127.0.0.1:%d" % port, "--duration", "1500ms",
                              "--logdir", logdir], capture_output=True, text=True, timeout=60)
        check(out.returncode == 0, "devtrace capture failed: %s" % out.stderr)
    finally:
        for p in procs:
            p.kill()
            p.wait()
        logf.close()
    xplane = out.stdout.strip().splitlines()[0]
    conv = Converter(work)
    conv.xplane = xplane
    names = conv.tool_names()
    check("kernel_stats" in names, "kernel_stats not offered: %s" % names)
    doc = conv.tool_json("kernel_stats")
    cols = [c.get("id") for c in doc.get("cols", [])]
    ki = cols.index("kernel_name")
    kernels = sorted({str(r["c"][ki]["v"]) for r in doc.get("rows") or []})
    check(kernels == ["matmul_tiled", "vector_add"], "kernel_stats rows: %s" % kernels)
    procs_seen, _ = _trace_processes(conv.tool_json("trace_viewer@"), "trace_viewer@")
    gpu = sum(c for n, c in procs_seen.items() if n.endswith("/device:GPU:0"))
    check(gpu > 0, "trace_viewer@: no /device:GPU:0 events: %s" % procs_seen)
    memory = conv.tool_json("memory_profile").get("memoryProfilePerAllocator") or {}
    check(any(n.startswith("GPU_0_cuda (pid ") for n in memory),
          "memory_profile allocators: %s" % list(memory))
    return "kernel_stats %s; trace_viewer@ %s; memory allocators %s" % (kernels, procs_seen, list(memory))


TESTS = [
    test_server_starts,
    test_trace_writes_one_xplane,
    test_xspace_contents,
    test_trace_session_id_and_override_hostname,
    test_tool_names,
    test_trace_viewer_streaming,
    test_trace_viewer,
    test_overview_page,
    test_memory_profile,
    test_kernel_stats,
    test_chunked_trace_in_xprof,
    test_trigger_session_in_xprof,
    test_monitor,
    test_grpc_health_and_metrics,
    test_devtrace_capture_against_tf_server,
    test_devtrace_tools_on_tf_trace,
    test_worker_list_new_session,
    test_federation_with_tf_server,
    test_federation_with_jax_server,
    test_tap_graph_session,
    test_tap_eager_client,
    test_tap_capture_shows_steps_and_ops,
    test_cuda_injection_in_xprof,
    test_server_survived,
]


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "--convert-worker":
        return convert_worker(sys.argv[2:])

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bin", default=os.environ.get("DEVTRACE_BIN", "target/debug/devtrace"),
                    help="agent binary (agent mode)")
    g = ap.add_mutually_exclusive_group()
    g.add_argument("--tf-server", dest="mode", action="store_const", const="tf-server",
                   help="test against TensorFlow's own profiler server instead of the agent")
    ap.add_argument("--keep", action="store_true", help="keep the work directory")
    ap.add_argument("-k", dest="only", action="append", default=[],
                    help="run only tests whose name contains this (repeatable; prerequisites still run)")
    args = ap.parse_args()
    args.mode = args.mode or "agent"

    faulthandler.enable()
    faulthandler.dump_traceback_later(GLOBAL_TIMEOUT_S, exit=True)  # last-resort watchdog

    if args.mode == "agent":
        if not os.path.isfile(args.bin) or not os.access(args.bin, os.X_OK):
            print("error: agent binary %r not found or not executable (build it first, or set "
                  "DEVTRACE_BIN / --bin)" % args.bin, flush=True)
            print("0 passed, 1 failed")
            return 1
        args.bin = os.path.abspath(args.bin)

    run = Run(args)
    print("interop mode=%s addr=%s workdir=%s" % (run.mode, run.addr, run.workdir), flush=True)

    def on_signal(signum, _frame):
        run.stop_server()
        os._exit(128 + signum)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)

    passed, failed, skipped = [], [], []
    required = {"test_server_starts", "test_trace_writes_one_xplane"}
    t_start = time.monotonic()
    try:
        run.start_server()
        for fn in TESTS:
            name = fn.__name__
            if args.only and name not in required and not any(s in name for s in args.only):
                continue
            t0 = time.monotonic()
            try:
                detail = fn(run)
            except SkipTest as e:
                skipped.append(name)
                print("SKIP %s: %s" % (name, e), flush=True)
                continue
            except Exception as e:  # noqa: BLE001
                failed.append(name)
                msg = str(e) if isinstance(e, CheckFailed) else traceback.format_exc()
                print("FAIL %s (%.1fs): %s" % (name, time.monotonic() - t0, msg), flush=True)
                if name == "test_server_starts":
                    break
                continue
            passed.append(name)
            print("PASS %s (%.1fs)%s" % (name, time.monotonic() - t0,
                                        (": " + detail) if detail else ""), flush=True)
    finally:
        run.stop_server()

    if run.conv.xplane:
        extra = [f for f, _ in list_files(os.path.dirname(run.conv.xplane))
                 if f != os.path.basename(run.conv.xplane)]
        print("note: the XProf converters wrote next to the input: %s" % extra)
    if run.conv.seconds:
        print("timings: converters %s" % ", ".join("%s=%.1fs" % kv for kv in run.conv.seconds.items()))
    print("timings: %stotal %.1fs" % ("".join("%s=%.2f, " % kv for kv in run.timings.items()),
                                      time.monotonic() - t_start))
    if failed or args.keep:
        print("work directory kept: %s (server log: %s)" % (run.workdir, run.server_log))
    else:
        shutil.rmtree(run.workdir, ignore_errors=True)
    if skipped:
        print("%d skipped: %s" % (len(skipped), ", ".join(skipped)))
    if failed:
        print("FAILED: %s" % ", ".join(failed))
    print("%d passed, %d failed" % (len(passed), len(failed)), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # TF/gRPC threads can stall interpreter shutdown; everything is cleaned up already.
    os._exit(code)
