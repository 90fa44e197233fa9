//! The sluice proxy-wasm filter: a thin adapter from Envoy's callbacks to the
//! scheduling policies in `sluice-policies`.
//!
//! The pure parts (configuration, the OpenAI wire format, messages between
//! workers, shared-data layouts, the scheduler role, the exchange between
//! gateway replicas) are modules that build and
//! test natively; [`vm`] is the only one that calls the proxy-wasm host.

pub mod config;
#[doc(hidden)]
#[cfg(any(test, feature = "fuzzing"))]
pub mod fuzzing;
pub mod interface;
pub mod openai;
pub mod outcome;
pub mod replicas;
pub mod scheduler;
pub mod shared;
pub mod slo;
#[cfg(target_arch = "wasm32")]
pub mod vm;
pub mod wire;
pub mod worker;
