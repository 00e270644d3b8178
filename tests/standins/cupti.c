/*
 * A stand-in for libcupti.so (by default CUDA 12.8, CUPTI_API_VERSION 26)
 * with the real C ABI of the Activity API: same symbol names and signatures,
 * and activity records laid out byte for byte like cupti_activity.h (packed,
 * 8-byte aligned), which for 12.8 is also what cudarc's `cuda-12080`
 * bindings read.
 *
 * $DEVTRACE_STANDIN_CUPTI_VERSION (read once, default 26) is the API version
 * cuptiGetVersion returns, records are written in the layout of that
 * release (CUPTI writes the newest record version it has for each kind), and
 * buffered as that release does: one buffer for the process before 130000,
 * one per thread from 130000 (Behaviour, below).
 * Versions only append fields, so every field keeps its offset, and an older
 * layout is a prefix of the newest one (CUpti_ActivityKernel13, Memcpy7,
 * Memset5, Device6 below); cuptiActivityGetNextRecord steps by the size
 * written. Kinds and sizes:
 *
 *   DRIVER                   CUpti_ActivityAPI                40 bytes
 *   KERNEL/CONCURRENT_KERNEL CUpti_ActivityKernel9           208 bytes  < 130000
 *                            Kernel10 (+isDeviceLaunched@208) 216 bytes  >= 130000 (13.0)
 *                            Kernel11 (+int32 priority@216)   224 bytes  >= 130100 (13.1)
 *                            Kernel12 (+executionModel@224)   232 bytes  >= 130300 (13.3)
 *                            Kernel13 (+sourceGraphId@232,
 *                                      sourceGraphNodeId@240) 248 bytes  >= 130400 (13.4)
 *   MEMCPY                   CUpti_ActivityMemcpy6            96 bytes  < 130400
 *                              (13.0+: byte 84 is isDeviceLaunched)
 *                            Memcpy7 (+sourceGraphId@96,
 *                                     sourceGraphNodeId@104) 112 bytes  >= 130400
 *   MEMSET                   CUpti_ActivityMemset4            88 bytes  < 130400
 *                              (13.0+: byte 84 is isDeviceLaunched)
 *                            Memset5 (+sourceGraphId@88,
 *                                     sourceGraphNodeId@96)  104 bytes  >= 130400
 *   MEMORY2                  CUpti_ActivityMemory4           128 bytes
 *   DEVICE                   CUpti_ActivityDevice5           184 bytes  < 130200
 *                            Device6 (+numTpcs@184)          192 bytes  >= 130200 (13.2)
 *   CONTEXT                  CUpti_ActivityContext3           32 bytes
 *   OVERHEAD                 CUpti_ActivityOverhead3          56 bytes
 *   SYNCHRONIZATION          CUpti_ActivitySynchronization2   56 bytes
 *
 * The newer fields hold: isDeviceLaunched 0 (all work is host-launched),
 * priority 0, executionModel 0 (CUPTI_FUNC_EXECUTION_MODEL_UNKNOWN), numTpcs
 * 66; graphId/graphNodeId (in every version) and sourceGraphId/
 * sourceGraphNodeId are 0 except for kernels of a graph launch (below).
 *
 * Build it once and symlink the other names cudarc may open:
 *   cc -shared -fPIC -O2 -Wall -Werror -Wl,-soname,libcupti.so.12 \
 *      -o libcupti.so.12 cupti.c && ln -sf libcupti.so.12 libcupti.so
 *
 * Activity comes from tests/standins/libcuda.c: this library registers a
 * handler with it (standin_call.h) and turns each driver call into records.
 *
 * Behaviour:
 * - All real kinds (1..54) can be enabled; records are written for the kinds
 *   listed above. Each driver call gets a correlation id (1, 2, ...) shared by
 *   its DRIVER record and its device record(s). Failed calls get only a DRIVER
 *   record. Every call the driver stand-in reports gets a DRIVER record with
 *   its cbid, cuDriverGetVersion (cbid 2, callable before cuInit) included.
 * - CUDA graphs: each cuGraphLaunch (DRIVER cbid 514) writes one kernel record
 *   per kernel node of the graph exec, in node order on the launch stream,
 *   all with the correlation id of that cuGraphLaunch, graphId = the
 *   CUgraphExec's id, graphNodeId = its node id (1, 2, ...),
 *   sourceGraphId / sourceGraphNodeId (13.4 layout) = the CUgraph it was
 *   instantiated from and that graph's node id. Launches captured into a
 *   graph get only their DRIVER record (libcuda.c).
 * - Clock: CLOCK_REALTIME ns + $DEVTRACE_STANDIN_GPU_CLOCK_OFFSET_NS (signed,
 *   default 0). cuptiGetTimestamp, DRIVER/SYNCHRONIZATION records (host entry
 *   and return of the call) and device records all use it, until a user
 *   registers a clock of its own with cuptiActivityRegisterTimestampCallback
 *   (PyTorch's Kineto registers the CPU's TSC, whose ticks are no
 *   nanoseconds): every record written after that carries that clock's
 *   readings, for the rest of the process (a finalize keeps it; nothing
 *   unregisters it), while cuptiGetTimestamp keeps CUPTI's own clock. (On an
 *   H200 with CUDA 13.0, the records of a capture after torch.profiler,
 *   mapped through cuptiGetTimestamp, fell decades before the window.)
 * - Device work starts at the call's entry, or when the previous work on the
 *   same stream ends if that is later, and lasts
 *   $DEVTRACE_STANDIN_GPU_KERNEL_NS (default 5000), $DEVTRACE_STANDIN_GPU_MEMCPY_NS
 *   (default 2000) or $DEVTRACE_STANDIN_GPU_MEMSET_NS (default 1000) exactly.
 * - Enabling DEVICE writes one DEVICE record per CUDA ordinal the driver
 *   stand-in makes visible (devtrace_standin_device_physical, standin_call.h;
 *   $DEVTRACE_STANDIN_GPUS and $CUDA_VISIBLE_DEVICES): id = the ordinal,
 *   uuid = STANDIN_GPU_UUID(physical index), "Standin GPU", sm_90, 132 SMs,
 *   80 GiB (ordinal 0 on physical GPU 0 if the driver stand-in is not
 *   loaded). Enabling CONTEXT writes a record for each context made so far,
 *   and later contexts get one when made; deviceId is the context's ordinal.
 * - Buffers come from the client's bufferRequested callback when a record
 *   needs room. Records sit at 8-byte-aligned offsets; a record fits when the
 *   bytes used so far plus its size are at most the buffer's size, so a
 *   buffer of exactly one record's size (40 bytes for DRIVER) holds one.
 * - Which buffer: below API version 130000 (CUDA 12.x) one buffer is being
 *   filled for the whole process. From 130000 (CUDA 13.0) each thread has its
 *   own: the records of a driver call go into the buffer of the thread that
 *   made it (standin_call.tid), records tied to no call (DEVICE and CONTEXT
 *   records written by cuptiActivityEnable) into that of the thread calling
 *   CUPTI. Threads are told apart by gettid() in a table of 256 slots; a slot
 *   whose buffer was handed back may go to another thread, and threads
 *   finding no slot share one more buffer.
 * - When a record needs room and its buffer is missing, too full for it, or
 *   at maxNumRecords, that buffer is handed back and bufferRequested (of the
 *   pair registered now) is called at once, synchronously, on the thread
 *   writing the record (the thread of the driver call, or the one calling
 *   CUPTI), and the record then goes into the new buffer. So from 130000,
 *   with buffers of one record's size, every record a thread writes after its
 *   first makes one bufferRequested call on that thread.
 * - cuptiActivityFlushAll (and the deprecated cuptiActivityFlush, whose
 *   context and stream are ignored): flag 0 hands back each partly filled
 *   buffer (every thread's, from 130000) once all device work in it has
 *   ended; CUPTI_ACTIVITY_FLAG_FLUSH_FORCED (1) hands back every buffer being
 *   filled (even an empty one), and as CUPTI's documentation says of
 *   incomplete records, the kernels, copies and memsets in it whose device
 *   work has not ended come back unfinished: end (and a kernel's completed)
 *   0, start 0 too if the work had not started, never filled in later. (A
 *   buffer handed back because it is full comes back at once with its
 *   records complete, as if CUPTI had waited for them: kinder than CUPTI.)
 *   bufferCompleted runs on a worker thread of this library; cuptiActivityFlushAll returns after it has delivered
 *   everything handed back so far. cuptiActivityFlushPeriod(ms) makes
 *   the worker do a flag-0 flush every ms; cuptiFinalize does a forced one.
 * - Several users in one process (a second profiler such as PyTorch's Kineto
 *   next to devtrace), as real CUPTI 13.0 behaves (seen on an H200: Kineto
 *   reported "bufferCompleted called with unknown buffer" for another user's
 *   buffers, and lost records written into them): a later
 *   cuptiActivityRegisterCallbacks replaces the pair for later buffer
 *   requests, buffers being filled at that moment stay and keep being
 *   filled, and every buffer goes to the bufferCompleted registered when it
 *   is delivered, whoever supplied it. Enable/disable stay global per kind:
 *   the Activity API is per process, not per user, so one user's
 *   cuptiActivityDisable stops that kind for everyone.
 * - A NULL buffer, a zero size, a buffer smaller than the record, or a buffer
 *   not 8-byte aligned (the last two handed straight back with validSize 0)
 *   drops the record it was requested for and counts it; the next record of
 *   that thread (of any thread below 130000) asks again.
 *   $DEVTRACE_STANDIN_CUPTI_DROP=N adds N to the count when the first buffer
 *   is handed back. cuptiActivityGetNumDroppedRecords
 *   returns the count (one global count, whatever context/stream is asked)
 *   and resets it to zero, as documented for the real call.
 * - $DEVTRACE_STANDIN_CUPTI_FAIL="cuptiActivityEnable,cuptiActivityFlushAll=1"
 *   makes the named entry points fail, with CUPTI_ERROR_NOT_INITIALIZED (15)
 *   or the code after '='.
 * - Which calls get a DRIVER record, as cupti_activity.h documents: enabling
 *   the DRIVER kind records every call, disabling it none, and
 *   cuptiActivityEnableDriverApi(cbid, on) switches one callback id without
 *   the kind (a later cuptiActivityEnable(DRIVER) overrides the selection).
 *   Ids from 1 up to the release's CUPTI_DRIVER_TRACE_CBID_SIZE are taken
 *   (782 below 130000, as in 12.8; 877 from it, as in 13.5); others answer
 *   CUPTI_ERROR_INVALID_PARAMETER. cuptiActivityEnableRuntimeApi is the same
 *   for runtime ids (sizes 487 and 567), though no call here is a runtime
 *   one. Built with -DSTANDIN_CUPTI_WITHOUT_PER_CALL_ENABLES the library has
 *   neither entry point, as libcupti before them. With
 *   $DEVTRACE_STANDIN_CUPTI_IGNORE_SELECTION=1 both succeed and select
 *   nothing, as libcupti 13.0 did on an H200: not one of 128,608 kernels of
 *   a capture had its launch's record.
 * - What CUPTI charges a driver call, modeled on what an H200 (CUDA 13.0)
 *   showed: from the first enable to cuptiFinalize every call pays
 *   $DEVTRACE_STANDIN_CUPTI_ARMED_NS (default 1000), kinds enabled or not;
 *   a call given a DRIVER record pays $DEVTRACE_STANDIN_CUPTI_API_RECORD_NS
 *   more (default 1900: the launch-bound loop cost 3.4 us per kernel with
 *   its launches' API records, 1.55 us with kernel records alone); each call
 *   of a subscriber's callback costs $DEVTRACE_STANDIN_CUPTI_CALLBACK_NS
 *   (default 100). A driver call for which nothing is enabled (no DRIVER
 *   record for its id, no kind its device work or synchronization would be
 *   recorded under, no subscriber listening) costs the call only a few
 *   loads: no lock, no correlation id.
 * - What enabling takes: the first cuptiActivityEnable after load or a
 *   finalize holds CUPTI's lock for $DEVTRACE_STANDIN_CUPTI_FIRST_ENABLE_MS
 *   (default 100; CUPTI's took 0.1-0.3 s on an H100). Each enable of a kind
 *   that was off returns $DEVTRACE_STANDIN_CUPTI_ENABLE_MS (default 0) after
 *   the kind is on, so that records of it are written while its caller has
 *   not yet enabled the next kind.
 * - $DEVTRACE_STANDIN_CUPTI_RUNTIME_LAUNCHES=1 presents each kernel launch
 *   (cuLaunchKernel, cuLaunchKernelEx) as PyTorch's reach CUPTI: inside a
 *   runtime call, cudaLaunchKernel (CUPTI_RUNTIME_TRACE_CBID_
 *   cudaLaunchKernel_v7000, 211). The runtime call gets the correlation id
 *   and shares it with the driver call inside it and the kernel; a
 *   subscriber with the runtime API domain enabled is called at the runtime
 *   call's entry, then the driver call's entry, exit, and the runtime call's
 *   exit; the launch gets a RUNTIME record (when cbid 211 or the RUNTIME
 *   kind is enabled) and never a DRIVER record, as CUPTI writes none for a
 *   driver call made by the runtime. cuptiGetCallbackName knows the name.
 * - cuptiSubscribe allows one subscriber (a second gets
 *   CUPTI_ERROR_MULTIPLE_SUBSCRIBERS_NOT_SUPPORTED), and so does
 *   cuptiSubscribe_v2 (CUDA 13.0's: its CUpti_SubscriberParams, when given,
 *   must say its size; the name fields are ignored). Its callback is called
 *   at the entry and exit sites of each driver call once it enabled the
 *   driver API domain, with the call's correlation id (the one its activity
 *   records carry) and a correlationData slot shared by the two sites,
 *   except for a subscriber made while CUPTI is armed but every
 *   activity kind is switched off again (after a capture, before a
 *   finalize): that one is never called. So it was on CUPTI 13.0 (H200,
 *   driver 580): subscribers made after a capture had disabled its kinds
 *   saw no API exit in 342 windows of 250 ms of a process launching
 *   kernels all along, while one made before the kinds were enabled is
 *   what CUPTI's own dynamic-detach sample finalizes from. That run could
 *   not tell this from a stricter CUPTI that calls no subscriber at all
 *   while every kind is off (the sample finalizes with its kinds on);
 *   $DEVTRACE_STANDIN_CUPTI_STRICT_SUBSCRIBERS=1 models that one too, and
 *   $DEVTRACE_STANDIN_CUPTI_DEAF_SUBSCRIBERS=1 the worst reading: no
 *   subscriber is ever called.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "standin_call.h"

#define CUPTIAPI __attribute__((visibility("default")))
#define PACKED_ALIGNMENT __attribute__((__packed__)) __attribute__((aligned(8)))

/* ---- cupti_result.h ------------------------------------------------------ */

