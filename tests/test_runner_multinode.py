"""The runner as a 2-node job: two processes joined by jax.distributed on CPU devices.

Two runner processes start with the variables ``srun --nodes=2 --ntasks-per-node=1`` sets
in each task of a job on ``a100-[1-2]`` with 2 GPUs per node (the lab's node names, which
do not resolve, so the coordinator is SLURM_LAUNCH_NODE_IPADDR, here 127.0.0.1). Each
fakes its node's 2 devices; together they train the tiny GPT under a data-parallel plan
over all 4 devices (cross-process all-reduce through gloo), then both get SIGUSR1, agree
to stop after the same step and exit 86 with one checkpoint. A single process on 4
devices is the reference: same steps, same losses. Then one process (the job rescaled to
one node) resumes from the 2-process checkpoint at the next step, still matching it.

The lab test does it for real: a 2-node job whose batch process execs ``srun``, one
runner per node, SIGUSR1 through ``scancel --signal=USR1 --batch``, requeued held.
"""

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TINY_GPT = ROOT / "tests" / "fixtures" / "runner" / "tiny-gpt.yaml"
GLOBAL_BATCH = 16
ITERATIONS = 4  # steps both processes take at least before SIGUSR1
REFERENCE_ITERATIONS = 10
PLAN = "cell=a100x4:s1 plan=[dp4tp1] mb=4 remat=1"
LOSS_RTOL = 1e-4
WAIT_S = 120
_STEP = re.compile(r"step (\d+) loss ([0-9.]+)")


def _free_job_id() -> int:
    """A job id whose coordinator port (20000 + id) is free now."""
    from job_scripts.slurm_env import coordinator_port
    for job_id in range(4000 + os.getpid() % 9000, 20000):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", coordinator_port(str(job_id))))
                return job_id
            except OSError:
                continue
    pytest.skip("no free port for the coordinator")


