//! Fault injection for soak runs: what the engine injects ([`Faults`], counted in
//! [`FaultCounts`]), backends that hang for a while ([`HangingUpstream`]), and garbage
//! `/metrics` pages. Every fault is drawn from its own seeded stream, so a run stays a pure
//! function of its inputs and changing one rate does not move the others' draws.
//!
//! The faults a soak combines, and where each lives:
//! - client cancels while queued in the gateway and while streaming, backend resets mid-stream
//!   and before the response headers, failed (refused, timed out) and malformed scrapes: the
//!   engine, from [`Faults`] in [`crate::GatewayConfig::faults`];
//! - the stream idle timeout that ends requests stuck on a hung backend: the engine
//!   ([`crate::GatewayConfig::stream_idle_timeout_us`]);
//! - hung backends: [`HangingUpstream`];
//! - traps in VM callbacks: the host ([`crate::PluginSpec::trap_rate`]);
//! - CAS races: the host ([`crate::PluginSpec::cas_conflict_rate`]);
//! - tick jitter: the engine ([`crate::GatewayConfig::tick_jitter_us`]).

use crate::sim::upstream::{Upstream, UpstreamEvent, UpstreamRequest};
use proxy_wasm_host::abi::HeaderMap;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use std::any::Any;

/// Faults the engine injects. Rates are probabilities per opportunity (a request that becomes
/// queued, a response whose first token reaches the client, a request sent upstream, a scrape);
/// a fault fires at a uniform delay within its window, and only if the request is still in the
/// phase it targets then (otherwise it counts as missed).
#[derive(Clone, Debug, Default)]
pub struct Faults {
    /// Seed of the fault streams (one stream per fault kind).
    pub seed: u64,
    /// A request the gateway holds (body received, filter paused) is cancelled by its client.
    pub cancel_queued_rate: f64,
    /// ... within this long after it was queued, µs.
    pub cancel_queued_within_us: u64,
    /// A streaming response is cancelled by its client after its first token.
    pub cancel_streaming_rate: f64,
    /// ... within this long after the first token, µs.
    pub cancel_streaming_within_us: u64,
    /// The backend resets a stream after its first token (Envoy's
    /// `upstream_reset_after_response_started{remote_reset}`).
    pub reset_mid_stream_rate: f64,
    /// ... within this long after the first token, µs.
    pub reset_mid_stream_within_us: u64,
    /// The backend resets a request before any response header (Envoy answers 503,
    /// `upstream_reset_before_response_started{remote_reset}`).
    pub reset_before_headers_rate: f64,
    /// ... within this long after the request was sent upstream, µs.
    pub reset_before_headers_within_us: u64,
    /// A scrape's connection is refused (Envoy's async client answers 503 itself).
    pub scrape_refused_rate: f64,
    /// A scrape times out (delivered as a failed call after the call's timeout).
    pub scrape_timeout_rate: f64,
    /// A scrape answers 200 with a garbage body (random bytes, broken Prometheus lines, a
    /// truncated or corrupted real page, HTML, nothing).
    pub scrape_malformed_rate: f64,
}

impl Faults {
    /// Whether any engine fault is on.
    pub fn any(&self) -> bool {
        [
            self.cancel_queued_rate,
            self.cancel_streaming_rate,
            self.reset_mid_stream_rate,
            self.reset_before_headers_rate,
            self.scrape_refused_rate,
            self.scrape_timeout_rate,
            self.scrape_malformed_rate,
        ]
        .iter()
        .any(|&r| r > 0.0)
    }
}

/// The seeded streams of [`Faults`], one per kind.
pub(crate) struct FaultRng {
    pub cancel_queued: ChaCha8Rng,
    pub cancel_streaming: ChaCha8Rng,
    pub reset: ChaCha8Rng,
    pub scrape: ChaCha8Rng,
}

impl FaultRng {
    pub fn new(seed: u64) -> FaultRng {
        let s = |k: u64| ChaCha8Rng::seed_from_u64(seed ^ k.wrapping_mul(0x9e37_79b9_7f4a_7c15));
        FaultRng { cancel_queued: s(1), cancel_streaming: s(2), reset: s(3), scrape: s(4) }
    }
}

/// Draws whether a fault of probability `rate` fires and, if so, its delay in `0..=within_us`.
pub(crate) fn draw(rng: &mut ChaCha8Rng, rate: f64, within_us: u64) -> Option<u64> {
    if rate <= 0.0 || rng.random::<f64>() >= rate {
        return None;
    }
    Some(rng.random_range(0..=within_us))
}

