//! The CUDA driver side of the eBPF backend: which entry points are probed
//! and what their arguments mean, where the driver library is (in the maps
//! of every process, containers included), and how a returned call becomes
//! events: a span on the calling thread's `/host:CPU` line and, for
//! allocations and frees, memory events per process.

use std::collections::HashMap;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use super::records::{
    c_str, CudaCall, CALL_FLAG_ENTRY_ONLY, CALL_FLAG_LAUNCH_CONFIG, CALL_FLAG_OUT_ARG0,
    CALL_FLAG_SYMBOL_ARG2,
};
use crate::event::{AllocatorTally, Device, DriverCallInfo, Event, NameId, Payload};
use crate::model::host_process;
use crate::model::registry::Registry;

/// One probed entry point: its symbol, which driver function it is (the
/// arguments mean the same for a function's per-thread-stream `_ptsz` and
/// `_ptds` variants), and the attach-cookie flags that tell the BPF program
/// what to read besides the integer arguments.
#[derive(Clone, Copy, Debug)]
pub struct CudaProbe {
    pub symbol: &'static str,
    pub function: usize,
    pub flags: u32,
}

const fn probe(symbol: &'static str, function: usize) -> CudaProbe {
    let flags = match function {
        LAUNCH_KERNEL_EX => CALL_FLAG_LAUNCH_CONFIG,
        MEM_ALLOC => CALL_FLAG_OUT_ARG0,
        MODULE_GET_FUNCTION => CALL_FLAG_OUT_ARG0 | CALL_FLAG_SYMBOL_ARG2,
        _ => 0,
    };
    CudaProbe {
        symbol,
        function,
        flags,
    }
}

/// Every probed symbol. Functions are `enum cuda_fn` in `bpf/records.h`.
pub const CUDA_PROBES: [CudaProbe; 27] = [
    probe("cuLaunchKernel", LAUNCH_KERNEL),
    probe("cuLaunchKernel_ptsz", LAUNCH_KERNEL),
    probe("cuLaunchKernelEx", LAUNCH_KERNEL_EX),
    probe("cuLaunchKernelEx_ptsz", LAUNCH_KERNEL_EX),
    probe("cuMemAlloc_v2", MEM_ALLOC),
    probe("cuMemFree_v2", MEM_FREE),
    probe("cuMemcpy", MEMCPY),
    probe("cuMemcpy_ptds", MEMCPY),
    probe("cuMemcpyAsync", MEMCPY_ASYNC),
    probe("cuMemcpyAsync_ptsz", MEMCPY_ASYNC),
    probe("cuMemcpyHtoD_v2", MEMCPY_HTOD),
    probe("cuMemcpyHtoD_v2_ptds", MEMCPY_HTOD),
    probe("cuMemcpyDtoH_v2", MEMCPY_DTOH),
    probe("cuMemcpyDtoH_v2_ptds", MEMCPY_DTOH),
    probe("cuMemcpyDtoD_v2", MEMCPY_DTOD),
    probe("cuMemcpyDtoD_v2_ptds", MEMCPY_DTOD),
    probe("cuMemcpyHtoDAsync_v2", MEMCPY_HTOD_ASYNC),
    probe("cuMemcpyHtoDAsync_v2_ptsz", MEMCPY_HTOD_ASYNC),
    probe("cuMemcpyDtoHAsync_v2", MEMCPY_DTOH_ASYNC),
    probe("cuMemcpyDtoHAsync_v2_ptsz", MEMCPY_DTOH_ASYNC),
    probe("cuMemcpyDtoDAsync_v2", MEMCPY_DTOD_ASYNC),
    probe("cuMemcpyDtoDAsync_v2_ptsz", MEMCPY_DTOD_ASYNC),
    probe("cuStreamSynchronize", STREAM_SYNCHRONIZE),
    probe("cuStreamSynchronize_ptsz", STREAM_SYNCHRONIZE),
    probe("cuCtxSynchronize", CTX_SYNCHRONIZE),
    probe("cuEventSynchronize", EVENT_SYNCHRONIZE),
    probe("cuModuleGetFunction", MODULE_GET_FUNCTION),
];

