"""The built-in runner: what ``job_scripts/elastic.sbatch`` execs inside a Slurm allocation.

``python -m job_scripts.run [options]`` trains a built-in model (or a model YAML) on a
seeded synthetic stream, as one user of the runtime API (``job_scripts.runtime``):

1. it reads the allocation, the job's settings and the daemon's plan (AdminComment);
2. it tunes inside the allocation: from the daemon's plan, it measures the Cell's
   pruned candidate plans on the granted devices and keeps the fastest
   (``job_scripts.tuning``; cached per model, global batch and Cell);
3. it resumes from the newest checkpoint, whatever plan wrote it, or starts fresh;
4. it trains the plan as one SPMD program (``job_scripts.pipeline``) and checkpoints
   every ``--checkpoint-every`` steps, on SIGUSR1 (then exits 86, which
   ``RequeueExitHold=86`` turns into a held requeue), on SIGTERM (exits 143) and at the end.

It writes ``<checkpoint dir>/measured.json`` (the plan that runs, where it came from, its
measured seconds per iteration) for the daemon. Without GPUs it runs on CPU fake devices,
one per granted GPU, so the whole protocol runs on a laptop or in CI.

Exit status: 0 done, 86 checkpointed for a rescale, 143 checkpointed on SIGTERM,
2 bad input (one line on stderr saying what to fix), 3 an fp16 model diverged (its
gradients stayed non-finite even unscaled; ``job_scripts.precision``).
"""

from __future__ import annotations

from job_scripts.stop_signal import StopSignal  # the standard library only

# Installed before anything else is imported: a rescale request that arrives while the
# runner starts up is recorded, not fatal (SIGUSR1's default action ends the process).
_STOP = StopSignal()
if __name__ == "__main__":
    _STOP.install()

import argparse  # noqa: E402
import logging  # noqa: E402
import math  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

from estimator.contract import EXIT_BAD_INPUT, EXIT_DIVERGED  # noqa: E402
from estimator.errors import SpecError  # noqa: E402
from job_scripts import runtime  # noqa: E402
from job_scripts.checkpoint import CheckpointError, Saved  # noqa: E402

# Named explicitly: run as ``python -m job_scripts.run`` this module's __name__ is __main__.
log = logging.getLogger("job_scripts.run")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m job_scripts.run", description=__doc__.split("\n\n")[0])
    p.add_argument("--elastic-script", help="batch script whose #ELASTIC lines give model, batch, iterations")
    p.add_argument("--model", help="built-in model name or model YAML path")
    p.add_argument("--global-batch", type=int, help="samples per iteration, whatever the plan")
    p.add_argument("--iterations", type=int, help="total training iterations")
    p.add_argument("--plan", help="plan string to run as is (else $SLURM_EXT_PLAN; else the AdminComment's, "
                                  "tuned here)")
    p.add_argument("--checkpoint-root", help="checkpoints go to ROOT/<job id> (else $SLURM_EXT_CHECKPOINT_ROOT, "
                                             "$SLURM_SUBMIT_DIR/checkpoints, ./checkpoints)")
    p.add_argument("--checkpoint-dir", help="exact checkpoint directory (overrides the root)")
    p.add_argument("--checkpoint-every", type=int, help="also checkpoint every K steps (else $SLURM_EXT_CHECKPOINT_EVERY, else 50; 0: never)")
    p.add_argument("--keep", type=int, default=2, help="checkpoints kept (default 2)")
    p.add_argument("--seed", type=int, default=0, help="seed of the weights and the data stream")
    p.add_argument("--devices", type=int, help="device count (default: the GPUs Slurm granted)")
    p.add_argument("--platform", choices=("auto", "cpu", "gpu"), default="auto",
                   help="where to train: gpu, cpu (one fake device per granted GPU), or auto (gpu when one is seen)")
    p.add_argument("--warmup-steps", type=int, default=2, help="steps not timed after each start")
    p.add_argument("--launch", choices=("auto", "srun", "single"), default=None,
                   help="on several nodes: srun one process per node (joined by jax.distributed) or "
                        "run a single process (else $SLURM_EXT_LAUNCH; auto: srun on GPUs, single on CPU)")
    p.add_argument("--compile-cache", help="JAX persistent compilation cache directory (else "
                                           "$SLURM_EXT_COMPILE_CACHE, else ROOT/jax-cache unless "
                                           "--checkpoint-dir is given; '' turns it off)")
    p.add_argument("--tune", action=argparse.BooleanOptionalAction, default=None,
                   help="measure the Cell's candidate plans before training (default on; "
                        "$SLURM_EXT_TUNE=0 turns it off)")
    p.add_argument("--tune-budget-s", type=float,
                   help="at most this many seconds of tuning (else $SLURM_EXT_TUNE_BUDGET_S, default 600)")
    p.add_argument("--tune-budget-frac", type=float,
                   help="and at most this fraction of the expected remaining run time "
                        "(else $SLURM_EXT_TUNE_BUDGET_FRAC, default 0.05)")
    return p


