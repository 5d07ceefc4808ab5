"""Online refit (Rubick): the robust fit of a GPU type's efficiency from measured speeds
(``estimator.online_refit``), and the daemon's side of it (``slurm_ext.refit``): threshold,
rate limit, observations kept across restarts, a refit written into the profile store."""

import json
import math
import time
from dataclasses import replace

import pytest

from estimator.cells import Cell, StagePlan
from estimator.cluster import load_cluster
from estimator.compute import FITTED_EFFICIENCY
from estimator.contract import ADMIN_COMMENT_PLAN, MEASURED_FILE, RunnerReport
from estimator.errors import SpecError
from estimator.estimate import EstimateOptions, estimate_cell, partition_stages, score_plan
from estimator.jobs import JobSpec
from estimator.models import load_model
from estimator.online_refit import MAX_OVERHEAD_S, RefitObservation, refit_efficiency
from estimator.profile_store import load_profile_view
from estimator.refine import Measurement
from slurm_ext.config import resolve
from slurm_ext.daemon import Daemon
from slurm_ext.refit import OnlineRefitter, RefitGate, observation_from_report, off_by_text, plan_key
from slurm_ext.slurm_client import Gres, SlurmJob, SlurmNode
from slurm_ext.store import Store
from test_daemon_rounds import FakeSlurm  # a SlurmClient over fixed jobs and nodes, recording changes

CLUSTER = load_cluster("crius-1280")  # A100 nodes of 4 GPUs: 8 and 16 GPUs span nodes
START = FITTED_EFFICIENCY["a100"]
# What the site's A100s "really" attain: slower matmuls and memory (0.85 of the shipped
# share), more launch overhead, a congested network.
TRUE = replace(START, matmul_frac=0.52, memory_frac=round(0.85 * START.memory_frac, 3), layer_overhead_s=150e-6,
               inter_node_frac=0.6)

# (model, global batch, Cell, per-stage (dp, tp), micro-batches): dense and MoE models,
# data and tensor parallelism, one to four stages, within a node and across nodes, large
# micro-batches (compute-bound) and tiny ones (launch-bound).
CASES = [
    ("gpt-760m", 64, Cell("a100", 4, 4, 1), [(4, 1)], 4),
    ("gpt-760m", 64, Cell("a100", 4, 4, 1), [(1, 4)], 8),
    ("gpt-1.3b", 128, Cell("a100", 8, 4, 2), [(4, 1), (2, 2)], 8),
    ("gpt-2.6b", 256, Cell("a100", 16, 4, 4), [(4, 1)] * 4, 16),
    ("moe-1.3b", 64, Cell("a100", 8, 4, 1), [(8, 1)], 4),
    ("gpt-760m", 16, Cell("a100", 4, 4, 2), [(2, 1), (1, 2)], 8),
    ("gpt-1.3b", 32, Cell("a100", 4, 4, 1), [(2, 2)], 2),
    ("gpt-6.7b", 128, Cell("a100", 16, 4, 4), [(1, 4)] * 4, 16),
    ("gpt-2.6b", 64, Cell("a100", 8, 4, 2), [(4, 1), (4, 1)], 8),
    ("gpt-760m", 512, Cell("a100", 8, 4, 1), [(8, 1)], 8),
    ("moe-690m", 128, Cell("a100", 16, 4, 2), [(8, 1), (4, 2)], 8),
    ("gpt-1.3b", 8, Cell("a100", 8, 4, 4), [(2, 1)] * 4, 8),
]


def observe(model, global_batch, cell, per_stage, micro_batches, eff=TRUE, job_id="0", at_s=0.0):
    """What a job running this plan would measure if the type attained ``eff``."""
    ranges = partition_stages(load_model(model), cell)
    stages = tuple(StagePlan(a, b, dp, tp) for (a, b), (dp, tp) in zip(ranges, per_stage))
    t = score_plan(JobSpec(model, global_batch), cell, CLUSTER, stages, micro_batches, True,
                   EstimateOptions(efficiency={cell.gpu_type: eff})).iteration_time_s
    return RefitObservation(model, global_batch, cell, stages, micro_batches, True, t, job_id, at_s)


@pytest.fixture(scope="module")
def observations():
    return [observe(*case, job_id=str(i), at_s=float(i)) for i, case in enumerate(CASES)]


