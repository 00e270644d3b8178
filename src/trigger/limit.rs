//! The brakes on a rule: a cool-down after each firing and a cap on
//! firings in any hour, so that a flapping condition cannot fill a disk.

use std::collections::VecDeque;
use std::time::Duration;

use crate::clock;

const HOUR_NS: u64 = 3_600_000_000_000;

/// Why a firing was held back.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Held {
    #[error("cooling down for {:.1} s more (cooldown)", *.left_ns as f64 / 1e9)]
    CoolingDown { left_ns: u64 },
    #[error("{fired} firings in the last hour already (max-per-hour)")]
    HourlyCap { fired: u32 },
}

/// The firings of one rule that count against its limits.
#[derive(Debug)]
pub struct Limit {
    cooldown_ns: u64,
    max_per_hour: u32,
    /// Times of the firings of the last hour, oldest first.
    recent: VecDeque<u64>,
}

impl Limit {
    pub fn new(cooldown: Duration, max_per_hour: u32) -> Limit {
        Limit {
            cooldown_ns: clock::duration_ns(cooldown),
            max_per_hour,
            recent: VecDeque::new(),
        }
    }

    /// Records a firing at `at_ns` if the limits allow one, else says why
    /// not. Firings are judged in the order they are offered; one dated
    /// before the last (a late event) is judged against it all the same.
    pub fn admit(&mut self, at_ns: u64) -> Result<(), Held> {
        while self
            .recent
            .front()
            .is_some_and(|t| t.saturating_add(HOUR_NS) <= at_ns)
        {
            self.recent.pop_front();
        }
        if let Some(&last) = self.recent.back() {
            let until = last.saturating_add(self.cooldown_ns);
            if at_ns < until {
                return Err(Held::CoolingDown {
                    left_ns: until - at_ns.max(last),
                });
            }
        }
        if self.recent.len() >= self.max_per_hour as usize {
            return Err(Held::HourlyCap {
                fired: self.recent.len() as u32,
            });
        }
        self.recent.push_back(at_ns);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: u64 = 1_000_000_000;

    #[test]
    fn the_cooldown_holds_firings_back_until_it_has_passed() {
        let mut limit = Limit::new(Duration::from_secs(10), 100);
        assert_eq!(limit.admit(100 * S), Ok(()));
        assert_eq!(
            limit.admit(105 * S),
            Err(Held::CoolingDown { left_ns: 5 * S })
        );
        assert!(limit.admit(109 * S).is_err());
        assert_eq!(limit.admit(110 * S), Ok(()));
        // A late event dated before the last firing is held too.
        assert!(limit.admit(90 * S).is_err());
    }

    #[test]
    fn the_hourly_cap_holds_until_the_oldest_firing_is_an_hour_old() {
        let mut limit = Limit::new(Duration::ZERO, 2);
        assert_eq!(limit.admit(S), Ok(()));
        assert_eq!(limit.admit(2 * S), Ok(()));
        assert_eq!(limit.admit(3 * S), Err(Held::HourlyCap { fired: 2 }));
        assert!(limit.admit(3600 * S).is_err());
        assert_eq!(limit.admit(3601 * S), Ok(()));
        assert!(limit.admit(3601 * S + 1).is_err());
    }
}
