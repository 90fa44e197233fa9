//! The client side of a stream: arrival, the request body through the filter's callbacks,
//! the response back, cancels and injected faults, local replies and the end of a stream.

use super::*;

impl Sim {
    pub(super) fn client_cancel(&mut self, i: usize, why: &str) {
        if !self.streams[i].done {
            self.abort_upstream(i);
            let s = &mut self.streams[i];
            s.rec.outcome = "client_cancel";
            s.rec.reason.get_or_insert_with(|| why.into());
            self.end_stream(i);
        }
    }

    /// Notes activity on a stream (Envoy resets its stream idle timer).
    pub(super) fn touch(&mut self, i: usize) {
        let now = self.now;
        let s = &mut self.streams[i];
        s.rec.max_silence_us = s.rec.max_silence_us.max(now.saturating_sub(s.last_activity));
        s.last_activity = now;
    }

    pub(super) fn idle_check(&mut self, i: usize) {
        let Some(timeout) = self.cfg.stream_idle_timeout_us else {
            return;
        };
        if self.streams[i].done {
            return;
        }
        let due = self.streams[i].last_activity + timeout;
        if self.now < due {
            self.push(due, Ev::Idle(i));
            return;
        }
        self.idle_timeout(i);
    }

    /// Envoy's stream idle timeout fired: a 504 (408 if the client had not sent all of its
    /// request) through the filter's response path before any response header, else a reset.
    pub(super) fn idle_timeout(&mut self, i: usize) {
        self.counts.idle_timeouts += 1;
        if let Some(u) = self.streams[i].upstream {
            if self.upstreams[u].up.hung_until(self.now).is_some() {
                self.counts.idle_timeouts_on_hung_backend += 1;
            }
        }
        self.abort_upstream(i);
        self.touch(i);
        let (g, vm, ctx) = (self.streams[i].gw, self.streams[i].vm, self.streams[i].ctx);
        if let Some(sd) = self.gws[g].host.stream_mut(vm, ctx) {
            sd.properties.insert("response.code_details".into(), b"stream_idle_timeout".to_vec());
        }
        let s = &mut self.streams[i];
        s.rec.outcome = "idle_timeout";
        s.rec.reason = Some("stream idle timeout".into());
        if s.got_resp_headers {
            self.end_stream(i);
            return;
        }
        let status: &[u8] = if s.pieces_left == 0 { b"504" } else { b"408" };
        self.resp_headers(
            i,
            vec![(":status".into(), status.to_vec()), ("content-type".into(), b"text/plain".to_vec())],
            false,
        );
        if !self.streams[i].done {
            self.resp_body(i, b"stream timeout".to_vec(), 0, true);
        }
    }

    /// The gateway now holds the whole request, paused by the filter: a queued request.
    pub(super) fn note_queued(&mut self, i: usize) {
        let s = &self.streams[i];
        if s.done || s.upstream.is_some() || !s.req_paused || s.pieces_left > 0 || s.rec.queued_us.is_some() {
            return;
        }
        self.streams[i].rec.queued_us = Some(self.now);
        let f = &self.cfg.faults;
        if let Some(d) = faults::draw(&mut self.frng.cancel_queued, f.cancel_queued_rate, f.cancel_queued_within_us) {
            self.push(self.now + d, Ev::FaultCancel(i, true));
        }
    }

    pub(super) fn fault_cancel(&mut self, i: usize, queued: bool) {
        let s = &self.streams[i];
        if queued {
            if s.done || s.upstream.is_some() || s.rec.dispatched_us.is_some() {
                self.counts.cancels_queued_missed += 1;
                return;
            }
            self.counts.cancels_queued += 1;
            self.client_cancel(i, "client gave up while queued (injected)");
        } else {
            if s.done {
                self.counts.cancels_streaming_missed += 1;
                return;
            }
            self.counts.cancels_streaming += 1;
            self.client_cancel(i, "client gave up while streaming (injected)");
        }
    }

