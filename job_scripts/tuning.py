"""Choosing the plan inside the allocation: the Cell-guided pruned search, measured.

The daemon's plan (the AdminComment's) is the starting point. The structures searched
(stage bounds, each stage's dp × tp) are those of the same Cell that Crius's Cell-guided
pruning keeps (``estimator.tuner``), best estimated first; the micro-batch count and
rematerialization are searched by measurement (:func:`search_plans`). Each candidate is
compiled and timed for a few steps on the granted devices, as the real SPMD program, and
the fastest *measured* plan trains: the model prunes and orders, it never decides.

Measuring stops when the budget is spent: at most ``budget_s`` seconds and at most
``budget_frac`` of the job's expected remaining run time (remaining iterations × the
starting plan's measured step time); a stop request (SIGUSR1, SIGTERM) ends it, and one
before the first measurement keeps the starting plan unmeasured. A candidate that runs out
of device memory is one that failed, and the search goes on (in a one-process job; across
processes the job ends, as a process's failure may leave the others in a collective). The result is cached per
(model, global batch, Cell, node layout, platform, the start's ZeRO level and ep), so a job
resumed on a Cell it has tuned does not tune again, unless that search was cut short by a
budget this run may well exceed (``RESEARCH_BUDGET_RATIO``).
Every process of a multi-process job measures the same candidates in the same order and
agrees on times (their maximum), so all take the same decision; a cached plan is used only
when every process read the same one.
"""

from __future__ import annotations

import gc
import hashlib
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from estimator.contract import ADMIN_COMMENT_PLAN
from estimator.errors import SpecError
from job_scripts.checkpoint import write_json_atomic
from job_scripts.run_config import TuneConfig

log = logging.getLogger(__name__)

# A cached search its budget cut short is searched again by a run that may spend more than
# this many times its budget.
RESEARCH_BUDGET_RATIO = 1.5

MEASURE_WARMUP_STEPS = 1  # the first step compiles
# Timed steps: at least MIN, more until MIN_TIMED_S have run (fast steps are noisy), at most MAX.
MEASURE_MIN_STEPS, MEASURE_MAX_STEPS, MIN_TIMED_S = 3, 20, 0.5
OUT_OF_MEMORY = "RESOURCE_EXHAUSTED"  # XLA's status for a failed device allocation


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
    start_s: float | None = None  # the starting (daemon's) plan's measured step time


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
    options_from: str | None = None  # the daemon's plan when it cannot run here (no start)


def start_options(req: TuneRequest) -> tuple[int, bool]:
    """The starting plan's ZeRO level and whether it splits a stage's experts (``ep``),
    or those of the daemon's plan that could not run here: what every plan searched keeps
    (0 and False without either)."""
    from estimator.plan_string import parse_plan
    text = req.start or req.options_from
    start = parse_plan(text) if text else None
    return (start.zero_level, any(start.stage_ep)) if start else (0, False)


def _runnable(req: TuneRequest, text: str):
    from job_scripts.plan import plan_from_string
    return plan_from_string(text, req.model_spec, req.arch, req.global_batch, len(req.devices),
                            req.gpus_per_node)[0]


