//! `Monitor`: a short window of the devices' activity summarised as text
//! and numbers (idle time, step times, sampled counters), as TensorBoard's
//! capture dialog and `capture_tpu_profile --monitoring_level` show it.

use tonic::Status;

use super::ProfilerService;
use crate::analysis;
use crate::capture::scope::Visibility;
use crate::clock;
use crate::proto::tensorflow::profiler_service_monitor_result::ResponseType;
use crate::proto::tensorflow::{MonitorRequest, MonitorResponse, ProfilerServiceMonitorResult};
use crate::protocol::caller::{Caller, Owner};
use crate::recorder::Window;
use crate::service::validate::invalid;

impl ProfilerService {
    /// `Monitor`: how busy the devices were over the next
    /// `duration_ms`, as text and as numbers, with the agent's own state
    /// at `monitoring_level` 2.
    pub(super) async fn monitor_report(
        &self,
        request: MonitorRequest,
        caller: Caller,
    ) -> Result<MonitorResponse, Status> {
        if request.duration_ms == 0 {
            return Err(invalid("duration_ms", "must be greater than 0"));
        }
        let max_ms = self.config.max_duration.as_millis() as u64;
        if request.duration_ms > max_ms {
            return Err(invalid(
                "duration_ms",
                format!(
                    "{} ms exceeds this agent's maximum of {max_ms} ms",
                    request.duration_ms
                ),
            ));
        }
        if !(0..=2).contains(&request.monitoring_level) {
            return Err(invalid("monitoring_level", "must be 0, 1 or 2"));
        }
        let scope = self.scope_of(&caller)?;
        let _slot = self.monitor_slot(&caller)?;
        let _active = self.agent.monitor_activity();
        let start_ns = clock::now_ns();
        let window = Window {
            start_ns,
            stop_ns: start_ns + request.duration_ms * 1_000_000,
        };
        let (data, registry) = self
            .agent
            .collect(window, None)
            .await
            .map_err(|e| Status::internal(e.to_string()))?;
        // A user who is not an admin is told of its own processes' devices
        // alone, as its captures are.
        let visibility = Visibility::of(scope, &self.agent.process_lines(window));
        let visible = data
            .events()
            .filter(|event| visibility.as_ref().is_none_or(|v| v.keeps(event)));
        let usage = analysis::utilization(visible, window);
        let mut result = ProfilerServiceMonitorResult::default();
        let mut text = String::new();
        if request.timestamp {
            text.push_str(&format!(
                "timestamp: {} (Unix ms)\n",
                window.stop_ns / 1_000_000
            ));
        }
        text.push_str(&format!(
            "devtrace on {} over {} ms\n",
            self.config.hostname, request.duration_ms
        ));
        if let Some(idle) = usage.idle_percent() {
            result.response_type = ResponseType::UtilIdle as i32;
            result.device_idle_time_percent = idle;
            for (ordinal, busy) in &usage.device_busy {
                text.push_str(&format!("GPU {ordinal}: {:.1}% busy\n", busy * 100.0));
            }
            text.push_str(&format!("device idle time: {idle:.1}%\n"));
        } else if let Some(busy) = sampled_busy_percent(&usage, &registry) {
            // No kernel timeline, but NVML sampled how busy the SMs were.
            result.response_type = ResponseType::UtilIdle as i32;
            result.device_idle_time_percent = 100.0 - busy;
            text.push_str(&format!(
                "device idle time: {:.1}% (sampled)\n",
                100.0 - busy
            ));
        } else {
            result.response_type = ResponseType::UtilOnly as i32;
            text.push_str("no device activity in this period\n");
        }
        // Device health from counter backends (NVML): the mean over the period.
        for ((ordinal, name), mean) in &usage.counter_means {
            text.push_str(&format!(
                "GPU {ordinal} {}: {mean:.1}\n",
                registry.name(*name)
            ));
        }
        if let Some((avg, min, max)) = usage.step_times_ms() {
            result.response_type = ResponseType::UtilIdleStep as i32;
            result.step_time_ms_avg = avg;
            result.step_time_ms_min = min;
            result.step_time_ms_max = max;
            text.push_str(&format!(
                "step time: avg {avg:.2} ms, min {min:.2} ms, max {max:.2} ms ({} steps)\n",
                usage.step_durations_ns.len()
            ));
        }
        if data.dropped() > 0 {
            text.push_str(&format!("dropped events: {}\n", data.dropped()));
        }
        // The agent's own state names other users' processes and rings.
        if request.monitoring_level >= 2 && self.config.access.is_admin(&caller) {
            for (name, health) in self.agent.backend_health() {
                text.push_str(&format!("backend {name}: {health}\n"));
            }
            let captures: usize = self.running.lock().values().map(Vec::len).sum();
            text.push_str(&format!("captures in progress: {captures}\n"));
            let (builds, reuses) = self.captures.build_counts();
            text.push_str(&format!(
                "traces built: {builds}; captures that shared another's build: {reuses}\n"
            ));
            if let Some(triggers) = self.config.telemetry.triggers() {
                text.push_str(&triggers.summary());
            }
            let store = self.agent.store_stats();
            text.push_str(&format!(
                "flight recorder: {} events in {} chunks, {:.1} MiB\n",
                store.events,
                store.chunks,
                store.bytes as f64 / (1 << 20) as f64
            ));
            text.push_str(&format!(
                "capture memory: {:.1} MiB of {:.1} MiB held\n",
                self.captures.memory_held() as f64 / (1 << 20) as f64,
                self.captures.memory_budget() as f64 / (1 << 20) as f64
            ));
            if let Some(space) = self.captures.memory().spill() {
                text.push_str(&format!(
                    "spilled traces: {:.1} MiB of {:.1} MiB in {}\n",
                    space.used() as f64 / (1 << 20) as f64,
                    space.limit() as f64 / (1 << 20) as f64,
                    space.dir().display()
                ));
            }
        } else if request.monitoring_level >= 2 {
            text.push_str(
                "level 2 (the agent's own state) is for admins (--admin-group, --admin-client): \
                 this is level 1\n",
            );
        }
        Ok(MonitorResponse {
            data: text,
            monitor_result: Some(result),
        })
    }

