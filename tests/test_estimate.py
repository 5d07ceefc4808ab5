import math

import pytest

from estimator.cells import Cell, StagePlan
from estimator.cluster import load_cluster
from estimator.errors import SpecError
from estimator.estimate import (EstimateOptions, enumerate_cells, estimate_cell, estimate_job,
                                pipeline_time_s, score_plan, StageCost)
from estimator.gpus import gpu_type
from estimator.jobs import JobSpec
from estimator.memory import MemoryOptions, StageMemory

CRIUS = load_cluster("crius-1280")


def test_requested_count_gives_half_same_double_times_types_times_stages():
    cells = enumerate_cells(JobSpec("gpt-1.3b", 256, num_gpus=8), CRIUS)
    assert {c.num_gpus for c in cells} == {4, 8, 16}
    assert {c.gpu_type for c in cells} == {"a100", "a40", "a10", "v100"}
    for c in cells:
        assert c.num_stages in (1, 2, 4, 8, 16) and c.num_stages <= c.num_gpus
    assert len([c for c in cells if c.gpu_type == "a100" and c.num_gpus == 8]) == 4  # s = 1, 2, 4, 8


def test_max_stages_limits_the_stage_counts_of_every_cell():
    unlimited = enumerate_cells(JobSpec("gpt-1.3b", 256, num_gpus=8), CRIUS)
    assert any(c.num_stages > 1 for c in unlimited)
    single = enumerate_cells(JobSpec("gpt-1.3b", 256, num_gpus=8, max_stages=1), CRIUS)
    assert single and all(c.num_stages == 1 for c in single)
    assert set(single) == {c for c in unlimited if c.num_stages == 1}
    two = enumerate_cells(JobSpec("gpt-1.3b", 256, num_gpus=8, max_stages=3), CRIUS)
    assert set(two) == {c for c in unlimited if c.num_stages <= 2}  # stage counts are powers of two


def test_a_job_on_the_runtime_api_gets_only_plans_such_a_script_runs():
    """One stage, ZeRO-0, every activation kept, no expert parallelism: a Cell on which the
    runner's plan fits only with its states split (or with remat) does not fit such a job."""
    runner = estimate_job(JobSpec("gpt-1.3b", 512, 4, "a100"), load_cluster("lab"), EstimateOptions())
    api = estimate_job(JobSpec("gpt-1.3b", 512, 4, "a100", trainer="api"), load_cluster("lab"),
                       EstimateOptions(expert_parallel=True))
    assert any(e.feasible and e.zero_level >= 1 and e.cell.num_stages == 1 for e in runner.cells)
    assert api.cells and all(e.cell.num_stages == 1 and e.zero_level == 0 and not e.offload and not e.remat
                             and not any(s.ep for s in e.stages) for e in api.cells)
    assert api.best is not None
    moe = estimate_job(JobSpec("moe-2.4b", 64, 8, "a100", trainer="api"), CRIUS, EstimateOptions(expert_parallel=True))
    assert all(not any(s.ep for s in e.stages) for e in moe.cells)
    with pytest.raises(SpecError, match="max_stages"):
        JobSpec("gpt-1.3b", 512, trainer="api", max_stages=2)
    with pytest.raises(SpecError, match="trainer"):
        JobSpec("gpt-1.3b", 512, trainer="flax")


def test_max_stages_applies_to_estimates_and_their_best_cell():
    est = estimate_job(JobSpec("gpt-1.3b", 256, max_stages=1), CRIUS, EstimateOptions(max_gpus=16))
    assert est.cells and all(c.cell.num_stages == 1 for c in est.cells)
    assert est.best is not None and est.best.cell.num_stages == 1


@pytest.mark.parametrize("bad", [0, -1, 2.0, "1", True, 1 << 11])
def test_bad_max_stages_is_refused_with_the_value_quoted(bad):
    with pytest.raises(SpecError) as info:
        JobSpec("gpt-1.3b", 256, max_stages=bad)
    assert info.value.field == "max_stages" and f"max_stages={bad!r}" in str(info.value)
    assert len(str(info.value).splitlines()) == 1


def test_serverless_starts_at_the_smallest_count_that_fits():
    est = estimate_job(JobSpec("gpt-6.7b", 256), CRIUS, EstimateOptions(max_gpus=32))
    a10 = [c for c in est.cells if c.cell.gpu_type == "a10"]
    smallest = min(c.cell.num_gpus for c in a10)
    # 6.7B parameters cannot fit on fewer 24 GB GPUs than that, and that count does fit.
    assert any(c.feasible for c in a10 if c.cell.num_gpus == smallest)
    assert smallest >= 4


