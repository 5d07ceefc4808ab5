"""`slurm-ext estimate`: the Cells of one job, their estimated speed and memory."""

import json
import sys
from contextlib import contextmanager

import click

from estimator.cluster import load_cluster
from estimator.errors import SpecError
from estimator.estimate import EstimateOptions, JobEstimate, estimate_job
from estimator.jobs import JobSpec
from estimator.memory import MemoryOptions
from estimator.models import load_model
from slurm_ext.commands import check_gpu_counts, check_micro_batches, check_writable, cluster_option

DEFAULT_CLUSTER = "crius-1280"
BATCH_KEYS = {"model", "global_batch", "gpu_type", "num_gpus", "gpus_per_node", "max_stages", "trainer"}
MAX_BATCH_LINE_BYTES = 4096


def _check_zero(model: str, options: EstimateOptions) -> None:
    """ZeRO 1-3 of a model whose optimizer the runner does not shard is refused (its Cells
    would be listed feasible, and none runnable) unless ``--what-if`` asks for them."""
    memory, optimizer = options.memory, load_model(model).optimizer
    if options.runnable_only and memory.zero_level and not memory.runnable(optimizer):
        raise SpecError("zero", memory.zero_level, f"the runner shards optimizer states only of element-wise "
                                                   f"optimizers; {model} trains with {optimizer}: give --zero 0, "
                                                   "or add --what-if to see them estimated anyway")


def _estimate(model: str, global_batch: int, gpu_type: str | None, gpus: int | None,
              gpus_per_node: int | None, max_stages: int | None, cluster_name: str,
              options: EstimateOptions, trainer: str = "runner") -> JobEstimate:
    check_gpu_counts(gpus, gpus_per_node)
    cluster = load_cluster(cluster_name)
    job = JobSpec(model, global_batch, gpus, gpu_type, max_stages, trainer=trainer)
    _check_zero(model, options)
    if job.gpu_type:
        cluster.group(job.gpu_type)  # a clear error for a type the cluster lacks, before its node sizes
    types = (job.gpu_type,) if job.gpu_type else cluster.gpu_types
    # What the cluster cannot hold at all is said, not left out of the table.
    if gpus_per_node is not None and not any(size >= gpus_per_node for t in types for size in cluster.node_sizes(t)):
        sizes = ", ".join(f"{t} {max(cluster.node_sizes(t))}" for t in types)
        raise SpecError("gpus_per_node", gpus_per_node, f"{cluster.name} has no node that large (GPUs per node: "
                                                        f"{sizes})")
    return estimate_job(job, cluster, options, (job.gpu_type,) if job.gpu_type else None, gpus_per_node)


def _fit(text: str, width: int) -> str:
    """``text`` in a column of ``width``, cut with an ellipsis when longer."""
    return f"{text:{width}}" if len(text) <= width else text[:width - 1] + "…"


def _number(value: float, width: int, decimals: int) -> str:
    """``value`` right-aligned in ``width`` columns, in powers of ten when fixed point
    would not fit (an absurd model's terabytes)."""
    text = f"{value:{width}.{decimals}f}"
    return text if len(text) <= width else f"{value:{width}.{max(0, width - 6)}e}"


