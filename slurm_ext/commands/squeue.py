"""`slurm-ext squeue [--json]`: squeue plus each elastic job's Cell, plan, speed and why.

Reads only Slurm (through the configured backend, ``slurm_backend``), so any user can run
it without the daemon's state.
The JSON keys are documented in ``slurm_ext.squeue_view``.
"""

from __future__ import annotations

import json
import os

import click

from slurm_ext.commands import POSITIVE_SECONDS


@click.command("squeue")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object: {\"jobs\": [...]}.")
@click.option("--all", "include_finished", is_flag=True, help="Include recently finished jobs.")
@click.option("--timeout-s", type=POSITIVE_SECONDS,
              help="Time limit of the squeue call (default: the configuration's slurm_timeout_s, 30 s).")
def command(as_json, include_finished, timeout_s):
    """Every job with its elastic Cell, plan, estimated samples/s and why."""
    from slurm_ext.backend import make_client
    from slurm_ext.config import SLURM_ACCESS_KEYS, load_config
    from slurm_ext.errors import SlurmExtError
    from slurm_ext.squeue_view import format_table, rows, to_json

    cfg = load_config(None, {}, dict(os.environ), only=SLURM_ACCESS_KEYS)
    try:
        jobs = make_client(cfg.slurm_backend, cfg.slurm_prefix, timeout_s or cfg.slurm_timeout_s).jobs()
    except SlurmExtError as e:
        raise click.ClickException(str(e)) from None
    table = rows(jobs, include_finished=include_finished)
    if as_json:
        click.echo(json.dumps(to_json(table), indent=1))
    else:
        click.echo(format_table(table))
