//! One bound shared by peers: an amount held in all and by each peer (an
//! address, or a uid on a UNIX socket), each under its own limit. A
//! listener's connections are counted in it one by one
//! ([`crate::protocol::listen`]), the request bodies being received in
//! bytes ([`crate::service::request_bodies`]).

use std::collections::HashMap;
use std::net::IpAddr;

use parking_lot::Mutex;

/// Who holds part of a bound.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Peer {
    /// A TCP peer's address (an IPv4-mapped IPv6 address as IPv4).
    Address(IpAddr),
    /// A UNIX-socket peer's uid, as the kernel reports it.
    User(u32),
    /// A peer the kernel could not name: bounded together.
    Unknown,
}

/// Which limit an amount would pass.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Over {
    /// The limit of all peers together.
    All,
    /// The limit of one peer.
    Peer,
}

/// See the module documentation.
#[derive(Debug)]
pub struct Shares {
    limit: usize,
    per_peer: usize,
    held: Mutex<Held>,
}

#[derive(Debug, Default)]
struct Held {
    total: usize,
    /// Only peers that hold something: the map does not grow with peers
    /// that came and went.
    by_peer: HashMap<Peer, usize>,
}

impl Shares {
    pub fn new(limit: usize, per_peer: usize) -> Shares {
        Shares {
            limit,
            per_peer,
            held: Mutex::default(),
        }
    }

    /// The limit of all peers together.
    pub fn limit(&self) -> usize {
        self.limit
    }

    /// The limit of one peer.
    pub fn per_peer(&self) -> usize {
        self.per_peer
    }

    /// Takes `amount` for `peer`, or says which limit it would pass (and
    /// takes nothing).
    pub fn take(&self, peer: Peer, amount: usize) -> Result<(), Over> {
        if amount == 0 {
            return Ok(());
        }
        let mut held = self.held.lock();
        let total = held.total.saturating_add(amount);
        if total > self.limit {
            return Err(Over::All);
        }
        let from_peer = held.by_peer.get(&peer).copied().unwrap_or(0);
        let after = from_peer.saturating_add(amount);
        if after > self.per_peer {
            return Err(Over::Peer);
        }
        held.by_peer.insert(peer, after);
        held.total = total;
        Ok(())
    }

    /// Gives back `amount` that `peer` took.
    pub fn give_back(&self, peer: Peer, amount: usize) {
        if amount == 0 {
            return;
        }
        let mut held = self.held.lock();
        held.total = held.total.saturating_sub(amount);
        if let Some(from_peer) = held.by_peer.get_mut(&peer) {
            *from_peer = from_peer.saturating_sub(amount);
            if *from_peer == 0 {
                held.by_peer.remove(&peer);
            }
        }
    }

    /// What all peers hold now.
    pub fn held(&self) -> usize {
        self.held.lock().total
    }

    /// How many peers hold something now.
    pub fn peers(&self) -> usize {
        self.held.lock().by_peer.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn peer(last: u8) -> Peer {
        Peer::Address(IpAddr::from([127, 0, 0, last]))
    }

    #[test]
    fn the_shares_hold_what_fits_and_take_back_what_is_given() {
        let shares = Shares::new(10, 10);
        assert_eq!(shares.take(peer(1), 6), Ok(()));
        assert_eq!(shares.take(peer(1), 5), Err(Over::All));
        assert_eq!(shares.take(peer(1), 4), Ok(()));
        shares.give_back(peer(1), 6);
        assert_eq!(shares.held(), 4);
        assert_eq!(shares.take(peer(1), 6), Ok(()));
    }

    #[test]
    fn one_peer_cannot_take_what_the_others_need() {
        let shares = Shares::new(10, 4);
        assert_eq!(shares.take(peer(1), 4), Ok(()));
        assert_eq!(shares.take(peer(1), 1), Err(Over::Peer));
        assert_eq!(shares.take(peer(2), 4), Ok(()));
        shares.give_back(peer(1), 4);
        shares.give_back(peer(2), 4);
        assert_eq!(shares.held(), 0);
        assert_eq!(shares.peers(), 0);
    }

    #[test]
    fn nothing_taken_leaves_no_trace_of_the_peer() {
        let shares = Shares::new(10, 4);
        assert_eq!(shares.take(peer(1), 0), Ok(()));
        assert_eq!(shares.take(peer(2), 5), Err(Over::Peer));
        assert_eq!(shares.peers(), 0);
    }
}
