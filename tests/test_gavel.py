"""Gavel as published (``policy.gavel``): its LP by hand, its rounds, its preemption."""

import math
from dataclasses import replace

import pytest

from policy._solver import capacity_by_type
from policy.gavel import GavelPolicy, GavelState, JobRounds, per_type_options, priority, solve_allocation
from policy.gavel_greedy import GavelGreedyPolicy
from policy.interface import SUSPEND, TRIGGER_ARRIVAL, TRIGGER_ROUND, implied_actions
from policy.registry import make_policy
from test_policies import a100, job, run, snap, v100

LONG = 10 ** 9  # iterations: no job finishes during a test


def three_jobs():
    """Three jobs on one a100 node (4 GPUs) and one v100 node (4 GPUs); samples/s:

    ======  ====  ======  ======
    job     GPUs  a100    v100
    ======  ====  ======  ======
    A       2     10      2
    B       2     2       10
    C       4     12      12
    ======  ====  ======  ======
    """
    return [job("A", {("a100", 2): 10.0, ("v100", 2): 2.0}, gpus=2, iterations=LONG),
            job("B", {("a100", 2): 2.0, ("v100", 2): 10.0}, gpus=2, submit=1.0, iterations=LONG),
            job("C", {("a100", 4): 12.0, ("v100", 4): 12.0}, gpus=4, submit=2.0, iterations=LONG)]


def test_the_lp_allocation_of_three_jobs_on_two_types_matches_the_hand_solution():
    # Hand derivation. Every job has the same global batch, so iterations/s are samples/s
    # ÷ 64 for all of them and the optimum is the one of samples/s:
    #   max 10·Aa + 2·Av + 2·Ba + 10·Bv + 12·Ca + 12·Cv
    #   s.t. Aa + Av ≤ 1, Ba + Bv ≤ 1, Ca + Cv ≤ 1                       (time per job)
    #        2·Aa + 2·Ba + 4·Ca ≤ 4,  2·Av + 2·Bv + 4·Cv ≤ 4             (GPUs per type)
    # Value per GPU-unit of time: A on a100 5, on v100 1; B on a100 1, on v100 5; C 3 on
    # either. A can fill at most 2 a100 GPU-units (Aa ≤ 1), B at most 2 v100 units, so the
    # objective is at most 2·5 + 2·3 on a100 plus 2·5 + 2·3 on v100 = 32, reached only by
    # Aa = 1, Bv = 1 and C on the 2 units left of each type: Ca = Cv = 2/4 = 0.5 (and
    # Ca + Cv = 1 keeps C's time row). Every other variable is 0. Unique optimum, 32.
    jobs = three_jobs()
    s = snap([a100(1), v100(1)], jobs, trigger=TRIGGER_ROUND)
    capacity = capacity_by_type(s)
    assert capacity == {"a100": 4, "v100": 4}
    options = {j.job_id: per_type_options(j, s, capacity) for j in jobs}
    x = solve_allocation(s.jobs, options, capacity)
    assert set(x) == {"A", "B", "C"}
    assert x["A"] == pytest.approx({"a100": 1.0})
    assert x["B"] == pytest.approx({"v100": 1.0})
    assert x["C"] == pytest.approx({"a100": 0.5, "v100": 0.5})
    # The policy's first round solves the same program and keeps it in its state.
    d = run(GavelPolicy(), s)
    flat = {(i, t): v for i, shares in d.policy_state.allocation for t, v in shares}
    assert flat == pytest.approx({("A", "a100"): 1.0, ("B", "v100"): 1.0, ("C", "a100"): 0.5, ("C", "v100"): 0.5})


def test_gavels_priority_rule():
    assert priority(0.5, 0, 0) == 0.5e9          # never ran there: X·10⁹
    assert priority(0.5, 1, 2) == pytest.approx(1.0)  # X ÷ (1/2)
    assert priority(0.5, 2, 2) == pytest.approx(0.5)
    assert priority(0.0, 0, 5) == 0.0


