//! Simulated GPU model servers and a wasmtime host of the proxy-wasm ABI.
