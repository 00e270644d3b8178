/*
 * A stand-in for the CUDA driver (libcuda.so.1) with the real C ABI of
 * cuda.h 12.x for the entry points devtrace traces: same symbol names,
 * argument types and struct layouts (CUlaunchConfig, CUlaunchAttribute).
 * Every entry point is a real, exported, non-inlined function, so uprobes
 * attach at its symbol address as they would on the real driver.
 *
 * Build it once and make the other name a symlink (as a real install does):
 *   cc -shared -fPIC -O2 -Wall -Werror -Wl,-soname,libcuda.so.1 \
 *      -o libcuda.so.1 libcuda.c && ln -sf libcuda.so.1 libcuda.so
 * Two copies under two names would both get loaded (cudarc opens
 * "libcuda.so" first) and each would keep its own state.
 *
 * Behaviour:
 * - cuInit loads $CUDA_INJECTION64_PATH (dlopen RTLD_NOW) once and calls its
 *   `int InitializeInjection(void)`, as the real driver does.
 * - Everything but cuInit, cuDriverGetVersion and cuGetErrorString answers
 *   CUDA_ERROR_NOT_INITIALIZED before cuInit; work needs a current context
 *   (per thread, set by cuCtxCreate_v2 / cuCtxSetCurrent).
 * - Host-side durations: cuLaunchKernel/Ex busy-spin $DEVTRACE_STANDIN_KERNEL_US
 *   microseconds, cuStreamSynchronize/cuCtxSynchronize/cuEventSynchronize
 *   busy-spin $DEVTRACE_STANDIN_SYNC_US (both default 0, read once).
 * - Devices: $DEVTRACE_STANDIN_GPUS physical GPUs (default 1, at most 64),
 *   all named "Standin GPU"; physical GPU i has the UUID bytes
 *   STANDIN_GPU_UUID(i) = 5e7a4d1b-0000-4000-8000-0000000000ii
 *   (standin_call.h), the same as the NVML stand-in's GPU i. $CUDA_VISIBLE_DEVICES
 *   (read once) is a comma-separated list of physical indices: CUDA ordinal k
 *   is the k-th entry. As in the real driver the list ends at the first
 *   entry that is not a valid index (out of range, a repeat, not a number;
 *   UUID entries are not understood here); unset means every physical GPU
 *   in order. cuDeviceGetCount / cuDeviceGet / cuDeviceGetName /
 *   cuDeviceGetAttribute / cuCtxCreate_v2 follow it, and cuInit answers
 *   CUDA_ERROR_NO_DEVICE when no
 *   GPU is visible. devtrace_standin_device_physical(ordinal) tells the CUPTI
 *   stand-in the physical index (or -1). Driver version 12080.
 * - cuDeviceGetAttribute knows the attributes occupancy needs, with the
 *   values the CUPTI stand-in's DEVICE records give (sm_90): warp size 32
 *   (CU_DEVICE_ATTRIBUTE_WARP_SIZE, 10), 2048 threads (39), 233472 bytes of
 *   shared memory (81), 65536 registers (82) and 32 blocks (106) per SM;
 *   and what describes the device, as those records do too: 132 SMs (16),
 *   compute capability 9.0 (75, 76), a 1980000 kHz clock (13), and memory
 *   at 2619000 kHz (36) on a 5120-bit bus (37), 3352320000 kB/s;
 *   other attributes answer CUDA_ERROR_INVALID_VALUE. cuDeviceTotalMem_v2
 *   answers 80 GiB, cuDeviceGetUuid the physical GPU's UUID.
 * - cuMemAlloc_v2 hands out increasing fake addresses from 0x7f0000000000,
 *   each rounded up to 256 bytes and never reused; the memory is not backed,
 *   so copies only check the device range and DtoH copies zero the host side.
 * - Module images are text. Lines `kernel NAME regs=N static_smem=M` declare
 *   kernels with those attributes; cuModuleGetFunction then answers
 *   CUDA_ERROR_NOT_FOUND for other names. An image without such lines accepts
 *   any name with regs=32 static_smem=0.
 * - Streams: NULL / CU_STREAM_LEGACY / CU_STREAM_PER_THREAD are stream 7,
 *   created streams 13, 14, ... (standin_call.h). Contexts 1, 2, ...;
 *   events 1, 2, ...
 * - CUDA graphs, by stream capture only: cuStreamBeginCapture_v2 (any mode;
 *   on a created stream, CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED on the
 *   default streams), then cuLaunchKernel / cuLaunchKernelEx on that stream
 *   add kernel nodes 1, 2, ... instead of running (their calls are reported
 *   as host-only), cuStreamEndCapture returns the CUgraph. Other work on a
 *   capturing stream (async copies, cuEventRecord, cuGraphLaunch) answers
 *   CUDA_ERROR_NOT_SUPPORTED, cuStreamSynchronize
 *   CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED. cuGraphInstantiateWithFlags makes
 *   a CUgraphExec whose nodes are numbered 1, 2, ... again; cuGraphLaunch
 *   runs its kernels in node order on the stream (one host-side
 *   $DEVTRACE_STANDIN_KERNEL_US spin for the whole launch) and is reported as
 *   one STANDIN_CALL_GRAPH_LAUNCH call. CUgraph and CUgraphExec ids come from
 *   one counter (1, 2, ...); unknown or destroyed handles answer
 *   CUDA_ERROR_INVALID_HANDLE. cuGraphDestroy / cuGraphExecDestroy free them.
 * - After each call the CUPTI stand-in, if attached, gets a
 *   `struct standin_call` (standin_call.h) describing it.
 * - devtrace_standin_stream_id(CUstream) tells a test program a stream's id,
 *   devtrace_standin_graph_id(CUgraph) and devtrace_standin_graph_exec_id
 *   (CUgraphExec) a graph's id (0 for an unknown handle).
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "standin_call.h"

#define CUAPI __attribute__((noinline, used, visibility("default")))

/* ---- cuda.h 12.x types ------------------------------------------------ */

typedef int CUresult;
enum {
    CUDA_SUCCESS = 0,
    CUDA_ERROR_INVALID_VALUE = 1,
    CUDA_ERROR_OUT_OF_MEMORY = 2,
    CUDA_ERROR_NOT_INITIALIZED = 3,
    CUDA_ERROR_DEINITIALIZED = 4,
    CUDA_ERROR_NO_DEVICE = 100,
    CUDA_ERROR_INVALID_DEVICE = 101,
    CUDA_ERROR_INVALID_IMAGE = 200,
    CUDA_ERROR_INVALID_CONTEXT = 201,
    CUDA_ERROR_INVALID_HANDLE = 400,
    CUDA_ERROR_ILLEGAL_STATE = 401,
    CUDA_ERROR_NOT_FOUND = 500,
    CUDA_ERROR_NOT_READY = 600,
    CUDA_ERROR_LAUNCH_FAILED = 719,
    CUDA_ERROR_NOT_SUPPORTED = 801,
    CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED = 900,
    CUDA_ERROR_UNKNOWN = 999,
};

typedef int CUdevice;
typedef unsigned long long CUdeviceptr;
typedef struct CUctx_st *CUcontext;
typedef struct CUmod_st *CUmodule;
typedef struct CUfunc_st *CUfunction;
typedef struct CUstream_st *CUstream;
typedef struct CUevent_st *CUevent;
typedef struct CUgraph_st *CUgraph;
typedef struct CUgraphExec_st *CUgraphExec;
typedef struct CUuuid_st {
    char bytes[16];
} CUuuid;

