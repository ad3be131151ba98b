"""Ragged sequences ↔ padded ``[B, T]`` batches, with length and row buckets.

Padding to buckets keeps jit compilations to one per ``(rows, length)`` bucket instead of one per
step (docs/conventions.md#performance-rules). Padding rows and columns are all-zero masks, so they change no loss (the
``losses`` terms are padding-invariant and ``N`` never counts all-zero rows).

Padded arrays are allocated 64-byte aligned (`aligned_zeros`): XLA:CPU then uses the numpy buffer
as the device buffer without copying it (a plain ``np.zeros`` is only 16-byte aligned, and each
``[256, 4096]`` float32 field would cost a ~4 MB copy per call). Several fields are padded
together row by row (`pad_fields`), on the calling thread: on a 2-core machine that was faster
than one thread per field (every row copy is a small numpy call, and threads contend for the GIL
between them; benchmarks/RESULTS.md).
"""

from __future__ import annotations

import itertools
import operator
from collections import deque
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

import losses
from runner._types import Seq

DEFAULT_LENGTH_BUCKETS = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
#: Smallest padded row count of short sequences (the one row rule of the local trainer and
#: the client loss)...
MIN_ROWS = 8
#: ... applied while it pads a batch to at most this many positions: the floor is
#: ``MIN_ROW_TOKENS // length`` rows, between 1 and `MIN_ROWS` (8 rows up to length 256, 2 at
#: 1024, 1 from 2048). Two sequences of 1024 tokens then run as 2 rows, not 8: a real
#: decoder's forward and backward cost is per padded row (4x the work at 8 rows).
MIN_ROW_TOKENS = 2048
#: Fields of a runner `Seq` that the client-loss adapter copies into a `losses.Batch`: the
#: `losses.DATA_FIELDS` (one list, owned by `losses`).
BATCH_FIELDS = losses.DATA_FIELDS


def bucket(n: int, buckets: Sequence[int] = DEFAULT_LENGTH_BUCKETS, cap: int | None = None) -> int:
    """The padded length of ``n`` targets: the smallest bucket ``≥ n``, capped at ``cap``.

    The one length rule of the runner: the local trainer (``cap = max_seq_len``) and the
    client-loss adapter pad to the same lengths, so a forward's padded logprobs are the client
    loss's padded input as they are (`CheckedSeqs`).

    Raises:
      ValueError: ``n`` exceeds the largest bucket (or ``cap``).
    """
    if cap is not None and n > cap:
        raise ValueError(f"length {n} exceeds the cap {cap}")
    for b in buckets:
        if b >= n:
            return int(b) if cap is None else min(int(b), int(cap))
    if cap is not None:
        return int(cap)
    raise ValueError(f"length {n} exceeds the largest bucket {buckets[-1]}; add a larger bucket")


