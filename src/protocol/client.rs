//! The client side of the profiler protocol, shared by `devtrace capture`,
//! the session fan-out and `--upstream`: addresses and how each is reached
//! (plaintext, TLS, a UNIX socket), connecting with the limits a reply may
//! reach, and the request TensorFlow's own client sends.

use std::time::Duration;

use bytes::Bytes;
use tonic::transport::{Channel, Endpoint};
use tonic::{Code, Status};

use crate::proto::tensorflow::profiler_service_client::ProfilerServiceClient;
use crate::proto::tensorflow::{
    MonitorRequest, MonitorResponse, ProfileOptions, ProfileRequest, TerminateRequest,
};
use crate::protocol::tls::ClientTls;
use crate::protocol::MAX_REPLY_BYTES;

/// Port of a profiler server when an address names none.
pub const DEFAULT_PORT: u16 = 6009;

/// Largest reply accepted from one server unless configured otherwise: real
/// traces run to hundreds of MB, and a hostile server must not make this
/// side hold gigabytes.
pub const DEFAULT_MAX_REPLY_BYTES: usize = 512 << 20;

/// The tools TensorFlow's client asks for; servers may use them as hints.
pub const REQUESTED_TOOLS: &[&str] = &[
    "trace_viewer",
    "op_profile",
    "input_pipeline",
    "kernel_stats",
    "memory_viewer",
    "memory_profile",
    "overview_page",
    "pod_viewer",
    "tensorflow_stats",
    "xplane.pb",
];

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum AddressError {
    #[error("address is empty")]
    Empty,
    #[error("{0:?} is not host:port (the port must be a number from 1 to 65535)")]
    BadPort(String),
    #[error("{0:?} contains characters a host name cannot have")]
    BadHost(String),
    #[error(
        "{0:?}: profiler servers speak gRPC; give grpc://HOST:PORT (plaintext), \
         grpcs://HOST:PORT (TLS), HOST:PORT or unix:PATH"
    )]
    Scheme(String),
}

/// `host:port` from `grpc://host:port`, `host:port` or `host` (then with
/// `default_port`). IPv6 literals go in brackets: `[::1]:6009`.
pub fn normalize_address(address: &str, default_port: u16) -> Result<String, AddressError> {
    let target = address.trim();
    let target = target.strip_prefix("grpc://").unwrap_or(target);
    if target.is_empty() {
        return Err(AddressError::Empty);
    }
    let (host, port) = match split_port(target) {
        Some((host, port)) => {
            let port: u16 = port
                .parse()
                .ok()
                .filter(|p| *p != 0)
                .ok_or_else(|| AddressError::BadPort(address.to_string()))?;
            (host, port)
        }
        None => (target, default_port),
    };
    let allowed = |c: char| c.is_ascii_alphanumeric() || "-._[]:".contains(c);
    if host.is_empty() || !host.chars().all(allowed) {
        return Err(AddressError::BadHost(address.to_string()));
    }
    Ok(format!("{host}:{port}"))
}

/// `(host, port)` of `host:port` or `[v6]:port`; `None` when no port is given.
pub fn split_port(text: &str) -> Option<(&str, &str)> {
    text.rsplit_once(':')
        .filter(|(host, _)| !host.is_empty() && (!host.contains(':') || host.ends_with(']')))
}

/// How an address asks to be reached.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Scheme {
    /// `host:port`: TLS when this side has TLS settings, else plaintext.
    Unspecified,
    /// `grpc://host:port`: plaintext.
    Plain,
    /// `grpcs://host:port`: TLS.
    Tls,
    /// `unix:PATH`: a local socket, plaintext (its file permissions guard it).
    Unix,
}

/// A profiler server to call: `host:port` (or a socket path) and how.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Target {
    /// `host:port`, or the socket's path for [`Scheme::Unix`].
    pub address: String,
    pub scheme: Scheme,
}

impl Target {
    /// A TCP server: `host`, `host:port`, `grpc://host:port` or
    /// `grpcs://host:port`.
    pub fn tcp(text: &str, default_port: u16) -> Result<Target, AddressError> {
        let trimmed = text.trim();
        let (scheme, rest) = if let Some(rest) = trimmed.strip_prefix("grpcs://") {
            (Scheme::Tls, rest)
        } else if let Some(rest) = trimmed.strip_prefix("grpc://") {
            (Scheme::Plain, rest)
        } else if trimmed.contains("://") {
            return Err(AddressError::Scheme(trimmed.to_string()));
        } else {
            (Scheme::Unspecified, trimmed)
        };
        Ok(Target {
            address: normalize_address(rest, default_port)?,
            scheme,
        })
    }

