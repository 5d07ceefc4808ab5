"""Analytic Cell estimation (Crius's agile estimation, formulas in place of compiles).

For a Cell the layers are split into stages (``estimator.partition``); every stage is
costed data-parallel-only and tensor-parallel-only (and, for MoE with
``expert_parallel``, data-parallel with its experts sharded); the assembled plan is
scored with the GPipe pipeline formula — first micro-batch through all stages + (B − 1)
× the slowest stage — plus the data-parallel gradient synchronisation and the optimizer
update. It gives the Cell's seconds per iteration, samples/s and peak memory per GPU.

A stage's cost depends only on its own plan (inter-stage sends are charged to the
sender); each stage takes its feasible variant with the fastest micro-batch, or the one
fastest as the pipeline's slowest stage would be (B micro-batches plus its gradient sync
and update), whichever assembly gives the faster pipeline. The tuner
(``estimator.tuner``) enumerates richer plans (hybrid dp × tp, micro-batch counts, remat).
"""

import logging
import math
from dataclasses import dataclass, field, replace
from functools import lru_cache

from estimator.batching import (dp_cap, micro_batch_count, moe_routes, moe_shard_problem, more_micro_batches,
                                replica_batch)
from estimator.cells import Cell, CellEstimate, StagePlan, gpus_per_node_of
from estimator.cluster import ClusterSpec, NodeGroup
from estimator.comm import CommTable, load_comm_table, with_profiled
from estimator.compute import Efficiency, efficiency, layer_time_s
from estimator.errors import SpecError
from estimator.gpus import gpu_type as _gpu_type
from estimator.jobs import MAX_GPUS, JobSpec, job_model
from estimator.host import HostSpec, default_host
from estimator.memory import (GRADIENT_BYTES, OPTIMIZER_STATE_BYTES, MemoryOptions, StageMemory, host_memory_gb,
                              memory_alternatives, memory_label, runner_row_bytes, stage_memory, stage_params)
from estimator.models import DTYPE_BYTES, ModelSpec, tp_problem
from estimator.partition import arena_stage_gpus, balanced_partition, stage_gpu_counts
from estimator.plan_string import MAX_PLAN_STRING, format_plan
from estimator.profile_fit import profiled_layer_s
from estimator.profile_store import (ProfileView, cached_profile_view, collective_csv_rows, model_fingerprint,
                                     store_version)
from estimator.stage_comm import (collective_s, dp_groups_per_node, gradient_sync_s, span_nodes,
                                  stage_collectives_s, stage_send_s)

log = logging.getLogger(__name__)

PLAN_SPACES = ("cell", "dp-only")
FIDELITIES = ("analytic", "compiled")
STAGE_GPUS = ("equal", "arena")
PROFILED = "profiled"


@dataclass(frozen=True)
class EstimateOptions:
    """How Cells are enumerated and estimated.

    Attributes:
        plan_space: ``cell`` — per stage dp-only or tp-only, every stage count;
            ``dp-only`` — one stage, data parallelism only (what static baselines see).
        micro_batches: pipeline micro-batches; None means 4 × stages (the measured tables
            used 16), or the largest count below it that divides the per-replica batch.
        remat: layer-level rematerialization; None chooses per Cell (off where it fits,
            the faster; on where only that fits).
        memory: reserve, usable fraction, ZeRO level, offload.
        runnable_only: a Cell that fits only with settings the runner cannot run yet
            (ZeRO 1–3, offload) is reported infeasible, its reason naming them; False
            counts it feasible (what-if estimates).
        host: the hosts' memory and PCIe per GPU (None: ``estimator.host.default_host``).
        comm_table: path of a measured collectives CSV; None for the shipped one.
        max_gpus: the largest GPU count a "serverless" job (no count asked) is offered.
        efficiency: per-GPU-type efficiency override (used when fitting).
        fidelity: ``analytic`` (formulas) or ``compiled``: every stage variant's training
            step is compiled with XLA (``estimator.compiled``) and its per-device FLOPs,
            collectives and, with the GPU-target extra, memory replace the formulas.
        compile_cache_dir: where compiled results are cached (None: the default cache).
        gpu_specs_dir: XLA GPU target specs, for compiled memory of the Cell's GPU type.
        profile_db: a profile store (``slurm-ext profile``): GPU types it profiled get its
            fitted efficiency and collectives, and the layers it timed for the job's model
            take their profiled times; such Cells say ``fidelity: profiled``.
        stage_gpus: ``equal`` — every stage of a Cell gets the same GPU count; ``arena`` —
            a Cell of three or more stages also tries Arena's power-of-two counts in
            proportion to the stages' load (``estimator.partition.arena_stage_gpus``) and
            keeps them where they are faster; such plans are ``runnable: false`` (the
            runner runs equal counts).
        expert_parallel: a MoE stage with data parallelism also tries its experts sharded
            over all its GPUs, tokens routed by all-to-all (GShard's layout, what Alpa's
            auto-sharding finds for the measured MoE runs; ``StagePlan.ep``), kept where
            faster. The runner runs it with and without tp.
    """

    plan_space: str = "cell"
    micro_batches: int | None = None
    remat: bool | None = True
    memory: MemoryOptions = MemoryOptions()
    runnable_only: bool = True
    host: HostSpec | None = None
    comm_table: str | None = None
    max_gpus: int = 64
    fidelity: str = "analytic"
    compile_cache_dir: str | None = None
    gpu_specs_dir: str | None = None
    profile_db: str | None = None
    stage_gpus: str = "equal"
    expert_parallel: bool = False
    efficiency: dict[str, Efficiency] | None = field(default=None, hash=False, compare=False)

    def __post_init__(self):
        for name, allowed in (("plan_space", PLAN_SPACES), ("fidelity", FIDELITIES), ("stage_gpus", STAGE_GPUS)):
            if getattr(self, name) not in allowed:
                raise SpecError(name, getattr(self, name), f"use one of {', '.join(allowed)}")
        if self.micro_batches is not None and self.micro_batches < 1:
            raise SpecError("micro_batches", self.micro_batches, "give a positive integer")