def test_best_is_the_fastest_feasible_cell():
    est = estimate_job(JobSpec("gpt-1.3b", 256, num_gpus=8), CRIUS)
    feasible = [c for c in est.cells if c.feasible]
    assert est.best in feasible
    assert est.best.iteration_time_s == min(c.iteration_time_s for c in feasible)
    assert est.best.samples_per_s == pytest.approx(256 / est.best.iteration_time_s)


def test_infeasible_cells_say_why():
    est = estimate_job(JobSpec("gpt-15b", 256, num_gpus=2, gpu_type="a10"), CRIUS, gpu_types=("a10",))
    assert est.best is None
    for c in est.cells:
        assert not c.feasible and c.reason and math.isinf(c.iteration_time_s)
    assert any("GB per GPU" in c.reason for c in est.cells)


def test_batch_that_does_not_split_is_infeasible():
    e = estimate_cell(JobSpec("gpt-1.3b", 100), Cell("a100", 4, 4, 1), CRIUS, EstimateOptions(micro_batches=16))
    assert not e.feasible and "does not split" in e.reason


def test_moe_needs_whole_expert_groups_per_shard():
    # As the runner routes them: a shard of fewer tokens than a group (S = 2,048) is one
    # smaller group; more tokens must be whole groups. 3 samples / dp 1 = 3,072 tokens.
    e = estimate_cell(JobSpec("moe-1.3b", 48), Cell("v100", 1, 16, 1), CRIUS,
                      EstimateOptions(micro_batches=16, plan_space="dp-only"))
    assert not e.feasible and "MoE" in e.reason
    # 256 samples / 16 micro-batches / dp 16 = 1 sample = 1,024 tokens: one group of 1,024.
    e = estimate_cell(JobSpec("moe-1.3b", 256), Cell("v100", 16, 16, 1), CRIUS,
                      EstimateOptions(micro_batches=16, plan_space="dp-only"))
    assert "MoE" not in e.reason


def test_more_gpus_of_a_type_run_faster_within_a_node():
    job = JobSpec("gpt-1.3b", 256)
    t = [estimate_cell(job, Cell("v100", n, 16, 1), CRIUS).iteration_time_s for n in (2, 4, 8)]
    assert t[0] > t[1] > t[2]


def test_faster_gpu_is_faster():
    job = JobSpec("gpt-1.3b", 256)
    a100 = estimate_cell(job, Cell("a100", 4, 4, 1), CRIUS)
    a10 = estimate_cell(job, Cell("a10", 4, 2, 1), CRIUS)
    assert a100.iteration_time_s < a10.iteration_time_s


def test_pipeline_formula():
    mem = StageMemory(0, 0, 0, 0, 0)
    costs = tuple(StageCost(StagePlan(0, 1, 1, 1), t, 0.1, 0.05, mem, True, "", "table") for t in (1.0, 3.0, 2.0))
    # first micro-batch through all stages + (B − 1) × slowest + sync and update
    assert pipeline_time_s(costs, 8) == pytest.approx(6.0 + 7 * 3.0 + 0.15)


def test_cell_estimate_equals_the_best_assembled_plan():
    """The per-stage choice is the optimum over all 2^S dp-only/tp-only assemblies, under
    the memory settings the estimate chose (here ZeRO, which lets the wide split fit)."""
    import itertools
    from estimator.memory import MemoryOptions
    job, cell = JobSpec("gpt-2.6b", 256), Cell("a100", 8, 4, 2)
    est = estimate_cell(job, cell, CRIUS)
    options = EstimateOptions(memory=MemoryOptions(zero_level=est.zero_level, offload=est.offload))
    ranges = [(s.layer_start, s.layer_end) for s in est.stages]
    scores = []
    for choice in itertools.product((0, 1), repeat=2):
        stages = tuple(StagePlan(a, b, 4, 1) if c == 0 else StagePlan(a, b, 1, 4)
                       for (a, b), c in zip(ranges, choice))
        s = score_plan(job, cell, CRIUS, stages, est.micro_batches, True, options)
        if s.feasible:
            scores.append(s.iteration_time_s)
    assert est.iteration_time_s == pytest.approx(min(scores))


def test_dp_only_plan_space_has_one_stage_and_no_tp():
    est = estimate_job(JobSpec("gpt-1.3b", 256, num_gpus=8), CRIUS, EstimateOptions(plan_space="dp-only"))
    assert all(c.cell.num_stages == 1 for c in est.cells)
    assert all(s.tp == 1 for c in est.cells for s in c.stages)


