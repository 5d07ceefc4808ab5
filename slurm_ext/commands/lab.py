"""`slurm-ext lab up|down|status [--dir D]`: the local heterogeneous Slurm cluster."""

import sys
from pathlib import Path

import click

from slurm_ext.commands import POSITIVE_SECONDS
from slurm_ext.errors import LabError, SlurmExtError


def _lab(directory: Path, cluster: str, base_port: int, slurm_prefix: str | None):
    from estimator.cluster import load_cluster
    from slurm_ext.lab import LabCluster
    from slurm_ext.slurm_install import install_from
    return LabCluster(directory, load_cluster(cluster), base_port,
                      install=install_from(slurm_prefix) if slurm_prefix else None)


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
@click.option("--timeout", "timeout_s", type=POSITIVE_SECONDS, default=60.0, show_default=True,
              help="Seconds `up` waits for every node to be idle.")
@click.option("--slurm-prefix", envvar="SLURM_EXT_SLURM_PREFIX", default=None,
              help="Run the Slurm built into this prefix (e.g. /opt/slurm-25.11 from "
                   "`make slurm-25.11`) [env SLURM_EXT_SLURM_PREFIX; default: Debian's Slurm, "
                   "or for down/status the one the lab was started with].")
def command(action: str, directory: Path, cluster: str, base_port: int, timeout_s: float,
            slurm_prefix: str | None):
    """Start, stop or inspect a local Slurm with fake heterogeneous GPU nodes.

    After `up`, SLURM_CONF=DIR/slurm.conf points any Slurm command at it.
    """
    lab = _lab(directory, cluster, base_port, slurm_prefix)
    try:
        if action == "up":
            lab.up(timeout_s=timeout_s)
            path = lab.install.env().get("PATH")
            click.echo(f"lab up: {len(lab.recorded_pids().get('slurmd', {}))} nodes, Slurm "
                       f"{'.'.join(map(str, lab.slurm_version()))}; export SLURM_CONF={lab.paths.conf}"
                       + (f" PATH={path.split(':', 2)[0]}:$PATH" if path else ""))
        elif action == "down":
            was_up = lab.is_up()
            lab.down()
            click.echo("lab down" if was_up else f"no lab was running in {lab.paths.root}")
        else:
            click.echo(lab.status_text())
    except (LabError, SlurmExtError) as e:
        _fail(e)
