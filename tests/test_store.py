"""The state store and the journal's recovery plan."""

import sqlite3

import pytest

from slurm_ext.slurm_client import JobUpdate, SlurmJob
from slurm_ext.store import (
    ABANDONED, ANNOTATE, CLOSE, DONE, FAILED, FORCED, INTENDED, KEEP, REAPPLY, RELEASE, RELEASE_ONLY,
    RESCALE, SIGNALLED, START, SUSPEND, Store, plan_recovery,
)

UPDATE = JobUpdate(partition="a100", gpus_per_node=4, num_nodes=2,
                   admin_comment="cell=a100x8:s2 plan=[dp2tp2|dp4tp1] mb=8 why=best",
                   required_nodes=("a100-2", "a100-1"))


@pytest.fixture
def store(tmp_path):
    s = Store(tmp_path / "state" / "slurm-ext.db")
    yield s
    s.close()


def held(job_id, state="PENDING"):
    return SlurmJob(job_id, "alice", "train", state, reason="JobHeldAdmin", priority=0,
                    comment="elastic")


def job(job_id, state, reason="Priority", priority=100):
    return SlurmJob(job_id, "alice", "train", state, reason=reason, priority=priority,
                    comment="elastic")


def test_journal_is_durable_across_reopen(tmp_path):
    path = tmp_path / "j.db"
    s = Store(path)
    first = s.intend(7, START, UPDATE, now_s=100.0)
    second = s.intend(8, RELEASE, None, now_s=101.0)
    s.close_entry(second, DONE, now_s=102.0, note="released")
    s.close()  # as if the daemon died here
    reopened = Store(path)
    open_ = reopened.open_entries()
    assert [e.entry_id for e in open_] == [first]
    assert open_[0].update == UPDATE and open_[0].kind == START and open_[0].state == INTENDED
    assert [e.state for e in reopened.entries()] == [INTENDED, DONE]
    assert reopened.entries(8)[0].note == "released"
    reopened.close()


def test_a_reader_opens_the_journal_without_writing_it(tmp_path):
    """``slurm-ext explain`` runs as any user: it reads the daemon's file and writes
    nothing, neither the schema nor its journal mode (which needed write access)."""
    path = tmp_path / "j.db"
    writer = Store(path)
    writer.intend(7, START, UPDATE, now_s=100.0)
    writer.close()
    reader = Store(path, read_only=True)
    assert [e.kind for e in reader.entries(7)] == [START]
    with pytest.raises(sqlite3.OperationalError, match="readonly"):
        reader.intend(8, START, UPDATE, now_s=101.0)
    reader.close()
    other = tmp_path / "other.db"
    sqlite3.connect(other).execute("CREATE TABLE t (x)").connection.close()
    with pytest.raises(sqlite3.Error):  # not the daemon's file: an error explain reports, no schema written
        Store(other, read_only=True).entries(7)
    assert [r[0] for r in sqlite3.connect(other).execute("SELECT name FROM sqlite_master")] == ["t"]


def test_rejects_unknown_kinds_and_states(store):
    with pytest.raises(ValueError, match="kind 'explode'"):
        store.intend(1, "explode", None, 0.0)
    entry = store.intend(1, START, UPDATE, 0.0)
    with pytest.raises(ValueError, match="state 'intended'"):
        store.close_entry(entry, INTENDED, 1.0)


def test_submit_time_survives_requeue(store):
    assert store.submit_times({5: 1000.0, 6: 1010.0}) == {5: 1000.0, 6: 1010.0}
    # A requeue resets Slurm's submit time; the store keeps the original.
    assert store.submit_times({5: 2000.0, 9: 2001.0}) == {5: 1000.0, 9: 2001.0}


def test_suspended_times_are_the_last_completed_suspensions(store):
    first = store.intend(5, SUSPEND, None, 100.0)
    store.close_entry(first, DONE, 110.0)
    again = store.intend(5, SUSPEND, None, 500.0)
    store.close_entry(again, DONE, 520.0)
    store.close_entry(store.intend(6, SUSPEND, None, 600.0), FAILED, 610.0, "never came back held")
    store.intend(7, SUSPEND, None, 700.0)  # still open
    store.close_entry(store.intend(8, RESCALE, UPDATE, 800.0), DONE, 810.0)
    assert store.suspended_times() == {5: 520.0}


