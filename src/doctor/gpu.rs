//! GPU checks: the NVIDIA kernel driver, NVML as the NVML backend loads it,
//! the CUDA driver library, the libcupti an injected job would load (on
//! the host and in a given Python environment) and whether the injection
//! library reads its records, and the injection library itself.

use std::ffi::{c_int, OsStr, OsString};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use super::isolate::{isolated, CHECK_LIMIT};
use super::{Area, Finding, Status};

/// What the GPU checks need to know of the agent's flags.
pub struct GpuPlan<'a> {
    pub nvml_library: &'a OsStr,
    pub cuda_libraries: &'a [PathBuf],
    pub inject_library: &'a Path,
    /// The interpreter whose environment's libcupti is looked for.
    pub python: Option<&'a Path>,
}

pub fn check(plan: &GpuPlan) -> Vec<Finding> {
    let mut findings = vec![
        isolated(Area::Nvml, "NVML", CHECK_LIMIT, || nvml(plan.nvml_library)),
        isolated(Area::Cuda, "CUDA driver", CHECK_LIMIT, || {
            cuda_driver(plan.cuda_libraries)
        }),
    ];
    let (python, python_has_cupti) = cupti_of_python(plan.python);
    findings.extend(cupti_on_host().into_iter().map(|finding| {
        // Jobs of that environment bring their own: none on the host is
        // no reason the CUDA backend cannot trace them.
        if finding.status == Status::Absent && python_has_cupti {
            Finding {
                status: Status::Ok,
                hint: None,
                detail: format!(
                    "{}; the Python environment's jobs load their own",
                    finding.detail
                ),
                ..finding
            }
        } else {
            finding
        }
    }));
    findings.extend(python);
    findings.push(inject_library(plan.inject_library));
    findings
}

const INSTALL_DRIVER: &str =
    "install the NVIDIA driver (it brings the kernel module, libcuda.so.1 and libnvidia-ml.so.1); \
     without a GPU, `--backend mock` shows what devtrace records";

/// NVML, initialised as the backend does it.
fn nvml(library: &OsStr) -> Finding {
    let shown = library.to_string_lossy();
    let nvml = match nvml_wrapper::Nvml::builder().lib_path(library).init() {
        Ok(nvml) => nvml,
        Err(nvml_wrapper::error::NvmlError::LibloadingError(error)) => {
            return match crate::backend::nvml::kernel_module() {
                // The driver is there but its library is not where the
                // loader looks (a container without the NVIDIA runtime's
                // mounts, or a driver installed under another prefix).
                Some(module) => Finding::new(
                    Area::Nvml,
                    "NVML",
                    Status::Fail,
                    format!("the NVIDIA kernel module {module} is loaded, but {shown} cannot be loaded: {error}"),
                )
                .hint("give --nvml-library the driver's libnvidia-ml.so.1; in a container, run it with the NVIDIA container runtime"),
                None => Finding::new(
                    Area::Nvml,
                    "NVML",
                    Status::Absent,
                    format!("no NVIDIA driver: no kernel module (/proc/driver/nvidia/version), and {shown} cannot be loaded"),
                )
                .hint(INSTALL_DRIVER),
            };
        }
        // A library without a driver: no GPU here, as the backend judges.
        Err(error) if crate::backend::nvml::init_failure_means_no_gpu(&error) => {
            return Finding::new(
                Area::Nvml,
                "NVML",
                Status::Absent,
                format!("{shown} loaded, but no NVIDIA driver is: {error}"),
            )
            .hint(INSTALL_DRIVER);
        }
        Err(error) => {
            return Finding::new(Area::Nvml, "NVML", Status::Fail, format!("{shown} loaded, but nvmlInit failed: {error}"))
                .hint("check that `nvidia-smi` works for this user; in a container, give it the GPUs (--gpus, or the NVIDIA device plugin)");
        }
    };
    let driver = nvml
        .sys_driver_version()
        .unwrap_or_else(|e| format!("unknown ({e})"));
    let cuda = nvml
        .sys_cuda_driver_version()
        .map(|v| format!(", CUDA {}.{}", v / 1000, (v % 1000) / 10))
        .unwrap_or_default();
    match nvml.device_count() {
        // No GPU to record, as the backend judges: `auto` runs the mock.
        Ok(0) => Finding::new(
            Area::Nvml,
            "NVML",
            Status::Absent,
            format!("driver {driver}{cuda}, but no GPU is visible"),
        )
        .hint("in a container, give it the GPUs; on a host, see `nvidia-smi`"),
        Ok(count) => Finding::new(
            Area::Nvml,
            "NVML",
            Status::Ok,
            format!(
                "driver {driver}{cuda}, {count} GPU{} ({shown})",
                if count == 1 { "" } else { "s" }
            ),
        ),
        Err(error) => Finding::new(
            Area::Nvml,
            "NVML",
            Status::Fail,
            format!("driver {driver}{cuda}, counting GPUs failed: {error}"),
        ),
    }
}

