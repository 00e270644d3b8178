#!/usr/bin/env python3
"""Session and tool benchmarks, printed as ratios measured in the same run.

1. `devtrace session new` over 8, 32 and 128 agents, each on its own loopback
   address (127.91.0.x, one port), named by one Slurm hostlist: the session's
   time against the slowest of the same hosts captured one at a time (the
   fan-out should cost about one capture, not one per host; target at most
   1.5x), and the coordinator's peak RSS against that of the 8-host session
   (traces are written as they arrive, so it should stay flat; target at
   most 1.5x). 128 agents keep two cores busy by themselves, so the largest
   session is then run once more against one agent listening on 0.0.0.0,
   reached through 128 addresses: the same calls and traces for the
   coordinator, without 128 processes competing for the CPU.
2. devtrace's trace_viewer and memory_profile converters against XProf's own
   (`xprof.convert.raw_to_tool_data`) on the same large trace, when the
   interop venv has xprof.
Nothing here fails on a number; it reports.
"""
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time

binary = sys.argv[1]
quick = "--quick" in sys.argv
SIZES = [4, 8] if quick else [8, 32, 128]
duration = "300ms" if quick else "1s"
# 128 agents share this machine: the mock backend alone, a few events per
# second each, a small flight recorder and no metrics endpoint.
FLEET_RATE = 2_000
FLEET_AGENT = ("--backend", "mock", "--store-size", "8MiB", "--metrics-listen", "off")
FLEET_NET = "127.91.0"
SHARED_NET = "127.92.0"
# Hosts of each size captured alone for the baseline: all of a small fleet,
# an even sample of a large one (one at a time, each takes a window).
SINGLES = 16


def start_agent(rate, extra=(), listen="127.0.0.1:0"):
    return read_address(spawn_agent(rate, extra, listen))


def spawn_agent(rate, extra=(), listen="127.0.0.1:0"):
    return subprocess.Popen([binary, "serve", "--listen", listen, "--log-level", "warn",
                             "--mock-rate", str(rate), *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)


def read_address(proc):
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


def port_free_on(hosts):
    for _ in range(50):
        probe = socket.socket()
        probe.bind((hosts[0], 0))
        port = probe.getsockname()[1]
        held, ok = [probe], True
        for host in hosts[1:]:
            s = socket.socket()
            try:
                s.bind((host, port))
                held.append(s)
            except OSError:
                ok = False
                break
        for s in held:
            s.close()
        if ok:
            return port
    sys.exit("no port free on all of %s.x" % FLEET_NET)


def verdict(met):
    return "MET" if met else "MISSED"


def run_session(hosts_arg, logdir):
    """`session new` alone, reaped with wait4 for its own peak RSS: seconds,
    stdout, MiB. Its output goes to files, so that it never waits on a pipe."""
    args = [binary, "session", "new", "--hosts", hosts_arg, "--logdir", logdir,
            "--duration", duration]
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        t0 = time.monotonic()
        proc = subprocess.Popen(args, stdout=out, stderr=err)
        _, status, usage = os.wait4(proc.pid, 0)
        elapsed = time.monotonic() - t0
        proc.returncode = status
        out.seek(0)
        err.seek(0)
        if status != 0:
            sys.exit("session new over %s failed: %s" % (hosts_arg, err.read().decode()[-2000:]))
        return elapsed, out.read().decode(), usage.ru_maxrss / 1024


work = tempfile.mkdtemp(prefix="devtrace-bench-sessions-")
agents = []
try:
    count = max(SIZES)
    addresses = ["%s.%d" % (FLEET_NET, i) for i in range(1, count + 1)]
    port = port_free_on(addresses)
    children = [spawn_agent(FLEET_RATE, FLEET_AGENT, "%s:%d" % (a, port)) for a in addresses]
    agents = [read_address(child) for child in children]
    # Let every flight recorder hold more than a window.
    time.sleep(1.5)
    singles = {}

    def single(index):
        if index not in singles:
            target = "grpc://%s:%d" % (addresses[index], port)
            singles[index], _ = timed([binary, "capture", target, "--duration", duration,
                                       "--logdir", os.path.join(work, "single"), "--quiet"])
        return singles[index]

    baseline_mib = None
    for size in SIZES:
        sample = range(0, size, max(1, size // SINGLES))
        slowest = max(single(i) for i in sample)
        hosts_arg = "%s.[1-%d]:%d" % (FLEET_NET, size, port)
        elapsed, out, peak_mib = run_session(hosts_arg, os.path.join(work, "fleet%d" % size))
        landed = len(out.split())
        ratio = elapsed / slowest
        print("session over %3d hosts (%s window, %d events/s each): %.0f ms  (%.2fx the slowest "
              "single host: %.0f ms, of %d captured alone; target: at most 1.5x) %s; %d traces landed"
              % (size, duration, FLEET_RATE, elapsed * 1e3, ratio, slowest * 1e3, len(sample),
                 verdict(ratio <= 1.5), landed))
        if baseline_mib is None:
            baseline_mib = peak_mib
        rss_ratio = peak_mib / baseline_mib
        print("   coordinator peak RSS over %3d hosts: %.1f MiB  (%.2fx that over %d hosts: %.1f MiB;"
              " target: flat, at most 1.5x) %s" % (size, peak_mib, rss_ratio, SIZES[0],
                                                  baseline_mib, verdict(rss_ratio <= 1.5)))
finally:
    for proc, _ in agents:
        proc.kill()
        proc.wait()
    agents = []

# The largest session again, every address served by one agent.
try:
    count = max(SIZES)
    addresses = ["%s.%d" % (SHARED_NET, i) for i in range(1, count + 1)]
    port = port_free_on(["0.0.0.0"])
    agents = [start_agent(FLEET_RATE, (*FLEET_AGENT, "--insecure"), "0.0.0.0:%d" % port)]
    time.sleep(1.5)
    sample = range(0, count, max(1, count // SINGLES))
    slowest = max(timed([binary, "capture", "grpc://%s:%d" % (addresses[i], port), "--duration",
                         duration, "--logdir", os.path.join(work, "single"), "--quiet"])[0]
                  for i in sample)
    hosts_arg = "%s.[1-%d]:%d" % (SHARED_NET, count, port)
    elapsed, out, peak_mib = run_session(hosts_arg, os.path.join(work, "shared"))
    ratio = elapsed / slowest
    print("   the %d-host session against one agent behind %s.[1-%d]: %.0f ms  (%.2fx the slowest "
          "single host: %.0f ms, of %d captured alone; target: at most 1.5x) %s; %d traces landed;"
          " coordinator peak RSS %.1f MiB" % (count, SHARED_NET, count, elapsed * 1e3, ratio,
                                               slowest * 1e3, len(sample), verdict(ratio <= 1.5),
                                               len(out.split()), peak_mib))
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