typedef enum CUstreamCaptureMode_enum {
    CU_STREAM_CAPTURE_MODE_GLOBAL = 0,
    CU_STREAM_CAPTURE_MODE_THREAD_LOCAL = 1,
    CU_STREAM_CAPTURE_MODE_RELAXED = 2
} CUstreamCaptureMode;

#define CU_STREAM_LEGACY ((CUstream)0x1)
#define CU_STREAM_PER_THREAD ((CUstream)0x2)

typedef enum {
    CU_LAUNCH_ATTRIBUTE_COOPERATIVE = 2,
    CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION = 4,
} CUlaunchAttributeID;

typedef union {
    char pad[64];
    struct { unsigned int x, y, z; } clusterDim;
    int cooperative;
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

_Static_assert(sizeof(CUlaunchAttribute) == 72, "CUlaunchAttribute layout");
_Static_assert(sizeof(CUlaunchConfig) == 56, "CUlaunchConfig layout");
_Static_assert(__builtin_offsetof(CUlaunchConfig, sharedMemBytes) == 24, "CUlaunchConfig layout");
_Static_assert(__builtin_offsetof(CUlaunchConfig, hStream) == 32, "CUlaunchConfig layout");
_Static_assert(__builtin_offsetof(CUlaunchConfig, attrs) == 40, "CUlaunchConfig layout");
_Static_assert(__builtin_offsetof(CUlaunchConfig, numAttrs) == 48, "CUlaunchConfig layout");

/* CUPTI_DRIVER_TRACE_CBID_* of CUDA 12.8 (cupti_driver_cbid.h). */
enum {
    CBID_cuInit = 1,
    CBID_cuDriverGetVersion = 2,
    CBID_cuDeviceGet = 3,
    CBID_cuDeviceGetCount = 4,
    CBID_cuDeviceGetName = 5,
    CBID_cuDeviceGetAttribute = 9,
    CBID_cuDeviceTotalMem_v2 = 259,
    CBID_cuDeviceGetUuid = 482,
    CBID_cuCtxSynchronize = 17,
    CBID_cuModuleLoadData = 19,
    CBID_cuModuleGetFunction = 23,
    CBID_cuEventCreate = 118,
    CBID_cuEventRecord = 119,
    CBID_cuEventSynchronize = 121,
    CBID_cuStreamCreate = 124,
    CBID_cuStreamSynchronize = 126,
    CBID_cuCtxCreate_v2 = 235,
    CBID_cuMemAlloc_v2 = 243,
    CBID_cuMemFree_v2 = 245,
    CBID_cuMemsetD8_v2 = 249,
    CBID_cuMemcpyHtoD_v2 = 276,
    CBID_cuMemcpyHtoDAsync_v2 = 277,
    CBID_cuMemcpyDtoH_v2 = 278,
    CBID_cuMemcpyDtoHAsync_v2 = 279,
    CBID_cuMemcpyDtoD_v2 = 280,
    CBID_cuCtxSetCurrent = 303,
    CBID_cuCtxGetCurrent = 304,
    CBID_cuMemcpy = 305,
    CBID_cuMemcpyAsync = 306,
    CBID_cuLaunchKernel = 307,
    CBID_cuCtxDestroy_v2 = 322,
    CBID_cuEventDestroy_v2 = 325,
    CBID_cuStreamDestroy_v2 = 326,
    CBID_cuGetErrorString = 372,
    CBID_cuStreamEndCapture = 497,
    CBID_cuGraphLaunch = 514,
    CBID_cuGraphExecDestroy = 516,
    CBID_cuGraphDestroy = 517,
    CBID_cuStreamBeginCapture_v2 = 539,
    CBID_cuGraphInstantiateWithFlags = 643,
    CBID_cuLaunchKernelEx = 652,
};

/* CUpti_ActivityMemcpyKind / CUpti_ActivitySynchronizationType values. */
enum { COPY_HTOD = 1, COPY_DTOH = 2, COPY_DTOD = 8, COPY_HTOH = 9 };
enum { SYNC_EVENT = 1, SYNC_STREAM = 3, SYNC_CONTEXT = 4 };

#define NO_ID 0xFFFFFFFFu

/* ---- driver objects ---------------------------------------------------- */

struct CUctx_st { uint32_t id; int destroyed; int device; };
struct CUstream_st { uint32_t id; uint32_t context_id; struct CUgraph_st *capture; };
struct CUevent_st { uint32_t id; uint32_t stream_id; };

struct kernel_decl { char *name; uint16_t registers; uint32_t static_shared; };
struct CUfunc_st { char *name; uint16_t registers; uint32_t static_shared; struct CUfunc_st *next; };
struct CUmod_st {
    struct kernel_decl *decls;
    size_t ndecls;
    struct CUfunc_st *functions;
};

struct allocation { CUdeviceptr ptr; size_t size; int live; };

/* A captured graph and an instantiated one: kernel nodes in order. */
struct CUgraph_st {
    uint32_t id;
    struct standin_graph_node *nodes;
    size_t nnodes;
    struct CUgraph_st *next; /* live graphs */
};
struct CUgraphExec_st {
    uint32_t id;
    uint32_t source_graph_id;
    struct standin_graph_node *nodes;
    size_t nnodes;
    struct CUgraphExec_st *next; /* live executable graphs */
};

#define MAX_GPUS 64

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static int initialized;
static uint32_t next_context_id = 1;
static uint32_t next_stream_id = STANDIN_FIRST_STREAM_ID;
static uint32_t next_event_id = 1;
static CUdeviceptr next_address = 0x7f0000000000ULL;
static struct allocation *allocations;
static size_t nallocations, allocations_cap;
static __thread CUcontext current_context;
static uint32_t next_graph_id = 1;
static struct CUgraph_st *graphs;
static struct CUgraphExec_st *graph_execs;

static pthread_once_t devices_once = PTHREAD_ONCE_INIT;
static int physical_gpus = 1;
static int visible[MAX_GPUS]; /* CUDA ordinal -> physical index */
static int nvisible;

static devtrace_standin_hook hook;
static long long kernel_us = -1, sync_us = -1;

/* ---- helpers ----------------------------------------------------------- */

static uint64_t clock_ns(clockid_t clock) {
    struct timespec ts;
    clock_gettime(clock, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ULL + (uint64_t)ts.tv_nsec;
}

static long long env_number(const char *name) {
    const char *value = getenv(name);
    return value && *value ? atoll(value) : 0;
}

static void spin_us(long long us) {
    if (us <= 0) return;
    uint64_t until = clock_ns(CLOCK_MONOTONIC) + (uint64_t)us * 1000ULL;
    while (clock_ns(CLOCK_MONOTONIC) < until) {
    }
}

static long long kernel_spin(void) {
    if (kernel_us < 0) kernel_us = env_number("DEVTRACE_STANDIN_KERNEL_US");
    return kernel_us;
}

static long long sync_spin(void) {
    if (sync_us < 0) sync_us = env_number("DEVTRACE_STANDIN_SYNC_US");
    return sync_us;
}

static uint32_t stream_id_of(CUstream stream) {
    if (stream == NULL || stream == CU_STREAM_LEGACY || stream == CU_STREAM_PER_THREAD)
        return STANDIN_DEFAULT_STREAM_ID;
    return stream->id;
}

static uint32_t context_id(void) {
    return current_context ? current_context->id : 0;
}

/* Reads $DEVTRACE_STANDIN_GPUS and $CUDA_VISIBLE_DEVICES (once). */
static void read_devices(void) {
    long long gpus = env_number("DEVTRACE_STANDIN_GPUS");
    physical_gpus = gpus <= 0 ? 1 : gpus > MAX_GPUS ? MAX_GPUS : (int)gpus;
    const char *list = getenv("CUDA_VISIBLE_DEVICES");
    nvisible = 0;
    if (!list) {
        for (int i = 0; i < physical_gpus; i++) visible[nvisible++] = i;
        return;
    }
    const char *p = list;
    while (*p && nvisible < MAX_GPUS) {
        while (*p == ' ') p++;
        char *end;
        long index = strtol(p, &end, 10);
        if (end == p || index < 0 || index >= physical_gpus) break;
        while (*end == ' ') end++;
        if (*end != ',' && *end != '\0') break;
        int repeated = 0;
        for (int k = 0; k < nvisible; k++) repeated |= visible[k] == (int)index;
        if (repeated) break;
        visible[nvisible++] = (int)index;
        if (*end == '\0') break;
        p = end + 1;
    }
}

static int visible_count(void) {
    pthread_once(&devices_once, read_devices);
    return nvisible;
}

static int current_device(void) {
    return current_context ? current_context->device : 0;
}

/* A call record with the common fields filled in, after telling the CUPTI
 * stand-in that the call entered. */
static struct standin_call begin_call(const char *api, uint32_t cbid, uint32_t kind) {
    struct standin_call call;
    memset(&call, 0, sizeof call);
    call.version = STANDIN_CALL_VERSION;
    call.kind = kind;
    call.api_name = api;
    call.cbid = cbid;
    call.start_ns = clock_ns(CLOCK_REALTIME);
    call.pid = (uint32_t)getpid();
    call.tid = (uint32_t)syscall(SYS_gettid);
    call.pthread_id = (uint64_t)pthread_self();
    call.device_id = (uint32_t)current_device();
    call.context_id = context_id();
    call.stream_id = NO_ID;
    call.event_id = NO_ID;
    call.site = STANDIN_SITE_ENTER;
    devtrace_standin_hook h = __atomic_load_n(&hook, __ATOMIC_ACQUIRE);
    if (h) h(&call);
    call.site = STANDIN_SITE_EXIT;
    return call;
}

/* Stamps the end of the call, tells the CUPTI stand-in, returns `result`. */
static CUresult finish_call(struct standin_call *call, CUresult result) {
    call->end_ns = clock_ns(CLOCK_REALTIME);
    call->result = result;
    devtrace_standin_hook h = __atomic_load_n(&hook, __ATOMIC_ACQUIRE);
    if (h) h(call);
    return result;
}

static int is_initialized(void) {
    return __atomic_load_n(&initialized, __ATOMIC_ACQUIRE);
}

static CUresult check_ready(void) {
    if (!is_initialized()) return CUDA_ERROR_NOT_INITIALIZED;
    if (!current_context) return CUDA_ERROR_INVALID_CONTEXT;
    return CUDA_SUCCESS;
}

/* The live allocation holding [ptr, ptr+bytes), or NULL. Caller holds lock. */
static struct allocation *find_allocation(CUdeviceptr ptr, size_t bytes) {
    for (size_t i = 0; i < nallocations; i++) {
        struct allocation *a = &allocations[i];
        if (a->live && ptr >= a->ptr && ptr - a->ptr < a->size && bytes <= a->size - (ptr - a->ptr))
            return a;
    }
    return NULL;
}

static int is_device(CUdeviceptr ptr, size_t bytes) {
    pthread_mutex_lock(&lock);
    int found = find_allocation(ptr, bytes) != NULL;
    pthread_mutex_unlock(&lock);
    return found;
}

/* ---- hook plumbing (not part of the CUDA ABI) -------------------------- */

/* The driver serves one CUPTI, the first copy to attach: a second copy
 * loaded later (another toolkit's) is not served. */
CUAPI void devtrace_standin_cuda_set_hook(devtrace_standin_hook h) {
    devtrace_standin_hook none = NULL;
    __atomic_compare_exchange_n(&hook, &none, h, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE);
}

CUAPI unsigned int devtrace_standin_stream_id(CUstream stream) {
    return stream_id_of(stream);
}

CUAPI int devtrace_standin_device_physical(int ordinal) {
    if (ordinal < 0 || ordinal >= visible_count()) return -1;
    return visible[ordinal];
}

CUAPI unsigned int devtrace_standin_graph_id(CUgraph graph) {
    unsigned int id = 0;
    pthread_mutex_lock(&lock);
    for (struct CUgraph_st *g = graphs; g; g = g->next)
        if (g == graph) id = g->id;
    pthread_mutex_unlock(&lock);
    return id;
}

CUAPI unsigned int devtrace_standin_graph_exec_id(CUgraphExec exec) {
    unsigned int id = 0;
    pthread_mutex_lock(&lock);
    for (struct CUgraphExec_st *e = graph_execs; e; e = e->next)
        if (e == exec) id = e->id;
    pthread_mutex_unlock(&lock);
    return id;
}

/* ---- initialisation ---------------------------------------------------- */

/* Attaches a CUPTI stand-in loaded before the driver (it attaches itself otherwise). */
static void find_cupti(void) {
    if (__atomic_load_n(&hook, __ATOMIC_ACQUIRE)) return;
    static const char *const names[] = {"libcupti.so.12", "libcupti.so"};
    devtrace_standin_hook found = (devtrace_standin_hook)dlsym(RTLD_DEFAULT, "devtrace_standin_cupti_on_call");
    for (size_t i = 0; !found && i < sizeof names / sizeof names[0]; i++) {
        void *library = dlopen(names[i], RTLD_LAZY | RTLD_NOLOAD);
        if (library) {
            found = (devtrace_standin_hook)dlsym(library, "devtrace_standin_cupti_on_call");
            dlclose(library);
        }
    }
    if (found) devtrace_standin_cuda_set_hook(found);
}

static void load_injection(void) {
    const char *path = getenv("CUDA_INJECTION64_PATH");
    if (!path || !*path) return;
    void *library = dlopen(path, RTLD_NOW);
    if (!library) {
        fprintf(stderr, "standin libcuda: cannot load injection %s: %s\n", path, dlerror());
        return;
    }
    int (*initialize)(void) = (int (*)(void))dlsym(library, "InitializeInjection");
    if (!initialize) {
        fprintf(stderr, "standin libcuda: %s has no InitializeInjection\n", path);
        return;
    }
    if (!initialize()) fprintf(stderr, "standin libcuda: InitializeInjection of %s failed\n", path);
}

CUAPI CUresult cuInit(unsigned int Flags) {
    struct standin_call call = begin_call("cuInit", CBID_cuInit, STANDIN_CALL_API);
    if (Flags != 0) return finish_call(&call, CUDA_ERROR_INVALID_VALUE);
    if (visible_count() == 0) return finish_call(&call, CUDA_ERROR_NO_DEVICE);
    pthread_mutex_lock(&lock);
    int first = !initialized;
    __atomic_store_n(&initialized, 1, __ATOMIC_RELEASE);
    pthread_mutex_unlock(&lock);
    if (first) {
        find_cupti();
        load_injection();
    }
    return finish_call(&call, CUDA_SUCCESS);
}

CUAPI CUresult cuDriverGetVersion(int *driverVersion) {
    struct standin_call call = begin_call("cuDriverGetVersion", CBID_cuDriverGetVersion, STANDIN_CALL_API);
    if (!driverVersion) return finish_call(&call, CUDA_ERROR_INVALID_VALUE);
    *driverVersion = 12080;
    return finish_call(&call, CUDA_SUCCESS);
}

CUAPI CUresult cuDeviceGetCount(int *count) {
    struct standin_call call = begin_call("cuDeviceGetCount", CBID_cuDeviceGetCount, STANDIN_CALL_API);
    if (!is_initialized()) return finish_call(&call, CUDA_ERROR_NOT_INITIALIZED);
    if (!count) return finish_call(&call, CUDA_ERROR_INVALID_VALUE);
    *count = visible_count();
    return finish_call(&call, CUDA_SUCCESS);
}

CUAPI CUresult cuDeviceGet(CUdevice *device, int ordinal) {
    struct standin_call call = begin_call("cuDeviceGet", CBID_cuDeviceGet, STANDIN_CALL_API);
    if (!is_initialized()) return finish_call(&call, CUDA_ERROR_NOT_INITIALIZED);
    if (!device) return finish_call(&call, CUDA_ERROR_INVALID_VALUE);
    if (ordinal < 0 || ordinal >= visible_count()) return finish_call(&call, CUDA_ERROR_INVALID_DEVICE);
    *device = ordinal;
    return finish_call(&call, CUDA_SUCCESS);
}

CUAPI CUresult cuDeviceGetName(char *name, int len, CUdevice dev) {
    struct standin_call call = begin_call("cuDeviceGetName", CBID_cuDeviceGetName, STANDIN_CALL_API);
    if (!is_initialized()) return finish_call(&call, CUDA_ERROR_NOT_INITIALIZED);
    if (!name || len <= 0) return finish_call(&call, CUDA_ERROR_INVALID_VALUE);
    if (dev < 0 || dev >= visible_count()) return finish_call(&call, CUDA_ERROR_INVALID_DEVICE);
    snprintf(name, (size_t)len, "%s", "Standin GPU");
    return finish_call(&call, CUDA_SUCCESS);
}

CUAPI CUresult cuDeviceGetAttribute(int *pi, int attrib, CUdevice dev) {
    struct standin_call call = begin_call("cuDeviceGetAttribute", CBID_cuDeviceGetAttribute, STANDIN_CALL_API);
    if (!is_initialized()) return finish_call(&call, CUDA_ERROR_NOT_INITIALIZED);
    if (!pi) return finish_call(&call, CUDA_ERROR_INVALID_VALUE);
    if (dev < 0 || dev >= visible_count()) return finish_call(&call, CUDA_ERROR_INVALID_DEVICE);
    switch (attrib) {
    case 10: *pi = 32; break;     /* CU_DEVICE_ATTRIBUTE_WARP_SIZE */
    case 39: *pi = 2048; break;   /* CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_MULTIPROCESSOR */
    case 81: *pi = 233472; break; /* CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR */
    case 82: *pi = 65536; break;  /* CU_DEVICE_ATTRIBUTE_MAX_REGISTERS_PER_MULTIPROCESSOR */
    case 106: *pi = 32; break;    /* CU_DEVICE_ATTRIBUTE_MAX_BLOCKS_PER_MULTIPROCESSOR */
    case 13: *pi = 1980000; break; /* CU_DEVICE_ATTRIBUTE_CLOCK_RATE, kHz */
    case 16: *pi = 132; break;     /* CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT */
    case 36: *pi = 2619000; break; /* CU_DEVICE_ATTRIBUTE_MEMORY_CLOCK_RATE, kHz */
    case 37: *pi = 5120; break;    /* CU_DEVICE_ATTRIBUTE_GLOBAL_MEMORY_BUS_WIDTH, bits */
    case 75: *pi = 9; break;       /* CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR */
    case 76: *pi = 0; break;       /* CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR */
    default: return finish_call(&call, CUDA_ERROR_INVALID_VALUE);
    }
    return finish_call(&call, CUDA_SUCCESS);
}

CUAPI CUresult cuDeviceTotalMem_v2(size_t *bytes, CUdevice dev) {
    struct standin_call call = begin_call("cuDeviceTotalMem_v2", CBID_cuDeviceTotalMem_v2, STANDIN_CALL_API);
    if (!is_initialized()) return finish_call(&call, CUDA_ERROR_NOT_INITIALIZED);
    if (!bytes) return finish_call(&call, CUDA_ERROR_INVALID_VALUE);
    if (dev < 0 || dev >= visible_count()) return finish_call(&call, CUDA_ERROR_INVALID_DEVICE);
    *bytes = (size_t)80 << 30;
    return finish_call(&call, CUDA_SUCCESS);
}

CUAPI CUresult cuDeviceGetUuid(CUuuid *uuid, CUdevice dev) {
    struct standin_call call = begin_call("cuDeviceGetUuid", CBID_cuDeviceGetUuid, STANDIN_CALL_API);
    if (!is_initialized()) return finish_call(&call, CUDA_ERROR_NOT_INITIALIZED);
    if (!uuid) return finish_call(&call, CUDA_ERROR_INVALID_VALUE);
    if (dev < 0 || dev >= visible_count()) return finish_call(&call, CUDA_ERROR_INVALID_DEVICE);
    const uint8_t bytes[16] = STANDIN_GPU_UUID(visible[dev]);
    memcpy(uuid->bytes, bytes, sizeof bytes);
    return finish_call(&call, CUDA_SUCCESS);
}

/* ---- contexts ----------------------------------------------------------- */

CUAPI CUresult cuCtxCreate_v2(CUcontext *pctx, unsigned int flags, CUdevice dev) {
    (void)flags;
    struct standin_call call = begin_call("cuCtxCreate_v2", CBID_cuCtxCreate_v2, STANDIN_CALL_CTX_CREATE);
    if (!is_initialized()) return finish_call(&call, CUDA_ERROR_NOT_INITIALIZED);
    if (!pctx) return finish_call(&call, CUDA_ERROR_INVALID_VALUE);
    if (dev < 0 || dev >= visible_count()) return finish_call(&call, CUDA_ERROR_INVALID_DEVICE);
    CUcontext ctx = calloc(1, sizeof *ctx);
    if (!ctx) return finish_call(&call, CUDA_ERROR_OUT_OF_MEMORY);
    ctx->device = dev;
    call.device_id = (uint32_t)dev;
    pthread_mutex_lock(&lock);
    ctx->id = next_context_id++;
    pthread_mutex_unlock(&lock);
    current_context = ctx;
    *pctx = ctx;
    call.context_id = ctx->id;
    return finish_call(&call, CUDA_SUCCESS);
}

CUAPI CUresult cuCtxGetCurrent(CUcontext *pctx) {
    struct standin_call call = begin_call("cuCtxGetCurrent", CBID_cuCtxGetCurrent, STANDIN_CALL_API);
    if (!is_initialized()) return finish_call(&call, CUDA_ERROR_NOT_INITIALIZED);
    if (!pctx) return finish_call(&call, CUDA_ERROR_INVALID_VALUE);
    *pctx = current_context;
    return finish_call(&call, CUDA_SUCCESS);
}

CUAPI CUresult cuCtxSetCurrent(CUcontext ctx) {
    struct standin_call call = begin_call("cuCtxSetCurrent", CBID_cuCtxSetCurrent, STANDIN_CALL_API);
    if (!is_initialized()) return finish_call(&call, CUDA_ERROR_NOT_INITIALIZED);
    if (ctx && ctx->destroyed) return finish_call(&call, CUDA_ERROR_INVALID_CONTEXT);
    current_context = ctx;
    call.context_id = context_id();
    call.device_id = (uint32_t)current_device();
    return finish_call(&call, CUDA_SUCCESS);
}

CUAPI CUresult cuCtxDestroy_v2(CUcontext ctx) {
    struct standin_call call = begin_call("cuCtxDestroy_v2", CBID_cuCtxDestroy_v2, STANDIN_CALL_CTX_DESTROY);
    if (!is_initialized()) return finish_call(&call, CUDA_ERROR_NOT_INITIALIZED);
    if (!ctx || ctx->destroyed) return finish_call(&call, CUDA_ERROR_INVALID_CONTEXT);
    ctx->destroyed = 1; /* kept allocated: stale handles stay detectable */
    call.context_id = ctx->id;
    call.device_id = (uint32_t)ctx->device;
    if (current_context == ctx) current_context = NULL;
    return finish_call(&call, CUDA_SUCCESS);
}

CUAPI CUresult cuCtxSynchronize(void) {
    struct standin_call call = begin_call("cuCtxSynchronize", CBID_cuCtxSynchronize, STANDIN_CALL_SYNC);
    CUresult ready = check_ready();
    if (ready) return finish_call(&call, ready);
    call.sync_type = SYNC_CONTEXT;
    spin_us(sync_spin());
    return finish_call(&call, CUDA_SUCCESS);
}

/* ---- modules ------------------------------------------------------------ */

/* Reads the `kernel NAME regs=N static_smem=M` lines of a text image. */
static int parse_image(struct CUmod_st *module, const char *image) {
    const char *line = image;
    while (*line) {
        const char *end = strchr(line, '\n');
        size_t length = end ? (size_t)(end - line) : strlen(line);
        if (length > 7 && strncmp(line, "kernel ", 7) == 0) {
            char text[512];
            if (length >= sizeof text) return -1;
            memcpy(text, line, length);
            text[length] = '\0';
            char name[256];
            unsigned regs = 32, smem = 0;
            if (sscanf(text, "kernel %255s", name) != 1) return -1;
            const char *r = strstr(text, "regs=");
            const char *s = strstr(text, "static_smem=");
            if (r) regs = (unsigned)strtoul(r + 5, NULL, 10);
            if (s) smem = (unsigned)strtoul(s + 12, NULL, 10);
            struct kernel_decl *grown = realloc(module->decls, (module->ndecls + 1) * sizeof *grown);
            if (!grown) return -1;
            module->decls = grown;
            module->decls[module->ndecls].name = strdup(name);
            module->decls[module->ndecls].registers = (uint16_t)regs;
            module->decls[module->ndecls].static_shared = smem;
            module->ndecls++;
        }
        if (!end) break;
        line = end + 1;
    }
    return 0;
}

CUAPI CUresult cuModuleLoadData(CUmodule *module, const void *image) {
    struct standin_call call = begin_call("cuModuleLoadData", CBID_cuModuleLoadData, STANDIN_CALL_API);
    CUresult ready = check_ready();
    if (ready) return finish_call(&call, ready);
    if (!module || !image) return finish_call(&call, CUDA_ERROR_INVALID_VALUE);
    struct CUmod_st *m = calloc(1, sizeof *m);
    if (!m) return finish_call(&call, CUDA_ERROR_OUT_OF_MEMORY);
    if (parse_image(m, image) != 0) {
        free(m);
        return finish_call(&call, CUDA_ERROR_INVALID_IMAGE);
    }
    *module = m;
    return finish_call(&call, CUDA_SUCCESS);
}

CUAPI CUresult cuModuleGetFunction(CUfunction *hfunc, CUmodule hmod, const char *name) {
    struct standin_call call = begin_call("cuModuleGetFunction", CBID_cuModuleGetFunction, STANDIN_CALL_API);
    CUresult ready = check_ready();
    if (ready) return finish_call(&call, ready);
    if (!hfunc || !name) return finish_call(&call, CUDA_ERROR_INVALID_VALUE);
    if (!hmod) return finish_call(&call, CUDA_ERROR_INVALID_HANDLE);
    pthread_mutex_lock(&lock);
    struct CUfunc_st *f = hmod->functions;
    while (f && strcmp(f->name, name) != 0) f = f->next;
    if (!f) {
        uint16_t regs = 32;
        uint32_t smem = 0;
        int found = hmod->ndecls == 0;
        for (size_t i = 0; i < hmod->ndecls; i++) {
            if (strcmp(hmod->decls[i].name, name) == 0) {
                regs = hmod->decls[i].registers;
                smem = hmod->decls[i].static_shared;
                found = 1;
            }
        }
        if (found && (f = calloc(1, sizeof *f)) != NULL) {
            f->name = strdup(name); /* never freed: CUPTI records point at it */
            f->registers = regs;
            f->static_shared = smem;
            f->next = hmod->functions;
            hmod->functions = f;
        } else if (found) {
            pthread_mutex_unlock(&lock);
            return finish_call(&call, CUDA_ERROR_OUT_OF_MEMORY);
        }
    }
    pthread_mutex_unlock(&lock);
    if (!f) return finish_call(&call, CUDA_ERROR_NOT_FOUND);
    *hfunc = f;
    return finish_call(&call, CUDA_SUCCESS);
}

/* ---- launches ----------------------------------------------------------- */

static CUresult launch(struct standin_call *call, CUfunction f, const unsigned grid[3],
                       const unsigned block[3], unsigned shared, CUstream stream) {
    CUresult ready = check_ready();
    if (ready) return ready;
    if (!f) return CUDA_ERROR_INVALID_HANDLE;
    for (int i = 0; i < 3; i++)
        if (grid[i] == 0 || block[i] == 0) return CUDA_ERROR_INVALID_VALUE;
    if ((unsigned long long)block[0] * block[1] * block[2] > 1024) return CUDA_ERROR_INVALID_VALUE;
    call->kernel_name = f->name;
    call->registers = f->registers;
    call->static_shared = f->static_shared;
    call->dynamic_shared = shared;
    call->stream_id = stream_id_of(stream);
    memcpy(call->grid, grid, sizeof call->grid);
    memcpy(call->block, block, sizeof call->block);
    if (stream_id_of(stream) != STANDIN_DEFAULT_STREAM_ID && stream->capture) {
        /* Captured: becomes a node of the graph, runs on cuGraphLaunch. */
        struct CUgraph_st *g = stream->capture;
        pthread_mutex_lock(&lock);
        struct standin_graph_node *grown = realloc(g->nodes, (g->nnodes + 1) * sizeof *grown);
        if (!grown) {
            pthread_mutex_unlock(&lock);
            return CUDA_ERROR_OUT_OF_MEMORY;
        }
        g->nodes = grown;
        struct standin_graph_node *node = &g->nodes[g->nnodes++];
        memset(node, 0, sizeof *node);
        node->node_id = g->nnodes;
        node->source_node_id = g->nnodes;
        node->kernel_name = f->name;
        memcpy(node->grid, grid, sizeof node->grid);
        memcpy(node->block, block, sizeof node->block);
        node->dynamic_shared = shared;
        node->static_shared = f->static_shared;
        node->registers = f->registers;
        node->launch_ex = call->launch_ex;
        memcpy(node->cluster, call->cluster, sizeof node->cluster);
        pthread_mutex_unlock(&lock);
        call->kind = STANDIN_CALL_API;
        return CUDA_SUCCESS;
    }
    spin_us(kernel_spin());
    return CUDA_SUCCESS;
}

CUAPI CUresult cuLaunchKernel(CUfunction f, unsigned int gridDimX, unsigned int gridDimY,
                              unsigned int gridDimZ, unsigned int blockDimX, unsigned int blockDimY,
                              unsigned int blockDimZ, unsigned int sharedMemBytes, CUstream hStream,
                              void **kernelParams, void **extra) {
    (void)kernelParams;
    (void)extra;
    struct standin_call call = begin_call("cuLaunchKernel", CBID_cuLaunchKernel, STANDIN_CALL_KERNEL);
    const unsigned grid[3] = {gridDimX, gridDimY, gridDimZ};
    const unsigned block[3] = {blockDimX, blockDimY, blockDimZ};
    return finish_call(&call, launch(&call, f, grid, block, sharedMemBytes, hStream));
}

CUAPI CUresult cuLaunchKernelEx(const CUlaunchConfig *config, CUfunction f, void **kernelParams,
                                void **extra) {
    (void)kernelParams;
    (void)extra;
    struct standin_call call = begin_call("cuLaunchKernelEx", CBID_cuLaunchKernelEx, STANDIN_CALL_KERNEL);
    call.launch_ex = 1;
    CUresult ready = check_ready();
    if (ready) return finish_call(&call, ready);
    if (!config || (config->numAttrs && !config->attrs)) return finish_call(&call, CUDA_ERROR_INVALID_VALUE);
    for (unsigned i = 0; i < config->numAttrs; i++) {
        if (config->attrs[i].id == CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION) {
            call.cluster[0] = config->attrs[i].value.clusterDim.x;
            call.cluster[1] = config->attrs[i].value.clusterDim.y;
            call.cluster[2] = config->attrs[i].value.clusterDim.z;
        }
    }
    const unsigned grid[3] = {config->gridDimX, config->gridDimY, config->gridDimZ};
    const unsigned block[3] = {config->blockDimX, config->blockDimY, config->blockDimZ};
    return finish_call(&call, launch(&call, f, grid, block, config->sharedMemBytes, config->hStream));
}

/* ---- memory ------------------------------------------------------------- */

CUAPI CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytesize) {
    struct standin_call call = begin_call("cuMemAlloc_v2", CBID_cuMemAlloc_v2, STANDIN_CALL_ALLOC);
    CUresult ready = check_ready();
    if (ready) return finish_call(&call, ready);
    if (!dptr || bytesize == 0) return finish_call(&call, CUDA_ERROR_INVALID_VALUE);
    pthread_mutex_lock(&lock);
    if (nallocations == allocations_cap) {
        size_t cap = allocations_cap ? allocations_cap * 2 : 64;
        struct allocation *grown = realloc(allocations, cap * sizeof *grown);
        if (!grown) {
            pthread_mutex_unlock(&lock);
            return finish_call(&call, CUDA_ERROR_OUT_OF_MEMORY);
        }
        allocations = grown;
        allocations_cap = cap;
    }
    CUdeviceptr ptr = next_address;
    next_address += (bytesize + 255) & ~(size_t)255;
    allocations[nallocations++] = (struct allocation){ptr, bytesize, 1};
    pthread_mutex_unlock(&lock);
    *dptr = ptr;
    call.device_ptr = ptr;
    call.bytes = bytesize;
    return finish_call(&call, CUDA_SUCCESS);
}

CUAPI CUresult cuMemFree_v2(CUdeviceptr dptr) {
    struct standin_call call = begin_call("cuMemFree_v2", CBID_cuMemFree_v2, STANDIN_CALL_FREE);
    CUresult ready = check_ready();
    if (ready) return finish_call(&call, ready);
    if (dptr == 0) {
        call.kind = STANDIN_CALL_API;
        return finish_call(&call, CUDA_SUCCESS);
    }
    pthread_mutex_lock(&lock);
    struct allocation *a = find_allocation(dptr, 0);
    if (a && a->ptr == dptr) {
        call.bytes = a->size;
        /* Freed entries leave the table, so that a long-running program's
         * lookups stay as cheap as its first (addresses are never reused). */
        *a = allocations[--nallocations];
    } else {
        a = NULL;
    }
    pthread_mutex_unlock(&lock);
    if (!a) {
        call.kind = STANDIN_CALL_API;
        return finish_call(&call, CUDA_ERROR_INVALID_VALUE);
    }
    call.device_ptr = dptr;
    return finish_call(&call, CUDA_SUCCESS);
}

/* Checks and performs one copy; `kind` 0 means "work it out" (cuMemcpy*). */
static CUresult copy(struct standin_call *call, uint64_t dst, uint64_t src, size_t bytes,
                     uint32_t kind, CUstream stream, int is_async) {
    CUresult ready = check_ready();
    if (ready) return ready;
    if (kind == 0) {
        int src_dev = is_device(src, bytes), dst_dev = is_device(dst, bytes);
        kind = src_dev ? (dst_dev ? COPY_DTOD : COPY_DTOH) : (dst_dev ? COPY_HTOD : COPY_HTOH);
    }
    if (bytes && (!src || !dst)) return CUDA_ERROR_INVALID_VALUE;
    if ((kind == COPY_HTOD || kind == COPY_DTOD) && bytes && !is_device(dst, bytes))
        return CUDA_ERROR_INVALID_VALUE;
    if ((kind == COPY_DTOH || kind == COPY_DTOD) && bytes && !is_device(src, bytes))
        return CUDA_ERROR_INVALID_VALUE;
    if (is_async && stream_id_of(stream) != STANDIN_DEFAULT_STREAM_ID && stream->capture)
        return CUDA_ERROR_NOT_SUPPORTED; /* only kernels are captured */
    if (kind == COPY_DTOH && bytes) memset((void *)(uintptr_t)dst, 0, bytes);
    if (kind == COPY_HTOH && bytes) memmove((void *)(uintptr_t)dst, (const void *)(uintptr_t)src, bytes);
    call->copy_kind = kind;
    call->bytes = bytes;
    call->src = src;
    call->dst = dst;
    call->device_ptr = kind == COPY_DTOH ? src : dst;
    call->is_async = (uint32_t)is_async;
    call->stream_id = stream_id_of(stream);
    return CUDA_SUCCESS;
}

#define MEMCPY_CALL(api) begin_call(#api, CBID_##api, STANDIN_CALL_MEMCPY)

CUAPI CUresult cuMemcpy(CUdeviceptr dst, CUdeviceptr src, size_t ByteCount) {
    struct standin_call call = MEMCPY_CALL(cuMemcpy);
    return finish_call(&call, copy(&call, dst, src, ByteCount, 0, NULL, 0));
}

CUAPI CUresult cuMemcpyAsync(CUdeviceptr dst, CUdeviceptr src, size_t ByteCount, CUstream hStream) {
    struct standin_call call = MEMCPY_CALL(cuMemcpyAsync);
    return finish_call(&call, copy(&call, dst, src, ByteCount, 0, hStream, 1));
}

CUAPI CUresult cuMemcpyHtoD_v2(CUdeviceptr dstDevice, const void *srcHost, size_t ByteCount) {
    struct standin_call call = MEMCPY_CALL(cuMemcpyHtoD_v2);
    return finish_call(&call, copy(&call, dstDevice, (uintptr_t)srcHost, ByteCount, COPY_HTOD, NULL, 0));
}

CUAPI CUresult cuMemcpyDtoH_v2(void *dstHost, CUdeviceptr srcDevice, size_t ByteCount) {
    struct standin_call call = MEMCPY_CALL(cuMemcpyDtoH_v2);
    return finish_call(&call, copy(&call, (uintptr_t)dstHost, srcDevice, ByteCount, COPY_DTOH, NULL, 0));
}

CUAPI CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr dstDevice, const void *srcHost, size_t ByteCount,
                                    CUstream hStream) {
    struct standin_call call = MEMCPY_CALL(cuMemcpyHtoDAsync_v2);
    return finish_call(&call, copy(&call, dstDevice, (uintptr_t)srcHost, ByteCount, COPY_HTOD, hStream, 1));
}

