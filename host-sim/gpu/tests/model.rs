//! Invariants and behaviour of the GPU model, driven as a discrete-event simulator would.

use std::collections::HashMap;

use proptest::prelude::*;
use sluice_gpu::{GenRequest, GpuEvent, GpuEventKind, GpuModel, GpuProfile, SubmitError};

fn req(id: u64, prompt: u32, output: u32) -> GenRequest {
    GenRequest { id, model: "m".into(), prompt_tokens: prompt, output_tokens: output, prefix_hashes: vec![] }
}

/// A scripted action at a virtual time.
#[derive(Debug, Clone)]
enum Action {
    Submit(GenRequest),
    Abort(u64),
}

/// Runs `script` (sorted by time) to completion, checking the invariants after every step.
fn run(gpu: &mut GpuModel, script: &[(u64, Action)]) -> Vec<GpuEvent> {
    let mut events = Vec::new();
    let mut next = 0;
    loop {
        let t = match (script.get(next).map(|s| s.0), gpu.next_event_us()) {
            (Some(a), Some(e)) => a.min(e),
            (Some(a), None) => a,
            (None, Some(e)) => e,
            (None, None) => break,
        };
        events.extend(gpu.advance(t));
        gpu.check_invariants().unwrap();
        while next < script.len() && script[next].0 <= t {
            match &script[next].1 {
                Action::Submit(r) => {
                    let _ = gpu.submit(r.clone(), t);
                }
                Action::Abort(id) => {
                    gpu.abort(*id, t);
                }
            }
            gpu.check_invariants().unwrap();
            next += 1;
        }
        assert!(events.len() < 10_000_000, "runaway simulation");
    }
    events
}

fn of(events: &[GpuEvent], id: u64) -> Vec<GpuEventKind> {
    events.iter().filter(|e| e.id == id).map(|e| e.kind).collect()
}

fn tokens(kinds: &[GpuEventKind]) -> u32 {
    kinds.iter().map(|k| if let GpuEventKind::Tokens { n } = k { *n } else { 0 }).sum()
}

#[test]
fn one_request_timing_follows_the_time_model() {
    let p = GpuProfile::fast();
    let tm = p.time;
    let mut gpu = GpuModel::new(p).unwrap();
    gpu.submit(req(1, 100, 3), 1_000).unwrap();
    assert_eq!(gpu.next_event_us(), Some(1_000), "an idle GPU starts at the arrival");
    let ev = run(&mut gpu, &[]);
    let prefill = tm.duration_us(100, 0, 100);
    let d1 = tm.duration_us(0, 1, 101);
    let d2 = tm.duration_us(0, 1, 102);
    let kinds: Vec<(u64, GpuEventKind)> = ev.iter().map(|e| (e.at_us, e.kind)).collect();
    assert_eq!(
        kinds,
        vec![
            (1_000 + prefill, GpuEventKind::FirstToken),
            (1_000 + prefill, GpuEventKind::Tokens { n: 1 }),
            (1_000 + prefill + d1, GpuEventKind::Tokens { n: 1 }),
            (1_000 + prefill + d1 + d2, GpuEventKind::Tokens { n: 1 }),
            (1_000 + prefill + d1 + d2, GpuEventKind::Finished),
        ]
    );
    let m = gpu.metrics();
    assert_eq!((m.finished, m.generation_tokens_total, m.prompt_tokens_total, m.running, m.waiting), (1, 3, 100, 0, 0));
    assert_eq!(m.kv_usage, 0.0);
}

#[test]
fn continuous_batching_admits_new_requests_mid_flight() {
    let mut gpu = GpuModel::new(GpuProfile::fast()).unwrap();
    let script = vec![(0, Action::Submit(req(1, 32, 200))), (20_000, Action::Submit(req(2, 32, 5)))];
    let ev = run(&mut gpu, &script);
    let finish = |id| ev.iter().find(|e| e.id == id && e.kind == GpuEventKind::Finished).unwrap().at_us;
    let first2 = ev.iter().find(|e| e.id == 2 && e.kind == GpuEventKind::FirstToken).unwrap().at_us;
    assert!(first2 < finish(1), "request 2 started while request 1 was running");
    assert!(finish(2) < finish(1));
    // While both ran, iterations carried both (request 1 kept producing tokens in between).
    let t1_between = ev.iter().filter(|e| e.id == 1 && e.at_us > first2 && e.at_us <= finish(2)).count();
    assert!(t1_between >= 4, "request 1 progressed alongside request 2 ({t1_between} events)");
}

