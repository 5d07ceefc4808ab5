"""Which `SlurmClient` backend a command gets: the CLI's, or pyslurm's (config
``slurm_backend``), running the Slurm of ``slurm_prefix``."""

from collections.abc import Mapping

from slurm_ext.slurm_client import SlurmClient
from slurm_ext.slurm_install import install_from


def make_client(backend: str = "cli", slurm_prefix: str | None = None, timeout_s: float = 30.0,
                env: Mapping[str, str] | None = None) -> SlurmClient:
    """A Slurm client.

    Args:
        backend: ``cli`` or ``pyslurm``.
        slurm_prefix: the Slurm installation prefix (None: the system's).
        timeout_s: time limit of each Slurm command.
        env: ``SLURM_CONF`` and other variables of the cluster (None: the process's).

    Raises:
        ValueError: an unknown backend.
        PyslurmUnavailable: pyslurm asked for and not usable.
    """
    install = install_from(slurm_prefix)
    if backend == "cli":
        from slurm_ext.cli_backend import CliSlurmClient
        return CliSlurmClient(env=env, timeout_s=timeout_s, install=install)
    if backend == "pyslurm":
        from slurm_ext.pyslurm_backend import PyslurmClient
        return PyslurmClient(env=env, timeout_s=timeout_s, install=install)
    raise ValueError(f"unknown Slurm backend {backend!r}; use cli or pyslurm")
