"""The runner as a 2-node job: two processes joined by jax.distributed on CPU devices.

Two runner processes start with the variables ``srun --nodes=2 --ntasks-per-node=1`` sets
in each task of a job on ``a100-[1-2]`` with 2 GPUs per node (the lab's node names, which
do not resolve, so the coordinator is SLURM_LAUNCH_NODE_IPADDR, here 127.0.0.1). Each
fakes its node's 2 devices; together they train a two-stage plan whose stages sit one
on each process, so micro-batches cross between the processes (collective permutes over
gloo), then both get SIGUSR1, agree to stop after the same step and exit 86, each
having written its own stage's shards. A single process on 4 devices is the reference:
same steps, same losses. Then one process (the job rescaled to one node) resumes under a
tensor-parallel plan at the next step, still matching.

The lab test does it for real, as the daemon would: a 2-node job trains the 2-stage plan
of its AdminComment across the nodes (its batch process execs ``srun``, one runner per
node), gets SIGUSR1 through ``scancel --signal=USR1 --batch``, is requeued held, updated to
one node and another plan, released, and resumes at the next step with the losses of an
uninterrupted run of the new plan.
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

from estimator.contract import EXIT_RESCALE, EXIT_TERMINATED

ROOT = Path(__file__).resolve().parent.parent
TINY_GPT = ROOT / "tests" / "fixtures" / "runner" / "tiny-gpt.yaml"
GLOBAL_BATCH = 16
ITERATIONS = 4  # steps both processes take at least before SIGUSR1
REFERENCE_ITERATIONS = 10
PLAN = "cell=a100x4:s2 plan=[dp2tp1|dp1tp2] mb=4 remat=1"  # stage 0 on process 0, stage 1 on 1
RESUME_PLAN = "cell=a100x4:s1 plan=[dp1tp4] mb=2 remat=0"
# ZeRO-3 over both processes: every layer's gather and reduce-scatter crosses them, and
# each process saves its devices' chunks of every layer's weights.
ZERO3_PLAN = "cell=a100x4:s1 plan=[dp4tp1] mb=4 remat=1 zero=3"
LOSS_RTOL = 1e-4
WAIT_S = 120
_STEP = re.compile(r"step (\d+) loss ([0-9.]+)")


def _free_job_id() -> int:
    """A job id whose coordinator port (20000 + id, below 32000) is free now."""
    from job_scripts.slurm_env import coordinator_port
    for job_id in range(4000 + os.getpid() % 7000, 12000):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", coordinator_port(str(job_id))))
                return job_id
            except OSError:
                continue
    pytest.skip("no free port for the coordinator")


def _task_env(job_id: int, rank: int, submit_dir: Path = ROOT) -> dict[str, str]:
    """What srun sets in task ``rank`` of a 2-node, 1-task-per-node step (and what it
    inherits), submitted from ``submit_dir`` (where the runner keeps what it measured)."""
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
        "SLURM_LAUNCH_NODE_IPADDR": "127.0.0.1", "SLURM_SUBMIT_DIR": str(submit_dir),
    })
    return env


def _runner_argv(ckpt: Path, cache: Path, devices: int | None, iterations: int, plan: str = PLAN) -> list[str]:
    return [sys.executable, "-m", "job_scripts.run", "--model", str(TINY_GPT),
            "--global-batch", str(GLOBAL_BATCH), "--iterations", str(iterations), "--plan", plan,
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


# SIGTERM (scancel, the time limit) must reach the runner in every process: JAX's
# preemption service would otherwise take it, and the job would train on until killed.
@pytest.mark.parametrize("plan, stop", [(PLAN, signal.SIGUSR1), (ZERO3_PLAN, signal.SIGTERM)],
                         ids=["usr1-pipeline", "term-zero3"])
def test_two_processes_join_jax_distributed_and_train_like_one(tmp_path, tmp_path_factory, plan, stop):
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
            # Far more iterations than it will run: the signal ends it.
            procs.append(subprocess.Popen(_runner_argv(tmp_path / "ckpt", cache, None, 10_000, plan),
                                          cwd=ROOT, env=_task_env(job_id, rank, tmp_path), stdout=out,
                                          stderr=subprocess.STDOUT))
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline and not all(
            f"step {ITERATIONS} loss" in p.read_text() for p in logs):
        if any(p.poll() is not None for p in procs):
            break
        time.sleep(0.1)
    for p in procs:
        if p.poll() is None:
            p.send_signal(stop)
    codes = _wait_all(procs, logs)
    texts = [p.read_text() for p in logs]
    code = EXIT_RESCALE if stop == signal.SIGUSR1 else EXIT_TERMINATED
    assert codes == [code, code], "\n".join(t[-3000:] for t in texts)

    for rank, text in enumerate(texts):
        assert re.search(rf"jax.distributed: process {rank} of 2 \(coordinator 127\.0\.0\.1:"
                         rf"{20000 + job_id}\), 2 local and 4 global devices", text), text[-3000:]
    # Both took the same steps with the same losses and stopped after the same one.
    steps = [_losses(t) for t in texts]
    assert steps[0] == steps[1] and len(steps[0]) >= ITERATIONS
    saved = [int(re.search(rf"{stop.name}: checkpointed step (\d+); exiting {code}", t).group(1)) for t in texts]
    assert saved[0] == saved[1] == max(steps[0])
    # One checkpoint, to which each process wrote its own stage's shards.
    arrays = tmp_path / "ckpt" / str(saved[0]) / "arrays"
    assert sorted(p.name for p in arrays.iterdir() if p.name.startswith("ocdbt.process_")) == \
        ["ocdbt.process_0", "ocdbt.process_1"]

    assert _wait_all([reference], [ref_log]) == [0], ref_log.read_text()[-3000:]
    single = _losses(ref_log.read_text())
    assert sorted(single) == list(range(1, REFERENCE_ITERATIONS + 1))
    for step, loss in steps[0].items():
        assert loss == pytest.approx(single[step], rel=LOSS_RTOL), (step, loss, single[step])

    # Rescaled to one node: one process on 4 devices, tensor parallel, resumes from the
    # checkpoint the two processes wrote.
    resume_log = tmp_path / "resumed.log"
    with open(resume_log, "w") as out:
        resumed = subprocess.Popen(_runner_argv(tmp_path / "ckpt", cache, 4, saved[0] + 2, RESUME_PLAN),
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
    # Below Linux's ephemeral ports (32768 on), which another process's connection may hold.
    from job_scripts.slurm_env import coordinator_port
    assert coordinator_port("12017") == 20017 and max(coordinator_port(str(j)) for j in range(30000)) < 32768
    # IPv6: Slurm writes the launch host without brackets; a port needs them.
    v6 = allocation_from_env({**_task_env(17, 1), "SLURM_LAUNCH_NODE_IPADDR": "2001:db8::5"})
    assert coordinator_address(v6, None, first_node_resolves=False) == "[2001:db8::5]:20017"
    assert coordinator_address(alloc, "::1", first_node_resolves=True) == "[::1]:20017"
    assert coordinator_address(alloc, "fe80::1%eth0", first_node_resolves=True) == "[fe80::1%eth0]:20017"
    assert coordinator_address(alloc, "[::1]:1234", first_node_resolves=True) == "[::1]:1234"
    assert coordinator_address(alloc, "[::1]", first_node_resolves=True) == "[::1]:20017"
    with pytest.raises(SpecError, match="SLURM_EXT_COORDINATOR"):
        coordinator_address(alloc, "[::1]:port", first_node_resolves=True)
    batch = allocation_from_env({**_task_env(17, 0), "SLURM_STEP_ID": "batch"})
    assert batch.launch_host is None
    with pytest.raises(SpecError, match="SLURM_EXT_COORDINATOR=host:port"):
        coordinator_address(batch, None, first_node_resolves=False)



LAB_PLAN = "cell=a10x4:s2 plan=[dp2tp1|dp1tp2] mb=4 remat=1"  # one stage on each a10 node
LAB_NEW_PLAN = "cell=a10x2:s1 plan=[dp1tp2] mb=2 remat=0"
LAB_RTOL = 1e-3


@pytest.mark.slurm
def test_two_node_lab_job_trains_its_pipeline_across_nodes_and_is_rescaled_to_one(
        slurm_lab, slurm_client, tmp_path, tmp_path_factory):
    """As the daemon does it: the AdminComment's 2-stage plan across 2 a10 nodes, then
    USR1 → exit 86 → requeued held → one node and another plan → released → resumed."""
    from conftest import wait_for

    from slurm_ext.lab import poll
    from slurm_ext.slurm_client import REQUEUE_SETTLE_S, JobUpdate, SubmitRequest

    cache = tmp_path_factory.getbasetemp() / "runner-jax-cache"
    script = (ROOT / "job_scripts" / "elastic.sbatch").read_text()
    script = re.sub(r"(?m)^#SBATCH --(comment|nodes|gres).*\n", "", script)
    script = re.sub(r"(?m)^#ELASTIC .*\n", "", script).replace(
        "set -euo pipefail", f"#ELASTIC model={TINY_GPT} global_batch={GLOBAL_BATCH} iterations=10000\n"
                             "set -euo pipefail")
    log_path = tmp_path / "job.out"
    # SLURM_EXT_TUNE=0: the plans must be exactly the AdminComment's (tuning has its own tests).
    export = (f"--export=ALL,SLURM_EXT_PYTHON={sys.executable},SLURM_EXT_LAUNCH=srun,SLURM_EXT_TUNE=0,"
              f"SLURM_EXT_COMPILE_CACHE={cache},SLURM_EXT_CHECKPOINT_ROOT={tmp_path / 'ckpt'}")
    job = slurm_client.submit(SubmitRequest(
        script=script, name="two-nodes", partition="a10", nodes=2, gres="gpu:2", output=str(log_path),
        workdir=str(ROOT), hold=True, extra_args=(export, "--requeue")))
    slurm_client.update_pending(job, JobUpdate(admin_comment=f"{LAB_PLAN} why=test"))
    slurm_client.release(job)

    def trained(n):
        text = log_path.read_text() if log_path.exists() else ""
        return text if len(re.findall(rf"step {n} loss", text)) == 2 else None

    wait_for("both tasks' second step", lambda: trained(2), 180)
    slurm_client.signal_batch(job, "USR1")
    held = wait_for("the job to be requeued held", lambda: (j := slurm_client.job(job)) and j.is_held and j, 90)
    held_seen_s = time.time()
    assert held.restart_count == 1
    text = log_path.read_text()
    for rank in range(2):
        assert re.search(rf"jax.distributed: process {rank} of 2 \(coordinator [^)]*\), 2 local and "
                         rf"4 global devices", text), text[-3000:]
    assert f"plan {LAB_PLAN} (from the AdminComment)" in text
    saved = {int(s) for s in re.findall(r"SIGUSR1: checkpointed step (\d+); exiting 86", text)}
    assert len(saved) == 1, text[-3000:]  # both stopped after the same step
    saved_step = saved.pop()
    before = {}
    for s, v in _STEP.findall(text):  # each step logged by both processes, with one loss
        assert before.setdefault(int(s), float(v)) == float(v)
    assert sorted(before) == list(range(1, saved_step + 1))

    # The daemon's update: one node, a tensor-parallel plan of 2 GPUs, released (as the
    # daemon does) no sooner than REQUEUE_SETTLE_S after the requeue: a10-1 ran the job.
    time.sleep(max(0.0, held_seen_s + REQUEUE_SETTLE_S - time.time()))
    slurm_client.update_pending(job, JobUpdate(num_nodes=1, gpus_per_node=2,
                                               admin_comment=f"{LAB_NEW_PLAN} why=test"))
    slurm_client.release(job)
    running = poll(lambda: (j := slurm_client.job(job)) and (j.is_running or not j.is_active) and j, 180)
    assert running and running.is_running, f"job {job} did not run again: {running or slurm_client.job(job)}"
    done = wait_for("3 steps after the resume", lambda: (t := log_path.read_text()) and
                    re.search(rf"step {saved_step + 3} loss", t) and t, 180)
    slurm_client.cancel(job)
    after_text = done[done.index(f"plan {LAB_NEW_PLAN} (from the AdminComment)"):]
    assert re.search(rf"resumed from step {saved_step} \(checkpoint .*\); next step {saved_step + 1}; "
                     rf"now plan {re.escape(LAB_NEW_PLAN)} on 2 devices", after_text), after_text[-3000:]
    after = {int(s): float(v) for s, v in _STEP.findall(after_text)}
    assert min(after) == saved_step + 1

    # An uninterrupted run of the new plan, from step 1.
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "XLA_", "JAX_"))}
    ref = subprocess.run(_runner_argv(tmp_path / "reference", cache, 2, saved_step + 3, LAB_NEW_PLAN),
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=WAIT_S)
    assert ref.returncode == 0, ref.stderr[-3000:]
    reference = _losses(ref.stderr)
    for step in range(saved_step + 1, saved_step + 4):
        assert after[step] == pytest.approx(reference[step], rel=LAB_RTOL), (step, after[step], reference[step])
    for step, loss in before.items():  # and before the rescale, the 2-stage plan trained the same model
        assert loss == pytest.approx(reference[step], rel=LAB_RTOL), (step, loss, reference[step])
