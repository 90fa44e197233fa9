//! SVG figures of the simulator's runs, drawn with `plotters` (its SVG backend only): line
//! charts over time, CDFs and grouped bars, each with ticked axes, gridlines, units and a
//! legend beside the plot.
//!
//! The ticks are computed here ([`Scale`]), not by plotters, so that they are round numbers a
//! reader can use and so that tests can pin them. A chart draws at most [`MAX_NAMED`] series in
//! colour with a legend entry; the rest are drawn thin and grey under one entry, since 27
//! coloured lines cannot be told apart. Output depends only on the inputs (no clock, no hash
//! order), so figures are byte-identical across runs.

use plotters::coord::ranged1d::{DefaultFormatting, KeyPointHint, Ranged};
use plotters::coord::Shift;
use plotters::prelude::*;
use std::collections::BTreeMap;

/// Width of a figure, px.
pub const WIDTH: u32 = 960;
/// Height of a one-panel figure, px.
pub const HEIGHT: u32 = 480;
/// Series drawn in colour with their own legend entry; any more are drawn faint.
pub const MAX_NAMED: usize = 8;
/// Width of the legend strip right of the plot, px.
const LEGEND_W: u32 = 190;
/// Tableau 10's first eight: distinct in print and for the common colour blindnesses.
const PALETTE: [RGBColor; MAX_NAMED] = [
    RGBColor(0x4e, 0x79, 0xa7),
    RGBColor(0xf2, 0x8e, 0x2b),
    RGBColor(0xe1, 0x57, 0x59),
    RGBColor(0x76, 0xb7, 0xb2),
    RGBColor(0x59, 0xa1, 0x4f),
    RGBColor(0xed, 0xc9, 0x48),
    RGBColor(0xb0, 0x7a, 0xa1),
    RGBColor(0x9c, 0x75, 0x5f),
];
const FAINT: RGBColor = RGBColor(0xc8, 0xc8, 0xc8);
const FONT: &str = "sans-serif";

/// An axis: its range and the values that get a tick, a label and a gridline.
#[derive(Clone, Debug, PartialEq)]
pub struct Scale {
    /// Lowest value shown.
    pub lo: f64,
    /// Highest value shown.
    pub hi: f64,
    /// Logarithmic (base 10): for spreads of two decades and more, such as TTFT under FCFS
    /// beside TTFT under a fair policy.
    pub log: bool,
    /// Tick values, ascending, within `lo..=hi`.
    pub ticks: Vec<f64>,
}

impl Scale {
    /// A linear axis covering `lo..hi`, widened to whole steps of a nice size (1, 2, 2.5 or 5
    /// × 10^k) so that about `n` ticks fall on round numbers and the ends carry a tick.
    pub fn linear(lo: f64, hi: f64, n: usize) -> Scale {
        let (lo, hi) = if hi > lo { (lo, hi) } else { (lo, lo + 1.0) };
        let step = nice_step((hi - lo) / n.max(1) as f64);
        let (lo, hi) = (clean((lo / step).floor() * step), clean((hi / step).ceil() * step));
        let count = ((hi - lo) / step).round() as usize;
        let ticks = (0..=count).map(|k| clean(lo + k as f64 * step)).collect();
        Scale { lo, hi, log: false, ticks }
    }

    /// A log axis from the decade at or below `lo` to the decade at or above `hi` (both > 0),
    /// ticks at 1, 2 and 5 × 10^k over up to three decades, else at the decades alone.
    pub fn log(lo: f64, hi: f64) -> Scale {
        let a = lo.max(f64::MIN_POSITIVE).log10().floor() as i32;
        let b = (hi.max(lo).log10().ceil() as i32).max(a + 1);
        let mults: &[f64] = if b - a <= 3 { &[1.0, 2.0, 5.0] } else { &[1.0] };
        let mut ticks = Vec::new();
        for e in a..=b {
            for m in mults {
                let v = clean(m * 10f64.powi(e));
                if e < b || *m == 1.0 {
                    ticks.push(v);
                }
            }
        }
        Scale { lo: clean(10f64.powi(a)), hi: clean(10f64.powi(b)), log: true, ticks }
    }

