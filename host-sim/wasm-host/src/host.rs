//! The proxy-wasm host: one compiled module, one wasm instance per simulated Envoy thread (VM 0
//! is the main thread, VMs 1..=workers are the workers), each with its root context, driven
//! call by call by the embedder. Every call returns either the module's answer or a [`Trap`]
//! carrying the wasm backtrace; effects a call requests (stream actions, queue posts, http
//! calls, tick period) are collected and drained by the caller after the call returns, which is
//! what makes them deferred and keeps callbacks from nesting.

use crate::abi::LogLevel;
use crate::state::{
    CallResponse, Cluster, Context, HostProfile, HttpCallOut, LogRecord, Metric, Process, QueuePost, StreamAction,
    StreamData, VmState,
};
use anyhow::{bail, Context as _, Result};
use rand::SeedableRng;
use std::cell::RefCell;
use std::collections::BTreeMap;
use std::rc::Rc;
use wasmtime::{Config, Engine, InstancePre, Linker, Module, Store, TypedFunc, WasmParams, WasmResults};

/// The plugin refused its configuration (`on_configure` returned false), as Envoy would refuse
/// the listener; callers that compare configurations tell it from other start-up failures with
/// `anyhow::Error::downcast_ref`.
#[derive(Clone, Debug)]
pub struct ConfigRejected {
    /// The module's last log messages, newest first (where it says why).
    pub last_logs: Vec<String>,
}

impl std::fmt::Display for ConfigRejected {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "on_configure returned false (the plugin rejected its configuration); last logs: {:?}",
            self.last_logs
        )
    }
}

impl std::error::Error for ConfigRejected {}

/// How the plugin is deployed: Envoy's `PluginConfig` / `VmConfig` plus the thread count.
#[derive(Clone, Debug)]
pub struct PluginSpec {
    /// `name` of the plugin (property `plugin_name`).
    pub name: String,
    /// `root_id` (property `plugin_root_id`).
    pub root_id: String,
    /// `vm_config.vm_id`: the namespace of shared data and shared queues.
    pub vm_id: String,
    /// `vm_config.configuration`, passed to `on_vm_start`.
    pub vm_configuration: Vec<u8>,
    /// `configuration`, passed to `on_configure` (the module's own format).
    pub configuration: Vec<u8>,
    /// Number of worker threads (Envoy `--concurrency`); one more VM runs the main thread.
    pub workers: usize,
    /// Log level reported to the module; lower levels are also not recorded.
    pub log_level: LogLevel,
    /// Seed of the WASI `random_get` stream.
    pub seed: u64,
    /// Fuel given to every call (wasm instructions, roughly); a call that runs out traps, so an
    /// endless loop in a module fails one request instead of hanging the simulation.
    pub fuel_per_call: u64,
    /// What happens to a VM after a trap (Envoy's `failure_policy`).
    pub failure_policy: FailurePolicy,
    /// Probability that a conditional `set_shared_data` whose CAS matches still fails with
    /// CasMismatch, as when another worker thread wins the race (seeded). VM calls never
    /// interleave in the simulation, so without this a module's CAS retry loops never run.
    pub cas_conflict_rate: f64,
    /// Fault injection: probability that a callback into a worker VM (start-up excluded) is
    /// armed to trap; an armed callback traps at its n-th host call (n uniform in 0..8, seeded),
    /// or not at all if it makes fewer. The VM then follows [`PluginSpec::failure_policy`].
    /// VM 0 (the main thread) is spared: streams, whose arrival reloads a failed VM, arrive on
    /// workers.
    pub trap_rate: f64,
}

/// Envoy's Wasm `failure_policy`: what a worker does once its VM has trapped.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Deserialize, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum FailurePolicy {
    /// Envoy's default: the VM stays failed; its streams and new streams on that worker get 503.
    #[default]
    FailClosed,
    /// The next stream on that worker reloads the VM (Envoy >= 1.33); streams of the old VM
    /// get 503, state in shared data survives.
    FailReload,
}