def test_specs_estimates_progress(store):
    store.put_spec(3, {"model": "gpt-1.3b"}, None, 1.0)
    store.put_spec(4, None, "model='x': unknown", 1.0)
    assert store.spec(3) == ({"model": "gpt-1.3b"}, None)
    assert store.spec(4) == (None, "model='x': unknown")
    assert store.spec(5) is None
    store.put_estimate("k", [{"a": 1}], 1.0)
    assert store.get_estimate("k") == [{"a": 1}] and store.get_estimate("other") is None
    store.add_progress(3, 10.5, 1.0)
    store.add_progress(3, 4.5, 2.0)
    assert store.progress() == {3: 15.0}
    store.submit_times({3: 1.0, 4: 1.0})
    assert store.forget_jobs_except([3]) == 2
    assert store.spec(4) is None and store.spec(3) is not None


def test_prune_keeps_open_entries_and_recent_estimates(store):
    a = store.intend(1, START, UPDATE, 10.0)
    b = store.intend(2, START, UPDATE, 10.0)
    store.close_entry(b, DONE, 11.0)
    store.put_estimate("old", [{"a": 1}], 10.0)
    store.put_estimate("new", [{"a": 2}], 60.0)
    assert store.prune(older_than_s=50.0) == 2  # the closed entry and the old estimate
    assert [e.entry_id for e in store.entries()] == [a]
    assert store.get_estimate("old") is None and store.get_estimate("new") == [{"a": 2}]


def test_one_jobs_entries_are_found_through_an_index_not_a_scan(store):
    """The daemon reads one job's entries for every job it released, every round: on a
    long journal a scan of it per job made rounds slow."""
    plan = " ".join(row[-1] for row in store._exec(
        "EXPLAIN QUERY PLAN SELECT id FROM journal WHERE job_id = ? ORDER BY id", (1,)).fetchall())
    assert "USING COVERING INDEX journal_job" in plan or "USING INDEX journal_job" in plan, plan


def test_writes_are_committed_immediately(tmp_path):
    path = tmp_path / "j.db"
    s = Store(path)
    s.intend(11, RESCALE, UPDATE, 5.0)
    other = sqlite3.connect(path)  # another process reading while the daemon runs
    assert other.execute("SELECT job_id, state FROM journal").fetchall() == [(11, INTENDED)]
    other.close()
    s.close()


def test_a_rescale_and_the_progress_it_credits_are_written_together(tmp_path):
    """The daemon died between journaling a rescale and crediting the stopped run's
    iterations: the next one signalled the job and the iterations were never counted."""
    s = Store(tmp_path / "j.db")
    with pytest.raises(KeyboardInterrupt):
        with s.transaction():
            entry = s.intend(11, RESCALE, UPDATE, 5.0)
            raise KeyboardInterrupt  # killed here, before add_progress
    assert s.open_entries() == () and s.progress() == {}
    with s.transaction():
        entry = s.intend(11, RESCALE, UPDATE, 5.0)
        s.add_progress(11, 100.0, 5.0, entry)
    other = sqlite3.connect(tmp_path / "j.db")  # committed: another process sees both
    assert other.execute("SELECT count(*) FROM journal").fetchone() == (1,)
    assert other.execute("SELECT iterations_done FROM progress").fetchone() == (100.0,)
    other.close()
    s.close()


def entries(store, *specs):
    for job_id, kind in specs:
        store.intend(job_id, kind, UPDATE if kind in (START, RESCALE) else None, 1.0)
    return store.open_entries()


def steps_by_job(steps):
    return {s.entry.job_id: s.step for s in steps}


