//! Sessions over fleets, against real agents on distinct loopback addresses
//! (Linux routes all of 127/8 to lo): hosts found through a real DNS server
//! (dnsmasq answering one name with many A records and an AAAA), written as
//! Slurm hostlists and in a file, called at most `--concurrent-hosts` at
//! once, and each trace written as it arrives instead of held.

use crate::common;

use std::io::{BufRead, BufReader, Read};
use std::net::{TcpListener, UdpSocket};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use common::bulky::bulky_host;
use common::*;
use devtrace::proto::tensorflow::profiler::XSpace;
use prost::Message;
use tonic::Code;

/// A port free on every one of `hosts`, so that one `host:PORT` pattern
/// names an agent on each.
fn port_free_on(hosts: &[&str]) -> u16 {
    listeners_on_one_port(hosts).0
}

/// Agents listening on `host:port` for each of `hosts`, started at once.
fn agents_on(hosts: &[String], port: u16, extra: &[&str]) -> Vec<AgentProcess> {
    let children: Vec<Child> = hosts
        .iter()
        .map(|host| {
            let listen = if host.contains(':') {
                format!("[{host}]:{port}")
            } else {
                format!("{host}:{port}")
            };
            AgentProcess::spawn_listening(&listen, extra)
        })
        .collect();
    children.into_iter().map(AgentProcess::adopt).collect()
}

/// `127.<second>.0.1` ... `127.<second>.0.<count>`.
fn loopback_addresses(second: u8, count: u8) -> Vec<String> {
    (1..=count).map(|i| format!("127.{second}.0.{i}")).collect()
}

/// The `.xplane.pb` files of a session directory, sorted.
fn trace_files(session: &Path) -> Vec<String> {
    let mut files: Vec<String> = std::fs::read_dir(session)
        .unwrap_or_else(|e| panic!("{}: {e}", session.display()))
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    files.sort();
    files
}

fn file_of(address: &str) -> String {
    format!("{}.xplane.pb", address.replace(':', "_"))
}

/// The window each trace of `session` starts at.
fn window_starts(session: &Path) -> Vec<u64> {
    trace_files(session)
        .iter()
        .map(|f| {
            let bytes = std::fs::read(session.join(f)).unwrap();
            window_of(&XSpace::decode(bytes.as_slice()).unwrap()).0
        })
        .collect()
}

// ---------------------------------------------------------------------------
// DNS

/// dnsmasq on a free loopback port, answering `name` with `addresses` from
/// a hosts file and NXDOMAIN for other names under `.test`; stopped when
/// dropped.
struct Dnsmasq {
    child: Child,
    server: String,
    _dir: tempfile::TempDir,
}

impl Dnsmasq {
    /// `None` when dnsmasq is not installed (CI installs dnsmasq-base).
    fn start(name: &str, addresses: &[String]) -> Option<Dnsmasq> {
        let binary = ["/usr/sbin/dnsmasq", "/sbin/dnsmasq", "/usr/bin/dnsmasq"]
            .into_iter()
            .map(PathBuf::from)
            .find(|p| p.exists())?;
        let dir = tempfile::tempdir().unwrap();
        let hosts = dir.path().join("hosts");
        let lines: String = addresses.iter().map(|a| format!("{a} {name}\n")).collect();
        std::fs::write(&hosts, lines).unwrap();
        for _ in 0..10 {
            let port = {
                let udp = UdpSocket::bind("127.0.0.1:0").unwrap();
                let port = udp.local_addr().unwrap().port();
                if TcpListener::bind(("127.0.0.1", port)).is_err() {
                    continue;
                }
                port
            };
            let mut child = Command::new(&binary)
                .args([
                    "--keep-in-foreground",
                    "--no-resolv",
                    "--no-hosts",
                    "--bind-interfaces",
                    "--listen-address=127.0.0.1",
                    "--pid-file=",
                    "--log-facility=-",
                    "--local=/test/",
                    // As root it would switch to nobody, who may not read the file.
                    "--user=root",
                ])
                .arg(format!("--port={port}"))
                .arg(format!("--addn-hosts={}", hosts.display()))
                .stdout(Stdio::null())
                .stderr(Stdio::piped())
                .spawn()
                .expect("starting dnsmasq");
            // It says it read the hosts file once it is serving; a taken
            // port ends it first.
            let stderr = BufReader::new(child.stderr.take().unwrap());
            let mut said = Vec::new();
            let mut ready = false;
            for line in stderr.lines().map_while(Result::ok) {
                ready = line.contains(&format!("read {}", hosts.display()));
                said.push(line);
                if ready {
                    break;
                }
            }
            if ready {
                return Some(Dnsmasq {
                    child,
                    server: format!("127.0.0.1:{port}"),
                    _dir: dir,
                });
            }
            let _ = child.kill();
            let _ = child.wait();
            eprintln!("dnsmasq on port {port} did not start: {said:?}");
        }
        panic!("dnsmasq did not start on any port");
    }
}