def test_compiled_fidelity_replaces_flops_and_says_so(tmp_path):
    """Every stage variant is compiled with XLA on CPU devices; times stay close to the
    formulas (FLOPs agree within a few percent) and the estimate says it was compiled."""
    model = tmp_path / "tiny.yaml"
    model.write_text("hidden: 64\nlayers: 2\nheads: 4\nsequence: 32\nvocab: 128\n")
    job, cell = JobSpec(str(model), 16), Cell("a100", 2, 2, 1)
    analytic = estimate_cell(job, cell, CRIUS)
    options = EstimateOptions(fidelity="compiled", compile_cache_dir=str(tmp_path / "cache"))
    compiled = estimate_cell(job, cell, CRIUS, options)
    assert analytic.fidelity == "analytic" and compiled.fidelity == "compiled"
    assert compiled.memory_fidelity == "analytic"  # no GPU-target compile here
    assert compiled.feasible and compiled.iteration_time_s == pytest.approx(analytic.iteration_time_s, rel=0.25)
    assert any((tmp_path / "cache").iterdir())  # results cached on disk
    assert compiled.to_json()["fidelity"] == "compiled"


def test_out_of_memory_cell_retries_with_more_micro_batches():
    job, cell = JobSpec("moe-27b", 1024), Cell("v100", 16, 16, 1)
    fixed = estimate_cell(job, cell, CRIUS, EstimateOptions(micro_batches=4))
    assert not fixed.feasible and "GB per GPU" in fixed.reason
    default = estimate_cell(job, cell, CRIUS)  # 4 × stages, doubled while it does not fit
    assert default.feasible and default.micro_batches > 4
    assert default.peak_memory_gb < fixed.peak_memory_gb


