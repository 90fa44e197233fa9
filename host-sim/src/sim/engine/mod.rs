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

mod calls;
mod client;
mod request;

pub use request::{ClientRequest, RequestRecord};

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
    /// `sluice_filter::interface::REJECT_REASON_HEADER`.
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
            reason_headers: vec![LLM_D_REASON_HEADER.into(), sluice_filter::interface::REJECT_REASON_HEADER.into()],
            service_prices: ServicePrices::VTC,
            stream_idle_timeout_us: None,
            faults: Faults::default(),
            recorded_upstream_headers: Vec::new(),
        }
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
    /// Every metrics scrape a gateway sent to a backend: (virtual time µs, backend, gateway).
    scrapes: Vec<(u64, usize, usize)>,
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
            scrapes: Vec::new(),
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

    /// Every metrics scrape sent so far, in order: (virtual time µs, backend index, gateway).
    pub fn scrape_log(&self) -> &[(u64, usize, usize)] {
        &self.scrapes
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
    /// horizon is reached; when every request ended, then the VMs' next ticks, so that the
    /// filter's stats count them all ([`Sim::settle_stats`]). Returns the records.
    pub fn run(&mut self) -> Vec<RequestRecord> {
        self.run_until(u64::MAX);
        if self.open == 0 {
            self.settle_stats();
        }
        self.records()
    }

    /// Runs the next event if it is due by virtual time `t`; `false` when none is.
    fn step_until(&mut self, t: u64) -> bool {
        if !matches!(self.heap.peek(), Some(Reverse(s)) if s.at <= t) {
            return false;
        }
        let Reverse(s) = self.heap.pop().expect("peeked");
        self.now = s.at;
        self.set_now(self.now);
        self.events_run += 1;
        self.dispatch(s.ev);
        true
    }

    /// Runs events up to virtual time `t` (inclusive), or until all requests have ended.
    pub fn run_until(&mut self, t: u64) {
        let horizon = self.cfg.horizon_us.unwrap_or(u64::MAX).min(t);
        while self.open > 0 && self.step_until(horizon) {}
        if horizon < u64::MAX && self.now < horizon && self.open > 0 {
            self.now = horizon;
            self.set_now(horizon);
        }
    }

    /// Runs every VM's next tick (and what is due before it), even when no request is open: the
    /// filter flushes its counters and stock gauge on the tick, so stats read after a run are
    /// exact only after this.
    pub fn settle_stats(&mut self) {
        let longest_ms = self.gws.iter().flat_map(|g| g.ticks.iter().map(|t| t.0)).max().unwrap_or(0);
        let wait_us = 2 * u64::from(longest_ms) * 1000 + self.cfg.tick_jitter_us + 1;
        self.run_idle_until(self.now + wait_us);
    }

    /// Runs events (ticks included) up to virtual time `t` even when no request is open.
    pub fn run_idle_until(&mut self, t: u64) {
        while self.step_until(t) {}
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
}
