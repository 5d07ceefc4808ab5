"""How a global batch splits: micro-batches (gradient accumulation, pipeline
micro-batches) and the data parallelism a Cell's stages can use."""

import math
from collections.abc import Callable

from estimator.cells import Cell


def divisors(n: int) -> list[int]:
    """The divisors of ``n`` ≥ 1, ascending (found up to its square root)."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return small + [n // d for d in reversed(small) if d * d != n]


def micro_batch_count(global_batch: int, target: int, fits: Callable[[int], bool] | None = None) -> int:
    """The largest micro-batch count of at most ``target`` that divides the global batch:
    the target itself for a global batch of 64 and 4 × stages, 3 for 6 samples and one
    stage, 1 for one sample. With ``fits`` (samples per micro-batch → whether they can
    run, e.g. as whole MoE expert groups): the largest such count whose micro-batch fits,
    else the smallest larger one, else the largest."""
    counts = divisors(global_batch)
    below = [d for d in counts if d <= target]
    if fits is None:
        return below[-1]
    return next((d for d in reversed(below) if fits(global_batch // d)), None) or \
        next((d for d in counts if d > target and fits(global_batch // d)), below[-1])


def more_micro_batches(global_batch: int, micro_batches: int,
                       fits: Callable[[int], bool] | None = None) -> int | None:
    """The smallest count of at least twice as many micro-batches that divides the global
    batch, and with ``fits`` whose micro-batch fits (as ``micro_batch_count``; None: there
    is none)."""
    return next((d for d in divisors(global_batch)
                 if d >= 2 * micro_batches and (fits is None or fits(global_batch // d))), None)


def dp_cap(global_batch: int, cell: Cell) -> int:
    """The largest data parallelism a stage of the Cell can use: its GPUs, or the largest
    power of two that divides the global batch (data parallelism is a power of two)."""
    per_stage = max(1, cell.num_gpus // max(1, cell.num_stages))
    return min(per_stage, global_batch & -global_batch)


def replica_batch(global_batch: int, cell: Cell) -> int:
    """Samples per iteration of one replica at the Cell's largest data parallelism:
    micro-batch counts are its divisors, so every dp up to it splits every micro-batch."""
    return global_batch // dp_cap(global_batch, cell)


def moe_routes(model):  # model: an estimator.models.ModelSpec
    """Samples per micro-batch shard → whether the model's MoE layers route them
    (``moe_shard_problem``): what a micro-batch count must allow."""
    return lambda samples: not moe_shard_problem(model, samples)


def moe_shard_problem(model, samples: int) -> str:
    """Why a device's share of a micro-batch cannot be routed by the MoE layers ("" if it
    can). As the runner: an expert group is min(S, tokens), so fewer tokens than S run as
    one smaller group and more must be whole groups of S."""
    group, tokens = model.min_tokens_per_shard, samples * model.sequence
    if group and tokens > group and tokens % group:
        return f"{tokens} tokens per micro-batch shard: MoE routing needs a multiple of {group}"
    return ""
