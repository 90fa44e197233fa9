//! `sluice-backend`: simulated GPU LLM servers speaking the OpenAI API over HTTP, in real time.

use std::io::Write;
use std::net::IpAddr;
use std::process::ExitCode;

use anyhow::Context;
use clap::Parser;
use sluice_gpu::server::{start, ServerConfig};
use sluice_gpu::GpuProfile;

/// Simulated GPU LLM backends (vLLM-like continuous batching over a paged KV cache) serving
/// POST /v1/chat/completions and /v1/completions (streaming or not), GET /metrics (vLLM names)
/// and GET /health. Prints one line `listening HOST:PORT` per backend on stdout once all are bound;
/// stops on SIGINT or SIGTERM.
#[derive(Debug, Parser)]
#[command(name = "sluice-backend", version)]
struct Args {
    /// First port; backend i listens on PORT+i. 0 gives every backend an ephemeral port.
    #[arg(long, default_value_t = 8000)]
    port: u16,
    /// Number of independent backends (each with its own GPU model).
    #[arg(long, default_value_t = 1)]
    count: u16,
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1")]
    host: IpAddr,
    /// GPU profile: llama2-7b-a10g (10,000-token KV pool, the VTC paper's testbed),
    /// llama3-8b-h100, or fast (small and quick, for tests).
    #[arg(long, default_value = "llama2-7b-a10g")]
    profile: String,
    /// Virtual seconds per real second: 10 runs the simulated GPU 10 times faster.
    #[arg(long, default_value_t = 1.0)]
    time_scale: f64,
    /// Answer every request at once with a one-token completion, without a GPU model
    /// (to measure proxy overhead).
    #[arg(long)]
    instant: bool,
    /// Tokens to generate when a request has neither max_tokens nor max_completion_tokens.
    #[arg(long, default_value_t = 64)]
    default_max_tokens: u32,
    /// Tokens a chat template adds to every chat prompt: counted in `usage.prompt_tokens` and in
    /// the KV cache, as a real engine counts its template (vLLM's tiny test model: 15).
    #[arg(long, default_value_t = 0)]
    chat_template_tokens: u32,
    /// Override the profile's running-batch limit (vLLM --max-num-seqs).
    #[arg(long)]
    max_num_seqs: Option<u32>,
    /// Override the profile's number of KV-cache blocks (its KV pool is this × its block size);
    /// the maximum context length shrinks to fit if needed.
    #[arg(long)]
    num_blocks: Option<u32>,
    /// Distinct models resident at once (0 = unlimited, no swapping). A request for a model that
    /// is not resident waits until one can be unloaded, then pays --swap-ms.
    #[arg(long)]
    max_loaded_models: Option<u32>,
    /// Time to load a model that is not resident, in (virtual) milliseconds.
    #[arg(long)]
    swap_ms: Option<u64>,
}

fn main() -> ExitCode {
    match run(Args::parse()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("sluice-backend: error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn run(args: Args) -> anyhow::Result<()> {
    let mut profile = GpuProfile::by_name(&args.profile).with_context(|| {
        format!("unknown --profile {:?}; known profiles: {}", args.profile, GpuProfile::NAMES.join(", "))
    })?;
    if let Some(n) = args.max_num_seqs {
        profile.max_num_seqs = n;
    }
    if let Some(n) = args.num_blocks {
        profile.num_blocks = n;
        let fit = n.saturating_sub(profile.watermark_blocks()).saturating_mul(profile.block_size);
        profile.max_model_len = profile.max_model_len.min(fit);
    }
    if let Some(n) = args.max_loaded_models {
        profile.max_loaded_models = n;
    }
    if let Some(ms) = args.swap_ms {
        profile.swap_us = ms.saturating_mul(1000);
    }
    profile.validate().context("the profile with the overrides given")?;
    let cfg = ServerConfig {
        host: args.host,
        port: args.port,
        count: args.count,
        profile,
        time_scale: args.time_scale,
        instant: args.instant,
        default_max_tokens: args.default_max_tokens,
        chat_template_tokens: args.chat_template_tokens,
    };
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    rt.block_on(async move {
        let server = start(cfg).await?;
        {
            let mut out = std::io::stdout().lock();
            for a in &server.addrs {
                writeln!(out, "listening {a}")?;
            }
            out.flush()?;
        }
        wait_for_signal().await?;
        server.shutdown().await;
        anyhow::Ok(())
    })
}

async fn wait_for_signal() -> anyhow::Result<()> {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        let mut term = signal(SignalKind::terminate())?;
        let mut int = signal(SignalKind::interrupt())?;
        tokio::select! {
            _ = term.recv() => {}
            _ = int.recv() => {}
        }
    }
    #[cfg(not(unix))]
    tokio::signal::ctrl_c().await?;
    Ok(())
}
