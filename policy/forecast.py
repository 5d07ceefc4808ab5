"""When each job will start and finish: the policy run forward from the current snapshot.

The daemon's own policy object decides, round after round, on a copy of the cluster that
moves forward in time with no new arrivals:

- running managed jobs progress at the speed of their Cell's estimate (refined by what
  their runner measured, as the daemon passes it in), from their real current step;
- GPUs held outside the policy (plain Slurm jobs) come free at those jobs' end times
  (Slurm's end time: start plus time limit), given as :class:`GpuRelease` events;
- waiting jobs take whatever the policy decides as GPUs come free; every (re)start holds
  its GPUs without progress for what the caller's ``start_cost`` says (the replay's own
  cost model in the simulator), or else the snapshot's ``restart_cost_s``.

The forward run goes from event to event (a job finishing, GPUs released), deciding at
each (no sooner than ``min_step_s`` after the last decision: the daemon's round), and a
round after a decision while a waiting job fits free GPUs (a policy such as sia starts jobs
at its rounds only). It stops when every job has finished or when nothing can change any
more. A policy's ``decide`` is pure, so the
daemon's own policy state is not touched: the run starts from the snapshot's
``policy_state`` and keeps its own.

A decision over a long queue costs a quarter of a second or more, and a queue of
thousands needs dozens of them to reach its last job. So after ``max_decisions``
decisions (or ``time_budget_s`` of wall time) the run goes on as a list schedule
(:func:`_extrapolate`): running jobs keep their Cells, and as GPUs come free, waiting
jobs take them in the order the policy's ``queue_order`` gives, each on the first of its
Cells (in the policy's preference) whose GPUs are free: for cells-ilp, the greedy rule it
falls back on when no solver answers. A policy without ``queue_order`` is played out in
submission order, each job on what it asked for. The near future, where a forecast is
checked soonest, is the policy's own decisions; the far tail is its ranking played out
without its packing and rescaling.
"""

from __future__ import annotations

import heapq
import itertools
import math
import time
from dataclasses import dataclass, field, replace
from typing import Callable, NamedTuple

from estimator.cells import Cell
from policy.fcfs import requested_estimate
from policy.placement import job_fitting_idle_gpus
from policy.interface import (
    PENDING, RUNNING, SUSPEND, TRIGGER_COMPLETION, TRIGGER_ROUND, Assignment, Decision, DecisionError, JobView,
    NodeView, Policy, QueueOrder, Snapshot, implied_actions, validate_decision,
)

DEFAULT_MAX_DECISIONS = 60
DEFAULT_HORIZON_S = 90 * 86400.0
DEFAULT_STEP_FRAC = 0.0
QUEUE_WINDOW_JOBS = 96  # waiting jobs a backfilling list schedule looks at, in order


@dataclass(frozen=True)
class Start:
    """One (re)start in the forward run, as the caller's cost model sees it.

    Attributes:
        view: the job as it was before the start.
        after: where it starts.
        first_in_run: neither running at the forecast's start nor started by the run yet.
        cells_run: the Cells (labels) it ran on so far, at the forecast's start and in the run.
    """

    view: JobView
    after: Assignment
    first_in_run: bool
    cells_run: tuple[str, ...]


# Seconds a (re)start holds the job's GPUs without progress.
StartCost = Callable[[Start], float]


class _Event(NamedTuple):
    """GPUs coming free in the list schedule: a job ending, or a release outside the policy."""

    at_s: float
    seq: int
    job_id: str  # "" for a release
    gpu_type: str
    gpus: int
    node: str = ""  # a release's node


@dataclass(frozen=True)
class GpuRelease:
    """GPUs held outside the policy on ``node`` that come free at ``at_s``."""

    at_s: float
    node: str
    gpus: int


@dataclass(frozen=True)
class JobForecast:
    """One job's expected start (its last start if it runs now), end, and the Cells it is
    expected to pass through (labels, in order, the current one first when it runs);
    ``next_start_s``: when it is next expected to start from waiting (its start, for a
    job waiting now; a restart, for one running now that is suspended on the way)."""

    job_id: str
    start_s: float | None
    end_s: float | None
    cells: tuple[str, ...] = ()
    extrapolated: bool = False  # its start or end came from the list schedule
    next_start_s: float | None = None


