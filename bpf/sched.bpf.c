// SPDX-License-Identifier: GPL-2.0
/* Scheduler events for the whole host: every context switch (which thread
 * left which CPU and in what state, which one took it), wakeups, exec and
 * exit. User space turns them into per-CPU lines and per-thread off-CPU
 * time. Switches are recorded when either side passes the filters. */
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
} sched_events SEC(".maps");

/* Waking the reader for every switch would make the reader's own switches
 * the busiest thing on the host; it polls on a timer instead, and is woken
 * early only when the buffer fills past this. */
#define WAKEUP_BYTES (512 * 1024)

static __always_inline long submit_flags(void)
{
	return bpf_ringbuf_query(&sched_events, BPF_RB_AVAIL_DATA) > WAKEUP_BYTES ?
		       BPF_RB_FORCE_WAKEUP :
		       BPF_RB_NO_WAKEUP;
}

/* A record to fill, or NULL (counted as lost) when the buffer is full. */
static __always_inline struct sched_record *reserve(void)
{
	struct sched_record *record = bpf_ringbuf_reserve(&sched_events, sizeof(*record), 0);
	if (!record)
		count_loss(LOSS_SCHED_RING);
	return record;
}

static __always_inline u32 task_matches(struct task_struct *task, const char *comm)
{
	return passes(BPF_CORE_READ(task, tgid), task_cgroup(task), comm);
}

static __always_inline void fill_side(struct task_struct *task, u32 *tid, u32 *pid, char *comm)
{
	*tid = BPF_CORE_READ(task, pid);
	*pid = BPF_CORE_READ(task, tgid);
	bpf_probe_read_kernel_str(comm, COMM_LEN, &task->comm);
}

SEC("tp_btf/sched_switch")
int BPF_PROG(on_sched_switch, bool preempt, struct task_struct *prev, struct task_struct *next,
	     unsigned int prev_state)
{
	struct sched_record *record = reserve();
	if (!record)
		return 0;
	record->time_ns = bpf_ktime_get_ns();
	record->kind = SCHED_SWITCH;
	record->cpu = bpf_get_smp_processor_id();
	fill_side(prev, &record->prev_tid, &record->prev_pid, record->prev_comm);
	fill_side(next, &record->next_tid, &record->next_pid, record->next_comm);
	record->prev_state = prev_state;
	record->matched = (task_matches(prev, record->prev_comm) ? MATCH_PREV : 0) |
			  (task_matches(next, record->next_comm) ? MATCH_NEXT : 0);
	if (!record->matched) {
		bpf_ringbuf_discard(record, BPF_RB_NO_WAKEUP);
		return 0;
	}
	bpf_ringbuf_submit(record, submit_flags());
	return 0;
}

SEC("tp_btf/sched_wakeup")
int BPF_PROG(on_sched_wakeup, struct task_struct *woken)
{
	char comm[COMM_LEN];
	bpf_probe_read_kernel_str(comm, COMM_LEN, &woken->comm);
	if (!task_matches(woken, comm))
		return 0;
	struct sched_record *record = reserve();
	if (!record)
		return 0;
	record->time_ns = bpf_ktime_get_ns();
	record->kind = SCHED_WAKEUP;
	record->cpu = bpf_get_smp_processor_id();
	u64 current = bpf_get_current_pid_tgid();
	record->prev_tid = (u32)current;
	record->prev_pid = current >> 32;
	bpf_get_current_comm(record->prev_comm, COMM_LEN);
	fill_side(woken, &record->next_tid, &record->next_pid, record->next_comm);
	record->prev_state = 0;
	record->matched = MATCH_NEXT;
	bpf_ringbuf_submit(record, submit_flags());
	return 0;
}

static __always_inline int record_self(struct task_struct *task, u32 kind)
{
	char comm[COMM_LEN];
	bpf_probe_read_kernel_str(comm, COMM_LEN, &task->comm);
	if (!task_matches(task, comm))
		return 0;
	struct sched_record *record = reserve();
	if (!record)
		return 0;
	record->time_ns = bpf_ktime_get_ns();
	record->kind = kind;
	record->cpu = bpf_get_smp_processor_id();
	fill_side(task, &record->prev_tid, &record->prev_pid, record->prev_comm);
	record->next_tid = record->prev_tid;
	record->next_pid = record->prev_pid;
	__builtin_memcpy(record->next_comm, record->prev_comm, COMM_LEN);
	record->prev_state = 0;
	record->matched = MATCH_PREV;
	bpf_ringbuf_submit(record, submit_flags());
	return 0;
}

SEC("tp_btf/sched_process_exec")
int BPF_PROG(on_sched_process_exec, struct task_struct *task, int old_pid, struct linux_binprm *bprm)
{
	return record_self(task, SCHED_EXEC);
}

SEC("tp_btf/sched_process_exit")
int BPF_PROG(on_sched_process_exit, struct task_struct *task)
{
	return record_self(task, SCHED_EXIT);
}
