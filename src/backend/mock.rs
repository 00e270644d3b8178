//! The mock backend: a deterministic, seeded model of a two-GPU training job,
//! detailed enough that every XProf tool has data. It stands in for hardware
//! on machines without any and drives load tests at millions of events per
//! second.
//!
//! Each training step is a `train` span (`step_num`, `_r = 1`) on the `python`
//! thread, holding a sequence of framework ops. Every op launches one kernel
//! (`cudaLaunchKernel` on the host with a correlation id, the kernel on GPU
//! stream 7 with `kernel_details`) and allocates its output tensor through a
//! BFC-like allocator per GPU (`MemoryAllocation`/`MemoryDeallocation` with
//! every stat the memory profile reads). Each step also copies its input batch
//! to every GPU (stream 13), copies results back (stream 14) and clears a
//! buffer with a memset (stream 7).
//!
//! Scenarios, off unless configured, stage what triggers watch for: one slow
//! step ([`SLOW_STEP_FACTOR`] times as long as the others) and a dip in
//! utilisation (SM utilisation samples on each GPU's counter track at every
//! step's start, [`BUSY_PERCENT`] normally and [`DIP_PERCENT`] during the
//! dip).

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;

use super::worker::Worker;
use super::{Backend, BackendContext, BackendError, Capabilities, Health};
use crate::clock;
use crate::event::{
    CopyInfo, CopyKind, Device, Event, KernelInfo, MemoryInfo, MemsetInfo, NameId, Payload,
};
use crate::model::registry::{DeviceInfo, Registry};
use crate::model::timeline::COUNTER_TRACK;

/// Thread id of the training loop's thread.
pub const PYTHON_TID: u64 = 4242;
/// Thread id of the thread that issues copies.
pub const COPY_TID: u64 = 4243;
/// GPU stream ids, as CUPTI would number them.
pub const COMPUTE_STREAM: u64 = 7;
pub const H2D_STREAM: u64 = 13;
pub const D2H_STREAM: u64 = 14;

const STEP_PERIOD_NS: u64 = 50_000_000;
/// Roughly how many events one op produces (op, launch, kernel, alloc, free).
const EVENTS_PER_OP: u64 = 5;
/// The highest `--mock-rate`: far past what a ring drains, low enough that
/// the generator's arithmetic cannot overflow.
pub const MAX_EVENTS_PER_SECOND: u64 = 100_000_000;
/// Ops emitted between looks at the stop flag.
const OPS_PER_STOP_CHECK: u64 = 4096;
const LIVE_TENSORS_PER_ALLOCATOR: usize = 6;
const GPU_MEMORY_LIMIT: i64 = 38 << 30;

/// How many times longer than the others the scenario's slow step lasts.
pub const SLOW_STEP_FACTOR: u64 = 4;
/// SM utilisation the dip scenario samples outside the dip, and within it.
pub const BUSY_PERCENT: f64 = 92.0;
pub const DIP_PERCENT: f64 = 3.0;

#[derive(Clone, Copy, Debug)]
pub struct MockConfig {
    pub seed: u64,
    /// Target event rate.
    pub events_per_second: u64,
    pub gpus: u16,
    /// The first step starting this long after the backend starts is slow.
    pub slow_step_after: Option<Duration>,
    /// Utilisation is sampled, and dips for a while from some time on.
    pub utilization_dip: Option<Dip>,
    /// The user the simulated job runs as, for captures scoped to one user;
    /// none: the agent's own (its events come from the agent's process).
    pub uid: Option<u32>,
}

impl Default for MockConfig {
    fn default() -> Self {
        MockConfig {
            seed: 1,
            events_per_second: 50_000,
            gpus: 2,
            slow_step_after: None,
            utilization_dip: None,
            uid: None,
        }
    }
}

/// A dip in utilisation: from `after` the backend's start, for `length`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Dip {
    pub after: Duration,
    pub length: Duration,
}

impl std::str::FromStr for Dip {
    type Err = String;

    /// `AFTER+LENGTH`, e.g. `10s+5s`.
    fn from_str(text: &str) -> Result<Dip, String> {
        let (after, length) = text
            .split_once('+')
            .ok_or_else(|| format!("{text:?}: a dip is AFTER+LENGTH, e.g. 10s+5s"))?;
        Ok(Dip {
            after: crate::model::units::parse_duration(after).map_err(|e| e.to_string())?,
            length: crate::model::units::parse_duration(length).map_err(|e| e.to_string())?,
        })
    }
}

