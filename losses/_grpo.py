"""GRPO / PPO-clip policy loss with optional dual clip, TRL ``delta`` and KL penalty."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from losses._batch import Term
from losses._common import check_number, ppo_clip_terms
from losses._correction import as_correction
from losses._policy import _kl_args, policy_term, ppo_or_dapo_twin
from losses._reductions import validate_reduction


def grpo(
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float | None = None,
    kl_coef: float = 0.0,
    kl_estimator: str = "k3",
    reduction: str = "token_mean",
    max_tokens: float | None = None,
    max_log_ratio: float = 20.0,
    correction: Any = None,
    delta: float | None = None,
    kl_score_function: bool = False,
    kl_importance_weight: bool = False,
) -> Term:
    """GRPO/PPO clipped policy loss (Shao et al. 2024, arXiv:2402.03300; Schulman et al. 2017).

    Per action token, with ``r = exp(clip(p - old, ±max_log_ratio))``, ``lo = 1 - clip_low``,
    ``hi = 1 + clip_high``::

        ℓ = -min(r·A, clip(r, lo, hi)·A)       (r → min(r, delta) in the first branch: TRL delta)
        ℓ = min(ℓ, -dual_clip·A)            if dual_clip is set and A < 0
        ℓ = sg(c)·ℓ                         c = the optional mismatch correction's weight
        ℓ += kl_coef · [r·] k(p, ref)       k ∈ {k1, k2, k3}, with its stated gradient in p
        L = Σ_{i,t} w_{i,t}·ℓ_{i,t}         w = the reduction's weights over action_mask

    The gradient is ``-r·A·w`` inside the trust region and exactly 0 where clipping is active
    (``A > 0, r > hi`` or ``A < 0, r < lo``). Masked tokens may hold any value (inf, nan): they
    are replaced before ``exp`` and get exactly zero gradient. ``clip_high = 0.28`` gives DAPO's
    clip-higher (Yu et al. 2025, arXiv:2503.14476).

    **Two-sided ``delta``** (TRL ``delta``, INTELLECT-2; docs/sources.md#newer-objectives): the unclipped
    branch uses ``min(r, δ)``, so the gradient is also 0 for ``A > 0, r > δ`` and for ``A < 0,
    r > max(hi, δ)``. For ``δ ≥ hi`` it equals ``dual_clip=δ`` (docs/sources.md#the-policy-family): e.g.
    ``r = 5, A = -1, ε = 0.2, δ = 4`` gives ``ℓ = 4`` with gradient 0 (no delta: 5 and 5).

    **KL gradients** per token (δ = p - ref, r = exp(p - old); docs/sources.md#kl-variants):

    ===============================  ===========  ==============  ============================
    keywords                         value        ∂/∂p            expected gradient (y ~ old)
    ===============================  ===========  ==============  ============================
    ``k1``                           δ            1               0 on-policy: useless
    ``k2``                           δ²/2         δ               ∇KL(p‖ref) on-policy only
    ``k3`` (default)                 k3           1 - e^{-δ}      ∇KL(ref‖p) (forward: biased)
    ``k1``/``k3`` + score_function   k1 / k3      δ               ∇KL(p‖ref) on-policy (verl
                                                                  ``k1+``/``k3+``)
    ``k3`` + importance_weight       r·k3         r·δ             ∇KL(p‖ref) (DeepSeek-V3.2)
    ``k1`` + importance_weight       r·δ          r·(δ + 1)       ∇KL(p‖ref) (slime)
    ``k2`` + importance_weight       r·δ²/2       r·(δ²/2 + δ)    biased
    any + both                       r·k          sg(r)·δ         ∇KL(p‖ref) (OpenRLHF #1309)
    ===============================  ===========  ==============  ============================

    Args:
      clip_low: ε_lo ≥ 0 (< 1); the lower ratio bound is ``1 - clip_low``.
      clip_high: ε_hi ≥ 0; the upper ratio bound is ``1 + clip_high``.
      dual_clip: ``c > 1`` caps the loss of negative-advantage tokens at ``-c·A``; None = off.
      kl_coef: β ≥ 0 of the KL penalty to ``batch.ref_logprobs`` (needed when β > 0).
      kl_estimator: ``"k1"``, ``"k2"`` or ``"k3"`` (Schulman 2020).
      reduction: one of ``losses.REDUCTIONS``.
      max_tokens: the Dr. GRPO constant, required for ``seq_mean_token_sum_norm``.
      max_log_ratio: clamp of ``p - old`` and ``p - ref`` before ``exp`` (verl/SkyRL: 20).
      correction: optional `losses.mismatch_correction` (TIS/MIS between ``old_logprobs`` and
        ``sampling_logprobs``); it weights the clipped surrogate, not the KL term. None = off,
        which leaves the term bit-for-bit unchanged.
      delta: TRL's cap ``δ > 1`` of the unclipped ratio; None = off. Not combinable with
        ``dual_clip`` (for ``δ ≥ hi`` they are the same cap).
      kl_score_function: the KL estimate keeps its value and takes the score-function gradient
        ``δ`` (table above).
      kl_importance_weight: multiply the KL estimate by ``r = exp(p - old)``, not detached
        (TRL ``use_bias_correction_kl``); the KL then also reads ``old_logprobs``.

    Returns:
      A `Term` ``(logprobs[B, T], batch) -> (loss, metrics)`` reading ``action_mask``,
      ``advantages`` ([B] or [B, T]), ``old_logprobs`` and (with β > 0) ``ref_logprobs``.
      Metrics: ``loss``, ``pg_loss``, ``kl_loss``, ``kl`` (token mean of the estimator),
      ``clip_frac_low``, ``clip_frac_high``, ``dual_clip_frac``, ``ratio_mean``, ``ratio_max``,
      ``adv_mean``, ``num_tokens``; with a correction also its ``mismatch_*`` metrics.
      `losses.builtin_twin` maps it to the ``ppo`` kernel (``dapo`` with ``dual_clip``, or with
      ``eps_clip_c = delta`` when ``delta ≥ hi``) when KL and correction are off.

    Example:
      >>> import jax.numpy as jnp, losses
      >>> batch = losses.Batch(action_mask=jnp.ones((1, 2)), advantages=jnp.array([1.0]),
      ...                      sampling_logprobs=jnp.array([[-1.0, -2.0]]))
      >>> loss, metrics = losses.grpo()(jnp.array([[-1.0, -2.0]]), batch)
      >>> float(loss)
      -1.0
    """
    where = "grpo"
    clip_low = check_number(where, "clip_low", clip_low, low=0.0)
    if clip_low >= 1.0:
        raise ValueError(
            f"grpo: clip_low must be < 1 (the lower bound is 1 - clip_low), got {clip_low}"
        )
    clip_high = check_number(where, "clip_high", clip_high, low=0.0)
    if dual_clip is not None:
        dual_clip = check_number(where, "dual_clip", dual_clip, low=1.0, low_open=True)
    if delta is not None:
        delta = check_number(where, "delta", delta, low=1.0, low_open=True)
        if dual_clip is not None:
            raise ValueError("grpo: give dual_clip or delta, not both (the same cap for A < 0)")
    kl_coef = _kl_args(where, kl_coef, kl_estimator, kl_score_function, kl_importance_weight)
    validate_reduction(reduction, max_tokens, where=where)
    max_log_ratio = check_number(where, "max_log_ratio", max_log_ratio, low=0.0, low_open=True)
    corr = as_correction(correction, where)
    config = dict(
        clip_low=clip_low,
        clip_high=clip_high,
        dual_clip=dual_clip,
        kl_coef=kl_coef,
        kl_estimator=kl_estimator,
        reduction=reduction,
        max_tokens=max_tokens,
        max_log_ratio=max_log_ratio,
        correction=None if corr is None else corr.as_config(),
        delta=delta,
        kl_score_function=kl_score_function,
        kl_importance_weight=kl_importance_weight,
    )

    lo, hi = 1.0 - clip_low, 1.0 + clip_high

    # The delta cap as a dual clip when it is one (δ ≥ hi); else it has no kernel.
    cap = dual_clip if delta is None else delta
    twin = ppo_or_dapo_twin(lo, hi, cap) if delta is None or delta >= hi else None

    def per_token(*, log_ratio, adv, valid, **_):
        ratio = jax.lax.stop_gradient(jnp.exp(log_ratio))
        terms = ppo_clip_terms(
            log_ratio, adv, ratio_low=lo, ratio_high=hi, dual_clip=dual_clip, delta=delta
        )
        low = valid & (adv < 0) & (ratio < lo)
        high = valid & (adv > 0) & (ratio > (hi if delta is None else min(hi, delta)))
        if cap is None:
            dual = valid & False
        else:
            dual = valid & (adv < 0) & (ratio > (cap if delta is None else max(hi, delta)))
        return terms, {
            "clip_frac_low": low.astype(ratio.dtype),
            "clip_frac_high": high.astype(ratio.dtype),
            "dual_clip_frac": dual.astype(ratio.dtype),
        }

    return policy_term(
        name="grpo",
        kind="grpo",
        per_token=per_token,
        reduction=reduction,
        max_tokens=max_tokens,
        max_log_ratio=max_log_ratio,
        config=config,
        correction=corr,
        kl_coef=kl_coef,
        kl_estimator=kl_estimator,
        kl_score_function=kl_score_function,
        kl_importance_weight=kl_importance_weight,
        twin=twin,
    )
