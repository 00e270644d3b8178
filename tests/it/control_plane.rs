//! The control plane under attack and over TLS, against real agents on
//! loopback: requests too large to decode, a hostile profiler server that
//! answers a session, an upstream or `devtrace capture` with more than the
//! caller accepts, session targets outside `--session-hosts`, TLS and mutual
//! TLS for the agent and every client (the health service included),
//! plaintext on an address other hosts can reach, and the UNIX socket
//! listener.

use crate::common;

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

use common::bulky::bulky_host;
use common::*;
use devtrace::proto::tensorflow::profile_analysis_client::ProfileAnalysisClient;
use devtrace::proto::tensorflow::profiler::XSpace;
use devtrace::proto::tensorflow::NewProfileSessionRequest;
use prost::Message;
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Endpoint, Identity};
use tonic::Code;

fn path(p: &Path) -> &str {
    p.to_str().expect("a UTF-8 path")
}

/// `devtrace capture TARGET --duration 300ms --logdir LOGDIR --quiet EXTRA`,
/// each in a session of its own.
async fn capture(target: &str, logdir: &Path, extra: &[&str]) -> Output {
    let mut list = args(&[
        "capture",
        target,
        "--duration",
        "300ms",
        "--logdir",
        path(logdir),
        "--quiet",
    ]);
    list.extend(args(extra));
    devtrace(list).await
}

/// Asserts that a devtrace command failed and said `words`.
fn fails_saying(out: &Output, words: &str) {
    let said = text(&out.stderr);
    assert!(!out.status.success(), "{said}");
    assert!(said.contains(words), "{said}");
}

/// The trace file `devtrace capture` printed, decoded.
fn captured_trace(out: &Output) -> XSpace {
    assert!(out.status.success(), "{}", text(&out.stderr));
    let file = text(&out.stdout).trim().to_string();
    XSpace::decode(std::fs::read(&file).expect("the trace file").as_slice()).expect("an XSpace")
}

async fn analysis(channel: Channel) -> ProfileAnalysisClient<Channel> {
    ProfileAnalysisClient::new(channel).max_decoding_message_size(usize::MAX)
}

async fn plain_channel(address: &str) -> Channel {
    Channel::from_shared(format!("http://{address}"))
        .expect("uri")
        .connect()
        .await
        .expect("connecting to the agent")
}

fn session_request(root: &Path, hosts: &[&str], session: &str) -> NewProfileSessionRequest {
    NewProfileSessionRequest {
        request: Some(request(300, "ignored")),
        repository_root: root.display().to_string(),
        hosts: hosts.iter().map(|h| h.to_string()).collect(),
        session_id: session.to_string(),
    }
}

// ---------------------------------------------------------------------------
// Sizes

#[tokio::test]
async fn requests_over_the_limit_are_refused_and_the_agent_keeps_serving() {
    let mut agent = AgentProcess::start(&["--mock-rate", "1000"]);
    // 5 MiB of request: over the 4 MiB the agent decodes.
    let mut huge = request(100, "huge");
    huge.tools = vec!["x".repeat(5 << 20)];
    let status = agent.client().await.profile(huge).await.unwrap_err();
    assert_eq!(status.code(), Code::OutOfRange, "{status:?}");
    assert!(status.message().contains("4194304"), "{}", status.message());

    let mut session = session_request(Path::new("/tmp"), &["h"], "s");
    session.hosts = vec!["h".repeat(5 << 20)];
    let status = analysis(plain_channel(&agent.address).await)
        .await
        .new_session(session)
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::OutOfRange, "{status:?}");

    // A prefix declaring 20 MiB, or 2 GiB, with nothing after it: refused
    // for its size from the prefix alone, not told to be sent again (as if
    // the agent's pools were full now).
    for claimed in [20 << 20, 2 << 30] {
        let call = common::raw_call::half_sent_call(&agent.address, claimed, 0).await;
        let (_, status) = common::raw_call::read_reply(call.response).await;
        assert_eq!(status.code(), Code::OutOfRange, "{status:?}");
        assert!(
            status
                .message()
                .contains(&format!("is {claimed} bytes, more than the 4194304")),
            "{status:?}"
        );
    }

    assert!(agent.is_running());
    let monitor = agent.monitor(50).await;
    assert!(!monitor.data.is_empty());
}

const CAP: &str = "4MiB";
const OVER_CAP: usize = 6 << 20;

#[tokio::test]
async fn a_hostile_session_host_is_refused_and_the_other_hosts_land() {
    let hostile = bulky_host(OVER_CAP).await;
    let dir = tempfile::tempdir().unwrap();
    let mut agent = AgentProcess::start(&[
        "--allow-root",
        path(dir.path()),
        "--max-reply-size",
        CAP,
        "--mock-rate",
        "2000",
    ]);
    let reply = analysis(plain_channel(&agent.address).await)
        .await
        .new_session(session_request(
            dir.path(),
            &[hostile.as_str(), agent.address.as_str()],
            "fleet",
        ))
        .await
        .unwrap()
        .into_inner();
    let errors = reply.error_message;
    assert!(
        errors.contains(&format!("{hostile}: reply refused: ")),
        "{errors}"
    );
    assert!(errors.contains("--max-reply-size"), "{errors}");
    assert!(!reply.empty_trace);
    assert_only_agents_trace(&dir.path().join("fleet"), &agent);
    assert!(agent.is_running());
    assert!(!agent.monitor(50).await.data.is_empty());
}

#[tokio::test]
async fn a_hostile_upstream_makes_the_capture_partial() {
    let hostile = bulky_host(OVER_CAP).await;
    let mut agent = AgentProcess::start(&["--upstream", &hostile, "--max-reply-size", CAP]);
    let reply = agent
        .client()
        .await
        .profile(request(300, "partial"))
        .await
        .unwrap()
        .into_inner();
    let space = space_of(&reply);
    assert_error_starting(&space, &format!("upstream {hostile}: reply refused: "));
    assert!(event_count(&space) > 0, "our own events are all there");
    assert!(agent.is_running());
}

