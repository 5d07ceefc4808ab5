"""The runner as a child process on CPU fake devices: rescale by USR1, hard kill, resume.

Each run trains the tiny GPT of fixtures/runner/tiny-gpt.yaml (2 blocks, hidden 64,
sequence 32, vocabulary 128, fp32) with a global batch of 16 for 8 steps. The reference
is an uninterrupted run under a two-stage plan on 2 devices; interrupted runs use a
data-parallel plan on 4 devices and resume under a pipeline + data + tensor parallel plan,
a plan tuned for 2 devices, or the same plan; they must continue at exactly the step
after their checkpoint and reproduce the reference's losses within LOSS_RTOL (float32
sums taken in another order under another plan; measured differences are below 1e-6).

Checkpoints are Orbax's: ``<dir>/<step>/`` complete, ``<dir>/<step>.orbax-checkpoint-tmp-*``
while being written. Runs share a JAX compilation cache, so each plan is compiled once;
the reference runs alongside the first interrupted runs.
"""

import math
import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest

from estimator.contract import ADMIN_COMMENT_PLAN, EXIT_RESCALE, MEASURED_FILE, RunnerReport
from estimator.errors import SpecError

ROOT = Path(__file__).resolve().parent.parent
TINY_GPT = ROOT / "tests" / "fixtures" / "runner" / "tiny-gpt.yaml"
TINY_GPT_FP16 = ROOT / "tests" / "fixtures" / "runner" / "tiny-gpt-fp16.yaml"
ITERATIONS = 8
GLOBAL_BATCH = 16
LOSS_RTOL = 1e-4
# The plan the daemon gives the tiny GPT on 4 GPUs in test_rescale_e2e: its compiled
# programs are shared through this pytest run's compilation cache.
DP4 = "cell=a100x4:s1 plan=[dp4tp1] mb=4 remat=1"
PP2_ON_2 = "cell=v100x2:s2 plan=[dp1tp1|dp1tp1] mb=4 remat=1"
# Pipeline, data and tensor parallelism at once: embedding + block 1 on 2 devices (dp),
# block 2 + head on 2 devices (tp).
MIXED = "cell=h100x4:s2 plan=[dp2tp1|dp1tp2] mb=2 remat=1 layers=0,2,4"
WAIT_S = 180

_STEP = re.compile(r"step (\d+) loss ([0-9.]+)")


