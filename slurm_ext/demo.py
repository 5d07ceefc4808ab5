"""`make demo`: the whole service on a local lab cluster, start to finish.

1. Start the lab (a real slurmctld and one slurmd per fake GPU node: a100, v100, a10, h100).
2. Submit elastic jobs of different models and sizes (one with a typed ``--gres``, one
   with a bad spec) and one plain job.
3. Run the daemon for a few rounds, then end the plain job so its GPUs come free and run
   one more round (a running elastic job may be rescaled through the requeue protocol).
4. Print ``slurm-ext squeue``: each elastic job's GPU type, count, stages, plan and why.
5. Stop the lab, always, even after an error.

The jobs run a minimal batch script written into the lab directory: it sleeps, and on
SIGUSR1 exits 86 so Slurm requeues it held for the rescale, as a real trainer does after
its checkpoint. The built-in models are far too large to train on the lab's CPU-backed
fake GPUs; ``--script`` submits another script (e.g. one running a small model YAML).

Usage: ``python -m slurm_ext.demo [--dir D] [--rounds N] [--policy P] [--script FILE]``.
"""

from __future__ import annotations

import argparse
import logging
import shutil
import sys
import tempfile
import time
from pathlib import Path

from estimator.cluster import load_cluster
from slurm_ext.cli_backend import CliSlurmClient
from slurm_ext.config import resolve
from slurm_ext.daemon import Daemon
from slurm_ext.errors import SlurmExtError
from slurm_ext.lab import LabCluster, find_free_base_port
from slurm_ext.run import run_command
from slurm_ext.slurm_client import SubmitRequest
from slurm_ext.store import Store

log = logging.getLogger(__name__)

DEMO_SCRIPT = """#!/bin/bash
#SBATCH --requeue
#SBATCH --open-mode=append
#ELASTIC global_batch=64 iterations=1000000
# A stand-in for the trainer: runs until told to rescale (SIGUSR1), then asks Slurm to
# requeue it held (exit 86) as a trainer does after writing its checkpoint.
echo "start restart=${SLURM_RESTART_COUNT:-0} partition=$SLURM_JOB_PARTITION gpus_per_node=${SLURM_GPUS_ON_NODE:-?} nodes=$SLURM_JOB_NUM_NODES"
trap 'echo "checkpoint, exit 86"; exit 86' USR1
while true; do sleep 1 & wait $!; done
"""

# (name, comment, sbatch request). The comment marks a job elastic (the plain job has
# none) and its settings override the script's #ELASTIC line.
JOBS = (
    ("plain", None, {"partition": "v100", "gres": "gpu:v100:2"}),
    ("gpt-1.3b", "elastic model=gpt-1.3b", {}),
    ("gpt-6.7b-typed", "elastic model=gpt-6.7b global_batch=32", {"gres": "gpu:a100:4", "nodes": 2}),
    ("moe-1.3b", "elastic model=moe-1.3b gpus=2", {}),
    ("wresnet-1b", "elastic model=wide_resnet-1b gpus=4 gpu_type=v100 global_batch=256", {}),
    ("bad-spec", "elastic model=gpt-13b", {"partition": "a10", "gres": "gpu:1"}),
)


def _banner(text: str) -> None:
    print(f"\n=== {text} ===", flush=True)


def _squeue(lab: LabCluster) -> None:
    out = run_command([sys.executable, "-m", "slurm_ext", "squeue"], timeout_s=60, env=lab.env())
    print(out.stdout, flush=True)


def _wait_started(client: CliSlurmClient, job_ids: list[int], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        jobs = {j.job_id: j for j in client.jobs()}
        if all(jobs.get(i) is None or jobs[i].state != "PENDING" or jobs[i].is_held for i in job_ids):
            return
        time.sleep(0.5)


def run_demo(root: Path, rounds: int, policy: str, script_path: Path | None) -> int:
    """Lab up → submit → daemon rounds → squeue view → lab down. Returns an exit status."""
    lab = LabCluster(root / "lab", base_port=find_free_base_port(load_cluster("lab"), range(17800, 18800, 40)))
    _banner(f"starting the lab cluster in {lab.paths.root}")
    lab.up()
    try:
        print(lab.status_text(), flush=True)
        client = CliSlurmClient(env=lab.env())
        script = script_path.read_text() if script_path else DEMO_SCRIPT
        (root / "elastic-demo.sbatch").write_text(script)
        _banner("submitting jobs")
        ids = {}
        for name, comment, extra in JOBS:
            ids[name] = client.submit(SubmitRequest(
                script=script, name=name, comment=comment, output=str(root / f"{name}-%j.out"),
                workdir=str(root), **extra))
            print(f"job {ids[name]:>3}  {name:<15} comment={comment!r} {extra}", flush=True)
            if comment is None:  # let Slurm start the plain job first, as on a busy cluster
                _wait_started(client, [ids[name]])
        _squeue(lab)
        config = resolve({"state_db": str(root / "state.db"), "policy": policy,
                          "rescale_timeout_s": 20.0}, {}, {})
        daemon = Daemon(config, client, Store(config.state_db), env=lab.env())
        for i in range(rounds):
            _banner(f"daemon round {i + 1}")
            report = daemon.round()
            print(f"actions: {list(report.actions) or 'none'}; {report.total_s:.2f} s", flush=True)
            _wait_started(client, list(ids.values()))
        _banner("the plain job ends; its 2 v100 GPUs come free")
        client.cancel(ids["plain"])
        time.sleep(2)
        report = daemon.round()
        print(f"actions: {list(report.actions) or 'none'}", flush=True)
        _wait_started(client, list(ids.values()))
        time.sleep(1)
        _banner("slurm-ext squeue")
        _squeue(lab)
        for out in sorted(root.glob("*.out")):
            text = out.read_text(errors="replace")
            if "checkpoint" in text:  # a job the daemon rescaled: its two runs
                _banner(f"output of a rescaled job ({out.name})")
                print(text, flush=True)
        return 0
    finally:
        _banner("stopping the lab cluster")
        lab.down()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m slurm_ext.demo", description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, default=None,
                        help="working directory, kept afterwards (default: a temporary one, removed)")
    parser.add_argument("--rounds", type=int, default=3, help="daemon rounds before the plain job ends")
    parser.add_argument("--policy", default="crius", help="scheduling policy")
    parser.add_argument("--script", type=Path, default=None, help="batch script to submit instead of the stand-in")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("slurm_ext.run").setLevel(logging.WARNING)
    root = args.dir or Path(tempfile.mkdtemp(prefix="slurm-ext-demo-"))
    root.mkdir(parents=True, exist_ok=True)
    root.chmod(0o755)
    try:
        return run_demo(root.resolve(), args.rounds, args.policy, args.script)
    except SlurmExtError as e:
        print(f"demo failed: {e}", file=sys.stderr)
        return 1
    finally:
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
