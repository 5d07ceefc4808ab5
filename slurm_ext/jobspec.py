"""Elastic job specs: what a training job asks the daemon for, parsed from Slurm's fields.

A job is elastic when its Comment is ``elastic``, optionally followed by ``key=value``
settings. The same settings may be written in the batch script on lines of their own::

    #ELASTIC model=gpt-1.3b global_batch=64 iterations=2000
    #ELASTIC gpus=8 gpu_type=a100 deadline=2026-12-01T18:00:00Z guaranteed=yes
    #ELASTIC trainer=api    # a script of the user's own on the runtime API trains it

When a key is set in both places the Comment wins, as an ``sbatch`` command-line option
overrides an ``#SBATCH`` line: the Comment is what the user typed last.

The settings are read by ``estimator.contract`` (the runner reads them the same way);
this module validates them. Everything here is pure: reading the batch script and loading a model file are done by
the caller (the daemon), which passes their text or a loader function in. Every bad input
raises :class:`ElasticSpecError` (a :class:`~estimator.errors.SpecError`) that quotes the
offending text and says what to write instead; its message is short enough to be stored
in the job's AdminComment.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from datetime import datetime, timezone
from typing import Callable

from estimator.contract import (COMMENT_TAG, SCRIPT_TAG, ElasticSpecError, comment_settings, is_elastic,
                                merge_settings, script_settings)
from estimator.errors import SpecError
from estimator.gpus import CATALOG
from estimator.jobs import MAX_GLOBAL_BATCH, MAX_GPUS, MAX_ITERATIONS, MAX_STAGES, TRAINERS, JobSpec

REQUIRED_KEYS = ("model", "global_batch", "iterations")
_YES = {"yes", "true", "1", "on"}
_NO = {"no", "false", "0", "off"}


@dataclass(frozen=True)
class ElasticSpec:
    """A validated elastic job spec.

    Attributes:
        model: built-in model name or an absolute path to a model YAML file.
        global_batch: samples per iteration, fixed whatever the plan.
        iterations: training iterations the job needs in total.
        num_gpus: the GPU count asked for; None lets the scheduler choose.
        gpu_type: the GPU type asked for (catalog name); None lets the scheduler choose.
        deadline_s: Unix time the job should finish by, or None.
        guaranteed: the job must get at least the throughput of what it asked for.
        max_stages: the most pipeline stages the job's training script can run (1 for a
            script with data and tensor parallelism only); None: any stage count.
        trainer: ``runner`` (the built-in runner) or ``api`` (a script on the runtime API:
            one stage of data and tensor parallelism, ZeRO-0, every activation kept).
    """

    model: str
    global_batch: int
    iterations: int
    num_gpus: int | None = None
    gpu_type: str | None = None
    deadline_s: float | None = None
    guaranteed: bool = False
    max_stages: int | None = None
    trainer: str = "runner"

    def job_spec(self) -> JobSpec:
        """The job as the estimator sees it (what its Cells depend on)."""
        return JobSpec(self.model, self.global_batch, self.num_gpus, self.gpu_type, self.max_stages,
                       trainer=self.trainer)

    def to_json(self) -> dict:
        return {
            "model": self.model, "global_batch": self.global_batch,
            "iterations": self.iterations, "num_gpus": self.num_gpus,
            "gpu_type": self.gpu_type, "deadline_s": self.deadline_s,
            "guaranteed": self.guaranteed, "max_stages": self.max_stages, "trainer": self.trainer,
        }

    @classmethod
    def from_json(cls, raw: dict) -> "ElasticSpec":
        return cls(**{k: raw.get(k) for k in (
            "model", "global_batch", "iterations", "num_gpus", "gpu_type", "deadline_s", "max_stages")},
            guaranteed=bool(raw.get("guaranteed", False)), trainer=raw.get("trainer") or "runner")


def _int(settings: dict[str, str], key: str, low: int, high: int) -> int | None:
    raw = settings.get(key)
    if raw is None:
        return None
    try:
        value = int(raw, 10)
    except ValueError:
        raise ElasticSpecError(key, raw, f"give a whole number between {low} and {high}") from None
    if not low <= value <= high:
        raise ElasticSpecError(key, raw, f"give a whole number between {low} and {high}")
    return value


def check_power_of_two_gpus(count: int, what: str, advice: str) -> None:
    """A Cell's stages each run on a power-of-two GPU count, so its count is one too: any
    other count has no Cell. Raises ElasticSpecError; ``advice`` is formatted with the
    powers of two on either side (``below``, ``above``)."""
    if count > MAX_GPUS:
        raise ElasticSpecError("gpus", str(count), f"give at most {MAX_GPUS} GPUs")
    if count & (count - 1):
        below = 1 << (count.bit_length() - 1)
        raise ElasticSpecError("gpus", str(count), f"{what}; Cells run on power-of-two GPU counts (each pipeline "
                                                   f"stage on 1, 2, 4, 8, ...): "
                                                   + advice.format(below=below, above=2 * below))


def parse_deadline(raw: str) -> float:
    """ISO 8601 date or date-time → Unix seconds; a time without zone is taken as UTC."""
    text = raw[:-1] + "+00:00" if raw.endswith(("Z", "z")) else raw
    try:
        when = datetime.fromisoformat(text)
    except ValueError:
        raise ElasticSpecError("deadline", raw, "give an ISO 8601 time, e.g. 2026-12-01T18:00:00Z") from None
    if when.tzinfo is None:
        when = when.replace(tzinfo=timezone.utc)
    if not 2000 <= when.year <= 2200:
        raise ElasticSpecError("deadline", raw, "give a year between 2000 and 2200")
    return when.timestamp()


def spec_from_settings(settings: dict[str, str]) -> ElasticSpec:
    """Validate merged settings into an :class:`ElasticSpec` (the model is not loaded here)."""
    for key in REQUIRED_KEYS:
        if key not in settings:
            raise ElasticSpecError(key, None, f"missing; add {key}=... to the comment or an {SCRIPT_TAG} line")
    model = settings["model"]
    if ".." in model.split("/"):
        raise ElasticSpecError("model", model, "give a built-in model name or an absolute path without '..'")
    gpu = settings.get("gpu_type")
    if gpu is not None:
        gpu = gpu.lower()
        if gpu not in CATALOG:
            raise ElasticSpecError("gpu_type", settings["gpu_type"], f"unknown GPU type; use one of {', '.join(CATALOG)}")
    guaranteed_raw = settings.get("guaranteed", "no").lower()
    if guaranteed_raw not in _YES | _NO:
        raise ElasticSpecError("guaranteed", settings["guaranteed"], "write yes or no")
    deadline = settings.get("deadline")
    trainer = settings.get("trainer", "runner")
    if trainer not in TRAINERS:
        raise ElasticSpecError("trainer", trainer, "write runner (the built-in runner) or api (a script of "
                                                   "your own on the runtime API)")
    max_stages = _int(settings, "max_stages", 1, MAX_STAGES)
    if trainer == "api" and (max_stages or 1) != 1:
        raise ElasticSpecError("max_stages", settings["max_stages"], "a script on the runtime API runs one "
                                                                     "stage: leave max_stages out")
    num_gpus = _int(settings, "gpus", 1, MAX_GPUS)
    if num_gpus is not None:
        check_power_of_two_gpus(num_gpus, "not a power of two",
                                "ask for {below} or {above}, or leave gpus= out to let the scheduler choose")
    return ElasticSpec(
        model=model,
        global_batch=_int(settings, "global_batch", 1, MAX_GLOBAL_BATCH),
        iterations=_int(settings, "iterations", 1, MAX_ITERATIONS),
        num_gpus=num_gpus,
        gpu_type=gpu,
        deadline_s=parse_deadline(deadline) if deadline is not None else None,
        guaranteed=guaranteed_raw in _YES,
        max_stages=1 if trainer == "api" else max_stages,
        trainer=trainer,
    )


def parse_spec(comment: str | None, script: str | None = None,
               requested_gpus: int | None = None,
               requested_type: str | None = None) -> ElasticSpec:
    """The elastic spec of one job.

    Args:
        comment: the job's Comment (``elastic key=value ...``).
        script: the batch script text, or None when it could not be read.
        requested_gpus: the GPU count of the job's own Slurm request (e.g. ``--gres=gpu:4
            -N2`` is 8), used when the spec sets no ``gpus``.
        requested_type: the GPU type the user asked Slurm for (the submit hook keeps it as
            ``requested=<type>`` in AdminComment), used when the spec sets no ``gpu_type``.

    Raises:
        ElasticSpecError: not elastic, or any setting is missing, unknown or out of range.
    """
    if not is_elastic(comment):
        raise ElasticSpecError("comment", comment, f"not an elastic job; start the comment with '{COMMENT_TAG}'")
    settings = merge_settings(script_settings(script), comment_settings(comment))
    spec = spec_from_settings(settings)
    if spec.num_gpus is None and requested_gpus:
        count = min(int(requested_gpus), MAX_GPUS)
        check_power_of_two_gpus(count, f"the job asks Slurm for {count} GPUs and sets no gpus=",
                                "set gpus={below} or gpus={above}, or submit without a GPU count")
        spec = replace(spec, num_gpus=count)
    if spec.gpu_type is None and requested_type and requested_type.lower() in CATALOG:
        spec = replace(spec, gpu_type=requested_type.lower())
    return spec


def check_model(spec: ElasticSpec, load_model: Callable[[str], object]) -> object:
    """Load the spec's model with ``load_model``; any failure becomes an ElasticSpecError.

    A path must be absolute: the daemon does not run in the job's working directory.
    """
    if "/" in spec.model and not spec.model.startswith("/"):
        raise ElasticSpecError("model", spec.model, "give a built-in model name or an absolute path to a YAML file")
    try:
        return load_model(spec.model)
    except SpecError as e:
        raise ElasticSpecError("model", spec.model, e.hint) from None
    except (OSError, ValueError, TypeError, KeyError) as e:
        raise ElasticSpecError("model", spec.model, f"cannot be loaded: {type(e).__name__}") from None
