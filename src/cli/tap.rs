//! `devtrace tap`: a standalone tap in front of a TensorFlow server, and the
//! `--tap LISTEN=UPSTREAM` taps that `devtrace serve` runs inside the agent.

use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use clap::Args;
use tokio_util::sync::CancellationToken;
use tracing::info;

use crate::agent::{Agent, AgentConfig};
use crate::capture::local_hostname;
use crate::service::profile_analysis::{AnalysisConfig, ProfileAnalysisService};
use crate::service::profiler::{ProfilerService, ServiceConfig};
use crate::tap::{Recorder, Tap};

#[derive(Debug, Args)]
pub struct TapArgs {
    /// Address the TensorFlow clients connect to instead of the server.
    #[arg(long, default_value = "127.0.0.1:2223")]
    pub listen: String,

    /// The TensorFlow server (`tf.distribute.Server`) as HOST:PORT.
    #[arg(long)]
    pub upstream: String,

    /// Also serve ProfilerService captures of the tap's events here (e.g.
    /// 127.0.0.1:6009). Without it the tap only logs summaries.
    #[arg(long, value_name = "ADDR")]
    pub profiler_listen: Option<String>,

    /// How often to log a summary of the calls forwarded (0: only at exit).
    #[arg(long, allow_hyphen_values = true, default_value = "10s", value_parser = super::parse_duration)]
    pub summary_every: Duration,
}

/// One `--tap LISTEN=UPSTREAM` of `devtrace serve`.
pub fn parse_tap_spec(text: &str) -> Result<(String, String), String> {
    match text.split_once('=') {
        Some((listen, upstream)) if !listen.is_empty() && !upstream.is_empty() => {
            Ok((listen.to_owned(), upstream.to_owned()))
        }
        _ => Err(format!(
            "{text:?} is not LISTEN=UPSTREAM (e.g. 127.0.0.1:2223=127.0.0.1:2222)"
        )),
    }
}

/// Taps bound, not yet serving.
pub(crate) struct BoundTaps {
    taps: Vec<(Tap, String)>,
    recorder: Arc<Recorder>,
}

/// Binds every tap, recording into `agent`'s ring through one shared lane:
/// a busy address fails here, before anything says the process listens.
pub(crate) async fn bind_taps(
    agent: &Agent,
    specs: &[(String, String)],
) -> anyhow::Result<Option<BoundTaps>> {
    if specs.is_empty() {
        return Ok(None);
    }
    let producer = agent
        .producer()
        .context("claiming a ring lane for the tap")?;
    let recorder = Recorder::new(Arc::clone(agent.registry()), producer);
    let mut taps = Vec::new();
    for (listen, upstream) in specs {
        let tap = Tap::bind(listen, upstream, Arc::clone(&recorder))
            .await
            .with_context(|| format!("starting the tap {listen}={upstream}"))?;
        taps.push((tap, upstream.clone()));
    }
    Ok(Some(BoundTaps { taps, recorder }))
}

/// Runs the bound taps on the current runtime until `stop` is cancelled
/// (then they accept no new connection; calls in progress go on, see
/// [`drain_taps`]). Prints each bound address.
pub(crate) fn start_taps(
    bound: BoundTaps,
    telemetry: Option<&crate::telemetry::Telemetry>,
    stop: &CancellationToken,
) -> anyhow::Result<Arc<Recorder>> {
    for (tap, upstream) in bound.taps {
        let address = tap.local_addr().context("reading the tap's address")?;
        // Scripts and tests read the bound address (useful with port 0).
        super::announce(&format!(
            "devtrace tap listening on {address} -> {upstream}"
        ));
        info!(%address, upstream, "tap forwarding");
        if let Some(telemetry) = telemetry {
            // One name per tap, made once for the agent's life.
            let name: &'static str = Box::leak(format!("tap {address}").into_boxed_str());
            telemetry.watch_connections(name, tap.gate());
        }
        tokio::spawn(tap.run(stop.clone().cancelled_owned()));
    }
    Ok(bound.recorder)
}

