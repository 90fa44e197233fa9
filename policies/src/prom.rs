//! A forgiving reader of the Prometheus text exposition format, enough to read
//! model-server `/metrics` pages.
//!
//! It never panics and never allocates for a well-formed line: comments,
//! `# HELP`/`# TYPE` and unknown metrics are skipped; a malformed line is
//! counted and skipped; an unterminated last line (a truncated body) is
//! ignored rather than misread.

use std::borrow::Cow;

/// One sample line: `name{labels} value [timestamp]`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Sample<'a> {
    /// Metric name, e.g. `vllm:num_requests_waiting`.
    pub name: &'a str,
    /// The raw text between the braces (empty without labels).
    pub labels: &'a str,
    /// The value; NaN and ±Inf are read as such.
    pub value: f64,
}

impl<'a> Sample<'a> {
    /// The value of label `key`, unescaped.
    pub fn label(&self, key: &str) -> Option<Cow<'a, str>> {
        labels(self.labels).find(|(k, _)| *k == key).map(|(_, v)| v)
    }
}

/// Reads every sample of `text`, calling `f` for each; returns the number of
/// malformed lines skipped.
pub fn parse<'a>(text: &'a str, mut f: impl FnMut(Sample<'a>)) -> usize {
    let mut bad = 0;
    let complete = match text.rfind('\n') {
        Some(i) => &text[..i],
        None => "", // no complete line at all
    };
    for line in complete.lines() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        match parse_line(line) {
            Some(s) => f(s),
            None => bad += 1,
        }
    }
    bad
}

fn is_name_char(c: char, first: bool) -> bool {
    c.is_ascii_alphabetic() || c == '_' || c == ':' || (!first && c.is_ascii_digit())
}

fn parse_line(line: &str) -> Option<Sample<'_>> {
    let name_end = line.char_indices().find(|&(i, c)| !is_name_char(c, i == 0)).map_or(line.len(), |(i, _)| i);
    if name_end == 0 {
        return None;
    }
    let name = &line[..name_end];
    let mut rest = &line[name_end..];
    let mut labels_text = "";
    if let Some(after) = rest.strip_prefix('{') {
        let close = closing_brace(after)?;
        labels_text = &after[..close];
        // Validate the label list once, so later lookups can trust it.
        let mut n = 0;
        let mut it = LabelIter { rest: labels_text, ok: true };
        for _ in it.by_ref() {
            n += 1;
        }
        if !it.ok || (n == 0 && !labels_text.trim().is_empty()) {
            return None;
        }
        rest = &after[close + 1..];
    }
    let mut fields = rest.split_ascii_whitespace();
    let value = parse_value(fields.next()?)?;
    if let Some(ts) = fields.next() {
        ts.parse::<i64>().ok()?;
    }
    if fields.next().is_some() {
        return None;
    }
    Some(Sample { name, labels: labels_text, value })
}

/// Index of the `}` that closes the label set, skipping quoted values.
fn closing_brace(s: &str) -> Option<usize> {
    let mut in_quotes = false;
    let mut escaped = false;
    for (i, c) in s.char_indices() {
        match (in_quotes, escaped, c) {
            (true, true, _) => escaped = false,
            (true, false, '\\') => escaped = true,
            (true, false, '"') => in_quotes = false,
            (false, _, '"') => in_quotes = true,
            (false, _, '}') => return Some(i),
            _ => {}
        }
    }
    None
}

fn parse_value(v: &str) -> Option<f64> {
    match v {
        "NaN" | "nan" => Some(f64::NAN),
        "+Inf" | "Inf" | "inf" | "+inf" => Some(f64::INFINITY),
        "-Inf" | "-inf" => Some(f64::NEG_INFINITY),
        _ => v.parse::<f64>().ok(),
    }
}

/// The `(key, value)` pairs of a label set.
pub fn labels(text: &str) -> impl Iterator<Item = (&str, Cow<'_, str>)> {
    LabelIter { rest: text, ok: true }
}

struct LabelIter<'a> {
    rest: &'a str,
    ok: bool,
}

impl<'a> Iterator for LabelIter<'a> {
    type Item = (&'a str, Cow<'a, str>);

