"""Crius, crius-ddl, Gavel (published and greedy), ElasticFlow and Sia on tiny hand-made snapshots
with known answers (Gavel's own rounds: tests/test_gavel.py)."""

import copy
import itertools
from dataclasses import replace

import pytest

from estimator.cells import Cell, CellEstimate
from estimator.jobs import JobSpec
from policy.crius import CriusDdlPolicy, CriusPolicy, CriusState
from policy.elasticflow import ElasticFlowPolicy
from policy.gavel import GavelPolicy
from policy.gavel_greedy import GavelGreedyPolicy
from policy.interface import (
    DROPPED_PREFIX, PENDING, RUNNING, TRIGGER_ARRIVAL, TRIGGER_COMPLETION, TRIGGER_ROUND, Assignment, JobView, NodeView, Snapshot,
    validate_decision,
)
from policy.sia import SiaPolicy

NODE_SIZE = {"a100": 4, "v100": 4}
BATCH = 64


def est(gpu_type, n, rate, stages=1, feasible=True):
    """A synthetic estimate: ``rate`` samples/s for a global batch of BATCH."""
    cell = Cell(gpu_type, n, min(n, NODE_SIZE[gpu_type]), stages)
    return CellEstimate(cell, (), 4 * stages, BATCH / rate if rate else 0.0, rate, 1.0, feasible,
                        "" if feasible else "out of memory")


def job(job_id, rates, *, gpus, gpu_type="a100", submit=0.0, running=None, deadline=None,
        iterations=1000, done=0.0, dp_rates=None):
    """A job; ``rates`` maps (type, count) → samples/s; ``running`` is (type, count, placement)."""
    ests = tuple(est(t, n, r) for (t, n), r in sorted(rates.items()))
    dp = tuple(est(t, n, r) for (t, n), r in sorted((dp_rates or rates).items()))
    assignment = None
    if running is not None:
        t, n, placement = running
        assignment = Assignment(est(t, n, 1.0).cell, placement)
    return JobView(job_id, "u", JobSpec("gpt-1.3b", BATCH, gpus, gpu_type), submit,
                   RUNNING if running else PENDING, assignment, done, iterations, 0, submit,
                   deadline, False, ests, dp)


def snap(nodes, jobs, now=100.0, trigger=TRIGGER_ARRIVAL, state=None, restart_cost_s=0.0):
    return Snapshot(now, tuple(nodes), tuple(jobs), trigger, 300.0, restart_cost_s, state)


def a100(k, unmanaged=0):
    return NodeView(f"a100-{k}", "a100", 4, unmanaged)


def v100(k):
    return NodeView(f"v100-{k}", "v100", 4)


def run(policy, s):
    d = policy.decide(s)
    validate_decision(s, d)
    return d


def cell_of(d, job_id):
    a = d.for_job(job_id).assignment
    return None if a is None else (a.cell.gpu_type, a.cell.num_gpus)


def final_cell(s, d, job_id):
    jd = d.for_job(job_id)
    if jd is None:
        a = s.job(job_id).assignment
        return None if a is None else (a.cell.gpu_type, a.cell.num_gpus)
    return cell_of(d, job_id)


# ---- gavel-greedy (Arena's restatement of Gavel) ---------------------------------------

def test_gavel_greedy_moves_a_running_job_to_the_faster_type_when_it_is_free():
    j = job("a", {("v100", 2): 10.0, ("a100", 2): 20.0}, gpus=2, gpu_type="v100",
            running=("v100", 2, (("v100-1", 2),)))
    s = snap([a100(1), v100(1)], [j], trigger="round")
    assert final_cell(s, run(GavelGreedyPolicy(), s), "a") == ("a100", 2)


def test_gavel_greedy_keeps_the_requested_count_and_admits_on_the_fastest_free_type():
    j = job("a", {("v100", 2): 10.0, ("a100", 2): 20.0, ("a100", 4): 60.0}, gpus=2, gpu_type="v100")
    s = snap([a100(1), v100(1)], [j])
    assert cell_of(run(GavelGreedyPolicy(), s), "a") == ("a100", 2)


