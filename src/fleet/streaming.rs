//! `Profile` with the reply's trace written to a file as it arrives: the
//! session fan-out's call. tonic holds a whole message before decoding it,
//! so a hundred hosts answering at once would be a hundred traces in
//! memory. Here the HTTP/2 body is read frame by frame: the gRPC message's
//! length prefix is checked against the reply limit before anything else,
//! the `ProfileResponse` is walked field by field, and its trace bytes go
//! to a [`TraceFile`] in batches of [`BATCH_BYTES`] written on the blocking
//! pool. A host holds one batch, plus what HTTP/2 flow control lets its
//! server send ahead. The file is committed only once the call's status
//! says OK.

use std::path::PathBuf;
use std::sync::Arc;

use bytes::{Buf, Bytes};
use http::header::{CONTENT_TYPE, TE};

use crate::protocol::caller::ON_BEHALF_OF_UID;
use http::HeaderMap;
use http_body_util::BodyExt;
use prost::Message;
use tonic::{Code, Status};
use tower_service::Service;

use crate::proto::tensorflow::ProfileRequest;
use crate::protocol::client::{CallError, Connection};
use crate::protocol::{RIEGELI_TOOL, XPLANE_TOOL};
use crate::repository::XPLANE_SUFFIX;
use crate::xspace::chunks::RIEGELI_SUFFIX;

/// Where a session's traces go (see `session`): one file per host, each
/// written as its reply arrives.
pub trait TraceSink: Send + Sync {
    /// Starts the file `file_name`; nothing appears under that name until
    /// it is committed.
    fn create(&self, file_name: &str) -> Result<Box<dyn TraceFile>, String>;
}

/// One host's trace file while it is written. Dropped uncommitted, it
/// leaves nothing behind.
pub trait TraceFile: Send {
    fn write(&mut self, bytes: &[u8]) -> Result<(), String>;
    /// Puts the file in place; where it is.
    fn commit(self: Box<Self>) -> Result<PathBuf, String>;
}

impl TraceFile for crate::repository::NewFile {
    fn write(&mut self, bytes: &[u8]) -> Result<(), String> {
        crate::repository::NewFile::write(self, bytes)
    }

    fn commit(self: Box<Self>) -> Result<PathBuf, String> {
        crate::repository::NewFile::commit(*self).map(PathBuf::from)
    }
}

/// Trace bytes gathered before each write to the file.
pub const BATCH_BYTES: usize = 256 << 10;

const PROFILE_PATH: &str = "/tensorflow.ProfilerService/Profile";

/// Longest `ProfileToolData.name` read; tool names are short.
const MAX_TOOL_NAME_BYTES: u64 = 4096;

// Field numbers of ProfileResponse and ProfileToolData.
const RESPONSE_TOOL_DATA: u64 = 6;
const RESPONSE_EMPTY_TRACE: u64 = 7;
const RESPONSE_XSPACE: u64 = 8;
const TOOL_NAME: u64 = 1;
const TOOL_DATA: u64 = 2;

// Protobuf wire types.
const VARINT: u64 = 0;
const FIXED64: u64 = 1;
const LENGTH_DELIMITED: u64 = 2;
const FIXED32: u64 = 5;

#[derive(Debug, thiserror::Error)]
pub enum ReceiveError {
    #[error(transparent)]
    Call(#[from] CallError),
    #[error("the call failed: {0}")]
    Transport(String),
    #[error("malformed reply: {0}")]
    Malformed(String),
    #[error("the reply ended early")]
    Truncated,
    #[error("writing the trace failed: {0}")]
    Write(String),
}

impl ReceiveError {
    /// A word or two for summaries that group hosts by what went wrong.
    pub fn kind(&self) -> &'static str {
        match self {
            ReceiveError::Call(CallError::TooLarge { .. }) => "reply too large",
            ReceiveError::Call(CallError::Status { .. }) => "refused by the server",
            ReceiveError::Transport(_) => "call failed",
            ReceiveError::Malformed(_) | ReceiveError::Truncated => "malformed reply",
            ReceiveError::Write(_) => "not written",
        }
    }
}

