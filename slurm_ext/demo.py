"""`make demo`: a real training job rescaled by the daemon because another job arrives.

The scenario, on the local lab cluster (a real slurmctld and one slurmd per fake GPU node:
a100 2×4, v100 2×4, a10 2×2, h100 1×8):

1. Plain jobs of other users hold every node but one a100 node.
2. An elastic job submitted with ``job_scripts/elastic.sbatch`` (the tiny GPT of
   ``tests/fixtures/runner/tiny-gpt.yaml``, global batch 16, asking for 8 GPUs) is planned
   by the daemon onto the 4 free a100 and trains there: the real JAX runner, on one CPU
   fake device per granted GPU.
3. The a10 nodes come free and a second elastic job arrives whose model (4.8 B
   parameters) fits 4 a100 but no count of a10 the lab has.
4. One daemon round moves the first job to 4 a10 to make room: SIGUSR1 → the runner
   finishes its step, checkpoints and exits 86 → Slurm requeues it held → new partition,
   shape and plan → released. It resumes from its checkpoint at the next step with the
   same global batch; the arrival starts on the a100.

:func:`run_rescale_scenario` plays it on any lab (the end-to-end test runs it too) and
returns what happened; :func:`main` starts a lab, narrates the scenario (``slurm-ext
squeue`` before and after, the job's log around the rescale), cancels the jobs and stops
the lab. Exit status 0 when the job was rescaled and resumed at the next step, else 1
with one line saying what did not happen.

Usage: ``python -m slurm_ext.demo [--dir D] [--policy P]``. The Slurm and the backend
are the daemon's (``SLURM_EXT_SLURM_PREFIX=/opt/slurm-25.11 SLURM_EXT_SLURM_BACKEND=pyslurm``
plays it on Slurm 25.11 through pyslurm).
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import shutil
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from estimator.cluster import load_cluster
from estimator.errors import SpecError
from policy.registry import policy_class
from slurm_ext.backend import make_client
from slurm_ext.config import DaemonConfig, resolve
from slurm_ext.daemon import Daemon
from slurm_ext.errors import SlurmExtError
from slurm_ext.lab import LabCluster, find_free_base_port, poll
from slurm_ext.run import run_command
from slurm_ext.slurm_client import SlurmClient, SlurmJob, SubmitRequest
from slurm_ext.slurm_install import install_from_env
from slurm_ext.store import Store

log = logging.getLogger(__name__)

REPO = Path(__file__).resolve().parent.parent
ELASTIC_SBATCH = REPO / "job_scripts" / "elastic.sbatch"
RUNNER_MODELS = REPO / "tests" / "fixtures" / "runner"
TRAIN_MODEL = RUNNER_MODELS / "tiny-gpt.yaml"
ARRIVAL_MODEL = RUNNER_MODELS / "arrival-5b.yaml"
TRAIN_GLOBAL_BATCH = 16
TRAIN_GPUS = 8  # asked for; its Cells have 4, 8 or 16 GPUs, and 4 a100 are free
# The iterations the training job asks for, and the arrival's: what the policy weighs
# (cells-ilp: a Cell worth less than waiting is dropped, and a short arrival is worth
# starting). The training job is fp32, whose layers run at the TF32 rate on an a100 and
# 2.5x slower on an a10: a long one would rather wait than move, and an arrival of
# 100,000 iterations (days) is not worth slowing it down for. Neither finishes in the
# scenario.
TRAIN_ITERATIONS = 20_000
ARRIVAL_ITERATIONS = 200
EXAMPLE_DIR = REPO / "examples" / "charlm"
EXAMPLE_GLOBAL_BATCH = 16
# Plain jobs of other users: (partition, gres per node, nodes). All of the lab but one
# a100 node; the a10 one ends when the arrival comes.
BLOCKERS = (("h100", "gpu:8", 1), ("v100", "gpu:4", 2), ("a10", "gpu:2", 2), ("a100", "gpu:4", 1))
FREED_PARTITION = "a10"
DEFAULT_POLICY = DaemonConfig().policy
# The scenario's jobs live seconds, not hours: cells-ilp's minimum time between two
# changes of one job (30 min by default) would keep the new training job in place.
SCENARIO_POLICY_OPTIONS = {"cells-ilp": {"min_change_interval_s": 0}}
# The arrival waits in the queue (it never trains): only its size matters to the policy.
ARRIVAL_SCRIPT = f"""#!/bin/bash
#ELASTIC model={ARRIVAL_MODEL} global_batch=64 iterations={ARRIVAL_ITERATIONS} gpus=4 gpu_type=a100
trap 'exit 86' USR1
while true; do sleep 0.2 & wait $!; done
"""
STEP_RE = re.compile(r"step (\d+) loss ([0-9.]+)")
SAVED_RE = re.compile(r"SIGUSR1: checkpointed step (\d+); exiting 86")
RESUMED_RE = re.compile(r"resumed from step (\d+) \(checkpoint .*\); next step (\d+); now plan (.*) on (\d+) "
                        r"devices, global batch (\d+)")


class ScenarioError(SlurmExtError):
    """The rescale scenario did not happen as it should (says which part and what was seen)."""


@dataclass(frozen=True)
class ResumeRecord:
    """The rescale as the training job's log tells it.

    Attributes:
        saved_step: the step checkpointed on SIGUSR1.
        resumed_step: the step the restarted runner loaded.
        next_step: the first step it trains.
        plan: its plan after the rescale.
        num_devices: devices it runs on after the rescale.
        global_batch: its global batch after the rescale.
        losses: step → loss of every step logged, before and after the rescale.
    """

    saved_step: int
    resumed_step: int
    next_step: int
    plan: str
    num_devices: int
    global_batch: int
    losses: dict[int, float]

    @property
    def steps_after_resume(self) -> tuple[int, ...]:
        return tuple(s for s in sorted(self.losses) if s > self.resumed_step)


@dataclass(frozen=True)
class RescaleOutcome:
    """What the scenario saw: the jobs, the daemon's actions, the views and the log."""

    train_job_id: int
    arrival_job_id: int
    before: SlurmJob
    after: SlurmJob
    actions: tuple[tuple[str, int], ...]
    squeue_before: str
    squeue_after: str
    log_path: Path
    log_text: str
    resume: ResumeRecord