    fn next(&mut self) -> Option<Self::Item> {
        let s = self.rest.trim_start().trim_start_matches(',').trim_start();
        if s.is_empty() || !self.ok {
            return None;
        }
        let fail = |me: &mut Self| {
            me.ok = false;
            None
        };
        let Some(eq) = s.find('=') else { return fail(self) };
        let key = s[..eq].trim();
        if key.is_empty() || !key.chars().enumerate().all(|(i, c)| is_name_char(c, i == 0) && c != ':') {
            return fail(self);
        }
        let Some(v) = s[eq + 1..].trim_start().strip_prefix('"') else { return fail(self) };
        let mut escaped = false;
        let mut needs_unescape = false;
        let mut end = None;
        for (i, c) in v.char_indices() {
            if escaped {
                escaped = false;
            } else if c == '\\' {
                escaped = true;
                needs_unescape = true;
            } else if c == '"' {
                end = Some(i);
                break;
            }
        }
        let Some(end) = end else { return fail(self) };
        let raw = &v[..end];
        self.rest = &v[end + 1..];
        let value = if needs_unescape { Cow::Owned(unescape(raw)) } else { Cow::Borrowed(raw) };
        Some((key, value))
    }
}

fn unescape(raw: &str) -> String {
    let mut out = String::with_capacity(raw.len());
    let mut chars = raw.chars();
    while let Some(c) = chars.next() {
        if c != '\\' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('n') => out.push('\n'),
            Some(other) => out.push(other),
            None => out.push('\\'),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    fn all(text: &str) -> (Vec<(String, String, f64)>, usize) {
        let mut v = Vec::new();
        let bad = parse(text, |s| v.push((s.name.to_string(), s.labels.to_string(), s.value)));
        (v, bad)
    }

    #[test]
    fn reads_a_vllm_page() {
        let text = "# HELP vllm:num_requests_waiting Waiting.\n# TYPE vllm:num_requests_waiting gauge\n\
vllm:num_requests_waiting{model_name=\"llama\"} 3.0\n\
vllm:kv_cache_usage_perc{model_name=\"llama\"} 0.25 1700000000000\n\
vllm:cache_config_info{block_size=\"16\",num_gpu_blocks=\"625\"} 1.0\n";
        let (v, bad) = all(text);
        assert_eq!(bad, 0);
        assert_eq!(v.len(), 3);
        assert_eq!(v[0].0, "vllm:num_requests_waiting");
        assert_eq!(v[0].2, 3.0);
        assert_eq!(v[1].2, 0.25);
        let mut blocks = None;
        parse(text, |s| {
            if s.name == "vllm:cache_config_info" {
                blocks = s.label("num_gpu_blocks").map(|c| c.into_owned());
            }
        });
        assert_eq!(blocks.as_deref(), Some("625"));
    }

    #[test]
    fn escapes_special_values_and_junk() {
        let text = "m{a=\"x\\\"}y\\\\z\\n\",b=\"\"} NaN\nn +Inf\no -Inf\n\
garbage line here\nbad{unterminated=\"x} 1\np{a=1} 2\nq 1 2 3\n1bad 3\nr 7";
        let (v, bad) = all(text);
        assert_eq!(v.len(), 3, "{v:?}");
        assert!(v[0].2.is_nan());
        assert_eq!(v[1].2, f64::INFINITY);
        assert_eq!(v[2].2, f64::NEG_INFINITY);
        assert_eq!(bad, 5);
        let mut label = None;
        parse(text, |s| {
            if s.name == "m" {
                label = s.label("a").map(|c| c.into_owned());
            }
        });
        assert_eq!(label.as_deref(), Some("x\"}y\\z\n"));
    }

    #[test]
    fn a_truncated_last_line_is_not_misread() {
        // "vllm:num_requests_waiting 12" cut to "... 1" must not read as 1.
        let (v, bad) = all("a 1\nvllm:num_requests_waiting 1");
        assert_eq!((v.len(), bad), (1, 0));
    }

    #[test]
    fn never_panics_on_arbitrary_bytes() {
        let mut seed = 0x2545F4914F6CDD1Du64;
        let alphabet = b"ab:_{}=\",\\ \n#019.eE+-InfNa";
        for _ in 0..2000 {
            let len = (seed % 64) as usize;
            let s: String = (0..len)
                .map(|_| {
                    seed ^= seed << 13;
                    seed ^= seed >> 7;
                    seed ^= seed << 17;
                    alphabet[(seed % alphabet.len() as u64) as usize] as char
                })
                .collect();
            let _ = all(&s);
        }
    }
}
