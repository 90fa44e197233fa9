//! Child processes that cannot outlive the harness.
//!
//! Every child runs in its own process group (so a terminal's Ctrl-C reaches only the harness,
//! which then tears everything down in order) and carries `PR_SET_PDEATHSIG = SIGKILL` (so even a
//! harness killed with SIGKILL, or a test binary interrupted without unwinding, leaves no orphan).
//! Dropping a [`ChildGuard`] kills the whole group and reaps the child.

use anyhow::{anyhow, Context, Result};
use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};

/// A running child process, killed (with its process group) when dropped.
#[derive(Debug)]
pub struct ChildGuard {
    name: String,
    child: Option<Child>,
    log_path: PathBuf,
}

/// Directory where child logs are kept (`$CARGO_TARGET_DIR/e2e-logs`), so a failed run can be read afterwards.
pub fn log_dir() -> PathBuf {
    crate::paths::target_dir().join("e2e-logs")
}

static LOG_SEQ: AtomicU64 = AtomicU64::new(0);

/// A fresh log file path for a child called `name`, unique within and across processes.
pub fn new_log_path(name: &str) -> PathBuf {
    let n = LOG_SEQ.fetch_add(1, Ordering::Relaxed);
    log_dir().join(format!("{name}-{}-{n}.log", std::process::id()))
}

impl ChildGuard {
    /// Spawns `cmd` with stdout and stderr appended to a fresh log file.
    ///
    /// The caller's thread must outlive the child (PDEATHSIG fires when the spawning *thread*
    /// exits): spawn from the main thread, a test thread or a runtime worker, never from a
    /// short-lived blocking-pool thread.
    pub fn spawn(name: &str, mut cmd: Command) -> Result<Self> {
        let log_path = new_log_path(name);
        std::fs::create_dir_all(log_dir()).context("creating the e2e log directory")?;
        let log = File::create(&log_path).with_context(|| format!("creating {}", log_path.display()))?;
        let log_err = log.try_clone()?;
        cmd.stdin(Stdio::null()).stdout(Stdio::from(log)).stderr(Stdio::from(log_err));
        cmd.process_group(0);
        let parent = std::process::id() as libc::pid_t;
        // SAFETY: prctl, getppid and _exit are async-signal-safe and touch no memory of the parent.
        unsafe {
            cmd.pre_exec(move || {
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL as libc::c_ulong, 0, 0, 0) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                // The parent may have died between fork and prctl: then nobody would kill us.
                if libc::getppid() != parent {
                    libc::_exit(1);
                }
                Ok(())
            });
        }
        let child = cmd.spawn().with_context(|| format!("starting {name}: {:?}", cmd.get_program()))?;
        Ok(Self { name: name.to_string(), child: Some(child), log_path })
    }

    /// Process id of the child (also its process group id).
    pub fn pid(&self) -> u32 {
        self.child.as_ref().map(|c| c.id()).unwrap_or(0)
    }

    /// Path of the file holding the child's stdout and stderr.
    pub fn log_path(&self) -> &Path {
        &self.log_path
    }

    /// The whole log so far (lossy UTF-8).
    pub fn log(&self) -> String {
        std::fs::read(&self.log_path).map(|b| String::from_utf8_lossy(&b).into_owned()).unwrap_or_default()
    }

    /// The last `max_bytes` of the log, for error messages.
    pub fn log_tail(&self, max_bytes: u64) -> String {
        let Ok(mut f) = File::open(&self.log_path) else { return String::new() };
        let len = f.metadata().map(|m| m.len()).unwrap_or(0);
        let _ = f.seek(SeekFrom::Start(len.saturating_sub(max_bytes)));
        let mut buf = Vec::new();
        let _ = f.read_to_end(&mut buf);
        String::from_utf8_lossy(&buf).into_owned()
    }

    /// `Some(status)` if the child has exited.
    pub fn try_exit_status(&mut self) -> Option<ExitStatus> {
        self.child.as_mut().and_then(|c| c.try_wait().ok().flatten())
    }

    /// Fails with the log tail if the child has exited.
    pub fn ensure_running(&mut self) -> Result<()> {
        match self.try_exit_status() {
            None => Ok(()),
            Some(st) => {
                Err(anyhow!("{} exited ({st}); log {}:\n{}", self.name, self.log_path.display(), self.log_tail(4000)))
            }
        }
    }

    /// Kills the process group and reaps the child. Idempotent.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let pgid = child.id() as libc::pid_t;
            // SAFETY: plain syscall; the group id is our own child's.
            unsafe {
                libc::kill(-pgid, libc::SIGKILL);
            }
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

impl Drop for ChildGuard {
    fn drop(&mut self) {
        self.kill();
    }
}
