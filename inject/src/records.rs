//! CUPTI's activity buffers coming and going: the two callbacks CUPTI
//! calls, and the conversion of the buffers it hands back into events for
//! the ring (on the converter thread, or at once while CUPTI is being
//! finalized).

use std::collections::VecDeque;
use std::time::Instant;

use crate::detach::{self, Attachment};
use crate::session::Session;
use crate::{buffers, coexist, cupti, ffi, quiet, SESSION};

/// CUPTI asks for a buffer: one of ours, or none past the limit or when
/// the library is quiet (CUPTI then drops records and counts them).
///
/// # Safety
/// Called by CUPTI with three valid out-pointers.
pub unsafe extern "C" fn buffer_requested(
    buffer: *mut *mut u8,
    size: *mut usize,
    max_records: *mut usize,
) {
    ffi::guard("bufferRequested", (), || {
        let lent = SESSION
            .get()
            .filter(|_| !quiet())
            .and_then(|_| buffers::lend());
        let (out, bytes) = lent.unwrap_or((std::ptr::null_mut(), 0));
        // SAFETY: CUPTI passes valid out-pointers.
        unsafe {
            *buffer = out;
            *size = bytes;
            *max_records = 0;
        }
    });
}

/// CUPTI hands a buffer back: ours are queued for the converter (converted
/// at once while CUPTI is being finalized); another user's are left alone.
///
/// # Safety
/// Called by CUPTI with a buffer it completed (ours or not: that is checked
/// before anything reads it) of `size` bytes, `valid` of them filled.
pub unsafe extern "C" fn buffer_completed(
    _context: *mut std::ffi::c_void,
    _stream: u32,
    buffer: *mut u8,
    size: usize,
    valid: usize,
) {
    ffi::guard("bufferCompleted", (), || {
        // In a forked child a lock of the library's may have been held by a
        // parent's thread at the fork: no lock is taken there, and what
        // CUPTI hands back is left alone.
        if buffer.is_null() || crate::forked() {
            return;
        }
        if !buffers::returned(buffer, size) {
            // One of ours CUPTI kept past a detach is no sign of another
            // user (which would keep CUPTI attached for good).
            if !buffers::returned_late(buffer, size) {
                coexist::foreign_buffer_arrived();
            }
            return;
        }
        let completed = Completed {
            address: buffer as usize,
            valid,
            handed_back_ns: devtrace_shm::clock::now_ns(),
        };
        let Some(session) = SESSION.get() else {
            return buffers::release(buffer);
        };
        if detach::convert_if_finalizing(|| convert_all(session, VecDeque::from([completed]), true))
        {
            return;
        }
        match session.pending.lock() {
            Ok(mut pending) => {
                pending.push_back(completed);
                session.pending_ready.notify_one();
            }
            Err(_) => buffers::release(buffer),
        }
    });
}

/// A buffer of ours CUPTI gave back, with the bytes it filled, and when.
#[derive(Clone, Copy)]
pub struct Completed {
    address: usize,
    valid: usize,
    /// Work whose record in it is unfinished was still running then.
    handed_back_ns: u64,
}

/// Converts the pending buffers now; the caller holds the gate, and CUPTI
/// is attached.
pub fn convert_pending_now() {
    if let Some(session) = SESSION.get() {
        convert_all(session, session.take_pending(), true);
    }
}

/// As [`convert_pending_now`], until `deadline`: the buffers left then are
/// freed unread, and how many is returned. For the exit handler, whose
/// process must not be held while its other threads fill buffers as fast
/// as they are read.
pub fn convert_pending_until(deadline: Instant) -> usize {
    SESSION.get().map_or(0, |session| {
        convert_until(session, session.take_pending(), true, Some(deadline))
    })
}

/// Converts buffers into events (when `readable`: CUPTI is attached) and
/// frees them: metadata first, then the events into the ring (a full ring
/// counts what it refuses).
pub fn convert_all(session: &Session, completed: VecDeque<Completed>, readable: bool) {
    convert_until(session, completed, readable, None);
}

/// As [`convert_all`], freeing unread the buffers left at `deadline`;
/// returns how many it left.
fn convert_until(
    session: &Session,
    completed: VecDeque<Completed>,
    readable: bool,
    deadline: Option<Instant>,
) -> usize {
    let mut events = Vec::new();
    let mut left = 0;
    for buffer in completed {
        let address = buffer.address as *mut u8;
        if deadline.is_some_and(|deadline| Instant::now() >= deadline) {
            buffers::release(address);
            left += 1;
            continue;
        }
        if readable && !quiet() {
            let meta = {
                let Ok(mut converter) = session.converter.lock() else {
                    buffers::release(address);
                    continue;
                };
                // A clock registered since the last flush stamps these
                // records already.
                converter.clock.follow_registered();
                let mut record = std::ptr::null_mut();
                // SAFETY: a buffer CUPTI completed with `valid` bytes.
                while unsafe { cupti::next_record(address, buffer.valid, &mut record) } {
                    converter.convert(record, &mut events);
                }
                converter.end_buffer(buffer.handed_back_ns);
                converter.take_meta()
            };
            for record in &meta {
                session.write_meta(record);
            }
            if let Ok(mut producer) = session.producer.lock() {
                producer.push_batch(&events);
            }
            events.clear();
        }
        buffers::release(address);
    }
    left
}

/// The converter thread: waits for buffers CUPTI gave back and converts
/// them, one at a time, under the gate (reading records is a CUPTI call). Buffers that
/// arrive after CUPTI was detached or the process began exiting are freed
/// unread.
pub fn convert_loop() {
    let Some(session) = SESSION.get() else { return };
    loop {
        {
            let Ok(mut pending) = session.pending.lock() else {
                return;
            };
            while pending.is_empty() {
                pending = match session.pending_ready.wait(pending) {
                    Ok(pending) => pending,
                    Err(_) => return,
                };
            }
        }
        // One buffer per hold of the gate: the exit handler (and a
        // detach) waits for it, and a backlog read whole, on a machine
        // whose cores the job's threads hold, took seconds.
        let gate = detach::gate();
        let readable = *gate == Attachment::Attached;
        let next = session
            .pending
            .lock()
            .ok()
            .and_then(|mut pending| pending.pop_front());
        convert_all(session, next.into_iter().collect(), readable);
        if *gate == Attachment::Closed {
            return;
        }
    }
}
