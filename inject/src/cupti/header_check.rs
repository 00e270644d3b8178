//! Checks [`super::layout`] and [`super::api_calls`] against the real CUPTI
//! headers: the wheels of several releases are fetched with pip (cached
//! under `target/cupti-headers`), and a C file of `_Static_assert`s made from
//! the table is compiled against each release's `include/`. A field must lie
//! at its offset in every release from its `since` version on, and must lie
//! past the end of the record in every release before. Each callback id of
//! the timeline's API calls must be that call's in every release that has
//! it, and past the last id of every release that does not. The probe of
//! plain CUPTI's costs that `scripts/gpu-check` runs
//! (`scripts/gpu/cupti_cost.c`) compiles against each release too.

use std::path::{Path, PathBuf};
use std::process::Command;

use super::api_calls;
use super::layout::{fields, Record};

/// One release: the CUPTI wheel, and the CUDA runtime (and, for 13, crt)
/// wheels whose headers `cupti_activity.h` includes. A requirement such as
/// `nvidia-cuda-cupti<14` takes the newest release of a major.
struct Release {
    name: &'static str,
    wheels: &'static [&'static str],
}

const RELEASES: &[Release] = &[
    Release {
        name: "12.2",
        wheels: &[
            "nvidia-cuda-cupti-cu12==12.2.142",
            "nvidia-cuda-runtime-cu12==12.2.140",
        ],
    },
    Release {
        name: "12.8",
        wheels: &[
            "nvidia-cuda-cupti-cu12==12.8.90",
            "nvidia-cuda-runtime-cu12==12.8.90",
        ],
    },
    Release {
        name: "13.0",
        wheels: &[
            "nvidia-cuda-cupti==13.0.85",
            "nvidia-cuda-runtime==13.0.96",
            "nvidia-cuda-crt==13.0.88",
        ],
    },
    Release {
        name: "13.newest",
        wheels: &[
            "nvidia-cuda-cupti<14",
            "nvidia-cuda-runtime<14",
            "nvidia-cuda-crt<14",
        ],
    },
];

fn cache_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/cupti-headers")
}

/// Downloads and unpacks a release's wheels once; returns the directory.
/// The tests run on parallel threads and share the cache: one unpacks at a
/// time, and the others then find it done.
fn fetch(release: &Release) -> PathBuf {
    static UNPACKING: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _one_at_a_time = UNPACKING
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    let dir = cache_dir().join(release.name);
    let done = dir.join(".unpacked");
    if done.exists() {
        return dir;
    }
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("cache directory");
    let status = Command::new("python3")
        .args([
            "-m",
            "pip",
            "download",
            "--quiet",
            "--no-deps",
            "--only-binary=:all:",
        ])
        .arg("-d")
        .arg(&dir)
        .args(release.wheels)
        .status()
        .expect("python3 -m pip runs");
    assert!(status.success(), "pip download {:?} failed", release.wheels);
    let unzip = "import sys, zipfile, glob\n\
                 for w in glob.glob(sys.argv[1] + '/*.whl'):\n    zipfile.ZipFile(w).extractall(sys.argv[1])";
    let status = Command::new("python3")
        .args(["-c", unzip])
        .arg(&dir)
        .status()
        .expect("python3 runs");
    assert!(status.success(), "unpacking {:?} failed", release.wheels);
    std::fs::write(&done, b"").expect("marker");
    dir
}

/// Every `include` directory of the unpacked wheels, CUPTI's first.
fn include_dirs(dir: &Path) -> Vec<PathBuf> {
    let nvidia = dir.join("nvidia");
    let mut dirs: Vec<PathBuf> = std::fs::read_dir(&nvidia)
        .expect("nvidia/ in the wheels")
        .flatten()
        .map(|entry| entry.path().join("include"))
        .filter(|include| include.is_dir())
        .collect();
    dirs.sort_by_key(|d| !d.join("cupti_activity.h").exists());
    dirs
}

/// The 12.x runtime wheels lack `crt/host_defines.h`; it is plain macros, so
/// the 13.0 release's copy serves.
fn crt_fallback() -> PathBuf {
    let release = RELEASES.iter().find(|r| r.name == "13.0").expect("13.0");
    let dir = fetch(release);
    include_dirs(&dir)
        .into_iter()
        .find(|d| d.join("crt/host_defines.h").exists())
        .expect("crt/host_defines.h in the 13.0 wheels")
}

fn header_text(includes: &[PathBuf]) -> String {
    let mut text = String::new();
    for name in [
        "cupti_version.h",
        "cupti_activity.h",
        "cupti_activity_deprecated.h",
    ] {
        for dir in includes {
            if let Ok(part) = std::fs::read_to_string(dir.join(name)) {
                text.push_str(&part);
            }
        }
    }
    text
}

