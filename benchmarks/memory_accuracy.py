"""Memory accuracy: the analytic peak memory per GPU against every figure we have.

Sources (each row names its own):

- ``h200``, ``h100``: peak memory measured on one NVIDIA H200 or H100 by
  ``benchmarks/plan_measure.py`` (``docs/gpu-measurements.md``; the results JSONs beside
  this script, and the H200's remat=0 row of gpt-760m quoted in that document). Neither
  type is in the fitted tables: both are estimated from their datasheets.
- ``gpu-target``: the runner's own program (``job_scripts.pipeline.Pipeline``) compiled for
  an XLA GPU target on a CPU-only machine (the ``gpu-target`` extra), its
  ``memory_analysis()`` peak plus the estimator's 1 GB reserve
  (``benchmarks/results_memory_gpu_target.json``, made by ``memory_gpu_target.py``).
  Summaries: all rows, the ZeRO-1 ones, the ZeRO-2 ones (compiled after ZeRO-2's memory
  was modelled), the ZeRO-3 ones, the pipelines, ``held_out``: plans first compiled after
  the pipelines' memory was modelled from the others, and ``zero3_held_out``: ZeRO-3
  plans first compiled after ZeRO-3's memory was modelled from the other six.
- ``alpa-dp``: the per-GPU data-parallel figures of ``MODELS.md``, estimated for Alpa's
  program (``MemoryOptions(program="alpa", zero_level=1)``), not the runner's.

Accuracy = 1 − |estimate − reference| / reference. ``python benchmarks/memory_accuracy.py``
prints JSON; ``--json FILE`` also writes it.
"""

import argparse
import json
import statistics
import sys
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from estimator.cells import Cell  # noqa: E402
from estimator.estimate import EstimateOptions, partition_stages, score_plan  # noqa: E402
from estimator.jobs import JobSpec  # noqa: E402
from estimator.memory import MemoryOptions  # noqa: E402
from estimator.models import load_model  # noqa: E402
from job_scripts.pipeline import PROGRAM_REVISION, describes_current  # noqa: E402
from estimator.plan_string import parse_plan  # noqa: E402

HERE = Path(__file__).resolve().parent
GPU_TARGET_FILE = HERE / "results_memory_gpu_target.json"
# docs/gpu-measurements.md: an earlier --auto run kept only its progress line.
H200_EXTRA = [{"model": "gpt-760m", "global_batch": 8,
               "plan": "cell=h200x1:s1 plan=[dp1tp1] mb=1 remat=0", "peak_gb": 42.6, "step_s": 0.1440,
               "program_revision": 1}]
# MODELS.md, database/dp_mem.json (Alpa, data parallel only, 16 micro-batches, remat).
ALPA_DP = {("wide_resnet-500m", 256): [24.519, 15.847, 10.932, 8.484, 7.259],
           ("gpt-760m", 128): [24.129, 13.519, 9.108, 6.902, -1],
           ("gpt-1.3b", 256): [-1, 23.89, 15.684, 11.82, 9.888],
           ("moe-690m", 256): [23.964, 12.955, 8.426, 6.201, -1]}


def estimate_plan_gb(model: str, global_batch: int, plan_text: str, gpu: str = "h200",
                     memory: MemoryOptions = MemoryOptions()) -> float:
    """The analytic peak GB per GPU of one plan string on ``gpu``."""
    return score_plan_text(model, global_batch, plan_text, gpu, memory).peak_memory_gb


def score_plan_text(model: str, global_batch: int, plan_text: str, gpu: str = "h200",
                    memory: MemoryOptions = MemoryOptions(), profile_db: str | None = None):
    """The score (seconds per iteration, peak GB per GPU) of one plan string: analytic, or
    from a profile store's measurements where it has them."""
    ps = parse_plan(plan_text)
    if ps.zero_level or ps.offload:  # the plan's own memory settings (ZeRO-1 …)
        memory = replace(memory, zero_level=ps.zero_level, offload=ps.offload)
    spec = load_model(model)
    cell = Cell(gpu, ps.num_gpus, max(ps.num_gpus, 1), ps.num_stages)
    stages = ps.stage_plans(partition_stages(spec, cell))
    opts = EstimateOptions(memory=memory, profile_db=profile_db)
    cluster = _cluster()
    return score_plan(JobSpec(model, global_batch), cell, cluster, stages, ps.micro_batches,
                      ps.remat, opts)


