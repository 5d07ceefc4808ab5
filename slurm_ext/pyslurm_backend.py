"""The pyslurm backend of `SlurmClient`: Slurm's C API through pyslurm 25.11 (no commands).

Reads come from one ``slurm_load_jobs`` / ``slurm_load_node`` RPC each and are turned into
the records ``squeue --json`` / ``sinfo --json`` print, so `slurm_ext.slurm_parse` gives
both backends the same `SlurmJob` and `SlurmNode` (parity by construction, checked by the
integration tests that run on both). Actions are RPCs on ``pyslurm.Job``.

Where pyslurm cannot do a thing, this backend runs the command the CLI backend runs:

- a pending job's **node count**: ``JobSubmitDescription`` writes ``min_nodes`` only when
  submitting, never in an update, so ``NumNodes`` goes through ``scontrol update``; so
  does **clearing its node features** (pyslurm sends an empty constraint as unset, which
  Slurm reads as no change), and clearing a GPU count **per job** (``sbatch --gpus=N``),
  which Slurm refuses beside the count per node the daemon sets;
- a job's **GPU request** (``tres_per_job``, ``tres_per_node``): pyslurm 25.11.2 reads TRES
  strings as ``name=count``, and Slurm writes ``--gpus=6`` as ``gres/gpu:6``, so it reads
  nothing of it; it reads ``--gres=gpu:a100`` (a type, no count) as nothing too, a job of
  no GPUs. One cheap ``squeue -O JobID,tres-per-node,tres-per-job`` listing gives both raw
  strings, as the CLI backend reads them;
- **submitting** (tests and the demo; users submit with sbatch, the daemon never does):
  a ``JobSubmitDescription`` is not what sbatch sends. It fixes the task count (a job
  submitted on one node then cannot be moved to two: "Resources" for ever), it drops the
  message job_submit.lua gives a refused submission ("Unspecified error"), and it has no
  parser for sbatch's options (`SubmitRequest.extra_args`). So submissions go through sbatch.

pyslurm reads ``SLURM_CONF`` from the process environment when it is first imported, so
the client sets it (from ``env``) before that import; one process talks to one cluster.
Slurm ends the importing process when it finds no configuration (``fatal: Could not
establish a configuration source``; a ``SLURM_CONF`` that names no file is first retried
for a minute), so the first import is tried in a child process (`check_importable`) and
its failure becomes a one-line error.
"""

import logging
import os
import sys
import time
from collections.abc import Mapping, Sequence

from slurm_ext.cli_backend import (
    CliSlurmClient, _admin_comment, _id_list, _job_id, _name, _node_list, _positive, job_listing_argv,
    reservation_change, retry_stale_errno, signal_batch_argv,
)
from slurm_ext.errors import (
    CommandNotFoundError, CommandTimeoutError, SlurmArgumentError, SlurmCommandError, SlurmExtError, SlurmParseError,
)
from slurm_ext.slurm_client import ACTIVE_STATES, JobUpdate, SlurmJob, SlurmNode, SubmitRequest
from slurm_ext.run import run_command
from slurm_ext.slurm_install import SlurmInstall
from slurm_ext.slurm_parse import expand_hostlist, is_elastic, is_number, listing_records, parse_job, parse_node

log = logging.getLogger(__name__)

RAW_TRES_FIELDS = ("JobID", "tres-per-node", "tres-per-job")
# pyslurm takes no "unlimited" duration: ten years, in minutes.
RESERVATION_DURATION_MIN = 10 * 365 * 24 * 60
# Job states (as pyslurm names them) in which a job holds its nodes' resources.
HOLDING_STATES = frozenset({"RUNNING", "SUSPENDED", "COMPLETING", "CONFIGURING", "SIGNALING",
                            "STAGE_OUT", "RESIZING"})


class PyslurmUnavailable(SlurmExtError):
    """pyslurm is not installed, or was built for another Slurm than the one configured."""


IMPORT_PROBE = "try:\n import pyslurm\nexcept ImportError as e:\n print(e)\n raise SystemExit(3)\n"
IMPORT_PROBE_TIMEOUT_S = 90.0  # Slurm retries an unreadable configuration for 60 s


