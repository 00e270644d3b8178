//! Kernel checks: whether the eBPF backend's programs can load and attach
//! (BPF programs built in, BTF, capabilities, lockdown, the uprobe PMU and
//! a real `bpf()` program load), whether perf counters open as the perf
//! backend opens them, and the clock source every timestamp is read from.

use perf_event::events::{Hardware, Software};

use super::{Area, Finding, Status};

/// What the kernel checks need to know of the agent's flags.
pub struct KernelPlan {
    pub ebpf_sched: bool,
    pub ebpf_cuda: bool,
}

pub fn check(plan: &KernelPlan) -> Vec<Finding> {
    let mut findings = vec![kernel_release()];
    findings.extend(ebpf(plan));
    findings.extend(perf());
    findings.push(clock_source());
    findings
}

fn kernel_release() -> Finding {
    let release = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    Finding::new(
        Area::Ebpf,
        "kernel",
        Status::Ok,
        format!("Linux {}", release.trim()),
    )
}

/// The capabilities this process holds.
fn effective_capabilities() -> u64 {
    crate::model::host_process::credentials(std::process::id())
        .map_or(0, |credentials| credentials.effective_capabilities)
}

const CAP_SYS_ADMIN: u32 = 21;
const CAP_PERFMON: u32 = 38;
const CAP_BPF: u32 = 39;

fn has(capabilities: u64, capability: u32) -> bool {
    capabilities & (1 << capability) != 0
}

/// The lockdown mode in force (`[integrity]` of `none integrity
/// confidentiality`), when the kernel has the LSM.
fn lockdown() -> Option<String> {
    let text = std::fs::read_to_string("/sys/kernel/security/lockdown").ok()?;
    let start = text.find('[')? + 1;
    let end = start + text[start..].find(']')?;
    Some(text[start..end].to_string())
}

fn ebpf(plan: &KernelPlan) -> Vec<Finding> {
    let mut findings = Vec::new();
    let item = |name: &str| format!("eBPF {name}");
    // What the backend itself checks before loading anything.
    findings.push(
        match crate::backend::ebpf::preflight(plan.ebpf_sched, plan.ebpf_cuda) {
            Ok(()) => Finding::new(
                Area::Ebpf,
                item("preflight"),
                Status::Ok,
                format!("BPF programs built in, hooks on, BTF at {}", crate::backend::ebpf::BTF),
            ),
            Err(reason) => Finding::new(Area::Ebpf, item("preflight"), Status::Fail, reason)
                .hint("--ebpf-hooks turns the hooks on; a kernel with CONFIG_DEBUG_INFO_BTF=y has BTF (every major distribution's since 2021)"),
        },
    );
    let capabilities = effective_capabilities();
    let enough = has(capabilities, CAP_SYS_ADMIN)
        || (has(capabilities, CAP_BPF) && has(capabilities, CAP_PERFMON));
    if enough {
        findings.push(Finding::new(
            Area::Ebpf,
            item("capabilities"),
            Status::Ok,
            "CAP_BPF and CAP_PERFMON (or CAP_SYS_ADMIN) held",
        ));
    } else {
        findings.push(
            Finding::new(Area::Ebpf, item("capabilities"), Status::Fail, format!("this process lacks CAP_BPF and CAP_PERFMON (CapEff {capabilities:#x})"))
                .hint("run the agent as root, or grant CAP_BPF and CAP_PERFMON, and CAP_SYS_ADMIN and CAP_SYS_PTRACE for the CUDA uprobes (deploy/systemd/devtrace.service and the DaemonSet list what each is for)"),
        );
    }
    if enough && plan.ebpf_cuda && !has(capabilities, CAP_SYS_ADMIN) {
        findings.push(
            Finding::new(
                Area::Ebpf,
                item("uprobe capabilities"),
                Status::Warn,
                "no CAP_SYS_ADMIN: Linux 6.16 and the stable kernels that took its uprobe change refuse uprobes without it, so the CUDA driver's calls may go unprobed",
            )
            .hint("grant CAP_SYS_ADMIN, or --ebpf-hooks sched"),
        );
    }
    match lockdown().as_deref() {
        Some("confidentiality") => findings.push(
            Finding::new(Area::Ebpf, item("lockdown"), Status::Fail, "kernel lockdown is confidentiality: BPF programs cannot read kernel or process memory")
                .hint("boot with lockdown=integrity or none (Secure Boot may set it)"),
        ),
        Some(mode) => findings.push(Finding::new(Area::Ebpf, item("lockdown"), Status::Ok, format!("lockdown {mode}"))),
        None => findings.push(Finding::new(Area::Ebpf, item("lockdown"), Status::Ok, "no lockdown LSM")),
    }
    if plan.ebpf_cuda {
        if std::path::Path::new("/sys/bus/event_source/devices/uprobe/type").exists() {
            findings.push(Finding::new(
                Area::Ebpf,
                item("uprobes"),
                Status::Ok,
                "the uprobe PMU is there",
            ));
        } else {
            findings.push(
                Finding::new(Area::Ebpf, item("uprobes"), Status::Fail, "no uprobe PMU (/sys/bus/event_source/devices/uprobe is missing): the CUDA driver's calls cannot be probed")
                    .hint("use a kernel with CONFIG_UPROBE_EVENTS=y, or --ebpf-hooks sched"),
            );
        }
        if let Some(linking) = enough.then(crate::backend::ebpf::probe_linking).flatten() {
            findings.push(Finding::new(
                Area::Ebpf,
                item("uprobe links"),
                Status::Ok,
                format!("the CUDA driver's probes: {linking}"),
            ));
        }
    }
    if enough {
        findings.push(program_load());
    }
    findings
}

