#!/usr/bin/env python3
"""A deterministic PyTorch workload for scripts/gpu-check.

Each step, inside an NVTX range `step_<i>`: a 1024x1024 and a 4096x4096
matmul (fp32, TF32 off), a 3x3 conv2d, a 16 MiB host-to-device copy and an
8 MiB device-to-host copy (pinned memory, asynchronous), and one replay of a
CUDA graph (256x256 matmul + relu, captured once at setup); then a device
synchronize. Modes:

  plain    warm up, time STEPS steps, write the result and exit
  compare  warm up, time STEPS steps (the "idle" phase), touch SIGNALS/ready,
           wait for SIGNALS/start, time STEPS steps (the "capture" phase),
           touch SIGNALS/captured, wait for SIGNALS/torch, run STEPS steps
           under torch.profiler, write the result, touch SIGNALS/done
  coexist  warm up, touch SIGNALS/ready, wait for SIGNALS/start, run STEPS
           steps, then STEPS steps under torch.profiler, then STEPS steps
           again, write the result, touch SIGNALS/done

The result (--out, JSON) has the phases' timings and what torch.profiler saw:
kernel names with their durations (us), copies and memsets with their bytes,
runtime and driver calls, and the kernels that ran from graph launches.
Errors are written to the result as {"error": ...} with exit status 1.
"""

import argparse
import json
import os
import sys
import time
import traceback
from collections import Counter, defaultdict

from files import touch, write_json  # beside this script

MATMUL_SIZES = (1024, 4096)
CONV_INPUT = (32, 64, 56, 56)
CONV_WEIGHT = (128, 64, 3, 3)
H2D_BYTES = 16 << 20
D2H_BYTES = 8 << 20
GRAPH_SIZE = 256


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", choices=("plain", "compare", "coexist"), required=True)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--device", type=int, default=0)
    p.add_argument("--signals", help="directory of the ready/start/... files (compare, coexist)")
    p.add_argument("--out", required=True, help="result JSON")
    p.add_argument("--wait-timeout", type=float, default=120.0, help="longest wait for a signal file, seconds")
    return p.parse_args()



def wait_for(path, timeout):
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {path} after {timeout:.0f} s")
        time.sleep(0.005)



