"""The plan tuner: the plan space, Crius/Arena pruning, the CLI, and tuned plans that run."""

import contextlib
import io
import json
import math
import multiprocessing

import pytest

from estimator.cells import Cell, StagePlan
from estimator.cluster import load_cluster
from estimator.jobs import JobSpec
from estimator.plan_string import parse_plan
from estimator.tuner import (TuneOptions, arena_filter, candidate_partitions, pruned_splits,
                             stage_splits, tune)

TINY_YAML = "hidden: 32\nlayers: 2\nheads: 2\nsequence: 16\nvocab: 64\ndtype: fp32\n"


def test_stage_splits_cover_every_power_of_two_factorisation():
    assert stage_splits(8) == ((8, 1), (4, 2), (2, 4), (1, 8))
    assert stage_splits(1) == ((1, 1),)
    for n in (2, 4, 8, 16):
        dp_half, tp_half = set(pruned_splits(n, "dp")), set(pruned_splits(n, "tp"))
        assert (n, 1) in dp_half and (1, n) in tp_half
        assert (n, 1) not in tp_half and (1, n) not in dp_half
        assert dp_half | tp_half == set(stage_splits(n))
    # The √N × √N half-hybrid is in both halves; where N is not a square, both splits next to it.
    assert (4, 4) in pruned_splits(16, "dp") and (4, 4) in pruned_splits(16, "tp")
    assert {(4, 2), (2, 4)} <= set(pruned_splits(8, "dp")) & set(pruned_splits(8, "tp"))
    assert {(8, 4), (4, 8)} <= set(pruned_splits(32, "dp")) & set(pruned_splits(32, "tp"))


def test_stage_plans_beyond_the_limit_are_the_splits_alike_and_one_stage_apart():
    """16 stages of 8 GPUs with 3 splits each are 3^16 = 43M plans: the pruned search never
    finished. Beyond the limit it takes each split alike in every stage and each of those
    with one stage changed."""
    from estimator.tuner import _assemble
    ranges = tuple((i, i + 1) for i in range(16))
    splits = [((8, 1), (4, 2), (2, 4))] * 16
    plans = _assemble(ranges, splits, limit=256)
    assert len(plans) == len(set(plans)) == 3 + 3 * 16 * 2
    assert {tuple((p.dp, p.tp) for p in plan) for plan in plans[:3]} == {((dp, tp),) * 16 for dp, tp in splits[0]}
    assert all(sum(p.dp != plan[0].dp for p in plan) <= 1 or sum(p.dp != plan[-1].dp for p in plan) <= 1
               for plan in plans)
    assert len(_assemble(ranges[:4], splits[:4], limit=256)) == 3 ** 4  # under it: every one
    # Stages that favour other halves list their splits in another order: alike by value.
    mixed = [((4, 2), (2, 4), (1, 8))] * 2 + splits[2:]
    splits_of = {tuple((p.dp, p.tp) for p in plan) for plan in _assemble(ranges, mixed, limit=256)}
    assert all(((dp, tp),) * 16 in splits_of for dp, tp in ((4, 2), (2, 4)))


def test_tuning_a_cell_of_many_stages_scores_a_bounded_number_of_plans():
    result = tune(JobSpec("gpt-1.3b", 256), Cell("a100", 128, 8, 16), load_cluster("crius-1280"))
    assert result.ranked and result.candidates_evaluated < 5000


def test_candidate_partitions_are_contiguous_and_include_the_balanced_one():
    base = ((0, 9), (9, 17), (17, 26))
    parts = candidate_partitions(base, 26, 2)
    assert parts[0] == base
    assert len(parts) == 1 + 2 * 2 * 2
    for p in parts:
        assert p[0][0] == 0 and p[-1][1] == 26
        assert all(a[1] == b[0] and a[0] < a[1] for a, b in zip(p, p[1:]))


def test_arena_filter_drops_dominated_and_more_imbalanced_partitions():
    metrics = {
        "balanced": (1.02, 100.0, 3.0),
        "cheap-cut": (1.10, 50.0, 2.9),  # on the frontier and the best proxy time
        "dominated": (1.20, 120.0, 3.5),
        "skewed": (1.30, 40.0, 4.0),  # on the frontier, but more imbalanced than the best
    }
    assert set(arena_filter(metrics)) == {"balanced", "cheap-cut"}


