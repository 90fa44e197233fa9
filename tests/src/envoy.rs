//! Starting real Envoy on free loopback ports and reading its admin interface.

use crate::config::{EnvoyConfig, FilterSpec, FloorSpec, JwtAuth, ReplicaListener};
use crate::process::{log_dir, new_log_path, ChildGuard};
use crate::stats::Stats;
use crate::{paths, raw_http};
use anyhow::{bail, Context, Result};
use serde_json::Value;
use std::net::{SocketAddr, TcpListener};
use std::process::Command;
use std::time::{Duration, Instant};

/// How long [`Envoy::stats`] waits before it reads: four of the harness's 50 ms ticks.
const STATS_SETTLE: Duration = Duration::from_millis(200);

/// A loopback port that was free a moment ago and that this process has not handed out before
/// (the caller retries if it is taken by the time it binds). The kernel may hand the same
/// ephemeral port out twice while the first taker has not bound it yet, and Envoy binds its
/// listeners with `SO_REUSEPORT`, so two Envoys given one port would both start and split its
/// connections between them: a replica's peers then reached its client listener half the time.
pub fn free_port() -> Result<u16> {
    use std::collections::HashSet;
    use std::sync::Mutex;
    static GIVEN: Mutex<Option<HashSet<u16>>> = Mutex::new(None);
    let mut given = GIVEN.lock().unwrap_or_else(|e| e.into_inner());
    let given = given.get_or_insert_with(HashSet::new);
    for _ in 0..1000 {
        let l = TcpListener::bind("127.0.0.1:0").context("binding an ephemeral loopback port")?;
        let port = l.local_addr()?.port();
        if given.insert(port) {
            return Ok(port);
        }
    }
    bail!("no loopback port left that this process has not handed out ({} given)", given.len())
}

/// How to start one Envoy.
#[derive(Debug, Clone)]
pub struct EnvoyOptions {
    /// Name used in log file names and messages.
    pub name: String,
    /// Plugin configuration for the sluice filter; `None` runs Envoy without the filter.
    pub plugin_config: Option<Value>,
    /// `--concurrency` (worker threads).
    pub concurrency: u32,
    /// Fixed listener port; `None` picks a free one.
    pub listener_port: Option<u16>,
    /// Fixed admin port; `None` picks a free one.
    pub admin_port: Option<u16>,
    /// Add a second listener without the filter (for the bypass benchmark).
    pub direct_listener: bool,
    /// Add a listener with the floor filter sending every request to this endpoint (for the
    /// bypass benchmark).
    pub floor_endpoint: Option<String>,
    /// Add a listener with this build of the filter (a `.wasm` path), configured as the main one
    /// (for the bypass benchmark's before and after).
    pub baseline_wasm: Option<String>,
    /// Envoy's `--log-level`.
    pub log_level: String,
    /// `idle_timeout` of the pool's routes ([`EnvoyConfig::stream_idle_timeout`]).
    pub stream_idle_timeout: Duration,
    /// `request_body_buffer_limit` of the pool's routes; `None` derives it from the plugin's `max_body_bytes`.
    pub request_body_buffer_limit: Option<u64>,
    /// The replicas exchange's internal listener and peers (the plugin config needs `replicas`).
    pub replica_listener: Option<ReplicaListener>,
    /// Tenants from a verified token ([`JwtAuth`]); `None` trusts the client's tenant header.
    pub jwt: Option<JwtAuth>,
}

impl EnvoyOptions {
    /// Envoy with the sluice filter configured by `plugin_config`, 2 workers, free ports.
    pub fn with_filter(name: &str, plugin_config: Value) -> Self {
        Self { plugin_config: Some(plugin_config), ..Self::without_filter(name) }
    }

    /// Envoy as a plain proxy (clients name the endpoint in the destination header).
    pub fn without_filter(name: &str) -> Self {
        Self {
            name: name.to_string(),
            plugin_config: None,
            concurrency: 2,
            listener_port: None,
            admin_port: None,
            direct_listener: false,
            floor_endpoint: None,
            baseline_wasm: None,
            log_level: std::env::var("SLUICE_ENVOY_LOG_LEVEL").unwrap_or_else(|_| "info".into()),
            stream_idle_timeout: crate::config::DEFAULT_STREAM_IDLE_TIMEOUT,
            request_body_buffer_limit: None,
            replica_listener: None,
            jwt: None,
        }
    }
}

