"""Slurm command builders (pure) and the one place that runs programs."""

import os
import signal
import time

import pytest

from slurm_ext.cli_backend import (
    LISTING_ENV, CliSlurmClient, batch_script_argv, cancel_argv, hold_argv, job_detail_argv,
    job_listing_argv, release_argv, requeue_hold_argv, sbatch_argv, signal_batch_argv,
    sinfo_json_argv, squeue_json_argv, update_pending_argv,
)
from slurm_ext.errors import (
    CommandNotFoundError, CommandTimeoutError, SlurmArgumentError, SlurmCommandError,
)
from slurm_ext.run import reap, run_command, run_commands, start_background
from slurm_ext.slurm_client import JobUpdate, SlurmClient, SubmitRequest


# ---- builders -----------------------------------------------------------------------------

def test_readers_ask_for_json():
    assert squeue_json_argv()[0] == "squeue" and "--json" in squeue_json_argv()
    assert sinfo_json_argv()[0] == "sinfo" and "--json" in sinfo_json_argv()


def test_listing_is_untruncated_and_pipe_separated():
    argv = job_listing_argv(("JobID", "State", "Comment"))
    assert argv[:4] == ["squeue", "--all", "--states=all", "--noheader"]
    assert argv[-2:] == ["--Format", "JobID:|,State:|,Comment:|"]
    assert job_listing_argv(("JobID",), [12, 3])[4:6] == ["--jobs", "12,3"]
    assert LISTING_ENV == {"SLURM_TIME_FORMAT": "%s"}
    assert job_detail_argv(7) == ["scontrol", "-d", "-o", "show", "job", "7"]
    assert job_detail_argv() == ["scontrol", "-d", "-o", "show", "job"]


def test_batched_commands_name_every_job():
    update = JobUpdate(partition="a10", gpus_per_node=2, num_nodes=1, admin_comment="why=x")
    assert update_pending_argv([4, 5, 6], update)[2] == "JobId=4,5,6"
    assert hold_argv([4, 5]) == ["scontrol", "hold", "4,5"]
    assert release_argv((4, 5)) == ["scontrol", "release", "4,5"]
    with pytest.raises(SlurmArgumentError, match="job_ids"):
        release_argv([])
    with pytest.raises(SlurmArgumentError, match="job_id"):
        hold_argv([4, -1])


def test_full_pending_update():
    argv = update_pending_argv(42, JobUpdate(partition="v100", gpus_per_node=3, num_nodes=2,
                                             admin_comment="cell=v100x6 plan=[dp3,dp3]"))
    assert argv == ["scontrol", "update", "JobId=42", "Partition=v100", "Gres=gpu:3",
                    "NumNodes=2-2", "AdminComment=cell=v100x6 plan=[dp3,dp3]", "StartTime=now"]


def test_a_count_per_job_is_cleared_beside_the_count_per_node():
    argv = update_pending_argv(42, JobUpdate(partition="a100", gpus_per_node=4, clear_gpus_per_job=True))
    assert argv == ["scontrol", "update", "JobId=42", "Partition=a100", "Gres=gpu:4", "TresPerJob=",
                    "StartTime=now"]
    assert "TresPerJob=" not in update_pending_argv(42, JobUpdate(gpus_per_node=4))
    with pytest.raises(SlurmArgumentError, match="clear_gpus_per_job"):
        update_pending_argv(42, JobUpdate(partition="a100", clear_gpus_per_job=True))


def test_the_placement_is_the_required_node_list():
    argv = update_pending_argv(42, JobUpdate(partition="a100", gpus_per_node=4, num_nodes=2,
                                             required_nodes=("a100-2", "a100-1")))
    assert "ReqNodeList=a100-2,a100-1" in argv and argv[-1] == "StartTime=now"
    for bad in ("a100-1", (), ("a100-1", "x;rm")):
        with pytest.raises(SlurmArgumentError, match="required_nodes"):
            update_pending_argv(42, JobUpdate(required_nodes=bad))


