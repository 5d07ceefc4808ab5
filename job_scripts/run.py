"""The runner: what ``job_scripts/elastic.sbatch`` execs inside a Slurm allocation.

``python -m job_scripts.run [options]`` reads what Slurm granted (nodes, GPUs per node,
partition = GPU type, restart count), the job's model, global batch and iteration count
(flags, or the ``#ELASTIC`` lines of the batch script) and its parallel plan (flag, the
``SLURM_EXT_PLAN`` variable, the job's AdminComment written by the daemon, or else the
tuner), resumes from the newest valid checkpoint (resharded onto the new plan), trains,
and checkpoints:

- every ``--checkpoint-every`` steps (the newest two are kept);
- on SIGUSR1 (the daemon's rescale request): finish the current step, checkpoint, exit
  86, which ``RequeueExitHold=86`` turns into a held requeue;
- on SIGTERM: finish the current step, checkpoint, exit 143;
- at the end: checkpoint, exit 0.

It also writes ``<checkpoint dir>/measured.json`` (seconds per iteration after warm-up
under the current Cell and plan) for the daemon. Without GPUs it runs on CPU fake
devices, one per granted GPU, so the whole protocol runs on a laptop or in CI.

Exit status: 0 done, 86 checkpointed for a rescale, 143 checkpointed on SIGTERM,
2 bad input (one line on stderr saying what to fix).
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path


class _StopFlag:
    """Signal handlers only record what arrived; the loop acts between steps."""

    def __init__(self):
        self.signal_name: str | None = None

    def install(self) -> None:
        signal.signal(signal.SIGUSR1, self._handler)
        signal.signal(signal.SIGTERM, self._handler)

    def _handler(self, signum, frame):
        self.signal_name = signal.Signals(signum).name


# Installed before anything else is imported: a rescale request that arrives while the
# runner starts up is recorded, not fatal (SIGUSR1's default action ends the process).
_STOP = _StopFlag()
if __name__ == "__main__":
    _STOP.install()

from estimator.errors import SpecError  # noqa: E402
from estimator.refine import MEASURED_FILE  # noqa: E402
from job_scripts.slurm_env import (COORDINATOR_ENV, SlurmAllocation,  # noqa: E402
                                   admin_comment_from_scontrol, allocation_from_env,
                                   comment_from_scontrol, coordinator_address)

# Named explicitly: run as ``python -m job_scripts.run`` this module's __name__ is __main__.
log = logging.getLogger("job_scripts.run")

EXIT_RESCALE = 86
EXIT_TERMINATED = 143
EXIT_BAD_INPUT = 2
PLAN_ENV = "SLURM_EXT_PLAN"
CHECKPOINT_ROOT_ENV = "SLURM_EXT_CHECKPOINT_ROOT"
COMPILE_CACHE_ENV = "SLURM_EXT_COMPILE_CACHE"
COMPILE_CACHE_DIR = "jax-cache"  # beside the jobs' checkpoint directories
LAUNCH_ENV = "SLURM_EXT_LAUNCH"
# Flags that make XLA compile fast on the CPU; fake-device runs test the protocol, and
# the tiny models they use spend most of their time compiling, not computing.
CPU_FAST_COMPILE_FLAGS = ("--xla_backend_optimization_level=0",
                          "--xla_llvm_disable_expensive_passes=true")


@dataclass(frozen=True)
class RunConfig:
    """Everything the runner was told, resolved once (flag > environment > script)."""

    model: str
    global_batch: int
    iterations: int
    plan_text: str | None
    checkpoint_dir: Path
    checkpoint_every: int
    keep: int
    seed: int
    num_devices: int
    platform: str  # cpu | gpu
    warmup_steps: int
    compile_cache_dir: str | None
    launch: str = "single"  # single | srun (one process per node, joined by jax.distributed)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m job_scripts.run", description=__doc__.split("\n\n")[0])
    p.add_argument("--elastic-script", help="batch script whose #ELASTIC lines give model, batch, iterations")
    p.add_argument("--model", help="built-in model name or model YAML path")
    p.add_argument("--global-batch", type=int, help="samples per iteration, whatever the plan")
    p.add_argument("--iterations", type=int, help="total training iterations")
    p.add_argument("--plan", help=f"plan string (else ${PLAN_ENV}, the AdminComment, or the tuner)")
    p.add_argument("--checkpoint-root", help=f"checkpoints go to ROOT/<job id> (else ${CHECKPOINT_ROOT_ENV}, "
                                             "$SLURM_SUBMIT_DIR/checkpoints, ./checkpoints)")
    p.add_argument("--checkpoint-dir", help="exact checkpoint directory (overrides the root)")
    p.add_argument("--checkpoint-every", type=int, default=0, help="also checkpoint every K steps (0: never)")
    p.add_argument("--keep", type=int, default=2, help="checkpoints kept (default 2)")
    p.add_argument("--seed", type=int, default=0, help="seed of the weights and the data stream")
    p.add_argument("--devices", type=int, help="device count (default: the GPUs Slurm granted)")
    p.add_argument("--platform", choices=("auto", "cpu", "gpu"), default="auto")
    p.add_argument("--warmup-steps", type=int, default=2, help="steps not timed after each start")
    p.add_argument("--launch", choices=("auto", "srun", "single"), default=None,
                   help=f"on several nodes: srun one process per node (joined by jax.distributed) or "
                        f"run a single process (else ${LAUNCH_ENV}; auto: srun on GPUs, single on CPU)")
    p.add_argument("--compile-cache", help=f"JAX persistent compilation cache directory (else "
                                           f"${COMPILE_CACHE_ENV}, else ROOT/{COMPILE_CACHE_DIR} "
                                           "unless --checkpoint-dir is given; '' turns it off)")
    return p


def _elastic_settings(path: str | None, comment: str | None) -> dict[str, str]:
    """The job's ``#ELASTIC`` settings, overridden by those in its Comment (as the daemon reads them)."""
    from slurm_ext.jobspec import comment_settings, merge_settings, script_settings
    text = ""
    if path:
        try:
            text = Path(path).read_text(errors="replace")
        except OSError as e:
            raise SpecError("elastic_script", path, f"cannot read it: {e.strerror}") from None
    return merge_settings(script_settings(text), comment_settings(comment))


