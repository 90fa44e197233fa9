//! Named hardware/model profiles: scheduler limits, KV-cache geometry and the per-iteration time model.

use std::fmt;

/// Configuration of one simulated GPU server (one vLLM engine).
///
/// All fields are public so a scenario can start from a named profile and override a few of them;
/// call [`GpuProfile::validate`] (done by [`crate::GpuModel::new`]) after editing.
#[derive(Debug, Clone, PartialEq)]
pub struct GpuProfile {
    /// Profile name, reported in metrics and by the backend server.
    pub name: String,
    /// Model name served by default (the `model_name` label of the metrics).
    pub served_model: String,
    /// Tokens per KV-cache block (vLLM `--block-size`, default 16).
    pub block_size: u32,
    /// Number of KV-cache blocks on the GPU (vLLM `num_gpu_blocks`).
    pub num_blocks: u32,
    /// Maximum number of sequences in the running batch (vLLM `--max-num-seqs`).
    pub max_num_seqs: u32,
    /// Maximum number of tokens computed in one iteration (vLLM `--max-num-batched-tokens`).
    pub max_num_batched_tokens: u32,
    /// Longest sequence (prompt + output) accepted; longer requests are refused at submit.
    pub max_model_len: u32,
    /// Whether a prefill may be split across iterations to fit `max_num_batched_tokens`.
    pub chunked_prefill: bool,
    /// Fraction of blocks kept free when admitting a new sequence (vLLM's watermark, 0.01), which
    /// avoids admitting a request only to preempt it at its next block boundary.
    pub watermark: f64,
    /// Whether the prefix cache is enabled (vLLM `--enable-prefix-caching`).
    pub prefix_caching: bool,
    /// Tokens covered by one entry of a request's `prefix_hashes` (the Mooncake trace uses 512).
    /// Must be a multiple of `block_size`.
    pub prefix_hash_tokens: u32,
    /// Per-iteration time model.
    pub time: TimeModel,
    /// Model swapping: how many distinct models can be resident at once (0 = unlimited, no swaps).
    pub max_loaded_models: u32,
    /// Time to load a model that is not resident, added to the iteration that first schedules it.
    pub swap_us: u64,
}

/// Iteration duration as a linear function of the batch's shape.
///
/// `duration = base + prefill_tokens·per_prefill_token + decode_seqs·per_decode_seq +
/// kv_tokens·per_kv_token (+ swap)`, all in microseconds. The base term is the time to stream the
/// weights from HBM once per iteration, the KV term the time to read the attended KV cache, the
/// prefill term the compute of new prompt tokens, and the decode term per-sequence compute and
/// sampling overhead. A linear sum rather than a roofline `max` keeps the model monotonic and easy
/// to calibrate; its coefficients are fitted per profile (see the profile constructors).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TimeModel {
    /// Fixed cost of one iteration, µs.
    pub base_us: f64,
    /// Cost per prompt token computed in the iteration, µs.
    pub per_prefill_token_us: f64,
    /// Cost per sequence decoding one token in the iteration, µs.
    pub per_decode_seq_us: f64,
    /// Cost per KV token attended (context of every scheduled sequence), µs.
    pub per_kv_token_us: f64,
}

impl TimeModel {
    /// Duration in whole microseconds (at least 1, so virtual time always advances).
    pub fn duration_us(&self, prefill_tokens: u64, decode_seqs: u64, kv_tokens: u64) -> u64 {
        let d = self.base_us
            + self.per_prefill_token_us * prefill_tokens as f64
            + self.per_decode_seq_us * decode_seqs as f64
            + self.per_kv_token_us * kv_tokens as f64;
        (d.round() as u64).max(1)
    }
}

/// A profile that fails validation, naming the field.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProfileError(pub String);

impl fmt::Display for ProfileError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "invalid GPU profile: {}", self.0)
    }
}

impl std::error::Error for ProfileError {}

