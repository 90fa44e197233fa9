//! Prometheus text exposition of a model's metrics, with vLLM's metric names.

use std::fmt::Write;

use crate::model::GpuMetrics;
use crate::profile::GpuProfile;

/// Renders the metrics as vLLM's `/metrics` would (gauges, counters with `_total`, and
/// `cache_config_info` carrying the KV geometry that routers read), with vLLM 0.32's labels:
/// every series names its engine (one here, `engine="0"`) and model. vLLM 0.32 no longer exports
/// the old `vllm:gpu_cache_usage_perc`, so neither does this (readers fall back to it for older
/// servers).
pub fn render(p: &GpuProfile, m: &GpuMetrics) -> String {
    let label = format!("engine=\"0\",model_name=\"{}\"", p.served_model.replace('\\', "\\\\").replace('"', "\\\""));
    let mut out = String::with_capacity(2048);
    let mut metric = |name: &str, kind: &str, help: &str, value: String| {
        let _ = writeln!(out, "# HELP {name} {help}");
        let _ = writeln!(out, "# TYPE {name} {kind}");
        let _ = writeln!(out, "{name}{{{label}}} {value}");
    };
    metric(
        "vllm:num_requests_running",
        "gauge",
        "Number of requests in model execution batches.",
        m.running.to_string(),
    );
    metric("vllm:num_requests_waiting", "gauge", "Number of requests waiting to be processed.", m.waiting.to_string());
    metric(
        "vllm:kv_cache_usage_perc",
        "gauge",
        "KV-cache usage. 1 means 100 percent usage.",
        format!("{}", m.kv_usage),
    );
    metric(
        "vllm:prefix_cache_queries_total",
        "counter",
        "Prefix cache queries, in tokens.",
        m.prefix_queries_tokens.to_string(),
    );
    metric(
        "vllm:prefix_cache_hits_total",
        "counter",
        "Prefix cache hits, in tokens.",
        m.prefix_hits_tokens.to_string(),
    );
    metric("vllm:num_preemptions_total", "counter", "Cumulative number of preemptions.", m.preemptions.to_string());
    metric(
        "vllm:prompt_tokens_total",
        "counter",
        "Prompt tokens of finished requests.",
        m.prompt_tokens_total.to_string(),
    );
    metric(
        "vllm:generation_tokens_total",
        "counter",
        "Generation tokens processed.",
        m.generation_tokens_total.to_string(),
    );
    metric("vllm:request_success_total", "counter", "Successfully finished requests.", m.finished.to_string());
    let prefill_s = m.prefill_time_us as f64 / 1e6;
    let help = "Histogram of time spent in PREFILL phase for request.";
    histogram(&mut out, &label, "vllm:request_prefill_time_seconds", help, prefill_s, m.finished);
    let help = "Histogram of new KV tokens computed during prefill (excluding cached tokens).";
    let computed = m.prefill_kv_computed_tokens as f64;
    histogram(&mut out, &label, "vllm:request_prefill_kv_computed_tokens", help, computed, m.finished);
    let _ = writeln!(out, "# HELP vllm:cache_config_info Information of the KV cache configuration.");
    let _ = writeln!(out, "# TYPE vllm:cache_config_info gauge");
    let _ = writeln!(
        out,
        "vllm:cache_config_info{{block_size=\"{}\",enable_prefix_caching=\"{}\",engine=\"0\",num_gpu_blocks=\"{}\"}} 1",
        p.block_size,
        if p.prefix_caching { "True" } else { "False" }, // Python's spelling, as vLLM writes it
        p.num_blocks
    );
    out
}

/// A histogram with its sum and count, and only the `+Inf` bucket (the routers read the sum
/// and count; the model keeps no distribution).
fn histogram(out: &mut String, label: &str, name: &str, help: &str, sum: f64, count: u64) {
    let _ = writeln!(out, "# HELP {name} {help}");
    let _ = writeln!(out, "# TYPE {name} histogram");
    let _ = writeln!(out, "{name}_bucket{{{label},le=\"+Inf\"}} {count}");
    let _ = writeln!(out, "{name}_sum{{{label}}} {sum}");
    let _ = writeln!(out, "{name}_count{{{label}}} {count}");
}

/// Appends vLLM's `lora_requests_info` gauge (value: the time of the sample in seconds, as vLLM
/// does), mapping the model's resident-model limit and per-model requests onto LoRA adapters so
/// that adapter-affinity routers can read them.
pub fn render_lora_info(out: &mut String, max_loaded: u32, running: &[String], waiting: &[String], now_us: u64) {
    let esc = |v: &[String]| v.join(",").replace('\\', "\\\\").replace('"', "\\\"");
    let _ = writeln!(out, "# HELP vllm:lora_requests_info Running stats on lora requests.");
    let _ = writeln!(out, "# TYPE vllm:lora_requests_info gauge");
    let _ = writeln!(
        out,
        "vllm:lora_requests_info{{max_lora=\"{max_loaded}\",running_lora_adapters=\"{}\",waiting_lora_adapters=\"{}\"}} {}",
        esc(running),
        esc(waiting),
        now_us as f64 / 1e6
    );
}