def test_the_hold_reservation_commands():
    from slurm_ext.cli_backend import (
        reservation_create_argv, reservation_delete_argv, reservation_show_argv, reservation_update_argv,
    )
    create = reservation_create_argv("slurm-ext-hold", ("h100-1", "a100-2"))
    assert create[:4] == ["scontrol", "create", "reservation", "ReservationName=slurm-ext-hold"]
    assert {"StartTime=now", "Users=root", "Nodes=h100-1,a100-2", "Flags=IGNORE_JOBS"} <= set(create)
    assert reservation_update_argv("r", ["n1"]) == ["scontrol", "update", "ReservationName=r", "Nodes=n1"]
    assert reservation_delete_argv("r") == ["scontrol", "delete", "ReservationName=r"]
    assert reservation_show_argv("r") == ["scontrol", "-o", "show", "reservation", "r"]
    with pytest.raises(SlurmArgumentError, match="required_nodes"):
        reservation_create_argv("r", ())
    with pytest.raises(SlurmArgumentError, match="reservation"):
        reservation_delete_argv("r x")


def test_partial_update_and_no_start_time():
    assert update_pending_argv(7, JobUpdate(num_nodes=1, start_now=False)) == \
        ["scontrol", "update", "JobId=7", "NumNodes=1-1"]
    assert update_pending_argv(7, JobUpdate(admin_comment="")) == \
        ["scontrol", "update", "JobId=7", "AdminComment=", "StartTime=now"]


@pytest.mark.parametrize("update, field", [
    (JobUpdate(), "update"),
    (JobUpdate(gpus_per_node=0), "gpus_per_node"),
    (JobUpdate(gpus_per_node=True), "gpus_per_node"),
    (JobUpdate(gpus_per_node="3"), "gpus_per_node"),
    (JobUpdate(num_nodes=-1), "num_nodes"),
    (JobUpdate(partition="a100 Priority=1"), "partition"),
    (JobUpdate(partition=""), "partition"),
    (JobUpdate(admin_comment="x" * 5001), "admin_comment"),
    (JobUpdate(admin_comment="two\nlines"), "admin_comment"),
])
def test_bad_updates_are_refused_naming_the_field(update, field):
    with pytest.raises(SlurmArgumentError) as info:
        update_pending_argv(1, update)
    assert info.value.field == field and field in str(info.value)


@pytest.mark.parametrize("job_id", [0, -3, "12", 1.0, True, None])
def test_job_ids_must_be_positive_integers(job_id):
    for build in (hold_argv, release_argv, requeue_hold_argv, batch_script_argv, cancel_argv):
        with pytest.raises(SlurmArgumentError, match="job_id"):
            build(job_id)


def test_action_commands():
    assert hold_argv(5) == ["scontrol", "hold", "5"]
    assert release_argv(5) == ["scontrol", "release", "5"]
    assert requeue_hold_argv(5) == ["scontrol", "requeuehold", "5"]
    assert batch_script_argv(5) == ["scontrol", "write", "batch_script", "5", "-"]
    assert cancel_argv(5) == ["scancel", "5"]


def test_one_scancel_signals_several_batch_scripts():
    assert signal_batch_argv([3, 4], "USR1") == ["scancel", "--signal=USR1", "--batch", "3", "4"]
    with pytest.raises(SlurmArgumentError, match="job_ids"):
        signal_batch_argv([], "USR1")


@pytest.mark.parametrize("sig", ["USR1", "SIGUSR1", "usr1"])
def test_signal_goes_to_the_batch_step_only(sig):
    assert signal_batch_argv(9, sig) == ["scancel", "--signal=USR1", "--batch", "9"]


@pytest.mark.parametrize("sig", ["USR1; reboot", "", "-9", 10])
def test_bad_signals_are_refused(sig):
    with pytest.raises(SlurmArgumentError, match="signal"):
        signal_batch_argv(9, sig)


