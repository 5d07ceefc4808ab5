"""The Slurm CLI backend of `SlurmClient`: squeue listings and sinfo JSON to read, scontrol/scancel to act.

Building each command (``*_argv``) is a pure function, tested without Slurm; running it
goes through `run_command`; parsing the output lives in `slurm_ext.slurm_parse`.
Values are converted to Slurm's formats here and nowhere else.
"""

import logging
import re
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import replace

from estimator.contract import MAX_ADMIN_COMMENT_CHARS
from slurm_ext.errors import SlurmArgumentError, SlurmCommandError, SlurmParseError
from slurm_ext.run import run_command, run_commands
from slurm_ext.slurm_client import JobUpdate, SlurmJob, SlurmNode, SubmitRequest
from slurm_ext.slurm_install import SlurmInstall, parse_version
from slurm_ext.slurm_parse import (
    ADMIN_COMMENT_FIELDS, GroupedSinfoError, LISTING_FIELDS, NAME_FIELDS, PENDING_LISTING_FIELDS,
    parse_job_detail, parse_job_listing, parse_jobs, parse_nodes,
    parse_pending_listing, parse_reservation_nodes, parse_sbatch_parsable,
)

log = logging.getLogger(__name__)

# More running GPU jobs than this without a known grant: one `scontrol show job` for all.
DETAIL_ONE_BY_ONE_MAX = 8
# Times in the listing as epoch seconds, whatever the site's SLURM_TIME_FORMAT.
LISTING_ENV = {"SLURM_TIME_FORMAT": "%s"}
# Slurm 25.11 (23.11 and later) on a cluster without accounting refuses a pending job's
# partition change at random: `_update_job` reads errno when `_retrieve_new_assoc` returns
# no association, which without accounting is no error, so a stale errno of the RPC thread
# ("Resource temporarily unavailable") becomes the answer (about 2 tries in 3 on the lab).
# Such an update is retried; it is idempotent.
STALE_ERRNO_TEXT = "Resource temporarily unavailable"
PARTITION_UPDATE_ATTEMPTS = 20
_NAME = re.compile(r"^[A-Za-z0-9_.\-]+$")
_SIGNAL = re.compile(r"^(SIG)?([A-Z][A-Z0-9]*|[0-9]{1,2})$")
_GRES = re.compile(r"^[a-z][a-z0-9_]*(:[A-Za-z0-9_.\-]+)?(:[0-9]+)?(,[a-z][a-z0-9_]*(:[A-Za-z0-9_.\-]+)?(:[0-9]+)?)*$")


# ---- value checks -------------------------------------------------------------------------

def _job_id(job_id: object) -> str:
    if isinstance(job_id, bool) or not isinstance(job_id, int) or job_id <= 0:
        raise SlurmArgumentError("job_id", job_id, "give Slurm's positive integer job id")
    return str(job_id)


def _job_ids(job_ids: Iterable[object]) -> str:
    ids = [_job_id(j) for j in job_ids]
    if not ids:
        raise SlurmArgumentError("job_ids", ids, "give at least one job id")
    return ",".join(ids)


