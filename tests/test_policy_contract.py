"""The contract every registered policy keeps: valid decisions, no over-allocation,
inputs left untouched, the same answer to the same snapshot, seeded determinism."""

import copy

import pytest

from estimator.cluster import cluster_from_dict
from estimator.errors import SpecError
from policy.interface import (Decision, JobView, NodeView, Policy, Snapshot, implied_actions,
                              validate_decision)
from policy.measured import load_measured, measured_estimates
from policy.registry import make_policy, policy_class, policy_names
from policy.simulator import EstimateCache, SimConfig, simulate
from policy.trace import TraceRecord, map_trace

CLUSTER = cluster_from_dict({"name": "contract", "node_groups": [
    {"gpu_type": "a100", "nodes": 4, "gpus_per_node": 4},
    {"gpu_type": "a40", "nodes": 8, "gpus_per_node": 2},
    {"gpu_type": "a10", "nodes": 8, "gpus_per_node": 2},
    {"gpu_type": "v100", "nodes": 1, "gpus_per_node": 16},
]})
CONFIG = SimConfig(round_s=300.0)


@pytest.fixture(scope="module")
def table():
    return load_measured()


@pytest.fixture(scope="module")
def trace_jobs(table):
    # A busy 40 minutes: 20 arrivals of 1–4 h jobs, enough to queue on every type.
    records = tuple(TraceRecord(f"j{i}", 120.0 * i, 3600.0 * (1 + i % 4), 1) for i in range(20))
    return map_trace(records, table, seed=11)


@pytest.fixture(scope="module")
def estimates(table):
    # Estimates from the measured table: the contract concerns the policy, not the
    # estimator, and these keep the test fast (the analytic path is tested elsewhere).
    return EstimateCache(CLUSTER, table, estimate_fn=lambda spec, space: measured_estimates(spec, CLUSTER, table))


FIRST_RUNS: dict = {}


def _policy(name):
    try:
        policy_class(name)
    except SpecError as e:
        pytest.skip(f"policy {name} is registered but not importable: {e}")
    return make_policy(name)


class Checked:
    """Wraps a policy: checks every decision it makes against the snapshot it was given."""

    def __init__(self, inner):
        self.inner = inner
        self.name = getattr(inner, "name", type(inner).__name__)
        self.plan_tuning = getattr(inner, "plan_tuning", "full")
        self.round_s = getattr(inner, "round_s", None)  # the rounds the inner policy is woken at
        self.extra_start_s = getattr(inner, "extra_start_s", 0.0)
        self.calls = 0

    def decide(self, snapshot):
        self.calls += 1
        deep = self.calls <= 8 or self.calls % 60 == 0  # deep copies are costly; sample them
        before = copy.deepcopy(snapshot) if deep else None
        decision = self.inner.decide(snapshot)
        assert isinstance(decision, Decision), f"{self.name} returned {type(decision).__name__}"
        if deep:
            assert snapshot == before, f"{self.name} mutated its snapshot"
            again = self.inner.decide(snapshot)
            assert again.jobs == decision.jobs, f"{self.name} answered the same snapshot differently"
        validate_decision(snapshot, decision)  # raises on over-allocation or a bad placement
        for d in decision.jobs:
            assert isinstance(d.reason, str)
        implied_actions(snapshot, decision)
        return decision


@pytest.mark.parametrize("name", policy_names())
def test_policy_satisfies_the_protocol(name):
    policy = _policy(name)
    assert isinstance(policy, Policy)
    assert policy.name == name


@pytest.mark.parametrize("name", policy_names())
def test_policy_runs_a_trace_without_over_allocation(name, table, trace_jobs, estimates):
    checked = Checked(_policy(name))
    result = simulate(checked, trace_jobs, CLUSTER, table, CONFIG, estimates)
    assert checked.calls > 0
    assert [o.job_id for o in result.jobs] == [j.job_id for j in trace_jobs]
    for point in result.timeline:
        for gtype, used in point.gpus_in_use:
            assert used <= CLUSTER.total_gpus(gtype)
    assert any(o.status == "finished" for o in result.jobs), f"{name} finished no job at all"
    FIRST_RUNS[name] = result


@pytest.mark.parametrize("name", policy_names())
def test_policy_is_deterministic_for_a_seed(name, table, trace_jobs, estimates):
    runs = [FIRST_RUNS.get(name) or simulate(_policy(name), trace_jobs, CLUSTER, table, CONFIG, estimates)]
    runs.append(simulate(_policy(name), trace_jobs, CLUSTER, table, CONFIG, estimates))
    assert runs[0].jobs == runs[1].jobs
    assert runs[0].timeline == runs[1].timeline


@pytest.mark.parametrize("name", policy_names())
def test_policy_leaves_unmanaged_gpus_alone(name, trace_jobs, estimates):
    policy = _policy(name)
    nodes = tuple(NodeView(n, g.gpu_type, g.gpus_per_node, unmanaged_gpus=g.gpus_per_node if i % 2 else 1)
                  for g in CLUSTER.node_groups for i, n in enumerate(g.node_names()))
    jobs = []
    for t in trace_jobs[:15]:
        cells, dp_only, runnable = estimates.get(t.spec)
        jobs.append(JobView(t.job_id, "u", t.spec, t.submit_time_s, "pending", None, 0.0, t.iterations, 0,
                            t.submit_time_s, t.deadline_s, False, cells, dp_only, runnable))
    snapshot = Snapshot(2000.0, nodes, tuple(jobs))
    decision = policy.decide(snapshot)
    validate_decision(snapshot, decision)


