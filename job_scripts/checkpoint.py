"""Checkpoints with Orbax: every process writes its own shards, a killed save leaves the
previous checkpoint usable, and a checkpoint is read back into any plan.

A checkpoint of step N in directory D is Orbax's ``D/N/`` with two items:

- ``arrays``: a pytree of global ``jax.Array``s. Each process writes the shards its
  devices hold (OCDBT, one file set per process); Orbax writes them into a temporary
  directory and renames it only when every process has finished, so a save that is
  killed half-way leaves no step ``N`` at all and the newest complete one is used.
- ``meta``: JSON — the step, the data position, the model, global batch, plan, and how
  the arrays are laid out (what a reader needs to reshard them).

:meth:`Checkpoints.restore` gives Orbax's resharding restore (arrays with logical shapes,
read into any shardings); :meth:`Checkpoints.reader` reads slices of saved arrays
straight from the files (for the pipeline's flat buffers, whose layout is its own).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

log = logging.getLogger(__name__)

ARRAYS = "arrays"
META = "meta"
FORMAT_VERSION = 2
# tensorstore's status of a read that found array files truncated or garbled.
DAMAGE_STATUSES = ("OUT_OF_RANGE", "DATA_LOSS", "FAILED_PRECONDITION")


class CheckpointError(RuntimeError):
    """A checkpoint cannot be written or none can be read (names the path and why)."""


class CheckpointDamaged(CheckpointError):
    """A checkpoint's array files cannot be read (truncated, missing: a disk or a node that
    lost data after the save completed); the one before it may still be."""


@dataclass(frozen=True)
class Saved:
    """A complete checkpoint: its step, its metadata and its directory."""

    step: int
    meta: dict
    path: Path


def write_json_atomic(path: Path, obj: object) -> None:
    """Write JSON to ``path`` through a temporary file, fsync and rename. The temporary
    file's name is the writer's own: two jobs writing one shared file (a tuned plan) each
    rename a whole file, and the last one stands."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    # O_EXCL: a name no one else holds; the mode is open()'s, under the umask.
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(obj, f, indent=1, sort_keys=True)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _first_line(e: Exception) -> str:
    """The first line of an error (tensorstore's carry their whole spec after it)."""
    return str(e).splitlines()[0][:300] if str(e) else type(e).__name__


class ArrayReader:
    """Slices of the arrays saved in one checkpoint, read from its files with tensorstore."""

    def __init__(self, arrays_dir: Path):
        self.dir = Path(arrays_dir)
        try:
            meta = json.loads((self.dir / "_METADATA").read_text())
        except (OSError, ValueError) as e:
            raise CheckpointDamaged(f"{self.dir}: unreadable array metadata ({e})") from None
        self.use_zarr3 = bool(meta.get("use_zarr3", False))
        self.use_ocdbt = bool(meta.get("use_ocdbt", True))
        self._open: dict[str, object] = {}

    @property
    def manifest_lost(self) -> bool:
        """An OCDBT checkpoint without its database's root: every array reads NOT_FOUND."""
        return self.use_ocdbt and not (self.dir / "manifest.ocdbt").is_file()

    def _store(self, name: str):
        if name not in self._open:
            import tensorstore as ts
            from orbax.checkpoint import type_handlers as th
            info = th.ParamInfo(name=name, parent_dir=self.dir, use_zarr3=self.use_zarr3)
            spec = th.get_json_tspec_read(info, use_ocdbt=self.use_ocdbt)
            try:
                self._open[name] = ts.open(spec, context=th.get_ts_context(use_ocdbt=self.use_ocdbt)).result()
            except Exception as e:  # noqa: BLE001 - tensorstore raises ValueError and its own errors
                first = _first_line(e)
                if first.startswith("NOT_FOUND") and not self.manifest_lost:  # a checkpoint of another layout
                    raise CheckpointError(f"{self.dir}: no array {name!r} ({first})") from None
                raise CheckpointDamaged(f"{self.dir}: array {name!r} cannot be opened ({first})") from None
        return self._open[name]

    def shape(self, *keys: str) -> tuple[int, ...]:
        return tuple(self._store(".".join(keys)).shape)

    def read(self, keys: tuple[str, ...], index) -> np.ndarray:
        """``array[index]`` of the array saved under the pytree path ``keys``."""
        store = self._store(".".join(keys))
        try:
            return np.asarray(store[index].read().result())
        except Exception as e:  # noqa: BLE001 - tensorstore raises ValueError and its own errors
            raise CheckpointDamaged(f"{self.dir}: array {'.'.join(keys)!r} cannot be read "
                                    f"({_first_line(e)})") from None