def play_rounds(policy, nodes, jobs, rounds, state=None, round_s=360.0):
    """Run ``rounds`` rounds, applying each decision; (per round job → type or None, state)."""
    log = []
    for k in range(rounds):
        s = snap(nodes, jobs, now=round_s * k, trigger=TRIGGER_ROUND, state=state)
        d = run(policy, s)
        state = d.policy_state
        got = {jd.job_id: jd.assignment for jd in d.jobs}
        jobs = [replace(j, assignment=got.get(j.job_id, j.assignment),
                        state="running" if got.get(j.job_id, j.assignment) else "pending") for j in jobs]
        log.append({j.job_id: (j.assignment.cell.gpu_type if j.assignment else None) for j in jobs})
    return log, state


def two_jobs_sharing_half_each():
    """Two 4-GPU jobs on one a100 node, and a state whose LP gave each X = 0.5 there.

    The LP itself gives such a split only at a tie: with equal GPU counts its constraint
    matrix is totally unimodular and the simplex answers integral; mixed counts give
    fluid fractions whole rounds cannot always realize (A's X = 1 above cannot coexist
    with C's 0.5 on a100). So the allocation is handed in, as a solved round would keep it.
    """
    jobs = [job("P", {("a100", 4): 12.0}, gpus=4, iterations=LONG),
            job("Q", {("a100", 4): 12.0}, gpus=4, submit=1.0, iterations=LONG)]
    nodes = [a100(1)]
    fingerprint = (("P", "Q"), (("a100", 4),))
    state = GavelState(allocation=(("P", (("a100", 0.5),)), ("Q", (("a100", 0.5),))), solved_for=fingerprint)
    return nodes, jobs, state


def test_rounds_share_time_as_the_allocation_says():
    nodes, jobs, state = two_jobs_sharing_half_each()
    log, state = play_rounds(GavelPolicy(), nodes, jobs, 10, state)
    ran_p = sum(r["P"] == "a100" for r in log)
    ran_q = sum(r["Q"] == "a100" for r in log)
    assert ran_p == ran_q == 5  # X = 0.5: half the rounds each
    assert all((r["P"] is None) != (r["Q"] is None) for r in log)  # one at a time, never idle
    history = dict(state.history)
    assert history["P"] == JobRounds(10, (("a100", 5),), (("a100", 0.0),))


def test_a_job_not_picked_is_preempted_and_resumes_later():
    nodes, jobs, state = two_jobs_sharing_half_each()
    policy = GavelPolicy()
    s = snap(nodes, jobs, now=0.0, trigger=TRIGGER_ROUND, state=state)
    d1 = run(policy, s)
    assert d1.for_job("P").assignment is not None and d1.for_job("Q").assignment is None
    running = [replace(jobs[0], assignment=d1.for_job("P").assignment, state="running"), jobs[1]]
    s2 = snap(nodes, running, now=360.0, trigger=TRIGGER_ROUND, state=d1.policy_state)
    d2 = run(policy, s2)
    assert d2.for_job("P").assignment is None and d2.for_job("P").reason.startswith("preempted")
    assert d2.for_job("Q").assignment is not None
    kinds = {a.job_id: a.kind for a in implied_actions(s2, d2)}
    assert kinds == {"P": SUSPEND, "Q": "start"}


def test_over_rounds_every_lp_job_gets_gpus_and_jobs_change_type_as_gavel_does():
    # The three jobs of the hand case, Gavel's per-type queues (a100 first, the cluster's
    # order): C (X = 0.5 on each type) runs every round, alternating types; A and B fill
    # what C leaves (X = 0 entries still take leftover GPUs: the mechanism is
    # work-conserving), so they are preempted or change type round by round.
    log, _ = play_rounds(GavelPolicy(), [a100(1), v100(1)], three_jobs(), 12)
    assert all(r["C"] is not None for r in log)
    assert 3 <= sum(r["C"] == "a100" for r in log) <= 6
    assert sum(r["A"] == "a100" for r in log) >= 6 and sum(r["B"] == "v100" for r in log) >= 3
    # Used GPUs per round: never more than the 4 of each type.
    for r in log:
        for t in ("a100", "v100"):
            assert sum({"A": 2, "B": 2, "C": 4}[i] for i, got in r.items() if got == t) <= 4


def test_global_queue_gives_the_lp_types_first():
    # Sorted across types, the first round gives A a100 and B v100, their LP types; C's
    # 4 GPUs fit on neither type after them and it waits for the next round.
    log, _ = play_rounds(GavelPolicy(global_queue=True), [a100(1), v100(1)], three_jobs(), 1)
    assert log[0] == {"A": "a100", "B": "v100", "C": None}