CUAPI CUresult cuMemcpyDtoHAsync_v2(void *dstHost, CUdeviceptr srcDevice, size_t ByteCount,
                                    CUstream hStream) {
    struct standin_call call = MEMCPY_CALL(cuMemcpyDtoHAsync_v2);
    return finish_call(&call, copy(&call, (uintptr_t)dstHost, srcDevice, ByteCount, COPY_DTOH, hStream, 1));
}

CUAPI CUresult cuMemcpyDtoD_v2(CUdeviceptr dstDevice, CUdeviceptr srcDevice, size_t ByteCount) {
    struct standin_call call = MEMCPY_CALL(cuMemcpyDtoD_v2);
    return finish_call(&call, copy(&call, dstDevice, srcDevice, ByteCount, COPY_DTOD, NULL, 0));
}

CUAPI CUresult cuMemsetD8_v2(CUdeviceptr dstDevice, unsigned char uc, size_t N) {
    struct standin_call call = begin_call("cuMemsetD8_v2", CBID_cuMemsetD8_v2, STANDIN_CALL_MEMSET);
    CUresult ready = check_ready();
    if (ready) return finish_call(&call, ready);
    if (N && !is_device(dstDevice, N)) return finish_call(&call, CUDA_ERROR_INVALID_VALUE);
    call.device_ptr = dstDevice;
    call.dst = dstDevice;
    call.bytes = N;
    call.memset_value = uc;
    call.stream_id = STANDIN_DEFAULT_STREAM_ID;
    return finish_call(&call, CUDA_SUCCESS);
}

