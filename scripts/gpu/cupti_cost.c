/*
 * What CUPTI itself charges a CUDA job for each part of a capture, without
 * devtrace: a small library that scripts/gpu/cupti_cost.py loads into its
 * launch loop (ctypes), which turns CUPTI's activity kinds and a Callback
 * API subscriber on and off between phases of the loop. The records CUPTI
 * writes are counted by kind and dropped; the subscriber's callback only
 * counts its calls, so that what a phase costs is CUPTI's alone.
 *
 * A phase starts the way devtrace's injection library starts a capture on
 * a CUPTI attached afresh (the subscriber first, kernels last) and ends the
 * way a capture ends (kernels off first, every buffer flushed, the
 * subscriber gone, then cuptiFinalize, which takes CUPTI's hooks out of
 * the driver). Finalizing from the caller's thread is safe here only
 * because the loop's thread makes the process's CUDA calls and is the one
 * calling; devtrace finalizes from inside a callback instead.
 *
 * The libcupti the process has loaded already is used (a second copy would
 * be a second CUPTI in one process), else the one at the path given (the
 * one the job's environment brings). Built by scripts/gpu-pack against the
 * CUPTI headers of CUDA 13.0, whose types the function pointers take:
 *
 *   cc -shared -fPIC -O2 -Wall -Werror -I<cupti include> -I<cuda include> \
 *      -o libcupti_cost.so cupti_cost.c -ldl
 *
 * Every entry point answers 0 on success and -1 on failure, with
 * cost_error() saying why.
 */
#include <cupti.h>
#include <dlfcn.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define BUFFER_BYTES (8u << 20)
#define MAX_KINDS 64
#define MAX_ENABLED 32

static struct {
    __typeof__(&cuptiActivityRegisterCallbacks) register_callbacks;
    __typeof__(&cuptiActivityEnable) enable;
    __typeof__(&cuptiActivityDisable) disable;
    __typeof__(&cuptiActivityFlushAll) flush_all;
    __typeof__(&cuptiActivityGetNextRecord) next_record;
    __typeof__(&cuptiSubscribe) subscribe;
    __typeof__(&cuptiUnsubscribe) unsubscribe;
    __typeof__(&cuptiEnableDomain) enable_domain;
    /* Optional: only the launches-alone subscriber needs it. */
    __typeof__(&cuptiEnableCallback) enable_callback;
    __typeof__(&cuptiFinalize) finalize;
    __typeof__(&cuptiGetResultString) result_string;
    __typeof__(&cuptiGetVersion) version;
} cupti;

static char error[512];
static _Atomic uint64_t records[MAX_KINDS];
static _Atomic uint64_t callbacks;
static _Atomic uint64_t buffers_failed;
static CUpti_SubscriberHandle subscriber;
static int enabled[MAX_ENABLED];
static int enabled_count;
/* Every entry point resolved (cost_open succeeded). */
static int opened;

static int fail(const char *format, ...) {
    va_list args;
    va_start(args, format);
    vsnprintf(error, sizeof error, format, args);
    va_end(args);
    return -1;
}

/* `what` failed with `result`, in CUPTI's words. */
static int failed(const char *what, CUptiResult result) {
    const char *text = NULL;
    if (cupti.result_string == NULL || cupti.result_string(result, &text) != CUPTI_SUCCESS || !text)
        text = "no description";
    return fail("%s: CUPTI error %d (%s)", what, (int)result, text);
}

static void CUPTIAPI buffer_requested(uint8_t **buffer, size_t *size, size_t *max_records) {
    *buffer = aligned_alloc(8, BUFFER_BYTES);
    *size = *buffer ? BUFFER_BYTES : 0;
    *max_records = 0;
    if (!*buffer)
        atomic_fetch_add(&buffers_failed, 1);
}