@pytest.mark.parametrize("model, batch, cell", [
    ("gpt-1.3b", 256, Cell("a100", 8, 4, 2)),
    ("wide_resnet-2b", 512, Cell("a100", 16, 4, 4)),
])
def test_pruned_tuning_keeps_quality_with_far_fewer_candidates(model, batch, cell):
    cluster, job = load_cluster("crius-1280"), JobSpec(model, batch)
    full = tune(job, cell, cluster, TuneOptions(prune="none"))
    pruned = tune(job, cell, cluster, TuneOptions(prune="cell"))
    assert full.candidates_evaluated >= 5 * pruned.candidates_evaluated
    assert full.best.score.feasible and pruned.best.score.feasible
    assert full.best.score.iteration_time_s <= pruned.best.score.iteration_time_s
    assert full.best.score.iteration_time_s / pruned.best.score.iteration_time_s >= 0.97
    # Every plan respects the Cell: dp × tp = the stage's GPUs, layers cover the model.
    for plan in full.ranked:
        assert sum(s.num_gpus for s in plan.candidate.stages) == cell.num_gpus
        assert len(plan.candidate.stages) == cell.num_stages
    # Ranking: feasible first, then by time.
    times = [p.score.iteration_time_s for p in full.ranked if p.score.feasible]
    assert times == sorted(times)
    # The reported plan string names exactly the best plan.
    parsed = parse_plan(pruned.plan_string())
    assert parsed.stage_plans(pruned.default_ranges) == pruned.best.candidate.stages
    assert parsed.micro_batches == pruned.best.candidate.micro_batches


def test_pruned_tuning_drops_remat_where_more_micro_batches_fit_without_it():
    """gpt-760m at batch 128 on four a10s: at the Cell's micro-batch count a plan needs
    remat, and so does each count the hill-climb walks to, each slower than the last;
    16 micro-batches fit without remat and are the fastest of all. The pruned search
    finds them (before, it stopped at 8 s against the optimum's 6.9 s)."""
    cluster, job, cell = load_cluster("crius-1280"), JobSpec("gpt-760m", 128), Cell("a10", 4, 2, 1)
    full = tune(job, cell, cluster, TuneOptions(prune="none"))
    pruned = tune(job, cell, cluster, TuneOptions(prune="cell"))
    assert not full.best.candidate.remat
    assert pruned.best.candidate == full.best.candidate


def _cli(argv: list[str]) -> tuple[int, str, str]:
    from slurm_ext.cli import main
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(argv)
    return rc, out.getvalue(), err.getvalue()


def test_tune_cli_json_contract():
    rc, out, _ = _cli(["tune", "--model", "gpt-1.3b", "--global-batch", "256", "--gpu-type", "a100",
                       "--gpus", "8", "--stages", "2", "--json"])
    assert rc == 0
    doc = json.loads(out)
    assert {"cell", "prune", "candidates_evaluated", "best"} <= set(doc)
    assert doc["cell"] == "a100x8:s2" and doc["prune"] == "cell"
    best = doc["best"]
    assert {"plan", "stages", "iteration_time_s", "peak_memory_gb", "feasible"} <= set(best)
    plan = parse_plan(best["plan"])
    assert [[s["dp"], s["tp"]] for s in best["stages"]] == [list(s) for s in plan.stages]
    assert best["feasible"] and best["iteration_time_s"] > 0
    # Without --stages every stage count is tuned: more candidates, a best at least as good.
    rc, out, _ = _cli(["tune", "--model", "gpt-1.3b", "--global-batch", "256", "--gpu-type",
                       "a100", "--gpus", "8", "--json"])
    every = json.loads(out)
    assert every["candidates_evaluated"] > doc["candidates_evaluated"]
    assert every["best"]["iteration_time_s"] <= best["iteration_time_s"]


def test_tune_finds_the_zero_plan_that_estimate_finds_where_nothing_fits_without_it():
    """gpt-2.6b on 4 a100s in 2 stages fits only with its optimizer states split (ZeRO-1):
    `estimate` said so and `tune` said "no feasible plan"."""
    args = ["--model", "gpt-2.6b", "--global-batch", "256", "--gpu-type", "a100", "--gpus", "4"]
    rc, out, _ = _cli(["estimate", *args, "--json"])
    (cell,) = [c for c in json.loads(out)["cells"] if (c["num_gpus"], c["num_stages"]) == (4, 2)]
    assert cell["feasible"] and cell["zero_level"] == 1
    rc, out, _ = _cli(["tune", *args, "--stages", "2", "--json"])
    best = json.loads(out)["best"]
    assert rc == 0 and best["feasible"] and best["zero_level"] == 1 and parse_plan(best["plan"]).zero_level == 1
    assert best["iteration_time_s"] <= cell["iteration_time_s"] * 1.0001
    rc, out, _ = _cli(["tune", *args, "--stages", "2", "--zero", "0", "--json"])
    assert rc == 0 and not json.loads(out)["best"]["feasible"]  # as asked: ZeRO-0 only