    /// Linear from 0, or log when the positive values span more than two decades.
    pub fn auto(values: impl Iterator<Item = f64> + Clone, n: usize) -> Scale {
        let hi = values.clone().fold(0.0f64, f64::max);
        let lo = values.filter(|v| *v > 0.0).fold(f64::INFINITY, f64::min);
        if lo.is_finite() && hi / lo > 100.0 {
            Scale::log(lo, hi)
        } else {
            Scale::linear(0.0, hi, n)
        }
    }

    /// Where `v` sits on the (linear) plotting axis.
    fn pos(&self, v: f64) -> f64 {
        if self.log {
            v.clamp(self.lo, self.hi).log10()
        } else {
            v
        }
    }

    fn coord(&self) -> Axis {
        Axis { lo: self.pos(self.lo), hi: self.pos(self.hi), ticks: self.ticks.iter().map(|t| self.pos(*t)).collect() }
    }

    fn label(&self, p: f64) -> String {
        fmt_tick(if self.log { 10f64.powf(p) } else { p })
    }
}

/// A [`Scale`] as plotters sees it: a linear axis (log scales arrive as log10 values) whose
/// ticks are ours. plotters' own `with_key_points` wrapper loses the f64 axis's label
/// formatter, so the chart could not take a mesh; this carries the default one instead.
struct Axis {
    lo: f64,
    hi: f64,
    ticks: Vec<f64>,
}

impl Ranged for Axis {
    type FormatOption = DefaultFormatting;
    type ValueType = f64;

    fn map(&self, v: &f64, limit: (i32, i32)) -> i32 {
        let f = if self.hi > self.lo { (v - self.lo) / (self.hi - self.lo) } else { 0.5 };
        limit.0 + ((limit.1 - limit.0) as f64 * f).round() as i32
    }

    fn key_points<H: KeyPointHint>(&self, hint: H) -> Vec<f64> {
        // Light points would draw a second, finer grid; the ticks' grid is enough.
        if hint.weight().allow_light_points() {
            Vec::new()
        } else {
            self.ticks.clone()
        }
    }

    fn range(&self) -> std::ops::Range<f64> {
        self.lo..self.hi
    }
}

/// The smallest step of 1, 2, 2.5 or 5 × 10^k that is at least `raw`.
pub fn nice_step(raw: f64) -> f64 {
    if !(raw > 0.0 && raw.is_finite()) {
        return 1.0;
    }
    let mag = 10f64.powf(raw.log10().floor());
    [1.0, 2.0, 2.5, 5.0, 10.0].iter().map(|m| m * mag).find(|s| *s >= raw * (1.0 - 1e-9)).unwrap_or(10.0 * mag)
}

/// Rounds away the float noise of `k · step` (0.30000000000000004).
fn clean(v: f64) -> f64 {
    let p = 10f64.powi(9 - v.abs().max(1e-300).log10().floor().clamp(-300.0, 300.0) as i32);
    if p.is_finite() && p > 0.0 {
        (v * p).round() / p
    } else {
        v
    }
}

/// A tick label: up to three decimals without trailing zeros, 10,000 and over as `k`,
/// a million and over as `M`.
pub fn fmt_tick(v: f64) -> String {
    let a = v.abs();
    let (x, suffix) = if a >= 1e6 {
        (v / 1e6, "M")
    } else if a >= 1e4 {
        (v / 1e3, "k")
    } else {
        (v, "")
    };
    let mut s = format!("{x:.3}");
    if s.contains('.') {
        s = s.trim_end_matches('0').trim_end_matches('.').to_string();
    }
    if s == "-0" {
        s = "0".into();
    }
    s + suffix
}

/// Which series get a colour, in legend order: those in `highlight` first (in its order, so
/// that a caller can give policies the same colours in every figure), then the others, by
/// name while all fit, else the largest by mean value (ties by name) up to [`MAX_NAMED`].
pub fn named_series<'a>(series: &'a BTreeMap<String, Vec<(f64, f64)>>, highlight: &[String]) -> Vec<&'a str> {
    let mut out: Vec<&str> =
        highlight.iter().filter_map(|h| series.get_key_value(h).map(|(k, _)| k.as_str())).take(MAX_NAMED).collect();
    out.dedup();
    let mean = |v: &[(f64, f64)]| v.iter().map(|p| p.1).sum::<f64>() / v.len().max(1) as f64;
    let mut rest: Vec<(&str, f64)> =
        series.iter().filter(|(k, _)| !out.contains(&k.as_str())).map(|(k, v)| (k.as_str(), mean(v))).collect();
    if series.len() > MAX_NAMED {
        rest.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(b.0)));
    }
    out.extend(rest.into_iter().map(|(k, _)| k).take(MAX_NAMED - out.len()));
    out
}

