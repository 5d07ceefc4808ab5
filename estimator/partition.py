"""Stage partitioning: contiguous layer ranges that balance per-GPU load across stages.

As in Crius and Arena, GPUs are mapped to layers in proportion to their load: every stage
of a Cell gets the same power-of-two GPU count, so the layer ranges are chosen to equalise
load (a min-max linear partition by dynamic programming); among equally balanced
partitions the one whose stage boundaries carry the fewest activation bytes wins (the
cheapest inter-layer cuts).
"""

from collections import deque
from collections.abc import Sequence
from functools import lru_cache

from estimator.errors import SpecError


def stage_gpu_counts(num_gpus: int, num_stages: int) -> tuple[int, ...]:
    """GPUs per stage: equal powers of two that add up to the Cell's count."""
    if num_stages < 1 or num_gpus % num_stages:
        raise SpecError("num_stages", num_stages, f"must divide the GPU count {num_gpus}")
    per = num_gpus // num_stages
    if per & (per - 1):
        stages = f"{num_stages} stage{'s' if num_stages > 1 else ''}"
        raise SpecError("num_gpus", num_gpus,
                        f"each stage needs a power-of-two GPU count; {num_gpus} over {stages} gives {per}")
    return (per,) * num_stages


def balanced_partition(loads: Sequence[float], cut_bytes: Sequence[float],
                       num_stages: int) -> tuple[tuple[int, int], ...]:
    """Split layers into ``num_stages`` contiguous ranges [start, end).

    Args:
        loads: per-layer load (seconds or FLOPs; any additive unit), each ≥ 0.
        cut_bytes: bytes crossing a cut placed after each layer.
        num_stages: how many ranges; at most ``len(loads)``.

    Returns:
        The ranges minimising the largest stage load, then the bytes over the cuts.
    """
    bad = [x for x in loads if not x >= 0]  # also nan: the split search relies on order
    if bad:
        raise SpecError("loads", bad[0], "layer loads must be numbers ≥ 0")
    return _balanced_partition(tuple(loads), tuple(cut_bytes), num_stages)


def _prefix_sums(loads: tuple[float, ...], num_stages: int) -> list[float]:
    """Running totals of the layers' loads (0 first), after checking the stage count."""
    n = len(loads)
    if not 1 <= num_stages <= n:
        raise SpecError("num_stages", num_stages, f"give 1 to {n} stages for {n} layers")
    prefix = [0.0]
    for x in loads:
        prefix.append(prefix[-1] + x)
    return prefix


def _min_max_split(f: list[float], prefix: list[float], lo: int, i: int) -> float:
    """min over j in [lo, i) of max(f[j], prefix[i] - prefix[j]). f is non-decreasing in j
    (splitting a longer prefix never balances better) and the last stage's load is
    non-increasing in j, so the minimum sits where they cross: a binary search instead of
    a scan over every j."""
    a, b = lo, i  # first j in [lo, i) with f[j] >= the last stage's load; i when none
    while a < b:
        m = (a + b) // 2
        if f[m] >= prefix[i] - prefix[m]:
            b = m
        else:
            a = m + 1
    value = f[a] if a < i else float("inf")
    return min(value, prefix[i] - prefix[a - 1]) if a > lo else value


@lru_cache(maxsize=4096)
def _balanced_partition(loads: tuple[float, ...], cut_bytes: tuple[float, ...],
                        num_stages: int) -> tuple[tuple[int, int], ...]:
    n, prefix = len(loads), _prefix_sums(loads, num_stages)
    inf = float("inf")
    # Phase 1: the smallest achievable largest-stage load (min-max linear partition).
    # best[k][i]: smallest max load splitting the first i layers into k stages.
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0.0
    for k in range(1, num_stages + 1):
        for i in range(k, n - (num_stages - k) + 1):
            best[k][i] = _min_max_split(best[k - 1], prefix, k - 1, i)
    limit = best[num_stages][n] * (1 + 1e-9) + 1e-12
    # Phase 2: among partitions whose every stage stays within that load, the cheapest cuts.
    # The stage ending at layer i may start at any j from the first whose range stays
    # within the limit up to i - 1: a window that only moves right as i grows, so a
    # sliding-window minimum (a deque of candidates in index order with non-decreasing
    # costs; of equal costs the earliest stays in front, as a scan would pick it).
    cost = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    back = [[0] * (n + 1) for _ in range(num_stages + 1)]
    cost[0][0] = 0.0
    for k in range(1, num_stages + 1):
        window: deque[tuple[float, int]] = deque()
        start = k - 1  # the next j to enter the window
        first = k - 1  # the first j whose range to i stays within the limit
        for i in range(k, n - (num_stages - k) + 1):
            while start < i:
                c = cost[k - 1][start] + (cut_bytes[start - 1] if start > 0 else 0.0)
                while window and window[-1][0] > c:
                    window.pop()
                window.append((c, start))
                start += 1
            while first < i and prefix[i] - prefix[first] > limit:
                first += 1
            while window and window[0][1] < first:
                window.popleft()
            if window and window[0][0] < inf:
                cost[k][i], back[k][i] = window[0]
    ranges = []
    i = n
    for k in range(num_stages, 0, -1):
        j = back[k][i]
        ranges.append((j, i))
        i = j
    return tuple(reversed(ranges))


