"""One module per `slurm-ext` subcommand; each defines a click command named ``command``."""

import math
import os
from pathlib import Path

import click

from estimator.cluster import BUILTIN_CLUSTERS, load_cluster
from estimator.errors import SpecError

CLUSTER_ENV = "SLURM_EXT_CLUSTER"


class FiniteFloatRange(click.FloatRange):
    """click's FloatRange, without ``inf`` and ``nan`` (which pass its bounds)."""

    def convert(self, value, param, ctx):
        number = super().convert(value, param, ctx)
        if not math.isfinite(number):
            self.fail(f"{value!r} is not a finite number.", param, ctx)
        return number


POSITIVE_SECONDS = FiniteFloatRange(min=0, min_open=True)


def check_writable(field: str, path: str | None, directory: bool = False) -> None:
    """Fail now, before any work, when an output file (or directory) cannot be written:
    its folder is made when missing. ``-`` (stdout) and None pass."""
    if not path or path == "-":
        return
    p = Path(path)
    try:
        if not directory and p.is_dir():
            raise IsADirectoryError(21, "Is a directory")
        where = p if directory else p.parent
        where.mkdir(parents=True, exist_ok=True)
        if not os.access(where, os.W_OK):
            raise PermissionError(13, "Permission denied")
    except OSError as e:
        raise SpecError(field, path, f"cannot write: {e.strerror or e}") from None


def check_gpu_counts(gpus: int | None, gpus_per_node: int | None) -> None:
    """A Cell's GPU count and GPUs per node are powers of two (None: not given)."""
    from slurm_ext.jobspec import check_power_of_two_gpus
    if gpus_per_node is not None and (gpus_per_node < 1 or gpus_per_node & (gpus_per_node - 1)):
        raise SpecError("gpus_per_node", gpus_per_node, "give a power of two (a Cell's GPUs lie on nodes in "
                                                        "groups of 1, 2, 4, 8, ...)")
    if gpus is not None:
        if gpus < 1:
            raise SpecError("gpus", gpus, "give a positive power of two, or leave it out to see every count")
        check_power_of_two_gpus(gpus, "not a power of two", "ask for {below} or {above}")


def check_micro_batches(micro_batches: int | None, global_batch: int) -> None:
    """A micro-batch count must divide the global batch (None: chosen per Cell)."""
    if micro_batches and global_batch > 0 and global_batch % micro_batches:
        raise SpecError("micro_batches", micro_batches, f"must divide the global batch {global_batch}: every "
                        "micro-batch holds the same number of samples")


def _cluster_from(ctx: click.Context, param: click.Parameter, value: str) -> str:
    """A cluster taken from ``$SLURM_EXT_CLUSTER`` that does not load says where it came from
    (a user who never typed ``--cluster`` would not know where ``nope`` is from)."""
    if ctx.get_parameter_source(param.name) is click.core.ParameterSource.DEFAULT and CLUSTER_ENV in os.environ:
        try:
            load_cluster(value)
        except SpecError as e:
            raise SpecError(f"${CLUSTER_ENV}", value, e.hint if e.field == "cluster" else str(e)) from None
    return value


def cluster_option(default: str, help: str):
    """``--cluster``: a built-in cluster or a YAML file, by default ``$SLURM_EXT_CLUSTER``."""
    return click.option("--cluster", default=lambda: os.environ.get(CLUSTER_ENV, default),
                        show_default=f"${CLUSTER_ENV} or {default}", callback=_cluster_from,
                        help=help.format(builtins=", ".join(BUILTIN_CLUSTERS)))
