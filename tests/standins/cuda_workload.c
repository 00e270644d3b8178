/*
 * A CUDA driver-API program with a known, deterministic sequence of calls,
 * for tests of devtrace's CUDA tracing against tests/standins/libcuda.c.
 *
 * Build: cc -O2 -Wall -Werror -pthread -o cuda_workload cuda_workload.c -L<dir> -lcuda
 * Run:   LD_LIBRARY_PATH=<dir> cuda_workload ITERATIONS [options]
 *
 *   --wait-file PATH       after setup, wait until PATH exists before the first iteration
 *   --init-wait-file PATH  wait until PATH exists before cuInit
 *   --sleep-ms N           sleep N ms after each iteration
 *   --threads N            run the iterations in N threads at once (default 1: the main thread)
 *   --extras               also memset, DtoD, HtoDAsync, event record/sync and context sync
 *   --cleanup              destroy streams, events and the context at the end
 *   --real-ptx             load real PTX (for the real driver on a GPU) instead of the stand-in's image
 *   --graph                also capture a CUDA graph and replay it once per iteration (below)
 *   --capture-graph-last   after the iterations, capture a CUDA graph (its launches run no
 *                          kernel) and sleep --sleep-ms more before ending
 *   --bad-launch-last      after the iterations, launch vector_add with a grid of 0 (the
 *                          call fails, as expected: not counted as a failure) and sleep
 *                          --sleep-ms more before ending
 *   --rival-at N           act as a second in-process CUPTI user from iteration N (0-based; below)
 *   --rival-iterations M   ... for M iterations (default 1)
 *   --rival-direct         the rival binds to libcupti directly (its handle), never to
 *                          a preloaded or global library that exports the same names
 *   $DEVTRACE_STANDIN_RIVAL_FRAMEWORK=PATH: the rival calls CUPTI through the
 *                          library at PATH (cupti_framework.c), loaded as the rival
 *                          first starts (RTLD_DEEPBIND), which calls another copy of
 *                          libcupti
 *   --rival-linked         the rival calls the CUPTI functions this program imports (it
 *                          must be linked with -lcupti), through its PLT and GOT, as a
 *                          framework linked against libcupti (PyTorch's Kineto) does
 *   --rival-every K        start the rival again every K iterations (from --rival-at on)
 *   --rival-subscribe      the rival also holds a Callback API subscriber while it runs
 *                          (taken before its activity callbacks, as XLA's CUPTI tracer
 *                          does); refused one, it traces nothing that time (said on
 *                          stderr and counted, not fatal)
 *   --rival-subscribe-v2   as --rival-subscribe, with cuptiSubscribe_v2 (as Kineto built
 *                          for CUDA 13 subscribes)
 *   --rival-stays          a rival still running when the iterations end is left running
 *                          as the program exits (no disable, flush or `rival:` line)
 *   --rival-callbacks-only the rival holds a Callback API subscriber and nothing else
 *                          (a tool that times API calls itself): no activity callbacks,
 *                          kinds or flush; it reports kernels=0
 *   --rival-clock          the rival first registers a clock of its own for CUPTI's records
 *                          (cuptiActivityRegisterTimestampCallback), as Kineto does: the
 *                          CPU's time-stamp counter on x86-64, else CLOCK_MONOTONIC_RAW at
 *                          3 ticks a nanosecond
 *   --rival-clock-only     the rival registers its clock and does nothing else (no
 *                          callbacks, kinds or flush; it reports kernels=0)
 *   --rival-finalize       the rival ends its part with cuptiFinalize (as Kineto does when
 *                          it tears CUPTI down after a profile)
 *   --rival-frees-all      the rival frees every buffer its bufferCompleted gets, its own
 *                          or not (a careless profiler)
 *   --rival-early          the rival looks its CUPTI functions up before cuInit, so before
 *                          the injection library can redirect anything: it is unseen
 *   --wait-recording       with the CUPTI stand-in: before the first iteration, and
 *                          after the rival's part, wait (at most 10 s) until kernels are
 *                          recorded again, so that the run does not depend on how soon
 *                          a loaded machine lets the injected library act
 *   --quiet                print no `call` lines
 *   --rate-ms N            every N ms print `rate end_ns=T iterations=I` (I: iterations
 *                          finished so far by all threads, T: CLOCK_REALTIME ns)
 *   --exit-after-ms N      N ms after the iterations start, a thread of its own prints
 *                          `exit at_ns=T` on stderr (T: CLOCK_REALTIME ns) and calls
 *                          exit(3) while the workers are still in CUDA calls, as a job
 *                          whose watchdog or signal handler ends it does
 *
 * Setup: cuInit, cuDeviceGet, cuCtxCreate_v2, cuModuleLoadData,
 * cuModuleGetFunction("vector_add"), cuModuleGetFunction("matmul_tiled"),
 * cuStreamCreate. Each iteration, per thread:
 *   cuMemAlloc_v2(1 MiB)
 *   cuMemcpyHtoD_v2(4096 bytes)
 *   cuLaunchKernel(vector_add, grid 128,1,1, block 256,1,1, shared 0, stream)
 *   cuLaunchKernelEx(matmul_tiled, grid 16,16,1, block 32,8,1, shared 4096, stream)
 *   cuMemcpyDtoHAsync_v2(4096 bytes, stream)
 *   [--extras: cuMemsetD8_v2(4096 bytes, 0x5a), cuMemcpyDtoD_v2(4096),
 *    cuMemcpyHtoDAsync_v2(4096, stream), cuEventRecord(stream),
 *    cuEventSynchronize, cuCtxSynchronize]
 *   [--graph: cuGraphLaunch(exec, stream)]
 *   cuStreamSynchronize(stream)
 *   cuMemFree_v2
 * With --threads N > 1 each thread first calls cuCtxSetCurrent and
 * cuStreamCreate (and cuEventCreate with --extras) itself.
 *
 * --graph: after its stream (and event) is made, each thread captures a
 * graph on its stream: cuStreamBeginCapture_v2(stream, THREAD_LOCAL),
 * cuLaunchKernel(vector_add, grid 128,1,1, block 256,1,1, shared 0) and
 * cuLaunchKernelEx(matmul_tiled, grid 16,16,1, block 32,8,1, shared 4096),
 * both with n=0 so that no memory is touched (printed with captured=1; they
 * run nothing and, with the stand-ins, get a DRIVER record but no kernel
 * record), cuStreamEndCapture, cuGraphInstantiateWithFlags(flags 0): 5 more
 * setup calls per thread. Every iteration then adds one cuGraphLaunch, so
 * per iteration and thread: 1 more call, 4 kernel records instead of 2 (the
 * graph's two have graphNodeId 1 and 2, graphId = the exec's id, and the
 * correlation id of the cuGraphLaunch), nothing else. With one thread the
 * stand-in ids are CUgraph 1 and CUgraphExec 2 (printed as graph=/exec=).
 * --cleanup adds cuGraphExecDestroy and cuGraphDestroy per thread, before
 * the stream is destroyed.
 *
 * --rival-at N (needs --threads 1): before iteration N the program acts as
 * a second profiler in the process would (PyTorch's Kineto): it resolves the
 * CUPTI Activity API with dlsym(RTLD_DEFAULT, name), else from
 * dlopen("libcupti.so.12", RTLD_NOW | RTLD_NOLOAD), else
 * dlopen("libcupti.so", RTLD_NOW); takes t0 = CLOCK_REALTIME ns; calls
 * cuptiActivityRegisterCallbacks with its own pair; enables
 * CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL, DRIVER and RUNTIME; runs
 * iterations N .. N+M-1 as usual (fewer if ITERATIONS ends first; never if
 * N >= ITERATIONS); disables the three kinds; cuptiActivityFlushAll(1);
 * takes t1 (before the --sleep-ms pause of iteration N+M-1); and prints
 *   rival: kernels=K start_ns=T0 end_ns=T1 subscribe_refused=R
 * where K counts the kernel records (kind 3 or 10) its bufferCompleted got
 * (2 per iteration, 4 with --graph; cumulative over --rival-every windows)
 * and R the subscribers refused it (--rival-subscribe). Its callbacks free
 * only buffers it allocated (it keeps a table) and ignore others, unless
 * --rival-frees-all; it calls cuptiSubscribe only with --rival-subscribe
 * (and cuptiUnsubscribe after its flush). A CUPTI call failing or missing
 * (but a refused subscriber) is reported on stderr and makes the exit
 * status 1. None of this prints `call` lines.
 *
 * Output, one line per call, flushed at once:
 *   call NAME pid=P tid=T t0=NS t1=NS rt0=NS rt1=NS rc=R [thread=K iter=I] [key=value ...]
 * t0/t1 are CLOCK_MONOTONIC (bpf_ktime_get_ns) and rt0/rt1 CLOCK_REALTIME
 * around the call; tid is gettid(). Streams are printed by their stand-in
 * id (stream=13). Also `waiting pid=P file=PATH` before a wait, the `rival:`
 * line above and, at the end, `cupti armed=A finalized=F` when the CUPTI
 * stand-in is loaded (whether it is armed now and how often it was
 * finalized) and `done pid=P calls=N`. Exit status 1 if any call failed.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>
#if defined(__x86_64__)
#include <x86intrin.h>
#endif

/* ---- the cuda.h 12.x declarations used here ------------------------------ */

