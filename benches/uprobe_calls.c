/* Calls one CUDA driver entry point of the stand-in driver in a tight loop
 * and prints the mean nanoseconds per call, so that scripts/bench_uprobes can
 * compare the same program with no probe, with devtrace's uprobes and with
 * bpftrace's on the same function.
 *
 *   uprobe_calls CALLS [WARMUP_MS]   ->  "ns_per_call <mean>"
 *
 * WARMUP_MS of calls come first, untimed, so that a tracer that attaches to
 * the process after it starts (devtrace's injection library) is in place. */
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

typedef int CUresult;
CUresult cuInit(unsigned int flags);
CUresult cuCtxSynchronize(void);

static double now_ns(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return ts.tv_sec * 1e9 + ts.tv_nsec;
}

int main(int argc, char **argv)
{
	long calls = argc > 1 ? atol(argv[1]) : 200000;
	double warmup_ns = argc > 2 ? atof(argv[2]) * 1e6 : 0;
	if (calls <= 0 || cuInit(0) != 0) {
		fprintf(stderr, "usage: uprobe_calls CALLS [WARMUP_MS] (with the stand-in libcuda on the path)\n");
		return 2;
	}
	double start = now_ns();
	while (now_ns() - start < warmup_ns)
		cuCtxSynchronize();
	start = now_ns();
	for (long i = 0; i < calls; i++)
		cuCtxSynchronize();
	printf("ns_per_call %.1f\n", (now_ns() - start) / calls);
	return 0;
}
