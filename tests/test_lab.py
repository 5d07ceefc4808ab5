"""The lab cluster: its generated config (pure), and integration tests on a real Slurm
(the lab itself, job_submit.lua, the CLI client).

Tests marked ``slurm`` use the session lab of tests/conftest.py and skip without Slurm or root.
"""

import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from estimator.cluster import load_cluster
from conftest import wait_for
from slurm_ext.errors import LabError, SlurmCommandError
from estimator.cluster import cluster_from_dict
from slurm_ext.lab import (
    MIXED_PARTITION, LabCluster, LabPaths, find_free_base_port, ports_needed, render_gres_conf, render_slurm_conf,
)
from slurm_ext.run import run_command, start_background
from slurm_ext.slurm_client import JobUpdate, SlurmJob, SubmitRequest

SLEEPER = "#!/bin/bash\nsleep 300\n"
# Checkpoints on USR1 and asks to be requeued held (RequeueExitHold=86). The background
# sleep + wait lets bash run the trap at once.
TRAINER = """#!/bin/bash
trap 'echo checkpoint; exit 86' USR1
echo "start restart=${SLURM_RESTART_COUNT:-0} partition=$SLURM_JOB_PARTITION"
while true; do sleep 0.2 & wait $!; done
"""


def job_where(client, job_id: int, cond: Callable[[SlurmJob], bool]) -> Callable[[], SlurmJob | None]:
    def probe():
        job = client.job(job_id)
        return job if job is not None and cond(job) else None
    return probe


def request(tmp_path: Path, **kw) -> SubmitRequest:
    kw.setdefault("script", SLEEPER)
    return SubmitRequest(output=str(tmp_path / "%j.out"), workdir=str(tmp_path), **kw)


@pytest.mark.slurm
def test_nodes_idle_per_type_with_their_gpus(slurm_client):
    cluster = load_cluster("lab")
    nodes = wait_for("every lab node idle", lambda: (
        ns := {n.name: n for n in slurm_client.nodes()}) and all(
            n.state == "idle" for n in ns.values()) and ns)
    expected = {name: g for g in cluster.node_groups for name in g.node_names()}
    assert set(nodes) == set(expected)
    for name, group in expected.items():
        node = nodes[name]
        assert node.partitions == (group.partition, MIXED_PARTITION)
        assert node.features == (group.gpu_type,)
        assert node.gpu_type == group.gpu_type
        assert node.gpus == group.gpus_per_node
        assert node.gpus_used == 0
        assert node.is_usable


@pytest.mark.slurm
def test_typed_elastic_submission_is_normalized_and_held(slurm_client, tmp_path):
    job_id = slurm_client.submit(request(
        tmp_path, name="elastic-typed", gres="gpu:a100:4", nodes=2, requeue=False,
        comment="elastic model=gpt-1.3b global_batch=64"))
    job = slurm_client.job(job_id)
    assert job.is_elastic and job.is_pending and job.is_held
    assert job.reason == "JobHeldUser" and job.priority == 0
    assert job.partition == "a100"
    assert job.gpus_per_node == 4 and job.gpu_type_requested is None
    assert job.node_count == 2
    assert job.requeue, "job_submit.lua must force requeue on (the user asked --no-requeue)"
    assert job.admin_comment == "requested=a100"
    time.sleep(1.5)
    assert slurm_client.job(job_id).is_pending, "a held elastic job must not start by itself"


@pytest.mark.slurm
def test_typed_gpus_per_job_of_an_elastic_job_become_untyped_too(slurm_client, tmp_path):
    job_id = slurm_client.submit(request(tmp_path, name="elastic-gpus", comment="elastic",
                                         extra_args=("--gpus=h100:6",)))
    job = slurm_client.job(job_id)
    assert (job.partition, job.gpus_per_job, job.gpus_per_node) == ("h100", 6, 0)
    assert job.admin_comment == "requested=h100" and job.is_held


@pytest.mark.slurm
def test_a_typed_request_without_a_count_becomes_one_untyped_gpu(slurm_client, tmp_path):
    job_id = slurm_client.submit(request(tmp_path, name="elastic-one", gres="gpu:a100", comment="elastic"))
    job = slurm_client.job(job_id)
    assert (job.partition, job.gpus_per_node, job.gpu_type_requested) == ("a100", 1, None)
    assert job.admin_comment == "requested=a100" and job.is_held


