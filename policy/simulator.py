"""The trace simulator: replays mapped trace jobs on a cluster under one policy.

Only Slurm and the clock are replaced: the policy object is the one the daemon uses, fed
the same ``Snapshot`` and answering the same ``Decision``. Jobs advance at the *measured*
rate of the allocation they hold (``policy.measured``); policies decide on the estimator's
numbers (or, with ``oracle``, on the measured ones).

Events (arrivals, completions) and periodic rounds call ``decide``; events at the same
instant are handled together in one call. Every (re)start costs time during which the job
holds its GPUs without progress (``RestartCosts``). The run ends when every job has
finished, when nothing can change any more (no job running, no arrival left, and the
policy leaves the rest pending for ``stall_rounds`` rounds), or at ``max_time_s``; jobs
left are reported unfinished, and jobs no Cell of this cluster can run are reported as
never runnable, from the moment they arrive.

The timeline records the cluster after every decision that changed an allocation and
after every completion (and at least every ``timeline_min_step_s`` otherwise), so between
two points nothing held by a job changes. Each point carries, per GPU type, the free GPUs
and those of them on nodes partly in use; their ratio is the **fragmentation** of
``policy.placement.FreeGpus.fragmentation``. Such GPUs cannot host a Cell whose layout
wants whole nodes, whatever the policy does next, short of moving a job. The figures are
a tally kept as jobs take and release GPUs: O(nodes of a placement) per change, O(GPU
types) per point.
"""

from __future__ import annotations

import heapq
import logging
import math
import statistics
import time
from dataclasses import dataclass, field

from estimator.cells import CellEstimate
from estimator.cluster import ClusterSpec
from estimator.jobs import JobSpec
from policy.clock import SimulatedClock
from policy.interface import (PENDING, RUNNING, TRIGGER_ARRIVAL, TRIGGER_COMPLETION, TRIGGER_ROUND,
                              Assignment, Decision, DecisionError, DerivedCache, JobView, NodeView, Placement, Policy, Snapshot,
                              implied_actions, validate_decision)
from policy.forecast import JobForecast, Start, forecast, rate_of
from policy.measured import MeasuredTable, cell_layout, mask_unmeasured
from policy.placement import layout_of
from policy.trace import TraceJob

log = logging.getLogger(__name__)


class SimulationError(RuntimeError):
    """A policy returned a decision that cannot be applied (names the policy and the fault)."""


