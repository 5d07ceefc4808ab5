"""A training job as the estimator sees it: which model, what global batch, what was asked."""

from dataclasses import dataclass

from estimator.errors import SpecError
from estimator.gpus import gpu_type as _gpu_type
from estimator.models import ModelSpec, load_model

MAX_GLOBAL_BATCH = 1 << 24
MAX_GPUS = 1 << 16
MAX_STAGES = 1 << 10
MAX_ITERATIONS = 10**9  # an elastic job's iterations
# What trains a job: the built-in runner (pipelines, ZeRO 0-3, expert parallelism, remat)
# or a script of the user's own on the runtime API (one stage of data and tensor
# parallelism, optimizer states replicated, every activation kept).
TRAINERS = ("runner", "api")


@dataclass(frozen=True)
class JobSpec:
    """What a user asks for.

    Attributes:
        model: a built-in model name (``gpt-1.3b``) or a path to a model YAML file.
        global_batch: samples per iteration; fixed whatever the plan.
        num_gpus: the GPU count asked for; None lets the estimator choose ("serverless").
        gpu_type: the GPU type asked for, or None.
        max_stages: the most pipeline stages the job's training script can run (1 for a
            script with data and tensor parallelism only); None: any stage count.
        trainer: what trains it (`TRAINERS`): ``api`` limits its Cells to what a script on
            the runtime API runs (one stage, ZeRO-0, no remat, no expert parallelism).
        model_spec: the model, already loaded by a caller that checked who may read its
            file (the daemon, which runs as root, reads a user's file once, as that user
            could): the estimator then never opens ``model`` itself. None: loaded from
            ``model``.
    """

    model: str
    global_batch: int
    num_gpus: int | None = None
    gpu_type: str | None = None
    max_stages: int | None = None
    model_spec: ModelSpec | None = None
    trainer: str = "runner"

    def __post_init__(self):
        if not isinstance(self.global_batch, int) or isinstance(self.global_batch, bool) \
                or not 0 < self.global_batch <= MAX_GLOBAL_BATCH:
            raise SpecError("global_batch", self.global_batch, f"give a positive integer ≤ {MAX_GLOBAL_BATCH}")
        if self.num_gpus is not None and (
                not isinstance(self.num_gpus, int) or isinstance(self.num_gpus, bool)
                or not 0 < self.num_gpus <= MAX_GPUS):
            raise SpecError("num_gpus", self.num_gpus, f"give a positive integer ≤ {MAX_GPUS}")
        if self.max_stages is not None and (
                not isinstance(self.max_stages, int) or isinstance(self.max_stages, bool)
                or not 0 < self.max_stages <= MAX_STAGES):
            raise SpecError("max_stages", self.max_stages, f"give a positive integer ≤ {MAX_STAGES}, "
                            "or leave it out to allow any stage count")
        if self.gpu_type is not None:
            object.__setattr__(self, "gpu_type", _gpu_type(self.gpu_type).name)
        if self.trainer not in TRAINERS:
            raise SpecError("trainer", self.trainer, f"use one of {', '.join(TRAINERS)}")
        if self.trainer == "api":
            if (self.max_stages or 1) != 1:
                raise SpecError("max_stages", self.max_stages, "a script on the runtime API runs one stage")
            object.__setattr__(self, "max_stages", 1)


def job_model(job: JobSpec) -> ModelSpec:
    """The job's model: the one given with it, else loaded from its name or path."""
    return job.model_spec if job.model_spec is not None else load_model(job.model)
