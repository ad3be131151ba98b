"""Per-datum forms of terms: the batch constants and the rows a server runs one by one."""

from __future__ import annotations

from typing import Any

from losses._batch import UNSLICED_FIELDS, Batch, PerDatum
from losses._reductions import mask_total, num_rows


def normalizer_constants(batch: Batch) -> dict[str, Any]:
    """The reduction normalizers of ``batch`` (``num_rows``, action/obs token totals).

    Args:
      batch: the optimizer `Batch`.

    Returns:
      ``{field: 0-d array}`` for the normalizer fields (kept as carried when already set).
    """
    return {
        "num_rows": num_rows(batch),
        "num_action_tokens": mask_total(batch, "action"),
        "num_obs_tokens": mask_total(batch, "obs"),
    }


#: The per-datum form of a term whose only batch coupling is its reduction's normalizers.
NORMALIZED = PerDatum(constants=normalizer_constants)


def with_correction(correction: Any) -> PerDatum:
    """`NORMALIZED` plus a batch-normalised correction's ``is_weight_mean`` (when it has one).

    Args:
      correction: ``None`` or a `losses.mismatch_correction` / chain.

    Returns:
      A `PerDatum`.
    """
    from losses._correction import importance_weight_mean

    rules = [] if correction is None else [r for r in correction.rules if r.batch_normalize]
    if not rules:
        return NORMALIZED

    def constants(batch: Batch) -> dict[str, Any]:
        out = normalizer_constants(batch)
        if batch.is_weight_mean is None:
            out["is_weight_mean"] = importance_weight_mean(batch, correction)
        return out

    return PerDatum(constants=constants)


def union(forms: list[PerDatum]) -> PerDatum:
    """The per-datum form of a sum of terms with these forms (each field computed once)."""

    def constants(batch: Batch) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for form in forms:
            for name, value in form.constants(batch).items():
                out.setdefault(name, value)
        return out

    return PerDatum(constants=constants)


def per_datum_batch(term: Any, batch: Batch) -> Batch:
    """``batch`` with the 0-d constants of ``term``'s per-datum form set (rows unchanged).

    Each row of the result, with its 0-d fields, is one datum: ``term(lp, batch) ==
    Σ_i term(lp[i:i+1], row_i)`` (`PerDatum`). Constants already set on ``batch`` are kept.

    Args:
      term: a `Term` whose ``per_datum`` is set.
      batch: the optimizer `Batch`.

    Returns:
      The `Batch` with the constants set.

    Raises:
      ValueError: the term has no per-datum form.

    Example:
      >>> import jax.numpy as jnp, losses
      >>> b = losses.Batch(action_mask=jnp.ones((2, 2)), advantages=jnp.array([1.0, -1.0]))
      >>> float(losses.per_datum_batch(losses.grpo(), b).num_action_tokens)
      4.0
    """
    form = getattr(term, "per_datum", None)
    if not isinstance(form, PerDatum):
        raise ValueError(
            f"per_datum_batch: term {getattr(term, 'name', term)!r} has no per-datum form "
            "(it is coupled across rows, or does not declare one)"
        )
    changes = {
        name: value
        for name, value in form.constants(batch).items()
        if name in UNSLICED_FIELDS and getattr(batch, name) is None
    }
    return batch.replace(**changes) if changes else batch
