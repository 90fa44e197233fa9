//! A deterministic wasmtime host of the proxy-wasm ABI v0.2.1 that reproduces Envoy's semantics
//! and knows nothing of the module it runs: the embedder (a simulator, a test) drives it call by
//! call in virtual time.
//!
//! Modules: [`abi`] (status codes, enums, header-map wire format), [`state`] (what the host
//! functions share: the process, one per simulated Envoy, and each VM's state), [`hostcalls`]
//! (the host functions, one file per concern, each adding itself to a `wasmtime::Linker`),
//! [`host`] ([`Host`]: the compiled module and its VMs).
//!
//! # The embedder's side
//!
//! The host never calls out: the embedder supplies the clock ([`Host::set_now_us`]), the
//! clusters `proxy_http_call` may name ([`Host::add_cluster`]), process properties
//! ([`Host::set_property`]) and each stream's data ([`Host::create_http_context`],
//! [`Host::stream_mut`]), and calls the module's callbacks (`Host::on_*`). What a call asks
//! for is recorded and drained after it returns, for the embedder to apply: stream actions
//! (continue, reset, local reply; [`Host::take_actions`]), `on_queue_ready` posts
//! ([`Host::take_queue_posts`]), http calls ([`Host::take_http_calls`], answered with
//! [`Host::on_http_call_response`]) and the tick period ([`Host::tick_period_ms`]). So
//! callbacks never nest, and a run is a pure function of what the embedder does.
//!
//! # Envoy semantics reproduced
//!
//! - One VM (wasm instance, own memory) per worker plus one for the main thread
//!   ([`MAIN_VM`]); the module is compiled once. Each VM: `_initialize`, root context 1,
//!   `on_vm_start` with the VM configuration, `on_configure` with the plugin configuration
//!   (false fails start-up with [`ConfigRejected`]).
//! - `continue_stream`, `close_stream` and `send_local_response` are recorded and applied by
//!   the embedder after the VM call returns. `set_effective_context` only resolves contexts of
//!   the calling VM.
//! - Shared data: one map per process (the plugin's vm_id), CAS checked only against existing
//!   keys, no delete (a removed key keeps an empty value). Shared queues: last registrant wins,
//!   one `on_queue_ready` post per enqueue to the registrant's root context, dropped if that VM
//!   is stopped ([`Host::stop_vm`]).
//! - `proxy_http_call` to [`Cluster::Static`] or [`Cluster::OriginalDst`] clusters; unknown
//!   cluster or missing `:method`/`:path`/`:authority` is BadArgument; a failed call
//!   (delivered as `None`) gives zero headers.
//! - A trap (with its wasm backtrace, also logged at critical) marks the VM failed; the
//!   embedder applies [`FailurePolicy`] ([`Host::reload_vm`]). Every call runs with a fuel
//!   budget, so an endless loop traps instead of hanging the run. A reloaded VM is a new
//!   instance: answers to http calls the old one made are not delivered to it.
//! - gRPC calls and TCP stream types return Unimplemented; unknown foreign functions NotFound
//!   (`clear_route_cache` is accepted); any other import the module declares traps only when
//!   called, naming it.
//! - WASI preview 1 by hand: `fd_write` (stdout/stderr to the log), `clock_time_get` from the
//!   virtual clock (wall clock starts at [`state::EPOCH_NS`]), `random_get` from a ChaCha8
//!   stream seeded by [`PluginSpec::seed`], empty environment and arguments, no preopens,
//!   `proc_exit` traps.
//! - Fault injection, each from its own seeded stream: traps in host calls
//!   ([`PluginSpec::trap_rate`], [`INJECTED_TRAP`]) and lost CAS races
//!   ([`PluginSpec::cas_conflict_rate`]).

pub mod abi;
pub mod host;
pub mod hostcalls;
pub mod state;

pub use host::{ConfigRejected, FailurePolicy, Host, PluginSpec, Trap, MAIN_VM};
pub use hostcalls::INJECTED_TRAP;
pub use state::{Cluster, HostProfile, HttpCallOut, LogRecord, Metric, QueuePost, StreamAction, StreamData};