@dataclass(frozen=True)
class StageCost:
    """One stage under one (dp, tp): time per micro-batch and per iteration, memory."""

    plan: StagePlan
    micro_batch_s: float  # forward + backward (+ recompute) of one micro-batch, with tp comm and sends
    sync_s: float  # data-parallel gradient synchronisation, once per iteration
    update_s: float  # optimizer update, once per iteration
    memory: StageMemory
    feasible: bool
    reason: str
    comm_source: str
    compiled_peak_gb: float | None = None  # from a GPU-target compile, when there was one
    compute_source: str = "analytic"  # or "profiled": the site's profile gave the compute time
    memory_source: str = "analytic"  # profiled: every layer's activations from the site's profile

    @property
    def peak_gb(self) -> float:
        return self.memory.peak_gb if self.compiled_peak_gb is None else self.compiled_peak_gb


@dataclass(frozen=True)
class PlanScore:
    iteration_time_s: float
    peak_memory_gb: float
    feasible: bool
    reason: str
    stage_times_s: tuple[float, ...]
    comm_source: str


@dataclass(frozen=True)
class JobEstimate:
    job: JobSpec
    cells: tuple[CellEstimate, ...]
    best: CellEstimate | None

    def to_json(self) -> dict:
        return {
            "model": self.job.model,
            "global_batch": self.job.global_batch,
            "cells": [c.to_json() for c in self.cells],
            "best": self.best.to_json() if self.best else None,
        }


@dataclass(frozen=True)
class _Context:
    model: ModelSpec
    global_batch: int
    cell: Cell
    group: NodeGroup
    table: CommTable
    eff: Efficiency
    micro_batches: int
    remat: bool
    options: EstimateOptions
    profile: ProfileView | None = None  # the site's profile, when the options name one
    eff_source: str = "analytic"  # "profiled" when the profile fitted this type's efficiency
    host: HostSpec = HostSpec()
    fingerprint: str | None = None  # the model's, when the profile timed any layers


