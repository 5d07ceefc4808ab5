"""Profiling jobs: the batch script `slurm-ext profile` submits, and the daemon's
background profiling (Arena's disaggregated profiling) decided round by round.

Background profiling is opt-in (``background_profiling: true`` with a ``profile_db``).
When an elastic job's built-in model has not been profiled on a GPU type and a node of
that type sits idle, the daemon submits a short profiling job onto that one node, at the
lowest priority Slurm offers (``--nice``), named :data:`JOB_NAME` with the comment
:data:`BACKGROUND_COMMENT`. Its GPUs stay free in the policy's eyes: the moment the
policy places a job on that node, or an ordinary job waits for that GPU type, the
daemon cancels the profiling job (before the round's starts), and Slurm starts the user's
job as soon as the node is free. Everything here but the submission and the
cancellation, which the daemon does through its `SlurmClient`, is a pure function.
"""

from __future__ import annotations

import logging
import shlex
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace

from estimator.errors import SpecError
from slurm_ext.slurm_client import SlurmJob, SlurmNode, SubmitRequest

JOB_NAME = "slurm-ext-profile"
BACKGROUND_COMMENT = "slurm-ext background profile"
LOWEST_NICE = 2147483645  # sbatch's largest --nice: the lowest priority
log = logging.getLogger(__name__)

RETRY_AFTER_S = 3600.0  # a (model, type) whose profiling job failed waits this long


# The shortest time limit that leaves a minute of measuring beside starting JAX, the fit
# and the store's write (``measure_budget_s``).
MIN_PROFILE_MINUTES = 3


def measure_budget_s(time_limit_min: int) -> int:
    """Seconds the profiler may spend measuring in a job of this time limit: the rest is
    kept for starting JAX, the fit and the store's write, so a profile cut short by its
    limit still lands (whole tp degrees, the rest left to the roofline)."""
    return max(60, int(time_limit_min * 60 * 0.8) - 60)


def batch_script(python: str, argv: list[str], mpi: str | None) -> str:
    """The profiling job's batch script: one task per node, each running the profiler.

    Every argument is quoted for the shell (model names and paths come from users).
    """
    srun = ["srun", "--ntasks-per-node=1", "--kill-on-bad-exit=1"] + ([f"--mpi={mpi}"] if mpi else [])
    line = " ".join(shlex.quote(a) for a in srun + [python, "-m", "job_scripts.profile", *argv])
    return f"#!/bin/bash\n# slurm-ext profile: measure this partition's collectives and compute\nset -eu\nexec {line}\n"


def partition_layout(nodes: Iterable[SlurmNode], partition: str,
                     partitions_cfg: Mapping[str, str]) -> tuple[str, int, int]:
    """(GPU type, GPUs per node, nodes) of a partition, from Slurm's nodes and the config's
    partition → type map (else the nodes' GPU type, else the partition's name)."""
    from estimator.gpus import CATALOG
    members = [n for n in nodes if partition in n.partitions]
    if not members:
        raise SpecError("partition", partition, "Slurm has no nodes in it; see `sinfo -s`")
    types = sorted({n.gpu_type for n in members if n.gpu_type})
    if len(types) > 1 and partition not in partitions_cfg:  # Slurm may run it on any of them
        raise SpecError("partition", partition, f"its nodes have GPUs of several types ({', '.join(types)}): "
                                                "profile a partition of one type")
    gpu = partitions_cfg.get(partition) or (types[0] if types else None) \
        or (partition if partition in CATALOG else None)
    if gpu is None or gpu not in CATALOG:
        raise SpecError("partition", partition, f"its GPU type {gpu!r} is not in the catalog; map it in "
                                                f"the config's `partitions:` (e.g. {partition}: h100)")
    return gpu, min(n.gpus for n in members), len(members)


def is_background(job: SlurmJob) -> bool:
    return job.name == JOB_NAME and job.comment.startswith(BACKGROUND_COMMENT)