impl Drop for Dnsmasq {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[tokio::test]
async fn a_dns_name_stands_for_every_address_it_resolves_to() {
    const NAME: &str = "workers.devtrace.test";
    // 16 A records and an AAAA; agents run on four of the IPv4 addresses
    // and on ::1, and nothing listens on the other twelve.
    let v4 = loopback_addresses(77, 16);
    let mut records = v4.clone();
    records.push("::1".into());
    let Some(dns) = Dnsmasq::start(NAME, &records) else {
        eprintln!("SKIPPED: dnsmasq is not installed (apt-get install dnsmasq-base)");
        return;
    };
    let mut listening: Vec<String> = v4[..4].to_vec();
    listening.push("::1".into());
    let probe: Vec<&str> = v4.iter().map(String::as_str).chain(["::1"]).collect();
    let port = port_free_on(&probe);
    let _agents = agents_on(&listening, port, &["--mock-rate", "2000"]);
    let dir = tempfile::tempdir().unwrap();
    let coordinator = AgentProcess::start(&[
        "--allow-root",
        dir.path().to_str().unwrap(),
        "--dns-server",
        &dns.server,
        "--mock-rate",
        "0",
    ]);

    let hosts = format!("dns:{NAME}:{port},dns:missing.devtrace.test:{port}");
    let reply = coordinator
        .new_session_within(
            session_request(dir.path(), &[&hosts], "dns"),
            Duration::from_secs(20),
        )
        .await;
    assert!(!reply.empty_trace);
    let mut expected: Vec<String> = v4[..4]
        .iter()
        .map(|a| file_of(&format!("{a}:{port}")))
        .collect();
    expected.push(file_of(&format!("[::1]:{port}")));
    expected.sort();
    assert_eq!(trace_files(&dir.path().join("dns")), expected);
    let starts = window_starts(&dir.path().join("dns"));
    assert!(starts.iter().all(|s| *s == starts[0]), "{starts:?}");
    let errors = reply.error_message;
    assert!(
        errors.starts_with("13 of 18 hosts gave no trace (1 not resolved, 12 cannot connect)"),
        "{errors}"
    );
    for address in &v4[4..] {
        assert!(
            errors.contains(&format!("{address}:{port}: cannot connect")),
            "{errors}"
        );
    }
    assert!(
        errors.contains(&format!(
            "dns:missing.devtrace.test:{port}: looking up missing.devtrace.test"
        )),
        "{errors}"
    );

    // The command line takes the same entry and the same flag.
    let logdir = tempfile::tempdir().unwrap();
    let hosts = format!("dns:{NAME}:{port}");
    let session_new = || {
        devtrace(args(&[
            "session",
            "new",
            "--hosts",
            &hosts,
            "--dns-server",
            &dns.server,
            "--duration",
            "300ms",
            "--session-id",
            "cli",
            "--logdir",
            logdir.path().to_str().unwrap(),
        ]))
    };
    let out = session_new().await;
    assert_eq!(out.status.code(), Some(3), "{}", text(&out.stderr));
    assert_eq!(
        trace_files(&logdir.path().join("plugins/profile/cli")),
        expected
    );
    assert!(
        text(&out.stderr).contains("12 of 17 hosts gave no trace (12 cannot connect)")
            && text(&out.stderr).ends_with("devtrace: session cli: 5 of 17 hosts\n"),
        "{}",
        text(&out.stderr)
    );
    // The same session named again: its traces are not written over.
    let session = logdir.path().join("plugins/profile/cli");
    let before: Vec<Vec<u8>> = expected
        .iter()
        .map(|name| std::fs::read(session.join(name)).unwrap())
        .collect();
    let again = session_new().await;
    assert_eq!(again.status.code(), Some(1), "{}", text(&again.stderr));
    assert!(
        text(&again.stderr).contains("holds traces of these hosts already"),
        "{}",
        text(&again.stderr)
    );
    let after: Vec<Vec<u8>> = expected
        .iter()
        .map(|name| std::fs::read(session.join(name)).unwrap())
        .collect();
    assert!(before == after, "a trace was written over");
}

/// One address named with and without a scheme is one host: captured once,
/// the session whole. (Called twice, the second trace collided with the
/// first's file and the session was reported partial.)
#[test]
fn a_host_named_with_and_without_a_scheme_is_captured_once() {
    let agent = AgentProcess::start(&[]);
    let logdir = tempfile::tempdir().unwrap();
    let out = Command::new(BIN)
        .args(["session", "new", "--hosts", &agent.address, "--hosts"])
        .arg(format!("grpc://{}", agent.address))
        .args(["--duration", "200ms", "--session-id", "twice", "--logdir"])
        .arg(logdir.path())
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(stderr.contains("capturing 1 host for 200 ms"), "{stderr}");
    assert_eq!(
        trace_files(&logdir.path().join("plugins/profile/twice")),
        vec![format!("{}.xplane.pb", agent.address.replace(':', "_"))]
    );
}

// ---------------------------------------------------------------------------
// Many hosts

/// 32 agents in CI; `scripts/bench` runs 8, 32 and 128 and reports time and
/// memory.
const AGENTS: u8 = 32;

#[tokio::test]
async fn a_session_over_many_agents_lands_every_trace_in_one_window() {
    let addresses = loopback_addresses(78, AGENTS + 2);
    let probe: Vec<&str> = addresses.iter().map(String::as_str).collect();
    let port = port_free_on(&probe);
    // The last two addresses have no agent.
    let _agents = agents_on(
        &addresses[..AGENTS as usize],
        port,
        &["--mock-rate", "1000"],
    );
    let dir = tempfile::tempdir().unwrap();
    // Half as a Slurm hostlist, half from a file of hostlists.
    let half = AGENTS / 2;
    let list = dir.path().join("fleet.txt");
    std::fs::write(
        &list,
        format!(
            "# the second half of the fleet\n127.78.0.[{}-{}]:{port}\n\n127.78.0.[{}-{}]:{port}  # idle\n",
            half + 1,
            AGENTS,
            AGENTS + 1,
            AGENTS + 2
        ),
    )
    .unwrap();
    // Eight at a time: later hosts are asked for the same window, which
    // the agents serve from their flight recorder.
    let out = devtrace(args(&[
        "session",
        "new",
        "--hosts",
        &format!("127.78.0.[1-{half}]:{port}"),
        "--hosts",
        &format!("@{}", list.display()),
        "--concurrent-hosts",
        "8",
        "--duration",
        "300ms",
        "--session-id",
        "fleet",
        "--logdir",
        dir.path().to_str().unwrap(),
    ]))
    .await;
    let stderr = text(&out.stderr);
    // The two idle addresses make it a partial session.
    assert_eq!(out.status.code(), Some(3), "{stderr}");
    let session = dir.path().join("plugins/profile/fleet");
    let mut expected: Vec<String> = addresses[..AGENTS as usize]
        .iter()
        .map(|a| file_of(&format!("{a}:{port}")))
        .collect();
    expected.sort();
    assert_eq!(trace_files(&session), expected);
    assert_eq!(text(&out.stdout).lines().count(), AGENTS as usize);
    let starts = window_starts(&session);
    assert!(starts.iter().all(|s| *s == starts[0]), "{starts:?}");
    assert!(
        stderr.contains(&format!(
            "2 of {} hosts gave no trace (2 cannot connect)",
            AGENTS + 2
        )),
        "{stderr}"
    );
    for address in &addresses[AGENTS as usize..] {
        assert!(
            stderr.contains(&format!("{address}:{port}: cannot connect")),
            "{stderr}"
        );
    }
    assert!(
        stderr.contains(&format!("session fleet: {AGENTS} of {} hosts", AGENTS + 2)),
        "{stderr}"
    );
}

/// Listeners on one port on each of `hosts`, bound and kept: a port found
/// free and bound later could be taken in between by another test.
fn listeners_on_one_port(hosts: &[impl AsRef<str>]) -> (u16, Vec<TcpListener>) {
    let hosts: Vec<&str> = hosts.iter().map(AsRef::as_ref).collect();
    'candidates: for _ in 0..50 {
        let first = TcpListener::bind(format!("{}:0", hosts[0])).expect("binding a listener");
        let port = first.local_addr().expect("its address").port();
        let mut held = vec![first];
        for host in &hosts[1..] {
            match TcpListener::bind(format!("{host}:{port}")) {
                Ok(listener) => held.push(listener),
                Err(_) => continue 'candidates,
            }
        }
        return (port, held);
    }
    panic!("no port free on all of {hosts:?}");
}