/// Calls `Profile` on `connection` and writes the trace of its reply
/// through `sink` as `<host>.xplane.pb`, or `<host>.xplane.riegeli` when it
/// comes as Riegeli chunks: where it landed, or `None` for an empty trace.
pub async fn profile_to_file(
    connection: &Connection,
    request: &ProfileRequest,
    sink: Arc<dyn TraceSink>,
    host: &str,
) -> Result<Option<PathBuf>, ReceiveError> {
    let body = grpc_frame(request);
    let mut call = http::Request::builder()
        .method(http::Method::POST)
        .uri(PROFILE_PATH)
        .header(CONTENT_TYPE, "application/grpc")
        .header(TE, "trailers");
    if let Some(uid) = connection.on_behalf_of_uid() {
        call = call.header(ON_BEHALF_OF_UID, uid.to_string());
    }
    let call = call
        .body(tonic::body::Body::new(http_body_util::Full::new(body)))
        .map_err(|e| ReceiveError::Transport(e.to_string()))?;
    let mut channel = connection.channel();
    let transport = |e: tonic::transport::Error| ReceiveError::Transport(describe(&e));
    std::future::poll_fn(|cx| channel.poll_ready(cx))
        .await
        .map_err(transport)?;
    let response = channel.call(call).await.map_err(transport)?;
    let (head, body) = response.into_parts();
    // An error before any message comes as headers alone.
    if let Some(status) = Status::from_header_map(&head.headers) {
        if status.code() != Code::Ok {
            return Err(connection.call_error(status).into());
        }
    }
    if head.status != http::StatusCode::OK {
        return Err(ReceiveError::Transport(format!(
            "HTTP status {}",
            head.status
        )));
    }
    let refused = |status| connection.call_error(status);
    let trace = read_reply(body, connection.max_reply_bytes(), sink, host, refused).await?;
    match trace {
        Some(file) => blocking(move || file.commit()).await.map(Some),
        None => Ok(None),
    }
}

/// Reads a reply's body: its trace written through `sink` as `host`'s
/// file, not yet committed, or `None` when the reply holds none or says it
/// is empty. A status other than OK in the trailers is turned into an error by
/// `refused`, whatever the body held.
pub(crate) async fn read_reply(
    body: tonic::body::Body,
    limit: usize,
    sink: Arc<dyn TraceSink>,
    host: &str,
    refused: impl Fn(Status) -> CallError,
) -> Result<Option<Box<dyn TraceFile>>, ReceiveError> {
    let mut reader = Reader::new(body);
    let mut trace = TraceOut::new(sink, host);
    let received = receive(&mut reader, limit, &mut trace).await;
    let status = match &received {
        Ok(_) => reader.status().await,
        Err(_) => Ok(reader.trailers.as_ref().and_then(Status::from_header_map)),
    };
    if let Ok(Some(status)) = &status {
        if status.code() != Code::Ok {
            return Err(refused(status.clone()).into());
        }
    }
    let empty = received?;
    status?.ok_or_else(|| ReceiveError::Malformed("no grpc-status in the trailers".into()))?;
    let file = trace.finish().await?;
    Ok(file.filter(|_| !empty))
}

/// `request` as one uncompressed gRPC message.
fn grpc_frame(request: &ProfileRequest) -> Bytes {
    let length = request.encoded_len();
    let mut message = Vec::with_capacity(5 + length);
    message.push(0);
    // A request is far below 4 GiB; the server refuses large ones anyway.
    message.extend_from_slice(&u32::try_from(length).unwrap_or(u32::MAX).to_be_bytes());
    request.encode_raw(&mut message);
    Bytes::from(message)
}

/// An error with its causes.
fn describe(error: &dyn std::error::Error) -> String {
    crate::protocol::client::with_causes(error.to_string(), error)
}