impl Default for PluginSpec {
    fn default() -> Self {
        PluginSpec {
            name: "plugin".into(),
            root_id: "plugin".into(),
            vm_id: "plugin".into(),
            vm_configuration: Vec::new(),
            configuration: Vec::new(),
            workers: 2,
            log_level: LogLevel::Info,
            seed: 0,
            fuel_per_call: 2_000_000_000,
            failure_policy: FailurePolicy::FailClosed,
            cas_conflict_rate: 0.0,
            trap_rate: 0.0,
        }
    }
}

/// A trap (or host error) raised while a module ran a callback.
#[derive(Clone, Debug, serde::Serialize)]
pub struct Trap {
    /// Virtual time in microseconds.
    pub time_us: u64,
    /// VM that trapped.
    pub vm: usize,
    /// Context the callback was called for.
    pub context_id: u32,
    /// Export that was running (`proxy_on_request_headers` ...).
    pub callback: &'static str,
    /// Error text with the wasm backtrace.
    pub message: String,
}

impl std::fmt::Display for Trap {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "trap in {} (vm {}, context {}) at {} us: {}",
            self.callback, self.vm, self.context_id, self.time_us, self.message
        )
    }
}

type I32x5 = (i32, i32, i32, i32, i32);

#[derive(Clone)]
struct Exports {
    on_context_create: Option<TypedFunc<(i32, i32), ()>>,
    on_vm_start: Option<TypedFunc<(i32, i32), i32>>,
    on_configure: Option<TypedFunc<(i32, i32), i32>>,
    on_tick: Option<TypedFunc<i32, ()>>,
    on_queue_ready: Option<TypedFunc<(i32, i32), ()>>,
    on_request_headers: Option<TypedFunc<(i32, i32, i32), i32>>,
    on_request_body: Option<TypedFunc<(i32, i32, i32), i32>>,
    on_request_trailers: Option<TypedFunc<(i32, i32), i32>>,
    on_response_headers: Option<TypedFunc<(i32, i32, i32), i32>>,
    on_response_body: Option<TypedFunc<(i32, i32, i32), i32>>,
    on_response_trailers: Option<TypedFunc<(i32, i32), i32>>,
    on_done: Option<TypedFunc<i32, i32>>,
    on_log: Option<TypedFunc<i32, ()>>,
    on_delete: Option<TypedFunc<i32, ()>>,
    on_http_call_response: Option<TypedFunc<I32x5, ()>>,
}

struct Vm {
    store: Store<VmState>,
    ex: Exports,
}

/// The host: the compiled plugin and its VMs.
pub struct Host {
    proc: Rc<RefCell<Process>>,
    vms: Vec<Vm>,
    fuel: u64,
    traps: Vec<Trap>,
    pre: InstancePre<VmState>,
    spec: PluginSpec,
    failed: Vec<bool>,
    reloads: u64,
    /// Seeded stream of the trap injection.
    trap_rng: rand_chacha::ChaCha8Rng,
    /// Callbacks may be armed to trap (not during a VM's start-up).
    arming: bool,
}

/// Compiles a module once per process: the engine and compiled code are shared by every
/// `Host` built from the same bytes (tests and sweeps create many).
fn compile(wasm: &[u8]) -> Result<Module> {
    static CACHE: std::sync::Mutex<Vec<(Vec<u8>, Module)>> = std::sync::Mutex::new(Vec::new());
    static ENGINE: std::sync::OnceLock<Engine> = std::sync::OnceLock::new();
    let mut cache = CACHE.lock().unwrap_or_else(|e| e.into_inner());
    if let Some((_, m)) = cache.iter().find(|(b, _)| b == wasm) {
        return Ok(m.clone());
    }
    let engine = ENGINE.get_or_init(|| {
        let mut cfg = Config::new();
        cfg.consume_fuel(true);
        cfg.wasm_backtrace_details(wasmtime::WasmBacktraceDetails::Enable);
        Engine::new(&cfg).expect("wasmtime engine")
    });
    let module = Module::new(engine, wasm).map_err(|e| anyhow::anyhow!("compiling the wasm module: {e:?}"))?;
    cache.push((wasm.to_vec(), module.clone()));
    Ok(module)
}

/// Message of the error returned for calls into a VM that trapped earlier.
pub const VM_FAILED: &str = "VM failed earlier; no call made";

