"""Forecasts (policy.forecast) on hand-computed scenarios: the policy run forward from a
snapshot, with plain jobs ending at their time limits."""

import pytest

from estimator.cells import Cell, CellEstimate
from estimator.jobs import JobSpec
from policy.cells_ilp import CellsIlpPolicy
from policy.fcfs import FcfsPolicy
import policy.forecast as forecast_module
from policy.forecast import GpuRelease, forecast
from policy.interface import (PENDING, RUNNING, TRIGGER_COMPLETION, TRIGGER_ROUND, Assignment,
                              Decision, JobDecision, JobView, NodeView, Snapshot)

BATCH = 8


def est(n, iteration_time_s, gpu_type="a100"):
    return CellEstimate(Cell(gpu_type, n, n, 1), (), 4, iteration_time_s, BATCH / iteration_time_s, 1.0, True, "")


def job(job_id, gpus, estimates, *, iterations, done=0.0, running_on=None, started_s=0.0):
    assignment = None
    if running_on is not None:
        assignment = Assignment(Cell("a100", gpus, gpus, 1), (running_on,))
    return JobView(job_id, "u", JobSpec("gpt-1.3b", BATCH, gpus, "a100"), 0.0,
                   RUNNING if assignment else PENDING, assignment, done, iterations, 0,
                   started_s if assignment else 0.0, estimates=estimates, dp_only_estimates=estimates)


def scenario(restart_cost_s=0.0):
    """One node of 4 a100: job A runs on 2 (1 s per iteration, 50 left: ends at t=50), a
    plain job holds the other 2 until t=100, and job B waits for all 4 (0.5 s per
    iteration, 100 iterations)."""
    a = job("A", 2, (est(2, 1.0),), iterations=150, done=100.0, running_on=("a100-1", 2), started_s=-40.0)
    b = job("B", 4, (est(4, 0.5),), iterations=100)
    snap = Snapshot(0.0, (NodeView("a100-1", "a100", 4, 2),), (a, b), TRIGGER_ROUND, 10.0, restart_cost_s)
    return snap, (GpuRelease(100.0, "a100-1", 2),)


def test_a_waiting_job_starts_when_the_plain_job_ends_and_runs_at_its_estimate():
    snap, releases = scenario()
    got = forecast(snap, FcfsPolicy(), releases)
    assert (got["A"].start_s, got["A"].end_s, got["A"].cells) == (-40.0, 50.0, ("a100x2:s1",))
    assert (got["B"].start_s, got["B"].end_s, got["B"].cells) == (100.0, 150.0, ("a100x4:s1",))


def test_a_restart_costs_time_without_progress():
    snap, releases = scenario(restart_cost_s=30.0)
    got = forecast(snap, FcfsPolicy(), releases)
    assert got["A"].end_s == 50.0  # running already: no restart
    assert (got["B"].start_s, got["B"].end_s) == (100.0, 180.0)


def test_without_the_release_the_waiting_job_has_no_forecast():
    snap, _ = scenario()
    got = forecast(snap, FcfsPolicy())
    assert got["A"].end_s == 50.0 and (got["B"].start_s, got["B"].end_s) == (None, None)


def test_the_policy_is_told_a_job_finished_as_the_daemon_tells_it():
    """Crius searches again for waiting jobs only when told a job finished: a forward run
    that said "round" at every step played out another Crius than the daemon runs."""
    snap, releases = scenario()
    seen = []

    class Spy(FcfsPolicy):
        def decide(self, snapshot):
            seen.append((snapshot.now_s, snapshot.trigger))
            return super().decide(snapshot)
    forecast(snap, Spy(), releases)
    assert seen == [(0.0, TRIGGER_ROUND), (50.0, TRIGGER_COMPLETION), (100.0, TRIGGER_ROUND)]


def test_the_daemons_policy_forecasts_the_same_and_keeps_its_own_state():
    snap, releases = scenario()
    policy = CellsIlpPolicy(min_change_interval_s=0.0)
    got = forecast(snap, policy, releases)
    assert (got["B"].start_s, got["B"].end_s) == (100.0, 150.0)
    assert snap.policy_state is None  # the snapshot is not changed


