//! Kernel stats: GPU kernels aggregated by launch configuration, as XProf's
//! `kernel_stats` tool aggregates them.
//!
//! A kernel is an event on a `/device:GPU:<n>` plane, on a line outside
//! XProf's derived range, with a positive duration and a non-empty
//! `kernel_details` stat (`regs:R static_shared:S dynamic_shared:D
//! grid:X,Y,Z block:X,Y,Z occ_pct:P`, parsed as XProf parses it). Kernels
//! with the same name (event metadata name), grid, block, registers, shared
//! memory (static + dynamic) and op (name part of the `tf_op` stat) are one
//! row with their count and total / min / max / mean duration. Rows are
//! sorted by total duration, longest first.

use std::collections::HashMap;

use crate::proto::tensorflow::profiler::XSpace;

use super::json::{self, Array, Object};
use super::stats::{get, str_or_ref_value};
use super::{gpu_planes, is_derived_line, ToolError};

/// Launch parameters from a `kernel_details` string.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct KernelDetails {
    pub registers_per_thread: u32,
    pub static_shared_bytes: u32,
    pub dynamic_shared_bytes: u32,
    pub grid: [u32; 3],
    pub block: [u32; 3],
    pub occupancy_pct: f64,
}

impl Default for KernelDetails {
    fn default() -> Self {
        KernelDetails {
            registers_per_thread: 0,
            static_shared_bytes: 0,
            dynamic_shared_bytes: 0,
            grid: [1, 1, 1],
            block: [1, 1, 1],
            occupancy_pct: 0.0,
        }
    }
}

/// XProf's `ParseKernelLaunchParams`: tokens separated by spaces or
/// newlines, each `key:value`; unknown or malformed tokens are ignored, and
/// grid and block default to 1,1,1.
pub fn parse_kernel_details(details: &str) -> KernelDetails {
    let mut parsed = KernelDetails::default();
    let dims = |value: &str| -> Option<[u32; 3]> {
        let parts: Vec<&str> = value.split(',').collect();
        match parts.as_slice() {
            [x, y, z] => Some([
                x.trim().parse().ok()?,
                y.trim().parse().ok()?,
                z.trim().parse().ok()?,
            ]),
            _ => None,
        }
    };
    for token in details.split([' ', '\n']) {
        let mut parts = token.split(':');
        let (Some(key), Some(value), None) = (parts.next(), parts.next(), parts.next()) else {
            continue;
        };
        let number = || value.trim().parse::<u32>().ok();
        match key {
            "regs" => {
                if let Some(v) = number() {
                    parsed.registers_per_thread = v;
                }
            }
            "static_shared" => {
                if let Some(v) = number() {
                    parsed.static_shared_bytes = v;
                }
            }
            "dynamic_shared" => {
                if let Some(v) = number() {
                    parsed.dynamic_shared_bytes = v;
                }
            }
            "grid" => {
                if let Some(v) = dims(value) {
                    parsed.grid = v;
                }
            }
            "block" => {
                if let Some(v) = dims(value) {
                    parsed.block = v;
                }
            }
            "occ_pct" => {
                if let Ok(v) = value.trim().parse::<f64>() {
                    parsed.occupancy_pct = v;
                }
            }
            _ => {}
        }
    }
    parsed
}

/// Kernel-name substrings XProf takes as tensor-core kernels.
const TENSOR_CORE_KERNELS: [&str; 19] = [
    "16816",
    "c1688",
    "conv1x1",
    "conv2d_c1_k1",
    "dgrad_1x1_stride_2x2",
    "direct_group",
    "first_layer_wgrad_kernel",
    "h1688",
    "h884",
    "hmma",
    "i16832",
    "i8816",
    "s884",
    "s1688",
    "xmma_gemm",
    "xmma_implicit_gemm",
    "xmma_sparse_conv",
    "xmma_sparse_gemm",
    "xmma_warp_specialized_implicit_gemm",
];

/// True when XProf would report the kernel as using tensor cores.
pub fn uses_tensor_core(kernel_name: &str) -> bool {
    TENSOR_CORE_KERNELS.iter().any(|s| kernel_name.contains(s))
}

