"""A trial: six efficiency parameters shared by every GPU type, with two datasheet facts,
tested by leaving one GPU type out. The earlier baseline of the shipped datasheet model
(``estimator.compute.SharedPhysics``, measured by ``benchmarks/estimator_accuracy.py``).

The shipped estimator fits six parameters per GPU type (``estimator/compute.py``) and
gives an unmeasured type the per-field median. Here one set is shared by all types; per
type only datasheet facts differ:

- GPUs whose second fp32 datapath is shared with integer work (a40, a10, l20) get half
  their datasheet fp32 rate for fp32 convolutions;
- the kernel size at which a GPU reaches half its rate (``half_rate_gflop``) is a shared
  time constant times the GPU's fp16 tensor peak.

For each type: fit on the other three types' fit-subset rows (robust least squares, as
``benchmarks/estimator_accuracy.py --fit``), test on every row of the held-out type that
ran. Then once more fitted on every type's fit subset, tested on the rows not used for
fitting (in distribution). Takes about 10 minutes on 2 cores.

Prints one JSON object: ``{"command", "leave_one_type_out": {TYPE: {"rows", "median",
"mean", "worst", "shared": [...]}}, "in_distribution": {"overall", "by_gpu_type",
"shared"}}`` with ``shared`` = (matmul_frac, conv_frac, memory_frac, layer overhead µs,
half-rate time constant µs, inter_node_frac).

Usage: ``python benchmarks/estimator_shared_fit.py [--out FILE]``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from estimator.compute import Efficiency  # noqa: E402
from estimator.gpus import CATALOG  # noqa: E402
from estimator_accuracy import (DEFAULT_DATA, MICRO_BATCHES, EstimateOptions, accuracy, estimate_row,  # noqa: E402
                                load_rows, summarize)
from bench_output import emit  # noqa: E402

SHARED_INT_FP32 = frozenset({"a40", "a10", "l20"})  # GA10x / AD10x: half the fp32 lanes also do integer work
START = (0.65, 0.6, 0.8, 100.0, 100.0, 0.5)
LOWER, UPPER = (0.2, 0.05, 0.2, 0.0, 0.0, 0.05), (0.9, 0.9, 0.95, 2000.0, 2000.0, 1.0)


def efficiency_of(gpu_type: str, shared) -> Efficiency:
    g = CATALOG[gpu_type]
    issue = 0.5 if gpu_type in SHARED_INT_FP32 else 1.0
    return Efficiency(shared[0], shared[1] * issue, shared[2], shared[3] * 1e-6,
                      shared[4] * 1e-6 * g.fp16_tflops * 1e3, shared[5])


def _options(shared) -> EstimateOptions:
    return EstimateOptions(micro_batches=MICRO_BATCHES, efficiency={t: efficiency_of(t, shared) for t in CATALOG})


def _accuracies(shared, rows) -> list[float]:
    options = _options(shared)
    out = []
    for r in rows:
        best = estimate_row(r, options)
        out.append(accuracy(best.iteration_time_s if best else None, r.measured_s))
    return out


def _fit(rows) -> list[float]:
    import numpy as np
    from scipy.optimize import least_squares

    def residuals(x):
        options = _options(x)
        return np.array([((b.iteration_time_s if (b := estimate_row(r, options)) else 1e3) / r.measured_s - 1.0)
                         for r in rows])
    sol = least_squares(residuals, START, bounds=(LOWER, UPPER), diff_step=0.05, max_nfev=40,
                        loss="soft_l1", f_scale=0.15)
    return [round(float(v), 4) for v in sol.x]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", help="also write the JSON to this file")
    args = p.parse_args(argv)
    rows = [r for r in load_rows(DEFAULT_DATA) if r.measured_s > 0]
    types = sorted({r.gpu_type for r in rows})
    loto = {}
    for held in types:
        shared = _fit([r for r in rows if r.gpu_type != held and r.in_fit_set])
        loto[held] = dict(summarize(_accuracies(shared, [r for r in rows if r.gpu_type == held])), shared=shared)
        print(held, json.dumps(loto[held]), file=sys.stderr, flush=True)
    shared = _fit([r for r in rows if r.in_fit_set])
    test = [r for r in rows if not r.in_fit_set]
    in_dist = {"overall": summarize(_accuracies(shared, test)),
               "by_gpu_type": {t: summarize(_accuracies(shared, [r for r in test if r.gpu_type == t])) for t in types},
               "shared": shared}
    emit({"command": "python benchmarks/estimator_shared_fit.py", "leave_one_type_out": loto,
          "in_distribution": in_dist}, args.out, default=float)
    return 0


if __name__ == "__main__":
    sys.exit(main())