    pub(super) fn fault_reset(&mut self, i: usize, before_headers: bool) {
        let s = &self.streams[i];
        let Some(u) = s.upstream.filter(|_| !s.done && s.got_resp_headers != before_headers) else {
            self.counts.resets_missed += 1;
            return;
        };
        if self.upstreams[u].up.hung_until(self.now).is_some() {
            // A stopped process resets nothing.
            self.counts.resets_missed += 1;
            return;
        }
        if before_headers {
            self.counts.resets_before_headers += 1;
        } else {
            self.counts.resets_mid_stream += 1;
        }
        self.upstreams[u].up.abort(self.now, i as u64);
        self.schedule_wake(u);
        self.upstream_event(UpstreamEvent::Reset { id: i as u64 });
    }

    pub(super) fn root_trap(&mut self, g: usize, t: Trap) {
        // A trap on a stream's behalf (effective context) fails that stream; root callbacks only
        // get recorded (the host already logged the trap with its backtrace).
        if let Some(&i) = self.by_ctx.get(&(g, t.vm, t.context_id)) {
            self.fail(i, t);
        }
    }

    /// Runs a stream callback; on a trap, fails the stream with a 500 and returns `None`.
    pub(super) fn stream_call(
        &mut self,
        i: usize,
        f: impl FnOnce(&mut Host, usize, u32) -> Result<i32, Trap>,
    ) -> Option<i32> {
        let (g, vm, ctx) = (self.streams[i].gw, self.streams[i].vm, self.streams[i].ctx);
        let r = f(&mut self.gws[g].host, vm, ctx);
        match r {
            // The caller records the returned action, then runs `after_call`: a deferred
            // continue must see the pause it lifts.
            Ok(a) => Some(a),
            Err(t) => {
                self.after_call(g, vm);
                self.fail(i, t);
                None
            }
        }
    }

    pub(super) fn fail(&mut self, i: usize, t: Trap) {
        if self.streams[i].done {
            return;
        }
        if t.message == VM_FAILED {
            // Envoy answers streams of a failed VM itself (fail closed).
            let why = Some("wasm VM failed".to_string());
            self.local_reply(i, 503, "vm_failed", why, b"wasm VM failed".to_vec());
            return;
        }
        let msg = format!("wasm trap in {}", t.callback);
        self.local_reply(
            i,
            500,
            "trap",
            Some(msg),
            b"{\"error\":{\"message\":\"filter failure\",\"type\":\"server_error\",\"code\":500}}".to_vec(),
        );
    }

    pub(super) fn arrive(&mut self, i: usize) {
        let g = self.streams[i].gw;
        if !self.gws[g].up {
            self.gateway_reset(i);
            return;
        }
        let vm = 1 + self.gws[g].rr % self.gws[g].workers;
        self.gws[g].rr += 1;
        if self.gws[g].host.is_failed(vm) && !self.recover_vm(g, vm) {
            self.streams[i].vm = vm;
            self.streams[i].rec.worker = vm;
            let why = Some("wasm VM failed".to_string());
            self.local_reply(i, 503, "vm_failed", why, b"wasm VM failed".to_vec());
            return;
        }
        let req = &self.streams[i].req;
        let data = StreamData { request_headers: req.headers.clone(), ..Default::default() };
        let mut chunks: VecDeque<Vec<u8>> =
            req.body.chunks(self.cfg.body_chunk_bytes.max(1)).map(|c| c.to_vec()).collect();
        let has_trailers = req.trailers.is_some();
        let ctx = match self.gws[g].host.create_http_context(vm, data) {
            Ok(ctx) => ctx,
            Err(t) => {
                let s = &mut self.streams[i];
                s.vm = vm;
                s.done = true;
                s.rec.worker = vm;
                s.rec.status = 500;
                s.rec.outcome = "trap";
                s.rec.reason = Some(format!("wasm trap in {}", t.callback));
                s.rec.end_us = Some(self.now);
                self.open -= 1;
                return;
            }
        };
        {
            let s = &mut self.streams[i];
            s.vm = vm;
            s.ctx = ctx;
            s.rec.worker = vm;
        }
        self.by_ctx.insert((g, vm, ctx), i);
        let eos = chunks.is_empty() && !has_trailers;
        let n = chunks.len();
        self.streams[i].chunks = std::mem::take(&mut chunks);
        self.streams[i].pieces_left = n + has_trailers as usize;
        self.touch(i);
        if let Some(t) = self.cfg.stream_idle_timeout_us {
            self.push(self.now + t, Ev::Idle(i));
        }
        // The body arrives with the headers (same read), so its events are queued before
        // anything the headers callback posts.
        let gap = self.cfg.body_chunk_gap_us;
        for k in 0..(n + has_trailers as usize) {
            self.push(self.now + gap * k as u64, Ev::ReqChunk(i));
        }
        let Some(a) = self.stream_call(i, |h, vm, ctx| h.on_request_headers(vm, ctx, eos)) else {
            return;
        };
        self.streams[i].req_paused = a == action::PAUSE;
        if a == action::PAUSE && !eos && !self.cfg.allow_on_headers_stop_iteration {
            // ABI 0.2.1 without the flag: StopAllIterationAndWatermark, body held by Envoy.
            self.streams[i].held = Some(Vec::new());
        }
        if eos {
            self.streams[i].req_eos = true;
        }
        self.after_call(g, vm);
        self.req_flush(i);
        self.note_queued(i);
    }

