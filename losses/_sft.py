"""Supervised cross-entropy terms: masked SFT and explicitly weighted cross-entropy."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from losses._batch import Batch, Term, check_logprobs_shape, count, reduction_reads, require
from losses._common import masked_mean, safe
from losses._per_datum import NORMALIZED
from losses._reductions import term_weights, validate_reduction


def sft_cross_entropy(*, reduction: str = "token_mean", max_tokens: float | None = None) -> Term:
    """Supervised next-token cross-entropy over ``action_mask``.

    ``L = Σ_{i,t} w_{i,t}·(-logp_{i,t})`` with ``w`` the reduction's weights over ``action_mask``
    (``token_mean``: the per-token mean NLL over the optimizer batch, the SFT convention of
    SkyRL/Fireworks; ``seq_mean_token_mean``: mean over sequences of per-sequence means).

    Args:
      reduction: one of ``losses.REDUCTIONS``.
      max_tokens: the constant of ``seq_mean_token_sum_norm``.

    Returns:
      A `Term`. Metrics: ``loss``, ``nll`` (mean NLL per supervised token), ``num_tokens``.

    Example:
      >>> import jax.numpy as jnp, losses
      >>> b = losses.Batch(action_mask=jnp.array([[0., 1, 1]]))
      >>> float(losses.sft_cross_entropy()(jnp.array([[-9., -1, -3]]), b)[0])
      2.0
    """
    where = "sft_cross_entropy"
    validate_reduction(reduction, max_tokens, where=where)

    def loss_fn(logprobs, batch: Batch) -> tuple[jax.Array, dict[str, jax.Array]]:
        lp = check_logprobs_shape(logprobs, batch)
        batch = jax.lax.stop_gradient(batch)
        valid = batch.action_mask > 0
        w = term_weights(batch, "action", reduction, max_tokens)
        nll = -safe(lp, valid)
        loss = jnp.sum(w * nll)
        metrics = {
            "loss": jax.lax.stop_gradient(loss),
            "nll": masked_mean(nll, valid),
            "num_tokens": count(valid.astype(lp.dtype)),
        }
        return loss, metrics

    def data_weights(batch: Batch) -> jax.Array:
        return term_weights(batch, "action", reduction, max_tokens)

    return Term(
        name="sft",
        fn=loss_fn,
        kind="sft_cross_entropy",
        config=dict(reduction=reduction, max_tokens=max_tokens),
        reads=reduction_reads(reduction, "action"),
        requires=frozenset({"action_mask"}),
        data_weights=data_weights,
        per_datum=NORMALIZED,
    )


def weighted_cross_entropy() -> Term:
    """Cross-entropy with explicit per-token weights: ``L = Σ_{i,t} w_{i,t}·(-logp_{i,t})``.

    Exactly the Tinker/Fireworks server ``cross_entropy`` kernel (``Σ -p·w``, a raw sum over
    tokens and rows, no normalization), with ``w = batch.weights`` of any sign. The gradient with
    respect to ``logprobs`` is exactly ``-w``; tokens with ``w == 0`` may hold any value.

    Returns:
      A `Term` reading ``batch.weights`` (float[B, T]). Metrics: ``loss``,
      ``num_weighted_tokens`` (non-zero weights), ``weight_sum``.

    Example:
      >>> import jax.numpy as jnp, losses
      >>> b = losses.Batch(action_mask=jnp.zeros((1, 3)), weights=jnp.array([[0., .5, 0]]))
      >>> float(losses.weighted_cross_entropy()(jnp.array([[-1., -2, -3]]), b)[0])
      1.0
    """
    where = "weighted_cross_entropy"

    def loss_fn(logprobs, batch: Batch) -> tuple[jax.Array, dict[str, jax.Array]]:
        lp = check_logprobs_shape(logprobs, batch)
        batch = jax.lax.stop_gradient(batch)
        w = require(batch, "weights", where)
        nonzero = w != 0
        loss = jnp.sum(safe(w, nonzero) * -safe(lp, nonzero))
        metrics = {
            "loss": jax.lax.stop_gradient(loss),
            "num_weighted_tokens": count(nonzero.astype(lp.dtype)),
            "weight_sum": jnp.sum(safe(w, nonzero)),
            "nll": masked_mean(-safe(lp, nonzero), nonzero),
        }
        return loss, metrics

    def data_weights(batch: Batch) -> jax.Array:
        return require(batch, "weights", where)

    return Term(
        name="weighted_ce",
        fn=loss_fn,
        kind="weighted_cross_entropy",
        config={},
        reads=frozenset({"weights"}),
        requires=frozenset({"weights"}),
        twin=None,
        data_weights=data_weights,
        per_datum=NORMALIZED,
    )
