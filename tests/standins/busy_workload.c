/*
 * A program whose only running thread never waits, so that `devtrace
 * attach` must borrow it where it runs, for tests of where the attach
 * takes it. Most of its time is spent where borrowing it would harm it;
 * the rest in a plain spin of its own.
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
 *
 * Build: cc -O2 -Wall -Werror -pthread -o busy_workload busy_workload.c -L<dir> -lcuda
 * Run:   busy_workload malloc|rseq SECONDS
 * Prints `busy pid=P`; then, for rseq, `sequences guarded` or
 * `sequences unguarded: N` (or `rseq unavailable`); then `done`. It loads
 * the stand-in driver (cuInit), so that the attach takes it for a CUDA
 * process. Stops on SIGUSR1, or after SECONDS.
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <signal.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/rseq.h>
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
        fprintf(stderr, "busy_workload: pthread_create failed\n");
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

int main(int argc, char **argv) {
    if (argc != 3 || (strcmp(argv[1], "malloc") != 0 && strcmp(argv[1], "rseq") != 0)) {
        fprintf(stderr, "usage: busy_workload malloc|rseq SECONDS\n");
        return 2;
    }
    double seconds = atof(argv[2]);
    if (cuInit(0) != 0) {
        fprintf(stderr, "busy_workload: cuInit failed\n");
        return 1;
    }
    signal(SIGALRM, on_stop);
    signal(SIGUSR1, on_stop);
    struct itimerval timer = {.it_value = {.tv_sec = (time_t)seconds,
                                           .tv_usec = (suseconds_t)((seconds - (time_t)seconds) * 1e6)}};
    setitimer(ITIMER_REAL, &timer, NULL);
    printf("busy pid=%d\n", (int)getpid());
    fflush(stdout);
    if (strcmp(argv[1], "malloc") == 0)
        run_malloc();
    else
        run_rseq();
    printf("done\n");
    return 0;
}
