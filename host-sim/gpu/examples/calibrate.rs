//! Calibration check: replays a trace directly into one GPU model (FCFS, no proxy) and prints the
//! throughput the VTC paper reports (input + output tokens over the total execution time).
//!
//! `cargo run --release -p sluice-gpu --example calibrate -- [PROFILE] [TRACE.csv|TRACE.jsonl]`
//! Defaults: every named profile, `host-sim/traces/chatbot-arena-27-clients.csv` in this
//! repository, found from the crate's own directory so any working directory will do (or
//! `$SLUICE_TRACES/chatbot-arena-27-clients.csv`). CSV: the arena format
//! (arrival_s,client,prompt_tokens,output_tokens) or the Azure format
//! (TIMESTAMP,ContextTokens,GeneratedTokens); JSONL: the Mooncake format with hash_ids.

use std::time::Instant;

use sluice_gpu::replay::{replay, TraceRequest};
use sluice_gpu::GpuProfile;

fn load(path: &str) -> Result<Vec<TraceRequest>, String> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("{path}: {e}"))?;
    let mut out = Vec::new();
    if path.ends_with(".jsonl") {
        for (i, line) in text.lines().enumerate().filter(|(_, l)| !l.trim().is_empty()) {
            let v: serde_json::Value = serde_json::from_str(line).map_err(|e| format!("{path}:{}: {e}", i + 1))?;
            let num = |k: &str| v[k].as_f64().ok_or_else(|| format!("{path}:{}: missing {k}", i + 1));
            out.push(TraceRequest {
                arrival_us: (num("timestamp")? * 1000.0) as u64,
                prompt_tokens: num("input_length")? as u32,
                output_tokens: num("output_length")? as u32,
                prefix_hashes: v["hash_ids"]
                    .as_array()
                    .map_or(Vec::new(), |a| a.iter().filter_map(|h| h.as_u64()).collect()),
            });
        }
    } else {
        let mut lines = text.lines();
        let header = lines.next().unwrap_or_default();
        let azure = header.starts_with("TIMESTAMP");
        let mut t0 = None;
        for (i, line) in lines.enumerate() {
            let f: Vec<&str> = line.split(',').collect();
            let bad = || format!("{path}:{}: bad row {line:?}", i + 2);
            let (arrival_us, p, o) = if azure {
                // "2023-11-16 18:15:46.6805900" -> seconds of day (the traces span under a day).
                let ts = f.first().ok_or_else(bad)?;
                let hms = ts.split(' ').nth(1).ok_or_else(bad)?;
                let parts: Vec<f64> =
                    hms.split(':').map(|x| x.parse::<f64>()).collect::<Result<_, _>>().map_err(|_| bad())?;
                let s = parts.first().ok_or_else(bad)? * 3600.0
                    + parts.get(1).ok_or_else(bad)? * 60.0
                    + parts.get(2).ok_or_else(bad)?;
                let t0 = *t0.get_or_insert(s);
                ((s - t0) * 1e6, f.get(1), f.get(2))
            } else {
                (f.first().ok_or_else(bad)?.parse::<f64>().map_err(|_| bad())? * 1e6, f.get(2), f.get(3))
            };
            let num = |x: Option<&&str>| x.and_then(|s| s.trim().parse::<u32>().ok()).ok_or_else(bad);
            out.push(TraceRequest {
                arrival_us: arrival_us as u64,
                prompt_tokens: num(p)?,
                output_tokens: num(o)?,
                prefix_hashes: Vec::new(),
            });
        }
    }
    out.sort_by_key(|r| r.arrival_us);
    Ok(out)
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let profiles: Vec<String> = match args.first() {
        Some(p) => vec![p.clone()],
        None => GpuProfile::NAMES.iter().map(|s| s.to_string()).collect(),
    };
    let dir =
        std::env::var("SLUICE_TRACES").unwrap_or_else(|_| concat!(env!("CARGO_MANIFEST_DIR"), "/../traces").into());
    let path = args.get(1).cloned().unwrap_or(format!("{dir}/chatbot-arena-27-clients.csv"));
    let trace = match load(&path) {
        Ok(t) => t,
        Err(e) => {
            eprintln!("error: {e}");
            std::process::exit(2);
        }
    };
    println!("trace {path}: {} requests", trace.len());
    for name in profiles {
        let Some(profile) = GpuProfile::by_name(&name) else {
            eprintln!("error: unknown profile {name:?}; known: {}", GpuProfile::NAMES.join(", "));
            std::process::exit(2);
        };
        let t = Instant::now();
        let s = replay(profile, &trace).expect("named profiles are valid");
        println!(
            "{name:>15}: {:.0} tokens/s (input+output over {:.1} s makespan), {:.0} output tokens/s, finished {} refused {}, \
             mean TTFT {:.2} s, mean latency {:.2} s, preemptions {}, iterations {}, mean batch {:.1}, peak KV {:.0}%, prefix hit {:.1}% [{:.2} s wall]",
            s.tokens_per_s(),
            s.makespan_us as f64 / 1e6,
            s.output_tokens as f64 / (s.makespan_us.max(1) as f64 / 1e6),
            s.finished,
            s.refused,
            s.mean_ttft_us / 1e6,
            s.mean_latency_us / 1e6,
            s.preemptions,
            s.iterations,
            s.mean_batch,
            s.peak_kv_usage * 100.0,
            s.prefix_hit_rate * 100.0,
            t.elapsed().as_secs_f64()
        );
    }
}
