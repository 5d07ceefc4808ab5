"""First come, first served: each job gets exactly what it asked for, in order, per GPU type.

What the Crius/Arena papers ran as their FCFS baseline: no scaling, no type change, no
preemption. Jobs wait in one FIFO queue per requested GPU type; the head of a queue that
does not fit blocks the jobs behind it (of that type only), unless it could not fit even
on an empty cluster. The Cell is the requested
type and count in the most local layout, with the stage count the estimator found
fastest there; placement is whole nodes first, then best fit.

A job that did not ask for a type or count (a "serverless" submission) takes the
fastest feasible Cell its estimates offer, in the queue of that Cell's type.

Decisions name only the jobs that start and each blocked queue head (with why it
waits); every other pending job is absent, i.e. stays queued behind its head.
"""

from __future__ import annotations

from estimator.cells import CellEstimate
from policy.interface import PENDING, Assignment, Decision, JobDecision, JobView, QueueOrder, Snapshot
from policy.placement import FreeGpus


def requested_estimate(job: JobView) -> CellEstimate | None:
    """The Cell to run for what the job asked for (type and/or count).

    The fastest feasible estimate that matches; when the estimator deems every match
    infeasible, the one-stage match anyway if the platform can run it (FCFS gives users
    what they ask for and does not second-guess them with a memory model); else None.
    """
    spec = job.spec
    best = fallback = None
    for e in job.estimates:
        if spec.gpu_type is not None and e.cell.gpu_type != spec.gpu_type:
            continue
        if spec.num_gpus is not None and e.cell.num_gpus != spec.num_gpus:
            continue
        if not e.feasible:
            if (spec.gpu_type is not None and spec.num_gpus is not None and e.cell.num_stages == 1
                    and job.can_run(e.cell)):
                fallback = e
            continue
        if best is None or (e.iteration_time_s, e.cell.num_stages) < (best.iteration_time_s, best.cell.num_stages):
            best = e
    return best or fallback


class FcfsPolicy:
    """FIFO per requested GPU type, requested count, no preemption.

    Args:
        strict_fifo: a blocked queue head blocks the jobs behind it (True, the papers'
            FCFS); False lets later, smaller jobs of the same type backfill.
    """

    name = "fcfs"
    plan_tuning = "full"
    extra_start_s = 0.0  # added to every (re)start by the simulator, beside the costs every policy pays
    extra_start_reason = "none: it starts jobs as they come, with nothing of its own to set up"

    def __init__(self, strict_fifo: bool = True):
        self.strict_fifo = strict_fifo

    def queue_order(self, snapshot: Snapshot) -> QueueOrder:
        """The waiting jobs in the order ``decide`` looks at them, each on what it asked
        for; a blocked head blocks its type unless ``strict_fifo`` is off."""
        out = []
        for job in snapshot.jobs:
            want = requested_estimate(job) if job.state == PENDING else None
            if want is not None:
                out.append((job.job_id, (want.cell,)))
        return QueueOrder(tuple(out), blocking=self.strict_fifo)

    def decide(self, snapshot: Snapshot) -> Decision:
        free = FreeGpus.from_snapshot(snapshot)
        empty = None  # every GPU free, made when a head does not fit
        types = set(free.by_type)
        blocked: set[str] = set()
        decisions: list[JobDecision] = []
        for job in snapshot.jobs:
            if job.state != PENDING:
                continue
            if blocked >= types:
                break
            if job.spec.gpu_type in blocked:
                continue  # cheap early skip: long queues are mostly behind a blocked head
            want = requested_estimate(job)
            if want is None:
                asked = f"{job.spec.num_gpus or 'any'} {job.spec.gpu_type or 'GPU'}"
                decisions.append(JobDecision(job.job_id, None, f"requested {asked} is not runnable here"))
                continue
            gtype = want.cell.gpu_type
            if gtype in blocked:
                continue
            placement = free.place(want.cell)
            if placement is None and empty is None:
                # A request that does not fit even on an empty cluster (its usable nodes)
                # never will while they are what there is, and must not block the jobs behind it.
                empty = FreeGpus([(n.name, n.gpu_type, n.total_gpus) for n in snapshot.nodes if n.usable])
            if placement is None and empty.place(want.cell) is None:
                decisions.append(JobDecision(
                    job.job_id, None, f"requested {want.cell.num_gpus} {gtype} ({want.cell.num_nodes} node(s) of "
                    f"{min(want.cell.gpus_per_node, want.cell.num_gpus)}) never fit here "
                    f"({empty.free_of_type(gtype)} {gtype} in all)"))
                continue
            if placement is None:
                if self.strict_fifo:
                    blocked.add(gtype)
                decisions.append(JobDecision(
                    job.job_id, None,
                    f"waiting for {want.cell.num_gpus} {gtype} ({free.free_of_type(gtype)} free)"))
                continue
            free.take(placement)
            decisions.append(JobDecision(job.job_id, Assignment(want.cell, placement),
                                         f"started on {want.cell.num_gpus} {gtype} as requested"))
        return Decision(tuple(decisions))
