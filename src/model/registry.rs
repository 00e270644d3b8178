//! Everything an event refers to but does not carry: interned names, the names
//! of lines (threads, streams), and per-device facts such as compute capability.
//!
//! GPUs are planes by physical device: a process's CUDA ordinal depends on
//! its `CUDA_VISIBLE_DEVICES`, so backends key GPUs by UUID and the registry
//! gives each UUID one plane id, NVML's index where NVML named it first
//! (nvidia-smi's order), else the next id no GPU holds.
//!
//! Backends fill the registry when they start or discover something new; the
//! XSpace builder reads a [`RegistrySnapshot`] so that a capture sees one
//! consistent view without holding locks while it builds.
//!
//! Many names come from peers (workload metadata, tapped RPCs), so the table
//! is bounded: a name longer than [`MAX_NAME_BYTES`] is cut (marked with
//! `…`), and once [`MAX_NAMES`] names or [`MAX_NAME_TABLE_BYTES`] bytes are
//! held, new names read as [`TABLE_FULL_NAME`] and are counted
//! ([`Registry::names_refused`]), which every capture reports. Ids are never
//! reused, so an event can never show another event's name.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use parking_lot::RwLock;

use crate::event::{Device, NameId};
pub use devtrace_shm::device::{gpu_uuid_text, DeviceInfo};

/// The longest name kept whole, in bytes.
pub const MAX_NAME_BYTES: usize = 4096;
/// How many names the table holds at most.
pub const MAX_NAMES: usize = 1 << 20;
/// How many bytes of names the table holds at most.
pub const MAX_NAME_TABLE_BYTES: usize = 128 << 20;
/// What a name reads as once the table is full.
pub const TABLE_FULL_NAME: &str = "<name not kept: the agent's name table is full>";

#[derive(Default)]
struct Names {
    ids: HashMap<Arc<str>, NameId>,
    strings: Vec<Arc<str>>,
    bytes: usize,
    /// Names refused because the table was full.
    refused: u64,
    full: Option<NameId>,
}

/// `name` cut to at most [`MAX_NAME_BYTES`] at a character boundary.
fn bounded(name: &str) -> std::borrow::Cow<'_, str> {
    if name.len() <= MAX_NAME_BYTES {
        return name.into();
    }
    let mut end = MAX_NAME_BYTES - '…'.len_utf8();
    while !name.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}…", &name[..end]).into()
}

/// Shared by every backend and the collector of one agent.
pub struct Registry {
    names: RwLock<Names>,
    lines: RwLock<HashMap<(Device, u64), NameId>>,
    devices: RwLock<BTreeMap<Device, DeviceInfo>>,
    /// Plane id of each physical GPU, by UUID.
    gpus: RwLock<HashMap<String, u16>>,
}

impl Default for Registry {
    fn default() -> Self {
        let empty: Arc<str> = Arc::from("");
        let mut names = Names::default();
        names.ids.insert(empty.clone(), NameId(0));
        names.strings.push(empty);
        Registry {
            names: RwLock::new(names),
            lines: RwLock::default(),
            devices: RwLock::default(),
            gpus: RwLock::default(),
        }
    }
}

impl Names {
    fn add(names: &mut Names, name: &str) -> NameId {
        let id = NameId(names.strings.len() as u32);
        let shared: Arc<str> = Arc::from(name);
        names.bytes += shared.len();
        names.strings.push(shared.clone());
        names.ids.insert(shared, id);
        id
    }
}

impl Registry {
    pub fn new() -> Arc<Registry> {
        Arc::new(Registry::default())
    }

    /// Returns the id of `name`, adding it the first time it is seen (cut
    /// to [`MAX_NAME_BYTES`]; [`TABLE_FULL_NAME`]'s id once the table is full).
    pub fn intern(&self, name: &str) -> NameId {
        let name = bounded(name);
        if let Some(id) = self.names.read().ids.get(&*name) {
            return *id;
        }
        let mut names = self.names.write();
        if let Some(id) = names.ids.get(&*name) {
            return *id;
        }
        if names.strings.len() >= MAX_NAMES || names.bytes + name.len() > MAX_NAME_TABLE_BYTES {
            names.refused += 1;
            if let Some(full) = names.full {
                return full;
            }
            // The one name kept beyond the bounds.
            let full = Names::add(&mut names, TABLE_FULL_NAME);
            names.full = Some(full);
            return full;
        }
        Names::add(&mut names, &name)
    }

    /// The string behind `id`, if it was interned.
    pub fn name_of(&self, id: NameId) -> Option<Arc<str>> {
        self.names.read().strings.get(id.0 as usize).cloned()
    }

    /// Names [`Registry::intern`] refused since the agent started because
    /// the table was full.
    pub fn names_refused(&self) -> u64 {
        self.names.read().refused
    }

    /// Names a line (a thread on the host, a stream on a device).
    pub fn name_line(&self, device: Device, line: u64, name: &str) {
        let id = self.intern(name);
        self.lines.write().insert((device, line), id);
    }

    /// Records what is known about a device; replaces earlier facts.
    pub fn describe_device(&self, device: Device, info: DeviceInfo) {
        self.devices.write().insert(device, info);
    }

    /// Records facts about a device only if none are known: for what a peer
    /// says (a workload's metadata), which must not rewrite what NVML or
    /// another process said first.
    pub fn describe_device_if_unknown(&self, device: Device, info: DeviceInfo) {
        self.devices.write().entry(device).or_insert(info);
    }

    /// Records that the GPU `uuid` is plane `plane` (NVML's index). A UUID
    /// already placed keeps its plane.
    pub fn register_gpu(&self, uuid: &str, plane: u16) {
        self.gpus
            .write()
            .entry(uuid.to_ascii_lowercase())
            .or_insert(plane);
    }