/// Runs `work` on the blocking pool: file system calls stay off the
/// threads that serve calls.
async fn blocking<T: Send + 'static>(
    work: impl FnOnce() -> Result<T, String> + Send + 'static,
) -> Result<T, ReceiveError> {
    tokio::task::spawn_blocking(work)
        .await
        .map_err(|e| ReceiveError::Write(e.to_string()))?
        .map_err(ReceiveError::Write)
}

/// The reply's message: its length checked, then walked. Whether the
/// server said the trace is empty.
async fn receive(
    reader: &mut Reader,
    limit: usize,
    trace: &mut TraceOut,
) -> Result<bool, ReceiveError> {
    let prefix = reader.small(5).await?;
    if prefix[0] != 0 {
        return Err(ReceiveError::Malformed(
            "the message is compressed, though none was asked for".into(),
        ));
    }
    let length = u64::from(u32::from_be_bytes([
        prefix[1], prefix[2], prefix[3], prefix[4],
    ]));
    if length > limit as u64 {
        return Err(CallError::TooLarge {
            found: format!("{length} bytes"),
            limit,
        }
        .into());
    }
    let end = reader.consumed + length;
    let mut empty = false;
    while reader.consumed < end {
        let (field, wire) = reader.tag().await?;
        match (field, wire) {
            (RESPONSE_TOOL_DATA, LENGTH_DELIMITED) => {
                let length = reader.length(end).await?;
                tool_data(reader, reader.consumed + length, trace).await?;
            }
            (RESPONSE_EMPTY_TRACE, VARINT) => empty = reader.varint().await? != 0,
            (RESPONSE_XSPACE, LENGTH_DELIMITED) => {
                let length = reader.length(end).await?;
                trace.take(reader, length, XPLANE_SUFFIX, false).await?;
            }
            _ => reader.skip_field(wire, end).await?,
        }
    }
    if reader.consumed != end {
        return Err(ReceiveError::Malformed(
            "a field runs past the message".into(),
        ));
    }
    Ok(empty)
}

/// One `ProfileToolData`: its data is the trace when it is named
/// `xplane.pb`, or `xplane.riegeli` for a trace too large for one XSpace
/// (which a devtrace agent sends as Riegeli chunks). Encoders write the
/// name first; data that comes before any name is kept as `xplane.pb` until
/// the name says otherwise.
async fn tool_data(
    reader: &mut Reader,
    end: u64,
    trace: &mut TraceOut,
) -> Result<(), ReceiveError> {
    let mut name: Option<Vec<u8>> = None;
    let mut tentative = false;
    // Why data that came before its name was not taken for the trace.
    let mut passed_over = None;
    while reader.consumed < end {
        let (field, wire) = reader.tag().await?;
        match (field, wire) {
            (TOOL_NAME, LENGTH_DELIMITED) => {
                let length = reader.length(end).await?;
                if length > MAX_TOOL_NAME_BYTES {
                    return Err(ReceiveError::Malformed(format!(
                        "a tool name of {length} bytes"
                    )));
                }
                name = Some(reader.small(length as usize).await?);
            }
            (TOOL_DATA, LENGTH_DELIMITED) => {
                let length = reader.length(end).await?;
                let suffix = match name.as_deref() {
                    None => Some(XPLANE_SUFFIX),
                    Some(name) if name == XPLANE_TOOL.as_bytes() => Some(XPLANE_SUFFIX),
                    Some(name) if name == RIEGELI_TOOL.as_bytes() => Some(RIEGELI_SUFFIX),
                    Some(_) => None,
                };
                if let Some(suffix) = suffix.filter(|_| trace.wants_more()) {
                    passed_over = trace.take(reader, length, suffix, name.is_none()).await?;
                    tentative = name.is_none() && !trace.wants_more();
                } else {
                    reader.skip(length).await?;
                }
            }
            _ => reader.skip_field(wire, end).await?,
        }
    }
    let named_trace = name.as_deref() == Some(XPLANE_TOOL.as_bytes());
    if tentative && !named_trace {
        trace.discard();
    }
    // It was the trace after all.
    if let (Some(why), true) = (passed_over, named_trace) {
        return Err(ReceiveError::Malformed(format!("its trace {why}")));
    }
    Ok(())
}

