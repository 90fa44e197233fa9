//! Minimal HTTP/1.1 over a raw TCP stream (`Connection: close`), for the admin interface and for
//! requests a pooled client cannot express: a body sent in pieces, or a client that hangs up.

use anyhow::{anyhow, bail, Context, Result};
use std::net::SocketAddr;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// A complete response.
#[derive(Debug, Clone)]
pub struct RawResponse {
    /// Status code.
    pub status: u16,
    /// Header (lower-cased name, value) pairs in order.
    pub headers: Vec<(String, String)>,
    /// Body, de-chunked.
    pub body: Vec<u8>,
}

impl RawResponse {
    /// First value of header `name` (case-insensitive).
    pub fn header(&self, name: &str) -> Option<&str> {
        let name = name.to_ascii_lowercase();
        self.headers.iter().find(|(k, _)| *k == name).map(|(_, v)| v.as_str())
    }

    /// Body as (lossy) text.
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }
}

/// Serialises a request head; `content_length` is added when a body length is known.
pub fn request_head(method: &str, path: &str, headers: &[(&str, &str)], content_length: Option<usize>) -> String {
    let mut head = format!("{method} {path} HTTP/1.1\r\nhost: localhost\r\nconnection: close\r\n");
    for (k, v) in headers {
        head.push_str(&format!("{k}: {v}\r\n"));
    }
    if let Some(n) = content_length {
        head.push_str(&format!("content-length: {n}\r\n"));
    }
    head.push_str("\r\n");
    head
}

/// Sends one request and reads the whole response (bounded by `timeout`).
pub async fn request(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &[u8],
    timeout: Duration,
) -> Result<RawResponse> {
    tokio::time::timeout(timeout, async {
        let mut s = TcpStream::connect(addr).await.with_context(|| format!("connecting to {addr}"))?;
        let head = request_head(method, path, headers, Some(body.len()));
        // A server may answer (413, 400) and close before reading the whole body: a failed write
        // is not the outcome, the response is.
        let wrote = async {
            s.write_all(head.as_bytes()).await?;
            s.write_all(body).await
        }
        .await;
        read_response(&mut s).await.with_context(|| format!("{method} {path} to {addr} (request write: {wrote:?})"))
    })
    .await
    .map_err(|_| anyhow!("{method} {path} to {addr}: no complete response within {timeout:?}"))?
}

/// Writes `bytes` (a request exactly as given: any bytes in its head, its whole body) and only then
/// reads the response, as clients that write before they read do (python `http.client`, httpx).
/// Returns whether the whole write succeeded, and the response; bounded by `timeout`.
pub async fn write_all_then_read(
    addr: SocketAddr,
    bytes: &[u8],
    timeout: Duration,
) -> Result<(std::io::Result<()>, RawResponse)> {
    tokio::time::timeout(timeout, async {
        let mut s = TcpStream::connect(addr).await.with_context(|| format!("connecting to {addr}"))?;
        let wrote = s.write_all(bytes).await;
        let r =
            read_response(&mut s).await.with_context(|| format!("reading the response (request write: {wrote:?})"))?;
        Ok((wrote, r))
    })
    .await
    .map_err(|_| anyhow!("{addr}: no complete response within {timeout:?}"))?
}

/// Reads a response head (status line and headers) and leaves the body unread, for a response
/// that streams on. The returned response has the body bytes that arrived with the head.
pub async fn read_head(s: &mut TcpStream) -> Result<RawResponse> {
    let mut buf = Vec::new();
    let mut chunk = [0u8; 4096];
    while !buf.windows(4).any(|w| w == b"\r\n\r\n") {
        let n = s.read(&mut chunk).await.context("reading a response head")?;
        if n == 0 {
            bail!("connection closed before the response head ({} bytes)", buf.len());
        }
        buf.extend_from_slice(&chunk[..n]);
    }
    let end = buf.windows(4).position(|w| w == b"\r\n\r\n").unwrap_or(0);
    let (status, headers) = parse_head(&buf[..end])?;
    Ok(RawResponse { status, headers, body: buf[end + 4..].to_vec() })
}

/// `GET path` with a 10 s bound, returning (status, body text).
pub async fn get(addr: SocketAddr, path: &str) -> Result<(u16, String)> {
    let r = request(addr, "GET", path, &[], b"", Duration::from_secs(10)).await?;
    Ok((r.status, r.text()))
}

/// Reads one response: up to its content-length or last chunk, else until the server closes.
///
/// Stopping at the end of the message matters: Envoy delays closing a connection it wants closed
/// until the peer closes (`delayed_close_timeout`, 1 s), so waiting for EOF would add a second.
/// A reset after part of the response arrived (the server closed with our request body unread)
/// still yields what was received.
pub async fn read_response(s: &mut TcpStream) -> Result<RawResponse> {
    let mut buf = Vec::new();
    let mut chunk = [0u8; 16384];
    loop {
        if response_complete(&buf) {
            break;
        }
        match s.read(&mut chunk).await {
            Ok(0) => break,
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
            Err(_) if !buf.is_empty() => break,
            Err(e) => return Err(e).context("reading the response"),
        }
    }
    parse_response(&buf)
}

/// Whether `buf` holds a whole response with a known length (content-length or chunked).
fn response_complete(buf: &[u8]) -> bool {
    let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") else { return false };
    let head = String::from_utf8_lossy(&buf[..end]).to_ascii_lowercase();
    let body = &buf[end + 4..];
    for line in head.split("\r\n") {
        if let Some(v) = line.strip_prefix("content-length:") {
            return v.trim().parse::<usize>().is_ok_and(|n| body.len() >= n);
        }
        if line.starts_with("transfer-encoding:") && line.contains("chunked") {
            return dechunk(body).is_ok();
        }
    }
    false
}

/// Parses a complete response (head and body, chunked or not).
pub fn parse_response(buf: &[u8]) -> Result<RawResponse> {
    let end = buf
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .ok_or_else(|| anyhow!("incomplete response head ({} bytes received)", buf.len()))?;
    let (status, headers) = parse_head(&buf[..end])?;
    let raw_body = &buf[end + 4..];
    let chunked = headers.iter().any(|(k, v)| k == "transfer-encoding" && v.to_ascii_lowercase().contains("chunked"));
    let body = if chunked { dechunk(raw_body)? } else { raw_body.to_vec() };
    Ok(RawResponse { status, headers, body })
}

/// Status and headers of a response head (without its blank line).
fn parse_head(head: &[u8]) -> Result<(u16, Vec<(String, String)>)> {
    let head = String::from_utf8_lossy(head);
    let mut lines = head.split("\r\n");
    let status_line = lines.next().unwrap_or_default();
    let status: u16 = status_line
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| anyhow!("bad status line {status_line:?}"))?;
    let headers: Vec<(String, String)> = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_string()))
        .collect();
    Ok((status, headers))
}

fn dechunk(mut data: &[u8]) -> Result<Vec<u8>> {
    let mut out = Vec::new();
    loop {
        let line_end = data.windows(2).position(|w| w == b"\r\n").ok_or_else(|| anyhow!("truncated chunk size"))?;
        let size_text = String::from_utf8_lossy(&data[..line_end]);
        let size = usize::from_str_radix(size_text.split(';').next().unwrap_or("").trim(), 16)
            .map_err(|_| anyhow!("bad chunk size {size_text:?}"))?;
        data = &data[line_end + 2..];
        if size == 0 {
            return Ok(out);
        }
        if data.len() < size {
            bail!("truncated chunk");
        }
        out.extend_from_slice(&data[..size]);
        data = data.get(size + 2..).unwrap_or(&[]);
    }
}
