//! gRPC message framing and the partial protos the tap decodes.
//!
//! The tap never changes what it forwards; it reads the same bytes. [`Framer`]
//! reassembles gRPC messages (1-byte compressed flag, 4-byte big-endian
//! length, then the message) from HTTP/2 data frames of any size, holding
//! the frames themselves rather than copies, so that a 6 MiB tensor costs
//! the tap no memcpy; the partial protos decode straight from them
//! ([`Body::buf`]). The structs below declare only the fields the tap
//! records, with TensorFlow's field numbers (`master.proto`,
//! `eager_service.proto`); prost skips the rest.

use std::collections::VecDeque;

use bytes::{Buf, Bytes, BytesMut};

use super::fields::FieldFilter;

/// Length of the gRPC message prefix.
pub const PREFIX_BYTES: usize = 5;

/// Data frames shorter than this are copied together rather than held:
/// a peer sending a message a byte per frame must not make the tap hold a
/// queue entry (and the receive buffer behind it) per byte.
const HELD_FRAME_BYTES: usize = 4096;

/// One complete gRPC message seen on the wire.
#[derive(Debug, PartialEq)]
pub enum Frame {
    /// An uncompressed message body, ready to decode (up to the decode limit).
    Message(Body),
    /// A message the tap does not decode: compressed, or larger than the
    /// decode limit. `bytes` is its length without the prefix.
    Skipped { bytes: u64 },
}

/// A message's body as the pieces of the frames it arrived in.
#[derive(Clone, Debug, Default)]
pub struct Body {
    pieces: Vec<Bytes>,
    len: usize,
}

impl Body {
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The body to decode from, without joining its pieces.
    pub fn buf(&self) -> Pieces<'_> {
        Pieces {
            pieces: &self.pieces,
            at: 0,
            remaining: self.len,
        }
    }
}

impl From<Bytes> for Body {
    fn from(bytes: Bytes) -> Body {
        let len = bytes.len();
        let pieces = if len > 0 { vec![bytes] } else { Vec::new() };
        Body { pieces, len }
    }
}

impl PartialEq for Body {
    /// Equal bodies, however they were cut.
    fn eq(&self, other: &Body) -> bool {
        let mut ours = self.buf();
        ours.remaining() == other.len
            && other.pieces.iter().all(|piece| {
                let mine = ours.copy_to_bytes(piece.len());
                mine == *piece
            })
    }
}

/// A [`Body`]'s pieces read in order, as one buffer.
pub struct Pieces<'m> {
    pieces: &'m [Bytes],
    /// Offset into the first piece.
    at: usize,
    remaining: usize,
}

impl Buf for Pieces<'_> {
    fn remaining(&self) -> usize {
        self.remaining
    }

    fn chunk(&self) -> &[u8] {
        self.pieces.first().map_or(&[], |piece| &piece[self.at..])
    }

    fn advance(&mut self, mut count: usize) {
        assert!(count <= self.remaining, "advanced past the message's end");
        self.remaining -= count;
        while count > 0 {
            let left = self.pieces[0].len() - self.at;
            if count < left {
                self.at += count;
                return;
            }
            count -= left;
            self.pieces = &self.pieces[1..];
            self.at = 0;
        }
        while self
            .pieces
            .first()
            .is_some_and(|piece| piece.len() == self.at)
        {
            self.pieces = &self.pieces[1..];
            self.at = 0;
        }
    }
}

/// Reassembles gRPC messages from the data frames of one direction of a call.
/// Messages larger than `decode_limit` are counted but not held. A framer
/// made [`Framer::keeping`] some top-level fields holds nothing of a
/// message but those, whatever its size.
#[derive(Debug)]
pub struct Framer {
    /// What arrived and is not yet framed, in order: frames held as they
    /// came, small ones copied together.
    pending: VecDeque<Bytes>,
    /// Small frames being copied together, after `pending`.
    small: BytesMut,
    /// Bytes in `pending` and `small`.
    pending_len: usize,
    /// Bytes still to skip of a message that is not being held.
    skipping: u64,
    decode_limit: usize,
    /// The top-level fields kept of each message; `None` keeps it whole.
    fields: Option<&'static [u32]>,
    /// The message being filtered as it arrives.
    filtering: Option<FieldFilter>,
    /// Every byte seen, prefixes included.
    pub bytes: u64,
    /// Complete messages seen.
    pub messages: u32,
}

