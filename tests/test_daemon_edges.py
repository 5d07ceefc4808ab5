"""The daemon's rounds at the edges, without Slurm (``FakeSlurm``): a requeue that resets
Slurm's submit time, a rescale whose checkpoint is slow, a growing rescale still on its
old node, an elastic job with a spec error that Slurm does not start, a site whose gres
type names are not the catalog's, and a stop after a failed change of the hold reservation.

The same daemon against the real lab is in tests/test_daemon.py.
"""

import tempfile
import time
from dataclasses import replace
from pathlib import Path

import pytest

from estimator.contract import PlanComment, format_plan_comment
from policy.clock import SimulatedClock
from policy.interface import RESIZE, Action
from slurm_ext.act import Acts
from slurm_ext.config import resolve
from slurm_ext.daemon import Daemon
from slurm_ext.observe import cluster_spec, model_loader_for, partition_types, plan_comment
from slurm_ext.slurm_client import Gres, JobUpdate, SlurmJob, SlurmNode
from slurm_ext.store import Store
from test_daemon import NODES, TRAINER, node
from test_daemon_rounds import FakeSlurm

NOW = 1_800_000_000
SPEC = "elastic model=gpt-760m gpus=4 global_batch=64 iterations=1000000"
STARTED = format_plan_comment(PlanComment(requested="any", cell="a100x4:s1", plan="[dp4tp1]", why="started"))


def daemon_for(tmp_path, jobs, nodes, clock=None, **config):
    client = FakeSlurm(jobs, nodes, TRAINER)
    cfg = resolve({"state_db": str(tmp_path / "state.db"), "forecast_every_s": 0, **config}, {}, {})
    daemon = Daemon(cfg, client, Store(cfg.state_db), clock=clock or SimulatedClock(float(NOW)),
                    out=lambda line: None)
    return daemon, client


def seen_by_policy(daemon):
    """Every snapshot the policy is given, and every decision's managed jobs as act saw them."""
    seen = {"snapshots": [], "views": []}
    decide, act = daemon.policy.decide, daemon.actor.act
    daemon.policy.decide = lambda s: seen["snapshots"].append(s) or decide(s)

    def spy_act(snapshot, decision, views, *args, **kw):
        seen["views"].append(views)
        return act(snapshot, decision, views, *args, **kw)
    daemon.actor.act = spy_act
    return seen


def running(job_id=70, nodes=("a100-1",), gpu_type="a100", **kw):
    kw.setdefault("requeue", True)
    return SlurmJob(job_id, "alice", "t", "RUNNING", partition="a100", priority=1, comment=SPEC,
                    admin_comment=STARTED, gpus_per_node=4, node_count=len(nodes),
                    granted_gpus_per_node=(4,) * len(nodes), granted_gpu_type=gpu_type, nodes=nodes,
                    submit_time_s=NOW - 2000, start_time_s=NOW - 1000, **kw)


def held(job_id, submit_time_s, comment=SPEC, gpus_per_node=4, **kw):
    return SlurmJob(job_id, "alice", "t", "PENDING", reason="JobHeldAdmin", partition="a100", priority=0,
                    comment=comment, admin_comment="requested=any", gpus_per_node=gpus_per_node, node_count=1,
                    submit_time_s=submit_time_s, **kw)


def start_rescale(daemon, views, job_id, update):
    """The policy's rescale of ``job_id`` as the actor takes it: journaled, USR1 sent."""
    view = views[str(job_id)]
    daemon.actor.start_rescales([(Action(RESIZE, str(job_id), view.view.assignment, None, "grow"), update)],
                                views, Acts())


def test_guarantees_go_by_the_original_submission_after_a_requeue(tmp_path):
    """A rescale requeues the job and Slurm resets its SubmitTime: the older job keeps its
    guarantee (granted in submission order), not the job submitted after it."""
    now = int(time.time())
    jobs = [held(60, now - 3600, SPEC + " guaranteed=yes"), held(61, now - 600, SPEC + " guaranteed=yes")]
    daemon, client = daemon_for(tmp_path, jobs, [node("a100-1", "a100", 4, used=4)],
                                clock=SimulatedClock(float(now)), guarantees={"users": {"alice": 4}})
    seen = seen_by_policy(daemon)
    daemon.round()
    assert {v.job_id: v.guaranteed for v in seen["snapshots"][-1].jobs} == {"60": True, "61": False}
    client._jobs[60] = replace(client._jobs[60], submit_time_s=now - 5, restart_count=1)
    daemon.round()
    assert {v.job_id: v.guaranteed for v in seen["snapshots"][-1].jobs} == {"60": True, "61": False}