def weighted_partition(loads: Sequence[float], gpus: Sequence[int]) -> tuple[tuple[int, int], ...]:
    """Contiguous layer ranges for stages of ``gpus[k]`` GPUs each: the ranges minimising
    the largest per-GPU stage load (a stage's load over its GPU count)."""
    return _weighted_partition(tuple(loads), tuple(gpus))


@lru_cache(maxsize=4096)
def _weighted_partition(loads: tuple[float, ...], gpus: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
    n, s, prefix = len(loads), len(gpus), _prefix_sums(loads, len(gpus))
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(s + 1)]
    back = [[0] * (n + 1) for _ in range(s + 1)]
    best[0][0] = 0.0
    for k in range(1, s + 1):
        g = gpus[k - 1]
        for i in range(k, n - (s - k) + 1):
            for j in range(k - 1, i):
                v = max(best[k - 1][j], (prefix[i] - prefix[j]) / g)
                if v < best[k][i]:
                    best[k][i], back[k][i] = v, j
    ranges, i = [], n
    for k in range(s, 0, -1):
        j = back[k][i]
        ranges.append((j, i))
        i = j
    return tuple(reversed(ranges))


def computation_bias(loads: Sequence[float], ranges: Sequence[tuple[int, int]], gpus: Sequence[int]) -> float:
    """Arena's computation bias of a pipeline: its largest per-GPU stage load over the
    per-GPU load of a perfect split (1.0: every GPU equally loaded)."""
    total = sum(loads)
    if total <= 0:
        return 1.0
    worst = max(sum(loads[a:b]) / g for (a, b), g in zip(ranges, gpus))
    return worst / (total / sum(gpus))


def arena_stage_gpus(loads: Sequence[float], num_gpus: int, num_stages: int
                     ) -> tuple[tuple[int, ...], tuple[tuple[int, int], ...]]:
    """Arena's power-of-two GPU assignment: per-stage GPU counts (powers of two adding up
    to ``num_gpus``) and contiguous layer ranges that minimise the computation bias (the
    largest per-GPU stage load), found together by dynamic programming over (stages,
    layers, GPUs used). A stage gets between a quarter and four times the equal share.
    Equal counts win ties.
    """
    return _arena(tuple(loads), num_gpus, num_stages)


@lru_cache(maxsize=1024)
def _arena(loads: tuple[float, ...], num_gpus: int, num_stages: int
           ) -> tuple[tuple[int, ...], tuple[tuple[int, int], ...]]:
    if num_gpus < num_stages:
        raise SpecError("num_stages", num_stages, f"needs a GPU per stage, the Cell has {num_gpus}")
    n, prefix = len(loads), _prefix_sums(loads, num_stages)
    share = max(1, num_gpus // num_stages)
    options = [g for g in (share // 4, share // 2, share, share * 2, share * 4)
               if g >= 1 and not g & (g - 1) and g <= num_gpus]
    options = sorted(set(options), key=lambda g: (g != share, g))  # equal share first: it wins ties
    inf = float("inf")
    equal = (share,) * num_stages
    same = weighted_partition(loads, equal) if share * num_stages == num_gpus else None
    # No pipeline beats equal counts with a stage more loaded per GPU than equal counts'
    # most loaded: such stages are not extended (a stage's load grows with its layers).
    bound = inf if same is None else max(sum(loads[a:b]) / g for (a, b), g in zip(same, equal)) * (1 + 1e-9)
    # best[(k, i, used)]: smallest largest per-GPU load of the first i layers on k stages
    # that use ``used`` GPUs; back: (j, g) of the k-th stage.
    best: dict[tuple[int, int, int], float] = {(0, 0, 0): 0.0}
    back: dict[tuple[int, int, int], tuple[int, int]] = {}
    frontier = {(0, 0)}
    for k in range(1, num_stages + 1):
        nxt = set()
        stages_left = num_stages - k
        for j, used in sorted(frontier):
            base = best[(k - 1, j, used)]
            for g in options:
                u = used + g
                if u + stages_left > num_gpus:
                    continue
                for i in range(j + 1, n - stages_left + 1):
                    v = max(base, (prefix[i] - prefix[j]) / g)
                    if v > bound:
                        break
                    key = (k, i, u)
                    if v < best.get(key, inf) * (1 - 1e-12):
                        best[key], back[key] = v, (j, g)
                        nxt.add((i, u))
        frontier = nxt
    if (num_stages, n, num_gpus) not in best:
        if same is not None:  # every other assignment was cut by equal counts' bound
            return equal, same
        raise SpecError("num_gpus", num_gpus, f"cannot give {num_stages} stages power-of-two GPU counts")
    counts, ranges, i, used = [], [], n, num_gpus
    for k in range(num_stages, 0, -1):
        j, g = back[(k, i, used)]
        counts.append(g)
        ranges.append((j, i))
        i, used = j, used - g
    found = (tuple(reversed(counts)), tuple(reversed(ranges)))
    if same is not None and found[0] != equal:
        if computation_bias(loads, same, equal) <= computation_bias(loads, found[1], found[0]) * (1 + 1e-9):
            return equal, same
    return found
