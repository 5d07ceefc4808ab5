"""Gavel as published: the max-sum-throughput linear program and round-based time sharing.

Gavel (Narayanan et al., OSDI'20; ``stanford-futuredata/gavel``) in two parts:

1. **Allocation** (``scheduler/policies/max_sum_throughput.py``, ``ThroughputSumWithPerf``):
   a linear program over time fractions. X[j][t] is the fraction of time job j runs on GPU
   type t, with the GPU count it asked for (Gavel's ``scale_factor`` s_j)::

       maximize    Σ_j Σ_t  throughput[j][t] · X[j][t]
       subject to  Σ_t X[j][t] ≤ 1                  for every job j
                   Σ_j s_j · X[j][t] ≤ num_gpus[t]   for every type t
                   X ≥ 0

   As in Gavel's code the throughputs are *not* normalized (its ``scale = 1 / Σ_t
   throughput`` is computed and never used; there are no instance costs, and this policy
   has no priority weights): throughput[j][t] is the job's iterations per second
   (Gavel's steps/s) on s_j GPUs of type t. Solved with HiGHS's simplex (``highspy``).
   Re-solved at a round when the set of jobs or the GPUs lent to the policy changed
   (Gavel re-solves on arrivals and completions).
2. **Mechanism** (``scheduler/scheduler.py``, ``_update_priorities`` and
   ``_schedule_jobs_on_workers_helper``): every round of ``round_s`` = 360 s (Gavel's
   ``time_per_iteration``) each (job, type) gets the priority X[j][t] ÷ the fraction of
   rounds the job has received on t so far (X[j][t]·10⁹ while it has received none, Gavel's
   rule so that new jobs run according to their allocation; 0 when X[j][t] = 0). Entries are
   sorted by (priority, deficit, X) descending, per type in the cluster's type order (Gavel's
   default; ``global_queue=True`` sorts all types together, its ``--enable_global_queue``),
   and taken in that order while the type has GPUs left for the job; a job runs on at most
   one type per round; entries with X = 0 still take GPUs left over (Gavel's mechanism is
   work-conserving). A job keeps its nodes when it runs on the same type again (Gavel's
   lease extension); a running job not picked this round is preempted (suspended), a
   picked one starts or resumes. Between rounds nothing changes: arrivals wait for the
   next round, and GPUs a finished job frees stay idle until then, as in Gavel. An arrival
   on an idle cluster starts a round at once, and the rounds' clock from it (Gavel's
   simulator jumps to the next arrival when nothing runs).

The round state (rounds each job was active, rounds it received per type, the deficit per
type, the last LP solution, when the next round starts) is a ``GavelState`` handed back in
``Decision.policy_state``; the round clock is the policy's own, so a caller calling more
often (events, ``--round-s`` 300) does not shorten Gavel's rounds.

Where our setting forces a difference from the paper:

* **Throughputs** come from the estimator: the fastest data-parallel Cell of each type at
  the requested GPU count (``RateTable`` over ``dp_only_estimates``, as ``gavel-greedy``),
  in iterations per second; Gavel profiles or measures them. Types without a feasible Cell
  at that count, or with fewer GPUs than it, get no variable (throughput 0: Gavel never
  schedules a job there either).
* **No space sharing** (Gavel's packing variants): a GPU runs one job.
* **Received fraction** counts rounds since the job arrived (the paper's "rounds
  received"); Gavel's code keeps seconds run on the type since the last allocation reset
  (at most every 1,920 s) over all jobs' seconds there. The deficit (Σ over rounds of
  X − ran) is kept since arrival, as in Gavel's code across resets.
* **Placement** is node-level (``policy.placement``): the Cell's layout must fit on free
  nodes, so a picked job that does not fit this round waits although its type had the GPU
  count (Gavel places any ``scale_factor`` workers of the type). Kept jobs are placed
  first, then the others largest first, as Gavel assigns workers.
* **Restarts cost time**: every resume after a preemption and every type change is charged
  by the caller's cost model (the simulator: checkpoint and resume, plus the plan search
  on a Cell the job has not run on); Gavel's simulator charges none.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, replace

from estimator.cells import Cell, CellEstimate
from policy._solver import RateTable, capacity_by_type, realize, requested_count
from policy.binary_program import quiet_highs
from policy.interface import TRIGGER_ARRIVAL, Assignment, Decision, JobDecision, JobView, Snapshot
from policy.placement import FreeGpus

log = logging.getLogger(__name__)

ROUND_S = 360.0  # Gavel's time_per_iteration: the length of a round
NEW_JOB_PRIORITY = 1e9  # Gavel's factor on X for a job that has not yet run on the type
_EPS_S = 1e-6  # rounding slack on the round clock
_EPS_X = 1e-9  # LP values below this are zero


@dataclass(frozen=True)
class JobRounds:
    """One job's round history.

    Attributes:
        present: rounds that began while the job was active.
        received: (GPU type, rounds it ran on that type), by type name.
        deficit: (GPU type, Σ over rounds of X[j][t] − 1 if it ran on t else 0), by type name.
    """

    present: int = 0
    received: tuple[tuple[str, int], ...] = ()
    deficit: tuple[tuple[str, float], ...] = ()


@dataclass(frozen=True)
class GavelState:
    """What one round hands the next.

    Attributes:
        next_round_s: when the next round starts (−inf: the next call starts one).
        rounds_done: rounds run so far.
        allocation: the last LP solution, (job id, ((GPU type, X), ...)) with X > 0.
        solved_for: the job ids and (type, GPUs) the LP was solved for.
        history: (job id, its rounds) for the active jobs.
    """

    next_round_s: float = -math.inf
    rounds_done: int = 0
    allocation: tuple[tuple[str, tuple[tuple[str, float], ...]], ...] = ()
    solved_for: tuple = ()
    history: tuple[tuple[str, JobRounds], ...] = ()


class GavelPolicy:
    """Gavel as published: max-sum-throughput LP, priorities X / rounds received, preemption.

    Args:
        round_s: the length of a round (Gavel's 360 s).
        global_queue: sort the (job, type) entries of all types together (True) or type by
            type in the cluster's order (False, Gavel's default).
    """

    name = "gavel"
    extra_start_s = 0.0  # added to every (re)start by the simulator, beside the costs every policy pays
    extra_start_reason = ("none: Gavel's simulator charges nothing per lease; its preemptions pay the "
                          "checkpoint and resume that every policy pays")

    def __init__(self, round_s: float = ROUND_S, global_queue: bool = False):
        if round_s <= 0:
            raise ValueError(f"round_s must be positive, got {round_s!r}")
        self.round_s = round_s
        self.global_queue = global_queue

    @staticmethod
    def solve_next(state: object) -> object:
        """The state with which the next ``decide`` starts a round now (its jobs' rounds so
        far kept)."""
        return replace(state, next_round_s=-math.inf) if isinstance(state, GavelState) else state

    def decide(self, snapshot: Snapshot) -> Decision:
        """At a round boundary: re-solve if needed, pick this round's jobs, preempt the rest."""
        state = snapshot.policy_state if isinstance(snapshot.policy_state, GavelState) else GavelState()
        history = dict(state.history)
        # Arrivals on an idle cluster (nothing runs, no job was in the last round) start a
        # round now and the rounds' clock with it, as Gavel's simulator restarts its rounds
        # at the first arrival after an idle spell (and ours its round clock).
        idle_arrival = snapshot.trigger == TRIGGER_ARRIVAL and all(
            j.assignment is None and j.job_id not in history for j in snapshot.jobs)
        if snapshot.now_s < state.next_round_s - _EPS_S and not idle_arrival:
            return Decision((), state)  # between rounds: Gavel changes nothing
        types = _type_order(snapshot)
        capacity = capacity_by_type(snapshot)
        options = {j.job_id: per_type_options(j, snapshot, capacity) for j in snapshot.jobs}
        fingerprint = (tuple(j.job_id for j in snapshot.jobs), tuple(sorted(capacity.items())))
        if fingerprint == state.solved_for:
            allocation = {i: dict(x) for i, x in state.allocation}
        else:
            allocation = solve_allocation(snapshot.jobs, options, capacity)
        picked = self.pick(snapshot.jobs, types, options, allocation, history, capacity)

        wanted: dict[str, Cell | None] = {}
        reasons: dict[str, str] = {}
        round_no = state.rounds_done + 1
        for j in snapshot.jobs:
            t = picked.get(j.job_id)
            x = allocation.get(j.job_id, {})
            shares = ", ".join(f"{g} {v:.2f}" for g, v in sorted(x.items())) or "none"
            if t is None:
                wanted[j.job_id] = None
                reasons[j.job_id] = (f"{'preempted' if j.assignment else 'waiting'}: not picked in round "
                                     f"{round_no} (LP shares {shares})")
            elif j.assignment is not None and j.assignment.cell.gpu_type == t:
                wanted[j.job_id] = j.assignment.cell  # same type again: it keeps its nodes
                reasons[j.job_id] = f"round {round_no}: stays on {t} (LP shares {shares})"
            else:
                wanted[j.job_id] = options[j.job_id][t].cell
                reasons[j.job_id] = f"round {round_no}: runs on {t} (LP shares {shares})"
        rank = {j.job_id: k for k, j in enumerate(snapshot.jobs)}
        order = sorted((i for i, c in wanted.items() if c is not None), key=lambda i: (-wanted[i].num_gpus, rank[i]))
        placed = self.fill(snapshot, realize(snapshot, wanted, reasons, order), options, allocation, history,
                           round_no)

        ran = {d.job_id: d.assignment.cell.gpu_type for d in placed.jobs if d.assignment is not None}
        new_history = tuple((j.job_id, _advance(history.get(j.job_id), allocation.get(j.job_id, {}),
                                                ran.get(j.job_id))) for j in snapshot.jobs)
        next_round_s = state.next_round_s
        if next_round_s == -math.inf or idle_arrival:
            next_round_s = snapshot.now_s
        while next_round_s <= snapshot.now_s + _EPS_S:
            next_round_s += self.round_s
        new_state = GavelState(next_round_s, round_no,
                               tuple((i, tuple(sorted(x.items()))) for i, x in allocation.items() if x),
                               fingerprint, new_history)
        return Decision(placed.jobs, new_state)

    def fill(self, snapshot: Snapshot, placed: Decision, options: dict[str, dict[str, CellEstimate]],
             allocation: dict[str, dict[str, float]], history: dict[str, JobRounds], round_no: int) -> Decision:
        """The round's decision with GPUs its placement left idle given to jobs that fit them.

        ``pick`` counts a type's GPUs as freed by every job it moves elsewhere; a move whose
        new Cell cannot be placed keeps the job on its old nodes (``realize``), and the job
        picked for the GPUs it was to free then does not fit. The queue goes on over what
        is free after the decision, in ``pick``'s order: the mechanism stays work-conserving.
        """
        final = {d.job_id: d for d in placed.jobs}
        free = FreeGpus.from_snapshot(snapshot)
        for j in snapshot.jobs:
            if j.assignment is not None:
                free.release(j.assignment.placement)
        for d in placed.jobs:
            if d.assignment is not None:
                free.take(d.assignment.placement)
        waiting = [j for j in snapshot.jobs if j.job_id in final and final[j.job_id].assignment is None]
        if not waiting or not free.total_free():
            return placed
        now = {j.job_id: j.assignment for j in waiting}
        for job_id, t in self.queue(tuple(waiting), _type_order(snapshot), options, allocation, history):
            if final[job_id].assignment is not None:
                continue
            old = now[job_id]  # a job not picked keeps its nodes where they are free: a move restarts it
            if old is not None and old.cell.gpu_type == t and free.all_free(old.placement):
                cell, p = old.cell, old.placement
            elif (p := free.place(cell := options[job_id][t].cell)) is None:
                continue
            free.take(p)
            final[job_id] = JobDecision(job_id, Assignment(cell, p),
                                        f"round {round_no}: runs on {t}, on GPUs the round's placement left idle")
        return Decision(tuple(final[j.job_id] for j in snapshot.jobs if j.job_id in final), placed.policy_state)

    def pick(self, jobs: tuple[JobView, ...], types: list[str], options: dict[str, dict[str, CellEstimate]],
             allocation: dict[str, dict[str, float]], history: dict[str, JobRounds],
             capacity: dict[str, int]) -> dict[str, str]:
        """Gavel's round: job id → the GPU type it runs on this round (absent: it does not run).

        Entries (job, type) with a throughput are sorted by (priority, deficit, X)
        descending, ties in submission order; per type in ``types`` order unless
        ``global_queue``. Each is taken when the job has no type yet this round and the
        type has at least the job's GPU count left.
        """
        left = dict(capacity)
        picked: dict[str, str] = {}
        for job_id, t in self.queue(jobs, types, options, allocation, history):
            if left.get(t, 0) <= 0 or job_id in picked:
                continue
            n = options[job_id][t].cell.num_gpus
            if n > left[t]:
                continue
            left[t] -= n
            picked[job_id] = t
        return picked

    def queue(self, jobs: tuple[JobView, ...], types: list[str], options: dict[str, dict[str, CellEstimate]],
              allocation: dict[str, dict[str, float]], history: dict[str, JobRounds]) -> list[tuple[str, str]]:
        """The round's (job id, GPU type) entries in the order ``pick`` takes them."""
        per_type: dict[str, list[tuple]] = {t: [] for t in types}
        for rank, j in enumerate(jobs):
            h = history.get(j.job_id) or JobRounds()
            received, deficit = dict(h.received), dict(h.deficit)
            x_of = allocation.get(j.job_id, {})
            for t in options[j.job_id]:
                x = x_of.get(t, 0.0)
                per_type[t].append((-priority(x, received.get(t, 0), h.present), -deficit.get(t, 0.0), -x, rank,
                                    j.job_id, t))
        if self.global_queue:
            entries = sorted(e for t in types for e in per_type[t])
        else:
            entries = [e for t in types for e in sorted(per_type[t])]
        return [(job_id, t) for *_, job_id, t in entries]