@dataclass(frozen=True)
class RestartCosts:
    """Seconds a job holds its GPUs without progress when it (re)starts.

    Attributes:
        launch_s: first start: processes, data loader, compilation.
        checkpoint_resume_s: every later start: save on the signal, load, warm up.
        tuning_full_s: a plan search over the whole Cell (Alpa-style), paid whenever a job
            starts on a Cell it has not run on before.
        tuning_pruned_s: the same search pruned by the Cell's estimate (Crius keeps half of
            each stage's dp↔tp range), measured inside the allocation.
        tuning_budget_frac: the runtime stops measuring candidates once tuning has taken
            this fraction of the job's remaining run time on the new Cell
            (``SLURM_EXT_TUNE_BUDGET_FRAC``, default 0.05): a pruned search costs at most that.
    """

    launch_s: float = 30.0
    checkpoint_resume_s: float = 60.0
    tuning_full_s: float = 600.0
    tuning_pruned_s: float = 150.0
    tuning_budget_frac: float = 0.05

    def tuning_s(self, mode: str, remaining_run_s: float = float("inf")) -> float:
        """Tuning time for a policy's ``plan_tuning`` mode (full, pruned, none) on a Cell
        where the job has ``remaining_run_s`` of work left."""
        if mode == "pruned":
            return min(self.tuning_pruned_s, self.tuning_budget_frac * remaining_run_s)
        return {"full": self.tuning_full_s, "none": 0.0}.get(mode, self.tuning_full_s)

    @classmethod
    def from_reports(cls, reports, base: "RestartCosts | None" = None) -> "RestartCosts":
        """The costs the runtime measured: each field the median over the runners'
        reports (``estimator.contract.RunnerReport``, from ``measured.json``) that measured
        it, else ``base``'s.

        ``launch_s``: ``startup_s`` of first runs; ``checkpoint_resume_s``: ``startup_s`` of
        later runs (the restore and the new plan's compilation) plus the median
        ``final_save_s`` (the save a rescale waits for); ``tuning_pruned_s``: ``tuning_s``
        of runs that tuned (the runtime's budget still caps it per job).
        """
        base = base or cls()

        def median(xs) -> float | None:
            xs = [x for x in xs if x is not None and x >= 0]
            return statistics.median(xs) if xs else None

        launch_s = median(r.startup_s for r in reports if not r.restart_count)
        resume_s = median(r.startup_s for r in reports if r.restart_count)
        save_s = median(r.final_save_s for r in reports) or 0.0
        tuning_s = median(r.tuning_s for r in reports if r.candidates_measured)
        return cls(launch_s=base.launch_s if launch_s is None else launch_s,
                   checkpoint_resume_s=base.checkpoint_resume_s if resume_s is None else resume_s + save_s,
                   tuning_full_s=base.tuning_full_s,
                   tuning_pruned_s=base.tuning_pruned_s if tuning_s is None else tuning_s,
                   tuning_budget_frac=base.tuning_budget_frac)

    def start_cost_s(self, mode: str, first: bool, new_cell: bool, remaining_run_s: float) -> float:
        """What one (re)start costs: the launch (``first``) or a checkpoint and resume, plus
        the plan search when the Cell is one the job has not run on (``new_cell``)."""
        overhead_s = self.launch_s if first else self.checkpoint_resume_s
        if new_cell:
            overhead_s += self.tuning_s(mode, remaining_run_s)
        return overhead_s


@dataclass(frozen=True)
class SimConfig:
    """Simulation settings (frozen, resolved once by the caller)."""

    round_s: float = 300.0
    oracle: bool = False
    costs: RestartCosts = RestartCosts()
    stall_rounds: int = 3
    max_time_s: float = 365 * 86400.0
    timeline_min_step_s: float = 60.0
    # Forecast accuracy: at the arrival of every n-th job (0: never), the policy is run
    # forward from that round (``policy.forecast``, on estimates, as the daemon does) and
    # the job's forecast start and end are kept beside what happened.
    forecast_every_jobs: int = 0
    forecast_max_decisions: int = 60
    # The plan search a (re)start on a new Cell is charged: "equal" (the default), the
    # runtime's own search for every policy alike, since the runtime tunes whatever Cell a
    # policy chose; "own", each policy's ``plan_tuning`` (a full search for the
    # baselines, the Cell-guided pruned one for crius and cells-ilp, as the Crius paper
    # charged them); or one mode (full, pruned, none) for every policy alike.
    plan_search: str = "equal"


# The runtime's plan search (``job_scripts.tuning``): Cell-guided, pruned, under its budget.
RUNTIME_PLAN_SEARCH = "pruned"


def tuning_mode_of(policy: Policy, plan_search: str) -> str:
    """The plan-search mode a policy's (re)starts on a new Cell are charged."""
    if plan_search == "equal":
        return RUNTIME_PLAN_SEARCH
    if plan_search == "own":
        return getattr(policy, "plan_tuning", "full")
    return plan_search


def start_costs(policy: Policy, config: SimConfig) -> dict:
    """What a policy's (re)starts are charged in a replay, for its report."""
    return {"plan_search": tuning_mode_of(policy, config.plan_search),
            "round_s": round_period_s(policy, config),
            "launch_s": config.costs.launch_s, "checkpoint_resume_s": config.costs.checkpoint_resume_s,
            "extra_start_s": float(getattr(policy, "extra_start_s", 0.0)),
            "extra_start_reason": getattr(policy, "extra_start_reason", "")}


def round_period_s(policy: Policy, config: SimConfig) -> float:
    """Seconds between the rounds a policy is woken for: its own ``round_s`` where it
    declares one (gavel 360 s, sia 60 s, as their papers run them), else the config's."""
    own = getattr(policy, "round_s", None)
    return float(own) if own else config.round_s


