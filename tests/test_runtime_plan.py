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


def test_on_gpus_jax_may_take_the_share_of_memory_the_estimates_count_on(monkeypatch):
    """JAX's own default is 75 % of each GPU: a Cell estimated to fit in 90 % ran out of
    memory. A job that sets the share itself keeps its setting."""
    from types import SimpleNamespace

    from estimator.memory import MemoryOptions
    from job_scripts.runtime import _configure_jax
    gpu = SimpleNamespace(platform="gpu", compile_cache_dir=None)
    monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION", raising=False)
    _configure_jax(gpu, None)
    import os
    assert os.environ["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.9" == f"{MemoryOptions().usable_frac:g}"
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.5")
    _configure_jax(gpu, None)
    assert os.environ["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.5"