type Area<'a> = DrawingArea<SVGBackend<'a>, Shift>;

/// Draws `body` into a `WIDTH`-wide SVG of `height` px with a title, and a legend right of
/// it: `(name, colour)` entries, then `others` grey ones counted in one entry.
fn figure(
    title: &str,
    height: u32,
    legend: &[(String, RGBColor)],
    others: usize,
    body: impl FnOnce(&Area) -> Result<(), String>,
) -> String {
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (WIDTH, height)).into_drawing_area();
        let draw = || -> Result<(), String> {
            root.fill(&WHITE).map_err(|e| e.to_string())?;
            let root = root.titled(title, (FONT, 22)).map_err(|e| e.to_string())?;
            let (plot, side) = root.split_horizontally(WIDTH - LEGEND_W);
            body(&plot)?;
            let mut entries: Vec<(String, RGBColor)> = legend.to_vec();
            if others > 0 {
                entries.push((format!("{others} others"), FAINT));
            }
            for (k, (name, color)) in entries.iter().enumerate() {
                let y = 40 + 18 * k as i32;
                side.draw(&PathElement::new(vec![(4, y), (24, y)], color.stroke_width(3)))
                    .map_err(|e| e.to_string())?;
                let label = if name.chars().count() > 24 {
                    format!("{}…", name.chars().take(23).collect::<String>())
                } else {
                    name.clone()
                };
                side.draw(&Text::new(label, (30, y - 7), (FONT, 16))).map_err(|e| e.to_string())?;
            }
            root.present().map_err(|e| e.to_string())
        };
        if let Err(e) = draw() {
            // Drawing into a String cannot fail short of a plotters bug; say so in the figure.
            return format!("<svg xmlns=\"http://www.w3.org/2000/svg\"><text y=\"20\">plot failed: {e}</text></svg>\n");
        }
    }
    svg
}

/// Sets up one panel: ticked axes, gridlines at the ticks, axis titles (which carry the units).
fn panel<'a, 'b>(
    area: &'a Area<'b>,
    caption: Option<&str>,
    x: &Scale,
    y: &Scale,
    x_desc: &str,
    y_desc: &str,
    x_label: &dyn Fn(f64) -> String,
    x_grid: bool,
) -> Result<ChartContext<'a, SVGBackend<'b>, Cartesian2d<Axis, Axis>>, String> {
    let mut b = ChartBuilder::on(area);
    b.margin(10).x_label_area_size(45).y_label_area_size(70);
    if let Some(c) = caption {
        b.caption(c, (FONT, 14));
    }
    let mut chart = b.build_cartesian_2d(x.coord(), y.coord()).map_err(|e| e.to_string())?;
    let y_label = |p: &f64| y.label(*p);
    let x_fmt = |p: &f64| x_label(*p);
    let mut mesh = chart.configure_mesh();
    if !x_grid {
        mesh.disable_x_mesh();
    }
    mesh.x_desc(x_desc)
        .y_desc(y_desc)
        .axis_desc_style((FONT, 17))
        .label_style((FONT, 15))
        .bold_line_style(BLACK.mix(0.12))
        .light_line_style(TRANSPARENT)
        .max_light_lines(0)
        .x_label_formatter(&x_fmt)
        .y_label_formatter(&y_label)
        .set_all_tick_mark_size(5)
        .draw()
        .map_err(|e| e.to_string())?;
    Ok(chart)
}