def check_importable(environ: Mapping[str, str]) -> None:
    """Import pyslurm in a child process with ``environ`` first: Slurm's library ends the
    process that imports it without a configuration, so a parent learns it here.

    Where the child cannot be started, the import is left to the caller.

    Raises:
        PyslurmUnavailable: ``SLURM_CONF`` names no file, pyslurm is not installed, or
            Slurm found no configuration (its own last line of error).
    """
    conf = environ.get("SLURM_CONF")
    if conf is not None and not os.path.isfile(conf):
        raise PyslurmUnavailable(f"SLURM_CONF={conf} is not a file: set it to the cluster's "
                                 "slurm.conf, or set slurm_backend: cli")
    try:
        probe = run_command([sys.executable, "-c", IMPORT_PROBE], IMPORT_PROBE_TIMEOUT_S, env=environ,
                            check=False)
    except CommandTimeoutError:
        raise PyslurmUnavailable(f"importing pyslurm took over {IMPORT_PROBE_TIMEOUT_S:.0f} s "
                                 "(Slurm could not reach its configuration)") from None
    except CommandNotFoundError as e:  # this interpreter cannot be started again (e.g. its
        log.debug("pyslurm import not tried first: %s", e)  # path not traversable for this user)
        return
    if probe.returncode == 3:
        raise ImportError(probe.stdout.strip())
    if probe.returncode != 0:
        lines = [line.strip() for line in probe.stderr.splitlines() if line.strip()]
        why = next((line for line in reversed(lines) if "fatal" in line), lines[-1] if lines else
                   f"exit status {probe.returncode}")
        raise PyslurmUnavailable(f"pyslurm cannot load Slurm ({why}); set SLURM_CONF to the "
                                 "cluster's slurm.conf, or set slurm_backend: cli")


def _comment(job) -> str:
    """A loaded job's comment; '' when it is not UTF-8 (the round reads such a job through
    the CLI backend)."""
    try:
        return job.comment or ""
    except UnicodeDecodeError:
        return ""


def _gres_text(gres: Mapping | None) -> str:
    """pyslurm's gres dict → ``gpu:a100:4,gres/gpu:2``. Values are counts (``{"gpu:a100": 4}``,
    ``{"gres/gpu": 2}``) or, per node of a job, ``{"count": 3, "indexes": "0-2"}``."""
    return ",".join(f"{name}:{value['count'] if isinstance(value, Mapping) else value}"
                    for name, value in (gres or {}).items())


def _hostlist(value: object) -> str:
    if value is None:
        return ""
    return ",".join(value) if isinstance(value, (list, tuple)) else str(value)


def job_record(job, tres_per_job: str = "", tres_per_node: str | None = None) -> dict:
    """A ``pyslurm.Job`` as the job object of ``squeue --json`` (the keys `parse_job` reads);
    ``tres_per_job`` and ``tres_per_node`` are its raw TRES strings from squeue (which
    pyslurm misreads; module docstring). Without ``tres_per_node`` (a job the listing did
    not have yet) pyslurm's reading of it is taken."""
    state = job.state
    layout = job.get_resource_layout_per_node() if state in HOLDING_STATES else {}
    exit_status = job.exit_code
    signal = job.exit_code_signal
    waiting, throttle = job.array_tasks_waiting, job.array_tasks_parallel
    task_id = job.array_task_id
    if job.array_id and task_id is None and not waiting:
        task_id = 0  # pyslurm reads a task id of 0 as unset
    # squeue prints no end for a job without a time limit that has not ended (pyslurm: a
    # year after its start, or later).
    no_end = job.time_limit is None and state in ACTIVE_STATES and state != "COMPLETING"
    return {
        "job_id": job.id,
        "user_name": job.user_name or "",
        "name": job.name or "",
        "job_state": state,
        "state_reason": job.state_reason or "",
        "partition": job.partition or "",
        "comment": job.comment or "",
        "admin_comment": job.admin_comment or "",
        "tres_per_node": _gres_text(job.gres_per_node) if tres_per_node is None else tres_per_node,
        "tres_per_job": tres_per_job,
        "gres_detail": [_gres_text(layout[n]["gres"]) for n in layout],
        "nodes": _hostlist(job.allocated_nodes),
        "node_count": job.num_nodes or 0,
        "restart_cnt": job.requeue_count or 0,
        "submit_time": job.submit_time or 0,
        "start_time": job.start_time or 0,
        "end_time": 0 if no_end else job.end_time or 0,
        "priority": job.priority or 0,
        "batch_flag": int(bool(job.is_batch_job)),
        "requeue": int(bool(job.is_requeueable)),
        "array_job_id": job.array_id or 0,
        "array_task_id": task_id,
        "array_task_string": f"{waiting}%{throttle}" if waiting and throttle else waiting or "",
        "account": job.account or "",
        "qos": job.qos or "",
        "exit_code": {"return_code": exit_status or 0,
                      "signal": {"id": signal or 0}},
    }


