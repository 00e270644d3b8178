//! How many bytes a `NewSession` may have the agent write: the hosts it
//! names answer with traces of their choosing, written under the caller's
//! root, so a caller that is not an admin is bounded per session
//! (`--session-bytes`) and per hour (`--session-bytes-per-hour`, over the
//! last hour of its sessions together). A host whose trace would pass
//! either is not written, and the session's errors say which bound.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use crate::protocol::caller::{Caller, Owner};

/// The default `--session-bytes`.
pub const DEFAULT_PER_SESSION: u64 = 16 << 30;
/// The default `--session-bytes-per-hour`.
pub const DEFAULT_PER_HOUR: u64 = 64 << 30;

const HOUR: Duration = Duration::from_secs(3600);

/// Most callers remembered at once: past it, the one written to longest
/// ago is forgotten (its hour has likely passed).
const MAX_CALLERS: usize = 4096;

/// The bounds and what each caller wrote in its current hour.
#[derive(Debug)]
pub struct SessionBytes {
    pub per_session: u64,
    pub per_hour: u64,
    hours: Mutex<HashMap<Owner, Hour>>,
}

#[derive(Clone, Copy, Debug)]
struct Hour {
    began: Instant,
    written: u64,
}

impl Default for SessionBytes {
    fn default() -> Self {
        SessionBytes::new(DEFAULT_PER_SESSION, DEFAULT_PER_HOUR)
    }
}

impl SessionBytes {
    pub fn new(per_session: u64, per_hour: u64) -> SessionBytes {
        SessionBytes {
            per_session,
            per_hour,
            hours: Mutex::new(HashMap::new()),
        }
    }

    /// Counts `bytes` more written by one session of `caller`, which has
    /// written `session` bytes so far; or says which bound they would pass
    /// (and counts nothing).
    pub fn take(&self, caller: &Caller, session: u64, bytes: u64) -> Result<(), String> {
        if session.saturating_add(bytes) > self.per_session {
            return Err(format!(
                "the session would pass the {} bytes --session-bytes lets one session write",
                self.per_session
            ));
        }
        let mut hours = self.hours.lock();
        let now = Instant::now();
        let owner = caller.owner();
        if !hours.contains_key(&owner) && hours.len() >= MAX_CALLERS {
            if let Some(oldest) = hours
                .iter()
                .min_by_key(|(_, hour)| hour.began)
                .map(|(owner, _)| owner.clone())
            {
                hours.remove(&oldest);
            }
        }
        let hour = hours.entry(owner).or_insert(Hour {
            began: now,
            written: 0,
        });
        if now.duration_since(hour.began) >= HOUR {
            *hour = Hour {
                began: now,
                written: 0,
            };
        }
        if hour.written.saturating_add(bytes) > self.per_hour {
            return Err(format!(
                "{caller}'s sessions would pass the {} bytes --session-bytes-per-hour lets one \
                 caller write in an hour",
                self.per_hour
            ));
        }
        hour.written += bytes;
        Ok(())
    }

    /// Gives back `bytes` [`SessionBytes::take`] counted for `caller` that
    /// were never written after all (a trace refused or failed part-way).
    pub fn give_back(&self, caller: &Caller, bytes: u64) {
        if let Some(hour) = self.hours.lock().get_mut(&caller.owner()) {
            hour.written = hour.written.saturating_sub(bytes);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn user(uid: u32) -> Caller {
        Caller::tcp_user(uid)
    }

    #[test]
    fn a_session_and_a_callers_hour_are_each_bounded_and_callers_apart() {
        let bytes = SessionBytes::new(100, 150);
        assert!(bytes.take(&user(1), 0, 60).is_ok());
        let refused = bytes.take(&user(1), 60, 60).unwrap_err();
        assert!(refused.contains("--session-bytes "), "{refused}");
        // A second session of the same caller: its hour is the bound now.
        assert!(bytes.take(&user(1), 0, 80).is_ok());
        let refused = bytes.take(&user(1), 80, 20).unwrap_err();
        assert!(refused.contains("--session-bytes-per-hour"), "{refused}");
        // Another caller has its own hour.
        assert!(bytes.take(&user(2), 0, 90).is_ok());
        // Bytes given back (a trace that did not land) count no more.
        bytes.give_back(&user(1), 80);
        assert!(bytes.take(&user(1), 0, 80).is_ok());
    }
}