def _cluster():
    from estimator.cluster import ClusterSpec, Network, NodeGroup
    return ClusterSpec("bench", tuple(NodeGroup(t, 8, 8, t, Network()) for t in
                                      ("h200", "h100", "a100", "v100", "a40", "a10")))


def _acc(est: float, ref: float) -> float:
    return max(0.0, 1 - abs(est - ref) / ref)


def summary(rows: list[dict]) -> dict:
    accs = [r["accuracy"] for r in rows]
    if not accs:
        return {"rows": 0}
    return {"rows": len(accs), "median": round(statistics.median(accs), 4),
            "mean": round(statistics.fmean(accs), 4), "worst": round(min(accs), 4)}


MEASURED_GPUS = ("h200", "h100")  # GPU types with plan_measure results beside this script


def measured_plans(gpu: str) -> list[dict]:
    """Every plan ``benchmarks/plan_measure.py`` measured on one ``gpu`` (its results JSONs
    beside this script), with its median step time and peak memory."""
    rows = [r for path in sorted(HERE.glob(f"results_plan_measure_{gpu}_*.json"))
            for r in plans_in(path) if r["peak_gb"]]
    return rows + (H200_EXTRA if gpu == "h200" else [])


# A measured peak this many times the compiled step's holds the compile's own scratch:
# XLA's convolution autotuner takes what the GPU has free while it times candidates
# (Wide-ResNet on an H200: 117 GB measured, 9.7 GB compiled), then gives it back.
AUTOTUNE_SCRATCH_RATIO = 1.5


def plans_in(path: Path) -> list[dict]:
    """The plans of one ``plan_measure.py`` results JSON that ran: model, global batch,
    plan, median step seconds and peak GB (None off a GPU): the measured peak, or the
    compiled step's on the same GPU where the measured one holds the autotuner's scratch
    (``peak_source`` says which)."""
    data = json.loads(path.read_text())
    rows = []
    for p in data["plans"]:
        if not p.get("ok"):
            continue
        peak, compiled = p["measured"].get("peak_memory_gb"), p["measured"].get("compiled_memory_gb")
        scratch = bool(peak and compiled and peak > AUTOTUNE_SCRATCH_RATIO * compiled)
        rows.append({"model": data["model"], "global_batch": data["global_batch"], "plan": p["plan"],
                     "peak_gb": compiled if scratch else peak, "step_s": p["measured"]["step_s"]["median"],
                     "peak_source": "compiled on the GPU (the measured peak holds the autotuner's scratch)"
                     if scratch else "measured",
                     "source": path.name, "program_revision": data.get("program_revision", 1)})
    return rows


def gpu_rows(gpu: str, current: bool = True) -> list[dict]:
    """The measured plans of one GPU type against today's estimates: those of the runner's
    current program (``current``), or those measured on an earlier one (its update packed
    new per-layer buffers: more memory, more time), which today's model no longer
    describes and are kept as a record."""
    out = []
    for r in measured_plans(gpu):
        if is_current(r) != current:
            continue
        score = score_plan_text(r["model"], r["global_batch"], r["plan"], gpu)
        est = score.peak_memory_gb
        out.append({**r, "source": gpu, "estimate_gb": round(est, 3), "accuracy": round(_acc(est, r["peak_gb"]), 4),
                    "estimate_step_s": round(score.iteration_time_s, 4),
                    "time_accuracy": round(_acc(score.iteration_time_s, r["step_s"]), 4)})
    return out


def is_current(row: dict) -> bool:
    """Whether a row measured or compiled the runner's current program for its plan."""
    plan = parse_plan(row["plan"])
    split = plan.zero_level >= 2 and any(dp > 1 for dp, _ in plan.stages)
    return describes_current(row.get("program_revision", 1), plan.num_stages, plan.micro_batches, split)


def gpu_target_rows() -> list[dict]:
    """The GPU-target compiles of the runner's current program (``is_current``)."""
    if not GPU_TARGET_FILE.is_file():
        return []
    out = []
    for r in json.loads(GPU_TARGET_FILE.read_text())["rows"]:
        if not is_current(r):
            continue
        ref = r["compiled_peak_gb"] + MemoryOptions().reserve_gb
        est = estimate_plan_gb(r["model"], r["global_batch"], r["plan"], r.get("gpu_type", "h100"))
        out.append({**r, "source": "gpu-target", "reference_gb": round(ref, 3), "estimate_gb": round(est, 3),
                    "accuracy": round(_acc(est, ref), 4)})
    return out


