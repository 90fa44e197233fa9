//! What a model server's `/metrics` page says of its load.

use crate::prom;
use serde::Deserialize;

/// Which model server exposes the metrics, and so which names to read.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ModelServer {
    /// vLLM (`vllm:*`, with the older `gpu_cache_usage_perc` as a fallback).
    #[default]
    Vllm,
    /// SGLang (`sglang:*`).
    Sglang,
    /// TensorRT-LLM's `trtllm-serve` (`trtllm_*`).
    Trtllm,
}

impl ModelServer {
    /// Prefix cache: the tokens looked up, the tokens found, and a hit-rate
    /// gauge for servers that give no count of hits (`""`: none).
    fn prefix_names(self) -> [&'static str; 3] {
        match self {
            ModelServer::Vllm => ["vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total", ""],
            ModelServer::Sglang => {
                ["sglang:prompt_tokens_total", "sglang:cached_tokens_total", "sglang:cache_hit_rate"]
            }
            ModelServer::Trtllm => ["", "", ""],
        }
    }

    /// Prefill: the seconds spent prefilling (a histogram's `_sum`), the uncached
    /// prompt tokens those prefills computed, and the prompt tokens of all
    /// requests (less the prefix cache's hits: the uncached tokens, where the
    /// second is missing) (`""`: none). SGLang and TensorRT-LLM export no
    /// prefill time apart from the time to first token, which counts the queue.
    fn prefill_names(self) -> [&'static str; 3] {
        match self {
            ModelServer::Vllm => [
                "vllm:request_prefill_time_seconds_sum",
                "vllm:request_prefill_kv_computed_tokens_sum",
                "vllm:prompt_tokens_total",
            ],
            ModelServer::Sglang | ModelServer::Trtllm => ["", "", ""],
        }
    }

    /// Requests the server finished since it started (`""`: none exported).
    fn finished_name(self) -> &'static str {
        match self {
            ModelServer::Vllm => "vllm:request_success_total",
            ModelServer::Sglang | ModelServer::Trtllm => "",
        }
    }

    /// Names of (waiting, running, KV usage 0..1, fallback KV usage).
    fn names(self) -> [&'static str; 4] {
        match self {
            ModelServer::Vllm => [
                "vllm:num_requests_waiting",
                "vllm:num_requests_running",
                "vllm:kv_cache_usage_perc",
                "vllm:gpu_cache_usage_perc",
            ],
            ModelServer::Sglang => ["sglang:num_queue_reqs", "sglang:num_running_reqs", "sglang:token_usage", ""],
            ModelServer::Trtllm => {
                ["trtllm_num_requests_waiting", "trtllm_num_requests_running", "trtllm_kv_cache_utilization", ""]
            }
        }
    }
}

/// What a scrape says of one endpoint.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct EndpointMetrics {
    /// Requests waiting in the server's own queue.
    pub waiting: f64,
    /// Requests in the running batch.
    pub running: f64,
    /// Fraction of the KV cache in use, 0..1.
    pub kv_usage: f64,
    /// LoRA adapters running (vLLM's `lora_requests_info`), at most [`MAX_LORAS`].
    pub loras: Vec<String>,
    /// Prompt tokens looked up in the prefix cache since the server started
    /// (vLLM's `prefix_cache_queries_total`, SGLang's `prompt_tokens_total`);
    /// 0 when the page has none.
    pub prefix_queries: f64,
    /// Of those, the tokens found (vLLM's `prefix_cache_hits_total`, SGLang's
    /// `cached_tokens_total`, or its older `cache_hit_rate` gauge times the
    /// queries).
    pub prefix_hits: f64,
    /// Seconds the server spent prefilling since it started, summed over
    /// requests (vLLM's `request_prefill_time_seconds_sum`: from a request's
    /// first scheduling to its first token, recorded when it finishes); 0 when
    /// the page has none.
    pub prefill_seconds: f64,
    /// The prompt tokens those prefills computed, cached ones excluded (vLLM's
    /// `request_prefill_kv_computed_tokens_sum`, or on versions without it
    /// `prompt_tokens_total` less `prefix_cache_hits_total`).
    pub prefill_tokens: f64,
    /// The endpoint's prefill speed, smoothed over its scrapes: not on the
    /// page, carried from the previous scrape ([`EndpointMetrics::follow`]).
    pub prefill_rate: PrefillRate,
    /// Requests the server finished since it started (vLLM's
    /// `request_success_total`); 0 when the page has none.
    pub finished: f64,
    /// How fast requests leave its batch: not on the page, carried from the
    /// previous scrape ([`EndpointMetrics::follow_departures`]).
    pub departures: Departures,
}

