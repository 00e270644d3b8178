//! TLS for the control plane: the certificate a server presents, the CA its
//! clients must be signed by (mutual TLS), and what a client trusts and
//! presents. Every file is PEM and named explicitly: no system trust store
//! is consulted, so a certificate is accepted only when it chains to a CA
//! the operator gave.

use std::path::Path;
use std::time::Duration;

use tonic::transport::{Certificate, ClientTlsConfig, Identity, ServerTlsConfig};

use crate::model::small_file;

/// Largest certificate, key or CA bundle read (a system bundle of every
/// public CA is about 200 KiB).
const MAX_PEM_BYTES: u64 = 4 << 20;

/// How long a peer may take over its TLS handshake: one that stalls holds a
/// connection and a task, so it is cut off.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("cannot read {path}: {source}")]
    Read {
        path: String,
        source: std::io::Error,
    },
    #[error("{path} holds no PEM {what} (a -----BEGIN {what}----- block)")]
    NotPem { path: String, what: &'static str },
    /// Read, but refused by the TLS library (a key not the certificate's, a
    /// certificate or CA of a form it does not take).
    #[error("{files} cannot serve TLS: {reason}")]
    Unusable { files: String, reason: String },
    /// A certificate every peer would refuse (expired, not valid yet, not
    /// for servers) though it parses.
    #[error("{flag} {path}: {reason}")]
    Refused {
        flag: &'static str,
        path: String,
        reason: String,
    },
}

/// What a certificate says of itself, as TLS peers judge it.
#[derive(Debug)]
pub struct CertificateFacts {
    pub subject: String,
    /// Whole days until it expires.
    pub days_left: i64,
    /// Its SubjectPublicKeyInfo (DER), to match a key against.
    pub public_key: Vec<u8>,
    /// It names its purposes (extended key usage) and client
    /// authentication is not among them: servers that require client
    /// certificates refuse it.
    pub not_for_clients: bool,
}

/// Reads the first certificate of the PEM file at `path` (given as `flag`)
/// and refuses what every peer would refuse of it: a certificate expired or
/// not valid yet and, when it is a server's (`serving`), one whose
/// purposes leave out server authentication.
pub fn certificate_facts(
    flag: &'static str,
    path: &Path,
    serving: bool,
) -> Result<CertificateFacts, TlsError> {
    let refused = |reason: String| TlsError::Refused {
        flag,
        path: path.display().to_string(),
        reason,
    };
    let unusable = |reason: String| TlsError::Unusable {
        files: format!("{flag} {}", path.display()),
        reason,
    };
    let bytes = read_pem(path, "CERTIFICATE")?;
    let pem = x509_parser::pem::Pem::iter_from_buffer(&bytes)
        .filter_map(Result::ok)
        .find(|pem| pem.label == "CERTIFICATE")
        .ok_or_else(|| unusable("its CERTIFICATE block is not PEM".into()))?;
    let certificate = pem
        .parse_x509()
        .map_err(|error| unusable(format!("the certificate does not parse: {error}")))?;
    let subject = certificate.subject().to_string();
    let validity = certificate.validity();
    let now = x509_parser::time::ASN1Time::now();
    if now < validity.not_before {
        return Err(refused(format!(
            "{subject}: not valid before {}",
            validity.not_before
        )));
    }
    if now > validity.not_after {
        return Err(refused(format!(
            "{subject}: expired {}; renew it: peers refuse an expired certificate at the \
             handshake",
            validity.not_after
        )));
    }
    let purposes = certificate
        .extended_key_usage()
        .ok()
        .flatten()
        .map(|extension| extension.value);
    if serving && purposes.is_some_and(|usage| !usage.any && !usage.server_auth) {
        return Err(refused(format!(
            "{subject}: its purposes (extended key usage) leave out server authentication, \
             so clients refuse it as a server's"
        )));
    }
    Ok(CertificateFacts {
        subject,
        days_left: validity
            .time_to_expiration()
            .map_or(0, |left| left.whole_days()),
        public_key: certificate.public_key().raw.to_vec(),
        not_for_clients: purposes.is_some_and(|usage| !usage.any && !usage.client_auth),
    })
}

