"""Sia's goodput-optimizing ILP over (GPU type, GPU count) configurations.

Sia (SOSP'23; the Arena artifact's ``sia_sched.py`` follows its public code) re-plans every
job's configuration each round with one integer linear program:

* **Configurations**: every (GPU type, power-of-two count) on which the job runs; it sees
  data-parallel performance only (static parallelism), as in the Crius and Arena papers.
* **Throughput model**: bootstrapped from one GPU — the smallest feasible count of each type
  profiled, per-GPU rate scaled linearly to larger counts (Sia's initial model).
* **Goodput** of a configuration is its throughput over the job's slowest configuration
  (so ≥ 1), multiplied by the **restart factor** ``max((age − restarts·R)/(age + R), 0.01)``
  when the configuration differs from the one the job runs on, and raised to the fairness
  power ``p = −0.5``. With p < 0 the ILP *minimizes* the sum, which favours spreading GPUs.
* **Constraints**: a running job keeps exactly one configuration (Sia is non-preemptive);
  a pending job gets at most one, and leaving it out costs more than any configuration, so
  as many jobs as fit are admitted; per type the counts fit the GPUs; at most ``max_moves``
  running jobs change configuration per round (the Arena baseline's bound).

Sia re-plans once per scheduling round (``trigger == round``): the ILP runs through HiGHS
(``policy.binary_program``; CBC as fallback) under a time limit; when none
answers, a greedy rule decides (pending jobs in FIFO order take their best configuration
that still fits). A round in which no job arrived, finished or changed re-uses the last
answer without solving; only the ``max_free_running`` running jobs with most to gain may
change (the others are fixed), which bounds the ILP on a busy cluster. Between rounds,
arrivals and departures only admit pending jobs onto free GPUs (each on its best
configuration up to the count it asked for), so no job idles until the next round.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from estimator.cells import Cell
from policy._solver import FitIndex, RateTable, capacity_by_type, realize
from policy.binary_program import solve_binary_program
from policy.interface import TRIGGER_ROUND, Assignment, Decision, JobDecision, JobView, Snapshot
from policy.placement import FreeGpus

log = logging.getLogger(__name__)

FAIRNESS_P = -0.5
MAX_MOVES = 5
DEFAULT_RESTART_S = 300.0


@dataclass(frozen=True)
class _Config:
    job_id: str
    cell: Cell
    goodput: float  # normalized, restart factor applied
    value: float  # goodput ** p


@dataclass(frozen=True)
class SiaState:
    """The jobs and running Cells of the last solved round, to skip re-solving an unchanged one."""

    fingerprint: tuple = ()


class SiaPolicy:
    """Sia: one ILP per round over (type, count) configurations with p-fairness.

    Args:
        fairness_p: the fairness exponent (Sia's −0.5).
        max_moves: running jobs that may change configuration in one round.
        time_limit_s: seconds the solver may take per round.
        max_pending: pending jobs (FIFO) offered to one ILP; bounds its size.
        max_free_running: running jobs (those with most to gain) the ILP may reconfigure;
            the others keep their configuration this round.
    """

    name = "sia"

    def __init__(self, fairness_p: float = FAIRNESS_P, max_moves: int = MAX_MOVES,
                 time_limit_s: float = 0.5, max_pending: int = 32, max_free_running: int = 24):
        self.p = fairness_p
        self.max_moves = max_moves
        self.time_limit_s = time_limit_s
        self.max_pending = max_pending
        self.max_free_running = max_free_running

    def decide(self, snapshot: Snapshot) -> Decision:
        """A round solves the ILP (unless nothing changed); an event only admits onto free GPUs."""
        state = snapshot.policy_state if isinstance(snapshot.policy_state, SiaState) else SiaState()
        if snapshot.trigger != TRIGGER_ROUND:
            return self._admit_between_rounds(snapshot, state)
        fp = _fingerprint(snapshot, {})
        if state.fingerprint == fp:
            return Decision((), state)
        running = [j for j in snapshot.jobs if j.assignment is not None]
        pending = [j for j in snapshot.jobs if j.assignment is None][: self.max_pending]
        configs = {j.job_id: self._configs(snapshot, j) for j in running + pending}
        capacity = capacity_by_type(snapshot)
        # Only the running jobs with most to gain may change; the rest are fixed in place.
        # Sia itself moves few jobs a round (and so does max_moves): this keeps the ILP small.
        rank = {j.job_id: k for k, j in enumerate(snapshot.jobs)}
        movable = sorted(running, key=lambda j: (-_improvable(configs[j.job_id], j.cell), rank[j.job_id]))
        fixed = movable[self.max_free_running:]
        movable = movable[: self.max_free_running]
        for j in fixed:
            capacity[j.cell.gpu_type] = capacity.get(j.cell.gpu_type, 0) - j.cell.num_gpus
        chosen = self._solve(movable, pending, configs, capacity)
        reasons: dict[str, str] = {}
        if chosen is None:
            chosen = self._greedy(movable, pending, configs, capacity)
            how = "greedy (no ILP answer in time)"
        else:
            how = "ILP"
        wanted: dict[str, Cell | None] = {}
        for j in movable + pending:
            c = chosen.get(j.job_id)
            wanted[j.job_id] = c.cell if c else None
            if c is None:
                reasons[j.job_id] = "waiting: not allocated this round"
            elif c.cell != j.cell:
                reasons[j.job_id] = f"{how}: {c.cell.label()} (goodput {c.goodput:.2f})"
        order = sorted(wanted, key=lambda i: (-(wanted[i].num_gpus if wanted[i] else 0), rank[i]))
        decision = realize(snapshot, wanted, reasons, order)
        return Decision(decision.jobs, SiaState(_fingerprint_after(snapshot, decision)))

    def _admit_between_rounds(self, snapshot: Snapshot, state: SiaState) -> Decision:
        """Arrivals and departures between rounds: pending jobs (FIFO) take free GPUs.

        Each takes its best configuration (highest goodput) up to the count it asked for
        that fits on free nodes now; the next round's ILP may reconfigure it.
        """
        free = FreeGpus.from_snapshot(snapshot)
        index = FitIndex(free)
        no_fit: dict[tuple, RateTable] = {}
        out = []
        for j in snapshot.jobs:
            if j.assignment is not None:
                continue
            # A pending job's configurations depend on its spec only: once none of a spec's
            # fits, later jobs of that spec need no check until the free GPUs change.
            table = RateTable.of(j, True, snapshot.derived_cache())
            key = (id(table), j.spec.num_gpus, index.version)
            if key in no_fit:
                continue
            configs = self._configs(snapshot, j)
            cap = j.spec.num_gpus or max((c.cell.num_gpus for c in configs), default=0)
            for c in sorted(configs, key=lambda c: (-c.goodput, c.cell.label())):
                if c.cell.num_gpus > cap or not index.fits(c.cell):
                    continue
                p = free.place(c.cell)
                if p is not None:
                    free.take(p)
                    index.invalidate()
                    out.append(JobDecision(j.job_id, Assignment(c.cell, p),
                                           f"started on {c.cell.label()} until the next round"))
                    break
            else:
                no_fit[key] = table
        return Decision(tuple(out), state)

    def _configs(self, snapshot: Snapshot, job: JobView) -> list[_Config]:
        """The job's configurations with their Sia goodput and objective value."""
        table = RateTable.of(job, True, snapshot.derived_cache())
        rates: dict[tuple[str, int], float] = {}
        for gtype in sorted({t for t, _ in table.options}):
            counts = table.counts(gtype)
            per_gpu = table.rate(gtype, counts[0]) / counts[0]  # bootstrapped from the smallest
            for n in counts:
                if n & (n - 1) == 0:
                    rates[(gtype, n)] = per_gpu * n
        if job.cell is not None:
            key = (job.cell.gpu_type, job.cell.num_gpus)
            rates.setdefault(key, max(table.rate(*key), 1e-9))
        if not rates:
            return []
        base = min(rates.values())
        restart_s = snapshot.restart_cost_s or DEFAULT_RESTART_S
        age_s = max(0.0, snapshot.now_s - job.submit_time_s)
        factor = max((age_s - job.restarts * restart_s) / (age_s + restart_s), 0.01)
        out = []
        for (gtype, n), rate in sorted(rates.items()):
            if job.cell is not None and (gtype, n) == (job.cell.gpu_type, job.cell.num_gpus):
                cell, g = job.cell, rate / base
            else:
                cell = table.options[(gtype, n)][0].cell
                g = rate / base * (factor if job.cell is not None else 1.0)
            out.append(_Config(job.job_id, cell, g, g ** self.p))
        return out

    def _solve(self, running, pending, configs, capacity) -> dict[str, _Config] | None:
        flat: list[_Config] = [c for j in running + pending for c in configs[j.job_id]]
        if not flat:
            return {}
        index = {id(c): k for k, c in enumerate(flat)}
        sign = 1.0 if self.p < 0 else -1.0  # minimize Σ g^p for p < 0, maximize for p > 0
        objective: dict[int, float] = {}
        constraints = []
        for j in running + pending:
            cs = configs[j.job_id]
            if not cs:
                continue
            # Leaving a pending job out costs more than any of its configurations.
            penalty = (max(c.value for c in cs) + 1.0) if j.assignment is None else 0.0
            for c in cs:
                objective[index[id(c)]] = sign * c.value - penalty
            constraints.append(({index[id(c)]: 1.0 for c in cs}, "==" if j.assignment else "<=", 1.0))
        for gtype, total in capacity.items():
            coefs = {index[id(c)]: float(c.cell.num_gpus) for c in flat if c.cell.gpu_type == gtype}
            if coefs:
                constraints.append((coefs, "<=", float(total)))
        stay = {index[id(c)]: 1.0 for j in running for c in configs[j.job_id] if c.cell == j.cell}
        if stay:
            constraints.append((stay, ">=", float(max(0, len(stay) - self.max_moves))))
        got = solve_binary_program(objective, constraints, len(flat), maximize=False,
                                   time_limit_s=self.time_limit_s)
        if got is None:
            return None
        return {flat[k].job_id: flat[k] for k in got.chosen}

    def _greedy(self, running, pending, configs, capacity) -> dict[str, _Config]:
        """Fallback: running jobs stay; pending jobs (FIFO) take the best config that fits."""
        left = dict(capacity)
        out: dict[str, _Config] = {}
        for j in running:
            mine = [c for c in configs[j.job_id] if c.cell == j.cell]
            if mine:
                out[j.job_id] = mine[0]
                left[j.cell.gpu_type] = left.get(j.cell.gpu_type, 0) - j.cell.num_gpus
        for j in pending:
            best = sorted(configs[j.job_id], key=lambda c: (c.value * (1 if self.p < 0 else -1), c.cell.label()))
            for c in best:
                if left.get(c.cell.gpu_type, 0) >= c.cell.num_gpus:
                    out[j.job_id] = c
                    left[c.cell.gpu_type] -= c.cell.num_gpus
                    break
        return out


def _improvable(configs: list[_Config], cell: Cell) -> float:
    """How much a running job's objective value could drop by reconfiguring (p < 0)."""
    cur = next((c.value for c in configs if c.cell == cell), None)
    if cur is None:
        return 0.0
    return cur - min(c.value for c in configs)


def _fingerprint(snapshot: Snapshot, d: dict) -> tuple:
    """Every job's Cell (after the decisions ``d``) and the GPUs held outside the policy: a
    plain Slurm job that ends frees GPUs without any managed job changing, and that round
    must be solved again."""
    cells = tuple((j.job_id, (d[j.job_id].assignment.cell if d[j.job_id].assignment else None)
                   if j.job_id in d else j.cell) for j in snapshot.jobs)
    return cells, tuple(n.unmanaged_gpus for n in snapshot.nodes)


def _fingerprint_after(snapshot: Snapshot, decision: Decision) -> tuple:
    """The fingerprint the next snapshot has when this decision is applied and nothing else happens."""
    return _fingerprint(snapshot, decision.as_dict())
