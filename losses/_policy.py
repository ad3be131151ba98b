"""The policy-gradient family: IS, PPO, CISPO, DRO, DAPO, DPPO, REINFORCE, SAPO (+ the builder).

Notation (per action token): ``p`` current logprob (the only differentiable input), ``q =
old_logprobs`` the proximal anchor (stop-gradient), ``A`` the advantage (stop-gradient, per row
``[B]`` or per token ``[B, T]``), ``r = exp(clip(p - q, ±max_log_ratio))``, ``sg`` stop-gradient.

Every term reduces its per-token loss ``ℓ`` with the weights ``w`` of a reduction over
``action_mask`` (``losses.REDUCTIONS``): ``L = Σ w·ℓ``. Every term accepts ``correction=`` (a
`losses.mismatch_correction`), which multiplies ``ℓ`` by a detached rollout-mismatch weight.

With ``reduction="token_sum"`` and no correction, ``importance_sampling``, ``ppo``, ``cispo``,
``dro``, ``dapo`` and ``dppo`` (and ``gspo`` in ``_policy_seq.py``) are the Fireworks/Tinker
built-in kernels of the same names (docs/training-api.md#builtin-kernels); `losses.builtin_twin` says when
a term is exactly one, with its ``loss_fn_config``. Hyperparameter names are those
``loss_fn_config`` keys (``clip_low_threshold``, ``clip_high_threshold``, ``beta``,
``eps_clip_c``, ``divergence``, ``threshold``), so a config moves between paths unchanged.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from losses._batch import Batch, Term, Twin, check_logprobs_shape, count, reduction_reads, require
from losses._common import (
    KL_ESTIMATORS,
    check_choice,
    check_number,
    clamped_log_ratio,
    kl_penalty,
    masked_mean,
    per_token_advantages,
    ppo_clip_terms,
    safe,
)
from losses._correction import as_correction
from losses._per_datum import with_correction
from losses._reductions import term_weights, validate_reduction

#: ``(*, logprobs, anchor, log_ratio, adv, valid) -> (ℓ[B, T], extra metrics)``.
PerToken = Callable[..., tuple[jax.Array, dict]]

#: The ``max_log_ratio`` the built-in twins assume: the cookbook clients' ``ratio_log_cap``
#: default. The ``ppo``/``importance_sampling`` kernels take no cap; a clamp at 20 binds only
#: beyond e^±20.
TWIN_MAX_LOG_RATIO = 20.0


def policy_term(
    *,
    name: str,
    kind: str,
    per_token: PerToken,
    reduction: str,
    max_tokens: float | None,
    max_log_ratio: float | None,
    config: dict,
    correction: Any = None,
    kl_coef: float = 0.0,
    kl_estimator: str = "k3",
    twin: Twin | None = None,
    kl_score_function: bool = False,
    kl_importance_weight: bool = False,
    kl_target: str = "ref_logprobs",
    anchor: str = "old_logprobs",
    accepts_correction: bool = True,
    pass_batch: bool = False,
    correction_to_per_token: bool = False,
    per_datum: bool = True,
) -> Term:
    """Builds a policy `Term` from a per-token loss; shared by the whole policy family.

    The term reads ``action_mask``, ``advantages`` and ``old_logprobs``; it sanitizes masked
    entries before any ``exp`` (double-``where``: masked positions may hold inf/nan and get
    exactly zero gradient), clamps ``p - q`` to ``±max_log_ratio``, calls ``per_token``, applies
    the optional mismatch correction ``c`` and KL penalty, and reduces::

        L = Σ_{i,t} w_{i,t}·c_{i,t}·ℓ_{i,t}  +  kl_coef·Σ_{i,t} w_{i,t}·k(p, ref)_{i,t}

    Args:
      name: default name for `fold`.
      kind: the constructor's name (``Term.kind``).
      per_token: ``(*, logprobs, anchor, log_ratio, adv, valid) -> (ℓ[B, T], extra)``; inputs
        are sanitized (0 on masked tokens), ``log_ratio`` is clamped; ``extra`` maps metric names
        to float[B, T] (reported as their mean over action tokens) or 0-d arrays.
      reduction: one of ``losses.REDUCTIONS``.
      max_tokens: the ``seq_mean_token_sum_norm`` constant.
      max_log_ratio: clamp of ``p - q``; ``None`` = 20 and not a config key (terms without a
        ratio hyperparameter, e.g. ``dro``).
      config: the constructor's validated hyperparameters (`Term.config`); ``reduction``,
        ``max_tokens``, ``max_log_ratio`` and ``correction`` are added when missing.
      correction: ``None``, a `losses.mismatch_correction` or a mapping of its keywords.
      kl_coef: β ≥ 0 of a KL penalty to ``ref_logprobs`` (not corrected); 0 = off.
      kl_estimator: ``"k1"``, ``"k2"`` or ``"k3"`` (or a sampler form of
        ``losses._common.SAMPLER_KL_FORMS`` with ``kl_target="sampling_logprobs"``).
      twin: the built-in kernel that computes the term exactly when no correction and no KL is
        on and ``max_log_ratio`` is the kernels' 20 (`losses.builtin_twin`); dropped otherwise.
      kl_score_function: the KL estimate's score-function gradient ``δ`` (`kl_penalty`).
      kl_importance_weight: multiply the KL estimate by ``r = exp(p - old)``, not detached
        (DeepSeek-V3.2 / TRL ``use_bias_correction_kl``; detached for score-function forms).
      kl_target: the field the KL compares ``p`` with (``ref_logprobs``; ``sampling_logprobs``
        for a trust region toward the sampler).
      anchor: the field of the ratio's anchor ``q`` (``old_logprobs``; ``sampling_logprobs``
        for terms defined against the sampler, e.g. prime-rl's).
      accepts_correction: the constructor has a ``correction`` keyword (else it is not a config
        key and must be None).
      pass_batch: also pass the (stop-gradiented) ``batch=`` to ``per_token`` (terms that read
        batch-global data, e.g. Clip-Cov's PRNG seed).
      correction_to_per_token: pass the correction weights to ``per_token`` as
        ``correction=`` float[B, T] (ones without a correction) instead of multiplying ``ℓ`` by
        them (VESPO folds them into its sequence weight).
      per_datum: ``per_token`` reads one row at a time, so the term is a sum of per-row losses
        given the batch's normalizers (and ``is_weight_mean``): `Term.per_datum`. ``False`` for
        terms coupled across rows through the logprobs (Clip-Cov, KL-Cov).

    The term reads ``action_mask``, ``advantages``, ``old_logprobs``, ``ref_logprobs`` (with
    KL), ``sampling_logprobs`` (with a correction) and the reduction's normalizers (`Term.reads`).

    Returns:
      A `Term`. Metrics: ``loss``, ``ratio_mean``, ``ratio_max``, ``adv_mean``, ``num_tokens``,
      ``pg_loss``, ``kl_loss``, ``kl`` (0 when ``kl_coef == 0``), the ``extra`` metrics, and the
      correction's ``mismatch_*`` metrics when on.
    """
    corr = as_correction(correction, kind)
    mlr = 20.0 if max_log_ratio is None else max_log_ratio
    cfg = dict(config)
    cfg.setdefault("reduction", reduction)
    cfg.setdefault("max_tokens", max_tokens)
    if max_log_ratio is not None:
        cfg.setdefault("max_log_ratio", max_log_ratio)
    if accepts_correction:
        cfg.setdefault("correction", None if corr is None else corr.as_config())
    elif corr is not None:  # pragma: no cover - constructors without the keyword pass None
        raise ValueError(f"{kind}: takes no correction")
    requires = {"action_mask", "advantages", anchor}
    if kl_coef > 0.0:
        requires.add(kl_target)
        if kl_importance_weight:
            requires.add("old_logprobs")
    if corr is not None:
        requires |= corr.requires
    reads = frozenset(requires) | reduction_reads(reduction, "action")
    if corr is not None:
        reads |= corr.reads
    exact_ratio = max_log_ratio is None or max_log_ratio == TWIN_MAX_LOG_RATIO
    if corr is not None or kl_coef > 0.0 or not exact_ratio:
        twin = None

    def loss_fn(logprobs, batch: Batch) -> tuple[jax.Array, dict[str, jax.Array]]:
        lp = check_logprobs_shape(logprobs, batch)
        batch = jax.lax.stop_gradient(batch)
        q = require(batch, anchor, kind)
        valid = batch.action_mask > 0
        adv = per_token_advantages(batch, valid, kind)
        w = term_weights(batch, "action", reduction, max_tokens)
        log_ratio = clamped_log_ratio(lp, q, valid, mlr)
        inputs = dict(
            logprobs=safe(lp, valid),
            anchor=safe(jax.lax.stop_gradient(q), valid),
            log_ratio=log_ratio,
            adv=adv,
            valid=valid,
        )
        if pass_batch:
            inputs["batch"] = batch
        metrics: dict[str, jax.Array] = {}
        c_BT = None
        if corr is not None:
            c_BT, corr_metrics = corr.weights(batch, valid, logprobs=lp)
            metrics.update(corr_metrics)
        if correction_to_per_token:
            inputs["correction"] = valid.astype(lp.dtype) if c_BT is None else c_BT
        terms_BT, extra = per_token(**inputs)
        terms_BT = safe(terms_BT, valid)
        if c_BT is not None and not correction_to_per_token:
            terms_BT = c_BT * terms_BT
        pg_loss = jnp.sum(w * terms_BT)
        loss = pg_loss
        if kl_coef > 0.0:
            target = require(batch, kl_target, kind)
            iw = None
            if kl_importance_weight:
                iw = clamped_log_ratio(lp, require(batch, "old_logprobs", kind), valid, mlr)
            kl_BT = kl_penalty(
                lp,
                target,
                valid,
                estimator=kl_estimator,
                max_log_ratio=mlr,
                score_function=kl_score_function,
                importance_log_ratio=iw,
            )
            kl_loss = kl_coef * jnp.sum(w * kl_BT)
            loss = pg_loss + kl_loss
            metrics["kl"] = masked_mean(kl_BT, valid)
        else:
            kl_loss = jnp.zeros((), pg_loss.dtype)
            metrics["kl"] = jnp.zeros((), pg_loss.dtype)
        metrics["pg_loss"] = jax.lax.stop_gradient(pg_loss)
        metrics["kl_loss"] = jax.lax.stop_gradient(kl_loss)
        ratio = jax.lax.stop_gradient(jnp.exp(log_ratio))
        metrics.update(
            {
                "loss": jax.lax.stop_gradient(loss),
                "ratio_mean": masked_mean(ratio, valid),
                "ratio_max": jnp.max(jnp.where(valid, ratio, 0.0)),
                "adv_mean": masked_mean(adv, valid),
                "num_tokens": count(valid.astype(lp.dtype)),
            }
        )
        for key, value in extra.items():
            value = jax.lax.stop_gradient(value)
            metrics[key] = masked_mean(value, valid) if value.ndim == 2 else value
        return loss, metrics

    return Term(
        name=name,
        fn=loss_fn,
        kind=kind,
        config=cfg,
        reads=reads,
        requires=frozenset(requires),
        twin=twin,
        per_datum=with_correction(corr) if per_datum else None,
    )


# -- shared validation --------------------------------------------------------------------------


def _common_args(where, reduction, max_tokens, max_log_ratio):
    validate_reduction(reduction, max_tokens, where=where)
    return check_number(where, "max_log_ratio", max_log_ratio, low=0.0, low_open=True)


def ratio_bounds(
    where: str,
    *,
    clip_low_threshold: float | None,
    clip_high_threshold: float | None,
    clip_low: float | None,
    clip_high: float | None,
    default_thresholds: tuple[float, float],
    default_offsets: tuple[float, float],
) -> tuple[float, float]:
    """Resolves absolute ratio bounds from thresholds or (exclusively) offsets ``1 ∓ ε``."""
    absolute = clip_low_threshold is not None or clip_high_threshold is not None
    offset = clip_low is not None or clip_high is not None
    if absolute and offset:
        raise ValueError(
            f"{where}: give the bounds either as thresholds (clip_low_threshold/"
            "clip_high_threshold) or as offsets (clip_low/clip_high), not both"
        )
    if offset:
        el = default_offsets[0] if clip_low is None else clip_low
        eh = default_offsets[1] if clip_high is None else clip_high
        el = check_number(where, "clip_low", el, low=0.0, high=1.0)
        eh = check_number(where, "clip_high", eh, low=0.0)
        return 1.0 - el, 1.0 + eh
    lo = default_thresholds[0] if clip_low_threshold is None else clip_low_threshold
    hi = default_thresholds[1] if clip_high_threshold is None else clip_high_threshold
    lo = check_number(where, "clip_low_threshold", lo, low=0.0, high=1.0)
    hi = check_number(where, "clip_high_threshold", hi, low=1.0)
    return lo, hi


def _kl_args(where, kl_coef, kl_estimator, kl_score_function=False, kl_importance_weight=False):
    """Validates the reference-KL keywords shared by `grpo` and `reinforce`; returns β."""
    kl_coef = check_number(where, "kl_coef", kl_coef, low=0.0)
    check_choice(where, "kl_estimator", kl_estimator, KL_ESTIMATORS)
    for name, value in (
        ("kl_score_function", kl_score_function),
        ("kl_importance_weight", kl_importance_weight),
    ):
        if not isinstance(value, bool):
            raise ValueError(f"{where}: {name} must be a bool, got {value!r}")
    return kl_coef


def ppo_or_dapo_twin(lo: float, hi: float, dual_clip: float | None) -> Twin:
    """``ppo`` with absolute thresholds, or the inferred ``dapo`` kernel with a dual clip."""
    thresholds = {"clip_low_threshold": float(lo), "clip_high_threshold": float(hi)}
    if dual_clip is None:
        return Twin("ppo", thresholds)
    return Twin("dapo", {**thresholds, "eps_clip_c": float(dual_clip)}, provenance="inferred")


def _frac(mask_BT, dtype):
    return mask_BT.astype(dtype)


# -- terms --------------------------------------------------------------------------------------


def importance_sampling(
    *,
    reduction: str = "token_mean",
    max_tokens: float | None = None,
    max_log_ratio: float = 20.0,
    correction: Any = None,
) -> Term:
    """Importance-sampled policy gradient ``ℓ = -r·A`` (no clipping).

    Tinker/Fireworks built-in ``importance_sampling`` (``-Σ exp(p - q)·A``, documented) with
    ``reduction="token_sum"``; on-policy it is REINFORCE. The gradient is ``-r·A·w``.

    Args:
      reduction: one of ``losses.REDUCTIONS``.
      max_tokens: the ``seq_mean_token_sum_norm`` constant.
      max_log_ratio: clamp of ``p - q`` before ``exp``.
      correction: optional `losses.mismatch_correction` (multiplies ``ℓ`` by ``sg(c)``).

    Returns:
      A `Term` ``(logprobs[B, T], batch) -> (loss, metrics)`` reading ``action_mask``,
      ``advantages``, ``old_logprobs`` (and ``sampling_logprobs`` with a correction). Metrics:
      ``loss``, ``ratio_mean``, ``ratio_max``, ``adv_mean``, ``num_tokens``.
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
        correction=correction,
        twin=Twin("importance_sampling", {}),
    )