def test_recovery_reapplies_held_starts_and_rescales(store):
    es = entries(store, (1, START), (2, RESCALE), (3, START), (4, RESCALE), (5, SUSPEND))
    jobs = {1: held(1), 2: held(2, "SPECIAL_EXIT"), 3: job(3, "RUNNING"), 4: job(4, "RUNNING"),
            5: job(5, "RUNNING")}
    # A rescale or suspension whose job still runs is under way: the rounds go on with it.
    assert steps_by_job(plan_recovery(es, jobs)) == {1: REAPPLY, 2: REAPPLY, 3: CLOSE, 4: KEEP, 5: KEEP}
    # Its run ending (exit 86 under way): closed as done, the job came back held and was
    # started at once, within the second its credentials were revoked (Slurm fails it).
    ending = {4: job(4, "COMPLETING"), 5: job(5, "REQUEUED")}
    assert steps_by_job(plan_recovery(es[3:], ending)) == {4: KEEP, 5: KEEP}
    assert steps_by_job(plan_recovery(es[3:4], {4: job(4, "PENDING")})) == {4: CLOSE}  # released already


def test_a_rescale_marks_where_it_stands(store):
    entry = store.intend(7, RESCALE, UPDATE, 10.0)
    store.mark_entry(entry, SIGNALLED, 11.0)
    (e,) = store.open_entries()
    assert (e.note, e.created_s, e.updated_s, e.state) == (SIGNALLED, 10.0, 11.0, INTENDED)
    store.close_entry(entry, DONE, 20.0)
    store.mark_entry(entry, FORCED, 30.0)  # a closed entry stays as it was closed
    (e,) = store.entries()
    assert (e.state, e.updated_s) == (DONE, 20.0)


def test_recovery_releases_and_closes(store):
    es = entries(store, (1, RELEASE), (2, SUSPEND), (3, ANNOTATE), (4, START), (5, START))
    jobs = {1: held(1), 2: held(2), 3: held(3), 4: job(4, "PENDING"),
            5: job(5, "COMPLETED")}
    steps = plan_recovery(es, jobs)
    assert steps_by_job(steps) == {1: RELEASE_ONLY, 2: CLOSE, 3: CLOSE, 4: CLOSE, 5: CLOSE}
    # A job Slurm forgot is closed too.
    assert steps_by_job(plan_recovery(es, {})) == {i: CLOSE for i in range(1, 6)}


def test_recovery_only_acts_on_the_latest_entry_of_a_job(store):
    es = entries(store, (1, START), (1, RESCALE))
    steps = plan_recovery(es, {1: held(1)})
    assert [(s.entry.kind, s.step) for s in steps] == [(START, CLOSE), (RESCALE, REAPPLY)]
    assert "superseded" in steps[0].why


def test_a_later_closed_entry_supersedes_an_open_one(store):
    """A start left open by a round that failed, then a suspend the rounds completed: the
    next restart had applied the stale start again, releasing the suspended job."""
    (stale,) = entries(store, (1, START))
    later = store.intend(1, SUSPEND, None, 20.0)
    store.close_entry(later, DONE, 21.0)
    (step,) = plan_recovery([stale], {1: held(1)}, store.newest_entry_ids())
    assert (step.step, step.why) == (CLOSE, "superseded by a later entry")
    assert plan_recovery([stale], {1: held(1)})[0].step == REAPPLY  # without the closed entries


def test_held_means_hold_reason_or_zero_priority(store):
    es = entries(store, (1, START))
    not_held = job(1, "PENDING", reason="Resources", priority=5)
    assert plan_recovery(es, {1: not_held})[0].step == CLOSE
    zero_prio = job(1, "PENDING", reason="None", priority=0)
    assert plan_recovery(es, {1: zero_prio})[0].step == REAPPLY
    store.close_entry(es[0].entry_id, ABANDONED, 2.0, "test")
    assert store.open_entries() == ()