def test_gavel_greedy_moves_a_running_job_away_to_admit_a_blocked_one():
    # a100 is full with job r, which runs almost as fast on v100; p only runs on a100.
    r = job("r", {("a100", 4): 20.0, ("v100", 4): 19.0}, gpus=4, running=("a100", 4, (("a100-1", 4),)))
    p = job("p", {("a100", 4): 30.0}, gpus=4, submit=1.0)
    s = snap([a100(1), v100(1)], [r, p])
    d = run(GavelGreedyPolicy(), s)
    assert (cell_of(d, "r"), cell_of(d, "p")) == (("v100", 4), ("a100", 4))


@pytest.mark.parametrize("cls", [lambda: GavelPolicy(), lambda: GavelGreedyPolicy(), lambda: ElasticFlowPolicy(),
                                 lambda: SiaPolicy(),
                                 lambda: CriusPolicy()])
def test_policies_run_a_job_as_requested_when_the_memory_model_rejects_it(cls):
    # Only a 2-stage plan fits the model on a100×4: no data-parallel Cell is feasible.
    j = job("big", {("a100", 4): 30.0}, gpus=4, dp_rates={})
    j = JobView(**{**j.__dict__, "estimates": (est("a100", 4, 30.0, stages=2),),
                   "dp_only_estimates": (est("a100", 4, 0.0, feasible=False),)})
    s = snap([a100(1), v100(1)], [j])
    assert cell_of(run(cls(), s), "big") == ("a100", 4)
    # Rejected by the memory model everywhere, yet the platform runs the requested Cell.
    j = JobView(**{**j.__dict__, "estimates": (est("a100", 4, 0.0, feasible=False),)})
    s = snap([a100(1), v100(1)], [j])
    assert cell_of(run(cls(), s), "big") == ("a100", 4)


# ---- ElasticFlow -----------------------------------------------------------------------

def test_elasticflow_gives_the_extra_gpu_to_the_larger_marginal_gain():
    # 3 managed GPUs: both jobs get their minimum share (1), the third GPU doubles one job.
    big = job("big", {("a100", 1): 10.0, ("a100", 2): 19.0}, gpus=1)
    small = job("small", {("a100", 1): 10.0, ("a100", 2): 12.0}, gpus=1, submit=1.0)
    s = snap([a100(1, unmanaged=1)], [big, small])
    d = run(ElasticFlowPolicy(), s)
    assert (cell_of(d, "big"), cell_of(d, "small")) == (("a100", 2), ("a100", 1))
    swapped = snap([a100(1, unmanaged=1)], [
        job("big", {("a100", 1): 10.0, ("a100", 2): 12.0}, gpus=1),
        job("small", {("a100", 1): 10.0, ("a100", 2): 19.0}, gpus=1, submit=1.0)])
    d = run(ElasticFlowPolicy(), swapped)
    assert (cell_of(d, "big"), cell_of(d, "small")) == (("a100", 1), ("a100", 2))


def test_elasticflow_never_changes_the_requested_type():
    j = job("a", {("v100", 1): 1.0, ("a100", 1): 50.0}, gpus=1, gpu_type="v100")
    s = snap([a100(1), v100(1)], [j])
    assert cell_of(run(ElasticFlowPolicy(), s), "a")[0] == "v100"


def test_elasticflow_admission_passes_over_a_job_that_does_not_fit():
    """ElasticFlow admits the later job that fits; Arena's restatement (blocking) does not."""
    first = job("first", {("a100", 8): 10.0}, gpus=8)  # minimum share 8 > 4 GPUs
    later = job("later", {("a100", 1): 10.0}, gpus=1, submit=1.0)
    s = snap([a100(1)], [first, later])
    d = run(ElasticFlowPolicy(), s)
    assert final_cell(s, d, "first") is None and final_cell(s, d, "later") == ("a100", 1)
    assert "minimum share 8" in d.for_job("first").reason
    d = run(ElasticFlowPolicy(blocking=True), s)  # 8 a100 never fit here: it blocks nobody
    assert final_cell(s, d, "first") is None and final_cell(s, d, "later") == ("a100", 1)
    assert "never fits (4 in all)" in d.for_job("first").reason
    s = snap([a100(1), a100(2, unmanaged=4)], [first, later])  # 8 in all, 4 of them busy
    d = run(ElasticFlowPolicy(blocking=True), s)
    assert final_cell(s, d, "first") is None and final_cell(s, d, "later") is None
    assert "minimum share 8 a100 not free" in d.for_job("first").reason


