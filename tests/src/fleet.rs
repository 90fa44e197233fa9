//! One simulated backend per process, so a test can kill one backend of a pool and later bring it
//! back on the same address (the filter's endpoint list is fixed at configuration time).

use crate::backend::BackendOptions;
use crate::paths;
use crate::process::ChildGuard;
use anyhow::{bail, Result};
use std::net::SocketAddr;
use std::process::Command;
use std::time::{Duration, Instant};

/// One `sluice-backend` process serving one backend; killed on drop.
#[derive(Debug)]
pub struct Backend {
    child: ChildGuard,
    /// Where it listens.
    pub addr: SocketAddr,
}

impl Backend {
    /// Starts one backend on `port` (0: an ephemeral one) with `opts`' profile, time scale and
    /// extra arguments (`opts.count` is ignored), and waits for its `listening` line.
    pub async fn start(port: u16, opts: &BackendOptions) -> Result<Backend> {
        let mut cmd = Command::new(paths::backend_bin()?);
        cmd.arg("--port").arg(port.to_string()).arg("--count").arg("1");
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
            let addr = child
                .log()
                .lines()
                .find_map(|l| l.trim().strip_prefix("listening ").and_then(|a| a.trim().parse().ok()));
            if let Some(addr) = addr {
                return Ok(Backend { child, addr });
            }
            child.ensure_running()?;
            if Instant::now() > deadline {
                bail!(
                    "sluice-backend on port {port} did not print `listening` in 20 s; log:\n{}",
                    child.log_tail(4000)
                );
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Starts `n` backends on ephemeral ports, each in its own process.
    pub async fn start_many(n: usize, opts: &BackendOptions) -> Result<Vec<Backend>> {
        let mut out = Vec::with_capacity(n);
        for _ in 0..n {
            out.push(Backend::start(0, opts).await?);
        }
        Ok(out)
    }

    /// SIGKILLs the process and reaps it: its open connections are reset, new ones refused.
    pub fn kill(&mut self) {
        self.child.kill();
    }

    /// SIGSTOPs the process: a hung server. The kernel still accepts connections, nothing answers.
    pub fn freeze(&self) {
        self.signal(libc::SIGSTOP);
    }

    /// SIGCONTs a frozen process: it picks up where it stopped.
    pub fn thaw(&self) {
        self.signal(libc::SIGCONT);
    }

    fn signal(&self, sig: libc::c_int) {
        let pid = self.child.pid() as libc::pid_t;
        if pid > 0 {
            // SAFETY: plain syscall on our own live child.
            unsafe {
                libc::kill(pid, sig);
            }
        }
    }

    /// Fails (with the log) if the process has exited.
    pub fn ensure_running(&mut self) -> Result<()> {
        self.child.ensure_running()
    }

    /// The process's log.
    pub fn log(&self) -> String {
        self.child.log()
    }
}
