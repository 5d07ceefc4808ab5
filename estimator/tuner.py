"""The plan tuner: the best parallel plan inside one Cell, with Crius/Arena pruning.

A plan of a Cell fixes, per stage, a layer range and a (dp, tp) split of the stage's GPUs
(dp × tp = GPUs of the stage), plus the pipeline micro-batch count and whether layers are
rematerialized. Plans are scored with the analytic estimator (``estimate.score_plan``)
and ranked by feasibility, then estimated seconds per iteration.

``prune="none"`` scores the whole space: every stage partition near the balanced one
(each boundary moved by up to ``partition_radius`` layers) × every (dp, tp) per stage ×
every micro-batch count × remat on and off. With ``EstimateOptions.expert_parallel`` a MoE
stage's splits with dp > 1 are also tried with their experts split over the stage's GPUs
(``dp4tp1ep``, ``dp2tp2ep``), where the expert count allows.

``prune="cell"`` (Crius + Arena):

- Cell-guided (Crius): the Cell estimate costs each stage dp-only and tp-only; a stage
  whose estimate favoured dp keeps dp-only … half-hybrid (tp ≤ √N), one that favoured tp
  keeps half-hybrid … tp-only (dp ≤ √N).
- Arena: each candidate stage partition is scored once with a proxy plan (the Cell
  estimate's per-stage variant) and placed by (computation imbalance of its stage times,
  communication load over its cuts); partitions off the Pareto frontier, or more
  imbalanced than the frontier's best plan (lowest proxy time), are dropped.
- Rematerialization only where needed: a plan is scored with remat on only when it does
  not fit without it (remat never makes a plan faster, only smaller).
- Micro-batches by local search: all plans at the Cell's micro-batch count, then the best
  few walk to neighbouring counts (×2, ÷2) while that improves them; one that needs remat
  also tries the fewest more micro-batches that fit without it.
"""

import logging
import math
from dataclasses import dataclass, field
from itertools import product

from estimator.batching import micro_batch_count, moe_routes, more_micro_batches, replica_batch
from estimator.cells import Cell, CellEstimate, StagePlan
from estimator.cluster import ClusterSpec
from estimator.errors import SpecError
from estimator.estimate import (EstimateOptions, PlanScore, estimate_cell, expert_parallel_fits, partition_stages,
                                score_plan)
from estimator.jobs import JobSpec, job_model
from estimator.models import ModelSpec
from estimator.partition import stage_gpu_counts
from estimator.plan_string import format_plan

log = logging.getLogger(__name__)

PRUNE_MODES = ("cell", "none")


@dataclass(frozen=True)
class TuneOptions:
    """How the tuner searches.

    Attributes:
        prune: ``cell`` (Crius + Arena pruning) or ``none`` (the whole space).
        partition_radius: how far (layers) each stage boundary may move from the balanced one.
        micro_batch_factors: micro-batch counts tried, as multiples of the stage count.
        local_search_width: plans that walk the micro-batch counts in pruned mode.
        estimate: the analytic estimator's options (memory, comm table, efficiency).
    """

    prune: str = "cell"
    partition_radius: int = 1
    micro_batch_factors: tuple[int, ...] = (1, 2, 4, 8, 16)
    local_search_width: int = 2
    estimate: EstimateOptions = field(default_factory=EstimateOptions)

    def __post_init__(self):
        if self.prune not in PRUNE_MODES:
            raise SpecError("prune", self.prune, f"use one of {', '.join(PRUNE_MODES)}")


@dataclass(frozen=True)
class Candidate:
    """One fully specified plan of a Cell."""

    stages: tuple[StagePlan, ...]
    micro_batches: int
    remat: bool


@dataclass(frozen=True)
class ScoredPlan:
    candidate: Candidate
    score: PlanScore
    measured_s: float | None = None

    def rank_key(self) -> tuple:
        t = self.measured_s if self.measured_s is not None else self.score.iteration_time_s
        return (not self.score.feasible, t if self.score.feasible else self.score.peak_memory_gb)


