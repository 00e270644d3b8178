//! Accepting connections within bounds, for every listener of the agent
//! (gRPC over TCP and a UNIX socket, the metrics endpoint, the taps, with
//! bounds of their own): at most
//! so many connections at once, and so many from one peer (an address, or a
//! uid on a UNIX socket). A connection past either bound is closed as soon
//! as it is accepted, and counted, never left waiting in the backlog: a
//! peer that holds connections open cannot make others' (health probes
//! among them) wait behind it, and a connection that sends nothing within
//! [`FIRST_BYTES_DEADLINE`] is closed, so that silent ones do not keep their
//! places. Running out of file descriptors is waited out ([`FD_PAUSE`])
//! instead of retried at once, which would spin a core, or passed on, which
//! would end the server. Each connection carries a [`Closer`] in what tonic
//! tells its calls ([`ConnectionInfo`]), by which a reply its peer stops
//! reading gives the connection up.
//!
//! The bounds are per address: a peer with many addresses (any local user
//! has all of 127.0.0.0/8) can still fill a listener's total, each of its
//! connections having to speak within the deadline to keep its place.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream, UnixListener, UnixStream};
use tokio::sync::mpsc;
use tokio::time::Sleep;
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::server::Connected;
use tracing::warn;

use super::caller::{self, Caller, Transport};
pub use super::shares::Peer;
use super::shares::{Over, Shares};

/// Checks `text` as an address to listen on, `HOST:PORT` (`[V6]:PORT`
/// for IPv6), before anything binds it: a mistyped one is refused as the
/// flags are read, not once the agent has started.
pub fn check_listen_address(text: &str) -> Result<(), String> {
    let shape = "an address such as 127.0.0.1:6009, 0.0.0.0:6009 or [::1]:6009";
    if text.chars().any(char::is_whitespace) {
        return Err(format!("{text:?} holds spaces: {shape}"));
    }
    let Some((host, port)) = text.rsplit_once(':') else {
        return Err(format!("{text:?} has no port: {shape}"));
    };
    if port.parse::<u16>().is_err() {
        return Err(format!("{text:?}: {port:?} is not a port (0 to 65535)"));
    }
    let bare = host.strip_prefix('[').and_then(|h| h.strip_suffix(']'));
    let valid_host = match bare {
        Some(v6) => v6.parse::<std::net::Ipv6Addr>().is_ok(),
        None => !host.is_empty() && !host.contains(['[', ']', ':', '/']),
    };
    if !valid_host {
        return Err(format!("{text:?}: {host:?} is not a host: {shape}"));
    }
    Ok(())
}

/// How long accepting pauses when the process is out of file descriptors
/// (or the kernel of memory for sockets): long enough for connections to
/// close, short enough not to be noticed.
pub const FD_PAUSE: Duration = Duration::from_millis(100);

/// How long accepting pauses after another error of the listener itself.
const ERROR_PAUSE: Duration = Duration::from_millis(10);

/// How long a connection may stay silent after it is accepted.
pub const FIRST_BYTES_DEADLINE: Duration = Duration::from_secs(10);

/// The bounds of one listener.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    /// Connections open at once.
    pub total: usize,
    /// Connections open at once from one peer.
    pub per_peer: usize,
}

/// Why a connection was closed at once.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Refusal {
    /// The listener has [`Limits::total`] open.
    Full,
    /// Its peer has [`Limits::per_peer`] open.
    PeerFull,
}

/// What a gate has done, for metrics.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct GateCounts {
    pub open: usize,
    pub accepted: u64,
    pub refused_full: u64,
    pub refused_peer: u64,
    pub accept_errors: u64,
}

/// The bounds of one listener and the connections it holds.
#[derive(Debug)]
pub struct Gate {
    limits: Limits,
    /// Connections open, one each.
    open: Shares,
    accepted: AtomicU64,
    refused_full: AtomicU64,
    refused_peer: AtomicU64,
    accept_errors: AtomicU64,
}

impl Gate {
    pub fn new(limits: Limits) -> Arc<Gate> {
        Arc::new(Gate {
            limits,
            open: Shares::new(limits.total, limits.per_peer),
            accepted: AtomicU64::new(0),
            refused_full: AtomicU64::new(0),
            refused_peer: AtomicU64::new(0),
            accept_errors: AtomicU64::new(0),
        })
    }