/// The contents of a PEM file that holds at least one `what` block
/// (`CERTIFICATE`, or `PRIVATE KEY` of any kind).
fn read_pem(path: &Path, what: &'static str) -> Result<Vec<u8>, TlsError> {
    let shown = || path.display().to_string();
    let bytes = small_file::read(path, MAX_PEM_BYTES).map_err(|source| TlsError::Read {
        path: shown(),
        source,
    })?;
    let text = String::from_utf8_lossy(&bytes);
    // "PRIVATE KEY" also covers "RSA PRIVATE KEY" and "EC PRIVATE KEY".
    let found = text
        .lines()
        .any(|line| line.starts_with("-----BEGIN ") && line.ends_with(&format!("{what}-----")));
    if !found {
        return Err(TlsError::NotPem {
            path: shown(),
            what,
        });
    }
    Ok(bytes)
}

fn certificate(path: &Path) -> Result<Certificate, TlsError> {
    read_pem(path, "CERTIFICATE").map(Certificate::from_pem)
}

fn identity(cert: &Path, key: &Path) -> Result<Identity, TlsError> {
    Ok(Identity::from_pem(
        read_pem(cert, "CERTIFICATE")?,
        read_pem(key, "PRIVATE KEY")?,
    ))
}

/// A server's TLS: its certificate chain and key and, when `client_ca` is
/// given, mutual TLS: every client must present a certificate signed by it.
pub fn server_config(
    cert: &Path,
    key: &Path,
    client_ca: Option<&Path>,
) -> Result<ServerTlsConfig, TlsError> {
    // A client CA's dates are not checked (trust anchors' are not, and a
    // bundle may hold an old root beside its successor): doctor warns.
    certificate_facts("--tls-cert", cert, true)?;
    let mut config = ServerTlsConfig::new()
        .identity(identity(cert, key)?)
        .timeout(HANDSHAKE_TIMEOUT);
    if let Some(ca) = client_ca {
        config = config.client_ca_root(certificate(ca)?);
    }
    // Built now as the server builds it, so that files the TLS library
    // refuses stop the agent before it says it listens.
    if let Err(error) = tonic::transport::Server::builder().tls_config(config.clone()) {
        let mut files = format!(
            "--tls-cert {} with --tls-key {}",
            cert.display(),
            key.display()
        );
        if let Some(ca) = client_ca {
            files.push_str(&format!(" and --tls-client-ca {}", ca.display()));
        }
        return Err(TlsError::Unusable {
            files,
            // tonic's own text is only "transport error".
            reason: super::client::with_causes(error.to_string(), &error),
        });
    }
    Ok(config)
}

/// A client's TLS: the CA servers' certificates must chain to, a certificate
/// of its own for servers that require one, and a name to check servers'
/// certificates against when it is not the host being called.
#[derive(Clone, Debug)]
pub struct ClientTls {
    config: ClientTlsConfig,
}

impl ClientTls {
    pub fn load(
        ca: &Path,
        own: Option<(&Path, &Path)>,
        domain: Option<&str>,
    ) -> Result<ClientTls, TlsError> {
        let mut config = ClientTlsConfig::new()
            .ca_certificate(certificate(ca)?)
            .timeout(HANDSHAKE_TIMEOUT);
        if let Some((cert, key)) = own {
            config = config.identity(identity(cert, key)?);
        }
        if let Some(domain) = domain {
            config = config.domain_name(domain);
        }
        Ok(ClientTls { config })
    }

    pub fn config(&self) -> ClientTlsConfig {
        self.config.clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn files_without_the_expected_pem_block_are_named() {
        let dir = tempfile::tempdir().unwrap();
        let key = dir.path().join("key.pem");
        std::fs::write(&key, "-----BEGIN EC PRIVATE KEY-----\nAAAA\n").unwrap();
        let error = ClientTls::load(&key, None, None).unwrap_err().to_string();
        assert!(
            error.contains("key.pem holds no PEM CERTIFICATE"),
            "{error}"
        );
        assert!(read_pem(&key, "PRIVATE KEY").is_ok());
        let missing = ClientTls::load(&dir.path().join("none.pem"), None, None)
            .unwrap_err()
            .to_string();
        assert!(missing.starts_with("cannot read "), "{missing}");
    }
}