impl Framer {
    pub fn new(decode_limit: usize) -> Framer {
        Framer {
            pending: VecDeque::new(),
            small: BytesMut::new(),
            pending_len: 0,
            skipping: 0,
            decode_limit,
            fields: None,
            filtering: None,
            bytes: 0,
            messages: 0,
        }
    }

    /// A framer whose messages keep only the top-level fields numbered in
    /// `fields` (up to `decode_limit` bytes of them), of any message size.
    pub fn keeping(fields: &'static [u32], decode_limit: usize) -> Framer {
        Framer {
            fields: Some(fields),
            ..Framer::new(decode_limit)
        }
    }

    /// Feeds one data frame; complete messages go to `out`.
    pub fn push(&mut self, data: &Bytes, out: &mut Vec<Frame>) {
        self.bytes += data.len() as u64;
        let mut data = data.clone();
        // What a skipped message still has to come is never held.
        let skipped = (self.skipping as usize).min(data.len());
        data.advance(skipped);
        self.skipping -= skipped as u64;
        if let Some(filter) = &mut self.filtering {
            data.advance(filter.feed(&data));
            if !filter.is_done() {
                return;
            }
            self.end_filtering(out);
        }
        if data.is_empty() {
            return;
        }
        self.pending_len += data.len();
        if data.len() < HELD_FRAME_BYTES {
            self.small.extend_from_slice(&data);
        } else {
            self.seal_small();
            self.pending.push_back(data);
        }
        while self.pending_len >= PREFIX_BYTES {
            let prefix = self.peek_prefix();
            let compressed = prefix[0] != 0;
            let length = u32::from_be_bytes([prefix[1], prefix[2], prefix[3], prefix[4]]) as usize;
            if let (false, Some(fields)) = (compressed, self.fields) {
                self.discard(PREFIX_BYTES);
                self.filter_pending(FieldFilter::new(fields, length as u64, self.decode_limit));
                if self.filtering.as_ref().is_some_and(FieldFilter::is_done) {
                    self.end_filtering(out);
                    continue;
                }
                break;
            }
            if compressed || length > self.decode_limit {
                self.messages = self.messages.saturating_add(1);
                out.push(Frame::Skipped {
                    bytes: length as u64,
                });
                self.discard(PREFIX_BYTES);
                let here = length.min(self.pending_len);
                self.discard(here);
                self.skipping = (length - here) as u64;
                continue;
            }
            if self.pending_len < PREFIX_BYTES + length {
                // Nothing is reserved for the announced length: five bytes
                // from a peer must not make the tap hold 64 MiB. What is
                // held is what arrived.
                break;
            }
            self.discard(PREFIX_BYTES);
            self.messages = self.messages.saturating_add(1);
            out.push(Frame::Message(self.take(length)));
        }
    }

    /// Bytes of an incomplete message left when the stream ended.
    pub fn leftover(&self) -> usize {
        let filtering = self.filtering.as_ref().map_or(0, FieldFilter::remaining);
        self.pending_len + self.skipping as usize + filtering as usize
    }

    /// Starts filtering a message with what is pending; it goes on with
    /// the frames to come when they are not enough.
    fn filter_pending(&mut self, mut filter: FieldFilter) {
        let mut used = 0;
        let pieces = self.pending.iter().map(|piece| &piece[..]);
        for piece in pieces.chain(std::iter::once(&self.small[..])) {
            used += filter.feed(piece);
            if filter.is_done() {
                break;
            }
        }
        self.discard(used);
        self.filtering = Some(filter);
    }