@pytest.mark.parametrize("max_decisions", [1, 2])
def test_after_its_decisions_the_run_goes_on_as_a_list_schedule(max_decisions):
    snap, releases = scenario()
    got = forecast(snap, FcfsPolicy(), releases, max_decisions=max_decisions)
    assert got["A"].end_s == 50.0 and not got["A"].extrapolated  # decided: ends before the tail
    # B would start at the third decision (t=0, 50, 100); the tail starts it when the
    # release frees its 4 GPUs, on what it asked for.
    assert (got["B"].start_s, got["B"].end_s, got["B"].cells) == (100.0, 150.0, ("a100x4:s1",))
    assert got["B"].extrapolated
    exact = forecast(snap, FcfsPolicy(), releases, max_decisions=3)
    assert (exact["B"].start_s, exact["B"].end_s, exact["B"].extrapolated) == (100.0, 150.0, False)


def two_by_two(restart_cost_s=0.0):
    """One node of 4 a100, all free; three pending jobs of 2 GPUs each, 1 s per iteration:
    L (100 iterations, submitted first), S (10) and M (40)."""
    jobs = tuple(JobView(job_id, "u", JobSpec("gpt-1.3b", BATCH, 2, "a100"), submit_s, PENDING, None, 0.0,
                         iterations, 0, submit_s, estimates=(est(2, 1.0),), dp_only_estimates=(est(2, 1.0),))
                 for job_id, submit_s, iterations in (("L", -30.0, 100), ("S", -20.0, 10), ("M", -10.0, 40)))
    return Snapshot(0.0, (NodeView("a100-1", "a100", 4, 0),), jobs, TRIGGER_ROUND, 10.0, restart_cost_s)


def test_the_list_schedule_follows_the_policys_order_and_never_overcommits_a_type():
    snap = two_by_two(restart_cost_s=5.0)
    # FCFS's order: submission order, what each asked for. L and S fit now; M takes S's
    # GPUs when S ends (t = 5 + 10), and pays its own restart cost.
    got = forecast(snap, FcfsPolicy(), max_decisions=0)
    assert {k: (f.start_s, f.end_s) for k, f in got.items()} == \
        {"L": (0.0, 105.0), "S": (0.0, 15.0), "M": (15.0, 60.0)}
    assert all(f.extrapolated for f in got.values())
    # cells-ilp ranks the short jobs first (its weight): S and M start, L waits for S.
    got = forecast(snap, CellsIlpPolicy(), max_decisions=0)
    assert {k: (f.start_s, f.end_s) for k, f in got.items()} == \
        {"S": (0.0, 15.0), "M": (0.0, 45.0), "L": (15.0, 120.0)}


def test_a_zero_time_budget_decides_nothing_beyond_the_rounds_decision():
    snap, releases = scenario()
    policy = FcfsPolicy()
    calls = []
    decide = policy.decide
    policy.decide = lambda s: calls.append(s.now_s) or decide(s)
    got = forecast(snap, policy, releases, first=decide(snap), time_budget_s=0.0)
    assert calls == []  # only the round's own decision, which was given
    assert (got["B"].start_s, got["B"].end_s, got["B"].extrapolated) == (100.0, 150.0, True)

def test_each_start_pays_what_the_callers_cost_model_says_and_running_jobs_progress_when_told():
    snap, releases = scenario(restart_cost_s=30.0)
    seen = []

    def start_cost(start):
        seen.append((start.view.job_id, start.first_in_run, start.after.cell.label(), start.cells_run))
        return 5.0  # B's first start: far cheaper than the snapshot's restart cost

    # A is told it makes progress only from t=20 (its restart still runs): 50 iterations
    # left at 1 s each end it at 70, not at 50.
    got = forecast(snap, FcfsPolicy(), releases, start_cost=start_cost, progress_from_s={"A": 20.0})
    assert seen == [("B", True, "a100x4:s1", ())]
    assert (got["A"].end_s, got["B"].start_s, got["B"].end_s) == (70.0, 100.0, 155.0)
    # The list schedule charges the same.
    tail = forecast(snap, FcfsPolicy(), releases, max_decisions=0, start_cost=start_cost,
                    progress_from_s={"A": 20.0})
    assert (tail["A"].end_s, tail["B"].start_s, tail["B"].end_s, tail["B"].extrapolated) == (70.0, 100.0, 155.0, True)


