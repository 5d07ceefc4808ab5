"""Which pipeline stage count the measured rows look like, per allocation.

The measured table holds the time of the plan Alpa's search chose, not the plan. For each
GPU type and layout (nodes × GPUs per node), this prints the median accuracy of the
estimator's best plan (what ``estimator_accuracy.py`` scores) beside the median accuracy of
the estimate with each stage count held fixed, over the rows where that count fits. A
layout whose rows a fixed count matches much better than the best plan suggests the
measurement ran that pipeline, where the estimator finds a faster plan.

    python benchmarks/estimator_stage_counts.py [--gpu-type v100] [--out FILE]

Shipped shared physics; a few seconds on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from estimator_accuracy import DEFAULT_DATA, MEASURED_CLUSTER, accuracy, load_rows, physics_options  # noqa: E402

from estimator.cells import Cell  # noqa: E402
from estimator.compute import FITTED_PHYSICS  # noqa: E402
from estimator.estimate import estimate_cell, stage_counts  # noqa: E402
from estimator.jobs import JobSpec  # noqa: E402
from estimator.models import load_model  # noqa: E402


def by_layout(rows, gpu_type: str | None) -> dict[str, dict]:
    options = physics_options(FITTED_PHYSICS)
    groups: dict[str, list[tuple[float, dict[int, float]]]] = {}
    for row in rows:
        if row.measured_s <= 0 or (gpu_type and row.gpu_type != gpu_type):
            continue
        n = row.num_nodes * row.gpus_per_node
        job = JobSpec(row.model, row.global_batch)
        times = {}
        for s in stage_counts(n, load_model(row.model).num_layers):
            e = estimate_cell(job, Cell(row.gpu_type, n, row.gpus_per_node, s), MEASURED_CLUSTER, options)
            if e.feasible:
                times[s] = e.iteration_time_s
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", type=Path, default=DEFAULT_DATA)
    ap.add_argument("--gpu-type", help="only this GPU type's rows")
    ap.add_argument("--out", type=Path, help="also write the JSON here")
    args = ap.parse_args()
    result = {"command": "python benchmarks/estimator_stage_counts.py"
              + (f" --gpu-type {args.gpu_type}" if args.gpu_type else ""),
              "layouts": by_layout(load_rows(args.data), args.gpu_type)}
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
