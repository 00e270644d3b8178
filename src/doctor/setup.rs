//! The agent's own setup, as `devtrace serve` would meet it at start: the
//! runtime directory injected jobs write their rings into, the addresses it
//! listens on, the roots it writes traces under, its TLS files, and whether
//! its memory budgets fit the limit it runs under.

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use super::{Area, Finding, Status};
use crate::backend::cuda::runtime_dir;
use crate::model::filesystem;
use crate::protocol::tls::{self, TlsError};
use crate::repository::Location;

/// What the setup checks need to know of the agent's flags.
pub struct SetupPlan<'a> {
    pub runtime_dir: &'a Path,
    /// `None` for `--listen off`.
    pub listen: Option<&'a str>,
    pub listen_unix: Option<&'a Path>,
    pub metrics_listen: Option<&'a str>,
    pub allow_roots: &'a [PathBuf],
    pub tls_cert: Option<&'a Path>,
    pub tls_key: Option<&'a Path>,
    pub tls_client_ca: Option<&'a Path>,
    /// The budgets as serve sizes them: its log line and what it warns of
    /// them, or why they fail.
    pub memory: Result<(String, Option<String>), String>,
    /// Whether the CUDA backend would run (the runtime directory is its).
    pub cuda_chosen: bool,
    /// The longest capture window, and why it is less than --max-duration
    /// asked, if it is.
    pub window_limit: (std::time::Duration, Option<String>),
    /// Why serve would stop at start, by its own checks of these flags.
    pub refusals: Vec<String>,
}

pub fn check(plan: &SetupPlan) -> Vec<Finding> {
    let mut findings = Vec::new();
    findings.push(runtime_dir(plan.runtime_dir, plan.cuda_chosen));
    findings.extend(
        plan.refusals
            .iter()
            .map(|why| Finding::new(Area::Agent, "serve", Status::Fail, why.clone())),
    );
    if let Some(listen) = plan.listen {
        findings.push(tcp_address("listen", listen));
    }
    if let Some(path) = plan.listen_unix {
        findings.push(unix_socket(path));
    }
    if let Some(metrics) = plan.metrics_listen {
        findings.push(tcp_address("metrics listen", metrics));
    }
    findings.extend(plan.allow_roots.iter().map(|root| allow_root(root)));
    if let Some(cert) = plan.tls_cert {
        findings.push(tls_certificate("--tls-cert", cert, plan.tls_key));
    }
    if let Some(ca) = plan.tls_client_ca {
        findings.push(tls_certificate("--tls-client-ca", ca, None));
    }
    // What the TLS library itself refuses (a v1 certificate, say), as
    // serve finds it before it listens; unreadable files are said above.
    if let (Some(cert), Some(key)) = (plan.tls_cert, plan.tls_key) {
        if let Err(error @ TlsError::Unusable { .. }) =
            tls::server_config(cert, key, plan.tls_client_ca)
        {
            findings.push(Finding::new(
                Area::Agent,
                "TLS",
                Status::Fail,
                error.to_string(),
            ));
        }
    }
    findings.push(match &plan.window_limit {
        (_, Some(held)) => Finding::new(Area::Agent, "max duration", Status::Warn, held.clone()),
        (longest, None) => Finding::new(
            Area::Agent,
            "max duration",
            Status::Ok,
            format!("captures of up to {}s", longest.as_secs_f64()),
        ),
    });
    findings.push(match &plan.memory {
        Ok((budgets, None)) => Finding::new(Area::Agent, "memory", Status::Ok, budgets.clone()),
        Ok((budgets, Some(scant))) => Finding::new(
            Area::Agent,
            "memory",
            Status::Warn,
            format!("{budgets}; {scant}"),
        ),
        Err(reason) => Finding::new(Area::Agent, "memory", Status::Fail, reason.clone()),
    });
    findings
}

/// The directory every injected job creates its ring in, judged as
/// `serve` judges it ([`runtime_dir::concern`]): only one it cannot use
/// fails; the others are warned of, as `serve` warns of them and runs.
fn runtime_dir(dir: &Path, cuda_chosen: bool) -> Finding {
    let finding = judge_runtime_dir(dir, cuda_chosen);
    if cuda_chosen || finding.status != Status::Fail {
        return finding;
    }
    // Only the CUDA backend uses it: serve without it starts all the same.
    Finding {
        status: Status::Warn,
        detail: format!(
            "{}; unused while the CUDA backend is not chosen",
            finding.detail
        ),
        ..finding
    }
}