@dataclass
class _Job:
    view: JobView
    start_s: float | None
    end_s: float | None = None
    busy_until_s: float = 0.0  # a (re)start's cost: GPUs held, no progress
    cells: list[str] = field(default_factory=list)
    extrapolated: bool = False
    next_start_s: float | None = None  # its first start from waiting in the forward run


def rate_of(view: JobView, assignment: Assignment | None) -> float:
    """Iterations per second on ``assignment``'s Cell, from the job's estimate of it (or of
    a Cell of the same shape), 0 when none is known or it does not run."""
    if assignment is None:
        return 0.0
    est = view.estimate_for(assignment.cell)
    if est is None or not est.feasible:
        est = view.feasible_like(assignment.cell)
    if est is None or not est.feasible or est.iteration_time_s <= 0:
        return 0.0
    return 1.0 / est.iteration_time_s


def running_rate(view: JobView, assignment: Assignment) -> float:
    """Iterations per second of a job running on ``assignment`` (``rate_of``). One the
    policy started on a Cell the memory model rejects (what it asked for, which the
    platform runs) goes at the estimate's time, else the policies' 1 s per iteration: it
    had no rate, so it never ended and the queue behind it never started."""
    rate = rate_of(view, assignment)
    exact = view.estimate_for(assignment.cell)
    if rate > 0 or exact is None:
        return rate
    return 1.0 / (exact.iteration_time_s if 0 < exact.iteration_time_s < math.inf else 1.0)