def test_between_rounds_nothing_changes_and_arrivals_wait_for_the_next_round():
    policy = GavelPolicy()
    first = run(policy, snap([a100(1)], [job("a", {("a100", 2): 10.0}, gpus=2)], now=0.0,
                             trigger=TRIGGER_ROUND))
    state = first.policy_state
    assert state.next_round_s == 360.0 and state.rounds_done == 1
    running = replace(job("a", {("a100", 2): 10.0}, gpus=2), assignment=first.for_job("a").assignment,
                      state="running")
    late = job("b", {("a100", 2): 10.0}, gpus=2, submit=100.0)
    for now, trigger in ((100.0, TRIGGER_ARRIVAL), (300.0, TRIGGER_ROUND)):  # e.g. the simulator's 300 s tick
        d = run(policy, snap([a100(1)], [running, late], now=now, trigger=trigger, state=state))
        assert d.jobs == () and d.policy_state is state
    d = run(policy, snap([a100(1)], [running, late], now=360.0, trigger=TRIGGER_ARRIVAL, state=state))
    assert d.for_job("b").assignment is not None
    assert d.for_job("a").assignment == running.assignment  # kept on its nodes
    assert d.policy_state.next_round_s == 720.0


@pytest.mark.parametrize("grid_s", [720.0, 1080.0])  # the old clock's next round: passed, or still ahead
def test_an_arrival_on_an_idle_cluster_starts_the_rounds_again_from_it(grid_s):
    """The last job left; a new one arrives at t=1000. Its round is now and the next 360 s
    later (the simulator's round clock restarts there too); a later arrival waits for it."""
    policy = GavelPolicy()
    idle = GavelState(next_round_s=grid_s, rounds_done=3)
    first = run(policy, snap([a100(1)], [job("a", {("a100", 2): 10.0}, gpus=2)], now=1000.0,
                             trigger=TRIGGER_ARRIVAL, state=idle))
    assert first.for_job("a").assignment is not None
    assert (first.policy_state.next_round_s, first.policy_state.rounds_done) == (1360.0, 4)
    running = replace(job("a", {("a100", 2): 10.0}, gpus=2), assignment=first.for_job("a").assignment,
                      state="running")
    late = job("b", {("a100", 2): 10.0}, gpus=2, submit=1100.0)
    d = run(policy, snap([a100(1)], [running, late], now=1100.0, trigger=TRIGGER_ARRIVAL, state=first.policy_state))
    assert d.jobs == ()  # a round is under way: it waits for the next


def test_both_names_are_registered():
    assert isinstance(make_policy("gavel"), GavelPolicy)
    assert isinstance(make_policy("gavel-greedy"), GavelGreedyPolicy)
    with pytest.raises(ValueError):
        GavelPolicy(round_s=0.0)


def test_a_decision_over_a_thousand_jobs_stays_fast():
    import time

    rates = [{("a100", 1): 10.0, ("a100", 2): 18.0, ("a100", 4): 30.0, ("v100", 1): 6.0, ("v100", 2): 11.0,
              ("v100", 4): 20.0}, {("a100", 1): 8.0, ("a100", 2): 15.0, ("a100", 4): 26.0, ("v100", 1): 7.0,
                                   ("v100", 2): 13.0, ("v100", 4): 24.0}]
    jobs = [job(f"j{k}", rates[k % 2], gpus=[1, 2, 4][k % 3], submit=float(k), iterations=LONG)
            for k in range(1000)]
    nodes = [a100(k) for k in range(64)] + [v100(k) for k in range(64)]
    policy = GavelPolicy()
    t0 = time.perf_counter()
    d = run(policy, snap(nodes, jobs, now=0.0, trigger=TRIGGER_ROUND))
    first_s = time.perf_counter() - t0
    assert sum(jd.assignment is not None for jd in d.jobs) > 100
    assert first_s < 5.0  # generous: a shared 2-core host; measured well under a second
    assert math.isfinite(d.policy_state.next_round_s)