fn judge_runtime_dir(dir: &Path, cuda_chosen: bool) -> Finding {
    let area = if cuda_chosen { Area::Cuda } else { Area::Agent };
    let item = format!("runtime directory {}", dir.display());
    let concern = match runtime_dir::concern(dir) {
        Ok(concern) => concern,
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => {
            return match made_up_refusal(dir) {
                Some(refusal) => Finding::new(area, item, Status::Fail, refusal).hint(
                    "choose a --runtime-dir on an ordinary filesystem, such as /run/devtrace",
                ),
                None => match filesystem::writable_part(dir) {
                    (_, true) => Finding::new(
                        area,
                        item,
                        Status::Ok,
                        "missing: the agent makes it (mode 1777, like /tmp)",
                    ),
                    (existing, false) => Finding::new(
                        area,
                        item,
                        Status::Fail,
                        format!(
                            "missing, and this user cannot make it: {} is not writable by it",
                            existing.display()
                        ),
                    )
                    .hint("make it beforehand (mode 1777, or owned by the agent's user), or choose a --runtime-dir this user can make"),
                },
            }
        }
        Err(error) => return Finding::new(area, item, Status::Fail, error.to_string()),
    };
    if let Some(concern) = concern.as_ref().filter(|concern| concern.fatal()) {
        return Finding::new(area, item, Status::Fail, concern.text()).hint(concern.hint(dir));
    }
    let metadata = match std::fs::metadata(dir) {
        Ok(metadata) => metadata,
        Err(error) => return Finding::new(area, item, Status::Fail, error.to_string()),
    };
    let (mode, owner) = (metadata.mode() & 0o7777, metadata.uid());
    // Each thing to warn of, with what to do about it.
    let mut warnings: Vec<(String, String)> = Vec::new();
    if let Some(concern) = &concern {
        warnings.push((concern.text(), concern.hint(dir)));
    }
    if let Some(holder) = cuda_chosen
        .then(|| crate::backend::cuda::runtime_lock::holder(dir))
        .flatten()
    {
        // A warning, as for a listen address an agent holds: doctor is run
        // beside the very agent it checks, which holds the lock; a second
        // agent's CUDA backend would not start on it.
        let pid = holder
            .map(|pid| format!(" (pid {pid})"))
            .unwrap_or_default();
        warnings.push((
            format!(
                "an agent{pid} serves it: if it is not the one these flags are for, this \
                 agent's CUDA backend would not start on it"
            ),
            "stop the other agent, or give this one its own --runtime-dir".into(),
        ));
    }
    if warnings.is_empty() {
        return Finding::new(
            area,
            item,
            Status::Ok,
            format!("mode {mode:04o}, owned by uid {owner}"),
        );
    }
    let (texts, hints): (Vec<String>, Vec<String>) = warnings.into_iter().unzip();
    // A concern names the mode or owner itself.
    let detail = match concern {
        Some(_) => texts.join("; "),
        None => format!(
            "mode {mode:04o}, owned by uid {owner}; {}",
            texts.join("; ")
        ),
    };
    Finding::new(area, item, Status::Warn, detail).hint(hints.join("; "))
}

/// Binds a TCP address the way the agent will, and lets it go.
fn tcp_address(item: &str, address: &str) -> Finding {
    match std::net::TcpListener::bind(address) {
        Ok(listener) => {
            let bound = listener
                .local_addr()
                .map(|a| a.to_string())
                .unwrap_or_else(|_| address.into());
            Finding::new(
                Area::Agent,
                format!("{item} {address}"),
                Status::Ok,
                format!("free ({bound})"),
            )
        }
        Err(error) if error.kind() == std::io::ErrorKind::AddrInUse => {
            let port = address.rsplit(':').next().unwrap_or(address);
            let holder = port
                .parse()
                .ok()
                .and_then(|port| holder_of(&crate::protocol::caller::tcp_listeners(port)));
            let item = format!("{item} {address}");
            match holder {
                // Doctor run beside the agent it checks: not a fault.
                Some((pid, command)) if command == "devtrace" => Finding::new(
                    Area::Agent,
                    item,
                    Status::Warn,
                    format!(
                        "a devtrace agent (pid {pid}) listens there already; a second one \
                         would not start on it"
                    ),
                ),
                Some((pid, command)) => Finding::new(
                    Area::Agent,
                    item,
                    Status::Fail,
                    format!("in use: {command} (pid {pid}) listens there"),
                )
                .hint("stop it or choose another address"),
                None => Finding::new(
                    Area::Agent,
                    item,
                    Status::Fail,
                    "in use: another agent or program listens there",
                )
                .hint(format!(
                    "`ss -ltnp 'sport = :{port}'` names it; stop it or choose another address"
                )),
            }
        }
        Err(error) => Finding::new(
            Area::Agent,
            format!("{item} {address}"),
            Status::Fail,
            error.to_string(),
        ),
    }
}

