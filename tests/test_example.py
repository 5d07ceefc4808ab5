"""A researcher's own model (examples/charlm) through the runtime API.

Off the lab: the script resumes a checkpoint written under one plan in another plan at the
exact sample, so its losses equal an uninterrupted run's.

On the lab (the demo's scenario with the example as the training job): submitted with
``--comment=elastic``, planned by the daemon onto 4 a100, moved by the daemon to 4 a10
when a larger job arrives (SIGUSR1 → checkpoint → exit 86 → requeued held → new
partition, shape and plan → released), and resumed at the next step and the exact sample:
every step's loss, before and after, equals an uninterrupted run's.
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TRAIN = ROOT / "examples" / "charlm" / "train.py"
RTOL = 1e-3  # float32 sums in another order under another plan (measured < 1e-6)
_STEP = re.compile(r"step (\d+) loss ([0-9.]+)")


def _run(ckpt: Path, iterations: int, plan: str | None = None, *, every: int | None = None,
         global_batch: int = 16, status: int = 0) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "XLA_", "JAX_"))}
    if plan:
        env["SLURM_EXT_PLAN"] = plan
    if every:
        env["SLURM_EXT_CHECKPOINT_EVERY"] = str(every)
    proc = subprocess.run([sys.executable, str(TRAIN), "--iterations", str(iterations), "--global-batch",
                           str(global_batch), "--devices", "4", "--checkpoint-dir", str(ckpt)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == status, proc.stderr[-3000:]
    return proc.stderr


def _losses(text: str) -> dict[int, float]:
    return {int(s): float(v) for s, v in _STEP.findall(text)}


def test_own_model_resumes_in_another_plan_at_the_exact_sample(tmp_path):
    first = _run(tmp_path / "ckpt", 6, "cell=a100x4:s1 plan=[dp4tp1] mb=1 remat=1")
    second = _run(tmp_path / "ckpt", 10, "cell=a100x4:s1 plan=[dp2tp2] mb=2 remat=1")
    assert "resumed from step 6 (checkpoint" in second and "next sample 96" in second
    reference = _losses(_run(tmp_path / "reference", 10))
    got = {**_losses(first), **_losses(second)}
    assert sorted(got) == list(range(1, 11))
    for step, loss in got.items():
        assert loss == pytest.approx(reference[step], rel=RTOL), (step, loss, reference[step])
    assert reference[10] < reference[1]  # it learns its text


def test_a_damaged_checkpoint_is_set_aside_and_one_of_another_batch_refused_in_one_line(tmp_path):
    first = _run(tmp_path / "ckpt", 4, every=2)
    for f in (tmp_path / "ckpt" / "4" / "arrays" / "d").iterdir():  # step 4's array files cut short
        os.truncate(f, 100)
    second = _run(tmp_path / "ckpt", 6)
    assert "checkpoint of step 4 cannot be read" in second and "resumed from step 2 (checkpoint" in second
    assert (tmp_path / "ckpt" / "4.unreadable").is_dir()
    assert _losses(second)[4] == _losses(first)[4]  # step 4 again, from step 2's state
    other = _run(tmp_path / "ckpt", 8, global_batch=32, status=2)
    assert other.strip().splitlines()[-1].startswith("train.py: error: global_batch=32")


def test_a_pipeline_plan_is_refused_in_one_line(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "XLA_", "JAX_"))}
    env["SLURM_EXT_PLAN"] = "cell=a100x4:s2 plan=[dp2tp1|dp2tp1] mb=2 remat=1"
    proc = subprocess.run([sys.executable, str(TRAIN), "--iterations", "2", "--global-batch", "16",
                           "--devices", "4", "--checkpoint-dir", str(tmp_path)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1].startswith("train.py: error: plan=")
    assert "2 pipeline stages" in proc.stderr and "trainer=api" in proc.stderr


@pytest.mark.slurm
def test_daemon_rescales_the_own_model_which_resumes_at_the_exact_sample(slurm_lab, slurm_client, tmp_path,
                                                                       tmp_path_factory):
    from slurm_ext.demo import example_training_job, run_rescale_scenario

    cache = tmp_path_factory.getbasetemp() / "runner-jax-cache"
    outcome = run_rescale_scenario(slurm_client, slurm_lab.env(), tmp_path, training=example_training_job(),
                                   compile_cache=cache)
    first, after, resume = outcome.before, outcome.after, outcome.resume
    assert (first.granted_gpu_type, first.granted_gpus) == ("a100", 4)
    assert after.restart_count == 1 and after.granted_gpu_type != "a100"
    assert resume.next_step == resume.saved_step + 1 and resume.global_batch == 16
    text = outcome.log_text
    assert re.search(rf"next sample {resume.saved_step * 16}\b", text), text[-3000:]
    assert "(from the AdminComment)" in text and ":s1 " in resume.plan  # single-stage plans only
    assert " remat=0" in resume.plan and "zero=" not in resume.plan  # what the runtime API runs
    losses = resume.losses
    assert sorted(losses) == list(range(1, max(losses) + 1))
    reference = _losses(_run(tmp_path / "reference", max(losses)))
    for step, loss in losses.items():
        assert loss == pytest.approx(reference[step], rel=RTOL), (step, loss, reference[step])


def test_the_examples_data_that_cannot_make_a_sample_is_one_line_and_its_order_is_per_epoch(tmp_path, monkeypatch):
    """A missing, empty or too short data.txt was a traceback and exit 1 (a FAILED job
    with a stack trace); each sample reshuffled its whole epoch."""
    import numpy as np
    monkeypatch.syspath_prepend(str(ROOT / "examples" / "charlm"))
    import train
    for name, content in (("missing", None), ("empty", b""), ("short", b"x" * 64)):
        path = tmp_path / name
        if content is not None:
            path.write_bytes(content)
        with pytest.raises(train.runtime.SpecError, match=f"data='{path}'"):
            train.ByteWindows(path, 64)
    text = tmp_path / "text"
    text.write_bytes(np.random.default_rng(7).integers(0, 256, 1024, dtype=np.uint8).tobytes())
    windows = train.ByteWindows(text, 16)
    epoch = [tuple(windows.sample(i)) for i in range(windows.count)]
    assert len(set(epoch)) == windows.count  # every window once per epoch
    order = np.random.default_rng([0, 1]).permutation(windows.count)
    assert [tuple(windows.sample(windows.count + k)) for k in range(3)] == \
        [tuple(windows.windows[o * 16:o * 16 + 17]) for o in order[:3]]