    /// Counts a Monitor of `caller` until the slot is dropped, unless its
    /// caller (not an admin) already has `--captures-per-caller` running.
    fn monitor_slot(&self, caller: &Caller) -> Result<MonitorSlot<'_>, Status> {
        let owner = caller.owner();
        let mut monitors = self.monitors.lock();
        let theirs = monitors.entry(owner.clone()).or_default();
        let limit = self.config.captures_per_caller;
        if *theirs >= limit && !self.config.access.is_admin(caller) {
            return Err(Status::resource_exhausted(format!(
                "{caller} has {theirs} Monitor calls in progress, as many as \
                 --captures-per-caller ({limit}) lets one caller have; ask again when one has \
                 ended"
            )));
        }
        *theirs += 1;
        Ok(MonitorSlot {
            service: self,
            owner,
        })
    }
}

/// A Monitor in progress, counted against its caller until dropped.
struct MonitorSlot<'s> {
    service: &'s ProfilerService,
    owner: Owner,
}

impl Drop for MonitorSlot<'_> {
    fn drop(&mut self) {
        let mut monitors = self.service.monitors.lock();
        if let Some(count) = monitors.get_mut(&self.owner) {
            *count -= 1;
            if *count == 0 {
                monitors.remove(&self.owner);
            }
        }
    }
}

/// Mean sampled SM utilisation over all GPUs, when a counter backend reports it.
fn sampled_busy_percent(
    usage: &analysis::Utilization,
    registry: &crate::model::registry::RegistrySnapshot,
) -> Option<f64> {
    let samples: Vec<f64> = usage
        .counter_means
        .iter()
        .filter(|((_, name), _)| registry.name(*name) == crate::backend::nvml::SM_UTILIZATION)
        .map(|(_, mean)| *mean)
        .collect();
    (!samples.is_empty()).then(|| samples.iter().sum::<f64>() / samples.len() as f64)
}