/// The CUDA driver library the workloads (and the eBPF backend's probes)
/// use, and the CUDA version it supports.
fn cuda_driver(libraries: &[PathBuf]) -> Finding {
    let candidates: Vec<OsString> = if libraries.is_empty() {
        vec!["libcuda.so.1".into()]
    } else {
        libraries
            .iter()
            .map(|path| path.clone().into_os_string())
            .collect()
    };
    let mut tried = Vec::new();
    for candidate in &candidates {
        // SAFETY: loading the CUDA driver runs its initialisers, as every
        // CUDA program does; cuDriverGetVersion is callable before cuInit.
        let version = unsafe {
            libloading::Library::new(candidate).and_then(|library| {
                let get: libloading::Symbol<unsafe extern "C" fn(*mut c_int) -> c_int> =
                    library.get(b"cuDriverGetVersion\0")?;
                let mut version: c_int = 0;
                Ok((get(&mut version), version))
            })
        };
        match version {
            Ok((0, version)) => {
                return Finding::new(
                    Area::Cuda,
                    "CUDA driver",
                    Status::Ok,
                    format!(
                        "{} supports CUDA {}.{}",
                        candidate.to_string_lossy(),
                        version / 1000,
                        (version % 1000) / 10
                    ),
                )
            }
            Ok((code, _)) => tried.push(format!(
                "{}: cuDriverGetVersion returned {code}",
                candidate.to_string_lossy()
            )),
            Err(error) => tried.push(format!("{}: {error}", candidate.to_string_lossy())),
        }
    }
    Finding::new(
        Area::Cuda,
        "CUDA driver",
        Status::Absent,
        format!("no CUDA driver library ({})", tried.join("; ")),
    )
    .hint(format!(
        "{INSTALL_DRIVER}; --cuda-library PATH names a driver outside the loader's path"
    ))
}

/// What one libcupti file says of itself, asked in a child process (see
/// [`isolated`]).
fn cupti_version(path: &OsStr) -> Result<u32, String> {
    let item = "libcupti";
    let answer = isolated(
        Area::Cuda,
        item,
        CHECK_LIMIT,
        || match loaded_cupti_version(path) {
            Ok(version) => Finding::new(Area::Cuda, item, Status::Ok, version.to_string()),
            Err(error) => Finding::new(Area::Cuda, item, Status::Fail, error),
        },
    );
    match answer.status {
        Status::Ok => answer.detail.parse().map_err(|_| answer.detail),
        _ => Err(answer.detail),
    }
}

/// What one libcupti file says of itself, loaded into this process.
fn loaded_cupti_version(path: &OsStr) -> Result<u32, String> {
    // SAFETY: cuptiGetVersion writes one u32 and needs no GPU or CUDA
    // context; the library's initialisers are those every profiler runs.
    unsafe {
        let library = libloading::Library::new(path).map_err(|e| e.to_string())?;
        let get: libloading::Symbol<unsafe extern "C" fn(*mut u32) -> c_int> = library
            .get(b"cuptiGetVersion\0")
            .map_err(|e| e.to_string())?;
        let mut version = 0u32;
        match get(&mut version) {
            0 => Ok(version),
            code => Err(format!("cuptiGetVersion returned {code}")),
        }
    }
}