    /// As [`Target::tcp`], or a local socket: `unix:PATH`.
    pub fn any(text: &str, default_port: u16) -> Result<Target, AddressError> {
        match text.trim().strip_prefix("unix:") {
            Some("") => Err(AddressError::Empty),
            Some(path) => Ok(Target {
                address: path.to_string(),
                scheme: Scheme::Unix,
            }),
            None => Target::tcp(text, default_port),
        }
    }

    /// Whether calls to this target use TLS under `config`.
    pub fn uses_tls(&self, config: &ClientConfig) -> bool {
        match self.scheme {
            Scheme::Tls => true,
            Scheme::Plain | Scheme::Unix => false,
            Scheme::Unspecified => config.tls.is_some(),
        }
    }

    pub fn is_unix(&self) -> bool {
        self.scheme == Scheme::Unix
    }
}

/// `host:port` as given (the scheme is how, not who), `unix:PATH` for sockets.
impl std::fmt::Display for Target {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.scheme {
            Scheme::Unix => write!(f, "unix:{}", self.address),
            _ => f.write_str(&self.address),
        }
    }
}

/// How this side calls profiler servers.
#[derive(Clone, Debug)]
pub struct ClientConfig {
    /// TLS for `grpcs://` and scheme-less addresses; `None`: plaintext.
    pub tls: Option<ClientTls>,
    /// Largest reply accepted from one server; a larger one is refused
    /// while its length prefix is read, before its body is held.
    pub max_reply_bytes: usize,
    /// The local user a session's captures are asked for, when an agent
    /// calls on a user's behalf: an agent on this host honours it from its
    /// own user alone ([`crate::protocol::caller::ON_BEHALF_OF_UID`]).
    pub on_behalf_of_uid: Option<u32>,
    /// The agents a capture asked for with it passed through, this one
    /// last, for an agent's calls to its upstreams ([`super::via`]).
    pub via: Vec<u64>,
}

