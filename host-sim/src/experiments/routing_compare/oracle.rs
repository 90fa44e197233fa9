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

#[cfg(test)]
mod tests {
    use super::*;

    /// A streaming completion of `tokens` prompt tokens (4 bytes each) with these prefix blocks.
    fn request(tokens: usize, prefix_hashes: Vec<u64>) -> UpstreamRequest {
        let body = serde_json::json!({"model": "m", "prompt": "abcd".repeat(tokens), "stream": true, "max_tokens": 8});
        UpstreamRequest {
            headers: vec![(":path".into(), b"/v1/completions".to_vec())],
            body: serde_json::to_vec(&body).unwrap(),
            prefix_hashes,
            output_tokens: Some(8),
        }
    }

    /// Runs the pool until every GPU is idle.
    fn drain(pool: &mut OraclePool) {
        while let Some(t) = pool.next_event_us() {
            pool.advance(t);
        }
    }

    #[test]
    fn the_oracle_picks_the_cached_gpu_until_its_queue_costs_more_than_the_prefill() {
        let h100 = GpuProfile::llama3_8b_h100();
        let pool = Rc::new(RefCell::new(OraclePool::new(&[h100.clone(), h100], 256).unwrap()));
        let mut ups = OracleUpstream::for_pool(&pool);
        let doc: Vec<u64> = (0..16).collect();
        // Both idle: the lowest index; the request's 16 blocks get cached on GPU 0.
        assert_eq!(pool.borrow().choose(&request(8_500, doc.clone())), Some(0));
        ups[1].submit(0, 1, request(8_500, doc.clone()));
        assert_eq!(pool.borrow().placed(1), Some(0), "redirected from the filter's endpoint 1");
        drain(&mut pool.borrow_mut());
        // A repeat goes where its prefix is cached, whatever endpoint the filter picked.
        ups[1].submit(10_000_000, 2, request(8_500, doc.clone()));
        assert_eq!(pool.borrow().placed(2), Some(0));
        drain(&mut pool.borrow_mut());
        assert_eq!(pool.borrow().metrics(0).prefix_hits_tokens, 8_192);
        // With more uncached prefill queued on GPU 0 than the 8 k-token prompt costs, the
        // repeat goes to the idle GPU 1.
        for id in 3..6 {
            assert!(pool.borrow_mut().gpus[0].submit(20_000_000, id, request(8_000, vec![])).is_empty());
        }
        let queued = pool.borrow().gpus[0].model().queue_work().waiting_prefill_tokens;
        assert!(queued >= 8_000, "{queued}");
        assert_eq!(pool.borrow().choose(&request(8_500, doc)), Some(1));
        // A body no GPU would take stays where the filter sent it.
        let mut bad = request(10, vec![]);
        bad.body = b"not json".to_vec();
        assert_eq!(pool.borrow().choose(&bad), None);
    }
}
