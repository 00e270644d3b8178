//! A `ProfileRequest` read: every field validated and the capture it asks
//! for planned, and how long the caller is prepared to wait.

use prost::Message;
use tonic::Status;

use super::ServiceConfig;
use crate::backend::Loss;
use crate::backend::Scope;
use crate::capture::Plan;
use crate::clock;
use crate::model::calendar::session_timestamp;
use crate::proto::tensorflow::profile_options::advanced_config_value;
use crate::proto::tensorflow::{ProfileOptions, ProfileRequest};
use crate::protocol::caller::{Caller, Owner};
use crate::protocol::RIEGELI_TOOL;
use crate::recorder::Window;
use crate::service::validate::{self, invalid};

/// Validates every field of a `ProfileRequest` against the operator's
/// `config` and plans its capture; `losses_at_start` are the backends' loss
/// totals now. `require_duration` is false for continuous profiling, where
/// the window is open-ended.
pub fn plan(
    config: &ServiceConfig,
    request: &ProfileRequest,
    require_duration: bool,
    losses_at_start: Vec<(&'static str, Loss)>,
) -> Result<Plan, Status> {
    let options = request.opts.clone().unwrap_or_default();
    let modern = options.version != 0;
    let duration_ms = if modern && options.duration_ms != 0 {
        options.duration_ms
    } else {
        request.duration_ms
    };
    let duration_field = if modern {
        "opts.duration_ms"
    } else {
        "duration_ms"
    };
    if require_duration && duration_ms == 0 {
        return Err(invalid(
            duration_field,
            "must be greater than 0 (the length of the capture window in milliseconds)",
        ));
    }
    let max_ms = config.max_duration.as_millis() as u64;
    if duration_ms > max_ms {
        return Err(invalid(
            duration_field,
            format!(
                "{duration_ms} ms exceeds this agent's maximum of {max_ms} ms (--max-duration, \
                 by default a little under --store-retention: the flight recorder holds no longer a window)"
            ),
        ));
    }
    let now = clock::now_ns();
    let mut warnings = Vec::new();
    let start_ns = if modern && options.start_timestamp_ns != 0 {
        let latest = now.saturating_add(clock::duration_ns(config.max_start_delay));
        if options.start_timestamp_ns > latest {
            return Err(invalid(
                "opts.start_timestamp_ns",
                format!(
                    "starts {:.1} s from now; at most {} s ahead is accepted",
                    (options.start_timestamp_ns - now) as f64 / 1e9,
                    config.max_start_delay.as_secs()
                ),
            ));
        }
        options.start_timestamp_ns
    } else {
        now
    };
    validate::name_component("session_id", &request.session_id)?;
    validate::name_component("host_name", &request.host_name)?;
    validate::name_component("opts.override_hostname", &options.override_hostname)?;
    validate::name_component("opts.session_id", &options.session_id)?;
    validate::client_path("repository_root", &request.repository_root)?;
    validate::client_path("opts.repository_path", &options.repository_path)?;
    let legacy_override = match options
        .advanced_configuration
        .get("override_hostname")
        .and_then(|v| v.value.as_ref())
    {
        Some(advanced_config_value::Value::StringValue(s)) => s.clone(),
        _ => String::new(),
    };
    validate::name_component(
        "opts.advanced_configuration[override_hostname]",
        &legacy_override,
    )?;
    let attach = attach_pids(&options)?;
    let file_host = [&options.override_hostname, &legacy_override]
        .into_iter()
        .find(|h| !h.is_empty())
        .cloned()
        .unwrap_or_else(|| {
            if request.host_name.is_empty() {
                config.hostname.clone()
            } else {
                request.host_name.replace(':', "_")
            }
        });
    let longest_host = crate::xspace::chunks::LONGEST_HOST_PART;
    if file_host.len() > longest_host {
        let field = if !options.override_hostname.is_empty() {
            "opts.override_hostname"
        } else if !legacy_override.is_empty() {
            "opts.advanced_configuration[override_hostname]"
        } else {
            "host_name"
        };
        return Err(invalid(
            field,
            format!(
                "{} bytes: the trace's file is named after it, and a file name holds at most {} \
                 bytes, so a host name at most {longest_host}",
                file_host.len(),
                validate::MAX_NAME_LEN
            ),
        ));
    }
    let generated_session_id = request.session_id.is_empty() && options.session_id.is_empty();
    let session_id = if !request.session_id.is_empty() {
        request.session_id.clone()
    } else if !options.session_id.is_empty() {
        options.session_id.clone()
    } else {
        session_timestamp()
    };
    // A start a little in the past is network latency; a large one is a
    // deliberate look into the flight recorder, worth saying so.
    if now.saturating_sub(start_ns) > 1_000_000_000 {
        warnings.push(format!(
            "capture window starts {:.3} s before the request arrived; served from the flight recorder",
            (now - start_ns) as f64 / 1e9
        ));
    }
    Ok(Plan {
        window: Window {
            start_ns,
            stop_ns: start_ns.saturating_add(duration_ms.saturating_mul(1_000_000)),
        },
        session_id,
        generated_session_id,
        file_host,
        repository_root: request.repository_root.clone(),
        emit_xspace: request.emit_xspace,
        takes_chunks: request.tools.iter().any(|tool| tool == RIEGELI_TOOL),
        options: options.encode_to_vec(),
        warnings,
        losses_at_start,
        properties: Vec::new(),
        // TensorFlow reads no option of a version-0 request but this one.
        detailed_device: modern && options.device_tracer_level >= 2,
        // Named by the handler, which knows the connection; until then it
        // acts as nobody would and sees nothing.
        caller: Caller::Unknown,
        scope: Scope::NO_ONE,
        memory_owner: Some(Owner::Unnamed),
        attach,
        via: Vec::new(),
    })
}

/// The key of `ProfileOptions.advanced_configuration` that names processes
/// to attach the injection library to before the window (`devtrace
/// capture --attach`): a string of comma-separated pids.
pub const ATTACH_KEY: &str = "devtrace_attach";

/// Processes one capture may ask to attach.
const MAX_ATTACH: usize = 64;

fn attach_pids(options: &ProfileOptions) -> Result<Vec<i32>, Status> {
    let field = "opts.advanced_configuration[devtrace_attach]";
    let Some(value) = options.advanced_configuration.get(ATTACH_KEY) else {
        return Ok(Vec::new());
    };
    let Some(advanced_config_value::Value::StringValue(text)) = &value.value else {
        return Err(invalid(field, "must be a string of comma-separated pids"));
    };
    let pids: Vec<i32> = text
        .split(',')
        .map(|pid| pid.trim().parse::<i32>().ok().filter(|pid| *pid > 0))
        .collect::<Option<_>>()
        .ok_or_else(|| invalid(field, format!("{text:?} is not a list of pids")))?;
    if pids.len() > MAX_ATTACH {
        return Err(invalid(
            field,
            format!("names {} processes; at most {MAX_ATTACH}", pids.len()),
        ));
    }
    Ok(pids)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn naming(value: advanced_config_value::Value) -> ProfileOptions {
        let mut options = ProfileOptions::default();
        options.advanced_configuration.insert(
            ATTACH_KEY.into(),
            crate::proto::tensorflow::profile_options::AdvancedConfigValue { value: Some(value) },
        );
        options
    }

    #[test]
    fn processes_to_attach_are_a_short_list_of_pids() {
        use advanced_config_value::Value;
        assert_eq!(
            attach_pids(&ProfileOptions::default()).unwrap(),
            Vec::<i32>::new()
        );
        let listed = naming(Value::StringValue("12, 345".into()));
        assert_eq!(attach_pids(&listed).unwrap(), vec![12, 345]);
        for bad in ["", "12,x", "-3", "0"] {
            let refused = attach_pids(&naming(Value::StringValue(bad.into()))).unwrap_err();
            assert!(refused.message().contains("devtrace_attach"), "{refused:?}");
        }
        let many: Vec<String> = (1..=65).map(|p| p.to_string()).collect();
        assert!(attach_pids(&naming(Value::StringValue(many.join(",")))).is_err());
        assert!(attach_pids(&naming(Value::Int64Value(12))).is_err());
    }

    fn config() -> ServiceConfig {
        ServiceConfig {
            hostname: "agent-host".to_string(),
            max_duration: Duration::from_secs(60),
            max_start_delay: Duration::from_secs(10),
            ..ServiceConfig::default()
        }
    }

    /// A request as TensorFlow 2.x's client sends it (`opts.version` 1).
    fn modern(options: ProfileOptions) -> ProfileRequest {
        ProfileRequest {
            opts: Some(ProfileOptions {
                version: 1,
                ..options
            }),
            ..ProfileRequest::default()
        }
    }

    fn refused_field(result: Result<Plan, Status>) -> String {
        let status = result.expect_err("refused");
        assert_eq!(status.code(), tonic::Code::InvalidArgument);
        status
            .message()
            .split(':')
            .next()
            .unwrap_or_default()
            .to_string()
    }

    #[test]
    fn a_modern_request_is_timed_by_its_options_and_a_legacy_one_by_its_own_field() {
        let plan = plan(
            &config(),
            &modern(ProfileOptions {
                duration_ms: 1500,
                ..ProfileOptions::default()
            }),
            true,
            Vec::new(),
        )
        .unwrap();
        assert_eq!(plan.window.duration_ns(), 1_500_000_000);
        let legacy = ProfileRequest {
            duration_ms: 250,
            opts: Some(ProfileOptions {
                duration_ms: 9_000,
                ..ProfileOptions::default()
            }),
            ..ProfileRequest::default()
        };
        let plan = super::plan(&config(), &legacy, true, Vec::new()).unwrap();
        assert_eq!(plan.window.duration_ns(), 250_000_000);
        assert!(plan.generated_session_id);
        assert_eq!(plan.file_host, "agent-host");
    }

    #[test]
    fn windows_too_long_too_far_ahead_or_empty_are_refused_by_field() {
        let long = modern(ProfileOptions {
            duration_ms: 61_000,
            ..ProfileOptions::default()
        });
        assert_eq!(
            refused_field(plan(&config(), &long, true, Vec::new())),
            "opts.duration_ms"
        );
        let ahead = modern(ProfileOptions {
            duration_ms: 10,
            start_timestamp_ns: clock::now_ns() + 60_000_000_000,
            ..ProfileOptions::default()
        });
        assert_eq!(
            refused_field(plan(&config(), &ahead, true, Vec::new())),
            "opts.start_timestamp_ns"
        );
        let empty = ProfileRequest::default();
        assert_eq!(
            refused_field(plan(&config(), &empty, true, Vec::new())),
            "duration_ms"
        );
        // Continuous profiling has no window length.
        assert!(plan(&config(), &empty, false, Vec::new()).is_ok());
    }

    #[test]
    fn names_that_would_leave_the_session_folder_are_refused() {
        let request = ProfileRequest {
            duration_ms: 10,
            session_id: "../x".to_string(),
            ..ProfileRequest::default()
        };
        assert_eq!(
            refused_field(plan(&config(), &request, true, Vec::new())),
            "session_id"
        );
        let request = modern(ProfileOptions {
            duration_ms: 10,
            override_hostname: "a/b".to_string(),
            ..ProfileOptions::default()
        });
        assert_eq!(
            refused_field(plan(&config(), &request, true, Vec::new())),
            "opts.override_hostname"
        );
    }

    #[test]
    fn the_trace_is_named_by_the_override_then_the_callers_host_name() {
        let request = ProfileRequest {
            duration_ms: 10,
            host_name: "worker:6009".to_string(),
            session_id: "mine".to_string(),
            ..ProfileRequest::default()
        };
        let planned = plan(&config(), &request, true, Vec::new()).unwrap();
        assert_eq!(planned.file_host, "worker_6009");
        assert_eq!(planned.session_id, "mine");
        assert!(!planned.generated_session_id);
        let request = modern(ProfileOptions {
            duration_ms: 10,
            override_hostname: "chosen".to_string(),
            ..ProfileOptions::default()
        });
        assert_eq!(
            plan(&config(), &request, true, Vec::new())
                .unwrap()
                .file_host,
            "chosen"
        );
    }

    #[test]
    fn a_window_well_in_the_past_says_it_is_served_from_the_flight_recorder() {
        let request = modern(ProfileOptions {
            duration_ms: 10,
            start_timestamp_ns: clock::now_ns() - 5_000_000_000,
            ..ProfileOptions::default()
        });
        let planned = plan(&config(), &request, true, Vec::new()).unwrap();
        assert!(
            planned.warnings[0].contains("served from the flight recorder"),
            "{:?}",
            planned.warnings
        );
    }
}
