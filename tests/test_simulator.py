"""The trace simulator: known answers on hand-made traces, restarts, unrunnable jobs, determinism."""

from dataclasses import replace
import json
import re
from pathlib import Path

import pytest

from estimator.cells import Cell
from estimator.cluster import cluster_from_dict
from estimator.jobs import JobSpec
from policy.cells_ilp import CellsIlpPolicy
from policy.fcfs import FcfsPolicy
from policy.interface import Assignment, Decision, JobDecision
from policy.measured import MeasuredPoint, MeasuredTable, load_measured, measured_estimates
from policy.placement import FreeGpus
import random

from policy.interface import NodeView
from policy.report import (CONTRACT_KEYS, TIMING_KEYS, markdown_table, report_json, summarize, time_weighted,
                           write_plots)
from policy.simulator import EstimateCache, FreeTally, RestartCosts, SimConfig, TimelinePoint, simulate
from policy.trace import TraceJob
from slurm_ext.cli import main

COSTS = RestartCosts(launch_s=30.0, checkpoint_resume_s=60.0, tuning_full_s=600.0, tuning_pruned_s=150.0)
CONFIG = SimConfig(round_s=300.0, costs=COSTS, plan_search="own")  # the known answers charge FCFS a full search
T4, T2 = 2.0, 3.5  # measured seconds per iteration on 4 and 2 a100s


def _table():
    return MeasuredTable((
        MeasuredPoint("gpt-1.3b", 128, "a100", 1, 4, T4),
        MeasuredPoint("gpt-1.3b", 128, "a100", 1, 2, T2),
        MeasuredPoint("gpt-1.3b", 128, "a100", 1, 1, None),  # out of memory
    ))


def _cluster(nodes=1):
    return cluster_from_dict({"name": "tiny", "node_groups": [{"gpu_type": "a100", "nodes": nodes, "gpus_per_node": 4}]})


def _cache(cluster, table, oracle=False):
    return EstimateCache(cluster, table, oracle, lambda spec, space: measured_estimates(spec, cluster, table, space))


def _job(job_id, submit_s, gpus, iterations=100, model="gpt-1.3b"):
    return TraceJob(job_id, submit_s, JobSpec(model, 128, gpus, "a100"), iterations, 1.0, None)


def _run(policy, jobs, cluster=None, table=None, config=CONFIG):
    cluster, table = cluster or _cluster(), table or _table()
    return simulate(policy, tuple(jobs), cluster, table, config, _cache(cluster, table, config.oracle))


def test_fcfs_known_answer_on_a_tiny_trace():
    jobs = [_job("a", 0.0, 4), _job("b", 10.0, 4), _job("c", 20.0, 2)]
    result = _run(FcfsPolicy(), jobs)
    out = {o.job_id: o for o in result.jobs}
    first_run_s = COSTS.launch_s + COSTS.tuning_full_s
    a_end = first_run_s + 100 * T4
    b_end = a_end + first_run_s + 100 * T4
    # c asks for 2 GPUs but waits behind b: FIFO per type, no backfilling.
    c_end = b_end + first_run_s + 100 * T2
    assert out["a"].finish_s == pytest.approx(a_end)
    assert out["b"].first_start_s == pytest.approx(a_end) and out["b"].finish_s == pytest.approx(b_end)
    assert out["c"].first_start_s == pytest.approx(b_end) and out["c"].finish_s == pytest.approx(c_end)
    summary = summarize(result)
    assert summary["finished"] == 3 and summary["unfinished"] == 0
    assert summary["avg_jct_s"] == pytest.approx(round((a_end + b_end - 10 + c_end - 20) / 3, 3))
    assert summary["makespan_s"] == pytest.approx(c_end)
    assert summary["restarts_per_job"] == 0
    assert summary["avg_throughput"] == pytest.approx(3 * 100 * 128 / c_end, rel=1e-3)