/// VM index of the main thread.
pub const MAIN_VM: usize = 0;

impl Host {
    /// Compiles `wasm` (binary or text) once, instantiates `spec.workers + 1` VMs, and runs each
    /// one's start-up: `_initialize`, root context creation, `on_vm_start`, `on_configure`.
    /// Fails if the module is not a proxy-wasm module, if an import is malformed, or if any VM
    /// rejects its configuration, as Envoy would refuse the listener.
    pub fn new(wasm: &[u8], spec: &PluginSpec) -> Result<Host> {
        let module = compile(wasm)?;
        let engine = module.engine().clone();
        let abi = module.exports().find(|e| e.name().starts_with("proxy_abi_version_")).map(|e| e.name().to_string());
        match abi.as_deref() {
            Some("proxy_abi_version_0_2_1") | Some("proxy_abi_version_0_2_0") => {}
            Some(other) => {
                bail!("unsupported proxy-wasm ABI export {other} (this host speaks 0.2.1)")
            }
            None => bail!("not a proxy-wasm module: no proxy_abi_version_* export"),
        }
        let mut linker: Linker<VmState> = Linker::new(&engine);
        crate::hostcalls::add_to_linker(&mut linker)?;
        // Anything else the module imports traps when called (with its name in the message)
        // instead of failing instantiation.
        linker.define_unknown_imports_as_traps(&module)?;
        let pre = linker.instantiate_pre(&module)?;
        let proc = Rc::new(RefCell::new(Process {
            now_us: 0,
            vm_id: spec.vm_id.clone(),
            plugin_name: spec.name.clone(),
            root_id: spec.root_id.clone(),
            log_level: spec.log_level,
            logs: Vec::new(),
            shared: BTreeMap::new(),
            next_cas: 0,
            queues: BTreeMap::new(),
            profile: Default::default(),
            queue_names: BTreeMap::new(),
            next_queue: 0,
            posts: Vec::new(),
            metrics: Vec::new(),
            metric_ids: BTreeMap::new(),
            next_metric: 0,
            clusters: BTreeMap::new(),
            http_calls: Vec::new(),
            next_token: 0,
            properties: BTreeMap::new(),
            rng: rand_chacha::ChaCha8Rng::seed_from_u64(spec.seed),
            alive: Vec::new(),
            cas_conflict_rate: spec.cas_conflict_rate,
            cas_rng: rand_chacha::ChaCha8Rng::seed_from_u64(spec.seed ^ 0x05ee_dca5),
            cas_conflicts_injected: 0,
            traps_injected: 0,
        }));
        let mut host = Host {
            proc,
            vms: Vec::new(),
            fuel: spec.fuel_per_call,
            traps: Vec::new(),
            pre,
            spec: spec.clone(),
            failed: Vec::new(),
            reloads: 0,
            trap_rng: rand_chacha::ChaCha8Rng::seed_from_u64(spec.seed ^ 0x7ea9_0fba),
            arming: true,
        };
        for vm in 0..=spec.workers {
            host.start_vm(vm).with_context(|| format!("starting VM {vm}"))?;
        }
        Ok(host)
    }

    /// Replaces a VM by a fresh instance of the same module (Envoy's `FAIL_RELOAD`): new
    /// memory, new root context, `on_vm_start` and `on_configure` again. Its streams are gone;
    /// shared data and shared queues, which live in the process, survive.
    pub fn reload_vm(&mut self, vm: usize) -> Result<()> {
        self.reloads += 1;
        self.start_vm(vm).with_context(|| format!("reloading VM {vm}"))
    }

    /// Whether a VM has trapped (and not been reloaded since). Envoy makes no further calls
    /// into a failed VM.
    pub fn is_failed(&self, vm: usize) -> bool {
        self.failed[vm]
    }

    /// CAS conflicts injected so far (see [`PluginSpec::cas_conflict_rate`]).
    pub fn cas_conflicts_injected(&self) -> u64 {
        self.proc.borrow().cas_conflicts_injected
    }

    /// VM reloads so far.
    pub fn reloads(&self) -> u64 {
        self.reloads
    }

