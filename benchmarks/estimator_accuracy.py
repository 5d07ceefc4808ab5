"""Estimator accuracy against the measured iteration times of the Crius/Arena artifact.

For every row of ``measured_iter_time.csv`` with a measured time: the analytic estimate for
the same model, global batch, GPU type, nodes and GPUs per node (best over stage counts
and assembled plans, 16 micro-batches, rematerialization on — the measurement's settings).
Accuracy = 1 − |estimate − measured| / measured (floored at 0; an estimate of "infeasible"
for a row that ran scores 0). Reported overall, per GPU type and per family, separately
for the rows used to fit the efficiency parameters and for the rest; plus agreement on
out-of-memory rows (measured −1 vs predicted infeasible).

Leave one GPU type out (``leave_one_type_out``): every row of one type, estimated as if
that type had never been measured: it gets what the estimator gives an unmeasured type
(``estimator.compute.unmeasured_efficiency``) over the other three types' fitted
parameters. The parameters are fitted per type, so the held-out type's own rows never
reach the others' fit. This is how the estimator does on a GPU nobody has measured.

The fit subset is fixed: rows whose CRC-32 of "model,param,global_batch,gpu_type,
num_nodes,gpus_per_node" is divisible by 3 (about a third of the table).

    python benchmarks/estimator_accuracy.py [--fit] [--data ../shared/data/perf/measured_iter_time.csv]

``--fit`` refits the efficiency parameters on the fit subset and prints them (paste them
into ``estimator/compute.py``); without it the shipped parameters are evaluated.
"""

import argparse
import csv
import json
import statistics
import sys
import time
import zlib
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from estimator.cells import Cell  # noqa: E402
from estimator.cluster import cluster_from_dict  # noqa: E402
from estimator.compute import FITTED_EFFICIENCY, Efficiency, unmeasured_efficiency  # noqa: E402
from estimator.estimate import EstimateOptions, estimate_cell, stage_counts  # noqa: E402
from estimator.jobs import JobSpec  # noqa: E402
from estimator.models import load_model  # noqa: E402

DEFAULT_DATA = Path(__file__).resolve().parent.parent.parent / "shared/data/perf/measured_iter_time.csv"
# The clusters the table was measured on (MODELS.md §4): node sizes and fabrics.
MEASURED_CLUSTER = cluster_from_dict({
    "name": "measured",
    "node_groups": [
        {"gpu_type": "a100", "nodes": 8, "gpus_per_node": 4},
        {"gpu_type": "v100", "nodes": 1, "gpus_per_node": 16},
        {"gpu_type": "a40", "nodes": 8, "gpus_per_node": 2, "network": {"kind": "infiniband"}},
        {"gpu_type": "a10", "nodes": 8, "gpus_per_node": 2},
    ],
})
MICRO_BATCHES = 16


@dataclass(frozen=True)
class Row:
    model: str
    global_batch: int
    gpu_type: str
    num_nodes: int
    gpus_per_node: int
    measured_s: float  # -1 when the run failed (out of memory)

    @property
    def key(self) -> str:
        return f"{self.model},{self.global_batch},{self.gpu_type},{self.num_nodes},{self.gpus_per_node}"

    @property
    def in_fit_set(self) -> bool:
        return zlib.crc32(self.key.encode()) % 3 == 0


def load_rows(path: Path) -> list[Row]:
    rows = []
    with path.open() as f:
        for r in csv.DictReader(f):
            name = f"{r['model']}-{r['param'].lower()}"
            rows.append(Row(name, int(r["global_batch"]), r["gpu_type"], int(r["num_nodes"]),
                            int(r["gpus_per_node"]), float(r["iter_time_s"])))
    return rows


def estimate_row(row: Row, options: EstimateOptions):
    """Best estimate over stage counts for the row's allocation (None if nothing fits)."""
    n = row.num_nodes * row.gpus_per_node
    job = JobSpec(row.model, row.global_batch)
    best = None
    for s in stage_counts(n, load_model(row.model).num_layers):
        e = estimate_cell(job, Cell(row.gpu_type, n, row.gpus_per_node, s), MEASURED_CLUSTER, options)
        if e.feasible and (best is None or e.iteration_time_s < best.iteration_time_s):
            best = e
    return best


def accuracy(est_s: float | None, measured_s: float) -> float:
    if est_s is None:
        return 0.0
    return max(0.0, 1.0 - abs(est_s - measured_s) / measured_s)


def summarize(values: list[float]) -> dict:
    if not values:
        return {"rows": 0}
    return {"rows": len(values), "median": round(statistics.median(values), 4),
            "mean": round(statistics.fmean(values), 4), "worst": round(min(values), 4)}


