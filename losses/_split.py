"""Micro-batching that keeps the optimizer batch's normalizers."""

from __future__ import annotations

import jax.numpy as jnp

from losses._batch import FIELDS, UNSLICED_FIELDS, Batch
from losses._reductions import mask_total, num_rows


def with_normalizers(batch: Batch) -> Batch:
    """The batch with ``num_rows``/``num_action_tokens``/``num_obs_tokens`` set from itself.

    Fields already set are kept (they may describe a larger optimizer batch).

    Args:
      batch: a `Batch`.

    Returns:
      The `Batch` with its normalizer fields filled in.
    """
    changes = {}
    if batch.num_rows is None:
        changes["num_rows"] = num_rows(batch)
    if batch.num_action_tokens is None:
        changes["num_action_tokens"] = mask_total(batch, "action")
    if batch.num_obs_tokens is None:
        changes["num_obs_tokens"] = mask_total(batch, "obs")
    return batch.replace(**changes) if changes else batch


def split_batch(batch: Batch, num_microbatches: int) -> list[Batch]:
    """Splits rows into micro-batches that carry the full batch's normalizers.

    Every micro-batch gets the full batch's ``N`` (active rows), action-token total and
    observation-token total, so for every term and reduction
    ``Σ_k L(lp_k, batch_k) == L(lp, batch)`` and the micro-batch gradients, concatenated along
    rows, equal the full-batch gradient. Rows are cut into contiguous chunks of near-equal size
    (``numpy.array_split`` sizes: the first ``B mod k`` chunks get one row more).

    Args:
      batch: a `Batch` with B rows.
      num_microbatches: ``1 ≤ k ≤ B``.

    Returns:
      A list of k `Batch` objects; use `row_slices` for the matching rows of ``logprobs``.
    """
    b = batch.shape[0]
    if isinstance(num_microbatches, bool) or not isinstance(num_microbatches, int):
        raise ValueError(f"split_batch: num_microbatches must be an int, got {num_microbatches!r}")
    if not 1 <= num_microbatches <= b:
        raise ValueError(
            f"split_batch: num_microbatches must be between 1 and B={b}, got {num_microbatches}"
        )
    full = with_normalizers(batch)
    out = []
    for sl in row_slices(b, num_microbatches):
        fields = {}
        for name in FIELDS:
            value = getattr(full, name)
            fields[name] = value if value is None or name in UNSLICED_FIELDS else value[sl]
        fields["extra"] = {
            name: value[sl] if getattr(value, "ndim", 0) >= 1 else value
            for name, value in full.extra.items()
        }
        out.append(Batch(**fields))
    return out


def row_slices(num_rows_total: int, num_microbatches: int) -> list[slice]:
    """The row slices `split_batch` uses.

    Args:
      num_rows_total: B.
      num_microbatches: k.

    Returns:
      k contiguous ``slice`` objects covering ``range(B)``.
    """
    base, rem = divmod(num_rows_total, num_microbatches)
    slices, start = [], 0
    for k in range(num_microbatches):
        size = base + (1 if k < rem else 0)
        slices.append(slice(start, start + size))
        start += size
    return slices


def concat_rows(arrays) -> jnp.ndarray:
    """Concatenates per-micro-batch arrays along rows (inverse of `row_slices`)."""
    return jnp.concatenate(list(arrays), axis=0)