def alpa_rows() -> list[dict]:
    out = []
    for (model, batch), figures in ALPA_DP.items():
        for k, gb in enumerate(figures):
            n = 2 ** k
            if gb <= 0 or (batch // 16) % n:
                continue
            plan = f"cell=a100x{n}:s1 plan=[dp{n}tp1] mb=16 remat=1"
            # Alpa's program: master and states split over dp by its reduce-scatter (ZeRO-1),
            # every micro-batch's stash kept (GPipe, even on one stage).
            est = estimate_plan_gb(model, batch, plan, "a100", MemoryOptions(zero_level=1, program="alpa"))
            out.append({"model": model, "global_batch": batch, "plan": plan, "peak_gb": gb, "source": "alpa-dp",
                        "estimate_gb": round(est, 3), "accuracy": round(_acc(est, gb), 4)})
    return out


def zero_over(rows: list[dict], level: int, base: int) -> list[dict]:
    """What ZeRO-``level`` saves where the same plan was compiled under ZeRO-``base``:
    compiled peaks."""
    peaks = {(r["model"], r["global_batch"], r["plan"]): r["compiled_peak_gb"] for r in rows}
    out = []
    for (model, batch, plan), gb in peaks.items():
        other = plan.replace(f"zero={level}", f"zero={base}")
        if parse_plan(plan).zero_level == level and (was := peaks.get((model, batch, other))):
            out.append({"model": model, "global_batch": batch, "plan": plan, f"zero{base}_gb": was,
                        f"zero{level}_gb": gb, "ratio": round(gb / was, 3)})
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="also write the result here")
    args = ap.parse_args(argv)
    result = {gpu: {"rows": gpu_rows(gpu)} for gpu in MEASURED_GPUS}
    for gpu in MEASURED_GPUS:
        rows = result[gpu]["rows"]
        result[gpu].update(summary=summary(rows), time_summary=summary([{"accuracy": r["time_accuracy"]} for r in rows]))
    result["earlier_program"] = {
        "note": f"measured on a runner program that a revision up to {PROGRAM_REVISION} has since changed; not scored",
        "rows": [{k: r[k] for k in ("model", "global_batch", "plan", "peak_gb", "step_s", "source",
                                    "program_revision", "estimate_gb", "estimate_step_s")}
                 for gpu in MEASURED_GPUS for r in gpu_rows(gpu, current=False)]}
    for name, rows in (("gpu-target", gpu_target_rows()), ("alpa-dp", alpa_rows())):
        result[name] = {"summary": summary(rows), "rows": rows}
    # The compiled plans that split their optimizer states over dp (ZeRO-1), their
    # gradient accumulator too (ZeRO-2), their weights too (ZeRO-3), the pipelines,
    # and the plans first compiled after the pipeline's memory was modelled (``held_out``
    # true) or after ZeRO-3's was (``"zero3"``).
    target = result["gpu-target"]
    target["zero1_summary"] = summary([r for r in target["rows"] if parse_plan(r["plan"]).zero_level == 1])
    target["zero2_summary"] = summary([r for r in target["rows"] if parse_plan(r["plan"]).zero_level == 2])
    target["zero3_summary"] = summary([r for r in target["rows"] if parse_plan(r["plan"]).zero_level == 3])
    target["pipeline_summary"] = summary([r for r in target["rows"] if parse_plan(r["plan"]).num_stages > 1])
    target["held_out_summary"] = summary([r for r in target["rows"] if r.get("held_out") is True])
    target["zero3_held_out_summary"] = summary([r for r in target["rows"] if r.get("held_out") == "zero3"])
    target["zero2_over_zero1"] = zero_over(target["rows"], 2, 1)
    target["zero3_over_zero2"] = zero_over(target["rows"], 3, 2)
    result["runner_program"] = summary([r for gpu in MEASURED_GPUS for r in result[gpu]["rows"]]
                                       + result["gpu-target"]["rows"])
    text = json.dumps(result, indent=1)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
