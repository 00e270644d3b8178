//! The NVML backend: device health from the NVIDIA Management Library,
//! sampled at a fixed interval into counter tracks on each GPU's plane
//! (`_counters_` line): SM and memory utilisation, memory used, power,
//! temperature, SM and memory clocks, PCIe throughput, ECC errors and
//! throttle reasons. XID errors (the driver's GPU error reports) come from
//! an NVML event set per GPU, drained without waiting each round: each one
//! is an instant named `XID <code>` on the GPU's `XID errors` line, a
//! `Last XID` sample with its code and an `XID errors` sample with the
//! GPU's running count since the agent started. Device facts (name, compute
//! capability, SMs, clocks, memory size and bandwidth) become plane stats.
//! The latest value of each metric per GPU is also kept for the metrics
//! endpoint ([`Backend::gpu_readings`]).
//!
//! The library is loaded at run time (`nvml-wrapper` uses `libloading`), so a
//! machine without an NVIDIA driver builds and runs devtrace; the backend then
//! reports that it is unavailable and stays off. A metric a device does not
//! support (XID events included) is skipped for that device from then on; a
//! device that falls off the bus is reported and no longer sampled.

use std::ffi::OsString;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use nvml_wrapper::bitmasks::event::EventTypes;
use nvml_wrapper::enum_wrappers::device::{
    Clock, EccCounter, MemoryError, PcieUtilCounter, TemperatureSensor,
};
use nvml_wrapper::enums::event::XidError;
use nvml_wrapper::enums::gpm::GpmMetricId;
use nvml_wrapper::error::NvmlError;
use nvml_wrapper::gpm::{gpm_metrics_get, GpmSample};
use nvml_wrapper::{Device as NvmlDevice, EventSet, Nvml};
use parking_lot::Mutex;

use super::worker::{pace, Worker};
use super::{Backend, BackendContext, BackendError, Capabilities, GpuReading, Health};
use crate::clock;
use crate::event::{Device, Event, NameId, Payload};
use crate::model::registry::{DeviceInfo, Registry};
use crate::model::timeline::{COUNTER_TRACK, XID_TRACK};

/// Name of the SM utilisation counter track (percent).
pub const SM_UTILIZATION: &str = "SM utilization (%)";

/// Counter tracks of XID errors: the running count since the agent
/// started, and the code of the latest.
pub const XID_ERRORS: &str = "XID errors";
pub const LAST_XID: &str = "Last XID";

/// Counter tracks of uncorrected ECC errors and of the throttle reasons
/// (NVML's bitmask, as a number).
pub const ECC_ERRORS: &str = "ECC uncorrected errors";
pub const THROTTLE_REASONS: &str = "Throttle reasons (bitmask)";

/// The code NVML reports for an XID it cannot name.
const UNKNOWN_XID: u64 = 999;

/// XID events drained from one GPU's set in one round, at most: a library
/// that never stops reporting must not keep the sampler from sampling.
const MAX_XIDS_PER_ROUND: usize = 64;

/// How an XID error is named: the instant's name and in trigger firings.
pub fn xid_label(code: u64) -> String {
    if code == UNKNOWN_XID {
        "XID unknown".into()
    } else {
        format!("XID {code}")
    }
}

/// Where NVML is looked for when no path is given.
pub const DEFAULT_LIBRARY: &str = "libnvidia-ml.so.1";

#[derive(Clone, Debug)]
pub struct NvmlConfig {
    /// The NVML shared library (a path or a name the loader resolves).
    pub library: OsString,
    /// Sampling interval while a capture or continuous session runs.
    pub interval: Duration,
    /// Sampling interval otherwise (the flight recorder still gets samples).
    pub idle_interval: Duration,
}

impl Default for NvmlConfig {
    fn default() -> Self {
        NvmlConfig {
            library: DEFAULT_LIBRARY.into(),
            interval: Duration::from_millis(10),
            idle_interval: Duration::from_secs(1),
        }
    }
}