/// The trace file of one reply: made when the first trace byte arrives.
/// The first trace field of the reply is the trace; later ones are skipped.
struct TraceOut {
    sink: Arc<dyn TraceSink>,
    host: String,
    file: Option<Box<dyn TraceFile>>,
    batch: Vec<u8>,
}

impl TraceOut {
    fn new(sink: Arc<dyn TraceSink>, host: &str) -> TraceOut {
        TraceOut {
            sink,
            host: host.to_string(),
            file: None,
            batch: Vec::new(),
        }
    }

    fn wants_more(&self) -> bool {
        self.file.is_none()
    }

    /// Copies `length` bytes of the reader into the file, named for the
    /// host with `suffix` (what the trace is stored as), when they begin as
    /// a trace does; else it is an error, or, when `tentative` (data whose
    /// name has not come yet), they are passed over and why is returned.
    async fn take(
        &mut self,
        reader: &mut Reader,
        length: u64,
        suffix: &'static str,
        tentative: bool,
    ) -> Result<Option<String>, ReceiveError> {
        if !self.wants_more() {
            return reader.skip(length).await.map(|()| None);
        }
        // A peer's bytes are stored only when they begin as a trace does:
        // junk saved as a host's trace failed every tool later, as if the
        // agent were at fault.
        let head_length = length.min(crate::xspace::read::TRACE_HEAD_BYTES as u64);
        let mut head = Vec::with_capacity(BATCH_BYTES.min(length as usize));
        while (head.len() as u64) < head_length {
            let piece = reader.piece(head_length - head.len() as u64).await?;
            head.extend_from_slice(&piece);
        }
        if let Err(why) =
            crate::xspace::read::check_trace_head(&head, length, suffix == RIEGELI_SUFFIX)
        {
            // Data not yet named may be another tool's.
            if tentative {
                reader.skip(length - head_length).await?;
                return Ok(Some(why));
            }
            return Err(ReceiveError::Malformed(format!("its trace {why}")));
        }
        let (sink, name) = (Arc::clone(&self.sink), format!("{}{suffix}", self.host));
        self.file = Some(blocking(move || sink.create(&name)).await?);
        self.batch = head;
        let mut left = length - head_length;
        while left > 0 {
            let room = (BATCH_BYTES - self.batch.len()) as u64;
            let piece = reader.piece(left.min(room)).await?;
            left -= piece.len() as u64;
            self.batch.extend_from_slice(&piece);
            if self.batch.len() == BATCH_BYTES {
                self.flush().await?;
            }
        }
        Ok(None)
    }

    async fn flush(&mut self) -> Result<(), ReceiveError> {
        let Some(mut file) = self.file.take() else {
            return Ok(());
        };
        let batch = std::mem::take(&mut self.batch);
        let (file, mut batch) = blocking(move || {
            file.write(&batch)?;
            Ok((file, batch))
        })
        .await?;
        batch.clear();
        self.file = Some(file);
        self.batch = batch;
        Ok(())
    }

    /// Drops what was written: it was not the trace after all.
    fn discard(&mut self) {
        self.file = None;
        self.batch = Vec::new();
    }

    /// The file with everything written, ready to commit.
    async fn finish(mut self) -> Result<Option<Box<dyn TraceFile>>, ReceiveError> {
        self.flush().await?;
        Ok(self.file)
    }
}

/// The response body as a byte stream, counting what it has handed out.
struct Reader {
    body: tonic::body::Body,
    chunk: Bytes,
    /// Bytes of the body read so far.
    consumed: u64,
    trailers: Option<HeaderMap>,
}

impl Reader {
    fn new(body: tonic::body::Body) -> Reader {
        Reader {
            body,
            chunk: Bytes::new(),
            consumed: 0,
            trailers: None,
        }
    }