    /// Host-call traps injected so far (see [`PluginSpec::trap_rate`]).
    pub fn traps_injected(&self) -> u64 {
        self.proc.borrow().traps_injected
    }

    /// Size of a VM's linear memory, bytes (it only grows; a reload starts a fresh one).
    pub fn memory_bytes(&self, vm: usize) -> usize {
        let v = &self.vms[vm];
        v.store.data().memory.map_or(0, |m| m.data_size(&v.store))
    }

    /// Bytes held in shared data: keys plus values.
    pub fn shared_data_bytes(&self) -> usize {
        self.proc.borrow().shared.iter().map(|(k, e)| k.len() + e.value.len()).sum()
    }

    /// Every shared queue: name, registrant VM, and the messages waiting in it.
    pub fn queues(&self) -> Vec<(String, usize, Vec<Vec<u8>>)> {
        let p = self.proc.borrow();
        p.queue_names
            .iter()
            .filter_map(|((_, name), id)| {
                let q = p.queues.get(id)?;
                Some((name.clone(), q.owner_vm, q.items.iter().cloned().collect()))
            })
            .collect()
    }

    fn start_vm(&mut self, vm: usize) -> Result<()> {
        self.arming = false;
        let r = self.start_vm_unarmed(vm);
        self.arming = true;
        r
    }

    fn start_vm_unarmed(&mut self, vm: usize) -> Result<()> {
        let (pre, spec) = (self.pre.clone(), self.spec.clone());
        let state = VmState {
            vm,
            proc: self.proc.clone(),
            memory: None,
            malloc: None,
            root_id: 1,
            next_context: 1,
            effective: 0,
            in_call: false,
            contexts: BTreeMap::new(),
            tick_period_ms: 0,
            actions: Vec::new(),
            call_response: None,
            vm_configuration: spec.vm_configuration.clone(),
            plugin_configuration: spec.configuration.clone(),
            done_called: false,
            trap_in: std::cell::Cell::new(None),
            instance: self.reloads,
        };
        let mut store = Store::new(pre.module().engine(), state);
        store.set_fuel(self.fuel)?;
        let inst = pre.instantiate(&mut store)?;
        let memory = inst.get_memory(&mut store, "memory").context("module exports no memory")?;
        let malloc = inst
            .get_typed_func::<i32, i32>(&mut store, "proxy_on_memory_allocate")
            .or_else(|_| inst.get_typed_func::<i32, i32>(&mut store, "malloc"))
            .map_err(|_| anyhow::anyhow!("module exports neither proxy_on_memory_allocate nor malloc"))?;
        store.data_mut().memory = Some(memory);
        store.data_mut().malloc = Some(malloc);
        macro_rules! f {
            ($name:literal) => {
                inst.get_typed_func(&mut store, $name).ok()
            };
        }
        let ex = Exports {
            on_context_create: f!("proxy_on_context_create"),
            on_vm_start: f!("proxy_on_vm_start"),
            on_configure: f!("proxy_on_configure"),
            on_tick: f!("proxy_on_tick"),
            on_queue_ready: f!("proxy_on_queue_ready"),
            on_request_headers: f!("proxy_on_request_headers"),
            on_request_body: f!("proxy_on_request_body"),
            on_request_trailers: f!("proxy_on_request_trailers"),
            on_response_headers: f!("proxy_on_response_headers"),
            on_response_body: f!("proxy_on_response_body"),
            on_response_trailers: f!("proxy_on_response_trailers"),
            on_done: f!("proxy_on_done"),
            on_log: f!("proxy_on_log"),
            on_delete: f!("proxy_on_delete"),
            on_http_call_response: f!("proxy_on_http_call_response"),
        };
        let init: Option<TypedFunc<(), ()>> =
            inst.get_typed_func(&mut store, "_initialize").or_else(|_| inst.get_typed_func(&mut store, "_start")).ok();
        if vm < self.vms.len() {
            self.vms[vm] = Vm { store, ex };
            self.failed[vm] = false;
        } else {
            self.vms.push(Vm { store, ex });
            self.failed.push(false);
            self.proc.borrow_mut().alive.push(true);
        }
        if let Some(init) = init {
            self.invoke(vm, 0, "_initialize", init, ()).map_err(|t| anyhow::anyhow!("{t}"))?;
        }
        let root = self.vms[vm].store.data().root_id;
        self.vms[vm].store.data_mut().next_context = root + 1;
        self.vms[vm].store.data_mut().contexts.insert(root, Context::Root { properties: BTreeMap::new() });
        let (vm_cfg_len, plugin_cfg_len) = (spec.vm_configuration.len() as i32, spec.configuration.len() as i32);
        let ex = self.vms[vm].ex.clone();
        if let Some(f) = ex.on_context_create {
            self.invoke(vm, root, "proxy_on_context_create", f, (root as i32, 0))
                .map_err(|t| anyhow::anyhow!("{t}"))?;
        }
        if let Some(f) = ex.on_vm_start {
            let ok = self
                .invoke(vm, root, "proxy_on_vm_start", f, (root as i32, vm_cfg_len))
                .map_err(|t| anyhow::anyhow!("{t}"))?;
            if ok == 0 {
                bail!("on_vm_start returned false");
            }
        }
        if let Some(f) = ex.on_configure {
            let ok = self
                .invoke(vm, root, "proxy_on_configure", f, (root as i32, plugin_cfg_len))
                .map_err(|t| anyhow::anyhow!("{t}"))?;
            if ok == 0 {
                let last_logs: Vec<String> = self.logs().iter().rev().take(3).map(|l| l.message.clone()).collect();
                return Err(ConfigRejected { last_logs }.into());
            }
        }
        Ok(())
    }

