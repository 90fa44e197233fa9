//! The criticality-bands scenario: critical, standard and sheddable clients through one
//! overloaded GPU, per policy.

use super::*;

/// Results of the bands scenario for one policy.
#[derive(Clone, Debug, serde::Serialize)]
pub struct BandRow {
    /// Policy label.
    pub scheduler: String,
    /// Band name.
    pub band: String,
    /// Requests sent.
    pub requests: usize,
    /// Completed.
    pub completed: usize,
    /// Evicted from the queue (429 `evicted`).
    pub evicted: usize,
    /// Refused at arrival (429 `rejected-saturated` and other rejects).
    pub rejected: usize,
    /// Mean TTFT of completed requests, s.
    pub mean_ttft_s: f64,
    /// Max over the trace of the accumulated service difference between this band's flows
    /// (models), service units; 0 with one flow.
    pub flow_acc_diff_max: f64,
    /// Service received per flow (model) within the trace.
    pub flow_service: BTreeMap<String, f64>,
}

/// One client of the bands scenario: its model (flow), band and arrival process.
#[derive(Clone, Debug)]
pub struct BandClient {
    /// Model, also the flow (tenant header value).
    pub model: String,
    /// `critical`, `standard` or `sheddable`.
    pub band: String,
    /// Poisson rate, req/s.
    pub rate: f64,
    /// Prompt tokens.
    pub prompt: u32,
    /// Output tokens.
    pub output: u32,
}

/// The mixed workload of the bands scenario: an interactive critical model, two standard
/// models that together overload the GPU, and a sheddable batch model. The two standard
/// flows have the same input:output ratio, so WFQ's size (tokens) and VTC's service
/// (w_p·input + w_q·output) agree on what a fair split is.
pub fn band_clients() -> Vec<BandClient> {
    let c = |model: &str, band: &str, rate, prompt, output| BandClient {
        model: model.into(),
        band: band.into(),
        rate,
        prompt,
        output,
    };
    vec![
        c("chat", "critical", 0.3, 128, 64),
        c("chat", "standard", 1.6, 128, 128),
        c("code", "standard", 0.7, 384, 384),
        c("summarize", "sheddable", 1.0, 1024, 64),
    ]
}

/// Capacity settings of the bands scenario: a small queue so that it fills.
pub const BANDS_TOTAL_CAPACITY: usize = 48;
/// Queue slots per flow (model): fair queuing needs each flow its own share of the buffer,
/// or the flow that arrives more often fills the shared queue and loses fewer requests.
pub const BANDS_FLOW_CAPACITY: usize = 16;
/// Slots reserved for critical requests.
pub const BANDS_CRITICAL_RESERVE: usize = 8;