def test_throughput_counts_a_job_left_running_over_the_time_it_ran():
    """A short job finishes, a long one runs to the horizon: the long job's samples count
    over the whole replay, not over the short job's makespan (that read 1000 times the
    cluster's peak)."""
    jobs = [_job("short", 0.0, 4, iterations=10), _job("long", 0.0, 4, iterations=10_000_000)]
    horizon_s = 5 * 86400.0
    result = _run(FcfsPolicy(), jobs, _cluster(nodes=2), config=replace(CONFIG, max_time_s=horizon_s))
    summary = summarize(result)
    assert summary["finished"] == 1 and summary["left_unfinished"]
    peak = 2 * 128 / T4  # both jobs on 4 a100s at once
    assert summary["avg_throughput"] <= peak
    busy_s = result.run_end_s - result.start_s
    assert summary["avg_throughput"] == pytest.approx(result.samples_done / busy_s, abs=0.01)
    assert result.run_end_s >= horizon_s


def test_jobs_listed_out_of_submission_order_are_replayed_in_it():
    """The earlier job listed second is admitted at its submission, not after the later one
    (it was charged the gap as queueing, and the makespan counted from the wrong job)."""
    jobs = [_job("late", 5000.0, 4, iterations=10), _job("early", 0.0, 4, iterations=10)]
    out = {o.job_id: o for o in _run(FcfsPolicy(), jobs, _cluster(nodes=2)).jobs}
    in_order = {o.job_id: o for o in _run(FcfsPolicy(), jobs[::-1], _cluster(nodes=2)).jobs}
    assert out == in_order
    assert out["early"].first_start_s < 1000.0 and out["late"].first_start_s >= 5000.0


def test_backfilling_fcfs_lets_the_small_job_through():
    jobs = [_job("a", 0.0, 2), _job("b", 10.0, 4), _job("c", 20.0, 2)]
    out = {o.job_id: o for o in _run(FcfsPolicy(strict_fifo=False), jobs).jobs}
    assert out["c"].first_start_s == pytest.approx(20.0)
    assert out["b"].first_start_s > out["c"].first_start_s


def test_a_job_no_cell_can_run_is_reported_not_lost():
    jobs = [_job("ok", 0.0, 4), _job("huge", 5.0, 8, model="gpt-15b"), _job("oom", 6.0, 1)]
    result = _run(FcfsPolicy(), jobs)
    out = {o.job_id: o for o in result.jobs}
    assert len(result.jobs) == 3
    assert out["huge"].status == "never_runnable" and "no runnable Cell" in out["huge"].reason
    summary = summarize(result)
    assert summary["unfinished"] == 1 + (out["oom"].status != "finished")
    assert [n["job_id"] for n in summary["never_runnable"]] == ["huge"]
    # the 1-GPU request failed when measured, but 2 GPUs (its N·2 Cell) can run: not "never"
    assert out["oom"].status == "unfinished" and out["oom"].first_start_s is None


class _Resizer:
    """Starts every job on 4 GPUs, then shrinks it to 2 at its first round."""

    name = "resizer"
    plan_tuning = "pruned"

    def decide(self, snapshot):
        free = FreeGpus.from_snapshot(snapshot)
        out = []
        for job in snapshot.jobs:
            if job.state == "pending":
                cell = Cell("a100", 4, 4, 1)
            elif snapshot.trigger == "round" and job.cell.num_gpus == 4:
                free.release(job.assignment.placement)
                cell = Cell("a100", 2, 4, 1)
            else:
                continue
            placement = free.place(cell)
            free.take(placement)
            out.append(JobDecision(job.job_id, Assignment(cell, placement), f"{cell.num_gpus} a100"))
        return Decision(tuple(out))


def _pruned_tuning_s(remaining_run_s: float) -> float:
    """The runtime measures candidates for at most 5 % of the remaining run (and the search)."""
    return min(COSTS.tuning_pruned_s, COSTS.tuning_budget_frac * remaining_run_s)


@pytest.mark.parametrize("iterations", [2000, 600])  # the cap binds; 5 % of the run binds
def test_a_resize_costs_checkpoint_resume_plus_tuning_and_keeps_progress(iterations):
    result = _run(_Resizer(), [_job("a", 0.0, 4, iterations=iterations)])
    (o,) = result.jobs
    start_overhead_s = COSTS.launch_s + _pruned_tuning_s(iterations * T4)
    done_at_round = (CONFIG.round_s - start_overhead_s) / T4
    resume_s = CONFIG.round_s + COSTS.checkpoint_resume_s + _pruned_tuning_s((iterations - done_at_round) * T2)
    assert o.restarts == 1
    assert o.finish_s == pytest.approx(resume_s + (iterations - done_at_round) * T2)


