"""Choosing the plan inside the allocation: the Cell-guided pruned search, measured.

The daemon's plan (the AdminComment's) is the starting point. The candidates are the
plans of the same Cell that Crius's Cell-guided pruning keeps (``estimator.tuner``), in
the order the analytic model ranks them; each is compiled and timed for a few steps on
the granted devices, as the real SPMD program, and the fastest *measured* plan trains.
The model only orders the candidates; it never decides.

Measuring stops when the budget is spent: at most ``budget_s`` seconds and at most
``budget_frac`` of the job's expected remaining run time (remaining iterations × the
starting plan's measured step time). The result is cached per (model, global batch,
Cell, node layout, platform), so a job resumed on a Cell it has tuned does not tune again.
Every process of a multi-process job measures the same candidates in the same order and
agrees on times (their maximum), so all take the same decision.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from estimator.errors import SpecError
from job_scripts.checkpoint import write_json_atomic
from job_scripts.run_config import TuneConfig

log = logging.getLogger(__name__)

MEASURE_WARMUP_STEPS = 1  # the first step compiles
MEASURE_STEPS = 3
MAX_CANDIDATES = 16


@dataclass(frozen=True)
class Measured:
    """One candidate: its plan string, measured seconds per step (None: it failed), and
    the seconds it cost to measure (compile included)."""

    plan: str
    iteration_time_s: float | None
    cost_s: float
    error: str | None = None


@dataclass(frozen=True)
class Tuned:
    """The plan to train with and how it was chosen."""

    plan: str
    iteration_time_s: float | None
    source: str  # tuned | cached | AdminComment | given
    tuning_s: float = 0.0
    measured: tuple[Measured, ...] = field(default_factory=tuple)


@dataclass(frozen=True)
class TuneRequest:
    """What to tune: a model, its global batch, the allocation's Cell and devices.

    Attributes:
        model: the model as the job names it (built-in name or YAML path).
        model_spec: the estimator's model (``estimator.models.ModelSpec``).
        arch: its JAX architecture.
        global_batch: samples per step.
        gpu_type: the GPU type of the allocation (a catalog name).
        gpus_per_node: devices per node.
        devices: the job's devices, all processes'.
        num_stages: the Cell's stage count; None to search every stage count.
        start: the starting plan string (the daemon's), or None.
        remaining_iterations: steps left to train.
        platform: ``cpu`` or ``gpu``.
    """

    model: str
    model_spec: object
    arch: object
    global_batch: int
    gpu_type: str
    gpus_per_node: int
    devices: list
    num_stages: int | None
    start: str | None
    remaining_iterations: int
    platform: str


def _runnable(req: TuneRequest, text: str):
    from job_scripts.plan import plan_from_string
    return plan_from_string(text, req.model_spec, req.arch, req.global_batch, len(req.devices),
                            req.gpus_per_node)[0]


def candidate_plans(req: TuneRequest, limit: int = MAX_CANDIDATES) -> list[str]:
    """The starting plan, then the pruned search's plans best-estimated first, each one
    that can run, without repeats."""
    from estimator.cells import Cell
    from estimator.cluster import cluster_from_dict
    from estimator.estimate import stage_counts
    from estimator.jobs import JobSpec
    from estimator.tuner import TuneOptions, tune

    n = len(req.devices)
    per_node = max(1, min(req.gpus_per_node or n, n))
    cluster = cluster_from_dict({"name": "allocation", "node_groups": [
        {"gpu_type": req.gpu_type, "nodes": max(1, n // per_node), "gpus_per_node": per_node}]})
    job = JobSpec(req.model, req.global_batch, n, req.gpu_type)
    counts = [req.num_stages] if req.num_stages else stage_counts(n, req.model_spec.num_layers)
    ranked = []
    for stages in counts:
        try:
            result = tune(job, Cell(req.gpu_type, n, per_node, stages), cluster, TuneOptions(prune="cell"))
        except SpecError as e:
            log.info("no candidates with %d stages: %s", stages, e)
            continue
        ranked.extend((p.score.iteration_time_s, result.plan_string(p)) for p in result.ranked
                      if p.score.feasible)
    out = [req.start] if req.start else []
    for _, text in sorted(ranked, key=lambda r: r[0]):
        if len(out) >= limit:
            break
        if text in out:
            continue
        try:
            _runnable(req, text)
        except SpecError as e:  # the model does not know every sharding constraint
            log.info("candidate %s skipped: %s", text, e)
            continue
        out.append(text)
    return out


def measure_plan(req: TuneRequest, text: str, agree: Callable[[float], float]) -> Measured:
    """Compile and time ``text`` for a few steps on the job's devices (every process)."""
    import jax
    import numpy as np

    from estimator.jax_optim import optimizer_for
    from job_scripts.data import stream_for
    from job_scripts.pipeline import Pipeline

    t0 = time.perf_counter()
    try:
        pipe = Pipeline(req.arch, _runnable(req, text), req.devices, req.global_batch,
                        optimizer_for(req.arch.optimizer))
        if req.platform == "gpu" and agree(float(not pipe.fits_memory())) > 0:
            return Measured(text, None, agree(time.perf_counter() - t0), "does not fit in device memory")
        batch = stream_for(req.arch, 0, req.global_batch).batch(1)
        state = pipe.init(0)
        for _ in range(MEASURE_WARMUP_STEPS):
            state, loss = pipe.step(state, batch.inputs, batch.targets)
        jax.block_until_ready(loss)
        t1 = time.perf_counter()
        for _ in range(MEASURE_STEPS):
            state, loss = pipe.step(state, batch.inputs, batch.targets)
        jax.block_until_ready(loss)
        seconds = agree((time.perf_counter() - t1) / MEASURE_STEPS)
        if not np.isfinite(float(loss)):
            return Measured(text, None, agree(time.perf_counter() - t0), "loss is not finite")
        del state, pipe
        return Measured(text, seconds, agree(time.perf_counter() - t0))
    except SpecError as e:
        return Measured(text, None, agree(time.perf_counter() - t0), str(e))


def cache_key(req: TuneRequest) -> dict:
    import jax
    return {"arch": repr(req.arch), "global_batch": req.global_batch, "gpu_type": req.gpu_type,
            "devices": len(req.devices), "gpus_per_node": req.gpus_per_node,
            "num_stages": req.num_stages, "platform": req.platform,
            "device_kind": req.devices[0].device_kind, "jax": jax.__version__}


def _cache_path(cache_dir: Path, key: dict) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
    return cache_dir / f"{digest}.json"


def _cached(req: TuneRequest, cfg: TuneConfig) -> Tuned | None:
    if cfg.cache_dir is None:
        return None
    path = _cache_path(cfg.cache_dir, cache_key(req))
    try:
        raw = json.loads(path.read_text())
        plan, seconds = raw["plan"], raw["iteration_time_s"]
        _runnable(req, plan)
    except (OSError, ValueError, KeyError, TypeError, SpecError):
        return None
    return Tuned(plan, seconds, "cached")


def tune_plan(req: TuneRequest, cfg: TuneConfig, agree: Callable[[float], float],
              stop: Callable[[], bool], writer: bool) -> Tuned:
    """The plan to train with: cached, else the fastest measured candidate within the budget.

    Args:
        req: the model, batch, Cell and devices.
        cfg: the budget and the cache.
        agree: the maximum of a value over the job's processes.
        stop: whether a rescale or termination was requested (tuning then ends early).
        writer: whether this process writes the cache.
    """
    cached = _cached(req, cfg)
    if cached is not None:
        log.info("plan %s (tuned before on this Cell: %.4f s/iteration measured)", cached.plan,
                 cached.iteration_time_s)
        return cached
    candidates = candidate_plans(req)
    if not candidates:
        raise SpecError("plan", None, f"no runnable plan of {len(req.devices)} devices for this model and "
                                      f"global batch {req.global_batch}")
    t_begin = time.perf_counter()
    measured: list[Measured] = []
    budget_s = cfg.budget_s
    for text in candidates:
        spent = agree(time.perf_counter() - t_begin)
        if measured:
            costs = [m.cost_s for m in measured]
            if stop() or spent + sum(costs) / len(costs) > budget_s:
                break
        m = measure_plan(req, text, agree)
        measured.append(m)
        log.info("measured %s: %s (%.1f s to measure)", text,
                 f"{m.iteration_time_s:.4f} s/iteration" if m.iteration_time_s else f"failed: {m.error}", m.cost_s)
        if len(measured) == 1 and m.iteration_time_s:
            budget_s = min(cfg.budget_s, cfg.budget_frac * req.remaining_iterations * m.iteration_time_s)
    ok = [m for m in measured if m.iteration_time_s is not None]
    if not ok:
        raise SpecError("plan", candidates[0], "no candidate plan ran: " + "; ".join(
            f"{m.plan}: {m.error}" for m in measured))
    best = min(ok, key=lambda m: m.iteration_time_s)
    tuning_s = time.perf_counter() - t_begin
    source = "tuned" if len(measured) > 1 else ("AdminComment" if best.plan == req.start else "tuned")
    if writer and cfg.cache_dir is not None and len(measured) > 1:
        key = cache_key(req)
        write_json_atomic(_cache_path(cfg.cache_dir, key), {
            "key": key, "plan": best.plan, "iteration_time_s": best.iteration_time_s,
            "tuned_at_s": time.time(), "measured": [m.__dict__ for m in measured]})
    return Tuned(best.plan, best.iteration_time_s, source, tuning_s, tuple(measured))