/// Runs the bands scenario (WFQ or another policy across models, bands by a trusted header)
/// for `duration_s`; returns the per-band rows and the raw case.
pub fn run_bands(
    wasm: &[u8],
    policy: &PolicyCase,
    duration_s: f64,
    opts: &ReproOptions,
) -> Result<(Vec<BandRow>, CaseResult)> {
    let t0 = std::time::Instant::now();
    let clients = band_clients();
    let label = |b: &BandClient| format!("{}/{}", b.band, b.model);
    let synth: Vec<SyntheticClient> = clients
        .iter()
        .map(|b| SyntheticClient {
            name: label(b),
            rate: b.rate,
            prompt_tokens: b.prompt,
            output_tokens: b.output,
            lengths: Default::default(),
            arrival: Arrival::Poisson,
            model: Some(b.model.clone()),
            max_tokens: opts.max_tokens,
        })
        .collect();
    let items = workload::synthetic(&synth, duration_s, opts.seed).map_err(|e| anyhow::anyhow!(e))?;
    let config = json!({
        "policy": policy.policy,
        "watermark_per_backend": 16,
        "learned_limit": null,
        "queue_ttl_ms": NO_TTL_MS,
        "total_capacity": BANDS_TOTAL_CAPACITY,
        "flow_capacity": BANDS_FLOW_CAPACITY,
        "critical_reserve": BANDS_CRITICAL_RESERVE,
        "criticality_header": CRITICALITY_HEADER,
    });
    let sc = scenario(config, None, opts)?;
    let mut sim = sc.build(wasm, &[])?;
    for (i, w) in items.iter().enumerate() {
        let b = clients.iter().find(|b| label(b) == w.client).expect("known client");
        // The flow is the model: the tenant header carries it; the band comes from the
        // trusted header an upstream filter would set.
        let mut r = ClientRequest::chat(
            i as u64,
            w.arrival_us,
            TENANT_HEADER,
            &b.model,
            &b.model,
            w.prompt_tokens,
            w.output_tokens,
        )
        .with_max_tokens(w.max_tokens);
        r.client = w.client.clone();
        r.headers.push((CRITICALITY_HEADER.into(), b.band.clone().into_bytes()));
        sim.add_request(r);
    }
    sim.run();
    let report = sc.report(&sim);
    let records = sim.records();
    let w = ReproWorkload::new("bands", "bands", items, vec![policy.clone()]);
    let case = finish(&w, policy, sim, report, records, t0);
    let span = w.span_s();
    let mut rows = Vec::new();
    for band in ["critical", "standard", "sheddable"] {
        let recs: Vec<&RequestRecord> =
            case.records.iter().filter(|r| r.client.starts_with(&format!("{band}/"))).collect();
        let ok: Vec<&&RequestRecord> = recs.iter().filter(|r| r.outcome == "ok").collect();
        let evicted = recs.iter().filter(|r| r.reason.as_deref() == Some("evicted")).count();
        let flows: Vec<String> = clients.iter().filter(|b| b.band == band).map(label).collect();
        let flow_service: BTreeMap<String, f64> =
            flows.iter().map(|f| (f.clone(), service_between(&case, f, 0.0, span))).collect();
        let sub: BTreeMap<String, Vec<u64>> =
            case.buckets.iter().filter(|(k, _)| flows.contains(k)).map(|(k, v)| (k.clone(), v.clone())).collect();
        let acc = if flows.len() > 1 {
            acc_diff_series(&sub).iter().filter(|(t, _)| *t <= span).map(|(_, v)| *v).fold(0.0, f64::max)
        } else {
            0.0
        };
        let ttft: Vec<f64> = ok.iter().filter_map(|r| r.ttft_ms()).collect();
        rows.push(BandRow {
            scheduler: policy.label.clone(),
            band: band.into(),
            requests: recs.len(),
            completed: ok.len(),
            evicted,
            rejected: recs.len() - ok.len() - evicted,
            mean_ttft_s: round2(ttft.iter().sum::<f64>() / ttft.len().max(1) as f64 / 1000.0),
            flow_acc_diff_max: acc,
            flow_service,
        });
    }
    Ok((rows, case))
}

/// The cells both bands tables open with: who, which band, and where its requests ended.
fn band_counts(r: &BandRow) -> Vec<String> {
    let counts = [r.requests, r.completed, r.evicted, r.rejected];
    [r.scheduler.clone(), r.band.clone()].into_iter().chain(counts.iter().map(|n| n.to_string())).collect()
}

/// Markdown table of the bands scenario.
pub fn bands_markdown(rows: &[BandRow]) -> String {
    let mut t = Table::new().left("Scheduler").left("Band");
    for c in ["Requests", "Completed", "Evicted", "Rejected", "Mean TTFT (s)", "Flow acc diff max"] {
        t = t.right(c);
    }
    t = t.left("Service per flow");
    for r in rows {
        let flows: Vec<String> = r.flow_service.iter().map(|(k, v)| format!("{k}: {v:.0}")).collect();
        let mut cells = band_counts(r);
        cells.extend([format!("{:.2}", r.mean_ttft_s), format!("{:.0}", r.flow_acc_diff_max), flows.join(", ")]);
        t.row(cells);
    }
    t.markdown()
}

/// CSV of the bands scenario.
pub fn bands_csv(rows: &[BandRow]) -> String {
    let mut t = Table::with_columns([
        "scheduler",
        "band",
        "requests",
        "completed",
        "evicted",
        "rejected",
        "mean_ttft_s",
        "flow_acc_diff_max",
    ]);
    for r in rows {
        let mut cells = band_counts(r);
        cells.extend([r.mean_ttft_s.to_string(), r.flow_acc_diff_max.to_string()]);
        t.row(cells);
    }
    t.csv()
}