/// Which probed driver calls also get a return probe. A uprobe is a trap
/// into the kernel on each call; a return probe is a second one.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum CudaReturns {
    /// Only the calls whose duration or returned value is recorded:
    /// synchronizations, synchronous copies, allocations, frees (which may
    /// wait for the device) and module lookups (the kernel's name). Launches
    /// and asynchronous copies are recorded at entry: an instant with their
    /// arguments, without their API duration or `CUresult`.
    #[default]
    Needed,
    /// Every probed call, launches and asynchronous copies included.
    All,
}

impl CudaProbe {
    /// Whether this call gets a return probe under `returns`.
    pub fn has_return(&self, returns: CudaReturns) -> bool {
        returns == CudaReturns::All
            || !matches!(
                self.function,
                LAUNCH_KERNEL
                    | LAUNCH_KERNEL_EX
                    | MEMCPY_ASYNC
                    | MEMCPY_HTOD_ASYNC
                    | MEMCPY_DTOH_ASYNC
                    | MEMCPY_DTOD_ASYNC
            )
    }

    /// The attach cookie: function in bits 0-7, probe index in 8-15, flags
    /// from bit 16.
    pub fn cookie(&self, index: usize, returns: CudaReturns) -> u64 {
        let entry_only = if self.has_return(returns) {
            0
        } else {
            CALL_FLAG_ENTRY_ONLY
        };
        self.function as u64 | ((index as u64) << 8) | u64::from(self.flags | entry_only)
    }
}

const LAUNCH_KERNEL: usize = 0;
const LAUNCH_KERNEL_EX: usize = 1;
const MEM_ALLOC: usize = 2;
const MEM_FREE: usize = 3;
const MEMCPY: usize = 4;
const MEMCPY_ASYNC: usize = 5;
const MEMCPY_HTOD: usize = 6;
const MEMCPY_DTOH: usize = 7;
const MEMCPY_DTOD: usize = 8;
const MEMCPY_HTOD_ASYNC: usize = 9;
const MEMCPY_DTOH_ASYNC: usize = 10;
const MEMCPY_DTOD_ASYNC: usize = 11;
const STREAM_SYNCHRONIZE: usize = 12;
const CTX_SYNCHRONIZE: usize = 13;
const EVENT_SYNCHRONIZE: usize = 14;
const MODULE_GET_FUNCTION: usize = 15;

/// Kernel names remembered per process; beyond this the table starts over
/// (launches then show the handle without a name until it is seen again).
const MAX_KERNEL_NAMES: usize = 65_536;
/// Live allocations remembered per host, for the size of each free.
const MAX_ALLOCATIONS: usize = 1 << 20;

/// A driver library file, identified by device and inode so that the same
/// file seen through several mount namespaces is probed once.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct DriverLibrary {
    /// A path this process can open (through `/proc/<pid>/root` for a
    /// library inside a container).
    pub path: PathBuf,
    pub dev: u64,
    pub inode: u64,
}

impl DriverLibrary {
    pub fn at(path: &Path) -> Option<DriverLibrary> {
        let meta = std::fs::metadata(path).ok()?;
        meta.is_file().then(|| DriverLibrary {
            path: path.to_path_buf(),
            dev: meta.dev(),
            inode: meta.ino(),
        })
    }
}

/// Whether a mapped file is the CUDA driver (`libcuda.so`, `libcuda.so.1`,
/// `libcuda.so.550.54.15`, ...).
pub(crate) fn is_driver_library(path: &str) -> bool {
    path.rsplit('/')
        .next()
        .is_some_and(|file| file == "libcuda.so" || file.starts_with("libcuda.so."))
}

/// A process with a driver library mapped. Its start time tells it from a
/// later process given the same pid.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct MappingProcess {
    pub pid: u32,
    /// Clock ticks after boot (`/proc/<pid>/stat` field 22).
    pub started: u64,
}

impl MappingProcess {
    /// Process `pid` as listed under `proc_root` now, if it runs.
    pub fn at(proc_root: &Path, pid: u32) -> Option<MappingProcess> {
        let stat = std::fs::read_to_string(proc_root.join(pid.to_string()).join("stat")).ok()?;
        let started = host_process::parse_start_ticks(&stat)?;
        Some(MappingProcess { pid, started })
    }
}

