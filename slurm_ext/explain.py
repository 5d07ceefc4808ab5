"""``slurm-ext explain JOB``: a job's Cells, the one it got and why, its history, its
forecast, and, when it waits, why and what the user can do.

Everything comes from what any user may read: the job's Slurm record (its AdminComment,
where the daemon writes the plan, the reason and the forecast), its own batch script and
the nodes (for its Cells' estimates). The daemon's journal adds the rescale history when
the caller can read the state file; without it the history is the job's restart count.

The JSON form (``--json``) is one object: ``job_id`` (int), ``state``, ``elastic`` (bool),
``spec`` (the elastic settings, or null), ``spec_error`` (str or null), ``cells`` (every
Cell the estimator enumerated, as ``slurm-ext estimate`` prints them), ``chosen`` (the
Cell and plan of its AdminComment with their estimate, its samples/s and whether the
runner measured it, ``samples_per_s_measured``; or null), ``why_chosen`` (str or
null), ``history`` (``[{"at", "kind", "state", "detail"}]``, ISO 8601 UTC, oldest first),
``restarts`` (int), ``forecast`` (``{"expected_start", "expected_end", "progress_frac"}``)
and ``waiting`` (``{"category", "detail", "what_to_do"}`` when it waits, else null).
"""

from __future__ import annotations

from dataclasses import dataclass

from estimator.cells import CellEstimate
from estimator.contract import PlanComment, format_utc
from slurm_ext.limits import STUCK_REASONS, per_job_limit, waits_on_its_own_condition
from slurm_ext.slurm_client import TERMINAL_STATES, SlurmJob
from slurm_ext.squeue_view import job_row
from slurm_ext.store import JournalEntry

# Why a job waits, each with what its user can do about it.
NOT_ELASTIC = "not elastic"
SPEC_ERROR = "spec error"
NO_CELL_FITS = "no Cell fits"
NOT_PLANNED = "not planned yet"
WAITING_FOR_GPUS = "waiting for GPUs"
STARTING = "starting"
KEPT_BACK = "kept back by Slurm"
DECIDED_AGAIN = "to be decided again"
_WHAT_TO_DO = {
    NOT_ELASTIC: "Slurm schedules it as submitted; add --comment=elastic to let slurm-ext size it",
    SPEC_ERROR: "fix the #ELASTIC line or the comment (the error says what), then resubmit",
    NO_CELL_FITS: "lower global_batch, allow more GPUs (gpus=) or another gpu_type, or pick a smaller model",
    NOT_PLANNED: "wait for the daemon's next round; if it stays so, ask the admin whether slurm-ext runs",
    WAITING_FOR_GPUS: "nothing: it starts when the GPUs come free; fewer GPUs (gpus=) may start it sooner",
    STARTING: "nothing: Slurm starts it as soon as the GPUs it was given are free",
    DECIDED_AGAIN: "nothing: the daemon gives it another Cell in its next rounds (one under the limit, or of "
                   "another partition)",
    KEPT_BACK: "nothing for slurm-ext: Slurm starts it on its Cell once its own condition holds (a dependency, "
               "a begin time, a limit of its account or QOS; `scontrol show job` says which)",
}


@dataclass(frozen=True)
class Waiting:
    category: str
    detail: str

    def to_json(self) -> dict:
        return {"category": self.category, "detail": self.detail, "what_to_do": _WHAT_TO_DO[self.category]}


def chosen_estimate(pc: PlanComment, estimates: tuple[CellEstimate, ...]) -> CellEstimate | None:
    """The estimate of the Cell the AdminComment names (its plan's, when enumerated)."""
    parts = pc.cell_parts()
    if parts is None:
        return None
    same = [e for e in estimates if (e.cell.gpu_type, e.cell.num_gpus, e.cell.num_stages) == parts]
    return min(same, key=lambda e: (not e.feasible, e.iteration_time_s), default=None)


def why_chosen(pc: PlanComment, chosen: CellEstimate | None, estimates: tuple[CellEstimate, ...]) -> str | None:
    """Why its Cell beat the others: the fastest feasible one, or how much faster the
    faster ones were and the daemon's reason for not giving them."""
    if chosen is None:
        return None
    feasible = sorted((e for e in estimates if e.feasible), key=lambda e: e.iteration_time_s)
    faster = [e for e in feasible if e.iteration_time_s < chosen.iteration_time_s * 0.999]
    if not faster:
        return f"{chosen.cell.label()} is the fastest Cell that fits ({chosen.samples_per_s:.4g} samples/s)"
    best = faster[0]
    return (f"{len(faster)} Cell(s) would be faster, the best {best.cell.label()} at {best.samples_per_s:.4g} "
            f"samples/s against {chosen.samples_per_s:.4g}; the daemon said: {pc.why or 'no reason given'}")