def test_elasticflow_keeps_a_running_count_outside_its_data_parallel_table():
    """A job started elsewhere (another policy, as submitted) on a count whose data-parallel
    estimate is infeasible, past its deadline: its share is what it runs on (rate 0)."""
    j = job("j", {("a100", 1): 10.0, ("a100", 4): 35.0}, gpus=1, running=("a100", 2, (("a100-1", 2),)),
            deadline=50.0)
    s = snap([a100(1)], [j], now=1000.0)
    d = run(ElasticFlowPolicy(deadline_aware=True), s)
    assert final_cell(s, d, "j") == ("a100", 2)


def test_elasticflow_ranks_doublings_by_the_run_time_they_save():
    """The spare GPUs go where they save the most remaining run time per GPU: a fast small
    model gaining 20 samples/s on 100 saves 64,000 × (1/100 − 1/120) = 107 s, a slow one
    gaining 5 on 10 saves 2,133 s; but the slow job with 1 % of its work left saves 21 s."""
    fast = job("fast", {("a100", 2): 100.0, ("a100", 4): 120.0}, gpus=2)
    slow = job("slow", {("a100", 2): 10.0, ("a100", 4): 15.0}, gpus=2, submit=1.0)
    s = snap([a100(1), a100(2, unmanaged=2)], [fast, slow])  # 6 GPUs: 2 + 2, then one doubling
    d = run(ElasticFlowPolicy(), s)
    assert (cell_of(d, "fast"), cell_of(d, "slow")) == (("a100", 2), ("a100", 4))
    nearly_done = job("slow", {("a100", 2): 10.0, ("a100", 4): 15.0}, gpus=2, submit=1.0, done=990.0)
    d = run(ElasticFlowPolicy(), snap([a100(1), a100(2, unmanaged=2)], [fast, nearly_done]))
    assert (cell_of(d, "fast"), cell_of(d, "slow")) == (("a100", 4), ("a100", 2))


# ---- Crius -------------------------------------------------------------------------------

def test_crius_scales_a_running_job_down_to_admit_an_arrival_when_total_normalized_throughput_rises():
    r = job("r", {("a100", 2): 20.0, ("a100", 4): 24.0}, gpus=2, running=("a100", 4, (("a100-1", 4),)))
    p = job("p", {("a100", 2): 10.0}, gpus=2, submit=50.0)
    s = snap([a100(1)], [r, p])
    d = run(CriusPolicy(), s)
    assert (final_cell(s, d, "r"), cell_of(d, "p")) == (("a100", 2), ("a100", 2))
    assert "for job p" in d.for_job("r").reason


def test_crius_does_not_scale_down_when_the_plan_loses_normalized_throughput():
    # r asked for 4: halving it costs 0.79 of its normalized throughput; p, which asked
    # for 4 (reference 100 samples/s), would only run on 2 GPUs at 10 samples/s (0.1).
    r = job("r", {("a100", 2): 5.0, ("a100", 4): 24.0}, gpus=4, running=("a100", 4, (("a100-1", 4),)))
    p = job("p", {("a100", 2): 10.0, ("a100", 4): 100.0}, gpus=4, submit=50.0)
    s = snap([a100(1)], [r, p])
    d = run(CriusPolicy(), s)
    assert final_cell(s, d, "r") == ("a100", 4) and cell_of(d, "p") is None


def test_crius_moves_a_job_to_another_type_to_admit_an_arrival():
    r = job("r", {("a100", 4): 20.0, ("v100", 4): 18.0}, gpus=4, running=("a100", 4, (("a100-1", 4),)))
    p = job("p", {("a100", 4): 40.0}, gpus=4, submit=50.0)
    s = snap([a100(1), v100(1)], [r, p])
    d = run(CriusPolicy(), s)
    assert (final_cell(s, d, "r"), cell_of(d, "p")) == (("v100", 4), ("a100", 4))


def test_crius_starts_the_fastest_feasible_cell_that_fits():
    p = job("p", {("a100", 2): 10.0, ("a100", 4): 16.0, ("v100", 4): 30.0, ("v100", 8): 50.0}, gpus=4)
    s = snap([a100(1), v100(1)], [p])
    assert cell_of(run(CriusPolicy(), s), "p") == ("v100", 4)  # v100×8 does not fit


