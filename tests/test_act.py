"""Rescales as journaled steps (slurm_ext.act): a fake Slurm client and a simulated clock.

Each round moves every rescale one step on and never waits: signal → (the job checkpoints,
Slurm requeues it held) → noted → ``REQUEUE_SETTLE_S`` later updated and released; or,
with no requeue after ``rescale_timeout_s``, a forced requeue, then failure. A daemon
started afresh on the same journal goes on where the last one stopped.
"""

from dataclasses import dataclass, replace

import pytest

from policy.clock import SimulatedClock
from policy.interface import CHANGE_TYPE, SUSPEND, Action
from slurm_ext import store as journal
from slurm_ext.act import REQUEUE_ENDING_WAIT_S, REQUEUE_HOLD_WAIT_S, Actor, Acts
from slurm_ext.config import DaemonConfig
from slurm_ext.metrics import Metrics
from slurm_ext.slurm_client import REQUEUE_SETTLE_S, JobUpdate, SlurmJob
from slurm_ext.store import Store

TIMEOUT_S = 60.0
NEW_CELL = JobUpdate(partition="a100", gpus_per_node=4, num_nodes=1,
                     admin_comment="cell=a100x4:s1 plan=[dp4tp1] mb=4 remat=1 why=faster", start_now=True)


class FakeSlurm:
    """The jobs' states as a test sets them, and every call the actor makes."""

    def __init__(self, *job_ids: int):
        self.state = {j: SlurmJob(job_id=j, user="u", name="train", state="RUNNING", comment="elastic",
                                 admin_comment="requested=any cell=a10x2:s1 plan=[dp2tp1] why=started")
                     for j in job_ids}
        self.calls: list[tuple] = []

    def requeued_held(self, job_id: int) -> None:
        self.state[job_id] = replace(self.state[job_id], state="PENDING", reason="JobHeldUser", priority=0)

    def jobs(self):
        return tuple(self.state.values())

    def signal_batch(self, job_ids, signal="USR1"):
        self.calls.append(("signal", *([job_ids] if isinstance(job_ids, int) else job_ids)))

    def update_pending(self, job_id, update):
        self.calls.append(("update", job_id, update))

    def release(self, job_id):
        self.calls.append(("release", job_id))

    def requeue_hold(self, job_id):
        self.calls.append(("requeue_hold", job_id))


@dataclass
class View:
    """What the actor reads of a managed job when it starts a rescale."""

    slurm: SlurmJob

    def run_iterations(self, now_s: float) -> float:
        return 100.0


@pytest.fixture
def world(tmp_path):
    clock = SimulatedClock(1000.0)
    slurm = FakeSlurm(41, 42)
    store = Store(tmp_path / "state.db")
    config = DaemonConfig(state_db=str(tmp_path / "state.db"), rescale_timeout_s=TIMEOUT_S)

    def actor():  # a daemon (re)started on the same journal
        return Actor(slurm, store, clock, Metrics(), print, lambda: config)
    return clock, slurm, store, actor


def start(actor, slurm, *items):
    acts = Acts()
    actor.start_rescales([(Action(kind, str(j), None, None, "why"), update) for j, kind, update in items],
                         {str(j): View(slurm.state[j]) for j, _, _ in items}, acts)
    return acts


def advance(actor, slurm):
    acts = Acts()
    return actor.advance_rescales(dict(slurm.state), acts), acts


def test_a_rescale_never_waits_and_finishes_over_rounds(world):
    clock, slurm, store, actor = world
    a = actor()
    acts = start(a, slurm, (41, CHANGE_TYPE, NEW_CELL))
    assert acts.taken == [(CHANGE_TYPE, 41)] and slurm.calls == [("signal", 41)]
    assert clock.now_s() == 1000.0  # nothing waited
    assert store.progress() == {41: 100.0}  # the run's iterations, counted before its stop
    (e,) = store.open_entries()
    assert (e.kind, e.note) == (journal.RESCALE, journal.SIGNALLED)

    clock.advance_to(1020.0)  # still checkpointing
    in_rescale, acts = advance(a, slurm)
    assert in_rescale == {41: NEW_CELL} and acts.rescaled == [] and len(slurm.calls) == 1

    slurm.requeued_held(41)
    clock.advance_to(1030.0)
    in_rescale, acts = advance(a, slurm)  # seen held: not released in the same second
    assert in_rescale == {41: NEW_CELL} and acts.rescaled == [] and len(slurm.calls) == 1
    assert store.open_entries()[0].note == journal.CAME_BACK

    clock.advance_to(1030.0 + REQUEUE_SETTLE_S)
    in_rescale, acts = advance(a, slurm)
    assert acts.rescaled == [41] and in_rescale == {41: NEW_CELL}  # its new Cell's GPUs stay taken this round
    assert slurm.calls[1:] == [("update", 41, NEW_CELL), ("release", 41)]
    assert store.open_entries() == () and store.entries()[0].state == journal.DONE
    assert advance(a, slurm)[0] == {}