def parse_resume(log_text: str) -> ResumeRecord | None:
    """The checkpoint on SIGUSR1 and the resume after it, from a job's log; None when the
    log does not (yet) show a checkpoint, a resume and a step after it."""
    saved = SAVED_RE.search(log_text)
    resumed = RESUMED_RE.search(log_text, saved.end()) if saved else None
    if not resumed or not STEP_RE.search(log_text, resumed.end()):
        return None
    losses = {int(s): float(v) for s, v in STEP_RE.findall(log_text)}
    return ResumeRecord(saved_step=int(saved.group(1)), resumed_step=int(resumed.group(1)),
                        next_step=int(resumed.group(2)), plan=resumed.group(3),
                        num_devices=int(resumed.group(4)), global_batch=int(resumed.group(5)),
                        losses=losses)


def log_highlights(log_text: str, steps_around: int = 2) -> list[str]:
    """The lines of a rescaled job's log worth showing: where each run starts and with which
    plan (the AdminComment's, then the one tuned in the allocation), the last steps before
    the checkpoint, the checkpoint, the resume, the next steps."""
    lines = log_text.splitlines()
    saved = next((i for i, line in enumerate(lines) if SAVED_RE.search(line)), len(lines))
    resumed = next((i for i, line in enumerate(lines) if RESUMED_RE.search(line)), len(lines))
    step_idx = [i for i, line in enumerate(lines) if STEP_RE.search(line)]
    keep = set(i for i in step_idx if i < saved)
    keep = set(sorted(keep)[-steps_around:])
    keep |= set([i for i in step_idx if i > resumed][:steps_around])
    for i, line in enumerate(lines):
        if (re.search(r"starting at step|\((given|from the AdminComment|tuned here[^)]*)\)|resumed from step", line)
                or SAVED_RE.search(line) or (i > resumed and "error" in line.lower())):
            keep.add(i)
    return [lines[i] for i in sorted(keep)]


@dataclass(frozen=True)
class TrainingJob:
    """The elastic job the scenario rescales: its batch script, name and global batch."""

    name: str
    script: str
    global_batch: int
    description: str


