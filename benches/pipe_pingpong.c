/* A context-switch-heavy workload: two processes pass one byte back and
 * forth over two pipes, so every round trip is two wake-ups and two context
 * switches. Prints the round trips and the nanoseconds per round trip.
 *
 * Usage: pipe_pingpong [ROUND_TRIPS] */
#include <stdio.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

static void relay(int in, int out, long rounds, int first) {
    char byte = 0;
    for (long i = 0; i < rounds; i++) {
        if (first && write(out, &byte, 1) != 1) exit(1);
        if (read(in, &byte, 1) != 1) exit(1);
        if (!first && write(out, &byte, 1) != 1) exit(1);
    }
}

int main(int argc, char **argv) {
    long rounds = argc > 1 ? atol(argv[1]) : 100000;
    int ping[2], pong[2];
    if (rounds <= 0 || pipe(ping) || pipe(pong)) return 2;
    pid_t child = fork();
    if (child < 0) return 2;
    if (child == 0) {
        relay(ping[0], pong[1], rounds, 0);
        _exit(0);
    }
    struct timespec start, end;
    clock_gettime(CLOCK_MONOTONIC, &start);
    relay(pong[0], ping[1], rounds, 1);
    clock_gettime(CLOCK_MONOTONIC, &end);
    int status = 0;
    waitpid(child, &status, 0);
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) return 1;
    double ns = (end.tv_sec - start.tv_sec) * 1e9 + (end.tv_nsec - start.tv_nsec);
    printf("%ld %.1f\n", rounds, ns / rounds);
    return 0;
}
