"""`slurm-ext lab up|down|status [--dir D]`: the local heterogeneous Slurm cluster."""

import sys
from pathlib import Path

import click

from slurm_ext.errors import LabError, SlurmExtError


def _lab(directory: Path, cluster: str, base_port: int):
    from estimator.cluster import load_cluster
    from slurm_ext.lab import LabCluster
    return LabCluster(directory, load_cluster(cluster), base_port)


def _fail(e: Exception) -> None:
    click.echo(f"slurm-ext lab: error: {e}", err=True)
    sys.exit(1)


@click.command(name="lab")
@click.argument("action", type=click.Choice(["up", "down", "status"]))
@click.option("--dir", "directory", type=click.Path(path_type=Path), default=Path("lab"),
              show_default=True, help="Directory holding the lab's config, state and logs.")
@click.option("--cluster", default="lab", show_default=True,
              help="Cluster spec to emulate (built-in name or YAML file).")
@click.option("--base-port", type=click.IntRange(1024, 65000), default=17800, show_default=True,
              help="slurmctld's port; the slurmds use the ports after it.")
@click.option("--timeout", "timeout_s", type=float, default=60.0, show_default=True,
              help="Seconds `up` waits for every node to be idle.")
def command(action: str, directory: Path, cluster: str, base_port: int, timeout_s: float):
    """Start, stop or inspect a local Slurm with fake heterogeneous GPU nodes.

    After `up`, SLURM_CONF=DIR/slurm.conf points any Slurm command at it.
    """
    lab = _lab(directory, cluster, base_port)
    try:
        if action == "up":
            lab.up(timeout_s=timeout_s)
            click.echo(f"lab up: {len(lab.recorded_pids().get('slurmd', {}))} nodes; "
                       f"export SLURM_CONF={lab.paths.conf}")
        elif action == "down":
            was_up = lab.is_up()
            lab.down()
            click.echo("lab down" if was_up else f"no lab was running in {lab.paths.root}")
        else:
            click.echo(lab.status_text())
    except (LabError, SlurmExtError) as e:
        _fail(e)
