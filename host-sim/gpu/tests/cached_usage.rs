//! The prompt tokens a request found cached, as the usage reports them (issue 23, item 4).

use sluice_gpu::openai::{Endpoint, ResponseMeta};
use sluice_gpu::{GenRequest, GpuEventKind, GpuModel, GpuProfile};

/// Runs `req` alone to its end; the cached count read on its `Finished` event.
fn cached_at_finish(gpu: &mut GpuModel, req: GenRequest) -> Option<u32> {
    let id = req.id;
    let start = gpu.now_us();
    gpu.submit(req, start).unwrap();
    while let Some(t) = gpu.next_event_us() {
        for ev in gpu.advance(t) {
            if ev.id == id && ev.kind == GpuEventKind::Finished {
                return gpu.cached_tokens(id);
            }
        }
    }
    panic!("request {id} never finished")
}

#[test]
fn a_finished_request_reports_the_prefix_its_admission_found_cached() {
    let mut gpu = GpuModel::new(GpuProfile::fast()).unwrap(); // 32-token prefix entries
    let with = |id, hashes: Vec<u64>| GenRequest {
        id,
        model: "m".into(),
        prompt_tokens: 100,
        output_tokens: 3,
        prefix_hashes: hashes,
    };
    assert_eq!(cached_at_finish(&mut gpu, with(1, vec![7, 8, 9])), Some(0), "a cold cache");
    assert_eq!(cached_at_finish(&mut gpu, with(2, vec![7, 8, 10])), Some(64), "two leading entries");
    assert_eq!(cached_at_finish(&mut gpu, with(3, vec![7, 8, 9])), Some(96));
    assert_eq!(gpu.cached_tokens(3), Some(96), "known until the next advance");
    gpu.advance(gpu.now_us() + 1);
    assert_eq!(gpu.cached_tokens(3), None, "then forgotten: nothing grows with the requests served");

    let mut meta = ResponseMeta::new(Endpoint::Chat, 1, "m", 0);
    let usage = |meta: &ResponseMeta| {
        let v: serde_json::Value = serde_json::from_str(&meta.usage_chunk(100, 3)).unwrap();
        v["usage"].clone()
    };
    assert!(usage(&meta).get("prompt_tokens_details").is_none(), "no details unless known");
    meta.cached_tokens = Some(96);
    assert_eq!(usage(&meta)["prompt_tokens_details"]["cached_tokens"], 96, "as vLLM reports it");
}
