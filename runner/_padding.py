"""Ragged sequences ↔ padded ``[B, T]`` batches, with length and row buckets.

Padding to buckets keeps jit compilations to one per ``(rows, length)`` bucket instead of one per
step (DESIGN.md §7). Padding rows and columns are all-zero masks, so they change no loss (the
``losses`` terms are padding-invariant and ``N`` never counts all-zero rows).

Padded arrays are allocated 64-byte aligned (`aligned_zeros`): XLA:CPU then uses the numpy buffer
as the device buffer without copying it (a plain ``np.zeros`` is only 16-byte aligned, and each
``[256, 4096]`` float32 field would cost a ~4 MB copy per call). Large batches are packed and
un-packed by a few threads (`parallel_map`; numpy releases the GIL while it copies).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

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


#: Work (padded entries) from which packing and un-packing use several threads.
PARALLEL_MIN_ENTRIES = 1 << 18
_POOL: ThreadPoolExecutor | None = None
_POOL_LOCK = threading.Lock()


def _pool() -> ThreadPoolExecutor | None:
    global _POOL
    workers = min(4, os.cpu_count() or 1)
    if workers < 2:
        return None
    with _POOL_LOCK:
        if _POOL is None:
            _POOL = ThreadPoolExecutor(workers, thread_name_prefix="foldloss-pad")
        return _POOL


def parallel_map(fn: Callable[[Any], Any], items: Sequence[Any], *, work: int) -> list[Any]:
    """``[fn(x) for x in items]``, on a small shared thread pool when ``work`` is large.

    Args:
      fn: a function that mostly runs numpy copies (which release the GIL).
      items: its inputs.
      work: the total number of array entries involved; below `PARALLEL_MIN_ENTRIES` (or on one
        core) it runs inline.

    Returns:
      The results, in order.
    """
    pool = _pool() if work >= PARALLEL_MIN_ENTRIES and len(items) > 1 else None
    if pool is None:
        return [fn(x) for x in items]
    return list(pool.map(fn, items))


def bucket(n: int, buckets: Sequence[int]) -> int:
    """The smallest bucket ≥ ``n`` (``ValueError`` if ``n`` exceeds the largest)."""
    for b in buckets:
        if b >= n:
            return int(b)
    raise ValueError(f"length {n} exceeds the largest bucket {buckets[-1]}; add a larger bucket")


def row_bucket(n: int) -> int:
    """Rows are padded to the next power of two."""
    return 1 << max(0, int(n) - 1).bit_length()


#: Alignment (bytes) of padded buffers; XLA:CPU aliases host buffers with this alignment.
ALIGNMENT = 64


def aligned_zeros(shape: tuple[int, ...], dtype=np.float32) -> np.ndarray:
    """A zero array whose data starts on an `ALIGNMENT`-byte boundary (zero-copy into XLA:CPU).

    Callers must not write to it once it has been handed to JAX (it may be aliased).
    """
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    raw = np.zeros(nbytes + ALIGNMENT, dtype=np.uint8)
    start = -raw.ctypes.data % ALIGNMENT
    return raw[start : start + nbytes].view(dtype).reshape(shape)


def pad_ragged(
    arrays: Sequence[np.ndarray],
    length: int,
    rows: int,
    dtype=np.float32,
    out: np.ndarray | None = None,
) -> np.ndarray:
    """Right-pads 1-D arrays into a zero ``[rows, length]`` array (64-byte aligned).

    ``out``: a ``[rows, length]`` array of ``dtype`` to fill (overwritten, padding zeroed)
    instead of a fresh one. Reusing buffers avoids the page faults of fresh large allocations,
    which otherwise cost as much as the copy itself.
    """
    if out is None:
        out = aligned_zeros((rows, length), dtype)
    else:
        if out.shape != (rows, length) or out.dtype != np.dtype(dtype):
            raise ValueError(
                f"pad_ragged: out has shape {out.shape} / {out.dtype}, expected "
                f"{(rows, length)} / {np.dtype(dtype)}"
            )
        out.fill(0)
    for i, a in enumerate(arrays):
        out[i, : a.shape[0]] = a
    return out


def unpad(padded: np.ndarray, lengths: Sequence[int], dtype=None) -> list[np.ndarray]:
    """The inverse of `pad_ragged`: row ``i`` cut to ``lengths[i]``.

    With ``dtype`` different from ``padded.dtype`` each row is converted on its own (a fresh
    array per row, converting only the real entries); otherwise the rows are views.
    """
    padded = np.asarray(padded)
    if dtype is None or np.dtype(dtype) == padded.dtype:
        return [padded[i, :n] for i, n in enumerate(lengths)]
    rows = len(lengths)
    chunks = [range(lo, min(lo + 64, rows)) for lo in range(0, rows, 64)]
    parts = parallel_map(
        lambda rs: [padded[i, : lengths[i]].astype(dtype) for i in rs],
        chunks,
        work=int(sum(lengths)),
    )
    return [g for part in parts for g in part]


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
        a = None if a is None else np.asarray(a)
        o = None if o is None else np.asarray(o)
        a_sum = float(np.sum(a)) if a is not None else 0.0
        o_sum = float(np.sum(o)) if o is not None else 0.0
        action_total += a_sum
        obs_total += o_sum
        # ``max() > 0`` is ``any(x > 0)`` without the temporary boolean array.
        if (a is not None and a.size and a.max() > 0) or (o is not None and o.size and o.max() > 0):
            rows += 1
    return {"num_rows": rows, "num_action_tokens": action_total, "num_obs_tokens": obs_total}


def padded_normalizers(action_BT: np.ndarray, obs_BT: np.ndarray | None) -> dict[str, float]:
    """`normalizers` computed from padded masks (padding is all-zero, so it never counts).

    Equal to `normalizers` of the sequences for masks whose values the padded dtype holds
    exactly (0/1 masks always), at a fraction of the cost: a few vectorized passes instead of
    several small numpy calls per sequence.
    """
    return _combine_mask_stats(_mask_stats(action_BT), _mask_stats(obs_BT))


def _mask_stats(mask_BT: np.ndarray | None) -> tuple[np.ndarray, float] | None:
    """(rows with a positive entry, total) of a padded mask."""
    if mask_BT is None:
        return None
    return mask_BT.max(axis=1) > 0, float(np.sum(mask_BT, dtype=np.float64))


def _combine_mask_stats(action, obs) -> dict[str, float]:
    has = action[0] if obs is None else action[0] | obs[0]
    return {
        "num_rows": int(np.count_nonzero(has)),
        "num_action_tokens": action[1],
        "num_obs_tokens": 0.0 if obs is None else obs[1],
    }


def seqs_to_batch(
    seqs: Sequence[Seq],
    *,
    length: int,
    rows: int,
    norms: Mapping[str, float] | None,
    dtype=np.float32,
    out: Mapping[str, np.ndarray] | None = None,
) -> losses.Batch:
    """A padded `losses.Batch` from the sequences' per-token inputs (missing fields → None).

    ``action_mask`` is required on every sequence (a missing one is an error naming the
    sequence); other fields must be present on all sequences or on none. ``norms=None`` sets
    the batch's own normalizers (`padded_normalizers`). ``out`` optionally maps field names to
    ``[rows, length]`` buffers to fill instead of fresh arrays (see `pad_ragged`).
    """
    fields: dict[str, np.ndarray | None] = {}
    names = []
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
        fields[name] = None
        names.append(name)
    out = out or {}
    stats_of = ("action_mask", "obs_mask") if norms is None else ()

    def pad(name: str):
        p = pad_ragged([s.inputs[name] for s in seqs], length, rows, dtype, out=out.get(name))
        # The mask statistics behind the normalizers, while the mask is hot in this thread.
        return p, (_mask_stats(p) if name in stats_of else None)

    padded = parallel_map(pad, names, work=rows * length * len(names))
    fields.update((name, p) for name, (p, _) in zip(names, padded, strict=True))
    if norms is None:
        stats = {name: st for name, (_, st) in zip(names, padded, strict=True)}
        norms = _combine_mask_stats(stats["action_mask"], stats.get("obs_mask"))
    for name, value in norms.items():
        fields[name] = np.asarray(value, dtype=dtype)
    return losses.Batch(**fields)