def stage_cost(ctx: _Context, index: int, first_device: int, plan: StagePlan, compiled=None) -> StageCost:
    """Cost one stage: compute, tensor-parallel collectives, send to the next stage.

    ``compiled`` (an ``estimator.compiled.CompiledStage`` of this stage variant) replaces
    the formulas' FLOPs, collectives and, when it has one, the memory figure.
    """
    model, gpu = ctx.model, _gpu_type(ctx.cell.gpu_type)
    layers = model.layers[plan.layer_start:plan.layer_end]
    dp, tp, B = plan.dp, plan.tp, ctx.micro_batches
    sources: set[str] = set()
    samples_per_micro = ctx.global_batch / B
    micro = samples_per_micro / dp
    if ctx.global_batch % (B * dp):
        reason = f"global batch {ctx.global_batch} does not split into {B} micro-batches × dp {dp}"
    else:
        reason = moe_shard_problem(model, int(micro)) or tp_problem(layers, tp)
    passes = 3.0 + (1.0 if ctx.remat else 0.0)
    comm_passes = 2.0 + (1.0 if ctx.remat else 0.0)
    flops_scale = 1.0
    if compiled is not None:
        formula = sum(layer.flops_fwd for layer in layers) * micro / tp * passes
        flops_scale = compiled.flops_per_device / formula if formula > 0 else 1.0
    compute_s, timed = _compute_s(ctx, gpu, plan, micro, passes, flops_scale, compiled is None)
    compute_source = PROFILED if compiled is None and (timed or ctx.eff_source == PROFILED) else "analytic"
    comm_s = stage_collectives_s(ctx, layers, plan, first_device, micro, comm_passes, compiled, sources)
    send_s = stage_send_s(ctx, index, layers, plan, first_device, micro, sources)
    replicated, experts = stage_params(layers, dp, tp, plan.ep)
    memory = ctx.options.memory
    d = DTYPE_BYTES[model.dtype]
    # The runner keeps weights and gradients in float32 flat buffers and sums, scatters and
    # gathers those (``job_scripts.flat_optimizer``); Alpa's gradients are in the model's dtype.
    wire = GRADIENT_BYTES if memory.program == "runner" else d
    # Expert-parallel experts are each on one dp rank: no data-parallel sum of their grads.
    sync_s = gradient_sync_s(ctx, plan, first_device, replicated * wire, compiled, sources)
    # The update reads weights, grads, master and states, and writes weights, master,
    # states (a mixed-precision update's traffic; the time model predates the runner's
    # fp32-only weights and is kept as fitted).
    master_opt = (4.0 if d < 4 else 0.0) + OPTIMIZER_STATE_BYTES[model.optimizer]
    update_params = replicated / (dp if memory.zero_level >= 1 or memory.offload else 1) + experts
    update_bytes = update_params * (2 * d + d + 2 * master_opt)
    host = ctx.host
    if memory.offload:
        # ZeRO-Offload: gradients down and weights up over PCIe, the update streamed by
        # the host's memory (shared by the node's GPUs).
        gpn = min(ctx.cell.gpus_per_node, ctx.cell.num_gpus)
        host_bw = host.memory_bandwidth_gbytes_s_per_node / gpn * 1e9
        update_s = 2 * update_params * d / (host.pcie_gbytes_s * 1e9) + update_bytes / host_bw
    else:
        update_s = update_bytes / (gpu.memory_bandwidth_gbytes_s * 1e9 * ctx.eff.memory_frac)
    if memory.zero_level >= 3 and dp > 1:
        # ZeRO-3 gathers each layer's weights before its forward and backward (and its
        # recompute): per micro-batch, an all-gather of the stage's weights per pass, in
        # the compute dtype (``job_scripts.zero3``). The runner gathers in the forward and
        # the recompute (its backward reuses those).
        gpn = min(ctx.cell.gpus_per_node, ctx.cell.num_gpus)
        t, src = collective_s(ctx, "all-gather", dp, span_nodes(first_device, dp, tp, gpn), replicated * d,
                              dp_groups_per_node(plan, gpn))
        sources.add(src)
        comm_s += (2.0 if memory.runner_zero3 else comm_passes) * t
    # GPipe keeps every micro-batch's residuals until the backward passes start (the
    # runner's buffer has a spare row). The runner's single stage is plain gradient
    # accumulation, one micro-batch at a time; Alpa runs GPipe on one stage too.
    if memory.program == "alpa":
        in_flight = B
    else:
        in_flight = B + 1 if ctx.cell.num_stages > 1 else 1
    profiled_acts = _profiled_activations(ctx, plan) if compiled is None else None
    mem = stage_memory(model, layers, dp, tp, max(1, math.ceil(micro)), in_flight, ctx.remat,
                       memory, micro_batches=B, activation_bytes_per_sample=profiled_acts,
                       expert_parallel=plan.ep)
    compiled_peak_gb = None
    if compiled is not None and compiled.memory_bytes and not (memory.zero_level or memory.offload):
        # The compiled step (replicated states; under ZeRO or offload the formulas stand) holds one
        # micro-batch: GPipe keeps the others' residuals too, accumulating a second gradient buffer.
        if memory.program == "runner":
            row = runner_row_bytes(layers, dp, tp, micro, d, ctx.remat, plan.ep)
        else:
            row = micro * sum(x.output_bytes if ctx.remat else x.activation_bytes for x in layers)
        second_gb = mem.micro_gradients_gb or (mem.gradients_gb if mem.accumulating else mem.packed_sum_gb)
        compiled_peak_gb = (compiled.memory_bytes + (in_flight - 1) * row) / 1e9 + second_gb + memory.reserve_gb
    peak_gb = mem.peak_gb if compiled_peak_gb is None else compiled_peak_gb
    usable = gpu.device_memory_gb * ctx.options.memory.usable_frac
    host_usable = host.memory_gb_per_gpu * ctx.options.memory.usable_frac
    if not reason and peak_gb > usable:
        reason = f"stage {index} needs {peak_gb:.1f} GB per GPU, {gpu.name} has {usable:.1f} GB usable"
    elif not reason and mem.host_gb and host_memory_gb(mem) > host_usable:
        # What the plan reports it needs: the offloaded states, the process and the staging copy.
        reason = (f"stage {index} needs {host_memory_gb(mem):.1f} GB of host memory per GPU with offload, "
                  f"the host has {host_usable:.1f} GB per GPU usable")
    return StageCost(plan, compute_s + comm_s + send_s, sync_s, update_s, mem, not reason, reason,
                     _comm_label(sources), compiled_peak_gb, compute_source,
                     PROFILED if profiled_acts is not None else "analytic")


def _comm_label(sources: set[str]) -> str:
    """One word for where a stage's collectives came from: any guess makes it ``model``."""
    return "model" if "model" in sources else "profile" if "profile" in sources else "table"


def _compute_s(ctx: _Context, gpu, plan: StagePlan, micro: float, passes: float,
               flops_scale: float, use_profile: bool) -> tuple[float, bool]:
    """Seconds of a stage's layers for one micro-batch on one device, and whether every
    layer's time came from the site's profile (one device's share, Crius's profiling)."""
    model = ctx.model
    fp = ctx.fingerprint if use_profile else None
    total, timed = 0.0, fp is not None
    seen: dict[int, float] = {}  # by layer class: a model's blocks repeat
    for i in range(plan.layer_start, plan.layer_end):
        timing = ctx.profile.layer_timing(ctx.cell.gpu_type, fp, i, plan.tp) if fp else None
        if timing is not None:
            total += profiled_layer_s(timing, micro, ctx.remat)
            continue
        timed = False
        k = model.layer_classes[i]
        if k not in seen:
            seen[k] = layer_time_s(model.layers[k], gpu, ctx.eff, model.dtype, micro, plan.tp, passes,
                                   flops_scale, tf32=ctx.options.memory.tf32)
        total += seen[k]
    return total, timed