def _task_env(job_id: int, rank: int) -> dict[str, str]:
    """What srun sets in task ``rank`` of a 2-node, 1-task-per-node step (and what it inherits)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "XLA_", "JAX_"))}
    env.update({
        "SLURM_JOB_ID": str(job_id), "SLURM_JOBID": str(job_id),
        "SLURM_JOB_NODELIST": "a100-[1-2]", "SLURM_NODELIST": "a100-[1-2]",
        "SLURM_JOB_NUM_NODES": "2", "SLURM_NNODES": "2", "SLURM_JOB_PARTITION": "a100",
        "SLURM_GPUS_ON_NODE": "2", "SLURM_JOB_GPUS": "0,1",
        "SLURM_STEP_ID": "0", "SLURM_STEPID": "0", "SLURM_STEP_NODELIST": "a100-[1-2]",
        "SLURM_STEP_NUM_NODES": "2", "SLURM_STEP_NUM_TASKS": "2", "SLURM_NTASKS": "2",
        "SLURM_NPROCS": "2", "SLURM_TASKS_PER_NODE": "1(x2)", "SLURM_PROCID": str(rank),
        "SLURM_NODEID": str(rank), "SLURM_LOCALID": "0", "SLURMD_NODENAME": f"a100-{rank + 1}",
        "SLURM_LAUNCH_NODE_IPADDR": "127.0.0.1", "SLURM_SUBMIT_DIR": str(ROOT),
    })
    return env


def _runner_argv(ckpt: Path, cache: Path, devices: int | None, iterations: int) -> list[str]:
    return [sys.executable, "-m", "job_scripts.run", "--model", str(TINY_GPT),
            "--global-batch", str(GLOBAL_BATCH), "--iterations", str(iterations), "--plan", PLAN,
            *(("--devices", str(devices)) if devices else ()), "--platform", "cpu",
            "--checkpoint-dir", str(ckpt), "--compile-cache", str(cache), "--warmup-steps", "1"]


def _losses(text: str) -> dict[int, float]:
    return {int(s): float(v) for s, v in _STEP.findall(text)}


def _wait_all(procs: list[subprocess.Popen], logs: list[Path]) -> list[int]:
    try:
        return [p.wait(WAIT_S) for p in procs]
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        pytest.fail("runner did not exit:\n" + "\n".join(log.read_text()[-2000:] for log in logs))


def test_two_processes_join_jax_distributed_and_train_like_one(tmp_path, tmp_path_factory):
    cache = tmp_path_factory.getbasetemp() / "runner-jax-cache"
    cache.mkdir(exist_ok=True)
    ref_log = tmp_path / "single.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "XLA_", "JAX_"))}
    with open(ref_log, "w") as out:
        reference = subprocess.Popen(_runner_argv(tmp_path / "single", cache, 4, REFERENCE_ITERATIONS),
                                     cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)

    job_id = _free_job_id()
    logs = [tmp_path / f"task{rank}.log" for rank in range(2)]
    procs = []
    for rank, log_path in enumerate(logs):
        with open(log_path, "w") as out:
            # Far more iterations than it will run: SIGUSR1 ends it.
            procs.append(subprocess.Popen(_runner_argv(tmp_path / "ckpt", cache, None, 10_000),
                                          cwd=ROOT, env=_task_env(job_id, rank), stdout=out,
                                          stderr=subprocess.STDOUT))
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline and not all(
            f"step {ITERATIONS} loss" in p.read_text() for p in logs):
        if any(p.poll() is not None for p in procs):
            break
        time.sleep(0.1)
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGUSR1)
    codes = _wait_all(procs, logs)
    texts = [p.read_text() for p in logs]
    assert codes == [86, 86], "\n".join(t[-3000:] for t in texts)

    for rank, text in enumerate(texts):
        assert re.search(rf"jax.distributed: process {rank} of 2 \(coordinator 127\.0\.0\.1:"
                         rf"{20000 + job_id}\), 2 local and 4 global devices", text), text[-3000:]
    # Both took the same steps with the same losses and stopped after the same one.
    steps = [_losses(t) for t in texts]
    assert steps[0] == steps[1] and len(steps[0]) >= ITERATIONS
    saved = [int(re.search(r"SIGUSR1: checkpointed step (\d+); exiting 86", t).group(1)) for t in texts]
    assert saved[0] == saved[1] == max(steps[0])
    # Process 0 alone writes the checkpoint, which holds the full (unsharded) state.
    assert (tmp_path / "ckpt" / f"ckpt-{saved[0]:08d}.json").exists()
    assert "checkpoint step" not in texts[1]

    assert _wait_all([reference], [ref_log]) == [0], ref_log.read_text()[-3000:]
    single = _losses(ref_log.read_text())
    assert sorted(single) == list(range(1, REFERENCE_ITERATIONS + 1))
    for step, loss in steps[0].items():
        assert loss == pytest.approx(single[step], rel=LOSS_RTOL), (step, loss, single[step])

    # Rescaled to one node: one process on 4 devices resumes from the 2-process checkpoint.
    resume_log = tmp_path / "resumed.log"
    with open(resume_log, "w") as out:
        resumed = subprocess.Popen(_runner_argv(tmp_path / "ckpt", cache, 4, saved[0] + 2),
                                   cwd=ROOT, env={**env, "SLURM_RESTART_COUNT": "1"}, stdout=out,
                                   stderr=subprocess.STDOUT)
    assert _wait_all([resumed], [resume_log]) == [0], resume_log.read_text()[-3000:]
    text = resume_log.read_text()
    assert f"resumed from step {saved[0]} (checkpoint" in text and f"next step {saved[0] + 1};" in text
    after = _losses(text)
    assert sorted(after) == [saved[0] + 1, saved[0] + 2]
    for step, loss in after.items():
        assert loss == pytest.approx(single[step], rel=LOSS_RTOL), (step, loss, single[step])


def test_coordinator_address_first_node_launch_host_or_override():
    from estimator.errors import SpecError
    from job_scripts.slurm_env import allocation_from_env, coordinator_address

    alloc = allocation_from_env(_task_env(17, 1))
    assert alloc.launch_host == "127.0.0.1" and alloc.process_id == 1 and alloc.num_processes == 2
    assert coordinator_address(alloc, None, first_node_resolves=True) == "a100-1:20017"
    assert coordinator_address(alloc, None, first_node_resolves=False) == "127.0.0.1:20017"
    assert coordinator_address(alloc, "head:1234", first_node_resolves=True) == "head:1234"
    assert coordinator_address(alloc, "head", first_node_resolves=True) == "head:20017"
    with pytest.raises(SpecError, match="SLURM_EXT_COORDINATOR"):
        coordinator_address(alloc, "head:port", first_node_resolves=True)
    batch = allocation_from_env({**_task_env(17, 0), "SLURM_STEP_ID": "batch"})
    assert batch.launch_host is None
    with pytest.raises(SpecError, match="SLURM_EXT_COORDINATOR=host:port"):
        coordinator_address(batch, None, first_node_resolves=False)


@pytest.mark.slurm
def test_two_node_lab_job_runs_one_runner_per_node_through_srun(slurm_lab, slurm_client, tmp_path,
                                                                tmp_path_factory):
    """The same on the real lab: a 2-node a10 job (2 GPUs per node) whose batch process
    execs ``srun`` (``SLURM_EXT_LAUNCH=srun``); srun forwards the daemon's SIGUSR1."""
    from conftest import wait_for

    from slurm_ext.run import run_command
    from slurm_ext.slurm_client import SubmitRequest

    cache = tmp_path_factory.getbasetemp() / "runner-jax-cache"
    script = (ROOT / "job_scripts" / "elastic.sbatch").read_text()
    script = re.sub(r"(?m)^#SBATCH --(comment|nodes|gres).*\n", "", script)
    script = re.sub(r"(?m)^#ELASTIC .*\n", "", script).replace(
        "set -euo pipefail", f"#ELASTIC model={TINY_GPT} global_batch={GLOBAL_BATCH} iterations=10000\n"
                             "set -euo pipefail")
    log_path = tmp_path / "job.out"
    export = (f"--export=ALL,SLURM_EXT_PYTHON={sys.executable},SLURM_EXT_LAUNCH=srun,"
              f"SLURM_EXT_PLAN={PLAN},SLURM_EXT_COMPILE_CACHE={cache},"
              f"SLURM_EXT_CHECKPOINT_ROOT={tmp_path / 'ckpt'}")
    job = slurm_client.submit(SubmitRequest(
        script=script, name="two-nodes", partition="a10", nodes=2, gres="gpu:2", output=str(log_path),
        workdir=str(ROOT), extra_args=(export, "--requeue")))

    def both_trained():
        text = log_path.read_text() if log_path.exists() else ""
        return text if len(re.findall(r"step 2 loss", text)) == 2 else None

    wait_for("both tasks' second step", both_trained, 120)
    run_command(["scancel", "--signal=USR1", "--batch", str(job)], timeout_s=10, env=slurm_lab.env())
    # Exit 86 of srun's tasks is srun's: Slurm requeues the job held, as for a rescale.
    held = wait_for("the job to be requeued held", lambda: (j := slurm_client.job(job)) and j.is_held and j, 60)
    assert held.restart_count == 1
    # Process 0 writes the checkpoint after the last collective; srun may then end
    # process 1 (--kill-on-bad-exit) before it logs its own line, which is harmless.
    text = log_path.read_text()
    for rank in range(2):
        assert re.search(rf"jax.distributed: process {rank} of 2 \(coordinator [^)]*\), 2 local and "
                         rf"4 global devices", text), text[-3000:]
    saved = {int(s) for s in re.findall(r"SIGUSR1: checkpointed step (\d+); exiting 86", text)}
    assert len(saved) == 1, text[-3000:]  # both stopped after the same step
    by_step: dict[int, set[float]] = {}
    for s, v in _STEP.findall(text):
        by_step.setdefault(int(s), set()).add(float(v))
    # Each step was logged by both processes with the same loss.
    assert sorted(by_step) == list(range(1, max(saved) + 1))
    assert all(len(v) == 1 for v in by_step.values()), by_step
    assert (tmp_path / "ckpt" / str(job) / f"ckpt-{max(saved):08d}.json").exists()