def test_a_rescale_whose_checkpoint_was_slow_is_not_stale_once_released(tmp_path):
    """The launch timeout counts from the release, not from the signal: a checkpoint that
    took five minutes (within ``rescale_timeout_s``) does not make the job, released a
    moment ago, look stuck and get decided afresh."""
    clock = SimulatedClock(float(NOW))
    daemon, client = daemon_for(tmp_path, [running()], [node("a100-1", "a100", 4, used=4), node("a100-2", "a100", 4)],
                                clock=clock, rescale_timeout_s=900)
    seen = seen_by_policy(daemon)
    daemon.round()
    grown = format_plan_comment(PlanComment(requested="any", cell="a100x8:s1", plan="[dp8tp1]", why="grow"))
    start_rescale(daemon, seen["views"][-1], 70,
                  JobUpdate(partition="a100", gpus_per_node=4, num_nodes=2, admin_comment=grown))
    clock.advance_to(NOW + 300)  # checkpointed, requeued held
    client._jobs[70] = replace(client._jobs[70], state="SPECIAL_EXIT", reason="JobHeldAdmin", priority=0,
                               granted_gpus_per_node=(), nodes=(), start_time_s=0, restart_count=1)
    jobs = lambda: {j.job_id: j for j in client.jobs()}  # noqa: E731
    daemon.actor.advance_rescales(jobs(), Acts())  # seen back
    clock.advance_to(NOW + 302)
    acts = Acts()
    daemon.actor.advance_rescales(jobs(), acts)  # updated and released
    assert acts.rescaled == [70]
    client._jobs[70] = replace(client._jobs[70], state="PENDING", reason="Resources", priority=100,
                               admin_comment=grown, node_count=2)
    client._nodes = (node("a100-1", "a100", 4), node("a100-2", "a100", 4))
    clock.advance_to(NOW + 310)
    assert not daemon._launch_stale(client._jobs[70], clock.now_s())
    client.calls.clear()
    report = daemon.round()
    assert report.actions == () and [c for c in client.calls if c[0] != "hold_nodes"] == []
    # Its 8 GPUs count as taken while Slurm starts it.
    assert sum(n.unmanaged_gpus for n in seen["snapshots"][-1].nodes) == 8
    # Still waiting three rounds after its release: decided afresh.
    clock.advance_to(NOW + 302 + 3 * 60 + 1)
    assert daemon._launch_stale(client._jobs[70], clock.now_s())


def test_a_growing_rescale_holds_its_new_node_while_the_job_checkpoints(tmp_path):
    """A job grows from a100-1 to a100-1 + a100-2. While it checkpoints on a100-1, a100-2
    is its new Cell's: another job is not started there."""
    clock = SimulatedClock(float(NOW))
    daemon, client = daemon_for(tmp_path, [running()], [node("a100-1", "a100", 4, used=4), node("a100-2", "a100", 4)],
                                clock=clock)
    seen = seen_by_policy(daemon)
    daemon.round()
    grown = format_plan_comment(PlanComment(requested="any", cell="a100x8:s1", plan="[dp8tp1]", why="grow"))
    start_rescale(daemon, seen["views"][-1], 70,
                  JobUpdate(partition="a100", gpus_per_node=4, num_nodes=2, admin_comment=grown,
                            required_nodes=("a100-1", "a100-2")))
    clock.advance_to(NOW + 5)
    client._jobs[71] = held(71, NOW + 4)
    client.calls.clear()
    report = daemon.round()
    assert report.rescaling == (70,)
    assert {n.name: n.unmanaged_gpus for n in seen["snapshots"][-1].nodes} == {"a100-1": 4, "a100-2": 4}
    assert ("start", 71) not in report.actions
    assert not [c for c in client.calls if c[0] == "update" and c[1] == 71 and c[2].required_nodes]


def test_a_spec_error_job_slurm_does_not_start_leaves_the_idle_gpus_to_the_policy(tmp_path):
    """An elastic job with a bad spec, released as submitted, waits on a dependency: its
    GPUs are not kept from the policy beyond the launch timeout; a held one just released
    counts until then."""
    clock = SimulatedClock(float(NOW))
    waiting = SlurmJob(50, "bob", "x", "PENDING", reason="Dependency", partition="a100", priority=100,
                       comment="elastic model=no-such-model gpus=4 global_batch=64 iterations=100",
                       admin_comment="requested=any", gpus_per_node=4, node_count=1, submit_time_s=NOW - 3600)
    daemon, client = daemon_for(tmp_path, [waiting, held(51, NOW - 30)], [node("a100-1", "a100", 4)], clock=clock)
    seen = seen_by_policy(daemon)
    report = daemon.round()  # never released by the daemon: its GPUs stay the policy's
    assert ("annotate", 50) in report.actions and ("start", 51) in report.actions
    assert [n.unmanaged_gpus for n in seen["snapshots"][-1].nodes] == [0]

    client._jobs[52] = replace(held(52, NOW - 20), comment="elastic model=no-such-model gpus=4",
                               reason="JobHeldAdmin")
    daemon.round()  # released as submitted now: about to start, its 4 GPUs are reserved
    assert ("release", 52) in client.calls
    assert [n.unmanaged_gpus for n in seen["snapshots"][-1].nodes] == [4]
    client._jobs[52] = replace(client._jobs[52], reason="Dependency", priority=100)
    clock.advance_to(NOW + 3 * 60 + 1)
    daemon.round()  # not started three rounds on: no longer reserved
    assert [n.unmanaged_gpus for n in seen["snapshots"][-1].nodes] == [0]


def test_a_running_job_on_a_site_named_gres_type_stays_managed(tmp_path):
    """gres.conf's type is ``a100_sxm4_80gb``; the admin maps the partition to the catalog's
    a100. The running elastic job is the policy's, on a100."""
    def site_node(name, used=0):
        return SlurmNode(name, "mixed" if used else "idle", partitions=("a100",),
                         gres=(Gres("gpu", "a100_sxm4_80gb", 4),),
                         gres_used=(Gres("gpu", "a100_sxm4_80gb", used),) if used else ())
    job = running(gpu_type="a100_sxm4_80gb")
    daemon, _ = daemon_for(tmp_path, [job], [site_node("a100-1", used=4), site_node("a100-2")],
                           partitions={"a100": "a100"})
    seen = seen_by_policy(daemon)
    report = daemon.round()
    assert report.managed == 1
    (view,) = seen["snapshots"][-1].jobs
    assert view.assignment.cell.gpu_type == "a100" and view.assignment.placement == (("a100-1", 4),)