def _with_elastic_line(path: Path, line: str) -> str:
    """The batch script at ``path`` with its #ELASTIC lines replaced by ``line``."""
    text = re.sub(r"(?m)^#ELASTIC .*\n", "", path.read_text())
    marker = "#SBATCH --gres=gpu:4\n"
    if marker not in text:
        raise ScenarioError(f"{path} has no {marker.strip()!r} line to put #ELASTIC after")
    return text.replace(marker, marker + line + "\n")


def training_script(model: Path = TRAIN_MODEL, global_batch: int = TRAIN_GLOBAL_BATCH,
                    gpus: int = TRAIN_GPUS, iterations: int = TRAIN_ITERATIONS) -> str:
    """``job_scripts/elastic.sbatch`` with its #ELASTIC lines set to train ``model``."""
    return _with_elastic_line(ELASTIC_SBATCH, f"#ELASTIC model={model} global_batch={global_batch} "
                                              f"iterations={iterations} gpus={gpus}")


def builtin_training_job() -> TrainingJob:
    """The built-in runner (job_scripts/elastic.sbatch) training the tiny GPT."""
    return TrainingJob("train-tiny-gpt", training_script(), TRAIN_GLOBAL_BATCH,
                       f"job_scripts/elastic.sbatch training {TRAIN_MODEL.name}")


def example_training_job(global_batch: int = EXAMPLE_GLOBAL_BATCH) -> TrainingJob:
    """A researcher's own script (examples/charlm: flax and optax on a text file), through
    the runtime API; it runs what the API gives (``trainer=api``: single-stage ZeRO-0 plans)."""
    line = (f"#ELASTIC model={EXAMPLE_DIR / 'model.yaml'} global_batch={global_batch} "
            f"iterations={TRAIN_ITERATIONS} gpus={TRAIN_GPUS} trainer=api")
    return TrainingJob("charlm", _with_elastic_line(EXAMPLE_DIR / "train.sbatch", line), global_batch,
                       "examples/charlm/train.sbatch (a byte-level transformer in flax, optax, its own text)")


def squeue_text(env: dict[str, str]) -> str:
    """``slurm-ext squeue`` as a user sees it."""
    return run_command([sys.executable, "-m", "slurm_ext", "squeue"], timeout_s=60, env=env).stdout


def _wait(what: str, probe: Callable[[], object], timeout_s: float, detail: Callable[[], str] = str):
    value = poll(probe, timeout_s)
    if value:
        return value
    raise ScenarioError(f"timed out after {timeout_s:g} s waiting for {what}; last: {value!r}{detail()}")


def _running(client: SlurmClient, job_id: int) -> SlurmJob | None:
    job = client.job(job_id)
    return job if job is not None and job.is_running else None


