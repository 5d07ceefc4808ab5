"""Sia as published (policy/sia.py, policy/sia_model.py): its objective worked by hand, its
throughput model refined from an observed run, preemption, rounds, the ILP against brute force."""

import itertools

import pytest

from estimator.cells import Cell, CellEstimate
from estimator.jobs import JobSpec
from policy.interface import (PENDING, RUNNING, TRIGGER_ARRIVAL, TRIGGER_ROUND, Assignment, JobView, NodeView,
                              Snapshot, validate_decision)
from policy.sia import JobModel, Observation, Probe, SiaPolicy, SiaState, TypeFit, _type_shapes
from policy.sia_model import PerfParams, Point, fit_perf_params

BATCH = 64
NODE = NodeView("a100-1", "a100", 4)


def est(n, rate, feasible=True, gpu_type="a100", node_size=4):
    cell = Cell(gpu_type, n, min(n, node_size), 1)
    return CellEstimate(cell, (), 4, BATCH / rate if rate else 0.0, rate, 1.0, feasible,
                        "" if feasible else "out of memory")


def job(job_id, rates, *, submit=0.0, running=None, done=0.0, restarts=0, last_change=None):
    """``rates``: GPU count → samples/s on a100 (the estimates); ``running``: (count, placement)."""
    ests = tuple(est(n, r) for n, r in sorted(rates.items()))
    assignment = None
    if running is not None:
        n, placement = running
        assignment = Assignment(est(n, 1.0).cell, placement)
    return JobView(job_id, "u", JobSpec("gpt-1.3b", BATCH, 1, "a100"), submit,
                   RUNNING if running else PENDING, assignment, done, 100000, restarts,
                   submit if last_change is None else last_change, None, False, ests, ests)


def snap(jobs, now, trigger=TRIGGER_ROUND, state=None, restart_cost_s=0.0, nodes=(NODE,)):
    return Snapshot(now, tuple(nodes), tuple(jobs), trigger, 300.0, restart_cost_s, state)


def cells(decision, snapshot):
    out = {}
    for j in snapshot.jobs:
        d = decision.for_job(j.job_id)
        a = d.assignment if d is not None else j.assignment
        out[j.job_id] = None if a is None else a.cell.num_gpus
    return out


def decide(policy, s):
    d = policy.decide(s)
    validate_decision(s, d)
    return d


# ---- the objective, worked by hand --------------------------------------------------------

def _fitted(job_id, a_r_s, observed_s):
    """A job profiled at 10 samples/s on one a100 (6.4 s per iteration of the 64-sample
    batch), seen once on 2 GPUs of one node, with the model given rather than fitted:
    T(R) = 6.4 / R + a_r_s for R > 1 (gamma = 1, no retrogression)."""
    params = PerfParams(0.0, 6.4, a_r_s, 0.0, 1.1 * a_r_s, 0.0, 1.0)
    points = (Point(1.0, 1, 6.4), Point(2.0, 1, observed_s))
    return job_id, JobModel((Observation("a100", 2, 1, observed_s),), (TypeFit("a100", points, params),))


def test_sia_chooses_configurations_by_its_objective_worked_by_hand():
    # One a100 node of 4 GPUs; two pending jobs, each seen on 2 GPUs before, so each may
    # take 1, 2 or 4 GPUs (twice the most it ran on). Its model gives, per count:
    #
    #   job A (a_r = 1.6 s): T = 6.4, 4.8, 3.2 s  → 10, 13.33, 20 samples/s
    #       goodput G (÷ the slowest, 10)  = 1, 1.333, 2
    #       G^-0.5 rounded to 2 decimals   = 1, 0.87 (0.866), 0.71 (0.7071)
    #   job B (a_r = 0.8 s): T = 6.4, 4.0, 2.4 s  → 10, 16, 26.67 samples/s
    #       G = 1, 1.6, 2.667;  G^-0.5 = 1, 0.79 (0.7906), 0.61 (0.6124)
    #
    # Sia minimizes Σ G^-0.5 + 1.1 × (jobs left without GPUs) over ≤ 4 GPUs:
    #   A4 alone 0.71 + 1.1 = 1.81     B4 alone 0.61 + 1.1 = 1.71
    #   A2 + B2  0.87 + 0.79 = 1.66  ← the minimum
    #   A2 + B1  0.87 + 1 = 1.87       A1 + B2  1 + 0.79 = 1.79       A1 + B1  2.00
    # (pending jobs: no restart factor). Sia splits the node 2 + 2.
    a = job("A", {1: 10.0, 2: 20.0, 4: 40.0})
    b = job("B", {1: 10.0, 2: 20.0, 4: 40.0}, submit=1.0)
    state = SiaState(None, (_fitted("A", 1.6, 4.8), _fitted("B", 0.8, 4.0)))
    s = snap([a, b], now=1000.0, state=state)
    policy = SiaPolicy()
    shapes = _type_shapes(s)
    values = {}
    for j, (_, model) in zip((a, b), state.models):
        configs, _ = policy._configs(s, j, model, shapes)
        values[j.job_id] = {c.cell.num_gpus: c.value for c in configs}
    assert values == {"A": {1: 1.0, 2: 0.87, 4: 0.71}, "B": {1: 1.0, 2: 0.79, 4: 0.61}}
    assert cells(decide(policy, s), s) == {"A": 2, "B": 2}
    # Why Sia needs λ > 1 (its config says so): with λ = 0.5 leaving both out costs 1.0,
    # less than any allocation (B4 alone 0.61 + 0.5 = 1.11), and nothing starts.
    assert cells(decide(SiaPolicy(lambda_unallocated=0.5), s), s) == {"A": None, "B": None}


