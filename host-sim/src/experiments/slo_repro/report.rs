//! The SLO reproductions' tables (QLM per trace, PARD), CSVs and figures.

use super::*;

fn pct(x: f64) -> String {
    format!("{:.1}", 100.0 * x)
}

fn secs(ms: f64) -> String {
    format!("{:.2}", ms / 1000.0)
}

fn estimator_cells(m: &SloMetrics) -> [String; 3] {
    let e = &m.estimator;
    if e.n == 0 {
        ["-".into(), "-".into(), "-".into()]
    } else {
        [e.n.to_string(), secs(e.mae_ms), pct(e.within_20pct)]
    }
}

/// A note on a run that did not run, as a Markdown cell (a `|` would end it).
fn skipped_cell(r: &SloRow) -> String {
    format!("skipped: {}", r.skipped.as_deref().unwrap_or("-").replace('|', "/"))
}

/// The estimator's three right-aligned columns, last in both tables.
fn with_estimator_columns(t: Table) -> Table {
    t.right("pred n").right("pred MAE s").right("pred ±20%")
}

/// The QLM-style table of one trace: every configuration at every load, with the attainment
/// gain over `reference` in points and the throughput ratio to it at the same load.
pub fn qlm_markdown(rows: &[SloRow], reference: &str, classes: &[SloClass]) -> String {
    let mut t = Table::new().right("load").right("req/s").left("config").right("attain %");
    for c in classes {
        t = t.right(format!("{} %", c.name));
    }
    t = t.right(format!("vs {reference} (pts)")).right("goodput req/s").right("thru req/s");
    t = t.right(format!("thru ×{reference}")).right("out tok/s").right("dropped %").right("expired %");
    let mut t = with_estimator_columns(t.right("TTFT p50 s").right("TTFT p99 s"));
    for r in rows {
        let (load, rate) = (format!("{:.1}", r.load), format!("{:.2}", r.rate_rps));
        let Some(m) = &r.metrics else {
            t.row([load, rate, r.config.clone(), skipped_cell(r)]);
            continue;
        };
        let reference =
            rows.iter().find(|x| x.load == r.load && x.config == reference).and_then(|x| x.metrics.as_ref());
        let (gain, ratio) = match reference {
            Some(f) => (
                format!("{:+.1}", 100.0 * (m.attainment - f.attainment)),
                format!("{:.3}", m.throughput_rps / f.throughput_rps.max(1e-9)),
            ),
            None => ("-".into(), "-".into()),
        };
        let mut cells = vec![load, rate, r.config.clone(), pct(m.attainment)];
        cells.extend(m.classes.iter().map(|c| pct(c.attainment)));
        cells.extend([
            gain,
            format!("{:.3}", m.goodput_rps),
            format!("{:.3}", m.throughput_rps),
            ratio,
            format!("{:.0}", m.output_tok_s),
            pct(m.rate(m.dropped)),
            pct(m.rate(m.expired)),
            secs(m.ttft_ms.p50),
            secs(m.ttft_ms.p99),
        ]);
        cells.extend(estimator_cells(m));
        t.row(cells);
    }
    t.markdown()
}

/// The PARD-style table: goodput, drop and expiry rates of every configuration, and the goodput
/// gain of `proactive` over each.
pub fn pard_markdown(rows: &[SloRow], proactive: &str) -> String {
    let mut t = Table::new().left("config");
    for c in ["attain %", "goodput req/s", "goodput in bursts req/s", "gain of proactive %", "dropped %"] {
        t = t.right(c);
    }
    let mut t =
        with_estimator_columns(t.right("expired %").right("thru req/s").right("TTFT p50 s").right("TTFT p99 s"));
    let subject = rows.iter().find(|r| r.config == proactive).and_then(|r| r.metrics.as_ref());
    for r in rows {
        let Some(m) = &r.metrics else {
            t.row([r.config.clone(), skipped_cell(r)]);
            continue;
        };
        let gain = match subject {
            Some(p) if r.config != proactive && m.goodput_rps > 0.0 => {
                format!("{:+.1}", 100.0 * (p.goodput_rps / m.goodput_rps - 1.0))
            }
            _ => "-".into(),
        };
        let mut cells = vec![
            r.config.clone(),
            pct(m.attainment),
            format!("{:.3}", m.goodput_rps),
            opt(r.burst_goodput_rps, "-", |g| format!("{g:.3}")),
            gain,
            pct(m.rate(m.dropped)),
            pct(m.rate(m.expired)),
            format!("{:.3}", m.throughput_rps),
            secs(m.ttft_ms.p50),
            secs(m.ttft_ms.p99),
        ];
        cells.extend(estimator_cells(m));
        t.row(cells);
    }
    t.markdown()
}

