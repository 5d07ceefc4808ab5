"""The daemon's rounds without Slurm: the plan a running job's runner tuned, shown in its
AdminComment, and rounds over fixed jobs and nodes (``FakeSlurm``, which records every
change the daemon asks for): forecasts, progress, dropped jobs, expert parallelism.

The same rounds against the real lab are in tests/test_daemon.py.
"""

import json
import time
from dataclasses import replace

import pytest

from estimator.cells import Cell
from estimator.contract import (
    ADMIN_COMMENT_PLAN, MEASURED_FILE, PLAN_KEYS, PlanComment, RunnerReport, format_plan_comment, parse_plan_comment,
)
from estimator.plan_string import parse_plan
from policy.clock import SimulatedClock
from slurm_ext.config import resolve
import slurm_ext.daemon as daemon_module
from slurm_ext.act import HOLD_RESERVATION
from slurm_ext.daemon import Daemon
from slurm_ext.observe import running_plan_comment
from slurm_ext.profile_job import BACKGROUND_COMMENT, JOB_NAME
from slurm_ext.slurm_client import JobUpdate, SlurmJob
from slurm_ext.steering import Steering
from slurm_ext.store import Store
from test_daemon import TRAINER, node

# What the daemon wrote when it started the job on a100x4:s2.
DAEMON_COMMENT = format_plan_comment(PlanComment(
    requested="any", cell="a100x4:s2", plan="[dp2tp1|dp2tp1]", micro_batches=16, remat=True,
    layers="0,12,24", samples_per_s=80.0, why="started on a100x4:s2 (best)"))


def measured_json(plan="cell=a100x4:s2 plan=[dp2tp1|dp1tp2] mb=8 remat=0 layers=0,10,24",
                  source="tuned", **fields):
    """measured.json as the runner writes it (constructed)."""
    cell = plan.split()[0].partition("=")[2] if plan else "a100x4:s2"
    raw = RunnerReport(job_id="41", cell=cell, plan=plan, plan_source=source, iteration_time_s=0.67,
                       samples_per_s=95.5, steps_measured=8, platform="gpu", global_batch=64,
                       num_devices=4, restart_count=0, step=None, step_at_s=None,
                       updated_at_s=1700000000.0, tuning_s=41.2, candidates_measured=5).to_json()
    raw.update(fields)
    return json.dumps(raw)


def test_tuned_plan_that_differs_is_written_back_with_its_measured_speed():
    text = running_plan_comment(DAEMON_COMMENT, measured_json(), False, 0)
    assert text == ("requested=any cell=a100x4:s2 plan=[dp2tp1|dp1tp2] mb=8 remat=0 layers=0,10,24 "
                    "src=tuned sps=95.5 measured=1 why=started on a100x4:s2 (best)")
    # Once written, the same file changes nothing: no rewrite every round.
    assert running_plan_comment(text, measured_json(), False, 0) is None
    # A cached or user-given plan says so; the runner reads the plan string out of it as before.
    cached = running_plan_comment(DAEMON_COMMENT, measured_json(source="cached"), False, 0)
    assert "src=cached" in cached
    assert "src=given" in running_plan_comment(DAEMON_COMMENT, measured_json(source="given"), False, 0)
    words = [w for w in cached.split() if w.partition("=")[0] in PLAN_KEYS]
    assert parse_plan(" ".join(words)).format() == json.loads(measured_json())["plan"]


def test_same_plan_changes_nothing():
    same = "cell=a100x4:s2 plan=[dp2tp1|dp2tp1] mb=16 remat=1 layers=0,12,24"
    assert running_plan_comment(DAEMON_COMMENT, measured_json(same, source=ADMIN_COMMENT_PLAN), False, 0) is None
    assert running_plan_comment(DAEMON_COMMENT, measured_json(same, source=ADMIN_COMMENT_PLAN), True, 0) is None


def test_an_expert_parallel_plan_running_as_planned_changes_nothing():
    """The running plan's ``ep`` stages are part of the plan it is compared by."""
    planned = "cell=a100x4:s1 plan=[dp4tp1ep] mb=4 remat=1"
    comment = f"requested=any {planned} sps=80 why=started on a100x4:s1 (best)"
    assert running_plan_comment(comment, measured_json(planned, source=ADMIN_COMMENT_PLAN), False, 0) is None
    tuned = running_plan_comment(comment, measured_json("cell=a100x4:s1 plan=[dp4tp1] mb=4 remat=1"), False, 0)
    assert "plan=[dp4tp1] " in tuned and "src=tuned" in tuned


