/*
 * The private channel between the two GPU stand-ins in this directory:
 * tests/standins/libcuda.c (the driver) describes every driver API call it
 * completes in a `struct standin_call`, and tests/standins/cupti.c (the
 * profiling library) turns those descriptions into CUPTI activity records.
 *
 * Registration runs from the CUPTI side, because a profiler usually loads
 * libcupti with RTLD_LOCAL (libloading's default), which hides its symbols
 * from dlsym(RTLD_DEFAULT, ...) in the driver:
 *
 *   libcuda exports  void devtrace_standin_cuda_set_hook(devtrace_standin_hook);
 *   libcupti finds it with dlsym(RTLD_DEFAULT) (or dlopen("libcuda.so.1",
 *   RTLD_NOLOAD)) from its constructor and again from each CUPTI entry point
 *   until it succeeds, and registers its handler.
 *
 * For a libcupti loaded before the driver, the first cuInit also looks up
 * `devtrace_standin_cupti_on_call` itself: globally, then in an
 * already-loaded libcupti.so.12 or libcupti.so (dlopen RTLD_NOLOAD).
 *
 * Devices: libcuda also exports
 *   int devtrace_standin_device_physical(int ordinal);
 * the physical GPU index (0 .. $DEVTRACE_STANDIN_GPUS-1) behind CUDA ordinal
 * `ordinal` under $CUDA_VISIBLE_DEVICES, or -1 when there is no such ordinal.
 * libcupti finds it the same way as the hook and writes one DEVICE record
 * per visible ordinal; physical GPU i has the UUID bytes
 * STANDIN_GPU_UUID(i), which the NVML stand-in (nvml.c) reports too.
 *
 * Nothing here is part of the real CUDA ABI.
 */
#ifndef DEVTRACE_STANDIN_CALL_H
#define DEVTRACE_STANDIN_CALL_H

#include <stdint.h>

#define STANDIN_CALL_VERSION 3

/* Stream id the stand-ins give the legacy default stream (NULL,
 * CU_STREAM_LEGACY, CU_STREAM_PER_THREAD), as real CUPTI commonly reports. */
#define STANDIN_DEFAULT_STREAM_ID 7u
/* Streams made by cuStreamCreate get 13, 14, 15, ... */
#define STANDIN_FIRST_STREAM_ID 13u

/* The 16 UUID bytes of physical GPU `i` (0..255), as an initializer. */
#define STANDIN_GPU_UUID(i) \
    {0x5e, 0x7a, 0x4d, 0x1b, 0x00, 0x00, 0x40, 0x00, 0x80, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, (uint8_t)(i)}

enum standin_call_kind {
    STANDIN_CALL_API = 0,         /* host-only call, no device activity */
    STANDIN_CALL_KERNEL = 1,      /* cuLaunchKernel, cuLaunchKernelEx (API when captured) */
    STANDIN_CALL_MEMCPY = 2,      /* every cuMemcpy* */
    STANDIN_CALL_MEMSET = 3,      /* cuMemsetD8_v2 */
    STANDIN_CALL_ALLOC = 4,       /* cuMemAlloc_v2 */
    STANDIN_CALL_FREE = 5,        /* cuMemFree_v2 */
    STANDIN_CALL_SYNC = 6,        /* cuStreamSynchronize, cuCtxSynchronize, cuEventSynchronize */
    STANDIN_CALL_CTX_CREATE = 7,  /* cuCtxCreate_v2 */
    STANDIN_CALL_CTX_DESTROY = 8, /* cuCtxDestroy_v2 */
    STANDIN_CALL_GRAPH_LAUNCH = 9, /* cuGraphLaunch: `nodes` run in order on stream_id */
};

/* One kernel node of an instantiated graph (STANDIN_CALL_GRAPH_LAUNCH). */
struct standin_graph_node {
    uint64_t node_id;          /* 1, 2, ... within the CUgraphExec */
    uint64_t source_node_id;   /* the node of the CUgraph it came from: 1, 2, ... */
    const char *kernel_name;   /* lives until exit */
    uint32_t grid[3];
    uint32_t block[3];
    uint32_t dynamic_shared;
    uint32_t static_shared;
    uint16_t registers;
    uint16_t launch_ex;        /* captured from cuLaunchKernelEx */
    uint32_t cluster[3];
};