typedef enum {
    CUPTI_SUCCESS = 0,
    CUPTI_ERROR_INVALID_PARAMETER = 1,
    CUPTI_ERROR_INVALID_DEVICE = 2,
    CUPTI_ERROR_INVALID_CONTEXT = 3,
    CUPTI_ERROR_INVALID_EVENT_DOMAIN_ID = 4,
    CUPTI_ERROR_INVALID_EVENT_ID = 5,
    CUPTI_ERROR_INVALID_EVENT_NAME = 6,
    CUPTI_ERROR_INVALID_OPERATION = 7,
    CUPTI_ERROR_OUT_OF_MEMORY = 8,
    CUPTI_ERROR_HARDWARE = 9,
    CUPTI_ERROR_PARAMETER_SIZE_NOT_SUFFICIENT = 10,
    CUPTI_ERROR_API_NOT_IMPLEMENTED = 11,
    CUPTI_ERROR_MAX_LIMIT_REACHED = 12,
    CUPTI_ERROR_NOT_READY = 13,
    CUPTI_ERROR_NOT_COMPATIBLE = 14,
    CUPTI_ERROR_NOT_INITIALIZED = 15,
    CUPTI_ERROR_INVALID_METRIC_ID = 16,
    CUPTI_ERROR_INVALID_METRIC_NAME = 17,
    CUPTI_ERROR_QUEUE_EMPTY = 18,
    CUPTI_ERROR_INVALID_HANDLE = 19,
    CUPTI_ERROR_INVALID_STREAM = 20,
    CUPTI_ERROR_INVALID_KIND = 21,
    CUPTI_ERROR_INVALID_EVENT_VALUE = 22,
    CUPTI_ERROR_DISABLED = 23,
    CUPTI_ERROR_INVALID_MODULE = 24,
    CUPTI_ERROR_INVALID_METRIC_VALUE = 25,
    CUPTI_ERROR_HARDWARE_BUSY = 26,
    CUPTI_ERROR_NOT_SUPPORTED = 27,
    CUPTI_ERROR_UM_PROFILING_NOT_SUPPORTED = 28,
    CUPTI_ERROR_UM_PROFILING_NOT_SUPPORTED_ON_DEVICE = 29,
    CUPTI_ERROR_UM_PROFILING_NOT_SUPPORTED_ON_NON_P2P_DEVICES = 30,
    CUPTI_ERROR_UM_PROFILING_NOT_SUPPORTED_WITH_MPS = 31,
    CUPTI_ERROR_CDP_TRACING_NOT_SUPPORTED = 32,
    CUPTI_ERROR_VIRTUALIZED_DEVICE_NOT_SUPPORTED = 33,
    CUPTI_ERROR_CUDA_COMPILER_NOT_COMPATIBLE = 34,
    CUPTI_ERROR_INSUFFICIENT_PRIVILEGES = 35,
    CUPTI_ERROR_OLD_PROFILER_API_INITIALIZED = 36,
    CUPTI_ERROR_OPENACC_UNDEFINED_ROUTINE = 37,
    CUPTI_ERROR_LEGACY_PROFILER_NOT_SUPPORTED = 38,
    CUPTI_ERROR_MULTIPLE_SUBSCRIBERS_NOT_SUPPORTED = 39,
    CUPTI_ERROR_VIRTUALIZED_DEVICE_INSUFFICIENT_PRIVILEGES = 40,
    CUPTI_ERROR_CONFIDENTIAL_COMPUTING_NOT_SUPPORTED = 41,
    CUPTI_ERROR_CMP_DEVICE_NOT_SUPPORTED = 42,
    CUPTI_ERROR_MIG_DEVICE_NOT_SUPPORTED = 43,
    CUPTI_ERROR_SLI_DEVICE_NOT_SUPPORTED = 44,
    CUPTI_ERROR_WSL_DEVICE_NOT_SUPPORTED = 45,
    CUPTI_ERROR_UNKNOWN = 999,
    CUPTI_ERROR_FORCE_INT = 0x7fffffff
} CUptiResult;

/* ---- cupti_activity.h (12.8; records up to 13.4) -------------------------- */

typedef enum {
    CUPTI_ACTIVITY_KIND_INVALID = 0,
    CUPTI_ACTIVITY_KIND_MEMCPY = 1,
    CUPTI_ACTIVITY_KIND_MEMSET = 2,
    CUPTI_ACTIVITY_KIND_KERNEL = 3,
    CUPTI_ACTIVITY_KIND_DRIVER = 4,
    CUPTI_ACTIVITY_KIND_RUNTIME = 5,
    CUPTI_ACTIVITY_KIND_DEVICE = 8,
    CUPTI_ACTIVITY_KIND_CONTEXT = 9,
    CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL = 10,
    CUPTI_ACTIVITY_KIND_MARKER = 12,
    CUPTI_ACTIVITY_KIND_OVERHEAD = 17,
    CUPTI_ACTIVITY_KIND_SYNCHRONIZATION = 38,
    CUPTI_ACTIVITY_KIND_MEMORY = 45,
    CUPTI_ACTIVITY_KIND_INTERNAL_LAUNCH_API = 48,
    CUPTI_ACTIVITY_KIND_MEMORY2 = 49,
    CUPTI_ACTIVITY_KIND_MEM_DECOMPRESS = 54,
    CUPTI_ACTIVITY_KIND_COUNT = 55,
    CUPTI_ACTIVITY_KIND_FORCE_INT = 0x7fffffff
} CUpti_ActivityKind;

typedef enum {
    CUPTI_ACTIVITY_FLAG_NONE = 0,
    CUPTI_ACTIVITY_FLAG_DEVICE_CONCURRENT_KERNELS = 1 << 0,
    CUPTI_ACTIVITY_FLAG_FLUSH_FORCED = 1 << 0,
    CUPTI_ACTIVITY_FLAG_MEMCPY_ASYNC = 1 << 0,
    CUPTI_ACTIVITY_FLAG_MEMSET_ASYNC = 1 << 0,
    CUPTI_ACTIVITY_FLAG_FORCE_INT = 0x7fffffff
} CUpti_ActivityFlag;

typedef enum {
    CUPTI_ACTIVITY_MEMCPY_KIND_UNKNOWN = 0,
    CUPTI_ACTIVITY_MEMCPY_KIND_HTOD = 1,
    CUPTI_ACTIVITY_MEMCPY_KIND_DTOH = 2,
    CUPTI_ACTIVITY_MEMCPY_KIND_DTOD = 8,
    CUPTI_ACTIVITY_MEMCPY_KIND_HTOH = 9,
    CUPTI_ACTIVITY_MEMCPY_KIND_FORCE_INT = 0x7fffffff
} CUpti_ActivityMemcpyKind;

typedef enum {
    CUPTI_ACTIVITY_MEMORY_KIND_UNKNOWN = 0,
    CUPTI_ACTIVITY_MEMORY_KIND_PAGEABLE = 1,
    CUPTI_ACTIVITY_MEMORY_KIND_PINNED = 2,
    CUPTI_ACTIVITY_MEMORY_KIND_DEVICE = 3,
    CUPTI_ACTIVITY_MEMORY_KIND_FORCE_INT = 0x7fffffff
} CUpti_ActivityMemoryKind;

typedef enum {
    CUPTI_ACTIVITY_MEMORY_OPERATION_TYPE_INVALID = 0,
    CUPTI_ACTIVITY_MEMORY_OPERATION_TYPE_ALLOCATION = 1,
    CUPTI_ACTIVITY_MEMORY_OPERATION_TYPE_RELEASE = 2,
    CUPTI_ACTIVITY_MEMORY_OPERATION_TYPE_FORCE_INT = 0x7fffffff
} CUpti_ActivityMemoryOperationType;

typedef enum {
    CUPTI_ACTIVITY_MEMORY_POOL_TYPE_INVALID = 0,
    CUPTI_ACTIVITY_MEMORY_POOL_TYPE_FORCE_INT = 0x7fffffff
} CUpti_ActivityMemoryPoolType;

typedef enum {
    CUPTI_ACTIVITY_PARTITIONED_GLOBAL_CACHE_CONFIG_UNKNOWN = 0,
    CUPTI_ACTIVITY_PARTITIONED_GLOBAL_CACHE_CONFIG_NOT_SUPPORTED = 1,
    CUPTI_ACTIVITY_PARTITIONED_GLOBAL_CACHE_CONFIG_FORCE_INT = 0x7fffffff
} CUpti_ActivityPartitionedGlobalCacheConfig;

typedef enum {
    CUPTI_FUNC_SHMEM_LIMIT_DEFAULT = 0,
    CUPTI_FUNC_SHMEM_LIMIT_FORCE_INT = 0x7fffffff
} CUpti_FuncShmemLimitConfig;

typedef enum {
    CUPTI_CHANNEL_TYPE_INVALID = 0,
    CUPTI_CHANNEL_TYPE_COMPUTE = 1,
    CUPTI_CHANNEL_TYPE_ASYNC_MEMCPY = 2,
    CUPTI_CHANNEL_TYPE_FORCE_INT = 0x7fffffff
} CUpti_ChannelType;

typedef enum {
    CUPTI_ACTIVITY_OVERHEAD_ACTIVITY_BUFFER_REQUEST = 7 << 16,
    CUPTI_ACTIVITY_OVERHEAD_FORCE_INT = 0x7fffffff
} CUpti_ActivityOverheadKind;

typedef enum {
    CUPTI_ACTIVITY_OBJECT_UNKNOWN = 0,
    CUPTI_ACTIVITY_OBJECT_PROCESS = 1,
    CUPTI_ACTIVITY_OBJECT_THREAD = 2,
    CUPTI_ACTIVITY_OBJECT_FORCE_INT = 0x7fffffff
} CUpti_ActivityObjectKind;

typedef enum {
    CUPTI_ACTIVITY_SYNCHRONIZATION_TYPE_UNKNOWN = 0,
    CUPTI_ACTIVITY_SYNCHRONIZATION_TYPE_FORCE_INT = 0x7fffffff
} CUpti_ActivitySynchronizationType;

typedef enum {
    CUPTI_ACTIVITY_COMPUTE_API_CUDA = 1,
} CUpti_ActivityComputeApiKind;

typedef enum {
    CUPTI_CONTEXT_CIG_MODE_NONE = 0,
    CUPTI_CONTEXT_CIG_MODE_FORCE_INT = 0x7fffffff
} CUpti_ContextCigMode;

typedef enum {
    CUPTI_ACTIVITY_THREAD_ID_TYPE_DEFAULT = 0,
    CUPTI_ACTIVITY_THREAD_ID_TYPE_SYSTEM = 1,
    CUPTI_ACTIVITY_THREAD_ID_TYPE_SIZE = 2,
    CUPTI_ACTIVITY_THREAD_ID_TYPE_FORCE_INT = 0x7fffffff
} CUpti_ActivityThreadIdType;

#define CUPTI_API_VERSION 26
#define CUPTI_INVALID_CONTEXT_ID ((uint32_t)0xFFFFFFFFU)
#define CUPTI_INVALID_STREAM_ID ((uint32_t)0xFFFFFFFFU)
#define CUPTI_SYNCHRONIZATION_INVALID_VALUE ((uint32_t)0xFFFFFFFFU)

typedef uint32_t CUpti_CallbackId;
typedef struct CUctx_st *CUcontext;
typedef struct { char bytes[16]; } CUuuid;

typedef struct PACKED_ALIGNMENT {
    CUpti_ActivityKind kind;
} CUpti_Activity;

typedef struct PACKED_ALIGNMENT {
    CUpti_ActivityKind kind;
    CUpti_CallbackId cbid;
    uint64_t start;
    uint64_t end;
    uint32_t processId;
    uint32_t threadId;
    uint32_t correlationId;
    uint32_t returnValue;
} CUpti_ActivityAPI;

typedef union {
    uint8_t both;
    struct {
        uint8_t requested : 4;
        uint8_t executed : 4;
    } config;
} CUpti_KernelCacheConfig;

typedef struct PACKED_ALIGNMENT {
    CUpti_ActivityKind kind;
    CUpti_KernelCacheConfig cacheConfig;
    uint8_t sharedMemoryConfig;
    uint16_t registersPerThread;
    CUpti_ActivityPartitionedGlobalCacheConfig partitionedGlobalCacheRequested;
    CUpti_ActivityPartitionedGlobalCacheConfig partitionedGlobalCacheExecuted;
    uint64_t start;
    uint64_t end;
    uint64_t completed;
    uint32_t deviceId;
    uint32_t contextId;
    uint32_t streamId;
    int32_t gridX;
    int32_t gridY;
    int32_t gridZ;
    int32_t blockX;
    int32_t blockY;
    int32_t blockZ;
    int32_t staticSharedMemory;
    int32_t dynamicSharedMemory;
    uint32_t localMemoryPerThread;
    uint32_t localMemoryTotal;
    uint32_t correlationId;
    int64_t gridId;
    const char *name;
    void *reserved0;
    uint64_t queued;
    uint64_t submitted;
    uint8_t launchType;
    uint8_t isSharedMemoryCarveoutRequested;
    uint8_t sharedMemoryCarveoutRequested;
    uint8_t padding;
    uint32_t sharedMemoryExecuted;
    uint64_t graphNodeId;
    CUpti_FuncShmemLimitConfig shmemLimitConfig;
    uint32_t graphId;
    void *pAccessPolicyWindow; /* CUaccessPolicyWindow * */
    uint32_t channelID;
    CUpti_ChannelType channelType;
    uint32_t clusterX;
    uint32_t clusterY;
    uint32_t clusterZ;
    uint32_t clusterSchedulingPolicy;
    uint64_t localMemoryTotal_v2;
    uint32_t maxPotentialClusterSize;
    uint32_t maxActiveClusters;      /* CUpti_ActivityKernel9 (12.x) ends here: 208 */
    uint8_t isDeviceLaunched;
    uint8_t padding3[7];             /* Kernel10 (13.0): 216 */
    int32_t priority;
    uint32_t padding4;               /* Kernel11 (13.1): 224 */
    uint32_t executionModel;         /* CUpti_FuncExecutionModel */
    uint32_t padding5;               /* Kernel12 (13.3): 232 */
    uint32_t sourceGraphId;
    uint32_t padding6;
    uint64_t sourceGraphNodeId;      /* Kernel13 (13.4): 248 */
} CUpti_ActivityKernel13;

