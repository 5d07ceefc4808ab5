"""``slurm-ext squeue``: every job with its elastic Cell, plan, estimated speed and why.

Everything shown is read from Slurm (the daemon writes its plan into each elastic job's
AdminComment, which every user may read), so the view works for any user and needs no
access to the daemon's state file.

AdminComment format (``estimator.contract``: the daemon writes it, the runner and this view
read it), space-separated ``key=value`` tokens; ``why=`` or ``error=`` comes last and its
value runs to the end of the string::

    requested=a100 cell=a100x8:s2 plan=[dp2tp2|dp4tp1] mb=16 remat=1 layers=0,13,26 sps=412.5 why=fastest feasible
    requested=a100 cell=a100x8:s2 plan=[dp4tp1|dp4tp1] mb=8 remat=0 layers=0,13,26 src=tuned sps=431 measured=1 why=fastest feasible

- ``requested``: the GPU type the user asked for (kept from the submit hook; ``any``).
- ``cell plan mb remat layers``: the plan string of ``estimator.plan_string`` (what the
  runner inside the job reads): ``cell`` is GPU type × GPU count and stage count
  (``<type>x<gpus>:s<stages>``), ``plan`` per stage ``dp<d>tp<t>`` separated by ``|``,
  ``mb`` micro-batches per iteration, ``remat`` 1 or 0, ``layers`` the stage boundaries.
- ``src``: where the plan came from when it is not the daemon's own (absent: the daemon
  chose it): ``tuned`` in this allocation by the runner, ``cached`` (tuned in an earlier
  run on this Cell), ``given`` by the user. The daemon writes it, with the plan tokens of
  the plan that runs, when the runner's ``measured.json`` shows another plan of the Cell.
- ``sps``: samples per second, estimated, or measured by the runner when ``measured=1``.
- ``measured``: ``1`` when ``sps`` was measured on the plan that runs (absent: estimated).
- ``why``: why the job runs on this Cell, waits, or was rescaled.
- ``error``: the job's elastic spec is invalid; it runs as submitted.

The JSON form (``--json``) is ``{"jobs": [...]}``; each job has ``job_id`` (int),
``user``, ``state``, ``partition``, ``gpus`` (int: granted when running, requested
otherwise), ``gpu_type`` (str or null), ``nodes`` (int), ``elastic`` (bool), ``cell``
(str or null), ``plan`` (str or null), ``micro_batches`` (int or null),
``samples_per_s`` (float or null: ``sps``, measured or estimated), ``requested`` (str or
null), ``why`` (str), ``spec_error`` (str or null), ``plan_source`` (``daemon``, ``tuned``,
``cached``, ``given``, ``estimated``, or null when there is no plan), ``measured_samples_per_s``
(float, or null unless ``sps`` was measured), ``expected_start`` and ``expected_end``
(ISO 8601 UTC or null: a running job's start is Slurm's, a waiting elastic job's the
daemon's forecast, ``start=``; the end is the forecast, ``end=``; a finished job's are
Slurm's start and end) and ``progress_frac``
(float or null: the share of its iterations done, ``progress=``) and ``expected_cells``
(the Cells the forecast passes through, ``via=``; a list, maybe empty). The table shows the
times as START and END (``MM-DDTHH:MM``, UTC).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass

from estimator.cells import Cell, StagePlan
from estimator.contract import PlanComment, format_utc, parse_plan_comment
from slurm_ext.slurm_client import HELD_STATES, SlurmJob

DAEMON_PLAN = "daemon"  # plan_source in the view when no ``src`` token says otherwise
_SOURCE_NOTES = {"tuned": "plan tuned in this allocation",
                 "cached": "plan tuned in an earlier run on this Cell",
                 "given": "plan given by the user",
                 "estimated": "plan the estimate ranks first, not measured"}


def plan_label(stages: Sequence[StagePlan]) -> str:
    """``[dp2tp2|dp4tp1]``: the per-stage data- and tensor-parallel degrees (``ep``: the
    stage's experts split over its GPUs)."""
    return "[" + "|".join(s.label() for s in stages) + "]"


def cell_of(pc: PlanComment, gpus_per_node: int) -> Cell | None:
    """The Cell an AdminComment names, laid out ``gpus_per_node`` per node."""
    parts = pc.cell_parts()
    if parts is None:
        return None
    gpu_type, num_gpus, stages = parts
    return Cell(gpu_type, num_gpus, max(1, gpus_per_node), stages)


@dataclass(frozen=True)
class JobRow:
    """One line of the view; ``to_json`` gives the documented JSON keys."""

    job_id: int
    user: str
    state: str
    partition: str
    gpus: int
    gpu_type: str | None
    nodes: int
    elastic: bool
    cell: str | None
    plan: str | None
    micro_batches: int | None
    samples_per_s: float | None
    requested: str | None
    why: str
    spec_error: str | None
    plan_source: str | None = None
    measured_samples_per_s: float | None = None
    expected_start: str | None = None  # ISO 8601 UTC: a running job's start, a waiting one's forecast
    expected_end: str | None = None
    progress_frac: float | None = None
    expected_cells: tuple[str, ...] = ()  # the Cells the forecast passes through

    def to_json(self) -> dict:
        return asdict(self)


def job_row(job: SlurmJob) -> JobRow:
    """The view of one job (pure: only the job's Slurm fields are read)."""
    started = job.state in ("RUNNING", "COMPLETING", "SUSPENDED")
    ended = bool(job.state) and not job.is_active
    # Waiting to start: pending, requeued (held after a rescale: SPECIAL_EXIT), ...
    pending = job.state in HELD_STATES or job.state == "REQUEUED" or "PENDING" in job.state_flags
    running = started and job.granted_gpus_per_node
    if running:
        gpus, gpu_type, nodes = job.granted_gpus, job.granted_gpu_type, len(job.granted_gpus_per_node)
    else:
        nodes = max(job.node_count, 1)
        gpus = job.gpus_per_job or job.gpus_per_node * nodes
        gpu_type = job.gpu_type_requested
    pc = parse_plan_comment(job.admin_comment) if job.is_elastic else PlanComment()
    if job.is_elastic and gpu_type is None and pc.cell_parts():
        gpu_type = pc.cell_parts()[0]
    reason = job.reason if job.reason and job.reason != "None" else ""
    if pc.error:
        why = f"spec error, runs as submitted: {pc.error}"
    elif pc.why:
        why = pc.why
        # The daemon's own hold is what its why explains; any other reason is Slurm's.
        if pending and reason and reason not in why and not job.is_held:
            why = f"{why} (slurm: {reason})"
    elif job.is_elastic and pending and job.is_held:
        why = "waiting for the slurm-ext daemon"
    else:
        why = reason
    source = (pc.plan_source or DAEMON_PLAN) if pc.plan else None
    measured = pc.samples_per_s if pc.sps_measured else None
    start_s = job.start_time_s if started and job.start_time_s else pc.expected_start_s
    end_s = pc.expected_end_s
    progress, cells = pc.progress_frac, pc.expected_cells
    if ended:  # what happened, not the last forecast (nor its progress and Cells to come)
        start_s, end_s = job.start_time_s or None, job.end_time_s or None
        if start_s is not None and start_s == end_s:  # Slurm's mark of a job ended while pending
            start_s = None
        progress, cells = None, ()
    return JobRow(job.job_id, job.user, job.state, job.partition, gpus, gpu_type, nodes,
                  job.is_elastic, pc.cell, pc.plan, pc.micro_batches, pc.samples_per_s,
                  pc.requested, why, pc.error, source, measured,
                  format_utc(start_s) if start_s else None,
                  format_utc(end_s) if end_s else None, progress, cells)


def rows(jobs: Iterable[SlurmJob], include_finished: bool = False) -> list[JobRow]:
    """Rows of the active jobs (all jobs with ``include_finished``), by job id."""
    return [job_row(j) for j in sorted(jobs, key=lambda j: j.job_id)
            if include_finished or j.is_active]


COLUMNS = (("JOBID", 8), ("USER", 9), ("STATE", 12), ("PARTITION", 9), ("GPUS", 10),
           ("ELASTIC", 7), ("CELL", 13), ("PLAN", 18), ("SAMPLES/S", 9), ("START", 11), ("END", 11),
           ("WHY", 0))


def _why_cell(r: JobRow) -> str:
    # The columns stay as they were (scripts read them): where the plan and the speed come
    # from goes after the reason, in the last column, which is never truncated.
    notes = [_SOURCE_NOTES[r.plan_source]] if r.plan_source in _SOURCE_NOTES else []
    if r.measured_samples_per_s is not None:
        notes.append("samples/s measured")
    if not notes:
        return r.why or "-"
    return f"{r.why} [{'; '.join(notes)}]" if r.why else f"[{'; '.join(notes)}]"


def _cells(r: JobRow) -> list[str]:
    gpus = f"{r.gpus}" + (f"x{r.gpu_type}" if r.gpu_type else "") if r.gpus else "-"
    sps = f"{r.samples_per_s:.4g}" if r.samples_per_s is not None else "-"
    return [str(r.job_id), r.user or "-", r.state, r.partition or "-", gpus,
            "yes" if r.elastic else "no", r.cell or "-", r.plan or "-", sps, _short_time(r.expected_start),
            _short_time(r.expected_end), _why_cell(r)]


def _short_time(iso: str | None) -> str:
    """``11-25T12:03`` (UTC) of an ISO time, for the table."""
    return iso[5:16] if iso else "-"


def format_table(table: Sequence[JobRow]) -> str:
    """A fixed-width table like squeue's; the last column (WHY) is not truncated."""
    lines = []
    header = [name for name, _ in COLUMNS]
    for values in [header] + [_cells(r) for r in table]:
        out = []
        for (name, width), v in zip(COLUMNS, values):
            out.append(v if width == 0 else v[:width].ljust(width))
        lines.append(" ".join(out).rstrip())
    return "\n".join(lines)


def to_json(table: Sequence[JobRow]) -> dict:
    """The ``--json`` object: ``{"jobs": [row, ...]}``."""
    return {"jobs": [r.to_json() for r in table]}