/* ---- streams and events -------------------------------------------------- */

CUAPI CUresult cuStreamCreate(CUstream *phStream, unsigned int Flags) {
    (void)Flags;
    struct standin_call call = begin_call("cuStreamCreate", CBID_cuStreamCreate, STANDIN_CALL_API);
    CUresult ready = check_ready();
    if (ready) return finish_call(&call, ready);
    if (!phStream) return finish_call(&call, CUDA_ERROR_INVALID_VALUE);
    CUstream stream = calloc(1, sizeof *stream);
    if (!stream) return finish_call(&call, CUDA_ERROR_OUT_OF_MEMORY);
    pthread_mutex_lock(&lock);
    stream->id = next_stream_id++;
    pthread_mutex_unlock(&lock);
    stream->context_id = context_id();
    *phStream = stream;
    call.stream_id = stream->id;
    return finish_call(&call, CUDA_SUCCESS);
}

CUAPI CUresult cuStreamDestroy_v2(CUstream hStream) {
    struct standin_call call = begin_call("cuStreamDestroy_v2", CBID_cuStreamDestroy_v2, STANDIN_CALL_API);
    CUresult ready = check_ready();
    if (ready) return finish_call(&call, ready);
    if (stream_id_of(hStream) == STANDIN_DEFAULT_STREAM_ID) return finish_call(&call, CUDA_ERROR_INVALID_HANDLE);
    call.stream_id = hStream->id;
    free(hStream);
    return finish_call(&call, CUDA_SUCCESS);
}