/// A driver library and the processes that have it mapped now.
#[derive(Clone, Debug)]
pub struct MappedLibrary {
    pub library: DriverLibrary,
    pub mappers: Vec<Mapper>,
}

/// A process that maps a driver library, and the library's path through
/// that process's own root (the one to probe it in that process by: the
/// first process's may be gone).
#[derive(Clone, Debug)]
pub struct Mapper {
    pub process: MappingProcess,
    pub path: PathBuf,
}

/// Every driver library some process has mapped now, with those processes,
/// plus `extra` paths given by the operator (with the processes that map
/// the same file), without duplicates.
pub fn find_driver_libraries(proc_root: &Path, extra: &[PathBuf]) -> Vec<MappedLibrary> {
    let mut found: Vec<MappedLibrary> = Vec::new();
    let mut index: HashMap<(u64, u64), usize> = HashMap::new();
    let mut add = |library: DriverLibrary, process: Option<MappingProcess>| {
        let path = library.path.clone();
        let at = *index
            .entry((library.dev, library.inode))
            .or_insert_with(|| {
                found.push(MappedLibrary {
                    library,
                    mappers: Vec::new(),
                });
                found.len() - 1
            });
        if let Some(process) = process {
            let mappers = &mut found[at].mappers;
            if !mappers.iter().any(|m| m.process == process) {
                mappers.push(Mapper { process, path });
            }
        }
    };
    for path in extra {
        if let Some(library) = DriverLibrary::at(path) {
            add(library, None);
        }
    }
    let Ok(entries) = std::fs::read_dir(proc_root) else {
        return found;
    };
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(pid) = name
            .to_str()
            .filter(|n| n.bytes().all(|b| b.is_ascii_digit()))
        else {
            continue;
        };
        // Processes come and go while we look; a vanished one is skipped.
        let Ok(maps) = std::fs::read_to_string(entry.path().join("maps")) else {
            continue;
        };
        let mut paths: Vec<&str> = maps
            .lines()
            .filter_map(|line| line.split_whitespace().nth(5))
            .filter(|path| path.starts_with('/') && is_driver_library(path))
            .collect();
        paths.dedup();
        if paths.is_empty() {
            continue;
        }
        let process = pid
            .parse()
            .ok()
            .and_then(|pid| MappingProcess::at(proc_root, pid));
        for path in paths {
            // Through the process's own root, so a container's library
            // resolves to the container's file.
            let through_root = proc_root.join(pid).join("root").join(&path[1..]);
            if let Some(library) = DriverLibrary::at(&through_root) {
                add(library, process);
            }
        }
    }
    found
}

/// See the module documentation.
pub struct DriverCalls {
    registry: Arc<Registry>,
    probe_names: Vec<NameId>,
    allocation_name: NameId,
    deallocation_name: NameId,
    kernels: HashMap<(u32, u64), NameId>,
    allocations: HashMap<(u32, u64), u64>,
    memory: HashMap<u32, AllocatorTally>,
    named_threads: HashMap<u32, [u8; 16]>,
}

impl DriverCalls {
    pub fn new(registry: Arc<Registry>) -> DriverCalls {
        DriverCalls {
            probe_names: CUDA_PROBES
                .iter()
                .map(|p| registry.intern(p.symbol))
                .collect(),
            allocation_name: registry.intern("MemoryAllocation"),
            deallocation_name: registry.intern("MemoryDeallocation"),
            registry,
            kernels: HashMap::new(),
            allocations: HashMap::new(),
            memory: HashMap::new(),
            named_threads: HashMap::new(),
        }
    }

