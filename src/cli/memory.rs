//! The agent's memory budgets, sized at start inside the memory it may use
//! (its cgroup's limit, else the machine's: [`crate::model::memory_limit`]):
//! the flight recorder (`--store-size`) and the traces being built and sent
//! (`--capture-memory`), both `auto` by default, beside what the agent needs
//! whatever it is asked (its ring, the requests it is receiving, its own
//! code and runtime). Budgets that cannot fit are refused at start, naming
//! the limit and where it comes from, rather than found out by the OOM
//! killer.

use crate::model::memory_limit::MemoryLimit;
use crate::model::units::parse_size;

/// The flight recorder's size when `auto` leaves room for more.
pub const STORE_AT_MOST: usize = 512 << 20;
/// The capture budget when `auto` leaves room for more.
pub const CAPTURE_AT_MOST: usize = 2 << 30;
/// What the agent's code, runtime, threads and small tables take.
pub const AGENT_ITSELF: u64 = 96 << 20;
/// The least either budget may be.
const AT_LEAST: usize = 1 << 20;

/// A budget as configured: sized at start, or given.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MemorySize {
    Auto,
    Bytes(usize),
}

impl std::fmt::Display for MemorySize {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            MemorySize::Auto => f.write_str("auto"),
            MemorySize::Bytes(bytes) => write!(f, "{}", mib(*bytes as u64)),
        }
    }
}

/// A flight recorder's size: `auto`, or at least 1MiB.
pub fn parse_store_size(text: &str) -> Result<MemorySize, String> {
    parse_memory_size(
        text,
        AT_LEAST,
        "1MiB, the least that lets captures hold anything",
    )
}

/// A capture budget: `auto`, or at least 1KiB (a small one makes captures
/// take turns).
pub fn parse_capture_memory(text: &str) -> Result<MemorySize, String> {
    parse_memory_size(text, 1 << 10, "1KiB")
}

/// `--spill-size`: disk space for spilled traces, or none.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SpillSize {
    Off,
    Bytes(u64),
}

/// Disk space for spilled traces: `off`, or at least 1MiB.
pub fn parse_spill_size(text: &str) -> Result<SpillSize, String> {
    if text.trim() == "off" {
        return Ok(SpillSize::Off);
    }
    let bytes = parse_size(text).map_err(|e| e.to_string())?;
    if bytes < AT_LEAST {
        return Err(format!("{bytes} bytes is less than 1MiB (or off)"));
    }
    Ok(SpillSize::Bytes(bytes as u64))
}

fn parse_memory_size(text: &str, least: usize, shown: &str) -> Result<MemorySize, String> {
    if text.trim() == "auto" {
        return Ok(MemorySize::Auto);
    }
    let bytes = parse_size(text).map_err(|e| e.to_string())?;
    if bytes < least {
        return Err(format!("{bytes} bytes is less than {shown} (or auto)"));
    }
    Ok(MemorySize::Bytes(bytes))
}

/// The budgets the agent runs with, and what they were sized in.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Budgets {
    pub limit: MemoryLimit,
    /// What the agent needs besides the budgets.
    pub fixed: u64,
    pub store: usize,
    pub capture: usize,
    /// Whether each was sized by `auto` (not given).
    pub auto_store: bool,
    pub auto_capture: bool,
}

/// Below this, a budget `auto` sized holds too little for a capture of a
/// busy host (two seconds of 50,000 events a second take some 10 MiB to
/// build).
const SCANT: usize = 32 << 20;

impl Budgets {
    /// What is wrong with budgets the memory limit left scant, if they are
    /// (sizes given are the operator's to choose).
    pub fn scant(&self) -> Option<String> {
        let store_scant = self.auto_store && self.store < SCANT;
        let capture_scant = self.auto_capture && self.capture < SCANT;
        if !store_scant && !capture_scant {
            return None;
        }
        Some(format!(
            "the flight recorder ({}) or capture memory ({}) is under {}: captures of a busy \
             host will be cut short or refused (RESOURCE_EXHAUSTED). Raise the memory limit \
             ({}), or lower --ring-capacity to leave the budgets more",
            mib(self.store as u64),
            mib(self.capture as u64),
            mib(SCANT as u64),
            self.limit.source
        ))
    }