def test_crius_opportunistic_job_runs_on_idle_gpus_then_yields_to_the_earlier_job():
    holder = job("h", {("a100", 2): 10.0}, gpus=2, running=("a100", 2, (("a100-1", 2),)))
    big = job("big", {("a100", 4): 40.0}, gpus=4, submit=10.0)
    small = job("small", {("a100", 2): 10.0}, gpus=2, submit=20.0)
    s = snap([a100(1)], [holder, big, small])
    d = run(CriusPolicy(), s)
    assert cell_of(d, "big") is None and cell_of(d, "small") == ("a100", 2)  # runs opportunistically
    # h finishes: the GPUs big waits for are free only if small yields its two.
    small_running = job("small", {("a100", 2): 10.0}, gpus=2, submit=20.0,
                        running=("a100", 2, d.for_job("small").assignment.placement))
    s2 = snap([a100(1)], [big, small_running], trigger=TRIGGER_COMPLETION, state=d.policy_state)
    d2 = run(CriusPolicy(), s2)
    assert cell_of(d2, "big") == ("a100", 4) and cell_of(d2, "small") is None
    assert "yielded" in d2.for_job("small").reason


def test_crius_scales_up_a_running_job_on_departure():
    r = job("r", {("a100", 2): 10.0, ("a100", 4): 18.0}, gpus=2, running=("a100", 2, (("a100-1", 2),)))
    s = snap([a100(1)], [r], trigger=TRIGGER_COMPLETION)
    assert final_cell(s, run(CriusPolicy(), s), "r") == ("a100", 4)
    # Not when the restart costs more than the faster Cell saves.
    s = snap([a100(1)], [r], trigger=TRIGGER_COMPLETION, restart_cost_s=1e9)
    assert final_cell(s, run(CriusPolicy(), s), "r") == ("a100", 2)


def test_crius_moves_a_job_back_to_its_fastest_type_when_that_frees_up():
    r = job("r", {("a100", 4): 40.0, ("v100", 4): 20.0}, gpus=4, running=("v100", 4, (("v100-1", 4),)))
    s = snap([a100(1), v100(1)], [r], trigger="round")
    d = run(CriusPolicy(), s)
    assert final_cell(s, d, "r") == ("a100", 4) and "moved back" in d.for_job("r").reason


def test_crius_does_not_scale_up_onto_gpus_a_waiting_job_could_use():
    r = job("r", {("a100", 2): 10.0, ("a100", 4): 18.0}, gpus=2, running=("a100", 2, (("a100-1", 2),)))
    other = job("o", {("a100", 2): 10.0}, gpus=2, running=("a100", 2, (("a100-2", 2),)), submit=1.0)
    big = job("big", {("a100", 4): 40.0}, gpus=4, submit=2.0)  # 2 + 2 free, never 4 on one node
    s = snap([a100(1), a100(2)], [r, other, big], trigger=TRIGGER_COMPLETION)
    d = run(CriusPolicy(), s)
    assert final_cell(s, d, "r") == ("a100", 2) and cell_of(d, "big") is None


def test_crius_searches_again_for_a_job_whose_search_the_shared_budget_cut():
    """Arrivals beyond the decision's plan budget got a search of a plan or none, and were
    recorded as searched: no later arrival or round searched for them again."""
    nodes = [a100(k) for k in range(6)] + [v100(k) for k in range(6)]
    busy = [job(f"r{k}", {(n.gpu_type, 1): 9.5, (n.gpu_type, 2): 10.0}, gpus=2, gpu_type=n.gpu_type, submit=k,
                running=(n.gpu_type, 2, ((n.name, 2),))) for k, n in enumerate(n for n in nodes for _ in range(2))]
    arrivals = [job(f"p{i}", {("a100", 2): 10.0}, gpus=2, submit=1000 + i) for i in range(8)]
    first = run(CriusPolicy(max_plans=40), snap(nodes, busy + arrivals))
    views = [replace(j, assignment=first.for_job(j.job_id).assignment,
                     state=RUNNING if first.for_job(j.job_id).assignment else PENDING) for j in busy + arrivals]

    def started(state):
        d = run(CriusPolicy(max_plans=40), snap(nodes, views, trigger=TRIGGER_ROUND, state=state))
        return [x.job_id for x in d.jobs if x.job_id.startswith("p") and x.reason.startswith("started")]
    assert started(first.policy_state) == started(None) != []