@pytest.fixture(scope="module")
def clean_fit(observations):
    return refit_efficiency("a100", START, CLUSTER, observations)


def _rel(a, b):
    return abs(a / b - 1.0)


# ------------------------------------------------------------------------- the fit

def test_refit_recovers_the_parameters_that_made_the_measurements(clean_fit):
    r = clean_fit
    assert set(r.fitted) == {"matmul_frac", "memory_frac", "layer_overhead_s", "inter_node_frac"}
    e = r.efficiency
    # What dominates the time is recovered closely; what moves it little (the memory-bound
    # kernels' share) is held nearer its current value by the prior.
    assert _rel(e.matmul_frac, TRUE.matmul_frac) < 0.05
    assert _rel(e.inter_node_frac, TRUE.inter_node_frac) < 0.05
    assert _rel(e.layer_overhead_s, TRUE.layer_overhead_s) < 0.2
    assert _rel(e.memory_frac, TRUE.memory_frac) < 0.15
    # Nothing the fp16 models say about fp32 convolutions or the half-rate work size.
    assert (e.conv_frac, e.half_rate_gflop) == (START.conv_frac, START.half_rate_gflop)
    assert r.observations == len(CASES)
    assert r.median_error_before_frac > 0.2
    assert r.median_error_after_frac < 0.01 and r.improved


def test_refit_is_fast_enough_for_a_round(observations):
    t0 = time.perf_counter()
    refit_efficiency("a100", START, CLUSTER, observations + observations[:8])
    assert time.perf_counter() - t0 < 2.0  # ~0.1 s here; the daemon's round must not stall


def test_one_outlier_hardly_moves_the_parameters(observations, clean_fit):
    bad = list(observations)
    bad[2] = replace(bad[2], iteration_time_s=2.5 * bad[2].iteration_time_s)  # a straggling job
    e, clean = refit_efficiency("a100", START, CLUSTER, bad).efficiency, clean_fit.efficiency
    for name in ("matmul_frac", "memory_frac", "inter_node_frac"):
        assert _rel(getattr(e, name), getattr(clean, name)) < 0.03, name
    assert _rel(e.layer_overhead_s, clean.layer_overhead_s) < 0.1


def test_a_single_far_off_observation_moves_the_parameters_only_part_way():
    real = observe("gpt-1.3b", 128, Cell("a100", 8, 4, 2), [(4, 1), (2, 2)], 8, eff=START)
    r = refit_efficiency("a100", START, CLUSTER, [replace(real, iteration_time_s=2 * real.iteration_time_s)])
    e = r.efficiency
    assert r.improved and r.median_error_after_frac > 0.1  # helped, not explained away
    assert START.matmul_frac / 2 < e.matmul_frac < START.matmul_frac
    for name in ("matmul_frac", "conv_frac", "memory_frac", "inter_node_frac"):
        assert 0 < getattr(e, name) <= 1.0
    assert 0 <= e.layer_overhead_s <= MAX_OVERHEAD_S


def test_refits_of_one_far_off_job_do_not_walk_away_from_the_anchor():
    """The prior's centre stays where no refit moved it: centred on the last refit, the
    same job's measurement took the type over in two refits (a100's matmul share 0.69,
    0.39, 0.30, ...). A refit that gains nothing measurable is not one."""
    real = observe("gpt-1.3b", 128, Cell("a100", 8, 4, 2), [(4, 1), (2, 2)], 8, eff=START)
    slow = [replace(real, iteration_time_s=2 * real.iteration_time_s)]
    first = refit_efficiency("a100", START, CLUSTER, slow, anchor=START)
    second = refit_efficiency("a100", first.efficiency, CLUSTER, slow, anchor=START)
    assert first.improved and not second.improved
    assert second.efficiency.matmul_frac == pytest.approx(first.efficiency.matmul_frac, rel=0.02)
    drifting = refit_efficiency("a100", first.efficiency, CLUSTER, slow)  # centred on the last refit
    assert drifting.efficiency.matmul_frac < 0.9 * first.efficiency.matmul_frac


@pytest.mark.parametrize("gpu, moved, kept", [("v100", "conv_frac", "matmul_frac"),
                                               ("a100", "matmul_frac", "conv_frac")])