    /// Makes sure some bytes are at hand.
    async fn fill(&mut self) -> Result<(), ReceiveError> {
        while self.chunk.is_empty() {
            match self.body.frame().await {
                None => return Err(ReceiveError::Truncated),
                Some(Err(status)) => {
                    return Err(ReceiveError::Transport(describe(&status)));
                }
                Some(Ok(frame)) => match frame.into_data() {
                    Ok(data) => self.chunk = data,
                    Err(frame) => {
                        self.trailers = frame.into_trailers().ok();
                        return Err(ReceiveError::Truncated);
                    }
                },
            }
        }
        Ok(())
    }

    /// Up to `most` bytes, as they came.
    async fn piece(&mut self, most: u64) -> Result<Bytes, ReceiveError> {
        self.fill().await?;
        let take = self
            .chunk
            .len()
            .min(usize::try_from(most).unwrap_or(usize::MAX));
        self.consumed += take as u64;
        Ok(self.chunk.split_to(take))
    }

    /// Exactly `length` bytes; for short fields only.
    async fn small(&mut self, length: usize) -> Result<Vec<u8>, ReceiveError> {
        let mut bytes = Vec::with_capacity(length);
        while bytes.len() < length {
            let piece = self.piece((length - bytes.len()) as u64).await?;
            bytes.extend_from_slice(&piece);
        }
        Ok(bytes)
    }

    async fn skip(&mut self, mut length: u64) -> Result<(), ReceiveError> {
        while length > 0 {
            length -= self.piece(length).await?.len() as u64;
        }
        Ok(())
    }

    async fn varint(&mut self) -> Result<u64, ReceiveError> {
        let mut value = 0u64;
        for shift in (0..64).step_by(7) {
            self.fill().await?;
            let byte = self.chunk.get_u8();
            self.consumed += 1;
            value |= u64::from(byte & 0x7f) << shift;
            if byte & 0x80 == 0 {
                return Ok(value);
            }
        }
        Err(ReceiveError::Malformed(
            "a varint longer than 10 bytes".into(),
        ))
    }

    /// A field's number and wire type.
    async fn tag(&mut self) -> Result<(u64, u64), ReceiveError> {
        let key = self.varint().await?;
        Ok((key >> 3, key & 7))
    }

    /// A length prefix that must end by `end`.
    async fn length(&mut self, end: u64) -> Result<u64, ReceiveError> {
        let length = self.varint().await?;
        if length > end.saturating_sub(self.consumed) {
            return Err(ReceiveError::Malformed(
                "a field runs past its message".into(),
            ));
        }
        Ok(length)
    }

    async fn skip_field(&mut self, wire: u64, end: u64) -> Result<(), ReceiveError> {
        match wire {
            VARINT => self.varint().await.map(drop),
            FIXED64 => self.skip(8).await,
            FIXED32 => self.skip(4).await,
            LENGTH_DELIMITED => {
                let length = self.length(end).await?;
                self.skip(length).await
            }
            other => Err(ReceiveError::Malformed(format!("wire type {other}"))),
        }
    }

    /// The call's status from the trailers, once the body has no more
    /// data; a second message is refused.
    async fn status(&mut self) -> Result<Option<Status>, ReceiveError> {
        if !self.chunk.is_empty() {
            return Err(ReceiveError::Malformed("more than one message".into()));
        }
        while let Some(frame) = self.body.frame().await {
            let frame = frame.map_err(|status| ReceiveError::Transport(describe(&status)))?;
            match frame.into_data() {
                Ok(data) if data.is_empty() => {}
                Ok(_) => return Err(ReceiveError::Malformed("more than one message".into())),
                Err(frame) => self.trailers = frame.into_trailers().ok(),
            }
        }
        Ok(self.trailers.as_ref().and_then(Status::from_header_map))
    }
}

/// Stand-ins for a session's files and a server's reply body, for the
/// tests here and the fuzz target of replies.
#[cfg(test)]
pub(crate) mod stand_in {
    use super::*;
    use http_body::Frame;
    use parking_lot::Mutex;

    /// Files kept in memory (tests and fuzzing): what was committed, by name.
    #[derive(Default)]
    pub(crate) struct MemorySink {
        pub(crate) committed: Mutex<Vec<(String, Vec<u8>)>>,
    }