def ppo(
    *,
    clip_low_threshold: float | None = None,
    clip_high_threshold: float | None = None,
    clip_low: float | None = None,
    clip_high: float | None = None,
    reduction: str = "token_mean",
    max_tokens: float | None = None,
    max_log_ratio: float = 20.0,
    correction: Any = None,
) -> Term:
    """PPO clipped surrogate with **absolute** ratio thresholds (Tinker/Fireworks ``ppo``).

    ``ℓ = -min(r·A, clip(r, lo, hi)·A)`` (Schulman et al. 2017, arXiv:1707.06347). The gradient
    is ``-r·A·w`` inside the trust region and exactly 0 where the clip is active (``A > 0, r >
    hi`` or ``A < 0, r < lo``). With ``reduction="token_sum"`` this is the built-in ``ppo`` kernel
    (documented) and its ``loss_fn_config`` keys. ``grpo(clip_low=ε_lo, clip_high=ε_hi)`` without
    KL or dual clip equals ``ppo(clip_low_threshold=1-ε_lo, clip_high_threshold=1+ε_hi)``.

    Args:
      clip_low_threshold: lower ratio bound ``lo ∈ [0, 1]`` (Tinker default 0.8).
      clip_high_threshold: upper ratio bound ``hi ≥ 1`` (Tinker default 1.2).
      clip_low: alternatively the offset ``ε_lo ∈ [0, 1]`` (``lo = 1 - ε_lo``; default 0.2).
      clip_high: alternatively the offset ``ε_hi ≥ 0`` (``hi = 1 + ε_hi``; default 0.2).
      reduction: one of ``losses.REDUCTIONS``.
      max_tokens: the ``seq_mean_token_sum_norm`` constant.
      max_log_ratio: clamp of ``p - q`` before ``exp``.
      correction: optional `losses.mismatch_correction`.

    Returns:
      A `Term`; ``config`` holds the absolute thresholds. Metrics add ``clip_frac_low`` and
      ``clip_frac_high`` (tokens whose gradient the clip zeroes).
    """
    where = "ppo"
    mlr = _common_args(where, reduction, max_tokens, max_log_ratio)
    lo, hi = ratio_bounds(
        where,
        clip_low_threshold=clip_low_threshold,
        clip_high_threshold=clip_high_threshold,
        clip_low=clip_low,
        clip_high=clip_high,
        default_thresholds=(0.8, 1.2),
        default_offsets=(0.2, 0.2),
    )

    def per_token(*, log_ratio, adv, valid, **_):
        ratio = jax.lax.stop_gradient(jnp.exp(log_ratio))
        low = _frac(valid & (adv < 0) & (ratio < lo), ratio.dtype)
        high = _frac(valid & (adv > 0) & (ratio > hi), ratio.dtype)
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
        correction=correction,
        twin=Twin("ppo", dict(clip_low_threshold=lo, clip_high_threshold=hi)),
    )


