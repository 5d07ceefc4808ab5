"""Slurm environment parsing on environments recorded inside real Slurm 22.05 batch jobs.

The samples under fixtures/runner/slurm-22.05/ were recorded in the lab cluster: a job on
two a100 nodes with 4 GPUs each (AdminComment set by an admin), the same job after it
exited 86, was moved to the h100 partition with 4 GPUs and released (restart 1), a
v100 job before and after its requeue, and a job submitted from inside another job's step.
"""

from pathlib import Path

import pytest

from estimator.errors import SpecError
from estimator.contract import plan_tokens
from job_scripts.slurm_env import (admin_comment_from_scontrol, allocation_from_env,
                                   expand_nodelist, gpus_per_node_from_env,
                                   scontrol_show_job_argv)

SAMPLES = Path(__file__).parent / "fixtures" / "runner" / "slurm-22.05"


def _env(name: str) -> dict[str, str]:
    env = {}
    for line in (SAMPLES / f"{name}.env").read_text().splitlines():
        key, _, value = line.partition("=")
        env[key] = value
    return env


def test_two_node_a100_first_run():
    alloc = allocation_from_env(_env("a100-2nodes-first-run"))
    assert alloc.job_id == "1"
    assert alloc.node_names == ("a100-1", "a100-2")
    assert alloc.num_nodes == 2
    assert alloc.gpus_per_node == 4
    assert alloc.num_gpus == 8
    assert alloc.partition == "a100" and alloc.gpu_type == "a100"
    assert alloc.restart_count == 0
    assert not alloc.in_step and alloc.process_id == 0 and alloc.num_processes == 1
    assert alloc.submit_dir == "/srv/lab"


def test_after_rescale_to_h100_restart_count_and_shape():
    alloc = allocation_from_env(_env("h100-after-rescale"))
    assert alloc.node_names == ("h100-1",)
    assert (alloc.gpu_type, alloc.num_gpus, alloc.restart_count) == ("h100", 4, 1)


def test_v100_restarted_keeps_shape():
    first, again = allocation_from_env(_env("v100-first-run")), allocation_from_env(_env("v100-restarted"))
    assert (first.gpu_type, first.num_gpus, first.restart_count) == ("v100", 2, 0)
    assert (again.gpu_type, again.num_gpus, again.restart_count) == ("v100", 2, 1)


def test_gpu_count_fallbacks_in_order():
    assert gpus_per_node_from_env({"SLURM_GPUS_ON_NODE": "3", "SLURM_JOB_GPUS": "0,1"}) == 3
    assert gpus_per_node_from_env({"SLURM_JOB_GPUS": "0,1"}) == 2
    assert gpus_per_node_from_env({"CUDA_VISIBLE_DEVICES": "GPU-a1,GPU-b2,GPU-c3"}) == 3
    assert gpus_per_node_from_env({"SLURM_GPUS_PER_NODE": "a100:4"}) == 4
    assert gpus_per_node_from_env({"SLURM_JOB_GPUS": "NoDevFiles"}) == 0
    assert gpus_per_node_from_env({"CUDA_VISIBLE_DEVICES": "-1"}) == 0  # no GPU, not one
    assert gpus_per_node_from_env({"CUDA_VISIBLE_DEVICES": "0,1,-1,2"}) == 2
    assert gpus_per_node_from_env({}) == 0


@pytest.mark.parametrize("raw, gpus", [("volta:3,kepler:1", 4), ("a100:2,a100", 3), ("2", 2),
                                        ("gpu:a100:4", 4), ("h100", 1)])
def test_gpus_per_node_sums_every_type_and_a_bare_type_is_one(raw, gpus):
    # Slurm's --gpus-per-node takes a comma-separated list of [type:]count; a count left
    # out is 1, as in --gres.
    assert gpus_per_node_from_env({"SLURM_GPUS_PER_NODE": raw}) == gpus


@pytest.mark.parametrize("raw", ["volta:3,", "a100:x y", "4,?"])
def test_gpus_per_node_malformed_is_quoted(raw):
    with pytest.raises(SpecError, match="SLURM_GPUS_PER_NODE"):
        gpus_per_node_from_env({"SLURM_GPUS_PER_NODE": raw})


def test_outside_slurm_is_one_node_without_job():
    alloc = allocation_from_env({"CUDA_VISIBLE_DEVICES": "0"})
    assert alloc.job_id is None and alloc.num_nodes == 1 and alloc.gpus_per_node == 1


def test_inside_an_srun_step_reads_rank():
    env = {**_env("a100-2nodes-first-run"), "SLURM_STEP_ID": "0", "SLURM_PROCID": "1",
           "SLURM_NTASKS": "2"}
    alloc = allocation_from_env(env)
    assert alloc.in_step and alloc.process_id == 1 and alloc.num_processes == 2


@pytest.mark.parametrize("text, names", [
    ("a100-[1-2]", ("a100-1", "a100-2")),
    ("a100-[1-2,4],h100-1", ("a100-1", "a100-2", "a100-4", "h100-1")),
    ("n[08-10]", ("n08", "n09", "n10")),
    ("r[1-2]-g[1-2]", ("r1-g1", "r1-g2", "r2-g1", "r2-g2")),
    ("node7", ("node7",)),
])
def test_expand_nodelist(text, names):
    assert expand_nodelist(text) == names