def _profiled_activations(ctx: _Context, plan: StagePlan) -> tuple[float, ...] | None:
    """Bytes per sample each of a stage's layers holds through its forward and backward, as
    the site's profile compiled its share at this tp; None unless every layer has them."""
    if ctx.fingerprint is None:
        return None
    out = []
    for i in range(plan.layer_start, plan.layer_end):
        timing = ctx.profile.layer_timing(ctx.cell.gpu_type, ctx.fingerprint, i, plan.tp)
        per_sample = timing.activation_bytes_per_sample() if timing is not None else None
        if per_sample is None:
            return None
        out.append(per_sample)
    return tuple(out)


def pipeline_peak_gb(costs: tuple[StageCost, ...], memory: MemoryOptions) -> float:
    """Peak memory per GPU of a plan. The runner runs every stage as one SPMD program, so
    each device's weight, gradient, optimizer and residual buffers are as long as
    the largest stage's (``job_scripts.packing``): a pipeline's stages are padded to the
    largest of each. Other programs (``memory.program``), single stages and compiled
    figures take each stage's own peak."""
    if memory.program != "runner" or len(costs) < 2 or any(c.compiled_peak_gb is not None for c in costs):
        return max(c.peak_gb for c in costs)
    m = [c.memory for c in costs]
    # Stages split alike run one update program outside the stage switch
    # (``job_scripts.pipeline``: the flat elementwise step over the same dp axes).
    in_branch = len({(c.plan.dp, c.plan.tp, c.plan.ep) for c in costs}) > 1
    # Each buffer at least any stage's, so this is never below a stage's own peak.
    return StageMemory(max(x.weights_gb for x in m), max(x.gradients_gb for x in m),
                       max(x.optimizer_gb for x in m), max(x.activations_gb for x in m),
                       max(x.reserve_gb for x in m), max(x.update_gb for x in m),
                       any(x.accumulating for x in m), max(x.host_gb for x in m), max(x.stash_gb for x in m),
                       max(x.row_gb for x in m), max(x.branch_update_gb for x in m), in_branch,
                       max(x.micro_gradients_gb for x in m), max(x.packed_sum_gb for x in m)).peak_gb


def pipeline_time_s(costs: tuple[StageCost, ...], micro_batches: int) -> float:
    """GPipe: first micro-batch through every stage, then B − 1 at the slowest stage's pace."""
    per_micro = [c.micro_batch_s for c in costs]
    tail = max(c.sync_s + c.update_s for c in costs)
    return sum(per_micro) + (micro_batches - 1) * max(per_micro) + tail


def default_micro_batches(job: JobSpec, cell: Cell, options: EstimateOptions, model: ModelSpec) -> int:
    """The options' count, else the largest up to 4 × stages that divides a replica's batch
    and whose shards the model's MoE layers route (``batching.micro_batch_count``)."""
    return options.micro_batches or micro_batch_count(
        replica_batch(job.global_batch, cell), 4 * cell.num_stages, moe_routes(model))


def _context(job: JobSpec, cell: Cell, cluster: ClusterSpec, options: EstimateOptions,
             micro_batches: int | None = None, remat: bool | None = None) -> _Context:
    model = job_model(job)
    group = cluster.group(cell.gpu_type, cell.gpus_per_node, cell.num_gpus)
    gpu = _gpu_type(cell.gpu_type)
    B = micro_batches or default_micro_batches(job, cell, options, model)
    table, eff = load_comm_table(options.comm_table), efficiency(gpu, options.efficiency)
    profile, eff_source = None, "analytic"
    if options.profile_db:
        version = store_version(options.profile_db)
        profile = cached_profile_view(version)
        if cell.gpu_type in profile.collectives:
            table = _profiled_table(options.comm_table, version, cell.gpu_type)
        if cell.gpu_type in profile.efficiencies and options.efficiency is None:
            eff = profile.efficiencies[cell.gpu_type]  # a refit alone, without a profile: analytic
            eff_source = PROFILED if cell.gpu_type in profile.fitted else "analytic"
    host = options.host or default_host(cell.gpu_type)
    fingerprint = model_fingerprint(model) if profile is not None and profile.layers else None
    return _Context(model, job.global_batch, cell, group, table, eff, B,
                    bool(options.remat) if remat is None else remat, options, profile, eff_source, host,
                    fingerprint)


@lru_cache(maxsize=32)
def _profiled_table(comm_table: str | None, version: tuple[str, int, int], gpu_type: str) -> CommTable:
    """The collectives table with a GPU type's curves from the store, built once per version."""
    rows = cached_profile_view(version).collectives[gpu_type]
    return with_profiled(load_comm_table(comm_table), collective_csv_rows(gpu_type, rows))


def _layer_loads(model: ModelSpec, cell: Cell, options: EstimateOptions) -> list[float]:
    """Each layer's compute time for one sample on one GPU of the Cell's type."""
    gpu = _gpu_type(cell.gpu_type)
    eff = efficiency(gpu, options.efficiency)
    seen: dict[int, float] = {}
    for k in model.layer_classes:
        if k not in seen:
            seen[k] = layer_time_s(model.layers[k], gpu, eff, model.dtype, 1.0, 1, 1.0, tf32=options.memory.tf32)
    return [seen[k] for k in model.layer_classes]


def partition_stages(model: ModelSpec, cell: Cell, options: EstimateOptions = EstimateOptions()
                     ) -> tuple[tuple[int, int], ...]:
    """Layer ranges of a Cell's stages, balanced by compute time on its GPU type."""
    cuts = [layer.output_bytes for layer in model.layers]
    return balanced_partition(_layer_loads(model, cell, options), cuts, cell.num_stages)


