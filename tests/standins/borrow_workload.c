/*
 * A program for tests of where `devtrace attach` borrows a thread. In the
 * first two modes its only running thread never waits, so the attach must
 * borrow it where it runs; most of its time is spent where borrowing it
 * would harm it, the rest in a plain spin of its own.
 *
 *   malloc: allocates and frees 64 KiB blocks (past malloc's per-thread
 *           cache, so each call takes its arena's lock; a second thread,
 *           parked in pause(), which is not one of the waits an attach
 *           borrows, makes the process multi-threaded so malloc locks at
 *           all). A `dlopen` run from inside malloc waits for ever on that
 *           lock.
 *   rseq:   runs long restartable sequences (glibc's registered struct
 *           rseq, a sequence of its own). Each checks, at its end, that its
 *           descriptor is still set: the kernel clears it only when it
 *           finds the thread outside the sequence, so a thread sent off to
 *           other code from inside one and brought back finds it cleared.
 *   epoll:  a second thread waits in epoll_wait on a pipe nobody writes
 *           to until the end, and counts the calls that fail EINTR (its
 *           signals are blocked, so only a stop can cause one: the kernel
 *           fails epoll_wait after a stop rather than restart it).
 *
 * Build: cc -O2 -Wall -Werror -pthread -o borrow_workload borrow_workload.c -L<dir> -lcuda
 * Run:   borrow_workload malloc|rseq|epoll SECONDS
 * Prints `busy pid=P`; then, for rseq, `sequences guarded` or
 * `sequences unguarded: N` (or `rseq unavailable`); for epoll,
 * `epoll_wait interrupted: N`; then `done`. It loads the stand-in driver
 * (cuInit), so that the attach takes it for a CUDA process. Stops on
 * SIGUSR1, or after SECONDS.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <time.h>
#if __has_include(<sys/rseq.h>)
#include <sys/rseq.h>
#define HAVE_RSEQ 1
#endif
#include <sys/time.h>
#include <unistd.h>

typedef int CUresult;
CUresult cuInit(unsigned int Flags);

static volatile sig_atomic_t stop;

static void on_stop(int signal) {
    (void)signal;
    stop = 1;
}

static void *parked(void *unused) {
    (void)unused;
    for (;;) pause();
    return NULL;
}

/* A plain spin of the program's own: a point where it may be borrowed. */
static void spin(long rounds) {
    for (volatile long i = 0; i < rounds; i++) {
    }
}

static void run_malloc(void) {
    pthread_t thread;
    if (pthread_create(&thread, NULL, parked, NULL) != 0) {
        fprintf(stderr, "borrow_workload: pthread_create failed\n");
        exit(1);
    }
    while (!stop) {
        for (int i = 0; i < 64; i++) {
            char *block = malloc(64 << 10);
            if (!block) abort();
            block[0] = (char)i;
            free(block);
        }
        spin(300);
    }
}

#ifdef HAVE_RSEQ
/* One restartable sequence spinning `rounds` times; answers the
 * descriptor word as read at its end (the sequence's address while
 * guarded), or -1 when the kernel aborted it. */
static long sequence(struct rseq *area, long rounds) {
    long seen;
    __asm__ volatile(
        ".pushsection __rseq_cs, \"aw\"\n"
        ".balign 32\n"
        "3:\n"
        ".long 0x0, 0x0\n"
        ".quad 1f, (2f - 1f), 4f\n"
        ".popsection\n"
        "leaq 3b(%%rip), %%rax\n"
        "movq %%rax, %c[cs](%[area])\n"
        "1:\n"
        "movq %[rounds], %%rcx\n"
        "5:\n"
        "decq %%rcx\n"
        "jnz 5b\n"
        "movq %c[cs](%[area]), %[seen]\n"
        "2:\n"
        "jmp 6f\n"
        ".pushsection __rseq_failure, \"ax\"\n"
        ".byte 0x0f, 0xb9, 0x3d\n"
        ".long 0x53053053\n"
        "4:\n"
        "movq $-1, %[seen]\n"
        "jmp 6f\n"
        ".popsection\n"
        "6:\n"
        : [seen] "=&r"(seen)
        : [area] "r"(area), [cs] "i"(offsetof(struct rseq, rseq_cs)), [rounds] "r"(rounds)
        : "rax", "rcx", "memory", "cc");
    return seen;
}