    pub fn limits(&self) -> Limits {
        self.limits
    }

    /// Admits a connection from `peer`, held until the admission is
    /// dropped; or why not (counted).
    pub fn admit(self: &Arc<Self>, peer: Peer) -> Result<Admission, Refusal> {
        match self.open.take(peer, 1) {
            Err(Over::All) => {
                self.refused_full.fetch_add(1, Relaxed);
                return Err(Refusal::Full);
            }
            Err(Over::Peer) => {
                self.refused_peer.fetch_add(1, Relaxed);
                return Err(Refusal::PeerFull);
            }
            Ok(()) => {}
        }
        self.accepted.fetch_add(1, Relaxed);
        Ok(Admission {
            gate: Arc::clone(self),
            peer,
        })
    }

    pub fn counts(&self) -> GateCounts {
        GateCounts {
            open: self.open.held(),
            accepted: self.accepted.load(Relaxed),
            refused_full: self.refused_full.load(Relaxed),
            refused_peer: self.refused_peer.load(Relaxed),
            accept_errors: self.accept_errors.load(Relaxed),
        }
    }

    /// Waits out an accept error: longer when descriptors ran out, not at
    /// all when only the connection being accepted failed.
    async fn pause_after(&self, error: &io::Error, listener: &str) {
        if matches!(
            error.kind(),
            io::ErrorKind::ConnectionAborted
                | io::ErrorKind::ConnectionReset
                | io::ErrorKind::Interrupted
                | io::ErrorKind::WouldBlock
        ) {
            return;
        }
        let errors = self.accept_errors.fetch_add(1, Relaxed) + 1;
        let out_of_descriptors = matches!(
            error.raw_os_error(),
            Some(libc::EMFILE | libc::ENFILE | libc::ENOBUFS | libc::ENOMEM)
        );
        // The first, then one in a thousand: a lasting shortage must not
        // flood the log.
        if errors == 1 || errors.is_multiple_of(1000) {
            warn!(listener, %error, errors, "accepting a connection failed; pausing");
        }
        tokio::time::sleep(if out_of_descriptors {
            FD_PAUSE
        } else {
            ERROR_PAUSE
        })
        .await;
    }
}

/// A connection's place in its gate, given back when dropped.
#[derive(Debug)]
pub struct Admission {
    gate: Arc<Gate>,
    peer: Peer,
}

impl Drop for Admission {
    fn drop(&mut self) {
        self.gate.open.give_back(self.peer, 1);
    }
}

/// An accepted connection holding its place in its gate.
#[derive(Debug)]
pub struct Admitted<IO> {
    io: IO,
    admission: Admission,
    /// Until its first bytes arrive: when it is closed if they do not.
    silent_until: Option<Pin<Box<Sleep>>>,
    closer: Closer,
    /// Who is calling, named once the connection is admitted.
    caller: Caller,
    /// Once its side is shut: until when what the peer still sends is read
    /// and dropped ([`LINGER_LIMIT`]), and how much of it was.
    lingering: Option<Lingering>,
}

/// A connection waiting for its peer to close, within bounds.
#[derive(Debug)]
struct Lingering {
    /// Ends the wait, and wakes the connection then when the peer sends
    /// nothing.
    timer: Pin<Box<Sleep>>,
    dropped: usize,
}

/// How long a connection the server is done with is kept open, reading and
/// dropping what the peer still sends, so that closing it does not reset
/// it: a socket closed with unread bytes (the peer's flow-control updates
/// while it reads a long reply) sends a reset, and the peer then loses the
/// end of the reply it had not read yet, as every capture in flight did
/// now and then when the agent was stopped. A peer closes its side as soon
/// as it has read the reply.
pub const LINGER_LIMIT: Duration = Duration::from_secs(5);

/// The most a lingering connection reads and drops: a peer that keeps
/// sending is not waited for.
const LINGER_MAX_BYTES: usize = 1 << 20;

impl<IO> Admitted<IO> {
    fn new(io: IO, admission: Admission, first_bytes: Option<Duration>) -> Admitted<IO> {
        Admitted {
            io,
            admission,
            silent_until: first_bytes.map(|deadline| Box::pin(tokio::time::sleep(deadline))),
            closer: Closer::default(),
            caller: Caller::Unknown,
            lingering: None,
        }
    }
}

