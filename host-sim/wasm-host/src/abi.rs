//! Constants and wire formats of the proxy-wasm ABI v0.2.1 (status codes, enums, header-map
//! serialisation), shared by the host functions and the harness.

/// Status codes returned by host functions (proxy-wasm ABI v0.2.1 `WasmResult`).
#[allow(missing_docs)]
#[repr(i32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Status {
    Ok = 0,
    NotFound = 1,
    BadArgument = 2,
    SerializationFailure = 3,
    ParseFailure = 4,
    InvalidMemoryAccess = 6,
    Empty = 7,
    CasMismatch = 8,
    InternalFailure = 10,
    Unimplemented = 12,
}

/// `proxy_log` levels.
#[allow(missing_docs)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, serde::Serialize)]
pub enum LogLevel {
    Trace,
    Debug,
    Info,
    Warn,
    Error,
    Critical,
}

impl LogLevel {
    /// Decodes the ABI value; anything above 5 is treated as critical rather than rejected.
    pub fn from_abi(v: i32) -> LogLevel {
        match v {
            0 => LogLevel::Trace,
            1 => LogLevel::Debug,
            2 => LogLevel::Info,
            3 => LogLevel::Warn,
            4 => LogLevel::Error,
            _ => LogLevel::Critical,
        }
    }

    /// The ABI value.
    pub fn to_abi(self) -> i32 {
        self as i32
    }
}

/// `MapType` values.
pub mod map_type {
    /// Request headers of the effective HTTP context.
    pub const REQUEST_HEADERS: i32 = 0;
    /// Request trailers.
    pub const REQUEST_TRAILERS: i32 = 1;
    /// Response headers.
    pub const RESPONSE_HEADERS: i32 = 2;
    /// Response trailers.
    pub const RESPONSE_TRAILERS: i32 = 3;
    /// gRPC initial metadata (not simulated).
    pub const GRPC_INITIAL_METADATA: i32 = 4;
    /// gRPC trailing metadata (not simulated).
    pub const GRPC_TRAILING_METADATA: i32 = 5;
    /// Headers of the http-call response being delivered.
    pub const HTTP_CALL_RESPONSE_HEADERS: i32 = 6;
    /// Trailers of the http-call response being delivered.
    pub const HTTP_CALL_RESPONSE_TRAILERS: i32 = 7;
}

/// `BufferType` values.
pub mod buffer_type {
    /// Request body (the buffered part visible to the current callback).
    pub const REQUEST_BODY: i32 = 0;
    /// Response body.
    pub const RESPONSE_BODY: i32 = 1;
    /// TCP downstream data (not simulated).
    pub const DOWNSTREAM_DATA: i32 = 2;
    /// TCP upstream data (not simulated).
    pub const UPSTREAM_DATA: i32 = 3;
    /// Body of the http-call response being delivered.
    pub const HTTP_CALL_RESPONSE_BODY: i32 = 4;
    /// gRPC message (not simulated).
    pub const GRPC_RECEIVE: i32 = 5;
    /// VM configuration, during `on_vm_start`.
    pub const VM_CONFIGURATION: i32 = 6;
    /// Plugin configuration, during `on_configure`.
    pub const PLUGIN_CONFIGURATION: i32 = 7;
    /// Foreign-function call data.
    pub const CALL_DATA: i32 = 8;
}

/// `StreamType` values for `proxy_continue_stream` / `proxy_close_stream`.
pub mod stream_type {
    /// HTTP request direction.
    pub const REQUEST: i32 = 0;
    /// HTTP response direction.
    pub const RESPONSE: i32 = 1;
    /// TCP downstream (not simulated).
    pub const DOWNSTREAM: i32 = 2;
    /// TCP upstream (not simulated).
    pub const UPSTREAM: i32 = 3;
}

