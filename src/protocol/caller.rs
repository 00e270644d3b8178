//! Who is calling, as the kernel says, never as the caller says: the uid
//! of a UNIX-socket peer (`SO_PEERCRED`), the uid owning a TCP peer's socket
//! when that socket is on this host (this network namespace's socket
//! tables, matched on the connection's four addresses and ports); for a
//! peer elsewhere, the name its TLS client certificate (verified against
//! `--tls-client-ca`) gives, or else only its address. Every listener names
//! each connection's caller this way when it accepts it
//! ([`crate::protocol::listen`]).
//!
//! Bounds on connections and request bodies stay per address (see
//! [`crate::protocol::shares`]): the caller is who asks, not what it may
//! hold.

use std::fmt;
use std::io::{BufRead, BufReader};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::sync::Arc;

use tonic::transport::CertificateDer;

/// The metadata an agent sends with the captures of a session it runs for
/// a local user (`NewSession`), naming that user's uid: an agent on the
/// same host then scopes them to that user rather than to the agent's own
/// (root's) view. Honoured only on a connection from root or the agent's
/// own user, who could act as anyone anyway ([`Caller::acting_for`]).
pub const ON_BEHALF_OF_UID: &str = "devtrace-on-behalf-of-uid";

/// An [`ON_BEHALF_OF_UID`] value that is not a user id.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("{ON_BEHALF_OF_UID} must be a user id, 0 to 4294967294 in decimal, not {0:?}")]
pub struct NotAUser(String);

/// The uid `value` names: decimal digits only, and not 4294967295, which
/// the kernel uses for "no user".
fn named_uid(value: &[u8]) -> Result<u32, NotAUser> {
    const MOST_DIGITS: usize = 10;
    let refused = || {
        let shown: String = String::from_utf8_lossy(value).chars().take(64).collect();
        NotAUser(crate::model::printable::printable(&shown).into_owned())
    };
    if value.is_empty() || value.len() > MOST_DIGITS || !value.iter().all(u8::is_ascii_digit) {
        return Err(refused());
    }
    std::str::from_utf8(value)
        .ok()
        .and_then(|digits| digits.parse::<u32>().ok())
        .filter(|uid| *uid != u32::MAX)
        .ok_or_else(refused)
}

/// How a local caller reached the agent.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Transport {
    UnixSocket,
    Tcp,
}

/// See the module documentation.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Caller {
    /// A process of this host, whose user the kernel names.
    User { uid: u32, transport: Transport },
    /// A peer on another host that presented a client certificate the
    /// server verified: named by the certificate's first URI name (a SPIFFE
    /// ID), else its first DNS name.
    Certificate(Arc<str>),
    /// A peer whose socket is not on this host (or not in this network
    /// namespace): known only by its address.
    Remote(IpAddr),
    /// A local peer the kernel could not name (its socket already gone).
    Unknown,
    /// The agent itself (a trigger's save).
    Agent,
}

/// Who a caller is as an owner, whatever way it came: what it starts is
/// its own, and per-caller bounds count it, by this.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Owner {
    Uid(u32),
    Certificate(Arc<str>),
    Address(IpAddr),
    /// Callers the kernel could not name, counted together.
    Unnamed,
    Agent,
}

impl Caller {
    /// A local user over TCP, for tests.
    #[cfg(test)]
    pub fn tcp_user(uid: u32) -> Caller {
        Caller::User {
            uid,
            transport: Transport::Tcp,
        }
    }

    /// Whether this is root or the agent's own user, who may do anything
    /// the agent can.
    pub fn is_agents_equal(&self) -> bool {
        // SAFETY: geteuid has no preconditions.
        let agent = unsafe { libc::geteuid() };
        match self {
            Caller::Agent => true,
            Caller::User { uid, .. } => *uid == 0 || *uid == agent,
            _ => false,
        }
    }

    /// The caller a request counts as: the user an agent names in
    /// [`ON_BEHALF_OF_UID`] when the connection is root's or the agent's
    /// own user's, else who is on the connection. From such a connection a
    /// value that names no user is refused rather than ignored: ignoring it
    /// would run the request as root.
    pub fn acting_for(self, on_behalf_of: Option<&[u8]>) -> Result<Caller, NotAUser> {
        let Some(value) = on_behalf_of else {
            return Ok(self);
        };
        if !self.is_agents_equal() {
            return Ok(self);
        }
        match self {
            Caller::User { transport, .. } => Ok(Caller::User {
                uid: named_uid(value)?,
                transport,
            }),
            caller => Ok(caller),
        }
    }

