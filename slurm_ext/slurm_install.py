"""Which Slurm installation the project runs: Debian's (on PATH, daemons in /usr/sbin) or
one built into a prefix of its own (``make slurm-25.11`` → ``/opt/slurm-25.11``).

``SLURM_EXT_SLURM_PREFIX`` (config key ``slurm_prefix``) names the prefix. Then every Slurm
command the project runs comes from it: the CLI backend's, the lab's daemons, and (through
the ``PATH`` of `SlurmInstall.env`, which sbatch exports into jobs) the commands tests and
jobs run by name. munged always comes from the system: the prefix build links Debian's
libmunge.
"""

import os
import re
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

PREFIX_ENV = "SLURM_EXT_SLURM_PREFIX"
# The daemons live in sbin, every other command in bin.
DAEMONS = frozenset({"slurmctld", "slurmd", "slurmdbd", "slurmstepd", "slurmrestd"})
SLURM_COMMANDS = frozenset({"sbatch", "srun", "salloc", "squeue", "sinfo", "scontrol",
                            "scancel", "sacct", "sacctmgr", "sprio", "sshare", "sstat",
                            "strigger", "sbcast", "sattach", "sdiag", "scrontab"}) | DAEMONS
SYSTEM_SBIN = Path("/usr/sbin")
_VERSION = re.compile(r"slurm(?:-wlm)?\s+(\d+)\.(\d+)(?:\.(\d+))?")


@dataclass(frozen=True)
class SlurmInstall:
    """A Slurm installation.

    Attributes:
        prefix: the installation prefix (``bin/``, ``sbin/``, ``lib/``, ``include/``);
            None for the system's Slurm (commands on PATH, daemons in /usr/sbin).
    """

    prefix: Path | None = None

    def command(self, name: str) -> str:
        """The program to run for a Slurm command (``squeue``) or daemon (``slurmctld``);
        any other program name is returned unchanged."""
        if name not in SLURM_COMMANDS:
            return name
        if self.prefix is None:
            return str(SYSTEM_SBIN / name) if name in DAEMONS else name
        return str(self.prefix / ("sbin" if name in DAEMONS else "bin") / name)

    def argv(self, argv: list[str]) -> list[str]:
        """``argv`` with its program resolved by `command`."""
        return [self.command(argv[0]), *argv[1:]] if argv else argv

    def env(self, base: Mapping[str, str] | None = None) -> dict[str, str]:
        """Variables that make commands run by name come from this installation: ``PATH``
        with the prefix's ``bin`` and ``sbin`` first ({} for the system's Slurm)."""
        if self.prefix is None:
            return {}
        path = (base if base is not None else os.environ).get("PATH", "/usr/bin:/bin")
        return {"PATH": f"{self.prefix / 'bin'}:{self.prefix / 'sbin'}:{path}"}

    def missing(self) -> tuple[str, ...]:
        """The daemons and client commands a lab needs that are not installed."""
        names = ("slurmctld", "slurmd", "sbatch", "squeue", "sinfo", "scontrol")
        out = []
        for name in names:
            program = self.command(name)
            if os.sep in program:
                if not Path(program).exists():
                    out.append(program)
            elif shutil.which(program) is None:
                out.append(program)
        return tuple(out)

    @property
    def include_dir(self) -> Path | None:
        return self.prefix / "include" if self.prefix else None

    def describe(self) -> str:
        return str(self.prefix) if self.prefix else "system"


def install_from(prefix: str | Path | None) -> SlurmInstall:
    """The installation in ``prefix`` ('' or None: the system's)."""
    return SlurmInstall(Path(prefix).resolve()) if prefix else SlurmInstall()


def install_from_env(environ: Mapping[str, str]) -> SlurmInstall:
    """The installation ``SLURM_EXT_SLURM_PREFIX`` names in ``environ`` (unset: the system's)."""
    return install_from(environ.get(PREFIX_ENV) or None)


def parse_version(text: str) -> tuple[int, int, int] | None:
    """``slurm 25.11.7`` / ``slurm-wlm 22.05.8`` (``--version`` output) → (25, 11, 7)."""
    m = _VERSION.search(text)
    if not m:
        return None
    return int(m.group(1)), int(m.group(2)), int(m.group(3) or 0)
