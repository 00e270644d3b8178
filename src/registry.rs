//! Everything an event refers to but does not carry: interned names, the names
//! of lines (threads, streams), and per-device facts such as compute capability.
//!
//! Backends fill the registry when they start or discover something new; the
//! XSpace builder reads a [`RegistrySnapshot`] so that a capture sees one
//! consistent view without holding locks while it builds.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use parking_lot::RwLock;

use crate::event::{Device, NameId};

/// Static facts about a device, written as plane-level stats.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct DeviceInfo {
    pub vendor: String,
    pub model: String,
    pub compute_capability: (u32, u32),
    pub core_count: u32,
    pub clock_rate_khz: u64,
    pub memory_bytes: u64,
    pub memory_bandwidth_bytes_per_s: u64,
}

#[derive(Default)]
struct Names {
    ids: HashMap<Arc<str>, NameId>,
    strings: Vec<Arc<str>>,
}

/// Shared by every backend and the collector of one agent.
pub struct Registry {
    names: RwLock<Names>,
    lines: RwLock<HashMap<(Device, u64), NameId>>,
    devices: RwLock<BTreeMap<Device, DeviceInfo>>,
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
        }
    }
}

impl Registry {
    pub fn new() -> Arc<Registry> {
        Arc::new(Registry::default())
    }

    /// Returns the id of `name`, adding it the first time it is seen.
    pub fn intern(&self, name: &str) -> NameId {
        if let Some(id) = self.names.read().ids.get(name) {
            return *id;
        }
        let mut names = self.names.write();
        if let Some(id) = names.ids.get(name) {
            return *id;
        }
        let id = NameId(names.strings.len() as u32);
        let shared: Arc<str> = Arc::from(name);
        names.strings.push(shared.clone());
        names.ids.insert(shared, id);
        id
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
}
