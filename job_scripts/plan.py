"""A parallel plan as the runtime runs it, and whether it can run.

The plan string kept in a job's AdminComment (``estimator.plan_string``) names a Cell,
each stage's dp × tp, the micro-batch count, rematerialization and (optionally) the stage
boundaries. :func:`plan_from_string` turns it into a :class:`ParallelPlan` with layer
ranges, and :func:`check_plan` says, in one line naming the plan, why a plan cannot run
on a model, a global batch and a device count: everything else runs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from estimator import jax_models as jm
from estimator.cells import Cell, StagePlan
from estimator.errors import SpecError
from estimator.jax_optim import optimizer_for
from job_scripts.flat_optimizer import ZERO_LEVELS, zero_problem


@dataclass(frozen=True)
class ParallelPlan:
    """How one job runs: its stages (layers, dp, tp), micro-batch count, remat and ZeRO
    level (0: optimizer states replicated over dp; 1: split over dp, 2: gradients too,
    ``job_scripts.flat_optimizer``; 3: weights too, ``job_scripts.zero3``)."""

    stages: tuple[StagePlan, ...]
    micro_batches: int
    remat: bool = True
    zero_level: int = 0

    @property
    def num_gpus(self) -> int:
        return sum(s.num_gpus for s in self.stages)

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    def label(self) -> str:
        body = "|".join(s.label() for s in self.stages)
        zero = f" zero={self.zero_level}" if self.zero_level else ""
        return f"[{body}] mb={self.micro_batches} remat={int(self.remat)}{zero}"


def even_layer_split(num_layers: int, num_stages: int) -> tuple[tuple[int, int], ...]:
    """Contiguous layer ranges of near-equal length (the first stages get the extra)."""
    if not 1 <= num_stages <= num_layers:
        raise SpecError("num_stages", num_stages, f"give 1..{num_layers} stages for {num_layers} layers")
    base, extra = divmod(num_layers, num_stages)
    bounds, start = [], 0
    for s in range(num_stages):
        end = start + base + (1 if s < extra else 0)
        bounds.append((start, end))
        start = end
    return tuple(bounds)


def _pow2(v: int) -> bool:
    return v >= 1 and v & (v - 1) == 0


def check_plan(plan: ParallelPlan, arch: jm.Arch, global_batch: int, num_devices: int) -> None:
    """Raise SpecError (naming the plan and the reason) unless the plan can run."""
    label = plan.label()

    def refuse(field: str, value, why: str):
        raise SpecError(field, value, f"plan {label}: {why}")

    if plan.num_gpus != num_devices:
        refuse("plan", plan.num_gpus, f"uses {plan.num_gpus} devices but {num_devices} are present")
    per_stage = plan.stages[0].num_gpus
    if any(s.num_gpus != per_stage for s in plan.stages) or not _pow2(per_stage):
        refuse("stages", [s.num_gpus for s in plan.stages],
               "every stage needs the same power-of-two device count (a mesh axis per stage)")
    expected = 0
    for i, s in enumerate(plan.stages):
        if s.layer_start != expected or s.layer_end <= s.layer_start:
            refuse(f"stages[{i}].layers", (s.layer_start, s.layer_end),
                   f"stages must cover layers 0..{arch.num_layers} contiguously")
        expected = s.layer_end
    if expected != arch.num_layers:
        refuse("layers", expected, f"the stages end at layer {expected}; the model has {arch.num_layers} (its "
                                   "embedding, its blocks and its head: layers=0,…," f"{arch.num_layers})")
    if plan.zero_level not in ZERO_LEVELS:
        refuse("zero", plan.zero_level, f"this runner runs ZeRO levels {', '.join(map(str, ZERO_LEVELS))}")
    if plan.zero_level and (problem := zero_problem(optimizer_for(arch.optimizer))):
        refuse("zero", plan.zero_level, problem)
    if plan.zero_level and any(s.ep for s in plan.stages):
        refuse("zero", plan.zero_level, "expert-parallel stages keep their optimizer states whole (use zero=0)")
    if plan.zero_level >= 2 and len({(s.dp, s.tp) for s in plan.stages}) > 1:
        refuse("zero", plan.zero_level, f"ZeRO-{plan.zero_level} needs every stage split alike "
                                        "(the same dp and tp; or use zero=1)")
    if plan.zero_level >= 3 and not plan.remat:
        refuse("zero", plan.zero_level, "ZeRO-3 gathers each layer's weights inside its rematerialization "
                                        "(use remat=1, or zero=2)")
    if plan.micro_batches < 1 or global_batch % plan.micro_batches:
        refuse("micro_batches", plan.micro_batches, f"must divide the global batch {global_batch}")
    micro = global_batch // plan.micro_batches
    for i, s in enumerate(plan.stages):
        if micro % s.dp:
            refuse(f"stages[{i}].dp", s.dp, f"must divide the micro-batch of {micro} samples")
        tokens = micro // s.dp * max(1, arch.seq_len)
        for layer in range(s.layer_start, s.layer_end):
            shapes = jm.layer_param_shapes(arch, layer)
            for name, spec in jm.layer_param_specs(arch, layer).items():
                for dim, axis in enumerate(spec):
                    if axis == "tp" and shapes[name].shape[dim] % s.tp:
                        refuse(f"stages[{i}].tp", s.tp, f"must divide dimension {dim} "
                                                        f"({shapes[name].shape[dim]}) of layer {layer}'s {name}")
            if jm.layer_kind(arch, layer) == "moe_block" and tokens % jm.moe_group_size(arch, tokens):
                refuse(f"stages[{i}].dp", s.dp, f"leaves {tokens} tokens a device, not whole groups of "
                                                f"{arch.expert_group} for the experts")
        if s.ep:
            moe = any(jm.layer_kind(arch, layer) == "moe_block" for layer in range(s.layer_start, s.layer_end))
            if not moe:
                refuse(f"stages[{i}].ep", True, "the stage has no MoE layer whose experts could be split")
            elif arch.experts % (s.dp * s.tp):
                refuse(f"stages[{i}].ep", True, f"the stage's {s.dp * s.tp} GPUs (dp {s.dp} x tp {s.tp}) "
                                                f"must divide the {arch.experts} experts")


def plan_from_string(text: str, model_spec, arch: jm.Arch, global_batch: int, num_devices: int,
                     gpus_per_node: int = 0) -> tuple[ParallelPlan, str, str]:
    """(ParallelPlan, canonical plan string, Cell label) of a plan string, checked.

    Stage boundaries come from the string's ``layers=`` or else the Cell's default
    partition (``estimator.estimate.partition_stages``), as the daemon wrote them.
    """
    from estimator.estimate import partition_stages
    from estimator.plan_string import parse_plan

    ps = parse_plan(text)
    refuse_unsupported(ps, text)
    if ps.num_gpus != num_devices:
        raise SpecError("plan", text, f"is for {ps.num_gpus} GPUs but this job has {num_devices}")
    if ps.num_stages > arch.num_layers:
        raise SpecError("plan", text, f"has {ps.num_stages} stages; the model has {arch.num_layers} layers")
    cell = Cell(ps.gpu_type, ps.num_gpus, max(1, gpus_per_node or num_devices), ps.num_stages)
    try:
        default = partition_stages(model_spec, cell)
    except SpecError:  # not a catalog GPU type (e.g. a CPU test cell): split evenly
        default = even_layer_split(model_spec.num_layers, ps.num_stages)
    plan = ParallelPlan(ps.stage_plans(default), ps.micro_batches, ps.remat, ps.zero_level)
    check_plan(plan, arch, global_batch, num_devices)
    return plan, ps.format(), ps.cell_label


def refuse_unsupported(ps, text: str) -> None:
    """Raise SpecError (one line) for a plan's memory choices this runtime cannot run yet,
    rather than run something else: it keeps states on the GPU, replicated or split over
    data parallelism with the gradients and the weights whole or split too (ZeRO-0 to 3)."""
    if ps.zero_level not in ZERO_LEVELS:
        raise SpecError("zero", ps.zero_level, f"plan {text!r} asks for ZeRO-{ps.zero_level}, which this "
                                               "runner cannot run (it runs zero=0 to 3)")
    if ps.offload:
        raise SpecError("offload", 1, f"plan {text!r} asks for ZeRO-Offload, which this runner cannot "
                                      "run yet; choose a Cell without offload=1")


def log2(n: int) -> int:
    """Exponent of a power of two."""
    if not _pow2(n):
        raise SpecError("devices", n, "expected a power of two")
    return int(math.log2(n))