@pytest.mark.slurm
def test_a_comment_that_only_starts_with_the_word_is_not_elastic(slurm_client, tmp_path):
    job_id = slurm_client.submit(request(tmp_path, name="search", partition="v100", gres="gpu:v100:1",
                                         comment="elasticsearch reindex"))
    job = slurm_client.job(job_id)
    assert not job.is_elastic and not job.is_held and job.admin_comment == ""
    assert job.gpu_type_requested == "v100" and job.gpus_per_node == 1


@pytest.mark.slurm
def test_plain_job_is_untouched(slurm_client, tmp_path):
    job_id = slurm_client.submit(request(tmp_path, name="plain", partition="v100",
                                         gres="gpu:v100:2"))
    job = slurm_client.job(job_id)
    assert not job.is_elastic and not job.is_held and job.priority > 0
    assert job.gpu_type_requested == "v100" and job.gpus_per_node == 2
    assert job.admin_comment == ""
    running = wait_for("the plain job to run", job_where(slurm_client, job_id, lambda j: j.is_running))
    assert running.granted_gpu_type == "v100" and running.granted_gpus_per_node == (2,)


@pytest.mark.slurm
def test_typed_elastic_submission_to_a_mixed_partition_stays_there_untyped(slurm_client, tmp_path):
    job_id = slurm_client.submit(request(tmp_path, name="mixed", partition=MIXED_PARTITION,
                                         gres="gpu:v100:2", comment="elastic"))
    job = slurm_client.job(job_id)
    assert job.partition == MIXED_PARTITION and job.is_held
    assert job.gpu_type_requested is None and job.gpus_per_node == 2  # the daemon picks the type
    assert job.admin_comment == "requested=v100"


@pytest.mark.slurm
def test_owner_cannot_release_a_held_elastic_job(slurm_lab, slurm_client):
    as_nobody = ["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups"]
    out = run_command([*as_nobody, "sbatch", "--parsable", "--chdir=/tmp", "--output=/dev/null",
                       "--comment=elastic", "--partition=a10", "--gres=gpu:1"],
                      timeout_s=20, input_text=SLEEPER, env=slurm_lab.env())
    job_id = int(out.stdout.strip())
    assert slurm_client.job(job_id).user == "nobody"
    for argv in (["scontrol", "release", str(job_id)], ["scontrol", "hold", str(job_id)],
                 ["scontrol", "update", f"JobId={job_id}", "Priority=100"],
                 # a plain job's comment, and the release after it, would leave the daemon out
                 ["scontrol", "update", f"JobId={job_id}", "Comment=plain"],
                 # exit 86 would end a job Slurm may not requeue, not requeue it held
                 ["scontrol", "update", f"JobId={job_id}", "Requeue=0"]):
        with pytest.raises(SlurmCommandError, match="(?i)permission denied"):  # not "Unspecified error"
            run_command([*as_nobody, *argv], timeout_s=20, env=slurm_lab.env())
    assert slurm_client.job(job_id).is_held
    slurm_client.release(job_id)  # root (the daemon) may
    assert not slurm_client.job(job_id).is_held
    wait_for("the released job to run", job_where(slurm_client, job_id, lambda j: j.is_running))
    for change in ("Requeue=0", "Comment=plain"):  # running, the daemon may rescale it
        with pytest.raises(SlurmCommandError, match="(?i)permission denied"):
            run_command([*as_nobody, "scontrol", "update", f"JobId={job_id}", change],
                        timeout_s=20, env=slurm_lab.env())
    assert slurm_client.job(job_id).requeue and slurm_client.job(job_id).is_elastic
    slurm_client.cancel(job_id)


@pytest.mark.slurm
@pytest.mark.parametrize("gpus", ["--gpus-per-task=a100:1", "--gpus-per-socket=1"])
def test_gpus_per_task_or_socket_of_an_elastic_job_are_refused_with_the_reason(slurm_lab, gpus):
    with pytest.raises(SlurmCommandError) as refused:
        run_command(["sbatch", "--parsable", "--chdir=/tmp", "--output=/dev/null", "--comment=elastic",
                     "--ntasks=1", "--sockets-per-node=1", gpus], timeout_s=20, input_text=SLEEPER,
                    env=slurm_lab.env())
    assert "not --gpus-per-task or --gpus-per-socket" in refused.value.stderr
    plain = run_command(["sbatch", "--parsable", "--chdir=/tmp", "--output=/dev/null", "--hold",
                         "--ntasks=1", "--cpus-per-task=1", "--comment=elastic", "--gpus-per-node=1"],
                        timeout_s=20, input_text=SLEEPER, env=slurm_lab.env())
    assert int(plain.stdout.strip()) > 0  # CPUs per task alone are no GPUs per task