    /// Runs one export with `ctx` as the effective context, with a fresh fuel budget.
    fn invoke<P: WasmParams, R: WasmResults>(
        &mut self,
        vm: usize,
        ctx: u32,
        name: &'static str,
        f: TypedFunc<P, R>,
        params: P,
    ) -> Result<R, Trap> {
        if self.failed[vm] {
            let time_us = self.proc.borrow().now_us;
            return Err(Trap { time_us, vm, context_id: ctx, callback: name, message: VM_FAILED.into() });
        }
        let v = &mut self.vms[vm];
        assert!(!v.store.data().in_call, "re-entrant VM call into {name}");
        v.store.data_mut().in_call = true;
        v.store.data_mut().effective = ctx;
        if self.arming && vm != MAIN_VM && self.spec.trap_rate > 0.0 {
            use rand::Rng;
            if self.trap_rng.random::<f64>() < self.spec.trap_rate {
                v.store.data().trap_in.set(Some(self.trap_rng.random_range(0..8)));
            }
        }
        let _ = v.store.set_fuel(self.fuel);
        let r = f.call(&mut v.store, params);
        let used = self.fuel.saturating_sub(v.store.get_fuel().unwrap_or(self.fuel));
        self.proc.borrow_mut().profile.fuel += used;
        let d = v.store.data_mut();
        d.trap_in.set(None);
        d.in_call = false;
        d.effective = 0;
        d.call_response = None;
        r.map_err(|e| {
            let time_us = self.proc.borrow().now_us;
            let t = Trap { time_us, vm, context_id: ctx, callback: name, message: format!("{e:?}") };
            self.proc.borrow_mut().log(vm, ctx, LogLevel::Critical, "host", t.to_string());
            self.traps.push(t.clone());
            self.failed[vm] = true;
            t
        })
    }

    /// What the modules asked of the host since the start or the last [`Host::reset_profile`].
    pub fn profile(&self) -> HostProfile {
        self.proc.borrow().profile.clone()
    }

    /// Starts [`Host::profile`] again from zero.
    pub fn reset_profile(&mut self) {
        self.proc.borrow_mut().profile = HostProfile::default();
    }

    /// Sets the virtual clock (microseconds since the start of the run).
    pub fn set_now_us(&mut self, now_us: u64) {
        self.proc.borrow_mut().now_us = now_us;
    }

    /// The virtual clock.
    pub fn now_us(&self) -> u64 {
        self.proc.borrow().now_us
    }

    /// Number of VMs (workers + 1).
    pub fn vm_count(&self) -> usize {
        self.vms.len()
    }

