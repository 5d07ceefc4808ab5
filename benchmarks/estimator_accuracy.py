"""Estimator accuracy against the measured iteration times of the Crius/Arena artifact.

For every row of ``measured_iter_time.csv`` with a measured time: the analytic estimate for
the same model, global batch, GPU type, nodes and GPUs per node (best over stage counts
and assembled plans, 16 micro-batches, rematerialization on — the measurement's settings;
MoE stages may shard their experts over data parallelism, GShard's layout, which Alpa's
auto-sharding finds for these runs: ``EstimateOptions.expert_parallel``).
Accuracy = 1 − |estimate − measured| / measured (floored at 0; an estimate of "infeasible"
for a row that ran scores 0). Reported overall, per GPU type and per family, separately
for the rows used to fit the efficiency parameters and for the rest; plus agreement on
out-of-memory rows (measured −1 vs predicted infeasible).

The efficiency parameters are shared by every GPU type (``estimator.compute.SharedPhysics``);
each type's own come from its datasheet (``datasheet_efficiency``). Leave one GPU type out
(``leave_one_type_out``): the shared parameters are refitted on the fit subset of the other
three types only, and every row of the fourth that ran is estimated with its datasheet and
those: how the estimator does on a GPU nobody has measured. The in-distribution split
(``holdout``: rows not used for fitting, all four types fitted) stays beside it, and the
worst rows of each are listed (``worst_rows``).

The fit subset is fixed: rows whose CRC-32 of "model,global_batch,gpu_type,num_nodes,
gpus_per_node" is divisible by 3 (about a third of the table).

    python benchmarks/estimator_accuracy.py [--fit] [--no-loto] [--data ../shared/data/perf/measured_iter_time.csv]

``--fit`` refits the shared parameters on the fit subset and prints them (paste them into
``FITTED_PHYSICS`` in ``estimator/compute.py``); without it the shipped ones are evaluated.
Leaving each type out refits four times (about 2 minutes on 2 cores); ``--no-loto`` skips it.
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
from estimator.compute import FITTED_PHYSICS, SharedPhysics, datasheet_efficiency  # noqa: E402
from estimator.gpus import CATALOG  # noqa: E402
from estimator.memory import MemoryOptions  # noqa: E402
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
    out["worst_rows"] = worst_rows(per["holdout"])
    out["oom"] = {"rows": oom_total, "agreement": round(oom_agree / oom_total, 4),
                  "measured_oom_rows": oom_rows, "measured_oom_predicted_infeasible": oom_caught,
                  "ran_but_predicted_infeasible": sum(1 for items in per.values() for _, _, e in items if e is None)}
    return out


def worst_rows(items: list[tuple[Row, float, float | None]], count: int = 8) -> list[dict]:
    """The rows with the lowest accuracy, with estimate ÷ measured (how far and which way)."""
    items = sorted(items, key=lambda item: item[1])[:count]
    return [{"row": r.key.replace(",", " "), "model": r.model, "measured_s": r.measured_s,
             "estimate_s": round(e, 3) if e else None, "ratio": round(e / r.measured_s, 2) if e else None,
             "accuracy": round(a, 3)} for r, a, e in items]


def physics_options(physics: SharedPhysics) -> EstimateOptions:
    """The measurement's settings, every catalog type's parameters from ``physics``."""
    table = {name: datasheet_efficiency(g, physics) for name, g in CATALOG.items()}
    # The measured rows are Alpa's runs: its program's memory (fp16 weights and gradients,
    # master and states split over dp, GPipe's stash) decides which of them fit, not our
    # runner's.
    return EstimateOptions(micro_batches=MICRO_BATCHES, efficiency=table,
                           memory=MemoryOptions(zero_level=1, program="alpa"), expert_parallel=True)


def leave_one_type_out(rows: list[Row]) -> dict:
    """Per GPU type: the shared parameters fitted on the other types' fit subset, then the
    accuracy on all the held-out type's rows that ran, with its own datasheet."""
    out, pooled = {}, []
    for held in sorted({r.gpu_type for r in rows}):
        physics = fit(rows, exclude=held)
        options = physics_options(physics)
        items = []
        for row in rows:
            if row.gpu_type == held and row.measured_s > 0:
                best = estimate_row(row, options)
                est = best.iteration_time_s if best else None
                items.append((row, accuracy(est, row.measured_s), est))
        values = [a for _, a, _ in items]
        out[held] = dict(summarize(values), physics=vars(physics), worst_rows=worst_rows(items, 5))
        print(f"held out {held}: {summarize(values)}", file=sys.stderr, flush=True)
        pooled += values
    return {"by_gpu_type": out, "all": summarize(pooled)}