@pytest.mark.slurm
def test_a_heterogeneous_or_plain_job_cannot_become_elastic(slurm_lab, slurm_client):
    """Each component of a heterogeneous job is a job of its own to Slurm's listings: the
    daemon would size and requeue them apart. Refused at submission, and by comment."""
    as_nobody = ["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups"]
    sbatch = [*as_nobody, "sbatch", "--parsable", "--chdir=/tmp", "--output=/dev/null"]
    components = ["--partition=a10", "--gres=gpu:1", ":", "--partition=a10", "--gres=gpu:1"]
    with pytest.raises(SlurmCommandError) as refused:
        run_command([*sbatch, "--comment=elastic", *components], timeout_s=20, input_text=SLEEPER,
                     env=slurm_lab.env())
    assert "a heterogeneous job cannot be elastic" in refused.value.stderr  # the user is told why
    out = run_command([*sbatch, "--hold", *components], timeout_s=20, input_text=SLEEPER, env=slurm_lab.env())
    leader = int(out.stdout.strip().split("+")[0].split(";")[0])
    ids = {leader, leader + 1}
    assert {j.job_id for j in slurm_client.jobs() if j.job_id in ids} == ids  # a plain one is accepted
    plain = int(run_command([*sbatch, "--hold", "--partition=a10", "--gres=gpu:1"], timeout_s=20,
                            input_text=SLEEPER, env=slurm_lab.env()).stdout.strip())
    # Nor may a plain job become elastic later: the hook never normalized or held it.
    for job_id in (*sorted(ids), plain):
        with pytest.raises(SlurmCommandError, match="(?i)permission denied"):
            run_command([*as_nobody, "scontrol", "update", f"JobId={job_id}", "Comment=elastic"],
                        timeout_s=20, env=slurm_lab.env())
        assert not slurm_client.job(job_id).is_elastic
    slurm_client.cancel(leader)


@pytest.mark.slurm
def test_update_and_release_lands_on_the_chosen_partition_count_and_nodes(slurm_client, tmp_path):
    job_id = slurm_client.submit(request(tmp_path, name="steer", gres="gpu:a100:4", nodes=1,
                                         comment="elastic"))
    plan = "cell=v100x6 nodes=2 stages=2 plan=[0-12:dp3tp1,12-24:dp3tp1]"
    slurm_client.update_pending(job_id, JobUpdate(partition="v100", gpus_per_node=3,
                                                  num_nodes=2, admin_comment=plan))
    job = slurm_client.job(job_id)
    assert (job.partition, job.gpus_per_node, job.node_count) == ("v100", 3, 2)
    assert job.admin_comment == plan and job.is_held
    slurm_client.release(job_id)
    job = wait_for("the steered job to run", job_where(slurm_client, job_id, lambda j: j.is_running))
    assert job.nodes == ("v100-1", "v100-2")
    assert job.granted_gpu_type == "v100" and job.granted_gpus_per_node == (3, 3)


@pytest.mark.slurm
def test_hold_release_and_cancel_a_pending_job(slurm_client, tmp_path):
    job_id = slurm_client.submit(request(tmp_path, name="later", partition="a10",
                                         extra_args=("--begin=now+1hour",)))
    assert not slurm_client.job(job_id).is_held
    slurm_client.hold(job_id)
    job = slurm_client.job(job_id)
    assert job.is_held and job.reason == "JobHeldAdmin"
    slurm_client.release(job_id)
    assert not slurm_client.job(job_id).is_held
    slurm_client.cancel(job_id)
    assert slurm_client.job(job_id).state == "CANCELLED"


@pytest.mark.slurm
def test_usr1_to_a_trainer_that_exits_86_requeues_it_held_and_it_restarts_rescaled(
        slurm_client, tmp_path):
    job_id = slurm_client.submit(request(tmp_path, name="trainer", script=TRAINER,
                                         partition="a10", gres="gpu:1", comment="elastic",
                                         extra_args=("--open-mode=append",)))
    slurm_client.update_pending(job_id, JobUpdate(partition="a10", gpus_per_node=2, num_nodes=1))
    slurm_client.release(job_id)
    job = wait_for("the trainer to run", job_where(slurm_client, job_id, lambda j: j.is_running))
    assert job.granted_gpu_type == "a10" and job.granted_gpus_per_node == (2,)
    assert slurm_client.batch_script(job_id) == TRAINER
    wait_for("the trainer's USR1 trap (it prints its start after setting it)", lambda: (
        p := tmp_path / f"{job_id}.out").exists() and "start restart=0" in p.read_text())
    slurm_client.signal_batch(job_id, "USR1")
    job = wait_for("the trainer to be requeued held",
                   job_where(slurm_client, job_id, lambda j: j.is_held and j.restart_count == 1))
    assert job.exit_code == 86 and job.state == "SPECIAL_EXIT"
    slurm_client.update_pending(job_id, JobUpdate(partition="h100", gpus_per_node=6, num_nodes=1,
                                                  admin_comment="cell=h100x6"))
    slurm_client.release(job_id)
    job = wait_for("the rescaled trainer to run",
                   job_where(slurm_client, job_id, lambda j: j.is_running))
    assert job.granted_gpu_type == "h100" and job.granted_gpus_per_node == (6,)
    assert job.restart_count == 1
    log_text = wait_for("the second start in the job's output", lambda: (
        t := (tmp_path / f"{job_id}.out").read_text()) and "restart=1" in t and t)
    assert "start restart=0 partition=a10" in log_text
    assert "checkpoint" in log_text
    assert "start restart=1 partition=h100" in log_text


