#!/usr/bin/env python3
"""A short-lived PyTorch process for scripts/gpu-check's check h: one run of
a sequence of devtrace captures and torch.profiler windows, ending in the
process's exit, so that the exit status says whether the injection library
left the heap and CUPTI sound.

Each step launches 40 tiny elementwise kernels, then synchronizes. After 5
warm-up steps the process writes SIGNALS/ready ({"pid": ...}) and runs steps
until SIGNALS/exit exists, then returns from main (a normal interpreter
exit, with CUDA's and the library's exit handlers, whatever capture is in
flight). Each time a file SIGNALS/profile-<n> appears, it runs the number of
seconds the file holds under torch.profiler (CPU and CUDA activities), then
writes SIGNALS/profiled-<n> with the kernels the profiler saw.

Exit status 0 after an exit signal; 4 when none came within --max-seconds;
1 on an error (printed).
"""

import argparse
import json
import os
import sys
import time

from files import touch  # beside this script

KERNELS_PER_STEP = 40
WARMUP_STEPS = 5


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--signals", required=True, help="directory of the ready/exit/profile-<n> files")
    p.add_argument("--device", type=int, default=0)
    p.add_argument("--max-seconds", type=float, default=60.0, help="give up (status 4) after this long without an exit signal")
    return p.parse_args()


def profile_requests(signals, done):
    """The profile-<n> files not yet answered, in order."""
    names = [n for n in os.listdir(signals) if n.startswith("profile-") and n[8:].isdigit() and n not in done]
    return sorted(names, key=lambda n: int(n.split("-", 1)[1]))


def main():
    args = parse_args()
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.set_device(args.device)
    x = torch.zeros(1024, device=torch.device("cuda", args.device))

    def one_step():
        for _ in range(KERNELS_PER_STEP):
            x.add_(1.0)
        torch.cuda.synchronize()

    for _ in range(WARMUP_STEPS):
        one_step()
    signal = lambda name: os.path.join(args.signals, name)  # noqa: E731
    touch(signal("ready"), json.dumps({"pid": os.getpid()}))
    answered = set()
    give_up = time.monotonic() + args.max_seconds
    while not os.path.exists(signal("exit")):
        if time.monotonic() > give_up:
            print(f"cycles workload: no exit signal within {args.max_seconds:.0f} s", file=sys.stderr)
            return 4
        for name in profile_requests(args.signals, answered):
            with open(signal(name)) as f:
                seconds = float(f.read().strip() or "0.3")
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                start = time.time()
                while time.time() - start < seconds:
                    one_step()
            kernels = sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)
            answered.add(name)
            touch(signal("profiled-" + name.split("-", 1)[1]), json.dumps({"kernels": kernels}))
        one_step()
    return 0


if __name__ == "__main__":
    sys.exit(main())