def test_a_large_batch_fits_in_as_many_micro_batches_as_it_needs():
    """gpt-760m at 16,384 samples on two A100s needs 64 micro-batches or more: beyond the
    three doublings of the default count that were once the limit."""
    job, cell = JobSpec("gpt-760m", 16384), Cell("a100", 2, 2, 1)
    est = estimate_cell(job, cell, CRIUS, EstimateOptions(memory=MemoryOptions(zero_level=0), remat=True))
    assert est.feasible and est.micro_batches >= 64
    # Weights and states alone beyond the GPU: the doubling stops, and says why.
    big = estimate_cell(JobSpec("gpt-15b", 16384), Cell("a10", 1, 1, 1), CRIUS,
                        EstimateOptions(memory=MemoryOptions(zero_level=0), remat=True))
    assert not big.feasible and "GB per GPU" in big.reason
    # It stopped once a doubling's saving showed none could fit (16,384 allows far more):
    # the peak at the last count, less twice what its doubling saved, is still too much.
    usable_gb = gpu_type("a10").device_memory_gb * MemoryOptions().usable_frac
    half = estimate_cell(JobSpec("gpt-15b", 16384), Cell("a10", 1, 1, 1), CRIUS,
                         EstimateOptions(memory=MemoryOptions(zero_level=0), remat=True,
                                         micro_batches=big.micro_batches // 2))
    assert big.micro_batches <= 256
    assert big.peak_memory_gb - 2 * (half.peak_memory_gb - big.peak_memory_gb) > usable_gb


def test_micro_batch_count_is_the_largest_divisor_of_the_global_batch_up_to_the_target():
    from estimator.estimate import micro_batch_count, more_micro_batches

    assert [micro_batch_count(g, 4) for g in (64, 6, 10, 2, 1, 250)] == [4, 3, 2, 2, 1, 2]
    assert micro_batch_count(250, 8) == 5 and micro_batch_count(256, 16) == 16
    assert [more_micro_batches(g, b) for g, b in ((64, 4), (250, 2), (250, 5), (6, 3), (7, 1))] == \
           [8, 5, 10, 6, 7]
    assert more_micro_batches(6, 6) is None


@pytest.mark.parametrize("global_batch", [2, 6, 10, 250])
def test_small_and_odd_global_batches_get_cells_whose_micro_batches_divide_them(global_batch):
    est = estimate_job(JobSpec("gpt-1.3b", global_batch, num_gpus=4), CRIUS)
    assert est.best is not None and est.best.feasible
    for c in est.cells:
        assert global_batch % c.micro_batches == 0
        if c.feasible:
            micro = global_batch // c.micro_batches
            assert all(micro % s.dp == 0 for s in c.stages)
    # One stage on one A100: 6 samples as 3 micro-batches of 2 (the largest count ≤ 4).
    if global_batch == 6:
        one = estimate_cell(JobSpec("gpt-1.3b", 6), Cell("a100", 2, 4, 1), CRIUS)
        assert one.feasible and one.micro_batches == 3


def test_global_batches_divisible_by_four_per_stage_keep_that_count():
    for cell in (Cell("a100", 8, 4, 1), Cell("a100", 8, 4, 2), Cell("a100", 8, 4, 8)):
        assert estimate_cell(JobSpec("gpt-1.3b", 256), cell, CRIUS).micro_batches == 4 * cell.num_stages


def test_a_pipeline_whose_padded_stages_overflow_is_not_chosen_nor_called_feasible():
    """The runner pads every stage's buffers to the largest stage's. gpt-1.3b in two stages
    on 8 v100s: a tp-4 stage (large activations) beside a dp-4 one (whole weights and
    states) fits stage by stage but not padded; the tuner's score says so, and the Cell
    estimate takes a plan that fits as a whole, without ZeRO."""
    job, cell = JobSpec("gpt-1.3b", 256), Cell("v100", 8, 16, 2)
    est = estimate_cell(job, cell, CRIUS)
    assert est.feasible and est.zero_level == 0 and est.peak_memory_gb <= 32 * 0.9
    ranges = [(s.layer_start, s.layer_end) for s in est.stages]
    mixed = (StagePlan(*ranges[0], 1, 4), StagePlan(*ranges[1], 4, 1))
    score = score_plan(job, cell, CRIUS, mixed, est.micro_batches, True)
    assert not score.feasible and "padded" in score.reason and score.peak_memory_gb > 32 * 0.9


def test_every_feasible_cell_of_a_deep_pipeline_has_a_plan_the_runner_reads(tmp_path):
    """The daemon writes a Cell's plan with its stage boundaries; a pipeline of 256 stages
    takes more characters than a runner reads, and is no longer offered (it was, and its
    job failed at its first start)."""
    from estimator.plan_string import MAX_PLAN_STRING, format_plan, parse_plan
    model = tmp_path / "deep.yaml"
    model.write_text("hidden: 1024\nlayers: 600\nheads: 16\nsequence: 512\nvocab: 32000\n")
    est = estimate_job(JobSpec(str(model), 512, 256, "a100"), CRIUS, EstimateOptions(), ("a100",))
    deepest = max(est.cells, key=lambda c: c.cell.num_stages)
    assert deepest.cell.num_stages == 256 and not deepest.feasible and str(MAX_PLAN_STRING) in deepest.reason
    feasible = [c for c in est.cells if c.feasible]
    assert max(c.cell.num_stages for c in feasible) == 128
    for c in feasible:
        parse_plan(format_plan(c.cell, c.stages, c.micro_batches, c.remat, None,
                               zero_level=c.zero_level, offload=c.offload))  # boundaries written out


def test_with_runnable_only_a_job_is_never_given_a_plan_the_runner_refuses():
    """ZeRO-3 with remat off is faster and was kept as best, though the runner gathers
    ZeRO-3's weights inside its rematerialization; and a plan of data parallelism 1
    everywhere carried a ZeRO level (nothing to shard over) that Adafactor's runner refuses."""
    from estimator.memory import MemoryOptions
    for model, zero in (("gpt-1.3b", 3), ("moe-690m", 1)):
        est = estimate_job(JobSpec(model, 16, num_gpus=4, gpu_type="a100"), CRIUS,
                           EstimateOptions(memory=MemoryOptions(zero_level=zero), remat=None), ("a100",))
        assert est.best is not None and est.best.runnable, (model, est.best.plan)
        for c in est.cells:
            if c.feasible and all(s.dp == 1 for s in c.stages):
                assert c.zero_level == 0 and "zero=" not in c.plan and c.runnable, c.plan


def test_accumulation_skips_counts_moe_routing_cannot_split():
    """moe-2.4b at 100 samples on one V100: 2 micro-batches do not fit, and the doubling's
    4 micro-batches of 25 samples cannot be routed (whole expert groups of 2048 tokens),
    which stopped it there, calling the Cell out of memory; 5 fit. On four a10s its
    pipeline of 4 stages fits in 100 micro-batches: the doubling had stopped at 20."""
    job, v100 = JobSpec("moe-2.4b", 100), Cell("v100", 1, 1, 1)
    assert "GB per GPU" in estimate_cell(job, v100, CRIUS, EstimateOptions(micro_batches=2)).reason
    assert "tokens per micro-batch" in estimate_cell(job, v100, CRIUS, EstimateOptions(micro_batches=4)).reason
    one = estimate_cell(job, v100, CRIUS)
    assert one.feasible and one.micro_batches == 5
    four = estimate_cell(JobSpec("moe-2.4b", 1000), Cell("a10", 4, 2, 4), CRIUS)
    assert four.feasible and four.micro_batches > 20


def test_the_cells_of_a_count_never_exceed_what_a_job_may_ask_for():
    """N/2, N and 2N: at the largest count a job may request, 2N was offered (and starred
    as best) though it could not be asked for."""
    from estimator.cluster import cluster_from_dict
    from estimator.estimate import enumerate_cells
    from estimator.jobs import MAX_GPUS
    huge = cluster_from_dict({"name": "huge", "node_groups": [{"gpu_type": "h100", "nodes": 10**5,
                                                               "gpus_per_node": 8}]})
    counts = {c.num_gpus for c in enumerate_cells(JobSpec("gpt-1.3b", 2**20, MAX_GPUS, "h100"), huge)}
    assert counts == {MAX_GPUS // 2, MAX_GPUS}
