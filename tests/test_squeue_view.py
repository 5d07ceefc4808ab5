"""The squeue view: AdminComment round trip, rows, table and JSON."""

import json
from dataclasses import replace

from estimator.cells import StagePlan
from estimator.plan_string import parse_plan
from slurm_ext.slurm_client import SlurmJob
from estimator.contract import PlanComment, format_plan_comment, parse_plan_comment
from slurm_ext.squeue_view import cell_of, format_table, job_row, plan_label, rows, to_json

FULL = PlanComment(requested="a100", cell="a100x8:s2", plan="[dp2tp2|dp4tp1]",
                   micro_batches=16, remat=True, layers="0,13,26", samples_per_s=412.5,
                   why="fastest feasible, 8 a100 free")


def test_plan_label():
    stages = (StagePlan(0, 12, 2, 2), StagePlan(12, 24, 4, 1))
    assert plan_label(stages) == "[dp2tp2|dp4tp1]"


def test_admin_comment_round_trip():
    text = format_plan_comment(FULL)
    assert text == ("requested=a100 cell=a100x8:s2 plan=[dp2tp2|dp4tp1] mb=16 remat=1 "
                    "layers=0,13,26 sps=412.5 why=fastest feasible, 8 a100 free")
    assert parse_plan_comment(text) == FULL
    assert FULL.cell_parts() == ("a100", 8, 2)


def test_admin_comment_carries_the_plan_string_the_runner_reads():
    words = format_plan_comment(FULL).split()
    plan_words = " ".join(w for w in words if w.partition("=")[0] in ("cell", "plan", "mb", "remat", "layers"))
    plan = parse_plan(plan_words)
    assert (plan.gpu_type, plan.num_gpus, plan.num_stages) == ("a100", 8, 2)
    assert plan.stages == ((2, 2), (4, 1)) and plan.micro_batches == 16 and plan.remat
    assert plan.layer_bounds == (0, 13, 26)


def test_why_is_one_ascii_line_and_error_wins():
    pc = PlanComment(why="scaled 4→2 a100\nfor job 17 ünd", error=None)
    text = format_plan_comment(pc)
    assert text == "why=scaled 4->2 a100 for job 17 ?nd"
    err = format_plan_comment(PlanComment(requested="any", why="x", error="model='q': unknown"))
    assert err == "requested=any error=model='q': unknown"
    assert parse_plan_comment(err).error == "model='q': unknown"


def test_parse_tolerates_foreign_text():
    assert parse_plan_comment("requested=any") == PlanComment(requested="any")
    assert parse_plan_comment("set by admin") == PlanComment()
    assert parse_plan_comment("mb=x sps=fast cell=weird") == PlanComment(cell="weird")
    assert parse_plan_comment(None) == PlanComment()
    assert PlanComment(cell="weird").cell_parts() is None


def test_cell_of_uses_layout():
    cell = cell_of(FULL, gpus_per_node=4)
    assert (cell.gpu_type, cell.num_gpus, cell.num_stages, cell.num_nodes) == ("a100", 8, 2, 2)


def running_elastic():
    return SlurmJob(12, "alice", "train", "RUNNING", reason="None", partition="a100",
                    comment="elastic model=gpt-1.3b", admin_comment=format_plan_comment(FULL),
                    gpus_per_node=4, granted_gpus_per_node=(4, 4), granted_gpu_type="a100",
                    nodes=("a100-1", "a100-2"), node_count=2)


