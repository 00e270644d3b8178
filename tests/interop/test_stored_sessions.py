"""Sessions the agent writes itself, opened by XProf: a trace past
--chunk-traces-over stored as .xplane.riegeli chunks, and the session a
trigger saves."""

from harness import *  # noqa: F401,F403 - the harness is these tests' vocabulary


CHUNK_THRESHOLD = "1MiB"
INSPECT_TOP_RE = re.compile(r"^\s+[\d.]+ ms\s+(\d+)x\s+(.*)$")

def _riegeli_agent(run, root):
    return side_agent(run, "riegeli", ["--allow-root", root, "--chunk-traces-over", CHUNK_THRESHOLD])


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
    procs, _ = trace_processes(doc, "trace_viewer")
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
    _, log = side_agent(run, "trigger", [
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
