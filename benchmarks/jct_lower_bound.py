"""A lower bound on the average JCT any policy can reach on a trace, from the measured table.

Each job is given, the moment it arrives, the fastest allocation the measured table has
for its model and batch on the cluster (any GPU type, any GPU count, any node layout
the cluster's nodes allow), with no other job in the way; it pays the simulator's first
start (launch plus the pruned plan search, the cheapest tuning any policy pays, capped by
the simulator at 5 % of the run) and
never restarts. No schedule can finish a job sooner in ``slurm-ext simulate``: a job's
rate there is the measured rate of the allocation it holds, and every start costs at
least that. The average of these per-job bounds is therefore a floor on every policy's
average JCT — a test of whether a target such as "0.85 × Crius" is reachable at all on a
lightly loaded trace, where JCT is almost only service time.

With ``--result`` (the JSON of ``slurm-ext simulate``) it also prints each policy's
average JCT, its ratio to the floor, and the floor as a fraction of the best policy's
average JCT (the smallest ratio any policy could reach against that best).

Prints one JSON object: ``{"trace", "seed", "cluster", "jobs", "floor_avg_jct_h",
"floor_p50_jct_h", "floor_service_only_avg_h", "asked_avg_service_h", "policies": {name:
{"avg_jct_h", "over_floor"}}, "floor_over_best": {"best", "ratio"}}``.

Usage: ``python benchmarks/jct_lower_bound.py --trace ../shared/data/traces/itp_cluster08.csv
[--cluster crius-1280] [--seed 0] [--density 1] [--result out.json]``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from estimator.cluster import load_cluster  # noqa: E402
from policy.measured import MeasuredTable, load_measured  # noqa: E402
from policy.simulator import RestartCosts  # noqa: E402
from policy.trace import TraceJob, map_trace, read_trace, trace_kind_for  # noqa: E402


def fastest_iter_time_s(job: TraceJob, table: MeasuredTable, node_sizes: dict[str, int],
                        capacity: dict[str, int]) -> float:
    """The smallest measured seconds per iteration of the job's model and batch on this cluster."""
    best = job.requested_iter_time_s
    for p in table.points:
        if (p.model, p.global_batch) != (job.spec.model, job.spec.global_batch) or p.iter_time_s is None:
            continue
        if p.gpus_per_node <= node_sizes.get(p.gpu_type, 0) and p.num_gpus <= capacity.get(p.gpu_type, 0):
            best = min(best, p.iter_time_s)
    return best


def fastest_service_s(jobs, table: MeasuredTable, cluster) -> list[float]:
    """Each job's running time on the fastest measured allocation the cluster allows."""
    node_sizes = {g.gpu_type: g.gpus_per_node for g in cluster.node_groups}
    capacity = {t: cluster.total_gpus(t) for t in cluster.gpu_types}
    return [j.iterations * fastest_iter_time_s(j, table, node_sizes, capacity) for j in jobs]


def first_start_s(run_s: float) -> float:
    """The cheapest first start any policy pays a job that then runs ``run_s``: launch plus
    the pruned plan search, which the simulator caps at a share of the run (a longer run,
    on a slower Cell, never pays less)."""
    costs = RestartCosts()
    return costs.launch_s + costs.tuning_s("pruned", run_s)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trace", required=True)
    parser.add_argument("--cluster", default="crius-1280")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--density", type=float, default=1.0)
    parser.add_argument("--result", help="JSON written by `slurm-ext simulate --json` on the same trace and seed")
    args = parser.parse_args(argv)

    table = load_measured()
    cluster = load_cluster(args.cluster)
    jobs = map_trace(read_trace(args.trace), table, seed=args.seed, density=args.density,
                     kind=trace_kind_for(args.trace))
    service_s = fastest_service_s(jobs, table, cluster)
    floor_s = [first_start_s(s) + s for s in service_s]
    asked_s = [j.iterations * j.requested_iter_time_s for j in jobs]
    out = {
        "trace": Path(args.trace).name, "seed": args.seed, "cluster": cluster.name, "jobs": len(jobs),
        "floor_avg_jct_h": statistics.fmean(floor_s) / 3600,
        "floor_p50_jct_h": statistics.median(floor_s) / 3600,
        "floor_service_only_avg_h": statistics.fmean(service_s) / 3600,
        "asked_avg_service_h": statistics.fmean(asked_s) / 3600,
    }
    if args.result:
        policies = {}
        for name, res in _policies(json.loads(Path(args.result).read_text())).items():
            avg_s = res.get("avg_jct_s")
            if avg_s:
                avg_h = avg_s / 3600
                policies[name] = {"avg_jct_h": avg_h, "over_floor": avg_h / out["floor_avg_jct_h"]}
        out["policies"] = policies
        if policies:
            best = min(policies, key=lambda n: policies[n]["avg_jct_h"])
            out["floor_over_best"] = {"best": best, "ratio": out["floor_avg_jct_h"] / policies[best]["avg_jct_h"]}
    print(json.dumps(out, indent=2))
    return out


def _policies(raw: dict) -> dict[str, dict]:
    """policy name → its result object, from a `simulate` JSON."""
    if isinstance(raw.get("policies"), dict):
        return raw["policies"]
    if isinstance(raw.get("policies"), list):
        return {p["policy"]: p for p in raw["policies"]}
    return {}


if __name__ == "__main__":
    main()
