"""Tuning inside the allocation, measured: pruned against exhaustive search, and the tuned
plan against the daemon's, every plan compiled and timed as the runtime runs it.

For each Cell (CPU fake devices; the model only orders candidates, it never decides):

- **exhaustive**: every plan the tuner's whole space holds (``--prune none``: stage
  bounds near the balanced ones × every dp × tp per stage × micro-batch counts × remat)
  that the analytic model finds feasible and the runtime can run, each measured;
- **pruned**: the plans the runner measures (``job_scripts.tuning.search_plans``: the
  daemon's plan, then the structures Crius's Cell-guided pruning keeps at its micro-batch
  count, then a measured walk over micro-batch counts and remat), taken from the same
  measurements (a plan outside the exhaustive set is measured when the search asks);
- **daemon**: the Cell estimate's plan as the daemon writes it (remat on).

Each plan: one warm-up step (compiles), then the median of ``--steps`` timed steps or
more, until half a second of steps has run (fast steps are noisy). At the
end the best exhaustive, the best pruned and the daemon's plan are timed again,
alternately (``--confirm`` rounds), so drift of the shared machine between their first
measurements does not bias the ratios. Printed: per Cell the candidate counts, quality =
best exhaustive / best pruned (target ≥ 0.97), the reduction in measured candidates
(target ≥ 5×), the speed-up of the tuned plan over the daemon's, and the totals.

Usage: ``python benchmarks/tuning_measured.py > benchmarks/results_tuning_measured.json``
(8 CPU fake devices; progress on stderr).
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
TINY = str(ROOT / "tests" / "fixtures" / "runner" / "tiny-gpt.yaml")
BENCH = str(ROOT / "benchmarks" / "models" / "bench-gpt.yaml")
# (model, global batch, devices, stages)
CELLS = ((TINY, 16, 4, 1), (TINY, 16, 4, 2), (TINY, 16, 8, 2), (BENCH, 32, 4, 1))


class Timer:
    """Compiles and times plans of one model; keeps the compiled pipelines of a few."""

    def __init__(self, model: str, global_batch: int, devices: int, steps: int):
        import jax

        from estimator import jax_models as jm
        from estimator.models import load_model
        from job_scripts.data import stream_for
        self.spec = load_model(model)
        self.arch = jm.arch_from_model(self.spec)
        self.global_batch, self.devices, self.steps = global_batch, jax.devices()[:devices], steps
        self.batch = stream_for(self.arch, 0, global_batch).batch(1)
        self.kept: dict[str, tuple] = {}

    def pipeline(self, text: str):
        from estimator.jax_optim import optimizer_for
        from job_scripts.pipeline import Pipeline
        from job_scripts.plan import plan_from_string
        from estimator.plan_string import parse_plan
        from job_scripts.precision import TIMING_LOSS_SCALE, training_arch
        arch = training_arch(self.arch, parse_plan(text).gpu_type)  # the dtype the runner trains in there
        plan = plan_from_string(text, self.spec, arch, self.global_batch, len(self.devices))[0]
        pipe = Pipeline(arch, plan, self.devices, self.global_batch, optimizer_for(arch.optimizer))
        pipe.set_loss_scale(TIMING_LOSS_SCALE)  # fp16: timed at scale 1, as tuning times it
        state, loss = pipe.step(pipe.init(0), self.batch.inputs, self.batch.targets)
        float(loss)
        return pipe, state

    def step_s(self, pipe, state) -> tuple[float, object]:
        t0 = time.perf_counter()
        state, loss = pipe.step(state, self.batch.inputs, self.batch.targets)
        float(loss)
        return time.perf_counter() - t0, state

    def measure(self, text: str) -> float:
        """Median of at least ``steps`` steps, more until 0.5 s have run (at most 25)."""
        pipe, state = self.pipeline(text)
        times = []
        while len(times) < self.steps or (sum(times) < 0.5 and len(times) < 25):
            t, state = self.step_s(pipe, state)
            times.append(t)
        return statistics.median(times)

    def confirm(self, texts: list[str], rounds: int) -> dict[str, float]:
        """Median step time of each plan, timed alternately."""
        live = {t: list(self.pipeline(t)) for t in dict.fromkeys(texts)}
        times = {t: [] for t in live}
        for _ in range(rounds):
            for text, ps in live.items():
                t, ps[1] = self.step_s(*ps)
                times[text].append(t)
        return {t: statistics.median(v) for t, v in times.items()}


def exhaustive_plans(timer: Timer, model: str, cell) -> list[str]:
    from estimator.cluster import load_cluster
    from estimator.errors import SpecError
    from estimator.jobs import JobSpec
    from estimator.tuner import TuneOptions, tune
    from job_scripts.plan import plan_from_string
    result = tune(JobSpec(model, timer.global_batch), cell, load_cluster("crius-1280"), TuneOptions(prune="none"))
    out = []
    for p in result.ranked:
        text = result.plan_string(p)
        if not p.score.feasible or text in out:
            continue
        try:
            plan_from_string(text, timer.spec, timer.arch, timer.global_batch, len(timer.devices))
        except SpecError:
            continue
        out.append(text)
    return out


def daemon_plan(model: str, global_batch: int, cell) -> str:
    from estimator.cluster import load_cluster
    from estimator.estimate import estimate_cell, partition_stages
    from estimator.jobs import JobSpec
    from estimator.models import load_model
    from estimator.plan_string import format_plan
    est = estimate_cell(JobSpec(model, global_batch), cell, load_cluster("crius-1280"))
    return format_plan(cell, est.stages, est.micro_batches, True, partition_stages(load_model(model), cell))


def run(steps: int, confirm: int) -> dict:
    from estimator.cells import Cell
    from job_scripts.tuning import Measured, TuneRequest, search_plans

    rows = []
    for model, batch, n, stages in CELLS:
        cell = Cell("a100", n, n, stages)
        timer = Timer(model, batch, n, steps)
        daemon = daemon_plan(model, batch, cell)
        req = TuneRequest(model, timer.spec, timer.arch, batch, "a100", n, timer.devices, stages, daemon, 10**6, "cpu")
        exhaustive = exhaustive_plans(timer, model, cell)
        t0 = time.perf_counter()
        measured = {text: timer.measure(text) for text in dict.fromkeys([daemon, *exhaustive])}

        def lookup(text: str) -> Measured:
            if text not in measured:
                measured[text] = timer.measure(text)
            return Measured(text, measured[text], 0.0)

        pruned = [m.plan for m in search_plans(req, lookup, lambda: True)]
        best_exh = min(exhaustive, key=measured.get)
        best_pruned = min(pruned, key=measured.get)
        again = timer.confirm([best_exh, best_pruned, daemon], confirm)
        row = {
            "model": Path(model).stem, "global_batch": batch, "cell": cell.label(),
            "measured_exhaustive": len(exhaustive), "measured_pruned": len(pruned),
            "reduction": round(len(exhaustive) / len(pruned), 2),
            "best_exhaustive": {"plan": best_exh, "s": round(again[best_exh], 5)},
            "best_pruned": {"plan": best_pruned, "s": round(again[best_pruned], 5)},
            "daemon": {"plan": daemon, "s": round(again[daemon], 5)},
            "quality": round(again[best_exh] / again[best_pruned], 4),
            "quality_first_measurement": round(measured[best_exh] / measured[best_pruned], 4),
            "tuned_speedup_vs_daemon": round(again[daemon] / again[best_pruned], 4),
            "pruned_best_rank_in_exhaustive": sorted(exhaustive, key=measured.get).index(best_pruned) + 1
            if best_pruned in exhaustive else None,
            "measuring_s": round(time.perf_counter() - t0, 1),
        }
        rows.append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)
    q = [r["quality"] for r in rows]
    s = [r["tuned_speedup_vs_daemon"] for r in rows]
    return {
        "devices": "CPU fake devices (2 cores shared by all)", "steps_timed": steps, "confirm_rounds": confirm,
        "cells": rows,
        "quality": {"median": round(statistics.median(q), 4), "mean": round(statistics.fmean(q), 4),
                    "geomean": round(statistics.geometric_mean(q), 4), "worst": min(q)},
        "reduction_overall": round(sum(r["measured_exhaustive"] for r in rows)
                                   / sum(r["measured_pruned"] for r in rows), 2),
        "tuned_speedup_vs_daemon": {"median": round(statistics.median(s), 4), "mean": round(statistics.fmean(s), 4),
                                    "geomean": round(statistics.geometric_mean(s), 4), "worst": min(s)},
        "command": "python benchmarks/tuning_measured.py",
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--confirm", type=int, default=9)
    args = p.parse_args()
    result = run(args.steps, args.confirm)
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
