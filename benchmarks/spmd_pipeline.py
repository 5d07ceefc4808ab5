"""Step time of the SPMD pipeline against the per-stage pipeline, same plans, CPU devices.

The runtime runs every plan as one ``shard_map`` program with stages as a mesh axis
(``job_scripts.pipeline``). Before, each stage was its own program and activations moved
with ``device_put`` (kept as ``tests/reference_pipeline.py``; one process only). For each
plan both train the same model from the same weights on the same batch: after two
warm-up steps (compiles), their steps are timed alternately, so the machine's noise falls
on both. Printed per plan: median, mean and worst seconds per step of each, and the ratio
SPMD / per-stage of the medians and of the means (target: ≤ 1.3).

Usage: ``python benchmarks/spmd_pipeline.py [--steps 7] > benchmarks/results_spmd_pipeline.json``
(8 CPU fake devices; set before JAX starts).
"""

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

MODEL = ROOT / "benchmarks" / "models" / "bench-gpt.yaml"
GLOBAL_BATCH = 32
PLANS = (
    "cell=a100x4:s1 plan=[dp4tp1] mb=4 remat=1",
    "cell=a100x4:s1 plan=[dp2tp2] mb=2 remat=0",
    "cell=a100x4:s2 plan=[dp2tp1|dp2tp1] mb=4 remat=1",
    "cell=a100x4:s2 plan=[dp2tp1|dp1tp2] mb=4 remat=0",
    "cell=a100x8:s2 plan=[dp2tp2|dp4tp1] mb=8 remat=1",
    "cell=a100x8:s4 plan=[dp2tp1|dp1tp2|dp2tp1|dp1tp2] mb=8 remat=1",
)


def _stats(times: list[float]) -> dict:
    return {"median_s": round(statistics.median(times), 5), "mean_s": round(statistics.fmean(times), 5),
            "worst_s": round(max(times), 5)}


def run(steps: int) -> dict:
    import jax
    from reference_pipeline import Trainer

    from estimator import jax_models as jm
    from estimator.jax_optim import optimizer_for
    from estimator.models import load_model
    from estimator.plan_string import parse_plan
    from job_scripts.data import stream_for
    from job_scripts.pipeline import Pipeline
    from job_scripts.plan import plan_from_string
    from job_scripts.precision import training_arch

    spec = load_model(str(MODEL))
    model_arch = jm.arch_from_model(spec)
    batch = stream_for(model_arch, 0, GLOBAL_BATCH).batch(1)
    rows = []
    for text in PLANS:
        n = parse_plan(text).num_gpus
        arch = training_arch(model_arch, parse_plan(text).gpu_type)  # the dtype the runner trains in there
        plan = plan_from_string(text, spec, arch, GLOBAL_BATCH, n)[0]
        devices = jax.devices()[:n]
        t0 = time.perf_counter()
        spmd = Pipeline(arch, plan, devices, GLOBAL_BATCH, optimizer_for(arch.optimizer))
        state = spmd.init(0)
        for _ in range(2):
            state, loss = spmd.step(state, batch.inputs, batch.targets)
        jax.block_until_ready(loss)
        compile_spmd = time.perf_counter() - t0
        t0 = time.perf_counter()
        mpmd = Trainer(arch, plan, devices, GLOBAL_BATCH, optimizer_for(arch.optimizer))
        mpmd.init(0)
        for _ in range(2):
            mpmd.step(batch.inputs, batch.targets)
        compile_mpmd = time.perf_counter() - t0
        times = {"spmd": [], "mpmd": []}
        for _ in range(steps):
            t0 = time.perf_counter()
            state, loss = spmd.step(state, batch.inputs, batch.targets)
            float(loss)  # the per-stage step returns a host float too: both include the sync
            times["spmd"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            mpmd.step(batch.inputs, batch.targets)
            times["mpmd"].append(time.perf_counter() - t0)
        s, m = _stats(times["spmd"]), _stats(times["mpmd"])
        rows.append({"plan": text, "spmd": s, "per_stage": m,
                     "ratio_median": round(s["median_s"] / m["median_s"], 3),
                     "ratio_mean": round(s["mean_s"] / m["mean_s"], 3),
                     "first_two_steps_s": {"spmd": round(compile_spmd, 2), "per_stage": round(compile_mpmd, 2)}})
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
        del spmd, mpmd, state
    ratios = [r["ratio_median"] for r in rows]
    return {"model": MODEL.name, "global_batch": GLOBAL_BATCH, "devices": "8 CPU fake devices",
            "steps_timed": steps, "plans": rows,
            "ratio_median": {"median": round(statistics.median(ratios), 3),
                             "mean": round(statistics.fmean(ratios), 3),
                             "geomean": round(statistics.geometric_mean(ratios), 3), "worst": max(ratios)},
            "command": "python benchmarks/spmd_pipeline.py"}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=7)
    args = p.parse_args()
    result = run(args.steps)
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
