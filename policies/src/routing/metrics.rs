//! What a model server's `/metrics` page says of its load.

use crate::prom;
use serde::Deserialize;

/// Which model server exposes the metrics, and so which names to read.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ModelServer {
    /// vLLM (`vllm:*`, with the older `gpu_cache_usage_perc` as a fallback).
    #[default]
    Vllm,
    /// SGLang (`sglang:*`).
    Sglang,
    /// TensorRT-LLM's `trtllm-serve` (`trtllm_*`).
    Trtllm,
}

impl ModelServer {
    /// Prefix cache: the tokens looked up, the tokens found, and a hit-rate
    /// gauge for servers that give no count of hits (`""`: none).
    fn prefix_names(self) -> [&'static str; 3] {
        match self {
            ModelServer::Vllm => ["vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total", ""],
            ModelServer::Sglang => {
                ["sglang:prompt_tokens_total", "sglang:cached_tokens_total", "sglang:cache_hit_rate"]
            }
            ModelServer::Trtllm => ["", "", ""],
        }
    }

    /// Names of (waiting, running, KV usage 0..1, fallback KV usage).
    fn names(self) -> [&'static str; 4] {
        match self {
            ModelServer::Vllm => [
                "vllm:num_requests_waiting",
                "vllm:num_requests_running",
                "vllm:kv_cache_usage_perc",
                "vllm:gpu_cache_usage_perc",
            ],
            ModelServer::Sglang => ["sglang:num_queue_reqs", "sglang:num_running_reqs", "sglang:token_usage", ""],
            ModelServer::Trtllm => {
                ["trtllm_num_requests_waiting", "trtllm_num_requests_running", "trtllm_kv_cache_utilization", ""]
            }
        }
    }
}

/// What a scrape says of one endpoint.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct EndpointMetrics {
    /// Requests waiting in the server's own queue.
    pub waiting: f64,
    /// Requests in the running batch.
    pub running: f64,
    /// Fraction of the KV cache in use, 0..1.
    pub kv_usage: f64,
    /// LoRA adapters running (vLLM's `lora_requests_info`), at most [`MAX_LORAS`].
    pub loras: Vec<String>,
    /// Prompt tokens looked up in the prefix cache since the server started
    /// (vLLM's `prefix_cache_queries_total`, SGLang's `prompt_tokens_total`);
    /// 0 when the page has none.
    pub prefix_queries: f64,
    /// Of those, the tokens found (vLLM's `prefix_cache_hits_total`, SGLang's
    /// `cached_tokens_total`, or its older `cache_hit_rate` gauge times the
    /// queries).
    pub prefix_hits: f64,
}

/// Most running LoRA adapters kept per endpoint, and most bytes of their names: every request
/// reads them (the `lora` scorer, the shared records), so a server listing 16,000 adapter names
/// took Envoy from 5 to 22 % CPU at the same load (issue 19, finding 12). A server runs a few
/// adapters at once (vLLM's `max_loras`); past these bounds the rest get no adapter affinity.
pub const MAX_LORAS: usize = 64;
/// See [`MAX_LORAS`].
pub const MAX_LORA_BYTES: usize = 8 * 1024;

/// At most [`MAX_LORAS`] names from `list` (comma-separated), [`MAX_LORA_BYTES`] in all.
pub fn lora_names(list: &str) -> Vec<String> {
    let mut bytes = 0;
    list.split(',')
        .filter(|a| !a.is_empty())
        .take(MAX_LORAS)
        .take_while(|a| {
            bytes += a.len() + 1;
            bytes <= MAX_LORA_BYTES + 1
        })
        .map(str::to_owned)
        .collect()
}

impl EndpointMetrics {
    /// The fraction of prompt tokens the server's prefix cache served since
    /// it started (`None` before it looked any up).
    pub fn prefix_hit_rate(&self) -> Option<f64> {
        (self.prefix_queries > 0.0).then(|| (self.prefix_hits / self.prefix_queries).clamp(0.0, 1.0))
    }

