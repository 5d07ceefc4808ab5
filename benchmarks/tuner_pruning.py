"""Pruned vs exhaustive plan tuning over a documented set of Cells; prints JSON.

For every Cell the tuner scores the whole plan space (``--prune none``: stage partitions
near the balanced one × every (dp, tp) per stage × micro-batch counts × remat) and the
Crius/Arena-pruned space (``--prune cell``), with the same analytic scoring. Reported per
Cell: candidates scored each way, their ratio, both best iteration times, and the quality
ratio full best / pruned best (1.0 = the pruned search found the optimum; ≥ 0.97 is the
target) with ≥ 5× fewer candidates overall.

Usage: ``python benchmarks/tuner_pruning.py [--cluster crius-1280]``
"""

import argparse
import json
import math
import sys
import time

from estimator.cells import Cell
from estimator.cluster import load_cluster
from estimator.jobs import JobSpec
from estimator.tuner import TuneOptions, tune

# (model, global batch, GPU type, GPUs, GPUs per node, stages): the three families, 4-16
# GPUs, 1-4 stages, every GPU type of the measured tables, global batches of the traces.
CELLS = (
    ("gpt-760m", 128, "a10", 4, 2, 1),
    ("gpt-1.3b", 256, "a100", 8, 4, 2),
    ("gpt-1.3b", 256, "v100", 16, 16, 2),
    ("gpt-2.6b", 256, "a100", 16, 4, 4),
    ("gpt-2.6b", 512, "a40", 8, 2, 4),
    ("gpt-6.7b", 128, "a100", 16, 4, 4),
    ("moe-690m", 256, "a10", 4, 2, 2),
    ("moe-1.3b", 256, "a40", 8, 2, 2),
    ("moe-2.4b", 512, "a100", 16, 4, 2),
    ("moe-10b", 512, "v100", 16, 16, 4),
    ("wide_resnet-500m", 256, "a10", 4, 2, 1),
    ("wide_resnet-1b", 256, "v100", 8, 16, 1),
    ("wide_resnet-2b", 512, "a100", 16, 4, 4),
    ("wide_resnet-4b", 1024, "a100", 16, 4, 2),
)


def run(cluster_name: str) -> dict:
    cluster = load_cluster(cluster_name)
    rows = []
    for model, batch, gpu, n, gpn, stages in CELLS:
        job, cell = JobSpec(model, batch), Cell(gpu, n, gpn, stages)
        t0 = time.perf_counter()
        full = tune(job, cell, cluster, TuneOptions(prune="none"))
        t1 = time.perf_counter()
        pruned = tune(job, cell, cluster, TuneOptions(prune="cell"))
        t2 = time.perf_counter()
        fb, pb = full.best.score, pruned.best.score
        quality = fb.iteration_time_s / pb.iteration_time_s if fb.feasible and pb.feasible else None
        rows.append({
            "model": model, "global_batch": batch, "cell": cell.label(),
            "candidates_full": full.candidates_evaluated,
            "candidates_pruned": pruned.candidates_evaluated,
            "reduction": round(full.candidates_evaluated / pruned.candidates_evaluated, 2),
            "best_full_s": round(fb.iteration_time_s, 5) if fb.feasible else None,
            "best_pruned_s": round(pb.iteration_time_s, 5) if pb.feasible else None,
            "quality": round(quality, 4) if quality is not None else None,
            "feasible_full": fb.feasible, "feasible_pruned": pb.feasible,
            "plan_full": full.plan_string(), "plan_pruned": pruned.plan_string(),
            "tune_full_s": round(t1 - t0, 3), "tune_pruned_s": round(t2 - t1, 3),
        })
    qualities = [r["quality"] for r in rows if r["quality"] is not None]
    total_full = sum(r["candidates_full"] for r in rows)
    total_pruned = sum(r["candidates_pruned"] for r in rows)
    return {
        "cluster": cluster_name, "cells": rows,
        "summary": {
            "cells": len(rows),
            "candidates_full": total_full, "candidates_pruned": total_pruned,
            "reduction_total": round(total_full / total_pruned, 2),
            "reduction_geomean": round(math.exp(sum(math.log(r["reduction"]) for r in rows) / len(rows)), 2),
            "quality_min": min(qualities) if qualities else None,
            "quality_mean": round(sum(qualities) / len(qualities), 4) if qualities else None,
            "feasibility_agrees": all(r["feasible_full"] == r["feasible_pruned"] for r in rows),
            "meets_target": bool(qualities) and min(qualities) >= 0.97
            and total_full >= 5 * total_pruned,
        },
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cluster", default="crius-1280")
    args = parser.parse_args(argv)
    json.dump(run(args.cluster), sys.stdout, indent=1)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