def evaluate(rows: list[Row], options: EstimateOptions) -> dict:
    per: dict[str, list[tuple[Row, float, float | None]]] = {"fit": [], "holdout": []}
    oom_agree = oom_total = oom_caught = oom_rows = 0
    for row in rows:
        best = estimate_row(row, options)
        est = best.iteration_time_s if best else None
        if row.measured_s < 0:
            oom_rows += 1
            oom_caught += best is None
        else:
            per["fit" if row.in_fit_set else "holdout"].append((row, accuracy(est, row.measured_s), est))
        oom_total += 1
        oom_agree += (row.measured_s < 0) == (best is None)
    out = {}
    for split, items in per.items():
        out[split] = {
            "overall": summarize([a for _, a, _ in items]),
            "by_gpu_type": {t: summarize([a for r, a, _ in items if r.gpu_type == t])
                            for t in sorted({r.gpu_type for r, _, _ in items})},
            "by_family": {f: summarize([a for r, a, _ in items if r.model.split("-")[0] == f])
                          for f in sorted({r.model.split("-")[0] for r, _, _ in items})},
        }
    out["oom"] = {"rows": oom_total, "agreement": round(oom_agree / oom_total, 4),
                  "measured_oom_rows": oom_rows, "measured_oom_predicted_infeasible": oom_caught,
                  "ran_but_predicted_infeasible": sum(1 for items in per.values() for _, _, e in items if e is None)}
    return out


def leave_one_type_out(rows: list[Row], fitted: dict[str, Efficiency]) -> dict:
    """Per GPU type: the accuracy on all its rows that ran when its parameters are those
    of an unmeasured type derived from the other types' (see the module docstring)."""
    out, pooled = {}, []
    for held in sorted(fitted):
        others = {t: e for t, e in fitted.items() if t != held}
        table = dict(others, **{held: unmeasured_efficiency(others)})
        options = EstimateOptions(micro_batches=MICRO_BATCHES, efficiency=table)
        values = []
        for row in rows:
            if row.gpu_type == held and row.measured_s > 0:
                best = estimate_row(row, options)
                values.append(accuracy(best.iteration_time_s if best else None, row.measured_s))
        out[held] = summarize(values)
        pooled += values
    return {"by_gpu_type": out, "all": summarize(pooled)}


def fit(rows: list[Row]) -> dict[str, Efficiency]:
    """Robust least squares (soft L1) on the relative error (estimate − measured) / measured —
    the quantity the accuracy reports — over the fit subset, per
    GPU type: a few rows the physics cannot explain do not pull the others."""
    import numpy as np
    from scipy.optimize import least_squares

    fitted = dict(FITTED_EFFICIENCY)
    for t in sorted({r.gpu_type for r in rows}):
        subset = [r for r in rows if r.gpu_type == t and r.in_fit_set and r.measured_s > 0]

        def residuals(x, subset=subset, t=t):
            eff = dict(fitted)
            eff[t] = Efficiency(x[0], x[1], x[2], x[3] * 1e-6, x[4], x[5])
            opts = EstimateOptions(micro_batches=MICRO_BATCHES, efficiency=eff)
            res = []
            for r in subset:
                b = estimate_row(r, opts)
                res.append((b.iteration_time_s if b else 1e3) / r.measured_s - 1.0)
            return np.array(res)

        x0 = [0.6, 0.4, 0.6, 200.0, 5.0, 0.5]
        sol = least_squares(residuals, x0, bounds=([0.2, 0.05, 0.2, 0.0, 0.0, 0.05], [0.85, 0.85, 0.9, 2000.0, 500.0, 1.0]),
                            diff_step=0.05, max_nfev=60, loss="soft_l1", f_scale=0.15)
        fitted[t] = Efficiency(*(round(float(v), 4) for v in sol.x[:3]), round(float(sol.x[3]) * 1e-6, 8),
                               round(float(sol.x[4]), 3), round(float(sol.x[5]), 4))
        print(f"fitted {t}: {fitted[t]} on {len(subset)} rows", file=sys.stderr)
    return fitted


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", type=Path, default=DEFAULT_DATA)
    ap.add_argument("--fit", action="store_true", help="refit the efficiency parameters first")
    args = ap.parse_args()
    rows = load_rows(args.data)
    eff = fit(rows) if args.fit else None
    options = EstimateOptions(micro_batches=MICRO_BATCHES, efficiency=eff)
    t0 = time.perf_counter()
    result = evaluate(rows, options)
    result["leave_one_type_out"] = leave_one_type_out(rows, eff or FITTED_EFFICIENCY)
    result["seconds"] = round(time.perf_counter() - t0, 2)
    result["fit_rule"] = "crc32('model,global_batch,gpu_type,num_nodes,gpus_per_node') % 3 == 0"
    if eff:
        result["efficiency"] = {k: vars(v) for k, v in eff.items()}
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
