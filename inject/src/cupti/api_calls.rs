//! Which driver and runtime API calls CUPTI records during a capture.
//!
//! Recording a call costs the workload on every call, so by default only
//! the calls that put work on the GPU timeline are recorded (their records
//! carry the correlation ids that tie kernels, copies and memsets to the
//! host): the callback ids of [`DRIVER_FAMILIES`] and [`RUNTIME_FAMILIES`],
//! listed in [`DRIVER`] and [`RUNTIME`]. CUPTI selects them one by one with
//! `cuptiActivityEnableDriverApi` and `cuptiActivityEnableRuntimeApi`
//! (declared in CUDA 12.8's headers and 13.x's, not in 12.2's), called *without*
//! enabling the DRIVER and RUNTIME kinds, which would record every call and
//! override the selection. A capture that asks for every call gets the two
//! kinds, as does any capture where the libcupti lacks the per-call entry
//! points.

use std::sync::OnceLock;

use devtrace_shm::workload::ApiRecordSet;

use super::library::{CuptiResult, EnableApi, CUPTI_SUCCESS};
use super::{check, kind, lib};

/// Driver API names whose calls are recorded by default: every callback
/// whose name starts with one of these. (Read by the header check, which
/// holds [`DRIVER`] to them.)
#[cfg_attr(not(test), allow(dead_code))]
pub const DRIVER_FAMILIES: [&str; 6] = [
    "cuLaunch",
    "cuGraphLaunch",
    "cuMemcpy",
    "cuMemset",
    "cuMemAlloc",
    "cuMemFree",
];

/// Runtime API names whose calls are recorded by default.
#[cfg_attr(not(test), allow(dead_code))]
pub const RUNTIME_FAMILIES: [&str; 6] = [
    "cudaLaunch",
    "cudaGraphLaunch",
    "cudaMemcpy",
    "cudaMemset",
    "cudaMalloc",
    "cudaFree",
];

/// What a per-call enable answers for a callback id its release does not
/// have (one added after it).
const CUPTI_ERROR_INVALID_PARAMETER: CuptiResult = 1;

