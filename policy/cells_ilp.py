"""cells-ilp: one integer program per round over every job's Cells.

Each job considered this round gets one binary variable per candidate Cell (GPU type ×
GPU count × stages, the fastest plan of each shape) and one "wait" variable; exactly one
of them is 1. Per GPU type the chosen Cells fit the GPUs, and for every per-node share s
in use the GPUs of Cells needing s or more GPUs per node fit on nodes with at least s
free GPUs (a valid relaxation of node packing); a placement pass with repair then puts
the answer on nodes (``policy.placement``), so a decision never over-commits a node.

Objective (maximized), per job j and Cell c: the completion time the Cell saves, weighted,

    v_jc = w_j · (T_j + D − T_j / norm_jc) + w_R · (R_j − R_jc)        (wait: v = 0)

with w_j = a_j / T_j^β and w_R = max(w_j, 1 / D^β).

* ``norm_jc`` = samples/s on c over samples/s on what the job asked for, so models with
  many samples per second do not dominate; ``T_j / norm_jc`` is the time c needs.
* ``T_j`` = the job's remaining time on what it asked for. Dividing by T^β (β = 1 by
  default) favours jobs close to finishing: with β = 1, v_jc = a_j·((D − δ)/T_j +
  1 − 1/norm_jc), so starting a job is worth more the shorter it is (shortest-remaining-
  time-first, what minimizes average JCT under contention), and a faster Cell is worth
  its relative speed-up 1/norm_slow − 1/norm_fast whatever the job's length (a faster
  Cell held for a job's life saves time in proportion to the GPU time it uses, so long
  jobs should not outbid short ones for fast GPUs); the restart cost then weighs R/T,
  Rubick's rule, for jobs with less than D left. β < 1 lets long jobs outbid by T^(1−β).
* ``D`` = what waiting costs beyond the job's own time (``wait_cost_s``): the larger, the
  more admitting a job outweighs making an admitted job faster.
* ``a_j`` = 1 + (time since submission) / ``aging_s``: a job that waited long catches up
  with short newcomers, so none starves.
* ``R_jc`` = the restart cost of c: 0 for the Cell a job runs on, the snapshot's restart
  cost δ for a start, N·δ for a change of a running job with N = 1 + its restarts so far
  (Rubick's T − N·δ: a job restarted often becomes stickier); ``R_j`` = N·δ for a
  running job (suspending it means paying a restart later), 0 for a pending one.
* ``w_R``: a restart also idles the job's GPUs for its length, so it weighs at least what
  it would for a job with D left (without this floor long jobs were moved back and forth
  for small gains; on philly_2week it cut restarts per job from 1.1–1.2 to 0.7, the
  average JCT within 0.7 %). A running job changed less than ``min_change_interval_s``
  ago keeps its Cell.

Starvation bound (Slurm backfill's reservation, one job at a time): aging alone cannot
start a wide job whose GPUs many small jobs outbid it for, nor a job whose Cell needs
whole nodes that small jobs keep fragmenting. The pending job that has waited longest,
once it has waited ``reserve_after_s``, is decided before the program: it starts on its
best Cell that fits now; else on nodes freed by suspending running jobs that may change
(lowest weight first); else the nodes it needs least to wait for are held, their free
GPUs given to no one else, until it fits.

Options: ``guarantee`` (a guaranteed job only gets Cells at least as fast as what it asked
for, and a running one is never suspended), ``deadlines`` (a job with a deadline only
gets Cells that finish it in time; one that no Cell can finish in time is reported and
runs best effort), ``max_share_frac`` / ``share_limits`` (GPUs per user). The program goes
through ``policy.binary_program`` (HiGHS, CBC as fallback), warm-started from the current
allocation, under a time limit; when no solver answers, a greedy rule decides.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, replace

from estimator.cells import Cell, CellEstimate
from policy._solver import RateTable, requested_count
from policy.fcfs import requested_estimate
from policy.interface import Assignment, Decision, DerivedCache, JobDecision, JobView, QueueOrder, Snapshot
from policy.binary_program import SOLVERS
from policy.choice_program import solve_choice
from policy.placement import FreeGpus, name_beneficiaries

log = logging.getLogger(__name__)

WAIT = None  # the "wait" option of a job
MIN_TIME_S = 60.0  # remaining times below this weigh as this (a nearly done job is not infinitely urgent)


@dataclass(frozen=True)
class CellsIlpState:
    """What one decision hands the next: to skip re-solving a round where nothing changed.

    Attributes:
        fingerprint: (job id, Cell) of every job after the last solved decision, and
            the GPUs each node lends to jobs outside the policy.
        solved_s: when that decision was made.
    """

    fingerprint: tuple = ()
    solved_s: float = -math.inf


@dataclass(frozen=True)
class _Option:
    """One candidate of one job: a Cell (None = wait) and its objective value."""

    job_id: str
    cell: Cell | None
    value: float
    alternatives: tuple[Cell, ...] = ()  # same shape, other layouts, for placement repair
    current: bool = False  # the Cell the job runs on now


@dataclass(frozen=True)
class _Reservation:
    """The starvation bound's decision for the longest-waiting job, taken before the program.

    Attributes:
        job_id: the job.
        waited_s: how long it has waited.
        start: where it starts now, or None while its nodes drain.
        evicted: running jobs suspended to make room for it.
        hold: the free GPUs held for it on the nodes it waits for (nobody else gets them).
        reason: what the job's line says.
    """

    job_id: str
    waited_s: float
    start: Assignment | None
    evicted: tuple[str, ...] = ()
    hold: tuple[tuple[str, int], ...] = ()
    reason: str = ""

    def apply(self, free: FreeGpus, jobs: dict[str, JobView]) -> None:
        """Spend ``free`` as the reservation does: evictions freed, the start and the hold taken."""
        for job_id in self.evicted:
            free.release(jobs[job_id].assignment.placement)
        if self.start is not None:
            free.take(self.start.placement)
        free.take(self.hold)


@dataclass(frozen=True)
class _Shape:
    """The static rate facts of one job spec (shared by every job of the same spec)."""

    ref_rate: float  # samples/s of what was asked for
    cells: tuple[tuple[CellEstimate, tuple[Cell, ...]], ...]  # fastest per shape + alternatives


def _shape_of(job: JobView, cache: DerivedCache) -> _Shape:
    """The job's reference rate and its Cells by shape; jobs of one spec share their
    estimates tuple, so this is derived once per spec (in the snapshot's cache)."""
    return cache.get("cells_ilp_shape", (job.estimates, job.runnable_cells), (job.spec,),
                     lambda: _build_shape(job, cache))


def _build_shape(job: JobView, cache: DerivedCache) -> _Shape:
    table = RateTable.of(job, False, cache)
    n = requested_count(job, table)
    ref = 0.0
    if job.spec.gpu_type and n:
        ref = table.rate(job.spec.gpu_type, n)
    if ref <= 0:
        ref = max((table.rate(g, c) for g, c in table.options if c == n), default=0.0)
    if ref <= 0:
        best = table.best()
        ref = best.samples_per_s if best else 1.0
    cells = tuple((opts[0], tuple(o.cell for o in opts[1:])) for _, opts in sorted(table.options.items()))
    if all(not math.isfinite(e.iteration_time_s) for e, _ in cells):
        cells = ()  # only a "runs, rate unknown" stand-in: value it as below
    if not cells:
        # The memory model rejects every Cell but the platform runs what was asked for:
        # offer that (the baselines' rule), at the estimator's time when it has one.
        asked = requested_estimate(job)
        if asked is not None and job.can_run(asked.cell):
            it_s = asked.iteration_time_s if 0 < asked.iteration_time_s < math.inf else 1.0
            ref = job.spec.global_batch / it_s
            cells = ((replace(asked, samples_per_s=ref, iteration_time_s=it_s), ()),)
    return _Shape(ref, cells)


@dataclass(frozen=True)
class CellsIlpConfig:
    """cells-ilp's options (the daemon's ``policy_options``).

    Attributes:
        time_limit_s: seconds the solver may take per round.
        aging_s: waiting time that doubles a job's weight.
        wait_cost_s: D, what waiting costs a job beyond its own remaining time.
        size_exponent: β, how strongly short remaining times are favoured (0 to 1).
        min_change_interval_s: a running job keeps its Cell this long after a change.
        restart_penalty: charge the restart cost of changing a running job (False: free).
        type_changes: running jobs may change GPU type, and jobs may start on a type
            other than the one they asked for.
        count_changes: jobs may run on a GPU count other than the one they asked for.
        guarantee: honour ``JobView.guaranteed`` (never below the requested throughput).
        deadlines: honour ``JobView.deadline_s`` as a constraint on the Cells offered.
        max_share_frac: at most this share of all GPUs per user (None: no limit).
        share_limits: (user, share of all GPUs) pairs, overriding ``max_share_frac`` per user.
        max_pending: pending jobs (highest weight first) offered to one program.
        max_movable: running jobs that may change in one round (half the lowest
            weights, half the highest), the rest keep their Cells; bounds the program.
        resolve_s: a round where no job arrived, finished or changed re-solves only
            after this long.
        reserve_after_s: a pending job that has waited this long (since submission, or
            since it was suspended) gets the starvation bound's reservation; None: never.
        solvers: the solvers to try in order (``highs``, ``cbc``); none left means the
            greedy rule decides.
    """

    time_limit_s: float = 0.3
    aging_s: float = 4 * 3600.0
    wait_cost_s: float = 3600.0
    size_exponent: float = 1.0
    min_change_interval_s: float = 1800.0
    restart_penalty: bool = True
    type_changes: bool = True
    count_changes: bool = True
    guarantee: bool = True
    deadlines: bool = True
    max_share_frac: float | None = None
    share_limits: tuple[tuple[str, float], ...] = ()
    max_pending: int = 96
    max_movable: int = 32
    resolve_s: float = 900.0
    reserve_after_s: float | None = 6 * 3600.0
    solvers: tuple[str, ...] = SOLVERS

    def __post_init__(self):
        # Checked when the options are read (the daemon's config), not in a round.
        positive = {"time_limit_s": self.time_limit_s, "aging_s": self.aging_s, "wait_cost_s": self.wait_cost_s}
        at_least_zero = {"min_change_interval_s": self.min_change_interval_s, "resolve_s": self.resolve_s,
                         "max_movable": self.max_movable,
                         "reserve_after_s": 0.0 if self.reserve_after_s is None else self.reserve_after_s}
        for name, value in positive.items():
            if not value > 0 or value == math.inf:
                raise ValueError(f"{name}={value!r} must be a number of seconds above 0")
        for name, value in at_least_zero.items():
            if not value >= 0 or value == math.inf:
                raise ValueError(f"{name}={value!r} must be 0 or more")
        if not 0 <= self.size_exponent <= 1:
            raise ValueError(f"size_exponent={self.size_exponent!r} must be between 0 and 1")
        if self.max_pending < 1:
            raise ValueError(f"max_pending={self.max_pending!r} must be at least 1")
        for name, share in [("max_share_frac", self.max_share_frac), *self.share_limits]:
            if share is not None and not 0 < share <= 1:
                raise ValueError(f"share of all GPUs for {name}={share!r} must be above 0 and at most 1")


class CellsIlpPolicy:
    """The Cell ILP policy (see the module docstring for the formulation); its options are
    a :class:`CellsIlpConfig`.
    """

    name = "cells-ilp"
    config_class = CellsIlpConfig  # its options' names and types (the daemon's config check)
    plan_tuning = "pruned"  # Cells come with estimates, so the plan search is Cell-guided
    extra_start_s = 0.0  # added to every (re)start by the simulator, beside the costs every policy pays
    extra_start_reason = "none: its Cell-guided plan search is the runtime's own, charged to every policy"

    def __init__(self, config: CellsIlpConfig | None = None, **options):
        """``config``, with any of its fields overridden by ``options`` (the daemon's
        ``policy_options``); an unknown option raises TypeError naming it."""
        base = config or CellsIlpConfig()
        if "share_limits" in options:
            options["share_limits"] = tuple(sorted(dict(options["share_limits"] or {}).items()))
        if "solvers" in options:
            options["solvers"] = tuple(options["solvers"])
        self.config = replace(base, **options)
        unknown = [s for s in self.config.solvers if s not in SOLVERS]
        if unknown:
            raise ValueError(f"unknown solver {unknown[0]!r} in solvers; known: {', '.join(SOLVERS)}")
        self._share_limits = dict(self.config.share_limits)

    # ---- weights and options ------------------------------------------------------------

    def _scale(self, snapshot: Snapshot, job: JobView) -> tuple[float, float]:
        """(T_ref, the job's weight per second saved): its remaining time on what it asked
        for, and aging / T_ref^β."""
        shape = _shape_of(job, snapshot.derived_cache())
        t_ref_s = max(job.remaining_iterations, 1e-9) * job.spec.global_batch / shape.ref_rate
        aging = 1.0 + max(0.0, snapshot.now_s - job.submit_time_s) / self.config.aging_s
        return t_ref_s, aging / max(t_ref_s, MIN_TIME_S) ** self.config.size_exponent

    def weight(self, snapshot: Snapshot, job: JobView) -> float:
        """The job's priority: what running it as asked is worth (its value over waiting)."""
        t_ref_s, per_s = self._scale(snapshot, job)
        return per_s * self.config.wait_cost_s

    def options(self, snapshot: Snapshot, job: JobView, idle: bool = False) -> tuple[list[_Option], str]:
        """The job's candidates (wait included, listed last) and a note (deadline report).

        Args:
            idle: also offer Cells worth less than waiting for a faster one (for GPUs
                nobody else was given this round: running slowly beats idling, and the
                job moves when a faster Cell frees up).
        """
        shape = _shape_of(job, snapshot.derived_cache())
        cur = job.cell
        asked_type = job.spec.gpu_type or (cur.gpu_type if cur else None)
        asked_n = job.spec.num_gpus
        rem_samples = max(job.remaining_iterations, 1e-9) * job.spec.global_batch
        t_ref_s, per_s = self._scale(snapshot, job)
        delta_s = snapshot.restart_cost_s if self.config.restart_penalty else 0.0
        restart_s = delta_s * (1 + job.restarts) if cur is not None else delta_s
        # Waiting costs the job its remaining time plus D; a running job also holds a
        # restart (R_j) that suspending it would make it pay later.
        wait_cost_s = t_ref_s + self.config.wait_cost_s
        held_s = restart_s if cur is not None else 0.0
        # A restart also idles the job's GPUs for its length, time a waiting job could have
        # used: it weighs at least what it would for a job with D left.
        restart_weight = max(per_s, 1.0 / self.config.wait_cost_s ** self.config.size_exponent)
        candidates = []
        # A running job laid out as Slurm placed it (2 + 2 where 4 on a node is listed) keeps its shape's Cell.
        unlisted = cur is not None and not any(cur == f.cell or cur in a for f, a in shape.cells)
        for e, alts in shape.cells:
            c = e.cell
            is_cur = cur is not None and (c == cur or cur in alts or unlisted and (c.gpu_type, c.num_gpus) == (
                cur.gpu_type, cur.num_gpus))
            if is_cur:
                c, alts = cur, tuple(a for a in (e.cell,) + alts if a != cur)
            elif not self.config.type_changes and asked_type and c.gpu_type != (cur.gpu_type if cur else asked_type):
                continue
            elif not self.config.count_changes and c.num_gpus != (cur.num_gpus if cur else (asked_n or c.num_gpus)):
                continue
            if self.config.guarantee and job.guaranteed:
                if e.samples_per_s < shape.ref_rate * (1 - 1e-9):
                    continue
                alts = ()  # other layouts of the shape may be slower than what was asked for
            t_s = rem_samples / e.samples_per_s  # = T_ref / normalized throughput
            value = per_s * (wait_cost_s - t_s) + restart_weight * (held_s - (0.0 if is_cur else restart_s))
            candidates.append((e, c, alts, t_s, is_cur, value))
        if cur is not None and not any(x[4] for x in candidates):  # its Cell has no feasible estimate now:
            known = job.feasible_like(cur)  # it stays a choice, at its shape's speed where known
            t_s = rem_samples / known.samples_per_s if known is not None and known.samples_per_s > 0 else t_ref_s
            candidates.append((known, cur, (), t_s, True, per_s * (wait_cost_s - t_s) + restart_weight * held_s))
        note = ""
        if self.config.deadlines and job.deadline_s is not None and candidates:
            # A first start is not charged a restart (its launch is not a checkpoint and resume).
            start_s = snapshot.restart_cost_s if job.has_run else 0.0
            meets = [x for x in candidates
                     if snapshot.now_s + (0.0 if x[4] else start_s) + x[3] <= job.deadline_s]
            if not meets:
                note = "cannot meet its deadline on any Cell; runs best effort"
            else:
                # Its own Cell stays a choice: a running job is not suspended for a
                # deadline that only busy Cells would meet.
                candidates = meets + [x for x in candidates if x[4] and x not in meets]
                # Another layout placed in a Cell's stead may be slower: it must meet the deadline too.
                ests = {a: job.estimate_for(a) for x in candidates for a in x[2]}
                ok = {a for a, est in ests.items() if est is not None and est.samples_per_s > 0
                      and snapshot.now_s + start_s + rem_samples / est.samples_per_s <= job.deadline_s}
                candidates = [(x[0], x[1], tuple(a for a in x[2] if a in ok), *x[3:]) for x in candidates]
        # Waiting is worth 0 to a pending job. A running job on a Cell worth less than that
        # (a slow Cell it was given because nothing else used it) is not suspended for
        # nothing: suspending it is worth a restart less than staying, so it only
        # happens when another job gains more from its GPUs.
        wait_value = 0.0
        if cur is not None:
            now_value = next((x[5] for x in candidates if x[4]), 0.0)
            wait_value = min(0.0, now_value - restart_weight * restart_s)
        out = [_Option(job.job_id, c, value, alts, is_cur) for e, c, alts, t_s, is_cur, value in candidates
               if value > wait_value or is_cur or idle]
        out = _undominated(out)
        if not (self.config.guarantee and job.guaranteed and cur is not None and any(o.cell == cur for o in out)):
            out.append(_Option(job.job_id, WAIT, wait_value))
        return out, note

    def queue_order(self, snapshot: Snapshot) -> QueueOrder:
        """Waiting jobs by weight, each with its Cells best value first: the greedy rule's
        inputs (:meth:`_greedy`), which the forecast plays out beyond its decisions
        (``policy.forecast``); jobs with no Cell are left out."""
        waiting = sorted(((-self.weight(snapshot, j), j.submit_time_s, j.job_id, j)
                          for j in snapshot.jobs if j.assignment is None), key=lambda x: x[:3])
        out = []
        for *_, job in waiting:
            offered = [o for o in self.options(snapshot, job)[0] if o.cell is not None] or \
                [o for o in self.options(snapshot, job, idle=True)[0] if o.cell is not None]
            if offered:
                offered.sort(key=lambda o: (-o.value, o.cell.label()))
                out.append((job.job_id, tuple(o.cell for o in offered)))
        return QueueOrder(tuple(out))

    # ---- the round ----------------------------------------------------------------------

    @staticmethod
    def solve_next(state: object) -> object:
        """The state with which the next ``decide`` solves, whatever its memo says (the
        state is nothing but that memo)."""
        return None

    def decide(self, snapshot: Snapshot) -> Decision:
        """Solve the round's program (or skip an unchanged round) and place the answer."""
        fp = _fingerprint(snapshot, {})
        state = snapshot.policy_state if isinstance(snapshot.policy_state, CellsIlpState) else None
        if state is not None and state.fingerprint == fp and snapshot.now_s - state.solved_s < self.config.resolve_s:
            return Decision((), state, holds=None)  # what it held stays held
        weights = {j.job_id: self.weight(snapshot, j) for j in snapshot.jobs}
        reservation = self._reservation(snapshot, weights)
        skip = {reservation.job_id, *reservation.evicted} if reservation else set()
        # Jobs on nodes held for the reservation run on there until they end (the nodes
        # drain for it): moved or suspended, their GPUs would go to others.
        held = {n for n, g in reservation.hold if g > 0} if reservation else set()
        draining = {j.job_id for j in snapshot.jobs if j.assignment is not None
                    and any(n in held for n, _ in j.assignment.placement)}
        movable, fixed, known = self._split(snapshot, weights, skip, draining)
        pending = sorted((j for j in snapshot.jobs if j.assignment is None and j.job_id not in skip),
                         key=lambda j: (-weights[j.job_id], j.submit_time_s, j.job_id))
        offered = movable + pending[: self.config.max_pending]
        options: dict[str, list[_Option]] = {}
        reasons: dict[str, str] = {}
        for j in offered:
            options[j.job_id], note = known.get(j.job_id) or self.options(snapshot, j)
            if note:
                reasons[j.job_id] = note
        free = FreeGpus.from_snapshot(snapshot)
        if reservation:
            reservation.apply(free, snapshot.job_index())
        for j in movable:
            free.release(j.assignment.placement)
        users = {j.job_id: j.user for j in snapshot.jobs}
        share_left = self._share_left(snapshot, fixed)
        if reservation and reservation.start and users[reservation.job_id] in share_left:
            share_left[users[reservation.job_id]] -= reservation.start.num_gpus
        chosen, how = solve_choice(options, free, users, share_left, self.config.time_limit_s, self.config.solvers)
        if chosen is None or how != "ILP":
            # No answer, or one cut short by the time limit: the greedy rule's when better.
            greedy = self._greedy(offered, options, free, users, share_left)
            if chosen is None or _total(greedy) > _total(chosen) + 1e-12:
                chosen, how = greedy, "greedy"
        decision = self._place(snapshot, offered, pending, chosen, options, weights, reasons, how, share_left,
                               reservation)
        holds = ((reservation.job_id, tuple(sorted({n for n, g in reservation.hold if g > 0}))),) \
            if reservation and any(g > 0 for _, g in reservation.hold) else ()
        return Decision(decision, CellsIlpState(_fingerprint_after(snapshot, decision), snapshot.now_s), holds)

    def _reservation(self, snapshot: Snapshot, weights: dict[str, float]) -> _Reservation | None:
        """The starvation bound: the longest-waiting job past ``reserve_after_s`` that has a
        Cell on this cluster starts now (on free GPUs, else on GPUs of running jobs that may
        change, lowest weight first), or the nodes it needs are held for it; None when no
        job has waited that long."""
        if self.config.reserve_after_s is None:
            return None
        starving = sorted(((snapshot.now_s - j.last_change_s, j) for j in snapshot.jobs
                           if j.assignment is None and snapshot.now_s - j.last_change_s >= self.config.reserve_after_s),
                          key=lambda x: (-x[0], x[1].submit_time_s, x[1].job_id))
        if not starving:
            return None
        free = FreeGpus.from_snapshot(snapshot)
        on_node: dict[str, list[JobView]] = {}
        running = [j for j in snapshot.jobs if j.assignment is not None]
        for j in running:
            if snapshot.now_s - j.last_change_s >= self.config.min_change_interval_s and \
                    not (self.config.guarantee and j.guaranteed):
                for node, _ in j.assignment.placement:
                    on_node.setdefault(node, []).append(j)
        share_left = self._share_left(snapshot, running)
        for wait_s, job in starving:
            gpus_left = share_left.get(job.user, math.inf)
            opts = sorted((o for o in self.options(snapshot, job, idle=True)[0] if o.cell is not None),
                          key=lambda o: (-o.value, o.cell.label()))
            best = None  # ((status, cost, rank by value), cell, plan): free GPUs first, then fewest suspended
            for rank, o in enumerate(opts):
                for cell in (o.cell, *o.alternatives):
                    plan = _reserve_plan(cell, free, on_node, weights) if cell.num_gpus <= gpus_left else None
                    if plan is not None and (best is None or (plan[0], plan[1], rank) < best[0]):
                        best = ((plan[0], plan[1], rank), cell, plan)
            if best is None:
                continue
            _, cell, (status, _, placement, evicted, hold) = best
            waited = _waited(wait_s)
            if status == _HOLD:
                nodes = ",".join(n for n, _ in hold) or "busy nodes"
                return _Reservation(job.job_id, wait_s, None, (), hold, f"{waited}: {nodes} held for {cell.label()}")
            return _Reservation(job.job_id, wait_s, Assignment(cell, placement), evicted, (),
                                f"started on {cell.label()}: {waited}")
        return None

    def _split(self, snapshot: Snapshot, weights: dict[str, float], skip: set[str], frozen: set[str] = frozenset()
               ) -> tuple[list[JobView], list[JobView], dict[str, tuple[list[_Option], str]]]:
        """(running jobs that may change this round, running jobs that keep their Cells,
        the options already computed on the way); jobs in ``skip`` are in neither list,
        those in ``frozen`` keep their Cells.

        When more may change than ``max_movable``, half are the jobs a change would gain
        the most (their best Cell's value over their current one's: a long job on a slow
        Cell that a faster one would finish hours sooner) and half the jobs of lowest
        weight (whose GPUs others may use best).
        """
        running = [j for j in snapshot.jobs if j.assignment is not None and j.job_id not in skip]
        eligible = [j for j in running if snapshot.now_s - j.last_change_s >= self.config.min_change_interval_s
                    and j.job_id not in frozen]
        known: dict[str, tuple[list[_Option], str]] = {}
        if len(eligible) > self.config.max_movable:
            half = self.config.max_movable // 2
            known = {j.job_id: self.options(snapshot, j) for j in eligible}
            gains = {job_id: _gain(opts) for job_id, (opts, _) in known.items()}
            by_gain = sorted((j for j in eligible if gains[j.job_id] > 0),
                             key=lambda j: (-gains[j.job_id], j.job_id))[:half]
            ids = {j.job_id for j in by_gain}
            donors = sorted((j for j in eligible if j.job_id not in ids), key=lambda j: (weights[j.job_id], j.job_id))
            eligible = by_gain + donors[: self.config.max_movable - len(by_gain)]
        ids = {j.job_id for j in eligible}
        return eligible, [j for j in running if j.job_id not in ids], known

    def _share_left(self, snapshot: Snapshot, fixed: list[JobView]) -> dict[str, float]:
        """user → GPUs the user may still get this round (absent: no limit)."""
        if self.config.max_share_frac is None and not self._share_limits:
            return {}
        users = {j.user for j in snapshot.jobs}
        total = sum(snapshot.gpus_by_type().values())
        out = {}
        for u in sorted(users):
            frac = self._share_limits.get(u, self.config.max_share_frac)
            if frac is None:
                continue
            held = sum(j.assignment.num_gpus for j in fixed if j.user == u)
            out[u] = max(0.0, math.floor(frac * total + 1e-9) - held)
        return out

    def _greedy(self, offered, options, free: FreeGpus, users, share_left) -> dict[str, _Option]:
        """Fallback: running jobs keep their Cells; the rest, by weight, take the best fitting Cell."""
        trial = free.copy()
        left = dict(share_left)
        out: dict[str, _Option] = {}
        for j in offered:
            if j.assignment is None:
                continue
            mine = next((o for o in options[j.job_id] if o.cell == j.cell), None)
            if mine is not None and trial.all_free(j.assignment.placement):
                trial.take(j.assignment.placement)
                out[j.job_id] = mine
                _spend(left, j.user, j.cell.num_gpus)
        for j in offered:
            if j.job_id in out:
                continue
            for o in sorted(options[j.job_id], key=lambda o: -o.value):
                if o.cell is None:
                    if j.assignment is None or not any(x.cell == j.cell for x in options[j.job_id]):
                        out[j.job_id] = o
                        break
                    continue
                if left.get(users[j.job_id], math.inf) < o.cell.num_gpus:
                    continue
                p = trial.place(o.cell)
                if p is not None:
                    trial.take(p)
                    out[j.job_id] = o
                    _spend(left, users[j.job_id], o.cell.num_gpus)
                    break
        return out

    def _place_changed(self, snapshot, offered, chosen, options, weights, how, share_left,
                       reservation: _Reservation | None, kept: set[str]):
        """Place the reservation and every job whose Cell changes; running jobs in ``kept``
        stay on their GPUs should their new Cell not fit. Returns the free GPUs left, the
        assignments, reasons, share left, the jobs tried, and the running jobs in none of
        these that lost their GPUs to another's move (to be kept on the next try)."""
        free = FreeGpus.from_snapshot(snapshot)
        final: dict[str, Assignment | None] = {}
        reasons: dict[str, str] = {}
        if reservation:
            reservation.apply(free, snapshot.job_index())
            final[reservation.job_id] = reservation.start
            reasons[reservation.job_id] = reservation.reason
            final.update((job_id, None) for job_id in reservation.evicted)
        changed: list[JobView] = []
        left = dict(share_left)
        for j in offered:
            o = chosen.get(j.job_id)
            cell = o.cell if o is not None else None
            if j.assignment is not None and cell == j.assignment.cell:
                _spend(left, j.user, j.assignment.num_gpus)
                continue
            if j.assignment is not None:
                free.release(j.assignment.placement)
            if cell is None:
                final[j.job_id] = None
                reasons[j.job_id] = (f"{how}: suspended for jobs of higher weight" if j.assignment is not None
                                     else "waiting: not chosen this round")
            else:
                changed.append(j)
        # The GPUs of a running job kept on them are its own.
        fallback = {j.job_id: j.assignment.placement for j in changed if j.job_id in kept}
        for placement in fallback.values():
            free.take(placement)
        # Running jobs first (they hold state), then starts; heavier jobs first within each.
        changed.sort(key=lambda j: (j.assignment is None, -weights[j.job_id], j.job_id))
        tried: set[str] = set()
        lost: set[str] = set()
        for j in changed:
            o = chosen[j.job_id]
            repair = options[j.job_id] if j.assignment is None else []
            if j.job_id in fallback:
                free.release(fallback[j.job_id])
            got = _place_first(free, [o.cell, *o.alternatives], repair, left.get(j.user, math.inf))
            tried.add(j.job_id)
            if got is not None:
                final[j.job_id] = got
                _spend(left, j.user, got.num_gpus)
                verb = "started on" if j.assignment is None else "moved to"
                fixed = "" if got.cell in (o.cell, *o.alternatives) else f" (repair: {o.cell.label()} did not fit)"
                reasons[j.job_id] = f"{how}: {verb} {got.cell.label()}{fixed}"
            elif j.assignment is not None and free.all_free(j.assignment.placement):
                free.take(j.assignment.placement)
                final[j.job_id] = j.assignment
                _spend(left, j.user, j.assignment.num_gpus)
                reasons[j.job_id] = f"kept {j.cell.label()}: no room for {o.cell.label()}"
            else:
                if j.assignment is not None:
                    lost.add(j.job_id)
                final[j.job_id] = None
                reasons[j.job_id] = f"waiting: {o.cell.label()} does not fit on free nodes"
        return free, final, reasons, left, tried, lost

    def _place(self, snapshot, offered, pending, chosen, options, weights, reasons, how, share_left,
               reservation: _Reservation | None = None):
        """Put the chosen Cells on nodes; repair what does not fit; backfill leftovers."""
        notes = dict(reasons)
        # A running job whose new Cell does not fit keeps its GPUs; when a heavier job's move
        # took them, the placement is made again with them kept for it (at most once per
        # running job: the kept set only grows).
        kept: set[str] = set()
        while True:
            free, final, reasons, left, tried, lost = self._place_changed(
                snapshot, offered, chosen, options, weights, how, share_left, reservation, kept)
            if not lost:
                break
            kept |= lost
        # Backfill: GPUs the packing left free go to pending jobs by weight, on Cells no
        # larger than they asked for — also Cells slower than the job would wait for
        # (Crius's opportunistic execution) — so nothing idles while jobs wait. A job with
        # no Cell that small (its model fits only on more GPUs) may take its larger ones:
        # else a long one, which the packing leaves waiting, would never start.
        spare = free.total_free()
        for j in pending[: 4 * self.config.max_pending]:
            if spare <= 0:
                break
            if j.job_id in tried or final.get(j.job_id) is not None:
                continue
            opts = self.options(snapshot, j, idle=True)[0]
            cells = [o for o in opts if o.cell is not None]
            small = [o for o in cells if o.cell.num_gpus <= (j.spec.num_gpus or o.cell.num_gpus)] or cells
            got = _place_first(free, [], small, min(spare, left.get(j.user, math.inf)))
            if got is not None:
                final[j.job_id] = got
                spare -= got.num_gpus
                _spend(left, j.user, got.num_gpus)
                reasons[j.job_id] = f"backfilled on {got.cell.label()}"
        name_beneficiaries(snapshot, final, reasons)
        for job_id in reservation.evicted if reservation else ():
            reasons[job_id] = f"suspended for job {reservation.job_id}, which {_waited(reservation.waited_s)}"
        return tuple(JobDecision(j.job_id, final[j.job_id], _with_note(reasons.get(j.job_id, ""), notes.get(j.job_id)))
                     for j in snapshot.jobs if j.job_id in final)


def _waited(wait_s: float) -> str:
    return f"waited {wait_s / 3600:.1f} h (starvation bound)"


_NOW, _EVICT, _HOLD = 0, 1, 2  # how a reserved job gets its Cell: free GPUs, suspensions, draining


def _reserve_plan(cell: Cell, free: FreeGpus, on_node: dict[str, list[JobView]], weights: dict[str, float]):
    """How a reserved job could get ``cell``: (status, cost, placement, evicted job ids, hold),
    or None when the cluster has too few nodes for its layout.

    ``_NOW`` fits on free GPUs (cost 0). ``_EVICT`` fits once the running jobs in
    ``on_node`` (those that may change) on its nodes are suspended, lowest weight first
    (cost: their GPUs). ``_HOLD`` does not fit yet: the free GPUs of the nodes it needs
    least to wait for are held (cost: the GPUs still to be freed there).
    """
    placement = free.place(cell)
    if placement is not None:
        return _NOW, 0, placement, (), ()
    per_node = min(cell.gpus_per_node, cell.num_gpus)
    if cell.num_gpus % per_node or per_node & (per_node - 1):
        return None
    num_nodes = cell.num_gpus // per_node
    names = [n for n in free.by_type.get(cell.gpu_type, ()) if free.capacity[n] >= per_node]
    if len(names) < num_nodes:
        return None
    evictable = {n: sum(g for j in on_node.get(n, ()) for m, g in j.assignment.placement if m == n) for n in names}
    short = {n: max(0, per_node - free.free[n] - evictable[n]) for n in names}
    need = {n: max(0, per_node - free.free[n]) for n in names}
    chosen = sorted(names, key=lambda n: (short[n], need[n], n))[:num_nodes]
    if any(short[n] for n in chosen):
        hold = tuple((n, min(free.free[n], per_node)) for n in chosen if free.free[n] > 0)
        return _HOLD, sum(short[n] for n in chosen), None, (), hold
    trial, evicted = free.copy(), {}
    for n in chosen:
        for j in sorted(on_node.get(n, ()), key=lambda j: (weights[j.job_id], j.job_id)):
            if trial.free[n] >= per_node:
                break
            if j.job_id not in evicted:
                trial.release(j.assignment.placement)
                evicted[j.job_id] = j.assignment.num_gpus
    return _EVICT, sum(evicted.values()), tuple(sorted((n, per_node) for n in chosen)), tuple(evicted), ()


def _gain(options: list[_Option]) -> float:
    """What a running job's best Cell is worth over the one it runs on."""
    now_value = next((o.value for o in options if o.current), 0.0)
    return max((o.value for o in options if o.cell is not None), default=now_value) - now_value


def _with_note(reason: str, note: str | None) -> str:
    return f"{reason}; {note}" if note and reason else (note or reason)


def _spend(left: dict[str, float], user: str, gpus: int) -> None:
    """Count GPUs against a user's share left this round (absent: no limit)."""
    if user in left:
        left[user] -= gpus


def _place_first(free: FreeGpus, first: list[Cell], options: list[_Option], share_gpus: float) -> Assignment | None:
    """Take the first Cell that fits: ``first`` in order, then ``options`` by value (with their layouts)."""
    tries = list(first)
    for o in sorted((o for o in options if o.cell is not None), key=lambda o: (-o.value, o.cell.label())):
        tries += [o.cell, *o.alternatives]
    seen: set[Cell] = set()
    for cell in tries:
        if cell in seen or cell.num_gpus > share_gpus:
            continue
        seen.add(cell)
        if free.free_of_type(cell.gpu_type) < cell.num_gpus:
            continue
        p = free.place(cell)
        if p is not None:
            free.take(p)
            return Assignment(cell, p)
    return None


def _undominated(options: list[_Option]) -> list[_Option]:
    """Drop a Cell when another of the same type is worth at least as much with no more
    GPUs and no more GPUs per node: no optimum needs it, and the program gets smaller."""
    def dominated(o: _Option) -> bool:
        for p in options:
            if p is o or p.cell.gpu_type != o.cell.gpu_type or o.current:
                continue
            if p.value >= o.value and p.cell.num_gpus <= o.cell.num_gpus and \
                    min(p.cell.gpus_per_node, p.cell.num_gpus) <= min(o.cell.gpus_per_node, o.cell.num_gpus) and \
                    (p.value, -p.cell.num_gpus, p.cell.label()) > (o.value, -o.cell.num_gpus, o.cell.label()):
                return True
        return False

    return [o for o in options if not dominated(o)]


def _total(chosen: dict[str, _Option]) -> float:
    return sum(o.value for o in chosen.values())


def _fingerprint(snapshot: Snapshot, decisions: dict[str, JobDecision]) -> tuple:
    """Every job's Cell (after ``decisions``) and the GPUs held outside the policy.

    The second part matters in the daemon: an ordinary Slurm job that ends frees GPUs
    without any managed job changing, and that round must be solved again.
    """
    cells = tuple((j.job_id, (decisions[j.job_id].assignment.cell if decisions[j.job_id].assignment else None)
                   if j.job_id in decisions else j.cell) for j in snapshot.jobs)
    return cells, tuple(n.unmanaged_gpus for n in snapshot.nodes)


def _fingerprint_after(snapshot: Snapshot, decisions: tuple[JobDecision, ...]) -> tuple:
    return _fingerprint(snapshot, {x.job_id: x for x in decisions})


# ---- ablations, registered under their own names ---------------------------------------


class CellsIlpNoRestartPenalty(CellsIlpPolicy):
    """cells-ilp with restarts free in the objective (ablation)."""

    name = "cells-ilp-no-restart"

    def __init__(self, **config):
        super().__init__(**{**config, "restart_penalty": False})


class CellsIlpNoTypeChange(CellsIlpPolicy):
    """cells-ilp that never changes a job's GPU type (ablation)."""

    name = "cells-ilp-no-type-change"

    def __init__(self, **config):
        super().__init__(**{**config, "type_changes": False})


class CellsIlpNoCountChange(CellsIlpPolicy):
    """cells-ilp that never changes a job's GPU count (ablation)."""

    name = "cells-ilp-no-count-change"

    def __init__(self, **config):
        super().__init__(**{**config, "count_changes": False})
