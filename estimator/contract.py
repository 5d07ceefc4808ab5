"""The contract between the daemon and a job's runner, in one place: what each writes
for the other, and what operators and tests rely on.

- **Exit codes** of the runner: ``EXIT_RESCALE`` (86) after SIGUSR1 and a checkpoint,
  which Slurm turns into a held requeue (``RequeueExitHold=86``); ``EXIT_TERMINATED``
  (143) after SIGTERM; ``EXIT_BAD_INPUT`` (2) for a spec or plan it cannot run;
  ``EXIT_DIVERGED`` (3) when an fp16 model's gradients stay non-finite even unscaled, or
  a bf16 or fp32 model's loss is not finite (the job ends FAILED; the daemon does not
  requeue it).
- **The AdminComment** the daemon writes on each elastic job (every user may read it),
  space-separated ``key=value`` tokens; ``why=`` or ``error=`` comes last and its value
  runs to the end of the string::

    requested=a100 cell=a100x8:s2 plan=[dp2tp2|dp4tp1] mb=16 remat=1 layers=0,13,26 sps=412.5 why=fastest feasible

  ``cell plan mb remat layers`` (and, when not the defaults, ``zero offload``) are the
  plan string the runner reads (``estimator.plan_string``); ``requested`` the GPU type asked for; ``src`` where a
  running plan came from when not the daemon (``tuned``, ``cached``, ``given``); ``sps``
  samples per second, measured when ``measured=1``; ``progress`` the share of iterations
  done; ``start`` and ``end`` the forecast (UTC, ``2026-11-25T12:03:40Z``; the expected
  start of a waiting job, the expected end of any) and ``via`` the Cells it is expected to
  pass through (``a10x4:s1,a100x8:s2``); ``why`` or ``error`` the reason.
  One parser (:func:`parse_plan_comment`), one formatter (:func:`format_plan_comment`),
  one length limit (``MAX_ADMIN_COMMENT_CHARS``).
- **The job's elastic settings**: ``elastic key=value ...`` in its Comment and
  ``#ELASTIC key=value ...`` lines in its batch script (the Comment wins). The daemon
  validates them into a spec (``slurm_ext.jobspec``); the runner reads model, global
  batch and iterations from the same parse.
- **The runner's report**, ``measured.json`` beside the job's checkpoints
  (:class:`RunnerReport`): the plan that runs, its measured speed and the current step.
  The daemon reads it for squeue, its estimates and the job's progress.
"""

from __future__ import annotations

import json
import math
import re
import unicodedata
from datetime import datetime, timezone
from dataclasses import MISSING, asdict, dataclass, fields

from estimator.errors import SpecError

# ------------------------------------------------------------------ exit codes

EXIT_DONE = 0
EXIT_BAD_INPUT = 2
EXIT_DIVERGED = 3  # the model diverged (fp16: gradients non-finite even unscaled): training stopped
EXIT_RESCALE = 86  # Slurm requeues the job held (RequeueExitHold=86)
EXIT_TERMINATED = 143

# ------------------------------------------------------------------ the AdminComment