// The callbacks of the families in CUDA 13.x's `cupti_driver_cbid.h` and
// `cupti_runtime_cbid.h` (ids never change between releases; the header
// check holds this table to every release's headers and to the families).
/// `CUPTI_DRIVER_TRACE_CBID_*` of [`DRIVER_FAMILIES`].
pub const DRIVER: &[(&str, u32)] = &[
    ("cuMemAlloc", 29),
    ("cuMemAllocPitch", 31),
    ("cuMemFree", 33),
    ("cuMemAllocHost", 37),
    ("cuMemFreeHost", 38),
    ("cuMemcpyHtoD", 43),
    ("cuMemcpyDtoH", 45),
    ("cuMemcpyDtoD", 47),
    ("cuMemcpyDtoA", 49),
    ("cuMemcpyAtoD", 51),
    ("cuMemcpyHtoA", 53),
    ("cuMemcpyAtoH", 54),
    ("cuMemcpyAtoA", 55),
    ("cuMemcpy2D", 56),
    ("cuMemcpy2DUnaligned", 57),
    ("cuMemcpy3D", 58),
    ("cuMemcpyHtoDAsync", 60),
    ("cuMemcpyDtoHAsync", 62),
    ("cuMemcpyDtoDAsync", 64),
    ("cuMemcpyHtoAAsync", 66),
    ("cuMemcpyAtoHAsync", 67),
    ("cuMemcpy2DAsync", 68),
    ("cuMemcpy3DAsync", 69),
    ("cuMemsetD8", 71),
    ("cuMemsetD16", 73),
    ("cuMemsetD32", 75),
    ("cuMemsetD2D8", 77),
    ("cuMemsetD2D16", 79),
    ("cuMemsetD2D32", 81),
    ("cuLaunch", 115),
    ("cuLaunchGrid", 116),
    ("cuLaunchGridAsync", 117),
    ("cuMemsetD8Async", 216),
    ("cuMemsetD16Async", 218),
    ("cuMemsetD32Async", 220),
    ("cuMemsetD2D8Async", 222),
    ("cuMemsetD2D16Async", 224),
    ("cuMemsetD2D32Async", 226),
    ("cuMemAlloc_v2", 243),
    ("cuMemAllocPitch_v2", 244),
    ("cuMemFree_v2", 245),
    ("cuMemsetD8_v2", 249),
    ("cuMemsetD16_v2", 250),
    ("cuMemsetD32_v2", 251),
    ("cuMemsetD2D8_v2", 252),
    ("cuMemsetD2D16_v2", 253),
    ("cuMemsetD2D32_v2", 254),
    ("cuMemcpyHtoD_v2", 276),
    ("cuMemcpyHtoDAsync_v2", 277),
    ("cuMemcpyDtoH_v2", 278),
    ("cuMemcpyDtoHAsync_v2", 279),
    ("cuMemcpyDtoD_v2", 280),
    ("cuMemcpyDtoDAsync_v2", 281),
    ("cuMemcpyAtoH_v2", 282),
    ("cuMemcpyAtoHAsync_v2", 283),
    ("cuMemcpyAtoD_v2", 284),
    ("cuMemcpyDtoA_v2", 285),
    ("cuMemcpyAtoA_v2", 286),
    ("cuMemcpy2D_v2", 287),
    ("cuMemcpy2DUnaligned_v2", 288),
    ("cuMemcpy2DAsync_v2", 289),
    ("cuMemcpy3D_v2", 290),
    ("cuMemcpy3DAsync_v2", 291),
    ("cuMemcpyHtoA_v2", 292),
    ("cuMemcpyHtoAAsync_v2", 293),
    ("cuMemAllocHost_v2", 294),
    ("cuMemcpy", 305),
    ("cuMemcpyAsync", 306),
    ("cuLaunchKernel", 307),
    ("cuMemcpyPeer", 318),
    ("cuMemcpyPeerAsync", 319),
    ("cuMemcpy3DPeer", 320),
    ("cuMemcpy3DPeerAsync", 321),
    ("cuMemAllocManaged", 371),
    ("cuMemcpyHtoD_v2_ptds", 397),
    ("cuMemcpyDtoH_v2_ptds", 398),
    ("cuMemcpyDtoD_v2_ptds", 399),
    ("cuMemcpyDtoA_v2_ptds", 400),
    ("cuMemcpyAtoD_v2_ptds", 401),
    ("cuMemcpyHtoA_v2_ptds", 402),
    ("cuMemcpyAtoH_v2_ptds", 403),
    ("cuMemcpyAtoA_v2_ptds", 404),
    ("cuMemcpy2D_v2_ptds", 405),
    ("cuMemcpy2DUnaligned_v2_ptds", 406),
    ("cuMemcpy3D_v2_ptds", 407),
    ("cuMemcpy_ptds", 408),
    ("cuMemcpyPeer_ptds", 409),
    ("cuMemcpy3DPeer_ptds", 410),
    ("cuMemsetD8_v2_ptds", 411),
    ("cuMemsetD16_v2_ptds", 412),
    ("cuMemsetD32_v2_ptds", 413),
    ("cuMemsetD2D8_v2_ptds", 414),
    ("cuMemsetD2D16_v2_ptds", 415),
    ("cuMemsetD2D32_v2_ptds", 416),
    ("cuMemcpyAsync_ptsz", 418),
    ("cuMemcpyHtoAAsync_v2_ptsz", 419),
    ("cuMemcpyAtoHAsync_v2_ptsz", 420),
    ("cuMemcpyHtoDAsync_v2_ptsz", 421),
    ("cuMemcpyDtoHAsync_v2_ptsz", 422),
    ("cuMemcpyDtoDAsync_v2_ptsz", 423),
    ("cuMemcpy2DAsync_v2_ptsz", 424),
    ("cuMemcpy3DAsync_v2_ptsz", 425),
    ("cuMemcpyPeerAsync_ptsz", 426),
    ("cuMemcpy3DPeerAsync_ptsz", 427),
    ("cuMemsetD8Async_ptsz", 428),
    ("cuMemsetD16Async_ptsz", 429),
    ("cuMemsetD32Async_ptsz", 430),
    ("cuMemsetD2D8Async_ptsz", 431),
    ("cuMemsetD2D16Async_ptsz", 432),
    ("cuMemsetD2D32Async_ptsz", 433),
    ("cuLaunchKernel_ptsz", 442),
    ("cuLaunchCooperativeKernel", 477),
    ("cuLaunchCooperativeKernel_ptsz", 478),
    ("cuLaunchCooperativeKernelMultiDevice", 480),
    ("cuGraphLaunch", 514),
    ("cuGraphLaunch_ptsz", 515),
    ("cuLaunchHostFunc", 527),
    ("cuLaunchHostFunc_ptsz", 528),
    ("cuMemAllocAsync", 598),
    ("cuMemAllocAsync_ptsz", 599),
    ("cuMemFreeAsync", 600),
    ("cuMemFreeAsync_ptsz", 601),
    ("cuMemAllocFromPoolAsync", 611),
    ("cuMemAllocFromPoolAsync_ptsz", 612),
    ("cuLaunchKernelEx", 652),
    ("cuLaunchKernelEx_ptsz", 653),
    ("cuMemcpyBatchAsync", 776),
    ("cuMemcpyBatchAsync_ptsz", 777),
    ("cuMemcpy3DBatchAsync", 778),
    ("cuMemcpy3DBatchAsync_ptsz", 779),
    ("cuMemcpyBatchAsync_v2", 796),
    ("cuMemcpyBatchAsync_v2_ptsz", 797),
    ("cuMemcpy3DBatchAsync_v2", 798),
    ("cuMemcpy3DBatchAsync_v2_ptsz", 799),
    ("cuLaunchHostFunc_v2", 831),
    ("cuLaunchHostFunc_v2_ptsz", 832),
    ("cuMemcpyWithAttributesAsync", 837),
    ("cuMemcpyWithAttributesAsync_ptsz", 838),
    ("cuMemcpy3DWithAttributesAsync", 839),
    ("cuMemcpy3DWithAttributesAsync_ptsz", 840),
];
/// `CUPTI_RUNTIME_TRACE_CBID_*` of [`RUNTIME_FAMILIES`].
pub const RUNTIME: &[(&str, u32)] = &[
    ("cudaLaunch_v3020", 13),
    ("cudaMalloc_v3020", 20),
    ("cudaMallocPitch_v3020", 21),
    ("cudaFree_v3020", 22),
    ("cudaMallocArray_v3020", 23),
    ("cudaFreeArray_v3020", 24),
    ("cudaMallocHost_v3020", 25),
    ("cudaFreeHost_v3020", 26),
    ("cudaMemcpy_v3020", 31),
    ("cudaMemcpy2D_v3020", 32),
    ("cudaMemcpyToArray_v3020", 33),
    ("cudaMemcpy2DToArray_v3020", 34),
    ("cudaMemcpyFromArray_v3020", 35),
    ("cudaMemcpy2DFromArray_v3020", 36),
    ("cudaMemcpyArrayToArray_v3020", 37),
    ("cudaMemcpy2DArrayToArray_v3020", 38),
    ("cudaMemcpyToSymbol_v3020", 39),
    ("cudaMemcpyFromSymbol_v3020", 40),
    ("cudaMemcpyAsync_v3020", 41),
    ("cudaMemcpyToArrayAsync_v3020", 42),
    ("cudaMemcpyFromArrayAsync_v3020", 43),
    ("cudaMemcpy2DAsync_v3020", 44),
    ("cudaMemcpy2DToArrayAsync_v3020", 45),
    ("cudaMemcpy2DFromArrayAsync_v3020", 46),
    ("cudaMemcpyToSymbolAsync_v3020", 47),
    ("cudaMemcpyFromSymbolAsync_v3020", 48),
    ("cudaMemset_v3020", 49),
    ("cudaMemset2D_v3020", 50),
    ("cudaMemsetAsync_v3020", 51),
    ("cudaMemset2DAsync_v3020", 52),
    ("cudaMalloc3D_v3020", 140),
    ("cudaMalloc3DArray_v3020", 141),
    ("cudaMemset3D_v3020", 142),
    ("cudaMemset3DAsync_v3020", 143),
    ("cudaMemcpy3D_v3020", 144),
    ("cudaMemcpy3DAsync_v3020", 145),
    ("cudaMemcpyPeer_v4000", 160),
    ("cudaMemcpyPeerAsync_v4000", 161),
    ("cudaMemcpy3DPeer_v4000", 162),
    ("cudaMemcpy3DPeerAsync_v4000", 163),
    ("cudaMallocMipmappedArray_v5000", 192),
    ("cudaFreeMipmappedArray_v5000", 194),
    ("cudaMallocManaged_v6000", 206),
    ("cudaLaunchKernel_v7000", 211),
    ("cudaLaunch_ptsz_v7000", 213),
    ("cudaLaunchKernel_ptsz_v7000", 214),
    ("cudaMemcpy_ptds_v7000", 215),
    ("cudaMemcpy2D_ptds_v7000", 216),
    ("cudaMemcpyToArray_ptds_v7000", 217),
    ("cudaMemcpy2DToArray_ptds_v7000", 218),
    ("cudaMemcpyFromArray_ptds_v7000", 219),
    ("cudaMemcpy2DFromArray_ptds_v7000", 220),
    ("cudaMemcpyArrayToArray_ptds_v7000", 221),
    ("cudaMemcpy2DArrayToArray_ptds_v7000", 222),
    ("cudaMemcpyToSymbol_ptds_v7000", 223),
    ("cudaMemcpyFromSymbol_ptds_v7000", 224),
    ("cudaMemcpyAsync_ptsz_v7000", 225),
    ("cudaMemcpyToArrayAsync_ptsz_v7000", 226),
    ("cudaMemcpyFromArrayAsync_ptsz_v7000", 227),
    ("cudaMemcpy2DAsync_ptsz_v7000", 228),
    ("cudaMemcpy2DToArrayAsync_ptsz_v7000", 229),
    ("cudaMemcpy2DFromArrayAsync_ptsz_v7000", 230),
    ("cudaMemcpyToSymbolAsync_ptsz_v7000", 231),
    ("cudaMemcpyFromSymbolAsync_ptsz_v7000", 232),
    ("cudaMemset_ptds_v7000", 233),
    ("cudaMemset2D_ptds_v7000", 234),
    ("cudaMemsetAsync_ptsz_v7000", 235),
    ("cudaMemset2DAsync_ptsz_v7000", 236),
    ("cudaMemset3D_ptds_v7000", 243),
    ("cudaMemset3DAsync_ptsz_v7000", 244),
    ("cudaMemcpy3D_ptds_v7000", 245),
    ("cudaMemcpy3DAsync_ptsz_v7000", 246),
    ("cudaMemcpy3DPeer_ptds_v7000", 249),
    ("cudaMemcpy3DPeerAsync_ptsz_v7000", 250),
    ("cudaLaunchCooperativeKernel_v9000", 269),
    ("cudaLaunchCooperativeKernel_ptsz_v9000", 270),
    ("cudaLaunchCooperativeKernelMultiDevice_v9000", 272),
    ("cudaLaunchHostFunc_v10000", 284),
    ("cudaLaunchHostFunc_ptsz_v10000", 285),
    ("cudaGraphLaunch_v10000", 311),
    ("cudaGraphLaunch_ptsz_v10000", 312),
    ("cudaMallocAsync_v11020", 373),
    ("cudaMallocAsync_ptsz_v11020", 374),
    ("cudaFreeAsync_v11020", 375),
    ("cudaFreeAsync_ptsz_v11020", 376),
    ("cudaMallocFromPoolAsync_v11020", 391),
    ("cudaMallocFromPoolAsync_ptsz_v11020", 392),
    ("cudaLaunchKernelExC_v11060", 430),
    ("cudaLaunchKernelExC_ptsz_v11060", 431),
    ("cudaMemcpyBatchAsync_v12080", 482),
    ("cudaMemcpyBatchAsync_ptsz_v12080", 483),
    ("cudaMemcpy3DBatchAsync_v12080", 484),
    ("cudaMemcpy3DBatchAsync_ptsz_v12080", 485),
    ("cudaMemcpyBatchAsync_v13000", 509),
    ("cudaMemcpyBatchAsync_ptsz_v13000", 510),
    ("cudaMemcpy3DBatchAsync_v13000", 511),
    ("cudaMemcpy3DBatchAsync_ptsz_v13000", 512),
    ("cudaLaunchHostFunc_v2_v13020", 550),
    ("cudaLaunchHostFunc_v2_ptsz_v13020", 551),
    ("cudaMemcpyWithAttributesAsync_v13020", 554),
    ("cudaMemcpyWithAttributesAsync_ptsz_v13020", 555),
    ("cudaMemcpy3DWithAttributesAsync_v13020", 556),
    ("cudaMemcpy3DWithAttributesAsync_ptsz_v13020", 557),
];