    /// Hands the body Envoy held during a StopAll pause to the filter, in one callback.
    pub(super) fn release_held(&mut self, i: usize) {
        let Some(buf) = self.streams[i].held.take() else {
            return;
        };
        let eos = self.streams[i].held_eos;
        if buf.is_empty() && !eos {
            return;
        }
        let (g, vm, ctx) = (self.streams[i].gw, self.streams[i].vm, self.streams[i].ctx);
        if let Some(sd) = self.gws[g].host.stream_mut(vm, ctx) {
            sd.request_body.extend_from_slice(&buf);
        }
        let body_eos = eos && self.streams[i].req.trailers.is_none();
        let Some(a) = self.stream_call(i, |h, vm, ctx| h.on_request_body(vm, ctx, body_eos)) else {
            return;
        };
        self.streams[i].req_paused = a == action::PAUSE;
        self.streams[i].req_eos |= body_eos;
        self.after_call(g, vm);
        self.note_queued(i);
        if eos && !body_eos && !self.streams[i].done {
            // Trailers were held too.
            self.push(self.now, Ev::ReqChunk(i));
        }
    }

    pub(super) fn req_chunk(&mut self, i: usize) {
        if self.streams[i].done {
            return;
        }
        self.streams[i].pieces_left = self.streams[i].pieces_left.saturating_sub(1);
        self.touch(i);
        let (g, vm, ctx) = (self.streams[i].gw, self.streams[i].vm, self.streams[i].ctx);
        let s = &mut self.streams[i];
        if let Some(held) = s.held.as_mut() {
            // A trailers event (no chunk left) ends the held request; trailers follow the body.
            match s.chunks.pop_front() {
                Some(chunk) => {
                    held.extend_from_slice(&chunk);
                    s.held_eos = s.chunks.is_empty() && s.req.trailers.is_none();
                }
                None => s.held_eos = true,
            }
            return;
        }
        let a = if let Some(chunk) = self.streams[i].chunks.pop_front() {
            let eos = self.streams[i].chunks.is_empty() && self.streams[i].req.trailers.is_none();
            if let Some(sd) = self.gws[g].host.stream_mut(vm, ctx) {
                sd.request_body.extend_from_slice(&chunk);
            }
            let Some(a) = self.stream_call(i, |h, vm, ctx| h.on_request_body(vm, ctx, eos)) else {
                return;
            };
            self.streams[i].req_eos |= eos;
            a
        } else {
            let tr = self.streams[i].req.trailers.clone();
            if let Some(sd) = self.gws[g].host.stream_mut(vm, ctx) {
                sd.request_trailers = tr;
            }
            let Some(a) = self.stream_call(i, |h, vm, ctx| h.on_request_trailers(vm, ctx)) else {
                return;
            };
            self.streams[i].req_eos = true;
            a
        };
        // As in Envoy's filter manager, a data callback returning Continue also ends a stop
        // in the headers.
        self.streams[i].req_paused = a == action::PAUSE;
        self.after_call(g, vm);
        self.req_flush(i);
        self.note_queued(i);
    }