class Runner:
    """One runner process writing its log to a file."""

    def __init__(self, tmp: Path, name: str, ckpt: Path, plan: str | None, devices: int, cache: Path,
                 extra: tuple[str, ...] = (), restart_count: int = 0, iterations: int = ITERATIONS,
                 model: Path = TINY_GPT):
        self.log_path = tmp / f"{name}.log"
        env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "XLA_", "JAX_"))}
        env["SLURM_RESTART_COUNT"] = str(restart_count)
        argv = [sys.executable, "-m", "job_scripts.run", "--model", str(model),
                "--global-batch", str(GLOBAL_BATCH), "--iterations", str(iterations),
                *(("--plan", plan) if plan else ()), "--devices", str(devices), "--platform", "cpu",
                "--checkpoint-dir", str(ckpt), "--compile-cache", str(cache),
                "--warmup-steps", "1", *extra]
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)

    def text(self) -> str:
        return self.log_path.read_text()

    def wait_for(self, pattern: str) -> re.Match:
        deadline = time.monotonic() + WAIT_S
        while time.monotonic() < deadline:
            m = re.search(pattern, self.text())
            if m:
                return m
            if self.proc.poll() is not None:
                break
            time.sleep(0.05)
        self.proc.kill()
        pytest.fail(f"runner never printed {pattern!r}:\n{self.text()[-3000:]}")

    def finish(self) -> int:
        try:
            return self.proc.wait(WAIT_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            pytest.fail(f"runner did not exit:\n{self.text()[-3000:]}")

    def losses(self) -> dict[int, float]:
        return {int(s): float(v) for s, v in _STEP.findall(self.text())}


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """JAX's compilation cache, shared with the other runner tests of this pytest run."""
    path = tmp_path_factory.getbasetemp() / "runner-jax-cache"
    path.mkdir(exist_ok=True)
    return path


class Reference:
    """An uninterrupted run (two stages on 2 devices), started early, awaited when needed."""

    def __init__(self, tmp: Path, cache: Path):
        self.run = Runner(tmp, "reference", tmp / "ckpt", PP2_ON_2, 2, cache)
        self._losses: dict[int, float] | None = None

    def losses(self) -> dict[int, float]:
        if self._losses is None:
            assert self.run.finish() == 0, self.run.text()[-3000:]
            self._losses = self.run.losses()
            assert sorted(self._losses) == list(range(1, ITERATIONS + 1))
        return self._losses


@pytest.fixture(scope="module")
def reference(tmp_path_factory, cache):
    ref = Reference(tmp_path_factory.mktemp("reference"), cache)
    yield ref
    if ref.run.proc.poll() is None:
        ref.run.proc.kill()


def _meta(ckpt: Path, step: int) -> dict:
    """The metadata Orbax saved with checkpoint ``step`` (JSON item ``meta``)."""
    return json.loads((ckpt / str(step) / "meta" / "metadata").read_text())


def _complete_steps(ckpt: Path) -> list[int]:
    return sorted(int(p.name) for p in ckpt.iterdir() if p.name.isdigit())


def _assert_matches(losses: dict[int, float], reference: Reference) -> None:
    reference = reference.losses()
    for step, loss in losses.items():
        assert loss == pytest.approx(reference[step], rel=LOSS_RTOL), (step, loss, reference[step])


def test_usr1_checkpoints_exits_86_and_resumes_under_another_plan(tmp_path, cache, reference):
    ckpt = tmp_path / "ckpt"
    first = Runner(tmp_path, "first", ckpt, DP4, 4, cache)
    first.wait_for(r"step 2 loss")
    first.proc.send_signal(signal.SIGUSR1)
    assert first.finish() == 86, first.text()[-3000:]
    saved = int(re.search(rf"SIGUSR1: checkpointed step (\d+); exiting {EXIT_RESCALE}", first.text()).group(1))
    assert 2 <= saved < ITERATIONS
    # It finished the step it was in and stopped: no step after the checkpointed one ran.
    assert max(first.losses()) == saved
    meta = _meta(ckpt, saved)
    assert meta["data"] == {"next_step": saved + 1, "next_sample": saved * GLOBAL_BATCH}
    assert meta["global_batch"] == GLOBAL_BATCH and meta["plan"] == DP4
    assert " absl: " not in first.text()  # Orbax's INFO chatter stays out of the job's log
    report = RunnerReport.from_text((ckpt / MEASURED_FILE).read_text())
    assert report.step == saved  # where the daemon reads it
    # What the start and the save on the signal cost, for the restart-cost model.
    assert report.startup_s > report.init_s > 0 and report.restore_s is None
    assert report.final_save_s > 0

    # The daemon moved it to another GPU type with a two-stage dp/tp plan.
    second = Runner(tmp_path, "second", ckpt, MIXED, 4, cache, restart_count=1)
    assert second.finish() == 0, second.text()[-3000:]
    text = second.text()
    assert f"resumed from step {saved} (checkpoint" in text
    assert f"next step {saved + 1}" in text and f"global batch {GLOBAL_BATCH}" in text
    resumed = second.losses()
    assert sorted(resumed) == list(range(saved + 1, ITERATIONS + 1))
    _assert_matches({**first.losses(), **resumed}, reference)

    measured = RunnerReport.from_text((ckpt / MEASURED_FILE).read_text())  # the last run's figures
    assert measured.cell == "h100x4:s2" and measured.plan == MIXED
    assert measured.iteration_time_s > 0 and measured.steps_measured >= 1
    assert measured.step == ITERATIONS and measured.restart_count == 1
    assert measured.startup_s > measured.restore_s > 0 and measured.init_s is None


def test_sigkill_during_a_save_resumes_from_the_previous_checkpoint(tmp_path, cache, reference):
    ckpt = tmp_path / "ckpt"
    # A checkpoint every step, written while training goes on: a save is nearly always
    # under way, and the runner is killed while one is.
    first = Runner(tmp_path, "killed", ckpt, DP4, 4, cache, extra=("--checkpoint-every", "1"),
                   iterations=10_000)
    first.wait_for(r"step 4 loss")
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline and not any("orbax-checkpoint-tmp" in p.name for p in ckpt.iterdir()):
        time.sleep(0.001)
    first.proc.send_signal(signal.SIGKILL)
    assert first.finish() == -signal.SIGKILL
    complete = _complete_steps(ckpt)
    partial = [int(p.name.split(".")[0]) for p in ckpt.iterdir() if "orbax-checkpoint-tmp" in p.name]
    assert complete and partial and max(partial) > max(complete), (complete, partial)
    last = complete[-1]

    # Restarted on 2 GPUs without a plan: the runner tunes one for its 2 devices.
    second = Runner(tmp_path, "after-kill", ckpt, None, 2, cache, restart_count=1,
                    iterations=last + 3)
    assert second.finish() == 0, second.text()[-3000:]
    assert re.search(r"plan .* \(tuned here: [0-9.]+ s/iteration measured", second.text())
    assert f"resumed from step {last} (checkpoint" in second.text()
    resumed = second.losses()
    assert sorted(resumed) == list(range(last + 1, last + 4))
    _assert_matches({k: v for k, v in resumed.items() if k <= ITERATIONS}, reference)
    # The half-written checkpoint was cleared away; the newest complete ones are kept.
    assert not any("orbax-checkpoint-tmp" in p.name for p in ckpt.iterdir())
    assert _complete_steps(ckpt)[-1] == last + 3


def test_bad_plan_is_one_line_and_exit_2(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "job_scripts.run", "--model", str(TINY_GPT), "--global-batch", "16",
         "--iterations", "2", "--devices", "4", "--platform", "cpu",
         "--plan", "cell=a100x8:s1 plan=[dp8tp1] mb=1 remat=0", "--checkpoint-dir", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=WAIT_S,
        env={k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "XLA_", "JAX_"))})
    assert proc.returncode == 2
    assert "is for 8 GPUs but this job has 4" in proc.stderr


def test_platform_gpu_without_a_gpu_is_one_line_and_exit_2(tmp_path):
    """It trained on the CPU and reported the times as a GPU's."""
    proc = subprocess.run(
        [sys.executable, "-m", "job_scripts.run", "--model", str(TINY_GPT), "--global-batch", "16",
         "--iterations", "1", "--devices", "1", "--platform", "gpu", "--checkpoint-dir", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=WAIT_S,
        env={k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "XLA_", "JAX_", "CUDA_"))})
    assert proc.returncode == 2 and "sees no GPU" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "1").exists()