def gres_in_use(jobs) -> dict[str, dict[str, int]]:
    """Node → gres name (``gpu:a100``) → count held by jobs that hold resources.

    pyslurm has no node's ``gres_used``; its allocated TRES count GPUs only where the site
    tracks ``gres/gpu`` in ``AccountingStorageTRES``. The jobs' grants per node always do.
    """
    used: dict[str, dict[str, int]] = {}
    for job in jobs:
        if job.state not in HOLDING_STATES:
            continue
        for node, layout in job.get_resource_layout_per_node().items():
            per_node = used.setdefault(node, {})
            for name, value in (layout.get("gres") or {}).items():
                count = value["count"] if isinstance(value, Mapping) else value
                per_node[name] = per_node.get(name, 0) + int(count)
    return used


def node_record(node, used: Mapping[str, int] | None = None) -> dict:
    """A ``pyslurm.Node`` as the node object of ``sinfo --json`` (the keys `parse_node` reads),
    with ``used``, its gres held by jobs (`gres_in_use`)."""
    configured = node.configured_gres or {}
    in_use = {name: (used or {}).get(name, 0) for name in configured}
    in_use.update({n: c for n, c in (used or {}).items() if n not in in_use})
    return {
        "name": node.name,
        "state": (node.state or "").split("+"),
        "partitions": list(node.partitions or ()),
        "active_features": list(node.active_features or ()),
        "gres": _gres_text(configured),
        "gres_used": _gres_text(in_use),
        "cpus": node.total_cpus or 0,
        "real_memory": node.real_memory or 0,
    }


