"""gavel-greedy: Arena's restatement of Gavel, a greedy, non-preemptive type chooser.

Not Gavel as published (that is ``policy.gavel``: its linear program over time fractions
and its round-based time sharing); this is what the Crius and Arena papers ran as their
Gavel baseline. Gavel (OSDI'20, ``scheduler/policies/max_sum_throughput.py``) picks each
job's GPU *type* to maximize the cluster's total throughput; the GPU *count* stays what the
job asked for, and a job sees data-parallel performance only (static parallelism). The Arena
artifact solves a 0/1 program per admission with at most three type changes of running jobs
per decision; here the same objective is followed greedily, which is exact for one job at a
time:

1. **Admission** (FIFO): each pending job takes the free GPU type where it runs fastest.
2. **Make room** when no type has room: move one running job to another type with room for
   it, freeing room for the pending job, when the total throughput rises (≤ ``max_moves``).
3. **Re-optimize**: a running job moves to a type where it runs faster when that type has
   free GPUs now (the largest gain first, within the same move budget).
"""

from __future__ import annotations

import logging

from estimator.cells import CellEstimate
from policy._solver import FitIndex, RateTable, checked_decision, fits, rate_in, requested_count
from policy.interface import Assignment, Decision, DerivedCache, Snapshot
from policy.placement import FreeGpus

log = logging.getLogger(__name__)

# Arena's Gavel baseline: at most this many running jobs change type in one decision.
MAX_MOVES = 3
# A move restarts the job; only worth it above this relative throughput gain.
MIN_MOVE_GAIN_FRAC = 0.05
# Blocked pending jobs (FIFO) that may look for a running job to move, per decision: the
# papers' Gavel re-solves on each arrival, one new job at a time.
MAX_ROOM_SEARCHES = 4