/// An upstream's trace small on the wire but far larger decoded (empty
/// planes, two bytes each) is left out by what it decodes to, not merged
/// on the strength of its size: the capture is partial, our own events all
/// there.
#[tokio::test]
async fn an_upstream_trace_that_decodes_past_its_share_is_left_out() {
    use devtrace::proto::tensorflow::{ProfileResponse, ProfileToolData};
    let hostile = common::bulky::replying_host(ProfileResponse {
        tool_data: vec![ProfileToolData {
            name: "xplane.pb".into(),
            data: [0x0a, 0x00].repeat(1 << 20).into(),
        }],
        ..ProfileResponse::default()
    })
    .await;
    let mut agent = AgentProcess::start(&["--upstream", &hostile, "--capture-memory", "64MiB"]);
    let reply = agent
        .client()
        .await
        .profile(request(300, "decoded"))
        .await
        .unwrap()
        .into_inner();
    let space = space_of(&reply);
    assert_error_starting(
        &space,
        &format!("upstream {hostile}: its trace of 2097152 bytes"),
    );
    assert!(
        space
            .errors
            .iter()
            .any(|e| e.contains("more than one upstream's share")),
        "{:?}",
        space.errors
    );
    assert!(event_count(&space) > 0, "our own events are all there");
    assert!(agent.is_running());
}

/// An upstream's reply is held to a quarter of `--capture-memory` even
/// under a larger `--max-reply-size` (its bytes are held before the build
/// knows their size): a larger one makes the capture partial, naming the
/// budget, and our own events are all there.
#[tokio::test]
async fn an_upstream_reply_past_its_share_of_capture_memory_makes_the_capture_partial() {
    let hostile = bulky_host(OVER_CAP).await;
    let mut agent = AgentProcess::start(&["--upstream", &hostile, "--capture-memory", "16MiB"]);
    let reply = agent
        .client()
        .await
        .profile(request(300, "share"))
        .await
        .unwrap()
        .into_inner();
    let space = space_of(&reply);
    assert_error_starting(&space, &format!("upstream {hostile}: reply refused: "));
    assert!(
        space
            .errors
            .iter()
            .any(|e| e.contains("an upstream's share of --capture-memory")),
        "{:?}",
        space.errors
    );
    assert!(event_count(&space) > 0, "our own events are all there");
    assert!(agent.is_running());
}

#[tokio::test]
async fn clients_refuse_a_hostile_reply_and_name_the_host() {
    let hostile = bulky_host(OVER_CAP).await;
    let agent = AgentProcess::start(&["--mock-rate", "2000"]);
    let logdir = tempfile::tempdir().unwrap();
    let out = devtrace(args(&[
        "session",
        "new",
        "--hosts",
        &format!("{hostile},{}", agent.address),
        "--duration",
        "300ms",
        "--session-id",
        "fleet",
        "--logdir",
        path(logdir.path()),
        "--max-reply-size",
        CAP,
    ]))
    .await;
    // Some hosts' traces landed, not all.
    assert_eq!(out.status.code(), Some(3), "{}", text(&out.stderr));
    assert!(
        text(&out.stderr).contains(&format!("{hostile}: reply refused: ")),
        "{}",
        text(&out.stderr)
    );
    let landed = logdir.path().join(format!(
        "plugins/profile/fleet/{}.xplane.pb",
        agent.address.replace(':', "_")
    ));
    assert_eq!(text(&out.stdout).trim(), landed.display().to_string());

    let out = capture(&hostile, logdir.path(), &["--max-reply-size", CAP]).await;
    fails_saying(&out, "reply refused: ");
}

// ---------------------------------------------------------------------------
// Session targets

#[tokio::test]
async fn sessions_reach_only_the_hosts_the_operator_allows() {
    let dir = tempfile::tempdir().unwrap();
    let agent = AgentProcess::start(&[
        "--allow-root",
        path(dir.path()),
        "--session-hosts",
        "127.0.0.1:*",
        "--session-hosts",
        "*.cluster.local",
        "--mock-rate",
        "2000",
    ]);
    let mut client = analysis(plain_channel(&agent.address).await).await;
    let status = client
        .new_session(session_request(
            dir.path(),
            &[agent.address.as_str(), "169.254.169.254:80"],
            "outside",
        ))
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::PermissionDenied, "{status:?}");
    assert!(
        status
            .message()
            .starts_with("hosts[1]: 169.254.169.254:80 "),
        "{}",
        status.message()
    );
    assert!(
        status.message().contains("--session-hosts"),
        "{}",
        status.message()
    );
    assert!(!dir.path().join("outside").exists());

    let reply = client
        .new_session(session_request(
            dir.path(),
            &[agent.address.as_str()],
            "inside",
        ))
        .await
        .unwrap()
        .into_inner();
    assert!(reply.error_message.is_empty(), "{}", reply.error_message);
    assert!(dir.path().join("inside").is_dir());
}

// ---------------------------------------------------------------------------
// TLS

/// Certificates made for one test: a CA that signs the agents' certificate
/// (for localhost and 127.0.0.1, good for serving and for calling), a
/// second CA that signs client certificates, and an unrelated CA.
struct Pki {
    _dir: tempfile::TempDir,
    ca: PathBuf,
    agent_cert: PathBuf,
    agent_key: PathBuf,
    client_ca: PathBuf,
    client_cert: PathBuf,
    client_key: PathBuf,
    other_ca: PathBuf,
}

fn new_ca(name: &str) -> (rcgen::Certificate, rcgen::Issuer<'static, rcgen::KeyPair>) {
    let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
    params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    params
        .distinguished_name
        .push(rcgen::DnType::CommonName, name);
    params.key_usages = vec![
        rcgen::KeyUsagePurpose::KeyCertSign,
        rcgen::KeyUsagePurpose::DigitalSignature,
    ];
    let key = rcgen::KeyPair::generate().unwrap();
    let cert = params.self_signed(&key).unwrap();
    (cert, rcgen::Issuer::new(params, key))
}

