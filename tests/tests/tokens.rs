//! The tokens-charged stats through real Envoy (`--concurrency 2`): what sluice charged the
//! tenants equals what the engines reported in `usage`, for streamed and whole responses, chats
//! and completions.

mod common;

use common::*;
use serde_json::json;
use sluice_e2e::{serial, BackendOptions, ChatRequest, LoadClient};
use std::time::Instant;

/// Tokens the backends' chat template adds to every chat prompt: in the engine's count, not in
/// the gateway's estimate from the message text (as with vLLM).
const TEMPLATE_TOKENS: u64 = 15;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_tokens_charged_are_the_usage_the_engines_reported() -> anyhow::Result<()> {
    let _g = serial();
    let backend = BackendOptions {
        extra_args: vec!["--chat-template-tokens".into(), TEMPLATE_TOKENS.to_string()],
        ..backends(2, 1.0)
    };
    // One slot per backend, so most requests queue and are dispatched by the scheduler; the
    // rest bypass it: both paths are charged.
    let cap = json!({"lower_bound_per_backend": 1, "upper_bound_per_backend": 1});
    let rig = rig("tokens", backend, "vtc", cap, 2).await?;
    let client = LoadClient::default();
    let addr = rig.envoy.listener;
    let requests: Vec<ChatRequest> = (0..12)
        .map(|i| {
            let mut r = ChatRequest::chat(Some(["a", "b", "c"][i % 3]), 8 + i as u32);
            r.prompt_words = 3 + 7 * i;
            match i % 4 {
                1 => r.stream = false,
                2 => r.path = "/v1/completions".into(),
                3 => (r.path, r.stream) = ("/v1/completions".into(), false),
                _ => {}
            }
            r
        })
        .collect();
    let origin = Instant::now();
    let tasks: Vec<_> = requests
        .iter()
        .map(|r| {
            let (c, r) = (client.clone(), r.clone());
            tokio::spawn(async move { c.send(addr, &r, origin).await })
        })
        .collect();
    let (mut prompt, mut output, mut chats) = (0, 0, 0);
    for (t, r) in tasks.into_iter().zip(&requests) {
        let o = t.await?;
        assert!(o.ok() && o.tokens == u64::from(r.max_tokens), "{o:?}");
        prompt += o.usage_prompt_tokens.unwrap_or_else(|| panic!("no usage.prompt_tokens: {o:?}"));
        output += o.usage_completion_tokens.unwrap_or_else(|| panic!("no usage.completion_tokens: {o:?}"));
        chats += u64::from(r.path == "/v1/chat/completions");
    }
    let s = wait_idle(&rig.envoy).await?;
    assert!(s.value("sluice_requests_queued") > 0.0, "nothing was queued: {}", s.sluice_summary());
    assert_eq!(s.value("sluice_tokens_charged_prompt"), prompt as f64, "{}", s.sluice_summary());
    assert_eq!(s.value("sluice_tokens_charged_output"), output as f64, "{}", s.sluice_summary());
    // The estimate misses exactly the template: what the engine's count corrected.
    assert_eq!(
        s.value("sluice_tokens_estimated_prompt"),
        (prompt - chats * TEMPLATE_TOKENS) as f64,
        "{}",
        s.sluice_summary()
    );
    Ok(())
}