    /// Root context id of a VM.
    pub fn root_context(&self, vm: usize) -> u32 {
        self.vms[vm].store.data().root_id
    }

    /// Declares a cluster that `proxy_http_call` can name.
    pub fn add_cluster(&mut self, name: &str, cluster: Cluster) {
        self.proc.borrow_mut().clusters.insert(name.to_string(), (cluster, 0));
    }

    /// Sets a process-wide property readable with `proxy_get_property` (dot-joined path).
    pub fn set_property(&mut self, path: &str, value: &[u8]) {
        self.proc.borrow_mut().properties.insert(path.to_string(), value.to_vec());
    }

    /// Creates an HTTP context on `vm` for a new stream and returns its id.
    pub fn create_http_context(&mut self, vm: usize, data: StreamData) -> Result<u32, Trap> {
        let d = self.vms[vm].store.data_mut();
        let id = d.next_context;
        d.next_context += 1;
        let root = d.root_id;
        d.contexts.insert(id, Context::Http(Box::new(data)));
        if let Some(f) = self.vms[vm].ex.on_context_create.clone() {
            self.invoke(vm, id, "proxy_on_context_create", f, (id as i32, root as i32))?;
        }
        Ok(id)
    }

    /// The stream data of an HTTP context, for the embedder to fill in or read.
    pub fn stream_mut(&mut self, vm: usize, ctx: u32) -> Option<&mut StreamData> {
        match self.vms[vm].store.data_mut().contexts.get_mut(&ctx) {
            Some(Context::Http(s)) => Some(s),
            _ => None,
        }
    }

    /// Whether a context still exists on a VM.
    pub fn has_context(&self, vm: usize, ctx: u32) -> bool {
        self.vms[vm].store.data().contexts.contains_key(&ctx)
    }

    fn action_call3(
        &mut self,
        vm: usize,
        ctx: u32,
        name: &'static str,
        f: Option<TypedFunc<(i32, i32, i32), i32>>,
        a: i32,
        eos: bool,
    ) -> Result<i32, Trap> {
        match f {
            Some(f) => self.invoke(vm, ctx, name, f, (ctx as i32, a, eos as i32)),
            None => Ok(crate::abi::action::CONTINUE),
        }
    }

    fn action_call2(
        &mut self,
        vm: usize,
        ctx: u32,
        name: &'static str,
        f: Option<TypedFunc<(i32, i32), i32>>,
        a: i32,
    ) -> Result<i32, Trap> {
        match f {
            Some(f) => self.invoke(vm, ctx, name, f, (ctx as i32, a)),
            None => Ok(crate::abi::action::CONTINUE),
        }
    }

    /// `proxy_on_request_headers`; returns the action (0 continue, 1 pause).
    pub fn on_request_headers(&mut self, vm: usize, ctx: u32, eos: bool) -> Result<i32, Trap> {
        let n = self.stream_mut(vm, ctx).map_or(0, |s| s.request_headers.len()) as i32;
        let f = self.vms[vm].ex.on_request_headers.clone();
        self.action_call3(vm, ctx, "proxy_on_request_headers", f, n, eos)
    }

    /// `proxy_on_request_body` with the size of the stream's current `request_body`.
    pub fn on_request_body(&mut self, vm: usize, ctx: u32, eos: bool) -> Result<i32, Trap> {
        let n = self.stream_mut(vm, ctx).map_or(0, |s| s.request_body.len()) as i32;
        let f = self.vms[vm].ex.on_request_body.clone();
        self.action_call3(vm, ctx, "proxy_on_request_body", f, n, eos)
    }

    /// `proxy_on_request_trailers`.
    pub fn on_request_trailers(&mut self, vm: usize, ctx: u32) -> Result<i32, Trap> {
        let n = self.stream_mut(vm, ctx).and_then(|s| s.request_trailers.as_ref().map(|t| t.len())).unwrap_or(0) as i32;
        let f = self.vms[vm].ex.on_request_trailers.clone();
        self.action_call2(vm, ctx, "proxy_on_request_trailers", f, n)
    }

