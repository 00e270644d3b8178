/*
 * Runs scripts/gpu/cupti_cost.c (check l's probe of plain CUPTI) against
 * the stand-in driver and CUPTI, through phases as cupti_cost.py runs them
 * on a GPU: kernels alone, kernels with a subscriber, devtrace's capture
 * kinds, and plain launches after each finalize. Each phase's kernels must
 * all be recorded, the subscriber called for each call of its phase alone,
 * and nothing recorded once CUPTI is finalized.
 *
 *   cupti_cost_check PROBE.so LIBCUPTI
 *
 * Exits 0 with a line per phase, or 1 naming what went wrong.
 */
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

typedef int CUresult;
typedef int CUdevice;
typedef struct CUctx_st *CUcontext;
typedef struct CUmod_st *CUmodule;
typedef struct CUfunc_st *CUfunction;
typedef struct CUstream_st *CUstream;

CUresult cuInit(unsigned int flags);
CUresult cuDeviceGet(CUdevice *device, int ordinal);
CUresult cuCtxCreate_v2(CUcontext *context, unsigned int flags, CUdevice device);
CUresult cuCtxSynchronize(void);
CUresult cuModuleLoadData(CUmodule *module, const void *image);
CUresult cuModuleGetFunction(CUfunction *function, CUmodule module, const char *name);
CUresult cuLaunchKernel(CUfunction f, unsigned int gridX, unsigned int gridY, unsigned int gridZ,
                        unsigned int blockX, unsigned int blockY, unsigned int blockZ, unsigned int shared,
                        CUstream stream, void **params, void **extra);

enum { CONCURRENT_KERNEL = 10 };

static int (*cost_open)(const char *, uint32_t *);
static int (*cost_start)(const int *, int, int);
static int (*cost_stop)(void);
static uint64_t (*cost_records)(int);
static uint64_t (*cost_callbacks)(void);
static const char *(*cost_error)(void);

static CUfunction kernel;

static void die(const char *what) {
    fprintf(stderr, "cupti_cost_check: %s\n", what);
    exit(1);
}

static void probe_call(int status, const char *what) {
    if (status != 0) {
        fprintf(stderr, "cupti_cost_check: %s: %s\n", what, cost_error());
        exit(1);
    }
}

static void launch(int count) {
    for (int i = 0; i < count; i++)
        if (cuLaunchKernel(kernel, 1, 1, 1, 32, 1, 1, 0, NULL, NULL, NULL) != 0)
            die("cuLaunchKernel failed");
    if (cuCtxSynchronize() != 0)
        die("cuCtxSynchronize failed");
}

/* Launches `count` kernels in a phase of `kinds` and checks what was counted. */
static void phase(const char *name, const int *kinds, int n, int subscribe, int count) {
    uint64_t kernels = cost_records(CONCURRENT_KERNEL), calls = cost_callbacks();
    probe_call(cost_start(kinds, n, subscribe), name);
    launch(count);
    probe_call(cost_stop(), name);
    uint64_t recorded = cost_records(CONCURRENT_KERNEL) - kernels, called = cost_callbacks() - calls;
    printf("%s: %llu of %d kernels recorded, %llu subscriber calls\n", name, (unsigned long long)recorded, count,
           (unsigned long long)called);
    if (recorded != (uint64_t)count)
        die("a phase's kernels were not all recorded");
    /* An entry and an exit for each launch and the synchronize at least. */
    if (subscribe ? called < 2 * (uint64_t)(count + 1) : called != 0)
        die("the subscriber was called outside its phase, or not for each call");
    /* Finalized: launches cost and record nothing more. */
    kernels = cost_records(CONCURRENT_KERNEL);
    calls = cost_callbacks();
    launch(count);
    if (cost_records(CONCURRENT_KERNEL) != kernels || cost_callbacks() != calls)
        die("CUPTI still recorded after the finalize");
}

#define RESOLVE(symbol)                                        \
    do {                                                       \
        *(void **)&symbol = dlsym(probe, #symbol);             \
        if (!symbol)                                           \
            die("the probe has no " #symbol);                  \
    } while (0)

int main(int argc, char **argv) {
    if (argc != 3)
        die("usage: cupti_cost_check PROBE.so LIBCUPTI");
    void *probe = dlopen(argv[1], RTLD_NOW);
    if (!probe)
        die(dlerror());
    RESOLVE(cost_open);
    RESOLVE(cost_start);
    RESOLVE(cost_stop);
    RESOLVE(cost_records);
    RESOLVE(cost_callbacks);
    RESOLVE(cost_error);

    CUdevice device;
    CUcontext context;
    CUmodule module;
    if (cuInit(0) || cuDeviceGet(&device, 0) || cuCtxCreate_v2(&context, 0, device))
        die("no stand-in context");
    if (cuModuleLoadData(&module, "kernel vector_add regs=32 static_smem=0\n") ||
        cuModuleGetFunction(&kernel, module, "vector_add"))
        die("no stand-in kernel");
    uint32_t version = 0;
    probe_call(cost_open(argv[2], &version), "cost_open");
    printf("CUPTI API version %u\n", version);

    const int kernels[] = {CONCURRENT_KERNEL};
    /* devtrace's capture kinds, kernels last. */
    const int capture[] = {8, 9, 1, 2, 49, 17, 38, 12, CONCURRENT_KERNEL};
    phase("kernels", kernels, 1, 0, 100);
    phase("kernels+subscriber", kernels, 1, 1, 50);
    phase("capture", capture, sizeof capture / sizeof capture[0], 0, 20);
    phase("kernels again", kernels, 1, 0, 10);
    printf("ok\n");
    return 0;
}