def test_crius_ddl_refuses_a_job_that_cannot_meet_its_deadline():
    # 1000 iterations of BATCH samples at 64 samples/s take 1000 s.
    late = job("late", {("a100", 4): 64.0}, gpus=4, deadline=600.0)
    ok = job("ok", {("a100", 4): 64.0}, gpus=4, deadline=2000.0, submit=1.0)
    s = snap([a100(1), a100(2)], [late, ok], now=0.0)
    d = run(CriusDdlPolicy(), s)
    assert cell_of(d, "late") is None and d.for_job("late").reason.startswith("dropped")
    assert cell_of(d, "ok") == ("a100", 4)
    assert "late" in d.policy_state.dropped
    # The next round says so again (a report's last reason was "" before).
    later = run(CriusDdlPolicy(), replace(s, policy_state=d.policy_state, trigger=TRIGGER_ROUND))
    assert cell_of(later, "late") is None and later.for_job("late").reason.startswith("dropped")
    # Plain crius starts both.
    d = run(CriusPolicy(), s)
    assert cell_of(d, "late") == ("a100", 4) and cell_of(d, "ok") == ("a100", 4)


def test_crius_ddl_lets_a_job_that_is_late_anyway_scale_up_and_move_back():
    """Past reach of its deadline on every Cell, a running job stayed on its slow one with
    the GPUs of a faster one idle: every faster Cell "missed the deadline" too."""
    late = job("r", {("a100", 2): 32.0, ("a100", 4): 64.0}, gpus=2, deadline=500.0, done=10.0,
               running=("a100", 2, (("a100-1", 2),)))
    s = snap([a100(1)], [late], now=0.0, trigger=TRIGGER_COMPLETION)
    assert final_cell(s, run(CriusDdlPolicy(), s), "r") == ("a100", 4)
    away = job("r", {("a100", 4): 64.0, ("v100", 4): 16.0}, gpus=4, deadline=500.0, done=10.0,
               running=("v100", 4, (("v100-1", 4),)))
    s = snap([a100(1), v100(1)], [away], now=0.0, trigger=TRIGGER_ROUND)
    assert final_cell(s, run(CriusDdlPolicy(), s), "r") == ("a100", 4)
    # One that a faster Cell would still bring in on time is scaled up as before.
    s = snap([a100(1)], [replace(late, deadline_s=1500.0)], now=0.0, trigger=TRIGGER_COMPLETION)
    assert final_cell(s, run(CriusDdlPolicy(), s), "r") == ("a100", 4)
    # One that meets its deadline by staying (no restart) is not late: it is not shrunk for
    # a newcomer onto a Cell that, with the restart, would miss it.
    stays = job("r", {("a100", 2): 32.0, ("a100", 4): 64.0}, gpus=4, deadline=150.0, done=900.0,
                running=("a100", 4, (("a100-1", 4),)))
    s = snap([a100(1)], [stays, job("p", {("a100", 2): 32.0}, gpus=2, submit=1.0)], now=0.0,
             trigger=TRIGGER_ARRIVAL, restart_cost_s=60.0)
    assert final_cell(s, run(CriusDdlPolicy(), s), "r") == ("a100", 4)


def test_crius_ddl_charges_a_first_start_no_restart_and_never_drops_a_job_that_ran():
    """A new job whose run fits its deadline with less slack than a restart costs is
    started (it was dropped, though its first start is no checkpoint and resume); a job
    that has run and can no longer meet its deadline runs best effort, not dropped with
    its progress."""
    fresh = job("fresh", {("a100", 4): 64.0}, gpus=4, deadline=1100.0)  # 1000 s of work
    s = snap([a100(1)], [fresh], now=0.0, restart_cost_s=210.0)
    assert cell_of(run(CriusDdlPolicy(), s), "fresh") == ("a100", 4)
    ran = job("ran", {("a100", 4): 64.0}, gpus=4, deadline=700.0, done=100.0)  # 900 s left
    d = run(CriusDdlPolicy(), snap([a100(1)], [ran], now=0.0, restart_cost_s=210.0))
    assert cell_of(d, "ran") == ("a100", 4) and "ran" not in d.policy_state.dropped