/// The CUDA release a CUPTI API version belongs to, as people name it.
fn release(version: u32) -> String {
    if version >= 10_000 {
        format!("CUDA {}.{}", version / 10_000, (version / 100) % 100)
    } else {
        "CUDA 12.x".to_string()
    }
}

/// Judges one libcupti as the injection library would at load.
fn cupti_finding(item: String, path: &OsStr) -> Finding {
    let shown = path.to_string_lossy();
    match cupti_version(path) {
        Ok(version) => match devtrace_shm::cupti::support(version) {
            Ok(devtrace_shm::cupti::Support::Supported) => {
                Finding::new(Area::Cuda, item, Status::Ok, format!("{shown}: {} (API version {version})", release(version)))
            }
            Ok(devtrace_shm::cupti::Support::Warn(text)) => {
                Finding::new(Area::Cuda, item, Status::Warn, format!("{shown}: {} (API version {version})", release(version)))
                    .hint(text)
            }
            Err(reason) => Finding::new(Area::Cuda, item, Status::Fail, format!("{shown}: {reason}"))
                .hint("point DEVTRACE_CUPTI_PATH at a libcupti of CUDA 12.2 to 13.x (pip install nvidia-cuda-cupti)"),
        },
        Err(reason) => Finding::new(Area::Cuda, item, Status::Fail, format!("{shown}: {reason}")),
    }
}

/// libcupti outside any Python environment, in the injection library's
/// order (no process maps here, so no pip layout): `DEVTRACE_CUPTI_PATH`,
/// `$CUDA_HOME`'s extras, then the loader's path.
fn cupti_on_host() -> Vec<Finding> {
    let mut files: Vec<OsString> = devtrace_shm::cupti::candidates("")
        .into_iter()
        .filter(|path| path.exists())
        .map(PathBuf::into_os_string)
        .collect();
    if files.is_empty() {
        // The loader's own search: a name, resolved as dlopen would.
        files.extend(
            devtrace_shm::cupti::SONAMES
                .iter()
                .map(OsString::from)
                .filter(|name| cupti_version(name).is_ok()),
        );
    }
    if files.is_empty() {
        return vec![Finding::new(
            Area::Cuda,
            "CUPTI on the host",
            Status::Absent,
            format!(
                "no libcupti in DEVTRACE_CUPTI_PATH, {}/extras/CUPTI/lib64 or on the loader's path",
                devtrace_shm::cupti::cuda_home().display()
            ),
        )
        .hint(
            "PyTorch and JAX jobs bring their own (pip's nvidia-cuda-cupti; see the Python line); \
             for others install CUDA's CUPTI, or pip install nvidia-cuda-cupti and set \
             DEVTRACE_CUPTI_PATH to its lib directory",
        )];
    }
    files
        .iter()
        .enumerate()
        .map(|(index, file)| {
            let item = if index == 0 {
                "CUPTI on the host (used first)"
            } else {
                "CUPTI on the host"
            };
            cupti_finding(item.into(), file)
        })
        .collect()
}

/// The Python environment's CUDA wheels: the libcupti its processes map
/// beside their CUDA libraries, which the injection library takes first;
/// and whether there is one.
fn cupti_of_python(python: Option<&Path>) -> (Vec<Finding>, bool) {
    let Some(python) = python else {
        let unchecked = vec![Finding::new(
            Area::Cuda,
            "Python environment",
            Status::Ok,
            "not checked: no python3 on PATH (--python names the interpreter your jobs run with)",
        )];
        return (unchecked, false);
    };
    let shown = python.display();
    let site_dirs = match site_packages(python) {
        Ok(dirs) => dirs,
        Err(reason) => {
            let unread = Finding::new(
                Area::Cuda,
                "Python environment",
                Status::Warn,
                format!("{shown}: {reason}"),
            )
            .hint("--python names the interpreter your jobs run with");
            return (vec![unread], false);
        }
    };
    let mut findings = Vec::new();
    let torch = site_dirs.iter().find_map(|dir| torch_cuda(dir));
    if let Some((version, cuda)) = &torch {
        findings.push(Finding::new(
            Area::Cuda,
            "Python environment",
            Status::Ok,
            format!(
                "{shown}: torch {version}, built for CUDA {}",
                cuda.as_deref().unwrap_or("none (a CPU build)")
            ),
        ));
    }
    let cupti = site_dirs.iter().find_map(|dir| {
        devtrace_shm::cupti::pip_files(&dir.join("nvidia"))
            .into_iter()
            .find(|path| path.exists())
    });
    let has_cupti = cupti.is_some();
    match cupti {
        Some(path) => findings.push(cupti_finding(
            format!("CUPTI of {shown}'s jobs"),
            path.as_os_str(),
        )),
        None => {
            let finding = Finding::new(
                Area::Cuda,
                format!("CUPTI of {shown}'s jobs"),
                Status::Ok,
                "no pip libcupti (nvidia/cu13 or nvidia/cuda_cupti) in its site-packages: its jobs use the host's",
            );
            // A CUDA build of torch without its CUPTI wheel is a torn
            // environment; without torch it is only not a CUDA one.
            findings.push(match torch {
                Some(_) => Finding {
                    status: Status::Warn,
                    ..finding
                }
                .hint("pip install nvidia-cuda-cupti into that environment for a CUPTI matching its CUDA"),
                None => finding,
            });
        }
    }
    (findings, has_cupti)
}

