"""ElasticFlow's count-scaling policy (throughput mode), as the Crius and Arena papers ran it.

ElasticFlow (ASPLOS'23) scales each job's GPU *count*; the GPU *type* stays what the job
asked for (it knows homogeneous GPUs only) and a job sees data-parallel performance only.
In throughput mode — deadlines set "long enough", the papers' "Improvement in CE" setting —
per GPU type:

1. **Minimum satisfactory share**: the smallest count on which the job runs (with
   ``deadline_aware=True``, the smallest that also finishes it by its deadline).
2. **Admission control** (in submission order): a pending job is admitted when its minimum
   share fits beside the running jobs' and those admitted before it; one that does not fit
   is passed over, as in ElasticFlow's artifact (``blocking=True``: it blocks the type's
   queue, the Arena baseline's rule).
3. **Resource allocation**: every admitted job starts from its minimum share; the remaining
   GPUs go, one doubling at a time, to the job whose remaining run time the doubling
   shortens most per added GPU (diminishing returns make this greedy optimal for concave
   curves).

Jobs whose count does not change keep their nodes; the rest are placed largest first.

Checked against the paper and its artifact
------------------------------------------
Read: the paper's abstract only (its full text was not in the stored corpora); the artifact
github.com/pkusys/ElasticFlow, ``ElasticFlow/scheduler/``: ``scheduler.py``
(``ef_sim_jobs_access_control``, ``estimate_all_jobs``, ``ef_sim_allocation``,
``allocate_free_gpus``, ``get_marginal``), ``utils.py`` (``get_next_level``,
``get_allocation_time``, ``estimate_overhead``, ``align_to_time_slot``), ``jobs.py``
(``add_job``, ``run_all_jobs``), ``cluster.py`` (``elastic_placement``, ``release_job_res``),
``run_fig8a.sh``; and the Arena baseline this module follows, github.com/sjtu-epcc/arena
``baselines/elasticflow_sched.py``.

Matches:

- Count-only elasticity on one GPU type, data-parallel throughput curves at a fixed global
  batch (the artifact's ``THROUGHPUTS[model][global_batch][gpus]``).
- Every admitted job starts from its minimum share; the rest go one level at a time (the
  next profiled count, ``get_next_level``: 1, 2, 4, ... 64) to the best-ranked job, ranks
  recomputed after each step; a job whose next level does not fit is skipped.
- Shares are re-planned from the minimum at every decision, so running jobs shrink when
  others arrive (``estimate_all_jobs`` re-plans every runnable job at each event).
- Placement goes largest job first, as in ``ef_sim_jobs_access_control``.

Differences (ElasticFlow / here / whether our setting forces it):

- Minimum satisfactory share. EF: ``ef_sim_allocation`` plans each job over time against
  the future free GPUs (``future_free_gpus``), jobs in deadline order, filling backwards
  from the deadline in 60 s slots; a job with a loose deadline gets 0 GPUs now. Here: one
  count held from now (the smallest that runs, or that meets the deadline), no look-ahead
  at other jobs' future needs. Not forced: a simplification.
- Admission. EF: at an arrival all admitted jobs plus the newcomer are re-planned; a job
  whose deadline cannot be met is declined (dropped); no queue blocking. Here: in
  submission order per type, a job whose share does not fit is passed over (no blocking,
  as EF; ``blocking=True`` gives Arena's rule, its ``_ef_pending_jobs_restart_trial``).
  In deadline mode a waiting job that no count finishes by its deadline (however many
  GPUs were free) is declined before its first start, as EF declines it: its reason
  starts with ``DROPPED_PREFIX``, and the daemon runs it as submitted (one that has run
  gets its smallest count, best effort).
- Running jobs. EF: no priority for running jobs; jobs holding 0 GPUs rank first
  (``get_marginal`` sets them to sys.maxsize), in deadline order. Here: running jobs keep
  their minimum share before any pending job is admitted. Not forced.
- Ranking. EF artifact: ``marginal_gputime`` = change in the job's planned GPU-seconds to
  finish per added GPU (``get_allocation_time``), sorted descending. Arena: throughput gain
  of a doubling. Here: the job's remaining run time saved per added GPU, W (1 / r(n) −
  1 / r(m)) / (m − n) for W samples left, which like EF's weighs the gain by the job's
  remaining work and compares jobs of different models (raw samples/s would favour small
  ones; a relative speed-up per GPU, tried on 2026-11-26, starved large jobs: 17.7 h
  average JCT on philly_2week seed 0).
- Counts. EF: 1, 2, 4, ... up to a per-model cap (``get_max_gpu`` in ``add_job``, <= 64).
  Here: the counts of the job's feasible data-parallel Cells ({N/2, N, 2N} for a job that
  asked for N, else powers of two). Forced by Cells.
- GPU types. EF: homogeneous (one ``--gpu_type``). Here: each type allocated apart, a job
  on the type it asked for (else where its requested count is fastest), never moved to
  another type. Forced: heterogeneous cluster, and ElasticFlow has no type choice.
- Best-effort jobs. EF: ``best_effort=1`` sets the deadline to sys.maxsize; always
  admitted, served after the deadline jobs' shares. Here: a job without a deadline gets its
  smallest count and queues FIFO beside deadline jobs. Differs only in deadline mode.
- Non-improving levels. EF scales to the next level whatever its throughput; here a
  doubling must raise throughput (``min_gain_frac``). Minor.
- Events. EF: arrivals, completions and the plans' own scale events, merged into 60 s
  slots (``scheduling_slot``). Here: the simulator's arrivals, completions and 300 s rounds
  (no round length of its own: EF re-plans on events, not every slot).
- Restart cost. EF's simulator (``estimate_overhead``) charges every running job 2 s +
  2 (log2 n + 1) s at every scheduling event, changed or not (27 s more every 60th event).
  Here: ``extra_start_s`` = 0; the simulator charges its launch / resume and plan-search
  costs to jobs whose Cell changes, alike for every policy. Forced. EF's allocation ignores
  the cost, as this one does, but a resize costs 60 s or more here, not seconds.
- Placement. EF: ``elastic_placement``, buddy-style node sets by power-of-two free size,
  every job released and re-placed at each event, success assumed. Here: unchanged jobs
  keep their nodes; ``realize`` places the rest (whole nodes, then best fit); a share that
  cannot be placed waits. Shares are counted against the type's total GPUs.
- Profiling. Arena's baseline sets a 600 s profiling overhead per job, "referred to
  ElasticFlow's paper" (not checked: full text not found); here the estimator's curves are
  used and nothing is charged (``extra_start_reason``).
"""