@dataclass(frozen=True)
class JobOutcome:
    """What happened to one job; times are None when they never happened."""

    job_id: str
    spec: JobSpec
    submit_time_s: float
    iterations: int
    status: str  # finished | unfinished | never_runnable
    first_start_s: float | None
    finish_s: float | None
    restarts: int
    iterations_done: float
    reason: str = ""
    deadline_s: float | None = None
    forecast_start_s: float | None = None  # forecast at its arrival (SimConfig.forecast_every_jobs)
    forecast_end_s: float | None = None
    forecast_extrapolated: bool = False  # that forecast came from its list-schedule tail

    @property
    def jct_s(self) -> float | None:
        return None if self.finish_s is None else self.finish_s - self.submit_time_s

    @property
    def queue_s(self) -> float | None:
        return None if self.first_start_s is None else self.first_start_s - self.submit_time_s


@dataclass(frozen=True)
class TimelinePoint:
    """Cluster state right after one decision or completion.

    Attributes:
        time_s: simulated time.
        samples_per_s: cluster throughput at the measured rates, of the jobs past their
            (re)start's launch, resume and plan search (those still in it make no progress).
        queued_jobs: active jobs without an allocation.
        running_jobs: jobs holding GPUs.
        gpus_in_use: (GPU type, GPUs held by jobs) pairs.
        free_by_type: (GPU type, free GPUs, of those the ones on nodes partly in use), one
            triple per type; empty when not recorded.
    """

    time_s: float
    samples_per_s: float
    queued_jobs: int
    running_jobs: int
    gpus_in_use: tuple[tuple[str, int], ...]
    free_by_type: tuple[tuple[str, int, int], ...] = ()

    @property
    def fragmentation_frac(self) -> float:
        """Free GPUs on partly used nodes ÷ free GPUs, all types pooled (0 when none is free)."""
        free = sum(f for _, f, _ in self.free_by_type)
        return sum(p for _, _, p in self.free_by_type) / free if free else 0.0

    def fragmentation_frac_of(self, gpu_type: str) -> float:
        """The same share for one GPU type (0 when none of it is free)."""
        for gtype, free, partial in self.free_by_type:
            if gtype == gpu_type:
                return partial / free if free else 0.0
        return 0.0


@dataclass(frozen=True)
class SimResult:
    """One policy's run over one trace."""

    policy: str
    jobs: tuple[JobOutcome, ...]
    timeline: tuple[TimelinePoint, ...]
    decision_times_s: tuple[float, ...]
    samples_done: float
    start_s: float
    end_s: float  # the last finish (the start when none finished)
    capacity_gpus: dict = field(default_factory=dict)
    run_end_s: float | None = None  # the clock when the replay stopped (None: end_s)


