"""`slurm-ext tune`: the best parallel plan inside one Cell.

Without ``--stages`` every stage count of the Cell's GPU count is tuned and the best Cell
wins. ``--measure`` times the best few plans on the devices present (real GPUs, else as
many CPU devices as the Cell has GPUs), compiled as the runtime runs them, and picks by
measurement.
"""

import json
import logging
import os
from dataclasses import replace

import click

from estimator.cells import Cell, gpus_per_node_of
from estimator.cluster import ClusterSpec, load_cluster
from estimator.errors import SpecError
from estimator.estimate import EstimateOptions, stage_counts
from estimator.jobs import JobSpec
from estimator.memory import ZERO_LEVELS, MemoryOptions
from estimator.models import load_model
from estimator.tuner import PRUNE_MODES, TuneOptions, TuneResult, tune
from slurm_ext.commands import check_gpu_counts, check_micro_batches, cluster_option

log = logging.getLogger(__name__)

DEFAULT_CLUSTER = "crius-1280"
MEASURE_TOP = 3


def _cells(job: JobSpec, cluster: ClusterSpec, gpus_per_node: int | None, stages: int | None) -> list[Cell]:
    """The Cells to tune: each stage count (or ``stages``) on each layout of the count over
    the type's node sizes the cluster holds (or on ``gpus_per_node``)."""
    check_gpu_counts(job.num_gpus, gpus_per_node)
    cluster.group(job.gpu_type)  # a type the cluster lacks: one line naming those it has
    if job.num_gpus > (capacity := cluster.total_gpus(job.gpu_type)):
        raise SpecError("gpus", job.num_gpus, f"{cluster.name} has {capacity} {job.gpu_type} GPUs")
    sizes = (gpus_per_node,) if gpus_per_node else cluster.node_sizes(job.gpu_type)
    layouts = [gpn for gpn in dict.fromkeys(gpus_per_node_of(job.num_gpus, n) for n in sizes)
               if cluster.holds_layout(job.gpu_type, job.num_gpus, gpn)]
    if not layouts:
        gpn = gpus_per_node_of(job.num_gpus, sizes[0])
        raise SpecError("gpus", job.num_gpus, f"{cluster.name} has too few {job.gpu_type} nodes of "
                        f"{gpn} or more GPUs for {job.num_gpus} laid out {gpn} a node")
    model = load_model(job.model)
    counts = [stages] if stages else stage_counts(job.num_gpus, model.num_layers, job.max_stages)
    return [Cell(job.gpu_type, job.num_gpus, gpn, s) for gpn in layouts for s in counts]


def _measure(job: JobSpec, result: TuneResult, gpus_per_node: int) -> TuneResult:
    """Time the top feasible plans on this machine's devices, as the runtime runs them
    (one SPMD program per plan), and re-rank by measurement."""
    # Only reached from the command line: the host device count must be set before JAX
    # starts, so that a machine without GPUs can still run an N-device plan.
    flag = f"--xla_force_host_platform_device_count={job.num_gpus}"
    if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + flag).strip()
    import jax

    from estimator.jax_models import arch_from_model
    from job_scripts.tuning import TuneRequest, measure_plan

    devices = jax.devices()
    if len(devices) < job.num_gpus:
        raise SpecError("gpus", job.num_gpus, f"--measure needs {job.num_gpus} devices, this machine "
                        f"has {len(devices)} {devices[0].platform} device(s); run where the Cell is")
    spec = load_model(job.model)
    top = [p for p in result.ranked if p.score.feasible][:MEASURE_TOP]
    if not top:
        return result
    req = TuneRequest(job.model, spec, arch_from_model(spec), job.global_batch, job.gpu_type, gpus_per_node,
                      devices[:job.num_gpus], result.cell.num_stages, None, 0, devices[0].platform)
    seconds = {}
    for p in top:
        m = measure_plan(req, result.plan_string(p), lambda x: x)
        if m.iteration_time_s is None:
            log.warning("could not measure %s: %s", m.plan, m.error)
            continue
        log.info("measured %s: %.4f s/iteration", m.plan, m.iteration_time_s)
        seconds[id(p)] = m.iteration_time_s
    return replace(result, ranked=rank_measured(result.ranked, seconds), measured=bool(seconds))


def rank_measured(ranked: tuple, seconds: dict[int, float]) -> tuple:
    """The measured plans (``seconds``: ``id(plan)`` → s/iteration) first, fastest first,
    then the others in their estimated order: each plan once."""
    timed = sorted((replace(p, measured_s=seconds[id(p)]) for p in ranked if id(p) in seconds),
                   key=lambda p: p.measured_s)
    return tuple(timed) + tuple(p for p in ranked if id(p) not in seconds)


