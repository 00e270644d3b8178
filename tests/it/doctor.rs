//! `devtrace doctor` on this machine (no NVIDIA driver: NVML, the CUDA
//! driver and CUPTI are absent and say what to do) and against the
//! stand-ins on the loader's path (found, with their versions), and its
//! exit status: 0 only when the chosen backends can run.

use std::path::Path;
use std::process::Command;

use crate::common::workload::{cupti_standin, standin_driver_dir};
use crate::common::{build_standin, BIN};

struct Doctor {
    status: i32,
    report: serde_json::Value,
}

impl Doctor {
    /// The check named `item` (its start), as the report has it.
    fn check(&self, item: &str) -> &serde_json::Value {
        self.report["checks"]
            .as_array()
            .unwrap()
            .iter()
            .find(|check| check["item"].as_str().unwrap().starts_with(item))
            .unwrap_or_else(|| panic!("no check {item} in {:#}", self.report))
    }

    fn status_of(&self, item: &str) -> &str {
        self.check(item)["status"].as_str().unwrap()
    }
}

/// Runs `devtrace doctor --json ARGS` with `library_path` for the loader
/// (none: the machine's own) and, unless ARGS name one, a free listen
/// address.
fn doctor(args: &[&str], library_path: Option<&Path>, env: &[(&str, &str)]) -> Doctor {
    let runtime = tempfile::tempdir().unwrap();
    let mut command = Command::new(BIN);
    command
        .args(["doctor", "--json"])
        .args(if args.contains(&"--listen") {
            &[][..]
        } else {
            &["--listen", "127.0.0.1:0"][..]
        })
        .arg("--runtime-dir")
        .arg(runtime.path().join("run"))
        .args(args)
        .env_remove("DEVTRACE_CUPTI_PATH")
        .env("CUDA_HOME", runtime.path().join("no-cuda"));
    match library_path {
        Some(path) => command.env("LD_LIBRARY_PATH", path),
        None => command.env_remove("LD_LIBRARY_PATH"),
    };
    command.envs(env.iter().copied());
    let output = command.output().unwrap();
    let report = serde_json::from_slice(&output.stdout).unwrap_or_else(|e| {
        panic!(
            "{e}: {}{}",
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        )
    });
    Doctor {
        status: output.status.code().unwrap_or(-1),
        report,
    }
}

/// The directory of the stand-in CUPTI, NVML and driver, each built here:
/// a check must not pass only when another test happened to build one.
fn standins() -> std::path::PathBuf {
    let dir = cupti_standin();
    build_standin("nvml.c", "libnvidia-ml.so.1");
    assert_eq!(standin_driver_dir(), dir);
    dir
}

#[test]
fn without_a_gpu_auto_is_ready_and_the_gpu_parts_say_what_to_install() {
    let doctor = doctor(&[], None, &[]);
    assert_eq!(doctor.status, 0, "{:#}", doctor.report);
    assert_eq!(doctor.report["ready"], true);
    assert_eq!(doctor.report["backends"]["mock"], "runs");
    assert_eq!(doctor.report["backends"]["nvml"], "not_usable");
    // As `serve` starts it: it serves the jobs that bring their own driver
    // (in containers sharing its runtime directory).
    assert_eq!(doctor.report["backends"]["cuda"], "runs");
    let nvml = doctor.check("NVML");
    assert_eq!(nvml["status"], "absent");
    assert!(nvml["hint"]
        .as_str()
        .unwrap()
        .starts_with("install the NVIDIA driver"));
    assert_eq!(doctor.status_of("CUDA driver"), "absent");
    let cupti = doctor.check("CUPTI on the host");
    assert_eq!(cupti["status"], "absent");
    assert!(cupti["hint"]
        .as_str()
        .unwrap()
        .contains("DEVTRACE_CUPTI_PATH"));
    assert_eq!(doctor.status_of("memory"), "ok");
    assert_eq!(doctor.status_of("listen 127.0.0.1:0"), "ok");
}