    struct MemoryFile {
        name: String,
        bytes: Vec<u8>,
        sink: Arc<MemorySink>,
    }

    impl TraceSink for Arc<MemorySink> {
        fn create(&self, file_name: &str) -> Result<Box<dyn TraceFile>, String> {
            Ok(Box::new(MemoryFile {
                name: file_name.to_string(),
                bytes: Vec::new(),
                sink: Arc::clone(self),
            }))
        }
    }

    impl TraceFile for MemoryFile {
        fn write(&mut self, bytes: &[u8]) -> Result<(), String> {
            self.bytes.extend_from_slice(bytes);
            Ok(())
        }

        fn commit(self: Box<Self>) -> Result<PathBuf, String> {
            let MemoryFile { name, bytes, sink } = *self;
            sink.committed.lock().push((name.clone(), bytes));
            Ok(PathBuf::from(name))
        }
    }

    /// `body` as a reply body arriving in pieces of `piece` bytes, ended by
    /// trailers with `status` (none when `None`).
    pub(crate) fn body_in_pieces(
        body: Vec<u8>,
        piece: usize,
        status: Option<Code>,
    ) -> tonic::body::Body {
        // Frames are cut as they are read, each a slice of one buffer, so
        // that the stand-in holds no more than the body.
        let body = Bytes::from(body);
        let piece = piece.max(1);
        let data = (0..body.len()).step_by(piece).map(move |at| {
            let end = (at + piece).min(body.len());
            Ok::<_, Status>(Frame::data(body.slice(at..end)))
        });
        let trailers = status.map(|code| {
            let mut trailers = HeaderMap::new();
            Status::new(code, "said the server")
                .add_header(&mut trailers)
                .expect("a status as headers");
            Ok(Frame::trailers(trailers))
        });
        let frames = tokio_stream::iter(data.chain(trailers));
        tonic::body::Body::new(http_body_util::StreamBody::new(frames))
    }
}

#[cfg(test)]
mod tests {
    use super::stand_in::{body_in_pieces, MemorySink};
    use super::*;
    use crate::protocol::client::RawToolData;

    fn framed(message: &[u8], flag: u8) -> Vec<u8> {
        let mut body = vec![flag];
        body.extend_from_slice(&(message.len() as u32).to_be_bytes());
        body.extend_from_slice(message);
        body
    }

    /// An encoded XSpace of one host, `name`: bytes that begin as a trace
    /// does.
    fn trace(name: &str) -> Vec<u8> {
        crate::proto::tensorflow::profiler::XSpace {
            hostnames: vec![name.into()],
            ..Default::default()
        }
        .encode_to_vec()
    }

    /// A Riegeli/records file of one chunk.
    fn chunks() -> Vec<u8> {
        let mut file = crate::xspace::riegeli::FileWriter::default();
        file.write_record(&trace("chunk")).expect("a chunk");
        file.into_bytes()
    }

    fn tool(name: &str, data: &[u8]) -> RawToolData {
        RawToolData {
            name: name.into(),
            data: Bytes::copy_from_slice(data),
        }
    }

    /// What a reply of `body` ending with `status` comes to (read 1, 7 and
    /// all bytes at a time, so that every field crosses frames): the
    /// committed trace, or the error.
    async fn received_with(
        body: Vec<u8>,
        limit: usize,
        status: Option<Code>,
    ) -> Result<Option<Vec<u8>>, String> {
        let mut outcomes = Vec::new();
        for piece in [1, 7, 1 << 30] {
            let sink = Arc::new(MemorySink::default());
            let refused = |status| CallError::Status { status, tls: false };
            let reply = body_in_pieces(body.clone(), piece, status);
            let outcome =
                match read_reply(reply, limit, Arc::new(Arc::clone(&sink)), "h", refused).await {
                    Err(e) => Err(e.to_string()),
                    Ok(file) => {
                        if let Some(file) = file {
                            file.commit()?;
                        }
                        Ok(sink.committed.lock().pop().map(|(_, bytes)| bytes))
                    }
                };
            assert!(
                outcome.is_ok() || sink.committed.lock().is_empty(),
                "a failed reply left a file"
            );
            outcomes.push(outcome);
        }
        assert!(outcomes.windows(2).all(|w| w[0] == w[1]), "{outcomes:?}");
        outcomes.remove(0)
    }