    /// One line for the log at start.
    pub fn describe(&self) -> String {
        format!(
            "{} may be used ({}): flight recorder {}, capture memory {}, and {} for the rings, \
             requests being received and the agent itself",
            mib(self.limit.bytes),
            self.limit.source,
            mib(self.store as u64),
            mib(self.capture as u64),
            mib(self.fixed),
        )
    }
}

/// A size as the log says it (`512 MiB`, `4.0 GiB`).
pub(super) fn mib(bytes: u64) -> String {
    if bytes >= 1 << 40 {
        format!("{:.1} TiB", bytes as f64 / (1u64 << 40) as f64)
    } else if bytes >= 1 << 30 {
        format!("{:.1} GiB", bytes as f64 / (1u64 << 30) as f64)
    } else {
        format!("{} MiB", bytes >> 20)
    }
}

/// Sizes the budgets inside `limit`, beside the rings' `ring_bytes` (the
/// shared-memory ring and the eBPF backend's ring buffers) and
/// `receiving` bytes of requests: an `auto` flight recorder takes half of
/// what is left (at most [`STORE_AT_MOST`]), an `auto` capture budget the
/// rest (at most [`CAPTURE_AT_MOST`]). Given sizes that do not fit are an
/// error saying by how much.
pub fn size(
    limit: MemoryLimit,
    ring_bytes: u64,
    receiving: u64,
    store: MemorySize,
    capture: MemorySize,
) -> Result<Budgets, String> {
    let fixed = ring_bytes
        .saturating_add(receiving)
        .saturating_add(AGENT_ITSELF);
    let available = limit.bytes.saturating_sub(fixed);
    // What the agent needs whatever its budgets, as the errors say it.
    let besides = format!(
        "{} (the rings {}, requests being received {}, itself {})",
        mib(fixed),
        mib(ring_bytes),
        mib(receiving),
        mib(AGENT_ITSELF)
    );
    if available < 2 * AT_LEAST as u64 {
        return Err(format!(
            "the agent needs {besides} besides its budgets, and {} may be used: {}. Raise the \
             limit, or lower --ring-capacity (or --ebpf-ring-size)",
            mib(limit.bytes),
            limit.source
        ));
    }
    let clamp = |bytes: u64, most: usize| bytes.min(most as u64).max(AT_LEAST as u64) as usize;
    let (store_bytes, capture_bytes) = match (store, capture) {
        (MemorySize::Bytes(store), MemorySize::Bytes(capture)) => (store, capture),
        (MemorySize::Bytes(store), MemorySize::Auto) => (
            store,
            clamp(available.saturating_sub(store as u64), CAPTURE_AT_MOST),
        ),
        (MemorySize::Auto, MemorySize::Bytes(capture)) => (
            clamp(available.saturating_sub(capture as u64), STORE_AT_MOST),
            capture,
        ),
        (MemorySize::Auto, MemorySize::Auto) => {
            let store = clamp(available / 2, STORE_AT_MOST);
            (store, clamp(available - store as u64, CAPTURE_AT_MOST))
        }
    };
    let wanted = store_bytes as u64 + capture_bytes as u64;
    if wanted > available {
        let shown = |size: MemorySize, bytes: usize| match size {
            MemorySize::Auto => format!("{} (auto, the least)", mib(bytes as u64)),
            MemorySize::Bytes(_) => mib(bytes as u64),
        };
        return Err(format!(
            "--store-size {} and --capture-memory {} need {}, and with the {besides} the agent \
             needs besides that is more than the {} it may use: {}. Lower them (auto sizes them \
             to fit), or raise the limit",
            shown(store, store_bytes),
            shown(capture, capture_bytes),
            mib(wanted),
            mib(limit.bytes),
            limit.source
        ));
    }
    Ok(Budgets {
        limit,
        fixed,
        store: store_bytes,
        capture: capture_bytes,
        auto_store: store == MemorySize::Auto,
        auto_capture: capture == MemorySize::Auto,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::memory_limit::LimitSource;

    const MIB: u64 = 1 << 20;

    fn limit(bytes: u64) -> MemoryLimit {
        MemoryLimit {
            bytes,
            source: LimitSource::Cgroup("/sys/fs/cgroup/x/memory.max".into()),
        }
    }

    #[test]
    fn auto_budgets_fit_a_one_gib_unit_and_keep_the_old_defaults_on_a_big_machine() {
        let small = size(
            limit(1024 * MIB),
            128 * MIB,
            64 * MIB,
            MemorySize::Auto,
            MemorySize::Auto,
        )
        .unwrap();
        assert!(small.store as u64 + small.capture as u64 + small.fixed <= 1024 * MIB);
        assert_eq!(small.store as u64, (1024 - 128 - 64 - 96) * MIB / 2);
        let big = size(
            limit(64 << 30),
            128 * MIB,
            64 * MIB,
            MemorySize::Auto,
            MemorySize::Auto,
        )
        .unwrap();
        assert_eq!((big.store, big.capture), (STORE_AT_MOST, CAPTURE_AT_MOST));
    }

    #[test]
    fn budgets_a_small_limit_leaves_scant_are_warned_of() {
        // Beside the default rings, in a limit of `mib` MiB.
        let sized = |mib: u64, store, capture| {
            size(limit(mib * MIB), 136 * MIB, 64 * MIB, store, capture).unwrap()
        };
        // A 300 MiB cgroup: 1 MiB each.
        let scant = sized(300, MemorySize::Auto, MemorySize::Auto);
        let warning = scant.scant().expect("scant budgets");
        assert!(warning.contains("memory.max"), "{warning}");
        let fine = sized(1024, MemorySize::Auto, MemorySize::Auto);
        assert_eq!(fine.scant(), None);
        // Sizes given are the operator's choice.
        let small = MemorySize::Bytes(2 << 20);
        assert_eq!(sized(1024, small, small).scant(), None);
    }

    #[test]
    fn given_budgets_that_do_not_fit_are_refused_naming_the_limit() {
        let refused = size(
            limit(1024 * MIB),
            128 * MIB,
            64 * MIB,
            MemorySize::Bytes(512 << 20),
            MemorySize::Bytes(2 << 30),
        )
        .unwrap_err();
        assert!(
            refused.contains("--store-size 512 MiB and --capture-memory 2.0 GiB")
                && refused.contains("/sys/fs/cgroup/x/memory.max"),
            "{refused}"
        );
    }

    #[test]
    fn an_auto_budget_takes_what_a_given_one_leaves() {
        let budgets = size(
            limit(1024 * MIB),
            128 * MIB,
            64 * MIB,
            MemorySize::Bytes(600 << 20),
            MemorySize::Auto,
        )
        .unwrap();
        assert_eq!(budgets.capture as u64, (1024 - 288 - 600) * MIB);
    }

    #[test]
    fn a_limit_below_what_the_agent_needs_regardless_is_refused() {
        let refused = size(
            limit(200 * MIB),
            128 * MIB,
            64 * MIB,
            MemorySize::Auto,
            MemorySize::Auto,
        )
        .unwrap_err();
        assert!(refused.contains("lower --ring-capacity"), "{refused}");
    }

    #[test]
    fn sizes_are_auto_or_at_least_their_least() {
        assert_eq!(parse_store_size("auto"), Ok(MemorySize::Auto));
        assert_eq!(parse_store_size("2GiB"), Ok(MemorySize::Bytes(2 << 30)));
        assert!(parse_store_size("0")
            .unwrap_err()
            .contains("less than 1MiB"));
        assert_eq!(parse_capture_memory("1KiB"), Ok(MemorySize::Bytes(1 << 10)));
        assert!(parse_capture_memory("1").is_err());
    }
}