/// CSV of rows (QLM and PARD alike; per-class attainment as `class:attainment` pairs).
pub fn rows_csv(rows: &[SloRow]) -> String {
    let mut t = Table::with_columns([
        "trace",
        "load",
        "rate_rps",
        "config",
        "skipped",
        "requests",
        "met",
        "attainment",
        "class_attainment",
        "goodput_rps",
        "burst_goodput_rps",
        "completed",
        "throughput_rps",
        "output_tok_s",
        "dropped",
        "expired",
        "other_failed",
        "unfinished",
        "ttft_p50_ms",
        "ttft_p99_ms",
        "pred_n",
        "pred_mae_ms",
        "pred_within_20pct",
        "wall_s",
    ]);
    for r in rows {
        let m = r.metrics.clone().unwrap_or_default();
        let classes: Vec<String> = m.classes.iter().map(|c| format!("{}:{:.4}", c.class, c.attainment)).collect();
        t.row([
            r.trace.to_string(),
            r.load.to_string(),
            format!("{:.4}", r.rate_rps),
            r.config.clone(),
            r.skipped.clone().unwrap_or_default(),
            m.requests.to_string(),
            m.met.to_string(),
            format!("{:.4}", m.attainment),
            classes.join(" "),
            format!("{:.4}", m.goodput_rps),
            opt(r.burst_goodput_rps, "", |g| format!("{g:.4}")),
            m.completed.to_string(),
            format!("{:.4}", m.throughput_rps),
            format!("{:.1}", m.output_tok_s),
            m.dropped.to_string(),
            m.expired.to_string(),
            m.other_failed.to_string(),
            m.unfinished.to_string(),
            format!("{:.1}", m.ttft_ms.p50),
            format!("{:.1}", m.ttft_ms.p99),
            m.estimator.n.to_string(),
            format!("{:.1}", m.estimator.mae_ms),
            format!("{:.4}", m.estimator.within_20pct),
            format!("{:.2}", r.wall_s),
        ]);
    }
    t.csv()
}

/// Per-request CSV of one run: class, objective, outcome, TTFT and the filter's prediction.
pub fn records_csv(records: &[RequestRecord], objectives: &[Objective], classes: &[SloClass]) -> String {
    let mut t = Table::with_columns([
        "id",
        "client",
        "class",
        "objective_ms",
        "arrival_us",
        "status",
        "outcome",
        "reason",
        "ttft_ms",
        "predicted_ttft_ms",
        "met",
    ]);
    for (r, o) in records.iter().zip(objectives) {
        t.row([
            r.id.to_string(),
            r.client.clone(),
            classes.get(o.class).map_or("", |c| c.name.as_str()).to_string(),
            o.ttft_ms.to_string(),
            r.arrival_us.to_string(),
            r.status.to_string(),
            r.outcome.to_string(),
            r.reason.clone().unwrap_or_default(),
            opt(r.ttft_ms(), "", |v| format!("{v:.1}")),
            r.upstream_header(PREDICTED_TTFT_HEADER).unwrap_or("").to_string(),
            met(r, o).to_string(),
        ]);
    }
    t.csv()
}

/// SVG of a metric against load, one line per configuration (rows of one trace).
pub fn by_load_svg(title: &str, y_label: &str, rows: &[SloRow], y: impl Fn(&SloMetrics) -> f64) -> String {
    let mut series: BTreeMap<String, Vec<(f64, f64)>> = BTreeMap::new();
    for r in rows {
        if let Some(m) = &r.metrics {
            series.entry(r.config.clone()).or_default().push((r.load, y(m)));
        }
    }
    for v in series.values_mut() {
        v.sort_by(|a, b| a.0.total_cmp(&b.0));
    }
    plot::lines_svg(title, "load (× capacity)", y_label, &series, &[])
}