/// The metrics sampled per device, in the order they are read.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Metric {
    Utilization,
    Memory,
    Power,
    Temperature,
    Clocks,
    Pcie,
    Ecc,
    Throttle,
    /// XID error events; read from the GPU's event set, not in [`METRICS`].
    Xid,
}

const METRICS: [Metric; 8] = [
    Metric::Utilization,
    Metric::Memory,
    Metric::Power,
    Metric::Temperature,
    Metric::Clocks,
    Metric::Pcie,
    Metric::Ecc,
    Metric::Throttle,
];

/// Counter names, interned once.
struct CounterNames {
    sm_util: NameId,
    mem_util: NameId,
    mem_used: NameId,
    power: NameId,
    temperature: NameId,
    sm_clock: NameId,
    mem_clock: NameId,
    pcie_tx: NameId,
    pcie_rx: NameId,
    ecc: NameId,
    throttle: NameId,
    xid_errors: NameId,
    last_xid: NameId,
    gpm_sm_util: NameId,
    gpm_sm_occupancy: NameId,
    gpm_tensor_util: NameId,
    gpm_dram_util: NameId,
}

impl CounterNames {
    fn new(registry: &Registry) -> CounterNames {
        CounterNames {
            sm_util: registry.intern(SM_UTILIZATION),
            mem_util: registry.intern("Memory utilization (%)"),
            mem_used: registry.intern("Memory used (bytes)"),
            power: registry.intern("Power (W)"),
            temperature: registry.intern("Temperature (C)"),
            sm_clock: registry.intern("SM clock (MHz)"),
            mem_clock: registry.intern("Memory clock (MHz)"),
            pcie_tx: registry.intern("PCIe TX (KB/s)"),
            pcie_rx: registry.intern("PCIe RX (KB/s)"),
            ecc: registry.intern(ECC_ERRORS),
            throttle: registry.intern(THROTTLE_REASONS),
            xid_errors: registry.intern(XID_ERRORS),
            last_xid: registry.intern(LAST_XID),
            gpm_sm_util: registry.intern("GPM SM utilization (%)"),
            gpm_sm_occupancy: registry.intern("GPM SM occupancy (%)"),
            gpm_tensor_util: registry.intern("GPM tensor activity (%)"),
            gpm_dram_util: registry.intern("GPM DRAM bandwidth utilization (%)"),
        }
    }
}

/// SMs from CUDA cores: NVML reports cores, XProf wants multiprocessors.
fn cores_per_sm(major: i32, minor: i32) -> u32 {
    match (major, minor) {
        (6, 0) | (7, _) | (8, 0) => 64,
        (3, _) => 192,
        _ => 128,
    }
}

fn describe(device: &NvmlDevice) -> DeviceInfo {
    let capability = device.cuda_compute_capability().ok();
    let (major, minor) = capability.map_or((0, 0), |c| (c.major, c.minor));
    let cores = device.num_cores().unwrap_or(0);
    let sm_clock = device.max_clock_info(Clock::SM).unwrap_or(0);
    let memory_clock = device.max_clock_info(Clock::Memory).unwrap_or(0);
    let bus_bits = device.memory_bus_width().unwrap_or(0);
    DeviceInfo {
        vendor: "Nvidia".into(),
        model: device.name().unwrap_or_else(|_| "NVIDIA GPU".into()),
        compute_capability: (major.max(0) as u32, minor.max(0) as u32),
        core_count: cores / cores_per_sm(major, minor),
        clock_rate_khz: u64::from(sm_clock) * 1000,
        memory_bytes: device.memory_info().map_or(0, |m| m.total),
        // Double data rate: two transfers per memory clock.
        memory_bandwidth_bytes_per_s: 2 * u64::from(memory_clock) * 1_000_000 * u64::from(bus_bits)
            / 8,
    }
}

/// What the sampler has seen, for health reports.
#[derive(Default)]
struct Status {
    devices: u32,
    lost: Vec<u32>,
    unsupported: Vec<(u32, Metric)>,
    errors: u64,
}

