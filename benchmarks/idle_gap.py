"""How often cells-ilp leaves GPUs idle while a waiting job could use them, in replay.

cells-ilp skips a round whose jobs and outside GPUs are as its last solved decision left
them (for ``resolve_s``). The daemon solves anyway while a waiting job has a feasible Cell
that fits the GPUs free now (``policy.placement.job_fitting_idle_gpus``); the simulator
keeps the plain rule. This replays a trace and counts the decisions that were skipped
while such a job waited, and the GPU-seconds that stayed free in those rounds (each
counted for one round length: an upper bound of the gap the daemon's rule closes).

Usage: ``python benchmarks/idle_gap.py [--trace T ...] [--density D] [--seed S] >
benchmarks/results_idle_gap.json`` (about 5 minutes for both default traces).
"""

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT.parent / "shared" / "data"


def run(trace: Path, density: float, seed: int, round_s: float) -> dict:
    from estimator.cluster import load_cluster
    from policy.measured import load_measured
    from policy.placement import FreeGpus
    from policy.registry import make_policy
    from policy.simulator import EstimateCache, SimConfig, simulate
    from policy.trace import map_trace, read_trace, trace_kind_for
    from policy.placement import job_fitting_idle_gpus

    cluster, table = load_cluster("crius-1280"), load_measured(None)
    jobs = map_trace(read_trace(str(trace)), table, seed, density, trace_kind_for(str(trace)))
    policy = make_policy("cells-ilp")
    decide = policy.decide
    counts = {"decisions": 0, "skipped": 0, "skipped_with_fitting_waiting_job": 0}
    idle_gpu_s = 0.0

    def counting_decide(snapshot):
        nonlocal idle_gpu_s
        decision = decide(snapshot)
        counts["decisions"] += 1
        if snapshot.policy_state is not None and decision.policy_state is snapshot.policy_state:
            counts["skipped"] += 1
            if job_fitting_idle_gpus(snapshot) is not None:
                counts["skipped_with_fitting_waiting_job"] += 1
                free = FreeGpus.from_snapshot(snapshot)
                idle_gpu_s += sum(free.free.values()) * round_s
        return decision

    policy.decide = counting_decide
    t0 = time.perf_counter()
    result = simulate(policy, jobs, cluster, table, SimConfig(round_s=round_s), EstimateCache(cluster, table))
    span_s = result.end_s - result.start_s
    return {"trace": trace.name, "density": density, "seed": seed, "round_s": round_s, "jobs": len(jobs),
            **counts, "idle_gpu_hours_in_those_rounds": round(idle_gpu_s / 3600, 2),
            "cluster_gpu_hours_over_the_replay": round(cluster.total_gpus() * span_s / 3600, 1),
            "wall_s": round(time.perf_counter() - t0, 1),
            "command": f"python benchmarks/idle_gap.py --trace {trace.name} --density {density} --seed {seed}"}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trace", action="append", help="a trace in ../shared/data/traces (repeat; "
                                                    "default: itp_cluster08.csv and philly_2week.csv)")
    p.add_argument("--density", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--round-s", type=float, default=300.0)
    args = p.parse_args()
    # The solver's banner goes to file descriptor 1: keep it off the JSON.
    stdout = os.dup(1)
    os.dup2(2, 1)
    try:
        rows = [run(DATA / "traces" / t, args.density, args.seed, args.round_s)
                for t in args.trace or ("itp_cluster08.csv", "philly_2week.csv")]
    finally:
        sys.stdout.flush()
        os.dup2(stdout, 1)
    print(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
