"""The daemon killed at random moments while elastic jobs arrive, rescale and leave.

After 20 ``kill -9``s, each at a random moment of a round, a rescale or a recovery, one
daemon runs on to the end: every elastic job still there must run on the Cell its
AdminComment names (partition and GPU count). None is lost, held or left waiting, and
the journal has nothing open.
"""

import os
import random
import subprocess
import sys
import time

import pytest

from conftest import wait_for
from estimator.contract import parse_plan_comment
from slurm_ext.slurm_client import SubmitRequest
from slurm_ext.store import Store

# Checkpoints in 2 s on USR1 and asks to be requeued held, as the runner does.
TRAINER = """#!/bin/bash
#ELASTIC global_batch=64 iterations=100000000
trap 'sleep 2; exit 86' USR1
while true; do sleep 0.2 & wait $!; done
"""
# Room for all of them at the GPU counts they ask (the lab has 28 GPUs); the policy may
# give each more while GPUs are free, and take them back as others arrive.
REQUESTS = ("gpus=2", "gpus=4", "gpus=2", "gpus=4", "gpus=2", "gpus=2", "gpus=4")
KILLS = 20


def _daemon(env, tmp_path, log):
    argv = [sys.executable, "-m", "slurm_ext", "daemon", "--interval-s", "2",
            "--state-db", str(tmp_path / "state.db")]
    return subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=log)


def _settled(client, store, alive):
    """The jobs when each runs on the Cell its AdminComment names and no action is under
    way; else None."""
    if store.open_entries():
        return None
    jobs = {j.job_id: j for j in client.jobs()}
    got = [jobs.get(i) for i in sorted(alive)]
    for job in got:
        if job is None or not job.is_running or job.is_held:
            return None
        parts = parse_plan_comment(job.admin_comment).cell_parts()
        if parts is None or (job.partition, job.granted_gpus) != (parts[0], parts[1]):
            return None
    return got


@pytest.mark.slurm
@pytest.mark.scenario
def test_every_job_ends_on_its_cell_after_twenty_daemon_kills(slurm_lab, slurm_client, tmp_path):
    rng = random.Random(0)
    chaos_env = {**os.environ, **slurm_lab.env(), "SLURM_EXT_POLL_S": "0.5",
                 "SLURM_EXT_RESCALE_TIMEOUT_S": "20",
                 "SLURM_EXT_POLICY_OPTIONS": "{min_change_interval_s: 0}"}
    submitted, cancelled = [], set()

    def submit(spec):
        submitted.append(slurm_client.submit(SubmitRequest(
            script=TRAINER, comment=f"elastic model=gpt-760m {spec}", output="/dev/null",
            workdir=str(tmp_path))))

    for spec in REQUESTS[:3]:
        submit(spec)
    with open(tmp_path / "daemon.err", "w") as log:
        for kill in range(KILLS):
            proc = _daemon(chaos_env, tmp_path, log)
            time.sleep(rng.uniform(0.5, 4.0))  # anywhere: start-up, recovery, a round, a rescale
            proc.kill()
            proc.wait(timeout=10)
            if len(submitted) < len(REQUESTS) and rng.random() < 0.5:
                submit(REQUESTS[len(submitted)])  # a job arrives
            if kill in (7, 14):  # a running job leaves
                running = [j.job_id for j in slurm_client.jobs() if j.is_running and j.job_id in submitted
                           and j.job_id not in cancelled]
                if running:
                    victim = rng.choice(running)
                    slurm_client.cancel(victim)
                    cancelled.add(victim)
        for spec in REQUESTS[len(submitted):]:
            submit(spec)
        # The last daemon runs on, with the default minimum time between two changes of a job.
        calm_env = {k: v for k, v in chaos_env.items() if k != "SLURM_EXT_POLICY_OPTIONS"}
        proc = _daemon(calm_env, tmp_path, log)
        store = Store(tmp_path / "state.db")
        alive = set(submitted) - cancelled
        try:
            def settled_and_still():
                first = _settled(slurm_client, store, alive)
                if first is None:
                    return None
                time.sleep(6)  # three more rounds: nothing may move
                again = _settled(slurm_client, store, alive)
                same = again is not None and [(j.job_id, j.restart_count) for j in again] == \
                    [(j.job_id, j.restart_count) for j in first]
                return again if same else None
            jobs = wait_for("every job to run on the Cell its AdminComment names", settled_and_still, 240)
        finally:
            proc.terminate()
            proc.wait(timeout=30)
    assert len(jobs) == len(alive) == len(REQUESTS) - len(cancelled)  # none lost
    assert not any(j.is_held for j in slurm_client.jobs() if j.is_active)
    text = (tmp_path / "daemon.err").read_text()
    assert "event=recover" in text and "event=rescale_signalled" in text  # restarts mid-action, rescales