    /// The plane of the GPU `uuid`, placing it on the lowest free id the
    /// first time (a GPU NVML did not name, or no NVML).
    pub fn gpu_plane(&self, uuid: &str) -> u16 {
        let uuid = uuid.to_ascii_lowercase();
        if let Some(plane) = self.gpus.read().get(&uuid) {
            return *plane;
        }
        let mut gpus = self.gpus.write();
        let taken: std::collections::HashSet<u16> = gpus.values().copied().collect();
        let free = (0..=u16::MAX).find(|id| !taken.contains(id)).unwrap_or(0);
        *gpus.entry(uuid).or_insert(free)
    }

    pub fn snapshot(&self) -> RegistrySnapshot {
        RegistrySnapshot {
            names: self.names.read().strings.clone(),
            lines: self.lines.read().clone(),
            devices: self.devices.read().clone(),
        }
    }
}

/// A consistent copy of the registry taken at one moment.
#[derive(Clone, Debug, Default)]
pub struct RegistrySnapshot {
    names: Vec<Arc<str>>,
    lines: HashMap<(Device, u64), NameId>,
    devices: BTreeMap<Device, DeviceInfo>,
}

impl RegistrySnapshot {
    /// The string behind `id`; ids unknown to this snapshot read as "".
    pub fn name(&self, id: NameId) -> &str {
        self.names.get(id.0 as usize).map_or("", |s| s)
    }

    pub fn line_name(&self, device: Device, line: u64) -> Option<&str> {
        self.lines.get(&(device, line)).map(|id| self.name(*id))
    }

    pub fn device_info(&self, device: Device) -> Option<&DeviceInfo> {
        self.devices.get(&device)
    }

    /// Every device described so far, in plane order.
    pub fn devices(&self) -> impl Iterator<Item = Device> + '_ {
        self.devices.keys().copied()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn interning_is_stable_and_snapshots_resolve() {
        let registry = Registry::new();
        let a = registry.intern("MatMul");
        let b = registry.intern("Conv2D");
        assert_ne!(a, b);
        assert_eq!(registry.intern("MatMul"), a);
        assert_eq!(registry.intern(""), NameId(0));
        registry.name_line(Device::Host, 17, "python");
        let snapshot = registry.snapshot();
        assert_eq!(snapshot.name(a), "MatMul");
        assert_eq!(snapshot.name(NameId(9999)), "");
        assert_eq!(snapshot.line_name(Device::Host, 17), Some("python"));
        assert_eq!(snapshot.line_name(Device::Gpu(0), 17), None);
    }

    #[test]
    fn long_names_are_cut_at_a_character_boundary() {
        let registry = Registry::new();
        let long = "é".repeat(MAX_NAME_BYTES);
        let id = registry.intern(&long);
        let snapshot = registry.snapshot();
        let kept = snapshot.name(id);
        assert!(
            kept.len() <= MAX_NAME_BYTES && kept.ends_with('…'),
            "{}",
            kept.len()
        );
        assert!(long.starts_with(kept.trim_end_matches('…')));
        // The same long name maps to the same id.
        assert_eq!(registry.intern(&long), id);
    }

    #[test]
    fn a_full_table_refuses_new_names_and_counts_them() {
        let registry = Registry::new();
        let first = registry.intern("kept");
        for n in 0..MAX_NAMES {
            registry.intern(&format!("n{n}"));
        }
        let refused = registry.names_refused();
        assert!(refused > 0);
        let late = registry.intern("late");
        assert_eq!(registry.names_refused(), refused + 1);
        let snapshot = registry.snapshot();
        assert_eq!(snapshot.name(late), TABLE_FULL_NAME);
        // Names already held keep their ids.
        assert_eq!(registry.intern("kept"), first);
        assert_eq!(snapshot.name(first), "kept");
    }

    #[test]
    fn a_peer_cannot_rewrite_what_is_known_of_a_device() {
        let registry = Registry::new();
        let real = DeviceInfo {
            model: "H200".into(),
            ..DeviceInfo::default()
        };
        registry.describe_device(Device::Gpu(0), real.clone());
        let forged = DeviceInfo {
            model: "forged".into(),
            ..DeviceInfo::default()
        };
        registry.describe_device_if_unknown(Device::Gpu(0), forged.clone());
        registry.describe_device_if_unknown(Device::Gpu(1), forged.clone());
        let snapshot = registry.snapshot();
        assert_eq!(snapshot.device_info(Device::Gpu(0)), Some(&real));
        assert_eq!(snapshot.device_info(Device::Gpu(1)), Some(&forged));
    }

    #[test]
    fn gpus_keep_nvml_order_and_others_take_free_planes() {
        let registry = Registry::new();
        registry.register_gpu("GPU-AAAA", 0);
        registry.register_gpu("GPU-bbbb", 1);
        assert_eq!(registry.gpu_plane("GPU-bbbb"), 1);
        assert_eq!(registry.gpu_plane("gpu-aaaa"), 0);
        // Unknown to NVML: the lowest free id, then stable.
        assert_eq!(registry.gpu_plane("MIG-cccc"), 2);
        assert_eq!(registry.gpu_plane("MIG-cccc"), 2);
        assert_eq!(
            gpu_uuid_text(&[0x5e, 0x7a, 0x4d, 0x1b, 0, 0, 0x40, 0, 0x80, 0, 0, 0, 0, 0, 0, 3]),
            "GPU-5e7a4d1b-0000-4000-8000-000000000003"
        );
    }
}