/// Driver API names that begin or end a stream capture (the launches made
/// on a capturing stream are recorded into a CUDA graph and run no kernel):
/// every callback whose name starts with one of these. The runtime's
/// calls make them. (Read by the header check, which holds
/// [`STREAM_CAPTURE`] to them.)
#[cfg_attr(not(test), allow(dead_code))]
pub const STREAM_CAPTURE_FAMILIES: [&str; 2] = ["cuStreamBeginCapture", "cuStreamEndCapture"];

/// `CUPTI_DRIVER_TRACE_CBID_*` of [`STREAM_CAPTURE_FAMILIES`].
pub const STREAM_CAPTURE: &[(&str, u32)] = &[
    ("cuStreamBeginCapture", 495),
    ("cuStreamBeginCapture_ptsz", 496),
    ("cuStreamEndCapture", 497),
    ("cuStreamEndCapture_ptsz", 498),
    ("cuStreamBeginCapture_v2", 539),
    ("cuStreamBeginCapture_v2_ptsz", 540),
    ("cuStreamBeginCaptureToGraph", 720),
    ("cuStreamBeginCaptureToGraph_ptsz", 721),
    ("cuStreamBeginCaptureToCig", 783),
    ("cuStreamBeginCaptureToCig_ptsz", 814),
    ("cuStreamEndCaptureToCig", 815),
    ("cuStreamEndCaptureToCig_ptsz", 816),
];

