//! The discrete-event engine: a virtual clock, simulated clients, an Envoy model (streams
//! assigned to workers round-robin, filter callbacks in Envoy's order, deferred actions,
//! ORIGINAL_DST routing by `x-gateway-destination-endpoint`), and upstream endpoints.
//!
//! There are no sleeps and no wall-clock reads: a run is a pure function of its inputs, and
//! events at the same virtual time run in the order they were scheduled.

use crate::sim::faults::{self, FaultCounts, FaultRng, Faults};
use crate::sim::upstream::{Upstream, UpstreamEvent, UpstreamRequest};
use proxy_wasm_host::abi::{self, action, HeaderMap, LogLevel};
use proxy_wasm_host::host::{FailurePolicy, Host, PluginSpec, Trap, VM_FAILED};
use proxy_wasm_host::state::{CallResponse, Cluster, HttpCallOut, QueuePost, StreamAction, StreamData};
use std::cmp::Reverse;
use std::collections::{BTreeMap, BinaryHeap, VecDeque};

/// Gateway settings outside the plugin.
#[derive(Clone, Debug)]
pub struct GatewayConfig {
    /// Request header the filter sets to choose the endpoint (ORIGINAL_DST `http_header_name`).
    pub route_header: String,
    /// Bytes per request body chunk delivered to the filter (Envoy reads in slices).
    pub body_chunk_bytes: usize,
    /// Virtual time between request body chunks, µs.
    pub body_chunk_gap_us: u64,
    /// Round-trip time of a `dispatch_http_call`, µs.
    pub call_latency_us: u64,
    /// Events after this virtual time are not run; streams still open are reported unfinished.
    pub horizon_us: Option<u64>,
    /// Envoy's `allow_on_headers_stop_iteration` for the Wasm filter. With `true` (sluice's
    /// Envoy config) a pause in the headers still delivers body callbacks; with `false`, ABI
    /// 0.2.1 turns the pause into StopAllIterationAndWatermark and the body reaches the filter,
    /// in one callback, only after the stream is continued.
    pub allow_on_headers_stop_iteration: bool,
    /// Each tick fires up to this much late (uniform, seeded): Envoy's timers drift. 0 = exact.
    pub tick_jitter_us: u64,
    /// Delay of an `on_queue_ready` post to its registrant's thread (cross-thread dispatch).
    pub queue_post_delay_us: u64,
    /// Seed of the jitter stream.
    pub seed: u64,
    /// Local-reply headers whose value is recorded as the reject reason (first present wins).
    /// Default: llm-d's [`LLM_D_REASON_HEADER`], then the filter's
    /// `sluice_filter::worker::REJECT_REASON`.
    pub reason_headers: Vec<String>,
    /// Prices of served tokens in the per-client service the engine accounts
    /// ([`Sim::service_buckets`]); default VTC's ([`ServicePrices::VTC`]).
    pub service_prices: ServicePrices,
    /// Envoy's stream idle timeout (the route's `idle_timeout`, else the connection manager's
    /// `stream_idle_timeout`), µs: a stream with no activity (a request chunk from the client,
    /// anything from upstream) for this long ends. Before any response header it gets Envoy's
    /// own 504 "stream timeout" (408 if the client had not finished its request), passed through
    /// the filter's response callbacks; after, the stream is reset. Either way the response
    /// code details read `stream_idle_timeout` and `on_log` runs. The timer runs while the
    /// filter holds the request too. `None`: no timeout (Envoy's default is 5 minutes).
    pub stream_idle_timeout_us: Option<u64>,
    /// Faults to inject (none by default).
    pub faults: Faults,
    /// Request headers whose value, as the filter left them when it sent the request upstream,
    /// is kept in [`RequestRecord::upstream_headers`] (what the model server saw, e.g. a
    /// prediction the filter adds). Empty by default: nothing is copied.
    pub recorded_upstream_headers: Vec<String>,
}

impl Default for GatewayConfig {
    fn default() -> Self {
        GatewayConfig {
            route_header: "x-gateway-destination-endpoint".into(),
            body_chunk_bytes: 16384,
            body_chunk_gap_us: 0,
            call_latency_us: 500,
            horizon_us: None,
            allow_on_headers_stop_iteration: true,
            tick_jitter_us: 0,
            queue_post_delay_us: 0,
            seed: 0,
            reason_headers: vec![LLM_D_REASON_HEADER.into(), sluice_filter::worker::REJECT_REASON.into()],
            service_prices: ServicePrices::VTC,
            stream_idle_timeout_us: None,
            faults: Faults::default(),
            recorded_upstream_headers: Vec::new(),
        }
    }
}