def test_multi_process_jobs_refuse_pipeline_plans():
    """Stages on devices of different processes cannot hand activations over (JAX 0.10
    refuses cross-host device_put): a multi-process job needs a one-stage plan."""
    from estimator import jax_models as jm
    from estimator.errors import SpecError
    from estimator.models import load_model
    from job_scripts.run import _parser, _plan_from_text, resolve_config
    from job_scripts.slurm_env import allocation_from_env

    alloc = allocation_from_env(_task_env(17, 0))
    args = _parser().parse_args(["--model", str(TINY_GPT), "--global-batch", str(GLOBAL_BATCH),
                                 "--iterations", "4", "--platform", "cpu", "--checkpoint-dir", "/nonexistent"])
    cfg = resolve_config(args, {}, alloc)
    assert cfg.num_devices == 4 and cfg.launch == "single"  # CPU: srun only when asked
    model = load_model(str(TINY_GPT))
    arch = jm.arch_from_model(model)
    pipeline = "cell=a100x4:s2 plan=[dp2tp1|dp2tp1] mb=4 remat=1"
    with pytest.raises(SpecError, match="2 pipeline stages; a job of 2 processes"):
        _plan_from_text(pipeline, model, arch, cfg, 2, num_processes=2)
    assert _plan_from_text(pipeline, model, arch, cfg, 2, num_processes=1)[1].startswith("cell=a100x4:s2")
    assert _plan_from_text(PLAN, model, arch, cfg, 2, num_processes=2)[1] == PLAN
