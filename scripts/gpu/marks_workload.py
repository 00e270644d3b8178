#!/usr/bin/env python3
"""A long-running PyTorch workload for scripts/gpu-check's checks g, i and
k: does a devtrace capture leave a mark on the job (its speed after the
capture, its exit status, torch.profiler inside a capture), what does
recording always cost it, and what does attaching to it running cost?

Modes (--mode):
  launch  launch-bound: each step launches 40 tiny elementwise kernels on a
          4 KiB tensor, then synchronizes (about 86 k kernels/s on an H100)
  gpt2    GPT-2 small training (transformers, random initialisation, bf16
          autocast, batch 8 x 512 tokens, AdamW), a realistic job

Each step runs inside an NVTX range `step_<i>` that ends after the step's
synchronize, so every kernel of a step lies inside its range. After 20
warm-up steps (and --warmup-seconds of them, for a job that speeds up
over its first seconds) the workload writes SIGNALS/ready ({"pid": ...,
"kernels_per_step": ...}) and runs
steps until SIGNALS/stop exists, noting when each step ended
(CLOCK_REALTIME seconds). When SIGNALS/profile appears it runs
--profile-seconds of steps (or exactly --profile-steps steps) under
torch.profiler (CPU and CUDA activities), then writes SIGNALS/profiled. When
SIGNALS/hold appears it finishes its step, writes SIGNALS/held and runs
nothing until SIGNALS/exact, then exactly --exact-steps steps, writes
SIGNALS/exacted, and runs nothing until SIGNALS/resume (once per run: a
capture around them holds those steps alone). At the end it writes --out:

  {"mode", "pid", "kernels_per_step" (launch mode: 40), "step_ends": [...],
   "step_cpu": [...] (the main thread's CPU seconds at each step end, which
   a host's other tenants do not add to as they add to the wall time),
   "step_numbers": [...] (the i of each ended step's step_<i> range),
   "profile": {"start", "end", "steps", "kernels", "names": {name: count}}}

where the profile's names are those of torch.profiler's GPU events
(kernels, and copies and memsets as "Memcpy ..." and "Memset ..."; not
its own annotations of the step on the GPU's timeline).

A missing transformers (gpt2 mode) is written as {"skip": "..."} with exit
status 3; other errors as {"error": ...} with exit status 1.
"""

import argparse
import json
import os
import sys
import time

from files import run_to_file, touch  # beside this script

LAUNCH_KERNELS = 40
LAUNCH_ELEMENTS = 1024
GPT2_BATCH = (8, 512)
WARMUP_STEPS = 20


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", choices=("launch", "gpt2"), required=True)
    p.add_argument("--signals", required=True, help="directory of the ready/stop/profile files")
    p.add_argument("--out", required=True, help="result JSON")
    p.add_argument("--device", type=int, default=0)
    p.add_argument("--profile-seconds", type=float, default=1.0)
    p.add_argument("--profile-steps", type=int, default=0,
                   help="profile exactly this many steps instead of --profile-seconds of them")
    p.add_argument("--exact-steps", type=int, default=10, help="steps run between SIGNALS/exact and SIGNALS/exacted")
    p.add_argument("--max-seconds", type=float, default=300.0, help="stop by itself after this long")
    p.add_argument("--warmup-seconds", type=float, default=0.0,
                   help="warm up for at least this long too (GPT-2 gained 8-10%% over its first 20 s)")
    return p.parse_args()


class LaunchBound:
    kernels_per_step = LAUNCH_KERNELS

    def __init__(self, torch, device):
        self.torch = torch
        self.x = torch.zeros(LAUNCH_ELEMENTS, device=torch.device("cuda", device))

    def step(self):
        for _ in range(LAUNCH_KERNELS):
            self.x.add_(1.0)


class Gpt2Training:
    kernels_per_step = None

    def __init__(self, torch, device):
        from transformers import GPT2Config, GPT2LMHeadModel

        self.torch = torch
        dev = torch.device("cuda", device)
        torch.manual_seed(1234)
        self.model = GPT2LMHeadModel(GPT2Config()).to(dev)
        self.model.train()
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        vocab = self.model.config.vocab_size
        self.ids = torch.randint(0, vocab, GPT2_BATCH, device=dev)

    def step(self):
        torch = self.torch
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = self.model(self.ids, labels=self.ids).loss
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