/// What was injected and what it did, counted by the engine.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct FaultCounts {
    /// Client cancels of requests held by the gateway.
    pub cancels_queued: u64,
    /// Planned cancels that found the request no longer queued.
    pub cancels_queued_missed: u64,
    /// Client cancels of streaming responses.
    pub cancels_streaming: u64,
    /// Planned streaming cancels that found the response finished.
    pub cancels_streaming_missed: u64,
    /// Backend resets after the first token.
    pub resets_mid_stream: u64,
    /// Backend resets before any response header.
    pub resets_before_headers: u64,
    /// Planned resets that found the request no longer upstream (or its backend hung).
    pub resets_missed: u64,
    /// Scrapes (`dispatch_http_call`s to a known endpoint).
    pub scrapes: u64,
    /// Scrapes refused.
    pub scrapes_refused: u64,
    /// Scrapes timed out (injected).
    pub scrapes_timed_out: u64,
    /// Scrapes answered with garbage.
    pub scrapes_malformed: u64,
    /// Scrapes sent to a hung backend (they time out).
    pub scrapes_to_hung_backend: u64,
    /// Streams ended by the stream idle timeout.
    pub idle_timeouts: u64,
    /// ... of which were waiting on a hung backend.
    pub idle_timeouts_on_hung_backend: u64,
    /// Ticks that fired late (jitter > 0).
    pub ticks_jittered: u64,
    /// Streams sent upstream (so holding a stock slot in the filter) that ended without a
    /// completed `on_log`, because their VM had failed or trapped there: the filter never saw
    /// them end.
    pub dispatched_ended_without_log: u64,
    /// Local replies the filter asked for on a stream that had already ended (a second answer).
    pub answers_after_end: u64,
}

/// A backend that stops answering during given windows of virtual time, as a SIGSTOPped model
/// server does: nothing it holds progresses, requests sent to it are accepted but not read,
/// `/metrics` calls get no answer (the engine times them out, see [`Upstream::hung_until`]).
/// When a window ends it carries on where it stopped (its clock is shifted by the time it was
/// frozen); requests the gateway gave up on meanwhile were aborted.
pub struct HangingUpstream {
    inner: Box<dyn Upstream>,
    windows: Vec<(u64, u64)>,
    next: usize,
    offset: u64,
    frozen_since: Option<u64>,
    held: Vec<(u64, UpstreamRequest)>,
    /// Hangs that started so far.
    pub hangs: u64,
    /// Virtual time spent hung so far, µs (completed windows).
    pub hung_us: u64,
}

impl HangingUpstream {
    /// Wraps `inner`; it hangs during each `[start, end)` of `windows` (sorted, disjoint).
    pub fn new(inner: Box<dyn Upstream>, mut windows: Vec<(u64, u64)>) -> HangingUpstream {
        windows.retain(|w| w.1 > w.0);
        windows.sort();
        HangingUpstream {
            inner,
            windows,
            next: 0,
            offset: 0,
            frozen_since: None,
            held: Vec::new(),
            hangs: 0,
            hung_us: 0,
        }
    }

    /// The hang windows.
    pub fn windows(&self) -> &[(u64, u64)] {
        &self.windows
    }

    /// The wrapped endpoint.
    pub fn inner(&self) -> &dyn Upstream {
        self.inner.as_ref()
    }

    /// The inner clock at engine time `now` (constant while frozen).
    fn inner_now(&self, now: u64) -> u64 {
        match self.frozen_since {
            Some(ws) => ws - self.offset,
            None => match self.windows.get(self.next) {
                Some(&(ws, _)) if now >= ws => ws - self.offset,
                _ => now - self.offset,
            },
        }
    }

    /// Enters and leaves windows up to `now`; events the inner endpoint produced before a
    /// freeze, or for requests submitted at a thaw, go to `out`.
    fn step(&mut self, now: u64, out: &mut Vec<UpstreamEvent>) {
        loop {
            if let Some(ws) = self.frozen_since {
                let we = self.windows[self.next].1;
                if now < we {
                    return;
                }
                self.offset += we - ws;
                self.hung_us += we - ws;
                self.frozen_since = None;
                self.next += 1;
                let t = we - self.offset;
                for (id, req) in std::mem::take(&mut self.held) {
                    out.extend(self.inner.submit(t, id, req));
                }
            } else if let Some(&(ws, _)) = self.windows.get(self.next) {
                if now < ws {
                    return;
                }
                out.extend(self.inner.advance(ws - self.offset));
                self.frozen_since = Some(ws);
                self.hangs += 1;
            } else {
                return;
            }
        }
    }
}

