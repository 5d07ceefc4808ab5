"""Slurm's reasons for keeping a released job back: which ones its Cell can change.

The daemon releases a job onto a Cell and Slurm starts it when it can. While it waits,
its reason says whether the Cell itself is the trouble:

- a reason Slurm never gets past (``STUCK_REASONS``) or a limit on one job's size
  (``QOSMaxGRESPerJob``): the job is decided afresh, on fewer GPUs;
- a limit on the total of the job's user, account or QOS (``QOSMaxGRESPerUser``,
  ``AssocGrpGRES``) while the job's group runs other jobs: those end, the job then starts
  as it is, so it waits on its own condition;
- the same limit when nothing else of the group has run for a while: the job's Cell alone
  is over it, and it never starts as it is (``sole_under_group_limit``).

Pure functions over Slurm's jobs and the journal's entries; the daemon keeps the little
memory ``sole_under_group_limit`` needs between rounds.
"""

from __future__ import annotations

from slurm_ext.observe import is_held, last_release, plan_comment
from slurm_ext.slurm_client import COMPLETING, RUNNING, SUSPENDED, SlurmJob

# Slurm will never start a released job as planned (it is decided afresh).
STUCK_REASONS = frozenset({"BadConstraints", "PartitionNodeLimit", "PartitionConfig",
                           "InvalidQOS", "PartitionDown", "PartitionInactive"})
# Slurm keeps a released job back for a condition of its own: a dependency, a begin time,
# an association or QOS limit (``AssocGrpGRES``, ``QOSMaxGRESPerUser``, ...).
OWN_CONDITION_REASONS = frozenset({"Dependency", "DependencyNeverSatisfied", "BeginTime"})

# A released job Slurm says will never start as it is (``STUCK_REASONS``, a per-job limit)
# is decided afresh; so is one still waiting after LAUNCH_TIMEOUT_ROUNDS rounds (at least
# LAUNCH_TIMEOUT_MIN_S).
LAUNCH_TIMEOUT_ROUNDS = 3
LAUNCH_TIMEOUT_MIN_S = 60.0
# Slurm's scheduler evaluates a pending job at least this often (sched_interval, 60 s by
# default; backfill every 30 s): a per-job limit's reason is the current Cell's only then.
PER_JOB_LIMIT_SETTLE_S = 60.0

# Words of a limit reason that is not about how many resources are held at once: job
# counts (``QOSMaxJobsPerUserLimit``), time (``AssocGrpWallLimit``, ``QOSGrpGRESMinutes``,
# ``QOSGrpGRESRunMinutes``). Those clear with time or are not the Cell's to change.
_NOT_A_SIZE = ("Jobs", "Submit", "Wall", "Minutes")
# States in which a job holds its resources against its group's limits.
_HOLDING_STATES = frozenset({RUNNING, SUSPENDED, COMPLETING, "CONFIGURING"})


def per_job_limit(job: SlurmJob) -> bool:
    """Kept back by a limit on one job's size (``QOSMaxGRESPerJob``, ``AssocMaxNodesPerJob``,
    ``QOSMaxGRESPerNode`` ...; not its time): its Cell never starts, whatever frees up."""
    r = job.reason
    return r.startswith(("Assoc", "QOS")) and "Max" in r and ("PerJob" in r or "PerNode" in r) and "Wall" not in r


def group_limit(job: SlurmJob) -> str | None:
    """The group whose total a size limit keeping ``job`` back counts: ``"user"``
    (``QOSMaxGRESPerUser``), ``"account"`` (``AssocGrpGRES``, ``QOSMaxGRESPerAccount``),
    ``"qos"`` (``QOSGrpGRES``);
    None when its reason is no such limit (a per-job limit, a job count, a time)."""
    r = job.reason
    if any(word in r for word in _NOT_A_SIZE):
        return None
    if r.startswith("QOSMax") and "PerUser" in r:
        return "user"
    if r.startswith("AssocGrp") or r.startswith("QOSMax") and "PerAccount" in r:
        return "account"
    if r.startswith("QOSGrp"):
        return "qos"
    return None


def shares_group(job: SlurmJob, other: SlurmJob, group: str) -> bool:
    """``other`` counts against the limit on ``job``'s ``group``. A QOS's total counts the
    jobs of its partitions too (the limit may be the partition's QOS); an account's counts
    only that account's jobs, as Slurm reports no parent accounts."""
    if group == "user":
        return other.user == job.user
    if group == "account":
        return other.account == job.account
    parts = set(job.partition.split(","))
    return other.qos == job.qos or bool(parts & set(other.partition.split(",")))


