//! The checks behind the `cargo fuzz` targets in `fuzz/`, kept here so that
//! the fuzz targets and the stable regression test over their corpus
//! (`filter/tests/fuzz_corpus.rs`) run the very same code.
//!
//! Each `check_*` takes arbitrary bytes, feeds them to one parser that reads
//! bytes from outside (a client, a model server, another VM, the operator)
//! and panics if the parser panics or breaks one of the properties asserted
//! here. Not part of the filter's API.
#![cfg(not(target_arch = "wasm32"))]

use crate::config::Config;
use crate::openai::{
    is_scheduled_path, normalize_path, parse_request, set_top_level_int, CompletionRequest, PrefixHashing, TokenCounter,
};
use crate::scheduler::Scheduler;
use crate::wire::{decode_entry, encode_batch, ToScheduler, ToWorker};
use serde_json::Value;
use sluice_policies::bands::Criticality;
use sluice_policies::prom;
use sluice_policies::routing::prefix_hashes;
use sluice_policies::routing::{
    AffinityIndex, EndpointMetrics, EndpointView, LoadGuard, ModelServer, Picker, RouteContext, RouteRequest, Router,
    SaturationThresholds, Scratch, Weights,
};

/// The hashing the default routing configuration does.
const HASHING: PrefixHashing = PrefixHashing { block_bytes: 64, max_blocks: 128 };

/// A check: panics when the bytes break the parser or its properties.
pub type Check = fn(&[u8]);

/// Every fuzz target: its name (the `fuzz/fuzz_targets/<name>.rs` binary and
/// the `fuzz/corpus/<name>/` directory) and its check.
pub const TARGETS: &[(&str, Check)] = &[
    ("openai_request", check_openai_request),
    ("request_path", check_request_path),
    ("token_counter", check_token_counter),
    ("prometheus", check_prometheus),
    ("wire", check_wire),
    ("config", check_config),
];

/// A request body, as `on_http_request_body` parses it, with and without
/// prefix hashing: the answer must not depend on the block size, and what
/// is read must be self-consistent. A body it accepts takes the engine
/// priority rewrite ([`check_priority_edit`]).
pub fn check_openai_request(data: &[u8]) {
    let plain = parse_request(data, PrefixHashing::OFF);
    let hashed = parse_request(data, HASHING);
    match (&plain, &hashed) {
        (Ok(p), Ok(h)) => {
            assert!(!p.model.is_empty(), "a request without a model must be refused");
            assert!(p.prefix.is_empty(), "block size 0 hashes nothing");
            assert_eq!(
                (&p.model, p.stream, p.max_tokens, p.prompt_tokens),
                (&h.model, h.stream, h.max_tokens, h.prompt_tokens)
            );
            assert!(h.prefix.len() <= HASHING.max_blocks);
            // Whole 64-byte blocks of a prompt estimated at 4 bytes per token.
            assert!(
                h.prefix.len() as u64 * 16 <= h.prompt_tokens as u64,
                "{} blocks of a {}-token prompt",
                h.prefix.len(),
                h.prompt_tokens
            );
            assert_eq!(parse_request(data, HASHING).as_ref(), Ok(h), "hashing is deterministic");
            check_against_tree(data, PrefixHashing::OFF);
            check_against_tree(data, HASHING);
            check_priority_edit(data);
        }
        (Err(p), Err(h)) => {
            assert_eq!(p, h);
            check_against_tree(data, HASHING);
        }
        _ => panic!("the block size changed the verdict: {plain:?} vs {hashed:?}"),
    }
}