def test_a_rescale_that_never_happened_does_not_count_the_run_twice(tmp_path):
    """The job ignores USR1 and its forced requeue fails too: it keeps running the same
    run, whose iterations count once (from its start), not also as an earlier run's."""
    from slurm_ext.act import REQUEUE_HOLD_WAIT_S
    clock = SimulatedClock(float(NOW))
    daemon, client = daemon_for(tmp_path, [running()], [node("a100-1", "a100", 4, used=4), node("a100-2", "a100", 4)],
                                clock=clock, policy="fcfs")
    seen = seen_by_policy(daemon)
    daemon.round()
    managed = seen["views"][-1]["70"]
    start_rescale(daemon, seen["views"][-1], 70,
                  JobUpdate(partition="a100", gpus_per_node=4, num_nodes=2, admin_comment="cell=a100x8:s1 why=grow"))
    assert daemon.store.progress()[70] == managed.run_iterations(NOW) > 0  # credited at the signal
    jobs = lambda: {j.job_id: j for j in client.jobs()}  # noqa: E731
    clock.advance_to(NOW + daemon.config.rescale_timeout_s)
    daemon.actor.advance_rescales(jobs(), Acts())  # requeue forced
    clock.advance_to(NOW + daemon.config.rescale_timeout_s + REQUEUE_HOLD_WAIT_S)
    daemon.actor.advance_rescales(jobs(), Acts())  # never came back held
    assert [(e.kind, e.state) for e in daemon.store.entries()] == [("rescale", "failed")]
    daemon.round()
    after = seen["views"][-1]["70"].view
    estimate = next(e for e in after.estimates if e.cell == after.assignment.cell)
    assert abs(after.iterations_done - (clock.now_s() - (NOW - 1000)) / estimate.iteration_time_s) < 1e-6


def test_a_guaranteed_job_in_a_rescale_keeps_its_quota(tmp_path):
    """alice may hold 4 guaranteed GPUs. Her older job holds them and is being rescaled:
    for the rounds its rescale takes, her newer job is not granted the quota in its place."""
    clock = SimulatedClock(float(NOW))
    older = replace(running(), comment=SPEC + " guaranteed=yes")
    daemon, client = daemon_for(tmp_path, [older, held(61, NOW - 600, SPEC + " guaranteed=yes")],
                                [node("a100-1", "a100", 4, used=4), node("a100-2", "a100", 4, used=4)],
                                clock=clock, guarantees={"users": {"alice": 4}})
    seen = seen_by_policy(daemon)
    daemon.round()
    assert {v.job_id: v.guaranteed for v in seen["snapshots"][-1].jobs} == {"70": True, "61": False}
    start_rescale(daemon, seen["views"][-1], 70,
                  JobUpdate(partition="a100", gpus_per_node=4, num_nodes=1, admin_comment=STARTED,
                            required_nodes=("a100-2",)))
    clock.advance_to(NOW + 5)
    report = daemon.round()
    assert report.rescaling == (70,)
    assert {v.job_id: v.guaranteed for v in seen["snapshots"][-1].jobs} == {"61": False}


def test_a_forecast_end_past_the_last_printable_year_shows_none_and_the_round_acts(tmp_path):
    """A billion iterations of a slow model end after year 9999, which no UTC text can
    show. Such a job is started without an ``end=``, and the other job of the round too."""
    endless = "elastic model=wide_resnet-6.8b gpus=4 global_batch=131072 iterations=1000000000"
    short = "elastic model=gpt-760m gpus=4 global_batch=64 iterations=1000"
    daemon, client = daemon_for(tmp_path, [held(70, NOW - 100, comment=endless), held(71, NOW - 50, comment=short)],
                                [node("a100-1", "a100", 4), node("a100-2", "a100", 4), node("h100-1", "h100", 8)],
                                policy="crius")
    result = daemon.round()
    assert sorted(result.actions) == [("start", 70), ("start", 71)]
    endless_comment, short_comment = client._jobs[70].admin_comment, client._jobs[71].admin_comment
    assert "start=" in endless_comment and "end=" not in endless_comment
    assert "end=" in short_comment


def test_a_batch_script_slurm_does_not_give_is_read_again_before_its_spec_is_refused(tmp_path):
    """A spec in ``#ELASTIC`` lines needs the batch script. When Slurm does not give it (a
    timeout under load), the job is read again next round rather than run as submitted;
    only when it stays unreadable is the error kept, and it says why."""
    from slurm_ext.daemon import SCRIPT_READ_TRIES
    from slurm_ext.errors import CommandTimeoutError

    daemon, client = daemon_for(tmp_path, [held(70, NOW - 100, comment="elastic")], [node("a100-1", "a100", 4)])
    script = "#!/bin/bash\n#ELASTIC model=gpt-760m global_batch=64 iterations=1000\nsrun x\n"

    def timing_out(job_id):
        raise CommandTimeoutError(["scontrol", "write", "batch_script", str(job_id), "-"], 30)

    client.batch_script = timing_out
    assert daemon.round().actions == ()
    client.batch_script = lambda job_id: script  # slurmctld answers again
    assert daemon.round().actions == (("start", 70),)

    daemon, client = daemon_for(tmp_path / "never", [held(71, NOW - 100, comment="elastic")],
                                [node("a100-1", "a100", 4)])
    client.batch_script = timing_out
    actions = [daemon.round().actions for _ in range(SCRIPT_READ_TRIES)]
    assert actions[:-1] == [()] * (SCRIPT_READ_TRIES - 1) and actions[-1] == (("release", 71),)
    assert client._jobs[71].admin_comment.endswith("(its batch script could not be read)")