def row_bucket(
    n: int, multiple: int = 1, min_rows: int = MIN_ROWS, length: int | None = None
) -> int:
    """Padded row count: ``multiple·2^k ≥ max(n, floor)`` (``multiple`` = device count).

    ``floor`` is ``min_rows``, lowered for long rows when the padded ``length`` is given: at
    most ``max(1, MIN_ROW_TOKENS // length)`` (so short batches keep few shapes to compile and
    long ones are not padded with whole empty rows).
    """
    if length is not None:
        min_rows = min(min_rows, max(1, MIN_ROW_TOKENS // max(int(length), 1)))
    b = multiple * max(1, -(-min_rows // multiple))
    while b < n:
        b *= 2
    return b


class CheckedSeqs(list):
    """A list of `Seq` that the runner has validated, with their padded buffers.

    The runner's own path wraps the sequences it sends to a trainer in this type: a trainer
    skips the generic validation of `runner.validate_seqs` for it (the data were validated
    once, where they entered) and keeps only its own limits (vocabulary, length). ``padded``
    maps a field name (``"tokens"``, ``"weights"``, ...) to a ``[rows, length]`` host buffer
    whose row ``i`` starts with the field of sequence ``i`` (the rest is zero): the ragged
    representation, so that a consumer with the same bucket reads it without re-padding, and
    each sequence's array is a view of it.
    """

    def __init__(self, seqs: Sequence[Seq] = (), padded: Mapping[str, np.ndarray] | None = None):
        super().__init__(seqs)
        # A dict given is shared, not copied: the passes of one step see one set of buffers.
        self.padded: dict[str, Any] = padded if isinstance(padded, dict) else dict(padded or {})


class RaggedArrays(list):
    """Per-sequence 1-D arrays that are views of one padded ``[rows, length]`` buffer.

    ``padded[i, :len(self[i])]`` is ``self[i]`` and the rest of the buffer is 0. A trainer's
    ``forward`` returns its logprobs this way; the client loss then uses ``padded`` as its
    input directly when the bucket and dtype match.
    """

    def __init__(self, padded: np.ndarray, lengths: Sequence[int]):
        # Iterating a 2-D array yields its row views from C (cheaper than ``padded[i, :n]``).
        super().__init__([row[:n] for row, n in zip(padded, lengths, strict=False)])
        self.padded = padded


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


def pad_fields(
    columns: Sequence[Sequence[np.ndarray]],
    length: int,
    rows: int,
    dtype=np.float32,
    out: Sequence[np.ndarray] | None = None,
    dirty: Sequence[np.ndarray] | None = None,
    lengths: np.ndarray | None = None,
    views: Sequence[np.ndarray] | None = None,
) -> list[np.ndarray]:
    """Right-pads several ragged fields into zero ``[rows, length]`` arrays, row by row.

    Args:
      columns: one sequence of 1-D arrays per field (row ``i`` of field ``k`` is
        ``columns[k][i]``); every field has the same number of rows, at most ``rows``.
      length: the padded length (every array fits).
      rows: the padded row count.
      dtype: the padded dtype.
      out: optional ``[rows, length]`` arrays of ``dtype`` to fill (one per field) instead of fresh
        64-byte aligned ones. Reusing buffers avoids the page faults of fresh large
        allocations, which otherwise cost as much as the copy itself.
      dirty: with ``out``, optional int64 ``[rows]`` arrays (one per field): how many leading
        entries of each row of ``out`` may be non-zero. Then only entries beyond the new lengths
        are zeroed (not whole buffers), and ``dirty`` is updated in place. Without ``dirty`` a
        given ``out`` is zeroed whole first. Fields may share one ``dirty`` array (the same
        object) when their rows have equal lengths: it is then read and updated once.
      lengths: optional int64 ``[n]`` row lengths that every field's arrays have (saves
        counting them per field; the caller guarantees it).
      views: optional ``row_views(out)``, kept by a caller that reuses ``out`` (saves making
        the row views on every call).

    Returns:
      The padded arrays, one per field.
    """
    count = len(columns)
    dtype = np.dtype(dtype)
    if out is None:
        out = [aligned_zeros((rows, length), dtype) for _ in range(count)]
        dirty = None
    else:
        out = list(out)
        if len(out) != count or any(o.shape != (rows, length) or o.dtype != dtype for o in out):
            raise ValueError(
                f"pad_fields: out must be {count} arrays of shape {(rows, length)} / {dtype}, got "
                f"{[(o.shape, str(o.dtype)) for o in out]}"
            )
        if dirty is None:
            for o in out:
                o.fill(0)
    n_rows = len(columns[0]) if count else 0
    if any(len(c) != n_rows for c in columns) or n_rows > rows:
        raise ValueError(
            f"pad_fields: fields have {[len(c) for c in columns]} rows for {rows} padded rows"
        )
    # Row-major (row 0 of every field, then row 1, ...): each source row is read once while its
    # destinations are written, better locality than field by field on a [256, 4096] batch
    # (~5%). Every copy is ``view[:len(a)] = a``, driven by `map` from C: no Python bytecode
    # per row (~0.04 ms less than a Python loop at [64, 1024] x 6 fields, of ~0.35 ms).
    # A value beyond the padded dtype becomes inf here; the value check after padding
    # (`losses.any_violation`) reports it, so numpy need not warn.
    sources = list(itertools.chain.from_iterable(zip(*columns, strict=True)))
    if views is None:
        views = row_views(out)
    with np.errstate(over="ignore"):
        deque(map(operator.setitem, views, map(slice, map(len, sources)), sources), maxlen=0)
    if dirty is not None:
        _zero_stale(columns, out, dirty, n_rows, lengths)
    return out


def row_views(out: Sequence[np.ndarray]) -> list[np.ndarray]:
    """The rows of several ``[rows, length]`` arrays as 1-D views, row-major: row 0 of each
    array, then row 1 of each, ... (the order `pad_fields` fills them in)."""
    return list(itertools.chain.from_iterable(zip(*out, strict=True)))


def _zero_stale(columns, out, dirty, n_rows: int, lengths) -> None:
    """Zeroes what a previous fill left beyond the new row lengths and updates ``dirty``.

    Each distinct ``dirty`` array is compared with the new lengths once, before any update.
    """
    plans: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]] = {}
    for col, d, o in zip(columns, dirty, out, strict=True):
        plan = plans.get(id(d))
        if plan is None:
            new = lengths if lengths is not None else np.fromiter(map(len, col), np.int64, n_rows)
            stale = np.flatnonzero(d[:n_rows] > new)
            tail = np.flatnonzero(d[n_rows:]) + n_rows
            plan = plans[id(d)] = (d, new, stale, tail)
        _, new, stale, tail = plan
        for i in stale:
            o[i, new[i] : d[i]] = 0
        for i in tail:
            o[i, : d[i]] = 0
    for d, new, _, tail in plans.values():
        d[:n_rows] = new
        if tail.size:
            d[n_rows:] = 0


def pad_ragged(
    arrays: Sequence[np.ndarray],
    length: int,
    rows: int,
    dtype=np.float32,
    out: np.ndarray | None = None,
    dirty: np.ndarray | None = None,
) -> np.ndarray:
    """Right-pads 1-D arrays into a zero ``[rows, length]`` array (64-byte aligned).

    One field of `pad_fields` (``out`` and ``dirty`` as there, for this one field).
    """
    return pad_fields(
        [arrays],
        length,
        rows,
        dtype,
        out=None if out is None else [out],
        dirty=None if dirty is None else [dirty],
    )[0]


def unpad(
    padded: np.ndarray, lengths: Sequence[int], dtype=None, *, copy: bool = False
) -> list[np.ndarray]:
    """The inverse of `pad_ragged`: row ``i`` cut to ``lengths[i]``.

    Rows are views of ``padded``, unless ``copy`` or a ``dtype`` other than ``padded.dtype`` is
    given: then each row is a fresh array (converting only the real entries).
    """
    padded = np.asarray(padded)
    if not copy and (dtype is None or np.dtype(dtype) == padded.dtype):
        return [padded[i, :n] for i, n in enumerate(lengths)]
    dtype = padded.dtype if dtype is None else dtype
    return [np.array(padded[i, :n], dtype=dtype) for i, n in enumerate(lengths)]


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
    has = action_BT.max(axis=1) > 0
    if obs_BT is not None:
        has |= obs_BT.max(axis=1) > 0
    return {
        "num_rows": int(np.count_nonzero(has)),
        "num_action_tokens": float(np.sum(action_BT, dtype=np.float64)),
        "num_obs_tokens": 0.0 if obs_BT is None else float(np.sum(obs_BT, dtype=np.float64)),
    }


def batch_field_names(seqs: Sequence[Seq]) -> tuple[str, ...]:
    """The `BATCH_FIELDS` the sequences carry (``ValueError`` naming the sequence if only some do).

    ``action_mask`` is required on every sequence; other fields must be present on all
    sequences or on none.
    """
    if seqs:
        # Fast path: every sequence carries the same field names (the usual batch).
        first = seqs[0].inputs.keys()
        if "action_mask" in first and all(s.inputs.keys() == first for s in seqs):
            return tuple(name for name in BATCH_FIELDS if name in first)
    names = []
    for name in BATCH_FIELDS:
        present = [name in s.inputs for s in seqs]
        if not any(present):
            if name == "action_mask":
                raise ValueError("sequence 0: missing required field 'action_mask'")
            continue
        if not all(present):
            i = present.index(False)
            raise ValueError(
                f"sequence {i}: missing field '{name}' that other sequences in the batch have"
            )
        names.append(name)
    return tuple(names)


def seqs_to_batch(
    seqs: Sequence[Seq],
    *,
    length: int,
    rows: int,
    norms: Mapping[str, float] | None,
    dtype=np.float32,
    out: Mapping[str, np.ndarray] | None = None,
    dirty: Mapping[str, np.ndarray] | None = None,
    count_in_term: bool = False,
    logprobs: Sequence[np.ndarray] | None = None,
) -> losses.Batch | tuple[np.ndarray, losses.Batch]:
    """A padded `losses.Batch` from the sequences' per-token inputs (missing fields → None).

    Args:
      seqs: the sequences (fields as in `batch_field_names`).
      length, rows: the padded shape.
      norms: the normalizers (`normalizers`) to carry; ``None`` sets the batch's own
        (`padded_normalizers`), or, with ``count_in_term``, leaves them None so that the term
        counts them itself (the same definition, `losses` reductions; inside a jitted term that
        costs no extra pass over host memory).
      dtype: the padded dtype.
      out, dirty: optional buffers to fill and their per-row filled lengths, by field name
        (``"logprobs"`` for ``logprobs``); see `pad_fields`.
      count_in_term: see ``norms``.
      logprobs: optional per-sequence logprobs, padded in the same row-by-row pass.

    Returns:
      The batch, or ``(logprobs[rows, length], batch)`` when ``logprobs`` is given.
    """
    names = batch_field_names(seqs)
    columns = [[s.inputs[name] for s in seqs] for name in names]
    keys = list(names)
    if logprobs is not None:
        columns.insert(0, list(logprobs))
        keys.insert(0, "logprobs")
    out = out or {}
    dirty = dirty or {}
    reuse = all(k in out for k in keys)
    padded = pad_fields(
        columns,
        length,
        rows,
        dtype,
        out=[out[k] for k in keys] if reuse else None,
        dirty=[dirty[k] for k in keys] if reuse and all(k in dirty for k in keys) else None,
    )
    by_name = dict(zip(keys, padded, strict=True))
    fields: dict[str, np.ndarray | None] = {name: by_name.get(name) for name in BATCH_FIELDS}
    if norms is None and not count_in_term:
        norms = padded_normalizers(fields["action_mask"], fields["obs_mask"])
    for name, value in (norms or {}).items():
        fields[name] = np.asarray(value, dtype=dtype)
    batch = losses.Batch(**fields)
    return batch if logprobs is None else (by_name["logprobs"], batch)