def test_sia_ilp_equals_brute_force():
    a = job("A", {1: 10.0, 2: 20.0, 4: 40.0})
    b = job("B", {1: 10.0, 2: 20.0, 4: 40.0}, submit=1.0)
    c = job("C", {2: 15.0, 4: 30.0}, submit=2.0)
    state = SiaState(None, (_fitted("A", 1.6, 4.8), _fitted("B", 0.3, 3.5)))
    nodes = (NODE, NodeView("a100-2", "a100", 4))
    s = snap([a, b, c], now=1000.0, state=state, nodes=nodes)
    policy = SiaPolicy()
    models = dict(state.models)
    configs = {j.job_id: policy._configs(s, j, models.get(j.job_id, JobModel()), _type_shapes(s))[0] for j in s.jobs}

    def cost(choice):
        return sum(c.value if c is not None else 1.1 for c in choice)

    best = min((ch for ch in itertools.product(*[configs[j.job_id] + [None] for j in s.jobs])
                if sum(c.cell.num_gpus for c in ch if c is not None) <= 8), key=cost)
    got = policy._solve(s.jobs, configs, set(), {"a100": 8})
    assert cost(tuple(got.get(j.job_id) for j in s.jobs)) == pytest.approx(cost(best))


# ---- the throughput model -----------------------------------------------------------------

def test_fit_recovers_sublinear_scaling_from_two_points():
    # Truth: T(R) = 6.4 / R + 1.8 s for R > 1 on one node, T(1) = 6.4 s.
    p = fit_perf_params((Point(1.0, 1, 6.4), Point(2.0, 1, 5.0)))
    assert p.iteration_time_s(1, 1) == pytest.approx(6.4, rel=1e-3)
    assert p.iteration_time_s(2, 1) == pytest.approx(5.0, rel=1e-3)
    assert p.iteration_time_s(4, 1) == pytest.approx(3.4, rel=0.1)  # linear scaling says 1.6
    assert p.iteration_time_s(4, 2) >= p.iteration_time_s(4, 1)  # Sia's prior: inter-node ≥ intra
    # One replica count only: compute proportional to the local batch (the optimistic prior).
    linear = fit_perf_params((Point(1.0, 1, 6.4),))
    assert linear.iteration_time_s(4, 1) == pytest.approx(1.6, rel=1e-6)


def test_sia_refines_its_model_from_an_observed_multi_gpu_run():
    # The estimate says 10 samples/s per GPU (linear); the job really runs T(1) = 6.4 s,
    # T(2) = 5.0 s, T(4) = 3.4 s per iteration (strongly sublinear).
    truth_s = {1: 6.4, 2: 5.0, 4: 3.4}
    rates = {1: 10.0, 2: 20.0, 4: 40.0}
    policy = SiaPolicy()
    s = snap([job("J", rates)], now=0.0)
    d = decide(policy, s)
    assert cells(d, s) == {"J": 1}  # never seen running: its one-replica configuration only
    state, done, placement = d.policy_state, 0.0, d.for_job("J").assignment.placement
    n, t0 = 1, 0.0
    for step in range(2):
        # Restarted at t0, progressing from t0 + 40 s; Sia watches it for more than a round.
        for t, progress in ((t0 + 10.0, False), (t0 + 100.0, True), (t0 + 200.0, True)):
            now_done = done + (max(0.0, t - t0 - 40.0) / truth_s[n] if progress else 0.0)
            j = job("J", rates, running=(n, placement), done=now_done, last_change=t0, restarts=step)
            s = snap([j], now=t, state=state, trigger=TRIGGER_ROUND if t == t0 + 200.0 else TRIGGER_ARRIVAL)
            d = decide(policy, s)
            state = d.policy_state
        done, t0 = now_done, t0 + 200.0
        new = cells(d, s)["J"]
        assert new == 2 * n, f"step {step}: Sia should try twice the GPUs it saw, got {new}"
        n, placement = new, d.for_job("J").assignment.placement
    model = dict(state.models)["J"]
    assert [(o.num_gpus, round(o.iteration_time_s, 6)) for o in model.observations] == [(1, 6.4), (2, 5.0)]
    fit = {f.gpu_type: f for f in model.fits}["a100"].params
    predicted_4 = BATCH / fit.iteration_time_s(4, 1)
    assert predicted_4 == pytest.approx(BATCH / truth_s[4], rel=0.1)  # 18.8 samples/s
    assert predicted_4 < 0.5 * rates[4]  # the linear bootstrap said 40


