"""The Slurm client interface: what the daemon reads from Slurm and what it asks of it.

Backends implement `SlurmClient`: the CLI backend in `slurm_ext.cli_backend`, the pyslurm
backend in `slurm_ext.pyslurm_backend` (`slurm_ext.backend.make_client` picks one). Jobs and nodes cross module boundaries as the
frozen dataclasses below; numbers carry their units in their names.

Slurm 22.05 cannot change a pending job's GPU *type*, so elastic jobs carry an untyped
GPU count and the type is chosen by partition (one partition per GPU type).
"""

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from estimator.contract import is_elastic

# Job states as Slurm names them (base state, without flags).
PENDING = "PENDING"
RUNNING = "RUNNING"
SUSPENDED = "SUSPENDED"
COMPLETING = "COMPLETING"
COMPLETED = "COMPLETED"
CANCELLED = "CANCELLED"
FAILED = "FAILED"
TIMEOUT = "TIMEOUT"
NODE_FAIL = "NODE_FAIL"
PREEMPTED = "PREEMPTED"
OUT_OF_MEMORY = "OUT_OF_MEMORY"
BOOT_FAIL = "BOOT_FAIL"
DEADLINE = "DEADLINE"
REQUEUED = "REQUEUED"  # appears as a flag or, briefly, as the state itself
# A job that ended: Slurm keeps it listed for MinJobAge, and never runs it again. Any
# other state (and the flags squeue shows in its place: RESV_DEL_HOLD, EXPEDITING, ...,
# some newer than the code) is a job still queued or running.
TERMINAL_STATES = frozenset({"COMPLETE", COMPLETED, CANCELLED, FAILED, TIMEOUT, NODE_FAIL, PREEMPTED,
                             OUT_OF_MEMORY, BOOT_FAIL, DEADLINE, "REVOKED"})
ACTIVE_STATES = frozenset({PENDING, RUNNING, SUSPENDED, COMPLETING, "CONFIGURING",
                           "REQUEUE_HOLD", "REQUEUE_FED", "RESIZING", "SIGNALING", "EXPEDITING",
                           "STAGE_OUT", "STOPPED", REQUEUED, "SPECIAL_EXIT", "RESV_DEL_HOLD"})

# A held job waits in one of these states with one of these reasons (or priority 0).
# A job requeued held by RequeueExitHold shows as SPECIAL_EXIT, `requeuehold` as
# REQUEUE_HOLD, until Slurm moves it back to PENDING.
HELD_STATES = frozenset({PENDING, "SPECIAL_EXIT", "REQUEUE_HOLD", "RESV_DEL_HOLD"})
HELD_REASONS = frozenset({"JobHeldUser", "JobHeldAdmin"})
# States of a job requeued held after a rescale signal (exit 86).
HELD_FOR_RESCALE = frozenset({"SPECIAL_EXIT", "REQUEUE_HOLD"})

# Release a requeued job only this long after it was first seen requeued. When a run ends,
# each of its nodes revokes the job's credentials as of that second, and refuses any
# credential issued in the same second: a run started then fails at once ("Job credential
# revoked", state FAILED, not requeued). Slurm's own 121 s BeginTime after a requeue exists
# for this; with ``StartTime=now`` the caller must wait past the second itself.
REQUEUE_SETTLE_S = 1.1


@dataclass(frozen=True)
class Gres:
    """One generic resource entry, e.g. ``gpu:a100:4`` (type None when untyped)."""

    name: str
    type: str | None
    count: int

    def __str__(self) -> str:
        return ":".join([self.name] + ([self.type] if self.type else []) + [str(self.count)])