fn new_leaf(
    names: &[&str],
    usages: Vec<rcgen::ExtendedKeyUsagePurpose>,
    issuer: &rcgen::Issuer<'static, rcgen::KeyPair>,
) -> (String, String) {
    let names: Vec<String> = names.iter().map(|n| n.to_string()).collect();
    let mut params = rcgen::CertificateParams::new(names).unwrap();
    params.extended_key_usages = usages;
    let key = rcgen::KeyPair::generate().unwrap();
    let cert = params.signed_by(&key, issuer).unwrap();
    (cert.pem(), key.serialize_pem())
}

impl Pki {
    fn new() -> Pki {
        use rcgen::ExtendedKeyUsagePurpose::{ClientAuth, ServerAuth};
        let dir = tempfile::tempdir().unwrap();
        let write = |name: &str, pem: &str| {
            let file = dir.path().join(name);
            std::fs::write(&file, pem).unwrap();
            file
        };
        let (ca, ca_issuer) = new_ca("devtrace test CA");
        let (client_ca, client_issuer) = new_ca("devtrace test client CA");
        let (other_ca, _) = new_ca("someone else's CA");
        let (agent_cert, agent_key) = new_leaf(
            &["localhost", "127.0.0.1"],
            vec![ServerAuth, ClientAuth],
            &ca_issuer,
        );
        let (client_cert, client_key) = new_leaf(&["operator"], vec![ClientAuth], &client_issuer);
        Pki {
            ca: write("ca.pem", &ca.pem()),
            agent_cert: write("agent.pem", &agent_cert),
            agent_key: write("agent.key", &agent_key),
            client_ca: write("client-ca.pem", &client_ca.pem()),
            client_cert: write("client.pem", &client_cert),
            client_key: write("client.key", &client_key),
            other_ca: write("other-ca.pem", &other_ca.pem()),
            _dir: dir,
        }
    }

    /// Client flags: trusting the agents' CA, with the client certificate.
    fn client(&self) -> Vec<&str> {
        vec![
            "--tls-ca",
            path(&self.ca),
            "--tls-cert",
            path(&self.client_cert),
            "--tls-key",
            path(&self.client_key),
        ]
    }

    /// `serve` flags: TLS with the agent's certificate.
    fn serving(&self) -> Vec<&str> {
        vec![
            "--tls-cert",
            path(&self.agent_cert),
            "--tls-key",
            path(&self.agent_key),
        ]
    }
}

#[tokio::test]
async fn captures_over_tls_work_for_clients_that_trust_the_agent_only() {
    let pki = Pki::new();
    let agent = AgentProcess::start(&pki.serving());
    let logdir = tempfile::tempdir().unwrap();
    let tls_address = format!("grpcs://{}", agent.address);

    let out = capture(&tls_address, logdir.path(), &["--tls-ca", path(&pki.ca)]).await;
    assert!(event_count(&captured_trace(&out)) > 0);

    let plaintext = capture(&agent.address, logdir.path(), &[]).await;
    fails_saying(&plaintext, "--tls-ca");
    let no_ca = capture(&tls_address, logdir.path(), &[]).await;
    fails_saying(&no_ca, "grpcs:// needs the CA certificate");
    let wrong_ca = capture(
        &tls_address,
        logdir.path(),
        &["--tls-ca", path(&pki.other_ca)],
    )
    .await;
    fails_saying(&wrong_ca, "invalid peer certificate");
}

#[tokio::test]
async fn mutual_tls_admits_only_clients_signed_by_the_client_ca() {
    let pki = Pki::new();
    let mut flags = pki.serving();
    flags.extend(["--tls-client-ca", path(&pki.client_ca)]);
    let agent = AgentProcess::start(&flags);
    let logdir = tempfile::tempdir().unwrap();
    let tls_address = format!("grpcs://{}", agent.address);
    let ca = ["--tls-ca", path(&pki.ca)];

    let anonymous = capture(&tls_address, logdir.path(), &ca).await;
    fails_saying(&anonymous, "--tls-cert");
    // Signed, but by the CA of servers, not of clients.
    let mut wrong = ca.to_vec();
    wrong.extend(pki.serving());
    let wrong_signer = capture(&tls_address, logdir.path(), &wrong).await;
    fails_saying(&wrong_signer, "signed by a CA it trusts");

    let out = capture(&tls_address, logdir.path(), &pki.client()).await;
    assert!(event_count(&captured_trace(&out)) > 0);

    // The standard health service answers on the TLS listener too.
    let channel = tls_channel(&agent.address, &pki.ca, (&pki.client_cert, &pki.client_key)).await;
    let health = tonic_health::pb::health_client::HealthClient::new(channel)
        .check(tonic_health::pb::HealthCheckRequest::default())
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        health.status,
        tonic_health::pb::health_check_response::ServingStatus::Serving as i32
    );
}

/// A network namespace of its own joined to this one by a veth pair: a
/// client in it is on another host as far as the agent can tell (its
/// socket is in no table the agent reads). Gone when dropped.
struct OtherHost {
    name: String,
    /// This side's address, which the other reaches.
    here: String,
}

impl OtherHost {
    /// None when this machine cannot make one (no root, no `ip`).
    fn new() -> Option<OtherHost> {
        let id = std::process::id() % 10_000;
        let name = format!("dt-other-{id}");
        let subnet = 1 + std::process::id() % 250;
        let (here, there) = (format!("10.213.{subnet}.1"), format!("10.213.{subnet}.2"));
        let (ours, theirs) = (format!("dtv{id}a"), format!("dtv{id}b"));
        let run = |args: &[&str]| {
            Command::new("ip")
                .args(args)
                .status()
                .is_ok_and(|s| s.success())
        };
        let _ = run(&["netns", "del", &name]);
        if !run(&["netns", "add", &name]) {
            return None;
        }
        let host = OtherHost {
            name: name.clone(),
            here: here.clone(),
        };
        let made = run(&[
            "link", "add", &ours, "type", "veth", "peer", "name", &theirs,
        ]) && run(&["link", "set", &theirs, "netns", &name])
            && run(&["addr", "add", &format!("{here}/30"), "dev", &ours])
            && run(&["link", "set", &ours, "up"])
            && run(&[
                "netns",
                "exec",
                &name,
                "ip",
                "addr",
                "add",
                &format!("{there}/30"),
                "dev",
                &theirs,
            ])
            && run(&["netns", "exec", &name, "ip", "link", "set", &theirs, "up"]);
        made.then_some(host)
    }