/// A line chart of `series` (name → (x, y) points), x and y axes titled with their units.
/// More than [`MAX_NAMED`] series: see [`named_series`].
pub fn lines_svg(
    title: &str,
    x_desc: &str,
    y_desc: &str,
    series: &BTreeMap<String, Vec<(f64, f64)>>,
    highlight: &[String],
) -> String {
    let pts = || series.values().flatten();
    // x spans the data (a load axis from 0.8 wastes half the plot); y starts at 0 so that
    // heights compare.
    let (x_lo, x_hi) = pts().fold((f64::INFINITY, f64::NEG_INFINITY), |(l, h), p| (l.min(p.0), h.max(p.0)));
    let x = if x_lo <= x_hi { Scale::linear(x_lo, x_hi, 10) } else { Scale::linear(0.0, 1.0, 10) };
    let y = Scale::linear(pts().map(|p| p.1).fold(0.0, f64::min), pts().map(|p| p.1).fold(0.0, f64::max), 8);
    lines_on(title, &x, &y, x_desc, y_desc, series, highlight)
}

fn lines_on(
    title: &str,
    x: &Scale,
    y: &Scale,
    x_desc: &str,
    y_desc: &str,
    series: &BTreeMap<String, Vec<(f64, f64)>>,
    highlight: &[String],
) -> String {
    let named = named_series(series, highlight);
    let legend: Vec<(String, RGBColor)> =
        named.iter().enumerate().map(|(k, n)| (n.to_string(), PALETTE[k % PALETTE.len()])).collect();
    figure(title, HEIGHT, &legend, series.len() - named.len(), |area| {
        let mut chart = panel(area, None, x, y, x_desc, y_desc, &|p| x.label(p), true)?;
        let line = |v: &Vec<(f64, f64)>| -> Vec<(f64, f64)> { v.iter().map(|(a, b)| (x.pos(*a), y.pos(*b))).collect() };
        // Faint ones first, so that the coloured lines are drawn over them.
        for (k, v) in series.iter().filter(|(k, _)| !named.contains(&k.as_str())) {
            let _ = k;
            chart.draw_series(LineSeries::new(line(v), FAINT.stroke_width(1))).map_err(|e| e.to_string())?;
        }
        for (n, color) in named.iter().zip(legend.iter().map(|l| l.1)) {
            chart.draw_series(LineSeries::new(line(&series[*n]), color.stroke_width(2))).map_err(|e| e.to_string())?;
        }
        Ok(())
    })
}

/// Points of the empirical CDF of `v` in percent, at most `steps` + 1 of them (quantiles
/// 0, 1/steps, …, 1 by nearest rank), so that a figure of 10,000 requests stays small.
pub fn cdf_points(v: &[f64], steps: usize) -> Vec<(f64, f64)> {
    let mut v: Vec<f64> = v.iter().copied().filter(|x| x.is_finite()).collect();
    if v.is_empty() {
        return Vec::new();
    }
    v.sort_by(f64::total_cmp);
    let n = v.len();
    let steps = steps.clamp(1, n);
    (0..=steps)
        .map(|k| {
            let q = k as f64 / steps as f64;
            let i = ((q * n as f64).ceil() as usize).clamp(1, n) - 1;
            (v[i], clean(100.0 * (i + 1) as f64 / n as f64))
        })
        .collect()
}

/// The CDF of a latency per group (policy, client class): x the latency (log when the groups
/// span more than two decades), y the percentage of requests at or under it.
pub fn cdf_svg(title: &str, x_desc: &str, samples: &BTreeMap<String, Vec<f64>>, highlight: &[String]) -> String {
    let series: BTreeMap<String, Vec<(f64, f64)>> =
        samples.iter().filter(|(_, v)| !v.is_empty()).map(|(k, v)| (k.clone(), cdf_points(v, 200))).collect();
    let x = Scale::auto(series.values().flatten().map(|p| p.0), 10);
    let y = Scale::linear(0.0, 100.0, 10);
    lines_on(title, &x, &y, x_desc, "requests at or under it (%)", &series, highlight)
}

/// One panel of a bar chart: an axis title with its unit and, per series, a value per category.
#[derive(Clone, Debug)]
pub struct BarPanel {
    /// The y axis title, with its unit.
    pub y_desc: String,
    /// (series name, one value per category).
    pub series: Vec<(String, Vec<f64>)>,
}