typedef struct PACKED_ALIGNMENT {
    CUpti_ActivityKind kind;
    uint8_t copyKind;
    uint8_t srcKind;
    uint8_t dstKind;
    uint8_t flags;
    uint64_t bytes;
    uint64_t start;
    uint64_t end;
    uint32_t deviceId;
    uint32_t contextId;
    uint32_t streamId;
    uint32_t correlationId;
    uint32_t runtimeCorrelationId;
    uint32_t pad;
    void *reserved0;
    uint64_t graphNodeId;
    uint32_t graphId;
    uint32_t channelID;
    CUpti_ChannelType channelType;
    uint8_t isDeviceLaunched;        /* padding before 13.0 */
    uint8_t pad2[3];
    uint64_t copyCount;              /* CUpti_ActivityMemcpy6 ends here: 96 */
    uint32_t sourceGraphId;
    uint32_t pad3;
    uint64_t sourceGraphNodeId;      /* Memcpy7 (13.4): 112 */
} CUpti_ActivityMemcpy7;

typedef struct PACKED_ALIGNMENT {
    CUpti_ActivityKind kind;
    uint32_t value;
    uint64_t bytes;
    uint64_t start;
    uint64_t end;
    uint32_t deviceId;
    uint32_t contextId;
    uint32_t streamId;
    uint32_t correlationId;
    uint16_t flags;
    uint16_t memoryKind;
    uint32_t pad;
    void *reserved0;
    uint64_t graphNodeId;
    uint32_t graphId;
    uint32_t channelID;
    CUpti_ChannelType channelType;
    uint8_t isDeviceLaunched;        /* padding before 13.0 */
    uint8_t pad2[3];                 /* CUpti_ActivityMemset4 ends here: 88 */
    uint32_t sourceGraphId;
    uint32_t pad3;
    uint64_t sourceGraphNodeId;      /* Memset5 (13.4): 104 */
} CUpti_ActivityMemset5;

typedef struct PACKED_ALIGNMENT {
    CUpti_ActivityKind kind;
    CUpti_ActivityMemoryOperationType memoryOperationType;
    CUpti_ActivityMemoryKind memoryKind;
    uint32_t correlationId;
    uint64_t address;
    uint64_t bytes;
    uint64_t timestamp;
    uint64_t PC;
    uint32_t processId;
    uint32_t deviceId;
    uint32_t contextId;
    uint32_t streamId;
    const char *name;
    uint32_t isAsync;
    uint32_t pad1;
    struct PACKED_ALIGNMENT {
        CUpti_ActivityMemoryPoolType memoryPoolType;
        uint32_t pad2;
        uint64_t address;
        uint64_t releaseThreshold;
        union {
            uint64_t size;
            uint64_t processId;
        } pool;
        uint64_t utilizedSize;
    } memoryPoolConfig;
    const char *source;
} CUpti_ActivityMemory4;

typedef struct PACKED_ALIGNMENT {
    CUpti_ActivityKind kind;
    CUpti_ActivityFlag flags;
    uint64_t globalMemoryBandwidth;
    uint64_t globalMemorySize;
    uint32_t constantMemorySize;
    uint32_t l2CacheSize;
    uint32_t numThreadsPerWarp;
    uint32_t coreClockRate;
    uint32_t numMemcpyEngines;
    uint32_t numMultiprocessors;
    uint32_t maxIPC;
    uint32_t maxWarpsPerMultiprocessor;
    uint32_t maxBlocksPerMultiprocessor;
    uint32_t maxSharedMemoryPerMultiprocessor;
    uint32_t maxRegistersPerMultiprocessor;
    uint32_t maxRegistersPerBlock;
    uint32_t maxSharedMemoryPerBlock;
    uint32_t maxThreadsPerBlock;
    uint32_t maxBlockDimX;
    uint32_t maxBlockDimY;
    uint32_t maxBlockDimZ;
    uint32_t maxGridDimX;
    uint32_t maxGridDimY;
    uint32_t maxGridDimZ;
    uint32_t computeCapabilityMajor;
    uint32_t computeCapabilityMinor;
    uint32_t id;
    uint32_t eccEnabled;
    CUuuid uuid;
    const char *name;
    uint8_t isCudaVisible;
    uint8_t isMigEnabled;
    uint8_t reserved[6];
    uint32_t gpuInstanceId;
    uint32_t computeInstanceId;
    CUuuid migUuid;
    uint32_t isNumaNode;
    uint32_t numaId;                 /* CUpti_ActivityDevice5 ends here: 184 */
    uint32_t numTpcs;
    uint32_t reserved0;              /* Device6 (13.2): 192 */
} CUpti_ActivityDevice6;

typedef struct __attribute__((aligned(8))) {
    CUpti_ActivityKind kind;
    uint32_t contextId;
    uint32_t deviceId;
    uint16_t computeApiKind;
    uint16_t nullStreamId;
    uint32_t parentContextId;
    uint8_t isGreenContext;
    uint8_t padding;
    uint16_t numMultiprocessors;
    CUpti_ContextCigMode cigMode;
    uint32_t padding2;
} CUpti_ActivityContext3;

typedef union {
    struct { uint32_t processId; uint32_t threadId; } pt;
    struct { uint32_t deviceId; uint32_t contextId; uint32_t streamId; } dcs;
} CUpti_ActivityObjectKindId;

typedef struct PACKED_ALIGNMENT {
    CUpti_ActivityKind kind;
    CUpti_ActivityOverheadKind overheadKind;
    CUpti_ActivityObjectKind objectKind;
    CUpti_ActivityObjectKindId objectId;
    uint64_t start;
    uint64_t end;
    uint32_t correlationId;
    uint32_t reserved0;
    void *overheadData;
} CUpti_ActivityOverhead3;

typedef struct PACKED_ALIGNMENT {
    CUpti_ActivityKind kind;
    CUpti_ActivitySynchronizationType type;
    uint64_t start;
    uint64_t end;
    uint32_t correlationId;
    uint32_t contextId;
    uint32_t streamId;
    uint32_t cudaEventId;
    uint64_t cudaEventSyncId;
    uint32_t returnValue;
    uint32_t pad;
} CUpti_ActivitySynchronization2;

typedef void (*CUpti_BuffersCallbackRequestFunc)(uint8_t **buffer, size_t *size, size_t *maxNumRecords);
typedef void (*CUpti_BuffersCallbackCompleteFunc)(CUcontext context, uint32_t streamId, uint8_t *buffer,
                                                  size_t size, size_t validSize);
typedef struct CUpti_Subscriber_st *CUpti_SubscriberHandle;
typedef uint64_t (*CUpti_TimestampCallbackFunc)(void);
typedef void (*CUpti_CallbackFunc)(void *userdata, int domain, CUpti_CallbackId cbid, const void *cbdata);
/* CUDA 13.0's cupti_callbacks.h. */
typedef struct {
    size_t structSize;
    const char *subscriberName;
    char *oldSubscriberName;
    size_t oldSubscriberSize;
} CUpti_SubscriberParams;

/* cupti_callbacks.h: what a driver or runtime API callback is passed. */
typedef enum { CUPTI_API_ENTER = 0, CUPTI_API_EXIT = 1 } CUpti_ApiCallbackSite;
typedef enum {
    CUPTI_CB_DOMAIN_INVALID = 0,
    CUPTI_CB_DOMAIN_DRIVER_API = 1,
    CUPTI_CB_DOMAIN_RUNTIME_API = 2,
    CUPTI_CB_DOMAIN_SIZE = 7,
} CUpti_CallbackDomain;
typedef struct {
    CUpti_ApiCallbackSite callbackSite;
    const char *functionName;
    const void *functionParams;
    void *functionReturnValue;
    const char *symbolName;
    CUcontext context;
    uint32_t contextUid;
    uint64_t *correlationData;
    uint32_t correlationId;
} CUpti_CallbackData;
_Static_assert(offsetof(CUpti_CallbackData, callbackSite) == 0, "CUpti_CallbackData layout");
_Static_assert(offsetof(CUpti_CallbackData, functionName) == 8, "CUpti_CallbackData layout");
_Static_assert(offsetof(CUpti_CallbackData, correlationId) == 64, "CUpti_CallbackData layout");

/* Offsets and sizes as cudarc 0.19 (`cuda-12080`) lays these records out,
 * and, for the fields CUPTI 13 added, as the 13.0.85, 13.1.115, 13.4.92 and
 * 13.5.25 cupti_activity.h headers do. */
#define AT(type, field, offset) _Static_assert(offsetof(type, field) == (offset), #type "." #field)
#define SIZE(type, size) _Static_assert(sizeof(type) == (size), "sizeof " #type)
SIZE(CUpti_Activity, 8);
SIZE(CUpti_ActivityAPI, 40);
AT(CUpti_ActivityAPI, start, 8); AT(CUpti_ActivityAPI, processId, 24);
AT(CUpti_ActivityAPI, correlationId, 32); AT(CUpti_ActivityAPI, returnValue, 36);
SIZE(CUpti_ActivityKernel13, 248);
AT(CUpti_ActivityKernel13, registersPerThread, 6); AT(CUpti_ActivityKernel13, start, 16);
AT(CUpti_ActivityKernel13, deviceId, 40); AT(CUpti_ActivityKernel13, streamId, 48);
AT(CUpti_ActivityKernel13, gridX, 52); AT(CUpti_ActivityKernel13, blockX, 64);
AT(CUpti_ActivityKernel13, staticSharedMemory, 76); AT(CUpti_ActivityKernel13, dynamicSharedMemory, 80);
AT(CUpti_ActivityKernel13, correlationId, 92); AT(CUpti_ActivityKernel13, gridId, 96);
AT(CUpti_ActivityKernel13, name, 104); AT(CUpti_ActivityKernel13, queued, 120);
AT(CUpti_ActivityKernel13, launchType, 136); AT(CUpti_ActivityKernel13, sharedMemoryExecuted, 140);
AT(CUpti_ActivityKernel13, graphNodeId, 144); AT(CUpti_ActivityKernel13, shmemLimitConfig, 152);
AT(CUpti_ActivityKernel13, pAccessPolicyWindow, 160); AT(CUpti_ActivityKernel13, channelType, 172);
AT(CUpti_ActivityKernel13, clusterX, 176); AT(CUpti_ActivityKernel13, localMemoryTotal_v2, 192);
AT(CUpti_ActivityKernel13, maxActiveClusters, 204); AT(CUpti_ActivityKernel13, graphId, 156);
AT(CUpti_ActivityKernel13, isDeviceLaunched, 208); AT(CUpti_ActivityKernel13, priority, 216);
AT(CUpti_ActivityKernel13, executionModel, 224); AT(CUpti_ActivityKernel13, sourceGraphId, 232);
AT(CUpti_ActivityKernel13, sourceGraphNodeId, 240);
SIZE(CUpti_ActivityMemcpy7, 112);
AT(CUpti_ActivityMemcpy7, copyKind, 4); AT(CUpti_ActivityMemcpy7, flags, 7);
AT(CUpti_ActivityMemcpy7, bytes, 8); AT(CUpti_ActivityMemcpy7, start, 16);
AT(CUpti_ActivityMemcpy7, deviceId, 32); AT(CUpti_ActivityMemcpy7, correlationId, 44);
AT(CUpti_ActivityMemcpy7, reserved0, 56); AT(CUpti_ActivityMemcpy7, channelType, 80);
AT(CUpti_ActivityMemcpy7, copyCount, 88); AT(CUpti_ActivityMemcpy7, graphNodeId, 64);
AT(CUpti_ActivityMemcpy7, graphId, 72); AT(CUpti_ActivityMemcpy7, isDeviceLaunched, 84);
AT(CUpti_ActivityMemcpy7, sourceGraphId, 96); AT(CUpti_ActivityMemcpy7, sourceGraphNodeId, 104);
SIZE(CUpti_ActivityMemset5, 104);
AT(CUpti_ActivityMemset5, value, 4); AT(CUpti_ActivityMemset5, bytes, 8);
AT(CUpti_ActivityMemset5, correlationId, 44); AT(CUpti_ActivityMemset5, flags, 48);
AT(CUpti_ActivityMemset5, memoryKind, 50); AT(CUpti_ActivityMemset5, channelType, 80);
AT(CUpti_ActivityMemset5, graphNodeId, 64); AT(CUpti_ActivityMemset5, graphId, 72);
AT(CUpti_ActivityMemset5, isDeviceLaunched, 84); AT(CUpti_ActivityMemset5, sourceGraphId, 88);
AT(CUpti_ActivityMemset5, sourceGraphNodeId, 96);
SIZE(CUpti_ActivityMemory4, 128);
AT(CUpti_ActivityMemory4, correlationId, 12); AT(CUpti_ActivityMemory4, address, 16);
AT(CUpti_ActivityMemory4, timestamp, 32); AT(CUpti_ActivityMemory4, processId, 48);
AT(CUpti_ActivityMemory4, streamId, 60); AT(CUpti_ActivityMemory4, name, 64);
AT(CUpti_ActivityMemory4, isAsync, 72); AT(CUpti_ActivityMemory4, memoryPoolConfig, 80);
AT(CUpti_ActivityMemory4, memoryPoolConfig.utilizedSize, 112); AT(CUpti_ActivityMemory4, source, 120);
SIZE(CUpti_ActivityDevice6, 192);
AT(CUpti_ActivityDevice6, globalMemoryBandwidth, 8); AT(CUpti_ActivityDevice6, coreClockRate, 36);
AT(CUpti_ActivityDevice6, numMultiprocessors, 44); AT(CUpti_ActivityDevice6, computeCapabilityMajor, 104);
AT(CUpti_ActivityDevice6, id, 112); AT(CUpti_ActivityDevice6, uuid, 120);
AT(CUpti_ActivityDevice6, name, 136); AT(CUpti_ActivityDevice6, isCudaVisible, 144);
AT(CUpti_ActivityDevice6, gpuInstanceId, 152); AT(CUpti_ActivityDevice6, migUuid, 160);
AT(CUpti_ActivityDevice6, numaId, 180); AT(CUpti_ActivityDevice6, numTpcs, 184);
SIZE(CUpti_ActivityContext3, 32);
AT(CUpti_ActivityContext3, computeApiKind, 12); AT(CUpti_ActivityContext3, nullStreamId, 14);
AT(CUpti_ActivityContext3, isGreenContext, 20); AT(CUpti_ActivityContext3, numMultiprocessors, 22);
AT(CUpti_ActivityContext3, cigMode, 24);
SIZE(CUpti_ActivityOverhead3, 56);
AT(CUpti_ActivityOverhead3, objectId, 12); AT(CUpti_ActivityOverhead3, start, 24);
AT(CUpti_ActivityOverhead3, correlationId, 40); AT(CUpti_ActivityOverhead3, overheadData, 48);
SIZE(CUpti_ActivitySynchronization2, 56);
AT(CUpti_ActivitySynchronization2, start, 8); AT(CUpti_ActivitySynchronization2, correlationId, 24);
AT(CUpti_ActivitySynchronization2, cudaEventId, 36); AT(CUpti_ActivitySynchronization2, cudaEventSyncId, 40);
AT(CUpti_ActivitySynchronization2, returnValue, 48);