def test_an_elastic_job_array_runs_as_submitted_and_says_why(tmp_path):
    """One Cell for an array would reach every task: an array is not managed. Its pending
    record (22.05's listing, tasks 0-7, two at a time) is released with the reason."""
    from slurm_ext.daemon import ARRAY_REFUSED
    from slurm_ext.slurm_parse import parse_job_listing

    main = (f"4|4|0-7%2|PENDING|JobHeldAdmin|a100|alice|gres:gpu:4|N/A||1|0|{NOW - 30}|N/A|N/A|0|1|1|0|(null)|"
            f"(null)|{SPEC}|\n")
    (array,) = parse_job_listing(main, "4|requested=any|\n", "4|arr|\n")
    assert array.array_task_spec == "0-7%2"
    daemon, client = daemon_for(tmp_path, [array], [node("a100-1", "a100", 4), node("a100-2", "a100", 4)])
    result = daemon.round()
    assert result.actions == (("release", 4),) and result.managed == 0
    assert client._jobs[4].admin_comment == f"requested=any error={ARRAY_REFUSED}"


def test_a_guaranteed_job_that_names_no_count_is_charged_its_smallest_cell(tmp_path):
    """Without ``gpus=`` the policy still guarantees a job its smallest feasible count, so
    the quota is charged that count: two such jobs (gpt-760m fits on one GPU) do not both
    fit in alice's 1 GPU."""
    count_free = SPEC.replace(" gpus=4", "") + " guaranteed=yes"
    jobs = [held(60, NOW - 3600, count_free, gpus_per_node=0), held(61, NOW - 600, count_free, gpus_per_node=0)]
    daemon, client = daemon_for(tmp_path, jobs, [node("a100-1", "a100", 4, used=4)],
                                guarantees={"users": {"alice": 1}})
    seen = seen_by_policy(daemon)
    daemon.round()
    smallest = min(e.cell.num_gpus for e in seen["views"][-1]["60"].view.estimates if e.feasible)
    assert smallest == 1
    assert {v.job_id: v.guaranteed for v in seen["snapshots"][-1].jobs} == {"60": True, "61": False}


def test_a_released_job_slurm_keeps_for_its_dependency_holds_no_gpus_and_is_not_started_again(tmp_path):
    """Started by the daemon, the job then waits on its dependency (``afterok`` on a long
    job). It is neither counted on the GPUs of its Cell nor decided afresh and released
    again every few rounds: Slurm starts it on its Cell once the dependency holds."""
    clock = SimulatedClock(float(NOW))
    daemon, client = daemon_for(tmp_path, [held(80, NOW - 100)], [node("a100-1", "a100", 4), node("a100-2", "a100", 4)],
                                clock=clock)
    seen = seen_by_policy(daemon)
    assert daemon.round().actions == (("start", 80),)
    released = plan_comment(client._jobs[80].admin_comment)
    assert released.expected_start_s == NOW and released.expected_end_s > NOW
    for minute in range(1, 12):
        client._jobs[80] = replace(client._jobs[80], reason="Dependency", priority=100)
        clock.advance_to(NOW + 60 * minute)
        client.calls.clear()
        report = daemon.round()
        assert report.actions == () and report.managed == 0
        assert len(seen["snapshots"]) == minute + 1  # the policy saw this round's nodes
        assert [n.unmanaged_gpus for n in seen["snapshots"][-1].nodes] == [0, 0]
        assert not any(c[0] in ("hold", "release") for c in client.calls)
        updates = [c[2] for c in client.calls if c[0] == "update"]
        if minute == 1:
            # Its start is the dependency's: the start and end shown at its release are
            # taken back, once; the Cell and plan stay.
            (update,) = updates
            assert update == JobUpdate(admin_comment=update.admin_comment, start_now=False)
            shown = plan_comment(update.admin_comment)
            assert (shown.expected_start_s, shown.expected_end_s) == (None, None)
            assert (shown.cell, shown.plan) == (released.cell, released.plan)
        else:
            assert updates == []


def test_a_released_job_slurm_keeps_for_its_begin_time_shows_that_start_and_an_end_as_far_after_it(tmp_path):
    clock = SimulatedClock(float(NOW))
    daemon, client = daemon_for(tmp_path, [held(81, NOW - 100)], [node("a100-1", "a100", 4)], clock=clock)
    assert daemon.round().actions == (("start", 81),)
    released = plan_comment(client._jobs[81].admin_comment)
    run_s = released.expected_end_s - released.expected_start_s
    begin_s = NOW + 3 * 3600
    client._jobs[81] = replace(client._jobs[81], reason="BeginTime", priority=100, start_time_s=begin_s)
    clock.advance_to(NOW + 60)
    assert daemon.round().actions == ()
    shown = plan_comment(client._jobs[81].admin_comment)
    assert (shown.expected_start_s, shown.expected_end_s) == (begin_s, begin_s + run_s)
    client.calls.clear()
    clock.advance_to(NOW + 120)
    daemon.round()
    assert not [c for c in client.calls if c[0] == "update"]  # shown once


def test_a_reload_applies_the_policy_and_keeps_what_needs_a_restart(tmp_path, caplog):
    """The Slurm client, the metrics server and the log were built at the start: a reload
    that changes them keeps the old settings and says so, rather than log them reloaded."""
    daemon, _ = daemon_for(tmp_path, [], [node("a100-1", "a100", 4)], dry_run=True)
    old = daemon.config
    # A daemon started dry holds no lock on its state file: it must not start acting.
    daemon._reload = lambda: replace(old, policy="crius", slurm_timeout_s=99.0, metrics_port=9999,
                                     slurm_backend="pyslurm", dry_run=False)
    with caplog.at_level("WARNING"):
        daemon._apply_reload()
    assert daemon.config.policy == "crius" and daemon.policy.name == "crius"
    assert (daemon.config.slurm_timeout_s, daemon.config.metrics_port, daemon.config.slurm_backend) == \
        (old.slurm_timeout_s, old.metrics_port, old.slurm_backend)
    assert daemon.config.dry_run is True
    for key in ("slurm_timeout_s", "metrics_port", "slurm_backend", "dry_run"):
        assert f"key={key}" in caplog.text