from __future__ import annotations

import heapq
import logging

from estimator.cells import Cell
from policy._solver import RateTable, capacity_by_type, realize, requested_count
from policy.interface import DROPPED_PREFIX, Decision, JobView, Snapshot

log = logging.getLogger(__name__)


class ElasticFlowPolicy:
    """ElasticFlow: requested GPU type, GPU count scaled for maximum throughput.

    Args:
        min_gain_frac: a doubling must raise the job's throughput by this fraction.
        deadline_aware: size minimum shares by deadlines (ElasticFlow's deadline mode);
            off by default, the throughput mode the Crius and Arena papers compared with.
        blocking: a pending job whose minimum share is not free blocks the later jobs of
            its type (Arena's restatement); by default it is passed over and later jobs
            that fit are admitted, as ElasticFlow's artifact does.
    """

    name = "elasticflow"
    extra_start_s = 0.0  # added to every (re)start by the simulator, beside the costs every policy pays
    extra_start_reason = ("none: its scaling curves come from the estimator, as ElasticFlow's come from "
                          "its offline profiles")

    def __init__(self, min_gain_frac: float = 0.0, deadline_aware: bool = False, blocking: bool = False):
        self.min_gain_frac = min_gain_frac
        self.deadline_aware = deadline_aware
        self.blocking = blocking

    def decide(self, snapshot: Snapshot) -> Decision:
        """Admit by minimum share per GPU type, then double the best marginal gains."""
        capacity = capacity_by_type(snapshot)
        cache = snapshot.derived_cache()
        tables = {j.job_id: RateTable.of(j, True, cache) for j in snapshot.jobs}
        wanted: dict[str, Cell | None] = {}
        reasons: dict[str, str] = {}
        by_type: dict[str, list[JobView]] = {}
        for job in snapshot.jobs:
            gtype = job.cell.gpu_type if job.cell else _home_type(job, tables[job.job_id], capacity)
            if gtype is None:
                wanted[job.job_id] = None
                reasons[job.job_id] = "waiting: no feasible data-parallel Cell"
                continue
            by_type.setdefault(gtype, []).append(job)
        for gtype in sorted(by_type):
            self._allocate_type(snapshot, gtype, capacity.get(gtype, 0), by_type[gtype],
                                tables, wanted, reasons)
        rank = {j.job_id: k for k, j in enumerate(snapshot.jobs)}
        order = sorted(wanted, key=lambda i: (-(wanted[i].num_gpus if wanted[i] else 0), rank[i]))
        return realize(snapshot, wanted, reasons, order)

    def _allocate_type(self, snapshot, gtype, total_gpus, jobs, tables, wanted, reasons) -> None:
        # 1 + 2: minimum shares, running jobs first (they were admitted), then FIFO.
        share: dict[str, int] = {}
        left = total_gpus
        blocked = False
        # Busy with unmanaged jobs too, not down or drained ones.
        type_gpus = sum(n.total_gpus for n in snapshot.nodes if n.gpu_type == gtype and n.usable)
        # ``jobs`` is in submission order; a stable sort puts running jobs first.
        for job in sorted(jobs, key=lambda j: j.assignment is None):
            if job.assignment is None and blocked:
                continue  # behind a blocked head: stays queued (absent from the decision)
            m = _min_share(snapshot, job, tables[job.job_id], gtype, self.deadline_aware)
            if job.assignment is None and (m is None or m > left):
                # A head that cannot fit even in all the type's GPUs blocks nobody (as FCFS).
                blocked = self.blocking and m is not None and m <= type_gpus
                wanted[job.job_id] = None
                reasons[job.job_id] = (f"{DROPPED_PREFIX}: no GPU count finishes it by its deadline" if m is None
                                       else f"waiting: minimum share {m} {gtype} not free" if m <= type_gpus
                                       else f"waiting: minimum share {m} {gtype} never fits ({type_gpus} in all)")
                continue
            if m is None:  # a running job keeps at least what it has
                m = job.cell.num_gpus
            share[job.job_id] = m
            left -= m
        # 3: doublings by marginal gain per added GPU, best first (a heap of offers): the
        # job's remaining run time saved, as ElasticFlow ranks by the planned time a step
        # saves the job (raw samples/s would favour small models).
        rank = {j.job_id: k for k, j in enumerate(jobs)}
        by_id = {j.job_id: j for j in jobs}
        offers: list[tuple] = []

        def offer(i: str) -> None:
            t, n = tables[i], share[i]
            m = next((c for c in t.counts(gtype) if c > n), None)
            if m is None:
                return
            cur, new = t.rate(gtype, n), t.rate(gtype, m)
            if cur <= 0:  # a running count outside its data-parallel table: kept as it is
                return
            if new > cur * (1 + self.min_gain_frac):
                work = by_id[i].remaining_iterations * by_id[i].spec.global_batch  # samples left
                heapq.heappush(offers, (-work * (1.0 / cur - 1.0 / new) / (m - n), n, rank[i], i, m))

        for i in share:
            offer(i)
        while offers and left > 0:
            _, n, _, i, m = heapq.heappop(offers)
            if m - n > left:  # never affordable again: what is left only shrinks
                continue
            left -= m - n
            share[i] = m
            offer(i)
        for i, n in share.items():
            job = by_id[i]
            if job.cell is not None and job.cell.num_gpus == n:
                wanted[i] = job.cell
                continue
            opts = tables[i].options.get((gtype, n))
            if not opts:  # a running job whose count has no estimate: leave it as it is
                wanted[i] = job.cell
                continue
            wanted[i] = opts[0].cell
            reasons[i] = (f"{'started on' if job.cell is None else 'rescaled to'} "
                          f"{n} {gtype} (share of {total_gpus})")