def pending(job_id, gpus, submit_s, iterations=10, gpu_type="a100"):
    e = est(gpus, 1.0, gpu_type)
    return JobView(job_id, "u", JobSpec("gpt-1.3b", BATCH, gpus, gpu_type), submit_s, PENDING, None, 0.0,
                   iterations, 0, submit_s, estimates=(e,), dp_only_estimates=(e,))


@pytest.mark.parametrize("policy", [FcfsPolicy(), FcfsPolicy(strict_fifo=False)], ids=["fifo", "backfill"])
def test_a_job_no_cell_of_which_can_ever_fit_does_not_block_the_list_schedule(policy):
    """X asks for the 4 a100 that a plain job holds with no end in sight; with a one-job
    window (backfilling) or a blocked head (FIFO) it would hold back Y for ever."""
    nodes = (NodeView("a100-1", "a100", 4, 4), NodeView("v100-1", "v100", 4, 0))
    snap = Snapshot(0.0, nodes, (pending("X", 4, -20.0), pending("Y", 4, -10.0, gpu_type="v100")),
                    TRIGGER_ROUND, 10.0, 0.0)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(forecast_module, "QUEUE_WINDOW_JOBS", 1)
        got = forecast(snap, policy, max_decisions=0)
    assert (got["X"].start_s, got["Y"].start_s, got["Y"].end_s) == (None, 0.0, 10.0)


def test_a_fifo_list_schedule_keeps_a_blocked_head_first():
    """A runs on 2 of 4 a100 until t=50; B (first) asks for 4, C for 2. Strict FIFO starts
    B when A ends and C after B, as the decided run does; backfilling lets C go first."""
    a = job("A", 2, (est(2, 1.0),), iterations=50, running_on=("a100-1", 2))
    snap = Snapshot(0.0, (NodeView("a100-1", "a100", 4, 0),), (a, pending("B", 4, -20.0, 50), pending("C", 2, -10.0, 100)),
                    TRIGGER_ROUND, 10.0, 0.0)
    starts = lambda got: {k: (got[k].start_s, got[k].end_s) for k in ("B", "C")}  # noqa: E731
    decided = forecast(snap, FcfsPolicy())
    assert starts(decided) == {"B": (50.0, 100.0), "C": (100.0, 200.0)}
    assert starts(forecast(snap, FcfsPolicy(), max_decisions=0)) == starts(decided)
    assert starts(forecast(snap, FcfsPolicy(strict_fifo=False), max_decisions=0)) == \
        {"C": (0.0, 100.0), "B": (100.0, 150.0)}


def test_a_release_frees_no_more_gpus_than_the_plain_job_held():
    """A plain job holds 2 of 4 a100 and is said to release 4 at t=10: only 2 come free.
    Of three 2-GPU jobs, P starts at once (100 s), Q at t=10 (10 s), R when Q ends."""
    jobs = (pending("P", 2, 0.0, 100), pending("Q", 2, 1.0, 10), pending("R", 2, 2.0, 10))
    snap = Snapshot(0.0, (NodeView("a100-1", "a100", 4, 2),), jobs, TRIGGER_ROUND, 10.0, 0.0)
    release = (GpuRelease(10.0, "a100-1", 4),)
    for max_decisions in (0, 60):
        got = forecast(snap, FcfsPolicy(), release, max_decisions=max_decisions)
        assert {k: got[k].start_s for k in "PQR"} == {"P": 0.0, "Q": 10.0, "R": 20.0}, max_decisions