def test_a_gpu_node_whose_cpus_are_all_taken_and_one_power_saving_turned_off():
    """A node in state ``allocated`` has no CPU left for a job, whatever its free GPUs: a
    job placed there would never start, and would be placed there again each time its
    launch went stale. A node power saving turned off (``idle~``) is one Slurm powers up
    for the job it is given."""
    cpu_job = SlurmJob(7, "dave", "cpu-only", "RUNNING", partition="a100", priority=1, nodes=("a100-1",),
                       node_count=1, submit_time_s=NOW - 9000, start_time_s=NOW - 9000)
    for first, second, where in ((node("a100-1", "a100", 4, state="allocated"), node("a100-2", "a100", 4), "a100-2"),
                                 (node("a100-1", "a100", 4, state="allocated"),
                                  replace(node("a100-2", "a100", 4), state_flags=("POWERED_DOWN",)), "a100-2"),
                                 (node("a100-1", "a100", 4), replace(node("a100-2", "a100", 4, state="allocated")),
                                  "a100-1")):
        with tempfile.TemporaryDirectory() as tmp:
            daemon, client = daemon_for(Path(tmp), [cpu_job, held(80, NOW - 100)], [first, second], policy="fcfs")
            assert daemon.round().actions == (("start", 80),)
            (update,) = [c[2] for c in client.calls if c[0] == "update" and c[1] == 80]
            assert update.required_nodes == (where,)
    with tempfile.TemporaryDirectory() as tmp:  # the only free GPUs have no CPU: it waits
        daemon, client = daemon_for(Path(tmp), [cpu_job, held(80, NOW - 100)],
                                    [node("a100-1", "a100", 4, state="allocated")], policy="fcfs")
        assert ("start", 80) not in daemon.round().actions


def test_a_daemon_that_stops_frees_the_nodes_it_held(tmp_path):
    """No daemon keeps held nodes for their waiting job once it is gone: Slurm may use them."""
    from slurm_ext.act import HOLD_RESERVATION
    daemon, client = daemon_for(tmp_path, [], [node("a100-1", "a100", 4)])
    daemon.actor.hold_nodes(("a100-1",), (("80", ("a100-1",)),))
    assert client.calls == [("hold_nodes", HOLD_RESERVATION, ("a100-1",))]
    daemon.request_stop()
    assert daemon.run() == 0
    assert client.calls[-1] == ("hold_nodes", HOLD_RESERVATION, ())


def test_a_site_wide_micro_batch_count_applies_where_it_divides_the_batch(tmp_path):
    """``micro_batches: 3`` cannot split a batch of 64: that job takes the estimator's
    count rather than failing as if its own spec were wrong; one of 48 takes 3."""
    daemon, client = daemon_for(tmp_path, [held(80, NOW - 100), held(81, NOW - 90, comment=SPEC.replace("64", "48"))],
                                [node(f"a100-{i}", "a100", 4) for i in range(1, 5)], micro_batches=3)
    assert daemon.round().spec_errors == 0
    shown = {j: plan_comment(client._jobs[j].admin_comment) for j in (80, 81)}
    assert shown[80].error is None and shown[80].cell is not None and shown[80].micro_batches != 3
    assert shown[81].error is None and shown[81].micro_batches == 3


def test_a_released_job_slurm_has_not_started_holds_the_nodes_its_release_required(tmp_path):
    """Released onto a100-2 (ReqNodeList), the job is not started yet when a plain job on
    a100-2 ends and a 4-GPU job arrives: its GPUs are counted on a100-2, not wherever
    they fit best, so the newcomer is not given a100-2 too (6 GPUs on a 4-GPU node)."""
    clock = SimulatedClock(float(NOW))
    two, four = (SPEC.replace("gpus=4", f"gpus={n}") for n in (2, 4))
    plain = SlurmJob(5, "carol", "plain", "RUNNING", partition="a100", priority=1, gpus_per_node=2,
                     nodes=("a100-2",), node_count=1, granted_gpus_per_node=(2,), granted_gpu_type="a100",
                     submit_time_s=NOW - 9000, start_time_s=NOW - 9000)
    daemon, client = daemon_for(tmp_path, [plain, held(80, NOW - 100, comment=two, gpus_per_node=2)],
                                [node("a100-1", "a100", 4), node("a100-2", "a100", 4, used=2)],
                                clock=clock, policy="fcfs")
    assert daemon.round().actions == (("start", 80),)
    (first,) = [c[2] for c in client.calls if c[0] == "update" and c[1] == 80]
    assert first.required_nodes == ("a100-2",)
    client._jobs[80] = replace(client._jobs[80], reason="Priority", priority=100)
    client._jobs[5] = replace(plain, state="COMPLETED")
    client._nodes = (node("a100-1", "a100", 4), node("a100-2", "a100", 4))
    client._jobs[81] = held(81, NOW + 20, comment=four)
    clock.advance_to(NOW + 22)
    client.calls.clear()
    assert daemon.round().actions == (("start", 81),)
    (second,) = [c[2] for c in client.calls if c[0] == "update" and c[1] == 81]
    assert second.required_nodes == ("a100-1",)


@pytest.mark.parametrize("requeue", [True, False])
def test_a_running_job_slurm_may_not_requeue_is_never_the_policys_to_rescale(tmp_path, requeue):
    """Slurm ignores RequeueExitHold for a job with Requeue=0 (its owner may set it): exit 86
    would end it. Such a job is left alone, its GPUs counted as unmanaged."""
    daemon, _ = daemon_for(tmp_path, [running(requeue=requeue)],
                           [node("a100-1", "a100", 4, used=4), node("a100-2", "a100", 4)])
    seen = seen_by_policy(daemon)
    daemon.round()
    snapshot = seen["snapshots"][-1]
    if requeue:
        assert [(v.job_id, v.state) for v in snapshot.jobs] == [("70", "running")]
        assert {n.name: n.unmanaged_gpus for n in snapshot.nodes} == {"a100-1": 0, "a100-2": 0}
    else:
        assert snapshot.jobs == ()
        assert {n.name: n.unmanaged_gpus for n in snapshot.nodes} == {"a100-1": 4, "a100-2": 0}