/// Closes the connection it came with, from outside the server: its next
/// read fails, which ends the connection and every call on it. How a reply
/// the peer stops reading is given up on (the server would otherwise wait
/// on the peer's flow control for as long as it liked).
#[derive(Clone, Debug, Default)]
pub struct Closer(Arc<CloserState>);

#[derive(Debug, Default)]
struct CloserState {
    closed: std::sync::atomic::AtomicBool,
    /// The task polling the connection, woken to see it closed.
    reader: parking_lot::Mutex<Option<std::task::Waker>>,
}

impl Closer {
    fn is_closed(&self) -> bool {
        self.0.closed.load(std::sync::atomic::Ordering::Acquire)
    }

    pub fn close(&self) {
        self.0
            .closed
            .store(true, std::sync::atomic::Ordering::Release);
        if let Some(reader) = self.0.reader.lock().take() {
            reader.wake();
        }
    }

    /// An error once closed; until then, has the task polling the
    /// connection woken when it is.
    fn check(&self, cx: &Context<'_>) -> io::Result<()> {
        if self.0.closed.load(std::sync::atomic::Ordering::Acquire) {
            return Err(io::Error::new(
                io::ErrorKind::ConnectionAborted,
                "closed by the agent: a reply on it was not read within its deadline",
            ));
        }
        let mut reader = self.0.reader.lock();
        if !reader.as_ref().is_some_and(|w| w.will_wake(cx.waker())) {
            *reader = Some(cx.waker().clone());
        }
        Ok(())
    }
}

/// What tonic tells a call about its connection: the peer the listener
/// admitted it as (the same that its bounds count), who is calling
/// ([`crate::protocol::caller`]), and the connection's [`Closer`].
#[derive(Clone, Debug)]
pub struct ConnectionInfo {
    pub peer: Peer,
    pub caller: Caller,
    pub closer: Closer,
}

/// The connection a call came on, from the call's extensions (plaintext or
/// TLS, TCP or the UNIX socket); none for a stream a listener did not
/// admit.
pub fn connection_of(extensions: &http::Extensions) -> Option<&ConnectionInfo> {
    use tonic::transport::server::TlsConnectInfo;
    extensions.get::<ConnectionInfo>().or_else(|| {
        extensions
            .get::<TlsConnectInfo<ConnectionInfo>>()
            .map(TlsConnectInfo::get_ref)
    })
}

/// The caller `request` counts as: who is on its connection
/// ([`caller_of`]), or the local user an agent of this host named as the
/// one it calls for ([`caller::ON_BEHALF_OF_UID`]); `INVALID_ARGUMENT`
/// when root or the agent's user names no user there.
pub fn caller_of_request<T>(request: &tonic::Request<T>) -> Result<Caller, tonic::Status> {
    let named = request
        .metadata()
        .get(caller::ON_BEHALF_OF_UID)
        .map(|value| value.as_bytes());
    caller_of(request.extensions())
        .acting_for(named)
        .map_err(|refused| tonic::Status::invalid_argument(refused.to_string()))
}

/// Who is calling, from a call's extensions: a local user as the kernel
/// named it; a peer on another host by its verified client certificate when
/// it presented one, else by its address; unknown on a stream no listener
/// admitted.
pub fn caller_of(extensions: &http::Extensions) -> Caller {
    use tonic::transport::server::TlsConnectInfo;
    let Some(connection) = connection_of(extensions) else {
        return Caller::Unknown;
    };
    if let Caller::Remote(_) = connection.caller {
        let named = extensions
            .get::<TlsConnectInfo<ConnectionInfo>>()
            .and_then(TlsConnectInfo::peer_certs)
            .and_then(|certificates| caller::certificate_name(certificates.first()?));
        if let Some(name) = named {
            return Caller::Certificate(name);
        }
    }
    connection.caller.clone()
}

impl<IO> Admitted<IO> {
    pub fn into_parts(self) -> (IO, Admission) {
        (self.io, self.admission)
    }
}