static void CUPTIAPI buffer_completed(CUcontext context, uint32_t stream, uint8_t *buffer, size_t size,
                                      size_t valid) {
    (void)context;
    (void)stream;
    (void)size;
    CUpti_Activity *record = NULL;
    while (cupti.next_record(buffer, valid, &record) == CUPTI_SUCCESS) {
        if ((unsigned)record->kind < MAX_KINDS)
            atomic_fetch_add_explicit(&records[record->kind], 1, memory_order_relaxed);
    }
    free(buffer);
}

static void CUPTIAPI on_call(void *userdata, CUpti_CallbackDomain domain, CUpti_CallbackId id,
                             const void *data) {
    (void)userdata;
    (void)domain;
    (void)id;
    (void)data;
    atomic_fetch_add_explicit(&callbacks, 1, memory_order_relaxed);
}

#define RESOLVE(field, symbol)                                                   \
    do {                                                                         \
        *(void **)&cupti.field = dlsym(library, #symbol);                        \
        if (!cupti.field)                                                        \
            return fail("%s has no %s", path, #symbol);                          \
    } while (0)

/* Opens libcupti at `path`; answers its API version in `*version`. */
int cost_open(const char *path, uint32_t *version) {
    static const char *loaded[] = {"libcupti.so.13", "libcupti.so.12", "libcupti.so"};
    void *library = NULL;
    for (size_t i = 0; i < sizeof loaded / sizeof loaded[0] && !library; i++)
        library = dlopen(loaded[i], RTLD_NOW | RTLD_NOLOAD);
    if (!library)
        library = dlopen(path, RTLD_NOW | RTLD_GLOBAL);
    if (!library)
        return fail("cannot open %s: %s", path, dlerror());
    RESOLVE(register_callbacks, cuptiActivityRegisterCallbacks);
    RESOLVE(enable, cuptiActivityEnable);
    RESOLVE(disable, cuptiActivityDisable);
    RESOLVE(flush_all, cuptiActivityFlushAll);
    RESOLVE(next_record, cuptiActivityGetNextRecord);
    RESOLVE(subscribe, cuptiSubscribe);
    RESOLVE(unsubscribe, cuptiUnsubscribe);
    RESOLVE(enable_domain, cuptiEnableDomain);
    *(void **)&cupti.enable_callback = dlsym(library, "cuptiEnableCallback");
    RESOLVE(finalize, cuptiFinalize);
    RESOLVE(result_string, cuptiGetResultString);
    RESOLVE(version, cuptiGetVersion);
    CUptiResult result = cupti.version(version);
    if (result != CUPTI_SUCCESS)
        return failed("cuptiGetVersion", result);
    opened = 1;
    return 0;
}

/* What a phase's subscriber is called at (cost_start's `subscribe`). */
enum { SUBSCRIBE_NONE = 0, SUBSCRIBE_DOMAINS = 1, SUBSCRIBE_LAUNCHES = 2 };

/* The kernel launches, which a subscriber called at these alone sees: what
 * a subscriber costs the calls it is not called at, beside one called at
 * every call of both domains. */
static const struct {
    CUpti_CallbackDomain domain;
    CUpti_CallbackId id;
} launches[] = {
    {CUPTI_CB_DOMAIN_DRIVER_API, CUPTI_DRIVER_TRACE_CBID_cuLaunchKernel},
    {CUPTI_CB_DOMAIN_DRIVER_API, CUPTI_DRIVER_TRACE_CBID_cuLaunchKernelEx},
    {CUPTI_CB_DOMAIN_RUNTIME_API, CUPTI_RUNTIME_TRACE_CBID_cudaLaunchKernel_v7000},
    {CUPTI_CB_DOMAIN_RUNTIME_API, CUPTI_RUNTIME_TRACE_CBID_cudaLaunchKernelExC_v11060},
};

/*
 * Starts a phase: with `subscribe`, a subscriber first, called at every
 * call of the driver and runtime API domains (SUBSCRIBE_DOMAINS) or at the
 * kernel launches alone (SUBSCRIBE_LAUNCHES); then `kinds` in order (give
 * kernels last, as devtrace does).
 */
int cost_start(const int *kinds, int count, int subscribe) {
    if (!opened)
        return fail("cost_open has not succeeded");
    if (count < 0 || count > MAX_ENABLED)
        return fail("%d kinds: at most %d", count, MAX_ENABLED);
    CUptiResult result = cupti.register_callbacks(buffer_requested, buffer_completed);
    if (result != CUPTI_SUCCESS)
        return failed("cuptiActivityRegisterCallbacks", result);
    if (subscribe != SUBSCRIBE_NONE && subscribe != SUBSCRIBE_DOMAINS && subscribe != SUBSCRIBE_LAUNCHES)
        return fail("subscribe %d: 0, 1 or 2", subscribe);
    if (subscribe == SUBSCRIBE_LAUNCHES && !cupti.enable_callback)
        return fail("this libcupti has no cuptiEnableCallback");
    if (subscribe != SUBSCRIBE_NONE) {
        result = cupti.subscribe(&subscriber, (CUpti_CallbackFunc)on_call, NULL);
        if (result != CUPTI_SUCCESS) {
            subscriber = NULL;
            return failed("cuptiSubscribe", result);
        }
    }
    if (subscribe == SUBSCRIBE_DOMAINS) {
        CUpti_CallbackDomain domains[] = {CUPTI_CB_DOMAIN_DRIVER_API, CUPTI_CB_DOMAIN_RUNTIME_API};
        for (size_t i = 0; i < sizeof domains / sizeof domains[0]; i++) {
            result = cupti.enable_domain(1, subscriber, domains[i]);
            if (result != CUPTI_SUCCESS)
                return failed("cuptiEnableDomain", result);
        }
    }
    for (size_t i = 0; subscribe == SUBSCRIBE_LAUNCHES && i < sizeof launches / sizeof launches[0]; i++) {
        result = cupti.enable_callback(1, subscriber, launches[i].domain, launches[i].id);
        if (result != CUPTI_SUCCESS)
            return failed("cuptiEnableCallback", result);
    }
    enabled_count = 0;
    for (int i = 0; i < count; i++) {
        result = cupti.enable((CUpti_ActivityKind)kinds[i]);
        if (result != CUPTI_SUCCESS) {
            char what[64];
            snprintf(what, sizeof what, "cuptiActivityEnable(%d)", kinds[i]);
            return failed(what, result);
        }
        enabled[enabled_count++] = kinds[i];
    }
    return 0;
}

/*
 * Ends a phase: the kinds off in reverse order, every buffer handed back,
 * the subscriber gone, CUPTI finalized. Goes on past a failure, so that
 * CUPTI is detached whenever it can be; answers the first.
 */
int cost_stop(void) {
    if (!opened)
        return fail("cost_open has not succeeded");
    int status = 0;
    CUptiResult result;
    while (enabled_count > 0) {
        result = cupti.disable((CUpti_ActivityKind)enabled[--enabled_count]);
        if (result != CUPTI_SUCCESS && status == 0)
            status = failed("cuptiActivityDisable", result);
    }
    result = cupti.flush_all(CUPTI_ACTIVITY_FLAG_FLUSH_FORCED);
    if (result != CUPTI_SUCCESS && status == 0)
        status = failed("cuptiActivityFlushAll", result);
    if (subscriber) {
        result = cupti.unsubscribe(subscriber);
        subscriber = NULL;
        if (result != CUPTI_SUCCESS && status == 0)
            status = failed("cuptiUnsubscribe", result);
    }
    result = cupti.finalize();
    if (result != CUPTI_SUCCESS && status == 0)
        status = failed("cuptiFinalize", result);
    return status;
}

/* Records of `kind` counted since the library was loaded. */
uint64_t cost_records(int kind) {
    return kind >= 0 && kind < MAX_KINDS ? atomic_load(&records[kind]) : 0;
}

/* Calls of the subscriber's callback since the library was loaded. */
uint64_t cost_callbacks(void) { return atomic_load(&callbacks); }

/* Buffers that could not be given to CUPTI (out of memory). */
uint64_t cost_buffers_failed(void) { return atomic_load(&buffers_failed); }

const char *cost_error(void) { return error; }