def test_cached_estimates_keep_every_field_and_a_new_estimator_makes_them_anew(store):
    from dataclasses import fields, replace
    from estimator.cells import Cell, CellEstimate, StagePlan
    from slurm_ext.store import EstimateCache, estimate_from_json, estimate_to_json
    est = CellEstimate(Cell("a100", 8, 4, 2), (StagePlan(0, 17, 4, 1), StagePlan(17, 34, 4, 1, True)), 8,
                       12.5, 20.48, 38.2, True, "", "profiled", "profile", "compiled", remat=False,
                       zero_level=3, offload=True, host_memory_gb=61.5, runnable=False,
                       plan="cell=a100x8:s2 plan=[dp4tp1|dp4tp1ep] mb=8 remat=0 zero=3 offload=1")
    back = estimate_from_json(estimate_to_json(est))
    assert back == est
    # Each field set apart from its default, so a field left out would fail the equality.
    defaults = CellEstimate(est.cell, est.stages, 8, 12.5, 20.48, 38.2, True, "")
    assert all(getattr(est, f.name) != getattr(defaults, f.name) for f in fields(CellEstimate)
               if f.name not in ("cell", "stages", "micro_batches", "iteration_time_s", "samples_per_s",
                                 "peak_memory_gb", "feasible", "reason"))
    calls = []

    def compute(value):
        def run():
            calls.append(value)
            return [value]
        return run

    assert EstimateCache(store, version="v1").get("job", compute(est), 1.0) == (est,)
    assert EstimateCache(store, version="v1").get("job", compute(None), 2.0) == (est,)  # read back
    newer = replace(est, iteration_time_s=10.0)
    assert EstimateCache(store, version="v2").get("job", compute(newer), 3.0) == (newer,)
    assert calls == [est, newer]


def test_one_daemon_at_a_time_acts_on_a_state_file(tmp_path):
    """Two daemons on one state file would signal and release the same jobs twice; the
    second is refused, naming the first's process, and may start once the first is gone."""
    import os

    from slurm_ext.store import StateFileBusy, lock_state_file

    path = tmp_path / "state" / "state.db"
    held = lock_state_file(path)
    with pytest.raises(StateFileBusy, match=rf"pid {os.getpid()}\) acts on .*state.db"):
        lock_state_file(path)
    os.close(held)  # the first daemon ends
    os.close(lock_state_file(path))


def test_the_estimates_kept_in_memory_are_bounded_least_recently_used_out(store, monkeypatch):
    """Every refit or new profile makes each spec's key anew: the memory of a daemon that
    runs for months must not keep every key it ever made."""
    from slurm_ext import store as store_module
    from slurm_ext.store import EstimateCache

    monkeypatch.setattr(store_module, "MEMO_KEYS", 2)
    cache = EstimateCache(store, version="v1")
    for key in ("a", "b", "a", "c"):  # "a" used again, so "b" is the least recently used
        cache.get(key, lambda: [], 1.0)
    assert list(cache._memo) == ["a", "c"]
    assert store.get_estimate("b") is not None  # still in the file: read back when asked again


def test_every_field_of_an_update_survives_the_journal(store):
    """An entry re-applied (a rescale's release, recovery after a restart) is the update as
    meant: a field left out would send Slurm another (one it refuses: a count per job left
    beside the count per node)."""
    from dataclasses import fields
    full = JobUpdate(partition="a100", gpus_per_node=4, num_nodes=2, admin_comment="why=x",
                     required_nodes=("a100-1", "a100-2"), gpu_type="a100", features="", cpus_per_gpu=8,
                     mem_per_gpu_mb=64000, start_now=False, clear_gpus_per_job=True)
    assert all(getattr(full, f.name) != f.default for f in fields(JobUpdate))  # every field set
    entry_id = store.intend(7, START, full, now_s=1.0)
    (entry,) = [e for e in store.entries(7) if e.entry_id == entry_id]
    assert entry.update == full
    # A row written before a field existed reads back with its default.
    store._exec("UPDATE journal SET payload_json = ? WHERE id = ?", ('{"partition": "a100", "gpus_per_node": 4}',
                                                                    entry_id))
    (old,) = store.entries(7)
    assert old.update == JobUpdate(partition="a100", gpus_per_node=4)