impl<IO: AsyncRead + Unpin> AsyncRead for Admitted<IO> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        let this = &mut *self;
        this.closer.check(cx)?;
        match Pin::new(&mut this.io).poll_read(cx, buf) {
            Poll::Ready(Ok(())) => {
                if buf.filled().len() > before {
                    this.silent_until = None;
                }
                Poll::Ready(Ok(()))
            }
            Poll::Pending => {
                let expired = this
                    .silent_until
                    .as_mut()
                    .is_some_and(|deadline| deadline.as_mut().poll(cx).is_ready());
                if expired {
                    return Poll::Ready(Err(io::Error::new(
                        io::ErrorKind::TimedOut,
                        "the peer sent nothing within its deadline",
                    )));
                }
                Poll::Pending
            }
            other => other,
        }
    }
}

impl<IO: AsyncRead + AsyncWrite + Unpin> AsyncWrite for Admitted<IO> {
    // A connection stuck writing to a peer that reads nothing is closed
    // here, as a reading one is in `poll_read`.
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        self.closer.check(cx)?;
        Pin::new(&mut self.io).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        self.closer.check(cx)?;
        Pin::new(&mut self.io).poll_flush(cx)
    }

    /// Shuts this side, then lingers ([`LINGER_LIMIT`]) until the peer
    /// closes its own.
    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = &mut *self;
        if this.lingering.is_none() {
            std::task::ready!(Pin::new(&mut this.io).poll_shutdown(cx))?;
        }
        let lingering = this.lingering.get_or_insert_with(|| Lingering {
            timer: Box::pin(tokio::time::sleep(LINGER_LIMIT)),
            dropped: 0,
        });
        let mut scratch = [0u8; 4096];
        // The bounds are looked at before each read: reads that keep
        // succeeding never reach the timer.
        while !this.closer.is_closed()
            && lingering.dropped < LINGER_MAX_BYTES
            && tokio::time::Instant::now() < lingering.timer.deadline()
        {
            let mut buf = ReadBuf::new(&mut scratch);
            match Pin::new(&mut this.io).poll_read(cx, &mut buf) {
                Poll::Ready(Ok(())) if !buf.filled().is_empty() => {
                    lingering.dropped += buf.filled().len();
                }
                // The peer closed (or reset) its side: nothing is left to lose.
                Poll::Ready(_) => return Poll::Ready(Ok(())),
                Poll::Pending => {
                    if lingering.timer.as_mut().poll(cx).is_ready() {
                        return Poll::Ready(Ok(()));
                    }
                    return Poll::Pending;
                }
            }
        }
        Poll::Ready(Ok(()))
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        self.closer.check(cx)?;
        Pin::new(&mut self.io).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }
}

/// tonic hands every call on the connection who it came from and its
/// [`Closer`].
impl<IO> Connected for Admitted<IO> {
    type ConnectInfo = ConnectionInfo;

    fn connect_info(&self) -> Self::ConnectInfo {
        ConnectionInfo {
            peer: self.admission.peer,
            caller: self.caller.clone(),
            closer: self.closer.clone(),
        }
    }
}

/// Accepts from `accept` (a connection and who it comes from) until `gate`
/// admits one; a refused one is dropped, so closed at once.
async fn admitted<IO, F, A>(
    gate: &Arc<Gate>,
    name: &str,
    first_bytes: Option<Duration>,
    mut accept: F,
) -> Admitted<IO>
where
    F: FnMut() -> A,
    A: Future<Output = io::Result<(IO, Peer, Option<Caller>)>>,
{
    loop {
        match accept().await {
            Ok((stream, peer, caller)) => {
                if let Ok(admission) = gate.admit(peer) {
                    let mut admitted = Admitted::new(stream, admission, first_bytes);
                    if let Some(caller) = caller {
                        admitted.caller = caller;
                    }
                    return admitted;
                }
            }
            Err(error) => gate.pause_after(&error, name).await,
        }
    }
}