def dapo(
    *,
    clip_low_threshold: float | None = None,
    clip_high_threshold: float | None = None,
    clip_low: float | None = None,
    clip_high: float | None = None,
    eps_clip_c: float | None = None,
    reduction: str = "token_mean",
    max_tokens: float | None = None,
    max_log_ratio: float = 20.0,
    correction: Any = None,
) -> Term:
    """DAPO policy loss: PPO clip-higher plus an optional dual clip (Fireworks ``dapo``).

    DAPO (Yu et al. 2025, arXiv:2503.14476) decouples the clip range (``ε_lo = 0.2``, ``ε_hi =
    0.28``) and reduces by the token mean over the optimizer batch; the dual clip (Ye et al.
    2020, arXiv:1912.09729; verl ``clip_ratio_c``) caps the loss of negative-advantage tokens::

        ℓ = -min(r·A, clip(r, lo, hi)·A)
        ℓ = min(ℓ, -eps_clip_c·A)          if eps_clip_c is set and A < 0

    The gradient is ``-r·A·w`` inside the trust region and exactly 0 where a clip is active
    (``A > 0, r > hi``; ``A < 0, r < lo``; ``A < 0, r > eps_clip_c``). TRL's ``delta`` is the
    same cap for ``delta ≥ hi``. With ``reduction="token_sum"`` this is the Fireworks built-in
    ``dapo`` kernel — a formula *inferred* from the cookbook's client twin (the kernel is not
    public); without ``eps_clip_c`` it is exactly the documented ``ppo`` kernel, which is what
    `losses.builtin_twin` then returns (as the cookbook's registry did).

    Args:
      clip_low_threshold: lower ratio bound ``lo ∈ [0, 1]`` (default 0.8).
      clip_high_threshold: upper ratio bound ``hi ≥ 1`` (default 1.28).
      clip_low: alternatively ``ε_lo ∈ [0, 1]`` (default 0.2).
      clip_high: alternatively ``ε_hi ≥ 0`` (default 0.28).
      eps_clip_c: dual-clip constant ``c > 1`` (verl default 3); None = off.
      reduction: one of ``losses.REDUCTIONS`` (default ``token_mean``, as in DAPO).
      max_tokens: the ``seq_mean_token_sum_norm`` constant.
      max_log_ratio: clamp of ``p - q`` before ``exp`` (the cookbook's ``ratio_log_cap``, 20).
      correction: optional `losses.mismatch_correction`.

    Returns:
      A `Term`. Metrics add ``clip_frac_low``, ``clip_frac_high``, ``dual_clip_frac``.
    """
    where = "dapo"
    mlr = _common_args(where, reduction, max_tokens, max_log_ratio)
    lo, hi = ratio_bounds(
        where,
        clip_low_threshold=clip_low_threshold,
        clip_high_threshold=clip_high_threshold,
        clip_low=clip_low,
        clip_high=clip_high,
        default_thresholds=(0.8, 1.28),
        default_offsets=(0.2, 0.28),
    )
    c = None
    if eps_clip_c is not None:
        c = check_number(where, "eps_clip_c", eps_clip_c, low=1.0, low_open=True)

    def per_token(*, log_ratio, adv, valid, **_):
        ratio = jax.lax.stop_gradient(jnp.exp(log_ratio))
        low = _frac(valid & (adv < 0) & (ratio < lo), ratio.dtype)
        high = _frac(valid & (adv > 0) & (ratio > hi), ratio.dtype)
        if c is None:
            dual = jnp.zeros_like(ratio)
        else:
            dual = _frac(valid & (adv < 0) & (ratio > c), ratio.dtype)
        terms = ppo_clip_terms(log_ratio, adv, ratio_low=lo, ratio_high=hi, dual_clip=c)
        return terms, {"clip_frac_low": low, "clip_frac_high": high, "dual_clip_frac": dual}

    return policy_term(
        name="dapo",
        kind="dapo",
        per_token=per_token,
        reduction=reduction,
        max_tokens=max_tokens,
        max_log_ratio=mlr,
        config=dict(clip_low_threshold=lo, clip_high_threshold=hi, eps_clip_c=c),
        correction=correction,
        twin=ppo_or_dapo_twin(lo, hi, c),
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
    correction: Any = None,
) -> Term:
    """CISPO: ``ℓ = -sg(clip(r, lo, hi))·A·p`` (MiniMax-M1, arXiv:2506.13585).

    The clipped ratio is a stop-gradient coefficient, so every token keeps the gradient
    ``-clip(r)·A·w`` (never zeroed). Bounds are given either absolutely
    (``clip_low_threshold``/``clip_high_threshold``, the Tinker/Fireworks ``cispo`` keys, default
    ``[0, 4]`` as in the Tinker tutorial) or as offsets (``clip_low``/``clip_high``: bounds
    ``[1 - clip_low, 1 + clip_high]``, the verl/SkyRL style, each defaulting to 0.2). Mixing the
    two styles raises. With ``reduction="token_sum"`` this is the built-in ``cispo`` kernel
    (documented).

    Args:
      clip_low_threshold: absolute lower bound ``∈ [0, 1]``.
      clip_high_threshold: absolute upper bound ``≥ 1``.
      clip_low: offset ``ε_lo ∈ [0, 1]``.
      clip_high: offset ``ε_hi ≥ 0``.
      reduction: one of ``losses.REDUCTIONS``.
      max_tokens: the ``seq_mean_token_sum_norm`` constant.
      max_log_ratio: clamp of ``p - q`` before ``exp``.
      correction: optional `losses.mismatch_correction`.

    Returns:
      A `Term`; ``config`` holds the absolute thresholds. Metrics add ``clip_frac`` (tokens
      whose coefficient was clipped).
    """
    where = "cispo"
    mlr = _common_args(where, reduction, max_tokens, max_log_ratio)
    lo, hi = ratio_bounds(
        where,
        clip_low_threshold=clip_low_threshold,
        clip_high_threshold=clip_high_threshold,
        clip_low=clip_low,
        clip_high=clip_high,
        default_thresholds=(0.0, 4.0),
        default_offsets=(0.2, 0.2),
    )

    def per_token(*, logprobs, log_ratio, adv, valid, **_):
        ratio = jax.lax.stop_gradient(jnp.exp(log_ratio))
        coef = jax.lax.stop_gradient(jnp.clip(ratio, lo, hi))
        clipped = _frac(valid & ((ratio < lo) | (ratio > hi)), ratio.dtype)
        return -coef * adv * logprobs, {"clip_frac": clipped}

    return policy_term(
        name="cispo",
        kind="cispo",
        per_token=per_token,
        reduction=reduction,
        max_tokens=max_tokens,
        max_log_ratio=mlr,
        config=dict(clip_low_threshold=lo, clip_high_threshold=hi),
        correction=correction,
        twin=Twin("cispo", dict(clip_low_threshold=lo, clip_high_threshold=hi)),
    )


