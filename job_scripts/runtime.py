"""The runtime API: what a JAX training script calls inside a slurm-ext allocation.

The built-in runner (``python -m job_scripts.run``) is one user of it; a researcher's own
script is another::

    from job_scripts import runtime

    job = runtime.start()                  # first, before any JAX computation
    mesh = job.mesh()                      # the granted plan: devices as ("dp", "tp")
    state, first = job.resume(abstract_state_with_shardings)  # None, 1 on a fresh start
    step = first - 1                       # the last step done
    while step < job.iterations:
        if job.stop_requested():           # the daemon asked to rescale (SIGUSR1)
            break
        step += 1
        batch = job.put_batch(loader.batch_at(job.sample_of(step)))
        ...                                # your step; job.micro_batches for accumulation
        job.record_step(step, loss, seconds)
        if job.checkpoint_due(step):
            job.save(step, state)
    sys.exit(job.finish(step, state))      # checkpoint the last step done, then 86, 143 or 0

:func:`start` reads what Slurm granted (nodes, GPUs, the partition's GPU type, the restart
count), the job's settings (``#ELASTIC`` lines and Comment: global batch, iterations),
its plan (``SLURM_EXT_PLAN`` or the AdminComment the daemon wrote), starts one process per
node through ``srun`` when asked (``SLURM_EXT_LAUNCH=srun``) and joins them with
``jax.distributed``; without GPUs it makes one CPU device per granted GPU. The job then
gives the plan's mesh and shardings, the step and exact sample to resume from, Orbax
checkpoints of any pytree restored into any shardings, the SIGUSR1 → checkpoint → exit
86 protocol, and measured step times (``measured.json``, read by the daemon).
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from estimator.contract import (ADMIN_COMMENT_PLAN, EXIT_BAD_INPUT, EXIT_DONE, EXIT_RESCALE, EXIT_TERMINATED,
                                MEASURED_FILE, ElasticSpecError, RunnerReport, comment_settings, merge_settings,
                                plan_tokens, script_settings)
from estimator.errors import SpecError
from job_scripts.checkpoint import CheckpointDamaged, Checkpoints, CheckpointError, Saved, write_json_atomic
from job_scripts.run_config import SCRIPT_ENV, SETTINGS_ENV, RunConfig, resolve_config
from job_scripts.slurm_env import (COORDINATOR_ENV, SlurmAllocation, admin_comment_from_scontrol,
                                   allocation_from_env, comment_from_scontrol, coordinator_address)
from job_scripts.stop_signal import STOP_RANK, StopSignal

log = logging.getLogger(__name__)

PROGRESS_EVERY_S = 30.0  # the daemon's view of the current step is at most this old
# Flags that make XLA compile fast on the CPU; fake-device runs test the protocol, and
# the small models they use spend most of their time compiling, not computing.
CPU_FAST_COMPILE_FLAGS = ("--xla_backend_optimization_level=0",
                          "--xla_llvm_disable_expensive_passes=true")


SCONTROL_TRIES = 3  # a busy slurmctld answers a later try
# What sbatch wrote into the job's environment at submission from its GPU options, and srun
# reads as its own options: after the daemon changed the job's GPUs they would ask the step
# for the old request (a type the nodes lack: no step; a smaller count: fewer devices).
# Without them the step gets every GPU of the job on its nodes.
SUBMISSION_GPU_VARS = ("SLURM_GPUS", "SLURM_GPUS_PER_NODE", "SLURM_GPUS_PER_TASK", "SLURM_GPUS_PER_SOCKET",
                       "SLURM_TRES_PER_TASK", "SLURM_CPUS_PER_GPU", "SLURM_MEM_PER_GPU", "SLURM_NTASKS_PER_GPU",
                       "SLURM_GRES")


def scontrol_job_text(job_id: str, tries: int = SCONTROL_TRIES) -> str | None:
    """``scontrol show job`` of this job (Comment, AdminComment), or None without Slurm."""
    from job_scripts.slurm_env import read_job_record
    for attempt in range(1, tries + 1):
        try:
            return read_job_record(job_id)
        except FileNotFoundError as e:  # no Slurm here: the flags decide
            log.warning("could not read job %s with scontrol (%s)", job_id, e)
            return None
        except (OSError, subprocess.SubprocessError) as e:
            log.warning("could not read job %s with scontrol (%s)%s", job_id, e,
                        "; trying again" if attempt < tries else "")
            if attempt < tries:
                time.sleep(2.0 * attempt)
    return None


def enclosing_step() -> str | None:
    """The step (``8.batch``, ``8.0``) of the ``slurmstepd`` whose process tree this process
    is in, from its title in ``/proc`` (``slurmstepd: [8.0]``); None where not seen."""
    pid, seen = os.getpid(), set()
    while pid > 1 and pid not in seen:
        seen.add(pid)
        try:
            title = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            if title.startswith("slurmstepd: ["):
                return title[len("slurmstepd: ["):].partition("]")[0]
            pid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            return None
    return None


def _from_batch(env: dict[str, str], alloc: SlurmAllocation) -> dict | None:
    """What this job's batch process read and passed to the tasks srun started
    (:func:`_relaunch_under_srun`), or None outside such a task."""
    try:
        passed = json.loads(env.get(SETTINGS_ENV) or "null") if alloc.in_step else None
    except ValueError:
        return None
    return passed if isinstance(passed, dict) and passed.get("job_id") == alloc.job_id else None


def _elastic_settings(path: str | None, comment: str | None, given: dict | None = None,
                      require: tuple[str, ...] = ()) -> dict[str, str]:
    """The job's ``#ELASTIC`` settings, overridden by its Comment's (as the daemon reads them).

    A malformed Comment or ``#ELASTIC`` line stops the job, unless the ``given`` flags set
    every setting it is read for (the global batch and ``require``): the daemon released
    such a job to run as submitted, and then it runs on its flags, with a warning.
    """
    text = ""
    if path:
        try:
            text = Path(path).read_text(errors="replace")
        except OSError as e:
            raise SpecError("elastic_script", path, f"cannot read it: {e.strerror}") from None
    try:
        return merge_settings(script_settings(text), comment_settings(comment))
    except ElasticSpecError as e:
        given = given or {}
        if any(given.get(key) is None for key in ("global_batch", *require)):
            raise
        log.warning("the job's elastic settings are ignored (%s): the flags set every one", e)
        return {}


def _job_settings(script: str | None, comment: str | None, given: dict, require: tuple[str, ...],
                  env: dict[str, str], alloc: SlurmAllocation) -> dict[str, str]:
    """The job's elastic settings. A task srun started on each node takes those its batch
    process read and passed on (:func:`_relaunch_under_srun`): Slurm's copy of the batch
    script is on the batch node only."""
    passed = _from_batch(env, alloc)
    if passed is not None and isinstance(passed.get("settings"), dict):
        return {str(k): str(v) for k, v in passed["settings"].items()}
    return _elastic_settings(script, comment, given, require)


def gpu_available() -> bool:
    # Only the top-level names: find_spec of a dotted name imports its parent package.
    plugins = ("jax_cuda12_plugin", "jax_cuda13_plugin")
    return any(importlib.util.find_spec(p) is not None for p in plugins) and Path("/dev/nvidiactl").exists()


def host_resolves(host: str) -> bool:
    if not host:
        return False
    try:
        socket.getaddrinfo(host, None)
        return True
    except OSError:
        return False


def _relaunch_under_srun(alloc: SlurmAllocation, argv: list[str], settings: dict[str, str],
                         job_text: str | None) -> None:
    """Replace this batch process by ``srun`` starting the same command once per node.

    srun forwards SIGUSR1 and SIGTERM to its tasks and exits with their highest status,
    so the rescale protocol works unchanged. ``--kill-on-bad-exit=0`` keeps srun from
    killing the others when the first one exits 86 (a killed task would turn the step's
    86 into a failure, and the job would not be requeued); a task that crashes ends the
    others through jax.distributed's heartbeat timeout. The task count is given: srun
    would otherwise take the job's own (``SLURM_NTASKS``, from ``sbatch --ntasks``), which
    outranks ``--ntasks-per-node``. The job's ``settings`` go with the environment srun
    passes on (with the job id, so that a job submitted from inside this one ignores them),
    and so does its record (``job_text``): every task starts from the one AdminComment plan
    (each reading it had them start from different plans when one read failed). The GPU
    request of the submission does not (`SUBMISSION_GPU_VARS`).
    """
    os.environ[SETTINGS_ENV] = json.dumps({"job_id": alloc.job_id, "settings": settings, "job_text": job_text})
    for name in SUBMISSION_GPU_VARS:
        os.environ.pop(name, None)
    full = ["srun", f"--nodes={alloc.num_nodes}", f"--ntasks={alloc.num_nodes}", "--ntasks-per-node=1",
            "--kill-on-bad-exit=0", *argv]
    log.info("starting one task per node: %s", " ".join(full))
    os.execvp("srun", full)


def _configure_jax(cfg: RunConfig, alloc: SlurmAllocation) -> None:
    """Platform, CPU device count, GPU memory and compilation cache, before JAX starts its
    backends."""
    import jax
    if cfg.platform == "gpu":
        # The share of each GPU's memory the estimates count on; JAX's own default takes
        # 75 %, and a Cell estimated to fit in 90 % would run out of memory (a job's own
        # setting stands).
        from estimator.memory import MemoryOptions
        os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", f"{MemoryOptions().usable_frac:g}")
    if cfg.platform == "cpu":
        flags = os.environ.get("XLA_FLAGS", "")
        for f in CPU_FAST_COMPILE_FLAGS:
            if f.split("=")[0] not in flags:
                flags += " " + f
        os.environ["XLA_FLAGS"] = flags.strip()
        os.environ["JAX_PLATFORMS"] = "cpu"
        try:
            jax.config.update("jax_platforms", "cpu")
            if "xla_force_host_platform_device_count" not in flags:
                jax.config.update("jax_num_cpu_devices", cfg.num_devices // alloc.num_processes)
            if alloc.num_processes > 1:
                jax.config.update("jax_cpu_collectives_implementation", "gloo")
        except RuntimeError:  # JAX refuses once its backends have started
            raise SpecError("devices", cfg.num_devices, "JAX started before runtime.start(): call it "
                                                        "before any JAX computation") from None
    if cfg.compile_cache_dir:
        jax.config.update("jax_compilation_cache_dir", cfg.compile_cache_dir)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
        jax.config.update("jax_compilation_cache_max_size", cfg.compile_cache_max_bytes)


GIVEN_SETTINGS = ("model", "global_batch", "iterations", "plan", "checkpoint_root", "checkpoint_dir",
                  "checkpoint_every", "keep", "seed", "devices", "platform", "warmup_steps", "launch",
                  "compile_cache", "elastic_script", "tune", "tune_budget_s", "tune_budget_frac")


def start(*, stop: StopSignal | None = None, identity: dict | None = None,
          require: tuple[str, ...] = (), relaunch_argv: list[str] | None = None,
          env: dict[str, str] | None = None, **given) -> "Job":
    """Start the job's side of the protocol; call it before any JAX computation.

    Args:
        stop: a signal recorder installed earlier (else one is installed now).
        identity: more of what a checkpoint must match to be resumed (e.g. a model
            version), as JSON values (a tuple is compared as the list it is saved as);
            the global batch, the seed and the model (when known) always are.
        require: settings that must be known (``model``, ``iterations``).
        relaunch_argv: the command ``srun`` starts on each node (default: this one).
        env: the environment (default ``os.environ``).
        **given: explicit settings, which win over the environment and the job's spec
            (``GIVEN_SETTINGS``; another name is refused): ``model, global_batch,
            iterations, plan, checkpoint_root, checkpoint_dir, checkpoint_every, keep, seed,
            devices, platform, warmup_steps, launch, compile_cache, elastic_script, tune,
            tune_budget_s, tune_budget_frac``.

    Raises:
        SpecError: a setting that is missing or malformed (one line: what and how to fix).
    """
    unknown = sorted(set(given) - set(GIVEN_SETTINGS))
    if unknown:
        raise SpecError(unknown[0], given[unknown[0]], f"not a setting of runtime.start(); give one of "
                                                       f"{', '.join(GIVEN_SETTINGS)}")
    stop = stop or StopSignal().install()
    # Orbax reports each save in dozens of INFO lines (through absl's logger): the job's log
    # keeps its warnings, unless the script set that logger's level itself.
    if logging.getLogger("absl").level == logging.NOTSET:
        logging.getLogger("absl").setLevel(logging.WARNING)
    own_environment = env is None
    env = dict(os.environ if env is None else env)
    alloc = allocation_from_env(env)
    passed = _from_batch(env, alloc)
    if own_environment and alloc.in_step and passed is None:
        # Not a task this job's batch process started: a task of a step only if a step's
        # slurmstepd started it (else the variables came with the submission).
        alloc = allocation_from_env(env, enclosing_step())
    if passed is not None and "job_text" in passed:  # the batch process's reading, shared by every task
        job_text = passed["job_text"] if isinstance(passed["job_text"], str) else None
    else:
        job_text = scontrol_job_text(alloc.job_id) if alloc.job_id else None
    comment = comment_from_scontrol(job_text) if job_text else None
    script = given.pop("elastic_script", None) or env.get(SCRIPT_ENV)
    # A task srun started takes the settings its batch process read (the script's copy
    # is on that node only); the batch process reads them.
    settings = _job_settings(script, comment, given, require, env, alloc)
    cfg = resolve_config(given, env, alloc, settings, gpu_available(), require)
    if cfg.launch == "srun" and alloc.num_nodes > 1 and not alloc.in_step:
        if stop.name is not None:  # exec would forget it: the last checkpoint stands
            log.info("%s before the tasks started; exiting", stop.name)
            raise SystemExit(EXIT_RESCALE if stop.name == "SIGUSR1" else EXIT_TERMINATED)
        _relaunch_under_srun(alloc, relaunch_argv or [sys.executable, *sys.orig_argv[1:]], settings, job_text)
    _configure_jax(cfg, alloc)
    import jax
    if alloc.num_processes > 1:
        address = coordinator_address(alloc, env.get(COORDINATOR_ENV),
                                      host_resolves(alloc.node_names[0] if alloc.node_names else ""))
        # JAX's preemption service would take SIGTERM for itself (a C++ handler that
        # replaces ours): the runner's own checkpoint-and-exit-143 must see it.
        with contextlib.suppress(AttributeError):  # a JAX without the service: nothing to turn off
            jax.config.update("jax_enable_preemption_service", False)
        jax.distributed.initialize(address, alloc.num_processes, alloc.process_id)
        log.info("jax.distributed: process %d of %d (coordinator %s), %d local and %d global devices",
                 jax.process_index(), jax.process_count(), address, jax.local_device_count(),
                 jax.device_count())
    devices = jax.devices()
    if cfg.platform == "gpu" and devices[0].platform == "cpu":  # else CPU times recorded as a GPU's
        raise SpecError("platform", "gpu", "JAX sees no GPU in this process though a GPU's driver is here; check "
                                           "CUDA_VISIBLE_DEVICES, the job's --gres and JAX's CUDA install, or "
                                           "train on the CPU with --platform cpu")
    if len(devices) != cfg.num_devices:
        raise SpecError("devices", len(devices), f"JAX sees {len(devices)} devices, the job has "
                                                 f"{cfg.num_devices}; check CUDA_VISIBLE_DEVICES, or call "
                                                 "runtime.start() before any JAX computation")
    plan_text, source = cfg.plan_text, "given" if cfg.plan_text else None
    admin_plan = plan_tokens(admin_comment_from_scontrol(job_text)) if job_text else None
    if admin_plan and _parsed(admin_plan) is None:
        # Not the daemon's writing (an edit by hand): the job runs on, from the best estimate,
        # as it does from a plan that parses but cannot run here; exit 2 would end it FAILED.
        log.warning("the AdminComment's plan %r does not parse: ignored", admin_plan)
        admin_plan = None
    given_plan = _parsed(plan_text)
    moved = given_plan is not None and (given_plan.num_gpus != len(devices) or (
        alloc.gpu_type is not None and given_plan.gpu_type != alloc.gpu_type))
    if moved and admin_plan and alloc.restart_count:
        # The daemon rescaled the job: the plan given for its first Cell cannot run on this
        # one (another count), or was sized for another GPU's memory and speed (another
        # type); failing here would end the job, not requeue it.
        log.warning("the given plan %s is for %d %s GPUs and this run of the job has %d %s (it was rescaled): "
                    "running the AdminComment's plan", plan_text, given_plan.num_gpus, given_plan.gpu_type,
                    len(devices), alloc.gpu_type or "GPUs")
        plan_text = None
    if plan_text is None and admin_plan:
        plan_text, source = admin_plan, ADMIN_COMMENT_PLAN
    known = {"model": cfg.model} if cfg.model else {}
    # The job's own batch and seed are checked always; another value would pass a wrong
    # checkpoint (a model name may stand for the model file's: a version of the model).
    overridden = sorted(set(identity or {}) & {"global_batch", "seed"})
    if overridden:
        raise SpecError("identity", overridden[0], "checked already (the job's own value): give it as a "
                                                   "setting, or name your key otherwise")
    return Job(cfg, alloc, devices, stop, plan_text, source,
               _as_saved({"global_batch": cfg.global_batch, "seed": cfg.seed, **known, **(identity or {})}))


def _parsed(plan_text: str | None):
    """The plan string parsed (``PlanString``), None without one or when it does not parse
    (the plan's first use says why)."""
    from estimator.plan_string import parse_plan
    try:
        return parse_plan(plan_text) if plan_text else None
    except SpecError:
        return None


# Names a checkpoint's metadata holds of its own (``Job.save``, ``Checkpoints.save``, the
# built-in runner's layout and loss scale): an identity key among them would be written over.
RESERVED_META_KEYS = ("cell", "data", "format", "job_id", "layout", "loss_scale", "plan", "restart_count", "step")


def _as_saved(identity: dict) -> dict:
    """``identity`` as a checkpoint's JSON metadata reads it back (a tuple becomes a list),
    so that the same job finds its own checkpoints equal."""
    taken = sorted(set(identity) & set(RESERVED_META_KEYS))
    if taken:
        raise SpecError("identity", taken[0], "a name the checkpoint's own metadata uses "
                                              f"({', '.join(RESERVED_META_KEYS)}): give another")
    try:
        return json.loads(json.dumps(identity, allow_nan=False))
    except (TypeError, ValueError) as e:
        raise SpecError("identity", identity, f"give JSON values (strings, numbers, lists, dicts): {e}") from None


@dataclass
class _Meter:
    """Seconds per step after warm-up."""

    warmup_steps: int
    seen: int = 0
    total_s: float = 0.0
    timed: int = 0

    def add(self, seconds: float) -> bool:
        """Record one step; True when the count of timed steps reached a power of two."""
        self.seen += 1
        if self.seen <= self.warmup_steps:
            return False
        self.total_s += seconds
        self.timed += 1
        return self.timed & (self.timed - 1) == 0

    @property
    def mean_s(self) -> float | None:
        return self.total_s / self.timed if self.timed else None


def max_over_processes(value: float) -> float:
    """The largest of every process's ``value``, exactly (a collective: every process of
    the job calls it alike)."""
    import numpy as np
    from jax.experimental import multihost_utils
    # The float64's bytes as two int32s: JAX without x64 would round a float64 to float32
    # (step numbers past 2**24 and plan digests would no longer compare exactly).
    words = np.array([value], np.float64).view(np.int32)
    gathered = np.asarray(multihost_utils.process_allgather(words), np.int32)
    return float(np.max(np.ascontiguousarray(gathered).view(np.float64)))


class Job:
    """One training process's view of its job; made by :func:`start`."""

    def __init__(self, cfg: RunConfig, alloc: SlurmAllocation, devices: list, stop: StopSignal,
                 plan_text: str | None, plan_source: str | None, identity: dict):
        import jax
        self.config, self.alloc, self.devices, self._stop = cfg, alloc, devices, stop
        self.plan_text, self.plan_source, self.identity = plan_text, plan_source, identity
        self.process_index, self.process_count = jax.process_index(), jax.process_count()
        self.writer = self.process_index == 0
        self._checkpoints: Checkpoints | None = None
        self.next_step = 1
        self._saved_step: int | None = None
        self._meter = _Meter(cfg.warmup_steps)
        self._step: int | None = None  # the last step done, and when
        self._step_at_s: float | None = None
        self._written_at_s = 0.0
        self._report_warned = False  # a report that could not be written is warned of once
        # The daemon takes a measured speed for the Cell the report names: a script of its
        # own (which never calls set_running) runs the starting plan's.
        plan = _parsed(plan_text)
        self._running = {"cell": plan.cell_label if plan else None, "plan": plan_text, "plan_source": plan_source,
                         "tuning_s": 0.0, "candidates_measured": 0}
        self._started_s = time.monotonic()
        self._phases: dict[str, float] = {}  # startup_s, init_s or restore_s, final_save_s
        if plan_text:
            log.info("plan %s (%s)", plan_text, "from the AdminComment" if plan_source == ADMIN_COMMENT_PLAN else "given")

    # ------------------------------------------------------------------ settings

    @property
    def global_batch(self) -> int:
        return self.config.global_batch

    @property
    def iterations(self) -> int | None:
        return self.config.iterations

    def plan(self):
        """The starting plan as parsed (``estimator.plan_string.PlanString``), or None."""
        from estimator.plan_string import parse_plan
        return parse_plan(self.plan_text) if self.plan_text else None

    @property
    def micro_batches(self) -> int:
        """Micro-batches per step (gradient accumulation): the global batch stays fixed."""
        plan = self.plan()
        return plan.micro_batches if plan else 1

    # ------------------------------------------------------------------ mesh and shardings

    def mesh(self):
        """The plan's devices as a ``("dp", "tp")`` mesh (all devices data-parallel without one).

        Raises:
            SpecError: the plan has pipeline stages (a script's own model runs
                single-stage plans: submit it with ``trainer=api``), splits states or
                experts (``zero``, ``offload``, ``ep``: the mesh replicates them), or
                does not fit.
        """
        import numpy as np
        from jax.sharding import Mesh
        plan = self.plan()
        n = len(self.devices)
        if plan is None:
            dp, tp = n, 1
        elif plan.num_stages > 1:
            raise SpecError("plan", self.plan_text, f"has {plan.num_stages} pipeline stages; a script "
                            "with its own model runs single-stage plans: submit it with trainer=api")
        else:
            asks = [what for what, asked in (
                (f"zero={plan.zero_level} (states split over dp)", plan.zero_level),
                ("offload=1 (states on the host)", plan.offload),
                ("ep (experts split over a stage's devices)", any(plan.stage_ep))) if asked]
            if asks:
                raise SpecError("plan", self.plan_text, f"asks for {' and '.join(asks)}; a script with its own "
                                "model runs replicated states on a (dp, tp) mesh: submit it with trainer=api "
                                "(the daemon then plans none)")
            dp, tp = plan.stages[0]
        what = "the plan" if plan is not None else f"all {n} devices data-parallel (no plan given)"
        if dp * tp != n:
            raise SpecError("plan", self.plan_text, f"{what} needs {dp * tp} devices; the job has {n}")
        if self.global_batch % (dp * self.micro_batches):
            raise SpecError("global_batch", self.global_batch, f"{what} splits each step over dp {dp} × "
                            f"{self.micro_batches} micro-batches = {dp * self.micro_batches}, which does not "
                            "divide it: give a plan whose dp × micro-batches does, or another global batch")
        return Mesh(np.asarray(self.devices, dtype=object).reshape(dp, tp), ("dp", "tp"))

    def batch_sharding(self):
        """Batches split over ``dp`` along their first axis."""
        from jax.sharding import NamedSharding, PartitionSpec as P
        return NamedSharding(self.mesh(), P("dp"))

    def put_batch(self, host_array):
        """A host array of the whole global batch (every process holds it) → a global array."""
        import jax
        import numpy as np
        host = np.asarray(host_array)
        return jax.make_array_from_callback(host.shape, self.batch_sharding(), lambda idx: host[idx])

    def param_shardings(self, abstract, rule=None):
        """NamedShardings for a pytree of parameter shapes.

        Args:
            abstract: a pytree of arrays or ``jax.ShapeDtypeStruct``.
            rule: ``rule(path, shape) -> PartitionSpec`` over ``("dp", "tp")``; the default
                shards each matrix's last dimension that ``tp`` divides over ``tp``
                (Megatron's column split; XLA inserts the collectives) and replicates the rest.
        """
        import jax
        from jax.sharding import NamedSharding, PartitionSpec as P
        mesh = self.mesh()
        tp = mesh.shape["tp"]

        def default(path, shape):
            if tp > 1 and len(shape) >= 2:
                for d in range(len(shape) - 1, -1, -1):
                    if shape[d] % tp == 0:
                        return P(*(("tp" if i == d else None) for i in range(len(shape))))
            return P()

        rule = rule or default
        return jax.tree_util.tree_map_with_path(lambda p, x: NamedSharding(mesh, rule(p, tuple(x.shape))),
                                                abstract)

    # ------------------------------------------------------------------ checkpoints

    @property
    def checkpoints(self) -> Checkpoints:
        """The job's checkpoints (Orbax's manager starts on first use)."""
        if self._checkpoints is None:
            self._checkpoints = Checkpoints(self.config.checkpoint_dir, self.config.keep)
        return self._checkpoints

    def close(self) -> None:
        """Wait for the checkpoint writes under way and stop the manager (idempotent)."""
        if self._checkpoints is not None:
            self._checkpoints.close()
            self._checkpoints = None

    def sample_of(self, step: int) -> int:
        """Index of the first sample of ``step`` (steps count from 1): the data position."""
        return (step - 1) * self.global_batch

    @property
    def next_sample(self) -> int:
        return self.sample_of(self.next_step)

    def latest(self) -> Saved | None:
        """The newest complete checkpoint, checked against this job's identity.

        Raises:
            SpecError: the checkpoint was written by another model, batch or seed, or, in
                the job's own directory on its first run, by an earlier job of that id.
        """
        saved = self.checkpoints.latest(self.agree_max)
        if saved is not None and self.config.job_checkpoint_dir and not self.alloc.restart_count:
            # The job's first run, yet its own directory holds a checkpoint: an earlier job
            # with this id (Slurm reuses ids once its state is reset) would be resumed.
            raise SpecError("checkpoint_dir", str(self.config.checkpoint_dir),
                            f"holds step {saved.step} of an earlier job with id {self.alloc.job_id}, and this is "
                            "the job's first run: move it away, or name it with --checkpoint-dir "
                            "(checkpoint_dir=) to continue from it")
        if saved is not None:
            for key, value in self.identity.items():
                if saved.meta.get(key) != value:
                    raise SpecError(key, value, f"the checkpoint {saved.path} was written with "
                                                f"{key}={saved.meta.get(key)!r}; use a new checkpoint directory")
        return saved

    def restored(self, saved: Saved | None, read: Callable[[Saved], object]) -> tuple[Saved | None, object]:
        """(checkpoint, ``read(checkpoint)``) for the newest checkpoint from ``saved`` on
        whose arrays every process reads; (None, None) when there is none. A step whose files
        cannot be read (``CheckpointDamaged`` on any process) is set aside, as ``latest``
        does with one whose metadata cannot, and the one before is read.

        Raises:
            CheckpointError: every checkpoint was set aside (none is trained over from step 1).
        """
        set_aside: list[str] = []  # the same on every process
        while saved is not None:
            try:
                state, damage = read(saved), ""
            except CheckpointDamaged as e:
                state, damage = None, str(e)
            if not self.agree_max(float(bool(damage))):
                return saved, state
            log.warning("checkpoint of step %d cannot be read (%s): resuming from the one before", saved.step,
                        damage or "on another process of this job")
            self.checkpoints.set_aside(saved.step, self.agree_max)
            set_aside.append(f"step {saved.step}: {damage or 'unreadable on another process'}")
            saved = self.latest()
        if set_aside:
            raise CheckpointError(f"no readable checkpoint in {self.checkpoints.directory}: " + "; ".join(set_aside))
        return None, None

    def mark_resumed(self, saved: Saved | None, plan_text: str | None) -> None:
        """Log where training continues and set :attr:`next_step`."""
        if saved is None:
            self.next_step = 1
            if self.alloc.restart_count:
                log.warning("restart %d of job %s found no checkpoint in %s: training from step 1 "
                            "(is the checkpoint root shared and the same as before?)",
                            self.alloc.restart_count, self.alloc.job_id, self.config.checkpoint_dir)
            log.info("starting at step 1 (no checkpoint in %s); plan %s on %d devices, global batch %d",
                     self.config.checkpoint_dir, plan_text, len(self.devices), self.global_batch)
            return
        self.next_step = saved.step + 1
        self._saved_step = saved.step
        log.info("resumed from step %d (checkpoint %s, plan %s); next step %d; now plan %s on %d devices, "
                 "global batch %d, next sample %d", saved.step, saved.path, saved.meta.get("plan"),
                 saved.step + 1, plan_text, len(self.devices), self.global_batch, self.next_sample)

    def resume(self, target):
        """(state, next step): the newest checkpoint read into ``target``'s shardings
        (a pytree of ``jax.ShapeDtypeStruct`` with ``sharding``), or (None, 1). A newest
        checkpoint whose files cannot be read is set aside and the one before read
        (`restored`).

        Raises:
            SpecError: a checkpoint of another model, batch or seed (`latest`).
            CheckpointError: one whose arrays are not ``target``'s, or none readable.
        """
        saved, state = self.restored(self.latest(), lambda s: self.checkpoints.restore(s.step, target))
        self.mark_resumed(saved, self.plan_text)
        return state, self.next_step

    def save(self, step: int, arrays, meta: dict | None = None) -> None:
        """Checkpoint ``arrays`` (any pytree of global arrays) as the state after ``step``."""
        data = {"next_step": step + 1, "next_sample": self.sample_of(step + 1)}
        self.checkpoints.save(step, arrays, {**(meta or {}), **self.identity, "data": data,
                                             "plan": self._running["plan"], "cell": self._running["cell"],
                                             "job_id": self.alloc.job_id,
                                             "restart_count": self.alloc.restart_count})
        self._saved_step = step
        self._write_measured()

    def checkpoint_due(self, step: int) -> bool:
        every = self.config.checkpoint_every
        return bool(every) and step % every == 0 and (self.iterations is None or step < self.iterations)

    # ------------------------------------------------------------------ signals and progress

    def agree_max(self, value: float) -> float:
        """The largest of every process's ``value`` (the same answer on every process)."""
        return value if self.process_count == 1 else max_over_processes(value)

    def stop_requested(self) -> str | None:
        """``SIGUSR1`` or ``SIGTERM`` when any process got one (all processes agree), else None."""
        top = int(self.agree_max(STOP_RANK[self._stop.name]))
        return next(name for name, rank in STOP_RANK.items() if rank == top)

    def set_running(self, plan_text: str | None, cell: str | None, source: str | None,
                    tuning_s: float = 0.0, candidates_measured: int = 0) -> None:
        """Say which plan trains (reported in checkpoints and ``measured.json``)."""
        self._running = {"cell": cell, "plan": plan_text, "plan_source": source,
                         "tuning_s": round(tuning_s, 3), "candidates_measured": candidates_measured}

    def note_phase(self, name: str, seconds: float) -> None:
        """Report how long a start-up phase took (``init_s``: the state built fresh;
        ``restore_s``: read from a checkpoint) in ``measured.json``."""
        self._phases[name] = round(seconds, 3)

    def record_step(self, step: int, loss: float, seconds: float) -> None:
        """Log ``step N loss X time Ts``; time the step and report it to the daemon."""
        log.info("step %d loss %.6f time %.3fs", step, loss, seconds)
        if "startup_s" not in self._phases:
            # The first step of this run: what the (re)start cost, tuning aside.
            self._phases["startup_s"] = round(time.monotonic() - self._started_s - self._running["tuning_s"], 3)
        self._step, self._step_at_s = step, time.time()
        # Early and then ever rarer speed updates (1, 2, 4, 8, ... timed steps): the daemon
        # learns the real speed of a new plan within a few steps, at little cost; the
        # current step at least every PROGRESS_EVERY_S once a speed is known (checkpoints
        # and the exit write it in any case).
        if self._meter.add(seconds) or (self._meter.timed and self._step_at_s - self._written_at_s >= PROGRESS_EVERY_S):
            self._write_measured()

    @property
    def mean_step_s(self) -> float | None:
        """Mean seconds per step after warm-up in this run, or None before any."""
        return self._meter.mean_s

    def peak_memory_gb(self) -> float | None:
        """The largest peak of memory in use on this process's devices, or None where the
        backend keeps no statistics (CPU)."""
        peaks = []
        for device in self.devices:
            if device.process_index != self.process_index:
                continue
            try:
                stats = device.memory_stats()
            except Exception:  # backends without statistics raise or return None
                stats = None
            if stats and "peak_bytes_in_use" in stats:
                peaks.append(stats["peak_bytes_in_use"])
        return round(max(peaks) / 1e9, 4) if peaks else None

    def _write_measured(self) -> None:
        """Write ``measured.json``: this run's plan and step always (a report of an earlier
        run must not stand), its speed once a step after warm-up was timed."""
        if not self.writer:
            return
        mean = self._meter.mean_s
        self._written_at_s = time.time()
        report = RunnerReport(
            **self._running, job_id=self.alloc.job_id, global_batch=self.global_batch,
            num_devices=len(self.devices), platform=self.config.platform,
            restart_count=self.alloc.restart_count, iteration_time_s=mean,
            steps_measured=self._meter.timed, samples_per_s=self.global_batch / mean if mean else None,
            step=self._step, step_at_s=self._step_at_s, updated_at_s=self._written_at_s,
            peak_memory_gb=self.peak_memory_gb(), **self._phases)
        path = (self.config.report_dir or self.config.checkpoint_dir) / MEASURED_FILE
        try:
            write_json_atomic(path, report.to_json())
        except OSError as e:  # a report the daemon cannot read must not fail the training (or an exit 86)
            if not self._report_warned:
                log.warning("cannot write %s (%s): the scheduler sees no progress or speed of this run",
                            path, e.strerror or e)
            self._report_warned = True

    def finish(self, step: int, arrays, meta: dict | None = None) -> int:
        """Checkpoint the state after ``step`` (unless already), leave jax.distributed
        together, and return the exit status: 86 after SIGUSR1, 143 after SIGTERM, else 0.
        ``arrays`` may be a function that makes them: it is called only when the step is
        not saved yet."""
        signalled = self.stop_requested()
        t0 = time.monotonic()
        if self._saved_step != step:
            self.save(step, arrays() if callable(arrays) else arrays, meta)
        self.close()
        if signalled:  # a SIGTERM during the save outranks the USR1 it was made for (all agree)
            signalled = self.stop_requested()
        if self._saved_step == step:
            self._phases["final_save_s"] = round(time.monotonic() - t0, 3)
        if self._step != step:
            self._step, self._step_at_s = step, time.time()
        self._write_measured()
        if self.process_count > 1:
            import jax
            # A barrier: no process exits before every process has written its shards.
            jax.distributed.shutdown()
        done = self.iterations is not None and step >= self.iterations
        if signalled and not done:
            code = EXIT_RESCALE if signalled == "SIGUSR1" else EXIT_TERMINATED
            log.info("%s: checkpointed step %d; exiting %d", signalled, step, code)
            return code
        log.info("finished: %d iterations", step)
        return EXIT_DONE


__all__ = ["CheckpointError", "SpecError", "EXIT_BAD_INPUT", "EXIT_DONE", "EXIT_RESCALE", "EXIT_TERMINATED",
           "Job", "StopSignal", "plan_tokens", "start"]