impl Default for ClientConfig {
    fn default() -> Self {
        ClientConfig {
            tls: None,
            max_reply_bytes: DEFAULT_MAX_REPLY_BYTES,
            on_behalf_of_uid: None,
            via: Vec::new(),
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ConnectError {
    #[error("grpcs:// needs the CA certificate that signed the server's (--tls-ca); no system trust store is used")]
    NoCa,
    // The error is shown with its causes, so it is not also the source.
    #[error("{}", describe_transport(.error, *.tls))]
    Transport {
        error: tonic::transport::Error,
        tls: bool,
    },
}

/// A transport error with its causes (tonic's own text is only "transport
/// error"), and a hint when a plaintext call may have met a TLS server.
fn describe_transport(error: &tonic::transport::Error, tls: bool) -> String {
    with_hint(with_causes(error.to_string(), error), tls)
}

/// `text` followed by every cause of `error` that it does not already end with.
pub(crate) fn with_causes(mut text: String, error: &dyn std::error::Error) -> String {
    let mut source = error.source();
    while let Some(cause) = source {
        let cause_text = cause.to_string();
        if !text.ends_with(&cause_text) {
            text.push_str(": ");
            text.push_str(&cause_text);
        }
        source = cause.source();
    }
    text
}

/// A connection the server dropped says little by itself: the server
/// stopped, or the two sides disagree (on TLS: a TLS server answers a
/// plaintext HTTP/2 preface with an alert, and a server that requires
/// client certificates drops a client without one after the handshake;
/// or on the protocol, an HTTP/1 server). Each reaches the client as an
/// HTTP/2 protocol error or a broken connection, so the likely causes are
/// added.
fn with_hint(mut text: String, tls: bool) -> String {
    // TLS 1.3 servers send the refusal of a client certificate after the
    // client already counts the handshake done, so it arrives as a dropped
    // connection or, when read in time, as the alert itself.
    let dropped = [
        "h2 protocol error",
        "broken pipe",
        "connection closed",
        "connection reset",
        "received fatal alert",
    ];
    // A TLS client's handshake met the bytes of a plaintext HTTP/2 server.
    if text.ends_with("Connection refused (os error 111)") {
        text.push_str(
            " (nothing listens there: is the agent running, `devtrace serve`, and on this port?)",
        );
    } else if text.starts_with("Operation is not implemented or not supported") {
        // UNIMPLEMENTED with an empty message: a gRPC server without the
        // profiler service (another program's port).
        text.push_str(" (the server speaks gRPC but serves no profiler: is this the agent's or the job's profiler port?)");
    } else if tls && text.contains("InvalidContentType") {
        text.push_str(" (the server does not speak TLS: call it with grpc://, without --tls-ca)");
    } else if text.contains("error reading a body") {
        // The server had begun its reply: it was a gRPC server.
        text.push_str(
            " (the connection ended while the reply was on the way: the server stopped, was \
             killed or gave up on this client, which read too slowly; this reply is lost)",
        );
    } else if dropped.iter().any(|d| text.contains(d)) {
        text.push_str(if tls {
            " (the server dropped the connection: it stopped or was killed, or it requires client certificates, which need --tls-cert and --tls-key signed by a CA it trusts)"
        } else {
            " (the server dropped the connection: it stopped or was killed, it is not a gRPC server, or it serves TLS, which needs grpcs:// or --tls-ca)"
        });
    }
    text
}

/// Why a call failed: the server's status, or its reply over the limit.
#[derive(Debug, thiserror::Error)]
pub enum CallError {
    #[error("reply refused: {found} is more than --max-reply-size allows ({limit} bytes)")]
    TooLarge { found: String, limit: usize },
    #[error("{}", with_hint(with_causes(format!("{}: {}", .status.code(), .status.message()), .status), *.tls))]
    Status { status: Status, tls: bool },
}

impl CallError {
    /// The gRPC status code the server answered with, if it answered.
    pub fn code(&self) -> Option<Code> {
        match self {
            CallError::Status { status, .. } => Some(status.code()),
            CallError::TooLarge { .. } => None,
        }
    }
}

impl Connection {
    /// The channel, for calls made without tonic's codec (the session
    /// fan-out's, which writes the trace out as it arrives).
    pub(crate) fn channel(&self) -> Channel {
        self.channel.clone()
    }

    /// The user this connection's captures are asked for, if not its own.
    pub(crate) fn on_behalf_of_uid(&self) -> Option<u32> {
        self.on_behalf_of_uid
    }

    pub(crate) fn max_reply_bytes(&self) -> usize {
        self.max_reply_bytes
    }

    /// A call's failure as the server's status says it.
    pub(crate) fn call_error(&self, status: Status) -> CallError {
        // tonic refuses an oversized message with OUT_OF_RANGE and "found N
        // bytes" before reading its body.
        let message = status.message();
        if status.code() == Code::OutOfRange && message.contains("message length too large") {
            let found = message
                .split_once("found ")
                .and_then(|(_, rest)| rest.split_once(','))
                .map_or("the reply", |(found, _)| found)
                .to_string();
            return CallError::TooLarge {
                found,
                limit: self.max_reply_bytes,
            };
        }
        CallError::Status {
            status,
            tls: self.tls,
        }
    }
}

/// A `ProfileResponse` with its trace left as the bytes it came in. Decoding
/// an XSpace into messages multiplies its size many times over (an empty
/// event is two bytes on the wire), so what a server sends is held as
/// received, within [`ClientConfig::max_reply_bytes`].
#[derive(Clone, PartialEq, prost::Message)]
pub struct RawProfileResponse {
    #[prost(message, repeated, tag = "6")]
    pub tool_data: Vec<RawToolData>,
    #[prost(bool, tag = "7")]
    pub empty_trace: bool,
    #[prost(bytes = "bytes", optional, tag = "8")]
    pub xspace: Option<Bytes>,
}

/// `ProfileToolData` with its data as received.
#[derive(Clone, PartialEq, prost::Message)]
pub struct RawToolData {
    #[prost(string, tag = "1")]
    pub name: String,
    #[prost(bytes = "bytes", tag = "2")]
    pub data: Bytes,
}

/// A connection to one profiler server.
pub struct Connection {
    channel: Channel,
    max_reply_bytes: usize,
    tls: bool,
    on_behalf_of_uid: Option<u32>,
    via: Vec<u64>,
}

/// Connects to `target` as `config` says, allowing each call `deadline`.
pub async fn connect(
    target: &Target,
    config: &ClientConfig,
    deadline: Duration,
) -> Result<Connection, ConnectError> {
    let tls = target.uses_tls(config);
    let transport = |error| ConnectError::Transport { error, tls };
    let uri = match target.scheme {
        Scheme::Unix => format!("unix:{}", target.address),
        _ if tls => format!("https://{}", target.address),
        _ => format!("http://{}", target.address),
    };
    let mut endpoint = Endpoint::from_shared(uri)
        .map_err(transport)?
        .connect_timeout(Duration::from_secs(10))
        .timeout(deadline);
    if tls {
        let settings = config.tls.as_ref().ok_or(ConnectError::NoCa)?;
        endpoint = endpoint.tls_config(settings.config()).map_err(transport)?;
    }
    let channel = endpoint.connect().await.map_err(transport)?;
    Ok(Connection {
        channel,
        max_reply_bytes: config.max_reply_bytes,
        tls,
        on_behalf_of_uid: config.on_behalf_of_uid,
        via: config.via.clone(),
    })
}

impl Connection {
    /// `Profile`, with the reply held as received (see [`RawProfileResponse`]).
    pub async fn profile(&self, request: ProfileRequest) -> Result<RawProfileResponse, CallError> {
        let limit = self.max_reply_bytes;
        let mut grpc = tonic::client::Grpc::new(self.channel.clone())
            .max_decoding_message_size(limit)
            .max_encoding_message_size(MAX_REPLY_BYTES);
        grpc.ready()
            .await
            .map_err(|e| self.call_error(Status::unavailable(e.to_string())))?;
        let codec = tonic_prost::ProstCodec::<ProfileRequest, RawProfileResponse>::default();
        let path = http::uri::PathAndQuery::from_static("/tensorflow.ProfilerService/Profile");
        let mut call = tonic::Request::new(request);
        if let Some(via) = super::via::header_value(&self.via) {
            call.metadata_mut()
                .as_mut()
                .insert(super::via::VIA_HEADER, via);
        }
        grpc.unary(call, path, codec)
            .await
            .map(tonic::Response::into_inner)
            .map_err(|status| self.call_error(status))
    }

    /// `devtrace.Trigger/Fire`: fires the agent's trigger rule `name`.
    pub async fn fire_trigger(
        &self,
        name: &str,
        reason: &str,
    ) -> Result<crate::proto::devtrace::FireResponse, CallError> {
        crate::proto::devtrace::trigger_client::TriggerClient::new(self.channel.clone())
            .fire(crate::proto::devtrace::FireRequest {
                name: name.to_string(),
                reason: reason.to_string(),
            })
            .await
            .map(tonic::Response::into_inner)
            .map_err(|status| self.call_error(status))
    }

    /// `Monitor`: what the server measured of its devices over the period
    /// `request` asks for.
    pub async fn monitor(&self, request: MonitorRequest) -> Result<MonitorResponse, CallError> {
        ProfilerServiceClient::new(self.channel.clone())
            .max_decoding_message_size(self.max_reply_bytes)
            .monitor(request)
            .await
            .map(tonic::Response::into_inner)
            .map_err(|status| self.call_error(status))
    }

    /// `Terminate`: ends the server's captures of `session_id` early.
    pub async fn terminate(&self, session_id: &str) -> Result<(), CallError> {
        ProfilerServiceClient::new(self.channel.clone())
            .max_decoding_message_size(self.max_reply_bytes)
            .terminate(TerminateRequest {
                session_id: session_id.to_string(),
            })
            .await
            .map(|_| ())
            .map_err(|status| self.call_error(status))
    }
}

/// The deadline TensorFlow's client gives a capture: max(60 s, 2 x duration).
pub fn capture_deadline(duration: Duration) -> Duration {
    Duration::from_secs(60).max(duration * 2)
}

/// The options TensorFlow's client sends.
pub fn default_profile_options(duration_ms: u64, start_timestamp_ns: u64) -> ProfileOptions {
    ProfileOptions {
        version: 1,
        include_dataset_ops: true,
        host_tracer_level: 2,
        device_tracer_level: 1,
        enable_hlo_proto: true,
        start_timestamp_ns,
        duration_ms,
        ..ProfileOptions::default()
    }
}

/// A `Profile` request shaped like `tf.profiler.experimental.client.trace`'s.
pub fn trace_request(
    options: ProfileOptions,
    repository_root: &str,
    session_id: &str,
    host_name: &str,
) -> ProfileRequest {
    ProfileRequest {
        duration_ms: options.duration_ms,
        max_events: 1_000_000,
        tools: REQUESTED_TOOLS.iter().map(|t| t.to_string()).collect(),
        opts: Some(options),
        repository_root: repository_root.to_string(),
        session_id: session_id.to_string(),
        host_name: host_name.to_string(),
        ..ProfileRequest::default()
    }
}

/// The trace bytes a reply carries, inline or as `xplane.pb` tool data.
pub fn trace_bytes(reply: RawProfileResponse) -> Option<Bytes> {
    if let Some(space) = reply.xspace {
        return Some(space);
    }
    reply
        .tool_data
        .into_iter()
        .find(|tool| tool.name == "xplane.pb")
        .map(|tool| tool.data)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_connection_lost_mid_reply_is_not_blamed_on_tls() {
        let mid_reply = with_hint(
            "h2 protocol error: error reading a body from connection: connection reset".into(),
            false,
        );
        assert!(
            mid_reply.contains("while the reply was on the way"),
            "{mid_reply}"
        );
        assert!(!mid_reply.contains("TLS"), "{mid_reply}");
        let at_first = with_hint("h2 protocol error: connection reset".into(), false);
        assert!(at_first.contains("it serves TLS"), "{at_first}");
    }

    #[test]
    fn a_tls_client_meeting_a_plaintext_server_is_told_so() {
        let plaintext = with_hint(
            "transport error: received corrupt message of type InvalidContentType".into(),
            true,
        );
        assert!(plaintext.ends_with("without --tls-ca)"), "{plaintext}");
    }

    #[test]
    fn other_protocols_are_named_as_such() {
        for text in ["http://host:6009", "https://host", "s3://bucket"] {
            assert!(matches!(
                Target::tcp(text, 6009),
                Err(AddressError::Scheme(_))
            ));
        }
        assert!(Target::tcp("grpcs://host:1", 6009).is_ok());
    }

    #[test]
    fn addresses_get_ports_and_lose_schemes() {
        assert_eq!(
            normalize_address("grpc://10.0.0.2:8466", 6009).unwrap(),
            "10.0.0.2:8466"
        );
        assert_eq!(
            normalize_address("worker-3", 6009).unwrap(),
            "worker-3:6009"
        );
        assert_eq!(normalize_address("[::1]:7000", 6009).unwrap(), "[::1]:7000");
        assert_eq!(normalize_address("[::1]", 6009).unwrap(), "[::1]:6009");
        assert!(matches!(
            normalize_address("h:0", 1),
            Err(AddressError::BadPort(_))
        ));
        assert!(matches!(
            normalize_address("h:http", 1),
            Err(AddressError::BadPort(_))
        ));
        assert!(matches!(
            normalize_address("a/b:1", 1),
            Err(AddressError::BadHost(_))
        ));
        assert_eq!(normalize_address(" ", 1), Err(AddressError::Empty));
    }

    #[test]
    fn schemes_say_how_a_target_is_reached() {
        let tls = |text| Target::any(text, 6009).unwrap();
        assert_eq!(
            tls("grpcs://h:7"),
            Target {
                address: "h:7".into(),
                scheme: Scheme::Tls
            }
        );
        assert_eq!(tls("grpc://h").scheme, Scheme::Plain);
        assert_eq!(tls("h").scheme, Scheme::Unspecified);
        let socket = tls("unix:/run/devtrace.sock");
        assert_eq!(socket.scheme, Scheme::Unix);
        assert_eq!(socket.to_string(), "unix:/run/devtrace.sock");
        assert_eq!(Target::any("unix:", 1), Err(AddressError::Empty));
        // Sessions and upstreams reach TCP servers only.
        assert!(Target::tcp("unix:/run/devtrace.sock", 6009).is_err());
        let plain = ClientConfig::default();
        assert!(!tls("h").uses_tls(&plain));
        assert!(tls("grpcs://h").uses_tls(&plain));
    }
}