def test_measurement_of_another_cell_or_run_changes_nothing():
    before_rescale = measured_json("cell=a10x2:s1 plan=[dp2tp1] mb=4 remat=1")
    assert running_plan_comment(DAEMON_COMMENT, before_rescale, True, 0) is None
    # Same Cell label, but written by the run before a requeue.
    assert running_plan_comment(DAEMON_COMMENT, measured_json(restart_count=0), True, 1) is None
    assert running_plan_comment(DAEMON_COMMENT, measured_json(restart_count=1), True, 1) is not None


@pytest.mark.parametrize("text", [
    "{not json", "[]", "",
    measured_json(plan="cell=a100x4:s2 plan=[dp3tp1|dp1tp1] mb=8 remat=0"),   # invalid plan
    measured_json(plan="cell=a100x4:s2 plan=[dp2tp1|dp1tp2] mb=8 remat=0", cell="a10x4:s2"),
    measured_json(source="alpa"),          # a plan_source this contract does not know
    measured_json(source=None),            # a runner that does not report it
    measured_json(plan=None),
    measured_json(restart_count="0"),
])
def test_malformed_measurement_changes_nothing(text):
    assert running_plan_comment(DAEMON_COMMENT, text, True, 0) is None


def test_cpu_measurement_updates_the_plan_but_not_the_speed_unless_allowed():
    cpu = measured_json(platform="cpu")
    text = running_plan_comment(DAEMON_COMMENT, cpu, False, 0)
    pc = parse_plan_comment(text)
    assert (pc.plan, pc.micro_batches, pc.remat, pc.layers, pc.plan_source) == \
           ("[dp2tp1|dp1tp2]", 8, False, "0,10,24", "tuned")
    assert pc.samples_per_s == 80.0 and not pc.sps_measured  # still the estimate
    assert running_plan_comment(text, cpu, False, 0) is None
    allowed = parse_plan_comment(running_plan_comment(DAEMON_COMMENT, cpu, True, 0))
    assert allowed.samples_per_s == 95.5 and allowed.sps_measured


def test_measured_speed_is_refreshed_only_when_it_moved():
    shown = running_plan_comment(DAEMON_COMMENT, measured_json(), False, 0)
    assert running_plan_comment(shown, measured_json(samples_per_s=99.0), False, 0) is None
    moved = running_plan_comment(shown, measured_json(samples_per_s=120.0), False, 0)
    assert moved == shown.replace("sps=95.5", "sps=120")
    # The daemon's own plan running as planned keeps its estimate.
    same = "cell=a100x4:s2 plan=[dp2tp1|dp2tp1] mb=16 remat=1 layers=0,12,24"
    assert running_plan_comment(DAEMON_COMMENT, measured_json(same, source=ADMIN_COMMENT_PLAN,
                                                              samples_per_s=10.0), False, 0) is None


def test_a_tuned_plan_shown_before_its_speed_gets_its_first_measured_speed():
    """The runner checkpointed during its warm-up: its plan is shown with the daemon's
    estimate; the report with a measured speed that follows replaces the estimate."""
    early = measured_json(iteration_time_s=None, samples_per_s=None, steps_measured=0)
    shown = running_plan_comment(DAEMON_COMMENT, early, False, 0)
    pc = parse_plan_comment(shown)
    assert (pc.plan, pc.plan_source, pc.samples_per_s, pc.sps_measured) == ("[dp2tp1|dp1tp2]", "tuned", 80.0, False)
    assert running_plan_comment(shown, early, False, 0) is None
    later = parse_plan_comment(running_plan_comment(shown, measured_json(), False, 0))
    assert (later.plan, later.samples_per_s, later.sps_measured) == ("[dp2tp1|dp1tp2]", 95.5, True)


def test_plan_without_layers_and_comments_without_a_plan():
    text = running_plan_comment(DAEMON_COMMENT, measured_json("cell=a100x4:s2 plan=[dp2tp1|dp2tp1] mb=16 remat=1"),
                                False, 0)
    assert "layers=" not in text and "src=tuned" in text  # the runner's default stage split
    for comment in ("requested=any why=waiting for GPUs", "requested=any error=model: unknown", ""):
        assert running_plan_comment(comment, measured_json(), True, 0) is None
    # A plan the runner read from the AdminComment keeps the source the AdminComment gave it.
    tuned = DAEMON_COMMENT.replace(" sps=", " src=tuned sps=")
    shown = running_plan_comment(tuned, measured_json(source=ADMIN_COMMENT_PLAN), False, 0)
    assert "plan=[dp2tp1|dp1tp2]" in shown and "src=tuned" in shown


