/* A workload with a known scheduling pattern, for the eBPF scheduler tests.
 *
 *   sched_workload SECONDS
 *
 * Thread "dt-spinner" spins 60 ms then sleeps 40 ms; thread "dt-sleeper"
 * spins 5 ms then sleeps 95 ms; the main thread ("dt-main") waits. Prints
 * "ready <pid>" once the threads run, then exits after SECONDS. */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>

static double seconds_now(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return ts.tv_sec + ts.tv_nsec / 1e9;
}

static void spin(double seconds)
{
	double until = seconds_now() + seconds;
	volatile unsigned long sink = 0;
	while (seconds_now() < until)
		sink++;
}

struct pattern {
	const char *name;
	double spin_s;
	double sleep_s;
};

static void *run(void *arg)
{
	const struct pattern *p = arg;
	pthread_setname_np(pthread_self(), p->name);
	for (;;) {
		spin(p->spin_s);
		usleep((useconds_t)(p->sleep_s * 1e6));
	}
	return NULL;
}

int main(int argc, char **argv)
{
	if (argc != 2) {
		fprintf(stderr, "usage: %s SECONDS\n", argv[0]);
		return 2;
	}
	double seconds = atof(argv[1]);
	static struct pattern spinner = {"dt-spinner", 0.060, 0.040};
	static struct pattern sleeper = {"dt-sleeper", 0.005, 0.095};
	pthread_setname_np(pthread_self(), "dt-main");
	pthread_t a, b;
	pthread_create(&a, NULL, run, &spinner);
	pthread_create(&b, NULL, run, &sleeper);
	printf("ready %d\n", (int)getpid());
	fflush(stdout);
	usleep((useconds_t)(seconds * 1e6));
	return 0;
}
