#!/usr/bin/env python3
"""What plain CUPTI charges a PyTorch loop for each part of a capture,
without devtrace, in one process: scripts/gpu-check's check l.

    cupti_cost.py --probe libcupti_cost.so --cupti PATH/libcupti.so.13 --out RESULT.json
                  [--mode launch|gpt2] [--device 0] [--seconds 1.5]
                  [--warmup-seconds 0] [--configs kernels,capture,...]

The loops are marks_workload.py's: launch mode (40 tiny elementwise kernels,
then a synchronize) or gpt2 mode (GPT-2 small training, about 1,150
kernels a step, the job whose captures cost it most; it needs transformers).
A loop warms up (--warmup-seconds more), runs plain, then for each
configuration: CUPTI started that way through the probe
(scripts/gpu/cupti_cost.c: a subscriber first, kernels last, as devtrace
starts a capture), --seconds of steps, CUPTI stopped (kinds off, buffers
flushed, subscriber gone, cuptiFinalize), --seconds of plain steps. A
configuration's cost is judged against the mean rate of the plain phases
either side of it, as microseconds per kernel, (1/on - 1/plain) /
kernels_per_step; what it left behind as the plain phase after it against
the one before. The GPT-2 loop's kernels per step are the most any
configuration that records kernels recorded a step (null when none did).

The result JSON: {"mode", "cupti_version", "kernels_per_step", "plain":
[steps/s of each plain phase], "configs": [{"name", "kinds", "subscriber",
"on" (steps/s), "plain" (the mean either side), "ratio", "us_per_kernel",
"ms_per_step", "after_ratio", "kernels_recorded", "kernels_launched",
"steps", "callbacks", "callbacks_per_kernel", "records": {kind: count},
"error"}]}; {"error":
...} with exit status 1 when the loop or the probe could not run at all,
{"skip": ...} with exit status 3 for gpt2 mode without transformers.
"""

import argparse
import ctypes
import json
import sys
import time

from files import run_to_file  # beside this script
from marks_workload import Gpt2Training, LaunchBound  # beside this script


# CUpti_ActivityKind, unchanged from CUDA 12 to 13.
MEMCPY, MEMSET, DRIVER, RUNTIME, DEVICE, CONTEXT = 1, 2, 4, 5, 8, 9
CONCURRENT_KERNEL, MARKER, OVERHEAD, SYNCHRONIZATION, MEMORY2 = 10, 12, 17, 38, 49
KIND_NAMES = {
    MEMCPY: "memcpy", MEMSET: "memset", DRIVER: "driver", RUNTIME: "runtime", DEVICE: "device",
    CONTEXT: "context", CONCURRENT_KERNEL: "kernel", MARKER: "marker", OVERHEAD: "overhead",
    SYNCHRONIZATION: "synchronization", MEMORY2: "memory2",
}

# devtrace's kinds: between captures with --cuda-record always, and during
# a capture (inject/src/control.rs and inject/src/cupti/mod.rs), kernels last.
ALWAYS = [DEVICE, CONTEXT, MEMCPY, MEMSET, CONCURRENT_KERNEL]
CAPTURE = [DEVICE, CONTEXT, MEMCPY, MEMSET, MEMORY2, OVERHEAD, SYNCHRONIZATION, MARKER, CONCURRENT_KERNEL]


def before_kernels(kinds, *more):
    """`kinds` with `more` enabled before their kernels."""
    return kinds[:-1] + list(more) + kinds[-1:]


# The probe's subscribers (cupti_cost.c): none, one called at every call of
# the driver and runtime domains (devtrace's), one called at the kernel
# launches alone.
NONE, DOMAINS, LAUNCHES = 0, 1, 2
SUBSCRIBERS = {NONE: None, DOMAINS: "driver and runtime domains", LAUNCHES: "kernel launches alone"}

# name -> (kinds, subscriber).
CONFIGS = {
    "kernels": ([CONCURRENT_KERNEL], NONE),
    "subscriber": ([], DOMAINS),
    "kernels+subscriber": ([CONCURRENT_KERNEL], DOMAINS),
    "launch-subscriber": ([], LAUNCHES),
    "kernels+launch-subscriber": ([CONCURRENT_KERNEL], LAUNCHES),
    "always": (ALWAYS, NONE),
    "always+synchronization": (before_kernels(ALWAYS, SYNCHRONIZATION), NONE),
    "always+memory2": (before_kernels(ALWAYS, MEMORY2), NONE),
    "always+marker": (before_kernels(ALWAYS, MARKER), NONE),
    "always+overhead": (before_kernels(ALWAYS, OVERHEAD), NONE),
    "capture": (CAPTURE, NONE),
    "capture+subscriber": (CAPTURE, DOMAINS),
    "capture+launch-subscriber": (CAPTURE, LAUNCHES),
    "capture+runtime": (before_kernels(CAPTURE, RUNTIME), NONE),
    "capture+runtime+driver": (before_kernels(CAPTURE, RUNTIME, DRIVER), NONE),
}
# The GPT-2 loop's steps are 20-40 times longer: the configurations that
# split a capture's kinds, without CUPTI's API records (which only the
# launch-bound loop needs to measure).
GPT2_CONFIGS = [name for name in CONFIGS if "runtime" not in name]


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--probe", required=True, help="libcupti_cost.so (scripts/gpu-pack builds it)")
    p.add_argument("--cupti", required=True, help="the libcupti the job's environment loads")
    p.add_argument("--out", required=True, help="result JSON")
    p.add_argument("--mode", choices=("launch", "gpt2"), default="launch", help="the loop measured")
    p.add_argument("--device", type=int, default=0)
    p.add_argument("--seconds", type=float, default=1.5, help="length of each phase")
    p.add_argument("--warmup-seconds", type=float, default=0.0, help="steps run before the first plain phase")
    p.add_argument("--configs",
                   help="configurations, comma-separated (default: all for launch, those without API records "
                        "for gpt2): " + ", ".join(CONFIGS))
    return p.parse_args()


