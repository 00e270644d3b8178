/* The few kernel types devtrace's BPF programs read, declared with
 * preserve_access_index so that every field access is relocated against the
 * running kernel's BTF at load time (CO-RE): only the fields named here need
 * to exist, wherever the kernel puts them. This replaces a generated
 * vmlinux.h, which would tie the build to one kernel's headers. */
#ifndef DEVTRACE_KERNEL_TYPES_H
#define DEVTRACE_KERNEL_TYPES_H

/* bpf_tracing.h picks kernel register names when this is defined. */
#define __VMLINUX_H__

typedef unsigned char __u8;
typedef unsigned short __u16;
typedef unsigned int __u32;
typedef unsigned long long __u64;
typedef signed char __s8;
typedef short __s16;
typedef int __s32;
typedef long long __s64;
typedef __u16 __be16;
typedef __u32 __be32;
typedef __u32 __wsum;
typedef __u8 u8;
typedef __u16 u16;
typedef __u32 u32;
typedef __u64 u64;
typedef __s32 s32;
typedef __s64 s64;
typedef _Bool bool;
#define true 1
#define false 0

/* Map types and update flags from the UAPI (stable numbers). */
enum bpf_map_type {
	BPF_MAP_TYPE_HASH = 1,
	BPF_MAP_TYPE_ARRAY = 2,
	BPF_MAP_TYPE_PERCPU_ARRAY = 6,
	BPF_MAP_TYPE_LRU_HASH = 9,
	BPF_MAP_TYPE_RINGBUF = 27,
};
enum {
	BPF_ANY = 0,
	BPF_NOEXIST = 1,
};
enum {
	BPF_RB_NO_WAKEUP = 1,
	BPF_RB_FORCE_WAKEUP = 2,
};
enum {
	BPF_RB_AVAIL_DATA = 0,
};

struct kernfs_node {
	u64 id;
} __attribute__((preserve_access_index));

struct cgroup {
	struct kernfs_node *kn;
} __attribute__((preserve_access_index));

struct css_set {
	struct cgroup *dfl_cgrp;
} __attribute__((preserve_access_index));

struct task_struct {
	int pid;
	int tgid;
	char comm[16];
	struct css_set *cgroups;
} __attribute__((preserve_access_index));

struct linux_binprm {
	const char *filename;
} __attribute__((preserve_access_index));

/* User registers as the kernel saves them on entry: the uprobe context.
 * These layouts are ABI (ptrace), not subject to CO-RE. */
#if defined(__TARGET_ARCH_x86)
struct pt_regs {
	unsigned long r15, r14, r13, r12, bp, bx, r11, r10, r9, r8;
	unsigned long ax, cx, dx, si, di, orig_ax, ip, cs, flags, sp, ss;
};
#elif defined(__TARGET_ARCH_arm64)
struct user_pt_regs {
	u64 regs[31];
	u64 sp;
	u64 pc;
	u64 pstate;
};
struct pt_regs {
	union {
		struct user_pt_regs user_regs;
		struct {
			u64 regs[31];
			u64 sp;
			u64 pc;
			u64 pstate;
		};
	};
	u64 orig_x0;
};
#else
#error "devtrace's BPF programs support x86_64 and aarch64"
#endif

#endif