def _given(args: argparse.Namespace) -> dict:
    return {k: v for k, v in vars(args).items()}


def choose_plan(job: runtime.Job, model_spec, arch, remaining: int):
    """The plan to train with (``job_scripts.tuning.Tuned``): given, else tuned here from
    the AdminComment's, else the AdminComment's as is when tuning is off."""
    from estimator.plan_string import parse_plan
    from job_scripts.tuning import TuneRequest, Tuned, tune_plan, untuned

    cfg = job.config
    start = job.plan_text
    if job.plan_source == "given":
        _check(job, model_spec, arch, start)
        return Tuned(start, None, "given")
    stages = parse_plan(start).num_stages if start else None
    options_from = None
    if start:
        try:
            _check(job, model_spec, arch, start)
        except SpecError as e:
            if not cfg.tune.enabled:
                raise
            # Its ZeRO level and expert parallelism are kept, unless they are what cannot run.
            options_from = None if e.field in ("zero", "offload") else start
            log.warning("the AdminComment's plan cannot run here (%s); tuning a plan of these devices%s", e,
                        " with its ZeRO level and expert parallelism" if options_from else "")
            start = None
            if parse_plan(job.plan_text).num_gpus != len(job.devices):
                stages = None  # a plan for other GPUs: its stage count says nothing of these
    req = TuneRequest(cfg.model, model_spec, arch, cfg.global_batch, gpu_type_of(job),
                      job.alloc.gpus_per_node or len(job.devices), job.devices, stages, start,
                      remaining, cfg.platform, options_from=options_from)
    if not cfg.tune.enabled:
        return untuned(req)
    return tune_plan(req, cfg.tune, job.agree_max, lambda: job.stop_requested() is not None, job.writer)


def gpu_type_of(job: runtime.Job) -> str:
    """The GPU type the job runs on: the allocation's, else its plan's, else the catalog
    type its devices name (``Tesla V100-SXM2-32GB``), else a100."""
    from estimator.plan_string import parse_plan
    if job.alloc.gpu_type:
        return job.alloc.gpu_type
    if job.plan_text:
        return parse_plan(job.plan_text).gpu_type
    from job_scripts.precision import catalog_type_of_device
    return catalog_type_of_device(job.devices[0].device_kind if job.devices else "") or "a100"


def _check(job: runtime.Job, model_spec, arch, text: str):
    from job_scripts.plan import plan_from_string
    return plan_from_string(text, model_spec, arch, job.global_batch, len(job.devices),
                            job.alloc.gpus_per_node)


