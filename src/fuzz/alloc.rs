//! The allocator of the test binary, counting what each thread holds, so
//! that a fuzz case can tell how much memory its decoder took at its peak.
//! Counting is per thread (tests run side by side) and only while a thread
//! measures; the cost elsewhere is one thread-local read per allocation.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;

struct Counting;

#[global_allocator]
static ALLOCATOR: Counting = Counting;

thread_local! {
    static MEASURING: Cell<bool> = const { Cell::new(false) };
    /// Bytes allocated minus bytes freed by this thread since measuring began.
    static HELD: Cell<isize> = const { Cell::new(0) };
    static PEAK: Cell<isize> = const { Cell::new(0) };
}

fn count(delta: isize) {
    // `try_with`: allocations while a thread's locals are torn down.
    let _ = MEASURING.try_with(|measuring| {
        if measuring.get() {
            HELD.with(|held| {
                let now = held.get() + delta;
                held.set(now);
                PEAK.with(|peak| peak.set(peak.get().max(now)));
            });
        }
    });
}

// SAFETY: every call is passed on to the system allocator unchanged; the
// counting touches only const-initialised thread-locals without
// destructors, which never allocate.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        count(layout.size() as isize);
        // SAFETY: the caller's layout, as given.
        unsafe { System.alloc(layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        count(layout.size() as isize);
        // SAFETY: as above.
        unsafe { System.alloc_zeroed(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        count(-(layout.size() as isize));
        // SAFETY: `ptr` came from this allocator with `layout`.
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        count(new_size as isize - layout.size() as isize);
        // SAFETY: as above.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

/// The most bytes this thread held at once while running `work`.
pub fn peak_during<T>(work: impl FnOnce() -> T) -> (T, usize) {
    HELD.with(|held| held.set(0));
    PEAK.with(|peak| peak.set(0));
    MEASURING.with(|measuring| measuring.set(true));
    let result = work();
    MEASURING.with(|measuring| measuring.set(false));
    (result, PEAK.with(Cell::get).max(0) as usize)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_peak_is_what_was_held_at_once() {
        let ((), peak) = peak_during(|| {
            let big = vec![0u8; 1 << 20];
            drop(std::hint::black_box(big));
            let small = vec![0u8; 1 << 10];
            drop(std::hint::black_box(small));
        });
        assert!((1 << 20..(1 << 20) + 4096).contains(&peak), "{peak}");
    }
}