/// Shortest window of scrapes a departure rate is measured over: a 50 ms
/// page sees a step or two, whose completions come in bunches.
pub const DEPARTURE_WINDOW_MS: u64 = 1000;

/// The rate at which requests leave an endpoint's batch, from the growth of
/// its finished-requests counter over windows of at least
/// [`DEPARTURE_WINDOW_MS`]. A request waiting in an engine whose batch is
/// full (its KV cache, or its sequence limit) gets in only when one leaves,
/// so this rate turns the engine's waiting queue into a time
/// ([`super::SaturationThresholds::queue_ms`]). Only then: an engine with
/// room departs as fast as requests arrive, which says nothing of how many
/// it could run, so the rate counts only within [`DEPARTURE_WINDOW_MS`] of a
/// page that showed the batch full ([`super::SaturationThresholds::batch_full`]).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Departures {
    /// The counter and the time (ms) the current window started at.
    pub base: (f64, u64),
    /// Requests per second over the last whole window; 0 before one.
    pub per_s: f64,
    /// When a page last showed the batch full, ms (0: never).
    pub full_at: u64,
    /// Whether the batch was full within [`DEPARTURE_WINDOW_MS`] of this page.
    pub full: bool,
    /// The most requests a page has shown running since the server started:
    /// the batch an engine bound by its sequence limit holds
    /// ([`EndpointMetrics::held_at_limit`]).
    pub most_running: f64,
}

impl Departures {
    /// The rate once the counter reads `finished` at `now_ms`, on a page that
    /// showed the batch full or not: a window of at least
    /// [`DEPARTURE_WINDOW_MS`] is a sample; a counter that went back (a
    /// restart) starts a new window and forgets the rate.
    pub fn next(self, finished: f64, now_ms: u64, full: bool) -> Departures {
        // A time after this page (a hostile record) is forgotten.
        let full_at = if full {
            now_ms
        } else if self.full_at <= now_ms {
            self.full_at
        } else {
            0
        };
        let full = full_at > 0 && now_ms - full_at <= DEPARTURE_WINDOW_MS;
        let (count, at) = self.base;
        if !(finished >= count) || at == 0 || now_ms < at {
            return Departures { base: (finished, now_ms.max(1)), per_s: 0.0, full_at, full, ..self };
        }
        let dt = now_ms - at;
        if dt < DEPARTURE_WINDOW_MS {
            return Departures { full_at, full, ..self };
        }
        let per_s = (finished - count) / (dt as f64 / 1e3);
        Departures {
            base: (finished, now_ms),
            per_s: if per_s.is_finite() { per_s } else { 0.0 },
            full_at,
            full,
            ..self
        }
    }

    /// Requests per second, once measured and above zero, while the batch
    /// was lately full.
    pub fn get(&self) -> Option<f64> {
        (self.full && self.per_s > 0.0 && self.per_s.is_finite()).then_some(self.per_s)
    }
}

/// Samples in each of [`PrefillRate`]'s two epochs: the speed is the least
/// sample of the last one or two epochs (16 to 31 samples), a windowed
/// minimum like BBR's min-RTT filter. A request's prefill time counts every
/// iteration it shared with other prefills (and decodes), so a window's
/// seconds per token is the engine's speed times how many prefills ran
/// together: never below the speed, above it by the load. The least sample
/// reads the engine when it ran one prefill, the hardware (an A100 against an
/// H100) rather than the queue, which the cost already counts; a moving
/// average read identical GPUs more than 1.5× apart. A slowdown that lasts (a
/// throttled GPU) comes through within two epochs.
pub const PREFILL_WINDOW: u32 = 16;
/// Uncached prompt tokens a window needs before it is a sample: a few fully
/// cached prompts (one token computed, a whole iteration spent) would
/// otherwise read as a very slow server. Until then the window grows.
pub const PREFILL_MIN_TOKENS: f64 = 1024.0;
/// Seconds per token outside this range are no server's (a counter that
/// jumped, a histogram in other units): the window is dropped.
const PREFILL_SANE: std::ops::RangeInclusive<f64> = 1e-9..=1.0;

