"""Shared pytest fixtures.

Slurm integration tests (marked ``@pytest.mark.slurm``) of every module reuse the ONE
session-scoped lab cluster defined here instead of starting their own:

- ``slurm_lab``: a running `LabCluster` (the built-in ``lab`` spec: a100 2×4, v100 2×4,
  a10 2×2, h100 1×8 fake GPUs, one partition per type, etc/job_submit.lua installed).
  ``slurm_lab.env()`` gives ``{"SLURM_CONF": ...}`` for commands and the daemon.
- ``slurm_client``: a `SlurmClient` pointed at it; every job is cancelled after each
  test that uses it, so tests do not see each other's jobs running.

Both skip with a clear reason when Slurm's daemons are not installed or the tests do not
run as root (the lab starts slurmd, which needs root).

Which Slurm and which backend: the session's environment decides, as it does for the
daemon. ``SLURM_EXT_SLURM_PREFIX=/opt/slurm-25.11`` runs the lab on the Slurm built there
(``make slurm-25.11``; the prefix's commands come first on this process's PATH, so tests
and the jobs they submit run them), and ``SLURM_EXT_SLURM_BACKEND=pyslurm`` gives
``slurm_client`` (and every daemon the tests start) the pyslurm backend. ``make test``
runs the integration tests once per combination.
"""

import importlib.util
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import pytest

from estimator.cluster import load_cluster
from slurm_ext.lab import MUNGED, LabCluster, find_free_base_port
from slurm_ext.slurm_install import PREFIX_ENV, install_from_env

BACKEND_ENV = "SLURM_EXT_SLURM_BACKEND"

# Ports well away from the default of `slurm-ext lab up` (17800), so a lab a developer
# runs does not collide with the tests' lab.
TEST_BASE_PORTS = range(18800, 19400, 40)


def lab_skip_reason() -> str | None:
    """Why the Slurm integration tests cannot run here, or None."""
    install = install_from_env(os.environ)
    if install.prefix is not None and install.missing():
        return (f"no Slurm in {install.prefix} ({PREFIX_ENV}): `sudo make slurm-25.11` "
                "builds it from the vendored source")
    if install.missing() or not Path(MUNGED).exists():
        return ("Slurm is not installed (needs Debian's slurmctld slurmd slurm-client munge; "
                "`sudo make setup`)")
    # Not imported here: pyslurm reads SLURM_CONF when first imported (the client sets it).
    if os.environ.get(BACKEND_ENV) == "pyslurm" and importlib.util.find_spec("pyslurm") is None:
        return "pyslurm is not installed: `make setup` builds it against Slurm 25.11"
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
    install = install_from_env(os.environ)
    lab = LabCluster(root / "lab", base_port=find_free_base_port(load_cluster("lab"), TEST_BASE_PORTS),
                     install=install)
    os.environ.update(install.env())
    lab.up()
    try:
        yield lab
    finally:
        lab.down()
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def slurm_client(slurm_lab):
    """The session's Slurm client (CLI or pyslurm) on its lab; cancels every job after the test."""
    from slurm_ext.backend import make_client
    yield make_client(os.environ.get(BACKEND_ENV, "cli"), os.environ.get(PREFIX_ENV) or None,
                      env=slurm_lab.env())
    slurm_lab.cancel_all_jobs()


@pytest.fixture
def open_dir():
    """A directory every user may enter, for model files the daemon reads as a job's owner
    could (pytest's ``tmp_path`` lies under a directory only root may enter)."""
    path = Path(tempfile.mkdtemp(prefix="slurm-ext-open-"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


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

