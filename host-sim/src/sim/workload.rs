//! Workloads: seeded synthetic arrivals and replay of the trace formats in `host-sim/traces`.
//! Every generator is a pure function of its inputs and seed.

use crate::sim::engine::ClientRequest;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::Deserialize;
use std::fmt;

/// One request of a workload, before it becomes HTTP.
#[derive(Clone, Debug, PartialEq)]
pub struct WorkItem {
    /// Arrival, µs from the start.
    pub arrival_us: u64,
    /// Client / tenant.
    pub client: String,
    /// Prompt tokens.
    pub prompt_tokens: u32,
    /// Output tokens: where the model stops on its own (the trace's output).
    pub output_tokens: u32,
    /// `max_tokens` the client sends (`None`: the field is absent); see [`MaxTokens`]. A cap
    /// under `output_tokens` cuts the answer there.
    pub max_tokens: Option<u32>,
    /// Prefix-block hashes (Mooncake `hash_ids`).
    pub prefix_hashes: Vec<u64>,
    /// Model asked for (default: the scenario's).
    pub model: Option<String>,
    /// Extra request headers (name, value): what a trusted upstream filter would have set,
    /// such as a request's SLO. Empty for every generator and trace format here.
    pub headers: Vec<(String, String)>,
}

/// A synthetic client: an arrival process and a length distribution.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SyntheticClient {
    /// Client name (sent in the tenant header).
    pub name: String,
    /// Mean requests per second (for `ramp`, the rate at the start).
    pub rate: f64,
    /// Prompt tokens per request (the mean, when `lengths` varies them).
    pub prompt_tokens: u32,
    /// Output tokens per request (the mean, when `lengths` varies them).
    pub output_tokens: u32,
    /// How lengths vary around those means; fixed when absent.
    #[serde(default)]
    pub lengths: Lengths,
    /// Arrival process; Poisson when absent.
    #[serde(default)]
    pub arrival: Arrival,
    /// `model` of this client's requests (default: the scenario's).
    #[serde(default)]
    pub model: Option<String>,
    /// How this client sets `max_tokens` (default: it sends none).
    #[serde(default)]
    pub max_tokens: MaxTokens,
}

/// How a client sets `max_tokens` in its requests. In JSON and on command lines: `"absent"`,
/// `"oracle"`, a number (a fixed cap) or `{"multiple": f, "spread": s}`
/// (`"multiple:f:s"` on a command line).
///
/// The default is `absent`, which is what the evidence says real chat traffic mostly sends:
/// see docs/simulator.md, "What clients send as `max_tokens`".
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub enum MaxTokens {
    /// No `max_tokens` field.
    #[default]
    Absent,
    /// Exactly the output the request will produce: a client that knows the future, as load
    /// generators that replay a trace do (kept to compare against).
    Oracle,
    /// The same cap on every request (a client's configured limit, e.g. 4096).
    Fixed(u32),
    /// The real output times `factor`, times a uniform draw in `[1 − spread, 1 + spread]`,
    /// rounded and at least 1: a client that knows roughly how long its answers are.
    Multiple {
        /// Mean cap over real output.
        factor: f64,
        /// Relative half-width of the draw, in `[0, 1)`.
        spread: f64,
    },
}

impl MaxTokens {
    /// Reads a setting from its JSON form; errors name `field`.
    pub fn from_json(v: &serde_json::Value, field: &str) -> Result<MaxTokens, String> {
        use serde_json::Value;
        let m = match v {
            Value::String(s) => return MaxTokens::from_text(s, field),
            Value::Number(n) => match n.as_u64().and_then(|n| u32::try_from(n).ok()) {
                Some(n) => MaxTokens::Fixed(n),
                None => return Err(format!("{field} must be a whole number of tokens >= 1, got {n}")),
            },
            Value::Object(o) => {
                if let Some(k) = o.keys().find(|k| !matches!(k.as_str(), "multiple" | "spread")) {
                    return Err(format!("{field}: unknown field `{k}` (expected `multiple`, `spread`)"));
                }
                let num = |k: &str, default: Option<f64>| match o.get(k) {
                    Some(x) => x.as_f64().ok_or_else(|| format!("{field}.{k} must be a number, got {x}")),
                    None => default.ok_or_else(|| format!("{field}.{k} is required")),
                };
                MaxTokens::Multiple { factor: num("multiple", None)?, spread: num("spread", Some(0.0))? }
            }
            other => return Err(format!(
                "{field} must be \"absent\", \"oracle\", a number or {{\"multiple\": f, \"spread\": s}}, got {other}"
            )),
        };
        m.validate(field)?;
        Ok(m)
    }

    /// Checks ranges; errors name `field`.
    pub fn validate(&self, field: &str) -> Result<(), String> {
        match *self {
            MaxTokens::Fixed(0) => Err(format!("{field} must be >= 1 (absent is \"absent\")")),
            MaxTokens::Multiple { factor, spread } => {
                positive(format!("{field}.multiple"), factor)?;
                if !(0.0..1.0).contains(&spread) {
                    return Err(format!("{field}.spread must be in [0, 1), got {spread}"));
                }
                Ok(())
            }
            _ => Ok(()),
        }
    }

    /// The cap sent with a request whose answer is `output` tokens long (`multiple` draws its
    /// spread from `rng`).
    pub fn draw(&self, rng: &mut ChaCha8Rng, output: u32) -> Option<u32> {
        match *self {
            MaxTokens::Absent => None,
            MaxTokens::Oracle => Some(output),
            MaxTokens::Fixed(n) => Some(n),
            MaxTokens::Multiple { factor, spread } => {
                let x = output as f64 * factor * (1.0 - spread + 2.0 * spread * rng.random::<f64>());
                Some(x.round().clamp(1.0, u32::MAX as f64) as u32)
            }
        }
    }

    /// Sets every item's `max_tokens` by this setting, from a stream seeded by `seed` alone (so
    /// the caps never move arrivals or lengths).
    pub fn apply(&self, items: &mut [WorkItem], seed: u64) {
        let mut rng = ChaCha8Rng::seed_from_u64(seed ^ 0x3c6e_f372_fe94_f82b);
        for w in items {
            w.max_tokens = self.draw(&mut rng, w.output_tokens);
        }
    }
}

impl std::str::FromStr for MaxTokens {
    type Err = String;

    /// `absent`, `oracle`, a number, or `multiple:FACTOR[:SPREAD]`.
    fn from_str(s: &str) -> Result<MaxTokens, String> {
        MaxTokens::from_text(s, "max_tokens")
    }
}

