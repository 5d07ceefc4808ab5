"""The demo's pure parts: reading a rescaled job's log and building its batch script."""

from slurm_ext.demo import TRAIN_MODEL, log_highlights, parse_resume, training_script
from slurm_ext.jobspec import script_settings

# A rescaled runner's log as the lab writes it (both runs appended to one file).
LOG = """\
2026-11-21 04:11:37,277 job_scripts.run: plan cell=a100x4:s1 plan=[dp4tp1] mb=4 remat=1 layers=0,4 (from the AdminComment)
2026-11-21 04:11:39,065 job_scripts.run: starting at step 1 (no checkpoint in /w/ckpt/5); plan cell=a100x4:s1 plan=[dp4tp1] mb=4 remat=1 layers=0,4 on 4 devices, global batch 16
2026-11-21 04:11:42,100 job_scripts.run: step 1 loss 5.837612 time 2.000s
2026-11-21 04:11:42,200 job_scripts.run: step 2 loss 5.863803 time 0.100s
2026-11-21 04:11:42,300 job_scripts.run: step 3 loss 5.799651 time 0.100s
2026-11-21 04:11:43,360 job_scripts.checkpoint: checkpoint step 3 written to /w/ckpt/5/ckpt-00000003.npz (1449506 bytes)
2026-11-21 04:11:43,367 job_scripts.run: SIGUSR1: checkpointed step 3; exiting 86
2026-11-21 04:11:47,239 job_scripts.run: plan cell=a10x4:s1 plan=[dp4tp1] mb=4 remat=1 layers=0,4 (from the AdminComment)
2026-11-21 04:11:47,277 job_scripts.run: resumed from step 3 (checkpoint /w/ckpt/5/ckpt-00000003.npz, plan cell=a100x4:s1 plan=[dp4tp1] mb=4 remat=1 layers=0,4); next step 4; now plan cell=a10x4:s1 plan=[dp4tp1] mb=4 remat=1 layers=0,4 on 4 devices, global batch 16
2026-11-21 04:11:48,078 job_scripts.run: step 4 loss 5.604803 time 0.801s
2026-11-21 04:11:48,168 job_scripts.run: step 5 loss 5.780601 time 0.090s
2026-11-21 04:11:48,268 job_scripts.run: step 6 loss 5.700000 time 0.090s
"""


def test_parse_resume_reads_checkpoint_resume_and_losses():
    record = parse_resume(LOG)
    assert (record.saved_step, record.resumed_step, record.next_step) == (3, 3, 4)
    assert record.plan == "cell=a10x4:s1 plan=[dp4tp1] mb=4 remat=1 layers=0,4"
    assert (record.num_devices, record.global_batch) == (4, 16)
    assert record.steps_after_resume == (4, 5, 6)
    assert record.losses[3] == 5.799651 and record.losses[4] == 5.604803


def test_parse_resume_needs_a_step_after_the_resume():
    before_resume = LOG.split("2026-11-21 04:11:47,277")[0]
    assert parse_resume(before_resume) is None
    only_resumed = LOG.split("2026-11-21 04:11:48,078")[0]
    assert parse_resume(only_resumed) is None
    assert parse_resume("") is None


def test_log_highlights_keep_the_rescale_and_drop_the_middle():
    lines = log_highlights(LOG, steps_around=2)
    text = "\n".join(lines)
    assert "step 1 loss" not in text and "step 6 loss" not in text
    for wanted in ("starting at step 1", "step 2 loss", "step 3 loss", "SIGUSR1: checkpointed step 3",
                   "(from the AdminComment)", "resumed from step 3", "step 4 loss", "step 5 loss"):
        assert wanted in text, wanted
    assert lines == sorted(lines)  # in the log's order


def test_training_script_is_the_wrapper_with_the_demo_settings():
    script = training_script()
    assert script.startswith("#!/bin/bash") and "exec \"$PYTHON\" -m job_scripts.run" in script
    assert script_settings(script) == {"model": str(TRAIN_MODEL), "global_batch": "16",
                                       "iterations": "100000", "gpus": "8"}