    /// `devtrace ARGS` run on the other host.
    fn devtrace(&self, args: &[&str]) -> Output {
        Command::new("ip")
            .args(["netns", "exec", &self.name, BIN])
            .args(args)
            .output()
            .unwrap()
    }
}

impl Drop for OtherHost {
    fn drop(&mut self) {
        // The namespace's end of the pair goes with it, and the pair too.
        let _ = Command::new("ip")
            .args(["netns", "del", &self.name])
            .status();
    }
}

/// A client on another host is named by its verified certificate: by
/// default it captures nothing (refused, naming the flags that would let
/// it), and as an `--admin-client` it captures the whole host.
#[tokio::test]
async fn a_client_on_another_host_is_named_by_its_certificate_and_let_in_as_configured() {
    if unsafe { libc::geteuid() } != 0 {
        eprintln!("skipped: making a network namespace needs root");
        return;
    }
    let Some(other) = OtherHost::new() else {
        eprintln!("skipped: this machine cannot make a network namespace with ip");
        return;
    };
    let pki = Pki::new();
    let listen = format!("{}:0", other.here);
    let mut flags = pki.serving();
    flags.extend(["--tls-client-ca", path(&pki.client_ca)]);
    let logdir = tempfile::tempdir().unwrap();
    let capture_from_there = |agent: &AgentProcess| {
        let target = format!("grpcs://{}", agent.address);
        let mut args = vec!["capture", &target, "--tls-domain", "localhost"];
        args.extend(["--duration", "300ms", "--quiet", "--logdir"]);
        args.push(path(logdir.path()));
        args.extend(pki.client());
        other.devtrace(&args)
    };
    let refusing = AgentProcess::adopt(AgentProcess::spawn_listening(&listen, &flags));
    let refused = capture_from_there(&refusing);
    fails_saying(
        &refused,
        "operator (client certificate) is not a user of this host",
    );
    fails_saying(&refused, "--remote-callers host");
    drop(refusing);
    let mut as_admin = flags.clone();
    as_admin.extend(["--admin-client", "operator"]);
    let admitting = AgentProcess::adopt(AgentProcess::spawn_listening(&listen, &as_admin));
    let admitted = capture_from_there(&admitting);
    let space = captured_trace(&admitted);
    assert!(event_count(&space) > 0);
}

async fn tls_channel(address: &str, ca: &Path, own: (&Path, &Path)) -> Channel {
    let read = |p: &Path| std::fs::read(p).unwrap();
    let tls = ClientTlsConfig::new()
        .ca_certificate(Certificate::from_pem(read(ca)))
        .identity(Identity::from_pem(read(own.0), read(own.1)));
    Endpoint::from_shared(format!("https://{address}"))
        .unwrap()
        .tls_config(tls)
        .unwrap()
        .connect()
        .await
        .expect("connecting over mutual TLS")
}

#[tokio::test]
async fn a_session_between_two_agents_runs_over_mutual_tls() {
    let pki = Pki::new();
    let dir = tempfile::tempdir().unwrap();
    // Each agent requires client certificates from the CA that signed both,
    // and calls other agents with TLS and its own certificate.
    let mut flags = pki.serving();
    flags.extend([
        "--tls-client-ca",
        path(&pki.ca),
        "--tls-ca",
        path(&pki.ca),
        "--mock-rate",
        "2000",
    ]);
    let worker = AgentProcess::start(&flags);
    flags.extend(["--allow-root", path(dir.path())]);
    let coordinator = AgentProcess::start(&flags);
    let hosts = [coordinator.address.as_str(), worker.address.as_str()];
    let channel = tls_channel(
        &coordinator.address,
        &pki.ca,
        (&pki.agent_cert, &pki.agent_key),
    )
    .await;
    let reply = analysis(channel)
        .await
        .new_session(session_request(dir.path(), &hosts, "fleet"))
        .await
        .unwrap()
        .into_inner();
    assert!(reply.error_message.is_empty(), "{}", reply.error_message);
    let landed = |root: &Path, host: &str| {
        root.join(format!("fleet/{}.xplane.pb", host.replace(':', "_")))
            .is_file()
    };
    assert!(hosts.iter().all(|h| landed(dir.path(), h)));

    // The same session from the command line.
    let logdir = tempfile::tempdir().unwrap();
    let out = devtrace(args(&[
        "session",
        "new",
        "--hosts",
        &hosts.join(","),
        "--duration",
        "300ms",
        "--session-id",
        "fleet",
        "--logdir",
        path(logdir.path()),
        "--tls-ca",
        path(&pki.ca),
        "--tls-cert",
        path(&pki.agent_cert),
        "--tls-key",
        path(&pki.agent_key),
    ]))
    .await;
    assert!(out.status.success(), "{}", text(&out.stderr));
    let root = logdir.path().join("plugins/profile");
    assert!(hosts.iter().all(|h| landed(&root, h)));
}

// ---------------------------------------------------------------------------
// Listeners

#[test]
fn plaintext_other_hosts_can_reach_needs_insecure() {
    let serve = |extra: &[&str]| {
        Command::new(BIN)
            .args(["serve", "--listen", "0.0.0.0:0", "--backend", "mock"])
            .args(extra)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("starting devtrace serve")
    };
    let refused = serve(&[]).wait_with_output().unwrap();
    fails_saying(&refused, "--insecure");
    let mut allowed = AgentProcess::adopt(serve(&["--insecure", "--log-level", "warn"]));
    assert!(
        allowed.address.starts_with("0.0.0.0:"),
        "{}",
        allowed.address
    );
    assert!(allowed.is_running());
}