def test_tune_takes_a_higher_zero_level_where_it_lets_a_faster_split_fit():
    """gpt-6.7b on 16 a100s in 4 stages fits as dp2tp2 at ZeRO-0, and as the faster dp4tp1
    only with its states split: `tune` stopped at ZeRO-0, slower than `estimate`'s plan."""
    args = ["--model", "gpt-6.7b", "--global-batch", "256", "--gpu-type", "a100", "--gpus", "16"]
    rc, out, _ = _cli(["estimate", *args, "--json"])
    (cell,) = [c for c in json.loads(out)["cells"] if (c["num_gpus"], c["num_stages"]) == (16, 4)]
    rc, out, _ = _cli(["tune", *args, "--stages", "4", "--json"])
    best = json.loads(out)["best"]
    rc0, out0, _ = _cli(["tune", *args, "--stages", "4", "--zero", "0", "--json"])
    zero = json.loads(out0)["best"]
    assert rc == rc0 == 0 and best["feasible"] and zero["feasible"]
    assert best["iteration_time_s"] < zero["iteration_time_s"] and best["zero_level"] > 0
    assert best["iteration_time_s"] <= cell["iteration_time_s"] * 1.0001


def test_tuning_tries_the_micro_batch_count_a_large_batch_needs():
    from estimator.estimate import EstimateOptions
    cluster, job, cell = load_cluster("crius-1280"), JobSpec("gpt-760m", 16384), Cell("a100", 4, 4, 1)
    best = tune(job, cell, cluster).ranked[0]
    assert best.score.feasible and best.candidate.micro_batches >= 64  # the factors reach 16
    given = tune(job, cell, cluster, TuneOptions(estimate=EstimateOptions(micro_batches=256))).ranked
    assert given[0].score.feasible and 256 in {p.candidate.micro_batches for p in given}  # where it starts


def test_tune_cli_errors_are_one_line_with_exit_2():
    rc, out, err = _cli(["tune", "--model", "gpt-1.3b", "--global-batch", "256", "--gpu-type",
                         "h100", "--gpus", "8", "--cluster", "crius-1280"])
    assert rc == 2 and out == ""
    assert err.count("\n") == 1 and "h100" in err
    # More GPUs than the cluster has of the type (it tuned a 512-GPU Cell of 320 a100s, or
    # ran for minutes without a word), and micro-batches that do not divide the batch (a
    # worse plan came back without one).
    for flags, word in ((["--gpus", "512", "--stages", "1"], "crius-1280 has 320 a100 GPUs"),
                        (["--gpus", "64", "--stages", "1", "--gpus-per-node", "16"], "too few a100 nodes of 16"),
                        (["--gpus", "8", "--micro-batches", "3"], "must divide the global batch 64")):
        rc, out, err = _cli(["tune", "--model", "gpt-1.3b", "--global-batch", "64", "--gpu-type", "a100",
                             "--cluster", "crius-1280", *flags])
        assert rc == 2 and out == "" and err.count("\n") == 1 and word in err
    # What `estimate` refuses, `tune` refuses too; and ZeRO 1-3 for an Adafactor model (every
    # plan was dropped as one the runner cannot run: "no feasible plan", exit 0).
    for flags, word in ((["--gpus", "12"], "gpus='12': not a power of two"),
                        (["--gpus", "8", "--gpus-per-node", "3"], "gpus_per_node=3: give a power of two"),
                        (["--model", "moe-1.3b", "--gpus", "8", "--zero", "1"], "moe-1.3b trains with adafactor")):
        rc, out, err = _cli(["tune", "--model", "gpt-1.3b", "--global-batch", "64", "--gpu-type", "a100",
                             "--cluster", "crius-1280", *flags])
        assert rc == 2 and out == "" and err.count("\n") == 1 and word in err, err