/// What serve stops at as it starts, doctor does not call ready: each such
/// flag is named, by serve's own check, and serve refuses it too.
#[test]
fn flags_serve_would_stop_at_are_not_ready() {
    let runtime = tempfile::tempdir().unwrap();
    let allowed = runtime.path().join("allowed").display().to_string();
    for (flags, said) in [
        (
            &["--spill-dir", "/dev/shm"][..],
            "--spill-dir /dev/shm: its files are kept in memory",
        ),
        (
            &["--tls-ca", "/nonexistent/ca.pem"][..],
            "cannot read /nonexistent/ca.pem",
        ),
        (
            &[
                "--cuda-attach",
                "all",
                "--inject-library",
                "/nonexistent.so",
            ][..],
            "--cuda-attach: no injection library at /nonexistent.so",
        ),
        (
            &[
                "--trigger",
                "name=w; when=explicit",
                "--trigger-repository",
                "/var/tmp/elsewhere",
                "--allow-root",
                allowed.as_str(),
            ][..],
            "--trigger-repository /var/tmp/elsewhere must lie inside an --allow-root",
        ),
        (
            &["--ebpf-cgroup", "/nonexistent/cgroup"][..],
            "--ebpf-cgroup /nonexistent/cgroup: No such file",
        ),
        (
            &["--ebpf-cgroup", "/tmp"][..],
            "--ebpf-cgroup /tmp: /tmp is not a cgroup v2 directory",
        ),
        (
            &["--admin-group", "no-such-devtrace-group"][..],
            "--admin-group no-such-devtrace-group: no such group on this host",
        ),
    ] {
        let args: Vec<&str> = [&["--backend", "mock"][..], flags].concat();
        let doctor = doctor(&args, None, &[]);
        assert_eq!(doctor.status, 1, "{flags:?}: {:#}", doctor.report);
        let check = doctor.check("serve");
        assert_eq!(check["status"], "fail", "{check:#}");
        assert!(
            check["detail"].as_str().unwrap().contains(said),
            "{check:#}"
        );
        // Each is said once, where it belongs, and not as a memory failure.
        assert_ne!(doctor.status_of("memory"), "fail", "{:#}", doctor.report);

        let serve_args: Vec<&str> = [
            &[
                "serve",
                "--listen",
                "127.0.0.1:0",
                "--metrics-listen",
                "off",
            ][..],
            &args,
            &["--runtime-dir", runtime.path().to_str().unwrap()],
        ]
        .concat();
        let served = Command::new(BIN).args(&serve_args).output().unwrap();
        assert_eq!(served.status.code(), Some(1), "{flags:?}");
        let stderr = String::from_utf8_lossy(&served.stderr);
        assert!(stderr.contains(said), "{stderr}");
    }
    // Addresses serve refuses once it binds them: plaintext other hosts
    // reach, and one address for both listeners.
    let taken = {
        let probe = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        probe.local_addr().unwrap().to_string()
    };
    for (flags, doctor_said, serve_said) in [
        (
            vec!["--listen", "0.0.0.0:0"],
            "can be reached from other hosts and would serve plaintext".to_string(),
            "can be reached from other hosts and would serve plaintext".to_string(),
        ),
        (
            vec!["--listen", &taken, "--metrics-listen", &taken],
            format!("--listen and --metrics-listen are both {taken}"),
            format!("cannot listen on {taken}"),
        ),
    ] {
        let args: Vec<&str> = [&["--backend", "mock"][..], &flags].concat();
        let doctor = doctor(&args, None, &[]);
        assert_eq!(doctor.status, 1, "{flags:?}: {:#}", doctor.report);
        let check = doctor.check("serve");
        assert!(
            check["detail"].as_str().unwrap().contains(&doctor_said),
            "{check:#}"
        );
        let served = Command::new(BIN)
            .arg("serve")
            .args(&args)
            .args(["--runtime-dir", runtime.path().to_str().unwrap()])
            .output()
            .unwrap();
        assert_eq!(served.status.code(), Some(1), "{flags:?}");
        let stderr = String::from_utf8_lossy(&served.stderr);
        assert!(stderr.contains(&serve_said), "{stderr}");
    }
    // A rule between flags is a usage error for both: no TCP listener and
    // no socket, or a socket mode for no socket.
    for flags in [["--listen", "off"], ["--listen-unix-mode", "0660"]] {
        for command in ["serve", "doctor"] {
            let out = Command::new(BIN).arg(command).args(flags).output().unwrap();
            assert_eq!(out.status.code(), Some(2), "{command} {flags:?}");
            assert!(String::from_utf8_lossy(&out.stderr).contains("--listen-unix <PATH>"));
        }
    }
}