typedef int CUresult;
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;
typedef struct CUctx_st *CUcontext;
typedef struct CUmod_st *CUmodule;
typedef struct CUfunc_st *CUfunction;
typedef struct CUstream_st *CUstream;
typedef struct CUevent_st *CUevent;
typedef struct CUgraph_st *CUgraph;
typedef struct CUgraphExec_st *CUgraphExec;
typedef enum { CU_STREAM_CAPTURE_MODE_THREAD_LOCAL = 1 } CUstreamCaptureMode;

typedef enum { CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION = 4 } CUlaunchAttributeID;
typedef union {
    char pad[64];
    struct { unsigned int x, y, z; } clusterDim;
} CUlaunchAttributeValue;
typedef struct {
    CUlaunchAttributeID id;
    char pad[8 - sizeof(CUlaunchAttributeID)];
    CUlaunchAttributeValue value;
} CUlaunchAttribute;
typedef struct {
    unsigned int gridDimX, gridDimY, gridDimZ;
    unsigned int blockDimX, blockDimY, blockDimZ;
    unsigned int sharedMemBytes;
    CUstream hStream;
    CUlaunchAttribute *attrs;
    unsigned int numAttrs;
} CUlaunchConfig;

CUresult cuInit(unsigned int Flags);
CUresult cuDeviceGet(CUdevice *device, int ordinal);
CUresult cuCtxCreate_v2(CUcontext *pctx, unsigned int flags, CUdevice dev);
CUresult cuCtxSetCurrent(CUcontext ctx);
CUresult cuCtxDestroy_v2(CUcontext ctx);
CUresult cuCtxSynchronize(void);
CUresult cuModuleLoadData(CUmodule *module, const void *image);
CUresult cuModuleGetFunction(CUfunction *hfunc, CUmodule hmod, const char *name);
CUresult cuLaunchKernel(CUfunction f, unsigned int gridDimX, unsigned int gridDimY, unsigned int gridDimZ,
                        unsigned int blockDimX, unsigned int blockDimY, unsigned int blockDimZ,
                        unsigned int sharedMemBytes, CUstream hStream, void **kernelParams, void **extra);
CUresult cuLaunchKernelEx(const CUlaunchConfig *config, CUfunction f, void **kernelParams, void **extra);
CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytesize);
CUresult cuMemFree_v2(CUdeviceptr dptr);
CUresult cuMemcpyHtoD_v2(CUdeviceptr dstDevice, const void *srcHost, size_t ByteCount);
CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr dstDevice, const void *srcHost, size_t ByteCount, CUstream hStream);
CUresult cuMemcpyDtoHAsync_v2(void *dstHost, CUdeviceptr srcDevice, size_t ByteCount, CUstream hStream);
CUresult cuMemcpyDtoD_v2(CUdeviceptr dstDevice, CUdeviceptr srcDevice, size_t ByteCount);
CUresult cuMemsetD8_v2(CUdeviceptr dstDevice, unsigned char uc, size_t N);
CUresult cuStreamCreate(CUstream *phStream, unsigned int Flags);
CUresult cuStreamDestroy_v2(CUstream hStream);
CUresult cuStreamSynchronize(CUstream hStream);
CUresult cuEventCreate(CUevent *phEvent, unsigned int Flags);
CUresult cuEventRecord(CUevent hEvent, CUstream hStream);
CUresult cuEventSynchronize(CUevent hEvent);
CUresult cuEventDestroy_v2(CUevent hEvent);
CUresult cuStreamBeginCapture_v2(CUstream hStream, CUstreamCaptureMode mode);
CUresult cuStreamEndCapture(CUstream hStream, CUgraph *phGraph);
CUresult cuGraphInstantiateWithFlags(CUgraphExec *phGraphExec, CUgraph hGraph, unsigned long long flags);
CUresult cuGraphLaunch(CUgraphExec hGraphExec, CUstream hStream);
CUresult cuGraphExecDestroy(CUgraphExec hGraphExec);
CUresult cuGraphDestroy(CUgraph hGraph);