/// An endpoint's prefill speed in seconds per uncached prompt token, from
/// the growth of its prefill counters between scrapes (a counter's deltas,
/// so a restart that resets them costs one window, not a wrong figure).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct PrefillRate {
    /// The counters (`prefill_seconds`, `prefill_tokens`) the current window
    /// started at.
    pub base: (f64, f64),
    /// The least sample of the last whole epoch of [`PREFILL_WINDOW`]
    /// samples; 0 before one.
    pub previous: f64,
    /// The least sample of the epoch under way; 0 before its first.
    pub current: f64,
    /// Samples taken in the epoch under way.
    pub samples: u32,
}

impl PrefillRate {
    /// The rate once the counters read `seconds` and `tokens`: a window of at
    /// least [`PREFILL_MIN_TOKENS`] is a sample, and the rate the least
    /// sample over the last one or two epochs of [`PREFILL_WINDOW`]; counters
    /// that went back (a restart) or a sample out of any server's range start
    /// a new window and leave the rate as it was.
    pub fn next(self, seconds: f64, tokens: f64) -> PrefillRate {
        let (ds, dt) = (seconds - self.base.0, tokens - self.base.1);
        if !(ds >= 0.0 && dt >= 0.0) {
            return PrefillRate { base: (seconds, tokens), ..self };
        }
        if dt < PREFILL_MIN_TOKENS {
            return self;
        }
        PrefillRate { base: (seconds, tokens), ..self }.observe(ds / dt)
    }

    /// The rate after one more `sample` (seconds per uncached prompt token,
    /// from the counters or from a request's own time to first token): the
    /// least over the last one or two epochs of [`PREFILL_WINDOW`] samples. A
    /// sample out of any server's range changes nothing.
    pub fn observe(self, sample: f64) -> PrefillRate {
        if !PREFILL_SANE.contains(&sample) {
            return self;
        }
        let mut r = self;
        r.current = least(r.current, sample).unwrap_or(0.0);
        r.samples = r.samples.saturating_add(1);
        if r.samples >= PREFILL_WINDOW {
            (r.previous, r.current, r.samples) = (r.current, 0.0, 0);
        }
        r
    }

    /// Seconds per uncached prompt token, once measured: the least of
    /// [`PrefillRate::previous`] and [`PrefillRate::current`].
    pub fn get(&self) -> Option<f64> {
        least(self.previous, self.current)
    }
}

/// The lesser of two samples, of those in any server's range: a hostile
/// record (a peer's, decoded) may hold anything.
fn least(a: f64, b: f64) -> Option<f64> {
    match (PREFILL_SANE.contains(&a), PREFILL_SANE.contains(&b)) {
        (true, true) => Some(a.min(b)),
        (true, false) => Some(a),
        (false, true) => Some(b),
        (false, false) => None,
    }
}

/// Most running LoRA adapters kept per endpoint, and most bytes of their names: every request
/// reads them (the `lora` scorer, the shared records), so a server listing 16,000 adapter names
/// took Envoy from 5 to 22 % CPU at the same load (issue 19, finding 12). A server runs a few
/// adapters at once (vLLM's `max_loras`); past these bounds the rest get no adapter affinity.
pub const MAX_LORAS: usize = 64;
/// See [`MAX_LORAS`].
pub const MAX_LORA_BYTES: usize = 8 * 1024;

/// At most [`MAX_LORAS`] names from `list` (comma-separated), [`MAX_LORA_BYTES`] in all.
pub fn lora_names(list: &str) -> Vec<String> {
    let mut bytes = 0;
    list.split(',')
        .filter(|a| !a.is_empty())
        .take(MAX_LORAS)
        .take_while(|a| {
            bytes += a.len() + 1;
            bytes <= MAX_LORA_BYTES + 1
        })
        .map(str::to_owned)
        .collect()
}

impl EndpointMetrics {
    /// The fraction of prompt tokens the server's prefix cache served since
    /// it started (`None` before it looked any up).
    pub fn prefix_hit_rate(&self) -> Option<f64> {
        (self.prefix_queries > 0.0).then(|| (self.prefix_hits / self.prefix_queries).clamp(0.0, 1.0))
    }