/// The process holding one of the sockets `inodes` (its pid and command
/// name), found among the descriptors of `/proc`'s processes: every
/// process's as root, one's own user's otherwise.
fn holder_of(inodes: &[u64]) -> Option<(u32, String)> {
    let wanted: Vec<String> = inodes
        .iter()
        .map(|inode| format!("socket:[{inode}]"))
        .collect();
    if wanted.is_empty() {
        return None;
    }
    for process in std::fs::read_dir("/proc").ok()?.flatten() {
        let Some(pid) = process
            .file_name()
            .to_str()
            .and_then(|n| n.parse::<u32>().ok())
        else {
            continue;
        };
        let Ok(descriptors) = std::fs::read_dir(process.path().join("fd")) else {
            continue;
        };
        let holds = descriptors.flatten().any(|fd| {
            std::fs::read_link(fd.path())
                .is_ok_and(|target| wanted.iter().any(|w| target.as_os_str() == w.as_str()))
        });
        if holds {
            let command = std::fs::read_to_string(process.path().join("comm")).unwrap_or_default();
            return Some((pid, command.trim().to_string()));
        }
    }
    None
}

fn unix_socket(path: &Path) -> Finding {
    use crate::protocol::unix_socket::{occupant, Occupant};
    let item = format!("listen unix {}", path.display());
    let finding = |status, text: &str| Finding::new(Area::Agent, item.clone(), status, text);
    match occupant(path) {
        Occupant::Nothing => {
            let parent = path
                .parent()
                .filter(|p| !p.as_os_str().is_empty())
                .unwrap_or(Path::new("."));
            if parent.is_dir() {
                finding(Status::Ok, "free")
            } else {
                finding(
                    Status::Fail,
                    &format!("{} does not exist", parent.display()),
                )
            }
        }
        Occupant::NotASocket => {
            finding(Status::Fail, "a file that is not a socket is already there")
        }
        Occupant::Listening => match unix_listener(path) {
            // Doctor run beside the agent it checks: not a fault.
            Some((pid, command)) if command == "devtrace" => finding(
                Status::Warn,
                &format!(
                    "a devtrace agent (pid {pid}) listens there already; a second one would \
                     not start on it"
                ),
            ),
            Some((pid, command)) => finding(
                Status::Fail,
                &format!("in use: {command} (pid {pid}) listens there"),
            )
            .hint("stop it, or choose another path"),
            None => finding(Status::Fail, "in use: something accepts connections on it")
                .hint("stop the other agent, or choose another path"),
        },
        Occupant::Stale => finding(Status::Ok, "a stale socket, which the agent replaces"),
        Occupant::Unknown => finding(
            Status::Fail,
            "a socket is there that cannot be connected to (another user's?)",
        )
        .hint("remove it if no server uses it, or choose another path"),
    }
}

/// The process listening on the Unix socket at `path` (its pid and
/// command name): the credentials its peer had when it listened
/// (`SO_PEERCRED`). (`/proc/net/unix` would name the path the socket was
/// bound at, which the agent moves into place after binding.)
fn unix_listener(path: &Path) -> Option<(u32, String)> {
    use std::os::fd::AsRawFd;
    let stream = std::os::unix::net::UnixStream::connect(path).ok()?;
    // SAFETY: plain data, filled in by getsockopt below.
    let mut credentials: libc::ucred = unsafe { std::mem::zeroed() };
    let mut length = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: a connected socket this function owns, and a buffer of the
    // length given.
    let rc = unsafe {
        libc::getsockopt(
            stream.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&mut credentials as *mut libc::ucred).cast(),
            &mut length,
        )
    };
    let pid = u32::try_from(credentials.pid)
        .ok()
        .filter(|pid| rc == 0 && *pid > 0)?;
    let command = std::fs::read_to_string(format!("/proc/{pid}/comm")).ok()?;
    Some((pid, command.trim().to_string()))
}