impl MaxTokens {
    fn from_text(s: &str, field: &str) -> Result<MaxTokens, String> {
        let bad = || format!("{field} must be absent, oracle, a number or multiple:FACTOR[:SPREAD], got `{s}`");
        let m = match s {
            "absent" => MaxTokens::Absent,
            "oracle" => MaxTokens::Oracle,
            _ => match s.strip_prefix("multiple:") {
                Some(rest) => {
                    let mut it = rest.splitn(2, ':').map(|x| x.parse::<f64>().map_err(|_| bad()));
                    let factor = it.next().ok_or_else(bad)??;
                    MaxTokens::Multiple { factor, spread: it.next().transpose()?.unwrap_or(0.0) }
                }
                None => MaxTokens::Fixed(s.parse().map_err(|_| bad())?),
            },
        };
        m.validate(field)?;
        Ok(m)
    }
}

impl fmt::Display for MaxTokens {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            MaxTokens::Absent => write!(f, "absent"),
            MaxTokens::Oracle => write!(f, "oracle"),
            MaxTokens::Fixed(n) => write!(f, "{n}"),
            MaxTokens::Multiple { factor, spread } => write!(f, "multiple:{factor}:{spread}"),
        }
    }
}

impl serde::Serialize for MaxTokens {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match *self {
            MaxTokens::Fixed(n) => s.serialize_u32(n),
            MaxTokens::Multiple { factor, spread } => {
                serde_json::json!({"multiple": factor, "spread": spread}).serialize(s)
            }
            _ => s.collect_str(self),
        }
    }
}

impl<'de> Deserialize<'de> for MaxTokens {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let v = serde_json::Value::deserialize(d)?;
        MaxTokens::from_json(&v, "max_tokens").map_err(serde::de::Error::custom)
    }
}

/// Inter-arrival process of a synthetic client.
#[derive(Clone, Debug, Default, Deserialize, PartialEq)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum Arrival {
    /// Exponential gaps.
    #[default]
    Poisson,
    /// Gamma gaps with this coefficient of variation (1 = Poisson, > 1 = burstier).
    Gamma {
        /// Coefficient of variation of the gaps.
        cv: f64,
    },
    /// Evenly spaced arrivals, 1/rate apart.
    Uniform,
    /// Poisson arrivals during `on_s`, none during `off_s`, repeating (starting on).
    OnOff {
        /// Length of an on phase, seconds.
        on_s: f64,
        /// Length of an off phase, seconds.
        off_s: f64,
    },
    /// Poisson arrivals whose rate moves linearly from `rate` to `to_rate` over the run.
    Ramp {
        /// Rate at the end of the run.
        to_rate: f64,
    },
}

/// Distribution of a synthetic client's prompt and output lengths, each drawn
/// independently around its mean (`prompt_tokens`, `output_tokens`), at least
/// 1 and at most 16 times the mean.
#[derive(Clone, Copy, Debug, Default, Deserialize, PartialEq)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum Lengths {
    /// Exactly the means.
    #[default]
    Fixed,
    /// Uniform in `[mean·(1 − spread), mean·(1 + spread)]`.
    Uniform {
        /// Relative half-width, in `[0, 1)`.
        spread: f64,
    },
    /// Exponential with the given mean.
    Exponential,
    /// Log-normal with the given mean and coefficient of variation.
    LogNormal {
        /// Standard deviation over mean.
        cv: f64,
    },
}

impl Lengths {
    fn validate(&self, field: String) -> Result<(), String> {
        match *self {
            Lengths::Uniform { spread } if !(0.0..1.0).contains(&spread) => {
                Err(format!("{field}.spread must be in [0, 1), got {spread}"))
            }
            Lengths::LogNormal { cv } => positive(format!("{field}.cv"), cv),
            _ => Ok(()),
        }
    }

    fn draw(&self, rng: &mut ChaCha8Rng, mean: u32) -> u32 {
        let m = mean as f64;
        let x = match *self {
            Lengths::Fixed => return mean,
            Lengths::Uniform { spread } => m * (1.0 - spread + 2.0 * spread * rng.random::<f64>()),
            Lengths::Exponential => -(1.0 - rng.random::<f64>()).ln() * m,
            Lengths::LogNormal { cv } => {
                let sigma2 = (1.0 + cv * cv).ln();
                (m.ln() - sigma2 / 2.0 + sigma2.sqrt() * std_normal(rng)).exp()
            }
        };
        x.round().clamp(1.0, 16.0 * m) as u32
    }
}

/// Kept for scenario files and callers written against the first version.
pub type PoissonClient = SyntheticClient;

