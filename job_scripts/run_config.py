"""What a training process was told, resolved once: flag > environment > the job's
Comment > its ``#ELASTIC`` lines > defaults.

Shared by the built-in runner (``python -m job_scripts.run``) and researchers' own
scripts (``job_scripts.runtime.start``). Pure: the environment, the allocation, the
Comment and the batch script's text are passed in.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from estimator.errors import SpecError
from estimator.jobs import MAX_GLOBAL_BATCH, MAX_ITERATIONS
from job_scripts.slurm_env import SlurmAllocation, int_var

PLAN_ENV = "SLURM_EXT_PLAN"
CHECKPOINT_ROOT_ENV = "SLURM_EXT_CHECKPOINT_ROOT"
COMPILE_CACHE_ENV = "SLURM_EXT_COMPILE_CACHE"
LAUNCH_ENV = "SLURM_EXT_LAUNCH"
SCRIPT_ENV = "SLURM_EXT_ELASTIC_SCRIPT"
# The job's elastic settings as the batch process read them, passed to the tasks srun
# starts on every node: Slurm's copy of the batch script is on the batch node only.
SETTINGS_ENV = "SLURM_EXT_ELASTIC_SETTINGS"
CHECKPOINT_EVERY_ENV = "SLURM_EXT_CHECKPOINT_EVERY"
DEFAULT_CHECKPOINT_EVERY = 50  # steps between periodic checkpoints unless set (0: none)
TUNE_ENV = "SLURM_EXT_TUNE"
TUNE_WORDS = {"1": True, "yes": True, "on": True, "true": True, "0": False, "no": False, "off": False,
              "false": False}
TUNE_BUDGET_ENV = "SLURM_EXT_TUNE_BUDGET_S"
TUNE_FRAC_ENV = "SLURM_EXT_TUNE_BUDGET_FRAC"
COMPILE_CACHE_DIR = "jax-cache"  # beside the jobs' checkpoint directories
# The compile cache is shared by every job under one root: JAX evicts its least recently
# used programs beyond this many GB (0: no bound).
COMPILE_CACHE_MAX_GB_ENV = "SLURM_EXT_COMPILE_CACHE_MAX_GB"
DEFAULT_COMPILE_CACHE_MAX_GB = 20.0
TUNED_CACHE_DIR = "tuned-plans"  # likewise: tuned plans per (model, global batch, Cell)
DEFAULT_TUNE_BUDGET_S = 600.0
DEFAULT_TUNE_FRAC = 0.05


@dataclass(frozen=True)
class TuneConfig:
    """How long the runner may spend choosing its plan inside the allocation.

    Attributes:
        enabled: tune at all (else the plan given or in the AdminComment runs as is).
        budget_s: at most this many seconds of measuring.
        budget_frac: and at most this fraction of the job's expected remaining run time.
        cache_dir: where tuned plans are kept per (model, global batch, Cell), or None.
    """

    enabled: bool = True
    budget_s: float = DEFAULT_TUNE_BUDGET_S
    budget_frac: float = DEFAULT_TUNE_FRAC
    cache_dir: Path | None = None


@dataclass(frozen=True)
class RunConfig:
    """Everything a training process was told.

    ``model`` and ``iterations`` may be None for a researcher's script that knows its own
    model and stops when it likes; the built-in runner requires both.
    """

    model: str | None
    global_batch: int
    iterations: int | None
    plan_text: str | None
    checkpoint_dir: Path
    checkpoint_every: int
    keep: int
    seed: int
    num_devices: int
    platform: str  # cpu | gpu
    warmup_steps: int
    compile_cache_dir: str | None
    launch: str  # single | srun (one process per node, joined by jax.distributed)
    compile_cache_max_bytes: int = -1  # JAX's jax_compilation_cache_max_size (-1: no bound)
    tune: TuneConfig = TuneConfig()
    job_checkpoint_dir: bool = False  # checkpoint_dir is ROOT/<job id>, not one given
    # Where the runner's report (measured.json) goes: ROOT/<job id>, where the daemon reads
    # it, even when the checkpoints are an earlier job's (--checkpoint-dir); None: beside them.
    report_dir: Path | None = None


def _number(settings: dict[str, str], key: str) -> int | None:
    raw = settings.get(key)
    if raw is not None and not (raw.isascii() and raw.isdigit()):  # int() refuses '²'
        raise SpecError(key, raw, "give a whole number")
    return None if raw is None else int(raw)


def _float_env(env: dict[str, str], name: str, default: float) -> float:
    raw = env.get(name, "").strip()
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise SpecError(name, raw, "give a number") from None
    if not value >= 0:  # NaN too
        raise SpecError(name, raw, "give a non-negative number")
    return value


def _non_negative(key: str, value: float) -> float:
    if not value >= 0:  # NaN too
        raise SpecError(key, value, "give a non-negative number")
    return value


def _whole(key: str, value: int, least: int, what: str, most: int | None = None) -> int:
    """``value`` when it is a whole number in [``least``, ``most``]; ``what`` says what it counts."""
    if isinstance(value, bool) or not isinstance(value, int) or value < least or (most is not None and value > most):
        bound = f"≥ {least}" if most is None else f"in {least} … {most}"
        raise SpecError(key, value, f"give a whole number {bound} ({what})")
    return value


def resolve_config(given: dict, env: dict[str, str], alloc: SlurmAllocation,
                   settings: dict[str, str], gpu_available: bool,
                   require: tuple[str, ...] = ()) -> RunConfig:
    """Resolve the configuration.

    Args:
        given: explicit values (command-line flags or keyword arguments); None = not given.
            Keys: model, global_batch, iterations, plan, checkpoint_root, checkpoint_dir,
            checkpoint_every, keep, seed, devices, platform, warmup_steps, launch,
            compile_cache, tune, tune_budget_s, tune_budget_frac.
        env: the environment.
        alloc: the allocation Slurm granted.
        settings: the job's ``#ELASTIC`` settings overridden by its Comment's.
        gpu_available: whether JAX can use GPUs here.
        require: keys that must be known (``model``, ``iterations``).

    Raises:
        SpecError: a missing or malformed value, named, with how to give it.
    """
    def pick(key):
        return given.get(key) if given.get(key) is not None else None

    model = pick("model") or settings.get("model")
    batch = pick("global_batch") if pick("global_batch") is not None else _number(settings, "global_batch")
    iterations = pick("iterations") if pick("iterations") is not None else _number(settings, "iterations")
    for name, value in (("global_batch", batch), *((k, {"model": model, "iterations": iterations}[k])
                                                      for k in require)):
        if value is None:
            raise SpecError(name, None, f"give --{name.replace('_', '-')} or an #ELASTIC {name}=... line")
    _whole("global_batch", batch, 1, "samples per step", MAX_GLOBAL_BATCH)
    if iterations is not None:
        _whole("iterations", iterations, 1, "steps to train", MAX_ITERATIONS)
    default_cache, tuned_dir = "", None
    root = pick("checkpoint_root") or env.get(CHECKPOINT_ROOT_ENV) or (
        str(Path(alloc.submit_dir) / "checkpoints") if alloc.submit_dir else "checkpoints")
    if pick("checkpoint_dir"):
        ckpt = Path(given["checkpoint_dir"])
    else:
        ckpt = Path(root) / (alloc.job_id or "local")
        default_cache = str(Path(root) / COMPILE_CACHE_DIR)
        tuned_dir = Path(root) / TUNED_CACHE_DIR
    platform = pick("platform") or "auto"
    if platform == "auto":
        platform = "gpu" if gpu_available else "cpu"
    if platform not in ("cpu", "gpu"):
        raise SpecError("platform", platform, "give auto, cpu or gpu")
    devices = pick("devices")
    devices = (alloc.num_gpus or 1) if devices is None else _whole("devices", devices, 1, "devices to use")
    # Shared by the jobs under one root: a job restarted on a plan seen before (its own
    # or another job's) skips most of XLA's compile.
    cache = given.get("compile_cache")
    cache = env.get(COMPILE_CACHE_ENV, default_cache) if cache is None else cache
    max_gb = _float_env(env, COMPILE_CACHE_MAX_GB_ENV, DEFAULT_COMPILE_CACHE_MAX_GB)
    if max_gb == float("inf"):
        raise SpecError(COMPILE_CACHE_MAX_GB_ENV, max_gb, "give a number of GB (0: no bound)")
    checkpoint_every = pick("checkpoint_every")
    # A hard kill (a node lost, the time limit) loses the steps since the last checkpoint:
    # without a setting, every DEFAULT_CHECKPOINT_EVERY steps, as the wrapper does.
    checkpoint_every = int_var(env, CHECKPOINT_EVERY_ENV, DEFAULT_CHECKPOINT_EVERY) if checkpoint_every is None else \
        _whole("checkpoint_every", checkpoint_every, 0, "steps between checkpoints; 0: on signals and at the end")
    keep = pick("keep")
    keep = 2 if keep is None else _whole("keep", keep, 1, "checkpoints kept")
    launch = pick("launch") or env.get(LAUNCH_ENV) or "auto"
    if launch not in ("auto", "srun", "single"):
        raise SpecError(LAUNCH_ENV, launch, "give auto, srun or single")
    if launch == "auto":
        launch = "srun" if platform == "gpu" and alloc.num_nodes > 1 else "single"
    if alloc.num_processes > 1 and devices % alloc.num_processes:
        raise SpecError("devices", devices, f"cannot be split evenly over {alloc.num_processes} processes")
    tune_flag = given.get("tune")
    if tune_flag is None:
        word = env.get(TUNE_ENV, "1").strip().lower()
        if word not in TUNE_WORDS:
            raise SpecError(TUNE_ENV, word, f"give one of {', '.join(sorted(TUNE_WORDS))}")
        tune_flag = TUNE_WORDS[word]
    budget_s, budget_frac = pick("tune_budget_s"), pick("tune_budget_frac")
    tune = TuneConfig(
        enabled=bool(tune_flag),
        budget_s=_float_env(env, TUNE_BUDGET_ENV, DEFAULT_TUNE_BUDGET_S) if budget_s is None
        else _non_negative("tune_budget_s", budget_s),
        budget_frac=_float_env(env, TUNE_FRAC_ENV, DEFAULT_TUNE_FRAC) if budget_frac is None
        else _non_negative("tune_budget_frac", budget_frac),
        cache_dir=tuned_dir)
    seed = 0 if given.get("seed") is None else _whole("seed", given["seed"], 0, "seed of the weights and data")
    if seed >= 2**31:  # the weights' initialiser takes it as a 32-bit signed integer
        raise SpecError("seed", seed, "give a whole number below 2**31 (seed of the weights and data)")
    return RunConfig(model=model, global_batch=batch, iterations=iterations,
                     plan_text=pick("plan") or env.get(PLAN_ENV) or None, checkpoint_dir=ckpt,
                     checkpoint_every=checkpoint_every, keep=keep, seed=seed,
                     num_devices=devices, platform=platform,
                     warmup_steps=2 if given.get("warmup_steps") is None else _whole(
                         "warmup_steps", given["warmup_steps"], 0, "steps not timed after each start"),
                     compile_cache_dir=cache or None, launch=launch, tune=tune,
                     compile_cache_max_bytes=max(1, int(max_gb * 2**30)) if max_gb else -1,
                     job_checkpoint_dir=not pick("checkpoint_dir") and bool(alloc.job_id),
                     report_dir=Path(root) / alloc.job_id if alloc.job_id else None)