def score_plan(job: JobSpec, cell: Cell, cluster: ClusterSpec, stages: tuple[StagePlan, ...],
               micro_batches: int, remat: bool, options: EstimateOptions = EstimateOptions()) -> PlanScore:
    """Score one fully specified plan of a Cell (used by the tuner)."""
    ctx = _context(job, cell, cluster, options, micro_batches, remat)
    costs, first = [], 0
    for i, plan in enumerate(stages):
        costs.append(stage_cost(ctx, i, first, plan))
        first += plan.num_gpus
    costs = tuple(costs)
    peak = pipeline_peak_gb(costs, options.memory)
    reason = next((c.reason for c in costs if not c.feasible), "") or _padding_problem(peak, cell, options.memory)
    return PlanScore(pipeline_time_s(costs, micro_batches), peak, not reason, reason,
                     tuple(c.micro_batch_s for c in costs), _comm_label({c.comm_source for c in costs}))


def _padding_problem(peak: float, cell: Cell, memory: MemoryOptions) -> str:
    """Why a plan whose stages each fit does not fit once every stage's buffers are padded
    to the largest stage's (``peak``, ``pipeline_peak_gb``; "" if it fits)."""
    usable = _gpu_type(cell.gpu_type).device_memory_gb * memory.usable_frac
    if peak <= usable:
        return ""
    return (f"stages padded to the largest stage's buffers, as one program, need {peak:.1f} GB per GPU, "
            f"{cell.gpu_type} has {usable:.1f} GB usable")


def _infeasible(cell: Cell, reason: str, B: int) -> CellEstimate:
    return CellEstimate(cell, (), B, math.inf, 0.0, 0.0, False, reason)


# A bound on the doublings of the micro-batch count for memory; the activations' trend
# (``_with_accumulation``) stops a Cell that cannot fit long before it.
MAX_ACCUMULATION_DOUBLINGS = 24


def estimate_cell(job: JobSpec, cell: Cell, cluster: ClusterSpec,
                  options: EstimateOptions = EstimateOptions()) -> CellEstimate:
    """The best assembled plan of one Cell (per stage dp-only or tp-only).

    The default micro-batch count is 4 × stages, or the largest count below it that
    divides the per-replica batch (the global batch over the largest power-of-two data
    parallelism it splits into). A Cell that runs out of memory with it is tried again
    with at least 2×, 4×, 8× … as many (smaller) micro-batches — gradient accumulation
    trades speed for activation memory — and the first that fits is kept; the doubling
    stops when the memory one doubling saved says that no more can make the Cell fit.

    With ``options.remat`` None, remat off and on are both estimated and the faster
    feasible kept. A Cell that still does not fit is estimated under ZeRO 1, 2, 3 and
    ZeRO-Offload (``memory_alternatives``): the first that fits is returned when the runner
    can run it or ``options.runnable_only`` is False; otherwise the Cell stays infeasible
    with its own figures and its reason says what would fit, how fast, with how much GPU
    and host memory. A Cell that fits on narrower data parallelism than its batch allows is
    tried under ZeRO 1–3 too, and the fastest kept (``_faster_split``).
    """
    if api := job.trainer == "api":  # a script on the runtime API (JobSpec.trainer): ZeRO-0, no remat
        options = replace(options, remat=False, expert_parallel=False, memory=replace(options.memory, zero_level=0,
                                                                                      offload=False))
    remats = (False, True) if options.remat is None else (bool(options.remat),)
    best = None
    for remat in remats:
        est = _with_accumulation(job, cell, cluster, replace(options, remat=remat))
        if best is None or _better(est, best, options.runnable_only):
            best = est
    if best.feasible:
        return best if api else _faster_split(job, cell, cluster, options, best)
    if api or not best.stages or "GB" not in best.reason:
        return best
    for memory in memory_alternatives(options.memory):
        alt_opts = replace(options, memory=memory, remat=True if options.remat is None else options.remat)
        alt = _with_accumulation(job, cell, cluster, alt_opts)
        if not alt.feasible:
            continue
        if alt.runnable or not options.runnable_only:
            return alt
        # Keep the runnable plan's figures; say what would fit and what it would cost.
        return replace(best, reason=f"{best.reason}; fits with {memory_label(memory)} "
                                    f"({alt.iteration_time_s:.3g} s/iteration, {alt.peak_memory_gb:.1f} GB "
                                    f"per GPU, {alt.host_memory_gb:.0f} GB host memory per GPU), which the "
                                    "runner cannot run yet")
    return best


def _faster_split(job: JobSpec, cell: Cell, cluster: ClusterSpec, options: EstimateOptions,
                  best: CellEstimate) -> CellEstimate:
    """A feasible estimate whose stages use less data parallelism than the batch allows
    (tensor parallelism where the wider split did not fit, or was slower), or more
    micro-batches than the default (to fit), against the same Cell under higher ZeRO
    levels: splitting the states may let the faster split fit (more memory must never
    make a Cell slower). The fastest runnable one is kept; the levels stop at the first
    whose stages all take the widest split at the default micro-batch count (a higher
    level then only adds communication; one that needed more micro-batches may need fewer
    with more memory freed)."""
    cap = dp_cap(job.global_batch, cell)
    default_mb = default_micro_batches(job, cell, options, job_model(job))

    def widest(e: CellEstimate) -> bool:
        return all(s.dp >= min(s.num_gpus, cap) for s in e.stages) and e.micro_batches <= default_mb
    if options.plan_space != "cell" or widest(best):
        return best
    for memory in memory_alternatives(options.memory):
        if memory.offload:
            continue
        alt = _with_accumulation(job, cell, cluster, replace(options, memory=memory, remat=best.remat))
        if alt.feasible and (alt.runnable or not options.runnable_only):
            best = alt if _better(alt, best) else best
            if widest(alt):
                break
    return best