/// Accepts connections on each of `addresses` (on one port, returned) and
/// never answers, counting how many are open at once; returns the most
/// seen so far.
fn silent_hosts(addresses: &[String]) -> (u16, Arc<AtomicUsize>) {
    let open = Arc::new(AtomicUsize::new(0));
    let most = Arc::new(AtomicUsize::new(0));
    let (port, listeners) = listeners_on_one_port(addresses);
    for listener in listeners {
        let (open, most) = (Arc::clone(&open), Arc::clone(&most));
        std::thread::spawn(move || {
            for stream in listener.incoming() {
                let Ok(mut stream) = stream else { return };
                let now = open.fetch_add(1, Ordering::SeqCst) + 1;
                most.fetch_max(now, Ordering::SeqCst);
                let open = Arc::clone(&open);
                // Held until the caller hangs up.
                std::thread::spawn(move || {
                    let mut sink = [0u8; 4096];
                    while matches!(stream.read(&mut sink), Ok(n) if n > 0) {}
                    open.fetch_sub(1, Ordering::SeqCst);
                });
            }
        });
    }
    (port, most)
}

#[tokio::test]
async fn no_more_hosts_than_allowed_are_called_at_once() {
    let addresses = loopback_addresses(79, 6);
    let (port, most) = silent_hosts(&addresses);
    let dir = tempfile::tempdir().unwrap();
    let coordinator = AgentProcess::start(&[
        "--allow-root",
        dir.path().to_str().unwrap(),
        "--concurrent-hosts",
        "2",
    ]);
    let hosts = format!("127.79.0.[1-6]:{port}");
    let reply = coordinator
        .new_session_within(
            session_request(dir.path(), &[&hosts], "bounded"),
            Duration::from_secs(3),
        )
        .await;
    assert!(reply.empty_trace);
    assert_eq!(most.load(Ordering::SeqCst), 2, "{}", reply.error_message);
    let errors = reply.error_message;
    assert!(
        errors.starts_with("6 of 6 hosts gave no trace (")
            && errors.contains("2 no reply in time")
            && errors.contains("4 not called in time"),
        "{errors}"
    );
    assert_eq!(errors.matches(": no reply within").count(), 2, "{errors}");
    assert_eq!(
        errors
            .matches(": not called: the session's deadline passed while 2 other hosts")
            .count(),
        4,
        "{errors}"
    );
}