/// One client request to replay.
#[derive(Clone, Debug, serde::Serialize)]
pub struct ClientRequest {
    /// Identifier (reported back in the record).
    pub id: u64,
    /// Client / tenant name (reporting only; the header that carries it is in `headers`).
    pub client: String,
    /// Arrival time, µs.
    pub arrival_us: u64,
    /// Request headers, pseudo-headers included.
    #[serde(skip)]
    pub headers: HeaderMap,
    /// Request body.
    #[serde(skip)]
    pub body: Vec<u8>,
    /// Request trailers, if any.
    #[serde(skip)]
    pub trailers: Option<HeaderMap>,
    /// Prompt tokens (reporting; the backend derives its own from the body).
    pub prompt_tokens: u32,
    /// Output tokens asked for.
    pub output_tokens: u32,
    /// The client gives up (resets the stream) this long after arrival if not complete, µs.
    pub cancel_after_us: Option<u64>,
    /// Prompt prefix-block hashes (for the prefix cache).
    #[serde(skip)]
    pub prefix_hashes: Vec<u64>,
}

impl ClientRequest {
    /// A streaming OpenAI chat request of `prompt_tokens` tokens (4 bytes each) asking for
    /// exactly `output_tokens` tokens, with usage in the last chunk.
    pub fn chat(
        id: u64,
        arrival_us: u64,
        tenant_header: &str,
        client: &str,
        model: &str,
        prompt_tokens: u32,
        output_tokens: u32,
    ) -> ClientRequest {
        let content = "tok ".repeat(prompt_tokens.max(1) as usize);
        let body = serde_json::json!({
            "model": model,
            "messages": [{"role": "user", "content": content}],
            "max_tokens": output_tokens,
            "stream": true,
            "stream_options": {"include_usage": true},
        });
        let body = serde_json::to_vec(&body).expect("json");
        let headers = vec![
            (":method".to_string(), b"POST".to_vec()),
            (":path".to_string(), b"/v1/chat/completions".to_vec()),
            (":authority".to_string(), b"gateway".to_vec()),
            (":scheme".to_string(), b"http".to_vec()),
            ("content-type".to_string(), b"application/json".to_vec()),
            ("content-length".to_string(), body.len().to_string().into_bytes()),
            ("x-request-id".to_string(), format!("req-{id}").into_bytes()),
            (tenant_header.to_ascii_lowercase(), client.as_bytes().to_vec()),
        ];
        ClientRequest {
            id,
            client: client.to_string(),
            arrival_us,
            headers,
            body,
            trailers: None,
            prompt_tokens,
            output_tokens,
            cancel_after_us: None,
            prefix_hashes: Vec::new(),
        }
    }

    /// Adds a request header (name lower-cased, as Envoy passes names to filters).
    pub fn add_header(&mut self, name: &str, value: &str) {
        self.headers.push((name.to_ascii_lowercase(), value.as_bytes().to_vec()));
    }
}

/// What happened to one request, as the client saw it.
#[derive(Clone, Debug, serde::Serialize)]
pub struct RequestRecord {
    /// Request id.
    pub id: u64,
    /// Client / tenant.
    pub client: String,
    /// Worker VM that handled it.
    pub worker: usize,
    /// Arrival, µs.
    pub arrival_us: u64,
    /// Prompt tokens.
    pub prompt_tokens: u32,
    /// Output tokens asked for.
    pub output_tokens: u32,
    /// HTTP status the client got (0 = stream reset before any response).
    pub status: u16,
    /// `ok`, `upstream_error`, `local_reply`, `trap`, `no_route`, `client_cancel`,
    /// `upstream_reset`, `idle_timeout`, `filter_reset`, `vm_failed` or `unfinished`.
    pub outcome: &'static str,
    /// Reject reason: a reason header of a local reply (`GatewayConfig::reason_headers`), else
    /// its details, else a host explanation.
    pub reason: Option<String>,
    /// Endpoint the request went to.
    pub endpoint: Option<String>,
    /// When the gateway sent it upstream, µs.
    pub dispatched_us: Option<u64>,
    /// When the client received the first output token, µs.
    pub first_token_us: Option<u64>,
    /// When the client received the last output token, µs.
    pub last_token_us: Option<u64>,
    /// When the response ended, µs.
    pub end_us: Option<u64>,
    /// Output tokens received.
    pub tokens_received: u32,
    /// Response body bytes received.
    pub bytes_received: u64,
    /// Times the backend preempted it.
    pub preemptions: u32,
    /// When the gateway started holding the whole request (the client had sent it all and the
    /// filter paused it), if it did, µs.
    pub queued_us: Option<u64>,
    /// Longest time the stream went without activity (a request chunk, anything from
    /// upstream), up to its end, µs: what Envoy's stream idle timer measures.
    pub max_silence_us: u64,
    /// The headers named in [`GatewayConfig::recorded_upstream_headers`] that the request
    /// carried upstream (name, value), in that order; empty if it never went upstream.
    pub upstream_headers: Vec<(String, String)>,
}