class Probe:
    def __init__(self, path, cupti):
        self.lib = ctypes.CDLL(path)
        self.lib.cost_open.argtypes = [ctypes.c_char_p, ctypes.POINTER(ctypes.c_uint32)]
        self.lib.cost_start.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_int, ctypes.c_int]
        for name in ("cost_records",):
            getattr(self.lib, name).argtypes = [ctypes.c_int]
        for name in ("cost_records", "cost_callbacks", "cost_buffers_failed"):
            getattr(self.lib, name).restype = ctypes.c_uint64
        self.lib.cost_error.restype = ctypes.c_char_p
        version = ctypes.c_uint32(0)
        self.check(self.lib.cost_open(cupti.encode(), ctypes.byref(version)))
        self.version = version.value

    def check(self, status):
        if status != 0:
            raise RuntimeError(self.lib.cost_error().decode(errors="replace"))

    def start(self, kinds, subscriber):
        array = (ctypes.c_int * max(len(kinds), 1))(*kinds)
        self.check(self.lib.cost_start(array, len(kinds), int(subscriber)))

    def stop(self):
        self.check(self.lib.cost_stop())

    def counts(self):
        kinds = {KIND_NAMES[k]: self.lib.cost_records(k) for k in KIND_NAMES}
        return kinds, self.lib.cost_callbacks()


def run(args):
    import torch

    torch.cuda.set_device(args.device)
    work = LaunchBound(torch, args.device) if args.mode == "launch" else Gpt2Training(torch, args.device)
    kernels_per_step = work.kernels_per_step

    def step():
        work.step()
        torch.cuda.synchronize()

    def rate(seconds):
        steps, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds:
            step()
            steps += 1
        return steps / (time.perf_counter() - start), steps

    for _ in range(200 if args.mode == "launch" else 20):
        step()
    warmup_end = time.monotonic() + args.warmup_seconds
    while time.monotonic() < warmup_end:
        step()
    probe = Probe(args.probe, args.cupti)
    plain = [rate(args.seconds)[0]]
    configs = []
    for name in configs_of(args):
        kinds, subscriber = CONFIGS[name]
        entry = {"name": name, "kinds": [KIND_NAMES[k] for k in kinds], "subscriber": SUBSCRIBERS[subscriber]}
        before, callbacks_before = probe.counts()
        try:
            probe.start(kinds, subscriber)
            on, steps = rate(args.seconds)
        except RuntimeError as e:
            entry["error"] = str(e)
            on, steps = None, 0
        try:
            probe.stop()
        except RuntimeError as e:
            entry.setdefault("error", str(e))
        after, callbacks_after = probe.counts()
        plain.append(rate(args.seconds)[0])
        mean = (plain[-2] + plain[-1]) / 2
        entry.update({
            "on": on,
            "plain": mean,
            "ratio": on / mean if on else None,
            "ms_per_step": (1 / on - 1 / mean) * 1e3 if on else None,
            "after_ratio": plain[-1] / plain[-2],
            "kernels_recorded": after["kernel"] - before["kernel"],
            "records": {k: after[k] - before[k] for k in after if after[k] != before[k]},
            "steps": steps,
            "callbacks": callbacks_after - callbacks_before,
        })
        configs.append(entry)
        print(json.dumps(entry), flush=True)
    if kernels_per_step is None:
        # The most any configuration recorded a step: one that lost records
        # must not set what the others are judged against.
        kernels_per_step = max((c["kernels_recorded"] / c["steps"] for c in configs
                                if c["steps"] and "error" not in c and "kernel" in c["kinds"]), default=None) or None
    for c in configs:
        launched = c["steps"] * kernels_per_step if kernels_per_step else None
        c["kernels_launched"] = round(launched) if launched is not None else None
        c["us_per_kernel"] = c["ms_per_step"] * 1e3 / kernels_per_step if c["on"] and kernels_per_step else None
        c["callbacks_per_kernel"] = c["callbacks"] / launched if launched else None
    return {
        "mode": args.mode,
        "cupti_version": probe.version,
        "kernels_per_step": kernels_per_step,
        "plain": plain,
        "buffers_failed": probe.lib.cost_buffers_failed(),
        "configs": configs,
    }


def configs_of(args):
    if args.configs:
        return args.configs.split(",")
    return list(CONFIGS) if args.mode == "launch" else GPT2_CONFIGS


def main():
    args = parse_args()
    unknown = [n for n in configs_of(args) if n not in CONFIGS]
    if unknown:
        print(f"cupti_cost.py: unknown configurations {unknown}; known: {', '.join(CONFIGS)}", file=sys.stderr)
        return 2
    # Only GPT-2 needs more than torch (transformers).
    skipped = (ImportError,) if args.mode == "gpt2" else ()
    return run_to_file(args.out, lambda: run(args), skipped)


if __name__ == "__main__":
    sys.exit(main())