#[test]
fn preemption_happens_under_memory_pressure_and_everything_finishes() {
    let mut p = GpuProfile::fast();
    p.num_blocks = 40; // 640 tokens of KV
    p.max_model_len = 512;
    let mut gpu = GpuModel::new(p).unwrap();
    let script: Vec<(u64, Action)> = (0..8).map(|i| (i * 10, Action::Submit(req(i, 100, 200)))).collect();
    let ev = run(&mut gpu, &script);
    let m = gpu.metrics();
    assert!(m.preemptions > 0, "8 × 300 tokens do not fit in 640: expected preemptions");
    assert!(ev.iter().any(|e| e.kind == GpuEventKind::Preempted));
    for i in 0..8 {
        let k = of(&ev, i);
        assert_eq!(tokens(&k), 200, "request {i} produced every token exactly once");
        assert_eq!(k.iter().filter(|k| **k == GpuEventKind::FirstToken).count(), 1);
        assert_eq!(k.last(), Some(&GpuEventKind::Finished));
    }
    assert!(m.prefill_tokens_computed > 800, "recompute after preemption costs prefill again");
    assert_eq!(m.kv_usage, 0.0);
}

#[test]
fn chunked_prefill_splits_long_prompts_and_keeps_decodes_flowing() {
    let mut p = GpuProfile::fast();
    p.max_num_batched_tokens = 64;
    let mut gpu = GpuModel::new(p).unwrap();
    let script = vec![(0, Action::Submit(req(1, 16, 60))), (5_000, Action::Submit(req(2, 400, 2)))];
    let ev = run(&mut gpu, &script);
    let first2 = ev.iter().find(|e| e.id == 2 && e.kind == GpuEventKind::FirstToken).unwrap().at_us;
    // 400 prompt tokens with 63 tokens of budget left per iteration: 7 chunks, each alongside a
    // decode of request 1.
    let a_during = ev
        .iter()
        .filter(|e| e.id == 1 && matches!(e.kind, GpuEventKind::Tokens { .. }) && e.at_us > 5_000 && e.at_us <= first2)
        .count();
    assert!(a_during >= 7, "request 1 decoded during request 2's chunked prefill ({a_during} tokens)");
    assert_eq!(gpu.metrics().prefill_tokens_computed, 416);
}

#[test]
fn without_chunked_prefill_a_prompt_is_computed_in_one_iteration() {
    let mut p = GpuProfile::fast();
    p.chunked_prefill = false;
    let tm = p.time;
    let mut gpu = GpuModel::new(p).unwrap();
    gpu.submit(req(1, 400, 1), 0).unwrap();
    let ev = run(&mut gpu, &[]);
    assert_eq!(ev[0].at_us, tm.duration_us(400, 0, 400));
    assert_eq!(gpu.metrics().iterations, 1);
}

#[test]
fn abort_frees_kv_and_silences_the_request() {
    let mut gpu = GpuModel::new(GpuProfile::fast()).unwrap();
    gpu.submit(req(1, 200, 100), 0).unwrap();
    gpu.submit(req(2, 50, 10), 0).unwrap();
    let mut ev = gpu.advance(gpu.next_event_us().unwrap());
    while !ev.iter().any(|e| e.id == 1) {
        ev = gpu.advance(gpu.next_event_us().unwrap());
    }
    let usage_before = gpu.metrics().kv_usage;
    assert!(gpu.abort(1, gpu.now_us()));
    assert!(!gpu.abort(1, gpu.now_us()), "second abort finds nothing");
    assert!(gpu.metrics().kv_usage < usage_before);
    gpu.check_invariants().unwrap();
    let rest = run(&mut gpu, &[]);
    assert!(rest.iter().all(|e| e.id != 1), "no event after abort");
    assert_eq!(tokens(&of(&rest, 2)) + tokens(&of(&ev, 2)), 10);
    let m = gpu.metrics();
    assert_eq!((m.aborted, m.finished, m.kv_usage), (1, 1, 0.0));
}