fn std_normal(rng: &mut ChaCha8Rng) -> f64 {
    // Box-Muller; 1 - u keeps the logarithm finite.
    let u1: f64 = 1.0 - rng.random::<f64>();
    let u2: f64 = rng.random::<f64>();
    (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()
}

/// Gamma(shape, 1) by Marsaglia and Tsang (boosted for shape < 1).
fn gamma(rng: &mut ChaCha8Rng, shape: f64) -> f64 {
    if shape < 1.0 {
        let u: f64 = 1.0 - rng.random::<f64>();
        return gamma(rng, shape + 1.0) * u.powf(1.0 / shape);
    }
    let d = shape - 1.0 / 3.0;
    let c = 1.0 / (9.0 * d).sqrt();
    loop {
        let x = std_normal(rng);
        let v = (1.0 + c * x).powi(3);
        if v <= 0.0 {
            continue;
        }
        let u: f64 = 1.0 - rng.random::<f64>();
        if u.ln() < 0.5 * x * x + d - d * v + d * v.ln() {
            return d * v;
        }
    }
}

fn exp_gap(rng: &mut ChaCha8Rng, rate: f64) -> f64 {
    -(1.0 - rng.random::<f64>()).ln() / rate
}

fn positive(field: String, v: f64) -> Result<(), String> {
    if v > 0.0 && v.is_finite() {
        Ok(())
    } else {
        Err(format!("{field} must be a positive number, got {v}"))
    }
}

/// Arrivals of every client over `duration_s`, merged in time order (ties by client order).
/// Each client draws from its own stream derived from `seed`, so adding a client does not
/// change the others' arrivals. Errors name the field (`clients[2].arrival.cv`).
pub fn synthetic(clients: &[SyntheticClient], duration_s: f64, seed: u64) -> Result<Vec<WorkItem>, String> {
    positive("duration_s".into(), duration_s)?;
    let mut out = Vec::new();
    for (ci, c) in clients.iter().enumerate() {
        positive(format!("clients[{ci}].rate"), c.rate)?;
        if c.prompt_tokens == 0 || c.output_tokens == 0 {
            return Err(format!("clients[{ci}]: prompt_tokens and output_tokens must be >= 1"));
        }
        match &c.arrival {
            Arrival::Gamma { cv } => positive(format!("clients[{ci}].arrival.cv"), *cv)?,
            Arrival::OnOff { on_s, off_s } => {
                positive(format!("clients[{ci}].arrival.on_s"), *on_s)?;
                if !(*off_s >= 0.0 && off_s.is_finite()) {
                    return Err(format!("clients[{ci}].arrival.off_s must be >= 0"));
                }
            }
            Arrival::Ramp { to_rate } => positive(format!("clients[{ci}].arrival.to_rate"), *to_rate)?,
            Arrival::Poisson | Arrival::Uniform => {}
        }
        c.lengths.validate(format!("clients[{ci}].lengths"))?;
        c.max_tokens.validate(&format!("clients[{ci}].max_tokens"))?;
        // Lengths draw from their own stream, so varying them leaves arrivals as they were.
        let mut len_rng = ChaCha8Rng::seed_from_u64(seed ^ (0xd1b5_4a32_d192_ed03u64.wrapping_mul(ci as u64 + 1)));
        let mut rng = ChaCha8Rng::seed_from_u64(seed ^ (0x9e37_79b9_7f4a_7c15u64.wrapping_mul(ci as u64 + 1)));
        let mut times = Vec::new();
        let mut t = 0.0f64;
        match &c.arrival {
            Arrival::Poisson => loop {
                t += exp_gap(&mut rng, c.rate);
                if t >= duration_s {
                    break;
                }
                times.push(t);
            },
            Arrival::Gamma { cv } => {
                let shape = 1.0 / (cv * cv);
                let scale = 1.0 / (c.rate * shape);
                loop {
                    t += gamma(&mut rng, shape) * scale;
                    if t >= duration_s {
                        break;
                    }
                    times.push(t);
                }
            }
            Arrival::Uniform => {
                let gap = 1.0 / c.rate;
                t = gap;
                while t < duration_s {
                    times.push(t);
                    t += gap;
                }
            }
            Arrival::OnOff { on_s, off_s } => {
                // Poisson in "on time", mapped onto the wall timeline.
                let mut on_time = 0.0;
                loop {
                    on_time += exp_gap(&mut rng, c.rate);
                    let cycles = (on_time / on_s).floor();
                    let at = cycles * (on_s + off_s) + (on_time - cycles * on_s);
                    if at >= duration_s {
                        break;
                    }
                    times.push(at);
                }
            }
            Arrival::Ramp { to_rate } => {
                // Thinning of a Poisson process at the peak rate.
                let peak = c.rate.max(*to_rate);
                loop {
                    t += exp_gap(&mut rng, peak);
                    if t >= duration_s {
                        break;
                    }
                    let r = c.rate + (to_rate - c.rate) * t / duration_s;
                    if rng.random::<f64>() * peak < r {
                        times.push(t);
                    }
                }
            }
        }
        let mut items: Vec<WorkItem> = times
            .into_iter()
            .map(|t| WorkItem {
                arrival_us: (t * 1e6) as u64,
                client: c.name.clone(),
                prompt_tokens: c.lengths.draw(&mut len_rng, c.prompt_tokens),
                output_tokens: c.lengths.draw(&mut len_rng, c.output_tokens),
                max_tokens: None,
                prefix_hashes: Vec::new(),
                model: c.model.clone(),
                headers: Vec::new(),
            })
            .collect();
        c.max_tokens.apply(&mut items, seed.wrapping_add(ci as u64));
        out.extend(items);
    }
    out.sort_by_key(|w| w.arrival_us);
    Ok(out)
}

/// Poisson arrivals for every client, whatever their `arrival` says (the first API).
pub fn poisson(clients: &[SyntheticClient], duration_s: f64, seed: u64) -> Result<Vec<WorkItem>, String> {
    let c: Vec<SyntheticClient> = clients
        .iter()
        .cloned()
        .map(|mut c| {
            c.arrival = Arrival::Poisson;
            c
        })
        .collect();
    synthetic(&c, duration_s, seed)
}

/// Trace file formats.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum TraceFormat {
    /// `arrival_s,client,prompt_tokens,output_tokens` (the VTC artifact's real workload).
    VtcCsv,
    /// `TIMESTAMP,ContextTokens,GeneratedTokens` (Azure LLM inference trace 2023).
    AzureCsv,
    /// JSON lines `{"timestamp": ms, "input_length", "output_length", "hash_ids"}` (Mooncake).
    MooncakeJsonl,
}

/// A bad row of a trace.
#[derive(Clone, Debug, PartialEq)]
pub struct TraceError {
    /// 1-based line number.
    pub line: usize,
    /// What is wrong, naming the field.
    pub message: String,
}

impl fmt::Display for TraceError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "line {}: {}", self.line, self.message)
    }
}

/// Parses a trace. Rows are validated (numbers, non-negative times, lengths >= 1); every bad row
/// is reported with its line number and the whole parse fails if there is any. Arrivals are made
/// relative to the first row and sorted (stable). Azure rows get client `azure`, Mooncake rows
/// `mooncake`: those traces carry no tenant.
pub fn parse_trace(format: TraceFormat, text: &str) -> Result<Vec<WorkItem>, Vec<TraceError>> {
    let mut items = Vec::new();
    let mut errs = Vec::new();
    let mut lines = text.lines().enumerate().map(|(i, l)| (i + 1, l.trim_end_matches('\r')));
    if format != TraceFormat::MooncakeJsonl {
        let expected: &[&str] = match format {
            TraceFormat::VtcCsv => &["arrival_s", "client", "prompt_tokens", "output_tokens"],
            _ => &["TIMESTAMP", "ContextTokens", "GeneratedTokens"],
        };
        match lines.next() {
            Some((_, h)) if h.split(',').map(str::trim).eq(expected.iter().copied()) => {}
            Some((n, h)) => errs
                .push(TraceError { line: n, message: format!("header must be `{}`, found `{h}`", expected.join(",")) }),
            None => errs.push(TraceError { line: 1, message: "empty file: no header".into() }),
        }
    }
    let mut azure_t0: Option<i64> = None;
    for (n, line) in lines {
        if line.trim().is_empty() {
            continue;
        }
        let r = match format {
            TraceFormat::VtcCsv => parse_vtc(line),
            TraceFormat::AzureCsv => parse_azure(line, &mut azure_t0),
            TraceFormat::MooncakeJsonl => parse_mooncake(line),
        };
        match r {
            Ok(w) => items.push(w),
            Err(message) => errs.push(TraceError { line: n, message }),
        }
    }
    if !errs.is_empty() {
        return Err(errs);
    }
    if items.is_empty() {
        return Err(vec![TraceError { line: 1, message: "trace has no requests".into() }]);
    }
    let t0 = items.iter().map(|w| w.arrival_us).min().unwrap_or(0);
    for w in &mut items {
        w.arrival_us -= t0;
    }
    items.sort_by_key(|w| w.arrival_us);
    Ok(items)
}