def test_sbatch_with_every_option():
    argv = sbatch_argv(SubmitRequest(
        script="#!/bin/bash\ntrue\n", name="t1", partition="a10", nodes=2, gres="gpu:a10:2",
        comment="elastic model=gpt-1.3b", hold=True, requeue=False, time_limit_min=30,
        output="/tmp/o-%j", workdir="/tmp", extra_args=("--open-mode=append",)))
    assert argv == ["sbatch", "--parsable", "--job-name=t1", "--partition=a10", "--nodes=2",
                    "--gres=gpu:a10:2", "--comment=elastic model=gpt-1.3b", "--hold",
                    "--no-requeue", "--time=30", "--output=/tmp/o-%j", "--chdir=/tmp",
                    "--open-mode=append"]
    assert sbatch_argv(SubmitRequest(script="#!/bin/sh\n")) == \
        ["sbatch", "--parsable", "--job-name=slurm-ext"]


@pytest.mark.parametrize("request_, field", [
    (SubmitRequest(script="sleep 1"), "script"),
    (SubmitRequest(script="#!/bin/sh\n", gres="gpu a100"), "gres"),
    (SubmitRequest(script="#!/bin/sh\n", name="a b"), "name"),
    (SubmitRequest(script="#!/bin/sh\n", nodes=0), "nodes"),
    (SubmitRequest(script="#!/bin/sh\n", extra_args=(3,)), "extra_args"),
])
def test_bad_submissions_are_refused(request_, field):
    with pytest.raises(SlurmArgumentError) as info:
        sbatch_argv(request_)
    assert info.value.field == field


def test_cli_client_implements_the_protocol():
    assert isinstance(CliSlurmClient(), SlurmClient)


# ---- run_command --------------------------------------------------------------------------

def test_a_string_command_is_a_type_error():
    with pytest.raises(TypeError, match="not a string"):
        run_command("squeue --json", timeout_s=5)
    with pytest.raises(TypeError):
        run_command(["echo", 3], timeout_s=5)
    with pytest.raises(TypeError):
        start_background("sleep 1")


def test_output_input_and_environment():
    out = run_command(["cat"], timeout_s=5, input_text="hello\n")
    assert out.stdout == "hello\n" and out.returncode == 0
    env = run_command(["env"], timeout_s=5, env={"SLURM_CONF": "/x/slurm.conf"}).stdout
    assert "SLURM_CONF=/x/slurm.conf" in env.splitlines()
    assert "PATH=" in env  # the rest of the environment is kept


def test_output_that_is_not_utf8_is_read_with_a_stand_in():
    """A job comment or script in Latin-1 (or any byte Slurm stored as given) must not make
    the whole listing unreadable."""
    latin1 = ["printf", "Autor: M\\374ller|a\\377b\\n"]
    assert run_command(latin1, timeout_s=5).stdout == "Autor: M\ufffdller|a\ufffdb\n"
    (out,) = run_commands([latin1], timeout_s=5)
    assert out.stdout == "Autor: M\ufffdller|a\ufffdb\n"


def test_failure_carries_argv_status_and_stderr():
    argv = ["sh", "-c", "echo 'scontrol: error: Invalid job id specified' >&2; exit 3"]
    with pytest.raises(SlurmCommandError) as info:
        run_command(argv, timeout_s=5)
    e = info.value
    assert e.argv == tuple(argv) and e.returncode == 3
    assert "Invalid job id specified" in e.stderr and "Invalid job id specified" in str(e)
    assert run_command(argv, timeout_s=5, check=False).returncode == 3


def test_commands_run_together_each_checked():
    started = time.monotonic()
    a, b = run_commands([["sh", "-c", "sleep 0.5; echo a"], ["sh", "-c", "sleep 0.5; echo $X"]],
                        timeout_s=10, env={"X": "b"})
    assert (a.stdout, b.stdout) == ("a\n", "b\n")
    assert time.monotonic() - started < 0.95  # together, not one after the other
    with pytest.raises(SlurmCommandError) as info:
        run_commands([["true"], ["sh", "-c", "echo nope >&2; exit 4"]], timeout_s=10)
    assert info.value.returncode == 4 and "nope" in str(info.value)
    with pytest.raises(CommandTimeoutError):
        run_commands([["sleep", "5"], ["true"]], timeout_s=0.3)
    with pytest.raises(CommandNotFoundError):
        run_commands([["true"], ["/nonexistent/prog"]], timeout_s=5)