def test_crius_ddl_does_not_make_a_job_admitted_for_its_deadline_yield():
    """Opportunistic reclaim suspended later jobs without their deadlines in view: one
    admitted for its deadline was suspended 14 s from its end and then dropped."""
    head = job("head", {("a100", 4): 64.0}, gpus=4)
    later = job("later", {("a100", 4): 64.0}, gpus=4, submit=1.0, deadline=1500.0, done=900.0,
                running=("a100", 4, (("a100-1", 4),)))
    s = snap([a100(1)], [head, later], now=10.0, trigger=TRIGGER_ROUND)
    assert cell_of(run(CriusDdlPolicy(), s), "later") == ("a100", 4)
    assert cell_of(run(CriusPolicy(), s), "later") is None  # plain crius reclaims for its head


def test_crius_ddl_picks_a_cell_that_meets_the_deadline_over_a_faster_one_that_does_not_fit():
    j = job("j", {("a100", 2): 64.0, ("a100", 4): 128.0, ("a100", 1): 16.0}, gpus=2, deadline=1200.0)
    s = snap([a100(1, unmanaged=2)], [j], now=0.0)
    assert cell_of(run(CriusDdlPolicy(), s), "j") == ("a100", 2)  # a100×1 would miss it


# Sia has its own tests: tests/test_sia.py.


# ---- every policy ------------------------------------------------------------------------

POLICIES = [CriusPolicy, CriusDdlPolicy, GavelPolicy, GavelGreedyPolicy, ElasticFlowPolicy, SiaPolicy]


def _busy_snapshot():
    rates = {("a100", 1): 10.0, ("a100", 2): 18.0, ("a100", 4): 30.0, ("a100", 8): 50.0,
             ("v100", 1): 6.0, ("v100", 2): 11.0, ("v100", 4): 20.0}
    jobs = [job("r1", rates, gpus=2, running=("a100", 2, (("a100-1", 2),))),
            job("r2", rates, gpus=4, gpu_type="v100", running=("v100", 4, (("v100-1", 4),)), submit=1.0)]
    jobs += [job(f"p{k}", rates, gpus=[1, 2, 4, 8][k % 4], gpu_type=["a100", "v100"][k % 2],
                 submit=10.0 + k, deadline=5000.0 + 500 * k) for k in range(8)]
    return snap([a100(1), a100(2), v100(1), v100(2)], jobs, trigger=TRIGGER_COMPLETION)


@pytest.mark.parametrize("cls", POLICIES)
def test_every_policy_is_deterministic_valid_and_leaves_its_input_alone(cls):
    s = _busy_snapshot()
    before = copy.deepcopy(s)
    d1, d2 = run(cls(), s), run(cls(), s)
    assert d1 == d2
    assert s == before
    assert any(jd.assignment is not None for jd in d1.jobs if jd.job_id.startswith("p"))


def test_crius_state_round_trips_and_forgets_finished_jobs():
    s = _busy_snapshot()
    d = run(CriusPolicy(), s)
    assert isinstance(d.policy_state, CriusState)
    assert d.policy_state.searched <= {j.job_id for j in s.jobs}


@pytest.mark.parametrize("solvers", [("highs",), ("cbc",), ("highs", "cbc")])
@pytest.mark.parametrize("start", [None, [0, 2]])
def test_binary_program_solvers_agree_with_brute_force(solvers, start):
    from policy.binary_program import solve_binary_program

    weights, values = [3, 4, 5, 2, 6], [4.0, 5.0, 7.0, 3.0, 8.0]
    objective = dict(enumerate(values))
    constraints = [(dict(enumerate(map(float, weights))), "<=", 10.0), ({0: 1.0, 1: 1.0}, "<=", 1.0)]
    best = max((sum(values[i] for i in c), c) for r in range(6) for c in itertools.combinations(range(5), r)
               if sum(weights[i] for i in c) <= 10 and not {0, 1} <= set(c))
    got = solve_binary_program(objective, constraints, 5, True, 2.0, start=start, solvers=solvers)
    assert got.solver == solvers[0] and got.optimal
    assert sum(values[i] for i in got.chosen) == pytest.approx(best[0])


def test_binary_program_without_a_solver_that_answers_is_none():
    from policy.binary_program import solve_binary_program

    infeasible = [({0: 1.0}, ">=", 2.0)]
    assert solve_binary_program({0: 1.0}, infeasible, 1, True, 1.0) is None
    assert solve_binary_program({0: 1.0}, [], 1, True, 1.0, solvers=()) is None
    with pytest.raises(ValueError, match="unknown solver 'no-such-solver'"):
        solve_binary_program({0: 1.0}, [], 1, True, 1.0, solvers=("no-such-solver",))