struct standin_call {
    uint32_t version;        /* STANDIN_CALL_VERSION */
    uint32_t kind;           /* enum standin_call_kind */
    const char *api_name;    /* "cuLaunchKernel", ... (static storage) */
    uint32_t cbid;           /* CUPTI_DRIVER_TRACE_CBID_* of the call */
    int32_t result;          /* the CUresult the call returned */
    uint64_t start_ns;       /* CLOCK_REALTIME at entry */
    uint64_t end_ns;         /* CLOCK_REALTIME at return */
    uint32_t pid;            /* getpid() */
    uint32_t tid;            /* gettid() */
    uint64_t pthread_id;     /* (uint64_t)pthread_self() */
    uint32_t device_id;      /* CUDA ordinal of the current context's device (0 if none) */
    uint32_t context_id;     /* 1, 2, ... in creation order; 0 if none current */
    uint32_t stream_id;      /* see STANDIN_*_STREAM_ID; 0xFFFFFFFF if none */
    uint32_t event_id;       /* cuEvent* calls: 1, 2, ...; else 0xFFFFFFFF */

    /* STANDIN_CALL_KERNEL */
    const char *kernel_name;   /* name given to cuModuleGetFunction; lives until exit */
    uint32_t grid[3];
    uint32_t block[3];
    uint32_t dynamic_shared;   /* sharedMemBytes of the launch */
    uint32_t static_shared;    /* from the module image, see libcuda.c */
    uint16_t registers;        /* from the module image, see libcuda.c */
    uint16_t launch_ex;        /* 1 for cuLaunchKernelEx */
    uint32_t cluster[3];       /* CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION, else 0 */

    /* STANDIN_CALL_MEMCPY / MEMSET / ALLOC / FREE */
    uint64_t bytes;
    uint32_t copy_kind;        /* CUpti_ActivityMemcpyKind: 1 HTOD, 2 DTOH, 8 DTOD, 9 HTOH */
    uint32_t memset_value;     /* the byte cuMemsetD8_v2 writes */
    uint64_t device_ptr;       /* alloc/free/memset target; memcpy device side */
    uint64_t src;              /* memcpy source address */
    uint64_t dst;              /* memcpy destination address */
    uint32_t is_async;         /* the *Async variants */

    /* STANDIN_CALL_SYNC: CUpti_ActivitySynchronizationType
     * (1 event, 3 stream, 4 context) */
    uint32_t sync_type;

    /* STANDIN_CALL_GRAPH_LAUNCH (valid only during the hook call) */
    uint32_t graph_id;         /* unique id of the CUgraphExec (nonzero) */
    uint32_t source_graph_id;  /* unique id of the CUgraph it was instantiated from */
    uint32_t nnodes;
    const struct standin_graph_node *nodes;

    /* The hook sees each call twice: at entry (STANDIN_SITE_ENTER, from the
     * driver's begin_call, before the call does anything; the other fields
     * but start_ns are not filled in yet) and at return (STANDIN_SITE_EXIT).
     * The CUPTI stand-in may number the call at entry (correlation_id) and
     * hands its Callback API subscriber &correlation_data at both sites, as
     * CUPTI's CUpti_CallbackData.correlationData. */
    uint32_t site;
    uint32_t correlation_id;   /* 0 until the CUPTI stand-in numbers the call */
    uint64_t correlation_data;
    /* The correlationData slot of the runtime call the CUPTI stand-in may
     * wrap a launch in ($DEVTRACE_STANDIN_CUPTI_RUNTIME_LAUNCHES, cupti.c). */
    uint64_t runtime_correlation_data;
};

#define STANDIN_SITE_ENTER 0u
#define STANDIN_SITE_EXIT 1u

typedef void (*devtrace_standin_hook)(struct standin_call *call);
typedef int (*devtrace_standin_physical_fn)(int ordinal);

#endif
