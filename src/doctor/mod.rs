//! `devtrace doctor`: checks this host the way `devtrace serve`, with the
//! same flags, would use it, before anything is started: the GPU driver,
//! NVML and CUPTI ([`gpu`]), the kernel's eBPF and perf support and its
//! clock ([`kernel`]), and the agent's own setup: runtime directory, listen
//! addresses, allow-roots, TLS files and memory budgets ([`setup`]).
//!
//! Each check is one [`Finding`] with what to do when it is not fine; the
//! checks that load a vendor library run in a child process ([`isolate`]). The
//! [`Report`] decides whether the chosen backends can run: a backend named
//! with `--backend` needs every check of its area to pass; under `auto`
//! a missing device is no failure (the agent leaves that backend out, and
//! runs the mock when no device backend works), but the agent's own setup
//! always must pass.

pub mod gpu;
mod isolate;
pub mod kernel;
pub mod setup;
pub mod tpu;

use crate::agent::BackendChoice;

/// How one check came out.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Status {
    /// Works as the agent would use it.
    Ok,
    /// Works, with a limit worth knowing.
    Warn,
    /// Not on this host (no GPU driver, no TPU): nothing is broken.
    Absent,
    /// There, but the agent or a backend could not use it.
    Fail,
}

impl Status {
    pub fn word(self) -> &'static str {
        match self {
            Status::Ok => "ok",
            Status::Warn => "warn",
            Status::Absent => "absent",
            Status::Fail => "FAIL",
        }
    }

    /// The status whose [`Status::word`] is `word`, in any case.
    fn worded(word: &str) -> Option<Status> {
        [Status::Ok, Status::Warn, Status::Absent, Status::Fail]
            .into_iter()
            .find(|status| status.word().eq_ignore_ascii_case(word))
    }

    /// Whether the area's backend can run with it.
    fn usable(self) -> bool {
        matches!(self, Status::Ok | Status::Warn)
    }
}

/// What a check is about: the agent's own setup, or one backend.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Area {
    Agent,
    Nvml,
    Cuda,
    Ebpf,
    Perf,
    Tpu,
}

impl Area {
    pub fn name(self) -> &'static str {
        match self {
            Area::Agent => "agent",
            Area::Nvml => "nvml",
            Area::Cuda => "cuda",
            Area::Ebpf => "ebpf",
            Area::Perf => "perf",
            Area::Tpu => "tpu",
        }
    }

    const BACKENDS: [Area; 5] = [Area::Nvml, Area::Cuda, Area::Ebpf, Area::Perf, Area::Tpu];

    /// The area whose [`Area::name`] is `name`.
    fn named(name: &str) -> Option<Area> {
        std::iter::once(Area::Agent)
            .chain(Area::BACKENDS)
            .find(|area| area.name() == name)
    }

    fn of(choice: BackendChoice) -> Option<Area> {
        match choice {
            BackendChoice::Nvml => Some(Area::Nvml),
            BackendChoice::Cuda => Some(Area::Cuda),
            BackendChoice::Ebpf => Some(Area::Ebpf),
            BackendChoice::Perf => Some(Area::Perf),
            BackendChoice::Tpu => Some(Area::Tpu),
            BackendChoice::Auto | BackendChoice::Mock => None,
        }
    }
}

/// One check: what was looked at, how it came out, and what to do.
#[derive(Clone, Debug)]
pub struct Finding {
    pub area: Area,
    pub item: String,
    pub status: Status,
    pub detail: String,
    /// What to do about it; `None` when nothing needs doing.
    pub hint: Option<String>,
}

impl Finding {
    pub fn new(
        area: Area,
        item: impl Into<String>,
        status: Status,
        detail: impl Into<String>,
    ) -> Self {
        Finding {
            area,
            item: item.into(),
            status,
            detail: detail.into(),
            hint: None,
        }
    }

    pub fn hint(mut self, hint: impl Into<String>) -> Self {
        self.hint = Some(hint.into());
        self
    }

    /// The finding as `--json` prints it.
    pub fn json(&self) -> serde_json::Value {
        serde_json::json!({
            "area": self.area.name(),
            "item": self.item,
            "status": self.status.word().to_ascii_lowercase(),
            "detail": self.detail,
            "hint": self.hint,
        })
    }

    /// The finding [`Finding::json`] printed.
    pub fn from_json(value: &serde_json::Value) -> Option<Finding> {
        let text = |key: &str| value.get(key)?.as_str();
        Some(Finding {
            area: Area::named(text("area")?)?,
            item: text("item")?.to_string(),
            status: Status::worded(text("status")?)?,
            detail: text("detail")?.to_string(),
            hint: text("hint").map(str::to_string),
        })
    }
}

/// Every finding, and the backends asked for.
#[derive(Debug)]
pub struct Report {
    pub findings: Vec<Finding>,
    pub chosen: Vec<BackendChoice>,
}

/// What became of one backend.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// It would start.
    Runs,
    /// Not usable here; `auto` goes on without it (the reason is in its
    /// findings).
    LeftOut,
    /// It was asked for and would not start.
    Fails,
    /// Neither asked for nor part of `auto`.
    NotChosen,
}