    /// The filtered message has passed: its kept fields are the message.
    fn end_filtering(&mut self, out: &mut Vec<Frame>) {
        let Some(filter) = self.filtering.take() else {
            return;
        };
        self.messages = self.messages.saturating_add(1);
        let length = filter.length();
        out.push(match filter.finish() {
            Some(kept) => Frame::Message(kept.into()),
            None => Frame::Skipped { bytes: length },
        });
    }

    /// Moves the small frames copied so far into the queue.
    fn seal_small(&mut self) {
        if !self.small.is_empty() {
            self.pending.push_back(self.small.split().freeze());
        }
    }

    fn peek_prefix(&self) -> [u8; PREFIX_BYTES] {
        let mut prefix = [0u8; PREFIX_BYTES];
        let mut filled = 0;
        let pieces = self.pending.iter().map(|piece| &piece[..]);
        for piece in pieces.chain(std::iter::once(&self.small[..])) {
            let take = (PREFIX_BYTES - filled).min(piece.len());
            prefix[filled..filled + take].copy_from_slice(&piece[..take]);
            filled += take;
            if filled == PREFIX_BYTES {
                break;
            }
        }
        prefix
    }

    /// Drops the next `count` pending bytes.
    fn discard(&mut self, count: usize) {
        self.consume(count, None);
    }

    /// The next `count` pending bytes, as the pieces they are in.
    fn take(&mut self, count: usize) -> Body {
        let mut pieces = Vec::new();
        self.consume(count, Some(&mut pieces));
        Body { pieces, len: count }
    }

    /// Moves past the next `count` pending bytes, handing their pieces to
    /// `into` when one is given (a skipped message's are only dropped).
    fn consume(&mut self, mut count: usize, mut into: Option<&mut Vec<Bytes>>) {
        self.pending_len -= count;
        while count > 0 {
            let Some(front) = self.pending.front_mut() else {
                break;
            };
            let piece = if front.len() <= count {
                count -= front.len();
                self.pending.pop_front()
            } else {
                let piece = front.split_to(count);
                count = 0;
                Some(piece)
            };
            if let (Some(piece), Some(into)) = (piece, into.as_deref_mut()) {
                into.push(piece);
            }
        }
        if count > 0 {
            match into {
                Some(into) => into.push(self.small.split_to(count).freeze()),
                None => self.small.advance(count),
            }
        }
    }
}

impl Default for Framer {
    /// A framer that decodes nothing, only counts.
    fn default() -> Framer {
        Framer::new(0)
    }
}

/// `tensorflow.NamedTensorProto`, name only.
#[derive(Clone, PartialEq, prost::Message)]
pub struct NamedTensor {
    #[prost(string, tag = "1")]
    pub name: String,
}

/// `tensorflow.RunStepRequest`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct RunStepRequest {
    #[prost(string, tag = "1")]
    pub session_handle: String,
    #[prost(message, repeated, tag = "2")]
    pub feed: Vec<NamedTensor>,
    #[prost(string, repeated, tag = "3")]
    pub fetch: Vec<String>,
    #[prost(string, repeated, tag = "4")]
    pub target: Vec<String>,
    #[prost(string, tag = "6")]
    pub partial_run_handle: String,
}

/// `tensorflow.RunStepResponse`: with `store_errors_in_response_body` a failed
/// step travels with gRPC status OK and its code here.
#[derive(Clone, PartialEq, prost::Message)]
pub struct RunStepResponse {
    #[prost(int32, tag = "3")]
    pub status_code: i32,
}

/// `tensorflow.RunCallableRequest`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct RunCallableRequest {
    #[prost(string, tag = "1")]
    pub session_handle: String,
    #[prost(int64, tag = "2")]
    pub handle: i64,
}