def test_timeout_and_missing_program_are_typed():
    start = time.monotonic()
    with pytest.raises(CommandTimeoutError, match="0.2 s"):
        run_command(["sleep", "5"], timeout_s=0.2)
    assert time.monotonic() - start < 3
    with pytest.raises(CommandNotFoundError, match="no-such-program"):
        run_command(["no-such-program-xyz"], timeout_s=5)


def test_a_program_that_cannot_be_run_is_typed_too(tmp_path):
    """A prefix naming a file that is not executable: a Slurm error the daemon backs off
    from, not an OSError that fails the round."""
    script = tmp_path / "squeue"
    script.write_text("#!/bin/sh\n")
    script.chmod(0o644)
    with pytest.raises(CommandNotFoundError, match=r"cannot be run \(Permission denied\)"):
        run_command([str(script)], timeout_s=5)
    with pytest.raises(CommandNotFoundError, match="cannot be run"):
        run_commands([["true"], [str(script)]], timeout_s=5)


def test_background_process_runs_until_stopped_by_pid(tmp_path):
    log_path = tmp_path / "out.log"
    pid = start_background(["sh", "-c", "echo started; exec sleep 30"], log_path=log_path)
    try:
        deadline = time.monotonic() + 5
        while "started" not in log_path.read_text() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert "started" in log_path.read_text()
        assert os.getsid(pid) == pid  # its own session: a Ctrl-C on us does not reach it
    finally:
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        reap(pid)
        if not os.path.exists(f"/proc/{pid}"):
            break
        time.sleep(0.05)
    assert not os.path.exists(f"/proc/{pid}")


@pytest.mark.slurm
def test_batched_update_hold_release_on_the_lab(slurm_lab, slurm_client, tmp_path):
    script = "#!/bin/bash\nsleep 300\n"

    def submit(**kw):
        return slurm_client.submit(SubmitRequest(script=script, partition="a10", gres="gpu:1",
                                                 output=str(tmp_path / "%j.out"), workdir=str(tmp_path), **kw))

    # Held, and not eligible for an hour: released, they stay pending.
    ids = [submit(hold=True, extra_args=("--begin=now+3600",)) for _ in range(3)]
    slurm_client.update_pending(ids, JobUpdate(admin_comment="why=batched", start_now=False))
    jobs = {j.job_id: j for j in slurm_client.jobs()}
    assert [jobs[i].admin_comment for i in ids] == ["why=batched"] * 3
    # scontrol changes a node count one job at a time only (22.05: "Invalid job ID a,b")...
    with pytest.raises(SlurmCommandError, match="Invalid job ID"):
        run_command(update_pending_argv(ids, JobUpdate(num_nodes=1)), timeout_s=30, env=slurm_lab.env())
    # ...so the client does it job by job.
    slurm_client.update_pending(ids, JobUpdate(num_nodes=1, admin_comment="why=n"))
    jobs = {j.job_id: j for j in slurm_client.jobs()}
    assert [jobs[i].admin_comment for i in ids] == ["why=n"] * 3
    slurm_client.release(ids)
    assert not any(j.is_held for j in slurm_client.jobs() if j.job_id in ids)
    slurm_client.hold(ids[:2])

    def held() -> list[bool]:
        jobs = {j.job_id: j for j in slurm_client.jobs()}
        return [jobs[i].is_held for i in ids]
    # scontrol returns once slurmctld took the hold; a listing right after showed none of
    # it once in many runs, so the listing is given a few seconds, and a failure says what
    # slurmctld holds.
    deadline = time.monotonic() + 5
    while (got := held()) != [True, True, False] and time.monotonic() < deadline:
        time.sleep(0.2)
    shown = "".join(run_command(["scontrol", "show", "job", str(i)], timeout_s=30, env=slurm_lab.env(),
                                check=False).stdout for i in ids) if got != [True, True, False] else ""
    assert got == [True, True, False], shown
    # One job Slurm refuses (gone) fails the call: the caller then goes job by job.
    slurm_client.cancel(ids[0])
    with pytest.raises(SlurmCommandError):
        slurm_client.update_pending([ids[0], ids[2]], JobUpdate(admin_comment="why=again", start_now=False))
    # A running GPU job's grant per node, from the detail of that job alone.
    runs = submit()
    deadline = time.monotonic() + 20
    while not (job := slurm_client.job(runs)).is_running and time.monotonic() < deadline:
        time.sleep(0.3)
    assert job.granted_gpus_per_node == (1,) and job.granted_gpu_type == "a10"
    assert slurm_client.job(10**8) is None
    # The cheap listing the arrival poll uses.
    assert slurm_client.pending_elastic_job_ids() == []  # none of them says "elastic"
    elastic = submit(hold=True, comment="elastic model=gpt-760m")
    assert slurm_client.pending_elastic_job_ids() == [elastic]


