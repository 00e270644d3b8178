//! The flags that say how devtrace calls profiler servers: TLS (what it
//! trusts, what it presents) and the largest reply it accepts. `capture` and
//! `session new` use them for their calls; `serve` for its session hosts and
//! upstreams, and serves its own `--tls-cert` too.

use std::path::PathBuf;

use anyhow::{bail, Context};
use clap::Args;

use crate::protocol::client::{ClientConfig, DEFAULT_MAX_REPLY_BYTES};
use crate::protocol::tls::ClientTls;

#[derive(Debug, Args)]
pub struct ClientArgs {
    /// CA certificate (PEM) that servers' certificates must be signed by.
    /// Calls then use TLS (as a grpcs:// address does), except to grpc://
    /// addresses; no system trust store is consulted.
    #[arg(long, value_name = "FILE")]
    pub tls_ca: Option<PathBuf>,

    /// Certificate chain (PEM) presented to servers that require client
    /// certificates (mutual TLS); `serve` also presents it to its own
    /// clients. Needs --tls-key.
    #[arg(long, value_name = "FILE", requires = "tls_key")]
    pub tls_cert: Option<PathBuf>,

    /// Private key (PEM) of --tls-cert.
    #[arg(long, value_name = "FILE", requires = "tls_cert")]
    pub tls_key: Option<PathBuf>,

    /// Name servers' certificates are checked against, instead of the host
    /// of each address (e.g. when certificates name a service, not an IP).
    #[arg(long, value_name = "NAME")]
    pub tls_domain: Option<String>,

    /// Largest reply accepted from a server (e.g. 512MiB, 1GiB; at most
    /// 2GiB - 1, protobuf's bound). A larger one is refused before it is
    /// read, naming the server that sent it.
    #[arg(long, value_name = "SIZE", default_value = "512MiB", value_parser = parse_reply_size)]
    pub max_reply_size: usize,
}

fn parse_reply_size(text: &str) -> Result<usize, String> {
    let bytes = super::parse_size(text).map_err(|e| e.to_string())?;
    if bytes == 0 || bytes > i32::MAX as usize {
        return Err(format!(
            "{bytes} bytes; a gRPC reply is 1 byte to 2GiB - 1 (default {} MiB)",
            DEFAULT_MAX_REPLY_BYTES >> 20
        ));
    }
    Ok(bytes)
}

impl ClientArgs {
    /// The client configuration these flags describe, with every file read.
    pub fn config(&self) -> anyhow::Result<ClientConfig> {
        let tls = match &self.tls_ca {
            Some(ca) => {
                let own = self.tls_cert.as_deref().zip(self.tls_key.as_deref());
                Some(
                    ClientTls::load(ca, own, self.tls_domain.as_deref())
                        .context("loading the TLS files of --tls-ca/--tls-cert/--tls-key")?,
                )
            }
            None => None,
        };
        Ok(ClientConfig {
            tls,
            max_reply_bytes: self.max_reply_size,
            on_behalf_of_uid: None,
            via: Vec::new(),
        })
    }

    /// For commands that only call: a certificate or domain without
    /// --tls-ca would silently go unused.
    pub fn config_for_calls(&self) -> anyhow::Result<ClientConfig> {
        if self.tls_ca.is_none() && (self.tls_cert.is_some() || self.tls_domain.is_some()) {
            bail!("--tls-cert and --tls-domain need --tls-ca, the CA that signed the server's certificate");
        }
        self.config()
    }
}