CUAPI CUresult cuStreamSynchronize(CUstream hStream) {
    struct standin_call call = begin_call("cuStreamSynchronize", CBID_cuStreamSynchronize, STANDIN_CALL_SYNC);
    CUresult ready = check_ready();
    if (ready) return finish_call(&call, ready);
    call.sync_type = SYNC_STREAM;
    call.stream_id = stream_id_of(hStream);
    if (call.stream_id != STANDIN_DEFAULT_STREAM_ID && hStream->capture) {
        call.kind = STANDIN_CALL_API;
        return finish_call(&call, CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED);
    }
    spin_us(sync_spin());
    return finish_call(&call, CUDA_SUCCESS);
}

CUAPI CUresult cuEventCreate(CUevent *phEvent, unsigned int Flags) {
    (void)Flags;
    struct standin_call call = begin_call("cuEventCreate", CBID_cuEventCreate, STANDIN_CALL_API);
    CUresult ready = check_ready();
    if (ready) return finish_call(&call, ready);
    if (!phEvent) return finish_call(&call, CUDA_ERROR_INVALID_VALUE);
    CUevent event = calloc(1, sizeof *event);
    if (!event) return finish_call(&call, CUDA_ERROR_OUT_OF_MEMORY);
    pthread_mutex_lock(&lock);
    event->id = next_event_id++;
    pthread_mutex_unlock(&lock);
    event->stream_id = NO_ID;
    *phEvent = event;
    call.event_id = event->id;
    return finish_call(&call, CUDA_SUCCESS);
}

