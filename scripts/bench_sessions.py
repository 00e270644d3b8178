#!/usr/bin/env python3
"""Session and tool benchmarks, printed as ratios measured in the same run.

1. `devtrace session new` over 8 agents (separate ports on loopback) against
   the slowest of the same 8 hosts captured one at a time: the fan-out should
   cost about one capture, not eight.
2. devtrace's trace_viewer and memory_profile converters against XProf's own
   (`xprof.convert.raw_to_tool_data`) on the same large trace, when the
   interop venv has xprof.
Nothing here fails on a number; it reports.
"""
import os
import shutil
import subprocess
import sys
import tempfile
import time

binary = sys.argv[1]
quick = "--quick" in sys.argv
HOSTS = 8
duration = "300ms" if quick else "1s"


def start_agent(rate, extra=()):
    proc = subprocess.Popen([binary, "serve", "--listen", "127.0.0.1:0", "--log-level", "warn",
                             "--mock-rate", str(rate), *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    line = proc.stdout.readline().strip()
    prefix = "devtrace listening on "
    if not line.startswith(prefix):
        proc.kill()
        sys.exit("agent did not start: %r" % line)
    return proc, line[len(prefix):]


def timed(args):
    t0 = time.monotonic()
    out = subprocess.run(args, capture_output=True, text=True)
    elapsed = time.monotonic() - t0
    if out.returncode != 0:
        sys.exit("%s failed: %s" % (" ".join(args[:3]), out.stderr.strip()))
    return elapsed, out.stdout


work = tempfile.mkdtemp(prefix="devtrace-bench-sessions-")
agents = []
try:
    agents = [start_agent(50_000) for _ in range(HOSTS)]
    addresses = [a for _, a in agents]
    singles = []
    for address in addresses:
        elapsed, _ = timed([binary, "capture", "grpc://" + address, "--duration", duration,
                            "--logdir", os.path.join(work, "single"), "--quiet"])
        singles.append(elapsed)
    slowest = max(singles)
    elapsed, out = timed([binary, "session", "new", "--hosts", ",".join(addresses),
                          "--logdir", os.path.join(work, "fleet"), "--duration", duration])
    landed = len(out.split())
    print("NewSession over %d hosts (%s window): %.0f ms  (%.2fx the slowest single host: %.0f ms; "
          "target: close to 1x) %d traces landed" % (HOSTS, duration, elapsed * 1e3, elapsed / slowest,
                                                     slowest * 1e3, landed))
finally:
    for proc, _ in agents:
        proc.kill()
        proc.wait()

# A large trace for the converters.
proc, address = start_agent(500_000 if quick else 1_000_000)
try:
    _, path = timed([binary, "capture", "grpc://" + address, "--duration", "1s" if quick else "2s",
                     "--logdir", os.path.join(work, "big"), "--session-id", "big", "--quiet"])
    path = path.strip()
finally:
    proc.kill()
    proc.wait()
size_mib = os.path.getsize(path) / 2**20
host = os.path.basename(path)[: -len(".xplane.pb")]
try:
    from xprof.convert import raw_to_tool_data as r2t  # noqa: F401
    have_xprof = True
except ImportError:
    have_xprof = False
for tool, params in [("trace_viewer", ["--param", "resolution=0"]), ("memory_profile", [])]:
    ours, _ = timed([binary, "tool", os.path.join(work, "big"), "big", tool, "--host", host,
                     "--output", os.path.join(work, tool + ".json"), *params])
    if not have_xprof:
        print("%s on a %.0f MiB trace: devtrace %.0f ms (xprof not installed here: run scripts/interop "
              "once to create .venv)" % (tool, size_mib, ours * 1e3))
        continue
    copy_dir = tempfile.mkdtemp(dir=work)
    copy = os.path.join(copy_dir, os.path.basename(path))
    shutil.copy(path, copy)
    code = ("import sys,time\nfrom xprof.convert import raw_to_tool_data as r2t\n"
            "t=time.monotonic()\nd,_=r2t.xspace_to_tool_data([sys.argv[1]], sys.argv[2], {})\n"
            "print(time.monotonic()-t, len(d or b''))")
    out = subprocess.run([sys.executable, "-c", code, copy, tool], capture_output=True, text=True)
    if out.returncode != 0:
        print("%s: XProf's converter failed: %s" % (tool, out.stderr.strip()[-300:]))
        continue
    theirs = float(out.stdout.split()[0])
    print("%s on a %.0f MiB trace: devtrace %.0f ms  (%.2fx XProf's converter: %.0f ms, measured inside "
          "its process, without interpreter start-up)" % (tool, size_mib, ours * 1e3, ours / theirs,
                                                           theirs * 1e3))
shutil.rmtree(work, ignore_errors=True)