/// A running Envoy, killed on drop.
#[derive(Debug)]
pub struct Envoy {
    child: ChildGuard,
    /// The main listener (with the filter when configured).
    pub listener: SocketAddr,
    /// The admin interface.
    pub admin: SocketAddr,
    /// The listener without the filter, when requested.
    pub direct: Option<SocketAddr>,
    /// The listener with the floor filter, when requested.
    pub floor: Option<SocketAddr>,
    /// The listener with the baseline build of the filter, when requested.
    pub baseline: Option<SocketAddr>,
    /// The rendered bootstrap that Envoy runs.
    pub config_yaml: String,
}

fn is_bind_failure(log: &str) -> bool {
    log.contains("Address already in use") || log.contains("cannot bind") || log.contains("unable to bind")
}

impl Envoy {
    /// Renders the config, starts Envoy and waits until the admin `/ready` answers 200 and the
    /// listener accepts connections. Retries with new ports when a picked port was taken meanwhile.
    pub async fn start(opts: EnvoyOptions) -> Result<Envoy> {
        let envoy_bin = paths::envoy_bin()?;
        let filter = match &opts.plugin_config {
            Some(pc) => {
                Some(FilterSpec { wasm_path: paths::filter_wasm()?.display().to_string(), plugin_config: pc.clone() })
            }
            None => None,
        };
        let floor_wasm = match &opts.floor_endpoint {
            Some(_) => Some(paths::floor_wasm()?.display().to_string()),
            None => None,
        };
        let mut last_err = None;
        for _attempt in 0..5 {
            let cfg = EnvoyConfig {
                listen_address: "127.0.0.1".into(),
                listener_port: match opts.listener_port {
                    Some(p) => p,
                    None => free_port()?,
                },
                admin_port: match opts.admin_port {
                    Some(p) => p,
                    None => free_port()?,
                },
                filter: filter.clone(),
                direct_listener_port: if opts.direct_listener { Some(free_port()?) } else { None },
                floor: match (&floor_wasm, &opts.floor_endpoint) {
                    (Some(wasm_path), Some(endpoint)) => {
                        Some(FloorSpec { port: free_port()?, wasm_path: wasm_path.clone(), endpoint: endpoint.clone() })
                    }
                    _ => None,
                },
                baseline: match &opts.baseline_wasm {
                    Some(w) => Some((free_port()?, w.clone())),
                    None => None,
                },
                stream_idle_timeout: opts.stream_idle_timeout,
                request_body_buffer_limit: opts.request_body_buffer_limit,
                replicas: opts.replica_listener.clone(),
                jwt: opts.jwt.clone(),
            };
            let yaml = cfg.render();
            std::fs::create_dir_all(log_dir())?;
            let cfg_path = new_log_path(&format!("{}-config", opts.name)).with_extension("yaml");
            std::fs::write(&cfg_path, &yaml)?;
            let mut cmd = Command::new(&envoy_bin);
            cmd.arg("-c")
                .arg(&cfg_path)
                .arg("--concurrency")
                .arg(opts.concurrency.to_string())
                // Hot restart needs a shared-memory base id per instance; without it many Envoys coexist.
                .arg("--disable-hot-restart")
                .arg("--log-level")
                .arg(&opts.log_level)
                .current_dir(paths::repo_root());
            let child = ChildGuard::spawn(&format!("envoy-{}", opts.name), cmd)?;
            let mut envoy = Envoy {
                child,
                listener: SocketAddr::from(([127, 0, 0, 1], cfg.listener_port)),
                admin: SocketAddr::from(([127, 0, 0, 1], cfg.admin_port)),
                direct: cfg.direct_listener_port.map(|p| SocketAddr::from(([127, 0, 0, 1], p))),
                floor: cfg.floor.as_ref().map(|f| SocketAddr::from(([127, 0, 0, 1], f.port))),
                baseline: cfg.baseline.as_ref().map(|(p, _)| SocketAddr::from(([127, 0, 0, 1], *p))),
                config_yaml: yaml,
            };
            match envoy.wait_ready(Duration::from_secs(60)).await {
                Ok(()) => return Ok(envoy),
                Err(e) => {
                    let fixed = opts.listener_port.is_some() || opts.admin_port.is_some();
                    if !fixed && is_bind_failure(&envoy.child.log()) {
                        last_err = Some(e);
                        continue;
                    }
                    return Err(e);
                }
            }
        }
        Err(last_err.unwrap_or_else(|| anyhow::anyhow!("Envoy did not start")))
    }

