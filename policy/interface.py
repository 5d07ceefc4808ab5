"""The policy interface: what a policy sees (a Snapshot) and what it returns (a Decision).

The daemon and the simulator build the same Snapshot and call the same
``Policy.decide(snapshot) -> Decision``. A policy is pure over the snapshot: it never
reads the clock, the environment or the filesystem, and it keeps no hidden state between
calls. State that must survive a round (a queue order, a smoothed rate) travels as an
explicit value: the policy returns it in ``Decision.policy_state`` and the caller hands
it back unchanged in the next ``Snapshot.policy_state``.

The actions a decision implies (start, resize, change type, move, suspend) are not part
of the Decision; ``implied_actions(snapshot, decision)`` derives them, so the daemon and
the simulator act on exactly the same difference.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from estimator.cells import Cell, CellEstimate
from estimator.jobs import JobSpec

PENDING = "pending"
RUNNING = "running"
JOB_STATES = (PENDING, RUNNING)

# Why decide() is being called; policies may treat rounds and events differently.
TRIGGER_ROUND = "round"
TRIGGER_ARRIVAL = "arrival"
TRIGGER_COMPLETION = "completion"
DEFAULT_ROUND_S = 300.0

Placement = tuple[tuple[str, int], ...]
"""Node name and GPU count on that node, one pair per node, sorted by node name."""


@dataclass(frozen=True)
class NodeView:
    """One node as a policy sees it.

    Attributes:
        name: the node's name (Slurm NodeName or simulated ``a100-17``).
        gpu_type: GPU type of every GPU on the node.
        total_gpus: GPUs on the node.
        unmanaged_gpus: GPUs held by jobs the policy does not manage (ordinary Slurm
            jobs, drained GPUs); never available to the policy.
        usable: False for a node that is down or drained (all its GPUs unmanaged, and
            they come back only when an admin or Slurm brings the node back).
    """

    name: str
    gpu_type: str
    total_gpus: int
    unmanaged_gpus: int = 0
    usable: bool = True

    @property
    def managed_gpus(self) -> int:
        """GPUs the policy may hand out on this node."""
        return max(0, self.total_gpus - self.unmanaged_gpus)


@dataclass(frozen=True)
class NodeIndex:
    """Lookups over a node tuple: capacity for managed jobs, type per node, nodes per type."""

    capacity: dict[str, int]
    type_of: dict[str, str]
    by_type: dict[str, tuple[str, ...]]


_last_index: list = [None, None]  # (nodes tuple, its NodeIndex): snapshots reuse one tuple


def node_index(nodes: tuple[NodeView, ...]) -> NodeIndex:
    """The lookups of a node tuple, cached for the tuple last asked about.

    Callers that build snapshots in a loop (the simulator, the daemon between node
    changes) pass the same tuple object each time, so the per-node work happens once.
    """
    if _last_index[0] is not nodes:
        by_type: dict[str, list[str]] = {}
        for n in nodes:
            by_type.setdefault(n.gpu_type, []).append(n.name)
        index = NodeIndex({n.name: n.managed_gpus for n in nodes}, {n.name: n.gpu_type for n in nodes},
                          {t: tuple(sorted(names)) for t, names in by_type.items()})
        _last_index[0], _last_index[1] = nodes, index
    return _last_index[1]


@dataclass(frozen=True)
class Assignment:
    """A Cell and where it runs: ``placement`` sums to ``cell.num_gpus`` on nodes of its type."""

    cell: Cell
    placement: Placement

    @property
    def num_gpus(self) -> int:
        return sum(g for _, g in self.placement)

    @property
    def nodes(self) -> tuple[str, ...]:
        return tuple(n for n, _ in self.placement)


@dataclass(frozen=True)
class JobView:
    """One managed job as a policy sees it.

    Attributes:
        job_id: the job's id (Slurm job id or trace id), unique in a snapshot.
        user: who submitted it.
        spec: model, global batch and what was asked (GPU count and type, optional).
        submit_time_s: when it was submitted, on the snapshot's clock.
        state: ``pending`` (never started, or suspended) or ``running``.
        assignment: its current Cell and placement while running, else None.
        iterations_done: training iterations completed so far (fractional in simulation).
        iterations_total: iterations the job will run in all.
        restarts: how many times it was (re)started after its first start.
        last_change_s: when its allocation last changed (submit time if never started).
        deadline_s: when it should be done, or None.
        guaranteed: the user asked for at least the throughput of the requested Cell.
        estimates: the Cells the estimator enumerated for it and their estimates
            (``plan_space="cell"``). A Cell the platform cannot run has ``feasible=False``
            with the reason, e.g. ``no measured rate`` in simulation.
        dp_only_estimates: the same Cells estimated with data parallelism only (one
            stage), for baselines that know no pipeline or tensor parallelism.
        runnable_cells: the Cells the platform can run at all, when it knows (the
            simulator: those with a measured rate); None means no such limit is known.
            Estimates of Cells outside it are already marked infeasible. A set's order
            changes with Python's hash seed: test membership, or iterate it sorted.
    """

    job_id: str
    user: str
    spec: JobSpec
    submit_time_s: float
    state: str
    assignment: Assignment | None
    iterations_done: float
    iterations_total: int
    restarts: int
    last_change_s: float
    deadline_s: float | None = None
    guaranteed: bool = False
    estimates: tuple[CellEstimate, ...] = ()
    dp_only_estimates: tuple[CellEstimate, ...] = ()
    runnable_cells: frozenset[Cell] | None = None

    def can_run(self, cell: Cell) -> bool:
        """Whether the platform can run ``cell`` at all (estimates aside)."""
        return self.runnable_cells is None or cell in self.runnable_cells

    @property
    def cell(self) -> Cell | None:
        return self.assignment.cell if self.assignment else None

    @property
    def has_run(self) -> bool:
        """The job has started before (it runs, made progress, or was restarted): a start
        now is a checkpoint and resume, not its first launch."""
        return self.assignment is not None or self.iterations_done > 0 or self.restarts > 0

    @property
    def remaining_iterations(self) -> float:
        return max(0.0, self.iterations_total - self.iterations_done)

    @property
    def progress_frac(self) -> float:
        return min(1.0, self.iterations_done / self.iterations_total) if self.iterations_total else 1.0

    def feasible_estimates(self, dp_only: bool = False) -> tuple[CellEstimate, ...]:
        """The feasible estimates, fastest first (ties broken by fewer GPUs, then label)."""
        pool = self.dp_only_estimates if dp_only else self.estimates
        return tuple(sorted((e for e in pool if e.feasible),
                            key=lambda e: (e.iteration_time_s, e.cell.num_gpus, e.cell.label())))

    def feasible_like(self, cell: Cell) -> CellEstimate | None:
        """The fastest feasible estimate of a Cell of ``cell``'s shape (GPU type, count
        and stages, whatever the layout), or None."""
        shape = (cell.gpu_type, cell.num_gpus, cell.num_stages)
        return next((e for e in self.feasible_estimates()
                     if (e.cell.gpu_type, e.cell.num_gpus, e.cell.num_stages) == shape), None)

    def estimate_for(self, cell: Cell, dp_only: bool = False) -> CellEstimate | None:
        """The estimate of exactly ``cell``, or None when it was not enumerated."""
        for e in (self.dp_only_estimates if dp_only else self.estimates):
            if e.cell == cell:
                return e
        return None


# A JobDecision whose reason starts with this leaves the job pending for good: the policy
# will never start it (crius-ddl: no Cell meets its deadline). The daemon then lets it run
# as submitted.
DROPPED_PREFIX = "dropped"


class DerivedCache:
    """What policies derive from a job's estimates (rate tables, shapes), kept from one
    snapshot to the next by whoever builds the snapshots (the daemon, the simulator).

    Jobs of one spec share their estimates tuple, and a caller hands out the same tuple
    round after round, so what is derived from it is computed once. An entry is found by
    the identity of the objects it was derived from and keeps them alive, so an id is
    never reused while its entry lives. Bounded: cleared wholesale when full (a rebuild is
    cheap and rare). Without one, a snapshot keeps its own (:func:`derived`).
    """

    def __init__(self, max_entries: int = 20000):
        self.max_entries = max_entries
        self._memo: dict[tuple, tuple[tuple, object]] = {}

    def get(self, kind: str, sources: tuple, key: tuple, compute: Callable[[], object]):
        """``compute()``, once per (kind, the objects ``sources``, ``key``)."""
        k = (kind, tuple(id(o) for o in sources), key)
        hit = self._memo.get(k)
        if hit is not None and all(a is b for a, b in zip(hit[0], sources)):
            return hit[1]
        value = compute()
        if len(self._memo) >= self.max_entries:
            self._memo.clear()
        self._memo[k] = (sources, value)
        return value


@dataclass(frozen=True)
class Snapshot:
    """Everything a policy may look at, at one instant.

    Attributes:
        now_s: the current time on the caller's clock (simulated or wall), seconds.
        nodes: the cluster's nodes.
        jobs: the managed jobs not yet finished, in submission order.
        trigger: why decide() is called (``round``, ``arrival``, ``completion``).
        round_s: the period of scheduling rounds, seconds.
        restart_cost_s: what one restart of a job costs in lost time (checkpoint,
            resume, plan tuning), as the caller models it; lets a policy weigh a resize.
        policy_state: the ``policy_state`` of the policy's previous Decision (None at first).
        derived: the caller's cache of what policies derive per job spec (None: each
            snapshot derives afresh). Not part of the snapshot's value.
    """

    now_s: float
    nodes: tuple[NodeView, ...]
    jobs: tuple[JobView, ...]
    trigger: str = TRIGGER_ROUND
    round_s: float = DEFAULT_ROUND_S
    restart_cost_s: float = 0.0
    policy_state: object = None
    derived: DerivedCache | None = field(default=None, compare=False, repr=False)

    def node(self, name: str) -> NodeView:
        for n in self.nodes:
            if n.name == name:
                return n
        raise KeyError(name)

    def job(self, job_id: str) -> JobView:
        return self.job_index()[job_id]

    def derived_cache(self) -> DerivedCache:
        """The caller's cache, else one of this snapshot's own."""
        if self.derived is not None:
            return self.derived
        own = self.__dict__.get("_own_derived")
        if own is None:
            own = DerivedCache()
            object.__setattr__(self, "_own_derived", own)
        return own

    def job_index(self) -> dict[str, JobView]:
        """Job id → view (memoised per snapshot; do not modify the returned dict)."""
        index = self.__dict__.get("_job_index")
        if index is None:
            index = {j.job_id: j for j in self.jobs}
            object.__setattr__(self, "_job_index", index)
        return index

    def managed_capacity(self) -> dict[str, int]:
        """Node name → GPUs the policy may hand out (ignoring managed jobs' holdings)."""
        return dict(node_index(self.nodes).capacity)

    def free_gpus(self) -> dict[str, int]:
        """Node name → GPUs free now, after unmanaged jobs and running managed jobs (a new dict)."""
        cached = self.__dict__.get("_free_gpus")
        if cached is None:
            cached = dict(node_index(self.nodes).capacity)
            for j in self.jobs:
                if j.assignment is not None:
                    for name, gpus in j.assignment.placement:
                        cached[name] -= gpus
            # A private memo, not a field: equality and hashing ignore it.
            object.__setattr__(self, "_free_gpus", cached)
        return dict(cached)

    def gpus_by_type(self) -> dict[str, int]:
        """GPU type → GPUs the policy may hand out."""
        out: Counter[str] = Counter()
        for n in self.nodes:
            out[n.gpu_type] += n.managed_gpus
        return dict(out)


@dataclass(frozen=True)
class JobDecision:
    """What one job should have: an assignment, or None for pending; and why, briefly."""

    job_id: str
    assignment: Assignment | None
    reason: str = ""


@dataclass(frozen=True)
class Decision:
    """A policy's answer: one JobDecision per job it decides about.

    A job of the snapshot that is absent keeps what it has (running stays running on the
    same placement; pending stays pending).

    ``holds``: nodes set aside for waiting jobs (the starvation bound's hold while they
    drain), as (job id, node names); nobody else may start there. () holds nothing;
    None keeps what the last decision held (a round the policy skipped).
    """

    jobs: tuple[JobDecision, ...]
    policy_state: object = None
    holds: tuple[tuple[str, tuple[str, ...]], ...] | None = ()

    def for_job(self, job_id: str) -> JobDecision | None:
        for d in self.jobs:
            if d.job_id == job_id:
                return d
        return None

    def as_dict(self) -> dict[str, JobDecision]:
        return {d.job_id: d for d in self.jobs}


@dataclass(frozen=True)
class QueueOrder:
    """How a policy would start waiting jobs as GPUs come free: what the forecast's list
    schedule plays out beyond its decisions (``policy.forecast``).

    Attributes:
        jobs: (job id, its Cells in the policy's preference), in the order it starts them.
        blocking: a job that does not fit blocks the later jobs of its GPU type (strict
            FIFO); False: later jobs that fit start (backfilling).
    """

    jobs: tuple[tuple[str, tuple[Cell, ...]], ...]
    blocking: bool = False


@runtime_checkable
class Policy(Protocol):
    """A scheduling policy. Construct it with its configuration only; ``decide`` is pure.

    Optional class attribute ``plan_tuning`` (``"full"`` by default, ``"pruned"`` for a
    Cell-guided search, ``"none"``) says what plan search the policy's paper charged on a new
    Cell (the simulator's ``--plan-search own``; by default every policy pays the runtime's).
    Optional class attributes ``extra_start_s`` and ``extra_start_reason`` state what the
    policy itself adds to every (re)start, beside the costs every policy pays, and why.
    Optional attribute ``round_s``: the policy's own round length, which the simulator
    wakes it at instead of its ``--round-s``.
    Optional method ``queue_order(snapshot) -> QueueOrder`` tells the forecast how the
    policy would start the waiting jobs as GPUs come free.
    A policy that may skip a call (a round it believes unchanged, a call between its own
    rounds) has ``solve_next(policy_state) -> policy_state``: the state with which its next
    ``decide`` solves afresh, keeping what it learnt; the daemon uses it while a waiting
    job fits idle GPUs.
    """

    name: str

    def decide(self, snapshot: Snapshot) -> Decision:
        """The assignment every managed job should have now."""
        ...


# Action kinds implied by a decision.
START = "start"            # pending → running (first start or resume after suspend)
SUSPEND = "suspend"        # running → pending (checkpoint, release the GPUs)
RESIZE = "resize"          # same GPU type, other GPU count (or stage count)
CHANGE_TYPE = "change_type"  # other GPU type
MOVE = "move"              # same Cell, other nodes
ACTION_KINDS = (START, SUSPEND, RESIZE, CHANGE_TYPE, MOVE)


@dataclass(frozen=True)
class Action:
    """One change to apply: ``before`` and ``after`` are assignments (None = not running)."""

    kind: str
    job_id: str
    before: Assignment | None
    after: Assignment | None
    reason: str = ""

    @property
    def restarts_job(self) -> bool:
        """Whether the job stops and starts again (every kind but a first start does)."""
        return self.kind != SUSPEND and self.before is not None


def implied_actions(snapshot: Snapshot, decision: Decision) -> tuple[Action, ...]:
    """The actions that turn the snapshot's assignments into the decision's.

    Suspensions come first, then resizes, type changes and moves, then starts, so that
    applying them in order never needs GPUs that are still held; within a kind, in the
    decision's order, except that a change waits for the changes that free the GPUs it
    takes (jobs that swap nodes among themselves, a cycle, keep the decision's order).

    Args:
        snapshot: the state the policy saw.
        decision: the policy's answer.

    Returns:
        The actions, in application order; jobs whose assignment is unchanged have none.
    """
    jobs = snapshot.job_index()
    actions: list[Action] = []
    for d in decision.jobs:
        job = jobs.get(d.job_id)
        if job is None:
            continue
        before, after = job.assignment, d.assignment
        if before is after or before == after:
            continue
        if after is None:
            kind = SUSPEND
        elif before is None:
            kind = START
        elif before.cell.gpu_type != after.cell.gpu_type:
            kind = CHANGE_TYPE
        elif before.cell != after.cell:
            kind = RESIZE
        else:
            kind = MOVE
        actions.append(Action(kind, job.job_id, before, after, d.reason))
    order = {SUSPEND: 0, RESIZE: 1, CHANGE_TYPE: 1, MOVE: 1, START: 2}
    actions.sort(key=lambda a: order[a.kind])
    changes = [a for a in actions if order[a.kind] == 1]
    if len(changes) < 2:
        return tuple(actions)
    free = {n.name: n.managed_gpus for n in snapshot.nodes}
    for j in snapshot.jobs:
        for name, gpus in j.assignment.placement if j.assignment is not None else ():
            free[name] = free.get(name, 0) - gpus
    for a in actions:
        if a.kind == SUSPEND:
            for name, gpus in a.before.placement:
                free[name] += gpus
    ordered: list[Action] = []
    while changes:
        ready = next((a for a in changes if _fits_after_leaving(free, a)), changes[0])
        for name, gpus in ready.before.placement:
            free[name] += gpus
        for name, gpus in ready.after.placement:
            free[name] = free.get(name, 0) - gpus
        ordered.append(ready)
        changes.remove(ready)
    return tuple(a for a in actions if a.kind == SUSPEND) + tuple(ordered) + \
        tuple(a for a in actions if a.kind == START)


def _fits_after_leaving(free: dict[str, int], action: Action) -> bool:
    """The GPUs ``action`` takes are free once its job has left the ones it holds."""
    own = dict(action.before.placement)
    return all(free.get(name, 0) + own.get(name, 0) >= gpus for name, gpus in action.after.placement)


class DecisionError(ValueError):
    """A decision that cannot be applied; the message names the job or node and the fault."""


def final_assignments(snapshot: Snapshot, decision: Decision) -> dict[str, Assignment | None]:
    """Job id → the assignment each job of the snapshot has once the decision is applied."""
    wanted = decision.as_dict()
    return {j.job_id: (wanted[j.job_id].assignment if j.job_id in wanted else j.assignment)
            for j in snapshot.jobs}


def validate_decision(snapshot: Snapshot, decision: Decision) -> None:
    """Check a decision is applicable: known jobs, consistent placements, no over-commit, no
    Cell with more pipeline stages than a job's ``max_stages``.

    Raises:
        DecisionError: naming the first fault found.
    """
    jobs = snapshot.job_index()
    index = node_index(snapshot.nodes)
    free = snapshot.free_gpus()
    seen: set[str] = set()
    changed = []
    for d in decision.jobs:
        job = jobs.get(d.job_id)
        if job is None:
            raise DecisionError(f"decision names job {d.job_id!r}, which is not in the snapshot")
        if d.job_id in seen:
            raise DecisionError(f"decision names job {d.job_id!r} twice")
        seen.add(d.job_id)
        if d.assignment is job.assignment or d.assignment == job.assignment:
            continue  # unchanged: already counted in the snapshot's free GPUs
        changed.append(d)
        if job.assignment is not None:
            for name, gpus in job.assignment.placement:
                free[name] += gpus
    touched: set[str] = set()
    for d in changed:
        a = d.assignment
        if a is None:
            continue
        job_id = d.job_id
        max_stages = jobs[job_id].spec.max_stages
        if max_stages is not None and a.cell.num_stages > max_stages:
            # The job's own script cannot run the plan: it would fail on the new Cell.
            raise DecisionError(f"job {job_id!r}: Cell {a.cell.label()} has {a.cell.num_stages} "
                                f"stages, the job allows at most max_stages={max_stages}")
        if a.cell.num_gpus <= 0 or a.cell.num_stages <= 0 or not a.placement:
            raise DecisionError(f"job {job_id!r}: Cell {a.cell.label()} on {a.placement} runs nothing: "
                                "give it GPUs and stages")
        if a.num_gpus != a.cell.num_gpus:
            raise DecisionError(f"job {job_id!r}: placement {a.placement} holds {a.num_gpus} GPUs, "
                                f"Cell {a.cell.label()} needs {a.cell.num_gpus}")
        names = [n for n, _ in a.placement]
        if len(set(names)) != len(names):
            raise DecisionError(f"job {job_id!r}: placement {a.placement} names a node twice")
        for name, gpus in a.placement:
            gtype = index.type_of.get(name)
            if gtype is None:
                raise DecisionError(f"job {job_id!r}: unknown node {name!r}")
            if gtype != a.cell.gpu_type:
                raise DecisionError(f"job {job_id!r}: node {name} has {gtype}, "
                                    f"Cell {a.cell.label()} needs {a.cell.gpu_type}")
            if gpus <= 0:
                raise DecisionError(f"job {job_id!r}: {gpus} GPUs on node {name}")
            free[name] -= gpus
            touched.add(name)
    for name in sorted(touched):
        if free[name] < 0:
            raise DecisionError(f"node {name}: {index.capacity[name] - free[name]} GPUs assigned, "
                                f"{index.capacity[name]} available to managed jobs")
