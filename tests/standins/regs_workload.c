/*
 * A program that holds known values in its registers while `devtrace
 * attach` borrows its only thread, for tests of the attach's register save
 * and restore: every general register the compiler lets it have, all
 * sixteen ymm registers (upper halves included) and the direction flag are
 * set to patterns, the thread spins in user code (no system call) until
 * SIGALRM says SECONDS have passed (the kernel restores every register
 * after the handler), then the values are compared with the patterns.
 *
 * Build: cc -O2 -Wall -Werror -mavx -o regs_workload regs_workload.c -L<dir> -lcuda
 * Run:   regs_workload SECONDS
 * Prints `spinning pid=P`, then `registers intact` or
 * `registers clobbered: ...`, then `done`. It loads the stand-in driver
 * (cuInit), so that the attach takes it for a CUDA process.
 */
#define _GNU_SOURCE
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <signal.h>
#include <sys/time.h>
#include <time.h>
#include <unistd.h>

typedef int CUresult;
CUresult cuInit(unsigned int Flags);

/* Read and written by name from the assembly below. */
uint64_t regs_gpr_patterns[12];
uint64_t regs_gpr_seen[12];
uint8_t regs_ymm_patterns[16 * 32] __attribute__((aligned(32)));
uint8_t regs_ymm_seen[16 * 32] __attribute__((aligned(32)));
/* Set by SIGALRM once SECONDS have passed (the spin reads no clock: a TSC
 * differs between the CPUs of some virtual machines). */
volatile int regs_stop;
uint64_t regs_flags_seen;

static const char *GPR_NAMES[12] = {"rbx", "rcx", "rsi", "rdi", "r8",  "r9",
                                    "r10", "r11", "r12", "r13", "r14", "r15"};

static void on_alarm(int signal) {
    (void)signal;
    regs_stop = 1;
}

