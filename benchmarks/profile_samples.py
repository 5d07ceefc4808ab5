"""Fewer sample counts in a profile: what interpolating the dropped ones costs in accuracy.

A GPU profile times every layer share at each sample count of its settings, and each
count is a forward and a forward+backward program to compile (and autotune): the cost of
a profile grows with the number of counts. This takes a kept store measured at every
count (1, 2, 4, 8, 16), keeps only ``--keep`` (default 1 4 16: the profiler's GPU default),
and reports against the store's own measurements:

- **layer shares**: each dropped count's time interpolated from the kept ones, as the
  estimator does (``estimator.profile_fit.profiled_layer_s``), over the measured one; per
  sample count and per tp, forward and forward+backward, each distinct share once;
- **plans measured on the GPU** (``benchmarks/profile_accuracy.py``'s rows): their profiled
  step time and peak memory from the full store and from the reduced one, and the time
  accuracy of each against the measured step.

The reference is the store's own measurement (or the measured whole step), never the
interpolation itself. Prints JSON (``benchmarks.bench_output.emit``)::

    python benchmarks/profile_samples.py --gpu-type h200 --keep 1 4 16
"""

from __future__ import annotations

import argparse
import shutil
import sqlite3
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.bench_output import emit  # noqa: E402
from benchmarks.estimator_accuracy import accuracy  # noqa: E402
from benchmarks.memory_accuracy import score_plan_text  # noqa: E402
from benchmarks.profile_accuracy import measured_rows  # noqa: E402
from estimator.profile_fit import profiled_layer_s  # noqa: E402
from estimator.profile_store import LayerTiming, load_profile_view  # noqa: E402

HERE = Path(__file__).resolve().parent


def _summary(values: list[float]) -> dict:
    return {"n": len(values), "median": round(statistics.median(values), 4),
            "mean": round(statistics.fmean(values), 4), "min": round(min(values), 4),
            "max": round(max(values), 4)}


def reduced(timing: LayerTiming, keep: tuple[int, ...]) -> LayerTiming:
    """The timing with only the ``keep`` sample counts."""
    idx = [i for i, s in enumerate(timing.samples) if s in keep]
    temp = timing.backward_temp_bytes
    return LayerTiming(tuple(timing.samples[i] for i in idx), tuple(timing.forward_s[i] for i in idx),
                       tuple(timing.forward_backward_s[i] for i in idx),
                       tuple(temp[i] for i in idx) if temp else ())


def layer_errors(db: str, gpu: str, keep: tuple[int, ...]) -> dict:
    """Interpolated ÷ measured time at every dropped sample count, each distinct share once."""
    view = load_profile_view(db)
    seen, by_samples, by_tp = set(), {}, {}
    for (g, _fp, _layer, tp), timing in view.layers.items():
        key = (tp, timing.samples, timing.forward_s, timing.forward_backward_s)
        if g != gpu or key in seen or not set(keep) <= set(timing.samples):
            continue
        seen.add(key)
        small = reduced(timing, keep)
        for s, f, fb in zip(timing.samples, timing.forward_s, timing.forward_backward_s):
            if s in keep:
                continue
            est_fb = profiled_layer_s(small, s, remat=False)
            est_f = profiled_layer_s(small, s, remat=True) - est_fb
            for bucket in (by_samples.setdefault(f"samples{s}", {}), by_tp.setdefault(f"tp{tp}", {})):
                bucket.setdefault("forward", []).append(est_f / f)
                bucket.setdefault("forward_backward", []).append(est_fb / fb)
    if not seen:
        raise SystemExit(f"error: no {gpu} layer shares measured at every count of {keep}")
    every = [r for b in by_samples.values() for v in b.values() for r in v]
    if not every:
        raise SystemExit(f"error: keeping {keep} drops no sample count the store measured")
    totals = model_totals(view, gpu, keep)
    return {"shares": len(seen), "models": totals,
            "models_abs_error": _summary([abs(r - 1.0) for r in totals.values()]),
            "ratio_by_samples": {k: {p: _summary(v) for p, v in b.items()} for k, b in sorted(by_samples.items())},
            "ratio_by_tp": {k: {p: _summary(v) for p, v in b.items()} for k, b in sorted(by_tp.items())},
            "abs_error_all": _summary([abs(r - 1.0) for r in every])}


