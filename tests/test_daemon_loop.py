"""The daemon's loop around its rounds: the wait between them, the backoff after errors,
recovery at a start, the order of the node hold and the round's starts, and a dry run
beside the service. A fake Slurm client (no Slurm); the wall clock where a signal's
effect on a sleep is what is tested."""

import time
from dataclasses import replace

from estimator.cells import Cell
from estimator.contract import PlanComment, format_plan_comment
from policy.clock import SimulatedClock
from policy.interface import Assignment, Decision, JobDecision
from slurm_ext import store as journal
from slurm_ext.daemon import Daemon
from slurm_ext.errors import SlurmCommandError
from slurm_ext.slurm_client import REQUEUE_SETTLE_S, JobUpdate
from slurm_ext.store import Store
from test_daemon import node
from test_daemon_edges import NOW, daemon_for, held, running, seen_by_policy, start_rescale

GROWN = JobUpdate(partition="a100", gpus_per_node=4, num_nodes=2, admin_comment=format_plan_comment(
    PlanComment(requested="any", cell="a100x8:s1", plan="[dp8tp1]", why="grow")))


def back_held(job):
    """The job after its checkpoint: requeued held (exit 86), its nodes given back."""
    return replace(job, state="SPECIAL_EXIT", reason="JobHeldAdmin", priority=0, granted_gpus_per_node=(),
                   nodes=(), start_time_s=0, restart_count=1)


def test_a_stop_requested_as_the_wait_begins_is_not_lost(tmp_path):
    """With polling off the daemon sleeps a whole interval: a stop that lands between its
    test of the stop flag and the sleep used to be wiped out with the wake-up."""
    seed, client = daemon_for(tmp_path, [], [node("a100-1", "a100", 4)], poll_s=0, interval_s=30)
    daemon = Daemon(seed.config, client, Store(seed.config.state_db), out=lambda line: None)  # wall clock
    clear, asked = daemon._wake.clear, []

    def stop_then_clear():
        if not asked:  # the signal handler runs just here
            daemon.request_stop()
            asked.append(time.monotonic())
        clear()
    daemon._wake.clear = stop_then_clear
    assert daemon.run() == 0
    assert time.monotonic() - asked[0] < 5.0  # not the 30 s interval


def test_a_round_that_fails_on_a_bug_waits_the_interval_not_the_last_slurm_backoff(tmp_path):
    clock = SimulatedClock(float(NOW))
    daemon, client = daemon_for(tmp_path, [], [node("a100-1", "a100", 4)], clock=clock, interval_s=60, poll_s=0,
                                backoff_max_s=300)
    plan, starts = ["slurm", "bug", "bug", "ok", "slurm", "slurm"], []
    listing = client.jobs

    def jobs():
        starts.append(clock.now_s())
        if len(starts) > len(plan):
            daemon.request_stop()
            return listing()
        if plan[len(starts) - 1] == "slurm":
            raise SlurmCommandError(["squeue"], 1, "Unable to contact slurm controller")
        if plan[len(starts) - 1] == "bug":
            raise RuntimeError("a bug")
        return listing()
    client.jobs = jobs
    daemon.run()
    gaps = [b - a for a, b in zip(starts, starts[1:])]
    # Slurm's errors back off from interval / 10 and double; a bug's round waits the interval.
    assert gaps == [6.0, 60.0, 60.0, 60.0, 6.0, 12.0]


def test_recovery_waits_the_requeue_settle_even_when_a_signal_wakes_the_clock(tmp_path):
    """A job requeued held just before the daemon (re)started is released no sooner than
    REQUEUE_SETTLE_S after recovery began (released in that second, its run fails), even
    with a reload requested at the start (a logrotate HUP), which wakes the clock's sleep."""
    now_s = time.time()
    seed, client = daemon_for(tmp_path, [back_held(running())], [node("a100-1", "a100", 4), node("a100-2", "a100", 4)])
    entry = seed.store.intend(70, journal.RESCALE, GROWN, now_s)
    seed.store.mark_entry(entry, journal.SIGNALLED, now_s)
    daemon = Daemon(seed.config, client, Store(seed.config.state_db), out=lambda line: None)  # wall clock
    released, release = [], client.release
    client.release = lambda job_id: released.append(time.monotonic()) or release(job_id)
    daemon.request_reload()
    began = time.monotonic()
    daemon.run(once=True)
    assert released and released[0] - began >= REQUEUE_SETTLE_S - 0.01