/// Grouped bars, one panel under the other (small multiples sharing the categories): per
/// category (a tenant), a bar per series (a policy). Series beyond [`MAX_NAMED`] are dropped,
/// since bars cannot be drawn faint; callers pick the series that matter.
pub fn bars_svg(title: &str, x_desc: &str, categories: &[String], panels: &[BarPanel]) -> String {
    let names: Vec<String> = panels.first().map_or(Vec::new(), |p| p.series.iter().map(|s| s.0.clone()).collect());
    let shown = names.len().min(MAX_NAMED);
    let legend: Vec<(String, RGBColor)> =
        names.iter().take(shown).enumerate().map(|(k, n)| (n.clone(), PALETTE[k])).collect();
    let n = categories.len().max(1);
    let x = Scale { lo: -0.5, hi: n as f64 - 0.5, log: false, ticks: (0..n).map(|i| i as f64).collect() };
    // Many categories sharing a prefix (client-00 … client-26) are labelled by what differs,
    // the prefix said once in the axis title, so that the labels fit under their bars.
    let prefix = if n > 10 { common_prefix(categories) } else { "" };
    let x_desc = if prefix.is_empty() { x_desc.to_string() } else { format!("{x_desc} ({prefix}…)") };
    let cat =
        |p: f64| categories.get(p.round().max(0.0) as usize).map_or(String::new(), |c| c[prefix.len()..].to_string());
    let height = 60 + 300 * panels.len().max(1) as u32;
    figure(title, height, &legend, 0, |area| {
        for (panel_area, p) in area.split_evenly((panels.len().max(1), 1)).iter().zip(panels) {
            let top = p.series.iter().take(shown).flat_map(|s| s.1.iter().copied()).fold(0.0, f64::max);
            let y = Scale::linear(0.0, top, 6);
            let mut chart = panel(panel_area, None, &x, &y, &x_desc, &p.y_desc, &cat, false)?;
            let width = 0.8 / shown.max(1) as f64;
            for (k, (_, values)) in p.series.iter().take(shown).enumerate() {
                let color = PALETTE[k];
                chart
                    .draw_series(values.iter().enumerate().map(|(i, v)| {
                        let x0 = i as f64 - 0.4 + k as f64 * width;
                        Rectangle::new([(x0, 0.0), (x0 + width * 0.9, y.pos(*v))], color.filled())
                    }))
                    .map_err(|e| e.to_string())?;
            }
        }
        Ok(())
    })
}