/// Every listener names its caller as the kernel does, whatever the request
/// says: a capture from uid 65534 over loopback TCP is logged as that uid,
/// one from this process's user over the UNIX socket as its uid, and a
/// Terminate likewise.
#[tokio::test]
async fn the_agent_names_each_caller_by_the_kernels_word() {
    if unsafe { libc::geteuid() } != 0 {
        eprintln!("skipped: needs root to call as another user");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("agent.sock");
    let log = dir.path().join("agent.log");
    let child = Command::new(BIN)
        .args(["serve", "--listen", "127.0.0.1:0", "--backend", "mock"])
        .args([
            "--metrics-listen",
            "off",
            "--log-level",
            "info",
            "--mock-rate",
            "2000",
            // uid 65534's capture holds the mock's job only when it is theirs.
            "--mock-uid",
            "65534",
        ])
        .arg("--listen-unix")
        .arg(&socket)
        .stdout(Stdio::piped())
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .unwrap();
    let agent = AgentProcess::adopt(child);
    let logdir = tempfile::tempdir().unwrap();
    std::fs::set_permissions(
        logdir.path(),
        std::os::unix::fs::PermissionsExt::from_mode(0o777),
    )
    .unwrap();
    let (address, logdir_path) = (agent.address.clone(), logdir.path().to_path_buf());
    let as_nobody = tokio::task::spawn_blocking(move || {
        Command::new("setpriv")
            .args(["--reuid=65534", "--regid=65534", "--clear-groups", "--"])
            .arg(BIN)
            .args(["capture", &address, "--duration", "200ms", "--quiet"])
            .args(["--session-id", "from-nobody", "--logdir"])
            .arg(logdir_path)
            .output()
            .unwrap()
    })
    .await
    .unwrap();
    assert!(as_nobody.status.success(), "{}", text(&as_nobody.stderr));
    let unix = format!("unix:{}", socket.display());
    let out = capture(&unix, logdir.path(), &["--session-id", "run"]).await;
    assert!(out.status.success(), "{}", text(&out.stderr));
    let mut client = agent.client().await;
    client
        .terminate(devtrace::proto::tensorflow::TerminateRequest {
            session_id: "nothing-running".into(),
        })
        .await
        .unwrap();
    drop(agent);
    let said = std::fs::read_to_string(&log).unwrap();
    let line_of = |session: &str| {
        said.lines()
            .find(|line| line.contains(session))
            .unwrap_or_else(|| panic!("no line for {session} in {said}"))
            .to_string()
    };
    assert!(
        line_of("session=from-nobody").contains("caller=uid 65534 (TCP from this host)"),
        "{said}"
    );
    assert!(
        line_of("session=run").contains("caller=uid 0 (UNIX socket)"),
        "{said}"
    );
    assert!(
        line_of("session=nothing-running").contains("caller=uid 0 (TCP from this host)"),
        "{said}"
    );
}

/// Files under an allowed root are touched with the caller's rights, as on
/// a team's shared 1777 directory: uid 65534 cannot have the agent write
/// into, list or read from uid 1001's 0700 directory there, and what it has
/// the agent write is its own file, not root's. Root is served as before.
#[tokio::test]
async fn files_under_an_allowed_root_are_touched_with_the_callers_rights() {
    use common::raw_call::{connect_as, unary_on};
    use devtrace::proto::tensorflow::{
        EnumProfileSessionsAndToolsRequest, EnumProfileSessionsAndToolsResponse,
        ProfileSessionDataRequest,
    };
    use std::os::unix::fs::{chown, MetadataExt, PermissionsExt};
    if unsafe { libc::geteuid() } != 0 {
        eprintln!("skipped: needs root to call as other users");
        return;
    }
    let mode = |path: &Path, mode: u32| {
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).unwrap()
    };
    let shared = tempfile::tempdir().unwrap();
    mode(shared.path(), 0o1777);
    // uid 1001's own directory, with a session of its own in it.
    let theirs = shared.path().join("theirs");
    let session = theirs.join("plugins/profile/run1");
    std::fs::create_dir_all(&session).unwrap();
    let trace = session.join("host.xplane.pb");
    let their_bytes = XSpace {
        hostnames: vec!["theirs".into()],
        ..XSpace::default()
    }
    .encode_to_vec();
    std::fs::write(&trace, &their_bytes).unwrap();
    for path in [
        theirs.clone(),
        theirs.join("plugins"),
        theirs.join("plugins/profile"),
        session.clone(),
        trace.clone(),
    ] {
        chown(&path, Some(1001), Some(1001)).unwrap();
    }
    mode(&theirs, 0o700);
    mode(&trace, 0o600);
    // The mock's job is uid 65534's, so that its captures hold events.
    let agent = AgentProcess::start(&[
        "--allow-root",
        path(shared.path()),
        "--mock-rate",
        "2000",
        "--mock-uid",
        "65534",
    ]);
    let as_nobody = |logdir: PathBuf, session: &'static str| {
        let address = agent.address.clone();
        tokio::task::spawn_blocking(move || {
            Command::new("setpriv")
                .args(["--reuid=65534", "--regid=65534", "--clear-groups", "--"])
                .arg(BIN)
                .args(["capture", &address, "--duration", "200ms", "--quiet"])
                .args(["--session-id", session, "--logdir"])
                .arg(logdir)
                .output()
                .unwrap()
        })
    };
    // Into their directory: not written, by the agent or anyone.
    let intruded = as_nobody(theirs.clone(), "intrude").await.unwrap();
    assert!(!intruded.status.success(), "{}", text(&intruded.stderr));
    assert!(!theirs.join("plugins/profile/intrude").exists());
    assert_eq!(std::fs::read(&trace).unwrap(), their_bytes);
    // Into the shared directory: written, as the caller's own file.
    let own = as_nobody(shared.path().join("mine"), "own").await.unwrap();
    assert!(own.status.success(), "{}", text(&own.stderr));
    let written = shared.path().join("mine/plugins/profile/own");
    let file = std::fs::read_dir(&written)
        .unwrap()
        .next()
        .expect("a trace file")
        .unwrap();
    assert_eq!(file.metadata().unwrap().uid(), 65534, "{:?}", file.path());
    assert_eq!(std::fs::metadata(&written).unwrap().uid(), 65534);
    // Listing and reading their sessions: refused to uid 65534.
    let repository = path(&theirs.join("plugins/profile")).to_string();
    let ask = ProfileSessionDataRequest {
        repository_root: repository.clone(),
        session_id: "run1".into(),
        host_name: "host".into(),
        tool_name: "xplane".into(),
        ..ProfileSessionDataRequest::default()
    };
    let read_path = "/tensorflow.ProfileAnalysis/GetSessionToolData";
    let io = connect_as(65534, &agent.address).await;
    let (_, status) = unary_on(io, &agent.address, read_path, &ask).await;
    // The caller's own rights refused it: PERMISSION_DENIED, not a fault
    // of the agent's (INTERNAL).
    assert_eq!(status.code(), tonic::Code::PermissionDenied, "{status:?}");
    let list = EnumProfileSessionsAndToolsRequest {
        repository_root: repository.clone(),
    };
    let io = connect_as(65534, &agent.address).await;
    let (listed, status) = unary_on(
        io,
        &agent.address,
        "/tensorflow.ProfileAnalysis/EnumSessions",
        &list,
    )
    .await;
    if status.code() == tonic::Code::Ok {
        let listed = EnumProfileSessionsAndToolsResponse::decode(&listed[..]).unwrap();
        panic!("uid 65534 listed their sessions: {listed:?}");
    }
    assert_eq!(status.code(), tonic::Code::PermissionDenied, "{status:?}");
    // A file named where a directory goes: no such directory, not a fault.
    let mut analysis = agent.analysis().await;
    let onto_file = analysis
        .enum_sessions(EnumProfileSessionsAndToolsRequest {
            repository_root: path(&trace).to_string(),
        })
        .await
        .unwrap_err();
    assert_eq!(onto_file.code(), tonic::Code::NotFound, "{onto_file:?}");
    // Root still reads it.
    let served = analysis
        .get_session_tool_data(ask)
        .await
        .expect("root reads the trace")
        .into_inner();
    assert_eq!(served.output, their_bytes);
}

