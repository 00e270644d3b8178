//! Which libcupti the injection library loads, and whether it reads it: the
//! files it tries, in order ([`candidates`]), and the releases whose record
//! layouts (the injection library's `cupti::layout`) it reads, CUDA 12.2 to
//! 13.x ([`support`]). Here, in the contract both sides link, so that the
//! agent's `devtrace doctor` answers the questions the injection library
//! asks at load.

use std::path::{Path, PathBuf};

/// The file names a loaded libcupti may have, newest first.
pub const SONAMES: [&str; 2] = ["libcupti.so.13", "libcupti.so.12"];

/// Where pip's CUDA wheels put libcupti under their `nvidia` directory:
/// CUDA 13's `nvidia-cuda-cupti`, then CUDA 12's `nvidia-cuda-cupti-cu12`.
pub fn pip_files(nvidia: &Path) -> [PathBuf; 2] {
    [
        nvidia.join("cu13/lib/libcupti.so.13"),
        nvidia.join("cuda_cupti/lib/libcupti.so.12"),
    ]
}

/// The candidate files, in the order they are tried after a copy the
/// process already has and before the loader's own search: `DEVTRACE_CUPTI_PATH`
/// (a file, or a directory holding one), the pip layout beside the CUDA
/// libraries of `maps` (a `/proc/PID/maps` text), `$CUDA_HOME/extras/CUPTI/lib64`
/// (default `/usr/local/cuda`).
pub fn candidates(maps: &str) -> Vec<PathBuf> {
    let mut out = Vec::new();
    if let Some(path) = std::env::var_os("DEVTRACE_CUPTI_PATH").filter(|p| !p.is_empty()) {
        let path = PathBuf::from(path);
        if path.is_dir() {
            out.extend(
                SONAMES
                    .iter()
                    .chain(&["libcupti.so"])
                    .map(|name| path.join(name)),
            );
        } else {
            out.push(path);
        }
    }
    for nvidia in pip_nvidia_dirs(maps) {
        out.extend(pip_files(&nvidia));
    }
    for name in SONAMES.iter().chain(&["libcupti.so"]) {
        out.push(cuda_home().join("extras/CUPTI/lib64").join(name));
    }
    out
}

/// `$CUDA_HOME`, else `/usr/local/cuda`.
pub fn cuda_home() -> PathBuf {
    std::env::var_os("CUDA_HOME")
        .filter(|p| !p.is_empty())
        .map_or_else(|| PathBuf::from("/usr/local/cuda"), PathBuf::from)
}

/// The `nvidia` package directories of pip's CUDA wheels that hold a
/// library this process has mapped (`.../site-packages/nvidia`), each once.
pub fn pip_nvidia_dirs(maps: &str) -> Vec<PathBuf> {
    let mut dirs: Vec<PathBuf> = Vec::new();
    for line in maps.lines() {
        let Some(path) = line.split_whitespace().nth(5) else {
            continue;
        };
        let Some(at) = path.rfind("/nvidia/") else {
            continue;
        };
        let dir = PathBuf::from(&path[..at + "/nvidia".len()]);
        if !dirs.contains(&dir) {
            dirs.push(dir);
        }
    }
    dirs
}

/// How the injection library stands with a libcupti's API version.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Support {
    /// Records are read by the injection library's layouts for this version.
    Supported,
    /// Read, but the release has bugs worth a warning (the text says which).
    Warn(&'static str),
}

const WARN_13_0_GA: &str =
    "libcupti 13.0 GA (API version 130000) has bugs fixed in 13.0 Update 1: \
     no synchronization records for cudaDeviceSynchronize, a possible deadlock disabling \
     concurrent kernel records and a possible crash in cuptiActivityFlushAll; use CUDA 13.0 \
     Update 1 or later";

const WARN_NEWER_13: &str =
    "this libcupti is newer than the newest release whose record layouts were checked \
     against its headers (13.5): its records are read with 13.5's layouts, which NVIDIA has \
     so far only grown at their end; a field moved in it would be misread";

/// The newest API version whose record layouts were checked against the
/// release's own headers (any 13.5 update).
const NEWEST_CHECKED: u32 = 130599;

/// Whether records of a libcupti with API `version` are read correctly: 12.2
/// (20) and every later 12.x, and every 13.x (past 13.5, with a warning).
/// Older releases lay records out differently; a major after 13 is unknown
/// and refused.
pub fn support(version: u32) -> Result<Support, String> {
    match version {
        20..=99 => Ok(Support::Supported),
        130000 => Ok(Support::Warn(WARN_13_0_GA)),
        130001..=NEWEST_CHECKED => Ok(Support::Supported),
        130600..=139999 => Ok(Support::Warn(WARN_NEWER_13)),
        140000.. => Err(format!(
            "libcupti has API version {version} (CUDA {}); the injection library reads the record \
             layouts of CUDA 12.2 to 13.x only",
            version / 10000
        )),
        _ => Err(format!(
            "libcupti has API version {version}; the injection library reads the record layouts of \
             CUDA 12.2 (API version 20) to 13.x only"
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_12_and_13_release_is_read_and_other_majors_refused() {
        for supported in [
            20, 26, 28, 130001, 130101, 130200, 130202, 130301, 130401, 130500,
        ] {
            assert_eq!(support(supported), Ok(Support::Supported), "{supported}");
        }
        assert!(matches!(support(130000), Ok(Support::Warn(text)) if text.contains("Update 1")));
        assert!(matches!(support(130501), Ok(Support::Supported)));
        for newer in [130600, 139999] {
            assert!(
                matches!(support(newer), Ok(Support::Warn(text)) if text.contains("13.5's layouts")),
                "{newer}"
            );
        }
        for refused in [0, 12, 19, 100, 120000, 140000, 150100] {
            assert!(support(refused).is_err(), "{refused}");
        }
        assert!(support(140000).unwrap_err().contains("CUDA 14"));
    }

    #[test]
    fn pip_layouts_are_found_beside_mapped_cuda_libraries() {
        let maps = "\
7f0000000000-7f0000001000 r-xp 00000000 08:01 1 /venv/lib/python3.12/site-packages/nvidia/cu13/lib/libcudart.so.13
7f0000001000-7f0000002000 r--p 00000000 08:01 1 /venv/lib/python3.12/site-packages/nvidia/cu13/lib/libcudart.so.13
7f0000002000-7f0000003000 r-xp 00000000 08:01 2 /usr/lib/x86_64-linux-gnu/libc.so.6
7f0000003000-7f0000004000 rw-p 00000000 00:00 0
7f0000004000-7f0000005000 r-xp 00000000 08:01 3 /other/site-packages/nvidia/cublas/lib/libcublas.so.12
";
        assert_eq!(
            pip_nvidia_dirs(maps),
            vec![
                PathBuf::from("/venv/lib/python3.12/site-packages/nvidia"),
                PathBuf::from("/other/site-packages/nvidia"),
            ]
        );
        let found = candidates(maps);
        assert!(found.contains(&PathBuf::from(
            "/venv/lib/python3.12/site-packages/nvidia/cu13/lib/libcupti.so.13"
        )));
        assert!(found.contains(&PathBuf::from(
            "/other/site-packages/nvidia/cuda_cupti/lib/libcupti.so.12"
        )));
    }
}
