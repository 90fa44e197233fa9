"""Issue 20, item 3: the host-sim side of the fidelity check (`scripts/fidelity.sh`) keeps working.

The comparison itself is a script: the real side's figures move with the machine's load, so no
test can hold host-sim to them. This test runs the same scenario the script gives host-sim (the
`vllm-cpu-tiny` profile fitted to this tier's engines, the two-tenant workload, sluice's
reference configuration with an explicit bound) and checks what both sides must show: every
modest request served, the flood held in sluice's queue, and VTC serving the modest tenant first.
"""

import argparse

import fidelity


def test_host_sim_runs_the_fidelity_workload_on_the_fitted_profile():
    a = argparse.Namespace(policy="vtc", bound=2, duration=10.0, flood_rate=12.0, modest_rate=1.0, max_tokens=64)
    report = fidelity.run_sim(a, prompt_tokens=79)
    assert [b.get("address") for b in report["backends"]], "two simulated engines"
    rows = fidelity.sim_rows(report, a.duration)
    flood, modest = rows["flood"], rows["modest"]
    # About a second's and 12 a second's worth of 10 s of arrivals.
    assert modest["sent"] >= 9 and modest["ok"] == modest["sent"], rows
    assert flood["sent"] >= 110 and flood["ok"] > 0, rows
    assert modest["ttft_p50"] < flood["ttft_p50"] / 5, f"VTC serves the modest tenant first: {rows}"