/// Waits, once the taps stopped accepting, for the calls they forward to
/// end, until `deadline` or `now` resolves (a second stop signal), and says
/// how many it stops without: they are cut off, and not in the summary.
pub(crate) async fn drain_taps(
    recorder: &Recorder,
    deadline: tokio::time::Instant,
    now: impl std::future::Future<Output = ()>,
) {
    let open = recorder.calls_in_progress();
    if open == 0 {
        return;
    }
    info!(
        calls = open,
        "taps: waiting at most {:.0} s for the calls in progress to end",
        deadline
            .saturating_duration_since(tokio::time::Instant::now())
            .as_secs_f64()
    );
    let ended = async {
        while recorder.calls_in_progress() > 0 {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    };
    tokio::select! {
        _ = ended => {}
        _ = tokio::time::sleep_until(deadline) => {}
        _ = now => {}
    }
    let cut = recorder.calls_in_progress();
    if cut > 0 {
        tracing::warn!(
            calls = cut,
            "taps: stopping with calls still in progress; they are cut off (their clients see \
             the connection end)"
        );
    }
}

/// How long a stopping tap waits for the calls it forwards.
pub(crate) const TAP_DRAIN: Duration = Duration::from_secs(10);

pub fn run(args: TapArgs) -> anyhow::Result<()> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .thread_name("devtrace-tap")
        .build()
        .context("starting the async runtime")?;
    runtime.block_on(tap(args))
}

async fn tap(args: TapArgs) -> anyhow::Result<()> {
    let shutdown = super::serve::shutdown_signal();
    // No backend: the agent holds only the tap's events.
    let config = AgentConfig {
        backends: Vec::new(),
        ..AgentConfig::default()
    };
    let agent = Agent::start(&config).context("starting the agent")?;
    let specs = [(args.listen.clone(), args.upstream.clone())];
    let bound = bind_taps(&agent, &specs)
        .await?
        .context("the tap did not start")?;
    // Bound before either address is announced: a busy one fails first.
    let profiler_listener = match &args.profiler_listen {
        Some(listen) => Some(
            tokio::net::TcpListener::bind(listen)
                .await
                .with_context(|| format!("cannot listen on {listen}"))?,
        ),
        None => None,
    };
    let stop = CancellationToken::new();
    let recorder = start_taps(bound, None, &stop)?;
    if let Some(listener) = profiler_listener {
        let service = Arc::new(ProfilerService::new(
            Arc::clone(&agent),
            ServiceConfig {
                hostname: local_hostname(),
                ..ServiceConfig::default()
            },
        ));
        let analysis = Arc::new(ProfileAnalysisService::new(AnalysisConfig::default()));
        let address = listener.local_addr().context("reading the bound address")?;
        super::announce(&format!("devtrace listening on {address}"));
        let trigger = Arc::new(crate::service::trigger::TriggerService::new(
            None,
            crate::service::access::Access::default(),
        ));
        tokio::spawn(async move {
            let serve =
                crate::service::serve(listener, service, analysis, trigger, std::future::pending());
            if let Err(error) = serve.await {
                tracing::error!(%error, "profiler service stopped");
            }
        });
    }
    let summary = |recorder: &Recorder| {
        let s = recorder.stats();
        info!(
            connections = s.connections,
            calls = s.calls,
            failed = s.failed,
            steps = s.steps,
            eager_ops = s.eager_ops,
            undecoded = s.undecoded,
            decode_queue_overflow = s.queue_overflow,
            request_bytes = s.request_bytes,
            response_bytes = s.response_bytes,
            "tap summary"
        );
    };
    tokio::pin!(shutdown);
    loop {
        if args.summary_every.is_zero() {
            (&mut shutdown).await;
            break;
        }
        tokio::select! {
            _ = &mut shutdown => break,
            _ = tokio::time::sleep(args.summary_every) => summary(&recorder),
        }
    }
    stop.cancel();
    // A second signal, a second or more after the first, stops at once.
    let asked_at = std::time::Instant::now();
    let again = async {
        loop {
            super::serve::shutdown_signal().await;
            if asked_at.elapsed() >= Duration::from_secs(1) {
                break;
            }
        }
    };
    drain_taps(&recorder, tokio::time::Instant::now() + TAP_DRAIN, again).await;
    summary(&recorder);
    agent.shutdown();
    Ok(())
}
