//! The floor of sluice's bypass path: the least a filter that schedules on the request body must
//! do inside Envoy. It pauses in the request headers, reads the whole body into the VM at end of
//! stream, sets the destination header and lets the request continue. `sluice-bench-bypass` runs
//! it beside sluice so that sluice's own cost is measured against the mechanism it rides on, in
//! the same run.
//!
//! The plugin configuration names the endpoint, or several separated by commas, taken in turn
//! (each VM on its own): Envoy's round-robin, which host-sim uses as the pool with no gateway.

use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{Action, ContextType};
use std::cell::Cell;
use std::rc::Rc;

/// The header the ORIGINAL_DST cluster routes on (the same as sluice's).
const DESTINATION: &str = "x-gateway-destination-endpoint";

proxy_wasm::main! {{
    proxy_wasm::set_root_context(|_| Box::new(Root { endpoints: Vec::new(), next: Cell::new(0) }));
}}

/// One per VM: holds the endpoints requests go to, in turn.
struct Root {
    endpoints: Vec<Rc<str>>,
    next: Cell<usize>,
}

impl Context for Root {}

impl RootContext for Root {
    fn on_configure(&mut self, _size: usize) -> bool {
        let raw = self.get_plugin_configuration().unwrap_or_default();
        let Ok(list) = std::str::from_utf8(&raw) else { return false };
        self.endpoints = list.split(',').map(str::trim).filter(|e| !e.is_empty()).map(Rc::from).collect();
        !self.endpoints.is_empty()
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }

    fn create_http_context(&self, _id: u32) -> Option<Box<dyn HttpContext>> {
        let i = self.next.get();
        self.next.set((i + 1) % self.endpoints.len());
        Some(Box::new(Stream { endpoint: self.endpoints[i].clone() }))
    }
}

/// One per request.
struct Stream {
    endpoint: Rc<str>,
}

impl Context for Stream {}

impl HttpContext for Stream {
    fn on_http_request_headers(&mut self, _n: usize, end_of_stream: bool) -> Action {
        self.set_http_request_header(DESTINATION, Some(&self.endpoint));
        if end_of_stream {
            Action::Continue
        } else {
            Action::Pause
        }
    }

    fn on_http_request_body(&mut self, size: usize, end_of_stream: bool) -> Action {
        if !end_of_stream {
            return Action::Pause;
        }
        // Read it as sluice does (which parses it); the floor only keeps its length.
        let body = self.get_http_request_body(0, size).unwrap_or_default();
        std::hint::black_box(body.len());
        Action::Continue
    }
}
