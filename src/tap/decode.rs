//! gRPC message framing and the partial protos the tap decodes.
//!
//! The tap never changes what it forwards; it reads a copy. [`Framer`]
//! reassembles gRPC messages (1-byte compressed flag, 4-byte big-endian
//! length, then the message) from HTTP/2 data frames of any size. The structs
//! below declare only the fields the tap records, with TensorFlow's field
//! numbers (`master.proto`, `eager_service.proto`); prost skips the rest.

use bytes::{Buf, Bytes, BytesMut};

/// Length of the gRPC message prefix.
pub const PREFIX_BYTES: usize = 5;

/// One complete gRPC message seen on the wire.
#[derive(Debug, PartialEq)]
pub enum Frame {
    /// An uncompressed message body, ready to decode (up to the decode limit).
    Message(Bytes),
    /// A message the tap does not decode: compressed, or larger than the
    /// decode limit. `bytes` is its length without the prefix.
    Skipped { bytes: u64 },
}

/// Reassembles gRPC messages from the data frames of one direction of a call.
/// Messages larger than `decode_limit` are counted but not buffered.
#[derive(Debug)]
pub struct Framer {
    buffer: BytesMut,
    /// Bytes still to skip of a message that is not being buffered.
    skipping: u64,
    decode_limit: usize,
    /// Every byte seen, prefixes included.
    pub bytes: u64,
    /// Complete messages seen.
    pub messages: u32,
}

impl Framer {
    pub fn new(decode_limit: usize) -> Framer {
        Framer {
            buffer: BytesMut::new(),
            skipping: 0,
            decode_limit,
            bytes: 0,
            messages: 0,
        }
    }

    /// Feeds one data frame; complete messages go to `out`.
    pub fn push(&mut self, mut data: &[u8], out: &mut Vec<Frame>) {
        self.bytes += data.len() as u64;
        while !data.is_empty() {
            if self.skipping > 0 {
                let take = (self.skipping as usize).min(data.len());
                self.skipping -= take as u64;
                data = &data[take..];
                continue;
            }
            self.buffer.extend_from_slice(data);
            data = &[];
            while self.buffer.len() >= PREFIX_BYTES {
                let compressed = self.buffer[0] != 0;
                let length = u32::from_be_bytes([
                    self.buffer[1],
                    self.buffer[2],
                    self.buffer[3],
                    self.buffer[4],
                ]) as usize;
                if compressed || length > self.decode_limit {
                    self.messages = self.messages.saturating_add(1);
                    out.push(Frame::Skipped {
                        bytes: length as u64,
                    });
                    self.buffer.advance(PREFIX_BYTES);
                    let here = length.min(self.buffer.len());
                    self.buffer.advance(here);
                    self.skipping = (length - here) as u64;
                    if self.skipping > 0 {
                        break;
                    }
                    continue;
                }
                if self.buffer.len() < PREFIX_BYTES + length {
                    // Nothing is reserved for the announced length: five
                    // bytes from a peer must not make the tap hold 64 MiB.
                    // The buffer grows with what arrives.
                    break;
                }
                self.buffer.advance(PREFIX_BYTES);
                self.messages = self.messages.saturating_add(1);
                out.push(Frame::Message(self.buffer.split_to(length).freeze()));
            }
        }
    }

    /// Bytes of an incomplete message left when the stream ended.
    pub fn leftover(&self) -> usize {
        self.buffer.len() + self.skipping as usize
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
                framer.push(piece, &mut out);
            }
            assert_eq!(
                out,
                vec![
                    Frame::Message(Bytes::from_static(b"hello")),
                    Frame::Skipped { bytes: 2 },
                    Frame::Skipped { bytes: 300 },
                    Frame::Message(Bytes::new()),
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
        framer.push(&[0, 0x03, 0xff, 0xff, 0xff], &mut out);
        assert!(out.is_empty());
        assert!(
            framer.buffer.capacity() < 4096,
            "{} bytes held for a 5-byte prefix",
            framer.buffer.capacity()
        );
    }
}