def test_an_fp32_model_refits_the_rate_its_convolutions_run_at(gpu, moved, kept):
    """A V100 has no TF32: an fp32 model's convolutions run on its CUDA cores, and their
    measured speed moves ``conv_frac`` only. On an A100 the runner's run on the TF32 tensor
    cores: ``matmul_frac`` moves, ``conv_frac`` stays."""
    start = FITTED_EFFICIENCY[gpu]
    true = replace(start, **{moved: 0.45})
    obs = [observe("wide_resnet-500m", gb, Cell(gpu, n, 4, 1), [(n, 1)], 4, eff=true)
           for gb, n in ((64, 4), (128, 4), (256, 4))]
    r = refit_efficiency(gpu, start, CLUSTER, obs)
    assert moved in r.fitted and kept not in r.fitted
    assert getattr(r.efficiency, kept) == getattr(start, kept)
    assert _rel(getattr(r.efficiency, moved), 0.45) < 0.1 and r.median_error_after_frac < 0.02


def test_nothing_to_fit_leaves_the_parameters(observations):
    assert refit_efficiency("v100", START, CLUSTER, observations).observations == 0  # other types ignored
    gone = replace(observations[0], model="/nonexistent/model.yaml")
    r = refit_efficiency("a100", START, CLUSTER, [gone])
    assert (r.efficiency, r.observations, r.improved) == (START, 0, False)


def test_observation_round_trips_through_json(observations):
    o = observations[3]
    assert RefitObservation.from_json(json.loads(json.dumps(o.to_json()))) == o
    for bad in (math.inf, math.nan, 0.0, -1.0):
        with pytest.raises(SpecError, match="iteration_time_s"):
            RefitObservation.from_json({**o.to_json(), "iteration_time_s": bad})


def test_an_infinite_time_kept_in_the_store_does_not_stop_the_types_refits(tmp_path, caplog):
    """The daemon's path: a measurement read back from the store that is not a time was
    refused when read, and the refit of its type failed as a whole, round after round."""
    from estimator.refine import Measurement
    refitter, store = _refitter(tmp_path)
    est = estimate_cell(JobSpec("gpt-760m", 64), Cell("a100", 4, 4, 1), CLUSTER)
    with pytest.raises(SpecError):
        Measurement.from_json({"cell": "a100x4:s1", "iteration_time_s": math.inf, "steps_measured": 8})
    refitter.observe(41, "gpt-760m", 64, (est,), Measurement("a100x4:s1", 1.6 * est.iteration_time_s, 8),
                     measured_json("cell=a100x4:s1 plan=[dp4tp1] mb=4 remat=1", 1.0), CLUSTER, 100.0)
    refitter.observe(43, "gpt-760m", 64, (est,), Measurement("a100x4:s1", math.inf, 8),
                     measured_json("cell=a100x4:s1 plan=[dp4tp2] mb=4 remat=1", 1.0, job_id="43"), CLUSTER, 150.0)
    with caplog.at_level("INFO", logger="slurm_ext.refit"):
        (result,) = refitter.refit_due(CLUSTER, [41, 43], 900.0)
    assert result.observations == 1 and result.improved
    assert "refit_observation_skipped" in caplog.text and "efficiency_refit_failed" not in caplog.text


def test_a_time_that_is_no_device_speed_is_left_out(observations, clean_fit):
    """An infinite time stopped every refit of the type (non-finite residuals); a time a
    thousand times off the estimate moved the parameters as far as the fit let it."""
    bad = [replace(observations[0], iteration_time_s=math.inf),
           replace(observations[1], iteration_time_s=observations[1].iteration_time_s * 1000),
           replace(observations[2], iteration_time_s=observations[2].iteration_time_s / 1000)]
    r = refit_efficiency("a100", START, CLUSTER, observations[3:] + bad)
    assert r.observations == len(observations) - 3
    assert r.efficiency == refit_efficiency("a100", START, CLUSTER, observations[3:]).efficiency