/// One row: a kernel and launch configuration, over all its launches.
#[derive(Clone, Debug, PartialEq)]
pub struct KernelStat {
    pub kernel_name: String,
    /// Framework op that launched it (name part of `tf_op`), "" if unknown.
    pub op_name: String,
    pub registers_per_thread: u32,
    /// Static plus dynamic shared memory per block.
    pub shared_memory_bytes: u64,
    pub block: [u32; 3],
    pub grid: [u32; 3],
    /// Occupancy of the first launch seen.
    pub occupancy_pct: f64,
    pub uses_tensor_core: bool,
    pub occurrences: u64,
    pub total_duration_ps: i64,
    pub min_duration_ps: i64,
    pub max_duration_ps: i64,
}

impl KernelStat {
    pub fn mean_duration_ps(&self) -> f64 {
        self.total_duration_ps as f64 / self.occurrences.max(1) as f64
    }
}

/// The kernel stats of a trace.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct KernelStats {
    /// Rows, longest total duration first.
    pub kernels: Vec<KernelStat>,
    /// Names of the GPU planes read.
    pub devices: Vec<String>,
}

impl KernelStats {
    /// Launches over all rows.
    pub fn total_occurrences(&self) -> u64 {
        self.kernels.iter().map(|k| k.occurrences).sum()
    }

    /// Kernel time over all rows, picoseconds.
    pub fn total_duration_ps(&self) -> i64 {
        self.kernels.iter().map(|k| k.total_duration_ps).sum()
    }

    /// `{"devices": [...], "total_occurrences": n, "total_duration_us": t,
    /// "kernels": [{"rank": 1, "kernel_name": ..., "op_name": ...,
    /// "registers_per_thread", "shmem_bytes", "block_dim": [x,y,z],
    /// "grid_dim": [x,y,z], "occupancy_pct", "is_kernel_using_tensor_core",
    /// "occurrences", "total_duration_us", "avg_duration_us",
    /// "min_duration_us", "max_duration_us"}, ...]}`.
    pub fn to_json(&self) -> String {
        let us = |ps: f64| ps / 1e6;
        let mut out = String::new();
        let mut o = Object::new(&mut out);
        {
            let mut devices = Array::new(o.key("devices"));
            for d in &self.devices {
                json::string(devices.item(), d);
            }
            devices.end();
        }
        o.raw("total_occurrences", self.total_occurrences());
        o.num("total_duration_us", us(self.total_duration_ps() as f64));
        let mut rows = Array::new(o.key("kernels"));
        for (rank, k) in self.kernels.iter().enumerate() {
            let mut r = Object::new(rows.item());
            r.raw("rank", rank + 1);
            r.str("kernel_name", &k.kernel_name);
            r.str("op_name", &k.op_name);
            r.raw("registers_per_thread", k.registers_per_thread);
            r.raw("shmem_bytes", k.shared_memory_bytes);
            r.raw(
                "block_dim",
                format_args!("[{},{},{}]", k.block[0], k.block[1], k.block[2]),
            );
            r.raw(
                "grid_dim",
                format_args!("[{},{},{}]", k.grid[0], k.grid[1], k.grid[2]),
            );
            r.num("occupancy_pct", k.occupancy_pct);
            r.raw("is_kernel_using_tensor_core", k.uses_tensor_core);
            r.raw("occurrences", k.occurrences);
            r.num("total_duration_us", us(k.total_duration_ps as f64));
            r.num("avg_duration_us", us(k.mean_duration_ps()));
            r.num("min_duration_us", us(k.min_duration_ps as f64));
            r.num("max_duration_us", us(k.max_duration_ps as f64));
            r.end();
        }
        rows.end();
        o.end();
        out
    }
}

/// Aggregation key: name, grid, block, registers, shared memory, op.
type Key = (String, [u32; 3], [u32; 3], u32, u64, String);