def test_a_dry_run_beside_the_service_leaves_its_rescales_to_it(tmp_path):
    """The service is rescaling job 70 (checkpointed, back held); a dry run on the same
    state file shows the rescale open and decides around it: no new Cell for the job."""
    clock = SimulatedClock(float(NOW))
    daemon, client = daemon_for(tmp_path, [running()], [node("a100-1", "a100", 4, used=4), node("a100-2", "a100", 4)],
                                clock=clock)
    seen = seen_by_policy(daemon)
    daemon.round()
    start_rescale(daemon, seen["views"][-1], 70, GROWN)
    clock.advance_to(NOW + 30)
    client._jobs[70] = back_held(client._jobs[70])
    client._nodes = (node("a100-1", "a100", 4), node("a100-2", "a100", 4))
    out = []
    config = replace(daemon.config, dry_run=True)
    dry = Daemon(config, client, Store(config.state_db), clock=clock, out=out.append)
    client.calls.clear()
    assert dry.run(once=True) == 0
    assert client.calls == []
    assert any(line.startswith("dry-run: open job=70 kind=rescale") for line in out), out
    assert not any("job=70" in line for line in out if line.startswith("dry-run: start")), out


def test_nodes_held_last_round_are_freed_before_a_job_starts_on_them(tmp_path):
    """Round 1 holds a100-2 for job 71; round 2 starts 71 there and holds a100-1 for 72:
    the reservation gives up a100-2 before 71's release, and takes a100-1 after."""
    class Scripted:
        name = "scripted"

        def __init__(self):
            self.rounds = 0

        def decide(self, snapshot):
            self.rounds += 1
            if self.rounds == 1:
                return Decision((), holds=(("71", ("a100-2",)),))
            return Decision((JobDecision("71", Assignment(Cell("a100", 4, 4, 1), (("a100-2", 4),)), "go"),),
                            holds=(("72", ("a100-1",)),))

    daemon, client = daemon_for(tmp_path, [held(71, NOW - 100), held(72, NOW - 50)],
                                [node("a100-1", "a100", 4, used=4), node("a100-2", "a100", 4)])
    daemon.policy = Scripted()
    daemon.round()
    client.calls.clear()
    daemon.round()
    order = [(c[0], c[2] if c[0] == "hold_nodes" else c[1]) for c in client.calls
             if c[0] in ("hold_nodes", "release")]
    assert order == [("hold_nodes", ()), ("release", 71), ("hold_nodes", ("a100-1",))]


def test_a_pending_id_the_rounds_never_list_starts_no_more_early_rounds(tmp_path):
    """A line of a pending job's comment that looks like a record of another elastic job
    (``424242|elastic``) made every poll find a new job: a round every poll, not every
    interval. After one round that does not list it, the poll passes over it."""
    from policy.interface import TRIGGER_ARRIVAL, TRIGGER_ROUND
    clock = SimulatedClock(float(NOW))
    daemon, client = daemon_for(tmp_path, [], [node("a100-1", "a100", 4)], clock=clock, interval_s=60, poll_s=2)
    client.pending_elastic_job_ids = lambda: [424242]
    daemon.round()
    assert daemon._wait_for_next(clock.now_s() + 60, poll=True) == TRIGGER_ARRIVAL
    daemon.round()  # its listing has no such job
    began = clock.now_s()
    assert daemon._wait_for_next(began + 60, poll=True) == TRIGGER_ROUND and clock.now_s() >= began + 60