def test_tune_tries_every_node_size_of_the_type_whatever_the_groups_order(tmp_path):
    """Its default layout was the first node group's: 16 h100 as 4 × 4 on one cluster file
    and 2 × 8 on the same cluster with its groups listed the other way round."""
    groups = [{"gpu_type": "h100", "nodes": 4, "gpus_per_node": 4, "partition": "small"},
              {"gpu_type": "h100", "nodes": 4, "gpus_per_node": 8, "partition": "big"}]
    best = []
    for order in (groups, groups[::-1]):
        path = tmp_path / f"c{len(best)}.yaml"
        path.write_text(json.dumps({"name": "two-sizes", "node_groups": order}))
        rc, out, err = _cli(["tune", "--model", "gpt-1.3b", "--global-batch", "256", "--gpu-type", "h100",
                             "--gpus", "16", "--stages", "1", "--cluster", str(path), "--json"])
        assert rc == 0, err
        best.append(json.loads(out))
    assert best[0] == best[1] and best[0]["cell"].startswith("h100x16")


# --------------------------------------------------------------------------- running plans


def _tune_and_run(model_path: str) -> dict:
    """In a spawn child with 4 CPU devices: tune a tiny model, run its plan and references
    as the runtime runs them (one SPMD program per plan)."""
    import jax

    from estimator.estimate import partition_stages
    from estimator.jax_models import arch_from_model
    from estimator.jax_optim import optimizer_for
    from estimator.models import load_model
    from job_scripts.data import stream_for
    from job_scripts.pipeline import Pipeline
    from job_scripts.plan import ParallelPlan
    spec = load_model(model_path)
    arch = arch_from_model(spec)
    batch = 16
    cell = Cell("a100", 4, 4, 2)
    result = tune(JobSpec(model_path, batch), cell, load_cluster("crius-1280"), TuneOptions())
    plan = parse_plan(result.plan_string())
    stages = plan.stage_plans(partition_stages(spec, cell))
    data = stream_for(arch, 0, batch).batch(1)
    devices = jax.devices()
    n = arch.num_layers
    # A second plan mixing tp and dp, on the same micro-batches when they split over dp=2,
    # so one unsharded reference serves both.
    mb = plan.micro_batches if (batch // plan.micro_batches) % 2 == 0 else 2
    hybrid = (StagePlan(0, n // 2, 1, 2), StagePlan(n // 2, n, 2, 1))
    runs = [("tuned", stages, plan.micro_batches, plan.remat, devices),
            ("tuned_ref", (StagePlan(0, n, 1, 1),), plan.micro_batches, False, devices[:1]),
            ("hybrid", hybrid, mb, True, devices)]
    if mb != plan.micro_batches:
        runs.append(("hybrid_ref", (StagePlan(0, n, 1, 1),), mb, False, devices[:1]))
    losses = {}
    for name, st, b, remat, devs in runs:
        pipe = Pipeline(arch, ParallelPlan(st, b, remat), devs, batch, optimizer_for(arch.optimizer))
        state = pipe.init(3)
        state, first = pipe.step(state, data.inputs, data.targets)
        _, second = pipe.step(state, data.inputs, data.targets)
        losses[name] = (float(first), float(second))
    losses.setdefault("hybrid_ref", losses["tuned_ref"])
    return {"losses": losses, "plan": result.plan_string(),
            "evaluated": result.candidates_evaluated}


def _measure_cli(model_path: str) -> tuple[int, str, str]:
    return _cli(["tune", "--model", model_path, "--global-batch", "8", "--gpu-type", "a100",
                 "--gpus", "2", "--stages", "1", "--measure", "--json"])


def test_tuned_plan_trains_like_the_unsharded_model_and_measure_picks_by_time(tmp_path):
    from estimator.compiled import _worker_init, child_xla_flags
    model_path = tmp_path / "tiny.yaml"
    model_path.write_text(TINY_YAML)
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(1, initializer=_worker_init, initargs=(child_xla_flags(4),)) as pool:
        ran = pool.apply(_tune_and_run, (str(model_path),))
        rc, out, err = pool.apply(_measure_cli, (str(model_path),))
    losses = ran["losses"]
    assert ran["plan"].startswith("cell=a100x4:s2 ")
    for plan, ref in (("tuned", "tuned_ref"), ("hybrid", "hybrid_ref")):
        for got, want in zip(losses[plan], losses[ref]):
            assert math.isfinite(got) and got == pytest.approx(want, rel=1e-5, abs=1e-5)
    assert losses["hybrid"][1] < losses["hybrid"][0]  # the update is applied: loss falls
    assert rc == 0, err
    doc = json.loads(out)
    assert doc["measured"] is True
    assert doc["best"]["measured_iteration_time_s"] > 0
    assert parse_plan(doc["best"]["plan"]).num_gpus == 2


def test_measured_plans_lead_and_every_plan_is_listed_once():
    from slurm_ext.commands.tune import rank_measured

    job = JobSpec("gpt-760m", 64)
    ranked = tune(job, Cell("a100", 4, 4, 1), load_cluster("crius-1280"), TuneOptions()).ranked
    assert len(ranked) >= 3
    # The second and third estimated plans were timed, the third faster.
    seconds = {id(ranked[1]): 2.0, id(ranked[2]): 1.0}
    out = rank_measured(ranked, seconds)
    assert len(out) == len(ranked)
    assert [p.measured_s for p in out[:2]] == [1.0, 2.0]
    assert out[0].candidate == ranked[2].candidate and out[1].candidate == ranked[1].candidate
    assert [p.candidate for p in out[2:]] == [p.candidate for i, p in enumerate(ranked) if i not in (1, 2)]
    assert all(p.measured_s is None for p in out[2:])


def test_micro_batch_choices_divide_odd_global_batches():
    from estimator.tuner import micro_batch_choices

    factors = TuneOptions().micro_batch_factors
    assert micro_batch_choices(Cell("a100", 4, 4, 2), 64, factors) == (2, 4, 8, 16, 32)
    # Targets past the global batch round down to it: one sample per micro-batch.
    assert micro_batch_choices(Cell("a100", 4, 4, 1), 6, factors) == (1, 2, 3, 6)
    assert micro_batch_choices(Cell("a100", 4, 4, 2), 10, factors) == (2, 5, 10)
    result = tune(JobSpec("gpt-1.3b", 10), Cell("a100", 4, 4, 2), load_cluster("crius-1280"),
                  TuneOptions(prune="none"))
    assert result.ranked and result.ranked[0].score.feasible
    assert {r.candidate.micro_batches for r in result.ranked} == {2, 5, 10}


def test_the_tuner_tries_expert_parallel_splits_when_asked():
    """With expert_parallel, moe-2.4b's stage on four a100s is also scored with its experts
    split over its GPUs, and that split wins, as in the Cell estimate; without it no
    candidate splits them. The allocation's search turns it on when the daemon's plan
    split them."""
    from estimator import jax_models as jm
    from estimator.estimate import EstimateOptions
    from estimator.models import load_model
    from job_scripts.tuning import PlanSpace, TuneRequest

    cluster, job, cell = load_cluster("crius-1280"), JobSpec("moe-2.4b", 512), Cell("a100", 4, 4, 1)
    for prune in ("cell", "none"):
        plain = tune(job, cell, cluster, TuneOptions(prune=prune))
        split = tune(job, cell, cluster, TuneOptions(prune=prune, estimate=EstimateOptions(expert_parallel=True)))
        assert not any(s.ep for p in plain.ranked for s in p.candidate.stages)
        assert split.candidates_evaluated > plain.candidates_evaluated
        assert all(s.ep for s in split.best.candidate.stages) and "ep]" in split.plan_string()
        assert split.best.score.iteration_time_s < plain.best.score.iteration_time_s

    spec = load_model("moe-2.4b")

    def space(start):
        return PlanSpace(TuneRequest("moe-2.4b", spec, jm.arch_from_model(spec), 512, "a100", 4, [None] * 4,
                                     1, start, 100, "gpu"))
    with_ep = space("cell=a100x4:s1 plan=[dp4tp1ep] mb=4 remat=1")
    without = space("cell=a100x4:s1 plan=[dp1tp4] mb=4 remat=1")
    assert any(s.ep for st in with_ep.structures for s in st)
    assert not any(s.ep for st in without.structures for s in st)


def test_micro_batch_counts_past_the_global_batch_round_down_to_its_divisors():
    """Stages × each factor, or the largest count below it that divides the global batch:
    6 samples over 4 stages try 3 and 6 micro-batches (not 3 alone), and 3 samples over 4
    stages still get a count, so a Cell of more stages than samples is tuned."""
    from estimator.tuner import micro_batch_choices
    assert micro_batch_choices(Cell("a100", 4, 4, 4), 6, (1, 2, 4, 8)) == (3, 6)
    assert micro_batch_choices(Cell("a100", 4, 4, 4), 3, (1, 2)) == (3,)
    result = tune(JobSpec("gpt-1.3b", 3), Cell("a100", 4, 4, 4), load_cluster("lab"))
    assert result.best.candidate.micro_batches == 3 and result.best.score.feasible
