"""Forecasts on the lab: plain jobs with 2- and 3-minute time limits fill every node, and
the daemon forecasts when a waiting elastic job will start. `slurm-ext squeue --json`
shows it; the job then starts within 90 s of it."""

import json
import os
import subprocess
import sys

import pytest

from conftest import wait_for
from estimator.contract import parse_utc
from slurm_ext.slurm_client import SubmitRequest

PLAIN = "#!/bin/bash\nsleep 900\n"
TRAINER = """#!/bin/bash
#ELASTIC global_batch=64 iterations=5000
trap 'exit 86' USR1
while true; do sleep 0.2 & wait $!; done
"""
# (partition, GPUs per node, nodes, time limit in minutes): every GPU of the lab.
FILL = (("a10", 2, 2, 2), ("a100", 4, 2, 3), ("v100", 4, 2, 3), ("h100", 8, 1, 3))


def _squeue_json(env) -> dict:
    out = subprocess.run([sys.executable, "-m", "slurm_ext", "squeue", "--json"], env=env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return {row["job_id"]: row for row in json.loads(out.stdout)["jobs"]}


@pytest.mark.slurm
@pytest.mark.scenario
def test_a_waiting_job_starts_within_90_s_of_its_forecast(slurm_lab, slurm_client, tmp_path):
    plain = [slurm_client.submit(SubmitRequest(script=PLAIN, name="plain", partition=p, gres=f"gpu:{g}",
                                               output="/dev/null", workdir=str(tmp_path),
                                               extra_args=(f"--time={minutes}",)))
             for p, g, n, minutes in FILL for _ in range(n)]
    wait_for("the plain jobs to fill every node",
             lambda: all((j := slurm_client.job(i)) and j.is_running for i in plain), 30)
    job = slurm_client.submit(SubmitRequest(script=TRAINER, comment="elastic model=gpt-760m gpus=4",
                                            output="/dev/null", workdir=str(tmp_path)))
    env = {**os.environ, **slurm_lab.env(), "SLURM_EXT_POLL_S": "0.5", "SLURM_EXT_FORECAST_EVERY_S": "3"}
    argv = [sys.executable, "-m", "slurm_ext", "daemon", "--interval-s", "2", "--state-db", str(tmp_path / "state.db")]
    with open(tmp_path / "daemon.err", "w") as log:
        proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=log)
    try:
        row = wait_for("a forecast in squeue", lambda: (r := _squeue_json(env).get(job)) and r["expected_start"] and r,
                       60)
        assert row["state"] == "PENDING" and row["expected_end"] is not None
        expected_s = parse_utc(row["expected_start"])
        # `slurm-ext explain` says why it waits, what to do, its Cells and its forecast.
        out = subprocess.run([sys.executable, "-m", "slurm_ext", "explain", str(job), "--json",
                              "--state-db", str(tmp_path / "state.db")], env=env, capture_output=True,
                             text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        doc = json.loads(out.stdout)
        assert doc["waiting"]["category"] == "waiting for GPUs" and "expected start" in doc["waiting"]["detail"]
        assert doc["waiting"]["what_to_do"] and doc["forecast"]["expected_start"] == row["expected_start"]
        assert any(c["feasible"] for c in doc["cells"]) and doc["spec"]["global_batch"] == 64
        assert doc["chosen"] is None and doc["restarts"] == 0
        text = subprocess.run([sys.executable, "-m", "slurm_ext", "explain", str(job)], env=env,
                              capture_output=True, text=True, timeout=120).stdout
        assert "what you can do:" in text and "Cells (fastest first" in text
        ends = sorted(slurm_client.job(i).end_time_s for i in plain)
        assert ends[0] - 5 <= expected_s <= ends[-1] + 5  # when some of the plain jobs' GPUs come free
        started = wait_for("the elastic job to start",
                           lambda: (j := slurm_client.job(job)) and j.is_running and j, 300)
        assert abs(started.start_time_s - expected_s) <= 90, (started.start_time_s, expected_s)
        # Running now: its Cell, why, and the history the daemon's journal holds.
        doc = json.loads(subprocess.run([sys.executable, "-m", "slurm_ext", "explain", str(job), "--json",
                                         "--state-db", str(tmp_path / "state.db")], env=env,
                                        capture_output=True, text=True, timeout=120).stdout)
        assert doc["waiting"] is None and doc["chosen"]["cell"] == f"{started.partition}x{started.granted_gpus}:s" \
            + doc["chosen"]["cell"].rpartition(":s")[2]
        assert doc["why_chosen"] and any(h["kind"] == "start" for h in doc["history"])
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    assert "event=daemon_started" in (tmp_path / "daemon.err").read_text()