@dataclass(frozen=True)
class BackgroundJob:
    """A profiling job the daemon submitted: what it profiles and where."""

    job_id: int
    node: str
    gpu_type: str
    model: str


def parse_background(job: SlurmJob, part_types: Mapping[str, str]) -> BackgroundJob | None:
    """The daemon's own profiling job as a BackgroundJob (its model is kept in the job's
    comment as ``model=NAME``)."""
    if not is_background(job):
        return None
    model = next((t[len("model="):] for t in job.comment.split() if t.startswith("model=")), "")
    node = job.nodes[0] if job.nodes else ""
    return BackgroundJob(job.job_id, node, part_types.get(job.partition, job.partition), model)


def free_for_policy(nodes: tuple[SlurmNode, ...], background: Iterable[BackgroundJob],
                    jobs: Mapping[int, SlurmJob]) -> tuple[SlurmNode, ...]:
    """The nodes with the GPUs of running background profiling jobs counted as free, so
    the policy may place a job there (the daemon then cancels the profiling job)."""
    held: dict[str, int] = {}
    for b in background:
        j = jobs.get(b.job_id)
        if j is None or j.state != "RUNNING":
            continue
        for name, gpus in zip(j.nodes, j.granted_gpus_per_node or (j.gpus_per_node,) * len(j.nodes)):
            held[name] = held.get(name, 0) + gpus
    out = []
    for n in nodes:
        take = held.get(n.name, 0)
        if take:
            used = []
            for g in n.gres_used:
                if g.name == "gpu" and take:
                    cut = min(take, g.count)
                    take -= cut
                    g = replace(g, count=g.count - cut)
                used.append(g)
            n = replace(n, gres_used=tuple(used))
        out.append(n)
    return tuple(out)


def to_cancel(background: Iterable[BackgroundJob], placed_nodes: set[str], waiting_types: set[str],
              waiting_partitions: set[str] = frozenset(),
              node_partitions: Mapping[str, tuple[str, ...]] | None = None) -> list[BackgroundJob]:
    """Profiling jobs to cancel now: on a node the round's decision places a job on, of a
    GPU type an ordinary job waits for, or on a node of a partition one waits in (a
    partition of several types, or one of a job's several)."""
    parts = node_partitions or {}
    return [b for b in background if b.node in placed_nodes or b.gpu_type in waiting_types
            or waiting_partitions & set(parts.get(b.node, ()))]


def waiting_partitions(active: Iterable[SlurmJob]) -> set[str]:
    """The partitions ordinary jobs wait in (each of a job's comma-separated list)."""
    return {p for j in active if j.state == "PENDING" and not j.is_elastic and not is_background(j)
            and j.priority > 0 for p in j.partition.split(",") if p}


FAILED_STATES = ("FAILED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY")


def retry_after_failures(jobs: Iterable[SlurmJob], part_types: Mapping[str, str],
                         retry: Mapping[tuple[str, str], tuple[int | None, float]],
                         now_s: float, profiled: set[tuple[str, str]] | None = None
                         ) -> dict[tuple[str, str], tuple[int | None, float]]:
    """(model, GPU type) → (its newest failed profiling job, when it may be tried again):
    ``RETRY_AFTER_S`` after a failure first seen now. A pair that failed again after its
    wait gets a new wait (it had been resubmitted every round). A job that completed
    without timing its model (``profiled`` lacks the pair: its budget ran out first) failed
    too."""
    out = dict(retry)
    newest: dict[tuple[str, str], int] = {}
    for j in jobs:
        if not is_background(j):
            continue
        b = parse_background(j, part_types)
        if j.state in FAILED_STATES or (j.state == "COMPLETED" and profiled is not None
                                        and (b.model, b.gpu_type) not in profiled):
            newest[(b.model, b.gpu_type)] = max(j.job_id, newest.get((b.model, b.gpu_type), j.job_id))
    for pair, job_id in newest.items():
        if out.get(pair, (None, 0.0))[0] != job_id:
            out[pair] = (job_id, now_s + RETRY_AFTER_S)
    return out