#[test]
fn a_backend_asked_for_that_cannot_run_fails_the_check() {
    let doctor = doctor(&["--backend", "nvml"], None, &[]);
    assert_eq!(doctor.status, 1);
    assert_eq!(doctor.report["ready"], false);
    assert_eq!(doctor.report["backends"]["nvml"], "fails");
    assert!(doctor.report["backends"].get("mock").is_none());
}

#[test]
fn the_standins_are_found_with_their_versions() {
    let doctor = doctor(
        &["--backend", "nvml", "--backend", "cuda"],
        Some(&standins()),
        &[],
    );
    assert_eq!(doctor.status, 0, "{:#}", doctor.report);
    let nvml = doctor.check("NVML")["detail"].as_str().unwrap().to_string();
    assert!(
        nvml.starts_with("driver 580.00-standin, CUDA 13.0, 2 GPUs"),
        "{nvml}"
    );
    assert_eq!(
        doctor.check("CUDA driver")["detail"],
        "libcuda.so.1 supports CUDA 12.8"
    );
    let cupti = doctor.check("CUPTI on the host");
    assert_eq!(cupti["status"], "ok");
    assert!(
        cupti["detail"]
            .as_str()
            .unwrap()
            .ends_with("(API version 26)"),
        "{cupti}"
    );
    assert_eq!(doctor.report["backends"]["cuda"], "runs");
}

#[test]
fn a_cupti_the_injection_library_cannot_read_fails_cuda() {
    let newer = doctor(
        &["--backend", "cuda"],
        Some(&standins()),
        &[("DEVTRACE_STANDIN_CUPTI_VERSION", "140000")],
    );
    assert_eq!(newer.status, 1, "{:#}", newer.report);
    let cupti = newer.check("CUPTI on the host");
    assert_eq!(cupti["status"], "fail");
    assert!(
        cupti["detail"].as_str().unwrap().contains("CUDA 14"),
        "{cupti}"
    );
    let ga = doctor(
        &["--backend", "cuda"],
        Some(&standins()),
        &[("DEVTRACE_STANDIN_CUPTI_VERSION", "130000")],
    );
    assert_eq!(ga.status, 0);
    let cupti = ga.check("CUPTI on the host");
    assert_eq!(cupti["status"], "warn");
    assert!(cupti["hint"].as_str().unwrap().contains("Update 1"));
}

/// A Python environment's own CUDA wheels: its torch and the libcupti
/// its jobs load before the host's.
#[test]
fn a_python_environments_cupti_and_torch_are_read() {
    let venv = tempfile::tempdir().unwrap();
    let site = venv.path().join("lib/python3.12/site-packages");
    std::fs::create_dir_all(site.join("nvidia/cu13/lib")).unwrap();
    std::fs::create_dir_all(site.join("torch")).unwrap();
    std::fs::copy(
        cupti_standin().join("libcupti.so.12"),
        site.join("nvidia/cu13/lib/libcupti.so.13"),
    )
    .unwrap();
    std::fs::write(
        site.join("torch/version.py"),
        "__version__ = '2.11.0+cu130'\ncuda: Optional[str] = '13.0'\n",
    )
    .unwrap();
    // An interpreter whose only site directory is that one.
    let python = venv.path().join("python3");
    std::fs::write(&python, format!("#!/bin/sh\necho {}\n", site.display())).unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&python, std::fs::Permissions::from_mode(0o755)).unwrap();

    let doctor = doctor(
        &["--backend", "cuda", "--python", python.to_str().unwrap()],
        None,
        &[("DEVTRACE_STANDIN_CUPTI_VERSION", "130001")],
    );
    let environment = doctor.check("Python environment")["detail"]
        .as_str()
        .unwrap()
        .to_string();
    assert!(
        environment.ends_with("torch 2.11.0+cu130, built for CUDA 13.0"),
        "{environment}"
    );
    let cupti = doctor.check("CUPTI of");
    assert_eq!(cupti["status"], "ok", "{cupti}");
    // None on the host is then no failure: those jobs bring their own.
    assert_eq!(doctor.status_of("CUPTI on the host"), "ok");
    assert!(cupti["detail"]
        .as_str()
        .unwrap()
        .contains("nvidia/cu13/lib/libcupti.so.13: CUDA 13.0"));
}