    /// Turns one call into events; `start_ns` and `end_ns` are on the
    /// agent's clock (equal for a call probed at entry only).
    pub fn record(&mut self, call: &CudaCall, start_ns: u64, end_ns: u64, out: &mut Vec<Event>) {
        let function = (call.cookie & 0xff) as usize;
        let Some(&name) = self.probe_names.get(((call.cookie >> 8) & 0xff) as usize) else {
            return;
        };
        self.name_thread(call);
        let a = &call.args;
        let ok = call.result == 0;
        let returned = call.cookie & CALL_FLAG_ENTRY_ONLY == 0;
        let mut info = DriverCallInfo {
            pid: call.pid,
            result: if returned {
                call.result
            } else {
                DriverCallInfo::NOT_RETURNED
            },
            ..DriverCallInfo::default()
        };
        match function {
            LAUNCH_KERNEL => {
                info.function = a[0];
                info.grid = [a[1] as u32, a[2] as u32, a[3] as u32];
                info.block = [a[4] as u32, a[5] as u32, a[6] as u32];
                info.shared_bytes = a[7] as u32;
                info.stream = a[8];
            }
            LAUNCH_KERNEL_EX => {
                let l = &call.launch;
                info.function = a[1];
                info.grid = [l[0], l[1], l[2]];
                info.block = [l[3], l[4], l[5]];
                info.shared_bytes = l[6];
                info.stream = call.launch_stream;
            }
            MEM_ALLOC => {
                info.bytes = a[1];
                info.address = if ok { call.out_value } else { 0 };
            }
            MEM_FREE => {
                info.address = a[0];
                info.bytes = self
                    .allocations
                    .get(&(call.pid, a[0]))
                    .copied()
                    .unwrap_or(0);
            }
            MEMCPY | MEMCPY_ASYNC | MEMCPY_HTOD | MEMCPY_DTOD | MEMCPY_HTOD_ASYNC
            | MEMCPY_DTOD_ASYNC => {
                info.address = a[0];
                info.bytes = a[2];
                if matches!(
                    function,
                    MEMCPY_ASYNC | MEMCPY_HTOD_ASYNC | MEMCPY_DTOD_ASYNC
                ) {
                    info.stream = a[3];
                }
            }
            MEMCPY_DTOH | MEMCPY_DTOH_ASYNC => {
                info.address = a[1];
                info.bytes = a[2];
                if function == MEMCPY_DTOH_ASYNC {
                    info.stream = a[3];
                }
            }
            STREAM_SYNCHRONIZE => info.stream = a[0],
            MODULE_GET_FUNCTION if ok && call.out_value != 0 => {
                let kernel = self.registry.intern(&c_str(&call.symbol));
                if self.kernels.len() >= MAX_KERNEL_NAMES {
                    self.kernels.clear();
                }
                self.kernels.insert((call.pid, call.out_value), kernel);
                info.kernel = kernel;
                info.function = call.out_value;
            }
            _ => {}
        }
        if matches!(function, LAUNCH_KERNEL | LAUNCH_KERNEL_EX) {
            info.kernel = self
                .kernels
                .get(&(call.pid, info.function))
                .copied()
                .unwrap_or_default();
        }
        out.push(Event::new(
            start_ns,
            end_ns.saturating_sub(start_ns),
            Device::Host,
            u64::from(call.tid),
            name,
            Payload::DriverCall(info),
        ));
        if ok && function == MEM_ALLOC && info.address != 0 {
            self.allocation(call, info.address, info.bytes, end_ns, out);
        }
        if ok && function == MEM_FREE {
            self.free(call, info.address, end_ns, out);
        }
    }

    fn name_thread(&mut self, call: &CudaCall) {
        if self.named_threads.get(&call.tid) != Some(&call.comm) {
            self.registry.name_line(
                Device::Host,
                u64::from(call.tid),
                &format!("{} {} (pid {})", c_str(&call.comm), call.tid, call.pid),
            );
            self.named_threads.insert(call.tid, call.comm);
        }
    }

    /// The allocator of process `pid`, made on its first allocation.
    fn tally(&mut self, pid: u32) -> &mut AllocatorTally {
        let registry = &self.registry;
        self.memory.entry(pid).or_insert_with(|| {
            AllocatorTally::new(registry.intern(&format!("cuMemAlloc pid {pid}")))
        })
    }