class EstimateCache:
    """Cell estimates per distinct job spec, computed once and masked by the measured table.

    Args:
        cluster: the simulated cluster.
        table: the ground truth (Cells it cannot run become infeasible).
        oracle: let policies see measured times instead of estimates.
        estimate_fn: ``(spec, plan_space) -> tuple[CellEstimate, ...]``; defaults to the
            analytic estimator (``estimator.estimate.estimate_job``).
        program: the training program whose memory the estimates count: the one the
            measured rates came from, so that policies judge what fits as the ground truth
            ran it. ``alpa`` for the shipped table (the Crius/Arena artifact ran Alpa:
            fp16 weights and gradients on every GPU, master and states split over dp,
            GPipe's stash of every micro-batch; ``estimator.memory``); ``runner`` for rates measured with
            this repository's runner. Counting the runner's memory against Alpa's rates
            had data-parallel policies (they see dp-only Cells, whose replicated states
            fit only on more GPUs) refuse allocations the table ran: gavel-greedy 2.57 h
            against 2.14 h on itp_cluster08 seed 0, crius the same.
    """

    def __init__(self, cluster: ClusterSpec, table: MeasuredTable, oracle: bool = False, estimate_fn=None,
                 program: str = "alpa"):
        self.cluster = cluster
        self.table = table
        self.oracle = oracle
        self.program = program
        self._estimate_fn = estimate_fn or self._analytic
        self._cache: dict[tuple, tuple] = {}
        self.estimate_seconds = 0.0

    def _analytic(self, spec: JobSpec, plan_space: str) -> tuple[CellEstimate, ...]:
        from estimator.estimate import EstimateOptions, estimate_job
        from estimator.memory import MemoryOptions
        memory = MemoryOptions(program="alpa", zero_level=1) if self.program == "alpa" else MemoryOptions()
        return estimate_job(spec, self.cluster, EstimateOptions(plan_space=plan_space, memory=memory)).cells

    def get(self, spec: JobSpec) -> tuple[tuple[CellEstimate, ...], tuple[CellEstimate, ...], frozenset]:
        """(cell estimates, dp-only estimates, runnable Cells) of ``spec``."""
        key = (spec.model, spec.global_batch, spec.num_gpus, spec.gpu_type, spec.max_stages)
        hit = self._cache.get(key)
        if hit is None:
            t0 = time.perf_counter()
            raw = {space: self._estimate_fn(spec, space) for space in ("cell", "dp-only")}
            runnable = frozenset(
                e.cell for e in raw["cell"] + raw["dp-only"]
                if self.table.iter_time_s(spec.model, spec.global_batch, e.cell.gpu_type, *cell_layout(e.cell))
                is not None)
            hit = tuple(mask_unmeasured(raw[space], spec.model, spec.global_batch, self.table, self.oracle)
                        for space in ("cell", "dp-only")) + (runnable,)
            self.estimate_seconds += time.perf_counter() - t0
            self._cache[key] = hit
        return hit


class _Job:
    """Mutable simulation state of one job (never seen by policies)."""

    __slots__ = ("trace", "estimates", "dp_only", "runnable", "assignment", "rate_s", "done", "anchor_s",
                 "resume_s", "restarts", "last_change_s", "first_start_s", "finish_s", "version",
                 "tuned", "view", "reason")

    def __init__(self, trace: TraceJob, estimates, dp_only, runnable):
        self.trace = trace
        self.estimates, self.dp_only, self.runnable = estimates, dp_only, runnable
        self.assignment: Assignment | None = None
        self.rate_s: float | None = None  # seconds per iteration while running
        self.done = 0.0
        self.anchor_s = trace.submit_time_s
        self.resume_s = trace.submit_time_s
        self.restarts = 0
        self.last_change_s = trace.submit_time_s
        self.first_start_s: float | None = None
        self.finish_s: float | None = None
        self.version = 0
        self.tuned: set = set()
        self.view: JobView | None = None
        self.reason = ""

    def progress_at(self, now_s: float) -> float:
        if self.rate_s is None:
            return self.done
        busy_from = max(self.anchor_s, self.resume_s)
        return min(float(self.trace.iterations), self.done + max(0.0, now_s - busy_from) / self.rate_s)

    def sync(self, now_s: float) -> None:
        self.done = self.progress_at(now_s)
        self.anchor_s = now_s

    def finish_time_s(self) -> float:
        return max(self.anchor_s, self.resume_s) + (self.trace.iterations - self.done) * self.rate_s


def _job_view(job: _Job, now_s: float) -> JobView:
    # Snapshots are the hot path of a run: a pending job's view is reused until it
    # changes; a running job's view is a copy of its cached fields with the progress
    # updated, which skips the frozen dataclass's per-field __init__ (same object, 5× faster).
    if job.view is None:
        t = job.trace
        job.view = JobView(t.job_id, "trace", t.spec, t.submit_time_s, RUNNING if job.assignment else PENDING,
                           job.assignment, job.done, t.iterations, job.restarts,
                           job.last_change_s, t.deadline_s, False, job.estimates, job.dp_only, job.runnable)
    if job.rate_s is None:
        return job.view
    view = _new(JobView)
    fields = view.__dict__
    fields.update(job.view.__dict__)
    fields["iterations_done"] = job.progress_at(now_s)
    return view


_new = object.__new__