impl Upstream for HangingUpstream {
    fn submit(&mut self, now_us: u64, id: u64, req: UpstreamRequest) -> Vec<UpstreamEvent> {
        let mut out = Vec::new();
        self.step(now_us, &mut out);
        if self.frozen_since.is_some() {
            self.held.push((id, req));
        } else {
            out.extend(self.inner.submit(now_us - self.offset, id, req));
        }
        out
    }

    fn abort(&mut self, now_us: u64, id: u64) {
        if let Some(p) = self.held.iter().position(|(h, _)| *h == id) {
            self.held.remove(p);
            return;
        }
        let t = self.inner_now(now_us);
        self.inner.abort(t, id);
    }

    fn next_event_us(&self) -> Option<u64> {
        let busy = self.inner.next_event_us();
        match self.frozen_since {
            Some(_) => (busy.is_some() || !self.held.is_empty()).then_some(self.windows[self.next].1),
            None => busy.map(|t| {
                let t = t + self.offset;
                self.windows.get(self.next).map_or(t, |&(ws, _)| t.min(ws))
            }),
        }
    }

    fn advance(&mut self, now_us: u64) -> Vec<UpstreamEvent> {
        let mut out = Vec::new();
        self.step(now_us, &mut out);
        if self.frozen_since.is_none() {
            out.extend(self.inner.advance(now_us - self.offset));
        }
        out
    }

    fn handle_call(&mut self, now_us: u64, headers: &HeaderMap, body: &[u8]) -> (HeaderMap, Vec<u8>) {
        let t = self.inner_now(now_us);
        self.inner.handle_call(t, headers, body)
    }

    fn hung_until(&self, now_us: u64) -> Option<u64> {
        self.windows[self.next.min(self.windows.len())..]
            .iter()
            .find(|w| w.1 > now_us)
            .filter(|w| w.0 <= now_us)
            .map(|w| w.1)
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}

/// Hang windows for one backend: hangs start as a Poisson process of mean gap `mean_gap_us`
/// (after the previous hang ended), each lasting uniformly `min_us..=max_us`, until `until_us`.
pub fn hang_windows(seed: u64, mean_gap_us: u64, min_us: u64, max_us: u64, until_us: u64) -> Vec<(u64, u64)> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let mut out = Vec::new();
    if mean_gap_us == 0 || max_us == 0 {
        return out;
    }
    let mut t = 0u64;
    loop {
        let gap = -(1.0 - rng.random::<f64>()).ln() * mean_gap_us as f64;
        t = t.saturating_add(gap as u64);
        if t >= until_us {
            return out;
        }
        let d = rng.random_range(min_us.min(max_us)..=max_us);
        out.push((t, t + d));
        t += d;
    }
}