/// A root the agent writes traces under: a local directory it can write
/// (or make), or an object-storage URL (not contacted here).
fn allow_root(root: &Path) -> Finding {
    let item = format!("allow-root {}", root.display());
    match Location::parse(root) {
        Ok(Location::Local(_)) => {}
        Ok(Location::Object(_)) => return Finding::new(
            Area::Agent,
            item,
            Status::Ok,
            "object storage: not contacted here (credentials come from the agent's environment)",
        ),
        Err(e) => return Finding::new(Area::Agent, item, Status::Fail, e.to_string()),
    }
    let (existing, writable) = filesystem::writable_part(root);
    if existing != root && !existing.is_dir() {
        return Finding::new(
            Area::Agent,
            item,
            Status::Fail,
            format!("{} is not a directory", existing.display()),
        );
    }
    if let Some(refusal) = made_up_refusal(root) {
        return Finding::new(Area::Agent, item, Status::Fail, refusal)
            .hint("choose an --allow-root on an ordinary filesystem");
    }
    match (existing == root, writable) {
        (true, true) => Finding::new(Area::Agent, item, Status::Ok, "writable"),
        (false, true) => Finding::new(
            Area::Agent,
            item,
            Status::Ok,
            format!("missing: the agent makes it under {}", existing.display()),
        ),
        (_, false) => Finding::new(
            Area::Agent,
            item,
            Status::Fail,
            format!("{} is not writable by this user", existing.display()),
        )
        .hint("run the agent as a user that can write there, or choose another --allow-root"),
    }
}

/// Why no trace file can be made at `path`, root's neither, though
/// `access` says writable: it is on a filesystem the kernel makes up
/// (`/proc`, `/sys`), or, missing, cannot be made on one.
fn made_up_refusal(path: &Path) -> Option<String> {
    let (existing, name) = filesystem::made_up_part(path)?;
    Some(if existing == path {
        format!("on {name}, which the kernel makes up: no trace file can be made there")
    } else {
        format!(
            "missing, and cannot be made: {} is on {name}, which the kernel makes up",
            existing.display()
        )
    })
}

/// A PEM certificate (and its key): readable, parsed, within its validity
/// dates, and, with a key, the key of that certificate.
fn tls_certificate(flag: &'static str, path: &Path, key: Option<&Path>) -> Finding {
    let item = format!("{flag} {}", path.display());
    // Judged as serve judges it as it starts.
    let facts = match tls::certificate_facts(flag, path, flag == "--tls-cert") {
        Ok(facts) => facts,
        // What serve refuses of its own certificate fails; of a client CA
        // (whose dates serve does not judge), it warns.
        Err(TlsError::Refused { reason, .. }) if flag == "--tls-client-ca" => {
            return Finding::new(Area::Agent, item, Status::Warn, reason);
        }
        Err(error) => {
            let reason = match error {
                TlsError::Refused { reason, .. } => reason,
                other => other.to_string(),
            };
            return Finding::new(Area::Agent, item, Status::Fail, reason);
        }
    };
    if let Some(key) = key {
        if let Err(reason) = key_matches(key, &facts.public_key) {
            return Finding::new(Area::Agent, item, Status::Fail, reason);
        }
    }
    let paired = if key.is_some() {
        ", its --tls-key matches"
    } else {
        ""
    };
    let days_left = facts.days_left;
    let detail = format!("{}, valid {days_left} more days{paired}", facts.subject);
    if flag == "--tls-cert" && facts.not_for_clients {
        return Finding::new(
            Area::Agent,
            item,
            Status::Warn,
            format!(
                "{detail}; its purposes leave out client authentication, so hosts that \
                 require client certificates refuse it when this agent calls them"
            ),
        )
        .hint("give it both the server and the client purpose, or neither");
    }
    if days_left < 14 {
        Finding::new(Area::Agent, item, Status::Warn, detail).hint("renew it soon")
    } else {
        Finding::new(Area::Agent, item, Status::Ok, detail)
    }
}