    /// `proxy_on_response_headers`.
    pub fn on_response_headers(&mut self, vm: usize, ctx: u32, eos: bool) -> Result<i32, Trap> {
        let n = self.stream_mut(vm, ctx).and_then(|s| s.response_headers.as_ref().map(|t| t.len())).unwrap_or(0) as i32;
        let f = self.vms[vm].ex.on_response_headers.clone();
        self.action_call3(vm, ctx, "proxy_on_response_headers", f, n, eos)
    }

    /// `proxy_on_response_body` with the size of the stream's current `response_body`.
    pub fn on_response_body(&mut self, vm: usize, ctx: u32, eos: bool) -> Result<i32, Trap> {
        let n = self.stream_mut(vm, ctx).map_or(0, |s| s.response_body.len()) as i32;
        let f = self.vms[vm].ex.on_response_body.clone();
        self.action_call3(vm, ctx, "proxy_on_response_body", f, n, eos)
    }

    /// `proxy_on_response_trailers`.
    pub fn on_response_trailers(&mut self, vm: usize, ctx: u32) -> Result<i32, Trap> {
        let n =
            self.stream_mut(vm, ctx).and_then(|s| s.response_trailers.as_ref().map(|t| t.len())).unwrap_or(0) as i32;
        let f = self.vms[vm].ex.on_response_trailers.clone();
        self.action_call2(vm, ctx, "proxy_on_response_trailers", f, n)
    }

    /// Ends a stream the way Envoy does: `proxy_on_done`, `proxy_on_log`, `proxy_on_delete`, then
    /// forgets the context. Runs all three even if one traps; returns the first trap.
    pub fn finish_stream(&mut self, vm: usize, ctx: u32) -> Result<(), Trap> {
        if !self.has_context(vm, ctx) {
            return Ok(());
        }
        let ex = self.vms[vm].ex.clone();
        let mut first: Option<Trap> = None;
        if let Some(f) = ex.on_done {
            if let Err(t) = self.invoke(vm, ctx, "proxy_on_done", f, ctx as i32) {
                first.get_or_insert(t);
            }
        }
        if let Some(f) = ex.on_log {
            if let Err(t) = self.invoke(vm, ctx, "proxy_on_log", f, ctx as i32) {
                first.get_or_insert(t);
            }
        }
        if let Some(f) = ex.on_delete {
            if let Err(t) = self.invoke(vm, ctx, "proxy_on_delete", f, ctx as i32) {
                first.get_or_insert(t);
            }
        }
        let d = self.vms[vm].store.data_mut();
        d.contexts.remove(&ctx);
        // Actions queued for a finished stream can no longer apply.
        d.actions.retain(|(c, _)| *c != ctx);
        first.map_or(Ok(()), Err)
    }

    /// `proxy_on_tick` on the VM's root context.
    pub fn on_tick(&mut self, vm: usize) -> Result<(), Trap> {
        let root = self.root_context(vm);
        match self.vms[vm].ex.on_tick.clone() {
            Some(f) => self.invoke(vm, root, "proxy_on_tick", f, root as i32),
            None => Ok(()),
        }
    }

    /// `proxy_on_queue_ready` for a post; dropped (returns `Ok(false)`) when the registrant VM or
    /// its context is gone.
    pub fn on_queue_ready(&mut self, post: &QueuePost) -> Result<bool, Trap> {
        if post.vm >= self.vms.len()
            || !self.proc.borrow().alive[post.vm]
            || !self.has_context(post.vm, post.context_id)
        {
            return Ok(false);
        }
        match self.vms[post.vm].ex.on_queue_ready.clone() {
            Some(f) => self
                .invoke(
                    post.vm,
                    post.context_id,
                    "proxy_on_queue_ready",
                    f,
                    (post.context_id as i32, post.queue_id as i32),
                )
                .map(|_| true),
            None => Ok(true),
        }
    }