def scontrol_job_text(job_id: str) -> str | None:
    """``scontrol show job`` of this job (Comment, AdminComment), or None without Slurm."""
    from job_scripts.slurm_env import scontrol_show_job_argv
    try:
        from slurm_ext.run import run_command
        return run_command(scontrol_show_job_argv(job_id), timeout_s=30).stdout
    except Exception as e:  # noqa: BLE001 - without Slurm the flags and the tuner decide
        log.warning("could not read job %s with scontrol (%s)", job_id, e)
        return None


def _resolves(host: str) -> bool:
    """Whether a host name resolves (the lab's node names do not: they are all localhost)."""
    import socket
    if not host:
        return False
    try:
        socket.getaddrinfo(host, None)
        return True
    except OSError:
        return False


def _gpu_platform_available() -> bool:
    # Only the top-level name: find_spec of a dotted name imports its parent package.
    has_plugin = importlib.util.find_spec("jax_cuda12_plugin") is not None
    return has_plugin and Path("/dev/nvidiactl").exists()


def resolve_config(args: argparse.Namespace, env: dict[str, str], alloc: SlurmAllocation,
                   comment: str | None = None) -> RunConfig:
    """Flags > environment > the job's Comment > its #ELASTIC lines; raises SpecError
    naming what is missing."""
    settings = _elastic_settings(args.elastic_script, comment)

    def number(key: str) -> int | None:
        raw = settings.get(key)
        if raw is not None and not raw.isdigit():
            raise SpecError(key, raw, "give a whole number")
        return None if raw is None else int(raw)

    model = args.model or settings.get("model")
    batch = args.global_batch or number("global_batch")
    iterations = args.iterations if args.iterations is not None else number("iterations")
    for name, value in (("model", model), ("global_batch", batch), ("iterations", iterations)):
        if value is None:
            raise SpecError(name, None, f"give --{name.replace('_', '-')} or an #ELASTIC {name}=... line")
    if batch <= 0 or iterations < 0:
        raise SpecError("global_batch" if batch <= 0 else "iterations", batch if batch <= 0 else iterations,
                        "give a positive batch and a non-negative iteration count")
    default_cache = ""
    if args.checkpoint_dir:
        ckpt = Path(args.checkpoint_dir)
    else:
        root = args.checkpoint_root or env.get(CHECKPOINT_ROOT_ENV) or (
            str(Path(alloc.submit_dir) / "checkpoints") if alloc.submit_dir else "checkpoints")
        ckpt = Path(root) / (alloc.job_id or "local")
        default_cache = str(Path(root) / COMPILE_CACHE_DIR)
    platform = args.platform
    if platform == "auto":
        platform = "gpu" if _gpu_platform_available() else "cpu"
    devices = args.devices or alloc.num_gpus or None
    if devices is None:
        devices = 1
    # Shared by the jobs under one root: a job restarted on a plan seen before (its own
    # or another job's) skips most of XLA's compile.
    cache = args.compile_cache if args.compile_cache is not None else env.get(
        COMPILE_CACHE_ENV, default_cache)
    if args.checkpoint_every < 0 or args.keep < 1:
        raise SpecError("checkpoint_every", args.checkpoint_every, "give K ≥ 0 and --keep ≥ 1")
    launch = args.launch or env.get(LAUNCH_ENV) or "auto"
    if launch not in ("auto", "srun", "single"):
        raise SpecError(LAUNCH_ENV, launch, "give auto, srun or single")
    if launch == "auto":
        launch = "srun" if platform == "gpu" and alloc.num_nodes > 1 else "single"
    if alloc.num_processes > 1 and devices % alloc.num_processes:
        raise SpecError("devices", devices, f"cannot be split evenly over {alloc.num_processes} processes")
    plan_text = args.plan or env.get(PLAN_ENV) or None
    if plan_text:  # a given plan that cannot fit fails now, before JAX is even imported
        from estimator.plan_string import parse_plan
        if parse_plan(plan_text).num_gpus != devices:
            raise SpecError("plan", plan_text, f"is for {parse_plan(plan_text).num_gpus} GPUs "
                                               f"but this job has {devices}")
    return RunConfig(model=model, global_batch=batch, iterations=iterations,
                     plan_text=plan_text, checkpoint_dir=ckpt,
                     checkpoint_every=args.checkpoint_every, keep=args.keep, seed=args.seed,
                     num_devices=devices, platform=platform, warmup_steps=max(0, args.warmup_steps),
                     compile_cache_dir=cache or None, launch=launch)


