"""Ragged sequences ↔ padded ``[B, T]`` batches, with length and row buckets.

Padding to buckets keeps jit compilations to one per ``(rows, length)`` bucket instead of one per
step (DESIGN.md §7). Padding rows and columns are all-zero masks, so they change no loss (the
``losses`` terms are padding-invariant and ``N`` never counts all-zero rows).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

import losses
from runner._types import Seq

DEFAULT_LENGTH_BUCKETS = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
#: Fields of a runner `Seq` that the client-loss adapter copies into a `losses.Batch`.
BATCH_FIELDS = (
    "action_mask",
    "obs_mask",
    "advantages",
    "sampling_logprobs",
    "old_logprobs",
    "ref_logprobs",
    "weights",
)


def bucket(n: int, buckets: Sequence[int]) -> int:
    """The smallest bucket ≥ ``n`` (``ValueError`` if ``n`` exceeds the largest)."""
    for b in buckets:
        if b >= n:
            return int(b)
    raise ValueError(f"length {n} exceeds the largest bucket {buckets[-1]}; add a larger bucket")


def row_bucket(n: int) -> int:
    """Rows are padded to the next power of two."""
    return 1 << max(0, int(n) - 1).bit_length()


def pad_ragged(
    arrays: Sequence[np.ndarray], length: int, rows: int, dtype=np.float32
) -> np.ndarray:
    """Right-pads 1-D arrays into a zero ``[rows, length]`` array."""
    out = np.zeros((rows, length), dtype=dtype)
    for i, a in enumerate(arrays):
        out[i, : a.shape[0]] = a
    return out


def unpad(padded: np.ndarray, lengths: Sequence[int]) -> list[np.ndarray]:
    """The inverse of `pad_ragged`: row ``i`` cut to ``lengths[i]``."""
    return [np.asarray(padded[i, :n]) for i, n in enumerate(lengths)]


def normalizers(seqs: Sequence[Seq]) -> dict[str, float]:
    """The optimizer batch's normalizers (``losses.Batch`` ``num_*`` fields) from its sequences.

    ``num_rows`` counts sequences with at least one action or observation token.
    """
    rows = 0
    action_total = 0.0
    obs_total = 0.0
    for s in seqs:
        a = s.inputs.get("action_mask")
        o = s.inputs.get("obs_mask")
        a_sum = float(np.sum(a)) if a is not None else 0.0
        o_sum = float(np.sum(o)) if o is not None else 0.0
        action_total += a_sum
        obs_total += o_sum
        if (a is not None and np.any(a > 0)) or (o is not None and np.any(o > 0)):
            rows += 1
    return {"num_rows": rows, "num_action_tokens": action_total, "num_obs_tokens": obs_total}


def seqs_to_batch(
    seqs: Sequence[Seq],
    *,
    length: int,
    rows: int,
    norms: Mapping[str, float],
    dtype=np.float32,
) -> losses.Batch:
    """A padded `losses.Batch` from the sequences' per-token inputs (missing fields → None).

    ``action_mask`` is required on every sequence (a missing one is an error naming the
    sequence); other fields must be present on all sequences or on none.
    """
    fields: dict[str, np.ndarray | None] = {}
    for name in BATCH_FIELDS:
        present = [name in s.inputs for s in seqs]
        if not any(present):
            if name == "action_mask":
                raise ValueError("sequence 0: missing required field 'action_mask'")
            fields[name] = None
            continue
        if not all(present):
            i = present.index(False)
            raise ValueError(
                f"sequence {i}: missing field '{name}' that other sequences in the batch have"
            )
        fields[name] = pad_ragged([s.inputs[name] for s in seqs], length, rows, dtype)
    for name, value in norms.items():
        fields[name] = np.asarray(value, dtype=dtype)
    return losses.Batch(**fields)
