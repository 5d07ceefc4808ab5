"""Where each policy's average JCT goes, by job length: queueing, running, and the floor.

Jobs are grouped by the time they asked for (iterations × measured seconds per iteration
on the requested allocation): under 1 h, 1–4 h, 4–12 h, 12–48 h, 48 h and more. For each
group and policy it prints the group's share of the average JCT (sum of the group's JCTs ÷
all jobs), split into queueing (submission to first start) and the rest (running,
restarts and suspensions), next to two floors: every job alone on the fastest Cell it is
offered (``floor_cells_h``) and on the fastest measured allocation of any size
(``floor_any_h``, as ``jct_lower_bound.py``), both with the first start's cost.

Prints one JSON object: ``{"trace", "seed", "cluster", "jobs", "groups": [{"asked_h":
[lo, hi], "jobs", "floor_cells_h", "floor_any_h", "policies": {name: {"jct_h",
"queue_h", "run_h", "unfinished"}}}], "totals": {...}}`` (all ``_h`` figures are
contributions to the average, in hours; a policy's jobs left unfinished contribute
nothing and are counted in ``unfinished``: its figures are then no average).

Usage: ``python benchmarks/jct_by_length.py --trace ../shared/data/traces/philly_2week.csv
--policy crius --policy cells-ilp [--seed 0] [--cluster crius-1280]``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from estimator.cluster import load_cluster  # noqa: E402
from jct_lower_bound import fastest_service_s, first_start_s  # noqa: E402
from policy.measured import load_measured  # noqa: E402
from policy.registry import make_policy  # noqa: E402
from policy.simulator import EstimateCache, SimConfig, simulate  # noqa: E402
from policy.trace import map_trace, read_trace, trace_kind_for  # noqa: E402

GROUPS_H = ((0, 1), (1, 4), (4, 12), (12, 48), (48, float("inf")))


def _group(asked_h: float) -> int:
    return next(k for k, (lo, hi) in enumerate(GROUPS_H) if lo <= asked_h < hi)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trace", required=True)
    parser.add_argument("--policy", action="append", required=True)
    parser.add_argument("--cluster", default="crius-1280")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    table = load_measured()
    cluster = load_cluster(args.cluster)
    jobs = map_trace(read_trace(args.trace), table, seed=args.seed, kind=trace_kind_for(args.trace))
    n = len(jobs)
    any_size_s = dict(zip((j.job_id for j in jobs), fastest_service_s(jobs, table, cluster)))
    oracle = EstimateCache(cluster, table, oracle=True)
    groups = [{"asked_h": [lo, hi if hi != float("inf") else None], "jobs": 0, "floor_cells_h": 0.0,
               "floor_any_h": 0.0, "policies": {}} for lo, hi in GROUPS_H]
    group_of = {}
    for j in jobs:
        g = groups[_group(j.iterations * j.requested_iter_time_s / 3600)]
        group_of[j.job_id] = g
        g["jobs"] += 1
        fastest_cell_s = min(e.iteration_time_s for e in oracle.get(j.spec)[0])
        cells_run_s = j.iterations * min(fastest_cell_s, j.requested_iter_time_s)
        g["floor_cells_h"] += (first_start_s(cells_run_s) + cells_run_s) / 3600 / n
        g["floor_any_h"] += (first_start_s(any_size_s[j.job_id]) + any_size_s[j.job_id]) / 3600 / n
    estimates = EstimateCache(cluster, table)
    for name in args.policy:
        result = simulate(make_policy(name), jobs, cluster, table, SimConfig(), estimates)
        for g in groups:
            g["policies"][name] = {"jct_h": 0.0, "queue_h": 0.0, "run_h": 0.0, "unfinished": 0}
        for o in result.jobs:
            row = group_of[o.job_id]["policies"][name]
            if o.jct_s is None:
                row["unfinished"] += 1
                continue
            row["jct_h"] += o.jct_s / 3600 / n
            row["queue_h"] += o.queue_s / 3600 / n
            row["run_h"] += (o.jct_s - o.queue_s) / 3600 / n
    totals = {"floor_cells_h": sum(g["floor_cells_h"] for g in groups),
              "floor_any_h": sum(g["floor_any_h"] for g in groups),
              "policies": {name: {k: sum(g["policies"][name][k] for g in groups)
                                  for k in ("jct_h", "queue_h", "run_h", "unfinished")}
                           for name in args.policy}}
    out = {"trace": Path(args.trace).name, "seed": args.seed, "cluster": cluster.name, "jobs": n,
           "groups": groups, "totals": totals}
    print(json.dumps(out, indent=2))
    return out


if __name__ == "__main__":
    main()
