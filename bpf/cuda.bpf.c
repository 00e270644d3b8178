// SPDX-License-Identifier: GPL-2.0
/* Uprobes on the CUDA driver library's entry points. One entry and one
 * return program serve every function: the attach cookie says which function
 * it is and what to read beyond the integer arguments. A call in flight is
 * kept per thread (the driver's entry points do not nest) and handed to user
 * space whole when it returns. */
#include "kernel_types.h"
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_tracing.h>
#include <bpf/bpf_core_read.h>
#include "records.h"
#include "filter.h"

char LICENSE[] SEC("license") = "GPL";

struct {
	__uint(type, BPF_MAP_TYPE_RINGBUF);
	__uint(max_entries, 4 * 1024 * 1024);
} cuda_events SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 16384);
	__type(key, u64); /* pid_tgid */
	__type(value, struct cuda_call);
} inflight SEC(".maps");

/* Scratch space for building a record: too big for the BPF stack. */
struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 1);
	__type(key, u32);
	__type(value, struct cuda_call);
} scratch SEC(".maps");

/* The CUlaunchConfig fields devtrace reads (cuda.h, CUDA 12). */
struct launch_config {
	u32 grid[3];
	u32 block[3];
	u32 shared_bytes;
	u64 stream;
};

static __always_inline void read_stack_args(struct pt_regs *ctx, u64 *args)
{
#if defined(__TARGET_ARCH_x86)
	/* At the first instruction the stack pointer is at the return address;
	 * arguments 7 to 9 follow it. */
	u64 sp = PT_REGS_SP(ctx);
	bpf_probe_read_user(&args[6], 3 * sizeof(u64), (void *)(sp + 8));
#else
	/* aarch64 passes eight arguments in registers; the ninth is at sp. */
	args[6] = PT_REGS_PARM7(ctx);
	args[7] = PT_REGS_PARM8(ctx);
	bpf_probe_read_user(&args[8], sizeof(u64), (void *)PT_REGS_SP(ctx));
#endif
}

SEC("uprobe")
int on_cuda_entry(struct pt_regs *ctx)
{
	u64 id = bpf_get_current_pid_tgid();
	u32 pid = id >> 32;
	char comm[COMM_LEN];
	bpf_get_current_comm(comm, COMM_LEN);
	if (!passes(pid, filter_cgroup ? bpf_get_current_cgroup_id() : 0, comm))
		return 0;

	u32 zero = 0;
	struct cuda_call *call = bpf_map_lookup_elem(&scratch, &zero);
	if (!call)
		return 0;
	u32 cookie = (u32)bpf_get_attach_cookie(ctx);
	call->start_ns = bpf_ktime_get_ns();
	call->end_ns = 0;
	call->pid = pid;
	call->tid = (u32)id;
	call->cookie = cookie;
	call->result = 0;
	call->args[0] = PT_REGS_PARM1(ctx);
	call->args[1] = PT_REGS_PARM2(ctx);
	call->args[2] = PT_REGS_PARM3(ctx);
	call->args[3] = PT_REGS_PARM4(ctx);
	call->args[4] = PT_REGS_PARM5(ctx);
	call->args[5] = PT_REGS_PARM6(ctx);
	if ((cookie & 0xff) == FN_LAUNCH_KERNEL)
		read_stack_args(ctx, call->args);
	else
		call->args[6] = call->args[7] = call->args[8] = 0;
	__builtin_memset(call->launch, 0, sizeof(call->launch));
	call->launch_stream = 0;
	if (cookie & CALL_FLAG_LAUNCH_CONFIG) {
		struct launch_config config = {};
		if (bpf_probe_read_user(&config, sizeof(config), (void *)call->args[0]) == 0) {
			__builtin_memcpy(call->launch, &config, 7 * sizeof(u32));
			call->launch_stream = config.stream;
		}
	}
	call->out_value = 0;
	__builtin_memcpy(call->comm, comm, COMM_LEN);
	call->symbol[0] = 0;
	if (cookie & CALL_FLAG_SYMBOL_ARG2)
		bpf_probe_read_user_str(call->symbol, SYMBOL_LEN, (void *)call->args[2]);
	if (bpf_map_update_elem(&inflight, &id, call, BPF_ANY))
		count_loss(LOSS_CUDA_INFLIGHT);
	return 0;
}

SEC("uretprobe")
int on_cuda_return(struct pt_regs *ctx)
{
	u64 id = bpf_get_current_pid_tgid();
	struct cuda_call *call = bpf_map_lookup_elem(&inflight, &id);
	if (!call)
		return 0;
	u32 cookie = (u32)bpf_get_attach_cookie(ctx);
	if (call->cookie != cookie) {
		/* A return we did not see enter (attached mid-call). */
		bpf_map_delete_elem(&inflight, &id);
		return 0;
	}
	call->end_ns = bpf_ktime_get_ns();
	call->result = (s32)PT_REGS_RC(ctx);
	if (cookie & CALL_FLAG_OUT_ARG0)
		bpf_probe_read_user(&call->out_value, sizeof(u64), (void *)call->args[0]);
	/* As for scheduler records, the reader is woken early only when the
	 * buffer fills up; otherwise it drains on its timer. */
	long flags = bpf_ringbuf_query(&cuda_events, BPF_RB_AVAIL_DATA) > 512 * 1024 ?
			     BPF_RB_FORCE_WAKEUP :
			     BPF_RB_NO_WAKEUP;
	if (bpf_ringbuf_output(&cuda_events, call, sizeof(*call), flags))
		count_loss(LOSS_CUDA_RING);
	bpf_map_delete_elem(&inflight, &id);
	return 0;
}