@dataclass(frozen=True)
class BackgroundPlan:
    """One profiling job to submit."""

    node: str
    partition: str
    gpu_type: str
    gpus: int
    model: str


def profiled_pairs(profile_db: str, models: Iterable[str]) -> set[tuple[str, str]] | None:
    """(model, GPU type) pairs whose layers the store has timed (none when it is missing;
    None when it cannot be read: nothing is to be profiled into it meanwhile)."""
    from pathlib import Path

    from estimator.models import load_model
    from estimator.profile_store import cached_profile_view, model_fingerprint, store_version
    if not Path(profile_db).is_file():
        return set()
    try:  # read again only when the store changed: it is asked every round
        timed = {(gpu, fp) for gpu, fp, _, _ in cached_profile_view(store_version(profile_db)).layers}
    except SpecError as e:
        log.warning("background profiling paused: %s", e)
        return None
    prints = {m: model_fingerprint(load_model(m)) for m in models}
    return {(m, gpu) for m, fp in prints.items() for gpu, f in timed if f == fp}


def next_background(models: Iterable[str], profiled: set[tuple[str, str]], nodes: Iterable[SlurmNode],
                    part_types: Mapping[str, str], busy_nodes: set[str], waiting_types: set[str],
                    retry_after: Mapping[tuple[str, str], float], now_s: float,
                    waiting_in: set[str] = frozenset()) -> BackgroundPlan | None:
    """The (model, GPU type) pair to profile next on an idle node, or None.

    Args:
        models: built-in model names of the elastic jobs the daemon knows.
        profiled: (model, GPU type) pairs the store already has layer timings of.
        nodes: Slurm's nodes.
        part_types: partition → GPU type.
        busy_nodes: nodes the round's decision uses or holds.
        waiting_types: GPU types an ordinary job waits for.
        retry_after: pairs whose profiling failed → when they may be tried again.
        now_s: the round's time.
        waiting_in: partitions an ordinary job waits in: their nodes are left to it (a
            profiling job there would be cancelled next round, as ``to_cancel`` says).
    """
    idle: dict[str, tuple[SlurmNode, str]] = {}
    for n in sorted(nodes, key=lambda n: n.name):
        part = next((p for p in n.partitions if p in part_types), None)
        if part is None or n.gpus == 0 or n.gpus_free < n.gpus or n.name in busy_nodes \
                or waiting_in & set(n.partitions):
            continue
        t = part_types[part]
        if t not in waiting_types and t not in idle:
            idle[t] = (n, part)
    for model in sorted(set(models)):
        for t, (node, part) in sorted(idle.items()):
            if (model, t) in profiled or retry_after.get((model, t), 0.0) > now_s:
                continue
            return BackgroundPlan(node.name, part, t, node.gpus, model)
    return None


def background_request(plan: BackgroundPlan, python: str, profile_db: str, mpi: str | None,
                       time_limit_min: int, log_path: str) -> SubmitRequest:
    """The submission of one background profiling job: one node, lowest priority, its log
    at ``log_path`` (``%j``: the job id)."""
    argv = ["--profile-db", profile_db, "--gpu-type", plan.gpu_type, "--partition", plan.partition,
            "--model", plan.model, "--budget-s", str(measure_budget_s(time_limit_min))]
    return SubmitRequest(batch_script(python, argv, mpi), name=JOB_NAME, partition=plan.partition, nodes=1,
                         gres=f"gpu:{plan.gpus}", comment=f"{BACKGROUND_COMMENT} model={plan.model}",
                         requeue=False, time_limit_min=time_limit_min, output=log_path,
                         extra_args=(f"--nodelist={plan.node}", f"--nice={LOWEST_NICE}",
                                     "--exclusive"))