    /// Reads a `/metrics` page. Series of the same metric (one per model) are
    /// summed (the sum stops at `f64::MAX`, so it stays finite), KV usage takes
    /// the largest; NaN, infinite or negative values are ignored. Returns `None`
    /// when none of the three signals is present, and the number of malformed
    /// lines.
    pub fn from_prometheus(text: &str, server: ModelServer) -> (Option<EndpointMetrics>, usize) {
        let [waiting, running, kv, kv_old] = server.names();
        let mut m = EndpointMetrics::default();
        let (mut seen, mut kv_seen) = (false, false);
        let mut kv_fallback = None;
        let [queries, hits, hit_gauge] = server.prefix_names();
        let mut hit_rate = None;
        let bad = prom::parse(text, |s| {
            let ok = s.value.is_finite() && s.value >= 0.0;
            // Two finite values can sum to infinity, which the router's
            // min-max normalisation turns into NaN scores.
            if s.name == waiting && ok {
                m.waiting = (m.waiting + s.value).min(f64::MAX);
                seen = true;
            } else if s.name == running && ok {
                m.running = (m.running + s.value).min(f64::MAX);
                seen = true;
            } else if s.name == kv && ok {
                m.kv_usage = m.kv_usage.max(s.value.min(1.0));
                kv_seen = true;
            } else if !kv_old.is_empty() && s.name == kv_old && ok {
                kv_fallback = Some(kv_fallback.unwrap_or(0.0f64).max(s.value.min(1.0)));
            } else if !queries.is_empty() && s.name == queries && ok {
                m.prefix_queries = (m.prefix_queries + s.value).min(f64::MAX);
            } else if !hits.is_empty() && s.name == hits && ok {
                m.prefix_hits = (m.prefix_hits + s.value).min(f64::MAX);
            } else if !hit_gauge.is_empty() && s.name == hit_gauge && ok {
                hit_rate = Some(s.value.min(1.0));
            } else if s.name == "vllm:lora_requests_info" {
                if let Some(list) = s.label("running_lora_adapters") {
                    m.loras = lora_names(&list);
                }
            }
        });
        // SGLang versions without `cached_tokens_total` give the rate only.
        if let Some(r) = hit_rate.filter(|_| m.prefix_hits == 0.0) {
            m.prefix_hits = r * m.prefix_queries;
        }
        if !kv_seen {
            if let Some(k) = kv_fallback {
                m.kv_usage = k;
                kv_seen = true;
            }
        }
        ((seen || kv_seen).then_some(m), bad)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    #[test]
    fn reads_the_prefix_cache_counters() {
        let read = |text: &str, server| EndpointMetrics::from_prometheus(text, server).0.unwrap();
        let vllm = "vllm:num_requests_running 1\nvllm:prefix_cache_queries_total{model_name=\"a\"} 800\n\
vllm:prefix_cache_queries_total{model_name=\"b\"} 200\nvllm:prefix_cache_hits_total 250\n";
        let m = read(vllm, ModelServer::Vllm);
        assert_eq!((m.prefix_queries, m.prefix_hits, m.prefix_hit_rate()), (1000.0, 250.0, Some(0.25)));
        assert_eq!(read("vllm:num_requests_running 1\n", ModelServer::Vllm).prefix_hit_rate(), None, "none yet");
        let sg = "sglang:num_queue_reqs 0\nsglang:prompt_tokens_total 400\nsglang:cached_tokens_total 100\n";
        assert_eq!(read(sg, ModelServer::Sglang).prefix_hit_rate(), Some(0.25));
        let old_sg = "sglang:num_queue_reqs 0\nsglang:prompt_tokens_total 400\nsglang:cache_hit_rate 0.5\n";
        assert_eq!(read(old_sg, ModelServer::Sglang).prefix_hit_rate(), Some(0.5), "the older gauge");
    }

    #[test]
    fn reads_each_model_server_flavour() {
        let vllm = "vllm:num_requests_waiting{model_name=\"a\"} 2\nvllm:num_requests_waiting{model_name=\"b\"} 1\n\
vllm:num_requests_running 4\nvllm:kv_cache_usage_perc 0.5\n\
vllm:lora_requests_info{running_lora_adapters=\"sql,chat\",max_lora=\"4\",waiting_lora_adapters=\"\"} 1\n";
        let (got, bad) = EndpointMetrics::from_prometheus(vllm, ModelServer::Vllm);
        let got = got.unwrap();
        assert_eq!((got.waiting, got.running, got.kv_usage, bad), (3.0, 4.0, 0.5, 0));
        assert_eq!(got.loras, vec!["sql", "chat"]);
        let old = "vllm:num_requests_waiting 0\nvllm:gpu_cache_usage_perc 0.7\n";
        assert_eq!(EndpointMetrics::from_prometheus(old, ModelServer::Vllm).0.unwrap().kv_usage, 0.7);
        let sg = "sglang:num_queue_reqs 6\nsglang:num_running_reqs 2\nsglang:token_usage 0.9\n";
        assert_eq!(
            EndpointMetrics::from_prometheus(sg, ModelServer::Sglang).0.unwrap(),
            EndpointMetrics { waiting: 6.0, running: 2.0, kv_usage: 0.9, ..Default::default() }
        );
        let trt = "trtllm_num_requests_waiting 1\ntrtllm_kv_cache_utilization 0.1\n";
        assert_eq!(EndpointMetrics::from_prometheus(trt, ModelServer::Trtllm).0.unwrap().kv_usage, 0.1);
        assert_eq!(EndpointMetrics::from_prometheus("other 1\n", ModelServer::Vllm).0, None);
        let weird = "vllm:num_requests_waiting NaN\nvllm:num_requests_running -1\nvllm:kv_cache_usage_perc +Inf\n";
        assert_eq!(EndpointMetrics::from_prometheus(weird, ModelServer::Vllm).0, None, "nonsense values are ignored");
    }

    /// Issue 19, finding 12: a server listing 16,000 adapters cost every request.
    #[test]
    fn a_long_adapter_list_is_cut_to_the_bounds() {
        let names: Vec<String> = (0..16_000).map(|i| format!("adapter-{i}")).collect();
        let page = format!(
            "vllm:num_requests_running 1\nvllm:lora_requests_info{{running_lora_adapters=\"{}\"}} 1\n",
            names.join(",")
        );
        let got = EndpointMetrics::from_prometheus(&page, ModelServer::Vllm).0.unwrap();
        assert_eq!(got.loras, names[..MAX_LORAS]);
        let long: Vec<String> = (0..64).map(|i| format!("{i:03}{}", "x".repeat(997))).collect();
        let got = lora_names(&long.join(","));
        assert_eq!(got, long[..8], "8 names of 1,000 bytes fill the 8 KiB");
    }
}
