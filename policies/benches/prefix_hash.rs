//! Cost of prefix hashing per KB of prompt, uncapped and under the filter's
//! default cap (`routing.prefix_max_blocks` 128 blocks of 16 tokens, 64
//! bytes each: the first 8 KB of a prompt). Prints a table; run with
//! `cargo bench -p sluice-policies --bench prefix_hash` (add `-- --quick`
//! for a short run).

use sluice_policies::routing::prefix_hashes;
use std::hint::black_box;
use std::time::Instant;

/// Microseconds per call, the best of a few rounds of `calls` calls.
fn time(prompt: &[u8], max_blocks: usize, calls: u32) -> f64 {
    let mut out = Vec::with_capacity(prompt.len() / 64 + 1);
    let mut best = f64::INFINITY;
    for _ in 0..5 {
        let start = Instant::now();
        for _ in 0..calls {
            prefix_hashes(black_box(prompt), 64, max_blocks, &mut out);
            black_box(&out);
        }
        best = best.min(start.elapsed().as_secs_f64() * 1e6 / calls as f64);
    }
    best
}

fn main() {
    let quick = std::env::args().any(|a| a == "--quick");
    // Text-like bytes (the hash does not care, but no all-zero shortcut either).
    let text: Vec<u8> =
        (0..1u32 << 20).map(|i| b"the quick brown fox jumps over a lazy dog "[i as usize % 42]).collect();
    println!("prefix_hashes, 64-byte blocks (16 tokens), native");
    println!("{:>10} {:>14} {:>10} {:>14} {:>10}", "prompt", "uncapped µs", "µs/KB", "cap 128 µs", "µs/KB");
    for kb in [1usize, 8, 64, 256, 1024] {
        let prompt = &text[..kb << 10];
        let calls = if quick { 20 } else { 200 }.max(4096 / kb as u32);
        let all = time(prompt, usize::MAX, calls);
        let capped = time(prompt, 128, calls);
        println!("{:>8}KB {:>14.2} {:>10.3} {:>14.2} {:>10.3}", kb, all, all / kb as f64, capped, capped / kb as f64);
    }
}
