//! What a workload process says about the devices it uses, in the form
//! both sides of the metadata file share.

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

/// A GPU UUID's 16 bytes in NVML's text form, `GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx`.
pub fn gpu_uuid_text(bytes: &[u8; 16]) -> String {
    let hex = |range: std::ops::Range<usize>| {
        bytes[range]
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect::<String>()
    };
    format!(
        "GPU-{}-{}-{}-{}-{}",
        hex(0..4),
        hex(4..6),
        hex(6..8),
        hex(8..10),
        hex(10..16)
    )
}