/// Doctor run beside the agent it checks (in its container, say) finds the
/// listen address taken by that agent: a warning naming it, not a failure.
#[test]
fn an_address_a_devtrace_agent_holds_is_named_and_does_not_fail_the_check() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("agent.sock");
    let socket = socket.to_str().unwrap();
    let agent = crate::common::AgentProcess::start(&["--backend", "mock", "--listen-unix", socket]);
    let doctor = doctor(
        &[
            "--listen",
            &agent.address,
            "--listen-unix",
            socket,
            "--backend",
            "mock",
        ],
        None,
        &[],
    );
    let held = format!(
        "a devtrace agent (pid {}) listens there already",
        agent.pid()
    );
    for item in [
        format!("listen {}", agent.address),
        format!("listen unix {socket}"),
    ] {
        let check = doctor.check(&item);
        assert_eq!(check["status"], "warn", "{check:#}");
        assert!(
            check["detail"].as_str().unwrap().starts_with(&held),
            "{check:#}"
        );
    }
    assert_eq!(doctor.status, 0, "{:#}", doctor.report);
}

/// A vendor library that crashes the process loading it (here a libtpu
/// whose initialiser aborts) costs doctor that one check, with the reason:
/// the libraries are loaded in a child process.
#[test]
fn a_library_that_crashes_as_it_loads_fails_its_check_and_not_doctor() {
    let crashing = crate::common::build_program(
        "libtpu.c",
        "libtpu-aborting.so",
        &["-shared", "-fPIC", "-DSTANDIN_TPU_ABORT_ON_LOAD"],
    );
    let doctor = doctor(
        &[
            "--backend",
            "mock",
            "--tpu-library",
            crashing.to_str().unwrap(),
        ],
        None,
        &[],
    );
    let check = doctor.check("libtpu");
    assert_eq!(check["status"], "fail", "{check:#}");
    assert!(
        check["detail"]
            .as_str()
            .unwrap()
            .starts_with(&format!("crashed (signal {})", libc::SIGABRT)),
        "{check:#}"
    );
    // The mock backend runs: the TPU was not asked for.
    assert_eq!(doctor.status, 0, "{:#}", doctor.report);
}