int main(int argc, char **argv) {
    double seconds = argc > 1 ? atof(argv[1]) : 3.0;
    if (cuInit(0) != 0) {
        fprintf(stderr, "regs_workload: cuInit failed\n");
        return 1;
    }
    for (int i = 0; i < 12; i++) regs_gpr_patterns[i] = 0x0101010101010101ull * (uint64_t)(i + 1) ^ 0x8000000000000001ull;
    for (int i = 0; i < 16 * 32; i++) regs_ymm_patterns[i] = (uint8_t)(i * 7 + 3);
    signal(SIGALRM, on_alarm);
    struct itimerval timer = {.it_value = {.tv_sec = (time_t)seconds,
                                           .tv_usec = (suseconds_t)((seconds - (time_t)seconds) * 1e6)}};
    setitimer(ITIMER_REAL, &timer, NULL);
    printf("spinning pid=%d\n", (int)getpid());
    fflush(stdout);
    __asm__ volatile(
        "mov regs_gpr_patterns+0(%%rip), %%rbx\n"
        "mov regs_gpr_patterns+8(%%rip), %%rcx\n"
        "mov regs_gpr_patterns+16(%%rip), %%rsi\n"
        "mov regs_gpr_patterns+24(%%rip), %%rdi\n"
        "mov regs_gpr_patterns+32(%%rip), %%r8\n"
        "mov regs_gpr_patterns+40(%%rip), %%r9\n"
        "mov regs_gpr_patterns+48(%%rip), %%r10\n"
        "mov regs_gpr_patterns+56(%%rip), %%r11\n"
        "mov regs_gpr_patterns+64(%%rip), %%r12\n"
        "mov regs_gpr_patterns+72(%%rip), %%r13\n"
        "mov regs_gpr_patterns+80(%%rip), %%r14\n"
        "mov regs_gpr_patterns+88(%%rip), %%r15\n"
        "vmovdqu regs_ymm_patterns+0(%%rip), %%ymm0\n"
        "vmovdqu regs_ymm_patterns+32(%%rip), %%ymm1\n"
        "vmovdqu regs_ymm_patterns+64(%%rip), %%ymm2\n"
        "vmovdqu regs_ymm_patterns+96(%%rip), %%ymm3\n"
        "vmovdqu regs_ymm_patterns+128(%%rip), %%ymm4\n"
        "vmovdqu regs_ymm_patterns+160(%%rip), %%ymm5\n"
        "vmovdqu regs_ymm_patterns+192(%%rip), %%ymm6\n"
        "vmovdqu regs_ymm_patterns+224(%%rip), %%ymm7\n"
        "vmovdqu regs_ymm_patterns+256(%%rip), %%ymm8\n"
        "vmovdqu regs_ymm_patterns+288(%%rip), %%ymm9\n"
        "vmovdqu regs_ymm_patterns+320(%%rip), %%ymm10\n"
        "vmovdqu regs_ymm_patterns+352(%%rip), %%ymm11\n"
        "vmovdqu regs_ymm_patterns+384(%%rip), %%ymm12\n"
        "vmovdqu regs_ymm_patterns+416(%%rip), %%ymm13\n"
        "vmovdqu regs_ymm_patterns+448(%%rip), %%ymm14\n"
        "vmovdqu regs_ymm_patterns+480(%%rip), %%ymm15\n"
        "std\n"
        "1:\n"
        "pause\n"
        "cmpl $0, regs_stop(%%rip)\n"
        "je 1b\n"
        "pushfq\n"
        "pop %%rax\n"
        "cld\n"
        "mov %%rax, regs_flags_seen(%%rip)\n"
        "mov %%rbx, regs_gpr_seen+0(%%rip)\n"
        "mov %%rcx, regs_gpr_seen+8(%%rip)\n"
        "mov %%rsi, regs_gpr_seen+16(%%rip)\n"
        "mov %%rdi, regs_gpr_seen+24(%%rip)\n"
        "mov %%r8, regs_gpr_seen+32(%%rip)\n"
        "mov %%r9, regs_gpr_seen+40(%%rip)\n"
        "mov %%r10, regs_gpr_seen+48(%%rip)\n"
        "mov %%r11, regs_gpr_seen+56(%%rip)\n"
        "mov %%r12, regs_gpr_seen+64(%%rip)\n"
        "mov %%r13, regs_gpr_seen+72(%%rip)\n"
        "mov %%r14, regs_gpr_seen+80(%%rip)\n"
        "mov %%r15, regs_gpr_seen+88(%%rip)\n"
        "vmovdqu %%ymm0, regs_ymm_seen+0(%%rip)\n"
        "vmovdqu %%ymm1, regs_ymm_seen+32(%%rip)\n"
        "vmovdqu %%ymm2, regs_ymm_seen+64(%%rip)\n"
        "vmovdqu %%ymm3, regs_ymm_seen+96(%%rip)\n"
        "vmovdqu %%ymm4, regs_ymm_seen+128(%%rip)\n"
        "vmovdqu %%ymm5, regs_ymm_seen+160(%%rip)\n"
        "vmovdqu %%ymm6, regs_ymm_seen+192(%%rip)\n"
        "vmovdqu %%ymm7, regs_ymm_seen+224(%%rip)\n"
        "vmovdqu %%ymm8, regs_ymm_seen+256(%%rip)\n"
        "vmovdqu %%ymm9, regs_ymm_seen+288(%%rip)\n"
        "vmovdqu %%ymm10, regs_ymm_seen+320(%%rip)\n"
        "vmovdqu %%ymm11, regs_ymm_seen+352(%%rip)\n"
        "vmovdqu %%ymm12, regs_ymm_seen+384(%%rip)\n"
        "vmovdqu %%ymm13, regs_ymm_seen+416(%%rip)\n"
        "vmovdqu %%ymm14, regs_ymm_seen+448(%%rip)\n"
        "vmovdqu %%ymm15, regs_ymm_seen+480(%%rip)\n"
        "vzeroupper\n"
        :
        :
        : "rax", "rbx", "rcx", "rdx", "rsi", "rdi", "r8", "r9", "r10", "r11", "r12", "r13", "r14",
          "r15", "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9",
          "xmm10", "xmm11", "xmm12", "xmm13", "xmm14", "xmm15", "memory", "cc");
    char problems[2048] = "";
    for (int i = 0; i < 12; i++) {
        if (regs_gpr_seen[i] != regs_gpr_patterns[i]) {
            size_t n = strlen(problems);
            snprintf(problems + n, sizeof problems - n, " %s=%#llx", GPR_NAMES[i],
                     (unsigned long long)regs_gpr_seen[i]);
        }
    }
    for (int r = 0; r < 16; r++) {
        if (memcmp(regs_ymm_seen + r * 32, regs_ymm_patterns + r * 32, 32) != 0) {
            size_t n = strlen(problems);
            snprintf(problems + n, sizeof problems - n, " ymm%d", r);
        }
    }
    if (!(regs_flags_seen & (1u << 10))) {
        size_t n = strlen(problems);
        snprintf(problems + n, sizeof problems - n, " direction-flag");
    }
    if (problems[0])
        printf("registers clobbered:%s\n", problems);
    else
        printf("registers intact\n");
    printf("done\n");
    fflush(stdout);
    return 0;
}