def forecast(snapshot: Snapshot, policy: Policy, releases: tuple[GpuRelease, ...] = (),
             max_decisions: int = DEFAULT_MAX_DECISIONS,
             horizon_s: float = DEFAULT_HORIZON_S, first: Decision | None = None,
             step_frac: float = DEFAULT_STEP_FRAC, min_step_s: float = 0.0,
             time_budget_s: float | None = None, start_cost: StartCost | None = None,
             progress_from_s: dict[str, float] | None = None) -> dict[str, JobForecast]:
    """Every managed job's forecast (see the module docstring).

    Args:
        snapshot: the cluster and jobs now, as the daemon gave them to the policy.
        policy: the policy object the daemon uses (``decide``, and ``queue_order`` when it
            has one, are called).
        releases: GPUs held outside the policy that come free later, and when.
        max_decisions: policy decisions the forward run takes at most (``first`` is not
            one); the list schedule goes on from there.
        horizon_s: how far ahead it looks at most.
        first: the policy's decision on ``snapshot`` when the caller has it already (the
            daemon's round): the run starts from it instead of deciding again.
        step_frac: decisions further ahead may be made sparser: after deciding at ``t``
            the next decision comes at the next event, but no sooner than
            ``step_frac × (t − now)`` later; events in between still happen at their time,
            but GPUs they free wait for that decision (default 0: every event).
        min_step_s: nor sooner than this (the daemon decides once a round: its round).
        time_budget_s: wall time by which decisions stop: none starts that would, at the
            last one's pace, end past it (the list schedule goes on from there); None:
            decisions are bounded by count alone, and the forecast is deterministic.
        start_cost: what each (re)start costs; None: the snapshot's ``restart_cost_s``.
        progress_from_s: job id → when a running job's last (re)start ends and it makes
            progress (the caller's knowledge); a running job not in it: ``restart_cost_s``
            after its last change.
    """
    began = time.perf_counter()
    now_s = snapshot.now_s
    if start_cost is None:
        start_cost = lambda start, cost_s=snapshot.restart_cost_s: cost_s  # noqa: E731
    # One cache of what the policy derives per job spec for the whole run (the caller's,
    # when it has one): the run's snapshots share their jobs' estimates.
    snapshot = replace(snapshot, derived=snapshot.derived_cache())
    jobs = _initial_jobs(snapshot, progress_from_s or {})
    nodes = {n.name: n for n in snapshot.nodes}
    pending_releases = sorted(releases, key=lambda r: (r.at_s, r.node))
    state = snapshot.policy_state
    trigger = snapshot.trigger
    round_s = getattr(policy, "round_s", None) or snapshot.round_s
    decided, last_decision_s, first_unused, round_step = 0, 0.0, first is not None, False
    while True:
        active = tuple(j.view for j in jobs.values() if j.end_s is None)
        if not active:
            break
        snap = replace(snapshot, now_s=now_s, nodes=tuple(nodes.values()), jobs=active, trigger=trigger,
                       policy_state=state)
        given, first_unused = first_unused, False
        # No decision that would likely end past the budget: one takes about as long as the last.
        if not given and (decided >= max_decisions or (time_budget_s is not None and
                                                       time.perf_counter() - began + last_decision_s > time_budget_s)):
            _extrapolate(jobs, nodes, pending_releases, snap, policy, snapshot.now_s + horizon_s, start_cost)
            break
        decided += not given
        t0 = time.perf_counter()
        decision = first if given else policy.decide(snap)
        last_decision_s = time.perf_counter() - t0 if not given else last_decision_s
        try:
            validate_decision(snap, decision)
        except DecisionError:
            break  # a policy that errs here erred in the daemon too: forecast nothing more
        state = decision.policy_state
        actions = implied_actions(snap, decision)
        _apply(jobs, actions, now_s, start_cost)
        # The next event: a running job finishes, or GPUs come free outside the policy.
        finish = _finish_times(jobs, now_s)
        next_release = pending_releases[0].at_s if pending_releases else math.inf
        next_s = min(min((f for _, f in finish.values()), default=math.inf), next_release)
        # A policy may start waiting jobs on free GPUs only at its rounds (sia and gavel
        # ignore events between them): while a waiting job fits free GPUs, the run decides
        # again a round later; not once more after such a round changed nothing.
        if next_s > now_s + round_s and (actions or not round_step) and job_fitting_idle_gpus(
                replace(snap, jobs=tuple(j.view for j in jobs.values() if j.end_s is None))):
            next_s, round_step = now_s + round_s, True
        else:
            round_step = False
        if not math.isfinite(next_s) or next_s - snapshot.now_s > horizon_s:
            break  # nothing will change any more (or not within the horizon)
        next_s = max(next_s, now_s + max(min_step_s, step_frac * (now_s - snapshot.now_s)))
        ended = sum(j.end_s is not None for j in jobs.values())
        _progress(jobs, finish, now_s, next_s)
        while pending_releases and pending_releases[0].at_s <= next_s:
            _release(nodes, pending_releases.pop(0))
        now_s = next_s
        # As the daemon and the simulator say it: a job finished (Crius searches again for
        # the waiting jobs only then), else a round.
        trigger = TRIGGER_COMPLETION if sum(j.end_s is not None for j in jobs.values()) > ended else TRIGGER_ROUND
    return {job_id: JobForecast(job_id, j.start_s, j.end_s, tuple(j.cells), j.extrapolated, j.next_start_s)
            for job_id, j in jobs.items()}


def _initial_jobs(snapshot: Snapshot, progress_from_s: dict[str, float]) -> dict[str, _Job]:
    """The forward run's jobs as the snapshot has them. A running job makes progress from
    when the caller says, else from a restart's cost after its last change (one that
    (re)started less than that ago is still starting)."""
    return {j.job_id: _Job(j, j.last_change_s if j.assignment is not None else None,
                           busy_until_s=progress_from_s.get(j.job_id, j.last_change_s + snapshot.restart_cost_s)
                           if j.assignment is not None else 0.0,
                           cells=[j.cell.label()] if j.cell is not None else [])
            for j in snapshot.jobs}


def default_queue_order(snapshot: Snapshot) -> QueueOrder:
    """For a policy without ``queue_order``: waiting jobs by submission, each on what it
    asked for (FCFS's Cell), backfilling; jobs with no such Cell are left out."""
    waiting = sorted((j for j in snapshot.jobs if j.assignment is None), key=lambda j: (j.submit_time_s, j.job_id))
    out = []
    for j in waiting:
        est = requested_estimate(j)
        if est is not None:
            out.append((j.job_id, (est.cell,)))
    return QueueOrder(tuple(out))