def _better(a: CellEstimate, b: CellEstimate, runnable_first: bool = False) -> bool:
    """Feasible first, then runnable (with ``runnable_first``), then faster; if infeasible, smaller."""
    if a.feasible != b.feasible:
        return a.feasible
    if runnable_first and a.feasible and a.runnable != b.runnable:
        return a.runnable
    if a.feasible:
        return a.iteration_time_s < b.iteration_time_s
    return a.peak_memory_gb < b.peak_memory_gb


def _with_accumulation(job: JobSpec, cell: Cell, cluster: ClusterSpec,
                       options: EstimateOptions) -> CellEstimate:
    """A Cell's estimate, retried with more micro-batches while it is out of memory.

    Doubling the count halves what scales with the micro-batch (its activations); what a
    doubling saved bounds what all further ones can save (half of it, a quarter, ...).
    When the peak less twice that is still above the usable memory, the Cell cannot fit
    by accumulation (its weights and states do not), and the doubling stops."""
    est = _estimate_cell(job, cell, cluster, options, None)
    doublings = 0
    replica, routes = replica_batch(job.global_batch, cell), moe_routes(job_model(job))
    usable_gb = _gpu_type(cell.gpu_type).device_memory_gb * options.memory.usable_frac
    while (not est.feasible and options.micro_batches is None and est.stages
           and "GB per GPU" in est.reason and doublings < MAX_ACCUMULATION_DOUBLINGS
           and (more := more_micro_batches(replica, est.micro_batches, routes))):
        doublings += 1
        retry = _estimate_cell(job, cell, cluster, options, more)
        if retry.feasible or "GB per GPU" not in retry.reason:
            return retry if retry.feasible else est
        saved_gb = est.peak_memory_gb - retry.peak_memory_gb
        est = retry
        if retry.peak_memory_gb - 2 * saved_gb > usable_gb:
            break
    return est


def _estimate_cell(job: JobSpec, cell: Cell, cluster: ClusterSpec, options: EstimateOptions,
                   micro_batches: int | None) -> CellEstimate:
    ctx = _context(job, cell, cluster, options, micro_batches)
    if cell.num_stages > ctx.model.num_layers:
        return _infeasible(cell, f"{cell.num_stages} stages > {ctx.model.num_layers} layers", ctx.micro_batches)
    try:
        per_stage = stage_gpu_counts(cell.num_gpus, cell.num_stages)
    except SpecError as e:
        return _infeasible(cell, e.hint, ctx.micro_batches)
    ranges = partition_stages(ctx.model, cell, options)
    equal = _assemble(job, ctx, ranges, per_stage, ranges)
    if options.stage_gpus != "arena" or cell.num_stages < 3:
        return equal
    counts, arena_ranges = arena_stage_gpus(_layer_loads(ctx.model, cell, options), cell.num_gpus, cell.num_stages)
    if counts == per_stage:
        return equal
    unequal = _assemble(job, ctx, arena_ranges, counts, ranges)
    # The runner runs equal counts only (a mesh axis per stage): Arena's plan is estimated.
    unequal = replace(unequal, runnable=False)
    return unequal if _better(unequal, equal) else equal


