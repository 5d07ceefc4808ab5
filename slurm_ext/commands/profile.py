"""`slurm-ext profile`: measure a partition's devices as a Slurm job, into a profile store.

The job runs ``job_scripts.profile`` once per node under ``srun`` (mpi4py ranks); rank 0
writes the measurements into the store (``estimator.profile_store``, schema in
``docs/profiling.md``), which `slurm-ext estimate --profile-db` and the daemon read. With
``--wait`` this command follows the job, echoing its ``profile:`` progress lines, and
prints what was measured.
"""

from __future__ import annotations

import json
import os
import shlex
import sys
import time
from pathlib import Path

import click

from estimator.errors import SpecError
from slurm_ext.profile_job import MIN_PROFILE_MINUTES

DEFAULT_DB = "slurm-ext-profiles.sqlite"
POLL_S = 2.0
FINISHED_OK = "COMPLETED"


def _follow(client, job_id: int, log_path: Path, quiet: bool) -> tuple[str, dict | None]:
    """Wait for the job, echoing its progress lines; (final state, the done summary)."""
    seen, summary, state, announced = 0, None, "PENDING", None
    while True:
        job = client.job(job_id)
        state = job.state if job is not None else "UNKNOWN"
        if state != announced and not quiet:
            reason = f" ({job.reason})" if job is not None and job.reason and state == "PENDING" else ""
            click.echo(f"job {job_id}: {state.lower()}{reason}", err=True)
            announced = state
        if log_path.is_file():
            # Whole lines only: the job may be writing the last one.
            lines = log_path.read_text(errors="replace").split("\n")[:-1]
            for line in lines[seen:]:
                if line.startswith("profile: done "):
                    summary = json.loads(line[len("profile: done "):])
                elif line.startswith("profile:") and not quiet:
                    click.echo(line, err=True)
            seen = len(lines)
        if job is None or state not in ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING", "REQUEUED",
                                        "SUSPENDED"):
            return state, summary
        time.sleep(POLL_S)


def _measurements(db: str, profile_id: int) -> tuple[list[dict], list[dict], dict]:
    from dataclasses import asdict

    from estimator.profile_store import read_profile
    p = read_profile(db, profile_id)
    compute = [{"kind": "kernel", **asdict(k)} for k in p.kernels] + \
              [{"kind": "layer", **asdict(r)} for r in p.layers]
    return [asdict(c) for c in p.collectives], compute, (asdict(p.efficiency) if p.efficiency else {})


@click.command("profile")
@click.option("--partition", required=True, help="The partition whose GPUs to profile.")
@click.option("--nodes", type=click.IntRange(1), default=1, show_default=True,
              help="Nodes to profile (collectives across nodes need 2 or more).")
@click.option("--model", "models", multiple=True,
              help="Also time one device's share of each layer of this model (repeatable).")
@click.option("--wait", is_flag=True, help="Follow the job until it ends, showing its progress.")
@click.option("--json", "as_json", is_flag=True,
              help='Print {"job_id", "partition", "gpu_type", "nodes", "collectives", "compute", '
                   '"profile_db", ...}; with --wait the measurements as lists, else null.')
@click.option("--profile-db", type=click.Path(dir_okay=False),
              envvar="SLURM_EXT_PROFILE_DB", show_envvar=True, default=DEFAULT_DB, show_default=True,
              help="The profile store (SQLite; created when missing). It must be on a file system "
                   "the job's first node can write.")
@click.option("--samples", type=click.IntRange(1), multiple=True,
              help="Samples per device to time each layer at, once per count (--samples 1 --samples 2 …); "
                   "default 1, 4 and 16 on GPUs, 1 on CPU stand-ins; counts between are interpolated.")
@click.option("--time-limit-min", type=click.IntRange(MIN_PROFILE_MINUTES), default=30, show_default=True,
              help=f"The job's time limit, at least {MIN_PROFILE_MINUTES}. Measuring stops at 80% of it less a "
                   "minute, and what was measured by then (whole tp degrees, tp 1 first) is still fitted "
                   "and stored.")
@click.option("--mpi", default=lambda: os.environ.get("SLURM_EXT_MPI", "pmi2"), show_default="$SLURM_EXT_MPI or pmi2",
              help="srun's --mpi plugin for the MPI mpi4py uses ('none' to leave it out).")