    /// Applies the failure policy to a failed VM before it takes a new stream; returns whether
    /// the VM is usable again.
    pub(super) fn recover_vm(&mut self, g: usize, vm: usize) -> bool {
        if self.failure_policy != FailurePolicy::FailReload {
            return false;
        }
        // The old instance's streams cannot continue: their contexts die with it.
        let open: Vec<usize> =
            self.by_ctx.iter().filter(|((gw, v, _), _)| *gw == g && *v == vm).map(|(_, &i)| i).collect();
        for i in open {
            let why = Some("wasm VM reloaded".to_string());
            self.local_reply(i, 503, "vm_failed", why, b"wasm VM reloaded".to_vec());
        }
        match self.gws[g].host.reload_vm(vm) {
            Ok(()) => {
                self.after_call(g, vm);
                true
            }
            Err(e) => {
                let msg = format!("VM reload failed: {e:#}");
                self.gws[g].host.host_log(vm, 0, LogLevel::Critical, msg);
                false
            }
        }
    }

    /// Passes what the filter released upstream; starts the upstream request at end of stream.
    pub(super) fn req_flush(&mut self, i: usize) {
        let s = &self.streams[i];
        if s.done || s.req_paused || s.upstream.is_some() {
            return;
        }
        let (g, vm, ctx) = (s.gw, s.vm, s.ctx);
        let Some(sd) = self.gws[g].host.stream_mut(vm, ctx) else {
            return;
        };
        let body = std::mem::take(&mut sd.request_body);
        self.streams[i].forwarded.extend_from_slice(&body);
        if !self.streams[i].req_eos {
            return;
        }
        let headers = self.gws[g].host.stream_mut(vm, ctx).map(|sd| sd.request_headers.clone()).unwrap_or_default();
        let dest = abi::header_str(&headers, &self.cfg.route_header).map(str::to_string);
        let Some(u) = dest.as_ref().and_then(|d| self.by_addr.get(d)).copied() else {
            let why = match dest {
                None => format!("no {} header: ORIGINAL_DST has no host", self.cfg.route_header),
                Some(d) => format!("endpoint {d} is not a known upstream"),
            };
            self.gws[g].host.host_log(vm, ctx, LogLevel::Warn, format!("request {}: {why}", self.streams[i].req.id));
            self.local_reply(i, 503, "no_route", Some(why), b"no healthy upstream".to_vec());
            return;
        };
        let addr = self.upstreams[u].addr.clone();
        if let Some(sd) = self.gws[g].host.stream_mut(vm, ctx) {
            sd.properties.insert("upstream.address".into(), addr.clone().into_bytes());
        }
        let kept: Vec<(String, String)> = self
            .cfg
            .recorded_upstream_headers
            .iter()
            .filter_map(|n| abi::header(&headers, n).map(|v| (n.clone(), String::from_utf8_lossy(v).into_owned())))
            .collect();
        let s = &mut self.streams[i];
        s.upstream = Some(u);
        s.rec.endpoint = Some(addr);
        s.rec.dispatched_us = Some(self.now);
        s.rec.upstream_headers = kept;
        let req = UpstreamRequest {
            headers,
            body: std::mem::take(&mut s.forwarded),
            prefix_hashes: s.req.prefix_hashes.clone(),
            output_tokens: (s.req.output_tokens > 0).then_some(s.req.output_tokens),
        };
        let f = &self.cfg.faults;
        if let Some(d) =
            faults::draw(&mut self.frng.reset, f.reset_before_headers_rate, f.reset_before_headers_within_us)
        {
            self.push(self.now + d, Ev::FaultReset(i, true));
        }
        let evs = self.upstreams[u].up.submit(self.now, i as u64, req);
        for ev in evs {
            self.upstream_event(ev);
        }
        self.schedule_wake(u);
    }