    async fn received(body: Vec<u8>, limit: usize) -> Result<Option<Vec<u8>>, String> {
        received_with(body, limit, Some(Code::Ok)).await
    }

    fn reply(tool_data: Vec<RawToolData>, xspace: Option<&[u8]>, empty: bool) -> Vec<u8> {
        crate::protocol::client::RawProfileResponse {
            tool_data,
            empty_trace: empty,
            xspace: xspace.map(Bytes::copy_from_slice),
        }
        .encode_to_vec()
    }

    #[tokio::test]
    async fn the_first_trace_field_of_a_reply_is_its_trace() {
        let big = trace(&"b".repeat(BATCH_BYTES * 2 + 17));
        let only_xspace = reply(vec![], Some(&big), false);
        assert_eq!(
            received(framed(&only_xspace, 0), 1 << 30).await,
            Ok(Some(big.clone()))
        );
        // Tool data first (field 6 before 8), as TensorFlow's servers send
        // both: the tool data is the trace, the xspace is skipped.
        let both = reply(
            vec![
                tool("trace_viewer", b"json"),
                tool("xplane.pb", &trace("first")),
            ],
            Some(&trace("second")),
            false,
        );
        assert_eq!(
            received(framed(&both, 0), 1 << 20).await,
            Ok(Some(trace("first")))
        );
        let other_tools_only = reply(vec![tool("trace_viewer", b"json")], None, false);
        assert_eq!(
            received(framed(&other_tools_only, 0), 1 << 20).await,
            Ok(None)
        );
        let empty = reply(vec![], Some(&trace("ignored")), true);
        assert_eq!(received(framed(&empty, 0), 1 << 20).await, Ok(None));
    }

    #[tokio::test]
    async fn a_chunked_trace_is_written_as_riegeli() {
        let chunked = reply(
            vec![tool("trace_viewer", b"json"), tool(RIEGELI_TOOL, &chunks())],
            None,
            false,
        );
        assert_eq!(
            received(framed(&chunked, 0), 1 << 20).await,
            Ok(Some(chunks()))
        );
        let sink = Arc::new(MemorySink::default());
        let refused = |status| CallError::Status { status, tls: false };
        let body = body_in_pieces(framed(&chunked, 0), 3, Some(Code::Ok));
        let file = read_reply(body, 1 << 20, Arc::new(Arc::clone(&sink)), "h_1", refused)
            .await
            .expect("a good reply");
        file.expect("a trace").commit().expect("committed");
        let names: Vec<String> = sink
            .committed
            .lock()
            .iter()
            .map(|(n, _)| n.clone())
            .collect();
        assert_eq!(names, vec![format!("h_1{RIEGELI_SUFFIX}")]);
    }

