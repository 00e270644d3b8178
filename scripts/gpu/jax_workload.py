#!/usr/bin/env python3
"""A JAX workload with its in-process profiler server, for scripts/gpu-check.

Starts `jax.profiler.start_server(PORT)`, compiles a jitted 2048x2048 matmul
+ tanh on the first GPU, runs it a few times, touches SIGNALS/ready, then
runs it in a loop (each result waited for) until SIGNALS/stop exists or
--max-seconds pass. The result (--out, JSON) has the iterations and their
rate; errors are written to it as {"error": ...} with exit status 1.
"""

import argparse
import json
import os
import sys
import time
import traceback

from files import touch, write_json  # beside this script

SIZE = 2048




def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--port", type=int, required=True, help="port of jax.profiler.start_server")
    p.add_argument("--signals", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--max-seconds", type=float, default=90.0)
    args = p.parse_args()
    result = {"pid": os.getpid(), "port": args.port}
    try:
        import jax
        import jax.numpy as jnp

        result["jax"] = jax.__version__
        server = jax.profiler.start_server(args.port)  # noqa: F841 - kept alive for the whole run
        gpus = [d for d in jax.devices() if d.platform == "gpu"]
        if not gpus:
            raise RuntimeError(f"no GPU among jax.devices(): {jax.devices()}")
        device = gpus[0]
        result["device"] = str(device)

        @jax.jit
        def step(a, b):
            return jnp.tanh(a @ b) * 0.5

        ka, kb = jax.random.split(jax.random.PRNGKey(0))
        a = jax.device_put(jax.random.normal(ka, (SIZE, SIZE), dtype=jnp.float32), device)
        b = jax.device_put(jax.random.normal(kb, (SIZE, SIZE), dtype=jnp.float32), device)
        for _ in range(5):
            a = step(a, b).block_until_ready()
        touch(os.path.join(args.signals, "ready"), str(os.getpid()))
        stop = os.path.join(args.signals, "stop")
        t0 = time.perf_counter()
        iterations = 0
        while not os.path.exists(stop) and time.perf_counter() - t0 < args.max_seconds:
            a = step(a, b).block_until_ready()
            iterations += 1
        seconds = time.perf_counter() - t0
        result.update(iterations=iterations, seconds=seconds, iterations_per_s=iterations / seconds if seconds else None)
        write_json(args.out, result)
        return 0
    except BaseException as e:  # noqa: BLE001 - the caller reads the reason from the result
        result["error"] = f"{type(e).__name__}: {e}"
        result["traceback"] = traceback.format_exc()
        write_json(args.out, result)
        print(result["traceback"], file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