class FakeSlurm:
    """A SlurmClient over fixed jobs and nodes that records every change asked of it."""

    def __init__(self, jobs, nodes, script):
        self._jobs, self._nodes, self._script = {j.job_id: j for j in jobs}, tuple(nodes), script
        self.calls = []

    def jobs(self):
        return tuple(self._jobs.values())

    def nodes(self):
        return self._nodes

    def batch_script(self, job_id):
        return self._script

    def update_pending(self, job_ids, update):
        for job_id in [job_ids] if isinstance(job_ids, int) else job_ids:
            self.calls.append(("update", job_id, update))
            if update.admin_comment is not None:  # as Slurm would show it next round
                self._jobs[job_id] = replace(self._jobs[job_id], admin_comment=update.admin_comment)

    def __getattr__(self, name):  # hold, release, signal, requeue, ...: recorded, never applied
        return lambda *args, **kw: self.calls.append((name, *args))


def test_daemon_shows_the_tuned_plan_of_a_running_job_and_does_nothing_else(tmp_path):
    comment = format_plan_comment(PlanComment(
        requested="any", cell="a100x4:s1", plan="[dp4tp1]", micro_batches=4, remat=True,
        layers="0,24", samples_per_s=80.0, why="started on a100x4:s1 (best)"))
    job = SlurmJob(41, "alice", "train", "RUNNING", partition="a100", comment="elastic model=gpt-760m",
                   admin_comment=comment, gpus_per_node=4, granted_gpus_per_node=(4,),
                   granted_gpu_type="a100", nodes=("a100-1",), node_count=1,
                   submit_time_s=1000, start_time_s=1000, priority=1, requeue=True)
    client = FakeSlurm([job], [node("a100-1", "a100", 4, used=4)], TRAINER)
    (tmp_path / "41").mkdir()
    (tmp_path / "41" / MEASURED_FILE).write_text(measured_json(
        "cell=a100x4:s1 plan=[dp2tp2] mb=8 remat=0 layers=0,24", platform="cpu"))
    cfg = resolve({"state_db": str(tmp_path / "state.db"), "checkpoint_root": str(tmp_path),
                   "use_cpu_measurements": True, "forecast_every_s": 0}, {}, {})  # the plan alone
    daemon = Daemon(cfg, client, Store(cfg.state_db), out=lambda line: None)

    report = daemon.round()
    assert report.actions == () and report.plans_shown == (41,)
    # The first round clears a node hold a previous daemon may have left (none to clear here).
    assert [c for c in client.calls if c[0] == "hold_nodes"] == [("hold_nodes", HOLD_RESERVATION, ())]
    client.calls = [c for c in client.calls if c[0] != "hold_nodes"]
    ((kind, job_id, update),) = client.calls  # one AdminComment update, no signal, requeue, hold
    assert (kind, job_id, update.start_now) == ("update", 41, False)
    assert (update.partition, update.gpus_per_node, update.num_nodes) == (None, None, None)
    assert update.admin_comment == ("requested=any cell=a100x4:s1 plan=[dp2tp2] mb=8 remat=0 layers=0,24 "
                                    "src=tuned sps=95.5 measured=1 why=started on a100x4:s1 (best)")
    assert daemon.store.entries() == ()  # display only: nothing to recover
    # The next round sees its own text: nothing to write, the job is still the policy's
    # running job on the same Cell.
    client.calls.clear()
    report = daemon.round()
    assert report.actions == () and report.plans_shown == () and client.calls == []
    assert report.managed == 1


def _waiting_behind_a_plain_job(tmp_path, now: int):
    """A daemon over one a100 node whose 4 GPUs a plain job holds until ``now`` + 600 s,
    and elastic job 41 waiting behind it: (daemon, client, config)."""
    plain = SlurmJob(40, "bob", "plain", "RUNNING", partition="a100", gpus_per_node=4,
                     granted_gpus_per_node=(4,), granted_gpu_type="a100", nodes=("a100-1",), node_count=1,
                     submit_time_s=now - 60, start_time_s=now - 60, end_time_s=now + 600, priority=1)
    waiting = SlurmJob(41, "alice", "train", "PENDING", reason="JobHeldAdmin", partition="a100",
                       comment="elastic model=gpt-760m gpus=4 global_batch=64 iterations=1000",
                       admin_comment="requested=any", gpus_per_node=4, node_count=1, submit_time_s=now - 30)
    client = FakeSlurm([plain, waiting], [node("a100-1", "a100", 4, used=4)], "#!/bin/bash\n")
    cfg = resolve({"state_db": str(tmp_path / "state.db")}, {}, {})
    return Daemon(cfg, client, Store(cfg.state_db), out=lambda line: None), client, cfg