fn tokens(field: &str, v: &str) -> Result<u32, String> {
    let n: u64 = v.trim().parse().map_err(|_| format!("{field} must be a non-negative integer, found `{v}`"))?;
    if n == 0 {
        return Err(format!("{field} must be >= 1"));
    }
    u32::try_from(n).map_err(|_| format!("{field} is too large: {n}"))
}

fn parse_vtc(line: &str) -> Result<WorkItem, String> {
    let f: Vec<&str> = line.split(',').collect();
    if f.len() != 4 {
        return Err(format!("expected 4 fields, found {}", f.len()));
    }
    let t: f64 = f[0].trim().parse().map_err(|_| format!("arrival_s must be a number, found `{}`", f[0]))?;
    if !(t >= 0.0 && t.is_finite()) {
        return Err(format!("arrival_s must be >= 0, found {t}"));
    }
    let client = f[1].trim();
    if client.is_empty() {
        return Err("client is empty".into());
    }
    Ok(WorkItem {
        arrival_us: (t * 1e6).round() as u64,
        client: client.to_string(),
        prompt_tokens: tokens("prompt_tokens", f[2])?,
        output_tokens: tokens("output_tokens", f[3])?,
        max_tokens: None,
        prefix_hashes: Vec::new(),
        model: None,
        headers: Vec::new(),
    })
}

/// Azure timestamps: `2023-11-16 18:15:46.6805900` (UTC, 100 ns digits).
fn azure_time_us(s: &str) -> Option<i64> {
    let (date, time) = s.trim().split_once(' ')?;
    let mut d = date.split('-').map(|x| x.parse::<i64>().ok());
    let (y, mo, da) = (d.next()??, d.next()??, d.next()??);
    let (hms, frac) = time.split_once('.').unwrap_or((time, "0"));
    let mut t = hms.split(':').map(|x| x.parse::<i64>().ok());
    let (h, mi, se) = (t.next()??, t.next()??, t.next()??);
    if !(1..=12).contains(&mo) || !(1..=31).contains(&da) || h > 23 || mi > 59 || se > 60 {
        return None;
    }
    let frac_digits: String = frac.chars().take(6).collect();
    if !frac_digits.chars().all(|c| c.is_ascii_digit()) {
        return None;
    }
    let us_frac = format!("{frac_digits:0<6}").parse::<i64>().ok()?;
    // Days from civil (Howard Hinnant's algorithm).
    let (yy, mm) = if mo <= 2 { (y - 1, mo + 9) } else { (y, mo - 3) };
    let era = yy.div_euclid(400);
    let yoe = yy - era * 400;
    let doy = (153 * mm + 2) / 5 + da - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    let days = era * 146097 + doe - 719468;
    Some(((days * 86400 + h * 3600 + mi * 60 + se) * 1_000_000) + us_frac)
}

fn parse_azure(line: &str, t0: &mut Option<i64>) -> Result<WorkItem, String> {
    let f: Vec<&str> = line.split(',').collect();
    if f.len() != 3 {
        return Err(format!("expected 3 fields, found {}", f.len()));
    }
    let t = azure_time_us(f[0])
        .ok_or_else(|| format!("TIMESTAMP must look like `2023-11-16 18:15:46.6805900`, found `{}`", f[0]))?;
    let base = *t0.get_or_insert(t);
    // Keep a large fixed offset so rows earlier than the first stay non-negative until rebased.
    let rel = t - base + (1i64 << 40);
    if rel < 0 {
        return Err("TIMESTAMP is out of range".into());
    }
    Ok(WorkItem {
        arrival_us: rel as u64,
        client: "azure".into(),
        prompt_tokens: tokens("ContextTokens", f[1])?,
        output_tokens: tokens("GeneratedTokens", f[2])?,
        max_tokens: None,
        prefix_hashes: Vec::new(),
        model: None,
        headers: Vec::new(),
    })
}

#[derive(Deserialize)]
struct MooncakeRow {
    timestamp: f64,
    input_length: u64,
    output_length: u64,
    #[serde(default)]
    hash_ids: Vec<u64>,
}

fn parse_mooncake(line: &str) -> Result<WorkItem, String> {
    let r: MooncakeRow = serde_json::from_str(line).map_err(|e| format!("invalid row: {e}"))?;
    if !(r.timestamp >= 0.0 && r.timestamp.is_finite()) {
        return Err(format!("timestamp must be >= 0, found {}", r.timestamp));
    }
    Ok(WorkItem {
        arrival_us: (r.timestamp * 1000.0).round() as u64,
        client: "mooncake".into(),
        prompt_tokens: tokens("input_length", &r.input_length.to_string())?,
        output_tokens: tokens("output_length", &r.output_length.to_string())?,
        max_tokens: None,
        prefix_hashes: r.hash_ids,
        model: None,
        headers: Vec::new(),
    })
}

/// How rows that carry no prefix information (Azure, Arena, synthetic clients) share prompt
/// prefixes, as real traffic does: every row belongs to one of `applications`, drawn uniformly
/// by a seeded draw; each application has its own system prompt of `system_prompt_tokens`; a row
/// may continue an earlier conversation of its application, resending that conversation's
/// prompt as its prefix; the rest of every prompt is text unique to the row. The sharing is
/// written into [`WorkItem::prefix_hashes`] (one id per full block of the backends'
/// `prefix_hash_tokens`), which both the GPU model's prefix cache and [`prompt_text`] read, so
/// the filter's prefix hashing sees the same sharing as the GPUs.
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct PrefixSharing {
    /// Applications, each with its own system prompt.
    pub applications: u32,
    /// Tokens of each application's system prompt: a multiple of the backends'
    /// `prefix_hash_tokens` (0 = no system prompt).
    pub system_prompt_tokens: u32,
    /// Add the system prompt to each row's prompt (for traces whose rows count only the user's
    /// turn, such as Arena) instead of carving it out of the row's prompt (Azure's
    /// `ContextTokens` is the whole context). Default false.
    #[serde(default)]
    pub prepend: bool,
    /// Probability in `[0, 1]` that a row continues an earlier conversation of its application
    /// whose prompt fits in its own (default 0).
    #[serde(default)]
    pub follow_up: f64,
}

