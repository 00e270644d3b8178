//! A capture's plan: the window to build and everything about the request
//! that shapes its trace or where it goes, after validation. The services
//! make plans from requests; a trigger makes one for the window it saves.

use prost::Message;

use crate::backend::{Loss, Scope};
use crate::protocol::caller::{Caller, Owner};
use crate::protocol::client;
use crate::recorder::Window;

/// See the module documentation.
#[derive(Clone, Debug)]
pub struct Plan {
    pub window: Window,
    pub session_id: String,
    /// The client named no session: `session_id` is a timestamp, and the
    /// directory gets a suffix when another capture took that name.
    pub generated_session_id: bool,
    /// Base name of the trace file (`<host>.xplane.pb`).
    pub file_host: String,
    pub repository_root: String,
    pub emit_xspace: bool,
    /// The client takes a trace too large for one XSpace as
    /// `xplane.riegeli` tool data even though it set `emit_xspace`, and
    /// writes it itself: it lists that tool in the request's `tools`, as a
    /// session's fan-out does ([`crate::fleet::fan_out`]).
    pub takes_chunks: bool,
    /// The request's encoded `ProfileOptions`, recorded in the trace.
    pub options: Vec<u8>,
    /// Said in this capture's reply alone (not in a build it shares).
    pub warnings: Vec<String>,
    /// Backends' running loss totals when the request arrived.
    pub losses_at_start: Vec<(&'static str, Loss)>,
    /// Facts for the Task Environment beyond the backends' (a trigger's).
    pub properties: Vec<(String, String)>,
    /// The client asked for device-specific detail
    /// (`device_tracer_level` 2 or more).
    pub detailed_device: bool,
    /// Who asked: files the capture writes are written with its rights.
    pub caller: Caller,
    /// Whose processes the trace holds (from who asked).
    pub scope: Scope,
    /// The caller whose share of `--capture-memory` the build draws from
    /// ([`super::memory`]); none for admins and the agent.
    pub memory_owner: Option<Owner>,
    /// Processes to load the injection library into before the window
    /// (`opts.advanced_configuration["devtrace_attach"]`).
    pub attach: Vec<i32>,
    /// The agents the capture passed through on its way here, along their
    /// `--upstream`s ([`crate::protocol::via`]); none for a client's.
    pub via: Vec<u64>,
}

impl Plan {
    /// The plan of a save of `window` from the flight recorder into
    /// session `session_id`, made for it beforehand, on this host, with the
    /// options a default client capture sends and `properties` in its Task
    /// Environment: what a trigger saves.
    pub fn save(
        window: Window,
        session_id: &str,
        hostname: &str,
        properties: Vec<(String, String)>,
        losses_at_start: Vec<(&'static str, Loss)>,
    ) -> Plan {
        let duration_ms = window.duration_ns().div_ceil(1_000_000);
        Plan {
            window,
            session_id: session_id.to_string(),
            generated_session_id: false,
            file_host: hostname.to_string(),
            repository_root: String::new(),
            emit_xspace: false,
            takes_chunks: false,
            options: client::default_profile_options(duration_ms, window.start_ns).encode_to_vec(),
            warnings: Vec::new(),
            losses_at_start,
            properties,
            detailed_device: false,
            caller: Caller::Agent,
            scope: Scope::Host,
            memory_owner: None,
            attach: Vec::new(),
            via: Vec::new(),
        }
    }
}