impl RequestRecord {
    /// Time to first token, ms.
    pub fn ttft_ms(&self) -> Option<f64> {
        self.first_token_us.map(|t| (t - self.arrival_us) as f64 / 1000.0)
    }

    /// Value of a header recorded in [`RequestRecord::upstream_headers`].
    pub fn upstream_header(&self, name: &str) -> Option<&str> {
        self.upstream_headers.iter().find(|(k, _)| k.eq_ignore_ascii_case(name)).map(|(_, v)| v.as_str())
    }

    /// Time per output token after the first, ms.
    pub fn tpot_ms(&self) -> Option<f64> {
        match (self.first_token_us, self.last_token_us) {
            (Some(a), Some(b)) if self.tokens_received > 1 => {
                Some((b - a) as f64 / 1000.0 / (self.tokens_received - 1) as f64)
            }
            _ => None,
        }
    }

    /// Arrival to end of response, ms.
    pub fn e2e_ms(&self) -> Option<f64> {
        self.end_us.map(|t| (t - self.arrival_us) as f64 / 1000.0)
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Ev {
    Arrive(usize),
    ReqChunk(usize),
    Tick(usize, usize, u64),
    Queue(usize, QueuePost),
    CallDone(usize, u32),
    Wake(usize),
    Cancel(usize),
    Idle(usize),
    FaultCancel(usize, bool),
    FaultReset(usize, bool),
}

#[derive(Debug, PartialEq, Eq)]
struct Scheduled {
    at: u64,
    seq: u64,
    ev: Ev,
}

impl Ord for Scheduled {
    fn cmp(&self, o: &Self) -> std::cmp::Ordering {
        (self.at, self.seq).cmp(&(o.at, o.seq))
    }
}

impl PartialOrd for Scheduled {
    fn partial_cmp(&self, o: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(o))
    }
}

struct Stream {
    req: ClientRequest,
    /// Gateway (Envoy process) the client sent the request to.
    gw: usize,
    vm: usize,
    ctx: u32,
    chunks: VecDeque<Vec<u8>>,
    req_eos: bool,
    req_paused: bool,
    forwarded: Vec<u8>,
    upstream: Option<usize>,
    got_resp_headers: bool,
    resp_paused: bool,
    resp_headers_sent: bool,
    resp_eos: bool,
    resp_tokens_buffered: u32,
    done: bool,
    rec: RequestRecord,
    /// Body Envoy holds while headers are stopped with StopAllIterationAndWatermark.
    held: Option<Vec<u8>>,
    held_eos: bool,
    /// Request pieces (body chunks, trailers) the client has yet to send.
    pieces_left: usize,
    last_activity: u64,
}

struct UpstreamSlot {
    addr: String,
    up: Box<dyn Upstream>,
    scheduled: Option<u64>,
}

/// The simulated exchange between gateway replicas (the filter's `replicas` key): an http
/// call from any gateway to `cluster` is answered by the gateways in turn (round-robin per
/// caller, the caller included), after `latency_us`, with the target's shared-data value at
/// `sluice.replicas.state` as the `replicas.serve` plugin returns it (404 when absent).
#[derive(Clone, Debug)]
pub struct PeerExchange {
    /// Cluster name the plugins' `replicas.peers_cluster` names.
    pub cluster: String,
    /// Time from the call to its answer, µs; the state is read when the answer is delivered.
    pub latency_us: u64,
    /// Probability that a call gets no answer (it fails at its timeout, or after the latency).
    pub loss: f64,
    /// Seed of the loss draws.
    pub seed: u64,
}

/// An open http call: the call, its answer, or the peer gateway whose state answers it.
type OpenCall = (HttpCallOut, Option<CallResponse>, Option<usize>);

/// One gateway replica: an Envoy process with its workers and shared data.
struct Gateway {
    host: Host,
    /// Per VM: tick period (ms) and generation.
    ticks: Vec<(u32, u64)>,
    workers: usize,
    /// Round-robin position over workers.
    rr: usize,
    /// Round-robin position over peers.
    peer_rr: usize,
    /// False once killed: its streams were reset and it answers nothing.
    up: bool,
}

/// The simulator: gateways (one by default), upstreams, clients, and the event queue.
pub struct Sim {
    gws: Vec<Gateway>,
    peers: Option<PeerExchange>,
    peer_rng: rand_chacha::ChaCha8Rng,
    cfg: GatewayConfig,
    now: u64,
    seq: u64,
    heap: BinaryHeap<Reverse<Scheduled>>,
    streams: Vec<Stream>,
    by_ctx: BTreeMap<(usize, usize, u32), usize>,
    upstreams: Vec<UpstreamSlot>,
    by_addr: BTreeMap<String, usize>,
    /// Open http calls by (gateway, token): the call, its answer, or the peer gateway whose
    /// state answers it on delivery.
    calls: BTreeMap<(usize, u32), OpenCall>,
    open: usize,
    events_run: u64,
    service: BTreeMap<String, Vec<u64>>,
    failure_policy: FailurePolicy,
    rng: rand_chacha::ChaCha8Rng,
    frng: FaultRng,
    counts: FaultCounts,
}

/// llm-d's reject-reason response header, recorded as a reason by default.
pub const LLM_D_REASON_HEADER: &str = "x-llm-d-request-dropped-reason";

/// Prices of served tokens, in the unit of the per-client service the engine accounts:
/// `input · prompt tokens + output · output tokens`, VTC's `w_p · n_p + w_q · n_q`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Deserialize, serde::Serialize)]
#[serde(deny_unknown_fields)]
pub struct ServicePrices {
    /// Price of a prompt token (w_p); a prompt counts as served with its first output token.
    pub input: u64,
    /// Price of an output token (w_q).
    pub output: u64,
}

impl ServicePrices {
    /// The VTC paper's prices: w_p = 1, w_q = 2.
    pub const VTC: ServicePrices = ServicePrices { input: 1, output: 2 };