/// See the module documentation.
pub struct NvmlBackend {
    config: NvmlConfig,
    running: Option<Worker>,
    samples: Arc<AtomicU64>,
    status: Arc<Mutex<Status>>,
    /// The latest values of each GPU, published after each round.
    readings: Arc<Mutex<Vec<GpuReading>>>,
}

impl NvmlBackend {
    pub fn new(config: NvmlConfig) -> NvmlBackend {
        NvmlBackend {
            config,
            running: None,
            samples: Arc::default(),
            status: Arc::default(),
            readings: Arc::default(),
        }
    }
}

/// The loaded NVIDIA kernel module's version, when there is one (its
/// procfs entry shows in containers too).
pub fn kernel_module() -> Option<String> {
    let text = std::fs::read_to_string("/proc/driver/nvidia/version").ok()?;
    let first = text.lines().next()?;
    first
        .split_whitespace()
        .find(|word| word.starts_with(|c: char| c.is_ascii_digit()) && word.contains('.'))
        .map(str::to_string)
}

/// Whether NVML failing to initialise with `error` says this host has no
/// NVIDIA GPU (no library, or a library and no driver, with no kernel
/// module loaded) rather than a GPU whose counters cannot be read. One
/// rule for the backend and `devtrace doctor`.
pub fn init_failure_means_no_gpu(error: &NvmlError) -> bool {
    matches!(
        error,
        NvmlError::LibloadingError(_) | NvmlError::DriverNotLoaded
    ) && kernel_module().is_none()
}

/// The backend's device is here and cannot be used.
fn failed(reason: impl std::fmt::Display) -> BackendError {
    BackendError::Start {
        backend: "nvml",
        reason: reason.to_string(),
    }
}

fn unavailable(reason: impl std::fmt::Display) -> BackendError {
    BackendError::Unavailable {
        backend: "nvml",
        reason: reason.to_string(),
    }
}