def never_runnable_reason(estimates: tuple[CellEstimate, ...], dp_only: tuple[CellEstimate, ...],
                          runnable: frozenset, cluster: ClusterSpec) -> str:
    """Why no Cell of the job can ever run on this cluster ("" when some can).

    Runnable means measured (the platform can run it) and within the cluster's capacity
    and node size; whether the estimator thinks it fits is the policies' business.
    """
    sizes: dict[str, int] = {}  # the largest node of each type
    for g in cluster.node_groups:
        sizes[g.gpu_type] = max(sizes.get(g.gpu_type, 0), g.gpus_per_node)
    for cell in runnable:
        if cell.gpu_type in sizes and cell.num_gpus <= cluster.total_gpus(cell.gpu_type) \
                and cell_layout(cell)[1] <= sizes[cell.gpu_type]:
            return ""
    reasons = sorted({e.reason for e in estimates + dp_only if e.reason})
    return "no runnable Cell: " + ("; ".join(reasons[:3]) if reasons else "no Cell fits this cluster")


class FreeTally:
    """Per GPU type, the free GPUs and those on nodes partly in use, kept current.

    The figures of ``policy.placement.FreeGpus.fragmentation`` (``free_gpus``,
    ``free_on_partial_nodes``) without its walk over every node: each ``take`` or
    ``release`` updates the sums by the difference on the nodes it touches.

    Args:
        nodes: the cluster's nodes, all GPUs free.
    """

    def __init__(self, nodes: tuple[NodeView, ...]):
        self.capacity = {n.name: n.managed_gpus for n in nodes}
        self.type_of = {n.name: n.gpu_type for n in nodes}
        self.free = dict(self.capacity)
        self._sums: dict[str, list[int]] = {}
        for n in nodes:
            self._sums.setdefault(n.gpu_type, [0, 0])[0] += self.capacity[n.name]

    def take(self, placement: Placement) -> None:
        self._add(placement, -1)

    def release(self, placement: Placement) -> None:
        self._add(placement, 1)

    def _add(self, placement: Placement, sign: int) -> None:
        for name, gpus in placement:
            cap, before = self.capacity[name], self.free[name]
            after = before + sign * gpus
            self.free[name] = after
            sums = self._sums[self.type_of[name]]
            sums[0] += after - before
            sums[1] += (after if 0 < after < cap else 0) - (before if 0 < before < cap else 0)

    def by_type(self) -> tuple[tuple[str, int, int], ...]:
        """(GPU type, free GPUs, free GPUs on partly used nodes), by type name."""
        return tuple((gtype, free, partial) for gtype, (free, partial) in sorted(self._sums.items()))


def _stale(entry: tuple[float, int, str, int], active: dict[str, _Job]) -> bool:
    job = active.get(entry[2])
    return job is None or job.version != entry[3]


def simulate(policy: Policy, trace_jobs: tuple[TraceJob, ...], cluster: ClusterSpec, table: MeasuredTable,
             config: SimConfig = SimConfig(), estimates: EstimateCache | None = None,
             progress=None) -> SimResult:
    """Replay ``trace_jobs`` on ``cluster`` under ``policy``.

    Args:
        policy: the policy object (the daemon's interface).
        trace_jobs: jobs from ``policy.trace.map_trace``; replayed in order of submission
            (a stable sort: jobs submitted at the same time keep their order).
        cluster: the simulated cluster.
        table: measured iteration times (the ground truth).
        config: round length, oracle mode, restart costs, stop rules.
        estimates: a shared estimate cache (one per cluster/oracle setting); built if None.
        progress: optional ``callback(jobs_done, jobs_total, now_s)`` called now and then.

    Returns:
        The outcome of every job, the timeline, and the decision times.

    Raises:
        SimulationError: the policy over-committed a node or named unknown jobs or nodes.
    """
    trace_jobs = tuple(sorted(trace_jobs, key=lambda tj: tj.submit_time_s))
    replay = _Replay(policy, trace_jobs, cluster, table, config, estimates or EstimateCache(cluster, table, config.oracle))
    idle_rounds = 0
    while True:
        now_s = replay.next_event_s()
        if now_s == math.inf or now_s > config.max_time_s:
            break
        replay.clock.advance_to(now_s)
        replay.record_resumes(now_s)
        triggers = replay.complete_due(now_s)
        arrived = replay.admit_due(now_s, triggers)
        if replay.next_round_s <= now_s:
            triggers.add(TRIGGER_ROUND)
            while replay.next_round_s <= now_s:
                replay.next_round_s += replay.round_s
        if not replay.active:
            if replay.timeline and replay.timeline[-1].running_jobs:
                replay.timeline.append(TimelinePoint(now_s, 0.0, 0, 0, (), replay.tally.by_type()))
            continue
        actions = replay.decide(now_s, triggers, arrived)
        for action in actions:
            replay.apply(action, now_s)
        if not replay.running and replay.next_arrival >= len(trace_jobs):
            # Only the policy can change anything now; refused assignments count as idle.
            idle_rounds += 1
            if idle_rounds > config.stall_rounds:
                break
        else:
            idle_rounds = 0
        replay.record(now_s, bool(actions) or TRIGGER_COMPLETION in triggers)
        if progress is not None and len(replay.decision_times) % 50 == 0:
            progress(len(replay.outcomes), len(trace_jobs), now_s)
    result = replay.result()
    if progress is not None:
        progress(len(replay.outcomes), len(trace_jobs), replay.clock.now_s())
    return result