def _table(result: JobEstimate) -> str:
    head = (f"{'':1} {'type':5} {'gpus':>4} {'nodes':>5} {'/node':>5} {'stg':>3}  "
            f"{'plan (dp x tp per stage)':28} {'s/iter':>8} {'samples/s':>9} {'GB/GPU':>6}  note")
    lines = [f"model {result.job.model}, global batch {result.job.global_batch}", head]
    for c in result.cells:
        plan = "|".join(s.label() for s in c.stages) or "-"
        mark = "*" if c is result.best else " "
        t = _number(c.iteration_time_s, 8, 3) if c.feasible else f"{'-':>8}"
        rate = _number(c.samples_per_s, 9, 2) if c.feasible else f"{'-':>9}"
        # A Cell refused before any plan was costed (no power-of-two split) has no figure.
        gb = _number(c.peak_memory_gb, 6, 1) if c.feasible or c.stages else f"{'-':>6}"
        notes = [c.reason] if not c.feasible else []
        if c.feasible and (c.zero_level or c.offload):
            notes.append(f"ZeRO-{c.zero_level}" + (f" + offload ({c.host_memory_gb:.0f} GB host/GPU)"
                                                   if c.offload else ""))
        if c.feasible and not c.runnable:
            notes.append("estimated only: the runner cannot run it yet")
        if c.comm_source == "model":
            notes.append("comm: latency-bandwidth model")
        elif c.comm_source == "profile":
            notes.append("comm: profiled")
        if c.fidelity != "analytic" or c.memory_fidelity != "analytic":
            notes.append(f"time: {c.fidelity}, memory: {c.memory_fidelity}")
        note = "; ".join(notes)
        cell = c.cell
        lines.append(f"{mark} {cell.gpu_type:5} {cell.num_gpus:4} {cell.num_nodes:5} "
                     f"{min(cell.gpus_per_node, cell.num_gpus):5} {cell.num_stages:3}  {_fit(plan, 28)} "
                     f"{t} {rate} {gb}  {note}")
    if not result.cells:
        lines.append("no Cell: the cluster has no GPU type with that many GPUs (or none of the type asked for); "
                     "ask for fewer GPUs, another type or another --cluster")
    elif result.best is None:
        lines.append("no Cell fits: try more GPUs, a larger-memory GPU type or a smaller global batch")
    else:
        b = result.best
        lines.append(f"best (*): {b.cell.label()} {b.samples_per_s:.2f} samples/s")
    asked = result.job.num_gpus
    if result.cells and asked and all(c.cell.num_gpus != asked for c in result.cells):
        lines.append(f"no Cell of {asked} GPUs: no GPU type asked for has that many; shown are half and "
                     "twice the count where they fit")
    return "\n".join(lines)


def _read_batch(source) -> list[tuple[int, dict]]:
    """Parse and validate every request before anything is estimated or printed: (line
    number, request) for each."""
    requests = []
    lines = iter(source)
    lineno = 0
    while True:
        try:
            line = next(lines)
        except StopIteration:
            break
        except UnicodeDecodeError:
            raise SpecError(f"line {lineno + 1}", "…", "not UTF-8 text") from None
        lineno += 1
        if lineno == 1:
            line = line.removeprefix("\ufeff")  # a byte-order mark (an editor's) is no part of the JSON
        if not line.strip():
            continue
        where = f"line {lineno}"
        if len(line.encode()) > MAX_BATCH_LINE_BYTES:
            raise SpecError(where, line[:40] + "…", f"longer than {MAX_BATCH_LINE_BYTES} bytes")
        try:
            req = json.loads(line)
        except json.JSONDecodeError as e:
            raise SpecError(where, line.strip()[:60], f"not JSON ({e.msg})") from None
        if not isinstance(req, dict):
            raise SpecError(where, req, "each line is a JSON object")
        unknown = set(req) - BATCH_KEYS
        if unknown:
            raise SpecError(f"{where}.{sorted(unknown)[0]}", req[sorted(unknown)[0]],
                            f"unknown key; use {', '.join(sorted(BATCH_KEYS))}")
        for key in ("model", "global_batch"):
            if key not in req:
                raise SpecError(f"{where}.{key}", None, "required")
        for key, value in req.items():
            if value is None and key not in ("model", "global_batch"):
                continue  # an optional key given as null: as if absent
            if key in ("model", "gpu_type", "trainer"):
                right, kind = isinstance(value, str), "a string"
            else:
                right, kind = isinstance(value, int) and not isinstance(value, bool), "a whole number"
            if not right:
                raise SpecError(f"{where}.{key}", value, kind)
        requests.append((lineno, req))
    return requests


@contextmanager
def _named_by_line(lineno: int):
    """A request's error, named as its line names it (``line 3.num_gpus``)."""
    try:
        yield
    except SpecError as e:
        field = "num_gpus" if e.field == "gpus" else e.field
        raise SpecError(f"line {lineno}.{field}", e.value, e.hint) from None


@click.command("estimate")
@click.option("--model", help="Built-in model name (e.g. gpt-1.3b) or a model YAML file.")
@click.option("--global-batch", type=int, help="Samples per iteration.")
@click.option("--gpu-type", help="Only Cells of this GPU type.")
@click.option("--gpus", type=int, help="Requested GPU count N: Cells of N/2, N and 2N GPUs. "
              "Without it, every power of two from the smallest that fits, up to 64.")
