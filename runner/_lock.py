"""One process per run directory: an exclusive OS file lock (released on exit or death)."""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator
from pathlib import Path

LOCK_NAME = ".lock"


class RunLockedError(ValueError):
    """Another live process holds the run directory's lock."""


@contextlib.contextmanager
def run_lock(run_dir: Path) -> Iterator[Path]:
    """Holds ``run_dir/.lock`` exclusively (``flock``) for the duration of the block.

    The lock file records the holder's pid. The OS releases the lock when the holding process
    exits or dies (SIGKILL included), so a stale lock file never blocks a later run.

    Raises:
      RunLockedError: another process holds the lock (the message names its pid).
    """
    path = Path(run_dir) / LOCK_NAME
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
            raise RunLockedError(
                f"run directory {run_dir} is in use by another process (pid {holder}): one "
                "process per run; wait for it or choose another --name"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield path
    finally:
        os.close(fd)  # closing the descriptor releases the lock


def check_unlocked(run_dir: Path) -> None:
    """Raises `RunLockedError` at once if a live process holds ``run_dir``'s lock (a probe that
    takes and drops the lock; it creates nothing)."""
    path = Path(run_dir) / LOCK_NAME
    if path.exists():
        with run_lock(run_dir):
            pass