def test_gpus_a_move_that_did_not_fit_left_idle_go_to_a_waiting_job_that_fits():
    """Gavel's pick counts a type's GPUs as freed by every job it moves away; a move whose
    new Cell cannot be placed keeps the job where it was, and the 16-GPU job picked for
    the freed GPUs no longer fits. Seeded jobs of the measured table on a100 2x4, v100
    1x16, a40 3x2: after every round no waiting job fits the GPUs left free on a type it
    has a Cell of (14 of 16 v100 GPUs had idled two rounds with seven v100 jobs waiting)."""
    import random

    from estimator.cluster import cluster_from_dict
    from estimator.jobs import JobSpec
    from policy.measured import load_measured, measured_estimates
    from policy.placement import FreeGpus
    from policy.simulator import EstimateCache, SimConfig, simulate
    from policy.trace import TraceJob

    table, node_size = load_measured(), {"a100": 4, "v100": 16, "a40": 2}
    groups = [("a100", 2, 4), ("v100", 1, 16), ("a40", 3, 2)]
    cluster = cluster_from_dict({"name": "t", "node_groups": [
        {"gpu_type": t, "nodes": n, "gpus_per_node": g} for t, n, g in groups]})
    requests = sorted({(p.model, p.global_batch, p.num_gpus, p.gpu_type, t) for p in table.points
                       if p.iter_time_s is not None and p.iter_time_s <= 300 and p.gpu_type in node_size
                       and p.num_gpus <= cluster.total_gpus(p.gpu_type)
                       and (t := table.best_locality_iter_time_s(p.model, p.global_batch, p.gpu_type, p.num_gpus,
                                                                 node_size[p.gpu_type])) is not None})
    rng, jobs, t = random.Random(2), [], 0.0
    for i in range(30):
        t += rng.choice([0, 10, 100, 600])
        model, batch, gpus, gtype, it = rng.choice(requests)
        iterations = max(1, int(rng.choice([600, 3600, 7200]) / it))
        jobs.append(TraceJob(f"j{i}", t, JobSpec(model, batch, gpus, gtype), iterations, it, None))
    policy, idle_fits = GavelPolicy(), []
    decide = policy.decide

    def checked(snapshot):
        decision = decide(snapshot)
        after = {j.job_id: j.assignment for j in snapshot.jobs}
        after.update({d.job_id: d.assignment for d in decision.jobs})
        free = FreeGpus.from_snapshot(snapshot, keep_running=False)
        for a in after.values():
            if a is not None:
                free.take(a.placement)
        capacity = capacity_by_type(snapshot)
        for j in snapshot.jobs:
            if after[j.job_id] is None and decision.jobs:
                idle_fits.extend((snapshot.now_s, j.job_id, gpu_type) for gpu_type, e
                                 in per_type_options(j, snapshot, capacity).items() if free.place(e.cell) is not None)
        return decision
    policy.decide = checked
    cache = EstimateCache(cluster, table, False, lambda spec, space: measured_estimates(spec, cluster, table, space))
    result = simulate(policy, tuple(jobs), cluster, table, SimConfig(), cache)
    assert all(o.status == "finished" for o in result.jobs)
    assert idle_fits == []


def test_a_job_the_round_did_not_pick_keeps_its_nodes_when_it_gets_idle_gpus_back():
    """Given back idle GPUs of its type, a job not picked this round went wherever placement
    put it first: two such jobs traded nodes, and each trade was a restart."""
    import random

    from policy.interface import implied_actions
    from test_policies import a100

    rng, moved = random.Random(1), []
    for _ in range(60):
        jobs = [job("P", {("a100", 4): rng.choice([5.0, 20.0, 40.0])}, gpus=4, submit=50.0, iterations=LONG)]
        slots = [("a100-1", 2), ("a100-1", 2), ("a100-2", 2), ("a100-2", 2)]
        rng.shuffle(slots)
        jobs += [job(f"J{k}", {("a100", 2): rng.choice([1.0, 3.0, 10.0])}, gpus=2, submit=float(k), iterations=LONG,
                     running=("a100", 2, ((n, 2),))) for k, (n, _) in enumerate(slots)]
        jobs.append(job("R", {("a100", 4): rng.choice([1.0, 10.0])}, gpus=4, submit=9.0, iterations=LONG,
                        running=("a100", 4, (("a100-3", 4),))))
        s = snap([a100(1), a100(2), a100(3)], jobs, trigger=TRIGGER_ROUND)
        d = run(GavelPolicy(), s)
        moved += [a.job_id for a in implied_actions(s, d) if a.kind == "move"
                  and "left idle" in d.for_job(a.job_id).reason]
    assert moved == []