/// Conversations remembered per application for follow-ups (bounds the search per row).
const CONVERSATIONS_KEPT: usize = 32;

impl PrefixSharing {
    /// Checks the values against the backends' `prefix_hash_tokens`; errors name the field
    /// under `field` (`prefix_sharing.applications`).
    pub fn validate(&self, field: &str, block_tokens: u32) -> Result<(), String> {
        if self.applications == 0 || self.applications > 1_000_000 {
            return Err(format!("{field}.applications must be in 1..=1000000, got {}", self.applications));
        }
        if block_tokens == 0 || !self.system_prompt_tokens.is_multiple_of(block_tokens) {
            return Err(format!(
                "{field}.system_prompt_tokens must be a multiple of the backends' prefix_hash_tokens ({block_tokens}), got {}",
                self.system_prompt_tokens
            ));
        }
        if !(0.0..=1.0).contains(&self.follow_up) {
            return Err(format!("{field}.follow_up must be in [0, 1], got {}", self.follow_up));
        }
        Ok(())
    }

    /// Writes the sharing into the `prefix_hashes` of every row that has none (rows that carry
    /// their own, like Mooncake's, are left as they are) and, with `prepend`, lengthens their
    /// prompts by the system prompt. `block_tokens` is the backends' `prefix_hash_tokens`.
    /// A pure function of the rows, the settings and `seed`.
    pub fn apply(&self, items: &mut [WorkItem], block_tokens: u32, seed: u64) -> Result<(), String> {
        self.validate("prefix_sharing", block_tokens)?;
        let mut rng = ChaCha8Rng::seed_from_u64(seed ^ 0x51a7_e0d5_c0de_b10c);
        let salt = splitmix(seed ^ 0x0a99_1ca7_1095_0000);
        let system_blocks = (self.system_prompt_tokens / block_tokens) as usize;
        let mut conversations: Vec<std::collections::VecDeque<Vec<u64>>> =
            vec![Default::default(); self.applications as usize];
        for (row, w) in items.iter_mut().enumerate() {
            // Two draws per row whatever the settings, so changing one leaves the other as it was.
            let app = rng.random_range(0..self.applications) as usize;
            let follows = rng.random::<f64>() < self.follow_up;
            if !w.prefix_hashes.is_empty() {
                continue;
            }
            if self.prepend {
                w.prompt_tokens = w.prompt_tokens.saturating_add(self.system_prompt_tokens);
            }
            let full = (w.prompt_tokens / block_tokens) as usize;
            let convs = &mut conversations[app];
            let earlier = if follows { convs.iter().position(|c| c.len() <= full) } else { None };
            let mut hashes = match earlier.and_then(|i| convs.remove(i)) {
                Some(history) => history,
                None => (0..system_blocks.min(full))
                    .map(|j| splitmix(salt ^ splitmix((app as u64) << 24 ^ j as u64 ^ 0x5a5)))
                    .collect(),
            };
            let unique = (hashes.len()..full).map(|j| splitmix(salt ^ splitmix((row as u64) << 24 ^ j as u64) ^ 0x0b1));
            hashes.extend(unique);
            convs.push_front(hashes.clone());
            convs.truncate(CONVERSATIONS_KEPT);
            w.prefix_hashes = hashes;
        }
        Ok(())
    }
}

/// The prefix hashes of a client's own shared prefix of `blocks` blocks (scenario
/// `shared_prefix_tokens`): the same for every row of that client, unlike any other client's.
pub fn client_prefix(client: &str, blocks: usize, seed: u64) -> Vec<u64> {
    let base = client.bytes().fold(splitmix(seed ^ 0xc11e_0000_5a5e_d000), |h, b| splitmix(h ^ b as u64));
    (0..blocks).map(|j| splitmix(base ^ (j as u64) << 32 ^ 0x9f1)).collect()
}

/// SplitMix64's finalizer: a well-mixed 64-bit id from any input, deterministic everywhere.
pub(crate) fn splitmix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

/// Appends `n` lowercase letters drawn from a stream seeded by `seed`.
fn letters(seed: u64, n: usize, out: &mut String) {
    let mut s = seed;
    let mut left = n;
    while left > 0 {
        s = splitmix(s);
        for k in 0..8.min(left) {
            out.push((b'a' + ((s >> (k * 8)) as u8 % 26)) as char);
        }
        left -= 8.min(left);
    }
}

/// The prompt text of row `id`: `4 × prompt_tokens` bytes (4 bytes per token, as both the filter
/// and the GPU model count). Block `j` of `4 × block_tokens` bytes is a fixed text derived from
/// `prefix_hashes[j]` alone when there is one (so rows sharing leading ids share that leading
/// text), else text unique to (`id`, `j`).
pub fn prompt_text(item: &WorkItem, id: u64, block_tokens: u32) -> String {
    let block = (block_tokens.max(1) * 4) as usize;
    let total = item.prompt_tokens as usize * 4;
    let mut text = String::with_capacity(total);
    let mut j = 0usize;
    while text.len() < total {
        let n = block.min(total - text.len());
        let seed = match item.prefix_hashes.get(j) {
            Some(&h) => splitmix(h ^ 0x5eed_0000_0000_0001),
            None => splitmix(id.wrapping_mul(0x1_0000_0001) ^ (j as u64) << 40 ^ 0xa2a2),
        };
        letters(seed, n, &mut text);
        j += 1;
    }
    text
}