def test_no_requeue_after_the_timeout_forces_one_then_gives_up(world):
    clock, slurm, store, actor = world
    a = actor()
    start(a, slurm, (41, CHANGE_TYPE, NEW_CELL))
    clock.advance_to(1000.0 + TIMEOUT_S - 1)
    advance(a, slurm)
    assert ("requeue_hold", 41) not in slurm.calls
    clock.advance_to(1000.0 + TIMEOUT_S)
    assert advance(a, slurm)[0] == {41: NEW_CELL}
    assert slurm.calls.count(("requeue_hold", 41)) == 1
    clock.advance_to(1000.0 + TIMEOUT_S + REQUEUE_HOLD_WAIT_S - 1)
    advance(a, slurm)
    assert slurm.calls.count(("requeue_hold", 41)) == 1  # forced once only
    clock.advance_to(1000.0 + TIMEOUT_S + REQUEUE_HOLD_WAIT_S)
    assert advance(a, slurm)[0] == {}
    (e,) = store.entries()
    assert (e.state, e.note) == (journal.FAILED, "never came back held")


def test_a_forced_requeue_whose_run_is_still_ending_is_waited_for_and_keeps_its_progress(world):
    """SIGTERM, KillWait, the epilog and the final checkpoint take longer than 45 s: the
    rescale was failed while Slurm showed the run completing, and what the run had
    trained was taken back as if it went on."""
    clock, slurm, store, actor = world
    a = actor()
    start(a, slurm, (41, CHANGE_TYPE, NEW_CELL))
    credited = store.progress()[41]
    clock.advance_to(1000.0 + TIMEOUT_S)
    advance(a, slurm)
    slurm.state[41] = replace(slurm.state[41], state="COMPLETING")
    clock.advance_to(1000.0 + TIMEOUT_S + REQUEUE_HOLD_WAIT_S + 60)
    assert advance(a, slurm)[0] == {41: NEW_CELL}  # still under way
    slurm.requeued_held(41)
    clock.advance_to(1000.0 + TIMEOUT_S + REQUEUE_HOLD_WAIT_S + 70)
    advance(a, slurm)
    clock.advance_to(1000.0 + TIMEOUT_S + REQUEUE_HOLD_WAIT_S + 80)
    advance(a, slurm)
    (e,) = store.entries()
    assert e.state == journal.DONE and store.progress()[41] == credited
    assert REQUEUE_ENDING_WAIT_S > REQUEUE_HOLD_WAIT_S + 60


def test_a_restarted_daemon_goes_on_where_the_last_one_stopped(world):
    clock, slurm, store, actor = world
    start(actor(), slurm, (41, CHANGE_TYPE, NEW_CELL), (42, SUSPEND, None))
    clock.advance_to(1000.0 + TIMEOUT_S)
    advance(actor(), slurm)  # forced requeues, then this daemon dies
    assert sorted(c for c in slurm.calls if c[0] == "requeue_hold") == [("requeue_hold", 41), ("requeue_hold", 42)]
    b = actor()
    assert b.recover() == 2 and len(store.open_entries()) == 2  # still running: kept for the rounds
    slurm.requeued_held(41)
    slurm.requeued_held(42)
    clock.advance_to(1100.0)
    advance(b, slurm)
    clock.advance_to(1100.0 + REQUEUE_SETTLE_S)
    _, acts = advance(b, slurm)
    assert sorted(acts.rescaled) == [41, 42]
    assert ("release", 41) in slurm.calls and ("release", 42) not in slurm.calls  # a suspension stays held
    (suspended,) = [c[2] for c in slurm.calls if c[:2] == ("update", 42)]
    assert suspended.admin_comment == "requested=any why=why"
    assert slurm.calls.count(("requeue_hold", 41)) == 1  # not forced again after the restart