def test_a_start_pinned_to_nodes_goes_to_a_partition_that_has_them(tmp_path):
    """Two partitions of a100 on different nodes: the 8 GPUs the policy chose are in
    ``a100-big`` only, so the job moves there, not to ``a100`` (named like the type), where
    Slurm would never start it on those nodes."""
    nodes = [node("a100-1", "a100", 4, partition="a100"), node("big-1", "a100", 8, partition="a100-big")]
    job = held(90, NOW - 100, comment="elastic model=gpt-760m gpus=8 global_batch=64 iterations=1000000",
               gpus_per_node=8)
    daemon, client = daemon_for(tmp_path, [job], nodes)
    assert daemon.round().actions == (("start", 90),)
    (update,) = [c[2] for c in client.calls if c[0] == "update" and c[1] == 90]
    assert update.required_nodes == ("big-1",) and update.partition == "a100-big"


def test_idle_gpus_make_sia_solve_now_without_forgetting_what_it_learnt(tmp_path):
    """A waiting job fits GPUs that sit idle, between sia's rounds: the daemon makes it
    solve now, with the state's own way (it had dropped the whole state: every job's
    learnt model and restart watch)."""
    from policy.sia import JobModel, SiaState

    daemon, _ = daemon_for(tmp_path, [held(80, NOW - 100)], [node("a100-1", "a100", 4)], policy="sia")
    learnt = (("70", JobModel()),)
    daemon._policy_state = SiaState(float(NOW) - 1.0, learnt, ())
    seen = seen_by_policy(daemon)
    assert daemon.round().actions == (("start", 80),)
    given = seen["snapshots"][-1].policy_state
    assert given.last_solve_s is None and given.models == learnt


def test_a_policy_that_skips_calls_says_how_to_make_it_solve_now():
    from policy.cells_ilp import CellsIlpPolicy, CellsIlpState
    from policy.gavel import GavelPolicy, GavelState

    assert CellsIlpPolicy.solve_next(CellsIlpState((), float(NOW))) is None  # the state is only its memo
    history = (("70", "rounds"),)
    gavel = GavelPolicy.solve_next(GavelState(float(NOW) + 300, 4, (), (), history))
    assert gavel.next_round_s == float("-inf") and gavel.history == history and gavel.rounds_done == 4


def test_under_partition_steering_a_type_without_its_own_partition_is_not_offered(tmp_path):
    """``steering: partition`` reaches a type only through a partition of its own: v100s in
    the catch-all partition alone are left out of the policy's nodes (a job given a Cell
    there had stayed held for ever, round after round)."""
    nodes = [node("a-1", "a100", 4), node("a-2", "a100", 4, partition="gpu"), node("v-1", "v100", 4, partition="gpu")]
    job = held(91, NOW - 100, comment="elastic model=gpt-760m gpus=4 gpu_type=v100 global_batch=64 iterations=1000")
    for steering, offered in (("partition", ["a-1", "a-2"]), ("auto", ["a-1", "a-2", "v-1"])):
        daemon, _ = daemon_for(tmp_path / steering, [job], nodes, steering=steering)
        seen = seen_by_policy(daemon)
        daemon.round()
        assert [n.name for n in seen["snapshots"][-1].nodes] == offered


def test_switching_to_partition_steering_keeps_the_nodes_managed_jobs_run_on(tmp_path):
    """A job started on v100 before ``steering: partition`` (no v100 partition) still runs
    there: its node stays in the policy's view (a KeyError had failed every round)."""
    nodes = [node("a-1", "a100", 4), node("a-2", "a100", 4, partition="gpu"),
             node("v-1", "v100", 4, used=4, partition="gpu")]
    on_v100 = replace(running(70, nodes=("v-1",), gpu_type="v100"), partition="gpu")
    daemon, _ = daemon_for(tmp_path, [on_v100], nodes, steering="partition")
    seen = seen_by_policy(daemon)
    daemon.round()
    assert [n.name for n in seen["snapshots"][-1].nodes] == ["a-1", "a-2", "v-1"]
    assert [(v.job_id, v.state) for v in seen["snapshots"][-1].jobs] == [("70", "running")]


def test_a_job_that_fits_only_gpus_gone_from_the_listing_waits_for_them(tmp_path):
    """gpt-6.7b fits only the a100 nodes; one round lists none (powered down, FUTURE): the
    job was released to run as submitted for good. It now stays held while a GPU type seen
    before is gone, at most ESTIMATE_ERROR_SETTLE_S; a type never seen fails at once."""
    from slurm_ext.daemon import ESTIMATE_ERROR_SETTLE_S
    clock = SimulatedClock(float(NOW))
    big = held(41, NOW - 100, comment="elastic model=gpt-6.7b global_batch=64 iterations=1000")
    a100, v100 = node("a100-1", "a100", 8), node("v100-1", "v100", 4)
    daemon, client = daemon_for(tmp_path, [big], [a100, v100], clock=clock)
    daemon.round()  # both types seen
    client._nodes, before = (v100,), len(client.calls)
    clock.advance_to(NOW + 60)
    report = daemon.round()
    assert report.spec_errors == 0 and not [c for c in client.calls[before:] if c[0] == "release"]
    client._nodes = (a100, v100)
    clock.advance_to(NOW + 120)
    assert daemon.round().managed == 1  # back: planned as before
    client._nodes = (v100,)
    for t in (180, 180 + ESTIMATE_ERROR_SETTLE_S + 1):
        clock.advance_to(NOW + t)
        report = daemon.round()
    assert report.spec_errors == 1 and ("release", 41) in report.actions  # gone too long
    fresh, client = daemon_for(tmp_path / "b", [big], [v100], clock=clock)
    assert fresh.round().spec_errors == 1  # a100 never seen: no Cell of this cluster fits it


