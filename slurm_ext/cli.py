"""The `slurm-ext` command line.

Subcommands live one per module in ``slurm_ext.commands`` and are imported only when
called, so `slurm-ext estimate` does not pay for JAX or the Slurm client.
"""

import importlib
import importlib.util
import logging
import sys

import click

from estimator.errors import SpecError

SUBCOMMANDS = {
    "estimate": "the Cells of one job and their estimated speed and memory",
    "tune": "the best parallel plan inside one Cell",
    "simulate": "replay a job trace on a cluster under one or more policies",
    "daemon": "observe Slurm, decide, act (the scheduler service)",
    "squeue": "squeue plus each elastic job's Cell, plan, forecast and why",
    "explain": "a job's Cells, the one it got and why, its history, forecast and why it waits",
    "profile": "measure a partition's GPUs and network as a Slurm job, into a profile store",
    "lab": "a local heterogeneous Slurm cluster for demos and tests",
}


class LazyGroup(click.Group):
    def list_commands(self, ctx):
        return [name for name in SUBCOMMANDS if _module_exists(name)]

    def get_command(self, ctx, name):
        if name not in SUBCOMMANDS or not _module_exists(name):
            return None
        return importlib.import_module(f"slurm_ext.commands.{name}").command

    def format_commands(self, ctx, formatter):
        rows = [(name, SUBCOMMANDS[name]) for name in self.list_commands(ctx)]
        if rows:
            with formatter.section("Commands"):
                formatter.write_dl(rows)


def _module_exists(name: str) -> bool:
    return importlib.util.find_spec(f"slurm_ext.commands.{name}") is not None


@click.group(cls=LazyGroup)
@click.version_option(package_name="slurm-ext", prog_name="slurm-ext")
@click.option("-v", "--verbose", count=True, help="More logging to stderr (-v info, -vv debug); "
              "before the subcommand: slurm-ext -v estimate ….")
def cli(verbose: int):
    """slurm-ext: choose each training job's GPU type, count, stages and parallel plan."""
    level = logging.WARNING - 10 * min(verbose, 2)
    logging.basicConfig(level=level, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def main(argv: list[str] | None = None) -> int:
    """Entry point: typed input errors become one line on stderr and exit 2; failures at
    run time (Slurm unreachable, a state file that cannot be opened) one line and exit 1."""
    try:
        # Outside standalone mode click returns a command's `Exit(status)` instead of raising it.
        status = cli.main(args=argv, prog_name="slurm-ext", standalone_mode=False)
    except SpecError as e:
        click.echo(f"slurm-ext: error: {e}", err=True)
        return 2
    except click.exceptions.Abort:
        click.echo("slurm-ext: aborted", err=True)
        return 130
    except click.UsageError as e:  # a bad command line: click's usage hint, status 2
        e.show()
        return e.exit_code
    except click.ClickException as e:  # a failure at run time, in the same one-line form
        click.echo(f"slurm-ext: error: {e.format_message()}", err=True)
        return e.exit_code
    except click.exceptions.Exit as e:
        return e.exit_code
    return status if isinstance(status, int) and not isinstance(status, bool) else 0


if __name__ == "__main__":
    sys.exit(main())
