"""How long one cells-ilp round takes on large synthetic clusters, and whether its fallback holds.

Builds clusters of 1,280 to 10,240 GPUs over eight node kinds (h100, h200, a100 with 4 and
with 8 GPUs per node, v100, a40, a10, l20), fills each with active jobs (5,000 on the
largest; running where the requested Cell fits on first-come placement, pending after),
and times one ``decide`` per cluster. Then, on the largest, it runs a round under a tiny
solver time limit and one with no solver at all (the greedy rule), and validates each
answer with ``policy.interface.validate_decision``.

Estimates are synthetic (a per-type speed factor, sub-linear scaling in the GPU count, one
and two stage Cells), so the benchmark measures the policy, not the estimator.

Prints one JSON object: ``{"rounds": [{"gpus", "nodes", "jobs", "running", "pending",
"decide_s", "decide_cpu_s", "how", "started", "changed", "valid"}], "time_limit": {...},
"no_solver": {...}, "target_s", "meets_target", "meets_target_cpu"}``. ``decide_s`` is wall
time and ``decide_cpu_s`` this process's CPU time: on a machine shared with other work the
two differ, and the CPU time is what the round costs.; ``how`` counts the decision paths named in the reasons
(ILP, ILP (time limit), greedy, backfilled).

The timed rounds run with ``--time-limit-s`` (2 s: at this scale a round may take 10 s,
and the limit is wall-clock time, which a loaded machine stretches).

Usage: ``python benchmarks/policy_scale.py [--max-gpus 10240] [--jobs 5000] [--seed 0]
[--time-limit-s 2]``.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from estimator.cells import Cell, CellEstimate  # noqa: E402
from estimator.jobs import JobSpec  # noqa: E402
from policy.cells_ilp import CellsIlpPolicy  # noqa: E402
from policy.interface import (PENDING, RUNNING, TRIGGER_ROUND, Assignment, JobView, NodeView,  # noqa: E402
                              Snapshot, implied_actions, validate_decision)
from policy.placement import FreeGpus  # noqa: E402

# (gpu_type, gpus_per_node, speed relative to a100) per node kind; a100 comes in two sizes.
KINDS = (("h100", 8, 3.0), ("h200", 8, 3.4), ("a100", 4, 1.0), ("a100", 8, 1.0),
         ("v100", 8, 0.45), ("a40", 2, 0.55), ("a10", 2, 0.35), ("l20", 8, 0.5))
TARGET_S = 10.0
BATCH = 256


def cluster(total_gpus: int) -> tuple[NodeView, ...]:
    """Nodes of every kind, an equal share of GPUs each."""
    nodes = []
    share = total_gpus // len(KINDS)
    for gtype, per_node, _ in KINDS:
        for k in range(share // per_node):
            nodes.append(NodeView(f"{gtype}n{per_node}-{k:04d}", gtype, per_node))
    return tuple(nodes)


def estimates(rng: random.Random, asked: int, node_sizes: dict[str, tuple[int, ...]]) -> tuple[CellEstimate, ...]:
    """Cells at counts {N/2, N, 2N} on every type and node size, one and two stages."""
    base = rng.uniform(5.0, 200.0)  # samples/s of one a100
    scaling = rng.uniform(0.75, 0.95)  # exponent: sub-linear speed-up with more GPUs
    out = []
    speed = {g: s for g, _, s in KINDS}
    for gtype, sizes in node_sizes.items():
        for n in sorted({max(1, asked // 2), asked, asked * 2}):
            for per_node in sizes:
                for stages in (1, 2):
                    if stages > n:
                        continue
                    rate = base * speed[gtype] * n ** scaling * (0.97 if stages == 2 else 1.0)
                    rate *= 1.0 if n <= per_node else 0.9  # crossing nodes costs some speed
                    cell = Cell(gtype, n, min(n, per_node), stages)
                    out.append(CellEstimate(cell, (), 4, BATCH / rate, rate, 1.0, True, ""))
    return tuple(out)


def snapshot(total_gpus: int, jobs: int, seed: int) -> Snapshot:
    """A busy cluster: jobs arrive over the last day; those whose request fits run."""
    rng = random.Random(seed)
    nodes = cluster(total_gpus)
    sizes: dict[str, set[int]] = {}
    for n in nodes:
        sizes.setdefault(n.gpu_type, set()).add(n.total_gpus)
    node_sizes = {g: tuple(sorted(v)) for g, v in sizes.items()}
    free = FreeGpus([(n.name, n.gpu_type, n.total_gpus) for n in nodes])
    now_s = 86_400.0
    views = []
    # Leave some GPUs free (as right after completions), so the round has starts to choose.
    budget_gpus = int(0.92 * total_gpus)
    for k in range(jobs):
        asked = rng.choice((1, 1, 2, 2, 4, 4, 8, 8, 16, 32))
        gtype = rng.choice(KINDS)[0]
        ests = estimates(rng, asked, node_sizes)
        submit_s = now_s * k / jobs
        iterations = rng.randint(500, 50_000)
        placed = None
        for e in ests:
            if e.cell.gpu_type == gtype and e.cell.num_gpus == asked and e.cell.num_stages == 1:
                p = free.place(e.cell) if budget_gpus >= asked else None
                if p is not None:
                    budget_gpus -= asked
                    free.take(p)
                    placed = Assignment(e.cell, p)
                    break
        done = rng.uniform(0, iterations * 0.9) if placed else 0.0
        last_change_s = rng.uniform(submit_s, now_s) if placed else submit_s
        views.append(JobView(f"job{k:05d}", f"user{k % 50}", JobSpec("gpt-1.3b", BATCH, asked, gtype), submit_s,
                             RUNNING if placed else PENDING, placed, done, iterations, 0, last_change_s,
                             None, False, ests, ests))
    return Snapshot(now_s, nodes, tuple(views), TRIGGER_ROUND, 300.0, 210.0, None)


def one_round(policy: CellsIlpPolicy, snap: Snapshot) -> dict:
    t0, c0 = time.perf_counter(), time.process_time()
    decision = policy.decide(snap)
    decide_s, cpu_s = time.perf_counter() - t0, time.process_time() - c0
    validate_decision(snap, decision)  # raises on any over-commit or bad placement
    how: Counter[str] = Counter()
    for d in decision.jobs:
        if "(starvation bound)" in d.reason:
            how["starvation bound"] += 1
            continue
        for path in ("ILP (time limit)", "ILP", "greedy", "backfilled"):
            if d.reason.startswith(path):
                how[path] += 1
                break
    actions = implied_actions(snap, decision)
    running = sum(1 for j in snap.jobs if j.assignment is not None)
    return {"gpus": sum(n.total_gpus for n in snap.nodes), "nodes": len(snap.nodes), "jobs": len(snap.jobs),
            "running": running, "pending": len(snap.jobs) - running, "decide_s": round(decide_s, 4),
            "decide_cpu_s": round(cpu_s, 4),
            "how": dict(sorted(how.items())), "started": sum(1 for a in actions if a.kind == "start"),
            "changed": sum(1 for a in actions if a.kind != "start"), "valid": True}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--max-gpus", type=int, default=10_240)
    parser.add_argument("--jobs", type=int, default=5_000, help="active jobs on the largest cluster")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--time-limit-s", type=float, default=2.0,
                        help="solver time limit of the timed rounds (a 10,240-GPU round may take 10 s)")
    args = parser.parse_args(argv)
    rounds = []
    sizes = [g for g in (1_280, 2_560, 5_120, 10_240) if g < args.max_gpus] + [args.max_gpus]
    for gpus in sizes:
        snap = snapshot(gpus, max(1, args.jobs * gpus // args.max_gpus), args.seed)
        rounds.append(one_round(CellsIlpPolicy(time_limit_s=args.time_limit_s), snap))
        print(json.dumps(rounds[-1]), file=sys.stderr)
    largest = snapshot(args.max_gpus, args.jobs, args.seed)
    time_limited = one_round(CellsIlpPolicy(time_limit_s=1e-3), largest)
    no_solver = one_round(CellsIlpPolicy(solvers=()), largest)
    every = rounds + [time_limited, no_solver]
    worst = max(r["decide_s"] for r in every)
    worst_cpu = max(r["decide_cpu_s"] for r in every)
    print(json.dumps({"rounds": rounds, "time_limit": {"time_limit_s": 1e-3, **time_limited},
                      "no_solver": no_solver, "target_s": TARGET_S, "meets_target": worst <= TARGET_S,
                      "meets_target_cpu": worst_cpu <= TARGET_S},
                     indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
