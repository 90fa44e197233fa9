//! The sluice proxy-wasm filter.