def priority(x: float, rounds_received: int, rounds_present: int) -> float:
    """Gavel's priority of a job on a type: X ÷ the fraction of rounds it received there.

    X·10⁹ while it has received none (new jobs run as their allocation says), 0 when X = 0.
    """
    if x <= 0.0:
        return 0.0
    if rounds_received <= 0 or rounds_present <= 0:
        return x * NEW_JOB_PRIORITY
    return x / (rounds_received / rounds_present)


def per_type_options(job: JobView, snapshot: Snapshot, capacity: dict[str, int]) -> dict[str, CellEstimate]:
    """GPU type → the job's fastest data-parallel Cell there at its requested GPU count.

    Types without such a Cell or with fewer managed GPUs than the count are left out.
    """
    cache = snapshot.derived_cache()
    table = RateTable.of(job, True, cache)
    n = requested_count(job, table)

    def compute() -> dict[str, CellEstimate]:
        return {t: opts[0] for (t, c), opts in table.options.items() if c == n and opts[0].samples_per_s > 0}

    best = cache.get("gavel_lp_options", (table,), (n,), compute)
    return {t: e for t, e in best.items() if capacity.get(t, 0) >= e.cell.num_gpus}


def solve_allocation(jobs: tuple[JobView, ...], options: dict[str, dict[str, CellEstimate]],
                     capacity: dict[str, int]) -> dict[str, dict[str, float]]:
    """Gavel's max-sum-throughput LP: job id → {GPU type: X[j][t] > 0}.

    Throughput is iterations per second (samples/s ÷ the job's global batch). Falls back
    to a greedy fill (jobs in submission order, each on its fastest type with GPUs left,
    fractionally at the end) when HiGHS gives no optimal answer.
    """
    cols: list[tuple[str, str, float, int]] = []  # job id, type, iterations/s, GPUs
    for j in jobs:
        for t, e in sorted(options[j.job_id].items()):
            cols.append((j.job_id, t, e.samples_per_s / j.spec.global_batch, e.cell.num_gpus))
    if not cols:
        return {}
    try:
        values = _solve_lp(cols, capacity)
    except Exception as e:  # a missing or failing solver must not stop a round
        log.warning("Gavel LP: HiGHS failed (%s); greedy allocation this round", e)
        values = None
    if values is None:
        values = _greedy_fill(cols, capacity)
    out: dict[str, dict[str, float]] = {}
    for (job_id, t, _, _), v in zip(cols, values):
        if v > _EPS_X:
            out.setdefault(job_id, {})[t] = min(1.0, v)
    return out