impl Report {
    fn auto(&self) -> bool {
        self.chosen.contains(&BackendChoice::Auto)
    }

    /// Whether every check of `area` passed; an area never checked has
    /// not shown that it can run (the agent's own setup always is).
    fn area_usable(&self, area: Area) -> bool {
        let mut checks = self.findings.iter().filter(|finding| finding.area == area);
        let mut any = false;
        let passed = checks.all(|finding| {
            any = true;
            // The CUDA backend needs only its runtime directory: a driver or
            // CUPTI absent from this host (a sidecar's container) says
            // which jobs this host can run, not whether the backend runs
            // for those that reach it, as `serve` starts it either way.
            finding.status.usable() || (area == Area::Cuda && finding.status == Status::Absent)
        });
        passed && (any || area == Area::Agent)
    }

    /// Whether `area`'s backend would run under the chosen backends.
    pub fn verdict(&self, area: Area) -> Verdict {
        let named = self
            .chosen
            .iter()
            .any(|choice| Area::of(*choice) == Some(area));
        // Perf is not part of auto: it adds a counter track per CPU.
        let in_auto = self.auto() && area != Area::Perf;
        match (named, in_auto, self.area_usable(area)) {
            (_, _, true) if named || in_auto => Verdict::Runs,
            (true, _, false) => Verdict::Fails,
            // A device that is here and cannot be used fails under auto
            // too; one that is not here is left out.
            (false, true, false) if self.device_broken(area) => Verdict::Fails,
            (false, true, false) => Verdict::LeftOut,
            _ => Verdict::NotChosen,
        }
    }

    /// Whether `area` is a device whose backend failed a check (rather than
    /// found no device): the agent's `auto` reports it failed. (The TPU
    /// backend tells no such failure from an absent TPU.)
    fn device_broken(&self, area: Area) -> bool {
        area == Area::Nvml
            && self
                .findings
                .iter()
                .any(|finding| finding.area == area && finding.status == Status::Fail)
    }

    /// Whether the mock runs: asked for, or `auto` with no NVIDIA GPU or
    /// TPU here, working or not (the agent's own rule).
    pub fn mock_runs(&self) -> bool {
        self.chosen.contains(&BackendChoice::Mock)
            || (self.auto()
                && [Area::Nvml, Area::Tpu]
                    .iter()
                    .all(|area| self.verdict(*area) == Verdict::LeftOut))
    }

    /// Whether `devtrace serve` with these flags would start with every
    /// backend it was asked for: the agent's setup passes and no backend
    /// named with `--backend` fails.
    pub fn ready(&self) -> bool {
        self.area_usable(Area::Agent)
            && Area::BACKENDS
                .iter()
                .all(|area| self.verdict(*area) != Verdict::Fails)
    }

    /// The report as lines for a terminal.
    pub fn text(&self) -> String {
        let mut out = String::new();
        for finding in &self.findings {
            out.push_str(&format!(
                "{:<6} {:<5}  {}: {}\n",
                finding.status.word(),
                finding.area.name(),
                finding.item,
                finding.detail
            ));
            if let Some(hint) = &finding.hint {
                out.push_str(&format!("{:14}-> {hint}\n", ""));
            }
        }
        out.push('\n');
        out.push_str(&format!("backends: {}\n", self.backends_line()));
        if self.ready() {
            out.push_str("ready: `devtrace serve` with these flags can start its backends\n");
        } else {
            let failing: Vec<&str> = Area::BACKENDS
                .iter()
                .filter(|area| self.verdict(**area) == Verdict::Fails)
                .map(|area| area.name())
                .collect();
            // With no backend at all to run, serve refuses to start.
            let any_runs = self.mock_runs()
                || Area::BACKENDS
                    .iter()
                    .any(|area| self.verdict(*area) == Verdict::Runs);
            if !self.area_usable(Area::Agent) || !any_runs {
                let mut why = if self.area_usable(Area::Agent) {
                    Vec::new()
                } else {
                    vec!["agent"]
                };
                why.extend(&failing);
                out.push_str(&format!(
                    "not ready: `devtrace serve` with these flags would not start; see the FAIL \
                     and absent lines of: {}\n",
                    why.join(", ")
                ));
            } else {
                out.push_str(&format!(
                    "not ready: `devtrace serve` with these flags would run without {} (it says \
                     so in its log, its health and every trace); see their FAIL and absent lines\n",
                    failing.join(", ")
                ));
            }
        }
        out
    }

    fn backends_line(&self) -> String {
        let mut parts = Vec::new();
        if self.mock_runs() {
            parts.push("mock runs".to_string());
        }
        for area in Area::BACKENDS {
            let word = match self.verdict(area) {
                Verdict::Runs => "runs",
                Verdict::LeftOut => "not usable here",
                Verdict::Fails => "cannot start",
                Verdict::NotChosen => continue,
            };
            parts.push(format!("{} {word}", area.name()));
        }
        parts.join(", ")
    }