def test_a_zero_3_plan_measured_at_its_own_estimate_refits_nothing(tmp_path):
    """The observation carries its plan's ZeRO stage: scored as ZeRO-0 (no per-micro-batch
    gathers), a ZeRO-3 run looked 5× slow and the refit cut a100's inter-node share 8×."""
    from estimator.memory import MemoryOptions
    job, cell, stages = JobSpec("gpt-1.3b", 64), Cell("a100", 8, 4, 1), (StagePlan(0, 26, 8, 1),)
    zero3 = score_plan(job, cell, CLUSTER, stages, 4, True, EstimateOptions(memory=MemoryOptions(zero_level=3)))
    assert zero3.feasible
    obs = [RefitObservation("gpt-1.3b", 64, cell, stages, 4, True, zero3.iteration_time_s, f"j{i}", float(i),
                            zero_level=3) for i in range(6)]
    r = refit_efficiency("a100", START, CLUSTER, obs)
    assert r.median_error_before_frac < 1e-6
    assert vars(r.efficiency) == pytest.approx(vars(START), rel=1e-6)
    assert RefitObservation.from_json(json.loads(json.dumps(obs[0].to_json()))) == obs[0]
    # The daemon's trigger scores it under its ZeRO stage too: it read +293 % and asked
    # for a refit at every checkpoint.
    refitter = OnlineRefitter(Store(":memory:"), lambda: resolve({"profile_db": str(tmp_path / "p.sqlite")}, {}, {}))
    est = estimate_cell(job, cell, CLUSTER, EstimateOptions(memory=MemoryOptions(zero_level=3)))
    measurement = Measurement(cell.label(), zero3.iteration_time_s, 8)
    refitter.observe(41, "gpt-1.3b", 64, (est,), measurement, measured_json(est.plan, zero3.iteration_time_s),
                     CLUSTER, 0.0)
    assert 41 in refitter._seen and refitter.gate.due(10_000.0, 600.0) == ()


# ------------------------------------------------------------- the daemon's side

def test_gate_refits_a_type_only_past_the_threshold_and_at_most_once_per_interval():
    gate = RefitGate()
    assert gate.note("a100", "7", 0.08, 0.10).due(0.0) == ()  # within the threshold
    assert gate.note("a100", "7", -0.08, 0.10).due(0.0) == ()
    gate = gate.note("a100", "7", 0.23, 0.10).note("a100", "8", -0.15, 0.10)  # the worst is kept
    assert gate.due(1000.0, 600.0) == (("a100", "job 7 off by +23 %"),)
    gate = gate.done("a100", 1000.0)
    assert gate.due(1000.0, 600.0) == ()  # nothing pending
    gate = gate.note("a100", "9", -0.5, 0.10).note("v100", "10", 0.3, 0.10)
    assert gate.due(1300.0, 600.0) == (("v100", "job 10 off by +30 %"),)  # a100: too soon
    assert [t for t, _ in gate.due(1600.0, 600.0)] == ["a100", "v100"]
    assert off_by_text("123", -0.234) == "job 123 off by -23 %"


def measured_json(plan, iteration_time_s, platform="gpu", job_id="41"):
    """measured.json as the runner writes it (constructed)."""
    return json.dumps(RunnerReport(
        job_id=job_id, restart_count=0, cell=plan.split()[0].partition("=")[2], plan=plan,
        plan_source=ADMIN_COMMENT_PLAN, global_batch=64, num_devices=4, platform=platform,
        iteration_time_s=iteration_time_s, steps_measured=8, samples_per_s=64 / iteration_time_s,
        step=None, step_at_s=None, updated_at_s=None).to_json())


def test_observation_is_the_plan_that_ran_else_the_cell_estimate():
    est = estimate_cell(JobSpec("gpt-760m", 64), Cell("a100", 4, 4, 1), CLUSTER)
    m = Measurement("a100x4:s1", 2.0, 8)
    tuned = observation_from_report(41, "gpt-760m", 64, (est,), m,
                                    measured_json("cell=a100x4:s1 plan=[dp2tp2] mb=8 remat=0", 2.0), 5.0)
    ranges = [(s.layer_start, s.layer_end) for s in est.stages]
    assert [(s.layer_start, s.layer_end, s.dp, s.tp) for s in tuned.stages] == [(*ranges[0], 2, 2)]
    assert (tuned.micro_batches, tuned.remat, tuned.iteration_time_s, tuned.cell) == (8, False, 2.0, est.cell)
    assert plan_key(tuned) == "cell=a100x4:s1 plan=[dp2tp2] mb=8 remat=0 layers=0,26"
    zero1 = observation_from_report(41, "gpt-760m", 64, (est,), m,
                                    measured_json("cell=a100x4:s1 plan=[dp4tp1] mb=8 remat=1 zero=1", 2.0), 5.0)
    assert zero1.zero_level == 1 and plan_key(zero1).endswith("zero=1")
    fallback = observation_from_report(41, "gpt-760m", 64, (est,), m, "{}", 5.0)
    assert (fallback.stages, fallback.micro_batches, fallback.remat) == (est.stages, est.micro_batches, True)
    assert observation_from_report(41, "gpt-760m", 64, (est,), Measurement("a100x8:s1", 2.0, 8), "{}", 5.0) is None