def dro(
    *,
    beta: float = 0.05,
    reduction: str = "token_mean",
    max_tokens: float | None = None,
    correction: Any = None,
) -> Term:
    """DRO: ``ℓ = -(p·A - ½·β·(p - q)²)`` (Tinker/Fireworks built-in ``dro``, documented).

    The quadratic penalty keeps ``p`` near the anchor ``q = old_logprobs``; the gradient is
    ``-(A - β(p - q))·w``. The penalty applies at **every** action token, including those with
    ``A = 0`` (the Tinker kernel; the Fireworks cookbook's client gates it on ``A ≠ 0``, contrary
    to its own docstring). ``dro`` is not positively homogeneous in ``A``: folding a reduction's
    weights into the advantages does not scale the quadratic, and the built-in applies the
    quadratic at every *target* position (prompt included). `losses.builtin_twin` therefore maps
    ``dro`` to the kernel only for ``reduction="token_sum"``, and the kernel matches only when
    every target of the datums is an action token.

    Args:
      beta: β ≥ 0 (Tinker docs example 0.05).
      reduction: one of ``losses.REDUCTIONS``.
      max_tokens: the ``seq_mean_token_sum_norm`` constant.
      correction: optional `losses.mismatch_correction` (weights the whole ``ℓ``).

    Returns:
      A `Term`. Metrics add ``sq_dev`` (mean of ``(p - q)²``).
    """
    where = "dro"
    validate_reduction(reduction, max_tokens, where=where)
    b = check_number(where, "beta", beta, low=0.0)

    def per_token(*, logprobs, anchor, adv, **_):
        dev = logprobs - jax.lax.stop_gradient(anchor)
        return -(logprobs * adv - 0.5 * b * jnp.square(dev)), {"sq_dev": jnp.square(dev)}

    # DRO has no ratio hyperparameter; the ratio metrics use the default clamp.
    return policy_term(
        name="dro",
        kind="dro",
        per_token=per_token,
        reduction=reduction,
        max_tokens=max_tokens,
        max_log_ratio=None,
        config=dict(beta=b),
        correction=correction,
        # Not homogeneous in A: folding a mean reduction into A does not scale the quadratic.
        twin=Twin("dro", {"beta": b}, all_targets_actions=True)
        if reduction == "token_sum"
        else None,
    )