@pytest.mark.parametrize("bad", ["a100-[1-2", "a100-1]", "a[2-1]", "a[x-y]", "a[1-99999999]"])
def test_expand_nodelist_rejects_malformed(bad):
    with pytest.raises(SpecError) as e:
        expand_nodelist(bad)
    assert bad in str(e.value)


def test_malformed_variables_are_quoted():
    with pytest.raises(SpecError, match="SLURM_RESTART_COUNT='x'"):
        allocation_from_env({"SLURM_JOB_ID": "5", "SLURM_RESTART_COUNT": "x"})
    with pytest.raises(SpecError, match="SLURM_NNODES"):
        allocation_from_env({"SLURM_JOB_NODELIST": "a-[1-2]", "SLURM_NNODES": "3"})


def test_admin_comment_from_recorded_scontrol():
    text = (SAMPLES / "a100-2nodes-first-run.scontrol").read_text()
    comment = admin_comment_from_scontrol(text)
    assert comment == "cell=a100x8:s2 plan=[dp2tp2|dp4tp1] mb=8 remat=1 why=best throughput"
    # The daemon's explanation is not part of the plan string.
    assert plan_tokens(comment) == "cell=a100x8:s2 plan=[dp2tp2|dp4tp1] mb=8 remat=1"
    after = admin_comment_from_scontrol((SAMPLES / "h100-after-rescale.scontrol").read_text())
    assert plan_tokens(after) == "cell=h100x4:s1 plan=[dp4tp1] mb=2 remat=0"
    assert admin_comment_from_scontrol((SAMPLES / "v100-first-run.scontrol").read_text()) is None
    assert plan_tokens("bad spec: model=x unknown") is None


def test_scontrol_argv_refuses_non_numeric_ids():
    assert scontrol_show_job_argv("17") == ["scontrol", "show", "job", "17"]
    with pytest.raises(SpecError):
        scontrol_show_job_argv("17; rm -rf /")


def test_comment_from_scontrol_and_its_elastic_settings():
    from estimator.contract import comment_settings

    from job_scripts.slurm_env import comment_from_scontrol

    recorded = (SAMPLES / "a100-2nodes-first-run.scontrol").read_text()
    assert comment_from_scontrol(recorded) is None
    # Constructed from the recorded record: Slurm prints Comment= on its own line after
    # AdminComment= when a job has one.
    text = recorded.replace("   StdErr=", "   Comment=elastic model=gpt-1.3b global_batch=64 \n   StdErr=")
    assert comment_from_scontrol(text) == "elastic model=gpt-1.3b global_batch=64"
    assert admin_comment_from_scontrol(text).startswith("cell=a100x8:s2")
    assert comment_settings(comment_from_scontrol(text)) == {"model": "gpt-1.3b", "global_batch": "64"}
    # A line break in the Comment: the runner had read its first line only, the daemon the
    # whole; both now refuse it. Slurm's own lines are broken at \n only.
    broken = recorded.replace("   StdErr=", "   Comment=elastic model=gpt-1.3b\nglobal_batch=64 iterations=5\n"
                                         "   StdErr=")
    assert comment_from_scontrol(broken) == "elastic model=gpt-1.3b\nglobal_batch=64 iterations=5"
    tab = recorded.replace("   StdErr=", "   Comment=elastic model=gpt-1.3b\x0biterations=5\n   StdErr=")
    assert comment_from_scontrol(tab) == "elastic model=gpt-1.3b\x0biterations=5"
    for comment in (comment_from_scontrol(broken), comment_from_scontrol(tab)):
        with pytest.raises(SpecError, match="on one line"):
            comment_settings(comment)
    # At its ends a line break changes nothing, for the daemon (the whole) and the runner alike.
    ends = "\nelastic model=gpt-1.3b global_batch=8\r\n"
    trailing = recorded.replace("   StdErr=", f"   Comment={ends}   StdErr=")
    assert comment_settings(ends) == comment_settings(comment_from_scontrol(trailing)) == {
        "model": "gpt-1.3b", "global_batch": "8"}


def test_a_batch_job_submitted_from_inside_a_step_is_its_batch_step():
    """Recorded: a job on two a100 nodes submitted by ``srun sbatch`` from a step of a job
    on a10-1. Its batch script carries that step's variables; the slurmstepd it runs under
    (``slurmstepd: [4.batch]``) says it is the batch step, which must start the tasks."""
    env = _env("submitted-from-a-step")
    assert allocation_from_env(env).in_step  # the variables alone cannot tell
    alloc = allocation_from_env(env, stepd="4.batch")
    assert (alloc.in_step, alloc.process_id, alloc.num_processes, alloc.launch_host) == (False, 0, 1, None)
    assert alloc.num_nodes == 2 and alloc.gpus_per_node == 2
    task = allocation_from_env(env, stepd="4.0")  # a task of the job's step 0
    assert task.in_step and task.launch_host == "127.0.0.1"
    assert allocation_from_env(env, stepd="4.0+1").in_step  # a component of a heterogeneous step
    assert not allocation_from_env(env, stepd="4.extern").in_step


def test_outside_slurm_no_step_encloses_this_process():
    from job_scripts.runtime import enclosing_step
    assert enclosing_step() is None  # pytest runs under no slurmstepd
