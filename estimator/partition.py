"""Stage partitioning: contiguous layer ranges that balance per-GPU load across stages.

As in Crius and Arena, GPUs are mapped to layers in proportion to their load: every stage
of a Cell gets the same power-of-two GPU count, so the layer ranges are chosen to equalise
load (a min-max linear partition by dynamic programming); among equally balanced
partitions the one whose stage boundaries carry the fewest activation bytes wins (the
cheapest inter-layer cuts).
"""

from collections.abc import Sequence

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
    n = len(loads)
    if not 1 <= num_stages <= n:
        raise SpecError("num_stages", num_stages, f"give 1 to {n} stages for {n} layers")
    prefix = [0.0]
    for x in loads:
        prefix.append(prefix[-1] + x)
    inf = (float("inf"), float("inf"))
    # best[k][i]: (max load, cut bytes) of splitting the first i layers into k stages.
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    back = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = (0.0, 0.0)
    tolerance = 1e-9 * prefix[-1]
    for k in range(1, num_stages + 1):
        for i in range(k, n - (num_stages - k) + 1):
            for j in range(k - 1, i):
                prev = best[k - 1][j]
                if prev[0] == float("inf"):
                    continue
                load = max(prev[0], prefix[i] - prefix[j])
                cut = prev[1] + (cut_bytes[j - 1] if j > 0 else 0.0)
                cur = best[k][i]
                if load < cur[0] - tolerance or (load <= cur[0] + tolerance and cut < cur[1]):
                    best[k][i] = (load, cut)
                    back[k][i] = j
    ranges = []
    i = n
    for k in range(num_stages, 0, -1):
        j = back[k][i]
        ranges.append((j, i))
        i = j
    return tuple(reversed(ranges))