def reinforce(
    *,
    ratio_weight: bool = False,
    ratio_cap: float | None = None,
    kl_coef: float = 0.0,
    kl_estimator: str = "k3",
    reduction: str = "token_mean",
    max_tokens: float | None = None,
    max_log_ratio: float = 20.0,
    correction: Any = None,
    kl_score_function: bool = False,
    kl_importance_weight: bool = False,
) -> Term:
    """REINFORCE / GPG: ``ℓ = -sg(ω)·A·p`` (Williams 1992; verl ``gpg``).

    ``ω = 1`` by default; with ``ratio_weight=True`` it is the detached ratio ``r`` (truncated at
    ``ratio_cap`` when given): the verl ``bypass_mode`` + ``loss_type="reinforce"`` form. An
    optional KL penalty ``kl_coef·k(p, ref)`` has its true gradient in ``p`` (the Fireworks
    cookbook's REINFORCE detaches it, giving zero gradient). The policy gradient is
    ``-ω·A·w``. No Fireworks built-in twin: that kernel (``reinforce``) is undocumented.

    Args:
      ratio_weight: weight each token by ``sg(r)``.
      ratio_cap: truncate the weight at ``C > 0`` (needs ``ratio_weight=True``); None = no cap.
      kl_coef: β ≥ 0 of the KL penalty to ``batch.ref_logprobs``; 0 = off.
      kl_estimator: ``"k1"``, ``"k2"`` or ``"k3"`` (Schulman 2020).
      reduction: one of ``losses.REDUCTIONS``.
      max_tokens: the ``seq_mean_token_sum_norm`` constant.
      max_log_ratio: clamp of ``p - q`` and ``p - ref`` before ``exp``.
      correction: optional `losses.mismatch_correction` (weights the policy part only).
      kl_score_function: keep the estimator's value but give it the score-function gradient
        ``δ = p - ref`` (verl ``k1+``/``k3+``; with ``k1`` the unbiased score-function k1 form
        = k1 in the reward). See `losses.grpo` for the table of gradients.
      kl_importance_weight: multiply the KL estimate by ``r = exp(p - old)``, **not** detached
        (DeepSeek-V3.2, TRL ``use_bias_correction_kl``, slime ``--use-unbiased-kl``): with
        ``k3`` the gradient is ``r·δ``, unbiased for ``∇KL(p‖ref)`` on tokens from the anchor.

    Returns:
      A `Term`. Metrics add ``weight_mean`` (mean ``ω``) and, with KL, ``pg_loss``,
      ``kl_loss``, ``kl``.
    """
    where = "reinforce"
    mlr = _common_args(where, reduction, max_tokens, max_log_ratio)
    if not isinstance(ratio_weight, bool):
        raise ValueError(f"{where}: ratio_weight must be a bool, got {ratio_weight!r}")
    cap = None
    if ratio_cap is not None:
        if not ratio_weight:
            raise ValueError(f"{where}: ratio_cap needs ratio_weight=True")
        cap = check_number(where, "ratio_cap", ratio_cap, low=0.0, low_open=True)
    kl_coef = _kl_args(where, kl_coef, kl_estimator, kl_score_function, kl_importance_weight)

    def per_token(*, logprobs, log_ratio, adv, **_):
        if ratio_weight:
            omega = jax.lax.stop_gradient(jnp.exp(log_ratio))
            if cap is not None:
                omega = jnp.minimum(omega, cap)
        else:
            omega = jnp.ones_like(logprobs)
        return -omega * adv * logprobs, {"weight_mean": omega}

    return policy_term(
        name="reinforce",
        kind="reinforce",
        per_token=per_token,
        reduction=reduction,
        max_tokens=max_tokens,
        max_log_ratio=mlr,
        config=dict(
            ratio_weight=ratio_weight,
            ratio_cap=cap,
            kl_coef=kl_coef,
            kl_estimator=kl_estimator,
            kl_score_function=kl_score_function,
            kl_importance_weight=kl_importance_weight,
        ),
        correction=correction,
        kl_coef=kl_coef,
        kl_estimator=kl_estimator,
        kl_score_function=kl_score_function,
        kl_importance_weight=kl_importance_weight,
        # The Fireworks ``reinforce`` kernel (undocumented; the cookbook's client twin uses the
        # unclipped ratio to the datum's logprobs): exact for the ratio-weighted form.
        twin=Twin("reinforce", {}, provenance="undocumented")
        if ratio_weight and cap is None
        else None,
    )


