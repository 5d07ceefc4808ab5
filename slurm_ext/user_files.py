"""Files the daemon, which runs as root, reads on a user's behalf: a job's model YAML and
its runner's ``measured.json``.

A user controls what such a path names. Each read therefore opens the file once, without
blocking (a FIFO would hang every round), checks what it opened (``fstat``: a regular
file, no larger than the caller allows; for a model, one its owner could read) and reads
only from that descriptor, so a file swapped for a symlink to ``/etc/shadow`` after a
check is never read.
"""

from __future__ import annotations

import os
import pwd
import stat

from estimator.errors import SpecError


def _uid_of(user: str | None) -> int | None:
    try:
        return pwd.getpwnam(user).pw_uid if user else None
    except KeyError:
        return None


def read_user_file(path: str, max_bytes: int, owner: str | None = None) -> bytes:
    """The bytes of the regular file at ``path``, of at most ``max_bytes``.

    Args:
        owner: when given, the file must be one this user could read (owned by them and
            readable by its owner, or readable by everyone).

    Raises:
        OSError: it cannot be opened (missing, a dangling link, ...).
        SpecError: not a regular file, too large, or not readable by ``owner``.
    """
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size > max_bytes:
            raise SpecError("file", path, f"give a regular file of at most {max_bytes} bytes")
        if owner is not None:
            uid = _uid_of(owner)
            if not (st.st_mode & stat.S_IROTH or (uid is not None and st.st_uid == uid
                                                  and st.st_mode & stat.S_IRUSR)):
                raise SpecError("file", path, "the file must be readable by the job's owner "
                                              "(owned by them or world-readable)")
        chunks, left = [], max_bytes + 1
        while left > 0 and (chunk := os.read(fd, min(left, 1 << 16))):
            chunks.append(chunk)
            left -= len(chunk)
        data = b"".join(chunks)
        if len(data) > max_bytes:  # grew after the fstat
            raise SpecError("file", path, f"give a regular file of at most {max_bytes} bytes")
        return data
    finally:
        os.close(fd)