def _solve_lp(cols, capacity) -> list[float] | None:
    """The LP in column form (each X has two nonzeros: its job's row and its type's row)."""
    import highspy

    job_row: dict[str, int] = {}
    for job_id, *_ in cols:
        job_row.setdefault(job_id, len(job_row))
    type_row = {t: len(job_row) + k for k, t in enumerate(sorted(capacity))}
    inf = highspy.kHighsInf
    lp = highspy.HighsLp()
    lp.num_col_ = len(cols)
    lp.num_row_ = len(job_row) + len(type_row)
    lp.col_cost_ = [thr for _, _, thr, _ in cols]
    lp.col_lower_ = [0.0] * len(cols)
    lp.col_upper_ = [1.0] * len(cols)
    lp.row_lower_ = [-inf] * lp.num_row_
    lp.row_upper_ = [1.0] * len(job_row) + [float(capacity[t]) for t in sorted(capacity)]
    start, index, value = [0], [], []
    for job_id, t, _, gpus in cols:
        index += [job_row[job_id], type_row[t]]
        value += [1.0, float(gpus)]
        start.append(len(index))
    lp.a_matrix_.format_ = highspy.MatrixFormat.kColwise
    lp.a_matrix_.num_col_, lp.a_matrix_.num_row_ = lp.num_col_, lp.num_row_
    lp.a_matrix_.start_, lp.a_matrix_.index_, lp.a_matrix_.value_ = start, index, value
    lp.sense_ = highspy.ObjSense.kMaximize
    h = quiet_highs()
    h.setOptionValue("threads", 1)
    h.passModel(lp)
    h.run()
    if h.getModelStatus() != highspy.HighsModelStatus.kOptimal:
        log.warning("Gavel LP: HiGHS status %s", h.modelStatusToString(h.getModelStatus()))
        return None
    return [max(0.0, v) for v in h.getSolution().col_value]