class Checkpoints:
    """The checkpoints of one job: ``save``, ``latest``, ``restore`` and ``reader``.

    Every process of the job makes the same calls (Orbax synchronises them).

    Args:
        directory: the job's checkpoint directory (created if missing).
        keep: how many of the newest checkpoints to keep.
    """

    def __init__(self, directory: Path | str, keep: int = 2):
        import orbax.checkpoint as ocp
        self._ocp = ocp
        self.directory = Path(directory).absolute()
        if self.directory.exists() and not self.directory.is_dir():
            raise CheckpointError(f"{self.directory}: not a directory; give a directory for the job's checkpoints")
        options = ocp.CheckpointManagerOptions(max_to_keep=max(1, keep), create=True,
                                               cleanup_tmp_directories=True)
        try:
            self.manager = ocp.CheckpointManager(self.directory, options=options)
        except OSError as e:
            raise CheckpointError(f"{self.directory}: cannot use it for checkpoints ({e.strerror})") from None
        if not os.access(self.directory, os.W_OK | os.X_OK):
            raise CheckpointError(f"{self.directory}: cannot write there; give a directory this job may write")

    def steps(self) -> list[int]:
        """Complete checkpoints, newest first."""
        self.manager.reload()
        return sorted(self.manager.all_steps(), reverse=True)

    def _meta(self, step: int) -> dict:
        # Read as the file Orbax's JsonSave wrote, not through a restore: with several
        # processes each restore ends in a barrier, and a process that cannot read a step
        # would make one barrier fewer than the others.
        meta = json.loads((self.directory / str(step) / META / "metadata").read_text())
        if not isinstance(meta, dict) or meta.get("format") != FORMAT_VERSION:
            raise CheckpointError(f"{self.directory / str(step)}: not a checkpoint of this format")
        return meta

    def latest(self, agree: Callable[[float], float] = lambda value: value) -> Saved | None:
        """The newest complete checkpoint whose metadata reads, or None when there is none.

        Every process of the job resumes from the same step: ``agree`` gives the largest
        of a value over the processes. Where they read different newest steps (a step
        one could not read), all take the oldest of them and the newer steps are set
        aside; where some see checkpoints and others none, the directory is not one they
        share and every process refuses.

        Raises:
            CheckpointError: checkpoints exist but none can be read, on any process; or
                the processes see different checkpoints.
        """
        problems, steps, saved = [], self.steps(), None
        for step in steps:
            try:
                saved = Saved(step, self._meta(step), self.directory / str(step))
                break
            except Exception as e:  # noqa: BLE001 - a damaged step falls back to the previous one
                log.warning("skipping checkpoint of step %d: %s", step, e)
                problems.append(f"step {step}: {e}")
        mine = saved.step if saved is not None else -1
        oldest, newest = -agree(-mine), agree(mine)  # the same on every process
        if oldest < 0 <= newest:
            raise CheckpointError(f"{self.directory}: this job's processes see different checkpoints (step "
                                  f"{int(newest)} on some, none readable on others): the checkpoint directory "
                                  "must be one that every node shares")
        if newest < 0:
            if agree(float(bool(problems))) > 0:  # every process refuses, or none
                raise CheckpointError(f"no readable checkpoint in {self.directory}: " + (
                    "; ".join(problems) or "another process of this job could not read them"))
            left = self._left_unreadable()
            if agree(float(bool(left))) > 0:  # a run after the one that set them aside refuses as it did
                raise CheckpointError(left or f"{self.directory}: another process of this job found checkpoints "
                                              "it cannot read")
            return None
        unread = ""
        if oldest < mine:
            log.warning("this process reads step %d, another process only step %d: every process resumes "
                        "from step %d", mine, int(oldest), int(oldest))
            try:
                saved = Saved(int(oldest), self._meta(int(oldest)), self.directory / str(int(oldest)))
            except Exception as e:  # noqa: BLE001 - said below, on every process
                unread = f"step {int(oldest)}: {e}"
        if agree(float(bool(unread))) > 0:  # every process stops, or none
            raise CheckpointError(f"{self.directory}: this job's processes cannot all read one checkpoint ("
                                  f"{unread or 'another process could not read step ' + str(int(oldest))})")
        self._set_aside([step for step in steps if step > int(oldest)], agree)
        return saved

    def _left_unreadable(self) -> str:
        """Why a directory with no checkpoint to resume from is no place to start afresh
        (checkpoints set aside as unreadable, or of the first format), or ""."""
        aside = sorted(p.name for p in self.directory.glob("*.unreadable*"))
        if aside:
            return (f"no readable checkpoint in {self.directory}: every one was set aside as unreadable "
                    f"({', '.join(aside[:4])}{', ...' if len(aside) > 4 else ''}); move one back once its "
                    "storage reads again, or remove them to train from step 1")
        if any(self.directory.glob("ckpt-*.npz")):
            return (f"{self.directory} holds checkpoints of an older format (ckpt-*.npz) this runner cannot "
                    "read: resume them with the version that wrote them, or remove them to train from step 1")
        return ""

    def set_aside(self, step: int, agree: Callable[[float], float] = lambda value: value) -> None:
        """Set the checkpoint of ``step`` aside as unreadable (``7`` → ``7.unreadable``), on
        every process's word (all call it): ``latest`` then gives the one before."""
        self._set_aside([step], agree)

    def _set_aside(self, steps: list[int], agree: Callable[[float], float]) -> None:
        """Rename the ``steps`` newer than the one resumed (damaged, or unreadable to some
        process; ``7`` → ``7.unreadable``): kept for a look, and out of the way of the
        run's own save when it reaches that step again. The first process renames, between
        two barriers that every process passes (as Orbax's own saves do); then each lists
        the steps afresh."""
        import jax
        from jax.experimental import multihost_utils
        several = jax.process_count() > 1
        if several:
            multihost_utils.sync_global_devices("slurm-ext checkpoints listed")
        failed = None
        for step in steps if jax.process_index() == 0 else ():
            aside, n = self.directory / f"{step}.unreadable", 1
            while aside.exists():
                n += 1
                aside = self.directory / f"{step}.unreadable.{n}"
            try:
                (self.directory / str(step)).rename(aside)
                log.warning("checkpoint of step %d set aside as %s", step, aside.name)
            except OSError as e:
                failed = f"{self.directory / str(step)}: unreadable, and cannot be set aside ({e.strerror}): " \
                         "move it away by hand"
                break
        if several:
            multihost_utils.sync_global_devices("slurm-ext checkpoints set aside")
        if agree(float(bool(failed))) > 0:  # every process stops, not the first alone
            raise CheckpointError(failed or f"{self.directory}: a newer checkpoint than the one to resume from "
                                            "could not be set aside (see the first process's log)")
        if steps or several:
            self.manager.reload()

    def save(self, step: int, arrays, meta: dict) -> None:
        """Start writing step ``step`` (asynchronously: :meth:`wait` before exiting)."""
        ocp = self._ocp
        meta = {**meta, "format": FORMAT_VERSION, "step": int(step)}
        self.manager.save(step, args=ocp.args.Composite(**{
            ARRAYS: ocp.args.StandardSave(arrays), META: ocp.args.JsonSave(meta)}), force=True)
        log.info("checkpoint step %d: writing to %s", step, self.directory / str(step))

    def wait(self) -> None:
        """Block until every started save is complete on disk."""
        self.manager.wait_until_finished()

    def restore(self, step: int, target):
        """The saved arrays of ``step`` read into ``target``'s shapes and shardings (a pytree
        of ``jax.ShapeDtypeStruct`` with ``sharding``), whatever the saving plan was.

        Raises:
            CheckpointDamaged: its files cannot be read (tensorstore's data-loss errors:
                truncated or lost array files).
            CheckpointError: its arrays are not ``target``'s.
        """
        ocp = self._ocp
        try:
            out = self.manager.restore(step, args=ocp.args.Composite(**{ARRAYS: ocp.args.StandardRestore(target)}))
        except (ValueError, KeyError) as e:
            first, lost = _first_line(e), self.reader(step).manifest_lost  # CheckpointDamaged without its metadata
            if first.startswith(DAMAGE_STATUSES) or (lost and first.startswith("NOT_FOUND")):
                raise CheckpointDamaged(f"{self.directory / str(step)}: cannot be read ({first})") from None
            raise CheckpointError(f"{self.directory / str(step)}: does not match this job's state ({first})") from None
        return out[ARRAYS]

    def reader(self, step: int) -> ArrayReader:
        return ArrayReader(self.directory / str(step) / ARRAYS)

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()