/// The streaming chat request row `id` becomes: [`prompt_text`] as its one message, the row's
/// `max_tokens` when it has one, usage asked for in the last chunk, the row's headers added, and
/// its `prefix_hashes` passed to the GPU model. Its answer is `output_tokens` long (cut at
/// `max_tokens` if smaller). `model` is used when the row names none.
pub fn chat_request(id: u64, item: &WorkItem, tenant_header: &str, model: &str, block_tokens: u32) -> ClientRequest {
    let model = item.model.as_deref().unwrap_or(model);
    let mut r = ClientRequest::chat(id, item.arrival_us, tenant_header, &item.client, model, 1, item.output_tokens);
    let mut body = serde_json::json!({
        "model": model,
        "messages": [{"role": "user", "content": prompt_text(item, id, block_tokens)}],
        "stream": true,
        "stream_options": {"include_usage": true},
    });
    if let Some(cap) = item.max_tokens {
        body["max_tokens"] = cap.into();
    }
    r.body = serde_json::to_vec(&body).expect("json");
    for (k, v) in &mut r.headers {
        if k == "content-length" {
            *v = r.body.len().to_string().into_bytes();
        }
    }
    r.prompt_tokens = item.prompt_tokens;
    r.prefix_hashes = item.prefix_hashes.clone();
    for (k, v) in &item.headers {
        r.add_header(k, v);
    }
    r
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn poisson_is_seeded_and_rate_shaped() {
        let c = vec![
            SyntheticClient { name: "a".into(), ..client(Arrival::Poisson, 10.0) },
            SyntheticClient { name: "b".into(), ..client(Arrival::Poisson, 1.0) },
        ];
        let w = poisson(&c, 100.0, 3).unwrap();
        assert_eq!(w, poisson(&c, 100.0, 3).unwrap());
        assert_ne!(w, poisson(&c, 100.0, 4).unwrap());
        let a = w.iter().filter(|x| x.client == "a").count();
        let b = w.iter().filter(|x| x.client == "b").count();
        assert!((900..1100).contains(&a), "{a}");
        assert!((60..140).contains(&b), "{b}");
        assert!(w.windows(2).all(|p| p[0].arrival_us <= p[1].arrival_us));
        assert!(poisson(&c, 0.0, 1).unwrap_err().contains("duration_s"));
    }

    fn client(arrival: Arrival, rate: f64) -> SyntheticClient {
        SyntheticClient {
            name: "c".into(),
            rate,
            prompt_tokens: 1,
            output_tokens: 1,
            lengths: Lengths::Fixed,
            arrival,
            model: None,
            max_tokens: MaxTokens::Absent,
        }
    }

    #[test]
    fn length_distributions_keep_their_mean_and_leave_arrivals_alone() {
        let base = SyntheticClient { prompt_tokens: 200, output_tokens: 100, ..client(Arrival::Poisson, 50.0) };
        let fixed = synthetic(std::slice::from_ref(&base), 100.0, 7).unwrap();
        assert!(fixed.iter().all(|w| w.prompt_tokens == 200 && w.output_tokens == 100));
        for lengths in [Lengths::Uniform { spread: 0.5 }, Lengths::Exponential, Lengths::LogNormal { cv: 1.5 }] {
            let w = synthetic(&[SyntheticClient { lengths, ..base.clone() }], 100.0, 7).unwrap();
            let arrivals = |v: &[WorkItem]| v.iter().map(|x| x.arrival_us).collect::<Vec<_>>();
            assert_eq!(arrivals(&w), arrivals(&fixed), "{lengths:?}");
            let mean = |f: fn(&WorkItem) -> u32| w.iter().map(|x| f(x) as f64).sum::<f64>() / w.len() as f64;
            let (p, o) = (mean(|x| x.prompt_tokens), mean(|x| x.output_tokens));
            assert!((p - 200.0).abs() < 20.0 && (o - 100.0).abs() < 10.0, "{lengths:?}: means {p} {o}");
            assert!(w.iter().any(|x| x.prompt_tokens != 200), "{lengths:?} varies");
            assert!(w.iter().all(|x| (1..=3200).contains(&x.prompt_tokens)));
        }
        let bad = SyntheticClient { lengths: Lengths::Uniform { spread: 1.0 }, ..base.clone() };
        assert!(synthetic(&[bad], 10.0, 1).unwrap_err().contains("clients[0].lengths.spread"));
        let bad = SyntheticClient { lengths: Lengths::LogNormal { cv: 0.0 }, ..base };
        assert!(synthetic(&[bad], 10.0, 1).unwrap_err().contains("clients[0].lengths.cv"));
    }

    /// The `max_tokens` of the JSON body a row becomes (`None`: absent).
    fn sent_cap(w: &WorkItem) -> Option<u64> {
        let r = chat_request(0, w, "x-tenant", "m", 16);
        let body: serde_json::Value = serde_json::from_slice(&r.body).unwrap();
        assert_eq!(r.output_tokens, w.output_tokens, "the answer stays the row's output");
        body.get("max_tokens").map(|v| v.as_u64().unwrap())
    }

    fn capped(json: &str) -> Result<Vec<WorkItem>, String> {
        let mut c: SyntheticClient = serde_json::from_str(&format!(
            r#"{{"name": "c", "rate": 20, "prompt_tokens": 50, "output_tokens": 200,
                "lengths": {{"kind": "exponential"}} {json}}}"#
        ))
        .map_err(|e| e.to_string())?;
        c.name = "c".into();
        synthetic(&[c], 20.0, 5)
    }

    #[test]
    fn clients_send_no_max_tokens_by_default_and_the_oracle_only_when_asked() {
        let w = capped("").unwrap();
        assert!(w.len() > 300 && w.iter().all(|x| x.max_tokens.is_none() && sent_cap(x).is_none()));
        let o = capped(r#", "max_tokens": "oracle""#).unwrap();
        assert!(o.iter().all(|x| sent_cap(x) == Some(x.output_tokens as u64)));
        let f = capped(r#", "max_tokens": 4096"#).unwrap();
        assert!(f.iter().all(|x| sent_cap(x) == Some(4096)));
        // Caps move nothing else: the same arrivals and lengths whatever the client sends.
        let strip = |v: &[WorkItem]| v.iter().map(|x| (x.arrival_us, x.output_tokens)).collect::<Vec<_>>();
        assert_eq!((strip(&o), strip(&f)), (strip(&w), strip(&w)));
        let m = capped(r#", "max_tokens": {"multiple": 2, "spread": 0.5}"#).unwrap();
        assert_eq!(m, capped(r#", "max_tokens": {"multiple": 2, "spread": 0.5}"#).unwrap(), "seeded");
        let ratio: Vec<f64> = m.iter().map(|x| x.max_tokens.unwrap() as f64 / x.output_tokens as f64).collect();
        assert!(ratio.iter().all(|r| (0.9..3.1).contains(r)), "{ratio:?}");
        assert!(ratio.iter().any(|&r| r < 1.5) && ratio.iter().any(|&r| r > 2.5), "spread around 2x");
        let mean = ratio.iter().sum::<f64>() / ratio.len() as f64;
        assert!((mean - 2.0).abs() < 0.1, "{mean}");
    }

    #[test]
    fn bad_max_tokens_settings_are_refused_naming_the_field() {
        for (json, field) in [
            (r#""max_tokens": 0"#, "max_tokens"),
            (r#""max_tokens": -5"#, "max_tokens"),
            (r#""max_tokens": 1.5"#, "max_tokens"),
            (r#""max_tokens": "lots""#, "max_tokens"),
            (r#""max_tokens": {"multiple": 0}"#, "max_tokens.multiple"),
            (r#""max_tokens": {"multiple": 2, "spread": 1}"#, "max_tokens.spread"),
            (r#""max_tokens": {"spread": 0.1}"#, "max_tokens.multiple"),
            (r#""max_tokens": {"multiple": 2, "sprad": 0.1}"#, "max_tokens: unknown field `sprad`"),
        ] {
            let e = capped(&format!(", {json}")).unwrap_err();
            assert!(e.contains(field), "{json}: {e}");
        }
        // Built in code, the range check names the client.
        let c = SyntheticClient {
            max_tokens: MaxTokens::Multiple { factor: 2.0, spread: -0.1 },
            ..client(Arrival::Uniform, 1.0)
        };
        assert!(synthetic(&[c], 5.0, 1).unwrap_err().contains("clients[0].max_tokens.spread"));
        for (s, m) in [
            ("absent", MaxTokens::Absent),
            ("oracle", MaxTokens::Oracle),
            ("4096", MaxTokens::Fixed(4096)),
            ("multiple:1.5:0.2", MaxTokens::Multiple { factor: 1.5, spread: 0.2 }),
            ("multiple:3", MaxTokens::Multiple { factor: 3.0, spread: 0.0 }),
        ] {
            assert_eq!(s.parse::<MaxTokens>(), Ok(m));
            let json = serde_json::to_string(&m).unwrap();
            assert_eq!(serde_json::from_str::<MaxTokens>(&json).unwrap(), m, "{json} round-trips");
        }
        for bad in ["", "0", "none", "multiple:", "multiple:x", "multiple:2:1"] {
            let e = bad.parse::<MaxTokens>().unwrap_err();
            assert!(e.starts_with("max_tokens"), "{bad}: {e}");
        }
    }

    fn gaps(w: &[WorkItem]) -> (f64, f64) {
        let g: Vec<f64> = w.windows(2).map(|p| (p[1].arrival_us - p[0].arrival_us) as f64 / 1e6).collect();
        let m = g.iter().sum::<f64>() / g.len() as f64;
        let sd = (g.iter().map(|x| (x - m) * (x - m)).sum::<f64>() / g.len() as f64).sqrt();
        (m, sd / m)
    }

    #[test]
    fn arrival_processes_have_their_rate_and_shape() {
        let (m, cv) = gaps(&synthetic(&[client(Arrival::Gamma { cv: 3.0 }, 20.0)], 2000.0, 1).unwrap());
        assert!((m - 0.05).abs() < 0.005 && (cv - 3.0).abs() < 0.3, "gamma mean {m} cv {cv}");
        let (m, cv) = gaps(&synthetic(&[client(Arrival::Gamma { cv: 0.5 }, 20.0)], 2000.0, 1).unwrap());
        assert!((m - 0.05).abs() < 0.005 && (cv - 0.5).abs() < 0.05, "gamma mean {m} cv {cv}");
        let u = synthetic(&[client(Arrival::Uniform, 4.0)], 10.0, 1).unwrap();
        assert_eq!(u.iter().map(|w| w.arrival_us).collect::<Vec<_>>()[..3], [250_000, 500_000, 750_000]);
        let o = synthetic(&[client(Arrival::OnOff { on_s: 1.0, off_s: 4.0 }, 50.0)], 100.0, 1).unwrap();
        assert!(o.iter().all(|w| w.arrival_us % 5_000_000 < 1_000_000), "arrivals only in on phases");
        assert!((900..1100).contains(&o.len()), "{}", o.len());
        let r = synthetic(&[client(Arrival::Ramp { to_rate: 40.0 }, 0.5)], 100.0, 1).unwrap();
        let first = r.iter().filter(|w| w.arrival_us < 50_000_000).count();
        assert!(first * 2 < r.len() && (1800..2300).contains(&r.len()), "{first} of {}", r.len());
        let e = synthetic(&[client(Arrival::Gamma { cv: -1.0 }, 1.0)], 1.0, 1).unwrap_err();
        assert!(e.contains("clients[0].arrival.cv"), "{e}");
    }

    #[test]
    fn traces_parse_and_bad_rows_name_line_and_field() {
        let w = parse_trace(
            TraceFormat::VtcCsv,
            "arrival_s,client,prompt_tokens,output_tokens\n1.5,c1,10,20\n0.5,c2,3,4\n",
        )
        .unwrap();
        assert_eq!(
            w[0],
            WorkItem {
                arrival_us: 0,
                client: "c2".into(),
                prompt_tokens: 3,
                output_tokens: 4,
                max_tokens: None,
                prefix_hashes: vec![],
                model: None,
                headers: vec![],
            }
        );
        assert_eq!(w[1].arrival_us, 1_000_000);
        let e = parse_trace(TraceFormat::VtcCsv, "arrival_s,client,prompt_tokens,output_tokens\n1,c,x,2\n2,c,1,0\n")
            .unwrap_err();
        assert_eq!(e.len(), 2);
        assert_eq!((e[0].line, e[1].line), (2, 3));
        assert!(e[0].message.contains("prompt_tokens") && e[1].message.contains("output_tokens"));
        let w = parse_trace(
            TraceFormat::AzureCsv,
            "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.6805900,374,44\n2023-11-16 18:15:50.9951690,396,109\n",
        )
        .unwrap();
        assert_eq!(w[1].arrival_us, 4_314_579);
        let e =
            parse_trace(TraceFormat::AzureCsv, "TIMESTAMP,ContextTokens,GeneratedTokens\nyesterday,1,1\n").unwrap_err();
        assert!(e[0].message.contains("TIMESTAMP") && e[0].line == 2);
        let w = parse_trace(
            TraceFormat::MooncakeJsonl,
            "{\"timestamp\": 27482, \"input_length\": 6955, \"output_length\": 52, \"hash_ids\": [46, 47]}\n{\"timestamp\": 30535, \"input_length\": 6472, \"output_length\": 26, \"hash_ids\": [46]}\n",
        )
        .unwrap();
        assert_eq!((w[1].arrival_us, w[0].prefix_hashes.clone()), (3_053_000, vec![46, 47]));
        let e = parse_trace(TraceFormat::MooncakeJsonl, "{\"timestamp\": 1}\n").unwrap_err();
        assert!(e[0].message.contains("input_length"));
    }

    fn rows(prompts: &[u32]) -> Vec<WorkItem> {
        prompts
            .iter()
            .enumerate()
            .map(|(i, &p)| WorkItem {
                arrival_us: i as u64,
                client: "c".into(),
                prompt_tokens: p,
                output_tokens: 1,
                max_tokens: None,
                prefix_hashes: Vec::new(),
                model: None,
                headers: Vec::new(),
            })
            .collect()
    }

    /// Bytes of `block_tokens`-token block `j` of a text.
    fn block(text: &str, j: usize, block_tokens: usize) -> &str {
        &text[j * 4 * block_tokens..((j + 1) * 4 * block_tokens).min(text.len())]
    }

    #[test]
    fn rows_of_one_application_share_exactly_its_system_prompt_and_others_share_nothing() {
        // Two applications with 3-block system prompts; 200 rows of 5 blocks and a bit.
        let sharing = PrefixSharing { applications: 2, system_prompt_tokens: 96, prepend: false, follow_up: 0.0 };
        let mut w = rows(&[170; 200]);
        sharing.apply(&mut w, 32, 9).unwrap();
        let text: Vec<String> = w.iter().enumerate().map(|(i, x)| prompt_text(x, i as u64, 32)).collect();
        assert!(w.iter().all(|x| x.prefix_hashes.len() == 5 && x.prompt_tokens == 170));
        let (mut same, mut other) = (0, 0);
        for i in 1..w.len() {
            let (a, b) = (&w[0], &w[i]);
            if a.prefix_hashes[0] == b.prefix_hashes[0] {
                same += 1;
                assert_eq!(a.prefix_hashes[..3], b.prefix_hashes[..3]);
                assert_eq!(text[0][..96 * 4], text[i][..96 * 4], "row {i} shares the system prompt's text");
                for j in 3..6 {
                    assert_ne!(block(&text[0], j, 32), block(&text[i], j, 32), "row {i} block {j} is its own");
                }
                assert!(a.prefix_hashes[3..].iter().all(|h| !b.prefix_hashes.contains(h)));
            } else {
                other += 1;
                assert!(a.prefix_hashes.iter().all(|h| !b.prefix_hashes.contains(h)), "row {i}");
                assert_ne!(block(&text[0], 0, 32), block(&text[i], 0, 32), "row {i} shares no text");
            }
        }
        // A seeded uniform draw over two applications.
        assert!(same > 60 && other > 60, "{same} {other}");
        let mut again = rows(&[170; 200]);
        sharing.apply(&mut again, 32, 9).unwrap();
        assert_eq!(again, w, "deterministic");
        let mut other_seed = rows(&[170; 200]);
        sharing.apply(&mut other_seed, 32, 10).unwrap();
        assert_ne!(other_seed, w);
    }

    #[test]
    fn prepended_system_prompts_lengthen_rows_and_short_rows_get_what_fits() {
        let sharing = PrefixSharing { applications: 1, system_prompt_tokens: 64, prepend: true, follow_up: 0.0 };
        let mut w = rows(&[10, 40]);
        sharing.apply(&mut w, 32, 1).unwrap();
        assert_eq!((w[0].prompt_tokens, w[1].prompt_tokens), (74, 104));
        assert_eq!(w[0].prefix_hashes, w[1].prefix_hashes[..2]);
        let carved = PrefixSharing { prepend: false, ..sharing };
        let mut w = rows(&[40, 200]);
        carved.apply(&mut w, 32, 1).unwrap();
        assert_eq!(w[0].prompt_tokens, 40);
        assert_eq!(w[0].prefix_hashes[..], w[1].prefix_hashes[..1], "one block of the system prompt fits");
    }

    #[test]
    fn follow_ups_resend_their_conversation_and_trace_hashes_are_kept() {
        let sharing = PrefixSharing { applications: 1, system_prompt_tokens: 32, prepend: false, follow_up: 1.0 };
        let mut w = rows(&[100, 200, 300, 90]);
        w[3].prefix_hashes = vec![7, 8];
        sharing.apply(&mut w, 32, 4).unwrap();
        // Each turn resends the whole previous prompt (its full blocks) and adds its own.
        assert_eq!(w[1].prefix_hashes[..3], w[0].prefix_hashes[..]);
        assert_eq!(w[2].prefix_hashes[..6], w[1].prefix_hashes[..]);
        assert_eq!(w[2].prefix_hashes.len(), 9);
        assert_eq!(w[3].prefix_hashes, vec![7, 8], "a row with its own hash ids keeps them");
        let t1 = prompt_text(&w[1], 1, 32);
        let t2 = prompt_text(&w[2], 2, 32);
        assert_eq!(t1[..6 * 128], t2[..6 * 128]);
    }

    #[test]
    fn rows_sharing_trace_hash_ids_share_those_blocks_of_text() {
        let mut w = rows(&[96, 96, 80]);
        w[0].prefix_hashes = vec![1, 2, 3];
        w[1].prefix_hashes = vec![1, 2, 4];
        let (a, b) = (prompt_text(&w[0], 0, 32), prompt_text(&w[1], 1, 32));
        assert_eq!((a.len(), b.len()), (384, 384));
        assert_eq!(a[..256], b[..256]);
        assert_ne!(block(&a, 2, 32), block(&b, 2, 32));
        // Rows without hash ids are unique text, even at the same length.
        let (c, d) = (prompt_text(&w[2], 2, 32), prompt_text(&w[2], 3, 32));
        assert_ne!(block(&c, 0, 32), block(&d, 0, 32));
        assert_ne!(block(&a, 0, 32), block(&c, 0, 32));
    }

    #[test]
    fn bad_prefix_sharing_names_the_field() {
        let ok = PrefixSharing { applications: 4, system_prompt_tokens: 512, prepend: false, follow_up: 0.5 };
        assert!(ok.validate("prefix_sharing", 512).is_ok());
        let cases = [
            (PrefixSharing { applications: 0, ..ok.clone() }, "prefix_sharing.applications"),
            (PrefixSharing { system_prompt_tokens: 500, ..ok.clone() }, "prefix_sharing.system_prompt_tokens"),
            (PrefixSharing { follow_up: 1.5, ..ok.clone() }, "prefix_sharing.follow_up"),
            (PrefixSharing { follow_up: f64::NAN, ..ok.clone() }, "prefix_sharing.follow_up"),
        ];
        for (bad, field) in cases {
            let e = bad.apply(&mut rows(&[10]), 512, 1).unwrap_err();
            assert!(e.contains(field), "{e}");
        }
    }
}