class _Spreader:
    """Puts each pending job on 2 GPUs of its own a100 node, so both nodes end up partly used."""

    name = "spreader"
    plan_tuning = "none"

    def decide(self, snapshot):
        taken = {n for j in snapshot.jobs if j.assignment for n, _ in j.assignment.placement}
        free_nodes = [n.name for n in snapshot.nodes if n.name not in taken]
        out = []
        for job in snapshot.jobs:
            if job.state == "pending":
                node = free_nodes.pop(0)
                out.append(JobDecision(job.job_id, Assignment(Cell("a100", 2, 2, 1), ((node, 2),)), "spread"))
        return Decision(tuple(out))


def test_fragmentation_over_time_known_by_hand():
    # Two 4-GPU nodes. a and b take 2 GPUs on separate nodes: the 4 free GPUs all sit on
    # partly used nodes (1.0). a ends at 30 + 100 x 3.5 = 380 s: its node is whole again,
    # 2 of the 6 free GPUs are on b's node (1/3) until b ends at 30 + 10,000 x 3.5 s.
    result = _run(_Spreader(), [_job("a", 0.0, 2, iterations=100), _job("b", 0.0, 2, iterations=10_000)],
                  cluster=_cluster(nodes=2))
    a_end, b_end = 30 + 100 * T2, 30 + 10_000 * T2
    out = {o.job_id: o for o in result.jobs}
    assert out["a"].finish_s == pytest.approx(a_end) and out["b"].finish_s == pytest.approx(b_end)
    at = {p.time_s: p for p in result.timeline}
    assert at[0.0].fragmentation_frac == 1.0
    assert at[a_end].fragmentation_frac == pytest.approx(1 / 3)  # recorded at the completion itself
    assert at[a_end].free_by_type == (("a100", 6, 2),)
    assert result.timeline[-1].fragmentation_frac == 0.0  # nothing runs: every free GPU is on a whole node
    # the rounds in between (no change of allocation) carry the same values
    assert all(p.fragmentation_frac == 1.0 for p in result.timeline if p.time_s < a_end)
    assert all(p.fragmentation_frac == pytest.approx(1 / 3) for p in result.timeline if a_end <= p.time_s < b_end)
    assert sum(a_end <= p.time_s < b_end for p in result.timeline) > 100
    summary = summarize(result)
    # 1.0 for 380 s, then 1/3 for the rest: time-weighted, not per timeline point.
    expected_avg = (a_end * 1.0 + (b_end - a_end) / 3) / b_end
    assert summary["fragmentation_avg"] == pytest.approx(round(expected_avg, 4))
    # 1.0 holds for about 1 % of the time, so the p95 is the 1/3 that holds for the rest.
    assert summary["fragmentation_p95"] == pytest.approx(round(1 / 3, 4))
    assert summary["fragmentation_avg_by_type"] == {"a100": summary["fragmentation_avg"]}


def test_cluster_fragmentation_pools_the_free_gpus_of_every_type():
    point = TimelinePoint(0.0, 0.0, 0, 2, (("a100", 6), ("a40", 2)), (("a100", 4, 3), ("a40", 2, 0)))
    assert point.fragmentation_frac == pytest.approx(3 / 6)  # not the mean of 0.75 and 0
    assert point.fragmentation_frac_of("a100") == 0.75
    assert point.fragmentation_frac_of("a40") == 0.0 and point.fragmentation_frac_of("v100") == 0.0


def test_free_tally_matches_the_placement_modules_fragmentation():
    nodes = tuple(NodeView(f"a100-{i}", "a100", 4) for i in range(3)) + \
        tuple(NodeView(f"v100-{i}", "v100", 16) for i in range(2)) + (NodeView("a40-0", "a40", 2, unmanaged_gpus=1),)
    tally = FreeTally(nodes)
    reference = FreeGpus([(n.name, n.gpu_type, n.managed_gpus) for n in nodes])
    rng = random.Random(7)
    held = []
    for _ in range(300):
        if held and rng.random() < 0.45:
            placement = held.pop(rng.randrange(len(held)))
            tally.release(placement)
            reference.release(placement)
        else:
            name = rng.choice([n for n in reference.free if reference.free[n] > 0] or [None])
            if name is None:
                continue
            placement = ((name, rng.randint(1, reference.free[name])),)
            tally.take(placement)
            reference.take(placement)
            held.append(placement)
        assert tally.by_type() == tuple((f.gpu_type, f.free_gpus, f.free_on_partial_nodes)
                                        for f in reference.fragmentation())


