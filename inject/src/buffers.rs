//! The activity buffers this library lends CUPTI, and how one that comes
//! back is known to be ours.
//!
//! CUPTI hands every completed buffer to whichever `bufferCompleted` is
//! registered at that moment, whoever supplied it, so a callback must tell
//! its own buffers from another CUPTI user's (and never read or free
//! those). An address alone does not tell it: a buffer of ours that went to
//! another user's callback and was freed there can come back from `malloc`
//! as that user's next buffer, at the same address. So every buffer of ours
//! has one size no framework profiler uses ([`BUFFER_BYTES`], not a power of
//! two), and a buffer is ours only when CUPTI returns it with our address
//! *and* that size. Buffers come from `malloc` (through the global
//! allocator) because another user's callback that is handed one may
//! `free` it.
//!
//! At most [`MAX_LENT`] buffers are out at once; past that a request gets
//! none, and CUPTI drops (and counts) the records.

use std::alloc::Layout;
use std::collections::HashSet;
use std::sync::Mutex;

/// Bytes of each buffer: about 1 MiB, and a size no profiler picks (theirs
/// are powers of two), so that a buffer is recognised by address and size.
pub const BUFFER_BYTES: usize = (1 << 20) - 13 * 8;
/// Buffers CUPTI may hold or have completed but not yet converted.
pub const MAX_LENT: usize = 64;

static LENT: Mutex<Lent> = Mutex::new(Lent {
    addresses: None,
    given_up: None,
    unreturned_total: 0,
});

struct Lent {
    /// Addresses of the buffers CUPTI holds (or completed and not yet
    /// released), created on first use.
    addresses: Option<HashSet<usize>>,
    /// Addresses of the buffers given up at a detach, in case CUPTI hands
    /// one back after all: it is then ours, not another user's.
    given_up: Option<HashSet<usize>>,
    /// Buffers CUPTI never handed back before it was detached.
    unreturned_total: u64,
}

/// Given-up addresses remembered at most (a bound on a leak's bookkeeping).
const MAX_GIVEN_UP: usize = 4096;

impl Lent {
    fn addresses(&mut self) -> &mut HashSet<usize> {
        self.addresses.get_or_insert_with(HashSet::new)
    }

    fn given_up(&mut self) -> &mut HashSet<usize> {
        self.given_up.get_or_insert_with(HashSet::new)
    }
}

fn layout() -> Layout {
    // A constant, valid size and alignment.
    Layout::from_size_align(BUFFER_BYTES, 8).unwrap_or_else(|_| Layout::new::<u64>())
}

/// A new buffer for CUPTI, or `None` past [`MAX_LENT`] or when memory is
/// short.
pub fn lend() -> Option<(*mut u8, usize)> {
    let mut lent = LENT.lock().ok()?;
    if lent.addresses().len() >= MAX_LENT {
        return None;
    }
    // SAFETY: a layout of non-zero size.
    let buffer = unsafe { std::alloc::alloc(layout()) };
    if buffer.is_null() {
        return None;
    }
    lent.addresses().insert(buffer as usize);
    // A given-up buffer freed elsewhere, its address ours again.
    lent.given_up().remove(&(buffer as usize));
    Some((buffer, BUFFER_BYTES))
}

/// Whether a buffer CUPTI handed back (`buffer`, of `size` bytes) is one of
/// ours; it is then ours to read and must be [`release`]d.
pub fn returned(buffer: *mut u8, size: usize) -> bool {
    size == BUFFER_BYTES
        && LENT
            .lock()
            .is_ok_and(|mut lent| lent.addresses().contains(&(buffer as usize)))
}

/// Whether a buffer CUPTI handed back is one of ours given up at a detach
/// ([`give_up_unreturned`]): it never went to another user then, so it is
/// freed here, unread (reading records would attach CUPTI again), and not
/// taken for another CUPTI user's.
pub fn returned_late(buffer: *mut u8, size: usize) -> bool {
    let Ok(mut lent) = LENT.lock() else {
        return false;
    };
    if size != BUFFER_BYTES || !lent.given_up().remove(&(buffer as usize)) {
        return false;
    }
    // SAFETY: allocated by `lend` with this layout; given up, so never
    // freed here, and removed from the given-up set now, so freed once.
    unsafe { std::alloc::dealloc(buffer, layout()) };
    true
}

/// Frees a buffer of ours that came back.
pub fn release(buffer: *mut u8) {
    let Ok(mut lent) = LENT.lock() else { return };
    if lent.addresses().remove(&(buffer as usize)) {
        // SAFETY: allocated by `lend` with this layout, and just removed
        // from the lent set, so freed once.
        unsafe { std::alloc::dealloc(buffer, layout()) };
    }
}

/// How many buffers of ours are out (held by CUPTI, or back and not yet
/// released).
pub fn out() -> usize {
    LENT.lock().map_or(0, |mut lent| lent.addresses().len())
}

/// After CUPTI was finalized it holds no buffer of ours: one it never
/// handed back to our callback was handed to another user's (which may
/// have freed it, or still read it), so it is given up and never freed
/// here: a leak is bounded, a second free is not. Returns how many there
/// were this time.
pub fn give_up_unreturned() -> usize {
    let Ok(mut lent) = LENT.lock() else { return 0 };
    let addresses: Vec<usize> = lent.addresses().drain().collect();
    if lent.given_up().len() + addresses.len() > MAX_GIVEN_UP {
        lent.given_up().clear();
    }
    lent.given_up().extend(&addresses);
    lent.unreturned_total += addresses.len() as u64;
    addresses.len()
}

/// Buffers given up since the process started.
pub fn unreturned_total() -> u64 {
    LENT.lock().map_or(0, |lent| lent.unreturned_total)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The lent buffers are the process's: one test at a time.
    static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

    #[test]
    fn a_buffer_is_ours_only_at_our_address_and_size() {
        let _alone = ONE_AT_A_TIME.lock();
        let (buffer, size) = lend().expect("a buffer");
        assert_eq!(size, BUFFER_BYTES);
        assert!(!BUFFER_BYTES.is_power_of_two());
        assert!(returned(buffer, size));
        // Another user's buffer that malloc placed at the same address.
        assert!(!returned(buffer, 1 << 20));
        let mut other = [0u8; 64];
        assert!(!returned(other.as_mut_ptr(), BUFFER_BYTES));
        release(buffer);
        assert!(!returned(buffer, size));
        // A second release of the same address frees nothing.
        release(buffer);
    }

    #[test]
    fn a_buffer_given_up_and_handed_back_late_is_ours_and_freed_once() {
        let _alone = ONE_AT_A_TIME.lock();
        let (buffer, size) = lend().expect("a buffer");
        assert!(give_up_unreturned() >= 1);
        assert!(!returned(buffer, size));
        // Another user's buffer at that address has another size.
        assert!(!returned_late(buffer, 1 << 20));
        assert!(returned_late(buffer, size));
        // Freed: not again.
        assert!(!returned_late(buffer, size));
    }
}