def test_a_waiting_job_is_forecast_to_start_when_the_plain_job_ends(tmp_path):
    """Every GPU is held by a plain job that Slurm ends in 10 minutes: the waiting elastic
    job's AdminComment says it starts then, and ends when its iterations are done."""
    now = int(time.time())
    daemon, client, cfg = _waiting_behind_a_plain_job(tmp_path, now)
    seen = []
    decide = daemon.policy.decide
    daemon.policy.decide = lambda snapshot: seen.append(snapshot) or decide(snapshot)
    report = daemon.round()  # its why; a forecast starts in the background
    assert report.actions == () and report.forecasts_shown == ()
    daemon.forecasts.wait(30)
    report = daemon.round()  # a job whose AdminComment this round rewrote waits for the next
    assert report.forecasts_shown == () and not daemon.forecasts.running  # every forecast_every_s (60 s)
    daemon._forecast_s -= cfg.forecast_every_s
    daemon.round()
    daemon.forecasts.wait(30)
    report = daemon.round()
    assert report.forecasts_shown == (41,)
    pc = parse_plan_comment(client.jobs()[1].admin_comment)
    assert pc.expected_start_s == now + 600 and pc.why and pc.progress_frac == 0.0
    assert len(pc.expected_cells) == 1 and pc.expected_cells[0].startswith("a100x")
    # It ends after a start's cost and its 1,000 iterations on one of its a100 Cells.
    (view,) = seen[0].jobs
    ends = [now + 600 + cfg.restart_cost_s + 1000 * e.iteration_time_s for e in view.feasible_estimates()
            if e.cell.gpu_type == "a100" and e.cell.num_gpus <= 4]
    assert min(abs(pc.expected_end_s - end) for end in ends) <= 1.0


def test_gpus_reserved_for_a_job_about_to_start_come_free_in_the_forecast_when_it_would_end(tmp_path):
    """The daemon released one job onto the only node's GPUs and Slurm has not started it
    yet: the job waiting behind it is forecast to start when the first would finish there,
    not never."""
    now = int(time.time())
    spec = "elastic model=gpt-760m gpus=4 global_batch=64 iterations=1000"
    first, second = (SlurmJob(job_id, "alice", "train", "PENDING", reason="JobHeldAdmin", partition="a100",
                              comment=spec, admin_comment="requested=any", gpus_per_node=4, node_count=1,
                              submit_time_s=now - 60 + job_id) for job_id in (41, 42))
    client = FakeSlurm([first], [node("a100-1", "a100", 4)], "#!/bin/bash\n")
    cfg = resolve({"state_db": str(tmp_path / "state.db")}, {}, {})
    daemon = Daemon(cfg, client, Store(cfg.state_db), out=lambda line: None)
    seen = []
    decide = daemon.policy.decide
    daemon.policy.decide = lambda snapshot: seen.append(snapshot) or decide(snapshot)
    assert daemon.round().actions == (("start", 41),)
    daemon.forecasts.wait(30)
    # As Slurm shows it once released: pending for resources, its Cell in its AdminComment.
    released = client.jobs()[0]
    cell = parse_plan_comment(released.admin_comment).cell
    assert cell == "a100x4:s1"  # alone, it takes the whole node
    client._jobs[41] = replace(released, reason="Resources", priority=1)
    client._jobs[42] = second
    forecast_at_s = []  # the clock of each round that started a forecast
    start_forecast = daemon._start_forecast
    daemon._start_forecast = lambda *args: forecast_at_s.append(args[-1]) or start_forecast(*args)
    for _ in range(4):  # rewritten AdminComments wait a round; forecasts come every 60 s
        daemon._forecast_s -= cfg.forecast_every_s
        report = daemon.round()
        daemon.forecasts.wait(30)
        if 42 in report.forecasts_shown:
            break
    assert 42 in report.forecasts_shown
    # Job 41 is no longer the policy's (its GPUs are reserved): only 42 is.
    assert [v.job_id for v in seen[-1].jobs] == ["42"]
    first_view = [v for v in seen[0].jobs if v.job_id == "41"][0]
    (t_s,) = {e.iteration_time_s for e in first_view.feasible_estimates() if e.cell.label() == cell}
    ends_s = [now_s + cfg.restart_cost_s + 1000 * t_s for now_s in forecast_at_s]
    pc = parse_plan_comment(client.jobs()[1].admin_comment)  # times in whole seconds
    assert pc.expected_start_s is not None and min(ends_s) - 1 <= pc.expected_start_s <= max(ends_s) + 1


