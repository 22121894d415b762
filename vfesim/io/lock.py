"""One writer per run store: an exclusive ``flock`` on ``.<NAME>.lock`` beside ``NAME``.

The lock file sits beside the store (not inside) so it exists before the store does: a run being
created, resumed or overwritten holds it from its first check to its end, and a second vfesim
process on the same path fails at once instead of racing it. The kernel drops the lock when the
holder dies (SIGKILL included), so a leftover lock file never blocks anyone; it is never deleted,
because deleting a lock file lets two processes lock two different files.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator
from pathlib import Path

from .store import StoreError

__all__ = ["store_lock", "lock_path"]


def lock_path(path: str | Path) -> Path:
    """The lock file of the store ``path`` (beside it, in the directory that holds it)."""
    path = Path(path).absolute()
    return path.parent / f".{path.name}.lock"


@contextlib.contextmanager
def store_lock(path: str | Path) -> Iterator[Path]:
    """Hold the exclusive lock of the store ``path`` for the ``with`` block.

    Raises StoreError naming ``path`` when another process holds it or the lock file cannot be made.
    """
    lock = lock_path(path)
    try:
        lock.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
        raise StoreError(f"{path}: output location is not writable ({e.strerror or e})") from e
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "?"
            raise StoreError(
                f"{path}: in use by another vfesim process (pid {holder}, lock file {lock}); "
                "wait for it to finish, or choose another output path"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)  # for the message above; the flock is the lock
        yield lock
    finally:
        os.close(fd)