/// Callbacks CUPTI renamed, keeping their id: (the name now, the name in
/// earlier releases). 13.0 called `cuStreamBeginCaptureToCig`
/// `cuStreamCreateForCaptureToCig`. (Read by the header check.)
#[cfg_attr(not(test), allow(dead_code))]
pub const RENAMED: &[(&str, &str)] =
    &[("cuStreamBeginCaptureToCig", "cuStreamCreateForCaptureToCig")];

/// Whether driver callback `cbid` begins a stream capture (`Some(true)`),
/// ends one (`Some(false)`), or neither.
pub fn stream_capture_edge(cbid: u32) -> Option<bool> {
    STREAM_CAPTURE
        .iter()
        .find(|(_, id)| *id == cbid)
        .map(|(name, _)| name.starts_with("cuStreamBeginCapture"))
}

/// Whether a call (a runtime one when `runtime`) launches work that CUPTI
/// records with the call's correlation id: a kernel or a graph (whose
/// kernels, copies and memsets carry the launch's id), not a host function.
pub fn launches_gpu_work(runtime: bool, cbid: u32) -> bool {
    static LAUNCHES: OnceLock<[Vec<u32>; 2]> = OnceLock::new();
    let launches = LAUNCHES.get_or_init(|| {
        let of = |table: &[(&str, u32)], families: [&str; 2]| {
            let mut ids: Vec<u32> = table
                .iter()
                .filter(|(name, _)| {
                    families.iter().any(|f| name.starts_with(f)) && !name.contains("HostFunc")
                })
                .map(|(_, cbid)| *cbid)
                .collect();
            ids.sort_unstable();
            ids
        };
        [
            of(DRIVER, ["cuLaunch", "cuGraphLaunch"]),
            of(RUNTIME, ["cudaLaunch", "cudaGraphLaunch"]),
        ]
    });
    launches[usize::from(runtime)].binary_search(&cbid).is_ok()
}

