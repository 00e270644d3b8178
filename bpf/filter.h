/* The process filters every devtrace program applies before it records:
 * by process id, by cgroup (v2 id) and by command-name prefix. User space
 * sets them before the object is loaded; a filter left at its zero value is
 * off, and a thread must pass every filter that is on. */
#ifndef DEVTRACE_FILTER_H
#define DEVTRACE_FILTER_H

#define MAX_FILTER_PIDS 1024

const volatile bool filter_pids = false;
const volatile u64 filter_cgroup = 0;
const volatile u32 filter_comm_len = 0;
const volatile char filter_comm[COMM_LEN] = {};

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, MAX_FILTER_PIDS);
	__type(key, u32);
	__type(value, u8);
} pid_filter SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, LOSS_KINDS);
	__type(key, u32);
	__type(value, u64);
} losses SEC(".maps");

static __always_inline void count_loss(u32 kind)
{
	u64 *count = bpf_map_lookup_elem(&losses, &kind);
	if (count)
		*count += 1;
}

static __always_inline bool comm_matches(const char *comm)
{
	for (int i = 0; i < COMM_LEN; i++) {
		if (i >= filter_comm_len)
			break;
		if (comm[i] != filter_comm[i])
			return false;
	}
	return true;
}

/* Whether a thread of process `pid`, named `comm`, in cgroup `cgroup`
 * passes the filters. `comm` must be readable directly (a local copy). */
static __always_inline bool passes(u32 pid, u64 cgroup, const char *comm)
{
	if (pid == 0)
		return false; /* the idle task */
	if (filter_pids && !bpf_map_lookup_elem(&pid_filter, &pid))
		return false;
	if (filter_cgroup && cgroup != filter_cgroup)
		return false;
	if (filter_comm_len && !comm_matches(comm))
		return false;
	return true;
}

static __always_inline u64 task_cgroup(struct task_struct *task)
{
	if (!filter_cgroup)
		return 0;
	return BPF_CORE_READ(task, cgroups, dfl_cgrp, kn, id);
}

#endif
