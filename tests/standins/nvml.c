/*
 * A stand-in for libnvidia-ml.so with the real NVML C ABI (symbol names,
 * argument types, struct layouts of NVML 12), for testing devtrace's NVML
 * backend on machines without an NVIDIA driver.
 *
 * Build: cc -shared -fPIC -O2 -Wall -Werror -o libnvidia-ml.so.1 nvml.c
 * (-DSTANDIN_WITHOUT_EVENTS leaves the event functions out, like an old driver)
 *
 * Values and failures are read on every call from the file named by
 * DEVTRACE_NVML_STANDIN, one `key=value` per line, so a test can change them
 * while the agent runs:
 *   gpus=2  util_gpu=37  util_mem=12  mem_total=42949672960  mem_used=1073741824
 *   power_mw=250000  temp_c=61  sm_clock=1410  mem_clock=1215  pcie_tx=1000
 *   pcie_rx=2000  ecc=0  throttle=0
 *   fail_power=3      (any metric: fail_<metric>=<nvmlReturn_t>, e.g. 3 = NOT_SUPPORTED)
 *   lost_gpu=1        (that GPU answers GPU_IS_LOST to everything)
 *   xid=79  xid_gpu=1 (an XID error: see below)
 *   event_types=11    (the supported-event-types mask; default XID and both ECC kinds)
 *   fail_events=3     (nvmlDeviceGetSupportedEventTypes and nvmlDeviceRegisterEvents)
 *   fail_event_set=3  (nvmlEventSetCreate)
 *
 * nvmlSystemGetDriverVersion writes "580.00-standin" (NVML_ERROR_INSUFFICIENT_SIZE
 * when it does not fit), nvmlSystemGetCudaDriverVersion_v2 13000 (CUDA 13.0).
 *
 * Device count: `gpus=` in that file when present, else $DEVTRACE_STANDIN_GPUS
 * (the physical GPU count the driver stand-in libcuda.c uses), else 2; at
 * most 16. Like the real NVML it ignores CUDA_VISIBLE_DEVICES: index i is
 * physical GPU i.
 *
 * nvmlDeviceGetUUID(device, uuid, length) writes "GPU-" and the 16 bytes
 * STANDIN_GPU_UUID(i) of standin_call.h in lower-case hex, grouped 4-2-2-2-6
 * bytes (GPU i: "GPU-5e7a4d1b-0000-4000-8000-0000000000ii"), the UUID the
 * CUPTI stand-in puts in its DEVICE records; NVML_ERROR_INSUFFICIENT_SIZE
 * when length < 41 (fail key: fail_uuid).
 *
 * Events: an event set delivers one nvmlEventTypeXidCriticalError event of
 * code `xid=` (1 or more) on GPU `xid_gpu=` (default 0) each time either
 * setting changes from what the set last saw, when that GPU is registered
 * with the set for XID events; what the file says when the set is created
 * is the past, as with the real NVML, which only reports events after
 * registration.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "standin_call.h"

typedef int nvmlReturn_t;
enum {
    NVML_SUCCESS = 0,
    NVML_ERROR_UNINITIALIZED = 1,
    NVML_ERROR_INVALID_ARGUMENT = 2,
    NVML_ERROR_NOT_SUPPORTED = 3,
    NVML_ERROR_INSUFFICIENT_SIZE = 7,
    NVML_ERROR_TIMEOUT = 10,
    NVML_ERROR_GPU_IS_LOST = 15,
};

typedef struct nvmlDevice_st { unsigned int index; } *nvmlDevice_t;
typedef struct { unsigned int gpu; unsigned int memory; } nvmlUtilization_t;
typedef struct {
    unsigned int version;
    unsigned long long total;
    unsigned long long reserved;
    unsigned long long free;
    unsigned long long used;
} nvmlMemory_v2_t;

#define MAX_GPUS 16
static struct nvmlDevice_st devices[MAX_GPUS];
static int initialized;

/* Value of `key` in the control file, or `fallback`. */
static long long setting(const char *key, long long fallback) {
    const char *path = getenv("DEVTRACE_NVML_STANDIN");
    if (!path) return fallback;
    FILE *f = fopen(path, "r");
    if (!f) return fallback;
    char line[256];
    size_t n = strlen(key);
    long long value = fallback;
    while (fgets(line, sizeof line, f)) {
        if (strncmp(line, key, n) == 0 && line[n] == '=') value = atoll(line + n + 1);
    }
    fclose(f);
    return value;
}

