"""Atomic checkpoints of the local trainer: resumable state (orbax) and sampler weights (safetensors).

Layout under ``checkpoint_dir``::

    state/<name>/CURRENT            # "v-<hex>": the complete version; replaced atomically, last
    state/<name>/v-<hex>/meta.json  # format, step, model config, the tree files' sha256
    state/<name>/v-<hex>/tree/      # orbax-checkpoint pytree {"params", "opt_state"}
    sampler/<name>.safetensors      # inference weights only, per-layer names; the header
                                    # records the sha256 of the tensor data

Integrity. ``meta.json`` records the sha256 of every file of ``tree/`` and the safetensors header
the sha256 of the tensors (names, dtypes, shapes and bytes); both are verified before anything
is used (`verify_state`, `load_weights`), so a flipped byte fails closed naming the file. The
run-level manifest (`runner.checkpoints`) additionally records the digest of every file,
``meta.json`` included.

Atomicity. A resumable save writes a fresh ``tmp-<hex>`` directory beside the versions, renames
it to ``v-<hex>`` (a rename of a new directory), then points ``CURRENT`` at it with
``os.replace`` of a temporary file, and only then deletes the older versions. A crash (or an
exception) at any point before the ``CURRENT`` replace leaves the previous checkpoint of the
same name — and every other checkpoint — loadable; leftovers are ignored and swept by the next
save of that name. A sampler save writes ``.<name>.safetensors.tmp-<hex>`` and ``os.replace``-s
it onto the final name. Files are fsynced before each rename and directories after it (all
through `runner._atomic`).

Names are ``[A-Za-z0-9][A-Za-z0-9._-]*`` (at most 128 characters), so a name never escapes the
checkpoint directory.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
import time
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from runner._atomic import (
    atomic_path,
    atomic_write_text,
    ensure_space,
    full_disk_as_oserror,
    make_dirs,
    publish_dir,
)
from runner._digests import (
    IntegrityError,
    bytes_digest,
    check_finite,
    tree_digests,
    verify_tree,
)

#: 2: integrity digests (a version-1 checkpoint, written without them, is refused).
FORMAT_VERSION = 2
STATE_KIND = "foldloss.local.state"
SAMPLER_KIND = "foldloss.local.sampler"
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_CURRENT = "CURRENT"


def check_name(name: Any) -> str:
    """Validates a checkpoint name (raises ``ValueError``)."""
    if not isinstance(name, str) or not _NAME_RE.match(name) or name.endswith(".safetensors"):
        raise ValueError(
            f"invalid checkpoint name {name!r}: use letters, digits, '.', '_', '-' (starting with "
            "a letter or digit, at most 128 characters)"
        )
    return name


# -- resumable state ----------------------------------------------------------------------------


def write_tree(directory: Path, tree: Any) -> None:
    """Writes a pytree of arrays with orbax-checkpoint into ``directory`` (which must not exist).

    Module-level so tests can monkeypatch it to simulate a crash mid-write.
    """
    import orbax.checkpoint as ocp

    ensure_space(directory.parent, tree_nbytes(tree))
    with _quiet_library_logs():
        ckptr = ocp.StandardCheckpointer()
        try:  # a disk filled during the write (the check above saw room): one OSError
            with full_disk_as_oserror(directory, "while orbax wrote the state"):
                ckptr.save(directory.absolute(), tree)
                ckptr.wait_until_finished()
        finally:
            ckptr.close()


def tree_nbytes(tree: Any) -> int:
    """The bytes of a pytree's arrays."""
    import jax

    return sum(
        int(x.nbytes) if hasattr(x, "nbytes") else np.asarray(x).nbytes
        for x in jax.tree_util.tree_leaves(tree)
    )


@contextlib.contextmanager
def _quiet_library_logs():
    """orbax logs each failed thread (absl) and asyncio each unretrieved task exception; the
    write's own exception says it once, so those loggers are raised to CRITICAL meanwhile."""
    loggers = [logging.getLogger(name) for name in ("absl", "asyncio")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels, strict=True):
            lg.setLevel(level)


