//! The comparison's tables (per run and per row of pickers), its goals and its figure.

use super::*;

/// The comparison table in Markdown.
pub fn markdown_table(results: &[RunResult]) -> String {
    let mut t = Table::new().left("trace").right("load").right("seed").left("pool").left("picker").left("ok/sent");
    for c in ["TTFT p50 ms", "TTFT p99 ms", "TPOT p50 ms", "TPOT p99 ms", "out tok/s", "prefix hit", "preempted"] {
        t = t.right(c);
    }
    let mut t = t.left("per backend").left("to dead after death");
    for r in results {
        let dead = if r.pool.contains("dies") {
            format!("{} (last +{:.0} ms)", r.sent_to_dead, r.last_to_dead_ms)
        } else {
            "-".into()
        };
        t.row([
            r.trace.clone(),
            format!("{:.1}", r.load),
            r.seed.to_string(),
            r.pool.clone(),
            r.picker.to_string(),
            format!("{}/{}", r.ok, r.requests),
            format!("{:.0}", r.ttft_ms.p50),
            format!("{:.0}", r.ttft_ms.p99),
            format!("{:.1}", r.tpot_ms.p50),
            format!("{:.1}", r.tpot_ms.p99),
            format!("{:.0}", r.output_tokens_per_s),
            format!("{:.1}%", r.prefix_hit_rate * 100.0),
            r.preempted.to_string(),
            per_backend(r),
            dead,
        ]);
    }
    t.markdown()
}

/// Requests each backend got, `a/b/c`.
fn per_backend(r: &RunResult) -> String {
    r.per_backend.iter().map(|n| n.to_string()).collect::<Vec<_>>().join("/")
}

/// The comparison table as CSV (one row per run).
pub fn csv(results: &[RunResult]) -> String {
    let mut t = Table::with_columns([
        "trace",
        "load",
        "seed",
        "pool",
        "picker",
        "requests",
        "ok",
        "failed",
        "unfinished",
        "ttft_p50_ms",
        "ttft_p99_ms",
        "tpot_p50_ms",
        "tpot_p99_ms",
        "output_tokens_per_s",
        "requests_per_s",
        "prefix_hit_rate",
        "preempted",
        "per_backend",
        "imbalance",
        "sent_to_dead",
        "last_to_dead_ms",
        "final_stock",
        "wall_s",
    ]);
    for r in results {
        t.row([
            r.trace.clone(),
            r.load.to_string(),
            r.seed.to_string(),
            r.pool.clone(),
            r.picker.to_string(),
            r.requests.to_string(),
            r.ok.to_string(),
            r.failed.to_string(),
            r.unfinished.to_string(),
            r.ttft_ms.p50.to_string(),
            r.ttft_ms.p99.to_string(),
            r.tpot_ms.p50.to_string(),
            r.tpot_ms.p99.to_string(),
            format!("{:.3}", r.output_tokens_per_s),
            format!("{:.4}", r.requests_per_s),
            format!("{:.4}", r.prefix_hit_rate),
            r.preempted.to_string(),
            per_backend(r),
            format!("{:.3}", r.imbalance),
            r.sent_to_dead.to_string(),
            r.last_to_dead_ms.to_string(),
            r.final_stock.to_string(),
            format!("{:.2}", r.wall_s),
        ]);
    }
    t.csv()
}

/// One row of the comparison: a picker on a trace, load and pool, over the seeds run.
#[derive(Clone, Debug, Serialize)]
pub struct Row {
    /// Trace.
    pub trace: String,
    /// Offered load (fraction of the pool's measured capacity).
    pub load: f64,
    /// Pool name.
    pub pool: String,
    /// Picker.
    pub picker: &'static str,
    /// Seeds (runs) summarized.
    pub seeds: usize,
    /// Requests sent, over all seeds.
    pub requests: usize,
    /// Completed with 2xx, over all seeds.
    pub ok: usize,
    /// Median TTFT, ms, mean over seeds.
    pub ttft_p50_ms: f64,
    /// p99 TTFT, ms, mean over seeds.
    pub ttft_p99_ms: f64,
    /// Lowest p99 TTFT of a seed, ms.
    pub ttft_p99_min_ms: f64,
    /// Highest p99 TTFT of a seed, ms.
    pub ttft_p99_max_ms: f64,
    /// Output tokens per second, mean over seeds.
    pub output_tokens_per_s: f64,
    /// Prefix-cache hit rate, mean over seeds.
    pub prefix_hit_rate: f64,
    /// Imbalance ([`RunResult::imbalance`]), mean over seeds.
    pub imbalance: f64,
    /// Round-robin's p99 TTFT over this row's (mean over seeds; > 1: better than round-robin).
    pub rr_over_p99: Option<f64>,
    /// The oracle's p99 TTFT over this row's on the same traffic (1 = the physical limit;
    /// 0.1: ten times the oracle's p99), when the oracle ran.
    pub oracle_over_p99: Option<f64>,
    /// The oracle's prefix hit rate on the same traffic, when it ran.
    pub oracle_prefix_hit_rate: Option<f64>,
}