    fn allocation(
        &mut self,
        call: &CudaCall,
        address: u64,
        bytes: u64,
        at: u64,
        out: &mut Vec<Event>,
    ) {
        if self.allocations.len() >= MAX_ALLOCATIONS {
            self.allocations.clear();
        }
        self.allocations.insert((call.pid, address), bytes);
        let info = self.tally(call.pid).allocate(address, bytes);
        let name = self.allocation_name;
        out.push(memory_event(
            call,
            at,
            name,
            Payload::MemoryAllocation(info),
        ));
    }

    fn free(&mut self, call: &CudaCall, address: u64, at: u64, out: &mut Vec<Event>) {
        // A free of memory allocated before the probes were attached has no
        // known size; it is shown with size 0 rather than guessed.
        let bytes = self.allocations.remove(&(call.pid, address)).unwrap_or(0);
        let info = self.tally(call.pid).free(address, bytes);
        let name = self.deallocation_name;
        out.push(memory_event(
            call,
            at,
            name,
            Payload::MemoryDeallocation(info),
        ));
    }
}

/// An allocator instant on the calling thread's line.
fn memory_event(call: &CudaCall, at: u64, name: NameId, payload: Payload) -> Event {
    Event::new(at, 0, Device::Host, u64::from(call.tid), name, payload)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn call(function: usize, args: &[u64]) -> CudaCall {
        let index = CUDA_PROBES
            .iter()
            .position(|p| p.function == function)
            .expect("a probe of the function");
        let mut comm = [0u8; 16];
        comm[..4].copy_from_slice(b"work");
        let mut call = CudaCall {
            start_ns: 0,
            end_ns: 0,
            pid: 100,
            tid: 101,
            cookie: CUDA_PROBES[index].cookie(index, CudaReturns::All) as u32,
            result: 0,
            args: [0; 9],
            launch: [0; 7],
            reserved: 0,
            launch_stream: 0,
            out_value: 0,
            comm,
            symbol: [0; 96],
        };
        call.args[..args.len()].copy_from_slice(args);
        call
    }

    #[test]
    fn launches_are_named_from_module_lookups_and_memory_is_balanced() {
        let registry = Registry::new();
        let mut calls = DriverCalls::new(Arc::clone(&registry));
        let mut out = Vec::new();
        let mut lookup = call(MODULE_GET_FUNCTION, &[0x10, 0x20, 0x30]);
        lookup.out_value = 0xf00;
        lookup.symbol[..10].copy_from_slice(b"vector_add");
        calls.record(&lookup, 10, 20, &mut out);
        calls.record(
            &call(LAUNCH_KERNEL, &[0xf00, 128, 1, 1, 256, 1, 1, 0, 0x5]),
            30,
            45,
            &mut out,
        );
        let mut alloc = call(MEM_ALLOC, &[0x7ff0, 4096]);
        alloc.out_value = 0xd000;
        calls.record(&alloc, 50, 60, &mut out);
        calls.record(&call(MEM_FREE, &[0xd000]), 70, 80, &mut out);
        let snapshot = registry.snapshot();
        let names: Vec<&str> = out.iter().map(|e| snapshot.name(e.name())).collect();
        assert_eq!(
            names,
            [
                "cuModuleGetFunction",
                "cuLaunchKernel",
                "cuMemAlloc_v2",
                "MemoryAllocation",
                "cuMemFree_v2",
                "MemoryDeallocation"
            ]
        );
        let Payload::DriverCall(launch) = out[1].payload() else {
            panic!("{:?}", out[1]);
        };
        assert_eq!(snapshot.name(launch.kernel), "vector_add");
        assert_eq!(
            (launch.grid, launch.block, launch.stream),
            ([128, 1, 1], [256, 1, 1], 5)
        );
        assert_eq!(
            (out[1].start_ns, out[1].duration_ns, out[1].line),
            (30, 15, 101)
        );
        let Payload::MemoryAllocation(allocated) = out[3].payload() else {
            panic!("{:?}", out[3]);
        };
        assert_eq!(
            (allocated.address, allocated.bytes_allocated),
            (0xd000, 4096)
        );
        assert_eq!(snapshot.name(allocated.allocator), "cuMemAlloc pid 100");
        let Payload::MemoryDeallocation(freed) = out[5].payload() else {
            panic!("{:?}", out[5]);
        };
        assert_eq!(
            (
                freed.allocation_bytes,
                freed.bytes_allocated,
                freed.peak_bytes_in_use
            ),
            (4096, 0, 4096)
        );
        assert_eq!(
            snapshot.line_name(Device::Host, 101),
            Some("work 101 (pid 100)")
        );
    }

    #[test]
    fn by_default_only_calls_whose_end_is_recorded_get_a_return_probe() {
        let returning: Vec<&str> = CUDA_PROBES
            .iter()
            .filter(|p| p.has_return(CudaReturns::Needed))
            .map(|p| p.symbol)
            .filter(|s| !s.ends_with("_ptsz") && !s.ends_with("_ptds"))
            .collect();
        assert_eq!(
            returning,
            [
                "cuMemAlloc_v2",
                "cuMemFree_v2",
                "cuMemcpy",
                "cuMemcpyHtoD_v2",
                "cuMemcpyDtoH_v2",
                "cuMemcpyDtoD_v2",
                "cuStreamSynchronize",
                "cuCtxSynchronize",
                "cuEventSynchronize",
                "cuModuleGetFunction",
            ]
        );
        assert!(CUDA_PROBES.iter().all(|p| p.has_return(CudaReturns::All)));

        // A launch probed at entry only: an instant, its arguments, no result.
        let registry = Registry::new();
        let mut calls = DriverCalls::new(Arc::clone(&registry));
        let mut launch = call(LAUNCH_KERNEL, &[0xf00, 2, 1, 1, 128, 1, 1, 0, 0x77]);
        launch.cookie = CUDA_PROBES[0].cookie(0, CudaReturns::Needed) as u32;
        let mut out = Vec::new();
        calls.record(&launch, 5, 5, &mut out);
        let Payload::DriverCall(info) = out[0].payload() else {
            panic!()
        };
        assert_eq!(out[0].duration_ns, 0);
        assert_eq!(info.result, DriverCallInfo::NOT_RETURNED);
        assert_eq!((info.grid, info.stream), ([2, 1, 1], 0x77));
        launch.cookie = CUDA_PROBES[0].cookie(0, CudaReturns::All) as u32;
        calls.record(&launch, 5, 9, &mut out);
        let Payload::DriverCall(info) = out[1].payload() else {
            panic!()
        };
        assert_eq!((out[1].duration_ns, info.result), (4, 0));
    }

    #[test]
    fn per_thread_stream_variants_decode_like_their_function_under_their_own_name() {
        let registry = Registry::new();
        let mut calls = DriverCalls::new(Arc::clone(&registry));
        let index = CUDA_PROBES
            .iter()
            .position(|p| p.symbol == "cuMemcpyDtoHAsync_v2_ptsz")
            .unwrap();
        let mut copy = call(MEMCPY_DTOH_ASYNC, &[0x1000, 0xd000, 4096, 0x77]);
        copy.cookie = CUDA_PROBES[index].cookie(index, CudaReturns::All) as u32;
        let mut out = Vec::new();
        calls.record(&copy, 1, 2, &mut out);
        assert_eq!(
            registry.snapshot().name(out[0].name()),
            "cuMemcpyDtoHAsync_v2_ptsz"
        );
        let Payload::DriverCall(info) = out[0].payload() else {
            panic!()
        };
        assert_eq!(
            (info.address, info.bytes, info.stream),
            (0xd000, 4096, 0x77)
        );
        // Every function id fits the cookie's 8 bits and is one the BPF
        // program knows.
        assert!(CUDA_PROBES
            .iter()
            .all(|p| p.function <= MODULE_GET_FUNCTION));
    }

    #[test]
    fn driver_libraries_are_found_by_file_name() {
        assert!(is_driver_library("/usr/lib/x86_64-linux-gnu/libcuda.so.1"));
        assert!(is_driver_library("/opt/libcuda.so.550.54.15"));
        assert!(is_driver_library("/x/libcuda.so"));
        assert!(!is_driver_library("/x/libcudart.so.12"));
        assert!(!is_driver_library("/x/libcuda.so-old/libfoo.so"));
    }
}
