"""Typed errors of the Slurm edge: each quotes what failed and says what to do."""

from collections.abc import Sequence


class SlurmExtError(Exception):
    """Base class of the errors raised by slurm_ext's Slurm edge."""


# What Slurm's commands print when they cannot reach or find the controller.
UNREACHABLE_MARKERS = ("Could not establish a configuration source", "Unable to contact slurm controller",
                       "Could not open configuration file")


def _shown(argv: Sequence[str], width: int = 160) -> str:
    """The command as one line, its middle cut when long (squeue's --Format list is ~400 chars)."""
    text = " ".join(argv)
    return text if len(text) <= width else text[:width - 40] + " … " + text[-37:]


class SlurmCommandError(SlurmExtError):
    """A command exited with a non-zero status.

    Args:
        argv: the argument list that was run.
        returncode: its exit status.
        stderr: what it wrote to stderr (stripped), quoted in the message.
    """

    def __init__(self, argv: Sequence[str], returncode: int, stderr: str):
        self.argv = tuple(argv)
        self.returncode = returncode
        self.stderr = stderr
        detail = stderr.strip().splitlines()[-1] if stderr.strip() else "(no stderr)"
        hint = ("; is slurmctld up and SLURM_CONF its slurm.conf (check `scontrol ping`)?"
                if any(s in stderr for s in UNREACHABLE_MARKERS) else "")
        super().__init__(f"{_shown(self.argv)!r} exited {returncode}: {detail}{hint}")


class CommandTimeoutError(SlurmExtError):
    """A command did not finish within its time limit (it was killed).

    Args:
        argv: the argument list that was run.
        timeout_s: the limit, seconds.
    """

    def __init__(self, argv: Sequence[str], timeout_s: float):
        self.argv = tuple(argv)
        self.timeout_s = timeout_s
        super().__init__(
            f"{_shown(self.argv)!r} did not finish within {timeout_s:g} s; "
            "is slurmctld up (check SLURM_CONF and `scontrol ping`)?")


class CommandNotFoundError(SlurmExtError):
    """The program to run is not installed or not on PATH, or cannot be run (``error``: the
    operating system's refusal, e.g. not executable)."""

    def __init__(self, argv: Sequence[str], error: OSError | None = None):
        self.argv = tuple(argv)
        why = None if error is None or isinstance(error, FileNotFoundError) else error.strerror
        where = ("or check the Slurm prefix (slurm_prefix in the config, SLURM_EXT_SLURM_PREFIX)"
                 if "/" in self.argv[0] else "or fix PATH")
        super().__init__(
            f"{self.argv[0]!r} {f'cannot be run ({why})' if why else 'not found'}: install Slurm's client "
            f"tools (Debian: apt-get install slurm-client) {where}")


class SlurmArgumentError(SlurmExtError, ValueError):
    """A value cannot be turned into a Slurm command argument.

    Args:
        field: the argument (``job_id``, ``gpus_per_node``).
        value: what was given.
        hint: what to give instead.
    """

    def __init__(self, field: str, value: object, hint: str):
        self.field = field
        self.value = value
        self.hint = hint
        super().__init__(f"{field}={value!r}: {hint}")


class SlurmParseError(SlurmExtError):
    """Slurm printed something the parser cannot read.

    Args:
        what: which output or field (``squeue --json``, ``jobs[3].job_id``).
        text: the offending text (shortened in the message).
    """

    def __init__(self, what: str, text: object):
        self.what = what
        self.text = text
        shown = repr(text)
        if len(shown) > 200:
            shown = shown[:200] + "..."
        super().__init__(f"cannot parse {what}: {shown}")


class LabError(SlurmExtError):
    """The local lab cluster cannot be started, stopped or inspected as asked."""
