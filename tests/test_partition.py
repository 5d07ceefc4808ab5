import itertools
import random

import pytest

from estimator.errors import SpecError
from estimator.partition import balanced_partition, stage_gpu_counts


def brute_force(loads, cuts, k):
    n = len(loads)
    best = None
    for bounds in itertools.combinations(range(1, n), k - 1):
        edges = (0, *bounds, n)
        ranges = tuple(zip(edges[:-1], edges[1:]))
        key = (max(sum(loads[a:b]) for a, b in ranges), sum(cuts[b - 1] for _, b in ranges[:-1]))
        if best is None or key < best[0]:
            best = (key, ranges)
    return best


@pytest.mark.parametrize("loads, k", [
    ([1, 1, 1, 1], 2), ([5, 1, 1, 1, 1, 1], 2), ([1, 2, 3, 4, 5, 6, 7], 3),
    ([3, 1, 4, 1, 5, 9, 2, 6], 4), ([2] * 10, 5), ([1, 100, 1], 3),
])
def test_balanced_partition_matches_brute_force(loads, k):
    cuts = [float((i * 7) % 5 + 1) for i in range(len(loads))]
    ranges = balanced_partition(loads, cuts, k)
    (best_load, best_cut), _ = brute_force(loads, cuts, k)
    assert ranges[0][0] == 0 and ranges[-1][1] == len(loads)
    assert all(a < b for a, b in ranges) and all(ranges[i][1] == ranges[i + 1][0] for i in range(k - 1))
    assert max(sum(loads[a:b]) for a, b in ranges) == pytest.approx(best_load)
    assert sum(cuts[b - 1] for _, b in ranges[:-1]) == pytest.approx(best_cut)


def test_balanced_partition_matches_brute_force_on_random_layers():
    # Zero-load layers and repeated loads and cut sizes make ties in both phases.
    rng = random.Random(7)
    for _ in range(300):
        n = rng.randint(1, 9)
        loads = [rng.choice([0.0, 1.0, 2.0, 0.5, rng.random()]) for _ in range(n)]
        cuts = [rng.choice([0.0, 1.0, 3.0, rng.random()]) for _ in range(n)]
        k = rng.randint(1, n)
        ranges = balanced_partition(loads, cuts, k)
        (best_load, best_cut), _ = brute_force(loads, cuts, k)
        assert [a for a, _ in ranges[1:]] == [b for _, b in ranges[:-1]] and len(ranges) == k
        assert ranges[0][0] == 0 and ranges[-1][1] == n and all(a < b for a, b in ranges)
        assert max(sum(loads[a:b]) for a, b in ranges) == pytest.approx(best_load, abs=1e-12)
        assert sum(cuts[b - 1] for _, b in ranges[:-1]) == pytest.approx(best_cut, abs=1e-12)


def test_ties_prefer_cheaper_cuts():
    # Cutting after layer 1 or after layer 2 balances equally (2 vs 2); the cut after layer
    # 2 carries fewer bytes.
    assert balanced_partition([1, 1, 0, 2], [9, 9, 1, 9], 2) == ((0, 3), (3, 4))


def test_stage_gpu_counts():
    assert stage_gpu_counts(8, 2) == (4, 4)
    with pytest.raises(SpecError):
        stage_gpu_counts(12, 2)  # 6 GPUs per stage is not a power of two
    with pytest.raises(SpecError):
        balanced_partition([1, 1], [1, 1], 3)
    with pytest.raises(SpecError):
        balanced_partition([1, -1, 1], [1, 1, 1], 2)
    with pytest.raises(SpecError):
        balanced_partition([1, float("nan"), 1], [1, 1, 1], 2)


def test_arena_gives_a_heavy_last_layer_more_gpus_by_hand():
    """Ten unit layers and a layer of 6 on 8 GPUs in 4 stages. Equal counts (2 each) leave
    the heavy layer alone on 2 GPUs: 3 per GPU against a perfect 16 / 8 = 2, bias 1.5.
    Arena's counts (1, 1, 2, 4): the heavy layer on 4 GPUs (1.5), ten unit layers over
    1 + 1 + 2 GPUs at 2 + 2 + 4 / 2: bias 1.0."""
    from estimator.partition import arena_stage_gpus, computation_bias, weighted_partition
    loads = [1.0] * 10 + [6.0]
    equal = weighted_partition(loads, (2, 2, 2, 2))
    assert computation_bias(loads, equal, (2, 2, 2, 2)) == pytest.approx(1.5)
    counts, ranges = arena_stage_gpus(loads, 8, 4)
    assert counts == (1, 1, 2, 4) and sum(counts) == 8
    assert ranges == ((0, 2), (2, 4), (4, 8), (8, 11))
    assert computation_bias(loads, ranges, counts) == pytest.approx(1.0)


def test_arena_keeps_equal_counts_when_they_are_as_good():
    from estimator.partition import arena_stage_gpus
    assert arena_stage_gpus([1.0] * 16, 16, 4) == ((4, 4, 4, 4), ((0, 4), (4, 8), (8, 12), (12, 16)))