/// What runs belongs to who started it: uid 65534 cannot stop root's
/// capture by naming its session, nor take snapshots of or stop root's
/// continuous session, which does not keep it from one of its own; root
/// stops its own. (Before, any caller could cut
/// another's capture short with a guessed session id.)
#[tokio::test]
async fn a_caller_cannot_stop_or_read_what_another_started() {
    use devtrace::proto::tensorflow::{
        GetSnapshotRequest, StopContinuousProfilingRequest, TerminateRequest,
    };
    if unsafe { libc::geteuid() } != 0 {
        eprintln!("skipped: needs root to call as other users");
        return;
    }
    let agent = AgentProcess::start(&["--mock-rate", "2000"]);
    let address = agent.address.clone();
    // Root's 3 s capture, which uid 65534 asks to stop a second in.
    let mut client = agent.client().await;
    let capture = tokio::spawn(async move { client.profile(request(3000, "roots")).await });
    tokio::time::sleep(std::time::Duration::from_millis(1000)).await;
    let terminate = TerminateRequest {
        session_id: "roots".into(),
    };
    let status = status_as_nobody(
        &address,
        "/tensorflow.ProfilerService/Terminate",
        &terminate,
    )
    .await;
    assert_eq!(status.code(), tonic::Code::Ok, "{status:?}");
    let space = space_of(&capture.await.unwrap().unwrap().into_inner());
    let (start, stop) = window_of(&space);
    assert!(
        stop - start >= 2_900_000_000,
        "cut short to {} ns",
        stop - start
    );
    // Its own Terminate still stops it.
    let mut client = agent.client().await;
    let capture = tokio::spawn(async move { client.profile(request(60_000, "own")).await });
    let mut other = agent.client().await;
    // Until it has ended: a Terminate before the capture is in progress
    // finds nothing to stop.
    while !capture.is_finished() {
        tokio::time::sleep(std::time::Duration::from_millis(300)).await;
        other
            .terminate(TerminateRequest {
                session_id: "own".into(),
            })
            .await
            .unwrap();
    }
    let space = space_of(&capture.await.unwrap().unwrap().into_inner());
    let (start, stop) = window_of(&space);
    assert!(stop - start < 30_000_000_000);
    // Root's continuous session: closed to uid 65534, open to root.
    let mut client = agent.client().await;
    let mut continuous = request(1000, "continuous");
    continuous.opts.as_mut().unwrap().start_timestamp_ns = 0;
    client.start_continuous_profiling(continuous).await.unwrap();
    let snapshot = || async {
        let path = "/tensorflow.ProfilerService/GetSnapshot";
        status_as_nobody(&address, path, &GetSnapshotRequest::default()).await
    };
    let stop = || async {
        let path = "/tensorflow.ProfilerService/StopContinuousProfiling";
        status_as_nobody(&address, path, &StopContinuousProfilingRequest {}).await
    };
    let start = || async {
        let mut theirs = request(1000, "theirs");
        theirs.opts.as_mut().unwrap().start_timestamp_ns = 0;
        let path = "/tensorflow.ProfilerService/StartContinuousProfiling";
        status_as_nobody(&address, path, &theirs).await
    };
    assert_eq!(snapshot().await.code(), tonic::Code::NotFound);
    assert_eq!(stop().await.code(), tonic::Code::NotFound);
    // Root's session does not keep uid 65534 from a session of its own,
    // which it alone snapshots and stops.
    assert_eq!(start().await.code(), tonic::Code::Ok);
    assert_eq!(start().await.code(), tonic::Code::AlreadyExists);
    assert_eq!(snapshot().await.code(), tonic::Code::Ok);
    assert_eq!(stop().await.code(), tonic::Code::Ok);
    client
        .get_snapshot(GetSnapshotRequest::default())
        .await
        .expect("root takes its snapshot");
    client
        .stop_continuous_profiling(StopContinuousProfilingRequest {})
        .await
        .expect("root stops its session");
}

