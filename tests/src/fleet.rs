//! One simulated backend per process, so a test can kill one backend of a pool and later bring it
//! back on the same address (the filter's endpoint list is fixed at configuration time).

use crate::backend::BackendOptions;
use crate::process::ChildGuard;
use anyhow::Result;
use std::net::SocketAddr;

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
        let (child, addrs) = crate::backend::spawn(port, 1, opts).await?;
        Ok(Backend { child, addr: addrs[0] })
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