def _view(job_id, assignment):
    from estimator.jobs import JobSpec
    state = "running" if assignment else "pending"
    return JobView(job_id, "u", JobSpec("gpt-1.3b", 128, 4, "a100"), 0.0, state, assignment, 0.0, 10, 0, 0.0)


def test_implied_actions_classify_every_change_and_order_releases_first():
    from estimator.cells import Cell
    from policy.interface import Assignment, DecisionError, JobDecision
    nodes = (NodeView("a-1", "a100", 4), NodeView("a-2", "a100", 4), NodeView("v-1", "v100", 16))
    a4 = Assignment(Cell("a100", 4, 4, 1), (("a-1", 4),))
    jobs = (_view("start", None), _view("stop", a4),
            _view("resize", Assignment(Cell("a100", 2, 4, 1), (("a-2", 2),))),
            _view("retype", Assignment(Cell("a100", 1, 4, 1), (("a-2", 1),))),
            _view("move", Assignment(Cell("a100", 1, 4, 1), (("a-2", 1),))), _view("same", None))
    snap = Snapshot(0.0, nodes, jobs)
    decision = Decision((
        JobDecision("start", Assignment(Cell("a100", 4, 4, 1), (("a-1", 4),)), "start"),
        JobDecision("stop", None, "stop"),
        JobDecision("resize", Assignment(Cell("a100", 1, 4, 1), (("a-2", 1),))),
        JobDecision("retype", Assignment(Cell("v100", 8, 16, 1), (("v-1", 8),))),
        JobDecision("move", Assignment(Cell("a100", 1, 4, 1), (("a-2", 1),))),  # unchanged
    ))
    validate_decision(snap, decision)
    kinds = {a.job_id: a.kind for a in implied_actions(snap, decision)}
    assert kinds == {"start": "start", "stop": "suspend", "resize": "resize", "retype": "change_type"}
    assert implied_actions(snap, decision)[0].kind == "suspend"
    moved = Decision((JobDecision("move", Assignment(Cell("a100", 1, 4, 1), (("a-1", 1),))),))
    with pytest.raises(DecisionError, match="a-1"):  # a-1 is still held by "stop"
        validate_decision(snap, moved)
    over = Decision((JobDecision("start", Assignment(Cell("a100", 4, 4, 1), (("a-2", 4),))),))
    with pytest.raises(DecisionError, match="a-2"):
        validate_decision(snap, over)
    wrong_type = Decision((JobDecision("start", Assignment(Cell("v100", 4, 4, 1), (("a-1", 4),))),))
    with pytest.raises(DecisionError, match="a100"):
        validate_decision(snap, wrong_type)
    for empty in (Assignment(Cell("a100", 0, 4, 1), ()), Assignment(Cell("a100", 4, 4, 0), (("a-1", 4),))):
        with pytest.raises(DecisionError, match="runs nothing"):  # had become a start on no GPUs
            validate_decision(snap, Decision((JobDecision("start", empty),)))
    assert [a.kind for a in implied_actions(snap, Decision((JobDecision("move", Assignment(
        Cell("a100", 1, 4, 1), (("a-1", 1),))), JobDecision("stop", None))))] == ["suspend", "move"]


def test_a_cell_with_more_stages_than_the_job_allows_is_refused():
    from dataclasses import replace

    from estimator.cells import Cell
    from policy.interface import Assignment, DecisionError, JobDecision
    view = _view("dp-tp", None)
    snap = Snapshot(0.0, (NodeView("a-1", "a100", 4),),
                    (replace(view, spec=replace(view.spec, max_stages=1)),))
    ok = Decision((JobDecision("dp-tp", Assignment(Cell("a100", 4, 4, 1), (("a-1", 4),))),))
    validate_decision(snap, ok)
    staged = Decision((JobDecision("dp-tp", Assignment(Cell("a100", 4, 4, 2), (("a-1", 4),))),))
    with pytest.raises(DecisionError, match="max_stages=1"):
        validate_decision(snap, staged)


def test_a_change_onto_gpus_another_change_frees_comes_after_it():
    """Applied in order, no action needs GPUs still held: A moves onto v-1's GPUs that B
    leaves for a-2, so B goes first whatever the decision's order; a swap keeps its order."""
    from estimator.cells import Cell
    from policy.interface import Assignment, JobDecision
    nodes = (NodeView("a-1", "a100", 4), NodeView("a-2", "a100", 4), NodeView("v-1", "v100", 4))
    on_a = Assignment(Cell("a100", 4, 4, 1), (("a-1", 4),))
    on_v = Assignment(Cell("v100", 4, 4, 1), (("v-1", 4),))
    snap = Snapshot(0.0, nodes, (_view("A", on_a), _view("B", on_v)))
    decision = Decision((JobDecision("A", on_v), JobDecision("B", Assignment(Cell("a100", 4, 4, 1), (("a-2", 4),)))))
    validate_decision(snap, decision)
    assert [a.job_id for a in implied_actions(snap, decision)] == ["B", "A"]
    free = {"a-1": 0, "a-2": 4, "v-1": 0}
    for a in implied_actions(snap, decision):
        for name, gpus in a.before.placement:
            free[name] += gpus
        for name, gpus in a.after.placement:
            free[name] -= gpus
            assert free[name] >= 0, (a.job_id, name)
    swap = Snapshot(0.0, nodes, (_view("A", on_a), _view("B", on_v)))
    crossed = Decision((JobDecision("A", Assignment(Cell("v100", 4, 4, 1), (("v-1", 4),))),
                        JobDecision("B", Assignment(Cell("a100", 4, 4, 1), (("a-1", 4),)))))
    assert [a.job_id for a in implied_actions(swap, crossed)] == ["A", "B"]
