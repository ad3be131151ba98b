"""Policy-gradient terms with the Fireworks/Tinker built-in kernels' formulas.

Notation (per action token): ``p`` current logprob (differentiable), ``q = old_logprobs`` the
anchor (stop-gradient), ``A`` the advantage (stop-gradient), ``r = exp(clip(p - q, ±max_log_ratio))``.
Each term reduces its per-token loss ``ℓ`` with a reduction over ``action_mask``; with
``reduction="token_sum"`` it is exactly the corresponding Fireworks built-in kernel
(reference/fireworks-sdk.md §4), so a runner may execute it on the server.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from losses._batch import Batch, Term, check_logprobs_shape, require
from losses._common import (
    check_number,
    clamped_log_ratio,
    masked_mean,
    per_token_advantages,
    safe,
)
from losses._grpo import ppo_clip_terms
from losses._reductions import term_weights, validate_reduction

#: ``(logprobs, anchor, log_ratio, adv, valid) -> (ℓ[B, T], extra metrics)``.
PerToken = Callable[..., tuple[jax.Array, dict]]


def policy_term(
    *,
    name: str,
    kind: str,
    per_token: PerToken,
    reduction: str,
    max_tokens: float | None,
    max_log_ratio: float,
    config: dict,
) -> Term:
    """Builds a policy `Term` from a per-token loss; shared by the policy family.

    The returned term sanitizes masked entries (double-``where``), clamps the log-ratio, reduces
    with the reduction's weights over ``action_mask`` and reports ``loss``, ``ratio_mean``,
    ``ratio_max``, ``adv_mean``, ``num_tokens`` plus the per-token function's extra metrics.
    """

    def loss_fn(logprobs, batch: Batch):
        lp = check_logprobs_shape(logprobs, batch)
        batch = jax.lax.stop_gradient(batch)
        anchor = require(batch, "old_logprobs", kind)
        valid = batch.action_mask > 0
        adv = per_token_advantages(batch, valid, kind)
        w = term_weights(batch, "action", reduction, max_tokens)
        log_ratio = clamped_log_ratio(lp, anchor, valid, max_log_ratio)
        terms_BT, extra = per_token(
            logprobs=safe(lp, valid),
            anchor=safe(anchor, valid),
            log_ratio=log_ratio,
            adv=adv,
            valid=valid,
        )
        loss = jnp.sum(w * safe(terms_BT, valid))
        ratio = jax.lax.stop_gradient(jnp.exp(log_ratio))
        metrics = {
            "loss": jax.lax.stop_gradient(loss),
            "ratio_mean": masked_mean(ratio, valid),
            "ratio_max": jnp.max(jnp.where(valid, ratio, 0.0)),
            "adv_mean": masked_mean(adv, valid),
            "num_tokens": jnp.sum(valid.astype(lp.dtype)),
        }
        for key, value in extra.items():
            metrics[key] = masked_mean(value, valid) if value.ndim == 2 else value
        return loss, metrics

    config = dict(config, reduction=reduction, max_tokens=max_tokens, max_log_ratio=max_log_ratio)
    return Term(name=name, fn=loss_fn, kind=kind, config=config)


def _common_args(where, reduction, max_tokens, max_log_ratio):
    validate_reduction(reduction, max_tokens, where=where)
    return check_number(where, "max_log_ratio", max_log_ratio, low=0.0, low_open=True)


def importance_sampling(
    *, reduction: str = "token_mean", max_tokens: float | None = None, max_log_ratio: float = 20.0
) -> Term:
    """Importance-sampled policy gradient ``ℓ = -r·A`` (no clipping).

    Tinker/Fireworks built-in ``importance_sampling`` (``-Σ exp(p - q)·A``) with
    ``reduction="token_sum"``; on-policy it is REINFORCE. The gradient is ``-r·A·w``.

    Args:
      reduction: one of ``losses.REDUCTIONS``.
      max_tokens: the ``seq_mean_token_sum_norm`` constant.
      max_log_ratio: clamp of ``p - q`` before ``exp``.

    Returns:
      A `Term` reading ``action_mask``, ``advantages``, ``old_logprobs``. Metrics: ``loss``,
      ``ratio_mean``, ``ratio_max``, ``adv_mean``, ``num_tokens``.
    """
    mlr = _common_args("importance_sampling", reduction, max_tokens, max_log_ratio)

    def per_token(*, log_ratio, adv, **_):
        return -adv * jnp.exp(log_ratio), {}

    return policy_term(
        name="importance_sampling",
        kind="importance_sampling",
        per_token=per_token,
        reduction=reduction,
        max_tokens=max_tokens,
        max_log_ratio=mlr,
        config={},
    )


def ppo(
    *,
    clip_low_threshold: float = 0.8,
    clip_high_threshold: float = 1.2,
    reduction: str = "token_mean",
    max_tokens: float | None = None,
    max_log_ratio: float = 20.0,
) -> Term:
    """PPO clipped surrogate with **absolute** ratio thresholds (Tinker/Fireworks ``ppo``).

    ``ℓ = -min(r·A, clip(r, clip_low_threshold, clip_high_threshold)·A)``; with
    ``reduction="token_sum"`` this is the built-in ``ppo`` kernel and its ``loss_fn_config`` keys.
    ``grpo(clip_low=ε_lo, clip_high=ε_hi)`` without KL or dual clip equals
    ``ppo(clip_low_threshold=1-ε_lo, clip_high_threshold=1+ε_hi)``.

    Args:
      clip_low_threshold: lower ratio bound, ``0 ≤ lo ≤ 1`` (Tinker default 0.8).
      clip_high_threshold: upper ratio bound, ``≥ max(lo, 1)`` (Tinker default 1.2).
      reduction: one of ``losses.REDUCTIONS``.
      max_tokens: the ``seq_mean_token_sum_norm`` constant.
      max_log_ratio: clamp of ``p - q`` before ``exp``.

    Returns:
      A `Term`. Metrics add ``clip_frac_low`` and ``clip_frac_high`` (tokens whose gradient the
      clip zeroes).
    """
    where = "ppo"
    mlr = _common_args(where, reduction, max_tokens, max_log_ratio)
    lo = check_number(where, "clip_low_threshold", clip_low_threshold, low=0.0, high=1.0)
    hi = check_number(where, "clip_high_threshold", clip_high_threshold, low=1.0)

    def per_token(*, log_ratio, adv, valid, **_):
        ratio = jax.lax.stop_gradient(jnp.exp(log_ratio))
        low = (valid & (adv < 0) & (ratio < lo)).astype(ratio.dtype)
        high = (valid & (adv > 0) & (ratio > hi)).astype(ratio.dtype)
        terms = ppo_clip_terms(log_ratio, adv, ratio_low=lo, ratio_high=hi)
        return terms, {"clip_frac_low": low, "clip_frac_high": high}

    return policy_term(
        name="ppo",
        kind="ppo",
        per_token=per_token,
        reduction=reduction,
        max_tokens=max_tokens,
        max_log_ratio=mlr,
        config=dict(clip_low_threshold=lo, clip_high_threshold=hi),
    )


def cispo(
    *,
    clip_low_threshold: float | None = None,
    clip_high_threshold: float | None = None,
    clip_low: float | None = None,
    clip_high: float | None = None,
    reduction: str = "token_mean",
    max_tokens: float | None = None,
    max_log_ratio: float = 20.0,
) -> Term:
    """CISPO: ``ℓ = -sg(clip(r, lo, hi))·A·p`` (MiniMax-M1, arXiv:2506.13585).

    The clipped ratio is a stop-gradient coefficient, so every token keeps the gradient
    ``-clip(r)·A·w`` (never zeroed). Bounds are given either absolutely
    (``clip_low_threshold``/``clip_high_threshold``, the Tinker/Fireworks ``cispo`` keys, default
    ``[0, 4]`` as in the Tinker tutorial) or as offsets (``clip_low``/``clip_high``: bounds
    ``[1 - clip_low, 1 + clip_high]``, the verl/SkyRL style). Mixing the two styles raises.
    With ``reduction="token_sum"`` this is the built-in ``cispo`` kernel.

    Args:
      clip_low_threshold: absolute lower bound ``≥ 0``.
      clip_high_threshold: absolute upper bound ``≥ 1``.
      clip_low: offset ``ε_lo ∈ [0, 1]``.
      clip_high: offset ``ε_hi ≥ 0``.
      reduction: one of ``losses.REDUCTIONS``.
      max_tokens: the ``seq_mean_token_sum_norm`` constant.
      max_log_ratio: clamp of ``p - q`` before ``exp``.

    Returns:
      A `Term`. Metrics add ``clip_frac`` (tokens whose coefficient was clipped).
    """
    where = "cispo"
    mlr = _common_args(where, reduction, max_tokens, max_log_ratio)
    absolute = clip_low_threshold is not None or clip_high_threshold is not None
    offset = clip_low is not None or clip_high is not None
    if absolute and offset:
        raise ValueError(
            "cispo: give the bounds either as thresholds (clip_low_threshold/clip_high_threshold) "
            "or as offsets (clip_low/clip_high), not both"
        )
    if offset:
        el = check_number(
            where, "clip_low", 0.2 if clip_low is None else clip_low, low=0.0, high=1.0
        )
        eh = check_number(where, "clip_high", 0.2 if clip_high is None else clip_high, low=0.0)
        lo, hi = 1.0 - el, 1.0 + eh
    else:
        lo = check_number(
            where,
            "clip_low_threshold",
            0.0 if clip_low_threshold is None else clip_low_threshold,
            low=0.0,
            high=1.0,
        )
        hi = check_number(
            where,
            "clip_high_threshold",
            4.0 if clip_high_threshold is None else clip_high_threshold,
            low=1.0,
        )

    def per_token(*, logprobs, log_ratio, adv, valid, **_):
        ratio = jax.lax.stop_gradient(jnp.exp(log_ratio))
        coef = jax.lax.stop_gradient(jnp.clip(ratio, lo, hi))
        clipped = (valid & ((ratio < lo) | (ratio > hi))).astype(ratio.dtype)
        return -coef * adv * logprobs, {"clip_frac": clipped}

    return policy_term(
        name="cispo",
        kind="cispo",
        per_token=per_token,
        reduction=reduction,
        max_tokens=max_tokens,
        max_log_ratio=mlr,
        config=dict(clip_low_threshold=lo, clip_high_threshold=hi),
    )


def dro(
    *, beta: float = 0.05, reduction: str = "token_mean", max_tokens: float | None = None
) -> Term:
    """DRO: ``ℓ = -(p·A - ½·β·(p - q)²)`` (Tinker/Fireworks built-in ``dro``).

    The quadratic penalty keeps ``p`` near the anchor ``q = old_logprobs``; the gradient is
    ``-(A - β(p - q))·w``. With ``reduction="token_sum"`` over an ``action_mask`` that covers every
    target, this is the built-in ``dro`` kernel (which applies the quadratic at every position).

    Args:
      beta: β ≥ 0 (Tinker docs example 0.05).
      reduction: one of ``losses.REDUCTIONS``.
      max_tokens: the ``seq_mean_token_sum_norm`` constant.

    Returns:
      A `Term`. Metrics add ``sq_dev`` (mean of ``(p - q)²``).
    """
    where = "dro"
    validate_reduction(reduction, max_tokens, where=where)
    b = check_number(where, "beta", beta, low=0.0)

    def per_token(*, logprobs, anchor, adv, **_):
        dev = logprobs - jax.lax.stop_gradient(anchor)
        return -(logprobs * adv - 0.5 * b * jnp.square(dev)), {"sq_dev": jnp.square(dev)}

    # DRO has no ratio; max_log_ratio only clamps the (unused) ratio metrics.
    return policy_term(
        name="dro",
        kind="dro",
        per_token=per_token,
        reduction=reduction,
        max_tokens=max_tokens,
        max_log_ratio=20.0,
        config=dict(beta=b),
    )
