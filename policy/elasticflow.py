"""ElasticFlow's count-scaling policy (throughput mode), as the Crius and Arena papers ran it.

ElasticFlow (ASPLOS'23) scales each job's GPU *count*; the GPU *type* stays what the job
asked for (it knows homogeneous GPUs only) and a job sees data-parallel performance only.
In throughput mode — deadlines set "long enough", the papers' "Improvement in CE" setting —
per GPU type:

1. **Minimum satisfactory share**: the smallest count on which the job runs (with
   ``deadline_aware=True``, the smallest that also finishes it by its deadline).
2. **Admission control** (FIFO): a pending job is admitted when the minimum shares of the
   running jobs and of every job admitted before it fit the type's GPUs; the first job that
   does not fit blocks the type's queue (the Arena baseline's rule).
3. **Resource allocation**: every admitted job starts from its minimum share; the remaining
   GPUs go, one doubling at a time, to the job with the largest *marginal throughput per
   added GPU* (diminishing returns make this greedy optimal for concave curves).

Jobs whose count does not change keep their nodes; the rest are placed largest first.
"""

from __future__ import annotations

import heapq
import logging

from estimator.cells import Cell
from policy._solver import RateTable, capacity_by_type, realize, requested_count
from policy.interface import Decision, JobView, Snapshot

log = logging.getLogger(__name__)


class ElasticFlowPolicy:
    """ElasticFlow: requested GPU type, GPU count scaled for maximum throughput.

    Args:
        min_gain_frac: a doubling must raise the job's throughput by this fraction.
        deadline_aware: size minimum shares by deadlines (ElasticFlow's deadline mode);
            off by default, the throughput mode the Crius and Arena papers compared with.
    """

    name = "elasticflow"
    extra_start_s = 0.0  # added to every (re)start by the simulator, beside the costs every policy pays
    extra_start_reason = ("none: its scaling curves come from the estimator, as ElasticFlow's come from "
                          "its offline profiles")

    def __init__(self, min_gain_frac: float = 0.0, deadline_aware: bool = False):
        self.min_gain_frac = min_gain_frac
        self.deadline_aware = deadline_aware

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
        # ``jobs`` is in submission order; a stable sort puts running jobs first.
        for job in sorted(jobs, key=lambda j: j.assignment is None):
            if job.assignment is None and blocked:
                continue  # behind a blocked head: stays queued (absent from the decision)
            m = _min_share(snapshot, job, tables[job.job_id], gtype, self.deadline_aware)
            if job.assignment is None and (m is None or m > left):
                blocked = m is not None
                wanted[job.job_id] = None
                reasons[job.job_id] = ("waiting: no count finishes it in time" if m is None
                                       else f"waiting: minimum share {m} {gtype} not free")
                continue
            if m is None:  # a running job keeps at least what it has
                m = job.cell.num_gpus
            share[job.job_id] = m
            left -= m
        # 3: doublings by marginal throughput per added GPU, best first (a heap of offers).
        rank = {j.job_id: k for k, j in enumerate(jobs)}
        offers: list[tuple] = []

        def offer(i: str) -> None:
            t, n = tables[i], share[i]
            m = next((c for c in t.counts(gtype) if c > n), None)
            if m is None:
                return
            cur, new = t.rate(gtype, n), t.rate(gtype, m)
            if new > cur * (1 + self.min_gain_frac):
                heapq.heappush(offers, (-(new - cur) / (m - n), n, rank[i], i, m))

        for i in share:
            offer(i)
        while offers and left > 0:
            _, n, _, i, m = heapq.heappop(offers)
            if m - n > left:  # never affordable again: what is left only shrinks
                continue
            left -= m - n
            share[i] = m
            offer(i)
        by_id = {j.job_id: j for j in jobs}
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
    """The smallest feasible count on ``gtype`` (that meets the deadline, in deadline mode)."""
    for n in table.counts(gtype):
        if job.deadline_s is None or not deadline_aware:
            return n
        e = table.options[(gtype, n)][0]
        finish = snapshot.now_s + snapshot.restart_cost_s + job.remaining_iterations * e.iteration_time_s
        if finish <= job.deadline_s:
            return n
    return None