def test_a_job_the_daemon_starts_shows_its_forecast_at_once(tmp_path):
    """The update that releases a job carries its forecast on the new Cell: it starts now,
    and ends after a start's cost and its remaining iterations at its estimate there (the
    time a forecast frees its GPUs), without waiting for the job to run and the next
    forecast."""
    now = 1_800_000_000.0
    job = SlurmJob(41, "alice", "train", "PENDING", reason="JobHeldAdmin", partition="a100",
                   comment="elastic model=gpt-760m gpus=4 global_batch=64 iterations=1000",
                   admin_comment="requested=any", gpus_per_node=4, node_count=1, submit_time_s=now - 60)
    client = FakeSlurm([job], [node("a100-1", "a100", 4)], "#!/bin/bash\n")
    cfg = resolve({"state_db": str(tmp_path / "state.db"), "forecast_every_s": 0}, {}, {})
    store = Store(cfg.state_db)
    store.add_progress(41, 250.0, now - 120)  # an earlier run's iterations
    daemon = Daemon(cfg, client, store, out=lambda line: None, clock=SimulatedClock(now))
    seen = []
    decide = daemon.policy.decide
    daemon.policy.decide = lambda snapshot: seen.append(snapshot) or decide(snapshot)
    assert daemon.round().actions == (("start", 41),)
    pc = parse_plan_comment(client.jobs()[0].admin_comment)
    assert pc.cell == "a100x4:s1" and pc.plan and pc.why
    (view,) = seen[0].jobs
    (t_s,) = {e.iteration_time_s for e in view.feasible_estimates() if e.cell.label() == pc.cell}
    assert pc.expected_start_s == now and pc.progress_frac == 0.25
    assert abs(pc.expected_end_s - (now + cfg.restart_cost_s + 750 * t_s)) <= 1.0  # whole seconds


def test_a_rescale_on_nodes_slurm_picks_holds_its_new_cell_where_its_run_leaves_gpus(tmp_path):
    """Job 7 holds both nodes and is checkpointing for a shrink to 4 GPUs on nodes Slurm
    picks (its update names none, as for a placement uneven over nodes). No GPU is free for
    its new Cell elsewhere, so the forecast must see it land on the GPUs its run leaves:
    one node's 4 come free now and the other's when it would finish there, not all 8 now
    (and the new Cell's GPUs never held)."""
    now = 1_800_000_000.0
    spec = "elastic model=gpt-760m gpus=8 global_batch=64 iterations=1000"
    running = SlurmJob(7, "alice", "train", "RUNNING", partition="a100", comment=spec,
                       admin_comment="requested=any cell=a100x8:s1", gpus_per_node=4, granted_gpus_per_node=(4, 4),
                       granted_gpu_type="a100", nodes=("a100-1", "a100-2"), node_count=2,
                       submit_time_s=now - 3600, start_time_s=now - 3000, priority=1,
                       requeue=True)
    waiting = SlurmJob(8, "bob", "train", "PENDING", reason="JobHeldAdmin", partition="a100",
                       comment="elastic model=gpt-760m gpus=2 global_batch=64 iterations=1000",
                       admin_comment="requested=any", gpus_per_node=2, node_count=1, submit_time_s=now - 60)
    client = FakeSlurm([running, waiting], [node("a100-1", "a100", 4, used=4), node("a100-2", "a100", 4, used=4)],
                       "#!/bin/bash\n")
    cfg = resolve({"state_db": str(tmp_path / "state.db")}, {}, {})
    store = Store(cfg.state_db)
    update = JobUpdate(gpus_per_node=4, num_nodes=1, admin_comment="requested=any cell=a100x4:s1 plan=[dp4tp1]",
                       start_now=True)
    store.mark_entry(store.intend(7, "rescale", update, now - 10), "signalled", now - 10)
    daemon = Daemon(cfg, client, store, out=lambda line: None, clock=SimulatedClock(now))
    given = []
    start_forecast = daemon._start_forecast
    daemon._start_forecast = lambda *args: given.append(args[-2]) or start_forecast(*args)
    daemon.round()
    daemon.forecasts.wait(30)
    (releases,) = given
    at_now = {(r.node, r.gpus) for r in releases if r.at_s == now}
    later = {r.at_s for r in releases if r.at_s > now}
    assert at_now == {("a100-2", 4)}
    assert len(later) == 1  # when job 7 would finish on its new Cell
    assert [(r.node, r.gpus) for r in releases if r.at_s > now] == [("a100-1", 4)]


