#!/usr/bin/env python3
"""A tiny stand-in for `devtrace serve --backend mock`, used only to validate
scripts/interop_check.py (`--fake-agent` mode) before/while the Rust agent exists.

It speaks just enough of tensorflow.ProfilerService (Profile, Monitor) with hand-encoded
protobuf wire bytes and builds a synthetic XSpace with TensorFlow's own xplane_pb2:
  /host:CPU       `train` steps (step_num, _r=1) and MemoryAllocation/MemoryDeallocation
                  events for allocators GPU_0_bfc and GPU_1_bfc (int64 stats, double
                  fragmentation) on a line sharing the step line's timestamp_ns
  /device:GPU:0,1 a `Stream #7(Compute)` line with kernels carrying `kernel_details`
  Task Environment  profile_start_time / profile_stop_time
The XSpace is returned as ProfileResponse.tool_data {name: "xplane.pb"} so the client
writes <logdir>/plugins/profile/<session>/<host>.xplane.pb itself.

Usage: interop_fake_agent.py serve --listen HOST:PORT [--backend mock]
Needs the interop venv (grpcio, tensorflow).
"""

import argparse
import sys
import threading
import time
from concurrent import futures


# --- minimal protobuf wire helpers -------------------------------------------------------

def _varint(n):
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def _read_varint(buf, i):
    shift = result = 0
    while True:
        b = buf[i]
        i += 1
        result |= (b & 0x7F) << shift
        if not b & 0x80:
            return result, i
        shift += 7


def parse_fields(buf):
    """Returns {field_number: [values]} (varints as int, LEN as bytes)."""
    fields = {}
    i = 0
    while i < len(buf):
        key, i = _read_varint(buf, i)
        num, wt = key >> 3, key & 7
        if wt == 0:
            v, i = _read_varint(buf, i)
        elif wt == 2:
            ln, i = _read_varint(buf, i)
            v, i = bytes(buf[i:i + ln]), i + ln
        elif wt == 1:
            v, i = bytes(buf[i:i + 8]), i + 8
        elif wt == 5:
            v, i = bytes(buf[i:i + 4]), i + 4
        else:
            raise ValueError("unsupported wire type %d" % wt)
        fields.setdefault(num, []).append(v)
    return fields


def _len_field(num, payload):
    return _varint(num << 3 | 2) + _varint(len(payload)) + payload


# --- synthetic XSpace ----------------------------------------------------------------------

KERNELS = [
    ("volta_sgemm_128x64_nn", "regs:126 static_shared:0 dynamic_shared:49152 grid:64,2,1 block:256,1,1 occ_pct:25.0", 180_000),
    ("void Eigen::internal::EigenMetaKernel<relu>", "regs:16 static_shared:0 dynamic_shared:0 grid:128,1,1 block:1024,1,1 occ_pct:100.0", 20_000),
    ("ampere_h16816gemm_64x64_ldg8_stages_64x5_tn", "regs:168 static_shared:0 dynamic_shared:73728 grid:32,4,1 block:128,1,1 occ_pct:12.5", 90_000),
]


class U64(int):
    """Marks a stat value to be stored as uint64_value (e.g. correlation_id)."""


