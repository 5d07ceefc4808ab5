"""Which plan a job's run takes: an AdminComment plan that does not parse (an edit by hand,
not the daemon's writing) is ignored with a warning, and the run goes on without it."""

from estimator.contract import ADMIN_COMMENT_PLAN


def _plan_with_admin_comment(ckpt: str, admin: str) -> tuple:
    from job_scripts import runtime

    runtime.scontrol_job_text = lambda job_id: f"JobId={job_id} JobName=t\n   AdminComment={admin}\n"
    job = runtime.start(stop=runtime.StopSignal(), env={"SLURM_JOB_ID": "42"}, global_batch=16, devices=2,
                        platform="cpu", checkpoint_dir=ckpt, compile_cache="")
    return job.plan_text, job.plan_source


def test_an_admin_comment_plan_that_does_not_parse_is_ignored_not_fatal(tmp_path):
    from conftest import in_jax_child

    good = "requested=any cell=a100x2:s1 plan=[dp2tp1] mb=1 remat=1 why=started"
    assert in_jax_child(2, _plan_with_admin_comment, str(tmp_path / "a"), good) == \
        ("cell=a100x2:s1 plan=[dp2tp1] mb=1 remat=1", ADMIN_COMMENT_PLAN)
    broken = "requested=any cell=a100x2:s1 plan=[dp2tp1 mb=1 remat=1 why=edited"  # no closing bracket
    assert in_jax_child(2, _plan_with_admin_comment, str(tmp_path / "b"), broken) == (None, None)
