"""The tap in front of a tf.distribute server: graph and eager clients work
through it unchanged, and a capture shows their steps and ops."""

from harness import *  # noqa: F401,F403 - the harness is these tests' vocabulary


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
                                  env=env, preexec_fn=set_pdeathsig)
    run.extra_procs.append(server)
    agent_log = os.path.join(run.workdir, "tap-agent.log")
    with open(agent_log, "wb") as logf:
        agent = subprocess.Popen([run.args.bin, "serve", "--listen", "127.0.0.1:%d" % agent_port,
                                  "--mock-rate", "0", "--tap",
                                  "127.0.0.1:%d=127.0.0.1:%d" % (tap_port, tf_port)],
                                 stdin=subprocess.DEVNULL, stdout=logf, stderr=subprocess.STDOUT,
                                 preexec_fn=set_pdeathsig)
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
                         preexec_fn=set_pdeathsig)
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
    space = load_xspace(out.stdout.strip())
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