def test_a_background_profiling_jobs_gpus_are_not_freed_twice_in_a_forecast(tmp_path, monkeypatch):
    """A running background profiling job's GPUs are free in the policy's snapshot (the
    daemon cancels it when it places a job there), so its Slurm end time is no release:
    it would free GPUs a job the forecast placed there holds."""
    now = 1_800_000_000.0
    profiling = SlurmJob(40, "slurm", JOB_NAME, "RUNNING", partition="a100", comment=f"{BACKGROUND_COMMENT} model=gpt-760m",
                         gpus_per_node=4, granted_gpus_per_node=(4,), granted_gpu_type="a100", nodes=("a100-1",),
                         node_count=1, submit_time_s=now - 60, start_time_s=now - 60, end_time_s=now + 600,
                         priority=1)
    plain = replace(profiling, job_id=39, user="bob", name="plain", comment="", nodes=("a100-2",))
    waiting = SlurmJob(41, "alice", "train", "PENDING", reason="JobHeldAdmin", partition="a100",
                       comment="elastic model=gpt-760m gpus=4 global_batch=64 iterations=1000",
                       admin_comment="requested=any", gpus_per_node=4, node_count=1, submit_time_s=now - 30)
    client = FakeSlurm([profiling, plain, waiting],
                       [node("a100-1", "a100", 4, used=4), node("a100-2", "a100", 4, used=4)], "#!/bin/bash\n")
    cfg = resolve({"state_db": str(tmp_path / "state.db")}, {}, {})
    daemon = Daemon(cfg, client, Store(cfg.state_db), out=lambda line: None, clock=SimulatedClock(now))
    given = []
    forecast = daemon_module.forecast
    monkeypatch.setattr(daemon_module, "forecast",
                        lambda snapshot, policy, releases, *args, **kw: given.append(releases)
                        or forecast(snapshot, policy, releases, *args, **kw))
    daemon.round()
    daemon.forecasts.wait(30)
    (releases,) = given
    # Only the plain job's GPUs come free, at its Slurm end time.
    assert [(r.at_s, r.node, r.gpus) for r in releases] == [(now + 600, "a100-2", 4)]


def test_a_job_crius_ddl_drops_runs_as_submitted_and_says_why(tmp_path):
    """No Cell finishes it by its deadline: it is released as submitted, not held forever."""
    now = int(time.time())
    deadline = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(now + 3600))
    waiting = SlurmJob(41, "alice", "train", "PENDING", reason="JobHeldAdmin", partition="a100", priority=0,
                       comment=f"elastic model=gpt-760m gpus=4 global_batch=64 iterations=100000000 deadline={deadline}",
                       admin_comment="requested=any", gpus_per_node=4, node_count=1, submit_time_s=now - 30)
    client = FakeSlurm([waiting], [node("a100-1", "a100", 4)], "#!/bin/bash\n")
    cfg = resolve({"state_db": str(tmp_path / "state.db"), "policy": "crius-ddl", "forecast_every_s": 0}, {}, {})
    daemon = Daemon(cfg, client, Store(cfg.state_db), out=lambda line: None)
    report = daemon.round()
    assert ("release", 41) in report.actions
    (update,) = [c[2] for c in client.calls if c[0] == "update"]
    assert parse_plan_comment(update.admin_comment).error == \
        "dropped: no Cell finishes it by its deadline; runs as submitted"
    assert ("release", [41]) in client.calls or ("release", 41) in client.calls
    assert not any(c[0] == "hold" for c in client.calls)
    client.calls.clear()
    report = daemon.round()  # no longer the daemon's: never held again
    assert report.managed == 0 and not any(c[0] in ("hold", "update") for c in client.calls)


def test_a_suspended_job_crius_ddl_can_no_longer_finish_in_time_runs_best_effort(tmp_path):
    """A job an earlier round suspended waits requeued held (``SPECIAL_EXIT``), not
    ``PENDING``. It has run, so crius-ddl does not drop it for a deadline it can no longer
    meet (its admission was at its first start): it is started best effort, on the Cell the
    policy picks, not left held (it was dropped and released as submitted)."""
    now = int(time.time())
    deadline = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(now + 3600))
    suspended = SlurmJob(41, "alice", "train", "SPECIAL_EXIT", reason="JobHeldUser", partition="a100", priority=0,
                         comment=f"elastic model=gpt-760m gpus=4 global_batch=64 iterations=100000000 "
                                 f"deadline={deadline}",
                         admin_comment="requested=any", gpus_per_node=4, node_count=1, submit_time_s=now - 30,
                         restart_count=1)
    client = FakeSlurm([suspended], [node("a100-1", "a100", 4)], "#!/bin/bash\n")
    cfg = resolve({"state_db": str(tmp_path / "state.db"), "policy": "crius-ddl", "forecast_every_s": 0}, {}, {})
    report = Daemon(cfg, client, Store(cfg.state_db), out=lambda line: None).round()
    assert report.actions == (("start", 41),)
    assert ("release", [41]) in client.calls or ("release", 41) in client.calls
    assert "cell=a100x4:s1" in client._jobs[41].admin_comment