@click.option("--python", "python", default=sys.executable, show_default="this Python",
              help="The Python on the nodes that has slurm-ext installed.")
def command(partition, nodes, models, wait, as_json, profile_db, samples, time_limit_min, mpi, python):
    """Profile a partition's GPUs and network as a Slurm job: collectives within and across
    nodes, calibration kernels from which the GPU type's efficiency is fitted and, for each
    --model, one device's share of each layer (dp-only and tp-only variants). Afterwards
    `slurm-ext estimate --profile-db FILE` prefers these measurements (fidelity: profiled).
    """
    from estimator.models import load_model
    from estimator.profile_store import connect
    from slurm_ext.backend import make_client
    from slurm_ext.config import SLURM_ACCESS_KEYS, load_config
    from slurm_ext.errors import SlurmExtError
    from slurm_ext.profile_job import JOB_NAME, batch_script, measure_budget_s, partition_layout
    from slurm_ext.slurm_client import SubmitRequest

    for m in models:
        load_model(m)  # a clear error now, not in the job's log
    db = str(Path(profile_db).resolve())
    made = not Path(db).exists()
    connect(db, create=True).close()  # likewise a file that is not a store, before minutes of measuring
    cfg = load_config(None, {}, dict(os.environ), only=SLURM_ACCESS_KEYS)
    job_id = None
    try:
        client = make_client(cfg.slurm_backend, cfg.slurm_prefix, cfg.slurm_timeout_s)
        gpu, gpus_per_node, available = partition_layout(client.nodes(), partition, dict(cfg.partitions))
        if nodes > available:
            raise SpecError("nodes", nodes, f"partition {partition} has {available}")
        argv = ["--profile-db", db, "--gpu-type", gpu, "--partition", partition,
                "--budget-s", str(measure_budget_s(time_limit_min))]
        for m in models:
            argv += ["--model", str(Path(m).resolve()) if Path(m).is_file() else m]
        if samples:
            argv += ["--samples", *map(str, samples)]
        log_path = Path.cwd() / "slurm-ext-profile-%j.out"
        request = SubmitRequest(batch_script(python, argv, None if mpi == "none" else mpi),
                                name=JOB_NAME, partition=partition, nodes=nodes,
                                gres=f"gpu:{gpus_per_node}", time_limit_min=time_limit_min,
                                output=str(log_path), requeue=False, extra_args=("--exclusive",))
        job_id = client.submit(request)
        log_path = Path(str(log_path).replace("%j", str(job_id)))
        if not as_json or wait:
            click.echo(f"submitted profiling job {job_id} on {nodes} {gpu} node(s) of {partition}; "
                       f"log {log_path}", err=True)
        out = {"job_id": job_id, "partition": partition, "gpu_type": gpu, "nodes": nodes,
               "gpus_per_node": gpus_per_node, "collectives": None, "compute": None, "profile_db": db,
               "log": str(log_path)}
        if wait:
            state, summary = _follow(client, job_id, log_path, quiet=False)
            if state != FINISHED_OK or summary is None:
                tail = log_path.read_text(errors="replace").splitlines()[-5:] if log_path.is_file() else []
                raise click.ClickException(f"profiling job {job_id} ended {state}; its log {log_path} "
                                           f"ends: {' | '.join(tail) or '(empty)'}")
            out["collectives"], out["compute"], out["efficiency"] = _measurements(db, summary["profile_id"])
            out["profile_id"] = summary["profile_id"]
            out["seconds"] = summary["seconds"]
    except SlurmExtError as e:
        raise click.ClickException(str(e)) from None
    finally:
        if made and job_id is None:
            Path(db).unlink(missing_ok=True)  # nothing was submitted: leave no empty store behind
    if as_json:
        click.echo(json.dumps(out, indent=1))
    elif wait:
        click.echo(f"profile {out['profile_id']} of {gpu} in {db}: {len(out['collectives'])} collectives, "
                   f"{len(out['compute'])} compute measurements, {out['seconds']} s; "
                   f"use it with `slurm-ext estimate --profile-db {shlex.quote(db)}`")
    else:
        click.echo(job_id)