/// Kernel stats over every GPU plane of `space`; fails when it has none.
pub fn kernel_stats(space: &XSpace) -> Result<KernelStats, ToolError> {
    let planes = gpu_planes(space)?;
    let mut rows: HashMap<Key, KernelStat> = HashMap::new();
    for plane in &planes {
        for line in plane.lines.iter().filter(|l| !is_derived_line(l.id)) {
            for event in line.events.iter().filter(|e| e.duration_ps > 0) {
                let Some(details) = get(plane, &event.stats, "kernel_details")
                    .map(|s| str_or_ref_value(plane, s))
                    .filter(|d| !d.is_empty())
                else {
                    continue;
                };
                let details = parse_kernel_details(details);
                let name = plane
                    .event_metadata
                    .get(&event.metadata_id)
                    .map_or("", |m| m.name.as_str());
                let op = get(plane, &event.stats, "tf_op")
                    .map(|s| str_or_ref_value(plane, s))
                    .map_or("", |op| op.split_once(':').map_or(op, |(name, _)| name));
                let shared = u64::from(details.static_shared_bytes)
                    + u64::from(details.dynamic_shared_bytes);
                let key = (
                    name.to_string(),
                    details.grid,
                    details.block,
                    details.registers_per_thread,
                    shared,
                    op.to_string(),
                );
                let duration = event.duration_ps;
                rows.entry(key)
                    .and_modify(|row| {
                        row.occurrences += 1;
                        row.total_duration_ps = row.total_duration_ps.saturating_add(duration);
                        row.min_duration_ps = row.min_duration_ps.min(duration);
                        row.max_duration_ps = row.max_duration_ps.max(duration);
                    })
                    .or_insert_with(|| KernelStat {
                        kernel_name: name.to_string(),
                        op_name: op.to_string(),
                        registers_per_thread: details.registers_per_thread,
                        shared_memory_bytes: shared,
                        block: details.block,
                        grid: details.grid,
                        occupancy_pct: details.occupancy_pct,
                        uses_tensor_core: uses_tensor_core(name),
                        occurrences: 1,
                        total_duration_ps: duration,
                        min_duration_ps: duration,
                        max_duration_ps: duration,
                    });
            }
        }
    }
    let mut kernels: Vec<KernelStat> = rows.into_values().collect();
    kernels.sort_by(|a, b| {
        b.total_duration_ps
            .cmp(&a.total_duration_ps)
            .then_with(|| a.kernel_name.cmp(&b.kernel_name))
            .then_with(|| a.op_name.cmp(&b.op_name))
            .then_with(|| a.grid.cmp(&b.grid))
            .then_with(|| a.block.cmp(&b.block))
            .then_with(|| a.registers_per_thread.cmp(&b.registers_per_thread))
            .then_with(|| a.shared_memory_bytes.cmp(&b.shared_memory_bytes))
    });
    Ok(KernelStats {
        kernels,
        devices: planes.iter().map(|p| p.name.clone()).collect(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn details_parse_like_xprof() {
        let d = parse_kernel_details(
            "regs:128 static_shared:0 dynamic_shared:32768 grid:16,8,1 block:256,1,1 occ_pct:25",
        );
        assert_eq!(d.registers_per_thread, 128);
        assert_eq!(d.dynamic_shared_bytes, 32768);
        assert_eq!(d.grid, [16, 8, 1]);
        assert_eq!(d.block, [256, 1, 1]);
        assert_eq!(d.occupancy_pct, 25.0);
        let d = parse_kernel_details("regs:x grid:1,2 junk a:b:c\nstatic_shared:12");
        assert_eq!(d.registers_per_thread, 0);
        assert_eq!(d.grid, [1, 1, 1]);
        assert_eq!(d.static_shared_bytes, 12);
    }

    #[test]
    fn tensor_core_names_and_missing_gpu() {
        assert!(uses_tensor_core("volta_h884gemm_64x64_ldg8_nn"));
        assert!(!uses_tensor_core("implicit_convolve_sgemm"));
        assert!(matches!(
            kernel_stats(&XSpace::default()),
            Err(ToolError::NoDevicePlanes { .. })
        ));
    }
}
