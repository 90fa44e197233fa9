//! Prometheus text scraped from Envoy's admin `/stats/prometheus`.

use std::collections::BTreeMap;

/// One scrape: sample name (with labels) to value.
#[derive(Debug, Clone, Default)]
pub struct Stats {
    samples: BTreeMap<String, f64>,
}

/// Metric name of a sample key (`name{labels}` -> `name`).
fn metric_name(key: &str) -> &str {
    key.split('{').next().unwrap_or(key)
}

fn matches_suffix(name: &str, suffix: &str) -> bool {
    name == suffix || (name.ends_with(suffix) && name[..name.len() - suffix.len()].ends_with('_'))
}

impl Stats {
    /// Parses Prometheus exposition text; comment and malformed lines are ignored.
    pub fn parse(text: &str) -> Self {
        let mut samples = BTreeMap::new();
        for line in text.lines() {
            let line = line.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            // The value follows the last space (label values may contain spaces).
            if let Some((key, value)) = line.rsplit_once(' ') {
                if let Ok(v) = value.parse::<f64>() {
                    samples.insert(key.trim().to_string(), v);
                }
            }
        }
        Self { samples }
    }

    /// Sum over every sample whose metric name is `suffix` or ends with `_` + `suffix`, so
    /// `sluice_stock` finds `envoy_wasmcustom_sluice_stock` whatever prefix Envoy adds. `None` when absent.
    pub fn get(&self, suffix: &str) -> Option<f64> {
        let mut found = None;
        for (k, v) in &self.samples {
            if matches_suffix(metric_name(k), suffix) {
                *found.get_or_insert(0.0) += v;
            }
        }
        found
    }

    /// Like [`Stats::get`] but 0 when absent (Envoy may not emit a stat that was never touched).
    pub fn value(&self, suffix: &str) -> f64 {
        self.get(suffix).unwrap_or(0.0)
    }

    /// Every sample whose metric name contains `needle`, for diagnostics.
    pub fn matching(&self, needle: &str) -> Vec<(String, f64)> {
        self.samples.iter().filter(|(k, _)| k.contains(needle)).map(|(k, v)| (k.clone(), *v)).collect()
    }

    /// A one-line summary of all `sluice_` samples, for messages.
    pub fn sluice_summary(&self) -> String {
        self.samples
            .iter()
            .map(|(k, v)| (k.trim_start_matches("envoy_wasmcustom_").trim_end_matches("{}"), v))
            .filter(|(k, _)| k.starts_with("sluice_") && !k.contains("_bucket"))
            .map(|(k, v)| format!("{k}={v}"))
            .collect::<Vec<_>>()
            .join(" ")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_wasm_custom_stats_by_suffix() {
        let s = Stats::parse(
            "# TYPE envoy_wasmcustom_sluice_stock gauge\nenvoy_wasmcustom_sluice_stock 3\n\
             envoy_wasmcustom_sluice_queue_wait_ms_count 7\n\
             envoy_wasmcustom_sluice_queue_wait_ms_bucket{le=\"1\"} 2\n\
             envoy_cluster_upstream_rq_total{envoy_cluster_name=\"model_servers\"} 11\n",
        );
        assert_eq!(s.get("sluice_stock"), Some(3.0));
        assert_eq!(s.get("sluice_queue_wait_ms_count"), Some(7.0));
        assert_eq!(s.get("upstream_rq_total"), Some(11.0));
        assert_eq!(s.get("stock"), Some(3.0));
        assert_eq!(s.get("luice_stock"), None);
        assert_eq!(s.value("sluice_queue_length"), 0.0);
    }
}
