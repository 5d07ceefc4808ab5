"""Files the daemon, which runs as root, reads on a user's behalf: a job's model YAML and
its runner's ``measured.json``.

A user controls what such a path names. Each read therefore opens the file once, without
blocking (a FIFO would hang every round), checks what it opened (``fstat``: a regular
file, no larger than the caller allows; for a model, one its owner could open: read
permission on it, search permission on the directories above it) and reads
only from that descriptor, so a file swapped for a symlink to ``/etc/shadow`` after a
check is never read.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import stat

from estimator.errors import SpecError


def _ids_of(user: str) -> tuple[int, frozenset[int]] | None:
    """The user's uid and groups (None: no such user)."""
    try:
        pw = pwd.getpwnam(user)
        return pw.pw_uid, frozenset(os.getgrouplist(user, pw.pw_gid))
    except (KeyError, OSError):
        return None


def _may(st: os.stat_result, ids: tuple[int, frozenset[int]], user_bit: int, group_bit: int, other_bit: int) -> bool:
    """Whether the user has a permission on a file of ``st`` (Unix's owner, group, other)."""
    uid, gids = ids
    if uid == 0:
        return True
    if st.st_uid == uid:
        return bool(st.st_mode & user_bit)
    if st.st_gid in gids:
        return bool(st.st_mode & group_bit)
    return bool(st.st_mode & other_bit)


def _may_search(directory: str, ids: tuple[int, frozenset[int]]) -> bool:
    """Whether the user may search ``directory`` and every directory above it."""
    while True:
        try:
            if not _may(os.stat(directory), ids, stat.S_IXUSR, stat.S_IXGRP, stat.S_IXOTH):
                return False
        except OSError:
            return False
        if directory == "/":
            return True
        directory = os.path.dirname(directory)


def _owner_may_read(fd: int, st: os.stat_result, ids: tuple[int, frozenset[int]]) -> bool:
    """Whether the user could have opened what ``fd`` is: read permission on the file and
    search permission on every directory above it (a world-readable file in someone's
    0700 home is not theirs to read)."""
    return _may(st, ids, stat.S_IRUSR, stat.S_IRGRP, stat.S_IROTH) and \
        _may_search(os.path.dirname(os.path.realpath(f"/proc/self/fd/{fd}")), ids)


def read_user_file(path: str, max_bytes: int, owner: str | None = None) -> bytes:
    """The bytes of the regular file at ``path``, of at most ``max_bytes``.

    Args:
        owner: when given, the file must be one this user could read (owned by them and
            readable by its owner, or readable by everyone).

    Raises:
        OSError: it cannot be opened (missing, a dangling link, ...), where ``owner`` may
            look.
        SpecError: not a regular file, too large, or not readable by ``owner``: nothing
            else is said of a path where ``owner`` may not look (whether it exists, what
            it is), and nothing there is opened (a device's open may act).
    """
    not_theirs = SpecError("file", path, "the file must be readable by the job's owner "
                                         "(owned by them or world-readable, in directories they may enter)")
    not_a_file = SpecError("file", path, f"give a regular file of at most {max_bytes} bytes")
    ids = _ids_of(owner) if owner is not None else None
    if owner is not None:
        if ids is None or not _may_search(os.path.dirname(os.path.realpath(path)), ids):
            raise not_theirs
        with contextlib.suppress(OSError):  # missing: the open below says so
            if not stat.S_ISREG(os.stat(path).st_mode):
                raise not_a_file  # never opened
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if ids is not None and not _owner_may_read(fd, st, ids):
            raise not_theirs
        if not stat.S_ISREG(st.st_mode) or st.st_size > max_bytes:
            raise not_a_file
        chunks, left = [], max_bytes + 1
        while left > 0 and (chunk := os.read(fd, min(left, 1 << 16))):
            chunks.append(chunk)
            left -= len(chunk)
        data = b"".join(chunks)
        if len(data) > max_bytes:  # grew after the fstat
            raise not_a_file
        return data
    finally:
        os.close(fd)