def test_a_daemon_restarted_while_a_gpu_type_is_gone_remembers_it(tmp_path):
    """The a100 nodes go missing from the listing and the daemon restarts (an upgrade):
    the job that fits only them waits for them as it would have without the restart."""
    from slurm_ext.store import GPU_TYPE_MEMORY_S
    clock = SimulatedClock(float(NOW))
    big = held(41, NOW - 100, comment="elastic model=gpt-6.7b global_batch=64 iterations=1000")
    a100, v100 = node("a100-1", "a100", 8), node("v100-1", "v100", 4)
    daemon, client = daemon_for(tmp_path, [big], [a100, v100], clock=clock)
    daemon.round()
    client._nodes = (v100,)
    clock.advance_to(NOW + 60)
    restarted = Daemon(daemon.config, client, Store(daemon.config.state_db), clock=clock, out=print)
    report = restarted.round()
    assert report.spec_errors == 0 and ("release", 41) not in report.actions
    client._nodes = (a100, v100)
    clock.advance_to(NOW + 120)
    assert restarted.round().managed == 1
    # Gone for longer than the store remembers: a type like any never seen.
    client._nodes = (v100,)
    clock.advance_to(NOW + 120 + GPU_TYPE_MEMORY_S + 1)
    later = Daemon(daemon.config, client, Store(daemon.config.state_db), clock=clock, out=print)
    assert later.round().spec_errors == 1


def test_a_job_whose_starts_slurm_refuses_runs_as_submitted_after_a_few(tmp_path):
    """Slurm refuses the update of every start (the job's account may not use the Cell's
    partition): the policy chose the same Cell round after round and the job stayed held
    for ever. After START_REFUSALS refusals in a row it runs as submitted, saying why."""
    from slurm_ext.errors import SlurmCommandError
    from slurm_ext.observe import START_REFUSALS
    clock = SimulatedClock(float(NOW))
    daemon, client = daemon_for(tmp_path, [held(41, NOW - 100)], [node("a100-1", "a100", 4)], clock=clock)

    def refuse(job_ids, update):
        if update.partition is not None or update.gpus_per_node is not None:
            raise SlurmCommandError(("scontrol", "update"), 1, "Invalid account or account/partition combination")
        client.calls.append(("update", job_ids, update))
    client.update_pending = refuse
    for k in range(START_REFUSALS):
        clock.advance_to(NOW + 60 * k)
        report = daemon.round()
        assert report.spec_errors == 0 and not [c for c in client.calls if c[0] == "release"]
    clock.advance_to(NOW + 60 * START_REFUSALS)
    report = daemon.round()
    assert report.spec_errors == 1 and ("release", 41) in client.calls
    (note,) = [c[2].admin_comment for c in client.calls if c[0] == "update"]
    assert f"Slurm refused {START_REFUSALS} starts in a row" in note and "account/partition" in note


def test_a_job_refused_on_one_gpu_type_is_started_on_another_first(tmp_path):
    """Slurm refuses the job's starts in the a100 partition only (its account may not use
    it): after START_REFUSALS refusals it is offered the v100 Cells, and starts there,
    rather than running as submitted."""
    from slurm_ext.errors import SlurmCommandError
    from slurm_ext.observe import START_REFUSALS
    clock = SimulatedClock(float(NOW))
    daemon, client = daemon_for(tmp_path, [held(41, NOW - 100)],
                                [node("a100-1", "a100", 4), node("v100-1", "v100", 4)], clock=clock)
    accept = client.update_pending

    def refuse_a100(job_ids, update):
        if update.partition == "a100":
            raise SlurmCommandError(("scontrol", "update"), 1, "Invalid account or account/partition combination")
        accept(job_ids, update)
    client.update_pending = refuse_a100
    for k in range(START_REFUSALS):
        clock.advance_to(NOW + 60 * k)
        assert daemon.round().spec_errors == 0 and not [c for c in client.calls if c[0] == "release"]
    clock.advance_to(NOW + 60 * START_REFUSALS)
    report = daemon.round()
    assert report.spec_errors == 0 and ("release", 41) in client.calls
    started = plan_comment(client._jobs[41].admin_comment)
    assert started.cell_parts()[0] == "v100" and started.error is None, started


def test_starts_slurm_did_not_answer_are_no_refusals(tmp_path):
    """A timeout (slurmctld busy) is no refusal: three of them had released the job to run
    as submitted for good."""
    from slurm_ext.errors import CommandTimeoutError
    from slurm_ext.observe import START_REFUSALS
    clock = SimulatedClock(float(NOW))
    daemon, client = daemon_for(tmp_path, [held(41, NOW - 100)], [node("a100-1", "a100", 4)], clock=clock)

    def no_answer(job_ids, update):
        raise CommandTimeoutError(("scontrol", "update"), 30.0)
    client.update_pending = no_answer
    for k in range(START_REFUSALS + 2):
        clock.advance_to(NOW + 60 * k)
        assert daemon.round().spec_errors == 0
    assert not [c for c in client.calls if c[0] == "release"]