#[tokio::test]
async fn replies_are_written_as_they_arrive_instead_of_held() {
    // Eight hosts answer at once with 24 MiB each (carried twice in the
    // reply: 48 MiB on the wire). Held until written, as tonic would hold
    // each message, that is hundreds of MiB at the coordinator's peak.
    const HOSTS: usize = 8;
    const TRACE: usize = 24 << 20;
    let mut hosts = Vec::new();
    for _ in 0..HOSTS {
        hosts.push(bulky_host(TRACE).await);
    }
    let dir = tempfile::tempdir().unwrap();
    let coordinator = AgentProcess::start(&[
        "--allow-root",
        dir.path().to_str().unwrap(),
        "--mock-rate",
        "0",
    ]);
    let before = coordinator.peak_rss_bytes();
    let names: Vec<&str> = hosts.iter().map(String::as_str).collect();
    let reply = coordinator
        .analysis()
        .await
        .new_session(session_request(dir.path(), &names, "bulky"))
        .await
        .unwrap()
        .into_inner();
    assert!(reply.error_message.is_empty(), "{}", reply.error_message);
    let session = dir.path().join("bulky");
    assert_eq!(trace_files(&session).len(), HOSTS);
    for host in &hosts {
        let trace = std::fs::read(session.join(file_of(host))).unwrap();
        let space = XSpace::decode(trace.as_slice()).unwrap();
        assert_eq!(space.hostnames[0].len(), TRACE);
    }
    let grown = coordinator.peak_rss_bytes().saturating_sub(before);
    assert!(
        grown < 64 << 20,
        "the coordinator's peak grew by {} MiB for {} MiB of traces",
        grown >> 20,
        (HOSTS * TRACE) >> 20
    );
}

