"""cells-ilp: the program's answer equals brute force, decisions never over-commit, the
greedy fallback is feasible, guarantees, deadlines and share limits hold, and it is deterministic."""

import itertools
import math
import random
from dataclasses import replace

import pytest

from estimator.cells import Cell, CellEstimate
from estimator.jobs import JobSpec
from policy.cells_ilp import CellsIlpPolicy, CellsIlpState, _shape_of, solve_choice
from policy.interface import (PENDING, RUNNING, TRIGGER_ROUND, Assignment, JobView, NodeView, Snapshot,
                              final_assignments, validate_decision)
from policy.placement import FreeGpus
from policy.registry import make_policy

BATCH = 64
NODE_SIZE = {"a100": 4, "v100": 8}


def est(gpu_type, n, rate, stages=1):
    cell = Cell(gpu_type, n, min(n, NODE_SIZE[gpu_type]), stages)
    return CellEstimate(cell, (), 4, BATCH / rate, rate, 1.0, True, "")


def job(job_id, rates, *, gpus, gpu_type="a100", submit=0.0, running=None, iterations=1000, done=0.0,
        user="u", guaranteed=False, deadline=None, restarts=0, last_change=None):
    ests = tuple(est(t, n, r) for (t, n), r in sorted(rates.items()))
    assignment = None
    if running is not None:
        t, n, placement = running
        assignment = Assignment(est(t, n, 1.0).cell, placement)
    return JobView(job_id, user, JobSpec("gpt-1.3b", BATCH, gpus, gpu_type), submit,
                   RUNNING if running else PENDING, assignment, done, iterations, restarts,
                   submit if last_change is None else last_change, deadline, guaranteed, ests, ests)


def nodes(a100=2, v100=1):
    return tuple([NodeView(f"a100-{k}", "a100", 4) for k in range(a100)]
                 + [NodeView(f"v100-{k}", "v100", 8) for k in range(v100)])


def snap(jobs, node_views=None, now=10_000.0, restart_cost_s=200.0, state=None):
    return Snapshot(now, node_views or nodes(), tuple(jobs), TRIGGER_ROUND, 300.0, restart_cost_s, state)


def random_instance(seed, n_jobs=4):
    """Jobs with random rates on a100 1–8 and v100 1–8; some running on free-standing placements."""
    rng = random.Random(seed)
    jobs, used = [], {"a100-0": 0, "a100-1": 0, "v100-0": 0}
    for k in range(n_jobs):
        per_gpu = {"a100": rng.uniform(5, 20), "v100": rng.uniform(2, 12)}
        rates = {(t, n): per_gpu[t] * n * rng.uniform(0.6, 1.0) for t in ("a100", "v100") for n in (1, 2, 4, 8)}
        asked = rng.choice([1, 2, 4])
        running = None
        if rng.random() < 0.4:
            for name in ("a100-0", "a100-1"):
                if used[name] + asked <= 4:
                    used[name] += asked
                    running = ("a100", asked, ((name, asked),))
                    break
        jobs.append(job(f"j{k}", rates, gpus=asked, submit=rng.uniform(0, 5000), running=running,
                        iterations=rng.randint(200, 5000), done=rng.uniform(0, 100), last_change=0.0))
    return snap(jobs)