    /// Takes the prefill speed measured up to the `previous` scrape of the same
    /// endpoint forward with this page's counters ([`PrefillRate::next`]).
    pub fn follow(&mut self, previous: Option<&EndpointMetrics>) {
        let rate = previous.map(|p| p.prefill_rate).unwrap_or_default();
        self.prefill_rate = rate.next(self.prefill_seconds, self.prefill_tokens);
    }

    /// Takes the departure rate measured up to the `previous` scrape of the
    /// same endpoint forward with this page's counter, read at `now_ms`,
    /// `full` if the page shows the batch full ([`Departures::next`]).
    pub fn follow_departures(&mut self, previous: Option<&EndpointMetrics>, now_ms: u64, full: bool) {
        let d = previous.map(|p| p.departures).unwrap_or_default();
        // A counter that went back is a restart, perhaps with another sequence limit.
        let restarted = previous.is_some_and(|p| !(self.finished >= p.finished));
        let most = if restarted { self.running } else { d.most_running.max(self.running) };
        self.departures = Departures { most_running: most, ..d.next(self.finished, now_ms, full) };
    }

    /// Is the engine's batch at its limit, by this page and the `previous`
    /// one? Found there when requests waited on both pages and some left,
    /// yet the batch with those that left made up the most it has been seen
    /// to run, and no more: the engine only replaced those that left, as at
    /// its sequence limit (vLLM's `max_num_seqs`). Still there while the batch
    /// stays at that most, its queue empty or not. A CPU vLLM fills its 128
    /// sequences at some 14 % of its KV cache, so its KV usage never says so.
    /// Those that left count because vLLM's page is read after a step's
    /// finished requests leave and before waiting ones replace them: a full
    /// batch of 128 reads 127 most of the time. Two pages within one step (a
    /// CPU vLLM's takes half a second) show nothing leave and keep the
    /// verdict. An engine with room takes in every waiting request at its
    /// next step, so its batch grows (past its most, it is growing), and one
    /// that runs under its most, more than what left, has room.
    pub fn held_at_limit(&self, previous: &EndpointMetrics) -> bool {
        let (most, left) = (previous.departures.most_running, self.finished - previous.finished);
        let at_most = left >= 0.0 && self.running >= 1.0 && self.running <= most && self.running + left >= most;
        let found = previous.waiting >= 1.0 && self.waiting >= 1.0 && left >= 1.0;
        let unchanged = left == 0.0 && self.running >= 1.0 && self.running == previous.running;
        (at_most && found) || ((at_most || unchanged) && previous.departures.full)
    }

