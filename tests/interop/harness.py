"""The interop harness: the agent (or TensorFlow's own profiler server) as a
subprocess, the unmodified TensorFlow profiler client that drives it, and
XProf's converters run in child processes; shared by the tests beside it.

A test takes the `run` fixture (conftest.py), a `Run`: the server process
and what earlier tests left for later ones (the first trace, TF's own trace,
the tap). It fails by raising (`check`), skips with `SkipTest`, and may
return a short detail that the report prints.

Run as `python harness.py --convert-worker TOOL XPLANE OUT`, it is the child
that converts one tool with XProf (a converter crash must not end the run).
"""

import collections
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

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
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


SkipTest = pytest.skip.Exception


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


def set_pdeathsig():
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
    def __init__(self, workdir, prepare=None):
        self.workdir = workdir
        # Makes `xplane` (the first trace) when a conversion needs it first.
        self.prepare = prepare
        self.xplane = None
        self.cache = {}
        self.seconds = {}

    def _run(self, tool):
        if self.xplane is None and self.prepare is not None:
            self.prepare()
        if self.xplane is None:
            raise CheckFailed("no xplane.pb to convert")
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
        self.conv = Converter(self.workdir, self.first_trace)
        self._serving = None  # ("ok", detail) or ("error", exception), once waited for
        self._first = None  # the same for the first trace
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
                                         preexec_fn=set_pdeathsig)
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

    # -- what several tests need first, done once ---------------------------------------
    def wait_until_serving(self):
        """Waits until the server accepts TCP (once); the detail, or its failure again."""
        self._serving = _once(self._serving, lambda: _wait_until_serving(self))
        return _result(self._serving)

    def first_trace(self):
        """Makes the first trace (once) and returns its detail, or raises its failure."""
        self.wait_until_serving()
        self._first = _once(self._first, lambda: _first_trace(self))
        return _result(self._first)


def _once(done, fn):
    if done is not None:
        return done
    try:
        return ("ok", fn())
    except BaseException as e:  # noqa: BLE001 - kept and raised to every caller
        return ("error", e)


def _result(done):
    kind, value = done
    if kind == "error":
        raise value
    return value


def _wait_until_serving(run):
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


def _first_trace(run):
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


def load_xspace(path):
    from tensorflow.tsl.profiler.protobuf import xplane_pb2  # noqa: PLC0415

    xs = xplane_pb2.XSpace()
    with open(path, "rb") as f:
        xs.ParseFromString(f.read())
    return xs


def trace_processes(doc, tool):
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


def side_agent(run, label, extra):
    """A second agent on the mock with `extra` flags; its address and log."""
    port = free_port()
    log = os.path.join(run.workdir, "%s-agent.log" % label)
    with open(log, "wb") as logf:
        agent = subprocess.Popen([run.args.bin, "serve", "--listen", "127.0.0.1:%d" % port,
                                  "--backend", "mock", "--metrics-listen", "off"] + extra,
                                 stdin=subprocess.DEVNULL, stdout=logf, stderr=subprocess.STDOUT,
                                 preexec_fn=set_pdeathsig)
    run.extra_procs.append(agent)
    deadline = time.monotonic() + 30
    while not port_open(port):
        check(agent.poll() is None, "the agent exited:\n" + tail(log))
        check(time.monotonic() < deadline, "the agent did not listen within 30 s:\n" + tail(log))
        time.sleep(0.1)
    return "127.0.0.1:%d" % port, log


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--convert-worker":
        sys.exit(convert_worker(sys.argv[2:]))
    sys.exit("usage: harness.py --convert-worker TOOL XPLANE OUT (the tests run through pytest)")