def holds_resources(job: SlurmJob) -> bool:
    """Running, suspended or completing: its resources count against its limits."""
    return job.state in _HOLDING_STATES or COMPLETING in job.state_flags


def sole_under_group_limit(jobs: list[SlurmJob], shared_s: dict[int, float],
                           now_s: float) -> tuple[frozenset[int], dict[int, float]]:
    """Pending jobs kept back by a limit on their group's total while nothing else of the
    group has held resources for ``PER_JOB_LIMIT_SETTLE_S``: their Cell alone is over the
    limit, which for them is a per-job limit. (Slurm's reason may lag a job of the group
    that just ended: the settling time lets it look again.)

    ``shared_s`` holds, per such job, when another job of its group was last seen holding
    resources (a job first seen is counted as sharing then); returns the jobs and the
    memory for the next round.
    """
    holders = [j for j in jobs if holds_resources(j)]
    sole, seen = set(), {}
    for job in jobs:
        group = group_limit(job) if job.state == "PENDING" else None
        if group is None:
            continue
        shared = any(o.job_id != job.job_id and shares_group(job, o, group) for o in holders)
        seen[job.job_id] = now_s if shared else shared_s.get(job.job_id, now_s)
        if now_s - seen[job.job_id] >= PER_JOB_LIMIT_SETTLE_S:
            sole.add(job.job_id)
    return frozenset(sole), seen


def limit_of_its_cell(job: SlurmJob, sole: frozenset[int] = frozenset()) -> bool:
    """Kept back by a limit its Cell alone is over: a per-job limit, or a group's
    (``sole``: the jobs ``sole_under_group_limit`` found alone in theirs)."""
    return per_job_limit(job) or job.job_id in sole


def waits_on_its_own_condition(job: SlurmJob, sole: frozenset[int] = frozenset()) -> bool:
    """Released, and kept back by Slurm for the job's own condition, not for GPUs: it holds
    none meanwhile, and it is not decided afresh (and released again) while it waits."""
    return job.reason in OWN_CONDITION_REASONS or (
        job.reason.startswith(("Assoc", "QOS")) and job.reason not in STUCK_REASONS
        and not limit_of_its_cell(job, sole))


def kept_back_by_slurm(job: SlurmJob, sole: frozenset[int] = frozenset()) -> bool:
    """Released onto a Cell, pending, and kept back by Slurm for its own condition."""
    return job.state == "PENDING" and not is_held(job) and plan_comment(job.admin_comment).cell is not None \
        and waits_on_its_own_condition(job, sole)


def over_per_job_limit(job: SlurmJob, entries, now_s: float, sole: frozenset[int] = frozenset()) -> bool:
    """Slurm keeps the job back for a limit its current Cell alone is over
    (``limit_of_its_cell``): Slurm keeps a pending job's reason through an update until its
    scheduler looks at the job again (at least every minute, ``PER_JOB_LIMIT_SETTLE_S``),
    so a reason seen sooner after the last start or release may be the previous Cell's."""
    if not limit_of_its_cell(job, sole):
        return False
    last = last_release(entries)
    return last is None or now_s - max(last.created_s, last.updated_s) >= PER_JOB_LIMIT_SETTLE_S


def launch_is_stale(job: SlurmJob, entries, now_s: float, interval_s: float,
                    sole: frozenset[int] = frozenset()) -> bool:
    """A released job Slurm will not start as planned: Slurm says it never will
    (``STUCK_REASONS``, a limit met by its current Cell alone: ``over_per_job_limit``),
    or it has waited more than ``LAUNCH_TIMEOUT_ROUNDS`` rounds for GPUs the policy thought
    were free, counted from its release in the journal ``entries``: the entry's close (a
    rescale's comes after its checkpoint). A job the journal has no release of (a state
    file made anew, a job released by hand) is stale too: nothing says Slurm is about to
    start it."""
    if job.reason in STUCK_REASONS or over_per_job_limit(job, entries, now_s, sole):
        return True
    last = last_release(entries)
    limit_s = max(LAUNCH_TIMEOUT_MIN_S, LAUNCH_TIMEOUT_ROUNDS * interval_s)
    return last is None or now_s - max(last.created_s, last.updated_s) > limit_s