TAIL_KEYS = ("why", "error")
# The plan string's tokens: what the runner reads from the AdminComment.
PLAN_KEYS = ("cell", "plan", "mb", "remat", "layers", "zero", "offload")
# Where a plan that runs came from when it is not the daemon's (the ``src`` token).
PLAN_SOURCES = ("tuned", "cached", "given", "estimated")  # estimated: ranked first, not measured
# The runner's report says ADMIN_COMMENT_PLAN when it runs the AdminComment's plan as is.
ADMIN_COMMENT_PLAN = "AdminComment"
RUNNER_PLAN_SOURCES = (ADMIN_COMMENT_PLAN, *PLAN_SOURCES)
MAX_WHY_CHARS = 300
MAX_FORECAST_CELLS = 8
MAX_ADMIN_COMMENT_CHARS = 4000  # what the daemon writes and what the Slurm client accepts
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
    zero_level: int = 0  # ``zero=``, written when not 0 (the ZeRO stage, 0–3)
    offload: bool = False  # ``offload=1``: master weights and optimizer states on the host
    samples_per_s: float | None = None
    why: str | None = None
    error: str | None = None
    plan_source: str | None = None  # one of PLAN_SOURCES; None: the daemon's own plan
    sps_measured: bool = False  # samples_per_s was measured on the running plan
    expected_start_s: float | None = None  # the forecast (Unix seconds), ``start=``
    expected_end_s: float | None = None  # ``end=``
    progress_frac: float | None = None  # iterations done / all, ``progress=``
    expected_cells: tuple[str, ...] = ()  # the Cells the forecast passes through, ``via=``

    def cell_parts(self) -> tuple[str, int, int] | None:
        """(gpu_type, num_gpus, num_stages) of ``cell``, or None."""
        m = _CELL.fullmatch(self.cell or "")
        return (m["type"], int(m["gpus"]), int(m["stages"])) if m else None


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
    if pc.zero_level in (1, 2, 3):
        parts.append(f"zero={pc.zero_level}")
    if pc.offload:
        parts.append("offload=1")
    if pc.plan_source in PLAN_SOURCES:
        parts.append(f"src={pc.plan_source}")
    if pc.samples_per_s is not None:
        parts.append(f"sps={pc.samples_per_s:.4g}")
        if pc.sps_measured:
            parts.append("measured=1")
    if pc.progress_frac is not None:
        parts.append(f"progress={min(1.0, max(0.0, pc.progress_frac)):.3f}")
    if shown_time(pc.expected_start_s):
        parts.append(f"start={format_utc(pc.expected_start_s)}")
    if shown_time(pc.expected_end_s):
        parts.append(f"end={format_utc(pc.expected_end_s)}")
    cells = [c for c in pc.expected_cells if _CELL.fullmatch(c)][:MAX_FORECAST_CELLS]
    if cells:
        parts.append(f"via={','.join(cells)}")
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

    def as_float(v):  # a finite number (nan and inf are malformed: JSON has neither)
        try:
            f = float(v) if v is not None else None
        except ValueError:
            return None
        return f if f is not None and math.isfinite(f) else None

    sps = as_float(values.get("sps"))
    progress = as_float(values.get("progress"))
    return PlanComment(requested=values.get("requested"), cell=values.get("cell"),
                       plan=values.get("plan"), micro_batches=as_int(values.get("mb")),
                       remat={"1": True, "0": False}.get(values.get("remat", "")),
                       layers=values.get("layers"), zero_level={"1": 1, "2": 2, "3": 3}.get(values.get("zero", ""), 0),
                       offload=values.get("offload") == "1", samples_per_s=sps, why=values.get("why"),
                       error=values.get("error"),
                       plan_source=values.get("src") if values.get("src") in PLAN_SOURCES else None,
                       sps_measured=values.get("measured") == "1" and sps is not None,
                       expected_start_s=parse_utc(values.get("start")), expected_end_s=parse_utc(values.get("end")),
                       progress_frac=progress if progress is not None and 0.0 <= progress <= 1.0 else None,
                       expected_cells=tuple(c for c in values.get("via", "").split(",") if _CELL.fullmatch(c)))


# The latest time a forecast shows: a datetime's last year. A job whose estimate puts its
# end past it (a billion iterations of a slow model) shows none rather than a wrong one.
LATEST_SHOWN_S = datetime(9999, 12, 31, tzinfo=timezone.utc).timestamp()


def shown_time(t_s: float | None) -> bool:
    """Whether ``t_s`` is a time the AdminComment can show (:func:`format_utc`)."""
    return t_s is not None and 0.0 <= t_s <= LATEST_SHOWN_S