def _home_type(job: JobView, table: RateTable, capacity: dict[str, int]) -> str | None:
    """The type the job asked for; without one, the type where its requested count is fastest."""
    if job.spec.gpu_type:
        return job.spec.gpu_type if table.counts(job.spec.gpu_type) else None
    n = requested_count(job, table)
    rated = [(table.rate(t, n), t) for t in sorted(capacity) if table.rate(t, n) > 0]
    if not rated:
        rated = [(table.rate(t, c), t) for (t, c) in table.options]
    return max(rated)[1] if rated else None


def _min_share(snapshot: Snapshot, job: JobView, table: RateTable, gtype: str,
               deadline_aware: bool) -> int | None:
    """The smallest feasible count on ``gtype`` (that meets the deadline, in deadline mode;
    for a waiting job that has run and none does, the smallest: it runs best effort)."""
    counts = table.counts(gtype)
    for n in counts:
        if job.deadline_s is None or not deadline_aware:
            return n
        e = table.options[(gtype, n)][0]
        finish = snapshot.now_s + snapshot.restart_cost_s + job.remaining_iterations * e.iteration_time_s
        if finish <= job.deadline_s:
            return n
    return counts[0] if counts and job.has_run and job.assignment is None else None


class ElasticFlowBlockingPolicy(ElasticFlowPolicy):
    """ElasticFlow as the Arena paper restated it: a pending job whose minimum share does
    not fit blocks the later jobs of its type (no starvation of large jobs, at the cost of
    idle GPUs while the head waits)."""

    name = "elasticflow-blocking"

    def __init__(self, min_gain_frac: float = 0.0, deadline_aware: bool = False, blocking: bool = True):
        super().__init__(min_gain_frac, deadline_aware, blocking)