CUAPI CUresult cuEventRecord(CUevent hEvent, CUstream hStream) {
    struct standin_call call = begin_call("cuEventRecord", CBID_cuEventRecord, STANDIN_CALL_API);
    CUresult ready = check_ready();
    if (ready) return finish_call(&call, ready);
    if (!hEvent) return finish_call(&call, CUDA_ERROR_INVALID_HANDLE);
    if (stream_id_of(hStream) != STANDIN_DEFAULT_STREAM_ID && hStream->capture)
        return finish_call(&call, CUDA_ERROR_NOT_SUPPORTED);
    hEvent->stream_id = stream_id_of(hStream);
    call.event_id = hEvent->id;
    call.stream_id = hEvent->stream_id;
    return finish_call(&call, CUDA_SUCCESS);
}

CUAPI CUresult cuEventSynchronize(CUevent hEvent) {
    struct standin_call call = begin_call("cuEventSynchronize", CBID_cuEventSynchronize, STANDIN_CALL_SYNC);
    CUresult ready = check_ready();
    if (ready) return finish_call(&call, ready);
    if (!hEvent) return finish_call(&call, CUDA_ERROR_INVALID_HANDLE);
    call.sync_type = SYNC_EVENT;
    call.event_id = hEvent->id;
    spin_us(sync_spin());
    return finish_call(&call, CUDA_SUCCESS);
}