/* ---- the cupti_activity.h declarations the rival profiler uses ------------ */

enum { RIVAL_KIND_KERNEL = 3, RIVAL_KIND_DRIVER = 4, RIVAL_KIND_RUNTIME = 5, RIVAL_KIND_CONCURRENT_KERNEL = 10 };
typedef struct { uint32_t kind; } CUpti_Activity;
typedef void (*CUpti_BuffersCallbackRequestFunc)(uint8_t **buffer, size_t *size, size_t *maxNumRecords);
typedef void (*CUpti_BuffersCallbackCompleteFunc)(CUcontext context, uint32_t streamId, uint8_t *buffer,
                                                  size_t size, size_t validSize);

/* ---- the program ------------------------------------------------------------- */

#define ALLOC_BYTES (1u << 20)
#define COPY_BYTES 4096u

static const char module_image[] =
    "kernel vector_add regs=32 static_smem=0\n"
    "kernel matmul_tiled regs=64 static_smem=8192\n";

/* The same two kernels as real PTX, for a real driver and GPU (with
 * --real-ptx): out[i] = a[i] + b[i] for i < n, over the x dimension. */
#define PTX_KERNEL(NAME)                                             \
    ".visible .entry " NAME "(.param .u64 a, .param .u64 b,\n"        \
    "    .param .u64 c, .param .u32 n)\n"                             \
    "{\n"                                                            \
    "  .reg .pred %p;\n  .reg .b32 %r<6>;\n  .reg .f32 %f<4>;\n"       \
    "  .reg .b64 %rd<10>;\n"                                          \
    "  ld.param.u64 %rd1, [a];\n  ld.param.u64 %rd2, [b];\n"          \
    "  ld.param.u64 %rd3, [c];\n  ld.param.u32 %r1, [n];\n"           \
    "  mov.u32 %r2, %ctaid.x;\n  mov.u32 %r3, %ntid.x;\n"             \
    "  mov.u32 %r4, %tid.x;\n  mad.lo.s32 %r5, %r2, %r3, %r4;\n"      \
    "  setp.ge.u32 %p, %r5, %r1;\n  @%p bra DONE;\n"                  \
    "  cvta.to.global.u64 %rd4, %rd1;\n"                              \
    "  cvta.to.global.u64 %rd5, %rd2;\n"                              \
    "  cvta.to.global.u64 %rd6, %rd3;\n"                              \
    "  mul.wide.u32 %rd7, %r5, 4;\n  add.s64 %rd8, %rd4, %rd7;\n"     \
    "  ld.global.f32 %f1, [%rd8];\n  add.s64 %rd8, %rd5, %rd7;\n"     \
    "  ld.global.f32 %f2, [%rd8];\n  add.f32 %f3, %f1, %f2;\n"        \
    "  add.s64 %rd9, %rd6, %rd7;\n  st.global.f32 [%rd9], %f3;\n"     \
    "DONE:\n  ret;\n}\n"

static const char real_ptx[] =
    ".version 7.0\n.target sm_52\n.address_size 64\n" PTX_KERNEL("vector_add") PTX_KERNEL("matmul_tiled");

static struct {
    int iterations, threads, sleep_ms, extras, cleanup, real_ptx, graph;
    int rival_at, rival_iterations, rival_direct, rival_linked, rival_every, rival_subscribe, rival_frees_all,
        rival_finalize, rival_callbacks_only, rival_subscribe_v2, rival_stays, rival_clock, rival_clock_only;
    int rival_early, wait_recording, capture_graph_last, bad_launch_last;
    int quiet, rate_ms, exit_after_ms;
    const char *wait_file, *init_wait_file;
} options = {.threads = 1, .rival_at = -1, .rival_iterations = 1};
static unsigned long iterations_done;

static CUcontext context;
static CUfunction vector_add, matmul_tiled;
static unsigned long calls;
static int failed;
static pthread_mutex_t output_lock = PTHREAD_MUTEX_INITIALIZER;
static unsigned int (*stream_id_fn)(CUstream);
static unsigned int (*graph_id_fn)(CUgraph);
static unsigned int (*graph_exec_id_fn)(CUgraphExec);

struct worker {
    int index;
    int own_setup; /* 1: make its own stream (threads > 1) */
    CUstream stream;
    CUevent event;
    CUgraph graph;      /* --graph */
    CUgraphExec exec;
};