@pytest.mark.slurm
def test_grants_of_many_new_running_jobs_come_from_one_listing_of_all(slurm_lab, slurm_client, tmp_path):
    from slurm_ext.cli_backend import DETAIL_ONE_BY_ONE_MAX
    wanted = {"h100": 8, "a10": 2}
    assert sum(wanted.values()) > DETAIL_ONE_BY_ONE_MAX
    ids = {slurm_client.submit(SubmitRequest(script="#!/bin/bash\nsleep 300\n", partition=p, gres="gpu:1",
                                             output=str(tmp_path / "%j.out"), workdir=str(tmp_path))): p
           for p, n in wanted.items() for _ in range(n)}
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        jobs = {j.job_id: j for j in CliSlurmClient(env=slurm_lab.env()).jobs() if j.job_id in ids}
        if all(j.is_running for j in jobs.values()) and len(jobs) == len(ids):
            break
        time.sleep(0.5)
    assert {i: (j.granted_gpus_per_node, j.granted_gpu_type) for i, j in jobs.items()} == \
        {i: ((1,), p) for i, p in ids.items()}
    # The session's backend (pyslurm too) reads the same grants.
    assert {j.job_id: (j.granted_gpus_per_node, j.granted_gpu_type) for j in slurm_client.jobs()
            if j.job_id in ids} == {i: ((1,), p) for i, p in ids.items()}


def test_a_failed_command_is_one_readable_line_with_a_hint_when_slurm_is_unreachable():
    argv = ["squeue", "--noheader", "--Format", ",".join(f"Field{i}:|" for i in range(60))]
    e = SlurmCommandError(argv, 1, "squeue: fatal: Could not establish a configuration source\n")
    text = str(e)
    assert len(text) < 320 and text.startswith("'squeue --noheader --Format Field0:|") and " … " in text
    assert "Field59:|' exited 1: squeue: fatal: Could not establish a configuration source" in text
    assert text.endswith("is slurmctld up and SLURM_CONF its slurm.conf (check `scontrol ping`)?")
    other = str(SlurmCommandError(["scontrol", "hold", "7"], 1, "Invalid job id specified"))
    assert other == "'scontrol hold 7' exited 1: Invalid job id specified"


def test_only_the_run_module_starts_programs():
    """Every program the daemon runs goes through ``slurm_ext/run.py`` (time limit, typed
    errors, the configured environment merged in)."""
    import ast
    from pathlib import Path
    package = Path(__file__).resolve().parent.parent / "slurm_ext"
    importers = []
    for path in sorted(package.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module] if isinstance(node, ast.ImportFrom) else [])
            if "subprocess" in names:
                importers.append(path.relative_to(package).as_posix())
    assert importers == ["run.py"]