    /// The report as one JSON object for scripts.
    pub fn json(&self) -> serde_json::Value {
        let findings: Vec<serde_json::Value> = self.findings.iter().map(Finding::json).collect();
        let mut backends = serde_json::Map::new();
        if self.mock_runs() {
            backends.insert("mock".into(), "runs".into());
        }
        for area in Area::BACKENDS {
            let word = match self.verdict(area) {
                Verdict::Runs => "runs",
                Verdict::LeftOut => "not_usable",
                Verdict::Fails => "fails",
                Verdict::NotChosen => "not_chosen",
            };
            backends.insert(area.name().into(), word.into());
        }
        serde_json::json!({
            "ready": self.ready(),
            "backends": backends,
            "checks": findings,
        })
    }
}

/// What to check: the backends asked for and what each area needs of the
/// agent's flags.
pub struct Plan<'a> {
    pub backends: Vec<BackendChoice>,
    pub gpu: gpu::GpuPlan<'a>,
    pub tpu_library: &'a std::ffi::OsStr,
    pub kernel: kernel::KernelPlan,
    pub setup: setup::SetupPlan<'a>,
}

/// Runs every check. Each area is checked whatever was chosen, so that the
/// report also says what another `--backend` would meet.
pub fn examine(plan: &Plan) -> Report {
    let mut findings = setup::check(&plan.setup);
    findings.extend(gpu::check(&plan.gpu));
    findings.extend(kernel::check(&plan.kernel));
    findings.push(isolate::isolated(
        Area::Tpu,
        "libtpu",
        isolate::CHECK_LIMIT,
        || tpu::check(plan.tpu_library),
    ));
    // Grouped by area, each area's checks in the order they were made.
    findings.sort_by_key(|finding| finding.area);
    Report {
        findings,
        chosen: plan.backends.clone(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn report(chosen: Vec<BackendChoice>, findings: Vec<(Area, Status)>) -> Report {
        Report {
            findings: findings
                .into_iter()
                .map(|(area, status)| Finding::new(area, "x", status, "y"))
                .collect(),
            chosen,
        }
    }

    #[test]
    fn auto_leaves_absent_devices_out_and_runs_the_mock() {
        let report = report(
            vec![BackendChoice::Auto],
            vec![
                (Area::Agent, Status::Ok),
                (Area::Nvml, Status::Absent),
                (Area::Ebpf, Status::Ok),
                (Area::Perf, Status::Fail),
            ],
        );
        assert!(report.ready());
        assert!(report.mock_runs());
        assert_eq!(report.verdict(Area::Nvml), Verdict::LeftOut);
        assert_eq!(report.verdict(Area::Ebpf), Verdict::Runs);
        assert_eq!(report.verdict(Area::Perf), Verdict::NotChosen);
        assert_eq!(report.json()["backends"]["nvml"], "not_usable");
    }

    #[test]
    fn a_named_backend_that_cannot_start_is_not_ready() {
        let report = report(
            vec![BackendChoice::Nvml, BackendChoice::Ebpf],
            vec![(Area::Nvml, Status::Absent), (Area::Ebpf, Status::Warn)],
        );
        assert!(!report.ready());
        assert_eq!(report.verdict(Area::Nvml), Verdict::Fails);
        assert_eq!(report.verdict(Area::Ebpf), Verdict::Runs);
        assert!(!report.mock_runs());
        assert!(report.text().contains("nvml cannot start"));
        assert!(
            report.text().contains("would run without nvml (it says so"),
            "{}",
            report.text()
        );
        // Alone, it leaves the agent nothing to run: it would not start.
        let alone = self::report(
            vec![BackendChoice::Nvml],
            vec![(Area::Nvml, Status::Absent)],
        );
        assert!(
            alone
                .text()
                .contains("would not start; see the FAIL and absent lines of: nvml"),
            "{}",
            alone.text()
        );
        assert_eq!(report.json()["ready"], false);
    }

    #[test]
    fn the_agents_setup_must_pass_whatever_the_backends() {
        let report = report(
            vec![BackendChoice::Mock],
            vec![(Area::Agent, Status::Fail), (Area::Nvml, Status::Absent)],
        );
        assert!(!report.ready());
        assert!(report.mock_runs());
        assert_eq!(report.verdict(Area::Nvml), Verdict::NotChosen);
    }

    #[test]
    fn a_gpu_whose_nvml_fails_under_auto_fails_and_means_no_mock() {
        let report = report(
            vec![BackendChoice::Auto],
            vec![
                (Area::Agent, Status::Ok),
                (Area::Nvml, Status::Fail),
                (Area::Tpu, Status::Absent),
            ],
        );
        assert_eq!(report.verdict(Area::Nvml), Verdict::Fails);
        assert_eq!(report.verdict(Area::Tpu), Verdict::LeftOut);
        assert!(!report.mock_runs());
        assert!(!report.ready());
    }

    #[test]
    fn nvml_that_works_under_auto_means_no_mock() {
        let report = report(vec![BackendChoice::Auto], vec![(Area::Nvml, Status::Ok)]);
        assert!(!report.mock_runs());
        assert_eq!(report.verdict(Area::Nvml), Verdict::Runs);
    }
}