def _prepare_jax(cfg: RunConfig, env: dict[str, str], num_processes: int = 1) -> None:
    """Set XLA's device count before JAX is imported (it reads the flags once).

    On the CPU each of ``num_processes`` processes fakes its share of the job's devices.
    """
    if cfg.platform == "cpu":
        flags = env.get("XLA_FLAGS", "")
        if "xla_force_host_platform_device_count" not in flags:
            flags += f" --xla_force_host_platform_device_count={cfg.num_devices // num_processes}"
        for f in CPU_FAST_COMPILE_FLAGS:
            if f.split("=")[0] not in flags:
                flags += " " + f
        os.environ["XLA_FLAGS"] = flags.strip()
        os.environ["JAX_PLATFORMS"] = "cpu"


def _exec_one_task_per_node(alloc: SlurmAllocation) -> None:
    """Replace this batch process by ``srun`` starting one runner per node.

    srun forwards SIGUSR1 and SIGTERM to its tasks and exits with their highest status,
    so the rescale protocol works unchanged. The tasks stop after the same step and leave
    jax.distributed together; ``--kill-on-bad-exit=0`` keeps srun from killing the others
    when the first one exits 86 (a killed task would turn the step's 86 into a failure,
    and the job would not be requeued). A task that crashes ends the others through
    jax.distributed's heartbeat timeout.
    """
    argv = ["srun", f"--nodes={alloc.num_nodes}", "--ntasks-per-node=1", "--kill-on-bad-exit=0",
            sys.executable, "-m", "job_scripts.run", *sys.argv[1:]]
    log.info("starting one task per node: %s", " ".join(argv))
    os.execvp("srun", argv)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(name)s: %(message)s")
    stop = _STOP
    stop.install()  # again, for callers that import main() instead of running the module
    env = dict(os.environ)
    try:
        alloc = allocation_from_env(env)
        args = _parser().parse_args(argv)
        job_text = scontrol_job_text(alloc.job_id) if alloc.job_id else None
        comment = comment_from_scontrol(job_text) if job_text else None
        cfg = resolve_config(args, env, alloc, comment)
    except SpecError as e:
        print(f"job_scripts.run: error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    if cfg.launch == "srun" and alloc.num_nodes > 1 and not alloc.in_step:
        _exec_one_task_per_node(alloc)
    _prepare_jax(cfg, env, alloc.num_processes)
    from job_scripts.checkpoint import CheckpointError
    try:
        return run_training(cfg, alloc, stop, job_text)
    except (SpecError, CheckpointError) as e:
        # Starting over would silently throw away the job's progress: stop and say why.
        print(f"job_scripts.run: error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT


# --------------------------------------------------------------------------- training
# Everything below imports JAX inside functions: only after _prepare_jax has set XLA_FLAGS.

PLAN_KEYS = ("cell", "plan", "mb", "remat", "layers")


def plan_tokens(admin_comment: str | None) -> str | None:
    """The plan part of an AdminComment (the daemon may add ``why=...`` and other words)."""
    if not admin_comment:
        return None
    words = [w for w in admin_comment.split() if w.partition("=")[0] in PLAN_KEYS and "=" in w]
    keys = {w.partition("=")[0] for w in words}
    return " ".join(words) if {"cell", "plan"} <= keys else None


def _plan_from_text(text: str, model_spec, arch, cfg: RunConfig, gpus_per_node: int,
                    num_processes: int = 1):
    from estimator.cells import Cell
    from estimator.estimate import partition_stages
    from estimator.plan_string import parse_plan
    from job_scripts.train import ParallelPlan, check_plan, even_layer_split

    ps = parse_plan(text)
    if ps.num_gpus != cfg.num_devices:
        raise SpecError("plan", text, f"is for {ps.num_gpus} GPUs but this job has {cfg.num_devices}")
    if num_processes > 1 and ps.num_stages > 1:
        # Stages hand activations over with jax.device_put, which JAX (0.10) refuses between
        # devices of different processes unless cross-host transfers are configured.
        raise SpecError("plan", text, f"has {ps.num_stages} pipeline stages; a job of {num_processes} "
                                      "processes runs one-stage plans (give one, or --launch single)")
    cell = Cell(ps.gpu_type, ps.num_gpus, max(1, gpus_per_node), ps.num_stages)
    try:
        default = partition_stages(model_spec, cell)
    except SpecError:  # not a catalog GPU type (e.g. a CPU test cell): split evenly
        default = even_layer_split(model_spec.num_layers, ps.num_stages)
    plan = ParallelPlan(ps.stage_plans(default), ps.micro_batches, ps.remat)
    check_plan(plan, arch, cfg.global_batch, cfg.num_devices)
    return plan, ps.format(), ps.cell_label


def _tuned_plan(cfg: RunConfig, alloc: SlurmAllocation, model_spec, arch):
    """The fastest feasible tuned plan of every stage count that this trainer can run."""
    from estimator.cells import Cell
    from estimator.cluster import cluster_from_dict
    from estimator.jobs import JobSpec
    from estimator.tuner import tune

    gpu = alloc.gpu_type or "a100"  # CPU runs outside a GPU partition: any catalog type
    per_node = alloc.gpus_per_node or cfg.num_devices
    nodes = max(1, cfg.num_devices // per_node)
    cluster = cluster_from_dict({"name": "allocation", "node_groups": [
        {"gpu_type": gpu, "nodes": nodes, "gpus_per_node": per_node}]})
    job = JobSpec(cfg.model, cfg.global_batch, cfg.num_devices, gpu)
    ranked = []
    stages = 1
    max_stages = 1 if alloc.num_processes > 1 else min(cfg.num_devices, model_spec.num_layers)
    while stages <= max_stages:
        result = tune(job, Cell(gpu, cfg.num_devices, per_node, stages), cluster)
        ranked.extend((p.score.iteration_time_s, result.plan_string(p))
                      for p in result.ranked if p.score.feasible)
        stages *= 2
    # The estimator does not know every constraint of the real shardings (tp must divide
    # heads and vocabulary, micro-batches the batch): take the best plan that passes them.
    for _, text in sorted(ranked, key=lambda r: r[0]):
        try:
            return _plan_from_text(text, model_spec, arch, cfg, alloc.gpus_per_node, alloc.num_processes)
        except SpecError as e:
            log.info("tuned plan %s skipped: %s", text, e)
    raise SpecError("plan", None, f"the tuner found no feasible plan for {cfg.model} on "
                                  f"{cfg.num_devices} {gpu}; give one with --plan")


def resolve_plan(cfg: RunConfig, alloc: SlurmAllocation, model_spec, arch, job_text: str | None):
    """(ParallelPlan, plan string, cell label) from flag/env, AdminComment or the tuner."""
    if cfg.plan_text:
        plan = _plan_from_text(cfg.plan_text, model_spec, arch, cfg, alloc.gpus_per_node,
                               alloc.num_processes)
        log.info("plan %s (given)", plan[1])
        return plan
    text = plan_tokens(admin_comment_from_scontrol(job_text)) if job_text else None
    if text:
        try:
            plan = _plan_from_text(text, model_spec, arch, cfg, alloc.gpus_per_node,
                                   alloc.num_processes)
            log.info("plan %s (from the AdminComment)", plan[1])
            return plan
        except SpecError as e:
            log.warning("AdminComment plan unusable (%s); tuning a plan here", e)
    plan = _tuned_plan(cfg, alloc, model_spec, arch)
    log.info("plan %s (tuned here)", plan[1])
    return plan


def _stream(arch, cfg: RunConfig):
    from job_scripts.data import ImageStream, TokenStream
    if arch.family == "wide_resnet":
        return ImageStream(cfg.seed, cfg.global_batch, arch.image_size, 3, arch.num_classes)
    return TokenStream(cfg.seed, cfg.global_batch, arch.seq_len, arch.vocab)


class _Meter:
    """Seconds per iteration after warm-up, written where the daemon reads it."""

    def __init__(self, warmup_steps: int):
        self.warmup_steps, self.seen, self.times_s = warmup_steps, 0, []

    def add(self, seconds: float) -> bool:
        """Record one step; True when the count of timed steps reached a power of two."""
        self.seen += 1
        if self.seen <= self.warmup_steps:
            return False
        self.times_s.append(seconds)
        n = len(self.times_s)
        return n & (n - 1) == 0

    def write(self, path: Path, info: dict) -> None:
        from job_scripts.checkpoint import write_json_atomic
        if not self.times_s:
            return
        mean_s = sum(self.times_s) / len(self.times_s)
        write_json_atomic(path, {**info, "iteration_time_s": mean_s,
                                 "steps_measured": len(self.times_s),
                                 "samples_per_s": info["global_batch"] / mean_s,
                                 "updated_at_s": time.time()})


def run_training(cfg: RunConfig, alloc: SlurmAllocation, stop: _StopFlag,
                 job_text: str | None = None) -> int:
    """Resume or start, train until done or signalled, checkpoint; returns the exit status."""
    import jax
    import numpy as np

    if cfg.compile_cache_dir:
        jax.config.update("jax_compilation_cache_dir", cfg.compile_cache_dir)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    if alloc.num_processes > 1:
        address = coordinator_address(alloc, os.environ.get(COORDINATOR_ENV),
                                      _resolves(alloc.node_names[0] if alloc.node_names else ""))
        jax.distributed.initialize(address, alloc.num_processes, alloc.process_id)
        log.info("jax.distributed: process %d of %d (coordinator %s), %d local and %d global devices",
                 jax.process_index(), jax.process_count(), address, jax.local_device_count(),
                 jax.device_count())
    from estimator import jax_models as jm
    from estimator.models import load_model
    from job_scripts import checkpoint as ck
    from job_scripts.data import data_position
    from job_scripts.train import Trainer

    devices = jax.devices()
    if len(devices) != cfg.num_devices:
        raise SpecError("devices", len(devices), f"JAX sees {len(devices)} devices, the job has "
                                                 f"{cfg.num_devices}; check CUDA_VISIBLE_DEVICES")
    model_spec = load_model(cfg.model)
    arch = jm.arch_from_model(model_spec)
    plan, plan_text, cell_label = resolve_plan(cfg, alloc, model_spec, arch, job_text)
    trainer = Trainer(arch, plan, devices, cfg.global_batch, jm.optimizer_for(arch))
    stream = _stream(arch, cfg)
    writer = alloc.process_id == 0
    meta = {"model": cfg.model, "global_batch": cfg.global_batch, "seed": cfg.seed,
            "cell": cell_label, "plan": plan_text, "job_id": alloc.job_id,
            "restart_count": alloc.restart_count}

    latest = ck.load_latest(cfg.checkpoint_dir)
    if latest is not None:
        for key in ("model", "global_batch", "seed"):
            if latest.meta.get(key) != meta[key]:
                raise SpecError(key, meta[key], f"the checkpoint {latest.path} was written with "
                                                f"{key}={latest.meta.get(key)!r}; use a new checkpoint directory")
        trainer.load_arrays(latest.arrays)
        done = latest.step
        log.info("resumed from step %d (checkpoint %s, plan %s); next step %d; "
                 "now plan %s on %d devices, global batch %d", done, latest.path,
                 latest.meta.get("plan"), done + 1, plan_text, len(devices), cfg.global_batch)
    else:
        trainer.init(cfg.seed)
        done = 0
        if alloc.restart_count:
            log.warning("restart %d of job %s found no checkpoint in %s: training from step 1 "
                        "(is the checkpoint root shared and the same as before?)",
                        alloc.restart_count, alloc.job_id, cfg.checkpoint_dir)
        log.info("starting at step 1 (no checkpoint in %s); plan %s on %d devices, "
                 "global batch %d", cfg.checkpoint_dir, plan_text, len(devices), cfg.global_batch)

    meter = _Meter(cfg.warmup_steps)
    measured_info = {"job_id": alloc.job_id, "cell": cell_label, "plan": plan_text,
                     "global_batch": cfg.global_batch, "num_devices": len(devices),
                     "platform": cfg.platform, "restart_count": alloc.restart_count}
    saved_step = done if latest is not None else None

    def save(step: int) -> None:
        nonlocal saved_step
        arrays = trainer.state_arrays()  # collective across processes: every process calls it
        if writer:
            data = data_position(stream, step + 1)
            ck.save_checkpoint(cfg.checkpoint_dir, step, arrays, {**meta, "data": data}, cfg.keep)
            meter.write(cfg.checkpoint_dir / MEASURED_FILE, measured_info)
        saved_step = step

    def agreed_stop() -> str | None:
        if alloc.num_processes == 1:
            return stop.signal_name
        from jax.experimental import multihost_utils
        codes = {None: 0, "SIGUSR1": 1, "SIGTERM": 2}
        mine = np.array([codes.get(stop.signal_name, 2)], np.int32)
        top = int(np.max(multihost_utils.process_allgather(mine)))
        return {0: None, 1: "SIGUSR1", 2: "SIGTERM"}[top]

    step = done
    while step < cfg.iterations:
        signalled = agreed_stop()
        if signalled:
            break
        step += 1
        batch = stream.batch(step)
        t0 = time.perf_counter()
        loss = trainer.step(batch.inputs, batch.targets)
        elapsed_s = time.perf_counter() - t0
        log.info("step %d loss %.6f time %.3fs", step, loss, elapsed_s)
        # Early and then ever rarer updates (1, 2, 4, 8, ... timed steps): the daemon
        # learns the real speed of a new plan within a few steps, at little cost.
        if meter.add(elapsed_s) and writer:
            meter.write(cfg.checkpoint_dir / MEASURED_FILE, measured_info)
        if cfg.checkpoint_every and step % cfg.checkpoint_every == 0 and step < cfg.iterations:
            save(step)
    signalled = agreed_stop()
    if saved_step != step:
        save(step)
    if writer and not (signalled and step < cfg.iterations):
        meter.write(cfg.checkpoint_dir / MEASURED_FILE, measured_info)
    if alloc.num_processes > 1:
        # A barrier: no process exits before process 0 has written the checkpoint.
        jax.distributed.shutdown()
    if signalled and step < cfg.iterations:
        code = EXIT_RESCALE if signalled == "SIGUSR1" else EXIT_TERMINATED
        log.info("%s: checkpointed step %d; exiting %d", signalled, step, code)
        return code
    log.info("finished: %d iterations", step)
    return 0


if __name__ == "__main__":
    sys.exit(main())