/* ---- state ----------------------------------------------------------------- */

struct completed {
    uint8_t *buffer;
    size_t size, valid;
    uint64_t due_ns; /* late buffers (on the late list): when the worker delivers it */
    struct completed *next;
};

struct stream_tail { uint32_t stream_id; uint64_t tail; };

static pthread_mutex_t lock;
static pthread_cond_t work_ready = PTHREAD_COND_INITIALIZER; /* worker has something to do */
static pthread_cond_t work_done = PTHREAD_COND_INITIALIZER;  /* a delivery finished */
static pthread_once_t setup_once = PTHREAD_ONCE_INIT;

static uint8_t enabled[CUPTI_ACTIVITY_KIND_COUNT];
/* Which driver and runtime callback ids get a DRIVER (RUNTIME) record. */
#define MAX_CALLBACK_IDS 1024
static uint8_t driver_calls[MAX_CALLBACK_IDS];
static uint8_t runtime_calls[MAX_CALLBACK_IDS];
static uint32_t driver_cbid_size = 782, runtime_cbid_size = 487;
static CUpti_BuffersCallbackRequestFunc request_cb;
static CUpti_BuffersCallbackCompleteFunc complete_cb;

/* A buffer being filled: the one of the process (API < 130000) or of one
 * thread (>= 130000). */
struct filling {
    uint32_t tid;      /* gettid() of its thread (>= 130000); 0: slot unused */
    int requesting;    /* threads of this slot inside bufferRequested */
    uint8_t *buffer;   /* or NULL */
    size_t size, used, max_records, records;
    uint64_t busy_until; /* latest end of device work in it */
    /* Its device records (kernels, copies, memsets), for a forced flush to
     * leave those whose work has not ended without their times. */
    struct device_record *device;
    size_t ndevice, device_cap;
};

/* Where a device record's times lie in a buffer, and the work's [start, end)
 * on the GPU's clock. */
struct device_record {
    uint64_t *start, *end, *completed; /* completed: kernels only, else NULL */
    uint64_t gpu_start, gpu_end;
};

/* API < 130000: fillings[0] is the one buffer. >= 130000: one slot per
 * thread, taken on its first record and reused for another thread once its
 * buffer was handed back; threads past THREAD_SLOTS share the last slot. */
#define THREAD_SLOTS 256
static struct filling fillings[THREAD_SLOTS + 1];
static int per_thread_buffers;     /* api_version >= 130000 */
static struct filling *last_filled; /* where reserve() put the latest record */

static struct completed *queue_head, *queue_tail;
/* Buffers a forced flush handed back for threads other than the flushing
 * one (>= 130000): delivered after $DEVTRACE_STANDIN_CUPTI_LATE_MS, or by
 * cuptiFinalize, whichever comes first. */
static struct completed *late_head, *late_tail;
static long long late_ms = 1500;
static int delivering;       /* buffers taken off the queue, not yet delivered */
static int worker_started;
static pthread_t worker;
static uint32_t flush_period_ms;

static size_t dropped;
/* The GPU-clock interval device_interval gave last. */
static uint64_t last_gpu_start, last_gpu_end;
static long long pending_env_drops;
static uint32_t next_correlation = 1;
static int64_t next_grid_id = 1;
static uint64_t next_event_sync_id = 1;
static CUpti_ActivityThreadIdType thread_id_type = CUPTI_ACTIVITY_THREAD_ID_TYPE_DEFAULT;
static struct stream_tail tails[64];
static uint32_t contexts[64];
static uint32_t context_devices[64];
static uint8_t context_reported[64];
static size_t ncontexts;
static int subscribed;
static struct CUpti_Subscriber_st { int unused; } the_subscriber;
static CUpti_CallbackFunc subscriber_callback;
static void *subscriber_userdata;
static uint8_t subscriber_domains[CUPTI_CB_DOMAIN_SIZE];
/* The subscriber was made after a capture switched every kind off: CUPTI
 * never calls it (see the top of this file). */
static int subscriber_deaf;
/* $DEVTRACE_STANDIN_CUPTI_STRICT_SUBSCRIBERS=1: the stricter reading, no
 * subscriber is called while CUPTI is armed with every kind off. */
static int strict_subscribers;
/* $DEVTRACE_STANDIN_CUPTI_DEAF_SUBSCRIBERS=1: no subscriber is ever called. */
static int deaf_subscribers;
/* $DEVTRACE_STANDIN_CUPTI_IGNORE_SELECTION=1: the per-call enables succeed
 * and select nothing (see the top of this file). */
static int ignore_selection;
/* $DEVTRACE_STANDIN_CUPTI_RUNTIME_LAUNCHES=1: launches come inside a
 * cudaLaunchKernel runtime call (see the top of this file). */
static int runtime_launches;
#define RUNTIME_CBID_cudaLaunchKernel 211u

/* Armed: some activity kind was enabled since load or the last
 * cuptiFinalize. Every driver call then pays armed_ns, enabled kinds or not,
 * as real CUPTI keeps its driver hooks until it is finalized. The first
 * enable while disarmed takes first_enable_ms; every enable of a kind that
 * was off returns enable_ms after the kind is on (the caller is still inside
 * it while records of that kind are written). Each DRIVER record written
 * costs its call api_record_ns more, and each call of the subscriber's
 * callback callback_ns (see the top of this file). */
static int armed;
static long long armed_ns = 1000, first_enable_ms = 100, enable_ms;
static long long api_record_ns = 1900, callback_ns = 100;
static unsigned long finalizes;

static long long clock_offset_ns;
static uint64_t kernel_ns = 5000, memcpy_ns = 2000, memset_ns = 1000;
static char fail_spec[1024];
static int driver_attached;
static devtrace_standin_physical_fn physical_of; /* libcuda's, once attached */

/* The emulated release ($DEVTRACE_STANDIN_CUPTI_VERSION) and the sizes of
 * the records it writes; every later version only appends fields. */
static uint32_t api_version = CUPTI_API_VERSION;
static size_t kernel_bytes = 208, memcpy_bytes = 96, memset_bytes = 88, device_bytes = 184;

/* ---- configuration ------------------------------------------------------------ */

static long long env_or(const char *name, long long fallback) {
    const char *value = getenv(name);
    return value && *value ? atoll(value) : fallback;
}

static void setup(void) {
    pthread_mutexattr_t attr;
    pthread_mutexattr_init(&attr);
    pthread_mutexattr_settype(&attr, PTHREAD_MUTEX_RECURSIVE);
    pthread_mutex_init(&lock, &attr);
    pthread_mutexattr_destroy(&attr);
    clock_offset_ns = env_or("DEVTRACE_STANDIN_GPU_CLOCK_OFFSET_NS", 0);
    kernel_ns = (uint64_t)env_or("DEVTRACE_STANDIN_GPU_KERNEL_NS", 5000);
    memcpy_ns = (uint64_t)env_or("DEVTRACE_STANDIN_GPU_MEMCPY_NS", 2000);
    memset_ns = (uint64_t)env_or("DEVTRACE_STANDIN_GPU_MEMSET_NS", 1000);
    pending_env_drops = env_or("DEVTRACE_STANDIN_CUPTI_DROP", 0);
    api_version = (uint32_t)env_or("DEVTRACE_STANDIN_CUPTI_VERSION", CUPTI_API_VERSION);
    per_thread_buffers = api_version >= 130000;
    driver_cbid_size = api_version >= 130000 ? 877 : 782;
    runtime_cbid_size = api_version >= 130000 ? 567 : 487;
    kernel_bytes = api_version >= 130400   ? sizeof(CUpti_ActivityKernel13)                     /* 248 */
                   : api_version >= 130300 ? offsetof(CUpti_ActivityKernel13, sourceGraphId)    /* 232 */
                   : api_version >= 130100 ? offsetof(CUpti_ActivityKernel13, executionModel)   /* 224 */
                   : api_version >= 130000 ? offsetof(CUpti_ActivityKernel13, priority)         /* 216 */
                                           : offsetof(CUpti_ActivityKernel13, isDeviceLaunched); /* 208 */
    memcpy_bytes = api_version >= 130400 ? sizeof(CUpti_ActivityMemcpy7)                      /* 112 */
                                         : offsetof(CUpti_ActivityMemcpy7, sourceGraphId);    /* 96 */
    memset_bytes = api_version >= 130400 ? sizeof(CUpti_ActivityMemset5)                      /* 104 */
                                         : offsetof(CUpti_ActivityMemset5, sourceGraphId);    /* 88 */
    device_bytes = api_version >= 130200 ? sizeof(CUpti_ActivityDevice6)                      /* 192 */
                                         : offsetof(CUpti_ActivityDevice6, numTpcs);          /* 184 */
    const char *fail = getenv("DEVTRACE_STANDIN_CUPTI_FAIL");
    if (fail) snprintf(fail_spec, sizeof fail_spec, "%s", fail);
    armed_ns = env_or("DEVTRACE_STANDIN_CUPTI_ARMED_NS", 1000);
    api_record_ns = env_or("DEVTRACE_STANDIN_CUPTI_API_RECORD_NS", 1900);
    callback_ns = env_or("DEVTRACE_STANDIN_CUPTI_CALLBACK_NS", 100);
    first_enable_ms = env_or("DEVTRACE_STANDIN_CUPTI_FIRST_ENABLE_MS", 100);
    enable_ms = env_or("DEVTRACE_STANDIN_CUPTI_ENABLE_MS", 0);
    strict_subscribers = env_or("DEVTRACE_STANDIN_CUPTI_STRICT_SUBSCRIBERS", 0) != 0;
    deaf_subscribers = env_or("DEVTRACE_STANDIN_CUPTI_DEAF_SUBSCRIBERS", 0) != 0;
    ignore_selection = env_or("DEVTRACE_STANDIN_CUPTI_IGNORE_SELECTION", 0) != 0;
    runtime_launches = env_or("DEVTRACE_STANDIN_CUPTI_RUNTIME_LAUNCHES", 0) != 0;
    late_ms = env_or("DEVTRACE_STANDIN_CUPTI_LATE_MS", 1500);
}

/* The error configured for entry point `name`, or CUPTI_SUCCESS. */
static CUptiResult injected(const char *name) {
    size_t n = strlen(name);
    for (const char *p = fail_spec; *p;) {
        const char *end = strchr(p, ',');
        size_t length = end ? (size_t)(end - p) : strlen(p);
        if (length >= n && strncmp(p, name, n) == 0 && (length == n || p[n] == '='))
            return length == n ? CUPTI_ERROR_NOT_INITIALIZED : (CUptiResult)atoi(p + n + 1);
        if (!end) break;
        p = end + 1;
    }
    return CUPTI_SUCCESS;
}

static uint64_t gpu_time(uint64_t realtime_ns) {
    return (uint64_t)((long long)realtime_ns + clock_offset_ns);
}

static uint64_t gpu_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return gpu_time((uint64_t)ts.tv_sec * 1000000000ULL + (uint64_t)ts.tv_nsec);
}

/* The clock a user registered for records (cuptiActivityRegisterTimestampCallback),
 * with a reading of it and of CUPTI's clock taken together when it was
 * registered, and its ticks per CUPTI nanosecond measured then. */
static CUpti_TimestampCallbackFunc record_clock;
static uint64_t record_clock_anchor, record_clock_anchor_gpu;
static double record_clock_rate = 1.0;

/* CUPTI's time `t` as a record carries it: on the registered clock when one
 * is, found as CUPTI finds it, from that clock's reading now and how fast
 * it ran since it was registered. */
static uint64_t stamp(uint64_t t) {
    if (!record_clock) return t;
    uint64_t gpu = gpu_now();
    uint64_t ticks = record_clock();
    double rate = record_clock_rate;
    if (gpu > record_clock_anchor_gpu + 1000000 && ticks > record_clock_anchor)
        rate = (double)(ticks - record_clock_anchor) / (double)(gpu - record_clock_anchor_gpu);
    double stamped = (double)ticks + ((double)t - (double)gpu) * rate;
    return stamped <= 0 ? 0 : (uint64_t)stamped;
}

/* ---- buffers ------------------------------------------------------------------ */

/* A forced flush hands back work that has not ended as real CUPTI does: its
 * record without an end (0), and without a start if it had not started
 * either; the record is never completed afterwards. Caller holds lock. */
static void leave_unfinished(struct filling *f, uint64_t now) {
    if (now >= f->busy_until) return;
    for (size_t i = 0; i < f->ndevice; i++) {
        struct device_record *d = &f->device[i];
        if (d->gpu_end <= now) continue;
        uint64_t zero = 0;
        memcpy(d->end, &zero, sizeof zero);
        if (d->completed) memcpy(d->completed, &zero, sizeof zero);
        if (d->gpu_start > now) memcpy(d->start, &zero, sizeof zero);
    }
}

/* Queues buffer `f` for delivery, now or (due_ns != 0) on the late list.
 * Caller holds lock. */
static void close_buffer_due(struct filling *f, uint64_t due_ns) {
    if (!f->buffer) return;
    struct completed *c = calloc(1, sizeof *c);
    if (!c) {
        fprintf(stderr, "standin cupti: out of memory, buffer lost\n");
    } else {
        c->buffer = f->buffer;
        c->size = f->size;
        c->valid = f->used;
        c->due_ns = due_ns;
        if (due_ns) {
            if (late_tail) late_tail->next = c; else late_head = c;
            late_tail = c;
        } else {
            if (queue_tail) queue_tail->next = c; else queue_head = c;
            queue_tail = c;
        }
        if (pending_env_drops > 0) {
            dropped += (size_t)pending_env_drops;
            pending_env_drops = 0;
        }
        pthread_cond_broadcast(&work_ready);
    }
    f->buffer = NULL;
    f->size = f->used = f->records = f->max_records = 0;
    f->busy_until = 0;
    f->ndevice = 0;
}

