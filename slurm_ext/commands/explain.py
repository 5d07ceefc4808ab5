"""`slurm-ext explain JOB [--json]`: a job's Cells, the chosen one and why, its history,
its forecast, and why it waits (``slurm_ext.explain`` documents the JSON keys).

Works for any user: it reads the job's Slurm record, its batch script (its owner and
root may) and the nodes. The rescale history comes from the daemon's journal when the
state file is readable (``--state-db``, else the configuration's ``state_db``).
"""

from __future__ import annotations

import json
import os
import sqlite3
from dataclasses import replace
from pathlib import Path

import click

from slurm_ext.commands import POSITIVE_SECONDS


class JobIdType(click.ParamType):
    """A Slurm job id: digits only (``int`` would read ``1234_5``, an array task, as 12345)."""

    name = "JOB"

    def convert(self, value, param, ctx):
        text = str(value).strip()
        if not text.isdigit() or not text.isascii():
            hint = (": an array task's own job id is in `squeue -r --Format JobID`" if "_" in text else "")
            self.fail(f"{value!r} is not a job id{hint}", param, ctx)
        return int(text)


@click.command("explain")
@click.argument("job_id", type=JobIdType())
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object (keys in slurm_ext.explain).")
@click.option("--config", "config_path", type=click.Path(dir_okay=False),
              help="The daemon's configuration (partitions, cluster, plan space); default: $SLURM_EXT_CONFIG.")
@click.option("--state-db", help="The daemon's state file, for the job's history (read only).")
@click.option("--timeout-s", type=POSITIVE_SECONDS,
              help="Time limit of each Slurm call (default: the configuration's slurm_timeout_s, 30 s).")
def command(job_id, as_json, config_path, state_db, timeout_s):
    """Why a job got its Cell, or why it waits, and when it is expected to start and end."""
    from estimator.contract import ElasticSpecError, parse_plan_comment
    from estimator.errors import SpecError
    from estimator.estimate import EstimateOptions
    from slurm_ext import explain
    from slurm_ext.backend import make_client
    from slurm_ext.config import load_config
    from slurm_ext.errors import SlurmExtError
    from slurm_ext.jobspec import ElasticSpec, check_model, parse_spec
    from slurm_ext.observe import (cluster_spec, estimate_cells, is_held, model_loader_for, partition_types,
                                   profile_db_if_written, requested_gpus)

    cfg = load_config(config_path, {}, dict(os.environ))
    try:
        client = make_client(cfg.slurm_backend, cfg.slurm_prefix, timeout_s or cfg.slurm_timeout_s)
        job = client.job(job_id)
        if job is None:
            raise click.ClickException(f"job {job_id} is not known to Slurm (finished long ago, or a typo)")
        nodes = client.nodes() if job.is_elastic else ()
        script = None
        if job.is_elastic:
            try:
                script = client.batch_script(job_id)
            except SlurmExtError:
                script = None  # not the owner: the Comment's settings alone
    except SlurmExtError as e:
        raise click.ClickException(str(e)) from None
    pc = parse_plan_comment(job.admin_comment) if job.is_elastic else parse_plan_comment("")
    history, stored = _journal(job_id, state_db or cfg.state_db)
    spec = spec_error = None
    estimates = None
    if job.is_elastic and stored is None and script is None and job.batch:
        # Its #ELASTIC lines are its owner's to read (the daemon, as root, read them).
        click.echo("slurm-ext: warning: the job's batch script cannot be read here (only its owner and root "
                   "may, while the job is queued or running), so its Cells are not estimated", err=True)
    elif job.is_elastic and stored is not None and stored[1]:
        spec_error = stored[1]  # the daemon's own verdict
    elif job.is_elastic and stored is None and pc.error:
        spec_error = pc.error  # the verdict the daemon kept in the AdminComment
    elif job.is_elastic:
        try:
            # The settings the daemon read before it rewrote the job's request, else the job's.
            spec = ElasticSpec.from_json(stored[0]) if stored is not None and stored[0] else \
                parse_spec(job.comment, script, requested_gpus(job), pc.requested)
            job_spec = replace(spec.job_spec(), model_spec=check_model(spec, model_loader_for(job.user)))
            part_types = partition_types(nodes, cfg.partition_map())
            cluster = cluster_spec(nodes, part_types, cfg.cluster, cfg.network)
            options = EstimateOptions(plan_space=cfg.plan_space, micro_batches=cfg.micro_batches_for(spec.global_batch),
                                      max_gpus=cfg.max_gpus, profile_db=profile_db_if_written(cfg.profile_db),
                                      expert_parallel=cfg.expert_parallel)
            estimates = estimate_cells(job_spec, cluster, options,
                                       lambda why: click.echo(f"slurm-ext: warning: {why}", err=True))
        except (ElasticSpecError, SpecError, ValueError, KeyError, ArithmeticError) as e:  # as the daemon's
            spec_error = str(e)
    if job.is_elastic and spec_error is None:
        spec_error = pc.error  # the script unread here: the daemon's verdict
    chosen = explain.chosen_estimate(pc, estimates or ())
    doc = {
        "job_id": job.job_id, "state": job.state, "elastic": job.is_elastic,
        "spec": spec.to_json() if spec else None, "spec_error": spec_error,
        "cells": [e.to_json() for e in sorted(estimates or (), key=lambda e: (not e.feasible, e.iteration_time_s))],
        "chosen": ({"cell": pc.cell, "plan": pc.plan, "samples_per_s": pc.samples_per_s,
                    "samples_per_s_measured": pc.sps_measured,
                    "peak_memory_gb": round(chosen.peak_memory_gb, 3) if chosen else None,
                    "estimate": chosen.to_json() if chosen else None} if pc.cell else None),
        "why_chosen": explain.why_chosen(pc, chosen, estimates or ()),
        "history": history, "restarts": job.restart_count,
        "forecast": explain.forecast_json(job),
    }
    w = explain.waiting(job, pc, estimates, spec_error, is_held(job))
    doc["waiting"] = w.to_json() if w else None
    click.echo(json.dumps(doc, indent=1) if as_json else explain.format_text(doc))


def _journal(job_id: int, path: str | None) -> tuple[list[dict], tuple[dict | None, str | None] | None]:
    """The job's history and the spec the daemon read (JSON, error), from its state file
    when this user can read it; else none."""
    from slurm_ext import explain
    from slurm_ext.store import Store

    if not (path and Path(path).is_file() and os.access(path, os.R_OK)):
        return [], None
    try:
        store = Store(path, read_only=True)
        try:
            return explain.history(store.entries(job_id)), store.spec(job_id)
        finally:
            store.close()
    except (sqlite3.Error, ValueError) as e:  # not the daemon's state file, or one this user cannot open
        click.echo(f"slurm-ext: warning: the daemon's state is unavailable ({path}: {e})", err=True)
        return [], None