class PyslurmClient:
    """`SlurmClient` over pyslurm (Slurm 25.11's C API).

    Args:
        env: ``SLURM_CONF`` (and, for the commands it still runs, ``PATH``) of the cluster;
            None to use the process's.
        timeout_s: time limit of each command it still runs (see the module docstring).
        install: the Slurm those commands come from.

    Raises:
        PyslurmUnavailable: pyslurm cannot be imported (not installed, or built for
            another Slurm), or another cluster's ``SLURM_CONF`` was already loaded.
    """

    def __init__(self, env: Mapping[str, str] | None = None, timeout_s: float = 30.0,
                 install: SlurmInstall | None = None):
        conf = (env or {}).get("SLURM_CONF")
        if conf and os.environ.get("SLURM_CONF") not in (None, conf) and "pyslurm" in sys.modules:
            raise PyslurmUnavailable(f"pyslurm already loaded {os.environ['SLURM_CONF']}; one "
                                     f"process talks to one cluster (asked for {conf})")
        if conf:
            os.environ["SLURM_CONF"] = conf
        try:
            if "pyslurm" not in sys.modules:
                check_importable(os.environ)
            import pyslurm
        except ImportError as e:
            raise PyslurmUnavailable(
                f"pyslurm is not usable ({e}); install the 'pyslurm' extra against Slurm "
                "25.11 (`make slurm-25.11`, then SLURM_INCLUDE_DIR=/opt/slurm-25.11/include "
                "SLURM_LIB_DIR=/opt/slurm-25.11/lib pip install -e '.[pyslurm]'), or set "
                "slurm_backend: cli") from None
        self._pyslurm = pyslurm
        # The commands pyslurm cannot replace (node counts, sbatch options).
        self._cli = CliSlurmClient(env=env, timeout_s=timeout_s, install=install)

    # ---- reading -------------------------------------------------------------------------

    def _rpc(self, what: str, call, *args):
        try:
            return call(*args)
        except self._pyslurm.RPCError as e:
            raise SlurmCommandError(("pyslurm", *what.split()), getattr(e, "errno", 1) or 1,
                                    str(e)) from None

    def _raw_tres(self, job_ids: Sequence[int] | None = None) -> dict[int, dict[str, str]]:
        """Job id → its raw ``tres_per_node`` and ``tres_per_job`` ('' when unset), from
        squeue (module docstring): the keyword arguments of `job_record`."""
        out = self._cli.output(job_listing_argv(RAW_TRES_FIELDS, job_ids))
        return {job_id: {key: "" if value.strip() in ("", "N/A", "(null)") else value.strip()
                         for key, value in zip(("tres_per_node", "tres_per_job"), f[1:])}
                for job_id, f in listing_records(out, len(RAW_TRES_FIELDS)).items()}

    def jobs(self) -> tuple[SlurmJob, ...]:
        loaded = self._rpc("load jobs", self._pyslurm.Jobs.load)
        raw = self._raw_tres()
        return tuple(self._readable(j, raw.get(j.id, {})) for j in loaded.values())

    def _readable(self, job, raw_tres: dict[str, str]) -> SlurmJob:
        """One loaded job; one whose name, comment or other text is not UTF-8 (pyslurm's
        strings are strict) as the CLI backend reads it, its bad bytes replaced."""
        try:
            return parse_job(job_record(job, **raw_tres), f"job {job.id}")
        except UnicodeDecodeError:
            found = self._cli.job(job.id)
            if found is None:  # gone between the two reads
                raise SlurmParseError(f"job {job.id} (not UTF-8, gone before scontrol read it)", "") from None
            return found

    def job(self, job_id: int) -> SlurmJob | None:
        _job_id(job_id)
        try:
            job = self._pyslurm.Job.load(job_id)
        except self._pyslurm.RPCError as e:
            if "Invalid job id" in str(e):
                return None
            raise SlurmCommandError(("pyslurm", "load job", str(job_id)), 1, str(e)) from None
        return self._readable(job, self._raw_tres([job_id]).get(job_id, {}))

    def nodes(self) -> tuple[SlurmNode, ...]:
        loaded = self._rpc("load nodes", self._pyslurm.Nodes.load)
        used = gres_in_use(self._rpc("load jobs", self._pyslurm.Jobs.load).values())
        return tuple(parse_node(node_record(n, used.get(n.name)), f"node {n.name}")
                     for n in loaded.values())

    def pending_elastic_job_ids(self) -> list[int]:
        loaded = self._rpc("load jobs", self._pyslurm.Jobs.load)
        return sorted(j.id for j in loaded.values() if j.state == "PENDING" and is_elastic(_comment(j)))

    # ---- acting --------------------------------------------------------------------------

    def update_pending(self, job_ids: int | Sequence[int], update: JobUpdate) -> None:
        ids = [int(_job_id(j)) for j in _id_list(job_ids)]
        if not ids:
            raise SlurmArgumentError("job_ids", ids, "give at least one job id")
        changes = {}
        if update.partition is not None:
            changes["partitions"] = _name("partition", update.partition)
        if update.gpu_type is not None and update.gpus_per_node is None:
            raise SlurmArgumentError("gpu_type", update.gpu_type, "a typed request needs gpus_per_node too")
        if update.gpus_per_node is not None:
            typed = f"{_name('gpu_type', update.gpu_type)}:" if update.gpu_type is not None else ""
            changes["gres_per_node"] = f"gpu:{typed}{_positive('gpus_per_node', update.gpus_per_node)}"
        if update.features:
            changes["constraints"] = _name("features", update.features)
        clear_features = update.features == ""
        if update.clear_gpus_per_job and update.gpus_per_node is None:
            raise SlurmArgumentError("clear_gpus_per_job", True, "the GPUs per node replace the count per job")
        if (update.cpus_per_gpu is not None or update.mem_per_gpu_mb is not None) and update.gpus_per_node is None:
            raise SlurmArgumentError("gpus_per_node", None, "CPUs and memory per GPU need the GPUs per node")
        # Per node, as the CLI backend writes them (see update_pending_argv for why).
        if update.cpus_per_gpu is not None:
            changes["min_cpus_per_node"] = _positive("cpus_per_gpu", update.cpus_per_gpu) * update.gpus_per_node
        if update.mem_per_gpu_mb is not None:
            changes["memory_per_node"] = f"{_positive('mem_per_gpu_mb', update.mem_per_gpu_mb) * update.gpus_per_node}M"
        if update.admin_comment is not None:
            changes["admin_comment"] = _admin_comment(update.admin_comment)
        if update.required_nodes is not None:
            changes["required_nodes"] = _node_list(update.required_nodes).split(",")
        if update.num_nodes is not None:
            _positive("num_nodes", update.num_nodes)
        elif not changes and not clear_features:
            raise SlurmArgumentError("update", update, "set at least one of partition, gpus_per_node, "
                                     "num_nodes, admin_comment, required_nodes, features, cpus_per_gpu, "
                                     "mem_per_gpu_mb")
        if clear_features and not update.clear_gpus_per_job:  # else cleared with the count below
            # pyslurm sends an empty constraint as "unset", which Slurm reads as "no change";
            # scontrol's Features= clears. First, so that a retype below does not meet the
            # old type's constraint.
            self._cli.update_pending(ids, JobUpdate(features="", start_now=False))
        if update.clear_gpus_per_job:
            # As for the features, through scontrol (TresPerJob=), with the partition and
            # the count per node in the same message: Slurm refuses either count beside
            # the other.
            self._cli.update_pending(ids, JobUpdate(partition=update.partition, gpus_per_node=update.gpus_per_node,
                                                    gpu_type=update.gpu_type, features=update.features,
                                                    clear_gpus_per_job=True, start_now=False))
        if changes or update.start_now:
            if update.start_now:
                # After a requeue Slurm adds BeginTime = now + 121 s unless told otherwise.
                changes["begin_time"] = "now"
            for job_id in ids:
                modify = self._pyslurm.Job(job_id).modify

                def once(modify=modify, job_id=job_id):
                    self._rpc(f"modify {job_id}", modify, self._pyslurm.JobSubmitDescription(**changes))
                if update.partition is None:
                    once()
                else:
                    retry_stale_errno(once)
        if update.num_nodes is not None:
            # pyslurm cannot update a node count (see the module docstring): scontrol, after
            # the rest, which Slurm then sizes the job's CPUs by.
            self._cli.update_pending(ids, JobUpdate(num_nodes=update.num_nodes, start_now=False))

    def _each(self, what: str, job_ids: int | Sequence[int], act) -> None:
        ids = [int(_job_id(j)) for j in _id_list(job_ids)]
        if not ids:
            raise SlurmArgumentError("job_ids", ids, "give at least one job id")
        failed = []
        for job_id in ids:
            try:
                act(self._pyslurm.Job(job_id))
            except self._pyslurm.RPCError as e:
                failed.append(f"{job_id}: {e}")
        if failed:
            raise SlurmCommandError(("pyslurm", what, *map(str, ids)), 1, "; ".join(failed))

    def slurm_version(self) -> tuple[int, int, int]:
        return self._cli.slurm_version()  # the same installation's commands

    def hold(self, job_ids: int | Sequence[int]) -> None:
        self._each("hold", job_ids, lambda job: job.hold())

    def release(self, job_ids: int | Sequence[int]) -> None:
        self._each("release", job_ids, lambda job: job.release())

    def signal_batch(self, job_ids: int | Sequence[int], signal: str = "USR1") -> None:
        name = signal_batch_argv(1, signal)[1].split("=", 1)[1]  # the CLI backend's check
        sig = int(name) if is_number(name) else f"SIG{name}"
        self._each("signal", job_ids, lambda job: job.send_signal(sig, steps="batch"))

    def requeue_hold(self, job_id: int) -> None:
        self._each("requeue hold", job_id, lambda job: job.requeue(hold=True))

    def batch_script(self, job_id: int) -> str:
        return self._rpc("batch script", self._pyslurm.Job(int(_job_id(job_id))).get_batch_script)

    def cancel(self, job_id: int) -> None:
        self._each("cancel", job_id, lambda job: job.cancel())

    def reserved_nodes(self, name: str) -> tuple[str, ...] | None:
        """The nodes of reservation ``name``, or None when there is none."""
        found = self._rpc("load reservations", self._pyslurm.Reservations.load).get(_name("reservation", name))
        if found is None:
            return None
        return expand_hostlist(_hostlist(found.nodes)) if found.nodes else ()

    def hold_nodes(self, name: str, nodes: Sequence[str]) -> None:
        nodes = tuple(nodes)
        change = reservation_change(self.reserved_nodes(name), nodes)
        if change is None:
            return
        if change == "delete":
            self._rpc(f"delete reservation {name}", self._pyslurm.Reservation(name).delete)
            return
        listed = _node_list(nodes)
        if change == "create":
            # As the CLI backend's: from now on, for root only, running jobs go on.
            resv = self._pyslurm.Reservation(
                name=name, users=["root"], nodes=listed, start_time=int(time.time()),
                duration=RESERVATION_DURATION_MIN,
                flags=self._pyslurm.ReservationFlags.IGNORE_RUNNING_JOBS)
            self._rpc(f"create reservation {name}", resv.create)
        else:
            changes = self._pyslurm.Reservation(nodes=listed)
            self._rpc(f"update reservation {name}", self._pyslurm.Reservation(name).modify, changes)

    def submit(self, request: SubmitRequest) -> int:
        # sbatch, as users submit (see the module docstring).
        return self._cli.submit(request)