@dataclass(frozen=True)
class TuneResult:
    cell: Cell
    prune: str
    candidates_evaluated: int
    ranked: tuple[ScoredPlan, ...]  # best first
    default_ranges: tuple[tuple[int, int], ...]
    measured: bool = False
    zero_level: int = 0  # the ZeRO stage every plan was scored under

    @property
    def best(self) -> ScoredPlan | None:
        return self.ranked[0] if self.ranked else None

    def plan_string(self, plan: ScoredPlan | None = None) -> str:
        p = plan or self.best
        c = p.candidate
        return format_plan(self.cell, c.stages, c.micro_batches, c.remat, self.default_ranges,
                           zero_level=self.zero_level)

    def to_json(self) -> dict:
        best = None
        if self.best is not None:
            b = self.best
            best = {
                "plan": self.plan_string(),
                "stages": [s.to_json() for s in b.candidate.stages],
                "micro_batches": b.candidate.micro_batches,
                "remat": b.candidate.remat,
                "zero_level": self.zero_level,
                "iteration_time_s": round(b.score.iteration_time_s, 6) if b.score.feasible else None,
                "peak_memory_gb": round(b.score.peak_memory_gb, 3),
                "feasible": b.score.feasible,
                "reason": b.score.reason,
            }
            if b.measured_s is not None:
                best["measured_iteration_time_s"] = round(b.measured_s, 6)
        return {"cell": self.cell.label(), "prune": self.prune,
                "candidates_evaluated": self.candidates_evaluated,
                "measured": self.measured, "best": best}


# --------------------------------------------------------------------------- the space


