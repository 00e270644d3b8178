"""--upstream: a TensorFlow and a JAX profiler server's traces merged into the
agent's capture on its time base."""

from harness import *  # noqa: F401,F403 - the harness is these tests' vocabulary


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
                                          preexec_fn=set_pdeathsig))
        with open(os.path.join(run.workdir, "%s-federating-agent.log" % name), "wb") as logf:
            procs.append(subprocess.Popen([run.args.bin, "serve", "--listen", "127.0.0.1:%d" % agent_port,
                                           "--upstream", "127.0.0.1:%d" % up_port],
                                          stdin=subprocess.DEVNULL, stdout=logf, stderr=subprocess.STDOUT,
                                          preexec_fn=set_pdeathsig))
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
        space = load_xspace(out.stdout.strip())
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