    pub fn owner(&self) -> Owner {
        match self {
            Caller::User { uid, .. } => Owner::Uid(*uid),
            Caller::Certificate(name) => Owner::Certificate(Arc::clone(name)),
            Caller::Remote(address) => Owner::Address(*address),
            Caller::Unknown => Owner::Unnamed,
            Caller::Agent => Owner::Agent,
        }
    }
}

impl fmt::Display for Caller {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Caller::User {
                uid,
                transport: Transport::UnixSocket,
            } => write!(f, "uid {uid} (UNIX socket)"),
            Caller::User {
                uid,
                transport: Transport::Tcp,
            } => write!(f, "uid {uid} (TCP from this host)"),
            Caller::Certificate(name) => write!(f, "{name} (client certificate)"),
            Caller::Remote(address) => write!(f, "{address} (another host)"),
            Caller::Unknown => f.write_str("unknown"),
            Caller::Agent => f.write_str("the agent"),
        }
    }
}

/// The name a verified client certificate gives (DER): its first URI name
/// (a SPIFFE ID such as `spiffe://cluster/ns/team/sa/trainer`), else its
/// first DNS name; none when it has neither.
pub fn certificate_name(certificate: &CertificateDer<'_>) -> Option<Arc<str>> {
    let parsed = webpki::EndEntityCert::try_from(certificate).ok()?;
    let name = parsed
        .valid_uri_names()
        .next()
        .or_else(|| parsed.valid_dns_names().next())?;
    Some(Arc::from(name))
}

/// The socket tables of this network namespace.
const TCP_TABLES: [&str; 2] = ["/proc/net/tcp", "/proc/net/tcp6"];

/// The caller of a TCP connection accepted at `local` from `peer`.
pub fn of_tcp(local: SocketAddr, peer: SocketAddr) -> Caller {
    let local = canonical(local);
    let peer = canonical(peer);
    for table in TCP_TABLES {
        let Ok(file) = std::fs::File::open(table) else {
            continue;
        };
        if let Some(uid) = owner_in(BufReader::new(file), local, peer) {
            return Caller::User {
                uid,
                transport: Transport::Tcp,
            };
        }
    }
    Caller::Remote(peer.ip())
}

/// The inodes of the sockets listening on TCP `port` in this network
/// namespace, at any address.
pub fn tcp_listeners(port: u16) -> Vec<u64> {
    let mut inodes = Vec::new();
    for table in TCP_TABLES {
        if let Ok(file) = std::fs::File::open(table) {
            inodes.extend(listeners_in(BufReader::new(file), port));
        }
    }
    inodes
}

/// The inodes of the sockets in `table` listening on `port`.
fn listeners_in(table: impl BufRead, port: u16) -> Vec<u64> {
    // sl local_address rem_address st tx:rx tr:when retrnsmt uid timeout inode
    const LISTEN: &str = "0A";
    table
        .lines()
        .skip(1)
        .map_while(Result::ok)
        .filter_map(|line| {
            let mut fields = line.split_whitespace().skip(1);
            let own = parse_end(fields.next()?)?;
            let state = fields.nth(1)?;
            if own.port() != port || state != LISTEN {
                return None;
            }
            fields.nth(5)?.parse().ok()
        })
        .collect()
}

/// The uid of the socket in `table` (the text of `/proc/net/tcp` or
/// `tcp6`) whose own end is `peer` and whose other end is `local`.
fn owner_in(table: impl BufRead, local: SocketAddr, peer: SocketAddr) -> Option<u32> {
    for line in table.lines().skip(1) {
        let line = line.ok()?;
        // sl local_address rem_address st tx:rx tr:when retrnsmt uid ...
        let mut fields = line.split_whitespace().skip(1);
        let (Some(own), Some(other)) = (fields.next(), fields.next()) else {
            continue;
        };
        if parse_end(own) != Some(peer) || parse_end(other) != Some(local) {
            continue;
        }
        return fields.nth(4)?.parse().ok();
    }
    None
}