# ---- preemption and rounds ----------------------------------------------------------------

def test_sia_preempts_a_running_job_when_the_objective_says_so():
    # r holds the whole node (its only configuration, G = 1: value 1). Two pending jobs can
    # each run on 2 GPUs. Keeping r costs 1 + 1.1 + 1.1 = 3.2; preempting it 1.1 + 1 + 1 = 3.1.
    r = job("r", {4: 40.0}, running=(4, (("a100-1", 4),)), done=50.0, last_change=0.0)
    p1 = job("p1", {2: 20.0}, submit=10.0)
    p2 = job("p2", {2: 20.0}, submit=20.0)
    s = snap([r, p1, p2], now=5000.0, restart_cost_s=100.0)
    d = decide(SiaPolicy(), s)
    assert cells(d, s) == {"r": None, "p1": 2, "p2": 2}
    assert d.for_job("r").reason.startswith("preempted")
    # While r is restarting (no progress since it started), Sia keeps its allocation.
    probe = Probe(r.assignment, 50.0)
    restarting = job("r", {4: 40.0}, running=(4, (("a100-1", 4),)), done=50.0, last_change=4950.0)
    s = snap([restarting, p1, p2], now=5000.0, restart_cost_s=100.0, state=SiaState(4900.0, (), (("r", probe),)))
    assert cells(decide(SiaPolicy(), s), s) == {"r": 4, "p1": None, "p2": None}


def test_sia_decides_once_per_round():
    p = job("p", {1: 10.0})
    state = SiaState(last_solve_s=100.0)
    early = snap([p], now=130.0, trigger=TRIGGER_ARRIVAL, state=state)
    d = decide(SiaPolicy(), early)
    assert d.jobs == () and d.policy_state.last_solve_s == 100.0
    late = snap([p], now=160.0, trigger=TRIGGER_ARRIVAL, state=state)
    d = decide(SiaPolicy(), late)
    assert cells(d, late) == {"p": 1} and d.policy_state.last_solve_s == 160.0


def test_sia_restart_factor_keeps_a_young_job_where_it_is():
    # j runs on 1 GPU and has been seen there; 2 GPUs would double its rate (G 2: value 0.71),
    # but with one restart at age 1000 s and S = 600 s the factor is (1000 − 600) / 1600
    # = 0.25: G 0.5, value 1.41 > 1 (staying). At age 10,000 s: 9400 / 10600 = 0.887, G 1.77,
    # value 0.75: it grows.
    model = JobModel((Observation("a100", 1, 1, 6.4),))
    state = SiaState(0.0, (("j", model),), (("j", Probe(Assignment(est(1, 1.0).cell, (("a100-1", 1),)), 0.0, 1.0, 1.0)),))

    def at(now):
        j = job("j", {1: 10.0, 2: 20.0}, running=(1, (("a100-1", 1),)), done=100.0, restarts=1, last_change=1.0)
        s = snap([j], now=now, restart_cost_s=600.0, state=state)
        return cells(decide(SiaPolicy(), s), s)["j"]

    assert at(1000.0) == 1
    assert at(10000.0) == 2


def test_the_solver_budget_is_deterministic_nodes_not_seconds():
    """A node budget reaches both solvers; the same program answers the same under it."""
    from policy.binary_program import solve_binary_program
    objective = {i: float(1 + (i * 7) % 5) for i in range(12)}
    rows = [({i: 1.0 for i in range(k, 12, 3)}, "<=", 2.0) for k in range(3)]
    answers = {solve_binary_program(objective, rows, 12, True, 60.0, solvers=(name,), max_nodes=1).chosen
               for name in ("highs", "cbc") for _ in range(2)}
    assert len(answers) == 1
    assert SiaPolicy().node_budget == 100_000