def waiting(job: SlurmJob, pc: PlanComment, estimates: tuple[CellEstimate, ...] | None,
            spec_error: str | None, is_held: bool) -> Waiting | None:
    """Why a pending job waits (None when it runs or has ended); a job suspended by a
    rescale (requeued held) waits too."""
    if job.state != "PENDING" and "PENDING" not in job.state_flags and not is_held:
        return None
    if not job.is_elastic:
        return Waiting(NOT_ELASTIC, f"slurm: {job.reason or 'pending'}")
    if spec_error or pc.error:
        return Waiting(SPEC_ERROR, spec_error or pc.error)
    if estimates is not None and not any(e.feasible for e in estimates):
        reasons = sorted({e.reason for e in estimates if e.reason})
        return Waiting(NO_CELL_FITS, "; ".join(reasons[:3]) or "no Cell enumerated")
    if not is_held and pc.cell is not None and (job.reason in STUCK_REASONS or per_job_limit(job)):
        # What the daemon takes for a launch Slurm will never make (``limits.launch_is_stale``).
        return Waiting(DECIDED_AGAIN, f"released on {pc.cell}, which Slurm will not start as it is "
                                      f"(slurm: {job.reason})")
    if not is_held and pc.cell is not None and waits_on_its_own_condition(job):
        return Waiting(KEPT_BACK, f"released on {pc.cell}; slurm: {job.reason}")
    if not is_held and pc.cell is not None:
        return Waiting(STARTING, f"released on {pc.cell} (slurm: {job.reason or 'pending'})")
    if pc.why is None:
        return Waiting(NOT_PLANNED, "the daemon has not written a plan or a reason yet")
    start = f"; expected start {format_utc(pc.expected_start_s)}" if pc.expected_start_s else ""
    return Waiting(WAITING_FOR_GPUS, f"{pc.why}{start}")


def history(entries: tuple[JournalEntry, ...]) -> list[dict]:
    """The daemon's actions on the job, from its journal."""
    return [{"at": format_utc(e.created_s), "kind": e.kind, "state": e.state,
             "detail": (e.update.admin_comment if e.update and e.update.admin_comment else e.note)}
            for e in entries]


def forecast_json(job: SlurmJob) -> dict:
    """The forecast as ``slurm-ext squeue --json`` shows it for the job."""
    row = job_row(job)
    return {"expected_start": row.expected_start, "expected_end": row.expected_end,
            "progress_frac": row.progress_frac}


def format_text(doc: dict) -> str:
    """The explanation for people, from the JSON form."""
    lines = [f"job {doc['job_id']}: {doc['state']}" + ("" if doc["elastic"] else " (not elastic)")]
    if doc["spec_error"]:
        lines.append(f"spec error: {doc['spec_error']}")
    if doc["chosen"]:
        c = doc["chosen"]
        speed = (f"{c['samples_per_s']} samples/s {'measured' if c.get('samples_per_s_measured') else 'estimated'}"
                 if c["samples_per_s"] is not None else "speed not known yet")
        memory = f", {c['peak_memory_gb']} GB per GPU" if c["peak_memory_gb"] is not None else ""
        lines.append(f"Cell: {c['cell']} plan {c['plan']} ({speed}{memory})")
    if doc["why_chosen"]:
        lines.append(f"why this Cell: {doc['why_chosen']}")
    f = doc["forecast"]
    if f["expected_start"] or f["expected_end"]:
        label = "ran" if doc["state"] in TERMINAL_STATES else "forecast"
        lines.append(f"{label}: start {f['expected_start'] or 'unknown'}, end {f['expected_end'] or 'unknown'}"
                     + (f", {100 * f['progress_frac']:.1f} % done" if f["progress_frac"] is not None else ""))
    if doc["waiting"]:
        w = doc["waiting"]
        lines.append(f"waiting: {w['category']}: {w['detail']}")
        lines.append(f"what you can do: {w['what_to_do']}")
    lines.append(f"restarts: {doc['restarts']}")
    for h in doc["history"]:
        lines.append(f"  {h['at']} {h['kind']} ({h['state']}): {h['detail']}")
    if doc["cells"]:
        lines.append("Cells (fastest first; * = infeasible):")
        for c in doc["cells"]:
            label = f"{c['gpu_type']}x{c['num_gpus']}:s{c['num_stages']}"
            if c["feasible"]:
                lines.append(f"  {label:<14} {c['samples_per_s']:>10.4g} samples/s {c['peak_memory_gb']:>8.2f} GB")
            else:
                lines.append(f"* {label:<14} {c['reason']}")
    return "\n".join(lines)