impl Backend for NvmlBackend {
    fn name(&self) -> &'static str {
        "nvml"
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities {
            records: vec![
                "GPU utilisation, memory, power, temperature, clocks, PCIe, ECC, throttling, XID errors",
            ],
            max_delay: self.config.interval * 2,
            held_until_asked: std::time::Duration::ZERO,
        }
    }

    fn start(&mut self, context: BackendContext) -> Result<(), BackendError> {
        if self.running.is_some() {
            return Ok(());
        }
        let nvml = Nvml::builder()
            .lib_path(&self.config.library)
            .init()
            .map_err(|e| {
                let reason = format!("cannot load NVML from {:?}: {e}", self.config.library);
                if init_failure_means_no_gpu(&e) {
                    unavailable(reason)
                } else {
                    failed(reason)
                }
            })?;
        let count = nvml.device_count().map_err(failed)?;
        if count == 0 {
            return Err(unavailable("NVML reports no GPU"));
        }
        let mut latest = Vec::new();
        for index in 0..count {
            let device = nvml.device_by_index(index).map_err(failed)?;
            // NVML's index is the GPU's plane, so that the CUDA backend's
            // kernels (keyed by UUID) land beside these counters.
            let uuid = device.uuid().unwrap_or_default();
            if !uuid.is_empty() {
                context.registry.register_gpu(&uuid, index as u16);
            }
            latest.push(GpuReading {
                index,
                uuid,
                ..GpuReading::default()
            });
            context
                .registry
                .describe_device(Device::Gpu(index as u16), describe(&device));
        }
        let mut producer = context.producer().map_err(|e| BackendError::Start {
            backend: "nvml",
            reason: e.to_string(),
        })?;
        self.status.lock().devices = count;
        let names = CounterNames::new(&context.registry);
        let (samples, status) = (Arc::clone(&self.samples), Arc::clone(&self.status));
        let published = Arc::clone(&self.readings);
        let (interval, idle_interval) = (self.config.interval, self.config.idle_interval);
        let captures = Arc::clone(&context.captures);
        let registry = Arc::clone(&context.registry);
        let worker = Worker::spawn("nvml", move |stop| {
            let xids = (0..count)
                .filter_map(|gpu| watch_xids(&nvml, gpu, &status))
                .collect();
            let mut sampler = Sampler {
                nvml: &nvml,
                registry,
                names,
                status,
                xids,
                batch: Vec::new(),
                latest,
                gpm_previous: (0..count).map(|_| None).collect(),
                gpm: (0..count)
                    .map(|i| {
                        nvml.device_by_index(i)
                            .and_then(|d| d.gpm_support())
                            .unwrap_or(false)
                    })
                    .collect(),
            };
            while !stop.is_set() {
                sampler.sample_all(count);
                // A scrape holding the lock costs this round's publication,
                // never a wait: the next round publishes again.
                if let Some(mut shared) = published.try_lock() {
                    shared.clone_from(&sampler.latest);
                }
                samples.fetch_add(sampler.batch.len() as u64, Ordering::Relaxed);
                producer.push_batch(&sampler.batch);
                sampler.batch.clear();
                pace(&stop, &captures, interval, idle_interval);
            }
        })?;
        self.running = Some(worker);
        Ok(())
    }

    fn stop(&mut self) {
        if let Some(worker) = self.running.take() {
            worker.stop();
        }
    }

    fn health(&self) -> Health {
        if let Some(health) = Worker::not_running(self.running.as_ref(), "sampling") {
            return health;
        }
        let status = self.status.lock();
        let mut detail = format!(
            "{} GPUs, every {} ms during captures and {} ms otherwise, {} samples",
            status.devices,
            self.config.interval.as_millis(),
            self.config.idle_interval.as_millis(),
            self.samples.load(Ordering::Relaxed)
        );
        if !status.lost.is_empty() {
            detail.push_str(&format!(", lost GPUs: {:?}", status.lost));
        }
        if !status.unsupported.is_empty() {
            let list: Vec<String> = status
                .unsupported
                .iter()
                .map(|(gpu, metric)| format!("GPU {gpu} {metric:?}"))
                .collect();
            detail.push_str(&format!(", not supported: {}", list.join(", ")));
        }
        if status.errors > 0 {
            detail.push_str(&format!(", {} failed reads", status.errors));
        }
        if status.lost.len() as u32 == status.devices {
            return Health::Failed { reason: detail };
        }
        Health::Running { detail }
    }

    fn gpu_readings(&self) -> Vec<GpuReading> {
        self.readings.lock().clone()
    }
}

impl Drop for NvmlBackend {
    fn drop(&mut self) {
        self.stop();
    }
}

/// One GPU's XID errors: the event set it is registered with, and how many
/// it has reported since the agent started.
struct XidWatch<'n> {
    gpu: u32,
    set: EventSet<'n>,
    count: u64,
}

/// An event set with `gpu` registered for XID errors, or `None` (said once
/// in the log and in health) when the GPU or driver cannot report them: the
/// counters are sampled all the same.
fn watch_xids<'n>(nvml: &'n Nvml, gpu: u32, status: &Mutex<Status>) -> Option<XidWatch<'n>> {
    let registered = nvml.device_by_index(gpu).and_then(|device| {
        if !device
            .supported_event_types()?
            .contains(EventTypes::CRITICAL_XID_ERROR)
        {
            return Err(NvmlError::NotSupported);
        }
        let set = nvml.create_event_set()?;
        device
            .register_events(EventTypes::CRITICAL_XID_ERROR, set)
            .map_err(|e| e.error)
    });
    match registered {
        Ok(set) => Some(XidWatch { gpu, set, count: 0 }),
        Err(NvmlError::NotSupported) => {
            tracing::info!(
                gpu,
                "NVML: XID error events not supported on this GPU; not recorded"
            );
            status.lock().unsupported.push((gpu, Metric::Xid));
            None
        }
        Err(error) => {
            tracing::warn!(gpu, %error, "NVML: cannot watch this GPU's XID errors; not recorded");
            status.lock().unsupported.push((gpu, Metric::Xid));
            None
        }
    }
}