    pub(super) fn schedule_wake(&mut self, u: usize) {
        if let Some(t) = self.upstreams[u].up.next_event_us() {
            let t = t.max(self.now);
            if self.upstreams[u].scheduled.is_none_or(|s| t < s) {
                self.upstreams[u].scheduled = Some(t);
                self.push(t, Ev::Wake(u));
            }
        }
    }

    pub(super) fn wake(&mut self, u: usize) {
        if self.upstreams[u].scheduled != Some(self.now) {
            return;
        }
        self.upstreams[u].scheduled = None;
        let evs = self.upstreams[u].up.advance(self.now);
        for ev in evs {
            self.upstream_event(ev);
        }
        self.schedule_wake(u);
    }

    pub(super) fn upstream_event(&mut self, ev: UpstreamEvent) {
        match ev {
            UpstreamEvent::Headers { id, headers, eos } => {
                let i = id as usize;
                if self.streams[i].done {
                    return;
                }
                self.touch(i);
                if self.streams[i].got_resp_headers {
                    self.resp_trailers(i, headers);
                } else {
                    self.resp_headers(i, headers, eos);
                }
            }
            UpstreamEvent::Body { id, data, tokens, eos } => {
                let i = id as usize;
                if !self.streams[i].done {
                    self.touch(i);
                    self.resp_body(i, data, tokens, eos);
                }
            }
            UpstreamEvent::Reset { id } => {
                let i = id as usize;
                if self.streams[i].done {
                    return;
                }
                self.touch(i);
                self.streams[i].upstream = None;
                // Envoy's response code details for a reset (filters read them in on_log).
                let details: &[u8] = if self.streams[i].got_resp_headers {
                    b"upstream_reset_after_response_started{remote_reset}"
                } else {
                    b"upstream_reset_before_response_started{remote_reset}"
                };
                let (g, vm, ctx) = (self.streams[i].gw, self.streams[i].vm, self.streams[i].ctx);
                if let Some(sd) = self.gws[g].host.stream_mut(vm, ctx) {
                    sd.properties.insert("response.code_details".into(), details.to_vec());
                }
                if !self.streams[i].got_resp_headers {
                    // Envoy's router answers 503 itself; the reply passes the filter's encode path.
                    let body = b"upstream connect error or disconnect/reset before headers. reset reason: remote reset"
                        .to_vec();
                    self.streams[i].rec.outcome = "upstream_reset";
                    self.resp_headers(
                        i,
                        vec![(":status".into(), b"503".to_vec()), ("content-type".into(), b"text/plain".to_vec())],
                        false,
                    );
                    if !self.streams[i].done {
                        self.resp_body(i, body, 0, true);
                    }
                } else {
                    self.streams[i].rec.outcome = "upstream_reset";
                    self.streams[i].rec.reason = Some("upstream reset after response headers".into());
                    self.end_stream(i);
                }
            }
            UpstreamEvent::Preempted { id } => {
                self.streams[id as usize].rec.preemptions += 1;
            }
        }
    }

    pub(super) fn resp_headers(&mut self, i: usize, headers: HeaderMap, eos: bool) {
        let (g, vm, ctx) = (self.streams[i].gw, self.streams[i].vm, self.streams[i].ctx);
        self.streams[i].got_resp_headers = true;
        if let Some(sd) = self.gws[g].host.stream_mut(vm, ctx) {
            sd.response_headers = Some(headers);
        }
        let Some(a) = self.stream_call(i, |h, vm, ctx| h.on_response_headers(vm, ctx, eos)) else {
            return;
        };
        self.streams[i].resp_eos = eos;
        self.streams[i].resp_paused = a == action::PAUSE;
        self.after_call(g, vm);
        self.resp_flush(i);
    }