CUAPI CUresult cuEventDestroy_v2(CUevent hEvent) {
    struct standin_call call = begin_call("cuEventDestroy_v2", CBID_cuEventDestroy_v2, STANDIN_CALL_API);
    CUresult ready = check_ready();
    if (ready) return finish_call(&call, ready);
    if (!hEvent) return finish_call(&call, CUDA_ERROR_INVALID_HANDLE);
    call.event_id = hEvent->id;
    free(hEvent);
    return finish_call(&call, CUDA_SUCCESS);
}

/* ---- graphs --------------------------------------------------------------- */

CUAPI CUresult cuStreamBeginCapture_v2(CUstream hStream, CUstreamCaptureMode mode) {
    struct standin_call call = begin_call("cuStreamBeginCapture_v2", CBID_cuStreamBeginCapture_v2, STANDIN_CALL_API);
    CUresult ready = check_ready();
    if (ready) return finish_call(&call, ready);
    call.stream_id = stream_id_of(hStream);
    if (mode != CU_STREAM_CAPTURE_MODE_GLOBAL && mode != CU_STREAM_CAPTURE_MODE_THREAD_LOCAL &&
        mode != CU_STREAM_CAPTURE_MODE_RELAXED)
        return finish_call(&call, CUDA_ERROR_INVALID_VALUE);
    if (call.stream_id == STANDIN_DEFAULT_STREAM_ID) return finish_call(&call, CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED);
    if (hStream->capture) return finish_call(&call, CUDA_ERROR_ILLEGAL_STATE);
    struct CUgraph_st *g = calloc(1, sizeof *g);
    if (!g) return finish_call(&call, CUDA_ERROR_OUT_OF_MEMORY);
    hStream->capture = g;
    return finish_call(&call, CUDA_SUCCESS);
}