struct Sampler<'n> {
    nvml: &'n Nvml,
    /// For the names of XID instants, one per code seen.
    registry: Arc<Registry>,
    names: CounterNames,
    status: Arc<Mutex<Status>>,
    xids: Vec<XidWatch<'n>>,
    batch: Vec<Event>,
    /// The values last read, per device.
    latest: Vec<GpuReading>,
    /// Whether each device supports GPM (Hopper and newer).
    gpm: Vec<bool>,
    /// The previous GPM sample per device: metrics cover the interval
    /// between two samples.
    gpm_previous: Vec<Option<GpmSample<'n>>>,
}

impl<'n> Sampler<'n> {
    fn sample_all(&mut self, count: u32) {
        for index in 0..count {
            if self.status.lock().lost.contains(&index) {
                continue;
            }
            if self.gpm[index as usize] {
                if let Err(error) = self.read_gpm(index) {
                    tracing::info!(gpu = index, %error, "NVML: GPM metrics unavailable; no longer read");
                    self.gpm[index as usize] = false;
                }
            }
            for metric in METRICS {
                let skipped = self.status.lock().unsupported.contains(&(index, metric));
                if skipped {
                    continue;
                }
                match self.read(index, metric) {
                    Ok(()) => {}
                    Err(NvmlError::NotSupported) => {
                        tracing::info!(
                            gpu = index,
                            ?metric,
                            "NVML: not supported on this GPU; no longer read"
                        );
                        self.status.lock().unsupported.push((index, metric));
                    }
                    Err(NvmlError::GpuLost) => {
                        tracing::warn!(
                            gpu = index,
                            "NVML: GPU has fallen off the bus; no longer sampled"
                        );
                        self.status.lock().lost.push(index);
                        let reading = &mut self.latest[index as usize];
                        *reading = GpuReading {
                            index,
                            uuid: std::mem::take(&mut reading.uuid),
                            ..GpuReading::default()
                        };
                        break;
                    }
                    Err(error) => {
                        tracing::debug!(gpu = index, ?metric, %error, "NVML read failed");
                        self.status.lock().errors += 1;
                    }
                }
            }
        }
        // After the counters, which find the GPUs that fell off the bus.
        self.drain_xids(count);
    }

    fn counter(&mut self, gpu: u32, name: NameId, value: f64) {
        self.counter_at(clock::now_ns(), gpu, name, value);
    }

    fn counter_at(&mut self, at_ns: u64, gpu: u32, name: NameId, value: f64) {
        self.batch.push(Event::new(
            at_ns,
            0,
            Device::Gpu(gpu as u16),
            COUNTER_TRACK,
            name,
            Payload::Counter { value },
        ));
    }

    /// The XID errors each watched GPU reported since the last round, and
    /// its running count, which a trigger compares sample to sample.
    fn drain_xids(&mut self, count: u32) {
        let mut xids = std::mem::take(&mut self.xids);
        for watch in &mut xids {
            if self.status.lock().lost.contains(&watch.gpu) {
                continue;
            }
            let mut reported = false;
            for _ in 0..MAX_XIDS_PER_ROUND {
                let data = match watch.set.wait(0) {
                    Ok(data) => data,
                    // Nothing pending; a lost GPU is found by the counters.
                    Err(NvmlError::Timeout | NvmlError::GpuLost) => break,
                    Err(error) => {
                        tracing::debug!(gpu = watch.gpu, %error, "NVML event wait failed");
                        self.status.lock().errors += 1;
                        break;
                    }
                };
                let Some(xid) = data.event_data else {
                    continue;
                };
                let code = match xid {
                    XidError::Value(code) => code,
                    XidError::Unknown => UNKNOWN_XID,
                };
                // The event names its device; the set's own GPU stands in
                // for a handle NVML cannot place.
                let gpu = data
                    .device
                    .index()
                    .ok()
                    .filter(|index| *index < count)
                    .unwrap_or(watch.gpu);
                watch.count += 1;
                reported = true;
                let at_ns = clock::now_ns();
                let name = self.registry.intern(&xid_label(code));
                self.batch.push(Event::new(
                    at_ns,
                    0,
                    Device::Gpu(gpu as u16),
                    XID_TRACK,
                    name,
                    Payload::Plain,
                ));
                // The code before the count: a trigger on the count names it.
                self.counter_at(at_ns, gpu, self.names.last_xid, code as f64);
                self.counter_at(at_ns, gpu, self.names.xid_errors, watch.count as f64);
            }
            if !reported {
                self.counter(watch.gpu, self.names.xid_errors, watch.count as f64);
            }
        }
        self.xids = xids;
    }