    pub(super) fn resp_body(&mut self, i: usize, data: Vec<u8>, tokens: u32, eos: bool) {
        let (g, vm, ctx) = (self.streams[i].gw, self.streams[i].vm, self.streams[i].ctx);
        if let Some(sd) = self.gws[g].host.stream_mut(vm, ctx) {
            sd.response_body.extend_from_slice(&data);
        }
        self.streams[i].resp_tokens_buffered += tokens;
        let Some(a) = self.stream_call(i, |h, vm, ctx| h.on_response_body(vm, ctx, eos)) else {
            return;
        };
        self.streams[i].resp_eos = eos;
        self.streams[i].resp_paused = a == action::PAUSE;
        self.after_call(g, vm);
        self.resp_flush(i);
    }

    pub(super) fn resp_trailers(&mut self, i: usize, trailers: HeaderMap) {
        let (g, vm, ctx) = (self.streams[i].gw, self.streams[i].vm, self.streams[i].ctx);
        if let Some(sd) = self.gws[g].host.stream_mut(vm, ctx) {
            sd.response_trailers = Some(trailers);
        }
        let Some(a) = self.stream_call(i, |h, vm, ctx| h.on_response_trailers(vm, ctx)) else {
            return;
        };
        self.streams[i].resp_eos = true;
        self.streams[i].resp_paused = a == action::PAUSE;
        self.after_call(g, vm);
        self.resp_flush(i);
    }

    /// Delivers to the client what the filter released.
    pub(super) fn resp_flush(&mut self, i: usize) {
        if self.streams[i].done || self.streams[i].resp_paused || !self.streams[i].got_resp_headers {
            return;
        }
        let (g, vm, ctx) = (self.streams[i].gw, self.streams[i].vm, self.streams[i].ctx);
        let Some(sd) = self.gws[g].host.stream_mut(vm, ctx) else {
            return;
        };
        let body = std::mem::take(&mut sd.response_body);
        let status = sd
            .response_headers
            .as_ref()
            .and_then(|h| abi::header_str(h, ":status"))
            .and_then(|v| v.parse::<u16>().ok())
            .unwrap_or(0);
        let now = self.now;
        let prices = self.cfg.service_prices;
        let mut first_token = false;
        let s = &mut self.streams[i];
        if !s.resp_headers_sent {
            s.resp_headers_sent = true;
            s.rec.status = status;
        }
        s.rec.bytes_received += body.len() as u64;
        if s.resp_tokens_buffered > 0 {
            // The prompt counts as served once its prefill produced the first token.
            let prompt = if s.rec.first_token_us.is_none() { s.rec.prompt_tokens as u64 } else { 0 };
            let service = prices.of(prompt, s.resp_tokens_buffered as u64);
            s.rec.tokens_received += s.resp_tokens_buffered;
            s.resp_tokens_buffered = 0;
            first_token = s.rec.first_token_us.is_none();
            s.rec.first_token_us.get_or_insert(now);
            s.rec.last_token_us = Some(now);
            let buckets = self.service.entry(s.rec.client.clone()).or_default();
            let b = (now / 1_000_000) as usize;
            if buckets.len() <= b {
                buckets.resize(b + 1, 0);
            }
            buckets[b] += service;
        }
        if first_token && !s.resp_eos {
            let f = &self.cfg.faults;
            if let Some(d) =
                faults::draw(&mut self.frng.cancel_streaming, f.cancel_streaming_rate, f.cancel_streaming_within_us)
            {
                self.push(now + d, Ev::FaultCancel(i, false));
            }
            let f = &self.cfg.faults;
            if let Some(d) = faults::draw(&mut self.frng.reset, f.reset_mid_stream_rate, f.reset_mid_stream_within_us) {
                self.push(now + d, Ev::FaultReset(i, false));
            }
        }
        let s = &mut self.streams[i];
        if s.resp_eos {
            if s.rec.outcome == "unfinished" {
                s.rec.outcome = if (200..300).contains(&s.rec.status) { "ok" } else { "upstream_error" };
            }
            s.upstream = None;
            self.end_stream(i);
        }
    }