static void close_buffer(struct filling *f) {
    close_buffer_due(f, 0);
}

/* Moves late buffers due by `now` (all of them for UINT64_MAX) to the
 * delivery queue. Caller holds lock. */
static void release_late(uint64_t now) {
    struct completed **link = &late_head, *last = NULL;
    while (*link) {
        struct completed *c = *link;
        if (c->due_ns > now) {
            last = c;
            link = &c->next;
            continue;
        }
        *link = c->next;
        c->next = NULL;
        c->due_ns = 0;
        if (queue_tail) queue_tail->next = c; else queue_head = c;
        queue_tail = c;
    }
    late_tail = last;
}

static uint64_t monotonic_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ULL + (uint64_t)ts.tv_nsec;
}

/* The buffer records of thread `tid` go into. Caller holds lock. */
static struct filling *filling_of(uint32_t tid) {
    if (!per_thread_buffers) return &fillings[0];
    struct filling *vacant = NULL;
    for (size_t i = 0; i < THREAD_SLOTS; i++) {
        struct filling *f = &fillings[i];
        if (f->tid == tid) return f;
        if (!vacant && (f->tid == 0 || (!f->buffer && !f->requesting))) vacant = f;
    }
    if (!vacant) return &fillings[THREAD_SLOTS]; /* shared overflow slot */
    vacant->tid = tid;
    return vacant;
}

static void *raw_reserve(struct filling *f, size_t size) {
    uint8_t *p = f->buffer + f->used;
    f->used += (size + 7) & ~(size_t)7;
    f->records++;
    memset(p, 0, size);
    return p;
}

static uint32_t current_tid(const struct standin_call *call) {
    return thread_id_type == CUPTI_ACTIVITY_THREAD_ID_TYPE_SYSTEM ? call->tid : (uint32_t)call->pthread_id;
}

/* Room for one record of `size` bytes, or NULL if it is dropped, in the
 * buffer of the thread that made `call` (NULL: of the calling thread; the
 * hook runs on the thread of the driver call, so that is the same thread).
 * Caller holds lock once; it is released while the client's bufferRequested
 * runs, on the calling thread. Sets last_filled. */
static void *reserve(size_t size, const struct standin_call *call) {
    if (!request_cb) {
        dropped++;
        return NULL;
    }
    struct filling *f = filling_of(call ? call->tid : (uint32_t)syscall(SYS_gettid));
    if (f->buffer && (f->used + size > f->size || (f->max_records && f->records >= f->max_records)))
        close_buffer(f);
    if (!f->buffer) {
        /* The client's callback runs without the lock, so it may take its own
         * locks, which another of its threads may hold while calling in here. */
        CUpti_BuffersCallbackRequestFunc request = request_cb;
        uint8_t *fresh = NULL;
        size_t fresh_size = 0, max_records = 0;
        uint64_t asked = gpu_now();
        f->requesting++; /* keeps the slot this thread's meanwhile */
        pthread_mutex_unlock(&lock);
        request(&fresh, &fresh_size, &max_records);
        pthread_mutex_lock(&lock);
        f->requesting--;
        uint64_t answered = gpu_now();
        if (!fresh || fresh_size == 0) {
            dropped++;
            return NULL;
        }
        /* Another thread sharing the slot (the one buffer, the overflow slot),
         * or this one from inside its bufferRequested, installed one meanwhile. */
        if (f->buffer) close_buffer(f);
        f->buffer = fresh;
        f->size = fresh_size;
        f->max_records = max_records;
        if ((uintptr_t)fresh % 8 != 0) {
            static int warned;
            if (!warned++)
                fprintf(stderr, "standin cupti: activity buffer %p is not 8-byte aligned, handed back unused\n",
                        (void *)fresh);
            close_buffer(f);
            dropped++;
            return NULL;
        }
        if (enabled[CUPTI_ACTIVITY_KIND_OVERHEAD] &&
            sizeof(CUpti_ActivityOverhead3) + size <= f->size &&
            (f->max_records == 0 || f->max_records > 1)) {
            CUpti_ActivityOverhead3 *o = raw_reserve(f, sizeof *o);
            o->kind = CUPTI_ACTIVITY_KIND_OVERHEAD;
            o->overheadKind = CUPTI_ACTIVITY_OVERHEAD_ACTIVITY_BUFFER_REQUEST;
            o->objectKind = CUPTI_ACTIVITY_OBJECT_THREAD;
            o->objectId.pt.processId = call ? call->pid : 0;
            o->objectId.pt.threadId = call ? current_tid(call) : 0;
            o->start = stamp(asked);
            o->end = stamp(answered);
        }
    }
    if (f->used + size > f->size) {
        close_buffer(f); /* too small even when empty */
        dropped++;
        return NULL;
    }
    last_filled = f;
    return raw_reserve(f, size);
}

/* ---- the worker thread ---------------------------------------------------------- */

static int on_worker(void) {
    return worker_started && pthread_equal(pthread_self(), worker);
}

/* Delivers one queued buffer. Caller holds lock (once); it is released around the callback. */
static int deliver_one(void) {
    struct completed *c = queue_head;
    if (!c) return 0;
    queue_head = c->next;
    if (!queue_head) queue_tail = NULL;
    /* The pair registered now, not the one that supplied the buffer. */
    CUpti_BuffersCallbackCompleteFunc cb = complete_cb;
    delivering++;
    pthread_mutex_unlock(&lock);
    if (cb) cb(NULL, 0, c->buffer, c->size, c->valid);
    pthread_mutex_lock(&lock);
    delivering--;
    free(c);
    pthread_cond_broadcast(&work_done);
    return 1;
}

static void flush_locked(int forced);

static void *worker_main(void *unused) {
    (void)unused;
    pthread_mutex_lock(&lock);
    for (;;) {
        release_late(monotonic_ns());
        if (!queue_head && late_head) {
            uint64_t wait_ns = late_head->due_ns;
            for (struct completed *c = late_head; c; c = c->next)
                if (c->due_ns < wait_ns) wait_ns = c->due_ns;
            uint64_t now = monotonic_ns();
            wait_ns = wait_ns > now ? wait_ns - now : 0;
            struct timespec until;
            clock_gettime(CLOCK_REALTIME, &until);
            until.tv_sec += (time_t)(wait_ns / 1000000000ULL);
            until.tv_nsec += (long)(wait_ns % 1000000000ULL);
            if (until.tv_nsec >= 1000000000L) {
                until.tv_sec++;
                until.tv_nsec -= 1000000000L;
            }
            pthread_cond_timedwait(&work_ready, &lock, &until);
            continue;
        }
        if (!queue_head) {
            if (flush_period_ms) {
                struct timespec until;
                clock_gettime(CLOCK_REALTIME, &until);
                until.tv_sec += flush_period_ms / 1000;
                until.tv_nsec += (long)(flush_period_ms % 1000) * 1000000L;
                if (until.tv_nsec >= 1000000000L) {
                    until.tv_sec++;
                    until.tv_nsec -= 1000000000L;
                }
                if (pthread_cond_timedwait(&work_ready, &lock, &until) == ETIMEDOUT) {
                    uint64_t now = gpu_now();
                    for (size_t i = 0; i < sizeof fillings / sizeof fillings[0]; i++)
                        if (fillings[i].used && now >= fillings[i].busy_until) close_buffer(&fillings[i]);
                }
            } else {
                pthread_cond_wait(&work_ready, &lock);
            }
        }
        while (deliver_one()) {
        }
    }
    return NULL;
}

static void start_worker(void) {
    if (worker_started) return;
    if (pthread_create(&worker, NULL, worker_main, NULL) == 0) {
        pthread_detach(worker);
        worker_started = 1;
    } else {
        fprintf(stderr, "standin cupti: cannot start the delivery thread\n");
    }
}

/* Hands back buffers (every thread's, >= 130000) and waits until the client
 * has them, except that a forced flush (>= 130000, not `all_now`) leaves
 * other threads' buffers on the late list. Caller holds lock. */
static void flush_all_locked(int forced, int all_now) {
    uint64_t now = gpu_now();
    uint32_t self = (uint32_t)syscall(SYS_gettid);
    uint64_t due = late_ms > 0 ? monotonic_ns() + (uint64_t)late_ms * 1000000ULL : 0;
    for (size_t i = 0; i < sizeof fillings / sizeof fillings[0]; i++) {
        struct filling *f = &fillings[i];
        int late = forced && !all_now && per_thread_buffers && f->tid != 0 && f->tid != self;
        if (forced) leave_unfinished(f, now);
        if (forced || (f->used && now >= f->busy_until)) close_buffer_due(f, late ? due : 0);
    }
    if (all_now) release_late(UINT64_MAX);
    if (on_worker() || !worker_started) {
        while (deliver_one()) {
        }
        return;
    }
    pthread_cond_broadcast(&work_ready);
    while (queue_head || delivering) pthread_cond_wait(&work_done, &lock);
}

static void flush_locked(int forced) {
    flush_all_locked(forced, 0);
}

/* ---- records ----------------------------------------------------------------------- */

static uint64_t *tail_of(uint32_t stream_id) {
    for (size_t i = 0; i < sizeof tails / sizeof tails[0]; i++) {
        if (tails[i].stream_id == stream_id) return &tails[i].tail;
        if (tails[i].stream_id == 0) {
            tails[i].stream_id = stream_id;
            return &tails[i].tail;
        }
    }
    return &tails[0].tail; /* more streams than slots: share one */
}

/* [start, end) of device work of `duration` ns issued by `call`, whose
 * record reserve() just placed (in last_filled). */
static void device_interval(const struct standin_call *call, uint64_t duration, uint64_t *start, uint64_t *end) {
    uint64_t *tail = tail_of(call->stream_id);
    uint64_t s = gpu_time(call->start_ns);
    if (*tail > s) s = *tail;
    *tail = s + duration;
    if (*tail > last_filled->busy_until) last_filled->busy_until = *tail;
    *start = stamp(s);
    *end = stamp(s + duration);
    last_gpu_start = s;
    last_gpu_end = s + duration;
}

/* Notes the device record just copied to `out` (in last_filled), whose
 * times device_interval took last, with its fields at these offsets
 * (`completed_at` < 0: none). Caller holds lock. */
static void track_device_record(void *out, size_t start_at, size_t end_at, long completed_at, size_t bytes) {
    struct filling *f = last_filled;
    if (f->ndevice == f->device_cap) {
        size_t cap = f->device_cap ? f->device_cap * 2 : 256;
        struct device_record *grown = realloc(f->device, cap * sizeof *grown);
        if (!grown) return; /* untracked: handed back complete */
        f->device = grown;
        f->device_cap = cap;
    }
    uint8_t *base = out;
    struct device_record *d = &f->device[f->ndevice++];
    d->start = (uint64_t *)(base + start_at);
    d->end = (uint64_t *)(base + end_at);
    d->completed = completed_at >= 0 && (size_t)completed_at + 8 <= bytes ? (uint64_t *)(base + completed_at) : NULL;
    d->gpu_start = last_gpu_start;
    d->gpu_end = last_gpu_end;
}

static void write_context(uint32_t context_id, uint32_t device_id, const struct standin_call *call) {
    CUpti_ActivityContext3 *r = reserve(sizeof *r, call);
    if (!r) return;
    r->kind = CUPTI_ACTIVITY_KIND_CONTEXT;
    r->contextId = context_id;
    r->deviceId = device_id;
    r->computeApiKind = CUPTI_ACTIVITY_COMPUTE_API_CUDA;
    r->nullStreamId = STANDIN_DEFAULT_STREAM_ID;
    r->numMultiprocessors = 132;
    r->cigMode = CUPTI_CONTEXT_CIG_MODE_NONE;
}

/* One DEVICE record for CUDA ordinal `ordinal`, physical GPU `physical`. */
static void write_one_device(uint32_t ordinal, int physical) {
    void *out = reserve(device_bytes, NULL);
    if (!out) return;
    const uint8_t uuid[16] = STANDIN_GPU_UUID(physical);
    CUpti_ActivityDevice6 record, *r = &record;
    memset(r, 0, sizeof *r);
    r->kind = CUPTI_ACTIVITY_KIND_DEVICE;
    r->flags = CUPTI_ACTIVITY_FLAG_DEVICE_CONCURRENT_KERNELS;
    r->globalMemoryBandwidth = 3352320000ULL; /* kB/s */
    r->globalMemorySize = 80ULL << 30;
    r->constantMemorySize = 65536;
    r->l2CacheSize = 50u << 20;
    r->numThreadsPerWarp = 32;
    r->coreClockRate = 1980000; /* kHz */
    r->numMemcpyEngines = 5;
    r->numMultiprocessors = 132;
    r->maxIPC = 4;
    r->maxWarpsPerMultiprocessor = 64;
    r->maxBlocksPerMultiprocessor = 32;
    r->maxSharedMemoryPerMultiprocessor = 233472;
    r->maxRegistersPerMultiprocessor = 65536;
    r->maxRegistersPerBlock = 65536;
    r->maxSharedMemoryPerBlock = 49152;
    r->maxThreadsPerBlock = 1024;
    r->maxBlockDimX = 1024;
    r->maxBlockDimY = 1024;
    r->maxBlockDimZ = 64;
    r->maxGridDimX = 2147483647;
    r->maxGridDimY = 65535;
    r->maxGridDimZ = 65535;
    r->computeCapabilityMajor = 9;
    r->computeCapabilityMinor = 0;
    r->id = ordinal;
    r->eccEnabled = 1;
    memcpy(r->uuid.bytes, uuid, sizeof uuid);
    r->name = "Standin GPU";
    r->isCudaVisible = 1;
    r->isMigEnabled = 0;
    r->gpuInstanceId = 0xFFFFFFFFu;
    r->computeInstanceId = 0xFFFFFFFFu;
    r->isNumaNode = 0;
    r->numaId = 0xFFFFFFFFu;
    r->numTpcs = 66;
    memcpy(out, r, device_bytes);
}

/* A DEVICE record per CUDA ordinal libcuda makes visible (just ordinal 0 on
 * physical GPU 0 when libcuda is not there to ask). */