class _Replay:
    """One replay's state and its steps (``simulate`` drives them event by event)."""

    def __init__(self, policy: Policy, trace_jobs: tuple[TraceJob, ...], cluster: ClusterSpec,
                 table: MeasuredTable, config: SimConfig, estimates: EstimateCache):
        self.policy, self.trace_jobs, self.cluster, self.table = policy, trace_jobs, cluster, table
        self.config, self.estimates = config, estimates
        self.name = getattr(policy, "name", type(policy).__name__)
        self.tuning_mode = tuning_mode_of(policy, config.plan_search)
        self.extra_start_s = float(getattr(policy, "extra_start_s", 0.0))  # what the policy itself adds per start
        # the most a restart's tuning costs, for the snapshot
        self.max_tuning_s = config.costs.tuning_s(self.tuning_mode) + self.extra_start_s
        self.round_s = round_period_s(policy, config)
        self.nodes = tuple(NodeView(n, g.gpu_type, g.gpus_per_node) for g in cluster.node_groups
                           for n in g.node_names())
        self.tally = FreeTally(self.nodes)
        self.clock = SimulatedClock(trace_jobs[0].submit_time_s if trace_jobs else 0.0)
        self.active: dict[str, _Job] = {}
        self.running: dict[str, _Job] = {}
        self.outcomes: dict[str, JobOutcome] = {}
        self.completions: list[tuple[float, int, str, int]] = []
        self.timeline: list[TimelinePoint] = []
        self.decision_times: list[float] = []
        self.samples_done = 0.0
        self.next_arrival, self.seq = 0, 0
        self.next_round_s = math.inf
        self.policy_state = None
        self.forecasts: dict[str, JobForecast] = {}
        self.derived = DerivedCache()  # what the policy derives per job spec, kept across rounds

    def next_event_s(self) -> float:
        """When the next arrival, completion or round (while jobs are active) happens."""
        while self.completions and _stale(self.completions[0], self.active):
            heapq.heappop(self.completions)
        t_arrival = (self.trace_jobs[self.next_arrival].submit_time_s if self.next_arrival < len(self.trace_jobs)
                     else math.inf)
        t_done = self.completions[0][0] if self.completions else math.inf
        t_round = self.next_round_s if self.active else math.inf
        return min(t_arrival, t_done, t_round)

    def finish(self, job: _Job, status: str, reason: str = "") -> None:
        self.samples_done += job.done * job.trace.spec.global_batch
        t = job.trace
        f = self.forecasts.get(t.job_id)
        self.outcomes[t.job_id] = JobOutcome(t.job_id, t.spec, t.submit_time_s, t.iterations, status,
                                             job.first_start_s, job.finish_s, job.restarts, job.done, reason,
                                             t.deadline_s, f.start_s if f else None, f.end_s if f else None,
                                             bool(f and f.extrapolated))

    def complete_due(self, now_s: float) -> set[str]:
        """Jobs whose last iteration is done by ``now_s`` finish; the triggers so far."""
        triggers = set()
        while self.completions and self.completions[0][0] <= now_s:
            _, _, job_id, version = heapq.heappop(self.completions)
            job = self.active.get(job_id)
            if job is None or job.version != version:
                continue
            job.done, job.finish_s = float(job.trace.iterations), now_s
            del self.active[job_id]
            del self.running[job_id]
            self.tally.release(job.assignment.placement)
            self.finish(job, "finished")
            triggers.add(TRIGGER_COMPLETION)
        return triggers

    def admit_due(self, now_s: float, triggers: set[str]) -> list[str]:
        """Jobs submitted by ``now_s`` arrive (those no Cell can run finish as never
        runnable); returns the arrivals whose forecast is kept."""
        arrived = []
        while self.next_arrival < len(self.trace_jobs) and self.trace_jobs[self.next_arrival].submit_time_s <= now_s:
            tj = self.trace_jobs[self.next_arrival]
            self.next_arrival += 1
            cell_est, dp_est, runnable = self.estimates.get(tj.spec)
            job = _Job(tj, cell_est, dp_est, runnable)
            why = never_runnable_reason(cell_est, dp_est, runnable, self.cluster)
            if why:
                self.finish(job, "never_runnable", why)
                continue
            if not self.active:
                self.next_round_s = now_s + self.round_s
            self.active[tj.job_id] = job
            triggers.add(TRIGGER_ARRIVAL)
            if self.config.forecast_every_jobs and (self.next_arrival - 1) % self.config.forecast_every_jobs == 0:
                arrived.append(tj.job_id)
        return arrived

    def decide(self, now_s: float, triggers: set[str], arrived: list[str]) -> list:
        """The policy's decision on the cluster now (and the arrivals' forecasts from it):
        its actions."""
        trigger = (TRIGGER_COMPLETION if TRIGGER_COMPLETION in triggers else
                   TRIGGER_ARRIVAL if TRIGGER_ARRIVAL in triggers else TRIGGER_ROUND)
        costs = self.config.costs
        snapshot = Snapshot(now_s, self.nodes, tuple(_job_view(j, now_s) for j in self.active.values()), trigger,
                            self.round_s, costs.checkpoint_resume_s + self.max_tuning_s, self.policy_state,
                            self.derived)
        t0 = time.perf_counter()
        decision: Decision = self.policy.decide(snapshot)
        self.decision_times.append(time.perf_counter() - t0)
        self.policy_state = decision.policy_state
        try:
            validate_decision(snapshot, decision)
        except DecisionError as e:
            raise SimulationError(f"policy {self.name} at t={now_s:.0f}s: {e}") from None
        for d in decision.jobs:
            self.active[d.job_id].reason = d.reason
        if arrived:
            got = forecast(snapshot, self.policy, (), self.config.forecast_max_decisions, first=decision,
                           start_cost=self._start_cost,
                           progress_from_s={job_id: j.resume_s for job_id, j in self.running.items()})
            self.forecasts.update((job_id, got[job_id]) for job_id in arrived if job_id in got)
        return implied_actions(snapshot, decision)

    def _start_cost(self, start: Start) -> float:
        """The forecast's view of a (re)start's cost: the replay's own rule, on the job's
        estimated rate (the forecast sees estimates, not the measured rates)."""
        job = self.active.get(start.view.job_id)
        first = start.first_in_run and (job is None or job.first_start_s is None)
        new_cell = start.after.cell.label() not in start.cells_run and (job is None or start.after.cell not in job.tuned)
        rate = rate_of(start.view, start.after)
        return self.extra_start_s + self.config.costs.start_cost_s(
            self.tuning_mode, first, new_cell, start.view.remaining_iterations / rate if rate > 0 else math.inf)

    def apply(self, action, now_s: float) -> None:
        """One action: the job stops, or (re)starts at the measured rate of its new
        allocation after the restart's costs (left pending when no rate was measured)."""
        costs = self.config.costs
        job = self.active[action.job_id]
        job.sync(now_s)
        job.version += 1
        job.view = None
        job.last_change_s = now_s
        if job.assignment is not None:
            self.tally.release(job.assignment.placement)
        after = action.after
        rate_s = None
        if after is not None:
            n_nodes, per_node = layout_of(after.placement)
            spec = job.trace.spec
            rate_s = self.table.iter_time_s(spec.model, spec.global_batch, after.cell.gpu_type, n_nodes, per_node)
            if rate_s is None:
                log.info("policy %s: job %s on %s %dx%d has no measured rate; left pending",
                         self.name, job.trace.job_id, after.cell.gpu_type, n_nodes, per_node)
                after = None
        if after is None:
            job.assignment, job.rate_s = None, None
            self.running.pop(job.trace.job_id, None)
            return
        overhead_s = self.extra_start_s + costs.start_cost_s(
            self.tuning_mode, job.first_start_s is None, after.cell not in job.tuned,
            (job.trace.iterations - job.done) * rate_s)
        if job.first_start_s is None:
            job.first_start_s = now_s
        else:
            job.restarts += 1
        job.tuned.add(after.cell)
        job.assignment, job.rate_s = after, rate_s
        self.tally.take(after.placement)
        self.running[job.trace.job_id] = job
        job.resume_s = now_s + overhead_s
        self.seq += 1
        heapq.heappush(self.completions, (job.finish_time_s(), self.seq, job.trace.job_id, job.version))

    def record(self, now_s: float, allocation_changed: bool) -> None:
        """A timeline point after a change, or when the last is ``timeline_min_step_s`` old."""
        if self.timeline and now_s - self.timeline[-1].time_s < self.config.timeline_min_step_s \
                and not allocation_changed:
            return
        self._point(now_s)

    def record_resumes(self, now_s: float) -> None:
        """Points where running jobs ended their launch, resume or plan search since the
        last point, before ``now_s``'s event changes anything: their progress starts there."""
        last_s = self.timeline[-1].time_s if self.timeline else -math.inf
        for t in sorted({j.resume_s for j in self.running.values() if last_s < j.resume_s < now_s}):
            self._point(t)

    def _point(self, at_s: float) -> None:
        in_use: dict[str, int] = {}
        for j in self.running.values():
            in_use[j.assignment.cell.gpu_type] = in_use.get(j.assignment.cell.gpu_type, 0) + j.assignment.cell.num_gpus
        # Jobs still in their launch, resume or plan search hold GPUs and make no progress.
        self.timeline.append(TimelinePoint(at_s, sum(j.trace.spec.global_batch / j.rate_s for j in self.running.values()
                                                     if j.resume_s <= at_s),
                                           len(self.active) - len(self.running), len(self.running),
                                           tuple(sorted(in_use.items())), self.tally.by_type()))

    def result(self) -> SimResult:
        """Jobs still active end unfinished at the clock's time, jobs not yet arrived as
        beyond the horizon; the replay's result."""
        end_s = self.clock.now_s()
        for job in self.active.values():
            job.sync(end_s)
            self.finish(job, "unfinished", job.reason or "left pending by the policy")
        for tj in self.trace_jobs[self.next_arrival:]:
            self.outcomes[tj.job_id] = JobOutcome(tj.job_id, tj.spec, tj.submit_time_s, tj.iterations, "unfinished",
                                                  None, None, 0, 0.0, "arrives after the simulated horizon",
                                                  tj.deadline_s)
        finished = [o.finish_s for o in self.outcomes.values() if o.finish_s is not None]
        start_s = self.trace_jobs[0].submit_time_s if self.trace_jobs else 0.0
        capacity = {t: self.cluster.total_gpus(t) for t in self.cluster.gpu_types}
        return SimResult(self.name, tuple(self.outcomes[t.job_id] for t in self.trace_jobs), tuple(self.timeline),
                         tuple(self.decision_times), self.samples_done, start_s,
                         max(finished) if finished else start_s, capacity, end_s)
