"""``slurm-ext squeue``: every job with its elastic Cell, plan, estimated speed and why.

Everything shown is read from Slurm (the daemon writes its plan into each elastic job's
AdminComment, which every user may read), so the view works for any user and needs no
access to the daemon's state file.

AdminComment format (written by the daemon, parsed here), space-separated ``key=value``
tokens; ``why=`` or ``error=`` comes last and its value runs to the end of the string::

    requested=a100 cell=a100x8:s2 plan=[dp2tp2|dp4tp1] mb=16 remat=1 layers=0,13,26 sps=412.5 why=fastest feasible

- ``requested``: the GPU type the user asked for (kept from the submit hook; ``any``).
- ``cell plan mb remat layers``: the plan string of ``estimator.plan_string`` (what the
  runner inside the job reads): ``cell`` is GPU type × GPU count and stage count
  (``<type>x<gpus>:s<stages>``), ``plan`` per stage ``dp<d>tp<t>`` separated by ``|``,
  ``mb`` micro-batches per iteration, ``remat`` 1 or 0, ``layers`` the stage boundaries.
- ``sps``: estimated samples per second.
- ``why``: why the job runs on this Cell, waits, or was rescaled.
- ``error``: the job's elastic spec is invalid; it runs as submitted.

The JSON form (``--json``) is ``{"jobs": [...]}``; each job has ``job_id`` (int),
``user``, ``state``, ``partition``, ``gpus`` (int: granted when running, requested
otherwise), ``gpu_type`` (str or null), ``nodes`` (int), ``elastic`` (bool), ``cell``
(str or null), ``plan`` (str or null), ``micro_batches`` (int or null),
``samples_per_s`` (float or null), ``requested`` (str or null), ``why`` (str), and
``spec_error`` (str or null).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass

from estimator.cells import Cell, StagePlan
from slurm_ext.slurm_client import SlurmJob

TAIL_KEYS = ("why", "error")
MAX_WHY_CHARS = 300
MAX_ADMIN_COMMENT_CHARS = 4000
_CELL = re.compile(r"(?P<type>[a-z0-9_]+)x(?P<gpus>\d+):s(?P<stages>\d+)")


@dataclass(frozen=True)
class PlanComment:
    """The parsed AdminComment of an elastic job (every field optional)."""

    requested: str | None = None
    cell: str | None = None
    plan: str | None = None
    micro_batches: int | None = None
    remat: bool | None = None
    layers: str | None = None
    samples_per_s: float | None = None
    why: str | None = None
    error: str | None = None

    def cell_parts(self) -> tuple[str, int, int] | None:
        """(gpu_type, num_gpus, num_stages) of ``cell``, or None."""
        m = _CELL.fullmatch(self.cell or "")
        return (m["type"], int(m["gpus"]), int(m["stages"])) if m else None


def plan_label(stages: Sequence[StagePlan]) -> str:
    """``[dp2tp2|dp4tp1]``: the per-stage data- and tensor-parallel degrees."""
    return "[" + "|".join(f"dp{s.dp}tp{s.tp}" for s in stages) + "]"


def _clean(text: str, limit: int) -> str:
    # One printable ASCII line: AdminComment is shown by squeue and scontrol verbatim.
    text = text.replace("→", "->").replace("×", "x")
    text = "".join(c if 32 <= ord(c) < 127 else "?" for c in " ".join(text.split()))
    return text[:limit]


def format_plan_comment(pc: PlanComment) -> str:
    """The AdminComment text of ``pc`` (parse_plan_comment reads it back)."""
    parts = []
    if pc.requested:
        parts.append(f"requested={_clean(pc.requested, 32).replace(' ', '')}")
    if pc.cell:
        parts.append(f"cell={pc.cell}")
    if pc.plan:
        parts.append(f"plan={pc.plan}")
    if pc.micro_batches is not None:
        parts.append(f"mb={pc.micro_batches}")
    if pc.remat is not None:
        parts.append(f"remat={int(pc.remat)}")
    if pc.layers:
        parts.append(f"layers={pc.layers}")
    if pc.samples_per_s is not None:
        parts.append(f"sps={pc.samples_per_s:.4g}")
    if pc.error is not None:
        parts.append(f"error={_clean(pc.error, MAX_WHY_CHARS)}")
    elif pc.why is not None:
        parts.append(f"why={_clean(pc.why, MAX_WHY_CHARS)}")
    return " ".join(parts)[:MAX_ADMIN_COMMENT_CHARS]


def parse_plan_comment(text: str | None) -> PlanComment:
    """Read an AdminComment written by the daemon; unknown or malformed tokens are ignored."""
    if not text:
        return PlanComment()
    values: dict[str, str] = {}
    rest = text.strip()
    while rest:
        word, _, after = rest.partition(" ")
        key, sep, value = word.partition("=")
        if sep and key in TAIL_KEYS:
            values[key] = (value + (" " + after if after else "")).strip()
            break
        if sep:
            values[key] = value
        rest = after.strip()

    def as_int(v):
        return int(v) if v is not None and v.isdigit() else None

    def as_float(v):
        try:
            return float(v) if v is not None else None
        except ValueError:
            return None

    return PlanComment(requested=values.get("requested"), cell=values.get("cell"),
                       plan=values.get("plan"), micro_batches=as_int(values.get("mb")),
                       remat={"1": True, "0": False}.get(values.get("remat", "")),
                       layers=values.get("layers"), samples_per_s=as_float(values.get("sps")), why=values.get("why"),
                       error=values.get("error"))


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

    def to_json(self) -> dict:
        return asdict(self)


def job_row(job: SlurmJob) -> JobRow:
    """The view of one job (pure: only the job's Slurm fields are read)."""
    running = job.state in ("RUNNING", "COMPLETING", "SUSPENDED") and job.granted_gpus_per_node
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
        if job.state == "PENDING" and reason and reason not in why:
            why = f"{why} (slurm: {reason})"
    elif job.is_elastic and job.state == "PENDING" and job.is_held:
        why = "waiting for the slurm-ext daemon"
    else:
        why = reason
    return JobRow(job.job_id, job.user, job.state, job.partition, gpus, gpu_type, nodes,
                  job.is_elastic, pc.cell, pc.plan, pc.micro_batches, pc.samples_per_s,
                  pc.requested, why, pc.error)


def rows(jobs: Iterable[SlurmJob], include_finished: bool = False) -> list[JobRow]:
    """Rows of the active jobs (all jobs with ``include_finished``), by job id."""
    return [job_row(j) for j in sorted(jobs, key=lambda j: j.job_id)
            if include_finished or j.is_active]


COLUMNS = (("JOBID", 8), ("USER", 9), ("STATE", 10), ("PARTITION", 9), ("GPUS", 10),
           ("ELASTIC", 7), ("CELL", 13), ("PLAN", 18), ("SAMPLES/S", 9), ("WHY", 0))


def _cells(r: JobRow) -> list[str]:
    gpus = f"{r.gpus}" + (f"x{r.gpu_type}" if r.gpu_type else "") if r.gpus else "-"
    sps = f"{r.samples_per_s:.4g}" if r.samples_per_s is not None else "-"
    return [str(r.job_id), r.user or "-", r.state, r.partition or "-", gpus,
            "yes" if r.elastic else "no", r.cell or "-", r.plan or "-", sps, r.why or "-"]


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
