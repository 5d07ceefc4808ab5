"""Sia as published (SOSP'23; its artifact ``siasosp23/artifacts``, ``sia-simulator/sia.py``).

Every round Sia re-plans every job's configuration with one integer linear program:

* **Configurations** of a GPU type with nodes of G GPUs: 1, 2, 4, … G GPUs on one node,
  then 2G, 3G, … whole nodes; a job may take those its Cells can run (data parallel only,
  as the Crius and Arena papers ran Sia) with at least its smallest runnable count there
  (its *scale unit*, one replica) and at most twice the most replicas it has been seen
  running on (Sia's exploration cap, shared across types); a job never seen running gets
  its scale unit only.
* **Throughput model** (``policy.sia_model``): per job and GPU type, Pollux's compute/
  communication model fitted to the one-replica profile and to the step times observed
  while the job ran (Sia's ``fit_perf_params``). A type the job never ran on borrows the
  shape of a type it ran on, scaled by the two types' one-replica rates (Sia's
  ``--project_throughput``). Observations come from the snapshot: a running Cell's
  ``measured`` estimate (the daemon's runner report), else the job's progress between two
  snapshots on one allocation once it is past its restart. The fitted state lives in
  ``SiaState``, per job.
* **Goodput** G of a configuration: its throughput over the job's slowest configuration
  (the global batch is fixed, so goodput is throughput); on any configuration but the
  current one multiplied by the **restart factor** ``max(T − N·S, 0) / (T + S)`` (T: job
  age, N: restarts, S: ``Snapshot.restart_cost_s``; 1 while T < S).
* **Objective** (minimized, since p < 0): ``Σ round(G^p, 2) + λ · (jobs left unallocated)``
  with p = −0.5, λ = 1.1, each G^p capped at 3000 (Sia's ``sia_goodput_clip_val``).
  Constraints: at most one configuration per job, GPUs per type. Preemptive: a running job
  may lose its GPUs when that lowers the objective, except while it is restarting (no
  progress yet since its last change), whose configuration is kept (Sia's
  ``preserve_ckpt_allocs``).
* **Rounds of 60 s**: Sia solves when the snapshot's trigger is a round or at least
  ``round_s`` has passed since its last solve; other events change nothing until then.
  The simulator wakes it every 60 s (``round_s``, which it declares); ``--rounds-for-all``
  gives it the simulator's ``--round-s`` (300 s by default) instead, as every policy.

The ILP goes through ``policy.binary_program`` (HiGHS, CBC as fallback) with Sia's
relative gap of 1e-4, a deterministic budget of ``node_budget`` branch-and-bound nodes
(100,000 by default; a solve that reaches it keeps the best answer found, the same on
any machine) and,
by default, no time limit: it is solved to that gap every time, so a decision does not
depend on the machine's load.
``time_limit_s`` caps a solve in wall-clock seconds only when given; an answerless solve
falls back to keeping running jobs and admitting pending ones FIFO.

Where this setting forces a difference from Sia: no batch-size adaptation (fixed global
batch, goodput = throughput; see ``policy.sia_model`` for the model's priors); the one-
replica profile is the estimator's estimate (measured only with ``--oracle``); restarts
cost what the simulator charges (checkpoint-resume plus the plan search of
``--plan-search``, a full search per new Cell by default, where Sia's jobs restart in
25–250 s), and S in the restart factor is that charge; placement is this repository's
(``policy._solver.realize``: unchanged jobs stay, changed ones are placed largest first),
so a configuration that fits its type's GPU count but not its free nodes waits.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace

from estimator.cells import Cell
from policy._solver import RateTable, capacity_by_type, realize
from policy.binary_program import solve_binary_program
from policy.interface import (TRIGGER_ROUND, Assignment, Decision, JobView, Snapshot, node_index)
from policy.sia_model import PerfParams, Point, fit_perf_params

log = logging.getLogger(__name__)

FAIRNESS_P = -0.5
LAMBDA_UNALLOCATED = 1.1
ROUND_S = 60.0
GOODPUT_POWER_CLIP = 3000.0  # Sia's sia_goodput_clip_val
VALUE_DECIMALS = 2  # Sia rounds G^p to 2 decimals before solving
GAP_REL = 1e-4  # Sia's sia_solver_thresh
MIN_OBSERVE_S = 60.0  # progress watched this long (one Sia round) makes an observation
NO_LIMIT_S = 86400.0  # "no time limit", finite so that CBC (whole seconds) accepts it too
NODE_BUDGET = 100_000  # branch-and-bound nodes per solve: a deterministic budget


@dataclass(frozen=True)
class Observation:
    """A step time the job showed on (type, GPUs, nodes)."""

    gpu_type: str
    num_gpus: int
    num_nodes: int
    iteration_time_s: float


@dataclass(frozen=True)
class TypeFit:
    """The model fitted for one GPU type and the points it was fitted to."""

    gpu_type: str
    points: tuple[Point, ...]
    params: PerfParams


@dataclass(frozen=True)
class JobModel:
    """What Sia knows of one job: its observations (the first per layout, as Sia's
    profile keeps) and the per-type fits made from them."""

    observations: tuple[Observation, ...] = ()
    fits: tuple[TypeFit, ...] = ()

    def observe(self, obs: Observation) -> "JobModel":
        if any((o.gpu_type, o.num_gpus, o.num_nodes) == (obs.gpu_type, obs.num_gpus, obs.num_nodes)
               for o in self.observations):
            return self
        return replace(self, observations=self.observations + (obs,))


@dataclass(frozen=True)
class Probe:
    """A running job's progress watch: the allocation, its progress when first seen on it,
    and the first time (and progress) it was seen advancing."""

    assignment: Assignment
    start_iterations: float
    mark_s: float | None = None
    mark_iterations: float = 0.0


@dataclass(frozen=True)
class SiaState:
    """Sia's memory between calls: when it last solved, each job's model and progress watch."""

    last_solve_s: float | None = None
    models: tuple[tuple[str, JobModel], ...] = ()
    probes: tuple[tuple[str, Probe], ...] = ()


@dataclass(frozen=True)
class _Config:
    job_id: str
    cell: Cell
    rate: float  # predicted samples/s
    goodput: float  # normalized, restart factor applied
    value: float  # min(round(goodput ** p, 2), clip)


class SiaPolicy:
    """Sia: one ILP per round over (type, count) configurations with p-fairness.

    Args:
        fairness_p: the fairness exponent (Sia's −0.5; must not be 0).
        lambda_unallocated: λ, the objective's cost of a job left without GPUs.
        round_s: Sia's round; events closer than this to the last solve change nothing.
        time_limit_s: wall-clock cap of one solve, or None (default): solved to the gap.
        node_budget: branch-and-bound nodes one solve may explore (deterministic).
    """

    name = "sia"
    extra_start_s = 0.0  # added to every (re)start by the simulator, beside the costs every policy pays
    extra_start_reason = ("none: Sia's throughput model learns from the step times running jobs report, so "
                          "no profiling run is charged")

    def __init__(self, fairness_p: float = FAIRNESS_P, lambda_unallocated: float = LAMBDA_UNALLOCATED,
                 round_s: float = ROUND_S, time_limit_s: float | None = None, node_budget: int = NODE_BUDGET):
        if fairness_p == 0:
            raise ValueError("fairness_p must not be 0 (Sia uses -0.5)")
        self.p = fairness_p
        self.lam = lambda_unallocated
        self.round_s = round_s
        self.time_limit_s = time_limit_s
        self.node_budget = node_budget

    @staticmethod
    def solve_next(state: object) -> object:
        """The state with which the next ``decide`` solves now (what it learnt of each job
        kept)."""
        return replace(state, last_solve_s=None) if isinstance(state, SiaState) else state

    def decide(self, snapshot: Snapshot) -> Decision:
        """Record what running jobs show; at a round, solve and place the answer."""
        old = snapshot.policy_state if isinstance(snapshot.policy_state, SiaState) else SiaState()
        models, probes = _observe(snapshot, dict(old.models), dict(old.probes))
        due = (snapshot.trigger == TRIGGER_ROUND or old.last_solve_s is None
               or snapshot.now_s - old.last_solve_s >= self.round_s - 1e-9)
        if not due:
            return Decision((), _state(old.last_solve_s, snapshot, models, probes))
        shapes = _type_shapes(snapshot)
        configs: dict[str, list[_Config]] = {}
        keep: set[str] = set()
        for j in snapshot.jobs:
            model = models.get(j.job_id, JobModel())
            cs, model = self._configs(snapshot, j, model, shapes)
            if model.observations or model.fits:
                models[j.job_id] = model
            if j.assignment is not None and _restarting(snapshot, j, probes.get(j.job_id)):
                cs = [c for c in cs if c.cell == j.cell]
                if cs:
                    keep.add(j.job_id)
            configs[j.job_id] = cs
        capacity = capacity_by_type(snapshot)
        chosen, how = self._solve(snapshot.jobs, configs, keep, capacity), "ILP"
        if chosen is None:
            chosen, how = self._greedy(snapshot.jobs, configs, capacity), "greedy (no ILP answer)"
        wanted: dict[str, Cell | None] = {}
        reasons: dict[str, str] = {}
        for j in snapshot.jobs:
            c = chosen.get(j.job_id)
            wanted[j.job_id] = c.cell if c else None
            if c is None:
                reasons[j.job_id] = ("preempted: the objective frees its GPUs" if j.assignment is not None
                                     else "waiting: not allocated this round")
            elif c.cell != j.cell:
                reasons[j.job_id] = f"sia {how}: {c.cell.label()} (goodput {c.goodput:.2f})"
        rank = {j.job_id: k for k, j in enumerate(snapshot.jobs)}
        order = sorted(wanted, key=lambda i: (-(wanted[i].num_gpus if wanted[i] else 0), rank[i]))
        decision = realize(snapshot, wanted, reasons, order)
        return Decision(decision.jobs, _state(snapshot.now_s, snapshot, models, probes))

    def _configs(self, snapshot: Snapshot, job: JobView, model: JobModel,
                 shapes: dict[str, tuple[int, int, frozenset[int]]]) -> tuple[list[_Config], JobModel]:
        """The job's configurations with Sia's goodput and objective value, and its model
        with any fit made on the way."""
        table = RateTable.of(job, True, snapshot.derived_cache())
        batch = job.spec.global_batch
        units = {}
        for gtype in sorted({t for t, _ in table.options}):
            if gtype in shapes:
                units[gtype] = table.counts(gtype)[0]
        seen = [o for o in model.observations if o.gpu_type in units]
        max_replicas = max([1.0] + [2.0 * o.num_gpus / units[o.gpu_type] for o in seen])
        fits = {f.gpu_type: f for f in model.fits}
        params: dict[str, PerfParams] = {}
        for gtype in sorted({o.gpu_type for o in seen}):
            points = _points(table, gtype, units[gtype], batch, [o for o in seen if o.gpu_type == gtype])
            fit = fits.get(gtype)
            if fit is None or fit.points != points:
                fit = TypeFit(gtype, points, fit_perf_params(points))
                fits[gtype] = fit
            params[gtype] = fit.params
        source = max(sorted(params), key=lambda t: sum(o.gpu_type == t for o in seen), default=None)
        rates: dict[tuple[str, int], tuple[Cell, float]] = {}
        for gtype, unit in units.items():
            node_size, _, counts = shapes[gtype]
            boot_s = batch / max(table.rate(gtype, unit), 1e-12)
            for n in table.counts(gtype):
                if n not in counts or n / unit > max_replicas + 1e-9:
                    continue
                cell = table.options[(gtype, n)][0].cell
                t_s = _predict_s(gtype, n / unit, cell.num_nodes, boot_s, params, source, units, shapes)
                rates[(gtype, n)] = (cell, batch / t_s if t_s else table.rate(gtype, n))
        if job.cell is not None:
            key = (job.cell.gpu_type, job.cell.num_gpus)
            unit = units.get(key[0])
            t_s = (_predict_s(key[0], key[1] / unit, job.cell.num_nodes, batch / max(table.rate(key[0], unit), 1e-12),
                              params, source, units, shapes) if unit and (params or key[1] == unit) else None)
            rate = batch / t_s if t_s else max(table.rate_of_cell(job.cell), 1e-9)
            rates[key] = (job.cell, rate)
        new_model = replace(model, fits=tuple(fits[t] for t in sorted(fits)))
        if not rates:
            return [], new_model
        slowest = min(r for _, r in rates.values())
        factor = _restart_factor(snapshot, job)
        out = []
        for key, (cell, rate) in sorted(rates.items()):
            g = rate / slowest
            if job.cell is not None and cell != job.cell:
                g *= factor
            out.append(_Config(job.job_id, cell, rate, g, self._value(g)))
        return out, new_model

    def _value(self, goodput: float) -> float:
        """Sia's objective coefficient: G^p rounded to 2 decimals, capped."""
        if goodput <= 0:
            return GOODPUT_POWER_CLIP
        return min(round(goodput ** self.p, VALUE_DECIMALS), GOODPUT_POWER_CLIP)

    def _solve(self, jobs, configs, keep, capacity) -> dict[str, _Config] | None:
        """The ILP: minimize Σ value − λ per allocated job (the constant λ·jobs dropped);
        for p > 0, maximize Σ value + λ per allocated job."""
        flat = [c for j in jobs for c in configs[j.job_id]]
        if not flat:
            return {}
        index = {id(c): k for k, c in enumerate(flat)}
        objective = {index[id(c)]: (c.value - self.lam if self.p < 0 else -(c.value + self.lam)) for c in flat}
        rows = []
        for j in jobs:
            cs = configs[j.job_id]
            if cs:
                rows.append(({index[id(c)]: 1.0 for c in cs}, "==" if j.job_id in keep else "<=", 1.0))
        for gtype, total in sorted(capacity.items()):
            coefs = {index[id(c)]: float(c.cell.num_gpus) for c in flat if c.cell.gpu_type == gtype}
            if coefs:
                rows.append((coefs, "<=", float(total)))
        start = [index[id(c)] for j in jobs if j.assignment is not None
                 for c in configs[j.job_id] if c.cell == j.cell]
        got = solve_binary_program(objective, rows, len(flat), maximize=False,
                                   time_limit_s=self.time_limit_s if self.time_limit_s is not None else NO_LIMIT_S,
                                   start=start, gap_rel=GAP_REL, max_nodes=self.node_budget)
        if got is None:
            return None
        if not got.optimal:
            log.warning("sia: the solver stopped at its limit before the 1e-4 gap (%d variables)", len(flat))
        return {flat[k].job_id: flat[k] for k in got.chosen}

    def _greedy(self, jobs, configs, capacity) -> dict[str, _Config]:
        """Fallback: running jobs stay; pending jobs (FIFO) take the best config that fits."""
        left = dict(capacity)
        out: dict[str, _Config] = {}
        for j in jobs:
            mine = [c for c in configs[j.job_id] if j.assignment is not None and c.cell == j.cell]
            if mine:
                out[j.job_id] = mine[0]
                left[j.cell.gpu_type] = left.get(j.cell.gpu_type, 0) - j.cell.num_gpus
        for j in jobs:
            if j.assignment is not None:
                continue
            for c in sorted(configs[j.job_id], key=lambda c: (c.value if self.p < 0 else -c.value, c.cell.label())):
                if left.get(c.cell.gpu_type, 0) >= c.cell.num_gpus:
                    out[j.job_id] = c
                    left[c.cell.gpu_type] -= c.cell.num_gpus
                    break
        return out


def _type_shapes(snapshot: Snapshot) -> dict[str, tuple[int, int, frozenset[int]]]:
    """GPU type → (node size, nodes, Sia's GPU counts: powers of two up to a node, then
    whole-node multiples), memoized per nodes tuple."""
    def compute():
        index = node_index(snapshot.nodes)
        out = {}
        for gtype, names in index.by_type.items():
            size = max((n.total_gpus for n in snapshot.nodes if n.gpu_type == gtype), default=0)
            counts = {1 << k for k in range(size.bit_length()) if 1 << k <= size}
            counts |= {size * k for k in range(2, len(names) + 1)}
            out[gtype] = (size, len(names), frozenset(counts))
        return out
    return snapshot.derived_cache().get("sia_type_shapes", (snapshot.nodes,), (), compute)


def _points(table: RateTable, gtype: str, unit: int, batch: int,
            observed: list[Observation]) -> tuple[Point, ...]:
    """The points of one type's fit: the one-replica profile (unless observed in the same
    layout) and every observation, in replicas of ``unit`` GPUs."""
    boot_nodes = table.options[(gtype, unit)][0].cell.num_nodes
    out = [Point(o.num_gpus / unit, o.num_nodes, o.iteration_time_s) for o in observed]
    if not any(o.num_gpus == unit and o.num_nodes == boot_nodes for o in observed):
        out.insert(0, Point(1.0, boot_nodes, batch / max(table.rate(gtype, unit), 1e-12)))
    return tuple(out)


def _predict_s(gtype, replicas, num_nodes, boot_s, params, source, units, shapes) -> float | None:
    """Seconds per iteration on ``replicas`` replicas of ``gtype``: its own fit, else the
    source type's fit scaled by the two one-replica times (Sia's projection), else the
    profile for one replica; None when nothing predicts it."""
    if gtype in params:
        return params[gtype].iteration_time_s(replicas, num_nodes)
    if source is not None:
        size = max(1, shapes[source][0])
        p = params[source]
        own_nodes = max(1, -(-round(replicas * units[source]) // size))
        one_nodes = max(1, -(-units[source] // size))
        return p.iteration_time_s(replicas, own_nodes) * boot_s / p.iteration_time_s(1.0, one_nodes)
    return boot_s if abs(replicas - 1.0) < 1e-9 else None


def _restart_factor(snapshot: Snapshot, job: JobView) -> float:
    """Sia's (Pollux's) re-allocation factor ``max(T − N·S, 0) / (T + S)``, 1 while T < S."""
    restart_s = snapshot.restart_cost_s
    age_s = max(0.0, snapshot.now_s - job.submit_time_s)
    if age_s < restart_s or restart_s <= 0:
        return 1.0
    return max(age_s - job.restarts * restart_s, 0.0) / (age_s + restart_s)


def _restarting(snapshot: Snapshot, job: JobView, probe: Probe | None) -> bool:
    """A running job that has shown no progress since its last change, within one restart."""
    return (probe is not None and probe.mark_s is None
            and snapshot.now_s - job.last_change_s < snapshot.restart_cost_s)


def _observe(snapshot: Snapshot, models: dict[str, JobModel], probes: dict[str, Probe]):
    """Models and progress watches updated with what the snapshot's running jobs show."""
    now = snapshot.now_s
    live = snapshot.job_index()
    models = {i: m for i, m in models.items() if i in live}
    out_probes: dict[str, Probe] = {}
    for j in snapshot.jobs:
        a = j.assignment
        if a is None:
            continue
        nodes = len(a.placement)
        model = models.get(j.job_id, JobModel())
        measured = j.estimate_for(a.cell, dp_only=True) or j.estimate_for(a.cell)
        if measured is not None and measured.feasible and measured.fidelity == "measured":
            model = model.observe(Observation(a.cell.gpu_type, a.cell.num_gpus, nodes, measured.iteration_time_s))
        probe = probes.get(j.job_id)
        if probe is None or probe.assignment != a:
            probe = Probe(a, j.iterations_done)
        elif probe.mark_s is None:
            if j.iterations_done > probe.start_iterations + 1e-9:
                probe = replace(probe, mark_s=now, mark_iterations=j.iterations_done)
        elif now - probe.mark_s >= MIN_OBSERVE_S and j.iterations_done > probe.mark_iterations + 1e-9:
            t_s = (now - probe.mark_s) / (j.iterations_done - probe.mark_iterations)
            model = model.observe(Observation(a.cell.gpu_type, a.cell.num_gpus, nodes, t_s))
        out_probes[j.job_id] = probe
        if model.observations:
            models[j.job_id] = model
    return models, out_probes


def _state(last_solve_s, snapshot: Snapshot, models: dict[str, JobModel], probes: dict[str, Probe]) -> SiaState:
    order = [j.job_id for j in snapshot.jobs]
    return SiaState(last_solve_s, tuple((i, models[i]) for i in order if i in models),
                    tuple((i, probes[i]) for i in order if i in probes))