def test_rows_for_each_kind_of_job():
    pending_plain = SlurmJob(13, "bob", "plain", "PENDING", reason="Resources", partition="v100",
                             gpus_per_node=2, gpu_type_requested="v100", node_count=1)
    held = SlurmJob(14, "carol", "t", "PENDING", reason="JobHeldUser", priority=0,
                    comment="elastic", admin_comment="requested=any", gpus_per_node=1, node_count=1)
    bad = SlurmJob(15, "dave", "t", "RUNNING", comment="elastic model=nope",
                   admin_comment="requested=any error=model='nope': unknown model",
                   granted_gpus_per_node=(2,), granted_gpu_type="a10", node_count=1)
    waiting = SlurmJob(16, "erin", "t", "PENDING", reason="Priority", priority=1, comment="elastic",
                       admin_comment="why=waiting for 8 a100", gpus_per_node=4, node_count=2)
    done = SlurmJob(11, "x", "t", "COMPLETED")
    planned = SlurmJob(17, "fay", "t", "PENDING", reason="JobHeldUser", priority=0, comment="elastic",
                       admin_comment="why=waiting: not chosen this round", gpus_per_node=4, node_count=1)
    table = rows([bad, held, running_elastic(), pending_plain, waiting, done, planned])
    assert [r.job_id for r in table] == [12, 13, 14, 15, 16, 17]
    r12, r13, r14, r15, r16, r17 = table
    assert r17.why == "waiting: not chosen this round"  # held by the daemon, which says why
    assert (r12.gpus, r12.gpu_type, r12.nodes, r12.elastic) == (8, "a100", 2, True)
    assert (r12.cell, r12.plan, r12.samples_per_s, r12.micro_batches) == ("a100x8:s2", "[dp2tp2|dp4tp1]", 412.5, 16)
    assert (r13.gpus, r13.gpu_type, r13.elastic, r13.why, r13.cell) == (2, "v100", False, "Resources", None)
    assert r14.why == "waiting for the slurm-ext daemon" and r14.requested == "any"
    assert r15.spec_error == "model='nope': unknown model" and "runs as submitted" in r15.why
    assert r16.why == "waiting for 8 a100 (slurm: Priority)" and r16.gpus == 8
    assert len(rows([done], include_finished=True)) == 1
    # A running job with no GPU grant recorded (CPU only, or GPUs per task) has started all the same.
    cpu = SlurmJob(18, "gus", "prep", "RUNNING", partition="cpu", node_count=1, start_time_s=1_800_000_000)
    (r18,) = rows([cpu])
    assert r18.expected_start == "2027-01-15T08:00:00Z"


def test_requeued_and_finished_jobs_say_why_and_when():
    held = SlurmJob(20, "u", "t", "SPECIAL_EXIT", reason="JobHeldUser", priority=0, comment="elastic",
                    admin_comment="requested=any", gpus_per_node=4, node_count=1)
    requeued = SlurmJob(21, "u", "t", "REQUEUED", reason="BeginTime", priority=1, comment="elastic",
                        admin_comment="cell=a100x4:s1 plan=[dp4tp1] why=chosen by crius", gpus_per_node=4, node_count=1)
    forecast = ("cell=a100x4:s1 plan=[dp4tp1] start=2026-01-01T00:00:00Z end=2026-01-02T00:00:00Z "
                "progress=0.420 via=a100x4:s1,a40x8:s2 why=chosen")
    done = SlurmJob(22, "u", "t", "COMPLETED", comment="elastic", admin_comment=forecast,
                    start_time_s=1_767_300_000, end_time_s=1_767_310_000)
    r20, r21, r22 = rows([held, requeued, done], include_finished=True)
    assert r20.why == "waiting for the slurm-ext daemon"
    assert r21.why == "chosen by crius (slurm: BeginTime)"
    assert (r22.expected_start, r22.expected_end) == ("2026-01-01T20:40:00Z", "2026-01-01T23:26:40Z")
    assert (r22.progress_frac, r22.expected_cells) == (None, ())  # the last forecast's, not what happened
    assert rows([replace(done, state="RUNNING")])[0].progress_frac == 0.42
    # Cancelled while it waited: Slurm sets its start and end to the cancel time; it never ran.
    cancelled = rows([replace(done, state="CANCELLED", start_time_s=1_767_310_000)], include_finished=True)[0]
    assert (cancelled.expected_start, cancelled.expected_end) == (None, "2026-01-01T23:26:40Z")
    assert "SPECIAL_EXIT " in format_table([r20])  # the state column holds Slurm's longest
    # A malformed speed (an admin's edit) is none: JSON has no NaN.
    nan = SlurmJob(23, "u", "t", "PENDING", comment="elastic", admin_comment="cell=a100x4:s1 sps=nan why=x")
    assert rows([nan])[0].samples_per_s is None