static void run_rseq(void) {
    if (__rseq_size == 0) {
        printf("rseq unavailable\n");
        return;
    }
    struct rseq *area = (struct rseq *)((char *)__builtin_thread_pointer() + __rseq_offset);
    long unguarded = 0;
    while (!stop) {
        long seen = sequence(area, 400000);
        if (seen == 0) unguarded++;
        area->rseq_cs = 0;
        spin(100000);
    }
    if (unguarded)
        printf("sequences unguarded: %ld\n", unguarded);
    else
        printf("sequences guarded\n");
}
#else
static void run_rseq(void) {
    printf("rseq unavailable\n");
}
#endif

static int wake_pipe[2];

static void *wait_in_epoll(void *unused) {
    (void)unused;
    int epoll = epoll_create1(0);
    struct epoll_event event = {.events = EPOLLIN};
    if (epoll < 0 || epoll_ctl(epoll, EPOLL_CTL_ADD, wake_pipe[0], &event) != 0) abort();
    long interrupted = 0;
    for (;;) {
        struct epoll_event ready;
        int n = epoll_wait(epoll, &ready, 1, -1);
        if (n == 1) break;
        if (n < 0 && errno == EINTR) interrupted++;
    }
    return (void *)interrupted;
}

static void run_epoll(void) {
    sigset_t stops;
    sigemptyset(&stops);
    sigaddset(&stops, SIGUSR1);
    sigaddset(&stops, SIGALRM);
    pthread_t thread;
    /* The waiting thread starts with the stops blocked: they are the main
     * thread's. */
    pthread_sigmask(SIG_BLOCK, &stops, NULL);
    if (pipe(wake_pipe) != 0 || pthread_create(&thread, NULL, wait_in_epoll, NULL) != 0) {
        fprintf(stderr, "borrow_workload: cannot start the waiting thread\n");
        exit(1);
    }
    pthread_sigmask(SIG_UNBLOCK, &stops, NULL);
    while (!stop) spin(100000);
    if (write(wake_pipe[1], "x", 1) != 1) abort();
    /* A waiting thread an attach left stuck must not hang the test. */
    struct timespec limit;
    clock_gettime(CLOCK_REALTIME, &limit);
    limit.tv_sec += 10;
    void *interrupted;
    if (pthread_timedjoin_np(thread, &interrupted, &limit) != 0) {
        printf("epoll_wait thread stuck\n");
        fflush(stdout);
        _exit(1);
    }
    printf("epoll_wait interrupted: %ld\n", (long)interrupted);
}

int main(int argc, char **argv) {
    const char *mode = argc == 3 ? argv[1] : "";
    if (strcmp(mode, "malloc") != 0 && strcmp(mode, "rseq") != 0 && strcmp(mode, "epoll") != 0) {
        fprintf(stderr, "usage: borrow_workload malloc|rseq|epoll SECONDS\n");
        return 2;
    }
    double seconds = atof(argv[2]);
    if (cuInit(0) != 0) {
        fprintf(stderr, "borrow_workload: cuInit failed\n");
        return 1;
    }
    signal(SIGALRM, on_stop);
    signal(SIGUSR1, on_stop);
    struct itimerval timer = {.it_value = {.tv_sec = (time_t)seconds,
                                           .tv_usec = (suseconds_t)((seconds - (time_t)seconds) * 1e6)}};
    setitimer(ITIMER_REAL, &timer, NULL);
    printf("busy pid=%d\n", (int)getpid());
    fflush(stdout);
    if (strcmp(mode, "malloc") == 0)
        run_malloc();
    else if (strcmp(mode, "rseq") == 0)
        run_rseq();
    else
        run_epoll();
    printf("done\n");
    return 0;
}