@dataclass(frozen=True)
class SlurmJob:
    """A job as Slurm reports it (one element of an array is one job).

    Attributes:
        job_id: Slurm's job id (array elements have their own id).
        user: the owner's user name ('' when Slurm did not say).
        account: the job's account ('' when none).
        qos: the job's QOS ('' when none).
        name: the job name.
        state: base state, e.g. ``PENDING``, ``RUNNING`` (see the constants above).
        state_flags: extra state flags Slurm reported (``REQUEUED``, ``COMPLETING``, ...).
        reason: why it waits (``Priority``, ``JobHeldUser``, ...), '' when it does not.
        partition: the partition (comma-separated list when several were given).
        comment: the user's comment (``elastic ...`` marks an elastic job).
        admin_comment: the admin comment (where the daemon keeps its plan).
        gpus_per_node: GPUs requested per node (0 if none).
        gpu_type_requested: GPU type in the request (``gpu:a100:4``), None if untyped.
        gpus_per_job: GPUs requested per job (``--gpus``), 0 if none.
        granted_gpus_per_node: for a running job, GPUs granted on each of its nodes.
        granted_gpu_type: for a running job, the GPU type granted (from gres_detail).
        nodes: the nodes it runs on (or was scheduled on), expanded names.
        node_count: nodes requested (pending) or allocated (running).
        restart_count: how many times it was requeued.
        submit_time_s, start_time_s, end_time_s: epoch seconds, 0 when unknown.
        priority: 0 means held.
        batch: it has a batch script (sbatch).
        requeue: it may be requeued.
        array_job_id, array_task_id: set for array elements.
        array_task_spec: for an array whose tasks have not started, the tasks still to
            run (``0-7%2``); '' otherwise.
        exit_code: the batch script's exit status of its last run once a run has ended
            (None before; 128 + N for a death by signal N).
    """

    job_id: int
    user: str
    name: str
    state: str
    reason: str = ""
    partition: str = ""
    comment: str = ""
    admin_comment: str = ""
    gpus_per_node: int = 0
    gpu_type_requested: str | None = None
    gpus_per_job: int = 0
    granted_gpus_per_node: tuple[int, ...] = ()
    granted_gpu_type: str | None = None
    nodes: tuple[str, ...] = ()
    node_count: int = 0
    restart_count: int = 0
    submit_time_s: int = 0
    start_time_s: int = 0
    end_time_s: int = 0
    priority: int = 0
    batch: bool = True
    requeue: bool = False
    array_job_id: int | None = None
    array_task_id: int | None = None
    exit_code: int | None = None
    state_flags: tuple[str, ...] = ()
    array_task_spec: str = ""
    account: str = ""
    qos: str = ""

    @property
    def is_elastic(self) -> bool:
        """The job asked for elastic scheduling (its comment's first word is ``elastic``,
        as the job spec and the submit hook read it: ``elasticsearch ...`` is not)."""
        return is_elastic(self.comment)

    @property
    def is_pending(self) -> bool:
        return self.state == PENDING

    @property
    def is_running(self) -> bool:
        return self.state == RUNNING

    @property
    def is_active(self) -> bool:
        """Still queued, running or about to run (not finished)."""
        return bool(self.state) and self.state not in TERMINAL_STATES

    @property
    def is_held(self) -> bool:
        """Pending and held (by the user, an admin, job_submit.lua or a requeue-hold)."""
        return self.state in HELD_STATES and (self.reason in HELD_REASONS or self.priority == 0)

    @property
    def granted_gpus(self) -> int:
        """GPUs the running job holds, over all its nodes."""
        return sum(self.granted_gpus_per_node)