/// `tensorflow.CallableOptions`, fetches and targets.
#[derive(Clone, PartialEq, prost::Message)]
pub struct CallableOptions {
    #[prost(string, repeated, tag = "2")]
    pub fetch: Vec<String>,
    #[prost(string, repeated, tag = "3")]
    pub target: Vec<String>,
}

/// `tensorflow.MakeCallableRequest`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct MakeCallableRequest {
    #[prost(string, tag = "1")]
    pub session_handle: String,
    #[prost(message, optional, tag = "2")]
    pub options: Option<CallableOptions>,
}

/// `tensorflow.GraphDef`, counted node by node without decoding them.
#[derive(Clone, PartialEq, prost::Message)]
pub struct GraphDef {
    #[prost(bytes = "bytes", repeated, tag = "1")]
    pub node: Vec<Bytes>,
}

/// `tensorflow.CreateSessionRequest` and `ExtendSessionRequest` share the
/// graph's field number only for CreateSession (1); ExtendSession has the
/// handle at 1 and the graph at 2.
#[derive(Clone, PartialEq, prost::Message)]
pub struct CreateSessionRequest {
    #[prost(bytes = "bytes", tag = "1")]
    pub graph_def: Bytes,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct ExtendSessionRequest {
    #[prost(string, tag = "1")]
    pub session_handle: String,
    #[prost(bytes = "bytes", tag = "2")]
    pub graph_def: Bytes,
}

/// Responses and requests whose first field is the session handle
/// (`CreateSessionResponse`, `CloseSessionRequest`, `PartialRunSetupRequest`, ...).
#[derive(Clone, PartialEq, prost::Message)]
pub struct SessionHandle {
    #[prost(string, tag = "1")]
    pub session_handle: String,
}

/// `tensorflow.eager.RemoteTensorHandle`, the op id only.
#[derive(Clone, PartialEq, prost::Message)]
pub struct RemoteTensorHandle {
    #[prost(int64, tag = "1")]
    pub op_id: i64,
}

/// `tensorflow.eager.Operation`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Operation {
    #[prost(int64, tag = "1")]
    pub id: i64,
    #[prost(string, tag = "2")]
    pub name: String,
    #[prost(string, tag = "6")]
    pub device: String,
}

/// `tensorflow.eager.QueueItem`: the two items the tap records.
#[derive(Clone, PartialEq, prost::Message)]
pub struct QueueItem {
    #[prost(message, optional, tag = "1")]
    pub handle_to_decref: Option<RemoteTensorHandle>,
    #[prost(message, optional, tag = "2")]
    pub operation: Option<Operation>,
    /// A `SendTensorOp`, kept as bytes for its size.
    #[prost(bytes = "bytes", optional, tag = "3")]
    pub send_tensor: Option<Bytes>,
}

/// `tensorflow.eager.EnqueueRequest`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct EnqueueRequest {
    #[prost(fixed64, tag = "1")]
    pub context_id: u64,
    #[prost(message, repeated, tag = "3")]
    pub queue: Vec<QueueItem>,
}

/// Eager requests that carry only the context id at field 1
/// (`KeepAlive`, `CloseContext`, `RegisterFunction`, ...) and
/// `CreateContextResponse`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct ContextId {
    #[prost(fixed64, tag = "1")]
    pub context_id: u64,
}

/// `tensorflow.eager.CreateContextRequest`: the context id lives in
/// `context_id = 7` in newer TensorFlow; older ones returned it.
#[derive(Clone, PartialEq, prost::Message)]
pub struct CreateContextRequest {
    #[prost(fixed64, tag = "7")]
    pub context_id: u64,
}

/// `tensorflow.eager.WaitQueueDoneRequest`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct WaitQueueDoneRequest {
    #[prost(fixed64, tag = "1")]
    pub context_id: u64,
    #[prost(int64, repeated, tag = "2")]
    pub op_id: Vec<i64>,
}