    /// GPM metrics over the interval since this device's previous sample.
    fn read_gpm(&mut self, index: u32) -> Result<(), NvmlError> {
        let sample = self.nvml.device_by_index(index)?.gpm_sample()?;
        let previous = self.gpm_previous[index as usize].replace(sample);
        let (Some(previous), Some(current)) = (previous, &self.gpm_previous[index as usize]) else {
            return Ok(());
        };
        let metrics = [
            (GpmMetricId::SmUtil, self.names.gpm_sm_util),
            (GpmMetricId::SmOccupancy, self.names.gpm_sm_occupancy),
            (GpmMetricId::AnyTensorUtil, self.names.gpm_tensor_util),
            (GpmMetricId::DramBwUtil, self.names.gpm_dram_util),
        ];
        let ids: Vec<GpmMetricId> = metrics.iter().map(|(id, _)| *id).collect();
        let results = gpm_metrics_get(self.nvml, &previous, current, &ids)?;
        for ((_, name), result) in metrics.iter().zip(results) {
            if let Ok(metric) = result {
                self.counter(index, *name, metric.value);
            }
        }
        Ok(())
    }

    fn read(&mut self, index: u32, metric: Metric) -> Result<(), NvmlError> {
        let device = self.nvml.device_by_index(index)?;
        let n = &self.names;
        let latest = &mut self.latest[index as usize];
        let values: Vec<(NameId, f64)> = match metric {
            Metric::Utilization => {
                let u = device.utilization_rates()?;
                latest.sm_utilization_percent = Some(f64::from(u.gpu));
                latest.memory_utilization_percent = Some(f64::from(u.memory));
                vec![
                    (n.sm_util, f64::from(u.gpu)),
                    (n.mem_util, f64::from(u.memory)),
                ]
            }
            Metric::Memory => {
                let memory = device.memory_info()?;
                latest.memory_used_bytes = Some(memory.used as f64);
                latest.memory_total_bytes = Some(memory.total as f64);
                vec![(n.mem_used, memory.used as f64)]
            }
            Metric::Power => {
                let watts = f64::from(device.power_usage()?) / 1000.0;
                latest.power_watts = Some(watts);
                vec![(n.power, watts)]
            }
            Metric::Temperature => {
                let celsius = f64::from(device.temperature(TemperatureSensor::Gpu)?);
                latest.temperature_celsius = Some(celsius);
                vec![(n.temperature, celsius)]
            }
            Metric::Clocks => {
                let sm = f64::from(device.clock_info(Clock::SM)?);
                let memory = f64::from(device.clock_info(Clock::Memory)?);
                latest.sm_clock_mhz = Some(sm);
                latest.memory_clock_mhz = Some(memory);
                vec![(n.sm_clock, sm), (n.mem_clock, memory)]
            }
            Metric::Pcie => vec![
                (
                    n.pcie_tx,
                    f64::from(device.pcie_throughput(PcieUtilCounter::Send)?),
                ),
                (
                    n.pcie_rx,
                    f64::from(device.pcie_throughput(PcieUtilCounter::Receive)?),
                ),
            ],
            Metric::Ecc => vec![(
                n.ecc,
                device.total_ecc_errors(MemoryError::Uncorrected, EccCounter::Aggregate)? as f64,
            )],
            Metric::Throttle => {
                vec![(n.throttle, device.current_throttle_reasons()?.bits() as f64)]
            }
            // Drained from the GPU's event set each round instead.
            Metric::Xid => Vec::new(),
        };
        for (name, value) in values {
            self.counter(index, name, value);
        }
        Ok(())
    }
}