/// A garbage `/metrics` body, derived from the real page `real` by one of several corruptions.
pub(crate) fn garbage_metrics(rng: &mut ChaCha8Rng, real: &[u8]) -> Vec<u8> {
    match rng.random_range(0..7u32) {
        // Random bytes, invalid UTF-8 included.
        0 => {
            let n = rng.random_range(1..4096);
            (0..n).map(|_| rng.random::<u8>()).collect()
        }
        // The real page cut at a random byte.
        1 => real[..rng.random_range(0..=real.len())].to_vec(),
        // The real page with bytes overwritten.
        2 => {
            let mut b = real.to_vec();
            for _ in 0..rng.random_range(1..32) {
                if !b.is_empty() {
                    let i = rng.random_range(0..b.len());
                    b[i] = rng.random();
                }
            }
            b
        }
        // Known metric names with values that are not numbers, or absurd ones.
        3 => {
            let vals = ["NaN", "+Inf", "-Inf", "1e999", "-5", "0x10", "", "18446744073709551617", "\u{0}"];
            let names = [
                "vllm:num_requests_waiting",
                "vllm:num_requests_running",
                "vllm:gpu_cache_usage_perc",
                "vllm:kv_cache_usage_perc",
                "vllm:lora_requests_info",
            ];
            let mut s = String::new();
            for _ in 0..rng.random_range(1..12) {
                let n = names[rng.random_range(0..names.len())];
                let v = vals[rng.random_range(0..vals.len())];
                match rng.random_range(0..4u32) {
                    0 => s.push_str(&format!("{n}{{model_name=\"m\"}} {v}\n")),
                    1 => s.push_str(&format!("{n}{{model_name=\"m\" {v}\n")),
                    2 => s.push_str(&format!("{n}{{{}}} {v}\n", "a=\"b\",".repeat(rng.random_range(0..200)))),
                    _ => s.push_str(&format!("{n} {v} {v} {v}\n")),
                }
            }
            s.into_bytes()
        }
        // An HTML error page.
        4 => b"<html><body><h1>502 Bad Gateway</h1></body></html>".to_vec(),
        // Nothing.
        5 => Vec::new(),
        // One very long line.
        _ => {
            let mut b = b"vllm:num_requests_waiting ".to_vec();
            b.extend(std::iter::repeat_n(b'9', rng.random_range(1000..200_000)));
            b
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sim::upstream::{StaticResponse, StaticUpstream};

    fn req() -> UpstreamRequest {
        UpstreamRequest { headers: Vec::new(), body: Vec::new(), prefix_hashes: Vec::new(), output_tokens: None }
    }

    /// Runs an upstream the way the engine does, returning (time, event) pairs.
    fn drive(up: &mut dyn Upstream, submits: &[(u64, u64)], until: u64) -> Vec<(u64, UpstreamEvent)> {
        let mut out = Vec::new();
        let mut pending: Vec<(u64, u64)> = submits.to_vec();
        let mut now = 0;
        loop {
            let next_submit = pending.first().map(|s| s.0);
            let next_ev = up.next_event_us();
            let t = match (next_submit, next_ev) {
                (Some(a), Some(b)) => a.min(b),
                (Some(a), None) => a,
                (None, Some(b)) => b,
                (None, None) => break,
            };
            if t > until {
                break;
            }
            now = t.max(now);
            if next_submit == Some(t) {
                let (_, id) = pending.remove(0);
                out.extend(up.submit(now, id, req()).into_iter().map(|e| (now, e)));
            } else {
                out.extend(up.advance(now).into_iter().map(|e| (now, e)));
            }
        }
        out
    }

    #[test]
    fn a_hung_backend_freezes_and_then_carries_on_shifted() {
        let cfg = StaticResponse { latency_us: 1000, chunk_gap_us: 1000, ..Default::default() };
        let plain = drive(&mut StaticUpstream::new(cfg.clone()), &[(0, 1)], u64::MAX);
        let times: Vec<u64> = plain.iter().map(|e| e.0).collect();
        assert_eq!(times, vec![1000, 2000, 3000]);
        // Hung from 1500 to 11500: the events after 1500 move by 10 ms.
        let mut h = HangingUpstream::new(Box::new(StaticUpstream::new(cfg.clone())), vec![(1500, 11_500)]);
        assert_eq!(h.hung_until(1499), None);
        assert_eq!(h.hung_until(1500), Some(11_500));
        let hung = drive(&mut h, &[(0, 1)], u64::MAX);
        let times: Vec<u64> = hung.iter().map(|e| e.0).collect();
        assert_eq!(times, vec![1000, 12_000, 13_000]);
        assert_eq!((h.hangs, h.hung_us), (1, 10_000));
        // A request sent during the hang is read only when it ends.
        let mut h = HangingUpstream::new(Box::new(StaticUpstream::new(cfg)), vec![(100, 5_100)]);
        let evs = drive(&mut h, &[(200, 7)], u64::MAX);
        assert_eq!(evs.first().map(|e| e.0), Some(6_100));
    }

    #[test]
    fn an_aborted_request_held_by_a_hung_backend_is_forgotten() {
        let mut h = HangingUpstream::new(Box::new(StaticUpstream::new(StaticResponse::default())), vec![(0, 10_000)]);
        assert!(h.submit(10, 1, req()).is_empty());
        assert_eq!(h.next_event_us(), Some(10_000));
        h.abort(20, 1);
        assert_eq!(h.next_event_us(), None);
        assert!(h.advance(10_000).is_empty());
    }

    #[test]
    fn hang_windows_are_disjoint_and_seeded() {
        let w = hang_windows(7, 1_000_000, 100_000, 300_000, 60_000_000);
        assert!(!w.is_empty());
        assert!(w.windows(2).all(|p| p[0].1 <= p[1].0));
        assert!(w.iter().all(|&(a, b)| (100_000..=300_000).contains(&(b - a))));
        assert_eq!(w, hang_windows(7, 1_000_000, 100_000, 300_000, 60_000_000));
        assert_ne!(w, hang_windows(8, 1_000_000, 100_000, 300_000, 60_000_000));
    }
}