/// The newest struct of a family in the headers: `CUpti_ActivityKernel13`.
fn newest_struct(text: &str, record: Record) -> String {
    let stem = record.c_stem();
    let mut best: Option<(u32, String)> = None;
    for (at, _) in text.match_indices(stem) {
        let before = text[..at].trim_end();
        if !before.ends_with('}') {
            continue;
        }
        let rest = &text[at + stem.len()..];
        let digits: String = rest.chars().take_while(|c| c.is_ascii_digit()).collect();
        if !rest[digits.len()..].trim_start().starts_with(';') {
            continue;
        }
        let number = digits.parse().unwrap_or(0);
        if best.as_ref().is_none_or(|(n, _)| number > *n) {
            best = Some((number, format!("{stem}{digits}")));
        }
    }
    best.map(|(_, name)| name)
        .unwrap_or_else(|| panic!("no {stem} struct in the headers"))
}

fn api_version(text: &str) -> u32 {
    text.lines()
        .find_map(|line| {
            line.trim()
                .strip_prefix("#define CUPTI_API_VERSION")
                .and_then(|v| v.trim().parse().ok())
        })
        .expect("CUPTI_API_VERSION in the headers")
}

/// Compiles `source` (written to `file`) against `includes` and the crt
/// fallback (GNU C11, for `__builtin_types_compatible_p`); when the compiler
/// complains, fails with `what` and its complaints.
fn assert_compiles(file: &Path, source: &str, includes: &[PathBuf], what: &str) {
    std::fs::write(file, source).expect("write the check");
    let mut cc = Command::new("cc");
    cc.args(["-fsyntax-only", "-std=gnu11"]);
    for include in includes.iter().chain([&crt_fallback()]) {
        cc.arg("-I").arg(include);
    }
    let output = cc.arg(file).output().expect("cc runs");
    assert!(
        output.status.success(),
        "{what}:\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
}

/// Every release, unpacked: its directory and its `include` directories
/// (CUPTI's first).
fn unpacked() -> Vec<(&'static Release, PathBuf, Vec<PathBuf>)> {
    RELEASES
        .iter()
        .map(|release| {
            let dir = fetch(release);
            let includes = include_dirs(&dir);
            (release, dir, includes)
        })
        .collect()
}

#[test]
fn the_layout_table_matches_the_real_headers() {
    for (release, dir, includes) in unpacked() {
        let text = header_text(&includes);
        let version = api_version(&text);
        assert!(
            super::support(version).is_ok(),
            "{}: API version {version} refused",
            release.name
        );
        let mut source = String::from("#include <stddef.h>\n#include <cupti_activity.h>\n");
        for (record, field, at) in fields() {
            let name = newest_struct(&text, record);
            if version >= at.since {
                source.push_str(&format!(
                    "_Static_assert(offsetof({name}, {field}) == {}, \"{name}.{field} at {}\");\n",
                    at.offset, at.offset
                ));
            } else {
                source.push_str(&format!(
                    "_Static_assert(sizeof({name}) <= {}, \"{name} has no {field} before API {}\");\n",
                    at.offset, at.since
                ));
            }
        }
        let what = format!(
            "CUPTI {} (API {version}): the layout table disagrees with the headers",
            release.name
        );
        assert_compiles(&dir.join("layout_check.c"), &source, &includes, &what);
        eprintln!(
            "CUPTI {} (API {version}): {} fields checked",
            release.name,
            fields().len()
        );
    }
}

/// `CUPTI_<domain>_TRACE_CBID_<name> = <id>` of a cbid header, by name
/// (`SIZE`, one past the last id, among them).
fn callback_ids(text: &str, domain: &str) -> std::collections::BTreeMap<String, u32> {
    let prefix = format!("CUPTI_{domain}_TRACE_CBID_");
    text.lines()
        .filter_map(|line| {
            let (name, id) = line.trim().strip_prefix(&prefix)?.split_once('=')?;
            let id = id.trim().trim_end_matches(',').trim().parse().ok()?;
            Some((name.trim().to_string(), id))
        })
        .collect()
}

#[test]
fn the_timeline_calls_and_their_entry_points_match_the_real_headers() {
    for (release, dir, includes) in unpacked() {
        for (domain, file, table, families) in [
            (
                "DRIVER",
                "cupti_driver_cbid.h",
                api_calls::DRIVER,
                &api_calls::DRIVER_FAMILIES[..],
            ),
            (
                "RUNTIME",
                "cupti_runtime_cbid.h",
                api_calls::RUNTIME,
                &api_calls::RUNTIME_FAMILIES[..],
            ),
            (
                "DRIVER",
                "cupti_driver_cbid.h",
                api_calls::STREAM_CAPTURE,
                &api_calls::STREAM_CAPTURE_FAMILIES[..],
            ),
        ] {
            let text = std::fs::read_to_string(includes[0].join(file)).expect(file);
            let ids = callback_ids(&text, domain);
            let size = ids["SIZE"];
            for (name, id) in table {
                let earlier = api_calls::RENAMED
                    .iter()
                    .find(|(now, _)| now == name)
                    .and_then(|(_, earlier)| ids.get(*earlier));
                match ids.get(*name).or(earlier) {
                    Some(declared) => assert_eq!(
                        declared, id,
                        "CUPTI {}: {name} is callback {declared}, not {id}",
                        release.name
                    ),
                    None => assert!(
                        *id >= size,
                        "CUPTI {}: callback {id} ({name} in later releases) is another call here",
                        release.name
                    ),
                }
            }
            if release.name == "13.newest" {
                let missing: Vec<&String> = ids
                    .keys()
                    .filter(|name| families.iter().any(|family| name.starts_with(family)))
                    .filter(|name| !table.iter().any(|(known, _)| known == name))
                    .collect();
                assert!(
                    missing.is_empty(),
                    "CUPTI {}: {domain} callbacks of the timeline's families missing from \
                     api_calls: {missing:?}",
                    release.name
                );
            }
        }
        let declared = header_text(&includes).contains("cuptiActivityEnableDriverApi(");
        if release.name == "12.2" {
            // Where the library falls back to every call's records.
            assert!(!declared, "12.2 declares the per-call enables");
            continue;
        }
        assert!(
            declared,
            "CUPTI {} lacks the per-call enables",
            release.name
        );
        let mut source = String::from("#include <stdint.h>\n#include <cupti_activity.h>\n");
        for name in [
            "cuptiActivityEnableDriverApi",
            "cuptiActivityEnableRuntimeApi",
        ] {
            // `EnableApi`: (u32, u8) -> CUptiResult.
            source.push_str(&format!(
                "_Static_assert(__builtin_types_compatible_p(__typeof__(&{name}), \
                 CUptiResult (*)(uint32_t, uint8_t)), \"{name}\");\n"
            ));
        }
        source.push_str("_Static_assert(sizeof(CUptiResult) == 4, \"CUptiResult\");\n");
        let what = format!(
            "CUPTI {}: the per-call enables are not declared as EnableApi",
            release.name
        );
        assert_compiles(&dir.join("api_calls_check.c"), &source, &includes, &what);
    }
}

/// The clock another user may register for CUPTI's records, interposed
/// (`coexist.rs`) and read by the library (`clock.rs`): its entry point
/// and callback as `library.rs` types them, in every release.
#[test]
fn the_timestamp_callback_matches_the_real_headers() {
    for (release, dir, includes) in unpacked() {
        let source = "#include <stdint.h>\n#include <cupti.h>\n\
             _Static_assert(__builtin_types_compatible_p(CUpti_TimestampCallbackFunc, \
             uint64_t (*)(void)), \"TimestampFunc\");\n\
             _Static_assert(__builtin_types_compatible_p(\
             __typeof__(&cuptiActivityRegisterTimestampCallback), \
             CUptiResult (*)(CUpti_TimestampCallbackFunc)), \"RegisterTimestampCallback\");\n";
        let what = format!(
            "CUPTI {}: cuptiActivityRegisterTimestampCallback is not as library.rs types it",
            release.name
        );
        assert_compiles(&dir.join("timestamp_check.c"), source, &includes, &what);
    }
}

/// The Callback API the detach and the timed calls use (`callbacks.rs`):
/// the entry points' signatures as `library.rs` types them, the call
/// site's place and values, the correlation fields,
/// the domains and the error a second subscriber gets, in every release.
#[test]
fn the_callback_api_matches_the_real_headers() {
    use super::callbacks::{
        API_ENTER as CUPTI_API_ENTER, API_EXIT as CUPTI_API_EXIT, CORRELATION_DATA_OFFSET,
        CORRELATION_ID_OFFSET, DOMAINS,
        ERROR_MULTIPLE_SUBSCRIBERS as CUPTI_ERROR_MULTIPLE_SUBSCRIBERS, RETURN_VALUE_OFFSET,
    };
    for (release, dir, includes) in unpacked() {
        let source = format!(
            "#include <stddef.h>\n#include <stdint.h>\n#include <cupti.h>\n\
             _Static_assert(__builtin_types_compatible_p(__typeof__(&cuptiSubscribe), \
             CUptiResult (*)(CUpti_SubscriberHandle *, CUpti_CallbackFunc, void *)), \"Subscribe\");\n\
             _Static_assert(__builtin_types_compatible_p(__typeof__(&cuptiUnsubscribe), \
             CUptiResult (*)(CUpti_SubscriberHandle)), \"Unsubscribe\");\n\
             _Static_assert(__builtin_types_compatible_p(__typeof__(&cuptiEnableDomain), \
             CUptiResult (*)(uint32_t, CUpti_SubscriberHandle, CUpti_CallbackDomain)), \"EnableDomain\");\n\
             _Static_assert(__builtin_types_compatible_p(__typeof__(&cuptiFinalize), \
             CUptiResult (*)(void)), \"Finalize\");\n\
             _Static_assert(__builtin_types_compatible_p(CUpti_CallbackFunc, \
             void (*)(void *, CUpti_CallbackDomain, CUpti_CallbackId, const void *)), \"CallbackFunc\");\n\
             _Static_assert(sizeof(CUpti_CallbackDomain) == 4 && sizeof(CUpti_CallbackId) == 4, \"sizes\");\n\
             _Static_assert(offsetof(CUpti_CallbackData, callbackSite) == 0 \
             && sizeof(CUpti_ApiCallbackSite) == 4, \"callbackSite\");\n\
             _Static_assert(CUPTI_API_ENTER == {CUPTI_API_ENTER} \
             && CUPTI_API_EXIT == {CUPTI_API_EXIT}, \"call sites\");\n\
             _Static_assert(offsetof(CUpti_CallbackData, correlationData) == \
             {CORRELATION_DATA_OFFSET} && __builtin_types_compatible_p(\
             __typeof__(((CUpti_CallbackData *)0)->correlationData), uint64_t *), \
             \"correlationData\");\n\
             _Static_assert(offsetof(CUpti_CallbackData, correlationId) == \
             {CORRELATION_ID_OFFSET} && __builtin_types_compatible_p(\
             __typeof__(((CUpti_CallbackData *)0)->correlationId), uint32_t), \
             \"correlationId\");\n\
             _Static_assert(offsetof(CUpti_CallbackData, functionReturnValue) == \
             {RETURN_VALUE_OFFSET} && __builtin_types_compatible_p(\
             __typeof__(((CUpti_CallbackData *)0)->functionReturnValue), void *), \
             \"functionReturnValue\");\n\
             _Static_assert(CUPTI_CB_DOMAIN_DRIVER_API == {} \
             && CUPTI_CB_DOMAIN_RUNTIME_API == {}, \"domains\");\n\
             _Static_assert(CUPTI_ERROR_MULTIPLE_SUBSCRIBERS_NOT_SUPPORTED \
             == {CUPTI_ERROR_MULTIPLE_SUBSCRIBERS}, \"multiple subscribers\");\n",
            DOMAINS[0], DOMAINS[1]
        );
        let what = format!(
            "CUPTI {}: the Callback API differs from callbacks.rs",
            release.name
        );
        assert_compiles(&dir.join("detach_check.c"), &source, &includes, &what);
        // Interposed where the release has it (`coexist.rs`).
        let callbacks_header = std::fs::read_to_string(includes[0].join("cupti_callbacks.h"))
            .expect("cupti_callbacks.h");
        if callbacks_header.contains("cuptiSubscribe_v2(") {
            let source = format!(
                "#include <cupti.h>\n\
                 _Static_assert(__builtin_types_compatible_p(__typeof__(&cuptiSubscribe_v2), \
                 CUptiResult (*)(CUpti_SubscriberHandle *, CUpti_CallbackFunc, void *, \
                 CUpti_SubscriberParams *)), \"SubscribeV2\");\n\
                 _Static_assert(CUPTI_ERROR_NOT_SUPPORTED == {}, \"not supported\");\n",
                crate::cupti::library::CUPTI_ERROR_NOT_SUPPORTED
            );
            assert_compiles(&dir.join("subscribe_v2_check.c"), &source, &includes, &what);
        }
    }
}

/// The driver calls the library makes itself (`driver.rs`): their
/// signatures, the device attributes it reads and what success is, in every
/// release's `cuda.h`.
#[test]
fn the_driver_calls_match_the_real_headers() {
    use crate::driver::{
        CLOCK_RATE, COMPUTE_CAPABILITY_MAJOR, COMPUTE_CAPABILITY_MINOR, GLOBAL_MEMORY_BUS_WIDTH,
        MAX_BLOCKS_PER_MULTIPROCESSOR, MAX_REGISTERS_PER_MULTIPROCESSOR,
        MAX_SHARED_MEMORY_PER_MULTIPROCESSOR, MAX_THREADS_PER_MULTIPROCESSOR, MEMORY_CLOCK_RATE,
        MULTIPROCESSOR_COUNT, WARP_SIZE,
    };
    for (release, dir, includes) in unpacked() {
        let source = format!(
            "#include <cuda.h>\n\
             _Static_assert(sizeof(CUdevice) == sizeof(int) && (CUdevice)-1 < 0 \
             && sizeof(CUdevice_attribute) == sizeof(int) && sizeof(CUresult) == sizeof(int) \
             && CUDA_SUCCESS == 0, \"types\");\n\
             _Static_assert(__builtin_types_compatible_p(__typeof__(&cuDriverGetVersion), \
             CUresult (*)(int *)), \"cuDriverGetVersion\");\n\
             _Static_assert(__builtin_types_compatible_p(__typeof__(&cuDeviceGetCount), \
             CUresult (*)(int *)), \"cuDeviceGetCount\");\n\
             _Static_assert(__builtin_types_compatible_p(__typeof__(&cuDeviceGet), \
             CUresult (*)(CUdevice *, int)), \"cuDeviceGet\");\n\
             _Static_assert(__builtin_types_compatible_p(__typeof__(&cuDeviceGetAttribute), \
             CUresult (*)(int *, CUdevice_attribute, CUdevice)), \"cuDeviceGetAttribute\");\n\
             _Static_assert(CU_DEVICE_ATTRIBUTE_WARP_SIZE == {WARP_SIZE} \
             && CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_MULTIPROCESSOR == {MAX_THREADS_PER_MULTIPROCESSOR} \
             && CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR == \
             {MAX_SHARED_MEMORY_PER_MULTIPROCESSOR} \
             && CU_DEVICE_ATTRIBUTE_MAX_REGISTERS_PER_MULTIPROCESSOR == \
             {MAX_REGISTERS_PER_MULTIPROCESSOR} \
             && CU_DEVICE_ATTRIBUTE_MAX_BLOCKS_PER_MULTIPROCESSOR == {MAX_BLOCKS_PER_MULTIPROCESSOR} \
             && CU_DEVICE_ATTRIBUTE_CLOCK_RATE == {CLOCK_RATE} \
             && CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT == {MULTIPROCESSOR_COUNT} \
             && CU_DEVICE_ATTRIBUTE_MEMORY_CLOCK_RATE == {MEMORY_CLOCK_RATE} \
             && CU_DEVICE_ATTRIBUTE_GLOBAL_MEMORY_BUS_WIDTH == {GLOBAL_MEMORY_BUS_WIDTH} \
             && CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR == {COMPUTE_CAPABILITY_MAJOR} \
             && CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR == {COMPUTE_CAPABILITY_MINOR}, \
             \"attributes\");\n\
             _Static_assert(__builtin_types_compatible_p(__typeof__(&cuDeviceGetName), \
             CUresult (*)(char *, int, CUdevice)), \"cuDeviceGetName\");\n\
             _Static_assert(__builtin_types_compatible_p(__typeof__(&cuDeviceTotalMem_v2), \
             CUresult (*)(size_t *, CUdevice)), \"cuDeviceTotalMem_v2\");\n\
             _Static_assert(sizeof(CUuuid) == 16 && sizeof(((CUuuid *)0)->bytes) == 16, \
             \"CUuuid\");\n\
             _Static_assert(__builtin_types_compatible_p(__typeof__(&cuDeviceGetUuid), \
             CUresult (*)(CUuuid *, CUdevice)), \"cuDeviceGetUuid\");\n"
        );
        let what = format!(
            "CUDA {}: the driver calls differ from driver.rs",
            release.name
        );
        assert_compiles(&dir.join("driver_check.c"), &source, &includes, &what);
    }
}

/// The probe `scripts/gpu-check` measures plain CUPTI's costs with
/// (`scripts/gpu/cupti_cost.c`) takes its function types from the headers:
/// it compiles against every release's.
#[test]
fn the_cupti_cost_probe_compiles_against_the_real_headers() {
    let probe = Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts/gpu/cupti_cost.c");
    let source = std::fs::read_to_string(&probe).expect("scripts/gpu/cupti_cost.c");
    for (release, dir, includes) in unpacked() {
        let what = format!(
            "CUPTI {}: scripts/gpu/cupti_cost.c does not compile",
            release.name
        );
        assert_compiles(&dir.join("cupti_cost_check.c"), &source, &includes, &what);
    }
}
