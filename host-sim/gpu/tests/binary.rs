//! The `sluice-backend` binary as a harness starts it: parse the `listening` lines, serve, stop on
//! SIGTERM.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

fn http(addr: &str, req: &str) -> String {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    s.write_all(req.as_bytes()).unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    out
}

#[test]
fn prints_one_line_per_backend_serves_and_stops_on_sigterm() {
    let mut child = Command::new(env!("CARGO_BIN_EXE_sluice-backend"))
        .args(["--port", "0", "--count", "2", "--profile", "fast", "--default-max-tokens", "3"])
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let addrs: Vec<String> = (0..2)
        .map(|_| lines.next().unwrap().unwrap().strip_prefix("listening ").expect("listening line").to_string())
        .collect();
    assert_ne!(addrs[0], addrs[1]);
    for a in &addrs {
        assert!(a.starts_with("127.0.0.1:"));
        let body = r#"{"model":"m","prompt":"hello"}"#;
        let resp = http(
            a,
            &format!(
                "POST /v1/completions HTTP/1.1\r\nhost: x\r\nconnection: close\r\ncontent-length: {}\r\n\r\n{body}",
                body.len()
            ),
        );
        assert!(resp.starts_with("HTTP/1.1 200"), "{resp}");
        assert!(resp.contains(&format!("x-sluice-backend: {a}")));
        assert!(resp.contains(r#""completion_tokens":3"#), "{resp}");
    }
    let ok = Command::new("kill").args(["-TERM", &child.id().to_string()]).status().unwrap();
    assert!(ok.success());
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            assert!(status.success(), "clean exit on SIGTERM: {status}");
            break;
        }
        assert!(Instant::now() < deadline, "still running 5 s after SIGTERM");
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn bad_options_are_reported() {
    let out = Command::new(env!("CARGO_BIN_EXE_sluice-backend")).args(["--profile", "h200"]).output().unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--profile") && err.contains("llama2-7b-a10g"), "{err}");
    let out =
        Command::new(env!("CARGO_BIN_EXE_sluice-backend")).args(["--time-scale=0", "--port", "0"]).output().unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("--time-scale"));
}
