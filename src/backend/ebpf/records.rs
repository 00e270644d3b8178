//! The records the BPF programs submit, mirrored from `bpf/records.h`
//! byte for byte, and read out of ring-buffer samples.

pub const COMM_LEN: usize = 16;
pub const SYMBOL_LEN: usize = 96;

pub const SCHED_SWITCH: u32 = 1;
pub const SCHED_WAKEUP: u32 = 2;
pub const SCHED_EXEC: u32 = 3;
pub const SCHED_EXIT: u32 = 4;
pub const MATCH_PREV: u32 = 1;
pub const MATCH_NEXT: u32 = 2;

/// Indexes of the per-CPU `losses` array.
pub const LOSS_SCHED_RING: u32 = 0;
pub const LOSS_CUDA_RING: u32 = 1;
pub const LOSS_CUDA_INFLIGHT: u32 = 2;
pub const LOSS_KINDS: u32 = 3;

/// Attach-cookie flags (the low 16 bits are the function).
pub const CALL_FLAG_LAUNCH_CONFIG: u32 = 1 << 16;
pub const CALL_FLAG_OUT_ARG0: u32 = 1 << 17;
pub const CALL_FLAG_SYMBOL_ARG2: u32 = 1 << 18;
pub const CALL_FLAG_ENTRY_ONLY: u32 = 1 << 19;

#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct SchedRecord {
    pub time_ns: u64,
    pub kind: u32,
    pub cpu: u32,
    pub prev_tid: u32,
    pub prev_pid: u32,
    pub next_tid: u32,
    pub next_pid: u32,
    pub prev_state: u32,
    pub matched: u32,
    pub prev_comm: [u8; COMM_LEN],
    pub next_comm: [u8; COMM_LEN],
}

#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct CudaCall {
    pub start_ns: u64,
    pub end_ns: u64,
    pub pid: u32,
    pub tid: u32,
    pub cookie: u32,
    pub result: i32,
    pub args: [u64; 9],
    pub launch: [u32; 7],
    pub reserved: u32,
    pub launch_stream: u64,
    pub out_value: u64,
    pub comm: [u8; COMM_LEN],
    pub symbol: [u8; SYMBOL_LEN],
}

const _: () = assert!(std::mem::size_of::<SchedRecord>() == 72);
const _: () = assert!(std::mem::size_of::<CudaCall>() == 264);
/// A call record without a symbol ends where the symbol would start.
pub const CUDA_CALL_HEAD_BYTES: usize = std::mem::offset_of!(CudaCall, symbol);
const _: () = assert!(CUDA_CALL_HEAD_BYTES == 168);

/// Plain-integer records that any bytes of the right length form.
pub trait Record: Copy {
    /// Reads a record from a ring-buffer sample; `None` when the sample is
    /// shorter than the record (a program and a user space out of step).
    fn read(sample: &[u8]) -> Option<Self> {
        if sample.len() < std::mem::size_of::<Self>() {
            return None;
        }
        // SAFETY: `Self` is `repr(C)` plain integers and byte arrays, valid
        // for any bits; the length was checked and the read is unaligned.
        Some(unsafe { std::ptr::read_unaligned(sample.as_ptr().cast::<Self>()) })
    }
}

impl Record for SchedRecord {}

impl Record for CudaCall {
    /// A record may end before its symbol (`CUDA_CALL_HEAD_BYTES`); the
    /// symbol is then empty.
    fn read(sample: &[u8]) -> Option<CudaCall> {
        if sample.len() < CUDA_CALL_HEAD_BYTES {
            return None;
        }
        let mut whole = [0u8; std::mem::size_of::<CudaCall>()];
        let present = sample.len().min(whole.len());
        whole[..present].copy_from_slice(&sample[..present]);
        // SAFETY: as for the default `read`: plain integers and byte
        // arrays, a full-length buffer, an unaligned read.
        Some(unsafe { std::ptr::read_unaligned(whole.as_ptr().cast::<CudaCall>()) })
    }
}

/// A kernel-style fixed-size name up to its first NUL.
pub fn c_str(bytes: &[u8]) -> String {
    let end = bytes.iter().position(|b| *b == 0).unwrap_or(bytes.len());
    String::from_utf8_lossy(&bytes[..end]).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn short_samples_are_refused_and_names_stop_at_nul() {
        assert!(SchedRecord::read(&[0u8; 71]).is_none());
        let mut bytes = [0u8; 72];
        bytes[8] = SCHED_SWITCH as u8;
        bytes[40..44].copy_from_slice(b"abc\0");
        let record = SchedRecord::read(&bytes).expect("full record");
        assert_eq!(record.kind, SCHED_SWITCH);
        assert_eq!(c_str(&record.prev_comm), "abc");
        assert_eq!(c_str(b"full-sixteen-chr"), "full-sixteen-chr");
    }

    #[test]
    fn call_records_may_end_before_their_symbol() {
        assert!(CudaCall::read(&[0u8; CUDA_CALL_HEAD_BYTES - 1]).is_none());
        let mut bytes = [0u8; CUDA_CALL_HEAD_BYTES];
        bytes[16..20].copy_from_slice(&7u32.to_ne_bytes());
        let call = CudaCall::read(&bytes).expect("a head is a record");
        assert_eq!(call.pid, 7);
        assert_eq!(c_str(&call.symbol), "");
        let mut whole = [0u8; 264];
        whole[CUDA_CALL_HEAD_BYTES..CUDA_CALL_HEAD_BYTES + 3].copy_from_slice(b"abc");
        assert_eq!(c_str(&CudaCall::read(&whole).expect("whole").symbol), "abc");
    }
}