/// The interpreter's site-packages directories.
fn site_packages(python: &Path) -> Result<Vec<PathBuf>, String> {
    let script = "import site, sys, sysconfig\n\
                  dirs = list(site.getsitepackages()) + [site.getusersitepackages(), sysconfig.get_paths()['purelib']]\n\
                  print('\\n'.join(dirs))";
    let output = run_with_limit(
        Command::new(python).args(["-I", "-c", script]),
        Duration::from_secs(20),
    )?;
    let mut dirs: Vec<PathBuf> = Vec::new();
    for line in output.lines().filter(|line| !line.is_empty()) {
        let dir = PathBuf::from(line);
        if dir.is_dir() && !dirs.contains(&dir) {
            dirs.push(dir);
        }
    }
    Ok(dirs)
}

/// torch's version and the CUDA it was built for, read from its
/// `version.py` (importing torch takes seconds and may touch the GPU).
fn torch_cuda(site: &Path) -> Option<(String, Option<String>)> {
    let text = crate::model::small_file::read(&site.join("torch/version.py"), 64 << 10).ok()?;
    let text = String::from_utf8_lossy(&text);
    let value = |name: &str| {
        text.lines().find_map(|line| {
            let rest = line.strip_prefix(name)?.trim_start();
            let rest = rest
                .strip_prefix(':')
                .map_or(rest, |typed| typed.split_once('=').map_or("", |(_, v)| v));
            let rest = rest.trim_start().strip_prefix('=').unwrap_or(rest).trim();
            (rest != "None").then(|| rest.trim_matches(|c| c == '\'' || c == '"').to_string())
        })
    };
    Some((value("__version__")?, value("cuda")))
}

/// Runs a command, killing it after `limit`; its standard output.
fn run_with_limit(command: &mut Command, limit: Duration) -> Result<String, String> {
    let mut child = command
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .map_err(|e| format!("cannot run it: {e}"))?;
    let started = std::time::Instant::now();
    loop {
        match child.try_wait() {
            Ok(Some(status)) => {
                let mut out = String::new();
                if let Some(mut stdout) = child.stdout.take() {
                    use std::io::Read;
                    let _ = stdout.by_ref().take(1 << 20).read_to_string(&mut out);
                }
                return if status.success() {
                    Ok(out)
                } else {
                    Err(format!("it exited with {status}"))
                };
            }
            Ok(None) if started.elapsed() < limit => std::thread::sleep(Duration::from_millis(20)),
            Ok(None) => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(format!("it did not answer within {} s", limit.as_secs()));
            }
            Err(error) => return Err(error.to_string()),
        }
    }
}