    async fn wait_ready(&mut self, timeout: Duration) -> Result<()> {
        let deadline = Instant::now() + timeout;
        loop {
            self.child.ensure_running().context("Envoy exited during start-up")?;
            if let Ok((200, _)) = raw_http::get(self.admin, "/ready").await {
                if tokio::net::TcpStream::connect(self.listener).await.is_ok() {
                    return Ok(());
                }
            }
            if Instant::now() > deadline {
                bail!(
                    "Envoy not ready after {timeout:?}; log {}:\n{}",
                    self.child.log_path().display(),
                    self.child.log_tail(4000)
                );
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// One scrape of `/stats/prometheus`, a few of the filter's ticks after the call: the filter
    /// keeps its counters and stock gauge in each worker and flushes them on the tick (issue 24),
    /// so what happened before the call is counted exactly only after one.
    pub async fn stats(&self) -> Result<Stats> {
        tokio::time::sleep(STATS_SETTLE).await;
        let (status, body) = raw_http::get(self.admin, "/stats/prometheus").await?;
        if status != 200 {
            bail!("admin /stats/prometheus answered {status}");
        }
        Ok(Stats::parse(&body))
    }

    /// Polls the stats until `pred` holds; on timeout fails with the last sluice stats.
    pub async fn wait_stats(&self, what: &str, timeout: Duration, pred: impl Fn(&Stats) -> bool) -> Result<Stats> {
        let deadline = Instant::now() + timeout;
        loop {
            let s = self.stats().await?;
            if pred(&s) {
                return Ok(s);
            }
            if Instant::now() > deadline {
                bail!("timed out after {timeout:?} waiting for {what}; stats: {}", s.sluice_summary());
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Envoy's log so far.
    pub fn log(&self) -> String {
        self.child.log()
    }

    /// The last `max_bytes` of Envoy's log.
    pub fn log_tail(&self, max_bytes: u64) -> String {
        self.child.log_tail(max_bytes)
    }

    /// Path of Envoy's log file.
    pub fn log_path(&self) -> std::path::PathBuf {
        self.child.log_path().to_path_buf()
    }

    /// Fails (with the log) if Envoy has exited, e.g. crashed.
    pub fn ensure_running(&mut self) -> Result<()> {
        self.child.ensure_running()
    }

    /// Process id of Envoy (the `envoy` pip launcher execs the binary, so this is Envoy itself).
    pub fn pid(&self) -> u32 {
        self.child.pid()
    }

    /// Envoy's resident set size (`VmRSS` of `/proc/<pid>/status`) in bytes; `None` if unreadable.
    pub fn rss_bytes(&self) -> Option<u64> {
        rss_bytes_of(self.pid())
    }

    /// Lines of Envoy's log that show a Wasm VM failure (see [`vm_failure_lines`]).
    pub fn vm_failures(&self) -> Vec<String> {
        vm_failure_lines(&self.log()).into_iter().map(str::to_string).collect()
    }

    /// Base URL of the main listener.
    pub fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.listener)
    }
}

/// `VmRSS` of process `pid` in bytes, from `/proc/<pid>/status`; `None` if unreadable.
pub fn rss_bytes_of(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let line = status.lines().find(|l| l.starts_with("VmRSS:"))?;
    let kb: u64 = line.trim_start_matches("VmRSS:").trim().trim_end_matches("kB").trim().parse().ok()?;
    Some(kb * 1024)
}

/// Substrings of Envoy log lines that mean a Wasm VM (or the filter inside it) failed: a trap
/// (V8 reports `Function: proxy_on_... failed: Uncaught RangeError: Maximum call stack size
/// exceeded`, `... unreachable`), a Rust panic in the filter (`panicked at`), or Envoy's own
/// messages about a failed VM or plugin.
///
/// What Envoy 1.40 prints when a callback traps (seen with a burst of local replies):
/// `[error][wasm] [source/extensions/common/wasm/wasm_vm.cc:38] Function: proxy_on_response_headers
/// failed: Uncaught RangeError: Maximum call stack size exceeded`.
pub const VM_FAILURE_MARKERS: &[&str] = &[
    "Function: ",
    "RangeError",
    "Maximum call stack",
    "panicked",
    "Uncaught",
    "Wasm VM failed",
    "wasm_fail",
    "failed: ",
    "Plugin configured to fail",
    "RuntimeError",
    "unreachable",
];

/// The lines of an Envoy log that show a Wasm VM failure ([`VM_FAILURE_MARKERS`]), leaving out
/// lines that merely mention a failure in the filter's own operational logs (`scraping ... failed`).
pub fn vm_failure_lines(log: &str) -> Vec<&str> {
    log.lines()
        .filter(|l| VM_FAILURE_MARKERS.iter().any(|m| l.contains(m)))
        .filter(|l| !(l.contains("wasm log") && l.contains("scraping ")))
        .collect()
}
