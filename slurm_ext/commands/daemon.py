"""`slurm-ext daemon`: the scheduler service (observe → decide → act).

This is the daemon's entry point: it resolves the configuration once (flag > environment >
YAML > defaults), configures logging (``key=value`` lines on stderr), installs the signal
handlers (SIGTERM/SIGINT exit cleanly, SIGHUP re-reads the configuration) and runs rounds.
"""

from __future__ import annotations

import logging
import os
import signal
import sqlite3
import sys

import click

from policy.registry import policy_names
from slurm_ext.config import DaemonConfig, load_config
from slurm_ext.errors import SlurmExtError

LOG_FORMAT = "ts=%(asctime)s level=%(levelname)s logger=%(name)s %(message)s"


def configure_logging(level: str) -> None:
    """Structured lines on stderr; replaces whatever the CLI group set up."""
    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(LOG_FORMAT, datefmt="%Y-%m-%dT%H:%M:%S"))
    root.addHandler(handler)
    root.setLevel(level)


def make_client(config: DaemonConfig):
    """The configured Slurm backend (``slurm_backend``, ``slurm_prefix``, command time limit)."""
    from slurm_ext.backend import make_client as make

    return make(config.slurm_backend, config.slurm_prefix, config.slurm_timeout_s)


@click.command("daemon")
@click.option("--config", "config_path", type=click.Path(dir_okay=False),
              help="YAML configuration (default: $SLURM_EXT_CONFIG, else built-in defaults).")
@click.option("--once", is_flag=True, help="Run one round and exit (status 1 if it failed); nodes it holds for a "
              "waiting job stay held for the next run, which releases them if no longer needed.")
@click.option("--dry-run", is_flag=True, default=None,
              help="Print the actions a round would take; change nothing in Slurm (may run beside the "
                   "service, which holds the state file's lock).")
@click.option("--interval-s", type=float, default=None,
              help=f"Seconds between rounds (default: the config's, else {DaemonConfig.interval_s:g}).")
@click.option("--policy", default=None,
              help=f"Scheduling policy (default: the config's policy:, else cells-ilp): {', '.join(policy_names())}.")
@click.option("--state-db", default=None,
              help=f"SQLite state file (default: the config's, else {DaemonConfig.state_db}).")
@click.option("--log-level", default=None,
              help=f"DEBUG, INFO, WARNING or ERROR (default: the config's, else {DaemonConfig.log_level}).")
def command(config_path, once, dry_run, interval_s, policy, state_db, log_level):
    """Schedule elastic jobs: choose each one's GPU type, count, stages and plan."""
    from slurm_ext.daemon import Daemon, kv
    from slurm_ext.metrics import Metrics
    from slurm_ext.store import StateFileBusy, Store, lock_state_file

    flags = {"dry_run": dry_run, "interval_s": interval_s, "policy": policy,
             "state_db": state_db, "log_level": log_level}

    def resolve() -> DaemonConfig:
        return load_config(config_path, flags, os.environ)

    config = resolve()
    configure_logging(config.log_level)
    log = logging.getLogger("slurm_ext.daemon")
    lock_fd = None
    try:
        if not config.dry_run and config.state_db != ":memory:":  # a dry run changes nothing
            lock_fd = lock_state_file(config.state_db)
        store = Store(config.state_db)
    except StateFileBusy as e:
        raise click.ClickException(f"{e}: stop it first, or pass --dry-run") from None
    except (OSError, sqlite3.Error) as e:
        if lock_fd is not None:
            os.close(lock_fd)
        raise click.ClickException(
            f"cannot open the state file {config.state_db!r}: {e}; set state_db in the config "
            "(or --state-db) to a writable path") from None

    def close() -> None:
        store.close()
        if lock_fd is not None:
            os.close(lock_fd)  # the next daemon may act on the state file

    metrics = Metrics(config.metrics_port, config.metrics_address)
    try:
        client = make_client(config)
    except SlurmExtError as e:
        close()
        raise click.ClickException(str(e)) from None
    daemon = Daemon(config, client, store, metrics=metrics,
                    out=lambda line: click.echo(line), reload=resolve)

    def on_stop(signum, _frame):
        log.info(kv("signal", name=signal.Signals(signum).name, action="stop"))
        daemon.request_stop()

    def on_hup(_signum, _frame):
        log.info(kv("signal", name="SIGHUP", action="reload"))
        daemon.request_reload()

    signal.signal(signal.SIGTERM, on_stop)
    signal.signal(signal.SIGINT, on_stop)
    signal.signal(signal.SIGHUP, on_hup)
    log.info(kv("daemon_started", policy=config.policy, backend=config.slurm_backend,
                slurm=config.slurm_prefix or "system", interval_s=config.interval_s,
                dry_run=config.dry_run, state_db=config.state_db, once=once))
    try:
        status = daemon.run(once=once)
    finally:
        close()
    raise click.exceptions.Exit(status)