def test_time_weighted_average_and_percentile():
    # 0.2 for 10 s, 0.9 for 1 s, 0.5 for 9 s; the last value (0.0 at t=20) holds for no time.
    times, values = [0.0, 10.0, 11.0, 20.0], [0.2, 0.9, 0.5, 0.0]
    avg, p95 = time_weighted(times, values, end_s=20.0)
    assert avg == pytest.approx((0.2 * 10 + 0.9 * 1 + 0.5 * 9) / 20)
    assert p95 == 0.5  # at or below 0.5 for 19 of the 20 s: exactly 95 %
    assert time_weighted(times, values, end_s=20.0, q=96)[1] == 0.9
    assert time_weighted(times, values, end_s=20.0, q=50)[1] == 0.2
    assert time_weighted([], [], 5.0) == (None, None)


def test_nearest_measured_layout_gives_the_rate():
    table = MeasuredTable((MeasuredPoint("gpt-1.3b", 128, "a100", 2, 2, 5.0),))
    assert table.iter_time_s("gpt-1.3b", 128, "a100", 1, 4) == 5.0  # 4 GPUs: only 2x2 measured
    assert table.iter_time_s("gpt-1.3b", 128, "a100", 1, 8) is None  # no 8-GPU measurement
    result = _run(FcfsPolicy(), [_job("a", 0.0, 4, iterations=10)], table=table)
    assert result.jobs[0].finish_s == pytest.approx(COSTS.launch_s + COSTS.tuning_full_s + 10 * 5.0)


def test_a_policy_that_never_starts_anything_ends_the_run_with_jobs_unfinished():
    class Idle:
        name = "idle"

        def decide(self, snapshot):
            return Decision(tuple(JobDecision(j.job_id, None, "idle policy") for j in snapshot.jobs))

    result = _run(Idle(), [_job("a", 0.0, 4), _job("b", 1.0, 2)])
    assert [o.status for o in result.jobs] == ["unfinished", "unfinished"]
    assert all(o.reason == "idle policy" for o in result.jobs)


def test_an_unmeasured_assignment_leaves_the_job_pending_and_the_run_ends():
    class Stubborn:
        """Always puts every job on one a100, which the table says ran out of memory."""

        name = "stubborn"

        def decide(self, snapshot):
            out = []
            for i, job in enumerate(snapshot.jobs):
                out.append(JobDecision(job.job_id, Assignment(Cell("a100", 1, 4, 1), ((f"a100-{i + 1}", 1),))))
            return Decision(tuple(out))

    result = _run(Stubborn(), [_job("a", 0.0, 2), _job("b", 1.0, 2)], cluster=_cluster(nodes=2))
    assert [o.status for o in result.jobs] == ["unfinished", "unfinished"]
    assert all(o.first_start_s is None and o.iterations_done == 0 for o in result.jobs)


def test_oracle_shows_measured_times_to_policies():
    cluster, table = _cluster(), load_measured()
    spec = JobSpec("gpt-1.3b", 128, 4, "a100")
    fake = lambda s, space: tuple(e.__class__(e.cell, (), 1, 99.0, 1.0, 1.0, True, "")  # noqa: E731
                                  for e in measured_estimates(s, cluster, table))
    plain = EstimateCache(cluster, table, False, fake).get(spec)[0]
    oracle = EstimateCache(cluster, table, True, fake).get(spec)[0]
    four = Cell("a100", 4, 4, 1)
    assert next(e for e in plain if e.cell == four).iteration_time_s == 99.0
    assert next(e for e in oracle if e.cell == four).iteration_time_s == table.iter_time_s("gpt-1.3b", 128, "a100", 1, 4)
    eight = next(e for e in plain if e.cell.num_gpus == 8)
    assert not eight.feasible and "no measured rate" in eight.reason  # a100 2x4 is not measured


def test_same_inputs_same_report(tmp_path):
    jobs = [_job(str(i), 50.0 * i, [1, 2, 4][i % 3] if i % 3 else 4, iterations=50 + 7 * i) for i in range(12)]
    cluster = _cluster(nodes=2)
    a = summarize(_run(FcfsPolicy(), jobs, cluster))
    b = summarize(_run(FcfsPolicy(), jobs, cluster))
    for key in TIMING_KEYS:
        a.pop(key), b.pop(key)
    assert json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)