/// `MetricType` values.
pub mod metric_type {
    /// Monotonic counter.
    pub const COUNTER: i32 = 0;
    /// Gauge.
    pub const GAUGE: i32 = 1;
    /// Histogram.
    pub const HISTOGRAM: i32 = 2;
}

/// Filter actions returned by the stream callbacks.
pub mod action {
    /// Continue iteration.
    pub const CONTINUE: i32 = 0;
    /// Stop iteration (pause); with a body callback, buffer.
    pub const PAUSE: i32 = 1;
}

/// An ordered, multi-valued header map with lower-case names, as Envoy keeps it.
pub type HeaderMap = Vec<(String, Vec<u8>)>;

/// Serialises a header map in the ABI layout: count, (key_len, value_len)*, then each key and
/// value followed by a NUL byte.
pub fn serialize_map(map: &[(String, Vec<u8>)]) -> Vec<u8> {
    let mut size = 4;
    for (k, v) in map {
        size += 10 + k.len() + v.len();
    }
    let mut out = Vec::with_capacity(size);
    out.extend_from_slice(&(map.len() as u32).to_le_bytes());
    for (k, v) in map {
        out.extend_from_slice(&(k.len() as u32).to_le_bytes());
        out.extend_from_slice(&(v.len() as u32).to_le_bytes());
    }
    for (k, v) in map {
        out.extend_from_slice(k.as_bytes());
        out.push(0);
        out.extend_from_slice(v);
        out.push(0);
    }
    out
}

/// Parses the ABI header-map layout; `None` when the bytes are truncated or malformed.
pub fn deserialize_map(bytes: &[u8]) -> Option<HeaderMap> {
    if bytes.is_empty() {
        return Some(Vec::new());
    }
    let rd =
        |at: usize| -> Option<usize> { Some(u32::from_le_bytes(bytes.get(at..at + 4)?.try_into().ok()?) as usize) };
    let n = rd(0)?;
    let mut p = 4usize.checked_add(n.checked_mul(8)?)?;
    if p > bytes.len() {
        return None;
    }
    let mut out = Vec::with_capacity(n);
    for i in 0..n {
        let kl = rd(4 + i * 8)?;
        let vl = rd(8 + i * 8)?;
        let k = bytes.get(p..p + kl)?;
        p += kl + 1;
        let v = bytes.get(p..p + vl)?;
        p += vl + 1;
        if p > bytes.len() {
            return None;
        }
        out.push((String::from_utf8_lossy(k).to_ascii_lowercase(), v.to_vec()));
    }
    Some(out)
}

/// Joins a serialised property path (segments separated by NUL) with dots, the way the harness
/// names properties (`request.path`, `plugin_name`).
pub fn property_path(bytes: &[u8]) -> String {
    bytes.split(|b| *b == 0).map(|s| String::from_utf8_lossy(s).into_owned()).collect::<Vec<_>>().join(".")
}

/// First value of `name` (case-insensitive) in a header map.
pub fn header<'a>(map: &'a [(String, Vec<u8>)], name: &str) -> Option<&'a [u8]> {
    map.iter().find(|(k, _)| k.eq_ignore_ascii_case(name)).map(|(_, v)| v.as_slice())
}

/// First value of `name` as UTF-8 text.
pub fn header_str<'a>(map: &'a [(String, Vec<u8>)], name: &str) -> Option<&'a str> {
    header(map, name).and_then(|v| std::str::from_utf8(v).ok())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn map_round_trip_and_truncation() {
        let m: HeaderMap =
            vec![(":path".into(), b"/v1".to_vec()), ("x-a".into(), b"".to_vec()), ("x-a".into(), b"2".to_vec())];
        let b = serialize_map(&m);
        assert_eq!(deserialize_map(&b).unwrap(), m);
        assert!(deserialize_map(&b[..b.len() - 3]).is_none());
        assert!(deserialize_map(&[5, 0, 0, 0]).is_none());
        assert_eq!(property_path(b"request\0path"), "request.path");
    }
}