def _extrapolate(jobs: dict[str, _Job], nodes: dict[str, NodeView], releases: list[GpuRelease],
                 snap: Snapshot, policy: Policy, horizon_end_s: float, start_cost: StartCost) -> None:
    """The forward run's tail as a list schedule from ``snap``: running jobs keep their
    Cells to the end; whenever GPUs come free (a job ends, a release), waiting jobs start
    in the policy's order, each on the first of its Cells whose count of GPUs of its type
    is free (a backfilling policy's first ``QUEUE_WINDOW_JOBS`` waiting jobs; a blocking
    one's queue up to the first job of each type that does not fit). Node packing,
    reservations for long-waiting jobs and moves to faster Cells are not modelled."""
    now_s = snap.now_s
    unmanaged = {n.name: n.unmanaged_gpus for n in nodes.values()}
    free: dict[str, int] = {}
    for n in nodes.values():
        free[n.gpu_type] = free.get(n.gpu_type, 0) + max(0, n.total_gpus - n.unmanaged_gpus)
    events: list[_Event] = []
    for j in jobs.values():
        a = j.view.assignment
        if j.end_s is not None or a is None:
            continue
        free[a.cell.gpu_type] = free.get(a.cell.gpu_type, 0) - a.num_gpus
        rate = running_rate(j.view, a)
        if rate > 0:
            end_s = max(now_s, j.busy_until_s) + j.view.remaining_iterations / rate
            events.append(_Event(end_s, len(events), j.view.job_id, a.cell.gpu_type, a.num_gpus))
    released: dict[str, int] = {}  # node → GPUs its releases give back, at most what it holds
    for r in releases:
        if r.node in nodes:
            events.append(_Event(max(r.at_s, now_s), len(events), "", nodes[r.node].gpu_type, r.gpus, r.node))
            released[r.node] = min(unmanaged[r.node], released.get(r.node, 0) + r.gpus)
    heapq.heapify(events)
    order = policy.queue_order(snap) if hasattr(policy, "queue_order") else default_queue_order(snap)
    # The GPUs each type will ever have: a Cell larger than that never fits, and a job with
    # only such Cells (or Cells it has no speed for) would wait for ever.
    capacity: dict[str, int] = {}
    for n in nodes.values():
        capacity[n.gpu_type] = capacity.get(n.gpu_type, 0) + n.total_gpus - n.unmanaged_gpus + released.get(n.name, 0)
    waiting = []
    for job_id, cells in order.jobs:
        j = jobs.get(job_id)
        if j is None or j.end_s is not None or j.view.assignment is not None:
            continue
        cells = tuple(c for c in cells if c.num_gpus <= capacity.get(c.gpu_type, 0)
                      and rate_of(j.view, Assignment(c, ())) > 0)
        if cells:
            waiting.append((job_id, cells))
    queue = iter(waiting)
    seq = itertools.count(len(events))  # ties in time: in the order pushed
    window_jobs = len(waiting) if order.blocking else QUEUE_WINDOW_JOBS
    window: list[tuple[str, tuple[Cell, ...]]] = []  # the first waiting jobs, in order
    while True:
        # Start what fits now; places a start frees in the window are refilled at once.
        started = True
        while started:
            window.extend(itertools.islice(queue, window_jobs - len(window)))
            window, started = _start_fitting(jobs, window, free, order.blocking, now_s, start_cost, events, seq)
        if not events or events[0].at_s > horizon_end_s:
            return
        now_s = events[0].at_s
        while events and events[0].at_s <= now_s:
            e = heapq.heappop(events)
            gpus = e.gpus
            if e.node:
                gpus = min(gpus, unmanaged[e.node])
                unmanaged[e.node] -= gpus
            free[e.gpu_type] = free.get(e.gpu_type, 0) + gpus
            if e.job_id:
                jobs[e.job_id].end_s = e.at_s
                jobs[e.job_id].extrapolated = True