    /// Service of `prompt` prompt tokens and `output` output tokens.
    pub fn of(self, prompt: u64, output: u64) -> u64 {
        self.input * prompt + self.output * output
    }
}

impl Default for ServicePrices {
    fn default() -> Self {
        ServicePrices::VTC
    }
}

impl Sim {
    /// Loads the plugin (see [`Host::new`]) and prepares an empty simulation.
    pub fn new(wasm: &[u8], plugin: &PluginSpec, cfg: GatewayConfig) -> anyhow::Result<Sim> {
        Sim::with_gateways(wasm, std::slice::from_ref(plugin), cfg, None)
    }

    /// Several gateway replicas (one Envoy process per plugin spec, each with its own workers
    /// and shared data) in front of the same upstreams, on one clock; `peers` simulates their
    /// state exchange. Requests go to gateway 0 unless added with [`Sim::add_request_to`].
    pub fn with_gateways(
        wasm: &[u8],
        plugins: &[PluginSpec],
        cfg: GatewayConfig,
        peers: Option<PeerExchange>,
    ) -> anyhow::Result<Sim> {
        anyhow::ensure!(!plugins.is_empty(), "at least one gateway");
        let mut gws = Vec::with_capacity(plugins.len());
        for plugin in plugins {
            let host = Host::new(wasm, plugin)?;
            let n = host.vm_count();
            gws.push(Gateway {
                host,
                ticks: vec![(0, 0); n],
                workers: plugin.workers.max(1),
                rr: 0,
                peer_rr: 0,
                up: true,
            });
        }
        let plugin = &plugins[0];
        let cfg_seed = cfg.seed;
        let frng = FaultRng::new(cfg.faults.seed);
        let peer_seed = peers.as_ref().map_or(0, |p| p.seed);
        let mut sim = Sim {
            gws,
            peers,
            peer_rng: <rand_chacha::ChaCha8Rng as rand::SeedableRng>::seed_from_u64(peer_seed),
            cfg,
            now: 0,
            seq: 0,
            heap: BinaryHeap::new(),
            streams: Vec::new(),
            by_ctx: BTreeMap::new(),
            upstreams: Vec::new(),
            by_addr: BTreeMap::new(),
            calls: BTreeMap::new(),
            open: 0,
            events_run: 0,
            service: BTreeMap::new(),
            failure_policy: plugin.failure_policy,
            rng: <rand_chacha::ChaCha8Rng as rand::SeedableRng>::seed_from_u64(cfg_seed),
            frng,
            counts: FaultCounts::default(),
        };
        // Start-up calls may have set tick periods, registered queues or enqueued messages.
        for g in 0..sim.gws.len() {
            for vm in 0..sim.gws[g].host.vm_count() {
                sim.after_call(g, vm);
            }
        }
        Ok(sim)
    }