/// The request parser [`parse_request`] replaced: the body read with serde's
/// derive into a struct of `serde_json::Value` trees (one per field read;
/// unknown members skipped unchecked, as the derive skips them), then the
/// fields picked out of it. Kept as the
/// oracle the streaming parser is held to ([`check_against_tree`]) and as
/// the "before" that `sluice-bench-path prompt` times beside it.
pub fn parse_request_via_tree(body: &[u8], hashing: PrefixHashing) -> Result<CompletionRequest, String> {
    #[derive(serde::Deserialize)]
    struct Body {
        model: Option<Value>,
        #[serde(default)]
        stream: Option<bool>,
        #[serde(default)]
        max_tokens: Option<u64>,
        #[serde(default)]
        max_completion_tokens: Option<u64>,
        #[serde(default)]
        messages: Option<Value>,
        #[serde(default)]
        prompt: Option<Value>,
    }
    /// Text length and token ids (integers), and the text's first `keep` bytes.
    fn collect(v: &Value, keep: usize, (len, ids): (&mut usize, &mut usize), head: &mut Vec<u8>) {
        match v {
            Value::String(s) => {
                *len = len.saturating_add(s.len());
                let room = keep.saturating_sub(head.len());
                head.extend_from_slice(&s.as_bytes()[..s.len().min(room)]);
            }
            Value::Number(n) if n.is_u64() || n.is_i64() => *ids = ids.saturating_add(1),
            Value::Array(items) => items.iter().for_each(|i| collect(i, keep, (&mut *len, &mut *ids), head)),
            Value::Object(map) => ["content", "text"]
                .iter()
                .filter_map(|k| map.get(*k))
                .for_each(|v| collect(v, keep, (&mut *len, &mut *ids), head)),
            _ => {}
        }
    }
    let b: Body = serde_json::from_slice(body).map_err(|e| format!("request body is not valid JSON: {e}"))?;
    if body.trim_ascii_start().first() != Some(&b'{') {
        return Err("request body must be a JSON object".into());
    }
    let model = match b.model {
        Some(Value::String(m)) if !m.is_empty() => m,
        Some(_) => return Err("field `model` must be a non-empty string".into()),
        None => return Err("field `model` is required".into()),
    };
    let (mut len, mut ids, mut head) = (0, 0usize, Vec::new());
    for part in [&b.messages, &b.prompt].into_iter().flatten() {
        collect(part, hashing.max_bytes(), (&mut len, &mut ids), &mut head);
    }
    let mut prefix = Vec::new();
    if hashing.block_bytes > 0 {
        prefix_hashes(&head, hashing.block_bytes, hashing.max_blocks, &mut prefix);
    }
    Ok(CompletionRequest {
        model,
        stream: b.stream.unwrap_or(false),
        max_tokens: b.max_completion_tokens.or(b.max_tokens).unwrap_or(0).min(u32::MAX as u64) as u32,
        prompt_tokens: len.div_ceil(4).saturating_add(ids).min(u32::MAX as usize) as u32,
        prefix,
    })
}

/// [`parse_request`] reads a body as [`parse_request_via_tree`] does: the
/// same fields, or the same error. A body that is not an object is refused
/// by both, as "not valid JSON" exactly when it is not, but the words may
/// differ: the tree reads an array into the request's fields before it looks.
pub fn check_against_tree(data: &[u8], hashing: PrefixHashing) {
    let got = parse_request(data, hashing);
    let want = parse_request_via_tree(data, hashing);
    let text = String::from_utf8_lossy(data);
    match (&got, &want) {
        (Err(g), Err(w)) if !data.trim_ascii_start().starts_with(b"{") => {
            let valid = serde_json::from_slice::<Value>(data).is_ok();
            assert_eq!(valid, !g.contains("not valid JSON"), "{text}: {g} (tree: {w})");
        }
        _ => assert_eq!(got, want, "{text}"),
    }
}