class Workload:
    def __init__(self, torch, device):
        import torch.nn.functional as F

        self.torch = torch
        self.F = F
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        torch.backends.cudnn.benchmark = False
        torch.backends.cudnn.deterministic = True
        torch.cuda.set_device(device)
        dev = torch.device("cuda", device)
        gen = torch.Generator().manual_seed(1234)

        def randn(*shape):
            return torch.randn(*shape, generator=gen).to(dev)

        self.mm = [(randn(n, n), randn(n, n), torch.empty(n, n, device=dev)) for n in MATMUL_SIZES]
        self.conv_x = randn(*CONV_INPUT)
        self.conv_w = randn(*CONV_WEIGHT)
        self.h2d_src = torch.ones(H2D_BYTES // 4, dtype=torch.float32).pin_memory()
        self.h2d_dst = torch.empty(H2D_BYTES // 4, dtype=torch.float32, device=dev)
        self.d2h_src = torch.ones(D2H_BYTES // 4, dtype=torch.float32, device=dev)
        self.d2h_dst = torch.empty(D2H_BYTES // 4, dtype=torch.float32).pin_memory()

        # The CUDA graph: warmed up on a side stream, then captured once.
        self.g_in = randn(GRAPH_SIZE, GRAPH_SIZE)
        self.g_w = randn(GRAPH_SIZE, GRAPH_SIZE)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                torch.relu(self.g_in @ self.g_w)
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.g_out = torch.relu(self.g_in @ self.g_w)
        torch.cuda.synchronize()
        self.next_step = 0

    def step(self):
        torch, F = self.torch, self.F
        i = self.next_step
        self.next_step += 1
        torch.cuda.nvtx.range_push(f"step_{i}")
        for a, b, c in self.mm:
            torch.mm(a, b, out=c)
        self.conv_y = F.conv2d(self.conv_x, self.conv_w, padding=1)
        self.h2d_dst.copy_(self.h2d_src, non_blocking=True)
        self.d2h_dst.copy_(self.d2h_src, non_blocking=True)
        self.graph.replay()
        torch.cuda.nvtx.range_pop()
        torch.cuda.synchronize()

    def timed(self, steps):
        wall0 = time.time()
        t0 = time.perf_counter()
        for _ in range(steps):
            self.step()
        seconds = time.perf_counter() - t0
        return {
            "steps": steps,
            "seconds": seconds,
            "steps_per_s": steps / seconds if seconds > 0 else None,
            "wall_start": wall0,
            "wall_end": time.time(),
        }

    def profiled(self, steps, trace_path):
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            phase = self.timed(steps)
        prof.export_chrome_trace(trace_path)
        return phase, summarize_kineto(trace_path)


def summarize_kineto(path):
    """What torch.profiler (Kineto) recorded, from its Chrome trace export."""
    with open(path) as f:
        doc = json.load(f)
    events = doc.get("traceEvents", doc) if isinstance(doc, dict) else doc
    kernels = defaultdict(list)
    kernel_correlations = []
    graph_arg_kernels = 0
    memcpy = defaultdict(lambda: {"count": 0, "bytes": 0})
    memset = defaultdict(lambda: {"count": 0, "bytes": 0})
    runtime = Counter()
    driver = Counter()
    graph_launch_correlations = set()
    for e in events:
        if not isinstance(e, dict) or e.get("ph") != "X":
            continue
        cat = str(e.get("cat", "")).lower()
        name = e.get("name", "")
        args = e.get("args") or {}
        if cat == "kernel":
            kernels[name].append(float(e.get("dur", 0.0)))
            kernel_correlations.append(args.get("correlation"))
            if any("graph" in k.lower() and args.get(k) not in (None, 0, "0", "") for k in args):
                graph_arg_kernels += 1
        elif cat == "gpu_memcpy":
            memcpy[name]["count"] += 1
            memcpy[name]["bytes"] += int(args.get("bytes", 0) or 0)
        elif cat == "gpu_memset":
            memset[name]["count"] += 1
            memset[name]["bytes"] += int(args.get("bytes", 0) or 0)
        elif cat == "cuda_runtime":
            runtime[name] += 1
            if "GraphLaunch" in name:
                graph_launch_correlations.add(args.get("correlation"))
        elif cat == "cuda_driver":
            driver[name] += 1
            if "GraphLaunch" in name:
                graph_launch_correlations.add(args.get("correlation"))
    graph_launch_correlations.discard(None)
    by_correlation = sum(1 for c in kernel_correlations if c in graph_launch_correlations)
    return {
        "trace": path,
        "kernels": dict(kernels),
        "memcpy": dict(memcpy),
        "memset": dict(memset),
        "runtime_calls": dict(runtime),
        "driver_calls": dict(driver),
        "graph_launches": sum(n for k, n in runtime.items() if "GraphLaunch" in k),
        "graph_kernels": max(by_correlation, graph_arg_kernels),
    }


def mapped_cupti():
    paths = set()
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                if "libcupti" in line:
                    paths.add(line.split()[-1])
    except OSError:
        pass
    return sorted(paths)


def main():
    args = parse_args()
    result = {"mode": args.mode, "pid": os.getpid(), "steps": args.steps, "phases": {}}
    keep = ("CUDA_INJECTION64_PATH", "LD_PRELOAD", "NVTX_INJECTION64_PATH", "DEVTRACE_RUNTIME_DIR", "DEVTRACE_CUPTI_PATH")
    result["env"] = {k: os.environ[k] for k in keep if k in os.environ}
    sig = (lambda name: os.path.join(args.signals, name)) if args.signals else None
    if args.mode != "plain" and not args.signals:
        raise SystemExit("--signals is needed for this mode")
    try:
        import torch

        result["torch"] = torch.__version__
        result["cuda"] = torch.version.cuda
        if not torch.cuda.is_available():
            raise RuntimeError("torch.cuda.is_available() is False")
        result["device_name"] = torch.cuda.get_device_name(args.device)
        w = Workload(torch, args.device)
        for _ in range(args.warmup):
            w.step()
        trace_path = os.path.splitext(args.out)[0] + ".torch_trace.json"
        if args.mode == "plain":
            result["phases"]["plain"] = w.timed(args.steps)
        elif args.mode == "compare":
            result["phases"]["idle"] = w.timed(args.steps)
            ready = {"pid": os.getpid(), "idle_steps_per_s": result["phases"]["idle"]["steps_per_s"]}
            touch(sig("ready"), json.dumps(ready))
            wait_for(sig("start"), args.wait_timeout)
            result["phases"]["capture"] = w.timed(args.steps)
            touch(sig("captured"), repr(time.time()))
            wait_for(sig("torch"), args.wait_timeout)
            result["phases"]["profiled"], result["torch_profiler"] = w.profiled(args.steps, trace_path)
        else:
            touch(sig("ready"), json.dumps({"pid": os.getpid()}))
            wait_for(sig("start"), args.wait_timeout)
            result["phases"]["before"] = w.timed(args.steps)
            result["phases"]["profiled"], result["torch_profiler"] = w.profiled(args.steps, trace_path)
            result["phases"]["after"] = w.timed(args.steps)
        result["libcupti_mapped"] = mapped_cupti()
        write_json(args.out, result)
        if sig:
            touch(sig("done"), repr(time.time()))
        return 0
    except BaseException as e:  # noqa: BLE001 - the caller reads the reason from the result
        result["error"] = f"{type(e).__name__}: {e}"
        result["traceback"] = traceback.format_exc()
        result["libcupti_mapped"] = mapped_cupti()
        write_json(args.out, result)
        print(result["traceback"], file=sys.stderr)
        if sig:
            touch(sig("done"), "error")
        return 1


if __name__ == "__main__":
    sys.exit(main())