#[test]
fn waiting_queue_is_fcfs_and_bounded_by_max_num_seqs() {
    let mut p = GpuProfile::fast();
    p.max_num_seqs = 2;
    let mut gpu = GpuModel::new(p).unwrap();
    for i in 0..4 {
        gpu.submit(req(i, 16, 20), 0).unwrap();
    }
    gpu.advance(0);
    let m = gpu.metrics();
    assert_eq!((m.running, m.waiting), (2, 2));
    let ev = run(&mut gpu, &[]);
    let first = |id| ev.iter().find(|e| e.id == id && e.kind == GpuEventKind::FirstToken).unwrap().at_us;
    assert!(first(0) <= first(1) && first(1) < first(2) && first(2) <= first(3));
}

#[test]
fn prefix_cache_hits_and_lru_eviction() {
    let mut p = GpuProfile::fast(); // prefix_hash_tokens 32 = 2 blocks
    p.num_blocks = 40;
    let mut gpu = GpuModel::new(p).unwrap();
    let with = |id, hashes: Vec<u64>| GenRequest {
        id,
        model: "m".into(),
        prompt_tokens: 100,
        output_tokens: 2,
        prefix_hashes: hashes,
    };
    run(&mut gpu, &[(0, Action::Submit(with(1, vec![7, 8, 9])))]);
    let m = gpu.metrics();
    assert_eq!((m.prefix_queries_tokens, m.prefix_hits_tokens), (96, 0));
    assert_eq!(m.cached_blocks, 6, "three 32-token entries stay cached after finishing");
    assert_eq!(m.kv_usage, 0.0, "cached but unreferenced blocks are not usage");
    // Same first two blocks, different third: 64 tokens hit.
    run(&mut gpu, &[(1_000_000, Action::Submit(with(2, vec![7, 8, 10])))]);
    let m = gpu.metrics();
    assert_eq!((m.prefix_queries_tokens, m.prefix_hits_tokens), (192, 64));
    // A different first hash is a miss even if later hashes match (chained keys).
    run(&mut gpu, &[(2_000_000, Action::Submit(with(3, vec![1, 8, 9])))]);
    assert_eq!(gpu.metrics().prefix_hits_tokens, 64);
    // A big request needs the whole pool: cached entries are evicted, not over-committed.
    run(&mut gpu, &[(3_000_000, Action::Submit(req(4, 400, 100)))]);
    let m = gpu.metrics();
    assert!(m.cached_blocks < 6 + 6 + 2, "LRU entries were evicted ({} cached)", m.cached_blocks);
    gpu.check_invariants().unwrap();
}

/// Submits `r` to an idle `gpu` at `t` after looking it up, runs it to the end and returns
/// (the lookup, the prefix-cache hits its admission counted).
fn lookup_then_admit(gpu: &mut GpuModel, r: GenRequest, t: u64) -> (u32, u64) {
    let looked = gpu.cached_prefix_tokens(&r.model, r.prompt_tokens, &r.prefix_hashes);
    let before = gpu.metrics();
    assert_eq!(gpu.cached_prefix_tokens(&r.model, r.prompt_tokens, &r.prefix_hashes), looked, "no side effect");
    assert_eq!(gpu.metrics(), before, "a lookup changes no counter");
    run(gpu, &[(t, Action::Submit(r))]);
    (looked, gpu.metrics().prefix_hits_tokens - before.prefix_hits_tokens)
}

#[test]
fn cached_prefix_lookup_is_what_admission_finds() {
    let mut p = GpuProfile::fast(); // prefix_hash_tokens 32
    p.num_blocks = 40;
    let mut gpu = GpuModel::new(p.clone()).unwrap();
    let with = |id, prompt, hashes: Vec<u64>, model: &str| GenRequest {
        id,
        model: model.into(),
        prompt_tokens: prompt,
        output_tokens: 2,
        prefix_hashes: hashes,
    };
    assert_eq!(lookup_then_admit(&mut gpu, with(1, 100, vec![7, 8, 9], "m"), 0), (0, 0));
    // Leading blocks in order; the chain stops at the first miss.
    assert_eq!(lookup_then_admit(&mut gpu, with(2, 100, vec![7, 8, 10], "m"), 1_000_000), (64, 64));
    assert_eq!(lookup_then_admit(&mut gpu, with(3, 100, vec![1, 8, 9], "m"), 2_000_000), (0, 0));
    // Another model's cache entries are not this one's.
    assert_eq!(lookup_then_admit(&mut gpu, with(4, 100, vec![7, 8, 9], "other"), 3_000_000), (0, 0));
    // A prompt of exactly three blocks keeps its last block to compute.
    assert_eq!(lookup_then_admit(&mut gpu, with(5, 96, vec![7, 8, 9], "m"), 4_000_000), (64, 64));
    // Hashes past the prompt's full blocks are not looked up.
    assert_eq!(lookup_then_admit(&mut gpu, with(6, 70, vec![7, 8, 9], "m"), 5_000_000), (64, 64));
    p.prefix_caching = false;
    let mut off = GpuModel::new(p).unwrap();
    run(&mut off, &[(0, Action::Submit(with(1, 100, vec![7, 8, 9], "m")))]);
    assert_eq!(off.cached_prefix_tokens("m", 100, &[7, 8, 9]), 0);
}

