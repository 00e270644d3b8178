"""The CUDA injection library against the stand-in driver and CUPTI: the
agent's trace of an injected workload, opened by XProf's tools."""

from harness import *  # noqa: F401,F403 - the harness is these tests' vocabulary


def test_cuda_injection_in_xprof(run):
    """A CUDA program (stand-in driver and CUPTI) traced through the injection
    library: XProf's converters read its kernels, streams and memory."""
    if run.mode != "agent":
        raise SkipTest("agent mode only")
    bindir = os.path.dirname(run.args.bin)
    inject = os.path.join(bindir, "libdevtrace_inject.so")
    check(os.path.isfile(inject), "%s missing (cargo build builds it)" % inject)
    work = os.path.join(run.workdir, "cuda")
    runtime = os.path.join(work, "run")
    os.makedirs(runtime)
    standins = os.path.join(ROOT, "tests", "standins")

    def cc(*args):
        out = subprocess.run(["cc", "-O2", *args], capture_output=True, text=True)
        check(out.returncode == 0, "cc %s failed: %s" % (" ".join(args), out.stderr))

    cc("-shared", "-fPIC", "-Wl,-soname,libcuda.so.1", "-o", os.path.join(work, "libcuda.so.1"),
       os.path.join(standins, "libcuda.c"), "-ldl", "-pthread")
    os.symlink("libcuda.so.1", os.path.join(work, "libcuda.so"))
    cc("-shared", "-fPIC", "-Wl,-soname,libcupti.so.12", "-o", os.path.join(work, "libcupti.so.12"),
       os.path.join(standins, "cupti.c"), "-ldl", "-pthread")
    cc("-pthread", "-o", os.path.join(work, "cuda_workload"), os.path.join(standins, "cuda_workload.c"),
       "-L" + work, "-lcuda", "-Wl,-rpath," + work)
    port = free_port()
    procs = []
    logf = open(os.path.join(work, "agent.log"), "wb")
    try:
        procs.append(subprocess.Popen([run.args.bin, "serve", "--listen", "127.0.0.1:%d" % port,
                                       "--backend", "cuda", "--runtime-dir", runtime],
                                      stdin=subprocess.DEVNULL, stdout=logf, stderr=subprocess.STDOUT,
                                      preexec_fn=set_pdeathsig))
        env = dict(os.environ, LD_LIBRARY_PATH=work, CUDA_INJECTION64_PATH=inject,
                   DEVTRACE_RUNTIME_DIR=runtime, DEVTRACE_STANDIN_GPU_KERNEL_NS="20000")
        procs.append(subprocess.Popen([os.path.join(work, "cuda_workload"), "400", "--sleep-ms", "5",
                                       "--extras"],
                                      env=env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
                                      preexec_fn=set_pdeathsig))
        deadline = time.monotonic() + 20
        while not any(n.endswith(".ring") for n in os.listdir(runtime)):
            check(time.monotonic() < deadline, "the workload made no ring in %s" % runtime)
            time.sleep(0.1)
        time.sleep(0.6)  # the agent scans every 250 ms
        logdir = os.path.join(work, "logs")
        out = subprocess.run([run.args.bin, "capture", "grpc://127.0.0.1:%d" % port, "--duration", "1500ms",
                              "--logdir", logdir], capture_output=True, text=True, timeout=60)
        check(out.returncode == 0, "devtrace capture failed: %s" % out.stderr)
    finally:
        for p in procs:
            p.kill()
            p.wait()
        logf.close()
    xplane = out.stdout.strip().splitlines()[0]
    conv = Converter(work)
    conv.xplane = xplane
    names = conv.tool_names()
    check("kernel_stats" in names, "kernel_stats not offered: %s" % names)
    doc = conv.tool_json("kernel_stats")
    cols = [c.get("id") for c in doc.get("cols", [])]
    ki = cols.index("kernel_name")
    kernels = sorted({str(r["c"][ki]["v"]) for r in doc.get("rows") or []})
    check(kernels == ["matmul_tiled", "vector_add"], "kernel_stats rows: %s" % kernels)
    procs_seen, _ = trace_processes(conv.tool_json("trace_viewer@"), "trace_viewer@")
    gpu = sum(c for n, c in procs_seen.items() if n.endswith("/device:GPU:0"))
    check(gpu > 0, "trace_viewer@: no /device:GPU:0 events: %s" % procs_seen)
    memory = conv.tool_json("memory_profile").get("memoryProfilePerAllocator") or {}
    check(any(n.startswith("GPU_0_cuda (pid ") for n in memory),
          "memory_profile allocators: %s" % list(memory))
    return "kernel_stats %s; trace_viewer@ %s; memory allocators %s" % (kernels, procs_seen, list(memory))