def test_a_solver_prints_nothing_on_stdout_even_the_first_in_a_process():
    """HiGHS prints its banner from C++ when a process makes its first instance: a fresh
    process, so that first instance is this one. `simulate --json -` needs stdout clean."""
    import subprocess
    import sys

    code = ("from policy.binary_program import quiet_highs, solve_binary_program\n"
            "h = quiet_highs()\n"
            "got = solve_binary_program({0: 1.0, 1: 2.0}, [({0: 1.0, 1: 1.0}, '<=', 1.0)], 2, True, 5.0)\n"
            "print('chosen', got.chosen, got.solver)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout == "chosen (1,) highs\n"


def test_elasticflow_deadline_mode_sizes_the_minimum_share_by_the_deadline():
    # 1000 iterations of BATCH samples: 1 GPU (16/s) takes 4000 s, 2 GPUs (32/s) 2000 s.
    j = job("j", {("a100", 1): 16.0, ("a100", 2): 32.0}, gpus=1, deadline=2500.0)
    other = job("o", {("a100", 1): 16.0, ("a100", 2): 17.0}, gpus=1, submit=1.0)
    s = snap([a100(1, unmanaged=1)], [j, other], now=0.0)
    assert cell_of(run(ElasticFlowPolicy(deadline_aware=True), s), "j") == ("a100", 2)
    s = snap([a100(1, unmanaged=2)], [j, other], now=0.0)
    d = run(ElasticFlowPolicy(deadline_aware=True), s)
    assert cell_of(d, "j") == ("a100", 2) and cell_of(d, "o") is None
    d = run(ElasticFlowPolicy(), s)  # throughput mode: both get one GPU
    assert cell_of(d, "j") == ("a100", 1) and cell_of(d, "o") == ("a100", 1)
    # A deadline no count meets: declined (the daemon runs it as submitted), not kept waiting.
    late = job("late", {("a100", 1): 16.0, ("a100", 2): 32.0}, gpus=1, deadline=1500.0)
    d = run(ElasticFlowPolicy(deadline_aware=True), snap([a100(1)], [late], now=0.0))
    (late_decision,) = [x for x in d.jobs if x.job_id == "late"]
    assert late_decision.assignment is None and late_decision.reason.startswith(DROPPED_PREFIX)
    # One that has run (suspended, requeued) is never declined: it runs, best effort.
    ran = replace(late, iterations_done=10.0, restarts=1)
    assert ran.has_run and cell_of(run(ElasticFlowPolicy(deadline_aware=True), snap([a100(1)], [ran], now=0.0)),
                                   "late") is not None


# ---- fcfs ------------------------------------------------------------------------------

def test_fcfs_a_request_larger_than_the_type_does_not_block_its_queue():
    """16 a100 on a cluster of 8 never fit: the job is told so, and the 4-GPU job behind it
    starts; a head that only waits for busy GPUs still blocks."""
    from policy.fcfs import FcfsPolicy
    big = job("big", {("a100", 16): 10.0}, gpus=16)
    small = job("small", {("a100", 4): 10.0}, gpus=4, submit=1.0)
    s = snap([a100(0), a100(1)], [big, small])
    d = run(FcfsPolicy(), s)
    assert "never fit" in d.for_job("big").reason and d.for_job("big").assignment is None
    assert cell_of(d, "small") == ("a100", 4)
    head = job("head", {("a100", 8): 10.0}, gpus=8)
    s = snap([a100(0, unmanaged=2), a100(1)], [head, small])
    d = run(FcfsPolicy(), s)
    assert d.for_job("head").reason.startswith("waiting for 8 a100") and d.for_job("small") is None
    # Its GPUs on a drained node do not come back by themselves: it blocks nobody (with
    # Arena's ElasticFlow too), and the job behind it starts.
    from dataclasses import replace
    drained = snap([replace(a100(0, unmanaged=4), usable=False), a100(1)], [head, small])
    for policy in (FcfsPolicy(), ElasticFlowPolicy(blocking=True)):
        d = run(policy, drained)
        assert "never fit" in d.for_job("head").reason and cell_of(d, "small") == ("a100", 4), policy