def read_tree(directory: Path, target: Any) -> Any:
    """Restores a pytree written by `write_tree` into the structure/shardings of ``target``."""
    import orbax.checkpoint as ocp

    ckptr = ocp.StandardCheckpointer()
    try:
        return ckptr.restore(directory.absolute(), target)
    finally:
        ckptr.close()


def save_state(root: Path, name: str, tree: Any, meta: Mapping[str, Any]) -> str:
    """Atomically saves resumable state under ``root/state/<name>``; returns that path."""
    check_name(name)
    base = make_dirs(Path(root) / "state" / name)
    token = uuid.uuid4().hex[:16]
    tmp = base / f"tmp-{token}"
    tmp.mkdir()
    try:
        write_tree(tmp / "tree", tree)
        meta = dict(meta, format_version=FORMAT_VERSION, kind=STATE_KIND, name=name)
        meta["files"] = tree_digests(tmp / "tree", tmp)
        meta["saved_at_ns"] = time.time_ns()
        atomic_write_text(tmp / "meta.json", json.dumps(meta, sort_keys=True, indent=1) + "\n")
        version = base / f"v-{token}"
        publish_dir(tmp, version)
        atomic_write_text(base / _CURRENT, version.name + "\n")
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    for old in base.iterdir():  # sweep older versions and leftovers of interrupted saves
        if old.is_dir() and old.name != version.name:
            shutil.rmtree(old, ignore_errors=True)
        elif old.name.startswith(f".{_CURRENT}.tmp-"):
            old.unlink(missing_ok=True)
    return str(base)


def _current_version(base: Path) -> Path | None:
    try:
        version = (base / _CURRENT).read_text().strip()
    except (FileNotFoundError, NotADirectoryError):
        return None
    path = base / version
    if not version.startswith("v-") or not (path / "meta.json").is_file():
        return None
    return path


def list_states(root: Path | None) -> list[str]:
    """Names of complete resumable checkpoints under ``root``, oldest save first."""
    if root is None:
        return []
    states = Path(root) / "state"
    if not states.is_dir():
        return []
    found = []
    for base in states.iterdir():
        version = _current_version(base) if _NAME_RE.match(base.name) else None
        if version is not None:
            try:
                meta = json.loads((version / "meta.json").read_text())
            except (OSError, UnicodeDecodeError, json.JSONDecodeError):
                continue  # unreadable: not a complete checkpoint
            if isinstance(meta, dict):
                found.append((meta.get("saved_at_ns", 0), base.name))
    return [name for _, name in sorted(found)]


def resolve_state(root: Path | None, ref: Any) -> Path:
    """The complete version directory of a state reference (a name or a path from `save_state`).

    Raises:
      FileNotFoundError: no complete checkpoint at ``ref`` (the message lists the known names).
    """
    if not isinstance(ref, str | os.PathLike) or not str(ref):
        raise ValueError(f"checkpoint reference must be a non-empty string, got {ref!r}")
    candidates = []
    if isinstance(ref, str) and _NAME_RE.match(ref) and root is not None:
        candidates.append(Path(root) / "state" / ref)
    candidates.append(Path(ref))
    for base in candidates:
        version = _current_version(base)
        if version is not None:
            return version
    known = list_states(root)
    raise FileNotFoundError(
        f"no complete resumable checkpoint at {str(ref)!r} (checkpoint_dir={root}); "
        f"known checkpoints: {known}"
    )


def read_meta(version: Path) -> dict:
    """The version's ``meta.json``, after verifying every tree file against its digests.

    Raises:
      ValueError: not a checkpoint of this format; `IntegrityError` (a ``ValueError``): a tree
        file is missing, modified or foreign (the message names it).
    """
    path = version / "meta.json"
    try:
        meta = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise IntegrityError(f"{path} is unreadable or corrupted: {exc}") from None
    if not isinstance(meta, dict):
        raise IntegrityError(f"{path} is corrupted: not a JSON object")
    if meta.get("format_version") != FORMAT_VERSION or meta.get("kind") != STATE_KIND:
        raise ValueError(
            f"{version}: not a {STATE_KIND} checkpoint of format {FORMAT_VERSION} "
            f"(kind={meta.get('kind')!r}, format_version={meta.get('format_version')!r})"
        )
    verify_tree(version, meta.get("files"), what=f"checkpoint {version}", under="tree")
    if meta.get("name") != version.parent.name:
        # The state's own name (a run's checkpoints carry its run id and step in it) is inside
        # the verified files: a state moved or copied under another name is not that state.
        raise IntegrityError(
            f"{path} records the state saved as {meta.get('name')!r}, not "
            f"{version.parent.name!r}: the checkpoint was moved, copied or edited"
        )
    return meta


