"""Bursts of concurrent captures of distinct windows against an agent held
in a memory cgroup, as its systemd unit and DaemonSet hold it.

Starts `devtrace serve --backend mock --mock-rate RATE` inside a fresh memory
cgroup (v1 or v2) limited to LIMIT bytes, waits until its flight recorder is
warm, then fires each burst: N `devtrace capture` clients at once, each asking
for its own window (a few milliseconds after the one before, as real clients'
windows differ), all ending within a moment of each other. After each burst it prints the cgroup's peak memory,
whether the kernel OOM-killed anything, how each capture ended, and whether the
agent still answers /healthz and a capture.

Usage: burst.py BINARY [--limit BYTES] [--rate N] [--warm S] [--bursts 16,64]
                [--duration S] [--json]
Exit status: 0 when the agent lived through every burst, 1 otherwise.
"""

import argparse
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request


class Cgroup:
    """A memory cgroup of its own, removed on close."""

    def __init__(self, name, limit):
        v1 = "/sys/fs/cgroup/memory"
        if os.path.exists(os.path.join(v1, "memory.limit_in_bytes")):
            self.dir = os.path.join(v1, name)
            os.mkdir(self.dir)
            self.v1 = True
            self._write("memory.limit_in_bytes", str(limit))
            # Swap would hide an excess: the limit is on memory and swap.
            try:
                self._write("memory.memsw.limit_in_bytes", str(limit))
            except OSError:
                pass
        else:
            self.dir = os.path.join("/sys/fs/cgroup", name)
            os.mkdir(self.dir)
            self.v1 = False
            self._write("memory.max", str(limit))
            self._write("memory.swap.max", "0")

    def _write(self, name, value):
        with open(os.path.join(self.dir, name), "w") as f:
            f.write(value)

    def _read(self, name):
        with open(os.path.join(self.dir, name)) as f:
            return f.read()

    def procs_file(self):
        return os.path.join(self.dir, "cgroup.procs")

    def reset_peak(self):
        if self.v1:
            self._write("memory.max_usage_in_bytes", "0")
        else:
            try:
                self._write("memory.peak", "0")
            except OSError:
                pass

    def peak(self):
        name = "memory.max_usage_in_bytes" if self.v1 else "memory.peak"
        return int(self._read(name))

    def current(self):
        name = "memory.usage_in_bytes" if self.v1 else "memory.current"
        return int(self._read(name))

    def oom_kills(self):
        if self.v1:
            text = self._read("memory.oom_control")
        else:
            text = self._read("memory.events")
        match = re.search(r"oom_kill (\d+)", text)
        return int(match.group(1)) if match else 0

    def close(self):
        for _ in range(50):
            try:
                os.rmdir(self.dir)
                return
            except OSError:
                time.sleep(0.1)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def healthz(metrics, timeout=2.0):
    try:
        with urllib.request.urlopen(f"http://{metrics}/healthz", timeout=timeout) as r:
            return r.status == 200
    except Exception:
        return False