/// An address and port as the socket tables print them: the address's
/// 32-bit words in hex, each in the host's byte order, then the port.
fn parse_end(text: &str) -> Option<SocketAddr> {
    let (address, port) = text.split_once(':')?;
    let port = u16::from_str_radix(port, 16).ok()?;
    let word = |hex: &str| u32::from_str_radix(hex, 16).ok().map(u32::to_ne_bytes);
    let ip = match address.len() {
        8 => IpAddr::V4(Ipv4Addr::from(word(address)?)),
        32 => {
            let mut bytes = [0u8; 16];
            for (i, chunk) in bytes.chunks_mut(4).enumerate() {
                chunk.copy_from_slice(&word(address.get(i * 8..i * 8 + 8)?)?);
            }
            IpAddr::V6(Ipv6Addr::from(bytes))
        }
        _ => return None,
    };
    Some(canonical(SocketAddr::new(ip, port)))
}

/// An IPv4-mapped IPv6 address as IPv4: a dual-stack listener's peers and
/// an IPv4 socket's table entry then compare equal.
fn canonical(address: SocketAddr) -> SocketAddr {
    SocketAddr::new(address.ip().to_canonical(), address.port())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn listeners_are_found_by_port_and_state() {
        let table = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n\
   0: 00000000:07E8 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 1077 1 00000000f7d56b66 100 0 0 10 0\n\
   1: 0100007F:07E8 0100007F:9177 01 00000000:00000000 03:00000FF4 00000000     0        0 2088 3 000000000446ecab\n\
   2: 0100007F:1F90 00000000:0000 0A 00000000:00000000 00:00000000 00000000  1001        0 3099 1 0000000000000000 100 0 0 10 0\n";
        assert_eq!(listeners_in(table.as_bytes(), 2024), [1077]);
        assert_eq!(listeners_in(table.as_bytes(), 8080), [3099]);
        assert!(listeners_in(table.as_bytes(), 9).is_empty());
        // This process's own listener is in the real tables.
        let held = std::net::TcpListener::bind("127.0.0.1:0").expect("a listener");
        let port = held.local_addr().expect("its address").port();
        assert_eq!(tcp_listeners(port).len(), 1);
    }

    #[test]
    fn only_root_or_the_agents_user_may_name_whom_it_calls_for() {
        let tcp = |uid| Caller::User {
            uid,
            transport: Transport::Tcp,
        };
        let named = |caller: Caller, value: &str| caller.acting_for(Some(value.as_bytes()));
        assert_eq!(named(tcp(0), "1001"), Ok(tcp(1001)));
        assert_eq!(named(tcp(0), "0"), Ok(tcp(0)));
        assert_eq!(named(tcp(0), "4294967294"), Ok(tcp(4_294_967_294)));
        assert_eq!(tcp(0).acting_for(None), Ok(tcp(0)));
        // Anyone else's claim is ignored (unless it runs the agent).
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } != 65_534 {
            assert_eq!(named(tcp(65_534), "1001"), Ok(tcp(65_534)));
            assert_eq!(named(tcp(65_534), "garbage"), Ok(tcp(65_534)));
        }
        let remote = Caller::Remote([10, 0, 0, 7].into());
        assert_eq!(named(remote.clone(), "0"), Ok(remote));
    }

    /// From root, a value that names no user is refused: ignoring it ran
    /// the request as root, and 4294967295 is the kernel's "no user".
    #[test]
    fn a_trusted_caller_naming_no_user_is_refused() {
        let root = Caller::tcp_user(0);
        for value in [
            "",
            "not a uid",
            "+1001",
            " 1001",
            "1001 ",
            "-1",
            "0x10",
            "4294967295",
            "4294967296",
            "00000000001001",
        ] {
            let refused = root.clone().acting_for(Some(value.as_bytes()));
            assert!(refused.is_err(), "{value:?} was taken as {refused:?}");
        }
        let error = root
            .acting_for(Some(b"\x1b[2J\xff"))
            .expect_err("not a uid");
        let message = error.to_string();
        assert!(message.contains(ON_BEHALF_OF_UID), "{message}");
        assert!(!message.contains('\x1b'), "{message}");
    }

    /// Words as a little-endian host prints them.
    fn hex_v4(ip: [u8; 4]) -> String {
        format!("{:08X}", u32::from_ne_bytes(ip))
    }

    #[test]
    fn the_socket_whose_ends_match_names_its_owner() {
        let agent: SocketAddr = "127.0.0.1:6009".parse().unwrap();
        let client: SocketAddr = "127.0.0.1:41234".parse().unwrap();
        let other: SocketAddr = "127.0.0.1:41235".parse().unwrap();
        let row = |sl: u32, own: SocketAddr, rem: SocketAddr, uid: u32| {
            let end = |a: SocketAddr| match a.ip() {
                IpAddr::V4(v4) => format!("{}:{:04X}", hex_v4(v4.octets()), a.port()),
                IpAddr::V6(_) => unreachable!(),
            };
            format!(
                "{sl:4}: {} {} 01 00000000:00000000 00:00000000 00000000 {uid:5} 0 123 1 0\n",
                end(own),
                end(rem)
            )
        };
        let table = format!(
            "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n{}{}{}",
            // The agent's own end of the same connection, then another
            // client's socket, then the caller's.
            row(0, agent, client, 0),
            row(1, other, agent, 1002),
            row(2, client, agent, 1001),
        );
        assert_eq!(owner_in(table.as_bytes(), agent, client), Some(1001));
        assert_eq!(owner_in(table.as_bytes(), agent, other), Some(1002));
        let absent: SocketAddr = "127.0.0.1:1".parse().unwrap();
        assert_eq!(owner_in(table.as_bytes(), agent, absent), None);
    }

    #[test]
    fn addresses_parse_as_the_kernel_prints_them() {
        let v4 = format!("{}:1773", hex_v4([127, 0, 0, 1]));
        assert_eq!(parse_end(&v4), Some("127.0.0.1:6003".parse().unwrap()));
        // ::1 and ::ffff:127.0.0.2, word by word in host order.
        let loopback6 = format!(
            "{:08X}{:08X}{:08X}{:08X}:0050",
            0,
            0,
            0,
            u32::from_ne_bytes([0, 0, 0, 1])
        );
        assert_eq!(parse_end(&loopback6), Some("[::1]:80".parse().unwrap()));
        let mapped = format!(
            "{:08X}{:08X}{:08X}{:08X}:0050",
            0,
            0,
            u32::from_ne_bytes([0, 0, 0xff, 0xff]),
            u32::from_ne_bytes([127, 0, 0, 2])
        );
        assert_eq!(parse_end(&mapped), Some("127.0.0.2:80".parse().unwrap()));
        assert_eq!(parse_end("nonsense"), None);
        assert_eq!(parse_end("0100007F:ZZZZ"), None);
    }

    /// A certificate is named by its first URI name, else its first DNS
    /// name; one with neither is not named.
    #[test]
    fn a_certificate_is_named_by_its_uri_else_its_dns_name() {
        let named = |sans: Vec<rcgen::SanType>| {
            let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
            params.subject_alt_names = sans;
            let key = rcgen::KeyPair::generate().unwrap();
            let cert = params.self_signed(&key).unwrap();
            certificate_name(cert.der()).map(|name| name.to_string())
        };
        let uri = |text: &str| rcgen::SanType::URI(text.try_into().unwrap());
        let dns = |text: &str| rcgen::SanType::DnsName(text.try_into().unwrap());
        assert_eq!(
            named(vec![
                dns("trainer.team.svc"),
                uri("spiffe://cluster/ns/team/sa/trainer")
            ]),
            Some("spiffe://cluster/ns/team/sa/trainer".into())
        );
        assert_eq!(
            named(vec![dns("trainer.team.svc")]),
            Some("trainer.team.svc".into())
        );
        assert_eq!(named(Vec::new()), None);
        assert_eq!(certificate_name(&CertificateDer::from(vec![1, 2, 3])), None);
    }

    /// A real connection on this host: its caller is this process's user.
    #[test]
    fn a_connection_from_this_process_is_its_user() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let client = std::net::TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (accepted, peer) = listener.accept().unwrap();
        let caller = of_tcp(accepted.local_addr().unwrap(), peer);
        // SAFETY: getuid has no preconditions.
        let uid = unsafe { libc::getuid() };
        assert_eq!(
            caller,
            Caller::User {
                uid,
                transport: Transport::Tcp
            }
        );
        drop(client);
    }
}