def test_table_and_json():
    table = rows([running_elastic()])
    text = format_table(table)
    header, line = text.splitlines()
    assert header.split() == ["JOBID", "USER", "STATE", "PARTITION", "GPUS", "ELASTIC", "CELL",
                              "PLAN", "SAMPLES/S", "START", "END", "WHY"]
    assert line.split()[:11] == ["12", "alice", "RUNNING", "a100", "8xa100", "yes", "a100x8:s2",
                                 "[dp2tp2|dp4tp1]", "412.5", "-", "-"]
    assert line.endswith("fastest feasible, 8 a100 free")
    doc = json.loads(json.dumps(to_json(table)))
    assert set(doc) == {"jobs"}
    assert set(doc["jobs"][0]) == {"job_id", "user", "state", "partition", "gpus", "gpu_type",
                                   "nodes", "elastic", "cell", "plan", "micro_batches",
                                   "samples_per_s", "requested", "why", "spec_error",
                                   "plan_source", "measured_samples_per_s", "expected_start",
                                   "expected_end", "progress_frac", "expected_cells"}
    assert doc["jobs"][0]["job_id"] == 12 and doc["jobs"][0]["elastic"] is True
    assert doc["jobs"][0]["plan_source"] == "daemon" and doc["jobs"][0]["measured_samples_per_s"] is None


# A plan the runner tuned in the allocation, written back by the daemon with its measured speed.
TUNED = PlanComment(requested="a100", cell="a100x8:s2", plan="[dp4tp1|dp4tp1]", micro_batches=8,
                    remat=False, layers="0,13,26", samples_per_s=431.0, why="fastest feasible",
                    plan_source="tuned", sps_measured=True)


def test_plan_source_and_measured_speed_round_trip():
    text = format_plan_comment(TUNED)
    assert text == ("requested=a100 cell=a100x8:s2 plan=[dp4tp1|dp4tp1] mb=8 remat=0 layers=0,13,26 "
                    "src=tuned sps=431 measured=1 why=fastest feasible")
    assert parse_plan_comment(text) == TUNED
    for source in ("cached", "given"):
        pc = PlanComment(cell="a10x2:s1", plan="[dp2tp1]", plan_source=source)
        assert parse_plan_comment(format_plan_comment(pc)) == pc
    # The daemon's own plan has neither token: the AdminComments written so far read as before.
    assert "src=" not in format_plan_comment(FULL) and "measured=" not in format_plan_comment(FULL)
    assert parse_plan_comment(format_plan_comment(FULL)).plan_source is None
    # The runner still reads exactly the plan string out of it.
    words = [w for w in text.split() if w.partition("=")[0] in ("cell", "plan", "mb", "remat", "layers")]
    assert parse_plan(" ".join(words)).stages == ((4, 1), (4, 1))


def test_unknown_plan_source_and_measured_without_speed_are_ignored():
    assert parse_plan_comment("cell=a10x2:s1 src=magic measured=1") == PlanComment(cell="a10x2:s1")
    assert format_plan_comment(PlanComment(cell="a10x2:s1", plan_source="magic", sps_measured=True)) == "cell=a10x2:s1"
    assert parse_plan_comment("sps=3 measured=yes").sps_measured is False
    assert parse_plan_comment("sps=fast measured=1") == PlanComment()