@pytest.mark.parametrize("state, flags, end_s, start_s", [
    ("RUNNING", (), 30.0, 30.0),  # frees its GPUs at its end in Slurm
    ("RUNNING", (), -5.0, 0.0),  # past it (OverTimeLimit, KillWait): now
    ("COMPLETING", (), -5.0, 0.0),
    ("RUNNING", ("COMPLETING",), -5.0, 0.0),
    ("RUNNING", (), None, None),  # no time limit: never, as far as anyone knows
])
def test_a_plain_jobs_gpus_come_free_at_its_end_or_now_once_it_is_past_it(state, flags, end_s, start_s):
    from slurm_ext.observe import gpu_releases
    from slurm_ext.slurm_client import SlurmJob
    now_s = 1_800_000_000.0
    plain = SlurmJob(9, "v", "plain", state, nodes=("a100-1",), granted_gpus_per_node=(4,), gpus_per_node=4,
                     start_time_s=now_s - 3600, end_time_s=None if end_s is None else now_s + end_s,
                     state_flags=flags)
    snap = Snapshot(now_s, (NodeView("a100-1", "a100", 4, 4),), (pending("B", 4, now_s - 100.0, 100),),
                    TRIGGER_ROUND, 60.0, 0.0)
    got = forecast(snap, FcfsPolicy(), gpu_releases([plain], now_s))["B"]
    assert (None if got.start_s is None else got.start_s - now_s) == start_s


def test_a_running_job_the_decision_suspends_is_next_expected_at_its_restart_not_its_last_start():
    """A (running for an hour) is suspended for B by the round's decision; B ends at 130 s
    (its 30 s start, then 100 iterations of 1 s), and A restarts then: while A waits, that
    restart is its expected start."""
    a = job("A", 4, (est(4, 1.0),), iterations=1000, done=50.0, running_on=("a100-1", 4), started_s=-3600.0)
    b = pending("B", 4, -5.0, 100)
    snap = Snapshot(0.0, (NodeView("a100-1", "a100", 4, 0),), (a, b), TRIGGER_ROUND, 60.0, 30.0)
    first = Decision((JobDecision("A", None), JobDecision("B", Assignment(Cell("a100", 4, 4, 1), (("a100-1", 4),)))))
    got = forecast(snap, FcfsPolicy(), first=first)
    assert got["A"].start_s == -3600.0  # its last start: it ran when the forecast began
    assert got["B"].next_start_s == got["B"].start_s == 0.0
    assert got["A"].next_start_s == got["B"].end_s == 130.0


def test_the_rounds_decision_is_applied_once_even_when_an_event_falls_on_now():
    """D has no iteration left (it ends now); the round's decision keeps D and starts E.
    The next event is at now again: the run must decide afresh there, not apply the
    round's decision (which names D, ended by then) a second time."""
    d = job("D", 2, (est(2, 1.0),), iterations=10, done=10.0, running_on=("a100-1", 2))
    snap = Snapshot(0.0, (NodeView("a100-1", "a100", 4, 0),), (d, pending("E", 2, -5.0, 20)),
                    TRIGGER_ROUND, 10.0, 0.0)
    first = Decision((JobDecision("D", d.assignment), JobDecision("E", Assignment(Cell("a100", 2, 2, 1), (("a100-1", 2),)))))
    got = forecast(snap, FcfsPolicy(), first=first)
    assert (got["E"].start_s, got["E"].end_s) == (0.0, 20.0)

def test_a_queue_far_ahead_starts_as_each_job_before_it_ends():
    """Thirty jobs that each need the whole node, one after the other: each starts when the
    one before ends. Decisions made sparser further ahead had left the node idle after
    each end until the next decision (the 30th job's start 2.1× too late)."""
    jobs = tuple(job(f"J{k:02d}", 4, (est(4, 1.0),), iterations=1000) for k in range(30))
    snap = Snapshot(0.0, (NodeView("a100-1", "a100", 4),), jobs, TRIGGER_ROUND, 10.0, 0.0)
    got = forecast(snap, FcfsPolicy(), max_decisions=100)
    assert [got[j.job_id].start_s for j in jobs] == [1000.0 * k for k in range(30)]


