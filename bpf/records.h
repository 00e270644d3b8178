/* Records the BPF programs hand to user space through their ring buffers.
 * src/backend/ebpf/records.rs mirrors these layouts byte for byte and checks
 * the sizes; change both together. */
#ifndef DEVTRACE_RECORDS_H
#define DEVTRACE_RECORDS_H

#define COMM_LEN 16
#define SYMBOL_LEN 96

enum sched_kind {
	SCHED_SWITCH = 1,
	SCHED_WAKEUP = 2,
	SCHED_EXEC = 3,
	SCHED_EXIT = 4,
};

/* Bits of sched_record.matched: which side passed the filters. */
#define MATCH_PREV 1
#define MATCH_NEXT 2

struct sched_record {
	u64 time_ns; /* CLOCK_MONOTONIC */
	u32 kind;
	u32 cpu;
	/* switch: the thread leaving the CPU; wakeup: the waker (current);
	 * exec, exit: the thread itself. */
	u32 prev_tid;
	u32 prev_pid;
	/* switch: the thread taking the CPU; wakeup: the woken thread. */
	u32 next_tid;
	u32 next_pid;
	/* switch: prev's task state as it left (0 = preempted while runnable). */
	u32 prev_state;
	u32 matched;
	char prev_comm[COMM_LEN];
	char next_comm[COMM_LEN];
};

/* Which loss counter (index of the per-CPU `losses` array). */
enum loss_kind {
	LOSS_SCHED_RING = 0,
	LOSS_CUDA_RING = 1,
	LOSS_CUDA_INFLIGHT = 2,
	LOSS_KINDS = 3,
};

/* Driver functions. The attach cookie carries one of these in bits 0-7, the
 * probe's index (which symbol: a function and its per-thread-stream
 * variants share a number) in bits 8-15, and CALL_FLAG_* from bit 16. */
enum cuda_fn {
	FN_LAUNCH_KERNEL = 0,
	FN_LAUNCH_KERNEL_EX = 1,
	FN_MEM_ALLOC = 2,
	FN_MEM_FREE = 3,
	FN_MEMCPY = 4,
	FN_MEMCPY_ASYNC = 5,
	FN_MEMCPY_HTOD = 6,
	FN_MEMCPY_DTOH = 7,
	FN_MEMCPY_DTOD = 8,
	FN_MEMCPY_HTOD_ASYNC = 9,
	FN_MEMCPY_DTOH_ASYNC = 10,
	FN_MEMCPY_DTOD_ASYNC = 11,
	FN_STREAM_SYNCHRONIZE = 12,
	FN_CTX_SYNCHRONIZE = 13,
	FN_EVENT_SYNCHRONIZE = 14,
	FN_MODULE_GET_FUNCTION = 15,
};

/* Read a CUlaunchConfig at argument 0 on entry. */
#define CALL_FLAG_LAUNCH_CONFIG (1u << 16)
/* Read the 64-bit value argument 0 points to on return (an out parameter). */
#define CALL_FLAG_OUT_ARG0 (1u << 17)
/* Read a NUL-terminated string at argument 2 on entry. */
#define CALL_FLAG_SYMBOL_ARG2 (1u << 18)
/* Probed at entry only: the record is written there, with no end time and
 * no result (on_cuda_call). */
#define CALL_FLAG_ENTRY_ONLY (1u << 19)

struct cuda_call {
	u64 start_ns; /* CLOCK_MONOTONIC */
	u64 end_ns;
	u32 pid;
	u32 tid;
	u32 cookie;
	s32 result;
	/* Integer arguments 1 to 9 in order (registers, then the stack). */
	u64 args[9];
	/* CUlaunchConfig: grid x, y, z, block x, y, z, shared bytes. */
	u32 launch[7];
	u32 reserved;
	u64 launch_stream;
	/* What argument 0 pointed to on return (CALL_FLAG_OUT_ARG0). */
	u64 out_value;
	char comm[COMM_LEN];
	char symbol[SYMBOL_LEN];
};

_Static_assert(sizeof(struct sched_record) == 72, "records.rs mirrors this size");
_Static_assert(sizeof(struct cuda_call) == 264, "records.rs mirrors this size");
/* A record without CALL_FLAG_SYMBOL_ARG2 ends before its symbol. */
#define CUDA_CALL_HEAD_BYTES __builtin_offsetof(struct cuda_call, symbol)
_Static_assert(CUDA_CALL_HEAD_BYTES == 168, "records.rs mirrors this size");

#endif