/// The engine priority rewrite of an accepted body: the result is still one
/// JSON object, with `priority` set at the top level and every other member
/// as it was, and reads the same to the filter. An accepted body may hold
/// bytes a strict JSON reader refuses, in a member the filter skips without
/// decoding (invalid UTF-8 in an unknown string field, as serde skips
/// unknown fields); the rewrite leaves them alone, so only a body that
/// reads as a `Value` must give a rewrite that does.
fn check_priority_edit(data: &[u8]) {
    let edit = set_top_level_int(data, "priority", -42).expect("an accepted body is a JSON object");
    let out = edit.apply(data);
    if let Ok(mut before) = serde_json::from_slice::<Value>(data) {
        let mut after: Value = serde_json::from_slice(&out).expect("the rewrite keeps the JSON valid");
        assert_eq!(after.get("priority"), Some(&Value::from(-42)));
        before.as_object_mut().expect("an object").remove("priority");
        after.as_object_mut().expect("an object").remove("priority");
        assert_eq!(before, after, "only the top-level priority changed");
    }
    let again = parse_request(&out, HASHING).expect("the rewritten body still parses");
    assert_eq!(
        parse_request(data, HASHING).map(|r| (r.model, r.max_tokens, r.prompt_tokens)),
        Ok((again.model, again.max_tokens, again.prompt_tokens))
    );
}

/// A request's `:path`, as `on_http_request_headers` matches it: the
/// normal form has no empty, `.` or `..` segment, no `;params`, no `\`, no
/// ASCII upper case and no trailing slash, is at most one byte longer than
/// the input, and decides alone whether the request is scheduled.
pub fn check_request_path(data: &[u8]) {
    let p = normalize_path(data);
    assert_eq!(p.first(), Some(&b'/'), "{p:?}");
    assert!(p.len() <= data.len() + 1, "{data:?} grew to {p:?}");
    if p.len() > 1 {
        for seg in p[1..].split(|&b| b == b'/') {
            assert!(!matches!(seg, b"" | b"." | b".."), "segment {seg:?} left in {p:?}");
            assert!(!seg.iter().any(|&b| b == b';' || b == b'\\' || b.is_ascii_uppercase()), "{p:?}");
        }
    }
    let scheduled = p == b"/v1/chat/completions" || p == b"/v1/completions";
    assert_eq!(is_scheduled_path(data), scheduled, "{data:?} normalised to {p:?}");
}

/// The chunks `body` is fed in: whole when `k` is 0, else pseudo-random
/// sizes in `1..=k` drawn from `k`.
fn chunks(body: &[u8], k: u8) -> Vec<&[u8]> {
    if k == 0 {
        return vec![body];
    }
    let mut seed = 0x9E37_79B9_7F4A_7C15u64 ^ k as u64;
    let mut out = Vec::new();
    let mut rest = body;
    while !rest.is_empty() {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        let n = (1 + (seed % k as u64) as usize).min(rest.len());
        let (head, tail) = rest.split_at(n);
        out.push(head);
        rest = tail;
    }
    out
}

/// A response body through `TokenCounter`. The first byte picks the
/// content type (bits 0-1) and whether empty chunks are fed between the
/// others (bit 2); the second byte picks the chunk sizes ([`chunks`]); the
/// rest is the body. The total never decreases, `feed` and `finish` report
/// exactly its increments, and for bodies well under the counter's buffer
/// the result does not depend on how the body was cut.
pub fn check_token_counter(data: &[u8]) {
    let (mode, k, body) = match data {
        [mode, k, body @ ..] => (*mode, *k, body),
        [mode] => (*mode, 0, &[][..]),
        [] => (0, 0, &[][..]),
    };
    let content_type = match mode & 3 {
        0 => Some("text/event-stream"),
        1 => Some("text/event-stream; charset=utf-8"),
        2 => Some("application/json"),
        _ => None,
    };
    let run = |parts: &[&[u8]], empties: bool| {
        let mut c = TokenCounter::new(content_type);
        let mut total = c.total();
        assert_eq!(total, 0);
        for part in parts {
            let n = c.feed(part);
            assert!(c.total() >= total, "total went down from {total} to {}", c.total());
            assert_eq!(c.total() - total, n, "feed must report exactly the new tokens");
            total = c.total();
            if empties {
                assert_eq!(c.feed(b""), 0, "an empty chunk carries no token");
                assert_eq!(c.total(), total);
            }
        }
        let extra = c.finish();
        assert!(c.total() >= total, "finish lowered the total from {total} to {}", c.total());
        assert_eq!(c.total() - total, extra, "finish must report exactly the new tokens");
        c.total()
    };
    let cut = run(&chunks(body, k), mode & 4 != 0);
    // Well under the counter's 256 KiB line buffer, cutting changes nothing.
    if body.len() <= 64 * 1024 {
        assert_eq!(cut, run(&[body], false), "the count depends on where the body was cut");
    }
}