/// Rows of the comparison: runs grouped by (trace, load, pool, picker) in first-seen order,
/// each with its spread over seeds and its ratio to round-robin on the same traffic.
pub fn rows(results: &[RunResult]) -> Vec<Row> {
    let mut keys: Vec<(String, u64, String, &'static str)> = Vec::new();
    for r in results {
        let k = (r.trace.clone(), r.load.to_bits(), r.pool.clone(), r.picker);
        if !keys.contains(&k) {
            keys.push(k);
        }
    }
    let mut out: Vec<Row> = keys
        .iter()
        .map(|(trace, load, pool, picker)| {
            let runs: Vec<&RunResult> = results
                .iter()
                .filter(|r| &r.trace == trace && r.load.to_bits() == *load && &r.pool == pool && r.picker == *picker)
                .collect();
            let mean = |f: fn(&RunResult) -> f64| runs.iter().map(|r| f(r)).sum::<f64>() / runs.len().max(1) as f64;
            let p99s = runs.iter().map(|r| r.ttft_ms.p99);
            Row {
                trace: trace.clone(),
                load: f64::from_bits(*load),
                pool: pool.clone(),
                picker,
                seeds: runs.len(),
                requests: runs.iter().map(|r| r.requests).sum(),
                ok: runs.iter().map(|r| r.ok).sum(),
                ttft_p50_ms: mean(|r| r.ttft_ms.p50),
                ttft_p99_ms: mean(|r| r.ttft_ms.p99),
                ttft_p99_min_ms: p99s.clone().fold(f64::INFINITY, f64::min),
                ttft_p99_max_ms: p99s.fold(0.0, f64::max),
                output_tokens_per_s: mean(|r| r.output_tokens_per_s),
                prefix_hit_rate: mean(|r| r.prefix_hit_rate),
                imbalance: mean(|r| r.imbalance),
                rr_over_p99: None,
                oracle_over_p99: None,
                oracle_prefix_hit_rate: None,
            }
        })
        .collect();
    let same = |a: &Row, b: &Row| a.trace == b.trace && a.load == b.load && a.pool == b.pool;
    let rr: Vec<(String, f64, String, f64)> = out
        .iter()
        .filter(|r| r.picker == PickerKind::RoundRobin.name())
        .map(|r| (r.trace.clone(), r.load, r.pool.clone(), r.ttft_p99_ms))
        .collect();
    let oracle: Vec<Row> = out.iter().filter(|r| r.picker == PickerKind::Oracle.name()).cloned().collect();
    for row in &mut out {
        row.rr_over_p99 = rr
            .iter()
            .find(|(t, l, p, _)| *t == row.trace && *l == row.load && *p == row.pool)
            .map(|(_, _, _, p99)| p99 / row.ttft_p99_ms.max(1e-9));
        if let Some(o) = oracle.iter().find(|o| same(o, row)) {
            row.oracle_over_p99 = Some(o.ttft_p99_ms / row.ttft_p99_ms.max(1e-9));
            row.oracle_prefix_hit_rate = Some(o.prefix_hit_rate);
        }
    }
    out
}

/// The default routing against the oracle, one line per row where both ran: the hit-rate gap
/// in points and the p99 ratio, with the bounds (within 10 points and 1.25×).
pub fn oracle_gaps(rows: &[Row]) -> Vec<String> {
    rows.iter()
        .filter(|r| r.picker == PickerKind::KvAware.name())
        .filter_map(|r| {
            let (over, hit) = (r.oracle_over_p99?, r.oracle_prefix_hit_rate?);
            let points = (hit - r.prefix_hit_rate) * 100.0;
            let ratio = 1.0 / over.max(1e-9);
            let within = points <= 10.0 && ratio <= 1.25;
            Some(format!(
                "{} at load {:.1} on {}: kv-aware hit {:.1}% vs oracle {:.1}% ({points:+.1} points), p99 {:.2}x the oracle's: {}",
                r.trace,
                r.load,
                r.pool,
                r.prefix_hit_rate * 100.0,
                hit * 100.0,
                ratio,
                if within { "within the issue's bounds" } else { "outside the issue's bounds (10 points, 1.25x)" }
            ))
        })
        .collect()
}

/// The rows in Markdown: p50 and p99 TTFT (p99's min–max over seeds), throughput, prefix hit
/// rate, imbalance and the ratio to round-robin.
pub fn rows_table(rows: &[Row]) -> String {
    let mut t = Table::new().left("trace").right("load").left("pool").left("picker").left("ok/sent");
    for c in
        ["TTFT p50 ms", "TTFT p99 ms (min–max over seeds)", "round-robin p99 ÷ this", "oracle p99 ÷ this", "out tok/s"]
    {
        t = t.right(c);
    }
    let mut t = t.right("prefix hit").right("oracle hit").right("imbalance");
    for r in rows {
        t.row([
            r.trace.clone(),
            format!("{:.1}", r.load),
            r.pool.clone(),
            r.picker.to_string(),
            format!("{}/{}", r.ok, r.requests),
            format!("{:.0}", r.ttft_p50_ms),
            format!("{:.0} ({:.0}–{:.0})", r.ttft_p99_ms, r.ttft_p99_min_ms, r.ttft_p99_max_ms),
            opt(r.rr_over_p99, "-", |x| format!("{x:.2}×")),
            opt(r.oracle_over_p99, "-", |x| format!("{x:.2}×")),
            format!("{:.0}", r.output_tokens_per_s),
            format!("{:.1}%", r.prefix_hit_rate * 100.0),
            opt(r.oracle_prefix_hit_rate, "-", |x| format!("{:.1}%", x * 100.0)),
            format!("{:.2}", r.imbalance),
        ]);
    }
    t.markdown()
}

/// The rows as CSV.
pub fn rows_csv(rows: &[Row]) -> String {
    let mut t = Table::with_columns([
        "trace",
        "load",
        "pool",
        "picker",
        "seeds",
        "requests",
        "ok",
        "ttft_p50_ms",
        "ttft_p99_ms",
        "ttft_p99_min_ms",
        "ttft_p99_max_ms",
        "rr_over_p99",
        "oracle_over_p99",
        "output_tokens_per_s",
        "prefix_hit_rate",
        "oracle_prefix_hit_rate",
        "imbalance",
    ]);
    for r in rows {
        t.row([
            r.trace.clone(),
            r.load.to_string(),
            r.pool.clone(),
            r.picker.to_string(),
            r.seeds.to_string(),
            r.requests.to_string(),
            r.ok.to_string(),
            format!("{:.1}", r.ttft_p50_ms),
            format!("{:.1}", r.ttft_p99_ms),
            format!("{:.1}", r.ttft_p99_min_ms),
            format!("{:.1}", r.ttft_p99_max_ms),
            opt(r.rr_over_p99, "", |x| format!("{x:.3}")),
            opt(r.oracle_over_p99, "", |x| format!("{x:.3}")),
            format!("{:.1}", r.output_tokens_per_s),
            format!("{:.4}", r.prefix_hit_rate),
            opt(r.oracle_prefix_hit_rate, "", |x| format!("{x:.4}")),
            format!("{:.3}", r.imbalance),
        ]);
    }
    t.csv()
}

/// The goal checked on the rows: the default (`kv-aware`) routing's p99 TTFT is never
/// above least-request's, and at the highest load of each trace and pool it is at least 1.5×
/// better than round-robin's. Returns one line per check that fails (empty: the goal holds)
/// and the number of checks made.
pub fn goal_failures(rows: &[Row]) -> (Vec<String>, usize) {
    let (mut fails, mut checks) = (Vec::new(), 0);
    let kv = PickerKind::KvAware.name();
    for r in rows.iter().filter(|r| r.picker == kv) {
        let same = |p: PickerKind| {
            rows.iter().find(|x| x.trace == r.trace && x.load == r.load && x.pool == r.pool && x.picker == p.name())
        };
        if let Some(lr) = same(PickerKind::LeastRequest) {
            checks += 1;
            if r.ttft_p99_ms > lr.ttft_p99_ms {
                fails.push(format!(
                    "{} at load {:.1} on {}: kv-aware p99 {:.0} ms > least-request {:.0} ms ({:.2}×)",
                    r.trace,
                    r.load,
                    r.pool,
                    r.ttft_p99_ms,
                    lr.ttft_p99_ms,
                    r.ttft_p99_ms / lr.ttft_p99_ms.max(1e-9)
                ));
            }
        }
        let top = rows
            .iter()
            .filter(|x| x.trace == r.trace && x.pool == r.pool)
            .map(|x| x.load)
            .fold(f64::NEG_INFINITY, f64::max);
        if let (true, Some(ratio)) = (r.load == top, r.rr_over_p99) {
            checks += 1;
            if ratio < 1.5 {
                fails.push(format!(
                    "{} at load {:.1} on {}: round-robin p99 ÷ kv-aware p99 = {ratio:.2}× < 1.5×",
                    r.trace, r.load, r.pool
                ));
            }
        }
    }
    (fails, checks)
}

const COLORS: [&str; 6] = ["#9e9e9e", "#f28e2b", "#4e79a7", "#59a14f", "#e15759", "#b07aa1"];

/// A figure: one panel per (trace, load, pool) with each picker's p99 TTFT (mean over seeds,
/// a whisker from the lowest to the highest seed), two panels a line.
pub fn svg(rows: &[Row]) -> String {
    let mut groups: Vec<(String, u64, String)> = Vec::new();
    for r in rows {
        let g = (r.trace.clone(), r.load.to_bits(), r.pool.clone());
        if !groups.contains(&g) {
            groups.push(g);
        }
    }
    let pickers: Vec<&str> = PickerKind::ALL.iter().map(|p| p.name()).collect();
    let (panel_w, panel_h, top) = (320.0, 150.0, 40.0);
    let width = 40.0 + 2.0 * (panel_w + 40.0);
    let height = top + groups.len().div_ceil(2) as f64 * (panel_h + 40.0) + 10.0;
    let mut s = format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{width}\" height=\"{height}\" font-family=\"sans-serif\" font-size=\"11\">\n\
         <rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n<text x=\"40\" y=\"32\">p99 TTFT (s), mean over seeds, whisker: min–max</text>\n"
    );
    for (k, p) in pickers.iter().enumerate() {
        let x = 40.0 + k as f64 * 110.0;
        let _ = writeln!(
            s,
            "<rect x=\"{x}\" y=\"8\" width=\"12\" height=\"12\" fill=\"{}\"/><text x=\"{}\" y=\"18\">{p}</text>",
            COLORS[k],
            x + 16.0
        );
    }
    for (gi, (trace, load, pool)) in groups.iter().enumerate() {
        let x0 = 40.0 + (gi % 2) as f64 * (panel_w + 40.0);
        let y0 = top + (gi / 2) as f64 * (panel_h + 40.0);
        let here: Vec<&Row> =
            rows.iter().filter(|r| &r.trace == trace && r.load.to_bits() == *load && &r.pool == pool).collect();
        let max = here.iter().map(|r| r.ttft_p99_max_ms).fold(0.0f64, f64::max).max(1e-9);
        let _ = writeln!(
            s,
            "<text x=\"{x0}\" y=\"{}\" font-weight=\"bold\">{trace}, load {:.1}, {pool}</text>\n<line x1=\"{x0}\" y1=\"{}\" x2=\"{}\" y2=\"{}\" stroke=\"black\"/>",
            y0 + 14.0,
            f64::from_bits(*load),
            y0 + panel_h,
            x0 + panel_w,
            y0 + panel_h
        );
        let bw = panel_w / (pickers.len() as f64 * 1.5);
        let scale = |v: f64| (v / max) * (panel_h - 40.0);
        for r in &here {
            let Some(k) = pickers.iter().position(|p| *p == r.picker) else {
                continue;
            };
            let (h, lo, hi) = (scale(r.ttft_p99_ms), scale(r.ttft_p99_min_ms), scale(r.ttft_p99_max_ms));
            let x = x0 + 10.0 + k as f64 * bw * 1.5;
            let cx = x + bw / 2.0;
            let _ = writeln!(
                s,
                "<rect x=\"{x:.1}\" y=\"{:.1}\" width=\"{bw:.1}\" height=\"{h:.1}\" fill=\"{}\"/>\
                 <line x1=\"{cx:.1}\" y1=\"{:.1}\" x2=\"{cx:.1}\" y2=\"{:.1}\" stroke=\"black\"/>\
                 <text x=\"{cx:.1}\" y=\"{:.1}\" text-anchor=\"middle\">{:.1}</text>",
                y0 + panel_h - h,
                COLORS[k],
                y0 + panel_h - lo,
                y0 + panel_h - hi,
                y0 + panel_h - hi - 3.0,
                r.ttft_p99_ms / 1000.0
            );
        }
    }
    s.push_str("</svg>\n");
    s
}
