//! The byte layout of a ring: a header, then `lanes` lanes, each a lane header
//! followed by `capacity` slots. Everything is `#[repr(C)]` plain data addressed
//! by offsets from the start of the region, so the same layout can be placed in
//! a heap allocation or in a shared-memory segment mapped by two processes.

use std::sync::atomic::{AtomicU32, AtomicU64};

use crate::event::EVENT_WORDS;

/// Identifies a devtrace ring region ("DVTRRING").
pub const RING_MAGIC: u64 = u64::from_le_bytes(*b"DVTRRING");
/// Bumped whenever anything in this file changes shape.
pub const LAYOUT_VERSION: u32 = 3;
/// Alignment of the region and of every lane header.
pub const REGION_ALIGN: usize = 64;
/// `RingHeader::clock_id`: event times are `CLOCK_REALTIME` nanoseconds.
pub const CLOCK_REALTIME_NS: u32 = libc::CLOCK_REALTIME as u32;

/// At the start of every ring region. Everything before `consumer_pid` is
/// written once, before the region is visible to anyone else, and only read
/// afterwards; a process that maps an existing region validates it first.
#[repr(C)]
pub struct RingHeader {
    pub magic: u64,
    pub version: u32,
    pub lane_count: u32,
    pub lane_capacity: u64,
    pub slot_size: u32,
    /// [`super::DropPolicy`] as a number; fixed when the ring is created.
    pub policy: u32,
    /// Bytes of the whole region, header included.
    pub total_size: u64,
    /// Which clock event times use ([`CLOCK_REALTIME_NS`]).
    pub clock_id: u32,
    /// Process that created the region (the producer process for a segment
    /// made by an injection library); stale-file cleanup keys on it.
    pub creator_pid: u32,
    /// `CLOCK_REALTIME` nanoseconds when the region was created.
    pub created_ns: u64,
    /// Process holding the ring's consumer; 0 while none.
    pub consumer_pid: AtomicU32,
    /// Bumped by the agent on every pass over the ring, so that a producer
    /// can tell an agent that died (and can no longer clear the control
    /// word) from one that is quiet; 0 while no agent that beats has seen
    /// the ring (an agent older than the beat leaves it 0).
    pub consumer_beat: AtomicU32,
    /// Control word set by the consumer side and read by producers: low 32
    /// bits are flags ([`super::CONTROL_CAPTURE`]), high 32 bits a generation
    /// bumped on every change.
    pub control: Padded<AtomicU64>,
}

/// A word on its own cache line, so producer and consumer do not share lines.
#[repr(C, align(64))]
pub struct Padded<T>(pub T);

/// One single-producer, single-consumer lane.
#[repr(C)]
pub struct LaneHeader {
    /// 0 while free; otherwise `pid << 32 | token` of the owning producer, so
    /// the consumer can tell when the owner's process has died.
    pub owner: Padded<AtomicU64>,
    /// Next position the producer writes; only the producer stores it.
    pub head: Padded<AtomicU64>,
    /// Next position the consumer reads; only the consumer stores it.
    pub tail: Padded<AtomicU64>,
    /// Events refused because the lane was full (drop-newest); producer-owned.
    pub dropped_newest: Padded<AtomicU64>,
    /// Events overwritten before they were read (drop-oldest); consumer-owned.
    pub dropped_oldest: Padded<AtomicU64>,
}

/// One event's worth of storage: exactly two cache lines.
#[repr(C, align(64))]
pub struct Slot {
    pub words: [AtomicU64; EVENT_WORDS],
}

/// Per-slot sequence lock of the overwriting (drop-oldest) policy: odd while
/// the slot is written, `2 * pos + 2` once the event for ring position `pos`
/// is complete. Kept apart from the slots so that they stay line-aligned; a
/// drop-newest ring never touches these pages.
pub type SlotSeq = AtomicU64;

/// Sizes and offsets of one ring's region.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RingLayout {
    pub lanes: u32,
    /// Slots per lane; a power of two.
    pub capacity: u64,
}

fn round_up(value: usize, align: usize) -> usize {
    value.div_ceil(align) * align
}

impl RingLayout {
    pub fn header_size() -> usize {
        round_up(std::mem::size_of::<RingHeader>(), REGION_ALIGN)
    }

    pub fn lane_size(&self) -> usize {
        round_up(
            std::mem::size_of::<LaneHeader>()
                + self.capacity as usize
                    * (std::mem::size_of::<Slot>() + std::mem::size_of::<SlotSeq>()),
            REGION_ALIGN,
        )
    }

    /// Bytes of the whole region; `None` when it would not fit in memory.
    pub fn total_size(&self) -> Option<usize> {
        (self.lanes as usize)
            .checked_mul(self.lane_size())?
            .checked_add(Self::header_size())
            .filter(|size| *size <= isize::MAX as usize)
    }

    pub fn lane_offset(&self, lane: u32) -> usize {
        Self::header_size() + lane as usize * self.lane_size()
    }

    /// Offset of the slot that ring position `position` maps to.
    pub fn slot_offset(&self, lane: u32, position: u64) -> usize {
        let index = (position & (self.capacity - 1)) as usize;
        self.lane_offset(lane)
            + std::mem::size_of::<LaneHeader>()
            + index * std::mem::size_of::<Slot>()
    }

    /// Offset of the sequence word of the slot for `position`.
    pub fn seq_offset(&self, lane: u32, position: u64) -> usize {
        let index = (position & (self.capacity - 1)) as usize;
        self.lane_offset(lane)
            + std::mem::size_of::<LaneHeader>()
            + self.capacity as usize * std::mem::size_of::<Slot>()
            + index * std::mem::size_of::<SlotSeq>()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layout_is_aligned_and_non_overlapping() {
        let layout = RingLayout {
            lanes: 3,
            capacity: 8,
        };
        assert_eq!(std::mem::size_of::<LaneHeader>() % 64, 0);
        assert_eq!(RingLayout::header_size(), 128);
        assert_eq!(std::mem::offset_of!(RingHeader, control), 64);
        // Tests forge headers at these offsets (tests/it/common, tests/it/hostile.rs).
        assert_eq!(std::mem::offset_of!(RingHeader, lane_count), 12);
        assert_eq!(std::mem::offset_of!(RingHeader, total_size), 32);
        assert_eq!(std::mem::offset_of!(RingHeader, creator_pid), 44);
        assert_eq!(
            RingLayout::header_size() + std::mem::offset_of!(LaneHeader, head),
            192
        );
        assert_eq!(std::mem::size_of::<Slot>(), 8 * EVENT_WORDS);
        for lane in 0..3 {
            assert_eq!(layout.lane_offset(lane) % REGION_ALIGN, 0);
            assert_eq!(layout.slot_offset(lane, 3) % REGION_ALIGN, 0);
            let last_slot = layout.slot_offset(lane, 7) + std::mem::size_of::<Slot>();
            assert!(last_slot <= layout.seq_offset(lane, 0));
            let last_seq = layout.seq_offset(lane, 7) + 8;
            assert!(last_seq <= layout.lane_offset(lane) + layout.lane_size());
            // Positions wrap onto the same slots.
            assert_eq!(layout.slot_offset(lane, 9), layout.slot_offset(lane, 1));
        }
        assert_eq!(
            layout.total_size(),
            Some(layout.lane_offset(2) + layout.lane_size())
        );
    }
}