def stage_splits(num_gpus: int) -> tuple[tuple[int, int], ...]:
    """Every (dp, tp) with dp × tp = num_gpus (a power of two), dp-only first."""
    if num_gpus < 1 or num_gpus & (num_gpus - 1):
        raise SpecError("num_gpus", num_gpus, "a stage needs a power-of-two GPU count")
    out, tp = [], 1
    while tp <= num_gpus:
        out.append((num_gpus // tp, tp))
        tp *= 2
    return tuple(out)


def pruned_splits(num_gpus: int, favoured: str) -> tuple[tuple[int, int], ...]:
    """Crius: the half of the dp↔tp range the Cell estimate favoured, the balanced hybrid
    included: √N×√N, or where N is not a square (8, 32, …) both splits next to it (4×2 and
    2×4 of 8), since the Cell's dp-only and tp-only estimates cannot tell which of the two
    is faster."""
    root = math.sqrt(num_gpus)
    near = {s for s in stage_splits(num_gpus) if root / 2 < s[0] < root * 2} if num_gpus >= 8 else set()
    if favoured == "dp":
        return tuple(s for s in stage_splits(num_gpus) if s[1] <= root or s in near)
    return tuple(s for s in stage_splits(num_gpus) if s[0] <= root or s in near)


def micro_batch_choices(cell: Cell, global_batch: int, factors: tuple[int, ...],
                        model: ModelSpec | None = None) -> tuple[int, ...]:
    """Stages × each factor, or the largest count below it that divides the global batch
    (with ``model``, one whose micro-batch its MoE layers can route without data
    parallelism: ``batching.micro_batch_count``)."""
    fits = None if model is None else moe_routes(model)
    return tuple(sorted({micro_batch_count(global_batch, cell.num_stages * f, fits) for f in factors}))


def candidate_partitions(base: tuple[tuple[int, int], ...], num_layers: int,
                         radius: int) -> tuple[tuple[tuple[int, int], ...], ...]:
    """The balanced partition and each boundary moved alone by 1..radius layers."""
    bounds = [base[0][0]] + [e for _, e in base]
    out = [tuple(base)]
    for i in range(1, len(bounds) - 1):
        for d in [x for r in range(1, radius + 1) for x in (-r, r)]:
            b = list(bounds)
            b[i] += d
            if all(x < y for x, y in zip(b, b[1:])) and b[0] == 0 and b[-1] == num_layers:
                out.append(tuple((b[k], b[k + 1]) for k in range(len(b) - 1)))
    return tuple(dict.fromkeys(out))


def cut_bytes(model: ModelSpec, ranges: tuple[tuple[int, int], ...]) -> float:
    """Activation bytes per sample that cross the partition's stage boundaries."""
    return sum(model.layers[e - 1].output_bytes for _, e in ranges[:-1])


def arena_filter(metrics: dict) -> tuple:
    """Arena's rule over partitions measured as ``{partition: (imbalance, comm, proxy_s)}``.

    Keeps the Pareto frontier of (computation imbalance, communication load) minus the
    frontier points more imbalanced than its best plan (lowest proxy seconds).
    """
    parts = list(metrics)
    frontier = [p for p in parts if not any(
        metrics[q][0] <= metrics[p][0] and metrics[q][1] <= metrics[p][1]
        and (metrics[q][0] < metrics[p][0] or metrics[q][1] < metrics[p][1]) for q in parts)]
    best = min(frontier, key=lambda p: metrics[p][2])
    return tuple(p for p in frontier if metrics[p][0] <= metrics[best][0] + 1e-12)


# --------------------------------------------------------------------------- search


# Per-stage splits combined per partition in the pruned search; beyond it, the combinations
# of splits alike in every stage and one stage apart (``_assemble``).
MAX_STAGE_PLANS = 256


class _Scorer:
    """Scores candidates once each and counts them."""

    def __init__(self, job: JobSpec, cell: Cell, cluster: ClusterSpec, options: EstimateOptions):
        self.job, self.cell, self.cluster, self.options = job, cell, cluster, options
        self.seen: dict[Candidate, ScoredPlan] = {}

    def __call__(self, c: Candidate) -> ScoredPlan:
        if c not in self.seen:
            s = score_plan(self.job, self.cell, self.cluster, c.stages, c.micro_batches, c.remat,
                           self.options)
            self.seen[c] = ScoredPlan(c, s)
        return self.seen[c]


def _assemble(ranges, splits_per_stage, model: ModelSpec | None = None,
              expert_parallel: bool = False, limit: int | None = None) -> list[tuple[StagePlan, ...]]:
    """Every plan taking one split per stage; with ``expert_parallel``, a MoE stage's
    splits with dp > 1 also with its experts split over its GPUs (``StagePlan.ep``).

    With ``limit``, where there are more such plans than that (they grow as the splits to
    the power of the stages: 3^16 for 16 stages of 8 GPUs), only each split taken by every
    stage alike, and each of those with one stage's split changed."""
    per_stage = []
    for (s, e), splits in zip(ranges, splits_per_stage):
        options = [StagePlan(s, e, dp, tp) for dp, tp in splits]
        if expert_parallel and model is not None:
            options += [StagePlan(s, e, dp, tp, ep=True) for dp, tp in splits
                        if dp > 1 and expert_parallel_fits(model.layers[s:e], dp * tp)]
        per_stage.append(options)
    if limit is None or math.prod(len(o) for o in per_stage) <= limit:
        return [tuple(combo) for combo in product(*per_stage)]
    def split(p: StagePlan) -> tuple:
        return p.dp, p.tp, p.ep
    values = dict.fromkeys(split(p) for options in per_stage for p in options)
    alike = [tuple(next((p for p in o if split(p) == v), o[0]) for o in per_stage) for v in values]
    plans = dict.fromkeys(alike)
    for base in alike:
        for i, options in enumerate(per_stage):
            for other in options:
                plans.setdefault(base[:i] + (other,) + base[i + 1:])
    return list(plans)


def tune(job: JobSpec, cell: Cell, cluster: ClusterSpec, options: TuneOptions = TuneOptions()
         ) -> TuneResult:
    """The ranked plans of one Cell (best first) and how many were scored."""
    model = job_model(job)
    per_stage = stage_gpu_counts(cell.num_gpus, cell.num_stages)
    if cell.num_stages > model.num_layers:
        raise SpecError("stages", cell.num_stages, f"{model.name} has {model.num_layers} layers")
    est_opts = options.estimate
    base = partition_stages(model, cell, est_opts)
    partitions = candidate_partitions(base, model.num_layers, options.partition_radius)
    mbs = micro_batch_choices(cell, job.global_batch, options.micro_batch_factors, model)
    if not mbs:
        raise SpecError("global_batch", job.global_batch, f"needs at least {cell.num_stages} samples")
    # The Cell estimate's count is tried too: one given, or more than the factors reach (a
    # large batch fits only in many micro-batches; that estimate may be under a higher
    # ZeRO level, so the doublings up to twice its count are tried as well).
    est = estimate_cell(job, cell, cluster, est_opts)
    if est.stages and est.micro_batches not in mbs:
        more, ladder, routes = max(mbs), {est.micro_batches}, moe_routes(model)
        while (more := more_micro_batches(replica_batch(job.global_batch, cell), more, routes)) \
                and more <= 2 * est.micro_batches:
            ladder.add(more)
        mbs = tuple(sorted({*mbs, *ladder}))
    scorer = _Scorer(job, cell, cluster, est_opts)
    if options.prune == "none":
        for ranges in partitions:
            for stages in _assemble(ranges, [stage_splits(n) for n in per_stage], model, est_opts.expert_parallel):
                for mb, remat in product(mbs, (False, True)):
                    scorer(Candidate(stages, mb, remat))
    else:
        _pruned_search(est, model, options, per_stage, partitions, mbs, scorer)
    ranked = tuple(sorted(scorer.seen.values(), key=ScoredPlan.rank_key))
    log.info("tuned %s: %d candidates (%s), best %s", cell.label(), len(scorer.seen),
             options.prune, ranked[0].score.iteration_time_s if ranked else None)
    return TuneResult(cell, options.prune, len(scorer.seen), ranked, base,
                      zero_level=est_opts.memory.zero_level)


def _fit(scorer: _Scorer, stages, mb: int) -> ScoredPlan:
    """Remat off first; on only when the plan does not fit without it."""
    plain = scorer(Candidate(stages, mb, False))
    if plain.score.feasible:
        return plain
    return scorer(Candidate(stages, mb, True))


def _pruned_search(est: CellEstimate, model, options: TuneOptions, per_stage, partitions,
                   mbs, scorer: _Scorer) -> None:
    favoured = ["tp" if s.tp > 1 and s.dp == 1 else "dp" for s in est.stages] or ["dp"] * len(per_stage)
    if len(favoured) != len(per_stage):
        favoured = ["dp"] * len(per_stage)
    splits = [pruned_splits(n, f) for n, f in zip(per_stage, favoured)]
    default_mb = est.micro_batches if est.micro_batches in mbs else min(
        mbs, key=lambda b: abs(math.log2(b) - math.log2(est.micro_batches)))
    # Arena's proxy plan: every partition scored once under the Cell estimate's favoured
    # variant per stage; its per-stage times (compute, tp collectives and the sends the
    # stage makes) give the computation imbalance.
    proxy = [(n, 1) if f == "dp" else (1, n) for n, f in zip(per_stage, favoured)]
    metrics = {}
    for ranges in partitions:
        ps = scorer(Candidate(_assemble(ranges, [[v] for v in proxy])[0], default_mb,
                              options.estimate.remat)).score
        times = ps.stage_times_s
        imbalance = max(times) / (sum(times) / len(times)) if sum(times) > 0 else 1.0
        metrics[ranges] = (imbalance if ps.feasible else math.inf, cut_bytes(model, ranges),
                           ps.iteration_time_s if ps.feasible else math.inf)
    kept = arena_filter(metrics)
    ep = options.estimate.expert_parallel
    first = [_fit(scorer, stages, default_mb)
             for ranges in kept for stages in _assemble(ranges, splits, model, ep, MAX_STAGE_PLANS)]
    first.sort(key=ScoredPlan.rank_key)
    for start in first[:options.local_search_width]:
        _walk_micro_batches(scorer, start, mbs)


def _walk_micro_batches(scorer: _Scorer, start: ScoredPlan, mbs: tuple[int, ...]) -> None:
    """Hill-climb over micro-batch counts from ``start`` in both directions. A start that
    needs remat also tries the fewest more micro-batches that fit without it: dropping the
    recompute can outweigh smaller micro-batches, and the climb stops before it gets there
    (each count on the way still needing remat is slower)."""
    i0 = mbs.index(start.candidate.micro_batches)
    for step in (1, -1):
        best, i = start, i0 + step
        while 0 <= i < len(mbs):
            nxt = _fit(scorer, start.candidate.stages, mbs[i])
            if nxt.rank_key() >= best.rank_key():
                break
            best, i = nxt, i + step
    if start.candidate.remat:
        for mb in mbs[i0 + 1:]:
            if scorer(Candidate(start.candidate.stages, mb, False)).score.feasible:
                break
