"""The demo's pure parts: reading a rescaled job's log and building its batch script."""

import pytest

from slurm_ext import demo
from slurm_ext.demo import TRAIN_MODEL, log_highlights, parse_resume, training_script
from estimator.contract import script_settings

# A rescaled runner's log as the lab wrote it in `make demo` (both runs appended to one
# file; paths shortened): each run reads the AdminComment's plan, tunes one, and trains.
LOG = """\
2026-11-24 08:08:35,862 job_scripts.runtime: plan cell=a100x4:s1 plan=[dp4tp1] mb=4 remat=1 layers=0,4 (from the AdminComment)
2026-11-24 08:09:05,683 job_scripts.run: plan cell=a100x4:s1 plan=[dp4tp1] mb=1 remat=0 (tuned here: 0.0233 s/iteration measured, 9 candidates in 29.6 s; the AdminComment's plan 0.0422 s)
2026-11-24 08:09:06,066 job_scripts.runtime: starting at step 1 (no checkpoint in /w/ckpt/5); plan cell=a100x4:s1 plan=[dp4tp1] mb=1 remat=0 on 4 devices, global batch 16
2026-11-24 08:09:06,377 job_scripts.runtime: step 1 loss 5.837612 time 0.310s
2026-11-24 08:09:06,402 job_scripts.runtime: step 2 loss 5.863802 time 0.025s
2026-11-24 08:09:06,973 job_scripts.runtime: step 23 loss 5.346848 time 0.015s
2026-11-24 08:09:06,995 job_scripts.runtime: step 24 loss 5.346438 time 0.022s
2026-11-24 08:09:07,104 job_scripts.checkpoint: checkpoint step 24: writing to /w/ckpt/5/24
2026-11-24 08:09:07,148 job_scripts.runtime: SIGUSR1: checkpointed step 24; exiting 86
2026-11-24 08:09:11,792 job_scripts.runtime: plan cell=a10x4:s1 plan=[dp4tp1] mb=4 remat=1 layers=0,4 (from the AdminComment)
2026-11-24 08:09:22,403 job_scripts.run: plan cell=a10x4:s1 plan=[dp4tp1] mb=1 remat=0 (tuned here: 0.0233 s/iteration measured, 9 candidates in 10.4 s; the AdminComment's plan 0.0423 s)
2026-11-24 08:09:22,457 job_scripts.runtime: resumed from step 24 (checkpoint /w/ckpt/5/24, plan cell=a100x4:s1 plan=[dp4tp1] mb=1 remat=0); next step 25; now plan cell=a10x4:s1 plan=[dp4tp1] mb=1 remat=0 on 4 devices, global batch 16, next sample 384
2026-11-24 08:09:24,691 job_scripts.runtime: step 25 loss 5.222121 time 2.234s
2026-11-24 08:09:24,718 job_scripts.runtime: step 26 loss 5.310122 time 0.027s
2026-11-24 08:09:24,742 job_scripts.runtime: step 27 loss 5.269246 time 0.024s
"""
LOSS_24, LOSS_25 = 5.346438, 5.222121
RESUMED_AT, FIRST_AFTER_AT = "2026-11-24 08:09:22,457", "2026-11-24 08:09:24,691"


def test_parse_resume_reads_checkpoint_resume_and_losses():
    record = parse_resume(LOG)
    assert (record.saved_step, record.resumed_step, record.next_step) == (24, 24, 25)
    assert record.plan == "cell=a10x4:s1 plan=[dp4tp1] mb=1 remat=0"  # tuned on the new Cell
    assert (record.num_devices, record.global_batch) == (4, 16)
    assert record.steps_after_resume == (25, 26, 27)
    assert record.losses[24] == LOSS_24 and record.losses[25] == LOSS_25


def test_parse_resume_needs_a_step_after_the_resume():
    before_resume = LOG.split(RESUMED_AT)[0]
    assert parse_resume(before_resume) is None
    only_resumed = LOG.split(FIRST_AFTER_AT)[0]
    assert parse_resume(only_resumed) is None
    assert parse_resume("") is None


def test_log_highlights_keep_the_rescale_and_drop_the_middle():
    lines = log_highlights(LOG, steps_around=2)
    text = "\n".join(lines)
    assert "step 1 loss" not in text and "step 27 loss" not in text
    for wanted in ("starting at step 1", "step 23 loss", "step 24 loss", "SIGUSR1: checkpointed step 24",
                   "(from the AdminComment)", "(tuned here: ", "resumed from step 24", "step 25 loss",
                   "step 26 loss"):
        assert wanted in text, wanted
    assert lines == sorted(lines)  # in the log's order


def test_training_script_is_the_wrapper_with_the_demo_settings():
    script = training_script()
    assert script.startswith("#!/bin/bash") and "exec \"$PYTHON\" -m job_scripts.run" in script
    assert script_settings(script) == {"model": str(TRAIN_MODEL), "global_batch": "16",
                                       "iterations": "20000", "gpus": "8"}


def test_example_training_job_is_the_examples_script_on_the_runtime_api():
    from slurm_ext.demo import EXAMPLE_DIR, example_training_job
    job = example_training_job()
    assert job.script.startswith("#!/bin/bash") and "examples/charlm/train.py" in job.script
    assert script_settings(job.script) == {"model": str(EXAMPLE_DIR / "model.yaml"), "global_batch": "16",
                                           "iterations": "20000", "gpus": "8", "trainer": "api"}


def test_an_unknown_policy_is_refused_before_anything_starts(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(demo, "run_demo", lambda *a: pytest.fail("the demo must not start"))
    assert demo.main(["--dir", str(tmp_path / "d"), "--policy", "nope"]) == 2
    assert "unknown policy" in capsys.readouterr().err
    assert not (tmp_path / "d").exists()


def test_a_directory_the_demo_did_not_make_keeps_its_permissions(tmp_path, monkeypatch):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o1777)
    monkeypatch.setattr(demo, "run_demo", lambda root, policy: 0)
    assert demo.main(["--dir", str(shared)]) == 0
    assert shared.stat().st_mode & 0o7777 == 0o1777
    made = tmp_path / "new"
    assert demo.main(["--dir", str(made)]) == 0
    assert made.stat().st_mode & 0o777 == 0o755
