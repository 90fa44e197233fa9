//! Simulated GPU model servers (`sluice-backend` from the sluice-gpu crate) as child processes.

use crate::paths;
use crate::process::ChildGuard;
use anyhow::{bail, Result};
use std::net::SocketAddr;
use std::process::Command;
use std::time::{Duration, Instant};

/// How to start a group of backends (one process serving `count` ports).
#[derive(Debug, Clone)]
pub struct BackendOptions {
    /// Number of backends.
    pub count: usize,
    /// GPU profile name (`--profile`); `None` keeps the binary's default.
    pub profile: Option<String>,
    /// `--time-scale`: simulated seconds per wall second (10 runs the GPU model 10 times faster).
    pub time_scale: Option<f64>,
    /// `--instant`: answer at once (bypass benchmark).
    pub instant: bool,
    /// `--default-max-tokens` for requests that name none.
    pub default_max_tokens: Option<u32>,
    /// Further arguments passed through unchanged.
    pub extra_args: Vec<String>,
}

impl BackendOptions {
    /// `count` backends with the binary's defaults.
    pub fn new(count: usize) -> Self {
        Self { count, profile: None, time_scale: None, instant: false, default_max_tokens: None, extra_args: vec![] }
    }
}

/// Running backends, killed on drop.
#[derive(Debug)]
pub struct Backends {
    child: ChildGuard,
    /// Their addresses, in the order the binary printed them.
    pub addrs: Vec<SocketAddr>,
}

/// Starts one `sluice-backend` process serving `count` backends from port `port` (0: ephemeral
/// ports) with `opts`' profile, time scale and arguments (`opts.count` is not read), and waits for
/// its `listening` lines.
pub(crate) async fn spawn(port: u16, count: usize, opts: &BackendOptions) -> Result<(ChildGuard, Vec<SocketAddr>)> {
    let mut cmd = Command::new(paths::backend_bin()?);
    cmd.arg("--port").arg(port.to_string()).arg("--count").arg(count.to_string());
    if let Some(p) = &opts.profile {
        cmd.arg("--profile").arg(p);
    }
    if let Some(t) = opts.time_scale {
        cmd.arg("--time-scale").arg(t.to_string());
    }
    if opts.instant {
        cmd.arg("--instant");
    }
    if let Some(m) = opts.default_max_tokens {
        cmd.arg("--default-max-tokens").arg(m.to_string());
    }
    cmd.args(&opts.extra_args);
    let mut child = ChildGuard::spawn("backend", cmd)?;
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let addrs: Vec<SocketAddr> = child
            .log()
            .lines()
            .filter_map(|l| l.trim().strip_prefix("listening "))
            .filter_map(|a| a.trim().parse().ok())
            .collect();
        if addrs.len() >= count {
            return Ok((child, addrs));
        }
        child.ensure_running()?;
        if Instant::now() > deadline {
            bail!(
                "sluice-backend printed {} of {count} `listening` lines in 20 s; log:\n{}",
                addrs.len(),
                child.log_tail(4000)
            );
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

impl Backends {
    /// Starts the backends and waits for one `listening IP:PORT` line per backend.
    pub async fn start(opts: BackendOptions) -> Result<Backends> {
        let (child, addrs) = spawn(0, opts.count, &opts).await?;
        Ok(Backends { child, addrs })
    }

    /// The addresses as `"ip:port"` strings, ready for the plugin config's `endpoints`.
    pub fn endpoints(&self) -> Vec<String> {
        self.addrs.iter().map(|a| a.to_string()).collect()
    }

    /// Fails (with the log) if the backend process has exited.
    pub fn ensure_running(&mut self) -> Result<()> {
        self.child.ensure_running()
    }

    /// The backend process's log.
    pub fn log(&self) -> String {
        self.child.log()
    }
}