/// Accepts the next connection `gate` admits from a TCP listener, with
/// TCP_NODELAY set (small replies must not wait on Nagle's algorithm), and
/// names its caller. A peer on this host (loopback, or this end's own
/// address) is named first and bounded as its user, as over the UNIX
/// socket (else one local user's connections would use up the place every
/// local caller shares, 127.0.0.1's); another is bounded by its address
/// and named after admission, so that a refused connection from elsewhere
/// costs no look at the socket tables.
pub async fn accept_tcp(
    listener: &TcpListener,
    gate: &Arc<Gate>,
    name: &str,
    first_bytes: Option<Duration>,
) -> Admitted<TcpStream> {
    let mut admitted = admitted(gate, name, first_bytes, || async {
        let (stream, address) = listener.accept().await?;
        let _ = stream.set_nodelay(true);
        let ip = address.ip().to_canonical();
        let this_host = ip.is_loopback()
            || stream
                .local_addr()
                .is_ok_and(|local| local.ip().to_canonical() == ip);
        if !this_host {
            return Ok((stream, Peer::Address(ip), None));
        }
        let caller = tcp_caller(&stream).await;
        let peer = match caller {
            Caller::User { uid, .. } => Peer::User(uid),
            _ => Peer::Address(ip),
        };
        Ok((stream, peer, Some(caller)))
    })
    .await;
    if admitted.caller == Caller::Unknown {
        admitted.caller = tcp_caller(&admitted.io).await;
    }
    admitted
}

/// Who is calling on `stream`: the local user owning its other end, else
/// its address.
async fn tcp_caller(stream: &TcpStream) -> Caller {
    let (Ok(local), Ok(peer)) = (stream.local_addr(), stream.peer_addr()) else {
        return Caller::Unknown;
    };
    tokio::task::spawn_blocking(move || caller::of_tcp(local, peer))
        .await
        .unwrap_or(Caller::Unknown)
}

/// Accepts the next connection `gate` admits from a UNIX listener, bounded
/// per uid.
pub async fn accept_unix(
    listener: &UnixListener,
    gate: &Arc<Gate>,
    name: &str,
    first_bytes: Option<Duration>,
) -> Admitted<UnixStream> {
    let mut admitted = admitted(gate, name, first_bytes, || async {
        let (stream, _) = listener.accept().await?;
        let peer = stream
            .peer_cred()
            .map_or(Peer::Unknown, |credentials| Peer::User(credentials.uid()));
        Ok((stream, peer, None))
    })
    .await;
    if let Peer::User(uid) = admitted.admission.peer {
        admitted.caller = Caller::User {
            uid,
            transport: Transport::UnixSocket,
        };
    }
    admitted
}

/// The connections a listener admits, as a stream for a server to serve;
/// accepting stops when the stream is dropped.
pub fn incoming<IO, A>(accept: A) -> ReceiverStream<Result<Admitted<IO>, io::Error>>
where
    IO: Send + 'static,
    A: FnMut() -> Pin<Box<dyn Future<Output = Admitted<IO>> + Send>> + Send + 'static,
{
    let (sender, receiver) = mpsc::channel(1);
    let mut accept = accept;
    tokio::spawn(async move {
        loop {
            let admitted = tokio::select! {
                _ = sender.closed() => return,
                admitted = accept() => admitted,
            };
            if sender.send(Ok(admitted)).await.is_err() {
                return;
            }
        }
    });
    ReceiverStream::new(receiver)
}

/// [`incoming`] of a TCP listener, whose connections must speak within
/// [`FIRST_BYTES_DEADLINE`].
pub fn tcp_incoming(
    listener: TcpListener,
    gate: Arc<Gate>,
    name: &'static str,
) -> ReceiverStream<Result<Admitted<TcpStream>, io::Error>> {
    let listener = Arc::new(listener);
    incoming(move || {
        let (listener, gate) = (Arc::clone(&listener), Arc::clone(&gate));
        Box::pin(
            async move { accept_tcp(&listener, &gate, name, Some(FIRST_BYTES_DEADLINE)).await },
        )
    })
}