impl GpuProfile {
    /// Names accepted by [`GpuProfile::by_name`].
    pub const NAMES: [&'static str; 6] =
        ["llama2-7b-a10g", "llama3-8b-h100", "llama3-8b-a100", "llama3-8b-a10g", "vllm-cpu-tiny", "fast"];

    /// Looks a profile up by name.
    pub fn by_name(name: &str) -> Option<GpuProfile> {
        match name {
            "llama2-7b-a10g" => Some(Self::llama2_7b_a10g()),
            "llama3-8b-h100" => Some(Self::llama3_8b_h100()),
            "llama3-8b-a100" => Some(Self::llama3_8b_a100()),
            "llama3-8b-a10g" => Some(Self::llama3_8b_a10g()),
            "vllm-cpu-tiny" => Some(Self::vllm_cpu_tiny()),
            "fast" => Some(Self::fast()),
            _ => None,
        }
    }

    /// Llama-2-7b (fp16) on one NVIDIA A10G (24 GB), the testbed of the VTC paper, with its
    /// 10,000-token KV pool (625 blocks of 16).
    ///
    /// Physical starting points: the A10G streams about 600 GB/s, so reading the 13.5 GB of weights
    /// once takes ≈ 22 ms at peak and ≈ 28 ms at a realistic 80 %; a Llama-2-7b KV token is
    /// 2·32 layers·4096·2 B = 512 KiB, ≈ 1 µs to read at that rate; a token costs ≈ 14 GFLOP, ≈ 0.2 ms
    /// of the A10G's ~70 effective fp16 TFLOPS, both for a prompt token and for the token a decoding
    /// sequence adds. The decode term was then fine-tuned (200 → 215 µs) so that FCFS on
    /// `chatbot-arena-27-clients.csv` gives the ≈ 779 (input+output) tokens/s over the total execution
    /// time of the VTC paper's Table 2: `cargo run --release -p sluice-gpu --example calibrate`
    /// prints 779 tokens/s (755.8 s makespan for the 600 s trace, which overloads this GPU).
    pub fn llama2_7b_a10g() -> GpuProfile {
        GpuProfile {
            name: "llama2-7b-a10g".into(),
            served_model: "meta-llama/Llama-2-7b-hf".into(),
            block_size: 16,
            num_blocks: 625,
            max_num_seqs: 256,
            max_num_batched_tokens: 4096,
            max_model_len: 4096,
            chunked_prefill: false,
            watermark: 0.01,
            prefix_caching: false,
            prefix_hash_tokens: 512,
            time: TimeModel {
                base_us: 28_000.0,
                per_prefill_token_us: 200.0,
                per_decode_seq_us: 215.0,
                per_kv_token_us: 1.0,
            },
            max_loaded_models: 0,
            swap_us: 0,
        }
    }

    /// Llama-3.1-8B-Instruct (bf16; the Llama-3-8B architecture with a 128 k context, so the long
    /// Mooncake prompts fit) on one NVIDIA H100 SXM 80 GB under vLLM defaults
    /// (`gpu_memory_utilization` 0.9, chunked prefill, prefix caching).
    ///
    /// Sources and assumptions: H100 SXM HBM3 3.35 TB/s and 989 dense bf16 TFLOPS (NVIDIA data
    /// sheet). Weights 16 GB → ≈ 6 ms per iteration at 80 % of peak bandwidth. KV per token =
    /// 2·32 layers·8 KV heads·128·2 B = 128 KiB, ≈ 0.05 µs to read; 72 GB usable − 16 GB weights −
    /// ~4 GB activations leaves ≈ 52 GB ≈ 400 k tokens (vLLM logs report a KV cache of that order
    /// for this pair), here 25,600 blocks of 16. Prefill ≈ 16 GFLOP/token at ~55 % MFU ≈ 30 µs/token
    /// (≈ 30 k prefill tokens/s, in line with published vLLM H100 prefill throughput). The decode
    /// term (30 µs/sequence: sampling, scheduling, per-token matmul share) gives ≈ 6–7 ms inter-token
    /// latency at batch 1 and ≈ 10 k output tokens/s at batch 256, the range of public vLLM
    /// benchmarks of Llama-3-8B on one H100.
    ///
    /// Checked against step times measured on a real H100 (`calibration/`, test `calibration`):
    /// within 24 % of every decode and single-prompt prefill row, KV and long-prompt prefill slopes
    /// within 19 %. The coefficients are kept rather than refitted: the measurement is a plain
    /// implementation (higher weight-streaming floor, 7.6 ms; no scheduler or sampler, 13 µs per
    /// sequence), while vLLM's fused kernels lower the floor and its CPU scheduling and sampling
    /// add per-sequence time, so the profile's split between base and decode terms is intended.
    pub fn llama3_8b_h100() -> GpuProfile {
        GpuProfile {
            name: "llama3-8b-h100".into(),
            served_model: "meta-llama/Llama-3.1-8B-Instruct".into(),
            block_size: 16,
            num_blocks: 25_600,
            max_num_seqs: 256,
            max_num_batched_tokens: 8192,
            max_model_len: 131_072,
            chunked_prefill: true,
            watermark: 0.01,
            prefix_caching: true,
            prefix_hash_tokens: 512,
            time: TimeModel {
                base_us: 6_000.0,
                per_prefill_token_us: 30.0,
                per_decode_seq_us: 30.0,
                per_kv_token_us: 0.05,
            },
            max_loaded_models: 0,
            swap_us: 0,
        }
    }

    /// The slow half of `sluice-routing`'s heterogeneous pool: Llama-3.1-8B on an NVIDIA A100 80 GB, derived from
    /// `llama3-8b-h100` by the data-sheet ratios (2.0 vs 3.35 TB/s of HBM, 312 vs 989 dense bf16
    /// TFLOPS; same memory, so the same KV pool and limits): weights streamed once per iteration
    /// 6 → 10 ms, a KV token 0.05 → 0.08 µs, a prefill token 30 → 95 µs (compute-bound), the
    /// per-sequence decode term 30 → 50 µs. It keeps the 128 k context and the prefix cache, so both
    /// traces run on it; the A10G profile cannot serve Mooncake's long prompts (4 k context).
    pub fn llama3_8b_a100() -> GpuProfile {
        let mut p = Self::llama3_8b_h100();
        p.name = "llama3-8b-a100".into();
        p.time =
            TimeModel { base_us: 10_000.0, per_prefill_token_us: 95.0, per_decode_seq_us: 50.0, per_kv_token_us: 0.08 };
        p
    }

    /// Llama-3.1-8B on one NVIDIA A10G (24 GB), a small GPU whose KV cache, not the batch limit,
    /// bounds the batch (QLM's A10 class), derived from `llama3-8b-h100` by the data-sheet ratios
    /// and this repository's `llama2-7b-a10g`: weights (16 GB) streamed at 600 GB/s × 80 % →
    /// 33.5 ms per iteration; a KV token (128 KiB) 0.05 → 0.28 µs (×5.6, bandwidth); a prefill
    /// token at ~70 effective fp16 TFLOPS, 16 GFLOP → 424 µs (×14, compute); the per-sequence decode
    /// term of the Llama-2-7b A10G profile (215 µs) scaled by FLOPs per token (16/14) → 245 µs.
    /// Memory: 24 GB × 0.9 − 16 GB of weights − activations leaves ≈ 4 GB ≈ 32 k tokens, 2,000
    /// blocks of 16; `max_model_len` 16,384 (every Azure row fits); chunked prefill of 2,048 tokens.
    pub fn llama3_8b_a10g() -> GpuProfile {
        let mut p = Self::llama3_8b_h100();
        p.name = "llama3-8b-a10g".into();
        p.num_blocks = 2_000;
        p.max_model_len = 16_384;
        p.max_num_batched_tokens = 2_048;
        p.time = TimeModel {
            base_us: 33_500.0,
            per_prefill_token_us: 424.0,
            per_decode_seq_us: 245.0,
            per_kv_token_us: 0.28,
        };
        p
    }

    /// The real-engine tier's engine: vLLM 0.32 for CPU (`vllm-cpu`) serving the tiny random-weight
    /// Llama of `tests/real-engine/build_model.py` (hidden 256, 2 layers) with the tier's flags
    /// (`--max-model-len 2048`, 256 MiB of KV cache, `--enforce-eager`, one OMP thread) on this
    /// project's 2-core machines, so that host-sim can be checked against an engine nobody here
    /// wrote (issue 20, item 3; `tests/real-engine/fidelity.py`).
    ///
    /// Limits are vLLM's CPU defaults for the API server: 128 sequences, 2,048 batched tokens,
    /// chunked prefill and prefix caching on, blocks of 128 tokens; 256 MiB at 2 KiB a token
    /// (2 layers × K and V × 256 × bf16) is 131,072 tokens (vLLM's log: "KV cache size: 131,072
    /// tokens"), 1,024 blocks. The time model was fitted by `tests/real-engine/fit_profile.py` to step
    /// times measured on two such servers at once, from vLLM's own histograms; see
    /// `docs/results/2026-11-26-fidelity.md` for the rows, the fit's errors and the machine's load,
    /// which moves these figures more than anything else.
    pub fn vllm_cpu_tiny() -> GpuProfile {
        GpuProfile {
            name: "vllm-cpu-tiny".into(),
            served_model: "tiny".into(),
            block_size: 128,
            num_blocks: 1_024,
            max_num_seqs: 128,
            max_num_batched_tokens: 2_048,
            max_model_len: 2_048,
            chunked_prefill: true,
            watermark: 0.01,
            prefix_caching: true,
            prefix_hash_tokens: 128,
            time: TimeModel {
                base_us: 6_645.5,
                per_prefill_token_us: 5.5,
                per_decode_seq_us: 502.3,
                per_kv_token_us: 0.0,
            },
            max_loaded_models: 0,
            swap_us: 0,
        }
    }

    /// A small, quick profile for tests: 64 blocks of 16 tokens, 1 ms iterations plus small terms.
    pub fn fast() -> GpuProfile {
        GpuProfile {
            name: "fast".into(),
            served_model: "fast-model".into(),
            block_size: 16,
            num_blocks: 64,
            max_num_seqs: 16,
            max_num_batched_tokens: 512,
            max_model_len: 512,
            chunked_prefill: true,
            watermark: 0.0,
            prefix_caching: true,
            prefix_hash_tokens: 32,
            time: TimeModel {
                base_us: 1_000.0,
                per_prefill_token_us: 2.0,
                per_decode_seq_us: 20.0,
                per_kv_token_us: 0.1,
            },
            max_loaded_models: 0,
            swap_us: 0,
        }
    }

    /// Total KV capacity in tokens.
    pub fn kv_tokens(&self) -> u64 {
        self.block_size as u64 * self.num_blocks as u64
    }

    /// Blocks kept free by the admission watermark.
    pub fn watermark_blocks(&self) -> u32 {
        (self.watermark * self.num_blocks as f64).floor() as u32
    }

    /// Checks the fields are consistent; the error names the offending field.
    pub fn validate(&self) -> Result<(), ProfileError> {
        let err = |m: String| Err(ProfileError(m));
        if self.block_size == 0 {
            return err("block_size must be >= 1".into());
        }
        if self.num_blocks == 0 {
            return err("num_blocks must be >= 1".into());
        }
        if self.max_num_seqs == 0 {
            return err("max_num_seqs must be >= 1".into());
        }
        if self.max_num_batched_tokens == 0 {
            return err("max_num_batched_tokens must be >= 1".into());
        }
        if self.max_model_len < 2 {
            return err(format!("max_model_len must be >= 2, got {}", self.max_model_len));
        }
        if !(0.0..0.5).contains(&self.watermark) {
            return err(format!("watermark must be in [0, 0.5), got {}", self.watermark));
        }
        // A single sequence of max_model_len tokens must fit next to the watermark, otherwise it
        // could wait (or be preempted) forever on an otherwise empty GPU.
        let need = (self.max_model_len as u64).div_ceil(self.block_size as u64) + self.watermark_blocks() as u64;
        if need > self.num_blocks as u64 {
            return err(format!(
                "max_model_len {} needs {} blocks (with the watermark) but num_blocks is {}",
                self.max_model_len, need, self.num_blocks
            ));
        }
        if !self.chunked_prefill && self.max_num_batched_tokens < self.max_model_len {
            return err(format!(
                "max_num_batched_tokens {} must be >= max_model_len {} without chunked_prefill",
                self.max_num_batched_tokens, self.max_model_len
            ));
        }
        if self.prefix_hash_tokens == 0 || !self.prefix_hash_tokens.is_multiple_of(self.block_size) {
            return err(format!(
                "prefix_hash_tokens {} must be a positive multiple of block_size {}",
                self.prefix_hash_tokens, self.block_size
            ));
        }
        let t = &self.time;
        for (field, v) in [
            ("time.base_us", t.base_us),
            ("time.per_prefill_token_us", t.per_prefill_token_us),
            ("time.per_decode_seq_us", t.per_decode_seq_us),
            ("time.per_kv_token_us", t.per_kv_token_us),
        ] {
            if !v.is_finite() || v < 0.0 {
                return err(format!("{field} must be a finite number >= 0, got {v}"));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn named_profiles_are_valid() {
        for n in GpuProfile::NAMES {
            let p = GpuProfile::by_name(n).expect(n);
            p.validate().unwrap();
            assert_eq!(p.name, n);
        }
        assert_eq!(GpuProfile::llama2_7b_a10g().kv_tokens(), 10_000);
        // vLLM's log for the tier's 256 MiB: "KV cache size: 131,072 tokens".
        assert_eq!(GpuProfile::vllm_cpu_tiny().kv_tokens(), 131_072);
        assert!(GpuProfile::by_name("nope").is_none());
    }

    #[test]
    fn validation_names_the_field() {
        let mut p = GpuProfile::fast();
        p.prefix_hash_tokens = 20;
        assert!(p.validate().unwrap_err().0.contains("prefix_hash_tokens"));
        let mut p = GpuProfile::fast();
        p.max_model_len = 100_000;
        assert!(p.validate().unwrap_err().0.contains("max_model_len"));
        let mut p = GpuProfile::llama2_7b_a10g();
        p.max_num_batched_tokens = 512;
        assert!(p.validate().unwrap_err().0.contains("max_num_batched_tokens"));
    }
}