/* The failure configured for `metric` on `device`, or success. */
static nvmlReturn_t check(nvmlDevice_t device, const char *metric) {
    if (!initialized) return NVML_ERROR_UNINITIALIZED;
    if (!device || device->index >= MAX_GPUS) return NVML_ERROR_INVALID_ARGUMENT;
    if (setting("lost_gpu", -1) == (long long)device->index) return NVML_ERROR_GPU_IS_LOST;
    char key[64];
    snprintf(key, sizeof key, "fail_%s", metric);
    return (nvmlReturn_t)setting(key, NVML_SUCCESS);
}

nvmlReturn_t nvmlInit_v2(void) {
    /* A driver that hangs as it initialises. */
    long long hang_ms = setting("hang_init_ms", 0);
    if (hang_ms > 0) usleep((useconds_t)(hang_ms * 1000));
    if (setting("fail_init", 0)) return (nvmlReturn_t)setting("fail_init", 0);
    for (unsigned i = 0; i < MAX_GPUS; i++) devices[i].index = i;
    initialized = 1;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlSystemGetDriverVersion(char *version, unsigned int length) {
    if (!initialized) return NVML_ERROR_UNINITIALIZED;
    const char *text = "580.00-standin";
    if (length < strlen(text) + 1) return NVML_ERROR_INSUFFICIENT_SIZE;
    memcpy(version, text, strlen(text) + 1);
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlSystemGetCudaDriverVersion_v2(int *cuda_driver_version) {
    if (!initialized) return NVML_ERROR_UNINITIALIZED;
    *cuda_driver_version = 13000;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlInitWithFlags(unsigned int flags) { (void)flags; return nvmlInit_v2(); }
nvmlReturn_t nvmlShutdown(void) { initialized = 0; return NVML_SUCCESS; }

const char *nvmlErrorString(nvmlReturn_t result) {
    switch (result) {
    case NVML_SUCCESS: return "Success";
    case NVML_ERROR_UNINITIALIZED: return "Uninitialized";
    case NVML_ERROR_INVALID_ARGUMENT: return "Invalid Argument";
    case NVML_ERROR_NOT_SUPPORTED: return "Not Supported";
    case NVML_ERROR_GPU_IS_LOST: return "GPU is lost";
    case NVML_ERROR_TIMEOUT: return "Timeout";
    default: return "Unknown Error";
    }
}

nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *count) {
    if (!initialized) return NVML_ERROR_UNINITIALIZED;
    const char *standin_gpus = getenv("DEVTRACE_STANDIN_GPUS");
    long long fallback = standin_gpus && *standin_gpus ? atoll(standin_gpus) : 2;
    long long gpus = setting("gpus", fallback);
    *count = (unsigned int)(gpus < 0 ? 0 : gpus > MAX_GPUS ? MAX_GPUS : gpus);
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int index, nvmlDevice_t *device) {
    unsigned int count;
    nvmlDeviceGetCount_v2(&count);
    if (!initialized) return NVML_ERROR_UNINITIALIZED;
    if (index >= count) return NVML_ERROR_INVALID_ARGUMENT;
    *device = &devices[index];
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetIndex(nvmlDevice_t device, unsigned int *index) {
    nvmlReturn_t r = check(device, "index");
    if (r) return r;
    *index = device->index;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetName(nvmlDevice_t device, char *name, unsigned int length) {
    nvmlReturn_t r = check(device, "name");
    if (r) return r;
    char text[96];
    snprintf(text, sizeof text, "NVIDIA Stand-in H100 #%u", device->index);
    if (strlen(text) + 1 > length) return NVML_ERROR_INSUFFICIENT_SIZE;
    strcpy(name, text);
    return NVML_SUCCESS;
}

/* "GPU-" + 32 hex digits + 4 dashes + NUL. */
#define NVML_UUID_LENGTH 41

nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t device, char *uuid, unsigned int length) {
    nvmlReturn_t r = check(device, "uuid");
    if (r) return r;
    if (!uuid) return NVML_ERROR_INVALID_ARGUMENT;
    if (length < NVML_UUID_LENGTH) return NVML_ERROR_INSUFFICIENT_SIZE;
    const uint8_t b[16] = STANDIN_GPU_UUID(device->index);
    snprintf(uuid, length,
             "GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x",
             b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7], b[8], b[9], b[10], b[11], b[12], b[13], b[14], b[15]);
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetUtilizationRates(nvmlDevice_t device, nvmlUtilization_t *u) {
    nvmlReturn_t r = check(device, "utilization");
    if (r) return r;
    u->gpu = (unsigned int)setting("util_gpu", 37);
    u->memory = (unsigned int)setting("util_mem", 12);
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t device, nvmlMemory_v2_t *m) {
    nvmlReturn_t r = check(device, "memory");
    if (r) return r;
    if (m->version != (sizeof(nvmlMemory_v2_t) | (2u << 24))) return NVML_ERROR_INVALID_ARGUMENT;
    m->total = (unsigned long long)setting("mem_total", 85899345920LL);
    m->used = (unsigned long long)setting("mem_used", 1073741824LL);
    m->reserved = 0;
    m->free = m->total - m->used;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetPowerUsage(nvmlDevice_t device, unsigned int *milliwatts) {
    nvmlReturn_t r = check(device, "power");
    if (r) return r;
    *milliwatts = (unsigned int)setting("power_mw", 250000);
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetTemperature(nvmlDevice_t device, int sensor, unsigned int *celsius) {
    nvmlReturn_t r = check(device, "temperature");
    if (r) return r;
    if (sensor != 0) return NVML_ERROR_INVALID_ARGUMENT;
    *celsius = (unsigned int)setting("temp_c", 61);
    return NVML_SUCCESS;
}

/* Clock types: 0 graphics, 1 SM, 2 memory, 3 video. */
nvmlReturn_t nvmlDeviceGetClockInfo(nvmlDevice_t device, int type, unsigned int *mhz) {
    nvmlReturn_t r = check(device, "clock");
    if (r) return r;
    *mhz = (unsigned int)(type == 2 ? setting("mem_clock", 1215) : setting("sm_clock", 1410));
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetMaxClockInfo(nvmlDevice_t device, int type, unsigned int *mhz) {
    nvmlReturn_t r = check(device, "max_clock");
    if (r) return r;
    *mhz = type == 2 ? 2619 : 1980;
    return NVML_SUCCESS;
}

/* Counters: 0 TX, 1 RX; KB/s. */
nvmlReturn_t nvmlDeviceGetPcieThroughput(nvmlDevice_t device, int counter, unsigned int *kbps) {
    nvmlReturn_t r = check(device, "pcie");
    if (r) return r;
    *kbps = (unsigned int)(counter == 0 ? setting("pcie_tx", 1000) : setting("pcie_rx", 2000));
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetCudaComputeCapability(nvmlDevice_t device, int *major, int *minor) {
    nvmlReturn_t r = check(device, "compute_capability");
    if (r) return r;
    *major = 9;
    *minor = 0;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetNumGpuCores(nvmlDevice_t device, unsigned int *cores) {
    nvmlReturn_t r = check(device, "cores");
    if (r) return r;
    *cores = 16896; /* 132 SMs x 128 */
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetMemoryBusWidth(nvmlDevice_t device, unsigned int *bits) {
    nvmlReturn_t r = check(device, "bus_width");
    if (r) return r;
    *bits = 5120;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetTotalEccErrors(nvmlDevice_t device, int error_type, int counter_type,
                                         unsigned long long *count) {
    nvmlReturn_t r = check(device, "ecc");
    if (r) return r;
    (void)counter_type;
    *count = error_type == 1 ? (unsigned long long)setting("ecc", 0) : 0;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetCurrentClocksThrottleReasons(nvmlDevice_t device,
                                                       unsigned long long *reasons) {
    nvmlReturn_t r = check(device, "throttle");
    if (r) return r;
    *reasons = (unsigned long long)setting("throttle", 0);
    return NVML_SUCCESS;
}

/* GPM (Hopper and newer): device support, samples, metrics between two samples. */
typedef struct { unsigned int version; unsigned int isSupportedDevice; } nvmlGpmSupport_t;
typedef struct nvmlGpmSample_st { unsigned int device; } *nvmlGpmSample_t;
typedef struct {
    unsigned int metricId;
    nvmlReturn_t nvmlReturn;
    double value;
    struct { char *shortName; char *longName; char *unit; } metricInfo;
} nvmlGpmMetric_t;
typedef struct {
    unsigned int version;
    unsigned int numMetrics;
    nvmlGpmSample_t sample1;
    nvmlGpmSample_t sample2;
    nvmlGpmMetric_t metrics[210];
} nvmlGpmMetricsGet_t;

nvmlReturn_t nvmlGpmQueryDeviceSupport(nvmlDevice_t device, nvmlGpmSupport_t *support) {
    nvmlReturn_t r = check(device, "gpm");
    if (r) return r;
    if (support->version != 1) return NVML_ERROR_INVALID_ARGUMENT;
    support->isSupportedDevice = (unsigned int)setting("gpm", 1);
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlGpmSampleAlloc(nvmlGpmSample_t *sample) {
    *sample = calloc(1, sizeof **sample);
    return *sample ? NVML_SUCCESS : NVML_ERROR_INVALID_ARGUMENT;
}

nvmlReturn_t nvmlGpmSampleFree(nvmlGpmSample_t sample) { free(sample); return NVML_SUCCESS; }

nvmlReturn_t nvmlGpmSampleGet(nvmlDevice_t device, nvmlGpmSample_t sample) {
    nvmlReturn_t r = check(device, "gpm");
    if (r) return r;
    sample->device = device->index;
    return NVML_SUCCESS;
}

/* Metric ids: 2 SM util, 3 SM occupancy, 5 any tensor util, 10 DRAM bandwidth util. */
nvmlReturn_t nvmlGpmMetricsGet(nvmlGpmMetricsGet_t *request) {
    if (!initialized) return NVML_ERROR_UNINITIALIZED;
    if (request->version != 1 || !request->sample1 || !request->sample2) return NVML_ERROR_INVALID_ARGUMENT;
    for (unsigned int i = 0; i < request->numMetrics && i < 210; i++) {
        nvmlGpmMetric_t *m = &request->metrics[i];
        m->nvmlReturn = NVML_SUCCESS;
        switch (m->metricId) {
        case 2: m->value = (double)setting("gpm_sm_util", 55); break;
        case 3: m->value = (double)setting("gpm_sm_occupancy", 30); break;
        case 5: m->value = (double)setting("gpm_tensor_util", 20); break;
        case 10: m->value = (double)setting("gpm_dram_util", 40); break;
        default: m->nvmlReturn = NVML_ERROR_NOT_SUPPORTED;
        }
    }
    return NVML_SUCCESS;
}

#ifndef STANDIN_WITHOUT_EVENTS
/*
 * Events, as nvml.h of NVML API version 12 declares them (checked against
 * the header of the nvidia-nvml-dev-cu12 12.9.79 wheel): the event set is
 * an opaque pointer, nvmlEventSetWait is nvmlEventSetWait_v2 under its
 * unversioned name.
 */
#define nvmlEventTypeSingleBitEccError 0x0000000000000001LL
#define nvmlEventTypeDoubleBitEccError 0x0000000000000002LL
#define nvmlEventTypeXidCriticalError 0x0000000000000008LL

typedef struct nvmlEventSet_st {
    unsigned long long registered[MAX_GPUS];
    /* The xid and xid_gpu settings this set last saw. */
    long long seen_xid;
    long long seen_gpu;
} *nvmlEventSet_t;

typedef struct nvmlEventData_st {
    nvmlDevice_t device;
    unsigned long long eventType;
    unsigned long long eventData;
    unsigned int gpuInstanceId;
    unsigned int computeInstanceId;
} nvmlEventData_t;

nvmlReturn_t nvmlEventSetCreate(nvmlEventSet_t *set) {
    if (!initialized) return NVML_ERROR_UNINITIALIZED;
    if (!set) return NVML_ERROR_INVALID_ARGUMENT;
    nvmlReturn_t r = (nvmlReturn_t)setting("fail_event_set", NVML_SUCCESS);
    if (r) return r;
    *set = calloc(1, sizeof **set);
    if (!*set) return NVML_ERROR_INVALID_ARGUMENT;
    (*set)->seen_xid = setting("xid", 0);
    (*set)->seen_gpu = setting("xid_gpu", 0);
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetSupportedEventTypes(nvmlDevice_t device, unsigned long long *eventTypes) {
    nvmlReturn_t r = check(device, "events");
    if (r) return r;
    if (!eventTypes) return NVML_ERROR_INVALID_ARGUMENT;
    *eventTypes = (unsigned long long)setting(
        "event_types",
        nvmlEventTypeSingleBitEccError | nvmlEventTypeDoubleBitEccError | nvmlEventTypeXidCriticalError);
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceRegisterEvents(nvmlDevice_t device, unsigned long long eventTypes,
                                      nvmlEventSet_t set) {
    nvmlReturn_t r = check(device, "events");
    if (r) return r;
    if (!set) return NVML_ERROR_INVALID_ARGUMENT;
    unsigned long long supported;
    nvmlDeviceGetSupportedEventTypes(device, &supported);
    if (eventTypes & ~supported) return NVML_ERROR_NOT_SUPPORTED;
    set->registered[device->index] |= eventTypes;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlEventSetWait_v2(nvmlEventSet_t set, nvmlEventData_t *data, unsigned int timeoutms) {
    if (!initialized) return NVML_ERROR_UNINITIALIZED;
    if (!set || !data) return NVML_ERROR_INVALID_ARGUMENT;
    /* Scripted events are there or not: waiting would not bring one. */
    (void)timeoutms;
    long long xid = setting("xid", 0), gpu = setting("xid_gpu", 0);
    /* No xid (or a file caught while a test rewrites it) is no news. */
    if (xid <= 0 || (xid == set->seen_xid && gpu == set->seen_gpu)) return NVML_ERROR_TIMEOUT;
    set->seen_xid = xid;
    set->seen_gpu = gpu;
    if (gpu < 0 || gpu >= MAX_GPUS || !(set->registered[gpu] & nvmlEventTypeXidCriticalError))
        return NVML_ERROR_TIMEOUT;
    if (setting("lost_gpu", -1) == gpu) return NVML_ERROR_GPU_IS_LOST;
    data->device = &devices[gpu];
    data->eventType = nvmlEventTypeXidCriticalError;
    data->eventData = (unsigned long long)xid;
    data->gpuInstanceId = 0xFFFFFFFFu;
    data->computeInstanceId = 0xFFFFFFFFu;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlEventSetWait(nvmlEventSet_t set, nvmlEventData_t *data, unsigned int timeoutms) {
    return nvmlEventSetWait_v2(set, data, timeoutms);
}

nvmlReturn_t nvmlEventSetFree(nvmlEventSet_t set) {
    if (!initialized) return NVML_ERROR_UNINITIALIZED;
    free(set);
    return NVML_SUCCESS;
}
#endif /* STANDIN_WITHOUT_EVENTS */
