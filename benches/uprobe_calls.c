/* Calls one CUDA driver entry point of the stand-in driver in a tight loop
 * and prints the mean nanoseconds per call, so that scripts/bench-uprobes can
 * compare the same program with no probe, with devtrace's uprobes and with
 * bpftrace's on the same function, and scripts/bench-inject the same program
 * with and without the injection library.
 *
 *   uprobe_calls CALLS [WARMUP_MS [no-context|sync|launch]]   ->  "ns_per_call <mean>"
 *
 * WARMUP_MS of calls come first, untimed, so that a tracer that attaches to
 * the process after it starts (devtrace's injection library) is in place.
 * By default (`no-context`) it calls cuCtxSynchronize with no context (a
 * call that fails at once); `sync` calls it in a context, `launch` calls
 * cuLaunchKernel of a one-kernel module there. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

typedef int CUresult;
typedef int CUdevice;
typedef struct CUctx_st *CUcontext;
typedef struct CUmod_st *CUmodule;
typedef struct CUfunc_st *CUfunction;
typedef struct CUstream_st *CUstream;
CUresult cuInit(unsigned int flags);
CUresult cuDeviceGet(CUdevice *device, int ordinal);
CUresult cuCtxCreate_v2(CUcontext *context, unsigned int flags, CUdevice device);
CUresult cuModuleLoadData(CUmodule *module, const void *image);
CUresult cuModuleGetFunction(CUfunction *function, CUmodule module, const char *name);
CUresult cuCtxSynchronize(void);
CUresult cuLaunchKernel(CUfunction f, unsigned int gx, unsigned int gy, unsigned int gz, unsigned int bx,
                        unsigned int by, unsigned int bz, unsigned int shared, CUstream stream, void **params,
                        void **extra);

static CUfunction kernel;

static double now_ns(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return ts.tv_sec * 1e9 + ts.tv_nsec;
}

static void launch(void)
{
	cuLaunchKernel(kernel, 1, 1, 1, 32, 1, 1, 0, NULL, NULL, NULL);
}

static void synchronize(void)
{
	cuCtxSynchronize();
}

/* A context, and for `launch` the kernel; 0 when set up. */
static int set_up(const char *mode)
{
	if (strcmp(mode, "no-context") == 0)
		return 0;
	CUdevice device;
	CUcontext context;
	CUmodule module;
	if (cuDeviceGet(&device, 0) || cuCtxCreate_v2(&context, 0, device))
		return -1;
	if (strcmp(mode, "launch") != 0)
		return 0;
	if (cuModuleLoadData(&module, "kernel bench_kernel regs=32\n") ||
	    cuModuleGetFunction(&kernel, module, "bench_kernel"))
		return -1;
	return 0;
}

int main(int argc, char **argv)
{
	long calls = argc > 1 ? atol(argv[1]) : 200000;
	double warmup_ns = argc > 2 ? atof(argv[2]) * 1e6 : 0;
	const char *mode = argc > 3 ? argv[3] : "no-context";
	int known = strcmp(mode, "no-context") == 0 || strcmp(mode, "sync") == 0 || strcmp(mode, "launch") == 0;
	if (calls <= 0 || !known || cuInit(0) != 0 || set_up(mode) != 0) {
		fprintf(stderr, "usage: uprobe_calls CALLS [WARMUP_MS [no-context|sync|launch]] (with the stand-in libcuda on the path)\n");
		return 2;
	}
	void (*call)(void) = strcmp(mode, "launch") == 0 ? launch : synchronize;
	double start = now_ns();
	while (now_ns() - start < warmup_ns)
		call();
	start = now_ns();
	for (long i = 0; i < calls; i++)
		call();
	printf("ns_per_call %.1f\n", (now_ns() - start) / calls);
	return 0;
}