def build_xspace(duration_ms, start_unix_ns):
    from tensorflow.tsl.profiler.protobuf import xplane_pb2

    xs = xplane_pb2.XSpace()
    xs.hostnames.append("fake-agent")
    dur_ps = int(duration_ms) * 1_000_000_000

    def meta(plane, table, name):
        for k, m in table.items():
            if m.name == name:
                return k
        k = len(table) + 1
        table[k].id = k
        table[k].name = name
        return k

    def stat(plane, holder, name, value):
        s = holder.stats.add()
        s.metadata_id = meta(plane, plane.stat_metadata, name)
        if isinstance(value, U64):
            s.uint64_value = int(value)
        elif isinstance(value, float):
            s.double_value = value
        elif isinstance(value, int):
            s.int64_value = value
        else:
            s.str_value = value

    host = xs.planes.add()
    host.id = 0
    host.name = "/host:CPU"
    steps = host.lines.add()
    steps.id = 1001
    steps.name = "python"
    steps.timestamp_ns = 1_000
    mem = host.lines.add()
    mem.id = 1002
    mem.name = "tf_Compute/1002"
    mem.timestamp_ns = steps.timestamp_ns

    step_ps = 10_000_000_000  # 10 ms

    def corr(step, ordinal, k):
        return 1000 + (step * 2 + ordinal) * len(KERNELS) + k

    n_steps = max(1, dur_ps // step_ps)
    live = {"GPU_0_bfc": {}, "GPU_1_bfc": {}}
    in_use = {"GPU_0_bfc": 0, "GPU_1_bfc": 0}
    peak = {"GPU_0_bfc": 0, "GPU_1_bfc": 0}
    limit = 16 << 30
    addr = 0x7F0000000000
    for i in range(n_steps):
        e = steps.events.add()
        e.metadata_id = meta(host, host.event_metadata, "train")
        e.offset_ps = i * step_ps
        e.duration_ps = step_ps - 500_000_000
        stat(host, e, "step_num", i)
        stat(host, e, "_r", 1)
        # Host-side launches nested in the step: XProf connects them to the device kernels
        # by correlation_id (KernelLaunch -> KernelExecute), which puts kernels into steps.
        for ordinal in (0, 1):
            for k in range(len(KERNELS)):
                launch = steps.events.add()
                launch.metadata_id = meta(host, host.event_metadata, "cudaLaunchKernel")
                launch.offset_ps = i * step_ps + (ordinal * len(KERNELS) + k + 1) * 50_000_000
                launch.duration_ps = 20_000_000
                stat(host, launch, "correlation_id", U64(corr(i, ordinal, k)))
                stat(host, launch, "device_id", ordinal)
        for j, alloc in enumerate(("GPU_0_bfc", "GPU_1_bfc")):
            for k in range(3):
                size = (1 << 20) * (k + 1) * (j + 1)
                addr += 4096 + size
                live[alloc][addr] = size
                in_use[alloc] += size
                peak[alloc] = max(peak[alloc], in_use[alloc])
                ev = mem.events.add()
                ev.metadata_id = meta(host, host.event_metadata, "MemoryAllocation")
                ev.offset_ps = i * step_ps + (1 + 3 * j + k) * 100_000_000
                for name, v in (("allocator_name", alloc), ("bytes_reserved", 0),
                                ("bytes_allocated", in_use[alloc]),
                                ("bytes_available", limit - in_use[alloc]),
                                ("fragmentation", 0.01), ("peak_bytes_in_use", peak[alloc]),
                                ("requested_bytes", size - 16), ("allocation_bytes", size),
                                ("addr", addr), ("tf_op", "dense_%d/MatMul:MatMul" % k),
                                ("region_type", "output"), ("data_type", 1),
                                ("shape", "[%d,256]" % (size // 1024))):
                    stat(host, ev, name, v)
            # free everything but the first allocation of the step
            for a in list(live[alloc])[1:]:
                size = live[alloc].pop(a)
                in_use[alloc] -= size
                ev = mem.events.add()
                ev.metadata_id = meta(host, host.event_metadata, "MemoryDeallocation")
                ev.offset_ps = i * step_ps + 8_000_000_000 + j * 100_000_000
                for name, v in (("allocator_name", alloc), ("bytes_reserved", 0),
                                ("bytes_allocated", in_use[alloc]),
                                ("bytes_available", limit - in_use[alloc]),
                                ("fragmentation", 0.01), ("peak_bytes_in_use", peak[alloc]),
                                ("requested_bytes", 0), ("allocation_bytes", size),
                                ("addr", a), ("tf_op", ""), ("region_type", ""),
                                ("data_type", 0), ("shape", "")):
                    stat(host, ev, name, v)

    for ordinal in (0, 1):
        gpu = xs.planes.add()
        gpu.id = 1 + ordinal
        gpu.name = "/device:GPU:%d" % ordinal
        for name, v in (("device_vendor", "Nvidia"), ("gpu_device_name", "Fake V100"),
                        ("clock_rate", 1_530_000), ("core_count", 80),
                        ("compute_cap_major", 7), ("compute_cap_minor", 0)):
            stat(gpu, gpu, name, v)
        line = gpu.lines.add()
        line.id = 7
        line.name = "Stream #7(Compute)"
        line.timestamp_ns = 1_000
        for i in range(n_steps):
            off = i * step_ps + 1_000_000_000
            for k, (kname, details, kdur_ns) in enumerate(KERNELS):
                e = line.events.add()
                e.metadata_id = meta(gpu, gpu.event_metadata, kname)
                e.offset_ps = off
                e.duration_ps = kdur_ns * 1000
                off += e.duration_ps + 50_000_000
                stat(gpu, e, "kernel_details", details)
                stat(gpu, e, "correlation_id", U64(corr(i, ordinal, k)))
                stat(gpu, e, "context_id", "$$1")

    env = xs.planes.add()
    env.id = 100
    env.name = "Task Environment"
    for name, v in (("profile_start_time", start_unix_ns),
                    ("profile_stop_time", start_unix_ns + duration_ms * 1_000_000)):
        s = env.stats.add()
        s.metadata_id = meta(env, env.stat_metadata, name)
        s.uint64_value = v
    return xs.SerializeToString()


# --- gRPC service ------------------------------------------------------------------------

class Service:
    def __init__(self):
        self.lock = threading.Lock()

    def profile(self, request, context):
        f = parse_fields(request)
        opts = parse_fields(f.get(4, [b""])[0])
        duration_ms = (opts.get(9) or f.get(1) or [2000])[0]
        session = f.get(6, [b""])[0].decode()
        host = f.get(7, [b""])[0].decode()
        override = opts.get(15, [b""])[0].decode()
        print("Profile session=%r host=%r opts.override_hostname=%r opts.session_id=%r duration_ms=%d"
              % (session, host, override, opts.get(14, [b""])[0].decode(), duration_ms), flush=True)
        if not self.lock.acquire(blocking=False):
            import grpc

            context.abort(grpc.StatusCode.INTERNAL, "Another profiling session active.")
        try:
            start = time.time_ns()
            time.sleep(duration_ms / 1000.0)
            data = build_xspace(duration_ms, start)
        finally:
            self.lock.release()
        tool = _len_field(1, b"xplane.pb") + _len_field(2, data)
        return _len_field(6, tool)  # ProfileResponse.tool_data; empty_trace = false

    def monitor(self, request, context):
        f = parse_fields(request)
        duration_ms = (f.get(1) or [1000])[0]
        time.sleep(min(duration_ms, 10_000) / 1000.0)
        text = ("Timestamp: %s\nfake-agent: 2 GPUs, utilization 42.0%%, step time avg 10.0 ms\n"
                % time.strftime("%H:%M:%S"))
        return _len_field(1, text.encode())


def serve(listen):
    import grpc
    from tensorflow.tsl.profiler.protobuf import xplane_pb2  # noqa: F401 - slow import, do it now

    svc = Service()
    handler = grpc.method_handlers_generic_handler("tensorflow.ProfilerService", {
        "Profile": grpc.unary_unary_rpc_method_handler(svc.profile),
        "Monitor": grpc.unary_unary_rpc_method_handler(svc.monitor),
    })
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4),
                         options=[("grpc.max_send_message_length", 2**31 - 1)])
    server.add_generic_rpc_handlers((handler,))
    if server.add_insecure_port(listen) == 0:
        print("cannot listen on %s" % listen, file=sys.stderr)
        return 1
    server.start()
    print("fake agent listening on %s" % listen, flush=True)
    server.wait_for_termination()
    return 0


def main():
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("serve")
    s.add_argument("--listen", required=True)
    s.add_argument("--backend", default="mock", choices=["mock"])
    args = ap.parse_args()
    return serve(args.listen)


if __name__ == "__main__":
    sys.exit(main())