static uint64_t now(clockid_t clock) {
    struct timespec ts;
    clock_gettime(clock, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ULL + (uint64_t)ts.tv_nsec;
}

struct stamp { uint64_t t0, rt0; };

static struct stamp start(void) {
    struct stamp s;
    s.rt0 = now(CLOCK_REALTIME);
    s.t0 = now(CLOCK_MONOTONIC);
    return s;
}

/* Prints one `call` line for a call that began at `s` and returned `rc`. */
static void report(const char *name, struct stamp s, CUresult rc, const char *format, ...) {
    uint64_t t1 = now(CLOCK_MONOTONIC), rt1 = now(CLOCK_REALTIME);
    char details[512] = "";
    va_list args;
    va_start(args, format);
    vsnprintf(details, sizeof details, format, args);
    va_end(args);
    pthread_mutex_lock(&output_lock);
    calls++;
    if (!options.quiet)
        printf("call %s pid=%d tid=%ld t0=%llu t1=%llu rt0=%llu rt1=%llu rc=%d%s%s\n", name, (int)getpid(),
           (long)syscall(SYS_gettid), (unsigned long long)s.t0, (unsigned long long)t1,
           (unsigned long long)s.rt0, (unsigned long long)rt1, rc, *details ? " " : "", details);
    fflush(stdout);
    if (rc != 0) {
        fprintf(stderr, "cuda_workload: %s failed with %d\n", name, rc);
        failed = 1;
    }
    pthread_mutex_unlock(&output_lock);
}

static unsigned int stream_id(CUstream stream) {
    return stream_id_fn ? stream_id_fn(stream) : 0;
}

static void wait_for(const char *path) {
    printf("waiting pid=%d file=%s\n", (int)getpid(), path);
    fflush(stdout);
    while (access(path, F_OK) != 0) usleep(10000);
}

/* --wait-recording: until the CUPTI stand-in records kernels, for at most
 * 10 s (then the run goes on, and says so). */
static void wait_until_recording(void) {
    if (!options.wait_recording) return;
    int (*recording)(void) = (int (*)(void))dlsym(RTLD_DEFAULT, "devtrace_standin_cupti_recording_kernels");
    if (!recording) {
        fprintf(stderr, "cuda_workload: --wait-recording without the CUPTI stand-in loaded\n");
        return;
    }
    for (int waited_ms = 0; !recording(); waited_ms++) {
        if (waited_ms == 10000) {
            fprintf(stderr, "cuda_workload: kernels still not recorded after 10 s; going on\n");
            return;
        }
        usleep(1000);
    }
}

static void iterate(struct worker *w, int iter) {
    struct stamp s;
    CUresult rc;
    CUdeviceptr buffer = 0;
    static __thread unsigned char host[COPY_BYTES];
    unsigned sid = stream_id(w->stream);

    s = start();
    rc = cuMemAlloc_v2(&buffer, ALLOC_BYTES);
    report("cuMemAlloc_v2", s, rc, "thread=%d iter=%d bytes=%u ptr=0x%llx", w->index, iter, ALLOC_BYTES, buffer);
    if (rc) return;

    memset(host, iter & 0xff, sizeof host);
    s = start();
    rc = cuMemcpyHtoD_v2(buffer, host, COPY_BYTES);
    report("cuMemcpyHtoD_v2", s, rc, "thread=%d iter=%d dst=0x%llx bytes=%u kind=1", w->index, iter, buffer,
           COPY_BYTES);

    int n = (int)(COPY_BYTES / sizeof(float));
    void *vector_args[] = {&buffer, &buffer, &buffer, &n};
    s = start();
    rc = cuLaunchKernel(vector_add, 128, 1, 1, 256, 1, 1, 0, w->stream, vector_args, NULL);
    report("cuLaunchKernel", s, rc, "thread=%d iter=%d func=vector_add grid=128,1,1 block=256,1,1 shmem=0 stream=%u",
           w->index, iter, sid);

    CUlaunchConfig config = {16, 16, 1, 32, 8, 1, 4096, w->stream, NULL, 0};
    void *matmul_args[] = {&buffer, &buffer, &buffer, &n};
    s = start();
    rc = cuLaunchKernelEx(&config, matmul_tiled, matmul_args, NULL);
    report("cuLaunchKernelEx", s, rc,
           "thread=%d iter=%d func=matmul_tiled grid=16,16,1 block=32,8,1 shmem=4096 stream=%u", w->index, iter, sid);

    s = start();
    rc = cuMemcpyDtoHAsync_v2(host, buffer, COPY_BYTES, w->stream);
    report("cuMemcpyDtoHAsync_v2", s, rc, "thread=%d iter=%d src=0x%llx bytes=%u kind=2 stream=%u", w->index, iter,
           buffer, COPY_BYTES, sid);

    if (options.extras) {
        s = start();
        rc = cuMemsetD8_v2(buffer, 0x5a, COPY_BYTES);
        report("cuMemsetD8_v2", s, rc, "thread=%d iter=%d dst=0x%llx bytes=%u value=90", w->index, iter, buffer,
               COPY_BYTES);
        s = start();
        rc = cuMemcpyDtoD_v2(buffer + COPY_BYTES, buffer, COPY_BYTES);
        report("cuMemcpyDtoD_v2", s, rc, "thread=%d iter=%d dst=0x%llx src=0x%llx bytes=%u kind=8", w->index, iter,
               buffer + COPY_BYTES, buffer, COPY_BYTES);
        s = start();
        rc = cuMemcpyHtoDAsync_v2(buffer, host, COPY_BYTES, w->stream);
        report("cuMemcpyHtoDAsync_v2", s, rc, "thread=%d iter=%d dst=0x%llx bytes=%u kind=1 stream=%u", w->index,
               iter, buffer, COPY_BYTES, sid);
        s = start();
        rc = cuEventRecord(w->event, w->stream);
        report("cuEventRecord", s, rc, "thread=%d iter=%d stream=%u", w->index, iter, sid);
        s = start();
        rc = cuEventSynchronize(w->event);
        report("cuEventSynchronize", s, rc, "thread=%d iter=%d", w->index, iter);
        s = start();
        rc = cuCtxSynchronize();
        report("cuCtxSynchronize", s, rc, "thread=%d iter=%d", w->index, iter);
    }

    if (options.graph) {
        s = start();
        rc = cuGraphLaunch(w->exec, w->stream);
        report("cuGraphLaunch", s, rc, "thread=%d iter=%d exec=%u stream=%u", w->index, iter,
               graph_exec_id_fn ? graph_exec_id_fn(w->exec) : 0, sid);
    }

    s = start();
    rc = cuStreamSynchronize(w->stream);
    report("cuStreamSynchronize", s, rc, "thread=%d iter=%d stream=%u", w->index, iter, sid);

    s = start();
    rc = cuMemFree_v2(buffer);
    report("cuMemFree_v2", s, rc, "thread=%d iter=%d ptr=0x%llx", w->index, iter, buffer);
}

static void make_stream(struct worker *w) {
    struct stamp s = start();
    CUresult rc = cuStreamCreate(&w->stream, 0);
    report("cuStreamCreate", s, rc, "thread=%d stream=%u", w->index, rc ? 0 : stream_id(w->stream));
    if (options.extras) {
        s = start();
        rc = cuEventCreate(&w->event, 0);
        report("cuEventCreate", s, rc, "thread=%d", w->index);
    }
}

/* --bad-launch-last: a launch the driver refuses (a grid of 0), printed
 * with its result but not counted as the program failing. */
static void bad_launch(struct worker *w) {
    CUdeviceptr none = 0;
    int n = 0;
    void *args[] = {&none, &none, &none, &n};
    struct stamp s = start();
    CUresult rc = cuLaunchKernel(vector_add, 0, 1, 1, 256, 1, 1, 0, w->stream, args, NULL);
    int was_failed = failed;
    report("cuLaunchKernel", s, rc, "thread=%d func=vector_add grid=0,1,1 block=256,1,1 shmem=0 stream=%u refused=1",
           w->index, stream_id(w->stream));
    failed = was_failed;
}

/* --graph: captures vector_add and matmul_tiled on the worker's stream. */
static void make_graph(struct worker *w) {
    unsigned sid = stream_id(w->stream);
    struct stamp s = start();
    CUresult rc = cuStreamBeginCapture_v2(w->stream, CU_STREAM_CAPTURE_MODE_THREAD_LOCAL);
    report("cuStreamBeginCapture_v2", s, rc, "thread=%d stream=%u mode=1", w->index, sid);
    if (rc) return;

    /* n = 0: every thread returns at once, so the pointers are never read. */
    CUdeviceptr none = 0;
    int n = 0;
    void *args[] = {&none, &none, &none, &n};
    s = start();
    rc = cuLaunchKernel(vector_add, 128, 1, 1, 256, 1, 1, 0, w->stream, args, NULL);
    report("cuLaunchKernel", s, rc,
           "thread=%d func=vector_add grid=128,1,1 block=256,1,1 shmem=0 stream=%u captured=1", w->index, sid);
    CUlaunchConfig config = {16, 16, 1, 32, 8, 1, 4096, w->stream, NULL, 0};
    s = start();
    rc = cuLaunchKernelEx(&config, matmul_tiled, args, NULL);
    report("cuLaunchKernelEx", s, rc,
           "thread=%d func=matmul_tiled grid=16,16,1 block=32,8,1 shmem=4096 stream=%u captured=1", w->index, sid);

    s = start();
    rc = cuStreamEndCapture(w->stream, &w->graph);
    report("cuStreamEndCapture", s, rc, "thread=%d stream=%u graph=%u", w->index, sid,
           rc == 0 && graph_id_fn ? graph_id_fn(w->graph) : 0);
    if (rc) return;
    s = start();
    rc = cuGraphInstantiateWithFlags(&w->exec, w->graph, 0);
    report("cuGraphInstantiateWithFlags", s, rc, "thread=%d graph=%u exec=%u flags=0", w->index,
           graph_id_fn ? graph_id_fn(w->graph) : 0, rc == 0 && graph_exec_id_fn ? graph_exec_id_fn(w->exec) : 0);
}

/* ---- the rival profiler (--rival-at) ------------------------------------------ */

/* Imported from libcupti when the program is linked with it (--rival-linked);
 * weak, so that programs built without it still link. */
extern int cuptiActivityRegisterCallbacks(CUpti_BuffersCallbackRequestFunc, CUpti_BuffersCallbackCompleteFunc)
    __attribute__((weak));
extern int cuptiActivityEnable(int kind) __attribute__((weak));
extern int cuptiActivityDisable(int kind) __attribute__((weak));
extern int cuptiActivityFlushAll(uint32_t flag) __attribute__((weak));
extern int cuptiActivityGetNextRecord(uint8_t *buffer, size_t valid, CUpti_Activity **record) __attribute__((weak));
typedef void (*RivalCallbackFunc)(void *userdata, int domain, uint32_t cbid, const void *data);
extern int cuptiSubscribe(void **subscriber, RivalCallbackFunc callback, void *userdata) __attribute__((weak));
/* CUDA 13.0's CUpti_SubscriberParams. */
struct rival_subscriber_params {
    size_t struct_size;
    const char *subscriber_name;
    char *old_subscriber_name;
    size_t old_subscriber_size;
};
extern int cuptiSubscribe_v2(void **subscriber, RivalCallbackFunc callback, void *userdata,
                             struct rival_subscriber_params *params) __attribute__((weak));
extern int cuptiUnsubscribe(void *subscriber) __attribute__((weak));
extern int cuptiFinalize(void) __attribute__((weak));
typedef uint64_t (*RivalClockFunc)(void);
extern int cuptiActivityRegisterTimestampCallback(RivalClockFunc clock) __attribute__((weak));

static struct {
    int (*register_callbacks)(CUpti_BuffersCallbackRequestFunc, CUpti_BuffersCallbackCompleteFunc);
    int (*enable)(int kind);
    int (*disable)(int kind);
    int (*flush_all)(uint32_t flag);
    int (*next_record)(uint8_t *buffer, size_t valid, CUpti_Activity **record);
    int (*subscribe)(void **subscriber, RivalCallbackFunc callback, void *userdata);
    int (*subscribe_v2)(void **subscriber, RivalCallbackFunc callback, void *userdata,
                        struct rival_subscriber_params *params);
    int (*unsubscribe)(void *subscriber);
    int (*finalize)(void);
    int (*register_clock)(RivalClockFunc clock);
} rival;
static void *rival_subscriber;
static unsigned long rival_subscribe_refused;

static void rival_callback(void *userdata, int domain, uint32_t cbid, const void *data) {
    (void)userdata;
    (void)domain;
    (void)cbid;
    (void)data;
}
static int rival_active;
static uint64_t rival_t0;
static pthread_mutex_t rival_lock = PTHREAD_MUTEX_INITIALIZER;
static uint8_t *rival_buffers[256]; /* the buffers it handed out and has not had back */
static unsigned long rival_kernels;

#define RIVAL_BUFFER_BYTES (256u << 10)

static void rival_requested(uint8_t **buffer, size_t *size, size_t *max_records) {
    *buffer = NULL;
    *size = 0;
    *max_records = 0;
    pthread_mutex_lock(&rival_lock);
    for (size_t i = 0; i < sizeof rival_buffers / sizeof rival_buffers[0]; i++) {
        if (rival_buffers[i]) continue;
        uint8_t *fresh = aligned_alloc(8, RIVAL_BUFFER_BYTES);
        if (fresh) {
            rival_buffers[i] = fresh;
            *buffer = fresh;
            *size = RIVAL_BUFFER_BYTES;
        }
        break;
    }
    pthread_mutex_unlock(&rival_lock);
}

static void rival_completed(CUcontext ctx, uint32_t stream, uint8_t *buffer, size_t size, size_t valid) {
    (void)ctx;
    (void)stream;
    (void)size;
    pthread_mutex_lock(&rival_lock);
    size_t slot = sizeof rival_buffers / sizeof rival_buffers[0];
    for (size_t i = 0; buffer && i < sizeof rival_buffers / sizeof rival_buffers[0]; i++)
        if (rival_buffers[i] == buffer) slot = i;
    if (slot == sizeof rival_buffers / sizeof rival_buffers[0]) { /* not ours */
        if (options.rival_frees_all && buffer) free(buffer);
        pthread_mutex_unlock(&rival_lock);
        return;
    }
    CUpti_Activity *record = NULL;
    while (valid && rival.next_record(buffer, valid, &record) == 0)
        if (record->kind == RIVAL_KIND_KERNEL || record->kind == RIVAL_KIND_CONCURRENT_KERNEL) rival_kernels++;
    rival_buffers[slot] = NULL;
    free(buffer);
    pthread_mutex_unlock(&rival_lock);
}

static void *rival_symbol(const char *name) {
    static void *library;
    void *symbol = options.rival_direct ? NULL : dlsym(RTLD_DEFAULT, name);
    if (symbol) return symbol;
    if (!library) library = dlopen("libcupti.so.12", RTLD_NOW | RTLD_NOLOAD);
    if (!library) library = dlopen("libcupti.so", RTLD_NOW);
    return library ? dlsym(library, name) : NULL;
}

static void rival_failed(const char *what, int code) {
    fprintf(stderr, "cuda_workload: rival: %s failed with %d\n", what, code);
    failed = 1;
}

/* The rival's CUPTI functions from the framework library at `path`
 * (cupti_framework.c), which calls another copy of libcupti. Loaded with
 * RTLD_DEEPBIND: otherwise the dynamic linker binds its calls to a libcupti
 * already in the global scope (the injected library's), not its own. */
static void rival_resolve_framework(const char *path) {
    void *framework = dlopen(path, RTLD_NOW | RTLD_LOCAL | RTLD_DEEPBIND);
    if (!framework) {
        fprintf(stderr, "cuda_workload: rival: %s\n", dlerror());
        failed = 1;
        return;
    }
    rival.register_callbacks = (int (*)(CUpti_BuffersCallbackRequestFunc, CUpti_BuffersCallbackCompleteFunc))dlsym(
        framework, "fw_cuptiActivityRegisterCallbacks");
    rival.enable = (int (*)(int))dlsym(framework, "fw_cuptiActivityEnable");
    rival.disable = (int (*)(int))dlsym(framework, "fw_cuptiActivityDisable");
    rival.flush_all = (int (*)(uint32_t))dlsym(framework, "fw_cuptiActivityFlushAll");
    rival.next_record =
        (int (*)(uint8_t *, size_t, CUpti_Activity **))dlsym(framework, "fw_cuptiActivityGetNextRecord");
    rival.subscribe = (int (*)(void **, RivalCallbackFunc, void *))dlsym(framework, "fw_cuptiSubscribe");
    rival.unsubscribe = (int (*)(void *))dlsym(framework, "fw_cuptiUnsubscribe");
    rival.finalize = (int (*)(void))dlsym(framework, "fw_cuptiFinalize");
}

/* Finds the rival's CUPTI functions (once). */
static void rival_resolve(void) {
    static int resolved;
    if (resolved++) return;
    const char *framework = getenv("DEVTRACE_STANDIN_RIVAL_FRAMEWORK");
    if (framework) {
        rival_resolve_framework(framework);
    } else if (options.rival_linked) {
        rival.register_callbacks = cuptiActivityRegisterCallbacks;
        rival.enable = cuptiActivityEnable;
        rival.disable = cuptiActivityDisable;
        rival.flush_all = cuptiActivityFlushAll;
        rival.next_record = cuptiActivityGetNextRecord;
        rival.subscribe = cuptiSubscribe;
        rival.subscribe_v2 = cuptiSubscribe_v2;
        rival.unsubscribe = cuptiUnsubscribe;
        rival.finalize = cuptiFinalize;
        rival.register_clock = cuptiActivityRegisterTimestampCallback;
    } else {
        rival.register_callbacks = (int (*)(CUpti_BuffersCallbackRequestFunc, CUpti_BuffersCallbackCompleteFunc))
            rival_symbol("cuptiActivityRegisterCallbacks");
        rival.enable = (int (*)(int))rival_symbol("cuptiActivityEnable");
        rival.disable = (int (*)(int))rival_symbol("cuptiActivityDisable");
        rival.flush_all = (int (*)(uint32_t))rival_symbol("cuptiActivityFlushAll");
        rival.next_record =
            (int (*)(uint8_t *, size_t, CUpti_Activity **))rival_symbol("cuptiActivityGetNextRecord");
        rival.subscribe = (int (*)(void **, RivalCallbackFunc, void *))rival_symbol("cuptiSubscribe");
        rival.subscribe_v2 = (int (*)(void **, RivalCallbackFunc, void *, struct rival_subscriber_params *))rival_symbol(
            "cuptiSubscribe_v2");
        rival.unsubscribe = (int (*)(void *))rival_symbol("cuptiUnsubscribe");
        rival.finalize = (int (*)(void))rival_symbol("cuptiFinalize");
        rival.register_clock = (int (*)(RivalClockFunc))rival_symbol("cuptiActivityRegisterTimestampCallback");
    }
}

/* The rival's clock (--rival-clock): neither CUPTI's clock nor
 * nanoseconds. */
static uint64_t rival_clock(void) {
#if defined(__x86_64__)
    return __rdtsc();
#else
    return 3 * now(CLOCK_MONOTONIC_RAW) + 12345;
#endif
}

static void rival_begin(void) {
    rival_resolve();
    if (!rival.register_callbacks || !rival.enable || !rival.disable || !rival.flush_all || !rival.next_record) {
        fprintf(stderr, "cuda_workload: rival: no CUPTI Activity API: %s\n", dlerror());
        failed = 1;
        return;
    }
    rival_t0 = now(CLOCK_REALTIME);
    int rc;
    if (options.rival_subscribe) {
        if (!(options.rival_subscribe_v2 ? !!rival.subscribe_v2 : !!rival.subscribe) || !rival.unsubscribe) {
            fprintf(stderr, "cuda_workload: rival: no cuptiSubscribe%s\n", options.rival_subscribe_v2 ? "_v2" : "");
            failed = 1;
            return;
        }
        rival_subscriber = NULL;
        struct rival_subscriber_params params = {.struct_size = sizeof params, .subscriber_name = "rival"};
        rc = options.rival_subscribe_v2 ? rival.subscribe_v2(&rival_subscriber, rival_callback, NULL, &params)
                                        : rival.subscribe(&rival_subscriber, rival_callback, NULL);
        if (rc != 0) {
            /* As XLA's tracer: no subscriber, no tracing this time. */
            fprintf(stderr, "cuda_workload: rival: cuptiSubscribe refused (%d)\n", rc);
            rival_subscribe_refused++;
            rival_subscriber = NULL;
            return;
        }
    }
    if (options.rival_callbacks_only) {
        rival_active = 1;
        return;
    }
    if (options.rival_clock) {
        if (!rival.register_clock) {
            fprintf(stderr, "cuda_workload: rival: no cuptiActivityRegisterTimestampCallback\n");
            failed = 1;
            return;
        }
        if ((rc = rival.register_clock(rival_clock)) != 0) {
            rival_failed("cuptiActivityRegisterTimestampCallback", rc);
            return;
        }
    }
    if (options.rival_clock_only) {
        rival_active = 1;
        return;
    }
    rc = rival.register_callbacks(rival_requested, rival_completed);
    if (rc) {
        rival_failed("cuptiActivityRegisterCallbacks", rc);
        return;
    }
    static const int kinds[] = {RIVAL_KIND_CONCURRENT_KERNEL, RIVAL_KIND_DRIVER, RIVAL_KIND_RUNTIME};
    for (size_t i = 0; i < sizeof kinds / sizeof kinds[0]; i++)
        if ((rc = rival.enable(kinds[i])) != 0) rival_failed("cuptiActivityEnable", rc);
    rival_active = 1;
}

static void rival_end(void) {
    rival_active = 0;
    static const int kinds[] = {RIVAL_KIND_CONCURRENT_KERNEL, RIVAL_KIND_DRIVER, RIVAL_KIND_RUNTIME};
    int rc;
    int recorded = !options.rival_callbacks_only && !options.rival_clock_only;
    for (size_t i = 0; recorded && i < sizeof kinds / sizeof kinds[0]; i++)
        if ((rc = rival.disable(kinds[i])) != 0) rival_failed("cuptiActivityDisable", rc);
    if (recorded && (rc = rival.flush_all(1)) != 0) rival_failed("cuptiActivityFlushAll", rc);
    if (rival_subscriber) {
        if ((rc = rival.unsubscribe(rival_subscriber)) != 0) rival_failed("cuptiUnsubscribe", rc);
        rival_subscriber = NULL;
    }
    if (options.rival_finalize) {
        if (!rival.finalize)
            rival_failed("cuptiFinalize (missing)", -1);
        else if ((rc = rival.finalize()) != 0)
            rival_failed("cuptiFinalize", rc);
    }
    uint64_t t1 = now(CLOCK_REALTIME);
    pthread_mutex_lock(&rival_lock);
    unsigned long kernels = rival_kernels;
    pthread_mutex_unlock(&rival_lock);
    pthread_mutex_lock(&output_lock);
    printf("rival: kernels=%lu start_ns=%llu end_ns=%llu subscribe_refused=%lu\n", kernels,
           (unsigned long long)rival_t0, (unsigned long long)t1, rival_subscribe_refused);
    fflush(stdout);
    pthread_mutex_unlock(&output_lock);
}

static void *run_worker(void *arg) {
    struct worker *w = arg;
    if (w->own_setup) {
        struct stamp s = start();
        CUresult rc = cuCtxSetCurrent(context);
        report("cuCtxSetCurrent", s, rc, "thread=%d", w->index);
        make_stream(w);
        if (options.graph && !failed) make_graph(w);
    }
    int rival_last = options.rival_at + options.rival_iterations - 1;
    for (int i = 0; i < options.iterations && !failed; i++) {
        if (options.rival_every > 0 && options.rival_at >= 0 && i > options.rival_at &&
            (i - options.rival_at) % options.rival_every == 0) {
            if (rival_active) rival_end();
            rival_last = i + options.rival_iterations - 1;
            rival_begin();
        }
        if (i == options.rival_at) rival_begin();
        iterate(w, i);
        __atomic_add_fetch(&iterations_done, 1, __ATOMIC_RELAXED);
        if (rival_active && i == rival_last) {
            rival_end();
            wait_until_recording();
        }
        if (options.sleep_ms > 0) usleep((useconds_t)options.sleep_ms * 1000);
    }
    if (rival_active && !options.rival_stays) rival_end();
    if (options.capture_graph_last && !options.graph && !failed) {
        make_graph(w);
        if (options.sleep_ms > 0) usleep((useconds_t)options.sleep_ms * 1000);
    }
    if (options.bad_launch_last && !failed) {
        bad_launch(w);
        if (options.sleep_ms > 0) usleep((useconds_t)options.sleep_ms * 1000);
    }
    return NULL;
}

static void cleanup(struct worker *w) {
    struct stamp s;
    CUresult rc;
    if (w->exec) {
        s = start();
        rc = cuGraphExecDestroy(w->exec);
        report("cuGraphExecDestroy", s, rc, "thread=%d", w->index);
    }
    if (w->graph) {
        s = start();
        rc = cuGraphDestroy(w->graph);
        report("cuGraphDestroy", s, rc, "thread=%d", w->index);
    }
    if (w->event) {
        s = start();
        rc = cuEventDestroy_v2(w->event);
        report("cuEventDestroy_v2", s, rc, "thread=%d", w->index);
    }
    if (w->stream) {
        unsigned sid = stream_id(w->stream);
        s = start();
        rc = cuStreamDestroy_v2(w->stream);
        report("cuStreamDestroy_v2", s, rc, "thread=%d stream=%u", w->index, sid);
    }
}

/* --rate-ms: how many iterations have finished, every N ms. */
static void *print_rates(void *unused) {
    (void)unused;
    for (;;) {
        usleep((useconds_t)options.rate_ms * 1000);
        pthread_mutex_lock(&output_lock);
        printf("rate end_ns=%llu iterations=%lu\n", (unsigned long long)now(CLOCK_REALTIME),
               __atomic_load_n(&iterations_done, __ATOMIC_RELAXED));
        fflush(stdout);
        pthread_mutex_unlock(&output_lock);
    }
    return NULL;
}

/* --exit-after-ms: ends the process from a thread of its own. */
static void *exit_later(void *unused) {
    (void)unused;
    usleep((useconds_t)options.exit_after_ms * 1000);
    fprintf(stderr, "exit at_ns=%llu\n", (unsigned long long)now(CLOCK_REALTIME));
    fflush(stderr);
    exit(3);
}

static int usage(void) {
    fprintf(stderr,
            "usage: cuda_workload ITERATIONS [--wait-file PATH] [--init-wait-file PATH] [--sleep-ms N]\n"
            "                     [--threads N] [--extras] [--cleanup] [--real-ptx] [--graph] [--capture-graph-last] [--bad-launch-last]\n"
            "                     [--rival-at N [--rival-iterations M] [--rival-every K] [--rival-direct]\n"
            "                      [--rival-linked] [--rival-subscribe] [--rival-subscribe-v2] [--rival-frees-all]\n"
            "                      [--rival-early] [--rival-stays]]\n"
            "                     [--wait-recording] [--quiet] [--rate-ms N] [--exit-after-ms N]\n");
    return 2;
}

int main(int argc, char **argv) {
    if (argc < 2) return usage();
    options.iterations = atoi(argv[1]);
    for (int i = 2; i < argc; i++) {
        const char *a = argv[i];
        if (strcmp(a, "--wait-file") == 0 && i + 1 < argc) options.wait_file = argv[++i];
        else if (strcmp(a, "--init-wait-file") == 0 && i + 1 < argc) options.init_wait_file = argv[++i];
        else if (strcmp(a, "--sleep-ms") == 0 && i + 1 < argc) options.sleep_ms = atoi(argv[++i]);
        else if (strcmp(a, "--threads") == 0 && i + 1 < argc) options.threads = atoi(argv[++i]);
        else if (strcmp(a, "--extras") == 0) options.extras = 1;
        else if (strcmp(a, "--cleanup") == 0) options.cleanup = 1;
        else if (strcmp(a, "--real-ptx") == 0) options.real_ptx = 1;
        else if (strcmp(a, "--graph") == 0) options.graph = 1;
        else if (strcmp(a, "--capture-graph-last") == 0) options.capture_graph_last = 1;
        else if (strcmp(a, "--bad-launch-last") == 0) options.bad_launch_last = 1;
        else if (strcmp(a, "--rival-at") == 0 && i + 1 < argc) options.rival_at = atoi(argv[++i]);
        else if (strcmp(a, "--rival-iterations") == 0 && i + 1 < argc) options.rival_iterations = atoi(argv[++i]);
        else if (strcmp(a, "--rival-direct") == 0) options.rival_direct = 1;
        else if (strcmp(a, "--rival-linked") == 0) options.rival_linked = 1;
        else if (strcmp(a, "--rival-every") == 0 && i + 1 < argc) options.rival_every = atoi(argv[++i]);
        else if (strcmp(a, "--rival-subscribe") == 0) options.rival_subscribe = 1;
        else if (strcmp(a, "--rival-stays") == 0) options.rival_stays = 1;
        else if (strcmp(a, "--rival-clock") == 0) options.rival_clock = 1;
        else if (strcmp(a, "--rival-clock-only") == 0) options.rival_clock = options.rival_clock_only = 1;
        else if (strcmp(a, "--rival-subscribe-v2") == 0) options.rival_subscribe = options.rival_subscribe_v2 = 1;
        else if (strcmp(a, "--rival-callbacks-only") == 0) options.rival_subscribe = options.rival_callbacks_only = 1;
        else if (strcmp(a, "--rival-frees-all") == 0) options.rival_frees_all = 1;
        else if (strcmp(a, "--rival-finalize") == 0) options.rival_finalize = 1;
        else if (strcmp(a, "--rival-early") == 0) options.rival_early = 1;
        else if (strcmp(a, "--wait-recording") == 0) options.wait_recording = 1;
        else if (strcmp(a, "--quiet") == 0) options.quiet = 1;
        else if (strcmp(a, "--rate-ms") == 0 && i + 1 < argc) options.rate_ms = atoi(argv[++i]);
        else if (strcmp(a, "--exit-after-ms") == 0 && i + 1 < argc) options.exit_after_ms = atoi(argv[++i]);
        else return usage();
    }
    if (options.iterations < 0 || options.threads < 1 || options.threads > 64) return usage();
    if (options.rival_iterations < 1 || (options.rival_at >= 0 && options.threads != 1)) return usage();
    stream_id_fn = (unsigned int (*)(CUstream))dlsym(RTLD_DEFAULT, "devtrace_standin_stream_id");
    graph_id_fn = (unsigned int (*)(CUgraph))dlsym(RTLD_DEFAULT, "devtrace_standin_graph_id");
    graph_exec_id_fn = (unsigned int (*)(CUgraphExec))dlsym(RTLD_DEFAULT, "devtrace_standin_graph_exec_id");

    if (options.init_wait_file) wait_for(options.init_wait_file);
    if (options.rival_early) rival_resolve();

    struct stamp s;
    CUresult rc;
    s = start();
    rc = cuInit(0);
    report("cuInit", s, rc, "flags=0");
    if (rc) return 1;

    CUdevice device = -1;
    s = start();
    rc = cuDeviceGet(&device, 0);
    report("cuDeviceGet", s, rc, "ordinal=0 device=%d", device);
    if (rc) return 1;

    s = start();
    rc = cuCtxCreate_v2(&context, 0, device);
    report("cuCtxCreate_v2", s, rc, "device=%d", device);
    if (rc) return 1;

    CUmodule module = NULL;
    s = start();
    const char *image = options.real_ptx ? real_ptx : module_image;
    rc = cuModuleLoadData(&module, image);
    report("cuModuleLoadData", s, rc, "bytes=%zu", strlen(image) + 1);
    if (rc) return 1;

    s = start();
    rc = cuModuleGetFunction(&vector_add, module, "vector_add");
    report("cuModuleGetFunction", s, rc, "name=vector_add");
    s = start();
    rc = cuModuleGetFunction(&matmul_tiled, module, "matmul_tiled");
    report("cuModuleGetFunction", s, rc, "name=matmul_tiled");
    if (failed) return 1;

    struct worker workers[64];
    memset(workers, 0, sizeof workers);
    for (int t = 0; t < options.threads; t++) {
        workers[t].index = t;
        workers[t].own_setup = options.threads > 1;
    }
    if (options.threads == 1) {
        make_stream(&workers[0]);
        if (options.graph && !failed) make_graph(&workers[0]);
    }
    if (failed) return 1;

    if (options.wait_file) wait_for(options.wait_file);
    wait_until_recording();
    if (options.rate_ms > 0) {
        pthread_t rate;
        pthread_create(&rate, NULL, print_rates, NULL);
        pthread_detach(rate);
    }
    if (options.exit_after_ms > 0) {
        pthread_t ender;
        pthread_create(&ender, NULL, exit_later, NULL);
        pthread_detach(ender);
    }

    if (options.threads == 1) {
        run_worker(&workers[0]);
    } else {
        pthread_t ids[64];
        for (int t = 0; t < options.threads; t++) pthread_create(&ids[t], NULL, run_worker, &workers[t]);
        for (int t = 0; t < options.threads; t++) pthread_join(ids[t], NULL);
    }

    if (options.cleanup) {
        for (int t = 0; t < options.threads; t++) cleanup(&workers[t]);
        s = start();
        rc = cuCtxDestroy_v2(context);
        report("cuCtxDestroy_v2", s, rc, "");
    }

    void (*cupti_state)(int *, unsigned long *) =
        (void (*)(int *, unsigned long *))dlsym(RTLD_DEFAULT, "devtrace_standin_cupti_state");
    if (cupti_state) {
        int armed = 0;
        unsigned long finalized = 0;
        cupti_state(&armed, &finalized);
        pthread_mutex_lock(&output_lock);
        printf("cupti armed=%d finalized=%lu\n", armed, finalized);
        pthread_mutex_unlock(&output_lock);
    }
    pthread_mutex_lock(&output_lock);
    printf("done pid=%d calls=%lu\n", (int)getpid(), calls);
    pthread_mutex_unlock(&output_lock);
    fflush(stdout);
    return failed ? 1 : 0;
}
