"""Reductions as per-token weights that depend on masks only (never on logprobs).

A reduction turns per-token losses ``ℓ[B, T]`` into a scalar ``Σ_{i,t} w_{i,t}·ℓ_{i,t}``. Writing it
as weights makes three things exact: gradient accumulation over micro-batches (the denominators
travel with the batch, see `split_batch`), folding the normalization into per-token advantages
for a server kernel that only sums, and the gradient identity ``∂L/∂ℓ = w``.

With ``m`` the term's mask, ``|row_i| = Σ_t m_{i,t}`` and ``N`` the number of rows of the optimizer
batch with at least one action *or* observation token (all-zero padding rows never count):

==============================  ==============================  ==========================
reduction                       weight ``w_{i,t}``              also known as
==============================  ==============================  ==========================
``token_mean``                  ``m / Σ m``                     verl ``token-mean``, DAPO
``seq_mean_token_mean``         ``m / (N·|row_i|)``             GRPO paper, verl
                                                                ``seq-mean-token-mean``
``seq_mean_token_sum``          ``m / N``                       verl ``seq-mean-token-sum``
``token_sum``                   ``m``                           Tinker/Fireworks kernels
``seq_mean_token_sum_norm``     ``m / (N·max_tokens)``          Dr. GRPO (Liu et al. 2025,
                                                                arXiv:2503.20783)
==============================  ==============================  ==========================

Every denominator is clamped at 1 (``max_tokens`` must be positive), so empty masks give 0, never
NaN.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from losses._batch import Batch, count

REDUCTIONS = (
    "token_mean",
    "seq_mean_token_mean",
    "seq_mean_token_sum",
    "token_sum",
    "seq_mean_token_sum_norm",
)


def validate_reduction(reduction: str, max_tokens: Any, *, where: str) -> None:
    """Raises ``ValueError`` for an unknown reduction or a bad ``max_tokens``."""
    if reduction not in REDUCTIONS:
        raise ValueError(f"{where}: unknown reduction {reduction!r}; expected one of {REDUCTIONS}")
    if reduction == "seq_mean_token_sum_norm":
        if max_tokens is None:
            raise ValueError(
                f"{where}: reduction 'seq_mean_token_sum_norm' needs max_tokens (the constant "
                "normalizer of Dr. GRPO) to be given explicitly"
            )
    if max_tokens is not None:
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int | float):
            raise ValueError(f"{where}: max_tokens must be a positive number, got {max_tokens!r}")
        if not max_tokens > 0:
            raise ValueError(f"{where}: max_tokens must be > 0, got {max_tokens!r}")


def active_rows(batch: Batch) -> jax.Array:
    """Which rows count in ``N``: those with at least one action or observation token.

    Args:
      batch: a `Batch`.

    Returns:
      float[B]: 1.0 for rows with an action or observation token, 0.0 for padding rows.
    """
    mask = batch.action_mask > 0
    if batch.obs_mask is not None:
        mask = mask | (batch.obs_mask > 0)
    return jnp.any(mask, axis=1).astype(jnp.promote_types(batch.action_mask.dtype, jnp.float32))


def num_rows(batch: Batch) -> jax.Array:
    """``N``: the optimizer batch's row count from ``batch.num_rows``, else counted here."""
    if batch.num_rows is not None:
        return jnp.asarray(batch.num_rows)
    return jnp.sum(active_rows(batch))


def mask_total(batch: Batch, which: str) -> jax.Array:
    """Total of ``action`` or ``obs`` mask over the optimizer batch (carried or counted)."""
    if which == "action":
        carried, mask = batch.num_action_tokens, batch.action_mask
    elif which == "obs":
        carried, mask = batch.num_obs_tokens, batch.obs_mask
    else:  # pragma: no cover - internal
        raise ValueError(which)
    if carried is not None:
        return jnp.asarray(carried)
    if mask is None:
        return jnp.zeros((), jnp.promote_types(batch.action_mask.dtype, jnp.float32))
    return count(mask)


def reduction_weights(
    mask_BT: jax.Array,
    reduction: str,
    *,
    num_rows: jax.Array,
    num_tokens: jax.Array,
    max_tokens: float | None = None,
) -> jax.Array:
    """Per-token weights ``w[B, T]`` of a reduction (module docstring table).

    Args:
      mask_BT: the term's 0/1 mask; float[B, T].
      reduction: one of `REDUCTIONS`.
      num_rows: ``N``, the optimizer batch's active-row count; 0-d.
      num_tokens: ``Σ m`` over the optimizer batch (used by ``token_mean``); 0-d.
      max_tokens: the Dr. GRPO constant (``seq_mean_token_sum_norm`` only).

    Returns:
      float[B, T] weights, exactly 0 where ``mask_BT`` is 0.
    """
    m = mask_BT
    if reduction == "token_sum":
        return m
    if reduction == "token_mean":
        return m / jnp.maximum(num_tokens, 1.0)
    n = jnp.maximum(num_rows, 1.0)
    if reduction == "seq_mean_token_sum":
        return m / n
    if reduction == "seq_mean_token_mean":
        row_len = jnp.sum(m, axis=1, keepdims=True, dtype=jnp.promote_types(m.dtype, jnp.float32))
        return m / (n * jnp.maximum(row_len, 1.0))
    if reduction == "seq_mean_token_sum_norm":
        return m / (n * float(max_tokens))  # type: ignore[arg-type]
    raise ValueError(f"unknown reduction {reduction!r}; expected one of {REDUCTIONS}")


def term_weights(
    batch: Batch, which: str, reduction: str, max_tokens: float | None = None
) -> jax.Array:
    """`reduction_weights` for the batch's action or observation mask.

    Uses the normalizers the batch carries (`split_batch`) or counts them on the batch.

    Args:
      batch: a `Batch`.
      which: ``"action"`` or ``"obs"``.
      reduction: one of `REDUCTIONS`.
      max_tokens: the ``seq_mean_token_sum_norm`` constant.

    Returns:
      float[B, T] weights (zeros when the mask is None).
    """
    mask = batch.action_mask if which == "action" else batch.obs_mask
    if mask is None:
        return jnp.zeros_like(batch.action_mask)
    return reduction_weights(
        mask,
        reduction,
        num_rows=num_rows(batch),
        num_tokens=mask_total(batch, which),
        max_tokens=max_tokens,
    )