    /// Adds an upstream endpoint reachable as `addr` (`ip:port`).
    pub fn add_upstream(&mut self, addr: &str, up: Box<dyn Upstream>) {
        self.by_addr.insert(addr.to_string(), self.upstreams.len());
        self.upstreams.push(UpstreamSlot { addr: addr.to_string(), up, scheduled: None });
    }

    /// Declares a cluster for `dispatch_http_call`.
    pub fn add_cluster(&mut self, name: &str, cluster: Cluster) {
        for g in &mut self.gws {
            g.host.add_cluster(name, cluster.clone());
        }
    }

    /// Schedules a client request (to gateway 0).
    pub fn add_request(&mut self, req: ClientRequest) {
        self.add_request_to(req, 0);
    }

    /// Schedules a client request to gateway `gw` (taken modulo the number of gateways).
    pub fn add_request_to(&mut self, req: ClientRequest, gw: usize) {
        let gw = gw % self.gws.len();
        let i = self.streams.len();
        let at = req.arrival_us;
        let cancel = req.cancel_after_us.map(|d| at + d);
        let rec = RequestRecord {
            id: req.id,
            client: req.client.clone(),
            worker: 0,
            arrival_us: at,
            prompt_tokens: req.prompt_tokens,
            output_tokens: req.output_tokens,
            status: 0,
            outcome: "unfinished",
            reason: None,
            endpoint: None,
            dispatched_us: None,
            first_token_us: None,
            last_token_us: None,
            end_us: None,
            tokens_received: 0,
            bytes_received: 0,
            preemptions: 0,
            queued_us: None,
            max_silence_us: 0,
            upstream_headers: Vec::new(),
        };
        self.streams.push(Stream {
            req,
            gw,
            vm: 0,
            ctx: 0,
            chunks: VecDeque::new(),
            req_eos: false,
            req_paused: false,
            forwarded: Vec::new(),
            upstream: None,
            got_resp_headers: false,
            resp_paused: false,
            resp_headers_sent: false,
            resp_eos: false,
            resp_tokens_buffered: 0,
            done: false,
            rec,
            held: None,
            held_eos: false,
            pieces_left: 0,
            last_activity: at,
        });
        self.open += 1;
        self.push(at, Ev::Arrive(i));
        if let Some(t) = cancel {
            self.push(t, Ev::Cancel(i));
        }
    }

    /// The (first gateway's) host, for logs, metrics, shared data and traps.
    pub fn host(&self) -> &Host {
        &self.gws[0].host
    }

    /// Mutable host access (properties, clusters) of the first gateway.
    pub fn host_mut(&mut self) -> &mut Host {
        &mut self.gws[0].host
    }

    /// Gateway `g`'s host.
    pub fn gateway_host(&self, g: usize) -> &Host {
        &self.gws[g].host
    }

    /// Number of gateways.
    pub fn gateways(&self) -> usize {
        self.gws.len()
    }

    /// Gateway of request `i` (in the order added).
    pub fn gateway_of(&self, i: usize) -> usize {
        self.streams[i].gw
    }

    /// Kills gateway `g` now (its Envoy process dies): its open streams are reset, its timers
    /// stop, and peers' calls to it fail. Requests still sent to it are reset at arrival.
    pub fn kill_gateway(&mut self, g: usize) {
        self.gws[g].up = false;
        let open: Vec<usize> = self.by_ctx.iter().filter(|((gw, _, _), _)| *gw == g).map(|(_, &i)| i).collect();
        for i in open {
            self.gateway_reset(i);
        }
    }

    fn gateway_reset(&mut self, i: usize) {
        if self.streams[i].done {
            return;
        }
        self.abort_upstream(i);
        let s = &mut self.streams[i];
        s.rec.outcome = "gateway_down";
        s.rec.reason = Some("gateway died".into());
        s.done = true;
        s.rec.end_us = Some(self.now);
        self.open -= 1;
        let (g, vm, ctx) = (s.gw, s.vm, s.ctx);
        self.by_ctx.remove(&(g, vm, ctx));
    }