@dataclass(frozen=True)
class SlurmNode:
    """A node as Slurm reports it.

    Attributes:
        name: node name.
        state: base state, lower-case as sinfo prints it (``idle``, ``mixed``,
            ``allocated``, ``down``, ``drained``, ``draining``, ...).
        state_flags: extra flags (``DRAIN``, ``NOT_RESPONDING``, ...), upper-case.
        partitions: partitions the node belongs to.
        features: active features (``a100``).
        gres: configured generic resources.
        gres_used: generic resources in use.
        cpus: CPUs configured.
        real_memory_mb: memory configured, MB.
    """

    name: str
    state: str
    partitions: tuple[str, ...] = ()
    features: tuple[str, ...] = ()
    gres: tuple[Gres, ...] = ()
    gres_used: tuple[Gres, ...] = ()
    cpus: int = 0
    real_memory_mb: int = 0
    state_flags: tuple[str, ...] = ()

    @property
    def gpus(self) -> int:
        """GPUs configured on the node."""
        return sum(g.count for g in self.gres if g.name == "gpu")

    @property
    def gpus_used(self) -> int:
        """GPUs allocated to jobs."""
        return sum(g.count for g in self.gres_used if g.name == "gpu")

    @property
    def gpus_free(self) -> int:
        """GPUs a new job could be given: none on a node that is not usable, or whose CPUs
        are all allocated (state ``allocated``; a job needs CPUs beside its GPUs)."""
        if not self.is_usable or self.state == "allocated":
            return 0
        return max(0, self.gpus - self.gpus_used)

    @property
    def gpu_type(self) -> str | None:
        """The (first) GPU type of the node, None if it has no typed GPUs."""
        for g in self.gres:
            if g.name == "gpu" and g.type:
                return g.type
        return None

    @property
    def is_usable(self) -> bool:
        """Up or powered down, and schedulable (not down, drained, failing or not responding)."""
        # A node power saving turned off (``idle~``, POWERED_DOWN) is usable: Slurm powers
        # it up for a job given it. One being turned off (POWER_DOWN, POWERING_DOWN) is not.
        # Slurm 22.05 and 23.11+ spell some flags apart (``maint``/``MAINTENANCE``,
        # ``reboot``/``REBOOT_REQUESTED``, ``inval``/``INVALID_REG``): both are here.
        bad = {"down", "drained", "draining", "drain", "fail", "failing", "future",
               "unknown", "inval", "invalid_reg", "maint", "maintenance", "reboot", "reboot_requested",
               "reboot_issued", "power_down", "powering_down"}
        flags = {f.lower() for f in self.state_flags}
        return self.state not in bad and not flags & (bad | {"not_responding"})


@dataclass(frozen=True)
class JobUpdate:
    """Changes to a pending job (None: leave as it is).

    Attributes:
        partition: the new partition (with one partition per GPU type, this picks the type).
        gpus_per_node: untyped GPU count per node (``gres=gpu:N``).
        num_nodes: exact node count (written as ``NumNodes=N-N``).
        admin_comment: the new admin comment (the plan).
        required_nodes: the nodes it must run on (the policy's placement), in order.
        gpu_type: with ``gpus_per_node``, a typed GPU request (``gres=gpu:a100:4``), which
            steers the job to that type inside a mixed partition; Slurm 23.02.6 and later
            only (22.05 refuses to retype a pending job).
        features: the job's node features (constraint), e.g. ``a100``: steering by node
            features on Slurm 22.05; '' clears them.
        cpus_per_gpu: CPUs per GPU (``CpusPerTres``), from the chosen Cell's nodes.
        mem_per_gpu_mb: host memory per GPU, MB (``MemPerTres``), from the Cell's plan.
        start_now: set ``StartTime=now`` so a requeued job does not wait the 121 s
            Slurm adds after a requeue (release it no sooner than ``REQUEUE_SETTLE_S``
            after it was seen requeued).
        clear_gpus_per_job: with ``gpus_per_node``, drop the job's GPU count per job
            (``sbatch --gpus=N``): Slurm refuses a count per node beside one that
            disagrees ("Invalid generic resource (gres) specification").
    """

    partition: str | None = None
    gpus_per_node: int | None = None
    num_nodes: int | None = None
    admin_comment: str | None = None
    required_nodes: tuple[str, ...] | None = None
    gpu_type: str | None = None
    features: str | None = None
    cpus_per_gpu: int | None = None
    mem_per_gpu_mb: int | None = None
    start_now: bool = True
    clear_gpus_per_job: bool = False