#[tokio::test]
async fn a_peer_cannot_make_the_agent_read_files() {
    let dir = tempfile::tempdir().unwrap();
    let secret = dir.path().join("hosts.txt");
    std::fs::write(&secret, "secret-host\n").unwrap();
    let agent = AgentProcess::start(&["--allow-root", dir.path().to_str().unwrap()]);
    let entry = format!("@{}", secret.display());
    let status = agent
        .analysis()
        .await
        .new_session(session_request(
            dir.path(),
            &[&agent.address, &entry],
            "files",
        ))
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::InvalidArgument, "{status:?}");
    assert!(
        status.message().starts_with(&format!(
            "hosts[1]: {entry}: files are read only from the command line"
        )),
        "{}",
        status.message()
    );
    assert!(!status.message().contains("secret-host"));
    assert!(!dir.path().join("files").exists());
}

/// `session new` cancelled during its window ends by the signal, saying
/// so, and leaves no empty session behind (it was killed, leaving the
/// directories it made and any file being written).
#[test]
fn a_cancelled_session_says_so_and_leaves_nothing_half_made() {
    let agent = AgentProcess::start(&[]);
    let logdir = tempfile::tempdir().unwrap();
    let mut child = Command::new(BIN)
        .args(["session", "new", "--hosts", &agent.address])
        .args(["--duration", "5s", "--session-id", "cancelled", "--logdir"])
        .arg(logdir.path())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut stderr = BufReader::new(child.stderr.take().unwrap());
    let mut line = String::new();
    while !line.contains("capturing 1 host") {
        line.clear();
        assert!(stderr.read_line(&mut line).unwrap() > 0, "ended early");
    }
    // Well inside the 5 s window, with the handlers long in place.
    std::thread::sleep(std::time::Duration::from_secs(1));
    // SAFETY: signalling a child of this test.
    unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGINT) };
    let status = child.wait().unwrap();
    let mut rest = String::new();
    std::io::Read::read_to_string(&mut stderr, &mut rest).unwrap();
    use std::os::unix::process::ExitStatusExt;
    assert_eq!(status.signal(), Some(libc::SIGINT), "{rest}");
    assert!(
        rest.contains(
            "the session was cancelled (Ctrl-C): 0 unfinished trace file(s) removed; no trace \
             was written whole, and the session's empty directory was removed"
        ),
        "{rest}"
    );
    assert!(
        !logdir.path().join("plugins").exists(),
        "the directories made for it are gone"
    );
}

/// A host's error, which its server wrote, reaches the agent's log (and a
/// journal or collector reading it) as one escaped line: a newline and a
/// fake record in it forged a line of the log, and escape sequences
/// reached whatever displayed it.
#[tokio::test(flavor = "multi_thread")]
async fn a_hosts_error_cannot_forge_a_line_of_the_log() {
    let forged = "2026-11-27T00:00:00.000000Z  INFO devtrace::agent: forged";
    let evil = common::bulky::failing_host(&format!("evil\u{1b}[31mRED\n{forged}")).await;
    let dir = tempfile::tempdir().unwrap();
    let (mut agent, logged) = spawn_logging(
        Command::new(BIN)
            .args(["serve", "--listen", "127.0.0.1:0", "--backend", "mock"])
            .args(["--metrics-listen", "off", "--log-level", "info"])
            .args(["--allow-root", dir.path().to_str().unwrap()]),
    );
    let reply = agent
        .new_session_within(
            session_request(dir.path(), &[&evil], "evil"),
            Duration::from_secs(20),
        )
        .await;
    assert!(reply.error_message.contains("evil"), "{reply:?}");
    agent.stop_with_sigterm(Duration::from_secs(30));
    let log = logged.join().unwrap();
    assert!(
        log.contains("evil\\u{1b}[31mRED\\n2026-11-27T00:00:00.000000Z  INFO"),
        "{log}"
    );
    assert!(!log.lines().any(|line| line.starts_with(forged)), "{log}");
    assert!(!log.contains('\u{1b}'), "{log}");
}