    /// An upstream by address.
    pub fn upstream(&self, addr: &str) -> Option<&dyn Upstream> {
        self.by_addr.get(addr).map(|&i| self.upstreams[i].up.as_ref())
    }

    /// Records of all requests added so far, in the order they were added.
    pub fn records(&self) -> Vec<RequestRecord> {
        self.streams.iter().map(|s| s.rec.clone()).collect()
    }

    /// Service received per client per 1-second bucket of virtual time (w_p·prompt at the
    /// first token + w_q·output tokens as delivered, at [`GatewayConfig::service_prices`]).
    pub fn service_buckets(&self) -> &BTreeMap<String, Vec<u64>> {
        &self.service
    }

    /// The virtual clock, µs.
    pub fn now_us(&self) -> u64 {
        self.now
    }

    /// Number of events processed so far.
    pub fn events_run(&self) -> u64 {
        self.events_run
    }

    /// Faults injected so far and what they did.
    pub fn fault_counts(&self) -> &FaultCounts {
        &self.counts
    }

    /// Requests not yet ended.
    pub fn open_requests(&self) -> usize {
        self.open
    }

    /// Every upstream: address and endpoint.
    pub fn upstreams(&self) -> impl Iterator<Item = (&str, &dyn Upstream)> {
        self.upstreams.iter().map(|u| (u.addr.as_str(), u.up.as_ref()))
    }

    fn set_now(&mut self, t: u64) {
        for g in &mut self.gws {
            g.host.set_now_us(t);
        }
    }

    fn push(&mut self, at: u64, ev: Ev) {
        self.seq += 1;
        self.heap.push(Reverse(Scheduled { at: at.max(self.now), seq: self.seq, ev }));
    }

    /// Runs until every request has ended (ticks alone do not keep the run going) or the
    /// horizon is reached. Returns the records.
    pub fn run(&mut self) -> Vec<RequestRecord> {
        self.run_until(u64::MAX);
        self.records()
    }

    /// Runs events up to virtual time `t` (inclusive), or until all requests have ended.
    pub fn run_until(&mut self, t: u64) {
        let horizon = self.cfg.horizon_us.unwrap_or(u64::MAX).min(t);
        while self.open > 0 {
            let Some(Reverse(s)) = self.heap.peek() else {
                break;
            };
            if s.at > horizon {
                break;
            }
            let Reverse(s) = self.heap.pop().expect("peeked");
            self.now = s.at;
            self.set_now(self.now);
            self.events_run += 1;
            self.dispatch(s.ev);
        }
        if horizon < u64::MAX && self.now < horizon && self.open > 0 {
            self.now = horizon;
            self.set_now(horizon);
        }
    }

    /// Runs events (ticks included) up to virtual time `t` even when no request is open.
    pub fn run_idle_until(&mut self, t: u64) {
        while let Some(Reverse(s)) = self.heap.peek() {
            if s.at > t {
                break;
            }
            let Reverse(s) = self.heap.pop().expect("peeked");
            self.now = s.at;
            self.set_now(self.now);
            self.events_run += 1;
            self.dispatch(s.ev);
        }
        self.now = self.now.max(t);
        self.set_now(self.now);
    }

    fn dispatch(&mut self, ev: Ev) {
        match ev {
            Ev::Arrive(i) => self.arrive(i),
            Ev::ReqChunk(i) => self.req_chunk(i),
            Ev::Tick(g, vm, gen) => self.tick(g, vm, gen),
            Ev::Queue(g, post) => {
                if !self.gws[g].up {
                    return;
                }
                let vm = post.vm;
                if let Err(t) = self.gws[g].host.on_queue_ready(&post) {
                    self.root_trap(g, t);
                }
                self.after_call(g, vm);
            }
            Ev::CallDone(g, token) => self.call_done(g, token),
            Ev::Wake(u) => self.wake(u),
            Ev::Cancel(i) => self.client_cancel(i, "client gave up"),
            Ev::Idle(i) => self.idle_check(i),
            Ev::FaultCancel(i, queued) => self.fault_cancel(i, queued),
            Ev::FaultReset(i, before_headers) => self.fault_reset(i, before_headers),
        }
    }

    fn client_cancel(&mut self, i: usize, why: &str) {
        if !self.streams[i].done {
            self.abort_upstream(i);
            let s = &mut self.streams[i];
            s.rec.outcome = "client_cancel";
            s.rec.reason.get_or_insert_with(|| why.into());
            self.end_stream(i);
        }
    }