/// One caller cannot hold all the captures: past --captures-per-caller in
/// progress its next is refused naming the flag, while root (an admin)
/// still captures.
#[tokio::test]
async fn a_caller_past_its_captures_in_progress_is_refused_and_others_go_on() {
    if unsafe { libc::geteuid() } != 0 {
        eprintln!("skipped: needs root to call as other users");
        return;
    }
    let agent = AgentProcess::start(&["--captures-per-caller", "2", "--mock-rate", "2000"]);
    let profile = "/tensorflow.ProfilerService/Profile";
    let mut held = Vec::new();
    for session in ["first", "second"] {
        let address = agent.address.clone();
        held.push(tokio::spawn(async move {
            status_as_nobody(&address, profile, &request(10_000, session)).await
        }));
    }
    // Both in progress (their windows are 10 s), whatever the machine's load.
    tokio::time::sleep(std::time::Duration::from_millis(2000)).await;
    let refused = status_as_nobody(&agent.address, profile, &request(300, "third")).await;
    assert_eq!(
        refused.code(),
        tonic::Code::ResourceExhausted,
        "{refused:?}"
    );
    assert!(
        refused.message().contains("--captures-per-caller (2)"),
        "{refused:?}"
    );
    let space = space_of(&agent.profile(request(300, "roots")).await);
    assert!(event_count(&space) > 0);
    for call in held {
        call.abort();
    }
}

/// A NewSession of a caller that is not an admin writes at most
/// --session-bytes: past it, the host's trace is not written, the
/// session's errors name the flag and no empty session is left. What was
/// not written does not count against the caller's hour. Root's session
/// of the same host lands.
#[tokio::test]
async fn a_callers_session_writes_at_most_its_bytes() {
    if unsafe { libc::geteuid() } != 0 {
        eprintln!("skipped: needs root to call as other users");
        return;
    }
    let shared = shared_directory();
    let agent = AgentProcess::start(&[
        "--allow-root",
        path(shared.path()),
        "--session-bytes",
        "1MiB",
        "--session-bytes-per-hour",
        "2MiB",
        "--mock-rate",
        "200000",
        "--mock-uid",
        "65534",
    ]);
    // 0.3 s at 200,000 events/s: a trace of about 4 MB. Each refusal
    // counted up to 1 MiB against the hour, before what did not land was
    // given back: the third would have named --session-bytes-per-hour.
    let hosts = [agent.address.as_str()];
    for round in 0..3 {
        let request = session_request(shared.path(), &hosts, "bounded");
        let reply = common::raw_call::new_session_as(65534, &agent.address, &request).await;
        assert!(
            reply
                .error_message
                .contains("--session-bytes lets one session write"),
            "round {round}: {}",
            reply.error_message
        );
        // The session this call made, empty, is taken back (just after
        // the reply).
        let bounded = shared.path().join("bounded");
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
        while bounded.exists() && std::time::Instant::now() < deadline {
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
        assert!(!bounded.exists(), "an empty session was left");
    }
    let reply = analysis(plain_channel(&agent.address).await)
        .await
        .new_session(session_request(shared.path(), &hosts, "roots"))
        .await
        .unwrap()
        .into_inner();
    assert!(reply.error_message.is_empty(), "{}", reply.error_message);
    assert_eq!(
        std::fs::read_dir(shared.path().join("roots"))
            .unwrap()
            .count(),
        1
    );
}

/// The status of one call of `path` carrying `message`, made as uid 65534.
async fn status_as_nobody(
    address: &str,
    path: &str,
    message: &impl prost::Message,
) -> tonic::Status {
    let io = common::raw_call::connect_as(65534, address).await;
    common::raw_call::unary_on(io, address, path, message)
        .await
        .1
}

/// `--listen off`: the UNIX socket alone serves, no TCP port is bound, and
/// without a socket there is nothing to serve on, which is refused.
#[tokio::test]
async fn listen_off_serves_only_the_unix_socket() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("agent.sock");
    let agent = AgentProcess::adopt(AgentProcess::spawn_listening(
        "off",
        &["--listen-unix", path(&socket), "--mock-rate", "2000"],
    ));
    assert_eq!(agent.address, format!("unix:{}", socket.display()));
    // Its only listening sockets are UNIX ones: no TCP socket of its own.
    let inodes = socket_inodes(agent.pid());
    let tcp_listening = ["/proc/net/tcp", "/proc/net/tcp6"]
        .iter()
        .filter_map(|table| std::fs::read_to_string(table).ok())
        .flat_map(|table| table.lines().skip(1).map(str::to_owned).collect::<Vec<_>>())
        .filter(|line| {
            let fields: Vec<&str> = line.split_whitespace().collect();
            // State 0A is LISTEN; field 9 the socket's inode.
            fields.get(3) == Some(&"0A")
                && fields
                    .get(9)
                    .is_some_and(|i| inodes.iter().any(|inode| inode == i))
        })
        .count();
    assert_eq!(tcp_listening, 0, "the agent listens on TCP");
    let logdir = tempfile::tempdir().unwrap();
    let out = capture(&agent.address, logdir.path(), &[]).await;
    assert!(event_count(&captured_trace(&out)) > 0);
    drop(agent);

    let alone = Command::new(BIN)
        .args(["serve", "--listen", "off", "--backend", "mock"])
        .args(["--metrics-listen", "off"])
        .output()
        .unwrap();
    fails_saying(&alone, "--listen-unix");
}

