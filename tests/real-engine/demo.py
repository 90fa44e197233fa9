"""`bash scripts/demo.sh --real-vllm`: the README demo's fcfs-vs-vtc table, with two real vLLM
servers (CPU, the tiny local model) behind Envoy + sluice instead of simulated backends.
Ctrl-C stops everything."""

import argparse
import dataclasses

import build_model
import harness
from load import Scenario, print_table, run_phase


def main() -> None:
    d = Scenario()
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--duration", type=float, default=d.duration_s, help="seconds of measured load per policy")
    p.add_argument("--flood-concurrency", type=int, default=d.flood_concurrency,
                   help="requests the flood tenant keeps outstanding")
    p.add_argument("--modest-interval", type=float, default=d.modest_interval_s,
                   help="seconds between the modest tenant's requests")
    p.add_argument("--max-tokens", type=int, default=d.max_tokens, help="max_tokens of every request")
    p.add_argument("--bound", type=int, default=d.bound_per_backend,
                   help="sluice's in-flight bound per server (vLLM runs --max-num-seqs 4)")
    p.add_argument("--policies", default="fcfs,vtc", help="policies to compare, in order")
    a = p.parse_args()
    scenario = dataclasses.replace(d, duration_s=a.duration, flood_concurrency=a.flood_concurrency,
                                   modest_interval_s=a.modest_interval, max_tokens=a.max_tokens,
                                   bound_per_backend=a.bound)
    harness.exit_on_sigterm()
    build_model.build(harness.MODEL_DIR)
    print("starting two vLLM servers (about 30 s on 2 cores)...", flush=True)
    servers = [harness.start_vllm(f"demo-vllm-{n}", ["--max-num-seqs", "4"]) for n in ("a", "b")]
    try:
        harness.wait_ready(servers)
        results = []
        for policy in a.policies.split(","):
            print(f"[{policy}] {scenario.warmup_s + scenario.duration_s:.0f} s of load: flood keeps "
                  f"{scenario.flood_concurrency} requests outstanding, modest sends one every "
                  f"{scenario.modest_interval_s} s; max_tokens {scenario.max_tokens}", flush=True)
            results.append(run_phase(servers, policy, scenario))
        print_table(results)
    except KeyboardInterrupt:
        print("interrupted: stopping Envoy and vLLM")
    finally:
        for s in servers:
            s.proc.stop()


if __name__ == "__main__":
    main()