/// SplitMix64: tiny, fast, and the same sequence on every platform.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in [lo, hi).
    fn fraction(&mut self, lo: f64, hi: f64) -> f64 {
        lo + (hi - lo) * (self.next() >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// One kind of framework op and the kernel it launches.
struct OpKind {
    op: &'static str,
    kernel: &'static str,
    registers: u32,
    static_shared: u32,
    dynamic_shared: u32,
    grid: [u32; 3],
    block: [u32; 3],
    occupancy: f32,
    output_bytes: i64,
    data_type: u32,
    shape: &'static str,
}

const OPS: &[OpKind] = &[
    OpKind {
        op: "model/dense/MatMul:MatMul",
        kernel: "volta_h884gemm_64x64_ldg8_nn",
        registers: 128,
        static_shared: 0,
        dynamic_shared: 32768,
        grid: [16, 8, 1],
        block: [256, 1, 1],
        occupancy: 25.0,
        output_bytes: 1 << 20,
        data_type: 19,
        shape: "[256,2048]",
    },
    OpKind {
        op: "model/dense/BiasAdd:BiasAdd",
        kernel: "void tensorflow::functor::BiasNHWCKernel<Eigen::half>(int, Eigen::half const*, Eigen::half const*, Eigen::half*, int)",
        registers: 24,
        static_shared: 0,
        dynamic_shared: 0,
        grid: [512, 1, 1],
        block: [1024, 1, 1],
        occupancy: 100.0,
        output_bytes: 1 << 20,
        data_type: 19,
        shape: "[256,2048]",
    },
    OpKind {
        op: "model/conv2d/Conv2D:Conv2D",
        kernel: "implicit_convolve_sgemm",
        registers: 96,
        static_shared: 8192,
        dynamic_shared: 0,
        grid: [28, 28, 4],
        block: [128, 1, 1],
        occupancy: 37.5,
        output_bytes: 6 << 20,
        data_type: 1,
        shape: "[64,28,28,32]",
    },
    OpKind {
        op: "model/conv2d/Relu:Relu",
        kernel: "void Eigen::internal::EigenMetaKernel<Eigen::TensorEvaluator<Relu>, long>(Eigen::TensorEvaluator<Relu>, long)",
        registers: 32,
        static_shared: 0,
        dynamic_shared: 0,
        grid: [1568, 1, 1],
        block: [1024, 1, 1],
        occupancy: 100.0,
        output_bytes: 6 << 20,
        data_type: 1,
        shape: "[64,28,28,32]",
    },
    OpKind {
        op: "model/loss/SparseSoftmaxCrossEntropyWithLogits:SparseSoftmaxCrossEntropyWithLogits",
        kernel: "void tensorflow::functor::SoftmaxCrossEntropyKernel<float>(float const*, int const*, float*, int)",
        registers: 40,
        static_shared: 4096,
        dynamic_shared: 0,
        grid: [64, 1, 1],
        block: [256, 1, 1],
        occupancy: 75.0,
        output_bytes: 256 << 10,
        data_type: 1,
        shape: "[256]",
    },
];

/// Interned names the workload uses, resolved once.
struct Names {
    train: NameId,
    /// Only with the utilisation scenario, so that names are numbered as
    /// before without it.
    sm_util: Option<NameId>,
    launch: NameId,
    memcpy_api: NameId,
    memcpy_h2d: NameId,
    memcpy_d2h: NameId,
    memset: NameId,
    alloc: NameId,
    dealloc: NameId,
    output: NameId,
    ops: Vec<(NameId, NameId, NameId)>,
    allocators: Vec<NameId>,
}

struct Tensor {
    address: u64,
    bytes: i64,
    op: NameId,
    shape: NameId,
    data_type: u32,
}

struct Allocator {
    name: NameId,
    in_use: i64,
    peak: i64,
    next_address: u64,
    live: VecDeque<Tensor>,
}

/// The deterministic event generator; the backend thread drives it in time.
pub struct Workload {
    rng: Rng,
    names: Names,
    gpus: u16,
    ops_per_step: u64,
    slot_ns: u64,
    step_start_ns: u64,
    /// Length of the current step.
    period_ns: u64,
    /// When the slow step may start, until it has.
    slow_step_from_ns: Option<u64>,
    /// The utilisation dip, `[from, to)`.
    dip_ns: Option<(u64, u64)>,
    step: i64,
    op_index: u64,
    correlation: u64,
    allocators: Vec<Allocator>,
}

impl Workload {
    /// Registers the workload's names, threads and devices and positions the
    /// first step at `start_ns`.
    pub fn new(config: &MockConfig, registry: &Registry, start_ns: u64) -> Workload {
        let gpus = config.gpus.max(1);
        registry.name_line(Device::Host, PYTHON_TID, "python");
        registry.name_line(Device::Host, COPY_TID, "tf_gpu_copy");
        for gpu in 0..gpus {
            registry.describe_device(Device::Gpu(gpu), mock_device_info());
        }
        let names = Names {
            train: registry.intern("train"),
            sm_util: config
                .utilization_dip
                .map(|_| registry.intern(crate::backend::nvml::SM_UTILIZATION)),
            launch: registry.intern("cudaLaunchKernel"),
            memcpy_api: registry.intern("cudaMemcpyAsync"),
            memcpy_h2d: registry.intern("MemcpyHToD"),
            memcpy_d2h: registry.intern("MemcpyDToH"),
            memset: registry.intern("Memset"),
            alloc: registry.intern("MemoryAllocation"),
            dealloc: registry.intern("MemoryDeallocation"),
            output: registry.intern("output"),
            ops: OPS
                .iter()
                .map(|k| {
                    (
                        registry.intern(k.op),
                        registry.intern(k.kernel),
                        registry.intern(k.shape),
                    )
                })
                .collect(),
            allocators: (0..gpus)
                .map(|g| registry.intern(&format!("GPU_{g}_bfc")))
                .collect(),
        };
        let ops_per_step = (config.events_per_second.saturating_mul(STEP_PERIOD_NS)
            / 1_000_000_000
            / EVENTS_PER_OP)
            .max(4);
        let allocators = names
            .allocators
            .iter()
            .enumerate()
            .map(|(g, name)| Allocator {
                name: *name,
                in_use: 0,
                peak: 0,
                next_address: 0x7f00_0000_0000 + ((g as u64) << 36),
                live: VecDeque::new(),
            })
            .collect();
        Workload {
            rng: Rng(config.seed),
            names,
            gpus,
            ops_per_step,
            slot_ns: slot_ns(STEP_PERIOD_NS, ops_per_step),
            step_start_ns: start_ns,
            period_ns: STEP_PERIOD_NS,
            slow_step_from_ns: config
                .slow_step_after
                .map(|after| start_ns + clock::duration_ns(after)),
            dip_ns: config.utilization_dip.map(|dip| {
                let from = start_ns + clock::duration_ns(dip.after);
                (from, from + clock::duration_ns(dip.length))
            }),
            step: 0,
            op_index: 0,
            correlation: 0,
            allocators,
        }
    }

    /// Start time of what the next call to [`Workload::emit_next`] produces.
    pub fn next_time_ns(&self) -> u64 {
        self.step_start_ns + self.op_index * self.slot_ns
    }

    /// Emits the next op of the current step (plus the step's own events at its
    /// start and end).
    pub fn emit_next(&mut self, sink: &mut impl FnMut(Event)) {
        if self.op_index == 0 {
            self.emit_step_start(sink);
        }
        self.emit_op(sink);
        self.op_index += 1;
        if self.op_index == self.ops_per_step {
            self.emit_step_end(sink);
            self.step += 1;
            self.op_index = 0;
            self.step_start_ns += self.period_ns;
        }
    }

    fn next_correlation(&mut self) -> u64 {
        self.correlation += 1;
        self.correlation
    }

    fn emit_step_start(&mut self, sink: &mut impl FnMut(Event)) {
        let start = self.step_start_ns;
        self.period_ns = match self.slow_step_from_ns {
            Some(from) if start >= from => {
                self.slow_step_from_ns = None;
                STEP_PERIOD_NS * SLOW_STEP_FACTOR
            }
            _ => STEP_PERIOD_NS,
        };
        self.slot_ns = slot_ns(self.period_ns, self.ops_per_step);
        sink(Event::new(
            start,
            self.period_ns * 95 / 100,
            Device::Host,
            PYTHON_TID,
            self.names.train,
            Payload::Step {
                step_num: self.step,
            },
        ));
        for gpu in 0..self.gpus {
            let bytes = 24 << 20;
            let at = start + u64::from(gpu) * 20_000;
            self.emit_copy(sink, gpu, at, bytes, CopyKind::HostToDevice);
        }
        if let (Some(name), Some((from, to))) = (self.names.sm_util, self.dip_ns) {
            let value = if (from..to).contains(&start) {
                DIP_PERCENT
            } else {
                BUSY_PERCENT
            };
            for gpu in 0..self.gpus {
                sink(Event::new(
                    start,
                    0,
                    Device::Gpu(gpu),
                    COUNTER_TRACK,
                    name,
                    Payload::Counter { value },
                ));
            }
        }
    }

    fn emit_step_end(&mut self, sink: &mut impl FnMut(Event)) {
        let end = self.step_start_ns + self.period_ns * 9 / 10;
        for gpu in 0..self.gpus {
            let at = end + u64::from(gpu) * 20_000;
            self.emit_copy(sink, gpu, at, 1 << 20, CopyKind::DeviceToHost);
            let correlation = self.next_correlation();
            sink(Event::new(
                end + self.period_ns / 50,
                8_000,
                Device::Gpu(gpu),
                COMPUTE_STREAM,
                self.names.memset,
                Payload::Memset(MemsetInfo {
                    correlation_id: correlation,
                    bytes: 4 << 20,
                    is_async: true,
                    tf_op: NameId(0),
                }),
            ));
        }
    }

    fn emit_copy(
        &mut self,
        sink: &mut impl FnMut(Event),
        gpu: u16,
        at: u64,
        bytes: u64,
        kind: CopyKind,
    ) {
        let correlation = self.next_correlation();
        sink(Event::new(
            at,
            6_000,
            Device::Host,
            COPY_TID,
            self.names.memcpy_api,
            Payload::ApiCall {
                correlation_id: correlation,
                device_ordinal: u32::from(gpu),
            },
        ));
        let (name, stream) = match kind {
            CopyKind::HostToDevice => (self.names.memcpy_h2d, H2D_STREAM),
            _ => (self.names.memcpy_d2h, D2H_STREAM),
        };
        // About 12 GB/s over PCIe.
        let duration_ns = bytes / 12;
        sink(Event::new(
            at + 9_000,
            duration_ns,
            Device::Gpu(gpu),
            stream,
            name,
            Payload::Memcpy(CopyInfo {
                correlation_id: correlation,
                bytes,
                kind,
                is_async: true,
                tf_op: NameId(0),
            }),
        ));
    }

    fn emit_op(&mut self, sink: &mut impl FnMut(Event)) {
        let slot = self.slot_ns;
        let start = self.next_time_ns();
        let kind_index = (self.op_index as usize) % OPS.len();
        let kind = &OPS[kind_index];
        let (op_name, kernel_name, shape) = self.names.ops[kind_index];
        let gpu = (self.op_index % u64::from(self.gpus)) as u16;
        let op_duration = (slot as f64 * self.rng.fraction(0.6, 0.85)) as u64;
        sink(Event::new(
            start,
            op_duration.max(4),
            Device::Host,
            PYTHON_TID,
            op_name,
            Payload::Plain,
        ));
        self.emit_allocation(sink, gpu, start + 1, op_name, shape, kind);
        let launch_start = start + slot / 5;
        let launch_duration = (slot / 30).max(1);
        let correlation = self.next_correlation();
        sink(Event::new(
            launch_start,
            launch_duration,
            Device::Host,
            PYTHON_TID,
            self.names.launch,
            Payload::ApiCall {
                correlation_id: correlation,
                device_ordinal: u32::from(gpu),
            },
        ));
        let kernel_start = launch_start + launch_duration + slot / 40;
        let kernel_duration = ((slot as f64 * self.rng.fraction(0.3, 0.6)) as u64).max(1);
        sink(Event::new(
            kernel_start,
            kernel_duration,
            Device::Gpu(gpu),
            COMPUTE_STREAM,
            kernel_name,
            Payload::Kernel(KernelInfo {
                correlation_id: correlation,
                registers_per_thread: kind.registers,
                static_shared_bytes: kind.static_shared,
                dynamic_shared_bytes: kind.dynamic_shared,
                occupancy_pct: kind.occupancy,
                grid: kind.grid,
                block: kind.block,
                tf_op: op_name,
                ..KernelInfo::default()
            }),
        ));
    }

    fn emit_allocation(
        &mut self,
        sink: &mut impl FnMut(Event),
        gpu: u16,
        at: u64,
        op: NameId,
        shape: NameId,
        kind: &OpKind,
    ) {
        let step = self.step;
        let output = self.names.output;
        let fragmentation = self.rng.fraction(0.0, 0.15);
        let requested = kind.output_bytes - (self.rng.next() % 256) as i64;
        let (alloc_name, dealloc_name) = (self.names.alloc, self.names.dealloc);
        let allocator = &mut self.allocators[usize::from(gpu)];
        let address = allocator.next_address;
        allocator.next_address += kind.output_bytes as u64;
        allocator.in_use += kind.output_bytes;
        allocator.peak = allocator.peak.max(allocator.in_use);
        allocator.live.push_back(Tensor {
            address,
            bytes: kind.output_bytes,
            op,
            shape,
            data_type: kind.data_type,
        });
        let stats = |allocator: &Allocator, tensor: &Tensor, requested: i64| MemoryInfo {
            allocator: allocator.name,
            tf_op: tensor.op,
            region_type: output,
            shape: tensor.shape,
            data_type: tensor.data_type,
            bytes_reserved: 0,
            bytes_allocated: allocator.in_use,
            bytes_available: GPU_MEMORY_LIMIT - allocator.in_use,
            fragmentation,
            peak_bytes_in_use: allocator.peak,
            requested_bytes: requested,
            allocation_bytes: tensor.bytes,
            address: tensor.address,
            step_id: step,
        };
        let allocated = allocator
            .live
            .back()
            .map(|t| stats(allocator, t, requested));
        if let Some(info) = allocated {
            sink(Event::new(
                at,
                0,
                Device::Host,
                PYTHON_TID,
                alloc_name,
                Payload::MemoryAllocation(info),
            ));
        }
        if allocator.live.len() > LIVE_TENSORS_PER_ALLOCATOR {
            if let Some(tensor) = allocator.live.pop_front() {
                allocator.in_use -= tensor.bytes;
                let info = stats(allocator, &tensor, tensor.bytes);
                sink(Event::new(
                    at + 1,
                    0,
                    Device::Host,
                    PYTHON_TID,
                    dealloc_name,
                    Payload::MemoryDeallocation(info),
                ));
            }
        }
    }
}

/// Time given to each op of a step of `period_ns`.
fn slot_ns(period_ns: u64, ops_per_step: u64) -> u64 {
    (period_ns * 9 / 10 / ops_per_step).max(1)
}

fn mock_device_info() -> DeviceInfo {
    DeviceInfo {
        vendor: "Nvidia".into(),
        model: "devtrace mock GPU (A100-class)".into(),
        compute_capability: (8, 0),
        core_count: 108,
        clock_rate_khz: 1_410_000,
        memory_bytes: 40 << 30,
        memory_bandwidth_bytes_per_s: 1_555_000_000_000,
    }
}

/// See the module documentation.
pub struct MockBackend {
    config: MockConfig,
    running: Option<Worker>,
    pushed: Arc<AtomicU64>,
    refused: Arc<AtomicU64>,
    failure: Arc<Mutex<Option<String>>>,
}

impl MockBackend {
    pub fn new(config: MockConfig) -> MockBackend {
        MockBackend {
            config,
            running: None,
            pushed: Arc::default(),
            refused: Arc::default(),
            failure: Arc::default(),
        }
    }
}

/// How often the generator catches up with the clock.
const TICK: Duration = Duration::from_millis(1);

impl Backend for MockBackend {
    fn name(&self) -> &'static str {
        "mock"
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities {
            records: vec![
                "training steps",
                "framework ops",
                "GPU kernels",
                "memcpy and memset",
                "allocator events",
            ],
            max_delay: TICK * 10,
            held_until_asked: std::time::Duration::ZERO,
        }
    }

    fn start(&mut self, context: BackendContext) -> Result<(), BackendError> {
        if self.running.is_some() {
            return Ok(());
        }
        let mut producer = context.producer().map_err(|e| BackendError::Start {
            backend: "mock",
            reason: e.to_string(),
        })?;
        let config = self.config;
        let (pushed, refused) = (Arc::clone(&self.pushed), Arc::clone(&self.refused));
        let worker = Worker::spawn("mock", move |stop| {
            let mut workload = Workload::new(&config, &context.registry, clock::now_ns());
            let (mut ok, mut full) = (0u64, 0u64);
            if config.events_per_second == 0 {
                // Rate 0: an idle agent, for measuring its own footprint.
                stop.wait();
                return;
            }
            while !stop.is_set() {
                let now = clock::now_ns();
                let mut ops: u64 = 0;
                while workload.next_time_ns() <= now {
                    // However far behind a high rate falls, a stop is seen
                    // within a batch of ops.
                    ops += 1;
                    if ops.is_multiple_of(OPS_PER_STOP_CHECK) && stop.is_set() {
                        break;
                    }
                    workload.emit_next(&mut |event| {
                        if producer.push(&event) {
                            ok += 1;
                        } else {
                            full += 1;
                        }
                    });
                }
                pushed.store(ok, Ordering::Relaxed);
                refused.store(full, Ordering::Relaxed);
                std::thread::sleep(TICK);
            }
        });
        match worker {
            Ok(worker) => {
                self.running = Some(worker);
                Ok(())
            }
            Err(e) => {
                *self.failure.lock() = Some(e.to_string());
                Err(e)
            }
        }
    }

    fn stop(&mut self) {
        if let Some(worker) = self.running.take() {
            worker.stop();
        }
    }

    /// The simulated job is one process: the agent's, of `MockConfig::uid`.
    fn process_lines(&self, _window: crate::recorder::Window) -> Vec<super::ProcessLines> {
        // SAFETY: geteuid has no preconditions.
        let uid = self
            .config
            .uid
            .unwrap_or_else(|| unsafe { libc::geteuid() });
        vec![super::ProcessLines {
            pid: std::process::id(),
            uid,
            from_ns: 0,
            until_ns: None,
            gpu_slot: Some(0),
            host_lines: vec![PYTHON_TID, COPY_TID],
            gpus: (0..self.config.gpus).collect(),
        }]
    }

    fn health(&self) -> Health {
        if let Some(reason) = self.failure.lock().clone() {
            return Health::Failed { reason };
        }
        match &self.running {
            None => Health::Stopped,
            Some(worker) if worker.exited() => Health::Failed {
                reason: "generator thread exited".into(),
            },
            Some(_) => Health::Running {
                detail: format!(
                    "{} GPUs, target {} events/s, {} events produced, {} refused by a full ring",
                    self.config.gpus,
                    self.config.events_per_second,
                    self.pushed.load(Ordering::Relaxed),
                    self.refused.load(Ordering::Relaxed)
                ),
            },
        }
    }
}

impl Drop for MockBackend {
    fn drop(&mut self) {
        self.stop();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn generate(config: MockConfig, steps: u64) -> (Vec<Event>, Arc<Registry>) {
        let registry = Registry::new();
        let mut workload = Workload::new(&config, &registry, 1_000_000_000);
        let mut events = Vec::new();
        let end = 1_000_000_000 + steps * STEP_PERIOD_NS;
        while workload.next_time_ns() < end {
            workload.emit_next(&mut |e| events.push(e));
        }
        (events, registry)
    }

    #[test]
    fn same_seed_same_events_other_seed_other_events() {
        let config = MockConfig::default();
        let (a, _) = generate(config, 3);
        let (b, _) = generate(config, 3);
        assert_eq!(a, b);
        let (c, _) = generate(MockConfig { seed: 2, ..config }, 3);
        assert_ne!(a, c);
    }

    #[test]
    fn the_slow_step_scenario_makes_one_step_slow_and_leaves_the_rest() {
        let config = MockConfig {
            slow_step_after: Some(Duration::from_millis(120)),
            ..MockConfig::default()
        };
        let (events, _) = generate(config, 8);
        let durations: Vec<(i64, u64)> = events
            .iter()
            .filter_map(|e| match e.payload() {
                Payload::Step { step_num } => Some((step_num, e.duration_ns)),
                _ => None,
            })
            .collect();
        let normal = STEP_PERIOD_NS * 95 / 100;
        let slow: Vec<i64> = durations
            .iter()
            .filter(|(_, d)| *d != normal)
            .map(|(n, _)| *n)
            .collect();
        // Steps start at 0, 50 and 100 ms; the one at 150 ms is the first after 120 ms.
        assert_eq!(slow, vec![3]);
        assert_eq!(durations[3].1, normal * SLOW_STEP_FACTOR);
        let (plain, _) = generate(MockConfig::default(), 3);
        assert_eq!(&events[..plain.len()], &plain[..]);
    }

    #[test]
    fn the_dip_scenario_samples_utilisation_low_only_within_the_dip() {
        let config = MockConfig {
            utilization_dip: Some("100ms+100ms".parse().unwrap()),
            ..MockConfig::default()
        };
        let (events, _) = generate(config, 6);
        let samples: Vec<(u64, f64)> = events
            .iter()
            .filter_map(|e| match e.payload() {
                Payload::Counter { value } => Some((e.start_ns - 1_000_000_000, value)),
                _ => None,
            })
            .collect();
        assert_eq!(samples.len(), 6 * 2);
        for (at, value) in samples {
            let in_dip = (100_000_000..200_000_000).contains(&at);
            assert_eq!(
                value,
                if in_dip { DIP_PERCENT } else { BUSY_PERCENT },
                "at {at}"
            );
        }
        assert!("10s".parse::<Dip>().is_err());
    }

    #[test]
    fn rate_is_close_to_the_target() {
        for rate in [20_000u64, 1_000_000] {
            let config = MockConfig {
                events_per_second: rate,
                ..MockConfig::default()
            };
            let (events, _) = generate(config, 20);
            let seconds = 20.0 * STEP_PERIOD_NS as f64 / 1e9;
            let measured = events.len() as f64 / seconds;
            let ratio = measured / rate as f64;
            assert!((0.8..1.3).contains(&ratio), "rate {rate}: got {measured}/s");
        }
    }

    #[test]
    fn kernels_on_one_stream_never_overlap_and_match_their_launch() {
        let (events, _) = generate(MockConfig::default(), 4);
        for gpu in 0..2 {
            let mut kernels: Vec<&Event> = events
                .iter()
                .filter(|e| e.device() == Device::Gpu(gpu) && e.line == COMPUTE_STREAM)
                .collect();
            kernels.sort_by_key(|e| e.start_ns);
            assert!(kernels.len() > 10);
            for pair in kernels.windows(2) {
                assert!(pair[0].end_ns() <= pair[1].start_ns, "{pair:?}");
            }
            for kernel in kernels {
                let Payload::Kernel(info) = kernel.payload() else {
                    continue;
                };
                let launch = events
                    .iter()
                    .find(|e| {
                        matches!(e.payload(), Payload::ApiCall { correlation_id, .. } if correlation_id == info.correlation_id)
                    })
                    .expect("every kernel has its launch");
                assert!(launch.end_ns() <= kernel.start_ns);
            }
        }
    }

    #[test]
    fn allocations_balance_and_stay_within_steps() {
        let (events, registry) = generate(MockConfig::default(), 4);
        let names = registry.snapshot();
        let steps: Vec<&Event> = events
            .iter()
            .filter(|e| matches!(e.payload(), Payload::Step { .. }))
            .collect();
        assert_eq!(steps.len(), 4);
        let mut allocs = 0;
        let mut frees = 0;
        for e in &events {
            let info = match e.payload() {
                Payload::MemoryAllocation(info) => {
                    allocs += 1;
                    info
                }
                Payload::MemoryDeallocation(info) => {
                    frees += 1;
                    info
                }
                _ => continue,
            };
            assert!(names.name(info.allocator).ends_with("_bfc"));
            assert!(info.bytes_allocated <= info.peak_bytes_in_use);
            assert!(steps
                .iter()
                .any(|s| s.start_ns <= e.start_ns && e.start_ns < s.end_ns()));
        }
        assert!(allocs > 0 && frees > 0 && allocs - frees <= 2 * LIVE_TENSORS_PER_ALLOCATOR);
    }
}