def _positive(field: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise SlurmArgumentError(field, value, "give a positive integer")
    return value


def _name(field: str, value: object) -> str:
    if not isinstance(value, str) or not _NAME.match(value):
        raise SlurmArgumentError(field, value, "give a name of letters, digits, '_', '.', '-'")
    return value


def _admin_comment(value: object) -> str:
    if not isinstance(value, str):
        raise SlurmArgumentError("admin_comment", value, "give text")
    if len(value) > MAX_ADMIN_COMMENT_CHARS:
        raise SlurmArgumentError("admin_comment", value[:40] + "...",
                                 f"keep it within {MAX_ADMIN_COMMENT_CHARS} characters "
                                 f"(got {len(value)})")
    if "\n" in value or "\r" in value:
        raise SlurmArgumentError("admin_comment", value, "keep it on one line")
    return value


def _node_list(nodes: object) -> str:
    if isinstance(nodes, str) or not isinstance(nodes, (tuple, list)) or not nodes:
        raise SlurmArgumentError("required_nodes", nodes, "give the node names as a tuple")
    return ",".join(_name("required_nodes", n) for n in nodes)


def _id_list(job_ids: int | Sequence[int]) -> list[int]:
    return [job_ids] if isinstance(job_ids, int) else list(job_ids)


def retry_stale_errno(update: Callable[[], None], attempts: int = PARTITION_UPDATE_ATTEMPTS) -> None:
    """Run a partition update, again while Slurm answers with a stale errno (see
    `STALE_ERRNO_TEXT`); any other failure, or the last attempt's, is raised."""
    for attempt in range(1, attempts + 1):
        try:
            update()
            return
        except SlurmCommandError as e:
            if STALE_ERRNO_TEXT not in e.stderr or attempt == attempts:
                raise
            log.debug("partition update refused with a stale errno (attempt %d); again", attempt)
            # A growing wait (at most 0.2 s, 2.5 s in all): quick retries can meet the same
            # RPC thread's errno again and again.
            time.sleep(min(0.2, 0.01 * attempt))


# ---- command builders (pure) --------------------------------------------------------------

def squeue_json_argv() -> list[str]:
    """All jobs as JSON, finished ones included (22.05 ignores filters with --json and lists
    every job; 23.11 and later apply them: ``--states=all``)."""
    return ["squeue", "--all", "--states=all", "--json"]


def job_listing_argv(fields: Iterable[str], job_ids: Iterable[int] | None = None) -> list[str]:
    """A cheap ``|``-separated listing of every job (finished ones included), or of some.

    ``Field:|`` prints the field untruncated with ``|`` after it (0.02 s for 2,000 jobs
    where ``--json`` takes 0.3 s). Run it with `LISTING_ENV`.
    """
    argv = ["squeue", "--all", "--states=all", "--noheader"]
    if job_ids is not None:
        argv += ["--jobs", _job_ids(job_ids)]
    return argv + ["--Format", ",".join(f"{f}:|" for f in fields)]


def pending_listing_argv() -> list[str]:
    """A cheap listing of pending jobs and their comments (0.02 s for 2,000 jobs)."""
    return ["squeue", "-h", "-t", "PENDING", "-O", PENDING_LISTING_FIELDS]


def job_detail_argv(job_id: int | None = None) -> list[str]:
    """``scontrol -d -o show job``: one line per job with its GPUs per node (all jobs: None)."""
    return ["scontrol", "-d", "-o", "show", "job"] + ([_job_id(job_id)] if job_id is not None else [])


def sinfo_json_argv() -> list[str]:
    """All nodes as JSON (one object per node up to 23.02; later, groups)."""
    return ["sinfo", "--all", "--json"]


def nodes_json_argv() -> list[str]:
    """All nodes as JSON, one object each, on Slurm 23.11 and later (22.05's scontrol has no
    ``--json``)."""
    return ["scontrol", "show", "nodes", "--json"]


def update_pending_argv(job_id: int | list[int] | tuple[int, ...], update: JobUpdate) -> list[str]:
    """``scontrol update`` of a pending job (or of several at once: a list of ids).

    The GPU count is untyped (``Gres=gpu:N``) unless the update names a type (typed-GRES
    steering, Slurm 23.02.6 and later: 22.05 cannot retype a pending job); the partition
    or the node features then pick the type. The node count is written ``NumNodes=N-N``
    because a single number on a multi-node job becomes a range. CPUs and memory per GPU
    are written per node (``MinCPUsNode``, ``MinMemoryNode``).

    Raises:
        SlurmArgumentError: a bad value, or an update that changes nothing.
    """
    ids = _job_ids(job_id) if isinstance(job_id, (list, tuple)) else _job_id(job_id)
    argv = ["scontrol", "update", f"JobId={ids}"]
    if update.partition is not None:
        argv.append(f"Partition={_name('partition', update.partition)}")
    if update.gpu_type is not None and update.gpus_per_node is None:
        raise SlurmArgumentError("gpu_type", update.gpu_type, "a typed request needs gpus_per_node too")
    if update.gpus_per_node is not None:
        typed = f"{_name('gpu_type', update.gpu_type)}:" if update.gpu_type is not None else ""
        argv.append(f"Gres=gpu:{typed}{_positive('gpus_per_node', update.gpus_per_node)}")
    if update.clear_gpus_per_job:
        if update.gpus_per_node is None:
            raise SlurmArgumentError("clear_gpus_per_job", True, "the GPUs per node replace the count per job")
        argv.append("TresPerJob=")
    if update.features is not None:
        argv.append(f"Features={_name('features', update.features) if update.features else ''}")
    if update.cpus_per_gpu is not None or update.mem_per_gpu_mb is not None:
        # Per node (the update's GPUs per node times the per-GPU figure): 22.05 starts a job
        # without per-GPU fields updated while it pends, and 25.11 leaves a requeued job
        # pending for ever ("Resources") once its CpusPerTres changed between runs.
        if update.gpus_per_node is None:
            raise SlurmArgumentError("gpus_per_node", None, "CPUs and memory per GPU need the GPUs per node")
        if update.cpus_per_gpu is not None:
            argv.append(f"MinCPUsNode={_positive('cpus_per_gpu', update.cpus_per_gpu) * update.gpus_per_node}")
        if update.mem_per_gpu_mb is not None:
            argv.append(f"MinMemoryNode={_positive('mem_per_gpu_mb', update.mem_per_gpu_mb) * update.gpus_per_node}")
    if update.num_nodes is not None:
        n = _positive("num_nodes", update.num_nodes)
        argv.append(f"NumNodes={n}-{n}")
    if update.admin_comment is not None:
        argv.append(f"AdminComment={_admin_comment(update.admin_comment)}")
    if update.required_nodes is not None:
        argv.append(f"ReqNodeList={_node_list(update.required_nodes)}")
    if len(argv) == 3:
        raise SlurmArgumentError("update", update, "set at least one of partition, gpus_per_node, "
                                 "num_nodes, admin_comment, required_nodes, features, cpus_per_gpu, "
                                 "mem_per_gpu_mb")
    if update.start_now:
        # After a requeue Slurm adds BeginTime = now + 121 s unless told otherwise.
        argv.append("StartTime=now")
    return argv


def hold_argv(job_id: int | list[int] | tuple[int, ...]) -> list[str]:
    """``scontrol hold`` of one job or several (as root or SlurmUser, an admin hold)."""
    return ["scontrol", "hold", _job_ids(job_id) if isinstance(job_id, (list, tuple)) else _job_id(job_id)]


def release_argv(job_id: int | list[int] | tuple[int, ...]) -> list[str]:
    return ["scontrol", "release", _job_ids(job_id) if isinstance(job_id, (list, tuple)) else _job_id(job_id)]


def signal_batch_argv(job_id: int | list[int] | tuple[int, ...], signal: str = "USR1") -> list[str]:
    """Signal only the batch script's process (plain ``-s`` reaches only srun steps).

    Several jobs (a list of ids) are signalled by one scancel.
    """
    if not isinstance(signal, str) or not _SIGNAL.match(signal.upper()):
        raise SlurmArgumentError("signal", signal, "give a signal name such as USR1 or a number")
    name = _SIGNAL.match(signal.upper()).group(2)
    if isinstance(job_id, (list, tuple)):
        _job_ids(job_id)
        return ["scancel", f"--signal={name}", "--batch", *(_job_id(j) for j in job_id)]
    return ["scancel", f"--signal={name}", "--batch", _job_id(job_id)]


def requeue_hold_argv(job_id: int) -> list[str]:
    """Requeue a running job held (SIGCONT+SIGTERM, SIGKILL after KillWait)."""
    return ["scontrol", "requeuehold", _job_id(job_id)]


def batch_script_argv(job_id: int) -> list[str]:
    """The job's batch script, written to stdout."""
    return ["scontrol", "write", "batch_script", _job_id(job_id), "-"]


def reservation_show_argv(name: str) -> list[str]:
    """One reservation on one line (``Nodes=...`` among its fields)."""
    return ["scontrol", "-o", "show", "reservation", _name("reservation", name)]


def reservation_create_argv(name: str, nodes: Sequence[str]) -> list[str]:
    """A reservation from now on, for root only, of ``nodes`` (running jobs there go on:
    IGNORE_JOBS): no job of anyone else starts on them while it lasts."""
    return ["scontrol", "create", "reservation", f"ReservationName={_name('reservation', name)}",
            "StartTime=now", "Duration=UNLIMITED", "Users=root", f"Nodes={_node_list(tuple(nodes))}",
            "Flags=IGNORE_JOBS"]


def reservation_update_argv(name: str, nodes: Sequence[str]) -> list[str]:
    return ["scontrol", "update", f"ReservationName={_name('reservation', name)}",
            f"Nodes={_node_list(tuple(nodes))}"]


def reservation_delete_argv(name: str) -> list[str]:
    return ["scontrol", "delete", f"ReservationName={_name('reservation', name)}"]


def reservation_change(held: tuple[str, ...] | None, nodes: tuple[str, ...]) -> str | None:
    """What makes a reservation that holds ``held`` (None: there is none) hold ``nodes``
    (none: no reservation): None when nothing, else ``delete``, ``create`` or ``update``."""
    if (held is None and not nodes) or (held is not None and set(held) == set(nodes)):
        return None
    if not nodes:
        return "delete"
    return "create" if held is None else "update"


def cancel_argv(job_id: int) -> list[str]:
    return ["scancel", _job_id(job_id)]


def sbatch_argv(request: SubmitRequest) -> list[str]:
    """``sbatch --parsable`` with the request's options; the script goes to stdin."""
    if not isinstance(request.script, str) or not request.script.startswith("#!"):
        raise SlurmArgumentError("script", (request.script or "")[:40],
                                 "give the batch script's text, starting with #!")
    argv = ["sbatch", "--parsable", f"--job-name={_name('name', request.name)}"]
    if request.partition is not None:
        argv.append(f"--partition={_name('partition', request.partition)}")
    if request.nodes is not None:
        argv.append(f"--nodes={_positive('nodes', request.nodes)}")
    if request.gres is not None:
        if not isinstance(request.gres, str) or not _GRES.match(request.gres):
            raise SlurmArgumentError("gres", request.gres, "give e.g. gpu:4 or gpu:a100:4")
        argv.append(f"--gres={request.gres}")
    if request.comment is not None:
        argv.append(f"--comment={request.comment}")
    if request.hold:
        argv.append("--hold")
    if request.requeue is not None:
        argv.append("--requeue" if request.requeue else "--no-requeue")
    if request.time_limit_min is not None:
        argv.append(f"--time={_positive('time_limit_min', request.time_limit_min)}")
    if request.output is not None:
        argv.append(f"--output={request.output}")
    if request.workdir is not None:
        argv.append(f"--chdir={request.workdir}")
    for extra in request.extra_args:
        if not isinstance(extra, str):
            raise SlurmArgumentError("extra_args", extra, "give each sbatch option as a string")
        argv.append(extra)
    return argv


# ---- the client ---------------------------------------------------------------------------

class CliSlurmClient:
    """`SlurmClient` over the Slurm command-line tools.

    Args:
        env: variables for every command (e.g. ``{"SLURM_CONF": ...}``), None to inherit.
        timeout_s: time limit of each command.
        install: the Slurm whose commands it runs (None: the system's, on PATH).
    """

    def __init__(self, env: Mapping[str, str] | None = None, timeout_s: float = 30.0,
                 install: SlurmInstall | None = None):
        self.env = dict(env) if env is not None else None
        self.timeout_s = timeout_s
        self.install = install if install is not None else SlurmInstall()
        # Running job → ((start time, restarts, nodes), GPUs per node, type): a grant does
        # not change while the job runs, so it is read once per run.
        self._granted: dict[int, tuple[tuple, tuple[int, ...], str | None]] = {}
        self._parsed: dict = {}  # the last listing's jobs, reused while their records match
        self._nodes_argv: list[str] | None = None  # set once sinfo --json groups nodes
        self._version: tuple[int, int, int] | None = None  # read once, when first needed

    def output(self, argv: list[str]) -> str:
        """The stdout of one Slurm command (for what another backend still asks the CLI)."""
        return self._run(argv)

    def _run(self, argv: list[str], input_text: str | None = None) -> str:
        return run_command(self.install.argv(argv), self.timeout_s, input_text=input_text,
                           env=self.env).stdout

    def _listing(self, job_ids: Iterable[int] | None) -> tuple[SlurmJob, ...]:
        env = {**(self.env or {}), **LISTING_ENV}
        done = run_commands([self.install.argv(job_listing_argv(fields, job_ids))
                             for fields in (LISTING_FIELDS, ADMIN_COMMENT_FIELDS, NAME_FIELDS)],
                            self.timeout_s, env=env)
        return parse_job_listing(*(d.stdout for d in done), memo=self._parsed if job_ids is None else None)

    def jobs(self) -> tuple[SlurmJob, ...]:
        try:
            jobs = self._listing(None)
        except SlurmParseError as e:  # free text imitating a record: JSON is unambiguous
            log.warning("squeue listing unreadable, reading JSON instead: %s", e)
            return parse_jobs(self._run(squeue_json_argv()))
        return self._with_grants(jobs)

    def _with_grants(self, jobs: tuple[SlurmJob, ...]) -> tuple[SlurmJob, ...]:
        """Jobs with the GPUs granted on each node filled in for running GPU jobs."""
        wanted = {j.job_id: j for j in jobs
                  if j.state == "RUNNING" and j.nodes and (j.gpus_per_node or j.gpus_per_job)}
        key = {i: (j.start_time_s, j.restart_count, j.nodes) for i, j in wanted.items()}
        self._granted = {i: g for i, g in self._granted.items() if i in wanted and g[0] == key[i]}
        missing = {i: wanted[i].name for i in wanted if i not in self._granted}
        if missing:
            found = {}
            if len(missing) > DETAIL_ONE_BY_ONE_MAX:
                found = parse_job_detail(self._run(job_detail_argv()), missing)
            # A job asked for alone has its own line first (later ones can only be its
            # comment's text): that also settles the few the listing of all left ambiguous.
            ids = sorted(j for j in missing if j not in found)[:DETAIL_ONE_BY_ONE_MAX]
            if ids:
                outs = run_commands([self.install.argv(job_detail_argv(j)) for j in ids],
                                    self.timeout_s, env=self.env,
                                    check=False)
                for job_id, out in zip(ids, outs):
                    if out.returncode != 0 and "Invalid job id" not in out.stderr:
                        raise SlurmCommandError(out.argv, out.returncode, out.stderr)
                    found.update(parse_job_detail(out.stdout.split("\n", 1)[0], {job_id: missing[job_id]}))
            for job_id, per_node in found.items():
                job = wanted[job_id]
                counts = tuple(per_node.get(n, (0, None))[0] for n in job.nodes)
                types = {per_node[n][1] for n in job.nodes if n in per_node and per_node[n][0]}
                self._granted[job_id] = (key[job_id], counts, types.pop() if len(types) == 1 else None)
        return tuple(replace(j, granted_gpus_per_node=self._granted[j.job_id][1],
                             granted_gpu_type=self._granted[j.job_id][2])
                     if j.job_id in self._granted else j for j in jobs)

    def job(self, job_id: int) -> SlurmJob | None:
        _job_id(job_id)
        try:
            jobs = self._listing([job_id])
        except SlurmCommandError as e:
            if "Invalid job id" in e.stderr:
                return None
            raise
        except SlurmParseError:
            jobs = parse_jobs(self._run(squeue_json_argv()))
            return next((j for j in jobs if j.job_id == job_id), None)
        return next((j for j in self._with_grants(jobs) if j.job_id == job_id), None)

    def nodes(self) -> tuple[SlurmNode, ...]:
        if self._nodes_argv is None:
            try:
                return parse_nodes(self._run(sinfo_json_argv()))
            except GroupedSinfoError:
                self._nodes_argv = nodes_json_argv()  # a newer Slurm: from now on
        return parse_nodes(self._run(self._nodes_argv))

    def update_pending(self, job_ids: int | Sequence[int], update: JobUpdate) -> None:
        ids = _id_list(job_ids)
        if update.num_nodes is not None and len(ids) > 1:
            # scontrol changes a node count one job at a time ("Invalid job ID 4,10").
            for job_id in ids:
                self._update(update_pending_argv(job_id, update), update)
            return
        self._update(update_pending_argv(ids, update), update)

    def slurm_version(self) -> tuple[int, int, int]:
        if self._version is None:
            version = parse_version(self._run(["scontrol", "--version"]))
            if version is None:
                raise SlurmCommandError(["scontrol", "--version"], 0, "printed no version")
            self._version = version
        return self._version

    def _update(self, argv: list[str], update: JobUpdate) -> None:
        if update.partition is None:
            self._run(argv)
        else:
            retry_stale_errno(lambda: self._run(argv))

    def hold(self, job_ids: int | Sequence[int]) -> None:
        self._run(hold_argv(_id_list(job_ids)))

    def release(self, job_ids: int | Sequence[int]) -> None:
        self._run(release_argv(_id_list(job_ids)))

    def signal_batch(self, job_ids: int | Sequence[int], signal: str = "USR1") -> None:
        self._run(signal_batch_argv(_id_list(job_ids), signal))

    def requeue_hold(self, job_id: int) -> None:
        self._run(requeue_hold_argv(job_id))

    def batch_script(self, job_id: int) -> str:
        return self._run(batch_script_argv(job_id))

    def pending_elastic_job_ids(self) -> list[int]:
        return parse_pending_listing(self._run(pending_listing_argv()))

    def cancel(self, job_id: int) -> None:
        self._run(cancel_argv(job_id))

    def reserved_nodes(self, name: str) -> tuple[str, ...] | None:
        """The nodes of reservation ``name``, or None when there is none."""
        out = run_command(self.install.argv(reservation_show_argv(name)), self.timeout_s,
                          env=self.env, check=False)
        if "not found" in out.stdout + out.stderr:
            return None
        if out.returncode != 0:
            raise SlurmCommandError(out.argv, out.returncode, out.stderr)
        return parse_reservation_nodes(out.stdout)

    def hold_nodes(self, name: str, nodes: Sequence[str]) -> None:
        nodes = tuple(nodes)
        change = reservation_change(self.reserved_nodes(name), nodes)
        if change == "delete":
            self._run(reservation_delete_argv(name))
        elif change == "create":
            self._run(reservation_create_argv(name, nodes))
        elif change == "update":
            self._run(reservation_update_argv(name, nodes))

    def submit(self, request: SubmitRequest) -> int:
        job_id = parse_sbatch_parsable(self._run(sbatch_argv(request), input_text=request.script))
        log.info("submitted job %d (%s)", job_id, request.name)
        return job_id