/// The longest prefix all of `names` share, cut after its last non-alphanumeric character
/// (`client-1` and `client-2` share `client-`, not `client-1`… of `client-10`, `client-11`).
fn common_prefix(names: &[String]) -> &str {
    let Some(first) = names.first() else { return "" };
    let mut len = first.len();
    for n in names {
        len = len.min(first.bytes().zip(n.bytes()).take_while(|(a, b)| a == b).count());
    }
    let p = &first[..len];
    p.rfind(|c: char| !c.is_ascii_alphanumeric()).map_or("", |i| &p[..=i])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nice_steps_are_one_two_two_and_a_half_or_five() {
        assert_eq!(nice_step(0.7), 1.0);
        assert_eq!(nice_step(1.0), 1.0);
        assert_eq!(nice_step(1.3), 2.0);
        assert_eq!(nice_step(2.2), 2.5);
        assert_eq!(nice_step(3.0), 5.0);
        assert_eq!(nice_step(7.0), 10.0);
        assert_eq!(nice_step(0.03), 0.05);
        assert_eq!(nice_step(1234.0), 2000.0);
        assert_eq!(nice_step(0.0), 1.0);
    }

    #[test]
    fn linear_scale_ends_on_round_ticks() {
        let s = Scale::linear(0.0, 973.0, 10);
        assert_eq!((s.lo, s.hi), (0.0, 1000.0));
        assert_eq!(s.ticks, (0..=10).map(|k| k as f64 * 100.0).collect::<Vec<_>>());
        let s = Scale::linear(0.0, 0.7, 7);
        assert_eq!(s.ticks, vec![0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7], "no 0.30000000000000004");
        let s = Scale::linear(0.0, 0.0, 5);
        assert_eq!((s.lo, s.hi), (0.0, 1.0), "an empty range still draws");
    }

    #[test]
    fn log_scale_covers_whole_decades() {
        let s = Scale::log(0.3, 48.0);
        assert_eq!((s.lo, s.hi), (0.1, 100.0));
        assert_eq!(s.ticks, vec![0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0]);
        let s = Scale::log(0.03, 48.0);
        assert_eq!(s.ticks, vec![0.01, 0.1, 1.0, 10.0, 100.0], "four decades: decades only");
        let wide = Scale::log(0.001, 1e5);
        assert_eq!(wide.ticks, vec![0.001, 0.01, 0.1, 1.0, 10.0, 100.0, 1000.0, 10000.0, 100000.0]);
        assert!(Scale::auto([0.5, 80.0].into_iter(), 10).log);
        assert!(!Scale::auto([0.5, 40.0].into_iter(), 10).log);
    }

    #[test]
    fn tick_labels_are_short() {
        assert_eq!(fmt_tick(0.0), "0");
        assert_eq!(fmt_tick(2.5), "2.5");
        assert_eq!(fmt_tick(0.1 + 0.2), "0.3");
        assert_eq!(fmt_tick(5000.0), "5000");
        assert_eq!(fmt_tick(12500.0), "12.5k");
        assert_eq!(fmt_tick(2_000_000.0), "2M");
        assert_eq!(fmt_tick(-0.0001), "0");
    }

    #[test]
    fn common_prefix_stops_at_a_separator() {
        let v: Vec<String> = ["client-10", "client-11", "client-2"].iter().map(|s| s.to_string()).collect();
        assert_eq!(common_prefix(&v), "client-");
        assert_eq!(common_prefix(&["ab".to_string(), "ac".to_string()]), "");
        assert_eq!(common_prefix(&[]), "");
    }

    #[test]
    fn cdf_points_are_nearest_rank_percentiles() {
        let v: Vec<f64> = (1..=10).rev().map(f64::from).collect();
        let p = cdf_points(&v, 5);
        assert_eq!(p, vec![(1.0, 10.0), (2.0, 20.0), (4.0, 40.0), (6.0, 60.0), (8.0, 80.0), (10.0, 100.0)]);
        assert_eq!(cdf_points(&[3.0], 200), vec![(3.0, 100.0), (3.0, 100.0)]);
        assert!(cdf_points(&[], 10).is_empty());
    }

    fn many(n: usize) -> BTreeMap<String, Vec<(f64, f64)>> {
        (0..n).map(|i| (format!("c{i:02}"), vec![(0.0, i as f64), (10.0, i as f64 + 1.0)])).collect()
    }

    #[test]
    fn at_most_max_named_series_get_a_colour() {
        let s = many(27);
        let named = named_series(&s, &["c03".to_string(), "nope".to_string()]);
        assert_eq!(named.len(), MAX_NAMED);
        assert_eq!(named[0], "c03", "highlighted first");
        assert_eq!(&named[1..3], &["c26", "c25"], "then the largest");
        assert_eq!(named_series(&many(3), &[]), vec!["c00", "c01", "c02"]);
        assert_eq!(named_series(&many(3), &["c02".to_string()]), vec!["c02", "c00", "c01"], "the caller's order");
    }

    #[test]
    fn figures_have_ticks_units_and_legend_and_are_deterministic() {
        let s = many(27);
        // plotters writes each text on a line of its own.
        let text = |svg: &str, t: &str| svg.contains(&format!(">\n{t}\n<"));
        let a = lines_svg("t", "time (s)", "rate (units/s)", &s, &[]);
        assert_eq!(a, lines_svg("t", "time (s)", "rate (units/s)", &s, &[]));
        assert!(a.starts_with("<svg") && text(&a, "time (s)") && text(&a, "rate (units/s)"), "{a}");
        assert!(text(&a, "19 others") && text(&a, "c26") && !text(&a, "c00"), "one legend entry for the faint series");
        assert!(text(&a, "30") && text(&a, "25") && text(&a, "10"), "tick labels on both axes: {a}");
        let c = cdf_svg("cdf", "TTFT (s)", &BTreeMap::from([("fcfs".to_string(), vec![0.05, 1.0, 40.0])]), &[]);
        assert!(text(&c, "0.01") && text(&c, "100") && text(&c, "TTFT (s)"), "log axis: {c}");
        let b = bars_svg(
            "bars",
            "client",
            &["a".into(), "b".into()],
            &[BarPanel { y_desc: "service (units)".into(), series: vec![("vtc".into(), vec![1.0, 2.0])] }],
        );
        assert!(text(&b, "a") && text(&b, "b") && text(&b, "service (units)") && b.contains("<rect"), "{b}");
    }
}