FIT_FIELDS = ("matmul_frac", "fp32_issue_frac", "memory_frac", "half_rate_gflop_per_sm",
              "inter_node_frac_nvlink", "inter_node_frac_pcie", "conv_half_outputs_k_per_sm")
# The optimiser works within physical bounds: fractions of a datasheet peak in (0, 0.95],
# at most 500 thousand convolution outputs per SM to half-fill a GPU.
FIT_START = (0.65, 0.6, 0.8, 0.5, 0.8, 0.3, 20.0)
FIT_LOWER = (0.2, 0.05, 0.2, 0.0, 0.05, 0.05, 0.0)
FIT_UPPER = (0.95, 0.95, 0.95, 20.0, 1.0, 1.0, 500.0)
# Held, not fitted: the table does not determine the per-layer launch overhead (left free,
# it went to its bound of 0 and every accuracy figure moved by 0.006 at most, while the
# H100's and H200's measured steps of the runner want one: docs/estimator.md). It stays
# where the fit before convolutions' occupancy put it.
HELD_PHYSICS = {"layer_overhead_s": 59.5e-6}


def fit(rows: list[Row], exclude: str | None = None) -> SharedPhysics:
    """Robust least squares (soft L1) on the relative error (estimate − measured) / measured —
    the quantity the accuracy reports — over the fit subset of every type but ``exclude``,
    one parameter set for all types: a few rows the physics cannot explain do not pull the
    others, and no type gets parameters of its own."""
    import numpy as np
    from scipy.optimize import least_squares

    subset = [r for r in rows if r.in_fit_set and r.measured_s > 0 and r.gpu_type != exclude]

    def physics(x) -> SharedPhysics:
        return SharedPhysics(**{f: float(v) for f, v in zip(FIT_FIELDS, x)}, **HELD_PHYSICS)

    def residuals(x):
        opts = physics_options(physics(x))
        return np.array([((b.iteration_time_s if (b := estimate_row(r, opts)) else 1e3) / r.measured_s - 1.0)
                         for r in subset])

    sol = least_squares(residuals, FIT_START, bounds=(FIT_LOWER, FIT_UPPER), diff_step=0.05, max_nfev=60,
                        x_scale="jac", loss="soft_l1", f_scale=0.15)
    fitted = SharedPhysics(**{f: round(float(v), 4) for f, v in zip(FIT_FIELDS, sol.x)}, **HELD_PHYSICS)
    print(f"fitted{' without ' + exclude if exclude else ''}: {fitted} on {len(subset)} rows",
          file=sys.stderr, flush=True)
    return fitted


TARGETS = {"loto_median_each": 0.88, "loto_mean_each": 0.85, "in_distribution_median": 0.93}


def targets(result: dict) -> dict:
    """The issue's targets against this run (each held-out type; the rows not used for fitting)."""
    out = {"in_distribution_median": {"target": TARGETS["in_distribution_median"],
                                      "value": result["holdout"]["overall"]["median"]}}
    loto = result.get("leave_one_type_out", {}).get("by_gpu_type", {})
    if loto:
        out["loto_median_each"] = {"target": TARGETS["loto_median_each"],
                                   "value": min(v["median"] for v in loto.values())}
        out["loto_mean_each"] = {"target": TARGETS["loto_mean_each"],
                                 "value": min(v["mean"] for v in loto.values())}
    for v in out.values():
        v["met"] = v["value"] >= v["target"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", type=Path, default=DEFAULT_DATA)
    ap.add_argument("--fit", action="store_true", help="refit the shared parameters first")
    ap.add_argument("--no-loto", action="store_true", help="skip leaving each GPU type out (4 refits)")
    args = ap.parse_args()
    rows = load_rows(args.data)
    physics = fit(rows) if args.fit else FITTED_PHYSICS
    t0 = time.perf_counter()
    result = evaluate(rows, physics_options(physics))
    result["seconds"] = round(time.perf_counter() - t0, 2)
    result["physics"] = vars(physics)
    if not args.no_loto:
        result["leave_one_type_out"] = leave_one_type_out(rows)
    result["targets"] = targets(result)
    result["fit_rule"] = "crc32('model,global_batch,gpu_type,num_nodes,gpus_per_node') % 3 == 0"
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
