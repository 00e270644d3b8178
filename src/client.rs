//! The client side of the profiler protocol, shared by `devtrace capture` and
//! the ProfileAnalysis fan-out: address handling, connecting with the limits
//! real traces need, and the request TensorFlow's own client sends.

use std::time::Duration;

use tonic::transport::{Channel, Endpoint};

use crate::proto::tensorflow::profiler_service_client::ProfilerServiceClient;
use crate::proto::tensorflow::{ProfileOptions, ProfileRequest, ProfileResponse};
use crate::service::MAX_MESSAGE_BYTES;

/// Port of a profiler server when an address names none.
pub const DEFAULT_PORT: u16 = 6009;

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
}

/// `host:port` from `grpc://host:port`, `host:port` or `host` (then with
/// `default_port`). IPv6 literals go in brackets: `[::1]:6009`.
pub fn normalize_address(address: &str, default_port: u16) -> Result<String, AddressError> {
    let target = address.trim();
    let target = target.strip_prefix("grpc://").unwrap_or(target);
    if target.is_empty() {
        return Err(AddressError::Empty);
    }
    let (host, port) = match target.rsplit_once(':') {
        Some((host, port)) if !host.is_empty() && (!host.contains(':') || host.ends_with(']')) => {
            let port: u16 = port
                .parse()
                .ok()
                .filter(|p| *p != 0)
                .ok_or_else(|| AddressError::BadPort(address.to_string()))?;
            (host, port)
        }
        _ => (target, default_port),
    };
    let allowed = |c: char| c.is_ascii_alphanumeric() || "-._[]:".contains(c);
    if host.is_empty() || !host.chars().all(allowed) {
        return Err(AddressError::BadHost(address.to_string()));
    }
    Ok(format!("{host}:{port}"))
}

/// Connects to a profiler server at `target` (`host:port`), allowing the
/// whole call `deadline`.
pub async fn connect(
    target: &str,
    deadline: Duration,
) -> Result<ProfilerServiceClient<Channel>, tonic::transport::Error> {
    let channel = Endpoint::from_shared(format!("http://{target}"))?
        .connect_timeout(Duration::from_secs(10))
        .timeout(deadline)
        .connect()
        .await?;
    Ok(ProfilerServiceClient::new(channel)
        .max_decoding_message_size(MAX_MESSAGE_BYTES)
        .max_encoding_message_size(MAX_MESSAGE_BYTES))
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
pub fn trace_bytes(reply: ProfileResponse) -> Option<Vec<u8>> {
    use prost::Message;
    if let Some(space) = reply.xspace {
        return Some(space.encode_to_vec());
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
}