/// Loads a trivial program of each kind the backend uses, as the backend
/// would: this is where seccomp, a container runtime or a sysctl says no.
fn program_load() -> Finding {
    let kinds = [
        (libbpf_rs::libbpf_sys::BPF_PROG_TYPE_KPROBE, "uprobe"),
        (
            libbpf_rs::libbpf_sys::BPF_PROG_TYPE_TRACEPOINT,
            "tracepoint",
        ),
    ];
    let mut refused = Vec::new();
    for (kind, name) in kinds {
        // SAFETY: libbpf loads a two-instruction program and closes it.
        let answer =
            unsafe { libbpf_rs::libbpf_sys::libbpf_probe_bpf_prog_type(kind, std::ptr::null()) };
        if answer != 1 {
            let why = if answer < 0 {
                std::io::Error::from_raw_os_error(-answer).to_string()
            } else {
                "not supported".into()
            };
            refused.push(format!("{name} programs: {why}"));
        }
    }
    if refused.is_empty() {
        Finding::new(
            Area::Ebpf,
            "eBPF program load",
            Status::Ok,
            "the kernel loaded a uprobe and a tracepoint program",
        )
    } else {
        Finding::new(Area::Ebpf, "eBPF program load", Status::Fail, format!("the kernel refused {}", refused.join(", ")))
            .hint("in a container, allow bpf() (seccomp) and run privileged or with CAP_BPF; on a host, check kernel.unprivileged_bpf_disabled only matters for non-root")
    }
}

fn perf() -> Vec<Finding> {
    let paranoid = std::fs::read_to_string("/proc/sys/kernel/perf_event_paranoid")
        .map(|text| text.trim().to_string())
        .unwrap_or_else(|_| "unknown".into());
    let mut findings = Vec::new();
    match crate::backend::perf::open(Software::CPU_CLOCK.into(), Some(0), None) {
        Ok(_) => findings.push(Finding::new(
            Area::Perf,
            "perf counters",
            Status::Ok,
            format!("a per-CPU counter opened (perf_event_paranoid {paranoid})"),
        )),
        Err(error) => {
            findings.push(
                Finding::new(Area::Perf, "perf counters", Status::Fail, format!("a per-CPU counter cannot be opened: {error} (perf_event_paranoid {paranoid})"))
                    .hint("run the agent as root (or with CAP_PERFMON), or set kernel.perf_event_paranoid to 0"),
            );
            return findings;
        }
    }
    match crate::backend::perf::open(Hardware::CPU_CYCLES.into(), Some(0), None) {
        Ok(_) => findings.push(Finding::new(Area::Perf, "hardware counters", Status::Ok, "cycles and instructions are counted")),
        Err(error) => findings.push(Finding::new(
            Area::Perf,
            "hardware counters",
            Status::Warn,
            format!("no CPU cycle counter ({error}): a virtual machine without a virtual PMU; the software counters are recorded alone"),
        )),
    }
    findings
}

/// Clock sources the kernel reads without a system call (through the
/// vDSO): each event's timestamp costs nanoseconds, not a microsecond.
const FAST_CLOCKS: [&str; 3] = ["tsc", "kvm-clock", "arch_sys_counter"];

fn clock_source() -> Finding {
    let path = "/sys/devices/system/clocksource/clocksource0/current_clocksource";
    match std::fs::read_to_string(path) {
        Ok(source) if FAST_CLOCKS.contains(&source.trim()) => {
            Finding::new(Area::Agent, "clock source", Status::Ok, source.trim().to_string())
        }
        Ok(source) => Finding::new(
            Area::Agent,
            "clock source",
            Status::Warn,
            format!("{}: every timestamp is a system call, so tracing costs the traced jobs more", source.trim()),
        )
        .hint("use tsc where the CPU's is stable (clocksource=tsc tsc=reliable), as the kernel picks on most hosts"),
        Err(error) => Finding::new(Area::Agent, "clock source", Status::Warn, format!("{path}: {error}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn capabilities_are_read_bit_by_bit() {
        let bpf_and_perfmon = (1u64 << CAP_BPF) | (1 << CAP_PERFMON);
        assert!(has(bpf_and_perfmon, CAP_BPF) && has(bpf_and_perfmon, CAP_PERFMON));
        assert!(!has(bpf_and_perfmon, CAP_SYS_ADMIN));
    }
}
