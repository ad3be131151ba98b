"""ECHO environment-prediction cross-entropy, and the observation-mask builder."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from losses._batch import Batch, Term, check_logprobs_shape, count, reduction_reads
from losses._common import check_choice, check_number, masked_mean, safe
from losses._per_datum import NORMALIZED
from losses._reductions import mask_total, num_rows

ENV_NORMALIZATIONS = ("seq_mean_token_mean", "token_mean", "token_sum")


def echo_env_weights(batch: Batch, *, coef: float, normalization: str) -> jax.Array:
    """The per-token cross-entropy weights of `echo_env` (the formulas in its docstring).

    These are the weights a runner sends as a separate ``cross_entropy`` pass to reproduce
    `echo_env` on a server (the "two-pass" ECHO of rLLM #668).

    Args:
      batch: a `Batch` with ``obs_mask`` (None = no observations).
      coef: λ.
      normalization: one of `ENV_NORMALIZATIONS`.

    Returns:
      float[B, T] weights, exactly 0 off observation tokens.
    """
    obs = batch.obs_mask
    if obs is None:
        return jnp.zeros_like(batch.action_mask)
    if normalization == "token_sum":
        return coef * obs
    if normalization == "token_mean":
        return coef * obs / jnp.maximum(mask_total(batch, "obs"), 1.0)
    count_B1 = jnp.sum(obs, axis=1, keepdims=True, dtype=jnp.promote_types(obs.dtype, jnp.float32))
    n = jnp.maximum(num_rows(batch), 1.0)
    return coef * obs / (n * jnp.maximum(count_B1, 1.0))


def echo_env(*, coef: float = 0.05, normalization: str = "seq_mean_token_mean") -> Term:
    """ECHO's environment-prediction cross-entropy ``λ·L_env`` on observation tokens.

    ECHO (Shrivastava et al. 2026, "ECHO: Terminal Agents Learn World Models for Free",
    arXiv:2605.24517) adds to the policy loss a cross-entropy on the environment's observation
    tokens, computed from the same forward pass. As per-token weights over ``obs_mask``::

        L = Σ_{i,t} w_{i,t}·(-logp_{i,t})
        seq_mean_token_mean:  w = coef·obs / (N·max(|O_i|, 1))   (the paper's length-normalized
                                                                  L_env; rLLM's Fireworks fold)
        token_mean:           w = coef·obs / max(Σ obs, 1)
        token_sum:            w = coef·obs                        (rLLM's Tinker backend)

    ``N`` counts the optimizer batch's rows with at least one action or observation token (all-
    zero padding rows never count); rows without observations contribute 0 but count in N. The
    gradient with respect to ``logprobs`` is exactly ``-w``. Non-observation tokens may hold any
    value (inf, nan) and get exactly zero gradient.

    Args:
      coef: λ ≥ 0 (paper: 0.05; 0 disables the term exactly).
      normalization: ``"seq_mean_token_mean"`` (default), ``"token_mean"`` or ``"token_sum"``.

    Returns:
      A `Term` reading ``obs_mask`` (None = no observations) and ``action_mask``. Metrics:
      ``loss``, ``nll`` (mean NLL per observation token), ``num_obs_tokens``, ``rows_with_obs``,
      ``coef``.

    Example:
      >>> import jax.numpy as jnp, losses
      >>> b = losses.Batch(action_mask=jnp.array([[1., 0, 0]]), obs_mask=jnp.array([[0., 1, 1]]))
      >>> round(float(losses.echo_env(coef=1.0)(jnp.array([[-1., -2, -4]]), b)[0]), 6)
      3.0
    """
    where = "echo_env"
    coef = check_number(where, "coef", coef, low=0.0)
    check_choice(where, "normalization", normalization, ENV_NORMALIZATIONS)
    config = dict(coef=coef, normalization=normalization)

    def loss_fn(logprobs, batch: Batch) -> tuple[jax.Array, dict[str, jax.Array]]:
        lp = check_logprobs_shape(logprobs, batch)
        batch = jax.lax.stop_gradient(batch)
        w = echo_env_weights(batch, coef=coef, normalization=normalization)
        obs = batch.obs_mask if batch.obs_mask is not None else jnp.zeros_like(lp)
        valid = obs > 0
        nll = -safe(lp, valid)
        loss = jnp.sum(w * nll)
        metrics = {
            "loss": jax.lax.stop_gradient(loss),
            "nll": masked_mean(nll, valid),
            "num_obs_tokens": count(valid.astype(lp.dtype)),
            "rows_with_obs": count(jnp.any(valid, axis=1).astype(lp.dtype)),
            "coef": jnp.asarray(coef, lp.dtype),
        }
        return loss, metrics

    def data_weights(batch: Batch) -> jax.Array:
        return echo_env_weights(batch, coef=coef, normalization=normalization)

    return Term(
        name="echo_env",
        fn=loss_fn,
        kind="echo_env",
        config=config,
        is_zero=coef == 0.0,
        reads=frozenset({"obs_mask"}) | reduction_reads(normalization, "obs"),
        data_weights=data_weights,
        per_datum=NORMALIZED,
    )


def observation_mask(
    action_mask: Any,
    valid_mask: Any,
    *,
    prompt_lengths: Any = None,
    include_prompt: bool = False,
) -> jax.Array:
    """The observation mask implied by an action mask (docs/echo.md#observation-masks).

    Every non-padding target that is not an action is an observation, except the prompt:

    * ``include_prompt=False`` (default; paper / verl convention): targets that belong to the
      initial prompt are excluded. With ``prompt_lengths`` (token counts in full-sequence
      coordinates) target ``t`` of row ``i`` is a prompt target iff ``t < prompt_lengths[i] - 1``
      (target ``t`` is token ``t + 1``). Without it, everything before the row's first action
      target is prompt.
    * ``include_prompt=True`` reproduces the managed-backend convention (rLLM Tinker/Fireworks:
      ``mask == 0``): every non-action, non-pad target, prompt included.

    Chat-template wrappers and harness warnings are *not* removed here; an environment that
    knows its message-body spans should build ``obs_mask`` itself (the paper's O′).

    Args:
      action_mask: 0/1 float[B, T].
      valid_mask: 1 on non-padding targets; float[B, T].
      prompt_lengths: optional int[B] prompt lengths in tokens.
      include_prompt: see above.

    Returns:
      0/1 float[B, T] observation mask, disjoint from ``action_mask`` and 0 on padding.
    """
    action = jnp.asarray(action_mask) > 0
    valid = jnp.asarray(valid_mask) > 0
    if action.shape != valid.shape or action.ndim != 2:
        raise ValueError(
            f"observation_mask: action_mask {action.shape} and valid_mask {valid.shape} must both "
            "be [B, T]"
        )
    obs = valid & ~action
    if not include_prompt:
        positions = jnp.arange(action.shape[1])[None, :]
        if prompt_lengths is not None:
            pl = jnp.asarray(prompt_lengths)
            if pl.shape != (action.shape[0],):
                raise ValueError(
                    f"observation_mask: prompt_lengths has shape {pl.shape}, expected "
                    f"({action.shape[0]},)"
                )
            prompt = positions < (pl[:, None] - 1)
        else:
            has_action = jnp.any(action, axis=1, keepdims=True)
            first = jnp.argmax(action, axis=1)[:, None]
            prompt = jnp.where(has_action, positions < first, True)
        obs = obs & ~prompt
    dtype = jnp.asarray(action_mask).dtype
    if not jnp.issubdtype(dtype, jnp.floating):
        dtype = jnp.float32
    return obs.astype(dtype)