def capture(binary, address, logdir, duration, delay, timeout):
    """Starts one capture of `duration` seconds, starting `delay` seconds
    from now (in the past when negative)."""
    when = (["--delay", f"{int(delay * 1000)}ms"] if delay >= 0
            else ["--delay-back", f"{int(-delay * 1000)}ms"])
    return subprocess.Popen(
        [binary, "capture", address, "--logdir", logdir, "--quiet",
         "--duration", f"{int(duration * 1000)}ms"] + when,
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def outcome(process, timeout):
    try:
        _, err = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.communicate()
        return "timed out"
    if process.returncode == 0:
        return "delivered"
    if "RESOURCE_EXHAUSTED" in err or "ResourceExhausted" in err or "resource" in err.lower():
        return "refused (budget)"
    return "failed: " + (err.strip().splitlines() or ["?"])[-1][:160]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("binary")
    parser.add_argument("--limit", type=int, default=1 << 30)
    parser.add_argument("--rate", type=int, default=1_000_000)
    parser.add_argument("--warm", type=float, default=26.0)
    parser.add_argument("--bursts", default="16,64")
    parser.add_argument("--duration", type=float, default=1.0)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--agent-args", default="", help="more `serve` flags, space-separated")
    args = parser.parse_args()

    work = tempfile.mkdtemp(prefix="devtrace-burst-")
    cgroup = Cgroup(f"devtrace-burst-{os.getpid()}", args.limit)
    port, metrics_port = free_port(), free_port()
    address, metrics = f"127.0.0.1:{port}", f"127.0.0.1:{metrics_port}"
    log = open(os.path.join(work, "agent.log"), "w")
    agent = subprocess.Popen(
        ["sh", "-c", f"echo $$ > {cgroup.procs_file()} && exec \"$0\" \"$@\"", args.binary,
         "serve", "--listen", address, "--metrics-listen", metrics,
         "--backend", "mock", "--mock-rate", str(args.rate)] + args.agent_args.split(),
        stdout=log, stderr=subprocess.STDOUT)
    results = {"limit": args.limit, "rate": args.rate, "bursts": []}
    alive = True
    try:
        deadline = time.time() + 30
        while not healthz(metrics) and time.time() < deadline:
            time.sleep(0.1)
        time.sleep(args.warm)
        for n in [int(x) for x in args.bursts.split(",") if x]:
            resident_before = cgroup.current()
            cgroup.reset_peak()
            before = cgroup.oom_kills()
            started = time.time()
            # Windows a little apart: distinct (none shares another's build),
            # ending close together (their builds overlap), starting once
            # every client has asked.
            clients = [capture(args.binary, address, os.path.join(work, f"b{n}-{i}"),
                               args.duration, 2.0 + 0.011 * i, 120) for i in range(n)]
            probes = []
            while any(c.poll() is None for c in clients):
                probes.append(healthz(metrics))
                time.sleep(0.5)
            outcomes = [outcome(c, 120) for c in clients]
            elapsed = time.time() - started
            after_healthz = healthz(metrics)
            check = capture(args.binary, address, os.path.join(work, f"after{n}"), 0.2, -1.0, 60)
            after_capture = outcome(check, 60)
            burst = {
                "captures": n,
                "peak_bytes": cgroup.peak(),
                "oom_kills": cgroup.oom_kills() - before,
                "agent_alive": agent.poll() is None,
                "outcomes": {k: outcomes.count(k) for k in sorted(set(outcomes))},
                "seconds": round(elapsed, 2),
                "healthz_during": f"{sum(probes)}/{len(probes)}",
                "healthz_after": after_healthz,
                "capture_after": after_capture,
                "resident_before_bytes": resident_before,
                "resident_after_bytes": cgroup.current(),
            }
            results["bursts"].append(burst)
            if not args.json:
                print(f"{n} concurrent captures of distinct {args.duration:g} s windows at "
                      f"{args.rate} events/s in a {args.limit >> 20} MiB cgroup: peak "
                      f"{burst['peak_bytes'] / 2**20:.0f} MiB, OOM kills {burst['oom_kills']}, "
                      f"agent {'alive' if burst['agent_alive'] else 'DEAD'}, {burst['outcomes']}, "
                      f"{elapsed:.1f} s, /healthz during {burst['healthz_during']}, after: "
                      f"healthz {after_healthz}, capture {after_capture}, resident "
                      f"{burst['resident_after_bytes'] / 2**20:.0f} MiB", flush=True)
            if not burst["agent_alive"]:
                alive = False
                break
    finally:
        agent.terminate()
        try:
            agent.wait(timeout=20)
        except subprocess.TimeoutExpired:
            agent.kill()
            agent.wait()
        log.close()
        cgroup.close()
        if not alive:
            print(f"agent log kept: {os.path.join(work, 'agent.log')}", file=sys.stderr)
        else:
            shutil.rmtree(work, ignore_errors=True)
    if args.json:
        print(json.dumps(results))
    return 0 if alive else 1


if __name__ == "__main__":
    sys.exit(main())