def format_utc(t_s: float) -> str:
    """``2026-11-25T12:03:40Z``: a time in a form every user reads (UTC, whole seconds)."""
    return datetime.fromtimestamp(round(t_s), tz=timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_utc(text: str | None) -> float | None:
    """The Unix time of a :func:`format_utc` text, or None when it is not one."""
    if not text:
        return None
    try:
        return datetime.strptime(text, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=timezone.utc).timestamp()
    except ValueError:
        return None


def plan_tokens(admin_comment: str | None) -> str | None:
    """The plan part of an AdminComment (the daemon adds ``why=...`` and other words), or
    None when it names no Cell and plan."""
    if not admin_comment:
        return None
    words = []
    for w in admin_comment.split():
        key, sep, _ = w.partition("=")
        if sep and key in TAIL_KEYS:
            break  # free text from here on: a ``why`` may say ``mb=3`` too
        if sep and key in PLAN_KEYS:
            words.append(w)
    keys = {w.partition("=")[0] for w in words}
    return " ".join(words) if {"cell", "plan"} <= keys else None


# ------------------------------------------------------------------ elastic settings

COMMENT_TAG = "elastic"
SCRIPT_TAG = "#ELASTIC"
KEYS = ("model", "global_batch", "iterations", "gpus", "gpu_type", "deadline", "guaranteed", "max_stages",
        "trainer")
# Limits that keep a hostile or broken submission from costing the daemon time or memory.
MAX_COMMENT_CHARS = 1024
MAX_SCRIPT_CHARS = 4 << 20
MAX_SCRIPT_SPEC_LINES = 32
MAX_VALUE_CHARS = 256
MAX_QUOTED_CHARS = 60
# Values are names, numbers, dates and paths: nothing a shell or Slurm would interpret.
_SAFE_VALUE = re.compile(r"[A-Za-z0-9._/:+\-]+")
_KEY = re.compile(r"[a-z_]+")


class ElasticSpecError(SpecError):
    """An elastic job's spec is invalid; the job runs as submitted and this is shown.

    The message is one line, quotes (a bounded prefix of) the bad input and says what to
    write instead.
    """

    def __init__(self, field: str, value: object, hint: str):
        if isinstance(value, str) and len(value) > MAX_QUOTED_CHARS:
            value = value[:MAX_QUOTED_CHARS] + "..."
        super().__init__(field, value, hint)


# What separates words of a Comment: ASCII white space only, as the submit hook's Lua
# ``%s`` reads it (Python's own split also takes U+00A0, U+001F, ...: a comment the hook
# had let through as a plain job would have been elastic to the daemon).
ASCII_SPACE = " \t\n\v\f\r"
_WORD_BREAK = re.compile(f"[{re.escape(ASCII_SPACE)}]+")


def comment_words(text: str) -> list[str]:
    """The words of a Comment, split at ASCII white space only (``ASCII_SPACE``)."""
    return [w for w in _WORD_BREAK.split(text) if w]


def is_elastic(comment: str | None) -> bool:
    """True when a job's Comment marks it elastic (first word ``elastic``, any case)."""
    if not comment:
        return False
    text = comment.lstrip(ASCII_SPACE)
    after = text[len(COMMENT_TAG):len(COMMENT_TAG) + 1]
    return text[:len(COMMENT_TAG)].lower() == COMMENT_TAG and (after == "" or after in ASCII_SPACE)


def _pairs(text: str, source: str) -> dict[str, str]:
    """``key=value`` words of one source; duplicates and unknown keys are errors."""
    out: dict[str, str] = {}
    for word in comment_words(text):
        key, sep, value = word.partition("=")
        if not sep:
            raise ElasticSpecError(source, word, "write settings as key=value, e.g. model=gpt-1.3b")
        key = key.strip().lower()
        if not _KEY.fullmatch(key) or key not in KEYS:
            raise ElasticSpecError(source, word, f"unknown key; use {', '.join(KEYS)}")
        if key in out:
            raise ElasticSpecError(key, value, f"set twice in the {source}; keep one")
        if not value:
            raise ElasticSpecError(key, value, "empty value")
        if len(value) > MAX_VALUE_CHARS:
            raise ElasticSpecError(key, value, f"longer than {MAX_VALUE_CHARS} characters")
        if not _SAFE_VALUE.fullmatch(value):
            raise ElasticSpecError(key, value,
                                   "only letters, digits and . _ / : + - are allowed (no quotes, spaces or shell characters)")
        out[key] = value
    return out


def comment_settings(comment: str | None) -> dict[str, str]:
    """The ``key=value`` settings after ``elastic`` in a Comment (empty if none)."""
    if comment is None:
        return {}
    if len(comment) > MAX_COMMENT_CHARS:
        raise ElasticSpecError("comment", comment, f"longer than {MAX_COMMENT_CHARS} characters")
    if not is_elastic(comment):
        return {}
    if any(unicodedata.category(ch) in ("Cc", "Zl", "Zp") and ch != "\t" for ch in comment.strip()):
        # A line break: the runner reads the Comment from `scontrol show job`, line by line,
        # and would read another spec than the daemon (which reads it whole). At its ends
        # (stripped by both) it changes nothing.
        raise ElasticSpecError("comment", comment, "give the settings on one line, without control characters")
    rest = comment.lstrip(ASCII_SPACE)[len(COMMENT_TAG):]
    # Slurm shows a comment with commas or semicolons unchanged; accept them as separators
    # so `--comment="elastic model=x,global_batch=8"` works too.
    rest = re.sub(r"[,;]", " ", rest)
    return _pairs(rest, "comment")


def script_settings(script: str | None) -> dict[str, str]:
    """The settings of the ``#ELASTIC`` lines of a batch script (empty if none).

    Lines count only when ``#ELASTIC`` starts the line, as ``#SBATCH`` does.
    """
    if not script:
        return {}
    if len(script) > MAX_SCRIPT_CHARS:
        raise ElasticSpecError("script", f"{len(script)} characters",
                               f"batch scripts above {MAX_SCRIPT_CHARS} characters are not read")
    lines = [line for line in script.splitlines() if line.startswith(SCRIPT_TAG)]
    if len(lines) > MAX_SCRIPT_SPEC_LINES:
        raise ElasticSpecError("script", f"{len(lines)} #ELASTIC lines",
                               f"use at most {MAX_SCRIPT_SPEC_LINES}")
    words: list[str] = []
    for line in lines:
        rest = line[len(SCRIPT_TAG):]
        if rest and not rest[0].isspace():
            raise ElasticSpecError("script", line, f"put a space after {SCRIPT_TAG}")
        # A trailing shell comment on the line is allowed and ignored.
        words.append(rest.split("#", 1)[0])
    return _pairs(" ".join(words), "batch script")


def merge_settings(from_script: dict[str, str], from_comment: dict[str, str]) -> dict[str, str]:
    """Script settings overridden by comment settings."""
    return {**from_script, **from_comment}


# ------------------------------------------------------------------ the runner's report

MEASURED_FILE = "measured.json"  # beside the job's checkpoints: ROOT/<job id>/measured.json
MAX_MEASURED_BYTES = 1 << 20  # the daemon reads no larger report
MAX_REPORTED_INT = 1 << 53  # a larger integer in it is not a step or a count (nor a float)


@dataclass(frozen=True)
class RunnerReport:
    """What the runner writes to ``measured.json`` (and the daemon reads).

    Attributes:
        job_id: the Slurm job id, and ``restart_count`` its run: a report of an earlier
            run (before a rescale) says nothing about the current one.
        cell: the Cell label that runs (``a100x8:s2``); ``plan`` its plan string;
            ``plan_source`` one of ``RUNNER_PLAN_SOURCES``.
        iteration_time_s: mean seconds per step after warm-up, over ``steps_measured``
            steps; ``samples_per_s`` the same as a speed.
        step: the last step done, at Unix time ``step_at_s``.
        platform: ``gpu`` or ``cpu`` (CPU fake devices: lab and tests).
        tuning_s: seconds the run spent measuring ``candidates_measured`` plans.
        startup_s: seconds from the runtime's start to the end of the first step, less
            the tuning: devices, the model's state (``init_s`` built fresh or
            ``restore_s`` read from a checkpoint) and the first step's compilation; what
            a (re)start costs besides tuning (the simulator's ``RestartCosts``).
        final_save_s: seconds the last checkpoint took to reach the disk at exit (on
            SIGUSR1: the save a rescale waits for).
        peak_memory_gb: the largest peak of memory in use on any of this process's
            devices (GPUs only: JAX's ``memory_stats``; None on CPU fake devices).
    """

    job_id: str | None
    restart_count: int | None
    cell: str | None
    plan: str | None
    plan_source: str | None
    global_batch: int | None
    num_devices: int | None
    platform: str | None
    iteration_time_s: float | None
    steps_measured: int | None
    samples_per_s: float | None
    step: int | None
    step_at_s: float | None
    updated_at_s: float | None
    tuning_s: float = 0.0
    candidates_measured: int = 0
    startup_s: float | None = None
    init_s: float | None = None
    restore_s: float | None = None
    final_save_s: float | None = None
    peak_memory_gb: float | None = None

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_text(cls, text: str) -> "RunnerReport | None":
        """The report in a ``measured.json`` text, or None when it is not a JSON object.
        A field of the wrong type reads as None (the daemon never trusts a bad value)."""
        try:
            raw = json.loads(text)
        except (ValueError, RecursionError):  # RecursionError: "[[[[…" thousands deep
            return None
        if not isinstance(raw, dict):
            return None
        kinds = {"str": str, "int": int, "float": float}
        out = {}
        for f in fields(cls):
            value = raw.get(f.name)
            kind = kinds[f.type.split(" | ")[0]]
            if isinstance(value, bool) or (isinstance(value, int) and abs(value) > MAX_REPORTED_INT):
                value = None  # JSON true/false is never a number here; no count is this large
            elif kind is float and isinstance(value, int):
                value = float(value)
            elif f.name == "job_id" and isinstance(value, int):
                value = str(value)  # a job id written as a number
            good = isinstance(value, kind) and not (kind is float and not math.isfinite(value))
            out[f.name] = value if good else (None if f.default is MISSING else f.default)
        return cls(**out)