/// A `/metrics` page, read as the scheduler VM reads it (lossy UTF-8), by
/// the Prometheus reader and for each model server kind; what is read must
/// be usable by the router, which must then still pick an endpoint.
pub fn check_prometheus(data: &[u8]) {
    let text = String::from_utf8_lossy(data);
    let mut samples = 0usize;
    let bad = prom::parse(&text, |s| {
        samples += 1;
        let mut name = s.name.chars();
        let first = name.next().expect("a sample has a name");
        assert!(first.is_ascii_alphabetic() || first == '_' || first == ':', "name {:?}", s.name);
        assert!(name.all(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':'), "name {:?}", s.name);
        let mut n = 0;
        for (k, _) in prom::labels(s.labels) {
            n += 1;
            assert!(s.label(k).is_some(), "label {k:?} of {:?} cannot be looked up", s.labels);
        }
        assert!(n > 0 || s.labels.trim().is_empty(), "labels {:?} were accepted but read as none", s.labels);
    });
    assert!(samples + bad <= text.lines().count(), "{samples} samples and {bad} bad lines");
    let idle = EndpointMetrics::default();
    for server in [ModelServer::Vllm, ModelServer::Sglang, ModelServer::Trtllm] {
        let (m, bad_here) = EndpointMetrics::from_prometheus(&text, server);
        assert_eq!(bad_here, bad, "{server:?}");
        let Some(m) = m else { continue };
        for (what, v) in [("waiting", m.waiting), ("running", m.running)] {
            assert!(v.is_finite() && v >= 0.0, "{server:?}: {what} = {v}");
        }
        assert!((0.0..=1.0).contains(&m.kv_usage), "{server:?}: kv_usage = {}", m.kv_usage);
        assert!(m.loras.iter().all(|l| !l.is_empty() && !l.contains(',')), "{:?}", m.loras);
        route_with(&m, &idle);
    }
}

/// Every picker, with and without the saturation filter and the load
/// guard, picks one of two healthy endpoints, one of them described by `m`,
/// whatever was sent there, and started, since the scrape.
fn route_with(m: &EndpointMetrics, other: &EndpointMetrics) {
    let lora = m.loras.first().map_or("model", String::as_str);
    let request = RouteRequest { prefix: &[1, 2, 3], session: Some(7), model: lora };
    let mut index = AffinityIndex::new(16, 100);
    index.record(1, &request, 0, 0);
    let weights = Weights::with([("running", 1.0), ("session", 1.0), ("lora", 1.0)]).expect("known scorers");
    let view = |m, in_flight, in_flight_at_scrape| EndpointView {
        in_flight,
        in_flight_at_scrape,
        // As many started as were sent (more than waited, at the extremes).
        started_since: in_flight.saturating_sub(in_flight_at_scrape),
        metrics: Some(m),
        age_ms: 10,
        healthy: true,
        full: false,
    };
    let mut scratch = Scratch::default();
    for pool in
        [vec![view(m, 0, 0), view(m, 3, 0)], vec![view(m, 1, u32::MAX), view(other, 0, 0)], vec![view(m, u32::MAX, 0)]]
    {
        for (e, p) in pool.iter().flat_map(|e| [(e, e.predicted()), (e, e.predicted_queue())]) {
            assert!(p.load().is_finite() && p.waiting >= 0.0 && p.running >= 0.0, "{e:?}: {p:?}");
            assert!((0.0..=1.0).contains(&p.kv_usage), "{e:?}: {p:?}");
        }
        for picker in [Picker::MaxScore, Picker::WeightedRandom, Picker::Random, Picker::RoundRobin] {
            for saturation in [None, Some(SaturationThresholds::default())] {
                for guard in [None, Some(LoadGuard::default())] {
                    let router = Router { weights: weights.clone(), picker, saturation, guard };
                    for random in [0.0, 0.5, 0.999] {
                        let cx = RouteContext::new(request, &pool, &index, 50);
                        let got = router.pick(&cx, random, &mut scratch);
                        assert!(got.is_some_and(|i| i < pool.len()), "{router:?} picked {got:?} of {pool:?}");
                    }
                }
            }
        }
    }
}

