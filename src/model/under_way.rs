//! The blocking work under way in this process that must not be cut off
//! unsaid (trace writes and uploads, attaching the injection library), so
//! that a stopping agent waits for it up to one deadline and names what it
//! stops without.
//!
//! Such work runs on the blocking pool and goes on after the call that
//! asked for it is gone (a client that gave up, a trigger save past its
//! grace). Without this, the process would wait at exit for each piece for
//! as long as the disk or bucket under it takes: an upload to a bucket that
//! stopped answering gives up only after object storage's request timeout.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use parking_lot::Mutex;

/// What each piece of work under way does, by the order it began in.
static UNDER_WAY: Mutex<BTreeMap<u64, String>> = Mutex::new(BTreeMap::new());
static NEXT: AtomicU64 = AtomicU64::new(0);

/// One piece of work under way, from [`begin`] until it is dropped.
#[must_use = "the work is under way only while this is held"]
pub struct UnderWay {
    id: u64,
}

/// Marks `what` (as the log names it: "writing PATH") under way until the
/// returned guard is dropped. Taken before the work is handed to the
/// blocking pool, so that work queued there counts too.
pub fn begin(what: String) -> UnderWay {
    let id = NEXT.fetch_add(1, Ordering::Relaxed);
    UNDER_WAY.lock().insert(id, what);
    UnderWay { id }
}

impl Drop for UnderWay {
    fn drop(&mut self) {
        UNDER_WAY.lock().remove(&self.id);
    }
}

/// The work under way now, oldest first.
pub fn under_way() -> Vec<String> {
    UNDER_WAY.lock().values().cloned().collect()
}

/// Waits until no work is under way or `deadline` passes; returns what is
/// still under way then, which the caller stops without.
pub async fn settled_by(deadline: tokio::time::Instant) -> Vec<String> {
    loop {
        let left = under_way();
        if left.is_empty() || tokio::time::Instant::now() >= deadline {
            return left;
        }
        // Polled: a stop waits on this once, and the work's end need not
        // wake anything the rest of the time.
        let next = tokio::time::Instant::now() + POLL;
        tokio::time::sleep_until(next.min(deadline)).await;
    }
}

const POLL: Duration = Duration::from_millis(20);

#[cfg(test)]
mod tests {
    use super::*;

    /// Of the work left, this test's: the work under way is the whole
    /// process's, and other tests write at the same time.
    fn ours(left: Vec<String>) -> Vec<String> {
        left.into_iter()
            .filter(|target| target.starts_with("writes-test:"))
            .collect()
    }

    #[tokio::test]
    async fn a_stop_waits_for_writes_under_way_until_its_deadline_and_names_those_left() {
        let quick = begin("writes-test:quick".into());
        let stalled = begin("writes-test:stalled".into());
        assert_eq!(
            ours(under_way()),
            ["writes-test:quick", "writes-test:stalled"]
        );
        let ending = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(100));
            drop(quick);
        });
        let deadline = tokio::time::Instant::now() + Duration::from_millis(600);
        let left = settled_by(deadline).await;
        assert_eq!(ours(left), ["writes-test:stalled"]);
        assert!(tokio::time::Instant::now() >= deadline, "waited it out");
        ending.join().unwrap();

        drop(stalled);
        assert!(ours(under_way()).is_empty());
    }
}