def test_report_table_and_plots(tmp_path):
    result = _run(FcfsPolicy(), [_job("a", 0.0, 4), _job("b", 10.0, 2)])
    report = report_json("t.csv", "tiny", 0, {"fcfs": summarize(result, 0.5)}, offered_load=0.5)
    assert set(CONTRACT_KEYS) <= set(report["policies"]["fcfs"])
    table = markdown_table(report)
    assert table.splitlines()[2].startswith("| fcfs | 2 | 2 | 0 |")
    files = write_plots([result], tmp_path)
    assert {f.name for f in files} == {"jct_cdf.png", "throughput.png", "queue_length.png", "fragmentation.png",
                                       "gpu_use.png"}
    assert "| fragmentation avg | fragmentation p95 |" in table
    assert all(f.stat().st_size > 1000 for f in files)


TRACE = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "traces" / "pai_1day_synthetic_sizes.csv"


@pytest.mark.skipif(not TRACE.exists(), reason="shared trace data absent")
def test_cli_writes_the_contract_json_and_is_deterministic(tmp_path, capsys):
    args = ["simulate", "--trace", str(TRACE), "--cluster", "lab", "--policy", "fcfs", "--seed", "3",
            "--density", "0.1", "--quiet"]
    assert main(args + ["--json", str(tmp_path / "a.json"), "--markdown", str(tmp_path / "t.md")]) == 0
    out = capsys.readouterr().out
    assert out.startswith("| policy |") and out == (tmp_path / "t.md").read_text()
    assert main(args + ["--json", str(tmp_path / "b.json")]) == 0
    a, b = (json.loads((tmp_path / f).read_text()) for f in ("a.json", "b.json"))
    assert {"trace", "cluster", "seed", "policies"} <= set(a) and a["cluster"] == "lab"
    assert set(CONTRACT_KEYS) <= set(a["policies"]["fcfs"])
    # The lab has no a40: the jobs that ask for one are named, not silently left waiting.
    assert re.search(r"warning: \d+ of \d+ jobs ask for GPU types lab lacks \(a40: \d+\)", capsys.readouterr().err)
    assert {"fragmentation_avg", "fragmentation_p95", "fragmentation_avg_by_type"} <= set(a["policies"]["fcfs"])
    assert all(0.0 <= a["policies"]["fcfs"][k] <= 1.0 for k in ("fragmentation_avg", "fragmentation_p95"))
    for report in (a, b):
        for key in TIMING_KEYS:
            report["policies"]["fcfs"].pop(key)
    assert a == b
    # the lab cluster has no a40: such requests are reported, not dropped
    s = a["policies"]["fcfs"]
    assert s["jobs"] == s["finished"] + s["unfinished"]


