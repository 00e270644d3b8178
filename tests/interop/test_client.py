"""The TensorFlow client against the agent: the server answers, `client.trace`
writes one XSpace in TensorBoard's layout with what it should hold, session
ids and host overrides are honoured, `Monitor`, grpc.health and /metrics
answer, and the server is still running at the end."""

from harness import *  # noqa: F401,F403 - the harness is these tests' vocabulary


def test_server_starts(run):
    return run.wait_until_serving()


def test_trace_writes_one_xplane(run):
    return run.first_trace()


def test_xspace_contents(run):
    run.first_trace()
    run.import_tf()
    xs = load_xspace(run.xplane_path)
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