def _refitter(tmp_path, threshold_frac=0.10):
    cfg = resolve({"state_db": str(tmp_path / "state.db"), "profile_db": str(tmp_path / "profile.db"),
                   "refit_threshold_frac": threshold_frac}, {}, {})
    store = Store(cfg.state_db)
    return OnlineRefitter(store, lambda: cfg, min_interval_s=600.0), store


def test_observations_and_refit_times_survive_a_restart(tmp_path):
    refitter, store = _refitter(tmp_path)
    est = estimate_cell(JobSpec("gpt-760m", 64), Cell("a100", 4, 4, 1), CLUSTER)
    text = measured_json("cell=a100x4:s1 plan=[dp4tp1] mb=4 remat=1", 1.0)
    t = est.iteration_time_s
    refitter.observe(41, "gpt-760m", 64, (est,), Measurement("a100x4:s1", 1.05 * t, 8), text, CLUSTER, 100.0)
    assert refitter.gate.pending == {}  # within 10 %: kept, not a trigger
    refitter.observe(41, "gpt-760m", 64, (est,), Measurement("a100x4:s1", 1.6 * t, 8), text, CLUSTER, 200.0)
    (row,) = store.refit_observations("a100", 50)  # one row per job and plan: the newest measurement
    assert row["iteration_time_s"] == pytest.approx(1.6 * t) and row["job_id"] == "41"
    assert refitter.gate.pending["a100"][1] == "job 41 off by +60 %"
    assert [r.gpu_type for r in refitter.refit_due(CLUSTER, [41], 300.0)] == ["a100"]
    assert refitter.refit_due(CLUSTER, [41], 400.0) == []  # nothing pending any more
    store.close()

    again, store = _refitter(tmp_path)  # the daemon restarted
    assert again.gate.last_refit_s == {"a100": 300.0}
    assert len(store.refit_observations("a100", 50)) == 1
    # The same file read again after the restart is weighed once more against the refitted
    # estimate; a new job far off the refitted estimate waits for the rate limit.
    again.observe(42, "gpt-760m", 64, (est,), Measurement("a100x4:s1", 3.0 * t, 8),
                  measured_json("cell=a100x4:s1 plan=[dp4tp1] mb=4 remat=1", 3.0 * t, job_id="42"),
                  CLUSTER, 500.0)
    assert "a100" in again.gate.pending and again.refit_due(CLUSTER, [41, 42], 600.0) == []
    assert len(store.refit_observations("a100", 50)) == 2
    assert [r.gpu_type for r in again.refit_due(CLUSTER, [41, 42], 900.0)] == ["a100"]


def test_a_model_files_observations_are_scored_from_what_was_read_never_the_path(tmp_path, caplog):
    """The daemon runs as root: a refit that reopened a stored observation's model path
    would read whatever the path names by then (a link to a root-only file)."""
    import logging
    import os
    model = tmp_path / "m.yaml"
    model.write_text("hidden: 1024\nlayers: 8\nheads: 16\nsequence: 512\nvocab: 32000\n")
    refitter, store = _refitter(tmp_path)
    est = estimate_cell(JobSpec(str(model), 64), Cell("a100", 4, 4, 1), CLUSTER)
    text = measured_json("cell=a100x4:s1 plan=[dp4tp1] mb=4 remat=1", 1.0)
    t = est.iteration_time_s
    refitter.observe(41, str(model), 64, (est,), Measurement("a100x4:s1", 1.6 * t, 8), text, CLUSTER, 100.0,
                     model.read_text())
    secret = tmp_path / "secret"
    secret.write_text("password: hunter2\n")
    os.chmod(secret, 0o600)
    model.unlink()
    model.symlink_to(secret)
    with caplog.at_level(logging.INFO):
        (result,) = refitter.refit_due(CLUSTER, [41], 800.0)
    assert result.observations == 1 and "hunter2" not in caplog.text
    # One stored before the text was kept (the path only) is left out, not reopened.
    (row,) = store.refit_observations("a100", 50)
    store.put_refit_observation(41, "old", "a100", {k: v for k, v in row.items() if k != "model_text"}, 900.0, 50)
    assert len(store.refit_observations("a100", 50)) == 2
    refitter.gate = refitter.gate.note("a100", "41", 0.6, 0.1)
    caplog.clear()
    with caplog.at_level(logging.INFO):
        refitter.refit_due(CLUSTER, [41], 2000.0)
    (line,) = [r.getMessage() for r in caplog.records if "efficiency_refit" in r.getMessage()]
    assert "observations=1 " in line and "hunter2" not in caplog.text