/// Whether the PEM private key at `path` is the key of `public_key` (the
/// certificate's SubjectPublicKeyInfo, DER).
fn key_matches(path: &Path, public_key: &[u8]) -> Result<(), String> {
    let shown = path.display();
    let bytes = crate::model::small_file::read(path, 4 << 20)
        .map_err(|e| format!("cannot read --tls-key {shown}: {e}"))?;
    let pem = x509_parser::pem::Pem::iter_from_buffer(&bytes)
        .filter_map(Result::ok)
        .find(|pem| pem.label.ends_with("PRIVATE KEY"))
        .ok_or_else(|| format!("--tls-key {shown} holds no PEM PRIVATE KEY block"))?;
    let der = match pem.label.as_str() {
        "RSA PRIVATE KEY" => rustls::pki_types::PrivateKeyDer::Pkcs1(pem.contents.into()),
        "EC PRIVATE KEY" => rustls::pki_types::PrivateKeyDer::Sec1(pem.contents.into()),
        _ => rustls::pki_types::PrivateKeyDer::Pkcs8(pem.contents.into()),
    };
    let signing = rustls::crypto::ring::sign::any_supported_type(&der)
        .map_err(|e| format!("--tls-key {shown} is not a key rustls can use: {e}"))?;
    match signing.public_key() {
        Some(key) if key.as_ref() == public_key => Ok(()),
        Some(_) => Err(format!(
            "--tls-key {shown} is not the key of this certificate"
        )),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    #[test]
    fn runtime_directories_are_judged_by_mode() {
        let dir = tempfile::tempdir().unwrap();
        let runtime = dir.path().join("run");
        assert_eq!(runtime_dir(&runtime, true).status, Status::Ok);
        std::fs::create_dir(&runtime).unwrap();
        // What serve warns of and runs on is a warning; only what it
        // cannot use fails.
        for (mode, status) in [
            (0o1777, Status::Ok),
            (0o777, Status::Warn),
            (0o755, Status::Warn),
        ] {
            std::fs::set_permissions(&runtime, std::fs::Permissions::from_mode(mode)).unwrap();
            assert_eq!(runtime_dir(&runtime, true).status, status, "{mode:o}");
        }
        let link = dir.path().join("link");
        std::os::unix::fs::symlink(&runtime, &link).unwrap();
        assert_eq!(runtime_dir(&link, true).status, Status::Warn);
        assert_eq!(runtime_dir(&link, false).area, Area::Agent);
        let file = dir.path().join("file");
        std::fs::write(&file, b"").unwrap();
        assert_eq!(runtime_dir(&file, true).status, Status::Fail);
        assert_eq!(runtime_dir(&file, false).status, Status::Warn);
        let made_up = runtime_dir(Path::new("/sys/devtrace"), true);
        assert_eq!(made_up.status, Status::Fail);
        assert!(made_up.detail.contains("sysfs"), "{}", made_up.detail);
    }

    #[test]
    fn an_address_in_use_is_named() {
        let held = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let address = held.local_addr().unwrap().to_string();
        let finding = tcp_address("listen", &address);
        assert_eq!(finding.status, Status::Fail);
        // This process holds it, under its own name.
        assert!(
            finding
                .detail
                .contains(&format!("(pid {}) listens there", std::process::id())),
            "{finding:?}"
        );
        drop(held);
        assert_eq!(tcp_address("listen", &address).status, Status::Ok);
    }

    #[test]
    fn certificates_are_checked_against_their_key_and_dates() {
        let dir = tempfile::tempdir().unwrap();
        let key = rcgen::KeyPair::generate().unwrap();
        let certificate = rcgen::CertificateParams::new(vec!["agent".into()])
            .unwrap()
            .self_signed(&key)
            .unwrap();
        let cert_path = dir.path().join("agent.pem");
        let key_path = dir.path().join("agent.key");
        std::fs::write(&cert_path, certificate.pem()).unwrap();
        std::fs::write(&key_path, key.serialize_pem()).unwrap();
        let finding = tls_certificate("--tls-cert", &cert_path, Some(&key_path));
        assert_eq!(finding.status, Status::Ok, "{finding:?}");
        assert!(finding.detail.contains("its --tls-key matches"));

        let other = rcgen::KeyPair::generate().unwrap();
        std::fs::write(&key_path, other.serialize_pem()).unwrap();
        let finding = tls_certificate("--tls-cert", &cert_path, Some(&key_path));
        assert_eq!(finding.status, Status::Fail);
        assert!(finding.detail.contains("not the key of this certificate"));

        let mut params = rcgen::CertificateParams::new(vec!["agent".into()]).unwrap();
        params.not_before = rcgen::date_time_ymd(2020, 1, 1);
        params.not_after = rcgen::date_time_ymd(2021, 1, 1);
        std::fs::write(&cert_path, params.self_signed(&key).unwrap().pem()).unwrap();
        let finding = tls_certificate("--tls-cert", &cert_path, None);
        assert_eq!(finding.status, Status::Fail);
        assert!(finding.detail.contains("expired"), "{finding:?}");

        std::fs::write(&cert_path, "not a certificate").unwrap();
        assert_eq!(
            tls_certificate("--tls-cert", &cert_path, None).status,
            Status::Fail
        );
    }

    /// What every client would refuse, serve refuses as it starts, and
    /// doctor fails; what only mTLS hosts it calls would refuse is a
    /// warning.
    #[test]
    fn a_certificate_is_judged_by_its_purposes_and_dates_as_serve_judges_it() {
        use rcgen::ExtendedKeyUsagePurpose::{ClientAuth, ServerAuth};
        let dir = tempfile::tempdir().unwrap();
        let key = rcgen::KeyPair::generate().unwrap();
        let key_path = dir.path().join("agent.key");
        std::fs::write(&key_path, key.serialize_pem()).unwrap();
        let made = |name: &str, purposes: Vec<rcgen::ExtendedKeyUsagePurpose>, expired: bool| {
            let mut params = rcgen::CertificateParams::new(vec!["agent".into()]).unwrap();
            params.extended_key_usages = purposes;
            if expired {
                params.not_before = rcgen::date_time_ymd(2020, 1, 1);
                params.not_after = rcgen::date_time_ymd(2021, 1, 1);
            }
            let path = dir.path().join(name);
            std::fs::write(&path, params.self_signed(&key).unwrap().pem()).unwrap();
            path
        };
        let both = made("both.pem", vec![ServerAuth, ClientAuth], false);
        // A client CA's dates are not judged by serve (nor by TLS): a
        // warning.
        let expired_ca = made("expired-ca.pem", vec![], true);
        let finding = tls_certificate("--tls-client-ca", &expired_ca, None);
        assert_eq!(finding.status, Status::Warn, "{finding:?}");
        assert!(tls::server_config(&both, &key_path, Some(&expired_ca)).is_ok());
        for (cert, status) in [
            (both.clone(), Status::Ok),
            (made("server.pem", vec![ServerAuth], false), Status::Warn),
            (made("client.pem", vec![ClientAuth], false), Status::Fail),
            (made("expired.pem", vec![], true), Status::Fail),
        ] {
            let finding = tls_certificate("--tls-cert", &cert, Some(&key_path));
            assert_eq!(finding.status, status, "{finding:?}");
            let served = tls::server_config(&cert, &key_path, None);
            assert_eq!(served.is_err(), status == Status::Fail, "{cert:?}");
        }
    }

    #[test]
    fn allow_roots_must_be_writable_or_makeable() {
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(allow_root(dir.path()).status, Status::Ok);
        assert!(allow_root(&dir.path().join("a/b"))
            .detail
            .contains("makes it"));
        let file = dir.path().join("file");
        std::fs::write(&file, b"").unwrap();
        assert_eq!(allow_root(&file.join("under")).status, Status::Fail);
        assert_eq!(
            allow_root(Path::new("s3://bucket/traces")).status,
            Status::Ok
        );
        // A scheme the agent refuses is no object storage.
        let http = allow_root(Path::new("http://host/traces"));
        assert_eq!(http.status, Status::Fail, "{http:?}");
        assert!(http.detail.contains("http"), "{http:?}");
        // Writable by access(2) for root, yet mkdir fails there, and no
        // file can be made in an existing directory of it either.
        for root in ["/proc/devtrace-traces", "/sys/kernel"] {
            let made_up = allow_root(Path::new(root));
            assert_eq!(made_up.status, Status::Fail, "{root}");
            assert!(made_up.detail.contains("fs"), "{}", made_up.detail);
        }
    }
}