static void write_devices(void) {
    devtrace_standin_physical_fn physical_of_ordinal = __atomic_load_n(&physical_of, __ATOMIC_ACQUIRE);
    if (!physical_of_ordinal) {
        write_one_device(0, 0);
        return;
    }
    for (int ordinal = 0;; ordinal++) {
        int physical = physical_of_ordinal(ordinal);
        if (physical < 0) break;
        write_one_device((uint32_t)ordinal, physical);
    }
}

static int kernel_kind(void) {
    if (enabled[CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL]) return CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL;
    if (enabled[CUPTI_ACTIVITY_KIND_KERNEL]) return CUPTI_ACTIVITY_KIND_KERNEL;
    return 0;
}

static uint8_t host_or_device(int device) {
    return device ? CUPTI_ACTIVITY_MEMORY_KIND_DEVICE : CUPTI_ACTIVITY_MEMORY_KIND_PAGEABLE;
}

/* One kernel record, in the layout of the emulated release: a launch
 * (graph_id 0) or node `k` of a launch of graph exec `graph_id`. */
static void write_kernel(const struct standin_call *call, uint32_t correlation, const struct standin_graph_node *k,
                         uint32_t graph_id, uint32_t source_graph_id) {
    int kind = kernel_kind();
    if (!kind) return;
    void *out = reserve(kernel_bytes, call);
    if (!out) return;
    CUpti_ActivityKernel13 record, *r = &record;
    memset(r, 0, sizeof *r);
    r->kind = (CUpti_ActivityKind)kind;
    r->cacheConfig.config.requested = 0;
    r->cacheConfig.config.executed = 0;
    r->registersPerThread = k->registers;
    r->partitionedGlobalCacheRequested = CUPTI_ACTIVITY_PARTITIONED_GLOBAL_CACHE_CONFIG_NOT_SUPPORTED;
    r->partitionedGlobalCacheExecuted = CUPTI_ACTIVITY_PARTITIONED_GLOBAL_CACHE_CONFIG_NOT_SUPPORTED;
    device_interval(call, kernel_ns, &r->start, &r->end);
    r->completed = r->end;
    r->deviceId = call->device_id;
    r->contextId = call->context_id;
    r->streamId = call->stream_id;
    r->gridX = (int32_t)k->grid[0];
    r->gridY = (int32_t)k->grid[1];
    r->gridZ = (int32_t)k->grid[2];
    r->blockX = (int32_t)k->block[0];
    r->blockY = (int32_t)k->block[1];
    r->blockZ = (int32_t)k->block[2];
    r->staticSharedMemory = (int32_t)k->static_shared;
    r->dynamicSharedMemory = (int32_t)k->dynamic_shared;
    r->correlationId = correlation;
    r->gridId = next_grid_id++;
    r->name = k->kernel_name;
    r->sharedMemoryExecuted = k->static_shared + k->dynamic_shared;
    r->graphNodeId = graph_id ? k->node_id : 0;
    r->shmemLimitConfig = CUPTI_FUNC_SHMEM_LIMIT_DEFAULT;
    r->graphId = graph_id;
    r->channelID = 1;
    r->channelType = CUPTI_CHANNEL_TYPE_COMPUTE;
    r->clusterX = k->cluster[0];
    r->clusterY = k->cluster[1];
    r->clusterZ = k->cluster[2];
    r->isDeviceLaunched = 0; /* launched from the host */
    r->priority = 0;
    r->executionModel = 0;   /* CUPTI_FUNC_EXECUTION_MODEL_UNKNOWN */
    r->sourceGraphId = graph_id ? source_graph_id : 0;
    r->sourceGraphNodeId = graph_id ? k->source_node_id : 0;
    memcpy(out, r, kernel_bytes);
    track_device_record(out, offsetof(CUpti_ActivityKernel13, start), offsetof(CUpti_ActivityKernel13, end),
                        (long)offsetof(CUpti_ActivityKernel13, completed), kernel_bytes);
}

/* Driver API names by cbid, learned from the calls the stand-in driver
 * reports, for cuptiGetCallbackName. */
static struct {
    uint32_t cbid;
    const char *name;
} callback_names[128];
static size_t ncallback_names;

/* Whether the name of `cbid` is known; without the lock (entries are only
 * appended, each before the count that publishes it). */
static int callback_name_known(uint32_t cbid) {
    size_t n = __atomic_load_n(&ncallback_names, __ATOMIC_ACQUIRE);
    for (size_t i = 0; i < n; i++)
        if (callback_names[i].cbid == cbid) return 1;
    return 0;
}

/* Caller holds lock. */
static void learn_callback_name(uint32_t cbid, const char *name) {
    if (callback_name_known(cbid)) return;
    size_t n = ncallback_names;
    if (name && n < sizeof callback_names / sizeof callback_names[0]) {
        callback_names[n].cbid = cbid;
        callback_names[n].name = name;
        __atomic_store_n(&ncallback_names, n + 1, __ATOMIC_RELEASE);
    }
}

static int on(const uint8_t *flag) {
    return __atomic_load_n(flag, __ATOMIC_RELAXED);
}

/* Whether `call` comes inside a runtime cudaLaunchKernel
 * ($DEVTRACE_STANDIN_CUPTI_RUNTIME_LAUNCHES). */
static int wrapped_launch(const struct standin_call *call) {
    return runtime_launches && call->kind == STANDIN_CALL_KERNEL;
}

/* Whether a call records anything: its DRIVER record (RUNTIME, for a
 * wrapped launch), or the kind its
 * device work or synchronization is recorded under. Contexts are always
 * followed, for the CONTEXT records of a later enable. */
static int records_anything(const struct standin_call *call) {
    if (wrapped_launch(call)) {
        if (on(&runtime_calls[RUNTIME_CBID_cudaLaunchKernel])) return 1;
    } else if (call->cbid < MAX_CALLBACK_IDS && on(&driver_calls[call->cbid])) {
        return 1;
    }
    if (call->result != 0) return 0;
    switch (call->kind) {
    case STANDIN_CALL_KERNEL:
    case STANDIN_CALL_GRAPH_LAUNCH:
        return on(&enabled[CUPTI_ACTIVITY_KIND_KERNEL]) || on(&enabled[CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL]);
    case STANDIN_CALL_MEMCPY: return on(&enabled[CUPTI_ACTIVITY_KIND_MEMCPY]);
    case STANDIN_CALL_MEMSET: return on(&enabled[CUPTI_ACTIVITY_KIND_MEMSET]);
    case STANDIN_CALL_ALLOC:
    case STANDIN_CALL_FREE: return on(&enabled[CUPTI_ACTIVITY_KIND_MEMORY2]);
    case STANDIN_CALL_SYNC: return on(&enabled[CUPTI_ACTIVITY_KIND_SYNCHRONIZATION]);
    case STANDIN_CALL_API: return 0;
    default: return 1;
    }
}

static void spin_ns(long long ns) {
    if (ns <= 0) return;
    uint64_t until = monotonic_ns() + (uint64_t)ns;
    while (monotonic_ns() < until) {
    }
}

static void record_call(struct standin_call *call);

/* Whether a subscriber's callback is called for driver calls now: it
 * enabled the driver API domain and is not deaf. Read without the lock, as
 * a driver call's hot path would: the writers hold it, each field is one
 * word. */
static int subscriber_listening(CUpti_CallbackDomain domain) {
    if (deaf_subscribers) return 0;
    if (!__atomic_load_n(&subscriber_domains[domain], __ATOMIC_ACQUIRE)) return 0;
    if (!__atomic_load_n(&subscribed, __ATOMIC_ACQUIRE) || __atomic_load_n(&subscriber_deaf, __ATOMIC_ACQUIRE))
        return 0;
    if (strict_subscribers && __atomic_load_n(&armed, __ATOMIC_ACQUIRE)) {
        int any_kind = 0;
        for (size_t k = 0; k < CUPTI_ACTIVITY_KIND_COUNT; k++) any_kind |= __atomic_load_n(&enabled[k], __ATOMIC_RELAXED);
        if (!any_kind) return 0;
    }
    return 1;
}

/* A subscriber's callback at the entry or exit site of `call` in `domain`
 * (as callback id `cbid`, named `name`, with `slot` as its correlationData),
 * when it is listening, with the call's correlation id. Runs without the
 * lock: the callback may call back into CUPTI (cuptiFinalize, as the dynamic
 * detach recipe does). */
static void call_subscriber(struct standin_call *call, CUpti_CallbackDomain domain, uint32_t cbid,
                            const char *name, uint64_t *slot, CUpti_ApiCallbackSite site) {
    if (!subscriber_listening(domain)) return;
    CUpti_CallbackFunc callback = __atomic_load_n(&subscriber_callback, __ATOMIC_ACQUIRE);
    void *userdata = __atomic_load_n(&subscriber_userdata, __ATOMIC_ACQUIRE);
    if (!callback) return;
    spin_ns(callback_ns);
    if (domain == CUPTI_CB_DOMAIN_DRIVER_API && site == CUPTI_API_EXIT && !callback_name_known(cbid)) {
        pthread_mutex_lock(&lock);
        learn_callback_name(cbid, name);
        pthread_mutex_unlock(&lock);
    }
    if (!call->correlation_id) call->correlation_id = __atomic_fetch_add(&next_correlation, 1, __ATOMIC_RELAXED);
    CUpti_CallbackData data;
    memset(&data, 0, sizeof data);
    data.callbackSite = site;
    data.functionName = name;
    data.context = NULL;
    data.contextUid = call->context_id;
    data.correlationData = slot;
    data.correlationId = call->correlation_id;
    /* The CUresult (0 for success, as a runtime call's cudaError_t), at
     * the exit alone, as CUPTI gives it. */
    if (site == CUPTI_API_EXIT) data.functionReturnValue = &call->result;
    callback(userdata, (int)domain, cbid, &data);
}

static void notify_subscriber(struct standin_call *call, CUpti_ApiCallbackSite site) {
    call_subscriber(call, CUPTI_CB_DOMAIN_DRIVER_API, call->cbid, call->api_name, &call->correlation_data, site);
}

/* The runtime call a wrapped launch comes inside. */
static void notify_runtime(struct standin_call *call, CUpti_ApiCallbackSite site) {
    call_subscriber(call, CUPTI_CB_DOMAIN_RUNTIME_API, RUNTIME_CBID_cudaLaunchKernel, "cudaLaunchKernel",
                    &call->runtime_correlation_data, site);
}

/* The handler libcuda calls as each driver call enters and returns. */
CUPTIAPI void devtrace_standin_cupti_on_call(struct standin_call *call) {
    if (!call || call->version != STANDIN_CALL_VERSION) return;
    pthread_once(&setup_once, setup);
    if (call->site == STANDIN_SITE_ENTER) {
        if (wrapped_launch(call)) {
            /* The runtime call is numbered first; its driver call shares it. */
            call->correlation_id = __atomic_fetch_add(&next_correlation, 1, __ATOMIC_RELAXED);
            notify_runtime(call, CUPTI_API_ENTER);
        }
        notify_subscriber(call, CUPTI_API_ENTER);
        return;
    }
    if (__atomic_load_n(&armed, __ATOMIC_RELAXED)) spin_ns(armed_ns);
    record_call(call);
    notify_subscriber(call, CUPTI_API_EXIT);
    if (wrapped_launch(call)) notify_runtime(call, CUPTI_API_EXIT);
}