    /// Reads a `/metrics` page. Series of the same metric (one per model) are
    /// summed (the sum stops at `f64::MAX`, so it stays finite), KV usage takes
    /// the largest; NaN, infinite or negative values are ignored. Returns `None`
    /// when none of the three signals is present, and the number of malformed
    /// lines.
    pub fn from_prometheus(text: &str, server: ModelServer) -> (Option<EndpointMetrics>, usize) {
        let [waiting, running, kv, kv_old] = server.names();
        let mut m = EndpointMetrics::default();
        let (mut seen, mut kv_seen) = (false, false);
        let mut kv_fallback = None;
        let [queries, hits, hit_gauge] = server.prefix_names();
        let mut hit_rate = None;
        let [prefill_time, computed, prompts] = server.prefill_names();
        let (mut computed_seen, mut prompt_tokens) = (false, 0.0f64);
        let finished = server.finished_name();
        let bad = prom::parse(text, |s| {
            let ok = s.value.is_finite() && s.value >= 0.0;
            // Two finite values can sum to infinity, which the router's
            // min-max normalisation turns into NaN scores.
            if s.name == waiting && ok {
                m.waiting = (m.waiting + s.value).min(f64::MAX);
                seen = true;
            } else if s.name == running && ok {
                m.running = (m.running + s.value).min(f64::MAX);
                seen = true;
            } else if s.name == kv && ok {
                m.kv_usage = m.kv_usage.max(s.value.min(1.0));
                kv_seen = true;
            } else if !kv_old.is_empty() && s.name == kv_old && ok {
                kv_fallback = Some(kv_fallback.unwrap_or(0.0f64).max(s.value.min(1.0)));
            } else if !queries.is_empty() && s.name == queries && ok {
                m.prefix_queries = (m.prefix_queries + s.value).min(f64::MAX);
            } else if !hits.is_empty() && s.name == hits && ok {
                m.prefix_hits = (m.prefix_hits + s.value).min(f64::MAX);
            } else if !hit_gauge.is_empty() && s.name == hit_gauge && ok {
                hit_rate = Some(s.value.min(1.0));
            } else if !prefill_time.is_empty() && s.name == prefill_time && ok {
                m.prefill_seconds = (m.prefill_seconds + s.value).min(f64::MAX);
            } else if !computed.is_empty() && s.name == computed && ok {
                m.prefill_tokens = (m.prefill_tokens + s.value).min(f64::MAX);
                computed_seen = true;
            } else if !prompts.is_empty() && s.name == prompts && ok {
                prompt_tokens = (prompt_tokens + s.value).min(f64::MAX);
            } else if !finished.is_empty() && s.name == finished && ok {
                m.finished = (m.finished + s.value).min(f64::MAX);
            } else if s.name == "vllm:lora_requests_info" {
                if let Some(list) = s.label("running_lora_adapters") {
                    m.loras = lora_names(&list);
                }
            }
        });
        // SGLang versions without `cached_tokens_total` give the rate only.
        if let Some(r) = hit_rate.filter(|_| m.prefix_hits == 0.0) {
            m.prefix_hits = r * m.prefix_queries;
        }
        if !computed_seen {
            m.prefill_tokens = (prompt_tokens - m.prefix_hits).max(0.0);
        }
        if !kv_seen {
            if let Some(k) = kv_fallback {
                m.kv_usage = k;
                kv_seen = true;
            }
        }
        ((seen || kv_seen).then_some(m), bad)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    #[test]
    fn reads_the_prefix_cache_counters() {
        let read = |text: &str, server| EndpointMetrics::from_prometheus(text, server).0.unwrap();
        let vllm = "vllm:num_requests_running 1\nvllm:prefix_cache_queries_total{model_name=\"a\"} 800\n\
vllm:prefix_cache_queries_total{model_name=\"b\"} 200\nvllm:prefix_cache_hits_total 250\n";
        let m = read(vllm, ModelServer::Vllm);
        assert_eq!((m.prefix_queries, m.prefix_hits, m.prefix_hit_rate()), (1000.0, 250.0, Some(0.25)));
        assert_eq!(read("vllm:num_requests_running 1\n", ModelServer::Vllm).prefix_hit_rate(), None, "none yet");
        let sg = "sglang:num_queue_reqs 0\nsglang:prompt_tokens_total 400\nsglang:cached_tokens_total 100\n";
        assert_eq!(read(sg, ModelServer::Sglang).prefix_hit_rate(), Some(0.25));
        let old_sg = "sglang:num_queue_reqs 0\nsglang:prompt_tokens_total 400\nsglang:cache_hit_rate 0.5\n";
        assert_eq!(read(old_sg, ModelServer::Sglang).prefix_hit_rate(), Some(0.5), "the older gauge");
    }

    /// vLLM's page after a server prefilled `tokens` uncached tokens in `seconds`.
    fn prefill_page(seconds: f64, tokens: f64) -> String {
        format!(
            "vllm:num_requests_running 1\nvllm:request_prefill_time_seconds_sum{{engine=\"0\"}} {seconds}\n\
vllm:request_prefill_time_seconds_count 7\nvllm:request_prefill_kv_computed_tokens_sum {tokens}\n"
        )
    }

    /// The rate after each page in turn, from none.
    fn rates(pages: &[String]) -> Vec<Option<f64>> {
        let mut last: Option<EndpointMetrics> = None;
        pages
            .iter()
            .map(|p| {
                let mut m = EndpointMetrics::from_prometheus(p, ModelServer::Vllm).0.unwrap();
                m.follow(last.as_ref());
                last = Some(m);
                last.as_ref().unwrap().prefill_rate.get()
            })
            .collect()
    }

    #[test]
    fn departures_are_the_finished_counters_growth_over_a_second_or_more() {
        // vLLM splits the counter by finished_reason: the series are summed.
        let page = |n: f64| {
            format!(
                "vllm:num_requests_running 1\nvllm:request_success_total{{finished_reason=\"stop\"}} {n}\n\
vllm:request_success_total{{finished_reason=\"length\"}} 10\n"
            )
        };
        let mut last: Option<EndpointMetrics> = None;
        let mut at = |n: f64, ms: u64| {
            let mut m = EndpointMetrics::from_prometheus(&page(n), ModelServer::Vllm).0.unwrap();
            m.follow_departures(last.as_ref(), ms, true);
            last = Some(m);
            last.as_ref().unwrap().departures.get()
        };
        assert_eq!(at(0.0, 1_000), None, "the first page starts a window");
        assert_eq!(at(5.0, 1_500), None, "half a second is no window");
        assert_eq!(at(12.0, 2_000), Some(12.0), "12 in a second");
        assert_eq!(at(12.0, 2_400), Some(12.0), "kept until the next window");
        assert_eq!(at(30.0, 4_000), Some(9.0), "18 in two seconds");
        assert_eq!(at(3.0, 4_050), None, "a restart forgets the rate");
        assert_eq!(at(13.0, 5_050), Some(10.0));
        let sg = EndpointMetrics::from_prometheus("sglang:num_queue_reqs 0\n", ModelServer::Sglang).0.unwrap();
        assert_eq!(sg.finished, 0.0);
        // A hostile base (a time in the future) starts again rather than dividing by it.
        let odd = Departures { base: (0.0, 9_000), per_s: 4.0, ..Default::default() };
        assert_eq!(odd.next(50.0, 5_000, true).get(), None);
    }

    #[test]
    fn the_departure_rate_counts_only_while_the_batch_was_lately_full() {
        // 20 a second over each window; the batch full only on the page at 2 s.
        let d = |per_s: f64, full_at: u64| Departures {
            base: (0.0, 1_000),
            per_s,
            full_at,
            full: true,
            ..Default::default()
        };
        let full = Departures::default().next(0.0, 1_000, false).next(20.0, 2_000, true);
        assert_eq!(full.get(), Some(20.0), "a page that shows the batch full");
        assert_eq!(full.next(30.0, 2_500, false).get(), Some(20.0), "half a second after it");
        assert_eq!(full.next(40.0, 3_000, false).get(), Some(20.0), "a second after it");
        assert_eq!(full.next(42.0, 3_001, false).get(), None, "longer ago: the rate is the arrivals'");
        let never = Departures::default().next(0.0, 1_000, false).next(20.0, 2_000, false);
        assert_eq!((never.per_s, never.get()), (20.0, None), "measured, but not of a full batch");
        // A time after the page (a hostile record) is forgotten rather than believed.
        assert_eq!(d(20.0, 9_000).next(20.0, 1_500, false).get(), None);
        assert_eq!(d(20.0, 9_000).next(20.0, 1_500, false).full_at, 0);
    }

    #[test]
    fn a_batch_held_at_its_most_while_requests_wait_is_full() {
        // Pages a quarter second apart: (waiting, running, finished).
        let (mut last, mut ms): (Option<EndpointMetrics>, u64) = (None, 1_000);
        let mut at = |waiting: f64, running: f64, finished: f64| {
            let mut m = EndpointMetrics { waiting, running, finished, ..Default::default() };
            let held = last.as_ref().is_some_and(|p| m.held_at_limit(p));
            ms += 250;
            m.follow_departures(last.as_ref(), ms, held);
            last = Some(m);
            held
        };
        assert!(!at(2.0, 100.0, 0.0), "one page says nothing");
        assert!(!at(3.0, 120.0, 1.0), "the batch grew: it had room");
        assert!(!at(3.0, 128.0, 2.0), "and grew again");
        assert!(!at(3.0, 128.0, 2.0), "nothing left: no sign yet");
        assert!(at(2.0, 128.0, 3.0), "held at its most while requests waited and left");
        assert!(at(2.0, 127.0, 4.0), "one left since the page and is not yet replaced");
        assert!(at(2.0, 127.0, 4.0), "nothing changed (one step): the verdict stands");
        assert!(at(0.0, 128.0, 5.0), "at its most with its queue empty: still at its limit");
        assert!(at(1.0, 126.0, 7.0), "two left, not yet replaced");
        assert!(!at(1.0, 125.0, 9.0), "under its most by more than left: room");
        for f in 10..=15 {
            assert!(!at(1.0, 100.0, f64::from(f)), "well under its most");
        }
        assert!(!at(1.0, 100.0, 15.0), "nothing changed, but no verdict for a second and more");
        assert!(!at(1.0, 128.0, 15.0), "at its most, but nothing left: no sign");
        assert!(at(2.0, 128.0, 16.0), "found again");
        assert!(!at(0.0, 0.0, 16.0), "the batch emptied");
        assert!(!at(0.0, 0.0, 16.0), "an idle engine is at no limit, however unchanged");
        assert!(!at(1.0, 60.0, 0.5), "a restart (the counter went back)");
        assert!(at(1.0, 60.0, 1.5), "forgets the most it ran, and finds the new limit");
    }

    #[test]
    fn the_prefill_rate_is_the_least_window_of_the_counters_growth() {
        let m = EndpointMetrics::from_prometheus(&prefill_page(2.5, 10_000.0), ModelServer::Vllm).0.unwrap();
        assert_eq!((m.prefill_seconds, m.prefill_tokens), (2.5, 10_000.0));
        let pages: Vec<String> = [(1.0, 10_000.0), (3.0, 20_000.0), (3.01, 20_100.0), (3.51, 30_100.0)]
            .iter()
            .map(|&(s, t)| prefill_page(s, t))
            .collect();
        let got = rates(&pages);
        assert_eq!(got[0], Some(1e-4), "since the server started");
        assert_eq!(got[1], Some(1e-4), "a slow window (a busy batch) changes nothing");
        assert_eq!(got[2], got[1], "100 tokens are no sample yet");
        // The window kept growing from the second page: 0.51 s over 10,100 tokens, fast.
        assert!((got[3].unwrap() - 0.51 / 10_100.0).abs() < 1e-15, "{got:?}: a faster window is the rate at once");
    }

    /// Issue 23: identical GPUs under different loads read one speed, and a
    /// slowdown that lasts comes through within two epochs.
    #[test]
    fn the_least_sample_reads_the_hardware_not_the_load_and_ages_out() {
        let after = |samples: &[f64]| samples.iter().fold(PrefillRate::default(), |r, &s| r.observe(s));
        // Each sample is the speed (3e-5 s a token) times the prefills that ran with it.
        let busy: Vec<f64> = (0..20).map(|i| 3e-5 * [1.0, 3.0, 2.0, 4.0][i % 4]).collect();
        let idle: Vec<f64> = (0..20).map(|i| 3e-5 * [1.0, 1.0, 1.5, 1.0][i % 4]).collect();
        assert_eq!((after(&busy).get(), after(&idle).get()), (Some(3e-5), Some(3e-5)));
        // Throttled to a third: every later sample is slower. The old least lasts the
        // epoch under way and the next, then goes.
        let mut r = after(&busy);
        let mut took = 0;
        while r.get() == Some(3e-5) {
            r = r.observe(9e-5);
            took += 1;
        }
        assert!(took > PREFILL_WINDOW as usize && took <= 2 * PREFILL_WINDOW as usize, "{took}");
        assert_eq!(r.get(), Some(9e-5));
        // Out of any server's range: nothing changes; a hostile record's least is replaced.
        assert_eq!(r.observe(f64::NAN), r);
        assert_eq!(r.observe(5.0), r);
        let hostile = PrefillRate { previous: f64::INFINITY, current: -1.0, ..PrefillRate::default() };
        assert_eq!(hostile.observe(1e-4).get(), Some(1e-4));
    }

    #[test]
    fn a_reset_or_a_hostile_counter_changes_no_rate() {
        let page = |s: &str, t: &str| {
            format!("vllm:num_requests_running 1\nvllm:request_prefill_time_seconds_sum {s}\nvllm:request_prefill_kv_computed_tokens_sum {t}\n")
        };
        let got = rates(&[
            page("1", "10000"),
            page("0.5", "1000"),  // restarted: a new window, the rate kept
            page("1.5", "11000"), // 1e-4 again from the restart's counters
            page("NaN", "-5"),    // ignored at parse: counters read 0, a reset
            page("1e9", "20000"), // 5e4 s per token: no server's
            page("+Inf", "1e308"),
        ]);
        assert_eq!(got, [Some(1e-4); 6]);
        assert_eq!(rates(&[page("0", "0"), page("1", "0")]), [None, None], "no uncached token: no rate");
        assert_eq!(rates(&["vllm:num_requests_running 1\n".to_string()]), [None], "no prefill counters: unknown");
    }

    #[test]
    fn without_the_computed_tokens_the_uncached_prompt_tokens_count() {
        let page = "vllm:num_requests_running 1\nvllm:request_prefill_time_seconds_sum 3\n\
vllm:prompt_tokens_total 40000\nvllm:prefix_cache_queries_total 40000\nvllm:prefix_cache_hits_total 10000\n";
        let mut m = EndpointMetrics::from_prometheus(page, ModelServer::Vllm).0.unwrap();
        assert_eq!(m.prefill_tokens, 30_000.0);
        m.follow(None);
        assert_eq!(m.prefill_rate.get(), Some(1e-4));
        let sg = "sglang:num_queue_reqs 0\nsglang:prompt_tokens_total 400\nvllm:request_prefill_time_seconds_sum 3\n";
        let m = EndpointMetrics::from_prometheus(sg, ModelServer::Sglang).0.unwrap();
        assert_eq!((m.prefill_seconds, m.prefill_tokens), (0.0, 0.0), "SGLang exports no prefill time");
    }

    #[test]
    fn reads_each_model_server_flavour() {
        let vllm = "vllm:num_requests_waiting{model_name=\"a\"} 2\nvllm:num_requests_waiting{model_name=\"b\"} 1\n\
vllm:num_requests_running 4\nvllm:kv_cache_usage_perc 0.5\n\
vllm:lora_requests_info{running_lora_adapters=\"sql,chat\",max_lora=\"4\",waiting_lora_adapters=\"\"} 1\n";
        let (got, bad) = EndpointMetrics::from_prometheus(vllm, ModelServer::Vllm);
        let got = got.unwrap();
        assert_eq!((got.waiting, got.running, got.kv_usage, bad), (3.0, 4.0, 0.5, 0));
        assert_eq!(got.loras, vec!["sql", "chat"]);
        let old = "vllm:num_requests_waiting 0\nvllm:gpu_cache_usage_perc 0.7\n";
        assert_eq!(EndpointMetrics::from_prometheus(old, ModelServer::Vllm).0.unwrap().kv_usage, 0.7);
        let sg = "sglang:num_queue_reqs 6\nsglang:num_running_reqs 2\nsglang:token_usage 0.9\n";
        assert_eq!(
            EndpointMetrics::from_prometheus(sg, ModelServer::Sglang).0.unwrap(),
            EndpointMetrics { waiting: 6.0, running: 2.0, kv_usage: 0.9, ..Default::default() }
        );
        let trt = "trtllm_num_requests_waiting 1\ntrtllm_kv_cache_utilization 0.1\n";
        assert_eq!(EndpointMetrics::from_prometheus(trt, ModelServer::Trtllm).0.unwrap().kv_usage, 0.1);
        assert_eq!(EndpointMetrics::from_prometheus("other 1\n", ModelServer::Vllm).0, None);
        let weird = "vllm:num_requests_waiting NaN\nvllm:num_requests_running -1\nvllm:kv_cache_usage_perc +Inf\n";
        assert_eq!(EndpointMetrics::from_prometheus(weird, ModelServer::Vllm).0, None, "nonsense values are ignored");
    }

    /// Issue 19, finding 12: a server listing 16,000 adapters cost every request.
    #[test]
    fn a_long_adapter_list_is_cut_to_the_bounds() {
        let names: Vec<String> = (0..16_000).map(|i| format!("adapter-{i}")).collect();
        let page = format!(
            "vllm:num_requests_running 1\nvllm:lora_requests_info{{running_lora_adapters=\"{}\"}} 1\n",
            names.join(",")
        );
        let got = EndpointMetrics::from_prometheus(&page, ModelServer::Vllm).0.unwrap();
        assert_eq!(got.loras, names[..MAX_LORAS]);
        let long: Vec<String> = (0..64).map(|i| format!("{i:03}{}", "x".repeat(997))).collect();
        let got = lora_names(&long.join(","));
        assert_eq!(got, long[..8], "8 names of 1,000 bytes fill the 8 KiB");
    }
}
