//! The TPU check: libtpu as the TPU backend loads it, and the TPU devices
//! it would profile.

use std::ffi::OsStr;

use super::{Area, Finding, Status};

pub fn check(library: &OsStr) -> Finding {
    let shown = library.to_string_lossy();
    // SAFETY: loading libtpu runs its initialisers, as the backend's start
    // does; no function of it is called here.
    let loaded = unsafe {
        libloading::Library::new(library)
            .and_then(|lib| lib.get::<*const ()>(b"GetPjrtApi\0").map(|_| ()))
    };
    let devices = std::fs::read_dir("/dev")
        .map(|entries| {
            entries
                .filter_map(Result::ok)
                .filter(|entry| entry.file_name().to_string_lossy().starts_with("accel"))
                .count()
        })
        .unwrap_or(0);
    match loaded {
        Ok(()) if devices > 0 => Finding::new(Area::Tpu, "libtpu", Status::Ok, format!("{shown} has GetPjrtApi; {devices} TPU device(s) in /dev")),
        Ok(()) => Finding::new(Area::Tpu, "libtpu", Status::Warn, format!("{shown} has GetPjrtApi, but /dev has no accel device")),
        Err(error) => Finding::new(Area::Tpu, "libtpu", Status::Absent, format!("{shown} cannot be loaded: {error}"))
            .hint("on a TPU VM, pip install libtpu and give --tpu-library (or TPU_LIBRARY_PATH) its libtpu.so; when a JAX job owns the TPU, use --upstream with its profiler server instead"),
    }
}