/// [`incoming`] of a UNIX listener, as [`tcp_incoming`].
pub fn unix_incoming(
    listener: UnixListener,
    gate: Arc<Gate>,
    name: &'static str,
) -> ReceiverStream<Result<Admitted<UnixStream>, io::Error>> {
    let listener = Arc::new(listener);
    incoming(move || {
        let (listener, gate) = (Arc::clone(&listener), Arc::clone(&gate));
        Box::pin(
            async move { accept_unix(&listener, &gate, name, Some(FIRST_BYTES_DEADLINE)).await },
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn listen_addresses_are_checked_before_anything_binds_them() {
        for good in [
            "127.0.0.1:6009",
            "0.0.0.0:0",
            "[::1]:6009",
            "[::]:80",
            "localhost:6009",
        ] {
            assert_eq!(check_listen_address(good), Ok(()), "{good}");
        }
        for (bad, said) in [
            ("bogus", "has no port"),
            (" 127.0.0.1:1 ", "holds spaces"),
            ("127.0.0.1:99999", "is not a port"),
            (":6009", "is not a host"),
            ("::1:6009", "is not a host"),
            ("[::1:6009", "is not a host"),
            ("[nothost]:1", "is not a host"),
        ] {
            let error = check_listen_address(bad).unwrap_err();
            assert!(error.contains(said), "{bad}: {error}");
        }
    }

    fn address(last: u8) -> Peer {
        Peer::Address(std::net::IpAddr::from([127, 0, 0, last]))
    }

    #[test]
    fn a_peer_is_bounded_alone_and_all_peers_together() {
        let gate = Gate::new(Limits {
            total: 3,
            per_peer: 2,
        });
        let first = gate.admit(address(1)).unwrap();
        let _second = gate.admit(address(1)).unwrap();
        assert_eq!(gate.admit(address(1)).unwrap_err(), Refusal::PeerFull);
        let _other = gate.admit(address(2)).unwrap();
        assert_eq!(gate.admit(address(3)).unwrap_err(), Refusal::Full);
        drop(first);
        let _again = gate.admit(address(1)).unwrap();
        let counts = gate.counts();
        assert_eq!(
            (
                counts.open,
                counts.accepted,
                counts.refused_peer,
                counts.refused_full
            ),
            (3, 4, 1, 1)
        );
    }

    #[test]
    fn places_are_given_back_when_connections_close() {
        let gate = Gate::new(Limits {
            total: 1,
            per_peer: 1,
        });
        for _ in 0..3 {
            let admission = gate.admit(Peer::User(1000)).unwrap();
            drop(admission);
        }
        assert_eq!(gate.counts().open, 0);
        assert_eq!(gate.open.peers(), 0);
    }

    #[tokio::test]
    async fn connections_past_a_peers_bound_are_closed_at_once() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = listener.local_addr().unwrap();
        let gate = Gate::new(Limits {
            total: 8,
            per_peer: 1,
        });
        let mut admitted = tcp_incoming(listener, Arc::clone(&gate), "test");
        let _held = TcpStream::connect(address).await.unwrap();
        let first = tokio_stream::StreamExt::next(&mut admitted).await;
        assert!(matches!(first, Some(Ok(_))));
        // The second from the same address is accepted and closed: its
        // read sees the end at once rather than hanging.
        let mut refused = TcpStream::connect(address).await.unwrap();
        let mut byte = [0u8; 1];
        let read = tokio::time::timeout(
            Duration::from_secs(10),
            tokio::io::AsyncReadExt::read(&mut refused, &mut byte),
        )
        .await
        .expect("closed, not left waiting");
        assert!(matches!(read, Ok(0) | Err(_)));
        assert_eq!(gate.counts().refused_peer, 1);
    }

    #[tokio::test]
    async fn a_connection_tells_its_calls_its_peer_and_is_closed_by_its_closer() {
        use tokio::io::AsyncReadExt;
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let bound = listener.local_addr().unwrap();
        let gate = Gate::new(Limits {
            total: 8,
            per_peer: 8,
        });
        let mut admitted = tcp_incoming(listener, gate, "test");
        let _client = TcpStream::connect(bound).await.unwrap();
        let mut connection = tokio_stream::StreamExt::next(&mut admitted)
            .await
            .unwrap()
            .unwrap();
        let mut extensions = http::Extensions::new();
        extensions.insert(connection.connect_info());
        let info = connection_of(&extensions).expect("the connection");
        // A loopback peer is known by its user, as the socket tables name it.
        // SAFETY: geteuid has no preconditions.
        let uid = unsafe { libc::geteuid() };
        assert_eq!(info.peer, Peer::User(uid));
        // Closed from outside while its reader waits: the read fails.
        let closer = info.closer.clone();
        let reading = tokio::spawn(async move {
            let mut byte = [0u8; 1];
            connection.read(&mut byte).await
        });
        tokio::time::sleep(Duration::from_millis(20)).await;
        closer.close();
        let read = tokio::time::timeout(Duration::from_secs(10), reading)
            .await
            .expect("woken, not left waiting")
            .unwrap();
        assert_eq!(read.unwrap_err().kind(), io::ErrorKind::ConnectionAborted);
    }
}