def test_a_policy_that_starts_jobs_at_its_rounds_is_forecast_to_start_them_at_the_next_round():
    """Sia decides at its rounds only: a job that arrives just after one starts at the next
    round on the free GPUs, not when the long job beside it ends (11 h later)."""
    from policy.sia import SiaPolicy, SiaState

    ests = (est(1, 4.0), est(2, 2.2), est(4, 1.2))
    nodes = (NodeView("a100-0", "a100", 4), NodeView("a100-1", "a100", 4))
    sia = SiaPolicy()
    long = job("L", 1, ests, iterations=10_000)
    first = sia.decide(Snapshot(0.0, nodes, (long,), TRIGGER_ROUND, 60.0, 60.0))
    running = job("L", 1, ests, iterations=10_000, done=100.0, running_on=first.for_job("L").assignment.placement[0])
    new = job("N", 1, ests, iterations=100)
    state = SiaState(120.0, first.policy_state.models, first.policy_state.probes)  # its last solve: t=120
    snap = Snapshot(130.0, nodes, (running, new), "arrival", 60.0, 60.0, policy_state=state)
    decision = sia.decide(snap)
    assert decision.for_job("N") is None  # not a round: nothing changes
    got = forecast(snap, sia, first=decision)
    assert 180.0 <= got["N"].start_s <= 130.0 + sia.round_s


def test_gavel_starts_a_waiting_job_at_its_round_after_gpus_come_free():
    """Gavel changes nothing between its rounds: GPUs freed at t=100 take the waiting job at
    the round after, not never (the forward run had stopped with no next event)."""
    from policy.gavel import GavelPolicy

    gavel = GavelPolicy()
    jobs = (job("L", 2, (est(2, 1.0),), iterations=20_000), job("S", 2, (est(2, 1.0),), iterations=100),
            job("W", 2, (est(2, 1.0),), iterations=100))
    snap = Snapshot(0.0, (NodeView("a100-1", "a100", 4),), jobs, TRIGGER_ROUND, 60.0, 0.0)
    first = gavel.decide(snap)
    assert first.for_job("L").assignment is None  # S and W have the node until t=100
    got = forecast(snap, gavel, first=first)
    assert 100.0 < got["L"].start_s <= 100.0 + gavel.round_s


def test_free_gpus_no_waiting_job_fits_cost_no_extra_decision():
    """Two GPUs stay free beside a queue of 4-GPU jobs: the run decides at each end only,
    not a round after each as well."""
    calls = []

    class Counting(FcfsPolicy):
        def decide(self, snapshot):
            calls.append(snapshot.now_s)
            return super().decide(snapshot)

    jobs = tuple(job(f"J{k}", 4, (est(4, 1.0),), iterations=1000) for k in range(10))
    nodes = (NodeView("a100-1", "a100", 4), NodeView("a100-2", "a100", 2))
    got = forecast(Snapshot(0.0, nodes, jobs, TRIGGER_ROUND, 300.0, 0.0), Counting(), max_decisions=1000)
    assert [got[j.job_id].start_s for j in jobs] == [1000.0 * k for k in range(10)]
    assert calls == [1000.0 * k for k in range(10)]


def test_a_job_started_on_a_cell_the_memory_model_rejects_ends_and_the_queue_behind_it_starts():
    """cells-ilp starts a job on what it asked for when the memory model rejects every
    Cell but the platform runs it: with no rate there, it never ended in the forecast,
    and the job queued behind it never started."""
    asked = Cell("a100", 4, 4, 1)
    rejected = tuple(CellEstimate(Cell("a100", n, min(n, 4), 1), (), 4, 0.0, 0.0, 99.0, False, "out of memory")
                     for n in (2, 4, 8))
    big = JobView("big", "u", JobSpec("gpt-1.3b", BATCH, 4, "a100"), 0.0, PENDING, None, 0.0, 100, 0, 0.0,
                  None, False, rejected, rejected, frozenset({asked}))
    after = job("next", 4, (est(4, 0.5),), iterations=100)
    snap = Snapshot(0.0, (NodeView("a100-1", "a100", 4, 0),), (big, after), TRIGGER_ROUND, 10.0, 0.0)
    got = forecast(snap, CellsIlpPolicy())
    assert (got["next"].start_s, got["next"].end_s) == (0.0, 50.0)
    assert (got["big"].start_s, got["big"].end_s) == (50.0, 150.0)  # the policies' 1 s per iteration