def test_view_shows_the_tuned_plan_and_its_measured_speed():
    job = SlurmJob(12, "alice", "train", "RUNNING", partition="a100", comment="elastic model=gpt-1.3b",
                   admin_comment=format_plan_comment(TUNED), granted_gpus_per_node=(4, 4),
                   granted_gpu_type="a100", nodes=("a100-1", "a100-2"), node_count=2)
    row = job_row(job)
    assert (row.plan, row.micro_batches, row.plan_source) == ("[dp4tp1|dp4tp1]", 8, "tuned")
    assert row.samples_per_s == row.measured_samples_per_s == 431.0
    assert row.why == "fastest feasible"  # the JSON "why" is the daemon's reason, unchanged
    line = format_table([row]).splitlines()[1]
    assert line.split()[7:9] == ["[dp4tp1|dp4tp1]", "431"]
    assert line.endswith("fastest feasible [plan tuned in this allocation; samples/s measured]")
    doc = to_json([row])["jobs"][0]
    assert (doc["plan_source"], doc["measured_samples_per_s"], doc["samples_per_s"]) == ("tuned", 431.0, 431.0)
    # Tuned, but measured on CPU fake devices (not trusted): sps stays the estimate.
    cpu = job_row(SlurmJob(13, "bob", "t", "RUNNING", comment="elastic", admin_comment=format_plan_comment(
        PlanComment(cell="a10x2:s1", plan="[dp2tp1]", samples_per_s=9.5, why="x", plan_source="cached"))))
    assert (cpu.plan_source, cpu.samples_per_s, cpu.measured_samples_per_s) == ("cached", 9.5, None)
    assert format_table([cpu]).endswith("x [plan tuned in an earlier run on this Cell]")
    # No plan at all: no source either.
    waiting = job_row(SlurmJob(14, "c", "t", "PENDING", comment="elastic", admin_comment="why=waiting"))
    assert waiting.plan_source is None and waiting.measured_samples_per_s is None


def test_forecast_tokens_show_as_start_end_and_progress():
    # 2026-11-25T12:00:00Z and two hours later.
    waiting = SlurmJob(20, "erin", "t", "PENDING", reason="JobHeldAdmin", priority=0, comment="elastic",
                       admin_comment=format_plan_comment(PlanComment(
                           requested="any", why="waiting for GPUs", expected_start_s=1795608000.0,
                           expected_end_s=1795615200.0, progress_frac=0.0, expected_cells=("a10x4:s1", "a100x8:s2"))),
                       gpus_per_node=4, node_count=1)
    assert "start=2026-11-25T12:00:00Z end=2026-11-25T14:00:00Z via=a10x4:s1,a100x8:s2 why=waiting for GPUs" \
        in waiting.admin_comment
    running = replace(running_elastic(), start_time_s=1795600000, admin_comment=format_plan_comment(
        replace(FULL, expected_end_s=1795615200.0, progress_frac=0.25)))
    by_id = {r.job_id: r for r in rows([waiting, running])}
    assert (by_id[20].expected_start, by_id[20].expected_end, by_id[20].progress_frac) == \
           ("2026-11-25T12:00:00Z", "2026-11-25T14:00:00Z", 0.0)
    assert by_id[20].to_json()["expected_cells"] == ("a10x4:s1", "a100x8:s2")
    # A running job's start is Slurm's own; its end and progress are the daemon's.
    assert (by_id[12].expected_start, by_id[12].expected_end, by_id[12].progress_frac) == \
           ("2026-11-25T09:46:40Z", "2026-11-25T14:00:00Z", 0.25)
    lines = format_table(rows([waiting])).splitlines()
    assert lines[1].split()[9:11] == ["11-25T12:00", "11-25T14:00"]
    assert parse_plan_comment("start=yesterday end=2026-13-01T00:00:00Z progress=2") == PlanComment()


def test_the_commands_take_the_configured_slurm_timeout(monkeypatch):
    from click.testing import CliRunner

    import slurm_ext.backend as backend
    from slurm_ext.commands.squeue import command

    given = []

    class Client:
        def jobs(self):
            return ()

    def make_client(kind, prefix, timeout_s, **_):
        given.append(timeout_s)
        return Client()
    monkeypatch.setattr(backend, "make_client", make_client)
    monkeypatch.delenv("SLURM_EXT_CONFIG", raising=False)
    for env, args, expected in (({"SLURM_EXT_SLURM_TIMEOUT_S": "120"}, [], 120.0),
                                ({"SLURM_EXT_SLURM_TIMEOUT_S": "120"}, ["--timeout-s", "5"], 5.0), ({}, [], 30.0)):
        result = CliRunner().invoke(command, ["--json", *args], env=env)
        assert result.exit_code == 0, result.output
        assert given.pop() == expected