/// A second agent on a socket path another agent serves on refuses to
/// start rather than take the socket over; an agent whose socket was
/// replaced meanwhile leaves the new one in place as it exits.
#[tokio::test]
async fn an_agent_never_takes_or_removes_another_agents_socket() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("agent.sock");
    let mut first = AgentProcess::start(&["--listen-unix", path(&socket), "--mock-rate", "2000"]);
    let second = Command::new(BIN)
        .args(["serve", "--listen", "off", "--backend", "mock"])
        .args(["--metrics-listen", "off", "--listen-unix", path(&socket)])
        .output()
        .unwrap();
    fails_saying(&second, "another server accepts connections on it");
    let logdir = tempfile::tempdir().unwrap();
    let address = format!("unix:{}", socket.display());
    assert!(
        event_count(&captured_trace(
            &capture(&address, logdir.path(), &[]).await
        )) > 0
    );

    // The operator removes the socket and starts another agent there: the
    // first one's exit leaves it.
    std::fs::remove_file(&socket).unwrap();
    let other = AgentProcess::adopt(AgentProcess::spawn_listening(
        "off",
        &["--listen-unix", path(&socket), "--mock-rate", "2000"],
    ));
    assert!(first
        .stop_with_sigterm(std::time::Duration::from_secs(30))
        .is_some());
    let logdir = tempfile::tempdir().unwrap();
    assert!(
        event_count(&captured_trace(
            &capture(&address, logdir.path(), &[]).await
        )) > 0
    );
    drop(other);
}

/// The inodes of the sockets process `pid` has open.
fn socket_inodes(pid: u32) -> Vec<String> {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .map(|fds| {
            fds.filter_map(|fd| std::fs::read_link(fd.ok()?.path()).ok())
                .filter_map(|target| {
                    let target = target.to_string_lossy().into_owned();
                    Some(
                        target
                            .strip_prefix("socket:[")?
                            .strip_suffix(']')?
                            .to_owned(),
                    )
                })
                .collect()
        })
        .unwrap_or_default()
}

#[tokio::test]
async fn a_unix_socket_serves_local_clients_with_its_mode() {
    use std::os::unix::fs::{FileTypeExt, PermissionsExt};
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("agent.sock");
    let agent = AgentProcess::start(&["--listen-unix", path(&socket), "--mock-rate", "2000"]);
    let meta = std::fs::symlink_metadata(&socket).unwrap();
    assert!(meta.file_type().is_socket());
    assert_eq!(meta.permissions().mode() & 0o777, 0o600);
    // Nothing else was left beside it.
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1);

    let logdir = tempfile::tempdir().unwrap();
    let out = capture(&format!("unix:{}", socket.display()), logdir.path(), &[]).await;
    assert!(event_count(&captured_trace(&out)) > 0);
    drop(agent);
}

/// A reply's files are named by the server: `devtrace capture` writes only
/// those whose names are plain file names (one naming `../` wrote outside
/// the logdir), and refuses a trace that does not begin as one.
#[tokio::test]
async fn a_hostile_servers_file_names_and_junk_stay_out_of_the_logdir() {
    use devtrace::proto::tensorflow::{ProfileResponse, ProfileToolData};
    let tool = |name: &str, data: &[u8]| ProfileToolData {
        name: name.into(),
        data: data.to_vec().into(),
    };
    let trace = XSpace {
        hostnames: vec!["h".into()],
        ..XSpace::default()
    }
    .encode_to_vec();
    let escaping = common::bulky::replying_host(ProfileResponse {
        tool_data: vec![
            tool("/../../../escaped.txt", b"outside"),
            tool("xplane.pb", &trace),
        ],
        ..ProfileResponse::default()
    })
    .await;
    let dir = tempfile::tempdir().unwrap();
    let logdir = dir.path().join("logs");
    let out = capture(&escaping, &logdir, &["--session-id", "run"]).await;
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(
        text(&out.stderr).contains("is not written"),
        "{}",
        text(&out.stderr)
    );
    let written: Vec<_> = walk(dir.path());
    assert_eq!(written.len(), 1, "{written:?}");
    assert!(
        written[0].to_string_lossy().ends_with(".xplane.pb"),
        "{written:?}"
    );

    let junk = common::bulky::replying_host(ProfileResponse {
        tool_data: vec![tool("xplane.riegeli", &b"\0junk".repeat(100))],
        ..ProfileResponse::default()
    })
    .await;
    let out = capture(&junk, &logdir, &["--session-id", "junk"]).await;
    fails_saying(
        &out,
        "the server's reply is not a trace: its xplane.riegeli",
    );
    assert!(!logdir.join("plugins/profile/junk").exists());
}

/// Asserts that `session` holds `agent`'s trace and nothing else.
fn assert_only_agents_trace(session: &Path, agent: &AgentProcess) {
    let files: Vec<String> = std::fs::read_dir(session)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    assert_eq!(
        files,
        vec![format!("{}.xplane.pb", agent.address.replace(':', "_"))]
    );
}

/// Every file under `dir`, recursively.
fn walk(dir: &Path) -> Vec<PathBuf> {
    let mut files = Vec::new();
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            files.extend(walk(&path));
        } else {
            files.push(path);
        }
    }
    files
}

/// A session host whose reply's trace is junk (not Riegeli, though named
/// so) is a failed host; nothing of it is stored (it was, and every tool on
/// the session failed with INTERNAL later).
#[tokio::test]
async fn a_session_host_sending_junk_for_a_trace_is_a_failed_host() {
    use devtrace::proto::tensorflow::{ProfileResponse, ProfileToolData};
    let junk = common::bulky::replying_host(ProfileResponse {
        tool_data: vec![ProfileToolData {
            name: "xplane.riegeli".into(),
            data: b"\0junk".repeat(100).into(),
        }],
        ..ProfileResponse::default()
    })
    .await;
    let dir = tempfile::tempdir().unwrap();
    let agent = AgentProcess::start(&["--allow-root", path(dir.path())]);
    let reply = agent
        .new_session_within(
            session_request(dir.path(), &[junk.as_str(), agent.address.as_str()], "s"),
            std::time::Duration::from_secs(20),
        )
        .await;
    assert!(
        reply
            .error_message
            .contains("does not begin with that format's signature"),
        "{}",
        reply.error_message
    );
    assert_only_agents_trace(&dir.path().join("s"), &agent);
}
