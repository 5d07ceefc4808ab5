"""Datasheet-derived efficiency: a GPU type with no measurements gets its own physics."""

from dataclasses import replace

import pytest

from estimator.cells import Cell
from estimator.cluster import load_cluster
from estimator.compute import (FITTED_EFFICIENCY, FITTED_PHYSICS, Efficiency, SharedPhysics,
                               datasheet_efficiency, efficiency, layer_time_s)
from estimator.estimate import EstimateOptions, estimate_cell
from estimator.gpus import CATALOG, gpu_type
from estimator.jobs import JobSpec
from estimator.memory import MemoryOptions
from estimator.models import load_model

MEASURED = ("a100", "v100", "a40", "a10")


def test_unmeasured_type_gets_its_datasheet_not_a_median():
    # h200 has no row in the measured table: every field follows from its datasheet and
    # the shared physics, by hand.
    h200, p = gpu_type("h200"), FITTED_PHYSICS
    eff = efficiency(h200)
    assert eff == datasheet_efficiency(h200)
    assert eff.matmul_frac == p.matmul_frac
    assert eff.conv_frac == pytest.approx(p.fp32_issue_frac * 1.0)
    assert eff.half_rate_gflop == pytest.approx(p.half_rate_gflop_per_sm * 132)
    assert eff.inter_node_frac == p.inter_node_frac_nvlink
    # l20 (AD102, PCIe-only): half the fp32 issue rate, the PCIe inter-node share.
    l20 = efficiency(gpu_type("l20"))
    assert l20.conv_frac == pytest.approx(p.fp32_issue_frac * 0.5)
    assert l20.inter_node_frac == p.inter_node_frac_pcie
    assert l20.half_rate_gflop == pytest.approx(p.half_rate_gflop_per_sm * 92)


def test_a_type_outside_the_catalog_is_derived_too():
    made_up = replace(gpu_type("h100"), name="x200", sm_count=160, fp32_issue_frac=0.5, pcie_only=True)
    eff = efficiency(made_up)
    assert eff.half_rate_gflop == pytest.approx(FITTED_PHYSICS.half_rate_gflop_per_sm * 160)
    assert eff.conv_frac == pytest.approx(FITTED_PHYSICS.fp32_issue_frac * 0.5)
    assert eff.inter_node_frac == FITTED_PHYSICS.inter_node_frac_pcie


def test_every_type_shares_one_parameter_set():
    fields = ("matmul_frac", "memory_frac", "layer_overhead_s")
    for f in fields:
        assert len({getattr(FITTED_EFFICIENCY[t], f) for t in CATALOG}) == 1, f


def test_parameters_are_physical():
    p = FITTED_PHYSICS
    for f in ("matmul_frac", "fp32_issue_frac", "memory_frac", "inter_node_frac_nvlink", "inter_node_frac_pcie"):
        assert 0.0 < getattr(p, f) <= 1.0, f
    assert 0.0 <= p.layer_overhead_s < 2e-3
    assert p.half_rate_gflop_per_sm >= 0.0


def test_a_per_type_override_wins_and_others_keep_their_physics():
    a100, h200 = gpu_type("a100"), gpu_type("h200")
    mine = Efficiency(0.5, 0.5, 0.5, 1e-4, 10.0, 0.5)
    table = {"a100": mine}
    assert efficiency(a100, table) is mine
    assert efficiency(h200, table) == datasheet_efficiency(h200)


def test_other_physics_give_other_parameters():
    other = SharedPhysics(0.5, 0.4, 0.7, 1e-4, 1.0, 0.9, 0.3)
    eff = datasheet_efficiency(gpu_type("a40"), other)
    assert (eff.matmul_frac, eff.conv_frac, eff.inter_node_frac) == (0.5, pytest.approx(0.2), 0.3)
    assert eff.half_rate_gflop == pytest.approx(84.0)


def test_newer_datasheet_is_faster_for_the_same_layer():
    layer = load_model("gpt-1.3b").layers[3]
    times = {t: layer_time_s(layer, gpu_type(t), efficiency(gpu_type(t)), "fp16", 4.0, 1, 3.0)
             for t in ("v100", "a100", "h100", "h200")}
    assert times["h200"] <= times["h100"] < times["a100"] < times["v100"]


def test_weight_reads_make_tiny_batches_memory_bound():
    layer = load_model("moe-10b").layers[2]  # an expert layer: many weights per token
    gpu = gpu_type("a100")
    eff = replace(efficiency(gpu), layer_overhead_s=0.0, half_rate_gflop=0.0)
    t = layer_time_s(layer, gpu, eff, "fp16", 1e-6, 1, 1.0)
    weights_s = layer.params * 2 / (gpu.memory_bandwidth_gbytes_s * 1e9 * eff.memory_frac)
    assert t == pytest.approx(weights_s, rel=1e-3)


def test_the_runner_runs_fp32_convolutions_on_tf32_tensor_cores_where_a_gpu_has_them():
    """By hand: with the memory and overhead terms off, a wide_resnet convolution layer's
    time is its FLOPs over the rate, and the occupancy term is the same either way. An H200
    takes TF32 at its tensor cores' share; a V100 has no TF32 and runs on its CUDA cores
    whatever the program. The runner's estimate takes TF32 (XLA's default), Alpa's does not."""
    model = load_model("wide_resnet-500m")
    conv = next(layer for layer in model.layers if layer.kernels)
    for name, tf32_rate in (("h200", 494.7e12), ("v100", None)):
        gpu = gpu_type(name)
        eff = replace(efficiency(gpu), memory_frac=1e9, layer_overhead_s=0.0)
        cuda = layer_time_s(conv, gpu, eff, "fp32", 32.0, 1, 1.0)
        tensor = layer_time_s(conv, gpu, eff, "fp32", 32.0, 1, 1.0, tf32=True)
        if tf32_rate is None:
            assert tensor == cuda
        else:
            expected = (gpu.fp32_tflops * 1e12 * eff.conv_frac) / (tf32_rate * eff.matmul_frac)
            assert tensor / cuda == pytest.approx(expected, rel=1e-3)
            assert expected < 0.2  # the 4.6× slow estimate of wide_resnet-500m on an H200
    assert MemoryOptions().tf32 and not MemoryOptions(program="alpa").tf32
    cluster, job = load_cluster("crius-1280"), JobSpec("wide_resnet-500m", 64)
    alpa = EstimateOptions(memory=MemoryOptions(program="alpa"))
    runner_a100 = estimate_cell(job, Cell("a100", 4, 4, 1), cluster).iteration_time_s
    assert runner_a100 < 0.5 * estimate_cell(job, Cell("a100", 4, 4, 1), cluster, alpa).iteration_time_s
    v100 = [estimate_cell(job, Cell("v100", 4, 4, 1), cluster, o).iteration_time_s for o in (EstimateOptions(), alpa)]
    assert v100[0] == pytest.approx(v100[1], rel=0.05)  # memory settings differ, not the convolutions' rate
