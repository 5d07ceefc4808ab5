"""End to end on the real lab Slurm: the daemon rescales a training job, which resumes.

The scenario is the demo's (slurm_ext.demo.run_rescale_scenario): plain jobs hold every
lab node but one a100 node; an elastic job submitted with job_scripts/elastic.sbatch
(the tiny GPT, asking for 8 GPUs, so its Cells have 4, 8 or 16) starts training on the 4
free a100. Then the a10 nodes come free and a second elastic job arrives whose model fits
4 a100 but no count of a10 the lab has: the daemon's policy moves the first job to 4 a10
to make room (USR1 → the runner checkpoints and exits 86 → requeued held → new partition,
shape and plan → released). The restarted runner must resume from its checkpoint at
exactly the next step, with the same global batch, on the new GPU type, and every step's
loss, before and after the rescale, must match an uninterrupted run's.
"""

import os
import re
import subprocess
import sys

import pytest

from slurm_ext.demo import TRAIN_GLOBAL_BATCH, TRAIN_MODEL, run_rescale_scenario

pytestmark = pytest.mark.slurm

LOSS_RTOL = 1e-4  # float32 sums in another order under another plan (measured < 1e-6)


def _uninterrupted_losses(tmp_path, cache, iterations: int) -> dict[int, float]:
    """The same training without a rescale: one runner process on 4 CPU devices."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "XLA_", "JAX_"))}
    proc = subprocess.run(
        [sys.executable, "-m", "job_scripts.run", "--model", str(TRAIN_MODEL),
         "--global-batch", str(TRAIN_GLOBAL_BATCH), "--iterations", str(iterations),
         "--plan", "cell=a100x4:s1 plan=[dp4tp1] mb=4 remat=1", "--devices", "4",
         "--platform", "cpu", "--checkpoint-dir", str(tmp_path / "reference"),
         "--compile-cache", str(cache)],
        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))), env=env,
        capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {int(s): float(v) for s, v in re.findall(r"step (\d+) loss ([0-9.]+)", proc.stderr)}


@pytest.mark.scenario
def test_daemon_rescales_training_job_which_resumes_at_next_step(slurm_lab, slurm_client, tmp_path,
                                                                 tmp_path_factory):
    # JAX's compilation cache is shared with test_runner's runs of the same plan.
    cache = tmp_path_factory.getbasetemp() / "runner-jax-cache"
    outcome = run_rescale_scenario(slurm_client, slurm_lab.env(), tmp_path, compile_cache=cache)
    first, after, resume = outcome.before, outcome.after, outcome.resume
    assert (first.granted_gpu_type, first.granted_gpus, first.restart_count) == ("a100", 4, 0)
    assert any(job == outcome.train_job_id for _, job in outcome.actions), outcome.actions
    assert after.restart_count == 1
    assert after.granted_gpu_type != "a100", after
    arrival = slurm_client.job(outcome.arrival_job_id)
    assert arrival is not None and arrival.is_running

    text = outcome.log_text
    saved = int(re.search(r"SIGUSR1: checkpointed step (\d+); exiting 86", text).group(1))
    resumed = re.search(r"resumed from step (\d+) \(checkpoint .*\); next step (\d+); now plan (.*) on (\d+) "
                        r"devices, global batch (\d+)", text)
    assert resumed, text[-3000:]
    assert int(resumed.group(1)) == saved and int(resumed.group(2)) == saved + 1
    assert int(resumed.group(4)) == after.granted_gpus
    assert int(resumed.group(5)) == TRAIN_GLOBAL_BATCH
    steps_after = [int(s) for s in re.findall(r"step (\d+) loss", text[resumed.end():])]
    assert steps_after[0] == saved + 1
    # The daemon's reasons, as `slurm-ext squeue` shows them.
    assert re.search(rf"(?m)^{outcome.train_job_id} .*RUNNING .*a10 .* (rescaled|moved) to a10x4:s1 "
                     rf"for job {outcome.arrival_job_id}\b", outcome.squeue_after), outcome.squeue_after

    losses = resume.losses
    assert sorted(losses) == list(range(1, max(losses) + 1)), sorted(losses)
    reference = _uninterrupted_losses(tmp_path, cache, max(losses))
    for step, loss in losses.items():
        assert loss == pytest.approx(reference[step], rel=LOSS_RTOL), (step, loss, reference[step])