def test_an_edited_model_file_is_estimated_anew(tmp_path):
    """The estimates are cached (and kept across restarts) by key: a model file rewritten
    under the same path had kept its old model's Cells."""
    import os
    from slurm_ext.jobspec import ElasticSpec
    cfg = resolve({"state_db": str(tmp_path / "state.db")}, {}, {})
    daemon = Daemon(cfg, None, Store(cfg.state_db))
    cluster = cluster_spec(NODES, partition_types(NODES, {}), None, "infiniband")
    model = tmp_path / "mine.yaml"
    model.write_text("hidden: 256\nlayers: 4\nheads: 4\nsequence: 128\nvocab: 1000\n")
    spec = ElasticSpec(str(model), 64, 10)
    _, small = daemon._estimate(spec, "root", cluster, 0.0)
    model.write_text("hidden: 8192\nlayers: 96\nheads: 64\nsequence: 4096\nvocab: 50000\n")
    os.utime(model, ns=(1, 1))  # even with an old time stamp: the size differs
    _, large = daemon._estimate(spec, "root", cluster, 1.0)
    assert isinstance(small, dict) and any(e.feasible for e in small[cfg.plan_space])
    assert large != small  # estimated anew (this one fits nowhere: an error, not the old Cells)


def test_a_model_file_up_to_one_mib_is_read_as_documented(open_dir):
    """The daemon let files of up to 1 MiB through (as documented) to an estimator that
    refused anything over 64 KiB."""
    from estimator.errors import SpecError
    model = open_dir / "padded.yaml"
    model.write_text("hidden: 256\nlayers: 4\nheads: 4\nsequence: 128\nvocab: 1000\n" + "# notes\n" * 12_000)
    model.chmod(0o644)
    assert 64 * 1024 < model.stat().st_size <= 1 << 20
    assert model_loader_for("nobody")(str(model)).hidden == 256
    model.write_text("hidden: 256\n" + "#" * (1 << 20))
    with pytest.raises(SpecError, match="1048576"):
        model_loader_for("nobody")(str(model))


def test_refused_starts_are_counted_per_gpu_type_since_the_last_accepted_start():
    from slurm_ext.observe import NO_ANSWER, refused_gpu_types
    from slurm_ext.slurm_client import JobUpdate
    from slurm_ext.store import DONE, FAILED, START, JournalEntry

    def start(gpu_type, state, note="refused"):
        comment = f"cell={gpu_type}x4:s1 plan=[dp4tp1] mb=4 remat=1" if gpu_type else None
        return JournalEntry(0, 41, START, JobUpdate(admin_comment=comment), state, note, 0.0)
    a, b = start("a100", FAILED), start("v100", FAILED)
    assert refused_gpu_types([a, b, a, start("a100", FAILED, NO_ANSWER + "timed out")]) == {"a100": 2, "v100": 1}
    assert refused_gpu_types([a, a, start("v100", DONE, ""), a]) == {"a100": 1}  # an accepted start clears
    assert refused_gpu_types([start(None, FAILED)]) == {"": 1}  # no Cell named: the daemon's error path


def test_refused_starts_of_no_known_cell_end_in_the_error_path(tmp_path):
    """Refused starts whose journal entry names no Cell (an old or damaged entry) barred no
    GPU type: the job was decided again and again, never released as submitted."""
    from slurm_ext.observe import START_REFUSALS
    from slurm_ext.slurm_client import JobUpdate
    from slurm_ext.store import FAILED, START
    daemon, client = daemon_for(tmp_path, [held(41, NOW - 100)], [node("a100-1", "a100", 4)])
    for _ in range(START_REFUSALS):
        entry = daemon.store.intend(41, START, JobUpdate(), NOW - 60)
        daemon.store.close_entry(entry, FAILED, NOW - 60, "Invalid account or account/partition combination")
    report = daemon.round()
    assert report.spec_errors == 1 and ("release", 41) in client.calls
    assert f"Slurm refused {START_REFUSALS} starts in a row, on its Cells" in client._jobs[41].admin_comment



def test_a_daemon_that_stops_frees_its_reservation_even_after_a_change_of_it_failed(tmp_path):
    """A reservation change that timed out leaves the actor not knowing what it holds
    (None): the stop took that for nothing held, and left the nodes reserved."""
    daemon, client = daemon_for(tmp_path, [], [node("a100-1", "a100", 4)])
    daemon.actor.held_nodes = None  # a change that failed
    daemon.clock.sleep = lambda s: daemon.request_stop()
    daemon.request_stop()
    assert daemon.run() == 0
    assert ("hold_nodes", "slurm-ext-hold", ()) in client.calls


def test_the_gpu_types_seen_are_written_once_an_hour_not_every_round(tmp_path):
    """The store remembers a type for 30 days: a round writes a type again only once
    GPU_TYPE_NOTE_EVERY_S has passed since it last did (a write every round was a commit
    every round), and a type new to the listing is written at once."""
    import sqlite3
    from contextlib import closing
    from slurm_ext.store import GPU_TYPE_NOTE_EVERY_S
    clock = SimulatedClock(float(NOW))
    a100, v100 = node("a100-1", "a100", 8), node("v100-1", "v100", 4)
    daemon, client = daemon_for(tmp_path, [], [a100], clock=clock)

    def written():
        with closing(sqlite3.connect(daemon.config.state_db)) as db:
            return dict(db.execute("SELECT gpu_type, seen_s FROM gpu_types_seen").fetchall())
    daemon.round()
    assert written() == {"a100": NOW}
    client._nodes = (a100, v100)
    for t in (60, 120, GPU_TYPE_NOTE_EVERY_S - 1):
        clock.advance_to(NOW + t)
        daemon.round()
    assert written() == {"a100": NOW, "v100": NOW + 60}
    clock.advance_to(NOW + GPU_TYPE_NOTE_EVERY_S)
    daemon.round()
    assert written() == {"a100": NOW + GPU_TYPE_NOTE_EVERY_S, "v100": NOW + 60}