    /// Delivers an http-call response (`None` = failure: reset, timeout or no host, delivered
    /// as zero headers, as Envoy does). Dropped if the calling context is gone, or if the VM
    /// was reloaded since the call (Envoy delivers it to the old instance's context, which
    /// failed).
    pub fn on_http_call_response(&mut self, call: &HttpCallOut, response: Option<CallResponse>) -> Result<(), Trap> {
        if !self.proc.borrow().alive[call.vm]
            || !self.has_context(call.vm, call.context_id)
            || self.vms[call.vm].store.data().instance != call.instance
        {
            return Ok(());
        }
        let Some(f) = self.vms[call.vm].ex.on_http_call_response.clone() else {
            return Ok(());
        };
        let (nh, nb, nt) = response.as_ref().map_or((0, 0, 0), |r| (r.0.len(), r.1.len(), r.2.len()));
        let vm = call.vm;
        let v = &mut self.vms[vm];
        v.store.data_mut().call_response = response;
        let args = (call.context_id as i32, call.token as i32, nh as i32, nb as i32, nt as i32);
        self.invoke(vm, call.context_id, "proxy_on_http_call_response", f, args)
    }

    /// Marks a VM as gone (its thread stopped): later queue posts and call-out responses to it
    /// are dropped, as Envoy drops them when the registrant's thread-local VM no longer exists.
    pub fn stop_vm(&mut self, vm: usize) {
        self.proc.borrow_mut().alive[vm] = false;
    }

    /// Deferred stream actions requested by the last calls on `vm`, in request order.
    pub fn take_actions(&mut self, vm: usize) -> Vec<(u32, StreamAction)> {
        std::mem::take(&mut self.vms[vm].store.data_mut().actions)
    }

    /// `on_queue_ready` posts produced by enqueues since the last drain.
    pub fn take_queue_posts(&mut self) -> Vec<QueuePost> {
        std::mem::take(&mut self.proc.borrow_mut().posts)
    }

    /// `proxy_http_call`s made since the last drain.
    pub fn take_http_calls(&mut self) -> Vec<HttpCallOut> {
        std::mem::take(&mut self.proc.borrow_mut().http_calls)
    }

    /// Tick period the VM's root context asked for (0 = disabled).
    pub fn tick_period_ms(&self, vm: usize) -> u32 {
        self.vms[vm].store.data().tick_period_ms
    }

    /// Whether the module on `vm` called `proxy_done`.
    pub fn done_called(&self, vm: usize) -> bool {
        self.vms[vm].store.data().done_called
    }

    /// All log records so far.
    pub fn logs(&self) -> std::cell::Ref<'_, Vec<LogRecord>> {
        std::cell::Ref::map(self.proc.borrow(), |p| &p.logs)
    }

    /// Log messages containing `needle`, for assertions.
    pub fn log_lines(&self, needle: &str) -> Vec<LogRecord> {
        self.proc.borrow().logs.iter().filter(|l| l.message.contains(needle)).cloned().collect()
    }

    /// Metrics defined by the module, in definition order.
    pub fn metrics(&self) -> Vec<Metric> {
        self.proc.borrow().metrics.clone()
    }

    /// One metric by name.
    pub fn metric(&self, name: &str) -> Option<Metric> {
        self.proc.borrow().metrics.iter().find(|m| m.name == name).cloned()
    }

    /// A shared-data entry (value, cas).
    pub fn shared_data(&self, key: &str) -> Option<(Vec<u8>, u32)> {
        self.proc.borrow().shared.get(key).map(|e| (e.value.clone(), e.cas))
    }

    /// All shared-data keys.
    pub fn shared_keys(&self) -> Vec<String> {
        self.proc.borrow().shared.keys().cloned().collect()
    }

    /// Traps so far.
    pub fn traps(&self) -> &[Trap] {
        &self.traps
    }

    /// A shared queue's registrant `(vm, root context)` and length, by name.
    pub fn queue_info(&self, name: &str) -> Option<(usize, u32, usize)> {
        let p = self.proc.borrow();
        let id = p.queue_names.get(&(p.vm_id.clone(), name.to_string()))?;
        let q = p.queues.get(id)?;
        Some((q.owner_vm, q.owner_context, q.items.len()))
    }

    /// Records a host-side log line (the embedder's diagnostics appear with the module's logs).
    pub fn host_log(&mut self, vm: usize, ctx: u32, level: LogLevel, msg: String) {
        self.proc.borrow_mut().log(vm, ctx, level, "host", msg);
    }
}
