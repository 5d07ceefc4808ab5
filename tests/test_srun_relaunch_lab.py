"""The runner's one-task-per-node ``srun`` on a real Slurm, after the daemon changed the job.

A job submitted with ``--gpus-per-node`` or ``--gpus`` carries that request in its batch
environment (``SLURM_GPUS_PER_NODE``, ``SLURM_GPUS``: sbatch writes them at submission),
and ``srun`` reads those variables as options. After the daemon moved the job to another
GPU type or count, the batch process's ``srun`` must still get every GPU of each node.
"""

import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.slurm

# The batch process relaunches a command that prints what each task was given.
_RELAUNCH = (
    "import os, sys\n"
    "from job_scripts import runtime\n"
    "from job_scripts.slurm_env import allocation_from_env\n"
    "alloc = allocation_from_env(os.environ)\n"
    "runtime._relaunch_under_srun(alloc, ['bash', '-c', "
    "'echo task=$SLURM_NODEID gpus=$SLURM_GPUS_ON_NODE devices=$CUDA_VISIBLE_DEVICES'], {}, None)\n"
)


@pytest.mark.parametrize("request_option", ["--gpus-per-node=a10:1", "--gpus=2", "--gres=gpu:a10:1"])
def test_srun_gets_every_gpu_of_the_new_layout(slurm_client, tmp_path, request_option):
    from slurm_ext.lab import poll
    from slurm_ext.slurm_client import JobUpdate, SubmitRequest

    log_path = tmp_path / "job.out"
    script = f"#!/bin/bash\nexec {sys.executable} - <<'EOF'\n{_RELAUNCH}EOF\n"
    job = slurm_client.submit(SubmitRequest(
        script=script, name="relaunch", nodes=2, output=str(log_path), workdir=str(ROOT),
        comment="elastic model=gpt-760m global_batch=8 iterations=1",
        extra_args=(request_option, f"--export=ALL,PYTHONPATH={ROOT}")))
    # As the daemon moves a job to another type on Slurm 22.05: partition, count per node
    # (and no count per job left beside it, `start_update`).
    gpus_per_job = slurm_client.job(job).gpus_per_job
    assert gpus_per_job == (2 if request_option == "--gpus=2" else 0)
    slurm_client.update_pending(job, JobUpdate(partition="a100", gpus_per_node=4, num_nodes=2,
                                               clear_gpus_per_job=gpus_per_job > 0))
    slurm_client.release(job)
    done = poll(lambda: (j := slurm_client.job(job)) and not j.is_active and j, 120)
    text = log_path.read_text() if log_path.exists() else ""
    tasks = re.findall(r"task=(\d) gpus=(\d+) devices=(\S*)", text)
    assert sorted(t[0] for t in tasks) == ["0", "1"], (done, text)
    assert all(gpus == "4" and len(devices.split(",")) == 4 for _, gpus, devices in tasks), text