def model_totals(view, gpu: str, keep: tuple[int, ...]) -> dict:
    """Per model and tp, every layer's forward+backward summed (what a whole-model stage
    takes) at each dropped count: interpolated ÷ measured. Weighs each share by its time,
    so a tiny layer's noisy millisecond does not count as much as a transformer block."""
    names = _model_names(view.path)
    sums: dict[tuple[str, int, int], list[float]] = {}
    for (g, fp, _layer, tp), timing in view.layers.items():
        if g != gpu or not set(keep) <= set(timing.samples):
            continue
        small = reduced(timing, keep)
        for s, fb in zip(timing.samples, timing.forward_backward_s):
            if s not in keep:
                total = sums.setdefault((fp, tp, s), [0.0, 0.0])
                total[0] += profiled_layer_s(small, s, remat=False)
                total[1] += fb
    return {f"{names.get(fp, fp)} tp{tp} samples{s}": round(est / meas, 4)
            for (fp, tp, s), (est, meas) in sorted(sums.items())}


def _model_names(db: str) -> dict[str, str]:
    """The model name the store recorded for each fingerprint."""
    conn = sqlite3.connect(db)
    try:
        return dict(conn.execute("SELECT DISTINCT model_fingerprint, model FROM layers"))
    finally:
        conn.close()


def reduced_store(db: str, keep: tuple[int, ...], directory: str) -> str:
    """A copy of the store whose layer rows are only at the ``keep`` sample counts."""
    path = str(Path(directory) / "reduced.sqlite")
    shutil.copyfile(db, path)
    conn = sqlite3.connect(path)
    try:
        conn.execute(f"DELETE FROM layers WHERE samples NOT IN ({','.join('?' * len(keep))})", keep)
        conn.commit()
    finally:
        conn.close()
    return path


def plan_effects(db: str, gpu: str, keep: tuple[int, ...]) -> dict:
    """Every plan measured on the GPU, profiled from the full store and the reduced one."""
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        small = reduced_store(db, keep, tmp)
        for r in measured_rows(gpu):
            full = score_plan_text(r["model"], r["global_batch"], r["plan"], gpu, profile_db=db)
            part = score_plan_text(r["model"], r["global_batch"], r["plan"], gpu, profile_db=small)
            rows.append({"model": r["model"], "plan": r["plan"], "step_s": r["step_s"],
                         "full_s": round(full.iteration_time_s, 4), "reduced_s": round(part.iteration_time_s, 4),
                         "time_reduced_over_full": round(part.iteration_time_s / full.iteration_time_s, 4),
                         "memory_reduced_over_full": round(part.peak_memory_gb / full.peak_memory_gb, 4),
                         "full_time_accuracy": round(accuracy(full.iteration_time_s, r["step_s"]), 4),
                         "reduced_time_accuracy": round(accuracy(part.iteration_time_s, r["step_s"]), 4)})
    return {"rows": rows,
            "summary": {k: _summary([r[k] for r in rows]) for k in
                        ("time_reduced_over_full", "memory_reduced_over_full",
                         "full_time_accuracy", "reduced_time_accuracy")}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gpu-type", default="h200", help="the GPU type of the store and the measured plans")
    ap.add_argument("--profile-db", help="a store measured at every count of the profiler's settings "
                                         "(default: the GPU type's kept here, results_profile_<gpu>.sqlite)")
    ap.add_argument("--keep", type=int, nargs="+", default=[1, 4, 16], help="sample counts kept (default 1 4 16)")
    ap.add_argument("--json", metavar="OUT", help="also write the JSON here")
    args = ap.parse_args(argv)
    db = args.profile_db or str(HERE / f"results_profile_{args.gpu_type}.sqlite")
    if not Path(db).is_file():
        raise SystemExit(f"error: no profile store {db}")
    keep = tuple(sorted(set(args.keep)))
    shown = Path(db).resolve()
    shown = shown.relative_to(ROOT) if shown.is_relative_to(ROOT) else shown
    emit({"gpu_type": args.gpu_type, "profile_db": str(shown), "kept_samples": list(keep),
          "layer_shares": layer_errors(db, args.gpu_type, keep),
          "plans": plan_effects(db, args.gpu_type, keep)}, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
