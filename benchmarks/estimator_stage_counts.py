"""Which pipeline stage count the measured rows look like, per allocation.

The measured table holds the time of the plan Alpa's search chose, not the plan. For each
GPU type and layout (nodes × GPUs per node), this prints the median accuracy of the
estimator's best plan (what ``estimator_accuracy.py`` scores) beside the median accuracy of
the estimate with each stage count held fixed, over the rows where that count fits. A
layout whose rows a fixed count matches much better than the best plan suggests the
measurement ran that pipeline, where the estimator finds a faster plan.

    python benchmarks/estimator_stage_counts.py [--gpu-type v100] [--out FILE]

Shipped shared physics; a few seconds on 2 cores.

``dgx2_at_four_stages`` (without ``--gpu-type``): the figures of ``estimator_accuracy.py``'s
targets (held-out v100 median and mean, with the physics that benchmark fitted without
v100, read from its results file; the median of the rows not used for fitting) as it
scores them, and with the rows of 4 and 8 GPUs of one DGX-2 scored at 4 stages, the plan
they match (``docs/estimator.md``; the best plan where 4 stages do not fit). A diagnostic
of what the misses are, not a score: the rule was chosen by looking at those rows.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from estimator_accuracy import (DEFAULT_DATA, MEASURED_CLUSTER, accuracy, load_rows, physics_options,  # noqa: E402
                                summarize)

from estimator.cells import Cell  # noqa: E402
from estimator.compute import FITTED_PHYSICS, SharedPhysics  # noqa: E402
from estimator.estimate import estimate_cell, stage_counts  # noqa: E402
from estimator.jobs import JobSpec  # noqa: E402
from estimator.models import load_model  # noqa: E402


def stage_times(row, options) -> dict[int, float]:
    """The row's estimated seconds per iteration at each stage count that fits."""
    n = row.num_nodes * row.gpus_per_node
    job = JobSpec(row.model, row.global_batch)
    return {s: e.iteration_time_s for s in stage_counts(n, load_model(row.model).num_layers)
            if (e := estimate_cell(job, Cell(row.gpu_type, n, row.gpus_per_node, s), MEASURED_CLUSTER,
                                   options)).feasible}


def by_layout(rows, gpu_type: str | None) -> dict[str, dict]:
    options = physics_options(FITTED_PHYSICS)
    groups: dict[str, list[tuple[float, dict[int, float]]]] = {}
    for row in rows:
        if row.measured_s <= 0 or (gpu_type and row.gpu_type != gpu_type):
            continue
        times = stage_times(row, options)
        best = min(times.values()) if times else None
        key = f"{row.gpu_type} {row.num_nodes}x{row.gpus_per_node}"
        groups.setdefault(key, []).append(
            (accuracy(best, row.measured_s), {s: accuracy(t, row.measured_s) for s, t in times.items()}))
    out = {}
    for key in sorted(groups):
        items = groups[key]
        counts = sorted({s for _, per in items for s in per})
        out[key] = {
            "rows": len(items),
            "best_plan_median": round(statistics.median(a for a, _ in items), 3),
            "fixed_stages_median": {str(s): {"median": round(statistics.median(per[s] for _, per in items if s in per), 3),
                                             "rows": sum(1 for _, per in items if s in per)} for s in counts},
        }
    return out


# The layouts whose rows a 4-stage pipeline matches where the best plan is ~20 % fast.
FOUR_STAGE_LAYOUTS = {("v100", 1, 4), ("v100", 1, 8)}
ACCURACY_RESULTS = Path(__file__).resolve().parent / "results_estimator_accuracy.json"


def dgx2_at_four_stages(rows, loto_results: Path = ACCURACY_RESULTS) -> dict:
    """The targets' figures with the DGX-2's 4- and 8-GPU rows scored as the best plan and
    at 4 stages."""
    held_physics = SharedPhysics(**json.loads(loto_results.read_text())["leave_one_type_out"]["by_gpu_type"]
                                 ["v100"]["physics"])
    out = {}
    for name, physics, pick in (("held_out_v100", held_physics, lambda r: r.gpu_type == "v100"),
                                ("in_distribution", FITTED_PHYSICS, lambda r: not r.in_fit_set)):
        options = physics_options(physics)
        best, four = [], []
        for row in rows:
            if row.measured_s <= 0 or not pick(row):
                continue
            times = stage_times(row, options)
            best.append(accuracy(min(times.values()) if times else None, row.measured_s))
            at_four = (row.gpu_type, row.num_nodes, row.gpus_per_node) in FOUR_STAGE_LAYOUTS and 4 in times
            four.append(accuracy(times[4], row.measured_s) if at_four else best[-1])
        out[name] = {"best_plan": summarize(best), "dgx2_4_and_8_at_4_stages": summarize(four)}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", type=Path, default=DEFAULT_DATA)
    ap.add_argument("--gpu-type", help="only this GPU type's rows")
    ap.add_argument("--out", type=Path, help="also write the JSON here")
    args = ap.parse_args()
    result = {"command": "python benchmarks/estimator_stage_counts.py"
              + (f" --gpu-type {args.gpu_type}" if args.gpu_type else ""),
              "layouts": by_layout(load_rows(args.data), args.gpu_type)}
    if not args.gpu_type:
        result["dgx2_at_four_stages"] = dgx2_at_four_stages(load_rows(args.data))
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
