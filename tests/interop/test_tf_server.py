"""devtrace's own client and tools against TensorFlow's profiler server:
`devtrace capture` of it, `devtrace inspect`/tools on its trace, and
`client.trace(worker_list=...)` through the agent's NewSession."""

from harness import *  # noqa: F401,F403 - the harness is these tests' vocabulary


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
                                env=env, preexec_fn=set_pdeathsig)
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
        space = load_xspace(path)
        names = [p.name for p in space.planes]
        check("/host:CPU" in names, "planes from TF's server: %s" % names)
        events = sum(len(l.events) for p in space.planes for l in p.lines)
        check(events > 0, "no events in the trace TF's server wrote")
        run.tf_trace = (logdir, "from_tf", os.path.basename(path)[: -len(".xplane.pb")], path)
        # TensorFlow's server records from when it is called: a past window
        # asked of it is another window, and the client says so.
        past = subprocess.run([run.args.bin, "capture", "grpc://127.0.0.1:%d" % port,
                               "--duration", "1s", "--delay-back", "3s", "--logdir", logdir,
                               "--session-id", "past_from_tf", "--quiet"],
                              capture_output=True, text=True, timeout=180)
        check(past.returncode == 0, "devtrace capture --delay-back failed: %s" % past.stderr.strip())
        said = [line for line in past.stderr.splitlines() if "after the window's start" in line]
        check(len(said) == 1 and "--delay-back" in said[0],
              "a past window TF's server did not record, not said: %r" % past.stderr)
        return "%s: %d events, planes %s; --delay-back said: %s" % (
            os.path.basename(path), events, names, said[0])
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
                                preexec_fn=set_pdeathsig)
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
            compare = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "py", "compare_memory_profile.py"),
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