/// The library workloads load through `CUDA_INJECTION64_PATH`: there, and
/// safe to hand to every job (no other user can replace it or a directory
/// above it, which would run their code inside every traced job). Missing,
/// it is a warning: the agent starts without it (no job can be traced
/// until it is there), and `--cuda-attach`, which needs it, is refused by
/// serve itself ([`crate::cli::serve`]'s refusals).
fn inject_library(path: &Path) -> Finding {
    let item = "injection library";
    let shown = path.display();
    let missing = |detail: String| {
        Finding::new(
            Area::Cuda,
            item,
            Status::Warn,
            format!("{detail}: the agent starts, but no job can load it (CUDA_INJECTION64_PATH), so none is traced"),
        )
        .hint("build it with `cargo build --release` (target/release/libdevtrace_inject.so) or install the image's /opt/devtrace/lib; --inject-library names another")
    };
    let metadata = match std::fs::metadata(path) {
        Ok(metadata) if metadata.is_file() => metadata,
        Ok(_) => return missing(format!("{shown} is not a file")),
        Err(error) => return missing(format!("{shown}: {error}")),
    };
    if metadata.mode() & 0o004 == 0 {
        return Finding::new(
            Area::Cuda,
            item,
            Status::Warn,
            format!("{shown} is not readable by other users: only its owner's jobs can load it"),
        )
        .hint(format!("chmod a+r {shown}"));
    }
    // SAFETY: geteuid has no preconditions.
    let agent = unsafe { libc::geteuid() };
    let mut ancestor = Some(path);
    while let Some(current) = ancestor {
        if let Ok(metadata) = std::fs::metadata(current) {
            let writable_by_others = metadata.mode() & 0o022 != 0
                && !(metadata.is_dir() && metadata.mode() & 0o1000 != 0 && current != path);
            let owner = metadata.uid();
            if writable_by_others || (owner != 0 && owner != agent) {
                return Finding::new(
                    Area::Cuda,
                    item,
                    Status::Fail,
                    format!("{shown}: {} can be changed by users other than root and you, and every traced job would run what they put there", current.display()),
                )
                .hint("install it under a root-owned directory, e.g. /opt/devtrace/lib (the image does)");
            }
        }
        ancestor = current.parent();
    }
    Finding::new(
        Area::Cuda,
        item,
        Status::Ok,
        format!("{shown}: start jobs with CUDA_INJECTION64_PATH={shown}"),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn torch_versions_are_read_from_both_spellings_of_version_py() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir(dir.path().join("torch")).unwrap();
        let file = dir.path().join("torch/version.py");
        std::fs::write(&file, "from typing import Optional\n__version__ = '2.11.0+cu130'\ncuda: Optional[str] = '13.0'\n").unwrap();
        assert_eq!(
            torch_cuda(dir.path()),
            Some(("2.11.0+cu130".into(), Some("13.0".into())))
        );
        std::fs::write(&file, "__version__ = \"2.4.0+cpu\"\ncuda = None\n").unwrap();
        assert_eq!(torch_cuda(dir.path()), Some(("2.4.0+cpu".into(), None)));
    }

    #[test]
    fn cupti_versions_are_named_by_release() {
        assert_eq!(release(130001), "CUDA 13.0");
        assert_eq!(release(130200), "CUDA 13.2");
        assert_eq!(release(26), "CUDA 12.x");
    }

    #[test]
    fn an_injection_library_under_a_directory_others_can_write_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let library = dir.path().join("libdevtrace_inject.so");
        std::fs::write(&library, b"\x7fELF").unwrap();
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&library, std::fs::Permissions::from_mode(0o644)).unwrap();
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o777)).unwrap();
        assert_eq!(inject_library(&library).status, Status::Fail);
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
        let finding = inject_library(&library);
        // The temporary directory sits under /tmp, sticky and world-writable:
        // a sticky directory above is fine, the file's own must not be open.
        assert_eq!(finding.status, Status::Ok, "{finding:?}");
        assert!(finding.detail.contains("CUDA_INJECTION64_PATH="));
        std::fs::set_permissions(&library, std::fs::Permissions::from_mode(0o600)).unwrap();
        assert_eq!(inject_library(&library).status, Status::Warn);
        // Missing: serve starts all the same (only --cuda-attach needs it,
        // and serve refuses that itself).
        let missing = inject_library(&dir.path().join("absent.so"));
        assert_eq!(missing.status, Status::Warn, "{missing:?}");
        assert!(missing.detail.contains("no job can load it"), "{missing:?}");
    }
}