    /// Answers the client directly (filter local reply, trap, no route).
    pub(super) fn local_reply(
        &mut self,
        i: usize,
        status: u16,
        outcome: &'static str,
        reason: Option<String>,
        body: Vec<u8>,
    ) {
        if self.streams[i].done {
            return;
        }
        self.abort_upstream(i);
        let s = &mut self.streams[i];
        s.rec.status = status;
        s.rec.outcome = outcome;
        s.rec.reason = reason;
        s.rec.bytes_received += body.len() as u64;
        self.end_stream(i);
    }

    pub(super) fn abort_upstream(&mut self, i: usize) {
        if let Some(u) = self.streams[i].upstream.take() {
            self.upstreams[u].up.abort(self.now, i as u64);
            self.schedule_wake(u);
        }
    }

    pub(super) fn end_stream(&mut self, i: usize) {
        if self.streams[i].done {
            return;
        }
        self.touch(i);
        let s = &mut self.streams[i];
        s.done = true;
        s.rec.end_us = Some(self.now);
        self.open -= 1;
        let (g, vm, ctx) = (s.gw, s.vm, s.ctx);
        let sent_upstream = s.rec.dispatched_us.is_some();
        // on_done / on_log / on_delete; a trap there cannot change the client's outcome.
        if let Err(t) = self.gws[g].host.finish_stream(vm, ctx) {
            if sent_upstream && t.callback != "proxy_on_delete" {
                self.counts.dispatched_ended_without_log += 1;
            }
        }
        self.by_ctx.remove(&(g, vm, ctx));
        self.after_call(g, vm);
    }

    pub(super) fn apply(&mut self, i: usize, a: StreamAction) {
        if self.streams[i].done {
            if matches!(a, StreamAction::LocalReply { .. }) {
                self.counts.answers_after_end += 1;
            }
            return;
        }
        match a {
            StreamAction::ContinueRequest => {
                self.streams[i].req_paused = false;
                self.release_held(i);
                self.req_flush(i);
            }
            StreamAction::ContinueResponse => {
                self.streams[i].resp_paused = false;
                self.resp_flush(i);
            }
            StreamAction::Reset => {
                self.abort_upstream(i);
                self.streams[i].rec.outcome = "filter_reset";
                self.end_stream(i);
            }
            StreamAction::LocalReply { status, details, headers, body } => {
                let reason = self
                    .cfg
                    .reason_headers
                    .iter()
                    .find_map(|h| abi::header_str(&headers, h))
                    .map(str::to_string)
                    .or_else(|| (!details.is_empty()).then_some(details));
                self.local_reply(i, status, "local_reply", reason, body);
            }
        }
    }

    /// Applies what the last call(s) on `vm` asked for: deferred stream actions, queue posts,
    /// http calls, tick period changes.
    pub(super) fn after_call(&mut self, g: usize, vm: usize) {
        loop {
            let acts = self.gws[g].host.take_actions(vm);
            if acts.is_empty() {
                break;
            }
            for (ctx, a) in acts {
                if let Some(&i) = self.by_ctx.get(&(g, vm, ctx)) {
                    self.apply(i, a);
                }
            }
        }
        for post in self.gws[g].host.take_queue_posts() {
            self.push(self.now + self.cfg.queue_post_delay_us, Ev::Queue(g, post));
        }
        for call in self.gws[g].host.take_http_calls() {
            self.start_call(g, call);
        }
        let p = self.gws[g].host.tick_period_ms(vm);
        if p != self.gws[g].ticks[vm].0 {
            let ticks = &mut self.gws[g].ticks;
            ticks[vm].0 = p;
            ticks[vm].1 += 1;
            if p >= 1 {
                let gen = ticks[vm].1;
                let at = self.now + p as u64 * 1000 + self.jitter();
                self.push(at, Ev::Tick(g, vm, gen));
            }
        }
    }
}