@click.option("--gpus-per-node", type=int, help="GPUs per node (default: the cluster's node size).")
@click.option("--max-stages", type=int, help="Only Cells of at most this many pipeline stages: "
              "what the job's training script can run (1 for data and tensor parallelism only). "
              "Default: any stage count.")
@click.option("--trainer", type=click.Choice(["runner", "api"]), default="runner", show_default=True,
              help="What trains the job (#ELASTIC trainer=): the built-in runner, or api, a script of your own "
                   "on the runtime API (one stage, ZeRO-0, no remat: what such a script runs).")
@cluster_option(DEFAULT_CLUSTER, "Built-in cluster ({builtins}) or a cluster YAML file.")
@click.option("--micro-batches", type=int,
              help="Pipeline micro-batches of every Cell (default 4 × stages, or the largest count "
                   "below it that divides the global batch; doubled while a Cell does not fit).")
@click.option("--comm-table", type=click.Path(dir_okay=False),
              help="Measured collectives CSV replacing the shipped one.")
@click.option("--fidelity", type=click.Choice(["analytic", "compiled"]), default="analytic",
              show_default=True, help="compiled: compile every stage variant with XLA on CPU "
              "devices (cached on disk; minutes the first time) and use its FLOPs, collectives "
              "and, with --gpu-specs-dir and the GPU-target extra, its memory.")
@click.option("--compile-cache", type=click.Path(file_okay=False),
              help="Cache directory of compiled stages (default ~/.cache/slurm-ext).")
@click.option("--gpu-specs-dir", type=click.Path(file_okay=False, exists=True),
              help="XLA GPU target specs, for compiled memory of the Cell's GPU type.")
@click.option("--profile-db", type=click.Path(dir_okay=False, exists=True),
              envvar="SLURM_EXT_PROFILE_DB", show_envvar=True,
              help="Profile store of `slurm-ext profile`: profiled GPU types use its fitted "
                   "efficiency and collectives, and its timed layers (fidelity: profiled).")
@click.option("--batch", "batch_file", type=click.File("r"),
              help="One JSON request per line (FILE or - for stdin); prints one JSON result per line.")
@click.option("--remat", type=click.Choice(["on", "off", "auto"]), default="on", show_default=True,
              help="Layer rematerialization: on, off, or auto (both estimated, the faster that fits kept).")
@click.option("--zero", "zero_level", type=click.IntRange(0, 3), default=0, show_default=True,
              help="ZeRO stage: 0 replicated states, 1 optimizer states sharded over dp, 2 also gradients, "
                   "3 also weights. The runner runs 0, and 1 to 3 for AdamW and SGD outside --expert-parallel "
                   "stages, 2 and 3 where every stage is split alike, 3 under remat (each Cell's \"runnable\" "
                   "says). A level is the least tried: a Cell that fits only with a higher one, or whose wider "
                   "data-parallel split fits only with one and is faster, is estimated with it.")
@click.option("--offload", is_flag=True,
              help="ZeRO-Offload: optimizer states and the update on the host (its memory and PCIe are in the "
                   "estimate, host_memory_gb per GPU). Estimated only; the runner does not run it.")
@click.option("--what-if", is_flag=True,
              help="Count Cells that fit only with settings the runner cannot run yet (offload, ZeRO-3 "
                   "without remat, ZeRO-1 to 3 for Adafactor) as feasible (their \"runnable\" is false); implied "
                   "by --offload and by --zero 3 --remat off.")
@click.option("--stage-gpus", type=click.Choice(["equal", "arena"]), default="equal", show_default=True,
              help="GPUs per pipeline stage: equal, or arena (Arena's power-of-two counts in proportion to "
                   "each stage's load, kept where faster; estimated only, runnable false).")