    #[tokio::test]
    async fn tool_data_before_its_name_is_kept_only_when_the_name_says_trace() {
        // ProfileToolData { data: "not it", name: "memory_viewer" } (fields
        // in reverse order), then an xspace.
        let mut reversed = Vec::new();
        prost::encoding::bytes::encode(2, &b"not it".to_vec(), &mut reversed);
        prost::encoding::string::encode(1, &"memory_viewer".to_string(), &mut reversed);
        let mut message = Vec::new();
        prost::encoding::bytes::encode(6, &reversed, &mut message);
        prost::encoding::bytes::encode(8, &trace("the trace"), &mut message);
        assert_eq!(
            received(framed(&message, 0), 1 << 20).await,
            Ok(Some(trace("the trace")))
        );
        let mut named_late = Vec::new();
        prost::encoding::bytes::encode(2, &trace("late name"), &mut named_late);
        prost::encoding::string::encode(1, &XPLANE_TOOL.to_string(), &mut named_late);
        let mut message = Vec::new();
        prost::encoding::bytes::encode(6, &named_late, &mut message);
        assert_eq!(
            received(framed(&message, 0), 1 << 20).await,
            Ok(Some(trace("late name")))
        );
        // Passed over for not beginning as a trace, then named the trace:
        // said, not taken for a reply without one.
        let mut junk_named_late = Vec::new();
        prost::encoding::bytes::encode(2, &b"\0junk".to_vec(), &mut junk_named_late);
        prost::encoding::string::encode(1, &XPLANE_TOOL.to_string(), &mut junk_named_late);
        let mut message = Vec::new();
        prost::encoding::bytes::encode(6, &junk_named_late, &mut message);
        let error = received(framed(&message, 0), 1 << 20).await.unwrap_err();
        assert!(
            error.starts_with("malformed reply: its trace (xplane.pb) does not begin"),
            "{error}"
        );
    }

    #[tokio::test]
    async fn a_reply_over_the_limit_is_refused_from_its_length_alone() {
        // Only the prefix arrives: the refusal cannot have read the body.
        let prefix = framed(&[], 0)[..1]
            .iter()
            .copied()
            .chain(600_000_000u32.to_be_bytes())
            .collect();
        let error = received(prefix, 512 << 20).await.unwrap_err();
        assert_eq!(
            error,
            "reply refused: 600000000 bytes is more than --max-reply-size allows (536870912 bytes)"
        );
    }

    #[tokio::test]
    async fn the_status_in_the_trailers_decides() {
        let good = framed(&reply(vec![], Some(&trace("trace")), false), 0);
        let error = received_with(good.clone(), 1 << 20, Some(Code::ResourceExhausted))
            .await
            .unwrap_err();
        assert_eq!(error, "Some resource has been exhausted: said the server");
        let error = received_with(good, 1 << 20, None).await.unwrap_err();
        assert_eq!(error, "malformed reply: no grpc-status in the trailers");
        // A status that ends the reply early is what is reported.
        let cut = framed(&reply(vec![], Some(&trace("trace")), false), 0)[..9].to_vec();
        let error = received_with(cut, 1 << 20, Some(Code::Internal))
            .await
            .unwrap_err();
        assert_eq!(error, "Internal error: said the server");
        let two = [framed(b"", 0), framed(b"", 0)].concat();
        let error = received(two, 1 << 20).await.unwrap_err();
        assert_eq!(error, "malformed reply: more than one message");
    }

    #[tokio::test]
    async fn malformed_replies_are_named_and_leave_no_file() {
        let good = reply(vec![], Some(&trace("trace")), false);
        let cases: Vec<(Vec<u8>, &str)> = vec![
            (
                framed(&good, 1),
                "malformed reply: the message is compressed",
            ),
            (framed(&good, 0)[..10].to_vec(), "the reply ended early"),
            (
                // xspace of 100 bytes in a message of 10.
                framed(&[0x42, 100, 1, 2, 3, 4, 5, 6, 7, 8], 0),
                "malformed reply: a field runs past its message",
            ),
            (framed(&[0x0b], 0), "malformed reply: wire type 3"),
            (
                framed(&reply(vec![tool(RIEGELI_TOOL, b"\0junk")], None, false), 0),
                "malformed reply: its trace is said to be Riegeli chunks",
            ),
            (
                framed(&reply(vec![tool(XPLANE_TOOL, b"\0junk")], None, false), 0),
                "malformed reply: its trace (xplane.pb) does not begin with a protobuf field",
            ),
            (
                // empty_trace with a value of 11 continued bytes.
                framed(
                    &[
                        0x38, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 1,
                    ],
                    0,
                ),
                "malformed reply: a varint longer than 10 bytes",
            ),
        ];
        for (body, expected) in cases {
            let error = received(body, 1 << 20).await.unwrap_err();
            assert!(error.starts_with(expected), "{error} (expected {expected})");
        }
    }
}
