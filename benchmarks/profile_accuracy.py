"""Profiled against analytic: each estimate of plans measured on a GPU, beside the
measured step time and peak memory.

The measured plans are those `benchmarks/plan_measure.py` ran on one NVIDIA H200 or H100
(``results_plan_measure_<gpu>_*.json``, ``results_profile_h200_plan_gpt-760m.json`` and the
H200's remat=0 row quoted in ``docs/gpu-measurements.md``). The profile store is what
``job_scripts.profile`` measured on a GPU of the same kind (``benchmarks/profile_gpu_node.sh``;
the store kept is ``results_profile_h200.sqlite``: the H100's was not kept, and its
``results_profile_accuracy_h100.json`` is the record). Each plan is scored with
``estimator.estimate.score_plan`` twice: analytic (the GPU's datasheet and the shared
fitted efficiency) and with the store (``EstimateOptions.profile_db``: profiled layer
times, the profile's fitted efficiency, profiled activation bytes). The model never grades
itself: the store holds one-layer timings, the reference is the whole training step.

Accuracy = 1 − |estimate − measured| / measured, floored at 0. Prints JSON
(``benchmarks.bench_output.emit``)::

    python benchmarks/profile_accuracy.py --gpu-type h200 --profile-db benchmarks/results_profile_h200.sqlite
    python benchmarks/profile_accuracy.py --gpu-type h100 --profile-db STORE  # a store profiled on an H100
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.bench_output import emit  # noqa: E402
from benchmarks.estimator_accuracy import accuracy as _acc, summarize as _summary  # noqa: E402
from benchmarks.memory_accuracy import is_current, measured_plans, plans_in, score_plan_text  # noqa: E402
from job_scripts.pipeline import PROGRAM_REVISION  # noqa: E402
from estimator.models import load_model  # noqa: E402
from estimator.plan_string import parse_plan  # noqa: E402
from estimator.profile_store import load_profile_view, model_fingerprint  # noqa: E402

HERE = Path(__file__).resolve().parent


def measured_rows(gpu: str) -> list[dict]:
    """Every plan measured on one ``gpu`` with its median step time and peak memory."""
    extra = HERE / f"results_profile_{gpu}_plan_gpt-760m.json"  # measured beside the profile
    return measured_plans(gpu) + (plans_in(extra) if extra.is_file() else [])


def profiled_share(view, model: str, plan_text: str, gpu: str) -> float:
    """The share of the model's layers the store's view timed at the plan's tp (1.0: all)."""
    spec = load_model(model)
    tp = parse_plan(plan_text).stages[0][1]
    fp = model_fingerprint(spec)
    n = spec.num_layers
    return sum(view.layer_timing(gpu, fp, i, tp) is not None for i in range(n)) / n


def compare(db: str, gpu: str = "h200") -> dict:
    rows, view = [], load_profile_view(db)
    for r in measured_rows(gpu):
        analytic = score_plan_text(r["model"], r["global_batch"], r["plan"], gpu)
        profiled = score_plan_text(r["model"], r["global_batch"], r["plan"], gpu, profile_db=db)
        row = {**r, "layers_profiled": round(profiled_share(view, r["model"], r["plan"], gpu), 3),
               "analytic_s": round(analytic.iteration_time_s, 4), "profiled_s": round(profiled.iteration_time_s, 4),
               "analytic_time_accuracy": round(_acc(analytic.iteration_time_s, r["step_s"]), 4),
               "profiled_time_accuracy": round(_acc(profiled.iteration_time_s, r["step_s"]), 4)}
        # Scored only on the runner's current program: earlier ones held more in their
        # update (memory_accuracy.gpu_rows), and revisions 6-8 summed a single stage's
        # micro-batches slot by slot, 5-6x slower on a GPU than the same layers now.
        row["current_program"] = is_current(r)
        if r.get("peak_gb") and row["current_program"]:
            row.update({"analytic_gb": round(analytic.peak_memory_gb, 3), "profiled_gb": round(profiled.peak_memory_gb, 3),
                        "analytic_memory_accuracy": round(_acc(analytic.peak_memory_gb, r["peak_gb"]), 4),
                        "profiled_memory_accuracy": round(_acc(profiled.peak_memory_gb, r["peak_gb"]), 4)})
        rows.append(row)
    summary = {key: _summary([r[key] for r in rows if key in r and r["current_program"]])
               for key in ("analytic_time_accuracy", "profiled_time_accuracy",
                           "analytic_memory_accuracy", "profiled_memory_accuracy")}
    shown = Path(db).resolve()
    shown = shown.relative_to(ROOT) if shown.is_relative_to(ROOT) else shown
    return {"gpu_type": gpu, "profile_db": str(shown), "program_revision": PROGRAM_REVISION,
            "rows": rows, "summary": summary}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--profile-db", help="the profile store (default: the GPU type's kept here, "
                                         "results_profile_<gpu>.sqlite)")
    ap.add_argument("--gpu-type", default="h200", help="the GPU type the plans were measured on (default h200)")
    ap.add_argument("--json", metavar="OUT", help="also write the JSON here")
    args = ap.parse_args(argv)
    from estimator.errors import SpecError
    try:
        result = compare(args.profile_db or str(HERE / f"results_profile_{args.gpu_type}.sqlite"), args.gpu_type)
    except SpecError as e:
        print(f"profile_accuracy: {e}", file=sys.stderr)
        return 2
    emit(result, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
