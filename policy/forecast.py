"""When each job will start and finish: the policy run forward from the current snapshot.

The daemon's own policy object decides, round after round, on a copy of the cluster that
moves forward in time with no new arrivals:

- running managed jobs progress at the speed of their Cell's estimate (refined by what
  their runner measured, as the daemon passes it in), from their real current step;
- GPUs held outside the policy (plain Slurm jobs) come free at those jobs' end times
  (Slurm's end time: start plus time limit), given as :class:`GpuRelease` events;
- waiting jobs take whatever the policy decides as GPUs come free; every (re)start costs
  the snapshot's ``restart_cost_s`` without progress, as the simulator charges it.

The forward run goes from event to event (a job finishing, GPUs released), deciding at
each, but the further ahead, the sparser (``step_frac``): a forecast a day ahead is good
to an hour or two, one ten minutes ahead to a round. It stops when every job has
finished, when nothing can change any more, or after ``max_decisions`` decisions (what is
then still unknown stays None). A policy's
``decide`` is pure, so the daemon's own policy state is not touched: the run starts from
the snapshot's ``policy_state`` and keeps its own.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from policy.interface import (
    PENDING, RUNNING, SUSPEND, TRIGGER_ROUND, Assignment, Decision, DecisionError, JobView,
    Policy, Snapshot, implied_actions, validate_decision,
)

DEFAULT_MAX_DECISIONS = 60
DEFAULT_HORIZON_S = 90 * 86400.0
DEFAULT_STEP_FRAC = 0.1


@dataclass(frozen=True)
class GpuRelease:
    """GPUs held outside the policy on ``node`` that come free at ``at_s``."""

    at_s: float
    node: str
    gpus: int


@dataclass(frozen=True)
class JobForecast:
    """One job's expected start (its last start if it runs now), end, and the Cells it is
    expected to pass through (labels, in order, the current one first when it runs)."""

    job_id: str
    start_s: float | None
    end_s: float | None
    cells: tuple[str, ...] = ()


@dataclass
class _Job:
    view: JobView
    start_s: float | None
    end_s: float | None = None
    busy_until_s: float = 0.0  # a (re)start's cost: GPUs held, no progress
    cells: list[str] = field(default_factory=list)


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


def forecast(snapshot: Snapshot, policy: Policy, releases: tuple[GpuRelease, ...] = (),
             max_decisions: int = DEFAULT_MAX_DECISIONS,
             horizon_s: float = DEFAULT_HORIZON_S, first: Decision | None = None,
             step_frac: float = DEFAULT_STEP_FRAC, min_step_s: float = 0.0) -> dict[str, JobForecast]:
    """Every managed job's forecast (see the module docstring).

    Args:
        snapshot: the cluster and jobs now, as the daemon gave them to the policy.
        policy: the policy object the daemon uses (only ``decide`` is called).
        releases: GPUs held outside the policy that come free later, and when.
        max_decisions: decisions the forward run may take at most.
        horizon_s: how far ahead it looks at most.
        first: the policy's decision on ``snapshot`` when the caller has it already (the
            daemon's round): the run starts from it instead of deciding again.
        step_frac: decisions further ahead are sparser: after deciding at ``t`` the next
            decision comes at the next event, but no sooner than ``step_frac × (t − now)``
            later; events in between still happen at their time.
        min_step_s: nor sooner than this (the daemon decides once a round: its round).
    """
    now_s = snapshot.now_s
    # One cache of what the policy derives per job spec for the whole run (the caller's,
    # when it has one): the run's snapshots share their jobs' estimates.
    snapshot = replace(snapshot, derived=snapshot.derived_cache())
    # A job that (re)started less than a restart's cost ago is still starting: it makes
    # progress from then on.
    jobs = {j.job_id: _Job(j, j.last_change_s if j.assignment is not None else None,
                           busy_until_s=j.last_change_s + snapshot.restart_cost_s if j.assignment is not None else 0.0,
                           cells=[j.cell.label()] if j.cell is not None else [])
            for j in snapshot.jobs}
    nodes = {n.name: n for n in snapshot.nodes}
    pending_releases = sorted(releases, key=lambda r: (r.at_s, r.node))
    state = snapshot.policy_state
    trigger = snapshot.trigger
    for _ in range(max_decisions):
        active = tuple(j.view for j in jobs.values() if j.end_s is None)
        if not active:
            break
        snap = replace(snapshot, now_s=now_s, nodes=tuple(nodes.values()), jobs=active, trigger=trigger,
                       policy_state=state)
        decision = first if first is not None and now_s == snapshot.now_s else policy.decide(snap)
        try:
            validate_decision(snap, decision)
        except DecisionError:
            break  # a policy that errs here erred in the daemon too: forecast nothing more
        state = decision.policy_state
        _apply(jobs, implied_actions(snap, decision), now_s, snapshot.restart_cost_s)
        # The next event: a running job finishes, or GPUs come free outside the policy.
        finish = {}
        for j in jobs.values():
            rate = rate_of(j.view, j.view.assignment) if j.end_s is None else 0.0
            if rate > 0:
                finish[j.view.job_id] = max(now_s, j.busy_until_s) + j.view.remaining_iterations / rate
        next_release = pending_releases[0].at_s if pending_releases else math.inf
        next_s = min(min(finish.values(), default=math.inf), next_release)
        if not math.isfinite(next_s) or next_s - snapshot.now_s > horizon_s:
            break  # nothing will change any more (or not within the horizon)
        next_s = max(next_s, now_s + max(min_step_s, step_frac * (now_s - snapshot.now_s)))
        _progress(jobs, finish, now_s, next_s)
        while pending_releases and pending_releases[0].at_s <= next_s:
            r = pending_releases.pop(0)
            n = nodes.get(r.node)
            if n is not None:
                nodes[r.node] = replace(n, unmanaged_gpus=max(0, n.unmanaged_gpus - r.gpus))
        now_s = next_s
        trigger = TRIGGER_ROUND
    return {job_id: JobForecast(job_id, j.start_s, j.end_s, tuple(j.cells))
            for job_id, j in jobs.items()}


def _apply(jobs: dict[str, _Job], actions, now_s: float, restart_cost_s: float) -> None:
    """The decision's actions on the forward run's jobs: starts pay ``restart_cost_s``."""
    for action in actions:
        j = jobs[action.job_id]
        view = j.view
        if action.kind == SUSPEND or action.after is None:
            j.view = replace(view, state=PENDING, assignment=None, last_change_s=now_s)
            continue
        j.view = replace(view, state=RUNNING, assignment=action.after, last_change_s=now_s,
                         restarts=view.restarts + (view.assignment is not None or view.iterations_done > 0))
        j.busy_until_s = now_s + restart_cost_s
        if view.assignment is None and j.start_s is None:
            j.start_s = now_s
        label = action.after.cell.label()
        if not j.cells or j.cells[-1] != label:
            j.cells.append(label)


def _progress(jobs: dict[str, _Job], finish: dict[str, float], now_s: float, next_s: float) -> None:
    """Every running job's iterations from ``now_s`` to ``next_s``; those that finish by
    then end at their finish time."""
    for j in jobs.values():
        rate = rate_of(j.view, j.view.assignment) if j.end_s is None else 0.0
        worked_s = max(0.0, next_s - max(now_s, j.busy_until_s))
        if rate > 0 and worked_s > 0:
            done = min(float(j.view.iterations_total), j.view.iterations_done + rate * worked_s)
            j.view = replace(j.view, iterations_done=done)
        if j.view.job_id in finish and finish[j.view.job_id] <= next_s:
            j.end_s = finish[j.view.job_id]
            j.view = replace(j.view, iterations_done=float(j.view.iterations_total))


__all__ = ["GpuRelease", "JobForecast", "forecast", "rate_of"]