#[test]
fn predicted_ttft_grows_with_uncached_prompt_and_queued_work() {
    let p = GpuProfile::llama3_8b_h100();
    let mut gpu = GpuModel::new(p.clone()).unwrap();
    let with = |id, prompt, hashes: Vec<u64>| GenRequest {
        id,
        model: "m".into(),
        prompt_tokens: prompt,
        output_tokens: 50,
        prefix_hashes: hashes,
    };
    let hashes: Vec<u64> = (0..8).collect();
    let cold = gpu.predicted_ttft_us("m", 4_200, &hashes);
    // Idle: one iteration's overhead plus the prompt at the prefill rate.
    assert_eq!(cold, (p.time.base_us + 4_200.0 * p.time.per_prefill_token_us).round() as u64);
    run(&mut gpu, &[(0, Action::Submit(with(1, 4_200, hashes.clone())))]);
    let warm = gpu.predicted_ttft_us("m", 4_200, &hashes);
    assert!(warm * 5 < cold, "8 cached blocks of 512: {warm} vs {cold} µs");
    // Work queued ahead (submitted, not yet admitted) lengthens the prediction.
    gpu.submit(with(2, 8_000, vec![]), 10_000_000).unwrap();
    gpu.submit(with(3, 8_000, vec![]), 10_000_000).unwrap();
    assert_eq!(gpu.queue_work().waiting_prefill_tokens, 16_000);
    let busy = gpu.predicted_ttft_us("m", 4_200, &hashes);
    assert!(busy as f64 > warm as f64 + 16_000.0 * p.time.per_prefill_token_us, "{busy} vs {warm}");
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(100))]

    /// On an idle GPU, whatever the cache holds (evictions included), the lookup equals the hits
    /// the request's admission counts.
    #[test]
    fn cached_prefix_lookup_is_exact(
        blocks in 34u32..80,
        reqs in prop::collection::vec((1u32..300, prop::collection::vec(0u64..4, 0..8), 0u8..2), 1..30),
    ) {
        let mut p = GpuProfile::fast();
        p.num_blocks = blocks;
        p.max_model_len = 512;
        let mut gpu = GpuModel::new(p).unwrap();
        for (i, (prompt, hashes, model)) in reqs.into_iter().enumerate() {
            let r = GenRequest { id: i as u64, model: format!("m{model}"), prompt_tokens: prompt, output_tokens: 3, prefix_hashes: hashes };
            let (looked, hits) = lookup_then_admit(&mut gpu, r, i as u64 * 10_000_000);
            prop_assert_eq!(looked as u64, hits);
        }
    }
}