class PlanSpace:
    """The plans of the allocation's Cell(s) the search may measure.

    The *structures* (stage bounds and each stage's dp × tp) are those Crius's Cell-guided
    pruning and Arena's partition filter keep (``estimator.tuner``, prune ``cell``), best
    estimated first; the micro-batch count and remat of a structure are left to
    measurement. A plan is offered only if the runtime can run it and the analytic memory
    model says it fits.
    """

    def __init__(self, req: TuneRequest):
        from estimator.cells import Cell
        from estimator.cluster import cluster_from_dict
        from estimator.estimate import EstimateOptions, partition_stages, stage_counts
        from estimator.jobs import JobSpec
        from estimator.memory import MemoryOptions
        from estimator.tuner import TuneOptions, micro_batch_choices, tune

        self.req = req
        # The daemon's plan keeps states split over dp (ZeRO-1, ZeRO-2 with the gradient
        # accumulator too, ZeRO-3 with the weights too) where replicated ones do not fit:
        # every plan of the search keeps its level (under ZeRO-2 and 3 the runner refuses
        # stages split differently, under ZeRO-3 no remat). A daemon that split a stage's
        # experts over its GPUs (expert_parallel) lets the search try such splits too.
        self.zero_level, expert_parallel = start_options(req)
        self.estimate = EstimateOptions(memory=MemoryOptions(zero_level=self.zero_level),
                                        expert_parallel=expert_parallel)
        n = len(req.devices)
        per_node = max(1, min(req.gpus_per_node or n, n))
        self.cluster = cluster_from_dict({"name": "allocation", "node_groups": [
            {"gpu_type": req.gpu_type, "nodes": max(1, n // per_node), "gpus_per_node": per_node}]})
        self.job = JobSpec(req.model, req.global_batch, n, req.gpu_type)
        counts = [req.num_stages] if req.num_stages else stage_counts(n, req.model_spec.num_layers)
        ranked, self.cells, self.defaults, self.mbs = [], {}, {}, {}
        for stages in counts:
            cell = Cell(req.gpu_type, n, per_node, stages)
            try:
                result = tune(self.job, cell, self.cluster, TuneOptions(prune="cell", estimate=self.estimate))
            except SpecError as e:
                log.info("no candidates with %d stages: %s", stages, e)
                continue
            self.cells[stages] = cell
            self.defaults[stages] = partition_stages(req.model_spec, cell)
            self.mbs[stages] = micro_batch_choices(cell, req.global_batch, TuneOptions().micro_batch_factors,
                                                    req.model_spec)
            ranked.extend((p.score.iteration_time_s, p.candidate) for p in result.ranked if p.score.feasible)
        # Each structure once, with the micro-batches and remat of its best estimate.
        self.structures: list[tuple] = []
        self.best_of: dict[tuple, tuple[int, bool]] = {}
        for _, c in sorted(ranked, key=lambda r: r[0]):
            if c.stages not in self.best_of:
                self.best_of[c.stages] = (c.micro_batches, c.remat)
                self.structures.append(c.stages)

    def text(self, stages: tuple, micro_batches: int, remat: bool) -> str:
        from estimator.plan_string import format_plan
        s = len(stages)
        return format_plan(self.cells[s], stages, micro_batches, remat, self.defaults[s], zero_level=self.zero_level)

    def runnable(self, stages: tuple, micro_batches: int, remat: bool) -> bool:
        from estimator.estimate import score_plan
        if len(stages) not in self.cells or micro_batches not in self.mbs[len(stages)]:
            return False
        try:
            _runnable(self.req, self.text(stages, micro_batches, remat))
        except SpecError:
            return False
        return score_plan(self.job, self.cells[len(stages)], self.cluster, stages, micro_batches, remat,
                          self.estimate).feasible

    def neighbours(self, stages: tuple, micro_batches: int) -> tuple[list[int], list[int]]:
        """Micro-batch counts above and below ``micro_batches`` (nearest first)."""
        mbs = self.mbs[len(stages)]
        return [m for m in mbs if m > micro_batches], [m for m in reversed(mbs) if m < micro_batches]


def best_estimated(req: TuneRequest) -> str:
    """The plan the analytic model ranks first (when nothing may be measured)."""
    space = PlanSpace(req)
    if not space.structures:
        raise SpecError("plan", None, f"no runnable plan of {len(req.devices)} devices for this model "
                                      f"and global batch {req.global_batch}")
    return space.text(space.structures[0], *space.best_of[space.structures[0]])


def untuned(req: TuneRequest) -> Tuned:
    """The plan without measuring: the starting (AdminComment's) plan, else the best estimated."""
    return Tuned(req.start, None, ADMIN_COMMENT_PLAN) if req.start else Tuned(best_estimated(req), None, "estimated")


STRUCTURES = 6  # structures measured at the starting micro-batch count
CLIMBERS = 2  # the best of them, whose micro-batch count is then searched by measurement


def search_plans(req: TuneRequest, measure: Callable[[str], Measured], more: Callable[[], bool]) -> list[Measured]:
    """Measure plans of the Cell, adaptively, while ``more()`` allows.

    1. the starting plan (the daemon's), then the best-estimated pruned structures at its
       micro-batch count and remat (each structure's own best estimate without a start);
    2. for the best measured structures, the other remat setting, then the micro-batch
       count walking ×2 and ÷2 while the *measured* step time improves.

    Returns every measurement, in the order taken.
    """
    from estimator.plan_string import parse_plan

    space = PlanSpace(req)
    # Keyed by what a plan is, (stages, micro-batches, remat), not by how it is written.
    seen: dict[tuple, Measured] = {}

    def trial(stages: tuple, mb: int, remat: bool, text: str | None = None) -> Measured | None:
        key = (stages, mb, remat)
        if key in seen:
            return seen[key]
        if text is None and not space.runnable(stages, mb, remat):
            return None
        if not more():
            return None
        seen[key] = measure(text or space.text(stages, mb, remat))
        return seen[key]

    def seconds(key: tuple) -> float:
        t = seen[key].iteration_time_s if key in seen else None
        return float("inf") if t is None else t

    start = None
    if req.start:
        ps = parse_plan(req.start)
        if ps.num_stages in space.cells:
            start = (tuple(ps.stage_plans(space.defaults[ps.num_stages])), ps.micro_batches, ps.remat)
            trial(*start, text=req.start)  # the daemon's plan, as it wrote it
    for stages in space.structures[:STRUCTURES]:
        mb, remat = space.best_of[stages]
        if start is not None and len(stages) == len(start[0]):
            mb, remat = start[1], start[2]
        trial(stages, mb, remat) or trial(stages, *space.best_of[stages])
    climbers: dict[tuple, tuple] = {}
    for key in sorted(seen, key=seconds):
        climbers.setdefault(key[0], key)
    for stages, mb, remat in list(climbers.values())[:CLIMBERS]:
        trial(stages, mb, not remat)
        if seconds((stages, mb, not remat)) < seconds((stages, mb, remat)):
            remat = not remat
        for direction in space.neighbours(stages, mb):
            best = seconds((stages, mb, remat))
            for other in direction:
                trial(stages, other, remat)
                if seconds((stages, other, remat)) >= best:
                    break
                best = seconds((stages, other, remat))
    return list(seen.values())


def measure_plan(req: TuneRequest, text: str, agree: Callable[[float], float]) -> Measured:
    """Compile and time ``text`` for a few steps on the job's devices (every process)."""
    import jax

    t0 = time.perf_counter()
    try:
        return _time_plan(req, text, agree, t0)
    except SpecError as e:
        return Measured(text, None, agree(time.perf_counter() - t0), str(e))
    except jax.errors.JaxRuntimeError as e:
        # Out of device memory (fragmentation, or an estimate short of the real peak): this
        # candidate cannot run, the others may. Across processes one process's failure can
        # leave the others waiting in a collective, so there the job ends instead.
        if not out_of_memory(e) or jax.process_count() > 1:
            raise
        failed = Measured(text, None, time.perf_counter() - t0,
                          "out of device memory: " + str(e).splitlines()[0][:200])
    gc.collect()  # the traceback's frames held the candidate's state: free it for the next
    return failed


def _time_plan(req: TuneRequest, text: str, agree: Callable[[float], float], t0: float) -> Measured:
    import jax
    import numpy as np

    from estimator.jax_optim import optimizer_for
    from job_scripts.data import stream_for
    from job_scripts.pipeline import Pipeline
    from job_scripts.precision import TIMING_LOSS_SCALE

    pipe = Pipeline(req.arch, _runnable(req, text), req.devices, req.global_batch,
                    optimizer_for(req.arch.optimizer))
    if req.platform == "gpu" and agree(float(not pipe.fits_memory())) > 0:
        return Measured(text, None, agree(time.perf_counter() - t0), "does not fit in device memory")
    batch = stream_for(req.arch, 0, req.global_batch).batch(1)
    state = pipe.init(0)
    pipe.set_loss_scale(TIMING_LOSS_SCALE)  # fp16: no step overflows and skips its update
    for _ in range(MEASURE_WARMUP_STEPS):
        state, loss = pipe.step(state, batch.inputs, batch.targets)
    jax.block_until_ready(loss)
    times: list[float] = []
    while len(times) < MEASURE_MIN_STEPS or (sum(times) < MIN_TIMED_S and len(times) < MEASURE_MAX_STEPS):
        t1 = time.perf_counter()
        state, loss = pipe.step(state, batch.inputs, batch.targets)
        jax.block_until_ready(loss)
        # Agreed, so that every process takes as many (collective) steps.
        times.append(agree(time.perf_counter() - t1))
    seconds = float(np.median(times))
    if not np.isfinite(float(loss)) or (pipe.scaled and not bool(pipe.last_step_finite)):
        return Measured(text, None, agree(time.perf_counter() - t0), "loss or gradients not finite")
    del state, pipe
    return Measured(text, seconds, agree(time.perf_counter() - t0))


def out_of_memory(error: Exception) -> bool:
    """Whether XLA's error is a failed device allocation (``RESOURCE_EXHAUSTED``, or an
    ``INTERNAL`` error when the allocation failed while the program was dispatched)."""
    text = str(error)
    return OUT_OF_MEMORY in text or "out of memory" in text.lower()


def cache_key(req: TuneRequest) -> dict:
    import jax
    # Every plan searched keeps the start's ZeRO level and ep: another start, other plans.
    zero_level, expert_parallel = start_options(req)
    return {"arch": repr(req.arch), "global_batch": req.global_batch, "gpu_type": req.gpu_type,
            "devices": len(req.devices), "gpus_per_node": req.gpus_per_node,
            "num_stages": req.num_stages, "platform": req.platform, "zero_level": zero_level,
            "expert_parallel": expert_parallel, "device_kind": req.devices[0].device_kind,
            "jax": jax.__version__}


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
        if raw.get("complete", True) is False:
            # A search its budget cut short: kept while this run could not search longer.
            budget_now_s = min(cfg.budget_s, cfg.budget_frac * req.remaining_iterations * float(seconds))
            if budget_now_s > RESEARCH_BUDGET_RATIO * float(raw["budget_s"]):
                log.info("the tuned plan of this Cell came from a search cut at %.0f s; this run may take "
                         "%.0f s: tuning again", float(raw["budget_s"]), budget_now_s)
                return None
    except (OSError, ValueError, KeyError, TypeError, SpecError):
        return None
    return Tuned(plan, seconds, "cached")


def _plan_digest(plan: str) -> float:
    """A plan string's digest as a float every process compares exactly (52 bits)."""
    return float(int(hashlib.sha256(plan.encode()).hexdigest()[:13], 16))


def agreed_cached(req: TuneRequest, cfg: TuneConfig, agree: Callable[[float], float]) -> Tuned | None:
    """The cached plan when every process read the same one, else None on every process.

    Each process reads the cache itself; one that reads it just before another job's
    tuning lands there, and one just after, would otherwise train and tune at once, each
    waiting in collectives the other never runs."""
    cached = _cached(req, cfg)
    digest = _plan_digest(cached.plan) if cached is not None else -1.0
    if agree(digest) == -agree(-digest):
        return cached
    log.warning("the processes read different tuned plans for this Cell (written while they read): tuning")
    return None


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
    cached = agreed_cached(req, cfg, agree)
    if cached is not None:
        log.info("plan %s (tuned before on this Cell: %.4f s/iteration measured)", cached.plan,
                 cached.iteration_time_s)
        return cached
    t_begin = time.perf_counter()
    budget_s, costs, stopped, timed, cut = cfg.budget_s, [], False, False, False
    # Nothing to tune for: no budget, or no iteration left to train (a job resumed at its end).
    idle = cfg.budget_s <= 0 or req.remaining_iterations <= 0

    def measure(text: str) -> Measured:
        nonlocal budget_s, timed
        m = measure_plan(req, text, agree)
        costs.append(m.cost_s)
        log.info("measured %s: %s (%.1f s to measure)", text,
                 f"{m.iteration_time_s:.4f} s/iteration" if m.iteration_time_s else f"failed: {m.error}", m.cost_s)
        if m.iteration_time_s and not timed:
            # Tuning may take this much of what is left of the job at the first timed plan's speed.
            budget_s = min(cfg.budget_s, cfg.budget_frac * req.remaining_iterations * m.iteration_time_s)
            timed = True
        return m

    def more() -> bool:
        """No stop was requested and another measurement fits the budget (every process
        gets the same answer)."""
        nonlocal stopped, cut
        stopped = stopped or stop()
        if stopped:
            return False  # a rescale or the job's end waits for no compile
        if not costs:
            return not idle
        spent = agree(time.perf_counter() - t_begin)
        fits = spent + sum(costs) / len(costs) <= budget_s
        cut = cut or not fits  # a candidate left unmeasured
        return fits

    measured = search_plans(req, measure, more)
    if not measured and (stopped or idle):
        log.info("%s: %s as is", "a stop was requested before tuning measured a plan" if stopped else
                 "no tuning budget or no iteration left", req.start or "the best estimate")
        return untuned(req)
    if not measured:
        raise SpecError("plan", req.start, f"no runnable plan of {len(req.devices)} devices for this model "
                                           f"and global batch {req.global_batch}")
    ok = [m for m in measured if m.iteration_time_s is not None]
    if not ok:
        raise SpecError("plan", measured[0].plan, "no candidate plan ran: " + "; ".join(
            f"{m.plan}: {m.error}" for m in measured))
    best = min(ok, key=lambda m: m.iteration_time_s)
    tuning_s = time.perf_counter() - t_begin
    start_s = measured[0].iteration_time_s if req.start and measured[0].plan == req.start else None
    source = ADMIN_COMMENT_PLAN if best.plan == req.start and len(measured) == 1 else "tuned"
    # A search a stop cut short is not kept: the next run on this Cell searches afresh. One
    # its budget cut is kept with that budget: a run that may search longer searches again.
    if writer and cfg.cache_dir is not None and len(measured) > 1 and not stopped:
        key = cache_key(req)
        try:  # a cache: the job trains on its tuned plan whether or not others can reuse it
            write_json_atomic(_cache_path(cfg.cache_dir, key), {
                "key": key, "plan": best.plan, "iteration_time_s": best.iteration_time_s,
                "tuned_at_s": time.time(), "complete": not cut, "budget_s": budget_s,
                "measured": [m.__dict__ for m in measured]})
        except OSError as e:
            log.warning("tuned plan not cached in %s: %s", cfg.cache_dir, e)
    return Tuned(best.plan, best.iteration_time_s, source, tuning_s, tuple(measured), start_s)
