"""Shared pytest fixtures.

Slurm integration tests (marked ``@pytest.mark.slurm``) of every module reuse the ONE
session-scoped lab cluster defined here instead of starting their own:

- ``slurm_lab``: a running `LabCluster` (the built-in ``lab`` spec: a100 2×4, v100 2×4,
  a10 2×2, h100 1×8 fake GPUs, one partition per type, etc/job_submit.lua installed).
  ``slurm_lab.env()`` gives ``{"SLURM_CONF": ...}`` for commands and the daemon.
- ``slurm_client``: a `CliSlurmClient` pointed at it; every job is cancelled after each
  test that uses it, so tests do not see each other's jobs running.

Both skip with a clear reason when Slurm's daemons are not installed or the tests do not
run as root (the lab starts slurmd, which needs root).
"""

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import pytest

from estimator.cluster import load_cluster
from slurm_ext.lab import MUNGED, SLURMCTLD, SLURMD, LabCluster, find_free_base_port

# Ports well away from the default of `slurm-ext lab up` (17800), so a lab a developer
# runs does not collide with the tests' lab.
TEST_BASE_PORTS = range(18800, 19400, 40)


def lab_skip_reason() -> str | None:
    """Why the Slurm integration tests cannot run here, or None."""
    missing = [p for p in (SLURMCTLD, SLURMD, MUNGED) if not Path(p).exists()]
    if missing or shutil.which("sbatch") is None:
        return ("Slurm is not installed (needs Debian's slurmctld slurmd slurm-client munge; "
                "`sudo make setup`)")
    if os.geteuid() != 0:
        return "the Slurm lab cluster needs root (slurmd runs jobs as their users)"
    return None


@pytest.fixture(scope="session")
def slurm_lab():
    """A running lab cluster shared by the whole test session (see the module docstring)."""
    reason = lab_skip_reason()
    if reason:
        pytest.skip(reason)
    # A world-readable directory, so tests may run commands as an unprivileged user.
    root = Path(tempfile.mkdtemp(prefix="slurm-ext-lab-"))
    os.chmod(root, 0o755)
    lab = LabCluster(root / "lab", base_port=find_free_base_port(load_cluster("lab"), TEST_BASE_PORTS))
    lab.up()
    try:
        yield lab
    finally:
        lab.down()
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def slurm_client(slurm_lab):
    """A CLI Slurm client on the session lab; cancels every job after the test."""
    from slurm_ext.cli_backend import CliSlurmClient
    yield CliSlurmClient(env=slurm_lab.env())
    slurm_lab.cancel_all_jobs()


def wait_for(what: str, probe: Callable[[], object], timeout_s: float = 20.0):
    """Poll until ``probe`` returns something truthy and return it; else fail the test with
    ``what`` and the last value. Lab tests import it: ``from conftest import wait_for``."""
    from slurm_ext.lab import poll

    value = poll(probe, timeout_s)
    if value:
        return value
    pytest.fail(f"timed out after {timeout_s:g} s waiting for {what}; last: {value!r}")


def in_jax_child(num_devices: int, fn: Callable, *args):
    """``fn(*args)`` in a spawned process whose JAX has ``num_devices`` CPU devices (JAX in
    this process may already have started with one). ``fn`` must be importable (a module's
    top-level function) and return plain data. Tests import it: ``from conftest import
    in_jax_child``."""
    import multiprocessing

    from estimator.compiled import _worker_init, child_xla_flags

    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(1, initializer=_worker_init, initargs=(child_xla_flags(num_devices),)) as pool:
        return pool.apply(fn, args)