/// An address in use fails; a runtime directory any user can empty is
/// warned of by doctor as `serve` warns of it, running on (it checks each
/// ring it opens there).
#[test]
fn an_address_in_use_is_not_ready_and_an_unsafe_runtime_directory_is_warned_of() {
    let held = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let address = held.local_addr().unwrap().to_string();
    let doctor = doctor(&["--listen", &address, "--backend", "mock"], None, &[]);
    assert_eq!(doctor.status, 1);
    assert_eq!(doctor.status_of(&format!("listen {address}")), "fail");

    let runtime = tempfile::tempdir().unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(runtime.path(), std::fs::Permissions::from_mode(0o777)).unwrap();
    let output = Command::new(BIN)
        .args(["doctor", "--listen", "127.0.0.1:0", "--backend", "cuda"])
        .arg("--runtime-dir")
        .arg(runtime.path())
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&output.stdout);
    assert_eq!(output.status.code(), Some(0), "{text}");
    assert!(
        text.contains("warn   cuda   runtime directory")
            && text.contains("any user can remove or replace another job's ring"),
        "{text}"
    );
    assert!(
        text.contains(&format!("-> chmod 1777 {}", runtime.path().display())),
        "{text}"
    );
    assert!(text.contains("\nready:"), "{text}");

    let mut serve = Command::new(BIN)
        .args(["serve", "--listen", "127.0.0.1:0", "--backend", "cuda"])
        .args(["--metrics-listen", "off", "--runtime-dir"])
        .arg(runtime.path())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let log = std::io::BufReader::new(serve.stderr.take().unwrap());
    let mut warned = false;
    for line in std::io::BufRead::lines(log) {
        let line = line.unwrap();
        warned |= line.contains("runtime directory: mode 0777: any user can remove");
        if line.contains("backend backend=\"cuda\" health=") {
            assert!(line.contains("health=running"), "{line}");
            break;
        }
    }
    let _ = serve.kill();
    let _ = serve.wait();
    assert!(warned, "serve did not warn of the runtime directory");
}

/// A runtime directory an agent serves: doctor warns (a second agent's
/// CUDA backend would not start there, though doctor is mostly run beside
/// the very agent it checks) and names that agent, without getting in its
/// way.
#[test]
fn a_runtime_directory_an_agent_serves_is_warned_of() {
    use std::os::unix::fs::PermissionsExt;
    let runtime = tempfile::tempdir().unwrap();
    std::fs::set_permissions(runtime.path(), std::fs::Permissions::from_mode(0o1777)).unwrap();
    let dir = runtime.path().to_str().unwrap();
    let agent = crate::common::AgentProcess::start(&["--backend", "cuda", "--runtime-dir", dir]);
    let output = Command::new(BIN)
        .args([
            "doctor",
            "--json",
            "--listen",
            "127.0.0.1:0",
            "--backend",
            "cuda",
        ])
        .args(["--runtime-dir", dir])
        .output()
        .unwrap();
    let doctor = Doctor {
        status: output.status.code().unwrap_or(-1),
        report: serde_json::from_slice(&output.stdout).expect("doctor --json"),
    };
    let check = doctor.check(&format!("runtime directory {dir}"));
    assert_eq!(check["status"], "warn", "{check:#}");
    let detail = check["detail"].as_str().unwrap();
    assert!(
        detail.contains(&format!("an agent (pid {}) serves it", agent.pid())),
        "{detail}"
    );
    assert_eq!(
        doctor.status, 0,
        "ready beside its agent: {:#}",
        doctor.report
    );
}

/// An agent's user that cannot make its missing runtime directory fails
/// the CUDA backend, as serve does (`cannot create ...: Permission
/// denied`); doctor said the agent would make it and was ready.
#[test]
fn a_runtime_directory_the_agents_user_cannot_make_fails() {
    // The agent runs as another user, which takes root.
    if !crate::common::is_root() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let runtime = dir.path().join("run");
    let output = Command::new("setpriv")
        .args(["--reuid=65534", "--regid=65534", "--clear-groups", "--"])
        .arg(BIN)
        .args([
            "doctor",
            "--json",
            "--listen",
            "127.0.0.1:0",
            "--metrics-listen",
            "off",
        ])
        .args(["--backend", "cuda", "--runtime-dir"])
        .arg(&runtime)
        .output()
        .unwrap();
    let report: serde_json::Value = serde_json::from_slice(&output.stdout)
        .unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&output.stderr)));
    let doctor = Doctor {
        status: output.status.code().unwrap_or(-1),
        report,
    };
    assert_eq!(
        doctor.status_of("runtime directory"),
        "fail",
        "{:#}",
        doctor.report
    );
    let detail = doctor.check("runtime directory")["detail"]
        .as_str()
        .unwrap();
    assert!(detail.contains("this user cannot make it"), "{detail}");
    assert_ne!(doctor.status, 0, "not ready: {:#}", doctor.report);
}
