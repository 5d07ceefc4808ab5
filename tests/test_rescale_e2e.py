"""End to end on the real lab Slurm: the daemon rescales a training job, which resumes.

Blockers hold every lab node but one a100 node. An elastic job submitted with
job_scripts/elastic.sbatch (the tiny GPT, asking for 8 GPUs, so its Cells have 4, 8 or 16)
starts training on the 4 free a100. Then the a10 nodes come free and a second elastic job
arrives whose model fits 4 a100 but no count of a10 the lab has: the daemon's policy
moves the first job to 4 a10 to make room (USR1 → the runner checkpoints and exits 86 →
requeued held → new partition, shape and plan → released). The restarted runner must
resume from its checkpoint at exactly the next step, with the same global batch, on the
new GPU type.
"""

import re
import sys
from pathlib import Path

import pytest

from conftest import wait_for as _wait_for
from slurm_ext.slurm_client import SubmitRequest

pytestmark = pytest.mark.slurm

REPO = Path(__file__).resolve().parents[1]
FIXTURES = REPO / "tests" / "fixtures" / "runner"
TINY_GPT = FIXTURES / "tiny-gpt.yaml"
GLOBAL_BATCH = 16

ARRIVAL = f"""#!/bin/bash
#ELASTIC model={FIXTURES / "arrival-6b.yaml"} global_batch=64 iterations=100000 gpus=4 gpu_type=a100
trap 'exit 86' USR1
while true; do sleep 0.2 & wait $!; done
"""


def _read(path: Path) -> str:
    return path.read_text() if path.exists() else ""


def _running(client, job_id):
    j = client.job(job_id)
    return j if j is not None and j.is_running else None


def _training_script() -> str:
    text = (REPO / "job_scripts" / "elastic.sbatch").read_text()
    text = re.sub(r"(?m)^#ELASTIC .*\n", "", text)
    return text.replace(
        "#SBATCH --gres=gpu:4\n",
        f"#SBATCH --gres=gpu:4\n#ELASTIC model={TINY_GPT} global_batch={GLOBAL_BATCH} "
        "iterations=100000 gpus=8\n")


def test_daemon_rescales_training_job_which_resumes_at_next_step(slurm_lab, slurm_client, tmp_path,
                                                                 tmp_path_factory):
    from slurm_ext.config import resolve
    from slurm_ext.daemon import Daemon
    from slurm_ext.store import Store

    blockers = [slurm_client.submit(SubmitRequest(
        script="#!/bin/bash\nsleep 3600\n", name="blocker", partition=p, gres=g, nodes=n,
        output=str(tmp_path / "blocker-%j.out"), workdir=str(tmp_path)))
        for p, g, n in (("h100", "gpu:8", 1), ("v100", "gpu:4", 2), ("a10", "gpu:2", 2), ("a100", "gpu:4", 1))]
    for b in blockers:
        _wait_for("the blockers to run", lambda b=b: _running(slurm_client, b), 30)

    log_path = tmp_path / "train.out"
    # JAX's compilation cache is shared with test_runner's runs of the same plan.
    cache = tmp_path_factory.getbasetemp() / "runner-jax-cache"
    env = (f"--export=ALL,SLURM_EXT_PYTHON={sys.executable},SLURM_EXT_COMPILE_CACHE={cache},"
           f"SLURM_EXT_CHECKPOINT_ROOT={tmp_path / 'ckpt'},SLURM_EXT_CHECKPOINT_EVERY=1000")
    train = slurm_client.submit(SubmitRequest(
        script=_training_script(), name="train", comment="elastic", output=str(log_path),
        workdir=str(REPO), extra_args=(env,)))

    # Crius's arrival search (move a running job to another GPU type) is the rescale this
    # scenario is built for; pinned so a change of the default policy does not change it.
    cfg = resolve({"state_db": str(tmp_path / "state.db"), "rescale_timeout_s": 90.0,
                   "policy": "crius"}, {}, {})
    daemon = Daemon(cfg, slurm_client, Store(cfg.state_db), out=lambda line: None, env=slurm_lab.env())
    daemon.round()
    first = _wait_for("the training job to run", lambda: _running(slurm_client, train), 30)
    assert (first.granted_gpu_type, first.granted_gpus, first.restart_count) == ("a100", 4, 0)
    _wait_for("training steps", lambda: re.search(r"step 2 loss", _read(log_path)), 150)

    a10_blocker = blockers[2]
    slurm_client.cancel(a10_blocker)
    _wait_for("the a10 blocker to end",
              lambda: not (j := slurm_client.job(a10_blocker)) or not j.is_active, 30)
    arrival = slurm_client.submit(SubmitRequest(
        script=ARRIVAL, name="arrival", comment="elastic", output=str(tmp_path / "arrival.out"),
        workdir=str(tmp_path)))
    report = daemon.round()
    assert any(job == train for _, job in report.actions), report.actions
    after = _wait_for("the rescaled job to run", lambda: _running(slurm_client, train), 60)
    assert after.restart_count == 1
    assert after.granted_gpu_type != "a100", after
    _wait_for("the arrival to run", lambda: _running(slurm_client, arrival), 60)

    def after_resume():
        t = _read(log_path)
        i = t.find("resumed from")
        return t if i >= 0 and re.search(r"step \d+ loss", t[i:]) else None

    text = _wait_for("a step after the resume", after_resume, 150)
    saved = int(re.search(r"SIGUSR1: checkpointed step (\d+); exiting 86", text).group(1))
    resumed = re.search(r"resumed from step (\d+) \(checkpoint .*\); next step (\d+); now plan (.*) on (\d+) "
                        r"devices, global batch (\d+)", text)
    assert resumed, text[-3000:]
    assert int(resumed.group(1)) == saved and int(resumed.group(2)) == saved + 1
    assert int(resumed.group(4)) == after.granted_gpus
    assert int(resumed.group(5)) == GLOBAL_BATCH
    steps_after = [int(s) for s in re.findall(r"step (\d+) loss", text[resumed.end():])]
    assert steps_after[0] == saved + 1