def test_a_job_released_by_someone_else_after_its_requeue_is_left_to_them(world):
    clock, slurm, store, actor = world
    a = actor()
    start(a, slurm, (41, CHANGE_TYPE, NEW_CELL))
    slurm.requeued_held(41)
    advance(a, slurm)
    slurm.state[41] = replace(slurm.state[41], state="RUNNING", reason="", priority=1)  # an admin released it
    clock.advance_to(1000.0 + TIMEOUT_S)
    assert advance(a, slurm)[0] == {}
    assert ("requeue_hold", 41) not in slurm.calls
    (e,) = store.entries()
    assert (e.state, e.note) == (journal.ABANDONED, "released by another hand")


def test_a_job_that_ended_meanwhile_is_abandoned(world):
    clock, slurm, store, actor = world
    a = actor()
    start(a, slurm, (41, CHANGE_TYPE, NEW_CELL))
    slurm.state[41] = replace(slurm.state[41], state="CANCELLED")
    assert advance(a, slurm)[0] == {}
    (e,) = store.entries()
    assert (e.state, e.note) == (journal.ABANDONED, "job ended")
    assert slurm.calls == [("signal", 41)]


def test_a_rescale_journaled_but_never_signalled_is_signalled_by_the_next_round(world):
    clock, slurm, store, actor = world
    store.intend(41, journal.RESCALE, NEW_CELL, 990.0)  # the daemon died before USR1 went out
    a = actor()
    assert a.recover() == 1 and len(store.open_entries()) == 1
    assert advance(a, slurm)[0] == {41: NEW_CELL}
    assert slurm.calls == [("signal", 41)] and store.open_entries()[0].note == journal.SIGNALLED
    clock.advance_to(1000.0 + TIMEOUT_S - 1)  # the timeout counts from this signal
    advance(a, slurm)
    assert ("requeue_hold", 41) not in slurm.calls


def test_an_action_whose_command_cannot_even_start_leaves_no_open_entry(world):
    """An error that is no answer from Slurm (a fork refused under memory pressure) ended
    the round with the start's entry open, and the next restart applied it again, over
    whatever the rounds had done since."""
    clock, slurm, store, actor = world

    def refused(job_id):
        raise BlockingIOError(11, "Resource temporarily unavailable")
    slurm.release = refused
    with pytest.raises(BlockingIOError):
        actor().take(journal.START, 41, JobUpdate(admin_comment="x"), True, Acts(), "a start")
    assert store.open_entries() == ()
    (entry,) = store.entries(41)
    assert entry.state == journal.FAILED and entry.note.startswith("no answer: BlockingIOError")


def test_a_job_that_ran_when_the_forecast_began_and_waits_now_shows_its_restart(world):
    """The forecast began while the job ran (its ``start_s`` is that run's start, an hour
    ago); it waits now: the start shown is its next start from waiting."""
    from estimator.contract import format_utc, parse_plan_comment
    from estimator.jobs import JobSpec
    from policy.forecast import JobForecast
    from policy.interface import PENDING, JobView
    from slurm_ext.observe import ManagedJob

    clock, slurm, _, actor = world
    now_s = clock.now_s()
    waiting = replace(slurm.state[41], state="PENDING", reason="JobHeldAdmin", priority=0,
                      admin_comment="requested=a100 why=preempted")
    view = JobView("41", "u", JobSpec("gpt-1.3b", 8, 4, "a100"), 0.0, PENDING, None, 50.0, 1000, 1, now_s)
    shown = JobForecast("41", now_s - 3600.0, now_s + 1470.0, ("a100x4:s1",), next_start_s=now_s + 130.0)
    actor()._show_forecasts([ManagedJob(waiting, None, view)], {"41": shown}, 10, Acts())
    (call,) = slurm.calls
    comment = parse_plan_comment(call[2].admin_comment)
    assert (comment.expected_start_s, comment.expected_end_s) == (now_s + 130.0, now_s + 1470.0), \
        format_utc(comment.expected_start_s)