CUAPI CUresult cuStreamEndCapture(CUstream hStream, CUgraph *phGraph) {
    struct standin_call call = begin_call("cuStreamEndCapture", CBID_cuStreamEndCapture, STANDIN_CALL_API);
    CUresult ready = check_ready();
    if (ready) return finish_call(&call, ready);
    if (!phGraph) return finish_call(&call, CUDA_ERROR_INVALID_VALUE);
    call.stream_id = stream_id_of(hStream);
    if (call.stream_id == STANDIN_DEFAULT_STREAM_ID || !hStream->capture)
        return finish_call(&call, CUDA_ERROR_ILLEGAL_STATE);
    struct CUgraph_st *g = hStream->capture;
    hStream->capture = NULL;
    pthread_mutex_lock(&lock);
    g->id = next_graph_id++;
    g->next = graphs;
    graphs = g;
    pthread_mutex_unlock(&lock);
    *phGraph = g;
    return finish_call(&call, CUDA_SUCCESS);
}

CUAPI CUresult cuGraphInstantiateWithFlags(CUgraphExec *phGraphExec, CUgraph hGraph, unsigned long long flags) {
    (void)flags;
    struct standin_call call =
        begin_call("cuGraphInstantiateWithFlags", CBID_cuGraphInstantiateWithFlags, STANDIN_CALL_API);
    CUresult ready = check_ready();
    if (ready) return finish_call(&call, ready);
    if (!phGraphExec) return finish_call(&call, CUDA_ERROR_INVALID_VALUE);
    struct CUgraphExec_st *e = calloc(1, sizeof *e);
    if (!e) return finish_call(&call, CUDA_ERROR_OUT_OF_MEMORY);
    pthread_mutex_lock(&lock);
    struct CUgraph_st *g = graphs;
    while (g && g != hGraph) g = g->next;
    if (!g) {
        pthread_mutex_unlock(&lock);
        free(e);
        return finish_call(&call, CUDA_ERROR_INVALID_VALUE);
    }
    e->nodes = calloc(g->nnodes ? g->nnodes : 1, sizeof *e->nodes);
    if (!e->nodes) {
        pthread_mutex_unlock(&lock);
        free(e);
        return finish_call(&call, CUDA_ERROR_OUT_OF_MEMORY);
    }
    for (size_t i = 0; i < g->nnodes; i++) {
        e->nodes[i] = g->nodes[i];
        e->nodes[i].node_id = i + 1;
        e->nodes[i].source_node_id = g->nodes[i].node_id;
    }
    e->nnodes = g->nnodes;
    e->source_graph_id = g->id;
    e->id = next_graph_id++;
    e->next = graph_execs;
    graph_execs = e;
    pthread_mutex_unlock(&lock);
    *phGraphExec = e;
    return finish_call(&call, CUDA_SUCCESS);
}

CUAPI CUresult cuGraphLaunch(CUgraphExec hGraphExec, CUstream hStream) {
    struct standin_call call = begin_call("cuGraphLaunch", CBID_cuGraphLaunch, STANDIN_CALL_GRAPH_LAUNCH);
    CUresult ready = check_ready();
    if (ready) return finish_call(&call, ready);
    call.stream_id = stream_id_of(hStream);
    if (call.stream_id != STANDIN_DEFAULT_STREAM_ID && hStream->capture)
        return finish_call(&call, CUDA_ERROR_NOT_SUPPORTED);
    pthread_mutex_lock(&lock);
    struct CUgraphExec_st *e = graph_execs;
    while (e && e != hGraphExec) e = e->next;
    pthread_mutex_unlock(&lock);
    if (!e) return finish_call(&call, CUDA_ERROR_INVALID_HANDLE);
    call.graph_id = e->id;
    call.source_graph_id = e->source_graph_id;
    call.nnodes = (uint32_t)e->nnodes;
    call.nodes = e->nodes;
    spin_us(kernel_spin());
    return finish_call(&call, CUDA_SUCCESS);
}

CUAPI CUresult cuGraphExecDestroy(CUgraphExec hGraphExec) {
    struct standin_call call = begin_call("cuGraphExecDestroy", CBID_cuGraphExecDestroy, STANDIN_CALL_API);
    if (!is_initialized()) return finish_call(&call, CUDA_ERROR_NOT_INITIALIZED);
    pthread_mutex_lock(&lock);
    struct CUgraphExec_st **link = &graph_execs;
    while (*link && *link != hGraphExec) link = &(*link)->next;
    struct CUgraphExec_st *e = *link;
    if (e) *link = e->next;
    pthread_mutex_unlock(&lock);
    if (!e) return finish_call(&call, CUDA_ERROR_INVALID_VALUE);
    free(e->nodes);
    free(e);
    return finish_call(&call, CUDA_SUCCESS);
}

CUAPI CUresult cuGraphDestroy(CUgraph hGraph) {
    struct standin_call call = begin_call("cuGraphDestroy", CBID_cuGraphDestroy, STANDIN_CALL_API);
    if (!is_initialized()) return finish_call(&call, CUDA_ERROR_NOT_INITIALIZED);
    pthread_mutex_lock(&lock);
    struct CUgraph_st **link = &graphs;
    while (*link && *link != hGraph) link = &(*link)->next;
    struct CUgraph_st *g = *link;
    if (g) *link = g->next;
    pthread_mutex_unlock(&lock);
    if (!g) return finish_call(&call, CUDA_ERROR_INVALID_VALUE);
    free(g->nodes);
    free(g);
    return finish_call(&call, CUDA_SUCCESS);
}

/* ---- errors -------------------------------------------------------------- */

CUAPI CUresult cuGetErrorString(CUresult error, const char **pStr) {
    struct standin_call call = begin_call("cuGetErrorString", CBID_cuGetErrorString, STANDIN_CALL_API);
    if (!pStr) return finish_call(&call, CUDA_ERROR_INVALID_VALUE);
    const char *text;
    switch (error) {
    case CUDA_SUCCESS: text = "no error"; break;
    case CUDA_ERROR_INVALID_VALUE: text = "invalid argument"; break;
    case CUDA_ERROR_OUT_OF_MEMORY: text = "out of memory"; break;
    case CUDA_ERROR_NOT_INITIALIZED: text = "initialization error"; break;
    case CUDA_ERROR_DEINITIALIZED: text = "driver shutting down"; break;
    case CUDA_ERROR_NO_DEVICE: text = "no CUDA-capable device is detected"; break;
    case CUDA_ERROR_INVALID_DEVICE: text = "invalid device ordinal"; break;
    case CUDA_ERROR_INVALID_IMAGE: text = "device kernel image is invalid"; break;
    case CUDA_ERROR_INVALID_CONTEXT: text = "invalid device context"; break;
    case CUDA_ERROR_INVALID_HANDLE: text = "invalid resource handle"; break;
    case CUDA_ERROR_ILLEGAL_STATE: text = "the operation cannot be performed in the present state"; break;
    case CUDA_ERROR_NOT_FOUND: text = "named symbol not found"; break;
    case CUDA_ERROR_NOT_READY: text = "device not ready"; break;
    case CUDA_ERROR_LAUNCH_FAILED: text = "unspecified launch failure"; break;
    case CUDA_ERROR_NOT_SUPPORTED: text = "operation not supported"; break;
    case CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED: text = "operation not permitted when stream is capturing"; break;
    case CUDA_ERROR_UNKNOWN: text = "unknown error"; break;
    default:
        *pStr = NULL;
        return finish_call(&call, CUDA_ERROR_INVALID_VALUE);
    }
    *pStr = text;
    return finish_call(&call, CUDA_SUCCESS);
}
