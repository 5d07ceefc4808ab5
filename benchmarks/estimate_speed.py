"""How fast the analytic estimator answers.

Prints JSON: the one-time load of the communication table; the time to estimate every Cell
of one job for each built-in model on crius-1280 (with a requested count of 8 GPUs, and
"serverless" without one); the same for a deep transformer at the model file's layer limit
(1,024 blocks: how the stage partitioning scales with depth); and `slurm-ext estimate
--batch` over one request per row of the measured table (329 requests with GPU type, count
and GPUs per node), run in-process from a cold start of the estimator's caches.

    python benchmarks/estimate_speed.py [--data ../shared/data/perf/measured_iter_time.csv]
"""

import argparse
import contextlib
import csv
import io
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from estimator.cluster import load_cluster  # noqa: E402
from estimator.comm import load_comm_table  # noqa: E402
from estimator.estimate import estimate_job  # noqa: E402
from estimator.jobs import JobSpec  # noqa: E402
from estimator.models import BUILTIN_MODELS  # noqa: E402
from slurm_ext.cli import main as cli_main  # noqa: E402

DEFAULT_DATA = Path(__file__).resolve().parent.parent.parent / "shared/data/perf/measured_iter_time.csv"


def _stats(values: list[float]) -> dict:
    return {"median_s": round(statistics.median(values), 4), "mean_s": round(statistics.fmean(values), 4),
            "max_s": round(max(values), 4)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", type=Path, default=DEFAULT_DATA)
    args = ap.parse_args()

    t0 = time.perf_counter()
    load_comm_table()
    table_s = time.perf_counter() - t0

    cluster = load_cluster("crius-1280")
    per_job = {"requested_8_gpus": [], "serverless": []}
    cells = {"requested_8_gpus": [], "serverless": []}
    for name in BUILTIN_MODELS:
        batch = 256
        for key, gpus in (("requested_8_gpus", 8), ("serverless", None)):
            t0 = time.perf_counter()
            est = estimate_job(JobSpec(name, batch, gpus), cluster)
            per_job[key].append(time.perf_counter() - t0)
            cells[key].append(len(est.cells))

    # A model file at the layer limit: 1,026 layers to split into up to 64 stages.
    deep_job = {}
    with tempfile.TemporaryDirectory() as tmp:
        deep = Path(tmp) / "deep-1024.yaml"
        deep.write_text("hidden: 2048\nlayers: 1024\nheads: 16\nsequence: 2048\nvocab: 50000\n")
        for key, gpus in (("requested_8_gpus", 8), ("serverless", None)):
            t0 = time.perf_counter()
            est = estimate_job(JobSpec(str(deep), 256, gpus), cluster)
            deep_job[key] = {"seconds": round(time.perf_counter() - t0, 2), "cells": len(est.cells),
                             "feasible": sum(c.feasible for c in est.cells)}

    load_comm_table.cache_clear()
    requests = []
    with args.data.open() as f:
        for r in csv.DictReader(f):
            requests.append(json.dumps({"model": f"{r['model']}-{r['param'].lower()}",
                                        "global_batch": int(r["global_batch"]), "gpu_type": r["gpu_type"],
                                        "num_gpus": int(r["num_gpus"]), "gpus_per_node": int(r["gpus_per_node"])}))
    stdin, out = sys.stdin, io.StringIO()
    sys.stdin = io.StringIO("\n".join(requests) + "\n")
    t0 = time.perf_counter()
    with contextlib.redirect_stdout(out):
        code = cli_main(["estimate", "--batch", "-"])
    batch_s = time.perf_counter() - t0
    sys.stdin = stdin
    print(json.dumps({
        "comm_table_load_s": round(table_s, 3),
        "all_cells_of_one_job": {k: {**_stats(v), "cells_median": statistics.median(cells[k]),
                                     "jobs": len(v)} for k, v in per_job.items()},
        "deep_model_1024_layers": deep_job,
        "batch_measured_rows": {"requests": len(requests), "exit_code": code,
                                "results": len(out.getvalue().splitlines()), "seconds": round(batch_s, 2)},
    }, indent=2))


if __name__ == "__main__":
    main()