def _runnable_only(result: TuneResult, memory: MemoryOptions, optimizer: str) -> TuneResult:
    """The result's plans the runner can run under ``memory`` (ZeRO-2 and 3: every stage
    split alike; ZeRO-3: remat; none of them expert-parallel or for Adafactor)."""
    return replace(result, ranked=tuple(p for p in result.ranked
                                        if memory.runs_plan(optimizer, p.candidate.stages, p.candidate.remat)))


def _text(result: TuneResult, top: int = 5) -> str:
    lines = [f"cell {result.cell.label()}  prune={result.prune}  "
             f"candidates evaluated: {result.candidates_evaluated}"]
    for i, p in enumerate(result.ranked[:top]):
        s = p.score
        t = f"{s.iteration_time_s:9.4f} s" if s.feasible else "  infeasible"
        m = f"  measured {p.measured_s:.4f} s" if p.measured_s is not None else ""
        why = f"  ({s.reason})" if not s.feasible else ""
        lines.append(f"{'*' if i == 0 else ' '} {result.plan_string(p):60} {t} "
                     f"{s.peak_memory_gb:6.1f} GB{m}{why}")
    if result.best is None or not result.best.score.feasible:
        lines.append("no feasible plan: try more GPUs, more stages or a larger-memory GPU type")
    return "\n".join(lines)


@click.command("tune")
@click.option("--model", required=True, help="Built-in model name (e.g. gpt-1.3b) or a model YAML file.")
@click.option("--global-batch", type=int, required=True, help="Samples per iteration.")
@click.option("--gpu-type", required=True, help="GPU type of the Cell.")
@click.option("--gpus", type=int, required=True, help="GPU count of the Cell.")
@click.option("--gpus-per-node", type=int, help="GPUs per node, a power of two (default: each node size the "
              "cluster has for the type; the best wins).")
@click.option("--stages", type=int, help="Pipeline stages (default: try every stage count).")
@click.option("--prune", type=click.Choice(PRUNE_MODES), default="cell", show_default=True,
              help="cell: Crius/Arena pruning; none: score the whole plan space.")
@click.option("--measure", is_flag=True, help="Time the best plans on this machine's devices.")
@cluster_option(DEFAULT_CLUSTER, "Built-in cluster ({builtins}) or a cluster YAML file (its network and node size).")
@click.option("--micro-batches", type=int,
              help="Micro-batch count the search starts from (default: the Cell estimate's).")
@click.option("--zero", "zero_level", type=click.IntRange(0, 3),
              help="ZeRO stage of every plan (default: the fastest plan the runner runs under any "
                   "of 0 to 3: more split states may let a faster split fit, as `estimate` finds).")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of text.")
def command(model, global_batch, gpu_type, gpus, gpus_per_node, stages, prune, measure, cluster,
            micro_batches, zero_level, as_json):
    """The best parallel plan inside one Cell (per stage dp x tp, micro-batches, remat)."""
    if stages is not None and stages < 1:
        raise SpecError("stages", stages, "give a positive integer")
    job = JobSpec(model, global_batch, gpus, gpu_type)
    check_micro_batches(micro_batches, job.global_batch)
    cluster_spec = load_cluster(cluster)
    cells = _cells(job, cluster_spec, gpus_per_node, stages)
    optimizer = load_model(model).optimizer
    if zero_level and not MemoryOptions(zero_level=zero_level).runnable(optimizer):
        raise SpecError("zero", zero_level, f"the runner shards optimizer states only of element-wise optimizers; "
                                            f"{model} trains with {optimizer}: give --zero 0 or leave it out")
    evaluated, best = 0, None
    for level in (zero_level,) if zero_level is not None else ZERO_LEVELS:
        memory = MemoryOptions(zero_level=level)
        options = TuneOptions(prune=prune, estimate=EstimateOptions(micro_batches=micro_batches, memory=memory))
        results = [_runnable_only(tune(job, cell, cluster_spec, options), memory, optimizer) for cell in cells]
        evaluated += sum(r.candidates_evaluated for r in results)
        found = min(results, key=lambda r: r.best.rank_key() if r.best else (True, float("inf")))
        fits = found.best is not None and found.best.score.feasible
        if best is None or (fits and (best.best is None or found.best.rank_key() < best.best.rank_key())):
            best = found  # the fastest level's; nothing fits at any: the first level's plans
    best = replace(best, candidates_evaluated=evaluated)
    if measure:
        best = _measure(job, best, best.cell.gpus_per_node)
    click.echo(json.dumps(best.to_json()) if as_json else _text(best))