/// Switches the API records from `current` (`None`: none enabled) to every
/// call (`all`) or the timeline's; to every call too once CUPTI was seen
/// ignoring the selection of the timeline's (`selection_ignored`, said by
/// the caller). Returns the set now in force and, when the timeline's could
/// not be selected, why.
pub fn switch(
    current: Option<ApiRecordSet>,
    all: bool,
    selection_ignored: bool,
) -> Result<(ApiRecordSet, Option<String>), String> {
    if all {
        enable_kinds()?;
        return Ok((ApiRecordSet::All, None));
    }
    if selection_ignored {
        // Said when it was found out, with what it cost.
        if current == Some(ApiRecordSet::Timeline) {
            disable(ApiRecordSet::Timeline)?;
        }
        enable_kinds()?;
        return Ok((ApiRecordSet::AllUnselectable, None));
    }
    if current == Some(ApiRecordSet::Timeline) {
        return Ok((ApiRecordSet::Timeline, None));
    }
    let Some((driver, runtime)) = per_call_entry_points() else {
        enable_kinds()?;
        return Ok((
            ApiRecordSet::AllUnselectable,
            Some(
                "this libcupti has no cuptiActivityEnableDriverApi and \
                 cuptiActivityEnableRuntimeApi (CUDA 12.8's and later releases' have them), so \
                 every driver and runtime API call is recorded while capturing, at CUPTI's cost \
                 on each"
                    .into(),
            ),
        ));
    };
    if current.is_some() {
        // The kinds record every call; they go first, then the selection.
        disable_kinds()?;
    }
    match select_calls(driver, runtime, true) {
        Ok(()) => Ok((ApiRecordSet::Timeline, None)),
        Err(error) => {
            let _ = select_calls(driver, runtime, false);
            enable_kinds()?;
            Ok((
                ApiRecordSet::AllUnselectable,
                Some(format!(
                    "selecting API calls failed ({error}), so every driver and runtime API call \
                     is recorded while capturing, at CUPTI's cost on each"
                )),
            ))
        }
    }
}

