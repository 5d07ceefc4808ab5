"""Stage partitioning: contiguous layer ranges that balance per-GPU load across stages.

As in Crius and Arena, GPUs are mapped to layers in proportion to their load: every stage
of a Cell gets the same power-of-two GPU count, so the layer ranges are chosen to equalise
load (a min-max linear partition by dynamic programming); among equally balanced
partitions the one whose stage boundaries carry the fewest activation bytes wins (the
cheapest inter-layer cuts).
"""

from collections.abc import Sequence
from functools import lru_cache

from estimator.errors import SpecError


def stage_gpu_counts(num_gpus: int, num_stages: int) -> tuple[int, ...]:
    """GPUs per stage: equal powers of two that add up to the Cell's count."""
    if num_stages < 1 or num_gpus % num_stages:
        raise SpecError("num_stages", num_stages, f"must divide the GPU count {num_gpus}")
    per = num_gpus // num_stages
    if per & (per - 1):
        raise SpecError("num_gpus", num_gpus, f"{num_stages} stages need a power of two GPUs each")
    return (per,) * num_stages


def balanced_partition(loads: Sequence[float], cut_bytes: Sequence[float],
                       num_stages: int) -> tuple[tuple[int, int], ...]:
    """Split layers into ``num_stages`` contiguous ranges [start, end).

    Args:
        loads: per-layer load (seconds or FLOPs; any additive unit).
        cut_bytes: bytes crossing a cut placed after each layer.
        num_stages: how many ranges; at most ``len(loads)``.

    Returns:
        The ranges minimising the largest stage load, then the bytes over the cuts.
    """
    return _balanced_partition(tuple(loads), tuple(cut_bytes), num_stages)


@lru_cache(maxsize=4096)
def _balanced_partition(loads: tuple[float, ...], cut_bytes: tuple[float, ...],
                        num_stages: int) -> tuple[tuple[int, int], ...]:
    n = len(loads)
    if not 1 <= num_stages <= n:
        raise SpecError("num_stages", num_stages, f"give 1 to {n} stages for {n} layers")
    prefix = [0.0]
    for x in loads:
        prefix.append(prefix[-1] + x)
    inf = float("inf")
    # Phase 1: the smallest achievable largest-stage load (min-max linear partition).
    # best[k][i]: smallest max load splitting the first i layers into k stages.
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0.0
    for k in range(1, num_stages + 1):
        for i in range(k, n - (num_stages - k) + 1):
            best[k][i] = min(max(best[k - 1][j], prefix[i] - prefix[j]) for j in range(k - 1, i))
    limit = best[num_stages][n] * (1 + 1e-9) + 1e-12
    # Phase 2: among partitions whose every stage stays within that load, the cheapest cuts.
    cost = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    back = [[0] * (n + 1) for _ in range(num_stages + 1)]
    cost[0][0] = 0.0
    for k in range(1, num_stages + 1):
        for i in range(k, n - (num_stages - k) + 1):
            for j in range(k - 1, i):
                if cost[k - 1][j] == inf or prefix[i] - prefix[j] > limit:
                    continue
                c = cost[k - 1][j] + (cut_bytes[j - 1] if j > 0 else 0.0)
                if c < cost[k][i]:
                    cost[k][i], back[k][i] = c, j
    ranges = []
    i = n
    for k in range(num_stages, 0, -1):
        j = back[k][i]
        ranges.append((j, i))
        i = j
    return tuple(reversed(ranges))
