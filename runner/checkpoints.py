"""Run-level checkpoints: resumable state + run state + optional promotable weights, a manifest.

Layout under ``runs/<name>/checkpoints/`` (after docs/sft.md#checkpoints-and-resume)::

    step_000010/manifest.json   identities of the resumable state and the promotable weights
                                (recorded separately, each with the sha256 of every local file),
                                the run state (run id, step, phase, config identity) and the
                                data/RNG position
    latest                      "10" — written LAST, atomically: the newest complete checkpoint

A checkpoint is *resumable* (weights + optimizer state + run state) and optionally *promotable*
(inference-formatted weights only). Every file is written to a temporary sibling and renamed, so
a crash leaves either the old or the new file, never a torn one. A resume that cannot resolve the
exact identity of the resumable state fails closed (`CheckpointError`), never silently starts
over or picks another checkpoint.

Which trainer methods are used is decided by its `runner.Capabilities` (probed once, by the
caller or here): a backend with `runner.RichCheckpoints` (``save_resumable(name) -> dict`` /
``load_resumable(identity, *, with_optimizer)`` / ``save_promotable(name) -> dict``) records
richer identities (Fireworks resolves the control-plane row); otherwise `runner.Checkpointing`'s
``save_state`` / ``load_state`` / ``save_weights_for_sampler`` are used and the returned
reference is the identity. A trainer with neither cannot be checkpointed (`CheckpointError`).
Files are written with `runner._atomic` (``atomic_write_text`` / ``atomic_write_json`` are
re-exported here).

Integrity: a reference that is a local file or directory inside the run directory is recorded
relative to it together with the sha256 of each of its files (`runner._digests`), and verified
before the backend reads any byte of it (a mismatch, a missing file or a reference without
digests fails closed naming the file). Remote references (a hosted backend's checkpoint names)
carry the provider's identity instead.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from runner._atomic import atomic_write_json, atomic_write_text, make_dirs
from runner._digests import IntegrityError, tree_digests, verify_tree
from runner._protocols import Capabilities, capabilities, describe

__all__ = [
    "FORMAT_VERSION",
    "CheckpointError",
    "atomic_write_json",
    "atomic_write_text",
    "check_marker_consistency",
    "latest_step",
    "load_resumable",
    "read_manifest",
    "save_promotable",
    "verify_promotable",
    "save_resumable",
    "step_dir",
    "verify_files",
    "write_checkpoint",
]

#: 2: file digests and the run id (a version-1 manifest is refused).
FORMAT_VERSION = 2
_STEP_DIR = re.compile(r"^step_(\d{6,})$")


class CheckpointError(RuntimeError):
    """A checkpoint cannot be written or resumed exactly (fail closed)."""


def _caps(trainer: Any, caps: Capabilities | None) -> Capabilities:
    caps = caps if caps is not None else capabilities(trainer)
    if not caps.can_checkpoint:
        raise CheckpointError(
            f"the trainer ({caps.type_name}) cannot be checkpointed: it has neither "
            f"{describe('checkpointing')} nor {describe('rich_checkpoints')}"
        )
    return caps


def step_dir(root: Path, step: int) -> Path:
    return root / f"step_{step:06d}"


def relative_ref(ref: str, run_dir: Path | None) -> str:
    """A file reference inside ``run_dir`` as a path relative to it (so a moved or copied run
    refers to its own files); anything else unchanged."""
    if run_dir is None:
        return str(ref)
    path, root = Path(ref), Path(run_dir)
    if path.is_absolute():
        try:
            return path.resolve().relative_to(root.resolve()).as_posix()
        except ValueError:
            return str(ref)
    return str(ref)


def resolve_ref(ref: str, run_dir: Path | None, what: str) -> str:
    """The file a manifest reference names, inside ``run_dir`` (fail closed outside it).

    Raises:
      CheckpointError: an absolute reference outside the run directory (a copied run whose
        manifest still points at the original, which may meanwhile be another run's).
    """
    if run_dir is None:
        return str(ref)
    path, root = Path(ref), Path(run_dir)
    if not path.is_absolute():
        return str(root / path)
    try:
        path.resolve().relative_to(root.resolve())
    except ValueError:
        raise CheckpointError(
            f"checkpoint manifest's {what} {ref} is outside this run directory {root}: a copied "
            "or moved run resumes only from its own files; refusing to load another run's state"
        ) from None
    return str(path)


def _local_files(ref: str, run_dir: Path | None) -> dict[str, str] | None:
    """``{path relative to run_dir: sha256}`` of a reference that is a local file or directory
    inside ``run_dir``; None for anything else (a remote reference)."""
    if run_dir is None or Path(ref).is_absolute() or "://" in ref:
        return None
    path = Path(run_dir) / ref
    return tree_digests(path, run_dir) if path.exists() else None


def _check_files(run_dir: Path, identity: dict[str, Any], key: str, what: str) -> None:
    """`verify_files` raising `IntegrityError` (the caller words the refusal)."""
    ref = identity.get(key)
    if not ref or Path(str(ref)).is_absolute() or "://" in str(ref):
        return
    digests = identity.get("sha256")
    if not isinstance(digests, dict) or not digests:
        raise IntegrityError(f"no file digests recorded for {ref}; cannot verify it")
    prefix = Path(str(ref)).as_posix().rstrip("/")
    outside = [k for k in digests if k != prefix and not str(k).startswith(prefix + "/")]
    if outside:
        raise IntegrityError(
            f"the digests recorded for {ref} name a file outside it ({outside[0]}): the "
            "manifest was edited"
        )
    verify_tree(run_dir, digests, what=what)


def verify_files(run_dir: Path, identity: dict[str, Any], key: str, what: str) -> None:
    """Verifies the files of ``identity[key]`` (a relative local reference) against the digests
    recorded beside it, before any byte is used.

    Raises:
      CheckpointError: no digests recorded for a local reference, or a file is missing or
        modified (naming it).
    """
    try:
        _check_files(run_dir, identity, key, what)
    except IntegrityError as exc:
        raise CheckpointError(
            f"{exc}; refusing to load it (restore the run directory from a backup, or start a "
            "new run)"
        ) from None


def verify_promotable(run_dir: Path, manifest: dict[str, Any]) -> None:
    """Verifies the promotable weights a manifest records (local files only) against their
    digests: a resume from a checkpoint whose deliverable weights were damaged fails closed
    naming the file, instead of carrying an unusable snapshot forward in silence.

    Raises:
      CheckpointError: a promotable file is missing or modified (naming it).
    """
    promotable = manifest.get("promotable")
    if not isinstance(promotable, dict) or "sha256" not in promotable:
        return
    ref = promotable.get("snapshot_path")
    try:
        _check_files(run_dir, promotable, "snapshot_path", f"promotable weights {ref}")
    except IntegrityError as exc:
        raise CheckpointError(
            f"--resume: checkpoint step {manifest.get('step')}: {exc}; refusing to resume from "
            "a checkpoint whose promotable weights are damaged (restore the run directory from "
            "a backup, or start a new run)"
        ) from None


def save_resumable(
    trainer: Any, name: str, caps: Capabilities | None = None, run_dir: Path | None = None
) -> dict[str, Any]:
    """The backend's resumable-state identity after saving it under ``name``.

    ``caps``: the trainer's `Capabilities` when the caller already probed them. ``run_dir``:
    file references inside it are recorded relative to it, with the sha256 of each file.
    """
    if _caps(trainer, caps).rich_checkpoints:
        return dict(trainer.save_resumable(name))
    ref = trainer.save_state(name)
    if not ref:
        raise CheckpointError(f"save_state({name!r}) returned an empty reference")
    out = {"checkpoint_name": name, "provider_path": relative_ref(ref, run_dir)}
    files = _local_files(out["provider_path"], run_dir)
    if files is not None:
        out["sha256"] = files
    return out


def save_promotable(
    trainer: Any, name: str, caps: Capabilities | None = None, run_dir: Path | None = None
) -> dict[str, Any]:
    if _caps(trainer, caps).rich_checkpoints:
        return dict(trainer.save_promotable(name))
    ref = trainer.save_weights_for_sampler(name)
    if not ref:
        raise CheckpointError(f"save_weights_for_sampler({name!r}) returned an empty reference")
    out = {"snapshot_name": name, "snapshot_path": relative_ref(ref, run_dir)}
    files = _local_files(out["snapshot_path"], run_dir)
    if files is not None:
        out["sha256"] = files
    return out


def load_resumable(
    trainer: Any,
    identity: dict[str, Any],
    *,
    with_optimizer: bool = True,
    caps: Capabilities | None = None,
    run_dir: Path | None = None,
    expected_name: str | None = None,
) -> None:
    """Loads the resumable state a manifest names (a relative path: inside ``run_dir``), after
    verifying its files' digests.

    ``expected_name``: the name the state must have been saved under (the manifest's own step
    and run: a ``resumable`` block copied from another step's manifest is not this step's).

    Raises:
      CheckpointError: no identity, another state's identity, a reference outside the run, a
        digest mismatch, or the backend cannot load it (its error, on one line).
    """
    rich = _caps(trainer, caps).rich_checkpoints
    ref = identity.get("provider_path")
    if not rich and not ref:
        raise CheckpointError(
            "checkpoint manifest has no resolved identity for the resumable state "
            "(provider_path is missing): refusing to resume from an unknown checkpoint"
        )
    # (a hosted control plane may rename the state; the name the runner asked for is recorded)
    saved = identity.get("requested_checkpoint_name", identity.get("checkpoint_name"))
    # (a service may make the name unique with a suffix: ``<name>-<hex>``)
    if expected_name is not None and not _same_state_name(saved, expected_name):
        raise CheckpointError(
            f"checkpoint manifest's resumable state is {saved!r}, not "
            f"the state saved as {expected_name!r} at this step: refusing to load state saved "
            "at another step or by another run"
        )
    if rich:
        trainer.load_resumable(identity, with_optimizer=with_optimizer)
        return
    path = resolve_ref(ref, run_dir, "provider_path")
    if run_dir is not None:
        verify_files(run_dir, identity, "provider_path", f"resumable state {ref}")
        if "sha256" in identity and Path(str(ref)).name != identity.get("checkpoint_name"):
            raise CheckpointError(
                f"checkpoint manifest's provider_path {ref} is not the state saved as "
                f"{identity.get('checkpoint_name')!r}: the manifest was edited"
            )
    try:
        trainer.load_state(path, with_optimizer=with_optimizer)
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"cannot load the resumable state {ref}: {exc}") from None


def _same_state_name(saved: Any, expected: str) -> bool:
    """``saved`` is ``expected`` or ``expected`` with a service's ``-<hex>`` suffix."""
    if not isinstance(saved, str):
        return False
    head, _, tail = saved.rpartition("-")
    return saved == expected or (
        head == expected and len(tail) >= 4 and all(c in "0123456789abcdef" for c in tail)
    )


def write_checkpoint(
    root: Path,
    trainer: Any,
    *,
    step: int,
    run_state: dict[str, Any],
    backend: str,
    promotable: bool,
    prefix: str = "foldloss",
    caps: Capabilities | None = None,
) -> dict[str, Any]:
    """Saves state for ``step`` and returns the manifest. Order: resumable state, promotable
    weights, manifest, then the ``latest`` marker (written last).

    ``caps``: the trainer's `Capabilities` when the caller already probed them.
    """
    caps = _caps(trainer, caps)
    d = make_dirs(step_dir(root, step))
    name = f"{prefix}-step-{step}"
    manifest: dict[str, Any] = {
        "format_version": FORMAT_VERSION,
        "step": step,
        "saved_as": name,
        "backend": backend,
        "resumable": save_resumable(trainer, name, caps, run_dir=root.parent),
        "includes_optimizer_state": True,
        "promotable": save_promotable(trainer, name, caps, run_dir=root.parent)
        if promotable
        else None,
        "run_state": run_state,
    }
    atomic_write_json(d / "manifest.json", manifest)
    atomic_write_text(root / "latest", f"{step}\n")
    return manifest


def latest_step(root: Path) -> int | None:
    """The step in the ``latest`` marker, or None when there is no checkpoint yet."""
    marker = root / "latest"
    if not marker.exists():
        return None
    try:
        text = marker.read_text().strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{marker} is unreadable ({exc}); expected a step number") from None
    if not text.isdigit():
        raise CheckpointError(f"{marker} is corrupt: expected a step number, got {text!r}")
    return int(text)


def read_manifest(root: Path, step: int) -> dict[str, Any]:
    """Reads and validates the manifest of ``step`` (fail closed on anything unexpected)."""
    path = step_dir(root, step) / "manifest.json"
    if not path.is_file():
        raise CheckpointError(f"checkpoint manifest not found: {path}")
    try:
        manifest = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"checkpoint manifest {path} is not valid JSON: {exc}") from None
    if not isinstance(manifest, dict):
        raise CheckpointError(
            f"checkpoint manifest {path} is not a JSON object (got {type(manifest).__name__})"
        )
    if manifest.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(
            f"checkpoint manifest {path} has format_version {manifest.get('format_version')!r}, "
            f"expected {FORMAT_VERSION}"
        )
    if manifest.get("step") != step:
        raise CheckpointError(f"checkpoint manifest {path} records step {manifest.get('step')!r}")
    resumable = manifest.get("resumable")
    if not isinstance(resumable, dict) or not resumable.get("checkpoint_name"):
        raise CheckpointError(
            f"checkpoint manifest {path} has no resolved identity for its resumable state"
        )
    if not isinstance(manifest.get("run_state"), dict):
        raise CheckpointError(f"checkpoint manifest {path} has no run_state")
    return manifest


def check_marker_consistency(root: Path, latest: int, interval: int) -> None:
    """A step directory far beyond the marker means the marker is stale (sft-translation §7.5)."""
    if not root.is_dir():
        return
    for child in root.iterdir():
        m = _STEP_DIR.match(child.name)
        if m and interval > 0 and int(m.group(1)) > latest + interval:
            raise CheckpointError(
                f"checkpoint directory {child.name} is more than {interval} steps past the latest "
                f"marker ({latest}): refusing to guess which checkpoint is current"
            )