def test_cli_errors_are_one_line(tmp_path, capsys):
    assert main(["simulate", "--trace", str(tmp_path / "none.csv"), "--cluster", "lab", "--policy", "fcfs"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "none.csv" in err[0]
    assert main(["simulate", "--trace", str(TRACE), "--cluster", "lab", "--policy", "nope"]) == 2
    err = capsys.readouterr().err.strip()
    assert "nope" in err and "fcfs" in err and len(err.splitlines()) == 1


def test_deadline_figures_count_every_job_with_a_deadline():
    """A job left unfinished (or dropped) missed its deadline: it is not left out."""
    from policy.simulator import JobOutcome, SimResult

    spec = JobSpec("gpt-1.3b", 64, 4, "a100")
    jobs = (JobOutcome("met", spec, 0.0, 10, "finished", 0.0, 50.0, 0, 10.0, deadline_s=100.0),
            JobOutcome("late", spec, 0.0, 10, "finished", 0.0, 150.0, 0, 10.0, deadline_s=100.0),
            JobOutcome("dropped", spec, 0.0, 10, "unfinished", None, None, 0, 0.0, deadline_s=100.0),
            JobOutcome("none", spec, 0.0, 10, "finished", 0.0, 80.0, 0, 10.0))
    summary = summarize(SimResult("p", jobs, (), (1.0,), 100.0, 0.0, 150.0))
    assert summary["deadline_jobs"] == 3 and summary["deadlines_missed_unfinished"] == 1
    assert summary["deadlines_met_frac"] == pytest.approx(1 / 3, abs=1e-4)


def test_forecasts_at_arrival_match_what_happens_when_estimates_are_the_measurements():
    """FCFS on estimates equal to the measurements and a start costing the same first time
    or later: each job's forecast at its arrival is what then happens."""
    costs = RestartCosts(launch_s=60.0, checkpoint_resume_s=60.0, tuning_full_s=600.0)
    config = SimConfig(round_s=300.0, costs=costs, forecast_every_jobs=1)
    jobs = [_job("a", 0.0, 4), _job("b", 10.0, 4), _job("c", 20.0, 2)]
    result = _run(FcfsPolicy(), jobs, config=config)
    for o in result.jobs:
        assert o.forecast_start_s == pytest.approx(o.first_start_s) and o.forecast_end_s == pytest.approx(o.finish_s)
    summary = summarize(result)
    assert summary["forecast_jobs"] == 3 and summary["forecast_end_abs_err_s"] == {"p50": 0.0, "p90": 0.0}
    # Every other job: only a and c are forecast.
    every_other = _run(FcfsPolicy(), jobs, config=SimConfig(round_s=300.0, costs=costs, forecast_every_jobs=2))
    assert [o.job_id for o in every_other.jobs if o.forecast_start_s is not None] == ["a", "c"]
    assert "forecast_jobs" not in summarize(_run(FcfsPolicy(), jobs, config=CONFIG))


def test_forecasts_charge_each_start_what_the_replay_charges():
    """A first start costs the launch, not a checkpoint and resume (30 s against 60 s here),
    and the plan search under cells-ilp's budget rule (a share of the run left): with
    estimates equal to the measurements the forecast at arrival is exact."""
    config = SimConfig(round_s=300.0, costs=COSTS, forecast_every_jobs=1)
    jobs = [_job("a", 0.0, 4), _job("b", 10.0, 4, iterations=20), _job("c", 20.0, 2)]
    for policy in (FcfsPolicy(), CellsIlpPolicy(count_changes=False, type_changes=False)):
        result = _run(policy, jobs, config=config)
        for o in result.jobs:
            assert o.forecast_start_s == pytest.approx(o.first_start_s)
            assert o.forecast_end_s == pytest.approx(o.finish_s), (policy.name, o.job_id)


def test_one_plan_search_charge_for_every_policy_when_asked():
    """FCFS pays a full plan search (600 s here) on a new Cell under its own charge; with
    ``plan_search`` set, every policy pays that mode instead: none saves exactly the 600 s;
    equal (the default) charges the runtime's pruned search, as crius pays."""
    jobs = [_job("a", 0.0, 4)]
    own = _run(FcfsPolicy(), jobs).jobs[0]
    none = _run(FcfsPolicy(), jobs, config=replace(CONFIG, plan_search="none")).jobs[0]
    pruned = _run(FcfsPolicy(), jobs, config=replace(CONFIG, plan_search="pruned")).jobs[0]
    equal = _run(FcfsPolicy(), jobs, config=replace(CONFIG, plan_search="equal")).jobs[0]
    assert SimConfig().plan_search == "equal"
    assert own.finish_s - none.finish_s == pytest.approx(600.0)
    run_s = none.finish_s - none.first_start_s - COSTS.launch_s
    assert pruned.finish_s - none.finish_s == pytest.approx(min(150.0, 0.05 * run_s))
    assert equal.finish_s == pytest.approx(pruned.finish_s)


def test_a_policys_own_extra_start_cost_is_charged_on_every_start():
    """``extra_start_s`` declared by a policy is added to each (re)start, beside the costs
    every policy pays, and reported with its reason."""
    from policy.simulator import start_costs

    class Slow(FcfsPolicy):
        name = "fcfs-slow"
        extra_start_s = 45.0
        extra_start_reason = "a profiling run per start"

    jobs = [_job("a", 0.0, 4)]
    base = _run(FcfsPolicy(), jobs).jobs[0]
    slow = _run(Slow(), jobs).jobs[0]
    assert slow.finish_s - base.finish_s == pytest.approx(45.0)
    costs = start_costs(Slow(), CONFIG)
    assert costs["extra_start_s"] == 45.0 and costs["extra_start_reason"] == "a profiling run per start"
    assert start_costs(FcfsPolicy(), SimConfig())["plan_search"] == "pruned"


def test_a_policy_with_rounds_of_its_own_is_woken_at_them():
    """A policy that declares ``round_s`` is called at its own rounds, not the config's."""
    calls = []

    class Every60(FcfsPolicy):
        name = "fcfs-60"
        round_s = 60.0

        def decide(self, snapshot):
            calls.append((snapshot.now_s, snapshot.trigger, snapshot.round_s))
            return super().decide(snapshot)

    _run(Every60(), [_job("a", 0.0, 4, iterations=400)])
    rounds = [t for t, trigger, _ in calls if trigger == "round"]
    assert rounds[:3] == [60.0, 120.0, 180.0]
    assert all(r == 60.0 for _, _, r in calls)


def test_restart_costs_are_the_medians_the_runtime_reported():
    """``RestartCosts.from_reports``: launch from first runs' start-up, resume from later
    runs' start-up plus the save at exit, tuning from runs that tuned; the defaults where
    nothing was measured."""
    from estimator.contract import RunnerReport

    def report(**fields):
        return RunnerReport.from_text(json.dumps(fields))

    reports = [report(restart_count=0, startup_s=40.0, tuning_s=20.0, candidates_measured=5),
               report(restart_count=0, startup_s=60.0, tuning_s=0.0, candidates_measured=0),
               report(restart_count=1, startup_s=30.0, final_save_s=5.0),
               report(restart_count=2, startup_s=50.0, final_save_s=7.0),
               report(restart_count=3, startup_s=35.0, final_save_s=9.0)]
    costs = RestartCosts.from_reports(reports, COSTS)
    assert costs.launch_s == 50.0
    assert costs.checkpoint_resume_s == 35.0 + 7.0
    assert costs.tuning_pruned_s == 20.0 and costs.tuning_full_s == COSTS.tuning_full_s
    assert RestartCosts.from_reports([], COSTS) == COSTS


def test_estimates_count_the_memory_of_the_program_the_rates_came_from():
    """The shipped table ran Alpa, whose runtime keeps every micro-batch's layer inputs
    until the backward (GPipe): gpt-1.3b at batch 256 does not fit one 40 GB a100 there,
    while the runner's program, with fewer micro-batches in flight, does. The memory an
    estimate counts is the program's whose rates the simulator replays (Alpa's by
    default); a policy estimating one against the other's rates would start jobs that
    could not run, or refuse ones that could."""
    from estimator.cluster import load_cluster
    cluster = load_cluster("crius-1280")
    spec = JobSpec("gpt-1.3b", 256, 1, "a100")

    def one_gpu(program):
        cells = EstimateCache(cluster, _table(), program=program)._analytic(spec, "dp-only")
        return next(e for e in cells if e.cell.gpu_type == "a100" and e.cell.num_gpus == 1)

    alpa, runner = one_gpu("alpa"), one_gpu("runner")
    assert EstimateCache(cluster, _table()).program == "alpa"
    assert not alpa.feasible and runner.feasible and alpa.peak_memory_gb > runner.peak_memory_gb


def test_the_timeline_counts_no_throughput_of_a_job_still_starting():
    """Launch and plan search (630 s) hold the GPUs with no progress: the throughput plot
    had shown the job's full rate from its start (4× the samples it made)."""
    result = _run(FcfsPolicy(), [_job("a", 0.0, 4, iterations=1000)])
    start_s = COSTS.launch_s + COSTS.tuning_full_s
    starting = [p for p in result.timeline if p.running_jobs and p.time_s < start_s]
    training = [p for p in result.timeline if p.running_jobs and p.time_s >= start_s]
    assert starting and all(p.samples_per_s == 0.0 for p in starting)
    assert training and all(p.samples_per_s == pytest.approx(128 / T4) for p in training)


def test_the_timeline_shows_progress_from_the_moment_a_start_ends():
    """Between events nothing changes but a start's end (launch, plan search): the timeline
    has a point there, so the samples under it are the samples done."""
    from policy.report import time_weighted
    r = _run(FcfsPolicy(), [_job("a", 0.0, 4, iterations=1800)])
    assert any(p.samples_per_s > 0 for p in r.timeline)
    times, rates = [p.time_s for p in r.timeline], [p.samples_per_s for p in r.timeline]
    average, _ = time_weighted(times, rates, r.end_s)
    assert average * (r.end_s - times[0]) == pytest.approx(r.samples_done)
