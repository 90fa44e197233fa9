//! The demo leaves no Envoy or backend behind, whether stopped with Ctrl-C (SIGINT) or killed outright.

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// Pids whose parent is `pid` (from /proc).
fn children(pid: u32) -> Vec<u32> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir("/proc").expect("/proc is readable").flatten() {
        let Ok(p) = entry.file_name().to_string_lossy().parse::<u32>() else { continue };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{p}/stat")) else { continue };
        // Field 4 (ppid) follows the parenthesised command name, which may contain spaces.
        let after = stat.rsplit_once(')').map(|(_, r)| r).unwrap_or("");
        if after.split_whitespace().nth(1).and_then(|s| s.parse::<u32>().ok()) == Some(pid) {
            out.push(p);
        }
    }
    out
}

/// Whether `pid` is still a live (non-zombie) process.
fn alive(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => !stat.rsplit_once(')').is_some_and(|(_, r)| r.trim_start().starts_with('Z')),
        Err(_) => false,
    }
}

fn check(signal: libc::c_int) {
    let mut demo = Command::new(env!("CARGO_BIN_EXE_sluice-demo"))
        // Free ports so a developer's Envoy on 10000 does not matter; long enough to be mid-run.
        .args(["--listener-port", "0", "--admin-port", "0", "--duration", "60", "--policies", "vtc"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("the demo binary starts");
    // Wait for Envoy and the backends (two children) to be up.
    let deadline = Instant::now() + Duration::from_secs(60);
    let kids = loop {
        let kids = children(demo.id());
        if kids.len() >= 2 {
            break kids;
        }
        if let Ok(Some(st)) = demo.try_wait() {
            panic!("the demo exited early ({st}); is scripts/setup.sh done?");
        }
        assert!(Instant::now() < deadline, "the demo did not start Envoy and the backends within 60 s");
        std::thread::sleep(Duration::from_millis(100));
    };
    std::thread::sleep(Duration::from_secs(2)); // let the load start
                                                // SAFETY: plain kill(2) of our own child.
    unsafe {
        libc::kill(demo.id() as libc::pid_t, signal);
    }
    let status = demo.wait().expect("the demo is reaped");
    let deadline = Instant::now() + Duration::from_secs(10);
    while kids.iter().any(|&k| alive(k)) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
    }
    let left: Vec<u32> = kids.iter().copied().filter(|&k| alive(k)).collect();
    for &k in &left {
        // SAFETY: clean up before failing so the test itself leaves nothing behind.
        unsafe {
            libc::kill(k as libc::pid_t, libc::SIGKILL);
        }
    }
    assert!(left.is_empty(), "after signal {signal} (demo exit {status}) these children survived: {left:?}");
}

#[test]
fn ctrl_c_stops_envoy_and_backends() {
    check(libc::SIGINT);
}

#[test]
fn killing_the_demo_kills_its_children() {
    check(libc::SIGKILL);
}
