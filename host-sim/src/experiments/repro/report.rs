//! The reproductions' results as the seed shows them: Table 2, per-client tables and the figures.

use super::*;

/// Markdown table in the form of the seed's Table 2.
pub fn table2_markdown(title: &str, rows: &[Table2Row]) -> String {
    let mut t = Table::new().left("Scheduler");
    for c in ["Max Diff", "Avg Diff", "Diff Var", "Throu (tok/s)", "Out tok/s", "Acc diff max"] {
        t = t.right(c);
    }
    t = t.right("Light-client TTFT (s)").right("Failed").right("Unfinished").right("Makespan (s)");
    for r in rows {
        t.row([
            r.scheduler.clone(),
            format!("{:.2}", r.max_diff),
            format!("{:.2}", r.avg_diff),
            format!("{:.2}", r.diff_var),
            format!("{:.0}", r.throughput),
            format!("{:.0}", r.output_tok_s),
            opt(r.acc_diff_max, "-", |v| format!("{v:.0}")),
            opt(r.light_ttft_s, "-", |v| format!("{v:.2}")),
            r.failed.to_string(),
            r.unfinished.to_string(),
            format!("{:.1}", r.makespan_s),
        ]);
    }
    format!("### {title}\n\n{}", t.markdown())
}

/// CSV of Table 2 rows (one header line).
pub fn table2_csv(workload: &str, rows: &[Table2Row]) -> String {
    let mut t = Table::with_columns([
        "workload",
        "scheduler",
        "max_diff",
        "avg_diff",
        "diff_var",
        "throughput_tok_s",
        "output_tok_s",
        "acc_diff_max",
        "light_ttft_s",
        "failed",
        "unfinished",
        "makespan_s",
    ]);
    for r in rows {
        t.row([
            workload.to_string(),
            r.scheduler.clone(),
            r.max_diff.to_string(),
            r.avg_diff.to_string(),
            r.diff_var.to_string(),
            r.throughput.to_string(),
            r.output_tok_s.to_string(),
            opt(r.acc_diff_max, "", |v| v.to_string()),
            opt(r.light_ttft_s, "", |v| v.to_string()),
            r.failed.to_string(),
            r.unfinished.to_string(),
            r.makespan_s.to_string(),
        ]);
    }
    t.csv()
}

/// Per-client table of one workload: service received within the trace and its share, TTFT.
pub fn clients_markdown(w: &ReproWorkload, results: &[&CaseResult]) -> String {
    let mut t = Table::new().left("Scheduler").left("Client");
    for c in ["Requests", "Completed", "Service in trace", "Share", "Mean TTFT (s)", "p90 TTFT (s)"] {
        t = t.right(c);
    }
    let span = w.span_s();
    let clients = if w.clients().len() > 8 { w.plotted_clients.clone() } else { w.clients() };
    for c in results {
        let total: f64 = w.clients().iter().map(|k| service_between(c, k, 0.0, span)).sum();
        for k in &clients {
            let cr = c.report.clients.get(k).cloned().unwrap_or_default();
            let got = service_between(c, k, 0.0, span);
            t.row([
                c.policy.clone(),
                k.clone(),
                cr.requests.to_string(),
                cr.ok.to_string(),
                format!("{got:.0}"),
                format!("{:.3}", if total > 0.0 { got / total } else { 0.0 }),
                format!("{:.2}", cr.ttft_ms.mean / 1000.0),
                format!("{:.2}", cr.ttft_ms.p90 / 1000.0),
            ]);
        }
    }
    t.markdown()
}

/// The clients a workload's figures draw in colour: its chosen ones, or all when none chosen.
fn figure_clients(w: &ReproWorkload) -> Vec<String> {
    if w.plotted_clients.is_empty() {
        w.clients()
    } else {
        w.plotted_clients.clone()
    }
}

/// SVG figures of one case: service rate (the report's) and response time per client.
pub fn case_svgs(w: &ReproWorkload, c: &CaseResult) -> (String, String) {
    let clients = figure_clients(w);
    let rt = response_time_series(&c.records, &clients);
    let rt_svg = plot::lines_svg(
        &format!("{}: response time (mean TTFT, ±30 s window), {}", w.name, c.policy),
        "time (s)",
        "response time (s)",
        &rt,
        &clients,
    );
    (c.report.service_rate_svg(&clients), rt_svg)
}

/// SVG of the accumulated service difference over time, one line per policy.
pub fn acc_diff_svg(w: &ReproWorkload, results: &[&CaseResult]) -> String {
    let span = w.span_s();
    let series = results
        .iter()
        .map(|c| (c.policy.clone(), c.acc_diff.iter().copied().filter(|(t, _)| *t <= span).collect()))
        .collect();
    plot::lines_svg(
        &format!("{}: absolute difference of accumulated service", w.name),
        "time (s)",
        "accumulated service difference (service units)",
        &series,
        &[],
    )
}

/// SVG of the CDF of TTFT per policy, over all completed requests of the workload.
pub fn ttft_cdf_svg(w: &ReproWorkload, results: &[&CaseResult]) -> String {
    let samples = results
        .iter()
        .map(|c| {
            (
                c.policy.clone(),
                c.records
                    .iter()
                    .filter(|r| r.outcome == "ok")
                    .filter_map(|r| r.ttft_ms())
                    .map(|t| t / 1000.0)
                    .collect(),
            )
        })
        .collect();
    let order: Vec<String> = results.iter().map(|c| c.policy.clone()).collect();
    plot::cdf_svg(
        &format!("{}: TTFT per policy (completed requests)", w.name),
        "time to first token (s)",
        &samples,
        &order,
    )
}

/// SVG of bars per client (the workload's figure clients) and policy: share of the service
/// within the trace, and mean TTFT.
pub fn clients_svg(w: &ReproWorkload, results: &[&CaseResult]) -> String {
    let clients = figure_clients(w);
    let span = w.span_s();
    let share = |c: &CaseResult, k: &String| {
        let total: f64 = w.clients().iter().map(|k| service_between(c, k, 0.0, span)).sum();
        if total > 0.0 {
            100.0 * service_between(c, k, 0.0, span) / total
        } else {
            0.0
        }
    };
    let ttft = |c: &CaseResult, k: &String| c.report.clients.get(k).map_or(0.0, |r| r.ttft_ms.mean / 1000.0);
    let series = |f: &dyn Fn(&CaseResult, &String) -> f64| -> Vec<(String, Vec<f64>)> {
        results.iter().map(|c| (c.policy.clone(), clients.iter().map(|k| f(c, k)).collect())).collect()
    };
    plot::bars_svg(
        &format!("{}: service share and TTFT per client", w.name),
        "client",
        &clients,
        &[
            plot::BarPanel { y_desc: "share of service in trace (%)".into(), series: series(&share) },
            plot::BarPanel { y_desc: "mean TTFT (s)".into(), series: series(&ttft) },
        ],
    )
}