def test_a_type_keeps_its_newest_observations(tmp_path):
    _, store = _refitter(tmp_path)
    for i in range(8):
        store.put_refit_observation(i, "cell=a100x4:s1", "a100", {"i": i}, float(i), keep=5)
    store.put_refit_observation(3, "cell=v100x4:s1", "v100", {"i": 3}, 3.0, keep=5)
    assert [r["i"] for r in store.refit_observations("a100", 50)] == [7, 6, 5, 4, 3]
    assert [r["i"] for r in store.refit_observations("v100", 50)] == [3]


TRAINER = "#!/bin/bash\n#ELASTIC global_batch=64 iterations=100000\nsleep 1000\n"


def test_daemon_writes_a_refit_when_a_running_job_is_far_off_its_estimate(tmp_path, caplog):
    plan = "cell=a100x4:s1 plan=[dp4tp1] mb=4 remat=1"
    job = SlurmJob(41, "alice", "train", "RUNNING", partition="a100", comment="elastic model=gpt-760m",
                   admin_comment=f"requested=any {plan} why=started",
                   gpus_per_node=4, granted_gpus_per_node=(4,), granted_gpu_type="a100", nodes=("a100-1",),
                   node_count=1, submit_time_s=int(time.time()) - 60, start_time_s=int(time.time()) - 60,
                   priority=1, requeue=True)
    nodes = [SlurmNode("a100-1", "mixed", partitions=("a100",), features=("a100",),
                       gres=(Gres("gpu", "a100", 4),), gres_used=(Gres("gpu", "a100", 4),))]
    cfg = resolve({"state_db": str(tmp_path / "state.db"), "checkpoint_root": str(tmp_path),
                   "profile_db": str(tmp_path / "profile.db"), "forecast_every_s": 0}, {}, {})
    daemon = Daemon(cfg, FakeSlurm([job], nodes, TRAINER), Store(cfg.state_db), out=lambda line: None)
    cell = Cell("a100", 4, 4, 1)
    stages = (StagePlan(0, load_model("gpt-760m").num_layers, 4, 1),)
    estimated_s = score_plan(JobSpec("gpt-760m", 64), cell, CLUSTER, stages, 4, True).iteration_time_s
    (tmp_path / "41").mkdir()
    (tmp_path / "41" / MEASURED_FILE).write_text(measured_json(plan, 1.4 * estimated_s))

    with caplog.at_level("INFO", logger="slurm_ext.refit"):
        daemon.round()
    (line,) = [r.getMessage() for r in caplog.records if "event=efficiency_refit " in r.getMessage() + " "]
    assert "gpu_type=a100 observations=1" in line and 'trigger="job 41 off by +40 %"' in line
    refitted = load_profile_view(cfg.profile_db).efficiencies["a100"]
    assert refitted.matmul_frac < START.matmul_frac
    # The estimator now takes the type's parameters from the store: closer to the measurement.
    after_s = score_plan(JobSpec("gpt-760m", 64), cell, CLUSTER, stages, 4, True,
                         EstimateOptions(profile_db=cfg.profile_db)).iteration_time_s
    assert estimated_s < after_s < 1.4 * estimated_s

    caplog.clear()
    with caplog.at_level("INFO", logger="slurm_ext.refit"):
        daemon.round()  # the same measurement again: nothing new to fit
    assert not [r for r in caplog.records if "efficiency_refit" in r.getMessage()]