/// Stops recording API calls of `current`. The selection is cleared after
/// the kinds as well, so that none of it outlives a capture whatever the
/// kinds' override left of it.
pub fn disable(current: ApiRecordSet) -> Result<(), String> {
    if current != ApiRecordSet::Timeline {
        disable_kinds()?;
    }
    match per_call_entry_points() {
        Some((driver, runtime)) => select_calls(driver, runtime, false),
        None => Ok(()),
    }
}

fn per_call_entry_points() -> Option<(EnableApi, EnableApi)> {
    let lib = lib().ok()?;
    Some((lib.enable_driver_api?, lib.enable_runtime_api?))
}

fn enable_kinds() -> Result<(), String> {
    super::enable(kind::DRIVER)?;
    super::enable(kind::RUNTIME)
}

fn disable_kinds() -> Result<(), String> {
    super::disable(kind::DRIVER)?;
    super::disable(kind::RUNTIME)
}

/// Selects (`on`) or clears the timeline's calls.
fn select_calls(driver: EnableApi, runtime: EnableApi, on: bool) -> Result<(), String> {
    set_calls(driver, DRIVER.iter().map(|(_, id)| *id), on)?;
    set_calls(runtime, RUNTIME.iter().map(|(_, id)| *id), on)
}

/// Enables or disables the records of each callback id; ids the release
/// does not have are passed over.
fn set_calls(entry: EnableApi, ids: impl Iterator<Item = u32>, on: bool) -> Result<(), String> {
    for id in ids {
        // SAFETY: plain call with a callback id and a flag.
        let result = unsafe { entry(id, u8::from(on)) };
        if result != CUPTI_SUCCESS && result != CUPTI_ERROR_INVALID_PARAMETER {
            check(&format!("switching API records of callback {id}"), result)?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kernel_and_graph_launches_launch_gpu_work_host_functions_do_not() {
        assert!(launches_gpu_work(false, 307)); // cuLaunchKernel
        assert!(launches_gpu_work(false, 514)); // cuGraphLaunch
        assert!(launches_gpu_work(true, 211)); // cudaLaunchKernel
        assert!(launches_gpu_work(true, 311)); // cudaGraphLaunch
        assert!(!launches_gpu_work(false, 527)); // cuLaunchHostFunc
        assert!(!launches_gpu_work(true, 284)); // cudaLaunchHostFunc
        assert!(!launches_gpu_work(false, 306)); // cuMemcpyAsync

        // The same id in the other API is another call.
        assert!(!launches_gpu_work(true, 307));
    }

    #[test]
    fn stream_captures_begin_and_end_by_callback_id() {
        assert_eq!(stream_capture_edge(539), Some(true)); // cuStreamBeginCapture_v2
        assert_eq!(stream_capture_edge(720), Some(true)); // cuStreamBeginCaptureToGraph
        assert_eq!(stream_capture_edge(497), Some(false)); // cuStreamEndCapture
        assert_eq!(stream_capture_edge(499), None); // cuStreamIsCapturing
    }
}