def _greedy_fill(cols, capacity) -> list[float]:
    left = {t: float(c) for t, c in capacity.items()}
    by_job: dict[str, list[int]] = {}
    for k, (job_id, *_) in enumerate(cols):
        by_job.setdefault(job_id, []).append(k)
    values = [0.0] * len(cols)
    for ks in by_job.values():
        room = 1.0
        for k in sorted(ks, key=lambda k: -cols[k][2]):
            _, t, _, gpus = cols[k]
            v = min(room, left[t] / gpus)
            if v > _EPS_X:
                values[k], room, left[t] = v, room - v, left[t] - v * gpus
    return values


def _type_order(snapshot: Snapshot) -> list[str]:
    """GPU types in the order the cluster's nodes list them (Gavel: its cluster spec's order)."""
    seen: dict[str, None] = {}
    for n in snapshot.nodes:
        seen.setdefault(n.gpu_type, None)
    return list(seen)


def _advance(h: JobRounds | None, x_of: dict[str, float], ran_on: str | None) -> JobRounds:
    """A job's history after one more round, in which it ran on ``ran_on`` (None: it did not)."""
    h = h or JobRounds()
    received, deficit = dict(h.received), dict(h.deficit)
    if ran_on is not None:
        received[ran_on] = received.get(ran_on, 0) + 1
    for t in set(x_of) | set(deficit) | ({ran_on} if ran_on else set()):
        deficit[t] = deficit.get(t, 0.0) + x_of.get(t, 0.0) - (1.0 if t == ran_on else 0.0)
    return JobRounds(h.present + 1, tuple(sorted(received.items())), tuple(sorted(deficit.items())))