#[test]
fn model_swap_costs_time_and_waits_for_an_idle_model() {
    let mut p = GpuProfile::fast();
    p.max_loaded_models = 1;
    p.swap_us = 50_000;
    let mut gpu = GpuModel::new(p.clone()).unwrap();
    let a = GenRequest { id: 1, model: "a".into(), prompt_tokens: 10, output_tokens: 5, prefix_hashes: vec![] };
    let b = GenRequest { id: 2, model: "b".into(), ..a.clone() };
    let ev = run(&mut gpu, &[(0, Action::Submit(a)), (0, Action::Submit(b))]);
    let at = |id, k| ev.iter().find(|e| e.id == id && e.kind == k).unwrap().at_us;
    assert!(at(1, GpuEventKind::FirstToken) >= 50_000, "first load costs a swap");
    assert!(
        at(2, GpuEventKind::FirstToken) >= at(1, GpuEventKind::Finished) + 50_000,
        "b waits for a to drain, then swaps"
    );
    assert_eq!(gpu.metrics().swaps, 2);
    let mut gpu = GpuModel::new(p).unwrap();
    gpu.submit(GenRequest { id: 1, model: "a".into(), prompt_tokens: 10, output_tokens: 5, prefix_hashes: vec![] }, 0)
        .unwrap();
    gpu.submit(GenRequest { id: 2, model: "b".into(), prompt_tokens: 10, output_tokens: 5, prefix_hashes: vec![] }, 0)
        .unwrap();
    gpu.advance(0);
    assert_eq!(gpu.model_sets(), (vec!["a".to_string()], vec!["b".to_string()], vec!["a".to_string()]));
    assert!(gpu
        .prometheus_text()
        .contains(r#"vllm:lora_requests_info{max_lora="1",running_lora_adapters="a",waiting_lora_adapters="b"} 0"#));
}

#[test]
fn submit_refuses_bad_requests() {
    let mut gpu = GpuModel::new(GpuProfile::fast()).unwrap();
    assert_eq!(gpu.submit(req(1, 0, 5), 0), Err(SubmitError::EmptyPrompt));
    assert_eq!(gpu.submit(req(1, 5, 0), 0), Err(SubmitError::NoOutput));
    assert!(matches!(gpu.submit(req(1, 500, 100), 0), Err(SubmitError::TooLong { tokens: 600, .. })));
    gpu.submit(req(1, 5, 5), 0).unwrap();
    assert_eq!(gpu.submit(req(1, 5, 5), 0), Err(SubmitError::DuplicateId(1)));
    assert!(GpuModel::new(GpuProfile { block_size: 0, ..GpuProfile::fast() }).is_err());
}

#[test]
fn prometheus_text_has_vllm_names() {
    let mut gpu = GpuModel::new(GpuProfile::llama2_7b_a10g()).unwrap();
    gpu.submit(req(1, 160, 10), 0).unwrap();
    gpu.submit(req(2, 16, 10), 0).unwrap();
    gpu.advance(0);
    let text = gpu.prometheus_text();
    let value = |name: &str| -> f64 {
        let line =
            text.lines().find(|l| l.starts_with(&format!("{name}{{"))).unwrap_or_else(|| panic!("{name} missing"));
        line.rsplit(' ').next().unwrap().parse().unwrap()
    };
    assert_eq!(value("vllm:num_requests_running"), 2.0);
    assert_eq!(value("vllm:num_requests_waiting"), 0.0);
    // 160 + 16 prompt tokens = 10 + 1 blocks of 625.
    assert!((value("vllm:kv_cache_usage_perc") - 11.0 / 625.0).abs() < 1e-9);
    // vLLM 0.32's labels; it no longer exports the old gpu_cache_usage_perc.
    assert!(text.contains("vllm:num_requests_running{engine=\"0\",model_name="));
    assert!(!text.contains("vllm:gpu_cache_usage_perc"));
    assert!(text.contains(
        "vllm:cache_config_info{block_size=\"16\",enable_prefix_caching=\"False\",engine=\"0\",num_gpu_blocks=\"625\"} 1"
    ));
    assert!(text.contains("vllm:prefix_cache_hits_total{"));
}

fn workload() -> impl Strategy<Value = (GpuProfile, Vec<(u64, Action)>)> {
    let profile = (any::<bool>(), any::<bool>(), 34u32..120, 1u32..12, 64u32..600, 0u32..3).prop_map(
        |(chunked, prefix, blocks, seqs, budget, loaded)| {
            let mut p = GpuProfile::fast();
            p.num_blocks = blocks;
            p.max_num_seqs = seqs;
            p.chunked_prefill = chunked;
            p.max_model_len = 512;
            p.max_num_batched_tokens = if chunked { budget } else { 512 };
            p.prefix_caching = prefix;
            p.max_loaded_models = loaded;
            p.swap_us = 3_000;
            p
        },
    );
    let item = (0u64..400_000, 1u32..300, 1u32..212, prop::collection::vec(0u64..4, 0..6), 0u8..3, any::<bool>());
    (profile, prop::collection::vec(item, 1..40)).prop_map(|(p, items)| {
        let mut script = Vec::new();
        for (i, (t, prompt, output, hashes, model, abort)) in items.into_iter().enumerate() {
            let id = i as u64;
            let r = GenRequest {
                id,
                model: format!("m{model}"),
                prompt_tokens: prompt,
                output_tokens: output,
                prefix_hashes: hashes,
            };
            script.push((t, Action::Submit(r)));
            if abort {
                script.push((t + (prompt as u64 * 97) % 200_000, Action::Abort(id)));
            }
        }
        script.sort_by_key(|(t, a)| (*t, matches!(a, Action::Abort(_))));
        (p, script)
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]

    /// KV never over-committed (checked after every step), every accepted request either finishes
    /// with exactly its tokens or is aborted, and a replay gives the same events.
    #[test]
    fn invariants_hold_on_random_workloads((p, script) in workload()) {
        let mut gpu = GpuModel::new(p.clone()).unwrap();
        let ev = run(&mut gpu, &script);
        let mut again = GpuModel::new(p).unwrap();
        prop_assert_eq!(&ev, &run(&mut again, &script), "deterministic");
        let m = gpu.metrics();
        prop_assert_eq!((m.running, m.waiting, m.kv_usage), (0, 0, 0.0));
        let mut per: HashMap<u64, Vec<GpuEventKind>> = HashMap::new();
        for e in &ev {
            per.entry(e.id).or_default().push(e.kind);
        }
        let mut finished = 0;
        for (_, a) in &script {
            let Action::Submit(r) = a else { continue };
            let k = per.remove(&r.id).unwrap_or_default();
            if k.last() == Some(&GpuEventKind::Finished) {
                finished += 1;
                prop_assert_eq!(tokens(&k), r.output_tokens);
                prop_assert_eq!(k.iter().filter(|x| **x == GpuEventKind::Finished).count(), 1);
            } else {
                prop_assert!(tokens(&k) < r.output_tokens, "unfinished request {} must have been aborted", r.id);
            }
            if let Some(pos) = k.iter().position(|x| matches!(x, GpuEventKind::Tokens { .. })) {
                prop_assert!(pos > 0 && k[pos - 1] == GpuEventKind::FirstToken, "FirstToken precedes the first Tokens");
            }
        }
        prop_assert_eq!(m.finished, finished);
        prop_assert_eq!(m.finished + m.aborted, script.iter().filter(|(_, a)| matches!(a, Action::Submit(_))).count() as u64);
    }
}

/// Issue 23: the page's prefill counters are what the model did, as vLLM counts them: the
/// time from a request's first scheduling to its first token (its wait in the queue
/// excluded), and the prompt tokens computed less the prefix cache's hits, both at the finish.
#[test]
fn the_prefill_counters_are_the_time_from_scheduling_to_first_token() {
    let mut p = GpuProfile::fast(); // prefix_hash_tokens 32
    p.max_num_seqs = 1; // the second request waits for the first to finish
    let mut gpu = GpuModel::new(p).unwrap();
    let with =
        |id| GenRequest { id, model: "m".into(), prompt_tokens: 100, output_tokens: 3, prefix_hashes: vec![7, 8, 9] };
    let events = run(&mut gpu, &[(0, Action::Submit(with(1))), (0, Action::Submit(with(2)))]);
    let at = |id, kind| events.iter().find(|e| e.id == id && e.kind == kind).unwrap().at_us;
    let (first1, done1, first2) =
        (at(1, GpuEventKind::FirstToken), at(1, GpuEventKind::Finished), at(2, GpuEventKind::FirstToken));
    let m = gpu.metrics();
    assert_eq!(m.prefill_time_us, first1 + (first2 - done1), "request 2 was scheduled when 1 left");
    assert!(m.prefill_time_us < first1 + first2, "the wait in the queue is not prefill");
    assert_eq!(m.prefill_kv_computed_tokens, 100 + (100 - 96), "request 2 found 96 tokens cached");
    let text = gpu.prometheus_text();
    let value = |name: &str| -> f64 {
        let line = text.lines().find(|l| l.starts_with(&format!("{name}{{"))).unwrap_or_else(|| panic!("{name}"));
        line.rsplit(' ').next().unwrap().parse().unwrap()
    };
    assert_eq!(value("vllm:request_prefill_time_seconds_sum"), m.prefill_time_us as f64 / 1e6);
    assert_eq!(value("vllm:request_prefill_time_seconds_count"), 2.0);
    assert_eq!(value("vllm:request_prefill_kv_computed_tokens_sum"), 104.0);
}
