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
use http::HeaderMap;
use http_body_util::BodyExt;
use prost::Message;
use tonic::{Code, Status};
use tower_service::Service;

use crate::client::{CallError, Connection};
use crate::proto::tensorflow::ProfileRequest;
use crate::service::profiler::XPLANE_TOOL;
use crate::session::{TraceFile, TraceSink};

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

/// Calls `Profile` on `connection` and writes the trace of its reply as
/// `file_name` through `sink`: where it landed, or `None` for an empty trace.
pub async fn profile_to_file(
    connection: &Connection,
    request: &ProfileRequest,
    sink: Arc<dyn TraceSink>,
    file_name: &str,
) -> Result<Option<PathBuf>, ReceiveError> {
    let body = grpc_frame(request);
    let call = http::Request::builder()
        .method(http::Method::POST)
        .uri(PROFILE_PATH)
        .header(CONTENT_TYPE, "application/grpc")
        .header(TE, "trailers")
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
    let mut reader = Reader::new(body);
    let mut trace = TraceOut::new(sink, file_name);
    let received = receive(&mut reader, connection.max_reply_bytes(), &mut trace).await;
    let status = match &received {
        Ok(_) => reader.status().await,
        Err(_) => Ok(reader.trailers.as_ref().and_then(Status::from_header_map)),
    };
    // The status outranks whatever the body looked like.
    if let Ok(Some(status)) = &status {
        if status.code() != Code::Ok {
            return Err(connection.call_error(status.clone()).into());
        }
    }
    let empty = received?;
    status?.ok_or_else(|| ReceiveError::Malformed("no grpc-status in the trailers".into()))?;
    match trace.finish().await? {
        Some(file) if !empty => blocking(move || file.commit()).await.map(Some),
        _ => Ok(None),
    }
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
    crate::client::with_causes(error.to_string(), error)
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
                trace.take(reader, length).await?;
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
/// `xplane.pb`. Encoders write the name first; data that comes before any
/// name is kept until the name says otherwise.
async fn tool_data(
    reader: &mut Reader,
    end: u64,
    trace: &mut TraceOut,
) -> Result<(), ReceiveError> {
    let mut name: Option<Vec<u8>> = None;
    let mut tentative = false;
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
                let named_trace = name.as_deref().is_none_or(|n| n == XPLANE_TOOL.as_bytes());
                if named_trace && trace.wants_more() {
                    tentative = name.is_none();
                    trace.take(reader, length).await?;
                } else {
                    reader.skip(length).await?;
                }
            }
            _ => reader.skip_field(wire, end).await?,
        }
    }
    if tentative && name.as_deref() != Some(XPLANE_TOOL.as_bytes()) {
        trace.discard();
    }
    Ok(())
}

/// The trace file of one reply: made when the first trace byte arrives.
/// The first trace field of the reply is the trace; later ones are skipped.
struct TraceOut {
    sink: Arc<dyn TraceSink>,
    file_name: String,
    file: Option<Box<dyn TraceFile>>,
    batch: Vec<u8>,
}

impl TraceOut {
    fn new(sink: Arc<dyn TraceSink>, file_name: &str) -> TraceOut {
        TraceOut {
            sink,
            file_name: file_name.to_string(),
            file: None,
            batch: Vec::new(),
        }
    }

    fn wants_more(&self) -> bool {
        self.file.is_none()
    }

    /// Copies `length` bytes of the reader into the file.
    async fn take(&mut self, reader: &mut Reader, length: u64) -> Result<(), ReceiveError> {
        if !self.wants_more() {
            return reader.skip(length).await;
        }
        let (sink, name) = (Arc::clone(&self.sink), self.file_name.clone());
        self.file = Some(blocking(move || sink.create(&name)).await?);
        self.batch = Vec::with_capacity(BATCH_BYTES.min(length as usize));
        let mut left = length;
        while left > 0 {
            let room = (BATCH_BYTES - self.batch.len()) as u64;
            let piece = reader.piece(left.min(room)).await?;
            left -= piece.len() as u64;
            self.batch.extend_from_slice(&piece);
            if self.batch.len() == BATCH_BYTES {
                self.flush().await?;
            }
        }
        Ok(())
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
