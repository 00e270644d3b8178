// SPDX-License-Identifier: GPL-2.0
/* Uprobes on the CUDA driver library's entry points. The attach cookie says
 * which function a probe is on and what to read beyond the integer
 * arguments. A call whose duration or result is recorded has an entry and a
 * return probe (on_cuda_entry, on_cuda_return): the call in flight is kept
 * per thread (the driver's entry points do not nest) and handed to user
 * space whole when it returns. A call probed at entry only (on_cuda_call:
 * launches and asynchronous copies by default) costs one trap, not two, and
 * its record is written straight into the ring buffer. Records end before
 * the symbol field unless they carry one.
 *
 * Each program comes twice, with one body: attached one probe at a time
 * (SEC "uprobe", a perf event each) and attached many probes to one link
 * (SEC "uprobe.multi", Linux 6.6 and later). Letting go of a probe waits
 * for the kernel to be sure no CPU still runs it; a link of many probes
 * waits once for all of them, where 54 single probes wait 54 times (about
 * 3 s a process here). User space loads the set the kernel supports. */
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

/* Each thread's call in flight, filled in place: a slot stays with its
 * thread between calls (start_ns 0 when none is in flight), so a call costs
 * a lookup rather than an insert and a delete. Slots of threads gone are
 * the first evicted. */
struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, 16384);
	__type(key, u64); /* pid_tgid */
	__type(value, struct cuda_call);
} inflight SEC(".maps");

/* A zeroed record to make a thread's slot from: too big for the BPF stack. */
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

/* Everything of a call known at its entry, but the symbol. The caller has
 * checked the filters and read `comm`. */
static __always_inline void fill_head(struct pt_regs *ctx, struct cuda_call *call, u64 id,
				      u32 cookie, const char *comm)
{
	call->start_ns = bpf_ktime_get_ns();
	call->end_ns = 0;
	call->pid = id >> 32;
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
	call->reserved = 0;
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
}

/* The reader is woken early only when the buffer fills up; otherwise it
 * drains on its timer, as for scheduler records. */
static __always_inline long wakeup_flags(void)
{
	return bpf_ringbuf_query(&cuda_events, BPF_RB_AVAIL_DATA) > 512 * 1024 ?
		       BPF_RB_FORCE_WAKEUP :
		       BPF_RB_NO_WAKEUP;
}

/* The filters, then the thread's command name (read once for both). */
static __always_inline bool wanted(u64 id, char *comm)
{
	bpf_get_current_comm(comm, COMM_LEN);
	return passes(id >> 32, filter_cgroup ? bpf_get_current_cgroup_id() : 0, comm);
}

static __always_inline int cuda_call(struct pt_regs *ctx)
{
	u64 id = bpf_get_current_pid_tgid();
	char comm[COMM_LEN];
	if (!wanted(id, comm))
		return 0;
	struct cuda_call *call = bpf_ringbuf_reserve(&cuda_events, CUDA_CALL_HEAD_BYTES, 0);
	if (!call) {
		count_loss(LOSS_CUDA_RING);
		return 0;
	}
	fill_head(ctx, call, id, (u32)bpf_get_attach_cookie(ctx), comm);
	bpf_ringbuf_submit(call, wakeup_flags());
	return 0;
}

static __always_inline int cuda_entry(struct pt_regs *ctx)
{
	u64 id = bpf_get_current_pid_tgid();
	char comm[COMM_LEN];
	if (!wanted(id, comm))
		return 0;
	struct cuda_call *call = bpf_map_lookup_elem(&inflight, &id);
	if (!call) {
		u32 zero = 0;
		struct cuda_call *blank = bpf_map_lookup_elem(&scratch, &zero);
		if (!blank)
			return 0;
		bpf_map_update_elem(&inflight, &id, blank, BPF_NOEXIST);
		call = bpf_map_lookup_elem(&inflight, &id);
		if (!call) {
			count_loss(LOSS_CUDA_INFLIGHT);
			return 0;
		}
	}
	u32 cookie = (u32)bpf_get_attach_cookie(ctx);
	fill_head(ctx, call, id, cookie, comm);
	call->symbol[0] = 0;
	if (cookie & CALL_FLAG_SYMBOL_ARG2)
		bpf_probe_read_user_str(call->symbol, SYMBOL_LEN, (void *)call->args[2]);
	return 0;
}

static __always_inline int cuda_return(struct pt_regs *ctx)
{
	u64 id = bpf_get_current_pid_tgid();
	struct cuda_call *call = bpf_map_lookup_elem(&inflight, &id);
	if (!call || call->start_ns == 0)
		return 0;
	u32 cookie = (u32)bpf_get_attach_cookie(ctx);
	if (call->cookie != cookie) {
		/* A return we did not see enter (attached mid-call). */
		call->start_ns = 0;
		return 0;
	}
	call->end_ns = bpf_ktime_get_ns();
	call->result = (s32)PT_REGS_RC(ctx);
	if (cookie & CALL_FLAG_OUT_ARG0)
		bpf_probe_read_user(&call->out_value, sizeof(u64), (void *)call->args[0]);
	/* Two constant sizes rather than one computed: the verifier checks a
	 * constant against the map value. */
	long written = cookie & CALL_FLAG_SYMBOL_ARG2 ?
			       bpf_ringbuf_output(&cuda_events, call, sizeof(*call), wakeup_flags()) :
			       bpf_ringbuf_output(&cuda_events, call, CUDA_CALL_HEAD_BYTES,
						  wakeup_flags());
	if (written)
		count_loss(LOSS_CUDA_RING);
	call->start_ns = 0;
	return 0;
}

SEC("uprobe")
int on_cuda_call(struct pt_regs *ctx)
{
	return cuda_call(ctx);
}

SEC("uprobe")
int on_cuda_entry(struct pt_regs *ctx)
{
	return cuda_entry(ctx);
}

SEC("uretprobe")
int on_cuda_return(struct pt_regs *ctx)
{
	return cuda_return(ctx);
}

SEC("uprobe.multi")
int on_cuda_call_multi(struct pt_regs *ctx)
{
	return cuda_call(ctx);
}

SEC("uprobe.multi")
int on_cuda_entry_multi(struct pt_regs *ctx)
{
	return cuda_entry(ctx);
}

SEC("uretprobe.multi")
int on_cuda_return_multi(struct pt_regs *ctx)
{
	return cuda_return(ctx);
}