/* The activity records of one driver call; numbers it if its entry did not. */
static void record_call(struct standin_call *call) {
    if (!records_anything(call)) return;
    pthread_mutex_lock(&lock);
    learn_callback_name(call->cbid, call->api_name);
    if (!call->correlation_id) call->correlation_id = __atomic_fetch_add(&next_correlation, 1, __ATOMIC_RELAXED);
    uint32_t correlation = call->correlation_id;

    if (call->kind == STANDIN_CALL_CTX_CREATE && call->result == 0 &&
        ncontexts < sizeof contexts / sizeof contexts[0]) {
        contexts[ncontexts] = call->context_id;
        context_devices[ncontexts] = call->device_id;
        context_reported[ncontexts] = enabled[CUPTI_ACTIVITY_KIND_CONTEXT];
        ncontexts++;
        if (enabled[CUPTI_ACTIVITY_KIND_CONTEXT]) write_context(call->context_id, call->device_id, call);
    }

    int wrapped = wrapped_launch(call);
    if (wrapped ? runtime_calls[RUNTIME_CBID_cudaLaunchKernel]
                : call->cbid < MAX_CALLBACK_IDS && driver_calls[call->cbid]) {
        CUpti_ActivityAPI *r = reserve(sizeof *r, call);
        if (r) {
            r->kind = wrapped ? CUPTI_ACTIVITY_KIND_RUNTIME : CUPTI_ACTIVITY_KIND_DRIVER;
            r->cbid = wrapped ? RUNTIME_CBID_cudaLaunchKernel : call->cbid;
            r->start = stamp(gpu_time(call->start_ns));
            r->end = stamp(gpu_time(call->end_ns));
            r->processId = call->pid;
            r->threadId = current_tid(call);
            r->correlationId = correlation;
            r->returnValue = (uint32_t)call->result;
            spin_ns(api_record_ns);
        }
    }

    if (call->result != 0) {
        pthread_mutex_unlock(&lock);
        return;
    }

    switch (call->kind) {
    case STANDIN_CALL_KERNEL: {
        struct standin_graph_node launch;
        memset(&launch, 0, sizeof launch);
        launch.kernel_name = call->kernel_name;
        memcpy(launch.grid, call->grid, sizeof launch.grid);
        memcpy(launch.block, call->block, sizeof launch.block);
        launch.dynamic_shared = call->dynamic_shared;
        launch.static_shared = call->static_shared;
        launch.registers = call->registers;
        launch.launch_ex = call->launch_ex;
        memcpy(launch.cluster, call->cluster, sizeof launch.cluster);
        write_kernel(call, correlation, &launch, 0, 0);
        break;
    }
    case STANDIN_CALL_GRAPH_LAUNCH:
        /* Every kernel of the replay shares the cuGraphLaunch correlation id. */
        for (uint32_t i = 0; i < call->nnodes; i++)
            write_kernel(call, correlation, &call->nodes[i], call->graph_id, call->source_graph_id);
        break;
    case STANDIN_CALL_MEMCPY: {
        if (!enabled[CUPTI_ACTIVITY_KIND_MEMCPY]) break;
        void *out = reserve(memcpy_bytes, call);
        if (!out) break;
        CUpti_ActivityMemcpy7 record, *r = &record;
        memset(r, 0, sizeof *r);
        uint32_t k = call->copy_kind;
        r->kind = CUPTI_ACTIVITY_KIND_MEMCPY;
        r->copyKind = (uint8_t)k;
        r->srcKind = host_or_device(k == CUPTI_ACTIVITY_MEMCPY_KIND_DTOH || k == CUPTI_ACTIVITY_MEMCPY_KIND_DTOD);
        r->dstKind = host_or_device(k == CUPTI_ACTIVITY_MEMCPY_KIND_HTOD || k == CUPTI_ACTIVITY_MEMCPY_KIND_DTOD);
        r->flags = call->is_async ? CUPTI_ACTIVITY_FLAG_MEMCPY_ASYNC : 0;
        r->bytes = call->bytes;
        device_interval(call, memcpy_ns, &r->start, &r->end);
        r->deviceId = call->device_id;
        r->contextId = call->context_id;
        r->streamId = call->stream_id;
        r->correlationId = correlation;
        r->graphNodeId = 0; /* copies are never captured by the stand-in driver */
        r->graphId = 0;
        r->channelID = 2;
        r->channelType = CUPTI_CHANNEL_TYPE_ASYNC_MEMCPY;
        r->isDeviceLaunched = 0;
        r->copyCount = 1;
        r->sourceGraphId = 0;
        r->sourceGraphNodeId = 0;
        memcpy(out, r, memcpy_bytes);
        track_device_record(out, offsetof(CUpti_ActivityMemcpy7, start), offsetof(CUpti_ActivityMemcpy7, end), -1,
                            memcpy_bytes);
        break;
    }
    case STANDIN_CALL_MEMSET: {
        if (!enabled[CUPTI_ACTIVITY_KIND_MEMSET]) break;
        void *out = reserve(memset_bytes, call);
        if (!out) break;
        CUpti_ActivityMemset5 record, *r = &record;
        memset(r, 0, sizeof *r);
        r->kind = CUPTI_ACTIVITY_KIND_MEMSET;
        r->value = call->memset_value;
        r->bytes = call->bytes;
        device_interval(call, memset_ns, &r->start, &r->end);
        r->deviceId = call->device_id;
        r->contextId = call->context_id;
        r->streamId = call->stream_id;
        r->correlationId = correlation;
        r->flags = call->is_async ? CUPTI_ACTIVITY_FLAG_MEMSET_ASYNC : 0;
        r->memoryKind = CUPTI_ACTIVITY_MEMORY_KIND_DEVICE;
        r->graphNodeId = 0;
        r->graphId = 0;
        r->channelID = 1;
        r->channelType = CUPTI_CHANNEL_TYPE_COMPUTE;
        r->isDeviceLaunched = 0;
        r->sourceGraphId = 0;
        r->sourceGraphNodeId = 0;
        memcpy(out, r, memset_bytes);
        track_device_record(out, offsetof(CUpti_ActivityMemset5, start), offsetof(CUpti_ActivityMemset5, end), -1,
                            memset_bytes);
        break;
    }
    case STANDIN_CALL_ALLOC:
    case STANDIN_CALL_FREE: {
        if (!enabled[CUPTI_ACTIVITY_KIND_MEMORY2]) break;
        CUpti_ActivityMemory4 *r = reserve(sizeof *r, call);
        if (!r) break;
        r->kind = CUPTI_ACTIVITY_KIND_MEMORY2;
        r->memoryOperationType = call->kind == STANDIN_CALL_ALLOC ? CUPTI_ACTIVITY_MEMORY_OPERATION_TYPE_ALLOCATION
                                                                  : CUPTI_ACTIVITY_MEMORY_OPERATION_TYPE_RELEASE;
        r->memoryKind = CUPTI_ACTIVITY_MEMORY_KIND_DEVICE;
        r->correlationId = correlation;
        r->address = call->device_ptr;
        r->bytes = call->bytes;
        r->timestamp = stamp(gpu_time(call->start_ns));
        r->processId = call->pid;
        r->deviceId = call->device_id;
        r->contextId = call->context_id;
        r->streamId = CUPTI_INVALID_STREAM_ID;
        r->memoryPoolConfig.memoryPoolType = CUPTI_ACTIVITY_MEMORY_POOL_TYPE_INVALID;
        break;
    }
    case STANDIN_CALL_SYNC: {
        if (!enabled[CUPTI_ACTIVITY_KIND_SYNCHRONIZATION]) break;
        CUpti_ActivitySynchronization2 *r = reserve(sizeof *r, call);
        if (!r) break;
        r->kind = CUPTI_ACTIVITY_KIND_SYNCHRONIZATION;
        r->type = (CUpti_ActivitySynchronizationType)call->sync_type;
        r->start = stamp(gpu_time(call->start_ns));
        r->end = stamp(gpu_time(call->end_ns));
        r->correlationId = correlation;
        r->contextId = call->context_id;
        r->streamId = call->sync_type == 3 ? call->stream_id : CUPTI_INVALID_STREAM_ID;
        r->cudaEventId = call->sync_type == 1 ? call->event_id : CUPTI_SYNCHRONIZATION_INVALID_VALUE;
        r->cudaEventSyncId = call->sync_type == 1 ? next_event_sync_id++ : CUPTI_SYNCHRONIZATION_INVALID_VALUE;
        r->returnValue = (uint32_t)call->result;
        break;
    }
    default:
        break;
    }
    pthread_mutex_unlock(&lock);
}

/* ---- attaching to the driver stand-in ---------------------------------------------- */

static void attach_driver(void) {
    if (__atomic_load_n(&driver_attached, __ATOMIC_ACQUIRE)) return;
    void (*set_hook)(devtrace_standin_hook) =
        (void (*)(devtrace_standin_hook))dlsym(RTLD_DEFAULT, "devtrace_standin_cuda_set_hook");
    devtrace_standin_physical_fn physical =
        (devtrace_standin_physical_fn)dlsym(RTLD_DEFAULT, "devtrace_standin_device_physical");
    if (!set_hook) {
        void *driver = dlopen("libcuda.so.1", RTLD_LAZY | RTLD_NOLOAD);
        if (!driver) driver = dlopen("libcuda.so", RTLD_LAZY | RTLD_NOLOAD);
        if (driver) {
            set_hook = (void (*)(devtrace_standin_hook))dlsym(driver, "devtrace_standin_cuda_set_hook");
            physical = (devtrace_standin_physical_fn)dlsym(driver, "devtrace_standin_device_physical");
            dlclose(driver);
        }
    }
    if (set_hook) {
        __atomic_store_n(&physical_of, physical, __ATOMIC_RELEASE);
        set_hook(devtrace_standin_cupti_on_call);
        __atomic_store_n(&driver_attached, 1, __ATOMIC_RELEASE);
    }
}

__attribute__((constructor)) static void on_load(void) {
    pthread_once(&setup_once, setup);
    attach_driver();
}

/* Common prologue of every entry point. */
#define ENTER(name)                                      \
    do {                                                 \
        pthread_once(&setup_once, setup);                \
        attach_driver();                                 \
        CUptiResult failure_ = injected(name);           \
        if (failure_ != CUPTI_SUCCESS) return failure_;  \
    } while (0)

/* ---- the Activity API ------------------------------------------------------------- */

CUPTIAPI CUptiResult cuptiGetVersion(uint32_t *version) {
    ENTER("cuptiGetVersion");
    if (!version) return CUPTI_ERROR_INVALID_PARAMETER;
    /* DEVTRACE_STANDIN_CUPTI_VERSION pretends to be another release. */
    *version = api_version;
    return CUPTI_SUCCESS;
}

CUPTIAPI CUptiResult cuptiGetTimestamp(uint64_t *timestamp) {
    ENTER("cuptiGetTimestamp");
    if (!timestamp) return CUPTI_ERROR_INVALID_PARAMETER;
    *timestamp = gpu_now();
    return CUPTI_SUCCESS;
}

CUPTIAPI CUptiResult cuptiActivityRegisterTimestampCallback(CUpti_TimestampCallbackFunc funcTimestamp) {
    ENTER("cuptiActivityRegisterTimestampCallback");
    if (!funcTimestamp) return CUPTI_ERROR_INVALID_PARAMETER;
    /* Its rate against CUPTI's clock, over a quarter of a millisecond. */
    uint64_t gpu0 = gpu_now(), ticks0 = funcTimestamp();
    uint64_t gpu1 = gpu0;
    while (gpu1 < gpu0 + 250000) gpu1 = gpu_now();
    uint64_t ticks1 = funcTimestamp();
    pthread_mutex_lock(&lock);
    record_clock_rate = ticks1 > ticks0 ? (double)(ticks1 - ticks0) / (double)(gpu1 - gpu0) : 1.0;
    record_clock_anchor = ticks0;
    record_clock_anchor_gpu = gpu0;
    record_clock = funcTimestamp;
    pthread_mutex_unlock(&lock);
    return CUPTI_SUCCESS;
}

CUPTIAPI CUptiResult cuptiActivityRegisterCallbacks(CUpti_BuffersCallbackRequestFunc funcBufferRequested,
                                                    CUpti_BuffersCallbackCompleteFunc funcBufferCompleted) {
    ENTER("cuptiActivityRegisterCallbacks");
    if (!funcBufferRequested || !funcBufferCompleted) return CUPTI_ERROR_INVALID_PARAMETER;
    pthread_mutex_lock(&lock);
    request_cb = funcBufferRequested;
    complete_cb = funcBufferCompleted;
    /* Buffers being filled stay and keep being filled. */
    start_worker();
    pthread_mutex_unlock(&lock);
    return CUPTI_SUCCESS;
}

CUPTIAPI CUptiResult cuptiActivityEnable(CUpti_ActivityKind kind) {
    ENTER("cuptiActivityEnable");
    if (kind <= CUPTI_ACTIVITY_KIND_INVALID || kind >= CUPTI_ACTIVITY_KIND_COUNT) return CUPTI_ERROR_INVALID_KIND;
    pthread_mutex_lock(&lock);
    if (!armed) {
        /* Arming CUPTI (its hooks into the driver) is slow; the lock is held
         * through it, as other CUPTI calls wait for it in the real library. */
        if (first_enable_ms > 0) usleep((useconds_t)(first_enable_ms * 1000));
        __atomic_store_n(&armed, 1, __ATOMIC_RELAXED);
    }
    int was = enabled[kind];
    __atomic_store_n(&enabled[kind], 1, __ATOMIC_RELAXED);
    if (kind == CUPTI_ACTIVITY_KIND_DRIVER) memset(driver_calls, 1, sizeof driver_calls);
    if (kind == CUPTI_ACTIVITY_KIND_RUNTIME) memset(runtime_calls, 1, sizeof runtime_calls);
    if (!was && kind == CUPTI_ACTIVITY_KIND_DEVICE) write_devices();
    if (kind == CUPTI_ACTIVITY_KIND_CONTEXT) {
        for (size_t i = 0; i < ncontexts; i++) {
            if (!context_reported[i]) {
                write_context(contexts[i], context_devices[i], NULL);
                context_reported[i] = 1;
            }
        }
    }
    pthread_mutex_unlock(&lock);
    if (!was && enable_ms > 0) usleep((useconds_t)(enable_ms * 1000));
    return CUPTI_SUCCESS;
}

CUPTIAPI CUptiResult cuptiActivityDisable(CUpti_ActivityKind kind) {
    ENTER("cuptiActivityDisable");
    if (kind <= CUPTI_ACTIVITY_KIND_INVALID || kind >= CUPTI_ACTIVITY_KIND_COUNT) return CUPTI_ERROR_INVALID_KIND;
    pthread_mutex_lock(&lock);
    __atomic_store_n(&enabled[kind], 0, __ATOMIC_RELAXED);
    if (kind == CUPTI_ACTIVITY_KIND_DRIVER) memset(driver_calls, 0, sizeof driver_calls);
    if (kind == CUPTI_ACTIVITY_KIND_RUNTIME) memset(runtime_calls, 0, sizeof runtime_calls);
    pthread_mutex_unlock(&lock);
    return CUPTI_SUCCESS;
}

#ifndef STANDIN_CUPTI_WITHOUT_PER_CALL_ENABLES
static CUptiResult enable_call(uint8_t *calls, uint32_t size, CUpti_CallbackId cbid, uint8_t enable) {
    if (cbid == 0 || cbid >= size || cbid >= MAX_CALLBACK_IDS) return CUPTI_ERROR_INVALID_PARAMETER;
    if (ignore_selection) return CUPTI_SUCCESS;
    pthread_mutex_lock(&lock);
    __atomic_store_n(&calls[cbid], enable ? 1 : 0, __ATOMIC_RELAXED);
    pthread_mutex_unlock(&lock);
    return CUPTI_SUCCESS;
}

CUPTIAPI CUptiResult cuptiActivityEnableDriverApi(CUpti_CallbackId cbid, uint8_t enable) {
    ENTER("cuptiActivityEnableDriverApi");
    return enable_call(driver_calls, driver_cbid_size, cbid, enable);
}

CUPTIAPI CUptiResult cuptiActivityEnableRuntimeApi(CUpti_CallbackId cbid, uint8_t enable) {
    ENTER("cuptiActivityEnableRuntimeApi");
    return enable_call(runtime_calls, runtime_cbid_size, cbid, enable);
}
#endif

CUPTIAPI CUptiResult cuptiActivityFlushAll(uint32_t flag) {
    ENTER("cuptiActivityFlushAll");
    pthread_mutex_lock(&lock);
    if (!request_cb) {
        pthread_mutex_unlock(&lock);
        return CUPTI_ERROR_INVALID_OPERATION;
    }
    flush_locked((flag & CUPTI_ACTIVITY_FLAG_FLUSH_FORCED) != 0);
    pthread_mutex_unlock(&lock);
    return CUPTI_SUCCESS;
}

/* Deprecated: context and stream are ignored, as in the real library. */
CUPTIAPI CUptiResult cuptiActivityFlush(CUcontext context, uint32_t streamId, uint32_t flag) {
    (void)context;
    (void)streamId;
    ENTER("cuptiActivityFlush");
    pthread_mutex_lock(&lock);
    if (!request_cb) {
        pthread_mutex_unlock(&lock);
        return CUPTI_ERROR_INVALID_OPERATION;
    }
    flush_locked((flag & CUPTI_ACTIVITY_FLAG_FLUSH_FORCED) != 0);
    pthread_mutex_unlock(&lock);
    return CUPTI_SUCCESS;
}

CUPTIAPI CUptiResult cuptiActivityFlushPeriod(uint32_t time) {
    ENTER("cuptiActivityFlushPeriod");
    pthread_mutex_lock(&lock);
    flush_period_ms = time;
    pthread_cond_broadcast(&work_ready);
    pthread_mutex_unlock(&lock);
    return CUPTI_SUCCESS;
}