def _read(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else ""


def run_rescale_scenario(client: SlurmClient, env: dict[str, str], workdir: Path, *,
                         training: TrainingJob | None = None,
                         policy: str = DEFAULT_POLICY, policy_options: dict | None = None,
                         compile_cache: Path | None = None,
                         steps_after_resume: int = 2,
                         say: Callable[[str], None] = lambda text: None) -> RescaleOutcome:
    """Play the scenario of the module docstring on an idle lab; leaves its jobs running.

    Args:
        client: a Slurm client on the lab.
        env: variables for Slurm commands and the daemon (``LabCluster.env()``).
        workdir: where the job logs, checkpoints and the daemon's state go.
        training: the elastic job to rescale (default: the built-in runner's tiny GPT).
        policy: the daemon's policy (default: the daemon's default, cells-ilp). It must
            move a running job to another Cell for an arrival, as cells-ilp and Crius do.
        policy_options: the policy's options; default ``SCENARIO_POLICY_OPTIONS[policy]``.
        compile_cache: JAX's persistent compilation cache for the runner (default: in workdir).
        steps_after_resume: training steps to wait for after the resume.
        say: narration, one paragraph per call.

    Raises:
        ScenarioError: a step did not happen (the message says which and what was seen).
    """
    workdir.mkdir(parents=True, exist_ok=True)
    log_path = workdir / "train.out"
    training = training or builtin_training_job()

    def log_tail() -> str:
        text = _read(log_path)
        return f"\n--- last lines of {log_path} ---\n{text[-2500:]}" if text else ""

    blockers = _start_blockers(client, workdir)
    say("Plain jobs hold every node but one a100 node: "
        + ", ".join(f"{p} job {j}" for p, j in blockers.items()))

    cache = compile_cache or workdir / "jax-cache"
    export = (f"--export=ALL,SLURM_EXT_PYTHON={sys.executable},SLURM_EXT_COMPILE_CACHE={cache},"
              f"SLURM_EXT_CHECKPOINT_ROOT={workdir / 'ckpt'},SLURM_EXT_CHECKPOINT_EVERY=1000")
    train = client.submit(SubmitRequest(
        script=training.script, name=training.name, comment="elastic", output=str(log_path),
        workdir=str(REPO), extra_args=(export,)))
    say(f"Submitted elastic job {train}: {training.description} "
        f"(global batch {training.global_batch}, asks for {TRAIN_GPUS} GPUs).")

    options = SCENARIO_POLICY_OPTIONS.get(policy, {}) if policy_options is None else policy_options
    config = resolve({"state_db": str(workdir / "state.db"), "rescale_timeout_s": 90.0,
                      "policy": policy, "policy_options": options}, {}, {})
    daemon = Daemon(config, client, Store(config.state_db), out=lambda line: None)
    daemon.round()
    before = _wait(f"job {train} to start", lambda: _running(client, train), 30, log_tail)
    say(f"The daemon planned job {train} onto {before.granted_gpus} {before.granted_gpu_type}; "
        "waiting for its first training steps (the first one compiles)...")
    _wait(f"job {train}'s second training step", lambda: re.search(r"step 2 loss", _read(log_path)),
          240, log_tail)

    freed = blockers[FREED_PARTITION]
    client.cancel(freed)
    _wait(f"the {FREED_PARTITION} job to end", lambda: not (j := client.job(freed)) or not j.is_active, 30)
    arrival = client.submit(SubmitRequest(
        script=ARRIVAL_SCRIPT, name="arrival-5b", comment="elastic", output=str(workdir / "arrival.out"),
        workdir=str(workdir)))
    say(f"The {FREED_PARTITION} nodes came free and elastic job {arrival} arrived: "
        f"{ARRIVAL_MODEL.name} (4.8 B parameters) fits 4 a100 but no count of {FREED_PARTITION}.")
    squeue_before = squeue_text(env)

    report = daemon.round()
    if not any(job == train for _, job in report.actions):
        raise ScenarioError(f"the daemon ({policy}) did not rescale job {train} when job {arrival} "
                            f"arrived; its actions: {list(report.actions) or 'none'}")
    # The round signalled the job and went on; the next rounds see it requeued held, then
    # update and release it.
    def rescaled() -> SlurmJob | None:
        daemon.round()
        job = _running(client, train)
        return job if job is not None and job.restart_count > before.restart_count else None

    after = _wait(f"job {train} to run again", rescaled, 90, log_tail)
    if after.restart_count < 1 or (after.granted_gpu_type, after.granted_gpus) == (
            before.granted_gpu_type, before.granted_gpus):
        raise ScenarioError(f"job {train} runs again but was not rescaled: {before.granted_gpus} "
                            f"{before.granted_gpu_type} → {after.granted_gpus} {after.granted_gpu_type}, "
                            f"restart count {after.restart_count}")
    _wait(f"job {arrival} to start", lambda: _running(client, arrival), 60)

    def resumed() -> ResumeRecord | None:
        record = parse_resume(_read(log_path))
        return record if record and len(record.steps_after_resume) >= steps_after_resume else None

    record = _wait(f"job {train} to resume and train {steps_after_resume} steps", resumed, 240, log_tail)
    _check_resume(train, record, training.global_batch)
    return RescaleOutcome(train_job_id=train, arrival_job_id=arrival, before=before, after=after,
                          actions=report.actions, squeue_before=squeue_before,
                          squeue_after=squeue_text(env), log_path=log_path,
                          log_text=_read(log_path), resume=record)


def _start_blockers(client: SlurmClient, workdir: Path) -> dict[str, int]:
    """Plain jobs on every node but one a100 node (``BLOCKERS``), running: partition → job id."""
    blockers = {}
    for partition, gres, nodes in BLOCKERS:
        blockers[partition] = client.submit(SubmitRequest(
            script="#!/bin/bash\nsleep 3600\n", name="blocker", partition=partition, gres=gres,
            nodes=nodes, output=str(workdir / "blocker-%j.out"), workdir=str(workdir)))
    for job_id in blockers.values():
        _wait("the plain jobs to run", lambda j=job_id: _running(client, j), 30)
    return blockers


def _check_resume(job_id: int, record: ResumeRecord, global_batch: int) -> None:
    """The job went on from the step it checkpointed, with its global batch."""
    if record.next_step != record.saved_step + 1 or record.resumed_step != record.saved_step:
        raise ScenarioError(f"job {job_id} checkpointed step {record.saved_step} but resumed from "
                            f"step {record.resumed_step} at step {record.next_step}")
    if record.global_batch != global_batch:
        raise ScenarioError(f"job {job_id} resumed with global batch {record.global_batch}, "
                            f"not {global_batch}")


def _banner(text: str) -> None:
    print(f"\n=== {text} ===", flush=True)


def run_demo(root: Path, policy: str) -> int:
    """Lab up → scenario → what happened → jobs cancelled → lab down. Returns an exit status."""
    lab = LabCluster(root / "lab", base_port=find_free_base_port(load_cluster("lab"), range(17800, 18800, 40)),
                     install=install_from_env(os.environ))
    _banner(f"starting the lab cluster in {lab.paths.root}")
    lab.up()
    try:
        print(lab.status_text(), flush=True)
        config = resolve({}, os.environ, {})
        client = make_client(config.slurm_backend, config.slurm_prefix, env=lab.env())
        outcome = run_rescale_scenario(client, lab.env(), root / "jobs", policy=policy,
                                       say=lambda text: print(f"\n{text}", flush=True))
        _banner("slurm-ext squeue before the daemon's round (the arrival waits)")
        print(outcome.squeue_before, flush=True)
        _banner(f"the daemon's round: {list(outcome.actions)}")
        _banner("slurm-ext squeue after it")
        print(outcome.squeue_after, flush=True)
        b, a, r = outcome.before, outcome.after, outcome.resume
        _banner(f"job {outcome.train_job_id}: {b.granted_gpus} {b.granted_gpu_type} → "
                f"{a.granted_gpus} {a.granted_gpu_type} (restart {a.restart_count}); its log "
                f"({outcome.log_path.name}) around the rescale")
        print("\n".join(log_highlights(outcome.log_text)), flush=True)
        print(f"\nJob {outcome.train_job_id} checkpointed step {r.saved_step} on SIGUSR1 and resumed at "
              f"step {r.next_step} on its {a.granted_gpus} {a.granted_gpu_type} (CPU fake devices here) "
              f"with global batch {r.global_batch}; job {outcome.arrival_job_id} runs on the a100.",
              flush=True)
        return 0
    except ScenarioError as e:
        print(f"demo failed: {e}", file=sys.stderr)
        return 1
    finally:
        _banner("cancelling the jobs and stopping the lab cluster")
        lab.cancel_all_jobs()
        lab.down()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m slurm_ext.demo", description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, default=None,
                        help="working directory, kept afterwards (default: a temporary one, removed)")
    parser.add_argument("--policy", default=DEFAULT_POLICY,
                        help=f"scheduling policy of the daemon (default {DEFAULT_POLICY})")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("slurm_ext.run").setLevel(logging.WARNING)
    try:
        policy_class(args.policy)  # before the lab starts and jobs are submitted
    except SpecError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    root = args.dir or Path(tempfile.mkdtemp(prefix="slurm-ext-demo-"))
    if args.dir is None or not root.exists():  # one it made: readable by the jobs' users
        root.mkdir(parents=True, exist_ok=True)
        root.chmod(0o755)
    try:
        return run_demo(root.resolve(), args.policy)
    except SlurmExtError as e:
        print(f"demo failed: {e}", file=sys.stderr)
        return 1
    finally:
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