# -- sampler weights ----------------------------------------------------------------------------


def save_weights(root: Path, name: str, tensors: Mapping[str, np.ndarray], meta: Mapping) -> str:
    """Atomically writes ``root/sampler/<name>.safetensors``; returns its path."""
    from safetensors.numpy import save_file

    check_name(name)
    final = make_dirs(Path(root) / "sampler") / f"{name}.safetensors"
    arrays = {k: np.ascontiguousarray(v) for k, v in tensors.items()}
    metadata = {"format": SAMPLER_KIND, "format_version": str(FORMAT_VERSION)}
    metadata.update({k: json.dumps(v, sort_keys=True) for k, v in meta.items()})
    metadata["data_sha256"] = tensors_digest(arrays)
    ensure_space(final.parent, sum(a.nbytes for a in arrays.values()))
    # safetensors raises its own error type for ENOSPC
    with full_disk_as_oserror(final, "while writing sampler weights"), atomic_path(final) as tmp:
        save_file(arrays, tmp, metadata=metadata)
    return str(final)


def tensors_digest(tensors: Mapping[str, np.ndarray]) -> str:
    """sha256 over the tensors in name order: each name, dtype, shape and raw bytes."""

    def chunks():
        for k in sorted(tensors):
            v = np.ascontiguousarray(tensors[k])
            yield f"{k}\0{v.dtype.str}\0{v.shape}\0".encode()
            # raw bytes via a uint8 view: also for dtypes without a buffer format (bfloat16)
            yield memoryview(v.reshape(-1).view(np.uint8)) if v.size else b""

    return bytes_digest(chunks())


def resolve_weights(root: Path | None, ref: Any) -> Path:
    """A sampler-weights path from a path or a name under ``root/sampler``."""
    if not isinstance(ref, str | os.PathLike) or not str(ref):
        raise ValueError(f"weights reference must be a non-empty string, got {ref!r}")
    path = Path(ref)
    if path.is_file():
        return path
    if isinstance(ref, str) and _NAME_RE.match(ref) and root is not None:
        named = Path(root) / "sampler" / f"{ref}.safetensors"
        if named.is_file():
            return named
    raise FileNotFoundError(f"no sampler weights at {str(ref)!r} (checkpoint_dir={root})")


def load_weights(path: Path) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """Reads a sampler checkpoint: ``(tensors by name, metadata with JSON values decoded)``.

    The tensor data is verified against the header's ``data_sha256`` before it is returned.

    Raises:
      IntegrityError: the file is unreadable, has no digest, or its tensors differ from it.
      ValueError: not a sampler checkpoint of this format.
    """
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="numpy") as f:
            raw_meta = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except Exception as exc:  # noqa: BLE001 - safetensors raises its own error types
        raise IntegrityError(f"sampler weights {path} are unreadable or corrupted: {exc}") from None
    if raw_meta.get("format") != SAMPLER_KIND or raw_meta.get("format_version") != str(
        FORMAT_VERSION
    ):
        raise ValueError(
            f"{path}: not a {SAMPLER_KIND} safetensors file of format {FORMAT_VERSION}"
        )
    recorded = raw_meta.get("data_sha256")
    if not recorded or tensors_digest(tensors) != recorded:
        raise IntegrityError(
            f"sampler weights {path} are corrupted or were modified: their tensors' sha256 "
            "differs from the one recorded when they were written"
        )
    for name, arr in tensors.items():
        check_finite(arr, f"sampler weights {path}: tensor {name!r}")
    try:
        meta = {
            k: (json.loads(v) if k not in ("format", "format_version", "data_sha256") else v)
            for k, v in raw_meta.items()
        }
    except json.JSONDecodeError as exc:
        raise IntegrityError(f"sampler weights {path}: corrupted metadata: {exc}") from None
    return tensors, meta
