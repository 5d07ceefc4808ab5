"""The one place that runs external programs (nothing else in slurm_ext imports subprocess).

Every command is an argument list (never a shell string), runs with a time limit, is
logged, and fails with a typed error that carries its stderr.
"""

import logging
import os
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from slurm_ext.errors import CommandNotFoundError, CommandTimeoutError, SlurmCommandError

log = logging.getLogger(__name__)

# Slurm stores job names, comments and scripts as the user's bytes: one that is not UTF-8
# must not make a listing of everybody's jobs unreadable (U+FFFD stands in for it).
TEXT = {"encoding": "utf-8", "errors": "replace"}

# Background children by PID, kept so that their exit status can be collected (`reap`).
_CHILDREN: dict[int, subprocess.Popen] = {}


@dataclass(frozen=True)
class CompletedCommand:
    """A command that exited with status 0."""

    argv: tuple[str, ...]
    returncode: int
    stdout: str
    stderr: str


def _check_argv(argv: object) -> tuple[str, ...]:
    # A string would be split into characters or, worse, invite shell=True; refuse it.
    if isinstance(argv, (str, bytes)):
        raise TypeError(f"argv must be a list of arguments, not a string: {argv!r}")
    if not isinstance(argv, Sequence) or not argv:
        raise TypeError(f"argv must be a non-empty list of arguments: {argv!r}")
    out = []
    for a in argv:
        if isinstance(a, Path):
            a = str(a)
        if not isinstance(a, str):
            raise TypeError(f"every argument must be a string, got {a!r} in {argv!r}")
        out.append(a)
    return tuple(out)


def _merged_env(env: Mapping[str, str] | None) -> dict[str, str] | None:
    if env is None:
        return None
    merged = dict(os.environ)
    merged.update(env)
    return merged


def run_command(argv: Sequence[str], timeout_s: float, input_text: str | None = None,
                env: Mapping[str, str] | None = None, check: bool = True) -> CompletedCommand:
    """Run a program and wait for it.

    Args:
        argv: the program and its arguments (a list; a string is a TypeError).
        timeout_s: seconds before the program is killed and CommandTimeoutError raised.
        input_text: text written to its stdin, or None for no stdin.
        env: variables added to (overriding) the current environment.
        check: raise SlurmCommandError on a non-zero exit (the default).

    Returns:
        The finished command with its stdout and stderr as text.

    Raises:
        SlurmCommandError: non-zero exit (with ``check``), carrying argv, status, stderr.
        CommandTimeoutError: it ran longer than ``timeout_s``.
        CommandNotFoundError: the program does not exist or cannot be run.
    """
    args = _check_argv(argv)
    log.debug("run %s", args)
    try:
        proc = subprocess.run(
            args, shell=False, input=input_text, capture_output=True, **TEXT,
            timeout=timeout_s, env=_merged_env(env),
            stdin=subprocess.DEVNULL if input_text is None else None)
    except subprocess.TimeoutExpired:
        log.warning("timed out after %g s: %s", timeout_s, args)
        raise CommandTimeoutError(args, timeout_s) from None
    except OSError as e:  # missing, not executable, ...
        raise CommandNotFoundError(args, e) from None
    if check and proc.returncode != 0:
        log.info("exit %d: %s: %s", proc.returncode, args, proc.stderr.strip())
        raise SlurmCommandError(args, proc.returncode, proc.stderr)
    return CompletedCommand(args, proc.returncode, proc.stdout, proc.stderr)


def run_commands(argvs: Sequence[Sequence[str]], timeout_s: float,
                 env: Mapping[str, str] | None = None, check: bool = True) -> list[CompletedCommand]:
    """Run several programs at once and wait for all of them (with ``check``, each must exit 0).

    For independent reads (three listings of the same queue): on a loaded machine their
    waits overlap instead of adding up.

    Raises:
        SlurmCommandError: one exited non-zero (the first such, in argument order).
        CommandTimeoutError: they were not all done within ``timeout_s``.
        CommandNotFoundError: a program does not exist or cannot be run.
    """
    all_args = [_check_argv(a) for a in argvs]
    procs: list[subprocess.Popen] = []
    try:
        for args in all_args:
            log.debug("run %s", args)
            try:
                procs.append(subprocess.Popen(args, shell=False, stdin=subprocess.DEVNULL,
                                              stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                              **TEXT, env=_merged_env(env)))
            except OSError as e:  # missing, not executable, ...
                raise CommandNotFoundError(args, e) from None
        deadline = time.monotonic() + timeout_s
        outputs = []
        for args, proc in zip(all_args, procs):
            try:
                out, err = proc.communicate(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("timed out after %g s: %s", timeout_s, args)
                raise CommandTimeoutError(args, timeout_s) from None
            outputs.append(CompletedCommand(args, proc.returncode, out, err))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    for done in outputs:
        if check and done.returncode != 0:
            log.info("exit %d: %s: %s", done.returncode, done.argv, done.stderr.strip())
            raise SlurmCommandError(done.argv, done.returncode, done.stderr)
    return outputs


def start_background(argv: Sequence[str], log_path: Path | str | None = None,
                     env: Mapping[str, str] | None = None) -> int:
    """Start a long-running program (a daemon in the foreground) and return its PID.

    The child gets its own session so that a Ctrl-C on the caller does not reach it;
    stop it by PID (see `stop_process`).

    Args:
        argv: the program and its arguments (a list; a string is a TypeError).
        log_path: file that receives its stdout and stderr (appended), or None to discard.
        env: variables added to (overriding) the current environment.

    Returns:
        The child's PID.
    """
    args = _check_argv(argv)
    log.debug("start %s", args)
    out = open(log_path, "ab") if log_path is not None else subprocess.DEVNULL
    try:
        proc = subprocess.Popen(args, shell=False, stdin=subprocess.DEVNULL, stdout=out,
                                stderr=subprocess.STDOUT, env=_merged_env(env),
                                start_new_session=True)
    except OSError as e:  # missing, not executable, ...
        raise CommandNotFoundError(args, e) from None
    finally:
        if log_path is not None:
            out.close()
    _CHILDREN[proc.pid] = proc
    return proc.pid


def reap(pid: int) -> int | None:
    """Collect the exit status of a background child of this process if it has exited.

    Returns:
        Its exit status, or None while it runs (or when it is not our child: a process
        started by an earlier command is reaped by init).
    """
    proc = _CHILDREN.get(pid)
    if proc is None or proc.poll() is None:
        return None
    del _CHILDREN[pid]
    return proc.returncode