def _assemble(job: JobSpec, ctx: _Context, ranges, per_stage, default_ranges) -> CellEstimate:
    """The best plan of a Cell for given layer ranges and GPUs per stage: per stage, data
    parallelism as wide as the batch allows (the rest tensor-parallel), or tensor
    parallelism only, whichever is faster and fits."""
    cell, options = ctx.cell, ctx.options
    cap = dp_cap(job.global_batch, cell)
    variants = []
    for (start, end), n in zip(ranges, per_stage):
        dp = min(n, cap) if options.plan_space == "cell" else n
        stage = [StagePlan(start, end, dp, n // dp)]
        if n > 1 and options.plan_space == "cell" and dp > 1:
            stage.append(StagePlan(start, end, 1, n))
            if options.expert_parallel and expert_parallel_fits(ctx.model.layers[start:end], n):
                stage.append(StagePlan(start, end, dp, n // dp, ep=True))
        variants.append(stage)
    compiled = _compile_variants(job, ctx, variants) if options.fidelity == "compiled" else {}
    per_stage_costs, first = [], 0
    for i, stage in enumerate(variants):
        per_stage_costs.append([stage_cost(ctx, i, first, v, compiled.get(v)) for v in stage])
        first += stage[0].num_gpus
    # The runner's ZeRO-2 needs every stage split alike.
    alike = options.memory.zero_level >= 2 and options.memory.program == "runner"
    costs = _choose_variants(per_stage_costs, ctx.micro_batches,
                             lambda a: not _padding_problem(pipeline_peak_gb(a, options.memory), cell, options.memory),
                             alike)
    # Of the stages that do not fit, the one with the largest need speaks for the Cell.
    bad = max((c for c in costs if not c.feasible), key=lambda c: c.peak_gb, default=None)
    t = pipeline_time_s(costs, ctx.micro_batches)
    source = _comm_label({c.comm_source for c in costs})
    peak = pipeline_peak_gb(costs, options.memory)
    if bad is None and (padding := _padding_problem(peak, cell, options.memory)):
        bad = replace(costs[0], reason=padding)
    plans = tuple(c.plan for c in costs)
    fidelity = "compiled" if compiled and all(c.plan in compiled for c in costs) else \
        PROFILED if all(c.compute_source == PROFILED for c in costs) else "analytic"
    memory_fidelity = ("compiled" if all(c.compiled_peak_gb is not None for c in costs) else
                       PROFILED if all(c.memory_source == PROFILED for c in costs) else "analytic")
    memory = options.memory
    if memory.zero_level and all(p.dp == 1 for p in plans):
        memory = replace(memory, zero_level=0)  # no data parallelism to shard the states over
    host_gb = max(host_memory_gb(c.memory) for c in costs)
    plan = format_plan(cell, plans, ctx.micro_batches, ctx.remat, default_ranges,
                       zero_level=memory.zero_level, offload=memory.offload)
    if bad is None and (too_long := _plan_too_long(cell, plans, ctx, memory)):
        bad = replace(costs[0], reason=too_long)
    dims = dict(remat=ctx.remat, zero_level=memory.zero_level, offload=memory.offload,
                host_memory_gb=host_gb, runnable=memory.runs_plan(ctx.model.optimizer, plans, ctx.remat),
                plan=plan)
    if bad is not None:
        return CellEstimate(cell, plans, ctx.micro_batches, math.inf, 0.0, peak, False, bad.reason,
                            fidelity, source, memory_fidelity, **dims)
    return CellEstimate(cell, plans, ctx.micro_batches, t, job.global_batch / t, peak, True, "",
                        fidelity, source, memory_fidelity, **dims)


def _plan_too_long(cell: Cell, plans: tuple[StagePlan, ...], ctx: _Context, memory: MemoryOptions) -> str:
    """Why the runner could not read the Cell's plan with its stage boundaries ("" if it can)."""
    if cell.num_stages < 32:  # at most ~20 characters a stage: far from the limit
        return ""
    n = len(format_plan(cell, plans, ctx.micro_batches, ctx.remat, None,
                        zero_level=memory.zero_level, offload=memory.offload))
    return f"its plan takes {n} characters, over the {MAX_PLAN_STRING} a job carries; fewer stages" \
        if n > MAX_PLAN_STRING else ""


def _choose_variants(per_stage_costs: list[list[StageCost]], micro_batches: int,
                     fits=lambda costs: True, alike: bool = False) -> tuple[StageCost, ...]:
    """One variant per stage: of two assemblies — each stage's fastest micro-batch, and
    each stage's least time as the pipeline's slowest stage (B micro-batches plus its
    gradient sync and update) — the faster pipeline. A stage with no feasible variant
    takes its smallest (of those short only of memory, if any). When that pipeline does
    not ``fit`` as a whole (the runner pads every stage's buffers to the largest stage's,
    so mixing a stage with large weights and one with large activations can overflow where
    either fits), the fastest that fits of the assemblies taking the same variant in every
    stage and each stage's smallest.
    ``alike``: only assemblies whose stages are split alike (the same variant in every
    stage), the fastest that fits, when there are any."""
    def assemble(key) -> tuple[StageCost, ...]:
        out = []
        for costs in per_stage_costs:
            ok = [c for c in costs if c.feasible]
            # No variant fits: the smallest of those short only of memory (more micro-batches
            # or ZeRO may fit it), else the smallest.
            out.append(min(ok, key=key) if ok else min(costs, key=lambda c: ("GB" not in c.reason, c.peak_gb)))
        return tuple(out)

    def time_s(costs) -> float:
        return pipeline_time_s(costs, micro_batches)

    # The k-th variant of every stage, where all are split alike. Stages of unequal GPU
    # counts (Arena's, estimated only) never are: they are chosen as without the rule.
    same = [a for a in zip(*per_stage_costs)
            if len({(c.plan.dp, c.plan.tp, c.plan.ep) for c in a}) == 1] if alike else []
    if same:
        ok = [a for a in same if all(c.feasible for c in a) and fits(a)]
        return min(ok, key=time_s) if ok else same[0]
    by_micro = assemble(lambda c: c.micro_batch_s)
    by_whole = assemble(lambda c: c.micro_batch_s * micro_batches + c.sync_s + c.update_s)
    best = by_whole if time_s(by_whole) < time_s(by_micro) else by_micro
    if not all(c.feasible for c in best) or fits(best):
        return best
    widest = max(len(costs) for costs in per_stage_costs)
    others = [tuple(costs[min(k, len(costs) - 1)] for costs in per_stage_costs) for k in range(widest)]
    others.append(assemble(lambda c: c.peak_gb))
    ok = [a for a in others if all(c.feasible for c in a) and fits(a)]
    return min(ok, key=time_s) if ok else best


def expert_parallel_fits(layers, num_gpus: int) -> bool:
    """Whether a stage's MoE layers can split their experts evenly over ``num_gpus``."""
    experts = {layer.experts for layer in layers if layer.experts}
    return bool(experts) and all(e % num_gpus == 0 for e in experts)


def _compile_variants(job: JobSpec, ctx: _Context, variants: list[list[StagePlan]]) -> dict:
    """Compile every stage variant of a Cell in one batch (cached on disk); {plan: costs}.

    Variants whose micro-batch does not split evenly are left to the formulas (and are
    reported infeasible by them anyway).
    """
    from pathlib import Path

    from estimator.compiled import DEFAULT_CACHE_DIR, GPU_TARGET_SPECS, StageRequest, compile_stages
    from estimator.compiled import gpu_target_available
    from estimator.jax_models import arch_from_model

    micro = ctx.global_batch // ctx.micro_batches
    if micro * ctx.micro_batches != ctx.global_batch:
        return {}
    arch = arch_from_model(ctx.model)
    opts = ctx.options
    # Without the GPU-target extra a GPU target compiles for the CPU alone: under its key.
    gpu_target = opts.gpu_specs_dir and ctx.cell.gpu_type in GPU_TARGET_SPECS and gpu_target_available()
    target = ctx.cell.gpu_type if gpu_target else "cpu"
    plans = [v for stage in variants for v in stage if micro % v.dp == 0 and not v.ep]
    requests = [StageRequest(ctx.model.name, arch, v.layer_start, v.layer_end, v.dp, v.tp, micro,
                             ctx.remat, target) for v in plans]
    cache = Path(opts.compile_cache_dir) if opts.compile_cache_dir else DEFAULT_CACHE_DIR
    specs = Path(opts.gpu_specs_dir) if opts.gpu_specs_dir else None
    try:
        return dict(zip(plans, compile_stages(requests, cache, specs)))
    except Exception as e:  # noqa: BLE001 - a variant XLA cannot partition keeps its formulas
        log.warning("compiling %s as a batch failed (%s); compiling variants one by one",
                    ctx.cell.label(), e)
    out = {}
    for plan, request in zip(plans, requests):
        try:
            out[plan] = compile_stages([request], cache, specs)[0]
        except Exception as e:  # noqa: BLE001
            log.warning("cannot compile %s %s: %s; using the formulas", ctx.cell.label(), plan, e)
    return out


def _powers_of_two(lo: int, hi: int) -> list[int]:
    out, n = [], 1
    while n <= hi:
        if n >= lo:
            out.append(n)
        n *= 2
    return out


def stage_counts(num_gpus: int, num_layers: int, max_stages: int | None = None) -> list[int]:
    """The pipeline-stage counts a Cell of ``num_gpus`` GPUs may have: 1, 2, 4, … that divide
    the count, are at most the model's layers and, when given, at most ``max_stages``."""
    top = num_gpus if max_stages is None else min(num_gpus, max_stages)
    return [s for s in _powers_of_two(1, top) if s <= num_layers and num_gpus % s == 0]


def enumerate_cells(job: JobSpec, cluster: ClusterSpec, options: EstimateOptions = EstimateOptions(),
                    gpu_types: tuple[str, ...] | None = None, gpus_per_node: int | None = None
                    ) -> tuple[Cell, ...]:
    """The Cells of a job (Crius): counts {N/2, N, 2N} when N was asked for, else every power
    of two up to ``max_gpus``; × every GPU type; × stage counts 1, 2, 4, … ≤ count (and
    ≤ ``job.max_stages`` when the job's script cannot run more)."""
    model = job_model(job)
    types = gpu_types or cluster.gpu_types
    cells = []
    for t in types:
        cluster.group(t)  # a clear error for a type the cluster lacks
        capacity = cluster.total_gpus(t)
        if job.num_gpus:
            counts = sorted({max(1, job.num_gpus // 2), job.num_gpus, min(2 * job.num_gpus, MAX_GPUS)})
        else:
            counts = _powers_of_two(1, min(options.max_gpus, capacity))
        for n in counts:
            if n > capacity:
                continue
            spaces = [1] if options.plan_space == "dp-only" else stage_counts(n, model.num_layers, job.max_stages)
            # Each node size the type comes in lays the count out its own way, where the
            # type has enough nodes that large.
            for gpn in dict.fromkeys(gpus_per_node_of(n, gpus_per_node or size) for size in cluster.node_sizes(t)):
                if cluster.holds_layout(t, n, gpn):
                    cells.extend(Cell(t, n, gpn, s) for s in spaces)
    return tuple(cells)


def estimate_job(job: JobSpec, cluster: ClusterSpec, options: EstimateOptions = EstimateOptions(),
                 gpu_types: tuple[str, ...] | None = None, gpus_per_node: int | None = None
                 ) -> JobEstimate:
    """Every Cell of a job with its estimate; ``best`` is the fastest feasible one.

    Without a requested count, counts below the smallest that fits in memory are dropped
    ("serverless": the user need not guess a count).
    """
    for t in gpu_types or ():
        cluster.group(t)  # a clear error for a type the cluster lacks
    cells = enumerate_cells(job, cluster, options, gpu_types, gpus_per_node)
    estimates = [estimate_cell(job, c, cluster, options) for c in cells]
    if not job.num_gpus:
        smallest: dict[str, int] = {}
        for e in estimates:
            if e.feasible:
                t = e.cell.gpu_type
                smallest[t] = min(smallest.get(t, e.cell.num_gpus), e.cell.num_gpus)
        estimates = [e for e in estimates
                     if e.cell.num_gpus >= smallest.get(e.cell.gpu_type, math.inf)
                     or e.cell.num_gpus == max(c.num_gpus for c in cells if c.gpu_type == e.cell.gpu_type)]
    feasible = [e for e in estimates if e.feasible and (e.runnable or not options.runnable_only)]
    best = min(feasible, key=lambda e: (e.iteration_time_s, e.cell.num_gpus)) if feasible else None
    return JobEstimate(job, tuple(estimates), best)

