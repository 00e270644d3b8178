"""pytest setup of the interop tests: options, the one `run` shared by every
test (the server is started once, stopped at the end), the order the tests
run in, and what the report prints.

    pytest tests/interop --bin target/debug/devtrace   # the agent (mock backend)
    pytest tests/interop --tf-server                   # TensorFlow's own profiler server

scripts/interop provides the venv (tensorflow-cpu, xprof, jax, grpcio health,
pytest) and runs this.
"""

import faulthandler
import os
import shutil
import signal
import sys

import pytest

import harness

# The order tests run in, whatever file they are in: a few read what an
# earlier one left in the run (TF's own trace, the tap), and the server's
# survival is checked after everything else.
ORDER = [
    "test_server_starts",
    "test_trace_writes_one_xplane",
    "test_xspace_contents",
    "test_trace_session_id_and_override_hostname",
    "test_tool_names",
    "test_trace_viewer_streaming",
    "test_trace_viewer",
    "test_overview_page",
    "test_memory_profile",
    "test_kernel_stats",
    "test_chunked_trace_in_xprof",
    "test_trigger_session_in_xprof",
    "test_monitor",
    "test_grpc_health_and_metrics",
    "test_devtrace_capture_against_tf_server",
    "test_devtrace_tools_on_tf_trace",
    "test_worker_list_new_session",
    "test_federation_with_tf_server",
    "test_federation_with_jax_server",
    "test_tap_graph_session",
    "test_tap_eager_client",
    "test_tap_capture_shows_steps_and_ops",
    "test_cuda_injection_in_xprof",
    "test_server_survived",
]


def pytest_addoption(parser):
    group = parser.getgroup("devtrace interop")
    group.addoption("--bin", default=os.environ.get("DEVTRACE_BIN", "target/debug/devtrace"),
                    help="the agent binary (agent mode; default $DEVTRACE_BIN or target/debug/devtrace)")
    group.addoption("--tf-server", dest="mode", action="store_const", const="tf-server",
                    default="agent",
                    help="test against TensorFlow's own profiler server instead of the agent")
    group.addoption("--keep", action="store_true", help="keep the work directory")


def pytest_configure(config):
    # A last resort: a hung client or converter must not hang CI.
    faulthandler.enable()
    faulthandler.dump_traceback_later(harness.GLOBAL_TIMEOUT_S, exit=True)


def pytest_collection_modifyitems(items):
    known = {name: index for index, name in enumerate(ORDER)}
    unknown = [item.name for item in items if item.name not in known]
    if unknown:
        raise pytest.UsageError("tests missing from conftest.ORDER: %s" % ", ".join(unknown))
    items.sort(key=lambda item: known[item.name])


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem):
    """Calls the test and prints the detail it returns after its name."""
    names = pyfuncitem._fixtureinfo.argnames
    detail = pyfuncitem.obj(**{name: pyfuncitem.funcargs[name] for name in names})
    if detail:
        print("%s: %s" % (pyfuncitem.name, detail))
    return True


@pytest.fixture(scope="session")
def run(request):
    options = request.config.option
    if options.mode == "agent":
        binary = options.bin
        if not os.path.isfile(binary) or not os.access(binary, os.X_OK):
            pytest.exit("agent binary %r not found or not executable (build it first, or set "
                        "DEVTRACE_BIN / --bin)" % binary, returncode=1)
        options.bin = os.path.abspath(binary)
    the_run = harness.Run(options)
    print("interop mode=%s addr=%s workdir=%s" % (the_run.mode, the_run.addr, the_run.workdir))

    def on_signal(signum, _frame):
        the_run.stop_server()
        os._exit(128 + signum)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    the_run.start_server()
    try:
        yield the_run
    finally:
        the_run.stop_server()
        _report(the_run, request.session.testsfailed > 0 or options.keep)


def _report(the_run, keep):
    lines = []
    if the_run.conv.xplane:
        extra = [f for f, _ in harness.list_files(os.path.dirname(the_run.conv.xplane))
                 if f != os.path.basename(the_run.conv.xplane)]
        lines.append("the XProf converters wrote next to the input: %s" % extra)
    if the_run.conv.seconds:
        lines.append("timings: converters %s" % ", ".join(
            "%s=%.1fs" % kv for kv in the_run.conv.seconds.items()))
    if the_run.timings:
        lines.append("timings: %s" % ", ".join("%s=%.2f" % kv for kv in the_run.timings.items()))
    if keep:
        lines.append("work directory kept: %s (server log: %s)" % (the_run.workdir, the_run.server_log))
    else:
        shutil.rmtree(the_run.workdir, ignore_errors=True)
    _NOTES.extend(lines)


_NOTES = []


def pytest_terminal_summary(terminalreporter):
    for line in _NOTES:
        terminalreporter.write_line(line)


def pytest_sessionfinish(session, exitstatus):
    session.config._interop_exitstatus = int(exitstatus)


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    # TensorFlow's and gRPC's threads can stall interpreter shutdown; the
    # server is stopped and the report printed by now.
    status = getattr(config, "_interop_exitstatus", None)
    if status is not None:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