def relaxation_ok(cells, free: FreeGpus) -> bool:
    """The program's capacity rows, re-derived: per type GPUs, and per node share s."""
    for gtype, names in free.by_type.items():
        mine = [c for c in cells if c.gpu_type == gtype]
        if sum(c.num_gpus for c in mine) > free.free_of_type(gtype):
            return False
        for s in (2, 4, 8):
            need = sum(c.num_gpus for c in mine if min(c.gpus_per_node, c.num_gpus) >= s)
            if need > sum(free.free[n] // s * s for n in names):
                return False
    return True


@pytest.mark.parametrize("seed", range(6))
def test_program_answer_equals_brute_force_optimum(seed):
    s = random_instance(seed)
    policy = CellsIlpPolicy()
    options = {}
    for j in s.jobs:
        options[j.job_id] = policy.options(s, j)[0]
    free = FreeGpus.from_snapshot(s)
    for j in s.jobs:
        if j.assignment is not None:
            free.release(j.assignment.placement)
    best = -float("inf")
    for combo in itertools.product(*options.values()):
        if relaxation_ok([o.cell for o in combo if o.cell is not None], free):
            best = max(best, sum(o.value for o in combo))
    got, how = solve_choice(options, free, {j.job_id: j.user for j in s.jobs}, {}, 5.0)
    assert how == "ILP" and got is not None
    assert sum(o.value for o in got.values()) == pytest.approx(best, rel=1e-6)
    assert relaxation_ok([o.cell for o in got.values() if o.cell is not None], free)


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("solvers", [("highs", "cbc"), ()])
def test_decisions_never_over_commit_types_or_nodes(seed, solvers):
    s = random_instance(100 + seed, n_jobs=7)
    d = CellsIlpPolicy(solvers=solvers).decide(s)
    validate_decision(s, d)  # raises on an over-committed node or a wrong-type placement
    final = final_assignments(s, d)
    capacity = s.gpus_by_type()
    for gtype in capacity:
        assert sum(a.num_gpus for a in final.values() if a and a.cell.gpu_type == gtype) <= capacity[gtype]
    for a in final.values():
        if a is not None:  # the Cell's own layout, as estimated (and measured)
            assert all(g == min(a.cell.gpus_per_node, a.cell.num_gpus) for _, g in a.placement)


def crowded():
    """Three pending jobs that each want the whole a100 node; only one fits."""
    rates = {("a100", 4): 40.0}
    jobs = [job(f"p{k}", rates, gpus=4, submit=float(k), iterations=1000 * (k + 1)) for k in range(3)]
    return snap(jobs, nodes(a100=1, v100=0))


def test_no_solver_means_greedy_answer_that_is_valid_and_uses_the_gpus():
    s = crowded()
    assert solve_choice({}, FreeGpus.from_snapshot(s), {}, {}, 1.0, solvers=())[0] == {}
    d = CellsIlpPolicy(solvers=()).decide(s)
    validate_decision(s, d)
    started = [x.job_id for x in d.jobs if x.assignment is not None]
    assert started == ["p0"]  # the shortest job, by weight
    assert "greedy" in d.for_job("p0").reason


def test_ilp_prefers_the_job_closest_to_finishing():
    s = crowded()
    d = CellsIlpPolicy().decide(s)
    validate_decision(s, d)
    assert [x.job_id for x in d.jobs if x.assignment is not None] == ["p0"]
    assert "ILP" in d.for_job("p0").reason


def test_aging_lets_a_long_waiting_job_overtake_a_short_newcomer():
    rates = {("a100", 4): 40.0}
    old = job("old", rates, gpus=4, submit=0.0, iterations=4000)
    new = job("new", rates, gpus=4, submit=99_000.0, iterations=1000)
    s = snap([old, new], nodes(a100=1, v100=0), now=100_000.0)
    d = CellsIlpPolicy(aging_s=3600.0).decide(s)
    assert d.for_job("old").assignment is not None and d.for_job("new").assignment is None


def guaranteed_instance(guaranteed):
    # The running job asked for 4 a100; a short newcomer would like the node, and the
    # running job could be squeezed to 2 GPUs (slower than what it asked for).
    rates = {("a100", 2): 20.0, ("a100", 4): 40.0}
    placement = (("a100-0", 4),)
    r = job("r", rates, gpus=4, running=("a100", 4, placement), iterations=100_000, guaranteed=guaranteed,
            last_change=0.0)
    p = job("p", {("a100", 2): 20.0, ("a100", 4): 40.0}, gpus=4, submit=9_000.0, iterations=200)
    return snap([r, p], nodes(a100=1, v100=0), restart_cost_s=10.0)


def test_guaranteed_job_keeps_at_least_its_requested_throughput():
    free_for_all = CellsIlpPolicy().decide(guaranteed_instance(False))
    assert final_assignments(guaranteed_instance(False), free_for_all)["r"] != \
        guaranteed_instance(False).job("r").assignment  # without the guarantee it gives way
    assert free_for_all.for_job("r").reason.endswith("for job p")  # and says to whom
    s = guaranteed_instance(True)
    d = CellsIlpPolicy().decide(s)
    validate_decision(s, d)
    a = final_assignments(s, d)["r"]
    assert a is not None and a.cell.num_gpus == 4


def test_deadline_is_a_constraint_and_a_missed_one_is_reported():
    rates = {("a100", 1): 10.0, ("a100", 4): 40.0}
    # 1000 iterations × 64 samples: 6400 s on one GPU, 1600 s on four.
    tight = job("tight", rates, gpus=1, iterations=1000, deadline=10_000.0 + 3000.0)
    hopeless = job("hopeless", rates, gpus=1, iterations=1000, deadline=10_000.0 + 100.0, user="v")
    s = snap([tight, hopeless], nodes(a100=2, v100=0), restart_cost_s=10.0)
    d = CellsIlpPolicy().decide(s)
    validate_decision(s, d)
    assert d.for_job("tight").assignment.cell.num_gpus == 4
    assert "deadline" in d.for_job("hopeless").reason


def test_share_limit_caps_a_users_gpus():
    rates = {("a100", 4): 40.0}
    jobs = [job(f"p{k}", rates, gpus=4, submit=float(k), user="alice") for k in range(2)]
    s = snap(jobs, nodes(a100=2, v100=0))
    assert sum(1 for x in CellsIlpPolicy().decide(s).jobs if x.assignment) == 2
    d = CellsIlpPolicy(share_limits={"alice": 0.5}).decide(s)
    validate_decision(s, d)
    assert sum(x.assignment.num_gpus for x in d.jobs if x.assignment) == 4


def test_restart_penalty_and_min_interval_keep_a_running_job_in_place():
    rates = {("a100", 2): 20.0, ("a100", 4): 38.0}
    r = job("r", rates, gpus=2, running=("a100", 2, (("a100-0", 2),)), iterations=2000, last_change=0.0)
    s = snap([r], nodes(a100=1, v100=0), restart_cost_s=600.0)
    # Growing to 4 GPUs saves ~1700 s of 3200 but a restart costs 600 s: worth it.
    assert final_assignments(s, CellsIlpPolicy().decide(s))["r"].cell.num_gpus == 4
    recent = snap([job("r", rates, gpus=2, running=("a100", 2, (("a100-0", 2),)), iterations=2000,
                       last_change=9_500.0)], nodes(a100=1, v100=0), restart_cost_s=600.0)
    assert final_assignments(recent, CellsIlpPolicy().decide(recent))["r"].cell.num_gpus == 2
    sticky = snap([job("r", rates, gpus=2, running=("a100", 2, (("a100-0", 2),)), iterations=2000,
                       last_change=0.0, restarts=5)], nodes(a100=1, v100=0), restart_cost_s=600.0)
    assert final_assignments(sticky, CellsIlpPolicy().decide(sticky))["r"].cell.num_gpus == 2
    assert final_assignments(sticky, CellsIlpPolicy(restart_penalty=False).decide(sticky))["r"].cell.num_gpus == 4


def test_long_job_is_not_restarted_for_a_small_speed_up():
    # A restart idles the job's GPUs: it weighs at least what it would for a job with an
    # hour left, however long the job is. 300,000 iterations: about 270 h left.
    def grown(rate_on_4):
        rates = {("a100", 2): 20.0, ("a100", 4): rate_on_4}
        r = job("r", rates, gpus=2, running=("a100", 2, (("a100-0", 2),)), iterations=300_000, last_change=0.0)
        s = snap([r], nodes(a100=1, v100=0), restart_cost_s=600.0)
        return final_assignments(s, CellsIlpPolicy().decide(s))["r"].cell.num_gpus

    assert grown(20.4) == 2  # 2 % faster saves hours, but a restart weighs 600 s of an hour-long job
    assert grown(40.0) == 4  # twice as fast is worth it


def test_ablations_restrict_type_and_count():
    rates = {("a100", 2): 10.0, ("v100", 2): 30.0, ("v100", 4): 60.0}
    p = job("p", rates, gpus=2, gpu_type="a100")
    s = snap([p])
    assert final_assignments(s, make_policy("cells-ilp").decide(s))["p"].cell.num_gpus == 4
    assert final_assignments(s, make_policy("cells-ilp-no-count-change").decide(s))["p"].cell == \
        Cell("v100", 2, 2, 1)
    assert final_assignments(s, make_policy("cells-ilp-no-type-change").decide(s))["p"].cell.gpu_type == "a100"


def test_deterministic_and_skips_an_unchanged_round():
    s = random_instance(7, n_jobs=7)
    d1, d2 = CellsIlpPolicy().decide(s), CellsIlpPolicy().decide(s)
    assert d1 == d2
    assert isinstance(d1.policy_state, CellsIlpState)
    # The next snapshot, with the decision applied and nothing else happening, is skipped.
    final = final_assignments(s, d1)
    jobs = [JobView(j.job_id, j.user, j.spec, j.submit_time_s, RUNNING if final[j.job_id] else PENDING,
                    final[j.job_id], j.iterations_done, j.iterations_total, j.restarts, s.now_s,
                    j.deadline_s, j.guaranteed, j.estimates, j.dp_only_estimates) for j in s.jobs]
    again = snap(jobs, now=s.now_s + 300.0, state=d1.policy_state)
    assert CellsIlpPolicy().decide(again).jobs == ()


def test_gpus_freed_outside_the_policy_are_used_at_once():
    """An ordinary Slurm job ends: no managed job changed, but the round is solved again."""
    rates = {("a100", 2): 20.0, ("a100", 4): 38.0}
    blocked = tuple(NodeView(f"a100-{k}", "a100", 4, unmanaged_gpus=4 if k else 2) for k in range(2))
    r = job("r", rates, gpus=2, running=("a100", 2, (("a100-0", 2),)), iterations=20_000, last_change=0.0)
    first = snap([r], blocked)
    d1 = CellsIlpPolicy().decide(first)
    assert final_assignments(first, d1)["r"].cell.num_gpus == 2  # nothing free to grow into
    freed = tuple(NodeView(n.name, n.gpu_type, n.total_gpus) for n in blocked)
    later = snap([r], freed, now=first.now_s + 300.0, state=d1.policy_state)
    assert final_assignments(later, CellsIlpPolicy().decide(later))["r"].cell.num_gpus == 4


def test_job_the_memory_model_rejects_everywhere_runs_as_requested():
    asked = Cell("a100", 4, 4, 1)
    rejected = tuple(CellEstimate(Cell("a100", n, min(n, 4), 1), (), 4, 0.0, 0.0, 99.0, False, "out of memory")
                     for n in (2, 4, 8))
    j = JobView("big", "u", JobSpec("gpt-1.3b", BATCH, 4, "a100"), 0.0, PENDING, None, 0.0, 100, 0, 0.0,
                None, False, rejected, rejected, frozenset({asked}))
    s = snap([j], nodes(a100=1, v100=0))
    d = CellsIlpPolicy().decide(s)
    validate_decision(s, d)
    assert d.for_job("big").assignment.cell == asked
    no_platform = JobView("big2", "u", j.spec, 0.0, PENDING, None, 0.0, 100, 0, 0.0, None, False,
                          rejected, rejected, frozenset())
    d = CellsIlpPolicy().decide(snap([no_platform], nodes(a100=1, v100=0)))
    assert all(x.assignment is None for x in d.jobs)


def test_idle_gpus_run_a_job_slowly_until_its_fast_cell_frees_up():
    """Opportunistic execution: a slow Cell beats idle GPUs; the job is not suspended for
    nothing, and it moves once the fast Cell is free."""
    rates = {("a100", 4): 40.0, ("v100", 4): 4.0}  # v100 ten times slower: worse than waiting
    a100_busy = (NodeView("a100-0", "a100", 4, unmanaged_gpus=4), NodeView("v100-0", "v100", 8))
    pending = job("p", rates, gpus=4, iterations=20_000)
    s = snap([pending], a100_busy)
    # The program alone would keep it waiting for the a100 (v100 is worth less than waiting).
    assert all(o.cell is None or o.cell.gpu_type == "a100" for o in CellsIlpPolicy().options(s, pending)[0])
    started = final_assignments(s, CellsIlpPolicy().decide(s))["p"]
    assert started is not None and started.cell.gpu_type == "v100"
    on_v100 = job("p", rates, gpus=4, iterations=20_000, running=("v100", 4, started.placement), last_change=0.0)
    still_busy = snap([on_v100], a100_busy)
    assert final_assignments(still_busy, CellsIlpPolicy().decide(still_busy))["p"] == started
    freed = snap([on_v100], nodes(a100=1, v100=1))
    assert final_assignments(freed, CellsIlpPolicy().decide(freed))["p"].cell.gpu_type == "a100"


def small_jobs_filling(node_names, *, last_change):
    """One-GPU jobs, nearly done, on every GPU of the a100 nodes named."""
    return [job(f"s{k}-{n}", {("a100", 1): 10.0}, gpus=1, submit=last_change, last_change=last_change,
                running=("a100", 1, ((n, 1),)), iterations=100) for n in node_names for k in range(4)]


def test_a_wide_job_that_waited_past_the_bound_starts_on_gpus_of_small_jobs():
    """Small jobs always outbid a wide one for its GPUs; once it has waited reserve_after_s,
    the lowest-weight jobs on the nodes it needs are suspended for it."""
    wide = job("wide", {("a100", 8): 80.0}, gpus=8, submit=0.0, iterations=100_000)
    small = small_jobs_filling(["a100-0", "a100-1"], last_change=30_000.0)
    s = snap([wide, *small], nodes(a100=2, v100=0), now=36_000.0)  # waited 10 h
    unbounded = CellsIlpPolicy(reserve_after_s=None).decide(s)
    assert final_assignments(s, unbounded)["wide"] is None
    d = CellsIlpPolicy(reserve_after_s=6 * 3600.0).decide(s)
    validate_decision(s, d)
    final = final_assignments(s, d)
    assert final["wide"].cell == Cell("a100", 8, 4, 1)
    assert "starvation bound" in d.for_job("wide").reason
    assert all(final[j.job_id] is None for j in small)
    assert all(d.for_job(j.job_id).reason.startswith("suspended for job wide") for j in small)
    later = snap([wide, *small], nodes(a100=2, v100=0), now=18_000.0)  # waited 5 h: not yet
    assert final_assignments(later, CellsIlpPolicy(reserve_after_s=6 * 3600.0).decide(later))["wide"] is None


def test_nodes_are_held_for_a_starving_job_until_its_cell_fits():
    """Jobs changed too recently cannot be suspended: the nodes the starving job needs are
    held (no newcomer gets their free GPUs), and it starts once they are free."""
    wide = job("wide", {("a100", 8): 80.0}, gpus=8, submit=0.0, iterations=100_000)
    recent = job("recent", {("a100", 2): 20.0}, gpus=2, submit=35_500.0, last_change=35_500.0,
                 running=("a100", 2, (("a100-0", 2),)), iterations=100)
    newcomer = job("new", {("a100", 1): 10.0}, gpus=1, submit=35_900.0, iterations=100)
    s = snap([wide, recent, newcomer], nodes(a100=2, v100=0), now=36_000.0)
    assert final_assignments(s, CellsIlpPolicy(reserve_after_s=None).decide(s))["new"] is not None
    d = CellsIlpPolicy().decide(s)
    validate_decision(s, d)
    final = final_assignments(s, d)
    assert final["wide"] is None and final["new"] is None and final["recent"] is not None
    assert "held for a100x8" in d.for_job("wide").reason
    # The held nodes are in the decision, for the daemon to protect in Slurm.
    assert d.holds == (("wide", ("a100-0", "a100-1")),)
    done = snap([wide, newcomer], nodes(a100=2, v100=0), now=36_300.0)
    started = CellsIlpPolicy().decide(done)
    assert final_assignments(done, started)["wide"].cell == Cell("a100", 8, 4, 1)
    assert started.holds == ()


def test_the_starvation_bound_never_suspends_a_guaranteed_job():
    wide = job("wide", {("a100", 8): 80.0}, gpus=8, submit=0.0, iterations=100_000)
    small = [job(j.job_id, {("a100", 1): 10.0}, gpus=1, submit=30_000.0, last_change=30_000.0,
                 running=("a100", 1, j.assignment.placement), iterations=100, guaranteed=True)
             for j in small_jobs_filling(["a100-0", "a100-1"], last_change=30_000.0)]
    s = snap([wide, *small], nodes(a100=2, v100=0), now=36_000.0)
    final = final_assignments(s, CellsIlpPolicy().decide(s))
    assert final["wide"] is None and all(final[j.job_id] is not None for j in small)


def test_a_long_job_whose_model_fits_only_on_more_gpus_than_it_asked_starts_on_an_idle_cluster():
    """gpt-1.3b at batch 128 asks for one a100 and fits only on two. With 30 hours of work
    its start is worth less than waiting to the packing (the restart it costs outweighs a
    long job's weight), and backfill offered only Cells of at most one GPU: it never
    started, on an idle cluster. It now takes its larger Cell, as crius does."""
    from estimator.cluster import load_cluster
    from policy.measured import load_measured
    from policy.simulator import EstimateCache, SimConfig, simulate
    from policy.trace import TraceJob

    cluster, table = load_cluster("lab"), load_measured()
    cache = EstimateCache(cluster, table)
    spec = JobSpec("gpt-1.3b", 128, 1, "a100")
    feasible = [e for e in cache.get(spec)[0] if e.feasible]
    assert feasible and min(e.cell.num_gpus for e in feasible) == 2
    step_s = min(e.iteration_time_s for e in feasible)
    job = TraceJob("J", 0.0, spec, int(30 * 3600 / step_s), step_s, None)
    (outcome,) = simulate(CellsIlpPolicy(), (job,), cluster, table, SimConfig(), cache).jobs
    assert outcome.status == "finished" and outcome.first_start_s == 0.0


def busy_a100_jobs():
    """Two guaranteed jobs holding a100-0's four GPUs for a long time."""
    return [job(f"y{k}", {("a100", 2): 20.0}, gpus=2, iterations=10**7, user=f"w{k}", guaranteed=True,
                running=("a100", 2, (("a100-0", 2),))) for k in range(2)]


def test_a_running_job_that_will_miss_its_deadline_is_not_suspended_for_nothing():
    """Its own Cell misses the deadline and the Cells that would meet it are busy: the job
    keeps running (it was suspended with no taker for its GPUs, and waited beside them).
    The busy jobs are guaranteed theirs."""
    x_rates = {("v100", 1): 1.0, ("a100", 4): 40.0}
    x = job("x", x_rates, gpus=1, gpu_type="v100", iterations=1000, deadline=10_000.0 + 3000.0,
            running=("v100", 1, (("v100-0", 1),)))
    ys = busy_a100_jobs()
    s = snap([x, *ys], nodes(a100=1, v100=1), restart_cost_s=10.0)
    d = CellsIlpPolicy().decide(s)
    validate_decision(s, d)
    assert final_assignments(s, d)["x"] == x.assignment


def test_a_waiting_job_is_not_backfilled_on_a_cell_that_misses_its_deadline_when_one_meets_it():
    """The busy a100s would meet the deadline: the job waits for them rather than starting
    on a v100 that cannot finish it in time."""
    p = job("p", {("v100", 1): 1.0, ("a100", 4): 40.0}, gpus=1, gpu_type="v100", iterations=1000,
            deadline=10_000.0 + 3000.0)
    ys = busy_a100_jobs()
    s = snap([p, *ys], nodes(a100=1, v100=1), restart_cost_s=10.0)
    d = CellsIlpPolicy().decide(s)
    validate_decision(s, d)
    assert final_assignments(s, d)["p"] is None


def test_a_first_start_is_not_charged_a_restart_against_the_deadline():
    """The v100 finishes the job 100 s before its deadline; a restart (200 s) would miss it,
    but the job has never run, so its start is a launch, not a checkpoint and resume: it
    starts there rather than waiting for the busy a100s."""
    p = job("p", {("v100", 1): 64 / 2.5, ("a100", 4): 40.0}, gpus=1, gpu_type="v100", iterations=1000,
            deadline=10_000.0 + 2600.0)
    ys = busy_a100_jobs()
    s = snap([p, *ys], nodes(a100=1, v100=1), restart_cost_s=200.0)
    d = CellsIlpPolicy().decide(s)
    validate_decision(s, d)
    a = final_assignments(s, d)["p"]
    assert a is not None and a.cell.gpu_type == "v100"
    assert "deadline" not in d.for_job("p").reason


def mixed_instance(seed, n_jobs, now):
    """Jobs on a100, v100 and a10 nodes (some GPUs unmanaged): some Cells infeasible, a
    quarter guaranteed, some with deadlines, half running where a Cell fits, changed long
    ago (movable) or lately, pending ones waiting for up to a day."""
    rng = random.Random(seed)
    size = {"a100": 4, "v100": 8, "a10": 2}
    node_views = tuple(NodeView(f"{t}-{i}", t, size[t], rng.choice([0, 0, 0, 1]))
                       for t, k in (("a100", rng.randint(1, 3)), ("v100", rng.randint(0, 2)), ("a10", rng.randint(0, 3)))
                       for i in range(k))
    types = sorted({n.gpu_type for n in node_views})
    free = FreeGpus.from_snapshot(Snapshot(now, node_views, ()))
    jobs = []
    for k in range(n_jobs):
        per_gpu = {t: rng.uniform(2, 20) for t in size}
        asked_type, asked = rng.choice(types), rng.choice([1, 2, 4])
        ests = []
        for t, n, st in ((t, n, st) for t in size for n in (1, 2, 4, 8) for st in (1, 2) if st <= n):
            ok = rng.random() > 0.15
            rate = per_gpu[t] * n * rng.uniform(0.5, 1.0) * (1.05 if st == 2 else 1.0)
            ests.append(CellEstimate(Cell(t, n, min(n, size[t]), st), (), 4, BATCH / rate if ok else math.inf,
                                     rate, 1.0, ok, "" if ok else "oom"))
        assignment = None
        if rng.random() < 0.5:
            cands = [e for e in ests if e.feasible and e.cell.gpu_type in types]
            rng.shuffle(cands)
            for e in cands:
                if (p := free.place(e.cell)) is not None:
                    free.take(p)
                    assignment = Assignment(e.cell, p)
                    break
        submit, iterations = rng.uniform(0, now), rng.randint(100, 20000)
        done = rng.uniform(0, iterations * 0.5) if assignment else rng.choice([0, 0, rng.uniform(0, 50)])
        deadline = submit + rng.uniform(1000, 80000) if rng.random() < 0.3 else None
        last_change = rng.choice([submit, rng.uniform(submit, now)])
        jobs.append(JobView(f"j{k}", rng.choice(["u1", "u2"]), JobSpec("gpt-1.3b", BATCH, asked, asked_type), submit,
                            RUNNING if assignment else PENDING, assignment, done, iterations,
                            rng.randint(0, 3) if done else 0, last_change, deadline, rng.random() < 0.25,
                            tuple(ests), tuple(ests)))
    jobs.sort(key=lambda j: (j.submit_time_s, j.job_id))
    return Snapshot(now, node_views, tuple(jobs), TRIGGER_ROUND, 300.0, 200.0, None)


# Seeds 31 (a node held for a starving job went to a newcomer) and 340 (a guaranteed job
# lost its GPUs to a heavier job's move, and was suspended) failed before the fix.
@pytest.mark.parametrize("now, n_jobs, seed", [(100_000.0, 8, k) for k in range(24, 40)]
                         + [(20_000.0, 14, k) for k in range(332, 348)])
def test_held_nodes_and_running_guaranteed_jobs_are_kept_when_the_answer_is_placed(now, n_jobs, seed):
    """Placing the program's answer: no job but the starving one gets GPUs on a node held
    for it (they drain for it), and a guaranteed running job is never suspended, even when a
    heavier job's move took the GPUs it would have kept (it keeps them instead)."""
    s = mixed_instance(seed, n_jobs, now)
    d = CellsIlpPolicy().decide(s)
    validate_decision(s, d)
    final = final_assignments(s, d)
    held = {n for _, names in d.holds for n in names}
    for j in s.jobs:
        got = final[j.job_id]
        if got is not None and got != j.assignment and all(j.job_id != r for r, _ in d.holds):
            assert not {n for n, _ in got.placement} & held, (j.job_id, got, d.holds)
        if j.guaranteed and j.assignment is not None and \
                j.estimate_for(j.cell).samples_per_s >= _shape_of(j, s.derived_cache()).ref_rate:
            assert got is not None, (j.job_id, d.for_job(j.job_id).reason)  # it meets its guarantee


@pytest.mark.parametrize("guaranteed", [True, False])
def test_a_running_job_laid_out_as_slurm_placed_it_keeps_its_cell(guaranteed):
    """The daemon reads a running job's Cell from Slurm's allocation: 4 GPUs placed 2 + 2
    is a layout its estimates (4 on one node) do not list. It had no current option: a
    guaranteed job was suspended next to its own idle GPUs, another moved for nothing."""
    rates = {("a100", 2): 20.0, ("a100", 4): 38.0, ("a100", 8): 60.0}
    placed = (("a100-0", 2), ("a100-1", 2))
    g = job("g", rates, gpus=4, iterations=100_000, last_change=0.0, done=5000.0, guaranteed=guaranteed)
    g = replace(g, state=RUNNING, assignment=Assignment(Cell("a100", 4, 2, 1), placed))
    ns = (NodeView("a100-0", "a100", 4, unmanaged_gpus=2), NodeView("a100-1", "a100", 4, unmanaged_gpus=2),
          NodeView("a100-2", "a100", 4))
    s = snap([g], ns)
    assert final_assignments(s, CellsIlpPolicy().decide(s))["g"] == g.assignment


def test_a_deadline_job_is_not_placed_on_a_slower_layout_of_a_cell_that_meets_it():
    """The deadline was checked on each shape's fastest layout only; its other layouts went
    along as alternatives, and placement put the job on one ten times slower (one node of
    4 GPUs meets the deadline, 2 + 2 in 4 stages misses it)."""
    fast = CellEstimate(Cell("a100", 4, 4, 1), (), 4, BATCH / 40.0, 40.0, 1.0, True, "")
    slow = CellEstimate(Cell("a100", 4, 2, 4), (), 4, BATCH / 4.0, 4.0, 1.0, True, "")
    now = 10_000.0
    p = JobView("p", "u", JobSpec("gpt-1.3b", BATCH, 4, "a100"), 0.0, PENDING, None, 0.0, 1000, 0, 0.0,
                now + 3000.0, False, (fast, slow), (fast, slow))
    ns = (NodeView("a100-0", "a100", 4, unmanaged_gpus=2), NodeView("a100-1", "a100", 4, unmanaged_gpus=2))
    s = snap([p], ns, now=now)
    assert final_assignments(s, CellsIlpPolicy().decide(s))["p"] is None  # waits for a node of 4
    whole = (NodeView("a100-0", "a100", 4), NodeView("a100-1", "a100", 4, unmanaged_gpus=2))
    s = snap([p], whole, now=now)
    assert final_assignments(s, CellsIlpPolicy().decide(s))["p"].cell == fast.cell


@pytest.mark.parametrize("guaranteed", [False, True])
def test_a_job_running_on_a_cell_its_estimates_now_call_infeasible_is_not_suspended_for_nothing(guaranteed):
    """Its v100 estimates turned infeasible (a refit, say) while it ran there: it had no
    option of staying, was suspended "for jobs of higher weight" that did not exist, and
    its 8 GPUs idled; a guaranteed one too."""
    r = job("r", {("v100", 8): 30.0, ("a100", 4): 40.0}, gpus=8, gpu_type="v100", running=("v100", 8, (("v100-0", 8),)),
            last_change=0.0, guaranteed=guaranteed)
    estimates = tuple(replace(e, feasible=False, reason="out of memory") if e.cell.gpu_type == "v100" else e
                      for e in r.estimates)
    r = replace(r, estimates=estimates, dp_only_estimates=estimates)
    busy = job("busy", {("a100", 4): 40.0}, gpus=4, running=("a100", 4, (("a100-0", 4),)), last_change=9_990.0)
    s = snap([r, busy], node_views=(NodeView("a100-0", "a100", 4), NodeView("v100-0", "v100", 8)))
    d = CellsIlpPolicy().decide(s)
    validate_decision(s, d)
    assert d.for_job("r") is None or d.for_job("r").assignment == r.assignment
