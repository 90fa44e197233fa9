//! Model of a GPU LLM server, and a real-time HTTP server around it.
//!
//! - [`GpuModel`]: a pure, deterministic, step-driven model of a vLLM engine (continuous batching,
//!   paged KV cache with prefix caching and recompute preemption, per-iteration time model) in
//!   virtual time. Both the discrete-event simulator and the real-time backend drive it.
//! - [`GpuProfile`]: named hardware/model profiles (`llama2-7b-a10g`, `llama3-8b-h100`, `fast`).
//! - [`server`]: the OpenAI-compatible HTTP backend (`sluice-backend` binary).

#![warn(missing_docs)]

pub mod metrics;
pub mod model;
pub mod openai;
pub mod profile;
pub mod replay;
pub mod server;

pub use model::{GenRequest, GpuEvent, GpuEventKind, GpuMetrics, GpuModel, QueueWork, SubmitError};
pub use profile::{GpuProfile, ProfileError, TimeModel};