def run(args):
    import torch
    # Imported now: the first import takes seconds on a busy host, which a
    # profiler window asked for inside a capture would spend outside it.
    import torch.profiler  # noqa: F401

    torch.cuda.set_device(args.device)
    work = LaunchBound(torch, args.device) if args.mode == "launch" else Gpt2Training(torch, args.device)
    index = 0

    step_ends, step_cpu, step_numbers = [], [], []

    def one_step(noted=True):
        nonlocal index
        torch.cuda.nvtx.range_push(f"step_{index}")
        work.step()
        torch.cuda.synchronize()
        torch.cuda.nvtx.range_pop()
        if noted:
            step_ends.append(time.time())
            step_cpu.append(time.thread_time())
            step_numbers.append(index)
        index += 1

    warmup_end = time.monotonic() + args.warmup_seconds
    for _ in range(WARMUP_STEPS):
        one_step(noted=False)
    while time.monotonic() < warmup_end:
        one_step(noted=False)
    profile = profiler = None
    signal = lambda name: os.path.join(args.signals, name)  # noqa: E731
    touch(signal("ready"), json.dumps({"pid": os.getpid(), "kernels_per_step": work.kernels_per_step}))
    give_up = time.monotonic() + args.max_seconds
    held = False
    while not os.path.exists(signal("stop")) and time.monotonic() < give_up:
        if profile is None and os.path.exists(signal("profile")):
            profile, profiler = profiled_steps(torch, one_step, args)
            touch(signal("profiled"))
            continue
        if not held and os.path.exists(signal("hold")):
            held = True
            exact_steps(one_step, args, signal)
            continue
        one_step()
    if profiler is not None:
        profile.update(profiled_kernels(torch, profiler))
    return {
        "mode": args.mode,
        "pid": os.getpid(),
        "kernels_per_step": work.kernels_per_step,
        "step_ends": step_ends,
        "step_cpu": step_cpu,
        "step_numbers": step_numbers,
        "profile": profile,
    }


def wait_for(path, limit=120.0):
    deadline = time.monotonic() + limit
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {path} after {limit:.0f} s")
        time.sleep(0.002)


def exact_steps(one_step, args, signal):
    """Holds still (SIGNALS/held), runs exactly --exact-steps steps once
    SIGNALS/exact exists, holds still again (SIGNALS/exacted) until
    SIGNALS/resume: a capture around them holds those steps alone."""
    touch(signal("held"))
    wait_for(signal("exact"))
    for _ in range(args.exact_steps):
        one_step()
    touch(signal("exacted"), f'{{"steps": {args.exact_steps}}}')
    wait_for(signal("resume"))


def profiled_steps(torch, one_step, args):
    """Steps under torch.profiler (--profile-steps of them, else
    --profile-seconds of them): their span, and the profiler, to be read
    once the run is over (reading it takes seconds for GPT-2, which would
    leave no steps after the profiler in the capture around it)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start = time.time()
        steps = 0
        while (steps < args.profile_steps if args.profile_steps else time.time() - start < args.profile_seconds):
            one_step()
            steps += 1
        end = time.time()
    return {"start": start, "end": end, "steps": steps}, prof


def profiled_kernels(torch, prof):
    """What torch.profiler saw on the GPU: {"kernels", "names": {name: count}}."""
    names = {}
    for e in prof.events():
        # torch.profiler also puts its own annotations of the step (such as
        # "Optimizer.step#AdamW.step") on the GPU's timeline: not GPU work.
        if e.device_type == torch.autograd.DeviceType.CUDA and not getattr(e, "is_user_annotation", False):
            names[e.name] = names.get(e.name, 0) + 1
    return {"kernels": sum(names.values()), "names": names}


def main():
    args = parse_args()
    # Only GPT-2 needs more than torch (transformers).
    skipped = (ImportError,) if args.mode == "gpt2" else ()
    return run_to_file(args.out, lambda: run(args), skipped)


if __name__ == "__main__":
    sys.exit(main())