@click.option("--expert-parallel", is_flag=True,
              help="MoE models: also try each data-parallel stage with its experts split over all its GPUs "
                   "(tokens routed by all-to-all), kept where faster; the runner runs it with and without "
                   "tensor parallelism.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
def command(model, global_batch, gpu_type, gpus, gpus_per_node, max_stages, trainer, cluster, micro_batches,
            comm_table, fidelity, compile_cache, gpu_specs_dir, profile_db, remat, zero_level, offload, what_if,
            stage_gpus, expert_parallel, batch_file, as_json):
    """The Cells of one job: for each GPU type × GPU count × stage count, its estimated plan
    (per stage, data parallelism as wide as the batch allows or tensor parallelism only,
    the faster: Crius's agile estimate; `slurm-ext tune` searches the plans inside one Cell),
    seconds per iteration, samples/s and peak memory per GPU, or why it does not fit.

    JSON: {"model", "global_batch", "cells": [...], "best": {...} | null}.

    --batch lines: {"model", "global_batch"} and optionally "gpu_type", "num_gpus" (--gpus),
    "gpus_per_node", "max_stages", "trainer" (as the flags of the same names); the flags, when given,
    apply to the lines that lack the key.
    """
    if fidelity == "compiled":
        check_writable("compile_cache", compile_cache, directory=True)
        from estimator.compiled import gpu_target_available
        if gpu_specs_dir and not gpu_target_available():
            click.echo("slurm-ext: warning: --gpu-specs-dir needs the GPU-target extra (pip install "
                       "'.[gpu-target]'), not installed: memory stays the formulas'", err=True)
    else:
        unused = [flag for flag, value in (("--compile-cache", compile_cache), ("--gpu-specs-dir", gpu_specs_dir))
                  if value is not None]
        if unused:
            raise click.UsageError(f"{' and '.join(unused)} only appl{'y' if len(unused) > 1 else 'ies'} with "
                                   "--fidelity compiled")
    if trainer == "api":
        source = click.get_current_context().get_parameter_source
        given = [flag for name, flag in (("zero_level", "--zero"), ("offload", "--offload"), ("remat", "--remat"),
                                         ("expert_parallel", "--expert-parallel"))
                 if source(name) is click.core.ParameterSource.COMMANDLINE]
        if given:
            raise click.UsageError(f"{given[0]} does not apply with --trainer api: a script on the runtime API "
                                   "runs ZeRO-0 plans without remat or expert parallelism")
    memory = MemoryOptions(zero_level=zero_level, offload=offload)
    options = EstimateOptions(micro_batches=micro_batches, comm_table=comm_table, fidelity=fidelity,
                              compile_cache_dir=compile_cache, gpu_specs_dir=gpu_specs_dir,
                              profile_db=profile_db, remat={"on": True, "off": False, "auto": None}[remat],
                              memory=memory,
                              runnable_only=not (what_if or not memory.runnable(remat=remat != "off")),
                              stage_gpus=stage_gpus, expert_parallel=expert_parallel)
    if batch_file is not None:
        if model is not None or global_batch is not None:
            raise click.UsageError("--batch reads model and global_batch from each line; drop --model/--global-batch")
        check_gpu_counts(gpus, gpus_per_node)  # the flags' own errors, before any line's
        cluster_spec, lines = load_cluster(cluster), []
        for lineno, req in _read_batch(batch_file):
            # --gpu-type, --gpus, --gpus-per-node, --max-stages and --trainer: for lines without their own
            # (or with it given as null).
            def given(key, flag):
                return flag if req.get(key) is None else req[key]
            args = (req["model"], req["global_batch"], given("gpu_type", gpu_type), given("num_gpus", gpus),
                    given("gpus_per_node", gpus_per_node), given("max_stages", max_stages))
            with _named_by_line(lineno):  # what can be told without estimating, of every line first
                check_micro_batches(micro_batches, args[1])
                check_gpu_counts(args[3], args[4])
                JobSpec(args[0], args[1], args[3], args[2], args[5], trainer=given("trainer", trainer))
                _check_zero(args[0], options)
                if args[2] is not None:
                    cluster_spec.group(args[2])
            lines.append((lineno, args, given("trainer", trainer)))
        results = []
        for lineno, args, line_trainer in lines:
            with _named_by_line(lineno):
                results.append(_estimate(*args, cluster, options, line_trainer))
        sys.stdout.write("".join(json.dumps(r.to_json()) + "\n" for r in results))
        return
    if not model or global_batch is None:
        raise click.UsageError("give --model and --global-batch (or --batch FILE)")
    check_micro_batches(micro_batches, global_batch)
    if expert_parallel and not any(layer.experts for layer in load_model(model).layers):
        click.echo(f"slurm-ext: note: {model} has no expert layers: --expert-parallel changes nothing", err=True)
    result = _estimate(model, global_batch, gpu_type, gpus, gpus_per_node, max_stages, cluster, options, trainer)
    click.echo(json.dumps(result.to_json(), indent=2) if as_json else _table(result))