def _start_fitting(jobs: dict[str, _Job], window: list, free: dict[str, int], blocking: bool, now_s: float,
                   start_cost: StartCost, events: list[_Event], seq) -> tuple[list, list[str]]:
    """Start, in order, each job of ``window`` on the first of its Cells whose GPUs are
    free (taking them, and pushing its end onto ``events``); with ``blocking``, a job that
    does not fit holds back the later jobs of its types. The jobs left waiting and the ones
    started."""
    free_total = sum(free.values())
    blocked: set[str] = set()
    kept, started = [], []
    for job_id, cells in window:
        cell = None
        if free_total > 0 and not (blocking and any(c.gpu_type in blocked for c in cells)):
            cell = next((c for c in cells if free.get(c.gpu_type, 0) >= c.num_gpus), None)
        if cell is None:
            kept.append((job_id, cells))
            if blocking:
                blocked.update(c.gpu_type for c in cells)
            continue
        j = jobs[job_id]
        free[cell.gpu_type] -= cell.num_gpus
        free_total -= cell.num_gpus
        after = Assignment(cell, ())
        cost_s = start_cost(Start(j.view, after, j.start_s is None, tuple(j.cells)))
        j.extrapolated = True
        if j.start_s is None:
            j.start_s = now_s
        if j.next_start_s is None:
            j.next_start_s = now_s
        if not j.cells or j.cells[-1] != cell.label():
            j.cells.append(cell.label())
        end_s = now_s + cost_s + j.view.remaining_iterations / rate_of(j.view, after)
        heapq.heappush(events, _Event(end_s, next(seq), job_id, cell.gpu_type, cell.num_gpus))
        started.append(job_id)
    return kept, started


def _finish_times(jobs: dict[str, _Job], now_s: float) -> dict[str, tuple[float, float]]:
    """Job id → (iterations per second, when it finishes from ``now_s``) of each job that
    runs at a known rate."""
    finish = {}
    for j in jobs.values():
        rate = running_rate(j.view, j.view.assignment) if j.end_s is None and j.view.assignment else 0.0
        if rate > 0:
            finish[j.view.job_id] = (rate, max(now_s, j.busy_until_s) + j.view.remaining_iterations / rate)
    return finish


def _release(nodes: dict[str, NodeView], release: GpuRelease) -> None:
    """GPUs held outside the policy come free on their node."""
    n = nodes.get(release.node)
    if n is not None:
        nodes[release.node] = replace(n, unmanaged_gpus=max(0, n.unmanaged_gpus - release.gpus))


def _apply(jobs: dict[str, _Job], actions, now_s: float, start_cost: StartCost) -> None:
    """The decision's actions on the forward run's jobs: starts pay ``start_cost``."""
    for action in actions:
        j = jobs[action.job_id]
        view = j.view
        if action.kind == SUSPEND or action.after is None:
            j.view = replace(view, state=PENDING, assignment=None, last_change_s=now_s)
            continue
        j.view = replace(view, state=RUNNING, assignment=action.after, last_change_s=now_s,
                         restarts=view.restarts + (view.assignment is not None or view.iterations_done > 0))
        j.busy_until_s = now_s + start_cost(Start(view, action.after, j.start_s is None, tuple(j.cells)))
        if view.assignment is None and j.start_s is None:
            j.start_s = now_s
        if view.assignment is None and j.next_start_s is None:
            j.next_start_s = now_s
        label = action.after.cell.label()
        if not j.cells or j.cells[-1] != label:
            j.cells.append(label)


def _progress(jobs: dict[str, _Job], finish: dict[str, tuple[float, float]], now_s: float, next_s: float) -> None:
    """The iterations of every job in ``finish`` (``_finish_times``) from ``now_s`` to
    ``next_s``; those that finish by then end at their finish time."""
    for job_id, (rate, finish_s) in finish.items():
        j = jobs[job_id]
        worked_s = max(0.0, next_s - max(now_s, j.busy_until_s))
        if worked_s > 0:
            done = min(float(j.view.iterations_total), j.view.iterations_done + rate * worked_s)
            j.view = replace(j.view, iterations_done=done)
        if finish_s <= next_s:
            j.end_s = finish_s
            j.view = replace(j.view, iterations_done=float(j.view.iterations_total))


__all__ = ["GpuRelease", "JobForecast", "Start", "StartCost", "default_queue_order", "forecast", "rate_of"]