@pytest.mark.parametrize("restart_count,reported", [(0, True), (1, False)])
def test_a_running_job_progresses_by_the_step_its_runner_reports(tmp_path, restart_count, reported):
    """The policy sees the runner's real step (``measured.json``), not one derived from the
    estimated speed; a file of an earlier run of the job is not the current run's step."""
    job = SlurmJob(41, "alice", "train", "RUNNING", partition="a100", comment="elastic model=gpt-760m",
                   admin_comment="requested=any cell=a100x4:s1 plan=[dp4tp1] mb=4 remat=1 why=started",
                   gpus_per_node=4, granted_gpus_per_node=(4,), granted_gpu_type="a100", nodes=("a100-1",),
                   node_count=1, submit_time_s=int(time.time()) - 3600, start_time_s=int(time.time()) - 3600,
                   priority=1, restart_count=restart_count, requeue=True)
    client = FakeSlurm([job], [node("a100-1", "a100", 4, used=4)], TRAINER)
    (tmp_path / "41").mkdir()
    (tmp_path / "41" / MEASURED_FILE).write_text(measured_json(
        "cell=a100x4:s1 plan=[dp4tp1] mb=4 remat=1", source=ADMIN_COMMENT_PLAN, step=500,
        step_at_s=time.time(), iteration_time_s=2.0, restart_count=0))
    cfg = resolve({"state_db": str(tmp_path / "state.db"), "checkpoint_root": str(tmp_path)}, {}, {})
    daemon = Daemon(cfg, client, Store(cfg.state_db), out=lambda line: None)
    seen = []
    decide = daemon.policy.decide
    daemon.policy.decide = lambda snapshot: seen.append(snapshot) or decide(snapshot)
    daemon.round()
    (view,) = seen[0].jobs
    if reported:
        assert 500 <= view.iterations_done < 501  # 500 steps, plus what 2 s steps did since
    else:  # the run's hour at the Cell's speed (refined by the file to 2 s an iteration)
        assert view.iterations_done == pytest.approx(1800, rel=0.01)


@pytest.mark.parametrize("gpus_free", [True, False])
def test_a_round_believed_unchanged_is_solved_while_a_waiting_job_fits_idle_gpus(tmp_path, gpus_free):
    """cells-ilp skips a round whose jobs and outside GPUs are as its last decision left
    them; the daemon makes it solve anyway while a waiting job fits GPUs that sit idle."""
    from policy.cells_ilp import CellsIlpState, _fingerprint

    job = SlurmJob(41, "alice", "train", "PENDING", partition="a100", comment="elastic model=gpt-760m",
                   reason="JobHeldAdmin", gpus_per_node=4, submit_time_s=int(time.time()) - 60,
                   priority=0)
    a100 = node("a100-1", "a100", 4, used=0 if gpus_free else 4)
    client = FakeSlurm([job], [a100], TRAINER)
    # No forecast: each round's one call of decide is the round's own.
    cfg = resolve({"state_db": str(tmp_path / "state.db"), "forecast_every_s": 0}, {}, {})
    daemon = Daemon(cfg, client, Store(cfg.state_db), out=lambda line: None)
    seen = []
    decide = daemon.policy.decide
    daemon.policy.decide = lambda snapshot: seen.append(snapshot) or decide(snapshot)
    daemon.round()
    (first,) = seen
    # As if the last solve had left exactly this state, a moment ago.
    daemon._policy_state = CellsIlpState(_fingerprint(first, {}), time.time())
    client.calls.clear()
    daemon.round()
    assert (seen[1].policy_state is None) == gpus_free
    started = [c for c in client.calls if c[:2] == ("update", 41) and c[2].num_nodes is not None]
    assert bool(started) == gpus_free  # without the rule the round is skipped: no start
    assert (("release", 41) in client.calls) == gpus_free


def test_runner_progress_is_the_current_runs_and_extrapolated_for_a_bounded_time():
    from slurm_ext.observe import PROGRESS_EXTRAPOLATE_S, RunnerProgress, runner_progress

    job = SlurmJob(41, "alice", "train", "RUNNING", restart_count=2)
    text = measured_json(step=70, step_at_s=1000.0, iteration_time_s=4.0, restart_count=2)
    assert runner_progress(text, job) == RunnerProgress(70, 1000.0, 4.0)
    assert runner_progress(text, replace(job, restart_count=1)) is None
    assert runner_progress(text, replace(job, job_id=42)) is None
    assert runner_progress(measured_json(restart_count=2), job) is None  # no step (an older runner)
    assert runner_progress("{not json", job) is None
    p = RunnerProgress(70, 1000.0, 4.0)
    assert p.steps_at(1000.0) == 70 and p.steps_at(1040.0) == 80 and p.steps_at(990.0) == 70
    assert p.steps_at(1e6) == 70 + PROGRESS_EXTRAPOLATE_S / 4.0


