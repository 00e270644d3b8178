//! The agents a call passed through on its way along `--upstream`s (a
//! capture) or taps (a forwarded call), so that an upstream that leads back
//! to an agent or tap already passed (itself, or one further down the
//! chain) is refused at once: without it, each agent of the loop asked the
//! next for the same window until every deadline ran out, and the trace
//! said only that an upstream did not answer; a tap forwarded to itself
//! until the client gave up.
//!
//! Each agent, and each tap, has a random id for its life. One that passes
//! a call on sends the ids of those it passed through, its own last, as
//! request metadata; other servers (TensorFlow's, JAX's) ignore it.

use std::hash::{BuildHasher, Hasher};
use std::sync::OnceLock;

/// The metadata naming the agents a capture passed through: their ids in
/// hexadecimal, separated by commas.
pub const VIA_HEADER: &str = "devtrace-via";

/// Most ids read from a request: a chain longer than this is no fleet's.
pub const MAX_HOPS: usize = 32;

/// This agent's id (its profiler service's), the same for the life of the
/// process.
pub fn this_agent() -> u64 {
    static ID: OnceLock<u64> = OnceLock::new();
    *ID.get_or_init(new_id)
}

/// A new random id, for an agent or a tap.
pub fn new_id() -> u64 {
    // Seeded from the system's randomness, as every `RandomState` is.
    let mut hasher = std::collections::hash_map::RandomState::new().build_hasher();
    hasher.write_u32(std::process::id());
    hasher.finish()
}

/// The agents a request passed through, as its metadata names them: what
/// cannot be read is left out (a peer's words, used only to refuse a loop).
pub fn of_request(headers: &http::HeaderMap) -> Vec<u64> {
    headers
        .get(VIA_HEADER)
        .and_then(|value| value.to_str().ok())
        .map(|text| {
            text.split(',')
                .filter_map(|id| u64::from_str_radix(id.trim(), 16).ok())
                .take(MAX_HOPS)
                .collect()
        })
        .unwrap_or_default()
}

/// The header value naming `agents`; `None` for none.
pub fn header_value(agents: &[u64]) -> Option<http::HeaderValue> {
    if agents.is_empty() {
        return None;
    }
    let text: Vec<String> = agents.iter().map(|id| format!("{id:x}")).collect();
    http::HeaderValue::from_str(&text.join(",")).ok()
}

/// The chain a call passed on carries: those it passed through, then
/// `own` (the agent's or the tap's id), within [`MAX_HOPS`].
pub fn onwards(passed: &[u64], own: u64) -> Vec<u64> {
    let mut chain: Vec<u64> = passed.iter().copied().take(MAX_HOPS - 1).collect();
    chain.push(own);
    chain
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_chain_goes_there_and_back_and_garbage_is_left_out() {
        let chain = onwards(&[0xabc, 7], this_agent());
        assert_eq!(chain, [0xabc, 7, this_agent()]);
        let mut headers = http::HeaderMap::new();
        headers.insert(VIA_HEADER, header_value(&chain).unwrap());
        assert_eq!(of_request(&headers), chain);

        let mut hostile = http::HeaderMap::new();
        let long: Vec<String> = (0..1000).map(|i| format!("{i:x}")).collect();
        let text = format!("zz, ,{},-1", long.join(","));
        hostile.insert(VIA_HEADER, text.parse().unwrap());
        let read = of_request(&hostile);
        assert_eq!(read.len(), MAX_HOPS);
        assert_eq!(read[0], 0);
        assert!(of_request(&http::HeaderMap::new()).is_empty());
        assert!(header_value(&[]).is_none());
        assert_eq!(onwards(&read, 1).len(), MAX_HOPS, "bounded onwards too");
        assert_ne!(new_id(), new_id(), "each tap has an id of its own");
    }
}