def test_a_report_that_cannot_be_written_does_not_fail_the_training(tmp_path):
    """measured.json goes to ROOT/<job id> even beside checkpoints of --checkpoint-dir: where
    that cannot be written, the job trained and checkpointed, then ended in a traceback."""
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "XLA_", "JAX_"))}
    env.update(SLURM_JOB_ID="4242", SLURM_SUBMIT_DIR=str(blocker / "home"), SLURM_EXT_TUNE="0")
    proc = subprocess.run(
        [sys.executable, "-m", "job_scripts.run", "--model", str(TINY_GPT), "--global-batch", "16",
         "--iterations", "2", "--devices", "1", "--platform", "cpu",
         "--plan", "cell=a100x1:s1 plan=[dp1tp1] mb=1 remat=0", "--checkpoint-dir", str(tmp_path / "ckpt")],
        cwd=ROOT, capture_output=True, text=True, timeout=WAIT_S, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stderr.count("cannot write") == 1 and "sees no progress" in proc.stderr
    assert _complete_steps(tmp_path / "ckpt")[-1] == 2


def test_usr1_before_the_first_step_checkpoints_step_0(tmp_path, cache, reference):
    ckpt = tmp_path / "ckpt"
    first = Runner(tmp_path, "early", ckpt, DP4, 4, cache)
    first.wait_for(r"plan .* \(given\)")  # started up, not trained yet
    first.proc.send_signal(signal.SIGUSR1)
    assert first.finish() == 86, first.text()[-3000:]
    assert "checkpointed step 0; exiting 86" in first.text() and not first.losses()
    second = Runner(tmp_path, "after-early", ckpt, DP4, 4, cache, restart_count=1)
    assert second.finish() == 0, second.text()[-3000:]
    assert "resumed from step 0 (checkpoint" in second.text() and "next step 1;" in second.text()
    resumed = second.losses()
    assert sorted(resumed) == list(range(1, ITERATIONS + 1))
    _assert_matches(resumed, reference)


def _config(given: dict, env: dict, alloc, script=None, comment=None):
    from job_scripts.run_config import resolve_config
    from job_scripts.runtime import _elastic_settings
    keys = ("model", "global_batch", "iterations", "plan", "checkpoint_root", "checkpoint_dir",
            "checkpoint_every", "keep", "seed", "devices", "platform", "warmup_steps", "launch",
            "compile_cache", "tune", "tune_budget_s", "tune_budget_frac")
    return resolve_config({k: given.get(k) for k in keys}, env, alloc, _elastic_settings(script, comment),
                          gpu_available=False, require=("model", "iterations"))


def test_config_precedence_flag_env_comment_script(tmp_path):
    from job_scripts.slurm_env import SlurmAllocation

    script = tmp_path / "job.sbatch"
    script.write_text("#!/bin/bash\n#ELASTIC model=gpt-760m global_batch=128 iterations=1000\n")
    alloc = SlurmAllocation(job_id="17", node_names=("a100-1", "a100-2"), gpus_per_node=4,
                            partition="a100", gpu_type="a100", restart_count=1,
                            submit_dir=str(tmp_path / "home"))
    cfg = _config({}, {}, alloc, str(script), comment="elastic global_batch=64")
    assert (cfg.model, cfg.global_batch, cfg.iterations) == ("gpt-760m", 64, 1000)  # comment wins
    assert cfg.num_devices == 8 and cfg.plan_text is None and cfg.platform == "cpu"
    assert cfg.checkpoint_dir == tmp_path / "home" / "checkpoints" / "17"
    assert cfg.compile_cache_dir == str(tmp_path / "home" / "checkpoints" / "jax-cache")
    assert cfg.tune.enabled and cfg.tune.budget_s == 600 and cfg.tune.budget_frac == 0.05
    assert cfg.tune.cache_dir == tmp_path / "home" / "checkpoints" / "tuned-plans"
    env = {"SLURM_EXT_CHECKPOINT_ROOT": str(tmp_path / "shared"),
           "SLURM_EXT_PLAN": "cell=a100x8:s1 plan=[dp8tp1] mb=1 remat=0",
           "SLURM_EXT_TUNE_BUDGET_S": "90", "SLURM_EXT_TUNE": "0"}
    cfg = _config({"global_batch": 32}, env, alloc, str(script), comment="elastic global_batch=64")
    assert cfg.global_batch == 32 and cfg.plan_text == env["SLURM_EXT_PLAN"]
    assert cfg.checkpoint_dir == tmp_path / "shared" / "17"
    assert not cfg.tune.enabled and cfg.tune.budget_s == 90
    # Continuing an earlier job's checkpoints: the report still goes where the daemon reads
    # this job's (ROOT/<job id>/measured.json).
    old = _config({"checkpoint_dir": str(tmp_path / "shared" / "9")}, env, alloc, str(script))
    assert old.checkpoint_dir == tmp_path / "shared" / "9" and old.report_dir == tmp_path / "shared" / "17"
    assert _config({"tune": True, "tune_budget_frac": 0.2}, env, alloc, str(script)).tune.budget_frac == 0.2
    with pytest.raises(SpecError, match="iterations"):
        _config({"model": "gpt-760m", "global_batch": 8}, {}, alloc)
    with pytest.raises(SpecError, match="SLURM_EXT_TUNE_BUDGET_S"):
        _config({}, {"SLURM_EXT_TUNE_BUDGET_S": "ten"}, alloc, str(script))


def test_a_malformed_comment_stops_the_job_unless_the_flags_set_every_setting(tmp_path, caplog):
    from job_scripts.runtime import _elastic_settings

    bad = "elastic global_batch=64 colour=blue"  # the daemon released it to run as submitted
    with pytest.raises(SpecError, match="colour"):
        _elastic_settings(None, bad, {"global_batch": 32, "model": "gpt-760m"}, ("model", "iterations"))
    with pytest.raises(SpecError, match="colour"):
        _elastic_settings(None, bad)
    flags = {"global_batch": 32, "model": "gpt-760m", "iterations": 10}
    with caplog.at_level("WARNING"):
        assert _elastic_settings(None, bad, flags, ("model", "iterations")) == {}
    assert "colour" in caplog.text
    script = tmp_path / "job.sbatch"
    script.write_text("#ELASTIC model gpt-760m\n")
    assert _elastic_settings(str(script), None, flags, ("model", "iterations")) == {}
    with pytest.raises(SpecError, match="cannot read"):  # a script that cannot be read still stops it
        _elastic_settings(str(tmp_path / "missing.sbatch"), None, flags, ("model", "iterations"))
    # A well-formed spec is still read under the flags (they win later, in resolve_config).
    assert _elastic_settings(None, "elastic global_batch=64", flags)["global_batch"] == "64"


@pytest.mark.parametrize("given, env, wrong", [
    ({"global_batch": 0}, {}, "global_batch=0"),  # not the #ELASTIC line's 128
    ({"keep": 0}, {}, "keep=0"),
    ({"devices": 0}, {}, "devices=0"),  # not the 8 GPUs granted
    ({"checkpoint_every": -1}, {}, "checkpoint_every=-1"),
    ({}, {"SLURM_EXT_CHECKPOINT_EVERY": "0.5"}, "SLURM_EXT_CHECKPOINT_EVERY='0.5'"),  # not 0: never
    ({"tune_budget_s": -1.0}, {}, "tune_budget_s=-1.0"),
    ({"tune_budget_frac": -0.1}, {}, "tune_budget_frac=-0.1"),
    ({"seed": -1}, {}, "seed=-1"),  # not at the first batch of data
    ({"seed": 2**32}, {}, "seed=4294967296"),
    ({"seed": 2**31}, {}, "seed=2147483648"),  # accepted, then an OverflowError at the weights' init
    ({"global_batch": 99999999999}, {}, "global_batch=99999999999"),  # the elastic spec's bounds
    ({"iterations": 0}, {}, "iterations=0"),  # trained nothing, exit 0
    ({"iterations": 10**12}, {}, "iterations=1000000000000"),
])
def test_a_zero_or_malformed_flag_is_refused_not_replaced(tmp_path, given, env, wrong):
    from job_scripts.slurm_env import SlurmAllocation

    script = tmp_path / "job.sbatch"
    script.write_text("#ELASTIC model=gpt-760m global_batch=128 iterations=1000\n")
    alloc = SlurmAllocation(job_id="17", node_names=("a100-1", "a100-2"), gpus_per_node=4,
                            partition="a100", gpu_type="a100", restart_count=0)
    with pytest.raises(SpecError) as e:
        _config(given, env, alloc, str(script))
    assert str(e.value).startswith(wrong) and "\n" not in str(e.value)
    # Values that are allowed stay as given.
    cfg = _config({"checkpoint_every": 0, "tune_budget_s": 0.0}, {"SLURM_EXT_CHECKPOINT_EVERY": "5"}, alloc,
                  str(script))
    assert (cfg.checkpoint_every, cfg.tune.budget_s, cfg.keep, cfg.num_devices) == (0, 0.0, 2, 8)
    assert _config({}, {"SLURM_EXT_CHECKPOINT_EVERY": "5"}, alloc, str(script)).checkpoint_every == 5
    # Unset, a script of its own still checkpoints periodically (it never did: a lost
    # node cost everything since the job's last start).
    assert _config({}, {}, alloc, str(script)).checkpoint_every == 50


def _start(ckpt: str, devices: int, env: dict | None = None, **given):
    """A job in a pool worker, whose SIGTERM stays the pool's (a recorder left uninstalled)."""
    from job_scripts import runtime
    return runtime.start(stop=runtime.StopSignal(), env=env or {}, global_batch=16, devices=devices,
                         platform="cpu", checkpoint_dir=ckpt, compile_cache="", **given)


def _meshes(ckpt: str) -> dict:
    from estimator.errors import SpecError
    out = {}
    for tail in ("", " zero=1", " offload=1", " zero=3 offload=1"):
        for stage in ("dp2tp2", "dp4tp1ep"):
            plan = f"cell=a100x4:s1 plan=[{stage}] mb=2 remat=1{tail}"
            try:
                out[plan] = dict(_start(ckpt, 4, plan=plan).mesh().shape)
            except SpecError as e:
                out[plan] = str(e)
    return out


def test_the_mesh_refuses_plans_that_split_states_or_experts(tmp_path):
    from conftest import in_jax_child

    out = in_jax_child(4, _meshes, str(tmp_path))
    plain = "cell=a100x4:s1 plan=[dp2tp2] mb=2 remat=1"
    assert out.pop(plain) == {"dp": 2, "tp": 2}
    for plan, refusal in out.items():
        assert isinstance(refusal, str) and refusal.startswith(f"plan={plan!r}: asks for "), refusal
        assert "\n" not in refusal and "a script with its own model" in refusal
        for token, named in (("zero=", "zero="), ("offload=1", "offload=1"), ("ep]", "ep (experts")):
            assert (token in plan) == (named in refusal), (plan, refusal)


def _batch_that_does_not_split(ckpt: str) -> str:
    from estimator.errors import SpecError
    try:
        _start(ckpt, 3).mesh()  # no plan: 3 devices data-parallel, and 16 samples
    except SpecError as e:
        return str(e)
    return ""


def test_a_global_batch_the_mesh_cannot_split_says_so(tmp_path):
    """It said "plan=None: needs 3 devices (the job has 3) and …": not what was wrong."""
    from conftest import in_jax_child

    refusal = in_jax_child(3, _batch_that_does_not_split, str(tmp_path))
    assert refusal.startswith("global_batch=16: all 3 devices data-parallel") and "= 3, which does not divide" in refusal


def _reports_in_warm_up(ckpt: str) -> list[dict]:
    """Two runs of one job that stop within their warm-up (2 steps): the second is a
    restart under another plan."""
    import jax.numpy as jnp
    reports = []
    for restart, plan, step in ((0, None, 1), (1, "cell=a100x1:s1 plan=[dp1tp1] mb=2 remat=1", 2)):
        job = _start(ckpt, 1, {"SLURM_RESTART_COUNT": str(restart)}, plan=plan, warmup_steps=2)
        job.record_step(step, 1.0, 0.1)
        assert job.finish(step, {"w": jnp.ones(3)}) == 0
        reports.append(json.loads((Path(ckpt) / MEASURED_FILE).read_text()))
    return reports


def _finish_after_a_save(ckpt: str) -> list[int]:
    """A job that saved its last step: finish() makes no state to save again; one that did
    not makes it."""
    import jax.numpy as jnp
    job = _start(ckpt, 1, {}, warmup_steps=0)
    job.record_step(1, 1.0, 0.1)
    job.save(1, {"w": jnp.ones(3)})
    made = []
    assert job.finish(1, lambda: made.append(1) or {"w": jnp.ones(3)}) == 0
    job = _start(ckpt, 1, {"SLURM_RESTART_COUNT": "1"}, warmup_steps=0)  # resumes step 1, trains step 2
    job.record_step(2, 1.0, 0.1)
    assert job.finish(2, lambda: made.append(2) or {"w": jnp.ones(3)}) == 0
    assert job.checkpoints.latest().step == 2
    return made


def _sigterm_during_the_rescale_save(ckpt: str) -> int:
    """USR1 asked for a rescale; a SIGTERM (scancel, the forced requeue) comes while the
    final checkpoint is written."""
    import jax.numpy as jnp
    from job_scripts import runtime
    stop = runtime.StopSignal()
    job = runtime.start(stop=stop, env={}, global_batch=16, devices=1, platform="cpu", checkpoint_dir=ckpt,
                        compile_cache="", warmup_steps=0)
    job.record_step(1, 1.0, 0.1)
    stop.name = "SIGUSR1"
    save = job.save

    def save_then_term(*args, **kw):
        stop.name = "SIGTERM"
        return save(*args, **kw)
    job.save = save_then_term
    return job.finish(1, {"w": jnp.ones(3)})


def test_a_sigterm_during_the_rescale_checkpoint_is_not_downgraded_to_a_requeue(tmp_path):
    from conftest import in_jax_child
    assert in_jax_child(1, _sigterm_during_the_rescale_save, str(tmp_path / "ckpt")) == 143  # not 86


def test_finish_makes_the_arrays_to_save_only_when_the_step_is_not_saved(tmp_path):
    """The runner's save view is a copy of the whole state on the devices: at exit right
    after a periodic save it was made for nothing."""
    from conftest import in_jax_child

    assert in_jax_child(1, _finish_after_a_save, str(tmp_path / "ckpt")) == [2]  # made for the unsaved step only


def test_measured_json_is_written_at_exit_before_any_step_is_timed(tmp_path):
    from conftest import in_jax_child

    first, second = (RunnerReport.from_text(json.dumps(r))
                     for r in in_jax_child(1, _reports_in_warm_up, str(tmp_path / "ckpt")))
    assert (first.restart_count, first.step, first.plan) == (0, 1, None)
    assert first.final_save_s > 0 and first.startup_s is not None
    # No speed before a timed step: left out, not made up.
    assert first.iteration_time_s is None and first.samples_per_s is None and first.steps_measured == 0
    # The restart's own report replaced the earlier run's.
    assert (second.restart_count, second.step) == (1, 2)
    assert second.plan == "cell=a100x1:s1 plan=[dp1tp1] mb=2 remat=1" and second.iteration_time_s is None
    # A script of its own reports its plan's Cell: the daemon takes a speed for that Cell only.
    assert first.cell is None and second.cell == "a100x1:s1"


def test_the_stop_handler_is_installed_before_anything_heavy_is_imported():
    # A SIGUSR1 while the runner imports JAX, Orbax or the estimator must be recorded, not
    # fatal: the first such import must find the handler in place.
    probe = (
        "import importlib.abc, runpy, signal, sys\n"
        "first = []\n"
        "class Probe(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if not first and name.split('.')[0] in ('estimator', 'numpy', 'jax', 'orbax'):\n"
        "            first.append((name, signal.getsignal(signal.SIGUSR1) is signal.SIG_DFL))\n"
        "sys.meta_path.insert(0, Probe())\n"
        "sys.argv = ['job_scripts.run', '--help']\n"
        "try:\n"
        "    runpy.run_module('job_scripts.run', run_name='__main__', alter_sys=True)\n"
        "except SystemExit:\n"
        "    pass\n"
        "print(first, file=sys.stderr)\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "XLA_", "JAX_"))}
    proc = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=WAIT_S)
    assert proc.returncode == 0, proc.stderr[-3000:]
    first = proc.stderr.strip().splitlines()[-1]
    assert first.startswith("[(") and first.endswith(", False)]"), first  # imported, handler in place


@pytest.mark.parametrize("order", [(signal.SIGTERM, signal.SIGUSR1), (signal.SIGUSR1, signal.SIGTERM)])
def test_sigterm_wins_over_sigusr1_whatever_the_order(order):
    from job_scripts.runtime import StopSignal

    before = {s: signal.getsignal(s) for s in order}
    try:
        stop = StopSignal().install()
        for s in order:
            signal.raise_signal(s)
        assert stop.name == "SIGTERM"  # the job ends (143), not a held requeue (86)
    finally:
        for s, handler in before.items():
            signal.signal(s, handler)


def test_the_relaunch_starts_one_task_per_node_whatever_the_job_asked(monkeypatch):
    # sbatch --ntasks=8 leaves SLURM_NTASKS=8, which srun reads as its own count and which
    # outranks --ntasks-per-node: the relaunch names its count.
    from job_scripts import runtime
    from job_scripts.slurm_env import SlurmAllocation

    calls = []
    monkeypatch.setattr(runtime.os, "execvp", lambda file, args: calls.append((file, args)))
    monkeypatch.delenv(runtime.SETTINGS_ENV, raising=False)
    alloc = SlurmAllocation(job_id="7", node_names=("n1", "n2"), gpus_per_node=4, partition="a100",
                            gpu_type="a100", restart_count=0)
    runtime._relaunch_under_srun(alloc, ["python", "-m", "job_scripts.run"], {"model": "gpt-760m"}, None)
    ((file, args),) = calls
    assert file == "srun" and args[:4] == ["srun", "--nodes=2", "--ntasks=2", "--ntasks-per-node=1"]
    assert args[-3:] == ["python", "-m", "job_scripts.run"]


@pytest.mark.parametrize("name, code", [("SIGUSR1", 86), ("SIGTERM", 143)])
def test_a_stop_before_the_relaunch_ends_the_batch_process_instead_of_being_forgotten(monkeypatch, name, code):
    """The exec that starts the tasks would drop a signal the batch process already took:
    a rescale asked for then would be ignored until the daemon forced the requeue."""
    from job_scripts import runtime
    from job_scripts.stop_signal import StopSignal

    calls = []

    class Execed(Exception):
        pass

    def execvp(file, args):  # as exec would, nothing after it runs here
        calls.append((file, args))
        raise Execed
    monkeypatch.setattr(runtime.os, "execvp", execvp)
    monkeypatch.delenv(runtime.SETTINGS_ENV, raising=False)
    env = {"SLURM_JOB_NODELIST": "a100-[1-2]", "SLURM_JOB_NUM_NODES": "2", "SLURM_GPUS_ON_NODE": "2",
           "SLURM_JOB_PARTITION": "a100"}
    stop = StopSignal()
    stop.name = name
    with pytest.raises(SystemExit) as info:
        runtime.start(stop=stop, env=env, model="gpt-760m", global_batch=8, iterations=4, launch="srun",
                      platform="cpu")
    assert info.value.code == code and calls == []
    stop.name = None  # no signal: the tasks are started
    with pytest.raises(Execed):
        runtime.start(stop=stop, env=env, model="gpt-760m", global_batch=8, iterations=4, launch="srun",
                      platform="cpu")
    assert [file for file, _ in calls] == ["srun"]


def test_a_task_on_another_node_takes_the_settings_its_batch_process_read(monkeypatch, tmp_path):
    """Slurm's copy of the batch script (``$0``) is on the batch node only: a task srun
    starts elsewhere finds no file there, and runs on the settings passed to it."""
    from job_scripts import runtime
    from job_scripts.slurm_env import SlurmAllocation

    script = tmp_path / "slurm_script"
    script.write_text("#!/bin/bash\n#ELASTIC model=gpt-760m global_batch=128 iterations=1000\n")
    batch = SlurmAllocation(job_id="7", node_names=("n1", "n2"), gpus_per_node=4, partition="a100",
                            gpu_type="a100", restart_count=0)
    read = runtime._job_settings(str(script), "elastic global_batch=64", {}, (), {}, batch)
    assert read == {"model": "gpt-760m", "global_batch": "64", "iterations": "1000"}
    monkeypatch.setattr(runtime.os, "execvp", lambda file, args: None)
    monkeypatch.delenv(runtime.SETTINGS_ENV, raising=False)
    runtime._relaunch_under_srun(batch, ["python"], read, "   AdminComment=cell=a100x8:s1 plan=[dp8tp1] mb=1 remat=1")
    env = {runtime.SETTINGS_ENV: runtime.os.environ[runtime.SETTINGS_ENV]}
    task = replace(batch, in_step=True, process_id=1, num_processes=2)
    missing = str(tmp_path / "elsewhere" / "slurm_script")
    assert runtime._job_settings(missing, None, {}, (), env, task) == read
    # The job's record too: each task reading it had them start from different plans when
    # one read failed (a busy slurmctld).
    assert runtime._from_batch(env, task)["job_text"].endswith("plan=[dp8tp1] mb=1 remat=1")
    assert runtime._from_batch(env, replace(task, job_id="8")) is None
    with pytest.raises(SpecError, match="cannot read"):  # another job's settings are not taken
        runtime._job_settings(missing, None, {}, (), env, replace(task, job_id="8"))


def test_a_misspelt_setting_of_start_is_refused_not_ignored():
    """``checkpoint_evry=5`` would run with no periodic checkpoints at all."""
    from job_scripts import runtime

    with pytest.raises(SpecError, match=r"checkpoint_evry=5: not a setting of runtime.start\(\)"):
        runtime.start(env={}, global_batch=8, iterations=4, checkpoint_evry=5)


def _plans_after_a_rescale(ckpt: str, given: str = "cell=a100x4:s1 plan=[dp4tp1] mb=1 remat=1",
                           admin_cell: str = "a100x2:s1", partition: str = "a100") -> dict:
    """A job started with a given plan (4 GPUs), then rescaled by the daemon (to 2)."""
    from job_scripts import runtime

    admin = f"requested=any cell={admin_cell} plan=[dp2tp1] mb=1 remat=1 why=shrink"
    runtime.scontrol_job_text = lambda job_id: f"JobId={job_id} JobName=t\n   AdminComment={admin}\n"
    out = {}
    for restarts in (1, 0):
        env = {"SLURM_JOB_ID": "42", "SLURM_RESTART_COUNT": str(restarts), "SLURM_EXT_PLAN": given,
               "SLURM_JOB_PARTITION": partition}
        job = _start(ckpt, 2, env)
        out[restarts] = (job.plan_text, job.plan_source)
    return out


def test_a_given_plan_gives_way_to_the_daemons_after_a_rescale(tmp_path):
    """A plan given for the job's first shape cannot run after the daemon rescaled it:
    the run takes the AdminComment's plan (refusing would fail the job, not requeue it).
    A first run keeps the given plan, whose errors are the user's to see."""
    from conftest import in_jax_child

    out = in_jax_child(2, _plans_after_a_rescale, str(tmp_path / "ckpt"))
    after, first = out[1], out[0]
    assert tuple(after) == ("cell=a100x2:s1 plan=[dp2tp1] mb=1 remat=1", ADMIN_COMMENT_PLAN)
    assert tuple(first) == ("cell=a100x4:s1 plan=[dp4tp1] mb=1 remat=1", "given")
    # Moved to another GPU type with as many GPUs: the a100 plan was sized for a100s, and
    # its report named an a100 Cell the daemon then could not match to the job.
    out = in_jax_child(2, _plans_after_a_rescale, str(tmp_path / "moved"),
                       "cell=a100x2:s1 plan=[dp1tp2] mb=1 remat=1", "a10x2:s1", "a10")
    assert tuple(out[1]) == ("cell=a10x2:s1 plan=[dp2tp1] mb=1 remat=1", ADMIN_COMMENT_PLAN)
    assert tuple(out[0]) == ("cell=a100x2:s1 plan=[dp1tp2] mb=1 remat=1", "given")


def test_an_fp16_model_trains_in_bf16_whose_gradients_do_not_underflow():
    """With the built-in head and loss over 8,192 tokens (the loss a mean over them, as the
    runner's seeds make it), fp16 without loss scaling zeroes a large share of the head's
    weight gradients; bf16 keeps them all, close to fp32's. The runner trains bf16 where
    the tensor cores take it (fp16 with loss scaling elsewhere: tests/test_precision.py)."""
    import jax
    import numpy as np
    from dataclasses import replace

    from estimator import jax_models as jm
    from estimator.models import model_from_dict
    from job_scripts.precision import training_arch

    a32 = jm.arch_from_model(model_from_dict({"name": "g", "hidden": 64, "layers": 1, "heads": 4,
                                              "sequence": 512, "vocab": 8192, "dtype": "fp32"}))
    assert training_arch(replace(a32, compute_dtype="fp16"), "a100").compute_dtype == "bf16"
    assert training_arch(a32, "a100") is a32
    assert training_arch(replace(a32, compute_dtype="bf16"), "a100").compute_dtype == "bf16"
    head = a32.num_layers - 1
    params = jm.init_layer_params(a32, head, jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (16, 512, 64))
    y = jax.random.randint(jax.random.key(2), (16, 512), 0, 8192)

    def weight_grad(dtype):
        arch = replace(a32, compute_dtype=dtype)

        def loss(p):
            out, _ = jm.apply_layer(arch, head, p, {}, x.astype(jm.DTYPES[dtype]))
            return jm.loss_fn(out, y) / 16  # the seed of one of 16 micro-batch shards
        return np.asarray(jax.grad(loss)(params)["w"], np.float64)

    exact, half, brain = weight_grad("fp32"), weight_grad("fp16"), weight_grad("bf16")
    assert np.mean((half == 0) & (exact != 0)) > 0.2  # what fp16 loses
    assert np.mean((brain == 0) & (exact != 0)) == 0.0
    assert np.linalg.norm(brain - exact) / np.linalg.norm(exact) < 0.01


def test_an_fp16_job_keeps_its_loss_scale_across_a_resume_and_a_move_to_bf16_gpus(tmp_path, cache):
    ckpt = tmp_path / "ckpt"
    on_v100 = "cell=v100x2:s1 plan=[dp2tp1] mb=1 remat=1"
    first = Runner(tmp_path, "first", ckpt, on_v100, 2, cache, iterations=3, model=TINY_GPT_FP16)
    assert first.finish() == 0, first.text()[-3000:]
    assert "in fp16 with dynamic loss scaling" in first.text()
    assert _meta(ckpt, 3)["loss_scale"] == {"scale": 2.0**15, "good_steps": 3}
    # Resumed, it counts on from the saved scale's good steps (from 0 it would say 2).
    second = Runner(tmp_path, "second", ckpt, on_v100, 2, cache, iterations=5, model=TINY_GPT_FP16,
                    restart_count=1)
    assert second.finish() == 0, second.text()[-3000:]
    assert "resumed from step 3" in second.text()
    assert _meta(ckpt, 5)["loss_scale"] == {"scale": 2.0**15, "good_steps": 5}
    # Moved to a100s it trains on in bf16 (the fp32 weights are the same), and unscaled.
    third = Runner(tmp_path, "third", ckpt, "cell=a100x2:s1 plan=[dp2tp1] mb=1 remat=1", 2, cache,
                   iterations=6, model=TINY_GPT_FP16, restart_count=2)
    assert third.finish() == 0, third.text()[-3000:]
    assert "resumed from step 5" in third.text() and "in bf16" in third.text()
    assert "loss_scale" not in _meta(ckpt, 6)
    losses = {**first.losses(), **second.losses(), **third.losses()}
    assert sorted(losses) == list(range(1, 7)) and all(math.isfinite(v) for v in losses.values())


def _resumes_of_a_reused_id(root: str) -> dict:
    """Job 77 saves step 3 under the root; later runs with id 77 look for it."""
    import jax.numpy as jnp

    from job_scripts import runtime

    def job(restart_count, **given):
        env = {"SLURM_JOB_ID": "77", "SLURM_RESTART_COUNT": str(restart_count)}
        return runtime.start(stop=runtime.StopSignal(), env=env, global_batch=16, iterations=8, devices=1,
                             platform="cpu", checkpoint_root=root, compile_cache="", **given)

    first = job(0)
    first.save(3, {"w": jnp.ones(4)})
    first.close()
    out = {}
    for name, restart_count, given in (("new job, same id", 0, {}), ("requeued", 1, {}),
                                       ("named outright", 0, {"checkpoint_dir": f"{root}/77"})):
        j = job(restart_count, **given)
        try:
            saved = j.latest()
            out[name] = saved.step if saved else None
        except SpecError as e:
            out[name] = str(e)
        j.close()
    return out


def test_a_first_run_does_not_resume_an_earlier_jobs_checkpoint_of_the_same_id(tmp_path):
    """Slurm reuses job ids once its state is reset: a new job's first run found the old
    job's checkpoint in ROOT/<id>, resumed it, and with as many iterations trained nothing."""
    from conftest import in_jax_child

    out = in_jax_child(1, _resumes_of_a_reused_id, str(tmp_path))
    assert "holds step 3 of an earlier job with id 77" in out["new job, same id"]
    assert "--checkpoint-dir" in out["new job, same id"]
    assert out["requeued"] == 3 and out["named outright"] == 3


def test_the_shared_compile_cache_is_bounded(tmp_path):
    from job_scripts.slurm_env import SlurmAllocation
    alloc = SlurmAllocation(job_id="17", node_names=("a-1",), gpus_per_node=1, partition="a100", gpu_type="a100",
                            restart_count=0, submit_dir=str(tmp_path))
    script = tmp_path / "job.sbatch"
    script.write_text("#!/bin/bash\n#ELASTIC model=gpt-760m global_batch=8 iterations=10\n")
    assert _config({}, {}, alloc, str(script)).compile_cache_max_bytes == 20 * 2**30
    assert _config({}, {"SLURM_EXT_COMPILE_CACHE_MAX_GB": "0"}, alloc, str(script)).compile_cache_max_bytes == -1
    # A bound below a byte is the smallest bound, not none.
    assert _config({}, {"SLURM_EXT_COMPILE_CACHE_MAX_GB": "1e-12"}, alloc, str(script)).compile_cache_max_bytes == 1
    for bad in ("-1", "nan", "inf", "lots"):
        with pytest.raises(SpecError, match="SLURM_EXT_COMPILE_CACHE_MAX_GB"):
            _config({}, {"SLURM_EXT_COMPILE_CACHE_MAX_GB": bad}, alloc, str(script))
    from conftest import in_jax_child
    used = in_jax_child(1, _compile_into_a_bounded_cache, str(tmp_path / "cache"))
    assert 0 < used <= 20_000  # JAX evicted (unbounded: about 60 kB; without filelock it raises)


def _compile_into_a_bounded_cache(cache_dir: str) -> int:
    """Compile ten programs into a 20 kB cache configured as the runtime does; its size."""
    import jax
    import jax.numpy as jnp

    from job_scripts.run_config import RunConfig
    from job_scripts.runtime import _configure_jax
    from job_scripts.slurm_env import SlurmAllocation
    cfg = RunConfig(None, 8, None, None, Path(cache_dir), 0, 1, 0, 1, "gpu", 0, cache_dir, "single",
                    compile_cache_max_bytes=20_000)
    _configure_jax(cfg, SlurmAllocation(None, (), 0, None, None, 0))
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    for k in range(10):
        jax.jit(lambda x, k=k: jnp.sin(x * (k + 1)) @ x.T + k)(jnp.ones((64 + k, 64 + k))).block_until_ready()
    return sum(p.stat().st_size for p in Path(cache_dir).rglob("*") if p.is_file())


def test_the_job_record_is_read_again_when_slurmctld_is_busy(monkeypatch):
    """One failed scontrol lost the Comment (the script's settings ran instead of the
    daemon's); a missing scontrol (no Slurm) is not waited for."""
    import subprocess as sp

    from job_scripts import runtime, slurm_env

    answers = [sp.CalledProcessError(1, "scontrol"), sp.TimeoutExpired("scontrol", 30), "   Comment=elastic"]

    def read(job_id):
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer
    monkeypatch.setattr(slurm_env, "read_job_record", read)
    monkeypatch.setattr(runtime.time, "sleep", lambda s: None)
    assert runtime.scontrol_job_text("7") == "   Comment=elastic" and answers == []
    monkeypatch.setattr(slurm_env, "read_job_record", lambda job_id: (_ for _ in ()).throw(FileNotFoundError(2, "x")))
    assert runtime.scontrol_job_text("7") is None