static size_t record_size(uint32_t kind) {
    switch (kind) {
    case CUPTI_ACTIVITY_KIND_DRIVER:
    case CUPTI_ACTIVITY_KIND_RUNTIME:
    case CUPTI_ACTIVITY_KIND_INTERNAL_LAUNCH_API: return sizeof(CUpti_ActivityAPI);
    case CUPTI_ACTIVITY_KIND_KERNEL:
    case CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL: return kernel_bytes;
    case CUPTI_ACTIVITY_KIND_MEMCPY: return memcpy_bytes;
    case CUPTI_ACTIVITY_KIND_MEMSET: return memset_bytes;
    case CUPTI_ACTIVITY_KIND_MEMORY2: return sizeof(CUpti_ActivityMemory4);
    case CUPTI_ACTIVITY_KIND_DEVICE: return device_bytes;
    case CUPTI_ACTIVITY_KIND_CONTEXT: return sizeof(CUpti_ActivityContext3);
    case CUPTI_ACTIVITY_KIND_OVERHEAD: return sizeof(CUpti_ActivityOverhead3);
    case CUPTI_ACTIVITY_KIND_SYNCHRONIZATION: return sizeof(CUpti_ActivitySynchronization2);
    default: return 0;
    }
}

CUPTIAPI CUptiResult cuptiActivityGetNextRecord(uint8_t *buffer_, size_t validBufferSizeBytes,
                                                CUpti_Activity **record) {
    ENTER("cuptiActivityGetNextRecord");
    if (!buffer_ || !record) return CUPTI_ERROR_INVALID_PARAMETER;
    size_t offset = 0;
    if (*record) {
        size_t previous = record_size((*record)->kind);
        if (!previous) return CUPTI_ERROR_INVALID_KIND;
        offset = (size_t)((uint8_t *)*record - buffer_) + previous;
    }
    if (offset + sizeof(CUpti_ActivityKind) > validBufferSizeBytes) return CUPTI_ERROR_MAX_LIMIT_REACHED;
    CUpti_Activity *next = (CUpti_Activity *)(buffer_ + offset);
    size_t size = record_size(next->kind);
    if (!size) return CUPTI_ERROR_INVALID_KIND;
    if (offset + size > validBufferSizeBytes) return CUPTI_ERROR_MAX_LIMIT_REACHED;
    *record = next;
    return CUPTI_SUCCESS;
}

CUPTIAPI CUptiResult cuptiActivityGetNumDroppedRecords(CUcontext context, uint32_t streamId, size_t *count) {
    (void)context;
    (void)streamId;
    ENTER("cuptiActivityGetNumDroppedRecords");
    if (!count) return CUPTI_ERROR_INVALID_PARAMETER;
    pthread_mutex_lock(&lock);
    *count = dropped;
    dropped = 0;
    pthread_mutex_unlock(&lock);
    return CUPTI_SUCCESS;
}

CUPTIAPI CUptiResult cuptiSetThreadIdType(CUpti_ActivityThreadIdType type) {
    ENTER("cuptiSetThreadIdType");
    if (type != CUPTI_ACTIVITY_THREAD_ID_TYPE_DEFAULT && type != CUPTI_ACTIVITY_THREAD_ID_TYPE_SYSTEM)
        return CUPTI_ERROR_INVALID_PARAMETER;
    pthread_mutex_lock(&lock);
    thread_id_type = type;
    pthread_mutex_unlock(&lock);
    return CUPTI_SUCCESS;
}

CUPTIAPI CUptiResult cuptiGetThreadIdType(CUpti_ActivityThreadIdType *type) {
    ENTER("cuptiGetThreadIdType");
    if (!type) return CUPTI_ERROR_INVALID_PARAMETER;
    *type = thread_id_type;
    return CUPTI_SUCCESS;
}

/* Both subscribe entry points; not an exported name, so that neither goes
 * through the other's interposition. */
static CUptiResult subscribe(CUpti_SubscriberHandle *subscriber, CUpti_CallbackFunc callback, void *userdata) {
    if (!subscriber) return CUPTI_ERROR_INVALID_PARAMETER;
    pthread_mutex_lock(&lock);
    if (subscribed) {
        pthread_mutex_unlock(&lock);
        return CUPTI_ERROR_MULTIPLE_SUBSCRIBERS_NOT_SUPPORTED;
    }
    int any_kind = 0;
    for (size_t k = 0; k < CUPTI_ACTIVITY_KIND_COUNT; k++) any_kind |= enabled[k];
    subscribed = 1;
    subscriber_deaf = armed && !any_kind;
    subscriber_callback = callback;
    subscriber_userdata = userdata;
    memset(subscriber_domains, 0, sizeof subscriber_domains);
    pthread_mutex_unlock(&lock);
    *subscriber = &the_subscriber;
    return CUPTI_SUCCESS;
}

CUPTIAPI CUptiResult cuptiSubscribe(CUpti_SubscriberHandle *subscriber, CUpti_CallbackFunc callback, void *userdata) {
    ENTER("cuptiSubscribe");
    return subscribe(subscriber, callback, userdata);
}

CUPTIAPI CUptiResult cuptiSubscribe_v2(CUpti_SubscriberHandle *subscriber, CUpti_CallbackFunc callback,
                                       void *userdata, CUpti_SubscriberParams *params) {
    ENTER("cuptiSubscribe_v2");
    if (params && params->structSize == 0) return CUPTI_ERROR_INVALID_PARAMETER;
    return subscribe(subscriber, callback, userdata);
}

CUPTIAPI CUptiResult cuptiEnableDomain(uint32_t enable, CUpti_SubscriberHandle subscriber, CUpti_CallbackDomain domain) {
    ENTER("cuptiEnableDomain");
    if (subscriber != &the_subscriber || domain <= CUPTI_CB_DOMAIN_INVALID || domain >= CUPTI_CB_DOMAIN_SIZE)
        return CUPTI_ERROR_INVALID_PARAMETER;
    pthread_mutex_lock(&lock);
    if (!subscribed) {
        pthread_mutex_unlock(&lock);
        return CUPTI_ERROR_INVALID_PARAMETER;
    }
    __atomic_store_n(&subscriber_domains[domain], enable ? 1 : 0, __ATOMIC_RELEASE);
    pthread_mutex_unlock(&lock);
    return CUPTI_SUCCESS;
}

CUPTIAPI CUptiResult cuptiUnsubscribe(CUpti_SubscriberHandle subscriber) {
    ENTER("cuptiUnsubscribe");
    if (subscriber != &the_subscriber) return CUPTI_ERROR_INVALID_PARAMETER;
    pthread_mutex_lock(&lock);
    subscribed = 0;
    subscriber_callback = NULL;
    memset(subscriber_domains, 0, sizeof subscriber_domains);
    pthread_mutex_unlock(&lock);
    return CUPTI_SUCCESS;
}

/* Delivers every buffer (late ones too) to the pair registered now, then
 * forgets everything a client set: kinds, per-call enables, the callbacks,
 * the subscriber, the thread id type. The next CUPTI call attaches afresh. */
CUPTIAPI CUptiResult cuptiFinalize(void) {
    ENTER("cuptiFinalize");
    pthread_mutex_lock(&lock);
    if (request_cb) flush_all_locked(1, 1);
    memset(enabled, 0, sizeof enabled);
    memset(driver_calls, 0, sizeof driver_calls);
    memset(runtime_calls, 0, sizeof runtime_calls);
    request_cb = NULL;
    complete_cb = NULL;
    subscribed = 0;
    subscriber_callback = NULL;
    memset(subscriber_domains, 0, sizeof subscriber_domains);
    thread_id_type = CUPTI_ACTIVITY_THREAD_ID_TYPE_DEFAULT;
    __atomic_store_n(&armed, 0, __ATOMIC_RELAXED);
    finalizes++;
    pthread_mutex_unlock(&lock);
    return CUPTI_SUCCESS;
}

/* Not CUPTI: whether CUPTI is armed now and how often it was finalized,
 * for test programs. */
CUPTIAPI void devtrace_standin_cupti_state(int *is_armed, unsigned long *finalized) {
    pthread_once(&setup_once, setup);
    pthread_mutex_lock(&lock);
    if (is_armed) *is_armed = armed;
    if (finalized) *finalized = finalizes;
    pthread_mutex_unlock(&lock);
}

/* Not CUPTI: whether kernels are being recorded now (a kernel kind is
 * enabled), for test programs that must not run ahead of a recording. The
 * injection library enables the kernel kind after every other kind, so a
 * program that waits for this has its copies, memsets and syncs recorded
 * too. */
CUPTIAPI int devtrace_standin_cupti_recording_kernels(void) {
    pthread_once(&setup_once, setup);
    return __atomic_load_n(&enabled[CUPTI_ACTIVITY_KIND_KERNEL], __ATOMIC_RELAXED) ||
           __atomic_load_n(&enabled[CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL], __ATOMIC_RELAXED);
}

/* Domain 1 is CUPTI_CB_DOMAIN_DRIVER_API; names are known once a call with
 * that cbid was made, as the real library knows them all. Of the runtime
 * domain (2), the one runtime call of this stand-in. */
CUPTIAPI CUptiResult cuptiGetCallbackName(int domain, CUpti_CallbackId cbid, const char **name) {
    ENTER("cuptiGetCallbackName");
    if (!name) return CUPTI_ERROR_INVALID_PARAMETER;
    if (domain == 2 && cbid == RUNTIME_CBID_cudaLaunchKernel) {
        *name = "cudaLaunchKernel_v7000";
        return CUPTI_SUCCESS;
    }
    if (domain != 1) return CUPTI_ERROR_INVALID_PARAMETER;
    pthread_mutex_lock(&lock);
    const char *found = NULL;
    for (size_t i = 0; i < ncallback_names; i++)
        if (callback_names[i].cbid == cbid) found = callback_names[i].name;
    pthread_mutex_unlock(&lock);
    if (!found) return CUPTI_ERROR_INVALID_PARAMETER;
    *name = found;
    return CUPTI_SUCCESS;
}

CUPTIAPI CUptiResult cuptiGetResultString(CUptiResult result, const char **str) {
    ENTER("cuptiGetResultString");
    if (!str) return CUPTI_ERROR_INVALID_PARAMETER;
    const char *text;
#define NAME(code) case code: text = #code; break
    switch (result) {
        NAME(CUPTI_SUCCESS);
        NAME(CUPTI_ERROR_INVALID_PARAMETER);
        NAME(CUPTI_ERROR_INVALID_DEVICE);
        NAME(CUPTI_ERROR_INVALID_CONTEXT);
        NAME(CUPTI_ERROR_INVALID_EVENT_DOMAIN_ID);
        NAME(CUPTI_ERROR_INVALID_EVENT_ID);
        NAME(CUPTI_ERROR_INVALID_EVENT_NAME);
        NAME(CUPTI_ERROR_INVALID_OPERATION);
        NAME(CUPTI_ERROR_OUT_OF_MEMORY);
        NAME(CUPTI_ERROR_HARDWARE);
        NAME(CUPTI_ERROR_PARAMETER_SIZE_NOT_SUFFICIENT);
        NAME(CUPTI_ERROR_API_NOT_IMPLEMENTED);
        NAME(CUPTI_ERROR_MAX_LIMIT_REACHED);
        NAME(CUPTI_ERROR_NOT_READY);
        NAME(CUPTI_ERROR_NOT_COMPATIBLE);
        NAME(CUPTI_ERROR_NOT_INITIALIZED);
        NAME(CUPTI_ERROR_INVALID_METRIC_ID);
        NAME(CUPTI_ERROR_INVALID_METRIC_NAME);
        NAME(CUPTI_ERROR_QUEUE_EMPTY);
        NAME(CUPTI_ERROR_INVALID_HANDLE);
        NAME(CUPTI_ERROR_INVALID_STREAM);
        NAME(CUPTI_ERROR_INVALID_KIND);
        NAME(CUPTI_ERROR_INVALID_EVENT_VALUE);
        NAME(CUPTI_ERROR_DISABLED);
        NAME(CUPTI_ERROR_INVALID_MODULE);
        NAME(CUPTI_ERROR_INVALID_METRIC_VALUE);
        NAME(CUPTI_ERROR_HARDWARE_BUSY);
        NAME(CUPTI_ERROR_NOT_SUPPORTED);
        NAME(CUPTI_ERROR_UM_PROFILING_NOT_SUPPORTED);
        NAME(CUPTI_ERROR_UM_PROFILING_NOT_SUPPORTED_ON_DEVICE);
        NAME(CUPTI_ERROR_UM_PROFILING_NOT_SUPPORTED_ON_NON_P2P_DEVICES);
        NAME(CUPTI_ERROR_UM_PROFILING_NOT_SUPPORTED_WITH_MPS);
        NAME(CUPTI_ERROR_CDP_TRACING_NOT_SUPPORTED);
        NAME(CUPTI_ERROR_VIRTUALIZED_DEVICE_NOT_SUPPORTED);
        NAME(CUPTI_ERROR_CUDA_COMPILER_NOT_COMPATIBLE);
        NAME(CUPTI_ERROR_INSUFFICIENT_PRIVILEGES);
        NAME(CUPTI_ERROR_OLD_PROFILER_API_INITIALIZED);
        NAME(CUPTI_ERROR_OPENACC_UNDEFINED_ROUTINE);
        NAME(CUPTI_ERROR_LEGACY_PROFILER_NOT_SUPPORTED);
        NAME(CUPTI_ERROR_MULTIPLE_SUBSCRIBERS_NOT_SUPPORTED);
        NAME(CUPTI_ERROR_VIRTUALIZED_DEVICE_INSUFFICIENT_PRIVILEGES);
        NAME(CUPTI_ERROR_CONFIDENTIAL_COMPUTING_NOT_SUPPORTED);
        NAME(CUPTI_ERROR_CMP_DEVICE_NOT_SUPPORTED);
        NAME(CUPTI_ERROR_MIG_DEVICE_NOT_SUPPORTED);
        NAME(CUPTI_ERROR_SLI_DEVICE_NOT_SUPPORTED);
        NAME(CUPTI_ERROR_WSL_DEVICE_NOT_SUPPORTED);
        NAME(CUPTI_ERROR_UNKNOWN);
    default:
        return CUPTI_ERROR_INVALID_PARAMETER;
    }
#undef NAME
    *str = text;
    return CUPTI_SUCCESS;
}