class GavelGreedyPolicy:
    """Arena's restatement of Gavel: requested GPU count, GPU type chosen greedily for
    maximum total throughput, no time sharing.

    Args:
        max_moves: running jobs that may change type in one decision.
        min_move_gain_frac: relative throughput gain a move must bring.
    """

    name = "gavel-greedy"
    extra_start_s = 0.0  # added to every (re)start by the simulator, beside the costs every policy pays
    extra_start_reason = "none: a greedy placement with nothing of its own to set up"

    def __init__(self, max_moves: int = MAX_MOVES, min_move_gain_frac: float = MIN_MOVE_GAIN_FRAC):
        self.max_moves = max_moves
        self.min_move_gain_frac = min_move_gain_frac

    def decide(self, snapshot: Snapshot) -> Decision:
        """Admit pending jobs on their fastest free type; move running jobs to faster ones."""
        free = FreeGpus.from_snapshot(snapshot)
        assign = {j.job_id: j.assignment for j in snapshot.jobs}
        rank = {j.job_id: k for k, j in enumerate(snapshot.jobs)}
        cache = snapshot.derived_cache()
        options = {j.job_id: _per_type(RateTable.of(j, True, cache), j, cache) for j in snapshot.jobs}
        reasons: dict[str, str] = {}
        moves_left = self.max_moves
        searches_left = MAX_ROOM_SEARCHES
        index = FitIndex(free)
        no_fit: dict[tuple[int, int], list] = {}

        # 1 + 2. Admission in submission order; a blocked job may move one running job away.
        for job in snapshot.jobs:
            if assign[job.job_id] is not None:
                continue
            opts = options[job.job_id]
            if not opts:
                reasons[job.job_id] = "waiting: no feasible data-parallel Cell at the requested count"
                continue
            # Jobs of one spec share ``opts``: once none fits, the rest of the queue's jobs
            # of that spec need no check until the free GPUs change.
            key = (id(opts), index.version)
            got = None if key in no_fit else _first_fitting(free, index, opts)
            if got is None:
                no_fit[key] = opts
            else:
                e, p = got
                free.take(p)
                index.invalidate()
                assign[job.job_id] = Assignment(e.cell, p)
                reasons[job.job_id] = f"started on {e.cell.label()} (fastest type with room)"
                continue
            if moves_left > 0 and searches_left > 0:
                searches_left -= 1
                if self._make_room(job.job_id, opts, free, assign, options, rank, reasons):
                    index.invalidate()
                    moves_left -= 1
                    continue
            reasons[job.job_id] = f"waiting for {opts[0].cell.num_gpus} GPUs of any type"

        # 3. Re-optimize: running jobs move to a faster type with free GPUs now.
        gains = []
        for i, a in assign.items():
            if a is None or moves_left <= 0:
                continue
            cur = rate_in(options[i], a.cell)
            for e in options[i]:
                if e.cell.gpu_type != a.cell.gpu_type and e.samples_per_s > cur * (1 + self.min_move_gain_frac):
                    gains.append((-(e.samples_per_s - cur), rank[i], i, e))
        gains.sort(key=lambda g: g[:2])
        moved: set[str] = set()
        for _, _, i, e in gains:
            if moves_left <= 0:
                break
            if i in moved or not fits(free, e.cell):
                continue
            p = free.place(e.cell)
            if p is None:
                continue
            free.take(p)
            free.release(assign[i].placement)
            reasons[i] = f"moved {assign[i].cell.gpu_type}→{e.cell.gpu_type}: faster, GPUs free"
            assign[i] = Assignment(e.cell, p)
            moved.add(i)
            moves_left -= 1
        return checked_decision(snapshot, assign, reasons)

    def _make_room(self, job_id, opts, free, assign, options, rank, reasons) -> bool:
        """Move one running job off a type so that ``job_id`` fits there; best total gain."""
        best = None
        for e in opts:
            t = e.cell.gpu_type
            for i, a in assign.items():
                if a is None or a.cell.gpu_type != t:
                    continue
                cur = rate_in(options[i], a.cell)
                for alt in options[i]:
                    if alt.cell.gpu_type == t or not fits(free, alt.cell):
                        continue
                    gain = e.samples_per_s + alt.samples_per_s - cur
                    if best is not None and (gain, -rank[i]) <= best[0]:
                        break
                    trial = free.copy()
                    trial.release(a.placement)
                    if fits(trial, e.cell):
                        best = ((gain, -rank[i]), i, alt, e)
                    break  # alternatives are fastest first: the first that fits is the best
        if best is None or best[0][0] <= 0:
            return False
        _, i, alt, e = best
        p_alt = free.place(alt.cell)
        if p_alt is None:
            return False
        free.take(p_alt)
        free.release(assign[i].placement)
        p = free.place(e.cell)
        if p is None:  # cannot happen after the trial; undo rather than over-commit
            free.release(p_alt)
            free.take(assign[i].placement)
            return False
        free.take(p)
        reasons[i] = f"moved {assign[i].cell.gpu_type}→{alt.cell.gpu_type} to admit job {job_id}"
        assign[i] = Assignment(alt.cell, p_alt)
        assign[job_id] = Assignment(e.cell, p)
        reasons[job_id] = f"started on {e.cell.label()} after moving job {i}"
        return True


def _per_type(table: RateTable, job, cache: DerivedCache) -> list[CellEstimate]:
    """The job's fastest data-parallel Cell of each type at its requested count, fastest first.

    Memoized per table (one per job spec) in the snapshot's cache, so jobs of one spec
    share one list.
    """
    n = requested_count(job, table)
    return cache.get("gavel_greedy_per_type", (table,), (n,), lambda: sorted(
        (table.options[(t, c)][0] for (t, c) in table.options if c == n),
        key=lambda e: (-e.samples_per_s, e.cell.label())))


def _first_fitting(free: FreeGpus, index: FitIndex, opts: list[CellEstimate]):
    for e in opts:
        if index.fits(e.cell):
            p = free.place(e.cell)
            if p is not None:
                return e, p
    return None