    /// Notes activity on a stream (Envoy resets its stream idle timer).
    fn touch(&mut self, i: usize) {
        let now = self.now;
        let s = &mut self.streams[i];
        s.rec.max_silence_us = s.rec.max_silence_us.max(now.saturating_sub(s.last_activity));
        s.last_activity = now;
    }

    fn idle_check(&mut self, i: usize) {
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
    fn idle_timeout(&mut self, i: usize) {
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
    fn note_queued(&mut self, i: usize) {
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

    fn fault_cancel(&mut self, i: usize, queued: bool) {
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

    fn fault_reset(&mut self, i: usize, before_headers: bool) {
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

    fn root_trap(&mut self, g: usize, t: Trap) {
        // A trap on a stream's behalf (effective context) fails that stream; root callbacks only
        // get recorded (the host already logged the trap with its backtrace).
        if let Some(&i) = self.by_ctx.get(&(g, t.vm, t.context_id)) {
            self.fail(i, t);
        }
    }

    /// Runs a stream callback; on a trap, fails the stream with a 500 and returns `None`.
    fn stream_call(&mut self, i: usize, f: impl FnOnce(&mut Host, usize, u32) -> Result<i32, Trap>) -> Option<i32> {
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

    fn fail(&mut self, i: usize, t: Trap) {
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

    fn arrive(&mut self, i: usize) {
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
    fn release_held(&mut self, i: usize) {
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

    fn req_chunk(&mut self, i: usize) {
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
    fn recover_vm(&mut self, g: usize, vm: usize) -> bool {
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
    fn req_flush(&mut self, i: usize) {
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

    fn schedule_wake(&mut self, u: usize) {
        if let Some(t) = self.upstreams[u].up.next_event_us() {
            let t = t.max(self.now);
            if self.upstreams[u].scheduled.is_none_or(|s| t < s) {
                self.upstreams[u].scheduled = Some(t);
                self.push(t, Ev::Wake(u));
            }
        }
    }

    fn wake(&mut self, u: usize) {
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

    fn upstream_event(&mut self, ev: UpstreamEvent) {
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

    fn resp_headers(&mut self, i: usize, headers: HeaderMap, eos: bool) {
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

    fn resp_body(&mut self, i: usize, data: Vec<u8>, tokens: u32, eos: bool) {
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

    fn resp_trailers(&mut self, i: usize, trailers: HeaderMap) {
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
    fn resp_flush(&mut self, i: usize) {
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
    fn local_reply(&mut self, i: usize, status: u16, outcome: &'static str, reason: Option<String>, body: Vec<u8>) {
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

    fn abort_upstream(&mut self, i: usize) {
        if let Some(u) = self.streams[i].upstream.take() {
            self.upstreams[u].up.abort(self.now, i as u64);
            self.schedule_wake(u);
        }
    }

    fn end_stream(&mut self, i: usize) {
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

    fn apply(&mut self, i: usize, a: StreamAction) {
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
    fn after_call(&mut self, g: usize, vm: usize) {
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

    fn jitter(&mut self) -> u64 {
        use rand::Rng;
        match self.cfg.tick_jitter_us {
            0 => 0,
            j => {
                let d = self.rng.random_range(0..=j);
                self.counts.ticks_jittered += (d > 0) as u64;
                d
            }
        }
    }

    fn tick(&mut self, g: usize, vm: usize, gen: u64) {
        if self.gws[g].ticks[vm].1 != gen || !self.gws[g].up {
            return;
        }
        if let Err(t) = self.gws[g].host.on_tick(vm) {
            self.root_trap(g, t);
        }
        self.after_call(g, vm);
        let (period, cur) = self.gws[g].ticks[vm];
        if cur == gen && period >= 1 {
            let at = self.now + period as u64 * 1000 + self.jitter();
            self.push(at, Ev::Tick(g, vm, gen));
        }
    }

    /// A call to the peers' cluster: answered on delivery by the next gateway in turn, or lost.
    fn peer_call(&mut self, g: usize, call: HttpCallOut) {
        use rand::Rng;
        let Some(p) = &self.peers else { return };
        let (latency, loss) = (p.latency_us, p.loss);
        let n = self.gws.len();
        let target = self.gws[g].peer_rr % n;
        self.gws[g].peer_rr += 1;
        let timeout_us = call.timeout_ms as u64 * 1000;
        let lost = loss > 0.0 && self.peer_rng.random::<f64>() < loss;
        let late = call.timeout_ms > 0 && latency > timeout_us;
        let key = (g, call.token);
        if lost || late || !self.gws[target].up {
            let at = if timeout_us > 0 { timeout_us } else { latency };
            self.calls.insert(key, (call, None, None));
            self.push(self.now + at, Ev::CallDone(g, key.1));
        } else {
            self.calls.insert(key, (call, None, Some(target)));
            self.push(self.now + latency, Ev::CallDone(g, key.1));
        }
    }

    fn start_call(&mut self, g: usize, call: HttpCallOut) {
        use rand::Rng;
        if self.peers.as_ref().is_some_and(|p| p.cluster == call.cluster) {
            self.peer_call(g, call);
            return;
        }
        let latency = self.cfg.call_latency_us;
        let timeout_us = call.timeout_ms as u64 * 1000;
        // Injected failure: (deliver at, response).
        let mut forced: Option<(u64, Option<CallResponse>)> = None;
        let resp = match call.endpoint.as_ref().and_then(|e| self.by_addr.get(e)) {
            Some(&u) => {
                self.counts.scrapes += 1;
                let f = &self.cfg.faults;
                if let Some(until) = self.upstreams[u].up.hung_until(self.now) {
                    // Connected, but nobody reads: the call times out (or, without a timeout,
                    // is answered once the process resumes).
                    self.counts.scrapes_to_hung_backend += 1;
                    if timeout_us > 0 {
                        forced = Some((self.now + timeout_us, None));
                    } else {
                        let (h, b) = self.upstreams[u].up.handle_call(until, &call.headers, &call.body);
                        forced = Some((until + latency, Some((h, b, Vec::new()))));
                    }
                } else if f.scrape_refused_rate + f.scrape_timeout_rate + f.scrape_malformed_rate > 0.0 {
                    let r = self.frng.scrape.random::<f64>();
                    if r < f.scrape_refused_rate {
                        self.counts.scrapes_refused += 1;
                        let body = b"upstream connect error or disconnect/reset before headers. reset reason: connection failure";
                        forced = Some((
                            self.now + latency,
                            Some((vec![(":status".into(), b"503".to_vec())], body.to_vec(), Vec::new())),
                        ));
                    } else if r < f.scrape_refused_rate + f.scrape_timeout_rate {
                        self.counts.scrapes_timed_out += 1;
                        // Without a timeout a lost answer is a reset: a failed call either way.
                        let at = if timeout_us > 0 { timeout_us } else { latency };
                        forced = Some((self.now + at, None));
                    } else if r < f.scrape_refused_rate + f.scrape_timeout_rate + f.scrape_malformed_rate {
                        self.counts.scrapes_malformed += 1;
                        let (h, real) = self.upstreams[u].up.handle_call(self.now, &call.headers, &call.body);
                        let body = faults::garbage_metrics(&mut self.frng.scrape, &real);
                        forced = Some((self.now + latency, Some((h, body, Vec::new()))));
                    }
                }
                if forced.is_some() {
                    None
                } else {
                    let (h, b) = self.upstreams[u].up.handle_call(self.now, &call.headers, &call.body);
                    Some((h, b, Vec::new()))
                }
            }
            // Envoy's async client reports "no healthy upstream" as a 503 response.
            None => Some((vec![(":status".into(), b"503".to_vec())], b"no healthy upstream".to_vec(), Vec::new())),
        };
        let (at, resp) = if let Some(f) = forced {
            f
        } else if call.timeout_ms > 0 && latency > timeout_us {
            (self.now + timeout_us, None)
        } else {
            (self.now + latency, resp)
        };
        let token = call.token;
        self.calls.insert((g, token), (call, resp, None));
        self.push(at, Ev::CallDone(g, token));
    }

    fn call_done(&mut self, g: usize, token: u32) {
        let Some((call, mut resp, peer)) = self.calls.remove(&(g, token)) else {
            return;
        };
        if !self.gws[g].up {
            return;
        }
        if let Some(target) = peer {
            // What the `replicas.serve` plugin answers: the state, or 404 before the first one.
            resp = Some(match self.gws[target].host.shared_data(sluice_filter::replicas::STATE_KEY) {
                Some((v, _)) if !v.is_empty() => (vec![(":status".into(), b"200".to_vec())], v, Vec::new()),
                _ => (vec![(":status".into(), b"404".to_vec())], Vec::new(), Vec::new()),
            });
        }
        let vm = call.vm;
        if let Err(t) = self.gws[g].host.on_http_call_response(&call, resp) {
            self.root_trap(g, t);
        }
        self.after_call(g, vm);
    }
}