def sapo(
    *,
    tau_pos: float = 1.0,
    tau_neg: float = 1.05,
    reduction: str = "seq_mean_token_mean",
    max_tokens: float | None = None,
    max_log_ratio: float = 20.0,
    correction: Any = None,
) -> Term:
    """SAPO (Soft Adaptive Policy Optimization): a soft gate instead of the hard clip.

    ``g(r; τ) = σ(τ·(r - 1))·4/τ`` with ``τ = tau_pos`` if ``A > 0`` else ``tau_neg``, and
    ``ℓ = -g(r; τ)·A`` (verl/SkyRL/TRL ``sapo``; docs/sources.md#the-policy-family). Since
    ``g'(1) = 1`` the on-policy gradient is the plain policy gradient ``-A·w``; away from
    ``r = 1`` the gradient ``-4σ(1-σ)·r·A·w`` decays smoothly instead of dropping to 0.

    Args:
      tau_pos: τ > 0 for positive advantages (default 1.0).
      tau_neg: τ > 0 for non-positive advantages (default 1.05).
      reduction: one of ``losses.REDUCTIONS`` (default ``seq_mean_token_mean``, as verl
        hard-codes and SkyRL recommends).
      max_tokens: the ``seq_mean_token_sum_norm`` constant.
      max_log_ratio: clamp of ``p - q`` before ``exp``.
      correction: optional `losses.mismatch_correction`.

    Returns:
      A `Term`. Metrics add ``gate_mean`` (mean ``g``).
    """
    where = "sapo"
    mlr = _common_args(where, reduction, max_tokens, max_log_ratio)
    tp = check_number(where, "tau_pos", tau_pos, low=0.0, low_open=True)
    tn = check_number(where, "tau_neg", tau_neg, low=0.0, low_open=True)

    def per_token(*, log_ratio, adv, **_):
        tau = jnp.where(adv > 0, tp, tn)
        gate = jax.nn.sigmoid(tau * (jnp.exp(log_ratio) - 1.0)) * (4.0 / tau)
        return -gate * adv, {"gate_mean": gate}

    return policy_term(
        name="sapo",
        kind="sapo",
        per_token=per_token,
        reduction=reduction,
        max_tokens=max_tokens,
        max_log_ratio=mlr,
        config=dict(tau_pos=tp, tau_neg=tn),
        correction=correction,
    )
