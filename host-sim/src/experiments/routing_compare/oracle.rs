//! The routing oracle: the physical limit a picker can reach, for the simulator only.
//!
//! The filter still runs in front and decides *when* a request leaves its queue (the same
//! admission as every other picker gets); the oracle decides only *where* it goes. Every
//! address of the pool is an [`OracleUpstream`] over one shared [`OraclePool`] of the real
//! GPUs: a request the filter sends to any address is redirected to the GPU where its
//! predicted time to first token is least ([`sluice_gpu::GpuModel::predicted_ttft_us`]: the
//! prompt tokens that GPU's prefix cache does not hold, at its prefill rate, plus the work
//! queued ahead and the running batch's share of each iteration), read from the GPUs' real
//! state at the moment of dispatch. Scrapes of an address still answer that address's GPU, so
//! the filter's saturation gate reads the real pages.
//!
//! The filter routes with round-robin under the oracle, so its per-endpoint in-flight counts
//! stay even and its stock bound (`watermark_per_backend` × endpoints) does not depend on
//! where requests really land; its predicted-load correction between scrapes counts a request
//! on the address it chose, an error of at most one scrape interval's dispatches, the same for
//! every address.

use crate::sim::upstream::{parse_request, GpuUpstream, Upstream, UpstreamEvent, UpstreamRequest};
use proxy_wasm_host::abi::HeaderMap;
use sluice_gpu::{GpuMetrics, GpuProfile};
use std::any::Any;
use std::cell::RefCell;
use std::collections::HashMap;
use std::rc::Rc;

/// The GPUs behind the oracle and where it sent each request.
pub struct OraclePool {
    gpus: Vec<GpuUpstream>,
    /// GPU of every request placed so far (kept after it ends, for the run's report).
    placed: HashMap<u64, usize>,
}

impl OraclePool {
    /// One GPU server per profile (`default_max_tokens` as [`GpuUpstream::new`]).
    pub fn new(profiles: &[GpuProfile], default_max_tokens: u32) -> anyhow::Result<OraclePool> {
        let gpus =
            profiles.iter().map(|p| GpuUpstream::new(p.clone(), default_max_tokens)).collect::<Result<_, _>>()?;
        Ok(OraclePool { gpus, placed: HashMap::new() })
    }

    /// The GPU with the least predicted TTFT for `req` (the lowest index on ties), or `None`
    /// when the request is not one a GPU would accept (it then goes where the filter sent it,
    /// which answers the error).
    pub fn choose(&self, req: &UpstreamRequest) -> Option<usize> {
        let parsed = parse_request(req).ok()?;
        (0..self.gpus.len()).min_by_key(|&i| {
            self.gpus[i].model().predicted_ttft_us(&parsed.model, parsed.prompt_tokens, &req.prefix_hashes)
        })
    }

    /// GPU `i`'s counters.
    pub fn metrics(&self, i: usize) -> GpuMetrics {
        self.gpus[i].model().metrics()
    }

    /// The GPU request `id` was sent to.
    pub fn placed(&self, id: u64) -> Option<usize> {
        self.placed.get(&id).copied()
    }

    fn next_event_us(&self) -> Option<u64> {
        self.gpus.iter().filter_map(|g| g.next_event_us()).min()
    }

    fn advance(&mut self, now_us: u64) -> Vec<UpstreamEvent> {
        self.gpus.iter_mut().flat_map(|g| g.advance(now_us)).collect()
    }
}

/// Address `index` of the pool under the oracle. Whichever address the engine wakes advances
/// every GPU (events are routed back by request id, so any address may return them), and each
/// address asks to be woken at the pool's next event.
pub struct OracleUpstream {
    pool: Rc<RefCell<OraclePool>>,
    index: usize,
}

impl OracleUpstream {
    /// One upstream per address of `pool`, in order.
    pub fn for_pool(pool: &Rc<RefCell<OraclePool>>) -> Vec<OracleUpstream> {
        (0..pool.borrow().gpus.len()).map(|index| OracleUpstream { pool: pool.clone(), index }).collect()
    }

    /// The shared pool.
    pub fn pool(&self) -> std::cell::Ref<'_, OraclePool> {
        self.pool.borrow()
    }

    /// This address's index in the pool.
    pub fn index(&self) -> usize {
        self.index
    }
}

impl Upstream for OracleUpstream {
    fn submit(&mut self, now_us: u64, id: u64, req: UpstreamRequest) -> Vec<UpstreamEvent> {
        let mut pool = self.pool.borrow_mut();
        let to = pool.choose(&req).unwrap_or(self.index);
        pool.placed.insert(id, to);
        pool.gpus[to].submit(now_us, id, req)
    }

    fn abort(&mut self, now_us: u64, id: u64) {
        let mut pool = self.pool.borrow_mut();
        if let Some(to) = pool.placed(id) {
            pool.gpus[to].abort(now_us, id);
        }
    }

    fn next_event_us(&self) -> Option<u64> {
        self.pool.borrow().next_event_us()
    }

    fn advance(&mut self, now_us: u64) -> Vec<UpstreamEvent> {
        self.pool.borrow_mut().advance(now_us)
    }

    fn handle_call(&mut self, now_us: u64, headers: &HeaderMap, body: &[u8]) -> (HeaderMap, Vec<u8>) {
        self.pool.borrow_mut().gpus[self.index].handle_call(now_us, headers, body)
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}