@pytest.mark.slurm
def test_requeue_hold_stops_a_job_that_ignores_the_signal(slurm_client, tmp_path):
    job_id = slurm_client.submit(request(tmp_path, name="deaf", partition="a100",
                                         gres="gpu:1", requeue=True))
    wait_for("the job to run", job_where(slurm_client, job_id, lambda j: j.is_running))
    slurm_client.requeue_hold(job_id)
    job = wait_for("the job to be requeued held",
                   job_where(slurm_client, job_id, lambda j: j.is_held and j.restart_count == 1))
    assert not job.nodes or job.state != "RUNNING"


@pytest.mark.slurm
def test_second_lab_refuses_to_start_twice_and_down_stops_exactly_its_pids(slurm_lab, tmp_path):
    cluster = load_cluster("lab")
    ours = tuple(range(slurm_lab.base_port, slurm_lab.base_port + 40))
    other = LabCluster(tmp_path / "lab2", base_port=find_free_base_port(
        cluster, range(19400, 20000, 40), exclude=ours), install=slurm_lab.install)
    bystander = start_background(["sleep", "60"])
    try:
        other.up()
        with pytest.raises(LabError, match="already up"):
            other.up()
        with pytest.raises(LabError, match="already in use"):
            LabCluster(tmp_path / "lab3", base_port=other.base_port, install=slurm_lab.install).up()
        daemons = other.daemons()
        assert set(daemons) == {"munged", "slurmctld"} | {
            f"slurmd {n}" for g in cluster.node_groups for n in g.node_names()}
        assert all(alive for _, alive in daemons.values())
        env = other.env()
        held = int(run_command(["sbatch", "--parsable", "--partition=a10", f"--chdir={tmp_path}",
                                "--output=/dev/null", "--comment=elastic"], timeout_s=20,
                               input_text=SLEEPER, env=env).stdout)
        other.stop_slurmctld()
        with pytest.raises(SlurmCommandError):
            run_command(["scontrol", "ping"], timeout_s=10, env=env)
        other.start_slurmctld()
        state = run_command(["squeue", "-h", "-j", str(held), "-O", "State,Reason,admin_comment"],
                            timeout_s=10, env=env).stdout.split()
        assert state == ["PENDING", "JobHeldUser", "requested=any"]  # recovered after the restart
        run_command(["sbatch", "--parsable", "--partition=a10", f"--chdir={tmp_path}",
                     "--output=/dev/null"], timeout_s=20, input_text=SLEEPER, env=env)
        daemons = other.daemons()
        other.down()
        assert not other.is_up()
        assert not any((other.paths.root / d).exists() for d in ("state", "spool", "run", "dev", "tmp"))
        for name, (pid, _) in daemons.items():
            assert not Path(f"/proc/{pid}").exists() or \
                Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] == "Z", name
        assert os.kill(bystander, 0) is None  # still running
        assert slurm_lab.is_up()
        assert run_command(["scontrol", "ping"], timeout_s=10, env=slurm_lab.env())
    finally:
        other.down()
        os.kill(bystander, signal.SIGTERM)


@pytest.mark.slurm
def test_lab_command_status_and_refusal_to_start_twice(slurm_lab):
    from click.testing import CliRunner

    from slurm_ext.commands.lab import command
    args = ["--dir", str(slurm_lab.paths.root), "--base-port", str(slurm_lab.base_port)]
    status = CliRunner().invoke(command, ["status", *args])
    assert status.exit_code == 0
    assert "slurmctld" in status.output and "stopped" not in status.output
    for g in load_cluster("lab").node_groups:
        assert f"{g.partition}-1 " in status.output and f"gpu:{g.gpu_type}:{g.gpus_per_node}" in status.output
    again = CliRunner().invoke(command, ["up", *args])
    assert again.exit_code == 1 and "already up" in again.output


