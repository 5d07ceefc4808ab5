"""Node placement: whole nodes first, best fit, power-of-two per node, never over-commit."""

import random

import pytest

from estimator.cells import Cell
from policy.interface import Assignment, JobView, NodeView, Snapshot
from policy.placement import FreeGpus, layout_of, place_cell
from estimator.jobs import JobSpec


def _cluster():
    nodes = [(f"a100-{i}", "a100", 4) for i in range(1, 5)]
    nodes += [(f"a40-{i}", "a40", 2) for i in range(1, 5)]
    nodes += [(f"v100-{i}", "v100", 16) for i in range(1, 3)]
    return nodes


def test_whole_free_nodes_are_used_for_whole_node_layouts():
    free = FreeGpus(_cluster())
    free.take((("a100-1", 1),))
    placement = free.place(Cell("a100", 8, 4, 1))
    assert placement is not None
    assert all(g == 4 for _, g in placement)
    assert "a100-1" not in dict(placement)  # the partly used node cannot host 4


def test_best_fit_prefers_the_tightest_partial_node():
    free = FreeGpus(_cluster())
    free.take((("a100-1", 2), ("a100-2", 1)))  # a100-1 has 2 free, a100-2 has 3 free
    assert free.place(Cell("a100", 2, 4, 1)) == (("a100-1", 2),)
    assert free.place(Cell("a100", 1, 4, 1)) == (("a100-1", 1),)


def test_one_gpu_type_per_job_and_unknown_type_does_not_fit():
    free = FreeGpus(_cluster())
    placement = free.place(Cell("a40", 4, 2, 1))
    assert placement is not None and all(name.startswith("a40-") for name, _ in placement)
    assert free.place(Cell("h100", 1, 8, 1)) is None


def test_strict_layout_versus_any_power_of_two_split():
    free = FreeGpus(_cluster())
    for i in range(1, 5):
        free.take(((f"a100-{i}", 2),))  # every a100 node half used
    assert free.place(Cell("a100", 4, 4, 1)) is None
    loose = free.place(Cell("a100", 4, 4, 1), strict=False)
    assert loose is not None and sum(g for _, g in loose) == 4
    assert layout_of(loose) == (2, 2)


def test_take_refuses_an_over_commit():
    free = FreeGpus(_cluster())
    free.take((("a40-1", 2),))
    with pytest.raises(ValueError, match="a40-1"):
        free.take((("a40-1", 1),))


@pytest.mark.parametrize("seed", range(5))
def test_random_placements_never_over_commit_and_stay_powers_of_two(seed):
    rng = random.Random(seed)
    free = FreeGpus(_cluster())
    held = []
    for _ in range(300):
        if held and rng.random() < 0.4:
            free.release(held.pop(rng.randrange(len(held))))
            continue
        gtype, size = rng.choice([("a100", 4), ("a40", 2), ("v100", 16)])
        n = rng.choice([1, 2, 4, 8, 16])
        placement = free.place(Cell(gtype, n, min(n, size), 1), strict=rng.random() < 0.5)
        if placement is None:
            continue
        assert sum(g for _, g in placement) == n
        assert all(g > 0 and g & (g - 1) == 0 for _, g in placement)
        assert all(free.type_of[name] == gtype for name, _ in placement)
        free.take(placement)
        held.append(placement)
        used = {}
        for p in held:
            for name, g in p:
                used[name] = used.get(name, 0) + g
        assert all(used[name] <= free.capacity[name] for name in used)
        assert all(free.free[name] == free.capacity[name] - used.get(name, 0) for name in free.capacity)


def test_fragmentation_counts_free_gpus_on_partial_nodes():
    free = FreeGpus(_cluster())
    free.take((("a100-1", 1), ("a100-2", 3)))
    frag = {f.gpu_type: f for f in free.fragmentation()}["a100"]
    assert frag.free_gpus == 16 - 4
    assert frag.free_on_partial_nodes == 3 + 1
    assert frag.free_whole_nodes == 2
    assert frag.fragmentation_frac == pytest.approx(4 / 12)


def test_snapshot_placement_respects_running_jobs_and_unmanaged_gpus():
    nodes = (NodeView("a100-1", "a100", 4, unmanaged_gpus=2), NodeView("a100-2", "a100", 4))
    running = JobView("1", "u", JobSpec("gpt-1.3b", 128, 4, "a100"), 0.0, "running",
                      Assignment(Cell("a100", 4, 4, 1), (("a100-2", 4),)), 0.0, 10, 0, 0.0)
    snap = Snapshot(0.0, nodes, (running,))
    assert place_cell(snap, Cell("a100", 4, 4, 1)) is None
    assert place_cell(snap, Cell("a100", 2, 4, 1)) == (("a100-1", 2),)


def test_cells_on_nodes_of_no_power_of_two_size_lay_out_on_whole_groups():
    """8 GPUs on 6-GPU nodes are 2 nodes of 4 (they were '2 x 6', 12 GPUs, which no rate
    and no placement matched, so such jobs were never runnable)."""
    from estimator.cells import gpus_per_node_of
    from estimator.cluster import cluster_from_dict
    from estimator.estimate import enumerate_cells
    cluster = cluster_from_dict({"name": "six", "node_groups": [{"gpu_type": "v100", "nodes": 4, "gpus_per_node": 6}]})
    assert [gpus_per_node_of(n, 6) for n in (1, 2, 4, 8, 16)] == [1, 2, 4, 4, 4]
    cells = enumerate_cells(JobSpec("gpt-1.3b", 64, num_gpus=8), cluster)
    assert cells and {(c.num_gpus, c.gpus_per_node) for c in cells} == {(4, 4), (8, 4), (16, 4)}
    free = FreeGpus([(f"v{i}", "v100", 6) for i in range(4)])
    eight = next(c for c in cells if c.num_gpus == 8)
    assert sorted(g for _, g in free.place(eight)) == [4, 4]
