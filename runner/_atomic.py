"""Atomic, durable file writes: the one helper family every checkpoint writer uses.

A write goes to a temporary sibling with a unique name (``.<name>.tmp-<hex>``), is flushed and
fsynced, then ``os.replace``-d onto the final name, and the parent directory is fsynced so the
rename itself survives a power loss. A crash or an exception at any point leaves either the old
file or the new one, never a torn one; on an exception the temporary file is removed.

`atomic_path` is the general form, for writers that want a path rather than bytes (safetensors'
``save_file``, matplotlib's ``savefig``); `publish_dir` atomically publishes a directory that was
built under a temporary name (a rename of a new directory, then a directory fsync).

`ensure_space` checks before a large write that the file system can hold it: a checkpoint
library that runs out of space half-way (orbax's threads, tensorstore's callbacks) prints pages
of tracebacks from its own threads before its error arrives; checked first, a full disk is one
``OSError`` naming the directory, the bytes needed and the bytes free.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

__all__ = [
    "atomic_path",
    "atomic_write_bytes",
    "atomic_write_json",
    "atomic_write_text",
    "disk_full",
    "ensure_space",
    "full_disk_as_oserror",
    "is_disk_full",
    "fsync_dir",
    "fsync_file",
    "make_dirs",
    "publish_dir",
    "tmp_sibling",
]


def fsync_file(path: str | os.PathLike) -> None:
    """Flushes a written file's data to stable storage."""
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def fsync_dir(path: str | os.PathLike) -> None:
    """Flushes a directory's entries (creations, renames) to stable storage.

    A no-op where directories cannot be opened (Windows).
    """
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # pragma: no cover - platforms without directory fds
        return
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover - filesystems that refuse directory fsync
        pass
    finally:
        os.close(fd)


#: Room left beyond a write's own bytes (metadata, the manifest and JSONL lines after it).
SPACE_MARGIN_BYTES = 1 << 20
#: A write's bytes on disk relative to its arrays (orbax's OCDBT index, safetensors' header).
SPACE_OVERHEAD = 1.25


def disk_full(path: str | os.PathLike, detail: str) -> OSError:
    """The one error a full file system gives: ``ENOSPC`` with ``path`` and ``detail``."""
    return OSError(errno.ENOSPC, f"No space left on device ({detail})", str(path))


def ensure_space(directory: str | os.PathLike, nbytes: int) -> None:
    """Raises `disk_full` unless the file system of ``directory`` has room for ``nbytes`` (times
    `SPACE_OVERHEAD`, plus `SPACE_MARGIN_BYTES`). ``directory`` must exist."""
    need = int(nbytes * SPACE_OVERHEAD) + SPACE_MARGIN_BYTES
    free = shutil.disk_usage(directory).free
    if free < need:
        raise disk_full(directory, f"a checkpoint write needs about {need:,} bytes, {free:,} free")


def is_disk_full(exc: BaseException) -> bool:
    """Whether ``exc`` (an OSError, or a library's own error type: tensorstore's
    ``RESOURCE_EXHAUSTED``, safetensors' ``SafetensorError``) reports a full file system."""
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    text = str(exc)
    return "No space left on device" in text or "os_error_code='28'" in text


@contextlib.contextmanager
def full_disk_as_oserror(path: str | os.PathLike, detail: str) -> Iterator[None]:
    """Turns a library's full-disk error inside the block into `disk_full` (``path``,
    ``detail``), without the library's chained traceback; other errors pass unchanged."""
    try:
        yield
    except Exception as exc:
        if is_disk_full(exc):
            raise disk_full(path, detail) from None
        raise


def tmp_sibling(path: str | os.PathLike, suffix: str = "") -> Path:
    """A unique temporary name beside ``path``: ``.<name>.tmp-<hex><suffix>``."""
    path = Path(path)
    return path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex[:12]}{suffix}")


def make_dirs(path: str | os.PathLike) -> Path:
    """``mkdir -p`` that fsyncs the parent of every directory it creates (so they persist)."""
    path = Path(path)
    missing = []
    p = path
    while not p.is_dir():
        missing.append(p)
        if p.parent == p:
            break
        p = p.parent
    path.mkdir(parents=True, exist_ok=True)
    for d in reversed(missing):
        fsync_dir(d.parent)
    return path


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike, suffix: str = "") -> Iterator[Path]:
    """Yields a temporary sibling of ``path`` to write; on a clean exit publishes it atomically.

    On exit the temporary file is fsynced, ``os.replace``-d onto ``path`` and the parent
    directory fsynced. If the body (or the publish) raises, the temporary file is removed and
    ``path`` is untouched. ``suffix`` keeps an extension writers may need (``".png"``).
    """
    path = Path(path)
    make_dirs(path.parent)
    tmp = tmp_sibling(path, suffix)
    try:
        yield tmp
        fsync_file(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Atomically and durably replaces ``path`` with ``data``."""
    data = bytes(data)
    with atomic_path(path) as tmp, open(tmp, "wb") as f:
        f.write(data)
        f.flush()


def atomic_write_text(path: str | os.PathLike, text: str, encoding: str = "utf-8") -> None:
    """Atomically and durably replaces ``path`` with ``text``."""
    atomic_write_bytes(path, text.encode(encoding))


def atomic_write_json(path: str | os.PathLike, data: Any) -> None:
    """Atomically writes ``data`` as JSON (sorted keys, indent 2, trailing newline).

    ``data`` is serialized before anything is written, so a value that cannot be serialized
    leaves no file behind.
    """
    atomic_write_text(path, json.dumps(data, sort_keys=True, indent=2) + "\n")


def publish_dir(tmp: str | os.PathLike, final: str | os.PathLike) -> None:
    """Atomically publishes a fully written directory ``tmp`` as ``final`` (a new name).

    Fsyncs ``tmp`` (its entries), renames it onto ``final`` and fsyncs the parent of ``final``.
    Files inside ``tmp`` must already be fsynced by their writers.
    """
    tmp, final = Path(tmp), Path(final)
    fsync_dir(tmp)
    os.replace(tmp, final)
    fsync_dir(final.parent)