def test_a_job_rescaled_this_round_keeps_its_new_admin_comment(tmp_path):
    from estimator.jobs import JobSpec
    from policy.clock import SimulatedClock
    from policy.interface import Assignment, Decision, JobDecision, JobView, NodeView, Snapshot
    from slurm_ext.act import Actor, Acts
    from slurm_ext.metrics import Metrics
    from slurm_ext.observe import ManagedJob

    cfg = resolve({"state_db": str(tmp_path / "state.db"), "dry_run": True}, {}, {})
    assignment = Assignment(Cell("a100", 4, 4, 1), (("a100-1", 4),))
    managed = {}
    for job_id in ("41", "42"):
        job = SlurmJob(int(job_id), "u", "t", "RUNNING", comment="elastic", admin_comment="cell=a100x4:s1")
        view = JobView(job_id, "u", JobSpec("gpt-760m", 64), 0.0, "running", assignment, 0.0, 10, 0, 0.0)
        managed[job_id] = ManagedJob(job, None, view, running_comment=f"cell=a100x4:s1 plan=[dp2tp2] src=tuned job={job_id}")
    snapshot = Snapshot(100.0, (NodeView("a100-1", "a100", 8, 0),), tuple(m.view for m in managed.values()))
    printed = []
    actor = Actor(FakeSlurm([], [], ""), Store(cfg.state_db), SimulatedClock(), Metrics(None), printed.append,
                  lambda: cfg)
    # The policy suspends job 41 (its AdminComment will say why) and leaves 42 as it runs.
    actor.act(snapshot, Decision((JobDecision("41", None, "preempted"),)), managed,
              lambda: Steering(type_partitions={"a100": "a100"}), "test", Acts())
    assert any(line.startswith("dry-run: suspend job=41") for line in printed)
    assert [line for line in printed if "show running plan" in line] == \
           ["dry-run: show running plan job=42 cell=a100x4:s1 plan=[dp2tp2] src=tuned job=42"]


def test_expert_parallel_reaches_the_estimates_and_their_cache_key(tmp_path):
    """``expert_parallel: true`` offers moe-2.4b at batch 1024 on two 2-GPU a10 nodes a
    Cell whose stage splits the experts over dp (far faster than tp over both nodes, the
    only plan there whose replicated experts fit), runnable, and keys its estimates apart;
    off, no stage is marked and the key is as before."""
    from dataclasses import replace as dc_replace
    from estimator.cluster import cluster_from_dict
    from slurm_ext.jobspec import ElasticSpec
    from slurm_ext.observe import estimate_key
    from slurm_ext.store import estimate_from_json, estimate_to_json
    cluster = cluster_from_dict({"name": "two", "node_groups": [{"gpu_type": "a10", "nodes": 2, "gpus_per_node": 2}]})
    spec = ElasticSpec("moe-2.4b", 1024, 10, num_gpus=4, gpu_type="a10", max_stages=1)
    best = {}
    for ep in (False, True):
        cfg = dc_replace(resolve({"state_db": str(tmp_path / f"state{ep}.db")}, {}, {}), expert_parallel=ep)
        _, est = Daemon(cfg, None, Store(cfg.state_db))._estimate(spec, "root", cluster, 0.0)
        best[ep] = next(e for e in est[cfg.plan_space] if e.feasible and e.cell.num_gpus == 4)
    assert not any(s.ep for s in best[False].stages)
    assert all(s.ep for s in best[True].stages) and best[True].runnable
    assert best[True].iteration_time_s < best[False].iteration_time_s / 3
    assert estimate_from_json(estimate_to_json(best[True])).stages == best[True].stages
    keys = {ep: estimate_key(spec, cluster, "cell", None, 64, None, ep) for ep in (False, True)}
    assert keys[False] != keys[True] and keys[False] == estimate_key(spec, cluster, "cell", None, 64)
    assert resolve({}, {"SLURM_EXT_EXPERT_PARALLEL": "true"}, {}).expert_parallel


def test_a_forecast_end_no_text_can_show_is_not_rewritten_every_forecast(tmp_path, monkeypatch):
    """A forecast end past year 9999 (a billion iterations of a slow model): the
    AdminComment shows no end, and a later forecast with the same start does not count
    that as a change."""
    import dataclasses

    from slurm_ext import daemon as daemon_module

    real = daemon_module.forecast
    monkeypatch.setattr(daemon_module, "forecast", lambda *a, **kw: {
        job_id: dataclasses.replace(f, end_s=1e13) for job_id, f in real(*a, **kw).items()})
    now = int(time.time())
    daemon, client, cfg = _waiting_behind_a_plain_job(tmp_path, now)
    daemon.round()  # its why; the first forecast, which this round's rewrite makes wait
    daemon.forecasts.wait(30)
    daemon.round()
    shown = []
    for _ in range(2):
        daemon._forecast_s -= cfg.forecast_every_s
        daemon.round()
        daemon.forecasts.wait(30)
        shown.append(daemon.round().forecasts_shown)
    assert shown == [(41,), ()]
    pc = parse_plan_comment(client.jobs()[1].admin_comment)
    assert pc.expected_start_s == now + 600 and pc.expected_end_s is None