@dataclass(frozen=True)
class SubmitRequest:
    """A batch job to submit (used by tests and the demo; users submit with sbatch).

    Attributes:
        script: the batch script's text (starts with ``#!``).
        name: job name.
        partition: partition, or None for the default.
        nodes: node count, or None.
        gres: e.g. ``gpu:a100:4`` (per node), or None.
        comment: e.g. ``elastic model=gpt-1.3b``.
        hold: submit held.
        requeue: allow requeue (None: Slurm's default).
        time_limit_min: time limit in minutes, or None.
        output: path of the job's stdout/stderr file, or None for Slurm's default.
        workdir: working directory, or None for the caller's.
        extra_args: further sbatch options, one argument each.
    """

    script: str
    name: str = "slurm-ext"
    partition: str | None = None
    nodes: int | None = None
    gres: str | None = None
    comment: str | None = None
    hold: bool = False
    requeue: bool | None = None
    time_limit_min: int | None = None
    output: str | None = None
    workdir: str | None = None
    extra_args: tuple[str, ...] = field(default=())


@runtime_checkable
class SlurmClient(Protocol):
    """What slurm-ext needs from Slurm. Every method raises a `SlurmExtError` subclass
    (with the command's stderr for the CLI backend) when Slurm refuses or does not answer.
    """

    def jobs(self) -> tuple[SlurmJob, ...]:
        """All jobs Slurm knows (including recently finished ones)."""
        ...

    def job(self, job_id: int) -> SlurmJob | None:
        """One job, or None if Slurm no longer knows it."""
        ...

    def nodes(self) -> tuple[SlurmNode, ...]:
        """All nodes."""
        ...

    def update_pending(self, job_ids: int | Sequence[int], update: JobUpdate) -> None:
        """Change pending jobs' partition, GPUs per node, node count, admin comment: one
        job or several, with one call to Slurm where it takes one (a node count it changes
        one job at a time).

        The admin comment alone (``start_now=False``) may also be changed on a running job.
        Raises when Slurm refused any of them; the others may have changed.
        """
        ...

    def hold(self, job_ids: int | Sequence[int]) -> None:
        """Hold pending jobs (admin hold: the owner cannot release it); raises if any was refused."""
        ...

    def release(self, job_ids: int | Sequence[int]) -> None:
        """Release held jobs; raises if any was refused."""
        ...

    def signal_batch(self, job_ids: int | Sequence[int], signal: str = "USR1") -> None:
        """Send a signal to the batch scripts' processes only (the trainers checkpoint);
        raises if any was refused."""
        ...

    def requeue_hold(self, job_id: int) -> None:
        """Requeue a running job and hold it (fallback when it ignores the signal)."""
        ...

    def batch_script(self, job_id: int) -> str:
        """The job's batch script text."""
        ...

    def cancel(self, job_id: int) -> None:
        """Cancel a job."""
        ...

    def pending_elastic_job_ids(self) -> list[int]:
        """Ids of the pending jobs whose comment asks for elastic scheduling, ascending, from
        a cheap listing (polled between rounds to notice arrivals)."""
        ...

    def submit(self, request: SubmitRequest) -> int:
        """Submit a batch job; return its job id."""
        ...

    def reserved_nodes(self, name: str) -> tuple[str, ...] | None:
        """The nodes of reservation ``name``, or None when there is none."""
        ...

    def slurm_version(self) -> tuple[int, int, int]:
        """The Slurm version the cluster's commands report (e.g. (25, 11, 7))."""
        ...

    def hold_nodes(self, name: str, nodes: Sequence[str]) -> None:
        """Make reservation ``name`` hold exactly ``nodes`` (none: no reservation): from
        now on, for root only, so no other job starts there; jobs running there go on.
        Idempotent."""
        ...


__all__ = [
    "ACTIVE_STATES", "Gres", "JobUpdate", "SlurmClient", "SlurmJob", "SlurmNode",
    "SubmitRequest", "PENDING", "RUNNING", "COMPLETED", "CANCELLED", "FAILED",
]

