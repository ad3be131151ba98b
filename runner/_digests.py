"""File integrity: sha256 digests recorded when a checkpoint is written, verified before a load.

One helper family, used by the run-level manifest (`runner.checkpoints`: every file of the
resumable state, the promotable weights and the KL reference) and by the local backend's own
checkpoint files (`runner.local.checkpoint`: the orbax tree's files in ``meta.json``, a digest of
the tensor data in each safetensors header), so that a flipped byte anywhere fails closed naming
the file before any of its bytes is used.

Digests are ``"sha256:<hex>"`` strings; file maps are ``{relative posix path: digest}`` sorted by
path. Reading is streamed in 4 MiB blocks (`hashlib.file_digest`), so memory stays flat.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

ALGORITHM = "sha256"
_PREFIX = f"{ALGORITHM}:"


class IntegrityError(ValueError):
    """A file's content differs from the digest recorded when it was written."""


def file_digest(path: str | Path) -> str:
    """``"sha256:<hex>"`` of one file's bytes."""
    with open(path, "rb") as f:
        return _PREFIX + hashlib.file_digest(f, ALGORITHM).hexdigest()


def bytes_digest(chunks: Iterable[bytes | memoryview]) -> str:
    """``"sha256:<hex>"`` of the concatenation of ``chunks`` (hashed incrementally)."""
    h = hashlib.new(ALGORITHM)
    for chunk in chunks:
        h.update(chunk)
    return _PREFIX + h.hexdigest()


def tree_digests(path: str | Path, base: str | Path) -> dict[str, str]:
    """Digests of ``path`` (a file, or every file under a directory), keyed relative to ``base``.

    Raises:
      FileNotFoundError: ``path`` does not exist.
    """
    path, base = Path(path), Path(base)
    if path.is_file():
        files = [path]
    elif path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file())
    else:
        raise FileNotFoundError(f"cannot digest {path}: no such file or directory")
    return {p.relative_to(base).as_posix(): file_digest(p) for p in files}


def verify_tree(
    base: str | Path,
    digests: Mapping[str, str],
    *,
    what: str,
    under: str | Path | None = None,
) -> None:
    """Checks every file of ``digests`` (paths relative to ``base``) against its digest.

    Args:
      base: the directory the recorded paths are relative to.
      digests: ``{relative path: "sha256:<hex>"}`` as `tree_digests` returned it.
      what: what the files are, for the message (``"resumable state"``).
      under: optionally, a directory (relative to ``base``) that must hold no file besides the
        recorded ones (an added file is as foreign as a changed one).

    Raises:
      IntegrityError: a file is missing, differs, a recorded path escapes ``base``, or ``under``
        holds an unrecorded file; the message names the file.
    """
    base = Path(base)
    if not isinstance(digests, Mapping) or not digests:
        raise IntegrityError(f"{what}: no file digests recorded; cannot verify its files")
    root = base.resolve()
    for rel, expected in sorted(digests.items()):
        path = base / rel
        if not isinstance(expected, str) or not expected.startswith(_PREFIX):
            raise IntegrityError(f"{what}: digest of {path} is not a {ALGORITHM} digest")
        if Path(rel).is_absolute() or not path.resolve().is_relative_to(root):
            raise IntegrityError(f"{what}: recorded file {rel!r} is outside {base}")
        if not path.is_file():
            raise IntegrityError(f"{what}: file {path} is missing")
        if file_digest(path) != expected:
            raise IntegrityError(
                f"{what}: file {path} is corrupted or was modified (its {ALGORITHM} differs from "
                "the one recorded when it was written)"
            )
    if under is not None:
        top = base / under
        recorded = {(base / rel).resolve() for rel in digests}
        for p in sorted(top.rglob("*")) if top.is_dir() else []:
            if p.is_file() and p.resolve() not in recorded:
                raise IntegrityError(f"{what}: file {p} was not part of it when it was written")


def check_finite(arr: Any, where: str) -> None:
    """Raises `IntegrityError` naming ``where`` (file and tensor) when a floating tensor read
    from disk holds a NaN or an infinity: weights are checked at load, not found by the first
    forward that produces NaN."""
    a = np.asarray(arr)
    if not np.issubdtype(a.dtype, np.floating) and a.dtype.kind != "V":
        return
    if a.dtype.kind == "V" or a.dtype.itemsize < 4:  # bfloat16 / float16: count in float32
        try:
            a = a.astype(np.float32)
        except (TypeError, ValueError):  # a structured dtype: not weights
            return
    bad = a.size - int(np.count_nonzero(np.isfinite(a)))
    if bad:
        first = np.unravel_index(int(np.argmin(np.isfinite(a))), a.shape) if a.ndim else ()
        raise IntegrityError(
            f"{where}: {bad} of {a.size} values are NaN or infinite (the first at index "
            f"{list(map(int, first))}); refusing to load non-finite weights"
        )