/// `tensorflow.eager.SendTensorRequest`, tensors kept as bytes for their size.
#[derive(Clone, PartialEq, prost::Message)]
pub struct SendTensorRequest {
    #[prost(fixed64, tag = "1")]
    pub context_id: u64,
    #[prost(int64, tag = "2")]
    pub op_id: i64,
    #[prost(bytes = "bytes", repeated, tag = "3")]
    pub tensors: Vec<Bytes>,
    #[prost(string, tag = "4")]
    pub device_name: String,
}

/// A RunStep request as TensorFlow sends one: for tests and fuzzing.
#[cfg(test)]
pub(crate) fn sample_run_step() -> RunStepRequest {
    RunStepRequest {
        session_handle: "s1".into(),
        feed: vec![NamedTensor { name: "x:0".into() }],
        fetch: vec!["y:0".into()],
        target: vec!["train".into()],
        partial_run_handle: String::new(),
    }
}

/// An eager Enqueue of an operation and a released handle with a tensor.
#[cfg(test)]
pub(crate) fn sample_enqueue() -> EnqueueRequest {
    EnqueueRequest {
        context_id: 9,
        queue: vec![
            QueueItem {
                handle_to_decref: None,
                operation: Some(Operation {
                    id: 3,
                    name: "MatMul".into(),
                    device: "/job:a/task:0/device:CPU:0".into(),
                }),
                send_tensor: None,
            },
            QueueItem {
                handle_to_decref: Some(RemoteTensorHandle { op_id: 2 }),
                operation: None,
                send_tensor: Some(Bytes::from_static(b"tensor")),
            },
        ],
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use prost::Message;

    fn framed(compressed: bool, body: &[u8]) -> Vec<u8> {
        let mut out = vec![u8::from(compressed)];
        out.extend_from_slice(&(body.len() as u32).to_be_bytes());
        out.extend_from_slice(body);
        out
    }

    #[test]
    fn messages_are_reassembled_across_any_split() {
        let mut wire = framed(false, b"hello");
        wire.extend(framed(true, b"zz"));
        wire.extend(framed(false, &[7u8; 300]));
        wire.extend(framed(false, b""));
        for chunk in [1, 2, 5, 7, 1000] {
            let mut framer = Framer::new(100);
            let mut out = Vec::new();
            for piece in wire.chunks(chunk) {
                framer.push(&Bytes::copy_from_slice(piece), &mut out);
            }
            assert_eq!(
                out,
                vec![
                    Frame::Message(Bytes::from_static(b"hello").into()),
                    Frame::Skipped { bytes: 2 },
                    Frame::Skipped { bytes: 300 },
                    Frame::Message(Body::default()),
                ],
                "chunk {chunk}"
            );
            assert_eq!(framer.bytes, wire.len() as u64);
            assert_eq!(framer.messages, 4);
            assert_eq!(framer.leftover(), 0);
        }
    }

    #[test]
    fn partial_protos_read_tensorflow_messages() {
        let full = sample_run_step();
        let decoded = RunStepRequest::decode(full.encode_to_vec().as_slice()).unwrap();
        assert_eq!(decoded, full);
        let enqueue = sample_enqueue();
        let decoded = EnqueueRequest::decode(enqueue.encode_to_vec().as_slice()).unwrap();
        assert_eq!(decoded, enqueue);
        assert!(RunStepRequest::decode(&b"\xff\xff\xff"[..]).is_err());
    }

    #[test]
    fn an_announced_length_holds_no_memory_until_the_bytes_arrive() {
        let mut framer = Framer::new(64 << 20);
        let mut out = Vec::new();
        framer.push(&Bytes::from_static(&[0, 0x03, 0xff, 0xff, 0xff]), &mut out);
        assert!(out.is_empty());
        let held: usize = framer.pending.iter().map(Bytes::len).sum();
        assert!(
            held + framer.small.capacity() < 4096,
            "{held} bytes held for a 5-byte prefix"
        );
    }

    #[test]
    fn large_frames_are_held_not_copied_and_decode_across_their_pieces() {
        let run_step = sample_run_step().encode_to_vec();
        // A body far larger than the fields decoded: a feed tensor's bytes
        // the partial proto skips, then the fields after it.
        let mut body = Vec::new();
        prost::encoding::bytes::encode(5, &vec![7u8; 3 * HELD_FRAME_BYTES], &mut body);
        body.extend_from_slice(&run_step);
        let wire = Bytes::from(framed(false, &body));
        let mut framer = Framer::new(1 << 20);
        let mut out = Vec::new();
        let frames: Vec<Bytes> = (0..wire.len())
            .step_by(HELD_FRAME_BYTES + 1)
            .map(|at| wire.slice(at..wire.len().min(at + HELD_FRAME_BYTES + 1)))
            .collect();
        for frame in &frames {
            framer.push(frame, &mut out);
        }
        let [Frame::Message(message)] = out.as_slice() else {
            panic!("{out:?}");
        };
        assert_eq!(message.len(), body.len());
        assert!(message.pieces.len() > 2, "{} pieces", message.pieces.len());
        // The pieces are the frames' own memory, but for the last frame,
        // short enough to be copied.
        let inside = |piece: &&Bytes| {
            let range = wire.as_ptr() as usize..wire.as_ptr() as usize + wire.len();
            range.contains(&(piece.as_ptr() as usize))
        };
        let held: usize = message.pieces.iter().filter(inside).map(Bytes::len).sum();
        assert!(
            held > body.len() - HELD_FRAME_BYTES,
            "{held} of {}",
            body.len()
        );
        let decoded = RunStepRequest::decode(message.buf()).unwrap();
        assert_eq!(decoded, sample_run_step());
    }

    #[test]
    fn a_keeping_framer_holds_only_the_kept_fields_of_messages_of_any_size() {
        let mut request = sample_run_step();
        request.feed = vec![NamedTensor {
            name: "t".repeat(6 << 20),
        }];
        let mut wire = framed(false, &request.encode_to_vec());
        wire.extend(framed(true, b"zz"));
        wire.extend(framed(false, &sample_run_step().encode_to_vec()));
        // Beyond the decode limit, which bounds only what is kept.
        let limit = 1 << 20;
        for frame in [1000, 65_536, wire.len()] {
            let mut framer = Framer::keeping(&[1, 3, 4, 6], limit);
            let mut out = Vec::new();
            let mut most_held = 0;
            for piece in wire.chunks(frame) {
                framer.push(&Bytes::copy_from_slice(piece), &mut out);
                most_held = most_held.max(framer.pending_len);
            }
            assert!(most_held <= frame.min(64 << 10), "{most_held} bytes held");
            let [Frame::Message(first), Frame::Skipped { bytes: 2 }, Frame::Message(last)] =
                out.as_slice()
            else {
                panic!("{out:?}");
            };
            let decoded = RunStepRequest::decode(first.buf()).unwrap();
            assert_eq!(decoded.fetch, request.fetch);
            assert!(decoded.feed.is_empty());
            let mut expected = sample_run_step();
            expected.feed.clear();
            assert_eq!(RunStepRequest::decode(last.buf()).unwrap(), expected);
            assert_eq!((framer.messages, framer.leftover()), (3, 0));
        }
    }

    #[test]
    fn a_message_a_byte_per_frame_is_copied_together() {
        let wire = framed(false, &[9u8; 10_000]);
        let mut framer = Framer::new(1 << 20);
        let mut out = Vec::new();
        for byte in &wire[..wire.len() - 1] {
            framer.push(&Bytes::copy_from_slice(&[*byte]), &mut out);
        }
        assert!(out.is_empty());
        assert!(framer.pending.len() <= 2, "{} held", framer.pending.len());
        framer.push(&Bytes::copy_from_slice(&wire[wire.len() - 1..]), &mut out);
        assert_eq!(
            out,
            vec![Frame::Message(Bytes::from(vec![9u8; 10_000]).into())]
        );
    }
}
