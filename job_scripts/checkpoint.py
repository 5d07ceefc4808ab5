"""Checkpoints: full (unsharded) arrays in .npz, written atomically, verified on load.

A checkpoint of step N in directory D is two files:

- ``D/ckpt-0000000N.npz``: every array of the training state under a plan-independent
  name (``params/layer_003/...``, ``opt/...``), unsharded, so any plan (other dp, tp,
  stage split or GPU count) can load it;
- ``D/ckpt-0000000N.json``: the manifest — step, SHA-256 and size of the .npz, and
  metadata (model, global batch, plan, data position). The manifest is written last: a
  checkpoint without one, or whose .npz does not match its checksum, does not exist.

Both are written to a temporary name, fsynced and renamed, then the directory is
fsynced, so a kill at any instant leaves either the old set or the new one. Loading
takes the newest checkpoint that verifies and falls back to older ones. Saving keeps
the newest ``keep`` checkpoints.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

log = logging.getLogger(__name__)

_NAME = re.compile(r"ckpt-(\d{8,})\.json")
FORMAT_VERSION = 1


class CheckpointError(RuntimeError):
    """A checkpoint cannot be written or none can be read (names the path and why)."""


@dataclass(frozen=True)
class Checkpoint:
    """A verified checkpoint loaded into host memory.

    Attributes:
        step: the last completed training step.
        arrays: plan-independent name → full array.
        meta: the metadata saved with it (model, plan, data position, ...).
        path: the .npz file it came from.
    """

    step: int
    arrays: dict[str, np.ndarray]
    meta: dict
    path: Path


def _paths(directory: Path, step: int) -> tuple[Path, Path]:
    stem = f"ckpt-{step:08d}"
    return directory / f"{stem}.npz", directory / f"{stem}.json"


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def write_json_atomic(path: Path, obj: object) -> None:
    """Write JSON to ``path`` through a temporary file, fsync and rename."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1, sort_keys=True)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def save_checkpoint(directory: Path | str, step: int, arrays: dict[str, np.ndarray],
                    meta: dict, keep: int = 2) -> Path:
    """Write the checkpoint of ``step`` atomically and prune older ones.

    Args:
        directory: the job's checkpoint directory (created if missing).
        step: the last completed step.
        arrays: plan-independent name → full host array.
        meta: JSON-serialisable metadata stored in the manifest.
        keep: how many of the newest checkpoints to keep (at least 1).

    Returns:
        The path of the .npz written.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    npz_path, manifest_path = _paths(directory, step)
    tmp = npz_path.with_name(npz_path.name + ".tmp")
    with open(tmp, "wb") as f:
        np.savez(f, **arrays)
        f.flush()
        os.fsync(f.fileno())
    digest, size = _sha256(tmp), tmp.stat().st_size
    os.replace(tmp, npz_path)
    _fsync_dir(directory)
    write_json_atomic(manifest_path, {
        "format": FORMAT_VERSION, "step": int(step), "file": npz_path.name,
        "sha256": digest, "bytes": size, "meta": meta,
    })
    log.info("checkpoint step %d written to %s (%d bytes)", step, npz_path, size)
    prune_checkpoints(directory, keep)
    return npz_path


def list_checkpoints(directory: Path | str) -> list[int]:
    """Steps that have a manifest, newest first (not yet verified)."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    steps = [int(m.group(1)) for p in directory.iterdir() if (m := _NAME.fullmatch(p.name))]
    return sorted(steps, reverse=True)


def prune_checkpoints(directory: Path | str, keep: int) -> None:
    """Delete all but the newest ``keep`` checkpoints, and leftover temporary files."""
    directory = Path(directory)
    keep = max(1, keep)
    for step in list_checkpoints(directory)[keep:]:
        npz_path, manifest_path = _paths(directory, step)
        # Manifest first: a half-deleted checkpoint must never look valid.
        manifest_path.unlink(missing_ok=True)
        npz_path.unlink(missing_ok=True)
    for p in directory.glob("*.tmp"):
        p.unlink(missing_ok=True)


def _load_one(directory: Path, step: int) -> Checkpoint:
    npz_path, manifest_path = _paths(directory, step)
    try:
        manifest = json.loads(manifest_path.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{manifest_path}: unreadable manifest ({e})") from None
    if not isinstance(manifest, dict) or manifest.get("step") != step:
        raise CheckpointError(f"{manifest_path}: manifest does not describe step {step}")
    if not npz_path.exists():
        raise CheckpointError(f"{npz_path}: missing")
    digest = _sha256(npz_path)
    if digest != manifest.get("sha256"):
        raise CheckpointError(
            f"{npz_path}: checksum {digest[:12]}… does not match the manifest's "
            f"{str(manifest.get('sha256'))[:12]}… (corrupt or partial)")
    try:
        with np.load(npz_path, allow_pickle=False) as npz:
            arrays = {name: npz[name] for name in npz.files}
    except (OSError, ValueError, zipfile.BadZipFile) as e:
        raise CheckpointError(f"{npz_path}: unreadable ({e})") from None
    return Checkpoint(step, arrays, dict(manifest.get("meta") or {}), npz_path)


def load_latest(directory: Path | str) -> Checkpoint | None:
    """The newest checkpoint that verifies, or None when the directory has none.

    A checkpoint that fails verification is logged and skipped, so a corrupt newest
    checkpoint falls back to the previous one.

    Raises:
        CheckpointError: checkpoints exist but none verifies.
    """
    directory = Path(directory)
    steps = list_checkpoints(directory)
    problems = []
    for step in steps:
        try:
            return _load_one(directory, step)
        except CheckpointError as e:
            log.warning("skipping checkpoint of step %d: %s", step, e)
            problems.append(str(e))
    if problems:
        raise CheckpointError(f"no valid checkpoint in {directory}: " + "; ".join(problems))
    return None