def train(job: runtime.Job) -> int:
    """Resume or start, train until done or signalled, checkpoint; returns the exit status."""
    from estimator import jax_models as jm
    from estimator.jax_optim import optimizer_for
    from estimator.models import load_model
    from job_scripts import reshard
    from job_scripts.data import stream_for
    from job_scripts.precision import (DivergedError, catalog_type_of_device, check_step, device_takes_bf16,
                                       training_arch)
    from job_scripts.pipeline import Pipeline

    cfg = job.config
    model_spec = load_model(cfg.model)
    # The dtype follows the devices' own compute capability, else their kind where it names
    # a catalog type (a plan may be another type's), else the job's GPU type.
    gpu = (catalog_type_of_device(job.devices[0].device_kind) if job.devices else None) or gpu_type_of(job)
    takes_bf16 = device_takes_bf16(job.devices[0]) if job.devices else None
    arch = training_arch(jm.arch_from_model(model_spec), gpu, takes_bf16)
    if arch.compute_dtype != model_spec.dtype:
        log.info("training the %s model in %s on %s (fp32's range: no loss scaling needed)", model_spec.dtype,
                 arch.compute_dtype, gpu)
    elif arch.compute_dtype == "fp16":
        log.info("training the fp16 model in fp16 with dynamic loss scaling (%s tensor cores take no bf16)", gpu)
    saved = job.latest()
    remaining = max(0, cfg.iterations - (saved.step if saved else 0))
    tuned = choose_plan(job, model_spec, arch, remaining)
    plan, text, cell = _check(job, model_spec, arch, tuned.plan)
    if tuned.source == "tuned" and tuned.measured:
        versus = f"; the AdminComment's plan {tuned.start_s:.4f} s" if tuned.start_s else ""
        log.info("plan %s (tuned here: %.4f s/iteration measured, %d candidates in %.1f s%s)", text,
                 tuned.iteration_time_s, len(tuned.measured), tuned.tuning_s, versus)
    job.set_running(text, cell, tuned.source, tuned.tuning_s, len(tuned.measured))
    pipe = Pipeline(arch, plan, job.devices, cfg.global_batch, optimizer_for(arch.optimizer))
    layout, views = {"layout": reshard.layout_json(pipe)}, reshard.saver(pipe)
    t0 = time.perf_counter()

    def read(ckpt: Saved):  # the reader's open files go with it: a rotated-out step is not kept alive
        reader = job.checkpoints.reader(ckpt.step)
        return reshard.restore(pipe, ckpt.meta.get("layout") or {}, lambda kind, dt, s, j, lo, hi: reader.read(
            (kind, dt), (s, j, slice(lo, hi))))
    saved, state = job.restored(saved, read)
    if saved is not None:
        pipe.set_loss_scale(saved.meta.get("loss_scale"))  # fp16's: a bf16 run's checkpoint has none
    else:
        state = pipe.init(cfg.seed)
    job.note_phase("restore_s" if saved is not None else "init_s", time.perf_counter() - t0)
    job.mark_resumed(saved, text)
    stream = stream_for(arch, cfg.seed, cfg.global_batch)
    step, skips_at_one = job.next_step - 1, 0
    while step < cfg.iterations:
        if job.stop_requested():
            break
        step += 1
        batch = stream.batch(step)
        scale = float(pipe.loss_scale.loss_scale) if pipe.scaled else None
        t0 = time.perf_counter()
        state, loss = pipe.step(state, batch.inputs, batch.targets)
        loss = float(loss)
        job.record_step(step, loss, time.perf_counter() - t0)
        if scale is not None:
            skips_at_one = check_step(step, bool(pipe.last_step_finite), scale, skips_at_one)
        elif not math.isfinite(loss):  # bf16 or fp32: no step is skipped, the weights are gone
            raise DivergedError(f"step {step}'s loss is {loss}: the model diverged; training stopped before "
                                "saving it (the newest checkpoint may hold the step before's update)")
        if job.checkpoint_due(step) and not skips_at_one:  # none inside a streak the run may die of
            job.save(step, views(state), {**layout, **_scale_meta(pipe)})
    # No copy when the step is saved already.
    return job.finish(step, lambda: views(state), {**layout, **_scale_meta(pipe)})


def _scale_meta(pipe) -> dict:
    """The loss scale, for the checkpoint's metadata (an fp16 model's: ``job_scripts.precision``)."""
    from job_scripts.precision import to_json
    return {"loss_scale": to_json(pipe.loss_scale)} if pipe.scaled else {}


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(name)s: %(message)s")
    argv = sys.argv[1:] if argv is None else argv
    try:
        args = _parser().parse_args(argv)
        job = runtime.start(stop=_STOP.install(), require=("model", "iterations"),
                            relaunch_argv=[sys.executable, "-m", "job_scripts.run", *argv], **_given(args))
    except (SpecError, CheckpointError) as e:
        print(f"job_scripts.run: error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    from job_scripts.precision import DivergedError
    try:
        return train(job)
    except (SpecError, CheckpointError) as e:
        # Starting over would silently throw away the job's progress: stop and say why.
        print(f"job_scripts.run: error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except DivergedError as e:
        print(f"job_scripts.run: error: {e}", file=sys.stderr)
        return EXIT_DIVERGED
    finally:
        job.close()


if __name__ == "__main__":
    sys.exit(main())