/// Bytes from a shared queue, as the scheduler (`decode_entry`) and the
/// workers (`ToWorker::decode`) read them. Whatever decodes re-encodes to
/// the same value and the same bytes (every flag is 0 or 1, a charge's
/// unknown events are refused), and a charge's events are its flags.
pub fn check_wire(data: &[u8]) {
    if let Some(m) = ToScheduler::decode(data) {
        let bytes = m.encode();
        assert_eq!(ToScheduler::decode(&bytes).as_ref(), Some(&m), "{data:?}");
        assert_eq!(bytes, data, "{m:?} does not re-encode to the bytes it was read from");
        if let ToScheduler::Charge(c) = &m {
            assert_eq!(data[10] & 1 != 0, c.dispatched.is_some(), "{m:?}");
            assert_eq!(data[10] & 2 != 0, c.done.is_some(), "{m:?}");
        }
        assert_eq!(decode_entry(data), Some(vec![m]), "a single message is an entry too");
    }
    if let Some(msgs) = decode_entry(data) {
        assert_eq!(decode_entry(&encode_batch(&msgs)).as_ref(), Some(&msgs));
        for m in &msgs {
            assert_eq!(ToScheduler::decode(&m.encode()).as_ref(), Some(m));
        }
    }
    if let Some(m) = ToWorker::decode(data) {
        assert_eq!(m.encode(), data, "{m:?}");
        assert_eq!(ToWorker::decode(&m.encode()), Some(m));
    }
}

/// A plugin configuration, as `on_configure` reads it: `Ok` or `Err`, never
/// a panic, and what is accepted is consistent and builds a scheduler.
pub fn check_config(data: &[u8]) {
    let Ok(c) = Config::from_json(data) else { return };
    assert!(!c.endpoints.is_empty());
    assert_eq!(c.routing.model_servers.len(), c.endpoints.len());
    assert!(c.routing.prefix_block_bytes >= 1, "prefix_block_bytes = {}", c.routing.prefix_block_bytes);
    assert!((1..=crate::config::MAX_PREFIX_MAX_BLOCKS).contains(&c.routing.prefix_max_blocks));
    if let Some(g) = c.routing.router.guard {
        assert!(g.max_extra >= 0.0 && g.max_ratio >= 1.0 && g.max_extra.is_finite() && g.max_ratio.is_finite());
    }
    assert!(c.routing.scrape_interval_ms >= 1 && c.routing.scrape_timeout_ms >= 1);
    assert!((1..=10_000).contains(&c.tick_ms));
    assert!(!c.tenant_header.is_empty());
    let shares = Criticality::ALL.map(|b| c.band_min_share.get(b));
    assert!(shares[0] == 0.0 && shares.iter().all(|s| (0.0..1.0).contains(s)) && shares.iter().sum::<f64>() < 1.0);
    if let Some(p) = &c.engine_priority {
        assert!(!p.field.is_empty() && p.field.len() <= 64, "engine_priority.field {:?}", p.field);
    }
    let s = Scheduler::new(&c);
    assert!(s.is_empty());
}