def _folders_like_a_lab(root: Path) -> list[Path]:
    kept = [root / d / "keep.txt" for d in ("state", "spool", "run", "dev", "munge", "tmp")]
    for f in kept:
        f.parent.mkdir(parents=True)
        f.write_text("not the lab's")
    return kept


def test_lab_down_in_a_directory_that_holds_no_lab_removes_nothing(tmp_path):
    kept = _folders_like_a_lab(tmp_path)
    lab = LabCluster(tmp_path)
    assert not lab.holds_a_lab()
    lab.down()
    assert all(f.read_text() == "not the lab's" for f in kept)


@pytest.mark.slurm
def test_lab_up_refuses_a_directory_whose_folders_are_not_a_labs(slurm_lab, tmp_path):
    kept = _folders_like_a_lab(tmp_path)
    with pytest.raises(LabError, match="but no lab"):
        LabCluster(tmp_path, base_port=slurm_lab.base_port + 500, install=slurm_lab.install).up()
    assert all(f.read_text() == "not the lab's" for f in kept)


def test_a_cluster_too_big_for_one_machine_is_refused(tmp_path):
    with pytest.raises(LabError, match="at most"):
        LabCluster(tmp_path, load_cluster("crius-1280")).up()


# ---- generated config (no Slurm needed) ---------------------------------------------------

def _settings(conf: str) -> dict[str, str]:
    return dict(line.split("=", 1) for line in conf.splitlines()
                if "=" in line and not line.startswith(("#", "NodeName", "PartitionName")))


def test_slurm_conf_follows_the_cluster_spec(tmp_path):
    cluster = load_cluster("lab")
    paths = LabPaths(tmp_path)
    conf = render_slurm_conf(cluster, paths, 20000, "myhost")
    nodes = [line for line in conf.splitlines() if line.startswith("NodeName=")]
    parts = [line for line in conf.splitlines() if line.startswith("PartitionName=")]
    assert len(nodes) == len(parts) - 1 == len(cluster.node_groups)
    # The last one holds every node: a partition of mixed GPU types.
    assert parts[-1].startswith(f"PartitionName={MIXED_PARTITION} Nodes=") and " Default=NO " in parts[-1]
    port = 20001
    for g, node_line, part_line in zip(cluster.node_groups, nodes, parts):
        names = f"{g.partition}-[1-{g.nodes}]" if g.nodes > 1 else f"{g.partition}-1"
        ports = f"[{port}-{port + g.nodes - 1}]" if g.nodes > 1 else str(port)
        assert node_line.startswith(f"NodeName={names} ")
        assert f" Port={ports} " in node_line
        assert f" Gres=gpu:{g.gpu_type}:{g.gpus_per_node} " in node_line
        assert f" Features={g.gpu_type} " in node_line
        assert part_line.startswith(f"PartitionName={g.partition} Nodes={names} ")
        port += g.nodes
    s = _settings(conf)
    assert s["SlurmctldPort"] == "20000" and s["SlurmctldHost"] == "myhost"
    assert s["RequeueExitHold"] == "86" and "RequeueExit" not in s  # nothing exits 85
    assert s["JobSubmitPlugins"] == "lua" and s["SlurmdParameters"] == "config_overrides"
    assert int(s["MaxJobCount"]) >= 10000 and int(s["KillWait"]) <= 10
    assert s["AuthInfo"] == f"socket={paths.munge_socket}"
    for key in ("StateSaveLocation", "SlurmdSpoolDir", "SlurmctldPidFile", "SlurmdPidFile",
                "SlurmctldLogFile", "SlurmdLogFile"):
        assert s[key].startswith(str(tmp_path)), key


def test_gres_conf_backs_every_gpu_with_a_device_file(tmp_path):
    cluster = cluster_from_dict({"name": "two", "node_groups": [
        {"gpu_type": "a40", "nodes": 3, "gpus_per_node": 2},
        {"gpu_type": "h200", "nodes": 1, "gpus_per_node": 1, "partition": "big"}]})
    gres = render_gres_conf(cluster, LabPaths(tmp_path)).splitlines()
    assert gres[0] == "AutoDetect=off"
    assert gres[1] == f"NodeName=a40-[1-3] Name=gpu Type=a40 File={tmp_path}/dev/nvidia[0-1]"
    assert gres[2] == f"NodeName=big-1 Name=gpu Type=h200 File={tmp_path}/dev/nvidia0"
    assert len(ports_needed(cluster, 100)) == 1 + 4
