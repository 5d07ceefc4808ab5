"""Helpers shared by the Crius, Gavel, ElasticFlow and Sia policies.

Two things every one of those policies needs and none should re-implement:

* ``RateTable``: a job's feasible Cells keyed by (GPU type, GPU count), fastest first,
  from the snapshot's estimates (``plan_space="cell"`` for Crius, the data-parallel-only
  ones for the baselines, as the Crius and Arena papers ran them).
* ``realize``: turn "job → wanted Cell" into a ``Decision`` with node placements from
  ``policy.placement.FreeGpus``, keeping every unchanged job where it is, so that a policy
  that re-plans from scratch never moves a job it did not mean to move.

Their 0/1 programs go through ``policy.binary_program``, as cells-ilp's do.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, replace

from estimator.cells import Cell, CellEstimate
from policy.interface import (
    Assignment, Decision, DecisionError, DerivedCache, JobDecision, JobView, Snapshot, validate_decision,
)
from policy.placement import FreeGpus

log = logging.getLogger(__name__)

# samples/s standing in for "runs, rate unknown" (a Cell the memory model rejects but the
# platform runs); small enough never to win a comparison against a known rate.
UNKNOWN_RATE = 1e-6


@dataclass(frozen=True)
class RateTable:
    """The feasible Cells of one job, grouped by (GPU type, GPU count).

    Attributes:
        options: (gpu_type, num_gpus) → feasible estimates of that shape, fastest first
            (ties: fewer stages, then label, so the choice is deterministic).
    """

    options: dict[tuple[str, int], tuple[CellEstimate, ...]]
    fastest: tuple[CellEstimate, ...] = ()

    @classmethod
    def of(cls, job: JobView, dp_only: bool, cache: DerivedCache) -> "RateTable":
        """The table of ``job``, from ``cache`` (the snapshot's ``derived_cache()``).

        Estimates are immutable tuples: the same objects mean the same table. Callers (the
        simulator's estimate cache, the daemon's store) hand out one object per job spec,
        the same from one snapshot to the next, so a table is built once per spec and
        shared by its jobs (which lets policies skip repeats of a spec in a queue).
        """
        source = job.dp_only_estimates if dp_only else job.estimates
        return cache.get("rate_table", (source, job.estimates), (job.spec, dp_only),
                         lambda: cls._build(job, dp_only))

    @classmethod
    def _build(cls, job: JobView, dp_only: bool) -> "RateTable":
        """The table of ``job`` from its Cell estimates or its data-parallel-only ones.

        With ``dp_only``, a job whose requested shape (type and count) has no feasible
        data-parallel Cell — its model does not fit in data-parallel memory there — keeps
        that shape with the Cell it would run as requested (``policy.fcfs``'s rule: the
        fastest feasible Cell of the shape, else the one-stage Cell the platform can run).
        A baseline then runs it as asked instead of never: the papers' baselines start every
        job, and the user brought a plan that runs. Likewise a job none of whose Cells the
        memory model accepts, though the platform runs what it asked for.
        """
        grouped: dict[tuple[str, int], list[CellEstimate]] = {}
        for e in (job.dp_only_estimates if dp_only else job.estimates):
            if e.feasible and e.samples_per_s > 0:
                grouped.setdefault((e.cell.gpu_type, e.cell.num_gpus), []).append(e)
        missing_request = dp_only and job.spec.num_gpus and not any(
            n == job.spec.num_gpus and (job.spec.gpu_type in (None, t)) for t, n in grouped)
        if missing_request or not grouped:
            from policy.fcfs import requested_estimate

            asked = requested_estimate(job)
            if asked is not None:
                if asked.samples_per_s <= 0:  # infeasible by the memory model, runnable: no rate known
                    asked = replace(asked, samples_per_s=UNKNOWN_RATE, iteration_time_s=math.inf)
                grouped[(asked.cell.gpu_type, asked.cell.num_gpus)] = [asked]
        options = {k: tuple(sorted(v, key=_speed_key)) for k, v in sorted(grouped.items())}
        every = sorted((e for v in options.values() for e in v),
                       key=lambda e: (-e.samples_per_s, e.cell.num_gpus, e.cell.label()))
        return cls(options, tuple(every))

    def rate(self, gpu_type: str, num_gpus: int) -> float:
        """Best samples/s of that shape, 0.0 when it is infeasible or was not estimated."""
        opts = self.options.get((gpu_type, num_gpus))
        return opts[0].samples_per_s if opts else 0.0

    def counts(self, gpu_type: str) -> tuple[int, ...]:
        """The GPU counts with a feasible Cell of ``gpu_type``, ascending."""
        # options is sorted by (type, count), so this is already ascending.
        return tuple(n for t, n in self.options if t == gpu_type)

    def best(self) -> CellEstimate | None:
        """The fastest feasible Cell of all, or None."""
        return min((o[0] for o in self.options.values()), key=_speed_key, default=None)

    def rate_of_cell(self, cell: Cell) -> float:
        """samples/s of exactly ``cell`` when it is in the table, else of its shape."""
        for e in self.options.get((cell.gpu_type, cell.num_gpus), ()):
            if e.cell == cell:
                return e.samples_per_s
        return self.rate(cell.gpu_type, cell.num_gpus)




def capacity_by_type(snapshot: Snapshot) -> dict[str, int]:
    """GPU type → GPUs the policy may hand out (``Snapshot.gpus_by_type``, memoized per
    nodes tuple in the snapshot's cache)."""
    def compute() -> dict[str, int]:
        out: dict[str, int] = {}
        for n in snapshot.nodes:
            out[n.gpu_type] = out.get(n.gpu_type, 0) + max(0, n.total_gpus - n.unmanaged_gpus)
        return out
    return dict(snapshot.derived_cache().get("capacity_by_type", (snapshot.nodes,), (), compute))


def _speed_key(e: CellEstimate) -> tuple:
    return (-e.samples_per_s, e.cell.num_stages, e.cell.label())


def requested_count(job: JobView, table: RateTable) -> int | None:
    """The GPU count the job asked for, else the smallest count with a feasible Cell."""
    if job.spec.num_gpus:
        return job.spec.num_gpus
    return min((n for _, n in table.options), default=None)


def fits(free: FreeGpus, cell: Cell) -> bool:
    """Whether ``cell`` fits in ``free`` in its own layout; cheaper than ``place``."""
    per_node = min(cell.gpus_per_node, cell.num_gpus)
    need = -(-cell.num_gpus // per_node)
    got = 0
    f = free.free
    for name in free.by_type.get(cell.gpu_type, ()):
        if f[name] >= per_node:
            got += 1
            if got >= need:
                return True
    return False


class FitIndex:
    """Constant-time "does this Cell fit?" over a ``FreeGpus`` that changes rarely.

    Per GPU type, how many nodes have at least g GPUs free, for every g. Scanning a long
    pending queue asks this for every Cell of every job while the free GPUs stay the same;
    call ``invalidate`` after changing the ``FreeGpus``.
    """

    def __init__(self, free: FreeGpus):
        self.free = free
        self.version = 0  # bumped on every change: answers cached under it stay valid
        self._at_least: dict[str, list[int]] | None = None

    def invalidate(self) -> None:
        self.version += 1
        self._at_least = None

    def fits(self, cell: Cell) -> bool:
        if self._at_least is None:
            self._at_least = {}
            for gtype, names in self.free.by_type.items():
                size = max((self.free.capacity[n] for n in names), default=0)
                counts = [0] * (size + 2)
                for n in names:
                    counts[max(0, min(self.free.free[n], size))] += 1
                for g in range(size, -1, -1):  # suffix sums: nodes with ≥ g free
                    counts[g] += counts[g + 1]
                self._at_least[gtype] = counts
        counts = self._at_least.get(cell.gpu_type)
        per_node = min(cell.gpus_per_node, cell.num_gpus)
        if counts is None or per_node > len(counts) - 2:  # larger than any node
            return False
        return counts[per_node] >= -(-cell.num_gpus // per_node)


def first_fitting(free: FreeGpus, estimates: tuple[CellEstimate, ...]) -> tuple[CellEstimate, tuple] | None:
    """The first estimate whose Cell can be placed now, with its placement, or None."""
    for e in estimates:
        if fits(free, e.cell):
            p = free.place(e.cell)
            if p is not None:
                return e, p
    return None


def realize(snapshot: Snapshot, wanted: dict[str, Cell | None], reasons: dict[str, str],
            order: list[str] | None = None, policy_state: object = None) -> Decision:
    """The Decision that gives each job in ``wanted`` its Cell, placed on nodes.

    Jobs keep their placement when their Cell does not change. Jobs whose Cell changes give
    their GPUs back first; then the resized or moved running jobs are placed (largest
    first), then the starts in ``order`` (the policy's priority). A running job whose new
    Cell cannot be placed keeps its old placement when that is still free, else waits;
    a start that cannot be placed waits, with the reason said.

    Args:
        snapshot: the policy's input.
        wanted: job id → the Cell it should run in, or None to wait / be suspended.
            Jobs left out keep what they have.
        reasons: job id → a short human reason.
        order: the order to place new starts in (default: snapshot order).
        policy_state: handed back unchanged in ``Decision.policy_state``.
    """
    free = FreeGpus.from_snapshot(snapshot)
    jobs = {j.job_id: j for j in snapshot.jobs}
    final: dict[str, Assignment | None] = {}
    moved: list[JobView] = []
    for j in snapshot.jobs:
        if j.job_id not in wanted:
            continue
        cell = wanted[j.job_id]
        if j.assignment is not None and cell == j.assignment.cell:
            final[j.job_id] = j.assignment
        elif j.assignment is not None:
            free.release(j.assignment.placement)
            if cell is None:
                final[j.job_id] = None
            else:
                moved.append(j)
        else:
            final[j.job_id] = None
    notes = dict(reasons)
    moved.sort(key=lambda j: (-wanted[j.job_id].num_gpus, j.submit_time_s, j.job_id))
    for j in moved:
        p = free.place(wanted[j.job_id])
        if p is not None:
            free.take(p)
            final[j.job_id] = Assignment(wanted[j.job_id], p)
        elif _all_free(free, j.assignment.placement):
            free.take(j.assignment.placement)
            final[j.job_id] = j.assignment
            notes[j.job_id] = f"kept {j.assignment.cell.label()}: no room for {wanted[j.job_id].label()}"
        else:
            final[j.job_id] = None
            notes[j.job_id] = f"suspended: no room for {wanted[j.job_id].label()}"
    starts = [i for i in (order or [j.job_id for j in snapshot.jobs])
              if i in wanted and wanted[i] is not None and jobs[i].assignment is None]
    for i in starts:
        p = free.place(wanted[i])
        if p is not None:
            free.take(p)
            final[i] = Assignment(wanted[i], p)
        else:
            notes[i] = f"waiting: {wanted[i].label()} does not fit on free nodes"
    out = tuple(JobDecision(j.job_id, final[j.job_id], notes.get(j.job_id, ""))
                for j in snapshot.jobs if j.job_id in final)
    return Decision(out, policy_state)


def checked_decision(snapshot: Snapshot, assign: dict[str, Assignment | None],
                     reasons: dict[str, str], policy_state: object = None) -> Decision:
    """A policy's own placements as a Decision, validated; ``realize`` re-derives them if not.

    Policies track node-level free GPUs while deciding, so their placements should always be
    a valid whole; the check guards against a bookkeeping slip ever over-committing a node.
    """
    own = Decision(tuple(JobDecision(j.job_id, assign.get(j.job_id, j.assignment),
                                     reasons.get(j.job_id, "")) for j in snapshot.jobs), policy_state)
    try:
        validate_decision(snapshot, own)
        return own
    except DecisionError as e:  # a bookkeeping slip; realize never over-commits
        log.warning("own placements invalid (%s); re-deriving them", e)
        wanted = {i: (a.cell if a else None) for i, a in assign.items()}
        return realize(snapshot, wanted, reasons, None, policy_state)


def rate_in(estimates, cell: Cell) -> float:
    """samples/s of ``cell``'s shape (type, count) among ``estimates``, 0.0 if absent."""
    for e in estimates:
        if e.cell == cell:
            return e.samples_per_s
    for e in estimates:
        if e.cell.gpu_type == cell.gpu_type and e.cell.num_gpus == cell.num_gpus:
            return e.samples_per_s
    return 0.0


def _all_free(free: FreeGpus, placement) -> bool:
    return all(free.free[n] >= g for n, g in placement)
